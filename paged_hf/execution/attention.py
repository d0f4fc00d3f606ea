"""The seam into transformers: one attention function and one mask function, registered as
"paged_hf" in transformers' AttentionInterface / AttentionMaskInterface.

Design notes: docs/internals.md, paged_hf/execution/attention.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from typing import Any, Iterator

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "paged_hf"
# the model layer an attention module's KV belongs to, where its own layer_idx does not say (set by patch)
LAYER_ATTR = "paged_hf_layer_idx"

_active_backend: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "paged_hf_backend", default=None
)
_fallback_impl: dict[int, str] = {}  # id(config) -> implementation the model had before patch
# config class -> what the last model of that class patched had: a model built with
# attn_implementation="paged_hf" and never patched (TRL's reference model copies the policy's
# config) runs plain forwards through that, or sdpa
_fallback_by_class: dict[type, str] = {}
# While a compiled decode step runs (compile_decode.py) its backend is also kept in this plain
# global: dynamo cannot trace ContextVar.get and would otherwise break the graph at every layer.
_compiled_backend: Any = None


def _current_backend() -> Any:
    return _compiled_backend if _compiled_backend is not None else _active_backend.get()


@contextlib.contextmanager
def active_backend(backend: Any) -> Iterator[None]:
    token = _active_backend.set(backend)
    try:
        yield
    finally:
        _active_backend.reset(token)


def set_fallback(config: Any, implementation: str | None) -> None:
    if implementation is None:
        _fallback_impl.pop(id(config), None)
    else:
        if implementation == NAME:  # built with attn_implementation="paged_hf": it had no other
            implementation = _fallback_by_class.get(type(config), "sdpa")
        _fallback_impl[id(config)] = implementation
        _fallback_by_class[type(config)] = implementation


def _fallback(config: Any) -> str:
    impl = _fallback_impl.get(id(config))
    # a model loaded with attn_implementation="paged_hf" that paged_hf never patched
    if impl is None:
        return _fallback_by_class.get(type(config), "sdpa")
    return impl


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    backend = _current_backend()
    if backend is None:
        impl = _fallback(module.config)
        if impl in ALL_ATTENTION_FUNCTIONS:
            fn = ALL_ATTENTION_FUNCTIONS[impl]
        else:  # "eager" lives in each modeling file, not in the registry
            fn = sys.modules[type(module).__module__].eager_attention_forward
        return fn(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    # paged_mask returns None in a step: this one the module built itself
    if attention_mask is not None:
        raise RuntimeError(
            f"paged_hf: {type(module).__name__} (layer {module.layer_idx}) passed an attention mask "
            "that paged attention would drop; paged_hf.patch should have refused this model"
        )
    # no AttributeError per call, as getattr has
    layer_idx = module.__dict__.get(LAYER_ATTR, module.layer_idx)
    out = backend.attend(
        backend.layout.kv_index(layer_idx),
        query,
        key,
        value,
        scaling=scaling,
        sliding_window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
    )
    return out, None


def paged_mask(*args: Any, **kwargs: Any) -> Any:
    if _current_backend() is not None:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[_fallback(kwargs["config"])](*args, **kwargs)


def register() -> None:
    """Idempotent: make "paged_hf" a valid ``attn_implementation``."""
    if NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, paged_attention_forward)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(NAME, paged_mask)
