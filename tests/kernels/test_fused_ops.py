"""The CPU step's fused element-wise ops (paged_hf/execution/cpu/fused_ops.py, csrc/fused_ops.cpp)
against transformers' own modules and functions, and where the engine uses them.

RMSNorm (llama- and gemma-style), SiLU-and-multiply on slices of one GEMM's output, and the
rotary embedding on q / k as the attention modules hand them over (transposed views): bf16
outputs bit-identical to the modules' (RMSNorm: but for an fp32 sum taken in another order, one
bf16 step on a rare element), fp32 within 1e-5 of the largest value. A module or function whose
math differs is left to its own code.
"""

from __future__ import annotations

import sys

import pytest
import torch
from tiny_models import make_tiny_model, tiny_prompts
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.glm4_moe import modeling_glm4_moe as glm4_moe
from transformers.models.llama import modeling_llama as llama

import paged_hf
from paged_hf.execution.cpu import fused_ops

pytestmark = pytest.mark.usefixtures("one_thread")
assert fused_ops.available(), "the CPU kernels did not build"
DTYPES = [torch.float32, torch.bfloat16]


def _agree(got: torch.Tensor, expected: torch.Tensor, rare: float = 0.0) -> None:
    """fp32: within 1e-5 of the largest value. bf16: bit-identical, but for a ``rare`` share of
    elements one bf16 step apart."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if got.dtype == torch.float32:
        assert float((got - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
        return
    apart = got != expected
    assert float(apart.float().mean()) <= rare, f"{int(apart.sum())} of {got.numel()} differ"
    step = torch.finfo(got.dtype).eps * expected.float().abs()
    assert bool(((got.float() - expected.float()).abs() <= step + 1e-30).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 64, 37])
def test_rms_norm_is_the_modules(dtype, width):
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(2, 19, width, generator=g) * 4).to(dtype)
    for module, gemma in (
        (llama.LlamaRMSNorm(width, eps=1e-5), False),
        (Gemma3RMSNorm(width, eps=1e-6), True),
    ):
        module = module.to(dtype)
        module.weight.data = torch.randn(width, generator=g).to(dtype)
        assert fused_ops._norm_style(module, dtype) is gemma
        with torch.no_grad():
            _agree(fused_ops._norm_forward(module, gemma, dtype, x), module(x), rare=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_on_slices_of_one_gemm(dtype):
    g = torch.Generator().manual_seed(3)
    # gate and up side by side, as fused
    both = (torch.randn(1, 13, 2 * 96, generator=g) * 3).to(dtype)
    gate, up = both[..., :96], both[..., 96:]
    _agree(fused_ops._silu_and_mul(gate, up), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 16, 10])
def test_rotary_is_llamas_on_the_attention_modules_views(dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    # view(...).transpose(1, 2)
    q = torch.randn(1, 11, 6, head_dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, 11, 2, head_dim, generator=g).to(dtype).transpose(1, 2)
    cos, sin = (torch.randn(1, 11, head_dim, generator=g).to(dtype) for _ in range(2))
    expected = llama.apply_rotary_pos_emb(q, k, cos, sin)
    for a, b in zip(fused_ops._rotary(q, k, cos, sin), expected):
        assert torch.equal(a, b) and a.stride() == b.stride()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 16])
def test_partial_rotary_is_glm4_moes_on_a_fused_projections_views(dtype, head_dim):
    """GLM-4-MoE rotates the first part of each head (partial_rotary_factor) and passes the rest
    through: the op does the same at every width, on q and k as views of one projection's rows, and
    the wrapper serves exactly the widths it was checked at. Llama's function, which cannot take a
    partial cos, is not served at one."""
    site = (glm4_moe.__name__, "apply_rotary_pos_emb")
    original = glm4_moe.apply_rotary_pos_emb
    g = torch.Generator().manual_seed(head_dim)
    for width in (head_dim, head_dim // 2, 4):
        assert fused_ops._rope_matches(site, dtype, head_dim, width)
        q, k, cos, sin = fused_ops._rope_inputs(dtype, head_dim, width, True, g)
        expected = original(q, k, cos, sin)
        with fused_ops.kernel_seams.switch("rotary", True):
            wrapped = fused_ops._rope(original)(q, k, cos, sin)
        for got in (fused_ops._rotary(q, k, cos, sin), wrapped):
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert fused_ops._checked_widths[original] >= {
        (head_dim, w) for w in (head_dim, head_dim // 2, 4)
    }
    assert not fused_ops._rope_matches(
        (llama.__name__, "apply_rotary_pos_emb"), dtype, head_dim, head_dim // 2
    )
    checked = fused_ops._checked_widths.get(llama.apply_rotary_pos_emb, ())
    assert (head_dim, head_dim // 2) not in checked


def test_other_math_is_left_to_its_own_code():
    class ScaledRMSNorm(llama.LlamaRMSNorm):  # an RMSNorm that does something else
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    class GeluMLP(llama.LlamaMLP):
        pass

    assert fused_ops._norm_style(ScaledRMSNorm(32), torch.float32) is None
    config = make_tiny_model("llama").config
    config.hidden_act = "gelu"
    assert not fused_ops._mlp_matches(GeluMLP(config), torch.float32)
    # a call the op does not take goes to the original
    with fused_ops.kernel_seams.switch("rotary", True):
        q = torch.randn(1, 5, 2, 8)  # [B, T, H, D]: unsqueeze_dim=2
        cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
        expected = llama.apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=2)
        got = fused_ops._rope(llama.apply_rotary_pos_emb)(q, q, cos, sin, unsqueeze_dim=2)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_the_engine_finds_what_it_checked_and_leaves_the_model_as_it_was(family):
    """Per layer: two RMSNorms (Qwen3: four, with its q/k norms; Gemma 3: six, gemma-style) and a
    gated SiLU MLP (Gemma 3's is GELU's: left alone); the final norm; one rotary function."""
    model = make_tiny_model(family)
    layers = model.config.num_hidden_layers
    norms, mlps = {
        "llama": (2 * layers + 1, layers),
        "qwen3": (4 * layers + 1, layers),
        "gemma3_text": (6 * layers + 1, 0),
    }[family]
    engine = paged_hf.Engine(model)
    found = engine.runner.fused_ops
    assert (len(found.norms), len(found.mlps), len(found.rope_sites)) == (norms, mlps, 1), (
        found.describe()
    )
    assert all(gemma == (family == "gemma3_text") for _, gemma in found.norms)
    prompts = tiny_prompts(model.config.vocab_size, 3, [5, 12, 30], seed=4)
    fused = engine.generate(
        prompts, paged_hf.SamplingParams(max_new_tokens=8, logprobs=1, ignore_eos=True)
    )
    plain = paged_hf.Engine(model, cpu_fused_ops=False).generate(
        prompts, paged_hf.SamplingParams(max_new_tokens=8, logprobs=1, ignore_eos=True)
    )
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        assert (
            max(
                abs(x[0] - y[0])
                for x, y in zip(a.completions[0].logprobs, b.completions[0].logprobs)
            )
            < 1e-4
        )
    assert not any("forward" in m.__dict__ for m in model.modules()), (
        "a module kept a step's forward"
    )
    module, name = found.rope_sites[0]
    assert "__wrapped__" not in vars(getattr(sys.modules[module], name)), (
        "transformers' function is given back"
    )


def test_a_dtype_the_ops_do_not_take_is_left_to_the_modules():
    model = make_tiny_model("llama").double()
    engine = paged_hf.Engine(model)
    assert engine.runner.fused_ops.describe() == "0 RMSNorms, 0 gated MLPs, 0 rotary functions"
    out = engine.generate([[5, 6, 7]], paged_hf.SamplingParams(max_new_tokens=3, ignore_eos=True))[
        0
    ]
    assert out.error is None and len(out.token_ids) == 3


def _attention_families() -> dict[str, list[str]]:
    """The support sweep's causal-LM types grouped by attention family: types whose attention
    modules' ``forward`` and modeling file's rotary function have the same source are one family."""
    import hashlib
    import inspect

    from paged_hf.model import support

    families: dict[str, list[str]] = {}
    for model_type in support.causal_lm_types():
        try:
            model = support.build_tiny_model(model_type)
        except Exception:  # noqa: BLE001 - no tiny model: not in the sweep either
            continue
        attention = sorted(
            {type(m) for m in model.modules() if type(m).__name__.endswith("Attention")},
            key=lambda c: c.__name__,
        )
        rope = getattr(sys.modules[type(model).__module__], fused_ops.ROPE_NAME, None)
        sources = [inspect.getsource(c.forward) for c in attention] + [
            inspect.getsource(rope) if rope else ""
        ]
        families.setdefault(hashlib.sha1("".join(sources).encode()).hexdigest(), []).append(
            model_type
        )
    return families


@pytest.mark.slow
def test_every_attention_family_of_the_sweep_gives_the_same_step_with_the_fused_ops_on_and_off():
    """One representative of each attention family that patch takes: its prompts' prefill and a
    decode step with the fused ops (and the compact layers) on give the tokens and logprobs of the
    engine with them off (fp32, 1e-4). A fused op the check approved must never fail in a step."""
    import warnings

    from paged_hf.model import support
    from paged_hf.model.capability import UnsupportedModelError

    params = paged_hf.SamplingParams(max_new_tokens=2, logprobs=5, ignore_eos=True)
    ran, served, problems = [], {"rotary": 0, "compact": 0}, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for members in _attention_families().values():
            model = support.build_tiny_model(members[0])
            try:
                paged_hf.patch(model)
            except UnsupportedModelError:
                continue
            prompts = support.prompt_ids(model)
            fused_engine = paged_hf.Engine(model)
            found = fused_engine.runner.fused_ops
            served["rotary"] += bool(found and found.rope_sites)
            served["compact"] += bool(
                fused_engine.runner.compact and fused_engine.runner.compact.plans
            )
            fused = fused_engine.generate(prompts, params)
            plain = paged_hf.Engine(model, cpu_fused_ops=False).generate(prompts, params)
            ran.append(members[0])
            for a, b in zip(fused, plain):
                if a.error or b.error or a.token_ids != b.token_ids:
                    problems.append(
                        f"{members}: {a.error or b.error or (a.token_ids, b.token_ids)}"
                    )
                    break
                gap = max(
                    abs(x[0] - y[0])
                    for x, y in zip(a.completions[0].logprobs, b.completions[0].logprobs)
                )
                if gap > 1e-4:
                    problems.append(f"{members}: logprobs {gap:.2e} apart")
                    break
    assert not problems, problems
    assert len(ran) >= 60 and served["rotary"] >= 30 and served["compact"] >= 5, (len(ran), served)
