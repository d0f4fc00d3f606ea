"""Gemma 3 (text): hybrid local (sliding) / global layers; the window is passed per layer."""
MODEL_TYPES = ("gemma3_text",)
