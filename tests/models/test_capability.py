"""The capability check (issue 13): what paged_hf cannot run is refused at patch, naming the module
and the reason, one case per category of the issue's table; a refused model is left as it was;
the dependency between the model side and the engine runs one way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

import paged_hf
from paged_hf.execution import attention
from paged_hf.model import layer_geometry
from paged_hf.model.support import build_tiny_model

REPO = Path(__file__).resolve().parents[2]


def refusal(model: torch.nn.Module) -> str:
    with pytest.raises(paged_hf.UnsupportedModelError) as info:
        paged_hf.patch(model)
    return str(info.value)


@pytest.mark.parametrize(
    "model_type, where, why",
    [
        # attention never reaches the registered function
        (
            "bloom",
            r"transformer\.h\.0\.self_attention \(BloomAttention\)",
            "never calls transformers' AttentionInterface",
        ),
        # recurrent / SSM / convolution state kept outside transformers' cache API, from the config's layer
        # types or from the modules that ran (hybrids that keep it through the API run: test_hybrid_models.py)
        (
            "recurrent_gemma",
            r"config\.layer_types \(3 'linear_attention' layer\(s\)",
            "found no mixer for",
        ),
        (
            "rwkv",
            r"rwkv\.blocks\.0\.attention \(RwkvSelfAttention\)",
            "outside transformers' cache API",
        ),
        # a layer that attends more than once per forward, or layers sharing KV slots
        (
            "diffllama",
            r"model\.layers\.0\.self_attn \(DiffLlamaAttention\)",
            "attends more than once per forward",
        ),
        ("hrm_text", r"\(HrmTextAttention\)", "attends more than once per forward"),
        ("blt", r"\(BltSelfAttention\)", r"has the layer_idx \(0\) of another attention module"),
        # sparse-attention indexers
        ("deepseek_v32", r"'indexed_attention'", "sparse attention: an indexer chooses the keys"),
        # positions not from position_ids
        ("bart", "its positions", "computes positions itself"),
        ("roberta", "its positions", "RoBERTa's start after the padding index"),
        # bidirectional attention, and masks a module builds itself
        (
            "bigbird_pegasus",
            r"\(BigBirdPegasusDecoderAttention\)",
            r"is not causal \(is_causal=False\)",
        ),
        (
            "doge",
            r"model\.layers\.0\.self_attn \(DogeAttention\)",
            "attention mask or bias it builds itself",
        ),
    ],
)
def test_refused_at_patch_naming_module_and_reason(model_type, where, why):
    model = build_tiny_model(model_type)
    message = refusal(model)
    assert f"paged_hf cannot run {model.config.model_type}" in message
    assert re.search(where, message), message
    assert re.search(why, message), message


def test_bidirectional_models_are_refused():
    # an encoder, not a decoder
    assert "is_causal=False" in refusal(build_tiny_model("bert", is_decoder=False))
    assert "config.is_causal=False" in refusal(build_tiny_model("llama", is_causal=False))
    # PaliGemma's prefix attends both ways; its text path must not pass by luck
    assert "is_causal=False" in refusal(build_tiny_model("paligemma", multimodal=True))


def test_a_token_mixing_module_is_found_even_when_the_config_says_attention_only():
    model = make_tiny_model("llama")

    # a causal depthwise convolution over the sequence, as LFM2 / Mamba have
    class ConvMixer(torch.nn.Module):
        def __init__(self, mlp: torch.nn.Module) -> None:
            super().__init__()
            self.mlp, self.conv = mlp, torch.nn.Conv1d(64, 64, 3, padding=2, groups=64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(x) + self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)

    model.model.layers[1].mlp = ConvMixer(model.model.layers[1].mlp)
    assert r"model.layers.1.mlp.conv (Conv1d): keeps recurrent / convolution state" in refusal(
        model
    )


def test_an_attention_keyword_paged_attention_would_drop_is_refused():
    from transformers.models.llama.modeling_llama import LlamaAttention

    class BiasedAttention(LlamaAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, position_bias=torch.zeros(1), **kwargs)

    model = make_tiny_model("llama")
    model.model.layers[0].self_attn.__class__ = BiasedAttention
    assert "model.layers.0.self_attn (BiasedAttention): passes ['position_bias']" in refusal(model)


def test_a_family_quirk_from_patches_is_refused_naming_its_file():
    model = make_tiny_model("gpt2")
    model.config.reorder_and_upcast_attn = True  # honoured only by GPT-2's own eager attention
    assert "patches/gpt2.py: config.reorder_and_upcast_attn=True" in refusal(model)


def test_llama4_temperature_tuning_limits_positions_and_budget():
    """Llama 4's NoPE layers scale queries by a factor of each token's row in the step: exact only
    while rows and positions stay below floor_scale - 1, so engines are held there, saying why."""
    import copy

    from oracle import assert_logprobs_close, assert_teacher_forced
    from tiny_models import make_arch_config, tiny_prompts
    from transformers import AutoModelForCausalLM

    config = make_arch_config("llama4_text")
    config.floor_scale = 12
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        reference = AutoModelForCausalLM.from_config(config).eval()
    model = paged_hf.patch(copy.deepcopy(reference))
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens=16 exceeds 11.*NoPE layers \(e\.g\. layer 3\)"
    ):
        paged_hf.Engine(model, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="max_model_len=64 exceeds 11"):
        paged_hf.Engine(model, max_model_len=64, max_num_batched_tokens=8, max_num_seqs=4)
    engine = paged_hf.Engine(model, max_num_batched_tokens=8, max_num_seqs=4, block_size=4)
    assert engine.max_model_len == 11  # the default (max_position_embeddings) lowered to the limit
    prompts = tiny_prompts(config.vocab_size, 3, [3, 5, 7], seed=1)
    for p, out in zip(
        prompts,
        engine.generate(
            prompts, paged_hf.SamplingParams(max_new_tokens=3, logprobs=3, ignore_eos=True)
        ),
    ):
        assert_teacher_forced(reference, p, out.token_ids)
        assert_logprobs_close(reference, p, out.token_ids, out.completions[0].logprobs)


def test_rope_scalings_that_follow_the_longest_sequence_limit_max_model_len():
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "factor": 4.0,
        },
    )
    model = paged_hf.patch(Phi3ForCausalLM(config).eval())
    assert paged_hf.Engine(model).max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len=128 exceeds 64.*'longrope' RoPE scaling"):
        paged_hf.Engine(model, max_model_len=128)


def test_attention_modules_that_transformers_cache_does_not_tell_apart_are_refused():
    """Two modules with one layer_idx are told apart only by the layer transformers' own cache keeps
    each one's KV under (Zamba2's shared block: test_hybrid_models.py); here the cache mixes them too."""
    model = make_tiny_model("llama")
    model.model.layers[1].self_attn.layer_idx = 0  # its KV goes to cache layer 0, as layer 0's does
    message = refusal(model)
    assert re.search(
        r"model\.layers\.1\.self_attn \(LlamaAttention\): its KV would be kept as layer 0's, as "
        r"model\.layers\.0\.self_attn's is",
        message,
    ), message
    assert not paged_hf.is_patched(model)


def test_a_refused_model_is_left_as_it_was():
    model = build_tiny_model("diffllama")
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = model(x).logits
    impl = model.config._attn_implementation
    refusal(model)
    assert model.config._attn_implementation == impl and not paged_hf.is_patched(model)
    assert "generate" not in model.__dict__
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)
    assert id(model.config) not in attention._fallback_impl


def test_forced_eos_in_the_generation_config_is_honoured():
    """BART-family generation configs force EOS at max_length: transformers' own processor runs it on
    the call's rows (it was refused; never ignored)."""
    reference = make_tiny_model("llama")
    model = paged_hf.patch(make_tiny_model("llama"))
    for m in (reference, model):
        m.generation_config.forced_eos_token_id = 2
    ids = torch.tensor([[5, 6, 7]])
    out = model.generate(ids, max_new_tokens=3)
    assert out[0, -1] == 2 and torch.equal(out, reference.generate(ids, max_new_tokens=3))


def test_a_mask_the_module_built_itself_fails_the_step_instead_of_being_dropped():
    """The runtime guard behind the patch-time check: in a step, paged_mask returns None, so any
    mask reaching paged attention was built by the module, and dropping it would change results."""
    model = make_tiny_model("llama")
    paged_hf.patch(model)
    backend = object()
    with (
        attention.active_backend(backend),
        pytest.raises(RuntimeError, match="passed an attention mask"),
    ):
        attention.paged_attention_forward(
            model.model.layers[0].self_attn,
            torch.zeros(1, 4, 2, 16),
            torch.zeros(1, 2, 2, 16),
            torch.zeros(1, 2, 2, 16),
            torch.ones(1, 1, 2, 2, dtype=torch.bool),
        )


def test_mask_patterns_are_read_past_the_probe():
    from transformers.masking_utils import (
        causal_mask_function,
        chunked_causal_mask_function,
        sliding_window_causal_mask_function,
    )

    zeros = torch.zeros(1, dtype=torch.long)
    assert layer_geometry._classify(causal_mask_function, False, 4096, "m", "l") == (None, None)
    assert layer_geometry._classify(
        sliding_window_causal_mask_function(1000), False, 4096, "m", "l"
    ) == (1000, None)
    assert layer_geometry._classify(
        chunked_causal_mask_function(300, zeros), False, 4096, "m", "l"
    ) == (None, 300)
    assert layer_geometry._classify(
        sliding_window_causal_mask_function(5000), False, 4096, "m", "l"
    ) == (None, None)
    with pytest.raises(paged_hf.UnsupportedModelError, match="see later keys"):
        layer_geometry._classify(lambda b, h, q, kv: q >= 0, False, 64, "m", "l")


def test_layers_spread_over_devices_or_offloaded_are_refused_by_name(tmp_path):
    """accelerate's big-model loading: one layer offloaded to disk (its weights meta between
    forwards). patch refuses naming the devices and pointing at tensor parallelism; the same
    checkpoint on one device runs."""
    from transformers import AutoModelForCausalLM

    make_tiny_model("llama").save_pretrained(tmp_path / "llama")
    where = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"}
    where |= {"model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    spread = AutoModelForCausalLM.from_pretrained(
        tmp_path / "llama", device_map=where, offload_folder=tmp_path / "offload"
    )
    with pytest.raises(paged_hf.UnsupportedModelError, match="device_map.*cpu, disk.*tp_plan"):
        paged_hf.patch(spread)
    assert not paged_hf.is_patched(spread)
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", device_map="cpu")
    paged_hf.patch(whole)
    ids = torch.tensor([[3, 5, 7, 9]])
    expected = make_tiny_model("llama").generate(ids, max_new_tokens=4, do_sample=False)
    assert whole.generate(ids, max_new_tokens=4, do_sample=False).tolist() == expected.tolist()
