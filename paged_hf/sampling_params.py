"""Per-request sampling parameters (what to generate and how), validated at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature=0`` (the default) is greedy decoding.

    >>> SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, seed=1).is_greedy
    False
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob plus the top k
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self, who: str = "sampling params") -> None:
        def bad(name: str, value: Any, limit: str) -> ValueError:
            return ValueError(f"{who}: {name}={value!r}, must be {limit}")

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", self.max_new_tokens, "an integer >= 1")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise bad("min_new_tokens", self.min_new_tokens, f"an integer in [0, max_new_tokens={self.max_new_tokens}]")
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "a finite number >= 0")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0 (0 disables)")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "a finite number > 0")
        if not _is_int(self.n) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "None or an integer >= 0")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", self.seed, "None or an integer")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "non-negative token ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def with_(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)

    @classmethod
    def from_generation_config(cls, generation_config: Any, **overrides: Any) -> "SamplingParams":
        """Translate a transformers ``GenerationConfig`` (sampling fields only) into SamplingParams.

        Options with no equivalent here (beam search, assisted decoding, ...) are the caller's to reject;
        see ``paged_hf.hf_generate``.
        """
        gc = generation_config
        do_sample = bool(getattr(gc, "do_sample", False))
        kw: dict[str, Any] = {}
        if getattr(gc, "max_new_tokens", None) is not None:
            kw["max_new_tokens"] = gc.max_new_tokens
        if getattr(gc, "min_new_tokens", None):
            kw["min_new_tokens"] = gc.min_new_tokens
        if do_sample:
            kw["temperature"] = 1.0 if gc.temperature is None else float(gc.temperature)
            kw["top_k"] = int(gc.top_k or 0)
            kw["top_p"] = 1.0 if gc.top_p is None else float(gc.top_p)
            kw["min_p"] = float(getattr(gc, "min_p", None) or 0.0)
        if getattr(gc, "repetition_penalty", None) is not None:
            kw["repetition_penalty"] = float(gc.repetition_penalty)
        kw.update(overrides)
        names = {f.name for f in fields(cls)}
        unknown = set(kw) - names
        if unknown:
            raise TypeError(f"unknown SamplingParams fields: {sorted(unknown)}")
        return cls(**kw)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
