"""GPT-2: learned absolute positions (position_ids drive them) and a per-layer ``scaling``
when ``scale_attn_by_inverse_layer_idx`` is set.

``reorder_and_upcast_attn=True`` is honoured only by GPT-2's own eager code path, which a
patched model no longer takes: refuse it rather than change the model's numerics silently.
"""

MODEL_TYPES = ("gpt2",)


def check(model) -> str | None:
    """Why paged_hf cannot run this GPT-2 (None: it can)."""
    if getattr(model.config, "reorder_and_upcast_attn", False):
        return (
            "config.reorder_and_upcast_attn=True: that option lives in GPT-2's own eager attention, which "
            "paged_hf replaces; load the model with it False"
        )
    return None
