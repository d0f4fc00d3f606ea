"""What the tensor-parallel test workers share: one rank's main (the gloo group as torchrun's
variables describe it, the worker's ``run(job, rank)``, its result or traceback written to
``<out>/rank<RANK>.json``), a call's outcome as JSON, and ``generate_dataset`` run twice."""

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny models, tokenizer


def main(run, timeout_s: float = 30, exit_at_once: bool = False) -> None:
    """``python WORKER JOB_JSON OUT_DIR``: a collective one rank never reaches fails after
    ``timeout_s`` instead of transformers' two hours. ``exit_at_once``: no teardown collective
    (the model's group may be gone)."""
    job, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = run(job, rank)
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        result = {"error": traceback.format_exc()}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if exit_at_once:
        os._exit(0)
    dist.destroy_process_group()


def outcome(call, timed: bool = False) -> dict:
    """What ``call()`` returned (``value``) or raised (``raised``), and with ``timed`` its seconds."""
    t0 = time.perf_counter()
    try:
        value = {"value": call()}
    except Exception as e:  # noqa: BLE001 - what each rank raised is the test's to compare
        value = {"raised": f"{type(e).__name__}: {e}"}
    return value | ({"seconds": time.perf_counter() - t0} if timed else {})


def dataset_runs(model, job: dict, columns: tuple[str, ...]) -> dict:
    """``generate_dataset`` over ``job["texts"]`` on every rank, then again from its checkpoint
    (every row restored): each run's ``columns`` of what this rank returned, or what it raised."""
    from datasets import Dataset
    from tiny_tokenizer import make_tiny_tokenizer

    import paged_hf

    rows = Dataset.from_dict({"prompt": job["texts"]})
    params = paged_hf.SamplingParams(max_new_tokens=job["max_new_tokens"])

    def run() -> list:
        result = paged_hf.generate_dataset(
            model,
            make_tiny_tokenizer(),
            rows,
            sampling_params=params,
            checkpoint_dir=job["checkpoint_dir"],
            progress=False,
        )
        return [list(result[column]) for column in columns]

    return {"dataset": outcome(run), "dataset_resumed": outcome(run)}
