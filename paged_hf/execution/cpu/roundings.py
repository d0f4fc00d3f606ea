"""How far apart two bf16 or fp32 results of the same product may be: one bf16 rounding, or fp32's
error for another order of the sum (the packed fp32 way and the few-row kernel are held to it).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def one_rounding_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: bf16 ``a`` equals ``b`` or is the bf16 value next to it (one unit in the last place)."""
    ia, ib = a.view(torch.int16).to(torch.int32), b.view(torch.int16).to(torch.int32)
    # bf16 bit patterns as a monotone integer line: negatives mirrored below zero
    ia = torch.where(ia < 0, -32768 - ia, ia)
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return (ia - ib).abs() <= 1


def within_a_rounding(
    got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor
) -> bool:
    """``got`` and ``want``, two results of ``x @ w.T`` (+ bias) summed in fp32 in different orders, part by
    no more than that: each element one bf16 rounding apart (bf16), or by less than 1e-5 of the sum of
    the magnitudes of its products (fp32's error for another order of the sum; near-zero results of
    large products may part by more than a bf16 step)."""
    order = 1e-5 * (x.abs().float() @ w.abs().float().T)
    close = (got.float() - want.float()).abs() <= order
    if got.dtype == torch.bfloat16:
        close |= one_rounding_apart(got, want)
    return bool(close.all())


def agrees_with_f_linear(gemm: Callable, widths: tuple[int, ...], k: int = 98) -> bool:
    """Whether ``gemm(x, weights, biases)`` (bf16 rows against bf16 weights of ``widths`` side by
    side, their biases or None) is bf16 and within a rounding of ``F.linear`` on the weights
    concatenated, on random data: at 1-9 and 23 rows, without and with biases; ``k`` off every
    kernel's step (a kernel's check before any use)."""
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * 0.1).bfloat16() for n in widths]
    biases = [torch.randn(n, generator=g).bfloat16() for n in widths]
    whole = torch.cat(weights)
    for bias in (None, biases):
        for rows in (*range(1, 10), 23):
            x = torch.randn(rows, k, generator=g).bfloat16()
            got = gemm(x, weights, bias)
            want = F.linear(x, whole, None if bias is None else torch.cat(bias))
            if got.dtype != torch.bfloat16 or not within_a_rounding(got, want, x, whole):
                return False
    return True
