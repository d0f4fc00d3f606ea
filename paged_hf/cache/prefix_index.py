"""Radix tree over block-aligned token chunks: which physical blocks already hold a prefix's KV.

Design notes: docs/internals.md, paged_hf/cache/prefix_index.py.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Callable, Hashable, Sequence

from .kv_groups import FULL, CacheGroup


class Node:
    __slots__ = ("key", "blocks", "extra", "children", "parent", "lock_ref", "last_access", "state")

    def __init__(
        self,
        key: tuple[int, ...],
        blocks: list[int],
        parent: "Node | None",
        extra: list[list[int]] | None = None,
    ) -> None:
        self.key = key  # tokens; len(key) == len(blocks) * block_size
        self.blocks = blocks
        self.extra = extra or []  # groups 1..: a page per position of this node, -1 where none
        self.children: dict[tuple[int, ...], Node] = {}  # first block's tokens -> child
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.state: int | None = None  # hybrids: a state checkpoint slot at this node's end

    @property
    def num_blocks_from_root(self) -> int:
        n, node = 0, self
        while node is not None and not node.is_root:
            n += len(node.blocks)
            node = node.parent
        return n

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return (
            f"Node(blocks={self.blocks}, lock_ref={self.lock_ref}, children={len(self.children)})"
        )


class RadixPrefixIndex:
    def __init__(
        self,
        block_size: int,
        namespace: Hashable = "",
        on_drop_state: Callable[[int], None] | None = None,
        groups: Sequence[CacheGroup] = (FULL,),
    ) -> None:
        """``on_drop_state``: called with a node's state checkpoint when the node's end goes (evicted,
        or trimmed): a checkpoint is only good at exactly the position it was taken. ``groups``: the
        cache groups, group 0 a full one."""
        if block_size < 1:
            raise ValueError(f"block_size={block_size}, must be >= 1")
        self.block_size = block_size
        self.namespace = namespace
        self.on_drop_state = on_drop_state
        self._roots: dict[tuple[Hashable, Hashable], Node] = {}
        self._clock = itertools.count(1)
        self._in_tree: set[int] = set()  # every block id the tree holds
        self.evictable_blocks = 0  # blocks in unlocked nodes, and loose pages nobody uses
        self.groups = tuple(groups)
        assert self.groups[0].is_full, "group 0 keys the tree: it must be a full-attention group"
        self._num_extra = len(self.groups) - 1
        self._loose_kind = [not g.is_full for g in self.groups[1:]]
        # pages per position counted by locks
        self._bound = 1 + sum(not loose for loose in self._loose_kind)
        self._where: dict[
            int, tuple[Node, int]
        ] = {}  # loose-kind page -> (its node, its extra group)
        self._loose: OrderedDict[int, int] = OrderedDict()  # unused loose pages -> when released

    # ---- queries -------------------------------------------------------------------------
    def root(self, cache_salt: Hashable = None, namespace: Hashable = None) -> Node:
        key = (self.namespace if namespace is None else namespace, cache_salt)
        node = self._roots.get(key)
        if node is None:
            node = self._roots[key] = Node((), [], None)
        return node

    def holds(self, block: int) -> bool:
        return block in self._in_tree

    @property
    def num_blocks(self) -> int:
        return len(self._in_tree)

    def match_prefix(
        self, tokens: Sequence[int], cache_salt: Hashable = None, namespace: Hashable = None
    ) -> tuple[Node, list[int]]:
        """Longest cached block-aligned prefix of ``tokens``: (deepest node, its block ids).

        The node's path covers exactly the returned blocks (an edge matched part-way is split).
        """
        node, blocks, _ = self._walk(tokens, self.root(cache_salt, namespace), next(self._clock))
        return node, blocks

    def path_tables(self, node: Node) -> list[list[int]]:
        """Per group, the pages of every position from the root to ``node``'s end (-1 where none)."""
        nodes = []
        while not node.is_root:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        tables = [[b for n in nodes for b in n.blocks]]
        for g in range(self._num_extra):
            tables.append([b for n in nodes for b in n.extra[g]])
        return tables

    # ---- the pool's view: loose pages become evictable when nobody uses them ------------------
    def unused(self, page: int) -> None:
        """The pool: a page the tree holds has no user any more."""
        if page in self._where and page not in self._loose:
            self._loose[page] = next(self._clock)
            self.evictable_blocks += 1

    def used(self, page: int) -> None:
        """The pool: a page the tree holds has a user again."""
        if self._loose.pop(page, None) is not None:
            self.evictable_blocks -= 1

    # ---- updates -------------------------------------------------------------------------
    def insert(
        self,
        tokens: Sequence[int],
        blocks: Sequence[int],
        cache_salt: Hashable = None,
        namespace: Hashable = None,
        extra: Sequence[Sequence[int]] = (),
    ) -> tuple[Node, list[int]]:
        """Record that ``blocks`` hold the KV of ``tokens`` (whole blocks only); ``extra``: per
        further group, the caller's pages of those positions (-1 where it holds none).

        Returns the node for the whole sequence and the tree's blocks along it: where a chunk
        was already cached, the tree keeps its own block and the caller's copy is a duplicate
        (``path_tables`` gives every group's). A position the tree holds no page of in a group
        takes the caller's.
        """
        bs = self.block_size
        if len(tokens) != len(blocks) * bs:
            raise ValueError(
                f"insert: {len(tokens)} tokens do not fill {len(blocks)} blocks of {bs}"
            )
        if len(extra) != self._num_extra or any(len(t) != len(blocks) for t in extra):
            raise ValueError(
                f"insert: {len(extra)} extra tables for {self._num_extra} further groups, "
                f"each of {len(blocks)} pages"
            )
        now = next(self._clock)
        node, path_blocks, n = self._walk(tokens, self.root(cache_salt, namespace), now)
        if self._num_extra and n:
            self._adopt(node, n, extra)
        if n < len(blocks):
            new_blocks = list(blocks[n:])
            new_extra = [list(t[n:]) for t in extra]
            pages = new_blocks + [b for t in new_extra for b in t if b >= 0]
            if any(b in self._in_tree for b in pages):
                raise ValueError(
                    f"insert: a block in {pages} is already cached under another prefix"
                )
            child = Node(tuple(tokens[n * bs :]), new_blocks, node, new_extra)
            child.last_access = now
            node.children[child.key[:bs]] = child
            self._in_tree.update(pages)
            self._track(child)
            self.evictable_blocks += len(new_blocks) * self._bound
            node = child
            path_blocks = path_blocks + new_blocks
        return node, path_blocks

    def _adopt(self, node: Node, n: int, extra: Sequence[Sequence[int]]) -> None:
        """Positions 0..n-1 end at ``node``: where the tree holds no page of a group, take the caller's."""
        end = n
        while not node.is_root:
            start = end - len(node.blocks)
            for g, table in enumerate(extra):
                mine = node.extra[g]
                for i in range(len(node.blocks)):
                    page = table[start + i]
                    if mine[i] < 0 and page >= 0:
                        if page in self._in_tree:
                            raise ValueError(
                                f"insert: page {page} is already cached under another prefix"
                            )
                        mine[i] = page
                        self._in_tree.add(page)
                        if self._loose_kind[g]:
                            self._where[page] = (node, g)
                        elif node.lock_ref == 0:
                            self.evictable_blocks += 1
            end = start
            node = node.parent

    def _track(self, node: Node) -> None:
        for g, table in enumerate(node.extra):
            if self._loose_kind[g]:
                for page in table:
                    if page >= 0:
                        self._where[page] = (node, g)

    def lock(self, node: Node) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref == 0:
                self.evictable_blocks -= len(node.blocks) * self._bound
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_blocks += len(node.blocks) * self._bound
            node = node.parent

    def evict(self, n_blocks: int) -> list[int]:
        """Free at least ``n_blocks`` blocks (fewer if the tree has fewer to give): unused loose
        pages and unlocked leaves, least recently used first.

        A leaf larger than what is still needed loses only its tail blocks.
        """
        freed: list[int] = []
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        while len(freed) < n_blocks:
            if self._loose and (not heap or next(iter(self._loose.values())) <= heap[0][0]):
                freed.append(self._forget_loose(next(iter(self._loose))))
                continue
            if not heap:
                break
            _, _, leaf = heapq.heappop(heap)
            if leaf.lock_ref or leaf.children or leaf.parent is None:
                continue  # changed since it was pushed
            per_position = self._bound + sum(b >= 0 for t in leaf.extra for b in t) / len(
                leaf.blocks
            )
            take = min(len(leaf.blocks), max(1, int(-(-(n_blocks - len(freed)) // per_position))))
            self._drop_state(leaf)  # its end goes, trimmed or removed
            keep = len(leaf.blocks) - take
            freed.extend(self._drop_positions(leaf, keep))
            if keep:  # trim the tail, keep the rest of the leaf cached
                leaf.blocks = leaf.blocks[:keep]
                leaf.extra = [t[:keep] for t in leaf.extra]
                leaf.key = leaf.key[: keep * self.block_size]
                if len(freed) >= n_blocks:
                    break
                heapq.heappush(heap, (leaf.last_access, id(leaf), leaf))
                continue
            parent = leaf.parent
            del parent.children[leaf.key[: self.block_size]]
            leaf.parent = None
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _drop_positions(self, leaf: Node, keep: int) -> list[int]:
        """Forget every page of the leaf's positions from ``keep`` on (the leaf is unlocked)."""
        out = list(leaf.blocks[keep:])
        self.evictable_blocks -= len(out) * self._bound
        for g, table in enumerate(leaf.extra):
            for page in table[keep:]:
                if page < 0:
                    continue
                if self._loose_kind[g]:
                    assert page in self._loose, f"page {page} of an unlocked node is in use"
                    del self._loose[page]
                    del self._where[page]
                    self.evictable_blocks -= 1
                out.append(page)
        self._in_tree.difference_update(out)
        return out

    def _forget_loose(self, page: int) -> int:
        node, g = self._where.pop(page)
        del self._loose[page]
        node.extra[g][node.extra[g].index(page)] = -1
        self._in_tree.discard(page)
        self.evictable_blocks -= 1
        return page

    def _drop_state(self, node: Node) -> None:
        if node.state is not None:
            slot, node.state = node.state, None
            if self.on_drop_state is not None:
                self.on_drop_state(slot)

    def forget_empty_roots(self) -> None:
        """Drop the roots of other namespaces that hold nothing (left behind by namespace changes)."""
        for key in [
            k for k, root in self._roots.items() if not root.children and k[0] != self.namespace
        ]:
            del self._roots[key]

    # ---- internals -----------------------------------------------------------------------
    def _walk(self, tokens: Sequence[int], node: Node, now: int) -> tuple[Node, list[int], int]:
        bs = self.block_size
        n_full = len(tokens) // bs
        blocks: list[int] = []
        i = 0  # blocks matched so far
        while i < n_full:
            child = node.children.get(tuple(tokens[i * bs : (i + 1) * bs]))
            if child is None:
                break
            k = 1
            while (
                k < len(child.blocks)
                and i + k < n_full
                and tuple(tokens[(i + k) * bs : (i + k + 1) * bs])
                == child.key[k * bs : (k + 1) * bs]
            ):
                k += 1
            if k < len(child.blocks):
                child = self._split(child, k)
            child.last_access = now
            blocks.extend(child.blocks)
            node = child
            i += k
        return node, blocks, i

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its first k blocks; return the new upper part."""
        bs = self.block_size
        upper = Node(node.key[: k * bs], node.blocks[:k], node.parent, [t[:k] for t in node.extra])
        node.extra = [t[k:] for t in node.extra]
        self._track(upper)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.parent.children[upper.key[:bs]] = upper
        node.key = node.key[k * bs :]
        node.blocks = node.blocks[k:]
        node.parent = upper
        upper.children[node.key[:bs]] = node
        return upper

    def _evictable_leaves(self) -> list[Node]:
        out, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif not node.is_root and node.lock_ref == 0:
                out.append(node)
        return out

    def iter_nodes(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.is_root:
                yield node
