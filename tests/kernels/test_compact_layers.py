"""Compact decoder layers (paged_hf/execution/cpu/compact_layers.py): the layers the engine checked to be
the canonical pre-norm block run as one function during CPU steps, with their own code's results bit
for bit; every other layer, and a hooked one, runs its own code."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_logprobs_close
from tiny_models import SLIDING_WINDOW, make_tiny_model, tiny_prompts
from transformers.models.llama import modeling_llama as llama

import paged_hf
from paged_hf.execution.cpu import compact_layers, small_rows

PARAMS = paged_hf.SamplingParams(max_new_tokens=10, logprobs=2, ignore_eos=True)


def _prompts(model, seed=5):
    # the longest well past the window of mistral's and qwen2's sliding layers
    return tiny_prompts(model.config.vocab_size, 4, [5, 12, 30, 10 * SLIDING_WINDOW], seed=seed)


def _served(engine) -> int:
    compact = engine.runner.compact
    return 0 if compact is None else len(compact.plans)


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        # exactly: the same ops on the same tensors
        assert x.completions[0].logprobs == y.completions[0].logprobs


@pytest.mark.parametrize(
    "family,dtype",
    [
        ("llama", torch.bfloat16),
        ("llama", torch.float32),
        ("llama_mqa", torch.bfloat16),
        ("mistral", torch.bfloat16),
        ("qwen2", torch.float32),
        ("qwen2", torch.bfloat16),
    ],
)
def test_served_layers_give_their_own_codes_results(family, dtype):
    """Every layer served (Mistral's sliding layers, Qwen2's q/k/v biases and its full and sliding
    layers included), the outputs and logprobs those of the same engine without compact layers, and
    in fp32 the reference's within its tolerance."""
    model = make_tiny_model(family, dtype=dtype)
    engine = paged_hf.Engine(model)
    assert _served(engine) == model.config.num_hidden_layers
    prompts = _prompts(model)
    got = engine.generate(prompts, PARAMS)
    _same(got, paged_hf.Engine(model, cpu_compact_layers=False).generate(prompts, PARAMS))
    if dtype == torch.float32:
        for p, out in zip(prompts, got):
            assert_logprobs_close(model, p, out.token_ids, out.completions[0].logprobs, what=family)
    assert not any("forward" in m.__dict__ for m in model.modules()), (
        "a layer kept a step's forward"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_partial_rotary_layers_are_served_at_the_width_a_step_hands_them(dtype):
    """GLM-4-MoE (partial_rotary_factor 0.5: cos and sin half a head wide): its dense layers are
    checked at that width and served, with the results of the engine without compact layers or
    fused ops, and in fp32 the reference's. (Checked at the full head only, a step handed the op a
    half-width cos and every request failed.)"""
    from paged_hf.model.support import build_tiny_model

    model = build_tiny_model("glm4_moe").to(dtype)
    paged_hf.patch(model)
    engine = paged_hf.Engine(model)
    head_dim = model.model.layers[0].self_attn.head_dim
    assert engine.runner.fused_ops.rope_widths == {head_dim, head_dim // 2}
    assert _served(engine) == model.config.first_k_dense_replace >= 1
    prompts = _prompts(model)
    got = engine.generate(prompts, PARAMS)
    assert all(o.error is None for o in got)
    _same(got, paged_hf.Engine(model, cpu_compact_layers=False).generate(prompts, PARAMS))
    plain = paged_hf.Engine(model, cpu_fused_ops=False).generate(prompts, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    if dtype == torch.float32:
        for p, out in zip(prompts, got):
            assert_logprobs_close(
                model, p, out.token_ids, out.completions[0].logprobs, what="glm4_moe"
            )


class _HalvedLayer(llama.LlamaDecoderLayer):
    """A Llama layer whose output is scaled: the structure of the canonical block, other math."""

    def forward(self, hidden_states, **kwargs):
        return super().forward(hidden_states, **kwargs) * 0.5


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "phi3"])
def test_layers_of_other_math_run_their_own_code(family):
    """Qwen3's per-head q/k norms pass the structural look and fail the check on the model;
    Gemma 3's four norms a layer and Phi-3's fused projections fail the look."""
    assert _served(paged_hf.Engine(make_tiny_model(family, dtype=torch.bfloat16))) == 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_the_few_row_halves_give_the_layer_by_layer_bits(family, monkeypatch):
    """bf16 layers whose GEMMs run on the few-row kernel make each half around attention one C++
    call (csrc/compact_rows.cpp): the same tokens and logprobs, bit for bit, as the same layers
    made op by op from Python (qwen2's q/k/v biases, mistral's sliding layers), and the calls
    counted. Where the kernel is not built, no layer takes them."""
    model = make_tiny_model(family, dtype=torch.bfloat16)
    prompts = _prompts(model)
    calls = []
    real = compact_layers._forward_few_rows
    monkeypatch.setattr(compact_layers, "_forward_few_rows", lambda *a: calls.append(1) or real(*a))
    got = paged_hf.Engine(model).generate(prompts, PARAMS)
    assert bool(calls) == small_rows.available()
    monkeypatch.setattr(compact_layers, "_few_rows", lambda weights: 0)
    calls.clear()
    _same(got, paged_hf.Engine(model).generate(prompts, PARAMS))
    assert not calls


def test_a_layer_whose_output_differs_is_found_by_the_check():
    model = make_tiny_model("llama")
    model.model.layers[1].__class__ = _HalvedLayer
    engine = paged_hf.Engine(model)
    assert [p.layer for p in engine.runner.compact.plans] == [model.model.layers[0]]
    prompts = _prompts(model)
    for p, out in zip(prompts, engine.generate(prompts, PARAMS)):
        assert_logprobs_close(
            model, p, out.token_ids, out.completions[0].logprobs, what="halved layer"
        )


def test_a_hooked_layer_runs_its_own_code_and_its_hooks():
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    engine = paged_hf.Engine(model)
    plain = paged_hf.Engine(model, cpu_compact_layers=False)
    prompts = _prompts(model)
    seen: list[int] = []
    handle = model.model.layers[1].mlp.register_forward_hook(
        lambda m, args, out: seen.append(out.shape[1])
    )
    try:
        hooked = engine.generate(prompts, PARAMS)
    finally:
        handle.remove()
    # every step's tokens
    assert len(seen) >= PARAMS.max_new_tokens and sum(seen) >= sum(map(len, prompts))
    steps = len(seen)
    _same(hooked, plain.generate(prompts, PARAMS))
    # the same steps again (no prefix hits): a GEMM's bits may depend on its row count where the
    # CPU has no row-invariant kernel (AVX2: oneDNN's fp32 GEMM), and a hit changes the rows
    engine.reset_prefix_cache()
    _same(engine.generate(prompts, PARAMS), hooked)
    assert len(seen) == steps


def test_weight_updates_reach_the_compact_layers():
    """In-place updates (an optimizer's) and a replaced norm weight: the next generation is the one a
    fresh engine on the new weights gives."""
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    engine = paged_hf.Engine(model)
    prompts = _prompts(model)
    before = engine.generate(prompts, PARAMS)
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.mlp.down_proj.weight.mul_(-1.5)
        layer.self_attn.q_proj.weight.mul_(2.0)
    layer.post_attention_layernorm.weight = torch.nn.Parameter(
        layer.post_attention_layernorm.weight.detach() * 3
    )
    after = engine.generate(prompts, PARAMS)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    assert _served(engine) == 2
    _same(after, paged_hf.Engine(model, cpu_compact_layers=False).generate(prompts, PARAMS))
