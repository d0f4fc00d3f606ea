"""Generating inside training loops: no weight update and no adapter switch may leave the engine
serving what other weights computed (prefix cache, packed CPU weights, CUDA graphs).

transformers is the oracle: after each update the engine's tokens are teacher-forced against the
updated model itself (fp32), or equal a fresh engine's on the updated weights bit for bit (bf16,
where rounding follows the batch shape, so only the same kernel on the same shapes is exact).
"""

from __future__ import annotations

import pytest
import torch
from oracle import assert_logprobs_close, assert_teacher_forced
from tiny_models import make_tiny_model, tiny_prompts

import paged_hf
from paged_hf.cache.coherence import WeightsWatch

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = paged_hf.SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2)
SMALL = dict(block_size=4, num_blocks=96)


def _train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: list[list[int]]
) -> None:
    batch = torch.tensor(ids)
    # plain forward of a patched model trains as before
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adamw_between_generates_is_seen(dtype):
    """torch's fused AdamW (the Trainer's and TRL's default optimizer) moves no version counter."""
    model = make_tiny_model("llama", dtype=dtype)
    prompts = tiny_prompts(model.config.vocab_size, 3, [12, 12, 12], seed=7)
    engine = paged_hf.Engine(model, **SMALL)
    if dtype == torch.bfloat16:
        assert engine.runner.packed is not None, (
            "bf16 on a CPU runs on packed weights: they must be packed again"
        )
    engine.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens > 0 for o in engine.generate(prompts, GREEDY)), (
        "unchanged weights: hits"
    )
    before = [o.token_ids for o in engine.generate(prompts, GREEDY)]

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    versions = [p._version for p in model.parameters()]
    _train_step(model, optimizer, prompts)
    assert [p._version for p in model.parameters()] == versions, (
        "fused AdamW moves no counter (else this test is moot)"
    )

    after = engine.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens == 0 for o in after), (
        "no block computed by the old weights may be served"
    )
    assert [o.token_ids for o in after] != before, (
        "the update must change the tokens for this test to mean anything"
    )
    if dtype == torch.float32:
        for prompt, out in zip(prompts, after):
            assert_teacher_forced(model, prompt, out.token_ids, what="after a fused AdamW step")
            assert_logprobs_close(model, prompt, out.token_ids, out.completions[0].logprobs)
    else:
        fresh = paged_hf.Engine(model, **SMALL).generate(prompts, GREEDY)
        assert [o.completions[0].logprobs for o in after] == [
            o.completions[0].logprobs for o in fresh
        ]


def test_an_optimizer_over_another_model_leaves_the_cache_alone():
    model, other = make_tiny_model("llama"), make_tiny_model("llama", seed=1)
    prompts = tiny_prompts(model.config.vocab_size, 2, [12, 12], seed=8)
    engine = paged_hf.Engine(model, **SMALL)
    engine.generate(prompts, GREEDY)
    _train_step(other, torch.optim.AdamW(other.parameters(), lr=0.05, fused=True), prompts)
    assert all(o.num_cached_tokens > 0 for o in engine.generate(prompts, GREEDY))


def test_a_write_through_data_is_seen_by_the_content_sample():
    """``p.data.mul_`` leaves the version counter alone; the sampled values move."""
    model = make_tiny_model("llama")
    prompts = tiny_prompts(model.config.vocab_size, 3, [12, 12, 12], seed=9)
    engine = paged_hf.Engine(model, **SMALL)
    engine.generate(prompts, GREEDY)
    versions = [p._version for p in model.parameters()]
    for name, p in model.named_parameters():
        if "layers.0." in name and name.endswith("proj.weight"):
            p.data.mul_(-2.0)
    assert [p._version for p in model.parameters()] == versions
    after = engine.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens == 0 for o in after)
    for prompt, out in zip(prompts, after):
        assert_teacher_forced(model, prompt, out.token_ids, what="after a write through .data")


def test_the_watch_names_what_changed():
    model = make_tiny_model("llama")
    watch = WeightsWatch(model)
    assert watch.changed(rescan=True) is None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    ids = tiny_prompts(model.config.vocab_size, 1, [8], seed=1)
    _train_step(model, optimizer, ids)
    change = watch.changed()
    assert change is not None and change.why == "an optimizer step" and not change.moved
    assert watch.changed() is None
    with torch.no_grad():
        model.lm_head.weight.data = model.lm_head.weight.data.clone()
    change = watch.changed()
    assert change is not None and change.moved
    model.model.norm.weight.data.add_(1.0)
    assert watch.changed() is None, "between rescans a write through .data is not looked for"
    change = watch.changed(rescan=True)
    assert change is not None and "no version counter" in change.why


# ---- PEFT adapters: part of the cache key -----------------------------------------------------------


def _lora_model():
    peft = pytest.importorskip("peft", reason="peft is in the test extra (make install)")
    base = make_tiny_model("llama")
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False
        ),
        adapter_name="first",
    )
    model.add_adapter(
        "second", peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    return model.eval()


def test_adapter_switches_merges_and_disabling_give_transformers_results():
    model = _lora_model()
    prompts = tiny_prompts(model.config.vocab_size, 3, [12, 12, 12], seed=10)
    engine = paged_hf.Engine(model, **SMALL)  # prefix caching on

    def check(what: str) -> list:
        outs = engine.generate(prompts, GREEDY)
        for prompt, out in zip(prompts, outs):
            assert_teacher_forced(model, prompt, out.token_ids, what=what)
            assert_logprobs_close(
                model, prompt, out.token_ids, out.completions[0].logprobs, what=what
            )
        return outs

    check("adapter a")
    assert all(o.num_cached_tokens > 0 for o in check("adapter a again"))
    with model.disable_adapter():
        assert all(o.num_cached_tokens == 0 for o in check("adapters disabled"))
    model.set_adapter("second")
    assert all(o.num_cached_tokens == 0 for o in check("adapter b"))
    model.set_adapter("first")
    assert all(o.num_cached_tokens > 0 for o in check("back to adapter a")), (
        "a's blocks stay cached under its key"
    )
    model.merge_adapter()
    assert all(o.num_cached_tokens == 0 for o in check("adapter a merged")), (
        "merging writes the base weights"
    )
    model.unmerge_adapter()
    check("adapter a unmerged")
