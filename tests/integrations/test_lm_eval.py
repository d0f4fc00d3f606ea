"""lm-evaluation-harness backend (issue 12): ``--model paged_hf`` against lm-eval's own
transformers backend ``--model hf`` on local tasks the test writes (benchmarks/eval_tasks.py:
a 4-choice multiple-choice task, a few-shot generate_until task with ``until``, a rolling
loglikelihood task), both backends loading the model by name from the same directory.

float32 (a tiny llama with the tiny byte-level tokenizer, so it takes seconds): the same
metrics, and every request's result the same (loglikelihoods to 1e-4, since the two sum
float32 logprobs in different orders; the same is_greedy flags and generated text).
bfloat16 (SmolLM2): within the tolerance stated below. The command line runs in a subprocess
with a chat template.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

lm_eval = pytest.importorskip(
    "lm_eval", reason="the eval extra (lm-eval==0.4.13) is installed by make install"
)
from eval_tasks import write_tasks  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402
from tiny_tokenizer import make_tiny_tokenizer  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf.integrations.lm_eval import PagedHFLM, wrap  # noqa: E402
from paged_hf.integrations.lm_eval_engine import device_for  # noqa: E402

TASKS = ["phf_mc", "phf_gen", "phf_rolling"]
# max_length 128 for both backends: contexts are cut from the left as lm-eval cuts them, and
# the rolling task's texts span several windows
MODEL_ARGS = "pretrained={path},dtype={dtype},max_length=128"
# bfloat16: lm-eval's hf backend takes log_softmax in bfloat16 (an ulp is 0.06 at -10, and a
# choice sums 2-3 tokens) and the two attention kernels round differently. Measured here: the
# 32 choices' loglikelihoods differ by 0.17 at most; the tolerance is 0.3, and accuracy may move
# by one question in eight at most (a near-tie between two choices).
BF16_LL_TOL = 0.3


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    directory = write_tasks(tmp_path_factory.mktemp("tasks"), n_mc=10, n_gen=8, n_rolling=5)
    return TaskManager(include_path=str(directory), include_defaults=False), directory


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir):
    return tiny_llama_dir


def evaluate(model: str, path: Path, dtype: str, tasks: list[str], task_manager, **kwargs):
    threads = torch.get_num_threads()
    try:
        return lm_eval.simple_evaluate(
            model=model,
            model_args=MODEL_ARGS.format(path=path, dtype=dtype),
            tasks=tasks,
            task_manager=task_manager,
            device="cpu",
            batch_size=4,
            log_samples=True,
            **kwargs,
        )
    finally:
        torch.set_num_threads(threads)


def metrics(result: dict, task: str) -> dict:
    return {k: v for k, v in result["results"][task].items() if "," in k and "stderr" not in k}


@pytest.fixture(scope="module")
def fp32_runs(tiny_dir, task_manager):
    tm, _ = task_manager
    return {m: evaluate(m, tiny_dir, "float32", TASKS, tm) for m in ("paged_hf", "hf")}


def test_the_backend_is_registered_on_import():
    assert get_model("paged_hf") is PagedHFLM


def test_same_metrics_as_lm_evals_hf_backend_in_float32(fp32_runs):
    ours, theirs = fp32_runs["paged_hf"], fp32_runs["hf"]
    for task in ("phf_mc", "phf_gen"):
        assert metrics(ours, task) == metrics(theirs, task), task
    for name, value in metrics(theirs, "phf_rolling").items():
        assert metrics(ours, "phf_rolling")[name] == pytest.approx(value, rel=1e-5), name


def test_same_result_for_every_request_in_float32(fp32_runs):
    ours, theirs = fp32_runs["paged_hf"]["samples"], fp32_runs["hf"]["samples"]
    for task in TASKS:
        assert len(ours[task]) == len(theirs[task]) > 0
        for a, b in zip(ours[task], theirs[task]):
            assert a["doc_id"] == b["doc_id"]
            for ra, rb in zip(a["resps"], b["resps"]):
                if task == "phf_mc":
                    (lla, greedy_a), (llb, greedy_b) = ra[0], rb[0]
                    assert lla == pytest.approx(llb, abs=1e-4) and greedy_a == greedy_b
                elif task == "phf_gen":
                    assert ra == rb
                else:
                    assert ra[0] == pytest.approx(rb[0], abs=1e-3)
    assert any(s["resps"][0][0] for s in ours["phf_gen"])


@pytest.fixture(scope="module")
def tiny_hybrid_dir(tmp_path_factory):
    """A tiny Qwen3.5 (gated DeltaNet and attention layers) with the tiny tokenizer."""
    from paged_hf.model.support import build_tiny_model

    path = tmp_path_factory.mktemp("tiny_hybrid")
    build_tiny_model("qwen3_5_text").save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def test_a_hybrid_scores_as_lm_evals_hf_backend(tiny_hybrid_dir, task_manager):
    """Multiple choice and rolling loglikelihood on a hybrid model: every request's loglikelihood
    lm-eval's hf backend gets, to 1e-4, and so the same metrics."""
    tm, _ = task_manager
    runs = {
        m: evaluate(m, tiny_hybrid_dir, "float32", ["phf_mc", "phf_rolling"], tm)
        for m in ("paged_hf", "hf")
    }
    ours, theirs = runs["paged_hf"], runs["hf"]
    assert metrics(ours, "phf_mc") == metrics(theirs, "phf_mc")
    for name, value in metrics(theirs, "phf_rolling").items():
        assert metrics(ours, "phf_rolling")[name] == pytest.approx(value, rel=1e-5), name
    for task in ("phf_mc", "phf_rolling"):
        pairs = list(zip(ours["samples"][task], theirs["samples"][task]))
        assert pairs
        for a, b in pairs:
            for ra, rb in zip(a["resps"], b["resps"]):
                mine, theirs_ = (ra[0][0], rb[0][0]) if task == "phf_mc" else (ra[0], rb[0])
                assert mine == pytest.approx(theirs_, abs=1e-4 if task == "phf_mc" else 1e-3), (
                    task,
                    a["doc_id"],
                )


def test_bfloat16_smollm2_within_tolerance(smollm2_dir, task_manager):
    tm, _ = task_manager
    runs = {
        m: evaluate(m, smollm2_dir, "bfloat16", ["phf_mc"], tm, limit=8) for m in ("paged_hf", "hf")
    }
    ours, theirs = runs["paged_hf"], runs["hf"]
    worst = 0.0
    for a, b in zip(ours["samples"]["phf_mc"], theirs["samples"]["phf_mc"]):
        for ra, rb in zip(a["resps"], b["resps"]):
            worst = max(worst, abs(ra[0][0] - rb[0][0]))
    assert worst < BF16_LL_TOL
    for name in ("acc,none", "acc_norm,none"):
        assert abs(metrics(ours, "phf_mc")[name] - metrics(theirs, "phf_mc")[name]) <= 1 / 8 + 1e-9
    assert metrics(ours, "phf_mc")["acc,none"] > 0  # a real model: not every question missed


@pytest.mark.slow
def test_command_line_with_chat_template(tiny_dir, task_manager, tmp_path):
    """`paged-hf lm-eval` forwards to lm-eval's CLI (no --device: lm-eval asks for cuda:0, which
    falls back to the CPU as its hf backend does); with --apply_chat_template the prompts go
    through the tokenizer's chat template and the answers equal --model hf's."""
    _, directory = task_manager
    out = tmp_path / "out"
    args = [
        "--model_args",
        MODEL_ARGS.format(path=tiny_dir, dtype="float32"),
        "--tasks",
        "phf_gen",
        "--include_path",
        str(directory),
        "--limit",
        "3",
        "--apply_chat_template",
        "--log_samples",
        "--output_path",
        str(out),
        "--batch_size",
        "2",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "paged_hf", "lm-eval", "--model", "paged_hf", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "phf_gen" in proc.stdout and "exact_match" in proc.stdout
    samples = [
        json.loads(line)
        for f in out.rglob("samples_phf_gen_*.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert len(samples) == 3
    # chat-templated
    assert all("assistant:" in s["arguments"]["gen_args_0"]["arg_0"] for s in samples)
    tm, _ = task_manager
    ref = evaluate("hf", tiny_dir, "float32", ["phf_gen"], tm, limit=3, apply_chat_template=True)
    assert {s["doc_id"]: s["resps"] for s in samples} == {
        s["doc_id"]: s["resps"] for s in ref["samples"]["phf_gen"]
    }


def test_lm_evals_batch_size_and_device_are_interpreted():
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    assert (
        PagedHFLM(pretrained=model, tokenizer=tok, batch_size=16).engine.config.max_num_seqs == 16
    )
    assert (
        PagedHFLM(pretrained=model, tokenizer=tok, batch_size=1).engine.config.max_num_seqs == 128
    )
    assert (
        PagedHFLM(
            pretrained=model, tokenizer=tok, batch_size="auto", max_batch_size=32
        ).engine.config.max_num_seqs
        == 32
    )
    assert (
        PagedHFLM(
            pretrained=model, tokenizer=tok, batch_size=16, max_num_seqs=8
        ).engine.config.max_num_seqs
        == 8
    )
    lm = PagedHFLM(pretrained=model, tokenizer=tok, device="cuda:0", max_length=64)
    assert lm.device.type == "cpu" and lm.max_length == 64  # a model object stays where it is
    if not torch.cuda.is_available():
        assert device_for("cuda:0") == "cpu" and device_for(None) == "cpu"
    assert device_for("cpu") == "cpu"
    with pytest.raises(TypeError, match="unknown model_args"):
        PagedHFLM(pretrained=model, tokenizer=tok, not_an_option=1)
    with pytest.raises(ValueError, match="batch_size"):
        PagedHFLM(pretrained=model, tokenizer=tok, batch_size="large")


def test_wrap_a_loaded_model_and_refuse_what_it_cannot_honour():
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    patched = paged_hf.patch(model)
    lm = wrap(patched, tok)
    assert lm.engine is paged_hf.engine_for(patched)  # a patched model brings its own engine

    class Req:
        def __init__(self, *args):
            self.args = args

    with pytest.raises(NotImplementedError, match="num_beams"):
        lm.generate_until([Req("hello", {"until": ["\n"], "num_beams": 2})])
    (text,) = lm.generate_until([Req("hello", {"until": ["zz"], "max_gen_toks": 5})])
    assert isinstance(text, str)
    (ll,) = lm.loglikelihood([Req("hello", " world")])
    ref = paged_hf.Engine(make_tiny_model("llama"), tok).score([("hello", " world")])[0]
    assert ll[0] == pytest.approx(ref.logprob, abs=1e-5) and ll[1] == ref.is_greedy


def test_benchmark_script_runs_both_systems(tiny_dir, tmp_path):
    """benchmarks/bench_eval.py end to end on the tiny model: every field, both systems, and
    the token counts it prints. No timing is asserted."""
    out = tmp_path / "bench_eval.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_eval.py"),
            "--model",
            str(tiny_dir),
            "--dtype",
            "float32",
            "--n-mc",
            "4",
            "--n-gen",
            "2",
            "--rounds",
            "1",
            "--out",
            str(out),
            "--tasks-dir",
            str(tmp_path / "tasks"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["task"]: r for r in result["rows"]}
    assert set(rows) == {"phf_mc", "phf_gen"}
    for row in rows.values():
        assert set(row["median_s"]) == {"hf", "paged_hf"} and row["speedup"] > 0
        assert row["metrics"]["hf"] == row["metrics"]["paged_hf"]  # float32: the same answers
    tokens, ref = rows["phf_mc"]["prefill_tokens"], rows["phf_mc"]["reference_tokens"]
    assert (
        ref["one_context_per_question_plus_choices"]
        <= tokens["paged_hf"]
        < ref["one_context_per_choice"]
    )
    assert (
        "| multiple choice, 4 x 4 (loglikelihood) |" in proc.stdout
        and "prefill tokens" in proc.stdout
    )


def test_lm_evals_own_hf_backend_on_a_patched_model_object(tiny_dir, task_manager):
    """Existing code that builds lm-eval's HF backend on a model object (``HFLM(pretrained=model)``):
    its generate_until passes lm-eval's stop-sequence criteria to ``model.generate``; on a patched
    model every request's text is the unpatched model's."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tm, _ = task_manager
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    results = {}
    for name in ("unpatched", "patched"):
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
        if name == "patched":
            paged_hf.patch(model)
        threads = torch.get_num_threads()
        try:
            results[name] = lm_eval.simple_evaluate(
                model=HFLM(pretrained=model, tokenizer=tok, batch_size=4),
                tasks=["phf_gen"],
                task_manager=tm,
                log_samples=True,
            )
        finally:
            torch.set_num_threads(threads)
    ours, theirs = results["patched"], results["unpatched"]
    assert metrics(ours, "phf_gen") == metrics(theirs, "phf_gen")
    assert [s["resps"] for s in ours["samples"]["phf_gen"]] == [
        s["resps"] for s in theirs["samples"]["phf_gen"]
    ]
    assert any(s["resps"][0][0] for s in ours["samples"]["phf_gen"])


def test_prompt_lookup_comes_as_transformers_takes_it_in_gen_kwargs():
    """``--gen_kwargs prompt_lookup_num_tokens=10`` (lm-eval passes it to every generate_until
    request, as its hf backend passes it to ``generate``) reaches the rows' SamplingParams."""
    from paged_hf.integrations.lm_eval import _sampling_params

    params = _sampling_params({"prompt_lookup_num_tokens": "5"}, 16, ["\n\n"])
    assert params.prompt_lookup_num_tokens == 5 and params.stop == ("\n\n",)
    assert _sampling_params({}, 16, []).prompt_lookup_num_tokens == 0


def test_a_draft_model_arg_drafts_every_generate_until_request(tiny_dir, task_manager):
    """``--model_args ...,draft_model=NAME`` loads the draft as ``pretrained`` is loaded; every
    generate_until request drafts with it (``num_assistant_tokens`` 20 unless the gen kwargs say),
    and the responses are those of the run without it."""
    from paged_hf.integrations.lm_eval import _sampling_params

    tm, _ = task_manager
    plain = evaluate("paged_hf", tiny_dir, "float32", ["phf_gen"], tm, limit=3)
    lm = get_model("paged_hf").create_from_arg_string(
        MODEL_ARGS.format(path=tiny_dir, dtype="float32") + f",draft_model={tiny_dir}"
    )
    assert lm.engine.scheduler.drafter is not None
    drafted = lm_eval.simple_evaluate(
        model=lm,
        tasks=["phf_gen"],
        task_manager=tm,
        device="cpu",
        batch_size=4,
        log_samples=True,
        limit=3,
    )
    assert [s["resps"] for s in drafted["samples"]["phf_gen"]] == [
        s["resps"] for s in plain["samples"]["phf_gen"]
    ]
    drafter = object()  # what the backend passes when its engine has a draft model
    assert _sampling_params({}, 16, [], drafter).num_assistant_tokens == 20
    assert (
        _sampling_params({"num_assistant_tokens": "6"}, 16, [], drafter).num_assistant_tokens == 6
    )
    lookup = _sampling_params({"prompt_lookup_num_tokens": "4"}, 16, [], drafter)
    assert lookup.num_assistant_tokens == 0 and lookup.prompt_lookup_num_tokens == 4
