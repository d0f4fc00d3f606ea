"""Step metadata: the packed batch in FlashInfer's own CSR format, used by every backend.

For B sequences and T new tokens:
  input_ids[T], positions[T]   the new tokens, sequence after sequence
  slot_mapping[T]              where each new token's K/V goes: block * block_size + offset
  qo_indptr[B+1]               sequence i's new tokens are rows qo_indptr[i]:qo_indptr[i+1]
  kv_indptr[B+1], kv_indices   sequence i's KV blocks (cached and new) are
                               kv_indices[kv_indptr[i]:kv_indptr[i+1]]
  kv_last_page_len[B]          tokens used in each sequence's last block (1..block_size)
  logits_indices[B' + R]       rows whose logits are needed: first the B' sampled rows (last
                               token of each sequence whose chunk reaches the end of its known
                               tokens), then the R rows scored (prompt logprobs, scoring requests)

With cache groups (paged_hf/cache/kv_groups.py) each group has its own slot mapping and KV pages
(``groups``; the fields above are group 0's): a sliding or chunked group's pages of a sequence
start at the first block its first query reads, ``kv_starts`` tokens in, and
``kv_last_page_len`` and the lengths a backend attends over count from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.kv_groups import FULL, CacheGroup
from ..requests.request import Request


@dataclass
class GroupTables:
    """One cache group's view of the step: where its layers write, and which pages they read."""

    slot_mapping: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_blocks: list[list[int]]  # per sequence, the pages its held KV spans
    kv_starts: list[int]  # per sequence, the position of its first held page's first token


@dataclass
class StepMetadata:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    logits_indices: torch.Tensor
    block_size: int
    # host copies the backends plan from without a device sync
    q_lens: list[int]
    kv_lens: list[int]
    kv_blocks: list[list[int]]  # per sequence, the blocks its KV spans (kv_indices, unflattened)
    sampled_requests: list[Request]  # one per logits row, in row order
    # after the sampled rows, in row order: (request, first target, count) of its scored rows
    score_rows: list[tuple[Request, int, int]] = field(default_factory=list)
    groups: list[GroupTables] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)


def build_step_metadata(
    scheduled: list[tuple[Request, int]],
    block_size: int,
    device: torch.device | str = "cpu",
    groups: tuple[CacheGroup, ...] = (FULL,),
) -> StepMetadata:
    """Metadata for requests that will compute ``n`` more tokens each (before ``mark_computed``)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qo_indptr, kv_indptr = [0], [0]
    kv_indices: list[int] = []
    last_page_len: list[int] = []
    logits_indices: list[int] = []
    sampled: list[Request] = []
    score_indices: list[int] = []
    score_rows: list[tuple[Request, int, int]] = []
    q_lens, kv_lens = [], []
    kv_blocks: list[list[int]] = []
    bs = block_size
    for req, n in scheduled:
        start = req.num_computed_tokens
        end = start + n
        table = req.block_table
        assert len(table) * bs >= end, (
            f"request {req.request_id}: {len(table)} blocks cannot hold {end} tokens"
        )
        input_ids.extend(req.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        n_blocks = -(-end // bs)
        kv_blocks.append(table[:n_blocks])
        kv_indices.extend(kv_blocks[-1])
        qo_indptr.append(qo_indptr[-1] + n)
        kv_indptr.append(kv_indptr[-1] + n_blocks)
        last_page_len.append(end - (n_blocks - 1) * bs)
        q_lens.append(n)
        kv_lens.append(end)
        if end == req.num_tokens and not req.prefill_only:
            logits_indices.append(len(input_ids) - 1)
            sampled.append(req)
        first, count = req.score_rows(start, end)
        if count:
            row0 = len(input_ids) - n + (req.score_start + first - start)
            score_indices.extend(range(row0, row0 + count))
            score_rows.append((req, first, count))

    ids, pos, logits_rows = upload(
        device, torch.long, input_ids, positions, logits_indices + score_indices
    )
    slot_t, qo_t, kv_t, idx_t, last_t = upload(
        device, torch.int32, slots, qo_indptr, kv_indptr, kv_indices, last_page_len
    )
    meta = StepMetadata(
        input_ids=ids,
        positions=pos,
        slot_mapping=slot_t,
        qo_indptr=qo_t,
        kv_indptr=kv_t,
        kv_indices=idx_t,
        kv_last_page_len=last_t,
        logits_indices=logits_rows,
        block_size=bs,
        q_lens=q_lens,
        kv_lens=kv_lens,
        kv_blocks=kv_blocks,
        sampled_requests=sampled,
        score_rows=score_rows,
    )
    meta.groups = [
        GroupTables(
            meta.slot_mapping,
            meta.kv_indptr,
            meta.kv_indices,
            meta.kv_last_page_len,
            kv_blocks,
            [0] * len(kv_blocks),
        )
    ]
    for g in range(1, len(groups)):
        meta.groups.append(_group_tables(scheduled, g, groups[g], bs, device))
    return meta


def _group_tables(
    scheduled: list[tuple[Request, int]],
    g: int,
    group: CacheGroup,
    bs: int,
    device: torch.device | str,
) -> GroupTables:
    slots: list[int] = []
    indptr, indices, last, blocks, starts = [0], [], [], [], []
    for req, n in scheduled:
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        table = req.block_tables[g]
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        first, n_blocks = group.first_needed_block(start, bs), -(-end // bs)
        held = table[first:n_blocks]
        assert min(held) >= 0, f"request {req.request_id}: group {g} lacks a block its queries read"
        blocks.append(held)
        starts.append(first * bs)
        indices.extend(held)
        indptr.append(indptr[-1] + len(held))
        last.append(end - (n_blocks - 1) * bs)

    return GroupTables(*upload(device, torch.int32, slots, indptr, indices, last), blocks, starts)


def upload(device: torch.device | str, dtype: torch.dtype, *lists: list[int]) -> list[torch.Tensor]:
    """Host lists as device tensors of ``dtype`` through one copy: on CUDA from pinned memory and
    asynchronous (a tensor built from a list on a CUDA device is one blocking copy per tensor)."""
    flat = [x for values in lists for x in values]
    device = torch.device(device)
    if device.type != "cuda":
        host = torch.tensor(flat, dtype=dtype, device=device)
    else:
        host = torch.tensor(flat, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return list(host.split([len(values) for values in lists]))
