"""Beam search on a patched ``generate`` against transformers' own (paged_hf/model/beam_call.py).

2 to 8 beams, with and without EOS, with num_return_sequences, in the three early_stopping modes,
with length penalties: the same sequences, beam indices and sequence scores (1e-4) as transformers.
A prompt's beams share its blocks (held once, not once per beam); beam groups survive preemption,
take prefix-cache hits on their prompt, and a processor that raises ends its call alone.
"""

from __future__ import annotations

import pytest
import torch
from engine_state import assert_clean
from tiny_models import PAD_ID, left_pad, make_tiny_model, tiny_prompts
from transformers import LogitsProcessor, LogitsProcessorList

import paged_hf

EOS_SET = list(range(1, 512, 7))  # many EOS ids: beams finish at different lengths


@pytest.fixture(scope="module")
def pair(one_thread):
    reference = make_tiny_model("llama")
    model = paged_hf.patch(make_tiny_model("llama"))
    return (
        reference,
        model,
        *left_pad(tiny_prompts(reference.config.vocab_size, 3, [4, 9, 17], seed=3)),
    )


def both(reference, model, ids, mask, **kwargs):
    kw = (
        dict(
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
        )
        | kwargs
    )
    return model.generate(ids, **kw), reference.generate(ids, **kw)


def assert_same(out, expected):
    assert torch.equal(out.sequences, expected.sequences)
    assert torch.equal(out.beam_indices, expected.beam_indices)
    assert torch.allclose(out.sequences_scores, expected.sequences_scores, atol=1e-4)
    for a, b in zip(out.scores, expected.scores, strict=True):
        finite = torch.isfinite(b)
        assert (
            torch.equal(torch.isfinite(a), finite)
            and float((a[finite] - b[finite]).abs().max()) < 1e-4
        )


@pytest.mark.parametrize(
    "beams,options",
    [
        (2, {}),
        (4, {}),
        (8, {}),
        (4, dict(eos_token_id=EOS_SET)),
        (4, dict(eos_token_id=EOS_SET, num_return_sequences=3)),
        (3, dict(eos_token_id=EOS_SET, early_stopping=True, max_new_tokens=12)),
        (3, dict(eos_token_id=EOS_SET, early_stopping="never", length_penalty=2.0)),
        (5, dict(eos_token_id=EOS_SET, early_stopping=False, length_penalty=-1.0)),
    ],
)
def test_beam_search_is_transformers(pair, beams, options):
    reference, model, ids, mask = pair
    out, expected = both(reference, model, ids, mask, num_beams=beams, **options)
    assert_same(out, expected)
    assert paged_hf.engine_for(model).kv_manager.pool.num_used == 0


def test_beam_sampling_draws_what_transformers_draws(pair):
    reference, model, ids, mask = pair
    torch.manual_seed(1)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=8,
        num_beams=3,
        do_sample=True,
        top_k=20,
        return_dict_in_generate=True,
        output_scores=True,
    )
    torch.manual_seed(1)
    expected = reference.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=8,
        num_beams=3,
        do_sample=True,
        top_k=20,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert_same(out, expected)


def test_a_prompts_beams_hold_its_blocks_once():
    """One 40-token prompt (two full 16-token blocks and a partial one), 8 beams, 4 new tokens: the two
    full blocks are held once; each beam holds at most its own copy of the last block (24 without
    sharing)."""
    reference = make_tiny_model("llama")
    model = paged_hf.patch(make_tiny_model("llama"), block_size=16)
    ids = torch.tensor([tiny_prompts(reference.config.vocab_size, 1, [40], seed=5)[0]])
    out = model.generate(ids, max_new_tokens=4, num_beams=8, do_sample=False)
    assert torch.equal(out, reference.generate(ids, max_new_tokens=4, num_beams=8, do_sample=False))
    stats = paged_hf.engine_for(model).stats()
    assert stats["peak_blocks_used"] <= 2 + 8, stats["peak_blocks_used"]
    # each full prompt block: 7 references that are not copies
    assert stats["peak_blocks_shared"] >= 2 * 7


def test_beam_groups_survive_preemption_and_hit_the_prefix_cache(pair):
    reference, _, ids, mask = pair
    model = paged_hf.patch(
        make_tiny_model("llama"), block_size=4, num_blocks=24, max_num_batched_tokens=16
    )
    out, expected = both(reference, model, ids, mask, num_beams=4, eos_token_id=EOS_SET)
    assert_same(out, expected)
    engine = paged_hf.engine_for(model)
    assert engine.stats()["preemptions"] > 0 and engine.kv_manager.pool.num_used == 0
    hits = engine.stats()["prefix_hit_tokens"]
    again, _ = both(reference, model, ids, mask, num_beams=4, eos_token_id=EOS_SET)
    assert_same(again, expected)
    assert engine.stats()["prefix_hit_tokens"] > hits, (
        "the second call's beams took their prompts from the cache"
    )


class Raises(LogitsProcessor):
    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > 19:
            raise OverflowError("beam processor failed on purpose")
        return scores


def test_a_processor_that_raises_ends_its_beam_call_alone(pair):
    _, model, ids, mask = pair
    engine = paged_hf.engine_for(model)
    params = paged_hf.SamplingParams(max_new_tokens=10, ignore_eos=True)
    alone = engine.generate([[7, 8, 9]], params)[0].token_ids
    rid = engine.add_request([7, 8, 9], params)
    with pytest.raises(OverflowError, match="on purpose"):
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=10,
            num_beams=4,
            logits_processor=LogitsProcessorList([Raises()]),
        )
    # the bystander stepped beside the beams and was still running when their call failed
    bystander = engine.requests[rid]
    assert bystander.num_output_tokens > 0 and not bystander.is_finished
    other = engine.run_until_done([rid])[0]
    assert other.error is None and other.token_ids == alone
    assert_clean(engine)


def test_beam_search_on_a_stateful_model_is_refused_naming_it():
    from paged_hf.model.support import build_tiny_model

    model = paged_hf.patch(build_tiny_model("qwen3_next"))
    with pytest.raises(NotImplementedError, match="beam search"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, num_beams=2)


def test_the_engines_own_beam_search_is_transformers(pair):
    """Engine.beam_search on token-id prompts of different lengths: per prompt, transformers' best
    hypotheses (its sequences past the prompt, to their EOS) and scores, best first."""
    reference, model, ids, mask = pair
    engine = paged_hf.engine_for(model)
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    got = engine.beam_search(
        prompts, num_beams=4, max_new_tokens=10, num_return_sequences=2, eos_token_ids=EOS_SET
    )
    expected = reference.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=10,
        num_beams=4,
        num_return_sequences=2,
        eos_token_id=EOS_SET,
        pad_token_id=PAD_ID,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    width = ids.shape[1]
    lengths = ((expected.beam_indices + 1).bool()).sum(dim=1).tolist()
    for i, hypotheses in enumerate(got):
        assert len(hypotheses) == 2
        for k, (tokens, score) in enumerate(hypotheses):
            j = 2 * i + k
            assert tokens == expected.sequences[j, width : width + lengths[j]].tolist()
            assert abs(score - float(expected.sequences_scores[j])) < 1e-4
    assert any(h[0][0][-1] in EOS_SET for h in got), "some hypothesis ended on EOS"
    assert engine.kv_manager.pool.num_used == 0
    with pytest.raises(ValueError, match="num_return_sequences"):
        engine.beam_search(prompts, num_beams=2, num_return_sequences=3)
