"""Packed weights for the model's linear layers, during engine steps on a CPU.

Design notes: docs/internals.md, paged_hf/execution/cpu/linear.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
from typing import Iterator

import torch
import torch.nn.functional as F

from ...cache.coherence import is_dtensor
from . import isa, small_rows, weight_rows
from .roundings import one_rounding_apart, within_a_rounding  # noqa: F401 - this module's words too
from .siblings import find_siblings

logger = logging.getLogger("paged_hf")

ONEDNN, FP32, ROWS = "onednn", "fp32", "rows"
TILE_ROWS = 16  # a row-invariant bf16 GEMM's granule (PackedWeight._by_tiles)
MODES = (ONEDNN, FP32, ROWS)
_CHECKED: dict[str, bool] = {}


def mode(dtype: torch.dtype, device: torch.device, wanted: bool | str = True) -> str | None:
    """How this model's linears are packed (``wanted``: ``cpu_packed_weights``). bf16: ``"onednn"`` where
    this CPU multiplies bf16 in hardware (``native_bf16``) and oneDNN gives ``F.linear``'s results
    exactly, else ``"fp32"`` where that gives them within one bf16 rounding; fp32: ``"fp32"`` where oneDNN's fp32 matmul gives ``F.linear``'s results
    within fp32 rounding (each checked once per process). None for other dtypes and devices, or when
    turned off (``wanted=False``, ``PAGED_HF_PACKED_LINEAR=0``). Asking for ``"onednn"`` where it cannot
    serve (no bf16 matmul here, or an fp32 model) raises."""
    if (
        wanted is False
        or dtype not in (torch.bfloat16, torch.float32)
        or device.type != "cpu"
        or os.environ.get("PAGED_HF_PACKED_LINEAR", "1") == "0"
    ):
        return None
    if dtype == torch.float32:
        if wanted == ONEDNN:
            raise ValueError(
                "cpu_packed_weights='onednn' is oneDNN's bf16 matmul, and this model is fp32; "
                "use True or 'fp32'"
            )
        return FP32 if _checked(FP32, dtype) else None
    if wanted not in (FP32, ROWS) and native_bf16() and _checked(ONEDNN, dtype):
        return ONEDNN
    # the weights as they are, no copy, when asked for (AVX2: 1.1-1.5x the fp32 copies from 16 rows);
    # not the default yet: the suite's SmolLM2 answers sit on a near-tie its roundings cross
    if wanted == ROWS:
        if weight_rows.available():
            return ROWS
        raise ValueError(
            "cpu_packed_weights='rows': the weight-rows GEMM needs AVX2 and FMA; use True"
        )
    if wanted == ONEDNN:
        raise ValueError(
            "cpu_packed_weights='onednn': this CPU's oneDNN has no bf16 matmul that gives F.linear's "
            "results (no AVX-512 bf16 or AMX); use True (the fp32 way here) or 'fp32'"
        )
    return FP32 if _checked(FP32, dtype) else None


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware, so that oneDNN's bf16 matmul is the fast way: AVX-512
    bf16 or AMX on x86 (oneDNN's own word elsewhere). oneDNN also runs bf16 on AVX-512 CPUs without
    them (torch calls bf16 supported there), converting to fp32 inside its kernels: an Intel Xeon with
    AVX-512 but no bf16 extensions, 2 threads, ran SmolLM2's GEMMs at 41-59 GFLOP/s that way from 8
    rows on, and at 102-273 as fp32 copies (benchmarks/bench_cpu_linear.py; docs/measurements.md), and
    there its results at one row were not ``F.linear``'s bit for bit."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    if platform.machine() not in ("x86_64", "AMD64"):
        return True
    return isa.at_least("avx512_bf16")


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether packed weights serve a model of this dtype on this device, one way or the other."""
    return mode(dtype, device) is not None


def affordable(nbytes: int) -> tuple[bool, str]:
    """Whether a second copy of ``nbytes`` of weights fits: at most a quarter of the memory
    available now (a 7B model in bf16 would need ~13 GiB more). Returns (ok, why not)."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf here: do not risk it
        return False, "the memory available could not be read"
    if nbytes <= available // 4:
        return True, ""
    return False, (
        f"the packed copy ({nbytes / 2**30:.1f} GiB) would take more than a quarter of the "
        f"{available / 2**30:.1f} GiB of memory available"
    )


def _checked(how: str, dtype: torch.dtype) -> bool:
    key = f"{how}/{dtype}"
    if key not in _CHECKED:
        _CHECKED[key] = _check(how, dtype)
        if not _CHECKED[key]:
            logger.debug(
                "paged_hf: %s linears on %s weights do not give F.linear's results here", how, dtype
            )
    return _CHECKED[key]


def _check(how: str, dtype: torch.dtype) -> bool:
    """The packed way against ``F.linear`` on random data of ``dtype``, at a few row counts, with and
    without bias: equal (onednn), or apart by no more than another order of fp32 sums (fp32;
    ``within_a_rounding``)."""
    try:
        if (
            not torch.backends.mkldnn.is_available()
            or how == ONEDNN
            and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        ):
            return False
        g = torch.Generator().manual_seed(0)
        w = torch.randn(96, 64, generator=g).to(dtype)
        b = torch.randn(96, generator=g).to(dtype)
        for bias in (None, b):
            weight = PackedWeight(how, [w], None if bias is None else [bias])
            for rows in (1, 7, 40):
                x = torch.randn(1, rows, 64, generator=g).to(dtype)
                got, want = weight(x), F.linear(x, w, bias)
                ok = torch.equal(got, want) if how == ONEDNN else within_a_rounding(got, want, x, w)
                if got.dtype != dtype or not ok:
                    return False
        return True
    except (RuntimeError, AttributeError):  # no mkldnn ops in this torch build
        return False


def takes_small_rows(asked: bool, how: str, row_invariant: bool) -> bool:
    """Whether weights packed ``how`` take small_rows' kernel: asked for, oneDNN's bf16 way, not
    row-invariant (its rows past the kernel's would be oneDNN's), and the kernel serves here."""
    return asked and how == ONEDNN and not row_invariant and small_rows.available()


def onednn_gemm(
    rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """oneDNN's GEMM of ``rows`` ``[M, K]`` with a packed weight (one name for every call: the
    batch-invariance tests stand a GEMM that sums by row count in for it)."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


class PackedWeight:
    """One GEMM's weight (a module's, or a sibling group's concatenated) packed for oneDNN as ``how``
    computes it: bf16, or fp32 (a bf16 weight's fp32 copy, its output rounded to bf16)."""

    def __init__(
        self,
        how: str,
        weights: list[torch.Tensor],
        biases: list[torch.Tensor] | None,
        batch_hint: int = 64,
        row_invariant: bool = False,
        small: bool = False,
        onednn: bool = True,
    ) -> None:
        self.how, self.dtype = how, weights[0].dtype
        self.weights, self.biases = weights, biases
        if (
            how == ROWS
        ):  # the weights where they lie; the biases' fp32 copies (weight_rows.prepared)
            self.small, self.small_rows, self.packed, self.bias = None, 0, None, None
            self.rows_kernel = all(weight_rows.fits(w) for w in weights)
            self.row_args = weight_rows.prepared(weights, biases)
            return
        # a bf16 weight's fp32 copy reads twice the bytes: at one row (a lone sequence's decode) the
        # weights' own bf16 F.linear is faster (SmolLM2's, Zen 3: 13-16 against 8-15 GFLOP/s), but
        # sums in another order than at more rows (``row_invariant``: never)
        self.one_row_in_bf16 = how == FP32 and self.dtype == torch.bfloat16 and not row_invariant
        self.by_tiles = how == ONEDNN and row_invariant
        with torch.no_grad():
            weight = (
                weights[0].detach()
                if len(weights) == 1
                else torch.cat([w.detach() for w in weights])
            )
            bias = (
                None
                if biases is None
                else biases[0].detach()
                if len(biases) == 1
                else torch.cat([b.detach() for b in biases])
            )
            # few rows on a copy laid out for small_rows' kernel (``small``: asked for, and it serves)
            fits = takes_small_rows(small, how, row_invariant) and small_rows.fits(weight)
            self.small = small_rows.SmallRowsWeight(weight, bias) if fits else None
            self.small_rows = small_rows.max_rows() if fits else 0
            if how == FP32:
                weight, bias = weight.float(), None if bias is None else bias.float()
            # without oneDNN's copy (memory for one: ``onednn=False``) rows past the kernel's run the
            # modules' own F.linear, oneDNN's results (``_check``)
            self.packed = (
                torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
                if onednn or self.small is None
                else None
            )
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == ROWS:
            if not self.rows_kernel or not x.numel():
                return self._own_linears(x)
            out = weight_rows.run(x.view(-1, x.shape[-1]), *self.row_args)
            return out.view(*x.shape[:-1], out.shape[-1])
        if self.one_row_in_bf16 and x.numel() == x.shape[-1]:
            return self._own_linears(x)
        # the rows as a matrix: the same GEMM, ~10 us a call less than a [1, T, K] input costs the op
        # (a lone decode's step makes 121 of them; the same bits: tests/kernels/test_cpu_linear.py)
        rows = x.view(-1, x.shape[-1]) if x.dim() != 2 else x
        if 0 < rows.shape[0] <= self.small_rows:
            out = self.small(rows)
        elif self.packed is None:
            out = self._own_linears(rows)
        elif self.by_tiles and rows.shape[0]:
            out = self._by_tiles(rows)
        elif self.how == ONEDNN:
            out = onednn_gemm(rows, self.packed, self.bias)
        else:
            out = onednn_gemm(rows.float(), self.packed, self.bias).to(self.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])

    def _own_linears(self, x: torch.Tensor) -> torch.Tensor:
        """Each module's own ``F.linear`` on the weights as the model has them, side by side."""
        parts = [
            F.linear(x, w, b)
            for w, b in zip(self.weights, self.biases or [None] * len(self.weights))
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def _by_tiles(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows in GEMMs of 32 rows (the last of 16), padded with zeros: oneDNN's bf16 GEMM sums a
        row in one order at 16 and 32 rows and in others at other counts, so each row's bits then
        do not depend on how many rows came with it (2.2x the time of one GEMM at 256 rows)."""
        n = rows.shape[0]
        if n % TILE_ROWS:
            rows = torch.cat([rows, rows.new_zeros(TILE_ROWS - n % TILE_ROWS, rows.shape[1])])
        parts = [
            onednn_gemm(rows[i : i + 2 * TILE_ROWS], self.packed, self.bias)
            for i in range(0, rows.shape[0], 2 * TILE_ROWS)
        ]
        return (parts[0] if len(parts) == 1 else torch.cat(parts))[:n]


class PackedLinears:
    """The model's ``nn.Linear`` modules with 2-D bf16 CPU weights, packed ``how`` (``mode``) on first
    use; siblings (``find_siblings``) fused into one GEMM when ``fuse``."""

    def __init__(
        self,
        model: torch.nn.Module,
        how: str = ONEDNN,
        dtype: torch.dtype = torch.bfloat16,
        batch_hint: int = 64,
        fuse: bool = True,
        row_invariant: bool = False,
        small: bool = False,
    ) -> None:
        if how not in MODES or (how, dtype) not in (
            (ONEDNN, torch.bfloat16),
            (FP32, torch.bfloat16),
            (FP32, torch.float32),
            (ROWS, torch.bfloat16),
        ):
            raise ValueError(
                f"how={how!r} for {dtype} weights; one of {MODES} for bf16, {FP32!r} for fp32"
            )
        self.how, self.dtype = how, dtype
        self.modules = [
            m
            for m in model.modules()
            if type(m) is torch.nn.Linear
            # a tensor-parallel linear (its own forward, a DTensor weight) runs its own code
            and "forward" not in m.__dict__
            and not is_dtensor(m.weight)
            and m.weight.dtype == dtype
            and m.weight.device.type == "cpu"
            and m.weight.dim() == 2
        ]
        self.batch_hint, self.row_invariant = batch_hint, row_invariant
        # few-row GEMMs on a second copy laid out for small_rows' kernel, where asked for and it serves;
        # oneDNN's copy besides unless memory holds one copy only (``onednn``: the runner decides)
        self.small = takes_small_rows(small, how, row_invariant)
        self.onednn = True
        # (no modules, no probe forward: a tensor-parallel model's would be a collective for nothing)
        self.siblings = find_siblings(model, self.modules) if fuse and self.modules else []
        self.fused: list[list[torch.nn.Linear]] = []  # the sibling groups packed as one GEMM
        self._states: list[_FusedState] = []
        self._weights: dict[tuple[int, ...], PackedWeight] = {}
        self._fusable: dict[tuple, bool] = {}  # per group, shapes: one GEMM gives the parts' bits
        self._forwards: list | None = None

    @property
    def nbytes(self) -> int:
        """The packed copies' size: the weights again (twice over for bf16 weights in fp32, or for
        small_rows' copy beside oneDNN's); none where the weight-rows GEMM reads them in place."""
        if self.how == ROWS:
            return 0
        per = 4 if self.how == FP32 or (self.small and self.onednn) else 2
        return sum(m.weight.numel() * per for m in self.modules)

    def reset(self) -> None:
        """Forget the packed copies (the weights changed); the next step packs them again."""
        self._forwards = None
        self._states, self._weights = [], {}

    def _packed(self, modules: list[torch.nn.Linear]) -> PackedWeight:
        biases = None if modules[0].bias is None else [m.bias for m in modules]
        return PackedWeight(
            self.how,
            [m.weight for m in modules],
            biases,
            self.batch_hint,
            self.row_invariant,
            self.small,
            self.onednn,
        )

    def weight_for(self, modules: list[torch.nn.Linear]) -> "PackedWeight | None":
        """The packed weight a step computes ``modules`` with: a fused group's (in its order), or one
        module's; None where they are not packed so (valid while the block of ``active`` runs)."""
        return self._weights.get(tuple(map(id, modules)))

    def _pack(self) -> list:
        fused: dict[torch.nn.Module, object] = {}
        self.fused, self._states, self._weights = [], [], {}
        for group in self.siblings:
            state = self._fuse(group)
            if state is not None:
                self.fused.append(group)
                self._states.append(state)
                self._weights[tuple(map(id, group))] = state.packed
                for i, m in enumerate(group):
                    fused[m] = _fused_forward_for(m, state, i)
        out = []
        for m in self.modules:
            if m not in fused:
                packed = self._weights[(id(m),)] = self._packed([m])
                fused[m] = _forward_for(m, packed)
            out.append((m, fused[m]))
        return out

    def _fuse(self, group: list[torch.nn.Linear]) -> "_FusedState | None":
        """One packed GEMM for ``group``, if it gives each module's own packed result bit for bit.

        Checked once per group and shapes: a GEMM's order of sums follows its shapes, not its values,
        so packing again for new weights (each step of a training loop) skips the check, ~80% of
        the packing's time (SmolLM2: 0.21 of 0.26 s)."""
        if group[0].bias is not None and any(m.bias.dtype != self.dtype for m in group):
            return None
        key = tuple((id(m), tuple(m.weight.shape), m.weight.dtype, m.bias is None) for m in group)
        with torch.no_grad():
            whole = self._packed(group)
            if key not in self._fusable:
                parts = [self._packed([m]) for m in group]
                g = torch.Generator().manual_seed(0)
                self._fusable[key] = all(
                    torch.equal(whole(x), torch.cat([part(x) for part in parts], dim=-1))
                    for x in (
                        torch.randn(1, rows, group[0].in_features, generator=g).to(self.dtype)
                        for rows in (1, 5, 40)
                    )
                )
        if not self._fusable[key]:
            return None
        return _FusedState(whole, [m.weight for m in group], [m.out_features for m in group])

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Point every module at its packed weight for the duration of the block."""
        if self._forwards is None:
            self._forwards = self._pack()
        installed = []
        try:
            # the instance dict directly: nn.Module's __setattr__ / __delattr__ checks for parameters,
            # buffers and submodules, none of which a forward is, cost ~1.5 us a module a step
            for m, fwd in self._forwards:
                d = m.__dict__
                if "forward" not in d:
                    d["forward"] = fwd
                    installed.append(d)
            yield
        finally:
            for d in installed:
                del d["forward"]
            for state in self._states:  # no step's activations kept past it
                state.x = state.out = None


class _FusedState:
    """A sibling group's packed concatenated weight, and the input it computed with its output until
    every sibling took its slice (then let go: a layer's output is not kept to the end of the step)."""

    def __init__(self, packed: PackedWeight, weights: list, widths: list[int]) -> None:
        self.packed, self.weights = packed, weights
        self.bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
        self.x = self.out = None  # the input and its output, while siblings still take slices
        self.served: set[int] = set()


def _fused_forward_for(module: torch.nn.Linear, state: _FusedState, i: int):
    lo, hi, n = state.bounds[i], state.bounds[i + 1], len(state.weights)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype != state.packed.dtype
            or not x.is_contiguous()
            or module.weight is not state.weights[i]
        ):
            return F.linear(x, module.weight, module.bias)
        # the first sibling called on this input computes them all
        if x is not state.x or i in state.served:
            state.out = state.packed(x)
            state.x = x
            state.served = set()
        out = state.out[..., lo:hi]
        state.served.add(i)
        if len(state.served) == n:
            state.x = state.out = None
        return out

    return forward


def _forward_for(module: torch.nn.Linear, packed: PackedWeight):
    weight, bias = module.weight, module.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype != packed.dtype
            or not x.is_contiguous()
            or module.weight is not weight
            or module.bias is not bias
            or (bias is not None and bias.dtype != packed.dtype)
        ):
            return F.linear(x, module.weight, module.bias)
        return packed(x)

    return forward
