"""The sampler's distribution against transformers' own logits processors.

For one row of logits, transformers' ``_get_logits_processor`` (what its ``generate`` builds from a
GenerationConfig: repetition penalty, min-new-tokens EOS ban, temperature, top-k, top-p, min-p)
gives the exact distribution to sample from. The paged_hf sampler, fed the same GenerationConfig
through ``SamplingParams.from_generation_config``, draws N tokens from that row; every token's
frequency must be within 5 standard errors of transformers' probability, and a token transformers
removes must never be drawn. Draws come from fixed seeds, so a run is deterministic.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model
from transformers import GenerationConfig

from paged_hf import SamplingParams
from paged_hf.execution.sampler import sample
from paged_hf.requests.request import Request

VOCAB = 16
DRAWS = 20_000
PROMPT = [3, 5, 5, 9]
EOS = 7

CASES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=3),
    "top_p": dict(temperature=0.8, top_p=0.7),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "repetition_penalty": dict(temperature=0.9, repetition_penalty=1.3),
    "min_new_tokens bans EOS": dict(temperature=1.0, min_new_tokens=2),
    "all filters": dict(temperature=1.2, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
}


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def _expected(model, gc: GenerationConfig, logits: torch.Tensor) -> torch.Tensor:
    # as generate does: the EOS ban reads its tensors
    model._prepare_special_tokens(gc, device="cpu")
    procs = model._get_logits_processor(gc, input_ids_seq_length=len(PROMPT), device="cpu")
    scores = procs(torch.tensor([PROMPT]), logits[None].clone())[0]
    return torch.softmax(scores, dim=-1)


def _requests(params: SamplingParams, seeded: bool) -> list[Request]:
    reqs = []
    for i in range(DRAWS):
        req = Request(str(i), list(PROMPT), params, frozenset({EOS}), 1 << 20)
        req.seed = i if seeded else None
        reqs.append(req)
    return reqs


@pytest.mark.parametrize("seeded", [False, True], ids=["shared draw", "own streams"])
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_frequencies_match_transformers_processors(model, case, seeded):
    gc = GenerationConfig(
        **{
            "do_sample": True,
            "top_k": 0,
            "top_p": 1.0,
            "eos_token_id": EOS,
            "max_new_tokens": 4,
            **CASES[case],
        }
    )
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(len(case))) * 2
    expected = _expected(model, gc, logits)
    assert (expected == 0).any() or case in ("temperature", "repetition_penalty"), (
        "the case filters nothing"
    )

    params = SamplingParams.from_generation_config(gc)
    torch.manual_seed(0)
    tokens = sample(logits.expand(DRAWS, VOCAB), _requests(params, seeded)).tokens
    freq = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double() / DRAWS

    removed = expected == 0
    assert freq[removed].sum() == 0, (
        f"drew tokens transformers removes: {removed.nonzero().flatten().tolist()}"
    )
    p = expected.double()
    bound = 5 * (p * (1 - p) / DRAWS).sqrt() + 1e-4
    worst = ((freq - p).abs() / bound).max()
    assert worst <= 1, f"{case}: frequencies {freq.tolist()} vs probabilities {p.tolist()}"


def test_seeded_rows_draw_the_same_tokens_alone_or_in_a_batch():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(max_new_tokens=4, temperature=1.0)

    def reqs(seeds):
        out = []
        for s in seeds:
            r = Request(str(s), list(PROMPT), params, frozenset(), 1 << 20)
            r.seed = s
            out.append(r)
        return out

    alone = [sample(logits[i : i + 1], reqs([s])).tokens[0] for i, s in ((1, 11), (4, 44))]
    torch.manual_seed(1)
    mixed = sample(logits, reqs([None, 11, None, None, 44, None])).tokens
    assert [mixed[1], mixed[4]] == alone


@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_max_op_is_torch_max(threads):
    """``paged_hf::greedy_max`` (the sampler's greedy pick on a CPU) against ``torch.max(dim=-1)``: the same
    maximum and first index on random rows, ties, a row of a narrow vocabulary (no full vector), rows with
    NaN (NaN out), +inf and all -inf, rows through a strided view, and bf16 rows read as they are."""
    from paged_hf.execution.cpu import ops as cpu_ops
    from paged_hf.execution.sampler import _row_max

    assert cpu_ops.load(), cpu_ops.status()["error"]
    gen = torch.Generator().manual_seed(threads)
    x = torch.randn(12, 49_157, generator=gen)
    x[1, [5, 900, 49_000]] = 50.0  # a three-way tie: the first wins
    x[2, 49_156] = 99.0  # the last column, past the last full vector
    x[3, 7] = float("nan")
    x[4, 100] = float("inf")
    x[5] = float("-inf")
    x[6] = x[6].round()  # many ties
    x[7, 12] = float("nan")
    x[7, 13] = float("inf")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for logits in (x, x[:, :11], x[::2, 3:], x.bfloat16(), x[::2, 3:].bfloat16()):
            best, idx = torch.ops.paged_hf.greedy_max(
                logits.contiguous() if logits.shape[1] == 11 else logits
            )
            want_best, want_idx = logits.max(dim=-1)
            assert torch.equal(best.isnan(), want_best.isnan())
            finite = ~want_best.isnan()
            assert torch.equal(best[finite], want_best[finite])
            assert torch.equal(idx[finite], want_idx[finite])
            got = _row_max(logits)
            assert torch.equal(got[1][finite], want_idx[finite])
    finally:
        torch.set_num_threads(before)


def test_a_plain_greedy_batch_takes_the_fast_path_and_the_same_tokens():
    """Rows that are greedy, without logprobs and with nothing to ban this step pick from the logits as they
    are (bf16 included: no fp32 copy); the tokens and failures are the full path's. A row that needs its
    processors (a repetition penalty, EOS still banned, logprobs) sends the batch the full way."""
    from paged_hf.execution import sampler

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=gen).bfloat16()
    logits[2, 17] = float("nan")
    logits[4] = float("-inf")
    plain = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=4)) for i in range(6)]
    assert all(sampler._plain_greedy(r) for r in plain)
    fast = sample(logits, plain)
    # a mask forces the full path
    full = sampler.sample(logits.float(), plain, mask=lambda lg, err: None)
    assert fast.tokens == full.tokens and fast.errors.keys() == full.errors.keys() == {2, 4}
    assert fast.tokens[0] == int(logits[0].float().argmax())
    for params in (
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(logprobs=2),
        SamplingParams(min_new_tokens=3, stop_token_ids=(7,)),
    ):
        assert not sampler._plain_greedy(Request("x", [1, 2], params))


def test_a_requests_own_logits_processors_run_after_the_penalties_and_before_the_warpers():
    """SamplingParams(logits_processors=[f]): f(token_ids, logits) sees the prompt and the tokens so
    far and the penalised fp32 row; what it returns is what the warpers and the draw see. One that
    raises, or returns another shape, ends its own request; the others' tokens do not change."""
    from tiny_models import make_tiny_model

    import paged_hf

    model = make_tiny_model("llama")
    engine = paged_hf.Engine(model)
    seen = []

    def only_odd(token_ids, logits):
        seen.append((list(token_ids), logits.dtype, logits.shape))
        out = logits.clone()
        out[0::2] = float("-inf")
        return out

    prompt = [5, 6, 7, 8]
    params = paged_hf.SamplingParams(
        max_new_tokens=6, ignore_eos=True, logits_processors=[only_odd], repetition_penalty=1.5
    )
    out = engine.generate([prompt], params)[0]
    assert all(t % 2 == 1 for t in out.token_ids)
    assert [s[0] for s in seen] == [prompt + out.token_ids[:i] for i in range(6)]
    assert seen[0][1:] == (torch.float32, (model.config.vocab_size,))
    sampled = engine.generate([prompt], params.with_(temperature=1.0, top_k=5, seed=3))[0]
    assert all(t % 2 == 1 for t in sampled.token_ids)

    def raises(token_ids, logits):
        raise RuntimeError("processor failed on purpose")

    plain = paged_hf.SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = engine.generate([[9, 10, 11]], plain)[0].token_ids
    bad, wrong_shape, other = engine.generate(
        [prompt, prompt, [9, 10, 11]],
        [
            plain.with_(logits_processors=[raises]),
            plain.with_(logits_processors=[lambda ids, lg: lg[:3]]),
            plain,
        ],
    )
    assert bad.finish_reason == "error" and "on purpose" in bad.error
    assert wrong_shape.finish_reason == "error" and "shape" in wrong_shape.error
    assert other.error is None and other.token_ids == alone
    assert engine.kv_manager.pool.num_used == 0
