"""The lm-eval backend's engine: built from lm-eval's model_args (a name, a model or an Engine),
with the evaluation defaults where the options do not say.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..config import EngineConfig
from ..model.loading import load_model, load_tokenizer

logger = logging.getLogger("paged_hf")

ENGINE_OPTIONS = {f for f in EngineConfig.__dataclass_fields__}


# engine defaults for evaluation (docs/internals.md, lm_eval); what the user gives wins
EVAL_ENGINE_DEFAULTS = {"block_size": 4, "max_num_batched_tokens": 2048}


def engine_for_eval(
    pretrained: Any,
    tokenizer: Any,
    dtype: Any,
    device: str | None,
    batch_size: Any,
    max_batch_size: int | None,
    revision: str | None,
    trust_remote_code: bool,
    gguf_file: str | None,
    engine_options: dict[str, Any],
    tp_size: int = 1,
) -> tuple[Any, torch.nn.Module, Any]:
    """(engine, model, tokenizer) for ``pretrained``: an Engine as it is, a model (its patched
    engine unless options are given), or a name loaded here (over ``tp_size`` ranks under
    torchrun, every rank evaluating every request as lm-eval runs a tensor-parallel model); the
    evaluation defaults apply where the options do not say."""
    from ..engine.core import EngineCore
    from ..model.patching import Engine, engine_for, is_patched

    explicit = dict(engine_options)
    seqs = max_num_seqs_for(batch_size, max_batch_size)
    if seqs is not None and "max_num_seqs" not in explicit:
        explicit["max_num_seqs"] = seqs
    engine_options = {**EVAL_ENGINE_DEFAULTS, **explicit}
    if "max_num_seqs" in explicit and "max_num_batched_tokens" not in explicit:
        engine_options["max_num_batched_tokens"] = max(
            EVAL_ENGINE_DEFAULTS["max_num_batched_tokens"], explicit["max_num_seqs"]
        )
    if tp_size != 1:
        refuse_copies(pretrained, tp_size)
    if isinstance(pretrained, EngineCore):
        if explicit:
            raise TypeError(
                f"paged_hf: engine options {sorted(explicit)} cannot change an existing Engine"
            )
        engine = pretrained
        model = pretrained.model
        tokenizer = tokenizer if tokenizer is not None else pretrained.tokenizer
    elif isinstance(pretrained, torch.nn.Module):
        model = pretrained
        tokenizer = eval_tokenizer(tokenizer, model, revision, trust_remote_code, gguf_file)
        if is_patched(model) and not explicit:
            engine = engine_for(model)
        else:
            engine = Engine(model, tokenizer, **engine_options)
    else:
        model, tokenizer = load_model(
            str(pretrained),
            tokenizer=tokenizer,
            dtype=dtype,
            device=device_for(device),
            gguf_file=gguf_file,
            revision=revision,
            trust_remote_code=trust_remote_code,
            tp_size=tp_size,
            labels={"model": "pretrained", "tokenizer": "tokenizer"},
        )
        engine = Engine(model, tokenizer, **engine_options)
    return engine, model, tokenizer


def use_draft_for_eval(
    engine: Any,
    draft_model: Any,
    dtype: Any,
    device: str | None,
    revision: str | None,
    trust_remote_code: bool,
) -> None:
    """The ``draft_model`` model arg: a model, or a name loaded as ``pretrained`` is; generate_until
    requests draft with it (docs/speculative.md). None: none."""
    if draft_model is None:
        return
    if not isinstance(draft_model, torch.nn.Module):
        draft_model = load_model(
            str(draft_model),
            dtype=dtype,
            device=device_for(device),
            revision=revision,
            trust_remote_code=trust_remote_code,
            labels={"model": "draft_model"},
        )[0]
    engine.use_draft_model(draft_model)


def refuse_copies(pretrained: Any, tp_size: int) -> None:
    """What ``tp_size`` cannot do here: shard a model already loaded, or run several copies (lm-eval
    splits its requests over ranks that each hold a whole model)."""
    if not isinstance(pretrained, str):
        raise TypeError(
            f"paged_hf: tp_size={tp_size} loads a model by name; shard a loaded model with "
            "transformers' DistributedConfig(tp_plan='auto') yourself (docs/tensor_parallel.md)"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > tp_size:
        raise ValueError(
            f"paged_hf: tp_size={tp_size} under {world} processes: lm-eval runs one copy of a "
            f"tensor-parallel model (torchrun --nproc-per-node {tp_size})"
        )


def special_kwargs(add_special_tokens: bool | None, add_bos: bool | None) -> dict:
    if add_special_tokens is not None:
        return {"add_special_tokens": add_special_tokens}
    if add_bos is not None:
        return {"add_special_tokens": add_bos}
    return {}


def max_num_seqs_for(batch_size: int | str | None, max_batch_size: int | None) -> int | None:
    """lm-eval's batch_size / max_batch_size as the engine's max_num_seqs (docs/internals.md, lm_eval)."""
    if batch_size is None:
        return None
    if isinstance(batch_size, str) and batch_size.startswith("auto"):
        return int(max_batch_size) if max_batch_size else None
    try:
        k = int(batch_size)
    except (TypeError, ValueError):
        raise ValueError(
            f"paged_hf: batch_size={batch_size!r}, must be an integer or 'auto'"
        ) from None
    if k < 1:
        raise ValueError(f"paged_hf: batch_size={k}, must be >= 1")
    if k == 1:
        logger.info(
            "paged_hf: batch_size=1 (lm-eval's default) leaves the engine's continuous batching as it is; "
            "pass max_num_seqs=1 in model_args to run one request at a time"
        )
        return None
    return k


def device_for(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        logger.warning(
            "paged_hf: device=%s but CUDA is not available (lm-eval's CLI asks for cuda:0 unless told "
            "otherwise); running on the CPU",
            device,
        )
        return "cpu"
    return device


def eval_tokenizer(
    tokenizer: Any,
    model: torch.nn.Module,
    revision: str | None,
    trust_remote_code: bool,
    gguf_file: str | None,
) -> Any:
    """The tokenizer for a model object: one given as an object, by name, or the model's own."""
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    name = tokenizer or getattr(model, "name_or_path", None)
    if not name:
        raise ValueError(
            "paged_hf: give the tokenizer (tokenizer=...) of a model object that has no name_or_path"
        )
    return load_tokenizer(
        name,
        gguf_file=gguf_file if tokenizer is None else None,
        revision=revision,
        trust_remote_code=trust_remote_code,
    )
