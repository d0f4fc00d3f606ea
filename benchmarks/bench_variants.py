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

import datetime
import statistics
import sys

import common
import omp_env

OMP_WAIT_POLICY = omp_env.setup()  # before torch: OpenMP reads its wait policy when libgomp loads

import bench  # noqa: E402
import bench_systems as S  # noqa: E402
import bench_workloads as W  # noqa: E402
import torch  # noqa: E402

import paged_hf  # noqa: E402
import paged_hf.execution.backends.torch_backend as torch_backend  # noqa: E402

GROUPS = torch_backend.GROUP_PADDING_TOKENS  # the default padding between decode groups
NO_CAP = {"max_prefill_tokens_while_decoding": None}
VARIANTS = {
    "one decode group": dict(group_padding=1 << 60, config={}),
    "decode groups": dict(group_padding=GROUPS, config={}),
    "decode groups, no prefill cap": dict(group_padding=GROUPS, config=NO_CAP),
}
DEFAULT_VARIANTS = tuple(VARIANTS)
# more, by name (--variants): the default engine but for one option
MORE = {
    f"{k} off": {f"cpu_{k.replace(' ', '_')}": False}
    for k in ("packed weights", "fused projections", "fused ops", "compact layers")
}
MORE |= {f"prefill cap {n}": {"max_prefill_tokens_while_decoding": n} for n in (64, 128, 256)}
MORE |= {f"budget {n}": {"max_num_batched_tokens": n} for n in (256, 1024, 2048)}
MORE |= {f"budget {n} no cap": {"max_num_batched_tokens": n, **NO_CAP} for n in (2048, 4096, 1024)}
for _name, _cfg in MORE.items():
    VARIANTS[_name] = dict(group_padding=GROUPS, config=_cfg)


def run_once(model, workload: W.Workload, warm: W.Workload, variant: dict) -> dict:
    torch_backend.GROUP_PADDING_TOKENS = variant["group_padding"]
    try:
        engine = paged_hf.Engine(model, **variant["config"])
        S.run_paged(engine, warm, tag="warm")
        res = S.run_paged(engine, workload)
    finally:
        torch_backend.GROUP_PADDING_TOKENS = GROUPS
    tok_s = sum(len(t) for t in res.tokens) / (res.t_end - res.t_start)
    lat = bench.latency_metrics(res, workload.focus_ids)
    return {"out_tok_s": tok_s, "itl_p50": lat["itl_p50"], "itl_p99": lat["itl_p99"]}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    h = "comma list of mixed, prefix, prefix_long, long"
    ap.add_argument("--workloads", default="mixed,prefix,long", help=h)
    ap.add_argument("--rounds", type=int, default=2)
    h = "comma list (';' where a name holds a comma), the first is the baseline; known: "
    ap.add_argument("--variants", default=";".join(DEFAULT_VARIANTS), help=h + "; ".join(VARIANTS))
    h = "shrink W-prefix and W-long, as bench.py --scale"
    ap.add_argument("--scale", type=float, default=1.0, help=h)
    common.add_threads(ap, help="torch threads (default: all cores)")
    h = "the model's dtype (default bf16)"
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help=h)
    common.add_omp(ap)
    ap.add_argument("--out", help="JSON path (default benchmarks/results/variants-<date>.json)")
    args = common.parse(ap, argv)

    model, tokenizer = common.default_model(args.dtype)
    pool = W.allowed_ids(model.config.vocab_size, common.special_ids(tokenizer))
    workloads = W.build(
        args.workloads.split(","), pool, mixed_n=max(4, round(64 * args.scale)), scale=args.scale
    )
    warm = W.warm(pool)
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
                common.log(
                    f"[round {r + 1}/{args.rounds}] {w.name} {name}: {m['out_tok_s']:.1f} out tok/s"
                )

    rows = []
    for w in workloads:
        base = None
        for name in chosen:
            ms = runs[(w.name, name)]
            tok_s = statistics.median(m["out_tok_s"] for m in ms)
            base = base or tok_s
            itl = {
                f"itl_{q}_ms": 1e3 * statistics.median(m[f"itl_{q}"] for m in ms)
                for q in ("p50", "p99")
            }
            row = {"workload": w.name, "variant": name, "out_tok_s": tok_s, "ratio": tok_s / base}
            rows.append({**row, **itl, "runs": ms})
    print(
        f"\n## paged_hf variants, SmolLM2-135M {args.dtype}, {torch.get_num_threads()} threads, "
        f"median of {args.rounds} interleaved rounds, OpenMP wait policy {OMP_WAIT_POLICY}\n"
    )
    cells = [
        [r["workload"], r["variant"], f"{r['out_tok_s']:.0f}", f"{r['ratio']:.2f}x"]
        + [f"{r['itl_p50_ms']:.0f}", f"{r['itl_p99_ms']:.0f}"]
        + [f"{r['itl_p99_ms'] / r['itl_p50_ms']:.1f}"]
        for r in rows
    ]
    head = ["workload", "variant", "out tok/s", "vs first", "ITL p50 ms", "ITL p99 ms", "p99/p50"]
    print(common.md_table(head, cells, ["---"] * 2 + ["---:"] * 5))
    print()
    today = datetime.date.today().isoformat()
    out = {"date": today, "threads": torch.get_num_threads(), "dtype": args.dtype}
    out.update(rounds=args.rounds, rows=rows)
    common.write_json(args.out or common.stamped("variants"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
