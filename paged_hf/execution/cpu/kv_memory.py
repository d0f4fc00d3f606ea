"""The CPU KV cache's memory: zero pages from the kernel, faulted in when first written.

Design notes: docs/internals.md, paged_hf/execution/cpu/kv_memory.py.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

SMALL = 1 << 20  # under this a pool is torch.zeros: nothing to save


def lazy() -> bool:
    """Whether CPU pools come from anonymous mappings here."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MAP_ANONYMOUS")


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous zero CPU tensor of ``shape``, page aligned: an anonymous mapping where
    ``lazy()`` and it spans a megabyte or more, else ``torch.zeros``."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < SMALL or not lazy():
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(
        -1,
        nbytes,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )
    # the tensor holds a reference to the mapping, which is unmapped when the last one goes
    return torch.frombuffer(region, dtype=dtype, count=numel).view(shape)
