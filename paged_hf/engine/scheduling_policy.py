"""Who goes first: the scheduling policy, as data the scheduler's one loop reads.

fcfs is the priority policy with one level and no lookahead: its queue is the arrival order, a
request that does not fit stops the queue, nothing displaces anything, and the latest admitted
gives way first. "priority" orders waiting requests by (priority, arrival), lower first; a request
that does not fit lets up to ``lookahead`` of those behind it go first, and displaces running
requests of a strictly higher number. Equal priorities never displace each other, and a preempted
request keeps its arrival, so two requests never take turns preempting each other. Aging: a request
``aging_s`` past its arrival competes as priority 0, in admission and displacement alike (a
priority only falls with time, so aging cannot start a cycle of displacements either).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from ..requests.request import Request


class Fcfs:
    """First come, first served."""

    lookahead = 0  # a request that does not fit stops the queue
    displaces = False  # a waiting request never preempts a running one

    def urgency(self, req: Request, now: float) -> int:
        return 0

    def admission_order(self, waiting: deque[Request], now: float) -> deque[Request]:
        """The queue as it stands (requeued requests at its head)."""
        return waiting

    def most_urgent_waiting(self, waiting: Iterable[Request], now: float) -> int | None:
        """None: no running prefill ever waits for a waiting request."""
        return None

    def first_to_give_up(self, reqs: list[Request], now: float) -> Request:
        """The latest admitted (``running`` is in admission order)."""
        return reqs[-1]

    def to_shed(self, req: Request, waiting: Iterable[Request], now: float) -> Request | None:
        """A full queue refuses the newcomer: nothing waiting is shed for it."""
        return None


class Priority(Fcfs):
    """Lower ``SamplingParams.priority`` first, then arrival."""

    displaces = True

    def __init__(self, lookahead: int = 8, aging_s: float | None = 60.0) -> None:
        self.lookahead = lookahead  # waiting requests passed over for lack of room, at most, a step
        self.aging_s = aging_s

    def urgency(self, req: Request, now: float) -> int:
        """The priority ``req`` competes with now: its own, or 0 once aged."""
        priority = req.params.priority
        if self.aging_s is not None and now - req.arrival_time >= self.aging_s:
            priority = min(priority, 0)
        return priority

    def admission_order(self, waiting: deque[Request], now: float) -> deque[Request]:
        """(urgency, arrival), ties in queue order."""
        return deque(sorted(waiting, key=lambda r: (self.urgency(r, now), r.arrival_time)))

    def most_urgent_waiting(self, waiting: Iterable[Request], now: float) -> int | None:
        return min((self.urgency(r, now) for r in waiting), default=None)

    def first_to_give_up(self, reqs: list[Request], now: float) -> Request:
        """The least urgent: the highest urgency number; among equals the latest to arrive, then
        the latest listed."""
        return max(
            enumerate(reqs), key=lambda ir: (self.urgency(ir[1], now), ir[1].arrival_time, ir[0])
        )[1]

    def to_shed(self, req: Request, waiting: Iterable[Request], now: float) -> Request | None:
        """The least urgent waiting request never admitted (preempted ones keep their place), if
        ``req`` is more urgent."""
        fresh = [r for r in waiting if not r.admitted_once]
        last = self.first_to_give_up(fresh, now) if fresh else None
        if last is None or self.urgency(last, now) <= self.urgency(req, now):
            return None
        return last


def make_policy(name: str, lookahead: int = 8, aging_s: float | None = 60.0) -> Fcfs:
    if name == "fcfs":
        return Fcfs()
    if name == "priority":
        return Priority(lookahead, aging_s)
    raise ValueError(f"scheduling_policy={name!r}: 'fcfs' or 'priority'")
