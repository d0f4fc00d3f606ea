"""One rank of the tensor-parallel fault tests (tests/distributed/test_rank_faults.py): every
rank loads and patches the tiny llama, then rank 1's forward fails (``"fault": "raise"``) or
rank 1 dies (``"kill"``) at its second step; what the call returned or raised on each surviving
rank, how long it took, and what the next call did, go to ``<out>/rank<RANK>.json``."""

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# the model's process group as the tests start it: long enough that a rank waiting for it to
# time out would show as a slow test (the ranks must fail each other at once instead)
GROUP_TIMEOUT_S = 60


def outcome(call) -> dict:
    t0 = time.perf_counter()
    try:
        value = {"value": call()}
    except Exception as e:  # noqa: BLE001 - what each rank raised is the test's to compare
        value = {"raised": f"{type(e).__name__}: {e}"}
    return value | {"seconds": time.perf_counter() - t0}


def inject(runner, fault: str) -> None:
    """Rank 1's runner fails its second forward: raises, or ends the process."""
    forward, calls = runner.execute, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            if fault == "kill":
                os._exit(3)
            raise RuntimeError("injected: rank 1's forward failed")
        return forward(*args, **kwargs)

    runner.execute = failing


def run(job: dict, rank: int) -> dict:
    from transformers import AutoModelForCausalLM, DistributedConfig

    import paged_hf

    model = AutoModelForCausalLM.from_pretrained(
        job["path"], distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32
    )
    paged_hf.patch(model)
    engine = paged_hf.Engine(model, tp_timeout_s=job["tp_timeout_s"])
    if rank == 1:
        inject(engine.runner, job["fault"])
    params = paged_hf.SamplingParams(max_new_tokens=job["max_new_tokens"])
    out = {"call": outcome(lambda: [o.error for o in engine.generate(job["prompts"], params)])}
    out["next"] = outcome(lambda: [o.error for o in engine.generate(job["prompts"], params)])
    out["blocks_used"] = engine.stats()["blocks_used"]
    out["requests_left"] = len(engine.requests)
    return out


def main() -> None:
    job, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    try:
        result = run(job, rank)
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        result = {"error": traceback.format_exc()}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # the model's group may be gone: no teardown collective to wait on


if __name__ == "__main__":
    main()
