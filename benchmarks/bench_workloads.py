"""Seeded token-level workloads: prompts are token ids drawn from the model's vocabulary (special
ids excluded), so no tokenizer noise enters a measurement. Every request is greedy and forced
to exactly ``n_out`` new tokens (EOS ignored), so every system does the same work.

    W-mixed   N prompts of U[20, 300] tokens, U[16, 128] new tokens each (all arrive at t0)
    W-prefix  64 requests: one shared 512-token prefix + 16-64 own tokens; 32 new tokens each
    W-prefix-long  N requests: one shared 512-token prefix + U[20, 300] own tokens, U[16, 128] new
              tokens each (contexts reach ~500-950 tokens: where attention's cost shows)
    W-long    32 short requests start decoding; then 4 prompts of 2,000 tokens arrive
              (TTFT/TPOT are reported for the short ones: they are what the long prefills hurt)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class BenchRequest:
    prompt: list[int]
    n_out: int
    late: bool = False  # arrives once every early request has produced LATE_AFTER tokens


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]
    shared_prefix: int = 0  # tokens every prompt shares (computed once by a perfect prefix cache)
    focus: list[int] = field(default_factory=list)  # requests whose latency is reported; [] = all
    late_after: int = 0  # late requests arrive when every early one has this many tokens out

    @property
    def focus_ids(self) -> list[int]:
        return self.focus or list(range(len(self.requests)))

    @property
    def arrival_order(self) -> list[int]:
        """Request indices, the early ones first (a system that queues takes them in this order)."""
        early = [i for i, r in enumerate(self.requests) if not r.late]
        return early + [i for i, r in enumerate(self.requests) if r.late]

    def late_ready(self, progress: list[int]) -> bool:
        """Whether the late requests arrive now, given each request's tokens out so far."""
        return all(
            progress[i] >= min(self.late_after, r.n_out)
            for i, r in enumerate(self.requests)
            if not r.late
        )

    def summary(self) -> dict:
        prompts = [len(r.prompt) for r in self.requests]
        outs = [r.n_out for r in self.requests]
        out = {"name": self.name, "requests": len(self.requests), "prompt_tokens": sum(prompts)}
        out |= {"output_tokens": sum(outs), "prompt_len_range": [min(prompts), max(prompts)]}
        out |= {"output_len_range": [min(outs), max(outs)], "shared_prefix": self.shared_prefix}
        out["late_requests"] = sum(r.late for r in self.requests)
        return out | {"late_after": self.late_after}

    def subset(self, n: int) -> "Workload":
        """The first ``n`` requests in arrival order (for the slow one-at-a-time baseline)."""
        keep = sorted(self.arrival_order[:n])
        focus = [keep.index(i) for i in self.focus if i in keep]
        reqs = [self.requests[i] for i in keep]
        return Workload(self.name, reqs, self.shared_prefix, focus, self.late_after)


def allowed_ids(vocab_size: int, special_ids: set[int]) -> list[int]:
    """Token ids a prompt may use: the vocabulary minus special/added ids."""
    return [t for t in range(vocab_size) if t not in special_ids]


def _tokens(rng: random.Random, pool: list[int], n: int) -> list[int]:
    return [pool[rng.randrange(len(pool))] for _ in range(n)]


Range = tuple[int, int]  # (least, most), both included


def w_mixed(
    pool, n=64, seed=0, prompt_len: Range = (20, 300), out_len: Range = (16, 128), name=None
):
    rng = random.Random(f"w-mixed/{seed}")
    reqs = [
        BenchRequest(_tokens(rng, pool, rng.randint(*prompt_len)), rng.randint(*out_len))
        for _ in range(n)
    ]
    return Workload(name or f"W-mixed-{n}", reqs)


def warm(pool: list[int]) -> Workload:
    """Two tiny requests each system runs first, so first-call costs stay out of its row."""
    return w_mixed(pool, n=2, seed=12345, prompt_len=(16, 24), out_len=(3, 3), name="warm-up")


def w_prefix(pool, n=64, seed=0, prefix_len=512, suffix_len: Range = (16, 64), n_out=32, name=None):
    rng = random.Random(f"w-prefix/{seed}")
    prefix = _tokens(rng, pool, prefix_len)
    reqs = [
        BenchRequest(prefix + _tokens(rng, pool, rng.randint(*suffix_len)), n_out) for _ in range(n)
    ]
    return Workload(name or f"W-prefix-{n}", reqs, shared_prefix=prefix_len)


def w_prefix_long(
    pool, n=64, seed=0, prefix_len=512, own_len=(20, 300), out_len=(16, 128), name=None
):
    rng = random.Random(f"w-prefix-long/{seed}")
    prefix = _tokens(rng, pool, prefix_len)
    reqs = [
        BenchRequest(prefix + _tokens(rng, pool, rng.randint(*own_len)), rng.randint(*out_len))
        for _ in range(n)
    ]
    return Workload(name or f"W-prefix-long-{n}", reqs, shared_prefix=prefix_len)


def w_long(
    pool,
    n_short=32,
    n_long=4,
    seed=0,
    long_len=2000,
    short_prompt: Range = (20, 120),
    short_out=128,
    long_out=16,
    late_after=4,
    name=None,
):
    rng = random.Random(f"w-long/{seed}")
    shorts = [
        BenchRequest(_tokens(rng, pool, rng.randint(*short_prompt)), short_out)
        for _ in range(n_short)
    ]
    longs = [BenchRequest(_tokens(rng, pool, long_len), long_out, late=True) for _ in range(n_long)]
    focus = list(range(n_short))  # the short requests' latency: what the long prefills hurt
    return Workload(name or "W-long", shorts + longs, focus=focus, late_after=late_after)


def build(names, pool, *, mixed_n=64, mixed_out: Range = (16, 128), scale=1.0, seed=0):
    """The workloads named in ``names`` ("mixed", "prefix", "prefix_long", "long"); ``scale`` < 1
    shrinks them (W-mixed and W-prefix-long take ``mixed_n`` requests and ``mixed_out`` outputs)."""

    def scaled(least: int, n: int) -> int:
        return max(least, round(n * scale))

    prefix_len = max(16, round(512 * scale) // 16 * 16)
    out = []
    for name in names:
        if name == "mixed":
            out.append(w_mixed(pool, mixed_n, seed, out_len=mixed_out))
        elif name == "prefix":
            out.append(w_prefix(pool, scaled(2, 64), seed, prefix_len, n_out=scaled(4, 32)))
        elif name == "prefix_long":
            own = (scaled(2, 20), scaled(4, 300))
            out.append(w_prefix_long(pool, mixed_n, seed, prefix_len, own, out_len=mixed_out))
        elif name == "long":
            sizes = dict(n_short=scaled(2, 32), n_long=scaled(1, 4), long_len=scaled(32, 2000))
            sizes.update(short_out=scaled(8, 128), long_out=scaled(4, 16), late_after=scaled(2, 4))
            out.append(w_long(pool, seed=seed, **sizes))
        else:
            raise ValueError(f"unknown workload {name!r}; known: mixed, prefix, prefix_long, long")
    return out
