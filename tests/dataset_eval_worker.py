"""A generate_dataset run in its own process, for the tests that kill one or launch several.

    python tests/dataset_eval_worker.py OUT.json [--checkpoint-dir D] [--rows N] [--max-num-seqs K]
    accelerate launch --multi_gpu --num_processes 2 tests/dataset_eval_worker.py OUT.json   # gloo on CPU

The model, tokenizer and dataset are rebuilt the same way in every process (``eval_setup``),
so runs in different processes are comparable. Rank 0 writes the result's columns to OUT.json;
other ranks write their shard to OUT.json.rank<r>.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WORDS = "the quick brown fox jumps over a lazy dog hello world paged attention café naïve 東京 🙂".split()


def eval_setup(rows: int = 200):
    """(model, tokenizer, dataset) of the dataset tests: prompts of 1..60 words, some empty."""
    import datasets
    from tiny_models import make_tiny_model
    from tiny_tokenizer import make_tiny_tokenizer

    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(rows)]
    for i in range(7, rows, 50):
        prompts[i] = ""  # refused rows: finish_reason "error"
    dataset = datasets.Dataset.from_dict({"id": [f"q{i}" for i in range(rows)], "prompt": prompts})
    return make_tiny_model("llama"), make_tiny_tokenizer(), dataset


def columns(result) -> dict:
    return {name: list(result[name]) for name in result.column_names}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument(
        "--step-delay", type=float, default=0.0, help="sleep this long after each engine step"
    )
    args = parser.parse_args()

    import time

    import torch

    import paged_hf

    torch.set_num_threads(1)
    if args.step_delay:  # slow the run down so a test can kill it midway
        step = paged_hf.Engine.step

        def slow_step(self):
            out = step(self)
            time.sleep(args.step_delay)
            return out

        paged_hf.Engine.step = slow_step
    model, tokenizer, dataset = eval_setup(args.rows)
    result = paged_hf.generate_dataset(
        model,
        tokenizer,
        dataset,
        sampling_params=paged_hf.SamplingParams(max_new_tokens=args.max_new_tokens),
        checkpoint_dir=args.checkpoint_dir,
        progress=False,
        max_num_seqs=args.max_num_seqs,
    )
    rank = int(os.environ.get("RANK", "0"))
    path = args.out if rank == 0 else f"{args.out}.rank{rank}"
    with open(path, "w") as f:
        json.dump(columns(result), f)


if __name__ == "__main__":
    main()
