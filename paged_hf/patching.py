"""patch / unpatch: switch a loaded transformers model to paged attention and the engine's
``generate``, and back.

    >>> model = paged_hf.patch(model, max_num_seqs=64)
    >>> model.generate(input_ids, attention_mask=mask, max_new_tokens=32)  # same API, continuous batching
    >>> paged_hf.unpatch(model)                                            # exactly as before
"""
from __future__ import annotations

import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from . import attention
from .config import EngineConfig
from .patches import family_for, supported_model_types

_STATE = "_paged_hf_state"


@dataclass
class PatchState:
    original_attn: str
    config: dict[str, Any]
    engine: Any = None       # created on first generate, kept so the prefix cache survives calls
    tokenizer: Any = None
    # every Engine built on the model while patched: unpatch refuses while one is busy, and an
    # engine refuses to run once the state it was built under is gone
    engines: weakref.WeakSet = field(default_factory=weakref.WeakSet)


def _configs(model: torch.nn.Module) -> list[Any]:
    """The model's config and every sub-config carrying an attention implementation."""
    seen, out = set(), []
    for cfg in [model.config] + [m.config for m in model.modules() if hasattr(m, "config")]:
        if id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    return out


def check_supported(model: torch.nn.Module) -> None:
    if not hasattr(model, "config") or not hasattr(model.config, "model_type"):
        raise TypeError(f"paged_hf.patch expects a transformers PreTrainedModel, got {type(model).__name__}")
    model_type = model.config.model_type
    family = family_for(model_type)
    if family is None:
        raise ValueError(f"paged_hf does not support model_type={model_type!r} (its attention may bypass "
                         f"transformers' AttentionInterface); supported: {', '.join(supported_model_types())}")
    if model.training:
        raise ValueError("paged_hf.patch: the model is in training mode; call model.eval() first "
                         "(the engine runs inference only; plain forward/training still work after patch)")
    check = getattr(family, "check", None)
    if check is not None:
        check(model)


def ensure_attention_patched(model: torch.nn.Module) -> None:
    """Select the paged attention implementation (idempotent); ``generate`` is left alone."""
    if getattr(model, _STATE, None) is not None:
        return
    check_supported(model)
    attention.register()
    original = model.config._attn_implementation
    for cfg in _configs(model):
        attention.set_fallback(cfg, cfg._attn_implementation or original)
    model.set_attn_implementation(attention.NAME)
    setattr(model, _STATE, PatchState(original_attn=original, config={}))


def patch(model: torch.nn.Module, tokenizer: Any = None, **config: Any) -> torch.nn.Module:
    """Turn a transformers causal LM into a continuous-batching generator; returns the model.

    ``config`` takes the fields of ``paged_hf.EngineConfig`` (block_size, num_blocks or
    kv_cache_memory, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, backend, ...).
    The KV cache is allocated on the first ``generate``.
    """
    EngineConfig.from_kwargs(**config)  # fail now on a bad option, not at first generate
    ensure_attention_patched(model)
    state: PatchState = getattr(model, _STATE)
    state.config = dict(config)
    state.engine = None
    state.tokenizer = tokenizer
    from .hf_generate import paged_generate
    model.generate = types.MethodType(paged_generate, model)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Restore the original attention implementation and ``generate``; frees the KV cache."""
    state: PatchState | None = getattr(model, _STATE, None)
    if state is None:
        raise ValueError("unpatch: this model was not patched by paged_hf")
    busy = [e for e in list(state.engines) if e.is_busy]
    if busy:
        raise RuntimeError(f"unpatch: {len(busy)} paged_hf engine(s) still run on this model (unfinished requests, "
                           "or a background engine from paged_hf.serve); let them finish or shut the background "
                           "engine down first")
    model.set_attn_implementation(state.original_attn)
    for cfg in _configs(model):
        attention.set_fallback(cfg, None)
    model.__dict__.pop("generate", None)
    delattr(model, _STATE)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    return getattr(model, _STATE, None) is not None


def patch_state(model: torch.nn.Module) -> PatchState | None:
    return getattr(model, _STATE, None)


def engine_for(model: torch.nn.Module) -> Any:
    """The engine behind a patched model's ``generate`` (created on first use)."""
    state: PatchState | None = getattr(model, _STATE, None)
    if state is None:
        raise ValueError("this model is not patched; call paged_hf.patch(model) first")
    if state.engine is None:
        from .engine import Engine
        state.engine = Engine(model, state.tokenizer, **state.config)
    return state.engine
