"""The few-row bf16 GEMM (paged_hf/execution/cpu/small_rows.py): its products against the exact ones,
its row invariance, where PackedWeight takes it, and an engine's tokens on it
teacher-forced against transformers. The kernel is built for AVX-512 bf16 CPUs: its own tests run
there and are reported skipped elsewhere (naming the CPU); that nothing takes it where it is not
built is tested on such CPUs and reported skipped here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cpu_isa import lacks, needs
from oracle import assert_teacher_forced
from tiny_models import make_tiny_model, tiny_prompts

import paged_hf
from paged_hf.execution.cpu import isa, small_rows
from paged_hf.execution.cpu import linear as cpu_linear

HERE = small_rows.available()
KERNEL = needs("avx512_bf16", "the few-row bf16 GEMM (vdpbf16ps)")
NATIVE = cpu_linear.mode(torch.bfloat16, torch.device("cpu")) == cpu_linear.ONEDNN
SMALL = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8}
BF16_TOL = 0.125  # teacher forcing against transformers' bf16 forward (as test_cpu_linear.py)


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.1).bfloat16(), torch.randn(n, generator=g).bfloat16()


@lacks("avx512_bf16", "a CPU without the few-row kernel")
def test_where_the_kernel_is_not_built_nothing_takes_it():
    """A weight asked to take it does not, on either way this CPU has (the fp32 way never does;
    oneDNN's where the kernel is not built), and an engine's packed set says so."""
    assert not HERE
    w, _ = _weights(64, 64, seed=0)
    for how in (cpu_linear.ONEDNN,) * NATIVE + (cpu_linear.FP32,):
        weight = cpu_linear.PackedWeight(how, [w], None, small=True)
        assert weight.small is None and weight.small_rows == 0
    assert not _engine(make_tiny_model("llama", dtype=torch.bfloat16)).runner.packed.small


def test_the_kernel_serves_wherever_the_cpu_builds_it():
    """An AVX-512 bf16 CPU builds it, and a built kernel serves: one that fails its own check
    against F.linear (``available``) is a bug in it, not a limit of the machine, and would
    otherwise only turn the kernel off unseen."""
    from paged_hf.execution.cpu import ops

    built = ops.load() and isa.at_least("avx512_bf16")
    assert small_rows._built() == built
    assert small_rows.available() == built


@KERNEL
@pytest.mark.parametrize("n,k", [(70, 98), (1536, 576), (96, 1538)])
def test_the_kernel_is_within_a_rounding_of_the_exact_product(n, k):
    """Every output the exact (float64) product rounded to bf16 or the bf16 value next to it (or, a
    near-zero sum of large products, within fp32's error for its sum); nearly all F.linear's own;
    and a weight 2% off is caught by the same measure."""
    w, b = _weights(n, k, seed=n + k)
    g = torch.Generator().manual_seed(1)
    for bias in (None, b):
        weight = small_rows.SmallRowsWeight(w, bias)
        for rows in (*range(1, 10), 16, 23, 64):
            x = torch.randn(rows, k, generator=g).bfloat16()
            got = weight(x)
            exact = (x.double() @ w.double().T + (0 if bias is None else bias.double())).bfloat16()
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            assert cpu_linear.within_a_rounding(got, exact, x, w), (rows, bias is None)
            assert (got != F.linear(x, w, bias)).float().mean() < 0.01
            wrong = small_rows.SmallRowsWeight(w * 1.02, bias)(x)
            assert not cpu_linear.within_a_rounding(wrong, exact, x, w)


@KERNEL
def test_a_row_has_the_same_bits_at_any_row_count():
    w, b = _weights(200, 576, seed=3)
    weight = small_rows.SmallRowsWeight(w, b)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    alone = torch.cat([weight(x[i : i + 1]) for i in range(70)])
    for rows in (*range(2, 18), 31, 64, 70):
        assert torch.equal(weight(x[:rows].contiguous()), alone[:rows])


@KERNEL
def test_the_kernel_refuses_what_it_cannot_compute():
    w, _ = _weights(64, 96, seed=5)
    weight = small_rows.SmallRowsWeight(w, None)
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        weight(torch.zeros(9, 192, dtype=torch.bfloat16)[:, ::2])
    with pytest.raises(RuntimeError, match="does not match"):
        weight(torch.zeros(2, 94, dtype=torch.bfloat16))
    assert not small_rows.fits(torch.zeros(4, 7, dtype=torch.bfloat16))  # K odd
    assert not small_rows.fits(torch.zeros(4, 8))  # fp32


@KERNEL
@pytest.mark.parametrize("row_invariant", [False, True])
def test_a_packed_weight_takes_the_kernel_up_to_its_rows_only(row_invariant):
    """Up to ``max_rows()`` rows on the kernel (512; 8 beside AMX), more on oneDNN (F.linear's
    bits); never where packed row-invariant (batch_invariant=True: a row's bits must not follow
    its step's row count)."""
    ws = [_weights(n, 576, seed=n)[0] for n in (576, 192, 192)]  # a q/k/v group
    packed = cpu_linear.PackedWeight(
        cpu_linear.ONEDNN, ws, None, row_invariant=row_invariant, small=True
    )
    assert (packed.small is not None) == (HERE and not row_invariant)
    most = small_rows.max_rows()
    assert most == (8 if isa.at_least("amx") else 512)
    g = torch.Generator().manual_seed(6)
    whole = torch.cat(ws)
    for rows in (1, 5, 8, 9, most, most + 1, 300):
        x = torch.randn(1, rows, 576, generator=g).bfloat16()
        got = packed(x)
        if packed.small is not None and rows <= most:
            assert torch.equal(got[0], packed.small(x[0]))
        elif not row_invariant:
            assert torch.equal(got, F.linear(x, whole))
        assert cpu_linear.within_a_rounding(got, F.linear(x, whole), x, whole)


def _engine(model, **kw):
    return paged_hf.Engine(model, cpu_packed_weights="onednn" if NATIVE else True, **SMALL, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3"])
def test_engine_tokens_on_the_kernel_agree_with_transformers(family):
    """bf16 models' decodes (1-4 rows a step here) on the kernel: every token teacher-forced against
    transformers' own bf16 forward, and the kernel did run (counted)."""
    model = make_tiny_model(family, dtype=torch.bfloat16)
    engine = _engine(model)
    packed = engine.runner.packed
    assert packed.small == (HERE and NATIVE)
    calls = []
    if packed.small:
        real = small_rows.SmallRowsWeight.__call__
        small_rows.SmallRowsWeight.__call__ = lambda self, rows: calls.append(1) or real(self, rows)
    try:
        prompts = tiny_prompts(model.config.vocab_size, 4, [1, 6, 19, 41], seed=5)
        outs = engine.generate(prompts, paged_hf.SamplingParams(max_new_tokens=8, ignore_eos=True))
    finally:
        if packed.small:
            small_rows.SmallRowsWeight.__call__ = real
    assert bool(calls) == packed.small
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 8
        assert_teacher_forced(
            model, prompt, out.token_ids, tol=BF16_TOL, what=f"{family}/small rows"
        )


@KERNEL
def test_without_onednn_s_copy_rows_past_the_kernel_run_the_modules_own_f_linear():
    """Memory for one copy: the kernel's, and past its rows each module's own F.linear (oneDNN's
    results, checked per process), no oneDNN copy made."""
    ws = [_weights(n, 576, seed=n)[0] for n in (576, 192, 192)]
    packed = cpu_linear.PackedWeight(cpu_linear.ONEDNN, ws, None, small=True, onednn=False)
    assert packed.packed is None and packed.small is not None
    g = torch.Generator().manual_seed(8)
    for rows in (1, 8, packed.small_rows, packed.small_rows + 1):
        x = torch.randn(1, rows, 576, generator=g).bfloat16()
        own = torch.cat([F.linear(x, w) for w in ws], dim=-1)
        if rows <= packed.small_rows:
            assert torch.equal(packed(x)[0], packed.small(x[0]))
        else:
            assert torch.equal(packed(x), own)


@KERNEL
def test_the_option_off_keeps_onednn_and_memory_for_one_copy_keeps_one(monkeypatch, caplog):
    """Room for both copies: both. For one: the kernel's where it serves a step's whole default
    budget (no AMX), else oneDNN's; the tokens teacher-forced either way."""
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    assert not _engine(model, cpu_small_row_gemm=False).runner.packed.small
    both = _engine(model).runner.packed
    assert both.small and both.onednn
    one_copy = sum(m.weight.numel() * 2 for m in both.modules)
    assert both.nbytes == 2 * one_copy
    monkeypatch.setattr(cpu_linear, "affordable", lambda nbytes: (nbytes <= one_copy, "short"))
    with caplog.at_level("WARNING", logger="paged_hf"):
        engine = _engine(model)
    packed = engine.runner.packed
    assert packed is not None and packed.nbytes == one_copy
    assert (packed.small, packed.onednn) == (
        (True, False) if small_rows.max_rows() == small_rows.ROWS else (False, True)
    )
    assert "not packed" not in caplog.text
    prompts = tiny_prompts(model.config.vocab_size, 3, [5, 30, 70], seed=9)
    params = paged_hf.SamplingParams(max_new_tokens=6, ignore_eos=True)
    for prompt, out in zip(prompts, engine.generate(prompts, params)):
        assert_teacher_forced(model, prompt, out.token_ids, tol=BF16_TOL, what="one copy")
    with pytest.raises(ValueError, match="cpu_small_row_gemm"):
        paged_hf.Engine(model, cpu_small_row_gemm="yes")
