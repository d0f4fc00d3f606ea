#!/usr/bin/env python
"""Evaluate a model over a dataset: ordered, resumable, one engine across all rows.

    python examples/dataset_eval.py                          # 24 questions, SmolLM2-135M-Instruct on CPU
    python examples/dataset_eval.py --rows 200 --checkpoint-dir runs/demo    # Ctrl-C, rerun: it resumes
    accelerate launch --multi_gpu --num_processes 2 examples/dataset_eval.py # one shard per process

The same run from the command line, over a JSON-lines file:

    paged-hf generate --model default --input questions.jsonl --messages-column messages \\
        --output answers.jsonl --checkpoint-dir runs/demo --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import time

import datasets

import paged_hf
from paged_hf.model.default_model import load_default_model

TOPICS = [
    "the moon",
    "tea",
    "rain",
    "bicycles",
    "volcanoes",
    "bees",
    "libraries",
    "the ocean",
    "bread",
    "trains",
    "snow",
    "owls",
]
ASKS = ["Describe {} in one sentence.", "Give one surprising fact about {}."]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--checkpoint-dir", help="append finished rows here; rerun to resume")
    args = parser.parse_args()

    model, tokenizer = load_default_model()
    questions = [ASKS[i % len(ASKS)].format(TOPICS[i % len(TOPICS)]) for i in range(args.rows)]
    dataset = datasets.Dataset.from_dict(
        {
            "id": list(range(args.rows)),
            "messages": [[{"role": "user", "content": q}] for q in questions],
        }
    )
    start = time.perf_counter()
    result = paged_hf.generate_dataset(
        model,
        tokenizer,
        dataset,
        messages_column="messages",
        output_column="answer",
        sampling_params=paged_hf.SamplingParams(max_new_tokens=args.max_new_tokens),
        checkpoint_dir=args.checkpoint_dir,
        max_num_seqs=32,
    )
    elapsed = time.perf_counter() - start
    if result is None or "answer" not in result.column_names or len(result) != args.rows:
        return  # a non-zero rank of a multi-process launch: rank 0 prints the whole result
    for row in result.select(range(min(6, len(result)))):
        print(
            f"[{row['id']}] {row['messages'][0]['content']}\n    -> {row['answer']!r} "
            f"({row['answer_num_tokens']} tokens, {row['answer_finish_reason']})"
        )
    tokens = sum(result["answer_num_tokens"])
    print(
        f"\n{len(result)} rows, {tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.0f} tok/s)"
    )


if __name__ == "__main__":
    main()
