"""Same seed, same samples (issue 72): a sampled row draws its j-th token with the j-th value of its
own random stream (paged_hf/execution/random_streams.py), keyed by its seed, or by one drawn from
torch's default generator when its call started. So TRL's GRPO pattern (``torch.manual_seed``
before each sampled ``generate``, n samples a prompt) gives one set of samples on a fresh engine,
again on the same engine once its prompts are cached, beside a streamed ``serve()`` request, in
a pool that preempts and with prompt lookup on. Each test goes red when rows draw from one
shared generator again (as they did: a step's draws then followed its composition)."""

from __future__ import annotations

import threading

import pytest
import torch
from test_speculation import drafting_pays, propose_continuations
from tiny_models import left_pad, make_tiny_model, tiny_prompts

import paged_hf
from paged_hf import SamplingParams
from paged_hf.execution import random_streams
from paged_hf.execution.sampler import _inverse_cdf_draw

NEW = 12
SAMPLES = 4


@pytest.fixture(scope="module")
def prompts():
    vocab = make_tiny_model("llama").config.vocab_size
    g = torch.Generator().manual_seed(8)
    motif = torch.randint(4, vocab, (5,), generator=g).tolist()
    # the second repeats itself, so prompt lookup finds drafts; both span several 4-token blocks
    return left_pad([tiny_prompts(vocab, 1, [14], seed=2)[0], motif * 4])


def grpo_call(model, prompts, **kw) -> torch.Tensor:
    """TRL's GRPO generation: a seed, then SAMPLES samples of each prompt, temperature 1, no top-k."""
    ids, mask = prompts
    torch.manual_seed(4)
    return model.generate(
        ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        max_new_tokens=NEW,
        num_return_sequences=SAMPLES,
        **kw,
    )


def patched(**config):
    return paged_hf.patch(make_tiny_model("llama"), **config)


def test_the_same_call_again_on_the_same_engine_draws_the_same_samples(prompts):
    """Again and a third time on the same engine (the prompts now prefix hits), and on another
    fresh engine: one set of tokens; the 8 samples are not all alike (they are samples). A small
    token budget chunks the first call's prompts, so its rows start sampling at other steps than
    the cached calls' rows."""
    model = patched(block_size=4, max_num_batched_tokens=16)
    first = grpo_call(model, prompts)
    engine = paged_hf.engine_for(model)
    hits = engine.stats()["prefix_hit_tokens"]
    again = grpo_call(model, prompts)
    assert engine.stats()["prefix_hit_tokens"] > hits
    third = grpo_call(model, prompts)
    other = grpo_call(patched(block_size=16), prompts)
    width = prompts[0].shape[1]
    assert len({tuple(row) for row in first[:, width:].tolist()}) > 2
    for got in (again, third, other):
        assert torch.equal(got, first)


def test_a_streamed_request_beside_the_call_changes_none_of_its_samples(prompts):
    """A serve() request sampling in the same steps (its own draws, every step) and a plain run."""
    model = patched(block_size=4)
    alone = grpo_call(patched(block_size=4), prompts)
    bg = paged_hf.serve(model, warmup=False)
    try:
        streamed = bg.submit(
            list(range(5, 40)),
            SamplingParams(max_new_tokens=400, temperature=1.0, ignore_eos=True),
        )
        tokens: list[int] = []
        reader = threading.Thread(target=lambda: tokens.extend(streamed.stream()))
        reader.start()
        beside = grpo_call(model, prompts)
        running = not streamed.done()
        streamed.cancel()
        reader.join(timeout=30)
    finally:
        bg.shutdown()
    assert running and tokens, "the streamed request did not run beside the call"
    assert torch.equal(beside, alone)


def test_preemption_changes_no_sample(prompts):
    """A pool too small for the 8 rows at once: rows preempted and recomputed."""
    want = grpo_call(patched(block_size=4), prompts)
    small = patched(block_size=4, num_blocks=14, max_num_batched_tokens=16, max_num_seqs=8)
    assert torch.equal(grpo_call(small, prompts), want)
    assert paged_hf.engine_for(small).stats()["preemptions"] > 0


def test_prompt_lookup_changes_no_sample(prompts):
    """TRL's other layout, each prompt repeated SAMPLES times as rows of their own (speculation
    takes n = 1 rows only), with prompt lookup drafting: a draft position's draw is the one a
    step at a time makes there."""
    ids, mask = (t.repeat_interleave(SAMPLES, dim=0) for t in prompts)
    # cooler than 1, so that a tiny random model's samples repeat enough for drafts to be taken
    kw = dict(attention_mask=mask, do_sample=True, temperature=0.4, top_k=0, max_new_tokens=NEW)
    torch.manual_seed(4)
    want = patched(block_size=4).generate(ids, **kw)
    lookup = patched(block_size=4)
    drafting_pays(paged_hf.engine_for(lookup))
    torch.manual_seed(4)
    got = lookup.generate(ids, prompt_lookup_num_tokens=3, **kw)
    assert torch.equal(got, want)
    stats = paged_hf.engine_for(lookup).stats()
    assert stats["draft_tokens_proposed"] > stats["draft_tokens_accepted"] > 0


def test_a_draft_of_the_plain_run_s_samples_is_taken_whole(monkeypatch):
    """A proposer that offers what a plain seeded run sampled next: at temperature 1 every draft
    position draws what the plain run drew there, so every draft is taken and the tokens are the
    plain run's (a draft position drawing with its row's first value would part at once)."""
    model = make_tiny_model("llama")
    prompts = tiny_prompts(model.config.vocab_size, 3, [6, 13, 22], seed=7)
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=5, ignore_eos=True)
    plain = [o.token_ids for o in paged_hf.Engine(model).generate(prompts, params)]
    propose_continuations(monkeypatch, prompts, plain)
    engine = drafting_pays(paged_hf.Engine(model, block_size=4))
    got = engine.generate(prompts, params.with_(prompt_lookup_num_tokens=4))
    assert [o.token_ids for o in got] == plain
    stats = engine.stats()
    assert stats["draft_tokens_accepted"] == stats["draft_tokens_proposed"] > NEW


def test_a_seeded_request_draws_the_same_alone_in_a_batch_and_cached():
    """``SamplingParams(seed=...)``: the same tokens alone on a fresh engine, among other sampled
    requests (seeded and not), and again once its prompt is cached; sample k of n is a request of
    seed + k."""
    model = make_tiny_model("llama")
    prompt = tiny_prompts(model.config.vocab_size, 1, [21], seed=5)[0]
    others = tiny_prompts(model.config.vocab_size, 3, [9, 30, 17], seed=6)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_p=0.95, seed=11, n=3)
    alone = paged_hf.Engine(model, block_size=4).generate([prompt], params)[0]
    engine = paged_hf.Engine(model, block_size=4)
    crowd = [SamplingParams(max_new_tokens=NEW + i, temperature=1.0, seed=i) for i in range(3)]
    mixed = engine.generate(others + [prompt], crowd + [params])[-1]
    cached = engine.generate([prompt], params)[0]
    assert cached.num_cached_tokens > 0
    sample_2 = paged_hf.Engine(model).generate([prompt], params.with_(n=1, seed=13))[0]
    got = [c.token_ids for c in alone.completions]
    assert len(set(map(tuple, got))) > 1
    assert [c.token_ids for c in mixed.completions] == got
    assert [c.token_ids for c in cached.completions] == got
    assert sample_2.token_ids == got[2]


def test_a_stream_s_values_are_uniform_and_independent_of_neighbouring_seeds():
    """64k values of one stream, and the first values of 64k consecutive seeds: each of 64 bins
    within 5 standard errors of 1/64, and no two neighbouring seeds' streams alike."""
    n, bins = 1 << 16, 64
    along = random_streams.uniforms([(7, i) for i in range(n)])
    across = random_streams.uniforms([(s, 0) for s in range(n)])
    for u in (along, across):
        assert 0 <= u.min() and u.max() < 1
        counts = torch.histc(u, bins=bins, min=0, max=1)
        expected = n / bins
        assert ((counts - expected).abs() <= 5 * (expected * (1 - 1 / bins)) ** 0.5).all()
    first = [random_streams.uniforms([(s, i) for i in range(8)]) for s in (100, 101, 102)]
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    # the next seed's stream is not this one shifted by a position
    assert not torch.equal(first[0][1:], first[1][:-1])


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.9)]
)
def test_one_stream_draws_the_model_s_distribution(temperature, top_k, top_p):
    """A chi-square test on 20k draws along one stream (positions 0..19999 of one seed, as one
    row's tokens are drawn) from a tiny model's next-token distribution after temperature, top-k
    and top-p: the statistic's p-value above 0.001, and no filtered token ever drawn."""
    from paged_hf.execution.sampler import drawn_probs
    from paged_hf.requests.request import Request

    model = make_tiny_model("llama")
    prompt = tiny_prompts(model.config.vocab_size, 1, [9], seed=3)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1:].float()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
    probs = drawn_probs(logits.clone(), [Request("r", prompt, params)])[0].double()
    draws = 20_000
    u = random_streams.uniforms([(12345, i) for i in range(draws)])
    picks = _inverse_cdf_draw(probs.float().expand(draws, -1), u)
    counts = torch.bincount(picks, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0
    # pool the tokens expected fewer than 5 times into one cell, as the test asks
    expected = probs * draws
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = wanted > 0
    stat = (((observed - wanted) ** 2)[keep] / wanted[keep]).sum().item()
    freedom = int(keep.sum()) - 1
    # the chi-square distribution's upper tail: the regularized upper incomplete gamma function
    p_value = torch.special.gammaincc(torch.tensor(freedom / 2), torch.tensor(stat / 2)).item()
    assert freedom > 2 and p_value > 1e-3, (stat, freedom)
