"""A bf16 GEMM for steps of few rows on CPUs with AVX-512 bf16 (``csrc/small_rows_gemm.cpp``).

At a few rows a decode step's GEMMs are the time it takes to read the weights, and oneDNN's bf16
GEMM reads them at about half the rate memory gives (SmolLM2, 2 cores: ~20 GB/s against ~35-40).
This kernel streams a copy of each weight laid out for it, once a step, each load serving 8 rows.
Its sums are fp32 in another order than oneDNN's, so an output may be the bf16 value next to
oneDNN's (``roundings.within_a_rounding``, checked here once per process before any use).
``PackedWeight`` takes it up to ``max_rows()`` rows unless packed row-invariant
(``batch_invariant=True``).
"""

from __future__ import annotations

import torch

from . import isa
from .roundings import agrees_with_f_linear

# rows it serves: a step's token budget (512). It measured 1.4-2.4x oneDNN's bf16 GEMM at 1-8 rows,
# 1.1-1.3x at 32, 1.0-1.1x at 512 (AMD Zen 4, 2 threads, SmolLM2's shapes: bench_cpu_linear.py);
# above, a blocking call's 2048-token steps stay oneDNN's. Where the CPU has AMX, oneDNN runs tile
# products from 16 rows on, not measured against this, so there it serves 1-8 rows only
ROWS, ROWS_BESIDE_AMX = 512, 8
_CHECKED: list[bool] = []


def max_rows() -> int:
    """Up to how many rows a GEMM runs on this kernel on this CPU."""
    return ROWS_BESIDE_AMX if isa.at_least("amx") else ROWS


def available() -> bool:
    """Whether the kernel serves here: built (an AVX-512 bf16 CPU) and within a rounding of
    ``F.linear`` on random data at a few row counts (each 8 and the rest), with and without bias."""
    if not _CHECKED:
        _CHECKED.append(_built() and _check())
    return _CHECKED[0]


def _built() -> bool:
    from . import ops

    return ops.load() and hasattr(torch.ops.paged_hf, "small_rows_gemm")


def _check() -> bool:
    # a tile and a part (70 columns), K not 32's multiple
    def gemm(x, weights, biases):
        return SmallRowsWeight(weights[0], None if biases is None else biases[0])(x)

    return agrees_with_f_linear(gemm, (70,))


def fits(weight: torch.Tensor) -> bool:
    """Whether a weight of this shape and dtype can be packed for the kernel."""
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 2 == 0


class SmallRowsWeight:
    """One GEMM's weight ([N, K] bf16, a sibling group's concatenated) packed for the kernel; called
    on [M, K] contiguous bf16 rows, M >= 1."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        with torch.no_grad():
            self.packed = torch.ops.paged_hf.small_rows_pack(weight.detach())
            self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.paged_hf.small_rows_gemm(rows, self.packed, self.bias, self.out_features)
