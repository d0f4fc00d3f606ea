"""What a finished request returns, and how the engine assembles it from the request's state
(completions, text cut at a stop string, logprobs).

``OutputsMixin`` is a part of ``EngineCore`` (paged_hf/engine/core.py); what it reads of the
engine it declares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..requests.request import FinishReason, Request
from . import latency_stats
from .scoring import ScoreOutput, prompt_logprobs_output, score_output


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    logprobs: list | None = None  # per token: (chosen logprob, {token: logprob} top-k)
    error: str | None = None  # why this sample failed (finish_reason "error")
    # the stop string or stop token id that ended it (None: EOS or other)
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """One prompt's result. With ``n > 1`` the samples are in ``completions``; the shortcuts
    (``token_ids``, ``text``, ``finish_reason``) read the first."""

    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)
    ttft: float | None = None  # seconds from arrival to first token
    latency: float | None = None  # seconds from arrival to finish
    queued_s: float | None = None  # seconds from arrival to its first step
    # (latency - ttft) / (tokens - 1), vLLM's time per output token; None below two tokens
    tpot: float | None = None
    max_itl: float | None = None  # the longest gap between two of its tokens (seconds)
    preemptions: int = 0  # times it (any of its samples) was preempted
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when the request was refused or failed; the others still ran
    # speculative decoding (prompt_lookup_num_tokens): draft tokens verified, and those accepted
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    # with SamplingParams(prompt_logprobs=k): None for the first prompt token, then per token
    # (its logprob, {token: logprob} of the k most likely)
    prompt_logprobs: list | None = None
    # SamplingParams.output_hidden_states: [layers + 1, positions, hidden], the prompt's positions
    # and each generated token's but the last
    hidden_states: torch.Tensor | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids if self.completions else []

    @property
    def text(self) -> str | None:
        return self.completions[0].text if self.completions else None

    @property
    def finish_reason(self) -> str | None:
        if self.error is not None:
            return "error"
        return self.completions[0].finish_reason if self.completions else None


class OutputsMixin:
    """A finished request's output, assembled from its state."""

    tokenizer: Any
    requests: dict[str, Request]
    _stats: Any  # EngineStats

    def _collect_root(self, root: Request) -> RequestOutput:
        if self.requests.get(root.request_id) is root:
            del self.requests[root.request_id]
        if not root.prefill_only and root.samples_finished:
            self._stats.finished_log.append(latency_stats.record(root))
        return self.make_output(root)

    def collect(self, group: list[Request]) -> RequestOutput:
        """The output of a finished request (given as any of its samples), releasing it from
        ``requests``."""
        root = group[0].parent or group[0]
        return self._collect_root(root)

    def make_output(
        self, root: Request, samples: list[Request] | None = None
    ) -> RequestOutput | ScoreOutput:
        if root.prefill_only:
            return score_output(root)
        samples = root.samples if samples is None else sorted(samples, key=lambda r: r.sample_index)
        completions = [self._completion(r) for r in samples]
        last = max((r.finish_time or 0.0) for r in samples)
        first = min(
            (r.first_token_time for r in samples if r.first_token_time is not None), default=None
        )
        error = next((c.error for c in completions if c.error is not None), None)
        row = latency_stats.record(root)
        return RequestOutput(
            root.request_id,
            list(root.prompt_ids),
            completions,
            ttft=None if first is None else first - root.arrival_time,
            latency=last - root.arrival_time if last else None,
            num_cached_tokens=root.num_cached_tokens,
            queued_s=row["queued_s"],
            tpot=row["tpot"],
            max_itl=row["max_itl"] if first is not None else None,
            preemptions=row["preemptions"],
            error=error,
            draft_tokens_proposed=root.draft_proposed,
            draft_tokens_accepted=root.draft_accepted,
            prompt_logprobs=prompt_logprobs_output(root),
            hidden_states=torch.cat(root.hidden_states, dim=1) if root.hidden_states else None,
        )

    def _completion(self, r: Request) -> Completion:
        reason, error, text = r.finish_reason, r.error, None
        try:
            # cut at the stop string, or the whole output decoded at once
            text = (
                r.stop_strings.text
                if r.stop_strings is not None and r.stop_strings.hit is not None
                else self.decode(r.output_ids)
            )
        except Exception as e:  # noqa: BLE001 - a tokenizer failing on these ids fails this request alone
            reason = FinishReason.ERROR
            error = (
                error
                or f"request {r.request_id}: detokenizing its output failed: {type(e).__name__}: {e}"
            )
        return Completion(
            list(r.output_ids),
            reason.value if reason else None,
            text,
            list(r.logprobs) if r.params.logprobs is not None else None,
            error,
            r.stop_reason,
        )

    def decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
