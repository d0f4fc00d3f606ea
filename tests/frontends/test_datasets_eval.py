"""generate_dataset: order, companions, per-row params, chat messages, resume after SIGKILL,
refusal of a changed resume, and the 2-process accelerate run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
import torch
from dataset_eval_worker import columns, eval_setup

import paged_hf
from paged_hf import SamplingParams

HERE = Path(__file__).resolve().parents[1]  # tests/
WORKER = HERE / "dataset_eval_worker.py"
ROWS = 200
MAX_NUM_SEQS = 16
PARAMS = SamplingParams(max_new_tokens=12)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    return eval_setup(ROWS)


@pytest.fixture(scope="module")
def reference(setup):
    """The uninterrupted single-process run every other run must reproduce."""
    model, tokenizer, dataset = setup
    return columns(
        paged_hf.generate_dataset(
            model,
            tokenizer,
            dataset,
            sampling_params=PARAMS,
            progress=False,
            max_num_seqs=MAX_NUM_SEQS,
        )
    )


def _without_ttft(cols: dict) -> dict:
    return {k: v for k, v in cols.items() if not k.endswith("_ttft")}


def _good_rows(results: Path) -> list[int]:
    """The rows of a results file that finished well, sorted, each as often as it was written."""
    recs = [json.loads(line) for line in results.read_text().splitlines()]
    return sorted(r["row_index"] for r in recs if r["finish_reason"] != "error")


def _good_rows_of(cols: dict) -> list[int]:
    return [i for i, reason in enumerate(cols["generation_finish_reason"]) if reason != "error"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_order_and_companions_on_200_rows(setup, reference):
    model, tokenizer, dataset = setup
    assert list(reference) == [
        "id",
        "prompt",
        "generation",
        "generation_num_tokens",
        "generation_finish_reason",
        "generation_ttft",
        "generation_error",
    ]
    assert reference["id"] == [f"q{i}" for i in range(ROWS)] and reference["prompt"] == list(
        dataset["prompt"]
    )
    # the same prompts through Engine.generate, an independent path that keeps order; text prompts go
    # through the chat template as one user message (the default)
    chat = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
        if p
        else p
        for p in dataset["prompt"]
    ]
    expected = paged_hf.Engine(model, tokenizer, max_num_seqs=MAX_NUM_SEQS).generate(chat, PARAMS)
    for i, out in enumerate(expected):
        if out.error:
            assert (
                reference["generation"][i] == ""
                and reference["generation_finish_reason"][i] == "error"
            )
            assert (
                reference["generation_num_tokens"][i] == 0
                and reference["generation_ttft"][i] is None
            )
            assert reference["generation_error"][i] == f"row {i}: ValueError: empty prompt"
        else:
            assert reference["generation"][i] == out.text, i
            assert reference["generation_num_tokens"][i] == len(out.token_ids)
            assert reference["generation_finish_reason"][i] == out.finish_reason
            assert reference["generation_ttft"][i] > 0 and reference["generation_error"][i] is None
    # the empty prompts; the rest ran
    assert reference["generation_finish_reason"].count("error") == 4
    assert {"stop", "length"} <= set(reference["generation_finish_reason"])
    lengths = [len(p) for p in dataset["prompt"]]
    assert min(lengths) == 0 and max(lengths) > 150  # varied lengths

    # a shuffled view keeps its own order, with a progress bar on
    shuffled = dataset.select(list(reversed(range(40))))
    out = paged_hf.generate_dataset(
        model, tokenizer, shuffled, sampling_params=PARAMS, progress=True, max_num_seqs=4
    )
    assert list(out["id"]) == [f"q{i}" for i in reversed(range(40))]
    assert list(out["generation"]) == reference["generation"][:40][::-1]


def test_messages_and_per_row_params(setup):
    model, tokenizer, _ = setup
    ds = datasets.Dataset.from_dict(
        {
            "messages": [
                [{"role": "user", "content": "hello there"}],
                [{"role": "user", "content": "café"}],
                [],
            ],
            "params": [{"max_new_tokens": 3}, {"temperature": 1.0}, None],
        }
    )
    out = paged_hf.generate_dataset(
        model,
        tokenizer,
        ds,
        messages_column="messages",
        params_column="params",
        output_column="answer",
        sampling_params=PARAMS,
        progress=False,
    )
    assert out.column_names == [
        "messages",
        "params",
        "answer",
        "answer_num_tokens",
        "answer_finish_reason",
        "answer_ttft",
        "answer_error",
    ]
    assert out["answer_num_tokens"][0] == 3 and out["answer_finish_reason"][2] == "error"
    assert out["answer_error"] == [None, None, "row 2: ValueError: no chat messages"]
    text = tokenizer.apply_chat_template(
        ds[0]["messages"], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    engine = paged_hf.Engine(model, tokenizer)
    assert out["answer"][0] == engine.generate([ids], PARAMS.with_(max_new_tokens=3))[0].text
    # sampling rows without a seed of their own use seed + row index: reruns agree
    again = paged_hf.generate_dataset(
        model,
        tokenizer,
        ds,
        messages_column="messages",
        params_column="params",
        output_column="answer",
        sampling_params=PARAMS,
        progress=False,
        max_num_seqs=1,
    )
    assert list(again["answer"]) == list(out["answer"])

    bad = datasets.Dataset.from_dict({"prompt": ["a b", "c"], "p": [{"top_p": 5.0}, {"nope": 1}]})
    out = paged_hf.generate_dataset(
        model, tokenizer, bad, params_column="p", sampling_params=PARAMS, progress=False
    )
    assert list(out["generation_finish_reason"]) == ["error", "error"]
    assert (
        out["generation_error"][0].startswith("row 0: ValueError: ")
        and "top_p" in out["generation_error"][0]
    )
    assert (
        out["generation_error"][1] == "row 1: ValueError: unknown SamplingParams field(s) ['nope']"
    )
    with pytest.raises(ValueError, match="already has column"):
        paged_hf.generate_dataset(model, tokenizer, out, sampling_params=PARAMS, progress=False)
    with pytest.raises(ValueError, match="prompt_column='text' is not a column"):
        paged_hf.generate_dataset(model, tokenizer, bad, prompt_column="text", progress=False)
    with pytest.raises(ValueError, match="n=2"):
        paged_hf.generate_dataset(
            model, tokenizer, bad, sampling_params=SamplingParams(n=2), progress=False
        )


def test_sigkill_midway_then_resume_is_identical(setup, reference, tmp_path):
    model, tokenizer, dataset = setup
    ckpt = tmp_path / "ckpt"
    results = ckpt / "results-0.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(WORKER),
            str(tmp_path / "killed.json"),
            "--checkpoint-dir",
            str(ckpt),
            "--rows",
            str(ROWS),
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--step-delay",
            "0.02",
        ],
        env=_env(),
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            if results.exists() and results.read_bytes().count(b"\n") >= 40:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the worker ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    written = results.read_bytes().count(b"\n")
    assert 40 <= written < ROWS
    before = {
        json.loads(line)["row_index"]: json.loads(line) for line in results.read_text().splitlines()
    }

    resumed = paged_hf.generate_dataset(
        model,
        tokenizer,
        dataset,
        sampling_params=PARAMS,
        checkpoint_dir=ckpt,
        progress=False,
        max_num_seqs=MAX_NUM_SEQS,
    )
    assert _without_ttft(columns(resumed)) == _without_ttft(reference)
    # finished rows were skipped (their ttft is the killed run's), and none is written twice
    for i, rec in before.items():
        if rec["finish_reason"] != "error":
            assert resumed["generation_ttft"][i] == rec["ttft"]
    assert _good_rows(results) == _good_rows_of(reference)
    lines = results.read_text().count("\n")

    # a third run with the same arguments reads everything back and runs only the errored rows again
    again = paged_hf.generate_dataset(
        model,
        tokenizer,
        dataset,
        sampling_params=PARAMS,
        checkpoint_dir=ckpt,
        progress=False,
        max_num_seqs=MAX_NUM_SEQS,
    )
    assert columns(again) == columns(resumed)
    appended = [json.loads(line) for line in results.read_text().splitlines()[lines:]]
    assert sorted(r["row_index"] for r in appended) == [7, 57, 107, 157]
    assert {r["finish_reason"] for r in appended} == {"error"}


def test_torn_last_line_is_dropped_and_rerun(setup, reference, tmp_path):
    model, tokenizer, dataset = setup
    small = dataset.select(range(30))
    ckpt = tmp_path / "ckpt"
    full = columns(
        paged_hf.generate_dataset(
            model, tokenizer, small, sampling_params=PARAMS, checkpoint_dir=ckpt, progress=False
        )
    )
    results = ckpt / "results-0.jsonl"
    lines = results.read_text().splitlines(keepends=True)
    assert len(lines) == 30
    results.write_text("".join(lines[:20]) + lines[20][: len(lines[20]) // 2])  # killed mid-write
    resumed = columns(
        paged_hf.generate_dataset(
            model, tokenizer, small, sampling_params=PARAMS, checkpoint_dir=ckpt, progress=False
        )
    )
    assert _without_ttft(resumed) == _without_ttft(full)
    assert resumed["generation"] == reference["generation"][:30]
    assert _good_rows(results) == [
        i for i in range(30) if i != 7
    ]  # row 7 (empty prompt) ran again, as errors do


def test_resume_with_changed_arguments_is_refused(setup, tmp_path):
    model, tokenizer, dataset = setup
    small = dataset.select(range(10))
    ckpt = tmp_path / "ckpt"
    paged_hf.generate_dataset(
        model, tokenizer, small, sampling_params=PARAMS, checkpoint_dir=ckpt, progress=False
    )
    cases = [
        (dict(sampling_params=PARAMS.with_(max_new_tokens=5)), "sampling_params"),
        (dict(dataset=dataset.select(range(11))), "dataset"),
        (dict(model=_other_model()), "model"),
        (dict(output_column="out"), "columns"),
    ]
    for change, what in cases:
        kwargs = dict(
            model=model,
            tokenizer=tokenizer,
            dataset=small,
            sampling_params=PARAMS,
            checkpoint_dir=ckpt,
            progress=False,
        )
        kwargs.update(change)
        with pytest.raises(ValueError, match=f"different arguments \\({what}: "):
            paged_hf.generate_dataset(**kwargs)
    # the same arguments still resume
    paged_hf.generate_dataset(
        model, tokenizer, small, sampling_params=PARAMS, checkpoint_dir=ckpt, progress=False
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _other_model():
    from tiny_models import make_tiny_model

    return make_tiny_model("llama", seed=1)  # same config and name, other weights


ACCELERATE = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which(
    "accelerate"
)


@pytest.mark.skipif(ACCELERATE is None, reason="the accelerate CLI is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the CPU (gloo) launch")
@pytest.mark.slow
def test_two_process_accelerate_run_equals_one_process(setup, reference, tmp_path):
    out = tmp_path / "out.json"
    # `--cpu` alone starts one process (accelerate wants MPI for several); on a machine without
    # CUDA, --multi_gpu starts K processes through torchrun and generate_dataset joins them with gloo.
    cmd = [
        ACCELERATE,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
        str(WORKER),
        str(out),
        "--rows",
        str(ROWS),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads(out.read_text())
    assert _without_ttft(merged) == _without_ttft(reference)
    shard = json.loads(Path(f"{out}.rank1").read_text())  # rank 1 returns its own shard
    assert shard["id"] == reference["id"][ROWS // 2 :]
    assert shard["generation"] == reference["generation"][ROWS // 2 :]
    # each rank checkpointed its own rows; one process resumes from both files and runs nothing
    for rank in (0, 1):
        lines = (tmp_path / "ckpt" / f"results-{rank}.jsonl").read_text().splitlines()
        half = ROWS // 2
        assert sorted(json.loads(line)["row_index"] for line in lines) == list(
            range(rank * half, (rank + 1) * half)
        )
    model, tokenizer, dataset = setup
    resumed = paged_hf.generate_dataset(
        model,
        tokenizer,
        dataset,
        sampling_params=PARAMS,
        progress=False,
        checkpoint_dir=tmp_path / "ckpt",
        max_num_seqs=MAX_NUM_SEQS,
    )
    assert columns(resumed) == merged
    lines = (tmp_path / "ckpt" / "results-0.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["row_index"] for line in lines[ROWS // 2 :]) == [
        7,
        57,
        107,
        157,
    ]  # errors rerun
