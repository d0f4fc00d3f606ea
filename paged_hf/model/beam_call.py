"""Beam search as one ``generate`` call whose rows, the beams, share their blocks: each step
transformers' own beam search over the beams' logits (a ``LockStepCall``,
paged_hf/requests/lock_step_call.py).

Design notes: docs/internals.md, paged_hf/model/beam_call.py.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    EosTokenCriteria,
    GenerationConfig,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
)
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput

from ..requests.lock_step_call import CallStep
from ..requests.request import Request
from .call_rows import CallRows, PicksTokens


class BeamCall(PicksTokens):
    """``prompts``: ``[batch, width]`` as the caller padded them; ``criteria`` / ``processors``:
    transformers' lists for the call; ``search``: the model (its beam-search helpers); ``gc``: the
    call's generation config, its special tokens prepared. Its rows follow from ``gc``:
    ``num_beams`` per prompt, room for ``max_length``, pad for finished beams."""

    def __init__(
        self,
        prompts: torch.Tensor,
        criteria: Any,
        processors: Any,
        search: Any,
        gc: Any,
        scores: bool,
        logits: bool,
        device: torch.device | None,
    ) -> None:
        self.num_beams, self.batch = gc.num_beams, prompts.shape[0]
        pad = int(gc._pad_token_tensor) if gc._pad_token_tensor is not None else 0
        room = gc.max_length - prompts.shape[1]
        self.rows = CallRows(prompts, self.num_beams, room, pad, True, device)
        self.criteria, self.processors, self.search, self.gc = criteria, processors, search, gc
        self.do_sample = bool(gc.do_sample)
        self.scores: tuple | None = () if scores else None
        self.logits: tuple | None = () if logits else None
        self.prompt_len = self.cur_len = prompts.shape[1]
        dev = device or torch.device("cpu")
        eos = gc._eos_token_tensor
        self.beams_to_keep = max(2, 1 + (eos.shape[0] if eos is not None else 0)) * self.num_beams
        self.top_num_beam_mask = torch.arange(self.beams_to_keep, device=dev) < self.num_beams
        # transformers' fill value, as it reads
        fill = gc._pad_token_tensor or eos[0] if eos is not None else -1
        b, k = self.batch, self.num_beams
        self.running = torch.full((b, k, gc.max_length), int(fill), dtype=torch.int64, device=dev)
        self.running[:, :, : self.prompt_len] = prompts.to(dev).unsqueeze(1)
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

    def choose(self) -> CallStep[Request]:
        """One iteration of transformers' beam search over the beams' logits: each beam's next
        token, and which beam it continues."""
        rows = self.rows
        logits = rows.take_offered(self.running.device)
        if logits is None:
            return CallStep()
        s, cur = self.search, self.cur_len
        try:
            self._iterate(logits)
        except Exception as e:  # noqa: BLE001 - the caller's processor or criterion: its call ends
            return rows.fail(e, "logits processors or stopping criteria")
        parents = s._flatten_beam_dim(self.running_indices[..., cur - self.prompt_len]).tolist()
        tokens = s._flatten_beam_dim(self.running[:, :, cur]).tolist()
        rows.steps += 1
        return CallStep(
            tokens=dict(zip(rows.members, tokens)),
            continues=[(rows.members[j], rows.members[p]) for j, p in enumerate(parents)],
        )

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
        self.rows.over = not bool(
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

    def output(self, gc: Any) -> torch.Tensor | GenerateBeamDecoderOnlyOutput:
        """``generate``'s result: transformers' best hypotheses, as a tensor or its output dict."""
        sequences, scores, indices = self.result(gc.num_return_sequences or 1)
        if gc.return_dict_in_generate:
            return GenerateBeamDecoderOnlyOutput(
                sequences=sequences,
                sequences_scores=scores if gc.output_scores else None,
                scores=self.scores,
                logits=self.logits,
                beam_indices=indices,
            )
        return sequences

    def best(self, num_return_sequences: int) -> list[list[tuple[list[int], float]]]:
        """``Engine.beam_search``'s result: per prompt, the best hypotheses' tokens past the prompt
        (to their end) and scores, best first."""
        sequences, scores, indices = self.result(num_return_sequences)
        lengths = ((indices + 1).bool()).sum(dim=1).tolist()
        width = self.prompt_len
        best = [
            (sequences[j, width : width + lengths[j]].tolist(), float(scores[j]))
            for j in range(sequences.shape[0])
        ]
        return [
            best[i * num_return_sequences : (i + 1) * num_return_sequences]
            for i in range(self.batch)
        ]


def search_call(
    model: Any,
    ids: list[list[int]],
    num_beams: int,
    max_new_tokens: int,
    num_return_sequences: int,
    length_penalty: float,
    early_stopping: bool | str,
    eos: list[int],
    logits_processors: Any,
) -> BeamCall:
    """``Engine.beam_search``'s call over the prompts ``ids`` left-padded to one width (with the
    first of ``eos``, else 0), configured as transformers' generate would be."""
    pad = eos[0] if eos else 0
    width = max(map(len, ids))
    prompts = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
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
    model._prepare_special_tokens(gc, True, device="cpu")
    criteria = StoppingCriteriaList(
        [MaxLengthCriteria(gc.max_length)]
        + ([EosTokenCriteria(gc._eos_token_tensor)] if eos else [])
    )
    processors = LogitsProcessorList(list(logits_processors))
    return BeamCall(
        prompts, criteria, processors, model, gc, scores=False, logits=False, device=None
    )
