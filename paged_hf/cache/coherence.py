"""What cached KV depends on besides tokens, and the checks that keep the cache honest.

Design notes: docs/internals.md, paged_hf/cache/coherence.py.
"""

from __future__ import annotations

import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

# every live watch, for the hook below
_WATCHES: "weakref.WeakSet[WeightsWatch]" = weakref.WeakSet()
_HOOK: Any = None


def _on_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After any torch optimizer's step, the watches whose model holds one of its parameters
    learn that their weights changed. Fused optimizers (``adamw_torch_fused``, the default of
    transformers' Trainer and of TRL) write parameters without moving their version counters:
    without this hook such a step goes unseen."""
    if not _WATCHES:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for watch in list(_WATCHES):
        if any(id(p) in watch.param_ids for p in params):
            watch.stepped = True


def _watch_optimizer_steps(watch: "WeightsWatch") -> None:
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK = register_optimizer_step_post_hook(_on_optimizer_step)
    _WATCHES.add(watch)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor: a tensor sharded or replicated across ranks, as transformers'
    tensor parallelism (``from_pretrained(..., tp_plan=...)``) leaves a model's weights."""
    # a DTensor exists only once its module is imported: nothing imported for other models
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def sharded_parameter(model: torch.nn.Module) -> str | None:
    """The name of one of ``model``'s parameters that is a DTensor (a tensor-parallel model), or None."""
    return next((n for n, p in model.named_parameters() if is_dtensor(p)), None)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, any other tensor as it is: a view sharing the shard's storage
    and version counter (a new view at each call, for a DTensor parameter). The DTensor itself has no
    storage of its own (``data_ptr()`` 0), and reading its values here would be a collective, or fail
    (a ``cat`` with plain tensors; a ``view`` under inference mode)."""
    if is_dtensor(t):
        with torch.no_grad():  # no autograd function in between
            return t.to_local()
    return t


@dataclass(frozen=True)
class WeightChange:
    why: str
    moved: (
        bool  # a tensor has new storage: anything holding its old address (a CUDA graph) is stale
    )


class WeightsWatch:
    """Tells whether a model's weights changed since it last looked, and why; and the model's
    adapter state (which PEFT adapters are active, or none), which picks a prefix-cache namespace.

    Three signals, each for writes the others miss:
    - a step of any ``torch.optim.Optimizer`` over one of the model's parameters (a global step
      hook: fused optimizers update in place without touching version counters);
    - version counters and storage of every parameter and buffer, and the set of merged adapters:
      in-place writes (``load_state_dict``, ``copy_`` under ``no_grad``), new storage (``.data =``,
      ``.to()``), replaced tensors, ``merge_adapter`` / ``unmerge_adapter``;
    - a content sample, ``SAMPLES`` values spread over each contiguous tensor, compared whenever
      the watch rescans: writes through ``.data`` (``p.data.copy_(w)``) and in-place writes to
      inference tensors, which no counter records, as long as they change a sampled value. An
      update of a whole tensor does; a write to a few rows of an embedding may not: call
      ``Engine.reset_prefix_cache()`` after such a write.

    Costs, 2 CPU cores, medians (``python benchmarks/bench_coherence.py``): per step, the version
    read and the adapter state, 50-130 us for SmolLM2-135M's 274 tensors; a rescan (one walk over
    the modules, the sample views, the sample), 1-2.5 ms, at the start of every generate call and
    at most once per ``RESCAN_S`` while stepping. The sample does not grow with a tensor's size: a
    2B-parameter Llama-7B-like layout (291 tensors) costs the same or less.
    """

    RESCAN_S = 1.0
    SAMPLES = 32

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.stepped = False
        self._rescan()
        self._version = self._read()
        self._content = self._sample()
        _watch_optimizer_steps(self)

    def changed(self, rescan: bool = False) -> WeightChange | None:
        """What changed in the weights since the last call (None: nothing)."""
        stepped, self.stepped = self.stepped, False
        looked = rescan or time.perf_counter() - self._scanned_at > self.RESCAN_S
        if looked:
            self._rescan()
        version = self._read()
        content = self._sample() if looked else None
        moved = version[1] != self._version[1] or version[2] != self._version[2]
        if moved:
            why = "a parameter or buffer replaced or given new storage"
        elif stepped:
            why = "an optimizer step"
        elif version != self._version:
            why = "a parameter or buffer written in place, or an adapter merged or unmerged"
        elif content is not None and not _same(content, self._content):
            why = "a parameter or buffer's values changed (a write no version counter records)"
        else:
            return None
        self._version = version
        self._content = content if content is not None else self._sample()
        return WeightChange(why, moved)

    def adapter_state(self) -> tuple:
        """The active / disabled state of every PEFT tuner layer (empty without adapters)."""
        return tuple((m._disable_adapters, tuple(m.active_adapters)) for m in self._tuner_layers)

    def _rescan(self) -> None:
        # one walk over the modules finds parameters, buffers and PEFT's tuner layers (each
        # parameters() / buffers() / modules() call would walk them again)
        params: dict[int, torch.Tensor] = {}
        buffers: dict[int, torch.Tensor] = {}
        self._tuner_layers = []
        for m in self.model.modules():
            for p in m._parameters.values():
                if p is not None:
                    params[id(p)] = p
            for b in m._buffers.values():
                if b is not None:
                    buffers[id(b)] = b
            # found by what their class carries, not by importing peft
            if all(
                hasattr(type(m), name)
                for name in ("merged_adapters", "_disable_adapters", "active_adapters")
            ):
                self._tuner_layers.append(m)
        self.param_ids = set(params)
        tensors = [*params.values(), *buffers.values()]
        # storage and values are a DTensor's local shard's; its version counter counts the writes made
        # through the DTensor, the shard's those made to the shard: both are read
        shards = [local_shard(t) for t in tensors]
        # inference tensors (made under torch.inference_mode) keep no version counter: for them
        # only new storage and the content sample are seen
        self._counted = [t for t in tensors if not t.is_inference()]
        self._counted += [s for t, s in zip(tensors, shards) if s is not t and not s.is_inference()]
        self._shards = shards
        ids = tuple((id(t), s.data_ptr()) for t, s in zip(tensors, shards))
        # the same tensors at the same addresses keep their views
        if ids != getattr(self, "_ids", None):
            self._samples = _sample_views(shards, self.SAMPLES)
        self._ids = ids
        self._scanned_at = time.perf_counter()

    def _read(self) -> tuple:
        return (
            tuple(t._version for t in self._counted),
            tuple(s.data_ptr() for s in self._shards),
            tuple(i for i, _ in self._ids),
            tuple(tuple(m.merged_adapters) for m in self._tuner_layers),
        )

    def _sample(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return [torch.cat(views).view(torch.uint8) for views in self._samples]


def _sample_views(tensors: list[torch.Tensor], k: int) -> list[list[torch.Tensor]]:
    """Views of ``k`` values spread over each contiguous tensor, grouped by dtype and device so
    that one ``cat`` per group reads them all."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_meta or t.numel() == 0 or t.dtype.is_complex or not t.is_contiguous():
            continue
        flat = t.detach().view(-1)
        step = max(1, flat.numel() // k)
        groups.setdefault((flat.dtype, flat.device), []).append(flat[step // 2 :: step][:k])
    return list(groups.values())


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))
