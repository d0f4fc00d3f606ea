"""CPU attention that reads K/V through the block table in place: the ``paged_hf::paged_attention``
C++ op (``paged_hf/execution/csrc/paged_attention.cpp``) and the backend that uses it.

The torch backend copies every decoding sequence's K/V out of the pages for every layer of every
step; this op reads them where they are: one call per layer for all sequences of the step, decode
and prefill chunks alike, parallel over (sequence, KV head, query tile), fp32 online softmax,
sliding window, softcap and per-layer scaling. ``CpuPagedBackend`` is the torch backend with that
op in its ``attend``; the torch backend stays the reference (the tests check one against the other
and both against transformers), and any layer the op cannot serve (a feature it lacks, a dtype it
does not take) still runs the torch path.

The op is compiled by ``torch.utils.cpp_extension`` on first use (~40 s on 2 cores; gcc/g++ and
ninja) into ``$PAGED_HF_EXTENSIONS_DIR``, default ``<paged_hf cache>/extensions`` (the cache is
``$PAGED_HF_CACHE`` or ``~/.cache/paged_hf``), under a name that hashes the source, torch's
version and the flags, so later processes load it in well under a second. Without a compiler (or
with ``PAGED_HF_CPU_KERNEL=0``) backend ``auto`` stays on the torch path, with one warning.

    from paged_hf.execution.backends import cpu_paged_attention as cpa
    cpa.load()                # True when the op is usable (builds it the first time)
    torch.ops.paged_hf.paged_attention(query, k_cache, v_cache, q_start, q_len, kv_len,
                                       kv_indptr, kv_indices, scale, sliding_window, softcap, out)
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kv_geometry import KVLayout
from ..metadata import GroupTables, StepMetadata
from .torch_backend import TorchBackend, _GroupPlan, _only_group, layer_window

# one library for paged_hf's CPU ops: this attention (and its K/V writes), the gated delta rule of hybrid
# models' mixers (paged_hf/execution/mixer_kernels.py), the fused element-wise ops
# (paged_hf/execution/fused_ops.py) and the sampler's greedy pick (paged_hf/execution/sampler.py)
SOURCES = [
    Path(__file__).resolve().parent.parent / "csrc" / name
    for name in (
        "paged_attention.cpp",
        "paged_attention_amx.cpp",
        "gated_delta.cpp",
        "fused_ops.cpp",
        "sampling.cpp",
        "cpu_allocator.cpp",
    )
]
HEADERS = [Path(__file__).resolve().parent.parent / "csrc" / "paged_attention.h"]
OP_NAME = "paged_hf::paged_attention"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_state: dict = {"loaded": None, "error": None, "build_s": None, "path": None}


def extensions_dir() -> Path:
    root = os.environ.get("PAGED_HF_EXTENSIONS_DIR")
    if root:
        return Path(root).expanduser()
    cache = os.environ.get("PAGED_HF_CACHE") or os.path.join("~", ".cache", "paged_hf")
    return Path(cache).expanduser() / "extensions"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compile_flags() -> list[str]:
    """at::vec's widest path this CPU runs (AVX-512, AVX2, or its portable default)."""
    # -ffp-contract=off: a multiply and an add stay two roundings unless the code asks for an fma
    # (the fused element-wise ops reproduce transformers' roundings step by step)
    flags = [
        "-O3",
        "-DNDEBUG",
        "-fopenmp",
        "-fvisibility=hidden",
        "-fvisibility-inlines-hidden",
        "-ffp-contract=off",
    ]
    cpu = _cpu_flags()
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu:
            flags += [
                "-mavx512f",
                "-mavx512bw",
                "-mavx512vl",
                "-mavx512dq",
                "-mavx2",
                "-mfma",
                "-mf16c",
                "-DCPU_CAPABILITY=AVX512",
                "-DCPU_CAPABILITY_AVX512",
            ]
            if "avx512_bf16" in cpu:  # bf16 pair dot products (vdpbf16ps) for bf16 caches
                flags.append("-mavx512bf16")
                if {"amx_tile", "amx_bf16"} <= cpu:  # tile products (paged_attention_amx.cpp)
                    flags += ["-mamx-tile", "-mamx-bf16"]
        elif {"avx2", "fma", "f16c"} <= cpu:
            flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags


def _build_name(flags: list[str]) -> str:
    h = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS))
    h.update(torch.__version__.encode())
    h.update(" ".join(flags).encode())
    return f"paged_hf_attention_{h.hexdigest()[:12]}"


def _register_fake() -> None:
    @torch.library.register_fake(OP_NAME)
    def _fake(
        query,
        k_cache,
        v_cache,
        q_start,
        q_len,
        kv_len,
        kv_indptr,
        kv_indices,
        scale,
        sliding_window,
        softcap,
        out,
        kv_offset=None,
    ):
        return None  # writes `out` in place

    @torch.library.register_fake("paged_hf::gated_delta_recurrent")
    def _fake_gated_delta(q, k, v, g, beta, state, out, l2norm):
        return None  # writes `state` and `out` in place

    for name in ("rms_norm", "silu_and_mul", "rotary"):  # each writes its last argument in place
        torch.library.register_fake(f"paged_hf::{name}")(lambda *args: None)

    @torch.library.register_fake("paged_hf::write_kv")
    def _fake_write_kv(key, value, k_cache, v_cache, slots):
        return None  # writes the caches in place

    @torch.library.register_fake("paged_hf::greedy_max")
    def _fake_greedy_max(logits):
        return logits.new_empty(logits.shape[0]), logits.new_empty(
            logits.shape[0], dtype=torch.long
        )


def load(verbose: bool = False) -> bool:
    """Build (first time) and load the op; True when it is usable. A failure warns once and is remembered."""
    if _state["loaded"] is not None:
        return _state["loaded"]
    with _lock:
        if _state["loaded"] is not None:
            return _state["loaded"]
        if os.environ.get("PAGED_HF_CPU_KERNEL", "1") == "0":
            _state.update(loaded=False, error="disabled by PAGED_HF_CPU_KERNEL=0")
            return False
        try:
            t0 = time.perf_counter()
            _build_and_load(verbose)
            _state["build_s"] = time.perf_counter() - t0
            _register_fake()
            _state["loaded"] = True
        except Exception as e:  # no compiler, a failed build, a library that does not load
            _state.update(loaded=False, error=f"{type(e).__name__}: {e}".strip()[:2000])
            warnings.warn(
                f"paged_hf: the CPU paged attention kernel could not be built or loaded, so attention "
                f"runs on the slower pure-PyTorch path ({_state['error'].splitlines()[0][:300]}). It needs "
                f"g++ and ninja; set PAGED_HF_CPU_KERNEL=0 to skip it without this warning.",
                RuntimeWarning,
                stacklevel=3,
            )
        return _state["loaded"]


def _build_and_load(verbose: bool) -> None:
    if hasattr(torch.ops.paged_hf, "greedy_max"):  # another copy already registered them
        return
    from torch.utils import cpp_extension

    flags = compile_flags()
    name = _build_name(flags)
    build_dir = extensions_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    so = build_dir / f"{name}.so"
    if so.exists() and not (build_dir / "lock").exists():
        # built by an earlier process (and no build under way: cpp_extension holds that lock file
        # while it compiles): load it without cpp_extension's import and ninja check (~2 s)
        torch.ops.load_library(str(so))
    else:
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
    _state["path"] = str(so)


def status() -> dict:
    """Whether the op loaded, why not, how long loading (and building) took, where it lives."""
    return dict(_state)


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
            if any(
                tables.kv_starts
            ):  # blocks a window freed: where each table starts in its sequence
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
        window = layer_window(
            self.layout.layers[layer_idx], layer_idx, sliding_window
        )  # the layout's, as torch's
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
    offsets: torch.Tensor | None = (
        None  # tokens before each table's first block (freed by a window)
    )
