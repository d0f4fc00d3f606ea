"""Start a worker script on several CPU processes as ``torchrun`` would (gloo; the variables
transformers' tensor parallelism reads) and collect what each rank wrote to ``rank<R>.json``.
A rank that fails, or a launch past its timeout, fails the calling test with every rank's log."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import paged_hf

PACKAGE_ROOT = str(Path(paged_hf.__file__).resolve().parents[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    worker: Path,
    job: object,
    tmp: Path,
    world: int = 2,
    timeout_s: float = 240,
    exits: dict[int, int] | None = None,
) -> list:
    """Run ``python worker JOB_JSON TMP`` on ``world`` ranks; each rank's ``rank<R>.json`` (None
    for a rank ``exits`` expects to end with its exit code, killed on purpose)."""
    exits = exits or {}
    (tmp / "job.json").write_text(json.dumps(job))
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            OMP_NUM_THREADS="1",
            # the paged_hf this process imported, wherever it came from
            PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")])),
        )
        with open(tmp / f"rank{rank}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(worker), str(tmp / "job.json"), str(tmp)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

    def output() -> str:
        return "\n".join(
            f"--- rank {r} (exit {p.returncode}) ---\n" + (tmp / f"rank{r}.log").read_text()[-4000:]
            for r, p in enumerate(procs)
        )

    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        pytest.fail(f"the ranks ran past {timeout_s} s\n{output()}")
    if any(p.returncode != exits.get(r, 0) for r, p in enumerate(procs)):
        pytest.fail(f"a rank failed\n{output()}")
    return [
        None if r in exits else json.loads((tmp / f"rank{r}.json").read_text())
        for r in range(world)
    ]
