"""Beam search as one ``generate`` call's group of rows, the beams, sharing their blocks.

Design notes: docs/internals.md, paged_hf/engine/beam_group.py.
"""

from __future__ import annotations

from typing import Any

import torch

from ..requests.request import Request
from ..requests.sampling_params import SamplingParams
from .call_group import Ending, JointCallGroup


class BeamCallGroup(JointCallGroup):
    """``search``: the model (its beam-search helpers); ``gc``: the call's generation config, its
    special tokens prepared. ``reassign(pairs)``: the engine's way to give each beam its parent's KV."""

    def __init__(
        self,
        rows: torch.Tensor,
        criteria: Any,
        processors: Any,
        search: Any,
        gc: Any,
        scores: bool,
        logits: bool,
        device: torch.device | None,
    ) -> None:
        self.num_beams, self.batch = gc.num_beams, rows.shape[0]
        pad = int(gc._pad_token_tensor) if gc._pad_token_tensor is not None else 0
        super().__init__(
            rows,
            self.num_beams,
            criteria,
            pad,
            True,
            gc.max_length - rows.shape[1],
            device,
            processors,
            bool(gc.do_sample),
            scores,
            logits,
        )
        self.search, self.gc = search, gc
        self.prompt_len = self.cur_len = rows.shape[1]
        dev = device or torch.device("cpu")
        eos = gc._eos_token_tensor
        self.beams_to_keep = max(2, 1 + (eos.shape[0] if eos is not None else 0)) * self.num_beams
        self.top_num_beam_mask = torch.arange(self.beams_to_keep, device=dev) < self.num_beams
        # transformers' fill value, as it reads
        fill = gc._pad_token_tensor or eos[0] if eos is not None else -1
        b, k = self.batch, self.num_beams
        self.running = torch.full((b, k, gc.max_length), int(fill), dtype=torch.int64, device=dev)
        self.running[:, :, : self.prompt_len] = rows.to(dev).unsqueeze(1)
        self.sequences = self.running.clone()
        self.running_scores = torch.zeros((b, k), device=dev)
        self.running_scores[:, 1:] = -1e9
        self.beam_scores = torch.full((b, k), -1e9, device=dev)
        self.finished = torch.zeros((b, k), dtype=torch.bool, device=dev)
        self.improvable = torch.ones((b, 1), dtype=torch.bool, device=dev)
        self.running_indices = torch.full(
            (b, k, gc.max_length - self.prompt_len), -1, dtype=torch.int32, device=dev
        )
        self.beam_indices = self.running_indices.clone()
        self.reassignments: list[
            tuple[Request, Request]
        ] = []  # (beam, the beam it continues), this step's

    def choose(self) -> dict[Request, int] | list[Ending]:
        """One iteration of transformers' beam search over the beams' logits: each beam's next
        token, and which beam it continues (``reassignments``)."""
        logits = self.take_offered(self.running.device)
        if logits is None:
            return {}
        s, cur = self.search, self.cur_len
        try:
            self._iterate(logits)
        except Exception as e:  # noqa: BLE001 - the caller's processor or criterion: its call ends
            return self._fail(e, "logits processors or stopping criteria")
        parents = s._flatten_beam_dim(self.running_indices[..., cur - self.prompt_len]).tolist()
        tokens = s._flatten_beam_dim(self.running[:, :, cur]).tolist()
        self.reassignments = [(self.members[j], self.members[p]) for j, p in enumerate(parents)]
        self.steps += 1
        return dict(zip(self.members, tokens))

    def _iterate(self, logits: torch.Tensor) -> None:
        """transformers' beam-search loop body (its GenerationMixin helpers), once."""
        s, gc, b, k, cur = self.search, self.gc, self.batch, self.num_beams, self.cur_len
        flat = s._flatten_beam_dim(self.running[:, :, :cur])
        log_probs = self.processors(flat, torch.log_softmax(logits, dim=-1))
        if self.logits is not None:
            self.logits += (logits.clone(),)
        if self.scores is not None:
            self.scores += (log_probs.clone(),)
        log_probs = (
            s._unflatten_beam_dim(log_probs, b, k) + self.running_scores[:, :, None]
        ).reshape(b, -1)
        top_lp, top_seq, top_idx = s._get_top_k_continuations(
            accumulated_log_probs=log_probs,
            running_sequences=self.running,
            running_beam_indices=self.running_indices,
            cur_len=cur,
            decoder_prompt_len=self.prompt_len,
            do_sample=self.do_sample,
            beams_to_keep=self.beams_to_keep,
            num_beams=k,
            batch_size=b,
        )
        hits = s._unflatten_beam_dim(
            self.criteria(s._flatten_beam_dim(top_seq[:, :, : cur + 1]), self.scores),
            b,
            self.beams_to_keep,
        )
        self.running, self.running_scores, self.running_indices = (
            s._get_running_beams_for_next_iteration(
                topk_log_probs=top_lp,
                topk_running_sequences=top_seq,
                topk_running_beam_indices=top_idx,
                next_token_hits_stopping_criteria=hits,
                num_beams=k,
            )
        )
        self.sequences, self.beam_scores, self.beam_indices, self.finished = (
            s._update_finished_beams(
                sequences=self.sequences,
                topk_running_sequences=top_seq,
                beam_scores=self.beam_scores,
                topk_log_probs=top_lp,
                beam_indices=self.beam_indices,
                topk_running_beam_indices=top_idx,
                is_early_stop_heuristic_unsatisfied=self.improvable,
                is_sent_finished=self.finished,
                next_token_hits_stopping_criteria=hits,
                top_num_beam_mask=self.top_num_beam_mask,
                num_beams=k,
                cur_len=cur,
                decoder_prompt_len=self.prompt_len,
                length_penalty=gc.length_penalty,
                early_stopping=gc.early_stopping,
            )
        )
        self.cur_len = cur + 1
        self._check_stop(hits)

    def _check_stop(self, hits: torch.Tensor) -> None:
        """transformers' early-stop heuristic, and whether the search is over."""
        s, gc = self.search, self.gc
        self.improvable = s._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=self.improvable,
            running_beam_scores=self.running_scores,
            beam_scores=self.beam_scores,
            is_sent_finished=self.finished,
            cur_len=self.cur_len,
            max_length=gc.max_length,
            decoder_prompt_len=self.prompt_len,
            early_stopping=gc.early_stopping,
            length_penalty=gc.length_penalty,
        )
        self.over = not bool(
            s._beam_search_has_unfinished_sequences(
                self.improvable, self.finished, hits, gc.early_stopping
            )
        )

    def result(self, num_return_sequences: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """transformers' output: the best ``num_return_sequences`` hypotheses per prompt, their
        scores and beam indices, cut to the longest."""
        s = self.search
        sequences = s._flatten_beam_dim(self.sequences[:, :num_return_sequences, :])
        scores = s._flatten_beam_dim(self.beam_scores[:, :num_return_sequences])
        indices = s._flatten_beam_dim(self.beam_indices[:, :num_return_sequences, :])
        longest = int(((indices + 1).bool()).sum(dim=1).max())
        return sequences[:, : self.prompt_len + longest], scores, indices[:, :longest]


def beam_search(
    engine: Any,
    prompts: list[Any],
    num_beams: int,
    max_new_tokens: int,
    num_return_sequences: int,
    length_penalty: float,
    early_stopping: bool | str,
    eos_token_ids: Any,
    logits_processors: Any,
) -> list[list[tuple[list[int], float]]]:
    """``Engine.beam_search``: the prompts' beams through the engine, the search transformers' own
    (the model's GenerationMixin helpers), its processors ``logits_processors`` on log-probabilities."""
    if engine.kv_manager.state is not None:
        raise NotImplementedError(
            "beam search on a model with recurrent / convolution state layers is not supported"
        )
    if not 1 <= num_return_sequences <= num_beams or num_beams < 2:
        raise ValueError(
            f"num_beams={num_beams} must be >= 2 and num_return_sequences={num_return_sequences} "
            "in [1, num_beams]"
        )
    ids = [engine._prompt_ids("beam search", p) for p in prompts]
    group, width = _search_group(
        engine,
        ids,
        num_beams,
        max_new_tokens,
        num_return_sequences,
        length_penalty,
        early_stopping,
        eos_token_ids,
        logits_processors,
    )
    params = SamplingParams(max_new_tokens=max_new_tokens, n=num_beams, ignore_eos=True)
    rids: list[str] = []
    try:
        for i, p in enumerate(ids):
            rids.append(engine.add_request(p, params, eos_token_ids=frozenset()))
            group.join(engine.requests[rids[-1]], i * num_beams)
        outputs = engine.run_until_done(rids)
    except BaseException:
        engine.abort_all(rids)
        raise
    if group.error is not None:
        raise group.error
    failed = [out.error for out in outputs if out.error is not None]
    if failed:
        raise RuntimeError(f"beam search failed: {failed[0]}")
    sequences, scores, indices = group.result(num_return_sequences)
    lengths = ((indices + 1).bool()).sum(dim=1).tolist()
    best = [
        (sequences[j, width : width + lengths[j]].tolist(), float(scores[j]))
        for j in range(sequences.shape[0])
    ]
    return [
        best[i * num_return_sequences : (i + 1) * num_return_sequences] for i in range(len(ids))
    ]


def _search_group(
    engine: Any,
    ids: list[list[int]],
    num_beams: int,
    max_new_tokens: int,
    num_return_sequences: int,
    length_penalty: float,
    early_stopping: bool | str,
    eos_token_ids: Any,
    logits_processors: Any,
) -> tuple[BeamCallGroup, int]:
    """The search's group over the prompts left-padded to one width, configured as transformers'
    generate would be; and that width."""
    from transformers import (
        EosTokenCriteria,
        GenerationConfig,
        LogitsProcessorList,
        MaxLengthCriteria,
        StoppingCriteriaList,
    )

    eos = sorted(engine.eos_token_ids if eos_token_ids is None else set(eos_token_ids))
    pad = eos[0] if eos else 0
    width = max(map(len, ids))
    rows = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
    gc = GenerationConfig(
        num_beams=num_beams,
        max_length=width + max_new_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=eos or None,
        pad_token_id=pad,
        num_return_sequences=num_return_sequences,
        do_sample=False,
    )
    engine.model._prepare_special_tokens(gc, True, device="cpu")
    criteria = StoppingCriteriaList(
        [MaxLengthCriteria(gc.max_length)]
        + ([EosTokenCriteria(gc._eos_token_tensor)] if eos else [])
    )
    group = BeamCallGroup(
        rows,
        criteria,
        LogitsProcessorList(list(logits_processors)),
        engine.model,
        gc,
        scores=False,
        logits=False,
        device=None,
    )
    return group, width
