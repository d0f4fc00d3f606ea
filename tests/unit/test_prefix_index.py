"""RadixPrefixIndex: block-aligned matching, node splits, LRU eviction, salts, locks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_hf.cache.block_manager import BlockManager
from paged_hf.cache.prefix_index import RadixPrefixIndex
from paged_hf.requests.request import Request
from paged_hf.requests.sampling_params import SamplingParams

BS = 4


def toks(*chunks: int) -> list[int]:
    """One block of ``BS`` identical tokens per chunk value: toks(1, 2) == [1,1,1,1,2,2,2,2]."""
    return [c for c in chunks for _ in range(BS)]


def recount_evictable(index: RadixPrefixIndex) -> int:
    return sum(len(n.blocks) for n in index.iter_nodes() if n.lock_ref == 0)


def all_tree_blocks(index: RadixPrefixIndex) -> list[int]:
    return [b for n in index.iter_nodes() for b in n.blocks]


def path_blocks(node) -> list[int]:
    out = []
    while node is not None and not node.is_root:
        out[:0] = node.blocks
        node = node.parent
    return out


# ---- matching -----------------------------------------------------------------------------
def test_match_after_insert():
    ix = RadixPrefixIndex(BS)
    node, blocks = ix.insert(toks(1, 2, 3), [10, 11, 12])
    assert blocks == [10, 11, 12]
    assert path_blocks(node) == [10, 11, 12]
    assert ix.num_blocks == 3 and ix.evictable_blocks == 3

    n, b = ix.match_prefix(toks(1, 2, 3))
    assert b == [10, 11, 12] and n is node
    assert ix.match_prefix(toks(1, 2))[1] == [10, 11]
    assert ix.match_prefix(toks(1))[1] == [10]
    assert ix.match_prefix(toks(1, 2, 3, 4))[1] == [10, 11, 12]  # longer query: longest prefix
    assert ix.match_prefix(toks(1, 9, 3))[1] == [10]  # diverges in block 2
    assert ix.match_prefix(toks(2, 2, 3))[1] == []  # diverges in block 1
    n0, b0 = ix.match_prefix([])
    assert b0 == [] and n0.is_root
    for b in (10, 11, 12):
        assert ix.holds(b)
    assert not ix.holds(13)


def test_partial_block_tail_is_truncated_for_match():
    ix = RadixPrefixIndex(BS)
    ix.insert(toks(1, 2), [5, 6])
    # 7 tokens = 1 whole block + 3 tokens of the second: only the whole block can match,
    # even though the 3 tokens agree with the cached second block
    assert ix.match_prefix(toks(1, 2)[:7])[1] == [5]
    assert ix.match_prefix(toks(1, 2)[:4])[1] == [5]
    assert ix.match_prefix(toks(1, 2)[:3])[1] == []
    assert ix.match_prefix(toks(1, 2) + [2, 2])[1] == [5, 6]


def test_insert_requires_whole_blocks():
    ix = RadixPrefixIndex(BS)
    with pytest.raises(ValueError):
        ix.insert(toks(1, 2)[:7], [5, 6])  # 7 tokens do not fill 2 blocks
    with pytest.raises(ValueError):
        ix.insert(toks(1, 2)[:7], [5])  # nor 1 block
    with pytest.raises(ValueError):
        ix.insert(toks(1, 2) + [3], [5, 6])  # a partial tail is never accepted
    assert ix.num_blocks == 0 and ix.evictable_blocks == 0
    assert list(ix.iter_nodes()) == []


def test_block_manager_caches_only_full_blocks():
    """A request with 10 computed tokens (block size 4) offers 2 blocks, never its partial tail."""
    kv = BlockManager(num_blocks=8, block_size=BS)
    req = Request("r", list(range(10)), SamplingParams())
    assert kv.allocate_slots(req, 10, [])
    req.num_computed_tokens = 10
    kv.cache_full_blocks(req)
    assert kv.index.num_blocks == 2
    assert all_tree_blocks(kv.index) == req.block_table[:2]
    assert not kv.index.holds(req.block_table[2])
    assert req.num_tree_blocks == 2


def test_invalid_block_size():
    with pytest.raises(ValueError):
        RadixPrefixIndex(0)
    with pytest.raises(ValueError):
        RadixPrefixIndex(-3)


# ---- splits -------------------------------------------------------------------------------
def test_insert_splits_edge_at_block_boundary():
    ix = RadixPrefixIndex(BS)
    a_node, _ = ix.insert(toks(1, 2, 3), [10, 11, 12])
    b_node, b_blocks = ix.insert(toks(1, 2, 7, 8), [20, 21, 22, 23])
    # the shared chunks keep the tree's blocks; the caller's 20, 21 are duplicates
    assert b_blocks == [10, 11, 22, 23]
    assert not ix.holds(20) and not ix.holds(21)
    assert ix.num_blocks == 5 and ix.evictable_blocks == 5

    # the tree: root -> [10, 11] -> {[12], [22, 23]}
    root = ix.root()
    (split,) = root.children.values()
    assert split.blocks == [10, 11]
    assert sorted(c.blocks for c in split.children.values()) == [[12], [22, 23]]
    assert a_node.parent is split and b_node.parent is split
    assert a_node.key == tuple(toks(3)) and split.key == tuple(toks(1, 2))

    assert ix.match_prefix(toks(1, 2, 3))[1] == [10, 11, 12]
    assert ix.match_prefix(toks(1, 2, 7, 8))[1] == [10, 11, 22, 23]
    assert ix.match_prefix(toks(1, 2, 9))[1] == [10, 11]
    # a match ending inside [22, 23] splits that edge too, and every path still matches
    node, blocks = ix.match_prefix(toks(1, 2, 7))
    assert blocks == [10, 11, 22] and node.blocks == [22]
    assert list(node.children.values()) == [b_node] and b_node.blocks == [23]
    assert ix.match_prefix(toks(1, 2, 7, 8))[1] == [10, 11, 22, 23]
    assert ix.match_prefix(toks(1, 2, 3))[1] == [10, 11, 12]
    assert ix.num_blocks == 5 and ix.evictable_blocks == 5 == recount_evictable(ix)


def test_match_splits_edge_and_keeps_lock_count():
    ix = RadixPrefixIndex(BS)
    node, _ = ix.insert(toks(1, 2, 3), [10, 11, 12])
    ix.lock(node)
    assert ix.evictable_blocks == 0
    upper, blocks = ix.match_prefix(toks(1, 2, 5))
    assert blocks == [10, 11]
    assert upper.blocks == [10, 11] and upper.parent.is_root
    assert list(upper.children.values()) == [node] and node.blocks == [12]
    assert upper.lock_ref == node.lock_ref == 1
    assert ix.evictable_blocks == 0 == recount_evictable(ix)
    ix.unlock(node)
    assert upper.lock_ref == 0 and node.lock_ref == 0
    assert ix.evictable_blocks == 3 == recount_evictable(ix)


# ---- eviction -----------------------------------------------------------------------------
def test_lru_eviction_order_and_match_refreshes():
    ix = RadixPrefixIndex(BS)
    ix.insert(toks(1), [1])  # oldest
    ix.insert(toks(2), [2])
    ix.insert(toks(3), [3])  # newest
    ix.match_prefix(toks(1))  # 1 becomes the most recently used
    assert ix.evict(1) == [2]
    assert ix.evict(1) == [3]
    assert ix.evict(1) == [1]
    assert ix.evict(1) == []
    assert ix.num_blocks == 0 and ix.evictable_blocks == 0


def test_insert_refreshes_recency():
    ix = RadixPrefixIndex(BS)
    ix.insert(toks(1), [1])
    ix.insert(toks(2), [2])
    ix.insert(toks(1), [9])  # already cached: a touch, not a new block
    assert not ix.holds(9)
    assert ix.evict(1) == [2]


def test_evict_leaves_before_their_parents():
    ix = RadixPrefixIndex(BS)
    ix.insert(toks(1, 2), [1, 2])
    ix.insert(toks(1, 3), [1, 3])  # splits: [1] -> {[2], [3]}
    ix.insert(toks(5), [5])  # newest, but a leaf
    # leaves by age: [2] (t1), [3] (t2), then [1] once it is a leaf (touched at t2) before [5] (t3)
    assert ix.evict(3) == [2, 3, 1]
    assert ix.holds(5) and ix.num_blocks == 1
    assert ix.evict(10) == [5]
    assert ix.num_blocks == 0 and ix.evictable_blocks == 0


def test_parent_that_becomes_a_leaf_keeps_its_own_recency():
    ix = RadixPrefixIndex(BS)
    ix.insert(toks(1, 2), [1, 2])  # t1
    ix.insert(toks(9), [9])  # t2
    ix.match_prefix(toks(1))  # t3: splits [1] | [2], touches only [1]
    # [2] (t1) goes first; then [1] is a leaf again, but touched at t3, after [9] (t2)
    assert ix.evict(2) == [2, 9]
    assert ix.holds(1)
    assert ix.evict(1) == [1]


def test_partial_leaf_eviction_trims_tail():
    ix = RadixPrefixIndex(BS)
    node, _ = ix.insert(toks(1, 2, 3), [10, 11, 12])
    assert ix.evict(1) == [12]
    assert ix.match_prefix(toks(1, 2, 3))[1] == [10, 11]
    assert node.blocks == [10, 11] and len(node.key) == 2 * BS
    assert ix.num_blocks == 2 and ix.evictable_blocks == 2 == recount_evictable(ix)
    assert ix.evict(1) == [11]
    assert ix.match_prefix(toks(1, 2, 3))[1] == [10]
    # re-inserting the lost tail hangs it below the trimmed node again
    ix.insert(toks(1, 2, 3), [21, 22, 23])
    assert ix.match_prefix(toks(1, 2, 3))[1] == [10, 22, 23]
    assert ix.evictable_blocks == 3 == recount_evictable(ix)


# ---- salts and namespaces -----------------------------------------------------------------
def test_cache_salt_isolation():
    ix = RadixPrefixIndex(BS)
    ix.insert(toks(1, 2), [1, 2], cache_salt="a")
    assert ix.match_prefix(toks(1, 2), cache_salt="a")[1] == [1, 2]
    assert ix.match_prefix(toks(1, 2))[1] == []
    assert ix.match_prefix(toks(1, 2), cache_salt="b")[1] == []
    # the same tokens under another salt get their own blocks
    _, blocks = ix.insert(toks(1, 2), [3, 4], cache_salt="b")
    assert blocks == [3, 4]
    assert ix.match_prefix(toks(1, 2), cache_salt="a")[1] == [1, 2]
    assert ix.match_prefix(toks(1, 2), cache_salt="b")[1] == [3, 4]
    # a block may not be cached under two salts at once
    with pytest.raises(ValueError):
        ix.insert(toks(1, 2), [1, 2], cache_salt=None)
    # same salt shares: a second insert keeps the tree's blocks
    _, blocks = ix.insert(toks(1, 2, 3), [7, 8, 9], cache_salt="a")
    assert blocks == [1, 2, 9]


def test_namespace_isolation():
    ix = RadixPrefixIndex(BS, namespace="model-a")
    ix.insert(toks(1, 2), [1, 2])
    ix.insert(toks(1, 2), [3, 4], namespace="adapter-b")
    assert ix.match_prefix(toks(1, 2))[1] == [1, 2]
    assert ix.match_prefix(toks(1, 2), namespace="model-a")[1] == [1, 2]
    assert ix.match_prefix(toks(1, 2), namespace="adapter-b")[1] == [3, 4]
    assert ix.match_prefix(toks(1, 2), namespace="other")[1] == []
    # namespace and salt combine
    assert ix.match_prefix(toks(1, 2), cache_salt="s", namespace="adapter-b")[1] == []

    other = RadixPrefixIndex(BS, namespace="model-b")
    assert other.match_prefix(toks(1, 2))[1] == []


def test_block_manager_salt_isolation():
    def req(rid, salt):
        return Request(rid, toks(1, 2, 3) + [4], SamplingParams(cache_salt=salt))

    kv = BlockManager(num_blocks=32, block_size=BS)
    first = req("a0", "a")
    assert kv.admit(first) == 0
    assert kv.allocate_slots(first, first.num_tokens, [])
    first.num_computed_tokens = first.num_tokens
    kv.cache_full_blocks(first)
    assert kv.admit(req("none", None)) == 0
    assert kv.admit(req("b", "b")) == 0
    same = req("a1", "a")
    assert kv.admit(same) == 3 * BS
    assert same.block_table == first.block_table[:3]


# ---- locks --------------------------------------------------------------------------------
def test_eviction_never_touches_locked_paths():
    ix = RadixPrefixIndex(BS)
    deep, _ = ix.insert(toks(1, 2, 3, 4), [1, 2, 3, 4])
    ix.insert(toks(1, 2, 5), [1, 2, 5])  # splits at [1, 2]
    ix.insert(toks(9, 9), [9, 10])
    ix.lock(deep)
    assert ix.evictable_blocks == 3 == recount_evictable(ix)
    freed = ix.evict(100)  # more than there is
    assert sorted(freed) == [5, 9, 10]
    for b in (1, 2, 3, 4):
        assert ix.holds(b)
    assert ix.evictable_blocks == 0
    assert ix.evict(1) == []
    assert ix.match_prefix(toks(1, 2, 3, 4))[1] == [1, 2, 3, 4]

    ix.unlock(deep)
    assert ix.evictable_blocks == 4
    assert sorted(ix.evict(100)) == [1, 2, 3, 4]
    assert ix.num_blocks == 0


def test_lock_of_ancestor_only_protects_ancestors():
    ix = RadixPrefixIndex(BS)
    ix.insert(toks(1, 2, 3), [1, 2, 3])
    mid, _ = ix.match_prefix(toks(1, 2))  # splits [1, 2] | [3]
    ix.lock(mid)
    assert sorted(ix.evict(100)) == [3]
    assert ix.holds(1) and ix.holds(2)
    ix.unlock(mid)


def test_unlock_underflow_raises():
    ix = RadixPrefixIndex(BS)
    node, _ = ix.insert(toks(1, 2), [1, 2])
    with pytest.raises(RuntimeError):
        ix.unlock(node)
    ix.lock(node)
    ix.lock(node)
    ix.unlock(node)
    ix.unlock(node)
    with pytest.raises(RuntimeError):
        ix.unlock(node)
    # the root is never locked nor unlocked
    ix.lock(ix.root())
    ix.unlock(ix.root())
    assert ix.root().lock_ref == 0


def test_lock_ref_counts_along_path():
    ix = RadixPrefixIndex(BS)
    a, _ = ix.insert(toks(1, 2), [1, 2])
    b, _ = ix.insert(toks(1, 3), [1, 3])
    ix.lock(a)
    ix.lock(b)
    shared = a.parent
    assert shared is b.parent and shared.blocks == [1]
    assert (shared.lock_ref, a.lock_ref, b.lock_ref) == (2, 1, 1)
    ix.unlock(a)
    assert (shared.lock_ref, a.lock_ref, b.lock_ref) == (1, 0, 1)
    assert ix.evictable_blocks == 1 == recount_evictable(ix)
    assert ix.evict(5) == [2]


# ---- random operations ------------------------------------------------------------------
OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
        st.lists(st.integers(0, 2), min_size=0, max_size=5),  # chunk values
        st.sampled_from([None, "a"]),
        st.integers(0, 6),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS)
def test_random_ops_keep_counters_consistent(ops):
    """evictable_blocks always equals a recount over unlocked nodes; locked blocks survive."""
    ix = RadixPrefixIndex(BS)
    next_block = iter(range(10_000))
    locked: list = []  # nodes we hold a lock on (with multiplicity)
    for kind, chunks, salt, k in ops:
        tokens = toks(*chunks)
        if kind == "insert":
            node, blocks = ix.insert(tokens, [next(next_block) for _ in chunks], cache_salt=salt)
            assert len(blocks) == len(chunks) and path_blocks(node) == blocks
        elif kind == "match":
            node, blocks = ix.match_prefix(tokens + [0] * (k % BS), cache_salt=salt)
            assert path_blocks(node) == blocks
        elif kind == "lock":
            node, blocks = ix.match_prefix(tokens, cache_salt=salt)
            ix.lock(node)
            locked.append(node)
        elif kind == "unlock" and locked:
            ix.unlock(locked.pop(k % len(locked)))
        elif kind == "evict":
            before = set(all_tree_blocks(ix))
            protected = {b for n in locked for b in path_blocks(n)}
            freed = ix.evict(k)
            assert len(freed) == min(k, len(before - protected))
            assert not set(freed) & protected
            assert set(freed) <= before
        # invariants
        assert ix.evictable_blocks == recount_evictable(ix)
        blocks = all_tree_blocks(ix)
        assert len(blocks) == len(set(blocks)) == ix.num_blocks
        assert all(ix.holds(b) for b in blocks)
        expected_refs: dict[int, int] = {}
        for n in locked:
            while not n.is_root:
                expected_refs[id(n)] = expected_refs.get(id(n), 0) + 1
                n = n.parent
        for n in ix.iter_nodes():
            assert n.lock_ref == expected_refs.get(id(n), 0)
            assert n.blocks and len(n.key) == len(n.blocks) * BS
            assert n.parent.children[n.key[:BS]] is n
