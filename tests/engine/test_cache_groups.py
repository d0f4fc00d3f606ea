"""Cache groups (paged_hf/cache/kv_groups.py): sliding-window and chunked layers hold only the KV
some query can still read, against transformers itself.

Tiny random fp32 models from each type's own config class (paged_hf.model.support.build_tiny_model:
window or chunk 8, so 4-token blocks slide out after two). Every generation is teacher-forced
against the unpatched model (each token within 1e-3 of the reference's best logit, logprobs
within 1e-4), with 4-token blocks and a 16-token budget, prompts past the window, prefix hits
inside and beyond it, preemption by recompute and by swap, and n > 1; and equals the tokens of
the same engine keeping every block. After every step every request's tables hold exactly the
blocks its later queries read, the pool's refcounts are its holders, and nothing leaks.
"""

from __future__ import annotations

import pytest
from engine_state import check_tables, checked
from oracle import assert_logprobs_close, assert_teacher_forced
from tiny_models import tiny_prompts

import paged_hf
from paged_hf.model.support import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# type: the kinds of its groups (mistral slides on every layer: one group keeping every block,
# since the prefix index is keyed on a full group's blocks)
TYPES = {
    "gemma2": ["full", "sliding 8"],
    "gemma3_text": ["full", "sliding 8"],
    "gpt_oss": ["full", "sliding 8"],
    "cohere2": ["full"] + ["sliding 8"] * 3,
    "llama4_text": ["full"] + ["chunked 8"] * 3,
    "qwen2_moe": ["full"] * 3 + ["sliding 8"],
    "mistral": ["full"],
}
MAX_NEW = 10
SMALL = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8}
GREEDY = paged_hf.SamplingParams(max_new_tokens=MAX_NEW, logprobs=3, ignore_eos=True)


def _prompts(model, lengths, seed=1):
    return tiny_prompts(
        model.config.get_text_config().vocab_size,
        len(lengths),
        lengths,
        seed=seed,
        eos_token_id=None,
    )


def _check(reference, prompts, outs, what):
    for prompt, out in zip(prompts, outs):
        assert out.error is None and len(out.token_ids) == MAX_NEW, (what, out.error)
        assert_teacher_forced(
            reference, prompt, out.token_ids, what=f"{what}, prompt of {len(prompt)}"
        )
        assert_logprobs_close(
            reference,
            prompt,
            out.token_ids,
            out.completions[0].logprobs,
            what=f"{what}, prompt of {len(prompt)}",
        )


def assert_clean(engine: paged_hf.Engine) -> None:
    check_tables(engine)
    assert engine.kv_manager.pool.num_used == 0 and not engine.requests
    assert (
        engine.kv_manager.pool.num_free + engine.kv_manager.pool.num_cached
        == engine.kv_manager.num_blocks
    )


@pytest.mark.parametrize("model_type", list(TYPES))
def test_generations_match_transformers_and_keeping_every_block(model_type):
    reference, model = build_tiny_model(model_type), build_tiny_model(model_type)
    prompts = _prompts(model, [1, 6, 19, 33, 45])
    engine = checked(paged_hf.Engine(model, **SMALL))
    assert [g.kind for g in engine.groups] == TYPES[model_type]
    outs = engine.generate(prompts, GREEDY)
    _check(reference, prompts, outs, model_type)
    keep = paged_hf.Engine(model, **SMALL, keep_every_kv_block=True)
    assert len(keep.groups) == 1
    assert [o.token_ids for o in keep.generate(prompts, GREEDY)] == [o.token_ids for o in outs]
    stats, kept = engine.stats(), keep.stats()
    if len(engine.groups) > 1:  # freed blocks: fewer bytes held at the peak than keeping them all
        assert stats["kv_bytes_peak"] < kept["kv_bytes_peak"], (
            stats["kv_bytes_peak"],
            kept["kv_bytes_peak"],
        )
    assert stats["peak_running"] == kept["peak_running"] == 5
    assert_clean(engine)


@pytest.mark.parametrize("model_type", list(TYPES))
def test_prefix_hits_inside_and_beyond_the_window(model_type):
    """A shared 40-token prefix (five windows), a shared 6-token one (inside the first), then exact
    repeats: the hits need the sliding groups' blocks of the last window only."""
    reference, model = build_tiny_model(model_type), build_tiny_model(model_type)
    long_prefix, short_prefix = _prompts(model, [40, 6], seed=7)
    tails = _prompts(model, [3, 9, 14], seed=8)
    prompts = [long_prefix + t for t in tails] + [short_prefix + t for t in tails]
    engine = checked(paged_hf.Engine(model, **SMALL))
    first = engine.generate([prompts[0], prompts[3]], GREEDY)
    together = engine.generate(prompts, GREEDY)
    again = engine.generate(prompts, GREEDY)
    _check(
        reference,
        [prompts[0], prompts[3]] + prompts + prompts,
        first + together + again,
        f"{model_type}, hits",
    )
    assert all(o.num_cached_tokens >= 40 for o in together[:3]), [
        o.num_cached_tokens for o in together
    ]
    assert all(o.num_cached_tokens >= 4 for o in together[3:]), [
        o.num_cached_tokens for o in together
    ]
    assert all(o.num_cached_tokens >= len(p) - 4 for o, p in zip(again, prompts)), [
        o.num_cached_tokens for o in again
    ]
    assert_clean(engine)


def test_a_hit_needs_the_last_windows_blocks():
    """Once the sliding blocks before a cached point are evicted, no hit is served there (their KV
    would be missing), though the full group still holds the point's blocks."""
    model = build_tiny_model("gemma3_text")
    prompt = _prompts(model, [41], seed=5)[0]
    engine = paged_hf.Engine(model, **SMALL)
    engine.generate([prompt], GREEDY)
    index = engine.kv_manager.index
    assert index._loose, "the sliding blocks of the cached prompt are evictable by themselves"
    for page in list(index._loose):  # evict every sliding page, none of the full group's
        engine.kv_manager.pool._release(index._forget_loose(page))
    assert index.num_blocks == (41 + MAX_NEW - 1) // 4  # the full group's blocks only
    out = engine.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0
    assert_clean(engine)


# pages of 4 tokens (one group's layers each) too few for six sequences of up to 40 tokens at once
PREEMPTING_POOL = {
    "gemma2": 24,
    "gemma3_text": 24,
    "gpt_oss": 24,
    "cohere2": 32,
    "llama4_text": 40,
    "qwen2_moe": 40,
    "mistral": 14,
}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("model_type", list(TYPES))
def test_preemption_keeps_each_requests_tokens(model_type, mode):
    reference, model = build_tiny_model(model_type), build_tiny_model(model_type)
    prompts = _prompts(model, [7, 15, 22, 30, 11, 26], seed=2)
    engine = checked(
        paged_hf.Engine(
            model,
            block_size=4,
            num_blocks=PREEMPTING_POOL[model_type],
            max_num_batched_tokens=16,
            max_num_seqs=6,
            preemption_mode=mode,
        )
    )
    outs = engine.generate(prompts, GREEDY)
    assert engine.stats()["preemptions"] > 0, "the pool was meant to be too small"
    _check(reference, prompts, outs, f"{model_type}, preempted by {mode}")
    assert_clean(engine)


@pytest.mark.parametrize("model_type", list(TYPES))
def test_seeded_samples_equal_keeping_every_block(model_type):
    model = build_tiny_model(model_type)
    prompts = _prompts(model, [9, 21], seed=3)
    params = paged_hf.SamplingParams(
        max_new_tokens=12, temperature=1.0, seed=11, n=3, ignore_eos=True
    )
    engine = checked(paged_hf.Engine(model, **SMALL))
    together = engine.generate(prompts, params)
    keep = paged_hf.Engine(model, **SMALL, keep_every_kv_block=True)
    assert [[c.token_ids for c in o.completions] for o in together] == [
        [c.token_ids for c in o.completions] for o in keep.generate(prompts, params)
    ]
    assert all(len({tuple(c.token_ids) for c in o.completions}) > 1 for o in together)
    assert_clean(engine)


def test_a_long_sequence_holds_its_window_not_its_context():
    """At 400 tokens a sliding group holds a few blocks, the full group all 100, and admission
    counts what a request holds, not its length times the groups."""
    model = build_tiny_model("gemma3_text")
    prompt = _prompts(model, [380], seed=4)[0]
    params = paged_hf.SamplingParams(max_new_tokens=20, ignore_eos=True)
    engine = paged_hf.Engine(
        model, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    held = []
    step = engine.step

    def record():
        out = step()
        held.append([g["blocks_used"] for g in engine.group_stats()])
        return out

    engine.step = record
    engine.generate([prompt], params)
    full, sliding = zip(*held[:-1])
    assert max(full) == 100 and max(sliding) <= -(-(8 + 16) // 4) + 1, (max(full), max(sliding))
    assert engine.kv_manager.most_blocks(400) == 100 + 7
    keep = paged_hf.Engine(
        model,
        block_size=4,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        keep_every_kv_block=True,
    )
    assert (
        keep.generate([prompt], params)[0].token_ids
        == engine.generate([prompt], params)[0].token_ids
    )
    ratio = engine.stats()["kv_bytes_peak"] / keep.stats()["kv_bytes_peak"]
    assert ratio < 0.56, ratio  # half the layers slide: ~(100 + 7) / 200 of the bytes


def test_stats_report_groups_and_peaks():
    model = build_tiny_model("cohere2")
    engine = paged_hf.Engine(model, **SMALL)
    stats = engine.stats()
    assert [g["kind"] for g in stats["cache_groups"]] == TYPES["cohere2"]
    # one layer of four per page
    assert stats["page_bytes"] * 4 == engine.layout.bytes_per_block(4, 4)
    engine.generate(_prompts(model, [20, 30]), GREEDY)
    stats = engine.stats()
    assert (
        stats["peak_running"] == 2
        and stats["kv_bytes_peak"] == stats["peak_blocks_used"] * stats["page_bytes"]
    )
    assert 0 <= stats["kv_waste"] < 1


def test_flashinfer_and_accelerated_decode_keep_every_block(monkeypatch):
    """Where a backend reads group 0's tables only, every block is kept, as before."""
    from paged_hf.execution import runner
    from paged_hf.execution.backends.torch_backend import TorchBackend

    class GroupBlind(TorchBackend):
        serves_cache_groups = False

    monkeypatch.setattr(runner, "select_backend", lambda *a, **k: GroupBlind)
    model = build_tiny_model("gemma2")
    assert len(paged_hf.Engine(model, **SMALL).groups) == 1
    monkeypatch.undo()
    assert len(paged_hf.Engine(model, **SMALL, compile_decode="aot_eager").groups) == 1
    assert len(paged_hf.Engine(model, **SMALL).groups) == 2


def test_keep_every_kv_block_must_be_a_bool():
    with pytest.raises(ValueError, match="keep_every_kv_block"):
        paged_hf.Engine(build_tiny_model("gemma2"), keep_every_kv_block="yes")
