"""Tiny random models: the one builder (seeded fp32 draw, size check, dtype rounding) that the
support sweep and the tests build through, and tiny configs from each model type's own config
class (every size field shrunk; the few that need more are given it in ``TINY_EXTRA``)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from typing import Any, Callable

import torch

# Sizes set on every config class that has the field. Windows and chunks are 8 tokens so the prompts
# cross them; head_dim 16; MLA widths differ (K 16 = 8 nope + 8 rope, V 12) so that is exercised.
MAX_PARAMS = 20_000_000  # a tiny model larger than this is not tiny: some size field was missed

TINY_SIZES: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.15,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_num_experts=4,
    num_experts_per_token=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    moe_topk=2,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
    qk_head_dim=16,
    n_embd=64,
    n_layer=4,
    n_head=4,
    n_positions=1024,
    n_ctx=1024,
    n_inner=128,
    d_model=64,
    decoder_layers=4,
    decoder_attention_heads=4,
    decoder_ffn_dim=128,
    encoder_layers=4,
    encoder_attention_heads=4,
    encoder_ffn_dim=128,
    ffn_dim=128,
    num_layers=4,
    num_heads=4,
    n_heads=4,
    n_layers=4,
    sliding_window=8,
    attention_chunk_size=8,
    use_sliding_window=True,
    max_window_layers=2,
    window_size=8,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_head_dim=16,
    linear_num_heads=4,
    mamba_d_state=8,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_expand=2,
    mamba_chunk_size=16,
    ssm_state_size=8,
    state_size=8,
    time_step_rank=8,
    mamba_dt_rank=8,
    mamba_num_heads=4,
    mamba_head_dim=16,
    n_groups=1,
    mamba_n_groups=1,
    index_head_dim=16,
    index_n_heads=2,
    index_topk=4,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=16,
    kv_channels=16,
    attention_head_dim=16,
    ffn_hidden_size=128,
    expert_ffn_hidden_size=32,
    zero_expert_num=2,
    emb_dim=64,
    vocab_size_per_layer_input=512,
    hidden_size_per_layer_input=16,
    encoder_hash_byte_group_vocab=512,
    hidden_size_global=64,
    rotary_dim=8,
    is_decoder=True,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    moe_k=2,
    moe_num_shared_experts=1,
    shared_experts_intermediate_size=32,
)
# what a type's own validators need beyond the sizes above (one line per type, each for a rule of its config)
TINY_EXTRA: dict[str, dict[str, Any]] = {
    # hybrids: the released checkpoints interleave attention with their stateful layers; the default
    # configs of bamba and granitemoehybrid have none, and jamba's first comes after layer 4
    "bamba": dict(mamba_d_head=32, attn_layer_indices=[1, 3]),
    "granitemoehybrid": dict(mamba_d_head=32, layer_types=["mamba", "attention"] * 2),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "falcon_h1": dict(mamba_d_head=32, mamba_d_ssm=None),
    "mamba2": dict(head_dim=32),
    "zaya": dict(num_experts_per_tok=1),
    "gpt_neo": dict(attention_types=[[["global", "local"], 2]]),
    "gemma3n_text": dict(num_kv_shared_layers=2),
    "zamba2": dict(layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),
    "zamba": dict(
        num_hidden_layers=7, attn_layer_period=2, attn_layer_offset=1, layers_block_type=None
    ),
    # released LFM2 checkpoints interleave convolution and attention layers; the default config has none
    "lfm2": dict(full_attn_idxs=[1, 3]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 2),
    "qwen4_exp_text": dict(
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
    ),
    "reformer": dict(is_decoder=True, axial_pos_shape=[32, 32], axial_pos_embds_dim=[32, 32]),
    "cohere_compass_text": dict(
        rope_parameters={
            kind: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
            for kind in ("full_attention", "sliding_attention")
        }
    ),
    "dbrx": dict(
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    # image-text models: a small vision tower (never run: prompts are text), M-RoPE sections for head_dim 16
    "qwen2_vl": dict(
        vision_config={"depth": 2, "embed_dim": 64, "hidden_size": 64, "num_heads": 4},
        text_config={
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            }
        },
    ),
    "qwen2_5_vl": dict(
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 4,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
        },
        text_config={
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            }
        },
    ),
}
TINY_EXTRA["qwen4_exp"] = dict(text_config=TINY_EXTRA["qwen4_exp_text"])
_KEEP_SUB_CONFIGS = ("dbrx",)  # sub-configs given whole in TINY_EXTRA
# calls a type needs after it is built before it can run at all
AFTER_BUILD = {"xmod": lambda model: model.set_default_language("en_XX")}


def _field_names(cls: type, default: Any) -> set[str]:
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    names |= set(default.to_dict())
    with contextlib.suppress(TypeError, ValueError):
        names |= set(inspect.signature(cls.__init__).parameters)
    return names


def tiny_config(model_type: str, config_class: type | None = None, **overrides: Any) -> Any:
    """A tiny config of ``model_type``'s own config class, or ``config_class`` (sub-configs shrunk alike)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return _shrink(config_class or CONFIG_MAPPING[model_type], overrides)


def _shrink(cls: type, overrides: dict[str, Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = cls()
    names = _field_names(cls, default)
    kw = {k: v for k, v in TINY_SIZES.items() if k in names or k == "is_decoder"}
    # MLA: one KV head per query head
    if "kv_lora_rank" in names and "num_key_value_heads" in names:
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    if "qk_rope_head_dim" in names and "head_dim" in names:  # MLA: head_dim is the rotary part
        kw["head_dim"] = kw["qk_rope_head_dim"]
    model_type = getattr(cls, "model_type", "")
    if model_type not in _KEEP_SUB_CONFIGS:
        for name in dict(getattr(default, "sub_configs", {}) or {}):
            sub = getattr(default, name, None)
            if sub is not None:
                with contextlib.suppress(Exception):
                    kw[name] = _shrink(type(sub), {}).to_dict()
    cycled = None
    if "layer_types" in names:
        # let the config derive its layer types from the sizes above; if that loses a kind the
        # default config has (a 5:1 sliding pattern over 4 layers), cycle through the kinds instead
        kw["layer_types"] = None
        kinds = list(dict.fromkeys(getattr(default, "layer_types", None) or []))
        if kinds:
            cycled = [kinds[i % len(kinds)] for i in range(kw.get("num_hidden_layers", 4))]
    for source in (TINY_EXTRA.get(model_type, {}), overrides):
        # a dict for a shrunk sub-config adjusts it; anything else replaces
        for (
            key,
            value,
        ) in source.items():
            kw[key] = (
                {**kw[key], **value}
                if isinstance(value, dict) and isinstance(kw.get(key), dict)
                else value
            )
    if cycled is not None and kw.get("layer_types", 0) is None:
        try:
            derived = cls(**kw).layer_types
        except Exception:  # noqa: BLE001 - some configs need layer types given
            derived = None
        if not derived or not set(cycled) <= set(derived):
            kw["layer_types"] = cycled
    return cls(**kw)


def build_model(
    config: Any,
    model_class: type,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    adjust: Callable[[torch.nn.Module], None] | None = None,
) -> torch.nn.Module:
    """The one tiny-model builder (the support sweep's and the tests'): ``model_class`` (or the
    class an Auto class maps ``config`` to) with weights drawn in fp32 from ``seed``, leaving the
    global RNG untouched, then ``adjust``ed, then rounded to ``dtype``; in eval mode. Models of one
    seed in different dtypes agree up to rounding."""
    if hasattr(model_class, "_model_mapping"):  # an Auto class
        model_class = model_class._model_mapping[type(config)]
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with torch.device("meta"):
        n = sum(p.numel() for p in model_class._from_config(config, **kw).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"the tiny config still has {n:,} parameters")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class._from_config(config, dtype=torch.float32, **kw)
    if adjust is not None:
        adjust(model)
    if dtype != torch.float32:
        # built directly in ``dtype``, the model gets the buffers from_pretrained(dtype=...) gives
        # (rotary inv_freq stays fp32, unlike after model.to(dtype)); the fp32 draw is copied in
        state = model.state_dict()
        with torch.random.fork_rng(devices=[]):
            model = model_class._from_config(config, dtype=dtype, **kw)
        model.load_state_dict(state)
    return model.eval()


def build_tiny_model(
    model_type: str, multimodal: bool = False, seed: int = 0, **overrides: Any
) -> torch.nn.Module:
    """The tiny model (fp32, eval) of ``model_type``: its causal-LM class, or its image-text class."""
    import transformers
    from transformers.models.auto import modeling_auto

    names = (
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        if multimodal
        else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    model_class = getattr(transformers, names[model_type])
    # the class's own config class: a decoder config where the type's is composite (Musicgen)
    config = tiny_config(model_type, model_class.config_class, **overrides)
    return build_model(config, model_class, seed=seed, adjust=AFTER_BUILD.get(model_type))
