"""Hybrid models (linear attention / SSM / short conv beside attention) against transformers itself.

Tiny random models from each type's own config class (paged_hf.model.support.build_tiny_model, with
attention layers interleaved as the released checkpoints have them). The engine's generations are
teacher-forced against the unpatched model (every token within 1e-3 of the reference's best logit;
logprobs within 1e-4 of the log-softmax of transformers' own incremental path, its generate's: the
prompt, then one token at a time; fp32; or, where transformers' two paths part by more, within 1.5x
of that: Mamba2's scan and its recurrence part by up to ~5e-4 on these models), with default settings and with 4-token blocks and a
16-token budget (prompts chunked, so each chunk continues its sequence's state), with prefix hits
(served only up to a checkpointed state), under preemption by recompute and by swap, with seeded
n > 1, and scoring; no state slot is left held.
"""

from __future__ import annotations

import pytest
import torch
from oracle import assert_logprobs_close_incremental, assert_teacher_forced
from tiny_models import tiny_prompts

import paged_hf
from paged_hf.engine.binding import patch_state
from paged_hf.model.support import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

HYBRIDS = {  # type: the state kind patch must find
    "qwen3_5_text": "gated delta net",
    "qwen3_5_moe_text": "gated delta net",
    "qwen3_next": "gated delta net",
    "olmo_hybrid": "gated delta net",
    "kimi_linear": "delta attention",
    "lfm2": "short conv",
    "lfm2_moe": "short conv",
    "granitemoehybrid": "mamba",
    "nemotron_h": "mamba2 mixer",
    "falcon_h1": "mixer",
    "bamba": "mixer",
    "jamba": "mamba mixer",
    # a shared attention block applied at several depths (each its own KV); state kept in the model's own cache
    "zamba2": "mamba mixer",
    "zamba": "mamba mixer",
    "minimax": "lightning attention",
    # stateful layers only: no attention, no KV
    "mamba2": "mixer",
    "mamba": "mixer",
    "falcon_mamba": "mixer",
}
PROMPT_LENGTHS = [1, 6, 19, 33]
MAX_NEW = 10
SMALL = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8}
GREEDY = paged_hf.SamplingParams(max_new_tokens=MAX_NEW, logprobs=3, ignore_eos=True)


def _pair(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    return build_tiny_model(model_type), build_tiny_model(model_type)


def _prompts(
    model: torch.nn.Module, lengths: list[int] = PROMPT_LENGTHS, seed: int = 1
) -> list[list[int]]:
    return tiny_prompts(
        model.config.get_text_config().vocab_size,
        len(lengths),
        lengths,
        seed=seed,
        eos_token_id=None,
    )


def _check(reference: torch.nn.Module, prompts: list[list[int]], outs: list, what: str) -> None:
    for prompt, out in zip(prompts, outs):
        assert out.error is None and len(out.token_ids) == MAX_NEW, (what, out.error)
        assert_teacher_forced(
            reference, prompt, out.token_ids, what=f"{what}, prompt of {len(prompt)}"
        )
        assert_logprobs_close_incremental(
            reference,
            prompt,
            out.token_ids,
            out.completions[0].logprobs,
            what=f"{what}, prompt of {len(prompt)}",
        )


def _assert_clean(engine: paged_hf.Engine) -> None:
    assert engine.kv_manager.pool.num_used == 0 and not engine.requests
    assert engine.kv_manager.state.num_used == 0, "a state slot is still held"
    assert engine.kv_manager.state.num_pending == 0, (
        "a state snapshot was never attached or released"
    )


@pytest.mark.parametrize("settings", ["defaults", "small"])
@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_generations_match_transformers(model_type, settings):
    reference, model = _pair(model_type)
    paged_hf.patch(model)
    state = patch_state(model).state
    assert state is not None and HYBRIDS[model_type] in ", ".join(state.kinds), state.kinds
    prompts = _prompts(model)
    engine = paged_hf.Engine(model, **({} if settings == "defaults" else SMALL))
    _check(reference, prompts, engine.generate(prompts, GREEDY), f"{model_type}/{settings}")
    if settings == "small":
        assert engine.stats()["steps"] > MAX_NEW + 2, "the 33-token prompt was prefilled in chunks"
    _assert_clean(engine)
    paged_hf.unpatch(model)
    x = torch.tensor([prompts[3]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, reference(input_ids=x).logits), (
            "unpatch is not exact"
        )


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_prefix_hits_resume_from_state_checkpoints(model_type):
    """A shared 40-token prefix, then exact repeats in a later call: hits are served only up to a
    checkpointed state, and the tokens and logprobs are transformers' all the same."""
    reference, model = _pair(model_type)
    shared = _prompts(model, [40], seed=7)[0]
    prompts = [shared + p for p in _prompts(model, [3, 9, 14], seed=8)]
    engine = paged_hf.Engine(model, **SMALL)
    first = engine.generate(prompts[:1], GREEDY)
    together = engine.generate(prompts, GREEDY)
    again = engine.generate(prompts, GREEDY)
    _check(
        reference,
        prompts[:1] + prompts + prompts,
        first + together + again,
        f"{model_type}, prefix hits",
    )
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens > 0 for o in together + again), [
        o.num_cached_tokens for o in together + again
    ]
    assert engine.stats()["state_checkpoint_hits"] > 0
    _assert_clean(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_preemption_keeps_each_requests_tokens(model_type, mode):
    reference, model = _pair(model_type)
    prompts = _prompts(model, [7, 15, 22, 30, 11, 26], seed=2)
    # 14 blocks of 4 tokens cannot hold six sequences of up to 40 tokens: running ones are preempted
    engine = paged_hf.Engine(
        model,
        block_size=4,
        num_blocks=14,
        max_num_batched_tokens=16,
        max_num_seqs=6,
        preemption_mode=mode,
    )
    outs = engine.generate(prompts, GREEDY)
    assert engine.stats()["preemptions"] > 0, "the pool was meant to be too small"
    _check(reference, prompts, outs, f"{model_type}, preempted by {mode}")
    _assert_clean(engine)


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_seeded_samples_equal_the_same_seeds_alone(model_type):
    model = build_tiny_model(model_type)
    prompts = _prompts(model, [9, 21], seed=3)
    engine = paged_hf.Engine(model, **SMALL)
    together = engine.generate(
        prompts,
        paged_hf.SamplingParams(max_new_tokens=8, temperature=1.0, seed=11, n=3, ignore_eos=True),
    )
    for prompt, out in zip(prompts, together):
        assert len(out.completions) == 3
        for k, completion in enumerate(out.completions):
            alone = engine.generate(
                [prompt],
                paged_hf.SamplingParams(
                    max_new_tokens=8, temperature=1.0, seed=11 + k, ignore_eos=True
                ),
            )[0]
            assert completion.token_ids == alone.token_ids, (
                f"sample {k} of a prompt of {len(prompt)}"
            )
    assert len({tuple(c.token_ids) for out in together for c in out.completions}) > 2, (
        "samples should differ"
    )
    _assert_clean(engine)


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_scores_equal_a_plain_forward(model_type):
    reference, model = _pair(model_type)
    contexts = _prompts(model, [5, 18, 27], seed=4)
    continuations = _prompts(model, [3, 6, 9], seed=5)
    engine = paged_hf.Engine(model, **SMALL)
    outs = engine.score(list(zip(contexts, continuations)))
    for ctx, cont, out in zip(contexts, continuations, outs):
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([ctx + cont])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[
            torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1), torch.tensor(cont)
        ]
        assert out.error is None
        assert torch.allclose(torch.tensor(out.token_logprobs), expected, atol=1e-4), (
            model_type,
            len(ctx),
        )
    _assert_clean(engine)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2", "nemotron_h"])
def test_the_choices_of_a_question_share_its_context(model_type):
    """Multiple choice: four continuations of one 30-token context. The context's state is
    checkpointed at its last full block, so the later choices resume there instead of computing
    it again; every score is still a plain forward's."""
    reference, model = _pair(model_type)
    context = _prompts(model, [30], seed=11)[0]
    choices = _prompts(model, [2, 3, 1, 4], seed=12)
    engine = paged_hf.Engine(model, block_size=4)
    first = engine.score([(context, choices[0])])
    rest = engine.score([(context, c) for c in choices[1:]])
    for cont, out in zip(choices, first + rest):
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([context + cont])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[
            torch.arange(len(context) - 1, len(context) + len(cont) - 1), torch.tensor(cont)
        ]
        assert out.error is None and torch.allclose(
            torch.tensor(out.token_logprobs), expected, atol=1e-4
        )
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 28 for o in rest), [o.num_cached_tokens for o in rest]
    assert engine.stats()["state_checkpoint_hits"] >= 3
    _assert_clean(engine)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "falcon_h1"])
def test_rolling_loglikelihood_equals_transformers_over_windows(model_type):
    reference, model = _pair(model_type)
    texts = _prompts(model, [45, 7, 23], seed=13)
    window = 16
    engine = paged_hf.Engine(model, block_size=4, max_num_batched_tokens=32)
    outs = engine.score_rolling(texts, window=window, prefix_token=1)
    for text, out in zip(texts, outs):
        expected, done = [], 0
        # transformers on each window: the first on BOS, later ones on what fits before
        while done < len(text):
            end = min(len(text), done + window)
            ctx = [1] if done == 0 else text[max(0, end - window - 1) : done]
            with torch.no_grad():
                logits = reference(input_ids=torch.tensor([ctx + text[done:end]])).logits[0].float()
            expected += torch.log_softmax(logits, -1)[
                torch.arange(len(ctx) - 1, len(ctx) + end - done - 1), torch.tensor(text[done:end])
            ].tolist()
            done = end
        assert out.error is None and out.token_ids == text
        assert torch.allclose(torch.tensor(out.token_logprobs), torch.tensor(expected), atol=1e-4)
    _assert_clean(engine)


def test_state_slots_cap_the_sequences_that_run_and_share_the_budget():
    model = build_tiny_model("qwen3_5_text")
    paged_hf.patch(model)
    per_slot = patch_state(model).state.bytes_per_slot()
    # a budget whose half holds 3 states: the default max_num_seqs (128) yields to it
    # half the budget holds 4 slots; each running sequence takes 1.5 (its own, half a prefix checkpoint):
    # 2 running sequences and 1 checkpoint
    engine = paged_hf.Engine(model, kv_cache_memory=8 * per_slot)
    assert (
        engine.config.max_num_seqs == 2 == engine.kv_manager.state.num_slots
        and engine.kv_manager.state.num_checkpoints == 1
    )
    assert engine.stats()["state_bytes"] == 3 * per_slot
    prompts = _prompts(model, [4, 9, 13, 6, 11], seed=6)
    outs = engine.generate(prompts, GREEDY)
    assert all(o.error is None for o in outs)
    _assert_clean(engine)
    with pytest.raises(
        ValueError, match="max_num_seqs=64 sequences' state and 32 prefix checkpoints take"
    ):
        paged_hf.Engine(model, kv_cache_memory=6 * per_slot, max_num_seqs=64)


def test_a_block_shared_across_layers_keeps_a_kv_per_application():
    """Zamba2 applies one attention block at several depths: one module per application, weights tied,
    all with layer_idx -1. patch gives each the layer transformers' own cache keeps its KV under."""
    from paged_hf.execution.attention import LAYER_ATTR

    model = build_tiny_model("zamba2")
    shared = [model.model.layers[i].shared_transformer.self_attn for i in (1, 3)]
    assert [m.layer_idx for m in shared] == [-1, -1] and shared[0].q_proj.weight is shared[
        1
    ].q_proj.weight
    paged_hf.patch(model)
    assert patch_state(model).layout.layer_ids == (1, 3)
    assert [getattr(m, LAYER_ATTR) for m in shared] == [1, 3]
    paged_hf.unpatch(model)
    assert not any(hasattr(m, LAYER_ATTR) for m in shared)


def test_state_kept_in_the_models_own_cache_class_runs_through_its_own_methods():
    """MiniMax's linear attention keeps its state through MiniMaxCache.get_linear_cache /
    set_linear_cache: the probe finds the pair and the state's shape, the step's view has it too."""
    model = build_tiny_model("minimax")
    paged_hf.patch(model)
    state = patch_state(model).state
    cfg = model.config
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    assert {m.own_methods for m in state.mixers} == {(("get_linear_cache", "set_linear_cache"),)}
    assert {m.recurrent for m in state.mixers} == {((cfg.num_attention_heads, head_dim, head_dim),)}
    assert state.continues_chunks


def test_a_mixer_that_cannot_continue_a_chunk_goes_on_token_by_token():
    # Mamba1: a multi-token chunk over a populated cache drops the state
    model = build_tiny_model("jamba")
    paged_hf.patch(model)
    assert not patch_state(model).state.continues_chunks
    qwen = build_tiny_model("qwen3_5_text")
    paged_hf.patch(qwen)
    assert patch_state(qwen).state.continues_chunks
