"""The probe forwards ``patch`` reads a model from: a few tokens through a recording attention
function and mask, and what they record; ``refuse`` and ``UnsupportedModelError``.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    sdpa_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PROBE = "paged_hf_probe"


PROBE_TOKENS = 6


POSITION_SHIFT = 3


MEDIA_PLACEHOLDERS = (
    "image_token_id",
    "image_token_index",
    "video_token_id",
    "video_token_index",
    "audio_token_id",
    "audio_token_index",
)


_recorder: contextvars.ContextVar[ProbeRecord | None] = contextvars.ContextVar(
    "paged_hf_probe", default=None
)


class UnsupportedModelError(ValueError):
    """``paged_hf.patch`` cannot run this model correctly; the message says which module and why."""


def refuse(model_name: str, module_path: str, reason: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"paged_hf cannot run {model_name}: {module_path}: {reason}")


def text_config(model: torch.nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


@dataclass
class ProbeCall:
    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: Any
    kwargs: dict


@dataclass
class ProbeRecord:
    calls: list[ProbeCall] = field(default_factory=list)
    # id(mask) -> (mask, fn, vmap)
    masks: dict[int, tuple[torch.Tensor, Any, bool]] = field(default_factory=dict)
    ran: list[torch.nn.Module] = field(default_factory=list)


def _probe_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    probe = _recorder.get()
    if probe is None:
        raise RuntimeError("paged_hf's probe attention ran outside a capability check")
    probe.calls.append(
        ProbeCall(
            module,
            query.detach().clone(),
            key.detach().clone(),
            value.detach().clone(),
            attention_mask,
            dict(kwargs, scaling=scaling, dropout=dropout),
        )
    )
    # a plausible output of the right shape, so the forward goes on (its numbers are not checked)
    mask = (
        attention_mask
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
        else None
    )
    hq, hkv = query.shape[1], key.shape[1]
    if hkv == 0 or hq % hkv:
        out = query.new_zeros(query.shape[0], hq, query.shape[2], value.shape[-1])
    else:
        if mask is not None and mask.shape[-1] != key.shape[2]:
            mask = None
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key.to(query.dtype),
            value.to(query.dtype),
            attn_mask=mask,
            is_causal=False,
            scale=scaling,
            enable_gqa=hq != hkv,
        )
    return out.transpose(1, 2).contiguous(), None


def _probe_mask(*args: Any, **kwargs: Any) -> torch.Tensor:
    probe = _recorder.get()
    kw = dict(kwargs, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    mask = sdpa_mask(*args, **kw)
    if probe is not None:
        probe.masks[id(mask)] = (
            mask,
            kwargs.get("mask_function"),
            bool(kwargs.get("use_vmap", False)),
        )
    return mask


def _register_probe() -> None:
    if PROBE not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(PROBE, _probe_attention)
    if PROBE not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(PROBE, _probe_mask)


def configs_of(model: torch.nn.Module) -> list[Any]:
    """The model's config and every sub-config any module carries (each once)."""
    seen, out = set(), []
    for cfg in [model.config] + [m.config for m in model.modules() if hasattr(m, "config")]:
        if id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    return out


@contextlib.contextmanager
def _implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Select ``name`` for the model, then put back every config's implementation exactly as it was."""
    from transformers.utils import logging as hf_logging

    saved = [(cfg, cfg.__dict__.get("_attn_implementation_internal")) for cfg in configs_of(model)]
    verbosity = hf_logging.get_verbosity()
    try:
        hf_logging.set_verbosity_error()  # a model that cannot switch says so; the probe finds out and says why
        try:
            model.set_attn_implementation(name)
        finally:
            hf_logging.set_verbosity(verbosity)
        yield
    finally:
        for cfg, impl in saved:
            cfg._attn_implementation_internal = impl


def probe_token_ids(model: torch.nn.Module, n: int) -> list[int]:
    """``n`` ordinary token ids: mid-vocabulary, away from special and media placeholder ids."""
    text = text_config(model)
    vocab = int(getattr(text, "vocab_size", None) or getattr(model.config, "vocab_size", 0) or 0)
    avoid = set(media_token_ids(model))
    for c in (model.config, text):
        for k, v in c.to_dict().items():
            if k.endswith(("_token_id", "_token_index")) and isinstance(v, int):
                avoid.add(v)
    ids, t = [], max(vocab // 2, 1)
    while len(ids) < n and t < vocab + n:
        if t not in avoid and t < vocab:
            ids.append(t)
        t += 7 if vocab > 64 else 1
    return (ids + list(range(1, n + 1)))[:n] if vocab else list(range(1, n + 1))


def run_probes(
    model: torch.nn.Module, model_name: str
) -> tuple[ProbeRecord, ProbeRecord, ProbeRecord]:
    """Three forwards of the same tokens through the recording attention function: position_ids
    0..n-1 (as the engine passes them), shifted by POSITION_SHIFT, and none (the model's own)."""
    _register_probe()
    device = next(model.parameters()).device
    ids = torch.tensor([probe_token_ids(model, PROBE_TOKENS)], device=device)
    runs = []
    with _implementation(model, PROBE), torch.inference_mode():
        for shift in (0, POSITION_SHIFT, None):
            probe = ProbeRecord()
            hooks = [
                m.register_forward_pre_hook(lambda mod, _args, p=probe: p.ran.append(mod))
                for m in model.modules()
            ]
            token = _recorder.set(probe)
            try:
                pos = (
                    None
                    if shift is None
                    else torch.arange(shift, shift + ids.shape[1], device=device)[None]
                )
                model(input_ids=ids, position_ids=pos, use_cache=False)
            except Exception as e:  # noqa: BLE001 - the model cannot run the way the engine runs it
                raise refuse(
                    model_name,
                    "its forward",
                    f"a forward of {ids.shape[1]} tokens with position_ids [1, T] and "
                    f"use_cache=False (how the engine calls it) failed: {type(e).__name__}: {e}",
                ) from e
            finally:
                _recorder.reset(token)
                for h in hooks:
                    h.remove()
            runs.append(probe)
    return runs[0], runs[1], runs[2]


def module_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(m): (name or "<model>") for name, m in model.named_modules()}


def media_token_ids(model: torch.nn.Module) -> frozenset[int]:
    ids = set()
    for c in (model.config, text_config(model)):
        for name in MEDIA_PLACEHOLDERS:
            v = getattr(c, name, None)
            if isinstance(v, int) and not isinstance(v, bool):
                ids.add(v)
    return frozenset(ids)
