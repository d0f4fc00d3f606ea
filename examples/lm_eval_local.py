"""Evaluate with lm-evaluation-harness through paged_hf, on local tasks (no hub access).

    python examples/lm_eval_local.py                 # SmolLM2-135M-Instruct (bf16), 50 questions, 20 prompts
    python examples/lm_eval_local.py --limit 10      # faster

It writes three local tasks (benchmarks/eval_tasks.py: multiple choice, few-shot
generate_until with ``until``, rolling loglikelihood), then evaluates the default model
twice: through the registered ``paged_hf`` backend by name, exactly as the command line does

    paged-hf lm-eval --model paged_hf --model_args pretrained=default,dtype=bfloat16 \\
        --tasks phf_mc,phf_gen,phf_rolling --include_path TASKS_DIR --device cpu

and by wrapping a model already loaded in this process. Then it shows what the engine did:
prefill tokens computed against the prompt tokens (the choices of a question share their
context through the prefix cache).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=None, help="documents per task")
    args = parser.parse_args()

    import lm_eval
    from eval_tasks import write_tasks
    from lm_eval.tasks import TaskManager

    import paged_hf.integrations.lm_eval as ple  # registers --model paged_hf
    from paged_hf.model.default_model import load_default_model

    tasks_dir = write_tasks(
        Path(tempfile.mkdtemp(prefix="paged_hf_tasks_")), n_mc=50, n_gen=20, n_rolling=10
    )
    tasks = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    names = ["phf_mc", "phf_gen", "phf_rolling"]

    # 1. by name, as `paged-hf lm-eval --model paged_hf ...` does
    start = time.perf_counter()
    by_name = lm_eval.simple_evaluate(
        model="paged_hf",
        model_args="pretrained=default,dtype=bfloat16",
        tasks=names,
        task_manager=tasks,
        device="cpu",
        limit=args.limit,
    )
    print(f"--model paged_hf: {time.perf_counter() - start:.1f} s")
    print(lm_eval.utils.make_table(by_name))

    # 2. a model you already have (patched or not), with engine options of your choosing
    model, tokenizer = load_default_model(dtype=torch.bfloat16)
    lm = ple.wrap(model, tokenizer, max_num_seqs=64)
    start = time.perf_counter()
    wrapped = lm_eval.simple_evaluate(
        model=lm, tasks=["phf_mc"], task_manager=tasks, limit=args.limit
    )
    stats = lm.engine.stats()
    print(
        f"wrapped model, phf_mc: {time.perf_counter() - start:.1f} s, acc {wrapped['results']['phf_mc']['acc,none']:.3f}"
    )
    print(
        f"prompt tokens {stats['prompt_tokens']:,}, prefill computed {stats['prefill_tokens_computed']:,}, "
        f"served from the prefix cache {stats['prefix_hit_tokens']:,}"
    )


if __name__ == "__main__":
    main()
