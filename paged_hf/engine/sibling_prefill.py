"""Two requests admitted in one step with the same next prompt block would compute it twice: the
later one waits a step and takes it from the prefix cache. The blocks a step's prefill chunks
complete, keyed by (namespace, salt, chain hash)."""

from __future__ import annotations

from ..cache.block_manager import BlockManager
from ..requests.request import Request


def blocks_in_flight(kv_manager: BlockManager, chosen: dict[Request, int]) -> set:
    """Keys of the full blocks that this step's prefill chunks complete."""
    if kv_manager.index is None:
        return set()
    bs = kv_manager.block_size
    keys = set()
    for req, n in chosen.items():
        first, last = req.num_computed_tokens // bs + 1, (req.num_computed_tokens + n) // bs
        if n >= 2 and last >= first:
            keys.update(_block_keys(req, bs, last)[first - 1 :])
    return keys


def waits_for_sibling_prefill(kv_manager: BlockManager, req: Request, pending: set) -> bool:
    """Is the next block this request would compute being computed this step by another?"""
    bs = kv_manager.block_size
    end = req.num_computed_tokens + bs
    if not pending or end > kv_manager.hit_limit(req):
        return False
    return _block_keys(req, bs, end // bs)[-1] in pending


def _block_keys(req: Request, block_size: int, n_blocks: int) -> list[tuple]:
    """(namespace, salt, chain hash) of the request's first ``n_blocks`` blocks: each key covers its
    whole prefix."""
    keys, h = [], None
    for b in range(n_blocks):
        h = hash((h, tuple(req.token_ids[b * block_size : (b + 1) * block_size])))
        keys.append((req.cache_namespace, req.cache_salt, h))
    return keys
