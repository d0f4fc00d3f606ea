"""Pure-PyTorch paged attention: the reference backend, on any device.

K of layer l lives in ``kv[2 * l]`` and V in ``kv[2 * l + 1]``, each [num_blocks, kv_heads,
block_size, head_dim] and contiguous: each head's tokens sit together (HND). That layout is
chosen for the decode gather: one ``index_select`` of whole blocks copies 1-2 KB runs and
yields K/V in the [seq, head, position, dim] order attention wants. (Gathering token rows of
an NHD cache, then transposing, was ~5x slower on CPU; gathering from a K/V-interleaved
cache, a strided view, ~3x slower than from a contiguous one.)

``plan`` turns the step metadata into gather indices and masks once per step; ``attend`` then
runs once per layer: write the new K/V, attend the decodes in a few batched calls (sequences
grouped by length, so a batch of short ones does not gather a long one's context each),
short prefill chunks the same way (scoring continuations over a shared context, prompts that
hit the prefix cache: one call per group, not per sequence), and each long prefill chunk with
its own causal offset.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..metadata import StepMetadata
from .swap import SwapMixin


@dataclass
class _DecodeGroup:
    """Decoding sequences of similar length, attended in one batched call, each padded to the
    longest of the group (a short sequence never pays for a long one's context)."""
    rows: torch.Tensor | slice  # their query rows in the packed batch
    blocks: torch.Tensor        # [n * max_blocks] each sequence's blocks, padded with its first
    n: int
    q_pos: torch.Tensor         # [n] position of each one's query token
    kv_pos: torch.Tensor        # [max_blocks * block_size]
    valid: torch.Tensor         # [n, max_blocks * block_size] real (not padding) key positions
    masks: dict = field(default_factory=dict)  # by sliding window, built on first use

    def mask(self, window: int | None) -> torch.Tensor:
        """[n, 1, 1, Lmax]: real keys, within ``window`` of the query when there is one."""
        mask = self.masks.get(window)
        if mask is None:
            mask = self.valid
            if window is not None:
                mask = mask & (self.q_pos[:, None] - self.kv_pos[None, :] < window)
            mask = self.masks[window] = mask[:, None, None, :]
        return mask


# A group grows to take the next longer sequence while the padding that adds (its members times
# the length step) stays under this many tokens: about what one more group's per-layer calls
# cost in copying on a CPU. Sorting by length first makes groups contiguous length ranges.
GROUP_PADDING_TOKENS = 512


def decode_groups(lengths: list[int], block_size: int, padding_tokens: int | None = None) -> list[list[int]]:
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
class _ChunkGroup:
    """Short prefill chunks of similar context length, attended in one batched call per layer:
    queries padded to the longest chunk (a padding row repeats a real one and is dropped),
    keys to the longest context, as decode groups are."""
    rows: torch.Tensor     # [n * q_max] query rows in the packed batch
    real: torch.Tensor     # [n * q_max] which of them are not padding
    out_rows: torch.Tensor  # the packed rows of the real ones, in order
    blocks: torch.Tensor   # [n * max_blocks] each sequence's blocks, padded with its first
    n: int
    q_max: int
    q_pos: torch.Tensor    # [n, q_max] position of each query
    kv_pos: torch.Tensor   # [max_blocks * block_size]
    valid: torch.Tensor    # [n, max_blocks * block_size] real (not padding) key positions
    fresh: bool            # no cached context: the keys are the chunks' own new tokens
    masks: dict = field(default_factory=dict)  # by sliding window, built on first use

    def mask(self, window: int | None) -> torch.Tensor:
        """[n, 1, q_max, Lmax]: causal over real keys, within ``window`` when there is one."""
        mask = self.masks.get(window)
        if mask is None:
            delta = self.q_pos[:, :, None] - self.kv_pos[None, None, :]
            mask = self.valid[:, None, :] & (delta >= 0)
            if window is not None:
                mask = mask & (delta < window)
            mask = self.masks[window] = mask[:, None]
        return mask


# Prefill chunks up to this many tokens are attended in groups (see _ChunkGroup); longer ones
# one by one, where their own attention outweighs a call's overhead.
SHORT_CHUNK_TOKENS = 128


@dataclass
class _PrefillSeq:
    rows: slice            # its new tokens' rows in the packed batch
    blocks: torch.Tensor   # [nb] the blocks its whole context spans
    q_pos: torch.Tensor    # [q] positions of its new tokens
    kv_len: int
    fresh: bool            # no cached context: attend over the new K/V directly


class TorchBackend(SwapMixin):
    name = "torch"

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_heads = kv_heads
        self.kv = [torch.zeros(num_blocks, kv_heads, block_size, head_dim, dtype=dtype, device=device)
                   for _ in range(2 * num_layers)]
        self._rows = [c.view(-1, head_dim) for c in self.kv]  # one row per (block, head, offset)
        self.device = torch.device(device)

    # ---- once per step -----------------------------------------------------------------------
    def plan(self, meta: StepMetadata) -> None:
        bs, dev, h = self.block_size, self.device, self.kv_heads
        slots = meta.slot_mapping.to(torch.long)
        heads = torch.arange(h, device=dev)
        # row of (token t, head j): (block * H + j) * bs + offset, in K's and in V's cache alike
        self._write = (((slots // bs) * h)[:, None] + heads[None, :]) * bs + (slots % bs)[:, None]
        self._write = self._write.flatten()

        qo = meta.qo_indptr.tolist()
        decode = [i for i, q in enumerate(meta.q_lens) if q == 1]
        self._decode_groups: list[_DecodeGroup] = []
        for members in decode_groups([meta.kv_lens[i] for i in decode], bs):
            seqs = [decode[j] for j in members]
            rows = [qo[i] for i in seqs]
            lens = torch.tensor([meta.kv_lens[i] for i in seqs], device=dev)
            max_blocks = max(len(meta.kv_blocks[i]) for i in seqs)
            table = [meta.kv_blocks[i] + [meta.kv_blocks[i][0]] * (max_blocks - len(meta.kv_blocks[i])) for i in seqs]
            pos = torch.arange(max_blocks * bs, device=dev)
            contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
            self._decode_groups.append(_DecodeGroup(
                rows=slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows, device=dev),
                blocks=torch.tensor(table, dtype=torch.long, device=dev).flatten(), n=len(seqs), q_pos=lens - 1,
                kv_pos=pos, valid=pos[None, :] < lens[:, None]))

        short = [i for i, q in enumerate(meta.q_lens) if 1 < q <= SHORT_CHUNK_TOKENS]
        self._chunk_groups = []
        for fresh in (True, False):  # chunks without cached context attend over their own K/V
            part = [i for i in short if (meta.kv_lens[i] == meta.q_lens[i]) == fresh]
            self._chunk_groups += [self._chunk_group([part[j] for j in members], meta, qo, fresh)
                                   for members in decode_groups([meta.kv_lens[i] for i in part], bs)]

        self._prefills: list[_PrefillSeq] = []
        for i, q in enumerate(meta.q_lens):
            if q <= SHORT_CHUNK_TOKENS:
                continue
            L = meta.kv_lens[i]
            self._prefills.append(_PrefillSeq(
                rows=slice(qo[i], qo[i + 1]), blocks=torch.tensor(meta.kv_blocks[i], dtype=torch.long, device=dev),
                q_pos=torch.arange(L - q, L, device=dev), kv_len=L, fresh=(L == q)))

    def _chunk_group(self, seqs: list[int], meta: StepMetadata, qo: list[int], fresh: bool) -> _ChunkGroup:
        bs, dev = self.block_size, self.device
        q_max = max(meta.q_lens[i] for i in seqs)
        max_blocks = max(len(meta.kv_blocks[i]) for i in seqs)
        rows, real, q_pos = [], [], []
        for i in seqs:
            q, first, L = meta.q_lens[i], qo[i], meta.kv_lens[i]
            rows += list(range(first, first + q)) + [first] * (q_max - q)
            real += [True] * q + [False] * (q_max - q)
            q_pos += list(range(L - q, L)) + [L - q] * (q_max - q)
        table = [meta.kv_blocks[i] + [meta.kv_blocks[i][0]] * (max_blocks - len(meta.kv_blocks[i])) for i in seqs]
        lens = torch.tensor([meta.kv_lens[i] for i in seqs], device=dev)
        pos = torch.arange(max_blocks * bs, device=dev)
        rows_t, real_t = torch.tensor(rows, device=dev), torch.tensor(real, device=dev)
        return _ChunkGroup(rows=rows_t, real=real_t, out_rows=rows_t[real_t],
                           blocks=torch.tensor(table, dtype=torch.long, device=dev).flatten(), n=len(seqs),
                           q_max=q_max, q_pos=torch.tensor(q_pos, device=dev).view(len(seqs), q_max),
                           kv_pos=pos, valid=pos[None, :] < lens[:, None], fresh=fresh)

    def _gather(self, layer_idx: int, blocks: torch.Tensor, n_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``blocks`` (n_seqs equal runs) as [n_seqs, H, n_blocks_each * bs, D]."""
        _, h, bs, d = self.kv[0].shape
        per_seq = blocks.numel() // n_seqs

        def take(cache: torch.Tensor) -> torch.Tensor:
            x = cache.index_select(0, blocks).view(n_seqs, per_seq, h, bs, d)
            return x.transpose(1, 2).reshape(n_seqs, h, per_seq * bs, d)

        return take(self.kv[2 * layer_idx]), take(self.kv[2 * layer_idx + 1])

    # ---- once per layer --------------------------------------------------------------------
    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, sliding_window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """q/k/v: [1, heads, T, head_dim] -> attention output [1, T, q_heads, head_dim]."""
        k_rows, v_rows = self._rows[2 * layer_idx], self._rows[2 * layer_idx + 1]
        d = k_rows.shape[1]
        k_new = key[0].transpose(0, 1).reshape(-1, d)    # [T * Hkv, D], token-major like _write
        v_new = value[0].transpose(0, 1).reshape(-1, d)
        k_rows.index_copy_(0, self._write, k_new.to(k_rows.dtype))
        v_rows.index_copy_(0, self._write, v_new.to(v_rows.dtype))
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        q_all = query[0]                  # [Hq, T, D]
        hq = q_all.shape[0]
        out = query.new_empty(q_all.shape[1], hq, d)

        for group in self._decode_groups:
            k, v = self._gather(layer_idx, group.blocks, group.n)                 # [n, Hkv, L, D]
            hkv = k.shape[1]
            # one query token per sequence: the G query heads of a KV head form a G-row query
            # (no K/V repeat for GQA). Plain matmuls beat CPU SDPA's flash kernel at q_len 1.
            q = q_all[:, group.rows].transpose(0, 1).reshape(group.n, hkv, hq // hkv, d)
            o = _attention(q, k, v, group.mask(sliding_window), scaling, softcap, fused=False)
            out[group.rows] = o.reshape(group.n, hq, d)

        for group in self._chunk_groups:
            q = q_all[:, group.rows].view(hq, group.n, group.q_max, d).transpose(0, 1)  # [n, Hq, q_max, D]
            if group.fresh and softcap is None and (sliding_window is None or sliding_window >= group.q_max):
                # the chunks' own K/V, right-padded: a real query never reaches a padding key
                def own(x: torch.Tensor) -> torch.Tensor:
                    return x[0][:, group.rows].view(x.shape[1], group.n, group.q_max, d).transpose(0, 1)

                o = F.scaled_dot_product_attention(q, own(key), own(value), is_causal=True, scale=scaling,
                                                   enable_gqa=key.shape[1] != hq)
            else:
                k, v = self._gather(layer_idx, group.blocks, group.n)             # [n, Hkv, L, D]
                o = _attention(q, k, v, group.mask(sliding_window), scaling, softcap)
            out[group.out_rows] = o.transpose(1, 2).reshape(-1, hq, d)[group.real]

        for seq in self._prefills:
            q = q_all[:, seq.rows].unsqueeze(0)                                 # [1, Hq, q, D]
            gqa = key.shape[1] != q.shape[1]
            plain_causal = softcap is None and (sliding_window is None or sliding_window >= seq.kv_len)
            if seq.fresh and plain_causal:
                o = F.scaled_dot_product_attention(q, key[:, :, seq.rows], value[:, :, seq.rows], is_causal=True,
                                                   scale=scaling, enable_gqa=gqa)
            else:
                k, v = self._gather(layer_idx, seq.blocks, 1)
                k, v = k[:, :, : seq.kv_len], v[:, :, : seq.kv_len]            # [1, Hkv, L, D]
                if plain_causal:
                    # causal with the chunk's offset, as a bias SDPA knows (~20% faster than a mask here)
                    bias = causal_lower_right(q.shape[2], seq.kv_len)
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scaling, enable_gqa=gqa)
                else:
                    kv_pos = torch.arange(seq.kv_len, device=q.device)
                    mask = kv_pos[None, :] <= seq.q_pos[:, None]
                    if sliding_window is not None:
                        mask = mask & (seq.q_pos[:, None] - kv_pos[None, :] < sliding_window)
                    o = _attention(q, k, v, mask[None, None], scaling, softcap)
            out[seq.rows] = o[0].transpose(0, 1)
        return out.unsqueeze(0)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float,
               softcap: float | None, fused: bool = True) -> torch.Tensor:
    """Masked attention with GQA; q [B, Hq, q, D], k/v [B, Hkv, L, D], mask broadcastable to [B, H, q, L].

    ``fused``: use SDPA where it can (no softcap); otherwise explicit matmuls with an fp32 softmax,
    as transformers' eager attention does.
    """
    if softcap is None and fused:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                              enable_gqa=k.shape[1] != q.shape[1])
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
