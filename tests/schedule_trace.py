"""Scheduler traces, the guard for refactors of the scheduler, the step and the tiers: every step's
(request, tokens) list, preemptions, swaps and queue, and each request's tokens, over 11 workloads
under fcfs and priority plus a lock-step generate call and beam search, on a clock the driver
advances per step. Two trees that schedule alike write byte-identical JSON (docs/testing.md):

    python tests/schedule_trace.py before.json      # at the commit before the change
    python tests/schedule_trace.py after.json && cmp before.json after.json
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from tiny_models import make_tiny_model, tiny_prompts  # noqa: E402
from transformers import StoppingCriteria, StoppingCriteriaList  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf import SamplingParams  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def drive(engine, clock, late=(), max_steps=2000):
    """Step until done; ``late``: (step, prompt, params) added at that step. The trace."""
    log = []
    sched = engine.scheduler
    original = sched.schedule

    def schedule():
        out = original()
        log.append(
            {
                "scheduled": [(r.request_id, n) for r, n in out.scheduled],
                "preempted": [r.request_id for r in out.preempted],
                "swap_out": [r.request_id for r, _ in out.swap_out],
                "swap_in": [r.request_id for r, _ in out.swap_in],
                "waiting": [r.request_id for r in sched.waiting],
            }
        )
        return out

    sched.schedule = schedule
    late = list(late)
    step = 0
    while engine.has_unfinished or late:
        for item in [x for x in late if x[0] <= step]:
            late.remove(item)
            engine.add_request(item[1], item[2], request_id=item[3])
        if engine.has_unfinished:
            engine.step()
        clock.now += 0.01 + 0.001 * len(log[-1]["scheduled"]) if log else 0.01
        step += 1
        assert step < max_steps
    del sched.schedule
    return log


def run_case(model, name, policy, prompts, params_of, engine_kw, late=(), pre=None):
    engine = paged_hf.Engine(model, scheduling_policy=policy, **engine_kw)
    clock = Clock()
    engine.scheduler.clock = clock
    for i, p in enumerate(prompts):
        engine.add_request(p, params_of(i), request_id=f"r{i}")
    finished = {}
    orig_step = engine.step

    def step():
        sampled, fin = orig_step()
        for r in fin:
            finished[r.request_id] = (list(r.output_ids), str(r.finish_reason), r.error)
        return sampled, fin

    engine.step = step
    if pre:
        pre(engine)
    log = drive(engine, clock, late)
    st = engine.stats()
    return {
        "steps": log,
        "finished": finished,
        "preemptions": st["preemptions"],
        "prefix_hit_tokens": st.get("prefix_hit_tokens"),
    }


def main(path):
    torch.manual_seed(0)
    model = make_tiny_model("llama").double()
    V = model.config.vocab_size
    mixed = tiny_prompts(V, 12, [5, 40, 17, 63, 9, 28, 33, 2, 50, 21, 12, 44], seed=1)
    shared = tiny_prompts(V, 1, 37, seed=2)[0]
    prefixed = [shared + p for p in tiny_prompts(V, 8, [3, 9, 1, 14, 6, 20, 2, 11], seed=3)]
    greedy = lambda n: lambda i: SamplingParams(max_new_tokens=n + (i * 7) % 13, ignore_eos=True)  # noqa: E731
    prio = lambda i: SamplingParams(  # noqa: E731
        max_new_tokens=6 + (i * 5) % 11, ignore_eos=True, priority=(i * 3) % 4
    )
    sampled = lambda i: SamplingParams(  # noqa: E731
        max_new_tokens=8, n=1 + i % 3, temperature=0.8, seed=i, ignore_eos=True
    )
    late = [
        (
            3 + 2 * k,
            p,
            SamplingParams(max_new_tokens=5 + k, ignore_eos=True, priority=k % 2),
            f"late{k}",
        )
        for k, p in enumerate(tiny_prompts(V, 5, [30, 8, 19, 45, 4], seed=9))
    ]
    cases = {
        "roomy": (mixed, greedy(8), dict(block_size=4, num_blocks=400), ()),
        "small_pool": (mixed, greedy(12), dict(block_size=4, num_blocks=40), ()),
        "small_pool_swap": (
            mixed,
            greedy(12),
            dict(block_size=4, num_blocks=40, preemption_mode="swap"),
            (),
        ),
        "chunked": (
            mixed,
            greedy(10),
            dict(
                block_size=4,
                num_blocks=300,
                max_num_batched_tokens=24,
                max_prefill_tokens_while_decoding=8,
            ),
            (),
        ),
        "prefix": (
            prefixed,
            greedy(6),
            dict(block_size=4, num_blocks=300, max_num_batched_tokens=32),
            (),
        ),
        "samples_small": (mixed[:8], sampled, dict(block_size=4, num_blocks=60), ()),
        "seats": (mixed, greedy(9), dict(block_size=4, num_blocks=400, max_num_seqs=3), ()),
        "priorities_small": (mixed, prio, dict(block_size=4, num_blocks=45), late),
        "priorities_seats": (mixed, prio, dict(block_size=4, num_blocks=400, max_num_seqs=4), late),
        "late_chunked": (
            mixed[:6],
            prio,
            dict(block_size=4, num_blocks=60, max_num_batched_tokens=20),
            late,
        ),
        "max_waiting": (
            mixed[:4],
            prio,
            dict(block_size=4, num_blocks=400, max_num_seqs=2, max_waiting=3),
            (),
        ),
    }
    result = {}
    for policy in ("fcfs", "priority"):
        for name, (prompts, params_of, kw, lt) in cases.items():
            if name == "max_waiting":
                # the queue sheds or refuses at add time: record what add does
                engine = paged_hf.Engine(model, scheduling_policy=policy, **kw)
                engine.scheduler.clock = Clock()
                events = []
                for i, p in enumerate(mixed):
                    try:
                        engine.add_request(p, params_of(i), request_id=f"r{i}")
                        events.append(("added", f"r{i}"))
                    except Exception as e:  # noqa: BLE001
                        events.append(("refused", f"r{i}", type(e).__name__))
                log = drive(engine, engine.scheduler.clock)
                result[f"{policy}/{name}"] = {"events": events, "steps": log}
                continue
            result[f"{policy}/{name}"] = run_case(model, name, policy, prompts, params_of, kw, lt)
        # a generate call with a per-row criterion (rows held in lock step) beside bystanders, small pool
        result[f"{policy}/call_group"] = call_group_case(model, policy, mixed)
        result[f"{policy}/beams"] = beams_case(model, policy, mixed)
    with open(path, "w") as f:
        json.dump(result, f, indent=0, sort_keys=True, default=str)
    print(path, sum(len(v.get("steps", [])) for v in result.values()), "steps")


class LastTokenIn(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.tensor([int(t) % 5 == 0 for t in input_ids[:, -1]])


def call_group_case(model, policy, prompts):
    m = paged_hf.patch(
        make_tiny_model("llama").double(),
        block_size=4,
        num_blocks=30,
        max_num_batched_tokens=16,
        scheduling_policy=policy,
    )
    engine = paged_hf.engine_for(m)
    clock = Clock()
    engine.scheduler.clock = clock
    log = []
    original = engine.scheduler.schedule

    def schedule():
        out = original()
        clock.now += 0.01
        log.append(
            {
                "scheduled": [(r.request_id, n) for r, n in out.scheduled],
                "preempted": [r.request_id for r in out.preempted],
            }
        )
        return out

    engine.scheduler.schedule = schedule
    by = [
        engine.add_request(
            p, SamplingParams(max_new_tokens=10, ignore_eos=True), request_id=f"b{i}"
        )
        for i, p in enumerate(prompts[6:9])
    ]
    from tiny_models import left_pad

    ids, mask = left_pad(prompts[:4])
    out = m.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        stopping_criteria=StoppingCriteriaList([LastTokenIn()]),
    )
    rest = engine.run_until_done(by)
    return {"steps": log, "sequences": out.tolist(), "bystanders": [o.token_ids for o in rest]}


def beams_case(model, policy, prompts):
    engine = paged_hf.Engine(
        model, block_size=4, num_blocks=50, max_num_batched_tokens=24, scheduling_policy=policy
    )
    engine.scheduler.clock = Clock()
    log = []
    original = engine.scheduler.schedule

    def schedule():
        out = original()
        engine.scheduler.clock.now += 0.01
        log.append(
            {
                "scheduled": [(r.request_id, n) for r, n in out.scheduled],
                "preempted": [r.request_id for r in out.preempted],
            }
        )
        return out

    engine.scheduler.schedule = schedule
    res = engine.beam_search(prompts[:3], num_beams=3, max_new_tokens=8)
    return {"steps": log, "beams": [[(t, round(s, 6)) for t, s in r] for r in res]}


if __name__ == "__main__":
    main(sys.argv[1])
