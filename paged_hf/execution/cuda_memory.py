"""KV-cache sizing on CUDA: what is left for the KV blocks after the largest step's activations.

Design notes: docs/internals.md, paged_hf/execution/cuda_memory.py.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .attention import active_backend
from .kv_geometry import KVLayout

logger = logging.getLogger("paged_hf")

FLOAT_WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace, one for all wrappers
# FlashInfer's int workspace, one per attention variant (shared by its wrappers)
INT_WORKSPACE_BYTES = 8 << 20
MARGIN_BYTES = 256 << 20  # cuBLAS workspaces, allocator rounding, kernels loaded later


class ProfileBackend:
    """Stands in for a paged backend during the profiling forward: attention's output, no scores."""

    name = "profile"

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

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
        _, heads, tokens, _ = query.shape
        return query.new_zeros(1, tokens, heads, value.shape[-1])


def attention_variants(layout: KVLayout) -> int:
    """Distinct attention geometries: FlashInfer plans one wrapper set per variant. Scale and
    soft-cap are learnt only at the first forward, so a model that varies them per layer (GPT-2's
    ``scale_attn_by_inverse_layer_idx``) is counted one per layer."""
    return max(1, len(set(layout.layers)))


def reserve_bytes(layout: KVLayout, graph_pool: int, per_layer_scale: bool = False) -> int:
    """Memory held beside the KV cache and the profiled step: FlashInfer's workspaces (float, and
    int per variant), the CUDA-graph pool (``graph_pool``: the captured decode steps' activations
    and logits) and a margin."""
    variants = len(layout.layers) if per_layer_scale else attention_variants(layout)
    return FLOAT_WORKSPACE_BYTES + INT_WORKSPACE_BYTES * variants + graph_pool + MARGIN_BYTES


def kv_budget_from_profile(
    total: int, utilization: float, peak_torch: int, non_torch: int, reserve: int
) -> int:
    """Bytes the KV cache may take, given the profile; raises when nothing is left."""
    budget = int(total * utilization) - peak_torch - non_torch - reserve
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} of {total / gib:.1f} GiB "
            f"is {total * utilization / gib:.2f} GiB, the profiled step peaks at {peak_torch / gib:.2f} GiB with "
            f"{non_torch / gib:.2f} GiB used outside torch and {reserve / gib:.2f} GiB reserved; raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget


def profile_forward(
    model: torch.nn.Module, layout: KVLayout, tokens: int, rows: int, limit: int | None
) -> torch.Tensor:
    """One step's forward of ``tokens`` tokens through the paged seam (``ProfileBackend``), keeping
    ``rows`` rows of logits, and the sampler's float32 softmax over them; returns the logits."""
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    input_ids = torch.randint(0, vocab, (1, tokens), device=device)
    span = min(tokens, limit or tokens)  # several sequences, as a real step packs them
    position_ids = (torch.arange(tokens, device=device) % span)[None]
    with active_backend(ProfileBackend(layout)):
        logits = model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=min(rows, tokens),
        ).logits
    torch.softmax(logits[0].float(), dim=-1)
    return logits


def _position_limit(model: torch.nn.Module, config: Any) -> int | None:
    text_cfg = model.config.get_text_config()
    limit = getattr(text_cfg, "max_position_embeddings", None) or getattr(
        text_cfg, "n_positions", None
    )
    if config.max_model_len is not None:
        limit = min(limit or config.max_model_len, config.max_model_len)
    return limit


def _activation_peak(
    model: torch.nn.Module,
    layout: KVLayout,
    tokens: int,
    rows: int,
    limit: int | None,
    device: torch.device,
) -> int:
    """Bytes a forward adds above what is allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    logits = profile_forward(model, layout, tokens, rows, limit)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del logits
    torch.cuda.empty_cache()
    return peak


@torch.inference_mode()
def profile_kv_budget(model: torch.nn.Module, config: Any, layout: KVLayout) -> int:
    """Bytes left for the KV cache on the model's CUDA device (docs/internals.md).

    Call it before any KV tensor is allocated. ``config`` is a ``paged_hf.EngineConfig``.
    """
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"profile_kv_budget needs a model on a CUDA device, it is on {device}")
    limit = _position_limit(model, config)
    # the graph pool holds the largest captured decode step's activations and a logits buffer
    graph_pool = 0
    if config.use_cuda_graphs:
        graph_pool = _activation_peak(
            model, layout, config.max_num_seqs, config.max_num_seqs, limit, device
        )
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)  # CUDA context, other processes
    weights = torch.cuda.memory_allocated(device)
    step = _activation_peak(
        model, layout, config.max_num_batched_tokens, config.max_num_seqs, limit, device
    )
    per_layer_scale = bool(
        getattr(model.config.get_text_config(), "scale_attn_by_inverse_layer_idx", False)
    )
    reserve = reserve_bytes(layout, graph_pool, per_layer_scale)
    budget = kv_budget_from_profile(
        total, config.gpu_memory_utilization, weights + step, max(non_torch, 0), reserve
    )
    gib = 1 << 30
    logger.info(
        "paged_hf: weights %.2f GiB, a step of %d tokens adds %.2f GiB, reserved %.2f GiB (graph pool "
        "%.2f GiB); %.2f GiB left for the KV cache",
        weights / gib,
        config.max_num_batched_tokens,
        step / gib,
        reserve / gib,
        graph_pool / gib,
        budget / gib,
    )
    return budget
