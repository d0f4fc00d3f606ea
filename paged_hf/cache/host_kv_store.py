"""KV block records in host memory, least recently used first out beyond a byte bound: the tier
between the device's pool and the disk (pinned on CUDA, so copies to and from the device run
asynchronously). A ``KVStore`` (paged_hf/cache/kv_store.py), as the disk's is; in-process only.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostKVStore:
    name = "host"

    def __init__(self, max_bytes: int, pin: bool = False) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes}, must be > 0")
        self.max_bytes = int(max_bytes)
        self.pin = pin
        self._records: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.nbytes = 0
        self.counts = dict.fromkeys(
            ("hits", "misses", "bytes_read", "bytes_written", "records_written", "evicted_records"),
            0,
        )

    def contains(self, key: bytes) -> bool:
        return key in self._records

    def get_into(self, key: bytes, out: torch.Tensor) -> bool:
        record = self._records.get(key)
        if record is None or record.shape != out.shape:
            self.counts["misses"] += 1
            return False
        self._records.move_to_end(key)
        out.copy_(record)
        self.counts["hits"] += 1
        self.counts["bytes_read"] += record.nbytes
        return True

    def put(self, key: bytes, payload: torch.Tensor, owned: bool = False) -> None:
        """Keep a copy of ``payload`` (``owned``: the caller hands it over, kept as it is unless it
        must be pinned); the least recently used records go to make room."""
        if key in self._records:
            self._records.move_to_end(key)
            return
        if payload.nbytes > self.max_bytes:
            return
        while self.nbytes + payload.nbytes > self.max_bytes:
            _, old = self._records.popitem(last=False)
            self.nbytes -= old.nbytes
            self.counts["evicted_records"] += 1
        # a view of a larger tensor would keep all of it alive, beyond the bound
        whole = payload.untyped_storage().nbytes() == payload.nbytes
        if owned and whole and not self.pin and payload.device.type == "cpu":
            self._records[key] = payload
        else:
            copy = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=self.pin)
            self._records[key] = copy.copy_(payload)
        self.nbytes += payload.nbytes
        self.counts["bytes_written"] += payload.nbytes
        self.counts["records_written"] += 1

    def flush(self, timeout: float | None = None) -> None:
        """Nothing is queued: every put is done when it returns."""

    def close(self) -> None:
        self._records.clear()
        self.nbytes = 0

    def stats(self) -> dict[str, int]:
        return dict(self.counts, records=len(self._records), bytes=self.nbytes)
