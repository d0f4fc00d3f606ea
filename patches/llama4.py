"""Llama 4: attention temperature tuning on its NoPE layers.

With ``attn_temperature_tuning``, each NoPE layer scales its queries by
``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``, where transformers computes the
position p as ``arange(T) + cache length``, not from ``position_ids``. In a packed step with
``use_cache=False`` that is each token's row in the step. The scale is 1 while
``p + 1 < floor_scale`` whichever p is used, so the paged path is exact as long as every position
and every packed row stays below ``floor_scale - 1``: engines on such a model are limited to it
(max_model_len, max_num_batched_tokens), with a message naming the reason.
"""

MODEL_TYPES = ("llama4", "llama4_text")


def limits(model) -> dict[str, tuple[int, str]]:
    cfg = model.config.get_text_config()
    nope = [i for i, rope in enumerate(getattr(cfg, "no_rope_layers", None) or []) if not rope]
    if not getattr(cfg, "attn_temperature_tuning", False) or not nope:
        return {}
    limit = int(cfg.floor_scale) - 1
    why = (
        f"Llama 4 scales the queries of its NoPE layers (e.g. layer {nope[0]}) by a factor computed from each "
        f"token's row in the step, not its position; that factor is 1 (exact) only below floor_scale - 1 = {limit}"
    )
    return {"max_model_len": (limit, why), "max_num_batched_tokens": (limit, why)}
