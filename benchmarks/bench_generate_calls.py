"""Existing ``generate`` code on a patched model: what stopping criteria and scores cost, and lm-eval's
HF backend built on a model object.

    python benchmarks/bench_generate_calls.py            # SmolLM2-135M bf16: 64 calls x 4 prompts; 32 x 4 beams; 100 prompts
    python benchmarks/bench_generate_calls.py --quick    # 16 calls, 8 x 4 beams, 20 prompts, one round
    python benchmarks/bench_generate_calls.py --dtype float32   # fp32: the same tokens as transformers, not near-ties

1. ``calls``: 64 ``model.generate`` calls one after another, each a left-padded batch of 4 few-shot
   prompts (lm-eval's phf_gen task), greedy, at most 32 new tokens. Patched: plain; with lm-eval's
   own ``stop_sequences_criteria`` (its ``MultiTokenEOSCriteria`` for "\\n\\n" and "Q:"); with
   ``output_scores=True, return_dict_in_generate=True``; with both. Unpatched transformers with the
   criteria. Systems interleaved round by round; medians. Calls with the criteria stop early (fewer
   tokens, fewer steps), so their cost is measured on criteria that never stop (a stop sequence
   the model never writes): the same tokens and steps as plain, the criteria called every step.
2. ``beams``: one ``generate`` call of 32 few-shot prompts x 4 beams (at most 32 new tokens), patched
   against transformers' own beam search: wall time, the same sequences or not, and the KV blocks
   the beams held at peak against what one copy per beam would take.
3. ``lm-eval``: ``HFLM(pretrained=model, tokenizer=tok, batch_size=16)`` on a patched model against
   the same on an unpatched copy, ``generate_until`` on N 5-shot prompts: wall time and metrics.

A table to stdout, everything to ``--out`` as JSON. No assertion on time anywhere.
"""

from __future__ import annotations

import copy
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import common
import torch


def _prompts(n: int) -> list[str]:
    from eval_tasks import write_tasks

    directory = Path(tempfile.mkdtemp(prefix="paged_hf_calls_"))
    write_tasks(directory, n_mc=1, n_gen=n)
    rows = lambda name: [json.loads(x) for x in (directory / name).read_text().splitlines()]  # noqa: E731
    shots, tests = rows("gen_train.jsonl")[:5], rows("gen_test.jsonl")
    few = "".join(f"Q: {r['question']}\nA: {r['answer']}\n\n" for r in shots)
    return [f"{few}Q: {r['question']}\nA:" for r in tests]


def bench_calls(model, patched, tok, n_calls: int, rounds: int) -> dict:
    from lm_eval.models.utils_hf import stop_sequences_criteria

    import paged_hf

    prompts = _prompts(n_calls * 4)
    tok.padding_side = "left"
    batches = [
        tok(prompts[i * 4 : (i + 1) * 4], return_tensors="pt", padding=True) for i in range(n_calls)
    ]
    greedy = dict(max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)

    def criteria(b, until=("\n\n", "Q:")):
        return {
            "stopping_criteria": stop_sequences_criteria(tok, list(until), b.input_ids.shape[1], 4)
        }

    scores = {"output_scores": True, "return_dict_in_generate": True}
    systems = {
        "transformers + criteria": (model, lambda b: criteria(b)),
        "paged_hf": (patched, lambda b: {}),
        "paged_hf + criteria": (patched, lambda b: criteria(b)),
        "paged_hf + criteria that never stop": (patched, lambda b: criteria(b, ("@@never@@",))),
        "paged_hf + scores": (patched, lambda b: scores),
        "paged_hf + criteria + scores": (patched, lambda b: {**criteria(b), **scores}),
    }
    engine = paged_hf.engine_for(patched)
    times: dict[str, list[float]] = {s: [] for s in systems}
    steps: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for _ in range(rounds):
        for name, (m, extra) in systems.items():
            before = engine.stats()["steps"]
            engine.reset_prefix_cache()
            start, new = time.perf_counter(), 0
            for b in batches:
                out = m.generate(b.input_ids, attention_mask=b.attention_mask, **greedy, **extra(b))
                seq = out.sequences if hasattr(out, "sequences") else out
                new += int((seq[:, b.input_ids.shape[1] :] != tok.pad_token_id).sum())
            times[name].append(time.perf_counter() - start)
            steps[name], tokens[name] = engine.stats()["steps"] - before, new
            print(
                f"  {name}: {times[name][-1]:.1f} s, {new} new tokens, {steps[name]} engine steps",
                flush=True,
            )
    median = common.medians(times)
    plain_step = median["paged_hf"] / steps["paged_hf"]
    rows = []
    for name in systems:
        per_step = median[name] / steps[name] if steps[name] else None
        row = {"system": name, "median_s": median[name], "times_s": times[name]}
        row |= {"new_tokens": tokens[name], "engine_steps": steps[name]}
        row["ms_per_step"] = None if per_step is None else per_step * 1e3
        row["extra_ms_per_step"] = None if per_step is None else (per_step - plain_step) * 1e3
        row["out_tok_s"] = tokens[name] / median[name]
        row["speedup_vs_transformers"] = median["transformers + criteria"] / median[name]
        rows.append(row)
    return {"calls": n_calls, "batch": 4, "rounds": rounds, "rows": rows}


def bench_beams(model, patched, tok, n_prompts: int, rounds: int) -> dict:
    import paged_hf

    tok.padding_side = "left"
    batch = tok(_prompts(n_prompts), return_tensors="pt", padding=True)
    kw = dict(attention_mask=batch.attention_mask, max_new_tokens=32, num_beams=4, do_sample=False)
    kw["pad_token_id"] = tok.pad_token_id
    engine = paged_hf.engine_for(patched)
    times: dict[str, list[float]] = {"transformers": [], "paged_hf": []}
    outs = {}
    for _ in range(rounds):
        for name, m in (("transformers", model), ("paged_hf", patched)):
            engine.reset_prefix_cache()
            engine._stats.peak_blocks_used = engine._stats.peak_blocks_shared = 0
            start = time.perf_counter()
            outs[name] = m.generate(batch.input_ids, **kw)
            times[name].append(time.perf_counter() - start)
            print(f"  beams {name}: {times[name][-1]:.1f} s", flush=True)
    stats = engine.stats()
    lengths = batch.attention_mask.sum(dim=1).tolist()
    longest = outs["paged_hf"].shape[1] - batch.input_ids.shape[1]
    bs = stats["block_size"]
    one_copy_per_beam = sum(4 * -(-(n + longest) // bs) for n in lengths)
    median = common.medians(times)
    same = sum(torch.equal(a, b) for a, b in zip(outs["paged_hf"], outs["transformers"]))
    out = {"prompts": n_prompts, "beams": 4, "median_s": median, "times_s": times}
    out |= {"speedup": median["transformers"] / median["paged_hf"]}
    out |= {"same_sequences": f"{same} of {n_prompts}"}
    out |= {k: stats[k] for k in ("peak_blocks_used", "peak_blocks_shared")}
    return out | {"blocks_one_copy_per_beam": one_copy_per_beam}


def bench_lm_eval(model, patched, tok, n_gen: int, rounds: int) -> dict:
    import lm_eval
    from eval_tasks import write_tasks
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    directory = Path(tempfile.mkdtemp(prefix="paged_hf_eval_tasks_"))
    write_tasks(directory, n_mc=1, n_gen=n_gen)
    tm = TaskManager(include_path=str(directory), include_defaults=False)
    threads = torch.get_num_threads()
    systems = {
        "HFLM, unpatched": HFLM(pretrained=model, tokenizer=tok, batch_size=16),
        "HFLM, patched": HFLM(pretrained=patched, tokenizer=tok, batch_size=16),
    }
    torch.set_num_threads(threads)
    times: dict[str, list[float]] = {s: [] for s in systems}
    metrics: dict[str, dict] = {}
    for _ in range(rounds):
        for name, lm in systems.items():
            start = time.perf_counter()
            res = lm_eval.simple_evaluate(
                model=lm, tasks=["phf_gen"], task_manager=tm, verbosity="WARNING"
            )
            times[name].append(time.perf_counter() - start)
            torch.set_num_threads(threads)
            metrics[name] = common.eval_metrics(res, "phf_gen")
            print(f"  {name}: {times[name][-1]:.1f} s {metrics[name]}", flush=True)
    median = common.medians(times)
    out = {"prompts": n_gen, "median_s": median, "times_s": times, "metrics": metrics}
    return out | {"speedup": median["HFLM, unpatched"] / median["HFLM, patched"]}


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--n-gen", type=int, default=100)
    p.add_argument("--beam-prompts", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="16 calls, 20 prompts, one round")
    p.add_argument("--out", help="JSON path (default benchmarks/results/calls-<date-time>.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.n_gen, args.beam_prompts, args.rounds = 16, 20, 8, 1

    import paged_hf

    model, tok = common.default_model(args.dtype)
    patched = paged_hf.patch(copy.deepcopy(model))
    print(f"SmolLM2-135M ({args.dtype}), {torch.get_num_threads()} threads", flush=True)
    calls = bench_calls(model, patched, tok, args.calls, args.rounds)
    beams = bench_beams(model, patched, tok, args.beam_prompts, args.rounds)
    evaluation = bench_lm_eval(model, patched, tok, args.n_gen, args.rounds)

    head = [f"{calls['calls']} generate calls x {calls['batch']} prompts", "median s"]
    head += ["new tokens", "out tok/s", "engine steps", "ms per step (over plain)"]
    cells = []
    for r in calls["rows"]:
        extra = r["extra_ms_per_step"]
        step = "" if extra is None else f"{r['ms_per_step']:.1f} ({extra:+.1f})"
        cells.append(
            [r["system"], f"{r['median_s']:.1f}", r["new_tokens"], f"{r['out_tok_s']:.0f}"]
        )
        cells[-1] += [r["engine_steps"], step, f"{r['speedup_vs_transformers']:.2f}x"]
    print("\n" + common.md_table(head + ["vs transformers + criteria"], cells))
    b, wall = beams, beams["median_s"]
    head = [f"beam search, {b['prompts']} prompts x 4 beams", "transformers", "paged_hf"]
    head += ["speedup", "same sequences", "KV blocks at peak (one copy per beam would take)"]
    blocks = f"{b['peak_blocks_used']} ({b['blocks_one_copy_per_beam']}; "
    blocks += f"{b['peak_blocks_shared']} references shared)"
    cells = [["one generate call", f"{wall['transformers']:.1f} s", f"{wall['paged_hf']:.1f} s"]]
    cells[0] += [f"{b['speedup']:.2f}x", b["same_sequences"], blocks]
    print("\n" + common.md_table(head, cells))
    head = [f"lm-eval HFLM on a model object, generate_until, {evaluation['prompts']} prompts"]
    cells = [[n, f"{s:.1f}", evaluation["metrics"][n]] for n, s in evaluation["median_s"].items()]
    print("\n" + common.md_table(head + ["median s", "metrics"], cells))
    print(f"speedup: {evaluation['speedup']:.2f}x")
    config = {"dtype": args.dtype, "threads": torch.get_num_threads()}
    config.update(machine=platform.processor(), date=time.strftime("%Y-%m-%d %H:%M"))
    out = {"config": config, "calls": calls, "beams": beams, "lm_eval": evaluation}
    common.write_json(args.out or common.stamped("calls"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
