"""Packed oneDNN weights for the linear layers in bf16 on a CPU (paged_hf/execution/cpu_linear.py): the same
results as ``F.linear`` bit for bit, only inside engine steps, packed again when the weights change."""
import pytest
import torch
import torch.nn.functional as F

import paged_hf
from paged_hf.execution import cpu_linear
from tiny_models import FAMILIES, make_tiny_model, tiny_prompts

pytestmark = pytest.mark.skipif(not cpu_linear.supported(torch.bfloat16, torch.device("cpu")),
                                reason="no bf16 oneDNN on this CPU (or packed results differ): F.linear stays")

SMALL = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8}


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
def test_the_packed_op_is_f_linear_bit_for_bit(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1536, 576, generator=g).bfloat16()
    b = torch.randn(1536, generator=g).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)  # packed for 64 rows, used at any
    x = torch.randn(1, rows, 576, generator=g).bfloat16()
    for bias in (None, b):
        assert torch.equal(cpu_linear._packed_linear(x, packed, bias), F.linear(x, w, bias))


def _run(model, prompts, packed: bool):
    engine = paged_hf.Engine(model, cpu_packed_weights=packed, **SMALL)
    assert (engine.runner.packed is not None) == packed
    params = paged_hf.SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3)
    return engine, engine.generate(prompts, params)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt2"])  # GPT-2's Conv1D is no nn.Linear
def test_engine_outputs_are_identical_with_and_without_packed_weights(family):
    model = make_tiny_model(family, dtype=torch.bfloat16)
    prompts = tiny_prompts(model.config.vocab_size, 4, [1, 6, 19, 41], seed=5)
    engine, with_packed = _run(model, prompts, packed=True)
    assert len(engine.runner.packed.modules) >= 4 * model.config.num_hidden_layers
    assert all("forward" not in m.__dict__ for m in engine.runner.packed.modules)  # untouched outside a step
    _, without = _run(model, prompts, packed=False)
    for a, b in zip(with_packed, without):
        assert a.token_ids == b.token_ids
        assert a.completions[0].logprobs == b.completions[0].logprobs  # bit for bit, not within a tolerance


def test_a_weight_update_is_packed_again():
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    prompts = tiny_prompts(model.config.vocab_size, 2, [7, 12], seed=6)
    engine, _ = _run(model, prompts, packed=True)
    with torch.no_grad():
        for m in engine.runner.packed.modules:
            m.weight.mul_(-1.5)  # an optimizer step's kind of write: the version counter moves
    params = paged_hf.SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3)
    after = engine.generate(prompts, params)
    reference = paged_hf.Engine(model, cpu_packed_weights=False, **SMALL).generate(prompts, params)
    assert [o.completions[0].logprobs for o in after] == [o.completions[0].logprobs for o in reference]


def test_fp32_and_the_option_off_keep_f_linear():
    assert not cpu_linear.supported(torch.float32, torch.device("cpu"))
    engine = paged_hf.Engine(make_tiny_model("llama"), **SMALL)  # fp32
    assert engine.runner.packed is None
    with pytest.raises(ValueError, match="cpu_packed_weights"):
        paged_hf.Engine(make_tiny_model("llama", dtype=torch.bfloat16), cpu_packed_weights="yes")


def test_no_second_copy_of_weights_that_would_crowd_memory(monkeypatch, caplog):
    ok, _ = cpu_linear.affordable(1 << 20)
    assert ok
    ok, why = cpu_linear.affordable(1 << 50)  # a petabyte of weights
    assert not ok and "quarter" in why
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    prompts = tiny_prompts(model.config.vocab_size, 2, [7, 12], seed=7)
    params = paged_hf.SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=3)
    reference = paged_hf.Engine(model, cpu_packed_weights=False, **SMALL).generate(prompts, params)
    monkeypatch.setattr(cpu_linear.os, "sysconf", lambda name: 1)  # one byte of memory available
    with caplog.at_level("WARNING", logger="paged_hf"):
        engine = paged_hf.Engine(model, **SMALL)
    assert engine.runner.packed is None
    assert "not packed" in caplog.text and "quarter" in caplog.text
    assert [o.completions[0].logprobs for o in engine.generate(prompts, params)] == \
        [o.completions[0].logprobs for o in reference]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3"])
def test_fused_projections_are_found_and_give_the_same_tokens(family):
    """q/k/v and gate/up (the siblings one forward calls on the same input) run as one GEMM in a step:
    found by the probe forward, and the engine's outputs are bit for bit those without fusion."""
    model = make_tiny_model(family, dtype=torch.bfloat16)
    prompts = tiny_prompts(model.config.vocab_size, 4, [3, 9, 17, 30], seed=2)
    fused = paged_hf.Engine(model, **SMALL)
    groups = fused.runner.packed.siblings
    widths = sorted({len(g) for g in groups})
    if family == "phi3":  # already one qkv_proj and one gate_up_proj: nothing to fuse
        assert groups == []
    else:
        assert widths == [2, 3] and len(groups) == 2 * model.config.num_hidden_layers, [len(g) for g in groups]
    params = paged_hf.SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2)
    with_fused = fused.generate(prompts, params)
    assert len(fused.runner.packed.fused) == len(groups), "every group's fused GEMM was exact here"
    assert all("forward" not in m.__dict__ for m in fused.runner.packed.modules)
    plain = paged_hf.Engine(model, cpu_fused_projections=False, **SMALL)
    assert plain.runner.packed.siblings == []
    for a, b in zip(with_fused, plain.generate(prompts, params)):
        assert a.token_ids == b.token_ids and a.completions[0].logprobs == b.completions[0].logprobs
