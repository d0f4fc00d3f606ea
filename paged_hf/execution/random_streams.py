"""Each sampled row's random numbers as a function of its seed and its token's index alone.

A row's ``j``-th output token is drawn with ``uniform(seed, j)``, the ``j``-th value of a SplitMix64
stream keyed by the row's seed (Steele, Lea & Flood 2014; counter-based: any value is computed
without the ones before it). So a draw never depends on which rows share the step, how the prompt
was chunked or served from the prefix cache, a preemption's recompute, how many draft positions a
speculative step verifies, which rank samples or which thread calls: the same seed gives the same
samples on any engine state. One shared generator (torch's default, drawn once a step for the
step's rows) gave other samples whenever a step was composed otherwise.
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2**64 / the golden ratio, odd
# a draw's resolution: 24 bits, a float32 in [0, 1) exactly (probabilities are float32)
_BITS = 24


def _mix(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit ints in which each input bit flips about
    half the output bits."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def uniform(seed: int, index: int) -> float:
    """The ``index``-th value in [0, 1) of the stream of ``seed`` (any int; taken mod 2**64). The
    seed is mixed first, so seeds next to each other (sample k of n draws with seed + k) key
    streams that are not shifted copies of each other."""
    key = _mix((seed ^ _GOLDEN) & _MASK)
    return (_mix((key + (index + 1) * _GOLDEN) & _MASK) >> (64 - _BITS)) / (1 << _BITS)


def uniforms(keys: list[tuple[int, int]]) -> torch.Tensor:
    """``uniform(seed, index)`` for each (seed, index), as float32 on the CPU."""
    return torch.tensor([uniform(s, i) for s, i in keys], dtype=torch.float32)
