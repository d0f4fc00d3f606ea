"""Per-layer KV geometry: what each attention layer writes into the paged cache, and how it reads it.

Design notes: docs/internals.md, paged_hf/execution/kv_geometry.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cache.kv_groups import CacheGroup


@dataclass(frozen=True)
class LayerSpec:
    q_heads: int
    kv_heads: int
    k_dim: int
    v_dim: int
    window: int | None = None
    chunk: int | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        for name in ("q_heads", "kv_heads", "k_dim", "v_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LayerSpec.{name}={value!r}, must be an integer >= 1")
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"LayerSpec: {self.q_heads} query heads are not a multiple of {self.kv_heads} KV heads"
            )
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"LayerSpec.{name}={value!r}, must be None or an integer >= 1")
        if self.window is not None and self.chunk is not None:
            raise ValueError("LayerSpec: a layer has a sliding window or a chunk, not both")

    def kv_elements(self, block_size: int) -> int:
        """K and V elements one block of this layer holds."""
        return block_size * self.kv_heads * (self.k_dim + self.v_dim)

    def describe(self) -> str:
        dims = f"{self.k_dim}" if self.k_dim == self.v_dim else f"K {self.k_dim} / V {self.v_dim}"
        extra = [f"window {self.window}"] if self.window else []
        extra += [f"chunk {self.chunk}"] if self.chunk else []
        extra += ["sinks"] if self.sinks else []
        return f"{self.q_heads}q/{self.kv_heads}kv heads x {dims}" + (
            f" ({', '.join(extra)})" if extra else ""
        )


@dataclass(frozen=True)
class KVLayout:
    """One ``LayerSpec`` per attention layer. Backends number the layers 0..n-1; ``layer_ids``
    gives each one's ``layer_idx`` in the model where those differ (a hybrid's attention layers sit
    between its stateful ones: Qwen3.5's are 3, 7, 11, ...). ``stateless_ok``: a model of stateful
    layers only (Mamba2) has no attention layer, and no KV."""

    layers: tuple[LayerSpec, ...]
    layer_ids: tuple[int, ...] | None = None
    stateless_ok: bool = False

    def __post_init__(self) -> None:
        if not self.layers and not self.stateless_ok:
            raise ValueError("KVLayout needs at least one attention layer")
        if self.layer_ids is not None and (
            len(self.layer_ids) != len(self.layers)
            or list(self.layer_ids) != sorted(set(self.layer_ids))
        ):
            raise ValueError(
                f"KVLayout.layer_ids={self.layer_ids}: one increasing layer_idx per layer"
            )

    def kv_index(self, layer_idx: int) -> int:
        """The backends' number for the model's attention layer ``layer_idx``."""
        if self.layer_ids is None:
            return layer_idx
        return self._index[layer_idx]

    @property
    def _index(self) -> dict[int, int]:
        index = self.__dict__.get("_index_cache")
        if index is None:
            index = {lid: i for i, lid in enumerate(self.layer_ids or ())}
            object.__setattr__(self, "_index_cache", index)
        return index

    @classmethod
    def uniform(
        cls, num_layers: int, kv_heads: int, head_dim: int, q_heads: int | None = None
    ) -> "KVLayout":
        """Every layer alike, full causal attention (what a plain llama has)."""
        return cls((LayerSpec(q_heads or kv_heads, kv_heads, head_dim, head_dim),) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_per_block(self, block_size: int, element_size: int) -> int:
        return sum(layer.kv_elements(block_size) for layer in self.layers) * element_size

    @property
    def is_uniform(self) -> bool:
        if not self.layers:
            return True
        first = self.layers[0]
        return all(
            (s.kv_heads, s.k_dim, s.v_dim) == (first.kv_heads, first.k_dim, first.v_dim)
            for s in self.layers
        )

    def cache_groups(self, keep_every_block: bool = False) -> tuple[CacheGroup, ...]:
        """The layers grouped by what they keep (paged_hf/cache/kv_groups.py): one full-attention group
        first, then the sliding and chunked ones, each of the same number of layers (the smallest
        kind's count; the last group of a kind may be short: its slabs there go unused).

        One group of every layer, keeping every block, when ``keep_every_block``, when every layer
        is full attention, when no layer is (the prefix index is keyed on a full group's blocks),
        or when the layers' geometries differ (a page must be the same bytes in every group)."""
        kinds: dict[tuple, list[int]] = {}
        for i, spec in enumerate(self.layers):
            kinds.setdefault((spec.window, spec.chunk), []).append(i)
        every = (CacheGroup(tuple(range(self.num_layers))),)
        if keep_every_block or len(kinds) < 2 or (None, None) not in kinds or not self.is_uniform:
            return every
        size = min(len(ids) for ids in kinds.values())
        order = [(None, None)] + [k for k in kinds if k != (None, None)]
        return tuple(
            CacheGroup(tuple(ids[i : i + size]), window, chunk)
            for window, chunk in order
            for ids in [kinds[(window, chunk)]]
            for i in range(0, len(ids), size)
        )

    def bytes_per_page(
        self, groups: tuple[CacheGroup, ...], block_size: int, element_size: int
    ) -> int:
        """One page: ``block_size`` tokens of K and V of one group's layers (its slabs)."""
        slabs = max(len(g.layers) for g in groups)
        first = next(g for g in groups if len(g.layers) == slabs)
        return sum(self.layers[i].kv_elements(block_size) for i in first.layers) * element_size

    def describe(self) -> str:
        """``"2 x 4q/2kv heads x 16 (window 8), 2 x 4q/2kv heads x 16"`` (runs of equal layers)."""
        runs: list[list] = []
        for layer in self.layers:
            if runs and runs[-1][1] == layer:
                runs[-1][0] += 1
            else:
                runs.append([1, layer])
        return ", ".join(f"{n} x {layer.describe()}" for n, layer in runs)


def as_layout(
    layout: KVLayout | int, kv_heads: int | None = None, head_dim: int | None = None
) -> KVLayout:
    """``layout`` itself, or (a number of layers, ``kv_heads``, ``head_dim``) as a uniform layout:
    backends take either, so code that only knows the three numbers keeps working."""
    if isinstance(layout, KVLayout):
        return layout
    if kv_heads is None or head_dim is None:
        raise TypeError("a backend built from a number of layers needs kv_heads and head_dim too")
    return KVLayout.uniform(int(layout), kv_heads, head_dim)
