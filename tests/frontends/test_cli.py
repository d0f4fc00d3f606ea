"""The paged-hf command: generate over a JSON-lines file (resumable), bench forwarding, -m."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model
from tiny_tokenizer import make_tiny_tokenizer

import paged_hf
from paged_hf.frontends import cli
from paged_hf.frontends import dataset_generation as cli_dataset


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


def test_generate_from_jsonl(model_dir, tmp_path):
    rows = [
        {"question": "hello world", "k": 1},
        {"question": "", "k": 2},
        {"question": "café 東京", "k": 3},
    ]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--input",
        str(data),
        "--prompt-column",
        "question",
        "--output",
        str(out),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--max-new-tokens",
        "5",
        "--max-num-seqs",
        "4",
        "--dtype",
        "float32",
        "--no-progress",
    ]
    assert cli.main(argv) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["k"] for r in got] == [1, 2, 3]
    assert got[1]["generation_finish_reason"] == "error" and got[1]["generation"] == ""
    assert (
        got[1]["generation_error"] == "row 1: ValueError: empty prompt"
        and got[0]["generation_error"] is None
    )
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    params = paged_hf.SamplingParams(max_new_tokens=5)
    # the default: each prompt one user message through the chat template
    chat = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
        for q in ("hello world", "café 東京")
    ]
    ref = paged_hf.Engine(model, tok).generate(chat, params)
    assert [got[0]["generation"], got[2]["generation"]] == [r.text for r in ref]
    assert got[0]["generation_num_tokens"] == len(ref[0].token_ids)
    raw_out = tmp_path / "raw.jsonl"
    raw_argv = [
        a if a != str(out) else str(raw_out)
        for a in argv
        if a not in ("--checkpoint-dir", str(tmp_path / "ckpt"))
    ]
    assert cli.main(raw_argv + ["--raw"]) == 0
    raw = [json.loads(line) for line in raw_out.read_text().splitlines()]
    ref_raw = paged_hf.Engine(model, tok).generate(["hello world", "café 東京"], params)
    assert [raw[0]["generation"], raw[2]["generation"]] == [r.text for r in ref_raw]

    assert cli.main(argv) == 0  # resumed from the checkpoint: same file
    assert [json.loads(line) for line in out.read_text().splitlines()] == got
    assert cli.main(argv[:-3] + ["--max-new-tokens", "6", "--no-progress"]) == 2  # changed: refused


def test_bad_arguments_fail_cleanly(model_dir, tmp_path, capsys):
    assert (
        cli.main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--input",
                str(tmp_path / "nope.jsonl"),
                "--output",
                str(tmp_path / "o.jsonl"),
            ]
        )
        == 2
    )
    assert "no such file" in capsys.readouterr().err
    assert (
        cli.main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--input",
                str(model_dir / "config.json"),
                "--output",
                str(tmp_path / "o.jsonl"),
                "--temperature",
                "-1",
            ]
        )
        == 2
    )
    assert "temperature" in capsys.readouterr().err


def test_bench_forwards_arguments(tmp_path, monkeypatch, capsys):
    script = tmp_path / "bench.py"
    script.write_text(
        "import sys\nprint('ARGS', sys.argv[1:])\nsys.exit(3 if '--fail' in sys.argv else 0)\n"
    )
    monkeypatch.setattr(cli, "bench_script", lambda: script)
    assert cli.main(["bench", "--quick", "--n", "4"]) == 0
    assert "ARGS ['--quick', '--n', '4']" in capsys.readouterr().out
    assert cli.main(["bench", "--fail"]) == 3
    monkeypatch.setattr(cli, "bench_script", lambda: tmp_path / "missing.py")
    assert cli.main(["bench"]) == 2
    assert "source checkout" in capsys.readouterr().err


def test_python_dash_m(monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", ["paged_hf", "generate", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("paged_hf", run_name="__main__")
    assert exit_.value.code == 0 and "--checkpoint-dir" in capsys.readouterr().out


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _generate(model_dir, data, out, *extra) -> int:
    return cli.main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--input",
            str(data),
            "--output",
            str(out),
            "--max-new-tokens",
            "2",
            "--dtype",
            "float32",
            "--no-progress",
            *extra,
        ]
    )


def _error(capsys) -> str:
    """The error message the command printed (after any progress bars of datasets)."""
    err = capsys.readouterr().err
    assert "\npaged-hf: error: " in "\n" + err and "Traceback" not in err, err
    return err[err.index("paged-hf: error: ") :]


def test_output_path_is_checked_before_the_model_loads(model_dir, tmp_path, monkeypatch, capsys):
    def load_model(*args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "load_model", load_model)
    data = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hello"}])
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "file").write_text("")
    cases = [
        (tmp_path / "out.txt", "unknown file type '.txt'"),
        (tmp_path / "dir.jsonl", "is a directory"),
        (tmp_path / "file" / "out.jsonl", "cannot write"),
    ]
    for out, message in cases:
        assert _generate(model_dir, data, out) == 2
        err = _error(capsys)
        assert f"--output {out}" in err and message in err, err
    assert (tmp_path / "file").read_text() == ""

    # a good path passes the check without a trace: an existing file is not truncated, a new one is removed
    monkeypatch.undo()
    existing = tmp_path / "existing.jsonl"
    existing.write_text("keep me\n")
    new = tmp_path / "new" / "deeper" / "out.csv"
    for out in (existing, new):
        assert _generate(tmp_path / "missing", data, out) == 2  # refused after the output check
        assert "--model" in _error(capsys)
    assert existing.read_text() == "keep me\n" and not (tmp_path / "new").exists()


def test_malformed_jsonl_input_fails_cleanly(model_dir, tmp_path, capsys):
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": \n')
    assert _generate(model_dir, data, tmp_path / "o.jsonl") == 2
    err = _error(capsys)
    assert f"--input {data}" in err and "JSON parse error" in err, err


def test_empty_input_fails_cleanly(model_dir, tmp_path, capsys):
    for name, text in [("in.jsonl", ""), ("blank.jsonl", "\n\n"), ("in.csv", "prompt\n")]:
        data = tmp_path / name
        data.write_text(text)
        assert _generate(model_dir, data, tmp_path / "o.jsonl") == 2
        err = _error(capsys)
        assert f"--input {data}" in err and "no rows" in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_negative_limit_fails_cleanly(model_dir, tmp_path, capsys):
    data = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hello"}])
    assert _generate(model_dir, data, tmp_path / "o.jsonl", "--limit", "-1") == 2
    assert "--limit -1: must be >= 0" in _error(capsys)
    assert not (tmp_path / "o.jsonl").exists()


def test_bad_model_fails_cleanly(model_dir, tmp_path, capsys):
    data = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hello"}])
    (tmp_path / "empty").mkdir()
    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    (not_a_model / "config.json").write_text('{"hello": 1}')
    for model, message in [
        (tmp_path / "missing", "no such directory"),
        (tmp_path / "empty", "cannot load"),
        (not_a_model, "cannot load"),
    ]:
        assert _generate(model, data, tmp_path / "o.jsonl") == 2
        err = _error(capsys)
        assert f"--model {model}: {message}" in err, err


def test_bad_tokenizer_fails_cleanly(model_dir, tmp_path, capsys):
    data = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hello"}])
    (tmp_path / "empty").mkdir()
    for tokenizer, message in [
        (tmp_path / "missing", "no such directory"),
        (tmp_path / "empty", "cannot load"),
    ]:
        assert _generate(model_dir, data, tmp_path / "o.jsonl", "--tokenizer", str(tokenizer)) == 2
        err = _error(capsys)
        assert f"--tokenizer {tokenizer}: {message}" in err, err


def test_the_readme_cli_lines_answer_on_topic(tmp_path):
    """The README's two `paged-hf generate` lines, as written, on the shipped SmolLM2: chat-templated
    answers (none empty; Paris for France's capital, 4 for 2 + 2), then JSON under the example schema.
    (Not Rome for Italy's: the model's own answer, transformers' fp32 generate, is "Il Coriobella,
    Italy.", and bf16 runs that order their sums differently end up elsewhere, Rome among them.)"""
    import re
    import shlex

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = [
        line for line in readme.splitlines() if line.startswith("paged-hf generate --model default")
    ]
    assert len(lines) == 2, lines
    repo = Path(__file__).resolve().parents[2]
    results = []
    for line in lines:
        argv = shlex.split(line)[1:]
        out = tmp_path / argv[argv.index("--output") + 1]
        argv[argv.index("--output") + 1] = str(out)
        for flag in ("--input", "--json-schema"):
            if flag in argv:
                argv[argv.index(flag) + 1] = str(repo / argv[argv.index(flag) + 1])
        assert cli.main(argv + ["--no-progress"]) == 0
        results.append([json.loads(row) for row in out.read_text().splitlines()])
    plain, structured = results
    questions = [
        json.loads(row)["prompt"]
        for row in (repo / "examples" / "questions.jsonl").read_text().splitlines()
    ]
    assert all(len(r["generation"].split()) >= 2 for r in plain), [r["generation"] for r in plain]
    assert "Paris" in plain[questions.index("What is the capital of France?")]["generation"]
    assert "4" in plain[questions.index("What is 2 + 2?")]["generation"]
    schema = json.loads((repo / "examples" / "answer_schema.json").read_text())
    for r in structured:
        value = json.loads(r["generation"])
        assert r["generation_finish_reason"] == "stop" and set(value) == set(schema["required"])
        assert value["confidence"] in schema["properties"]["confidence"]["enum"]
        assert len(value["answer"]) <= schema["properties"]["answer"]["maxLength"]
    assert re.search(
        r"Paris", structured[questions.index("What is the capital of France?")]["generation"]
    )
    assert re.search(r"\b4\b", structured[questions.index("What is 2 + 2?")]["generation"])


def test_scheduling_policy_reaches_the_engine_options(tmp_path):
    base = [
        "generate",
        "--model",
        "m",
        "--input",
        "in.jsonl",
        "--output",
        str(tmp_path / "o.jsonl"),
    ]
    args = cli._parser().parse_args(base + ["--scheduling-policy", "priority"])
    _, engine_config = cli._options(args)
    assert engine_config["scheduling_policy"] == "priority"
    _, engine_config = cli._options(cli._parser().parse_args(base))
    assert "scheduling_policy" not in engine_config


def test_kv_cache_dir_keeps_prompt_kv_for_the_next_run(model_dir, tmp_path):
    """Two runs with --kv-cache-dir: the first writes records, the second gives the same output
    (its prefill read from them, which tests/engine/test_kv_tiers.py checks token by token)."""
    data = tmp_path / "in.jsonl"
    rows = [{"q": "a longer question about the weather in the mountains " * 2}, {"q": "hi " * 20}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kv_dir = tmp_path / "kv"

    def run(out):
        argv = ["generate", "--model", str(model_dir), "--input", str(data), "--prompt-column"]
        argv += ["q", "--output", str(out), "--max-new-tokens", "4", "--dtype", "float32"]
        argv += ["--no-progress", "--kv-cache-dir", str(kv_dir), "--kv-cache-dir-bytes", "10000000"]
        assert cli.main(argv) == 0
        return [json.loads(line)["generation"] for line in out.read_text().splitlines()]

    first = run(tmp_path / "a.jsonl")
    assert list(kv_dir.rglob("*.kv")), "the first run wrote records"
    assert run(tmp_path / "b.jsonl") == first
    args = cli._parser().parse_args(
        ["generate", "--model", "m", "--input", "i.jsonl", "--output", str(tmp_path / "o.jsonl")]
    )
    assert "kv_cache_dir" not in cli._options(args)[1]


def test_batch_invariant_flag_reaches_the_engine_config(tmp_path):
    base = ["generate", "--model", "m", "--input", "i.jsonl", "--output", str(tmp_path / "o.jsonl")]
    assert "batch_invariant" not in cli._options(cli._parser().parse_args(base))[1]
    _, engine_config = cli._options(cli._parser().parse_args(base + ["--batch-invariant"]))
    assert engine_config["batch_invariant"] is True


def test_prompt_lookup_reaches_the_rows_and_what_it_cannot_run_is_refused(
    model_dir, tmp_path, monkeypatch, capsys
):
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "a b a b a b"}\n')
    argv = ["generate", "--model", str(model_dir), "--input", str(data), "--no-progress"]
    argv += ["--output", str(tmp_path / "o.jsonl"), "--prompt-lookup-num-tokens", "4"]
    seen = []
    run = cli_dataset.generate_dataset

    def recording(*args, **kwargs):
        seen.append(kwargs["sampling_params"])
        return run(*args, **kwargs)

    monkeypatch.setattr(cli_dataset, "generate_dataset", recording)
    assert cli.main(argv) == 0
    assert seen[0].prompt_lookup_num_tokens == 4
    assert cli.main(argv + ["--repetition-penalty", "1.2"]) == 2
    assert "prompt_lookup_num_tokens with repetition_penalty" in capsys.readouterr().err


def test_a_draft_model_reaches_the_engine_and_leaves_the_rows_as_they_were(
    model_dir, tmp_path, monkeypatch
):
    """``--draft-model`` loads the draft as --model is loaded and the rows draft with it (up to
    --num-assistant-tokens); the tokens are the plain run's."""
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "a b a b a b"}\n{"prompt": "one two three"}\n')
    argv = ["generate", "--model", str(model_dir), "--input", str(data), "--no-progress"]
    argv += ["--max-new-tokens", "12", "--dtype", "float32"]
    seen = []
    run = cli_dataset.generate_dataset

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return run(*args, **kwargs)

    monkeypatch.setattr(cli_dataset, "generate_dataset", recording)
    plain, drafted = tmp_path / "plain.jsonl", tmp_path / "drafted.jsonl"
    assert cli.main(argv + ["--output", str(plain)]) == 0
    extra = ["--draft-model", str(model_dir), "--num-assistant-tokens", "5"]
    assert cli.main(argv + ["--output", str(drafted)] + extra) == 0
    assert "draft_model" not in seen[0] and seen[0]["sampling_params"].num_assistant_tokens == 0
    assert isinstance(seen[1]["draft_model"], torch.nn.Module)
    assert seen[1]["sampling_params"].num_assistant_tokens == 5
    texts = [
        [json.loads(line)["generation"] for line in p.read_text().splitlines()]
        for p in (plain, drafted)
    ]
    assert texts[0] == texts[1]
