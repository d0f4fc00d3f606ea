"""The engine: requests in, tokens out, over a model whose attention is paged.

Design notes: docs/internals.md, paged_hf/engine/core.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from ..cache.block_manager import BlockManager
from ..cache.coherence import WeightsWatch
from ..cache.kv_groups import most_blocks
from ..cache.state_slots import StateSlots
from ..config import DEFAULT_CPU_KV_BYTES, DEFAULT_CPU_THROUGHPUT_CALL_TOKENS, EngineConfig
from ..execution.runner import ModelRunner, cache_groups
from ..requests.request import FinishReason, Request
from ..requests.sampling_params import SamplingParams
from .admission import AdmissionMixin, eos_ids, max_model_len_for, within_limits
from .binding import patch_state
from .blocking_calls import BlockingCallsMixin
from .callers import CallersMixin
from .draft_model import Drafter
from .engine_stats import EngineStats, snapshot
from .kv_tiers import make_kv_tiers
from .outputs import OutputsMixin, RequestOutput
from .ranks import over_ranks, ranks_for
from .scheduler import Scheduler
from .scheduling_policy import make_policy
from .speculation import Verified
from .step import StepMixin
from .step_time import StepTimeModel
from .turns import TurnLock

logger = logging.getLogger("paged_hf")


class EngineCore(AdmissionMixin, StepMixin, OutputsMixin, BlockingCallsMixin, CallersMixin):
    """The engine over a model whose attention is paged. ``paged_hf.Engine`` (paged_hf/model/patching.py)
    checks and patches the model first when needed; this class reads what patching left on the
    model (paged_hf/engine/binding.py) and never imports the model side."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, **config: Any) -> None:
        self.config = EngineConfig.from_kwargs(**config)
        state = patch_state(model)
        if state is None:
            raise ValueError(
                "this model's attention is not paged: build the engine with paged_hf.Engine(model), "
                "or call paged_hf.patch(model) first"
            )
        self.layout = state.layout
        self.model = model
        auto_prefill_cap = self.config.max_prefill_tokens_while_decoding == "auto"
        self.config.resolve_for(next(model.parameters()).device)
        self.tokenizer = tokenizer
        self.max_model_len = within_limits(
            self.config, max_model_len_for(model, self.config.max_model_len), state.limits
        )
        self.vocab_size = model.config.get_text_config().vocab_size
        self.eos_token_ids = eos_ids(model, tokenizer)
        self.state_layout = state.state
        self._num_checkpoints = 0
        self.groups = cache_groups(model, self.config, self.layout, self.state_layout)
        element = torch.empty((), dtype=next(model.parameters()).dtype).element_size()
        self.page_bytes = self.layout.bytes_per_page(self.groups, self.config.block_size, element)
        device = next(model.parameters()).device
        self.ranks = ranks_for(state.tp_group, self.config, state.state is not None, device)
        num_blocks = self._num_kv_blocks(explicit_max_num_seqs="max_num_seqs" in config)
        if self.ranks is not None:  # every rank's pool the same pages
            num_blocks = self.ranks.min(num_blocks)
        # the prefix cache's namespace carries a generation, bumped whenever the weights change
        self._namespace = self.config.namespace or "default"
        self._cache_generation = 0
        self._weights = WeightsWatch(model)
        self._adapters = self._weights.adapter_state()
        self._build_parts(num_blocks, auto_prefill_cap, "max_num_batched_tokens" in config)
        # requests by id until collected or aborted; samples 1..n-1 of n > 1 live on their root
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._stats = EngineStats()
        self._verified = Verified()
        # one thread at a time steps or changes the engine; callers are told by whoever steps
        self.lock = TurnLock()
        self._watches: dict[Request, Any] = {}  # root -> the Watch of the caller waiting on it
        # structured outputs' compiler, made for the first constrained request
        self.structured = None
        self.serving = False  # a BackgroundEngine steps this engine
        self._patch_state = state
        state.engines.add(self)

    def _build_parts(self, num_blocks: int, auto_prefill_cap: bool, budget_set: bool) -> None:
        """The block manager, the scheduler and the runner, over ``num_blocks`` pages."""
        model = self.model
        slots = (
            StateSlots(self.config.max_num_seqs, self._num_checkpoints)
            if self.state_layout is not None
            else None
        )
        # a throughput call (nobody watches its tokens) on a CPU takes wider steps, unless the
        # budget was set (or the model keeps recurrent state, whose checkpoints follow the budget)
        throughput_budget = (
            DEFAULT_CPU_THROUGHPUT_CALL_TOKENS
            if (
                not budget_set
                and self.state_layout is None
                and next(model.parameters()).device.type == "cpu"
            )
            else None
        )
        # a hybrid's prompts are checkpointed every step budget's worth of tokens (and at their last full block)
        self.kv_manager = BlockManager(
            num_blocks,
            self.config.block_size,
            self.config.enable_prefix_caching,
            self._cache_key(),
            slots,
            checkpoint_interval=self.config.max_num_batched_tokens,
            groups=self.groups,
            step_tokens=max(self.config.max_num_batched_tokens, throughput_budget or 0),
        )
        self.runner = ModelRunner(
            model,
            self.config,
            num_blocks,
            self.layout,
            self.state_layout,
            slots.total if slots is not None else 0,
            groups=self.groups,
        )
        runner = self.runner  # its backend's tensors at each use: waking up reallocates them
        kv_tiers = make_kv_tiers(
            self.config,
            model,
            self.groups,
            self.state_layout,
            lambda: runner.backend.distinct_kv,
            self._cache_key(),
        )
        self.scheduler = Scheduler(
            self.kv_manager,
            self.config.max_num_batched_tokens,
            self.config.max_num_seqs,
            self.config.preemption_mode,
            self.config.max_prefill_tokens_while_decoding,
            continues_chunks=self.state_layout is None or self.state_layout.continues_chunks,
            max_waiting=self.config.max_waiting,
            policy=make_policy(
                self.config.scheduling_policy,
                self.config.priority_lookahead,
                self.config.priority_aging_s,
            ),
            throughput_call_budget=throughput_budget,
            lift_cap_in_throughput_calls=auto_prefill_cap,
            kv_tiers=kv_tiers,
        )
        if kv_tiers is not None and kv_tiers.on_eviction is not None:
            self.kv_manager.pool.listener = kv_tiers

    # ---- sizing ------------------------------------------------------------------------------
    def _num_kv_blocks(self, explicit_max_num_seqs: bool) -> int:
        """KV pages the budget holds (a page: one cache group's layers' KV of a block), after a
        hybrid model's state slots (one per sequence that may run) took their share; ``max_num_seqs``'
        default yields to what the state memory allows."""
        cfg = self.config
        if cfg.num_blocks is not None and self.state_layout is None:
            return cfg.num_blocks
        device = next(self.model.parameters()).device
        per_block = self.page_bytes
        if device.type == "cuda":
            if cfg.kv_cache_memory is not None:  # an explicit fraction of the free memory
                budget = int(torch.cuda.mem_get_info(device)[0] * cfg.kv_cache_memory)
            else:  # gpu_memory_utilization of the total, less what the largest step needs
                from ..execution.cuda_memory import profile_kv_budget

                budget = profile_kv_budget(self.model, cfg, self.layout)
        else:
            budget = int(cfg.kv_cache_memory or DEFAULT_CPU_KV_BYTES)
        if self.state_layout is not None:
            budget -= self._reserve_state_slots(budget, explicit_max_num_seqs)
            if cfg.num_blocks is not None:
                return cfg.num_blocks
        # never more than every running sequence at full length could use
        useful = cfg.max_num_seqs * most_blocks(
            self.groups,
            min(self.max_model_len, 1 << 20),
            cfg.max_num_batched_tokens,
            cfg.block_size,
        )
        if per_block == 0:  # stateful layers only: blocks hold no KV, they only count tokens
            return cfg.max_num_seqs * -(-min(self.max_model_len, 1 << 16) // cfg.block_size)
        num_blocks = min(budget // per_block, useful)
        if num_blocks < 1:
            raise ValueError(f"KV budget of {budget} bytes holds no block of {per_block} bytes")
        return num_blocks

    def _reserve_state_slots(self, budget: int, explicit_max_num_seqs: bool) -> int:
        """Bytes of the state slots: ``max_num_seqs`` running ones and, with prefix caching, half as
        many prefix checkpoints; by default no more than half the budget holds."""
        cfg, per_slot = self.config, self.state_layout.bytes_per_slot()
        # checkpoints: half a slot per running sequence
        share = 1.5 if cfg.enable_prefix_caching else 1.0
        fit = max(1, int(budget // 2 // per_slot / share))
        if not explicit_max_num_seqs and fit < cfg.max_num_seqs:
            logger.info(
                "paged_hf: max_num_seqs lowered to %d: a sequence's state takes %s bytes (%s), and the "
                "states%s may take half of the %s-byte KV budget (kv_cache_memory)",
                fit,
                f"{per_slot:,}",
                self.state_layout.describe(),
                " and their prefix checkpoints" if share > 1 else "",
                f"{budget:,}",
            )
            cfg.max_num_seqs = fit
        self._num_checkpoints = max(1, cfg.max_num_seqs // 2) if cfg.enable_prefix_caching else 0
        need = (cfg.max_num_seqs + self._num_checkpoints) * per_slot
        if need >= budget and cfg.num_blocks is None:
            raise ValueError(
                f"max_num_seqs={cfg.max_num_seqs} sequences' state and {self._num_checkpoints} prefix "
                f"checkpoints take {need:,} bytes ({per_slot:,} each: {self.state_layout.describe()}), not "
                f"less than the KV budget of {budget:,} bytes; lower max_num_seqs or raise kv_cache_memory"
            )
        return need

    @over_ranks("Engine.warmup")
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
        prompts = (
            [(7 * i + 3) % vocab for i in range(min(2 * bs + 1, room))],
            [3 % vocab, 5 % vocab][:room],
        )
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        bound, self.scheduler.max_waiting = self.scheduler.max_waiting, None  # its own two
        try:
            rids = [self.add_request(p, params) for p in prompts]
        finally:
            self.scheduler.max_waiting = bound
        self.run_until_done(rids)
        self._forget_throwaway_runs()
        self.scheduler.step_time = StepTimeModel()  # its one-off first steps are no step's time
        seconds = time.perf_counter() - start
        logger.info("paged_hf: warm-up took %.1f s", seconds)
        return seconds

    def calibrate(self) -> None:
        """Time a few steps (two short prompts, eight tokens each, twice) so that the engine's
        step-time fit exists before its first real call; left as it was otherwise."""
        vocab = self.vocab_size
        prompts = [
            [(11 * i + 5) % vocab for i in range(16)],
            [(13 * i + 7) % vocab for i in range(9)],
        ]
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        for _ in range(2):
            self.generate(prompts, params)
        self._forget_throwaway_runs()

    def _forget_throwaway_runs(self) -> None:
        """After warm-up or calibration: no cached blocks, stats and counters at zero."""
        self.kv_manager.pool.drop_cached()
        self._stats = EngineStats()
        self.scheduler.num_preemptions = self.scheduler.prefix_hit_tokens = 0

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request (all its samples) now and free its blocks; returns its output so far
        (``finish_reason`` "abort"). Safe to call from an ``on_token`` callback."""
        with self.lock:
            root = self.requests.pop(str(request_id), None)
            if root is None:
                raise ValueError(f"request {request_id}: unknown or already finished")
            now = self.scheduler.clock()
            for r in root.samples:
                if not r.is_finished:
                    self.scheduler.finish(r, FinishReason.ABORT, now)
            self._settle(root)
            return self.make_output(root)

    def fail(self, req: Request, message: str) -> None:
        """End one request (one sample) with ``finish_reason`` "error" and ``message``; the
        others are not touched. A request already aborted stays aborted."""
        if req.finish_reason is FinishReason.ABORT:
            return
        with self.lock:
            req.error = message
            if req.is_finished:  # e.g. its last token's callback failed: the output says so
                req.finish_reason = FinishReason.ERROR
            else:
                self.scheduler.finish(req, FinishReason.ERROR, self.scheduler.clock())
            self._settle(req.parent or req)

    def set_draft_model(self, draft: EngineCore | None) -> None:
        """Requests with ``num_assistant_tokens`` take their drafts from ``draft``, an engine over
        a draft model with this model's tokenizer (paged_hf/engine/draft_model.py); None: no
        draft model (such requests are refused)."""
        if draft is None:
            self.scheduler.drafter = None
            return
        if draft is self or self.ranks is not None or draft.ranks is not None:
            raise NotImplementedError(
                "a draft model needs an engine of its own, outside tensor parallelism"
            )
        if draft.vocab_size < self.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.vocab_size}) is smaller than this model's "
                f"({self.vocab_size}): a draft model needs the same tokenizer"
            )
        if not self.scheduler.speculates:
            raise ValueError(
                "a model with recurrent or convolution state (a hybrid) does not speculate: its "
                "state cannot take back rejected tokens"
            )
        with self.lock:
            self.scheduler.drafter = Drafter(draft)

    def sleep(self) -> None:
        """Let go of the KV cache's memory (and a hybrid's state slots, captured CUDA graphs, packed
        CPU weights) between generations, as vLLM's sleep mode does next to a training step; the
        prefix cache is emptied. The next step wakes the engine (``wake_up``): the memory is
        allocated again, empty. Only an idle engine sleeps."""
        if self.is_busy:
            raise RuntimeError(
                "Engine.sleep(): requests are still live; let them finish or abort them first"
            )
        self.kv_manager.pool.drop_cached()
        self.runner.sleep()
        logger.info("paged_hf: the engine sleeps; its KV cache is released")

    def wake_up(self) -> None:
        """Allocate the memory ``sleep`` let go of (the first step after a sleep does it by itself)."""
        self.runner.wake_up()

    @property
    def is_sleeping(self) -> bool:
        return self.runner.asleep

    def reset_prefix_cache(self) -> None:
        """Never serve a block cached so far: requests admitted from now on compute their KV
        anew, and what was derived from the weights (packed CPU weights, captured CUDA graphs) is
        made again. Runs by itself when the weights change (checked before every step); call it
        after a write the checks cannot see (``paged_hf/cache/coherence.py``: a write through
        ``.data`` to a few rows of a tensor, say)."""
        self._weights_changed(moved=True)

    def _weights_changed(self, moved: bool) -> None:
        if self.scheduler.kv_tiers is not None:
            self.scheduler.kv_tiers.turn_off(
                "the model's weights changed in this process (build a new engine to keep and read "
                "records of the new weights)"
            )
        self._cache_generation += 1
        self.kv_manager.reset_prefix_cache(self._cache_key())
        self.runner.weights_changed(moved)

    def _cache_key(self) -> tuple:
        """The prefix-cache namespace requests are admitted under now: the engine's namespace, the
        weights' generation and the adapter state, so KV computed under one never serves another."""
        return self._namespace, self._cache_generation, self._adapters

    def check_weights(self, rescan: bool = False) -> bool:
        """Reset the prefix cache if the model's weights changed since the last check (True if
        they did), and follow an adapter switch to its own namespace. Every step checks
        (``rescan`` also looks for replaced tensors and compares the content sample, which steps
        do about once a second; every generate call does it at its start)."""
        change = self._weights.changed(rescan)
        if change is not None:
            self._weights_changed(change.moved)
            logger.info(
                "paged_hf: the model's weights changed (%s); the prefix cache was reset", change.why
            )
        adapters = self._weights.adapter_state()
        if adapters != self._adapters:  # blocks cached under the previous state stay, under its key
            self._adapters = adapters
            self.kv_manager.switch_namespace(self._cache_key())
            if self.scheduler.kv_tiers is not None:
                self.scheduler.kv_tiers.follow_adapters(adapters)
            logger.info(
                "paged_hf: the model's adapter state changed; the prefix cache serves that state's blocks"
            )
        return change is not None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def is_busy(self) -> bool:
        """Requests are live, or a background engine is stepping this one."""
        return self.serving or bool(self.requests) or self.scheduler.has_unfinished

    def group_stats(self) -> list[dict[str, Any]]:
        """Per cache group: its kind, layers, and the pages running requests hold in it now."""
        held: list[set[int]] = [set() for _ in self.groups]
        for req in self.scheduler.running:
            for pages, table in zip(held, req.block_tables):
                pages.update(b for b in table if b >= 0)
        return [
            {"kind": g.kind, "layers": len(g.layers), "blocks_used": len(pages)}
            for g, pages in zip(self.groups, held)
        ]

    def flush_kv_tiers(self, timeout: float | None = None) -> None:
        """Wait until the disk tier has written every record queued so far (the end of a run: the
        next process reads them; a normal exit waits for them too)."""
        if self.scheduler.kv_tiers is not None:
            self.scheduler.kv_tiers.flush(timeout)

    def stats(
        self, ttft_target_s: float | None = None, tpot_target_s: float | None = None
    ) -> dict[str, Any]:
        """Counters of the engine's work so far, and under "latency" per priority the finished
        requests' TTFT / TPOT / queue-time percentiles and goodput: good requests finished
        without error within ``ttft_target_s`` / ``tpot_target_s`` (else each request's own
        targets; none: every request without error is good)."""
        with self.lock:  # not while another thread steps
            return snapshot(self, ttft_target_s, tpot_target_s)
