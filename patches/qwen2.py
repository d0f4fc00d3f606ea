"""Qwen2: sliding windows only on the layers ``config.layer_types`` marks "sliding_attention"."""
MODEL_TYPES = ("qwen2",)
