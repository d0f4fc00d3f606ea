"""The "priority" scheduling policy: waiting requests in order of (priority, arrival), lower first.

A request that does not fit lets a bounded number of those behind it go first, and displaces
running requests of a strictly higher number (recompute or swap, as the preemption mode says).
Equal priorities never displace each other, and a preempted request keeps its arrival, so two
requests never take turns preempting each other. Aging: a request ``aging_s`` past its arrival
competes as priority 0, in admission and displacement alike (a priority only falls with time, so
aging cannot start a cycle of displacements either).
"""

from __future__ import annotations

from ..requests.request import FinishReason, Request
from .schedule_output import Budget, SchedulerOutput
from .scheduler import Scheduler, _held
from .sibling_prefill import blocks_in_flight


class PriorityScheduler(Scheduler):
    def __init__(self, *args, lookahead: int = 8, aging_s: float | None = 60.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lookahead = lookahead  # waiting requests passed over for lack of room, at most, a step
        self.aging_s = aging_s
        self._deferred: list[Request] = []  # running prefills that go after the waiting requests

    def urgency(self, req: Request, now: float) -> int:
        """The priority ``req`` competes with now: its own, or 0 once aged."""
        priority = req.params.priority
        if self.aging_s is not None and now - req.arrival_time >= self.aging_s:
            priority = min(priority, 0)
        return priority

    def rank(self, req: Request, now: float) -> tuple[int, float]:
        """Admission order: (urgency, arrival)."""
        return self.urgency(req, now), req.arrival_time

    def _first_to_give_up(self, reqs: list[Request], now: float | None = None) -> Request:
        """The least urgent: the highest urgency number; among equals the latest to arrive, then
        the latest listed."""
        now = self.clock() if now is None else now
        return max(
            enumerate(reqs), key=lambda ir: (self.urgency(ir[1], now), ir[1].arrival_time, ir[0])
        )[1]

    def _make_room(self, req: Request) -> None:
        """The queue is full: shed the least urgent waiting request if ``req`` is more urgent."""
        now = self.clock()
        waiting = [r for r in self.waiting if not r.admitted_once]  # preempted ones keep theirs
        last = self._first_to_give_up(waiting, now) if waiting else None
        if last is None or self.urgency(last, now) <= self.urgency(req, now):
            super()._make_room(req)
        self.waiting.remove(last)
        last.error = (
            f"request {last.request_id}: refused, the waiting queue is full "
            f"(max_waiting={self.max_waiting}) and request {req.request_id} is more urgent"
        )
        self.finish(last, FinishReason.ERROR, now)
        self.shed.append(last)

    def _schedule_running(
        self, out: SchedulerOutput, chosen: dict[Request, int], budget: Budget
    ) -> None:
        """Decodes, then the running prefills at least as urgent as the most urgent waiting
        request, most urgent first; the others wait for what the waiting requests leave
        (``_schedule_waiting``), so a long batch prompt does not take an urgent one's prefill room."""
        now = self.clock()
        waiting = [self.urgency(r, now) for r in self.waiting if not _held(r)]
        best = min(waiting, default=None)
        decodes = [r for r in self.running if r.num_pending_tokens == 1]
        prefills = sorted(
            (r for r in self.running if r.num_pending_tokens > 1),
            key=lambda r: self.urgency(r, now),
        )
        # prefills are sorted by urgency: the deferred ones are a tail
        first = next(
            (i for i, r in enumerate(prefills) if best is not None and self.urgency(r, now) > best),
            len(prefills),
        )
        self._deferred = prefills[first:]
        self._run_rows(decodes + prefills[:first], out, chosen, budget)

    def _schedule_waiting(
        self, out: SchedulerOutput, chosen: dict[Request, int], budget: Budget
    ) -> None:
        self._admit_waiting(out, chosen, budget)
        # deferred prefills take what is left; they preempt nobody (the step's plan is set)
        deferred, self._deferred = self._deferred, []
        self._run_rows(deferred, out, chosen, budget, may_preempt=False)

    def _admit_waiting(
        self, out: SchedulerOutput, chosen: dict[Request, int], budget: Budget
    ) -> None:
        pending = blocks_in_flight(self.kv_manager, chosen)
        if budget.prefill_room is None:
            budget.prefill_room = self._prefill_room(budget.tokens, chosen)
        # requests preempted for blocks this step wait; only more urgent ones may take their room
        preempted = set(out.preempted)
        now = self.clock()
        floor = min((self.urgency(r, now) for r in preempted), default=None)
        candidates = sorted(
            (r for r in self.waiting if r not in preempted), key=lambda r: self.rank(r, now)
        )
        kept = [r for r in self.waiting if r in preempted]
        self.waiting.clear()  # victims preempted below queue here, not reconsidered this step
        admitted: set[Request] = set()
        passed_over = 0
        for i, req in enumerate(candidates):
            if min(budget.tokens, budget.prefill_room) <= 0 or passed_over > self.lookahead:
                kept += candidates[i:]
                break
            if _held(req) or (floor is not None and self.urgency(req, now) >= floor):
                kept.append(req)
                continue
            verdict = self._admit_displacing(req, out, chosen, budget, pending, admitted)
            if verdict == "admitted":
                admitted.add(req)
                continue
            kept.append(req)
            if verdict != "sibling":
                passed_over += 1
        self.waiting.extend(kept)

    def _admit_displacing(
        self,
        req: Request,
        out: SchedulerOutput,
        chosen: dict[Request, int],
        budget: Budget,
        pending: set,
        admitted: set[Request],
    ) -> str:
        """Admit ``req``, preempting less urgent running requests while the sequence cap or the
        blocks stand in its way: "admitted", "sibling", "no seats" or "no blocks"."""
        while self.num_running_seqs() + req.seqs_when_running > self.max_num_seqs:
            if not self._displace(req, out, chosen, budget, admitted):
                return "no seats"
        while True:
            verdict = self._try_admit(req, out, chosen, budget, pending)
            if verdict != "no blocks":
                return verdict
            if not self._displace(req, out, chosen, budget, admitted):
                # rows that wait on it hold the blocks it needs
                if not chosen and self._preempt_held(out):
                    continue
                return verdict

    def _displace(
        self,
        req: Request,
        out: SchedulerOutput,
        chosen: dict[Request, int],
        budget: Budget,
        admitted: set[Request],
    ) -> bool:
        """Preempt the least urgent running request if it is strictly less urgent than ``req``
        (never one admitted this step: its swap-in or first chunk is already planned)."""
        now = self.clock()
        urgency = self.urgency(req, now)
        victims = [r for r in self.running if self.urgency(r, now) > urgency and r not in admitted]
        if not victims:
            return False
        self._preempt_scheduled(self._first_to_give_up(victims, now), out, chosen, budget)
        return True
