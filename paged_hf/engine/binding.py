"""What a patched model carries for the engine: the binding between a model and paged attention.

Design notes: docs/internals.md, paged_hf/engine/binding.py.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..execution import attention
from ..execution.kv_geometry import KVLayout
from ..execution.state_geometry import StateLayout

STATE_ATTR = "_paged_hf_state"


@dataclass
class PatchState:
    original_attn: str
    layout: KVLayout
    # every config's own implementation before patch (sub-models may differ: a VLM's vision tower
    # eager, its language model sdpa), put back exactly by unpatch
    saved_implementations: list = field(default_factory=list)
    # the configs the attention modules read their implementation from: all must stay "paged_hf"
    attention_configs: tuple = ()
    media_token_ids: frozenset[int] = frozenset()
    # engine options this model is exact only up to: {EngineConfig field: (largest value, why)}
    limits: dict = field(default_factory=dict)
    state: StateLayout | None = None  # a hybrid model's stateful layers (None: attention only)
    # the process group transformers' tensor parallelism spread the model's heads over (None: one
    # device); the engine runs one schedule for its ranks (paged_hf/engine/ranks.py)
    tp_group: Any = None
    # hands an FSDP-wrapped model's resharding back to FSDP (data parallel: its weights are
    # gathered once at patch, paged_hf/model/tensor_parallel.py); None where FSDP does not wrap it
    reshard: Callable[[], None] | None = None
    config: dict[str, Any] = field(default_factory=dict)  # engine options given to patch()
    engine: Any = None  # created on first generate, kept so the prefix cache survives calls
    tokenizer: Any = None
    # builds the engine behind ``model.generate`` (set by patch: the model side builds engines)
    engine_factory: Callable[[], Any] | None = None
    # every Engine built on the model while patched: unpatch refuses while one is busy, and an
    # engine refuses to run once the state it was built under is gone
    engines: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def get_engine(self) -> Any:
        """The engine behind the patched ``generate``, built on first use."""
        if self.engine is None:
            if self.engine_factory is None:
                raise ValueError(
                    "this model's attention is paged but it was not patched with paged_hf.patch"
                )
            self.engine = self.engine_factory()
        return self.engine


def patch_state(model: torch.nn.Module) -> PatchState | None:
    return getattr(model, STATE_ATTR, None)


def check_still_patched(model: torch.nn.Module, state: PatchState) -> None:
    """Raise if the model is no longer patched as it was when the engine was built."""
    if patch_state(model) is not state:
        raise RuntimeError(
            "paged_hf engine: its model was unpatched (or patched again) after the engine was built; "
            "build a new engine (or use paged_hf.engine_for(model))"
        )
    for cfg in state.attention_configs or (model.config,):
        impl = cfg._attn_implementation
        if impl != attention.NAME:
            raise RuntimeError(
                f"paged_hf engine: the model's attention implementation is now {impl!r} "
                f"(set_attn_implementation after patch); the engine needs {attention.NAME!r}"
            )
