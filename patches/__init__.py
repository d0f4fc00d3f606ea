"""Per-family quirks, one file per model family (shipped as ``paged_hf.patches``).

Whether a model runs is decided from the model itself (paged_hf/model/capability.py): its attention goes
through transformers' AttentionInterface, and each layer's geometry, window, chunk, sinks and
softcap are read from it. A family gets a file here only for what that check cannot see: each
module names the ``model_type`` values it covers in ``MODEL_TYPES`` and may define ``check(model)``,
which returns why the paged path cannot honour a configuration (or None; patch refuses with it),
and ``limits(model)``: engine options the paged path is exact only up to, ``{option: (largest, why)}``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILY_MODULES = ("gpt2", "llama4")

_registry: dict[str, ModuleType] = {}
for _name in FAMILY_MODULES:
    _mod = importlib.import_module(f"{__name__}.{_name}")
    for _model_type in _mod.MODEL_TYPES:
        _registry[_model_type] = _mod


def family_for(model_type: str) -> ModuleType | None:
    return _registry.get(model_type)
