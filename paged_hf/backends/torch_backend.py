"""Pure-PyTorch paged attention: the reference backend, on any device.

KV of layer l lives in ``kv[l]``, shape [num_blocks, 2, block_size, kv_heads, head_dim]
(FlashInfer's NHD layout). Viewed flat as rows [num_blocks * 2 * block_size, kv_heads, head_dim],
slot s (block b = s // block_size, offset o) keeps K in row b*2*bs + o and V block_size rows later.

``plan`` turns the step metadata into gather indices and masks once per step; ``attend`` then
runs once per layer: write the new K/V, attend all decodes in one batched call, and each
prefill chunk with its own causal offset.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..metadata import StepMetadata


@dataclass
class _PrefillSeq:
    rows: slice              # its new tokens' rows in the packed batch
    k_rows: torch.Tensor     # [L] flat K rows of its whole context
    q_pos: torch.Tensor      # [q] positions of its new tokens
    kv_len: int
    fresh: bool              # no cached context: attend over the new K/V directly


class TorchBackend:
    name = "torch"

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv = [torch.zeros(num_blocks, 2, block_size, kv_heads, head_dim, dtype=dtype, device=device)
                   for _ in range(num_layers)]
        self._flat = [c.view(num_blocks * 2 * block_size, kv_heads, head_dim) for c in self.kv]
        self.device = torch.device(device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv:
            cache[dst] = cache[src]

    # ---- once per step -----------------------------------------------------------------------
    def plan(self, meta: StepMetadata) -> None:
        bs, dev = self.block_size, self.device
        slots = meta.slot_mapping.to(torch.long)
        self._k_write = slots + (slots // bs) * bs
        self._v_write = self._k_write + bs
        self._masks: dict[int | None, torch.Tensor] = {}

        qo = meta.qo_indptr.tolist()
        decode = [i for i, q in enumerate(meta.q_lens) if q == 1]
        self._decode_rows = torch.tensor([qo[i] for i in decode], dtype=torch.long, device=dev)
        self._decode_k_rows = None
        if decode:
            lens = torch.tensor([meta.kv_lens[i] for i in decode], device=dev)
            max_blocks = max(len(meta.kv_blocks[i]) for i in decode)
            table = torch.tensor([meta.kv_blocks[i] + [0] * (max_blocks - len(meta.kv_blocks[i])) for i in decode],
                                 dtype=torch.long, device=dev)
            pos = torch.arange(int(lens.max()), device=dev)
            k_rows = table[:, pos // bs] * (2 * bs) + pos % bs  # [Bd, Lmax]
            # K rows then V rows, flat: one index_select per layer (much cheaper than 2-D indexing)
            self._decode_kv_rows = torch.cat([k_rows, k_rows + bs]).flatten()
            self._decode_shape = (2, len(decode), pos.numel())
            self._decode_k_rows = k_rows
            self._decode_kv_pos = pos
            self._decode_q_pos = lens - 1
            self._decode_valid = pos[None, :] < lens[:, None]
            self._decode_prefix = decode == list(range(len(decode)))  # decodes lead the batch: write by slice

        self._prefills: list[_PrefillSeq] = []
        for i, q in enumerate(meta.q_lens):
            if q == 1:
                continue
            L = meta.kv_lens[i]
            pos = torch.arange(L, device=dev)
            blocks = torch.tensor(meta.kv_blocks[i], dtype=torch.long, device=dev)
            self._prefills.append(_PrefillSeq(
                rows=slice(qo[i], qo[i + 1]), k_rows=blocks[pos // bs] * (2 * bs) + pos % bs,
                q_pos=torch.arange(L - q, L, device=dev), kv_len=L, fresh=(L == q)))

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        mask = self._masks.get(window)
        if mask is None:
            mask = self._decode_valid
            if window is not None:
                mask = mask & (self._decode_q_pos[:, None] - self._decode_kv_pos[None, :] < window)
            mask = self._masks[window] = mask[:, None, None, :]  # [Bd, 1, 1, Lmax]
        return mask

    # ---- once per layer --------------------------------------------------------------------
    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, sliding_window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """q/k/v: [1, heads, T, head_dim] -> attention output [1, T, q_heads, head_dim]."""
        flat = self._flat[layer_idx]
        bs = self.block_size
        k_new = key[0].transpose(0, 1)    # [T, Hkv, D]
        v_new = value[0].transpose(0, 1)
        flat.index_copy_(0, self._k_write, k_new.to(flat.dtype))
        flat.index_copy_(0, self._v_write, v_new.to(flat.dtype))
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        q_all = query[0]                  # [Hq, T, D]
        out = query.new_empty(q_all.shape[1], q_all.shape[0], q_all.shape[2])

        if self._decode_k_rows is not None:
            two, n_dec, max_len = self._decode_shape
            kv = flat.index_select(0, self._decode_kv_rows).view(two, n_dec, max_len, *flat.shape[1:])
            kv = kv.permute(0, 1, 3, 2, 4).contiguous()                        # [2, Bd, Hkv, L, D]
            hq, hkv, d = q_all.shape[0], kv.shape[2], q_all.shape[2]
            rows = slice(0, n_dec) if self._decode_prefix else self._decode_rows
            # one query token per sequence: the G query heads of a KV head form a G-row query
            # (no K/V repeat for GQA). Plain matmuls beat CPU SDPA's flash kernel at q_len 1.
            q = q_all[:, rows].transpose(0, 1).reshape(n_dec, hkv, hq // hkv, d)
            o = _attention(q, kv[0], kv[1], self._decode_mask(sliding_window), scaling, softcap, fused=False)
            out[rows] = o.reshape(n_dec, hq, d)

        for seq in self._prefills:
            q = q_all[:, seq.rows].unsqueeze(0)                                 # [1, Hq, q, D]
            if seq.fresh and softcap is None and (sliding_window is None or sliding_window >= seq.kv_len):
                o = F.scaled_dot_product_attention(q, key[:, :, seq.rows], value[:, :, seq.rows], is_causal=True,
                                                   scale=scaling, enable_gqa=key.shape[1] != q.shape[1])
            else:
                k = flat.index_select(0, seq.k_rows).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
                v = flat.index_select(0, seq.k_rows + bs).transpose(0, 1).unsqueeze(0)
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
