#!/usr/bin/env python
"""The linear layers' ways on this CPU, side by side: what ``cpu_packed_weights`` chooses among.

    python benchmarks/bench_cpu_linear.py --threads 2           # SmolLM2-135M's GEMM shapes
    python benchmarks/bench_cpu_linear.py --rows 1,8,64 --out linear.json

For each weight shape of SmolLM2-135M (q/k/v and gate/up fused as the engine runs them, o, down,
the lm_head) and each row count, GFLOP/s of:

- ``F.linear bf16``: transformers' own call on bf16 weights;
- ``oneDNN bf16``: the weight packed once for oneDNN's bf16 matmul (``cpu_packed_weights="onednn"``;
  only where the CPU has a bf16 matmul: AVX-512 bf16 or AMX);
- ``oneDNN fp32 (bf16 in/out)``: an fp32 copy packed for oneDNN, input cast up, output rounded to
  bf16 (``"fp32"``, the default on CPUs without a bf16 matmul);
- ``F.linear fp32``: an fp32 model's call, for scale.

Each is the median of 5 timed runs of at least 20 ms. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import omp_env  # noqa: E402  (before torch: OpenMP reads its wait policy when libgomp loads)

OMP_WAIT_POLICY = omp_env.setup()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from paged_hf.execution.cpu import linear as cpu_linear  # noqa: E402

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, intermediate 1536, vocabulary 49152
SHAPES = {
    "q/k/v": (960, 576),
    "o": (576, 576),
    "gate/up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def _seconds(fn, min_time: float = 0.02, repeats: int = 5) -> float:
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < min_time:
        fn()
        n += 1
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def ways(w16: torch.Tensor) -> dict:
    w32 = w16.float()
    out = {"F.linear bf16": lambda x: F.linear(x, w16)}
    if cpu_linear.mode(torch.bfloat16, torch.device("cpu")) == cpu_linear.ONEDNN:
        out["oneDNN bf16"] = cpu_linear.PackedWeight(cpu_linear.ONEDNN, [w16], None)
    out["oneDNN fp32 (bf16 in/out)"] = cpu_linear.PackedWeight(cpu_linear.FP32, [w16], None)
    out["F.linear fp32"] = lambda x: F.linear(x.float(), w32)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", default="1,8,32,128,512", help="comma list of row counts")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/cpu-linear-<date>.json)"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    results = []
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            w16 = torch.randn(n, k, generator=g).bfloat16()
            fns = ways(w16)
            for m in rows:
                x = torch.randn(1, m, k, generator=g).bfloat16()
                for way, fn in fns.items():
                    s = _seconds(lambda: fn(x))
                    results.append(
                        {
                            "weight": name,
                            "shape": [n, k],
                            "rows": m,
                            "way": way,
                            "ms": s * 1e3,
                            "gflops": 2 * m * n * k / s / 1e9,
                        }
                    )
                print(
                    f"{name} rows {m}: "
                    + ", ".join(f"{r['way']} {r['gflops']:.0f}" for r in results[-len(fns) :]),
                    file=sys.stderr,
                    flush=True,
                )
    names = list(dict.fromkeys(r["way"] for r in results))
    print(
        f"\n## Linear layers on this CPU, GFLOP/s ({torch.get_num_threads()} threads, "
        f"default way here: {cpu_linear.mode(torch.bfloat16, torch.device('cpu'))}, OpenMP {OMP_WAIT_POLICY})\n"
    )
    print("| weight | rows | " + " | ".join(names) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in names) + " |")
    for name in SHAPES:
        for m in rows:
            got = {r["way"]: r["gflops"] for r in results if r["weight"] == name and r["rows"] == m}
            print(
                f"| {name} {SHAPES[name][0]}x{SHAPES[name][1]} | {m} | "
                + " | ".join(f"{got[w]:.0f}" for w in names)
                + " |"
            )
    out = (
        Path(args.out)
        if args.out
        else HERE / "results" / f"cpu-linear-{datetime.date.today().isoformat()}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": datetime.date.today().isoformat(),
                "threads": torch.get_num_threads(),
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "default_way": cpu_linear.mode(torch.bfloat16, torch.device("cpu")),
                "results": results,
            },
            indent=2,
        )
    )
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
