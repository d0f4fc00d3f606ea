#!/usr/bin/env python
"""Attention alone, per layer: the routes issue 11 weighed for CPU paged attention, on one step.

    python benchmarks/bench_attention.py                  # torch path vs the C++ kernel, 5 step shapes
    python benchmarks/bench_attention.py --routes all     # + inductor-compiled gather-free decode, FlexAttention

Routes (SmolLM2-135M geometry by default: 9 query heads, 3 KV heads, head_dim 64, 16-token blocks, bf16):
  torch     the torch backend: K/V gathered out of the pages, then SDPA / batched matmuls
            (pages are drawn at random, none shared: the in-engine numbers, with pages allocated in
            runs and a shared prefix read from cache, are better for both; bench.py --profile-decode)
  kernel    the CPU backend: ``paged_hf::paged_attention`` reads the pages in place (prefill chunks
            longer than KERNEL_MAX_Q_LEN go to the torch path's SDPA, as in the engine)
  op        the C++ op alone on every sequence of the step, long prefill chunks included
  inductor  decode only: a gather-free attention function (indexing the pages inside the reduction)
            compiled by torch.compile(dynamic=True); compile time reported
  flex      decode only: FlexAttention on CPU with torch's PagedAttention block mask (128-token pages,
            the smallest its CPU template takes); compile time reported

  cold      the op on every sequence, as ``op``, over --layers layers' own caches in turn (each a pool of
            --pool-blocks blocks, the step's pages drawn at random from it): in a step the 30 layers'
            pages are in DRAM by the time each is read, where ``op`` times one layer's pages in cache

Each cell is the median of --reps calls after one warm-up, in ms per layer; K/V written first
(as in a step). Prints a table and writes JSON (--out).

    python benchmarks/bench_attention.py --routes op,cold --threads 2     # pages in cache vs in DRAM
"""

from __future__ import annotations

import sys
import time

import common
import torch

from paged_hf.execution.backends.torch_backend import TorchBackend
from paged_hf.execution.cpu import ops as cpu_ops
from paged_hf.execution.cpu import paged_attention as cpa
from paged_hf.execution.metadata import StepMetadata


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def step_metadata(
    specs: list[tuple[int, int]], bs: int, perm: list[int], shared: int = 0
) -> StepMetadata:
    """A step built by hand: sequence i has ``specs[i] = (new tokens, context length)``, its blocks
    taken in turn from ``perm`` (also used by tests/kernels/test_cpu_paged_attention.py); with ``shared``,
    every sequence's first ``shared`` blocks are the same ones (a prefix hit)."""
    slots, pos, qo, kvp, kvi, last, blocks, used = [], [], [0], [0], [], [], [], shared
    for ql, kv in specs:
        nb = -(-kv // bs)
        b = perm[:shared] + perm[used : used + nb - shared]
        used += nb - shared
        slots += [b[p // bs] * bs + p % bs for p in range(kv - ql, kv)]
        pos += list(range(kv - ql, kv))
        qo.append(qo[-1] + ql)
        kvp.append(kvp[-1] + nb)
        kvi += b
        last.append(kv - (nb - 1) * bs)
        blocks.append(b)
    ids, tables = torch.zeros(len(pos), dtype=torch.long), (i32(kvp), i32(kvi), i32(last))
    lens = ([q for q, _ in specs], [k for _, k in specs])
    sampled = torch.tensor([len(pos) - 1])
    return StepMetadata(
        ids, torch.tensor(pos), i32(slots), i32(qo), *tables, sampled, bs, *lens, blocks, []
    )


def cases(seed: int) -> dict[str, list[tuple[int, int]]]:
    g = torch.Generator().manual_seed(seed)

    def decodes(lo: int, hi: int, at: int = 0) -> list[tuple[int, int]]:  # at + U[lo, hi] each
        return [(1, at + int(n)) for n in torch.randint(lo, hi + 1, (64,), generator=g)]

    return {
        "decode 64 x 700": [(1, 700)] * 64,
        "decode 32 x 220": [(1, 220)] * 32,
        "decode 64 x U[40,420]": decodes(40, 420),
        "decode 64 x (512 + U[20,300])": decodes(20, 300, at=512),
        "decode 64 x (512 shared + U[20,300])": decodes(20, 300, at=512),
        "32 decodes x 300 + a 256-token prompt": [(1, 300)] * 32 + [(256, 256)],
        "a 512-token chunk over 1,500 cached": [(512, 2012)],
        "a 128-token chunk over 384 cached": [(128, 512)],
        "8 chunks of 32 over 300 cached": [(32, 332)] * 8,
        "8 chunks of 8 over 300 cached": [(8, 308)] * 8,
        "8 fresh prompts of 32": [(32, 32)] * 8,
        "a fresh 64-token prompt": [(64, 64)],
        "4 fresh prompts of 128": [(128, 128)] * 4,
        "a fresh 512-token prompt": [(512, 512)],
        "a fresh 2,000-token prompt": [(2000, 2000)],
    }


def op_args(meta: StepMetadata) -> tuple:
    """The C++ op's arguments that describe the step (its sequences' queries and pages)."""
    qo = meta.qo_indptr[:-1].contiguous()
    return qo, i32(meta.q_lens), i32(meta.kv_lens), meta.kv_indptr, meta.kv_indices


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    h = "comma list of torch, kernel, op, cold, inductor, flex; or all"
    ap.add_argument("--routes", default="torch,kernel,op", help=h)
    common.add_threads(ap, help="torch threads (default: all cores)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--heads", default="9,3,64", help="q heads, kv heads, head_dim")
    ap.add_argument("--block-size", type=int, default=16)
    h = "cold: layers whose caches are read in turn"
    ap.add_argument("--layers", type=int, default=30, help=h)
    h = "cold: blocks in each layer's pool (SmolLM2's default 1 GiB KV budget holds ~2,900)"
    ap.add_argument("--pool-blocks", type=int, default=2900, help=h)
    ap.add_argument("--out", help="JSON path (default benchmarks/results/attention-<date>.json)")
    args = common.parse(ap, argv)
    routes = "torch,kernel,op,cold,inductor,flex" if args.routes == "all" else args.routes
    routes = routes.split(",")
    assert cpu_ops.load(), cpu_ops.status()["error"]
    dtype = common.dtype(args.dtype)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    bs = args.block_size
    rows, compile_s = [], {}
    pools = None
    if "cold" in routes:
        g = torch.Generator().manual_seed(3)
        pools = [
            [torch.randn(args.pool_blocks, hkv, bs, d, generator=g).to(dtype) for _ in range(2)]
            for _ in range(args.layers)
        ]
    for name, specs in cases(0).items():
        shared = 512 // bs if "shared" in name else 0
        n_blocks = sum(-(-kv // bs) for _, kv in specs) + 4
        perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        meta = step_metadata(specs, bs, perm, shared)
        t = meta.num_tokens
        g = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(1, h, t, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
        cache = [torch.randn(n_blocks, hkv, bs, d, generator=g).to(dtype) for _ in range(2)]
        row = {"case": name, "tokens": t, "kv_tokens": sum(kv for _, kv in specs)}
        for route in routes:
            if route in ("torch", "kernel"):
                backend = TorchBackend if route == "torch" else cpa.CpuPagedBackend
                b = backend(1, n_blocks, bs, hkv, d, dtype, "cpu")
                b.kv[0].copy_(cache[0])
                b.kv[1].copy_(cache[1])

                def run(b=b):
                    b.plan(meta)
                    return b.attend(0, q, k, v, d**-0.5)

                row[route] = common.seconds(run, args.reps)
            elif route == "op":
                step, op = op_args(meta), torch.ops.paged_hf.paged_attention
                out, qt = torch.empty(t, hq, d, dtype=dtype), q[0].transpose(0, 1)
                call = lambda: op(qt, cache[0], cache[1], *step, d**-0.5, 0, 0.0, out)  # noqa: E731
                row[route] = common.seconds(call, args.reps)
            elif route == "cold" and sum(-(-kv // bs) for _, kv in specs) <= args.pool_blocks:
                g4 = torch.Generator().manual_seed(4)
                pool_perm = torch.randperm(args.pool_blocks, generator=g4).tolist()
                step = op_args(step_metadata(specs, bs, pool_perm, shared))
                out, qt = torch.empty(t, hq, d, dtype=dtype), q[0].transpose(0, 1)

                def layers_in_turn():
                    for kc, vc in pools:
                        torch.ops.paged_hf.paged_attention(qt, kc, vc, *step, d**-0.5, 0, 0.0, out)

                row[route] = common.seconds(layers_in_turn, args.reps) / len(pools)
            elif route in ("inductor", "flex") and all(ql == 1 for ql, _ in specs):
                compiled = inductor_decode if route == "inductor" else flex_decode
                fn, secs = compiled(specs, bs, hq, hkv, d, dtype)
                compile_s.setdefault(route, []).append(secs)
                row[route] = common.seconds(fn, args.reps)
        rows.append(row)
        common.log(
            f"{name}: " + ", ".join(f"{r} {row[r] * 1e3:.2f} ms" for r in routes if r in row)
        )

    head = ["case"] + [f"{r} ms" for r in routes] + ["torch / kernel"]
    lines = [head]
    for row in rows:
        both = "torch" in row and "kernel" in row
        ratio = f"{row['torch'] / row['kernel']:.2f}x" if both else "-"
        ms = [f"{row[r] * 1e3:.2f}" if r in row else "-" for r in routes]
        lines.append([row["case"], *ms, ratio])
    print(
        f"\nattention per layer, {args.dtype}, heads {hq}/{hkv}x{d}, {bs}-token blocks, "
        f"{torch.get_num_threads()} threads (median of {args.reps})"
    )
    print(common.text_table(lines))
    for route, secs in compile_s.items():
        print(
            f"{route}: compile {secs[0]:.1f}s first shape, then {', '.join(f'{s:.1f}s' for s in secs[1:])}"
        )
    report = {"rows": rows, "compile_s": compile_s, "args": vars(args)}
    report.update(threads=torch.get_num_threads(), torch=torch.__version__)
    common.write_json(args.out or common.stamped("attention"), report)
    return 0


def inductor_decode(specs, bs, hq, hkv, d, dtype):
    """Decode attention that indexes the pages inside its reductions, compiled by inductor."""
    g = hq // hkv
    n, max_blocks = len(specs), max(-(-kv // bs) for _, kv in specs)
    n_blocks = n * max_blocks + 1
    kc, vc = (torch.randn(n_blocks, hkv, bs, d).to(dtype) for _ in range(2))
    table = torch.randperm(n_blocks)[: n * max_blocks].view(n, max_blocks)
    lens = torch.tensor([kv for _, kv in specs])
    q = torch.randn(n, hkv, g, d).to(dtype)

    def decode(q, kc, vc, table, lens):
        nb = table.shape[1]
        k = kc[table].permute(0, 2, 1, 3, 4).reshape(q.shape[0], hkv, 1, nb * bs, d)
        v = vc[table].permute(0, 2, 1, 3, 4).reshape(q.shape[0], hkv, 1, nb * bs, d)
        s = (q[:, :, :, None, :].float() * k.float()).sum(-1) * d**-0.5
        s = s.masked_fill(
            torch.arange(nb * bs)[None, None, None, :] >= lens[:, None, None, None], float("-inf")
        )
        return (torch.softmax(s, -1)[..., None] * v.float()).sum(-2).to(q.dtype)

    fn = torch.compile(decode, dynamic=True)
    t0 = time.perf_counter()
    fn(q, kc, vc, table, lens)
    return (lambda: fn(q, kc, vc, table, lens)), time.perf_counter() - t0


def flex_decode(specs, bs, hq, hkv, d, dtype):
    """FlexAttention over a paged cache (torch's experimental PagedAttention), decode."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    page = 128
    n = len(specs)
    longest = -(-max(kv for _, kv in specs) // page) * page
    n_pages = sum(-(-kv // page) for _, kv in specs) + 1
    paged = PagedAttention(n_pages, page, n, device="cpu")
    for i, (_, kv) in enumerate(specs):
        paged.reserve(torch.tensor(i), torch.tensor(kv))
    kc, vc = (torch.randn(1, hkv, n_pages * page, d).to(dtype) for _ in range(2))
    q = torch.randn(n, hq, 1, d).to(dtype)
    lens = torch.tensor([kv for _, kv in specs])
    mask = create_block_mask(
        lambda b, h, qi, kv: kv < lens[b], n, None, 1, longest, device="cpu", BLOCK_SIZE=(128, page)
    )
    block_mask, score_mod = paged.convert_logical_block_mask(mask), paged.get_score_mod(None)
    kw = dict(block_mask=block_mask, score_mod=score_mod, enable_gqa=True)
    fn = torch.compile(flex_attention)
    t0 = time.perf_counter()
    fn(q, kc, vc, **kw)
    return (lambda: fn(q, kc, vc, **kw)), time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
