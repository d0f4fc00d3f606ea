"""Pre-norm decoder layers as one compact function each, during engine steps on a CPU.

Design notes: docs/internals.md, paged_hf/execution/cpu/compact_layers.py.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from .. import attention
from .fused_ops import FusedOps, _eps, _rms_norm, _rotary, _silu_and_mul
from .linear import PackedLinears, PackedWeight

logger = logging.getLogger("paged_hf")
# hooks every module runs (torch.nn.modules.module.register_module_forward_hook): where torch keeps
# them elsewhere, say there are some (the layers run their own code)
_global_hooks = getattr(torch.nn.modules.module, "_has_any_global_hook", lambda: True)


class _Plan:
    """One layer's modules and what its compact forward calls (``weights``: None until packed)."""

    def __init__(
        self, layer: torch.nn.Module, dtype: torch.dtype, rope_widths: frozenset[int]
    ) -> None:
        self.layer, self.dtype, self.rope_widths = layer, dtype, rope_widths
        attn, mlp = layer.self_attn, layer.mlp
        self.attn, self.mlp = attn, mlp
        self.norm_1, self.norm_2 = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.gate_up = [mlp.gate_proj, mlp.up_proj]
        self.head_dim = attn.head_dim
        widths = [m.out_features for m in self.qkv]
        self.q_end, self.k_end = widths[0], widths[0] + widths[1]
        self.modules = list(layer.modules())
        self.eps_1, self.eps_2 = _eps(self.norm_1), _eps(self.norm_2)
        self.intermediate = mlp.gate_proj.out_features
        # (scaling, sliding_window, softcap): what its own code passed attention
        self.call: tuple | None = None
        # made from the packed set (CompactLayers._refresh): q/k/v, o, gate/up and down's packed weights,
        # the norms' weights
        self.weights: tuple[PackedWeight | None, ...] | None = None
        self.norm_1_weight = self.norm_2_weight = None
        # up to how many rows every GEMM runs on the few-row kernel, so the halves around attention
        # run as one C++ call each (csrc/compact_rows.cpp); 0: never
        self.few_rows = 0
        stock = type(layer).forward.__get__(layer)
        self.forward = lambda *a, **k: _forward(self, stock, *a, **k)  # installed during steps

    def ready(self) -> bool:
        """Whether every GEMM it calls is packed (so in the current packed set)."""
        return self.weights is not None and None not in self.weights

    def hooked(self) -> bool:
        # forward hooks only: backward hooks do nothing under inference mode, where steps run
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)


def _structure(
    layer: torch.nn.Module,
    dtype: torch.dtype,
    norms: set[int],
    mlps: set[int],
    groups: set[tuple[int, ...]],
    rope_files: set[str],
    rope_widths: frozenset[int],
) -> _Plan | None:
    """A plan for ``layer`` where its parts are the ones the compact forward calls, else None."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    n1, n2 = (
        getattr(layer, "input_layernorm", None),
        getattr(layer, "post_attention_layernorm", None),
    )
    if (
        attn is None
        or mlp is None
        or id(mlp) not in mlps
        or id(n1) not in norms
        or id(n2) not in norms
    ):
        return None
    # its rotary function: the fused op's, as in its own steps
    if type(attn).__module__ not in rope_files:
        return None
    if not all(
        isinstance(getattr(attn, n, None), torch.nn.Linear)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj")
    ):
        return None
    if not isinstance(getattr(attn, "head_dim", None), int) or not isinstance(
        getattr(attn, "scaling", None), float
    ):
        return None
    if (
        tuple(map(id, (attn.q_proj, attn.k_proj, attn.v_proj))) not in groups
        or tuple(map(id, (mlp.gate_proj, mlp.up_proj))) not in groups
    ):
        return None
    return _Plan(layer, dtype, rope_widths)


def _forward(
    plan: _Plan,
    stock: Any,
    hidden_states: torch.Tensor,
    *args: Any,
    attention_mask: Any = None,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The layer's step: its own code's ops and calls, made directly (docs/internals.md)."""
    if (
        args
        or attention_mask is not None
        or not _rope_checked(plan, position_embeddings)
        or hidden_states.dim() != 3
        or hidden_states.shape[0] != 1
        or hidden_states.dtype != plan.dtype
        or not hidden_states.is_contiguous()
    ):
        return stock(
            hidden_states,
            *args,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            **kwargs,
        )
    if 0 < hidden_states.shape[1] <= plan.few_rows:
        return _forward_few_rows(plan, hidden_states, position_embeddings)
    qkv_w, o_w, gate_up_w, down_w = plan.weights
    shape = (*hidden_states.shape[:-1], -1, plan.head_dim)
    x = _rms_norm(hidden_states, plan.norm_1_weight, plan.eps_1, False)
    qkv = qkv_w(x)
    q = qkv[..., : plan.q_end].view(shape).transpose(1, 2)
    k = qkv[..., plan.q_end : plan.k_end].view(shape).transpose(1, 2)
    v = qkv[..., plan.k_end :].view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    q_out, k_out = _rotary(q, k, cos, sin)
    scaling, window, softcap = plan.call
    out, _ = attention.paged_attention_forward(
        plan.attn, q_out, k_out, v, None, scaling=scaling, sliding_window=window, softcap=softcap
    )
    h = hidden_states + o_w(out.reshape(*hidden_states.shape[:-1], -1).contiguous())
    gate_up = gate_up_w(_rms_norm(h, plan.norm_2_weight, plan.eps_2, False))
    width = plan.intermediate
    return h + down_w(_silu_and_mul(gate_up[..., :width], gate_up[..., width:]))


def _forward_few_rows(
    plan: _Plan, hidden_states: torch.Tensor, position_embeddings: tuple
) -> torch.Tensor:
    """``_forward``'s ops, the same in the same order, with each half around attention one call."""
    qkv, o, gate_up, down = (w.small for w in plan.weights)
    hidden = hidden_states[0]
    cos, sin = position_embeddings
    q, k, v = torch.ops.paged_hf.small_rows_attn_in(
        hidden, plan.norm_1_weight, plan.eps_1, qkv.packed, qkv.bias, qkv.out_features,
        plan.q_end, plan.k_end, plan.head_dim, cos, sin,
    )  # fmt: skip
    scaling, window, softcap = plan.call
    out, _ = attention.paged_attention_forward(
        plan.attn, q, k, v, None, scaling=scaling, sliding_window=window, softcap=softcap
    )
    return torch.ops.paged_hf.small_rows_mlp_out(
        out[0], hidden, o.packed, o.bias, plan.norm_2_weight, plan.eps_2,
        gate_up.packed, gate_up.bias, plan.intermediate, down.packed, down.bias,
    ).view(hidden_states.shape)  # fmt: skip


def _rope_checked(plan: _Plan, position_embeddings: Any) -> bool:
    """cos and sin of a width the rotary op was checked at (partial rotary: less than the head)."""
    if not isinstance(position_embeddings, tuple) or len(position_embeddings) != 2:
        return False
    cos = position_embeddings[0]
    return (
        isinstance(cos, torch.Tensor)
        and cos.dim() == 3
        and cos.shape[-1] in plan.rope_widths
        and cos.dtype == plan.dtype
    )


def _few_rows(weights: tuple) -> int:
    """Rows up to which every one of a layer's GEMMs runs on the few-row kernel (0: not all do; a
    weight without the kernel's copy serves 0 rows on it)."""
    if None in weights or not hasattr(torch.ops.paged_hf, "small_rows_mlp_out"):
        return 0
    return min(w.small_rows for w in weights)


class _Recorder:
    """Attention during the check: records each call (its q, k, v and arguments) and answers with
    plain causal attention, so that what follows it in the layer is checked too."""

    def __init__(self, layout: Any) -> None:
        self.layout = layout
        self.calls: list = []

    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.calls.append(
            (
                layer_idx,
                scaling,
                sliding_window,
                softcap,
                sinks is None,
                query.clone(),
                key.clone(),
                value.clone(),
            )
        )
        groups = query.shape[1] // key.shape[1]
        k, v = (t.float().repeat_interleave(groups, dim=1) for t in (key, value))
        scores = query.float() @ k.transpose(-1, -2) * (scaling or query.shape[-1] ** -0.5)
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return (scores.softmax(-1) @ v).to(query.dtype).transpose(1, 2)


def _same_calls(a: list, b: list) -> bool:
    return (
        len(a) == len(b) == 1
        and a[0][:5] == b[0][:5]
        and a[0][4]
        and all(torch.equal(x, y) for x, y in zip(a[0][5:], b[0][5:]))
    )


class CompactLayers:
    """The model's decoder layers that run compactly in CPU steps (checked on the model when built)."""

    def __init__(
        self, model: torch.nn.Module, fused: FusedOps, packed: PackedLinears, layout: Any
    ) -> None:
        self.fused, self.packed = fused, packed
        self.plans: list[_Plan] = []
        self._packed_forwards: Any = None  # the packed linears' set the plans' weights come from
        if not fused.rope_sites:
            return
        norms = {id(m) for m, gemma in fused.norms if not gemma}
        mlps = {id(m) for m in fused.mlps}
        rope_files = {site[0] for site in fused.rope_sites}
        groups = {tuple(map(id, g)) for g in packed.siblings}
        candidates = [
            _structure(m, fused.dtype, norms, mlps, groups, rope_files, fused.rope_widths)
            for m in model.modules()
        ]
        if any(candidates):
            self.plans = self._checked([p for p in candidates if p], layout)

    def _refresh(self) -> None:
        """The plans' packed weights and norm weights (taken again when the packed set is made again)."""
        if self._packed_forwards is self.packed._forwards:
            return
        for p in self.plans:
            p.weights = (
                self.packed.weight_for(p.qkv),
                self.packed.weight_for([p.attn.o_proj]),
                self.packed.weight_for(p.gate_up),
                self.packed.weight_for([p.mlp.down_proj]),
            )
            p.norm_1_weight, p.norm_2_weight = p.norm_1.weight.detach(), p.norm_2.weight.detach()
            p.few_rows = _few_rows(p.weights)
        self._packed_forwards = self.packed._forwards

    def _checked(self, candidates: list[_Plan], layout: Any) -> list[_Plan]:
        recorder = _Recorder(layout)
        g = torch.Generator().manual_seed(3)
        kept = []
        with (
            torch.inference_mode(),
            attention.active_backend(recorder),
            self.packed.active(),
            self.fused.active(),
        ):
            self.plans = candidates
            self._refresh()
            for p in candidates:
                try:
                    if self._matches(p, recorder, g):
                        kept.append(p)
                except Exception as e:  # noqa: BLE001 - another signature: its own code serves it
                    logger.debug(
                        "paged_hf: %s runs its own code: %s: %s",
                        type(p.layer).__name__,
                        type(e).__name__,
                        e,
                    )
        self._packed_forwards = None  # made again on the first step
        return kept

    def _matches(self, p: _Plan, recorder: _Recorder, g: torch.Generator) -> bool:
        hidden = p.norm_1.weight.shape[0]
        if p.hooked() or not p.ready():
            return False
        for width in sorted(p.rope_widths):  # each rotary width a step may hand it
            x = (torch.randn(1, 7, hidden, generator=g) * 2).to(p.dtype)
            cos, sin = (torch.randn(1, 7, width, generator=g).to(p.dtype) for _ in range(2))
            kwargs = dict(
                attention_mask=None,
                position_ids=torch.arange(3, 10)[None],
                position_embeddings=(cos, sin),
            )
            recorder.calls = []
            expected = p.layer(x, **kwargs)
            own = recorder.calls
            if (
                not isinstance(expected, torch.Tensor)
                or len(own) != 1
                or own[0][1:4] != (p.call or own[0][1:4])
            ):
                return False
            p.call = own[0][1:4]
            recorder.calls = []
            got = _forward(p, None, x, **kwargs)
            if not (
                expected.shape == got.shape
                and torch.equal(got, expected)
                and _same_calls(own, recorder.calls)
            ):
                return False
        return bool(p.rope_widths)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside the packed linears' and fused ops' ``active``: each served layer, unless hooked now or
        replaced by someone, runs compactly for the block."""
        self._refresh()
        installed = []
        try:
            for p in self.plans if not _global_hooks() else ():
                d = p.layer.__dict__
                if "forward" not in d and p.ready() and not p.hooked():
                    d["forward"] = p.forward
                    installed.append(d)
            yield
        finally:
            for d in installed:
                del d["forward"]
