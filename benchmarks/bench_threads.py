"""Threads calling one patched model's ``generate`` at once (a thread-pool web app, HELM's threads)
against the same calls one after another: each call one chat answer, greedy, a fixed number of new
tokens. Their rows share the engine's steps, so the threads finish together in about the time of
the longest call. Prints a table (medians of ``--repeat`` rounds, the two ways interleaved) and
writes JSON; checks that every call's tokens are the same both ways.

    python benchmarks/bench_threads.py                    # 8 threads, 64 tokens, SmolLM2-135M bf16
    python benchmarks/bench_threads.py --threads-calls 4 --dtype fp32
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import common
import omp_env

omp_env.setup()  # before torch: OpenMP reads its wait policy when libgomp loads

import paged_hf  # noqa: E402

QUESTIONS = """What is the capital of France?|Give me three tips for a good night's sleep.|Explain
what a hash table is in two sentences.|Write a haiku about autumn leaves.|Why is the sky blue?|Name
a few uses of Python in science.|How do I boil an egg?|What does a CPU cache do?|Suggest a name
for a small bakery.|Summarize the plot of Romeo and Juliet.|What is 17 times 23?|How do vaccines
work?"""
QUESTIONS = QUESTIONS.replace("\n", " ").split("|")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads-calls", type=int, default=8, help="calls (threads) at once")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--repeat", type=int, default=3)
    common.add_threads(ap, default=2)
    common.add_omp(ap)
    ap.add_argument("--out", default="bench_threads.json")
    args = common.parse(ap)
    model, tok = common.default_model(args.dtype)
    tok.padding_side = "left"
    template = dict(add_generation_prompt=True, return_tensors="pt", return_dict=True)
    questions = (QUESTIONS * 4)[: args.threads_calls]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], **template) for q in questions
    ]
    # batch_invariant: a row's tokens do not depend on what shares its steps (bf16 otherwise
    # forks now and then at near-ties), so both ways must give the same tokens
    options = {"batch_invariant": True} if args.dtype == "bf16" else {}
    model = paged_hf.patch(model, tok, **options)

    def one(inputs):
        n = args.new_tokens
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, min_new_tokens=n)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    one(prompts[0])  # warm-up: kernels, packed weights
    timings: dict[str, list[float]] = {"one after another": [], "threads at once": []}
    tokens: dict[str, list] = {}
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        for _ in range(args.repeat):
            start = time.perf_counter()
            tokens["one after another"] = [one(p) for p in prompts]
            timings["one after another"].append(time.perf_counter() - start)
            start = time.perf_counter()
            tokens["threads at once"] = list(pool.map(one, prompts))
            timings["threads at once"].append(time.perf_counter() - start)
    same = tokens["one after another"] == tokens["threads at once"]
    total = sum(len(t) for t in tokens["threads at once"])
    rows = common.medians(timings)
    ratio = rows["one after another"] / rows["threads at once"]
    print(
        f"{len(prompts)} calls x {args.new_tokens} new tokens, SmolLM2-135M {args.dtype}, "
        f"{args.threads} torch threads, median of {args.repeat}"
    )
    cells = [[name, f"{sec:.2f}", f"{total / sec:.1f}"] for name, sec in rows.items()]
    print(common.md_table(["way", "seconds", "out tok/s"], cells))
    print(f"threads at once: {ratio:.2f}x one after another; same tokens: {same}")
    fields = dict(calls=len(prompts), new_tokens=args.new_tokens, dtype=args.dtype)
    common.write_json(
        args.out, dict(fields, seconds=timings, median_s=rows, ratio=ratio, same_tokens=same)
    )
    if not same:
        sys.exit("the threads' tokens differ from the calls' alone")


if __name__ == "__main__":
    main()
