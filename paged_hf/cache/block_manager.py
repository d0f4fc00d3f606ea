"""Block tables of requests: prefix hits at admission, slots for new tokens, caching full
blocks, copy-on-write for shared partial blocks, and release.

The pool counts references; the prefix index knows which blocks hold which prefix; this
file keeps each request's block table consistent with both. It never touches tensors: a
copy-on-write returns the (src, dst) block pairs the backend must copy before the step.
"""
from __future__ import annotations

from typing import Hashable

from ..requests.request import Request
from .block_pool import BlockPool
from .prefix_index import RadixPrefixIndex
from .state_slots import StateSlots


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 namespace: Hashable = "", state_slots: StateSlots | None = None,
                 checkpoint_interval: int | None = None) -> None:
        """``state_slots``: a hybrid model's state slots; a request takes one with its first blocks
        and gives it back with them. With prefix caching, a prompt's state is checkpointed every
        ``checkpoint_interval`` tokens (a block multiple) and at its last full block, and a prefix
        hit is served only up to the deepest checkpoint on its path."""
        self.block_size = block_size
        self.state = state_slots
        on_drop = state_slots.dropped if state_slots is not None else None
        self.index = RadixPrefixIndex(block_size, namespace, on_drop) if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, block_size, self.index)
        self.state_copies: list[tuple[int, int]] = []  # (src, dst) slots to copy before the next step
        self.checkpoints = self.index is not None and state_slots is not None and state_slots.num_checkpoints > 0
        interval = checkpoint_interval or block_size
        self.checkpoint_interval = max(block_size, interval // block_size * block_size)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # ---- admission -----------------------------------------------------------------------
    def admit(self, req: Request) -> int:
        """Take the cached prefix of a request that holds no blocks; return its token count.

        At least one token is always left to compute: its logits give the next sample; and no
        position whose logits are still to be scored is served (``Request.prefix_limit``).
        """
        assert not req.block_table and req.num_computed_tokens == 0, req.request_id
        if self.index is None:
            return 0
        req.cache_namespace = self.index.namespace  # the KV it computes from now on belongs there
        node, blocks = self.index.match_prefix(req.token_ids[: req.prefix_limit], req.cache_salt)
        if blocks and self.state is not None:  # hybrids: only as far as a checkpointed state reaches
            while not node.is_root and node.state is None:
                node = node.parent
            blocks = [] if node.is_root else blocks[: node.num_blocks_from_root]
            if blocks:
                self.state.hit(node.state)
                self.state_copies.append((node.state, self.state.take(req)))
        if blocks:
            self.pool.incref(blocks)
            self.index.lock(node)
            req.prefix_node = node
            req.block_table = list(blocks)
            req.num_tree_blocks = len(blocks)
            req.num_computed_tokens = len(blocks) * self.block_size
        return req.num_computed_tokens

    # ---- slots for the next step ---------------------------------------------------------
    def blocks_needed(self, req: Request, n_new: int) -> int:
        total = blocks_for(req.num_computed_tokens + n_new, self.block_size)
        need = max(0, total - len(req.block_table))
        if self._shared_tail(req) is not None and n_new > 0:
            need += 1
        return need

    def allocate_slots(self, req: Request, n_new: int, copies: list[tuple[int, int]]) -> bool:
        """Make room for ``n_new`` more tokens of KV; False (and no change) if the pool is short.

        A partially filled block that others share is copied first (copy-on-write); the
        (src, dst) pair is appended to ``copies``.
        """
        need = self.blocks_needed(req, n_new)
        if need > self.pool.num_available:
            return False
        if self.state is not None:
            self.state.take(req)
        if need == 0:
            return True
        fresh = self.pool.allocate(need)
        shared = self._shared_tail(req) if n_new > 0 else None
        if shared is not None:
            dst = fresh.pop()
            copies.append((req.block_table[shared], dst))
            self.pool.decref([req.block_table[shared]])
            req.block_table[shared] = dst
        req.block_table.extend(fresh)
        return True

    def _shared_tail(self, req: Request) -> int | None:
        """Index of the partially filled block the next token is written to, if others hold it."""
        idx = req.num_computed_tokens // self.block_size
        if req.num_computed_tokens % self.block_size and idx < len(req.block_table) \
                and self.pool.refcount[req.block_table[idx]] > 1:
            return idx
        return None

    def plan_checkpoints(self, req: Request, n_new: int, whole_chunks_only: bool) -> None:
        """The state snapshots the step computing ``n_new`` tokens of ``req`` takes: at multiples of
        ``checkpoint_interval`` and at the last full block the prefix cache could ever serve it
        (``prefix_limit``: a repeat of this prompt, the choices of one scoring context), where no
        checkpoint is yet. ``whole_chunks_only``: only at the chunk's end (mixers that drop their
        state in a chunk cannot be split inside one)."""
        if not self.checkpoints or req.parent is not None:
            return
        bs, start = self.block_size, req.num_computed_tokens
        last = req.prefix_limit // bs * bs
        end = min(start + n_new, last)
        points = [p for p in range(start // bs * bs + bs, end + 1, bs)
                  if p > start and (p % self.checkpoint_interval == 0 or p == last)]
        if whole_chunks_only:
            points = [p for p in points if p == start + n_new]
        for p in points:
            slot = self.state.take_checkpoint()
            if slot is None:
                break
            req.pending_checkpoints.append((p, slot))

    # ---- after a step ----------------------------------------------------------------------
    def cache_full_blocks(self, req: Request) -> None:
        """Offer the request's newly completed blocks to the prefix index, and attach the state
        snapshots its step took to the nodes that end where they were taken.

        Where another request cached the same chunk first, switch to the tree's block and let
        ours go: the KV is the same.
        """
        if self.index is None:
            return
        n_full = req.num_computed_tokens // self.block_size
        if n_full > req.num_tree_blocks:
            # under the namespace it was admitted with: KV computed before a weight update never
            # joins the tree that requests admitted after it read
            node, tree_blocks = self.index.insert(req.token_ids[: n_full * self.block_size],
                                                  req.block_table[:n_full], req.cache_salt, req.cache_namespace)
            self.index.lock(node)
            if req.prefix_node is not None:
                self.index.unlock(req.prefix_node)
            req.prefix_node = node
            for j in range(req.num_tree_blocks, n_full):
                mine, theirs = req.block_table[j], tree_blocks[j]
                if mine != theirs:
                    self.pool.incref([theirs])
                    self.pool.decref([mine])
                    req.block_table[j] = theirs
            req.num_tree_blocks = n_full
        if req.pending_checkpoints:
            self._attach_checkpoints(req)

    def _attach_checkpoints(self, req: Request) -> None:
        """Each snapshot the step took goes to the node ending at its position (the walk splits an
        edge there if need be; the blocks are in the tree already)."""
        done = [(p, s) for p, s in req.pending_checkpoints if p <= req.num_computed_tokens]
        if not done:
            return
        req.pending_checkpoints = [(p, s) for p, s in req.pending_checkpoints if p > req.num_computed_tokens]
        bs = self.block_size
        for p, slot in done:
            node, _ = self.index.insert(req.token_ids[:p], req.block_table[: p // bs], req.cache_salt,
                                        req.cache_namespace)
            self.state.attach(slot, node)

    def free(self, req: Request) -> None:
        """Release everything the request holds (finish, abort or preemption)."""
        if req.prefix_node is not None:
            self.index.unlock(req.prefix_node)
            req.prefix_node = None
        self.pool.decref(req.block_table)
        req.block_table = []
        req.num_tree_blocks = 0
        req.num_computed_tokens = 0
        if self.state is not None:
            self.state.give_back(req)

    def reset_prefix_cache(self, namespace: Hashable) -> int:
        """Serve no cached block from now on: requests admitted later look up and insert under
        ``namespace`` only; cached blocks nobody uses are freed now (how many is returned), the
        ones running requests use are freed by eviction once those finish."""
        if self.index is None:
            return 0
        self.index.namespace = namespace
        dropped = self.pool.drop_cached()
        self.index.forget_empty_roots()
        return dropped

    def switch_namespace(self, namespace: Hashable) -> None:
        """Requests admitted from now on look up and insert under ``namespace``; blocks cached
        under others stay (a switch back finds them) until eviction needs their room."""
        if self.index is not None:
            self.index.namespace = namespace

    def fork(self, parent: Request, child: Request) -> None:
        """Let ``child`` share every block of ``parent`` (parallel sampling)."""
        assert not child.block_table
        child.cache_namespace = parent.cache_namespace
        self.pool.incref(parent.block_table)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_tree_blocks = parent.num_tree_blocks
        if parent.prefix_node is not None:
            self.index.lock(parent.prefix_node)
            child.prefix_node = parent.prefix_node
        if self.state is not None:  # the sample continues from its parent's state
            self.state_copies.append((parent.state_slot, self.state.take(child)))

    def take_state_copies(self) -> list[tuple[int, int]]:
        copies, self.state_copies = self.state_copies, []
        return copies
