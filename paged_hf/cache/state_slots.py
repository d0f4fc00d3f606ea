"""State slot ids for hybrid models (the memory lives in paged_hf/execution/state_store.py).

Design notes: docs/internals.md, paged_hf/cache/state_slots.py.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any

from ..requests.request import Request


class StateSlots:
    def __init__(self, num_slots: int, num_checkpoints: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}, must be >= 1")
        self.num_slots = num_slots
        self.num_checkpoints = num_checkpoints
        # a heap: the lowest first, so running slots stay near the front
        self._free = list(range(num_slots))
        self._owner: dict[int, Request] = {}  # running slot -> the request holding it
        self._ckpt_free = list(range(num_slots + num_checkpoints - 1, num_slots - 1, -1))
        # checkpoint -> its node, least recently used first
        self._attached: OrderedDict[int, Any] = OrderedDict()
        self._pending: set[int] = set()  # taken during a step, not attached yet
        self.checkpoint_hits = 0

    @property
    def total(self) -> int:
        return self.num_slots + self.num_checkpoints

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    @property
    def num_checkpoints_held(self) -> int:
        return len(self._attached)

    def stats(self, states: Any, asleep: bool) -> dict[str, int]:
        """The engine's stats of the slots, and the bytes of ``states`` (their memory) unless
        the engine sleeps."""
        return {
            "state_slots": self.num_slots,
            "state_slots_used": self.num_used,
            "state_checkpoints": self.num_checkpoints_held,
            "state_checkpoint_hits": self.checkpoint_hits,
            "state_bytes": 0 if asleep else states.nbytes,
        }

    @property
    def num_pending(self) -> int:
        """Checkpoint slots taken for snapshots not attached yet (none between steps of a finished run)."""
        return len(self._pending)

    # ---- running slots -------------------------------------------------------------------
    def take(self, req: Request) -> int:
        """The request's slot, taken now if it holds none."""
        if req.state_slot is None:
            if not self._free:
                raise RuntimeError(
                    f"request {req.request_id}: no free state slot ({self.num_slots} in use); "
                    "the scheduler admits at most max_num_seqs sequences (this is a bug)"
                )
            req.state_slot = heapq.heappop(self._free)
            self._owner[req.state_slot] = req
        return req.state_slot

    def give_back(self, req: Request) -> None:
        slot = req.state_slot
        if slot is not None:
            if self._owner.get(slot) is not req:
                raise RuntimeError(f"request {req.request_id}: state slot {slot} given back twice")
            del self._owner[slot]
            heapq.heappush(self._free, slot)
            req.state_slot = None
        for _, ckpt in req.pending_checkpoints:
            self.release(ckpt)
        req.pending_checkpoints = []

    def plan_front(self, reqs: list[Request]) -> list[tuple[Request, int]]:
        """New slots that put ``reqs`` (the step's decode batch) in slots ``0 .. len(reqs)-1``, so
        the mixers read and update their states in place rather than gathering and scattering
        them every step: (request, new slot) for each request that moves, the decode batch's and
        the running requests they swap with. Nothing changes until ``renumber`` applies it, after
        the states' memory has moved the same way."""
        front = len(reqs)
        outside = [r for r in reqs if r.state_slot >= front]
        if not outside:
            return []
        inside = {r.state_slot for r in reqs}
        holes = [s for s in range(front) if s not in inside]
        moves = []
        for req, hole in zip(outside, holes):
            moves.append((req, hole))
            other = self._owner.get(hole)
            if other is not None:  # a running request not decoding this step takes the place left
                moves.append((other, req.state_slot))
        return moves

    def renumber(self, moves: list[tuple[Request, int]]) -> None:
        """Apply ``plan_front``'s moves (the states' memory already moved the same way)."""
        old = {req.state_slot for req, _ in moves}
        new = {slot for _, slot in moves}
        for req, _ in moves:
            del self._owner[req.state_slot]
        for req, slot in moves:
            req.state_slot = slot
            self._owner[slot] = req
        self._free = sorted((set(self._free) - new) | (old - new))
        heapq.heapify(self._free)

    # ---- checkpoints ---------------------------------------------------------------------
    def take_checkpoint(self) -> int | None:
        """A checkpoint slot for a snapshot this step takes: a free one, else the least recently
        used one detached from its node; None when every one is pending."""
        if not self._ckpt_free:
            if not self._attached:
                return None
            slot, node = self._attached.popitem(last=False)
            node.state = None
            self._ckpt_free.append(slot)
        slot = self._ckpt_free.pop()
        self._pending.add(slot)
        return slot

    def attach(self, slot: int, node: Any) -> bool:
        """After the step: the snapshot in ``slot`` is the state at ``node``'s end. False (and the
        slot released) when the node has a checkpoint already."""
        self._pending.discard(slot)
        if node.state is not None:
            self._ckpt_free.append(slot)
            return False
        node.state = slot
        self._attached[slot] = node
        return True

    def hit(self, slot: int) -> None:
        self._attached.move_to_end(slot)
        self.checkpoint_hits += 1

    def release(self, slot: int) -> None:
        """A pending snapshot that will not be attached (its request ended, or its step failed)."""
        if slot in self._pending:
            self._pending.remove(slot)
            self._ckpt_free.append(slot)

    def dropped(self, slot: int) -> None:
        """The prefix index let go of the node holding this checkpoint."""
        if self._attached.pop(slot, None) is not None:
            self._ckpt_free.append(slot)
