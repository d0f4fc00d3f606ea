"""The "priority" scheduling policy against the default "fcfs": order, displacement under the
sequence cap and under the block pool, lookahead, aging, the waiting-queue bound, and tokens
that do not depend on any of it (fp64 greedy and seeded sampling, against each request alone)."""

from __future__ import annotations

import pytest
from engine_state import assert_clean
from tiny_models import tiny_prompts

import paged_hf
from paged_hf import SamplingParams

SMALL = dict(block_size=4, max_num_batched_tokens=16)


def drain(engine, arrivals=None):
    """Step until done; ``arrivals``: {step number: [(prompt, params, id)]} added before that
    step. Returns ({id: output}, [per step: ([(id, tokens)], [preempted ids])])."""
    arrivals = arrivals or {}
    outputs, log, step = {}, [], 0
    while engine.has_unfinished or any(k >= step for k in arrivals):
        for prompt, params, rid in arrivals.get(step, []):
            engine.add_request(prompt, params, request_id=rid)
        schedule = engine.scheduler.schedule

        def recording(schedule=schedule):
            out = schedule()
            log.append(
                (
                    [(r.request_id, n) for r, n in out.scheduled],
                    [r.request_id for r in out.preempted],
                )
            )
            return out

        engine.scheduler.schedule = recording
        try:
            _, finished = engine.step()
        finally:
            engine.scheduler.schedule = schedule
        step += 1
        for req in finished:
            root = req.parent or req
            if root.samples_finished and engine.requests.get(root.request_id) is root:
                outputs[root.request_id] = engine.collect([root])
    return outputs, log


def alone(model, prompt, params, **config):
    return paged_hf.Engine(model, num_blocks=64, **config).generate([prompt], params)[0].token_ids


def first_step(log, rid):
    return next(i for i, (scheduled, _) in enumerate(log) if rid in dict(scheduled))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_equal_priorities_without_lookahead_schedule_exactly_as_fcfs(model, mode):
    """With one priority and no lookahead the policy is fcfs: the same requests and token counts
    at every step, the same preemptions, the same tokens (blocks run out: preemption happens)."""
    prompts = tiny_prompts(model.config.vocab_size, 8, [9, 23, 5, 17, 30, 3, 12, 26], seed=7)
    params = [SamplingParams(max_new_tokens=14, ignore_eos=True)] * 8
    # two seats at once: a head that does not fit while one-seat requests behind it would
    params[3] = params[6] = SamplingParams(max_new_tokens=9, n=2, temperature=0.8, seed=3)
    arrivals = {0: [(p, params[i], f"r{i}") for i, p in enumerate(prompts[:5])]}
    arrivals[3] = [(p, params[i + 5], f"r{i + 5}") for i, p in enumerate(prompts[5:])]
    config = dict(SMALL, num_blocks=18, max_num_seqs=3, preemption_mode=mode)
    fcfs_out, fcfs_log = drain(paged_hf.Engine(model, **config), arrivals)
    engine = paged_hf.Engine(
        model, **config, scheduling_policy="priority", priority_lookahead=0, priority_aging_s=None
    )
    prio_out, prio_log = drain(engine, arrivals)
    assert any(preempted for _, preempted in fcfs_log), "the workload must preempt"
    assert prio_log == fcfs_log
    assert {k: [c.token_ids for c in o.completions] for k, o in prio_out.items()} == {
        k: [c.token_ids for c in o.completions] for k, o in fcfs_out.items()
    }
    assert_clean(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_urgent_request_displaces_batch_work_when_the_sequence_cap_binds(model, mode):
    prompts = tiny_prompts(model.config.vocab_size, 4, [12, 9, 15, 6], seed=5)
    batch = SamplingParams(max_new_tokens=12, ignore_eos=True, priority=1)
    urgent = SamplingParams(max_new_tokens=6, ignore_eos=True, priority=0)
    config = dict(SMALL, num_blocks=64, max_num_seqs=2, preemption_mode=mode)
    arrivals = {0: [(p, batch, f"b{i}") for i, p in enumerate(prompts[:3])]}
    arrivals[4] = [(prompts[3], urgent, "urgent")]
    engine = paged_hf.Engine(model, **config, scheduling_policy="priority")
    outputs, log = drain(engine, arrivals)
    assert first_step(log, "urgent") == 4, "admitted in the step after it arrived"
    assert log[4][1] == ["b1"], "the least urgent, latest arrival among the running is displaced"
    assert outputs["b1"].preemptions == 1 and outputs["urgent"].preemptions == 0
    # fcfs: the urgent request waits behind the third batch request
    _, fcfs_log = drain(paged_hf.Engine(model, **config), arrivals)
    assert first_step(fcfs_log, "urgent") > first_step(fcfs_log, "b2") > 4
    for rid, prompt, params in [("urgent", prompts[3], urgent)] + [
        (f"b{i}", p, batch) for i, p in enumerate(prompts[:3])
    ]:
        assert outputs[rid].token_ids == alone(model, prompt, params, **SMALL), rid
    assert_clean(engine)


def test_an_urgent_request_displaces_batch_work_when_blocks_run_out(model):
    prompts = tiny_prompts(model.config.vocab_size, 3, [44, 44, 10], seed=9)
    batch = SamplingParams(max_new_tokens=8, ignore_eos=True, priority=1)
    urgent = SamplingParams(max_new_tokens=5, ignore_eos=True, priority=0)
    # two batch requests fill the pool (13 blocks of 4 each at the end); the urgent one needs 3
    config = dict(SMALL, num_blocks=26, max_num_seqs=8, enable_prefix_caching=False)
    arrivals = {0: [(p, batch, f"b{i}") for i, p in enumerate(prompts[:2])]}
    arrivals[7] = [(prompts[2], urgent, "urgent")]
    engine = paged_hf.Engine(model, **config, scheduling_policy="priority")
    outputs, log = drain(engine, arrivals)
    assert first_step(log, "urgent") == 7
    assert log[7][1] == ["b1"]
    fcfs_out, fcfs_log = drain(paged_hf.Engine(model, **config), arrivals)
    assert not any(preempted for _, preempted in fcfs_log), "alone they fit the pool"
    assert first_step(fcfs_log, "urgent") > 7
    for rid, prompt, params in [("urgent", prompts[2], urgent)] + [
        (f"b{i}", p, batch) for i, p in enumerate(prompts[:2])
    ]:
        assert outputs[rid].token_ids == alone(model, prompt, params, **SMALL), rid
    assert_clean(engine)


def test_seeded_samples_do_not_change_when_displaced(model):
    prompts = tiny_prompts(model.config.vocab_size, 4, [12, 9, 15, 6], seed=11)
    batch = [
        SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=s, priority=1, n=n)
        for s, n in ((1, 1), (2, 2), (3, 1))
    ]
    urgent = SamplingParams(max_new_tokens=6, temperature=0.7, seed=4, priority=0)
    config = dict(SMALL, num_blocks=64, max_num_seqs=4)
    arrivals = {0: [(p, b, f"b{i}") for i, (p, b) in enumerate(zip(prompts, batch))]}
    arrivals[5] = [(prompts[3], urgent, "urgent")]
    engine = paged_hf.Engine(model, **config, scheduling_policy="priority")
    outputs, log = drain(engine, arrivals)
    assert any(preempted for _, preempted in log[5:])
    for rid, prompt, params in [("urgent", prompts[3], urgent)] + [
        (f"b{i}", p, b) for i, (p, b) in enumerate(zip(prompts, batch))
    ]:
        want = paged_hf.Engine(model, **SMALL, num_blocks=64).generate([prompt], params)[0]
        got = outputs[rid]
        assert [c.token_ids for c in got.completions] == [c.token_ids for c in want.completions]


def test_equal_priorities_never_displace_each_other(model):
    prompts = tiny_prompts(model.config.vocab_size, 5, [12, 9, 15, 6, 8], seed=5)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, priority=3)
    arrivals = {0: [(p, params, f"r{i}") for i, p in enumerate(prompts[:3])]}
    arrivals[2] = [(p, params, f"r{i + 3}") for i, p in enumerate(prompts[3:])]
    engine = paged_hf.Engine(
        model, **SMALL, num_blocks=64, max_num_seqs=2, scheduling_policy="priority"
    )
    outputs, log = drain(engine, arrivals)
    assert engine.stats()["preemptions"] == 0
    firsts = [first_step(log, f"r{i}") for i in range(5)]
    assert firsts == sorted(firsts), "arrival order within a priority"


def test_a_request_that_does_not_fit_lets_the_ones_behind_it_go_first(model):
    """Two seats: one runs a long request; the head of the queue wants two (n=2) and waits; the
    less urgent one-seat request behind it runs meanwhile (fcfs: it waits behind the head)."""
    prompts = tiny_prompts(model.config.vocab_size, 3, [8, 8, 8], seed=2)
    long = SamplingParams(max_new_tokens=16, ignore_eos=True, priority=0)
    wide = SamplingParams(max_new_tokens=4, ignore_eos=True, priority=0, n=2, temperature=1.0)
    small = SamplingParams(max_new_tokens=4, ignore_eos=True, priority=1)
    arrivals = {0: [(prompts[0], long, "long")], 1: [(prompts[1], wide, "wide")]}
    arrivals[1].append((prompts[2], small, "small"))
    config = dict(SMALL, num_blocks=64, max_num_seqs=2)
    _, log = drain(paged_hf.Engine(model, **config, scheduling_policy="priority"), arrivals)
    assert first_step(log, "small") == 1 < first_step(log, "wide")
    _, fcfs_log = drain(paged_hf.Engine(model, **config), arrivals)
    assert first_step(fcfs_log, "small") >= first_step(fcfs_log, "wide")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("aging_s", [None, 50.0])
def test_aging_lets_a_long_waiting_request_in_first(model, aging_s):
    prompts = tiny_prompts(model.config.vocab_size, 3, [6, 6, 6], seed=4)
    engine = paged_hf.Engine(
        model,
        **SMALL,
        num_blocks=64,
        max_num_seqs=1,
        scheduling_policy="priority",
        priority_aging_s=aging_s,
    )
    clock = engine.scheduler.clock = FakeClock()
    engine.add_request(prompts[0], SamplingParams(max_new_tokens=3, priority=0), "running")
    engine.add_request(prompts[1], SamplingParams(max_new_tokens=3, priority=5), "old")
    engine.step()
    clock.now = 100.0
    engine.add_request(prompts[2], SamplingParams(max_new_tokens=3, priority=0), "new")
    order = []
    while engine.has_unfinished:
        out_running = list(engine.scheduler.running)
        engine.step()
        order += [r.request_id for r in engine.scheduler.running if r not in out_running]
    assert order == (["old", "new"] if aging_s else ["new", "old"])
    assert engine.stats()["preemptions"] == 0, "aging orders the queue; it displaces nobody"


def test_max_waiting_refuses_or_sheds(model):
    prompts = tiny_prompts(model.config.vocab_size, 5, [6, 7, 8, 9, 5], seed=4)
    low = SamplingParams(max_new_tokens=3, priority=1)
    fcfs = paged_hf.Engine(model, **SMALL, num_blocks=64, max_waiting=2)
    fcfs.add_request(prompts[0], low, "a")
    fcfs.add_request(prompts[1], low, "b")
    with pytest.raises(paged_hf.QueueFull, match=r"request c: refused, 2 requests are waiting"):
        fcfs.add_request(prompts[2], low, "c")
    assert set(fcfs.requests) == {"a", "b"}

    engine = paged_hf.Engine(
        model, **SMALL, num_blocks=64, max_waiting=2, scheduling_policy="priority"
    )
    engine.add_request(prompts[0], low, "a")
    engine.add_request(prompts[1], low, "b")
    engine.add_request(prompts[2], SamplingParams(max_new_tokens=3, priority=0), "urgent")
    with pytest.raises(paged_hf.QueueFull, match="request late"):
        engine.add_request(prompts[3], SamplingParams(max_new_tokens=3, priority=1), "late")
    outputs, _ = drain(engine)
    assert outputs["b"].finish_reason == "error"
    assert "waiting queue is full (max_waiting=2) and request urgent is more urgent" in (
        outputs["b"].error
    )
    assert outputs["b"].token_ids == []
    assert outputs["a"].finish_reason == outputs["urgent"].finish_reason == "length"
    assert_clean(engine)


def test_latency_metrics_on_a_fake_clock(model):
    prompts = tiny_prompts(model.config.vocab_size, 2, [6, 30], seed=4)
    engine = paged_hf.Engine(model, **SMALL, num_blocks=64, max_num_seqs=1)
    clock = engine.scheduler.clock = FakeClock()
    a = SamplingParams(max_new_tokens=4, ignore_eos=True, ttft_target_s=2.5, tpot_target_s=1.0)
    b = SamplingParams(max_new_tokens=3, ignore_eos=True, priority=2)
    engine.add_request(prompts[0], a, "a")  # arrives at 0
    clock.now = 1.0
    engine.add_request(prompts[1], b, "b")  # waits for the one seat
    gaps = iter([1.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    outputs = {}
    while engine.has_unfinished:
        clock.now += next(gaps)  # the step's time
        for req in engine.step()[1]:
            outputs[req.request_id] = engine.collect([req])
    # a: its steps run at 2, 3, 6, 7 (one token each): queued 2, ttft 2, tpot (7 - 2) / 3,
    # longest gap 3
    oa = outputs["a"]
    assert (oa.queued_s, oa.ttft, oa.latency, oa.max_itl) == (2.0, 2.0, 7.0, 3.0)
    assert oa.tpot == pytest.approx(5 / 3)
    # b: arrives at 1, first step at 8 (a's seat), prompt of 30 in two chunks (16 + 14): tokens
    # at 9, 10, 11
    ob = outputs["b"]
    assert (ob.queued_s, ob.ttft, ob.tpot, ob.max_itl) == (7.0, 8.0, 1.0, 1.0)
    latency = engine.stats()["latency"]
    assert latency[0]["requests"] == latency[2]["requests"] == 1
    assert latency["all"]["ttft_p50"] == 5.0 and latency["all"]["ttft_p99"] == pytest.approx(7.94)
    # a misses its own TPOT target (5/3 > 1); b has none: good
    assert (latency[0]["good"], latency[2]["good"]) == (0, 1)
    assert latency["all"]["goodput_per_s"] == pytest.approx(1 / 11)
    relaxed = engine.stats(tpot_target_s=2.0)["latency"]["all"]
    assert relaxed["good"] == 2 and relaxed["attainment"] == 1.0
    strict = engine.stats(ttft_target_s=1.0)["latency"]["all"]
    assert strict["good"] == 0


def test_a_failing_step_that_displaced_a_request_ends_only_its_own(model):
    """The forward fails in the step where an urgent request displaced batch work: that step's
    requests end with an error, the displaced one (not in the step) finishes with the tokens it
    has alone, no block leaks."""
    prompts = tiny_prompts(model.config.vocab_size, 4, [12, 9, 15, 6], seed=5)
    batch = SamplingParams(max_new_tokens=12, ignore_eos=True, priority=1)
    urgent = SamplingParams(max_new_tokens=6, ignore_eos=True, priority=0)
    engine = paged_hf.Engine(
        model, **SMALL, num_blocks=64, max_num_seqs=2, scheduling_policy="priority"
    )
    execute = engine.runner.execute

    def failing(scheduled, copies):
        if any(r.request_id == "urgent" for r, _ in scheduled):
            raise RuntimeError("device error")
        return execute(scheduled, copies)

    engine.runner.execute = failing
    arrivals = {0: [(p, batch, f"b{i}") for i, p in enumerate(prompts[:3])]}
    arrivals[4] = [(prompts[3], urgent, "urgent")]
    outputs, log = drain(engine, arrivals)
    in_failed_step = {rid for rid, _ in log[4][0]}
    assert log[4][1] == ["b1"] and "urgent" in in_failed_step
    for rid, out in outputs.items():
        if rid in in_failed_step:
            assert out.finish_reason == "error" and "device error" in out.error
        else:
            i = int(rid[1])
            assert out.token_ids == alone(model, prompts[i], batch, **SMALL), rid
    assert "b1" not in in_failed_step and outputs["b1"].preemptions == 1
    assert_clean(engine)


def test_an_urgent_prompt_takes_the_prefill_room_before_running_batch_prefills(model):
    """A batch prompt mid-prefill and a decode run; an urgent prompt arrives: the step's prefill
    room (32 beside decodes) goes to the urgent prompt first, the batch chunk gets what is left."""
    prompts = tiny_prompts(model.config.vocab_size, 3, [6, 200, 30], seed=8)
    config = dict(
        block_size=4,
        num_blocks=128,
        max_num_batched_tokens=64,
        max_prefill_tokens_while_decoding=32,
        max_num_seqs=4,
    )
    decode = SamplingParams(max_new_tokens=30, ignore_eos=True, priority=0)
    batch = SamplingParams(max_new_tokens=4, ignore_eos=True, priority=1)
    urgent = SamplingParams(max_new_tokens=4, ignore_eos=True, priority=0)
    arrivals = {0: [(prompts[0], decode, "chat"), (prompts[1], batch, "batch")]}
    arrivals[3] = [(prompts[2], urgent, "urgent")]
    engine = paged_hf.Engine(model, **config, scheduling_policy="priority")
    outputs, log = drain(engine, arrivals)
    step = dict(log[3][0])
    assert step["urgent"] == 30 and step["batch"] == 2, step
    _, fcfs_log = drain(paged_hf.Engine(model, **config), arrivals)
    assert dict(fcfs_log[3][0]).get("batch") == 32, "fcfs: the running prefill goes first"
    for rid, prompt, params in [("urgent", prompts[2], urgent), ("batch", prompts[1], batch)]:
        assert outputs[rid].token_ids == alone(model, prompt, params, **SMALL), rid
    assert_clean(engine)


def test_smollm2_an_urgent_chat_displaces_batch_work_and_keeps_its_tokens(smollm2_fp32):
    """The default model (fp32): an urgent chat arriving while batch requests hold both seats runs
    in the next step; every request's tokens are the ones transformers picks (teacher forced)."""
    from oracle import assert_teacher_forced

    model, tok = smollm2_fp32
    texts = ["Write a long story about the sea.", "List ten fruits.", "Explain rain.", "Hi! 2+2?"]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        for t in texts
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    batch = SamplingParams(max_new_tokens=12, ignore_eos=True, priority=1)
    urgent = SamplingParams(max_new_tokens=6, ignore_eos=True, priority=0)
    arrivals = {0: [(p, batch, f"b{i}") for i, p in enumerate(prompts[:3])]}
    arrivals[3] = [(prompts[3], urgent, "urgent")]
    engine = paged_hf.Engine(
        model, tok, block_size=16, num_blocks=64, max_num_seqs=2, scheduling_policy="priority"
    )
    outputs, log = drain(engine, arrivals)
    assert first_step(log, "urgent") == 3 and log[3][1] == ["b1"]
    for rid, prompt in [("urgent", prompts[3])] + [(f"b{i}", p) for i, p in enumerate(prompts[:3])]:
        assert_teacher_forced(model, prompt, outputs[rid].token_ids, what=rid)
    assert_clean(engine)
