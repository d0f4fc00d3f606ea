"""What the scheduler hands the step: who runs and how many tokens, and the data movement the
backend does first (copies, swaps, tier loads); and the step budget it plans within."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..requests.request import Request


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
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]  # in batch order: decodes, then prefill chunks
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the step
    # swap preemption, done by the backend before the step (swap-outs first: their blocks are free now)
    swap_out: list[tuple[Request, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[Request, list[int]]] = field(default_factory=list)
    # (blocks read from the disk tier, their pool pages), loaded before the step
    tier_loads: list[tuple[Any, list[int]]] = field(default_factory=list)
    # (src, dst) state slots before the step
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
