"""Loading a model by name (paged_hf/model/loading.py), the one loader the CLI and the lm-eval backend share."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_models import make_tiny_model  # noqa: E402
from tiny_tokenizer import make_tiny_tokenizer  # noqa: E402

from paged_hf.model.loading import LoadError, load_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir):
    return tiny_llama_dir


def test_a_checkpoint_directory_loads_in_the_dtype_asked(tiny_dir):
    model, tokenizer = load_model(str(tiny_dir), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16 and not model.training
    assert tokenizer("ab")["input_ids"]
    reference = make_tiny_model("llama")
    for name, param in reference.state_dict().items():
        torch.testing.assert_close(
            model.state_dict()[name].float(), param.to(torch.bfloat16).float()
        )


def test_mistakes_name_the_argument_in_the_callers_words(tiny_dir, tmp_path):
    cli = {"model": "--model", "tokenizer": "--tokenizer", "device": "--device"}
    with pytest.raises(LoadError, match=f"^--model {tmp_path}/missing: no such directory$"):
        load_model(str(tmp_path / "missing"), labels=cli)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoadError, match=f"^pretrained {tmp_path}/empty: cannot load it"):
        load_model(str(tmp_path / "empty"), labels={"model": "pretrained"})
    with pytest.raises(LoadError, match=f"^--tokenizer {tmp_path}/empty: cannot load it"):
        load_model(str(tiny_dir), tokenizer=str(tmp_path / "empty"), labels=cli)
    with pytest.raises(LoadError, match="^--device not-a-device: "):
        load_model(str(tiny_dir), device="not-a-device", labels=cli)
    with pytest.raises(LoadError, match="dtype 'float13' is not a torch dtype"):
        load_model(str(tiny_dir), dtype="float13")
    # a tokenizer object is used as it is
    tok = make_tiny_tokenizer()
    assert load_model(str(tiny_dir), tokenizer=tok)[1] is tok


@pytest.mark.slow
def test_a_gguf_file_loads_as_the_plain_weights_the_engine_patches(smollm2_fp32):
    """The SmolLM2 GGUF by directory and file name: dense nn.Linear weights (never transformers'
    packed GGUF modules), the same tensors as the default model's cache, made from that file."""
    from paged_hf.model.default_model import smollm2_gguf_path

    directory, filename = os.path.split(smollm2_gguf_path())
    model, tokenizer = load_model(directory, gguf_file=filename, dtype="float32")
    reference, reference_tok = smollm2_fp32
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is torch.nn.Linear for m in linears)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    want = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    text = "The capital of France is"
    assert tokenizer(text)["input_ids"] == reference_tok(text)["input_ids"]


def test_the_front_ends_load_through_it(tiny_dir, tmp_path):
    from paged_hf.frontends import cli

    with pytest.raises(LoadError, match=f"^--model {tmp_path}/missing: no such directory"):
        cli.load_model(str(tmp_path / "missing"), None, None, "auto", "cpu")
    pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is installed by make install")
    from paged_hf.integrations.lm_eval import PagedHFLM

    with pytest.raises(LoadError, match=f"^pretrained {tmp_path}/missing: no such directory"):
        PagedHFLM(pretrained=str(tmp_path / "missing"))
    lm = PagedHFLM(pretrained=str(tiny_dir), dtype="float32", max_length=64)
    assert next(lm.engine.model.parameters()).dtype == torch.float32
