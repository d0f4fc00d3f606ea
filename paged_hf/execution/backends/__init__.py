"""Execution backends: where the KV tensors live and how attention reads them; ``select_backend``."""

from __future__ import annotations

import warnings

import torch

from ..kv_geometry import KVLayout
from .torch_backend import TorchBackend


def select_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    layout: KVLayout | int | None = None,
    quiet: bool = False,
) -> type:
    """The backend class for ``name``; 'auto' is FlashInfer on CUDA when it imports and supports
    the model's dtype and KV layout (``layout``: per-layer geometry, or a head_dim), else torch
    (with one warning on CUDA, saying why: an import that fails in any way, a missing package, a
    library that does not load, counts); on CPU it is the paged attention kernel when it builds,
    else torch (with one warning). ``quiet``: choose without warning (a caller that asks again)."""
    if name == "torch":
        return TorchBackend
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"backend='flashinfer' needs a CUDA device, the model is on {device}")
        from .flashinfer_backend import (
            FlashInferBackend,  # lazy: CPU installs never import flashinfer
        )

        return FlashInferBackend
    if name != "auto":
        raise ValueError(f"unknown backend {name!r}; choose 'auto', 'torch' or 'flashinfer'")
    if isinstance(layout, KVLayout) and not layout.layers:
        return TorchBackend  # a model of stateful layers only: no attention for a kernel to run
    if device.type == "cuda":
        try:
            from .flashinfer_backend import FlashInferBackend, unsupported_reason
        except Exception as e:  # noqa: BLE001 - ImportError, or an OSError / RuntimeError loading its libraries
            if not quiet:
                warnings.warn(
                    f"paged_hf: FlashInfer is not available ({type(e).__name__}: {e}); using the torch "
                    "backend on CUDA, which is much slower. Install it with `pip install paged_hf[cuda]`.",
                    stacklevel=3,
                )
            return TorchBackend
        reason = None if dtype is None or layout is None else unsupported_reason(dtype, layout)
        if reason is None:
            return FlashInferBackend
        if not quiet:
            warnings.warn(
                f"paged_hf: using the torch backend on CUDA, which is much slower: {reason}",
                stacklevel=3,
            )
    elif device.type == "cpu":
        from ..cpu import paged_attention as cpu_paged_attention

        if cpu_paged_attention.available():
            return cpu_paged_attention.CpuPagedBackend
    return TorchBackend
