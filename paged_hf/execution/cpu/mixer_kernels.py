"""A CPU kernel for hybrid models' gated-DeltaNet decode, at the seam transformers uses for fla's.

Design notes: docs/internals.md, paged_hf/execution/cpu/mixer_kernels.py.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from . import kernel_seams

KIND = "C++ gated delta rule"
RULE_NAME = "torch_recurrent_gated_delta_rule"
RULE_PARAMS = (
    "query",
    "key",
    "value",
    "g",
    "beta",
    "initial_state",
    "output_final_state",
    "use_qk_l2norm_in_kernel",
)
calls = 0  # kernel calls in this process (the probe checks its mixer reached the kernel)


def sites_of(module: torch.nn.Module) -> list[kernel_seams.Site]:
    """(python module, name) of the recurrent gated-delta rule a mixer's forward calls, if any."""
    return kernel_seams.functions_named(module, RULE_NAME, RULE_PARAMS)


def available() -> bool:
    from . import ops

    return ops.load()


def installed(sites: list[kernel_seams.Site]) -> contextlib.AbstractContextManager:
    """The kernel's entry point under those names while the block runs."""
    return kernel_seams.installed(sites, _rule)


@contextlib.contextmanager
def enabled(on: bool, writable: list[torch.Tensor]) -> Iterator[None]:
    """Within the block, on this thread, the kernel serves the rule; ``writable``: states it may
    update in place (the step's own)."""
    with kernel_seams.switch("gated_delta", (on, writable)):
        yield


def _rule(original: Callable) -> Callable:
    def rule(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        on, writable = kernel_seams.setting("gated_delta") or (False, ())
        if not (on and _serves(query, key, value, g, beta, initial_state, kwargs)):
            return original(
                query,
                key,
                value,
                g=g,
                beta=beta,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                **kwargs,
            )
        return recurrent(
            query,
            key,
            value,
            g,
            beta,
            initial_state,
            output_final_state,
            use_qk_l2norm_in_kernel,
            in_place=any(initial_state is t for t in writable),
        )

    rule.__name__ = rule.__qualname__ = RULE_NAME
    rule.__wrapped__ = original
    return rule


def _serves(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    kwargs: dict,
) -> bool:
    if any(kwargs.get(name) is not None for name in ("cu_seqlens", "seq_idx")):
        return False
    tensors = (query, key, value, g, beta) + (() if state is None else (state,))
    if any(t.device.type != "cpu" or not t.is_floating_point() for t in tensors):
        return False
    b, length, hk, dk = query.shape
    hv, dv = value.shape[-2:]
    return (
        key.shape == query.shape
        and value.shape[:2] == (b, length)
        and hv % hk == 0
        and g.shape == beta.shape == (b, length, hv)
        and (state is None or state.shape == (b, hv, dk, dv))
    )


def recurrent(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    l2norm: bool,
    in_place: bool = False,
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
    torch.ops.paged_hf.gated_delta_recurrent(
        f32(query), f32(key), f32(value), f32(g), f32(beta), state, out, bool(l2norm)
    )
    calls += 1
    return out.to(query.dtype), (state if output_final_state else None)
