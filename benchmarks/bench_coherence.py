"""What the weight watch costs (paged_hf/cache/coherence.py): per step, and per rescan.

    python benchmarks/bench_coherence.py                 # SmolLM2-135M and a 7B-like layout, 2 threads
    python benchmarks/bench_coherence.py --big-params 7e9   # the 7B-like layout at full size (14 GB in bf16)

Per step the engine reads every tensor's version counter and storage, and the adapter state;
at a rescan (the start of every generate call, and at most once a second while stepping) it
finds the tensors again and compares a content sample. The 7B-like model is Llama-2-7B's
layout (32 layers of 9 tensors, embeddings, norm, head: 291 tensors) filled with random bf16
values, scaled to ``--big-params`` in all. Prints a table (median of ``--repeat`` timings, in
microseconds) and writes JSON.
"""

from __future__ import annotations

import sys

import common
import torch

from paged_hf.cache.coherence import WeightsWatch


class _Params(torch.nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes
        )


def llama7b_like(total: float, dtype: torch.dtype) -> torch.nn.Module:
    hidden, inter, vocab, layers = 4096, 11008, 32000, 32
    layer = [(hidden, hidden)] * 4 + [(inter, hidden)] * 2 + [(hidden, inter)] + [(hidden,)] * 2
    shapes = [(vocab, hidden)] + layer * layers + [(hidden,), (vocab, hidden)]
    full = sum(torch.Size(s).numel() for s in shapes)
    scale = (total / full) ** 0.5  # shrink both sides of every matrix alike
    return _Params([tuple(max(1, int(d * scale)) for d in s) for s in shapes], dtype)


def timed(fn, repeat: int) -> float:
    """Median microseconds of ``fn``."""
    return common.seconds(fn, repeat) * 1e6


def measure(name: str, model: torch.nn.Module, repeat: int) -> dict:
    watch = WeightsWatch(model)
    tensors = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    params = sum(p.numel() for p in model.parameters())
    row = {"model": name, "tensors": tensors, "params": params}
    step = lambda: (watch.changed(), watch.adapter_state())  # noqa: E731
    return row | {
        "per step: versions + adapter state (us)": timed(step, repeat),
        "rescan: find tensors and sample views (us)": timed(watch._rescan, repeat),
        "rescan: content sample (us)": timed(watch._sample, repeat),
        "whole rescan check (us)": timed(lambda: watch.changed(rescan=True), repeat),
    }


def main() -> int:
    parser = common.parser(__doc__)
    common.add_threads(parser, default=2)
    parser.add_argument("--repeat", type=int, default=50)
    h = "parameters of the 7B-like layout"
    parser.add_argument("--big-params", type=float, default=2e9, help=h)
    parser.add_argument("--json", default="benchmarks/results/coherence.json")
    args = common.parse(parser)
    rows = [measure("SmolLM2-135M (bf16)", common.default_model()[0], args.repeat)]
    big = f"Llama-7B layout, {args.big_params / 1e9:.1f} B params (bf16)"
    rows.append(measure(big, llama7b_like(args.big_params, torch.bfloat16), args.repeat))
    cells = [[f"{v:,.0f}" if isinstance(v, (int, float)) else v for v in r.values()] for r in rows]
    print(common.md_table(list(rows[0]), cells))
    common.write_json(args.json, {"threads": args.threads, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
