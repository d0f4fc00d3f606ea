"""The tiers under the prefix cache: host memory (``kv_host_cache_bytes``), then a directory that
outlives the process (``kv_cache_dir``), each a ``KVStore`` (paged_hf/cache/kv_store.py). A tier
read has two halves. At admission the scheduler asks ``lookup``: where the in-memory prefix index
misses, which stores hold records of the prompt's next blocks (no record is read). Before the
forward, the step has ``load`` read those records and copy them into the request's new pool pages
(a disk hit is copied up to host memory); a record that turns out bad or gone is computed instead.
The prompt blocks this engine computes are written to disk as they are computed, to host memory
as the pool evicts them (or as computed: ``kv_host_write="through"``). Keys:
paged_hf/cache/stable_keys.py. Models with one full-attention cache group and no recurrent state
only: a record holds pages of KV. The flow, step by step: docs/internals.md.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..cache.coherence import sharded_parameter
from ..cache.disk_kv_store import DiskKVStore
from ..cache.host_kv_store import HostKVStore
from ..cache.kv_store import KVStore
from ..cache.stable_keys import chain_keys, salted, tier_seed, weights_fingerprint
from ..execution.backends.page_copies import by_page, gather_pages, page_numel, scatter_pages
from ..requests.request import Request

logger = logging.getLogger("paged_hf")

# a record holds at least this many tokens' KV: with small blocks (lm-eval's 4) a record per block
# would mean many small files, each read costing its open and checks
RECORD_TOKENS = 16


def record_blocks(block_size: int) -> int:
    return max(1, -(-RECORD_TOKENS // block_size))


@dataclass
class TierMatch:
    """What the tiers hold of a prompt where the prefix cache's hit ends, as a lookup found it
    (nothing read yet): blocks ``span[0]``, ``span[0] + 1``, ... (``len`` of them; ``span``: the
    blocks asked for), from the records ``keys`` names in order, ``used[i]`` blocks of record i
    (the first may start inside its record); ``blocks``: how many each tier holds, by its name."""

    span: tuple[int, int]
    keys: list[bytes] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    blocks: dict[str, int] = field(default_factory=dict)

    @property
    def first(self) -> int:
        return self.span[0]

    def __len__(self) -> int:
        return sum(self.used)


@dataclass
class TierState:
    """A request's part in the tiers (``Request.tier_state``): its chain root under the engine
    state of its last admission, the keys of its prompt blocks so far, how many leading blocks
    every tier holds, and the match found for an admission that has not happened yet (kept: an
    admission that found no room looks up the same span again at its next try)."""

    root: bytes
    keys: list[bytes] = field(default_factory=list)
    done: int = 0
    last_match: TierMatch | None = None  # the lookup kept for the admission that takes it


class KVTiers:
    def __init__(
        self,
        stores: list[KVStore],
        seed: Callable[[object], bytes],
        adapters: object,
        block_size: int,
        kv: Callable[[], list[torch.Tensor]],
        on_eviction: KVStore | None = None,
    ) -> None:
        """``stores``: fastest first; ``seed(adapters)``: the chain root of this engine's weights,
        geometry and namespace under that adapter state; ``kv``: the backend's distinct KV tensors,
        [num_pages, ...] each (looked up at each use: a sleeping engine reallocates them);
        ``on_eviction``: the store that gets a record when the pool evicts its pages (``evicted``,
        the pool's listener), not when they are computed."""
        self.stores = stores
        self._seed_for = seed
        self.seed = seed(adapters)
        self.block_size = block_size
        self.record_blocks = record_blocks(block_size)
        self.kv = kv
        self.off_reason: str | None = None
        self.hit_blocks = dict.fromkeys((s.name for s in stores), 0)
        self.stored_blocks = dict.fromkeys((s.name for s in stores), 0)
        self.read_s = 0.0  # reading and checking records, in the step before its forward
        self.load_s = 0.0  # copying them into pool pages
        self.write_s = 0.0  # copying computed pages out to the tiers
        self.on_eviction = on_eviction
        # records ``on_eviction`` will get when the pool evicts them: by the page of each one's last
        # block, (key, pages); and each watched page's record (a page freed any other way
        # forgets its record: its KV is no longer that record's)
        self._watched: dict[int, tuple[bytes, list[int]]] = {}
        self._record_of: dict[int, int] = {}

    @property
    def on(self) -> bool:
        return self.off_reason is None

    def store(self, name: str) -> KVStore:
        return next(s for s in self.stores if s.name == name)

    def turn_off(self, why: str) -> None:
        """Serve and write nothing more (the weights changed: records of the old ones must not be
        served, and a fingerprint per training step would cost more than it saves)."""
        if self.off_reason is None:
            self.off_reason = why
            self._watched, self._record_of = {}, {}
            logger.warning("paged_hf: the KV cache tiers are off for this engine: %s", why)

    def follow_adapters(self, adapters: object) -> None:
        """Requests admitted from now on key their blocks under this adapter state."""
        self.seed = self._seed_for(adapters)

    def flush(self, timeout: float | None = None) -> None:
        for store in self.stores:
            store.flush(timeout)

    def _bind(self, req: Request) -> TierState:
        """At each admission: key ``req``'s blocks under the engine's state now (its adapters), as
        the in-memory index files them under the namespace of the admission."""
        root = salted(self.seed, req.cache_salt)
        if req.tier_state is None or req.tier_state.root != root:
            req.tier_state = TierState(root)
        return req.tier_state

    def _keys(self, state: TierState, req: Request, n_blocks: int) -> list[bytes]:
        if len(state.keys) < n_blocks:
            tokens = req.prompt_ids[: n_blocks * self.block_size]
            state.keys = chain_keys(state.root, tokens, self.block_size, state.keys)
        return state.keys[:n_blocks]

    # ---- a read: the scheduler's lookup, then the step's load ---------------------------------
    def lookup(self, req: Request, first: int, last: int) -> TierMatch | None:
        """Blocks ``first``, ``first + 1``, ... (before ``last``, within the prompt's whole records)
        of ``req`` that some tier holds records of, up to the first miss; None where none. Reads
        no record (``load`` does, in the step). A match is kept on ``req`` until its admission:
        asked again for the same blocks, it is returned as it is."""
        state = self._bind(req)
        p = self.record_blocks
        records_end = min(-(-last // p), req.num_prompt_tokens // self.block_size // p)
        r0 = first // p
        if not self.on or r0 >= records_end or req.parent is not None:
            return None
        if state.last_match is not None and state.last_match.span == (first, last):
            return state.last_match
        keys = self._keys(state, req, records_end * p)
        match = TierMatch((first, last), blocks=dict.fromkeys(self.hit_blocks, 0))
        for k in range(r0, records_end):
            key = keys[(k + 1) * p - 1]  # a record is named by its last block's key
            store = next((s for s in self.stores if s.contains(key)), None)
            if store is None:
                break
            used = min(last, (k + 1) * p) - max(first, k * p)
            match.keys.append(key)
            match.used.append(used)
            match.blocks[store.name] += used
        if not match.keys:
            return None
        state.last_match = match
        return match

    def load(self, match: TierMatch, pages: list[int]) -> int:
        """Read ``match``'s records (each from the fastest tier with a good one; faster tiers get a
        copy) and copy their blocks into ``pages``, before the step that reads them: one copy per
        KV tensor. Returns the blocks loaded, a leading part of the match: fewer where a record
        turned out bad or gone since the lookup (the rest is to be computed)."""
        t0 = time.perf_counter()
        kv = self.kv()
        p = self.record_blocks
        rows = torch.empty((len(match.keys) * p, page_numel(kv)), dtype=kv[0].dtype)
        sources: list[tuple[KVStore, int]] = []
        for i, key in enumerate(match.keys):
            store = self._read_record(key, rows[i * p : (i + 1) * p])
            if store is None:
                break
            sources.append((store, match.used[i]))
        t1 = time.perf_counter()
        self.read_s += t1 - t0
        n = sum(used for _, used in sources)
        if n:
            skip = match.first % p  # the match's first block, in its record
            scatter_pages(kv, pages[:n], by_page(rows[skip : skip + n], kv))
        for store, used in sources:
            self.hit_blocks[store.name] += used
        self.load_s += time.perf_counter() - t1
        return n

    def _read_record(self, key: bytes, rows: torch.Tensor) -> KVStore | None:
        """The first store with a good record of ``key``, read into ``rows``; faster stores get a
        copy. None: no store has one."""
        for i, store in enumerate(self.stores):
            if store.get_into(key, rows):
                for upper in self.stores[:i]:
                    upper.put(key, rows)
                return store
        return None

    # ---- writes: computed prompt blocks, and pages the pool evicts ----------------------------
    def write(self, req: Request) -> None:
        """Write the whole records of prompt blocks ``req`` holds computed through to every store
        that lacks them (``on_eviction``: watched, written when the pool evicts them)."""
        p, state = self.record_blocks, req.tier_state
        n_full = min(req.num_computed_tokens, req.num_prompt_tokens) // self.block_size
        records_end = n_full // p
        if not self.on or req.parent is not None or state is None or records_end * p <= state.done:
            return
        t0 = time.perf_counter()
        keys = self._keys(state, req, records_end * p)
        table = req.block_tables[0]
        todo = []  # (record, the stores lacking it)
        for k in range(state.done // p, records_end):
            key = keys[(k + 1) * p - 1]
            lacking = [s for s in self.stores if not s.contains(key)]
            if self.on_eviction in lacking:
                lacking.remove(self.on_eviction)
                self._watch(key, table[k * p : (k + 1) * p])
            if lacking:
                todo.append((k, lacking))
        if todo:
            rows = self._gather([table[k * p + j] for k, _ in todo for j in range(p)])
            for i, (k, lacking) in enumerate(todo):
                for store in lacking:  # each record a view of rows, which nobody writes
                    store.put(keys[(k + 1) * p - 1], rows[i * p : (i + 1) * p], owned=True)
                    self.stored_blocks[store.name] += p
        state.done = records_end * p
        self.write_s += time.perf_counter() - t0

    def _gather(self, pages: list[int]) -> torch.Tensor:
        """The pages' KV in host memory, a row per page (every KV tensor's page in turn): gathered
        on the device, then one copy to the host."""
        kv = self.kv()
        rows = torch.empty((len(pages), page_numel(kv)), dtype=kv[0].dtype, device=kv[0].device)
        gather_pages(kv, pages, by_page(rows, kv))
        return rows.to("cpu")

    def _watch(self, key: bytes, pages: list[int]) -> None:
        if pages[-1] not in self._watched:
            self._watched[pages[-1]] = (key, list(pages))
            for page in pages:
                self._record_of[page] = pages[-1]

    def _forget(self, last: int) -> tuple[bytes, list[int]]:
        key, pages = self._watched.pop(last)
        for page in pages:
            self._record_of.pop(page, None)
        return key, pages

    def evicted(self, pages: list[int]) -> None:
        """The pool evicted ``pages`` (their KV still there): the watched records they end go to
        ``on_eviction``. The index evicts leaves first, so a record's last block goes no later
        than its others."""
        records = [self._forget(page) for page in pages if page in self._watched]
        store = self.on_eviction
        if not records or not self.on or store is None:
            return
        t0 = time.perf_counter()
        records = [(key, pages) for key, pages in records if not store.contains(key)]
        if records:
            p = self.record_blocks
            rows = self._gather([page for _, pages in records for page in pages])
            for i, (key, _) in enumerate(records):
                store.put(key, rows[i * p : (i + 1) * p], owned=True)
                self.stored_blocks[store.name] += p
        self.write_s += time.perf_counter() - t0

    def released(self, page: int) -> None:
        """The pool freed ``page``: a record it was part of is no longer watched."""
        last = self._record_of.get(page)
        if last is not None:
            self._forget(last)

    def stats(self, prefill_token_s: float | None) -> dict:
        """Per tier: blocks read from it and written to it, its store's counters; "total": the
        seconds spent against the prefill time the hits saved (``prefill_token_s``: the engine's
        measured prefill cost per token)."""
        bs = self.block_size
        out: dict[str, Any] = {
            store.name: {
                "hit_blocks": self.hit_blocks[store.name],
                "hit_tokens": self.hit_blocks[store.name] * bs,
                "stored_blocks": self.stored_blocks[store.name],
                **store.stats(),
            }
            for store in self.stores
        }
        tokens = sum(self.hit_blocks.values()) * bs
        out["total"] = {
            "on": self.on,
            "off_reason": self.off_reason,
            "hit_tokens": tokens,
            "read_s": self.read_s,
            "load_s": self.load_s,
            "write_s": self.write_s,
            "recompute_saved_s": None if prefill_token_s is None else tokens * prefill_token_s,
        }
        return out


def make_kv_tiers(
    config: Any,
    model: torch.nn.Module,
    groups: list,
    state_layout: Any,
    kv: Callable[[], list[torch.Tensor]],
    cache_key: tuple,
) -> KVTiers | None:
    """The engine's tiers when ``config.kv_host_cache_bytes`` or ``config.kv_cache_dir`` is set and
    the model's KV can go there whole (else None, with a warning saying why). ``kv``: the backend's
    distinct KV tensors now (its ``distinct_kv``); ``cache_key``: (namespace, generation,
    adapters), the in-memory prefix cache's; the generation is replaced by the weights'
    fingerprint."""
    wanted = [
        f"{name}={getattr(config, name)!r}"
        for name in ("kv_host_cache_bytes", "kv_cache_dir")
        if getattr(config, name) is not None
    ]
    if not wanted:
        return None
    tensors = kv()
    why = _why_not_whole(model, groups, state_layout, tensors)
    if why is not None:
        logger.warning("paged_hf: %s not used: %s", ", ".join(wanted), why)
        return None
    t0 = time.perf_counter()
    fingerprint = weights_fingerprint(model)
    geometry = {
        "block_size": config.block_size,
        "record_blocks": record_blocks(config.block_size),
        "pages": [[list(c.shape[1:]), str(c.dtype)] for c in tensors],
        "groups": [repr(g) for g in groups],
        "device": tensors[0].device.type if tensors else "none",
    }
    namespace, _, adapters = cache_key
    stores, on_eviction = _stores(config, pin=bool(tensors) and tensors[0].device.type == "cuda")
    logger.info(
        "paged_hf: KV cache tiers %s (weights fingerprinted in %.2f s)",
        ", ".join(wanted),
        time.perf_counter() - t0,
    )
    return KVTiers(
        stores,
        lambda adapters: tier_seed(fingerprint, geometry, adapters, namespace),
        adapters,
        config.block_size,
        kv,
        on_eviction,
    )


def _why_not_whole(
    model: torch.nn.Module, groups: list, state_layout: Any, tensors: list[torch.Tensor]
) -> str | None:
    """Why a record cannot hold this model's KV, or None where it can."""
    sharded = sharded_parameter(model)
    if sharded is not None:
        # a rank's KV depends on every rank's shards, and its store would have to hold the records
        # the others hold: neither is there yet
        return (
            f"the model is tensor parallel ({sharded} is a DTensor), and tiers serve one process's "
            "whole model only"
        )
    why = (
        "this model keeps recurrent state"
        if state_layout is not None
        else f"this model keeps {len(groups)} cache groups"
        if len(groups) > 1
        else "its KV tensors differ in dtype"
        if len({c.dtype for c in tensors}) > 1
        else None
    )
    return None if why is None else f"{why}, and a record holds pages of full-attention KV only"


def _stores(config: Any, pin: bool) -> tuple[list[KVStore], KVStore | None]:
    """The stores ``config`` asks for, fastest first, and the one written as the pool evicts pages
    (host memory, unless ``kv_host_write="through"``); ``pin``: host memory pinned (CUDA)."""
    stores: list[KVStore] = []
    host = None
    if config.kv_host_cache_bytes is not None:
        host = HostKVStore(config.kv_host_cache_bytes, pin=pin)
        stores.append(host)
    if config.kv_cache_dir is not None:
        stores.append(DiskKVStore(config.kv_cache_dir, config.kv_cache_dir_bytes))
    return stores, host if config.kv_host_write == "eviction" else None
