"""BlockPool: allocation, refcounts, the free list, eviction of cached blocks."""

from __future__ import annotations

import pytest

from paged_hf.cache.block_pool import BlockPool
from paged_hf.cache.prefix_index import RadixPrefixIndex

BS = 2


def toks(*chunks: int) -> list[int]:
    return [c for c in chunks for _ in range(BS)]


def test_allocate_and_free():
    pool = BlockPool(4, BS)
    assert (pool.num_free, pool.num_used, pool.num_available, pool.num_cached) == (4, 0, 4, 0)
    a = pool.allocate(3)
    assert len(a) == len(set(a)) == 3 and all(0 <= b < 4 for b in a)
    assert all(pool.refcount[b] == 1 and not pool.is_free(b) for b in a)
    assert (pool.num_free, pool.num_used) == (1, 3)
    pool.decref(a[:2])
    assert (pool.num_free, pool.num_used) == (3, 1)
    assert pool.is_free(a[0]) and pool.is_free(a[1]) and not pool.is_free(a[2])
    b = pool.allocate(3)
    assert a[2] not in b and len(set(b)) == 3
    assert pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.decref(b + [a[2]])
    assert pool.num_free == 4 and all(r == 0 for r in pool.refcount)


def test_allocate_zero_is_a_noop():
    pool = BlockPool(2, BS)
    assert pool.allocate(0) == []
    assert pool.num_free == 2


def test_free_list_is_a_stack():
    """The lowest ids go first; a freed block is the next one handed out, so a run keeps to the
    pages it has written (no fresh page of a CPU pool faulted in while old ones sit free)."""
    pool = BlockPool(4, BS)
    assert pool.allocate(2) == [0, 1]
    pool.decref([1])
    pool.decref([0])
    assert pool.allocate(3) == [0, 1, 2]


def test_refcount_sharing():
    pool = BlockPool(3, BS)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.incref([b])
    assert pool.refcount[b] == 3
    pool.decref([b])
    assert pool.refcount[b] == 2 and not pool.is_free(b) and pool.num_free == 2
    pool.decref([b])
    assert pool.refcount[b] == 1 and not pool.is_free(b)
    pool.decref([b])
    assert pool.refcount[b] == 0 and pool.is_free(b) and pool.num_free == 3


def test_double_free_and_underflow_raise():
    pool = BlockPool(3, BS)
    (b,) = pool.allocate(1)
    pool.decref([b])
    with pytest.raises(RuntimeError):
        pool.decref([b])  # double free
    with pytest.raises(RuntimeError):
        pool.decref([2])  # never allocated
    with pytest.raises(RuntimeError):
        pool.incref([b])  # a free block cannot gain references
    assert pool.num_free == 3 and pool.refcount == [0, 0, 0]


def test_release_twice_raises():
    pool = BlockPool(2, BS)
    with pytest.raises(RuntimeError):
        pool._release(0)  # already on the free list


def test_cached_blocks_stay_out_of_the_free_list():
    ix = RadixPrefixIndex(BS)
    pool = BlockPool(4, BS, ix)
    blocks = pool.allocate(2)
    ix.insert(toks(1, 2), blocks)
    pool.decref(blocks)
    assert all(pool.refcount[b] == 0 and not pool.is_free(b) for b in blocks)
    assert (pool.num_free, pool.num_cached, pool.num_available, pool.num_used) == (2, 2, 4, 0)
    # a cached block can be taken again (prefix hit) while the index has it locked
    node, hit = ix.match_prefix(toks(1, 2))
    assert hit == blocks
    pool.incref(hit)
    ix.lock(node)
    assert (pool.num_cached, pool.num_used) == (0, 2)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    ix.unlock(node)
    pool.decref(hit)
    assert pool.num_cached == 2


def test_allocation_prefers_free_blocks_then_evicts_lru():
    ix = RadixPrefixIndex(BS)
    pool = BlockPool(5, BS, ix)
    x, y, z = pool.allocate(3)
    ix.insert(toks(1), [x])  # oldest
    ix.insert(toks(2), [y])
    ix.insert(toks(3), [z])
    pool.decref([x, y, z])
    ix.match_prefix(toks(1))  # x is now the most recently used
    assert (pool.num_free, pool.num_cached) == (2, 3)

    fresh = pool.allocate(2)  # the two free blocks, no eviction
    assert not set(fresh) & {x, y, z}
    assert pool.evictions == 0 and ix.num_blocks == 3

    (got,) = pool.allocate(1)  # now the least recently used cached block goes
    assert got == y and pool.evictions == 1
    assert pool.refcount[y] == 1 and not ix.holds(y)
    assert ix.match_prefix(toks(2))[1] == []
    assert ix.match_prefix(toks(1))[1] == [x]

    got = pool.allocate(2)
    assert got == [z, x] and pool.evictions == 3
    assert ix.num_blocks == 0 and pool.num_available == 0


def test_allocation_mixes_free_and_evicted():
    ix = RadixPrefixIndex(BS)
    pool = BlockPool(3, BS, ix)
    a, b = pool.allocate(2)
    ix.insert(toks(1, 2), [a, b])
    pool.decref([a, b])
    got = pool.allocate(2)  # 1 free + 1 evicted (the tail of the cached chain)
    assert sorted(got) == sorted([2, b])
    assert ix.match_prefix(toks(1, 2))[1] == [a]
    assert pool.num_cached == 1 and pool.num_free == 0


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (-1, 4), (4, 0), (4, -2), (0, 0)])
def test_bad_sizes_raise(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_negative_allocation_raises():
    pool = BlockPool(2, BS)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert pool.num_free == 2
