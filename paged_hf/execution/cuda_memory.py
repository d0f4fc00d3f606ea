"""KV-cache sizing on CUDA: what is left for the KV blocks after the largest step's activations.

    budget = gpu_memory_utilization * total GPU memory
             - (peak memory of a profiling forward at the largest step + memory outside torch)
             - a reserve for FlashInfer's workspaces and the CUDA-graph pool

The profiling forward is the step the engine can schedule at most: ``max_num_batched_tokens``
tokens through the model's plain forward (``use_cache=False``, no paged step active, so the
model's own attention runs), keeping the logits of ``max_num_seqs`` rows as the engine does,
followed by the sampler's float32 softmax over them. Weights and that peak are counted, the
memory other processes hold on the GPU too (it is in ``total - free`` and not in torch's pool).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("paged_hf")

# FlashInfer: a 128 MiB float workspace plus 8 MiB per planned wrapper (int workspace); CUDA graphs:
# the captured decode steps' pool. Measured per model on a GPU this could shrink; it errs large.
DEFAULT_RESERVE_BYTES = 1 << 30


def kv_budget_from_profile(total: int, utilization: float, peak_torch: int, non_torch: int,
                           reserve: int = DEFAULT_RESERVE_BYTES) -> int:
    """Bytes the KV cache may take, given the profile; raises when nothing is left."""
    budget = int(total * utilization) - peak_torch - non_torch - reserve
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} of {total / gib:.1f} GiB "
            f"is {total * utilization / gib:.2f} GiB, the profiled step peaks at {peak_torch / gib:.2f} GiB with "
            f"{non_torch / gib:.2f} GiB used outside torch and {reserve / gib:.2f} GiB reserved; raise "
            "gpu_memory_utilization or lower max_num_batched_tokens")
    return budget


@torch.inference_mode()
def profile_kv_budget(model: torch.nn.Module, config: Any, reserve: int = DEFAULT_RESERVE_BYTES) -> int:
    """Bytes left for the KV cache on the model's CUDA device (see the module docstring).

    Call it before any KV tensor is allocated. ``config`` is a ``paged_hf.EngineConfig``.
    """
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"profile_kv_budget needs a model on a CUDA device, it is on {device}")
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    tokens = config.max_num_batched_tokens
    limit = getattr(text_cfg, "max_position_embeddings", None) or getattr(text_cfg, "n_positions", None)
    if config.max_model_len is not None:
        limit = min(limit or config.max_model_len, config.max_model_len)
    input_ids = torch.randint(0, text_cfg.vocab_size, (1, tokens), device=device)
    # several sequences, as a real step packs them; positions stay below the model's limit
    span = min(tokens, limit or tokens)
    position_ids = (torch.arange(tokens, device=device) % span)[None]

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)  # CUDA context, other processes
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                   logits_to_keep=min(config.max_num_seqs, tokens)).logits
    torch.softmax(logits[0].float(), dim=-1)  # the sampler's temporaries
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del logits
    torch.cuda.empty_cache()
    budget = kv_budget_from_profile(total, config.gpu_memory_utilization, peak, max(non_torch, 0), reserve)
    logger.info("paged_hf: profiled step of %d tokens peaks at %.2f GiB; %.2f GiB left for the KV cache",
                tokens, peak / (1 << 30), budget / (1 << 30))
    return budget
