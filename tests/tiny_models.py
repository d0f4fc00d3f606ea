"""Tiny random causal LMs built from real transformers config classes.

This is the usual transformers testing pattern: the real modeling code of each
family, with dimensions small enough that a forward pass takes milliseconds. Each
family keeps the attention features a paged-KV patch has to honour (GQA / MQA,
sliding windows on all or some layers, logit softcapping, non-default and per-layer
attention scaling, q/k norms, fused projections, partial rotary).

``probe_attention(model)`` records what the model passes to its attention function,
so tests can check those features are really exercised.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from paged_hf.model.tiny_configs import build_model

FAMILIES = (
    "llama",
    "llama_mqa",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt2",
)
# Families with a sliding window on at least one layer, and those whose attention is softcapped.
SLIDING_FAMILIES = ("mistral", "qwen2", "gemma2", "gemma3_text")
SOFTCAP_FAMILIES = ("gemma2",)

VOCAB_SIZE = 512
SLIDING_WINDOW = 8
# Ids 0..3 are kept for special tokens in every family; prompts avoid them.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
N_SPECIAL = 4

# Random init with the usual initializer_range=0.02 makes a tiny model's logits almost
# flat, so greedy decoding repeats one token forever and hides cache bugs. 0.15 gives
# peaked but varied next-token distributions (checked: 16 greedy tokens on 30-token
# prompts are mostly distinct for every family).
INITIALIZER_RANGE = 0.15
# In a tied-embedding model whose input embedding dominates the residual stream, the
# last token's own embedding wins the lm_head dot product and greedy decoding repeats
# it (Gemma multiplies embeddings by sqrt(hidden_size) = 8; GPT2's are large next to its
# layers' outputs). Shrinking the shared matrix by 1/16 fixes that, and raising the final
# norm's gain by 16 keeps the logits as spread out as in the other families (std ~1.2),
# so greedy steps are not near-ties. Measured over 18 prompts x 16 greedy tokens: distinct
# tokens per generation went from ~1.5 to ~10 for the gemmas, ~7 to ~13 for gpt2.
_EMBEDDING_SCALE = {"gemma2": 1 / 16, "gemma3_text": 1 / 16, "gpt2": 1 / 16}

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    initializer_range=INITIALIZER_RANGE,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)


def make_config(family: str) -> PreTrainedConfig:
    """The tiny config of ``family`` (see the module docstring for what each one exercises)."""
    if family == "llama":
        # Tied embeddings, like SmolLM2 (the project's default model).
        return LlamaConfig(**_COMMON, num_hidden_layers=2, tie_word_embeddings=True)
    if family == "llama_mqa":
        return LlamaConfig(**{**_COMMON, "num_key_value_heads": 1}, num_hidden_layers=2)
    if family == "mistral":
        # Every layer slides (the model reads config.sliding_window, not a per-layer value).
        return MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=SLIDING_WINDOW)
    if family == "qwen2":
        # Qwen2 slides on layers i >= max_window_layers (and only if use_sliding_window):
        # layers 0-1 full, 2-3 sliding. No head_dim field: it is hidden_size // heads = 16.
        common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
        return Qwen2Config(
            **common,
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=SLIDING_WINDOW,
            max_window_layers=2,
        )
    if family == "qwen3":
        # Full attention everywhere (as released); the feature here is q_norm/k_norm.
        return Qwen3Config(**_COMMON, num_hidden_layers=2)
    if family == "gemma2":
        # Sliding on even layers, full on odd ones (Gemma2's own default pattern); attention
        # logits softcapped, final logits softcapped, and scaling = query_pre_attn_scalar**-0.5
        # = 1/sqrt(32), deliberately not head_dim**-0.5.
        return Gemma2Config(
            **_COMMON,
            num_hidden_layers=4,
            sliding_window=SLIDING_WINDOW,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=32,
        )
    if family == "gemma3_text":
        # Gemma3's 5-sliding-1-full pattern shrunk to sliding, sliding, full, sliding; the two
        # layer types also get different rope bases (10k local, 1M global). No softcapping in Gemma3.
        return Gemma3TextConfig(
            **_COMMON,
            num_hidden_layers=4,
            sliding_window=SLIDING_WINDOW,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            query_pre_attn_scalar=32,
        )
    if family == "phi3":
        # Phi3Config has no sliding window by default and none is set here (mistral and
        # the hybrids cover sliding). Its features are the fused qkv_proj / gate_up_proj
        # and partial rotary (only half of each head is rotated).
        common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
        return Phi3Config(
            **common,
            num_hidden_layers=2,
            sliding_window=None,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        )
    if family == "gpt2":
        # Learned absolute positions, no rotary; scaling = head_dim**-0.5 / (layer_idx + 1).
        return GPT2Config(
            vocab_size=VOCAB_SIZE,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=1024,
            initializer_range=INITIALIZER_RANGE,
            scale_attn_by_inverse_layer_idx=True,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )
    raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


def default_attn_implementation(family: str) -> str:
    # sdpa rejects softcap, and Gemma2 declares no sdpa support, so it runs eager.
    return "eager" if family == "gemma2" else "sdpa"


@torch.no_grad()
def _shrink_tied_embeddings(model: PreTrainedModel, scale: float) -> None:
    model.get_input_embeddings().weight.mul_(scale)  # the lm_head shares it
    if model.config.model_type == "gpt2":
        model.transformer.ln_f.weight.mul_(1 / scale)
        model.transformer.ln_f.bias.mul_(1 / scale)
    else:  # Gemma's RMSNorm multiplies by (1 + weight)
        norm = model.model.norm
        norm.weight.add_(1).mul_(1 / scale).sub_(1)


def make_tiny_model(
    family: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """A tiny randomly initialised causal LM of ``family``, in eval mode.

    The weights depend only on ``family`` and ``seed`` (drawn in float32, then rounded to
    ``dtype``: see ``paged_hf.model.tiny_configs.build_model``).
    """
    scale = _EMBEDDING_SCALE.get(family)
    model = build_model(
        make_config(family),
        AutoModelForCausalLM,
        seed=seed,
        dtype=dtype,
        attn_implementation=attn_implementation or default_attn_implementation(family),
        adjust=None if scale is None else lambda m: _shrink_tied_embeddings(m, scale),
    )
    model.generation_config.pad_token_id = PAD_ID
    return model


def tiny_prompts(
    vocab_size: int,
    n: int,
    lengths: int | Sequence[int],
    seed: int = 0,
    eos_token_id: int | None = EOS_ID,
) -> list[list[int]]:
    """``n`` random prompts of token ids in [4, vocab_size), never ``eos_token_id``.

    ``lengths`` is one length for all prompts or one per prompt.
    """
    if isinstance(lengths, int):
        lengths = [lengths] * n
    if len(lengths) != n:
        raise ValueError(f"got {len(lengths)} lengths for {n} prompts")
    allowed = torch.arange(N_SPECIAL, vocab_size)
    if eos_token_id is not None:
        allowed = allowed[allowed != eos_token_id]
    generator = torch.Generator().manual_seed(seed)
    return [
        allowed[torch.randint(len(allowed), (length,), generator=generator)].tolist()
        for length in lengths
    ]


def left_pad(
    prompts: Sequence[Sequence[int]], pad: int = PAD_ID
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of prompts padded on the left, as a generate call gets them."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


@contextlib.contextmanager
def probe_attention(model: PreTrainedModel) -> Iterator[list[dict[str, Any]]]:
    """Record every attention call of ``model`` while in the block.

    Yields a list that gets one dict per call: layer_idx, sliding_window, softcap,
    scaling, query/key shapes, and the names of all keyword arguments. The calls are
    delegated to the model's own implementation, so outputs do not change.
    """
    original = model.config._attn_implementation
    records: list[dict[str, Any]] = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        records.append(
            {
                "layer_idx": getattr(module, "layer_idx", None),
                "sliding_window": kwargs.get("sliding_window"),
                "softcap": kwargs.get("softcap"),
                "scaling": kwargs.get("scaling"),
                "query_shape": tuple(query.shape),
                "key_shape": tuple(key.shape),
                "kwargs": sorted(kwargs),
            }
        )
        if original == "eager":
            # "eager" is not in the registry: each model file has its own eager function
            # (Gemma2's is the one that applies softcap).
            delegate = sys.modules[type(module).__module__].eager_attention_forward
        else:
            delegate = ALL_ATTENTION_FUNCTIONS[original]
        return delegate(module, query, key, value, attention_mask, **kwargs)

    name = f"tiny_probe_{original}"
    AttentionInterface.register(name, probe)
    # Without a mask function registered under the same name, transformers builds no
    # mask at all for a custom implementation (it assumes the kernel masks itself).
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    model.set_attn_implementation(name)
    try:
        yield records
    finally:
        model.set_attn_implementation(original)


# ---- the architectures of issue 13, each for the feature it brings ---------------------------------
# Every config below is written out so the feature is visible; tests/models/test_architectures.py checks
# that patch really finds it in the model (a window on the right layers, a chunk, sinks, MLA widths,
# per-layer head widths) before comparing generations with transformers.
ARCHITECTURES = (
    "olmo2",
    "granite",
    "cohere2",
    "starcoder2",
    "smollm3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "llama4_text",
    "gpt_oss",
    "deepseek_v3",
    "gemma4_text",
    "qwen2_vl",
)
_SMALL = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=INITIALIZER_RANGE,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)


def make_arch_config(name: str) -> PreTrainedConfig:
    """The tiny config of one of ``ARCHITECTURES``."""
    import transformers as T

    if name == "olmo2":  # q/k norms over all heads, post-norm blocks
        return T.Olmo2Config(**_SMALL, num_hidden_layers=2)
    # embedding / residual / attention / logits multipliers; scaling = attention_multiplier
    if name == "granite":
        return T.GraniteConfig(
            **_SMALL,
            num_hidden_layers=2,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.0,
        )
    if name == "cohere2":  # sliding, sliding, sliding, full; parallel attention + MLP
        return T.Cohere2Config(
            **_SMALL,
            num_hidden_layers=4,
            head_dim=16,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        )
    if name == "starcoder2":  # every layer slides; biases; LayerNorm
        return T.Starcoder2Config(**_SMALL, num_hidden_layers=2, sliding_window=SLIDING_WINDOW)
    if name == "smollm3":  # NoPE every 4th layer (layer 3 has no RoPE)
        return T.SmolLM3Config(**_SMALL, num_hidden_layers=4, no_rope_layer_interval=4)
    if name == "mixtral":  # sparse MoE, every layer slides
        return T.MixtralConfig(
            **_SMALL,
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
        )
    # MoE with a shared expert; sliding on: the window lives in the mask only
    if name == "qwen2_moe":
        return T.Qwen2MoeConfig(
            **_SMALL,
            **_MOE,
            num_hidden_layers=4,
            num_experts=4,
            shared_expert_intermediate_size=32,
            use_sliding_window=True,
            sliding_window=SLIDING_WINDOW,
            max_window_layers=4,
        )
    if name == "qwen3_moe":  # MoE with q/k norms
        return T.Qwen3MoeConfig(**_SMALL, **_MOE, num_hidden_layers=2, num_experts=4, head_dim=16)
    # chunked attention on 3 of 4 layers (the 4th is full, without RoPE), MoE
    if name == "llama4_text":
        return T.Llama4TextConfig(
            **_SMALL,
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size_mlp=128,
            num_local_experts=4,
            num_experts_per_tok=1,
            attention_chunk_size=SLIDING_WINDOW,
        )
    if name == "gpt_oss":  # attention sinks (s_aux), alternating sliding / full, MoE
        return T.GptOssConfig(
            **{**_SMALL, "intermediate_size": 32},
            num_hidden_layers=4,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
        )
    if name == "deepseek_v3":  # MLA: K of 8 + 8 (nope + rope), V of 12; MoE after the first layer
        return T.DeepseekV3Config(
            **{**_SMALL, "num_key_value_heads": 4},
            **_MOE,
            num_hidden_layers=2,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
        )
    # per-layer geometry: sliding layers 2 KV heads of 16, the full layer 1 of 32
    if name == "gemma4_text":
        return T.Gemma4TextConfig(
            **_SMALL,
            num_hidden_layers=4,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            sliding_window=SLIDING_WINDOW,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=VOCAB_SIZE,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        )
    # the text path of an image-text model: M-RoPE (3 position sections) over text
    if name == "qwen2_vl":
        text = {
            k: v
            for k, v in _SMALL.items()
            if k not in ("pad_token_id", "bos_token_id", "eos_token_id")
        }
        return T.Qwen2VLConfig(
            text_config=dict(
                **text,
                num_hidden_layers=2,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 3, 3],
                },
            ),
            vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2),
            image_token_id=VOCAB_SIZE - 3,
            video_token_id=VOCAB_SIZE - 2,
            vision_start_token_id=VOCAB_SIZE - 4,
            vision_end_token_id=VOCAB_SIZE - 5,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
        )
    raise ValueError(f"unknown architecture {name!r}; known: {ARCHITECTURES}")


@torch.no_grad()
def _shrink_gemma4_embeddings(model: PreTrainedModel) -> None:
    # tied embeddings scaled by sqrt(hidden): shrink them, as for gemma2/3 above
    model.get_input_embeddings().weight.mul_(1 / 16)
    model.model.norm.weight.mul_(16)  # Gemma 4's norm multiplies by weight itself, not 1 + weight


def make_arch_model(name: str, seed: int = 0) -> PreTrainedModel:
    """A tiny random fp32 model of one of ``ARCHITECTURES`` (image-text models: their full class),
    eval mode."""
    from transformers import AutoModelForImageTextToText

    model = build_model(
        make_arch_config(name),
        AutoModelForImageTextToText if name == "qwen2_vl" else AutoModelForCausalLM,
        seed=seed,
        adjust=_shrink_gemma4_embeddings if name == "gemma4_text" else None,
    )
    model.generation_config.pad_token_id = PAD_ID
    return model
