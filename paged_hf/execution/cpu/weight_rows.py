"""A bf16 GEMM for steps of few rows that reads each weight where transformers keeps it
(``csrc/weight_rows_gemm.cpp``): no copy, on every x86 CPU with AVX2 and FMA.

At a few rows a decode step's GEMMs are the time it takes to read the weights. This kernel
streams ``module.weight`` itself ([N, K] row-major bf16; siblings such as q/k/v read side by
side, never concatenated), so the weights are held once, an optimizer step or an adapter switch
needs no repacking, and a CPU without AVX-512 bf16 gets a few-row path too. Its sums are fp32 in
another order than oneDNN's, so an output may be the bf16 value next to ``F.linear``'s
(``roundings.within_a_rounding``, checked here once per process before any use); a row's bits do
not depend on how many rows came with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .roundings import within_a_rounding

_CHECKED: list[bool] = []


def available() -> bool:
    """Whether the kernel serves here: built (AVX2+FMA or more) and within a rounding of
    ``F.linear`` on random data at a few row counts, with and without bias, on one weight and on
    siblings side by side."""
    if not _CHECKED:
        _CHECKED.append(_built() and _check())
    return _CHECKED[0]


def build() -> str | None:
    """Which lanes this CPU's build runs ("avx2", "avx512", "avx512_bf16"), or None unbuilt."""
    return torch.ops.paged_hf.weight_rows_build() if _built() else None


def _built() -> bool:
    from . import ops

    return ops.load() and hasattr(torch.ops.paged_hf, "weight_rows_gemm")


def _check() -> bool:
    g = torch.Generator().manual_seed(0)
    # K not a multiple of any build's step, N not of its 4 rows a block
    ws = [(torch.randn(n, 98, generator=g) * 0.1).bfloat16() for n in (70, 9)]
    bs = [torch.randn(n, generator=g).bfloat16() for n in (70, 9)]
    for weights, biases in ((ws[:1], None), (ws, bs)):
        whole = torch.cat(weights)
        bias = None if biases is None else torch.cat(biases)
        for rows in (*range(1, 10), 23):
            x = torch.randn(rows, 98, generator=g).bfloat16()
            got, want = gemm(x, weights, biases), F.linear(x, whole, bias)
            if got.dtype != torch.bfloat16 or not within_a_rounding(got, want, x, whole):
                return False
    return True


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel reads this weight in place: a plain [N, K] contiguous bf16 tensor."""
    return (
        type(weight) in (torch.Tensor, torch.nn.Parameter)
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.device.type == "cpu"
    )


def gemm(
    rows: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """``[M, K]`` contiguous bf16 rows against the weights side by side: ``[M, sum N]`` bf16.
    Biases are added in fp32 (as ``F.linear``'s bf16 bias is, inside its sum)."""
    fp32 = [None if b is None else b.detach().float() for b in (biases or [None] * len(weights))]
    return torch.ops.paged_hf.weight_rows_gemm(rows, [w.detach() for w in weights], fp32)
