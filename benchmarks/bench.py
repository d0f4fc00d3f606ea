#!/usr/bin/env python
"""Side-by-side throughput/latency benchmark: transformers vs paged_hf on one model, one run.

    python benchmarks/bench.py --quick            # < 2 min: W-mixed-16, bf16, static B=8, hf_cb, paged_hf
    python benchmarks/bench.py                    # full: 3 workloads x 5 systems x {fp32, bf16}
    python benchmarks/bench.py --workloads mixed --systems paged_hf,hf_static --dtypes bf16 --plot
    python benchmarks/bench.py --profile          # where paged_hf's step time goes (torch.profiler)
    python benchmarks/bench.py --smoke            # tiny random llama, seconds (used by the tests)
    python benchmarks/bench.py --workloads mixed,prefix_long --systems paged_hf,paged_hf_torch,vllm_cpu \
        --dtypes bf16 --repeat 3                  # against vLLM's CPU engine (bash benchmarks/peers/vllm_cpu.sh)

Model: SmolLM2-135M-Instruct real weights (``paged_hf.model.default_model.load_default_model``); the
transformers baselines run on a separate copy that paged_hf never patches. Workloads are in
``bench_workloads.py``, the systems in ``bench_systems.py``, FLOPs and the matmul ceiling in
``bench_flops.py`` (the formula is in its docstring). A table goes to stdout, JSON to --out.
``paged_hf_torch`` is paged_hf on its pure-PyTorch attention path (``backend="torch"``, what ran
before the CPU kernel); ``vllm_cpu`` is vLLM's CPU engine in its own venv (``peers/vllm_worker.py``,
kept running between rows; its threads = --threads, bound to the first cores). paged_hf's engine is
kept between rows too (``kept_engine``): each run starts from an empty prefix cache on both.

Columns: wall (s, first arrival to last token); out/s and tot/s (output, prompt+output tokens
per second); comp/need (tokens fed to the model / tokens a perfect prefix-cached system must
compute); TTFT and TPOT p50/p99 over requests (TPOT = (latency - ttft) / (n_out - 1); W-long:
the short requests only); ITL p50/p99 over every gap between consecutive tokens of those
requests (per-request TPOT averages a stall away, ITL shows it); RSS (peak resident MiB during the row, process-wide: both model
copies included); KV waste; prefix hits (share of prompt tokens served from cache); util
(needed FLOPs / wall / matmul ceiling); floor (needed FLOPs / ceiling, seconds).
A row marked * ran on a subset of the requests and is extrapolated at the same output tok/s.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # `paged-hf bench` runs this file with runpy

import common  # noqa: E402
import omp_env  # noqa: E402  (before torch: OpenMP reads its wait policy when libgomp loads)

OMP_WAIT_POLICY = omp_env.setup()

import bench_flops  # noqa: E402
import bench_systems as S  # noqa: E402
import bench_workloads as W  # noqa: E402
import torch  # noqa: E402

SYSTEMS = ("hf_seq", "hf_static", "hf_cb", "paged_hf", "paged_hf_torch", "vllm_cpu")
DEFAULT_SYSTEMS = "hf_seq,hf_static,hf_cb,paged_hf"
WORKLOADS = ("mixed", "prefix", "prefix_long", "long")
VLLM_PYTHON = HERE.parent / ".venv-vllm-cpu" / "bin" / "python"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the engine's settings a paged_hf row reports; all but num_blocks can be set on the command line
ENGINE_FIELDS = (
    "block_size max_num_batched_tokens max_num_seqs num_blocks max_prefill_tokens_while_decoding "
    "backend"
).split()


NOTES = {
    "peak_rss_mib": "peak resident set of the whole process during the row (VmHWM reset before it): both model "
    "copies, the KV cache and allocator caches included",
    "needed_tokens": "prompt + output - 1 per request, a shared prefix counted once (W-prefix)",
    "needed_flops": "2*P_layers*needed_tokens + 2*hidden*vocab*output_tokens + 4*layers*q_heads*head_dim*sum(ctx); "
    "see bench_flops.py",
    "utilisation": "needed_flops / wall / matmul ceiling (the better of the ceilings measured before and after "
    "the dtype's rows)",
    "computed_tokens": "tokens fed to the model's forward (padding, recomputation and hf_cb's padding included)",
    "ttft": "from the request's arrival to its first token (all but W-long's late requests arrive at t0)",
    "tpot": "per request (latency - ttft) / (n_out - 1); percentiles over requests",
    "itl": "every gap between consecutive tokens of the reported requests",
    "kv_waste": "paged_hf: mean over steps of unfilled slots in allocated blocks; hf_static: unused share of the "
    "batch's KV slots at its end (padding, finished rows); hf_cb: not exposed",
    "hf_seq": "extrapolated rows ran the first `subset` requests; wall/tok/s scaled at the same output tok/s",
}


# ---- process memory ----------------------------------------------------------------------------
def _cpu_time() -> float:
    t = os.times()
    return t.user + t.system


def _loadavg() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def _loadavg1() -> float | None:
    return (_loadavg() or [None])[0]


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) so the next reading is this row's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024
    except (OSError, AttributeError):
        import resource

        # never reset: process peak
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- statistics --------------------------------------------------------------------------------
def cross_check(rows: list[dict], tokens: list) -> None:
    """Each row's tokens against the reference: the first transformers row that ran every request."""
    full = [
        i for i, r in enumerate(rows) if r["system"].startswith("hf_") and not r["extrapolated"]
    ]
    for row, toks in zip(rows, tokens if full else []):
        ref_toks = tokens[full[0]][: len(toks)]
        row["match_reference"] = sum(a == b for a, b in zip(toks, ref_toks)) / len(toks)
        agree = sum(
            len(os.path.commonprefix([a, b])) / max(1, len(b)) for a, b in zip(toks, ref_toks)
        )
        row["match_prefix"] = agree / len(toks)
        row["reference_system"] = rows[full[0]]["system"]


def latency_metrics(res: S.RunResult, focus: list[int]) -> dict:
    ttft, tpot, itl = [], [], []
    for i in focus:
        t = res.token_times[i]
        if not t:
            continue
        ttft.append(t[0] - res.arrival[i])
        if len(t) > 1:
            tpot.append((t[-1] - t[0]) / (len(t) - 1))
            itl += [b - a for a, b in zip(t, t[1:])]
    series = {"ttft": ttft, "tpot": tpot, "itl": itl}
    out = {f"{k}_p{q}": common.pct(xs, q) for k, xs in series.items() for q in (50, 99)}
    return {**out, "itl_max": max(itl) if itl else None}


# ---- models ------------------------------------------------------------------------------------
def load_models(smoke: bool, dtype: torch.dtype):
    """(baseline model, engine model, special ids, pad id); two independent copies."""
    if smoke:
        base, special, pad = common.tiny_llama(dtype)
        return base, copy.deepcopy(base), special, pad
    base, tok = common.default_model(dtype)
    # paged_hf patches the copy only
    return base, copy.deepcopy(base), common.special_ids(tok), tok.pad_token_id


# ---- one row -----------------------------------------------------------------------------------
def kept_engine(args, system: str, eng_model, engine_cfg: dict):
    """paged_hf's engine for ``system``, kept between rows as vLLM's worker keeps its engine: a run
    starts from an empty prefix cache (``reset_prefix_cache``, as the worker's ``llm.reset_prefix_cache()``)
    on a KV pool whose pages earlier runs faulted in. A fresh engine per row paid those first-touch
    faults inside every timed run (W-mixed, 64 requests: ~80,000 faults, ~7% of the wall on a
    virtual machine whose host backs freed memory anew) while vLLM's kept pool paid them once."""
    held = getattr(args, "_engines", None) or {}
    if system not in held:
        from paged_hf import Engine

        held.clear()  # one engine on the model at a time: drop the other system's first
        gc.collect()
        torch_path = {"backend": "torch"} if system == "paged_hf_torch" else {}
        held[system] = Engine(eng_model, **{**engine_cfg, **torch_path})
    else:
        held[system].reset_prefix_cache()
    args._engines = held
    return held[system]


def run_system(system, batch, base, eng_model, w, args, pad_id, engine_cfg, warm) -> S.RunResult:
    """One row's run of ``system`` (``batch``: hf_static's) on ``w``, after the warm-up ``warm``."""
    if system.startswith("hf_"):
        from paged_hf import is_patched

        assert not is_patched(base) and base.config._attn_implementation != "paged_hf", (
            "the transformers baselines must run on a model paged_hf never patched"
        )
    if system == "hf_seq":
        S.run_hf_seq(base, warm, pad_id)
        return S.run_hf_seq(base, w, pad_id, subset=args.seq_subset)
    if system == "hf_static":
        S.run_hf_static(base, warm, batch, pad_id)
        return S.run_hf_static(base, w, batch, pad_id)
    if system == "hf_cb":
        S.run_hf_cb(base, warm)
        return S.run_hf_cb(base, w)
    if system == "vllm_cpu":
        return args._peers["vllm_cpu"].run(w, warm)
    if system in ("paged_hf", "paged_hf_torch"):
        engine = kept_engine(args, system, eng_model, engine_cfg)
        S.run_paged(engine, warm, tag="warm")
        res = S.run_paged(engine, w)
        res.extra["engine_config"] = {k: getattr(engine.config, k) for k in ENGINE_FIELDS}
        return res
    raise ValueError(system)


def make_row(
    system, batch, dtype_name, w, res: S.RunResult, ceiling, geo, rss, save_tokens
) -> dict:
    """The table's row of one run (``rss``: its peak resident MiB)."""
    work = bench_flops.needed_work(w, geo)
    ran = res.extra.pop("workload", w)  # hf_seq may have run a subset
    ran_work = bench_flops.needed_work(ran, geo) if ran is not w else work
    wall_ran = res.t_end - res.t_start
    scale = work["output_tokens"] / ran_work["output_tokens"]
    wall = wall_ran * scale
    prompt_tokens = sum(len(r.prompt) for r in w.requests)
    expected = [r.n_out for r in ran.requests]
    got = [len(t) for t in res.tokens]
    assert got == expected, f"{system}: produced {got} tokens, expected {expected}"
    lat = latency_metrics(res, ran.focus_ids)
    if res.subset is not None:
        # queueing in a subset says nothing of the full run
        lat["ttft_p50"] = lat["ttft_p99"] = None
    gflops = ceiling["gflops"]
    computed = res.computed_tokens  # a subset's, scaled as the work a cacheless system does
    computed *= work["naive_tokens"] / ran_work["naive_tokens"] if ran is not w else 1
    name = system if batch is None else f"{system}_B{batch}"
    n_out, needed, flops = work["output_tokens"], work["needed_tokens"], work["flops"]
    row = {"workload": w.name, "system": name, "dtype": dtype_name, "subset": res.subset}
    row |= {"extrapolated": res.subset is not None, "wall_s": wall, "wall_measured_s": wall_ran}
    row |= {"output_tok_s": n_out / wall, "total_tok_s": (prompt_tokens + n_out) / wall}
    row |= {"computed_tokens": computed, "needed_tokens": needed}
    row |= {"computed_over_needed": computed / needed, **lat}
    row |= {"forward_calls": len(res.forward_sizes)}
    row |= {"tokens_per_forward_p50": common.pct(res.forward_sizes, 50), "peak_rss_mib": rss}
    shown = ("kv_waste", "prefix_hit_rate")  # columns of their own; the rest under "extra"
    row |= {k: res.extra.get(k) for k in shown}
    row |= {"needed_flops": flops, "utilisation": flops / wall / (gflops * 1e9)}
    row |= {"floor_s": flops / (gflops * 1e9), "ceiling_gflops": gflops}
    row["extra"] = {k: v for k, v in res.extra.items() if k not in shown}
    if save_tokens:
        row["tokens"] = res.tokens
    return row


# ---- output ------------------------------------------------------------------------------------
COLUMNS = [  # header, key, format, scale
    ("workload", "workload", "{}", 1),
    ("system", "system", "{}", 1),
    ("dtype", "dtype", "{}", 1),
    ("wall s", "wall_s", "{:.1f}", 1),
    ("out/s", "output_tok_s", "{:.0f}", 1),
    ("tot/s", "total_tok_s", "{:.0f}", 1),
    ("comp/need", "computed_over_needed", "{:.2f}", 1),
    ("TTFT p50", "ttft_p50", "{:.2f}", 1),
    ("p99", "ttft_p99", "{:.2f}", 1),
    ("TPOT p50 ms", "tpot_p50", "{:.0f}", 1e3),
    ("p99", "tpot_p99", "{:.0f}", 1e3),
    ("ITL p50 ms", "itl_p50", "{:.0f}", 1e3),
    ("p99", "itl_p99", "{:.0f}", 1e3),
    ("RSS MiB", "peak_rss_mib", "{:.0f}", 1),
    ("KV waste", "kv_waste", "{:.0%}", 1),
    ("prefix hit", "prefix_hit_rate", "{:.0%}", 1),
    ("match", "match_reference", "{:.0%}", 1),
    ("agree", "match_prefix", "{:.0%}", 1),
    ("util", "utilisation", "{:.1%}", 1),
    ("floor s", "floor_s", "{:.1f}", 1),
    ("cpu", "cpu_share", "{:.0%}", 1),
]


def format_table(rows: list[dict]) -> str:
    cells = [[h for h, *_ in COLUMNS]]
    for r in rows:
        line = []
        for _, key, fmt, sc in COLUMNS:
            v = r.get(key)
            s = "-" if v is None else (fmt.format(v * sc) if not isinstance(v, str) else v)
            if key == "system" and r.get("extrapolated"):
                s += f"*{r['subset']}"
            line.append(s)
        cells.append(line)
    return common.text_table(cells, left=3)


def ratios(rows: list[dict]) -> list[str]:
    """paged_hf against the best static batch and hf_cb, per workload and dtype."""
    lines = []
    for key in sorted({(r["workload"], r["dtype"]) for r in rows}):
        group = [r for r in rows if (r["workload"], r["dtype"]) == key]
        paged = next((r for r in group if r["system"] == "paged_hf"), None)
        if paged is None:
            continue
        parts = [f"{key[0]} {key[1]}: paged_hf {paged['output_tok_s']:.0f} out tok/s"]
        static = [r for r in group if r["system"].startswith("hf_static")]
        if static:
            best = max(static, key=lambda r: r["output_tok_s"])
            parts.append(
                f"{paged['output_tok_s'] / best['output_tok_s']:.2f}x best static ({best['system']})"
            )
        for other in ("hf_cb", "vllm_cpu", "paged_hf_torch"):
            row = next((r for r in group if r["system"] == other), None)
            if row:
                parts.append(f"{paged['output_tok_s'] / row['output_tok_s']:.2f}x {other}")
        parts.append(f"util {paged['utilisation']:.1%}")
        if paged.get("tpot_p50"):
            parts.append(f"TPOT p99/p50 {paged['tpot_p99'] / paged['tpot_p50']:.2f}")
        if paged.get("itl_p50"):
            parts.append(f"ITL p99/p50 {paged['itl_p99'] / paged['itl_p50']:.2f}")
        pf = paged["extra"].get("prefill_tokens_computed")
        if pf is not None:
            parts.append(f"prefill computed {pf}")
        lines.append(", ".join(parts))
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # lazily: only --plot needs it (pip install -e ".[bench]")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(5.5 * len(workloads), 8), squeeze=False)
    for col, wname in enumerate(workloads):
        group = [r for r in rows if r["workload"] == wname]
        labels = [f"{r['system']}{'*' if r['extrapolated'] else ''}\n{r['dtype']}" for r in group]
        colors = ["tab:green" if r["system"] == "paged_hf" else "tab:gray" for r in group]
        ax = axes[0][col]
        ax.bar(range(len(group)), [r["output_tok_s"] for r in group], color=colors)
        for dtype in dict.fromkeys(r["dtype"] for r in group):
            r0 = next(r for r in group if r["dtype"] == dtype)
            outs = r0["output_tok_s"] * r0["wall_s"]
            ax.axhline(outs / r0["floor_s"], ls="--", lw=1, label=f"floor {dtype} (matmul ceiling)")
        ax.set_xticks(range(len(group)), labels, fontsize=7, rotation=45, ha="right")
        ax.set_ylabel("output tok/s")
        ax.set_title(wname)
        ax.legend(fontsize=7)
        ax = axes[1][col]
        bars = [("tpot_p50", "TPOT p50", "tab:blue"), ("tpot_p99", "TPOT p99", "tab:orange")]
        for k, (key, label, color) in enumerate(bars + [("itl_p99", "inter-token p99", "tab:red")]):
            x = [i + (k - 1) * 0.27 for i in range(len(group))]
            ms = [(r[key] or 0) * 1e3 for r in group]
            ax.bar(x, ms, width=0.27, label=label, color=color)
        ax.set_xticks(range(len(group)), labels, fontsize=7, rotation=45, ha="right")
        ax.set_ylabel("ms per output token")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    opt, mode = p.add_argument, p.add_mutually_exclusive_group()
    h = "under 2 minutes: W-mixed-16 (short outputs), bf16, hf_static B=8, hf_cb, paged_hf"
    mode.add_argument("--quick", action="store_true", help=h)
    h = "tiny random llama, 4 requests, fp32, seconds (tests)"
    mode.add_argument("--smoke", action="store_true", help=h)
    opt("--profile", action="store_true", help="profile paged_hf on W-mixed, not benchmark")
    h = "(default: all; --quick: mixed; --smoke: mixed, prefix, long)"
    opt("--workloads", help=f"comma list of {', '.join(WORKLOADS)} {h}")
    h = f"(default: {DEFAULT_SYSTEMS}; --quick: hf_static, hf_cb, paged_hf)"
    opt("--systems", help=f"comma list of {', '.join(SYSTEMS)} {h}")
    opt("--dtypes", help="comma list of fp32, bf16 (default: both; --quick: bf16)")
    opt("--batch-sizes", help="static batch sizes, comma list (default 8,32; --quick 8)")
    h = "W-mixed and W-prefix-long requests (default 64; --quick 16; --smoke 4)"
    opt("--n", type=int, help=h)
    h = "shrink W-prefix and W-long (lengths and counts) by this factor, for quick experiments"
    opt("--scale", type=float, default=1.0, help=h + " (default 1)")
    h = "hf_seq runs only the first K requests and extrapolates (default 8; 0 = all)"
    opt("--seq-subset", type=int, help=h)
    common.add_threads(p, help="torch threads (default: all cores; --smoke: 1)")
    opt("--seed", type=int, default=0)
    h = "leave glibc's malloc at its defaults for every system (by default it is set once for the "
    h += "whole process, as paged_hf's CPU engine sets it, and for vLLM's worker: "
    h += "paged_hf/execution/cpu/malloc.py)"
    opt("--no-tune-malloc", dest="tune_malloc", action="store_false", help=h)
    common.add_omp(p)
    h = "run every row R times, interleaved, and report the median-wall run (wall_s_runs: all)"
    opt("--repeat", type=int, default=1, help=h)
    h = "paged_hf's backend (default auto: the CPU kernel where it builds; torch: the pure-PyTorch"
    opt("--backend", choices=("auto", "torch"), help=h + " path, e.g. for --profile before/after)")
    h = "paged_hf samples at this temperature (default 0: greedy, as every system here); a "
    opt("--temperature", type=float, default=0.0, help=h + "sampler's cost in the step")
    opt("--block-size", type=int, help="paged_hf block_size (default: the engine's)")
    opt("--max-num-batched-tokens", type=int, help="paged_hf token budget per step")
    opt("--max-num-seqs", type=int, help="paged_hf max running sequences")
    h = "paged_hf prefill tokens per step next to running decodes (default: the engine's, 128; "
    opt("--max-prefill-tokens-while-decoding", type=int, help=h + "0: no cap)")
    opt("--out", help="JSON path (default benchmarks/results/bench-<date>.json)")
    opt("--plot", nargs="?", const="", help="write a PNG (default: the JSON path, .png)")
    opt("--save-tokens", action="store_true", help="keep every request's output tokens in the JSON")
    h = "--profile: the workload to profile (default mixed)"
    opt("--profile-workload", default="mixed", choices=("mixed", "prefix_long"), help=h)
    h = "time pure decode steps of N running sequences at ~L tokens of context, torch path vs CPU"
    opt("--profile-decode", metavar="NxL", help=h + " kernel (e.g. 64x700), not benchmark")
    opt("--profile-steps", type=int, default=6, help="--profile-decode: steps per round")
    opt("--profile-rows", type=int, default=25, help="--profile: rows of the op table")
    opt("--profile-shapes", action="store_true", help="--profile: also a table by input shapes")
    args = p.parse_args(argv)

    def pick(value: str | None, default: str, known) -> list[str]:
        items = [s.strip() for s in (value or default).split(",") if s.strip()]
        bad = [s for s in items if s not in known]
        if bad:
            p.error(f"unknown {bad}; known: {', '.join(known)}")
        return items

    quick, smoke = args.quick, args.smoke
    every = "mixed,prefix,long" if smoke else "mixed,prefix,prefix_long,long"
    args.workloads = pick(args.workloads, "mixed" if quick else every, WORKLOADS)
    default = "hf_static,hf_cb,paged_hf" if quick else DEFAULT_SYSTEMS
    args.systems = pick(args.systems, default, SYSTEMS)
    if "vllm_cpu" in args.systems and smoke:
        p.error("vllm_cpu runs the real model only (not --smoke)")
    if "vllm_cpu" in args.systems and not VLLM_PYTHON.exists():
        p.error(f"vllm_cpu needs {VLLM_PYTHON}: build it with `bash benchmarks/peers/vllm_cpu.sh`")
    args.dtypes = pick(args.dtypes, "bf16" if quick else ("fp32" if smoke else "fp32,bf16"), DTYPES)
    default = "8" if quick else "2,4" if smoke else "8,32"
    args.batch_sizes = [int(b) for b in (args.batch_sizes or default).split(",")]
    args.n = args.n or (16 if quick else 4 if smoke else 64)
    if args.seq_subset is None:
        args.seq_subset = 0 if smoke else 8
    args.seq_subset = args.seq_subset or None
    if smoke:
        args.save_tokens = True
    args.threads = args.threads or (1 if smoke else os.cpu_count())
    return args


def engine_config(args) -> dict:
    """The engine's settings the command line gives (--backend, --block-size, ...)."""
    cfg = {k: getattr(args, k, None) for k in ENGINE_FIELDS}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    if cfg.get("max_prefill_tokens_while_decoding") == 0:  # 0 on the command line: no cap
        cfg["max_prefill_tokens_while_decoding"] = None
    if not args.tune_malloc:
        cfg["cpu_tune_malloc"] = False
    return cfg


def build_workloads(args, pool: list[int]) -> list[W.Workload]:
    if args.smoke:
        out = []
        for name in args.workloads:
            if name == "mixed":
                out.append(W.w_mixed(pool, args.n, args.seed, prompt_len=(8, 40), out_len=(4, 12)))
            else:
                out += W.build([name], pool, scale=1 / 16, seed=args.seed)
        return out
    sizes = dict(mixed_n=args.n, mixed_out=(16, 48) if args.quick else (16, 128), scale=args.scale)
    return W.build(args.workloads, pool, seed=args.seed, **sizes)


def machine_info(args) -> dict:
    import transformers

    cpuinfo = Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    names = [
        line.split(":", 1)[1] for line in cpuinfo.splitlines() if line.startswith("model name")
    ]
    cpu = names[0].strip() if names else ""
    info = {"date": _dt.datetime.now().isoformat(timespec="seconds")}
    info |= {"python": platform.python_version(), "torch": torch.__version__}
    info |= {"transformers": transformers.__version__, "cpu": cpu, "cores": os.cpu_count()}
    info |= {"threads": args.threads, "omp_wait_policy": OMP_WAIT_POLICY, "malloc": args._malloc}
    return info | {"loadavg_start": _loadavg()}


def benchmark(args) -> dict:
    eng_cfg = engine_config(args)
    result: dict[str, Any] = {"meta": {**machine_info(args), "notes": NOTES}}
    result["meta"]["paged_hf_temperature"] = args.temperature
    result["args"] = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    result |= {"engine_config_overrides": eng_cfg, "ceilings": {}, "workloads": {}, "rows": []}
    t_run = time.perf_counter()
    with omp_env.OtherProcesses() as look:  # not the load average: this VM idles at ~1
        time.sleep(0.5)
    others, spare = look.cores, (os.cpu_count() or 1) - args.threads + 0.3
    if others is not None and args.threads > 1 and others > spare:
        common.log(
            f"WARNING: other processes kept {others:.1f} of {os.cpu_count()} cores busy before the run: they compete "
            f"for the cores. Multi-threaded GEMMs stall badly when oversubscribed (on this machine one forward "
            f"ranged from 66 ms to 2.5 s with 2 threads, 80-92 ms with 1): compare rows of one run only, check "
            f"the cpu column, and prefer --threads 1 and --repeat 3 while the machine is busy.",
        )
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        t0 = time.perf_counter()
        base, eng_model, special, pad_id = load_models(args.smoke, dtype)
        S.prepare_baseline(base)
        geo = bench_flops.Geometry.of(base)
        pool = W.allowed_ids(geo.vocab, special)
        common.log(
            f"[{dtype_name}] models loaded in {time.perf_counter() - t0:.1f}s; measuring the matmul ceiling",
        )
        ceiling = bench_flops.matmul_ceiling(geo, dtype, min_time=0.005 if args.smoke else 0.03)
        common.log(
            f"[{dtype_name}] matmul ceiling {ceiling['gflops']:.0f} GFLOP/s (m={ceiling['best_rows']}; by m: "
            + ", ".join(f"{m}: {g:.0f}" for m, g in ceiling["layer_gflops_by_rows"].items())
            + ")",
        )
        warm = W.warm(pool)
        args._peers = {}
        if "vllm_cpu" in args.systems:
            args._peers["vllm_cpu"] = S.VllmCpu(VLLM_PYTHON, base, dtype, args.threads)
        for w in build_workloads(args, pool):
            result["workloads"].setdefault(
                w.name, {**w.summary(), **bench_flops.needed_work(w, geo)}
            )
            batches = {"hf_static": args.batch_sizes}  # the other systems: one row each
            plan = [(s, b) for s in args.systems for b in batches.get(s, [None])]
            runs: dict[int, list[tuple[dict, list]]] = {k: [] for k in range(len(plan))}
            # rounds interleave the systems, so load drifts hit all alike
            for rep in range(args.repeat):
                for k, (system, batch) in enumerate(plan):
                    label = system if batch is None else f"{system}_B{batch}"
                    common.log(
                        f"[{dtype_name}] {w.name} {label}"
                        + (f" round {rep + 1}/{args.repeat}" if args.repeat > 1 else "")
                        + f" ... (t={time.perf_counter() - t_run:.0f}s)",
                    )
                    gc.collect()
                    reset_peak_rss()
                    load0, cpu0, t1 = _loadavg1(), _cpu_time(), time.perf_counter()
                    res = run_system(system, batch, base, eng_model, w, args, pad_id, eng_cfg, warm)
                    rss = peak_rss_mib()
                    row = make_row(
                        system, batch, dtype_name, w, res, ceiling, geo, rss, args.save_tokens
                    )
                    row["row_time_s"] = time.perf_counter() - t1
                    # CPU time this process got over the row, per thread: well under 1 means other
                    # processes took the cores (hf_cb's setup and warm-ups are inside the row time)
                    row["cpu_share"] = (_cpu_time() - cpu0) / row["row_time_s"] / args.threads
                    row["loadavg_1m"] = [load0, _loadavg1()]
                    runs[k].append((row, res.tokens))
                    common.log(format_table([row]).splitlines()[-1])
            w_rows, w_tokens = [], []
            for k in range(len(plan)):  # each row's median run (the lower median for even counts)
                by_wall = sorted(runs[k], key=lambda rt: rt[0]["wall_s"])
                row, toks = by_wall[(len(by_wall) - 1) // 2]
                if len(by_wall) > 1:
                    row["wall_s_runs"] = [r["wall_s"] for r, _ in runs[k]]
                w_rows.append(row)
                w_tokens.append(toks)
            cross_check(w_rows, w_tokens)
            result["rows"] += w_rows
        # the machine is shared: measure the ceiling again after the rows, keep the better of the two
        # (a conservative utilisation), and recompute the rows' utilisation against it
        again = bench_flops.matmul_ceiling(geo, dtype, min_time=0.005 if args.smoke else 0.03)
        best = dict(max(ceiling, again, key=lambda c: c["gflops"]))
        best.update(before_rows_gflops=ceiling["gflops"], after_rows_gflops=again["gflops"])
        result["ceilings"][dtype_name] = best
        for row in result["rows"]:
            if row["dtype"] == dtype_name:
                row["ceiling_gflops"] = best["gflops"]
                row["utilisation"] = row["needed_flops"] / row["wall_s"] / (best["gflops"] * 1e9)
                row["floor_s"] = row["needed_flops"] / (best["gflops"] * 1e9)
        common.log(
            f"[{dtype_name}] matmul ceiling after the rows {again['gflops']:.0f} GFLOP/s; using "
            f"{best['gflops']:.0f}",
        )
        for peer in args._peers.values():
            result.setdefault("peers", {})[f"{peer.name}/{dtype_name}"] = peer.info
            peer.close()
        args._peers = {}
        args._engines = {}
        del base, eng_model
        gc.collect()
    result["meta"]["loadavg_end"] = _loadavg()
    result["meta"]["runtime_s"] = time.perf_counter() - t_run
    return result


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # one allocator setting for every system in the process (transformers' rows included), set before any runs
    args._malloc = S.set_malloc(args.tune_malloc)
    S.PAGED_SAMPLING["temperature"] = args.temperature
    if args.profile_decode or args.profile:
        import bench_profile

        if args.profile_decode:
            return bench_profile.main_decode(args, sys.modules[__name__])
        return bench_profile.main(args, sys.modules[__name__], engine_config(args))
    result = benchmark(args)
    result["meta"]["total_runtime_s"] = time.perf_counter() - t_start
    rows = result["rows"]
    print()
    for d, c in result["ceilings"].items():
        print(
            f"matmul ceiling {d}: {c['gflops']:.0f} GFLOP/s at m={c['best_rows']} "
            f"(by m: {', '.join(f'{m}: {g:.0f}' for m, g in c['layer_gflops_by_rows'].items())}; "
            f"before the rows {c['before_rows_gflops']:.0f}, after {c['after_rows_gflops']:.0f})"
        )
    print(format_table(rows))
    for line in ratios(rows):
        print(line)
    if any(r["extrapolated"] for r in rows):
        print(
            "* ran on the first K requests only; wall and tok/s extrapolated at the same output tok/s, TTFT omitted"
        )
    print(
        "match = share of requests whose tokens all equal the reference row's (the first transformers row that "
        "ran every request); agree = mean share of each request's tokens before its first difference. Greedy "
        "decoding of random-token prompts has near-ties, and bf16 numerics change with batch shape, so < 100% "
        "is expected in bf16; fp32 should be ~100%."
    )
    out = common.write_json(args.out or common.stamped("bench"), result)
    print(
        f"(total {result['meta']['total_runtime_s']:.0f}s, threads {args.threads}, "
        f"OpenMP wait policy {OMP_WAIT_POLICY}, malloc {args._malloc}, "
        f"load avg {result['meta']['loadavg_start']} -> {result['meta']['loadavg_end']})"
    )
    if args.plot is not None:
        png = Path(args.plot) if args.plot else out.with_suffix(".png")
        plot(rows, png)
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
