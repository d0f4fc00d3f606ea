"""OpenMP's wait policy for a benchmark process, chosen before torch loads libgomp (import this first).

OpenMP threads that finish a parallel region spin while they wait for the next one. On a machine
whose cores other processes use too, the spinning threads take the cores from the thread the region
waits for, and every parallel region stalls for a scheduler slice: on this 2-core machine, with
another 2-thread job running, a bf16 [512, 576] multiply took 8 ms with 2 threads instead of 0.1 ms,
and W-mixed ran at 20 out tok/s for paged_hf and 26 for vLLM's CPU engine, against 143 and 158
with ``OMP_WAIT_POLICY=PASSIVE`` (waiting threads sleep). The policy is read once, when libgomp
loads, so it is set here from the command line before anything imports torch:

    --omp-wait-policy auto      PASSIVE when the 1-minute load average is above 0.5 (others run),
                                else OpenMP's default (spinning costs nothing on idle cores)
    --omp-wait-policy passive   / active / default (leave it to OpenMP)

An OMP_WAIT_POLICY already in the environment is kept. Subprocesses (vLLM's worker) inherit it.
"""
from __future__ import annotations

import os
import sys

CHOICES = ("auto", "passive", "active", "default")


def setup(argv: list[str] | None = None) -> str:
    """Set OMP_WAIT_POLICY from ``--omp-wait-policy`` in argv; return what the process runs with."""
    argv = sys.argv[1:] if argv is None else argv
    choice = "auto"
    for i, a in enumerate(argv):
        if a == "--omp-wait-policy" and i + 1 < len(argv):
            choice = argv[i + 1]
        elif a.startswith("--omp-wait-policy="):
            choice = a.split("=", 1)[1]
    if "OMP_WAIT_POLICY" in os.environ:
        return f"{os.environ['OMP_WAIT_POLICY']} (from the environment)"
    if "torch" in sys.modules:
        return "OpenMP default (torch was imported first)"
    if choice == "auto":
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        choice = "passive" if load > 0.5 else "default"
        if choice == "passive":
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
            return f"PASSIVE (auto: load average {load:.1f} before the run)"
        return f"OpenMP default (auto: load average {load:.1f} before the run)"
    if choice in ("passive", "active"):
        os.environ["OMP_WAIT_POLICY"] = choice.upper()
        return choice.upper()
    return "OpenMP default"
