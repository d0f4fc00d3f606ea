#!/usr/bin/env python
"""paged_hf against itself: engine variants side by side, interleaved, in one process.

    python benchmarks/bench_variants.py                       # W-mixed, W-prefix, W-long; 2 rounds
    python benchmarks/bench_variants.py --workloads long --rounds 3 --out variants.json

Variants (same model, same workloads, fresh engine per run, each preceded by a tiny warm-up):

- ``one decode group``: every decoding sequence padded to the longest, in one batched call (the
  torch backend before decode groups; ``GROUP_PADDING_TOKENS`` set beyond any batch);
- ``decode groups``: the default engine (prefill capped at 128 tokens per step while decoding);
- ``decode groups, no prefill cap``: ``max_prefill_tokens_while_decoding=None``.

Rounds run every (workload, variant) once in turn, so a slow spell of the machine hits all
variants alike; the table reports each one's median output tok/s, its ratio to the first
variant, and inter-token latency p50/p99 (the focus requests of the workload: W-long's shorts).
SmolLM2-135M-Instruct real weights, bf16 (``--dtype fp32``: fp32). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import omp_env  # noqa: E402  (before torch: OpenMP reads its wait policy when libgomp loads)

OMP_WAIT_POLICY = omp_env.setup()

import bench  # noqa: E402
import bench_systems as S  # noqa: E402
import bench_workloads as W  # noqa: E402
import torch  # noqa: E402

import paged_hf  # noqa: E402
import paged_hf.execution.backends.torch_backend as torch_backend  # noqa: E402
from paged_hf.model.default_model import load_default_model  # noqa: E402

VARIANTS = {
    "one decode group": dict(group_padding=1 << 60, config={}),
    "decode groups": dict(group_padding=torch_backend.GROUP_PADDING_TOKENS, config={}),
    "decode groups, no prefill cap": dict(
        group_padding=torch_backend.GROUP_PADDING_TOKENS,
        config={"max_prefill_tokens_while_decoding": None},
    ),
}
DEFAULT_VARIANTS = tuple(VARIANTS)
# more, by name (--variants): the default engine but for one option
for _name, _cfg in {
    "packed weights off": {"cpu_packed_weights": False},
    "fused projections off": {"cpu_fused_projections": False},
    "fused ops off": {"cpu_fused_ops": False},
    "compact layers off": {"cpu_compact_layers": False},
    "prefill cap 64": {"max_prefill_tokens_while_decoding": 64},
    "prefill cap 128": {"max_prefill_tokens_while_decoding": 128},
    "prefill cap 256": {"max_prefill_tokens_while_decoding": 256},
    "budget 256": {"max_num_batched_tokens": 256},
    "budget 1024": {"max_num_batched_tokens": 1024},
    "budget 2048": {"max_num_batched_tokens": 2048},
    "budget 2048 no cap": {
        "max_num_batched_tokens": 2048,
        "max_prefill_tokens_while_decoding": None,
    },
    "budget 4096 no cap": {
        "max_num_batched_tokens": 4096,
        "max_prefill_tokens_while_decoding": None,
    },
    "budget 1024 no cap": {
        "max_num_batched_tokens": 1024,
        "max_prefill_tokens_while_decoding": None,
    },
}.items():
    VARIANTS[_name] = dict(group_padding=torch_backend.GROUP_PADDING_TOKENS, config=_cfg)


def run_once(model, workload: W.Workload, warm: W.Workload, variant: dict) -> dict:
    torch_backend.GROUP_PADDING_TOKENS = variant["group_padding"]
    try:
        engine = paged_hf.Engine(model, **variant["config"])
        S.run_paged(engine, warm, tag="warm")
        res = S.run_paged(engine, workload)
    finally:
        torch_backend.GROUP_PADDING_TOKENS = VARIANTS["decode groups"]["group_padding"]
    out = sum(len(t) for t in res.tokens)
    lat = bench.latency_metrics(res, workload.focus_ids)
    return {
        "out_tok_s": out / (res.t_end - res.t_start),
        "itl_p50": lat["itl_p50"],
        "itl_p99": lat["itl_p99"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--workloads",
        default="mixed,prefix,long",
        help="comma list of mixed, prefix, prefix_long, long",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--variants",
        default=";".join(DEFAULT_VARIANTS),
        help=f"comma list (';' where a name holds a comma), the first is the baseline; known: "
        f"{'; '.join(VARIANTS)}",
    )
    ap.add_argument(
        "--scale", type=float, default=1.0, help="shrink W-prefix and W-long, as bench.py --scale"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument(
        "--dtype", choices=("bf16", "fp32"), default="bf16", help="the model's dtype (default bf16)"
    )
    ap.add_argument(
        "--omp-wait-policy", choices=omp_env.CHOICES, default="auto", help="see omp_env.py"
    )
    ap.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/variants-<date>.json)"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_default_model(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    special = set(tokenizer.all_special_ids) | set(
        getattr(tokenizer, "added_tokens_decoder", {}) or {}
    )
    pool = W.allowed_ids(model.config.vocab_size, special)
    workloads = W.build(
        args.workloads.split(","), pool, mixed_n=max(4, round(64 * args.scale)), scale=args.scale
    )
    warm = bench.warm_workload(pool)
    chosen = [v.strip() for v in args.variants.split(";" if ";" in args.variants else ",")]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    runs: dict[tuple[str, str], list[dict]] = {(w.name, v): [] for w in workloads for v in chosen}
    for r in range(args.rounds):
        for w in workloads:
            for name in chosen:
                m = run_once(model, w, warm, VARIANTS[name])
                runs[(w.name, name)].append(m)
                print(
                    f"[round {r + 1}/{args.rounds}] {w.name} {name}: {m['out_tok_s']:.1f} out tok/s",
                    file=sys.stderr,
                    flush=True,
                )

    rows = []
    for w in workloads:
        base = None
        for name in chosen:
            ms = runs[(w.name, name)]
            tok_s = statistics.median(m["out_tok_s"] for m in ms)
            base = base or tok_s
            p50 = statistics.median(m["itl_p50"] for m in ms)
            p99 = statistics.median(m["itl_p99"] for m in ms)
            rows.append(
                {
                    "workload": w.name,
                    "variant": name,
                    "out_tok_s": tok_s,
                    "ratio": tok_s / base,
                    "itl_p50_ms": p50 * 1e3,
                    "itl_p99_ms": p99 * 1e3,
                    "runs": ms,
                }
            )
    print(
        f"\n## paged_hf variants, SmolLM2-135M {args.dtype}, {torch.get_num_threads()} threads, "
        f"median of {args.rounds} interleaved rounds, OpenMP wait policy {OMP_WAIT_POLICY}\n"
    )
    print("| workload | variant | out tok/s | vs first | ITL p50 ms | ITL p99 ms | p99/p50 |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['workload']} | {row['variant']} | {row['out_tok_s']:.0f} | {row['ratio']:.2f}x | "
            f"{row['itl_p50_ms']:.0f} | {row['itl_p99_ms']:.0f} | {row['itl_p99_ms'] / row['itl_p50_ms']:.1f} |"
        )
    out = (
        Path(args.out)
        if args.out
        else HERE / "results" / f"variants-{datetime.date.today().isoformat()}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": datetime.date.today().isoformat(),
                "threads": torch.get_num_threads(),
                "dtype": args.dtype,
                "rounds": args.rounds,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
