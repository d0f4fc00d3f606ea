"""Engines on FlashInfer's stand-in (tests/fake_flashinfer.py): the backend swapped in, a workload
of shared prefixes and mixed lengths, and the check that it gives the torch backend's tokens.
"""

from __future__ import annotations

import sys

from tiny_models import tiny_prompts

import paged_hf
import paged_hf.execution.runner
from paged_hf import SamplingParams
from paged_hf.execution.decode_accelerator import (
    DecodeAccelerator,
    _EagerGraph,
)


def use_backend(monkeypatch, backend_cls, graphs: bool = False, graph_factory=_EagerGraph):
    """Make engines built from now on use ``backend_cls`` (on CPU), and with ``graphs`` the
    CUDA-graph decode path with stand-in graphs (``graph_factory``, eager by default)."""
    monkeypatch.setattr(paged_hf.execution.runner, "select_backend", lambda *a, **k: backend_cls)
    if graphs:
        monkeypatch.setattr(
            paged_hf.execution.runner, "wants_decode_accelerator", lambda config, device: True
        )
        monkeypatch.setattr(
            DecodeAccelerator,
            "build",
            classmethod(
                lambda cls, model, backend, config, pad_block: cls(
                    model,
                    backend,
                    config.max_num_seqs,
                    pad_block,
                    use_graphs=True,
                    compile_backend=None,
                    graph_factory=graph_factory,
                )
            ),
        )


def workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    shared = tiny_prompts(vocab, 1, 21, seed=11)[0]
    prompts = [shared + p for p in tiny_prompts(vocab, 3, [2, 9, 14], seed=12)] + tiny_prompts(
        vocab, 3, [1, 5, 26], seed=13
    )
    params = [SamplingParams(max_new_tokens=n) for n in (9, 4, 12, 7, 10, 3)]
    return prompts, params


def generate_tokens(model, prompts, params, **config):
    engine = paged_hf.Engine(
        model, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=24, **config
    )
    outs = engine.generate(prompts, params)
    return [o.token_ids for o in outs], engine


def flashinfer_matches_torch(model, backend_cls, monkeypatch, graphs: bool = False):
    """The workload through the torch backend, then through ``backend_cls`` (and with ``graphs``
    the CUDA-graph decode path): the same tokens. Returns the second engine."""
    prompts, params = workload(model.config.vocab_size)
    expected, _ = generate_tokens(model, prompts, params, backend="torch")
    use_backend(monkeypatch, backend_cls, graphs=graphs)
    got, engine = generate_tokens(model, prompts, params)
    assert got == expected
    return engine


def forget_flashinfer_backend() -> None:
    """Drop the imported FlashInfer backend, so the next import sees whichever flashinfer is installed."""
    import paged_hf.execution.backends as backends

    sys.modules.pop("paged_hf.execution.backends.flashinfer_backend", None)
    if hasattr(backends, "flashinfer_backend"):
        delattr(backends, "flashinfer_backend")
