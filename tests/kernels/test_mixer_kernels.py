"""paged_hf's CPU gated-delta-rule kernel (paged_hf/execution/cpu/mixer_kernels.py) against
transformers' own torch fallback, and that it stands in for it only inside engine steps.

The kernel is the recurrence of ``torch_recurrent_gated_delta_rule`` (GQA heads, l2-normalised
q/k, any number of tokens) with each state read and written once: fp32 results within 2e-6 of
the fallback's (relative to the largest value), bf16 outputs within one bf16 rounding.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

import paged_hf
from paged_hf.engine.binding import patch_state
from paged_hf.execution.cpu import mixer_kernels
from paged_hf.model.support import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
assert mixer_kernels.available(), "the CPU kernels did not build"
FALLBACK = qwen.torch_recurrent_gated_delta_rule


def _inputs(b, length, hk, hv, dk, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, length, hk, dk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(b, length, hv, dv, generator=g).to(dtype)
    decay = -torch.rand(b, length, hv, generator=g) * 2  # fp32, as the mixers compute it
    beta = torch.rand(b, length, hv, generator=g).to(dtype)
    state = torch.randn(b, hv, dk, dv, generator=g)
    return q, k, v, decay, beta, state


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 1, 1, 16, 16),
        (3, 1, 2, 4, 16, 8),
        (2, 5, 2, 2, 32, 40),
        (4, 1, 3, 6, 24, 20),
        (2, 3, 1, 3, 17, 9),
    ],
)
@pytest.mark.parametrize("l2norm", [True, False])
def test_the_kernel_is_transformers_recurrence(shape, l2norm):
    q, k, v, decay, beta, state = _inputs(*shape, torch.float32)
    out, final = FALLBACK(
        q,
        k,
        v,
        g=decay,
        beta=beta,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm,
    )
    before = state.clone()
    mine, mine_final = mixer_kernels.recurrent(q, k, v, decay, beta, state, True, l2norm)
    assert _rel(mine, out) < 2e-6 and _rel(mine_final, final) < 2e-6
    assert torch.equal(state, before), "not in place: the initial state is left alone"
    # from no state, and without the final state
    out0, _ = FALLBACK(
        q, k, v, g=decay, beta=beta, initial_state=None, use_qk_l2norm_in_kernel=l2norm
    )
    mine0, none = mixer_kernels.recurrent(q, k, v, decay, beta, None, False, l2norm)
    assert none is None and _rel(mine0, out0) < 2e-6


def test_bf16_inputs_and_the_state_updated_in_place():
    q, k, v, decay, beta, state = _inputs(6, 1, 2, 4, 64, 64, torch.bfloat16, seed=3)
    out, final = FALLBACK(
        q,
        k,
        v,
        g=decay,
        beta=beta,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    mine, mine_final = mixer_kernels.recurrent(
        q, k, v, decay, beta, state, True, True, in_place=True
    )
    assert mine.dtype == torch.bfloat16 and mine_final is state, (
        "the final state is written over the initial one"
    )
    assert _rel(state, final) < 2e-6
    assert _rel(mine, out) <= 2 * torch.finfo(torch.bfloat16).eps


def test_it_stands_in_only_inside_engine_steps_on_their_thread():
    model = build_tiny_model("qwen3_5_text")
    paged_hf.patch(model)
    assert patch_state(model).state.kernels == [mixer_kernels.KIND], (
        "the probe should have checked the kernel"
    )
    engine = paged_hf.Engine(model)
    calls = mixer_kernels.calls
    engine.generate([[5, 6, 7, 8]], paged_hf.SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert mixer_kernels.calls > calls, "decode steps went through the kernel"
    assert qwen.torch_recurrent_gated_delta_rule is FALLBACK, (
        "transformers' name is given back after the step"
    )

    # while a step holds the name, another thread (a plain forward, say) still gets the fallback
    q, k, v, decay, beta, state = _inputs(2, 1, 2, 2, 16, 16, torch.float32)
    sites = mixer_kernels.sites_of(model.get_submodule(patch_state(model).state.mixers[0].path))
    assert sites == [(qwen.__name__, "torch_recurrent_gated_delta_rule")]
    seen = {}

    def elsewhere():
        seen["calls"] = mixer_kernels.calls
        seen["out"] = qwen.torch_recurrent_gated_delta_rule(
            q, k, v, g=decay, beta=beta, initial_state=state
        )[0]
        seen["after"] = mixer_kernels.calls

    with mixer_kernels.installed(sites), mixer_kernels.enabled(True, []):
        assert qwen.torch_recurrent_gated_delta_rule is not FALLBACK
        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join()
        calls = mixer_kernels.calls
        qwen.torch_recurrent_gated_delta_rule(q, k, v, g=decay, beta=beta, initial_state=state)
        assert mixer_kernels.calls == calls + 1, "this thread's call is the kernel's"
    assert seen["after"] == seen["calls"]
    assert torch.equal(seen["out"], FALLBACK(q, k, v, g=decay, beta=beta, initial_state=state)[0])
    assert qwen.torch_recurrent_gated_delta_rule is FALLBACK


def test_without_the_kernel_the_mixers_run_their_own_code(monkeypatch):
    """A model the kernel could not serve runs transformers' fallback: the same tokens."""
    reference = build_tiny_model("qwen3_5_text")
    model = build_tiny_model("qwen3_5_text")
    monkeypatch.setattr(mixer_kernels, "available", lambda: False)
    paged_hf.patch(model)
    assert patch_state(model).state.kernels == []
    calls = mixer_kernels.calls
    prompt = [3, 9, 27, 81, 11]
    out = paged_hf.Engine(model).generate(
        [prompt], paged_hf.SamplingParams(max_new_tokens=6, ignore_eos=True)
    )[0]
    assert mixer_kernels.calls == calls
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6
        )[0, len(prompt) :].tolist()
    assert out.token_ids == expected
