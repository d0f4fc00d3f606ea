"""Fault isolation and cache coherence (issue 10): one request, one failed step or one weight
update never harms anyone else. One test per defect seen on the engine before this issue.

fp64 tiny models make greedy tokens independent of batch composition, so "the others' tokens
do not change" is checked as equality with a fault-free run.
"""

from __future__ import annotations

import pytest
import torch
from engine_state import assert_clean
from oracle import assert_teacher_forced
from tiny_models import make_tiny_model, tiny_prompts

import paged_hf
from paged_hf import SamplingParams
from paged_hf.frontends.serve import BackgroundEngine
from paged_hf.requests.request import root_request_id

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
BYSTANDER = [5, 6, 7, 8]  # a request of nobody's call, running while a call fails


def assert_ran_through_the_fault(engine, rid, alone):
    """The bystander was mid-run when the fault hit, and then made its tokens alone."""
    running = engine.requests[rid]
    assert running.num_output_tokens > 0 and not running.is_finished
    out = engine.run_until_done([rid])[0]
    assert out.error is None and out.token_ids == alone


@pytest.fixture(scope="module")
def reference(model, prompts):
    """Fault-free tokens of ``prompts`` under GREEDY."""
    return [
        o.token_ids
        for o in paged_hf.Engine(model, block_size=4, num_blocks=64).generate(prompts, GREEDY)
    ]


# ---- poison requests are refused at admission (each used to fail inside step() and wedge it) ----


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(logprobs=10**6), "logprobs"),
        (dict(cache_salt=["x"]), "cache_salt"),
        (dict(cache_salt=1), "cache_salt"),
        (dict(seed=2**64 - 1, n=2, temperature=1.0), "seed"),
        (dict(seed=-1, temperature=1.0), "seed"),
        (dict(repetition_penalty=1e-300), "repetition_penalty"),
        (dict(ignore_eos="no"), "ignore_eos"),
    ],
)
def test_poison_params_are_refused_naming_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**params)


@pytest.mark.parametrize("stop", [5, "12", [1.9], [True], [None]])
def test_stop_token_ids_must_be_a_list_of_ints(stop):
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=stop)


def test_refused_request_in_a_batch_ends_alone(model, prompts, reference):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    most_logprobs = GREEDY.with_(logprobs=20)
    outs = engine.generate(
        prompts + [prompts[0], [5, 6]],
        [GREEDY] * 4 + [most_logprobs, GREEDY.with_(stop_token_ids=(999,))],
    )
    assert [o.token_ids for o in outs[:4]] == reference
    assert outs[4].error is None and len(outs[4].completions[0].logprobs) == 6
    assert "stop token id 999 is outside the vocabulary" in outs[5].error
    assert_clean(engine)


def test_logprobs_above_the_vocabulary_are_refused():
    tiny = make_tiny_model("llama")
    # what the engine reads; the check must not need a real 16-token model
    tiny.config.vocab_size = 16
    engine = paged_hf.Engine(tiny, num_blocks=8)
    with pytest.raises(ValueError, match=r"logprobs=20 exceeds the vocabulary \(16\)"):
        engine.add_request([5, 6], SamplingParams(logprobs=20))


def test_tiny_temperature_is_greedy_not_the_last_token(model, prompts, reference):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    outs = engine.generate(prompts, GREEDY.with_(temperature=1e-40, seed=0))
    assert [o.token_ids for o in outs] == reference
    assert (
        SamplingParams(temperature=1e-40).is_greedy
        and not SamplingParams(temperature=1e-4).is_greedy
    )


def test_unseeded_none_prompt_and_bad_ids_name_the_request(model):
    engine = paged_hf.Engine(model, num_blocks=16)
    with pytest.raises(
        ValueError, match="request x: a prompt is text or a list of token ids, got NoneType"
    ):
        engine.add_request(None, request_id="x")
    with pytest.raises(TypeError, match="request_id"):
        engine.add_request([5], request_id=1.5)
    assert_clean(engine)


# ---- failures inside a step end their requests alone; the engine keeps serving ----


def test_forward_that_raises_once_ends_that_steps_requests_and_frees_their_blocks(
    model, prompts, reference
):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64, max_num_seqs=2)
    execute, calls = engine.runner.execute, []

    def flaky(scheduled, copies):
        calls.append([r.request_id for r, _ in scheduled])
        if len(calls) == 3:
            raise RuntimeError("transient device error")
        return execute(scheduled, copies)

    engine.runner.execute = flaky
    outs = engine.generate(prompts, GREEDY)
    in_failed_step = set(calls[2])
    assert in_failed_step and len(in_failed_step) < len(prompts)
    for out, ref in zip(outs, reference):
        if out.request_id in in_failed_step:
            assert out.finish_reason == "error" and "transient device error" in out.error
            assert out.request_id in out.error
        else:
            assert out.error is None and out.token_ids == ref
    assert_clean(engine)
    engine.runner.execute = execute
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == reference


def test_a_requests_sampling_failure_ends_it_alone(model, prompts, reference, monkeypatch):
    from paged_hf.execution import sampler

    prepare = sampler._prepare_row

    def poisoned(logits, row, req):
        if req.prompt_ids == prompts[1] and req.num_output_tokens == 2:
            raise IndexError("poisoned row")
        prepare(logits, row, req)

    monkeypatch.setattr(sampler, "_prepare_row", poisoned)
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    outs = engine.generate(prompts, GREEDY)
    assert outs[1].finish_reason == "error" and "IndexError: poisoned row" in outs[1].error
    assert outs[1].token_ids == reference[1][:2]  # what it had before it failed
    assert [outs[i].token_ids for i in (0, 2, 3)] == [reference[i] for i in (0, 2, 3)]
    assert_clean(engine)


def test_nan_logits_of_one_request_end_it_alone(model, prompts, reference):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    execute = engine.runner.execute

    def nan_for_second(scheduled, copies):
        logits, meta = execute(scheduled, copies)
        logits = logits.clone()  # out of inference mode, so it can be written
        for row, req in enumerate(meta.sampled_requests):
            if req.prompt_ids == prompts[2]:
                logits[row, 7] = float("nan")
        return logits, meta

    engine.runner.execute = nan_for_second
    outs = engine.generate(prompts, GREEDY)
    assert (
        outs[2].finish_reason == "error"
        and "not finite" in outs[2].error
        and outs[2].token_ids == []
    )
    assert [outs[i].token_ids for i in (0, 1, 3)] == [reference[i] for i in (0, 1, 3)]
    assert_clean(engine)


@pytest.mark.parametrize("fault", [RuntimeError("sampler crashed"), KeyboardInterrupt()])
def test_a_step_failing_after_it_forked_parallel_samples(model, prompts, fault, monkeypatch):
    """The step that first samples an n > 1 request forks its samples, then the sampler fails:
    an error ends the forked samples too; an interrupt takes the fork back (it forks again)."""
    from paged_hf.engine import step as engine_module

    params = SamplingParams(max_new_tokens=5, n=3, temperature=1.0, seed=11, ignore_eos=True)
    expected = paged_hf.Engine(model, block_size=4, num_blocks=64).generate([prompts[1]], params)[0]
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    rid = engine.add_request(prompts[1], params)
    sample = engine_module.sample

    def crash(*args):
        raise fault

    monkeypatch.setattr(engine_module, "sample", crash)
    if isinstance(fault, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        root = engine.requests[rid]
        assert not root.children and not root.forked and engine.kv_manager.pool.num_used == 0
        monkeypatch.setattr(engine_module, "sample", sample)
        out = engine.run_until_done([rid])[0]
        assert [c.token_ids for c in out.completions] == [c.token_ids for c in expected.completions]
    else:
        _, finished = engine.step()
        assert len(finished) == 3 and all(r.finish_reason.value == "error" for r in finished)
        out = engine.run_until_done([rid])[0]
        assert [c.finish_reason for c in out.completions] == ["error"] * 3
    assert_clean(engine)


def test_a_tokenizer_that_cannot_decode_one_output_fails_that_request_alone(
    model, prompts, reference
):
    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            if reference[2][0] in ids:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return " ".join(map(str, ids))

    engine = paged_hf.Engine(model, Tokenizer(), block_size=4, num_blocks=64)
    outs = engine.generate(prompts, GREEDY)
    assert (
        outs[2].finish_reason == "error"
        and "detokenizing its output failed: UnicodeDecodeError" in outs[2].error
    )
    assert outs[2].token_ids == reference[2]
    assert [o.text for i, o in enumerate(outs) if i != 2] == [
        " ".join(map(str, reference[i])) for i in (0, 1, 3)
    ]
    assert_clean(engine)


def test_keyboard_interrupt_from_a_callback_aborts_the_call_and_leaves_the_engine_clean(
    model, prompts, reference
):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    alone = paged_hf.Engine(model, block_size=4, num_blocks=64).generate([BYSTANDER], GREEDY)[0]
    rid = engine.add_request(BYSTANDER, GREEDY)
    seen = []

    def ctrl_c(rid, tok):
        seen.append(rid)
        if len(seen) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, GREEDY, on_token=ctrl_c)
    assert_ran_through_the_fault(engine, rid, alone.token_ids)
    assert_clean(engine)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == reference


def test_keyboard_interrupt_inside_a_step_is_undone(model, prompts, reference):
    """Interrupted mid-forward, the step's requests keep their tokens and recompute their KV."""
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    execute, calls = engine.runner.execute, []

    def interrupted(scheduled, copies):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return execute(scheduled, copies)

    engine.runner.execute = interrupted
    with pytest.raises(KeyboardInterrupt):
        while engine.has_unfinished:
            engine.step()
    assert engine.kv_manager.pool.num_used == 0  # the interrupted step's blocks went back
    assert all(r.num_computed_tokens == 0 for r in engine.requests.values())
    outs = engine.run_until_done(rids)
    assert [o.token_ids for o in outs] == reference
    assert_clean(engine)


def test_streamer_interrupt_aborts_model_generate(model, prompts):
    patched = paged_hf.patch(make_tiny_model("llama").double(), block_size=4, num_blocks=64)

    class Streamer:
        def __init__(self):
            self.puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:
                raise KeyboardInterrupt

        def end(self):
            pass

    ids = torch.tensor([prompts[0]])
    engine = paged_hf.engine_for(patched)
    alone = engine.generate([BYSTANDER], GREEDY)[0].token_ids
    rid = engine.add_request(BYSTANDER, GREEDY)
    with pytest.raises(KeyboardInterrupt):
        patched.generate(ids, max_new_tokens=8, streamer=Streamer())
    assert_ran_through_the_fault(engine, rid, alone)
    assert_clean(engine)
    out = patched.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(prompts[0]) + 4)


def test_swap_out_failure_falls_back_to_recompute(model, prompts):
    kw = dict(
        block_size=4,
        num_blocks=14,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        preemption_mode="swap",
    )
    long = SamplingParams(max_new_tokens=14, ignore_eos=True)
    ref_engine = paged_hf.Engine(model, **kw)
    reference = [o.token_ids for o in ref_engine.generate(prompts, long)]
    assert ref_engine.stats()["preemptions"] > 0, "the workload must preempt"

    engine = paged_hf.Engine(model, **kw)
    calls = []

    def broken_swap_out(blocks):
        calls.append(blocks)
        raise RuntimeError("pinned memory exhausted")

    engine.runner.backend.swap_out = broken_swap_out
    outs = engine.generate(prompts, long)
    assert calls and [o.token_ids for o in outs] == reference and all(o.error is None for o in outs)
    assert_clean(engine)


def test_abort_from_inside_on_token_keeps_the_other_outputs(model, prompts, reference):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    ids = {}

    def abort_second(rid, tok):
        ids.setdefault(rid, 0)
        ids[rid] += 1
        victim = sorted(ids)[1] if len(ids) > 1 else None
        if victim is not None and victim in engine.requests and ids[victim] >= 2:
            engine.abort(victim)

    outs = engine.generate(prompts, GREEDY, on_token=abort_second)
    aborted = [o for o in outs if o.finish_reason == "abort"]
    assert len(aborted) == 1 and 2 <= len(aborted[0].token_ids) < 6
    for out, ref in zip(outs, reference):
        if out.finish_reason != "abort":
            assert out.token_ids == ref
    assert_clean(engine)


def test_a_failing_callback_ends_its_request_alone(model, prompts, reference):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    first = []

    def fails_for_first(rid, tok):
        first.append(rid)
        if rid == first[0]:
            raise ValueError("callback bug")

    outs = engine.generate(prompts, GREEDY, on_token=fails_for_first)
    assert (
        outs[0].finish_reason == "error"
        and "on_token callback raised ValueError: callback bug" in outs[0].error
    )
    assert [o.token_ids for o in outs[1:]] == reference[1:]
    assert_clean(engine)


# ---- identity: caller ids and the engine's own ids never collide ----


def test_caller_id_like_a_sample_id_does_not_collide(model, prompts):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    sampled = SamplingParams(max_new_tokens=6, n=2, temperature=1.0, seed=5, ignore_eos=True)
    engine.add_request(prompts[0], sampled, request_id="job")
    engine.step()
    engine.step()
    engine.add_request(prompts[1], GREEDY, request_id="job#1")
    cancelled = engine.abort("job#1")
    assert cancelled.prompt_token_ids == prompts[1] and cancelled.finish_reason == "abort"
    out = engine.run_until_done(["job"])[0]
    assert len(out.completions) == 2 and all(len(c.token_ids) == 6 for c in out.completions)
    assert_clean(engine)


def test_step_never_hands_out_one_id_for_two_requests(model, prompts):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    sampled = SamplingParams(max_new_tokens=6, n=2, temperature=1.0, seed=5, ignore_eos=True)
    engine.add_request(prompts[0], sampled, request_id="job")
    engine.add_request(prompts[1], GREEDY, request_id="job#1")
    seen: dict[str, object] = {}
    while engine.has_unfinished:
        sampled_now, _finished = engine.step()
        for req in sampled_now:
            assert seen.setdefault(req.request_id, req) is req, (
                f"two requests stepped as {req.request_id!r}"
            )
    assert {"job", "job#1"} <= set(seen) and len(seen) == 3
    child = next(r for rid, r in seen.items() if rid not in ("job", "job#1"))
    assert child.parent is seen["job"] and root_request_id(child.request_id) == "job"
    engine.run_until_done(["job", "job#1"])
    assert_clean(engine)


def test_caller_ids_never_hit_auto_ids(model, prompts, reference):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    engine.add_request(prompts[0], GREEDY, request_id="1")
    engine.add_request(prompts[1], GREEDY, request_id="0")
    # used to refuse a valid prompt: "request 1: id already in use"
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference and all(o.error is None for o in outs)
    with pytest.raises(ValueError, match="ids starting with 'paged_hf:'"):
        engine.add_request(prompts[0], GREEDY, request_id="paged_hf:0")
    engine.run_until_done(["1", "0"])
    assert_clean(engine)


def test_background_engine_caller_id_like_a_sample_id(model, prompts):
    bg = paged_hf.serve(model, block_size=4, num_blocks=64, warmup=False)
    try:
        job = bg.submit(
            prompts[0],
            SamplingParams(max_new_tokens=40, n=2, temperature=1.0, seed=1, ignore_eos=True),
            request_id="job",
        )
        other = bg.submit(
            prompts[1], SamplingParams(max_new_tokens=40, ignore_eos=True), request_id="job#1"
        )
        other.cancel()
        got = other.result(timeout=30)
        assert got.prompt_token_ids == prompts[1] and got.finish_reason == "abort"
        out = job.result(timeout=60)
        assert len(out.completions) == 2 and all(len(c.token_ids) == 40 for c in out.completions)
        auto = bg.submit(prompts[2], GREEDY)
        assert auto.request_id.startswith("paged_hf:") and auto.result(timeout=30).error is None
    finally:
        bg.shutdown()
    assert_clean(bg.engine)


def test_background_engine_keeps_serving_after_a_failed_step(model, prompts, reference):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    execute, calls = engine.runner.execute, []

    def fails_once(scheduled, copies):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("transient")
        return execute(scheduled, copies)

    engine.runner.execute = fails_once
    bg = BackgroundEngine(engine)
    try:
        first = bg.submit(prompts[0], GREEDY).result(timeout=30)
        assert first.finish_reason == "error" and "transient" in first.error
        later = [bg.submit(p, GREEDY) for p in prompts]
        assert [h.result(timeout=60).token_ids for h in later] == reference
        assert bg.is_running
    finally:
        bg.shutdown()
    assert_clean(engine)


# ---- coherence: the prefix cache never serves KV other weights computed ----


def test_online_training_generate_step_generate_matches_updated_weights():
    """The RL / online-training loop: generate, step the optimizer, generate the same prompts."""
    torch.manual_seed(0)
    model = paged_hf.patch(make_tiny_model("llama"), block_size=4, num_blocks=64)
    ids = torch.tensor(tiny_prompts(model.config.vocab_size, 3, [12, 12, 12], seed=7))
    engine = paged_hf.engine_for(model)
    first = model.generate(ids, max_new_tokens=6, do_sample=False)
    model.generate(ids, max_new_tokens=6, do_sample=False)
    hits = engine.stats()["prefix_hit_tokens"]
    assert hits > 0, "unchanged weights: the second call reads the first one's cached prompts"

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    # plain forward of a patched model trains as before
    loss = model(input_ids=first, labels=first).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

    second = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert engine.stats()["prefix_hit_tokens"] == hits, (
        "no block computed by the old weights may be served"
    )
    assert not torch.equal(first, second), (
        "the update must change the tokens for this test to mean anything"
    )
    for row, prompt in zip(second.tolist(), ids.tolist()):
        assert_teacher_forced(model, prompt, row[12:], what="after an optimizer step")
    reference = paged_hf.unpatch(model).generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(second, reference)


def test_load_state_dict_and_explicit_reset_drop_the_cache(model, prompts):
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    engine.generate(prompts, GREEDY)
    assert engine.stats()["blocks_cached"] > 0
    with torch.no_grad():
        # same values, written in place: still a new version
        model.load_state_dict(model.state_dict())
    engine.generate([[5, 6, 7]], GREEDY)
    again = engine.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens == 0 for o in again)
    cached = engine.generate(prompts, GREEDY)
    assert any(o.num_cached_tokens > 0 for o in cached)  # unchanged weights: the cache serves again
    engine.reset_prefix_cache()
    assert engine.stats()["blocks_cached"] == 0
    assert all(o.num_cached_tokens == 0 for o in engine.generate(prompts, GREEDY))


def test_a_replaced_parameter_is_seen_at_the_next_generate(prompts):
    model = make_tiny_model("llama").double()
    engine = paged_hf.Engine(model, block_size=4, num_blocks=64)
    engine.generate(prompts, GREEDY)
    assert any(o.num_cached_tokens > 0 for o in engine.generate(prompts, GREEDY))
    proj = model.model.layers[0].self_attn.k_proj
    # a new tensor, the old one untouched
    proj.weight = torch.nn.Parameter(proj.weight.detach() * 3)
    outs = engine.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens == 0 for o in outs)
    for prompt, out in zip(prompts, outs):
        assert_teacher_forced(model, prompt, out.token_ids, what="after replacing a parameter")


def test_unpatch_refuses_while_serving_and_a_stale_engine_refuses_to_run(prompts):
    model = paged_hf.patch(make_tiny_model("llama"), num_blocks=32)
    bg = paged_hf.serve(model, warmup=False)
    try:
        with pytest.raises(RuntimeError, match="unpatch: 1 paged_hf engine"):
            paged_hf.unpatch(model)
        assert bg.generate(prompts[0], GREEDY).error is None
    finally:
        bg.shutdown()
    engine = paged_hf.engine_for(model)
    paged_hf.unpatch(model)
    with pytest.raises(RuntimeError, match="unpatched"):
        engine.add_request(prompts[0], GREEDY)


def test_set_attn_implementation_after_patch_stops_the_engine(prompts):
    model = paged_hf.patch(make_tiny_model("llama"), num_blocks=32)
    engine = paged_hf.engine_for(model)
    engine.add_request(prompts[0], GREEDY)
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="attention implementation is now 'sdpa'"):
        engine.step()
