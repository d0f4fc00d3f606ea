"""Which of a model's linear layers read the very same input (q/k/v, gate/up): the groups the packed
linears fuse into one GEMM (``linear.PackedLinears``).
"""

from __future__ import annotations

import torch


def find_siblings(
    model: torch.nn.Module, modules: list[torch.nn.Linear]
) -> list[list[torch.nn.Linear]]:
    """Groups of ``modules`` that a forward of a few tokens calls on the very same input tensor, each
    module once, in call order, with one input width and biases all or none."""
    calls: list[tuple[torch.nn.Module, torch.Tensor]] = []
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: calls.append((mod, args[0]))) for m in modules
    ]
    try:
        vocab = model.config.get_text_config().vocab_size
        with torch.inference_mode():
            model(input_ids=torch.arange(3, 9)[None] % vocab, use_cache=False)
    except Exception:  # noqa: BLE001 - a model this forward does not suit: nothing is fused
        return []
    finally:
        for h in hooks:
            h.remove()
    times: dict[torch.nn.Module, int] = {}
    for mod, _ in calls:
        times[mod] = times.get(mod, 0) + 1
    groups: list[tuple[torch.Tensor, list]] = []
    for mod, x in calls:
        for seen, members in groups:
            if seen is x:
                members.append(mod)
                break
        else:
            groups.append((x, [mod]))
    out = []
    for _, members in groups:
        if (
            len(members) > 1
            and all(times[m] == 1 for m in members)
            and len({m.in_features for m in members}) == 1
            and len({m.bias is None for m in members}) == 1
        ):
            out.append(members)
    return out
