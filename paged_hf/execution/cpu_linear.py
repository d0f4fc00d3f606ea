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


class PackedLinears:
    """The model's ``nn.Linear`` modules with 2-D bf16 CPU weights, packed on first use."""

    def __init__(self, model: torch.nn.Module, batch_hint: int = 64) -> None:
        self.modules = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in m.__dict__
                        and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"
                        and m.weight.dim() == 2]
        self.batch_hint = batch_hint
        self.nbytes = sum(m.weight.numel() * m.weight.element_size() for m in self.modules)
        self._forwards: list | None = None

    def reset(self) -> None:
        """Forget the packed copies (the weights changed); the next step packs them again."""
        self._forwards = None

    def _pack(self) -> list:
        forwards = []
        for m in self.modules:
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), self.batch_hint)
            forwards.append((m, _forward_for(m, packed)))
        return forwards

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


def _forward_for(module: torch.nn.Linear, packed: torch.Tensor):
    weight = module.weight

    def forward(x: torch.Tensor) -> torch.Tensor:
        bias = module.bias
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or module.weight is not weight \
                or (bias is not None and bias.dtype != torch.bfloat16):
            return F.linear(x, module.weight, bias)
        return _packed_linear(x, packed, bias)

    return forward
