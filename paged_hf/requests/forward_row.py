"""What a step's forward reads of one scheduled request, as plain data.

Under tensor parallelism one rank (the leader) schedules and samples; the others run the same
forwards without the requests themselves (paged_hf/engine/ranks.py). The leader sends each of
them a ``ForwardRow`` per scheduled request: the step's tokens, the block tables, where the
logits and scored rows fall. The runner builds its metadata from these exactly as from the
requests (paged_hf/execution/metadata.py reads the same attributes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request


@dataclass(frozen=True)
class _Flags:
    output_hidden_states: bool


class _Window:
    """A request's token ids where only the step's positions are known: ``[start, start + n)``."""

    __slots__ = ("start", "ids")

    def __init__(self, start: int, ids: list[int]) -> None:
        self.start, self.ids = start, ids

    def __getitem__(self, part: slice) -> list[int]:
        lo, hi = part.start - self.start, part.stop - self.start
        if part.step is not None or lo < 0 or hi > len(self.ids):
            raise IndexError(f"positions {part.start}..{part.stop} are outside the step's tokens")
        return self.ids[lo:hi]


@dataclass(eq=False)  # rows are told apart by identity, as requests are
class ForwardRow:
    request_id: str
    num_computed_tokens: int
    num_tokens: int
    tokens: list[int]  # the step's tokens: positions [num_computed_tokens, + len(tokens))
    block_tables: list[list[int]]
    prefill_only: bool
    scored: tuple[int, int]  # score_rows' answer for the step's positions
    score_start: int
    output_hidden_states: bool
    draft: list[int]  # the leader's proposal this step, verified after its pending token

    @classmethod
    def of(cls, req: Request, n: int) -> ForwardRow:
        start = req.num_computed_tokens
        return cls(
            req.request_id,
            start,
            req.num_tokens,
            req.step_ids(start, start + n),
            [list(table) for table in req.block_tables],
            req.prefill_only,
            req.score_rows(start, start + n),
            req.score_start,
            bool(req.params.output_hidden_states),
            list(req.draft) if start + n > req.num_tokens else [],
        )

    # ---- the attributes the runner reads of a Request ---------------------------------------
    @property
    def token_ids(self) -> _Window:
        return _Window(self.num_computed_tokens, self.tokens)

    def step_ids(self, start: int, end: int) -> list[int]:
        return self.token_ids[start:end]

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]

    @property
    def params(self) -> _Flags:
        return _Flags(self.output_hidden_states)

    prompt_embeds = None  # refused under tensor parallelism (paged_hf/engine/ranks.py)
    state_slot = None  # stateful (hybrid) models too
    pending_checkpoints: tuple = ()

    def score_rows(self, start: int, end: int) -> tuple[int, int]:
        assert (start, end) == (
            self.num_computed_tokens,
            self.num_computed_tokens + len(self.tokens),
        )
        return self.scored
