"""The state slots' memory: every stateful layer's conv and recurrent states for ``num_slots``
sequences, on the model's device, in the dtypes the model keeps them in.

A slot id (handed out by paged_hf/cache/state_slots.py) names one sequence's state across every
stateful layer. A slot's state is only meaningful once its sequence computed a token: before
that the mixers are told there is no previous state, whatever the memory holds.
"""

from __future__ import annotations

import torch

from .state_geometry import StateLayout, _dtype


class StateStore:
    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device | str) -> None:
        self.layout = layout
        self.num_slots = num_slots
        self.device = torch.device(device)
        # by layer_idx: per state_idx, the [num_slots, *shape] conv and recurrent tensors (or None)
        self.conv: dict[int, list[torch.Tensor | None]] = {}
        self.recurrent: dict[int, list[torch.Tensor | None]] = {}
        for m in layout.mixers:
            self.conv[m.layer_idx] = [
                None if s is None else torch.zeros(num_slots, *s, dtype=_dtype(d), device=device)
                for s, d in zip(m.conv, m.conv_dtypes)
            ]
            self.recurrent[m.layer_idx] = [
                None if s is None else torch.zeros(num_slots, *s, dtype=_dtype(d), device=device)
                for s, d in zip(m.recurrent, m.recurrent_dtypes)
            ]

    def _tensors(self) -> list[torch.Tensor]:
        return [
            t
            for by_state in (*self.conv.values(), *self.recurrent.values())
            for t in by_state
            if t is not None
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (src, dst) slot's state: a forked sample starts from its parent's."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for t in self._tensors():
            t.index_copy_(0, dst, t.index_select(0, src))

    def copy_layer(self, layer_idx: int, src: int, dst: int) -> None:
        """One stateful layer's state from slot ``src`` to ``dst`` (a prefix checkpoint, mid-step)."""
        for t in (*self.conv[layer_idx], *self.recurrent[layer_idx]):
            if t is not None:
                t[dst].copy_(t[src])

    def save(self, slot: int) -> list[torch.Tensor]:
        """A host copy of one slot's state (swap preemption): pinned on CUDA, so neither direction waits."""
        saved = []
        for t in self._tensors():
            pin = t.device.type == "cuda"
            host = torch.empty(t.shape[1:], dtype=t.dtype, pin_memory=pin)
            saved.append(host.copy_(t[slot], non_blocking=pin))
        return saved

    def restore(self, slot: int, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self._tensors(), saved):
            t[slot].copy_(s, non_blocking=s.is_pinned())
