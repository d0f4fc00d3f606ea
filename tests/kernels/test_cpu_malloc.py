"""glibc's malloc and torch's CPU allocator set by a CPU engine (paged_hf/execution/cpu/malloc.py): a step's
freed temporaries stay mapped (no page faults on the next step's), large blocks are kept for the next
step however the heap fragments, and nothing is set where the process chose its allocator already or the
engine is told not to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paged_hf.execution.cpu import malloc as cpu_malloc

ROOT = Path(__file__).resolve().parents[2]

# A step's temporaries: four 24 MiB activations alive at once, then freed, 10 times, counting the
# minor page faults (the fewest of 3 rounds: the kernel's own page sampling adds a few now and then).
# First from glibc's starting thresholds (128 KiB; its defaults move them as blocks are freed, so
# where they stand after a process's history varies), where each block is unmapped on free and
# faulted in again; then after building a CPU engine, which sets malloc unless told not to.
SCRIPT = r"""
import ctypes, json, resource, sys
import torch
sys.path.insert(0, sys.argv[1])
from paged_hf.execution.cpu import malloc as cpu_malloc
libc = ctypes.CDLL(None)
assert libc.mallopt(cpu_malloc.M_MMAP_THRESHOLD, 128 << 10) and libc.mallopt(cpu_malloc.M_TRIM_THRESHOLD, 128 << 10)
def step():
    xs = [torch.empty(6 << 20) for _ in range(4)]
    for x in xs:
        x.fill_(1.0)
    del xs
def faults():
    step()
    counts = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            step()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(counts)
start = faults()
from tiny_models import make_tiny_model
import paged_hf
model = make_tiny_model("llama")
paged_hf.patch(model)
engine = paged_hf.Engine(model, num_blocks=32, block_size=4, cpu_tune_malloc=(sys.argv[2] == "engine"))
print(json.dumps({"start": start, "faults": faults(), "status": cpu_malloc.status()}))
"""


def _run(mode: str, **env: str) -> dict:
    full = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GLIBC_TUNABLES", "PAGED_HF_CPU_MALLOC") and not k.startswith("MALLOC_")
    }
    full.update(env)
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(Path(__file__).resolve().parents[1]), mode],
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _glibc() -> bool:
    return cpu_malloc._glibc() is not None


needs_glibc = pytest.mark.skipif(
    not _glibc(), reason="mallopt is glibc's; elsewhere tune() does nothing"
)
START_FAULTS = 10 * 4 * 6144  # every page of the four 24 MiB blocks, 10 times


@needs_glibc
@pytest.mark.slow
def test_a_cpu_engine_keeps_freed_blocks_mapped_unless_told_not_to():
    off = _run("engine-off")
    on = _run("engine")
    assert on["start"] >= START_FAULTS and off["start"] >= START_FAULTS, (on, off)
    assert off["status"]["tuned"] is None and off["faults"] >= START_FAULTS, off
    assert on["status"] == {"tuned": True, "why": None, "kept_blocks": True}, on
    assert on["faults"] <= on["start"] // 4, on


# A large step's activations between small allocations that live on (what fragments glibc's heap: the
# next large block does not fit the hole a freed one left, the heap grows, new pages fault in), once
# with freed large blocks kept for the next step and once with none kept (PAGED_HF_CPU_KEEP_BYTES=0).
FRAGMENTING = r"""
import json, resource, sys
import torch
sys.path.insert(0, sys.argv[1])
from paged_hf.execution.cpu import malloc as cpu_malloc
assert cpu_malloc.tune()
def flt():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
keep, counts = [], []
for step in range(12):
    before = flt()
    for layer in range(30):
        h = torch.ones(4096, 576, dtype=torch.bfloat16)
        qkv = torch.ones(4096, 960, dtype=torch.bfloat16)
        a = torch.ones(4096, 576, dtype=torch.bfloat16)
        del qkv
        gu = torch.ones(4096, 3072, dtype=torch.bfloat16)
        s = torch.ones(4096, 1536, dtype=torch.bfloat16)
        del gu
        keep.append(torch.ones(16, 64))
        del h, a, s
    counts.append(flt() - before)
print(json.dumps({"faults": sum(counts[2:]), "status": cpu_malloc.status(),
                  "stats": torch.ops.paged_hf.kept_blocks_stats() if cpu_malloc.status()["kept_blocks"] else None}))
"""


@needs_glibc
@pytest.mark.slow
def test_large_blocks_are_kept_for_the_next_step():
    def run(**env):
        full = {
            k: v
            for k, v in os.environ.items()
            if k not in ("GLIBC_TUNABLES", "PAGED_HF_CPU_MALLOC", "PAGED_HF_CPU_KEEP_BYTES")
        }
        full.update(env)
        res = subprocess.run(
            [sys.executable, "-c", FRAGMENTING, str(Path(__file__).resolve().parents[1])],
            env=full,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    kept, none_kept = run(), run(PAGED_HF_CPU_KEEP_BYTES="0")
    # bytes waiting in their classes
    assert kept["status"]["kept_blocks"] and kept["stats"][0] > 0, kept
    assert none_kept["stats"][0] == 0, none_kept
    # every kept block served again: the small live ones' pages alone fault (16 x 64 fp32 a layer)
    assert kept["faults"] <= 1_000, kept
    assert none_kept["faults"] >= 10 * kept["faults"] + 10_000, (kept, none_kept)


@pytest.mark.parametrize(
    "env, why",
    [
        ({"PAGED_HF_CPU_MALLOC": "0"}, "PAGED_HF_CPU_MALLOC=0"),
        (
            {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"},
            "GLIBC_TUNABLES sets glibc's malloc",
        ),
        ({"MALLOC_ARENA_MAX_": "2"}, "MALLOC_ARENA_MAX_ is set"),
        (
            {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"},
            "tcmalloc is preloaded",
        ),
    ],
)
def test_a_process_that_chose_its_malloc_is_left_alone(monkeypatch, env, why):
    for k in [k for k in os.environ if k.startswith("MALLOC_")] + [
        "GLIBC_TUNABLES",
        "PAGED_HF_CPU_MALLOC",
    ]:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "")
    assert cpu_malloc.reason_to_leave_alone() is None
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(cpu_malloc, "_state", {"tuned": None, "why": None, "kept_blocks": False})
    assert cpu_malloc.tune() is False
    assert cpu_malloc.status() == {"tuned": False, "why": why, "kept_blocks": False}


def test_the_option_is_checked():
    from paged_hf.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_tune_malloc"):
        EngineConfig(cpu_tune_malloc="yes")


LRU = r"""
import json, resource, sys
import torch
sys.path.insert(0, sys.argv[1])
from paged_hf.execution.cpu import malloc as cpu_malloc
assert cpu_malloc.tune() and torch.ops.paged_hf.keep_large_blocks(48 << 20)  # a 48 MiB cap
def flt():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def churn(mib, n, rounds):
    before = flt()
    for _ in range(rounds):
        xs = [torch.ones(mib << 18) for _ in range(n)]  # mib MiB of fp32 each
        del xs
    return flt() - before
churn(10, 4, 1)                    # 40 MiB kept in 10-MiB classes
old = torch.ops.paged_hf.kept_blocks_stats()[0]
churn(13, 3, 1)                    # 13 MiB blocks: the 10 MiB ones kept longest go first
after = torch.ops.paged_hf.kept_blocks_stats()[0]
print(json.dumps({"old": old, "after": after, "faults": churn(13, 3, 5),
                  "trimmed": torch.ops.paged_hf.trim_kept_blocks(), "left": torch.ops.paged_hf.kept_blocks_stats()[0]}))
"""


@needs_glibc
def test_kept_blocks_make_room_for_the_classes_a_step_asks_for_now():
    """Past the cap the blocks kept longest go back first: a step whose token count moved (other size
    classes) keeps its own blocks, and they serve it again without faults; trim gives everything back."""
    res = subprocess.run(
        [sys.executable, "-c", LRU, str(Path(__file__).resolve().parents[1])],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "PAGED_HF_CPU_MALLOC"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["old"] == 40 << 20, got
    assert got["after"] == 3 * (14 << 20), got  # three 14-MiB-class blocks; the 10 MiB ones evicted
    assert got["faults"] < 100, got  # 5 rounds of 3 x 13 MiB served from the kept blocks
    assert got["trimmed"] == got["after"] and got["left"] == 0, got
