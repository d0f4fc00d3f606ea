"""Stateful layers of hybrid models, run through their own transformers modules during engine steps.

Design notes: docs/internals.md, paged_hf/execution/stateful_mixers.py.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from transformers.cache_utils import Cache, LinearAttentionLayer

from .cpu import mixer_kernels
from .state_geometry import MixerSpec, StateLayout
from .state_store import StateStore

CACHE_ARGS = ("cache", "cache_params", "past_key_values")


@dataclass
class Segment:
    """One sequence's rows, run through the mixer on their own."""

    first: int  # its first row in the packed batch
    end: int
    slot: int
    has_previous: bool  # it continues a state (not its first token)
    # (offset, checkpoint slot): after row first + offset, copy the state there (a prefix checkpoint)
    snapshots: list[tuple[int, int]]


def decodes_from_state(n_tokens: int, computed: int, snapshots: list) -> bool:
    """Whether a sequence's rows join the step's decode batch: one token continuing its state,
    no snapshot to take."""
    return n_tokens == 1 and computed > 0 and not snapshots


@dataclass
class StatePlan:
    """Which rows of a step's packed batch go to the mixers together, and with which slots."""

    # [N] rows of single-token sequences that have a state, by slot
    decode_rows: torch.Tensor | None
    # their slots, a..b-1 (the step loop renumbers slots so that they are): the mixers read and
    # update those states in place, through views of the slots, with no gather or scatter
    decode_span: tuple[int, int] | None
    segments: list[Segment]

    @classmethod
    def build(
        cls,
        q_lens: list[int],
        computed: list[int],
        slots: list[int],
        device: torch.device,
        snapshots: list[list[tuple[int, int]]] | None = None,
    ) -> "StatePlan":
        """``computed``: tokens each sequence had computed before this step; ``snapshots``: per
        sequence, (position, checkpoint slot) of the state snapshots to take."""
        rows, dslots, segments, start = [], [], [], 0
        for i, (q, done, slot) in enumerate(zip(q_lens, computed, slots)):
            cuts = sorted((p - done, ckpt) for p, ckpt in (snapshots[i] if snapshots else ()))
            if decodes_from_state(q, done, cuts):
                rows.append(start)
                dslots.append(slot)
            else:
                segments.append(Segment(start, start + q, slot, done > 0, cuts))
            start += q
        if not rows:
            return cls(None, None, segments)
        order = sorted(range(len(rows)), key=dslots.__getitem__)
        first = dslots[order[0]]
        if [dslots[k] for k in order] != list(range(first, first + len(rows))):
            raise ValueError(
                f"paged_hf: the decode rows' state slots {sorted(dslots)} are not one span "
                "(the step loop renumbers them so that they are; this is a bug)"
            )
        return cls(
            torch.tensor([rows[k] for k in order], device=device),
            (first, first + len(rows)),
            segments,
        )


class _OneLayer:
    """``Cache.layers`` for a view that holds only ``layer_idx`` (the mixer being called)."""

    def __init__(self, layer_idx: int, layer: LinearAttentionLayer) -> None:
        self.layer_idx, self.layer = layer_idx, layer

    def __getitem__(self, idx: int) -> LinearAttentionLayer:
        if idx != self.layer_idx:
            raise IndexError(
                f"paged_hf: the step's cache view holds layer {self.layer_idx}, not {idx}"
            )
        return self.layer

    def __len__(self) -> int:
        return self.layer_idx + 1


class SlotView(Cache):
    """transformers' ``Cache``, holding one stateful layer's states for some sequences (their slots)."""

    def __init__(
        self,
        spec: MixerSpec,
        conv: list[torch.Tensor | None],
        recurrent: list[torch.Tensor | None],
        has_previous: bool,
    ) -> None:  # noqa: D107 - Cache.__init__ builds layers this view does not have
        layer = LinearAttentionLayer(number_of_states=spec.num_states)
        for i in range(spec.num_states):
            if conv[i] is not None:
                layer.conv_states[i] = conv[i]
                layer.is_conv_states_initialized[i] = True
                layer.conv_kernel_size[i] = spec.conv_kernel_size(i)
                layer.dtype, layer.device = conv[i].dtype, conv[i].device
            if recurrent[i] is not None:
                layer.recurrent_states[i] = recurrent[i]
                layer.is_recurrent_states_initialized[i] = True
            layer.has_previous_state[i] = has_previous
        self.layers = _OneLayer(spec.layer_idx, layer)
        self.offloading = False
        self.layer = layer
        self.given = [t for t in (*conv, *recurrent) if t is not None]  # the slots' own tensors
        # the model's own cache's pair, over the same slots
        for i, (get, put) in enumerate(spec.own_methods):
            setattr(self, get, functools.partial(self.get_recurrent_state, state_idx=i))
            setattr(self, put, functools.partial(_own_set, self, state_idx=i))


def _own_set(view: SlotView, layer_idx: int, state: torch.Tensor, state_idx: int) -> None:
    view.update_recurrent_state(state, layer_idx, state_idx=state_idx)


class MixerRunner:
    """Wraps the model's stateful modules for the duration of a step (``active``)."""

    def __init__(self, model: torch.nn.Module, layout: StateLayout, store: StateStore) -> None:
        self.store = store
        self.mixers = [(model.get_submodule(spec.path), spec) for spec in layout.mixers]
        # where the kernels the probe checked go in (module-level names of transformers' modeling files)
        self.kernel_sites = sorted(
            {
                site
                for module, spec in self.mixers
                if spec.kernel is not None
                for site in mixer_kernels.sites_of(module)
            }
        )

    @contextlib.contextmanager
    def active(self, plan: StatePlan) -> Iterator[None]:
        installed = []
        with mixer_kernels.installed(self.kernel_sites):
            try:
                for module, spec in self.mixers:
                    module.forward = stepped_forward(module.forward, spec, self.store, plan)
                    installed.append(module)
                yield
            finally:
                for module in installed:
                    del module.forward


def mixer_arguments(params: list[str], args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict]:
    """A mixer call's hidden states, and its other arguments by name less any cache (the view is
    passed instead). ``params``: the names of the mixer forward's parameters."""
    kwargs = dict(kwargs) | dict(zip(params, args))
    hidden = kwargs.pop(params[0])
    for name in CACHE_ARGS:
        kwargs.pop(name, None)
    return hidden, kwargs


def mixer_output(y: Any) -> tuple[torch.Tensor, int]:
    """A mixer's output tensor, and how many more values it returned beside it (MiniMax's lightning
    attention returns ``(output, state)``)."""
    if isinstance(y, torch.Tensor):
        return y, 0
    if isinstance(y, tuple) and y and isinstance(y[0], torch.Tensor):
        return y[0], len(y) - 1
    raise RuntimeError(
        f"paged_hf: a stateful mixer returned {type(y).__name__}, not a tensor or (tensor, ...); "
        "paged_hf.patch should have refused this model"
    )


def stepped_forward(original: Any, spec: MixerSpec, store: StateStore, plan: StatePlan) -> Any:
    params = list(inspect.signature(original).parameters)

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor | tuple:
        hidden, kwargs = mixer_arguments(params, args, kwargs)
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None  # a packed step has no padding
        out: torch.Tensor | None = None
        extra = 0  # values returned beside the output (a state): None in the packed result

        def run(x: torch.Tensor, view: SlotView) -> torch.Tensor:
            nonlocal extra
            with mixer_kernels.enabled(spec.kernel is not None, view.given):
                y, extra = mixer_output(original(x, **{spec.cache_arg: view}, **kwargs))
            return y

        if plan.decode_rows is not None:
            slots = slice(*plan.decode_span)
            view = _view(spec, store, slots, has_previous=True)
            y = run(hidden[0].index_select(0, plan.decode_rows)[:, None], view)
            out = hidden.new_empty(1, hidden.shape[1], y.shape[-1], dtype=y.dtype)
            out[0].index_copy_(0, plan.decode_rows, y[:, 0])
            _put_back(view, store, spec, slots)
        for seg in plan.segments:
            slot, pieces = seg.slot, _pieces(seg)
            for k, (a, b, ckpt) in enumerate(pieces):
                view = _view(
                    spec, store, slice(slot, slot + 1), has_previous=seg.has_previous or k > 0
                )
                y = run(hidden[:, a:b], view)
                if out is None:
                    out = hidden.new_empty(1, hidden.shape[1], y.shape[-1], dtype=y.dtype)
                out[:, a:b] = y
                _put_back(view, store, spec, slice(slot, slot + 1))
                if ckpt is not None:
                    store.copy_layer(spec.layer_idx, slot, ckpt)
        assert out is not None, "a step with no rows"
        return (out,) + (None,) * extra if extra else out

    return forward


def _pieces(seg: Segment) -> list[tuple[int, int, int | None]]:
    """The segment's rows cut at its snapshots: (first row, end row, checkpoint slot after it)."""
    pieces, start = [], seg.first
    for offset, ckpt in seg.snapshots:
        pieces.append((start, seg.first + offset, ckpt))
        start = seg.first + offset
    if start < seg.end:
        pieces.append((start, seg.end, None))
    return pieces


def _view(spec: MixerSpec, store: StateStore, slots: slice, has_previous: bool) -> SlotView:
    """A cache view over the slots ``where``: views of the store, so the mixer's in-place updates
    land in the slots."""
    return SlotView(
        spec,
        [None if t is None else t[slots] for t in store.conv[spec.layer_idx]],
        [None if t is None else t[slots] for t in store.recurrent[spec.layer_idx]],
        has_previous,
    )


def _put_back(view: SlotView, store: StateStore, spec: MixerSpec, slots: slice) -> None:
    """A state the view's layer holds that is not the slots' own view (the mixer replaced it, or
    it was None) goes to the slots."""
    layer = view.layer
    for held, pool in (
        (layer.conv_states, store.conv[spec.layer_idx]),
        (layer.recurrent_states, store.recurrent[spec.layer_idx]),
    ):
        for i, target in enumerate(pool):
            state = held.get(i)
            if target is not None and state is not None and not any(state is t for t in view.given):
                target[slots].copy_(state)
