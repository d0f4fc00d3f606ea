"""Cache groups: layers grouped by what they keep of a request's KV (docs/cache_groups.md).

Design notes: docs/internals.md, paged_hf/cache/kv_groups.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheGroup:
    layers: tuple[int, ...] = ()  # the backends' layer numbers in it; layer i reads memory slab i
    window: int | None = None
    chunk: int | None = None

    @property
    def is_full(self) -> bool:
        return self.window is None and self.chunk is None

    @property
    def kind(self) -> str:
        if self.window is not None:
            return f"sliding {self.window}"
        if self.chunk is not None:
            return f"chunked {self.chunk}"
        return "full"

    def first_needed_block(self, position: int, block_size: int) -> int:
        """The first block a query at ``position`` or later can read."""
        if self.window is not None:
            return max(0, position - self.window + 1) // block_size
        if self.chunk is not None:
            return position // self.chunk * self.chunk // block_size
        return 0

    def tokens_needed(self, num_computed: int) -> int:
        """Of ``num_computed`` tokens of KV, how many some later query still reads."""
        if self.window is not None:
            return min(num_computed, self.window - 1)
        if self.chunk is not None:
            return num_computed - num_computed // self.chunk * self.chunk
        return num_computed

    def most_blocks(self, num_tokens: int, step_tokens: int, block_size: int) -> int:
        """The most blocks a request of ``num_tokens`` holds at once in this group, computing at
        most ``step_tokens`` per step (a step writes its whole chunk before blocks are freed)."""
        total = -(-num_tokens // block_size)
        reach = self.window if self.window is not None else self.chunk
        if reach is None:
            return total
        # a chunk's queries read back reach - 1 positions from its first; +1: the span's misalignment
        return min(total, -(-(reach - 1 + min(step_tokens, num_tokens)) // block_size) + 1)


FULL = CacheGroup()


def most_blocks(
    groups: tuple[CacheGroup, ...], num_tokens: int, step_tokens: int, block_size: int
) -> int:
    """The most pages a request of ``num_tokens`` holds at once, over every group."""
    return sum(g.most_blocks(num_tokens, step_tokens, block_size) for g in groups)


@dataclass(frozen=True)
class SlabPlaces:
    """Where each layer's KV lives under ``groups``: its group, its slab, and per slab the layer whose
    geometry the slab has (the same at that place in every group)."""

    groups: tuple[CacheGroup, ...]
    group_of: tuple[int, ...]
    slab_of: tuple[int, ...]
    slab_layers: tuple[int, ...]

    @classmethod
    def of(cls, groups: tuple[CacheGroup, ...] | None, num_layers: int) -> "SlabPlaces":
        """``groups`` default: one group of every layer."""
        groups = groups or (CacheGroup(tuple(range(num_layers))),)
        group_of, slab_of = [0] * num_layers, [0] * num_layers
        for g, group in enumerate(groups):
            for j, layer in enumerate(group.layers):
                group_of[layer], slab_of[layer] = g, j
        slabs = max((len(g.layers) for g in groups), default=0)
        slab_layers = tuple(
            next(g.layers[j] for g in groups if len(g.layers) > j) for j in range(slabs)
        )
        return cls(tuple(groups), tuple(group_of), tuple(slab_of), slab_layers)
