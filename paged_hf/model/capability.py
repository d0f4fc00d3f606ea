"""Can paged_hf run this model? Decided from the model itself, not from its name.

``check(model)`` returns a ``Capability`` (the per-layer KV layout the engine sizes its cache
from, the configs whose attention implementation must stay "paged_hf", the placeholder token ids
of media inputs) or raises ``UnsupportedModelError`` naming the module and the reason.

Design notes: docs/internals.md, paged_hf/model/capability.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
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

from ..execution.kv_geometry import KVLayout, LayerSpec
from ..execution.runner import eval_modes, max_positions
from ..execution.state_geometry import StateLayout
from ..patches import family_for
from .state_probe import StateProbeError, attention_cache_layers, probe_state_layout

PROBE = "paged_hf_probe"
PROBE_TOKENS = 6
POSITION_SHIFT = 3

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# keywords an attention layer may pass: honoured by the paged kernels, or inert at inference
HONOURED_KWARGS = ("scaling", "sliding_window", "softcap", "s_aux", "dropout")
INERT_KWARGS = (
    "position_ids",
    "use_cache",
    "output_attentions",
    "output_router_logits",
    "output_hidden_states",
    "return_dict",
    "cache_position",
    "is_causal",
    "layer_idx",
    "logits_to_keep",
)
# modules that keep state across tokens outside the KV cache, matched on the words of their class
# names (GptOssModel is not an "ssm"): single words, and pairs of consecutive words
RECURRENT_WORDS = (
    "mamba",
    "ssm",
    "rwkv",
    "recurrent",
    "rglru",
    "lstm",
    "xlstm",
    "mlstm",
    "slstm",
    "retention",
    "hyena",
    "lightning",
)
RECURRENT_PAIRS = (
    ("linear", "attention"),
    ("gated", "delta"),
    ("delta", "net"),
    ("short", "conv"),
    ("short", "convolution"),
    ("linear", "attn"),
    ("delta", "attention"),
)
RECURRENT_MODULES = (torch.nn.Conv1d, torch.nn.RNNBase)
# class-name endings
NOT_MIXERS = (
    "Norm",
    "Embedding",
    "Embeddings",
    "MLP",
    "Experts",
    "Gate",
    "Router",
)
MEDIA_PLACEHOLDERS = (
    "image_token_id",
    "image_token_index",
    "video_token_id",
    "video_token_index",
    "audio_token_id",
    "audio_token_index",
)


class UnsupportedModelError(ValueError):
    """``paged_hf.patch`` cannot run this model correctly; the message says which module and why."""


@dataclass(frozen=True)
class Capability:
    layout: KVLayout
    # configs the attention modules read their implementation from (all must say "paged_hf")
    attention_configs: tuple = ()
    # token ids that stand for image / video / audio inputs (refused in text prompts)
    media_token_ids: frozenset[int] = frozenset()
    # engine options the paged path is exact only up to: {EngineConfig field: (largest value, why)}
    limits: dict = field(default_factory=dict)
    # hybrid models: the stateful layers (linear attention, SSM, short conv) and what each keeps
    state: StateLayout | None = None
    # (module path, layer) of attention modules whose own layer_idx does not name their layer (the
    # applications of a block shared across layers): patch writes the layer on each (LAYER_ATTR)
    attention_layers: tuple[tuple[str, int], ...] = ()


def check(model: torch.nn.Module) -> Capability:
    """The model's ``Capability``, or ``UnsupportedModelError`` naming the module and the reason."""
    if (
        not isinstance(model, torch.nn.Module)
        or not hasattr(model, "config")
        or not hasattr(model.config, "model_type")
    ):
        raise TypeError(
            f"paged_hf.patch expects a transformers PreTrainedModel, got {type(model).__name__}"
        )
    with eval_modes(model):  # a model in train mode is probed, and later run, with dropout off
        return _check(model)


def _check(model: torch.nn.Module) -> Capability:
    model_name = f"{model.config.model_type} ({type(model).__name__})"
    state = _state_layout(model, model_name)
    _check_config(model, model_name, state)
    first, shifted, unpositioned = _probe(model, model_name)
    _check_ran_modules(model, first, model_name, state)
    layout, configs, attention_layers = _layout(model, first, model_name, sparse=state is not None)
    _check_positions(first, shifted, unpositioned, model_name, stateful=state is not None)
    family = family_for(model.config.model_type)  # per-family quirks the probes cannot see
    reason = family.check(model) if family is not None and hasattr(family, "check") else None
    if reason:
        raise refuse(model_name, f"patches/{family.__name__.rsplit('.', 1)[-1]}.py", reason)
    limits = _rope_limits(model)
    if family is not None and hasattr(family, "limits"):
        for option, (value, why) in family.limits(model).items():
            if option not in limits or value < limits[option][0]:
                limits[option] = (value, why)
    return Capability(
        layout, tuple(configs), _media_token_ids(model), limits, state, attention_layers
    )


def refuse(model_name: str, module_path: str, reason: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"paged_hf cannot run {model_name}: {module_path}: {reason}")


# ---- 1. the config -------------------------------------------------------------------------------
def text_config(model: torch.nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _state_layout(model: torch.nn.Module, model_name: str) -> StateLayout | None:
    """The stateful mixers of a hybrid model (None for a model without any), read by one forward
    through the cache the model builds for itself (paged_hf/model/state_probe.py)."""
    layer_types = getattr(text_config(model), "layer_types", None) or []
    if all(
        kind in ATTENTION_LAYER_TYPES + ("mlp", "moe")
        or any(w in kind.lower() for w in ("index", "sparse", "compress"))
        for kind in layer_types
    ):
        return None  # nothing that could keep state (sparse indexers are refused by _check_config)
    ids = torch.tensor(
        [probe_token_ids(model, PROBE_TOKENS)], device=next(model.parameters()).device
    )
    try:
        return probe_state_layout(model, ids)
    except StateProbeError as e:
        raise refuse(model_name, e.module_path, e.reason) from e
    except Exception as e:  # noqa: BLE001 - its own cache cannot run this model's stateful layers
        raise refuse(
            model_name,
            "its stateful layers",
            "a forward through the cache it builds for itself (use_cache=True) "
            f"failed: {type(e).__name__}: {e}",
        ) from e


def _check_config(
    model: torch.nn.Module, model_name: str, state: StateLayout | None = None
) -> None:
    cfg, text = model.config, text_config(model)
    if getattr(cfg, "is_encoder_decoder", False):
        raise refuse(
            model_name,
            "config.is_encoder_decoder",
            "an encoder-decoder model; paged_hf runs decoder-only causal LMs",
        )
    for c in {id(cfg): cfg, id(text): text}.values():
        if getattr(c, "is_causal", True) is False:
            raise refuse(
                model_name,
                "config.is_causal=False",
                "its attention is bidirectional; paged attention is causal",
            )
    layer_types = getattr(text, "layer_types", None) or []
    stateful = {m.layer_idx for m in state.mixers} if state is not None else set()
    for kind in dict.fromkeys(layer_types):
        if kind in ATTENTION_LAYER_TYPES:
            continue
        layers = [i for i, k in enumerate(layer_types) if k == kind]
        module_path = (
            f"config.layer_types ({len(layers)} {kind!r} layer(s), e.g. layer {layers[0]})"
        )
        low = kind.lower()
        if "index" in low or "sparse" in low or "compress" in low:
            reason = (
                "sparse attention: an indexer chooses the keys each query reads (from the attention mask "
                "or its own scores), which paged attention does not do"
            )
        elif low in ("mlp", "moe"):
            continue  # layers without attention (nemotron_h); whatever else they hold is checked below
        elif set(layers) <= stateful:
            continue  # each has a mixer that keeps its state through transformers' cache API
        else:
            missing = sorted(set(layers) - stateful)
            reason = (
                "recurrent / linear-attention / convolution layers keep state that paged_hf found no mixer for "
                f"(layers {missing[:4]}: no module read or wrote their state through transformers' cache API)"
            )
        raise refuse(model_name, module_path, reason)


# ---- 2. the probe forward ------------------------------------------------------------------------
@dataclass
class _Call:
    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: Any
    kwargs: dict


@dataclass
class _Probe:
    calls: list[_Call] = field(default_factory=list)
    # id(mask) -> (mask, fn, vmap)
    masks: dict[int, tuple[torch.Tensor, Any, bool]] = field(default_factory=dict)
    ran: list[torch.nn.Module] = field(default_factory=list)


_recorder: contextvars.ContextVar[_Probe | None] = contextvars.ContextVar(
    "paged_hf_probe", default=None
)


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
        _Call(
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
    avoid = set(_media_token_ids(model))
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


def _probe(model: torch.nn.Module, model_name: str) -> tuple[_Probe, _Probe, _Probe]:
    """Three forwards of the same tokens through the recording attention function: position_ids
    0..n-1 (as the engine passes them), shifted by POSITION_SHIFT, and none (the model's own)."""
    _register_probe()
    device = next(model.parameters()).device
    ids = torch.tensor([probe_token_ids(model, PROBE_TOKENS)], device=device)
    runs = []
    with _implementation(model, PROBE), torch.inference_mode():
        for shift in (0, POSITION_SHIFT, None):
            probe = _Probe()
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


# ---- 3. modules that ran -------------------------------------------------------------------------
def _names(model: torch.nn.Module) -> dict[int, str]:
    return {id(m): (name or "<model>") for name, m in model.named_modules()}


def _check_ran_modules(
    model: torch.nn.Module, probe: _Probe, model_name: str, state: StateLayout | None = None
) -> None:
    names = _names(model)
    ran = list({id(m): m for m in probe.ran}.values())
    # a hybrid's mixers keep their state in the engine's state slots: neither they, what runs inside
    # them, the blocks around them nor modules that attend through the AttentionInterface (Kimi's
    # "KimiLinearAttention" is MLA) are state paged_hf misses. Of the rest, only modules named like a
    # mixer count (a "Mamba2RMSNorm" beside the mixer is a norm)
    mixed: set[int] = set()
    parents = _parents(model)
    for spec in state.mixers if state is not None else ():
        mixer = model.get_submodule(spec.path)
        mixed.update(id(d) for d in mixer.modules())
        mixed.update(id(a) for a in parents.get(id(mixer), []))
    callers = {id(c.module) for c in probe.calls}
    stateful = [
        m
        for m in ran
        if (isinstance(m, RECURRENT_MODULES) or _recurrent_name(type(m).__name__))
        and id(m) not in mixed
        and id(m) not in callers
        and not (state is not None and type(m).__name__.endswith(NOT_MIXERS))
    ]
    if stateful:  # name the innermost such module: the mixer, not the model around it
        m = max(
            stateful,
            key=lambda mod: names.get(id(mod), "").count(".") + (names.get(id(mod)) != "<model>"),
        )
        raise refuse(
            model_name,
            f"{names.get(id(m), '?')} ({type(m).__name__})",
            "keeps recurrent / convolution state across tokens outside transformers' cache API "
            "(in module attributes or explicit state arguments), which paged_hf does not page",
        )
    if not probe.calls:
        if state is not None:
            return  # stateful layers only (Mamba2): no KV to page, only state slots
        attn = [m for m in ran if "attention" in type(m).__name__.lower()]
        module_path = (
            f"{names.get(id(attn[0]), '?')} ({type(attn[0]).__name__})" if attn else "its attention"
        )
        raise refuse(
            model_name,
            module_path,
            "computes attention itself and never calls transformers' AttentionInterface "
            "(ALL_ATTENTION_FUNCTIONS), so paged_hf cannot page its KV",
        )
    for m in ran:
        if "attention" not in type(m).__name__.lower() or id(m) in callers or id(m) in mixed:
            continue
        if any(id(d) in callers for d in m.modules()):
            continue  # a wrapper whose child attends (BertAttention around BertSelfAttention)
        if any(id(p) in callers for p in parents.get(id(m), [])):
            continue  # a helper inside an attending module
        raise refuse(
            model_name,
            f"{names.get(id(m), '?')} ({type(m).__name__})",
            "computes attention itself instead of calling transformers' AttentionInterface, so paged_hf "
            "cannot page its KV",
        )


def _recurrent_name(class_name: str) -> bool:
    words = [w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", class_name)]
    return any(w in RECURRENT_WORDS for w in words) or any(
        pair in RECURRENT_PAIRS for pair in zip(words, words[1:])
    )


def _parents(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    out: dict[int, list[torch.nn.Module]] = {}

    def walk(m: torch.nn.Module, chain: list[torch.nn.Module]) -> None:
        for child in m.children():
            out.setdefault(id(child), []).extend(chain + [m])
            walk(child, chain + [m])

    walk(model, [])
    return out


# ---- 4. per-layer geometry -----------------------------------------------------------------------
def _layout(
    model: torch.nn.Module, probe: _Probe, model_name: str, sparse: bool = False
) -> tuple[KVLayout, list[Any], tuple[tuple[str, int], ...]]:
    """``sparse``: a hybrid's attention layers need not be numbered 0..n-1 (stateful layers sit between)."""
    names = _names(model)
    max_pos = max_positions(model)[1] or (1 << 17)
    by_layer: dict[int, LayerSpec] = {}
    configs: dict[int, Any] = {}
    windows_cache: dict[int, tuple[int | None, int | None]] = {}
    _refuse_repeated_calls(probe, names, model_name)
    layers = _attention_layers(model, probe, model_name)
    for call in probe.calls:
        m = call.module
        module_path = f"{names.get(id(m), '?')} ({type(m).__name__})"
        layer_idx = layers[id(m)]
        by_layer[layer_idx] = _layer_spec(
            call, module_path, model_name, probe, max_pos, windows_cache
        )
        cfg = getattr(m, "config", None)
        if cfg is not None:
            configs[id(cfg)] = cfg
    ids = sorted(by_layer)
    if ids != list(range(len(by_layer))) and not sparse:
        raise refuse(
            model_name,
            "its attention layers",
            f"layer_idx values {ids} are not 0..{len(by_layer) - 1}",
        )
    layer_ids = None if ids == list(range(len(ids))) else tuple(ids)
    tagged = tuple(
        (names[id(m)], layers[id(m)])
        for m in {id(c.module): c.module for c in probe.calls}.values()
        if layers[id(m)] != getattr(m, "layer_idx", None)
    )
    return (
        KVLayout(tuple(by_layer[i] for i in ids), layer_ids, stateless_ok=sparse),
        list(configs.values()),
        tagged,
    )


def _layer_spec(
    call: Any,
    module_path: str,
    model_name: str,
    probe: _Probe,
    max_pos: int,
    windows_cache: dict[int, tuple[int | None, int | None]],
) -> LayerSpec:
    """One attention call's layer, as the probe saw it; what paged attention cannot apply is
    refused, naming the module."""
    _refuse_what_paging_drops(call, module_path, model_name)
    n = PROBE_TOKENS
    q, k, v = call.query, call.key, call.value
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[0] != 1:
        raise refuse(
            model_name,
            module_path,
            f"passes query/key/value of shapes {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}; paged attention takes [1, heads, tokens, head_dim]",
        )
    if q.shape[2] != n or k.shape[2] != n or v.shape[2] != n:
        raise refuse(
            model_name,
            module_path,
            f"attends {k.shape[2]} keys for {q.shape[2]} queries of a {n}-token input "
            "(cross-attention or extra memory tokens)",
        )
    hq, hkv, dq, dk, dv = q.shape[1], k.shape[1], q.shape[3], k.shape[3], v.shape[3]
    if v.shape[1] != hkv or dq != dk or hkv < 1 or hq % hkv:
        raise refuse(
            model_name,
            module_path,
            f"query/key/value heads {hq}/{hkv}/{v.shape[1]} and widths {dq}/{dk}/{dv} "
            "do not form (grouped-query) attention",
        )
    sinks = call.kwargs.get("s_aux")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.numel() != hq):
        raise refuse(
            model_name,
            module_path,
            f"passes attention sinks (s_aux) of shape {getattr(sinks, 'shape', None)}; "
            f"paged attention takes one sink logit per query head ({hq})",
        )
    window, chunk = _mask_pattern(probe, call, module_path, model_name, max_pos, windows_cache)
    _refuse_disagreeing_window(call, window, chunk, max_pos, module_path, model_name)
    return LayerSpec(
        q_heads=hq,
        kv_heads=hkv,
        k_dim=dk,
        v_dim=dv,
        window=window,
        chunk=chunk,
        sinks=sinks is not None,
    )


def _refuse_what_paging_drops(call: Any, module_path: str, model_name: str) -> None:
    """Keywords paged attention would not apply, and bidirectional attention."""
    m = call.module
    unknown = sorted(
        k
        for k, v in call.kwargs.items()
        if k not in HONOURED_KWARGS + INERT_KWARGS and v is not None
    )
    if unknown:
        raise refuse(
            model_name,
            module_path,
            f"passes {unknown} to its attention function, which paged attention does not "
            "apply (e.g. a position bias)",
        )
    if call.kwargs.get("is_causal") is False or getattr(m, "is_causal", True) is False:
        raise refuse(
            model_name,
            module_path,
            "is not causal (is_causal=False): bidirectional attention cannot be paged",
        )


def _refuse_disagreeing_window(
    call: Any,
    window: int | None,
    chunk: int | None,
    max_pos: int,
    module_path: str,
    model_name: str,
) -> None:
    """The ``sliding_window`` a layer passes must be the window its mask has."""
    kw_window = call.kwargs.get("sliding_window")
    if kw_window is not None and window is not None and int(kw_window) != window:
        raise refuse(
            model_name,
            module_path,
            f"passes sliding_window={kw_window} but transformers masks it with a window of "
            f"{window}; the two disagree",
        )
    if kw_window is not None and window is None and chunk is None and 0 < int(kw_window) < max_pos:
        raise refuse(
            model_name,
            module_path,
            f"passes sliding_window={kw_window} but its mask has no window; the two disagree",
        )


def _refuse_repeated_calls(probe: _Probe, names: dict[int, str], model_name: str) -> None:
    seen: set[int] = set()
    for call in probe.calls:
        if id(call.module) in seen:
            raise refuse(
                model_name,
                f"{names.get(id(call.module), '?')} ({type(call.module).__name__})",
                "attends more "
                "than once per forward (a second attention map, or a block reused across layers); each call "
                "would need its own KV",
            )
        seen.add(id(call.module))


def _attention_layers(model: torch.nn.Module, probe: _Probe, model_name: str) -> dict[int, int]:
    """id(module) -> the layer each attention module's KV is kept under: its ``layer_idx``, or, where that
    does not tell it from the others (none, or another module's too), the one layer transformers' own
    cache keeps its K and V under (a block shared across layers: Zamba2 builds one module per
    application, weights tied, every one with layer_idx -1, and passes the depth to its forward)."""
    names = _names(model)
    modules = list({id(c.module): c.module for c in probe.calls}.values())
    own = {id(m): getattr(m, "layer_idx", None) for m in modules}
    named = [v for v in own.values() if isinstance(v, int) and not isinstance(v, bool)]
    unnamed = [m for m in modules if own[id(m)] not in named or named.count(own[id(m)]) > 1]
    if not unnamed:
        return own
    ids = torch.tensor(
        [probe_token_ids(model, PROBE_TOKENS)], device=next(model.parameters()).device
    )
    try:
        kept, failed = attention_cache_layers(model, ids), ""
    except Exception as e:  # noqa: BLE001 - no cache to tell them apart: said below
        kept, failed = {}, f"a forward through its own cache failed ({type(e).__name__}: {e})"
    layers = dict(own)
    for m in unnamed:
        got = sorted(
            kept.get(id(m), ()),
            key=lambda v: (not isinstance(v, int), v if isinstance(v, int) else 0),
        )
        if len(got) == 1 and isinstance(got[0], int) and not isinstance(got[0], bool):
            layers[id(m)] = got[0]
            continue
        module_path = f"{names.get(id(m), '?')} ({type(m).__name__})"
        why = failed or (
            f"transformers' own cache keeps its K and V under layers {got}"
            if got
            else "it writes no K and V to transformers' own cache"
        )
        if own[id(m)] not in named:
            raise refuse(
                model_name,
                module_path,
                f"calls attention without a layer_idx, and {why}: it is not a per-layer "
                "attention over the sequence's tokens (e.g. attention over earlier layers' outputs)",
            )
        raise refuse(
            model_name,
            module_path,
            f"has the layer_idx ({own[id(m)]}) of another attention module (a block shared "
            f"across layers, or stacks that number their layers alike), and {why}; their KV would "
            "overwrite each other",
        )
    taken: dict[int, torch.nn.Module] = {}
    for m in modules:
        other = taken.setdefault(layers[id(m)], m)
        if other is not m:
            raise refuse(
                model_name,
                f"{names.get(id(m), '?')} ({type(m).__name__})",
                f"its KV would be kept as layer "
                f"{layers[id(m)]}'s, as {names.get(id(other), '?')}'s is; they would overwrite each other",
            )
    return layers


def _mask_pattern(
    probe: _Probe,
    call: _Call,
    module_path: str,
    model_name: str,
    max_pos: int,
    cache: dict[int, tuple[int | None, int | None]],
) -> tuple[int | None, int | None]:
    """(window, chunk) of the mask transformers built for this call, evaluated up to ``max_pos``."""
    mask = call.mask
    if mask is None:
        # no mask: the attention function's own causal masking (module.is_causal is True)
        return (
            None,
            None,
        )
    entry = probe.masks.get(id(mask)) if isinstance(mask, torch.Tensor) else None
    if entry is None:
        raise refuse(
            model_name,
            module_path,
            "passes an attention mask or bias it builds itself (not one of transformers' mask "
            "functions), which paged attention would drop",
        )
    if id(mask) not in cache:
        cache[id(mask)] = _classify(entry[1], entry[2], max_pos, model_name, module_path)
    return cache[id(mask)]


def _query_positions(max_pos: int) -> list[int]:
    qs = set(range(0, 18))
    p = 16
    while p < max_pos:
        qs.update((p - 1, p, p + 1, p + p // 2))
        p *= 2
    qs.add(max_pos - 1)
    return sorted(q for q in qs if 0 <= q < max_pos)


def _classify(
    mask_function: Any, use_vmap: bool, max_pos: int, model_name: str, module_path: str
) -> tuple[int | None, int | None]:
    """Read a mask function's pattern: full causal, a sliding window, or chunks; refuse anything else."""
    lows: dict[int, int] = {}
    for q in _query_positions(max_pos):
        try:
            row = sdpa_mask(
                batch_size=1,
                q_length=1,
                kv_length=q + 3,
                q_offset=q,
                kv_offset=0,
                mask_function=mask_function,
                attention_mask=None,
                allow_is_causal_skip=False,
                use_vmap=use_vmap,
            )
        except Exception as e:  # noqa: BLE001
            raise refuse(
                model_name,
                module_path,
                "its attention mask depends on per-token inputs (a multimodal overlay of token "
                "types or blocks), so its window cannot be read past the probe "
                f"({type(e).__name__}: {e})",
            ) from e
        seen = row.reshape(-1).nonzero().flatten().tolist()
        if not seen or seen[-1] != q:
            raise refuse(
                model_name,
                module_path,
                f"its mask {'lets query ' + str(q) + ' see later keys' if seen and seen[-1] > q else 'hides a query from itself'}"
                ": not causal attention (a bidirectional prefix or an encoder)",
            )
        if seen != list(range(seen[0], q + 1)):
            raise refuse(
                model_name,
                module_path,
                f"its mask for query {q} is not a contiguous run of keys (a custom pattern)",
            )
        lows[q] = seen[0]
    if all(lo == 0 for lo in lows.values()):
        return None, None
    widths = {q - lo + 1 for q, lo in lows.items() if lo > 0}
    if len(widths) == 1:
        w = widths.pop()
        if all(lo == max(0, q - w + 1) for q, lo in lows.items()):
            return w, None
    c = min(lo for lo in lows.values() if lo > 0)
    if all(lo == (q // c) * c for q, lo in lows.items()):
        return None, c
    raise refuse(
        model_name, module_path, "its mask is causal but neither full, a sliding window nor chunked"
    )


# ---- 5. positions --------------------------------------------------------------------------------
def _check_positions(
    first: _Probe, shifted: _Probe, unpositioned: _Probe, model_name: str, stateful: bool = False
) -> None:
    """The engine gives each packed sequence position_ids 0..n-1: they must reach the attention
    inputs, and mean what the model's own positions mean. A hybrid whose attention has no positional
    encoding at all (Nemotron-H, Kimi Linear: order comes from the recurrent layers) needs none."""
    if not len(first.calls) == len(shifted.calls) == len(unpositioned.calls):
        raise refuse(
            model_name,
            "its forward",
            "runs a different number of attention calls when position_ids change",
        )
    if stateful and not first.calls:
        return  # no attention at all: nothing reads positions but the recurrence
    # anything that could encode positions: a rotary / positional module, an embedding table besides the tokens'
    positional = [
        m
        for m in first.ran
        if any(w in type(m).__name__.lower() for w in ("rotary", "rope", "position"))
    ]
    positional += list({id(m): m for m in first.ran if isinstance(m, torch.nn.Embedding)}.values())[
        1:
    ]
    if (
        stateful
        and not positional
        and all(
            torch.equal(a.query, b.query) and torch.equal(a.key, b.key)
            for a, b in zip(first.calls, unpositioned.calls)
        )
    ):
        return
    if all(
        torch.equal(a.query, b.query) and torch.equal(a.key, b.key)
        for a, b in zip(first.calls, shifted.calls)
    ):
        raise refuse(
            model_name,
            "its positions",
            "no layer's queries or keys change with position_ids: it computes "
            "positions itself (e.g. from the cache position), which would place each packed sequence after "
            "the previous",
        )
    for a, b in zip(first.calls, unpositioned.calls):
        if not (_close(a.query, b.query) and _close(a.key, b.key)):
            raise refuse(
                model_name,
                "its positions",
                "position_ids 0..n-1 give other queries / keys than the model's own "
                "positions (e.g. RoBERTa's start after the padding index), so the engine cannot name them",
            )


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    tol = 1e-5 if a.dtype == torch.float32 else 1e-2
    return torch.allclose(
        a.float(), b.float(), rtol=tol, atol=tol * float(a.float().abs().max().clamp(min=1))
    )


# RoPE scalings whose frequencies follow the longest sequence in the forward (torch.max(position_ids)):
# in a packed step one long sequence would switch every other sequence's frequencies too
BATCH_WIDE_ROPE = ("dynamic", "longrope")


def _rope_limits(model: torch.nn.Module) -> dict[str, tuple[int, str]]:
    text = text_config(model)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    params = (
        list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    )
    limits: dict[str, tuple[int, str]] = {}
    for p in params:
        kind = (p or {}).get("rope_type") or (p or {}).get("type")
        if kind not in BATCH_WIDE_ROPE:
            continue
        original = (
            p.get("original_max_position_embeddings")
            or getattr(text, "original_max_position_embeddings", None)
            or getattr(text, "max_position_embeddings", None)
        )
        if original:
            limits["max_model_len"] = (
                int(original),
                f"its {kind!r} RoPE scaling switches the frequencies of every "
                "sequence in a forward once the longest passes original_max_position_embeddings "
                f"({original}); a packed step mixes sequences, so paged_hf stays below it",
            )
    return limits


def _media_token_ids(model: torch.nn.Module) -> frozenset[int]:
    ids = set()
    for c in (model.config, text_config(model)):
        for name in MEDIA_PLACEHOLDERS:
            v = getattr(c, name, None)
            if isinstance(v, int) and not isinstance(v, bool):
                ids.add(v)
    return frozenset(ids)
