"""The bf16 GEMM on the weights where transformers keeps them (paged_hf/execution/cpu/weight_rows.py):
the build this CPU has (AVX2, AVX-512 or AVX-512 bf16 lanes), its products against the exact ones,
its row invariance, siblings read side by side as one GEMM, what it refuses, and engines on it
(``cpu_packed_weights="rows"``) teacher-forced against transformers. ``make test-avx2`` runs these on the AVX2 build on a CPU with more;
a CPU without AVX2 and FMA reports them skipped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cpu_isa import needs
from oracle import assert_teacher_forced
from tiny_models import make_tiny_model, tiny_prompts

import paged_hf
from paged_hf.execution.cpu import isa, roundings, weight_rows
from paged_hf.execution.cpu import linear as cpu_linear

pytestmark = needs("avx2", "the weight-rows GEMM (AVX2 + FMA lanes at least)")
SMALL = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8}
BF16_TOL = 0.125  # teacher forcing against transformers' bf16 forward (as test_cpu_linear.py)


def _weights(shapes: list[int], k: int, seed: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    ws = [(torch.randn(n, k, generator=g) * 0.1).bfloat16() for n in shapes]
    return ws, [torch.randn(n, generator=g).bfloat16() for n in shapes]


def test_the_build_is_the_widest_this_cpu_runs_and_it_serves():
    """avx512_bf16 where the CPU has it, else avx512, else avx2; a build that fails its own check
    against F.linear would only turn itself off unseen, so it must serve."""
    want = next(level for level in ("avx512_bf16", "avx512", "avx2") if isa.at_least(level))
    assert weight_rows.build() == want
    assert weight_rows.available()


@pytest.mark.parametrize(
    "shapes,k", [([70], 98), ([576, 192, 192], 576), ([1536], 576), ([96, 3], 1538), ([5], 33)]
)
def test_products_are_within_a_rounding_of_the_exact_ones(shapes, k):
    """Every output the exact (float64) product rounded to bf16 or the bf16 value next to it; at
    most 2% of them other than F.linear's own; a weight 2% off is caught by the same measure.
    Shapes: K and N off every build's step and block, siblings of other widths side by side."""
    ws, bs = _weights(shapes, k, seed=k + len(shapes))
    whole, whole_bias = torch.cat(ws), torch.cat(bs)
    g = torch.Generator().manual_seed(1)
    for biases in (None, bs):
        bias = None if biases is None else whole_bias
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 33):
            x = torch.randn(rows, k, generator=g).bfloat16()
            got = weight_rows.gemm(x, ws, biases)
            exact = x.double() @ whole.double().T + (0 if bias is None else bias.double())
            assert got.dtype == torch.bfloat16 and got.shape == (rows, whole.shape[0])
            assert roundings.within_a_rounding(got, exact.bfloat16(), x, whole), rows
            assert (got != F.linear(x, whole, bias)).float().mean() <= 0.02
            wrong = weight_rows.gemm(x, [w * 1.02 for w in ws], biases)
            assert not roundings.within_a_rounding(wrong, exact.bfloat16(), x, whole)


def test_a_row_has_the_same_bits_at_any_row_count():
    ws, bs = _weights([200, 40], 576, seed=3)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    alone = torch.cat([weight_rows.gemm(x[i : i + 1], ws, bs) for i in range(70)])
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 70):
        assert torch.equal(weight_rows.gemm(x[:rows].contiguous(), ws, bs), alone[:rows])


def test_the_weights_are_read_where_they_lie():
    """No copy: a change to a weight in place (an optimizer step) shows in the next product."""
    ws, _ = _weights([64, 32], 96, seed=5)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(6)).bfloat16()
    before = weight_rows.gemm(x, ws)
    ws[1].mul_(-2)
    after = weight_rows.gemm(x, ws)
    assert torch.equal(after[:, :64], before[:, :64])
    assert not torch.equal(after[:, 64:], before[:, 64:])


def test_it_refuses_what_it_cannot_compute():
    ws, _ = _weights([64], 96, seed=7)
    x = torch.randn(2, 96).bfloat16()
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        weight_rows.gemm(x.float(), ws)
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        weight_rows.gemm(torch.randn(96, 4).bfloat16().T, ws)  # [4, 96], not contiguous
    with pytest.raises(RuntimeError, match="K as x's"):
        weight_rows.gemm(x, [torch.zeros(8, 95, dtype=torch.bfloat16)])
    with pytest.raises(RuntimeError, match="one bias"):
        torch.ops.paged_hf.weight_rows_gemm(x, ws, [])
    assert not weight_rows.fits(ws[0].T)
    assert not weight_rows.fits(ws[0].float())
    assert weight_rows.fits(ws[0]) and weight_rows.fits(torch.nn.Parameter(ws[0]))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3"])
def test_an_engine_on_the_weights_as_they_are_agrees_with_transformers(family):
    """``cpu_packed_weights="rows"``: no copy of any
    weight, the kernel run (counted) for prompt chunks and decodes alike, every token teacher-forced
    against transformers' own bf16 forward (qwen2's q/k/v biases, gemma2's, phi3's fused ones)."""
    model = make_tiny_model(family, dtype=torch.bfloat16)
    engine = paged_hf.Engine(model, cpu_packed_weights="rows", **SMALL)
    packed = engine.runner.packed
    assert packed.how == cpu_linear.ROWS and packed.nbytes == 0
    calls = []
    real = weight_rows.run
    prompts = tiny_prompts(model.config.vocab_size, 4, [1, 6, 19, 41], seed=5)
    try:
        cpu_linear.weight_rows.run = lambda rows, *a: calls.append(len(rows)) or real(rows, *a)
        outs = engine.generate(prompts, paged_hf.SamplingParams(max_new_tokens=8, ignore_eos=True))
    finally:
        cpu_linear.weight_rows.run = real
    assert max(calls) > 8 and min(calls) <= 4  # prompt chunks and decode steps
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 8
        assert_teacher_forced(model, prompt, out.token_ids, tol=BF16_TOL, what=f"{family}/rows")


def test_an_in_place_weight_update_reaches_the_next_step():
    """An optimizer's in-place step: the next generation is a fresh engine's on the new weights."""
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    engine = paged_hf.Engine(model, cpu_packed_weights="rows", **SMALL)
    prompts = tiny_prompts(model.config.vocab_size, 3, [5, 12, 30], seed=8)
    params = paged_hf.SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1)
    before = engine.generate(prompts, params)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-1.5)
    after = engine.generate(prompts, params)
    fresh = paged_hf.Engine(model, cpu_packed_weights="rows", **SMALL).generate(prompts, params)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    assert [o.token_ids for o in after] == [o.token_ids for o in fresh]


def test_the_way_is_asked_for():
    """``"rows"`` where asked for (not yet a default); an fp32 model keeps its fp32 copies."""
    native = cpu_linear.native_bf16()
    assert cpu_linear.mode(torch.bfloat16, torch.device("cpu")) == (
        cpu_linear.ONEDNN if native else cpu_linear.FP32
    )
    assert cpu_linear.mode(torch.bfloat16, torch.device("cpu"), "rows") == cpu_linear.ROWS
    assert cpu_linear.mode(torch.float32, torch.device("cpu")) == cpu_linear.FP32
