"""The support table's script (paged_hf/model/support.py) over a fixed subset of types: verdicts, the
reasons it reports, and the table it writes on docs/support.md."""

from __future__ import annotations

import json

import pytest

from paged_hf.model import support

EXPECTED = {  # type: (verdict, words its details must hold)
    "llama": ("pass", "GQA"),
    "qwen2_moe": ("pass", "sliding window on 1/4 layers"),
    "gpt_oss": ("pass", "attention sinks"),
    "llama4_text": ("pass", "chunked attention on 3/4 layers"),
    "deepseek_v3": ("pass", "K/V widths 16/12 (MLA)"),
    "gemma4_text": ("pass", "per-layer heads / widths"),
    "bloom": ("refused", "never calls transformers' AttentionInterface"),
    "jamba": ("pass", "state: mamba mixer on 2 layers, prompts continued token by token"),
    "rwkv": ("refused", "outside transformers' cache API"),
    "bart": ("refused", "computes positions itself"),
}


@pytest.fixture(scope="module")
def results(one_thread):
    return support.run_sweep(list(EXPECTED), multimodal=["qwen2_vl"])


def test_sweep_verdicts_on_a_fixed_subset(results):
    by_type = {(r.model_type, r.multimodal): r for r in results}
    for model_type, (verdict, words) in EXPECTED.items():
        r = by_type[(model_type, False)]
        assert (r.verdict, words in r.reason) == (verdict, True), (model_type, r)
        assert r.model_class.endswith(("ForCausalLM", "LMHeadModel")), r.model_class
    vl = by_type[("qwen2_vl", True)]
    assert vl.verdict == "pass" and vl.model_class == "Qwen2VLForConditionalGeneration", vl
    assert support.counts(results) == {"pass": 8, "refused": 3}


def test_the_support_table_is_written_between_its_markers(results, tmp_path):
    table = support.render_table(results, "9.9.9")
    assert (
        "transformers 9.9.9, all 10 `model_type`s" in table
        and "**7 pass**, 3 refused, 0 wrong, 0 error" in table
    )
    assert (
        "| gpt_oss | GptOssForCausalLM | pass | " in table
        and "| qwen2_vl | Qwen2VLForConditionalGeneration | pass" in table
    )
    readme = tmp_path / "README.md"
    readme.write_text(
        f"# x\n\nbefore\n\n{support.TABLE_START}\nold\n{support.TABLE_END}\n\nafter\n"
    )
    support.write_page(readme, table)
    text = readme.read_text()
    assert (
        text.startswith("# x\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "old" not in text
    )
    assert text.count(support.TABLE_START) == 1 and text.count(support.TABLE_END) == 1
    with pytest.raises(ValueError, match="no support-table markers"):
        (tmp_path / "plain.md").write_text("no markers")
        support.write_page(tmp_path / "plain.md", table)


def test_the_support_page_holds_a_generated_table():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "support.md").read_text()
    body = text.split(support.TABLE_START, 1)[1].split(support.TABLE_END, 1)[0]
    assert "0 wrong, 0 error" in body and "| llama | LlamaForCausalLM | pass |" in body


def test_command_line_writes_json(tmp_path, one_thread):
    out = tmp_path / "s.json"
    assert support.main(["llama", "bloom", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["model_type"], r["verdict"]) for r in rows] == [
        ("llama", "pass"),
        ("bloom", "refused"),
    ]
