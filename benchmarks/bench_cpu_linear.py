#!/usr/bin/env python
"""The linear layers' ways on this CPU, side by side: what ``cpu_packed_weights`` chooses among.

    python benchmarks/bench_cpu_linear.py --threads 2           # SmolLM2-135M's GEMM shapes
    python benchmarks/bench_cpu_linear.py --rows 1,8,64 --out linear.json
    python benchmarks/bench_cpu_linear.py --model 1.7b --rows 1,8,32 --metric gbps

For each weight shape of SmolLM2-135M (or SmolLM2-1.7B's, Llama-3-8B's: ``--model``; q/k/v and
gate/up fused as the engine runs them, o, down, the lm_head) and each row count, GFLOP/s (or the
weight's GB/s, ``--metric gbps``: at a few rows a GEMM is reading its weight) of:

- ``F.linear bf16``: transformers' own call on bf16 weights;
- ``oneDNN bf16``: the weight packed once for oneDNN's bf16 matmul (``cpu_packed_weights="onednn"``;
  only where the CPU has a bf16 matmul: AVX-512 bf16 or AMX);
- ``few-row kernel bf16``: paged_hf's own GEMM on its copy of the weight (``cpu_small_row_gemm``,
  which the engine runs up to ``small_rows.max_rows()`` rows; only where AVX-512 bf16 built it);
- ``weight-rows kernel bf16``: paged_hf's GEMM on the weight where transformers keeps it, no copy
  (``weight_rows.py``; AVX2, AVX-512 or AVX-512 bf16 lanes, whichever this CPU has);
- ``oneDNN fp32 (bf16 in/out)``: an fp32 copy packed for oneDNN, input cast up, output rounded to
  bf16 (``"fp32"``, the default on CPUs without a bf16 matmul);
- ``F.linear fp32``: an fp32 model's call, for scale.

Each is the median of 5 timed runs of at least 20 ms. Prints a table and writes JSON.
"""

from __future__ import annotations

import datetime
import sys

import common
import omp_env

OMP_WAIT_POLICY = omp_env.setup()  # before torch: OpenMP reads its wait policy when libgomp loads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from paged_hf.execution.cpu import linear as cpu_linear  # noqa: E402
from paged_hf.execution.cpu import small_rows, weight_rows  # noqa: E402

MODELS = {
    # SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, intermediate 1536, vocabulary 49152
    "135m": {
        "q/k/v": (960, 576),
        "o": (576, 576),
        "gate/up": (3072, 576),
        "down": (576, 1536),
        "lm_head": (49152, 576),
    },
    # SmolLM2-1.7B: hidden 2048, 32 heads of 64 (no GQA), intermediate 8192, vocabulary 49152
    "1.7b": {
        "q/k/v": (6144, 2048),
        "o": (2048, 2048),
        "gate/up": (16384, 2048),
        "down": (2048, 8192),
        "lm_head": (49152, 2048),
    },
    # Llama-3-8B: hidden 4096, 32 query heads and 8 KV heads of 128, intermediate 14336, vocab 128256
    "8b": {
        "q/k/v": (6144, 4096),
        "o": (4096, 4096),
        "gate/up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    },
}


def ways(w16: torch.Tensor) -> dict:
    w32 = w16.float()
    out = {"F.linear bf16": lambda x: F.linear(x, w16)}
    if cpu_linear.mode(torch.bfloat16, torch.device("cpu")) == cpu_linear.ONEDNN:
        out["oneDNN bf16"] = cpu_linear.PackedWeight(cpu_linear.ONEDNN, [w16], None)
    if small_rows.available():
        few = small_rows.SmallRowsWeight(w16, None)
        out["few-row kernel bf16"] = lambda x: few(x.view(-1, x.shape[-1]))
    if weight_rows.available():
        out["weight-rows kernel bf16"] = lambda x: weight_rows.gemm(x.view(-1, x.shape[-1]), [w16])
    out["oneDNN fp32 (bf16 in/out)"] = cpu_linear.PackedWeight(cpu_linear.FP32, [w16], None)
    out["F.linear fp32"] = lambda x: F.linear(x.float(), w32)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--rows", default="1,8,32,128,512", help="comma list of row counts")
    ap.add_argument("--model", choices=list(MODELS), default="135m", help="whose shapes")
    ap.add_argument("--metric", choices=["gflops", "gbps"], default="gflops")
    ap.add_argument("--ways", help="comma list: only the ways whose names contain one of these")
    common.add_threads(ap, help="torch threads (default: all cores)")
    common.add_omp(ap)
    ap.add_argument("--out", help="JSON path (default benchmarks/results/cpu-linear-<date>.json)")
    args = common.parse(ap, argv)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = MODELS[args.model]
    g = torch.Generator().manual_seed(0)
    results = []
    with torch.inference_mode():
        for name, (n, k) in shapes.items():
            w16 = torch.randn(n, k, generator=g, dtype=torch.bfloat16)
            fns = ways(w16)
            if args.ways:
                wanted = args.ways.split(",")
                fns = {w: f for w, f in fns.items() if any(part in w for part in wanted)}
            for m in rows:
                x = torch.randn(1, m, k, generator=g).bfloat16()
                for way, fn in fns.items():
                    s = common.seconds(lambda: fn(x), repeats=5, min_time=0.02)
                    row = {"weight": name, "shape": [n, k], "rows": m, "way": way, "ms": s * 1e3}
                    results.append(
                        row | {"gflops": 2 * m * n * k / s / 1e9, "gbps": 2 * n * k / s / 1e9}
                    )
                common.log(
                    f"{name} rows {m}: "
                    + ", ".join(f"{r['way']} {r[args.metric]:.1f}" for r in results[-len(fns) :])
                )
            del fns, w16
    names = list(dict.fromkeys(r["way"] for r in results))
    print(
        f"\n## Linear layers on this CPU, {'weight GB/s' if args.metric == 'gbps' else 'GFLOP/s'} "
        f"({args.model}'s shapes, {torch.get_num_threads()} threads, "
        f"default way here: {cpu_linear.mode(torch.bfloat16, torch.device('cpu'))}, OpenMP {OMP_WAIT_POLICY})\n"
    )
    cells = []
    for name, (n, k) in shapes.items():
        for m in rows:
            got = {
                r["way"]: r[args.metric] for r in results if r["weight"] == name and r["rows"] == m
            }
            cells.append([f"{name} {n}x{k}", m] + [f"{got[w]:.1f}" for w in names])
    print(common.md_table(["weight", "rows", *names], cells, ["---", *["---:"] * (len(names) + 1)]))
    print()
    report = {"date": datetime.date.today().isoformat(), "threads": torch.get_num_threads()}
    report["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    report["model_shapes"] = args.model
    report["weight_rows_build"] = weight_rows.build()
    report["default_way"] = cpu_linear.mode(torch.bfloat16, torch.device("cpu"))
    common.write_json(args.out or common.stamped("cpu-linear"), report | {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
