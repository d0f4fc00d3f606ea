"""``bench.py --profile``: where paged_hf's step time goes, on W-mixed (or --profile-workload).

Two passes over the same workload on a fresh engine each:
1. timing pass: the engine's parts are wrapped from here (paged_hf's files are not touched)
   and timed with perf_counter per step: scheduler.schedule, build_step_metadata,
   backend.copy_blocks + backend.plan, the model forward (attention, i.e. backend.attend,
   broken out of it, and on a CPU the packed linear layers' GEMMs), sample, scheduler.update +
   mark_computed + stats. "Overhead" is step
   time outside the model forward: the part that does not shrink with faster kernels.
2. torch.profiler pass: the top ops by self CPU time.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Any, Callable

import bench_systems as S
import bench_workloads as W
import common
import torch

PARTS = tuple("schedule metadata plan forward attention linear sample update other".split())


class StepTimer:
    def __init__(self) -> None:
        self.cur: dict[str, float] = defaultdict(float)
        self.steps: list[dict] = []

    def wrap(self, owner: Any, name: str, part: str) -> Callable[[], None]:
        """Replace owner.name by a timed wrapper; return an undo function."""
        original = getattr(owner, name)
        had_own = name in getattr(owner, "__dict__", {})

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.cur[part] += time.perf_counter() - t0

        setattr(owner, name, timed)

        def undo() -> None:
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

        return undo

    def hook_forward(self, model: torch.nn.Module) -> Callable[[], None]:
        start: list[float] = []

        def pre(*_: Any, **__: Any) -> None:
            start.append(time.perf_counter())

        def post(*_: Any, **__: Any) -> None:
            self.cur["forward"] += time.perf_counter() - start.pop()

        h1 = model.register_forward_pre_hook(pre)
        h2 = model.register_forward_hook(post)
        return lambda: (h1.remove(), h2.remove())

    def end_step(self, total: float, tokens: int, running: int, decode_only: bool) -> None:
        row = dict(self.cur, total=total)
        # attention and linear are inside forward
        timed = ("schedule", "metadata", "plan", "forward", "sample", "update")
        row["other"] = max(0.0, total - sum(row.get(p, 0.0) for p in timed))
        row.update(tokens=tokens, running=running, decode_only=decode_only)
        self.steps.append(row)
        self.cur = defaultdict(float)


def instrument(engine: Any, timer: StepTimer) -> list[Callable[[], None]]:
    import paged_hf.engine.step as engine_mod
    import paged_hf.execution.runner as runner_mod

    undo = [
        timer.wrap(engine.scheduler, "schedule", "schedule"),
        timer.wrap(runner_mod, "build_step_metadata", "metadata"),
        timer.wrap(engine_mod, "sample", "sample"),
        timer.wrap(engine.scheduler, "update", "update"),
        timer.wrap(engine.scheduler, "mark_computed", "update"),
        timer.wrap(engine_mod, "record_step", "update"),
        timer.hook_forward(engine.model),
    ]
    backend = engine.runner.backend
    for name in ("plan", "copy_blocks"):
        if hasattr(backend, name):
            undo.append(timer.wrap(backend, name, "plan"))
    if hasattr(backend, "attend"):
        undo.append(timer.wrap(backend, "attend", "attention"))
    if engine.runner.packed is not None:  # the linear layers' GEMMs on packed weights (a CPU)
        from paged_hf.execution.cpu import linear as cpu_linear

        undo.append(timer.wrap(cpu_linear.PackedWeight, "__call__", "linear"))
    return undo


def timed_run(engine: Any, w: Any) -> StepTimer:
    timer = StepTimer()
    undo = instrument(engine, timer)
    original_step = engine.step

    def step() -> Any:
        t0 = time.perf_counter()
        out = original_step()
        total = time.perf_counter() - t0
        log = engine._stats.step_log[-1] if engine._stats.step_log else {}
        decode_only = bool(out[0]) and log.get("tokens") == len(out[0])
        timer.end_step(total, log.get("tokens", 0), log.get("running", 0), decode_only)
        return out

    engine.step = step
    try:
        S.run_paged(engine, w, tag="t")
    finally:
        del engine.step
        for u in reversed(undo):
            u()
    return timer


def summarise(steps: list[dict]) -> dict:
    total = sum(s["total"] for s in steps)
    if not total:
        return {"steps": len(steps)}
    share = {p: sum(s.get(p, 0.0) for s in steps) / total for p in PARTS}
    out = {"steps": len(steps), "step_time_s": total, "tokens": sum(s["tokens"] for s in steps)}
    out |= {"share": share, "overhead_share": 1 - share["forward"]}
    return out | {"mean_step_ms": 1e3 * total / len(steps)}


def format_summary(title: str, s: dict) -> str:
    if "share" not in s:
        return f"{title}: no steps"
    parts = ", ".join(f"{p} {s['share'][p]:.1%}" for p in PARTS)
    return (
        f"{title}: {s['steps']} steps, {s['step_time_s']:.2f}s, mean {s['mean_step_ms']:.1f} ms/step, "
        f"{s['tokens']} tokens\n    outside the forward (schedule+metadata+plan+sample+update+other): "
        f"{s['overhead_share']:.1%}\n    {parts}  (attention and linear are inside forward)"
    )


def decode_steps(
    model: Any, backend: str, n: int, ctx: int, steps: int, pool: list[int], seed: int = 0
) -> dict:
    """Time ``steps`` pure decode steps of ``n`` running sequences at ~``ctx`` tokens of context
    (a 512-token shared prefix + the rest their own, as in W-prefix-long) on a fresh engine."""
    import random

    from paged_hf import Engine, SamplingParams

    rng = random.Random(seed)
    ids = lambda k: [pool[rng.randrange(len(pool))] for _ in range(k)]  # noqa: E731
    shared = ids(min(512, ctx - 1))
    prompts = [shared + ids(ctx - len(shared)) for _ in range(n)]
    engine = Engine(model, backend=backend, max_num_seqs=n)
    # long enough that the first admitted are still running when the last finishes its prefill
    params = SamplingParams(max_new_tokens=steps + 512, min_new_tokens=steps + 512, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"d{i}")
    while any(not r.output_ids for r in engine.requests.values()):  # prefill all, then decode only
        engine.step()
    assert len(engine.scheduler.running) == n, f"{len(engine.scheduler.running)} of {n} running"
    timer = StepTimer()
    undo = instrument(engine, timer)
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            sampled, _ = engine.step()
            log = engine._stats.step_log[-1]
            timer.end_step(time.perf_counter() - t0, log["tokens"], log["running"], True)
            assert log["tokens"] == n, log
    finally:
        for u in reversed(undo):
            u()
    engine.abort_all(list(engine.requests))
    s = summarise(timer.steps)
    row = {"backend": engine.stats()["backend"], "running": n, "context": ctx, **s}
    return row | {"attention_ms": 1e3 * s["share"]["attention"] * s["step_time_s"] / s["steps"]}


def main_decode(args: Any, B: Any) -> int:
    """``bench.py --profile-decode NxL``: the decode step at N running sequences of ~L tokens, the
    torch path and the CPU kernel alternating (--repeat rounds), attention's share of step time."""
    n, ctx = (int(x) for x in args.profile_decode.lower().split("x"))
    dtype_name, model, pool = engine_model(args, B)
    rows = []
    for rep in range(args.repeat):
        for backend in ("torch", "auto"):
            r = decode_steps(model, backend, n, ctx, args.profile_steps, pool)
            rows.append(r)
            print(
                f"round {rep + 1} {r['backend']:6s}: {r['mean_step_ms']:7.1f} ms/step, attention "
                f"{r['attention_ms']:7.1f} ms = {r['share']['attention']:.1%} of the step",
                flush=True,
            )
    report = {"decode_steps": rows, "dtype": dtype_name, "threads": args.threads}
    print(
        f"\ndecode step, {n} running sequences x ~{ctx} tokens of context, {dtype_name}, {args.threads} threads "
        f"(median over {args.repeat} rounds of {args.profile_steps} steps):"
    )
    med = {}
    for backend in ("torch", "cpu"):
        rs = sorted((r for r in rows if r["backend"] == backend), key=lambda r: r["mean_step_ms"])
        if rs:
            m = med[backend] = rs[(len(rs) - 1) // 2]
            print(
                f"  {backend:5s}  step {m['mean_step_ms']:7.1f} ms  attention {m['attention_ms']:7.1f} ms  "
                f"share {m['share']['attention']:.1%}"
            )
    if len(med) == 2:
        print(
            f"  attention share: {med['cpu']['share']['attention'] / med['torch']['share']['attention']:.2f} of the "
            f"torch path's; step time {med['torch']['mean_step_ms'] / med['cpu']['mean_step_ms']:.2f}x faster"
        )
    common.write_json(args.out or common.stamped("decode-step"), report)
    return 0


def engine_model(args: Any, B: Any) -> tuple[str, Any, list[int]]:
    """(dtype name, the model paged_hf patches, the ids prompts draw from); the dtype is the last
    of --dtypes (bf16 unless told otherwise)."""
    dtype_name = args.dtypes[-1]
    _, model, special, _ = B.load_models(args.smoke, B.DTYPES[dtype_name])
    return dtype_name, model, W.allowed_ids(model.config.get_text_config().vocab_size, special)


def main(args: Any, B: Any, engine_cfg: dict) -> int:
    """B: the bench module (its model loading and workloads)."""
    from paged_hf import Engine

    dtype_name, model, pool = engine_model(args, B)
    args.workloads = [args.profile_workload]
    w = B.build_workloads(args, pool)[0]
    warm = W.warm(pool)
    print(
        f"profiling paged_hf on {w.name}, {dtype_name}, {args.threads} threads, engine {engine_cfg or 'defaults'}"
    )

    engine = Engine(model, **engine_cfg)
    S.run_paged(engine, warm, tag="warm")
    timer = timed_run(engine, w)
    most = min(64, max(x["running"] for x in timer.steps))
    parts = {
        "all_steps": ("all steps", timer.steps),
        "steps_with_max_running": (
            f"steps with >= {most} running",
            [s for s in timer.steps if s["running"] >= most],
        ),
        "decode_only_steps": ("pure decode steps", [s for s in timer.steps if s["decode_only"]]),
    }
    report = {"workload": w.name, "dtype": dtype_name}
    for key, (title, steps) in parts.items():
        report[key] = summarise(steps)
        print(format_summary(title, report[key]))
    report["per_step"] = timer.steps
    del engine

    engine = Engine(model, **engine_cfg)
    S.run_paged(engine, warm, tag="warm")
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=args.profile_shapes) as prof:
        S.run_paged(engine, w, tag="p")
    wall = time.perf_counter() - t0
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
    print(
        f"\ntorch.profiler, {w.name} under the profiler ({wall:.1f}s wall), top ops by self CPU time:"
    )
    print(table)
    report["profiler_table"] = table
    if args.profile_shapes:
        by_shape = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=args.profile_rows
        )
        print("\nthe same, by input shapes:")
        print(by_shape)
        report["profiler_table_by_shape"] = by_shape
    common.write_json(args.out or common.stamped("profile"), report)
    return 0
