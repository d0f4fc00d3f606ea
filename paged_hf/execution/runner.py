"""Execution: owns the KV tensors (through a backend) and runs one packed forward per step.

The model is driven unmodified: ``input_ids[1, T]`` and ``position_ids[1, T]`` hold every
scheduled token of every request, ``use_cache=False`` keeps transformers' own cache out of
the way, and ``logits_to_keep`` selects just the rows that will be sampled.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..cache.kv_groups import CacheGroup
from ..config import EngineConfig
from ..requests.request import Request
from .attention import active_backend
from .backends import select_backend
from .cpu import batch_invariance, compact_layers, fused_ops, small_rows
from .cpu import linear as cpu_linear
from .cpu import malloc as cpu_malloc
from .decode_accelerator import DecodeAccelerator, wants_decode_accelerator
from .kv_geometry import KVLayout
from .metadata import StepMetadata, build_step_metadata
from .state_geometry import StateLayout
from .state_store import StateStore
from .stateful_mixers import MixerRunner, StatePlan

logger = logging.getLogger("paged_hf")


# RoPE scalings that stretch positions past max_position_embeddings by their factor (vLLM's rule;
# llama3 and longrope configs already state the stretched length)
_STRETCHING_ROPE = ("linear", "dynamic", "yarn")


def max_positions(model: torch.nn.Module) -> tuple[int | None, int | None]:
    """(default, most) positions the model can encode: max_position_embeddings (n_positions for
    GPT-2), and, where a RoPE scaling stretches it, that length times its factor."""
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    base = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if base is None:
        return None, None
    most = base
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    for params in (
        rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]
    ):
        kind = params.get("rope_type") or params.get("type")
        factor = params.get("factor")
        if kind in _STRETCHING_ROPE and isinstance(factor, (int, float)) and factor > 1:
            most = max(most, int((params.get("original_max_position_embeddings") or base) * factor))
    return base, most


def _training_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` (itself included, each once) in train mode: ``model.modules()`` without
    building every module's dotted name, which took most of its ~180 us a step for SmolLM2's 368."""
    seen: set[int] = set()
    stack, training = [model], []
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if m.training:
            training.append(m)
        stack.extend(c for c in m._modules.values() if c is not None)
    return training


@contextlib.contextmanager
def eval_modes(model: torch.nn.Module):
    """The engine's forwards run with dropout off whatever mode the model is in (a trainer keeps it
    in train mode between generations); every module's mode is put back after."""
    training = _training_modules(model)
    for m in training:
        m.training = False
    try:
        yield
    finally:
        for m in training:
            m.training = True


def cache_groups(
    model: torch.nn.Module,
    config: EngineConfig,
    layout: KVLayout,
    state_layout: StateLayout | None = None,
) -> tuple[CacheGroup, ...]:
    """The cache groups the engine runs the model's layers in: sliding and chunked layers apart from
    full ones (paged_hf/cache/kv_groups.py), unless ``keep_every_kv_block``, or the step runs where
    groups are not served yet (CUDA-graph and compiled decode steps read group 0's tables only):
    there every block is kept, as it always was, with the same results."""
    param = next(model.parameters())
    backend = select_backend(config.backend, param.device, param.dtype, layout, quiet=True)
    keep = (
        config.keep_every_kv_block
        or not getattr(backend, "serves_cache_groups", False)
        or (wants_decode_accelerator(config, param.device) and state_layout is None)
    )
    return layout.cache_groups(keep_every_block=keep)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        num_blocks: int,
        layout: KVLayout,
        state_layout: StateLayout | None = None,
        num_state_slots: int = 0,
        groups: tuple[CacheGroup, ...] | None = None,
    ) -> None:
        """``layout``: the model's per-layer KV geometry (paged_hf/execution/kv_geometry.py), found when it was
        patched; ``state_layout``: a hybrid model's stateful layers (paged_hf/execution/state_geometry.py), whose
        states live in ``num_state_slots`` slots (running sequences', then prefix checkpoints);
        ``groups``: the cache groups (``cache_groups``), ``num_blocks`` pages of which the backend holds."""
        self.model = model
        self.config = config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.groups = groups or cache_groups(model, config, layout, state_layout)
        self._sizes = (num_blocks, layout, state_layout, num_state_slots)
        self.asleep = False
        if config.cpu_tune_malloc and self.device.type == "cpu":
            cpu_malloc.tune()
        self._allocate()
        self.fused_ops = None
        if config.cpu_fused_ops and self.device.type == "cpu" and fused_ops.available():
            with eval_modes(model):  # checked as the steps run them
                self.fused_ops = fused_ops.FusedOps(
                    model, self.dtype, layout.layers[0].k_dim if layout.layers else None
                )
        self.packed = self._packed_linears(model, config)
        if config.batch_invariant:
            self._check_batch_invariance(model, state_layout)
        self.compact = None
        if config.cpu_compact_layers and self.fused_ops is not None and self.packed is not None:
            with eval_modes(model):
                self.compact = compact_layers.CompactLayers(
                    model, self.fused_ops, self.packed, layout
                )

    def _packed_linears(
        self, model: torch.nn.Module, config: EngineConfig
    ) -> "cpu_linear.PackedLinears | None":
        """On a CPU the linear layers use weights packed once for oneDNN: bf16 for its bf16 matmul
        or, where this CPU has none, as fp32 copies; fp32 for its fp32 matmul
        (paged_hf/execution/cpu/linear.py). None where they run as the model has them."""
        invariant = config.batch_invariant
        how = (
            cpu_linear.mode(self.dtype, self.device, config.cpu_packed_weights)
            if self.decode is None
            else None
        )
        if not how:
            return None
        packed = cpu_linear.PackedLinears(
            model,
            how,
            self.dtype,
            fuse=config.cpu_fused_projections,
            row_invariant=invariant,
            small=config.cpu_small_row_gemm,
        )
        ok, why = cpu_linear.affordable(packed.nbytes)
        if not ok and packed.small:
            # room for one copy: the few-row kernel's where it serves a step's whole default budget
            # (no AMX; past it the modules' own F.linear, oneDNN's results), else oneDNN's
            if small_rows.max_rows() == small_rows.ROWS:
                packed.onednn = False
            else:
                packed.small = False
            ok, why = cpu_linear.affordable(packed.nbytes)
        if ok:
            return packed
        if invariant:
            raise MemoryError(f"paged_hf: batch_invariant=True cannot pack the linears: {why}")
        # the same results either way (fp32: within a rounding); only speed is lost, so say so
        logger.warning(
            "paged_hf: linear weights are not packed (%s); steps run %s slower. "
            "cpu_packed_weights=False silences this.",
            why,
            "up to 5x" if how == cpu_linear.FP32 and self.dtype == torch.bfloat16 else "~10-50%",
        )
        return None

    def _check_batch_invariance(self, model: torch.nn.Module, state_layout) -> None:
        """``batch_invariant=True`` refused, naming why, where this model and backend cannot hold it."""
        why = batch_invariance.refusal(
            model,
            self.dtype,
            self.device,
            state_layout is not None,
            self.packed,
            getattr(self.backend, "bf16_path_everywhere", False),
        )
        if why:
            raise ValueError(f"paged_hf: batch_invariant=True cannot hold {why}")

    def _allocate(self) -> None:
        """The KV tensors (through the backend), the state slots and the decode accelerator."""
        num_blocks, layout, state_layout, num_state_slots = self._sizes
        config = self.config
        self.states = (
            StateStore(state_layout, num_state_slots, self.device)
            if state_layout is not None
            else None
        )
        self.mixers = (
            MixerRunner(self.model, state_layout, self.states) if state_layout is not None else None
        )
        # padded decode steps (CUDA graphs / compile) need one extra KV block for their padding rows;
        # a hybrid's state gather is not captured (never run on a GPU), so its decode steps run eagerly
        accelerate = wants_decode_accelerator(config, self.device) and state_layout is None
        kwargs = {"groups": self.groups} if len(self.groups) > 1 else {}
        self.backend = select_backend(config.backend, self.device, self.dtype, layout)(
            layout,
            num_blocks + int(accelerate),
            config.block_size,
            dtype=self.dtype,
            device=self.device,
            **kwargs,
        )
        self.decode = (
            DecodeAccelerator.build(self.model, self.backend, config, pad_block=num_blocks)
            if accelerate
            else None
        )
        self.backend_name = self.backend.name

    def sleep(self) -> None:
        """Let go of the KV cache, the state slots, captured graphs and packed weights (their contents
        are lost); ``wake_up`` makes them again, empty."""
        self.backend = self.states = self.mixers = self.decode = None
        if self.packed is not None:
            self.packed.reset()
        self.asleep = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        elif self.config.cpu_tune_malloc:  # the freed KV tensors, not kept for the next step
            cpu_malloc.release()

    def wake_up(self) -> None:
        if self.asleep:
            self._allocate()
            self.asleep = False

    def weights_changed(self, moved: bool = True) -> None:
        """The model's weights changed (``moved``: some tensor has new storage): what was derived
        from them is made again."""
        if self.packed is not None:
            self.packed.reset()
        if self.decode is not None:
            self.decode.weights_changed(moved)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (src, dst) state slots: forked samples start from their parent's state."""
        if pairs:
            self.states.copy_slots(pairs)

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Request, int]], block_copies: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, StepMetadata]:
        """Run the step; return logits [B', V] for ``meta.sampled_requests`` and the metadata."""
        meta = build_step_metadata(scheduled, self.config.block_size, self.device, self.groups)
        self.backend.copy_blocks(block_copies)
        with eval_modes(self.model):
            return self._forward(meta, scheduled)

    def _embeddings(
        self, meta: StepMetadata, given: list[tuple[int, Request, int, int]]
    ) -> torch.Tensor:
        """The step's input embeddings: its tokens' through the model's embedding layer, then the
        given prompt embeddings at their rows (as transformers' generate takes inputs_embeds)."""
        embeds = self.model.get_input_embeddings()(meta.input_ids)
        for row, req, start, count in given:
            embeds[row : row + count] = req.prompt_embeds[start : start + count]
        return embeds

    def _forward(
        self, meta: StepMetadata, scheduled: list[tuple[Request, int]]
    ) -> tuple[torch.Tensor, StepMetadata]:
        asking = [i for i, (req, _) in enumerate(scheduled) if req.params.output_hidden_states]
        embeds = _prompt_embeds_rows(scheduled)
        if not asking and not embeds and self.decode is not None and self.decode.can_run(meta):
            return self.decode.run(meta), meta
        self.backend.plan(meta)
        mixers = contextlib.nullcontext()
        if self.mixers is not None:
            plan = StatePlan.build(
                meta.q_lens,
                [req.num_computed_tokens for req, _ in scheduled],
                [req.state_slot for req, _ in scheduled],
                self.device,
                [req.pending_checkpoints for req, _ in scheduled],
            )
            mixers = self.mixers.active(plan)
        with (
            active_backend(self.backend),
            self.packed.active() if self.packed else contextlib.nullcontext(),
            self.fused_ops.active() if self.fused_ops else contextlib.nullcontext(),
            self.compact.active() if self.compact else contextlib.nullcontext(),
            mixers,
        ):
            inputs = (
                {"inputs_embeds": self._embeddings(meta, embeds)[None]}
                if embeds
                else {"input_ids": meta.input_ids[None]}
            )
            out = self.model(
                **inputs,
                position_ids=meta.positions[None],
                use_cache=False,
                logits_to_keep=meta.logits_indices,
                **({"output_hidden_states": True} if asking else {}),
            )
        if asking:
            meta.hidden_states = _rows_hidden_states(out.hidden_states, scheduled, asking, meta)
        logits = out.logits[0]
        # a forward without logits_to_keep (Whisper's): every row
        if logits.shape[0] != meta.logits_indices.numel():
            logits = logits.index_select(0, meta.logits_indices)
        return logits, meta


def _prompt_embeds_rows(
    scheduled: list[tuple[Request, int]],
) -> list[tuple[int, Request, int, int]]:
    """(first row in the step, request, first position, count) of each prompt position this step
    computes from a request's given embeddings."""
    rows, offset = [], 0
    for req, n in scheduled:
        start = req.num_computed_tokens
        if req.prompt_embeds is not None and start < req.prompt_embeds.shape[0]:
            rows.append((offset, req, start, min(n, req.prompt_embeds.shape[0] - start)))
        offset += n
    return rows


def _rows_hidden_states(
    layers: tuple[torch.Tensor, ...],
    scheduled: list[tuple[Request, int]],
    asking: list[int],
    meta: StepMetadata,
) -> dict[Request, tuple[int, torch.Tensor]]:
    """The asking requests' rows of each layer's packed ``[1, T, hidden]`` states."""
    starts = [0]
    for n in meta.q_lens:
        starts.append(starts[-1] + n)
    return {
        scheduled[i][0]: (
            scheduled[i][0].num_computed_tokens,
            torch.stack([h[0, starts[i] : starts[i + 1]] for h in layers]),
        )
        for i in asking
    }
