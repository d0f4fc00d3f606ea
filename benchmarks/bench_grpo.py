"""TRL's GRPOTrainer on SmolLM2-135M-Instruct (bf16, CPU): its generation phase through
transformers' ``generate`` and through paged_hf (``paged_hf.integrations.trl.PagedGenerationMixin``),
side by side in one run, the same seed, data and config.

    python benchmarks/bench_grpo.py --threads 2                  # 3 steps, the table and JSON
    python benchmarks/bench_grpo.py --steps 2 --completion 32    # quicker

Per step: the generation phase's seconds (``_generate_single_turn``, TRL's own generation call),
then the whole run's seconds. Each step generates ``--generations`` completions for each of
``--prompts-per-step`` prompts, of up to ``--completion`` tokens, sampled (TRL's defaults:
temperature 1). The default optimizer (fused AdamW) trains between the generations; paged_hf
sees each step (paged_hf/cache/coherence.py) and sleeps between generations.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import common
import omp_env

OMP_WAIT_POLICY = omp_env.setup()  # before torch: OpenMP reads its wait policy when libgomp loads

import torch  # noqa: E402

QUESTIONS = """What is the capital of France?|Name a primary color.|What is 2 + 3?|Say hello in
Spanish.|What animal barks?|What is the opposite of hot?|Name a planet.|What do bees make?|How many
legs does a cat have?|What color is the sky?|Name a fruit.|What is ice made of?"""
QUESTIONS = QUESTIONS.replace("\n", " ").split("|")


def reward_short_answers(completions, **kw):
    """Shorter answers score higher (a reward with spread, so every step updates the weights)."""
    return [-float(len(c[0]["content"] if isinstance(c, list) else c)) / 100 for c in completions]


def run(system: str, args, tmp: str) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import paged_hf
    from paged_hf.integrations.trl import PagedGenerationMixin

    model, tokenizer = common.default_model()
    times: list[float] = []

    def timed(cls):
        class Timed(cls):
            def _generate_single_turn(self, *a, **kw):
                start = time.perf_counter()
                out = super()._generate_single_turn(*a, **kw)
                times.append(time.perf_counter() - start)
                return out

        return Timed

    options = {"paged_hf_options": {"max_num_seqs": 64}}
    paged = type("PagedGRPOTrainer", (PagedGenerationMixin, GRPOTrainer), options)
    base = GRPOTrainer if system == "transformers" else paged
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS * 4]})
    batch = dict(per_device_train_batch_size=args.prompts_per_step * args.generations)
    batch.update(num_generations=args.generations, max_completion_length=args.completion)
    steps = dict(max_steps=args.steps, learning_rate=1e-6, logging_steps=1, report_to=[], seed=0)
    steps.update(save_strategy="no", use_cpu=True, bf16=True, dataloader_num_workers=0)
    config = GRPOConfig(output_dir=tmp, **batch, **steps)
    inputs = dict(reward_funcs=reward_short_answers, train_dataset=data, processing_class=tokenizer)
    trainer = timed(base)(model=model, args=config, **inputs)
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    out = {"system": system, "optimizer": str(getattr(config.optim, "value", config.optim))}
    out |= {"generation_s": times, "total_s": total}
    # each prompt's completions were one n-sample request, forked from its KV
    if system == "paged_hf":
        engine = paged_hf.engine_for(trainer.accelerator.unwrap_model(trainer.model))
        out["engine_steps"] = engine.stats()["steps"]
    return out


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--completion", type=int, default=64)
    common.add_threads(ap)
    ap.add_argument("--json", default="benchmarks/results/grpo.json")
    common.add_omp(ap)
    args = common.parse(ap)
    results = []
    for system in ("transformers", "paged_hf"):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run(system, args, tmp))
    print(
        f"\nGRPO, SmolLM2-135M-Instruct bf16, {torch.get_num_threads()} threads; {args.steps} steps of "
        f"{args.prompts_per_step} prompts x {args.generations} completions of <= {args.completion} tokens; "
        f"optimizer {results[0]['optimizer']}\n"
    )
    head = ["generation through", "generation per step (s)", "median", "whole run (s)"]
    cells = [
        [r["system"], ", ".join(f"{t:.1f}" for t in r["generation_s"])]
        + [f"{statistics.median(r['generation_s']):.1f}", f"{r['total_s']:.1f}"]
        for r in results
    ]
    print(common.md_table(head, cells))
    hf, paged = results
    print(
        f"\ngeneration phase: {statistics.median(hf['generation_s']) / statistics.median(paged['generation_s']):.2f}x; "
        f"whole run: {hf['total_s'] / paged['total_s']:.2f}x"
    )
    common.write_json(args.json, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
