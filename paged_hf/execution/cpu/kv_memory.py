"""The CPU KV cache's memory: zero pages from the kernel, faulted in when first written.

``torch.zeros`` writes every byte of the pool when the engine is built, so an engine's first
request waits for the whole pool (1 GiB by default on a CPU) to be faulted in: 0.4 s on a Zen 4
virtual machine here, 2.3-2.6 s on a Xeon one where the host backs the guest's memory on first
touch, most of a short lm-eval task's or a first ``generate``'s wait. An anonymous mapping reads as
zeros by the kernel's promise and costs nothing until a page is written, so a run pays for the pages
it fills and no more (and the block pool hands out the pages it has written first: its free list is
a stack). Elsewhere (not Linux) the pool is ``torch.zeros``.

Plain 4 KiB pages: asked for transparent huge pages (``MADV_HUGEPAGE``) the first write of 256 MiB
took 0.44-0.57 s against 0.12 s (the kernel compacting memory for each 2 MiB fault), and reads were
no faster.

Either way the pool reads as zeros until written: the attention kernels rely on it (a page's unused
slots are multiplied by zero probabilities, and a zero V is what keeps that product zero).
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
