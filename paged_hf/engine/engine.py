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

from .binding import check_still_patched, patch_state
from ..cache.block_manager import BlockManager
from ..cache.coherence import WeightsWatch
from ..config import DEFAULT_CPU_KV_BYTES, EngineConfig
from ..requests.detokenizer import StopStrings
from .outputs import Completion, RequestOutput
from ..requests.request import FinishReason, Request
from ..execution.runner import ModelRunner, max_positions
from ..execution.sampler import sample
from ..requests.sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .scoring import ScoreOutput, prompt_logprobs_output, score_output, score_step_rows

logger = logging.getLogger("paged_hf")

# Ids the engine makes start with this; a caller's id may not, so the two never collide.
AUTO_ID_PREFIX = "paged_hf:"


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
    """The engine over a model whose attention is paged. ``paged_hf.Engine`` (paged_hf/model/patching.py)
    checks and patches the model first when needed; this class reads what patching left on the
    model (paged_hf/engine/binding.py) and never imports the model side."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, **config: Any) -> None:
        self.config = EngineConfig.from_kwargs(**config)
        state = patch_state(model)
        if state is None:
            raise ValueError("this model's attention is not paged: build the engine with paged_hf.Engine(model), "
                             "or call paged_hf.patch(model) first")
        self.layout = state.layout
        self.model = model
        self.config.resolve_for(next(model.parameters()).device)
        self.tokenizer = tokenizer
        self.max_model_len = _within_limits(self.config, _max_model_len(model, self.config.max_model_len), state.limits)
        self.vocab_size = model.config.get_text_config().vocab_size
        self.eos_token_ids = _eos_ids(model, tokenizer)
        num_blocks = self._num_kv_blocks()
        # the prefix cache's namespace carries a generation, bumped whenever the weights change
        self._namespace = self.config.namespace or "default"
        self._cache_generation = 0
        self.kv = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching,
                               (self._namespace, 0))
        self.scheduler = Scheduler(self.kv, self.config.max_num_batched_tokens, self.config.max_num_seqs,
                                   self.config.preemption_mode, self.config.max_prefill_tokens_while_decoding)
        self.runner = ModelRunner(model, self.config, num_blocks, self.layout)
        # requests by id until collected or aborted; samples 1..n-1 of n > 1 live on their root
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._stats = EngineStats()
        self._aborts = 0  # counts aborts, so run_until_done notices ones made from its callbacks
        self.serving = False  # a BackgroundEngine steps this engine
        self._patch_state = state
        state.engines.add(self)
        self._weights = WeightsWatch(model)

    # ---- sizing ------------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        dtype = next(self.model.parameters()).dtype
        device = next(self.model.parameters()).device
        per_block = self.layout.bytes_per_block(cfg.block_size, torch.empty((), dtype=dtype).element_size())
        if device.type == "cuda":
            if cfg.kv_cache_memory is not None:  # an explicit fraction of the free memory
                budget = int(torch.cuda.mem_get_info(device)[0] * cfg.kv_cache_memory)
            else:  # gpu_memory_utilization of the total, less what the largest step needs
                from ..execution.cuda_memory import profile_kv_budget
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
        model's EOS ids for this request (transformers' generate takes them from its config).
        ``request_id``: a str of the caller's choosing, or None for one the engine makes
        (``"paged_hf:<n>"``); returns the id."""
        return self._add(self._new_id(request_id), prompt, params, eos_token_ids)

    def _add(self, rid: str, prompt: Any, params: SamplingParams | None,
             eos_token_ids: frozenset[int] | None = None, stop_strings: StopStrings | None = None) -> str:
        """``stop_strings``: a matcher of the caller's making (``model.generate``'s, with
        transformers' semantics) instead of one for ``params.stop``."""
        check_still_patched(self.model, self._patch_state)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {rid}: params must be SamplingParams, got {type(params).__name__}")
        params.validate(f"request {rid}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:
                raise ValueError(f"request {rid}: {name}={k} exceeds the vocabulary ({self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {rid}: stop={list(params.stop)!r} needs a tokenizer to read the text "
                             "(Engine(model, tokenizer)); stop_token_ids need none")
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"request {rid}: stop token id {bad_stop[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        ids = self._prompt_ids(rid, prompt)
        eos = self.eos_token_ids if eos_token_ids is None else frozenset(eos_token_ids)
        req = Request(rid, ids, params, eos, self.max_model_len)
        req.generator = self._generator(params, 0)
        req.stop_strings = stop_strings if stop_strings is not None else self._stop_strings(params)
        if params.prompt_logprobs is not None:
            req.score_targets, req.score_start = ids[1:], 0
        return self._queue(req)

    def _queue(self, req: Request) -> str:
        """Hand a built request to the scheduler (which refuses what could never fit the pool)."""
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        self._stats.prompt_tokens += req.num_prompt_tokens
        return req.request_id

    def _check_token_ids(self, rid: str, ids: list, what: str) -> None:
        """Token ids a request carries (its prompt; a scoring pair's context or continuation):
        ints, inside the vocabulary, none of them a media placeholder."""
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"request {rid}: {what} must be token ids (int)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {rid}: {what} token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        media = [t for t in ids if t in self._patch_state.media_token_ids]
        if media:
            raise ValueError(f"request {rid}: {what} token id {media[0]} is this model's image/video/audio "
                             "placeholder; media inputs are not supported yet (paged_hf runs the text path of "
                             "multimodal models)")

    def _stop_strings(self, params: SamplingParams) -> StopStrings | None:
        if not params.stop:
            return None
        return StopStrings(self.tokenizer, params.stop, params.include_stop_str_in_output)

    def add_score_request(self, context: Any, continuation: Any, request_id: str | None = None, *,
                          top_logprobs: int | None = None, cache_salt: str | None = None) -> str:
        """Queue one scoring request (see ``score``); returns its id. ``run_until_done`` gives
        its ``ScoreOutput``."""
        from .scoring import add_score_request

        return add_score_request(self, self._new_id(request_id), context, continuation, top_logprobs, cache_salt)

    def _new_id(self, request_id: Any) -> str:
        if request_id is None:
            return f"{AUTO_ID_PREFIX}{next(self._ids)}"
        if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
            raise TypeError(f"request_id={request_id!r}: must be a str (or None for an id the engine makes)")
        rid = str(request_id)
        if rid.startswith(AUTO_ID_PREFIX):
            raise ValueError(f"request {rid}: ids starting with {AUTO_ID_PREFIX!r} are the ones the engine makes; "
                             "choose another, or pass none")
        if rid in self.requests:
            raise ValueError(f"request {rid}: id already in use")
        return rid

    def _prompt_ids(self, rid: str, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {rid}: a text prompt needs a tokenizer (Engine(model, tokenizer))")
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.flatten().tolist()
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise ValueError(f"request {rid}: a prompt is text or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"request {rid}: empty prompt")
        self._check_token_ids(rid, ids, "prompt")
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
        rids = [self.add_request(p, params) for p in prompts]
        self.run_until_done(rids)
        self.kv.pool.drop_cached()
        self._stats = EngineStats()
        self.scheduler.num_preemptions = self.scheduler.prefix_hit_tokens = 0
        seconds = time.perf_counter() - start
        logger.info("paged_hf: warm-up took %.1f s", seconds)
        return seconds

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request (all its samples) now and free its blocks; returns its output so far
        (``finish_reason`` "abort"). Safe to call from an ``on_token`` callback."""
        root = self.requests.pop(str(request_id), None)
        if root is None:
            raise ValueError(f"request {request_id}: unknown or already finished")
        now = time.perf_counter()
        for r in root.samples:
            if not r.is_finished:
                self.scheduler.finish(r, FinishReason.ABORT, now)
        self._aborts += 1
        return self.make_output(root)

    def fail(self, req: Request, message: str) -> None:
        """End one request (one sample) with ``finish_reason`` "error" and ``message``; the
        others are not touched. A request already aborted stays aborted."""
        if req.finish_reason is FinishReason.ABORT:
            return
        req.error = message
        if req.is_finished:  # e.g. its last token's callback failed: the output says so
            req.finish_reason = FinishReason.ERROR
        else:
            self.scheduler.finish(req, FinishReason.ERROR, time.perf_counter())

    def reset_prefix_cache(self) -> None:
        """Never serve a block cached so far: requests admitted from now on compute their KV
        anew. Runs by itself when the weights change (checked before every step); call it for
        changes no version counter records: writes through ``param.data`` (``p.data.copy_(w)``
        bypasses autograd's counter, unlike ``p.copy_(w)`` under ``torch.no_grad()``)."""
        self._cache_generation += 1
        self.kv.reset_prefix_cache((self._namespace, self._cache_generation))
        self.runner.weights_changed()

    def check_weights(self, rescan: bool = False) -> bool:
        """Reset the prefix cache if the model's weights changed since the last check; True if
        they did. Every step checks (``rescan`` also looks for replaced tensors, which steps do
        about once a second; every generate call does it at its start)."""
        if not self._weights.changed(rescan):
            return False
        self.reset_prefix_cache()
        logger.info("paged_hf: the model's weights changed; the prefix cache was reset")
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def is_busy(self) -> bool:
        """Requests are live, or a background engine is stepping this one."""
        return self.serving or bool(self.requests) or self.scheduler.has_unfinished

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> tuple[dict[Request, int], list[Request]]:
        """One engine step; returns ({request: new token}, finished requests).

        A request that fails on its own (its sampling, its logits) ends with ``finish_reason``
        "error"; if the step fails as a whole (the forward raised), every request in it ends so,
        and the engine goes on serving. Interrupted (KeyboardInterrupt), the step is undone: its
        requests keep their tokens and recompute their KV when next scheduled.
        """
        check_still_patched(self.model, self._patch_state)
        self.check_weights()
        sched = self.scheduler
        out = sched.schedule()
        if out.is_empty:
            if sched.has_unfinished:
                raise RuntimeError("scheduler made no progress with requests pending (this is a bug)")
            return {}, []
        decode_tokens = sum(1 for req, n in out.scheduled
                            if n == 1 and req.num_output_tokens > 0 and req.num_pending_tokens == 1)
        forked: list[Request] = []
        try:
            self._swap_out(out)
            for req, blocks in out.swap_in:
                self.runner.backend.swap_in(req.swap_handle, blocks)
                req.swap_handle = None
            logits, meta = self.runner.execute(out.scheduled, out.block_copies)
            sched.mark_computed(out)
            # logits: the sampled rows, then the scored ones (prompt logprobs, scoring requests)
            scores, score_errors = score_step_rows(logits[len(meta.sampled_requests):], meta.score_rows) \
                if meta.score_rows else ({}, {})
            logits = logits[:len(meta.sampled_requests)]
            rows = list(meta.sampled_requests)
            row_of = list(range(len(rows)))
            for i, req in enumerate(meta.sampled_requests):
                if req.params.n > 1 and not req.forked and req.parent is None:
                    children = [self._fork_child(req, k) for k in range(1, req.params.n)]
                    sched.fork(req, children)
                    forked.append(req)
                    rows += children
                    row_of += [i] * len(children)
            if len(rows) != len(meta.sampled_requests):
                logits = logits[torch.tensor(row_of, device=logits.device)]
            result = sample(logits, rows)
        except Exception as e:  # noqa: BLE001 - ends the step's requests, not the engine
            return {}, self._fail_step(out, forked, e)
        except BaseException:
            for victim, _ in out.swap_out:  # preempted, KV not (all) saved: recompute it
                if victim.swap_handle is None:
                    victim.swapped_tokens = 0
            for parent in forked:
                sched.unfork(parent)
            sched.requeue([req for req, _ in out.scheduled])
            raise

        sampled: dict[Request, int] = {}
        failed: list[Request] = []
        for req, entries in scores.items():
            req.scored.extend(entries)
        for req, why in score_errors.items():
            req.error = f"request {req.request_id}: {why}"
            failed.append(req)
        for i, (req, tok, lp) in enumerate(zip(rows, result.tokens, result.logprobs)):
            if tok is None:
                req.error = f"request {req.request_id}: {result.errors[i]}"
                failed.append(req)
                continue
            sampled[req] = tok
            if lp is not None:
                req.logprobs.append(lp)
        now = time.perf_counter()
        finished = sched.update(out, sampled, now)
        finished += self._finish_prefill_only(out, failed, now)
        failed += self._check_stop_strings(sampled, finished, now)
        for req in failed:
            if not req.is_finished:
                sched.finish(req, FinishReason.ERROR, now)
            else:  # its last token's stop-string check failed: the output says so
                req.finish_reason = FinishReason.ERROR
            logger.warning("paged_hf: %s", req.error)
        self._record_step(out, sampled, decode_tokens)
        return sampled, finished + [req for req in failed if req not in finished]

    def _finish_prefill_only(self, out: SchedulerOutput, failed: list[Request], now: float) -> list[Request]:
        """Scoring requests whose last position was computed this step are done."""
        done = [req for req, _ in out.scheduled
                if req.prefill_only and req.num_computed_tokens == req.num_tokens and req not in failed]
        for req in done:
            self.scheduler.finish(req, FinishReason.STOP, now)
        return done

    def _check_stop_strings(self, sampled: dict[Request, int], finished: list[Request], now: float) -> list[Request]:
        """Feed each sampled token to its request's stop strings; a request whose token completed
        one stops there (even if the same token also ended it by length). Returns the requests
        whose check raised (a tokenizer failing on their ids): they fail alone."""
        failed = []
        for req, tok in sampled.items():
            stops = req.stop_strings
            if stops is None:
                continue
            try:
                hit = stops.push(tok)
            except Exception as e:  # noqa: BLE001 - this request's detokenization, no one else's
                req.error = f"request {req.request_id}: detokenizing its output for stop strings failed: " \
                            f"{type(e).__name__}: {e}"
                failed.append(req)
                continue
            if hit is None:
                continue
            req.stop_reason = hit
            if req.is_finished:
                req.finish_reason = FinishReason.STOP
            else:
                self.scheduler.finish(req, FinishReason.STOP, now)
                finished.append(req)
        return failed

    def _swap_out(self, out: SchedulerOutput) -> None:
        """Copy preempted requests' KV to host memory before anything reuses their blocks. A copy
        that fails turns that request's preemption into a recompute one: same tokens, more work."""
        for req, blocks in out.swap_out:
            try:
                req.swap_handle = self.runner.backend.swap_out(blocks)
            except Exception as e:  # noqa: BLE001
                req.swapped_tokens, req.swap_handle = 0, None
                logger.warning("paged_hf: request %s: swapping its KV out failed (%s: %s); it will recompute it",
                               req.request_id, type(e).__name__, e)

    def _fail_step(self, out: SchedulerOutput, forked: list[Request], error: Exception) -> list[Request]:
        """End every request the failed step touched with the error; free their blocks."""
        logger.error("paged_hf: a step of %d request(s) failed; they end with finish_reason 'error'",
                     len(out.scheduled), exc_info=error)
        touched = [req for req, _ in out.scheduled] + [c for p in forked for c in p.children]
        now = time.perf_counter()
        for req in touched:
            req.error = f"request {req.request_id}: the step it ran in failed: {type(error).__name__}: {error}"
            self.scheduler.finish(req, FinishReason.ERROR, now)
        return touched

    def _fork_child(self, parent: Request, k: int) -> Request:
        child = Request(f"{parent.request_id}#{k}", parent.prompt_ids, parent.params, parent.eos_token_ids,
                        parent.max_model_len, arrival_time=parent.arrival_time, sample_index=k, parent=parent)
        child.num_cached_tokens = parent.num_cached_tokens
        child.generator = self._generator(parent.params, k)
        child.stop_strings = parent.stop_strings.fresh() if parent.stop_strings is not None else None
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

        A prompt that is refused (empty, too long, bad ids, bad params, cannot fit the pool) or
        fails while it runs gets an output with ``error`` set (``finish_reason`` "error"); every
        other prompt still runs. Interrupted (KeyboardInterrupt, or any exception), it aborts
        every prompt it submitted before raising.
        """
        if isinstance(prompts, (str, torch.Tensor)) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("generate takes a list of prompts; wrap a single prompt in a list")
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        ids: list[str | None] = []
        errors: dict[int, RequestOutput] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = self._new_id(None)
                try:
                    ids.append(self._add(rid, prompt, p))
                except Exception as e:  # noqa: BLE001 - this prompt's problem alone (a tokenizer may raise anything)
                    message = str(e) if isinstance(e, (ValueError, TypeError)) else \
                        f"request {rid}: {type(e).__name__}: {e}"
                    logger.warning("paged_hf: %s", message)
                    ids.append(None)
                    errors[i] = RequestOutput(rid, [], error=message)
        except BaseException:
            self.abort_all(rid for rid in ids if rid is not None)
            raise
        outputs = self.run_until_done([rid for rid in ids if rid is not None], on_token=on_token,
                                      progress=progress)
        it = iter(outputs)
        return [errors[i] if rid is None else next(it) for i, rid in enumerate(ids)]

    def score(self, pairs: Sequence[tuple[Any, Any]], *, top_logprobs: int | None = None,
              cache_salt: str | None = None, progress: bool = False) -> list[ScoreOutput]:
        """The loglikelihood of each continuation given its context, in input order.

        ``pairs``: ``(context, continuation)`` as text (tokenized as lm-evaluation-harness does:
        ``scoring.encode_pair``) or as token ids. Each pair is a prefill-only request through the
        scheduler, batched with anything else running; pairs with the same context share its KV
        (prefix cache), and each continuation token still gets its logprob. A refused or failed
        pair gets a ``ScoreOutput`` with ``error`` set; the others run. ``top_logprobs=k`` adds the k
        most likely tokens of every scored position.

        >>> outs = engine.score([("Q: 2 + 2 =", " 4"), ("Q: 2 + 2 =", " 5")])
        >>> [round(o.logprob, 2) for o in outs], outs[0].is_greedy
        """
        from .scoring import score

        return score(self, pairs, top_logprobs, cache_salt, progress)

    def score_rolling(self, texts: Sequence[Any], *, window: int | None = None, prefix_token: int | None = None,
                      cache_salt: str | None = None, progress: bool = False) -> list[ScoreOutput]:
        """The loglikelihood of each whole text (perplexity tasks): every token scored once, in
        windows of at most ``window`` tokens (default ``max_model_len``), the first conditioned on
        ``prefix_token`` (default the tokenizer's BOS, else EOS), each later one on as much of the
        preceding text as fits (``scoring.rolling_windows``, lm-evaluation-harness's windows).
        Texts are tokenized without special tokens; token ids are taken as they are.

        >>> out = engine.score_rolling(["It was the best of times, it was the worst of times."], window=8)[0]
        >>> math.exp(-out.logprob / len(out.token_ids))   # perplexity
        """
        from .scoring import score_rolling

        return score_rolling(self, texts, window, prefix_token, cache_salt, progress)

    def run_until_done(self, request_ids: Sequence[str], *, on_token: Callable[[str, int], None] | None = None,
                       progress: bool = False) -> list[RequestOutput]:
        """Step until the given (already added) requests finish; their outputs in the given order.

        ``on_token(request_id, token)`` runs after each step for every token sampled; if it raises,
        that request ends with ``finish_reason`` "error" and the others go on. It may abort
        requests. On any exception from here (KeyboardInterrupt included) the given requests are
        aborted, their blocks freed, and the exception raised.
        """
        roots = [self._root(rid) for rid in request_ids]
        self.check_weights(rescan=True)
        open_roots = {root for root in roots if not root.group_finished}
        bar = _progress(len(roots)) if progress else None
        if bar is not None:
            bar.update(len(roots) - len(open_roots))
        try:
            while open_roots:
                if not self.scheduler.has_unfinished:
                    raise RuntimeError("engine went idle with requests unfinished (this is a bug)")
                aborts = self._aborts
                sampled, finished = self.step()
                failed = self._run_callbacks(on_token, sampled)
                # an abort from a callback can end any request: then look at all of them
                touched = open_roots if self._aborts != aborts else \
                    {(r.parent or r) for r in finished + failed} & open_roots
                done = [root for root in touched if root.group_finished]
                open_roots.difference_update(done)
                if bar is not None and done:
                    bar.update(len(done))
        except BaseException:
            self.abort_all(root.request_id for root in roots if self.requests.get(root.request_id) is root)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self._collect_root(root) for root in roots]

    def _run_callbacks(self, on_token: Callable[[str, int], None] | None, sampled: dict[Request, int]) -> list[Request]:
        """Call ``on_token`` for each sampled token; a request whose callback raises ends with an error."""
        failed: list[Request] = []
        if on_token is None:
            return failed
        for req, tok in sampled.items():
            try:
                on_token(req.request_id, tok)
            except Exception as e:  # noqa: BLE001 - the callback's failure is its request's alone
                self.fail(req, f"request {req.request_id}: on_token callback raised {type(e).__name__}: {e}")
                failed.append(req)
        return failed

    def _root(self, request_id: str) -> Request:
        root = self.requests.get(request_id)
        if root is None:
            raise ValueError(f"request {request_id}: unknown or already collected")
        return root

    def abort_all(self, request_ids: Any) -> None:
        """Abort those of ``request_ids`` still live (unknown or finished ones are skipped)."""
        for rid in list(request_ids):
            if rid in self.requests:
                self.abort(rid)

    def _collect_root(self, root: Request) -> RequestOutput:
        if self.requests.get(root.request_id) is root:
            del self.requests[root.request_id]
        return self.make_output(root)

    def collect(self, group: list[Request]) -> RequestOutput:
        """The output of a finished request (given as any of its samples), releasing it from
        ``requests``."""
        root = group[0].parent or group[0]
        return self._collect_root(root)

    def make_output(self, root: Request, samples: list[Request] | None = None) -> RequestOutput | ScoreOutput:
        if root.prefill_only:
            return score_output(root)
        samples = root.samples if samples is None else sorted(samples, key=lambda r: r.sample_index)
        completions = [self._completion(r) for r in samples]
        last = max((r.finish_time or 0.0) for r in samples)
        first = min((r.first_token_time for r in samples if r.first_token_time is not None), default=None)
        error = next((c.error for c in completions if c.error is not None), None)
        return RequestOutput(root.request_id, list(root.prompt_ids), completions,
                             ttft=None if first is None else first - root.arrival_time,
                             latency=last - root.arrival_time if last else None,
                             num_cached_tokens=root.num_cached_tokens, error=error,
                             prompt_logprobs=prompt_logprobs_output(root))

    def _completion(self, r: Request) -> Completion:
        reason, error, text = r.finish_reason, r.error, None
        try:
            # cut at the stop string, or the whole output decoded at once
            text = r.stop_strings.text if r.stop_strings is not None and r.stop_strings.hit is not None \
                else self.decode(r.output_ids)
        except Exception as e:  # noqa: BLE001 - a tokenizer failing on these ids fails this request alone
            reason = FinishReason.ERROR
            error = error or f"request {r.request_id}: detokenizing its output failed: {type(e).__name__}: {e}"
        return Completion(list(r.output_ids), reason.value if reason else None, text,
                          list(r.logprobs) if r.params.logprobs is not None else None, error, r.stop_reason)

    def decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _max_model_len(model: torch.nn.Module, asked: int | None) -> int:
    """``asked``, if the model can position that many tokens; by default what it was trained for."""
    default, most = max_positions(model)
    if asked is None:
        return default or (1 << 31)
    if most is not None and asked > most:
        raise ValueError(f"max_model_len={asked} exceeds the {most} positions this {model.config.model_type} model "
                         f"can encode (max_position_embeddings / n_positions{', with its RoPE scaling' if most != default else ''})")
    return asked


def _within_limits(config: EngineConfig, max_model_len: int, limits: dict) -> int:
    """``max_model_len``, lowered to what the model is exact up to (patch found the limits); an
    option set above a limit is refused naming why."""
    for option, (limit, why) in limits.items():
        value = max_model_len if option == "max_model_len" else getattr(config, option)
        if value <= limit:
            continue
        if option == "max_model_len" and config.max_model_len is None:  # the default: lower it, say so once
            logger.info("paged_hf: max_model_len lowered to %d: %s", limit, why)
            max_model_len = limit
        else:
            raise ValueError(f"{option}={value} exceeds {limit}, the most this model runs exactly with: {why}")
    return max_model_len


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
