"""OpenMP's wait policy for a benchmark process, chosen before torch loads libgomp (import this first).

OpenMP threads that finish a parallel region spin while they wait for the next one. On a machine
whose cores other processes use too, the spinning threads take the cores from the thread the region
waits for, and every parallel region stalls for a scheduler slice: on this 2-core machine, with
another 2-thread job running, a bf16 [512, 576] multiply took 8 ms with 2 threads instead of 0.1 ms,
and W-mixed ran at 20 out tok/s for paged_hf and 26 for vLLM's CPU engine, against 143 and 158
with ``OMP_WAIT_POLICY=PASSIVE`` (waiting threads sleep). The policy is read once, when libgomp
loads, so it is set here from the command line before anything imports torch:

    --omp-wait-policy auto      PASSIVE when other processes keep a third of a core busy over a
                                half-second look (/proc/stat; load averages cannot tell: this VM
                                idles at ~1), else OpenMP's default (on idle cores PASSIVE cost
                                paged_hf ~10% in make demo)
    --omp-wait-policy passive   / active / default (leave it to OpenMP)

An OMP_WAIT_POLICY already in the environment is kept. Subprocesses (vLLM's worker) inherit it.
"""

from __future__ import annotations

import os
import sys
import time

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
        with OtherProcesses() as look:
            time.sleep(0.5)
        others = "others' CPU time unknown"
        if look.cores is not None:
            others = f"others kept {look.cores:.1f} cores busy before the run"
        if others_busy(look.cores):
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
            return f"PASSIVE (auto: {others})"
        return f"OpenMP default (auto: {others})"
    if choice in ("passive", "active"):
        os.environ["OMP_WAIT_POLICY"] = choice.upper()
        return choice.upper()
    return "OpenMP default"


def others_busy(cores: float | None) -> bool:
    return cores is not None and cores > 0.3


def others_busy_now() -> bool:
    """Whether other processes keep a third of a core busy, over a half-second look."""
    with OtherProcesses() as look:
        time.sleep(0.5)
    return others_busy(look.cores)


class OtherProcesses:
    """CPU time other processes take while a block runs: the machine's busy time (/proc/stat)
    less this process's own (Linux; elsewhere ``cores`` stays None). Load averages do not tell
    it: this VM's floor is ~1 with nothing running."""

    def __enter__(self) -> "OtherProcesses":
        self.cores = None
        self._start = (_machine_busy_s(), os.times(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy0, own0, wall0 = self._start
        busy1, own1, wall1 = _machine_busy_s(), os.times(), time.perf_counter()
        if busy0 is not None and busy1 is not None:
            own = (own1.user + own1.system) - (own0.user + own0.system)
            self.cores = max(0.0, (busy1 - busy0 - own) / (wall1 - wall0))  # cores they kept busy


def _machine_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
