"""Gemma 2: attention logit softcap and alternating sliding layers, both passed per layer;
``query_pre_attn_scalar`` arrives through ``scaling``. The final logit softcap is applied
by the model's head, before our sampler sees the logits."""
MODEL_TYPES = ("gemma2",)
