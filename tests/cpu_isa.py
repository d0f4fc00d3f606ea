"""Marks for tests of one kind of CPU's kernels: such a test runs where this CPU (within
``PAGED_HF_CPU_ISA``) has what it needs, and elsewhere is reported as skipped, naming what it needs
and what this CPU has, never passed unrun (``make test`` lists the skips with ``-rs``)."""

from __future__ import annotations

import os

import pytest
import torch

from paged_hf.execution.cpu import isa

# in every skip reason these marks give, before the CPU's description (the run's closing line
# counts the skips by it)
THIS_CPU = "; this CPU: "


def describe() -> str:
    """This CPU as paged_hf's kernels and torch's see it, e.g. 'avx2 (capped by
    PAGED_HF_CPU_ISA=avx2), torch AVX2'."""
    level = isa.level() or "below avx2"
    capped = f" (capped by PAGED_HF_CPU_ISA={isa.cap()})" if isa.cap() else ""
    return f"{level}{capped}, torch {torch.backends.cpu.get_cpu_capability()}"


def needs(level: str, what: str):
    """Run where this CPU reaches ``level``; elsewhere skip saying so."""
    return pytest.mark.skipif(
        not isa.at_least(level), reason=f"{what} needs {level}{THIS_CPU}{describe()}"
    )


def lacks(level: str, what: str):
    """Run where this CPU does not reach ``level`` (the path such CPUs take); elsewhere skip."""
    return pytest.mark.skipif(
        isa.at_least(level),
        reason=f"{what} is what CPUs without {level} run{THIS_CPU}{describe()}",
    )


def header() -> str:
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return f"cpu kernels: {describe()}" + (f", ONEDNN_MAX_CPU_ISA={onednn}" if onednn else "")
