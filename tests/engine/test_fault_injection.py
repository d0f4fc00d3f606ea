"""Fault injection over random workloads (issue 10): whatever single fault hits a run, the
requests it did not touch produce the tokens of a fault-free run, nothing is left behind in the
engine, and the same engine then serves the whole workload again correctly (so no fault leaves
a corrupt block in the prefix cache either).

Workloads mix prompt lengths with shared prefixes, parallel samples (n > 1, seeded), cache
salts, tight pools that preempt (recompute or swap), small token budgets (chunked prefill) and
prefix caching on or off. Faults: the forward raises at step k (an error, or KeyboardInterrupt),
one sample's sampling raises, the whole sampler call raises (an error, or KeyboardInterrupt:
after parallel samples were forked), swap-out raises, a callback raises KeyboardInterrupt, a callback
aborts a request, a poison request joins the batch.

A tiny llama in float64 makes greedy tokens independent of how requests are batched, so "the
same tokens" is exact equality; a tiny Qwen3.5 (gated DeltaNet layers beside attention) in float64
runs the same faults over state slots, which must all be given back too; a tiny Gemma 3 (sliding
layers beside full ones: two cache groups, the sliding one freeing blocks as they slide out) runs
them over every group's tables, checked after every step.
"""

from __future__ import annotations

import functools

import engine_state
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_cache_groups import check_tables
from tiny_models import N_SPECIAL, make_tiny_model

import paged_hf
from paged_hf import SamplingParams
from paged_hf.engine import step as engine_module
from paged_hf.execution import sampler
from paged_hf.model.support import build_tiny_model
from paged_hf.requests.request import root_request_id, sample_request_id

pytestmark = pytest.mark.usefixtures("one_thread")

FAULTS = (
    "none",
    "forward_error",
    "forward_interrupt",
    "sampling_error",
    "sampler_error",
    "sampler_interrupt",
    "swap_out_error",
    "callback_interrupt",
    "callback_abort",
    "poison",
)
STEP_INTERRUPTS = ("forward_interrupt", "sampler_interrupt")  # KeyboardInterrupt inside step()


@functools.lru_cache(maxsize=2)
def tiny_model(kind: str = "llama"):
    return (make_tiny_model("llama") if kind == "llama" else build_tiny_model(kind)).double()


@st.composite
def workloads(draw, fault: str, kind: str = "llama"):
    vocab = tiny_model(kind).config.get_text_config().vocab_size
    token = st.integers(N_SPECIAL, vocab - 1)
    prefixes = draw(st.lists(st.lists(token, min_size=0, max_size=10), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(2, 5))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(token, min_size=1, max_size=8))
        n = draw(st.sampled_from([1, 1, 2, 3]))
        sampled = n > 1 or draw(st.booleans())
        params = SamplingParams(
            max_new_tokens=draw(st.integers(1, 7)),
            n=n,
            temperature=1.0 if sampled else 0.0,
            seed=draw(st.integers(0, 1000)) if sampled else None,
            ignore_eos=draw(st.booleans()),
            cache_salt=draw(st.sampled_from([None, None, "t"])),
        )
        requests.append((prompt, params))
    block_size = draw(st.sampled_from([2, 4]))
    longest = max(len(p) + sp.max_new_tokens for p, sp in requests)
    # its pool's pages are one group's; a request holds some in each
    groups = 2 if kind == "gemma3_text" else 1
    swap_fault = fault == "swap_out_error"  # needs swap preemption, so a tight pool
    config = dict(
        block_size=block_size,
        # from just enough for the longest request (preemption certain) to roomy
        num_blocks=groups * -(-longest // block_size)
        + draw(st.sampled_from([0, 1, 2] if swap_fault else [0, 1, 2, 4, 12])),
        max_num_batched_tokens=draw(st.sampled_from([8, 16, 64])),
        max_num_seqs=draw(st.sampled_from([3, 4, 8])),
        enable_prefix_caching=draw(st.booleans()),
        preemption_mode="swap" if swap_fault else draw(st.sampled_from(["recompute", "swap"])),
    )
    where = draw(st.integers(0, 12))  # the step, sample call or callback the fault hits
    victim = draw(st.integers(0, len(requests) - 1))
    return requests, config, where, victim


def run(engine, requests, on_token=None):
    prompts, params = zip(*requests)
    return engine.generate(list(prompts), list(params), on_token=on_token)


def tokens(outputs):
    return [[c.token_ids for c in o.completions] for o in outputs]


def assert_clean(engine):
    """engine_state's check, then what a hybrid or the prefix cache may still hold."""
    engine_state.assert_clean(engine)
    index = engine.kv_manager.index
    assert index is None or all(node.lock_ref == 0 for node in index.iter_nodes())
    assert engine.kv_manager.state is None or engine.kv_manager.state.num_used == 0, (
        "a state slot is still held"
    )
    assert engine.kv_manager.state is None or engine.kv_manager.state.num_pending == 0, (
        "a state snapshot was never attached or released"
    )
    # every checkpoint sits on a node of the tree
    if engine.kv_manager.state is not None and index is not None:
        assert engine.kv_manager.state.num_checkpoints_held == sum(
            1 for n in index.iter_nodes() if n.state is not None
        )


@pytest.mark.parametrize("fault", FAULTS)
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_a_single_fault_harms_only_what_it_touches(fault, data):
    single_fault(fault, data, "llama")


@pytest.mark.parametrize("fault", FAULTS)
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_a_single_fault_harms_only_what_it_touches_on_a_hybrid(fault, data):
    single_fault(fault, data, "qwen3_5_text")


@pytest.mark.parametrize("fault", FAULTS)
@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_a_single_fault_harms_only_what_it_touches_with_cache_groups(fault, data):
    single_fault(fault, data, "gemma3_text")


def single_fault(fault: str, data, kind: str) -> None:
    requests, config, where, victim = data.draw(workloads(fault, kind))
    model = tiny_model(kind)
    reference = tokens(run(paged_hf.Engine(model, **config), requests))
    engine = paged_hf.Engine(model, **config)
    assert len(engine.groups) == (2 if kind == "gemma3_text" else 1)
    touched: set[str] = set()  # sample ids the fault may end with an error
    aborted: set[str] = set()  # root ids a callback aborted
    victim_id: list[str] = []  # the victim's request id, once submitted
    calls: list[str] = []  # steps run
    callbacks: list[str] = []  # on_token calls made
    in_step: list[str] = []  # the requests of the step running now
    execute, prepare, sample = engine.runner.execute, sampler._prepare_row, engine_module.sample

    def faulty_execute(scheduled, copies):
        calls.append("step")
        in_step[:] = [r.request_id for r, _ in scheduled]
        if fault.startswith("forward") and len(calls) == where + 1:
            touched.update(in_step)
            raise RuntimeError("device error") if fault == "forward_error" else KeyboardInterrupt
        check_tables(engine)  # every group's tables, as the step found them
        return execute(scheduled, copies)

    def faulty_prepare(logits, row, req):
        if (req.parent or req).request_id in victim_id and req.num_output_tokens == where % 4:
            touched.add(req.request_id)
            raise ValueError("poisoned sampling")
        prepare(logits, row, req)

    def faulty_sample(logits, rows, mask=None):
        # a failed step ends every request in it, and the samples it forked
        if len(calls) == where + 1:
            touched.update(in_step + [r.request_id for r in rows])
            raise RuntimeError("sampler crashed") if fault == "sampler_error" else KeyboardInterrupt
        return sample(logits, rows, mask)

    def faulty_swap_out(blocks):
        raise RuntimeError("no pinned memory")

    def on_token(rid, tok):
        callbacks.append(rid)
        if len(callbacks) != where + 1:
            return
        if fault == "callback_interrupt":
            raise KeyboardInterrupt
        root = root_request_id(rid)
        if root in engine.requests:
            aborted.add(root)
            engine.abort(root)

    engine.runner.execute = faulty_execute
    if fault in ("sampler_error", "sampler_interrupt"):
        engine_module.sample = faulty_sample
    elif fault == "swap_out_error":
        engine.runner.backend.swap_out = faulty_swap_out
    submitted = list(requests)
    if fault == "poison":  # a request admission refuses, in the middle of the batch
        submitted.insert(victim, ([5, 6], SamplingParams(stop_token_ids=(10**6,))))

    rids: list[str] = []
    for i, (prompt, params) in enumerate(submitted):
        try:
            rids.append(engine.add_request(prompt, params))
        except ValueError as e:
            assert fault == "poison" and i == victim and "outside the vocabulary" in str(e)
    victim_id.append(rids[victim])
    interrupted = False
    sampler._prepare_row = faulty_prepare if fault == "sampling_error" else prepare
    try:
        if fault in STEP_INTERRUPTS:
            # the caller of step() catches the interrupt and goes on: the step was undone, so
            # every request still produces exactly its fault-free tokens
            try:
                while engine.has_unfinished:
                    engine.step()
            except KeyboardInterrupt:
                engine.runner.execute, engine_module.sample = execute, sample
                waiting = {r.request_id: r for r in engine.scheduler.waiting}
                running = {r.request_id for r in engine.scheduler.running}
                for rid in touched:  # the interrupted step's requests wait to run again, without KV
                    r = waiting.get(rid)
                    if r is None:  # a sample forked in the undone step is gone; it forks again
                        assert root_request_id(rid) != rid and rid not in running, rid
                    else:
                        assert not r.block_tables and r.num_computed_tokens == 0, rid
                touched.clear()
        outputs = engine.run_until_done(
            rids, on_token=on_token if fault.startswith("callback") else None
        )
    except KeyboardInterrupt:
        assert fault == "callback_interrupt"
        interrupted = True
    finally:
        sampler._prepare_row, engine_module.sample = prepare, sample
        engine.runner.execute = execute
        engine.runner.backend.__dict__.pop("swap_out", None)

    assert_clean(engine)
    check_tables(engine)
    event(f"{'interrupted' if interrupted else f'{len(touched)} touched, {len(aborted)} aborted'}")
    event(f"samples of n > 1 touched: {any(root_request_id(rid) != rid for rid in touched)}")
    event(
        f"preemptions: {'some' if engine.stats()['preemptions'] else 'none'} ({config['preemption_mode']})"
    )
    if not interrupted:
        assert len(outputs) == len(reference)
        for out, ref in zip(outputs, reference):
            if out.request_id in aborted or any(
                c.finish_reason == "error" for c in out.completions
            ):
                assert len(out.completions) <= len(ref)  # ended before it forked, perhaps
            else:
                assert len(out.completions) == len(ref)
            for k, (completion, expected) in enumerate(zip(out.completions, ref)):
                sample_id = out.request_id if k == 0 else sample_request_id(out.request_id, k)
                if completion.finish_reason == "error":
                    assert sample_id in touched, (
                        f"{sample_id} failed without a fault touching it: {completion.error}"
                    )
                    assert completion.token_ids == expected[: len(completion.token_ids)]
                elif out.request_id in aborted:
                    assert completion.token_ids == expected[: len(completion.token_ids)]
                else:
                    assert completion.token_ids == expected, (
                        f"{sample_id} changed under fault {fault}"
                    )
    # the same engine serves the whole workload again, cache and all, as a fresh one would
    assert tokens(run(engine, requests)) == reference
    assert_clean(engine)
