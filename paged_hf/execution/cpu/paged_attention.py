"""CPU attention that reads K/V through the block table in place: the ``paged_hf::paged_attention``
C++ op (``paged_hf/execution/cpu/csrc/paged_attention.cpp``) and the backend that uses it.

Design notes: docs/internals.md, paged_hf/execution/cpu/paged_attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.torch_backend import TorchBackend, _GroupPlan, _only_group, layer_window
from ..kv_geometry import KVLayout
from ..metadata import GroupTables, StepMetadata
from . import ops
from .ops import compile_flags

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    """Whether the op is usable on this machine (builds the library the first time)."""
    return ops.load()


# Which sequences of a step the kernel attends; the others go to the torch path's SDPA. The limits
# are where the generic path stops beating SDPA (docs/measurements.md, "The CPU kernel's routes").
KERNEL_MAX_Q_LEN = 32
KERNEL_MAX_AREA = 512 * 512  # q_len x kv_len
AVX2_KERNEL_MAX_Q_LEN = 16
AVX2_KERNEL_MAX_AREA = 64 * 64
_LIMITS: list = []


def kernel_limits() -> tuple[int, int]:
    """(most new tokens, most q_len x kv_len) of a sequence the generic path attends, for this build."""
    if not _LIMITS:
        avx512 = "-DCPU_CAPABILITY=AVX512" in compile_flags()
        _LIMITS.append(
            (KERNEL_MAX_Q_LEN, KERNEL_MAX_AREA)
            if avx512
            else (AVX2_KERNEL_MAX_Q_LEN, AVX2_KERNEL_MAX_AREA)
        )
    return _LIMITS[0]


def kernel_takes(q_len: int, kv_len: int, bf16_path: bool) -> bool:
    """Whether the kernel, not SDPA, attends a sequence with ``q_len`` new tokens of ``kv_len``."""
    if bf16_path:
        return True
    most_q, most_area = kernel_limits()
    return q_len <= most_q or q_len * kv_len <= most_area


def amx_built() -> bool:
    """Whether this CPU's build of the kernel has the AMX path (paged_attention_amx.cpp); it runs unless
    ``PAGED_HF_CPU_AMX=0``."""
    return "-mamx-bf16" in compile_flags()


def bf16_path(layout: KVLayout, block_size: int, dtype: torch.dtype) -> bool:
    """Whether every layer runs one of the kernel's bf16 paths, which attend sequences of any length:
    bf16 caches, head dims multiples of 32 up to 512, and blocks of any size dividing 16 (smaller pages
    gathered 16 keys at a time), built for AVX-512 (``bf16_path`` in paged_attention.cpp: bf16 pair dot
    products, emulated by fp32 FMAs without AVX512-BF16) or for AMX (``amx_ready`` in
    paged_attention_amx.cpp)."""
    if dtype != torch.bfloat16 or not all(
        s.k_dim % 32 == 0 and s.v_dim % 32 == 0 and s.v_dim <= 512 and s.k_dim <= 512
        for s in layout.layers
    ):
        return False
    return 16 % block_size == 0 and "-DCPU_CAPABILITY=AVX512" in compile_flags()


class CpuPagedBackend(TorchBackend):
    """The torch backend whose attention runs ``paged_hf::paged_attention`` (all of it on the bf16
    path; decodes, short chunks and small prompts otherwise)."""

    name = "cpu"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._bf16_path = bf16_path(self.layout, self.block_size, self.kv[0].dtype)

    @property
    def bf16_path_everywhere(self) -> bool:
        """Whether every layer's attention runs the kernel's bf16 paths (row-invariant ones)."""
        return self._bf16_path

    def plan(self, meta: StepMetadata) -> None:
        self._meta = meta
        self._groups = [self._plan_kernel(meta, g) for g in range(len(self.groups))]

    def _plan_kernel(self, meta: StepMetadata, g: int) -> "_KernelPlan":
        """Group ``g``'s writes and kernel arguments; its torch plan is made when a layer needs it."""
        tables = meta.groups[g] if meta.groups else _only_group(meta)
        held = [kv - start for kv, start in zip(meta.kv_lens, tables.kv_starts)]
        short = [
            i
            for i, (q, kv) in enumerate(zip(meta.q_lens, held))
            if kernel_takes(q, kv, self._bf16_path)
        ]
        plan = _KernelPlan(None, has_long=len(short) < meta.num_seqs, tables=tables)
        if short:
            if len(short) == meta.num_seqs:
                q_start, kv_indptr, kv_indices = (
                    meta.qo_indptr[:-1],
                    tables.kv_indptr,
                    tables.kv_indices,
                )
            else:
                q_start = meta.qo_indptr[short]
                blocks = [tables.kv_blocks[i] for i in short]
                kv_indptr = torch.tensor([0] + [len(b) for b in blocks], dtype=torch.int32).cumsum(
                    0, dtype=torch.int32
                )
                kv_indices = torch.tensor([b for bl in blocks for b in bl], dtype=torch.int32)
            plan.args = (
                q_start.contiguous(),
                torch.tensor([meta.q_lens[i] for i in short], dtype=torch.int32),
                torch.tensor([held[i] for i in short], dtype=torch.int32),
                kv_indptr.contiguous(),
                kv_indices.contiguous(),
            )
            # blocks a window freed: where each table starts in its sequence
            if any(tables.kv_starts):
                plan.offsets = torch.tensor([tables.kv_starts[i] for i in short], dtype=torch.int32)
        return plan

    def _torch_plan(self, g: int, kind: str) -> None:
        """The torch backend's plan of group ``g`` for every sequence ("full") or for its long
        prefills alone ("long"), in ``self._plans`` where the torch path reads it."""
        plan = self._groups[g]
        if plan.torch_kind == kind:
            return
        full = self._plan_group(self._meta, g)
        if kind == "long":
            full.decode_groups = []
            full.prefills = [
                p
                for p in full.prefills
                if not kernel_takes(p.rows.stop - p.rows.start, p.kv_len - p.start, self._bf16_path)
            ]
        plan.torch, plan.torch_kind = full, kind
        self._plans = [k.torch for k in self._groups]

    def kernel_serves(
        self, query: torch.Tensor, layer_idx: int, sinks: torch.Tensor | None = None
    ) -> bool:
        """Whether the op can compute this layer: a dtype it takes, and no feature it lacks (sinks,
        chunked-local attention)."""
        k = self.kv[2 * layer_idx]
        return (
            query.dtype == k.dtype
            and k.dtype in DTYPES
            and query.device.type == "cpu"
            and sinks is None
            and self.layout.layers[layer_idx].chunk is None
        )

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
        g = self.group_of[layer_idx]
        plan = self._groups[g]
        if not self.kernel_serves(query, layer_idx, sinks):
            self._torch_plan(g, "full")
            return super().attend(
                layer_idx, query, key, value, scaling, sliding_window, softcap, sinks=sinks
            )
        # the layout's, as torch's
        window = layer_window(self.layout.layers[layer_idx], layer_idx, sliding_window)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        v_cache = self.kv[2 * layer_idx + 1]
        if plan.has_long:  # the torch path writes the new K/V and attends the long prefills
            self._torch_plan(g, "long")
            out = super().attend(layer_idx, query, key, value, scaling, sliding_window, softcap)[0]
        else:
            self._store_kv(layer_idx, key, value, plan)
            out = query.new_empty(query.shape[2], query.shape[1], v_cache.shape[-1])
        if plan.args is not None:
            torch.ops.paged_hf.paged_attention(
                query[0].transpose(0, 1),
                self.kv[2 * layer_idx],
                v_cache,
                *plan.args,
                float(scaling),
                int(window or 0),
                float(softcap or 0.0),
                out,
                plan.offsets,
            )
        return out.unsqueeze(0)

    def _store_kv(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, plan: "_KernelPlan"
    ) -> None:
        """The layer's new K/V into their slots: ``paged_hf::write_kv`` reads them where they are, or, for
        what it does not take (another dtype than the cache's, a strided last dim), the torch path's copy."""
        k_cache, v_cache = self.kv[2 * layer_idx], self.kv[2 * layer_idx + 1]
        k, v = key[0], value[0]
        if (
            k.dtype == k_cache.dtype
            and v.dtype == v_cache.dtype
            and k.stride(-1) == 1
            and v.stride(-1) == 1
        ):
            torch.ops.paged_hf.write_kv(k, v, k_cache, v_cache, plan.tables.slot_mapping)
            return
        if plan.writes is None:
            plan.writes = self._plan_write(plan.tables)
        self._write_kv(layer_idx, key, value, plan.writes)


@dataclass
class _KernelPlan:
    torch: _GroupPlan | None  # made when a layer needs the torch path
    has_long: bool
    tables: GroupTables  # the group's tables (slot_mapping: where new K/V go)
    args: tuple | None = None
    torch_kind: str | None = None
    writes: dict | None = None  # the torch path's write rows, made if a layer's K/V need them
    # tokens before each table's first block (freed by a window)
    offsets: torch.Tensor | None = None
