"""``output_hidden_states`` on a patched ``generate``: each row's states, recorded by the engine at
the positions it computed, laid out as transformers' ``generate`` returns them.

transformers gives one entry per generated token: the first holds the prompt's positions (the
padded width), each later one the position of the token generated before it; each entry is a
tuple of the model's ``num_layers + 1`` states ``[batch, positions, hidden]``. Positions the engine
never computes show zeros: pads, and a row's steps after it ended (transformers runs pad tokens
through the model there).
"""

from __future__ import annotations

import torch

from ..engine.outputs import RequestOutput


def as_transformers_returns(
    outputs: list[RequestOutput], attention_mask: torch.Tensor, steps: int
) -> tuple[tuple[torch.Tensor, ...], ...]:
    """``outputs``: the call's rows, each with ``hidden_states`` ``[layers + 1, positions, hidden]``;
    ``steps``: the generated width of the call's sequences."""
    states = [out.hidden_states for out in outputs]
    layers, hidden = states[0].shape[0], states[0].shape[2]
    batch, width = attention_mask.shape
    prompt = torch.zeros(layers, batch, width, hidden, dtype=states[0].dtype)
    later = torch.zeros(layers, batch, max(steps - 1, 0), hidden, dtype=states[0].dtype)
    for i, (row, mask) in enumerate(zip(states, attention_mask.cpu().bool())):
        row = row.cpu()
        n = int(mask.sum())
        prompt[:, i, mask] = row[:, :n]
        generated = row[:, n:]
        later[:, i, : generated.shape[1]] = generated
    device = attention_mask.device
    first = tuple(prompt[layer].to(device) for layer in range(layers))
    rest = (
        tuple(later[layer, :, j : j + 1].to(device) for layer in range(layers))
        for j in range(later.shape[2])
    )
    return (first, *rest)
