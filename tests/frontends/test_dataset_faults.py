"""generate_dataset when things go wrong: rows that raise while they are prepared, the error
column, errored rows on resume, the engine in the checkpoint fingerprint, damaged or unusual
checkpoint records, and an empty dataset."""

from __future__ import annotations

import json
import logging

import datasets
import pytest
from dataset_eval_worker import columns, eval_setup
from tiny_tokenizer import CHAT_TEMPLATE, make_tiny_tokenizer

import paged_hf
from paged_hf import SamplingParams

PARAMS = SamplingParams(max_new_tokens=6)
ROWS = 12

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    model, tokenizer, dataset = eval_setup(ROWS)  # row 7 has an empty prompt: refused
    return model, tokenizer, dataset


@pytest.fixture(scope="module")
def reference(setup):
    model, tokenizer, dataset = setup
    return columns(
        paged_hf.generate_dataset(model, tokenizer, dataset, sampling_params=PARAMS, progress=False)
    )


def _run(setup, ckpt, **kwargs) -> dict:
    model, tokenizer, dataset = setup
    kwargs = {"sampling_params": PARAMS, "progress": False, "checkpoint_dir": ckpt, **kwargs}
    return columns(
        paged_hf.generate_dataset(
            kwargs.pop("model", model),
            kwargs.pop("tokenizer", tokenizer),
            kwargs.pop("dataset", dataset),
            **kwargs,
        )
    )


def _without_ttft(cols: dict) -> dict:
    return {k: v for k, v in cols.items() if not k.endswith("_ttft")}


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_row_raising_anything_while_prepared_is_an_error_row(setup):
    model, _, _ = setup
    tokenizer = make_tiny_tokenizer()
    # a chat template that refuses system messages, as many real ones do (jinja2's TemplateError)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('system messages are not supported') }}{% endif %}{% endfor %}"
        + CHAT_TEMPLATE
    )
    template = tokenizer.apply_chat_template

    def apply_chat_template(messages, **kwargs):  # a tokenizer that breaks on one input
        if messages[0]["content"] == "explode":
            raise RuntimeError("tokenizer exploded")
        if messages[0]["content"] == "interrupt":
            raise KeyboardInterrupt
        return template(messages, **kwargs)

    tokenizer.apply_chat_template = apply_chat_template
    user = [{"role": "user", "content": "hello there"}]
    ds = datasets.Dataset.from_dict(
        {
            "messages": [
                user,
                [{"role": "system", "content": "be brief"}],
                user,
                [{"role": "user", "content": "explode"}],
                user,
            ]
        }
    )
    out = paged_hf.generate_dataset(
        model, tokenizer, ds, messages_column="messages", sampling_params=PARAMS, progress=False
    )
    reasons = list(out["generation_finish_reason"])
    assert (
        reasons[1] == reasons[3] == "error"
        and "error" not in reasons[:1] + reasons[2:3] + reasons[4:]
    )
    assert out["generation_error"][1] == "row 1: TemplateError: system messages are not supported"
    assert out["generation_error"][3] == "row 3: RuntimeError: tokenizer exploded"
    assert out["generation"][0] == out["generation"][2] == out["generation"][4] != ""

    # Ctrl-C while a row is prepared still stops the run, and leaves a shared engine clean
    patched = paged_hf.patch(eval_setup(1)[0], tokenizer, max_num_seqs=2)
    try:
        stop = datasets.Dataset.from_dict(
            {"messages": [user] * 3 + [[{"role": "user", "content": "interrupt"}]]}
        )
        with pytest.raises(KeyboardInterrupt):
            paged_hf.generate_dataset(
                patched,
                tokenizer,
                stop,
                messages_column="messages",
                sampling_params=PARAMS,
                progress=False,
            )
        assert not paged_hf.engine_for(patched).requests
    finally:
        paged_hf.unpatch(patched)


def test_error_column_holds_the_message_of_refused_rows(setup, reference):
    assert list(reference) == [
        "id",
        "prompt",
        "generation",
        "generation_num_tokens",
        "generation_finish_reason",
        "generation_ttft",
        "generation_error",
    ]
    errors = reference["generation_error"]
    assert errors[7] == "row 7: ValueError: empty prompt"
    assert [e is None for e in errors] == [
        r != "error" for r in reference["generation_finish_reason"]
    ]
    _, _, dataset = setup
    with pytest.raises(ValueError, match=r"already has column\(s\) \['generation_error'\]"):
        _run(setup, None, dataset=dataset.add_column("generation_error", [None] * ROWS))


def test_errored_rows_run_again_on_resume_and_a_good_record_wins(setup, reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _run(setup, ckpt)
    results = ckpt / "results-0.jsonl"
    # row 3 failed last time (say the engine ran out of something); row 7 was refused as usual
    recs = _lines(results)
    for rec in recs:
        if rec["row_index"] == 3:
            rec.update(
                text="",
                num_tokens=0,
                finish_reason="error",
                ttft=None,
                error="row 3: RuntimeError: boom",
            )
    results.write_text("".join(json.dumps(r) + "\n" for r in recs))
    resumed = _run(setup, ckpt)
    assert _without_ttft(resumed) == _without_ttft(reference)
    again = [r["row_index"] for r in _lines(results)[ROWS:]]
    assert sorted(again) == [3, 7]  # only the errored rows ran again

    # row 3 now has an error record, then a good one; a later error in another rank's file does not win
    good3 = _lines(results)[ROWS:][again.index(3)]
    (ckpt / "results-1.jsonl").write_text(
        json.dumps(
            {
                **good3,
                "text": "",
                "num_tokens": 0,
                "ttft": None,
                "finish_reason": "error",
                "error": "row 3: late",
            }
        )
        + "\n"
    )
    before = results.read_text()
    assert _run(setup, ckpt)["generation"] == first["generation"]
    assert [r["row_index"] for r in _lines(results)[len(before.splitlines()) :]] == [
        7
    ]  # row 3 stayed done


def test_engine_max_model_len_and_eos_are_in_the_fingerprint(setup, tmp_path, monkeypatch):
    model, _, dataset = setup
    small = dataset.select(range(4))
    ckpt = tmp_path / "ckpt"
    _run(setup, ckpt, dataset=small, max_model_len=200)
    with pytest.raises(
        ValueError,
        match=r"different arguments \(engine: .*'max_model_len': 200.*'max_model_len': 120",
    ):
        _run(setup, ckpt, dataset=small, max_model_len=120)
    # the engine stops on 5 too now
    monkeypatch.setattr(model.generation_config, "eos_token_id", [2, 5])
    with pytest.raises(
        ValueError, match=r"different arguments \(engine: .*'eos_token_ids': \[2\].*\[2, 5\]"
    ):
        _run(setup, ckpt, dataset=small, max_model_len=200)
    monkeypatch.undo()
    _run(setup, ckpt, dataset=small, max_model_len=200)  # the same engine resumes


BAD_RECORDS = {  # row -> (what is wrong, how the written record is changed)
    0: ("row_index is a bool", lambda r: {**r, "row_index": True}),
    1: ("row_index is a float", lambda r: {**r, "row_index": 1.0}),
    2: ("text is missing", lambda r: {k: v for k, v in r.items() if k != "text"}),
    3: ("num_tokens is negative", lambda r: {**r, "num_tokens": -1}),
    4: ("unknown finish_reason", lambda r: {**r, "finish_reason": "done"}),
    5: ("error set on a good row", lambda r: {**r, "error": "x"}),
    6: ("ttft is text", lambda r: {**r, "ttft": "0.1"}),
    8: ("not a dict", lambda r: [r]),
    9: ("text is not a str", lambda r: {**r, "text": 5}),
}


def test_bad_checkpoint_records_are_found_at_load_and_their_rows_rerun(
    setup, reference, tmp_path, monkeypatch, caplog
):
    ckpt = tmp_path / "ckpt"
    _run(setup, ckpt)
    results = ckpt / "results-0.jsonl"
    recs = _lines(results)
    lines = [
        json.dumps(BAD_RECORDS[r["row_index"]][1](r) if r["row_index"] in BAD_RECORDS else r)
        for r in recs
    ]
    lines.append(json.dumps({**recs[0], "row_index": ROWS}))  # beyond the dataset
    lines.append(json.dumps({**recs[0], "row_index": -1}))
    results.write_text("".join(line + "\n" for line in lines))

    warned_before_first_step: list[int] = []
    step = paged_hf.Engine.step

    def spy(self):
        if not warned_before_first_step:
            warned_before_first_step.append(
                sum("results-0.jsonl line" in m for m in caplog.messages)
            )
        return step(self)

    monkeypatch.setattr(paged_hf.Engine, "step", spy)
    with caplog.at_level(logging.WARNING, logger="paged_hf"):
        resumed = _run(setup, ckpt)
    assert _without_ttft(resumed) == _without_ttft(reference)
    bad = len(BAD_RECORDS) + 2
    assert warned_before_first_step == [bad]
    rerun = sorted(r["row_index"] for r in _lines(results)[len(lines) :])
    # the damaged rows and the errored one, nothing else
    assert rerun == sorted(set(BAD_RECORDS) | {7})


def test_last_record_without_its_newline_is_kept(setup, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _run(setup, ckpt)
    results = ckpt / "results-0.jsonl"
    text = results.read_text()
    results.write_text(text[:-1])  # complete, but the newline never made it to disk
    resumed = _run(setup, ckpt)
    last = json.loads(text.splitlines()[-1])
    assert resumed["generation_ttft"][last["row_index"]] == last["ttft"]  # restored, not run again
    assert resumed == {**first, "generation_ttft": resumed["generation_ttft"]}
    assert results.read_text().startswith(text) and results.read_text().endswith("\n")
    assert [r["row_index"] for r in _lines(results)[ROWS:]] == [7]  # only the errored row ran


def test_empty_dataset_gets_the_output_columns(setup, tmp_path):
    _, _, dataset = setup
    for ckpt in (None, tmp_path / "ckpt"):
        out = _run(setup, ckpt, dataset=dataset.select([]))
        assert out == {
            "id": [],
            "prompt": [],
            "generation": [],
            "generation_num_tokens": [],
            "generation_finish_reason": [],
            "generation_ttft": [],
            "generation_error": [],
        }
