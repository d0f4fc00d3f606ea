"""Issue 13: the architectures people run, each against transformers itself.

For the nine original families and the thirteen of issue 13 (tests/tiny_models.py says what each
one brings): patch finds the model's real features (windows on the right layers, chunks, sinks,
MLA widths, per-layer head widths), then the engine's generations are teacher-forced against the
unpatched model (every token within 1e-3 of the reference's best logit) and its logprobs (chosen
and top 5) must equal the reference's log-softmax within 1e-4 (fp32), with default settings and
with 4-token blocks and a 16-token budget; after unpatch the model is bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from oracle import assert_logprobs_close, assert_teacher_forced
from tiny_models import (
    ARCHITECTURES,
    FAMILIES,
    PAD_ID,
    SLIDING_WINDOW,
    make_arch_model,
    make_tiny_model,
    tiny_prompts,
)

import paged_hf
from paged_hf.engine.binding import patch_state

W = SLIDING_WINDOW
PROMPT_LENGTHS = [1, 5, 19, 37]  # past the window / chunk of 8 and several 4-token blocks
MAX_NEW = 12
SETTINGS = {
    "defaults": {},
    "small": {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8},
}


def build(name: str) -> torch.nn.Module:
    return make_arch_model(name) if name in ARCHITECTURES else make_tiny_model(name)


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    yield


@pytest.mark.parametrize("settings", list(SETTINGS))
@pytest.mark.parametrize("name", list(FAMILIES) + list(ARCHITECTURES))
def test_tokens_and_logprobs_match_transformers(name, settings):
    reference, model = build(name), build(name)
    paged_hf.patch(model)
    vocab = model.config.get_text_config().vocab_size
    prompts = tiny_prompts(vocab, len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=1)
    engine = paged_hf.Engine(model, **SETTINGS[settings])
    outs = engine.generate(
        prompts, paged_hf.SamplingParams(max_new_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
    )
    for prompt, out in zip(prompts, outs):
        assert out.error is None and len(out.token_ids) == MAX_NEW
        what = f"{name}/{settings}, prompt of {len(prompt)}"
        assert_teacher_forced(reference, prompt, out.token_ids, what=what)
        assert_logprobs_close(
            reference, prompt, out.token_ids, out.completions[0].logprobs, what=what
        )
    assert engine.kv_manager.pool.num_used == 0
    if settings == "small":
        assert engine.stats()["steps"] > MAX_NEW + 2, (
            "the 37-token prompt was prefilled in 16-token chunks"
        )
    assert len({t for o in outs for t in o.token_ids}) > MAX_NEW, (
        f"{name}: degenerate generations test little"
    )

    paged_hf.unpatch(model)
    assert "generate" not in model.__dict__ and not paged_hf.is_patched(model)
    x = torch.tensor([prompts[3]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, reference(input_ids=x).logits), (
            f"{name}: unpatch is not exact"
        )


def _layout(name: str, **config_changes) -> list:
    model = build(name)
    for key, value in config_changes.items():
        setattr(model.config.get_text_config(), key, value)
    paged_hf.patch(model)
    return list(patch_state(model).layout.layers)


def test_patch_reads_each_layers_window_chunk_sinks_and_widths():
    assert [s.window for s in _layout("cohere2")] == [W, W, W, None]
    assert [s.window for s in _layout("starcoder2")] == [W, W]
    assert [s.window for s in _layout("mixtral")] == [W, W]
    # Qwen2-MoE passes no sliding_window keyword: the window lives in the mask of the sliding layers
    assert [s.window for s in _layout("qwen2_moe")] == [W, None, W, None]
    llama4 = _layout("llama4_text")
    assert [s.chunk for s in llama4] == [W, W, W, None] and not any(s.window for s in llama4)
    gpt_oss = _layout("gpt_oss")
    assert all(s.sinks for s in gpt_oss) and [s.window for s in gpt_oss] == [W, None, W, None]
    assert {(s.k_dim, s.v_dim) for s in _layout("deepseek_v3")} == {
        (16, 12)
    }  # MLA, stored at its own widths
    assert [(s.kv_heads, s.k_dim) for s in _layout("gemma4_text")] == [(2, 16)] * 3 + [(2, 32)]
    assert [s.window for s in _layout("gemma4_text")] == [W, W, W, None]
    plain = _layout("olmo2")
    assert all(
        s.window is None and s.chunk is None and not s.sinks and s.k_dim == s.v_dim == 16
        for s in plain
    )


def test_the_verdict_follows_config_values():
    """Qwen2-MoE with use_sliding_window off has no window anywhere, on the same weights."""
    model = make_arch_model("qwen2_moe")
    config = model.config
    config.layer_types = [
        "full_attention"
    ] * config.num_hidden_layers  # what use_sliding_window=False derives
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    paged_hf.patch(model)
    assert [s.window for s in patch_state(model).layout.layers] == [None] * 4


def test_kv_cache_is_sized_from_each_layers_geometry():
    model = paged_hf.patch(make_arch_model("deepseek_v3"))
    engine = paged_hf.Engine(model, num_blocks=8, block_size=4)
    k, v = engine.runner.backend.kv[0], engine.runner.backend.kv[1]
    assert k.shape == (8, 4, 4, 16) and v.shape == (8, 4, 4, 12), (
        "MLA: K and V at their own widths, not padded"
    )
    gemma4 = paged_hf.Engine(
        paged_hf.patch(make_arch_model("gemma4_text")), num_blocks=8, block_size=4
    )
    widths = [t.shape[-1] for t in gemma4.runner.backend.kv]
    assert widths == [16, 16, 16, 16, 16, 16, 32, 32]
    per_block = sum(t[0].numel() for t in gemma4.runner.backend.kv) * 4
    assert gemma4.layout.bytes_per_block(4, 4) == per_block
    sized = paged_hf.Engine(
        paged_hf.patch(make_arch_model("gemma4_text")), block_size=4, kv_cache_memory=10 * per_block
    )
    assert sized.kv_manager.pool.num_blocks == 10


def test_multimodal_text_path_generate_and_media_refused():
    """qwen2_vl's text path through the patched generate (left-padded batch); media inputs are refused."""
    reference, model = make_arch_model("qwen2_vl"), make_arch_model("qwen2_vl")
    paged_hf.patch(model)
    prompts = tiny_prompts(500, 3, [4, 11, 23], seed=2)  # below the image / video placeholder ids
    width = max(map(len, prompts))
    ids = torch.full((3, width), PAD_ID)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for i, p in enumerate(prompts):
        assert_teacher_forced(reference, p, out[i, width:].tolist(), what=f"qwen2_vl row {i}")
    with pytest.raises(
        NotImplementedError, match=r"image / video / audio inputs \(pixel_values.*text path"
    ):
        model.generate(
            ids, attention_mask=mask, pixel_values=torch.zeros(4, 1176), max_new_tokens=2
        )
    image_token = model.config.image_token_id
    outs = paged_hf.engine_for(model).generate(
        [[5, image_token, 7]], paged_hf.SamplingParams(max_new_tokens=2)
    )
    assert (
        outs[0].finish_reason == "error"
        and f"token id {image_token} is this model's image/video/audio placeholder" in outs[0].error
    )
