"""Mistral: every layer passes ``sliding_window=config.sliding_window`` to attention."""
MODEL_TYPES = ("mistral",)
