"""Logits processors, ``prefix_allowed_tokens_fn``, scores / logits and the options only transformers'
processor classes implement, on a patched ``generate``, against transformers' own generate.

Such a call's rows pick their tokens together with transformers' own processor list
(paged_hf/model/lock_step_calls.py ``JointCall``): each processor sees the calls transformers makes
(the same input_ids, batch positions and scores, step by step), the sequences are transformers',
and scores and logits are within 1e-4 of its own, -inf where it has -inf. Exact token comparisons
are made where the reference's processed scores have a clear winner at every step (checked).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from engine_state import assert_clean
from tiny_models import EOS_ID, left_pad, make_tiny_model, tiny_prompts
from transformers import InfNanRemoveLogitsProcessor, LogitsProcessor, LogitsProcessorList

import paged_hf

MAX_NEW = 12


class Recording(LogitsProcessor):
    """A stateful processor (outlines-style): bans, per batch position, the tokens that row made in
    earlier calls' steps, and records each call's input_ids."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []
        self.seen: dict[int, set[int]] = {}

    def __call__(self, input_ids, scores):
        self.calls.append(input_ids.clone())
        scores = scores.clone()
        for row in range(input_ids.shape[0]):
            self.seen.setdefault(row, set()).add(int(input_ids[row, -1]))
            scores[row, sorted(self.seen[row])] = -float("inf")
        return scores


class Raises(LogitsProcessor):
    def __init__(self, at_call: int) -> None:
        self.at_call, self.calls = at_call, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at_call:
            raise ZeroDivisionError("processor failed on purpose")
        return scores


@pytest.fixture(scope="module")
def pair(one_thread):
    reference = make_tiny_model("llama")
    model = paged_hf.patch(make_tiny_model("llama"))
    prompts = tiny_prompts(reference.config.vocab_size, 4, [3, 9, 17, 30], seed=3)
    return reference, model, *left_pad(prompts)


def both(reference, model, ids, mask, make_kwargs, **kwargs):
    """(ours, transformers') outputs of the same call, each with its own fresh callbacks."""
    ours_kw, theirs_kw = make_kwargs(), make_kwargs()
    torch.manual_seed(0)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=MAX_NEW,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        **ours_kw,
        **kwargs,
    )
    torch.manual_seed(0)
    expected = reference.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=MAX_NEW,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        **theirs_kw,
        **kwargs,
    )
    return out, expected, ours_kw, theirs_kw


def assert_same(out, expected, sampled=False):
    if not sampled:  # a clear winner at every step, or exact equality tests rounding
        for step, scores in enumerate(expected.scores):
            finite = scores.masked_fill(~torch.isfinite(scores), -1e30)
            top = finite.topk(2, dim=-1).values
            assert bool(((top[:, 0] - top[:, 1] > 1e-3) | (top[:, 1] < -1e29)).all()), (
                f"near-tie at step {step}"
            )
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == len(expected.scores) and len(out.logits) == len(expected.logits)
    for ours, theirs in zip(out.scores + out.logits, expected.scores + expected.logits):
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
        finite = torch.isfinite(theirs)
        assert float((ours[finite] - theirs[finite]).abs().max()) < 1e-4
        # NaN where it has NaN too: the raw logits of a model that overflows
        assert torch.allclose(ours[~finite], theirs[~finite], rtol=0, atol=0, equal_nan=True)


def test_a_stateful_processor_sees_transformers_calls(pair):
    reference, model, ids, mask = pair
    out, expected, ours, theirs = both(
        reference,
        model,
        ids,
        mask,
        lambda: {"logits_processor": LogitsProcessorList([Recording()])},
        do_sample=False,
    )
    assert_same(out, expected)
    a, b = ours["logits_processor"][0].calls, theirs["logits_processor"][0].calls
    assert len(a) == len(b) == MAX_NEW and all(torch.equal(x, y) for x, y in zip(a, b))
    assert paged_hf.engine_for(model).kv_manager.pool.num_used == 0


def test_scores_and_logits_give_transformers_transition_scores(pair):
    reference, model, ids, mask = pair
    out, expected, *_ = both(
        reference,
        model,
        ids,
        mask,
        dict,
        do_sample=False,
        repetition_penalty=1.3,
        eos_token_id=EOS_ID,
    )
    assert_same(out, expected)
    ours = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    theirs = reference.compute_transition_scores(
        expected.sequences, expected.scores, normalize_logits=True
    )
    assert torch.allclose(ours, theirs, atol=1e-4)


def test_prefix_allowed_tokens_fn(pair):
    """lm-format-enforcer's way in: allowed tokens per (batch id, prefix)."""
    reference, model, ids, mask = pair
    calls = {"ours": [], "theirs": []}

    def make(who):
        def allowed(batch_id, prefix):
            calls[who].append((batch_id, prefix.tolist()))
            return [t for t in range(4, 512) if (t + int(prefix[-1]) + batch_id) % 5 == 0]

        return allowed

    who = iter(["ours", "theirs"])
    out, expected, *_ = both(
        reference,
        model,
        ids,
        mask,
        lambda: {"prefix_allowed_tokens_fn": make(next(who))},
        do_sample=False,
    )
    assert_same(out, expected)
    assert calls["ours"] == calls["theirs"]


@pytest.mark.parametrize(
    "options",
    [
        dict(no_repeat_ngram_size=2),
        dict(encoder_no_repeat_ngram_size=2),
        dict(bad_words_ids=[[271], [121, 155]]),
        dict(sequence_bias={(271,): -5.0, (340,): 3.0}),
        dict(forced_bos_token_id=7),
        dict(forced_eos_token_id=EOS_ID),
        dict(exponential_decay_length_penalty=(3, 1.5), eos_token_id=EOS_ID),
        dict(renormalize_logits=True),
        dict(remove_invalid_values=True),
        dict(min_new_tokens=5, eos_token_id=EOS_ID, suppress_tokens=[9, 10]),
    ],
)
def test_options_only_transformers_processors_implement(pair, options):
    reference, model, ids, mask = pair
    if "forced_bos_token_id" in options:
        # ForcedBOSTokenLogitsProcessor acts only at cur_len == 1: one-token prompts
        ids, mask = ids[:, -1:], mask[:, -1:]
    # InfNanRemoveLogitsProcessor has work only where the logits are not finite
    logits = (
        invalid_logits(reference, model)
        if options.get("remove_invalid_values")
        else contextlib.nullcontext()
    )
    with logits:
        out, expected, *_ = both(reference, model, ids, mask, dict, do_sample=False, **options)
        # without scores or logits asked for, the option alone sends the call to transformers'
        # processors
        plain = model.generate(
            ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, **options
        )
        without = reference.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=MAX_NEW,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
        )
    assert not same_result(expected, without), f"{options} do nothing to transformers here"
    assert_same(out, expected)
    assert torch.equal(plain, expected.sequences)


def same_result(a, b) -> bool:
    return (
        torch.equal(a.sequences, b.sequences)
        and len(a.scores) == len(b.scores)
        and all(
            torch.allclose(x, y, rtol=0, atol=0, equal_nan=True) for x, y in zip(a.scores, b.scores)
        )
    )


@contextlib.contextmanager
def invalid_logits(*models):
    """Logits with NaN and -inf in them (an fp16 overflow's), on every model given. A logits
    processor cannot put them there for the option: transformers runs callers' processors after
    its InfNanRemoveLogitsProcessor."""

    def overflow(_module, _args, logits):
        logits = logits.clone()
        logits[..., 271] = float("nan")
        logits[..., 300] = -float("inf")
        return logits

    hooks = [m.lm_head.register_forward_hook(overflow) for m in models]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize(
    "options",
    [
        dict(typical_p=0.6),
        dict(epsilon_cutoff=3e-3),
        dict(eta_cutoff=3e-3),
        dict(top_k=20, top_p=0.8, temperature=0.7),
    ],
)
def test_sampling_warpers_draw_what_transformers_draws(pair, options):
    """Drawn from torch's default generator as transformers draws: seeded the same, the same tokens."""
    reference, model, ids, mask = pair
    out, expected, *_ = both(reference, model, ids, mask, dict, do_sample=True, **options)
    assert_same(out, expected, sampled=True)


def test_llama_factorys_inf_nan_processor_and_samples_per_prompt(pair):
    """num_return_sequences: [batch * n] rows, each prompt's samples side by side."""
    reference, model, ids, mask = pair
    out, expected, *_ = both(
        reference,
        model,
        ids,
        mask,
        lambda: {"logits_processor": LogitsProcessorList([InfNanRemoveLogitsProcessor()])},
        do_sample=True,
        num_return_sequences=3,
        top_k=0,
    )
    assert out.sequences.shape[0] == 12
    assert_same(out, expected, sampled=True)


def test_a_small_pool_preempts_rows_waiting_for_their_call(pair):
    reference, _, ids, mask = pair
    model = paged_hf.patch(
        make_tiny_model("llama"), block_size=4, num_blocks=14, max_num_batched_tokens=16
    )
    out, expected, *_ = both(
        reference,
        model,
        ids,
        mask,
        lambda: {"logits_processor": LogitsProcessorList([Recording()])},
        do_sample=False,
    )
    assert_same(out, expected)
    engine = paged_hf.engine_for(model)
    assert engine.stats()["preemptions"] > 0 and engine.kv_manager.pool.num_used == 0


def test_a_processor_that_raises_ends_its_call_alone(pair):
    reference, model, ids, mask = pair
    engine = paged_hf.engine_for(model)
    prompt = [7, 8, 9, 10, 11]
    params = paged_hf.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    alone = engine.generate([prompt], params)[0].token_ids
    rid = engine.add_request(prompt, params)
    with pytest.raises(ZeroDivisionError, match="on purpose"):
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=MAX_NEW,
            do_sample=False,
            logits_processor=LogitsProcessorList([Raises(at_call=3)]),
        )
    # the bystander stepped beside the call and was still running when the call failed
    bystander = engine.requests[rid]
    assert bystander.num_output_tokens > 0 and not bystander.is_finished
    other = engine.run_until_done([rid])[0]
    assert other.error is None and other.token_ids == alone
    assert_clean(engine)
