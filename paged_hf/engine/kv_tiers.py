"""The tiers under the prefix cache: host memory (``kv_host_cache_bytes``), then a directory that
outlives the process (``kv_cache_dir``), each a ``KVStore`` (paged_hf/cache/kv_store.py). Where the
in-memory prefix index misses, a prompt's next blocks are read from the first tier holding their
record (a disk hit is copied up to host memory). The prompt blocks this engine computes are written
to disk as they are computed, to host memory as the pool evicts them (or as computed:
``kv_host_write="through"``). Keys: paged_hf/cache/stable_keys.py. Models with one full-attention
cache group and no recurrent state only: a record holds pages of KV.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

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


class TierHit:
    """Blocks read from records: a row each, holding one page of every KV tensor in turn;
    ``sources``: (store, blocks) of the rows in order."""

    def __init__(self, rows: torch.Tensor, sources: list[tuple[KVStore, int]]) -> None:
        self.rows = rows
        self.sources = sources

    def __len__(self) -> int:
        return self.rows.shape[0]


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
        self.read_s = 0.0  # reading and checking records at admission
        self.load_s = 0.0  # copying them into pool pages before the step
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

    def _bind(self, req: Request) -> None:
        """At each admission: key ``req``'s blocks under the engine's state now (its adapters), as
        the in-memory index files them under the namespace of the admission."""
        root = salted(self.seed, req.cache_salt)
        if root != req.tier_root:
            req.tier_root, req.tier_keys, req.tier_done, req.tier_held = root, [], 0, None

    def _keys(self, req: Request, n_blocks: int) -> list[bytes]:
        if len(req.tier_keys) < n_blocks:
            tokens = req.prompt_ids[: n_blocks * self.block_size]
            req.tier_keys = chain_keys(req.tier_root, tokens, self.block_size, req.tier_keys)
        return req.tier_keys[:n_blocks]

    def read(self, req: Request, first: int, last: int) -> TierHit | None:
        """Blocks ``first``, ``first + 1``, ... (before ``last``, within the prompt's whole records)
        of ``req`` that some tier holds good records of, read into host memory, up to the first
        miss."""
        self._bind(req)
        p = self.record_blocks
        records_end = min(-(-last // p), req.num_prompt_tokens // self.block_size // p)
        r0 = first // p
        if not self.on or r0 >= records_end or req.parent is not None:
            return None
        if req.tier_held is not None and req.tier_held[0] == (first, last):
            return req.tier_held[1]  # read for an admission that found no room: not read again
        t0 = time.perf_counter()
        keys = self._keys(req, records_end * p)
        kv = self.kv()
        staged = torch.empty(((records_end - r0) * p, page_numel(kv)), dtype=kv[0].dtype)
        sources: list[tuple[KVStore, int]] = []
        for k in range(r0, records_end):
            key = keys[(k + 1) * p - 1]  # a record is named by its last block's key
            rows = staged[(k - r0) * p : (k - r0 + 1) * p]
            tier = self._read_record(key, rows)
            if tier is None:
                break
            used = min(last, (k + 1) * p) - max(first, k * p)
            sources.append((tier, used))
        self.read_s += time.perf_counter() - t0
        end = first + sum(n for _, n in sources)
        if end == first:
            return None
        hit = TierHit(staged[first - r0 * p : end - r0 * p], sources)
        req.tier_held = ((first, last), hit)
        return hit

    def _read_record(self, key: bytes, rows: torch.Tensor) -> KVStore | None:
        """The first store with a good record of ``key``, read into ``rows``; faster stores get a
        copy. None: no store has one."""
        for i, store in enumerate(self.stores):
            if store.get_into(key, rows):
                for upper in self.stores[:i]:
                    upper.put(key, rows)
                return store
        return None

    def load(self, hit: TierHit, pages: list[int]) -> None:
        """Copy read blocks into their pool pages (before the step that reads them): one copy per
        KV tensor for all of them."""
        t0 = time.perf_counter()
        kv = self.kv()
        scatter_pages(kv, pages, by_page(hit.rows, kv))
        for store, n in hit.sources:
            self.hit_blocks[store.name] += n
        self.load_s += time.perf_counter() - t0

    # ---- writes: computed prompt blocks, and pages the pool evicts ----------------------------
    def write(self, req: Request) -> None:
        """Write the whole records of prompt blocks ``req`` holds computed through to every store
        that lacks them (``on_eviction``: watched, written when the pool evicts them)."""
        p = self.record_blocks
        n_full = min(req.num_computed_tokens, req.num_prompt_tokens) // self.block_size
        records_end = n_full // p
        if not self.on or req.parent is not None or records_end * p <= req.tier_done:
            return
        t0 = time.perf_counter()
        keys = self._keys(req, records_end * p)
        table = req.block_tables[0]
        todo = []  # (record, the stores lacking it)
        for k in range(req.tier_done // p, records_end):
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
        req.tier_done = records_end * p
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
        records = [(key, held) for key, held in records if not store.contains(key)]
        if records:
            p = self.record_blocks
            rows = self._gather([page for _, held in records for page in held])
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
    why = (
        "this model keeps recurrent state"
        if state_layout is not None
        else f"this model keeps {len(groups)} cache groups"
        if len(groups) > 1
        else "its KV tensors differ in dtype"
        if len({c.dtype for c in tensors}) > 1
        else None
    )
    if why is not None:
        logger.warning(
            "paged_hf: %s not used: %s, and a record holds pages of full-attention KV only",
            ", ".join(wanted),
            why,
        )
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
