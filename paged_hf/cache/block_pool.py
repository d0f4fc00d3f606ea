"""Physical KV blocks: ids, refcounts, the free list, and eviction of cached-but-unused blocks.

Design notes: docs/internals.md, paged_hf/cache/block_pool.py.
"""

from __future__ import annotations

from typing import Iterable

from .prefix_index import RadixPrefixIndex


class BlockPool:
    def __init__(
        self, num_blocks: int, block_size: int, index: RadixPrefixIndex | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}, must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}, must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.index = index
        self.refcount = [0] * num_blocks
        # a stack: a freed block is the next one handed out, so a run keeps writing the pages it
        # has touched (warm in cache, and on a CPU no fresh page of the pool faulted in:
        # execution/cpu/kv_memory.py); the lowest ids go first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks
        self.evictions = 0
        # told of blocks evicted (before anything overwrites them) and of every block freed:
        # a write-on-eviction tier (paged_hf/engine/kv_tiers.py)
        self.listener = None
        # references beyond each block's first: the blocks that sharing (parallel samples, beams, a
        # prefix two requests hold) saves, each of which would otherwise be a copy
        self.shared_refs = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Cached blocks nobody uses (evictable)."""
        return self.index.evictable_blocks if self.index is not None else 0

    @property
    def num_available(self) -> int:
        return self.num_free + self.num_cached

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"allocate({n}): the number of blocks must be >= 0")
        if n > self.num_available:
            raise RuntimeError(f"allocate({n}): only {self.num_available} blocks available")
        if n > len(self._free):
            evicted = self.index.evict(n - len(self._free))
            self.evictions += len(evicted)
            if self.listener is not None:
                self.listener.evicted(evicted)
            # onto the stack so that they come off least recently used first
            for b in reversed(evicted):
                assert self.refcount[b] == 0, (
                    f"evicted block {b} still has refcount {self.refcount[b]}"
                )
                self._release(b)
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._is_free[b] = False
            self.refcount[b] = 1
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._is_free[b]:
                raise RuntimeError(f"incref of free block {b}")
            if self.refcount[b] == 0 and self.index is not None:
                self.index.used(b)
            elif self.refcount[b] > 0:
                self.shared_refs += 1
            self.refcount[b] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody holds goes back to the free list
        unless the prefix index caches it."""
        for b in blocks:
            if self.refcount[b] <= 0:
                raise RuntimeError(f"block {b}: refcount underflow (double free)")
            if self.refcount[b] > 1:
                self.shared_refs -= 1
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                if self.index is not None and self.index.holds(b):
                    # cached: a sliding group's page may now be evicted by itself
                    self.index.unused(b)
                else:
                    self._release(b)

    def drop_cached(self) -> int:
        """Evict every cached block nobody uses back to the free list; returns how many."""
        if self.index is None:
            return 0
        evicted = self.index.evict(self.index.evictable_blocks)
        for b in evicted:
            self._release(b)
        return len(evicted)

    def _release(self, b: int) -> None:
        if self._is_free[b]:
            raise RuntimeError(f"block {b} freed twice")
        self._is_free[b] = True
        self._free.append(b)
        if self.listener is not None:
            self.listener.released(b)

    def is_free(self, b: int) -> bool:
        return self._is_free[b]
