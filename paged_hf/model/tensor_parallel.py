"""A model larger than one device, as transformers spreads it.

``from_pretrained(..., tp_plan="auto")`` under ``torchrun`` shards each attention and MLP over
the ranks of a device mesh's "tp" axis; the mesh lives on the model (``_mesh_manager``) with its
degree (``_tp_size``). The engine needs the group to run one schedule for its ranks
(paged_hf/engine/ranks.py). A ``device_map`` that spreads layers over several devices, or
offloads them to host memory or disk (accelerate's big-model loading), is refused by name.

Data parallel on top (``DistributedConfig(dp_replicate_size=...)`` or ``fsdp_size``) wraps the
model in FSDP2, which gathers each module's weights before its forward and frees them after: a
collective of the FSDP group at every forward, which copies of the model serving other requests
do not run alike, and which fails under inference mode. ``keep_unsharded`` gathers them once, at
``patch``, and keeps them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .probe import refuse

logger = logging.getLogger("paged_hf")


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


def keep_unsharded(model: torch.nn.Module) -> Callable[[], None] | None:
    """Gather an FSDP2-wrapped model's weights once and keep them gathered (FSDP's own shard
    stays beside them: the weights take their FSDP shard's memory more). Called on every rank
    alike, as ``patch`` is. Returns what hands the resharding back to FSDP (unpatch); None for
    a model FSDP does not wrap."""
    from torch.distributed.fsdp import FSDPModule

    wrapped = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not wrapped:
        return None
    before = [(m, _reshards_after_forward(m)) for m in wrapped]
    for m in wrapped:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    logger.info(
        "paged_hf: gathered the weights of %d FSDP modules once, for every forward to use "
        "(data parallel copies run their own requests)",
        len(wrapped),
    )

    def give_back() -> None:
        for m, reshards in before:
            m.set_reshard_after_forward(reshards, recurse=False)
            if reshards:
                m.reshard()

    return give_back


def _reshards_after_forward(module: Any) -> bool:
    group = module._get_fsdp_state()._fsdp_param_group
    return group is not None and group.post_forward_mesh_info is not None
