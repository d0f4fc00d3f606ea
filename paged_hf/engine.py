"""The engine loop: submit requests, step (schedule -> forward -> sample -> update), collect.

    >>> engine = paged_hf.Engine(model, tokenizer)
    >>> out = engine.generate(["Hello"], paged_hf.SamplingParams(max_new_tokens=8))
    >>> out[0].text
"""
from __future__ import annotations

import itertools
from collections import deque
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .block_manager import BlockManager
from .config import DEFAULT_CPU_KV_BYTES, EngineConfig
from .outputs import Completion, RequestOutput
from .request import FinishReason, Request
from .runner import ModelRunner, kv_geometry
from .sampler import sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler

logger = logging.getLogger("paged_hf")



@dataclass
class EngineStats:
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    generated_tokens: int = 0
    steps: int = 0
    peak_blocks_used: int = 0
    kv_waste_sum: float = 0.0
    # one row per step, for plots and tables; bounded so a long-lived server does not grow without end
    step_log: deque = field(default_factory=lambda: deque(maxlen=100_000))


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, **config: Any) -> None:
        from .patching import ensure_attention_patched

        self.config = EngineConfig.from_kwargs(**config)
        ensure_attention_patched(model)
        self.model = model
        self.tokenizer = tokenizer
        text_cfg = model.config.get_text_config()
        model_max = getattr(text_cfg, "max_position_embeddings", None) or getattr(text_cfg, "n_positions", None)
        self.max_model_len = self.config.max_model_len or model_max or (1 << 31)
        self.vocab_size = text_cfg.vocab_size
        self.eos_token_ids = _eos_ids(model, tokenizer)
        num_blocks = self._num_kv_blocks()
        self.kv = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching,
                               self.config.namespace or "default")
        self.scheduler = Scheduler(self.kv, self.config.max_num_batched_tokens, self.config.max_num_seqs,
                                   self.config.preemption_mode, self.config.max_prefill_tokens_while_decoding)
        self.runner = ModelRunner(model, self.config, num_blocks)
        self.requests: dict[str, Request] = {}  # live requests by id (samples of n > 1 included)
        self._ids = itertools.count()
        self._stats = EngineStats()

    # ---- sizing ------------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        layers, kv_heads, head_dim = kv_geometry(self.model)
        dtype = next(self.model.parameters()).dtype
        device = next(self.model.parameters()).device
        per_block = layers * 2 * cfg.block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        if device.type == "cuda":
            if cfg.kv_cache_memory is not None:  # an explicit fraction of the free memory
                budget = int(torch.cuda.mem_get_info(device)[0] * cfg.kv_cache_memory)
            else:  # gpu_memory_utilization of the total, less what the largest step needs
                from .cuda_memory import profile_kv_budget
                budget = profile_kv_budget(self.model, cfg)
        else:
            budget = int(cfg.kv_cache_memory or DEFAULT_CPU_KV_BYTES)
        # never more than every running sequence at full length could use
        useful = cfg.max_num_seqs * -(-min(self.max_model_len, 1 << 20) // cfg.block_size)
        num_blocks = min(budget // per_block, useful)
        if num_blocks < 1:
            raise ValueError(f"KV budget of {budget} bytes holds no block of {per_block} bytes")
        return num_blocks

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: Any, params: SamplingParams | None = None,
                    request_id: str | None = None, eos_token_ids: frozenset[int] | None = None) -> str:
        """Queue one prompt (token ids, or a string with a tokenizer). Bad input raises
        ValueError naming the request; nothing else is disturbed. ``eos_token_ids`` replaces the
        model's EOS ids for this request (transformers' generate takes them from its config)."""
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self.requests:
            raise ValueError(f"request {rid}: id already in use")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {rid}: params must be SamplingParams, got {type(params).__name__}")
        params.validate(f"request {rid}")
        ids = self._prompt_ids(rid, prompt)
        eos = self.eos_token_ids if eos_token_ids is None else frozenset(eos_token_ids)
        req = Request(rid, ids, params, eos, self.max_model_len)
        req.generator = self._generator(params, 0)
        self.scheduler.add(req)  # refuses what could never fit the pool
        self.requests[rid] = req
        self._stats.prompt_tokens += len(ids)
        return rid

    def _prompt_ids(self, rid: str, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {rid}: a text prompt needs a tokenizer (Engine(model, tokenizer))")
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.flatten().tolist()
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError(f"request {rid}: empty prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"request {rid}: prompt must be token ids (int)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {rid}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {rid}: prompt has {len(ids)} tokens, max_model_len is {self.max_model_len} "
                             "(room for at least one new token is needed)")
        return ids

    def _generator(self, params: SamplingParams, sample_index: int) -> torch.Generator | None:
        """A seeded request's own generator, on the logits' device (a CPU generator cannot draw
        CUDA noise). Unseeded requests have none: they share torch's default generator, one draw
        for the whole batch, so torch.manual_seed reproduces a run."""
        if params.is_greedy or params.seed is None:
            return None
        return torch.Generator(device=self.runner.device).manual_seed(params.seed + sample_index)

    def warmup(self) -> float:
        """Do now what the first steps would otherwise do on the first real requests: FlashInfer
        JIT-compiles its kernels on a machine's first use, CUDA graphs are captured, a compiled
        decode step is traced. Two throwaway requests run a prefill step and decode steps, then
        the engine is left as it was: no requests, no cached blocks, stats at zero.

        Returns the seconds it took; an engine that has already stepped is warm, and returns 0.
        """
        if self.requests:
            raise RuntimeError("Engine.warmup() runs before requests are added, not while they run")
        if self._stats.steps:
            return 0.0
        start = time.perf_counter()
        vocab, bs = self.vocab_size, self.config.block_size
        room = max(1, self.max_model_len - 4)
        prompts = ([(7 * i + 3) % vocab for i in range(min(2 * bs + 1, room))], [3 % vocab, 5 % vocab][:room])
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        rids = [self.add_request(p, params, request_id=f"paged_hf-warmup-{i}") for i, p in enumerate(prompts)]
        self.run_until_done(rids)
        self.kv.pool.drop_cached()
        self._stats = EngineStats()
        self.scheduler.num_preemptions = self.scheduler.prefix_hit_tokens = 0
        seconds = time.perf_counter() - start
        logger.info("paged_hf: warm-up took %.1f s", seconds)
        return seconds

    def abort(self, request_id: str) -> None:
        req = self.requests.get(str(request_id))
        if req is None:
            raise ValueError(f"request {request_id}: unknown or already finished")
        now = time.perf_counter()
        for r in [req] + [c for c in self.requests.values() if c.parent is req]:
            self.scheduler.finish(r, FinishReason.ABORT, now)
            self.requests.pop(r.request_id, None)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> tuple[dict[Request, int], list[Request]]:
        """One engine step; returns ({request: new token}, finished requests)."""
        sched = self.scheduler
        out = sched.schedule()
        if out.is_empty:
            if sched.has_unfinished:
                raise RuntimeError("scheduler made no progress with requests pending (this is a bug)")
            return {}, []
        decode_tokens = sum(1 for req, n in out.scheduled
                            if n == 1 and req.num_output_tokens > 0 and req.num_pending_tokens == 1)
        for req, blocks in out.swap_out:  # before anything writes the blocks they just gave up
            req.swap_handle = self.runner.backend.swap_out(blocks)
        for req, blocks in out.swap_in:
            self.runner.backend.swap_in(req.swap_handle, blocks)
            req.swap_handle = None
        logits, meta = self.runner.execute(out.scheduled, out.block_copies)
        sched.mark_computed(out)

        rows = list(meta.sampled_requests)
        row_of = list(range(len(rows)))
        for i, req in enumerate(meta.sampled_requests):
            if req.params.n > 1 and not req.forked and req.parent is None:
                children = [self._fork_child(req, k) for k in range(1, req.params.n)]
                sched.fork(req, children)
                rows += children
                row_of += [i] * len(children)
        if len(rows) != len(meta.sampled_requests):
            logits = logits[torch.tensor(row_of, device=logits.device)]
        result = sample(logits, rows)
        for req, lp in zip(rows, result.logprobs):
            if lp is not None:
                req.logprobs.append(lp)
        sampled = dict(zip(rows, result.tokens))
        now = time.perf_counter()
        finished = sched.update(out, sampled, now)
        self._record_step(out, sampled, decode_tokens)
        return sampled, finished

    def _fork_child(self, parent: Request, k: int) -> Request:
        child = Request(f"{parent.request_id}#{k}", parent.prompt_ids, parent.params, parent.eos_token_ids,
                        parent.max_model_len, arrival_time=parent.arrival_time, sample_index=k, parent=parent)
        child.num_cached_tokens = parent.num_cached_tokens
        child.generator = self._generator(parent.params, k)
        self.requests[child.request_id] = child
        return child

    def _record_step(self, out: Any, sampled: dict[Request, int], decode_tokens: int) -> None:
        s, pool = self._stats, self.kv.pool
        s.prefill_tokens_computed += out.num_tokens - decode_tokens
        s.generated_tokens += len(sampled)
        s.steps += 1
        used = pool.num_used
        s.peak_blocks_used = max(s.peak_blocks_used, used)
        unfilled = sum(len(r.block_table) * self.kv.block_size - r.num_computed_tokens
                       for r in self.scheduler.running)
        waste = unfilled / (used * self.kv.block_size) if used else 0.0
        s.kv_waste_sum += waste
        s.step_log.append({"step": s.steps, "time": time.perf_counter(), "running": len(self.scheduler.running),
                           "waiting": len(self.scheduler.waiting), "tokens": out.num_tokens,
                           "blocks_used": used, "kv_waste": waste, "preempted": len(out.preempted)})

    def stats(self) -> dict[str, Any]:
        s, pool = self._stats, self.kv.pool
        return {
            "prompt_tokens": s.prompt_tokens,
            "prefill_tokens_computed": s.prefill_tokens_computed,
            "prefix_hit_tokens": self.scheduler.prefix_hit_tokens,
            "generated_tokens": s.generated_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "steps": s.steps,
            "num_blocks": pool.num_blocks,
            "blocks_used": pool.num_used,
            "blocks_cached": pool.num_cached,
            "blocks_free": pool.num_free,
            "peak_blocks_used": s.peak_blocks_used,
            "kv_waste": s.kv_waste_sum / s.steps if s.steps else 0.0,
            "block_size": self.kv.block_size,
            "backend": self.runner.backend.name,
        }

    # ---- batch front end ---------------------------------------------------------------------
    def generate(self, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, on_token: Callable[[str, int], None] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; outputs come back in input order.

        A prompt that is refused (empty, too long, bad ids, bad params, cannot fit the pool)
        gets an output with ``error`` set; every other prompt still runs.
        """
        if isinstance(prompts, (str, torch.Tensor)) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("generate takes a list of prompts; wrap a single prompt in a list")
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        ids: list[str | None] = []
        errors: dict[int, RequestOutput] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = str(next(self._ids))
            try:
                ids.append(self.add_request(prompt, p, request_id=rid))
            except (ValueError, TypeError) as e:
                logger.warning("paged_hf: %s", e)
                ids.append(None)
                errors[i] = RequestOutput(rid, [], error=str(e))
        outputs = self.run_until_done([rid for rid in ids if rid is not None], on_token=on_token,
                                      progress=progress)
        it = iter(outputs)
        return [errors[i] if rid is None else next(it) for i, rid in enumerate(ids)]

    def run_until_done(self, request_ids: Sequence[str], *, on_token: Callable[[str, int], None] | None = None,
                       progress: bool = False) -> list[RequestOutput]:
        """Step until the given (already added) requests finish; their outputs in the given order."""
        want = {rid: self.requests[rid].params.n for rid in request_ids}
        done: dict[str, list[Request]] = {rid: [] for rid in want}
        bar = _progress(len(want)) if progress else None
        while any(len(done[rid]) < n for rid, n in want.items()):
            if not self.scheduler.has_unfinished:
                raise RuntimeError("engine went idle with requests unfinished (this is a bug)")
            sampled, finished = self.step()
            if on_token is not None:
                for req, tok in sampled.items():
                    on_token(req.request_id, tok)
            for req in finished:
                group = done.get((req.parent or req).request_id)
                if group is not None:
                    group.append(req)
                    if bar is not None and len(group) == req.params.n:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [self.collect(done[rid]) for rid in request_ids]

    def collect(self, group: list[Request]) -> RequestOutput:
        """The output of a finished request (all its samples), releasing it from ``requests``."""
        group = sorted(group, key=lambda r: r.sample_index)
        root = group[0] if group[0].parent is None else group[0].parent
        for r in group:
            self.requests.pop(r.request_id, None)
        return self.make_output(root, group)

    def make_output(self, root: Request, samples: list[Request]) -> RequestOutput:
        completions = [Completion(list(r.output_ids), r.finish_reason.value if r.finish_reason else None,
                                  self.decode(r.output_ids), list(r.logprobs) if r.params.logprobs is not None
                                  else None) for r in samples]
        last = max((r.finish_time or 0.0) for r in samples)
        first = min((r.first_token_time for r in samples if r.first_token_time is not None), default=None)
        return RequestOutput(root.request_id, list(root.prompt_ids), completions,
                             ttft=None if first is None else first - root.arrival_time,
                             latency=last - root.arrival_time if last else None,
                             num_cached_tokens=root.num_cached_tokens)

    def decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gc = getattr(model, "generation_config", None)
    for src in (getattr(gc, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        ids.update([src] if isinstance(src, int) else list(src))
    return frozenset(ids)


def _progress(total: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="paged_hf", unit="req")
