"""The CPU KV pool comes from an anonymous mapping: zero until written, resident only where written."""

from __future__ import annotations

import gc
import mmap
import sys

import pytest
import torch

from paged_hf.execution.backends.torch_backend import TorchBackend
from paged_hf.execution.cpu import kv_memory as cpu_kv_memory

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="anonymous mappings: Linux only"
)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_pool_reads_zero_keeps_what_is_written_and_is_aligned():
    assert cpu_kv_memory.lazy()
    for dtype in (torch.bfloat16, torch.float32):
        x = cpu_kv_memory.zeros((64, 3, 16, 64 * 8), dtype)
        assert x.shape == (64, 3, 16, 512) and x.dtype == dtype and x.is_contiguous()
        assert x.data_ptr() % mmap.PAGESIZE == 0
        assert not x.any()
        values = torch.randn(x.shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        x.copy_(values)
        assert torch.equal(x, values)
        assert torch.equal(x.view(-1, 512)[5], values.view(-1, 512)[5])  # views share its memory
    small = cpu_kv_memory.zeros((4, 16), torch.float32)  # under a megabyte: plain torch.zeros
    assert not small.any() and small.shape == (4, 16)


def test_building_a_backend_does_not_fault_in_its_pool_and_releasing_it_unmaps_it():
    gc.collect()
    before = _rss_bytes()
    # 24 layers x K and V x 2,048 blocks of 16 x 4 heads x 64 dims, fp32: 1.5 GiB
    backend = TorchBackend(
        24, num_blocks=2048, block_size=16, kv_heads=4, head_dim=64, dtype=torch.float32
    )
    pool = sum(t.numel() * t.element_size() for t in backend.kv_slabs)
    assert pool == 24 * 2 * 2048 * 16 * 4 * 64 * 4
    built = _rss_bytes()
    assert built - before < pool // 16, (
        f"building faulted in {(built - before) >> 20} MiB of a {pool >> 20} MiB pool"
    )
    for t in backend.kv_slabs[:4]:
        t[:1024].fill_(1.0)  # a run that fills half of four slabs
    written = _rss_bytes()
    half_of_four = sum(t[:1024].numel() * t.element_size() for t in backend.kv_slabs[:4])
    assert half_of_four <= written - before < half_of_four + pool // 16
    assert all(not t[1024:].any() for t in backend.kv_slabs[:4]) and not backend.kv_slabs[5].any()
    del backend, t
    gc.collect()
    assert _rss_bytes() - before < pool // 16, (
        "the pool's pages stayed resident after the backend went"
    )
