"""Qwen3: q/k RMS norms run before attention inside the module; nothing to do here."""
MODEL_TYPES = ("qwen3",)
