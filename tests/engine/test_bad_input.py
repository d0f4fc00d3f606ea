"""Bad input gets a clear error naming the problem and costs nothing else (issues 2 and 3)."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_teacher_forced
from tiny_models import make_tiny_model, tiny_prompts

import paged_hf


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def test_bad_requests_fail_alone_and_leak_nothing(model):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=12, max_model_len=64)
    good = tiny_prompts(model.config.vocab_size, 2, [5, 9], seed=20)
    sp = paged_hf.SamplingParams(max_new_tokens=4)
    prompts = [
        good[0],
        [],
        list(range(4, 70)),
        [5, 10**6],
        [5, -1],
        good[1],
        [5, 6, 7],
        "text without tokenizer",
    ]
    params = [sp, sp, sp, sp, sp, sp, paged_hf.SamplingParams(max_new_tokens=200), sp]
    outs = engine.generate(prompts, params)
    errors = [o.error for o in outs]
    assert errors[0] is None and errors[5] is None
    assert "empty prompt" in errors[1]
    assert "66 tokens, max_model_len is 64" in errors[2]
    assert "outside the vocabulary" in errors[3] and "1000000" in errors[3]
    assert "outside the vocabulary" in errors[4]
    assert "needs" in errors[6] and "KV blocks" in errors[6]
    assert "tokenizer" in errors[7]
    assert all(o.finish_reason == "error" for i, o in enumerate(outs) if i not in (0, 5))
    for i in (0, 5):
        assert len(outs[i].token_ids) == 4 or outs[i].finish_reason == "stop"
        assert_teacher_forced(model, prompts[i], outs[i].token_ids, what=f"good request {i}")
    assert engine.kv_manager.pool.num_used == 0 and not engine.requests
    assert engine.kv_manager.pool.num_free + engine.kv_manager.pool.num_cached == 12


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": float("inf")}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": -3}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"n": 0}, "n=0"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_sampling_params_validate(kwargs, message):
    with pytest.raises(ValueError, match=message):
        paged_hf.SamplingParams(**kwargs)


def test_engine_config_validates():
    for bad in (
        {"block_size": 0},
        {"num_blocks": -4},
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": -1},
        {"max_num_seqs": 64, "max_num_batched_tokens": 32},
        {"backend": "cuda-magic"},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            paged_hf.EngineConfig(**bad)
    with pytest.raises(TypeError, match="unknown engine option"):
        paged_hf.patch(make_tiny_model("llama"), block_sise=8)


def test_abort_unknown_request_names_it(model):
    engine = paged_hf.Engine(model)
    with pytest.raises(ValueError, match="request nope"):
        engine.abort("nope")
    rid = engine.add_request([5, 6, 7], paged_hf.SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort(rid)
    assert engine.kv_manager.pool.num_used == 0 and not engine.has_unfinished


def test_generate_refuses_the_whole_call_before_running_anything():
    model = paged_hf.patch(make_tiny_model("llama"), num_blocks=16, block_size=4)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10**5]])
    with pytest.raises(ValueError, match="row 1.*outside the vocabulary"):
        model.generate(ids, max_new_tokens=3)
    engine = paged_hf.engine_for(model)
    assert (
        engine.stats()["steps"] == 0
        and not engine.has_unfinished
        and engine.kv_manager.pool.num_used == 0
    )


def test_patch_refuses_unsupported_architectures():
    from transformers import BloomConfig, BloomForCausalLM

    bloom = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(
        paged_hf.UnsupportedModelError,
        match=r"bloom .*transformer\.h\.0\.self_attention \(BloomAttention\).*AttentionInterface",
    ):
        paged_hf.patch(bloom)
    assert not paged_hf.is_patched(bloom) and bloom.config._attn_implementation != "paged_hf"
    with pytest.raises(ValueError, match="not patched"):
        paged_hf.unpatch(make_tiny_model("llama"))
