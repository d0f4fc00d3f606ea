"""torch.compile of the decode step, with each attention call one opaque custom op.

Design notes: docs/internals.md, paged_hf/execution/compile_decode.py.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from . import attention

_target: list[Any] = [None]  # the backend the op's real implementation calls, set per step


@torch.library.custom_op(
    "paged_hf::attend",
    mutates_args=(),
    schema="(Tensor query, Tensor key, Tensor value, int layer_idx, float scaling, int? sliding_window, "
    "float? softcap, Tensor? sinks) -> Tensor",
)
def attend_op(query, key, value, layer_idx, scaling, sliding_window, softcap, sinks):
    """Write this layer's new K/V into the paged cache and attend: [1, Hq, T, D] -> [1, T, Hq, Dv].

    The KV cache is the backend's own state, not an argument: each call writes and reads only
    its own layer, so calls need no ordering beyond their data flow."""
    backend = _target[0]
    if backend is None:
        raise RuntimeError("paged_hf::attend called outside a compiled paged_hf step")
    return backend.attend(
        layer_idx,
        query,
        key,
        value,
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
    )


@attend_op.register_fake
def _attend_fake(query, key, value, layer_idx, scaling, sliding_window, softcap, sinks):
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[3])


class OpBackend:
    """What the attention function sees in a compiled step: every layer is one ``paged_hf::attend``."""

    name = "op"

    def __init__(self, layout: Any) -> None:
        # the real backend's KV layout: the attention seam numbers layers by it
        self.layout = layout

    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        return torch.ops.paged_hf.attend(
            query,
            key,
            value,
            layer_idx,
            float(scaling),
            None if sliding_window is None else int(sliding_window),
            None if softcap is None else float(softcap),
            sinks,
        )


@contextlib.contextmanager
def compiled_step(op_backend: OpBackend, backend: Any) -> Iterator[None]:
    """Run a compiled forward: attention goes through ``op_backend`` (keep one instance: dynamo
    guards on its identity) and the op reaches ``backend``."""
    _target[0] = backend
    attention._compiled_backend = op_backend
    try:
        with attention.active_backend(op_backend):
            yield
    finally:
        attention._compiled_backend = None
        _target[0] = None


def compile_forward(
    model: torch.nn.Module, compile_backend: str = "inductor"
) -> Callable[..., torch.Tensor]:
    """The model's forward over a packed [1, T] batch, compiled; returns logits [T, V]."""

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]

    compiled = torch.compile(forward, backend=compile_backend, fullgraph=False)

    def run(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(input_ids, 1)
        torch._dynamo.maybe_mark_dynamic(position_ids, 1)
        return compiled(input_ids, position_ids)

    return run
