"""Whole pages of the KV tensors copied to a buffer and back: the one gather and scatter that swap
preemption (paged_hf/execution/backends/swap.py) and the tiers under the prefix cache
(paged_hf/engine/kv_tiers.py) share. ``kv``: a backend's ``distinct_kv``, each tensor
[num_pages, ...]; a page's bytes are its slice of every one of them.

A buffer lays pages out by tensor (swap's: each tensor's pages one contiguous run, so that a device
copy into pinned memory stays asynchronous) or by page (a record's: a row per page, holding its
slice of every tensor in turn, so that a run of pages is a run of rows).
"""

from __future__ import annotations

import torch


def page_numel(kv: list[torch.Tensor]) -> int:
    """Elements of one page over every tensor: a row of a by-page buffer."""
    return sum(c[0].numel() for c in kv)


def by_tensor(data: torch.Tensor, kv: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """Flat ``data`` (``n * page_numel(kv)`` elements) as each tensor's ``n`` pages, one contiguous
    run per tensor, [n, *the rest of its shape]."""
    parts, start = [], 0
    for c in kv:
        size = n * c[0].numel()
        parts.append(data[start : start + size].view((n,) + tuple(c.shape[1:])))
        start += size
    return parts


def by_page(rows: torch.Tensor, kv: list[torch.Tensor]) -> list[torch.Tensor]:
    """``rows`` ([n, page_numel(kv)]) as each tensor's ``n`` pages: a run of columns per tensor."""
    n, parts, offset = rows.shape[0], [], 0
    for c in kv:
        size = c[0].numel()
        parts.append(rows[:, offset : offset + size].view((n,) + tuple(c.shape[1:])))
        offset += size
    return parts


def gather_pages(
    kv: list[torch.Tensor],
    pages: list[int],
    parts: list[torch.Tensor],
    non_blocking: bool = False,
) -> None:
    """Copy pages ``pages`` of every tensor into ``parts`` (``by_tensor`` or ``by_page`` views of a
    buffer), in that order."""
    idx = torch.tensor(pages, dtype=torch.long, device=kv[0].device)
    for part, c in zip(parts, kv):
        part.copy_(c.index_select(0, idx), non_blocking=non_blocking)


def scatter_pages(
    kv: list[torch.Tensor],
    pages: list[int],
    parts: list[torch.Tensor],
    non_blocking: bool = False,
) -> None:
    """Copy ``parts`` (as ``gather_pages`` fills them) into pages ``pages`` of every tensor."""
    idx = torch.tensor(pages, dtype=torch.long, device=kv[0].device)
    for part, c in zip(parts, kv):
        c.index_copy_(0, idx, part.to(c.device, non_blocking=non_blocking))
