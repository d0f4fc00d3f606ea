"""The scheduler's part in speculative decoding: a decode scheduled with its draft
(paged_hf/engine/speculation.py), and the draft model's proposals for a step's decodes.

Design notes: docs/speculative.md, paged_hf/engine/draft_scheduling.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..requests.request import Request
from .schedule_output import Budget, SchedulerOutput
from .speculation import DraftCosts, draft_costs, draft_for, draft_room

if TYPE_CHECKING:
    from ..cache.block_manager import BlockManager


SURE_DRAFT = 64  # the longest draft the step's first check prices


class DraftSchedulingMixin:
    """Drafts into the step's plan: what fits, cut to the budget, never preempting anyone."""

    kv_manager: BlockManager
    speculates: bool
    drafter: Any  # paged_hf/engine/draft_model.py's Drafter, or None
    _draft_costs: DraftCosts | None
    _decode_rows: int
    _proposals: dict[Request, list[int]]
    draft_seconds: float  # this step's time in the draft model (apart from its step-time fit)
    clock: Any
    step_time: Any  # this engine's StepTimeModel

    def _schedule_draft(
        self, req: Request, out: SchedulerOutput, chosen: dict[Request, int], budget: Budget
    ) -> bool:
        """A decode with its draft (paged_hf/engine/speculation.py) where it proposes one and its
        slots fit without preempting anyone; else (False) it decodes as any other."""
        p = req.params
        if not (p.prompt_lookup_num_tokens or p.num_assistant_tokens):  # most rows: the hot path
            return False
        if p.num_assistant_tokens:  # proposed for the step's decodes at once, cut to the budget
            req.draft = self._proposals.pop(req, [])[: budget.tokens - 1]
        else:
            costs, rows = self._draft_costs, self._decode_rows
            req.draft = draft_for(req, budget.tokens, costs, rows) if self.speculates else []
        n = 1 + len(req.draft)
        if n == 1 or not self.kv_manager.allocate_slots(req, n, out.block_copies):
            req.draft = []
            return False
        chosen[req] = n
        budget.tokens -= n
        return True

    def _propose_drafts(self, decodes: list[Request], budget: Budget) -> dict[Request, list[int]]:
        """The draft model's proposals for this step's decodes that ask (one batched run of it),
        each as long as ``draft_room`` allows with every decode's own token counted first: its
        tokens priced with a draft step's cost (untimed until the draft has run), at odds from
        the row's record, before any from the recent verifications' (the drafter's ``prior``)."""
        drafter, rows = self.drafter, len(decodes)
        asking = [req for req in decodes if req.params.num_assistant_tokens]
        if not asking:
            return {}
        step_s = drafter.step_cost(rows)
        costs = None if step_s is None else draft_costs(self.step_time.coef, rows, step_s)
        if costs is not None and drafter.explores():
            costs = None  # now and then untimed: costs measured on a busy machine do not stick
        elif costs is not None and costs.best_length(1.0, SURE_DRAFT, drafted=True) == 0:
            return {}  # not even a draft sure to be taken pays this step: no row's does
        room = budget.tokens - rows + 1  # what a decode's draft may take beside the other decodes
        asks = [
            (req, n)
            for req in asking
            if (n := draft_room(req, room, costs, rows, drafter.prior)) > 0
        ]
        if not asks:
            return {}
        start = self.clock()
        drafts = drafter.propose(asks)
        self.draft_seconds = self.clock() - start  # the draft's steps are not this step's time
        return drafts
