"""Llama: the plain case (RoPE, GQA/MQA); SmolLM2 is a llama."""
MODEL_TYPES = ("llama",)
