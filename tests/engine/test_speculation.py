"""Speculative decoding by prompt lookup (issue 58): each decode step of a speculating row
verifies its proposal in the same forward as its pending token. Greedy rows give the tokens a
plain run gives and transformers' greedy ``generate`` picks (teacher-forced, fp32), on three
families, in one batch with rows of other proposal sizes and none, through EOS and length limits
that fall inside a proposal, under preemption and from the prefix cache; after every step each
page's refcount is its holders and the prefix index holds no rejected token's KV. The proposer is
transformers' ``PromptLookupCandidateGenerator``'s choice."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from engine_state import assert_clean, checked
from oracle import assert_teacher_forced
from tiny_models import make_tiny_model

import paged_hf
from paged_hf import SamplingParams
from paged_hf.requests.prompt_lookup import propose

NEW = 24


def repetitive_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts whose tails recur, so that lookups find matches (and tiny random models, which
    repeat themselves, accept some)."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(4, vocab, (7,), generator=g).tolist()
    other = torch.randint(4, vocab, (9,), generator=g).tolist()
    return [
        motif * 4,
        other + motif * 2 + other[:3],
        torch.randint(4, vocab, (21,), generator=g).tolist(),
    ]


def drafting_pays(engine: paged_hf.Engine) -> paged_hf.Engine:
    """The engine's step costs pinned where every draft pays (a step 20 ms, a drafted token a
    microsecond), so that rows draft whatever the machine: these tests check what drafts do."""
    engine.scheduler.step_time.coef = (0.02, 0.0, 1e-6)
    engine.scheduler.step_time.observe = lambda *args: None
    return engine


@torch.no_grad()
def two_token_odds(model, prompt: list[int], temperature: float, top_k: int) -> tuple:
    """The model's own odds of its first token after ``prompt``, and of the second after each
    first (temperature, then top-k: what the sampler draws from)."""

    def odds(ids: list[int]) -> dict[int, float]:
        logits = model(torch.tensor([ids])).logits[0, -1] / temperature
        top = torch.topk(logits, top_k)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    first = odds(prompt)
    return first, {t: odds(prompt + [t]) for t in first}


def assert_two_token_odds(first: dict, second: dict, counts: Counter, rows: int) -> None:
    """``counts`` of (first, second) over ``rows`` sampled rows against those odds: no outcome the
    model cannot give, and chi-square at p = 0.001 (the outcomes less one degrees of freedom)."""
    chi2, outcomes = 0.0, 0
    for t1, p1 in first.items():
        for t2, p2 in second[t1].items():
            expected = rows * p1 * p2
            chi2 += (counts.pop((t1, t2), 0) - expected) ** 2 / expected
            outcomes += 1
    assert not counts, f"outcomes the model cannot give: {counts}"
    assert outcomes == 9 and chi2 < 26.12, f"chi-square {chi2:.1f} over 8 degrees of freedom"


def run(model, prompts, params, **config) -> tuple[list[list[int]], paged_hf.Engine]:
    engine = drafting_pays(checked(paged_hf.Engine(model, block_size=4, **config)))
    outs = engine.generate(prompts, params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs], engine


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma2"])
def model(request):
    return make_tiny_model(request.param)


def test_greedy_prompt_lookup_gives_the_plain_tokens(model):
    prompts = repetitive_prompts(model.config.vocab_size)
    plain, _ = run(model, prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    # one batch: rows proposing up to 8, 3 and no tokens
    ks = [8, 3, 0]
    params = [
        SamplingParams(max_new_tokens=NEW, ignore_eos=True, prompt_lookup_num_tokens=k) for k in ks
    ]
    spec, engine = run(model, prompts, params)
    assert spec == plain
    for prompt, tokens in zip(prompts, spec):
        assert_teacher_forced(model, prompt, tokens, what="prompt lookup")
    stats = engine.stats()
    assert stats["draft_tokens_proposed"] > 0
    outs = engine.generate(prompts, params)  # per request: none proposed where k is 0
    assert [o.draft_tokens_proposed > 0 for o in outs] == [True, True, False]
    after = engine.stats()
    for key in ("draft_tokens_proposed", "draft_tokens_accepted"):
        assert sum(getattr(o, key) for o in outs) == after[key] - stats[key]
    assert_clean(engine)


def test_rows_end_on_eos_and_length_inside_a_proposal():
    """EOS: the token the plain runs emit most; lengths not a multiple of k; EOS banned up to
    min_new_tokens, whose boundary a proposal must not straddle (the ban is the step's)."""
    model = make_tiny_model("llama")
    prompts = repetitive_prompts(model.config.vocab_size, seed=1)
    plain, _ = run(model, prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    counts = Counter(t for row in plain for t in row)
    eos = [counts.most_common(1)[0][0]]
    for new, least in [(5, 0), (11, 0), (NEW, 0)] + [(NEW, m) for m in range(2, 14)]:
        base = dict(max_new_tokens=new, min_new_tokens=least, stop_token_ids=eos)
        want, _ = run(model, prompts, SamplingParams(**base))
        got, engine = run(model, prompts, SamplingParams(**base, prompt_lookup_num_tokens=6))
        assert got == want, (new, least)
        assert all(len(t) <= new for t in got)
        assert_clean(engine)


def test_preemption_and_prefix_hits_on_speculating_rows():
    model = make_tiny_model("llama")
    prompts = repetitive_prompts(model.config.vocab_size, seed=2)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, prompt_lookup_num_tokens=5)
    plain, _ = run(model, prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    # a pool too small for every row at once: rows preempt one another and recompute
    small, engine = run(model, prompts, params, num_blocks=14, max_num_seqs=3)
    assert small == plain and engine.stats()["preemptions"] > 0
    # the second time from the prefix cache; then prompts that run into the first outputs, whose
    # cached blocks must hold only verified tokens' KV (a fresh engine is the reference)
    engine = drafting_pays(checked(paged_hf.Engine(model, block_size=4)))
    first = [o.token_ids for o in engine.generate(prompts, params)]
    again = [o.token_ids for o in engine.generate(prompts, params)]
    assert first == again == plain and engine.stats()["prefix_hit_tokens"] > 0
    longer = [p + t[:13] for p, t in zip(prompts, first)]
    hits = engine.stats()["prefix_hit_tokens"]
    cached = [o.token_ids for o in engine.generate(longer, params)]
    assert engine.stats()["prefix_hit_tokens"] - hits >= 3 * 12  # through the first outputs
    assert cached == run(model, longer, SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
    assert_clean(engine)


def test_watches_hear_every_accepted_token_in_order():
    model = make_tiny_model("llama")
    prompts = repetitive_prompts(model.config.vocab_size)
    heard: dict[str, list[int]] = {}
    engine = drafting_pays(paged_hf.Engine(model, block_size=4))
    outs = engine.generate(
        prompts,
        SamplingParams(max_new_tokens=NEW, ignore_eos=True, prompt_lookup_num_tokens=6),
        on_token=lambda rid, tok: heard.setdefault(rid, []).append(tok),
    )
    assert engine.stats()["draft_tokens_accepted"] > 0
    assert [heard[o.request_id] for o in outs] == [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "what",
    [
        dict(n=2),
        dict(repetition_penalty=1.1),
        dict(output_hidden_states=True),
    ],
)
def test_what_speculation_does_not_run_yet_is_refused_by_name(what):
    name = next(iter(what))
    with pytest.raises(NotImplementedError, match=f"prompt_lookup_num_tokens with {name}"):
        SamplingParams(prompt_lookup_num_tokens=3, **what)


def test_the_proposal_is_transformers_prompt_lookup_candidates():
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        length = int(torch.randint(2, 40, (1,), generator=g))
        tokens = torch.randint(0, 6, (length,), generator=g).tolist()
        k, ngram = (
            int(torch.randint(1, 8, (1,), generator=g)),
            int(torch.randint(1, 4, (1,), generator=g)),
        )
        eos = [5]
        theirs = PromptLookupCandidateGenerator(
            eos_token_id=torch.tensor(eos),
            num_output_tokens=k,
            max_matching_ngram_size=ngram,
            max_length=1000,
        )
        candidates, _ = theirs.get_candidates(torch.tensor([tokens]))
        expected = candidates[0, length:].tolist()
        assert propose(tokens, k, ngram, frozenset(eos)) == expected, (tokens, k, ngram)


def test_a_proposal_stops_short_of_the_limits_the_step_would_cross():
    """At most k; room for the sampled token within max_new_tokens and max_model_len; and all of
    it on one side of min_new_tokens (the sampler bans EOS for the whole step, or for none of it)."""
    from paged_hf.engine.speculation import draft_for
    from paged_hf.requests.request import Request

    def draft(outputs: int, budget: int = 100, max_len: int = 1 << 30, **params) -> list[int]:
        req = Request("r", [1, 2, 3] * 20, SamplingParams(prompt_lookup_num_tokens=10, **params))
        req.max_model_len = max_len
        req.token_ids += [1, 2, 3, 1][:outputs]
        req.num_computed_tokens = req.num_tokens - 1
        return draft_for(req, budget, None, decode_rows=1)

    assert len(draft(outputs=2)) == 10
    assert len(draft(outputs=2, budget=4)) == 3
    assert len(draft(outputs=2, max_new_tokens=7)) == 4  # 2 + 4 drafted + 1 sampled = 7
    assert len(draft(outputs=2, max_len=70)) == 7  # 62 tokens + 7 drafted + 1 sampled = 70
    assert len(draft(outputs=2, min_new_tokens=6)) == 3  # outputs 2..5 banned alike
    assert len(draft(outputs=4, min_new_tokens=4)) == 10


def test_drafts_are_as_long_as_their_expected_tokens_pay_for():
    """A drafted token is worth its chance of being taken times what a written token costs the
    step now; it costs what its position adds. Long drafts where steps are overhead (one row) and
    acceptance high; none where a chunk's token costs what a decoding row's does, or for rows that
    are rarely right; none in a step of many rows before the engine has timed its steps."""
    from paged_hf.engine.speculation import TAKEN_VALUE, DraftCosts, draft_costs, draft_for
    from paged_hf.requests.request import Request

    one_row = draft_costs((0.020, 0.001, 0.0002), decode_rows=1)  # 21 ms a step, 0.2 ms a token
    assert one_row.token_s == pytest.approx(0.021)  # a lone row's taken token saves a step
    assert draft_costs((0.020, 0.001, 0.0002), decode_rows=2).token_s == pytest.approx(
        0.011 * TAKEN_VALUE
    )
    assert one_row.best_length(0.9, 10) == 10 and 3 <= one_row.best_length(0.5, 10) < 10
    many = draft_costs((0.010, 0.0004, 0.0003), decode_rows=32)  # 0.71 ms a written token
    assert many.best_length(0.99, 10) > 0 and many.best_length(0.5, 10) == 0
    # the arithmetic: token j is worth alpha ** j written tokens, a draft of d costs d + 1 chunk
    # tokens in place of one decoding row
    assert DraftCosts(0.001, 0.0005, 0.0004).best_length(0.9, 10) == 6
    assert DraftCosts(0.001, 0.002, 0.001).best_length(0.99, 10) == 0
    req = Request("r", [1, 2, 3] * 20, SamplingParams(prompt_lookup_num_tokens=10))
    req.token_ids.append(1)
    req.num_computed_tokens = req.num_tokens - 1
    assert len(draft_for(req, 100, None, decode_rows=2)) == 10
    assert draft_for(req, 100, None, decode_rows=3) == []
    req.draft_rejections = 40  # acceptance (0 + 1) / 42: not worth one token among 32 rows
    assert draft_for(req, 100, many, decode_rows=32) == []


def test_sampled_rows_keep_the_models_distribution(monkeypatch):
    """Sampling with a draft: a draft token is taken when the position's draw picks it, else the
    draw is kept, so each token is drawn from the model's distribution after the ones before it.
    The second token's draft is the likeliest one after the first (proposer pinned, so that both
    taking and keeping the draw happen often); (first, second) over 4000 rows against the model's
    own probabilities (temperature 0.8, top-k 3: 9 outcomes), chi-square at p = 0.001."""
    import paged_hf.engine.speculation as speculation

    model = make_tiny_model("llama")
    prompt = repetitive_prompts(model.config.vocab_size)[2][:6]
    temperature, top_k, rows = 0.8, 3, 4000

    first, second = two_token_odds(model, prompt, temperature, top_k)
    likeliest = {t: max(d, key=d.get) for t, d in second.items()}
    monkeypatch.setattr(
        speculation,
        "propose",
        lambda tokens, k, ngram, stops: [likeliest[tokens[-1]]] if len(tokens) == 7 else [],
    )
    engine = drafting_pays(paged_hf.Engine(model, block_size=4, max_num_seqs=256))
    params = SamplingParams(
        temperature=temperature, top_k=top_k, max_new_tokens=3, prompt_lookup_num_tokens=1
    )
    torch.manual_seed(0)
    outs = engine.generate([prompt] * rows, params)
    counts = Counter((o.token_ids[0], o.token_ids[1]) for o in outs)
    stats = engine.stats()
    assert stats["draft_tokens_proposed"] == rows
    assert 0.2 * rows < stats["draft_tokens_accepted"] < 0.95 * rows  # both ways, often
    assert_two_token_odds(first, second, counts, rows)


@pytest.fixture
def prophet(monkeypatch):
    """(model, prompts, their plain tokens) with the proposer pinned to the plain run's own
    continuation: every draft is taken, so what a draft token does happens inside drafts."""

    model = make_tiny_model("llama")
    prompts = repetitive_prompts(model.config.vocab_size, seed=4)
    plain, _ = run(model, prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    propose_continuations(monkeypatch, prompts, plain)
    return model, prompts, plain


def propose_continuations(monkeypatch, prompts: list, continuations: list) -> None:
    """Pin the proposer to each prompt's given continuation: a row drafts what comes next there."""
    import paged_hf.engine.speculation as speculation

    def propose(tokens, k, ngram, stops):
        for prompt, out in zip(prompts, continuations):
            if list(tokens[: len(prompt)]) == prompt:
                return out[len(tokens) - len(prompt) :][:k]
        return []

    monkeypatch.setattr(speculation, "propose", propose)


def stopped_outputs(model, tok, prompts, stops, k, heard=None) -> list[tuple]:
    engine = drafting_pays(checked(paged_hf.Engine(model, tok, block_size=4)))
    params = SamplingParams(
        max_new_tokens=NEW, ignore_eos=True, stop=stops, prompt_lookup_num_tokens=k
    )
    hear = None if heard is None else (lambda rid, t: heard.setdefault(rid, []).append(t))
    outs = engine.generate(prompts, params, on_token=hear)
    assert_clean(engine)
    if heard is not None:
        assert [heard.get(o.request_id, []) for o in outs] == [o.token_ids for o in outs]
    return [
        (o.token_ids, o.finish_reason, o.completions[0].stop_reason, o.text, o.error) for o in outs
    ]


def rows_stopped_inside_drafts(monkeypatch) -> list:
    """The rows a stop string ends inside a draft, as steps append their drafts' tokens."""
    import paged_hf.engine.step as step

    inside = []
    take = step.append_accepted

    def spied(verified, sampled, now):
        stopped, failed = take(verified, sampled, now)
        inside.extend(stopped)
        return stopped, failed

    monkeypatch.setattr(step, "append_accepted", spied)
    return inside


def test_stop_strings_end_a_row_inside_its_draft(prophet, monkeypatch):
    """A stop string completed by an accepted draft token ends the row there, as a plain run ends
    it: the same tokens, finish reason, stop reason and text; a watch hears each kept token."""
    from tiny_tokenizer import make_tiny_tokenizer

    model, prompts, plain = prophet
    tok = make_tiny_tokenizer()
    inside = rows_stopped_inside_drafts(monkeypatch)
    stops = [tok.decode(row[9:11]) for row in plain]
    want = stopped_outputs(model, tok, prompts, stops, 0)
    assert not inside and all(out[1] == "stop" for out in want)
    assert stopped_outputs(model, tok, prompts, stops, 6, heard={}) == want
    assert inside, "no stop string fell inside a draft"


def test_a_stop_string_check_that_raises_on_a_draft_token_fails_its_row_alone(prophet):
    """Fault injection: the tokenizer raises on one token of row 0's output, which comes in a
    draft; row 0 ends with the plain run's error, the other rows as in the plain run."""
    from tiny_tokenizer import make_tiny_tokenizer

    model, prompts, plain = prophet
    poison = next(t for t in plain[0][3:] if all(t not in row for row in plain[1:]))
    tok = make_tiny_tokenizer()
    decode = tok.decode

    def failing(ids, *args, **kwargs):
        if poison in list(ids):
            raise RuntimeError(f"cannot decode {poison}")
        return decode(ids, *args, **kwargs)

    tok.decode = failing
    stops = ["never in any output \u2603"]
    want = stopped_outputs(model, tok, prompts, stops, 0)
    assert want[0][1] == "error" and "cannot decode" in want[0][4]
    assert stopped_outputs(model, tok, prompts, stops, 6) == want


def repeat_a_passage(tok) -> torch.Tensor:
    """A chat prompt asking to repeat a short passage, as ids: the work drafts are for."""
    passage = (
        "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every "
        "night its keeper climbed the narrow stairs and polished the great lens until it shone."
    )
    chat = [{"role": "user", "content": f"Repeat this passage exactly:\n\n{passage}"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    return ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids


def test_smollm2_repeating_a_passage_in_fp32_is_transformers_greedy_search(smollm2_fp32):
    """Real weights, the work prompt lookup is for: a patched model's ``generate`` with
    ``prompt_lookup_num_tokens`` gives transformers' own greedy tokens (fp32), most of them taken
    from drafts."""
    model, tok = smollm2_fp32
    ids = repeat_a_passage(tok)
    expected = model.generate(ids, max_new_tokens=40, do_sample=False)
    patched = paged_hf.patch(model)
    try:
        out = patched.generate(ids, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=10)
        stats = paged_hf.engine_for(patched).stats()
    finally:
        paged_hf.unpatch(model)
    assert torch.equal(out, expected)
    assert stats["draft_tokens_accepted"] > 20, stats["draft_tokens_accepted"]


def test_logprobs_of_taken_draft_tokens_are_a_plain_runs(prophet):
    """Each taken draft token's logprob (and top-k) comes from its own position's logits, in
    order, as a plain run gives them (fp32, 1e-4), also where a stop string ends a row inside a
    draft (one logprob a token)."""
    from tiny_tokenizer import make_tiny_tokenizer

    model, prompts, plain = prophet
    tok = make_tiny_tokenizer()

    def run_logprobs(k: int, stops: list[str]) -> list:
        engine = drafting_pays(checked(paged_hf.Engine(model, tok, block_size=4)))
        params = SamplingParams(
            max_new_tokens=NEW, ignore_eos=True, logprobs=2, stop=stops, prompt_lookup_num_tokens=k
        )
        outs = engine.generate(prompts, params)
        assert_clean(engine)
        return [(o.token_ids, o.completions[0].logprobs) for o in outs], engine

    for stops in ([], [tok.decode(row[9:11]) for row in plain]):
        want, _ = run_logprobs(0, stops)
        got, engine = run_logprobs(6, stops)
        assert engine.stats()["draft_tokens_accepted"] > 0
        for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
            assert tokens == want_tokens and len(lps) == len(tokens) == len(want_lps)
            for (lp, top), (want_lp, want_top) in zip(lps, want_lps):
                assert lp == pytest.approx(want_lp, abs=1e-4)
                assert top.keys() == want_top.keys()


def test_a_pick_that_fails_past_the_first_rejection_does_not_fail_the_row(monkeypatch):
    """Fault injection: every draft is wrong (a token the rows never write), and the sampler fails
    at every draft position after the pending token's; a step at a time never reaches those
    positions, so the rows end as a plain run ends them, none with an error."""
    import paged_hf.engine.speculation as speculation
    import paged_hf.engine.step as step
    from paged_hf.execution.sampler import SampleResult

    model = make_tiny_model("llama")
    prompts = repetitive_prompts(model.config.vocab_size, seed=5)
    plain, _ = run(model, prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    never = next(t for t in range(4, model.config.vocab_size) if all(t not in r for r in plain))
    monkeypatch.setattr(speculation, "propose", lambda tokens, k, ngram, stops: [never] * k)
    sample = step.sample
    failed = []

    def failing_past_the_first(logits, rows, mask=None):
        result = sample(logits, rows, mask)
        tokens, errors = list(result.tokens), dict(result.errors)
        for i in range(2, len(rows)):
            if rows[i] is rows[i - 1] is rows[i - 2]:  # a draft position after the first
                tokens[i], errors[i] = None, "injected: this position's pick failed"
                failed.append(i)
        return SampleResult(tokens, result.logprobs, errors)

    monkeypatch.setattr(step, "sample", failing_past_the_first)
    got, engine = run(
        model,
        prompts,
        SamplingParams(max_new_tokens=NEW, ignore_eos=True, prompt_lookup_num_tokens=3),
    )
    assert failed and got == plain
    assert engine.stats()["draft_tokens_accepted"] == 0
    assert_clean(engine)


def test_the_sampled_tokens_logprob_after_a_rejected_draft_is_a_plain_runs():
    """The token a step samples where its draft was rejected takes its logprob (and top-k) from
    the position of the first wrong draft token, not the draft's last: the real proposer on
    repetitive prompts, whose drafts tiny models partly reject, greedy and fp32; every logprob
    and top-k entry as a plain run gives it (1e-4), the tokens the same. (The prophet's drafts
    above are always taken, so no draft there is rejected.)"""
    model = make_tiny_model("llama")
    prompts = repetitive_prompts(model.config.vocab_size, seed=1)

    def run_logprobs(k: int) -> tuple[list, list]:
        engine = drafting_pays(checked(paged_hf.Engine(model, block_size=4)))
        params = SamplingParams(
            max_new_tokens=NEW, ignore_eos=True, logprobs=3, prompt_lookup_num_tokens=k
        )
        outs = engine.generate(prompts, params)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        assert_clean(engine)
        return [(o.token_ids, o.completions[0].logprobs) for o in outs], outs

    want, _ = run_logprobs(0)
    got, outs = run_logprobs(6)
    proposed = sum(o.draft_tokens_proposed for o in outs)
    accepted = sum(o.draft_tokens_accepted for o in outs)
    assert 0 < accepted < proposed, (accepted, proposed)  # drafts taken, and some rejected
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens and len(lps) == len(tokens) == len(want_lps)
        for j, ((lp, top), (want_lp, want_top)) in enumerate(zip(lps, want_lps)):
            assert lp == pytest.approx(want_lp, abs=1e-4), j
            assert top.keys() == want_top.keys(), j
            for t, v in want_top.items():
                assert top[t] == pytest.approx(v, abs=1e-4), (j, t)
