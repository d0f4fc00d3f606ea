"""Per-layer KV geometry through every path that stores or reads KV: the FlashInfer backend (its
stand-in) with per-layer widths, and its refusals where its wrappers cannot do a layer's variant;
swap preemption of layers of different shapes; the compiled decode step with sinks and MLA."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from stand_in_engines import flashinfer_matches_torch, workload
from tiny_models import make_arch_model

import paged_hf
from paged_hf.execution.backends import TorchBackend, select_backend
from paged_hf.execution.backends.swap import swap_in, swap_out
from paged_hf.execution.kv_geometry import KVLayout, LayerSpec

MLA = KVLayout((LayerSpec(4, 4, 16, 12),) * 2)
SINKS = KVLayout(
    (LayerSpec(4, 2, 16, 16, window=8, sinks=True), LayerSpec(4, 2, 16, 16, sinks=True))
)
CHUNKED = KVLayout((LayerSpec(4, 2, 16, 16, chunk=8), LayerSpec(4, 2, 16, 16)))
PER_LAYER = KVLayout((LayerSpec(4, 2, 16, 16, window=8),) * 3 + (LayerSpec(4, 2, 32, 32),))


def test_layer_spec_and_layout():
    with pytest.raises(ValueError, match="not a multiple"):
        LayerSpec(4, 3, 16, 16)
    with pytest.raises(ValueError, match="not both"):
        LayerSpec(4, 2, 16, 16, window=8, chunk=8)
    assert MLA.bytes_per_block(4, 2) == 2 * 4 * 4 * (16 + 12) * 2
    assert PER_LAYER.describe() == "3 x 4q/2kv heads x 16 (window 8), 1 x 4q/2kv heads x 32"
    assert not PER_LAYER.is_uniform and KVLayout.uniform(3, 2, 16).is_uniform
    backend = TorchBackend(MLA, num_blocks=5, block_size=4)
    assert [tuple(t.shape) for t in backend.kv] == [(5, 4, 4, 16), (5, 4, 4, 12)] * 2


def test_flashinfer_backend_runs_per_layer_widths(fake_flashinfer, monkeypatch):
    """Gemma 4's sliding layers (16 wide) and full layer (32 wide) through the FlashInfer backend:
    one planned variant per shape, the same tokens as the torch backend."""
    monkeypatch.setattr(fake_flashinfer, "SUPPORTED_HEAD_DIMS", (16, 32))
    engine = flashinfer_matches_torch(
        make_arch_model("gemma4_text"), fake_flashinfer.FlashInferBackend, monkeypatch
    )
    backend = engine.runner.backend
    assert [tuple(c.shape[-2:]) for c in backend.kv] == [(2, 16)] * 3 + [(2, 32)]
    assert {(v[0], v[5]) for v in backend.variants} == {(7, 16), (-1, 32)}, (
        "window_left 7 on the 16-wide layers"
    )


@pytest.mark.parametrize(
    "layout, reason",
    [
        (MLA, r"K and V of different widths \(16 / 12, MLA\)"),
        (SINKS, r"attention sinks \(s_aux\)"),
        (CHUNKED, r"chunked attention \(chunks of 8\)"),
    ],
)
def test_flashinfer_names_what_it_cannot_do_and_auto_falls_back_once(
    layout, reason, fake_flashinfer, monkeypatch
):
    with pytest.raises(ValueError, match=reason):
        fake_flashinfer.FlashInferBackend(layout, 4, 16, dtype=torch.bfloat16, device="cpu")
    cuda = torch.device("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert select_backend("auto", cuda, torch.bfloat16, layout) is TorchBackend
    assert len(caught) == 1 and "using the torch backend on CUDA" in str(caught[0].message)
    assert re.search(reason, str(caught[0].message))


@pytest.mark.parametrize("layout", [MLA, PER_LAYER])
def test_swap_round_trip_with_layers_of_different_shapes(layout):
    backend = TorchBackend(layout, num_blocks=10, block_size=4)
    gen = torch.Generator().manual_seed(0)
    for cache in backend.kv:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    before = [c.clone() for c in backend.kv]
    handle = swap_out(backend.kv, [3, 1, 5])
    assert handle.num_blocks == 3 and handle.nbytes == 3 * layout.bytes_per_block(4, 4)
    for cache in backend.kv:
        cache[[3, 1, 5]] = 0
    swap_in(backend.kv, handle, [7, 2, 0])
    for old, new in zip(before, backend.kv):
        assert torch.equal(new[[7, 2, 0]], old[[3, 1, 5]])


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_swap_preemption_gives_the_same_tokens(name):
    model = make_arch_model(name)
    prompts, params = workload(model.config.vocab_size)
    big = paged_hf.Engine(model, num_blocks=128, block_size=4, max_num_seqs=8)
    # pages of one cache group each: gpt_oss's sliding and full layers are two groups, its sliding
    # pages freed as they slide out; both pools are small enough to preempt
    small = paged_hf.Engine(
        model,
        num_blocks={"deepseek_v3": 14, "gpt_oss": 24}[name],
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=32,
        preemption_mode="swap",
    )
    assert [o.token_ids for o in small.generate(prompts, params)] == [
        o.token_ids for o in big.generate(prompts, params)
    ]
    assert small.stats()["preemptions"] > 0


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_compiled_decode_with_mla_widths_and_sinks(name):
    """The compiled decode step's attention op carries sinks and returns V's width (its fake too)."""
    torch._dynamo.reset()
    model = make_arch_model(name)
    prompts, params = workload(model.config.vocab_size)
    kw = dict(
        num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, backend="torch"
    )
    expected = [o.token_ids for o in paged_hf.Engine(model, **kw).generate(prompts, params)]
    engine = paged_hf.Engine(model, **kw, compile_decode="aot_eager")
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
