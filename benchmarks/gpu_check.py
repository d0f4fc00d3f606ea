"""The CUDA check of issue 5, in one run: correctness of the FlashInfer path, then throughput.

(a) agreement, on tiny llama / qwen3 / gemma2 models in bf16 (head_dim 128: FlashInfer's kernels
    take 64/128/256/512): greedy generations with the FlashInfer backend (CUDA graphs on) and the
    torch backend, each teacher-forced through plain transformers (the patched model's forward
    outside a step is the model's own attention): the share of generated tokens that are
    transformers' argmax at that position, and how long FlashInfer and torch agree token for token.
(b) throughput, nano-vllm's workload: 256 requests, prompt and output lengths U[100, 1024], random
    token ids, EOS ignored, temperature 0.6, Qwen3-0.6B's config with random weights, for
    transformers' generate (one static batch), transformers' continuous batching (the manager
    behind ``generate_batch``, so each request keeps its own output length), paged_hf eager and
    paged_hf with CUDA graphs; plus decode step time at batch 64, eager against graphs.
    The transformers runs are time-capped (--hf-max-time): a capped run reports the throughput of
    the part it finished and says so in the table.

    python benchmarks/gpu_check.py --json gpu_check.json     # on the GPU (see gpu_check.sh)
    python benchmarks/gpu_check.py --dry-run                 # tiny, on CPU: checks the script runs

Prints a markdown table and writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import paged_hf
from paged_hf import SamplingParams


@dataclass
class Setup:
    device: str
    dtype: torch.dtype
    dry_run: bool
    num_requests: int
    min_len: int
    max_len: int
    token_range: int
    temperature: float
    max_num_seqs: int
    max_num_batched_tokens: int
    hf_max_time: float
    decode_batch: int
    decode_steps: int
    agree_prompts: int
    agree_new_tokens: int
    seed: int = 0


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
def tiny_config(family: str, dry: bool):
    from transformers import Gemma2Config, LlamaConfig, Qwen3Config

    head_dim = 16 if dry else 128
    common = dict(vocab_size=512 if dry else 4096, hidden_size=64 if dry else 256, intermediate_size=128 if dry else 512,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=2048,
                  initializer_range=0.15, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return LlamaConfig(**common, num_hidden_layers=2)
    if family == "qwen3":
        return Qwen3Config(**common, num_hidden_layers=2)
    if family == "gemma2":
        return Gemma2Config(**common, num_hidden_layers=4, sliding_window=16, attn_logit_softcapping=50.0,
                            final_logit_softcapping=30.0, query_pre_attn_scalar=head_dim)
    raise ValueError(family)


def qwen3_06b_config(dry: bool):
    """Qwen/Qwen3-0.6B's config.json (random weights are drawn for it); a tiny one for --dry-run."""
    from transformers import Qwen3Config

    if dry:
        return Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                       attention_bias=False, bos_token_id=151643, eos_token_id=151645)


def build_model(config, setup: Setup, seed: int, attn: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(setup.device):
            model = AutoModelForCausalLM.from_config(config, dtype=setup.dtype, attn_implementation=attn)
    return model.eval()


# ---- (a) agreement ----------------------------------------------------------------------------------
@torch.inference_mode()
def teacher_forced_agreement(model, prompts: list[list[int]], outputs: list[list[int]]) -> tuple[float, float]:
    """(share of generated tokens that are transformers' argmax, largest logit gap where not)."""
    hits = total = 0
    worst_gap = 0.0
    device = next(model.parameters()).device
    for prompt, out in zip(prompts, outputs):
        if not out:
            continue
        ids = torch.tensor([prompt + out], device=device)
        logits = model(ids, use_cache=False).logits[0, len(prompt) - 1: len(prompt) - 1 + len(out)].float()
        target = torch.tensor(out, device=device)
        best = logits.argmax(-1)
        hits += int((best == target).sum())
        total += len(out)
        gap = (logits.max(-1).values - logits.gather(1, target[:, None])[:, 0]).max()
        worst_gap = max(worst_gap, float(gap))
    return hits / max(total, 1), worst_gap


def common_prefix_share(a: list[list[int]], b: list[list[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same += n
        total += max(len(x), len(y))
    return same / max(total, 1)


def check_agreement(setup: Setup) -> list[dict[str, Any]]:
    rows = []
    backends = ["flashinfer", "torch"] if setup.device == "cuda" else ["torch"]
    for i, family in enumerate(("llama", "qwen3", "gemma2")):
        attn = "eager" if family == "gemma2" else "sdpa"
        model = build_model(tiny_config(family, setup.dry_run), setup, seed=100 + i, attn=attn)
        rng = random.Random(setup.seed + i)
        vocab = model.config.vocab_size
        prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(20, 60))] for _ in range(setup.agree_prompts)]
        params = SamplingParams(max_new_tokens=setup.agree_new_tokens, ignore_eos=True)
        row: dict[str, Any] = {"family": family, "dtype": str(setup.dtype).replace("torch.", "")}
        outs = {}
        for backend in backends:
            try:
                engine = paged_hf.Engine(model, backend=backend, num_blocks=1024, max_num_seqs=16,
                                         max_num_batched_tokens=512, use_cuda_graphs=backend == "flashinfer")
                outs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
                row[f"{backend}_backend"] = engine.stats()["backend"]
                del engine
                tf, gap = teacher_forced_agreement(model, prompts, outs[backend])
                row[f"{backend}_teacher_forced"] = round(tf, 4)
                row[f"{backend}_worst_logit_gap"] = round(gap, 4)
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                row[f"{backend}_error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        if "flashinfer" in outs and "torch" in outs:
            row["flashinfer_vs_torch_prefix"] = round(common_prefix_share(outs["flashinfer"], outs["torch"]), 4)
        if setup.device != "cuda":
            row["flashinfer_skipped"] = "no CUDA device (dry run)"
        rows.append(row)
        log(f"agreement {row}")
        del model
        free_memory()
    return rows


# ---- (b) throughput ----------------------------------------------------------------------------------
def workload(setup: Setup) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py: random ids in [0, 10000), prompt and output lengths U[100, 1024]."""
    rng = random.Random(setup.seed)
    prompts = [[rng.randint(0, setup.token_range) for _ in range(rng.randint(setup.min_len, setup.max_len))]
               for _ in range(setup.num_requests)]
    outputs = [rng.randint(setup.min_len, setup.max_len) for _ in range(setup.num_requests)]
    return prompts, outputs


@torch.inference_mode()
def run_hf_generate(setup: Setup, prompts, out_lens) -> Row:
    """One static batch through transformers' generate: every row runs max(out_lens) steps; the
    useful tokens are each request's own length. Capped at --hf-max-time (max_time)."""
    model = build_model(qwen3_06b_config(setup.dry_run), setup, seed=1)
    pad = 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=setup.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=setup.device)
    steps = max(out_lens)
    kwargs = dict(do_sample=setup.temperature > 0, temperature=setup.temperature or None, top_k=None, top_p=None,
                  eos_token_id=None, pad_token_id=pad)
    model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm
    sync(setup)
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                         max_time=setup.hf_max_time, **kwargs)
    sync(setup)
    seconds = time.perf_counter() - t
    done_steps = out.shape[1] - width
    tokens = sum(min(done_steps, n) for n in out_lens)
    note = f"static batch of {len(prompts)}, {steps} steps"
    if done_steps < steps:
        note = f"time-capped at {setup.hf_max_time:.0f} s after {done_steps}/{steps} steps: throughput of the part run"
    del model, out
    free_memory()
    return Row("transformers generate", tokens, seconds, sum(n <= done_steps for n in out_lens), note)


@torch.inference_mode()
def run_hf_continuous(setup: Setup, prompts, out_lens) -> Row:
    """transformers' continuous batching (the manager behind generate_batch, which takes a single
    max_new_tokens; the manager takes one per request). Capped at --hf-max-time."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = build_model(qwen3_06b_config(setup.dry_run), setup, seed=1)
    gen = GenerationConfig(do_sample=setup.temperature > 0, temperature=setup.temperature or None, top_k=None,
                           top_p=None, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(out_lens))
    # without num_blocks its cache takes a share of free memory: ~14 GB of RAM in the CPU dry run
    page = ContinuousBatchingConfig().page_size
    cb_config = ContinuousBatchingConfig(num_blocks=sum(-(-(len(p) + n) // page) for p, n in zip(prompts, out_lens))
                                         + 2)
    tokens = done = 0
    t_warm = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb_config,
                                                   block=True, timeout=30, warmup=not setup.dry_run) as manager:
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
        note = (f"time-capped at {setup.hf_max_time:.0f} s with {done}/{len(prompts)} requests finished: "
                "counts finished requests only (a lower bound)")
    del model
    free_memory()
    return Row("transformers generate_batch", tokens, seconds, done, note)


def paged_engine(model, setup: Setup, prompts, out_lens, graphs: bool, max_num_seqs: int | None = None):
    need = sum(-(-(len(p) + n) // 16) for p, n in zip(prompts, out_lens))
    return paged_hf.Engine(model, num_blocks=int(need * 1.1) + 64, block_size=16,
                           max_num_seqs=max_num_seqs or setup.max_num_seqs,
                           max_num_batched_tokens=setup.max_num_batched_tokens,
                           max_model_len=setup.max_len * 2 + 16, use_cuda_graphs=graphs,
                           enable_prefix_caching=False)


@torch.inference_mode()
def run_paged(setup: Setup, prompts, out_lens, graphs: bool) -> Row:
    model = build_model(qwen3_06b_config(setup.dry_run), setup, seed=1)
    engine = paged_engine(model, setup, prompts, out_lens, graphs)
    params = [SamplingParams(max_new_tokens=n, temperature=setup.temperature, ignore_eos=True, seed=i)
              for i, n in enumerate(out_lens)]
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
    prompts = [[rng.randint(0, setup.token_range) for _ in range(min(256, setup.max_len))] for _ in range(b)]
    out_lens = [setup.decode_steps + 8] * b
    engine = paged_engine(model, setup, prompts, out_lens, graphs, max_num_seqs=b)
    for p, n in zip(prompts, out_lens):
        engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
    while any(r.num_pending_tokens > 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
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


def guarded(name: str, fn, *args) -> Row:
    log(f"start {name}")
    try:
        row = fn(*args)
    except Exception as e:  # noqa: BLE001 - one failed phase must not hide the others
        traceback.print_exc()
        row = Row(name, error=f"{type(e).__name__}: {e}"[:500])
        free_memory()
    log(f"done  {name}: {row.output_tokens} tokens in {row.seconds:.1f} s = {row.tok_s:.0f} tok/s {row.note}")
    return row


# ---- report ----------------------------------------------------------------------------------------
def environment(setup: Setup) -> dict[str, Any]:
    import transformers

    env = {"date": datetime.date.today().isoformat(), "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "paged_hf": paged_hf.__version__}
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
    lines = ["| run | output tok/s | vs transformers generate | vs generate_batch | tokens | seconds | requests | note |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        def ratio(name: str) -> str:
            return f"{r.tok_s / ref[name]:.2f}x" if ref.get(name) else "-"
        note = r.error or r.note
        lines.append(f"| {r.name} | {r.tok_s:,.0f} | {ratio(base)} | {ratio('transformers generate_batch')} | "
                     f"{r.output_tokens:,} | {r.seconds:.1f} | {r.requests_done} | {note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny models and workload on CPU (float32)")
    ap.add_argument("--json", default="gpu_check.json", help="where to write the report")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--hf-max-time", type=float, default=90.0, help="cap on each transformers run, seconds")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--fa2", action="store_true",
                    help="FlashInfer: FA2 prefill and tensor-core decode (fewer kernels to JIT-compile)")
    ap.add_argument("--skip", default="", help="comma-separated: agreement,hf_generate,hf_batch,eager,graphs,decode")
    args = ap.parse_args(argv)

    if args.dry_run:
        setup = Setup(device="cpu", dtype=torch.float32, dry_run=True, num_requests=6, min_len=4, max_len=16,
                      token_range=500, temperature=0.6, max_num_seqs=8, max_num_batched_tokens=64,
                      hf_max_time=60.0, decode_batch=4, decode_steps=3, agree_prompts=2, agree_new_tokens=4)
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; use --dry-run on CPU", file=sys.stderr)
            return 2
        setup = Setup(device="cuda", dtype=torch.bfloat16, dry_run=False, num_requests=args.requests, min_len=100,
                      max_len=1024, token_range=10000, temperature=0.6, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, hf_max_time=args.hf_max_time,
                      decode_batch=64, decode_steps=50, agree_prompts=8, agree_new_tokens=48)
    skip = set(filter(None, args.skip.split(",")))
    if args.fa2 and not setup.dry_run:
        from paged_hf.execution.backends import flashinfer_backend
        flashinfer_backend.PREFILL_BACKEND, flashinfer_backend.DECODE_TENSOR_CORES = "fa2", True
    started = time.perf_counter()
    report: dict[str, Any] = {"dry_run": setup.dry_run, "environment": environment(setup),
                              "setup": {k: str(v) for k, v in asdict(setup).items()}}
    log(f"environment {report['environment']}")

    report["agreement"] = [] if "agreement" in skip else check_agreement(setup)
    prompts, out_lens = workload(setup)
    report["workload"] = {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                          "output_tokens": sum(out_lens)}
    rows = []
    for key, name, fn, extra in (("hf_generate", "transformers generate", run_hf_generate, ()),
                                 ("hf_batch", "transformers generate_batch", run_hf_continuous, ()),
                                 ("eager", "paged_hf eager", run_paged, (False,)),
                                 ("graphs", "paged_hf cuda graphs", run_paged, (True,))):
        if key not in skip:
            rows.append(guarded(name, fn, setup, prompts, out_lens, *extra))
    report["throughput"] = [dict(asdict(r), tok_s=round(r.tok_s, 1)) for r in rows]
    if "decode" not in skip:
        decode = {}
        for graphs in (False, True):
            try:
                decode["graphs" if graphs else "eager"] = decode_step_time(setup, graphs)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                decode[("graphs" if graphs else "eager") + "_error"] = f"{type(e).__name__}: {e}"[:500]
        if decode.get("eager") and decode.get("graphs"):
            decode["speedup"] = decode["eager"] / decode["graphs"]
        report["decode_step"] = {"batch": setup.decode_batch, **decode}
        log(f"decode step at batch {setup.decode_batch}: {decode}")
    report["total_seconds"] = round(time.perf_counter() - started, 1)

    print()
    print(f"## gpu_check {report['environment'].get('date')} on {report['environment'].get('gpu', 'CPU (dry run)')}")
    print()
    print(table(rows))
    print()
    for r in report["agreement"]:
        print(f"agreement {r}")
    if "decode_step" in report:
        print(f"decode step at batch {setup.decode_batch}: {report['decode_step']}")
    print(f"total {report['total_seconds']} s")
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
