"""``EngineConfig(batch_invariant=True)``: a bf16 prompt's tokens, greedy or seeded samples, are the
same bits however its KV was had (computed whole, behind a prefix-cache hit, read from the disk
tier) and whatever shares its steps; where that cannot hold the engine refuses with the reason."""

from __future__ import annotations

import random

import pytest
import torch
from engine_state import assert_clean
from oracle import assert_teacher_forced
from tiny_models import make_arch_config, make_config, make_tiny_model, tiny_prompts
from transformers import AutoModelForCausalLM

import paged_hf
from paged_hf import SamplingParams
from paged_hf.execution.cpu import batch_invariance, isa, small_rows
from paged_hf.execution.cpu import linear as cpu_linear
from paged_hf.execution.cpu import paged_attention as cpa
from paged_hf.model.tiny_configs import build_model

# teacher forcing against transformers' bf16 forward: random-token prompts have near-ties, where
# bf16 roundings alone move logits by ~0.25 (garbage from a wrong row would trail by logits)
BF16_TOL = 0.5
SPLITS = (272, 256, 200)  # prefix lengths computed first: their tails then run alone
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


def holds_here() -> bool:
    """Whether this machine has what batch invariance takes (the CPU attention kernel's bf16 path, a
    row-invariant packed GEMM); where it does not, the tests check the refusal instead."""
    how = cpu_linear.mode(torch.bfloat16, torch.device("cpu"))
    bf16_path = cpa.available() and isa.at_least("avx512")  # the kernel's bf16 path is AVX-512's
    return bf16_path and how is not None and batch_invariance.gemm_rows_invariant(how)


@pytest.fixture(scope="module")
def prompts():
    """Three prompts of random tokens, 280-300 long: flat next-token distributions, whose near-ties
    fork the default bf16 mode's tokens between these layouts (2 of 3 at a 272-token prefix hit)."""
    rng = random.Random(0)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in (280, 290, 300)]


WHY_NOT = (
    "batch_invariant=True cannot hold on this CPU (no attention kernel bf16 path, no bf16 oneDNN "
    "GEMM, or a GEMM that is not row-invariant at 16 and 32 rows)"
)


@pytest.mark.slow
def test_it_is_refused_on_a_machine_where_it_cannot_hold(smollm2):
    if holds_here():
        pytest.skip("it holds on this CPU: the tokens are checked instead")
    with pytest.raises(ValueError, match="batch_invariant=True cannot hold"):
        paged_hf.Engine(*smollm2, batch_invariant=True)


def alone(model, tok, prompt, split=None, params=PARAMS, **options):
    """One prompt's tokens from a fresh engine, its first ``split`` tokens computed by an earlier call."""
    engine = paged_hf.Engine(model, tok, batch_invariant=True, **options)
    if split:
        engine.generate([prompt[:split]], SamplingParams(max_new_tokens=1))
    out = engine.generate([prompt], params)[0].token_ids
    assert_clean(engine)
    return out


@pytest.mark.slow
def test_tokens_do_not_depend_on_prefix_hits_batches_or_the_disk_tier(smollm2, prompts, tmp_path):
    model, tok = smollm2
    if not holds_here():
        pytest.skip(f"{WHY_NOT}: the refusal is checked instead")
    whole = [alone(model, tok, p) for p in prompts]
    for p, want in zip(prompts, whole):
        assert_teacher_forced(model, p, want, tol=BF16_TOL, what="batch_invariant, whole")
        for split in SPLITS:
            assert alone(model, tok, p, split) == want, f"prefix hit of {split} tokens"
    # all three in one call (their prompts and decodes in shared steps), with a small budget
    engine = paged_hf.Engine(model, tok, batch_invariant=True, max_num_batched_tokens=96)
    together = [o.token_ids for o in engine.generate(prompts, PARAMS)]
    assert together == whole
    # a second engine reading the first one's records from disk (it computes only each tail)
    for _ in range(2):
        engine = paged_hf.Engine(model, tok, batch_invariant=True, kv_cache_dir=str(tmp_path))
        assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == whole
        engine.flush_kv_tiers()
    assert engine.stats()["kv_tiers"]["disk"]["hit_tokens"] > 3 * 250
    # seeded sampling (issue 72): the same logits' bits and each row's own random stream, so the
    # same samples behind a prefix hit and in a shared call
    sampled = PARAMS.with_(temperature=1.0, seed=3)
    want = [alone(model, tok, p, params=sampled) for p in prompts]
    assert want != whole
    assert alone(model, tok, prompts[0], SPLITS[0], params=sampled) == want[0]
    engine = paged_hf.Engine(model, tok, batch_invariant=True, max_num_batched_tokens=96)
    assert [o.token_ids for o in engine.generate(prompts, sampled)] == want


def row_count_gemm(real):
    """oneDNN's GEMM as it sums on some CPUs (an Intel Xeon with AMX: a row of an 18-row prompt tail
    and the same row in a 450-row prompt differ by a rounding), exaggerated so that it forks greedy
    tokens on any machine: alike at 16 and 32 rows (as there), scaled by the row count otherwise."""

    def gemm(rows, packed, bias):
        out = real(rows, packed, bias)
        n = rows.shape[0]
        return out if n in (16, 32) else out * (1 + 0.02 * (1 + n % 7))

    return gemm


def tokens_by_layout(model, prompts, **options) -> list[list[list[int]]]:
    """Each prompt's tokens computed whole, behind a 16- and a 32-token prefix hit, and all
    prompts in one call sharing steps under a small token budget."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    layouts = []
    for split in (None, 16, 32):
        outs = []
        for p in prompts:
            engine = paged_hf.Engine(model, **options)
            if split:
                engine.generate([p[:split]], SamplingParams(max_new_tokens=1))
            outs.append(engine.generate([p], params)[0].token_ids)
        layouts.append(outs)
    engine = paged_hf.Engine(model, max_num_batched_tokens=24, **options)
    layouts.append([o.token_ids for o in engine.generate(prompts, params)])
    assert_clean(engine)
    return layouts


def test_a_gemm_that_sums_by_row_count_forks_the_default_mode_and_not_the_invariant_one(
    monkeypatch,
):
    """The machine's own GEMM may sum alike at every row count (AMD Zen 4 does, on SmolLM2's
    prompts), so the test above may pass with the row-invariant GEMM turned off; one that does not
    stands in for it here: the default mode's tokens fork between layouts where oneDNN computes them,
    the invariant mode's do not. Steps of up to ``small_rows.max_rows()`` rows run on paged_hf's
    own few-row GEMM by default, which sums a row alike at any row count: there they do not fork
    either."""
    if (
        not holds_here()
        or cpu_linear.mode(torch.bfloat16, torch.device("cpu")) != cpu_linear.ONEDNN
    ):
        pytest.skip("needs oneDNN's bf16 GEMM and the attention kernel's bf16 path on this CPU")
    config = make_config("llama")
    config.head_dim = 32  # the attention kernel's bf16 path
    model = build_model(config, AutoModelForCausalLM, dtype=torch.bfloat16)
    prompts = tiny_prompts(config.vocab_size, 3, [40, 45, 50], seed=7)
    monkeypatch.setattr(cpu_linear, "onednn_gemm", row_count_gemm(cpu_linear.onednn_gemm))
    default = tokens_by_layout(model, prompts, cpu_small_row_gemm=False)
    assert any(layout != default[0] for layout in default[1:]), "the stand-in forks nothing"
    if small_rows.available() and small_rows.max_rows() >= 64:  # every step here is under 64 rows
        few_rows = tokens_by_layout(model, prompts)
        assert all(layout == few_rows[0] for layout in few_rows[1:])
    invariant = tokens_by_layout(model, prompts, batch_invariant=True)
    assert all(layout == invariant[0] for layout in invariant[1:])


def refusal(model, **options) -> str:
    with pytest.raises(ValueError) as e:
        paged_hf.Engine(model, batch_invariant=True, **options)
    return str(e.value)


def test_it_is_refused_where_it_cannot_hold():
    bf16 = make_tiny_model("llama", dtype=torch.bfloat16)  # head dim 16: not the kernel's bf16 path
    assert "bf16 path" in refusal(bf16)
    assert "bf16 only" in refusal(make_tiny_model("llama"))
    config = make_arch_config("qwen3_moe")
    config.head_dim = 32  # the kernel's bf16 path: what is left is the experts' matrices
    moe = build_model(config, AutoModelForCausalLM, dtype=torch.bfloat16)
    if isa.at_least("avx512"):
        assert "mlp.experts" in refusal(moe) and "outside nn.Linear" in refusal(moe)
    else:  # the kernel's bf16 path is AVX-512's: that is refused first (an AVX2 CPU's reason)
        assert "bf16 path" in refusal(moe)
    for conflict in ({"cpu_packed_weights": False}, {"compile_decode": True}):
        with pytest.raises(ValueError, match="contradict"):
            paged_hf.EngineConfig(batch_invariant=True, **conflict)
