"""Speculative decoding by a draft model (transformers' ``assistant_model``), inside the batch.

The draft model runs in an engine of its own (its own paged KV pool and prefix index). Each step,
the decodes that ask (``num_assistant_tokens``) become that engine's requests at once: the row's
tokens as the prompt, greedy, as many new tokens as ``draft_room`` allows, and that engine runs
them to the end as one batch, whose tokens are the drafts the target's step verifies
(paged_hf/engine/speculation.py). Its prefix cache is what carries the draft's KV from one step to
the next: the blocks of a row's tokens it computed before are hits, so a step computes the tail
past the last whole block, and the proposal; KV of the tokens the target rejected stays under
their own keys, where no other sequence reads it (rolled back by content, not by count). A greedy
draft is a certain proposal, so the target's verification keeps its tokens exact (greedy) and its
distribution exact (sampled) whatever the draft proposes: a draft that fails, or stale weights,
cost speed only, never a token. So a failure of the draft engine ends no target request: the rows
it failed for decode without a draft.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Any

from ..requests.request import Request
from ..requests.sampling_params import SamplingParams
from .speculation import stop_ids

logger = logging.getLogger("paged_hf")

_RECENT_RUNS = 5  # draft runs whose step time ``step_s`` is the median of (one slow run, a
# weight repacking or a busy machine, must not stop drafting for good: nothing would re-measure)
EXPLORE_EVERY = 64
_DECAY = 0.98  # a step's weight in ``prior`` against the steps before it


class Drafter:
    """Proposals from a draft model's engine (an ``EngineCore`` over the draft model)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._recent: deque[float] = deque(maxlen=_RECENT_RUNS)  # seconds a draft step took
        self._taken, self._stops = 0.0, 0.0  # recent verifications' (decayed)
        self._priced = 0  # steps priced by the cost rule
        self.failures = 0  # draft runs that failed (their rows decoded without a draft)

    def propose(self, asks: list[tuple[Request, int]]) -> dict[Request, list[int]]:
        """Each asking request's draft of up to its number of tokens, cut before a token that would
        end it (EOS, a stop id); rows the draft engine refused or failed get none."""
        engine = self.engine
        asks = [(req, n) for req, n in asks if req.num_tokens + n <= engine.max_model_len]
        if not asks:
            return {}
        prompts = [list(req.token_ids) for req, _ in asks]
        params = [
            SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for _, n in asks
        ]
        start = time.perf_counter()
        try:
            outputs = engine.generate(prompts, params)
        except Exception as e:  # noqa: BLE001 - the draft costs speed only; the rows go on without
            self.failures += 1
            logger.warning(
                "paged_hf: the draft model failed (%s: %s); its rows decode without drafts",
                type(e).__name__,
                e,
            )
            return {}
        self._recent.append((time.perf_counter() - start) / max(n for _, n in asks))
        drafts: dict[Request, list[int]] = {}
        for (req, _), out in zip(asks, outputs):
            if out.error is not None:
                self.failures += 1
                continue
            stops = stop_ids(req)
            tokens = out.token_ids
            cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
            if cut:
                drafts[req] = tokens[:cut]
        return drafts

    def explores(self) -> bool:
        """Whether this step drafts untimed (one in ``EXPLORE_EVERY``): drafting priced out by a
        slow measurement would never measure again otherwise."""
        self._priced += 1
        return self._priced % EXPLORE_EVERY == 0

    def learn(self, taken: int, stops: int) -> None:
        """A step's verifications of this draft's tokens: those taken, and the drafts that
        stopped short (every row's, including rows that end there)."""
        self._taken = _DECAY * self._taken + taken
        self._stops = _DECAY * self._stops + stops

    @property
    def prior(self) -> float:
        """The chance a draft token is taken, from recent verifications (a geometric chain's
        estimate, from one of each before any): a new row's odds before its own record."""
        return (self._taken + 1) / (self._taken + self._stops + 2)

    @property
    def step_s(self) -> float:
        """What a draft run's step took (the median of recent runs'; 0 before any)."""
        return statistics.median(self._recent) if self._recent else 0.0

    def step_cost(self, rows: int) -> float | None:
        """What one more draft token costs a step of ``rows`` decodes: a decode step of the draft
        at that many rows, from the draft engine's own step-time fit (its runs' fixed costs, a
        prompt's tail to compute, are not a token's); the recent runs' step time before that
        fit; None before the draft has run (the cost rule then drafts untimed)."""
        fitted = self.engine.scheduler.step_time.predict(rows, 0)
        if fitted is not None:
            return fitted
        return self.step_s or None

    def stats(self) -> dict[str, Any]:
        """The draft runs' median step time, the odds a draft token is taken, the failed runs, and
        the draft engine's own counters."""
        inner = self.engine.stats()
        return {
            "step_s": self.step_s,
            "acceptance": self.prior,
            "failures": self.failures,
            "prefix_hit_tokens": inner["prefix_hit_tokens"],
            "prefill_tokens_computed": inner["prefill_tokens_computed"],
            "steps": inner["steps"],
        }
