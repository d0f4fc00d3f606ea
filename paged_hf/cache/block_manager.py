"""Block tables of requests: prefix hits at admission, slots for new tokens, caching full
blocks, copy-on-write for shared partial blocks, and release.

The pool counts references; the prefix index knows which blocks hold which prefix; this
file keeps each request's block table consistent with both. It never touches tensors: a
copy-on-write returns the (src, dst) block pairs the backend must copy before the step.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from ..requests.request import Request
from .block_pool import BlockPool
from .kv_groups import FULL, CacheGroup, most_blocks
from .prefix_index import Node, RadixPrefixIndex
from .state_slots import StateSlots


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        namespace: Hashable = "",
        state_slots: StateSlots | None = None,
        checkpoint_interval: int | None = None,
        groups: Sequence[CacheGroup] = (FULL,),
        step_tokens: int | None = None,
    ) -> None:
        """``state_slots``: a hybrid model's state slots; a request takes one with its first blocks
        and gives it back with them. With prefix caching, a prompt's state is checkpointed every
        ``checkpoint_interval`` tokens (a block multiple) and at its last full block, and a prefix
        hit is served only up to the deepest checkpoint on its path.

        ``groups``: the cache groups (paged_hf/cache/kv_groups.py); each request holds a table per
        group over the one pool of pages, and a sliding or chunked group's pages go back to the pool
        as they fall out of reach. ``step_tokens``: the most tokens a step computes for a request
        (what a sliding group holds at most while a chunk is written)."""
        self.block_size = block_size
        self.groups = tuple(groups)
        self.step_tokens = step_tokens or block_size
        self.state = state_slots
        on_drop = state_slots.dropped if state_slots is not None else None
        self.index = (
            RadixPrefixIndex(block_size, namespace, on_drop, self.groups)
            if enable_prefix_caching
            else None
        )
        self.pool = BlockPool(num_blocks, block_size, self.index)
        self.state_copies: list[
            tuple[int, int]
        ] = []  # (src, dst) slots to copy before the next step
        self.checkpoints = (
            self.index is not None and state_slots is not None and state_slots.num_checkpoints > 0
        )
        interval = checkpoint_interval or block_size
        self.checkpoint_interval = max(block_size, interval // block_size * block_size)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def most_blocks(self, num_tokens: int) -> int:
        """The most pages a request of ``num_tokens`` holds at once, over every group."""
        return most_blocks(self.groups, num_tokens, self.step_tokens, self.block_size)

    # ---- admission -----------------------------------------------------------------------
    def admit(self, req: Request) -> int:
        """Take the cached prefix of a request that holds no blocks; return its token count.

        At least one token is always left to compute: its logits give the next sample; and no
        position whose logits are still to be scored is served (``hit_limit``). A sliding group
        needs only the pages of the last window before the hit point (a chunked one, those of its
        chunk), and a hybrid a state checkpoint at exactly that point.
        """
        assert not req.block_tables and req.num_computed_tokens == 0, req.request_id
        if self.index is None:
            return 0
        req.cache_namespace = self.index.namespace  # the KV it computes from now on belongs there
        tokens = req.token_ids[: self.hit_limit(req)]
        node, blocks = self.index.match_prefix(tokens, req.cache_salt)
        if not blocks:
            return 0
        tables = self.index.path_tables(node) if len(self.groups) > 1 else [blocks]
        n = self._servable(node, tables)
        if n == 0:
            return 0
        if n < len(blocks):  # the node ending at the hit point (the walk splits an edge there)
            node, blocks = self.index.match_prefix(tokens[: n * self.block_size], req.cache_salt)
        tables = [self._reach(g, t[:n], n * self.block_size) for g, t in zip(self.groups, tables)]
        if self.state is not None:
            self.state.hit(node.state)
            self.state_copies.append((node.state, self.state.take(req)))
        self.pool.incref([b for t in tables for b in t if b >= 0])
        self.index.lock(node)
        req.prefix_node = node
        req.block_tables = tables
        req.kv_released = [
            g.first_needed_block(n * self.block_size, self.block_size) for g in self.groups
        ]
        req.num_tree_blocks = n
        req.num_computed_tokens = n * self.block_size
        return req.num_computed_tokens

    def hit_limit(self, req: Request) -> int:
        """How many leading tokens a prefix hit may serve: ``Request.prefix_limit``, and on a hybrid
        two tokens short of the end, so that what is left is never a lone token, which would go through
        the mixers' one-token path (see ``plan_checkpoints``)."""
        return req.prefix_limit if self.state is None else min(req.prefix_limit, req.num_tokens - 2)

    def _servable(self, node: Node, tables: list[list[int]]) -> int:
        """The most blocks of the matched path a hit may resume after: every group holds what the
        next query reads there, and (hybrids) a state checkpoint ends there."""
        bs = self.block_size
        if self.state is not None:
            ends = []
            while not node.is_root:
                if node.state is not None:
                    ends.append(node.num_blocks_from_root)
                node = node.parent
        else:
            ends = range(len(tables[0]), 0, -1)
        for n in ends:
            if all(
                g.is_full or all(b >= 0 for b in t[g.first_needed_block(n * bs, bs) : n])
                for g, t in zip(self.groups, tables)
            ):
                return n
        return 0

    def _reach(self, group: CacheGroup, table: list[int], num_tokens: int) -> list[int]:
        """``table`` with -1 for the blocks no query from ``num_tokens`` on reads."""
        first = group.first_needed_block(num_tokens, self.block_size)
        return [-1] * first + table[first:] if first else list(table)

    # ---- slots for the next step ---------------------------------------------------------
    def blocks_needed(self, req: Request, n_new: int) -> int:
        bs, nc = self.block_size, req.num_computed_tokens
        total = blocks_for(nc + n_new, bs)
        need = 0
        for g, group in enumerate(self.groups):
            have = len(req.block_tables[g]) if req.block_tables else 0
            need += max(0, total - max(have, group.first_needed_block(nc, bs)))
            if n_new > 0 and self._shared_tail(req, g) is not None:
                need += 1
        return need

    def allocate_slots(self, req: Request, n_new: int, copies: list[tuple[int, int]]) -> bool:
        """Make room for ``n_new`` more tokens of KV; False (and no change) if the pool is short.

        A partially filled block that others share is copied first (copy-on-write); the
        (src, dst) pair is appended to ``copies``. A sliding group's blocks that no query from
        here on reads are not allocated (-1).
        """
        need = self.blocks_needed(req, n_new)
        if need > self.pool.num_available:
            return False
        if self.state is not None:
            self.state.take(req)
        if not req.block_tables:
            req.block_tables = [[] for _ in self.groups]
            req.kv_released = [0] * len(self.groups)
        fresh = iter(self.pool.allocate(need))
        bs, nc = self.block_size, req.num_computed_tokens
        total = blocks_for(nc + n_new, bs)
        for g, (group, table) in enumerate(zip(self.groups, req.block_tables)):
            shared = self._shared_tail(req, g) if n_new > 0 else None
            if shared is not None:
                dst = next(fresh)
                copies.append((table[shared], dst))
                self.pool.decref([table[shared]])
                table[shared] = dst
            first = group.first_needed_block(nc, bs)
            if len(table) < first:
                table.extend([-1] * (first - len(table)))
                req.kv_released[g] = max(req.kv_released[g], first)
            table.extend(next(fresh) for _ in range(total - len(table)))
        return True

    def _shared_tail(self, req: Request, g: int = 0) -> int | None:
        """Index of the partially filled block of group ``g`` the next token is written to, if others
        hold it."""
        if not req.block_tables:
            return None
        table, idx = req.block_tables[g], req.num_computed_tokens // self.block_size
        if (
            req.num_computed_tokens % self.block_size
            and idx < len(table)
            and table[idx] >= 0
            and self.pool.refcount[table[idx]] > 1
        ):
            return idx
        return None

    def release_out_of_reach(self, req: Request) -> int:
        """Give back the sliding and chunked groups' blocks no later query of ``req`` reads (a block
        the prefix index holds stays cached, evictable by itself); returns how many."""
        n = 0
        for g, group in enumerate(self.groups):
            if group.is_full or not req.block_tables:
                continue
            table = req.block_tables[g]
            first = min(
                group.first_needed_block(req.num_computed_tokens, self.block_size), len(table)
            )
            gone = []
            for i in range(req.kv_released[g], first):
                if table[i] >= 0:
                    gone.append(table[i])
                    table[i] = -1
            req.kv_released[g] = max(req.kv_released[g], first)
            self.pool.decref(gone)
            n += len(gone)
        return n

    def live_pages(self, req: Request, num_tokens: int) -> list[int]:
        """Every group's pages of the first ``num_tokens`` tokens that some later query reads, group
        after group (what swap preemption copies out, and back in, in the same order)."""
        bs, out = self.block_size, []
        for group, table in zip(self.groups, req.block_tables):
            part = table[group.first_needed_block(num_tokens, bs) : blocks_for(num_tokens, bs)]
            assert all(b >= 0 for b in part), f"request {req.request_id}: a needed block was freed"
            out.extend(part)
        return out

    def unfilled_slots(self, req: Request) -> int:
        """Token slots ``req`` holds beyond what some later query reads, over every group (every step:
        a table holds a page at each position from its ``kv_released`` on, and none before it)."""
        if not req.block_tables:
            return 0
        held = sum(len(t) - r for t, r in zip(req.block_tables, req.kv_released)) * self.block_size
        return held - sum(g.tokens_needed(req.num_computed_tokens) for g in self.groups)

    def plan_checkpoints(self, req: Request, n_new: int, whole_chunks_only: bool) -> None:
        """The state snapshots the step computing ``n_new`` tokens of ``req`` takes: at multiples of
        ``checkpoint_interval`` and at the last full block the prefix cache could ever serve it
        (``hit_limit``: a repeat of this prompt, the choices of one scoring context), where no
        checkpoint is yet. ``whole_chunks_only``: only at the chunk's end (mixers that drop their
        state in a chunk cannot be split inside one). Otherwise no snapshot cuts a lone token off the
        chunk, after its first: that token would go through the mixers' one-token (decode) path, not
        the chunk path ``generate`` runs a prompt through, and some mixers' two paths part (Zamba2's
        Mamba2 clamps its time step in its chunk scan, not in its decode step)."""
        if not self.checkpoints or req.parent is not None:
            return
        bs, start = self.block_size, req.num_computed_tokens
        last = self.hit_limit(req) // bs * bs
        end = min(start + n_new, last)
        points = [
            p
            for p in range(start // bs * bs + bs, end + 1, bs)
            if p > start and (p % self.checkpoint_interval == 0 or p == last)
        ]
        if whole_chunks_only:
            points = [p for p in points if p == start + n_new]
        else:
            cuts: list[int] = []
            for p in points:
                if start + n_new - p != 1 and not (
                    p - (cuts[-1] if cuts else start) == 1 and p > 1
                ):
                    cuts.append(p)
            points = cuts
        for p in points:
            slot = self.state.take_checkpoint()
            if slot is None:
                break
            req.pending_checkpoints.append((p, slot))

    # ---- after a step ----------------------------------------------------------------------
    def cache_full_blocks(self, req: Request) -> None:
        """Offer the request's newly completed blocks to the prefix index, and attach the state
        snapshots its step took to the nodes that end where they were taken; then give back what
        slid out of reach.

        Where another request cached the same chunk first, switch to the tree's block and let
        ours go: the KV is the same.
        """
        if self.index is None:
            self.release_out_of_reach(req)
            return
        n_full = req.num_computed_tokens // self.block_size
        if n_full > req.num_tree_blocks:
            # under the namespace it was admitted with: KV computed before a weight update never
            # joins the tree that requests admitted after it read
            tables = req.block_tables
            node, tree_blocks = self.index.insert(
                req.token_ids[: n_full * self.block_size],
                tables[0][:n_full],
                req.cache_salt,
                req.cache_namespace,
                [t[:n_full] for t in tables[1:]],
            )
            self.index.lock(node)
            if req.prefix_node is not None:
                self.index.unlock(req.prefix_node)
            req.prefix_node = node
            tree = self.index.path_tables(node) if len(self.groups) > 1 else [tree_blocks]
            for table, theirs in zip(tables, tree):
                for j in range(req.num_tree_blocks, n_full):
                    mine = table[j]
                    if mine >= 0 and theirs[j] >= 0 and mine != theirs[j]:
                        self.pool.incref([theirs[j]])
                        self.pool.decref([mine])
                        table[j] = theirs[j]
            req.num_tree_blocks = n_full
        if req.pending_checkpoints:
            self._attach_checkpoints(req)
        self.release_out_of_reach(req)

    def _attach_checkpoints(self, req: Request) -> None:
        """Each snapshot the step took goes to the node ending at its position (the walk splits an
        edge there if need be; the blocks are in the tree already)."""
        done = [(p, s) for p, s in req.pending_checkpoints if p <= req.num_computed_tokens]
        if not done:
            return
        req.pending_checkpoints = [
            (p, s) for p, s in req.pending_checkpoints if p > req.num_computed_tokens
        ]
        bs = self.block_size
        for p, slot in done:
            tables = [t[: p // bs] for t in req.block_tables]
            node, _ = self.index.insert(
                req.token_ids[:p], tables[0], req.cache_salt, req.cache_namespace, tables[1:]
            )
            self.state.attach(slot, node)

    def free(self, req: Request) -> None:
        """Release everything the request holds (finish, abort or preemption), the tail first: the
        prefix cache then evicts a chain from its end."""
        if req.prefix_node is not None:
            self.index.unlock(req.prefix_node)
            req.prefix_node = None
        tables = req.block_tables
        longest = max((len(t) for t in tables), default=0)
        self.pool.decref(
            [t[i] for i in range(longest - 1, -1, -1) for t in tables if i < len(t) and t[i] >= 0]
        )
        req.block_tables = []
        req.kv_released = []
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
        assert not child.block_tables
        child.cache_namespace = parent.cache_namespace
        self.pool.incref([b for t in parent.block_tables for b in t if b >= 0])
        child.block_tables = [list(t) for t in parent.block_tables]
        child.kv_released = list(parent.kv_released)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_tree_blocks = parent.num_tree_blocks
        if parent.prefix_node is not None:
            self.index.lock(parent.prefix_node)
            child.prefix_node = parent.prefix_node
        if self.state is not None:  # the sample continues from its parent's state
            self.state_copies.append((parent.state_slot, self.state.take(child)))

    def reassign(self, pairs: list[tuple[Request, Request]]) -> None:
        """Beam search: each ``(beam, parent)`` pair's beam gives back its blocks and takes its parent's,
        as the parents hold them now, by reference (a shared partial block is copied on write)."""
        held = [
            (
                [list(t) for t in p.block_tables],
                list(p.kv_released),
                p.num_computed_tokens,
                p.num_tree_blocks,
                p.prefix_node,
                p.cache_namespace,
            )
            for _, p in pairs
        ]
        # the parents' references first: a beam may be another's parent
        for (
            tables,
            _,
            _,
            _,
            node,
            _,
        ) in held:
            self.pool.incref([b for t in tables for b in t if b >= 0])
            if node is not None:
                self.index.lock(node)
        for beam, _ in pairs:
            self.free(beam)
        for (beam, _), (tables, released, computed, tree, node, namespace) in zip(pairs, held):
            beam.block_tables, beam.kv_released, beam.num_computed_tokens = (
                tables,
                released,
                computed,
            )
            beam.num_tree_blocks, beam.prefix_node, beam.cache_namespace = tree, node, namespace

    def take_state_copies(self) -> list[tuple[int, int]]:
        copies, self.state_copies = self.state_copies, []
        return copies
