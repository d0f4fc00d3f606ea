"""``EngineConfig(batch_invariant=True)``: a bf16 prompt's tokens are the same bits however its KV was
had (computed whole, behind a prefix-cache hit, read from the disk tier) and whatever shares its
steps; where that cannot hold the engine refuses with the reason."""

from __future__ import annotations

import random

import pytest
import torch
from engine_state import assert_clean
from oracle import assert_teacher_forced
from tiny_models import make_arch_config, make_tiny_model
from transformers import AutoModelForCausalLM

import paged_hf
from paged_hf import SamplingParams
from paged_hf.execution.cpu import batch_invariance
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
    return cpa.available() and how is not None and batch_invariance.gemm_rows_invariant(how)


@pytest.fixture(scope="module")
def prompts():
    """Three prompts of random tokens, 280-300 long: flat next-token distributions, whose near-ties
    fork the default bf16 mode's tokens between these layouts (2 of 3 at a 272-token prefix hit)."""
    rng = random.Random(0)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in (280, 290, 300)]


def alone(model, tok, prompt, split=None, **options):
    """One prompt's tokens from a fresh engine, its first ``split`` tokens computed by an earlier call."""
    engine = paged_hf.Engine(model, tok, batch_invariant=True, **options)
    if split:
        engine.generate([prompt[:split]], SamplingParams(max_new_tokens=1))
    out = engine.generate([prompt], PARAMS)[0].token_ids
    assert_clean(engine)
    return out


@pytest.mark.slow
def test_tokens_do_not_depend_on_prefix_hits_batches_or_the_disk_tier(smollm2, prompts, tmp_path):
    model, tok = smollm2
    if not holds_here():
        with pytest.raises(ValueError, match="batch_invariant=True cannot hold"):
            paged_hf.Engine(model, tok, batch_invariant=True)
        return
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
    assert "mlp.experts" in refusal(moe) and "outside nn.Linear" in refusal(moe)
    for conflict in ({"cpu_packed_weights": False}, {"compile_decode": True}):
        with pytest.raises(ValueError, match="contradict"):
            paged_hf.EngineConfig(batch_invariant=True, **conflict)
