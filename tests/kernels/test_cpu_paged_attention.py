"""The CPU paged attention kernel (paged_hf/execution/cpu/paged_attention.py, paged_hf/execution/cpu/csrc/):
the op against a float64 reference written here, the kernel backend against the torch backend,
generation through it against transformers on all nine families in fp32 and bf16 (small blocks,
chunked prefill, prefix hits), and the fallback when it cannot be built."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from cpu_isa import needs
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import assert_teacher_forced
from tiny_models import FAMILIES, make_tiny_model, tiny_prompts

import paged_hf
from paged_hf.execution.backends import TorchBackend, select_backend
from paged_hf.execution.cpu import isa
from paged_hf.execution.cpu import ops as cpu_ops
from paged_hf.execution.cpu import paged_attention as cpa

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_attention import step_metadata  # noqa: E402  (steps built by hand, shared with the benchmark)

pytestmark = pytest.mark.usefixtures("one_thread")

# The build (once per machine: the extension is cached) and load happen here, at collection:
# every test below needs the op, and a failed build must fail this module, not skip it.
assert cpu_ops.load(), f"the CPU paged attention kernel did not build: {cpu_ops.status()['error']}"

# bf16 logits of two correct kernels differ by a few 1e-2 (tests/models/test_smollm2.py); a wrong page,
# mask or offset moves them by whole units
BF16_TOL = 0.125


# ---- the op against a float64 reference ------------------------------------------------------
def reference(q, k_cache, v_cache, seqs, scale, window, softcap):
    """q [T, Hq, Dk]; seqs: (q_start, q_len, kv_len, blocks). Gathers the pages and attends in float64."""
    _, hkv, _, dv = v_cache.shape
    g = q.shape[1] // hkv
    out = torch.zeros(q.shape[0], q.shape[1], dv, dtype=torch.float64)
    for start, ql, kv_len, blocks in seqs:
        b = torch.tensor(blocks)
        k = k_cache[b].transpose(0, 1).reshape(hkv, -1, k_cache.shape[-1])[:, :kv_len].double()
        v = v_cache[b].transpose(0, 1).reshape(hkv, -1, dv)[:, :kv_len].double()
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        s = q[start : start + ql].double().transpose(0, 1) @ k.transpose(-1, -2) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        q_pos, k_pos = torch.arange(kv_len - ql, kv_len)[:, None], torch.arange(kv_len)[None]
        mask = k_pos <= q_pos
        if window:
            mask &= q_pos - k_pos < window
        out[start : start + ql] = (s.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(
            0, 1
        )
    return out


def run_op(q, k_cache, v_cache, seqs, scale, window, softcap, out=None, offsets=None):
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    indptr = [0]
    for s in seqs:
        indptr.append(indptr[-1] + len(s[3]))
    if out is None:
        out = torch.full((q.shape[0], q.shape[1], v_cache.shape[-1]), float("nan"), dtype=q.dtype)
    torch.ops.paged_hf.paged_attention(
        q,
        k_cache,
        v_cache,
        i32([s[0] for s in seqs]),
        i32([s[1] for s in seqs]),
        i32([s[2] for s in seqs]),
        i32(indptr),
        i32(sum((s[3] for s in seqs), [])),
        scale,
        window,
        softcap,
        out,
        None if offsets is None else i32(offsets),
    )
    return out


# The bf16 paths of 16-token blocks this CPU runs: AVX-512 pair dot products, and on CPUs with AMX
# the tile path (paged_attention_amx.cpp), which PAGED_HF_CPU_AMX=0 turns off. Tests of bf16 layouts run
# on each; on a CPU without AMX only the first exists (there is nothing else to test there).
BF16_PATHS = ["avx512"] + (["amx"] if cpa.amx_built() else [])


@pytest.fixture(params=BF16_PATHS)
def bf16_path(request, monkeypatch):
    monkeypatch.setenv("PAGED_HF_CPU_AMX", "1" if request.param == "amx" else "0")
    return request.param


def bf16_pages(seed: int, n_blocks: int, hkv: int, d: int, bs: int = 16):
    """Random bf16 K/V pages and a ``take(n)`` that hands out n unused page ids in random order."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(n_blocks, hkv, bs, d, generator=gen).bfloat16()
    v_cache = torch.randn(n_blocks, hkv, bs, d, generator=gen).bfloat16()
    free = torch.randperm(n_blocks, generator=gen).tolist()
    return gen, k_cache, v_cache, lambda n: [free.pop() for _ in range(n)]


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@st.composite
def problems(draw):
    hkv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    dk = draw(st.sampled_from([16, 40, 64, 80]))
    dv = draw(st.sampled_from([dk, 16, 48]))
    bs = draw(st.sampled_from([1, 4, 16]))
    lens = draw(st.lists(st.tuples(st.integers(1, 70), st.integers(0, 40)), min_size=1, max_size=6))
    seqs_lens = [
        (min(ql, ctx + ql), ctx + ql) for ql, ctx in lens
    ]  # (q_len, kv_len): decode when q_len 1
    seqs_lens += [(1, draw(st.integers(1, 90))) for _ in range(draw(st.integers(0, 4)))]
    window = draw(st.sampled_from([0, 0, 1, 5, 17]))
    softcap = draw(st.sampled_from([0.0, 0.0, 7.5, 50.0]))
    scale = draw(st.sampled_from([dk**-0.5, 0.1, 1.7 * dk**-0.5]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    seed = draw(st.integers(0, 2**16))
    return hkv, group, dk, dv, bs, seqs_lens, window, softcap, scale, dtype, seed


@settings(max_examples=150, deadline=None)
@given(problems())
def test_op_matches_a_float64_reference(problem):
    hkv, group, dk, dv, bs, lens, window, softcap, scale, dtype, seed = problem
    gen = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-kv // bs) for _, kv in lens) + 3
    k_cache = torch.randn(n_blocks, hkv, bs, dk, generator=gen).to(dtype)
    v_cache = torch.randn(n_blocks, hkv, bs, dv, generator=gen).to(dtype)
    perm = torch.randperm(n_blocks, generator=gen).tolist()  # pages in any order
    seqs, start, used = [], 0, 0
    for ql, kv in lens:
        nb = -(-kv // bs)
        seqs.append((start, ql, kv, perm[used : used + nb]))
        start, used = start + ql, used + nb
    # query rows through a strided view, as the backend passes them ([1, H, T, D] transposed)
    q = torch.randn(hkv * group, start, dk, generator=gen).to(dtype).transpose(0, 1)
    got = run_op(q, k_cache, v_cache, seqs, scale, window, softcap)
    want = reference(q, k_cache, v_cache, seqs, scale, window, softcap)
    # fp32: accumulation order only; bf16/fp16: the output's own rounding (inputs are the same)
    tol = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dk,dv", [(64, 64), (128, 32), (32, 96), (32, 256)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (13, 0.0), (0, 30.0), (21, 10.0)])
def test_bf16_16_token_blocks_match_a_float64_reference(dk, dv, window, softcap, bf16_path):
    """The shapes the bf16 pair-dot-product path takes on AVX-512 CPUs (16-token blocks, head
    dims multiples of 32): decodes and chunks of up to 32 tokens, odd lengths (a key without a partner
    in the last pair), windows that start inside a block."""
    gen = torch.Generator().manual_seed(dk + dv + window)
    lens = [
        (1, 1),
        (1, 16),
        (1, 17),
        (1, 333),
        (5, 5),
        (3, 40),
        (32, 32),
        (17, 200),
        (1, 95),
        (30, 31),
    ]
    n_blocks = sum(-(-kv // 16) for _, kv in lens) + 1
    k_cache = torch.randn(n_blocks, 2, 16, dk, generator=gen).bfloat16()
    v_cache = torch.randn(n_blocks, 2, 16, dv, generator=gen).bfloat16()
    perm = torch.randperm(n_blocks, generator=gen).tolist()
    seqs, start, used = [], 0, 0
    for ql, kv in lens:
        nb = -(-kv // 16)
        seqs.append((start, ql, kv, perm[used : used + nb]))
        start, used = start + ql, used + nb
    q = torch.randn(start, 6, dk, generator=gen).bfloat16()
    got = run_op(q, k_cache, v_cache, seqs, dk**-0.5, window, softcap)
    want = reference(q, k_cache, v_cache, seqs, dk**-0.5, window, softcap)
    torch.testing.assert_close(got.double(), want, atol=1.6e-2, rtol=1.6e-2)
    if isa.at_least("avx512_bf16"):
        assert "-mavx512bf16" in cpu_ops.compile_flags()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group,softcap", [(3, 0.0), (1, 0.0), (4, 30.0)])
def test_bf16_rows_are_the_same_however_the_step_is_laid_out(threads, group, softcap, bf16_path):
    """A query row's output is bit for bit the same however the step around it is laid out: a prompt as one
    chunk (tiles of several tokens) or as one decode per token (what a recompute after preemption, or
    another chunking, gives); a step of decodes (all kv heads an item), some sharing 3 blocks, some nothing,
    or each decode alone (an item per kv head). Seeded requests sample the same tokens in any batch only
    while this holds. (A decode's few rows take the AVX-512 kernel's dims-in-lanes scores, a tile's many
    rows its keys-in-lanes scores: the two must add in the same order.) And the float64 reference's within
    bf16."""
    hkv, d, bs = 3, 64, 16
    gen, k_cache, v_cache, take = bf16_pages(threads * 7 + group, 300, hkv, d)
    with torch_threads(threads):
        # a prompt of 37 tokens over 40 cached, as one chunk, and as 37 decodes of one token each
        blocks = take(-(-77 // bs))
        q = torch.randn(37, hkv * group, d, generator=gen).bfloat16()
        chunk = run_op(q, k_cache, v_cache, [(0, 37, 77, blocks)], d**-0.5, 0, softcap)
        tokens = run_op(
            q, k_cache, v_cache, [(t, 1, 41 + t, blocks) for t in range(37)], d**-0.5, 0, softcap
        )
        assert torch.equal(chunk, tokens)
        # decodes: 12 sharing 3 blocks, 5 sharing nothing; together, then each alone
        shared = take(3)
        seqs = [(i, 1, 49 + 13 * i, shared + take(-(-(49 + 13 * i) // bs) - 3)) for i in range(12)]
        seqs += [(12 + i, 1, 20 + 31 * i, take(-(-(20 + 31 * i) // bs))) for i in range(5)]
        q = torch.randn(len(seqs), hkv * group, d, generator=gen).bfloat16()
        together = run_op(q, k_cache, v_cache, seqs, d**-0.5, 0, softcap)
        alone = torch.cat(
            [
                run_op(q[i : i + 1], k_cache, v_cache, [(0, 1, kv, b)], d**-0.5, 0, softcap)
                for i, (_, _, kv, b) in enumerate(seqs)
            ]
        )
        assert torch.equal(together, alone)
    want = reference(q, k_cache, v_cache, seqs, d**-0.5, 0, softcap)
    torch.testing.assert_close(together.double(), want, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group,softcap", [(3, 0.0), (4, 0.0), (3, 20.0), (1, 0.0)])
def test_bf16_decodes_sharing_their_first_blocks_match_a_float64_reference(
    threads, group, softcap, bf16_path
):
    """Decodes whose tables start with the same blocks (a common prompt, a prefix hit), as a step holds them
    with prefix caching: a run of 20 sharing 3 blocks, tables that part after one block, a context ending
    exactly on the shared blocks' end and one a token past it, a pair, and decodes sharing nothing, all
    against the float64 reference."""
    hkv, d, bs = 2, 64, 16
    gen, k_cache, v_cache, take = bf16_pages(threads * 10 + group, 400, hkv, d)

    prefix_a, prefix_b, prefix_c = take(3), take(2), take(1)
    lens_tables = []
    for i in range(20):  # 3 shared blocks then their own
        kv = 48 + 1 + (29 * i) % 150
        lens_tables.append((kv, prefix_a + take(-(-kv // bs) - 3)))
    lens_tables.append((48, prefix_a))  # ends exactly on the shared blocks
    lens_tables.append((49, prefix_a + take(1)))  # one token past them
    for i in range(6):  # share the first block, part at the second (different second blocks)
        lens_tables.append((40 + 7 * i, prefix_b[:1] + take(-(-(40 + 7 * i) // bs) - 1)))
    lens_tables += [
        (70, prefix_c + take(4)),
        (90, prefix_c + take(5)),
    ]  # a pair: grouped when 2 * group >= 8
    lens_tables += [
        (33 + 11 * i, take(-(-(33 + 11 * i) // bs))) for i in range(5)
    ]  # nothing shared
    seqs = [(i, 1, kv, blocks) for i, (kv, blocks) in enumerate(lens_tables)]
    q = torch.randn(len(seqs), hkv * group, d, generator=gen).bfloat16()
    with torch_threads(threads):
        got = run_op(q, k_cache, v_cache, seqs, d**-0.5, 0, softcap)
    want = reference(q, k_cache, v_cache, seqs, d**-0.5, 0, softcap)
    torch.testing.assert_close(got.double(), want, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group", [3, 4, 1])
def test_bf16_long_contexts_are_the_same_however_the_step_is_laid_out(threads, group, bf16_path):
    """Contexts past several of the AMX path's 256-key softmax chunks: a 300-token prompt over 460 cached as
    one chunk, as two (100 + 200) and as 300 decodes; 14 decodes whose tables share 40 blocks (two whole
    chunks, computed once for all of them there) together and each alone, beside decodes sharing nothing.
    Bit for bit, and within bf16 of the float64 reference."""
    hkv, d, bs = 2, 64, 16
    gen, k_cache, v_cache, take = bf16_pages(threads * 3 + group, 800, hkv, d)
    with torch_threads(threads):
        blocks = take(-(-760 // bs))
        q = torch.randn(300, hkv * group, d, generator=gen).bfloat16()
        whole = run_op(q, k_cache, v_cache, [(0, 300, 760, blocks)], d**-0.5, 0, 0.0)
        split = run_op(
            q, k_cache, v_cache, [(0, 100, 560, blocks), (100, 200, 760, blocks)], d**-0.5, 0, 0.0
        )
        tokens = run_op(
            q, k_cache, v_cache, [(t, 1, 461 + t, blocks) for t in range(300)], d**-0.5, 0, 0.0
        )
        assert torch.equal(whole, split) and torch.equal(whole, tokens)
        shared = take(40)
        seqs = [
            (i, 1, 640 + 1 + 37 * i, shared + take(-(-(641 + 37 * i) // bs) - 40))
            for i in range(14)
        ]
        seqs += [(14 + i, 1, 300 + 97 * i, take(-(-(300 + 97 * i) // bs))) for i in range(4)]
        q = torch.randn(len(seqs), hkv * group, d, generator=gen).bfloat16()
        together = run_op(q, k_cache, v_cache, seqs, d**-0.5, 0, 0.0)
        alone = torch.cat(
            [
                run_op(q[i : i + 1], k_cache, v_cache, [(0, 1, kv, b)], d**-0.5, 0, 0.0)
                for i, (_, _, kv, b) in enumerate(seqs)
            ]
        )
        assert torch.equal(together, alone)
    want = reference(q, k_cache, v_cache, seqs, d**-0.5, 0, 0.0)
    torch.testing.assert_close(together.double(), want, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("window", [100, 300])
def test_bf16_a_window_s_freed_blocks_do_not_move_its_rows(window, bf16_path):
    """A sliding-window layer whose first blocks were freed (the table starts ``kv_offset`` tokens in) gives
    the rows it gave with every block held, bit for bit: the AMX path's chunks stay at the sequence's own
    positions. A prompt chunk and decodes, against the float64 reference too."""
    gen = torch.Generator().manual_seed(window)
    hkv, d, bs = 2, 64, 16
    k_cache = torch.randn(200, hkv, bs, d, generator=gen).bfloat16()
    v_cache = torch.randn(200, hkv, bs, d, generator=gen).bfloat16()
    blocks = torch.randperm(200, generator=gen).tolist()
    full = [(0, 40, 900, blocks[:57]), (40, 1, 650, blocks[57:98]), (41, 1, 333, blocks[98:119])]
    held, offsets = [], []
    for start, ql, kv, b in full:
        first = max(0, kv - ql - window + 1) // bs  # the first block the first query reads
        held.append((start, ql, kv - first * bs, b[first:]))
        offsets.append(first * bs)
    q = torch.randn(42, hkv * 3, d, generator=gen).bfloat16()
    everything = run_op(q, k_cache, v_cache, full, d**-0.5, window, 0.0)
    freed = run_op(q, k_cache, v_cache, held, d**-0.5, window, 0.0, offsets=offsets)
    assert torch.equal(everything, freed)
    want = reference(q, k_cache, v_cache, full, d**-0.5, window, 0.0)
    torch.testing.assert_close(freed.double(), want, atol=1.6e-2, rtol=1.6e-2)
    with pytest.raises(RuntimeError, match="not a whole number of blocks"):
        run_op(q, k_cache, v_cache, held, d**-0.5, window, 0.0, offsets=[1, 0, 0])


@needs(
    "avx512",
    "the bf16 path's gathering of small pages (built for AVX-512; the portable path's sums follow the page size)",
)
@pytest.mark.parametrize("page", [4, 8, 2])
def test_bf16_pages_smaller_than_16_give_the_rows_16_token_pages_give(page, bf16_path):
    """Both bf16 paths gather each block's (AMX: tile's) 16 keys from pages of 2, 4 or 8 tokens (lm-eval's
    default is 4): the same rows, bit for bit, as the same K/V in 16-token pages, for prompt chunks, decodes,
    decodes sharing two whole chunks, and a window whose freed pages leave the table starting mid-block."""
    gen = torch.Generator().manual_seed(page)
    hkv, d, per = 2, 64, 16 // page
    n16 = 120
    k16 = torch.randn(n16, hkv, 16, d, generator=gen).bfloat16()
    v16 = torch.randn(n16, hkv, 16, d, generator=gen).bfloat16()
    # the same tokens in small pages: 16-token page b is small pages b*per .. b*per + per - 1, shuffled
    k_small = k16.view(n16, hkv, per, page, d).transpose(1, 2).reshape(n16 * per, hkv, page, d)
    v_small = v16.view(n16, hkv, per, page, d).transpose(1, 2).reshape(n16 * per, hkv, page, d)
    shuffle = torch.randperm(n16 * per, generator=gen)
    where = torch.empty_like(shuffle)
    where[shuffle] = torch.arange(n16 * per)
    k_small, v_small = k_small[shuffle].contiguous(), v_small[shuffle].contiguous()

    def small(blocks16, kv):  # the small pages holding the first kv tokens of those 16-token pages
        pages = [int(where[b * per + j]) for b in blocks16 for j in range(per)]
        return pages[: -(-kv // page)]

    free = torch.randperm(n16, generator=gen).tolist()
    shared = [free.pop() for _ in range(33)]
    seqs16 = [(0, 40, 300, [free.pop() for _ in range(19)])]
    seqs16 += [
        (
            40 + i,
            1,
            530 + 11 * i,
            shared + [free.pop() for _ in range(-(-(530 + 11 * i) // 16) - 33)],
        )
        for i in range(5)
    ]
    q = torch.randn(45, hkv * 3, d, generator=gen).bfloat16()
    want = run_op(q, k16, v16, seqs16, d**-0.5, 0, 0.0)
    got = run_op(
        q, k_small, v_small, [(s, ql, kv, small(b, kv)) for s, ql, kv, b in seqs16], d**-0.5, 0, 0.0
    )
    assert torch.equal(got, want)
    # a window of 100 over a 300-token prompt chunk: freed small pages up to the first one its first query reads
    first = (300 - 40 - 100 + 1) // page
    pages = small(seqs16[0][3], 300)
    windowed = run_op(
        q[:40],
        k_small,
        v_small,
        [(0, 40, 300 - first * page, pages[first:])],
        d**-0.5,
        100,
        0.0,
        offsets=[first * page],
    )
    assert torch.equal(windowed, run_op(q[:40], k16, v16, [seqs16[0]], d**-0.5, 100, 0.0))


def test_bf16_nan_in_a_page_reaches_no_other_sequence(bf16_path):
    """NaN in a page's unused slots (past a sequence's last token: what a failed request can leave in a
    reused page) and in every K/V of another sequence (one whose activations blew up) leave the other
    sequences' rows as they are with clean pages, decodes sharing chunks with each other included."""
    hkv, d, bs = 2, 64, 16
    gen, k_cache, v_cache, take = bf16_pages(5, 300, hkv, d)
    shared = take(33)
    seqs = [(i, 1, 530 + 9 * i, shared + take(-(-(530 + 9 * i) // bs) - 33)) for i in range(6)]
    bad = take(-(-541 // bs))
    seqs.append((6, 1, 541, shared + bad[33:]))  # shares the chunks, its own pages all NaN
    seqs.append((7, 20, 90, take(6)))  # a prompt chunk beside them
    q = torch.randn(27, hkv * 3, d, generator=gen).bfloat16()
    clean = run_op(q, k_cache, v_cache, seqs, d**-0.5, 0, 0.0)
    k_dirty, v_dirty = k_cache.clone(), v_cache.clone()
    for _, _, kv, b in seqs:
        if kv % bs:  # the last page's unused slots
            k_dirty[b[-1], :, kv % bs :] = float("nan")
            v_dirty[b[-1], :, kv % bs :] = float("nan")
    k_dirty[bad[33:]] = float("nan")
    v_dirty[bad[33:]] = float("nan")
    dirty = run_op(q, k_dirty, v_dirty, seqs, d**-0.5, 0, 0.0)
    others = [r for r in range(27) if r != 6]
    assert torch.isfinite(dirty[others]).all()
    assert torch.equal(dirty[others], clean[others])


def test_op_writes_only_the_rows_of_the_sequences_it_is_given():
    """A subset of a step's sequences (the others' rows untouched), and bad input refused by name."""
    k_cache, v_cache = torch.randn(8, 2, 4, 16), torch.randn(8, 2, 4, 16)
    q = torch.randn(10, 4, 16)
    out = torch.zeros(10, 4, 16)
    seqs = [(2, 3, 7, [5, 1]), (8, 1, 9, [0, 3, 6])]
    run_op(q, k_cache, v_cache, seqs, 0.25, 0, 0.0, out=out)
    want = reference(q, k_cache, v_cache, seqs, 0.25, 0, 0.0)
    torch.testing.assert_close(out[2:5].double(), want[2:5], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out[8:9].double(), want[8:9], atol=2e-5, rtol=2e-5)
    assert out[[0, 1, 5, 6, 7, 9]].abs().sum() == 0
    with pytest.raises(RuntimeError, match="block id 8 out of range"):
        run_op(q, k_cache, v_cache, [(0, 1, 4, [8])], 0.25, 0, 0.0)
    with pytest.raises(RuntimeError, match="sequence 0 has 9 tokens in 2 blocks"):
        run_op(q, k_cache, v_cache, [(0, 1, 9, [1, 2])], 0.25, 0, 0.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        run_op(q.bfloat16(), k_cache, v_cache, [(0, 1, 4, [1])], 0.25, 0, 0.0)


# ---- the kernel backend against the torch backend ----------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 30.0), (5, 20.0)])
def test_kernel_backend_agrees_with_the_torch_backend(dtype, window, softcap):
    bs, hq, hkv, d = 4, 6, 2, 32
    # decodes, short chunks and small prompts (the kernel), a long prompt (the torch path's SDPA)
    specs = [
        (1, 1),
        (1, 23),
        (9, 9),
        (7, 30),
        (1, 14),
        (16, 16),
        (1, 40),
        (40, 40),
        (35, 61),
        (520, 520),
    ]
    takes = [cpa.kernel_takes(q, kv, bf16_path=False) for q, kv in specs]
    assert takes == [True] * 9 + [False]
    n_blocks = sum(-(-kv // bs) for _, kv in specs) + 2
    meta = step_metadata(
        specs, bs, torch.randperm(n_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    )
    ref, ker = (
        TorchBackend(2, n_blocks, bs, hkv, d, dtype, "cpu"),
        cpa.CpuPagedBackend(2, n_blocks, bs, hkv, d, dtype, "cpu"),
    )
    gen = torch.Generator().manual_seed(1)
    for a, b in zip(ref.kv, ker.kv):
        a.copy_(torch.randn(a.shape, generator=gen))
        b.copy_(a)
    t = meta.num_tokens
    for layer in range(2):
        q, k, v = (torch.randn(1, h, t, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
        ref.plan(meta)
        ker.plan(meta)
        want = ref.attend(layer, q, k, v, 0.3, window, softcap)
        got = ker.attend(layer, q, k, v, 0.3, window, softcap)
        assert torch.equal(ker.kv[2 * layer], ref.kv[2 * layer]) and torch.equal(
            ker.kv[2 * layer + 1], ref.kv[2 * layer + 1]
        )
        # the torch path rounds scores and probs to bf16; where the kernel takes the 520-token prompt too (bf16
        # in 4-token pages on the AMX path) that rounding meets the kernel's fp32 softmax on a long row (the
        # float64-reference tests above hold the kernel itself to 1.6e-2)
        tol = 2e-5 if dtype == torch.float32 else (5e-2 if ker._bf16_path else 3e-2)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        # bf16 in 4-token pages on the AMX path: every sequence, the long prompt too
        if ker._bf16_path:
            assert ker._groups[0].torch_kind is None and len(ker._groups[0].args[0]) == len(specs)
        else:
            assert ker._groups[0].torch_kind == "long" and len(ker._groups[0].args[0]) == sum(
                takes
            ), "the kernel served what it takes"


def test_on_the_bf16_path_the_kernel_attends_every_sequence():
    """bf16, blocks dividing 16 tokens, head dims multiples of 32, an AVX-512 build (its pair dot products
    emulated without AVX512-BF16): long prompts and long chunks over cached context go to the kernel too
    (it beats SDPA there), and agree with the torch path."""
    bs, hq, hkv, d = 16, 6, 2, 64
    specs = [(1, 40), (600, 600), (300, 700), (40, 40), (1, 333)]
    n_blocks = sum(-(-kv // bs) for _, kv in specs) + 2
    fast = "-DCPU_CAPABILITY=AVX512" in cpu_ops.compile_flags()
    ker = cpa.CpuPagedBackend(2, n_blocks, bs, hkv, d, torch.bfloat16, "cpu")
    assert ker._bf16_path is fast
    # 48 % 32
    assert cpa.CpuPagedBackend(2, n_blocks, bs, hkv, 48, torch.bfloat16, "cpu")._bf16_path is False
    # 8-token blocks: both bf16 paths take pages of any size dividing 16
    assert cpa.CpuPagedBackend(2, n_blocks, 8, hkv, d, torch.bfloat16, "cpu")._bf16_path is fast
    assert cpa.CpuPagedBackend(2, n_blocks, 12, hkv, d, torch.bfloat16, "cpu")._bf16_path is False
    assert cpa.CpuPagedBackend(2, n_blocks, bs, hkv, d, torch.float32, "cpu")._bf16_path is False
    if not fast:
        pytest.skip("this CPU has no AVX-512: the bf16 path is not built")
    meta = step_metadata(
        specs, bs, torch.randperm(n_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    )
    ref = TorchBackend(2, n_blocks, bs, hkv, d, torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(1)
    for a, b in zip(ref.kv, ker.kv):
        a.copy_(torch.randn(a.shape, generator=gen))
        b.copy_(a)
    q, k, v = (
        torch.randn(1, h, meta.num_tokens, d, generator=gen).bfloat16() for h in (hq, hkv, hkv)
    )
    ref.plan(meta)
    ker.plan(meta)
    want = ref.attend(0, q, k, v, d**-0.5)
    got = ker.attend(0, q, k, v, d**-0.5)
    assert ker._groups[0].torch_kind is None and len(ker._groups[0].args[0]) == len(specs), (
        "the kernel attended every sequence"
    )
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_a_layer_with_a_feature_the_kernel_lacks_takes_the_torch_path(monkeypatch):
    """Features the op does not implement (attention sinks, chunked attention, when the model passes
    them) send that layer through the torch backend's own attend, in the same step."""
    bs, n_blocks = 4, 16
    meta = step_metadata([(1, 9), (5, 5)], bs, list(range(n_blocks)))
    ker = cpa.CpuPagedBackend(1, n_blocks, bs, 2, 16, torch.float32, "cpu")
    calls = []
    monkeypatch.setattr(
        TorchBackend, "attend", lambda self, *a, **kw: calls.append(kw) or "torch path"
    )
    ker.plan(meta)
    q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    assert ker.attend(0, q, k, v, 0.25, sinks=torch.zeros(4)) == "torch path"
    assert ker._groups[0].torch_kind == "full" and calls and "sinks" in calls[0]
    # an absent feature: the kernel
    assert ker.attend(0, q, k, v, 0.25, sinks=None).shape == (
        1,
        6,
        4,
        16,
    )
    assert len(calls) == 1

    from paged_hf.execution.kv_geometry import KVLayout, LayerSpec

    chunked = cpa.CpuPagedBackend(
        KVLayout((LayerSpec(4, 2, 16, 16, chunk=8),)), n_blocks, bs, dtype=torch.float32
    )
    chunked.plan(meta)
    # a chunked layer
    assert (
        chunked.attend(0, q, k, v, 0.25) == "torch path" and chunked._groups[0].torch_kind == "full"
    )


# ---- generation through the kernel against transformers ----------------------------------------
PROMPT_LENGTHS = [1, 6, 19, 41]
SMALL = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_generation_through_the_kernel_agrees_with_transformers(family, dtype):
    """4-token blocks and a 16-token budget (chunked prefill over cached context), then the same
    prompts again behind a shared prefix (prefix hits): every token is transformers' argmax."""
    reference = make_tiny_model(family, dtype=dtype)
    engine = paged_hf.Engine(make_tiny_model(family, dtype=dtype), **SMALL)
    assert engine.stats()["backend"] == "cpu"
    tol = 1e-3 if dtype == torch.float32 else BF16_TOL
    prompts = tiny_prompts(
        reference.config.vocab_size, len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=11
    )
    shared = tiny_prompts(reference.config.vocab_size, 1, 22, seed=12)[0]
    params = paged_hf.SamplingParams(max_new_tokens=10, ignore_eos=True)
    first = engine.generate(prompts, params)
    second = engine.generate([shared + p for p in prompts], params)
    assert engine.stats()["steps"] > 20 and engine.stats()["prefix_hit_tokens"] >= 3 * 20
    for prompt, out in list(zip(prompts, first)) + list(zip([shared + p for p in prompts], second)):
        assert len(out.token_ids) == 10
        assert_teacher_forced(
            reference, prompt, out.token_ids, tol=tol, what=f"{family}/{dtype}/kernel"
        )
    assert engine.kv_manager.pool.num_used == 0


# ---- when it cannot be built ---------------------------------------------------------------------
def test_a_failed_build_warns_once_and_auto_stays_on_the_torch_path(monkeypatch):
    monkeypatch.setattr(
        cpu_ops, "_state", {"loaded": None, "error": None, "build_s": None, "path": None}
    )

    def no_compiler(verbose):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpu_ops, "_build_and_load", no_compiler)
    with pytest.warns(RuntimeWarning, match="could not be built.*command not found"):
        assert select_backend("auto", torch.device("cpu")) is TorchBackend
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: later engines say nothing
        engine = paged_hf.Engine(make_tiny_model("llama"), block_size=4)
    assert engine.stats()["backend"] == "torch"
    model = make_tiny_model("llama")
    prompt = tiny_prompts(model.config.vocab_size, 1, 13, seed=3)[0]
    out = engine.generate([prompt], paged_hf.SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert_teacher_forced(model, prompt, out.token_ids, what="torch fallback")


def test_no_compiler_in_a_fresh_process(tmp_path):
    """A real failed build: no C++ compiler, an empty extensions dir. One warning, then the torch path."""
    script = textwrap.dedent("""
        import warnings, paged_hf, sys
        sys.path.insert(0, sys.argv[1])
        from tiny_models import make_tiny_model
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = paged_hf.Engine(make_tiny_model("llama"), block_size=4)
            b = paged_hf.Engine(make_tiny_model("qwen3"), block_size=4)
        out = a.generate([[5, 6, 7, 8, 9]], paged_hf.SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
        kernel = [w for w in caught if "paged attention kernel" in str(w.message)]
        print(a.stats()["backend"], b.stats()["backend"], len(kernel), len(out.token_ids))
    """)
    env = {
        **os.environ,
        "CXX": str(tmp_path / "no-such-compiler"),
        "PAGED_HF_EXTENSIONS_DIR": str(tmp_path / "ext"),
        "PAGED_HF_CPU_KERNEL": "1",
    }
    res = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).resolve().parents[1])],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["torch", "torch", "1", "3"], res.stdout + res.stderr[-2000:]


def test_the_build_is_cached_and_named_by_source_torch_and_flags():
    status = cpu_ops.status()
    assert status["loaded"] and Path(status["path"]).is_file()
    assert Path(status["path"]).parent.parent == cpu_ops.extensions_dir()
    name = cpu_ops._build_name(cpu_ops.compile_flags())
    assert Path(status["path"]).stem == name
    assert cpu_ops._build_name(cpu_ops.compile_flags() + ["-DX"]) != name
