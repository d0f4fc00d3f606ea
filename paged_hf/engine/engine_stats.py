"""The engine's counters, and ``stats()``'s snapshot of them with the pool, the scheduler, the
tiers and the tensor-parallel ranks (paged_hf/engine/core.py's ``EngineCore.stats``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from . import latency_stats


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    generated_tokens: int = 0
    steps: int = 0
    peak_blocks_used: int = 0
    # references beyond a block's first, at the step with the most (blocks sharing saved)
    peak_blocks_shared: int = 0
    peak_bytes: int = 0  # KV pages and state slots held, at the step that held the most
    peak_running: int = 0  # sequences running in one step, at most
    kv_waste_sum: float = 0.0
    draft_proposed: int = 0  # speculative decoding: draft tokens verified, and those accepted
    draft_accepted: int = 0
    # one row per step, for plots and tables; bounded so a long-lived server does not grow without end
    step_log: deque = field(default_factory=lambda: deque(maxlen=100_000))
    # one row per finished request (paged_hf/engine/latency_stats.py), bounded alike
    finished_log: deque = field(default_factory=lambda: deque(maxlen=100_000))


def snapshot(engine: Any, ttft_target_s: float | None, tpot_target_s: float | None) -> dict:
    """``engine.stats()``: its counters now (its lock held)."""
    s, pool = engine._stats, engine.kv_manager.pool
    slots = engine.kv_manager.state
    state = {} if slots is None else slots.stats(engine.runner.states, engine.runner.asleep)
    structured = {} if engine.structured is None else engine.structured.stats()
    drafter = engine.scheduler.drafter
    return (
        state
        | structured
        | {
            "prompt_tokens": s.prompt_tokens,
            "prefill_tokens_computed": s.prefill_tokens_computed,
            "prefix_hit_tokens": engine.scheduler.prefix_hit_tokens,
            "kv_tiers": _tier_stats(engine),
            "tensor_parallel": _rank_stats(engine),
            "generated_tokens": s.generated_tokens,
            "draft_tokens_proposed": s.draft_proposed,
            "draft_tokens_accepted": s.draft_accepted,
            "draft_model": {} if drafter is None else drafter.stats(),
            "preemptions": engine.scheduler.num_preemptions,
            "steps": s.steps,
            "num_blocks": pool.num_blocks,
            "blocks_used": pool.num_used,
            "blocks_cached": pool.num_cached,
            "blocks_free": pool.num_free,
            "peak_blocks_used": s.peak_blocks_used,
            "peak_blocks_shared": s.peak_blocks_shared,
            "kv_bytes_peak": s.peak_bytes,
            "peak_running": s.peak_running,
            "page_bytes": engine.page_bytes,
            "cache_groups": engine.group_stats(),
            "kv_waste": s.kv_waste_sum / s.steps if s.steps else 0.0,
            "block_size": engine.kv_manager.block_size,
            "backend": engine.runner.backend_name,
            "asleep": engine.runner.asleep,
            "latency": latency_stats.summary(list(s.finished_log), ttft_target_s, tpot_target_s),
        }
    )


def _tier_stats(engine: Any) -> dict[str, Any]:
    tier = engine.scheduler.kv_tiers
    return {} if tier is None else tier.stats(engine.scheduler.step_time.prefill_token_s())


def _rank_stats(engine: Any) -> dict[str, Any]:
    if engine.ranks is None or not engine.layout.layers:
        return {}
    text = engine.model.config.get_text_config()
    whole = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    return engine.ranks.stats(engine.layout.layers[0].kv_heads, whole)


def record_step(engine: Any, out: Any, sampled: dict, decode_tokens: int) -> None:
    """A finished step's counts: tokens, blocks and bytes at their peaks, the step log's row."""
    s, pool, kv = engine._stats, engine.kv_manager.pool, engine.kv_manager
    verified = engine._verified
    s.prefill_tokens_computed += out.num_tokens - decode_tokens
    s.generated_tokens += len(sampled) + sum(map(len, verified.accepted.values()))
    s.draft_proposed += verified.proposed
    s.draft_accepted += verified.taken
    s.steps += 1
    used = pool.num_used
    s.peak_blocks_used = max(s.peak_blocks_used, used)
    s.peak_blocks_shared = max(s.peak_blocks_shared, pool.shared_refs)
    states = kv.state.num_used * engine.state_layout.bytes_per_slot() if kv.state is not None else 0
    s.peak_bytes = max(s.peak_bytes, used * engine.page_bytes + states)
    s.peak_running = max(s.peak_running, len(out.scheduled))
    unfilled = sum(kv.unfilled_slots(r) for r in engine.scheduler.running)
    waste = unfilled / (used * kv.block_size) if used else 0.0
    s.kv_waste_sum += waste
    s.step_log.append(
        {
            "step": s.steps,
            "time": engine.scheduler.clock(),
            "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting),
            "tokens": out.num_tokens,
            "blocks_used": used,
            "kv_waste": waste,
            "preempted": len(out.preempted),
        }
    )
