"""What cached KV depends on besides tokens, and the checks that keep the cache honest.

KV in the prefix cache was computed by particular weights through paged attention. An optimizer
step, ``load_state_dict`` or a swapped-in parameter makes it stale; ``unpatch`` or
``set_attn_implementation`` means the engine no longer drives the attention it writes KV with.
The engine checks both before every step: a weight change resets the prefix cache (new requests
never read the old KV), a lost patch stops the engine with an error (``binding.check_still_patched``).
"""
from __future__ import annotations

import time

import torch


class WeightsWatch:
    """Tells whether a model's weights changed since it last looked: a parameter or buffer written
    in place (its version counter moves: optimizer steps, ``load_state_dict``, ``copy_``) or given
    new storage (``.data =``, ``.to()``), or a tensor replaced by another. Not seen: in-place
    writes through ``.data`` (``p.data.copy_(w)``), which leave the counter alone, and in-place
    writes to inference tensors (weights created under ``torch.inference_mode``), which have none.

    Reading the version counters of a known list of tensors costs ~45 us for SmolLM2's 274;
    finding the tensors (walking the modules) ~0.7 ms, so that is done on ``rescan`` (the engine
    asks at the start of every generate call) and at most once per ``RESCAN_S`` otherwise.
    """

    RESCAN_S = 1.0

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._rescan()
        self._version = self._read()

    def changed(self, rescan: bool = False) -> bool:
        if rescan or time.perf_counter() - self._scanned_at > self.RESCAN_S:
            self._rescan()
        version = self._read()
        if version == self._version:
            return False
        self._version = version
        return True

    def _rescan(self) -> None:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        # inference tensors (made under torch.inference_mode) keep no version counter: for them
        # only new storage is seen
        self._counted = [t for t in tensors if not t.is_inference()]
        self._uncounted = [t for t in tensors if t.is_inference()]
        self._scanned_at = time.perf_counter()

    def _read(self) -> tuple:
        return (tuple((t.data_ptr(), t._version) for t in self._counted),
                tuple(t.data_ptr() for t in self._uncounted))
