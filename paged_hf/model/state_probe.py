"""Which modules of a hybrid model keep state, and what they keep: read from the model itself.

Design notes: docs/internals.md, paged_hf/model/state_probe.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from ..execution.state_geometry import MixerSpec, StateLayout
from ..execution.stateful_mixers import CACHE_ARGS

logger = logging.getLogger("paged_hf")

STATE_METHODS = (
    "get_conv_state",
    "update_conv_state",
    "get_recurrent_state",
    "update_recurrent_state",
)


class StateProbeError(ValueError):
    """The model's stateful layers cannot be read through transformers' cache API; says where and why."""

    def __init__(self, module_path: str, reason: str) -> None:
        super().__init__(f"{module_path}: {reason}")
        self.module_path, self.reason = module_path, reason


@dataclass
class CacheCall:
    method: str
    layer_idx: Any
    state_idx: int
    module: torch.nn.Module | None  # the innermost module whose forward was handed the cache
    value: Any = None  # what a set_X call stored


@dataclass
class CacheRecord:
    """One forward through the model's own cache: the cache, the calls, and what each module handed
    the cache got on its first call."""

    cache: Any = None
    calls: list[CacheCall] = field(default_factory=list)
    inputs: dict[int, tuple[tuple, dict]] = field(default_factory=dict)


def own_state_methods(cache_class: type) -> tuple[tuple[str, str], ...]:
    """The ``(get_X, set_X)`` method pairs a model's own cache class adds to transformers' cache
    classes: MiniMax's ``(get_linear_cache, set_linear_cache)``, a state per layer kept its own way."""

    def own(name: str) -> bool:
        for klass in cache_class.__mro__:
            if name in vars(klass):
                return klass.__module__ != Cache.__module__ and callable(vars(klass)[name])
        return False

    return tuple(
        (name, "set_" + name[4:])
        for name in sorted(dir(cache_class))
        if name.startswith("get_") and own(name) and own("set_" + name[4:])
    )


def record_cache_calls(model: torch.nn.Module, input_ids: torch.Tensor) -> CacheRecord:
    """One forward with ``use_cache=True`` and no cache given, so the model builds its own; the first
    ``Cache`` handed to a submodule is that cache, and its state methods (``STATE_METHODS``, its own
    pairs) and ``update`` are recorded from then on."""
    record = CacheRecord()
    stack: list[torch.nn.Module] = []
    installed: list[str] = []

    def recording(name: str, method: Any) -> Any:
        signature = inspect.signature(method)

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            value = (
                next((v for k, v in bound.items() if k != "layer_idx"), None)
                if name.startswith("set_")
                else None
            )
            record.calls.append(
                CacheCall(
                    name,
                    bound.get("layer_idx"),
                    bound.get("state_idx", 0),
                    stack[-1] if stack else None,
                    value,
                )
            )
            return method(*args, **kwargs)

        return call

    def handed(args: tuple, kwargs: dict) -> bool:
        # the model's own cache, on its way to the first module it is handed to
        if record.cache is None:
            found = next((a for a in (*args, *kwargs.values()) if isinstance(a, Cache)), None)
            if found is None:
                return False
            record.cache = found
            for name in (
                STATE_METHODS
                + ("update",)
                + tuple(n for pair in own_state_methods(type(found)) for n in pair)
            ):
                if hasattr(found, name):
                    setattr(found, name, recording(name, getattr(found, name)))
                    installed.append(name)
        return any(a is record.cache for a in (*args, *kwargs.values()))

    def pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if handed(args, kwargs):
            stack.append(module)
            record.inputs.setdefault(id(module), (args, kwargs))

    def post(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if stack and stack[-1] is module:
            stack.pop()

    hooks = []
    for m in model.modules():
        hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
    try:
        with torch.inference_mode():
            model(input_ids=input_ids, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
        for name in installed:
            record.cache.__dict__.pop(name, None)
    return record


def attention_cache_layers(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[int, set]:
    """id(module) -> the layer indices transformers' own cache keeps that module's K and V under
    (its ``update(key, value, layer_idx)`` calls)."""
    out: dict[int, set] = {}
    for call in record_cache_calls(model, input_ids).calls:
        if call.method == "update" and call.module is not None:
            out.setdefault(id(call.module), set()).add(call.layer_idx)
    return out


def _kind(module: torch.nn.Module, model_type: str) -> str:
    """``Qwen3_5GatedDeltaNet`` -> "gated delta net", ``NemotronHMamba2Mixer`` -> "mamba2 mixer": the
    class name's words less the model's own name in front."""
    words = [
        w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", type(module).__name__)
    ]
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


def probe_state_layout(
    model: torch.nn.Module, input_ids: torch.Tensor, check_chunks: bool = True
) -> StateLayout | None:
    """The model's stateful mixers and their states, or None when no module uses the state API.
    ``check_chunks=False`` reads the shapes only (a model on the meta device, for sizing)."""
    record = record_cache_calls(model, input_ids)
    own = {name for pair in own_state_methods(type(record.cache)) for name in pair}
    calls = [c for c in record.calls if c.method in STATE_METHODS or c.method in own]
    if not calls:
        return None
    layout = _layout_from(model, record.cache, calls)
    if not check_chunks:
        return layout
    continues, mixers = True, []
    for spec in layout.mixers:
        module = model.get_submodule(spec.path)
        chunks, kernel = _run_as_engine(module, spec, *record.inputs[id(module)], spec.path)
        continues &= chunks
        mixers.append(dataclasses.replace(spec, kernel=kernel))
    return dataclasses.replace(layout, mixers=tuple(mixers), continues_chunks=continues)


def _run_as_engine(
    module: torch.nn.Module, spec: MixerSpec, args: tuple, kwargs: dict, module_path: str
) -> tuple[bool, str | None]:
    """Run the mixer as the engine does, through state slots and the step's cache view, on the very
    input it had in the probe forward, and compare with its own forward over the whole sequence
    without a cache: the second half one token at a time (its decode path) must agree, or the
    model is refused; the second half as one chunk tells whether it carries its state into a
    chunk (Mamba1-style mixers drop it). Returns that, and the paged_hf kernel its decode path
    runs with (None: its own code only): one that gave its own code's outputs, to rounding."""
    from ..execution.state_store import StateStore
    from ..execution.stateful_mixers import (
        StatePlan,
        mixer_arguments,
        mixer_output,
        stepped_forward,
    )

    hidden, kwargs = mixer_arguments(
        list(inspect.signature(module.forward).parameters), args, kwargs
    )
    n, half = hidden.shape[1], hidden.shape[1] // 2
    tol = 1e-3 if hidden.dtype == torch.float32 else 5e-2

    other = hidden.flip(1)  # a second sequence, so the decode rows run as a batch, as in the engine

    def pieces(lengths: list[int], spec: MixerSpec = spec) -> torch.Tensor:
        """Both sequences, cut into ``lengths`` (each step runs a piece of each); the outputs of each."""
        store = StateStore(StateLayout((spec,)), 2, hidden.device)
        outs, start = [], 0
        for length in lengths:
            plan = StatePlan.build([length, length], [start, start], [0, 1], hidden.device)
            x = torch.cat(
                [hidden[:, start : start + length], other[:, start : start + length]], dim=1
            )
            y = mixer_output(stepped_forward(module.forward, spec, store, plan)(x, **kwargs))[0]
            outs.append(y.unflatten(1, (2, length)))
            start += length
        return torch.cat(outs, dim=2).float()

    with torch.inference_mode():
        whole = torch.stack(
            [mixer_output(module(hidden, **kwargs))[0], mixer_output(module(other, **kwargs))[0]],
            dim=1,
        ).float()
        by_token = pieces([half] + [1] * (n - half))
        chunked = pieces([half, n - half])
        kernel = _checked_kernel(module, spec, hidden, by_token, pieces, module_path)
    if not _close(whole, by_token, tol):
        raise StateProbeError(
            f"{module_path} ({type(module).__name__})",
            "continued one token at a time from a state "
            "it wrote, it gives other outputs than over the whole sequence at once (max difference "
            f"{float((whole - by_token).abs().max()):.2e}): its state cannot be carried between steps",
        )
    return _close(whole, chunked, tol), kernel


def _checked_kernel(
    module: torch.nn.Module,
    spec: MixerSpec,
    hidden: torch.Tensor,
    by_token: torch.Tensor,
    pieces: Any,
    module_path: str,
) -> str | None:
    """paged_hf's CPU kernel for this mixer's decode path where it gives the mixer's own outputs
    token by token (to rounding), else None."""
    from ..execution.cpu import mixer_kernels

    half, n = hidden.shape[1] // 2, hidden.shape[1]
    kernel = None
    sites = mixer_kernels.sites_of(module) if hidden.device.type == "cpu" else []
    if sites and mixer_kernels.available():
        calls = mixer_kernels.calls
        try:
            with mixer_kernels.installed(sites):
                with_kernel = pieces(
                    [half] + [1] * (n - half),
                    dataclasses.replace(spec, kernel=mixer_kernels.KIND),
                )
        except Exception as e:  # noqa: BLE001 - the model's own code serves it: slower, same outputs
            logger.warning(
                "paged_hf: %s runs without paged_hf's %s kernel, which failed on it: %s: %s",
                module_path,
                mixer_kernels.KIND,
                type(e).__name__,
                e,
            )
        else:
            # the same math in another order: fp32 rounding, or one step of the output's dtype
            if mixer_kernels.calls > calls and _close(
                by_token,
                with_kernel,
                1e-5 if hidden.dtype == torch.float32 else 2 * torch.finfo(hidden.dtype).eps,
            ):
                kernel = mixer_kernels.KIND
    return kernel


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return float((a - b).abs().max()) <= tol * float(a.abs().max().clamp(min=1e-6))


def _layout_from(model: torch.nn.Module, cache: Any, calls: list[CacheCall]) -> StateLayout:
    names = {id(m): name for name, m in model.named_modules()}
    pairs = own_state_methods(type(cache))
    pair_of = {name: pair for pair in pairs for name in pair}
    by_module: dict[int, tuple[torch.nn.Module, list[CacheCall]]] = {}
    for call in calls:
        if call.module is None:
            raise StateProbeError(
                "its forward", f"{call.method} was called outside any module handed the cache"
            )
        by_module.setdefault(id(call.module), (call.module, []))[1].append(call)
    mixers, seen_layers = [], set()
    for module, its in by_module.values():
        module_path = f"{names.get(id(module), '?')} ({type(module).__name__})"
        layers = {c.layer_idx for c in its}
        if len(layers) != 1 or not isinstance(next(iter(layers)), int):
            raise StateProbeError(
                module_path,
                f"reads the states of layers {sorted(map(str, layers))}; one module must "
                "keep one layer's state",
            )
        layer_idx = next(iter(layers))
        if layer_idx in seen_layers:
            raise StateProbeError(
                module_path, f"keeps the state of layer {layer_idx}, as another module does"
            )
        seen_layers.add(layer_idx)
        sig = inspect.signature(module.forward).parameters
        cache_arg = next((n for n in CACHE_ARGS if n in sig), None)
        if cache_arg is None:
            raise StateProbeError(module_path, f"takes the cache by none of {CACHE_ARGS}")
        used = [pair for pair in pairs if any(pair_of.get(c.method) == pair for c in its)]
        if used:
            if any(c.method in STATE_METHODS for c in its):
                raise StateProbeError(
                    module_path,
                    f"keeps its state both through transformers' cache API and through "
                    f"{used[0][0]} / {used[0][1]} of {type(cache).__name__}",
                )
            spec = _own_pairs_spec(its, used, module_path)
        else:
            spec = _unified_spec(cache.layers[layer_idx], max(c.state_idx for c in its) + 1)
        conv, conv_dtypes, rec, rec_dtypes = spec
        if all(s is None for s in conv + rec):
            raise StateProbeError(
                module_path, "called the state API but left no state in the cache"
            )
        mixers.append(
            MixerSpec(
                layer_idx,
                names[id(module)],
                _kind(module, model.config.model_type),
                cache_arg,
                conv,
                conv_dtypes,
                rec,
                rec_dtypes,
                own_methods=tuple(used),
            )
        )
    return StateLayout(tuple(sorted(mixers, key=lambda m: m.layer_idx)))


def _shape_dtype(t: Any) -> tuple[tuple[int, ...] | None, str | None]:
    return (tuple(t.shape[1:]), str(t.dtype)[6:]) if isinstance(t, torch.Tensor) else (None, None)


def _unified_spec(layer: Any, n: int) -> tuple:
    """Shapes and dtypes of the states a mixer left in its ``LinearAttentionLayer`` (per state_idx)."""
    conv = [_shape_dtype(layer.conv_states.get(i)) for i in range(n)]
    rec = [_shape_dtype(layer.recurrent_states.get(i)) for i in range(n)]
    return (
        tuple(s for s, _ in conv),
        tuple(d for _, d in conv),
        tuple(s for s, _ in rec),
        tuple(d for _, d in rec),
    )


def _own_pairs_spec(
    calls: list[CacheCall], pairs: list[tuple[str, str]], module_path: str
) -> tuple:
    """A mixer that keeps its state through its own cache's get_X / set_X pairs: recurrent state i is
    what it last handed ``pairs[i]``'s set_X (no conv state)."""
    rec = []
    for get, put in pairs:
        stored = [c.value for c in calls if c.method == put]
        if not stored or not isinstance(stored[-1], torch.Tensor):
            raise StateProbeError(module_path, f"called {get} but never handed {put} a tensor")
        rec.append(_shape_dtype(stored[-1]))
    return (
        (None,) * len(pairs),
        (None,) * len(pairs),
        tuple(s for s, _ in rec),
        tuple(d for _, d in rec),
    )
