"""FlashInfer's stand-in for gpu_check's dry run on a CPU: tests/fake_flashinfer.py (a pure-torch
implementation of the two wrappers paged_hf calls, with FlashInfer 0.7's signatures and checks)
imported as ``flashinfer``, the FlashInfer backend chosen for ``backend="flashinfer"`` on the CPU,
and CUDA-graph decode run from its fixed buffers with eager stand-in graphs. So the dry run takes
the same paths as a GPU run (variants, host CSR, padded graph buckets, re-planning), minus the
kernels themselves.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def install() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    import fake_flashinfer

    import paged_hf.execution.runner as runner
    from paged_hf.execution.decode_accelerator import DecodeAccelerator, _EagerGraph

    sys.modules["flashinfer"] = fake_flashinfer.as_module()
    sys.modules.pop("paged_hf.execution.backends.flashinfer_backend", None)
    fib = importlib.import_module("paged_hf.execution.backends.flashinfer_backend")
    fib.SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
    fib.SUPPORTED_HEAD_DIMS = (16, 64, 128, 256, 512)
    choose = runner.select_backend
    runner.select_backend = lambda name, *a, **k: (
        fib.FlashInferBackend if name == "flashinfer" else choose(name, *a, **k)
    )
    wants = runner.wants_decode_accelerator
    runner.wants_decode_accelerator = lambda config, device: (
        config.use_cuda_graphs or wants(config, device)
    )

    def build(cls, model, backend, config, pad_block):
        if not (config.use_cuda_graphs and getattr(backend, "supports_cuda_graphs", False)):
            return None
        eager = dict(use_graphs=True, compile_backend=None, graph_factory=_EagerGraph)
        return cls(model, backend, config.max_num_seqs, pad_block, **eager)

    DecodeAccelerator.build = classmethod(build)
