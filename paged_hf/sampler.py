"""Next-token choice for a batch of logits rows, each with its own SamplingParams.

Order follows transformers' logits processors: repetition penalty, min-new-tokens EOS ban,
temperature, top-k, top-p, min-p. Each sampling request draws from its own torch.Generator,
so a seeded request picks the same tokens alone or in any batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[tuple[float, dict[int, float]] | None]  # (chosen, top-k) per row, when asked


def sample(logits: torch.Tensor, requests: list[Request]) -> SampleResult:
    """logits: [B, V] (one row per request, any dtype) -> one token per request."""
    logits = logits.float()
    raw = logits
    logits = logits.clone()
    for row, req in enumerate(requests):
        p = req.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.token_ids)), device=logits.device)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals < 0, vals * p.repetition_penalty, vals / p.repetition_penalty)
        if req.num_output_tokens < p.min_new_tokens:
            banned = [t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
                      if t < logits.shape[1]]
            if banned:
                logits[row, banned] = float("-inf")

    tokens = logits.argmax(dim=-1)
    sampling_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
    if sampling_rows:
        idx = torch.tensor(sampling_rows, device=logits.device)
        temps = torch.tensor([requests[i].params.temperature for i in sampling_rows], device=logits.device)
        probs = _filtered_probs(logits[idx] / temps[:, None], [requests[i] for i in sampling_rows])
        for j, i in enumerate(sampling_rows):
            # exponential race (Gumbel-max): argmax p / E with E ~ Exp(1) samples from p
            noise = torch.empty_like(probs[j]).exponential_(generator=requests[i].generator)
            noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # 0/0 would be NaN, and argmax picks NaN
            tokens[i] = torch.argmax(probs[j] / noise)
    token_list = tokens.tolist()

    logprobs: list = [None] * len(requests)
    if any(r.params.logprobs is not None for r in requests):
        lp = torch.log_softmax(raw, dim=-1)
        for i, r in enumerate(requests):
            k = r.params.logprobs
            if k is None:
                continue
            top = torch.topk(lp[i], k) if k > 0 else None
            logprobs[i] = (float(lp[i, token_list[i]]),
                           {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist())))
    return SampleResult(token_list, logprobs)


def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    for row, req in enumerate(requests):
        k = req.params.top_k
        if 0 < k < logits.shape[1]:
            kth = torch.topk(logits[row], k).values[-1]
            logits[row] = logits[row].masked_fill(logits[row] < kth, float("-inf"))
    top_p = torch.tensor([r.params.top_p for r in requests], device=logits.device)
    if (top_p < 1).any():
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - top_p)[:, None]
        remove_sorted[:, -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([r.params.min_p for r in requests], device=logits.device)
    if (min_p > 0).any():
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
