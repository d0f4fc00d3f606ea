"""Packed weights for the linear layers on a CPU (paged_hf/execution/cpu/linear.py). bf16 models, both
ways: oneDNN's bf16 matmul (``F.linear``'s results bit for bit; only where this CPU has it) and fp32
copies (within one bf16 rounding of ``F.linear``; runs on any CPU, the default where bf16 matmuls are
slow); fp32 models on oneDNN's fp32 matmul (within fp32 rounding). Only inside engine steps, packed
again when the weights change."""

import os
import platform

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_logprobs_close, assert_teacher_forced
from tiny_models import FAMILIES, make_tiny_model, tiny_prompts

import paged_hf
from paged_hf.execution.cpu import batch_invariance, isa
from paged_hf.execution.cpu import linear as cpu_linear

NATIVE = cpu_linear.mode(torch.bfloat16, torch.device("cpu")) == cpu_linear.ONEDNN
needs_onednn = pytest.mark.skipif(
    not NATIVE,
    reason="no bf16 oneDNN matmul on this CPU (AVX-512 bf16 / AMX): "
    "the fp32 way's tests run here instead",
)
HOWS = [pytest.param(cpu_linear.ONEDNN, marks=needs_onednn), cpu_linear.FP32]

SMALL = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8}
BF16_TOL = 0.125  # teacher forcing against transformers' bf16 forward (as tests/kernels/test_cpu_paged_attention.py)


def test_the_default_way_follows_the_cpu():
    """oneDNN's bf16 matmul where the CPU has one, else fp32 copies (the weight-rows GEMM only when
    asked for)."""
    want = cpu_linear.ONEDNN if NATIVE else cpu_linear.FP32
    assert cpu_linear.mode(torch.bfloat16, torch.device("cpu")) == want
    assert (
        paged_hf.Engine(make_tiny_model("llama", dtype=torch.bfloat16), **SMALL).runner.packed.how
        == want
    )
    if not NATIVE:
        with pytest.raises(ValueError, match="no bf16 matmul"):
            paged_hf.Engine(
                make_tiny_model("llama", dtype=torch.bfloat16), cpu_packed_weights="onednn", **SMALL
            )


def _cpuinfo_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next(
            (set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set()
        )


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not os.path.exists("/proc/cpuinfo"), reason="x86 Linux only"
)
def test_bf16_is_native_only_with_bf16_instructions():
    # torch calls bf16 supported on any AVX-512 CPU; oneDNN's bf16 matmul is only fast with these
    flags = _cpuinfo_flags()
    capped = isa.cap() is not None and isa.NAMES.index(isa.cap()) < isa.NAMES.index("avx512_bf16")
    hardware = ("avx512_bf16" in flags or "amx_bf16" in flags) and not capped
    assert cpu_linear.native_bf16() == (hardware and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if not hardware:
        assert not NATIVE


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
def test_the_onednn_weight_is_f_linear_bit_for_bit(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1536, 576, generator=g).bfloat16()
    b = torch.randn(1536, generator=g).bfloat16()
    x = torch.randn(1, rows, 576, generator=g).bfloat16()
    for bias in (None, b):  # packed for 64 rows, used at any
        packed = cpu_linear.PackedWeight(
            cpu_linear.ONEDNN, [w], None if bias is None else [bias], batch_hint=64
        )
        # [1, T, K]: the op takes its rows' view
        assert torch.equal(packed(x), F.linear(x, w, bias))
        assert torch.equal(packed(x[0]), F.linear(x[0], w, bias))


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
def test_the_fp32_weight_is_within_a_rounding_of_the_exact_product(rows):
    """Each output is the exact (float64) product rounded to bf16, the bf16 value next to it, or (a
    near-zero sum of large products) within fp32's error for its sum; and mostly ``F.linear``'s own."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1536, 576, generator=g).bfloat16()
    b = torch.randn(1536, generator=g).bfloat16()
    x = torch.randn(1, rows, 576, generator=g).bfloat16()
    for bias in (None, b):
        got = cpu_linear.PackedWeight(cpu_linear.FP32, [w], None if bias is None else [bias])(x)
        exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
        assert got.dtype == torch.bfloat16 and got.shape == (1, rows, 1536)
        assert cpu_linear.within_a_rounding(got, exact.to(torch.bfloat16), x, w)
        assert cpu_linear.one_rounding_apart(got, exact.to(torch.bfloat16)).float().mean() > 0.999
        assert (got != F.linear(x, w, bias)).float().mean() < 0.01
        wrong = cpu_linear.PackedWeight(
            cpu_linear.FP32, [w * 1.02], None if bias is None else [bias]
        )(x)
        # 2% off is caught
        assert not cpu_linear.within_a_rounding(wrong, exact.to(torch.bfloat16), x, w)


def test_one_row_of_a_bf16_model_runs_its_own_f_linear():
    """At one row the fp32 copy's bytes cost more than its math saves: the modules' bf16 F.linear runs,
    a fused group's too (each module's, side by side)."""
    g = torch.Generator().manual_seed(9)
    ws = [torch.randn(n, 64, generator=g).bfloat16() for n in (96, 32, 32)]
    bs = [torch.randn(n, generator=g).bfloat16() for n in (96, 32, 32)]
    x = torch.randn(1, 1, 64, generator=g).bfloat16()
    fused = cpu_linear.PackedWeight(cpu_linear.FP32, ws, bs)
    assert torch.equal(fused(x), torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs)], dim=-1))
    two = torch.randn(1, 2, 64, generator=g).bfloat16()  # from two rows on, the fp32 copy
    assert torch.equal(
        fused(two),
        torch.ops.mkldnn._linear_pointwise(
            two.float(), fused.packed, fused.bias, "none", [], ""
        ).bfloat16(),
    )


def test_one_rounding_is_measured_in_bf16_steps():
    one = torch.tensor([1.0, -1.0, 0.0, 3.0], dtype=torch.bfloat16)
    # each the next bf16 value
    up = torch.tensor([1.0078125, -1.0078125, 1e-40, 3.015625], dtype=torch.bfloat16)
    assert (
        cpu_linear.one_rounding_apart(one, up).all()
        and cpu_linear.one_rounding_apart(up, one).all()
    )
    two = torch.tensor([1.015625, -1.015625, 2e-40, 3.03125], dtype=torch.bfloat16)
    assert not cpu_linear.one_rounding_apart(one, two).any()
    assert cpu_linear.one_rounding_apart(
        torch.tensor([0.0], dtype=torch.bfloat16), torch.tensor([-0.0], dtype=torch.bfloat16)
    ).all()


def _run(model, prompts, packed, **kw):
    engine = paged_hf.Engine(model, cpu_packed_weights=packed, **SMALL, **kw)
    assert (engine.runner.packed is not None) == (packed is not False)
    params = paged_hf.SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3)
    return engine, engine.generate(prompts, params)


@needs_onednn
# GPT-2's Conv1D is no nn.Linear
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt2"])
def test_engine_outputs_are_identical_with_and_without_onednn_weights(family):
    model = make_tiny_model(family, dtype=torch.bfloat16)
    prompts = tiny_prompts(model.config.vocab_size, 4, [1, 6, 19, 41], seed=5)
    # oneDNN's own GEMMs at every row count (the few-row kernel is within a rounding of them:
    # tests/kernels/test_small_rows_gemm.py)
    engine, with_packed = _run(model, prompts, packed="onednn", cpu_small_row_gemm=False)
    assert len(engine.runner.packed.modules) >= 4 * model.config.num_hidden_layers
    # untouched outside a step
    assert all("forward" not in m.__dict__ for m in engine.runner.packed.modules)
    _, without = _run(model, prompts, packed=False)
    for a, b in zip(with_packed, without):
        assert a.token_ids == b.token_ids
        # bit for bit, not within a tolerance
        assert a.completions[0].logprobs == b.completions[0].logprobs


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt2"])
def test_engine_on_fp32_weights_agrees_with_transformers(family):
    """The fp32 way, on any CPU: every token teacher-forced against transformers' own bf16 forward."""
    model = make_tiny_model(family, dtype=torch.bfloat16)
    prompts = tiny_prompts(model.config.vocab_size, 4, [1, 6, 19, 41], seed=5)
    engine, outs = _run(model, prompts, packed="fp32")
    assert engine.runner.packed.how == cpu_linear.FP32
    assert len(engine.runner.packed.modules) >= 4 * model.config.num_hidden_layers
    # untouched outside a step
    assert all("forward" not in m.__dict__ for m in engine.runner.packed.modules)
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 8
        assert_teacher_forced(
            model, prompt, out.token_ids, tol=BF16_TOL, what=f"{family}/fp32 weights"
        )


@pytest.mark.parametrize("how", HOWS)
def test_a_weight_update_is_packed_again(how):
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    prompts = tiny_prompts(model.config.vocab_size, 2, [7, 12], seed=6)
    engine, before = _run(model, prompts, packed=how)
    with torch.no_grad():
        for m in engine.runner.packed.modules:
            m.weight.mul_(-1.5)  # an optimizer step's kind of write: the version counter moves
    params = paged_hf.SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3)
    after = engine.generate(prompts, params)
    # packed afresh
    reference = paged_hf.Engine(model, cpu_packed_weights=how, **SMALL).generate(prompts, params)
    assert [o.completions[0].logprobs for o in after] == [
        o.completions[0].logprobs for o in reference
    ]
    assert [o.completions[0].logprobs for o in after] != [o.completions[0].logprobs for o in before]
    # packed again with its fused groups, their bit-for-bit check not made again (one entry per group)
    assert engine.runner.packed.fused and len(engine.runner.packed._fusable) == len(
        engine.runner.packed.siblings
    )


def test_an_fp32_model_runs_on_packed_fp32_weights_within_fp32_rounding():
    """fp32 models: oneDNN's fp32 matmul on packed weights (MKL's F.linear reorders each call), the
    same sums in another order: every token and logprob is transformers' within the fp32 tolerances."""
    model = make_tiny_model("qwen2")  # q/k/v biases
    engine = paged_hf.Engine(model, **SMALL)
    assert (
        engine.runner.packed.how == cpu_linear.FP32 and engine.runner.packed.dtype == torch.float32
    )
    prompts = tiny_prompts(model.config.vocab_size, 4, [1, 6, 19, 41], seed=5)
    outs = engine.generate(
        prompts, paged_hf.SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3)
    )
    assert len(engine.runner.packed.fused) == 2 * model.config.num_hidden_layers
    for prompt, out in zip(prompts, outs):
        assert_teacher_forced(model, prompt, out.token_ids, what="fp32 model, packed")
        assert_logprobs_close(
            model, prompt, out.token_ids, out.completions[0].logprobs, what="fp32 model, packed"
        )
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(960, 576, generator=g), torch.randn(960, generator=g)
    x = torch.randn(1, 300, 576, generator=g)
    got = cpu_linear.PackedWeight(cpu_linear.FP32, [w], [b])(x)
    exact = x.double() @ w.double().T + b.double()
    assert (
        got.dtype == torch.float32 and (got.double() - exact).abs().max() < 1e-5 * exact.abs().max()
    )
    for rows in (1, 5, 17):  # a row's result does not depend on the rows beside it
        assert torch.equal(
            cpu_linear.PackedWeight(cpu_linear.FP32, [w], [b])(x[:, :rows].contiguous()),
            got[:, :rows],
        )


def test_the_option_off_and_odd_dtypes_keep_f_linear():
    assert not cpu_linear.supported(torch.float64, torch.device("cpu"))
    assert (
        paged_hf.Engine(make_tiny_model("llama", dtype=torch.float64), **SMALL).runner.packed
        is None
    )
    assert (
        paged_hf.Engine(make_tiny_model("llama"), cpu_packed_weights=False, **SMALL).runner.packed
        is None
    )
    with pytest.raises(ValueError, match="cpu_packed_weights"):
        paged_hf.Engine(make_tiny_model("llama", dtype=torch.bfloat16), cpu_packed_weights="yes")
    with pytest.raises(ValueError, match="fp32"):
        paged_hf.Engine(make_tiny_model("llama"), cpu_packed_weights="onednn")  # an fp32 model
    with pytest.raises(ValueError, match="how="):
        cpu_linear.PackedLinears(make_tiny_model("llama", dtype=torch.bfloat16), "bf16")


@pytest.mark.parametrize("how", HOWS)
def test_no_second_copy_of_weights_that_would_crowd_memory(how, monkeypatch, caplog):
    ok, _ = cpu_linear.affordable(1 << 20)
    assert ok
    ok, why = cpu_linear.affordable(1 << 50)  # a petabyte of weights
    assert not ok and "quarter" in why
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    packed = cpu_linear.PackedLinears(model, how, torch.bfloat16)
    assert packed.nbytes == sum(m.weight.numel() for m in packed.modules) * (
        4 if how == cpu_linear.FP32 else 2
    )
    prompts = tiny_prompts(model.config.vocab_size, 2, [7, 12], seed=7)
    params = paged_hf.SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=3)
    reference = paged_hf.Engine(model, cpu_packed_weights=False, **SMALL).generate(prompts, params)
    monkeypatch.setattr(cpu_linear.os, "sysconf", lambda name: 1)  # one byte of memory available
    with caplog.at_level("WARNING", logger="paged_hf"):
        engine = paged_hf.Engine(model, cpu_packed_weights=how, **SMALL)
    assert engine.runner.packed is None
    assert "not packed" in caplog.text and "quarter" in caplog.text
    assert [o.completions[0].logprobs for o in engine.generate(prompts, params)] == [
        o.completions[0].logprobs for o in reference
    ]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3"])
def test_fused_projections_are_found_and_give_the_same_tokens(family, how):
    """q/k/v and gate/up (the siblings one forward calls on the same input) run as one GEMM in a step:
    found by the probe forward, and the engine's outputs are bit for bit those without fusion."""
    model = make_tiny_model(family, dtype=torch.bfloat16)
    prompts = tiny_prompts(model.config.vocab_size, 4, [3, 9, 17, 30], seed=2)
    fused = paged_hf.Engine(model, cpu_packed_weights=how, **SMALL)
    groups = fused.runner.packed.siblings
    widths = sorted({len(g) for g in groups})
    if family == "phi3":  # already one qkv_proj and one gate_up_proj: nothing to fuse
        assert groups == []
    else:
        assert widths == [2, 3] and len(groups) == 2 * model.config.num_hidden_layers, [
            len(g) for g in groups
        ]
    params = paged_hf.SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2)
    with_fused = fused.generate(prompts, params)
    assert len(fused.runner.packed.fused) == len(groups), "every group's fused GEMM was exact here"
    assert all("forward" not in m.__dict__ for m in fused.runner.packed.modules)
    plain = paged_hf.Engine(model, cpu_packed_weights=how, cpu_fused_projections=False, **SMALL)
    assert plain.runner.packed.siblings == []
    for a, b in zip(with_fused, plain.generate(prompts, params)):
        assert a.token_ids == b.token_ids and a.completions[0].logprobs == b.completions[0].logprobs


def test_a_fused_group_lets_go_of_its_output_once_every_sibling_took_its_slice():
    """The fused q/k/v and gate/up outputs are dropped as soon as each module got its slice: one layer's
    output is not held to the end of the step (30 layers x 12 MiB of gate/up at 2,048 tokens were, each a
    fresh block faulted in). A sibling called again on the same input gets a fresh product."""
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    engine = paged_hf.Engine(model, **SMALL)
    packed = engine.runner.packed
    held = []
    original = cpu_linear.PackedWeight.__call__

    def watch(self, x):  # after each GEMM of the step: how many groups still hold an output
        out = original(self, x)
        held.append(sum(s.out is not None for s in packed._states))
        return out

    cpu_linear.PackedWeight.__call__ = watch
    try:
        engine.generate(
            tiny_prompts(model.config.vocab_size, 2, [5, 9], seed=1),
            paged_hf.SamplingParams(max_new_tokens=3, ignore_eos=True),
        )
    finally:
        cpu_linear.PackedWeight.__call__ = original
    assert packed._states and held and max(held) <= 1, held  # the one being sliced, at most
    state = packed._states[0]
    x = torch.randn(1, 3, model.config.hidden_size).bfloat16()
    with packed.active():
        q = packed.fused[0][0](x)
        assert state.out is not None
        again = packed.fused[0][0](x)  # before its siblings: computed again, not the kept slice
        rest = [m(x) for m in packed.fused[0][1:]]
        assert state.out is None and torch.equal(q, again)
        assert torch.equal(torch.cat([q, *rest], dim=-1), state.packed(x))


@pytest.mark.parametrize("how", HOWS)
def test_row_invariant_packing_gives_a_row_the_same_bits_at_any_row_count(how):
    """``row_invariant=True`` (batch_invariant): each row of SmolLM2's gate/up shape is the same bits
    whether it came in 1, 5, 17, 40 or 90 rows and wherever among them, and one bf16 rounding from
    ``F.linear``. Where the engine's own check finds this machine's oneDNN otherwise, the engine
    refuses batch_invariant instead."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(3072, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(90, 576, generator=g).bfloat16()
    spans = [(89, 90), (3, 8), (10, 27), (1, 41), (0, 90), (40, 90)]

    def mismatches(weight):
        whole = weight(x)
        return sum(not torch.equal(weight(x[lo:hi].contiguous()), whole[lo:hi]) for lo, hi in spans)

    invariant = cpu_linear.PackedWeight(how, [w], None, row_invariant=True)
    assert cpu_linear.within_a_rounding(invariant(x), F.linear(x, w), x, w)
    if batch_invariance.gemm_rows_invariant(how):
        assert mismatches(invariant) == 0
    else:
        model = make_tiny_model("llama", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="sums rows by row count|bf16 path"):
            paged_hf.Engine(model, batch_invariant=True, cpu_packed_weights=how)
