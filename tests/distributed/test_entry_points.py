"""The command line and the lm-eval backend with a tensor-parallel size (issue 57): ``paged-hf
generate --tp-size 2`` and lm-eval's ``model_args=...,tp_size=2`` on two CPU processes (as under
``torchrun --nproc-per-node 2``) give what one process gives: the same output file, written by
rank 0 alone, and the same metrics, reported by rank 0 alone (lm-eval's way under torchrun)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from spmd_launch import launch

from paged_hf.frontends import cli
from paged_hf.integrations import lm_eval as _registers_the_backend  # noqa: F401
from paged_hf.model.loading import LoadError, sharding

lm_eval = pytest.importorskip(
    "lm_eval", reason="the eval extra (lm-eval==0.4.13) is installed by make install"
)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from eval_tasks import write_tasks  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

WORKER = Path(__file__).with_name("entry_worker.py")
TASKS = ["phf_mc", "phf_gen"]
ROWS = ["hello world", "the cat sat on the mat", "x", "one two three"]


@pytest.fixture(scope="module")
def runs(tiny_llama_dir, tmp_path_factory):
    """(one process's output rows and metrics, the output file of the two ranks, their results)."""
    tmp = tmp_path_factory.mktemp("entry_points")
    data = tmp / "in.jsonl"
    data.write_text("".join(json.dumps({"prompt": r}) + "\n" for r in ROWS))
    tasks_dir = write_tasks(tmp / "tasks", n_mc=6, n_gen=4, n_rolling=1)
    argv = ["generate", "--model", str(tiny_llama_dir), "--input", str(data), "--dtype", "float32"]
    argv += ["--max-new-tokens", "6", "--no-progress"]
    model_args = f"pretrained={tiny_llama_dir},dtype=float32,max_length=128"
    assert cli.main(argv + ["--output", str(tmp / "alone.jsonl")]) == 0
    threads = torch.get_num_threads()
    try:
        alone = lm_eval.simple_evaluate(
            model="paged_hf",
            model_args=model_args,
            tasks=TASKS,
            task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
            device="cpu",
            batch_size=4,
        )["results"]
    finally:
        torch.set_num_threads(threads)
    job = {
        "cli": argv + ["--output", str(tmp / "ranks.jsonl")],
        "model_args": model_args,
        "tasks": TASKS,
        "tasks_dir": str(tasks_dir),
    }
    results = launch(WORKER, job, tmp)
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["loaded_tp"] == [2, 2], f"rank {rank}: the CLI's and lm-eval's model sharded"
    read = [json.loads(line) for line in (tmp / "alone.jsonl").read_text().splitlines()]
    ranks = [json.loads(line) for line in (tmp / "ranks.jsonl").read_text().splitlines()]
    return (read, alone), ranks, results


def test_the_command_line_writes_one_processs_rows(runs):
    (alone, _), ranks, results = runs
    assert [r["cli"] for r in results] == [0, 0]
    drop = {"generation_ttft"}  # a time
    assert [{k: v for k, v in row.items() if k not in drop} for row in ranks] == [
        {k: v for k, v in row.items() if k not in drop} for row in alone
    ]


def test_lm_eval_reports_one_processs_metrics_on_rank_zero(runs):
    (_, alone), _, results = runs
    assert results[1]["lm_eval"] is None  # rank 0 alone reports
    for task in TASKS:
        ours = {k: v for k, v in results[0]["lm_eval"][task].items() if "stderr" not in k}
        assert ours == {k: v for k, v in alone[task].items() if "stderr" not in k}, task


def test_a_tp_size_the_launch_cannot_hold_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(LoadError, match=r"--tp-size 2: .*multiple of 2 processes.*3 launched"):
        sharding(2, "--tp-size")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert sharding(2, "--tp-size")["distributed_config"].dp_replicate_size == 2
