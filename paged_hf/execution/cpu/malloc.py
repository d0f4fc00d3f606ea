"""glibc's malloc, set once per process for a CPU engine's steps.

Design notes: docs/internals.md, paged_hf/execution/cpu/malloc.py.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

logger = logging.getLogger("paged_hf")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_BYTES = 256 << 20
_OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")
_state: dict = {"tuned": None, "why": None, "kept_blocks": False}


def reason_to_leave_alone() -> str | None:
    """Why the process's malloc is not ours to set, or None."""
    if os.environ.get("PAGED_HF_CPU_MALLOC", "1") == "0":
        return "PAGED_HF_CPU_MALLOC=0"
    preload = os.environ.get("LD_PRELOAD", "")
    for name in _OTHER_ALLOCATORS:
        if name in preload:
            return f"{name} is preloaded"
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc's malloc"
    tuned = sorted(k for k in os.environ if k.startswith("MALLOC_") and k.endswith("_"))
    if tuned:
        return f"{tuned[0]} is set"
    return None


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return None


def keep_bytes() -> int:
    """The most bytes of freed large blocks kept for the next step: ``PAGED_HF_CPU_KEEP_BYTES``, or
    1 GiB, at most an eighth of the memory available when first asked."""
    env = os.environ.get("PAGED_HF_CPU_KEEP_BYTES")
    if env is not None:
        return max(0, int(env))
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 8 << 30
    return min(1 << 30, available // 8)


def _keep_large_blocks() -> bool:
    """torch's CPU allocator wrapped so a step's freed large blocks serve the next step (the C++ op)."""
    from . import ops

    if not ops.load():
        return False
    return bool(torch.ops.paged_hf.keep_large_blocks(keep_bytes()))


def release() -> int:
    """Give the kept large blocks back to the system; returns the bytes given back."""
    if not _state.get("kept_blocks"):
        return 0
    return int(torch.ops.paged_hf.trim_kept_blocks())


def tune() -> bool:
    """Set glibc's thresholds and keep large blocks, once per process; True when the thresholds are set
    (now or before)."""
    if _state["tuned"] is not None:
        return _state["tuned"]
    why = reason_to_leave_alone()
    libc = None if why else _glibc()
    if why is None and libc is None:
        why = "the C library is not glibc"
    ok = (
        why is None
        and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_BYTES))
        and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
    )
    if why is None and not ok:
        why = "mallopt refused the thresholds"
    _state.update(tuned=ok, why=why, kept_blocks=bool(ok and _keep_large_blocks()))
    if ok:
        logger.debug(
            "paged_hf: glibc malloc keeps freed memory for the next step (mmap threshold %d MiB, "
            "trim threshold %d MiB)",
            MMAP_BYTES >> 20,
            TRIM_BYTES >> 20,
        )
    else:
        logger.debug("paged_hf: malloc left as it is: %s", why)
    return ok


def status() -> dict:
    """Whether ``tune`` set the thresholds (None: not asked yet), and if not, why; whether large blocks
    are kept (``kept_blocks``)."""
    return dict(_state)
