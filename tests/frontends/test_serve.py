"""The background engine: streaming, cancel, errors at submit and in the loop, stats and plot."""

from __future__ import annotations

import threading

import pytest
from tiny_models import make_tiny_model
from tiny_tokenizer import make_tiny_tokenizer

import paged_hf
from paged_hf import SamplingParams
from paged_hf.frontends.serve import EngineStopped, IncrementalDetokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture
def bg(model, tokenizer):
    engine = paged_hf.serve(model, tokenizer, num_blocks=128, block_size=4, max_num_seqs=8)
    yield engine
    engine.shutdown()


def test_stream_deltas_concatenate_to_the_final_text(bg, model, tokenizer):
    # a random byte-level model emits many split multi-byte characters: each must wait for its end
    prompts = ["héllo wörld", "東京 tower 🙂", "the quick brown fox", "naïve café"]
    handles = [
        bg.submit(p, SamplingParams(max_new_tokens=48, temperature=1.0, seed=i))
        for i, p in enumerate(prompts)
    ]
    results = {}

    def consume(k, h):
        results[k] = list(h.stream())

    threads = [threading.Thread(target=consume, args=(k, h)) for k, h in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    split_chars = 0
    for k, h in enumerate(handles):
        out = h.result()
        assert "".join(results[k]) == out.text
        assert len(results[k]) > 1
        # the stream matches the engine's own run of the same request
        ref = paged_hf.Engine(model, tokenizer).generate(
            [prompts[k]], SamplingParams(max_new_tokens=48, temperature=1.0, seed=k)
        )[0]
        assert out.token_ids == ref.token_ids
        # non-ASCII byte tokens
        split_chars += sum(1 for t in out.token_ids if 0x80 + 4 <= t < 4 + 256)
    assert split_chars > 0, "the test should exercise multi-byte characters"
    # token ids without a tokenizer-free view: the raw ids are there too
    assert list(handles[0].token_ids()) == handles[0].result().token_ids


def test_detokenizer_holds_back_partial_characters(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer("a東b", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5  # a, three bytes of 東, b
    deltas = [detok.push(t) for t in ids]
    assert deltas == ["a", "", "", "東", "b"]
    assert detok.finish(tokenizer.decode(ids)) == ""


def test_cancel_frees_blocks_at_once(bg):
    h = bg.submit("a long story " * 4, SamplingParams(max_new_tokens=400, ignore_eos=True))
    tokens = h.token_ids()
    for _ in range(5):
        next(tokens)
    assert bg.stats()["blocks_used"] > 0
    h.cancel()
    stats = bg.stats()
    assert stats["blocks_used"] == 0, stats  # freed when cancel() returned, not some steps later
    out = h.result(timeout=5)
    assert out.finish_reason == "abort" and 5 <= len(out.token_ids) < 400
    assert list(tokens)[-1] == out.token_ids[-1]  # the stream ends
    assert not bg.engine.requests
    h.cancel()  # a finished request: no-op
    # the engine keeps serving
    assert bg.generate("after", SamplingParams(max_new_tokens=3)).finish_reason in (
        "stop",
        "length",
    )


def test_bad_input_raises_at_submit_in_the_callers_thread(bg):
    with pytest.raises(ValueError, match="empty prompt"):
        bg.submit("")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bg.submit([1, 2, 100000])
    with pytest.raises(TypeError):
        bg.submit("x", params={"max_new_tokens": 2})
    h = bg.submit("fine", SamplingParams(max_new_tokens=2))
    assert len(h.result(timeout=30).token_ids) <= 2


def test_concurrent_submitters(bg):
    outs = {}

    def worker(k):
        outs[k] = bg.submit(f"prompt {k}", SamplingParams(max_new_tokens=4)).result(timeout=60)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outs) == list(range(12)) and all(o.token_ids for o in outs.values())


def test_loop_error_reaches_waiting_handles(model, tokenizer, monkeypatch):
    bg = paged_hf.serve(model, tokenizer, num_blocks=64)
    h = bg.submit("hello", SamplingParams(max_new_tokens=200, ignore_eos=True))
    next(h.token_ids())

    def broken_step():
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(bg.engine, "step", broken_step)
    with pytest.raises(EngineStopped, match="kernel exploded"):
        h.result(timeout=10)
    with pytest.raises(EngineStopped):
        list(h.stream())
    with pytest.raises(EngineStopped, match="kernel exploded"):
        bg.submit("again")
    bg.shutdown()


def test_shutdown_aborts_running_requests(model, tokenizer):
    bg = paged_hf.serve(model, tokenizer, num_blocks=64)
    h = bg.submit("hello", SamplingParams(max_new_tokens=500, ignore_eos=True))
    next(h.token_ids())
    bg.shutdown()
    assert h.result(timeout=5).finish_reason == "abort"
    assert not bg.is_running
    with pytest.raises(EngineStopped):
        bg.submit("late")
    bg.shutdown()  # idempotent


def test_token_stream_without_tokenizer(model):
    with paged_hf.serve(model, num_blocks=64) as bg:
        h = bg.submit([5, 6, 7, 8], SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert list(h.stream()) == h.result().token_ids and len(h.result().token_ids) == 6


def test_n_samples_and_stats_frame_and_plot(bg):
    pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    h = bg.submit("several", SamplingParams(max_new_tokens=5, temperature=1.0, seed=3, n=3))
    out = h.result(timeout=30)
    assert len(out.completions) == 3
    assert "".join(h.stream()) == out.text  # the stream follows the first sample
    frame = bg.stats_frame()
    assert list(frame.columns)[:6] == [
        "step",
        "time",
        "running",
        "waiting",
        "tokens",
        "blocks_used",
    ]
    assert len(frame) == bg.stats()["steps"] and frame["time"].iloc[0] == 0
    requests = bg.requests_frame()
    assert len(requests) == 1 and requests["priority"].tolist() == [0]
    assert requests["ttft"].iloc[0] == pytest.approx(out.ttft)
    assert requests["output_tokens"].iloc[0] == len(out.token_ids)
    fig = bg.plot()
    assert len(fig.axes) == 4


def test_a_full_queue_refuses_at_submit_in_the_callers_thread(model, tokenizer):
    bg = paged_hf.serve(
        model, tokenizer, num_blocks=128, block_size=4, max_num_seqs=1, max_waiting=1
    )
    try:
        long = SamplingParams(max_new_tokens=400, ignore_eos=True)
        running = bg.submit("one", long)
        next(running.token_ids())  # admitted: it no longer waits
        waiting = bg.submit("two", long)
        with pytest.raises(paged_hf.QueueFull, match="max_waiting=1"):
            bg.submit("three", long)
        running.cancel()
        waiting.cancel()
        assert bg.stats()["blocks_used"] == 0
    finally:
        bg.shutdown()
