"""Step metadata: the packed batch in FlashInfer's own CSR format, used by every backend.

Design notes: docs/internals.md, paged_hf/execution/metadata.py.
"""

from __future__ import annotations

import itertools
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
    # requests that asked for hidden states: (first position computed, [layers + 1, n, hidden])
    hidden_states: dict[Request, tuple[int, torch.Tensor]] = field(default_factory=dict)

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
    host = _HostLists()
    for req, n in scheduled:
        host.add(req, n, block_size)
    ids, pos, logits_rows = upload(
        device, torch.long, host.input_ids, host.positions, host.logits_indices + host.score_indices
    )
    slot_t, qo_t, kv_t, idx_t, last_t = upload(
        device,
        torch.int32,
        host.slots,
        host.qo_indptr,
        host.kv_indptr,
        host.kv_indices,
        host.last_page_len,
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
        block_size=block_size,
        q_lens=host.q_lens,
        kv_lens=host.kv_lens,
        kv_blocks=host.kv_blocks,
        sampled_requests=host.sampled,
        score_rows=host.score_rows,
    )
    first = [0] * len(host.kv_blocks)
    meta.groups = [GroupTables(slot_t, kv_t, idx_t, last_t, host.kv_blocks, first)]
    for g in range(1, len(groups)):
        meta.groups.append(_group_tables(scheduled, g, groups[g], block_size, device))
    return meta


@dataclass
class _HostLists:
    """A step's metadata as host lists, one scheduled request at a time."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    qo_indptr: list[int] = field(default_factory=lambda: [0])
    kv_indptr: list[int] = field(default_factory=lambda: [0])
    kv_indices: list[int] = field(default_factory=list)
    last_page_len: list[int] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)
    sampled: list[Request] = field(default_factory=list)
    score_indices: list[int] = field(default_factory=list)
    score_rows: list[tuple[Request, int, int]] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)
    kv_lens: list[int] = field(default_factory=list)
    kv_blocks: list[list[int]] = field(default_factory=list)

    def add(self, req: Request, n: int, bs: int) -> None:
        start = req.num_computed_tokens
        end = start + n
        table = req.block_table
        assert len(table) * bs >= end, (
            f"request {req.request_id}: {len(table)} blocks cannot hold {end} tokens"
        )
        # past its own tokens: its draft's (paged_hf/engine/speculation.py)
        self.input_ids.extend(
            req.token_ids[start:end] if end <= req.num_tokens else req.step_ids(start, end)
        )
        self.positions.extend(range(start, end))
        self.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        n_blocks = -(-end // bs)
        self.kv_blocks.append(table[:n_blocks])
        self.kv_indices.extend(self.kv_blocks[-1])
        self.qo_indptr.append(self.qo_indptr[-1] + n)
        self.kv_indptr.append(self.kv_indptr[-1] + n_blocks)
        self.last_page_len.append(end - (n_blocks - 1) * bs)
        self.q_lens.append(n)
        self.kv_lens.append(end)
        drafted = end - req.num_tokens  # > 0: draft tokens follow its own
        if drafted >= 0 and not req.prefill_only:
            # a draft's verification: the logits after its pending token and after each draft
            # token, one sampled row each (paged_hf/engine/speculation.py)
            last = len(self.input_ids) - 1
            self.logits_indices.extend(range(last - drafted, last + 1))
            self.sampled.extend([req] * (drafted + 1))
        first, count = req.score_rows(start, end)
        if count:
            row0 = len(self.input_ids) - n + (req.score_start + first - start)
            self.score_indices.extend(range(row0, row0 + count))
            self.score_rows.append((req, first, count))


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
    flat = list(itertools.chain.from_iterable(lists))  # at C speed: a prefill step's lists are long
    device = torch.device(device)
    if device.type != "cuda":
        host = torch.tensor(flat, dtype=dtype, device=device)
    else:
        host = torch.tensor(flat, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return list(host.split([len(values) for values in lists]))


def keep_hidden_states(meta: StepMetadata) -> None:
    """Each asking request's hidden states at the positions it had not recorded (a recompute
    after preemption computes some again)."""
    for req, (start, states) in meta.hidden_states.items():
        skip = req.hidden_positions - start
        if skip < states.shape[1]:
            req.hidden_states.append(states[:, max(skip, 0) :])
            req.hidden_positions = start + states.shape[1]
