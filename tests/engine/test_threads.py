"""Several threads calling one patched model's ``generate`` (and the engine's ``generate`` / ``score``)
at once: HELM's four threads, a web app's thread pool. Their rows share the engine's steps, and each
call returns what it returns alone (fp64: greedy tokens do not depend on what shares a step); a call
whose callback raises ends alone; an interrupted call aborts its own rows; nothing leaks."""

from __future__ import annotations

import _thread
import signal
import threading
import time

import pytest
import torch
from engine_state import assert_clean
from tiny_models import EOS_ID, left_pad, make_tiny_model, tiny_prompts
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria

import paged_hf
from paged_hf import SamplingParams


class EveryThird(StoppingCriteria):
    """Per row: stop on a token divisible by 3."""

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] % 3 == 0


class BanLast(LogitsProcessor):
    """Never repeat the row's last token."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), input_ids[:, -1]] = -float("inf")
        return scores


class RaisesAt(StoppingCriteria):
    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyError("criterion failed on purpose")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.fixture(scope="module")
def model():
    return paged_hf.patch(make_tiny_model("llama").double(), block_size=4, num_blocks=512)


def calls(model):
    """Eight calls, each a function of no arguments giving something comparable."""
    vocab = model.config.vocab_size
    batches = [left_pad(tiny_prompts(vocab, 3, [5 + i, 11, 17 + 2 * i], seed=i)) for i in range(6)]
    engine = paged_hf.engine_for(model)
    chat = tiny_prompts(vocab, 2, [9, 23], seed=40)

    def gen(i, **kw):
        ids, mask = batches[i]
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, **kw)
        out = out.sequences if hasattr(out, "sequences") else out
        return out.tolist()

    def scores():
        ids, mask = batches[5]
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        return out.sequences.tolist(), [s.tolist() for s in out.scores]

    return {
        "greedy": lambda: gen(0, do_sample=False),
        "criteria": lambda: gen(1, do_sample=False, stopping_criteria=[EveryThird()]),
        "processor": lambda: gen(
            2, do_sample=False, logits_processor=LogitsProcessorList([BanLast()])
        ),
        "beams": lambda: gen(3, num_beams=3, do_sample=False),
        "eos and min length": lambda: gen(
            4, do_sample=False, eos_token_id=EOS_ID, min_new_tokens=4
        ),
        "scores": scores,
        "seeded sampling": lambda: [
            o.token_ids
            for o in engine.generate(
                chat, SamplingParams(max_new_tokens=20, temperature=0.9, top_k=40, seed=7)
            )
        ],
        "score": lambda: [
            round(o.logprob, 9)
            for o in engine.score([(chat[0], chat[1][:6]), (chat[1], chat[0][:4])])
        ],
    }


def run_in_threads(fns: dict, start: threading.Barrier | None = None) -> dict:
    results, errors = {}, {}
    start = start or threading.Barrier(len(fns))

    def run(name, fn):
        start.wait()
        try:
            results[name] = fn()
        except BaseException as e:  # noqa: BLE001
            errors[name] = e

    threads = [threading.Thread(target=run, args=item) for item in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return results | {name: e for name, e in errors.items()}


def test_eight_threads_at_once_each_get_what_they_get_alone(model):
    fns = calls(model)
    engine = paged_hf.engine_for(model)
    start = engine.stats()["steps"]
    alone = {name: fn() for name, fn in fns.items()}
    steps_alone = engine.stats()["steps"] - start
    start = engine.stats()["steps"]
    together = run_in_threads(fns)
    for name in fns:
        assert not isinstance(together[name], BaseException), f"{name}: {together[name]!r}"
        assert together[name] == alone[name], name
    # they shared steps: far fewer than the calls one after another took
    assert engine.stats()["steps"] - start < 0.7 * steps_alone
    assert engine.stats()["peak_running"] > 9  # more rows at once than any one call has
    assert_clean(engine)


def test_a_failing_callback_ends_only_its_own_call(model):
    fns = calls(model)
    alone = {name: fns[name]() for name in ("greedy", "beams", "seeded sampling")}
    ids, mask = left_pad(tiny_prompts(model.config.vocab_size, 2, [6, 13], seed=77))
    fns = {name: fns[name] for name in alone} | {
        "raises": lambda: model.generate(
            ids, attention_mask=mask, max_new_tokens=16, stopping_criteria=[RaisesAt(4)]
        )
    }
    together = run_in_threads(fns)
    assert isinstance(together["raises"], KeyError) and "on purpose" in str(together["raises"])
    for name in alone:
        assert together[name] == alone[name], name
    assert_clean(paged_hf.engine_for(model))


def test_ctrl_c_in_the_main_threads_call_aborts_it_alone(model):
    """KeyboardInterrupt reaches the main thread's call (stepping or waiting for its turn): its rows
    are aborted; a call in another thread gets its tokens as alone."""
    fns = calls(model)
    expected = fns["greedy"]()
    vocab = model.config.vocab_size
    ids, mask = left_pad(tiny_prompts(vocab, 4, [30, 40, 50, 60], seed=5))
    engine = paged_hf.engine_for(model)
    other: dict = {}
    started = threading.Event()

    def background():
        started.set()
        other["out"] = fns["greedy"]()

    in_call, over, turn = threading.Event(), threading.Event(), threading.Lock()

    def interrupt_soon():
        # counted from the main thread's call on: the engine's count includes earlier calls, and
        # an interrupt before the call would land outside it
        in_call.wait()
        base = engine.stats()["generated_tokens"]
        while engine.stats()["generated_tokens"] < base + 20:
            time.sleep(0.001)
        while True:  # again if one was lost (run in a finalizer, say), never after the call
            with turn:
                if over.is_set():
                    return
                _thread.interrupt_main()
            if over.wait(5):
                return

    # Python's own Ctrl-C handler, whatever an earlier test left (interrupt_main does nothing
    # where SIGINT is ignored or left to the system)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    thread = threading.Thread(target=background)
    thread.start()
    started.wait()
    threading.Thread(target=interrupt_soon, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            try:
                in_call.set()
                for _ in range(50):  # long enough to be interrupted in the middle
                    model.generate(ids, attention_mask=mask, max_new_tokens=200, eos_token_id=None)
            finally:
                with turn:
                    over.set()
    finally:
        signal.signal(signal.SIGINT, handler)
    thread.join(timeout=300)
    assert other["out"] == expected
    assert_clean(engine)


def test_generate_beside_a_background_engine(model):
    """A ``serve()`` engine and ``model.generate`` calls from two threads, on one engine: the
    background requests stream their tokens and the calls return theirs, as alone."""
    fns = calls(model)
    expected = {name: fns[name]() for name in ("greedy", "criteria")}
    prompt = tiny_prompts(model.config.vocab_size, 1, 12, seed=99)[0]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    alone = paged_hf.engine_for(model).generate([prompt], params)[0].token_ids
    bg = paged_hf.serve(model, warmup=False)
    try:
        handles = [bg.submit(prompt, params) for _ in range(3)]
        together = run_in_threads({name: fns[name] for name in expected})
        streamed = [list(h.token_ids()) for h in handles]
        outs = [h.result(timeout=60) for h in handles]
    finally:
        bg.shutdown()
    assert together == expected
    assert all(s == alone and o.token_ids == alone for s, o in zip(streamed, outs))
    assert_clean(paged_hf.engine_for(model))


def test_a_call_hears_only_its_own_rows(model):
    """A streamer (and any ``on_token``) gets its own call's tokens, not those of a request that
    shares its steps (it once got every request's), and its failure ends only its own rows."""
    from transformers import TextStreamer

    class Tokens(TextStreamer):
        def __init__(self):
            self.got = []

        def put(self, value):
            self.got.append(value.tolist())

        def end(self):
            pass

    engine = paged_hf.engine_for(model)
    prompt = tiny_prompts(model.config.vocab_size, 1, 9, seed=3)[0]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    alone = engine.generate([prompt], params)[0].token_ids
    other = engine.add_request(prompt, params)
    ids = torch.tensor([tiny_prompts(model.config.vocab_size, 1, 7, seed=4)[0]])
    streamer = Tokens()
    out = model.generate(
        ids, max_new_tokens=8, do_sample=False, streamer=streamer, eos_token_id=None
    )
    assert (
        streamer.got[0] == ids.tolist() and [t[0] for t in streamer.got[1:]] == out[0, 7:].tolist()
    )

    def fails(rid, tok):
        raise ValueError("callback failed on purpose")

    mine = engine.add_request(prompt, params)
    (failed,) = engine.run_until_done([mine], on_token=fails)
    assert failed.error is not None and "on purpose" in failed.error
    (bystander,) = engine.run_until_done([other])
    assert bystander.error is None and bystander.token_ids == alone
    assert_clean(engine)


def test_a_patched_model_with_its_engine_can_be_deep_copied(model):
    """copy.deepcopy of a patched model that has run (TRL's reference model, a notebook's copy):
    the copy's engine gets a free lock of its own and gives the same tokens."""
    import copy

    ids = torch.tensor([tiny_prompts(model.config.vocab_size, 1, 9, seed=12)[0]])
    want = model.generate(ids, max_new_tokens=6, do_sample=False)
    twin = copy.deepcopy(model)
    assert torch.equal(twin.generate(ids, max_new_tokens=6, do_sample=False), want)
    assert paged_hf.engine_for(twin).lock is not paged_hf.engine_for(model).lock
