"""One rank of the tensor-parallel fault tests (tests/distributed/test_rank_faults.py): every
rank loads and patches the tiny llama, then rank 1's forward fails (``"fault": "raise"``) or
rank 1 dies (``"kill"``) at its second step; what the call returned or raised on each surviving
rank, how long it took, and what the next call did, go to ``<out>/rank<RANK>.json``."""

import os

import torch
from rank_main import main, outcome

# the model's process group as the tests start it: long enough that a rank waiting for it to
# time out would show as a slow test (the ranks must fail each other at once instead)
GROUP_TIMEOUT_S = 60


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
    out = {
        "call": outcome(
            timed=True, call=lambda: [o.error for o in engine.generate(job["prompts"], params)]
        )
    }
    out["next"] = outcome(
        timed=True, call=lambda: [o.error for o in engine.generate(job["prompts"], params)]
    )
    out["blocks_used"] = engine.stats()["blocks_used"]
    out["requests_left"] = len(engine.requests)
    return out


if __name__ == "__main__":
    main(run, GROUP_TIMEOUT_S, exit_at_once=True)
