"""What a finished request returns."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    logprobs: list | None = None  # per token: (chosen logprob, {token: logprob} top-k)
    error: str | None = None  # why this sample failed (finish_reason "error")
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS or other)


@dataclass
class RequestOutput:
    """One prompt's result. With ``n > 1`` the samples are in ``completions``; the shortcuts
    (``token_ids``, ``text``, ``finish_reason``) read the first."""

    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)
    ttft: float | None = None     # seconds from arrival to first token
    latency: float | None = None  # seconds from arrival to finish
    num_cached_tokens: int = 0    # prompt tokens served from the prefix cache
    error: str | None = None      # set when the request was refused or failed; the others still ran
    # with SamplingParams(prompt_logprobs=k): None for the first prompt token, then per token
    # (its logprob, {token: logprob} of the k most likely)
    prompt_logprobs: list | None = None

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
