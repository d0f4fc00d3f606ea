"""A model larger than one device, as transformers spreads it.

``from_pretrained(..., tp_plan="auto")`` under ``torchrun`` shards each attention and MLP over
the ranks of a device mesh's "tp" axis; the mesh lives on the model (``_mesh_manager``) with its
degree (``_tp_size``). The engine needs the group to run one schedule for its ranks
(paged_hf/engine/ranks.py). A ``device_map`` that spreads layers over several devices, or
offloads them to host memory or disk (accelerate's big-model loading), is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from .probe import refuse


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


def refuse_spread_layers(model: torch.nn.Module, model_name: str) -> None:
    """``UnsupportedModelError`` where a ``device_map`` put the model's layers on several devices
    or offloaded some (their weights live elsewhere between forwards, as meta tensors here): an
    engine holds each model's KV on one device and reads its weights where they are."""
    placed = getattr(model, "hf_device_map", None) or {}
    devices = sorted({str(d) for d in placed.values()})
    offloaded = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if len(devices) > 1 or offloaded:
        where = ", ".join(devices) or "meta"
        raise refuse(
            model_name,
            "device_map",
            f"its layers are spread over {where} (accelerate's big-model loading"
            + (f"; {offloaded[0]} and others offloaded" if offloaded else "")
            + "); load it on one device, or shard it with transformers' tensor parallelism "
            '(DistributedConfig(tp_plan="auto") under torchrun: docs/tensor_parallel.md)',
        )
