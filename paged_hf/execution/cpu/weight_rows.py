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

from .roundings import agrees_with_f_linear

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
    # K off every build's step, N off its 4 rows a block; one weight, and siblings side by side
    return all(agrees_with_f_linear(gemm, widths) for widths in ((70,), (70, 9)))


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel reads this weight in place: a plain [N, K] contiguous bf16 tensor."""
    return (
        type(weight) in (torch.Tensor, torch.nn.Parameter)
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.device.type == "cpu"
    )


def prepared(
    weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The kernel's arguments for these weights, made once (``run`` takes them each step): the
    weights detached (views of the same storage, so in-place updates show) and the biases in fp32
    (as ``F.linear`` adds a bf16 bias, inside its sum)."""
    fp32 = [None if b is None else b.detach().float() for b in (biases or [None] * len(weights))]
    return [w.detach() for w in weights], fp32


def run(
    rows: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> torch.Tensor:
    """``[M, K]`` contiguous bf16 rows against ``prepared`` weights side by side: ``[M, sum N]``."""
    return torch.ops.paged_hf.weight_rows_gemm(rows, weights, biases)


def gemm(
    rows: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """``run`` on weights and biases as they are (preparing them on every call)."""
    return run(rows, *prepared(weights, biases))
