"""Can paged_hf run this model? Decided from the model itself, not from its name.

``check(model)`` returns a ``Capability`` (the per-layer KV layout the engine sizes its cache
from, the configs whose attention implementation must stay "paged_hf", the placeholder token ids
of media inputs) or raises ``UnsupportedModelError`` naming the module and the reason.

Design notes: docs/internals.md, paged_hf/model/capability.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..execution.kv_geometry import KVLayout
from ..execution.runner import eval_modes
from ..execution.state_geometry import StateLayout
from ..patches import family_for
from .layer_geometry import kv_layout
from .probe import (  # noqa: F401 - UnsupportedModelError is capability's API
    PROBE_TOKENS,
    ProbeRecord,
    UnsupportedModelError,
    configs_of,
    media_token_ids,
    module_names,
    probe_token_ids,
    refuse,
    run_probes,
    text_config,
)
from .state_probe import StateProbeError, probe_state_layout
from .tensor_parallel import refuse_spread_layers

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
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
    refuse_spread_layers(model, model_name)
    state = _state_layout(model, model_name)
    _check_config(model, model_name, state)
    first, shifted, unpositioned = run_probes(model, model_name)
    _check_ran_modules(model, first, model_name, state)
    layout, configs, attention_layers = kv_layout(
        model, first, model_name, sparse=state is not None
    )
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
        layout, tuple(configs), media_token_ids(model), limits, state, attention_layers
    )


# ---- 1. the config -------------------------------------------------------------------------------


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


# ---- 3. modules that ran -------------------------------------------------------------------------


def _check_ran_modules(
    model: torch.nn.Module, probe: ProbeRecord, model_name: str, state: StateLayout | None = None
) -> None:
    names = module_names(model)
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


# ---- 5. positions --------------------------------------------------------------------------------
def _check_positions(
    first: ProbeRecord,
    shifted: ProbeRecord,
    unpositioned: ProbeRecord,
    model_name: str,
    stateful: bool = False,
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
