"""The tiers under the prefix cache, on SmolLM2-135M-Instruct (bf16, CPU): the disk tier
(``kv_cache_dir``) across processes, what a second process computes and how long it takes against
the first; the host tier (``kv_host_cache_bytes``) against the pool alone.

    python benchmarks/bench_kv_tiers.py                 # every scenario
    python benchmarks/bench_kv_tiers.py --quick         # fewer prompts, shorter document
    python benchmarks/bench_kv_tiers.py --scenarios eval --batch-invariant  # outputs must be equal
    python benchmarks/bench_kv_tiers.py --scenarios eval --dtype float32      # (equal here, not promised)

Scenarios, each run as separate processes in turn (a fresh directory per scenario):
- ``eval``: lm-evaluation-harness's ``phf_gen_shots`` (benchmarks/eval_tasks.py: generate_until,
  5 shots per prompt drawn per document, the same in every run) through ``--model paged_hf``:
  once without a directory, then twice with one. Per run: prefill tokens computed, disk-tier blocks
  read and written, the evaluation's wall time (model loading excluded; the process's whole
  time beside it) and the metric.
- ``document``: a ~4k-token document and 32 questions about it, asked one after another through
  ``Engine.generate``: in a first process and then in a second on the same directory. Per run: the
  first question's TTFT, the median of the others', prefill tokens computed.
- ``host``: a working set 3x the pool (24 prompts of 1,024 tokens, the pool holding 8), asked in
  three shuffled rounds: prompts/s and hits with the pool alone and with a host tier holding them
  all, written on eviction (the default) and written through. On a CPU the host tier is the same memory as the pool: this measures the mechanism (and a
  pool capped below the machine's memory), not a device's copy costs.

Prints a table, writes JSON to benchmarks/results/. No assertion on time anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common


def eval_worker(args) -> dict:
    t0 = time.perf_counter()
    import lm_eval
    import torch
    from bench_eval import _model_dir
    from lm_eval.tasks import TaskManager

    from paged_hf.integrations.lm_eval import PagedHFLM

    torch.set_num_threads(args.threads)
    t1 = time.perf_counter()
    extra = {"kv_cache_dir": args.kv_dir} if args.kv_dir else {}
    extra |= {"batch_invariant": True} if args.batch_invariant else {}
    lm = PagedHFLM(pretrained=str(_model_dir("default")), dtype=args.dtype, device="cpu", **extra)
    torch.set_num_threads(args.threads)
    t2 = time.perf_counter()
    tm = TaskManager(include_path=args.tasks_dir, include_defaults=False)
    start = time.perf_counter()
    res = lm_eval.simple_evaluate(
        model=lm, tasks=["phf_gen_shots"], task_manager=tm, log_samples=True, verbosity="WARNING"
    )
    lm.engine.flush_kv_tiers()  # the records are the run's output: count their writing
    wall = time.perf_counter() - start
    samples = sorted(res["samples"]["phf_gen_shots"], key=lambda x: x["doc_id"])
    outputs = [x["filtered_resps"] for x in samples]
    row = {"eval_s": wall, "import_s": t1 - t0, "load_s": t2 - t1}
    row |= {"metrics": common.eval_metrics(res, "phf_gen_shots"), "outputs": outputs}
    return row | _engine(lm.engine)


def document_worker(args) -> dict:
    import paged_hf
    from paged_hf import SamplingParams

    common.set_threads(args.threads)
    model, tok = common.default_model(args.dtype)
    engine = paged_hf.Engine(model, tok, kv_cache_dir=args.kv_dir, max_model_len=8192)
    document = _document(tok, args.doc_tokens)
    ttfts, answers = [], []
    for i in range(args.questions):
        content = f"{document}\n\nQuestion {i + 1}: {QUESTIONS[i % 8]}"
        chat = [{"role": "user", "content": content}]
        prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        out = engine.generate([prompt], SamplingParams(max_new_tokens=8))[0]
        ttfts.append(out.ttft)
        answers.append(out.token_ids)
    engine.flush_kv_tiers()
    row = {"first_ttft_s": ttfts[0], "other_ttft_median_s": statistics.median(ttfts[1:])}
    return row | {"answers": answers} | _engine(engine)


def host_worker(args) -> dict:
    """A working set 3x the pool: ``3 * args.pool_prompts`` distinct prompts of 1,024 tokens, asked
    in three shuffled rounds, four at a time, with the pool alone and with a host tier that holds
    them all; one process, the two engines in turn."""
    import random

    import paged_hf
    from paged_hf import SamplingParams

    common.set_threads(args.threads)
    model, tok = common.default_model(args.dtype)
    rng = random.Random(0)
    vocab = [t for t in range(1000, 30000) if t not in set(tok.all_special_ids)]
    prompts = [[rng.choice(vocab) for _ in range(1024)] for _ in range(3 * args.pool_prompts)]
    order = [i for _ in range(3) for i in rng.sample(range(len(prompts)), len(prompts))]
    blocks = args.pool_prompts * 1024 // 16 + 64  # the prompts of a third of the set, and room
    out = {}
    room = 2 * len(prompts) * 1024 * 23 * 1024
    configs = [("pool alone", None, "eviction"), ("host tier", room, "eviction")]
    configs += [("host tier, written through", room, "through")]
    for name, host, write in configs:
        tier = dict(kv_host_cache_bytes=host, kv_host_write=write)
        engine = paged_hf.Engine(model, tok, num_blocks=blocks, **tier)
        start = time.perf_counter()
        for k in range(0, len(order), 4):
            batch = [prompts[i] for i in order[k : k + 4]]
            engine.generate(batch, SamplingParams(max_new_tokens=4, ignore_eos=True))
        wall = time.perf_counter() - start
        s = engine.stats()
        host = s["kv_tiers"].get("host", {})
        out[name] = {"wall_s": wall, "prompts_per_s": len(order) / wall}
        out[name] |= {k: s[k] for k in ("prompt_tokens", "prefill_tokens_computed")}
        out[name] |= {"prefix_hit_tokens": s["prefix_hit_tokens"]}
        out[name] |= {f"host_{k}": host.get(k, 0) for k in ("hit_tokens", "stored_blocks")}
        out[name]["tiers"] = s["kv_tiers"].get("total")
    return {"configs": out, "num_blocks": blocks, "prompts": len(prompts)}


QUESTIONS = """Who went to the market?|How many apples were there at the end?|What was the weather
like?|Who had the most stamps?|Where did they go after school?|How many coins were given away?|What
did the dog do?|Summarise the first paragraph in five words.""".replace("\n", " ").split("|")


def _document(tok, n_tokens: int) -> str:
    import random

    from eval_tasks import _story

    rng, parts = random.Random(0), []
    while len(tok(" ".join(parts))["input_ids"]) < n_tokens:
        passage, question, answer = _story(rng)
        parts.append(f"{passage} {question} The answer is {answer}.")
    return " ".join(parts)


def _engine(engine) -> dict:
    s = engine.stats()
    disk, total = s["kv_tiers"].get("disk", {}), s["kv_tiers"].get("total", {})
    row = {k: s[k] for k in ("prompt_tokens", "prefill_tokens_computed", "prefix_hit_tokens")}
    row["disk"] = {
        k: disk.get(k) for k in "hit_tokens stored_blocks bytes_read bytes_written".split()
    }
    row["disk"] |= {k: total.get(k) for k in ("read_s", "load_s", "write_s", "recompute_saved_s")}
    return row


def run_worker(kind: str, kv_dir: str | None, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--threads", str(args.threads)]
    cmd += ["--tasks-dir", args.tasks_dir, "--questions", str(args.questions)]
    cmd += ["--doc-tokens", str(args.doc_tokens), "--dtype", args.dtype]
    cmd += ["--pool-prompts", str(args.pool_prompts)]
    cmd += ["--batch-invariant"] if args.batch_invariant else []
    if kv_dir:
        cmd += ["--kv-dir", kv_dir]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - start
    return row


def main(argv=None) -> int:
    p = common.parser(__doc__)
    p.add_argument("--scenarios", default="eval,document,host")
    p.add_argument("--pool-prompts", type=int, default=8, help="host: prompts the pool holds")
    p.add_argument("--n-gen", type=int, default=100, help="eval: prompts")
    p.add_argument("--questions", type=int, default=32, help="document: questions")
    p.add_argument("--doc-tokens", type=int, default=4000)
    common.add_threads(p, default=2)
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    h = "eval: EngineConfig(batch_invariant=True), outputs independent of batch shapes"
    p.add_argument("--batch-invariant", action="store_true", help=h)
    p.add_argument("--timeout", type=float, default=1200.0, help="per process")
    h = "20 prompts, 8 questions, 1k-token document"
    p.add_argument("--quick", action="store_true", help=h)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--kv-dir", help=argparse.SUPPRESS)
    p.add_argument("--tasks-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(common.RESULTS), help="the JSON's folder")
    args = p.parse_args(argv)  # the eval worker times its imports, torch's among them
    if args.worker:
        workers = {"eval": eval_worker, "document": document_worker, "host": host_worker}
        row = workers[args.worker](args)
        print(json.dumps(row))
        return 0
    if args.quick:
        args.n_gen, args.questions, args.doc_tokens, args.pool_prompts = 20, 8, 1000, 2
    from eval_tasks import write_tasks

    work = Path(tempfile.mkdtemp(prefix="paged_hf_tiers_"))
    args.tasks_dir = str(write_tasks(work / "tasks", n_mc=1, n_gen=args.n_gen, n_rolling=1))
    rows = []
    for scenario in args.scenarios.split(","):
        kv_dir = str(work / f"kv_{scenario}")
        runs = {
            "eval": [("no directory", None), ("first", kv_dir), ("second", kv_dir)],
            "document": [("first", kv_dir), ("second", kv_dir)],
            "host": [("one process", None)],
        }[scenario]
        for name, d in runs:
            print(f"{scenario}: {name} process ...", flush=True)
            row = {"scenario": scenario, "run": name, **run_worker(scenario, d, args)}
            rows.append(row)
            print("  " + _line(row), flush=True)
    print()
    for row in rows:
        print(_line(row))
    _summary(rows)
    common.write_json(common.stamped("kv_tiers", args.out), {"args": vars(args), "rows": rows})
    return 0


def _line(row: dict) -> str:
    if row["scenario"] == "host":
        return "host: " + "; ".join(
            f"{name} {c['prompts_per_s']:.2f} prompts/s, prefill computed "
            f"{c['prefill_tokens_computed']:,} of {c['prompt_tokens']:,}, pool hits "
            f"{c['prefix_hit_tokens']:,}, host hits {c['host_hit_tokens']:,}, "
            f"blocks to host {c['host_stored_blocks']:,}"
            for name, c in row["configs"].items()
        )
    d, r = row["disk"], row
    head = f"{r['scenario']:8s} {r['run']:12s} prefill computed {r['prefill_tokens_computed']:7,d}"
    head += (
        f"  disk read {d['hit_tokens'] or 0:7,d} tok  written {d['stored_blocks'] or 0:5,d} blocks"
    )
    if r["scenario"] == "eval":
        head += f"  eval {r['eval_s']:6.1f} s  process {r['process_s']:6.1f} s"
        return head + f" (imports {r['import_s']:.1f} s, model {r['load_s']:.1f} s)  {r['metrics']}"
    return (
        head
        + f"  first TTFT {r['first_ttft_s']:.3f} s  others' median {r['other_ttft_median_s']:.3f} s"
    )


def _differing(a: dict, b: dict) -> int:
    return sum(x != y for x, y in zip(a["outputs"], b["outputs"]))


def _summary(rows: list[dict]) -> None:
    by = {(r["scenario"], r["run"]): r for r in rows}
    if ("eval", "second") in by:
        first, second = by["eval", "first"], by["eval", "second"]
        print(
            f"eval: the second process computed {second['prefill_tokens_computed'] / first['prefill_tokens_computed']:.0%} "
            f"of the first's prefill tokens, in {first['eval_s'] / second['eval_s']:.1f}x less time; "
            f"metrics {first['metrics']} / {second['metrics']}; outputs differing from the run "
            f"without a directory: first {_differing(first, by['eval', 'no directory'])}, second "
            f"{_differing(second, by['eval', 'no directory'])} of {len(first['outputs'])}"
        )
    if ("host", "one process") in by:
        c = by["host", "one process"]["configs"]
        print(
            f"host: a working set 3x the pool, {c['host tier']['prompts_per_s'] / c['pool alone']['prompts_per_s']:.1f}x "
            f"the pool alone's prompts/s; host hit rate "
            f"{c['host tier']['host_hit_tokens'] / c['host tier']['prompt_tokens']:.0%} of prompt tokens"
        )
    if ("document", "second") in by:
        first, second = by["document", "first"], by["document", "second"]
        print(
            f"document: first question's TTFT {first['first_ttft_s']:.3f} s -> {second['first_ttft_s']:.3f} s "
            f"({first['first_ttft_s'] / second['first_ttft_s']:.1f}x lower); answers "
            f"{'equal' if first['answers'] == second['answers'] else 'DIFFER'}"
        )


if __name__ == "__main__":
    sys.exit(main())
