"""What the engine asks of a ``model.generate`` call whose callbacks need its rows in lock-step.

Callbacks written for transformers' loop (stopping criteria, logits processors, beam search) see
every row of their call at every step. The engine runs such a call's rows as requests beside
everything else; each row's ``Request.call`` is its call, and this protocol is all the engine knows
of it. The calls themselves are model-side code (paged_hf/model/lock_step_calls.py,
paged_hf/model/beam_call.py).

``Row`` is a request (paged_hf/requests/request.py): a type variable, so that this module stands
below the request that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

Row = TypeVar("Row")


@dataclass
class CallStep(Generic[Row]):
    """What a call decided for its rows, for the engine to apply. ``choose`` fills ``tokens``,
    ``continues`` and ``failed``; ``advance`` fills ``stopped`` and ``failed``."""

    tokens: dict[Row, int] = field(default_factory=dict)  # each row's token, where the call picks
    # (beam, the beam it continues): the beam takes that one's tokens and KV before its new token
    continues: list[tuple[Row, Row]] = field(default_factory=list)
    stopped: list[tuple[Row, str]] = field(default_factory=list)  # (row, its stop reason)
    failed: list[tuple[Row, str]] = field(default_factory=list)  # (row, why it fails)


class LockStepCall(Protocol[Row]):
    """One generate call's rows, moved on together; the engine's side of it."""

    def waits(self, row: Row) -> bool:
        """Whether ``row`` has what it needs for the call's next step and waits for the others:
        the scheduler gives it no tokens (and preempts it first: it is idle)."""
        ...

    def join_sample(self, parent: Row, k: int, child: Row) -> None:
        """Sample ``k`` of ``parent``'s ``n``, forked after the prompt, is a row of the call too."""
        ...

    def offer(self, row: Row, logits: torch.Tensor) -> bool:
        """Hand the call ``row``'s logits for the step; False where the call does not pick its rows'
        tokens (then the engine samples the row itself)."""
        ...

    def choose(self) -> CallStep[Row]:
        """The rows' tokens, once every row has offered its logits (else an empty step)."""
        ...

    def advance(self) -> CallStep[Row]:
        """After the step's tokens are recorded: the rows the call ends now."""
        ...
