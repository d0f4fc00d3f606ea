"""The scheduler's queues: requests in (the fit check, the queue bound and whom it sheds), and
the changes a step makes to them afterwards (tokens computed and sampled, samples forked, beams
reassigned, requests finished) or, interrupted, undoes. ``QueuesMixin`` is a part of
``Scheduler`` (paged_hf/engine/scheduler.py); what it reads of it, it declares.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from ..cache.block_manager import BlockManager
from ..requests.request import FinishReason, Request, RequestStatus
from .schedule_output import QueueFull, SchedulerOutput
from .scheduling_policy import Fcfs


class QueuesMixin:
    kv_manager: BlockManager
    policy: Fcfs
    waiting: deque[Request]
    running: list[Request]
    max_num_seqs: int
    max_waiting: int | None
    shed: list[Request]
    clock: Callable[[], float]

    # ---- submission ----------------------------------------------------------------------
    def check_fits(self, req: Request) -> None:
        """A request that could never fit the whole pool alone is refused up front."""
        if req.seqs_when_running > self.max_num_seqs:
            # it would wait at the head of the queue forever, and block everything behind it
            raise ValueError(
                f"request {req.request_id}: n={req.params.n} parallel samples exceed "
                f"max_num_seqs={self.max_num_seqs}"
            )
        longest = (
            req.num_prompt_tokens
            if req.prefill_only
            else min(req.num_prompt_tokens + req.params.max_new_tokens, req.max_model_len)
        )
        need = self.kv_manager.most_blocks(longest)
        if need > self.kv_manager.num_blocks:
            what = f"prompt ({req.num_prompt_tokens})" + (
                "" if req.prefill_only else f" + max_new_tokens ({req.params.max_new_tokens})"
            )
            raise ValueError(
                f"request {req.request_id}: {what} needs {need} KV blocks, the pool has "
                f"{self.kv_manager.num_blocks} of {self.kv_manager.block_size} tokens"
            )

    def add(self, req: Request) -> None:
        self.check_fits(req)
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            self._make_room(req)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def _make_room(self, req: Request) -> None:
        """The queue is full: the policy may shed a less urgent waiting request, else ``req`` is
        refused."""
        now = self.clock()
        last = self.policy.to_shed(req, self.waiting, now)
        if last is None:
            raise QueueFull(
                f"request {req.request_id}: refused, {len(self.waiting)} requests are waiting "
                f"(max_waiting={self.max_waiting})"
            )
        self.waiting.remove(last)
        last.error = (
            f"request {last.request_id}: refused, the waiting queue is full "
            f"(max_waiting={self.max_waiting}) and request {req.request_id} is more urgent"
        )
        self.finish(last, FinishReason.ERROR, now)
        self.shed.append(last)

    def take_shed(self) -> list[Request]:
        """Waiting requests refused since the last call (finished with their error)."""
        shed, self.shed = self.shed, []
        return shed

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_seqs(self) -> int:
        return sum(r.seqs_when_running for r in self.running)

    # ---- after the model ran ---------------------------------------------------------------
    def mark_computed(self, out: SchedulerOutput) -> None:
        for req, n in out.scheduled:
            req.num_computed_tokens += n

    def fork(self, parent: Request, children: list[Request]) -> None:
        """Parallel sampling: children share every block of a parent whose prompt is done."""
        pos = self.running.index(parent) + 1
        for child in children:
            self.kv_manager.fork(parent, child)
            child.status = RequestStatus.RUNNING
            child.admitted_once = True
        self.running[pos:pos] = children
        parent.children = list(children)
        parent.forked = True

    def reassign(self, pairs: list[tuple[Request, Request]]) -> None:
        """Beam search: each ``(beam, parent)`` pair's beam continues its parent's sequence: its tokens,
        and its KV where both run (else the beam recomputes it when next scheduled)."""
        moved = [(beam, parent) for beam, parent in pairs if beam is not parent]
        tokens = {id(parent): list(parent.token_ids) for _, parent in moved}
        both = [
            (b, p)
            for b, p in moved
            if b.status is RequestStatus.RUNNING and p.status is RequestStatus.RUNNING
        ]
        self.kv_manager.reassign(both)
        for beam, parent in moved:
            if beam.status is RequestStatus.RUNNING and (beam, parent) not in both:
                # its parent was preempted: it computes the parent's KV again
                self.kv_manager.free(beam)
            beam.swapped_tokens, beam.swap_handle = 0, None
            beam.token_ids = list(tokens[id(parent)])

    def update(
        self, out: SchedulerOutput, sampled: dict[Request, int], now: float
    ) -> list[Request]:
        """Record this step's sampled tokens, cache newly full blocks, release finished requests."""
        finished = [req for req, token in sampled.items() if req.append_token(token, now)]
        for req in self.running:
            self.kv_manager.cache_full_blocks(req)
        for req in finished:
            self.finish(req, req.finish_reason, now)
        return finished

    def finish(self, req: Request, reason: FinishReason, now: float) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv_manager.free(req)
        req.swapped_tokens, req.swap_handle, req.swapped_state = 0, None, None
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = now

    # ---- undoing a step that did not complete ----------------------------------------------
    def requeue(self, reqs: list[Request]) -> None:
        """Forget the KV of ``reqs`` (running requests) and queue them first, in their order:
        they recompute it when readmitted, as after a recompute preemption, with their tokens as
        they were. Undoes an interrupted step."""
        for req in reversed(reqs):
            if req.status is not RequestStatus.RUNNING:
                continue
            self.running.remove(req)
            self.kv_manager.free(req)
            req.swapped_tokens, req.swap_handle, req.swapped_state = 0, None, None
            req.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(req)

    def unfork(self, parent: Request) -> None:
        """Undo ``fork``: the samples disappear (they have no tokens yet) and fork again later."""
        for child in parent.children:
            if child.status is RequestStatus.RUNNING:
                self.running.remove(child)
            self.kv_manager.free(child)
        parent.children = []
        parent.forked = False
