"""``EngineConfig(batch_invariant=True)`` on a CPU: what makes a row's result independent of the
step around it, and the refusal, with its reason, wherever that cannot be had.

A bf16 model's tokens depend on the shapes its rows were computed in: oneDNN's bf16 GEMM picks its
kernels, and so its order of sums, by the row count, and a row of an 18-row prompt tail differs
by a bf16 rounding from the same row inside a 450-row prompt. Greedy tokens then fork now and
then, so a prompt whose prefix came from the prefix cache or a KV tier (its tail computed alone)
can decode otherwise than the same prompt computed whole (16 of 100 lm-eval outputs, in bf16).
What is row-invariant here, checked: oneDNN's bf16 GEMM called on 16 or 32 rows at a time (it sums
a row alike at both; ``PackedWeight._by_tiles``), its fp32 GEMM on fp32 copies of the weights (CPUs
without bf16 matmuls), the CPU kernel's bf16 attention paths (tests/kernels/
test_cpu_paged_attention.py), and the per-row ops (norms, rotary, activations, sampling). Not: the
fp32 attention kernel, SDPA, Inductor's decode, a linear recurrence's chunked scan, experts outside
``nn.Linear``.
"""

from __future__ import annotations

import torch

from ...cache.coherence import sharded_parameter
from . import linear as cpu_linear

_ROWS_CHECKED: dict[tuple[str, int, int], bool] = {}


def gemm_rows_invariant(how: str, in_features: int = 256, out_features: int = 320) -> bool:
    """Whether a row-invariant ``PackedWeight`` packed ``how`` gives each row the same bits at any
    row count on this machine, at this shape (oneDNN picks its kernels by shape; checked once per
    process and shape, on random data)."""
    key = (how, in_features, out_features)
    if key not in _ROWS_CHECKED:
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(out_features, in_features, generator=g) * 0.05).bfloat16()
        x = torch.randn(90, in_features, generator=g).bfloat16()
        try:
            weight = cpu_linear.PackedWeight(how, [w], None, row_invariant=True)
            whole = weight(x)
            ok = all(
                torch.equal(weight(x[lo:hi].contiguous()), whole[lo:hi])
                for lo, hi in ((89, 90), (3, 8), (10, 27), (1, 34), (0, 64), (5, 90))
            )
        except (RuntimeError, AttributeError):  # no mkldnn ops in this torch build
            ok = False
        _ROWS_CHECKED[key] = ok
    return _ROWS_CHECKED[key]


def _gemm_shapes(packed: cpu_linear.PackedLinears) -> set[tuple[int, int]]:
    """(in, out) of every GEMM the packed linears may run: each module's, each sibling group's."""
    shapes = {(m.in_features, m.out_features) for m in packed.modules}
    for group in packed.siblings:
        shapes.add((group[0].in_features, sum(m.out_features for m in group)))
    return shapes


def refusal(
    model: torch.nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    stateful: bool,
    packed: cpu_linear.PackedLinears | None,
    bf16_attention: bool,
) -> str | None:
    """Why ``batch_invariant=True`` cannot hold for this model here (None: it holds)."""
    if device.type != "cpu":
        return (
            f"on {device.type} (FlashInfer's and cuBLAS's kernels pick their splits by batch); "
            "it is CPU-only"
        )
    sharded = sharded_parameter(model)
    if sharded is not None:
        return (
            f"for tensor-parallel models ({sharded} is a DTensor): their linears run transformers' "
            "own GEMMs on the shards, which sum by shape"
        )
    if dtype != torch.bfloat16:
        return f"for {dtype} models (the CPU attention kernel's fp32 path is not row-invariant); bf16 only"
    if stateful:
        return "for models with recurrent layers (their chunked scans sum by chunk)"
    if not bf16_attention:
        return (
            "without the CPU attention kernel's bf16 path (it needs the C++ kernel built, AVX-512, "
            "blocks dividing 16 and head dims multiples of 32); SDPA sums by shape"
        )
    if packed is None:
        return "without packed linears (no oneDNN here, or cpu_packed_weights=False)"
    linears = {id(p) for m in packed.modules for p in m.parameters(recurse=False)}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        for pname, param in module.named_parameters(recurse=False):
            if param.dim() >= 2 and id(param) not in linears:
                return (
                    f"for this model: {name}.{pname} ({tuple(param.shape)}) is a matrix outside "
                    "nn.Linear (experts, a custom layer), computed by GEMMs that sum by shape"
                )
    # last: the only check that computes (each GEMM shape once per process)
    for k, n in sorted(_gemm_shapes(packed)):
        if not gemm_rows_invariant(packed.how, k, n):
            return (
                f"here: this machine's oneDNN GEMM ({packed.how}, {k} x {n}) sums rows by row count"
            )
    return None
