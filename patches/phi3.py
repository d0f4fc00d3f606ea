"""Phi-3: fused qkv projection inside the module; an optional sliding window on every layer."""
MODEL_TYPES = ("phi3",)
