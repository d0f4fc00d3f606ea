"""The CUDA check: FlashInfer alone, then the FlashInfer path's correctness, then throughput.

Phases (``--phases``, each in a subprocess of its own, under ``--budget`` seconds in all; the report
``OUT/gpu_check.json``, the log and ``summary.md`` rewritten after every phase, ``OUT`` = ``$OUT``):
  env          versions, the device
  smoke        benchmarks/gpu/gpu_smoke_flashinfer.py: FlashInfer's wrappers against fp32, before paged_hf
  agreement    per family (``--families`` of llama, qwen3, gemma2: plain, q/k norms, window + soft-cap;
               bf16, head_dim 128): greedy generations on the risky workload (shared prefixes, chunked
               prefill and mixed steps at a 64-token budget, twelve output lengths so decode batches
               shrink through the graph buckets with padding rows) with FlashInfer and CUDA graphs,
               FlashInfer eager and torch, each teacher-forced through transformers, and how long each
               agrees with torch token for token; the graph buckets each ran
  hf_generate  transformers' generate, one static batch, time-capped (--hf-max-time)
  hf_batch     transformers' continuous batching (the manager behind generate_batch), time-capped
  eager/graphs paged_hf without and with CUDA graphs, nano-vllm's workload: N requests, prompt and
               output lengths U[100, 1024], random ids, EOS ignored, temperature 0.6, unseeded,
               Qwen3-0.6B's config with random weights
  decode       engine step time at batch 64, eager against graphs
  memory       an engine sized by profiling (no num_blocks): its KV, 64 requests through it, peak
               memory; swap preemption on a quarter of the blocks against the same requests with room;
               the host KV tier (pinned, written on eviction) under that pool, the workload twice
``--call 1`` / ``--call 2``: the two device calls of the plan in gpu_check.sh's header.

    bash benchmarks/gpu/gpu_check.sh --call 1          # on the GPU (installs what is carried, then this)
    python benchmarks/gpu/gpu_check.py --dry-run       # tiny, on CPU, FlashInfer's stand-in: every phase
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import paged_hf
from paged_hf import SamplingParams


@dataclass
class Setup:  # a GPU run's sizes, unless given
    num_requests: int
    max_num_seqs: int
    max_num_batched_tokens: int
    hf_max_time: float
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    dry_run: bool = False
    min_len: int = 100
    max_len: int = 1024
    token_range: int = 10000
    temperature: float = 0.6
    decode_batch: int = 64
    decode_steps: int = 50
    seed: int = 0
    stand_in: bool = False  # dry run: FlashInfer's pure-torch stand-in (gpu_stand_in.py)

    @property
    def backend(self) -> str:
        return "flashinfer" if self.stand_in else "auto"


@dataclass
class Row:
    name: str
    output_tokens: int = 0
    seconds: float = 0.0
    requests_done: int = 0
    note: str = ""
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(setup: Setup) -> None:
    if setup.device == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- models ---------------------------------------------------------------------------------------
FAMILIES = ("llama", "qwen3", "gemma2")  # plain, per-head q/k norms, window + soft-cap


def tiny_config(family: str, dry: bool):
    from transformers import Gemma2Config, LlamaConfig, Qwen3Config

    head_dim = 16 if dry else 128
    vocab, hidden, intermediate = (512, 64, 128) if dry else (4096, 256, 512)
    sizes = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)
    ids = dict(initializer_range=0.15, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    common = dict(**sizes, **heads, **ids, max_position_embeddings=2048, num_hidden_layers=2)
    if family == "gemma2":
        window = dict(sliding_window=16, query_pre_attn_scalar=head_dim, num_hidden_layers=4)
        caps = dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
        return Gemma2Config(**{**common, **window, **caps})
    return {"llama": LlamaConfig, "qwen3": Qwen3Config}[family](**common)


def qwen3_06b_config(dry: bool):
    """Qwen/Qwen3-0.6B's config.json (random weights are drawn for it); a tiny one for --dry-run."""
    from transformers import Qwen3Config

    if dry:
        sizes = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        return Qwen3Config(**sizes, **heads, max_position_embeddings=2048)
    return Qwen3Config(**json.loads(QWEN3_06B))


QWEN3_06B = """{"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
"max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
"tie_word_embeddings": true, "hidden_act": "silu", "attention_bias": false,
"bos_token_id": 151643, "eos_token_id": 151645}"""


def build_model(config, setup: Setup, seed: int, attn: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(setup.device):
            model = AutoModelForCausalLM.from_config(
                config, dtype=setup.dtype, attn_implementation=attn
            )
    return model.eval()


# ---- (a) agreement ----------------------------------------------------------------------------------
@torch.inference_mode()
def teacher_forced_agreement(
    model, prompts: list[list[int]], outputs: list[list[int]]
) -> tuple[float, float]:
    """(share of generated tokens that are transformers' argmax, largest logit gap where not)."""
    hits = total = 0
    worst_gap = 0.0
    device = next(model.parameters()).device
    for prompt, out in zip(prompts, outputs):
        if not out:
            continue
        ids = torch.tensor([prompt + out], device=device)
        start = len(prompt) - 1
        logits = model(ids, use_cache=False).logits[0, start : start + len(out)].float()
        target = torch.tensor(out, device=device)
        best = logits.argmax(-1)
        hits += int((best == target).sum())
        total += len(out)
        gap = (logits.max(-1).values - logits.gather(1, target[:, None])[:, 0]).max()
        worst_gap = max(worst_gap, float(gap))
    return hits / max(total, 1), worst_gap


def common_prefix_share(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(len(os.path.commonprefix([x, y])) for x, y in zip(a, b))
    return same / max(sum(max(len(x), len(y)) for x, y in zip(a, b)), 1)


AGREEMENT_VARIANTS = (
    ("flashinfer graphs", "flashinfer", True),
    ("flashinfer eager", "flashinfer", False),
    ("torch", "torch", False),
)


def agreement_workload(
    vocab: int, rng: random.Random, dry: bool
) -> tuple[list[list[int]], list[int]]:
    """The paths a kernel or graph fault hides in: six prompts sharing a 40-token prefix (prefix
    hits), six of their own (20-150 tokens, longer than a step's budget: chunked prefill, steps that
    mix prefill and decode), and twelve output lengths from 3 to 48 (dry run: 2 to 16), so the
    decode batch shrinks through the graph buckets 8 -> 4 -> 2 -> 1 with padding rows."""
    shared = [rng.randrange(4, vocab) for _ in range(40)]
    longest = 60 if dry else 150
    ids = lambda lo, hi: [rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))]  # noqa: E731
    prompts = [shared + ids(5, longest // 2) for _ in range(6)]
    prompts += [ids(20, longest) for _ in range(6)]
    dry_lengths = [2, 3, 4, 5, 6, 7, 8, 10, 12, 13, 14, 16]
    return prompts, dry_lengths if dry else [3, 5, 7, 9, 12, 16, 20, 24, 30, 36, 42, 48]


def check_agreement(setup: Setup, family: str) -> dict[str, Any]:
    """One family's greedy generations on the risky workload with FlashInfer and CUDA graphs, FlashInfer
    eager (a kernel fault told from a graph fault) and torch: each teacher-forced through
    transformers, and how long each agrees with torch token for token; the decode buckets run."""
    k, attn = FAMILIES.index(family), "eager" if family == "gemma2" else "sdpa"
    model = build_model(tiny_config(family, setup.dry_run), setup, seed=100 + k, attn=attn)
    rng = random.Random(setup.seed + k)
    prompts, out_lens = agreement_workload(model.config.vocab_size, rng, setup.dry_run)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in out_lens]
    dtype = str(setup.dtype).replace("torch.", "")
    row: dict[str, Any] = {"family": family, "dtype": dtype, "prompts": len(prompts)}
    outs = {}
    flashinfer = setup.device == "cuda" or setup.stand_in
    for name, backend, graphs in AGREEMENT_VARIANTS:
        if backend == "flashinfer" and not flashinfer:
            row[f"{name} skipped"] = "no CUDA device and no stand-in"
            continue
        try:
            sizes = dict(block_size=16, num_blocks=1024, max_num_seqs=16, max_num_batched_tokens=64)
            engine = paged_hf.Engine(model, backend=backend, use_cuda_graphs=graphs, **sizes)
            outs[name] = [o.token_ids for o in engine.generate(prompts, params)]
            stats = engine.stats()
            accel = engine.runner.decode
            tf, gap = teacher_forced_agreement(model, prompts, outs[name])
            row[name] = {"backend": stats["backend"], "teacher_forced": round(tf, 4)}
            row[name]["worst_logit_gap"] = round(gap, 4)
            row[name]["tokens"] = sum(map(len, outs[name]))  # how many were teacher-forced
            row[name] |= {k: stats[k] for k in ("steps", "prefix_hit_tokens")}
            buckets = sorted(accel.steps_by_bucket.items() if accel else [])
            row[name]["graph_steps_by_bucket"] = dict(buckets)
            del engine
        except Exception as e:  # noqa: BLE001 - reported, the other variants still run
            row[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            traceback.print_exc()
        free_memory()
    for name in outs:
        if name != "torch" and "torch" in outs:
            share = common_prefix_share(outs[name], outs["torch"])
            row[name]["agrees_with_torch"] = round(share, 4)
    log(f"agreement {row}")
    del model
    free_memory()
    return row


# ---- (b) throughput ----------------------------------------------------------------------------------
def workload(setup: Setup) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py: random ids in [0, 10000), prompt and output lengths U[100, 1024]."""
    rng, lo, hi = random.Random(setup.seed), setup.min_len, setup.max_len
    prompts = [
        [rng.randint(0, setup.token_range) for _ in range(rng.randint(lo, hi))]
        for _ in range(setup.num_requests)
    ]
    return prompts, [rng.randint(lo, hi) for _ in range(setup.num_requests)]


@torch.inference_mode()
def run_hf_generate(setup: Setup, prompts, out_lens) -> Row:
    """One static batch through transformers' generate: every row runs max(out_lens) steps; the
    useful tokens are each request's own length. Capped at --hf-max-time (max_time)."""
    model = build_model(qwen3_06b_config(setup.dry_run), setup, seed=1)
    pad = 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=setup.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    mask = mask.to(setup.device)
    steps = max(out_lens)
    kwargs = dict(sampling(setup), eos_token_id=None, pad_token_id=pad)
    warm = dict(attention_mask=mask[:2, -8:], max_new_tokens=2, min_new_tokens=2)
    model.generate(ids[:2, -8:], **warm, **kwargs)
    sync(setup)
    t = time.perf_counter()
    run = dict(max_new_tokens=steps, min_new_tokens=steps, max_time=setup.hf_max_time)
    out = model.generate(ids, attention_mask=mask, **run, **kwargs)
    sync(setup)
    seconds = time.perf_counter() - t
    done_steps = out.shape[1] - width
    tokens = sum(min(done_steps, n) for n in out_lens)
    note = f"static batch of {len(prompts)}, {steps} steps"
    if done_steps < steps:
        note = f"time-capped at {setup.hf_max_time:.0f} s after {done_steps}/{steps} steps: throughput of the part run"
    del model, out
    free_memory()
    done = sum(n <= done_steps for n in out_lens)
    return Row("transformers generate", tokens, seconds, done, note)


@torch.inference_mode()
def run_hf_continuous(setup: Setup, prompts, out_lens) -> Row:
    """transformers' continuous batching (the manager behind generate_batch, which takes a single
    max_new_tokens; the manager takes one per request). Capped at --hf-max-time."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = build_model(qwen3_06b_config(setup.dry_run), setup, seed=1)
    longest = max(out_lens)
    gen = GenerationConfig(
        **sampling(setup), eos_token_id=-1, pad_token_id=0, max_new_tokens=longest
    )
    # without num_blocks its cache takes a share of free memory: ~14 GB of RAM in the CPU dry run
    page = ContinuousBatchingConfig().page_size
    blocks = sum(-(-(len(p) + n) // page) for p, n in zip(prompts, out_lens)) + 2
    cb_config = ContinuousBatchingConfig(num_blocks=blocks)
    tokens = done = 0
    t_warm = time.perf_counter()
    configs = dict(generation_config=gen, continuous_batching_config=cb_config)
    options = dict(block=True, timeout=30, warmup=not setup.dry_run)
    with model.continuous_batching_context_manager(**configs, **options) as manager:
        warm_s = time.perf_counter() - t_warm
        sync(setup)
        t = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, out_lens)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        while done < len(prompts) and time.perf_counter() - t < setup.hf_max_time:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
                if result.error:
                    raise RuntimeError(f"request {result.request_id}: {result.error}")
            elif not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
        sync(setup)
        seconds = time.perf_counter() - t
    note = f"warm-up (graph capture) {warm_s:.1f} s, not timed"
    if done < len(prompts):
        note = (
            f"time-capped at {setup.hf_max_time:.0f} s with {done}/{len(prompts)} requests finished: "
            "counts finished requests only (a lower bound)"
        )
    del model
    free_memory()
    return Row("transformers generate_batch", tokens, seconds, done, note)


def sampling(setup: Setup) -> dict[str, Any]:
    """transformers' sampling as the workload's (temperature only, no top-k or top-p)."""
    t = setup.temperature
    return dict(do_sample=t > 0, temperature=t or None, top_k=None, top_p=None)


def paged_engine(model, setup: Setup, prompts, out_lens, graphs: bool, max_num_seqs=None):
    need = sum(-(-(len(p) + n) // 16) for p, n in zip(prompts, out_lens))
    kv = dict(num_blocks=int(need * 1.1) + 64, block_size=16, enable_prefix_caching=False)
    kv.update(max_model_len=setup.max_len * 2 + 16)
    steps = dict(max_num_seqs=max_num_seqs or setup.max_num_seqs, use_cuda_graphs=graphs)
    steps.update(max_num_batched_tokens=setup.max_num_batched_tokens)
    return paged_hf.Engine(model, backend=setup.backend, **kv, **steps)


@torch.inference_mode()
def run_paged(setup: Setup, prompts, out_lens, graphs: bool) -> Row:
    model = build_model(qwen3_06b_config(setup.dry_run), setup, seed=1)
    engine = paged_engine(model, setup, prompts, out_lens, graphs)
    # unseeded, as nano-vllm's workload: one draw per step for the batch (a seed per request costs a
    # draw per row and shrinks what the graphs save)
    sample = dict(temperature=setup.temperature, ignore_eos=True)
    params = [SamplingParams(max_new_tokens=n, **sample) for n in out_lens]
    warm_s = engine.warmup()  # kernels (FlashInfer JIT on a fresh machine), CUDA-graph capture
    sync(setup)
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync(setup)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    stats = engine.stats()
    accel = engine.runner.decode
    name = "paged_hf cuda graphs" if graphs else "paged_hf eager"
    note = f"backend {stats['backend']}, {stats['steps']} steps, {stats['preemptions']} preemptions, warm-up {warm_s:.1f} s"
    if graphs and (accel is None or not accel.use_graphs):
        note += "; CUDA graphs NOT active (no CUDA or no FlashInfer)"
    row = Row(name, tokens, seconds, sum(1 for o in outs if o.error is None), note)
    row.extra = {"backend": stats["backend"], "steps": stats["steps"], "warmup_s": round(warm_s, 2)}
    del engine, model
    free_memory()
    return row


@torch.inference_mode()
def decode_step_time(setup: Setup, graphs: bool) -> float:
    """Seconds per engine step with ``decode_batch`` requests all decoding."""
    b = setup.decode_batch
    model = build_model(qwen3_06b_config(setup.dry_run), setup, seed=1)
    rng = random.Random(7)
    n = min(256, setup.max_len)
    prompts = [[rng.randint(0, setup.token_range) for _ in range(n)] for _ in range(b)]
    out_lens = [setup.decode_steps + 8] * b
    engine = paged_engine(model, setup, prompts, out_lens, graphs, max_num_seqs=b)
    for p, n in zip(prompts, out_lens):
        engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
    scheduler = engine.scheduler
    while any(r.num_pending_tokens > 1 for r in scheduler.running) or scheduler.waiting:
        engine.step()  # prefill
    for _ in range(3):
        engine.step()  # warm (and capture)
    sync(setup)
    t = time.perf_counter()
    for _ in range(setup.decode_steps):
        engine.step()
    sync(setup)
    per_step = (time.perf_counter() - t) / setup.decode_steps
    del engine, model
    free_memory()
    return per_step


@torch.inference_mode()
def memory_checks(setup: Setup) -> dict[str, Any]:
    """The header's memory phase: KV sized by profiling on Qwen3-0.6B (no ``num_blocks``), swap
    preemption and the host tier on the agreement workload, each against a roomy run's tokens."""
    out: dict[str, Any] = {}
    model = build_model(qwen3_06b_config(setup.dry_run), setup, seed=1)
    t = time.perf_counter()
    sizes = dict(
        max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens
    )
    engine = paged_hf.Engine(model, block_size=16, backend=setup.backend, **sizes)
    out["sizing_s"] = round(time.perf_counter() - t, 2)
    out["num_blocks"] = engine.runner.backend.num_blocks
    out["kv_gib"] = round(engine.runner.backend.num_blocks * engine.page_bytes / (1 << 30), 3)
    prompts, out_lens = workload(setup)
    if setup.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in out_lens[:64]]
    done = engine.generate(prompts[:64], params)
    out["requests_ok"] = sum(o.error is None for o in done)
    if setup.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        gib = lambda n: round(n / (1 << 30), 2)  # noqa: E731
        out["peak_gib"] = gib(torch.cuda.max_memory_allocated())
        out.update(total_gib=gib(total), free_gib_after=gib(free))
    del engine, model, done
    free_memory()

    model = build_model(tiny_config("llama", setup.dry_run), setup, seed=100)
    rng = random.Random(setup.seed)
    prompts, out_lens = agreement_workload(model.config.vocab_size, rng, setup.dry_run)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in out_lens]
    need = sum(-(-(len(p) + n) // 16) for p, n in zip(prompts, out_lens))
    largest = max(-(-(len(p) + n) // 16) for p, n in zip(prompts, out_lens))
    kw = dict(block_size=16, max_num_seqs=16, max_num_batched_tokens=64, backend=setup.backend)
    kw.update(enable_prefix_caching=False)
    roomy = paged_hf.Engine(model, num_blocks=need + 16, **kw).generate(prompts, params)
    roomy = [o.token_ids for o in roomy]
    kw.update(num_blocks=max(largest + 1, need // 4))  # a quarter of what the workload needs
    engine = paged_hf.Engine(model, preemption_mode="swap", **kw)
    tight = [o.token_ids for o in engine.generate(prompts, params)]
    out["swap"] = {"preemptions": engine.stats()["preemptions"], "same_tokens": tight == roomy}
    out["swap"] |= {"num_blocks": engine.runner.backend.num_blocks, "blocks_needed": need}
    del engine
    free_memory()
    # the host tier (pinned, written as the pool evicts): the workload twice through a pool of a
    # quarter of what it needs; the second round reads what the first one's evictions kept
    engine = paged_hf.Engine(
        model, kv_host_cache_bytes=1 << 30, **dict(kw, enable_prefix_caching=True)
    )
    rounds = [[o.token_ids for o in engine.generate(prompts, params)] for _ in range(2)]
    host = engine.stats()["kv_tiers"]["host"]
    tier = {"same_tokens": rounds[0] == roomy and rounds[1] == roomy}
    tier["requests_equal"] = sum(a == b for a, b in zip(rounds[1], roomy))
    tier["requests"] = len(roomy)
    tier |= {"blocks_to_host": host["stored_blocks"], "host_hit_tokens": host["hit_tokens"]}
    out["host_tier"] = tier | {"preemptions": engine.stats()["preemptions"]}
    log(f"memory {out}")
    del engine, model
    free_memory()
    return out


def guarded(name: str, fn, *args) -> Row:
    log(f"start {name}")
    try:
        row = fn(*args)
    except Exception as e:  # noqa: BLE001 - one failed phase must not hide the others
        traceback.print_exc()
        row = Row(name, error=f"{type(e).__name__}: {e}"[:500])
        free_memory()
    speed = f"{row.output_tokens} tokens in {row.seconds:.1f} s = {row.tok_s:.0f} tok/s"
    log(f"done  {name}: {speed} {row.note}")
    return row


# ---- report ----------------------------------------------------------------------------------------
def environment(setup: Setup) -> dict[str, Any]:
    import transformers

    env = {"date": datetime.date.today().isoformat(), "python": platform.python_version()}
    env |= {"torch": torch.__version__, "transformers": transformers.__version__}
    env["paged_hf"] = paged_hf.__version__
    if setup.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        try:
            import flashinfer

            env["flashinfer"] = flashinfer.__version__
        except ImportError as e:
            env["flashinfer"] = f"not installed ({e})"
    return env


def table(rows: list[Row], base: str = "transformers generate") -> str:
    ref = {r.name: r.tok_s for r in rows}
    lines = [
        "| run | output tok/s | vs transformers generate | vs generate_batch | tokens | seconds | requests | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        vs = [f"{r.tok_s / ref[n]:.2f}x" if ref.get(n) else "-" for n in (base, f"{base}_batch")]
        cells = [r.name, f"{r.tok_s:,.0f}", *vs, f"{r.output_tokens:,}", f"{r.seconds:.1f}"]
        cells += [r.requests_done, r.error or r.note]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


PHASES = tuple("env smoke agreement hf_generate hf_batch eager graphs decode memory".split())
# The plan for a GPU lent for 15 minutes of device time, 10 at most a command (see the header):
# FA2 prefill (FA3's JIT is the slowest), the default decode kernel choice
_CALL = dict(requests=128, prefill="fa2", decode_tc="auto")
CALLS = {
    "1": dict(_CALL, phases=("env", "smoke", "agreement", "eager", "graphs"), families=("llama",)),
    "2": dict(_CALL, families=("gemma2", "qwen3"), hf_max_time=45.0),
}
CALLS["2"]["phases"] = ("env", "agreement", "memory", "hf_generate", "hf_batch", "decode")


def call_argv(argv: list[str]) -> list[str]:
    """``argv`` with ``--call N`` (or ``--call=N``) replaced by that call's options; options given
    after it still apply (argparse keeps the last)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--call" or arg.startswith("--call="):
            name = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            i += 1 if "=" in arg else 2
            plan = CALLS[name]
            out += ["--phases", ",".join(plan["phases"]), "--families", ",".join(plan["families"])]
            out += ["--requests", str(plan["requests"]), "--prefill-backend", plan["prefill"]]
            out += ["--decode-tensor-cores", plan["decode_tc"]]
            out += ["--hf-max-time", str(plan["hf_max_time"])] if "hf_max_time" in plan else []
            continue
        out.append(arg)
        i += 1
    return out


def make_setup(args: argparse.Namespace) -> Setup:
    if args.dry_run:  # tiny, on a CPU, in float32
        tiny = dict(device="cpu", dtype=torch.float32, dry_run=True, stand_in=not args.no_stand_in)
        tiny.update(min_len=4, max_len=16, token_range=500, decode_batch=4, decode_steps=3)
        return Setup(6, 8, 64, 60.0, **tiny)
    return Setup(args.requests, args.max_num_seqs, args.max_num_batched_tokens, args.hf_max_time)


def run_phase(name: str, setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    """One phase, in this process (the driver gives each its own: an illegal memory access
    poisons the process it happens in)."""
    if setup.stand_in:
        import gpu_stand_in

        gpu_stand_in.install()
    if args.fa2:
        args.prefill_backend, args.decode_tensor_cores = "fa2", "on"
    if not setup.dry_run:  # the kernels FlashInfer JIT-compiles: prefill and decode chosen apart
        from paged_hf.execution.backends import flashinfer_backend

        flashinfer_backend.PREFILL_BACKEND = args.prefill_backend
        tensor_cores = {"auto": None, "on": True, "off": False}[args.decode_tensor_cores]
        flashinfer_backend.DECODE_TENSOR_CORES = tensor_cores
    if name == "env":
        sizes = {k: str(v) for k, v in asdict(setup).items()}
        return {"environment": environment(setup), "setup": sizes}
    if name == "smoke":
        import gpu_smoke_flashinfer

        return {"smoke": gpu_smoke_flashinfer.run(setup.device, stand_in=setup.stand_in)}
    if name == "agreement":
        return {"agreement": [check_agreement(setup, f) for f in args.families.split(",")]}
    if name == "memory":
        return {"memory": memory_checks(setup)}
    prompts, out_lens = workload(setup)
    if name == "decode":
        decode: dict[str, Any] = {"batch": setup.decode_batch}
        for graphs in (False, True):
            decode["graphs" if graphs else "eager"] = decode_step_time(setup, graphs)
        decode["speedup"] = decode["eager"] / decode["graphs"]
        return {"decode_step": decode}
    runs = {
        "hf_generate": ("transformers generate", run_hf_generate, ()),
        "hf_batch": ("transformers generate_batch", run_hf_continuous, ()),
        "eager": ("paged_hf eager", run_paged, (False,)),
        "graphs": ("paged_hf cuda graphs", run_paged, (True,)),
    }
    title, fn, extra = runs[name]
    row = guarded(title, fn, setup, prompts, out_lens, *extra)
    sizes = dict(requests=len(prompts), prompt_tokens=sum(map(len, prompts)))
    sizes.update(output_tokens=sum(out_lens), seeded=False)
    return {"throughput": [dict(asdict(row), tok_s=round(row.tok_s, 1))], "workload": sizes}


def merge(report: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        if isinstance(value, list) and isinstance(report.get(key), list):
            report[key] += value
        else:
            report[key] = value


def summary(report: dict[str, Any]) -> str:
    env = report.get("environment", {})
    rows = [
        Row(**{k: v for k, v in r.items() if k != "tok_s"}) for r in report.get("throughput", [])
    ]
    title = f"## gpu_check {env.get('date', '')} on {env.get('gpu', 'CPU (dry run)')}"
    lines = [title, "", table(rows), ""]
    lines += [f"smoke {report['smoke']}"] if "smoke" in report else []
    lines += [f"agreement {r}" for r in report.get("agreement", [])]
    lines += [f"decode step {report['decode_step']}"] if "decode_step" in report else []
    lines += [f"memory {report['memory']}"] if "memory" in report else []
    lines += [f"phases {report.get('phases', {})}"]
    return "\n".join(lines)


JIT_ARCHIVE = "flashinfer_jit.tar.xz"
JIT_CARRY_BYTES = 28 << 20  # beside the ~32 MiB of wheels, under the 64 MiB a device call carries


def keep_compiled_kernels(out: Path, report: dict[str, Any]) -> None:
    """FlashInfer's JIT cache (sources, objects, ninja's logs, the .so), packed under ``out`` when it
    grew, so the next call carries it in benchmarks/gpu/wheels/ and ninja finds nothing to rebuild."""
    import subprocess

    cache = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE") or Path.home()) / ".cache/flashinfer"
    if not cache.is_dir():
        return
    size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    kept = report.setdefault("jit_cache", {"bytes": 0})
    if size == kept["bytes"]:
        return
    t = time.perf_counter()
    archive = out / JIT_ARCHIVE
    xz = dict(os.environ, XZ_OPT="-T0 -1")
    subprocess.run(["tar", "-cJf", str(archive), "-C", str(cache), "."], check=True, env=xz)
    packed = archive.stat().st_size
    if packed > JIT_CARRY_BYTES:
        archive.unlink()
    kept.update(bytes=size, packed_bytes=packed, carried=packed <= JIT_CARRY_BYTES)
    kept["pack_seconds"] = round(time.perf_counter() - t, 1)


def drive(args: argparse.Namespace, argv: list[str]) -> int:
    """Each phase in a subprocess of its own, under what is left of ``--budget``; the report JSON and
    the log rewritten under ``--out`` after every phase, so a run stopped at its limit keeps them."""
    import subprocess

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"dry_run": args.dry_run, "phases": {}}
    json_path = Path(args.json) if args.json else out / "gpu_check.json"
    started = time.perf_counter()
    passthrough = [a for a in argv if a != "--dry-run"] + (["--dry-run"] if args.dry_run else [])
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    status = 0
    with open(out / "gpu_check.log", "a") as logfile:
        for name in args.phases.split(","):
            left = args.budget - (time.perf_counter() - started)
            if left < 5:
                report["phases"][name] = "not run: out of budget"
                continue
            log(f"phase {name} (at most {left:.0f} s)")
            part_file = out / f"phase-{name}.json"
            part_file.unlink(missing_ok=True)
            t = time.perf_counter()
            cmd = [sys.executable, __file__, *passthrough, "--phase", name]
            cmd += ["--part", str(part_file)]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env)
                logfile.write(proc.stdout + proc.stderr)
                sys.stdout.write(proc.stdout[-4000:])
                ok = proc.returncode == 0 and part_file.exists()
                failed = f"failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-300:]}"
                how = "ok" if ok else failed
            except subprocess.TimeoutExpired as e:
                ok, how = False, f"timed out after {left:.0f} s"
                logfile.write(str(e.stdout or "") + str(e.stderr or ""))
            if ok:
                merge(report, json.loads(part_file.read_text()))
            status = status or (0 if ok else 1)
            report["phases"][name] = f"{how} in {time.perf_counter() - t:.1f} s"
            keep_compiled_kernels(out, report)
            report["total_seconds"] = round(time.perf_counter() - started, 1)
            json_path.write_text(json.dumps(report, indent=2, default=str))
            (out / "summary.md").write_text(summary(report) + "\n")
            logfile.flush()
    print()
    print(summary(report))
    print(f"wrote {json_path}")
    return status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    opt = ap.add_argument
    h = "tiny models and workload on CPU (float32), FlashInfer's stand-in"
    opt("--dry-run", action="store_true", help=h)
    opt("--no-stand-in", action="store_true", help="dry run without FlashInfer's stand-in (torch)")
    h = "one call of the plan in the header (phases, families, sizes)"
    opt("--call", choices=sorted(CALLS), help=h)
    h = f"comma-separated, in order, of {','.join(PHASES)}"
    opt("--phases", default=",".join(PHASES), help=h)
    h = f"agreement families, of {','.join(FAMILIES)}"
    opt("--families", default=",".join(FAMILIES), help=h)
    h = "report, log, summary (default $OUT)"
    opt("--out", default=os.environ.get("OUT") or "gpu_check_out", help=h)
    opt("--json", help="the report's path (default OUT/gpu_check.json)")
    h = "seconds for all phases (each stops when it runs out)"
    opt("--budget", type=float, default=540.0, help=h)
    opt("--requests", type=int, default=256)
    opt("--hf-max-time", type=float, default=90.0, help="cap on each transformers run, seconds")
    opt("--max-num-seqs", type=int, default=256)
    opt("--max-num-batched-tokens", type=int, default=16384)
    h = "FlashInfer: FA2 prefill and tensor-core decode (--prefill-backend fa2 "
    opt("--fa2", action="store_true", help=h + "--decode-tensor-cores on)")
    h = "FlashInfer's prefill kernels (auto: FA3 on Hopper, the slowest to JIT-compile)"
    opt("--prefill-backend", choices=("auto", "fa2", "fa3"), default="auto", help=h)
    h = "FlashInfer's decode kernel (auto: tensor cores where the GQA group exceeds 4)"
    opt("--decode-tensor-cores", choices=("auto", "on", "off"), default="auto", help=h)
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.call:
        argv = call_argv(argv)
        args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run on CPU", file=sys.stderr)
        return 2
    if args.phase is None:
        return drive(args, argv)
    setup = make_setup(args)
    part = run_phase(args.phase, setup, args)
    with open(args.part, "w") as f:
        json.dump(part, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
