"""A hybrid model through paged_hf against transformers' best static batch, in one run.

    python benchmarks/bench_hybrid.py --threads 2                 # W-mixed and W-prefix, 64 requests each
    python benchmarks/bench_hybrid.py --quick                     # 16 requests, shorter outputs

paged_hf runs the DeltaNet decode through its C++ kernel (paged_hf/execution/cpu/mixer_kernels.py);
a second engine ("transformers' DeltaNet code", ``--no-own-code`` drops it) runs transformers'
torch fallback, as the static batch does, to show what the engine and the kernel each bring.

The model is a Qwen3.5-style config of realistic proportions scaled to run here (gated DeltaNet
and attention layers 3:1, random weights, bf16; ``--layers``/``--hidden`` resize it). Same
weights, same token ids, greedy, outputs forced to their length; systems interleaved round by
round, medians of ``--repeat`` rounds. Prints a table (output tokens per second) and writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import common
import omp_env

OMP_WAIT_POLICY = omp_env.setup()  # before torch: OpenMP reads its wait policy when libgomp loads

import bench_systems as S  # noqa: E402
import bench_workloads as W  # noqa: E402
import torch  # noqa: E402


def qwen3_5_like(layers: int, hidden: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    heads = hidden // 128
    sizes = dict(vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 3)
    sizes.update(num_hidden_layers=layers, max_position_embeddings=4096, tie_word_embeddings=True)
    attention = dict(
        num_attention_heads=heads * 2, num_key_value_heads=max(1, heads // 2), head_dim=128
    )
    deltanet = dict(linear_num_key_heads=heads, linear_num_value_heads=heads * 2)
    deltanet.update(linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
    kinds = ["linear_attention"] * 3 + ["full_attention"]  # DeltaNet and attention layers, 3:1
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    layer_types = kinds * (layers // 4)
    cfg = Qwen3_5TextConfig(**sizes, **attention, **deltanet, **ids, layer_types=layer_types)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def main() -> int:
    p = common.parser(__doc__)
    p.add_argument("--quick", action="store_true")
    common.add_threads(p, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--batch-sizes", default="8,32")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--n", type=int, default=None)
    h = "also run the engine with transformers' DeltaNet decode code (no paged_hf kernel)"
    p.add_argument("--own-code", action=argparse.BooleanOptionalAction, default=True, help=h)
    p.add_argument("--json", default="benchmarks/results/bench_hybrid.json")
    common.add_omp(p)
    args = common.parse(p)
    n = args.n or (16 if args.quick else 64)
    base = qwen3_5_like(args.layers, args.hidden, torch.bfloat16)
    eng_model = copy.deepcopy(base)
    own_code_model = copy.deepcopy(base) if args.own_code else None
    S.prepare_baseline(base)
    params = sum(t.numel() for t in base.parameters())
    pool = W.allowed_ids(base.config.vocab_size, {0, 1, 2})
    out_len = (8, 32) if args.quick else (16, 128)
    prefix = dict(prefix_len=256, n_out=16) if args.quick else dict(prefix_len=512, n_out=32)
    workloads = [W.w_mixed(pool, n=n, out_len=out_len), W.w_prefix(pool, n=n, **prefix)]
    warm = W.warm(pool)
    from paged_hf import Engine
    from paged_hf.execution.cpu import mixer_kernels

    engines = {"paged_hf": Engine(eng_model)}
    # the DeltaNet decode through transformers' torch fallback, as the static batch runs it
    if own_code_model is not None:
        available, mixer_kernels.available = mixer_kernels.available, lambda: False
        try:
            engines["paged_hf, transformers' DeltaNet code"] = Engine(own_code_model)
        finally:
            mixer_kernels.available = available
    for engine in engines.values():
        S.run_paged(engine, warm, tag="warm")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    tok_s = lambda res: sum(map(len, res.tokens)) / (res.t_end - res.t_start)  # noqa: E731
    rows = []
    for w in workloads:
        rates: dict[str, list[float]] = {}
        hits = []
        for r in range(args.repeat):
            for b in batches:
                S.run_hf_static(base, warm, b, 0)
                res = S.run_hf_static(base, w, b, 0)
                rates.setdefault(f"static B={b}", []).append(tok_s(res))
            for name, engine in engines.items():
                engine.reset_prefix_cache()
                before = engine.stats()
                res = S.run_paged(engine, w, tag=f"{w.name}-{r}-")
                rates.setdefault(name, []).append(tok_s(res))
                if name == "paged_hf":
                    hits.append(engine.stats()["prefix_hit_tokens"] - before["prefix_hit_tokens"])
        med = common.medians(rates)
        best = max(v for k, v in med.items() if k.startswith("static"))
        row = {"workload": w.name, **{k: round(v, 1) for k, v in med.items()}}
        row["paged_hf vs best static"] = round(med["paged_hf"] / best, 2)
        rows.append(row | {"prefix hit tokens": hits[-1]})
        common.log(f"[{w.name}] done")
    print(
        f"Qwen3.5-style hybrid, {args.layers} layers ({args.layers * 3 // 4} gated DeltaNet, {args.layers // 4} "
        f"attention), hidden {args.hidden}, {params / 1e6:.0f}M parameters, bf16, {args.threads} threads, "
        f"{time.strftime('%Y-%m-%d')}, OpenMP wait policy {OMP_WAIT_POLICY}; output tokens per second, median of "
        f"{args.repeat}"
    )
    print(common.md_table(list(rows[0]), [list(row.values()) for row in rows]))
    out = {"params": params, "layers": args.layers, "hidden": args.hidden, "rows": rows}
    common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
