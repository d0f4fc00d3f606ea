"""What a workload must compute, and how fast this machine can compute it.

FLOPs a workload needs (dense decoder; one multiply-add = 2 FLOPs):
    2 * P_layers * needed_tokens                     every linear layer of every block
  + 2 * hidden * vocab * output_tokens               lm_head, only on rows that are sampled
  + 4 * layers * q_heads * head_dim * sum(ctx)       attention: QK^T and PV, ctx = positions the
                                                     token attends to (causal: position + 1)
``needed_tokens`` are the tokens whose KV must be computed by a system with a perfect prefix
cache: every prompt token and every output token but the last, with a shared prefix counted
once. Embedding lookups, norms, RoPE and activations are left out (a few % of the total).

The ceiling is the sustained GEMM rate at the model's own layer shapes, measured in the same
run and dtype: ``torch.matmul([m, in] x [in, out])`` over the q/k/v/o/gate/up/down shapes of one
block, for m in {32, 128, 512} rows; the best of those is the ceiling (lm_head is timed and
reported too). bf16 on a CPU with no bf16 matmul (AVX2; AVX-512 without its bf16 extension), where
torch's bf16 matmul runs at a fifth of fp32's: the fastest way there is to bf16 results, oneDNN's fp32
matmul on packed fp32 copies of the weights with bf16 in and out (what paged_hf runs there). ``utilisation = needed FLOPs / wall / ceiling`` and ``floor = needed FLOPs /
ceiling`` is the time a system would take if it did nothing but the needed GEMMs at that rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import common
import torch
from bench_workloads import Workload

from paged_hf.execution.cpu.linear import native_bf16


@dataclass
class Geometry:
    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> "Geometry":
        c = model.config.get_text_config()
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        sizes = (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads)
        return cls(*sizes, kv_heads, head_dim, c.vocab_size)

    def layer_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear in one decoder block (llama-style)."""
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        attention = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h)}
        return attention | {"gate": (h, i), "up": (h, i), "down": (i, h)}

    @property
    def layer_params(self) -> int:
        return self.layers * sum(i * o for i, o in self.layer_shapes().values())


def _ctx_sum(start: int, end: int) -> int:
    """sum over positions p in [start, end) of (p + 1)."""
    return (end * (end + 1) - start * (start + 1)) // 2


def needed_work(w: Workload, geo: Geometry) -> dict:
    """Needed tokens and FLOPs of a workload (see the module docstring for the formula)."""
    naive = needed = ctx = out = 0
    for i, r in enumerate(w.requests):
        total = len(r.prompt) + r.n_out - 1  # the last output token is never fed back
        skip = w.shared_prefix if (w.shared_prefix and i > 0) else 0
        naive += total
        needed += total - skip
        ctx += _ctx_sum(skip, total)
        out += r.n_out
    linear = 2 * geo.layer_params * needed
    head = 2 * geo.hidden * geo.vocab * out
    attn = 4 * geo.layers * geo.q_heads * geo.head_dim * ctx
    work = {"naive_tokens": naive, "needed_tokens": needed, "output_tokens": out}
    work |= {"flops_linear": linear, "flops_lm_head": head, "flops_attention": attn}
    return work | {"flops": linear + head + attn}


def fp32_for_bf16() -> bool:
    """Whether bf16 GEMMs here are fastest as fp32 ones (a CPU whose oneDNN has no bf16 matmul)."""
    return not native_bf16()


def _matmul(w: torch.Tensor):
    """x @ w the fastest way to w's dtype (see the module docstring)."""
    if w.dtype == torch.bfloat16 and fp32_for_bf16():
        packed = torch.ops.mkldnn._reorder_linear_weight(w.t().float().contiguous(), 64)
        return lambda x: torch.ops.mkldnn._linear_pointwise(
            x.float(), packed, None, "none", [], ""
        ).bfloat16()
    return lambda x: torch.matmul(x, w)


def _time_matmul(x: torch.Tensor, w: torch.Tensor, min_time: float, repeats: int) -> float:
    """Median seconds per call of x @ w over ``repeats`` timed runs of >= min_time each."""
    mm = _matmul(w)
    return common.seconds(lambda: mm(x), repeats, min_time)


def matmul_ceiling(
    geo: Geometry,
    dtype: torch.dtype,
    rows: tuple[int, ...] = (32, 128, 512),
    min_time: float = 0.02,
    repeats: int = 3,
) -> dict:
    """Sustained GFLOP/s of torch.matmul at the model's layer shapes, per row count m."""
    gen = torch.Generator().manual_seed(0)
    shapes = geo.layer_shapes()
    per_m, lm_head = {}, {}
    with torch.inference_mode():
        weights = {k: torch.randn(i, o, generator=gen).to(dtype) for k, (i, o) in shapes.items()}
        head = torch.randn(geo.hidden, geo.vocab, generator=gen).to(dtype)
        for m in rows:
            xs = {i: torch.randn(m, i, generator=gen).to(dtype) for i, _ in shapes.values()}
            flops = secs = 0.0
            for k, (i, o) in shapes.items():
                secs += _time_matmul(xs[i], weights[k], min_time, repeats)
                flops += 2.0 * m * i * o
            per_m[m] = flops / secs / 1e9
            x = torch.randn(m, geo.hidden, generator=gen).to(dtype)
            secs = _time_matmul(x, head, min_time, repeats)
            lm_head[m] = 2.0 * m * geo.hidden * geo.vocab / secs / 1e9
    best = max(per_m, key=per_m.get)
    method = "torch.matmul [m, in] x [in, out]"
    if dtype == torch.bfloat16 and fp32_for_bf16():
        method = "oneDNN fp32 on packed fp32 weights, bf16 in and out (no bf16 matmul on this CPU)"
    method += f" at q/k/v/o/gate/up/down shapes, median of {repeats} runs; ceiling = best m"
    out = {"dtype": str(dtype).removeprefix("torch."), "gflops": per_m[best], "best_rows": best}
    out |= {"layer_gflops_by_rows": per_m, "lm_head_gflops_by_rows": lm_head}
    return out | {"method": method}
