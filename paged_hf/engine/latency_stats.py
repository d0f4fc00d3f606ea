"""Per-request latency records and their summary: TTFT, TPOT and queue-time percentiles per
priority, and goodput (requests per second that finished without error within their targets,
vLLM's ``bench serve --goodput`` definition)."""

from __future__ import annotations

import math
from typing import Any

from ..requests.request import FinishReason, Request

PERCENTILES = (50, 90, 99)


def record(root: Request) -> dict[str, Any]:
    """One finished request's row (its first sample's tokens; preemptions of all its samples)."""
    samples = root.samples
    first = root.first_token_time
    n_out = root.num_output_tokens
    ttft = None if first is None else first - root.arrival_time
    tpot = (
        (root.finish_time - first) / (n_out - 1)
        if first is not None and root.finish_time is not None and n_out > 1
        else None
    )
    return {
        "time": root.finish_time,
        "arrival": root.arrival_time,
        "priority": root.params.priority,
        "queued_s": None
        if root.first_scheduled_time is None
        else root.first_scheduled_time - root.arrival_time,
        "ttft": ttft,
        "tpot": tpot,
        "max_itl": max(r.max_itl for r in samples),
        "preemptions": sum(r.num_preemptions for r in samples),
        "output_tokens": n_out,
        "error": any(r.finish_reason is FinishReason.ERROR for r in samples),
        "ttft_target_s": root.params.ttft_target_s,
        "tpot_target_s": root.tpot_target_s,
    }


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile, linearly interpolated (numpy's default); None for no values."""
    if not values:
        return None
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def is_good(row: dict[str, Any], ttft_target_s: float | None, tpot_target_s: float | None) -> bool:
    """Finished without error and within every target given (the arguments, else its own)."""
    if row["error"]:
        return False
    ttft_target = ttft_target_s if ttft_target_s is not None else row["ttft_target_s"]
    tpot_target = tpot_target_s if tpot_target_s is not None else row["tpot_target_s"]
    if ttft_target is not None and (row["ttft"] is None or row["ttft"] > ttft_target):
        return False
    return tpot_target is None or row["tpot"] is None or row["tpot"] <= tpot_target


def summary(
    rows: list[dict[str, Any]],
    ttft_target_s: float | None = None,
    tpot_target_s: float | None = None,
) -> dict[Any, dict[str, Any]]:
    """Per priority (and "all"): requests, TTFT / TPOT / queue-time percentiles, good requests,
    attainment (good / requests) and goodput (good per second of the span they arrived and
    finished in)."""
    by_priority: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        by_priority.setdefault(row["priority"], []).append(row)
    groups = dict(sorted(by_priority.items()))
    if len(groups) > 1:
        groups["all"] = rows
    return {key: _one_class(group, ttft_target_s, tpot_target_s) for key, group in groups.items()}


def _one_class(
    rows: list[dict[str, Any]], ttft_target_s: float | None, tpot_target_s: float | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(rows)}
    for name in ("ttft", "tpot", "queued_s"):
        values = [r[name] for r in rows if r[name] is not None]
        for q in PERCENTILES:
            out[f"{name}_p{q}"] = percentile(values, q)
    good = sum(is_good(r, ttft_target_s, tpot_target_s) for r in rows)
    span = max(r["time"] for r in rows) - min(r["arrival"] for r in rows)
    out["good"] = good
    out["attainment"] = good / len(rows)
    out["goodput_per_s"] = good / span if span > 0 else None
    out["preemptions"] = sum(r["preemptions"] for r in rows)
    return out
