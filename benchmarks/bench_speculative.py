"""Speculative decoding by prompt lookup (``prompt_lookup_num_tokens``) against the same engine
without it and against transformers' own prompt lookup. Batch 1: passages to repeat or edit (the
work it pays on), each prompt alone, greedy; then batches of 8 and 32 of the same work and of chat
questions (little to look up), with and without it. SmolLM2-135M, medians of ``--repeat`` rounds,
the ways interleaved; prints tables, writes JSON, and says how many rows' tokens match.

    python benchmarks/bench_speculative.py                 # bf16, 2 threads, k=10, 96 new tokens
    python benchmarks/bench_speculative.py --k 6 --batches 8 --repeat 1
"""

from __future__ import annotations

import argparse
import time

import common
import omp_env

omp_env.setup()  # before torch: OpenMP reads its wait policy when libgomp loads

from bench_threads import QUESTIONS  # noqa: E402

import paged_hf  # noqa: E402

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night "
    "its keeper climbed the narrow stairs, trimmed the wick and polished the great lens until it "
    "shone. Ships far out at sea watched for its beam, and sailors said that as long as the light "
    "turned, no storm could take them.",
    "To install the package, first create a virtual environment with python -m venv .venv, then "
    "activate it and run pip install -e . from the repository root. The tests run with pytest; "
    "set the environment variable DEBUG=1 to keep the temporary files that a failing test leaves.",
    "Maria opened the bakery at six every morning. She baked bread, rolls and a cake of the day, "
    "and by nine the shelves were half empty. On Sundays her brother Tomas helped at the counter, "
    "and the queue reached the corner of the street.",
]
TASKS = [
    "Repeat this passage exactly, word for word:\n\n{}",
    "Rewrite this passage with every sentence in the present tense:\n\n{}",
    "Copy this passage and put it in quotation marks:\n\n{}",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--k", type=int, default=10, help="prompt_lookup_num_tokens")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batches", default="8,32", help="batch sizes after batch 1")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--repeat", type=int, default=3)
    common.add_threads(ap, default=2)
    common.add_omp(ap)
    ap.add_argument("--out", default="bench_speculative.json")
    args = common.parse(ap)
    theirs, tok = common.default_model(args.dtype)
    ours = paged_hf.patch(common.default_model(args.dtype)[0], tok)
    chat = dict(add_generation_prompt=True, return_tensors="pt", return_dict=True)
    edits = [t.format(p) for t in TASKS for p in PASSAGES]
    inputs = [tok.apply_chat_template([{"role": "user", "content": c}], **chat) for c in edits]
    n, k = args.new_tokens, args.k

    def call(model, lookup):
        return each_alone(
            model, inputs[:3], n, **({"prompt_lookup_num_tokens": k} if lookup else {})
        )

    ways = {
        "paged_hf": lambda: call(ours, False),
        "paged_hf + prompt lookup": lambda: call(ours, True),
        "transformers": lambda: call(theirs, False),
        "transformers + prompt lookup": lambda: call(theirs, True),
    }
    one = timed(ways, args.repeat)
    print(
        f"batch 1: 3 prompts one at a time, {n} new tokens, k={k}, SmolLM2-135M {args.dtype}, "
        f"{args.threads} threads, median of {args.repeat}"
    )
    print(table(one, 3 * n, "paged_hf"))
    engine = paged_hf.engine_for(ours)
    rows = {"batch 1": summary(one, 3 * n)}
    for b in [int(x) for x in args.batches.split(",") if x]:
        for name, texts in (("edits", edits), ("chat", QUESTIONS)):
            ids = chat_ids(tok, texts, b)
            batch = {
                mode: (
                    lambda s=k * (mode != "plain"): [
                        o.token_ids
                        for o in engine.generate(
                            ids,
                            paged_hf.SamplingParams(
                                max_new_tokens=n, min_new_tokens=n, prompt_lookup_num_tokens=s
                            ),
                        )
                    ]
                )
                for mode in ("plain", "prompt lookup")
            }
            before = engine.stats()
            runs = timed(batch, args.repeat)
            drafts = {key: engine.stats()[key] - before[key] for key in DRAFT_KEYS}
            print(f"\nbatch {b}, {name}: one call of {b} prompts; drafted {drafts}")
            print(table(runs, b * n, "plain"))
            rows[f"batch {b} {name}"] = dict(summary(runs, b * n), **drafts)
    common.write_json(args.out, dict(k=k, new_tokens=n, dtype=args.dtype, rows=rows))


DRAFT_KEYS = ("draft_tokens_proposed", "draft_tokens_accepted")


def each_alone(model, inputs: list, n: int, **extra) -> list[list[int]]:
    """Batch 1, each prompt alone (a notebook's calls): ``n`` greedy tokens each."""
    return [
        model.generate(**x, max_new_tokens=n, min_new_tokens=n, do_sample=False, **extra)[
            0, x["input_ids"].shape[1] :
        ].tolist()
        for x in inputs
    ]


def chat_ids(tok, texts: list[str], b: int) -> list[list[int]]:
    """``b`` user turns cycling through ``texts``, chat-templated, as token ids."""
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True
        )
        for c in (texts * (b // len(texts) + 1))[:b]
    ]
    return [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]


def timed(ways: dict, repeat: int) -> dict:
    """Each way's seconds per round (interleaved) and its last round's tokens."""
    out = {name: {"seconds": [], "tokens": None} for name in ways}
    for name, run in ways.items():  # warm-up: kernels, packed weights, the prefix cache
        run()
    for _ in range(repeat):
        for name, run in ways.items():
            start = time.perf_counter()
            out[name]["tokens"] = run()
            out[name]["seconds"].append(time.perf_counter() - start)
    return out


def table(runs: dict, tokens: int, base: str) -> str:
    med = common.medians({name: r["seconds"] for name, r in runs.items()})
    ref = runs[base]["tokens"]
    cells = [
        [
            name,
            f"{sec:.2f}",
            f"{tokens / sec:.1f}",
            f"{med[base] / sec:.2f}x",
            f"{sum(a == b for a, b in zip(r['tokens'], ref))}/{len(ref)}",
        ]
        for (name, sec), r in zip(med.items(), runs.values())
    ]
    return common.md_table(["way", "s", "out tok/s", f"vs {base}", f"rows as {base}"], cells)


def summary(runs: dict, tokens: int) -> dict:
    med = common.medians({name: r["seconds"] for name, r in runs.items()})
    return {
        name: dict(seconds=r["seconds"], median_s=med[name], tok_s=tokens / med[name])
        for name, r in runs.items()
    }


if __name__ == "__main__":
    main()
