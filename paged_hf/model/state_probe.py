"""Which modules of a hybrid model keep state, and what they keep: read from the model itself.

One forward of a few tokens through transformers' own cache (``DynamicCache(config=...)``, what
``generate`` builds) records every call of the unified linear-attention cache API
(``get/update_conv_state``, ``get/update_recurrent_state``) and the innermost module whose forward
was handed the cache when the call came: that module is the layer's mixer (a gated DeltaNet, a
Mamba2 mixer, a short conv), and it is what the engine wraps during its steps. The states it left
in the cache give their shapes and dtypes. A stateful module that keeps its state some other
way (its own cache class, module attributes, explicit state arguments) is found by the
capability check's module scan and refused there.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from typing import Any

import torch

from ..execution.state_geometry import MixerSpec, StateLayout
from ..execution.stateful_mixers import CACHE_ARGS

logger = logging.getLogger("paged_hf")

STATE_METHODS = ("get_conv_state", "update_conv_state", "get_recurrent_state", "update_recurrent_state")


class StateProbeError(ValueError):
    """The model's stateful layers cannot be read through transformers' cache API; says where and why."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


def _kind(module: torch.nn.Module, model_type: str) -> str:
    """``Qwen3_5GatedDeltaNet`` -> "gated delta net", ``NemotronHMamba2Mixer`` -> "mamba2 mixer": the
    class name's words less the model's own name in front."""
    words = [w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", type(module).__name__)]
    compact, prefix = re.sub(r"[^a-z0-9]", "", model_type.lower()), ""
    while words and compact.startswith(prefix + words[0]):
        prefix += words.pop(0)
    kept: list[str] = []
    for w in words:  # digits stay with the word before them ("mamba2")
        if w.isdigit() and kept:
            kept[-1] += w
        else:
            kept.append(w)
    return " ".join(kept) or type(module).__name__


def probe_state_layout(model: torch.nn.Module, input_ids: torch.Tensor, check_chunks: bool = True
                       ) -> StateLayout | None:
    """The model's stateful mixers and their states, or None when no module uses the state API.
    ``check_chunks=False`` reads the shapes only (a model on the meta device, for sizing)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    stack: list[torch.nn.Module] = []
    calls: list[tuple[str, int, int, torch.nn.Module | None]] = []
    inputs: dict[int, tuple[tuple, dict]] = {}  # each module handed the cache: what its first call got

    def gets_cache(args: tuple, kwargs: dict) -> bool:
        return any(a is cache for a in args) or any(v is cache for v in kwargs.values())

    def pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if gets_cache(args, kwargs):
            stack.append(module)
            inputs.setdefault(id(module), (args, kwargs))

    def post(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if stack and stack[-1] is module:
            stack.pop()

    def recording(name: str, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(method).bind(*args, **kwargs).arguments
            calls.append((name, bound.get("layer_idx"), bound.get("state_idx", 0), stack[-1] if stack else None))
            return method(*args, **kwargs)
        return call

    for name in STATE_METHODS:
        setattr(cache, name, recording(name, getattr(cache, name)))
    hooks = []
    for m in model.modules():
        hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
    params = inspect.signature(model.forward).parameters
    cache_kw = next((n for n in ("cache", "past_key_values") if n in params), "past_key_values")
    try:
        with torch.inference_mode():
            model(input_ids=input_ids, use_cache=True, **{cache_kw: cache})
    finally:
        for h in hooks:
            h.remove()
        for name in STATE_METHODS:
            cache.__dict__.pop(name, None)
    if not calls:
        return None
    layout = _layout_from(model, cache, calls)
    if not check_chunks:
        return layout
    continues, mixers = True, []
    for spec in layout.mixers:
        module = model.get_submodule(spec.path)
        chunks, kernel = _run_as_engine(module, spec, *inputs[id(module)], spec.path)
        continues &= chunks
        mixers.append(dataclasses.replace(spec, kernel=kernel))
    return dataclasses.replace(layout, mixers=tuple(mixers), continues_chunks=continues)


def _run_as_engine(module: torch.nn.Module, spec: MixerSpec, args: tuple, kwargs: dict, where: str
                   ) -> tuple[bool, str | None]:
    """Run the mixer as the engine does, through state slots and the step's cache view, on the very
    input it had in the probe forward, and compare with its own forward over the whole sequence
    without a cache: the second half one token at a time (its decode path) must agree, or the
    model is refused; the second half as one chunk tells whether it carries its state into a
    chunk (Mamba1-style mixers drop it). Returns that, and the paged_hf kernel its decode path
    runs with (None: its own code only): one that gave its own code's outputs, to rounding."""
    from ..execution import mixer_kernels
    from ..execution.state_store import StateStore
    from ..execution.stateful_mixers import StatePlan, mixer_arguments, stepped_forward

    hidden, kwargs = mixer_arguments(list(inspect.signature(module.forward).parameters), args, kwargs)
    n, half = hidden.shape[1], hidden.shape[1] // 2
    tol = 1e-3 if hidden.dtype == torch.float32 else 5e-2

    other = hidden.flip(1)  # a second sequence, so the decode rows run as a batch, as in the engine

    def pieces(lengths: list[int], spec: MixerSpec = spec) -> torch.Tensor:
        """Both sequences, cut into ``lengths`` (each step runs a piece of each); the outputs of each."""
        store = StateStore(StateLayout((spec,)), 2, hidden.device)
        outs, start = [], 0
        for length in lengths:
            plan = StatePlan.build([length, length], [start, start], [0, 1], hidden.device)
            x = torch.cat([hidden[:, start:start + length], other[:, start:start + length]], dim=1)
            outs.append(stepped_forward(module.forward, spec, store, plan)(x, **kwargs).unflatten(1, (2, length)))
            start += length
        return torch.cat(outs, dim=2).float()

    with torch.inference_mode():
        whole = torch.stack([module(hidden, **kwargs), module(other, **kwargs)], dim=1).float()
        by_token = pieces([half] + [1] * (n - half))
        chunked = pieces([half, n - half])
        kernel = None
        sites = mixer_kernels.sites_of(module) if hidden.device.type == "cpu" else []
        if sites and mixer_kernels.available():
            calls = mixer_kernels.calls
            try:
                with mixer_kernels.installed(sites):
                    with_kernel = pieces([half] + [1] * (n - half),
                                         dataclasses.replace(spec, kernel=mixer_kernels.KIND))
            except Exception as e:  # noqa: BLE001 - the model's own code serves it: slower, same outputs
                logger.warning("paged_hf: %s runs without paged_hf's %s kernel, which failed on it: %s: %s",
                               where, mixer_kernels.KIND, type(e).__name__, e)
            else:
                # the same math in another order: fp32 rounding, or one step of the output's dtype
                if mixer_kernels.calls > calls and _close(by_token, with_kernel, 1e-5 if hidden.dtype == torch.float32
                                                          else 2 * torch.finfo(hidden.dtype).eps):
                    kernel = mixer_kernels.KIND
    if not _close(whole, by_token, tol):
        raise StateProbeError(f"{where} ({type(module).__name__})", "continued one token at a time from a state "
                              "it wrote, it gives other outputs than over the whole sequence at once (max difference "
                              f"{float((whole - by_token).abs().max()):.2e}): its state cannot be carried between steps")
    return _close(whole, chunked, tol), kernel


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return float((a - b).abs().max()) <= tol * float(a.abs().max().clamp(min=1e-6))


def _layout_from(model: torch.nn.Module, cache: Any, calls: list) -> StateLayout:
    names = {id(m): name for name, m in model.named_modules()}
    by_module: dict[int, tuple[torch.nn.Module, set[int], set[int]]] = {}
    for name, layer_idx, state_idx, module in calls:
        if module is None:
            raise StateProbeError("its forward", f"{name} was called outside any module handed the cache")
        entry = by_module.setdefault(id(module), (module, set(), set()))
        entry[1].add(layer_idx)
        entry[2].add(state_idx)
    mixers, seen_layers = [], set()
    for module, layers, states in by_module.values():
        where = f"{names.get(id(module), '?')} ({type(module).__name__})"
        if len(layers) != 1 or not isinstance(next(iter(layers)), int):
            raise StateProbeError(where, f"reads the states of layers {sorted(map(str, layers))}; one module must "
                                  "keep one layer's state")
        layer_idx = next(iter(layers))
        if layer_idx in seen_layers:
            raise StateProbeError(where, f"keeps the state of layer {layer_idx}, as another module does")
        seen_layers.add(layer_idx)
        sig = inspect.signature(module.forward).parameters
        cache_arg = next((n for n in CACHE_ARGS if n in sig), None)
        if cache_arg is None:
            raise StateProbeError(where, f"takes the cache by none of {CACHE_ARGS}")
        layer = cache.layers[layer_idx]
        n = max(states) + 1
        conv = tuple(None if layer.conv_states.get(i) is None else tuple(layer.conv_states[i].shape[1:])
                     for i in range(n))
        conv_dtypes = tuple(None if layer.conv_states.get(i) is None else str(layer.conv_states[i].dtype)[6:]
                            for i in range(n))
        rec = tuple(None if layer.recurrent_states.get(i) is None else tuple(layer.recurrent_states[i].shape[1:])
                    for i in range(n))
        rec_dtypes = tuple(None if layer.recurrent_states.get(i) is None else str(layer.recurrent_states[i].dtype)[6:]
                           for i in range(n))
        if all(s is None for s in conv + rec):
            raise StateProbeError(where, "called the state API but left no state in the cache")
        mixers.append(MixerSpec(layer_idx, names[id(module)], _kind(module, model.config.model_type), cache_arg, conv,
                                conv_dtypes, rec, rec_dtypes))
    return StateLayout(tuple(sorted(mixers, key=lambda m: m.layer_idx)))
