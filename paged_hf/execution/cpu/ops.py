"""paged_hf's one C++ library for the CPU (``csrc/``): built by ``torch.utils.cpp_extension`` on
first use into ``$PAGED_HF_EXTENSIONS_DIR`` (default ``<paged_hf cache>/extensions``) under a name
that hashes the sources, torch's version and the flags, then loaded; its ops are the paged
attention, the gated delta rule, the fused element-wise ops, the sampler's greedy pick, the
allocator hooks, the few-row bf16 GEMM and the compact layer's halves on it, and the weight-rows
GEMM (the weights where they lie). Without a compiler (or with ``PAGED_HF_CPU_KERNEL=0``)
``load()`` is False, once warned.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import warnings
from pathlib import Path

import torch

from . import isa

# one library for paged_hf's CPU ops: the paged attention (and its K/V writes), the gated delta rule of hybrid
# models' mixers (paged_hf/execution/cpu/mixer_kernels.py), the fused element-wise ops
# (paged_hf/execution/cpu/fused_ops.py) and the sampler's greedy pick (paged_hf/execution/sampler.py)
SOURCES = [
    Path(__file__).resolve().parent / "csrc" / name
    for name in (
        "paged_attention.cpp",
        "paged_attention_amx.cpp",
        "gated_delta.cpp",
        "fused_ops.cpp",
        "sampling.cpp",
        "cpu_allocator.cpp",
        "small_rows_gemm.cpp",
        "compact_rows.cpp",
        "weight_rows_gemm.cpp",
    )
]
HEADERS = [Path(__file__).resolve().parent / "csrc" / "paged_attention.h"]
OP_NAME = "paged_hf::paged_attention"

_lock = threading.Lock()
_state: dict = {"loaded": None, "error": None, "build_s": None, "path": None}


def extensions_dir() -> Path:
    root = os.environ.get("PAGED_HF_EXTENSIONS_DIR")
    if root:
        return Path(root).expanduser()
    cache = os.environ.get("PAGED_HF_CACHE") or os.path.join("~", ".cache", "paged_hf")
    return Path(cache).expanduser() / "extensions"


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
    if isa.at_least("avx2"):
        if isa.at_least("avx512"):
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
            if isa.at_least("avx512_bf16"):  # bf16 pair dot products (vdpbf16ps) for bf16 caches
                flags.append("-mavx512bf16")
                if isa.at_least("amx"):  # tile products (paged_attention_amx.cpp)
                    flags += ["-mamx-tile", "-mamx-bf16"]
        else:
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

    if hasattr(torch.ops.paged_hf, "small_rows_gemm"):  # built for AVX-512 bf16 CPUs only

        @torch.library.register_fake("paged_hf::small_rows_gemm")
        def _fake_small_rows_gemm(x, packed, bias, n):
            return x.new_empty(x.shape[0], n)


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
