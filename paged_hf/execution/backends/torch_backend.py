"""Pure-PyTorch paged attention: the reference backend, on any device.

Design notes: docs/internals.md, paged_hf/execution/backends/torch_backend.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ...cache.kv_groups import CacheGroup, SlabPlaces
from ..cpu import kv_memory as cpu_kv_memory
from ..kv_geometry import KVLayout, LayerSpec, as_layout
from ..metadata import GroupTables, StepMetadata
from .swap import SwapMixin


@dataclass
class _DecodeGroup:
    """Decoding sequences of similar length, attended in one batched call, each padded to the
    longest of the group (a short sequence never pays for a long one's context)."""

    rows: torch.Tensor | slice  # their query rows in the packed batch
    blocks: torch.Tensor  # [n * max_blocks] each sequence's blocks, padded with its first
    n: int
    q_pos: torch.Tensor  # [n] position of each one's query token
    kv_pos: torch.Tensor  # [n, max_blocks * block_size] position of each key gathered
    valid: torch.Tensor  # [n, max_blocks * block_size] real (not padding) key positions
    masks: dict = field(default_factory=dict)  # by (sliding window, chunk), built on first use

    def mask(self, window: int | None, chunk: int | None = None) -> torch.Tensor:
        """[n, 1, 1, Lmax]: real keys, within ``window`` of the query when there is one, in the
        query's own ``chunk`` when there is one."""
        mask = self.masks.get((window, chunk))
        if mask is None:
            mask = self.valid
            if window is not None:
                mask = mask & (self.q_pos[:, None] - self.kv_pos < window)
            if chunk is not None:
                mask = mask & (self.q_pos[:, None] // chunk == self.kv_pos // chunk)
            mask = self.masks[(window, chunk)] = mask[:, None, None, :]
        return mask


# A group grows to take the next longer sequence while the padding that adds (its members times
# the length step) stays under this many tokens: about what one more group's per-layer calls
# cost in copying on a CPU. Sorting by length first makes groups contiguous length ranges.
GROUP_PADDING_TOKENS = 512


def decode_groups(
    lengths: list[int], block_size: int, padding_tokens: int | None = None
) -> list[list[int]]:
    """Indices into ``lengths`` (KV lengths of decoding sequences) split into groups of similar length."""
    if padding_tokens is None:
        padding_tokens = GROUP_PADDING_TOKENS
    groups: list[list[int]] = []
    longest = 0  # blocks of the current group's longest member
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        blocks = -(-lengths[i] // block_size)
        if groups and len(groups[-1]) * (blocks - longest) * block_size <= padding_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
        longest = blocks
    return groups


@dataclass
class _PrefillSeq:
    rows: slice  # its new tokens' rows in the packed batch
    blocks: torch.Tensor  # [nb] the blocks its whole context spans
    q_pos: torch.Tensor  # [q] positions of its new tokens
    kv_len: int
    fresh: bool  # no cached context: attend over the new K/V directly
    start: int = 0  # position of the first key its blocks hold (a sliding group's)


@dataclass
class _GroupPlan:
    """One cache group's share of the step's plan."""

    writes: dict[int, torch.Tensor]  # by KV head count: the rows the new K/V go to
    decode_groups: list[_DecodeGroup] = field(default_factory=list)
    prefills: list[_PrefillSeq] = field(default_factory=list)


class TorchBackend(SwapMixin):
    name = "torch"
    serves_cache_groups = True

    def __init__(
        self,
        layout: KVLayout | int,
        num_blocks: int,
        block_size: int,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        groups: tuple[CacheGroup, ...] | None = None,
    ) -> None:
        """``layout``: the model's per-layer geometry, or a number of layers all of ``kv_heads`` x
        ``head_dim``; ``groups``: its cache groups (default: one of every layer)."""
        self.layout = as_layout(layout, kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        places = SlabPlaces.of(groups, self.layout.num_layers)
        self.groups, self.group_of, slab_of = places.groups, places.group_of, places.slab_of
        self.kv_slabs = []  # K and V of each slab
        on_cpu = torch.device(device).type == "cpu"
        for layer in places.slab_layers:
            spec = self.layout.layers[layer]
            for dim in (spec.k_dim, spec.v_dim):
                shape = (num_blocks, spec.kv_heads, block_size, dim)
                # on a CPU, zero pages faulted in when first written (cpu_kv_memory.py)
                self.kv_slabs.append(
                    cpu_kv_memory.zeros(shape, dtype)
                    if on_cpu
                    else torch.zeros(shape, dtype=dtype, device=device)
                )
        self.kv = [
            self.kv_slabs[2 * slab_of[i] + kv]
            for i in range(self.layout.num_layers)
            for kv in (0, 1)
        ]
        self._rows = [c.view(-1, c.shape[-1]) for c in self.kv]  # one row per (block, head, offset)
        self.device = torch.device(device)

    # ---- once per step -----------------------------------------------------------------------
    def plan(self, meta: StepMetadata) -> None:
        self._plans = [self._plan_group(meta, g) for g in range(len(self.groups))]

    def _plan_group(self, meta: StepMetadata, g: int) -> _GroupPlan:
        bs, dev = self.block_size, self.device
        tables = meta.groups[g] if meta.groups else _only_group(meta)
        plan = _GroupPlan(self._plan_write(tables))
        qo = meta.qo_indptr.tolist()
        decode = [i for i, q in enumerate(meta.q_lens) if q == 1]
        held = [meta.kv_lens[i] - tables.kv_starts[i] for i in range(meta.num_seqs)]
        for members in decode_groups([held[i] for i in decode], bs):
            seqs = [decode[j] for j in members]
            rows = [qo[i] for i in seqs]
            lens = torch.tensor([meta.kv_lens[i] for i in seqs], device=dev)
            held_lens = torch.tensor([held[i] for i in seqs], device=dev)
            starts = torch.tensor([tables.kv_starts[i] for i in seqs], device=dev)
            blocks = [tables.kv_blocks[i] for i in seqs]
            max_blocks = max(len(b) for b in blocks)
            table = [b + [b[0]] * (max_blocks - len(b)) for b in blocks]
            pos = torch.arange(max_blocks * bs, device=dev)
            contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
            plan.decode_groups.append(
                _DecodeGroup(
                    rows=slice(rows[0], rows[0] + len(rows))
                    if contiguous
                    else torch.tensor(rows, device=dev),
                    blocks=torch.tensor(table, dtype=torch.long, device=dev).flatten(),
                    n=len(seqs),
                    q_pos=lens - 1,
                    kv_pos=starts[:, None] + pos[None, :],
                    valid=pos[None, :] < held_lens[:, None],
                )
            )

        for i, q in enumerate(meta.q_lens):
            if q == 1:
                continue
            L = meta.kv_lens[i]
            plan.prefills.append(
                _PrefillSeq(
                    rows=slice(qo[i], qo[i + 1]),
                    blocks=torch.tensor(tables.kv_blocks[i], dtype=torch.long, device=dev),
                    q_pos=torch.arange(L - q, L, device=dev),
                    kv_len=L,
                    fresh=(L == q),
                    start=tables.kv_starts[i],
                )
            )
        return plan

    def _plan_write(self, tables: GroupTables) -> dict[int, torch.Tensor]:
        bs, dev = self.block_size, self.device
        slots = tables.slot_mapping.to(torch.long)
        # row of (token t, head j): (block * H + j) * bs + offset, in K's and in V's cache alike;
        # one index per distinct KV head count among the layers
        writes: dict[int, torch.Tensor] = {}
        for h in {spec.kv_heads for spec in self.layout.layers}:
            heads = torch.arange(h, device=dev)
            writes[h] = (
                (((slots // bs) * h)[:, None] + heads[None, :]) * bs + (slots % bs)[:, None]
            ).flatten()
        return writes

    def _gather(
        self, layer_idx: int, blocks: torch.Tensor, n_seqs: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``blocks`` (n_seqs equal runs) as [n_seqs, H, n_blocks_each * bs, D] (D: K's, V's width)."""
        per_seq = blocks.numel() // n_seqs

        def take(cache: torch.Tensor) -> torch.Tensor:
            _, h, bs, d = cache.shape
            x = cache.index_select(0, blocks).view(n_seqs, per_seq, h, bs, d)
            return x.transpose(1, 2).reshape(n_seqs, h, per_seq * bs, d)

        return take(self.kv[2 * layer_idx]), take(self.kv[2 * layer_idx + 1])

    # ---- once per layer --------------------------------------------------------------------
    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q/k/v: [1, heads, T, head_dim] -> attention output [1, T, q_heads, v_dim].

        The layer's window, chunk and sinks come from the layout; ``sliding_window`` (what the
        model passed) must agree with it, and ``sinks`` is the layer's ``s_aux`` [q_heads]."""
        spec = self.layout.layers[layer_idx]
        window, chunk = layer_window(spec, layer_idx, sliding_window), spec.chunk
        plan = self._plans[self.group_of[layer_idx]]
        self._write_kv(layer_idx, key, value, plan.writes)
        d, dv = self._rows[2 * layer_idx].shape[1], self._rows[2 * layer_idx + 1].shape[1]
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        q_all = query[0]  # [Hq, T, D]
        hq = q_all.shape[0]
        out = query.new_empty(q_all.shape[1], hq, dv)
        sink_logits = None if sinks is None else sinks.to(device=query.device, dtype=torch.float32)

        for group in plan.decode_groups:
            k, v = self._gather(layer_idx, group.blocks, group.n)  # [n, Hkv, L, D]
            hkv = k.shape[1]
            # one query token per sequence: the G query heads of a KV head form a G-row query
            # (no K/V repeat for GQA). Plain matmuls beat CPU SDPA's flash kernel at q_len 1.
            q = q_all[:, group.rows].transpose(0, 1).reshape(group.n, hkv, hq // hkv, d)
            group_sinks = None if sink_logits is None else sink_logits.view(1, hkv, hq // hkv, 1)
            o = _attention(
                q, k, v, group.mask(window, chunk), scaling, softcap, fused=False, sinks=group_sinks
            )
            out[group.rows] = o.reshape(group.n, hq, dv)

        for seq in plan.prefills:
            o = self._attend_prefill(
                layer_idx, seq, q_all, key, value, scaling, window, chunk, softcap, sink_logits
            )
            out[seq.rows] = o[0].transpose(0, 1)
        return out.unsqueeze(0)

    def _attend_prefill(
        self,
        layer_idx: int,
        seq: Any,
        q_all: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        window: int | None,
        chunk: int | None,
        softcap: float | None,
        sink_logits: torch.Tensor | None,
    ) -> torch.Tensor:
        """One prefill chunk's attention, [1, Hq, q, Dv]: SDPA on the step's own K/V for a fresh
        causal prompt, else over the pages it holds with the chunk's offset and the layer's mask."""
        q = q_all[:, seq.rows].unsqueeze(0)  # [1, Hq, q, D]
        hq = q.shape[1]
        gqa = key.shape[1] != hq
        plain_causal = (
            softcap is None
            and sink_logits is None
            and (window is None or window >= seq.kv_len)
            and (chunk is None or chunk >= seq.kv_len)
        )
        if seq.fresh and plain_causal:
            return F.scaled_dot_product_attention(
                q,
                key[:, :, seq.rows],
                value[:, :, seq.rows],
                is_causal=True,
                scale=scaling,
                enable_gqa=gqa,
            )
        held = seq.kv_len - seq.start
        k, v = self._gather(layer_idx, seq.blocks, 1)
        k, v = k[:, :, :held], v[:, :, :held]  # [1, Hkv, held, D]
        if plain_causal:
            # causal with the chunk's offset, as a bias SDPA knows (~20% faster than a mask here)
            bias = causal_lower_right(q.shape[2], held)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, scale=scaling, enable_gqa=gqa
            )
        kv_pos = torch.arange(seq.start, seq.kv_len, device=q.device)
        mask = kv_pos[None, :] <= seq.q_pos[:, None]
        if window is not None:
            mask = mask & (seq.q_pos[:, None] - kv_pos[None, :] < window)
        if chunk is not None:
            mask = mask & (seq.q_pos[:, None] // chunk == kv_pos[None, :] // chunk)
        prefill_sinks = None if sink_logits is None else sink_logits.view(1, hq, 1, 1)
        return _attention(q, k, v, mask[None, None], scaling, softcap, sinks=prefill_sinks)

    def _write_kv(
        self,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        writes: dict[int, torch.Tensor],
    ) -> None:
        """Store the step's new K/V ([1, kv_heads, T, K / V width]) of one layer at the planned slots."""
        k_rows, v_rows = self._rows[2 * layer_idx], self._rows[2 * layer_idx + 1]
        write = writes[self.layout.layers[layer_idx].kv_heads]
        # [T * Hkv, D], token-major like the write rows
        k_new = key[0].transpose(0, 1).reshape(-1, k_rows.shape[1])
        v_new = value[0].transpose(0, 1).reshape(-1, v_rows.shape[1])
        k_rows.index_copy_(0, write, k_new.to(k_rows.dtype))
        v_rows.index_copy_(0, write, v_new.to(v_rows.dtype))


def _only_group(meta: StepMetadata) -> GroupTables:
    """Group 0's tables of metadata built without groups (tests and tools that make their own)."""
    return GroupTables(
        meta.slot_mapping,
        meta.kv_indptr,
        meta.kv_indices,
        meta.kv_last_page_len,
        meta.kv_blocks,
        [0] * meta.num_seqs,
    )


def layer_window(spec: LayerSpec, layer_idx: int, passed: int | None) -> int | None:
    """The layer's window from the layout; a window the model passes must be that one."""
    if passed is not None and spec.window is not None and int(passed) != spec.window:
        raise ValueError(
            f"layer {layer_idx}: the model passed sliding_window={passed}, but the window found when it "
            f"was patched is {spec.window} (was its config changed after patch?)"
        )
    return spec.window


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None,
    fused: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked attention with GQA; q [B, Hq, q, D], k [B, Hkv, L, D], v [B, Hkv, L, Dv], mask
    broadcastable to [B, H, q, L]; ``sinks`` (float32, broadcastable to [B, H, q, 1]): a logit per
    head that joins the softmax and is dropped from it (GPT-OSS).

    ``fused``: use SDPA where it can (no softcap, no sinks); otherwise explicit matmuls with an fp32
    softmax, as transformers' eager attention does.
    """
    if softcap is None and sinks is None and fused:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
        )
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        scores = scores.float()
        sink = sinks.expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(probs, v)
