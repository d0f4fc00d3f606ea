"""patch(model).generate against transformers' own generate, family by family (issue 3)."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_state import assert_clean, checked
from oracle import assert_teacher_forced
from tiny_models import EOS_ID, FAMILIES, PAD_ID, left_pad, make_tiny_model, tiny_prompts

import paged_hf

# longer than the sliding window (8) and than several 4-token blocks; one prompt of one token
PROMPT_LENGTHS = [1, 5, 19, 37]
MAX_NEW = 12
CONFIGS = {
    "defaults": {},
    "chunked": {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8},
}


def generated_rows(out: torch.Tensor, width: int) -> list[list[int]]:
    """Strip transformers-style padding after EOS from generated rows."""
    rows = []
    for row in out[:, width:].tolist():
        if EOS_ID in row:
            row = row[: row.index(EOS_ID) + 1]
        rows.append(row)
    return rows


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_generate_agrees_with_transformers(family, config_name):
    reference = make_tiny_model(family)
    model = paged_hf.patch(make_tiny_model(family), **CONFIGS[config_name])
    prompts = tiny_prompts(reference.config.vocab_size, len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=1)
    ids, mask = left_pad(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    assert out.shape == expected.shape or out.shape[1] <= expected.shape[1]
    assert torch.equal(out[:, : ids.shape[1]], ids)  # the input comes back as given
    for prompt, gen in zip(prompts, generated_rows(out, ids.shape[1])):
        assert len(gen) == MAX_NEW or gen[-1] == EOS_ID
        assert_teacher_forced(reference, prompt, gen, what=f"{family}/{config_name}")
    engine = paged_hf.engine_for(model)
    assert engine.kv_manager.pool.num_used == 0
    if config_name == "chunked":
        assert engine.stats()["steps"] > MAX_NEW  # the 37-token prompt really was chunked


def test_right_padding_and_exact_match_with_transformers_on_unpadded_rows():
    reference = make_tiny_model("llama")
    model = paged_hf.patch(make_tiny_model("llama"))
    prompts = tiny_prompts(reference.config.vocab_size, 3, [6, 11, 3], seed=2)
    width = max(map(len, prompts))
    ids = torch.full((3, width), PAD_ID)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for i, p in enumerate(prompts):
        alone = reference.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[
            0, len(p) :
        ].tolist()
        gen = out[i, width:].tolist()[: len(alone)]
        assert_teacher_forced(reference, p, gen, what=f"right-padded row {i}")


def test_small_pool_preempts_and_gives_the_same_tokens():
    model = make_tiny_model("llama")
    prompts = tiny_prompts(model.config.vocab_size, 6, [20, 9, 30, 14, 25, 7], seed=3)
    params = paged_hf.SamplingParams(max_new_tokens=24, ignore_eos=True)
    big = paged_hf.Engine(model, num_blocks=256, block_size=4)
    small = paged_hf.Engine(
        model, num_blocks=14, block_size=4, max_num_batched_tokens=32, max_num_seqs=6
    )
    want = [o.token_ids for o in big.generate(prompts, params)]
    got = [o.token_ids for o in small.generate(prompts, params)]
    assert small.stats()["preemptions"] > 0
    for p, g, w in zip(prompts, got, want):
        assert len(g) == len(w) == 24
        assert_teacher_forced(model, p, g, what="small pool")
    assert small.kv_manager.pool.num_used == 0


def test_prefix_caching_saves_prefill_and_keeps_tokens():
    model = make_tiny_model("qwen3")
    shared = tiny_prompts(model.config.vocab_size, 1, 40, seed=4)[0]
    tails = tiny_prompts(model.config.vocab_size, 6, [3, 7, 5, 9, 1, 6], seed=5)
    prompts = [shared + t for t in tails]
    params = paged_hf.SamplingParams(max_new_tokens=6, ignore_eos=True)
    on = paged_hf.Engine(model, block_size=4)
    off = paged_hf.Engine(model, block_size=4, enable_prefix_caching=False)
    got_on = [o.token_ids for o in on.generate(prompts, params)]
    got_off = [o.token_ids for o in off.generate(prompts, params)]
    for p, a, b in zip(prompts, got_on, got_off):
        assert_teacher_forced(model, p, a, what="prefix cache on")
        assert_teacher_forced(model, p, b, what="prefix cache off")
    s_on, s_off = on.stats(), off.stats()
    assert s_off["prefix_hit_tokens"] == 0
    assert s_on["prefix_hit_tokens"] >= 5 * 40
    assert s_on["prefill_tokens_computed"] <= s_off["prefill_tokens_computed"] - 5 * 40
    # a second round hits the cache left by the first
    again = on.generate(prompts[:1], params)[0]
    assert again.num_cached_tokens == 40 + (len(tails[0]) // 4) * 4 - (
        0 if (40 + len(tails[0])) % 4 else 4
    )


def test_cache_salt_isolates_tenants():
    model = make_tiny_model("llama")
    prompt = tiny_prompts(model.config.vocab_size, 1, 33, seed=6)[0]
    engine = paged_hf.Engine(model, block_size=4)
    p = paged_hf.SamplingParams(max_new_tokens=2)
    engine.generate([prompt], p.with_(cache_salt="alice"))
    bob = engine.generate([prompt], p.with_(cache_salt="bob"))[0]
    alice = engine.generate([prompt], p.with_(cache_salt="alice"))[0]
    assert bob.num_cached_tokens == 0
    assert alice.num_cached_tokens == 32
    assert alice.token_ids == bob.token_ids


def test_seeded_sampling_is_the_same_alone_and_in_a_batch():
    model = make_tiny_model("mistral")
    prompts = tiny_prompts(model.config.vocab_size, 16, [3 + 2 * i for i in range(16)], seed=7)
    params = paged_hf.SamplingParams(
        max_new_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=1234, ignore_eos=True
    )
    alone = paged_hf.Engine(model).generate(prompts[5:6], params)[0].token_ids
    batch = paged_hf.Engine(model).generate(prompts, params)
    assert batch[5].token_ids == alone
    assert len({tuple(o.token_ids) for o in batch}) > 1


def test_unpatch_is_bit_identical_to_a_never_patched_model():
    for family in ("llama", "gemma2", "gpt2"):
        pristine = make_tiny_model(family)
        model = copy.deepcopy(pristine)
        prompts = tiny_prompts(pristine.config.vocab_size, 3, [4, 10, 17], seed=8)
        ids, mask = left_pad(prompts)
        paged_hf.patch(model)
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        paged_hf.unpatch(model)
        assert "generate" not in model.__dict__
        assert model.config._attn_implementation == pristine.config._attn_implementation
        with torch.no_grad():
            assert torch.equal(
                model(ids, attention_mask=mask).logits, pristine(ids, attention_mask=mask).logits
            )
        assert torch.equal(
            model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False),
            pristine.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False),
        )


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
def test_plain_forward_and_training_still_work_while_patched(family):
    pristine = make_tiny_model(family)
    model = paged_hf.patch(copy.deepcopy(pristine))
    prompts = tiny_prompts(pristine.config.vocab_size, 2, [5, 14], seed=9)
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, attention_mask=mask).logits,
            pristine(ids, attention_mask=mask).logits,
            rtol=0,
            atol=0,
        )
    model.train()
    loss = model(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    model.eval()


def test_parallel_sampling_n_shares_the_prompt_and_samples_independently():
    model = make_tiny_model("llama")
    prompt = tiny_prompts(model.config.vocab_size, 1, 10, seed=10)[
        0
    ]  # last block partial: copy-on-write
    engine = paged_hf.Engine(model, block_size=4)
    out = engine.generate(
        [prompt],
        paged_hf.SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, n=4, ignore_eos=True),
    )[0]
    assert len(out.completions) == 4
    assert len({tuple(c.token_ids) for c in out.completions}) > 1
    assert all(len(c.token_ids) == 8 for c in out.completions)
    assert engine.stats()["prefill_tokens_computed"] == 10  # the prompt ran once
    assert engine.kv_manager.pool.num_used == 0
    greedy = engine.generate([prompt], paged_hf.SamplingParams(max_new_tokens=6, n=3))[0]
    assert len({tuple(c.token_ids) for c in greedy.completions}) == 1
    assert_teacher_forced(model, prompt, greedy.token_ids, what="n=3 greedy")


def test_hf_num_return_sequences_shape_and_sampling_reproducible():
    model = paged_hf.patch(make_tiny_model("llama"))
    ids, mask = left_pad(tiny_prompts(model.config.vocab_size, 2, [4, 7], seed=11))
    torch.manual_seed(0)
    a = model.generate(
        ids, attention_mask=mask, do_sample=True, max_new_tokens=5, num_return_sequences=3
    )
    torch.manual_seed(0)
    b = model.generate(
        ids, attention_mask=mask, do_sample=True, max_new_tokens=5, num_return_sequences=3
    )
    assert a.shape[0] == 6 and torch.equal(a, b)
    assert torch.equal(a[0::3, : ids.shape[1]], ids)


def first_ending(rows: list[list[int]]) -> tuple[int, int]:
    """(token, length): a token of ``rows[0]`` that ends it there, the earliest one that no other
    row has written by then, so that with it as a stop token row 0 ends first and alone (every
    row draws as in ``rows`` until one of them ends)."""
    for p in range(1, len(rows[0])):
        t = rows[0][p]
        if t not in rows[0][:p] and all(t not in row[: p + 1] for row in rows[1:]):
            return t, p + 1
    raise AssertionError(f"no token ends row 0 before the others: {rows}")


def test_samples_ending_at_different_steps_each_run_to_their_own_end():
    """n=4 seeded samples (sample k draws with seed + k) where one ends on a stop token steps
    before the others: ``Engine.generate`` returns when every sample is over, not the first, each
    completion with its finish reason, as the same request stepped by hand on a fresh engine (no
    blocking call: what it returns does not depend on when a call thinks a request is over)."""
    model = make_tiny_model("llama")
    prompt = tiny_prompts(model.config.vocab_size, 1, 10, seed=10)[0]
    sampled = paged_hf.SamplingParams(
        max_new_tokens=10, temperature=1.0, seed=3, n=4, ignore_eos=True
    )
    free = paged_hf.Engine(model, block_size=4).generate([prompt], sampled)
    stop, ends_at = first_ending([c.token_ids for c in free[0].completions])
    params = sampled.with_(stop_token_ids=(stop,))

    by_hand = paged_hf.Engine(model, block_size=4)
    root = by_hand.requests[by_hand.add_request(prompt, params)]
    while by_hand.has_unfinished:
        by_hand.step()
    want = [(c.token_ids, c.finish_reason) for c in by_hand.collect([root]).completions]
    assert len(want[0][0]) == ends_at and want[0][1] == "stop"
    assert all(len(tokens) > ends_at for tokens, _ in want[1:])  # the others go on

    engine = checked(paged_hf.Engine(model, block_size=4))
    out = engine.generate([prompt], params)[0]
    assert [(c.token_ids, c.finish_reason) for c in out.completions] == want
    assert all(c.finish_reason in ("stop", "length") for c in out.completions)
    assert_clean(engine)


def test_hf_num_return_sequences_rows_ending_on_eos_at_different_steps():
    """The drop-in call: ``num_return_sequences=3`` sampled rows where EOS ends one steps before
    the others. Each row runs to its own end (its first EOS, then padding, or max_new_tokens),
    and the call is the same call on a freshly patched model (the global seed set alike); the
    engine is left with nothing running."""
    max_new = 8
    model = paged_hf.patch(make_tiny_model("llama"))
    ids = torch.tensor(tiny_prompts(model.config.vocab_size, 1, [7], seed=11))
    width = ids.shape[1]

    def call(model, eos):
        torch.manual_seed(0)
        return model.generate(
            ids,
            do_sample=True,
            max_new_tokens=max_new,
            num_return_sequences=3,
            eos_token_id=eos,
            pad_token_id=PAD_ID,
        )

    free = call(model, None)[:, width:].tolist()  # no EOS (None: not the config's, as in HF)
    eos, ends_at = first_ending(free)
    out = call(model, eos)
    rows = out[:, width:].tolist()
    lengths = [row.index(eos) + 1 if eos in row else len(row) for row in rows]
    assert lengths[0] == ends_at and all(n > ends_at for n in lengths[1:]), lengths
    for row, n in zip(rows, lengths):
        assert row[n:] == [PAD_ID] * (len(row) - n) if eos in row else n == max_new, row
    assert torch.equal(out[:, :width], ids.expand(3, -1))
    assert_clean(paged_hf.engine_for(model))
    assert torch.equal(out, call(paged_hf.patch(make_tiny_model("llama")), eos))


def test_stop_tokens_min_new_tokens_logprobs_and_eos_padding():
    model = make_tiny_model("llama")
    engine = paged_hf.Engine(model)
    prompt = tiny_prompts(model.config.vocab_size, 1, 6, seed=12)[0]
    free = engine.generate([prompt], paged_hf.SamplingParams(max_new_tokens=10, ignore_eos=True))[
        0
    ].token_ids
    stop = free[3]
    first = free.index(stop)
    out = engine.generate(
        [prompt], paged_hf.SamplingParams(max_new_tokens=10, stop_token_ids=(stop,), logprobs=2)
    )[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    chosen, top = out.completions[0].logprobs[0]
    assert len(top) == 2 and chosen <= max(top.values()) + 1e-6
    held = engine.generate(
        [prompt],
        paged_hf.SamplingParams(
            max_new_tokens=10, stop_token_ids=(stop,), min_new_tokens=first + 2
        ),
    )[0]
    assert len(held.token_ids) >= first + 2

    # transformers-style: a row that hits EOS early is padded with pad_token_id
    model2 = paged_hf.patch(make_tiny_model("llama"))
    ids, mask = left_pad([prompt, prompt[:3]])
    out = model2.generate(
        ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=stop
    )
    row = out[0, ids.shape[1] :].tolist()
    assert row[: first + 1] == free[: first + 1] and all(t == PAD_ID for t in row[first + 1 :])


def test_return_dict_and_streamer():
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []
            self.ended = False

        def put(self, value):
            self.chunks.append(value.tolist())

        def end(self):
            self.ended = True

    model = paged_hf.patch(make_tiny_model("llama"))
    ids = torch.tensor([tiny_prompts(model.config.vocab_size, 1, 5, seed=13)[0]])
    streamer = Collect()
    out = model.generate(
        ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, streamer=streamer
    )
    seq = out.sequences[0].tolist()
    assert streamer.ended and streamer.chunks[0] == ids.tolist()
    assert [c[0] for c in streamer.chunks[1:]] == seq[5:]


@pytest.mark.parametrize(
    "penalties",
    [
        dict(encoder_repetition_penalty=3.0),
        dict(encoder_repetition_penalty=0.4, repetition_penalty=1.3),
    ],
)
def test_encoder_repetition_penalty_is_transformers_on_the_padded_rows(penalties):
    """transformers applies it to a decoder-only model's input_ids as the caller padded them (the
    pad token favoured too), before the repetition penalty: each token is the argmax of transformers'
    own processors' scores, and the penalty changes the tokens (it was once silently ignored)."""
    from oracle import processed_violations
    from transformers import (
        EncoderRepetitionPenaltyLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
    )

    reference = make_tiny_model("llama")
    model = paged_hf.patch(make_tiny_model("llama"))
    prompts = tiny_prompts(reference.config.vocab_size, 3, [4, 9, 17], seed=6)
    ids, mask = left_pad(prompts)
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, **penalties
    )
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    expected = reference.generate(
        ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, **penalties
    )
    assert not torch.equal(out, plain), (
        "the penalty changed nothing: this test would not see it ignored"
    )
    width = ids.shape[1]
    for i, (prompt, gen) in enumerate(zip(prompts, generated_rows(out, width))):
        row = ids[i].tolist()
        processors = [
            EncoderRepetitionPenaltyLogitsProcessor(
                penalties["encoder_repetition_penalty"], torch.tensor([row])
            )
        ]
        if "repetition_penalty" in penalties:
            processors.append(
                RepetitionPenaltyLogitsProcessor(
                    penalties["repetition_penalty"],
                    prompt_ignore_length=torch.tensor([width - len(prompt)]),
                )
            )
        assert not processed_violations(reference, row, prompt, gen, processors), f"row {i}"
    same = sum(torch.equal(a, b) for a, b in zip(out, expected))
    assert same >= 2, f"only {same} of 3 rows are transformers' tokens exactly"


def test_encoder_repetition_penalty_on_the_engine_is_the_prompts():
    """Engine API: SamplingParams(encoder_repetition_penalty=...) favours the prompt's tokens; the
    processed logprobs are transformers' processor's scores' log-softmax."""
    from transformers import EncoderRepetitionPenaltyLogitsProcessor

    model = make_tiny_model("llama")
    prompt = tiny_prompts(model.config.vocab_size, 1, [11], seed=7)[0]
    params = paged_hf.SamplingParams(
        max_new_tokens=4,
        encoder_repetition_penalty=2.5,
        logprobs=3,
        logprobs_mode="processed",
        ignore_eos=True,
    )
    out = paged_hf.Engine(model).generate([prompt], params)[0]
    processor = EncoderRepetitionPenaltyLogitsProcessor(2.5, torch.tensor([prompt]))
    with torch.no_grad():
        logits = (
            model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        )
    for i, (chosen, top) in enumerate(out.completions[0].logprobs):
        expected = torch.log_softmax(processor(None, logits[i : i + 1].clone())[0], dim=-1)
        assert abs(chosen - float(expected[out.token_ids[i]])) < 1e-4
        assert all(abs(v - float(expected[t])) < 1e-4 for t, v in top.items())
    with pytest.raises(ValueError, match="encoder_repetition_penalty"):
        paged_hf.SamplingParams(encoder_repetition_penalty=0.0)


@pytest.mark.parametrize(
    "option",
    [
        {"num_beam_groups": 2, "num_beams": 2, "diversity_penalty": 0.5},
        {"penalty_alpha": 0.6, "top_k": 4},
        {"guidance_scale": 2.0},
        {"output_attentions": True, "return_dict_in_generate": True},
        {"dola_layers": "low"},
    ],
)
def test_options_it_cannot_honour_raise(option):
    model = paged_hf.patch(make_tiny_model("llama"))
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(NotImplementedError, match=next(iter(option))):
        model.generate(ids, max_new_tokens=3, **option)


def test_large_batch_is_admitted_as_the_pool_allows():
    model = paged_hf.patch(make_tiny_model("llama"), num_blocks=40, block_size=4, max_num_seqs=8)
    prompts = tiny_prompts(model.config.vocab_size, 300, [3 + i % 9 for i in range(300)], seed=14)
    ids, mask = left_pad(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    engine = paged_hf.engine_for(model)
    assert out.shape[0] == 300 and engine.stats()["peak_blocks_used"] <= 40
    for i in (0, 137, 299):
        assert_teacher_forced(
            make_tiny_model("llama"),
            prompts[i],
            generated_rows(out[i : i + 1], ids.shape[1])[0],
            what=f"row {i}",
        )


def test_swap_preemption_gives_the_same_tokens_without_recomputing():
    model = make_tiny_model("llama")
    prompts = tiny_prompts(model.config.vocab_size, 6, [20, 9, 30, 14, 25, 7], seed=3)
    params = paged_hf.SamplingParams(max_new_tokens=24, ignore_eos=True)
    tight = dict(
        num_blocks=14,
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=6,
        enable_prefix_caching=False,
    )
    recompute = paged_hf.Engine(model, **tight)
    swap = paged_hf.Engine(model, preemption_mode="swap", **tight)
    want = [o.token_ids for o in recompute.generate(prompts, params)]
    got = [o.token_ids for o in swap.generate(prompts, params)]
    s_swap, s_re = swap.stats(), recompute.stats()
    assert s_swap["preemptions"] > 0 and s_re["preemptions"] > 0
    for p, g, w in zip(prompts, got, want):
        assert len(g) == len(w) == 24
        assert_teacher_forced(model, p, g, what="swap preemption")
    assert s_swap["prefill_tokens_computed"] == sum(map(len, prompts))  # nothing computed twice
    assert s_re["prefill_tokens_computed"] > s_swap["prefill_tokens_computed"]
    assert swap.kv_manager.pool.num_used == 0


def test_warmup_leaves_the_engine_as_it_was():
    """Engine.warmup runs throwaway requests, then leaves no request, no cached block and zero
    stats behind: the requests that follow run exactly as on a fresh engine."""
    model = make_tiny_model("gemma2")
    prompts = tiny_prompts(model.config.vocab_size, 4, [9, 23, 5, 17], seed=21)
    params = paged_hf.SamplingParams(max_new_tokens=10, ignore_eos=True)
    config = dict(num_blocks=48, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    fresh = paged_hf.Engine(model, **config)
    want = [o.token_ids for o in fresh.generate(prompts, params)]

    warm = paged_hf.Engine(model, **config)
    assert warm.warmup() > 0
    stats = warm.stats()
    assert (stats["steps"], stats["prompt_tokens"], stats["generated_tokens"]) == (0, 0, 0)
    assert (stats["blocks_used"], stats["blocks_cached"], stats["blocks_free"]) == (0, 0, 48)
    assert not warm.requests and not warm.has_unfinished
    got = [o.token_ids for o in warm.generate(prompts, params)]
    assert got == want
    untimed = [{k: v for k, v in e.stats().items() if k != "latency"} for e in (warm, fresh)]
    assert untimed[0] == untimed[1]
    # the warm-up's requests are not among the latency records
    assert warm.stats()["latency"][0]["requests"] == fresh.stats()["latency"][0]["requests"] == 4
    assert warm.warmup() == 0.0, "an engine that has stepped is warm already"
    warm.add_request(prompts[0], params)
    with pytest.raises(RuntimeError, match="before requests"):
        warm.warmup()


def test_right_padding_is_told_and_each_row_continues_its_own_tokens(caplog):
    """A tokenizer left at padding_side="right": transformers continues after the pads; a patched
    model continues each row after its own last token (the left-padded call's result) and says so,
    naming the rows, every call."""
    reference = make_tiny_model("llama")
    model = paged_hf.patch(make_tiny_model("llama"))
    prompts = tiny_prompts(reference.config.vocab_size, 3, [4, 9, 6], seed=8)
    width = max(map(len, prompts))
    right = torch.full((3, width), PAD_ID)
    mask = torch.zeros_like(right)
    for i, p in enumerate(prompts):
        right[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
    left_ids, left_mask = left_pad(prompts)
    kw = dict(max_new_tokens=6, do_sample=False)
    want = generated_rows(model.generate(left_ids, attention_mask=left_mask, **kw), width)
    theirs = generated_rows(reference.generate(right, attention_mask=mask, **kw), width)
    for _ in range(2):
        caplog.clear()
        with caplog.at_level("WARNING", logger="paged_hf"):
            ours = generated_rows(model.generate(right, attention_mask=mask, **kw), width)
        assert "right padding in row(s) [0, 2]" in caplog.text
    assert ours == want and theirs != want
    caplog.clear()
    with caplog.at_level("WARNING", logger="paged_hf"):
        model.generate(left_ids, attention_mask=left_mask, **kw)
    assert "right padding" not in caplog.text
