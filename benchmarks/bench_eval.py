"""lm-evaluation-harness at full speed: ``--model paged_hf`` against ``--model hf``.

    python benchmarks/bench_eval.py                      # SmolLM2-135M bf16, 200 x 4 choices, 100 few-shot prompts
    python benchmarks/bench_eval.py --quick              # 20 questions, 10 prompts, one round (a minute)
    python benchmarks/bench_eval.py --model PATH --dtype float32 --out bench_eval.json

Two local tasks (benchmarks/eval_tasks.py): ``phf_mc``, multiple-choice loglikelihood (N
questions x 4 choices, ~80-token contexts), and ``phf_gen``, generate_until (N 5-shot prompts
with the same shots, as lm-eval's first_n sampler gives them; ``until`` = ["\\n\\n", "Q:"], at
most 16 new tokens). Both backends are built once from the same checkpoint with lm-eval's own
constructor arguments (``--batch_size 16`` for hf; ``auto`` for paged_hf, whose engine batches
continuously up to ``max_num_seqs``, 128 by default; ``--paged-batch-size 16`` caps it at 16
too). Each task then runs ``lm_eval.simple_evaluate`` with the model object, the systems
interleaved round by round (hf, paged_hf, hf, paged_hf, ...; paged_hf's prefix cache emptied
before each round) so a busy machine slows both alike; the table shows medians of wall time
and their ratio, medians of the process's CPU time (steadier on a shared machine), and the
metrics each system reached.

Prefill work: for ``--model hf`` the tokens it forwards (padding included, counted at its
model call); for paged_hf the tokens its engine computed; and two references: one context per
choice (what a backend without prefix reuse must compute) and one context per question plus
the choices. Writes everything to ``--out`` as JSON. No assertion on time anywhere.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import common
import torch


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__)
    p.add_argument("--model", default="default", help="checkpoint, or 'default' (SmolLM2-135M)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--n-mc", type=int, default=200, help="multiple-choice questions (4 choices)")
    p.add_argument("--n-gen", type=int, default=100, help="generate_until prompts")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    p.add_argument("--batch-size", type=int, default=16, help="lm-eval's --batch_size, --model hf")
    h = "lm-eval's --batch_size for --model paged_hf (auto: the engine's max_num_seqs; an integer"
    p.add_argument("--paged-batch-size", default="auto", help=h + " caps the sequences at once)")
    common.add_threads(p, help="torch threads (default: torch's)")
    p.add_argument("--paged-args", default="", help="more model_args for paged_hf: k=v,k=v")
    p.add_argument("--tasks-dir", help="where to write the tasks (default: a temp dir)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/eval-<date-time>.json)")
    p.add_argument("--quick", action="store_true", help="20 questions, 10 prompts, one round")
    args = common.parse(p, argv)
    if args.quick:
        args.n_mc, args.n_gen, args.rounds = 20, 10, 1

    import lm_eval
    from eval_tasks import write_tasks
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from paged_hf.integrations.lm_eval import PagedHFLM

    path = _model_dir(args.model)
    tasks_dir = Path(args.tasks_dir or tempfile.mkdtemp(prefix="paged_hf_eval_tasks_"))
    write_tasks(tasks_dir, n_mc=args.n_mc, n_gen=args.n_gen)
    tm = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    threads = torch.get_num_threads()

    sizes = f"{args.n_mc} questions x 4 choices, {args.n_gen} prompts, {args.rounds} round(s)"
    batch = f"batch_size {args.batch_size} (hf) / {args.paged_batch_size} (paged_hf)"
    print(f"model {path} ({args.dtype}), {sizes}, {batch}, {threads} threads", flush=True)
    hf = HFLM(pretrained=str(path), dtype=args.dtype, batch_size=args.batch_size, device="cpu")
    paged_extra = dict(kv.split("=", 1) for kv in args.paged_args.split(",") if kv)
    paged_extra = {k: _literal(v) for k, v in paged_extra.items()}
    paged_batch = _literal(args.paged_batch_size)
    paged = PagedHFLM(
        pretrained=str(path), dtype=args.dtype, batch_size=paged_batch, device="cpu", **paged_extra
    )
    torch.set_num_threads(threads)  # a constructor may have changed it
    forwarded = _count_hf_tokens(hf)
    systems = {"hf": hf, "paged_hf": paged}

    rows = []
    # the prefill tokens each system computed so far: hf's forwarded, paged_hf's engine's
    computed = {"hf": lambda: forwarded[0]}
    computed["paged_hf"] = lambda: paged.engine.stats()["prefill_tokens_computed"]
    for task in ("phf_mc", "phf_gen"):
        times: dict[str, list[float]] = {s: [] for s in systems}
        cpu: dict[str, list[float]] = {s: [] for s in systems}
        results: dict[str, dict] = {}
        prefill: dict[str, int] = {}
        for _round in range(args.rounds):
            for name, lm in systems.items():
                paged.engine.reset_prefix_cache()  # every round starts cold: no KV kept from the last one
                before = computed[name]()
                start, start_cpu = time.perf_counter(), time.process_time()
                res = lm_eval.simple_evaluate(
                    model=lm, tasks=[task], task_manager=tm, log_samples=True, verbosity="WARNING"
                )
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
                torch.set_num_threads(threads)
                results[name], prefill[name] = res, computed[name]() - before
                print(
                    f"  {task} {name}: {times[name][-1]:.1f} s (CPU {cpu[name][-1]:.1f} s)",
                    flush=True,
                )
        row = {"task": task, "times_s": times, "median_s": common.medians(times), "cpu_s": cpu}
        row["median_cpu_s"] = common.medians(cpu)
        row["metrics"] = {s: common.eval_metrics(results[s], task) for s in systems}
        row["prefill_tokens"] = prefill
        row["speedup"] = row["median_s"]["hf"] / row["median_s"]["paged_hf"]
        row["cpu_ratio"] = row["median_cpu_s"]["hf"] / row["median_cpu_s"]["paged_hf"]
        if task == "phf_mc":
            row["reference_tokens"] = _mc_reference(results["paged_hf"], paged)
        rows.append(row)

    _print_table(rows, args)
    config = {"model": str(path), "dtype": args.dtype}
    config |= {k: getattr(args, k) for k in "n_mc n_gen rounds batch_size paged_batch_size".split()}
    config |= {"threads": threads, "paged_args": paged_extra}
    config["paged_engine"] = paged.get_model_info()["paged_hf_engine"]
    config |= {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    config["torch"] = torch.__version__
    config["lm_eval"] = getattr(lm_eval, "__version__", "0.4.13")
    config["date"] = time.strftime("%Y-%m-%d %H:%M")
    common.write_json(args.out or common.stamped("eval"), {"config": config, "rows": rows})
    return 0


def _model_dir(name: str) -> Path:
    if name != "default":
        return Path(name)
    from paged_hf.model.default_model import default_cache_dir, load_default_model

    path = default_cache_dir()
    if not (path / "model.safetensors").is_file():
        load_default_model()  # builds the safetensors cache from the wheel's GGUF
    return path


def _literal(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def _count_hf_tokens(hf) -> list[int]:
    """Count the tokens --model hf forwards (its padded batches), at its model call."""
    counter = [0]
    call = hf._model_call

    def counting(inps, *a, **k):
        counter[0] += int(inps.numel())
        return call(inps, *a, **k)

    hf._model_call = counting
    return counter


def _mc_reference(result: dict, paged) -> dict:
    """Token counts of the multiple-choice requests, as lm-eval tokenized them."""
    per_choice = per_question = 0
    seen: set[tuple] = set()
    for sample in result["samples"]["phf_mc"]:
        arguments = sample["arguments"]  # in memory: one (context, continuation) per choice
        for arg in arguments.values() if isinstance(arguments, dict) else arguments:
            context, continuation = (arg["arg_0"], arg["arg_1"]) if isinstance(arg, dict) else arg
            ctx, cont = paged._encode_pair(context, continuation)
            per_choice += len(ctx) + len(cont) - 1  # the last continuation token is never input
            per_question += len(cont) - 1
            if tuple(ctx) not in seen:
                seen.add(tuple(ctx))
                per_question += len(ctx)
    out = {"one_context_per_choice": per_choice}
    return out | {"one_context_per_question_plus_choices": per_question}


def _print_table(rows: list[dict], args) -> None:
    head = ["task", f"lm-eval --model hf (batch {args.batch_size})"]
    head += [f"--model paged_hf (batch {args.paged_batch_size})", "speedup"]
    head += ["CPU time hf / paged_hf", "metrics hf / paged_hf"]
    names = {
        "phf_mc": f"multiple choice, {args.n_mc} x 4 (loglikelihood)",
        "phf_gen": f"generate_until, {args.n_gen} 5-shot prompts",
    }
    cells = []
    for row in rows:
        m, wall, cpu = row["metrics"], row["median_s"], row["median_cpu_s"]
        cpu_s = f"{cpu['hf']:.0f} s / {cpu['paged_hf']:.0f} s ({row['cpu_ratio']:.1f}x)"
        metrics = ", ".join(f"{k} {m['hf'][k]:.3f} / {m['paged_hf'][k]:.3f}" for k in m["hf"])
        cells.append(
            [names[row["task"]], f"{wall['hf']:.1f} s", f"{wall['paged_hf']:.1f} s"]
            + [f"{row['speedup']:.1f}x", cpu_s, metrics]
        )
    print()
    print(common.md_table(head, cells))
    mc = next(r for r in rows if r["task"] == "phf_mc")
    ref = mc["reference_tokens"]
    print()
    print(
        f"prefill tokens, multiple choice: --model hf forwarded {mc['prefill_tokens']['hf']:,} (padding included); "
        f"paged_hf computed {mc['prefill_tokens']['paged_hf']:,}; one context per choice "
        f"{ref['one_context_per_choice']:,}; one context per question plus the choices "
        f"{ref['one_context_per_question_plus_choices']:,}"
    )


if __name__ == "__main__":
    sys.exit(main())
