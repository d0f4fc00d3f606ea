"""Per-family patch modules, one file per model family (shipped as ``paged_hf.patches``).

Each module names the ``model_type`` values it covers in ``MODEL_TYPES`` and may define
``check(model)`` to refuse configurations the paged path cannot honour. Most families need
nothing else: their attention already goes through transformers' AttentionInterface, and
sliding windows, softcaps and per-layer scaling arrive as the attention call's arguments.
"""
from __future__ import annotations

import importlib
from types import ModuleType

FAMILY_MODULES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2")

_registry: dict[str, ModuleType] = {}
for _name in FAMILY_MODULES:
    _mod = importlib.import_module(f"{__name__}.{_name}")
    for _model_type in _mod.MODEL_TYPES:
        _registry[_model_type] = _mod


def supported_model_types() -> list[str]:
    return sorted(_registry)


def family_for(model_type: str) -> ModuleType | None:
    return _registry.get(model_type)
