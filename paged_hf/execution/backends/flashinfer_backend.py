"""FlashInfer paged attention (CUDA): the fast backend, same interface as ``TorchBackend``.

Importing this module imports flashinfer, so only ``select_backend`` imports it, and a CPU
install of paged_hf never does. Without flashinfer the import fails with an install hint.

Design notes: docs/internals.md, paged_hf/execution/backends/flashinfer_backend.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache.kv_groups import CacheGroup, SlabPlaces
from ..kv_geometry import KVLayout, as_layout
from ..metadata import GroupTables, StepMetadata
from .swap import SwapMixin

try:
    import flashinfer
except ImportError as e:  # pragma: no cover - depends on the machine
    raise ImportError(
        f"paged_hf's FlashInfer backend could not import flashinfer ({e}). Install it with "
        "`pip install paged_hf[cuda]` (flashinfer-python 0.7), or choose backend='torch'."
    ) from e

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256, 512)  # FlashInfer's DISPATCH_HEAD_DIM
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace, shared by all wrappers
# Kernel choice. "auto" lets FlashInfer pick (FA3 prefill on Hopper); None: tensor-core decode when
# the GQA group is larger than 4. PREFILL_BACKEND="fa2" with DECODE_TENSOR_CORES=True makes prefill
# and decode share one JIT-compiled module per variant (fewer, shorter compiles on a fresh machine).
PREFILL_BACKEND = "auto"
DECODE_TENSOR_CORES: bool | None = None

# (window_left, logits_soft_cap (0: none), sm_scale, q_heads, kv_heads, head_dim, cache group)
Variant = tuple[int, float, float, int, int, int, int]


def unsupported_reason(dtype: torch.dtype, layout: KVLayout | int) -> str | None:
    """Why FlashInfer cannot run this model (``layout``: its per-layer KV geometry, or one
    head_dim for every layer), or None when it can."""
    if dtype not in SUPPORTED_DTYPES:
        return (
            f"FlashInfer kernels take float16 or bfloat16, the model is {dtype}: load it with "
            "dtype=torch.bfloat16, or use backend='torch'"
        )
    layers = layout.layers if isinstance(layout, KVLayout) else None
    dims = (
        sorted({s.k_dim for s in layers} | {s.v_dim for s in layers}) if layers else [int(layout)]
    )
    for layer_idx, spec in enumerate(layers or ()):
        if spec.k_dim != spec.v_dim:
            return (
                f"layer {layer_idx} has K and V of different widths ({spec.k_dim} / {spec.v_dim}, MLA); the paged "
                "FlashInfer wrappers used here take one head_dim: use backend='torch'"
            )
        if spec.sinks:
            return f"layer {layer_idx} has attention sinks (s_aux), not wired to FlashInfer here: use backend='torch'"
        if spec.chunk is not None:
            return (
                f"layer {layer_idx} uses chunked attention (chunks of {spec.chunk}), which FlashInfer's paged "
                "wrappers do not do: use backend='torch'"
            )
    bad = [d for d in dims if d not in SUPPORTED_HEAD_DIMS]
    if bad:
        return f"FlashInfer kernels support head_dim {SUPPORTED_HEAD_DIMS}, the model has {bad[0]}: use backend='torch'"
    return None


@dataclass
class _HostCSR:
    """The step's CSR arrays that FlashInfer's plan reads on the host (int32, CPU)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    last_page_len: torch.Tensor


def host_csr(meta: StepMetadata, starts: list[int] | None = None) -> _HostCSR:
    """Rebuild qo_indptr / kv_indptr / last_page_len on the host from ``q_lens`` / ``kv_lens``
    (a cache group's sequences holding their KV from ``starts``: their pages begin there)."""
    bs = meta.block_size
    qo, kv, last = [0], [0], []
    for i, (q, L) in enumerate(zip(meta.q_lens, meta.kv_lens)):
        start = starts[i] if starts else 0
        pages = -(-L // bs) - start // bs
        qo.append(qo[-1] + q)
        kv.append(kv[-1] + pages)
        last.append(L - start - (pages - 1) * bs)
    i32 = torch.int32
    return _HostCSR(
        torch.tensor(qo, dtype=i32), torch.tensor(kv, dtype=i32), torch.tensor(last, dtype=i32)
    )


@dataclass
class _GraphBuffers:
    """Fixed-address buffers shared by every bucket's CUDA-graph decode wrappers."""

    kv_indptr: torch.Tensor  # [max_batch + 1] int32; a bucket of b uses [:b + 1]
    kv_indices: torch.Tensor  # [max_indices] int32
    last_page_len: torch.Tensor  # [max_batch] int32; a bucket of b uses [:b]
    k_rows: torch.Tensor  # [max_batch] int64: flat K rows of the new tokens
    v_rows: torch.Tensor


class FlashInferBackend(SwapMixin):
    name = "flashinfer"
    supports_cuda_graphs = True
    # eager steps; CUDA-graph steps keep every block (cache_groups in runner.py)
    serves_cache_groups = True

    def __init__(
        self,
        layout: KVLayout | int,
        num_blocks: int,
        block_size: int,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        groups: tuple[CacheGroup, ...] | None = None,
    ) -> None:
        """``layout``: the model's per-layer geometry, or a number of layers all of ``kv_heads`` x
        ``head_dim``; ``groups``: its cache groups (layer j of every group reads slab j through its
        group's pages; default one group of every layer)."""
        self.layout = as_layout(layout, kv_heads, head_dim)
        reason = unsupported_reason(dtype, self.layout)
        if reason is not None:
            raise ValueError(f"backend='flashinfer': {reason}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = torch.device(device)
        places = SlabPlaces.of(groups, self.layout.num_layers)
        self.groups, self.group_of, slab_of = places.groups, places.group_of, places.slab_of
        self.kv_slabs = []
        for layer in places.slab_layers:
            spec = self.layout.layers[layer]
            self.kv_slabs.append(
                torch.zeros(
                    num_blocks,
                    2,
                    block_size,
                    spec.kv_heads,
                    spec.k_dim,
                    dtype=dtype,
                    device=self.device,
                )
            )
        self.kv = [self.kv_slabs[slab_of[i]] for i in range(self.layout.num_layers)]
        self._flat = [
            c.view(num_blocks * 2 * block_size, c.shape[-2], c.shape[-1]) for c in self.kv
        ]
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.variants: list[Variant] = []  # every variant seen, in first-use order
        self._eager: dict[tuple[str, Variant], object] = {}
        self._graph: dict[tuple[int, Variant], object] = {}
        self._int_workspaces: dict[Variant, tuple[torch.Tensor, torch.Tensor]] = {}
        self._graph_bufs: _GraphBuffers | None = None
        # the current step
        self._meta: StepMetadata | None = None
        self._csr: _HostCSR | None = None
        self._tables: list[GroupTables] = []
        self._csrs: list[_HostCSR] = []
        self._rows: list[
            tuple[torch.Tensor, torch.Tensor]
        ] = []  # per group: flat K and V rows of the new tokens
        self._graph_batch: int | None = None
        self._planned: dict[Variant, object] = {}
        self._k_rows = self._v_rows = None

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def prepare_cuda_graphs(self, max_batch: int, max_indices: int) -> None:
        """Allocate the fixed buffers that captured decode steps read (once, before capture)."""
        i32, dev = torch.int32, self.device
        self._graph_bufs = _GraphBuffers(
            kv_indptr=torch.zeros(max_batch + 1, dtype=i32, device=dev),
            kv_indices=torch.zeros(max_indices, dtype=i32, device=dev),
            last_page_len=torch.ones(max_batch, dtype=i32, device=dev),
            k_rows=torch.zeros(max_batch, dtype=torch.long, device=dev),
            v_rows=torch.zeros(max_batch, dtype=torch.long, device=dev),
        )

    def graph_fits(self, batch: int, num_pages: int) -> bool:
        """Whether a padded decode step of ``batch`` rows reading ``num_pages`` pages fits the buffers."""
        g = self._graph_bufs
        return g is not None and batch < g.kv_indptr.numel() and num_pages <= g.kv_indices.numel()

    # ---- once per step -------------------------------------------------------------------------
    def plan(self, meta: StepMetadata, graph_batch: int | None = None) -> None:
        """Plan every known variant for this step; ``graph_batch``: a padded decode step of that
        bucket, to be run by (or captured into) a CUDA graph."""
        bs = self.block_size
        slots = meta.slot_mapping.to(torch.long)
        # block b, offset o -> flat K row b*2*bs + o; V is bs rows later
        k_rows = slots + (slots // bs) * bs
        if graph_batch is not None:
            g = self._graph_bufs
            assert g is not None, "prepare_cuda_graphs() must run before a graph step"
            assert meta.num_seqs == meta.num_tokens == graph_batch, (
                "a graph step is a padded pure-decode step"
            )
            g.k_rows[:graph_batch].copy_(k_rows)
            g.v_rows[:graph_batch].copy_(k_rows + bs)
            self._k_rows, self._v_rows = g.k_rows[:graph_batch], g.v_rows[:graph_batch]
        else:
            self._k_rows, self._v_rows = k_rows, k_rows + bs
        self._meta = meta
        self._csr = host_csr(meta)
        self._tables = meta.groups if len(self.groups) > 1 else []
        self._csrs = [self._csr] + [host_csr(meta, t.kv_starts) for t in self._tables[1:]]
        self._rows = [(self._k_rows, self._v_rows)]
        if self._tables:
            assert graph_batch is None, "CUDA-graph steps run with one cache group"
            for t in self._tables[1:]:
                slots = t.slot_mapping.to(torch.long)
                rows = slots + (slots // bs) * bs
                self._rows.append((rows, rows + bs))
        self._graph_batch = graph_batch
        self._planned = {}
        for variant in self.variants:
            self._plan(variant)

    def _wrapper(self, variant: Variant) -> object:
        w = self._new_or_known_wrapper(variant)
        self._share_int_workspace(w, variant)
        return w

    def _share_int_workspace(self, wrapper: object, variant: Variant) -> None:
        """One int workspace (8 MiB on the device, 8 MiB pinned) per variant, not per wrapper: a
        step plans each variant once, for one kind (prefill, decode or one graph bucket), and a
        graph bucket is planned again before every replay, so the variant's wrappers never hold
        live plans at once. Per wrapper it was (2 + buckets) x 16 MiB a variant: 340 MiB at 256
        sequences (cuda_memory.reserve_bytes counts one per variant)."""
        # FlashInfer renamed it: each keeps its own
        if not hasattr(wrapper, "_int_workspace_buffer"):
            return
        shared = self._int_workspaces.setdefault(
            variant, (wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer)
        )
        wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer = shared

    def _new_or_known_wrapper(self, variant: Variant) -> object:
        meta = self._meta
        group = variant[3] // variant[4]
        use_tc = group > 4 if DECODE_TENSOR_CORES is None else DECODE_TENSOR_CORES
        if self._graph_batch is not None:
            key = (self._graph_batch, variant)
            w = self._graph.get(key)
            if w is None:
                g, b = self._graph_bufs, self._graph_batch
                w = self._graph[key] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace,
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=use_tc,
                    paged_kv_indptr_buffer=g.kv_indptr[: b + 1],
                    paged_kv_indices_buffer=g.kv_indices,
                    paged_kv_last_page_len_buffer=g.last_page_len[:b],
                )
            return w
        kind = "decode" if meta.is_pure_decode else "prefill"
        w = self._eager.get((kind, variant))
        if w is None:
            if kind == "decode":
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=use_tc
                )
            else:
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace, "NHD", backend=PREFILL_BACKEND
                )
            self._eager[(kind, variant)] = w
        return w

    def _plan(self, variant: Variant) -> object:
        window_left, softcap, sm_scale, q_heads, kv_heads, head_dim, g = variant
        w = self._wrapper(variant)
        csr, meta = self._csrs[g], self._meta
        kv_indices = self._tables[g].kv_indices if self._tables else meta.kv_indices
        common = dict(
            window_left=window_left,
            logits_soft_cap=softcap or None,
            sm_scale=sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        if isinstance(w, flashinfer.BatchPrefillWithPagedKVCacheWrapper):
            w.plan(
                csr.qo_indptr,
                csr.kv_indptr,
                kv_indices,
                csr.last_page_len,
                q_heads,
                kv_heads,
                head_dim,
                self.block_size,
                causal=True,
                **common,
            )
        else:
            w.plan(
                csr.kv_indptr,
                kv_indices,
                csr.last_page_len,
                q_heads,
                kv_heads,
                head_dim,
                self.block_size,
                **common,
            )
        self._planned[variant] = w
        return w

    # ---- once per layer ------------------------------------------------------------------------
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
        """q/k/v: [1, heads, T, head_dim] -> attention output [1, T, q_heads, head_dim]. The window
        is the layer's own (the layout); one the model passes must agree with it."""
        spec = self.layout.layers[layer_idx]
        # unsupported_reason refuses such layouts; a model that grew sinks since
        if sinks is not None:
            raise ValueError(
                f"flashinfer backend: layer {layer_idx} passed attention sinks, which it does not apply"
            )
        if (
            sliding_window is not None
            and spec.window is not None
            and int(sliding_window) != spec.window
        ):
            raise ValueError(
                f"layer {layer_idx}: the model passed sliding_window={sliding_window}, but the window found "
                f"when it was patched is {spec.window}"
            )
        flat = self._flat[layer_idx]
        g = self.group_of[layer_idx]
        k_rows, v_rows = self._rows[g]
        flat.index_copy_(0, k_rows, key[0].transpose(0, 1).to(flat.dtype))
        flat.index_copy_(0, v_rows, value[0].transpose(0, 1).to(flat.dtype))
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        variant: Variant = (
            -1 if spec.window is None else spec.window - 1,
            float(softcap) if softcap else 0.0,
            float(scaling),
            int(query.shape[1]),
            spec.kv_heads,
            spec.k_dim,
            g,
        )
        wrapper = self._planned.get(variant)
        # first forward only: learn the variant and plan it now (never under capture)
        if wrapper is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"flashinfer backend: attention variant {variant} of layer {layer_idx} was not "
                    "planned before CUDA-graph capture (run one eager step of this bucket first)"
                )
            if variant not in self.variants:
                self.variants.append(variant)
            wrapper = self._plan(variant)
        q = query[0].transpose(0, 1)  # [T, Hq, D]
        if q.dtype != self.dtype:
            q = q.to(self.dtype)
        out = wrapper.run(q.contiguous(), self.kv[layer_idx])
        return out.unsqueeze(0)
