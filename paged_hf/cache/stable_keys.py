"""Block keys that mean the same in every process: a sha256 chain over a prompt's blocks, seeded with
everything the KV depends on besides the tokens (the weights' content, the KV geometry, the adapter
state, the namespace and the request's salt). The in-memory prefix index keys by tokens under a
per-process namespace; the tiers that outlive the process (paged_hf/cache/disk_kv_store.py) key by
these.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import numpy as np
import torch

from .coherence import is_dtensor

# bumped whenever the meaning of a record's bytes changes (layout of a page, what the seed covers)
FORMAT_VERSION = 1


_CHUNK = 1 << 24  # bytes copied at a time


def hash_tensor(h: Any, t: torch.Tensor) -> None:
    """Feed ``t``'s bytes to the hash ``h``, a chunk's copy at a time: numpy's view of a tensor
    marks its storage as never to be resized again, which breaks the owner's later ``resize_``
    (FSDP's resharding of a weight, a caller's own tensor)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), _CHUNK):
        h.update(flat[start : start + _CHUNK].clone().numpy())


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over every parameter's and buffer's name, dtype, shape and bytes: equal only for the
    same weights (the same checkpoint loaded twice, in any process). Not for a tensor-parallel model:
    a rank's KV depends on every rank's shards, and this process sees its own only."""
    h = hashlib.sha256()
    tensors = list(model.named_parameters(remove_duplicate=False))
    tensors += list(model.named_buffers(remove_duplicate=False))
    for name, t in sorted(tensors, key=lambda nt: nt[0]):
        if is_dtensor(t):
            raise ValueError(f"weights_fingerprint: {name} is sharded across ranks (a DTensor)")
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        hash_tensor(h, t)
    return h.hexdigest()


def tier_seed(weights: str, geometry: dict[str, Any], adapters: Any, namespace: Any) -> bytes:
    """The chain's root for one engine state; ``adapters`` and ``namespace`` as the engine keys its
    in-memory prefix cache (their ``repr`` must be stable across processes: names, not ids)."""
    doc = {
        "format": FORMAT_VERSION,
        "weights": weights,
        "geometry": geometry,
        "adapters": repr(adapters),
        "namespace": repr(namespace),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).digest()


def salted(seed: bytes, cache_salt: Any) -> bytes:
    """The root of a request's chain: its salt (None for none) mixed into the engine's seed."""
    if cache_salt is None:
        return seed
    return hashlib.sha256(seed + b"salt:" + str(cache_salt).encode()).digest()


def chain_keys(
    root: bytes, tokens: Sequence[int], block_size: int, keys: list[bytes] | None = None
) -> list[bytes]:
    """Keys of every whole block of ``tokens``: key i covers blocks 0..i (a key names the whole
    prefix, so equal keys mean equal KV). ``keys``: the first keys, already computed, to extend."""
    keys = list(keys or [])
    n_full = len(tokens) // block_size
    h = keys[-1] if keys else root
    for b in range(len(keys), n_full):
        chunk = np.asarray(tokens[b * block_size : (b + 1) * block_size], dtype="<u4")
        h = hashlib.sha256(h + chunk.tobytes()).digest()
        keys.append(h)
    return keys
