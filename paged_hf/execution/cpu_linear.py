"""Prepacked oneDNN weights for the model's linear layers, during engine steps on a CPU (bf16).

A bf16 ``F.linear`` on a CPU already runs oneDNN's matmul, but it reorders the weight into
oneDNN's blocked layout on every call. For the few rows of a decode step that reorder is a large
part of the call (SmolLM2-135M, 1 thread: a 1536x576 weight at 8 rows 0.44 -> 0.23 ms, at 64
rows 1.29 -> 1.10 ms; the lm_head at 8 rows 19 -> 10 ms). ``PackedLinears`` reorders each
weight once (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing does) and,
for the duration of one engine forward only, points each ``nn.Linear`` at
``torch.ops.mkldnn._linear_pointwise`` over that copy: the same oneDNN kernel on the same
blocked weight, so the results are bit-identical to ``F.linear`` (checked here once per
process and in tests/test_cpu_linear.py). Outside a step the model is untouched; ``unpatch``
has nothing to undo.

Fused projections: linears that one forward calls on the same input tensor (an attention block's
q, k and v; a gated MLP's gate and up), found by one probe forward when the engine is built, run as
one GEMM over their concatenated packed weights; the first of them called on an input computes
all of them, the others take their slice (fewer, wider GEMMs at decode batch sizes). A group is
fused only where the fused GEMM gives each module's own packed result bit for bit (checked when it
is packed); the modules' parameters are untouched.

Costs and limits: one packed copy of each weight (the model's linear weights again in memory),
made on the first step and made again when the weights change (the engine drops the copies
whenever it resets its prefix cache: a weight update it sees, or ``reset_prefix_cache``).
Inputs the packed path might compute differently (not contiguous, another dtype) and modules
whose ``forward`` was replaced go through the module as usual.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.nn.functional as F

_EXACT: dict[str, bool] = {}


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether packed weights can serve this model: bf16 on a CPU whose oneDNN does bf16, and
    the packed op gives exactly ``F.linear``'s results here (checked once per process)."""
    if dtype != torch.bfloat16 or device.type != "cpu" or os.environ.get("PAGED_HF_PACKED_LINEAR", "1") == "0":
        return False
    if "bf16" not in _EXACT:
        _EXACT["bf16"] = _check_exact()
    return _EXACT["bf16"]


def affordable(nbytes: int) -> tuple[bool, str]:
    """Whether a second copy of ``nbytes`` of weights fits: at most a quarter of the memory
    available now (a 7B model in bf16 would need ~13 GiB more). Returns (ok, why not)."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf here: do not risk it
        return False, "the memory available could not be read"
    if nbytes <= available // 4:
        return True, ""
    return False, (f"the packed copy ({nbytes / 2**30:.1f} GiB) would take more than a quarter of the "
                   f"{available / 2**30:.1f} GiB of memory available")


def _check_exact() -> bool:
    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        g = torch.Generator().manual_seed(0)
        w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
        b = torch.randn(96, generator=g).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        for rows in (1, 7, 40):
            x = torch.randn(1, rows, 64, generator=g).to(torch.bfloat16)
            for bias in (None, b):
                if not torch.equal(_packed_linear(x, packed, bias), F.linear(x, w, bias)):
                    return False
        return True
    except (RuntimeError, AttributeError):  # no mkldnn ops in this torch build
        return False


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def find_siblings(model: torch.nn.Module, modules: list[torch.nn.Linear]) -> list[list[torch.nn.Linear]]:
    """Groups of ``modules`` that a forward of a few tokens calls on the very same input tensor, each
    module once, in call order, with one input width and biases all or none."""
    calls: list[tuple[torch.nn.Module, torch.Tensor]] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: calls.append((mod, args[0]))) for m in modules]
    try:
        vocab = model.config.get_text_config().vocab_size
        with torch.inference_mode():
            model(input_ids=torch.arange(3, 9)[None] % vocab, use_cache=False)
    except Exception:  # noqa: BLE001 - a model this forward does not suit: nothing is fused
        return []
    finally:
        for h in hooks:
            h.remove()
    times: dict[torch.nn.Module, int] = {}
    for mod, _ in calls:
        times[mod] = times.get(mod, 0) + 1
    groups: list[tuple[torch.Tensor, list]] = []
    for mod, x in calls:
        for seen, members in groups:
            if seen is x:
                members.append(mod)
                break
        else:
            groups.append((x, [mod]))
    out = []
    for _, members in groups:
        if len(members) > 1 and all(times[m] == 1 for m in members) \
                and len({m.in_features for m in members}) == 1 and len({m.bias is None for m in members}) == 1:
            out.append(members)
    return out


class PackedLinears:
    """The model's ``nn.Linear`` modules with 2-D bf16 CPU weights, packed on first use; siblings
    (``find_siblings``) fused into one GEMM when ``fuse``."""

    def __init__(self, model: torch.nn.Module, batch_hint: int = 64, fuse: bool = True) -> None:
        self.modules = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in m.__dict__
                        and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"
                        and m.weight.dim() == 2]
        self.batch_hint = batch_hint
        self.nbytes = sum(m.weight.numel() * m.weight.element_size() for m in self.modules)
        self.siblings = find_siblings(model, self.modules) if fuse else []
        self.fused: list[list[torch.nn.Linear]] = []  # the sibling groups packed as one GEMM
        self._states: list[_FusedState] = []
        self._forwards: list | None = None

    def reset(self) -> None:
        """Forget the packed copies (the weights changed); the next step packs them again."""
        self._forwards = None

    def _pack(self) -> list:
        forwards, packed = [], {}
        for m in self.modules:
            with torch.no_grad():
                packed[m] = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), self.batch_hint)
        fused: dict[torch.nn.Module, object] = {}
        self.fused, self._states = [], []
        for group in self.siblings:
            state = self._fuse(group, packed)
            if state is not None:
                self.fused.append(group)
                self._states.append(state)
                for i, m in enumerate(group):
                    fused[m] = _fused_forward_for(m, state, i)
        for m in self.modules:
            forwards.append((m, fused.get(m) or _forward_for(m, packed[m])))
        return forwards

    def _fuse(self, group: list[torch.nn.Linear], packed: dict) -> "_FusedState | None":
        """One packed GEMM for ``group``, if it gives each module's own packed result bit for bit."""
        with torch.no_grad():
            weight = torch.cat([m.weight.detach() for m in group])
            bias = None if group[0].bias is None else torch.cat([m.bias.detach() for m in group])
            if bias is not None and bias.dtype != torch.bfloat16:
                return None
            state = _FusedState(torch.ops.mkldnn._reorder_linear_weight(weight, self.batch_hint), bias,
                                [m.weight for m in group], [m.out_features for m in group])
            g = torch.Generator().manual_seed(0)
            for rows in (1, 5, 40):
                x = torch.randn(1, rows, group[0].in_features, generator=g).to(torch.bfloat16)
                whole = _packed_linear(x, state.packed, state.bias)
                parts = [_packed_linear(x, packed[m], m.bias) for m in group]
                if not torch.equal(whole, torch.cat(parts, dim=-1)):
                    return None
        return state

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Point every module at its packed weight for the duration of the block."""
        if self._forwards is None:
            self._forwards = self._pack()
        installed = []
        try:
            for m, fwd in self._forwards:
                if "forward" not in m.__dict__:
                    m.forward = fwd
                    installed.append(m)
            yield
        finally:
            for m in installed:
                del m.forward
            for state in self._states:  # no step's activations kept past it
                state.x = state.out = None


class _FusedState:
    """A sibling group's packed concatenated weight, and the last input it computed with its output."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, weights: list, widths: list[int]) -> None:
        self.packed, self.bias, self.weights = packed, bias, weights
        self.bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
        self.x: torch.Tensor | None = None
        self.out: torch.Tensor | None = None


def _fused_forward_for(module: torch.nn.Linear, state: _FusedState, i: int):
    lo, hi = state.bounds[i], state.bounds[i + 1]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or module.weight is not state.weights[i]:
            return F.linear(x, module.weight, module.bias)
        if x is not state.x:  # the first sibling called on this input computes them all
            state.out = _packed_linear(x, state.packed, state.bias)
            state.x = x
        return state.out[..., lo:hi]

    return forward


def _forward_for(module: torch.nn.Linear, packed: torch.Tensor):
    weight = module.weight

    def forward(x: torch.Tensor) -> torch.Tensor:
        bias = module.bias
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or module.weight is not weight \
                or (bias is not None and bias.dtype != torch.bfloat16):
            return F.linear(x, module.weight, bias)
        return _packed_linear(x, packed, bias)

    return forward
