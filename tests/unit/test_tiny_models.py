"""The tiny-model factory builds every family with the attention features it claims."""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    FAMILIES,
    N_SPECIAL,
    SLIDING_FAMILIES,
    SLIDING_WINDOW,
    SOFTCAP_FAMILIES,
    make_tiny_model,
    probe_attention,
    tiny_prompts,
)

# What each family's attention layers must receive, per layer (written out by hand, so
# a transformers upgrade that changes it fails here rather than silently in other tests).
W = SLIDING_WINDOW
EXPECTED_SLIDING = {
    "llama": [None, None],
    "llama_mqa": [None, None],
    "mistral": [W, W],
    "qwen2": [None, None, W, W],
    "qwen3": [None, None],
    "gemma2": [W, None, W, None],
    "gemma3_text": [W, W, None, W],
    "phi3": [None, None],
    "gpt2": [None, None],
}
EXPECTED_SCALING = {
    "gemma2": [32**-0.5] * 4,  # query_pre_attn_scalar=32, not head_dim=16
    "gemma3_text": [32**-0.5] * 4,
    "gpt2": [16**-0.5, 16**-0.5 / 2],  # scale_attn_by_inverse_layer_idx
}
PROMPT_LEN = 30  # longer than the sliding window


def _probe_forward(model, input_ids):
    with probe_attention(model) as records, torch.no_grad():
        logits = model(input_ids).logits
    by_layer = {}
    for record in records:
        by_layer.setdefault(record["layer_idx"], record)
    return logits, [by_layer[i] for i in sorted(by_layer)]


@pytest.mark.parametrize("family", FAMILIES)
def test_builds_forwards_and_generates(family):
    model = make_tiny_model(family)
    assert not model.training
    assert model.dtype == torch.float32
    assert model.config.num_attention_heads == 4
    prompts = tiny_prompts(model.config.vocab_size, 3, PROMPT_LEN, seed=1)
    x = torch.tensor(prompts[:1])
    with torch.no_grad():
        plain = model(x).logits
        with_positions = model(x, position_ids=torch.arange(PROMPT_LEN)[None]).logits
    assert plain.shape == (1, PROMPT_LEN, model.config.vocab_size)
    torch.testing.assert_close(with_positions, plain)

    repeats = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
        new = out[0, PROMPT_LEN:].tolist()
        assert out[0, :PROMPT_LEN].tolist() == prompt
        assert 1 <= len(new) <= 16
        repeats += [a == b for a, b in zip(new, new[1:])]
    # A degenerate init repeats one token nearly every step.
    assert sum(repeats) / len(repeats) < 0.3, f"{family}: greedy output is degenerate"


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_kwargs(family):
    model = make_tiny_model(family)
    x = torch.tensor(tiny_prompts(model.config.vocab_size, 1, PROMPT_LEN, seed=2))
    with torch.no_grad():
        reference = model(x).logits
    logits, layers = _probe_forward(model, x)
    assert torch.equal(logits, reference), "the probe must not change outputs"
    assert model.config._attn_implementation in ("sdpa", "eager"), (
        "probe did not restore the implementation"
    )

    assert [r["sliding_window"] for r in layers] == EXPECTED_SLIDING[family]
    assert (family in SLIDING_FAMILIES) == any(r["sliding_window"] for r in layers)
    softcaps = {r["softcap"] for r in layers}
    assert softcaps == ({50.0} if family in SOFTCAP_FAMILIES else {None})
    expected_scaling = EXPECTED_SCALING.get(family, [16**-0.5] * len(layers))
    assert [r["scaling"] for r in layers] == pytest.approx(expected_scaling)
    n_kv = 1 if family == "llama_mqa" else 4 if family == "gpt2" else 2
    assert layers[0]["query_shape"] == (1, 4, PROMPT_LEN, 16)
    assert layers[0]["key_shape"] == (1, n_kv, PROMPT_LEN, 16)


def test_sliding_window_changes_outputs():
    """The window is enforced (here through the mask): past it, outputs differ from full attention."""
    model = make_tiny_model("mistral")
    x = torch.tensor(tiny_prompts(model.config.vocab_size, 1, PROMPT_LEN, seed=3))
    with torch.no_grad():
        windowed = model(x).logits
        model.config.sliding_window = None
        full = model(x).logits
    differs = (windowed - full).abs().amax(-1)[0] > 1e-5
    assert not differs[:SLIDING_WINDOW].any()
    assert differs[SLIDING_WINDOW:].all()


def test_gemma2_final_softcap():
    model = make_tiny_model("gemma2")
    x = torch.tensor(tiny_prompts(model.config.vocab_size, 1, PROMPT_LEN, seed=4))
    with torch.no_grad():
        logits = model(x).logits
    assert logits.abs().max() < model.config.final_logit_softcapping == 30.0


def test_seeding_and_dtype():
    state = torch.random.get_rng_state()
    a = make_tiny_model("llama", seed=0)
    assert torch.equal(torch.random.get_rng_state(), state), "factory must not touch the global RNG"
    b = make_tiny_model("llama", seed=0)
    c = make_tiny_model("llama", seed=1)
    for name, p in a.state_dict().items():
        assert torch.equal(p, b.state_dict()[name])
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)

    half = make_tiny_model("llama", seed=0, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and not half.training
    for name, p in a.state_dict().items():
        assert torch.equal(p.to(torch.bfloat16), half.state_dict()[name]), name
    # as with from_pretrained(dtype=bf16): rotary frequencies stay float32
    assert half.model.rotary_emb.inv_freq.dtype == torch.float32


def test_attn_implementation_override():
    model = make_tiny_model("llama", attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert make_tiny_model("gemma2").config._attn_implementation == "eager"


def test_tiny_prompts():
    prompts = tiny_prompts(512, 3, [5, 30, 1], seed=7)
    assert [len(p) for p in prompts] == [5, 30, 1]
    assert prompts == tiny_prompts(512, 3, [5, 30, 1], seed=7)
    assert prompts != tiny_prompts(512, 3, [5, 30, 1], seed=8)
    many = sum(tiny_prompts(512, 50, 40, seed=0, eos_token_id=100), [])
    assert min(many) >= N_SPECIAL and max(many) < 512 and 100 not in many
    with pytest.raises(ValueError):
        tiny_prompts(512, 2, [3], seed=0)
