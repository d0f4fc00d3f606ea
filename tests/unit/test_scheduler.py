"""Scheduler unit tests: batch order, chunked prefill, prefix hits, preemption, admission
checks, copy-on-write for parallel samples, and computing a shared prefix once."""

from __future__ import annotations

import pytest

from paged_hf.cache.block_manager import BlockManager
from paged_hf.engine.schedule_output import SchedulerOutput
from paged_hf.engine.scheduler import Scheduler
from paged_hf.requests.request import FinishReason, Request, RequestStatus
from paged_hf.requests.sampling_params import SamplingParams


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 32,
    max_seqs: int = 8,
    caching: bool = True,
) -> tuple[BlockManager, Scheduler]:
    kv = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return kv, Scheduler(kv, budget, max_seqs)


def req(
    rid: str, prompt: list[int], max_new: int = 4, n: int = 1, salt: str | None = None, **kw
) -> Request:
    return Request(
        rid, list(prompt), SamplingParams(max_new_tokens=max_new, n=n, cache_salt=salt), **kw
    )


def det_token(r: Request) -> int:
    """A token that depends only on (request, position): a rerun samples the same outputs."""
    return 1000 + 31 * sum(map(ord, r.request_id)) + r.num_tokens


def step(s: Scheduler, token=det_token, now: float = 0.0) -> SchedulerOutput:
    """One model step as the engine drives it (see the property tests' driver)."""
    out = s.schedule()
    s.mark_computed(out)
    sampled: dict[Request, int] = {}
    for r, _ in out.scheduled:
        if r.num_pending_tokens == 0:
            if r.params.n > 1 and not r.forked and r.parent is None:
                kids = [
                    Request(
                        f"{r.request_id}.{k}",
                        r.prompt_ids,
                        r.params,
                        eos_token_ids=r.eos_token_ids,
                        parent=r,
                        sample_index=k,
                    )
                    for k in range(1, r.params.n)
                ]
                s.fork(r, kids)
                for k in kids:
                    sampled[k] = token(k)
            sampled[r] = token(r)
    s.update(out, sampled, now)
    return out


def run_all(s: Scheduler, cap: int = 1000, **kw) -> list[SchedulerOutput]:
    outs = []
    while s.has_unfinished:
        outs.append(step(s, **kw))
        assert len(outs) < cap
    return outs


def assert_all_released(kv: BlockManager) -> None:
    assert kv.pool.num_free + kv.pool.num_cached == kv.num_blocks
    assert all(r == 0 for r in kv.pool.refcount)
    if kv.index is not None:
        assert all(n.lock_ref == 0 for n in kv.index.iter_nodes())


# ---- batch order ----------------------------------------------------------------------------
def test_decodes_come_first():
    kv, s = make(budget=8, max_seqs=4)
    a = req("a", range(3), max_new=10)
    s.add(a)
    assert step(s).scheduled == [(a, 3)]
    b = req("b", range(100, 120), max_new=2)
    s.add(b)
    assert step(s).scheduled == [(a, 1), (b, 7)]
    assert step(s).scheduled == [(a, 1), (b, 7)]

    # even when the prefill comes first in the running list, the decode leads the batch
    s.running[:] = [b, a]
    out = s.schedule()
    assert out.scheduled == [(a, 1), (b, 6)]
    assert out.num_tokens == 7


def test_waiting_prefill_after_all_decodes():
    kv, s = make(budget=16, max_seqs=4)
    a, b = req("a", range(2), max_new=8), req("b", range(10, 12), max_new=8)
    s.add(a)
    s.add(b)
    assert step(s).scheduled == [(a, 2), (b, 2)]
    c = req("c", range(20, 40))
    s.add(c)
    out = step(s)
    assert out.scheduled == [(a, 1), (b, 1), (c, 14)]


# ---- chunked prefill --------------------------------------------------------------------------
def test_chunked_prefill_spans_steps_within_budget():
    kv, s = make(budget=8, max_seqs=2)
    r = req("long", range(30), max_new=3)
    s.add(r)
    chunks = []
    for _ in range(4):
        out = step(s)
        assert out.num_tokens <= 8
        (got,) = out.scheduled
        chunks.append(got[1])
        if len(chunks) < 4:
            assert r.num_output_tokens == 0 and r.num_computed_tokens == 8 * len(chunks)
    assert chunks == [8, 8, 8, 6]
    assert r.num_output_tokens == 1
    assert step(s).scheduled == [(r, 1)]


def test_two_chunked_prefills_share_the_budget():
    kv, s = make(budget=8, max_seqs=2)
    a, b = req("a", range(13), max_new=2), req("b", range(50, 63), max_new=2)
    s.add(a)
    s.add(b)
    outs = run_all(s)
    for out in outs:
        assert out.num_tokens <= 8
        for r, n in out.scheduled:
            assert n >= 1
    assert outs[0].scheduled == [(a, 8)]
    assert outs[1].scheduled == [(a, 5), (b, 3)]
    assert a.num_output_tokens == b.num_output_tokens == 2
    assert_all_released(kv)


# ---- prefix cache hits ---------------------------------------------------------------------------
def test_prefix_hit_skips_prefill():
    kv, s = make(block_size=4, budget=64)
    first = req("first", range(20), max_new=2)
    s.add(first)
    run_all(s)
    assert first.num_cached_tokens == 0 and s.prefix_hit_tokens == 0

    second = req("second", list(range(16)) + [90, 91, 92, 93], max_new=2)
    s.add(second)
    out = step(s)
    assert out.scheduled == [(second, 4)]
    assert second.num_cached_tokens == 16 and s.prefix_hit_tokens == 16
    run_all(s)

    # the same prompt again: at least its last token is computed (its logits give the sample)
    same = req("same", range(20), max_new=1)
    s.add(same)
    assert step(s).scheduled == [(same, 4)]
    assert same.num_cached_tokens == 16

    # a prompt that is exactly cached whole blocks still recomputes its last block
    whole = req("whole", range(16), max_new=1)
    s.add(whole)
    assert step(s).scheduled == [(whole, 4)]
    assert whole.num_cached_tokens == 12
    assert s.prefix_hit_tokens == 16 + 16 + 12
    assert_all_released(kv)


def test_no_prefix_hits_without_caching():
    kv, s = make(block_size=4, budget=64, caching=False)
    s.add(req("first", range(20), max_new=2))
    run_all(s)
    again = req("again", range(20), max_new=2)
    s.add(again)
    assert step(s).scheduled == [(again, 20)]
    assert again.num_cached_tokens == 0 and s.prefix_hit_tokens == 0


# ---- preemption -------------------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_preemption_requeues_latest_at_front_and_keeps_tokens(caching):
    def scenario(num_blocks):
        kv, s = make(num_blocks=num_blocks, block_size=2, budget=8, max_seqs=2, caching=caching)
        a = req("a", [1, 2, 3, 4], max_new=6)
        b = req("b", [5, 6, 7, 8], max_new=6)
        c = req("c", [9, 10], max_new=2)
        for r in (a, b, c):
            s.add(r)
        return kv, s, a, b, c

    # reference: a pool big enough for everyone
    _, s_ref, a_ref, b_ref, c_ref = scenario(64)
    run_all(s_ref)
    assert s_ref.num_preemptions == 0

    # 6 blocks of 2: each request fits alone (5 blocks), a and b together do not
    kv, s, a, b, c = scenario(6)
    preempted_at = None
    for i in range(100):
        if not s.has_unfinished:
            break
        b_tokens_before = list(b.output_ids)
        out = step(s)
        assert a not in out.preempted  # the oldest running request keeps going
        if out.preempted and preempted_at is None:
            preempted_at = i
            assert out.preempted == [b]  # the most recently admitted one
            assert b not in [r for r, _ in out.scheduled]
            assert b.status is RequestStatus.PREEMPTED
            assert list(s.waiting) == [b, c]  # requeued at the front
            assert b.block_table == [] and b.num_computed_tokens == 0 and b.prefix_node is None
            assert b.output_ids == b_tokens_before and len(b_tokens_before) > 0
            assert [r for r, _ in out.scheduled] == [a]
    assert preempted_at is not None and s.num_preemptions >= 1
    assert not s.has_unfinished

    for r, ref in ((a, a_ref), (b, b_ref), (c, c_ref)):
        assert r.finish_reason is FinishReason.LENGTH
        assert r.num_output_tokens == ref.num_output_tokens == r.params.max_new_tokens
        assert r.output_ids == ref.output_ids
    assert_all_released(kv)


# ---- admission checks ------------------------------------------------------------------------------
def test_check_fits_rejects_requests_that_never_fit():
    kv, s = make(num_blocks=4, block_size=4, budget=16, max_seqs=4)
    small = req("small", range(40, 43), max_new=3)
    s.add(small)
    step(s)
    big = req("too-big-17", range(10), max_new=10)  # 20 tokens = 5 blocks > 4
    with pytest.raises(ValueError, match="too-big-17"):
        s.check_fits(big)
    with pytest.raises(ValueError, match="too-big-17"):
        s.add(big)
    assert big not in s.waiting and s.running == [small]

    # the limit is inclusive, and max_model_len caps the length that has to fit
    exact = req("exact", range(10), max_new=6)  # 16 tokens = 4 blocks
    capped = req("capped", range(20, 30), max_new=10, max_model_len=16)
    for r in (exact, capped):
        s.add(r)
    run_all(s)
    assert exact.num_output_tokens == 6
    assert capped.num_tokens == 16 and capped.finish_reason is FinishReason.LENGTH
    assert small.num_output_tokens == 3
    assert big.status is RequestStatus.WAITING and big.num_output_tokens == 0
    assert_all_released(kv)


def test_check_fits_rejects_more_samples_than_sequences():
    """n parallel samples run as n sequences: with max_num_seqs < n it could never be admitted
    and would block every request queued behind it."""
    kv, s = make(num_blocks=32, block_size=4, budget=16, max_seqs=2)
    with pytest.raises(ValueError, match="wide"):
        s.add(req("wide", range(5), max_new=2, n=3))
    ok = req("ok", range(5), max_new=2, n=2)
    after = req("after", range(9), max_new=2)
    s.add(ok)
    s.add(after)
    run_all(s, cap=50)
    assert ok.is_finished and after.is_finished


# ---- copy-on-write ------------------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_parallel_samples_copy_a_shared_partial_block(caching):
    kv, s = make(block_size=4, budget=32, caching=caching)
    p = req("p", range(6), max_new=4, n=2)  # 6 tokens: the second block is partial
    s.add(p)
    out = step(s)
    assert out.scheduled == [(p, 6)] and out.block_copies == []
    (child,) = [r for r in s.running if r is not p]
    assert child.parent is p and child.block_table == p.block_table
    b0, b1 = p.block_table
    assert kv.pool.refcount[b0] == kv.pool.refcount[b1] == 2

    out = step(s)
    assert out.scheduled == [(p, 1), (child, 1)]
    assert len(out.block_copies) == 1
    src, dst = out.block_copies[0]
    assert src == b1 and dst not in (b0, b1)
    assert p.block_table == [b0, dst] and child.block_table == [b0, b1]  # the last holder keeps it
    assert kv.pool.refcount[b0] == 2 and kv.pool.refcount[b1] == 1 and kv.pool.refcount[dst] == 1

    out = step(s)
    assert out.block_copies == []
    run_all(s)
    assert p.num_output_tokens == child.num_output_tokens == 4
    assert_all_released(kv)


def test_fork_after_chunked_prefill_shares_the_prefix_lock():
    kv, s = make(block_size=4, budget=8)
    p = req("p", range(14), max_new=3, n=2)
    s.add(p)
    step(s)  # first chunk: 8 tokens = 2 cached blocks
    node = p.prefix_node
    assert node is not None and node.lock_ref == 1 and p.num_tree_blocks == 2
    step(s)  # last chunk, sample, fork, cache block 3
    (child,) = [r for r in s.running if r is not p]
    assert child.prefix_node is p.prefix_node and p.num_tree_blocks == child.num_tree_blocks == 3
    assert p.prefix_node.lock_ref == 2 and node.lock_ref == 2
    assert p.block_table[:3] == child.block_table[:3]
    s.finish(p, FinishReason.ABORT, 0.0)
    assert child.prefix_node.lock_ref == 1 and node.lock_ref == 1
    run_all(s)
    assert child.num_output_tokens == 3
    assert_all_released(kv)


def test_parallel_samples_three_way_copy():
    kv, s = make(block_size=4, budget=32)
    p = req("p", range(7), max_new=3, n=3)
    s.add(p)
    step(s)
    assert len(s.running) == 3
    shared = p.block_table[1]
    out = step(s)
    assert len(out.block_copies) == 2
    assert all(src == shared for src, _ in out.block_copies)
    assert len({dst for _, dst in out.block_copies}) == 2
    assert sorted(r.block_table[1] == shared for r in s.running) == [False, False, True]


def test_parallel_samples_with_aligned_prompt_need_no_copy():
    kv, s = make(block_size=4, budget=32)
    p = req("p", range(8), max_new=3, n=2)  # 8 tokens: both blocks full
    s.add(p)
    step(s)
    out = step(s)
    assert out.block_copies == []
    (child,) = [r for r in s.running if r is not p]
    assert p.block_table[:2] == child.block_table[:2]
    assert p.block_table[2] != child.block_table[2]


# ---- a shared prefix is computed once ------------------------------------------------------------------
def prefill_tokens(outs: list[SchedulerOutput], reqs) -> int:
    """Prompt tokens computed (re-computation after a preemption included)."""
    return sum(n for out in outs for r, n in out.scheduled if r in reqs and n > 1)


@pytest.mark.parametrize("budget", [64, 16, 12])
def test_concurrent_shared_prefix_is_computed_once(budget):
    prefix = list(range(100, 132))  # 32 tokens = 8 blocks of 4
    kv, s = make(num_blocks=128, block_size=4, budget=budget, max_seqs=4)
    reqs = [
        req(f"r{i}", prefix + [10 * i + 1, 10 * i + 2, 10 * i + 3], max_new=2) for i in range(4)
    ]
    for r in reqs:
        s.add(r)
    outs = [step(s)]
    # the first request prefills the prefix; the others wait for it instead of computing it too
    assert [r for r, _ in outs[0].scheduled] == [reqs[0]]
    assert list(s.waiting) == reqs[1:]
    outs += run_all(s)
    assert s.num_preemptions == 0
    assert prefill_tokens(outs, reqs) == len(prefix) + 4 * 3
    assert s.prefix_hit_tokens == 3 * len(prefix)
    assert [r.num_cached_tokens for r in reqs] == [0, 32, 32, 32]
    for out in outs:
        assert out.num_tokens <= budget
    assert all(r.num_output_tokens == 2 for r in reqs)
    assert_all_released(kv)


def test_shared_prefix_without_caching_is_computed_per_request():
    prefix = list(range(100, 132))
    kv, s = make(num_blocks=128, block_size=4, budget=64, max_seqs=4, caching=False)
    reqs = [req(f"r{i}", prefix + [i, i, i], max_new=2) for i in range(4)]
    for r in reqs:
        s.add(r)
    outs = run_all(s)
    assert prefill_tokens(outs, reqs) == 4 * 35


def test_different_salts_do_not_wait_for_each_other():
    prefix = list(range(100, 132))
    kv, s = make(num_blocks=128, block_size=4, budget=128, max_seqs=4)
    a = req("a", prefix + [1], salt="x")
    b = req("b", prefix + [2], salt="y")
    s.add(a)
    s.add(b)
    out = step(s)
    assert out.scheduled == [(a, 33), (b, 33)]


def test_rows_held_for_their_call_give_way_to_the_rows_they_wait_for():
    """A generate call's rows move in lock-step (paged_hf/model/lock_step_calls.py): a row with its
    token for the call's next step is held. A pool too small for both rows: the held row is
    preempted first (it is idle), and when the row it waits for is queued and nothing else can run,
    the held row gives up its blocks to it. Both finish, the criteria having run once per step."""
    import torch

    from paged_hf.model.call_rows import CallRows
    from paged_hf.model.lock_step_calls import CriteriaCall

    kv, s = make(num_blocks=4, block_size=4, budget=32)
    calls = []

    def criteria(ids, scores):
        calls.append(ids.shape[1])
        return torch.zeros(ids.shape[0], dtype=torch.bool)

    a, b = req("a", range(1, 9), max_new=6), req("b", range(11, 19), max_new=6)
    rows = CallRows(torch.tensor([a.prompt_ids, b.prompt_ids]), 1, 6, pad=0, pads_finished=True)
    call = CriteriaCall(rows, criteria)
    call.join(a, 0)
    call.join(b, 1)
    s.add(a)
    s.add(b)
    for _ in range(100):
        if not s.has_unfinished:
            break
        out = step(s)
        assert not out.is_empty, "nothing ran with rows pending"
        assert abs(a.num_output_tokens - b.num_output_tokens) <= 1, "a row ran ahead of its call"
        for r, _ in call.advance().stopped:
            s.finish(r, FinishReason.STOP, 0.0)
    assert a.num_output_tokens == b.num_output_tokens == 6 and calls == list(range(9, 15))
    assert s.num_preemptions >= 2
    assert_all_released(kv)
