"""Engine configuration: its defaults and what they yield to, the limits a model puts on them, the
device-dependent prefill cap and a blocking call's wider steps."""

from __future__ import annotations

import pytest
import torch
from engine_state import assert_clean
from oracle import assert_teacher_forced
from tiny_models import make_tiny_model, tiny_prompts

import paged_hf
from paged_hf import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def test_max_model_len_is_capped_by_what_the_model_can_position():
    gpt2 = make_tiny_model("gpt2")  # learned positions: 1024
    with pytest.raises(ValueError, match="max_model_len=2048 exceeds the 1024 positions"):
        paged_hf.Engine(gpt2, max_model_len=2048)
    assert paged_hf.Engine(gpt2, num_blocks=8).max_model_len == 1024


def test_rope_scaling_stretches_the_cap():
    model = make_tiny_model("llama")
    model.config.rope_parameters = {
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 1024,
    }
    assert paged_hf.Engine(model, num_blocks=8, max_model_len=4096).max_model_len == 4096
    with pytest.raises(ValueError, match="4097 exceeds the 4096 positions"):
        paged_hf.Engine(model, num_blocks=8, max_model_len=4097)


def test_defaults_yield_to_explicit_options():
    model = paged_hf.patch(make_tiny_model("llama"), max_num_batched_tokens=16, num_blocks=32)
    engine = paged_hf.engine_for(model)
    assert engine.config.max_num_seqs == 16 and engine.config.max_num_batched_tokens == 16
    assert paged_hf.EngineConfig(max_num_seqs=1024).max_num_batched_tokens == 1024
    with pytest.raises(ValueError, match="max_num_seqs=64 exceeds max_num_batched_tokens=32"):
        paged_hf.EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)


def test_do_sample_with_zero_temperature_is_refused_as_transformers_does(prompts):
    model = paged_hf.patch(make_tiny_model("llama"), num_blocks=32)
    with pytest.raises(ValueError, match="temperature=0.0 with do_sample=True"):
        model.generate(
            torch.tensor([prompts[0]]), do_sample=True, temperature=0.0, max_new_tokens=3
        )
    assert_clean(paged_hf.engine_for(model))


def test_weights_made_under_inference_mode_have_no_version_counter_and_still_run(prompts):
    with torch.inference_mode():
        model = make_tiny_model("llama")
        engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
        outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        assert_teacher_forced(model, prompt, out.token_ids, what="inference-mode weights")


def test_the_prefill_cap_default_follows_the_device():
    from paged_hf.config import DEFAULT_CPU_MAX_PREFILL_TOKENS_WHILE_DECODING, EngineConfig

    cfg = EngineConfig()
    assert cfg.max_prefill_tokens_while_decoding == "auto"
    cfg.resolve_for(torch.device("cpu"))
    assert cfg.max_prefill_tokens_while_decoding == DEFAULT_CPU_MAX_PREFILL_TOKENS_WHILE_DECODING
    cfg = EngineConfig()
    cfg.resolve_for(torch.device("cuda", 0))
    assert cfg.max_prefill_tokens_while_decoding is None
    cfg = EngineConfig(max_prefill_tokens_while_decoding=None)  # an explicit None stays: no cap
    cfg.resolve_for(torch.device("cpu"))
    assert cfg.max_prefill_tokens_while_decoding is None
    with pytest.raises(ValueError, match="'auto', None or an integer"):
        EngineConfig(max_prefill_tokens_while_decoding="fast")


def test_a_throughput_call_lifts_the_auto_prefill_cap_and_streaming_keeps_it():
    """With the cap on "auto" (128 on a CPU), a blocking ``generate`` lets a prompt chunk take the
    whole step budget while others decode (only the call's total time counts); with ``on_token``,
    stepping by hand, or a cap set explicitly, a decode waits for at most 128 prompt tokens. The
    tokens are the same either way."""
    model = make_tiny_model("llama")
    prompts = tiny_prompts(model.config.vocab_size, 3, 300, seed=1)
    params = paged_hf.SamplingParams(max_new_tokens=4, ignore_eos=True)

    # step 1 prefills 512 tokens; step 2 has a decode beside prefill
    def second_step(run, **options):
        engine = paged_hf.Engine(model, **options)
        outs = run(engine)
        return engine._stats.step_log[1]["tokens"], [o.token_ids for o in outs]

    budget = {"max_num_batched_tokens": 512}  # set: a batch call keeps it (the next test)
    batch, tokens = second_step(lambda e: e.generate(prompts, params), **budget)
    streamed, streamed_tokens = second_step(
        lambda e: e.generate(prompts, params, on_token=lambda *_: None), **budget
    )
    explicit, explicit_tokens = second_step(
        lambda e: e.generate(prompts, params), max_prefill_tokens_while_decoding=128, **budget
    )
    assert batch > 129 and streamed <= 129 and explicit <= 129, (batch, streamed, explicit)
    assert tokens == streamed_tokens == explicit_tokens


def test_a_throughput_call_on_a_cpu_takes_wider_steps_unless_the_budget_is_set():
    """A blocking ``generate`` on a CPU steps up to DEFAULT_CPU_THROUGHPUT_CALL_TOKENS (2048) tokens where
    ``max_num_batched_tokens`` was left unset; streaming keeps 512, a budget set is kept, and a hybrid (its
    state checkpoints follow the budget) keeps 512. The tokens are the same every way."""
    from paged_hf.config import DEFAULT_CPU_THROUGHPUT_CALL_TOKENS, DEFAULT_MAX_NUM_BATCHED_TOKENS

    model = make_tiny_model("llama")
    prompts = tiny_prompts(model.config.vocab_size, 6, 300, seed=2)
    params = paged_hf.SamplingParams(max_new_tokens=3, ignore_eos=True)

    def first_step(run, **options):
        engine = paged_hf.Engine(model, **options)
        outs = run(engine)
        return engine._stats.step_log[0]["tokens"], [o.token_ids for o in outs]

    batch, tokens = first_step(lambda e: e.generate(prompts, params))
    streamed, streamed_tokens = first_step(
        lambda e: e.generate(prompts, params, on_token=lambda *_: None)
    )
    explicit, explicit_tokens = first_step(
        lambda e: e.generate(prompts, params), max_num_batched_tokens=512
    )
    assert (
        batch == min(DEFAULT_CPU_THROUGHPUT_CALL_TOKENS, 6 * 300) > DEFAULT_MAX_NUM_BATCHED_TOKENS
    ), batch
    assert streamed == explicit == DEFAULT_MAX_NUM_BATCHED_TOKENS, (streamed, explicit)
    assert tokens == streamed_tokens == explicit_tokens
    from paged_hf.model.support import build_tiny_model

    hybrid = build_tiny_model("lfm2")
    engine = paged_hf.Engine(hybrid)
    engine.generate(tiny_prompts(hybrid.config.vocab_size, 3, 300, seed=3), params)
    assert engine._stats.step_log[0]["tokens"] <= DEFAULT_MAX_NUM_BATCHED_TOKENS
