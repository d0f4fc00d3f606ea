"""A CPU kernel for hybrid models' gated-DeltaNet decode, at the seam transformers uses for fla's.

transformers' gated-DeltaNet mixers (Qwen3.5, Qwen3-Next, OLMo-hybrid, ...) call a module-level
``torch_recurrent_gated_delta_rule`` for single-token steps: fla's fused kernel when fla is
installed (on a GPU), else a torch fallback that makes some ten passes over every [Dk, Dv] state
per token, each a new tensor. On a CPU that fallback was 40% of a hybrid's engine time. During an
engine step, and only for the mixers the capability probe checked it on (on the model itself,
against the fallback), that name answers with ``paged_hf::gated_delta_recurrent``
(paged_hf/execution/csrc/gated_delta.cpp): the same recurrence, each state read and written once,
in place in the state slots when the state is the step's own (the cache view's). Everything else
(another thread, a plain forward, a GPU tensor, varlen arguments) goes to the function that was
there. The module names are put back when no step needs them.

    with installed(sites_of(module)):          # around the step
        with enabled(spec.kernel is not None, view.given):   # around one mixer call
            module(...)
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from typing import Any, Callable, Iterator

import torch

KIND = "C++ gated delta rule"
RULE_NAME = "torch_recurrent_gated_delta_rule"
RULE_PARAMS = ("query", "key", "value", "g", "beta", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel")

_local = threading.local()  # .on: the current mixer call may use the kernel; .writable: its view's states
_lock = threading.Lock()
_installed: dict[tuple[str, str], list] = {}  # (module, name) -> [steps using it, the original]
calls = 0  # kernel calls in this process (the probe checks its mixer reached the kernel)


def sites_of(module: torch.nn.Module) -> list[tuple[str, str]]:
    """(python module, name) of the recurrent gated-delta rule a mixer's forward calls, if any."""
    python_module = sys.modules.get(type(module).__module__)
    found = []
    for name, fn in vars(python_module or object()).items():
        if callable(fn) and getattr(fn, "__name__", None) == RULE_NAME and _takes_rule_params(fn):
            found.append((python_module.__name__, name))
    return found


def _takes_rule_params(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(p in params for p in RULE_PARAMS)


def available() -> bool:
    from .backends import cpu_paged_attention
    return cpu_paged_attention.load()


@contextlib.contextmanager
def installed(sites: list[tuple[str, str]]) -> Iterator[None]:
    """The kernel's entry point under those names while the block runs (counted: steps of
    several engines may overlap)."""
    taken = []
    try:
        with _lock:
            for site in sites:
                entry = _installed.get(site)
                if entry is None:
                    module = sys.modules[site[0]]
                    original = getattr(module, site[1])
                    entry = _installed[site] = [0, original]
                    setattr(module, site[1], _rule(original))
                entry[0] += 1
                taken.append(site)
        yield
    finally:
        with _lock:
            for site in taken:
                entry = _installed[site]
                entry[0] -= 1
                if entry[0] == 0:
                    setattr(sys.modules[site[0]], site[1], entry[1])
                    del _installed[site]


@contextlib.contextmanager
def enabled(on: bool, writable: list[torch.Tensor]) -> Iterator[None]:
    """Within the block, on this thread, the kernel serves the rule; ``writable``: states it may
    update in place (the step's own)."""
    before = getattr(_local, "on", False), getattr(_local, "writable", ())
    _local.on, _local.writable = on, writable
    try:
        yield
    finally:
        _local.on, _local.writable = before


def _rule(original: Callable) -> Callable:
    def rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             initial_state: torch.Tensor | None = None, output_final_state: bool = False,
             use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not (getattr(_local, "on", False) and _serves(query, key, value, g, beta, initial_state, kwargs)):
            return original(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)
        return recurrent(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                         in_place=any(initial_state is t for t in _local.writable))
    rule.__name__ = rule.__qualname__ = RULE_NAME
    rule.__wrapped__ = original
    return rule


def _serves(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor | None, kwargs: dict) -> bool:
    if any(kwargs.get(name) is not None for name in ("cu_seqlens", "seq_idx")):
        return False
    tensors = (query, key, value, g, beta) + (() if state is None else (state,))
    if any(t.device.type != "cpu" or not t.is_floating_point() for t in tensors):
        return False
    b, length, hk, dk = query.shape
    hv, dv = value.shape[-2:]
    return (key.shape == query.shape and value.shape[:2] == (b, length) and hv % hk == 0
            and g.shape == beta.shape == (b, length, hv) and (state is None or state.shape == (b, hv, dk, dv)))


def recurrent(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor | None, output_final_state: bool, l2norm: bool, in_place: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' recurrent gated delta rule through the C++ kernel; ``in_place``: the final
    state is written over ``initial_state`` (fp32, contiguous) and returned as it."""
    global calls
    b, length, _, dk = key.shape
    hv, dv = value.shape[-2:]

    def f32(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32).contiguous()

    if in_place and initial_state.dtype == torch.float32 and initial_state.is_contiguous():
        state = initial_state
    elif initial_state is None:
        state = torch.zeros(b, hv, dk, dv, dtype=torch.float32)
    else:
        state = initial_state.to(torch.float32, copy=True).contiguous()
    out = torch.empty(b, length, hv, dv, dtype=torch.float32)
    torch.ops.paged_hf.gated_delta_recurrent(f32(query), f32(key), f32(value), f32(g), f32(beta), state, out,
                                             bool(l2norm))
    calls += 1
    return out.to(query.dtype), (state if output_final_state else None)
