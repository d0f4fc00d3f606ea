"""What this CPU's instructions allow paged_hf's kernels: its x86 flags, read once, and the level
they make (AVX2+FMA, AVX-512, AVX-512 bf16, AMX), the one place every CPU path asks.

``PAGED_HF_CPU_ISA=avx2`` (or ``avx512``, ``avx512_bf16``) caps what paged_hf takes from this CPU,
so a machine with more runs the paths a lesser CPU runs; with ``ATEN_CPU_CAPABILITY=avx2`` and
``ONEDNN_MAX_CPU_ISA=AVX2`` torch's own kernels follow (``make test-avx2`` sets all three). A cap
above what the CPU has changes nothing.
"""

from __future__ import annotations

import os
import platform

# each level's flags, cumulative: a CPU is at a level when it has all of them
_LEVELS: list[tuple[str, frozenset[str]]] = [
    ("avx2", frozenset({"avx2", "fma", "f16c"})),
    ("avx512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})),
    ("avx512_bf16", frozenset({"avx512_bf16"})),
    ("amx", frozenset({"amx_tile", "amx_bf16"})),
]
NAMES = [name for name, _ in _LEVELS]
_FLAGS: list[frozenset[str]] = []


def _read_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cap() -> str | None:
    """The level ``PAGED_HF_CPU_ISA`` caps paged_hf at, or None; an unknown name raises."""
    asked = os.environ.get("PAGED_HF_CPU_ISA", "").strip().lower()
    if asked in ("", "native"):
        return None
    if asked not in NAMES:
        raise ValueError(f"PAGED_HF_CPU_ISA={asked!r}: expected one of native, {', '.join(NAMES)}")
    return asked


def flags() -> frozenset[str]:
    """This CPU's flags, less those above ``PAGED_HF_CPU_ISA``'s level."""
    if not _FLAGS:
        have = _read_flags()
        limit = cap()
        if limit is not None:
            above = set().union(*(f for _, f in _LEVELS[NAMES.index(limit) + 1 :]))
            # AVX-512's extensions beyond the four a level names go with it
            if NAMES.index(limit) < NAMES.index("avx512"):
                above |= {f for f in have if f.startswith("avx512")}
            have = have - above
        _FLAGS.append(have)
    return _FLAGS[0]


def level() -> str | None:
    """The highest level whose flags (and all below) this CPU has, or None (not x86, or older)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    have, reached = flags(), None
    for name, needed in _LEVELS:
        if not needed <= have:
            break
        reached = name
    return reached


def at_least(name: str) -> bool:
    """Whether this CPU (within the cap) reaches level ``name``."""
    reached = level()
    return reached is not None and NAMES.index(reached) >= NAMES.index(name)
