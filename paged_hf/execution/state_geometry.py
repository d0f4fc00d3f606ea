"""What each stateful layer of a hybrid model keeps per sequence: its conv and recurrent states.

Design notes: docs/internals.md, paged_hf/execution/state_geometry.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@dataclass(frozen=True)
class MixerSpec:
    layer_idx: int
    path: str  # the module's name in the model (``model.layers.0.linear_attn``)
    kind: str  # what it is, for messages and the support table ("gated delta net")
    cache_arg: str  # the keyword its forward takes the cache by ("cache")
    # per state_idx: the state's shape without the batch dimension (None: the mixer keeps no such state)
    conv: tuple[tuple[int, ...] | None, ...]
    conv_dtypes: tuple[str | None, ...]
    recurrent: tuple[tuple[int, ...] | None, ...]
    recurrent_dtypes: tuple[str | None, ...]
    # (get_X, set_X) per state_idx: the mixer keeps recurrent state i through these two methods of its
    # model's own cache class, not transformers' unified API (MiniMax's get_linear_cache / set_linear_cache)
    own_methods: tuple[tuple[str, str], ...] = ()
    # a paged_hf kernel the probe checked this mixer against its own code with, used in engine
    # steps (paged_hf/execution/cpu/mixer_kernels.py), or None
    kernel: str | None = None

    @property
    def num_states(self) -> int:
        return len(self.conv)

    def conv_kernel_size(self, state_idx: int) -> int | None:
        shape = self.conv[state_idx]
        return None if shape is None else shape[-1]

    def bytes_per_slot(self) -> int:
        total = 0
        for shapes, dtypes in (
            (self.conv, self.conv_dtypes),
            (self.recurrent, self.recurrent_dtypes),
        ):
            for shape, dtype in zip(shapes, dtypes):
                if shape is not None:
                    total += (
                        torch.Size(shape).numel()
                        * torch.empty((), dtype=_dtype(dtype)).element_size()
                    )
        return total


@dataclass(frozen=True)
class StateLayout:
    """One ``MixerSpec`` per stateful layer, in layer order. ``continues_chunks``: the mixers carry
    their state into a chunk of several tokens (False for Mamba1-style mixers, which drop it: after
    a request's first chunk, its prompt goes on one token at a time, through their decode path)."""

    mixers: tuple[MixerSpec, ...]
    continues_chunks: bool = True

    def bytes_per_slot(self) -> int:
        """Bytes of one sequence's state across every stateful layer."""
        return sum(m.bytes_per_slot() for m in self.mixers)

    @property
    def kinds(self) -> list[str]:
        return list(dict.fromkeys(m.kind for m in self.mixers))

    @property
    def kernels(self) -> list[str]:
        """paged_hf kernels some mixers' decode runs through (checked against their own code)."""
        return list(dict.fromkeys(m.kernel for m in self.mixers if m.kernel is not None))

    def describe(self) -> str:
        chunks = (
            ""
            if self.continues_chunks
            else "; prompts continue token by token after their first chunk"
        )
        chunks += "".join(f"; decode through paged_hf's {k} kernel" for k in self.kernels)
        return f"{len(self.mixers)} x {', '.join(self.kinds)} ({self.bytes_per_slot():,} state bytes per sequence{chunks})"
