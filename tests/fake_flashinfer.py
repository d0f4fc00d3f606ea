"""A pure-torch stand-in for the two flashinfer wrappers the FlashInfer backend uses.

It follows FlashInfer's documented semantics, so the backend's own logic (variants, host CSR,
K/V writes, CUDA-graph buffers) can be checked on CPU against the torch backend:

- page table: sequence i's pages are ``indices[indptr[i]:indptr[i+1]]``, its KV length is
  ``(pages - 1) * page_size + last_page_len[i]``; cache layout NHD [pages, 2, page_size, H, D];
- query row j of a sequence with q_len rows sits at position ``kv_len - q_len + j``; ``causal``
  keeps keys at or before it, ``window_left >= 0`` keeps keys at or after ``pos - window_left``;
- logits ``q.k * sm_scale`` (default ``head_dim ** -0.5``), soft-capped as
  ``cap * tanh(logits / cap)``; GQA: query head h reads KV head ``h // (Hq / Hkv)``;
- ``use_cuda_graph=True``: ``plan`` copies into the caller's buffers and ``run`` reads them, the
  batch size is fixed by the buffers (as in FlashInfer, where the captured kernel reads them);
- ``plan`` leaves its plan in the wrapper's int workspace (``_int_workspace_buffer``, as FlashInfer
  does) and ``run`` fails when that buffer holds another wrapper's plan: wrappers that share one
  (the backend shares it per variant) must never hold live plans at once.

The constructor and ``plan`` signatures are FlashInfer 0.7's (keyword names checked), and the
dtype / layout / index checks FlashInfer makes are made here too.
"""

from __future__ import annotations

import types

import torch
from torch.utils._python_dispatch import _disable_current_modes

__version__ = "0.0.0-fake"


def _check_i32(name: str, t: torch.Tensor) -> None:
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int32, (
        f"{name} must be an int32 tensor, got {t!r}"
    )


_plans_made = iter(range(1, 1 << 62))


class _Base:
    def _init_workspace(self) -> None:
        self._int_workspace_buffer = torch.zeros(8, dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.zeros(8, dtype=torch.uint8)
        self._plan_id = 0

    def _store(
        self,
        indptr,
        indices,
        last_page_len,
        page_size,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        window_left,
        logits_soft_cap,
        sm_scale,
        q_data_type,
        kv_data_type,
    ):
        for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
            _check_i32(name, t)
        assert num_qo_heads % num_kv_heads == 0, (num_qo_heads, num_kv_heads)
        assert isinstance(window_left, int) and window_left >= -1, window_left
        assert logits_soft_cap is None or logits_soft_cap > 0, logits_soft_cap
        assert q_data_type is not None and kv_data_type is not None
        batch = len(last_page_len)
        assert len(indptr) == batch + 1
        assert int(indptr[-1]) == len(indices), (indptr, len(indices))
        assert bool((last_page_len >= 1).all()) and bool((last_page_len <= page_size).all())
        if self.use_cuda_graph:
            assert batch == self._fixed_batch, (
                f"cuda graph wrapper of batch {self._fixed_batch} planned with {batch}"
            )
            assert len(indices) <= len(self._indices_buf), "indices exceed the cuda graph buffer"
            self._indptr_buf.copy_(indptr)
            self._last_buf.copy_(last_page_len)
            self._indices_buf[: len(indices)].copy_(indices)
        else:
            self._indptr_buf, self._indices_buf, self._last_buf = (
                indptr.clone(),
                indices.clone(),
                last_page_len.clone(),
            )
        self.page_size, self.num_qo_heads, self.num_kv_heads, self.head_dim = (
            page_size,
            num_qo_heads,
            num_kv_heads,
            head_dim,
        )
        self.window_left, self.logits_soft_cap, self.sm_scale = (
            window_left,
            logits_soft_cap,
            sm_scale,
        )
        self.q_data_type, self.kv_data_type = q_data_type, kv_data_type
        self.planned = True
        self.plan_count += 1
        self._plan_id = next(_plans_made)
        self._int_workspace_buffer.view(torch.int64)[0] = self._plan_id

    def _attend(
        self, q: torch.Tensor, cache: torch.Tensor, qo_indptr: list[int], causal: bool
    ) -> torch.Tensor:
        # A kernel launch: the stand-in's host-side work is hidden from dispatch modes, so a test that
        # watches a captured step for host syncs sees the model's code and the backend's, not this.
        with _disable_current_modes():
            return self._reference_attention(q, cache, qo_indptr, causal)

    def _reference_attention(
        self, q: torch.Tensor, cache: torch.Tensor, qo_indptr: list[int], causal: bool
    ) -> torch.Tensor:
        assert self.planned, "run before plan"
        assert int(self._int_workspace_buffer.view(torch.int64)[0]) == self._plan_id, (
            "run after another wrapper planned into this wrapper's int workspace"
        )
        assert q.dtype == self.q_data_type and cache.dtype == self.kv_data_type, (
            q.dtype,
            cache.dtype,
        )
        assert q.dim() == 3 and q.shape[1:] == (self.num_qo_heads, self.head_dim), q.shape
        assert cache.dim() == 5 and cache.shape[1:] == (
            2,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
        ), cache.shape
        indptr, indices, last = (
            self._indptr_buf.tolist(),
            self._indices_buf.tolist(),
            self._last_buf.tolist(),
        )
        assert qo_indptr[-1] == q.shape[0], (qo_indptr, q.shape)
        ps, group = self.page_size, self.num_qo_heads // self.num_kv_heads
        scale = self.sm_scale if self.sm_scale is not None else self.head_dim**-0.5
        out = torch.empty_like(q)
        for i in range(len(last)):
            pages = indices[indptr[i] : indptr[i + 1]]
            kv_len = (len(pages) - 1) * ps + last[i]
            kv = cache[torch.tensor(pages, dtype=torch.long)]  # [P, 2, ps, Hkv, D]
            k = kv[:, 0].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len].float()
            v = kv[:, 1].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len].float()
            rows = slice(qo_indptr[i], qo_indptr[i + 1])
            qi = q[rows].float()  # [n, Hq, D]
            n = qi.shape[0]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            logits = torch.einsum("nhd,lhd->hnl", qi, k) * scale
            if self.logits_soft_cap:
                logits = self.logits_soft_cap * torch.tanh(logits / self.logits_soft_cap)
            q_pos = torch.arange(kv_len - n, kv_len)[:, None]
            k_pos = torch.arange(kv_len)[None, :]
            keep = torch.ones(n, kv_len, dtype=torch.bool)
            if causal:
                keep &= k_pos <= q_pos
            if self.window_left >= 0:
                keep &= k_pos >= q_pos - self.window_left
            logits = logits.masked_fill(~keep, float("-inf"))
            out[rows] = torch.einsum("hnl,lhd->nhd", torch.softmax(logits, dim=-1), v).to(q.dtype)
        return out


class BatchDecodeWithPagedKVCacheWrapper(_Base):
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend="auto",
        jit_args=None,
    ):
        assert kv_layout == "NHD", kv_layout
        assert float_workspace_buffer.dtype == torch.uint8
        self._init_workspace()
        self.use_cuda_graph = use_cuda_graph
        self.use_tensor_cores = use_tensor_cores
        self.planned = False
        self.plan_count = 0
        self.run_count = 0
        if use_cuda_graph:
            for name, t in (
                ("indptr", paged_kv_indptr_buffer),
                ("indices", paged_kv_indices_buffer),
                ("last_page_len", paged_kv_last_page_len_buffer),
            ):
                _check_i32(name + " buffer", t)
            self._fixed_batch = len(paged_kv_last_page_len_buffer)
            assert len(paged_kv_indptr_buffer) == self._fixed_batch + 1
            self._indptr_buf = paged_kv_indptr_buffer
            self._indices_buf = paged_kv_indices_buffer
            self._last_buf = paged_kv_last_page_len_buffer

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *,
        pos_encoding_mode="NONE",
        window_left=-1,
        window_right=0,
        logits_soft_cap=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        data_type=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        non_blocking=True,
        block_tables=None,
        seq_lens=None,
        fixed_split_size=None,
        disable_split_kv=False,
        q_len_per_req=1,
    ):
        assert pos_encoding_mode == "NONE"
        self._store(
            indptr,
            indices,
            last_page_len,
            page_size,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            window_left,
            logits_soft_cap,
            sm_scale,
            q_data_type,
            kv_data_type or q_data_type,
        )

    def run(
        self,
        q,
        paged_kv_cache,
        *args,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        out=None,
        lse=None,
        return_lse=False,
        enable_pdl=None,
        window_left=None,
        sinks=None,
    ):
        self.run_count += 1
        batch = len(self._last_buf)
        assert q.shape[0] == batch, f"decode run with {q.shape[0]} rows, planned batch {batch}"
        return self._attend(q, paged_kv_cache, list(range(batch + 1)), causal=False)


class BatchPrefillWithPagedKVCacheWrapper(_Base):
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend="auto",
        jit_args=None,
        jit_kwargs=None,
        variant_owns_mask=False,
    ):
        assert kv_layout == "NHD", kv_layout
        assert not use_cuda_graph, "the backend captures decode steps only"
        self._init_workspace()
        self.use_cuda_graph = False
        self.planned = False
        self.plan_count = 0
        self.run_count = 0

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        head_dim_vo=None,
        custom_mask=None,
        packed_custom_mask=None,
        causal=False,
        pos_encoding_mode="NONE",
        use_fp16_qk_reduction=False,
        sm_scale=None,
        window_left=-1,
        logits_soft_cap=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking=True,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len=0,
        max_item_len_ptr=None,
        seq_lens=None,
        seq_lens_q=None,
        block_tables=None,
        max_token_per_sequence=None,
        max_sequence_kv=None,
        fixed_split_size=None,
        disable_split_kv=False,
        uniform_q_len=None,
    ):
        _check_i32("qo_indptr", qo_indptr)
        assert len(qo_indptr) == len(paged_kv_last_page_len) + 1
        self._qo_indptr = qo_indptr.tolist()
        self.causal = causal
        self._store(
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            page_size,
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            window_left,
            logits_soft_cap,
            sm_scale,
            q_data_type,
            kv_data_type or q_data_type,
        )

    def run(
        self,
        q,
        paged_kv_cache,
        *args,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        out=None,
        lse=None,
        return_lse=False,
        enable_pdl=None,
        window_left=None,
        sinks=None,
    ):
        self.run_count += 1
        return self._attend(q, paged_kv_cache, self._qo_indptr, causal=self.causal)


def as_module() -> types.ModuleType:
    """This file as a fresh module object named ``flashinfer`` (for ``sys.modules``)."""
    mod = types.ModuleType("flashinfer")
    mod.__version__ = __version__
    mod.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    mod.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    return mod
