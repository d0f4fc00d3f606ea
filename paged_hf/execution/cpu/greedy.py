"""The sampler's greedy pick on a CPU: each row's maximum and first index in one pass of a C++ op."""

from __future__ import annotations

import torch

from . import ops


def greedy_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``logits.max(dim=-1)`` through ``paged_hf::greedy_max`` (a tenth of the time; NaN rows give
    NaN, as max does), or None where the op does not serve these logits."""
    if not (
        logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(1) == 1
        and ops.load()
    ):
        return None
    return torch.ops.paged_hf.greedy_max(logits)
