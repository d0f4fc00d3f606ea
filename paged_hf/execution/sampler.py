"""Next-token choice for a batch of logits rows, each with its own SamplingParams.

Design notes: docs/internals.md, paged_hf/execution/sampler.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..requests.request import Request
from . import random_streams
from .cpu import greedy as cpu_greedy


@dataclass
class SampleResult:
    tokens: list[int | None]  # None where the row failed
    logprobs: list[tuple[float, dict[int, float]] | None]  # (chosen, top-k) per row, when asked
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it has no token


def sample(
    logits: torch.Tensor, requests: list[Request], mask: Callable | None = None
) -> SampleResult:
    """logits: [B, V] (one row per request, any dtype) -> one token per request. ``mask(logits,
    errors)``: structured outputs' grammar masks, applied after the per-request processors."""
    if mask is None and all(_plain_greedy(r) for r in requests):
        fast = _greedy_as_they_are(logits)
        if fast is not None:
            return fast
    logits = logits.float()
    raw = logits
    logits = logits.clone()
    errors: dict[int, str] = {}
    for row, req in enumerate(requests):
        try:
            _prepare_row(logits, row, req)
        except Exception as e:  # noqa: BLE001 - whatever it was, it is this row's alone
            errors[row] = f"sampling failed: {type(e).__name__}: {e}"
    if mask is not None:
        mask(logits, errors)

    # max gives the greedy choice and, in the same pass, rows with NaN / +inf (max propagates them)
    # or nothing left to pick (all -inf)
    best, tokens = _row_max(logits)
    sampling_rows = [
        i for i, r in enumerate(requests) if not r.params.is_greedy and i not in errors
    ]
    processed: dict[int, torch.Tensor] = {}  # row -> log-probabilities it was drawn from
    if sampling_rows:
        drawn = _draw_rows(logits, requests, sampling_rows, errors)
        if drawn is not None:
            rows, picks, probs = drawn
            tokens[torch.tensor(rows, device=logits.device)] = picks
            for j, i in enumerate(rows):
                if (
                    requests[i].params.processed_logprobs
                    and requests[i].params.logprobs is not None
                ):
                    processed[i] = probs[j].log()
    token_list = _picked(best, tokens, errors)
    logprobs = _logprobs(raw, logits, requests, token_list, processed, errors)
    return SampleResult(token_list, logprobs, errors)


def _logprobs(
    raw: torch.Tensor,
    logits: torch.Tensor,
    requests: list[Request],
    token_list: list[int | None],
    processed: dict[int, torch.Tensor],
    errors: dict[int, str],
) -> list:
    """Each row's (chosen token's logprob, top-k) where it asked: from the model's own
    distribution, or with ``processed_logprobs`` the one it was drawn from. A row whose
    logprobs fail ends without a token (``errors``)."""
    logprobs: list = [None] * len(requests)
    if not any(r.params.logprobs is not None for r in requests):
        return logprobs
    lp = torch.log_softmax(raw, dim=-1)
    for i, r in enumerate(requests):
        k = r.params.logprobs
        if k is None or token_list[i] is None:
            continue
        try:
            row_lp = processed.get(i)
            # greedy rows' processed distribution: their masked, penalised logits
            if row_lp is None:
                row_lp = (
                    torch.log_softmax(logits[i], dim=-1) if r.params.processed_logprobs else lp[i]
                )
            top = torch.topk(row_lp, k) if k > 0 else None
            logprobs[i] = (
                float(row_lp[token_list[i]]),
                {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist())),
            )
        except Exception as e:  # noqa: BLE001
            errors[i] = f"logprobs failed: {type(e).__name__}: {e}"
            token_list[i] = None
    return logprobs


def _plain_greedy(req: Request) -> bool:
    """Greedy, no logprobs, and no processor that would change its row this step."""
    p = req.params
    if (
        not p.is_greedy
        or p.logprobs is not None
        or p.repetition_penalty != 1.0
        or p.encoder_repetition_penalty != 1.0
        or p.suppress_tokens
        or p.logits_processors
    ):
        return False
    if p.begin_suppress_tokens and req.num_output_tokens == 0:
        return False
    if req.num_output_tokens < p.min_new_tokens and (
        p.stop_token_ids or not p.ignore_eos and req.eos_token_ids
    ):
        return False
    return True


def _greedy_as_they_are(logits: torch.Tensor) -> SampleResult | None:
    """Every row greedy and unprocessed: each row's first maximum, read from the logits as they are
    (the same tokens as the full path's fp32 copy gives: bf16 values are exact in fp32); None where the
    C++ op does not serve these logits."""
    picked = cpu_greedy.greedy_max(logits)
    if picked is None:
        return None
    best, tokens = picked
    errors: dict[int, str] = {}
    token_list = _picked(best, tokens, errors)
    return SampleResult(token_list, [None] * len(token_list), errors)


def _picked(best: torch.Tensor, tokens: torch.Tensor, errors: dict[int, str]) -> list[int | None]:
    """The rows' tokens, None for a row with an error or whose maximum ``best`` is not finite (NaN and
    +inf propagate through max; -inf: nothing left to pick), which becomes its error. The maxima are
    read as numbers: torch.isfinite's ops on a few values cost ~80 us a step."""
    token_list: list[int | None] = tokens.tolist()
    for row, value in enumerate(best.tolist()):
        if row in errors:
            token_list[row] = None
        elif not math.isfinite(value):
            errors[row] = "its logits are not finite (NaN or inf), or every token was excluded"
            token_list[row] = None
    return token_list


def _row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum (NaN where the row holds one) and its first index: ``logits.max(dim=-1)``,
    on a CPU through ``paged_hf::greedy_max`` where the extension is built (a tenth of the time)."""
    picked = cpu_greedy.greedy_max(logits) if logits.dtype == torch.float32 else None
    if picked is not None:
        return picked
    return logits.max(dim=-1)


def _prepare_row(logits: torch.Tensor, row: int, req: Request) -> None:
    """The per-request processors, in place on ``logits[row]``: the penalties, EOS ban, suppressed tokens."""
    p = req.params
    # transformers' EncoderRepetitionPenaltyLogitsProcessor: by 1 / penalty
    if p.encoder_repetition_penalty != 1.0:
        ids = req.encoder_token_ids if req.encoder_token_ids is not None else req.prompt_ids
        _penalise(logits, row, ids, 1 / p.encoder_repetition_penalty)
    if p.repetition_penalty != 1.0:
        _penalise(logits, row, req.token_ids, p.repetition_penalty)
    if req.num_output_tokens < p.min_new_tokens:
        banned = [
            t
            for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
            if t < logits.shape[1]
        ]
        if banned:
            logits[row, banned] = float("-inf")
    suppressed = list(p.suppress_tokens) + (
        list(p.begin_suppress_tokens) if req.num_output_tokens == 0 else []
    )
    suppressed = [t for t in suppressed if t < logits.shape[1]]
    if suppressed:
        logits[row, suppressed] = float("-inf")
    # the caller's, after the built-in ones (transformers' order)
    for processor in p.logits_processors:
        out = processor(list(req.token_ids), logits[row])
        if not isinstance(out, torch.Tensor) or out.shape != logits[row].shape:
            raise ValueError(
                f"logits processor {getattr(processor, '__name__', processor)!r} returned "
                f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}, not a tensor of shape "
                f"{tuple(logits[row].shape)}"
            )
        logits[row] = out


def _penalise(logits: torch.Tensor, row: int, ids: Sequence[int], factor: float) -> None:
    """transformers' repetition-penalty arithmetic on ``logits[row]`` at ``ids``: a logit below 0
    times ``factor``, any other divided by it."""
    seen = torch.tensor(sorted(set(ids)), device=logits.device)
    vals = logits[row, seen]
    logits[row, seen] = torch.where(vals < 0, vals * factor, vals / factor)


def _draw_rows(
    logits: torch.Tensor, requests: list[Request], rows: list[int], errors: dict[int, str]
) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
    """Sampled tokens of ``rows`` (those still drawn, their picks, and the probabilities drawn from). Filtering runs batched; if
    that raises, row by row, so only the row at fault fails. Generators advance only in the
    draw itself, after filtering, so a failed row never shifts another row's seeded draw."""

    def probs_of(idx: list[int]) -> torch.Tensor:
        sel = torch.tensor(idx, device=logits.device)
        return drawn_probs(logits[sel], [requests[i] for i in idx])

    try:
        probs = probs_of(rows)
    except Exception:  # noqa: BLE001 - find the row(s) at fault
        parts, kept = [], []
        for i in rows:
            try:
                parts.append(probs_of([i]))
                kept.append(i)
            except Exception as e:  # noqa: BLE001
                errors[i] = f"sampling failed: {type(e).__name__}: {e}"
        if not kept:
            return None
        rows, probs = kept, torch.cat(parts)
    return rows, _inverse_cdf_draw(probs, _row_uniforms(requests, rows, probs.device)), probs


def _row_uniforms(requests: list[Request], rows: list[int], device: torch.device) -> torch.Tensor:
    """Each row's uniform: its request's stream at the index of the token it draws (the outputs so
    far, plus its place among the request's rows before it in this step: a speculative step
    verifies k draft positions and the one after as consecutive rows). A request made outside an
    engine may have no seed: such rows share one draw from torch's default generator."""
    seen: dict[int, int] = {}
    offsets = []
    for i, req in enumerate(requests):
        offsets.append(seen.get(id(req), 0))
        seen[id(req)] = offsets[-1] + 1
    u = torch.empty(len(rows), dtype=torch.float32)
    unseeded = [j for j, i in enumerate(rows) if requests[i].seed is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded))
    seeded = [(j, i) for j, i in enumerate(rows) if requests[i].seed is not None]
    if seeded:
        keys = [(requests[i].seed, requests[i].num_output_tokens + offsets[i]) for _, i in seeded]
        u[[j for j, _ in seeded]] = random_streams.uniforms(keys)
    return u.to(device)


def drawn_probs(logits: torch.Tensor, requests: list[Any]) -> torch.Tensor:
    """The distribution each row is drawn from: its processed logits (``[B, V]``, float) through
    temperature, top-k, top-p and min-p, as transformers' warpers apply them."""
    temps = torch.tensor([r.params.temperature for r in requests], device=logits.device)
    return _filtered_probs(logits / temps[:, None], requests)


def _inverse_cdf_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` from its uniform ``u`` in [0, 1). (A Gumbel/exponential race
    needs a random number per vocabulary entry: 63 ms for 64 x 49k rows on this CPU, against
    ~3 ms for the cumulative sum.)"""
    u = u.to(probs.dtype)
    cdf = probs.cumsum(dim=-1)
    # first index whose cumulative sum exceeds u * total: a zero-probability token never qualifies,
    # as its cumulative sum equals its predecessor's
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(
        max=probs.shape[1] - 1
    )
    # u * total can round up to total itself (p ~ 2**-24); never let that pick a filtered token
    zero = probs.gather(1, picks[:, None])[:, 0] == 0
    return torch.where(zero, probs.argmax(dim=-1), picks)


def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    for row, req in enumerate(requests):
        k = req.params.top_k
        if 0 < k < logits.shape[1]:
            kth = torch.topk(logits[row], k).values[-1]
            logits[row] = logits[row].masked_fill(logits[row] < kth, float("-inf"))
    # which filters apply is read from the params on the host: a test on device values waits for the device
    top_ps = [r.params.top_p for r in requests]
    if any(p < 1 for p in top_ps):
        top_p = torch.tensor(top_ps, device=logits.device)
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - top_p)[:, None]
        remove_sorted[:, -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    probs = logits.softmax(dim=-1)
    min_ps = [r.params.min_p for r in requests]
    if any(p > 0 for p in min_ps):
        min_p = torch.tensor(min_ps, device=logits.device)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
