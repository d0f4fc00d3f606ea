"""Property tests of the engine core (scheduler + block manager + pool + prefix index) over
random schedules: random pools, block sizes, budgets, sequence caps, prompts with shared
prefixes, parallel samples, salts, aborts and stop tokens, with every invariant checked after
every operation, and liveness checked at the end.

A fake model loop (``Driver``) drives the core as the engine does: schedule, mark the tokens
computed, sample for every request whose KV is complete (forking the n-1 siblings on a
request's first sample), update.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_hf.cache.block_manager import BlockManager, blocks_for
from paged_hf.engine.schedule_output import SchedulerOutput
from paged_hf.engine.scheduler import Scheduler
from paged_hf.requests.request import FinishReason, Request, RequestStatus
from paged_hf.requests.sampling_params import SamplingParams

EOS = 0
STOP = 1
OUT_VOCAB = 8  # sampled tokens: 0 (eos) .. 7


class Driver:
    """A fake model loop over a real Scheduler, checking invariants as it goes."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        budget: int,
        max_seqs: int,
        prefix_caching: bool,
        seed: int = 0,
        preemption_mode: str = "recompute",
        prefill_cap: int | None = None,
    ) -> None:
        self.kv = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.s = Scheduler(
            self.kv,
            budget,
            max_seqs,
            preemption_mode,
            max_prefill_tokens_while_decoding=prefill_cap,
        )
        self.rng = random.Random(seed)
        self.live: list[Request] = []  # added (or forked) and not finished, in order
        self.ended: list[Request] = []
        self.steps = 0  # steps run
        self.busy_steps = 0  # steps that started with unfinished requests
        self.work = 0  # sum over sequences of prompt + max_new + 1
        self.born: dict[Request, int] = {}
        self.died: dict[Request, int] = {}
        self.seen_outputs: dict[Request, list[int]] = {}
        self.rejected = 0
        self._ids = 0

    # ---- requests --------------------------------------------------------------------------
    def make_request(
        self,
        prompt: list[int],
        max_new: int,
        n: int = 1,
        salt: str | None = None,
        stop_mode: int = 0,
    ) -> Request:
        kw: dict = {}
        eos: frozenset[int] = frozenset()
        if stop_mode == 1:
            eos = frozenset({EOS})
        elif stop_mode == 2:
            kw["stop_token_ids"] = (STOP,)
        elif stop_mode == 3:
            eos = frozenset({EOS})
            kw["min_new_tokens"] = min(2, max_new)
        elif stop_mode == 4:
            eos = frozenset({EOS})
            kw["ignore_eos"] = True
        # as the engine does: max_model_len leaves room for at least one new token
        max_len = len(prompt) + self.rng.randint(1, max_new) if stop_mode == 5 else 1 << 62
        self._ids += 1
        params = SamplingParams(max_new_tokens=max_new, n=n, cache_salt=salt, **kw)
        return Request(
            f"req{self._ids}", list(prompt), params, eos_token_ids=eos, max_model_len=max_len
        )

    def add(self, req: Request) -> bool:
        """Add ``req`` if it can ever run; a refused request must name itself and stay out."""
        try:
            self.s.check_fits(req)
        except ValueError as e:
            assert req.request_id in str(e)
            with pytest.raises(ValueError):
                self.s.add(req)
            assert all(r is not req for r in self.s.waiting)
            self.rejected += 1
            return False
        self.s.add(req)
        self._born(req)
        self.work += req.params.n * (req.num_prompt_tokens + req.params.max_new_tokens + 1)
        self.check_invariants()
        return True

    def _born(self, req: Request) -> None:
        self.live.append(req)
        self.born[req] = self.steps
        self.seen_outputs[req] = []

    def _ended(self, req: Request) -> None:
        self.live.remove(req)
        self.ended.append(req)
        self.died[req] = self.steps

    def abort(self, req: Request, family: bool = False) -> None:
        """Abort ``req`` (and, with ``family``, its forked samples too, as the engine does)."""
        for r in [req] + ([c for c in self.live if c.parent is req] if family else []):
            self.s.finish(r, FinishReason.ABORT, float(self.steps))
            assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.ABORT
            self._ended(r)
        self.check_invariants()

    def token(self) -> int:
        return self.rng.randrange(OUT_VOCAB)

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> SchedulerOutput:
        s = self.s
        busy = s.has_unfinished
        self.busy_steps += busy
        decodes = [r for r in s.running if r.num_pending_tokens == 1]
        out = s.schedule()
        # every step with work makes progress (the engine treats an empty step as a bug)
        assert out.scheduled or not busy
        self.check_schedule(out, decodes)
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
                            max_model_len=r.max_model_len,
                            parent=r,
                            sample_index=k,
                        )
                        for k in range(1, r.params.n)
                    ]
                    s.fork(r, kids)
                    for k in kids:
                        self._born(k)
                        sampled[k] = self.token()
                sampled[r] = self.token()
        finished = s.update(out, sampled, float(self.steps))
        self.steps += 1
        assert set(finished) <= set(sampled)
        for r in finished:
            assert r.is_finished and r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            self._ended(r)
        self.check_invariants()
        return out

    def drain(self) -> None:
        """Run until every request has ended; the number of steps is bounded.

        Why the bound holds: running[0] fits the pool alone (check_fits) and is preempted
        last, and max_num_seqs <= budget leaves it at least one token of budget, so every
        busy step advances running[0] by one token at least; once at the head a sequence
        needs at most prompt + max_new + 1 such steps, and nothing overtakes it there.
        """
        cap = self.work + 2
        while self.s.has_unfinished:
            self.step()
            assert self.busy_steps <= cap, (
                f"no progress: {self.busy_steps} steps for work {self.work}"
            )
        self.check_final()

    # ---- checks ----------------------------------------------------------------------------
    def check_schedule(self, out: SchedulerOutput, decodes: list[Request]) -> None:
        s, pool = self.s, self.kv.pool
        reqs = [r for r, _ in out.scheduled]
        assert len(set(reqs)) == len(reqs)
        assert out.num_tokens <= s.max_num_batched_tokens
        assert len(reqs) <= s.max_num_seqs
        assert s.num_running_seqs() <= s.max_num_seqs
        for r, n in out.scheduled:
            assert r.status is RequestStatus.RUNNING and r in s.running
            assert 1 <= n <= r.num_pending_tokens, (r.request_id, n, r.num_pending_tokens)
            # the block table has room for the new tokens
            assert len(r.block_table) >= blocks_for(r.num_computed_tokens + n, self.kv.block_size)
        assert len(set(out.preempted)) == len(out.preempted)
        for r in out.preempted:
            assert r.status is RequestStatus.PREEMPTED and r in s.waiting and r not in reqs
            assert not r.block_table and r.prefix_node is None and r.num_computed_tokens == 0
        # swap preemption: what goes out is a victim's computed blocks; what comes back fills
        # the first blocks of a request admitted this step, covering its computed tokens
        for r, blocks in out.swap_out:
            assert (
                r in out.preempted
                and blocks
                and r.swapped_tokens > (len(blocks) - 1) * self.kv.block_size
            )
        for r, blocks in out.swap_in:
            assert r in reqs and not r.swapped_tokens and r.block_table[: len(blocks)] == blocks
            assert blocks_for(r.num_computed_tokens, self.kv.block_size) == len(blocks)
        # decodes are never starved: each is in the batch (one token) unless preempted
        chosen = dict(out.scheduled)
        for r in decodes:
            assert chosen.get(r) == 1 or r in out.preempted, r.request_id
        # next to running decodes, prefill chunks stay within their cap
        cap = s.max_prefill_tokens_while_decoding
        if cap is not None and any(r in chosen for r in decodes):
            assert sum(n for r, n in out.scheduled if r not in decodes) <= cap
        # copy-on-write pairs: each destination is a fresh block of one request in this batch
        dsts = [d for _, d in out.block_copies]
        assert len(set(dsts)) == len(dsts)
        owners = {b: r for r in reqs for b in r.block_table}
        for src, dst in out.block_copies:
            assert src != dst
            assert pool.refcount[dst] == 1 and dst in owners, (src, dst)
            assert pool.refcount[src] >= 1
            assert src not in owners[dst].block_table

    def check_invariants(self) -> None:
        s, kv, pool, ix = self.s, self.kv, self.kv.pool, self.kv.index
        bs = kv.block_size
        live = self.live
        # the scheduler's queues hold exactly the live requests
        assert len(s.running) == len(set(s.running)) and len(s.waiting) == len(set(s.waiting))
        assert not set(s.running) & set(s.waiting)
        assert set(s.running) | set(s.waiting) == set(live)
        for r in s.running:
            assert r.status is RequestStatus.RUNNING
            assert r.num_pending_tokens >= 1
            assert (
                blocks_for(r.num_computed_tokens, bs)
                <= len(r.block_table)
                <= blocks_for(r.num_tokens, bs)
            )
        for r in s.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not r.block_table and r.prefix_node is None and r.num_computed_tokens == 0
        for r in self.ended:
            assert r.is_finished and not r.block_table and r.prefix_node is None
        # generated tokens are never lost (preemption keeps them)
        for r in live + self.ended:
            seen = self.seen_outputs[r]
            assert r.output_ids[: len(seen)] == seen
            self.seen_outputs[r] = list(r.output_ids)
            assert r.num_output_tokens <= r.params.max_new_tokens

        # refcount == number of live block tables holding the block
        holders = Counter(b for r in live for b in r.block_table)
        for r in live:
            assert len(set(r.block_table)) == len(r.block_table)
        assert all(pool.refcount[b] == holders.get(b, 0) for b in range(pool.num_blocks))

        # each block is exactly one of: free, cached (in an unlocked node, refcount 0), held
        free = list(pool._free)
        assert len(free) == len(set(free))
        assert set(free) == {b for b in range(pool.num_blocks) if pool.is_free(b)}
        tree_lock: dict[int, int] = {}
        if ix is not None:
            for node in ix.iter_nodes():
                assert node.blocks and len(node.key) == len(node.blocks) * bs
                assert node.parent.children[node.key[:bs]] is node
                for b in node.blocks:
                    assert b not in tree_lock, f"block {b} in two tree nodes"
                    tree_lock[b] = node.lock_ref
            assert set(tree_lock) == ix._in_tree
        n_free = n_cached = n_held = 0
        for b in range(pool.num_blocks):
            in_tree = b in tree_lock
            if pool.is_free(b):
                assert pool.refcount[b] == 0 and not in_tree
                n_free += 1
            elif pool.refcount[b] == 0:
                assert in_tree and tree_lock[b] == 0, f"block {b} leaked"
                n_cached += 1
            else:
                n_held += 1
            if in_tree:
                # no unlocked node holds a used block, and a locked node's blocks are in use
                assert (tree_lock[b] > 0) == (pool.refcount[b] > 0), (
                    b,
                    tree_lock[b],
                    pool.refcount[b],
                )
        assert n_free == pool.num_free and n_cached == pool.num_cached
        assert n_free + n_cached + n_held == pool.num_blocks

        if ix is None:
            assert all(r.prefix_node is None and r.num_tree_blocks == 0 for r in live)
            return
        # evictable counter == recount over unlocked nodes
        assert ix.evictable_blocks == sum(len(n.blocks) for n in ix.iter_nodes() if n.lock_ref == 0)
        # lock_ref == number of live requests whose prefix node is that node or below it
        nodes = {id(n): n for n in ix.iter_nodes()}
        expected: Counter = Counter()
        for r in live:
            node = r.prefix_node
            if node is None:
                assert r.num_tree_blocks == 0
                continue
            assert id(node) in nodes, f"{r.request_id} locks a node outside the tree"
            path = []
            while not node.is_root:
                expected[id(node)] += 1
                path[:0] = node.blocks
                node = node.parent
            assert node is ix.root(r.cache_salt)
            assert r.block_table[: r.num_tree_blocks] == path
            assert r.num_tree_blocks * bs <= r.num_computed_tokens
        for key, node in nodes.items():
            assert node.lock_ref == expected.get(key, 0), (node, expected.get(key, 0))

    def check_final(self) -> None:
        pool, ix = self.kv.pool, self.kv.index
        assert not self.live and not self.s.running and not self.s.waiting
        assert pool.num_free + pool.num_cached == pool.num_blocks
        assert all(r == 0 for r in pool.refcount)
        if ix is not None:
            assert all(n.lock_ref == 0 for n in ix.iter_nodes())
            assert ix.evictable_blocks == ix.num_blocks == pool.num_cached
        # liveness: every request ended within the bound on the total work
        for r in self.ended:
            assert self.died[r] - self.born[r] <= self.work + 1
        assert self.busy_steps <= self.work + 2


# ---- strategies ---------------------------------------------------------------------------------
@st.composite
def configs(draw):
    # sampled_from draws near-uniformly (integers() favours small values): block sizes 1..8;
    # mostly pools of 6..64 tokens (requests of up to ~38 tokens: many fit alone but not
    # together, so preemption and eviction are common), sometimes a tiny one that refuses most
    block_size = draw(st.sampled_from(range(1, 9)))
    capacity = draw(
        st.one_of(st.sampled_from(range(6, 65)), st.sampled_from(range(6, 65)), st.integers(1, 12))
    )
    num_blocks = max(1, -(-capacity // block_size))
    budget = draw(st.sampled_from(range(1, 25)))
    max_seqs = draw(st.sampled_from(range(1, min(budget, 6) + 1)))
    return dict(
        num_blocks=num_blocks,
        block_size=block_size,
        budget=budget,
        max_seqs=max_seqs,
        prefix_caching=draw(st.sampled_from([True, True, False])),
        prefill_cap=draw(st.sampled_from([None, None, 1, 2, 3, 5, 8])),
    )


def random_config(rng: random.Random) -> dict:
    block_size = rng.randint(1, 8)
    budget = rng.randint(1, 24)
    return dict(
        num_blocks=max(1, -(-rng.randint(6, 64) // block_size)),
        block_size=block_size,
        budget=budget,
        max_seqs=rng.randint(1, min(budget, 6)),
        prefix_caching=rng.random() < 0.7,
        preemption_mode=rng.choice(["recompute", "recompute", "swap"]),
        prefill_cap=rng.choice([None, None, 1, 2, 4, 8]),
    )


ADD = st.tuples(
    st.just("add"),
    st.booleans(),  # starts with the common prefix
    st.lists(st.integers(0, 2), max_size=14),  # the rest of the prompt
    st.integers(1, 8),  # max_new_tokens
    st.sampled_from([1, 1, 1, 2, 3]),  # n
    st.sampled_from([None, None, "a", "b"]),  # cache_salt
    st.integers(0, 5),
)  # stop mode
STEP = st.tuples(st.just("step"), st.integers(1, 6))
ABORT = st.tuples(st.just("abort"), st.integers(0, 1 << 16))
OPS = st.lists(st.one_of(ADD, ADD, ADD, STEP, STEP, ABORT), min_size=1, max_size=30)


def run_ops(cfg: dict, prefix: list[int], ops: list, seed: int) -> Driver:
    d = Driver(seed=seed, **cfg)
    for op in ops:
        if op[0] == "add":
            _, use_prefix, rest, max_new, n, salt, stop_mode = op
            prompt = (prefix if use_prefix else []) + rest
            d.add(d.make_request(prompt or [2], max_new, n, salt, stop_mode))
        elif op[0] == "step":
            for _ in range(op[1]):
                d.step()
        elif op[0] == "abort" and d.live:
            d.abort(d.live[op[1] % len(d.live)])
    d.drain()
    return d


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=configs(),
    prefix=st.lists(st.integers(0, 1), min_size=0, max_size=16),
    ops=OPS,
    seed=st.integers(0, 1 << 30),
)
def test_random_schedules(cfg, prefix, ops, seed):
    """Operation lists drawn (and shrunk) by hypothesis."""
    run_ops(cfg, prefix, ops, seed)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, (1 << 32) - 1))
def test_long_random_schedules(seed):
    """Longer schedules from a seeded generator (pool, block size, budget, caps uniform):
    request sizes scaled to the pool, so most requests fit alone and contend together
    (preemption, eviction, prefix reuse, deferred shared prefills)."""
    rng = random.Random(seed)
    d = Driver(seed=seed, **random_config(rng))
    cap = d.kv.num_blocks * d.kv.block_size
    third = max(1, cap // 3)
    prefix = [rng.randrange(2) for _ in range(rng.randint(0, min(16, third)))]
    for _ in range(rng.randint(10, 60)):
        x = rng.random()
        if x < 0.35:
            rest = [rng.randrange(3) for _ in range(rng.randint(0, third))]
            prompt = (prefix if rng.random() < 0.6 else []) + rest
            n = rng.choice([1, 1, 1, 2, 3])
            if rng.random() < 0.9:
                n = min(n, d.s.max_num_seqs)
            d.add(
                d.make_request(
                    prompt or [2],
                    rng.randint(1, min(8, third + 2)),
                    n,
                    rng.choice([None, None, "a", "b"]),
                    rng.randrange(6),
                )
            )
        elif x < 0.93:
            d.step()
        elif d.live:
            d.abort(rng.choice(d.live), family=rng.random() < 0.5)
    d.drain()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.integers(1, 4),
    num_blocks=st.integers(2, 10),
    budget=st.integers(2, 8),
    prefix_caching=st.booleans(),
    seed=st.integers(0, 1 << 30),
)
def test_tight_pool_parallel_samples(block_size, num_blocks, budget, prefix_caching, seed):
    """Heavy contention: many requests that each just fit the pool, parallel samples with a
    partial last block (copy-on-write), a common prefix, and no eos: lots of preemption."""
    rng = random.Random(seed)
    max_seqs = rng.randint(1, min(budget, 4))
    d = Driver(num_blocks, block_size, budget, max_seqs, prefix_caching, seed)
    cap_tokens = num_blocks * block_size
    prefix = [rng.randrange(2) for _ in range(rng.randint(0, cap_tokens // 2))]
    for _ in range(rng.randint(2, 6)):
        prompt = (prefix + [rng.randrange(3) for _ in range(rng.randint(1, 4))])[
            : max(1, cap_tokens - 1)
        ]
        max_new = max(1, min(8, cap_tokens - len(prompt)))
        n = rng.randint(1, min(3, max_seqs))
        assert d.add(d.make_request(prompt, max_new, n, rng.choice([None, "a"])))
        for _ in range(rng.randint(0, 2)):
            d.step()
    d.drain()
    assert all(r.finish_reason is FinishReason.LENGTH for r in d.ended)
    assert all(r.num_output_tokens == r.params.max_new_tokens for r in d.ended)


def test_driver_smoke():
    """The /tmp/sim.py scenario: 30 requests with a shared 20-token prefix."""
    rng = random.Random(0)
    d = Driver(num_blocks=40, block_size=4, budget=32, max_seqs=8, prefix_caching=True)
    prefix = [rng.randrange(100) for _ in range(20)]
    for _ in range(30):
        p = prefix + [rng.randrange(100) for _ in range(rng.randrange(1, 20))]
        assert d.add(d.make_request(p, rng.randrange(1, 20), rng.choice([1, 1, 2])))
    d.drain()
    assert d.s.prefix_hit_tokens > 0 and d.s.num_preemptions > 0
    assert len(d.ended) > 30
