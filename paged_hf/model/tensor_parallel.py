"""Where a model loaded with transformers' tensor parallelism keeps its process group.

``from_pretrained(..., tp_plan="auto")`` under ``torchrun`` shards each attention and MLP over
the ranks of a device mesh's "tp" axis; the mesh lives on the model (``_mesh_manager``) with its
degree (``_tp_size``). The engine needs the group to run one schedule for its ranks
(paged_hf/engine/ranks.py).
"""

from __future__ import annotations

from typing import Any

import torch


def tp_group(model: torch.nn.Module) -> Any:
    """The tensor-parallel process group ``model`` is sharded over; None where it is not."""
    size = getattr(model, "_tp_size", None) or 1
    if size == 1:
        return None
    mesh = getattr(model, "_mesh_manager", None)
    if mesh is None:
        raise NotImplementedError(
            f"paged_hf: this model is sharded over {size} ranks, but its device mesh is not where "
            "transformers 5 keeps it (model._mesh_manager)"
        )
    return mesh.get_mesh("tp").get_group()
