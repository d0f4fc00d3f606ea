"""The disk tier under the prefix cache: where the in-memory prefix index misses, a prompt's next
blocks are read from records other processes (or this one, earlier) wrote, and the prompt blocks
this engine computes are written there. Keys: paged_hf/cache/stable_keys.py; records:
paged_hf/cache/disk_kv_store.py. Models with one full-attention cache group and no recurrent state
only: a record holds a page of KV, nothing else.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..cache.disk_kv_store import DiskKVStore
from ..cache.stable_keys import chain_keys, salted, tier_seed, weights_fingerprint
from ..execution.backends.swap import SwapHandle, host_parts, swap_in
from ..requests.request import Request

logger = logging.getLogger("paged_hf")


class DiskTier:
    def __init__(
        self,
        store: DiskKVStore,
        seed: Callable[[object], bytes],
        adapters: object,
        block_size: int,
        kv: Callable[[], list[torch.Tensor]],
    ) -> None:
        """``seed(adapters)``: the chain root of this engine's weights, geometry and namespace under
        that adapter state; ``kv``: the backend's distinct KV tensors, [num_pages, ...] each (looked
        up at each use: a sleeping engine reallocates them)."""
        self.store = store
        self._seed_for = seed
        self.seed = seed(adapters)
        self.block_size = block_size
        self.kv = kv
        self.off_reason: str | None = None
        self.hit_blocks = 0
        self.stored_blocks = 0
        self.read_s = 0.0  # reading and checking records at admission
        self.load_s = 0.0  # copying them into pool pages before the step
        self.write_s = 0.0  # copying computed pages out for the writer

    @property
    def on(self) -> bool:
        return self.off_reason is None

    def turn_off(self, why: str) -> None:
        """Serve and write nothing more (the weights changed: records of the old ones must not be
        served, and a fingerprint per training step would cost more than it saves)."""
        if self.off_reason is None:
            self.off_reason = why
            logger.warning("paged_hf: the disk KV tier is off for this engine: %s", why)

    def follow_adapters(self, adapters: object) -> None:
        """Requests admitted from now on key their blocks under this adapter state."""
        self.seed = self._seed_for(adapters)

    def _keys(self, req: Request, n_blocks: int) -> list[bytes]:
        if req.tier_root is None:
            req.tier_root = salted(self.seed, req.cache_salt)
        if len(req.tier_keys) < n_blocks:
            tokens = req.prompt_ids[: n_blocks * self.block_size]
            req.tier_keys = chain_keys(req.tier_root, tokens, self.block_size, req.tier_keys)
        return req.tier_keys[:n_blocks]

    def read(self, req: Request, first: int, last: int) -> list[SwapHandle]:
        """Blocks ``first``, ``first + 1``, ... (before ``last``, within the prompt) of ``req`` that
        have good records, read into host buffers, up to the first miss."""
        last = min(last, req.num_prompt_tokens // self.block_size)
        if not self.on or first >= last or req.parent is not None:
            return []
        t0 = time.perf_counter()
        keys = self._keys(req, last)
        kv = self.kv()
        out = []
        for key in keys[first:last]:
            if not self.store.contains(key):
                break
            data, parts = host_parts(kv, 1, pin=False)
            if not self.store.get_into(key, data):
                break
            out.append(SwapHandle(data, parts, 1))
        self.read_s += time.perf_counter() - t0
        return out

    def load(self, handles: list[SwapHandle], pages: list[int]) -> None:
        """Copy read blocks into their pool pages (before the step that reads them)."""
        t0 = time.perf_counter()
        kv = self.kv()
        for handle, page in zip(handles, pages):
            swap_in(kv, handle, [page])
        self.hit_blocks += len(handles)
        self.load_s += time.perf_counter() - t0

    def write(self, req: Request) -> None:
        """Queue the prompt blocks ``req`` holds computed and not yet on disk for the writer."""
        n_full = min(req.num_computed_tokens, req.num_prompt_tokens) // self.block_size
        if not self.on or req.parent is not None or n_full <= req.tier_done:
            return
        t0 = time.perf_counter()
        keys = self._keys(req, n_full)
        kv = self.kv()
        for j in range(req.tier_done, n_full):
            if not self.store.contains(keys[j]):
                page = req.block_tables[0][j]
                payload = torch.cat([c[page].reshape(-1) for c in kv]).to("cpu")
                self.store.put(keys[j], payload)
                self.stored_blocks += 1
        req.tier_done = n_full
        self.write_s += time.perf_counter() - t0

    def stats(self, prefill_token_s: float | None) -> dict:
        """Hits, bytes and time; ``prefill_token_s``: the engine's measured prefill cost per token,
        for the compute the hits saved."""
        tokens = self.hit_blocks * self.block_size
        return {
            "on": self.on,
            "off_reason": self.off_reason,
            "hit_blocks": self.hit_blocks,
            "hit_tokens": tokens,
            "stored_blocks": self.stored_blocks,
            "read_s": self.read_s,
            "load_s": self.load_s,
            "write_s": self.write_s,
            "recompute_saved_s": None if prefill_token_s is None else tokens * prefill_token_s,
            **self.store.stats(),
        }


def make_disk_tier(config, model, groups, state_layout, backend, cache_key) -> DiskTier | None:
    """The engine's disk tier when ``config.kv_cache_dir`` is set and the model's KV can go there
    whole (else None, with a warning saying why). ``cache_key``: (namespace, generation, adapters),
    the in-memory prefix cache's; the generation is replaced by the weights' fingerprint."""
    if config.kv_cache_dir is None:
        return None
    if state_layout is not None or len(groups) > 1:
        logger.warning(
            "paged_hf: kv_cache_dir=%r is not used: this model keeps %s, and a record holds one "
            "page of full-attention KV only",
            config.kv_cache_dir,
            "recurrent state" if state_layout is not None else f"{len(groups)} cache groups",
        )
        return None
    t0 = time.perf_counter()
    fingerprint = weights_fingerprint(model)
    kv = backend._distinct_kv
    geometry = {
        "block_size": config.block_size,
        "pages": [[list(c.shape[1:]), str(c.dtype)] for c in kv],
        "groups": [repr(g) for g in groups],
        "device": kv[0].device.type if kv else "none",
    }
    namespace, _, adapters = cache_key
    store = DiskKVStore(config.kv_cache_dir, config.kv_cache_dir_bytes)
    logger.info(
        "paged_hf: disk KV tier at %s (weights fingerprinted in %.2f s)",
        config.kv_cache_dir,
        time.perf_counter() - t0,
    )
    return DiskTier(
        store,
        lambda adapters: tier_seed(fingerprint, geometry, adapters, namespace),
        adapters,
        config.block_size,
        lambda: backend._distinct_kv,
    )
