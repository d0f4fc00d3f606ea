"""Where a small decode step goes (issue 59): pure decode steps of 1, 2, 4 and 8 running rows on the
default model, each part's milliseconds a step (bench_profile.py's timers: the scheduler, the
step's metadata, the attention plan, the forward with its packed GEMMs and attention broken out,
sampling, the bookkeeping after it, and the rest of the step), medians of ``--repeat`` rounds.
Where a compact layer's halves run as one C++ call each (the few-row kernel, compact_rows.cpp) its
GEMMs are inside them: "linear" is then the lm_head alone and the layers' GEMMs are "forward rest".

    python benchmarks/bench_small_step.py                   # 1,2,4,8 rows, 64 steps, 3 rounds
    python benchmarks/bench_small_step.py --rows 1 --steps 32 --repeat 1
"""

from __future__ import annotations

import argparse
import statistics

import common
import omp_env

omp_env.setup()  # before torch: OpenMP reads its wait policy when libgomp loads

import bench_profile  # noqa: E402
import bench_systems as S  # noqa: E402

# the parts of a step, in ms; "forward rest" is the forward less its GEMMs and attention: the
# layers' Python, norms, rotary, activations, the embedding and the head's other ops
COLUMNS = ("schedule", "metadata", "plan", "linear", "attention", "forward rest", "sample")
COLUMNS += ("update", "other", "total")


def parts_ms(row: dict) -> dict[str, float]:
    per_step = 1e3 * row["step_time_s"] / row["steps"]
    ms = {p: per_step * row["share"][p] for p in bench_profile.PARTS}
    ms["forward rest"] = ms["forward"] - ms["linear"] - ms["attention"]
    ms["total"] = per_step
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=160, help="tokens of context a row")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    common.add_threads(ap, default=2)
    common.add_omp(ap)
    ap.add_argument("--out", default="bench_small_step.json")
    args = common.parse(ap)
    S.set_malloc(True)
    model, tok = common.default_model(args.dtype)
    pool = list(range(100, model.config.vocab_size))
    result, lines = {}, []
    for n in [int(r) for r in args.rows.split(",")]:
        bench_profile.decode_steps(model, "auto", n, args.context, 4, pool)  # warm
        rounds = [
            parts_ms(bench_profile.decode_steps(model, "auto", n, args.context, args.steps, pool))
            for _ in range(args.repeat)
        ]
        med = {c: statistics.median(r[c] for r in rounds) for c in COLUMNS}
        result[n] = {"median_ms": med, "rounds": rounds}
        lines.append([n, *(f"{med[c]:.2f}" for c in COLUMNS)])
    print(
        f"pure decode steps, SmolLM2-135M {args.dtype}, {args.threads} threads, ~{args.context} "
        f"tokens of context a row; ms a step, median of {args.repeat} rounds of {args.steps} steps"
    )
    print(common.md_table(["rows", *COLUMNS], lines))
    common.write_json(args.out, {"dtype": args.dtype, "threads": args.threads, "rows": result})


if __name__ == "__main__":
    main()
