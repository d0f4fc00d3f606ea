"""State slot ids for hybrid models (the memory lives in paged_hf/execution/state_store.py).

Two kinds of slot, numbered in one range:
- running slots, ``0 .. num_slots-1``: one per running sequence, naming its state in every stateful
  layer. There are as many as the engine runs sequences at most (``max_num_seqs``), so admission
  under ``max_num_seqs`` never waits for one. Taken when a sequence is admitted or forked (a
  forked sample copies its parent's state), given back when it finishes, is aborted, fails or is
  preempted (it then recomputes its state, or gets it back from host memory with its KV).
- checkpoint slots, after them: the state of some prefix at a block boundary, attached to the
  prefix-index node that ends there, so a later request with that prefix can start from it (KV
  alone would resume a recurrence mid-stream). A checkpoint is taken during a step (pending),
  attached to its node after the step, and dropped when its node's end is evicted or, least
  recently used first, when a new one needs its room.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ..requests.request import Request


class StateSlots:
    def __init__(self, num_slots: int, num_checkpoints: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}, must be >= 1")
        self.num_slots = num_slots
        self.num_checkpoints = num_checkpoints
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._held: set[int] = set()
        self._ckpt_free = list(range(num_slots + num_checkpoints - 1, num_slots - 1, -1))
        self._attached: OrderedDict[int, Any] = OrderedDict()  # checkpoint -> its node, least recently used first
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
        return len(self._held)

    @property
    def num_checkpoints_held(self) -> int:
        return len(self._attached)

    @property
    def num_pending(self) -> int:
        """Checkpoint slots taken for snapshots not attached yet (none between steps of a finished run)."""
        return len(self._pending)

    # ---- running slots -------------------------------------------------------------------
    def take(self, req: Request) -> int:
        """The request's slot, taken now if it holds none."""
        if req.state_slot is None:
            if not self._free:
                raise RuntimeError(f"request {req.request_id}: no free state slot ({self.num_slots} in use); "
                                   "the scheduler admits at most max_num_seqs sequences (this is a bug)")
            req.state_slot = self._free.pop()
            self._held.add(req.state_slot)
        return req.state_slot

    def give_back(self, req: Request) -> None:
        slot = req.state_slot
        if slot is not None:
            if slot not in self._held:
                raise RuntimeError(f"request {req.request_id}: state slot {slot} given back twice")
            self._held.remove(slot)
            self._free.append(slot)
            req.state_slot = None
        for _, ckpt in req.pending_checkpoints:
            self.release(ckpt)
        req.pending_checkpoints = []

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
