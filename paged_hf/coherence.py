"""What cached KV depends on besides tokens, and the checks that keep the cache honest.

KV in the prefix cache was computed by particular weights through paged attention. An optimizer
step, ``load_state_dict`` or a swapped-in parameter makes it stale; ``unpatch`` or
``set_attn_implementation`` means the engine no longer drives the attention it writes KV with.
The engine checks both before every step: a weight change resets the prefix cache (new requests
never read the old KV), a lost patch stops the engine with an error.
"""
from __future__ import annotations

from typing import Any

import torch

from . import attention


def weights_version(model: torch.nn.Module) -> tuple:
    """Changes whenever a parameter or buffer is written in place (each tensor's version counter:
    optimizer steps, ``load_state_dict``, ``copy_``) or replaced (storage address). Reading it
    costs a pass over the tensor objects, not their data."""
    return tuple((t.data_ptr(), t._version) for t in _tensors(model))


def _tensors(model: torch.nn.Module):
    yield from model.parameters()
    yield from model.buffers()


def check_still_patched(model: torch.nn.Module, state: Any) -> None:
    """Raise if the model is no longer patched as it was when the engine was built."""
    from .patching import patch_state

    if patch_state(model) is not state:
        raise RuntimeError("paged_hf engine: its model was unpatched (or patched again) after the engine was built; "
                           "build a new engine (or use paged_hf.engine_for(model))")
    impl = model.config._attn_implementation
    if impl != attention.NAME:
        raise RuntimeError(f"paged_hf engine: the model's attention implementation is now {impl!r} "
                           f"(set_attn_implementation after patch); the engine needs {attention.NAME!r}")
