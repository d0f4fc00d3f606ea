"""Fused element-wise ops on the CPU step: RMSNorm, a gated MLP's SiLU-and-multiply, rotary embedding.

Design notes: docs/internals.md, paged_hf/execution/cpu/fused_ops.py.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
from typing import Any, Callable, Iterator

import torch

from . import kernel_seams

logger = logging.getLogger("paged_hf")

ROPE_NAME = "apply_rotary_pos_emb"
ROPE_PARAMS = ("q", "k", "cos", "sin")
EPS_ATTRS = ("variance_epsilon", "eps")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the C++ ops take


def available() -> bool:
    from . import ops

    return ops.load()


class FusedOps:
    """The model's RMSNorms, gated MLPs and rotary-embedding functions that the fused ops serve,
    checked on the model when built (``head_dim``: the attention layers' width, for the rotary check)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, head_dim: int | None) -> None:
        self.dtype = dtype
        self.norms: list[tuple[torch.nn.Module, bool]] = []  # (module, gemma-style)
        self.mlps: list[torch.nn.Module] = []
        self.rope_sites: list[kernel_seams.Site] = []
        # (module's __dict__, its fused forward), made on first use
        self._forwards: list | None = None
        if dtype not in DTYPES:
            return
        for module in model.modules():
            if "forward" in module.__dict__:  # replaced by someone else: leave it to them
                continue
            if _looks_like_rms_norm(module):
                style = _checked(_norm_style, module, dtype)
                if style is not None:
                    self.norms.append((module, style))
            elif _looks_like_gated_mlp(module) and _checked(_mlp_matches, module, dtype):
                self.mlps.append(module)
        # the rotary widths a step hands the rotary functions (cos's last dimension): where every
        # site checks out at each of them, the compact layers may call the op directly
        self.rope_widths: frozenset[int] = frozenset()
        if head_dim is not None and head_dim % 2 == 0:
            widths = _rotary_widths(model, head_dim)
            sites = {
                site
                for m in model.modules()
                for site in kernel_seams.functions_named(m, ROPE_NAME, ROPE_PARAMS)
            }
            self.rope_sites = sorted(
                site
                for site in sites
                if all(_rope_matches(site, dtype, head_dim, w) for w in widths)
            )
            self.rope_widths = frozenset(widths) if self.rope_sites else frozenset()

    def describe(self) -> str:
        return f"{len(self.norms)} RMSNorms, {len(self.mlps)} gated MLPs, {len(self.rope_sites)} rotary functions"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self._forwards is None:
            self._forwards = [
                (module.__dict__, functools.partial(_norm_forward, module, gemma, self.dtype))
                for module, gemma in self.norms
            ]
            self._forwards += [
                (module.__dict__, functools.partial(_mlp_forward, module, self.dtype))
                for module in self.mlps
            ]
        installed = []
        with kernel_seams.installed(self.rope_sites, _rope), kernel_seams.switch("rotary", True):
            try:
                # the instance dict directly (nn.Module's __setattr__ checks cost ~1.5 us a module a step)
                for d, fwd in self._forwards:
                    if "forward" not in d:  # replaced by someone since: theirs runs
                        d["forward"] = fwd
                        installed.append(d)
                yield
            finally:
                for d in installed:
                    del d["forward"]


def _checked(check: Callable, module: torch.nn.Module, dtype: torch.dtype) -> Any:
    """``check(module, dtype)``, or None where the module's own code raised on the check's input
    (its own code serves it then)."""
    try:
        return check(module, dtype)
    except Exception as e:  # noqa: BLE001
        logger.debug(
            "paged_hf: %s is left to its own code: %s: %s",
            type(module).__name__,
            type(e).__name__,
            e,
        )
        return None


# ---- RMSNorm ----------------------------------------------------------------------------------
def _eps(module: torch.nn.Module) -> float | None:
    for name in EPS_ATTRS:
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _one_input(module: torch.nn.Module) -> bool:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (
        params[0].POSITIONAL_ONLY,
        params[0].POSITIONAL_OR_KEYWORD,
    )


def _looks_like_rms_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.lower().endswith("rmsnorm")
        and isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 1
        and _eps(module) is not None
        and _one_input(module)
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=x.dtype)
    torch.ops.paged_hf.rms_norm(rows, weight, eps, gemma, out)
    return out.view(x.shape)


def _norm_forward(
    module: torch.nn.Module, gemma: bool, dtype: torch.dtype, hidden_states: torch.Tensor
) -> torch.Tensor:
    weight = module.weight
    if (
        hidden_states.dtype != dtype
        or hidden_states.device.type != "cpu"
        or hidden_states.stride(-1) != 1
        or (not gemma and weight.dtype != dtype)
    ):
        return type(module).forward(module, hidden_states)
    return _rms_norm(hidden_states, weight.detach(), _eps(module), gemma)


def _norm_style(module: torch.nn.Module, dtype: torch.dtype) -> bool | None:
    """gemma-style (True), llama-style (False) or neither (None): which gives the module's outputs,
    with its own weight and with a random one (a weight of ones, as at init, would let ``2x`` pass
    for gemma-style's ``(1 + w) x``)."""
    weight = module.weight
    if weight.device.type != "cpu" or not weight.dtype.is_floating_point:
        return None
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(11, weight.shape[0], generator=g) * 3).to(dtype)
    x[0] *= 1e-3  # a small row and a large one
    x[1] *= 50
    other = copy.deepcopy(module)
    with torch.no_grad():
        other.weight.copy_(torch.randn(weight.shape, generator=g))
        for gemma in (False, True):
            if not gemma and weight.dtype != dtype:
                continue
            if all(
                _close(_rms_norm(x, m.weight.detach(), _eps(m), gemma), type(m).forward(m, x))
                for m in (module, other)
            ):
                return gemma
    return None


# ---- gated MLP ----------------------------------------------------------------------------------
def _looks_like_gated_mlp(module: torch.nn.Module) -> bool:
    return (
        all(
            isinstance(getattr(module, n, None), torch.nn.Linear)
            for n in ("gate_proj", "up_proj", "down_proj")
        )
        and isinstance(getattr(module, "act_fn", None), torch.nn.Module)
        and _one_input(module)
    )


def _silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate, up))
    width = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype)
    torch.ops.paged_hf.silu_and_mul(
        gate.reshape(-1, width), up.reshape(-1, width), out.view(-1, width)
    )
    return out


def _mlp_forward(module: torch.nn.Module, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != dtype or x.device.type != "cpu":
        return type(module).forward(module, x)
    return module.down_proj(_silu_and_mul(module.gate_proj(x), module.up_proj(x)))


def _mlp_matches(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    linear = module.gate_proj
    if linear.weight.device.type != "cpu" or linear.weight.dtype != dtype:
        return False
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 5, linear.in_features, generator=g).to(dtype)
    with torch.no_grad():
        expected = type(module).forward(module, x)
        return expected.shape == (1, 5, module.down_proj.out_features) and _close(
            _mlp_forward(module, dtype, x), expected
        )


# ---- rotary embedding ---------------------------------------------------------------------------
# rotary function -> the (head dim, rotated width: cos's last dimension) pairs at which it was
# checked to give the op's outputs (a width checked whole on one model is not checked as a part of a
# wider head on another)
_checked_widths: dict[Callable, set[tuple[int, int]]] = {}


def _rope(original: Callable) -> Callable:
    def apply_rotary_pos_emb(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if not (
            kernel_seams.setting("rotary")
            and not args
            and kwargs.get("unsqueeze_dim", 1) == 1
            and set(kwargs) <= {"unsqueeze_dim"}
            and _rope_fits(q, k, cos, sin)
            and (q.shape[-1], cos.shape[-1]) in _checked_widths.get(original, ())
        ):
            return original(q, k, cos, sin, *args, **kwargs)
        return _rotary(q, k, cos, sin)

    apply_rotary_pos_emb.__wrapped__ = original
    return apply_rotary_pos_emb


def _rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_hf::rotary`` on q and k (inputs ``_rope_fits`` took)."""
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    torch.ops.paged_hf.rotary(q, cos, sin, q_out)
    torch.ops.paged_hf.rotary(k, cos, sin, k_out)
    return q_out, k_out


def _rope_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    tensors = (q, k, cos, sin)
    if any(
        not isinstance(t, torch.Tensor)
        or t.device.type != "cpu"
        or t.dtype != q.dtype
        or t.stride(-1) != 1
        for t in tensors
    ):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    b, _, length, width = q.shape
    rotated = cos.shape[-1]
    return (
        k.shape[0] == b
        and k.shape[2:] == q.shape[2:]
        and tuple(cos.shape) == (b, length, rotated)
        and rotated <= width
        and rotated % 2 == 0
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def _rotary_widths(model: torch.nn.Module, head_dim: int) -> set[int]:
    """The widths of the cos / sin the model's rotary embeddings make (two per inverse frequency),
    and the full head: the widths to check the rotary functions at."""
    widths = {head_dim}
    for module in model.modules():
        if "rotary" in type(module).__name__.lower():
            widths.update(
                2 * buf.numel()
                for name, buf in module.named_buffers(recurse=False)
                if name.endswith("inv_freq")
                and "original" not in name
                and 0 < 2 * buf.numel() <= head_dim
            )
    return widths


def _rope_inputs(
    dtype: torch.dtype, head_dim: int, width: int, fused: bool, g: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """q, k, cos, sin as a step hands them: q and k transposed views of [1, T, heads, D], each its
    own projection's or (``fused``) side by side in one projection's rows; cos and sin [1, T, width]."""
    t, q_heads, k_heads = 7, 4, 2
    if fused:
        qk = torch.randn(1, t, (q_heads + k_heads + k_heads) * head_dim, generator=g).to(dtype)
        q = qk[..., : q_heads * head_dim].view(1, t, q_heads, head_dim)
        k = qk[..., q_heads * head_dim : (q_heads + k_heads) * head_dim].view(
            1, t, k_heads, head_dim
        )
    else:
        q = torch.randn(1, t, q_heads, head_dim, generator=g).to(dtype)
        k = torch.randn(1, t, k_heads, head_dim, generator=g).to(dtype)
    cos, sin = (torch.randn(1, t, width, generator=g).to(dtype) for _ in range(2))
    return q.transpose(1, 2), k.transpose(1, 2), cos, sin


def _rope_matches(site: kernel_seams.Site, dtype: torch.dtype, head_dim: int, width: int) -> bool:
    """The function at ``site`` gives the fused op's outputs at rotary ``width`` on inputs laid out
    as a step's (``_rope_inputs``); recorded for the function's wrapper."""
    import sys

    original = getattr(sys.modules[site[0]], site[1])
    g = torch.Generator().manual_seed(2)
    for fused in (False, True):
        q, k, cos, sin = _rope_inputs(dtype, head_dim, width, fused, g)
        try:
            with torch.no_grad():
                expected = original(q, k, cos, sin)
                got = _rotary(q, k, cos, sin) if _rope_fits(q, k, cos, sin) else None
        except Exception as e:  # noqa: BLE001 - another signature or math: its own code serves it
            logger.debug(
                "paged_hf: %s.%s is not served by the fused rotary op at width %d: %s",
                *site,
                width,
                e,
            )
            return False
        if got is None or not (
            isinstance(expected, tuple)
            and len(expected) == 2
            and all(isinstance(e, torch.Tensor) and _close(a, e) for a, e in zip(got, expected))
        ):
            return False
    _checked_widths.setdefault(original, set()).add((head_dim, width))
    return True


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal within one rounding of the dtype (an fp32 sum in another order, an exp's last bit)."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if expected.dtype == torch.float32:  # relative to the largest value: sums of rounded terms
        return float((got - expected).abs().max()) <= 1e-5 * float(
            expected.abs().max().clamp(min=1e-30)
        )
    return torch.allclose(
        got.float(), expected.float(), rtol=2 * torch.finfo(expected.dtype).eps, atol=1e-6
    )
