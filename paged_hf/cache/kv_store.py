"""``KVStore``: what a tier under the prefix cache keeps KV records in and answers, whatever holds
them (host memory: paged_hf/cache/host_kv_store.py; a directory: disk_kv_store.py). A record is one
contiguous CPU tensor of a few blocks' KV; its key, a 32-byte digest (paged_hf/cache/stable_keys.py),
already says which model, geometry, salt and tokens, so a store never interprets it. The tiers
(paged_hf/engine/kv_tiers.py) ask ``contains`` at lookup (no read) and ``get_into`` at load.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVStore(Protocol):
    name: str  # the tier's entry in the engine's stats: "host", "disk"

    def contains(self, key: bytes) -> bool:
        """Holds a record of ``key`` (no read of it: it may still turn out bad)."""
        ...

    def get_into(self, key: bytes, out: torch.Tensor) -> bool:
        """Read ``key``'s record into ``out`` (contiguous, CPU, the record's size); True on a good
        one. False: none, or a bad one (dropped); ``out`` may then hold anything."""
        ...

    def put(self, key: bytes, payload: torch.Tensor, owned: bool = False) -> None:
        """Keep a copy of ``payload`` (``owned``: the caller hands over a CPU tensor nobody writes
        again); nothing to do where the key is held. May drop it (a bound)."""
        ...

    def flush(self, timeout: float | None = None) -> None:
        """Return once every ``put`` so far is kept (or dropped)."""
        ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, int]:
        """The store's own counters (hits, misses, bytes, ...)."""
        ...
