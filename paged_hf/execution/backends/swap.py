"""Swap preemption, the data-movement half: copy a request's KV blocks to host memory and back.

Design notes: docs/internals.md, paged_hf/execution/backends/swap.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .page_copies import by_tensor, gather_pages, page_numel, scatter_pages


@dataclass
class SwapHandle:
    """A request's KV on the host: ``data``, one flat buffer; ``parts[i]``, tensor i's contiguous
    piece of it, [num_blocks, *the rest of that tensor's shape]."""

    data: torch.Tensor
    parts: list[torch.Tensor]
    num_blocks: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def swap_out(kv: list[torch.Tensor], block_ids: list[int]) -> SwapHandle:
    """Copy blocks ``block_ids`` of every layer to (pinned, on CUDA) host memory."""
    if not kv:
        raise ValueError("swap_out: the backend has no KV layers")
    cache = kv[0]
    device = cache.device
    n = len(block_ids)
    if n and not 0 <= min(block_ids) <= max(block_ids) < cache.shape[0]:
        raise ValueError(f"swap_out: block ids {block_ids} outside [0, {cache.shape[0]})")
    pin = device.type == "cuda"
    data = torch.empty(n * page_numel(kv), dtype=cache.dtype, pin_memory=pin)
    parts = by_tensor(data, kv, n)
    if n:
        gather_pages(kv, block_ids, parts, non_blocking=pin)
    return SwapHandle(data, parts, n)


def swap_in(kv: list[torch.Tensor], handle: SwapHandle, new_block_ids: list[int]) -> None:
    """Copy a swapped-out request's blocks into ``new_block_ids`` (same count, any ids)."""
    if len(new_block_ids) != handle.num_blocks:
        raise ValueError(
            f"swap_in: the handle holds {handle.num_blocks} blocks, got {len(new_block_ids)} new ids"
        )
    if len(kv) != len(handle.parts):
        raise ValueError(
            f"swap_in: the handle holds {len(handle.parts)} KV tensors, the backend has {len(kv)}"
        )
    if not new_block_ids:
        return
    device = kv[0].device
    if not 0 <= min(new_block_ids) <= max(new_block_ids) < kv[0].shape[0]:
        raise ValueError(f"swap_in: block ids {new_block_ids} outside [0, {kv[0].shape[0]})")
    non_blocking = device.type == "cuda" and handle.data.is_pinned()
    scatter_pages(kv, new_block_ids, handle.parts, non_blocking=non_blocking)


class SwapMixin:
    """Whole-block data movement as backend methods, over the backend's ``distinct_kv``:
    copy-on-write copies, and ``swap_out`` / ``swap_in``."""

    kv: list[torch.Tensor]

    @property
    def distinct_kv(self) -> list[torch.Tensor]:
        """The KV tensors, each once, [num_pages, ...] each: ``kv_slabs`` where layers of several
        cache groups share one, else ``kv`` (what whole-page copies move; the tiers under the prefix
        cache read and write pages through it)."""
        return getattr(self, "kv_slabs", None) or self.kv

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        # a model with no attention layer (pure SSM) keeps no KV
        if not copies or not self.distinct_kv:
            return
        device = self.kv[0].device
        src = torch.tensor([s for s, _ in copies], device=device)
        dst = torch.tensor([d for _, d in copies], device=device)
        for cache in self.distinct_kv:
            cache[dst] = cache[src]

    def swap_out(self, block_ids: list[int]) -> SwapHandle:
        return swap_out(self.distinct_kv, block_ids)

    def swap_in(self, handle: SwapHandle, new_block_ids: list[int]) -> None:
        swap_in(self.distinct_kv, handle, new_block_ids)
