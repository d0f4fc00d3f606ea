"""FlashInfer alone, before paged_hf is involved: its two wrappers as paged_hf calls them, each against
an fp32 reference computed here from the same pages.

- prefill (``BatchPrefillWithPagedKVCacheWrapper``, causal) over shuffled pages, three sequences
  whose caches are longer than their queries (a chunk after cached tokens), with a window and a
  soft-cap variant;
- decode (``BatchDecodeWithPagedKVCacheWrapper``) with and without tensor cores;
- a CUDA-graph decode: a ``use_cuda_graph=True`` wrapper over fixed index buffers, captured on
  padding-like data (every row reading one page), then planned for two real batches in turn and
  replayed (on a CPU, with the stand-in, the replay is the run itself).

    python benchmarks/gpu/gpu_smoke_flashinfer.py            # on the GPU (the real flashinfer)
    python benchmarks/gpu/gpu_smoke_flashinfer.py --dry-run  # CPU, FlashInfer's stand-in (tests/fake_flashinfer.py)

Prints one line per check (max abs error against the reference, and the tolerance) and exits 1 if
any check is off. gpu_check.py runs it as its ``smoke`` phase.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

PAGE, Q_HEADS, KV_HEADS, HEAD_DIM = 16, 8, 2, 128
SHAPE = (Q_HEADS, KV_HEADS, HEAD_DIM, PAGE)  # plan()'s arguments after the page table


def _pages(seq_lens: list[int], num_pages: int, g: torch.Generator) -> list[list[int]]:
    """Each sequence's pages, drawn from a shuffled pool (no two sequences share one)."""
    order = torch.randperm(num_pages, generator=g).tolist()
    out = []
    for n in seq_lens:
        k = -(-n // PAGE)
        out.append(order[:k])
        order = order[k:]
    return out


def _csr(pages: list[list[int]], seq_lens: list[int], device: str) -> tuple[torch.Tensor, ...]:
    indptr = [0] + [sum(map(len, pages[: i + 1])) for i in range(len(pages))]
    indices, last = [p for ps in pages for p in ps], [(n - 1) % PAGE + 1 for n in seq_lens]
    return tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (indptr, indices, last))


def _reference(q, cache, pages, seq_lens, q_lens, window_left: int, softcap) -> torch.Tensor:
    """fp32 causal attention of each sequence's last ``q_len`` positions over its pages (``pages``
    and the lengths: one list each, per sequence; ``softcap`` None for none)."""
    outs, start = [], 0
    for ps, n, m in zip(pages, seq_lens, q_lens):
        kv = cache[torch.tensor(ps, device=cache.device)].float()  # [pages, 2, PAGE, H, D]
        k, v = (
            kv[:, i].reshape(-1, KV_HEADS, HEAD_DIM)[:n].repeat_interleave(Q_HEADS // KV_HEADS, 1)
            for i in (0, 1)
        )
        qs = q[start : start + m].float()
        logits = torch.einsum("qhd,khd->hqk", qs, k) * HEAD_DIM**-0.5
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        pos = torch.arange(n - m, n, device=q.device)[:, None]
        keys = torch.arange(n, device=q.device)[None, :]
        visible = (keys <= pos) & ((keys >= pos - window_left) if window_left >= 0 else True)
        logits = logits.masked_fill(~visible[None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", logits.softmax(-1), v))
        start += m
    return torch.cat(outs)


def _check(name: str, got: torch.Tensor, expected: torch.Tensor, tol: float) -> dict:
    err = float((got.float() - expected).abs().max())
    ok = err <= tol and bool(torch.isfinite(got).all())
    print(
        f"smoke {name}: max abs error {err:.2e} (tolerance {tol:.0e}) {'ok' if ok else 'OFF'}",
        flush=True,
    )
    return {"name": name, "max_abs_error": err, "tolerance": tol, "ok": ok}


def run(device: str, stand_in: bool = False) -> list[dict]:
    import flashinfer

    dtype = torch.float32 if stand_in and device == "cpu" else torch.bfloat16
    # fp32 (the stand-in on a CPU): 1e-3, since torch's CPU tanh, on its first call in a process,
    # sometimes takes a less exact path (errors up to ~2.5e-4 after the soft cap's x30 were seen)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    g = torch.Generator().manual_seed(0)
    types = dict(q_data_type=dtype, kv_data_type=dtype)
    results = []
    size = 128 << 20 if device == "cuda" else 1 << 10
    workspace = torch.zeros(size, dtype=torch.uint8, device=device)
    num_pages = 64
    cache = torch.randn(num_pages, 2, PAGE, KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)

    # prefill: chunks after cached tokens (cache longer than query), shuffled pages
    seq_lens, q_lens = [70, 33, 129], [20, 33, 1]
    pages = _pages(seq_lens, num_pages, g)
    indptr, indices, last = _csr(pages, seq_lens, device)
    qo = torch.tensor([0, 20, 53, 54], dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    for window_left, softcap in ((-1, None), (31, 30.0)):
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        mask = dict(causal=True, window_left=window_left, logits_soft_cap=softcap)
        w.plan(qo, indptr, indices, last, *SHAPE, **mask, **types)
        expected = _reference(q, cache, pages, seq_lens, q_lens, window_left, softcap)
        name = f"prefill window {window_left} softcap {softcap}"
        results.append(_check(name, w.run(q, cache), expected, tol))

    # decode, with and without tensor cores
    seq_lens = [5, 70, 129, 16]
    pages = _pages(seq_lens, num_pages, g)
    indptr, indices, last = _csr(pages, seq_lens, device)
    q = torch.randn(len(seq_lens), Q_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    expected = _reference(q, cache, pages, seq_lens, [1] * len(seq_lens), -1, None)
    for tc in (False, True):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tc)
        w.plan(indptr, indices, last, *SHAPE, **types)
        results.append(_check(f"decode tensor cores {tc}", w.run(q, cache), expected, tol))

    # CUDA-graph decode: fixed buffers, captured on padding-like data, re-planned twice and replayed
    b = 4
    ind_buf = torch.zeros(num_pages, dtype=torch.int32, device=device)
    ptr_buf = torch.zeros(b + 1, dtype=torch.int32, device=device)
    last_buf = torch.zeros(b, dtype=torch.int32, device=device)
    buffers = dict(paged_kv_indptr_buffer=ptr_buf, paged_kv_indices_buffer=ind_buf)
    buffers["paged_kv_last_page_len_buffer"] = last_buf
    graph_options = dict(use_cuda_graph=True, use_tensor_cores=False, **buffers)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **graph_options)
    q_buf = torch.zeros(b, Q_HEADS, HEAD_DIM, dtype=dtype, device=device)
    out_buf = torch.zeros_like(q_buf)
    # padding-like: every row reads page 0, one token of it
    pad = [torch.tensor(x, dtype=torch.int32, device=device) for x in ([*range(b + 1)], [0] * b)]
    w.plan(*pad, torch.ones(b, dtype=torch.int32, device=device), *SHAPE, **types)
    graph = None
    if device == "cuda":
        out_buf.copy_(w.run(q_buf, cache))  # warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_buf.copy_(w.run(q_buf, cache))
    for round_ in range(2):
        lens = [[9, 40, 77, 130], [1, 16, 17, 64]][round_]
        pages = _pages(lens, num_pages, g)
        indptr, indices, last = _csr(pages, lens, device)
        q = torch.randn(b, Q_HEADS, HEAD_DIM, generator=g).to(device, dtype)
        w.plan(indptr, indices, last, *SHAPE, **types)
        q_buf.copy_(q)
        if graph is not None:
            graph.replay()
            torch.cuda.synchronize()
        else:
            out_buf.copy_(w.run(q_buf, cache))
        expected = _reference(q, cache, pages, lens, [1] * b, -1, None)
        results.append(_check(f"graph decode replay {round_ + 1}", out_buf, expected, tol))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, FlashInfer's stand-in")
    args = ap.parse_args(argv)
    if args.dry_run:
        import gpu_stand_in

        gpu_stand_in.install()
    results = run("cpu" if args.dry_run else "cuda", stand_in=args.dry_run)
    print(json.dumps(results))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
