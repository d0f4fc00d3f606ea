"""What an engine must look like after any failure: nothing left behind."""

from __future__ import annotations

from collections import Counter

import paged_hf
from paged_hf.cache.block_manager import blocks_for


def assert_clean(engine: paged_hf.Engine) -> None:
    """Nothing left behind: no live request, no queued work, no block held beyond the prefix cache."""
    assert not engine.requests and not engine.has_unfinished
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv_manager.pool.num_used == 0
    assert (
        engine.kv_manager.pool.num_free + engine.kv_manager.pool.num_cached
        == engine.kv_manager.num_blocks
    )


def check_tables(engine: paged_hf.Engine) -> None:
    """Every running request holds, per group, exactly the blocks a later query reads (-1 before),
    every page's refcount is its holders, and the prefix index counts what it may evict."""
    kv, bs = engine.kv_manager, engine.kv_manager.block_size
    holders = Counter()
    for req in engine.scheduler.running:
        assert len(req.block_tables) == len(kv.groups)
        for group, table in zip(kv.groups, req.block_tables):
            first = group.first_needed_block(req.num_computed_tokens, bs)
            assert all(b == -1 for b in table[:first]), (req.request_id, group.kind, table, first)
            assert all(b >= 0 for b in table[first:]), (req.request_id, group.kind, table, first)
            assert len(table) >= blocks_for(req.num_computed_tokens, bs)
            holders.update(b for b in table if b >= 0)
        assert [sum(b >= 0 for b in t) for t in req.block_tables] == [
            len(t) - r for t, r in zip(req.block_tables, req.kv_released)
        ], "pages held from kv_released on only"
    for page, n in holders.items():
        assert kv.pool.refcount[page] == n, (page, kv.pool.refcount[page], n)
    assert kv.pool.num_used == len(holders)
    if kv.index is not None:  # what the index may evict is exactly what it holds and nobody uses
        assert all(kv.pool.refcount[p] == 0 for p in kv.index._loose)
        assert kv.index.evictable_blocks == sum(kv.pool.refcount[p] == 0 for p in kv.index._in_tree)
        assert not any(kv.pool.is_free(p) for p in kv.index._in_tree)
    # a hybrid's running slots: each held by the request that names it, or free
    if kv.state is not None:
        owners = kv.state._owner
        assert all(req.state_slot == slot for slot, req in owners.items())
        assert sorted([*owners, *kv.state._free]) == list(range(kv.state.num_slots))
        assert all(
            r.state_slot in owners for r in engine.scheduler.running if r.state_slot is not None
        )


def checked(engine: paged_hf.Engine) -> paged_hf.Engine:
    """``engine`` with ``check_tables`` after every step."""
    step = engine.step

    def step_and_check(*args, **kwargs):
        out = step(*args, **kwargs)
        check_tables(engine)
        return out

    engine.step = step_and_check
    return engine
