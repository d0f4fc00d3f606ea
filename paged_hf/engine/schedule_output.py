"""What the scheduler hands the step: who runs and how many tokens, and the data movement the
backend does first (copies, swaps, tier loads); and the step budget it plans within."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..requests.request import Request

if TYPE_CHECKING:
    from .kv_tiers import TierMatch


class QueueFull(RuntimeError):
    """The engine's waiting queue holds ``max_waiting`` requests: this one was refused (retry later,
    or shed the load)."""


@dataclass
class Budget:
    """What is left of a step's token budget, and of its room for prefill tokens (set once the
    decodes are placed)."""

    tokens: int
    prefill_room: int | None = None


@dataclass
class TierLoad:
    """Blocks an admission's tier lookup found (not read yet), for the step to read into ``pages``,
    the request's pool pages of them, before its forward; ``first_admission``: they count in the
    request's ``num_cached_tokens``."""

    req: Request
    match: TierMatch
    pages: list[int]
    first_admission: bool


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]  # in batch order: decodes, then prefill chunks
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the step
    # swap preemption, done by the backend before the step (swap-outs first: their blocks are free now)
    swap_out: list[tuple[Request, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[Request, list[int]]] = field(default_factory=list)
    # records of the tiers under the prefix cache, read into pool pages before the step
    tier_loads: list[TierLoad] = field(default_factory=list)
    # (src, dst) state slots before the step
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
