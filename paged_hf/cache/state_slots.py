"""State slot ids for hybrid models: one slot per running sequence, naming its state in every
stateful layer (the memory lives in paged_hf/execution/state_store.py).

There are as many slots as the engine runs sequences at most (``max_num_seqs``), and every running
sequence holds exactly one, so admission under ``max_num_seqs`` never waits for a slot. A slot is
taken when a sequence is admitted (or forked from its parent, whose state it then copies) and
given back when it finishes, is aborted, fails or is preempted; a preempted sequence recomputes
its state from its tokens, or gets it back from host memory with its KV (swap).
"""
from __future__ import annotations

from ..requests.request import Request


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}, must be >= 1")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._held)

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
        if slot is None:
            return
        if slot not in self._held:
            raise RuntimeError(f"request {req.request_id}: state slot {slot} given back twice")
        self._held.remove(slot)
        self._free.append(slot)
        req.state_slot = None
