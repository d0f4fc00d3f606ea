"""``output_hidden_states`` on a patched ``generate`` against transformers' own: every layer's states
at the prompt's positions and at each generated token's, within 1e-4 in fp32, through chunked
prefill, preemption and a warm prefix cache; only the rows that ask pay for them."""

from __future__ import annotations

import pytest
import torch
from engine_state import assert_clean
from oracle import assert_hidden_states_close
from tiny_models import EOS_ID, left_pad, make_tiny_model, tiny_prompts

import paged_hf
from paged_hf import SamplingParams

MAX_NEW = 12


@pytest.fixture(scope="module")
def pair(one_thread):
    reference = make_tiny_model("llama")
    prompts = tiny_prompts(reference.config.vocab_size, 4, [3, 9, 17, 30], seed=21)
    return reference, *left_pad(prompts)


def both(reference, model, ids, mask, **kw):
    kw = dict(max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True) | kw
    return (
        model.generate(ids, attention_mask=mask, output_hidden_states=True, **kw),
        reference.generate(ids, attention_mask=mask, output_hidden_states=True, **kw),
    )


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"block_size": 4, "max_num_batched_tokens": 8},  # prompts in chunks
        {"block_size": 4, "num_blocks": 18, "max_num_batched_tokens": 16},  # preempted
    ],
    ids=["roomy", "chunked", "small pool"],
)
def test_hidden_states_are_transformers(pair, options):
    reference, ids, mask = pair
    model = paged_hf.patch(make_tiny_model("llama"), **options)
    engine = paged_hf.engine_for(model)
    bystander = engine.add_request(
        tiny_prompts(512, 1, 20, seed=5)[0], SamplingParams(max_new_tokens=20, ignore_eos=True)
    )
    ours, theirs = both(reference, model, ids, mask)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert_hidden_states_close(ours, theirs, mask, EOS_ID)
    (other,) = engine.run_until_done([bystander])
    assert other.hidden_states is None and other.error is None  # it did not ask: it paid nothing
    if "num_blocks" in options:
        assert engine.stats()["preemptions"] > 0
    assert_clean(engine)


def test_with_scores_and_a_warm_prefix_cache(pair):
    """The call's rows picking their tokens with transformers' processors (output_scores), after
    the same prompts were cached: the prompts are computed again for their states."""
    reference, ids, mask = pair
    model = paged_hf.patch(make_tiny_model("llama"), block_size=4)
    model.generate(ids, attention_mask=mask, max_new_tokens=2)
    ours, theirs = both(reference, model, ids, mask, output_scores=True, eos_token_id=None)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert_hidden_states_close(ours, theirs, mask, EOS_ID)
    assert len(ours.scores) == len(theirs.scores)


def test_beams_and_several_sequences_are_refused_naming_it(pair):
    _, ids, mask = pair
    model = paged_hf.patch(make_tiny_model("llama"))
    for kw in ({"num_beams": 2}, {"do_sample": True, "num_return_sequences": 2}):
        with pytest.raises(NotImplementedError, match="output_hidden_states"):
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=4,
                output_hidden_states=True,
                return_dict_in_generate=True,
                **kw,
            )
    assert_clean(paged_hf.engine_for(model))
