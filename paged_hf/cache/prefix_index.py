"""Radix tree over block-aligned token chunks: which physical blocks already hold a prefix's KV.

SGLang-style, with page size = block size: every edge holds a whole number of blocks, so a
split always falls on a block boundary. Each root is one (namespace, cache_salt) pair: the
key of a chunk is its whole path from that root, so requests with different salts, or
models/adapters with different namespaces, can never share a block.

The tree holds no references. A node's ``lock_ref`` counts the requests whose block tables
use it (lock/unlock go along the whole path); an unlocked node's blocks are therefore
unused and may be evicted, least recently used leaf first.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Hashable, Sequence


class Node:
    __slots__ = ("key", "blocks", "children", "parent", "lock_ref", "last_access", "state")

    def __init__(self, key: tuple[int, ...], blocks: list[int], parent: "Node | None") -> None:
        self.key = key  # tokens; len(key) == len(blocks) * block_size
        self.blocks = blocks
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
        return f"Node(blocks={self.blocks}, lock_ref={self.lock_ref}, children={len(self.children)})"


class RadixPrefixIndex:
    def __init__(self, block_size: int, namespace: Hashable = "", on_drop_state: Callable[[int], None] | None = None
                 ) -> None:
        """``on_drop_state``: called with a node's state checkpoint when the node's end goes (evicted,
        or trimmed): a checkpoint is only good at exactly the position it was taken."""
        if block_size < 1:
            raise ValueError(f"block_size={block_size}, must be >= 1")
        self.block_size = block_size
        self.namespace = namespace
        self.on_drop_state = on_drop_state
        self._roots: dict[tuple[Hashable, Hashable], Node] = {}
        self._clock = itertools.count(1)
        self._held: set[int] = set()  # every block id the tree holds
        self.evictable_blocks = 0  # blocks in unlocked nodes

    # ---- queries -------------------------------------------------------------------------
    def root(self, cache_salt: Hashable = None, namespace: Hashable = None) -> Node:
        key = (self.namespace if namespace is None else namespace, cache_salt)
        node = self._roots.get(key)
        if node is None:
            node = self._roots[key] = Node((), [], None)
        return node

    def holds(self, block: int) -> bool:
        return block in self._held

    @property
    def num_blocks(self) -> int:
        return len(self._held)

    def match_prefix(self, tokens: Sequence[int], cache_salt: Hashable = None,
                     namespace: Hashable = None) -> tuple[Node, list[int]]:
        """Longest cached block-aligned prefix of ``tokens``: (deepest node, its block ids).

        The node's path covers exactly the returned blocks (an edge matched part-way is split).
        """
        node, blocks, _ = self._walk(tokens, self.root(cache_salt, namespace), next(self._clock))
        return node, blocks

    # ---- updates -------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], blocks: Sequence[int], cache_salt: Hashable = None,
               namespace: Hashable = None) -> tuple[Node, list[int]]:
        """Record that ``blocks`` hold the KV of ``tokens`` (whole blocks only).

        Returns the node for the whole sequence and the tree's blocks along it: where a chunk
        was already cached, the tree keeps its own block and the caller's copy is a duplicate.
        """
        bs = self.block_size
        if len(tokens) != len(blocks) * bs:
            raise ValueError(f"insert: {len(tokens)} tokens do not fill {len(blocks)} blocks of {bs}")
        now = next(self._clock)
        node, path_blocks, n = self._walk(tokens, self.root(cache_salt, namespace), now)
        if n < len(blocks):
            new_blocks = list(blocks[n:])
            if any(b in self._held for b in new_blocks):
                raise ValueError(f"insert: a block in {new_blocks} is already cached under another prefix")
            child = Node(tuple(tokens[n * bs:]), new_blocks, node)
            child.last_access = now
            node.children[child.key[:bs]] = child
            self._held.update(new_blocks)
            self.evictable_blocks += len(new_blocks)
            node = child
            path_blocks = path_blocks + new_blocks
        return node, path_blocks

    def lock(self, node: Node) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref == 0:
                self.evictable_blocks -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_blocks += len(node.blocks)
            node = node.parent

    def evict(self, n_blocks: int) -> list[int]:
        """Free up to ``n_blocks`` blocks from unlocked leaves, least recently used first.

        A leaf larger than what is still needed loses only its tail blocks.
        """
        freed: list[int] = []
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        while heap and len(freed) < n_blocks:
            _, _, leaf = heapq.heappop(heap)
            take = min(n_blocks - len(freed), len(leaf.blocks))
            self._drop_state(leaf)  # its end goes, trimmed or removed
            if take < len(leaf.blocks):  # trim the tail, keep the rest of the leaf cached
                keep = len(leaf.blocks) - take
                freed.extend(leaf.blocks[keep:])
                leaf.blocks = leaf.blocks[:keep]
                leaf.key = leaf.key[: keep * self.block_size]
                break
            freed.extend(leaf.blocks)
            parent = leaf.parent
            del parent.children[leaf.key[: self.block_size]]
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self._held.difference_update(freed)
        self.evictable_blocks -= len(freed)
        return freed

    def _drop_state(self, node: Node) -> None:
        if node.state is not None:
            slot, node.state = node.state, None
            if self.on_drop_state is not None:
                self.on_drop_state(slot)

    def forget_empty_roots(self) -> None:
        """Drop the roots of other namespaces that hold nothing (left behind by namespace changes)."""
        for key in [k for k, root in self._roots.items() if not root.children and k[0] != self.namespace]:
            del self._roots[key]

    # ---- internals -----------------------------------------------------------------------
    def _walk(self, tokens: Sequence[int], node: Node, now: int) -> tuple[Node, list[int], int]:
        bs = self.block_size
        n_full = len(tokens) // bs
        blocks: list[int] = []
        i = 0  # blocks matched so far
        while i < n_full:
            child = node.children.get(tuple(tokens[i * bs:(i + 1) * bs]))
            if child is None:
                break
            k = 1
            while k < len(child.blocks) and i + k < n_full and \
                    tuple(tokens[(i + k) * bs:(i + k + 1) * bs]) == child.key[k * bs:(k + 1) * bs]:
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
        upper = Node(node.key[: k * bs], node.blocks[:k], node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.parent.children[upper.key[:bs]] = upper
        node.key = node.key[k * bs:]
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
