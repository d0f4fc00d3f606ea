"""How far apart two bf16 or fp32 results of the same product may be: one bf16 rounding, or fp32's
error for another order of the sum (the packed fp32 way and the few-row kernel are held to it).
"""

from __future__ import annotations

import torch


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
