"""``stopping_criteria`` and ``max_time`` on a patched ``generate``, against transformers' own generate.

A criterion sees what transformers shows it (the call's rows as padded, the generated tokens, pad
after a finished row), once per step, and its answer (one bool for the call or one per row) ends
the same rows at the same steps: the criteria's whole call history equals transformers', and so do
the returned sequences. Where the reference's greedy path passes a near-tie (top two logits within
1e-3), exact equality would test rounding, not semantics: the prompts here are checked to have none.
"""

from __future__ import annotations

import pytest
import torch
from engine_state import assert_clean
from tiny_models import EOS_ID, PAD_ID, left_pad, make_tiny_model, tiny_prompts
from transformers import StoppingCriteria, StoppingCriteriaList, StopStringCriteria

import paged_hf

MAX_NEW = 20


class LastTokenIn(StoppingCriteria):
    """A row's last token in ``tokens``: per row (a [batch] tensor), or for the whole call (one bool):
    ``any`` row now, or (``tracker``, lm-eval's way) every row at some step so far. Records each call."""

    def __init__(self, tokens: set[int], mode: str = "row") -> None:
        self.tokens, self.mode, self.calls, self.done = tokens, mode, [], None

    def __call__(self, input_ids, scores, **kwargs):
        assert scores is None  # transformers passes None where output_scores is off
        self.calls.append(input_ids.clone())
        hit = torch.tensor([int(t) in self.tokens for t in input_ids[:, -1]])
        if self.mode == "row":
            return hit
        if self.mode == "any":
            return bool(hit.any())
        self.done = hit if self.done is None else self.done | hit
        return bool(self.done.all())


class Raises(StoppingCriteria):
    def __init__(self, at_call: int) -> None:
        self.at_call, self.calls = at_call, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at_call:
            raise KeyError("criterion failed on purpose")
        return False


@torch.no_grad()
def assert_no_near_ties(reference, ids, mask, max_new=MAX_NEW, tol=1e-3):
    """The reference's greedy path has a clear winner at every step (exact comparisons are fair)."""
    out = reference.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    for step, logits in enumerate(out.logits):
        top = logits.float().topk(2, dim=-1).values
        assert bool((top[:, 0] - top[:, 1] > tol).all()), (
            f"near-tie at step {step}: pick other prompts"
        )


def _models(family="llama"):
    return make_tiny_model(family), paged_hf.patch(make_tiny_model(family))


def _run_both(reference, model, ids, mask, make_criteria, **kwargs):
    ours, theirs = make_criteria(), make_criteria()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=MAX_NEW,
        do_sample=False,
        stopping_criteria=StoppingCriteriaList(ours),
        **kwargs,
    )
    expected = reference.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=MAX_NEW,
        do_sample=False,
        stopping_criteria=StoppingCriteriaList(theirs),
        **kwargs,
    )
    return out, expected, ours, theirs


def _same_calls(ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        assert len(a.calls) == len(b.calls), (len(a.calls), len(b.calls))
        for x, y in zip(a.calls, b.calls):
            assert torch.equal(x, y)


PROMPTS = dict(vocab=512, n=4, lengths=[3, 9, 17, 30], seed=3)


@pytest.fixture(scope="module")
def llama_pair(one_thread):
    reference, model = _models()
    prompts = tiny_prompts(reference.config.vocab_size, 4, PROMPTS["lengths"], seed=PROMPTS["seed"])
    ids, mask = left_pad(prompts)
    assert_no_near_ties(reference, ids, mask)
    return reference, model, ids, mask


@pytest.mark.parametrize("eos", ["model's", None])
@pytest.mark.parametrize("mode", ["row", "any", "tracker"])
def test_criteria_see_and_stop_as_under_transformers(llama_pair, mode, eos):
    """Per-row (rows it stops show pad, the others go on), any-row and all-rows batch-level
    criteria (rows that met their own stop run on until every row has): same sequences, and every
    call of the criterion saw the same input_ids. Without an EOS (lm-eval's calls), transformers
    shows no pad after a row's stop: every row runs on until the call ends, and ends with it."""
    reference, model, ids, mask = llama_pair
    tokens = {
        t for t in range(0, 512, 3)
    }  # about a third of the vocabulary: rows stop at different steps
    kwargs = {} if eos else {"eos_token_id": None}
    out, expected, ours, theirs = _run_both(
        reference, model, ids, mask, lambda: [LastTokenIn(tokens, mode)], **kwargs
    )
    assert torch.equal(out, expected)
    _same_calls(ours, theirs)
    assert 1 < len(ours[0].calls) < MAX_NEW
    assert paged_hf.engine_for(model).kv_manager.pool.num_used == 0


def test_stop_string_criteria_and_eos_with_a_criterion(llama_pair):
    """transformers' StopStringCriteria passed as a criterion (per row, on the decoded text), beside
    the model's EOS: rows end at the same tokens."""
    from tiny_tokenizer import make_tiny_tokenizer

    reference, model, ids, mask = llama_pair
    tok = make_tiny_tokenizer()
    text = tok.decode(
        reference.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)[
            2, ids.shape[1] :
        ]
    )
    stop = text[4:6]  # two characters the third row makes mid-way
    out, expected, *_ = _run_both(
        reference, model, ids, mask, lambda: [StopStringCriteria(tok, [stop])], eos_token_id=EOS_ID
    )
    assert torch.equal(out, expected)
    assert (out[2, ids.shape[1] :] == PAD_ID).any(), "the stop string ended the third row early"


def test_lm_evals_own_stop_sequences_criteria_on_smollm2(smollm2_fp32):
    """lm-eval's HF backend passes its MultiTokenEOSCriteria (one per stop sequence, tracking each
    row and answering "every row is done"): the same sequences as transformers, on real weights."""
    from lm_eval.models.utils_hf import stop_sequences_criteria

    model, tok = smollm2_fp32
    questions = [
        "Question: What is 2+2?\nAnswer:",
        "Question: Name a colour.\nAnswer:",
        "Question: What is 3+5?\nAnswer:",
    ]
    tok.padding_side = "left"
    batch = tok(questions, return_tensors="pt", padding=True)
    ids, mask = batch.input_ids, batch.attention_mask
    make = lambda: stop_sequences_criteria(tok, ["\n", "Question:"], ids.shape[1], ids.shape[0])  # noqa: E731
    expected = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=24,
        do_sample=False,
        stopping_criteria=make(),
        pad_token_id=tok.pad_token_id,
    )
    patched = paged_hf.patch(model)
    try:
        ours = make()
        out = patched.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=24,
            do_sample=False,
            stopping_criteria=ours,
            pad_token_id=tok.pad_token_id,
        )
    finally:
        paged_hf.unpatch(model)
    assert torch.equal(out, expected)
    assert all(ours[0].done_tracker)  # every row met "\n", so the call ended
    assert out.shape[1] < ids.shape[1] + 24, "the stop sequences ended the call early"


def test_max_time_is_honoured():
    """max_time=0: transformers' MaxTimeCriteria ends the call after its first step."""
    reference, model = _models()
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    out = model.generate(ids, max_new_tokens=8, do_sample=False, max_time=0.0)
    expected = reference.generate(ids, max_new_tokens=8, do_sample=False, max_time=0.0)
    assert out.shape == expected.shape == (2, 4) and torch.equal(out, expected)


def test_rows_whose_prefill_ends_first_wait_for_their_call(llama_pair):
    """A small token budget chunks the long prompts' prefill over several steps while the short
    ones decode (a roomy pool: nothing is preempted): the rows that could run ahead wait for their
    call's others, so the criteria stop each row where transformers stops it."""
    reference, _, ids, mask = llama_pair
    model = paged_hf.patch(make_tiny_model("llama"), block_size=4, max_num_batched_tokens=8)
    tokens = {t for t in range(0, 512, 4)}
    out, expected, ours, theirs = _run_both(
        reference, model, ids, mask, lambda: [LastTokenIn(tokens, "row")]
    )
    assert torch.equal(out, expected)
    _same_calls(ours, theirs)
    engine = paged_hf.engine_for(model)
    assert engine.stats()["preemptions"] == 0
    assert_clean(engine)


def test_a_small_pool_preempts_rows_held_in_lock_step(llama_pair):
    """Rows that wait for their call's others keep their blocks, or lose them to preemption and
    recompute: the same sequences either way."""
    reference, _, ids, mask = llama_pair
    model = paged_hf.patch(
        make_tiny_model("llama"), block_size=4, num_blocks=14, max_num_batched_tokens=16
    )
    tokens = {t for t in range(0, 512, 4)}
    out, expected, ours, theirs = _run_both(
        reference, model, ids, mask, lambda: [LastTokenIn(tokens, "row")]
    )
    assert torch.equal(out, expected)
    _same_calls(ours, theirs)
    engine = paged_hf.engine_for(model)
    assert engine.stats()["preemptions"] > 0 and engine.kv_manager.pool.num_used == 0


def test_samples_of_one_prompt_are_rows_of_their_own():
    """num_return_sequences: the criterion sees [batch * n, length], each prompt's samples side by
    side, and stops each sample alone."""
    model = paged_hf.patch(make_tiny_model("llama"))
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    crit = LastTokenIn({t for t in range(0, 512, 3)}, "row")
    out = model.generate(
        ids,
        max_new_tokens=12,
        do_sample=True,
        num_return_sequences=3,
        top_k=0,
        stopping_criteria=StoppingCriteriaList([crit]),
        eos_token_id=EOS_ID,
    )
    assert out.shape[0] == 6 and all(c.shape[0] == 6 for c in crit.calls)
    assert torch.equal(crit.calls[0][:, :4], ids.repeat_interleave(3, dim=0))
    for row in out[:, 4:].tolist():
        ends = [i for i, t in enumerate(row) if t % 3 == 0 and t != PAD_ID or t == EOS_ID]
        end = ends[0] if ends else len(row) - 1
        assert all(t == PAD_ID for t in row[end + 1 :]), row


def test_a_criterion_that_raises_ends_its_call_alone(llama_pair):
    """The call raises the criterion's own error; a request sharing its steps gets the tokens it
    gets alone; no block leaks."""
    reference, model, ids, mask = llama_pair
    engine = paged_hf.engine_for(model)
    other_prompt = [7, 8, 9, 10, 11]
    params = paged_hf.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    alone = engine.generate([other_prompt], params)[0].token_ids
    rid = engine.add_request(other_prompt, params)
    with pytest.raises(KeyError, match="on purpose"):
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=MAX_NEW,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([Raises(at_call=3)]),
        )
    assert engine.requests[rid].num_output_tokens >= 3, "the other request shared the call's steps"
    other = engine.run_until_done([rid])[0]
    assert other.error is None and other.token_ids == alone
    assert engine.kv_manager.pool.num_used == 0
