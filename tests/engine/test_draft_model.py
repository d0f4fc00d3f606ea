"""Speculative decoding by a draft model (issue 58; transformers' ``assistant_model``): the step's
asking decodes run as one batch in the draft model's own engine, and the target's step verifies
what it proposes as it verifies prompt lookup's (tests/engine/test_speculation.py). Greedy rows
give a plain run's tokens and transformers' greedy picks (teacher-forced, fp32), on three
families, with a draft that agrees with the target (the same weights) and one that rarely does,
in one batch with rows of other draft sizes and none, through EOS and length limits inside a
draft, under preemption and from both prefix caches; both engines' refcounts are checked after
every step. A draft model that fails costs its rows their drafts, never a token."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from engine_state import assert_clean, checked
from oracle import assert_teacher_forced
from test_speculation import (
    assert_two_token_odds,
    drafting_pays,
    repeat_a_passage,
    repetitive_prompts,
    rows_stopped_inside_drafts,
    two_token_odds,
)
from tiny_models import make_tiny_model

import paged_hf
from paged_hf import SamplingParams
from paged_hf.model.support import build_tiny_model

NEW = 24


def plain_tokens(model, prompts, **params) -> list[list[int]]:
    engine = paged_hf.Engine(model, block_size=4)
    base = dict(max_new_tokens=NEW, ignore_eos=True) | params
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(**base))]


def drafting_engine(model, draft, **config) -> paged_hf.Engine:
    """An engine drafting with ``draft``, both engines' tables checked after every step, and
    every draft paying (the draft's steps free) whatever the machine."""
    engine = drafting_pays(
        checked(paged_hf.Engine(model, block_size=4, draft_model=draft, **config))
    )
    drafter = engine.scheduler.drafter
    checked(drafter.engine)
    drafter.step_cost = lambda rows: 1e-6
    return engine


def run(engine, prompts, params) -> list[list[int]]:
    outs = engine.generate(prompts, params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def assert_both_clean(engine) -> None:
    assert_clean(engine)
    assert_clean(engine.scheduler.drafter.engine)


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma2"])
def family(request):
    return request.param


@pytest.mark.parametrize("agrees", [True, False], ids=["same-weights", "other-weights"])
def test_greedy_drafts_give_the_plain_tokens(family, agrees):
    model = make_tiny_model(family)
    draft = make_tiny_model(family, seed=0 if agrees else 1)  # the same weights, or others
    prompts = repetitive_prompts(model.config.vocab_size)
    plain = plain_tokens(model, prompts)
    ks = [8, 3, 0]  # one batch: rows drafting up to 8, 3 and no tokens
    params = [
        SamplingParams(max_new_tokens=NEW, ignore_eos=True, num_assistant_tokens=k) for k in ks
    ]
    engine = drafting_engine(model, draft)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    for prompt, out in zip(prompts, outs):
        assert_teacher_forced(model, prompt, out.token_ids, what="draft model")
    assert [o.draft_tokens_proposed > 0 for o in outs] == [True, True, False]
    taken = sum(o.draft_tokens_accepted for o in outs)
    proposed = sum(o.draft_tokens_proposed for o in outs)
    if agrees:  # the same weights propose the target's own picks
        assert taken == proposed
    else:
        assert taken < proposed
    assert engine.stats()["draft_tokens_proposed"] == proposed
    assert_both_clean(engine)


def test_rows_end_on_eos_and_length_inside_a_draft():
    """EOS a token a plain run first emits well inside its output, where a draft that agrees
    with the target proposes it (a draft stops before it); lengths not a multiple of k; EOS
    banned up to min_new_tokens, whose boundary a draft must not straddle."""
    model = make_tiny_model("llama")
    prompts = repetitive_prompts(model.config.vocab_size, seed=1)
    row = plain_tokens(model, prompts)[0]
    eos = [next(t for i, t in enumerate(row) if i >= 7 and t not in row[:i])]
    engine = drafting_engine(model, make_tiny_model("llama"))
    for new, least in [(5, 0), (11, 0), (NEW, 0), (NEW, 3), (NEW, 8), (NEW, 13)]:
        base = dict(max_new_tokens=new, min_new_tokens=least, stop_token_ids=eos)
        want = plain_tokens(model, prompts, **base, ignore_eos=False)
        got = run(engine, prompts, SamplingParams(**base, num_assistant_tokens=6))
        assert got == want, (new, least)
    assert engine.stats()["draft_tokens_accepted"] > 0
    assert_both_clean(engine)


def test_preemption_and_prefix_hits_on_drafting_rows():
    model = make_tiny_model("llama")
    prompts = repetitive_prompts(model.config.vocab_size, seed=2)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, num_assistant_tokens=5)
    plain = plain_tokens(model, prompts)
    # a target pool too small for every row at once: rows preempt one another and recompute
    small = drafting_engine(model, make_tiny_model("llama", seed=1), num_blocks=14, max_num_seqs=3)
    assert run(small, prompts, params) == plain and small.stats()["preemptions"] > 0
    assert_both_clean(small)
    # again from the prefix caches; then prompts through the first outputs, whose cached blocks
    # must hold only verified tokens' KV (the plain run on a fresh engine is the reference)
    engine = drafting_engine(model, make_tiny_model("llama"))
    first = run(engine, prompts, params)
    draft_engine = engine.scheduler.drafter.engine
    draft_hits = draft_engine.stats()["prefix_hit_tokens"]
    assert run(engine, prompts, params) == first == plain
    assert engine.stats()["prefix_hit_tokens"] > 0
    assert draft_engine.stats()["prefix_hit_tokens"] > draft_hits  # its KV carried over
    longer = [p + t[:13] for p, t in zip(prompts, first)]
    assert run(engine, longer, params) == plain_tokens(model, longer)
    assert_both_clean(engine)


def test_a_failing_draft_model_costs_its_rows_their_drafts_not_a_token(monkeypatch):
    """The draft's forward raises on some steps: the target's rows go on, with the plain tokens,
    and neither engine leaks a block."""
    model = make_tiny_model("llama")
    prompts = repetitive_prompts(model.config.vocab_size, seed=3)
    engine = drafting_engine(model, make_tiny_model("llama"))
    runner = engine.scheduler.drafter.engine.runner
    execute, calls = runner.execute, [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] % 3 == 0:
            raise RuntimeError("injected draft failure")
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", flaky)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, num_assistant_tokens=4)
    assert run(engine, prompts, params) == plain_tokens(model, prompts)
    assert engine.stats()["draft_model"]["failures"] == engine.scheduler.drafter.failures > 0
    assert engine.stats()["draft_tokens_accepted"] > 0
    assert_both_clean(engine)


def test_what_a_draft_model_needs_is_checked_by_name():
    model = make_tiny_model("llama")
    plain = paged_hf.Engine(model, block_size=4)
    with pytest.raises(ValueError, match="num_assistant_tokens needs a draft model"):
        plain.add_request([5, 6, 7], SamplingParams(num_assistant_tokens=3))
    with pytest.raises(ValueError, match="one proposer"):
        SamplingParams(num_assistant_tokens=3, prompt_lookup_num_tokens=3)
    with pytest.raises(NotImplementedError, match="num_assistant_tokens with n=2"):
        SamplingParams(num_assistant_tokens=3, n=2)
    small = make_tiny_model("llama")
    small.config.vocab_size -= 1  # what a different tokenizer looks like to the engine
    with pytest.raises(ValueError, match="needs the same tokenizer"):
        paged_hf.Engine(model, block_size=4, draft_model=small)
    hybrid = build_tiny_model("jamba")  # its state cannot take back rejected tokens
    with pytest.raises(ValueError, match="hybrid"):
        paged_hf.Engine(hybrid, draft_model=build_tiny_model("jamba"))
    with pytest.raises(ValueError, match="num_assistant_tokens on a model with recurrent"):
        paged_hf.Engine(hybrid).add_request([5, 6, 7], SamplingParams(num_assistant_tokens=3))


def test_generate_with_assistant_model_is_transformers_assisted_greedy_search():
    """A patched model's ``generate(assistant_model=...)`` gives transformers' own tokens (which
    are its greedy search's), for a batch transformers runs one row at a time."""
    model = make_tiny_model("qwen3")
    draft = make_tiny_model("qwen3", seed=1)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(4, model.config.vocab_size, (2, 11), generator=g)
    expected = [
        model.generate(row[None], max_new_tokens=NEW, do_sample=False, assistant_model=draft)
        for row in ids
    ]
    patched = paged_hf.patch(model)
    try:
        out = patched.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft)
        stats = paged_hf.engine_for(patched).stats()
        with pytest.raises(NotImplementedError, match="assistant_model with stopping criteria"):
            patched.generate(ids, max_new_tokens=4, assistant_model=draft, max_time=10.0)
    finally:
        paged_hf.unpatch(model)
    assert torch.equal(out, torch.cat(expected))
    assert stats["draft_tokens_proposed"] > 0


def test_sampled_rows_keep_the_models_distribution():
    """A greedy draft is a certain proposal: a draft token is taken where the target's draw at
    its position picks it, else the draw is kept. (first, second) over 3000 rows of a tiny model,
    against its own probabilities (temperature 0.8, top-k 3: 9 outcomes), chi-square at
    p = 0.001; the draft (the target's weights: its greedy pick) is taken often and refused often."""
    model = make_tiny_model("llama")
    prompt = repetitive_prompts(model.config.vocab_size)[2][:6]
    temperature, top_k, rows = 0.8, 3, 3000

    first, second = two_token_odds(model, prompt, temperature, top_k)
    engine = drafting_engine(model, make_tiny_model("llama"), max_num_seqs=256)
    params = SamplingParams(
        temperature=temperature, top_k=top_k, max_new_tokens=3, num_assistant_tokens=1
    )
    torch.manual_seed(0)
    counts = Counter(tuple(o.token_ids[:2]) for o in engine.generate([prompt] * rows, params))
    stats = engine.stats()
    assert stats["draft_tokens_proposed"] == rows
    assert 0.1 * rows < stats["draft_tokens_accepted"] < 0.9 * rows, stats
    # a new row's odds come from every verification, the rows a taken draft ended included
    taken = stats["draft_tokens_accepted"] / rows
    assert abs(engine.scheduler.drafter.prior - taken) < 0.15, (
        engine.scheduler.drafter.prior,
        taken,
    )
    assert_two_token_odds(first, second, counts, rows)
    assert_both_clean(engine)


def test_smollm2_fp32_drafted_by_its_bf16_copy_is_transformers_greedy_search(smollm2_cache):
    """Real weights: a patched SmolLM2 in fp32 with its own bf16 copy as ``assistant_model`` gives
    transformers' own fp32 greedy tokens, most of them taken from drafts."""
    from paged_hf.model.default_model import load_default_model

    model, tok = load_default_model(dtype=torch.float32, cache_dir=smollm2_cache)
    draft, _ = load_default_model(dtype=torch.bfloat16, cache_dir=smollm2_cache)
    ids = repeat_a_passage(tok)
    expected = model.generate(ids, max_new_tokens=40, do_sample=False)
    patched = paged_hf.patch(model)
    out = patched.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=draft)
    stats = paged_hf.engine_for(patched).stats()
    assert torch.equal(out, expected)
    assert stats["draft_tokens_accepted"] > 20, stats["draft_tokens_accepted"]


def test_a_draft_is_as_long_as_its_tokens_pay_for_with_the_drafts_own_steps():
    """A drafted token costs its share of a draft step besides its position in the target's step:
    drafts are shorter than prompt lookup's at the same odds, and none where a draft step costs
    what the target's does at these odds. The draft step's cost is the median of recent runs, so
    one slow run (a repacking, a busy machine) does not stop drafting for good."""
    from paged_hf.engine.draft_model import Drafter
    from paged_hf.engine.speculation import draft_costs

    free = draft_costs((0.020, 0.001, 0.0002), decode_rows=1)
    drafted = draft_costs((0.020, 0.001, 0.0002), decode_rows=1, draft_step_s=0.008)
    assert 0 < drafted.best_length(0.9, 20, drafted=True) < free.best_length(0.9, 20)
    assert drafted.best_length(0.9, 20) == free.best_length(0.9, 20)  # prompt lookup's: free
    costly = draft_costs((0.020, 0.001, 0.0002), decode_rows=1, draft_step_s=0.021)
    assert costly.best_length(0.9, 20, drafted=True) == 0
    drafter = Drafter(engine=None)
    assert drafter.step_s == 0.0
    drafter._recent.extend([2.0, 0.01, 0.012])
    assert drafter.step_s == 0.012


def test_the_step_time_fit_does_not_count_the_drafts_steps():
    """The engine fits its own step times (the cost rule, TPOT budgets); the draft model's runs
    happen inside scheduling and are timed apart: a draft that takes 100 s of the (fake) clock
    leaves every observed step under a second."""
    model = make_tiny_model("llama")
    engine = paged_hf.Engine(model, block_size=4, draft_model=make_tiny_model("llama"))
    now = [0.0]
    engine.scheduler.clock = lambda: now[0]
    drafter = engine.scheduler.drafter
    propose = drafter.propose

    def slow(asks):
        now[0] += 100.0
        return propose(asks)

    drafter.propose = slow
    prompts = repetitive_prompts(model.config.vocab_size)[:1]  # one row: it drafts untimed
    run(engine, prompts, SamplingParams(max_new_tokens=12, ignore_eos=True, num_assistant_tokens=3))
    observed = [seconds for _, _, seconds in engine.scheduler.step_time._rows]
    assert engine.stats()["draft_tokens_proposed"] > 0 and now[0] >= 100.0
    assert observed and max(observed) < 1.0, observed


def test_stop_strings_end_a_row_inside_a_draft_models_draft(monkeypatch):
    """A draft with the target's weights proposes the plain run's own continuation, so the stop
    strings (two tokens of each row's plain output) fall inside drafts: the rows end there with the
    plain run's tokens, reasons and text, and a watch hears each kept token."""
    from tiny_tokenizer import make_tiny_tokenizer

    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    prompts = repetitive_prompts(model.config.vocab_size, seed=4)
    stops = [tok.decode(row[9:11]) for row in plain_tokens(model, prompts)]
    inside = rows_stopped_inside_drafts(monkeypatch)

    def outputs(engine, k):
        heard: dict[str, list[int]] = {}
        params = SamplingParams(
            max_new_tokens=NEW, ignore_eos=True, stop=stops, num_assistant_tokens=k
        )
        outs = engine.generate(
            prompts, params, on_token=lambda rid, t: heard.setdefault(rid, []).append(t)
        )
        assert [heard.get(o.request_id, []) for o in outs] == [o.token_ids for o in outs]
        return [(o.token_ids, o.finish_reason, o.completions[0].stop_reason, o.text) for o in outs]

    want = outputs(paged_hf.Engine(model, tok, block_size=4), 0)
    assert not inside and all(out[1] == "stop" for out in want)
    engine = drafting_engine(model, make_tiny_model("llama"), tokenizer=tok)
    assert outputs(engine, 6) == want
    assert inside, "no stop string fell inside a draft"
    assert_both_clean(engine)


def test_a_priced_out_draft_is_tried_now_and_then_and_costs_are_known_from_the_start():
    """The draft engine times a few steps when attached (its step-time fit can exist before the
    first call); and where the costs say a draft never pays (a slow measurement, a busy machine),
    one step in EXPLORE_EVERY drafts untimed all the same, or nothing would measure again."""
    from paged_hf.engine.draft_model import EXPLORE_EVERY

    model = make_tiny_model("llama")
    engine = drafting_pays(
        paged_hf.Engine(model, block_size=4, draft_model=make_tiny_model("llama"))
    )
    drafter = engine.scheduler.drafter
    assert (
        len(drafter.engine.scheduler.step_time._rows) >= 16
    )  # (a tiny model's fit may not tell a token's cost)
    assert_clean(drafter.engine)  # calibration leaves nothing behind
    drafter.step_cost = lambda rows: 10.0  # a drafted token costs 10 s: never pays
    runs = []
    propose = drafter.propose
    drafter.propose = lambda asks: runs.append(asks) or propose(asks)
    new = 3 * EXPLORE_EVERY + 2
    prompt = repetitive_prompts(model.config.vocab_size)[:1]
    params = SamplingParams(max_new_tokens=new, ignore_eos=True, num_assistant_tokens=4)
    assert run(engine, prompt, params) == plain_tokens(model, prompt, max_new_tokens=new)
    assert 2 <= len(runs) <= 4, len(runs)  # about one a EXPLORE_EVERY steps, no more
