"""A model and its tokenizer by name, for the front ends (the CLI, the lm-eval backend).

Design notes: docs/internals.md, paged_hf/model/loading.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from .default_model import dequantized_gguf, load_default_model


class LoadError(ValueError):
    """A model, tokenizer or device that cannot be used; the message names the argument."""


DEFAULT_LABELS = {"model": "model", "tokenizer": "tokenizer", "device": "device"}


def load_model(
    name: str,
    *,
    tokenizer: Any = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    gguf_file: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    tp_size: int = 1,
    labels: dict[str, str] | None = None,
) -> tuple[Any, Any]:
    """(model in eval mode on ``device``, tokenizer). ``name`` is a checkpoint directory, a Hub id
    or ``default``; ``dtype`` "auto" is the checkpoint's own (bfloat16 for ``default``); a GGUF file
    is dequantized into plain weights, which the engine patches. ``tokenizer``: a name to load, a
    tokenizer object to return as it is, or None for the model's own. ``tp_size`` above 1: under
    ``torchrun``, transformers shards the model over that many ranks (its tensor parallelism; the
    world a multiple of it, one copy of the model per ``tp_size`` ranks: docs/tensor_parallel.md)
    and puts each rank's shard on its device."""
    label = {**DEFAULT_LABELS, **(labels or {})}
    spread = sharding(tp_size, label.get("tp_size", "tp_size"))
    dtype_name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    if dtype_name != "auto" and not isinstance(getattr(torch, dtype_name, None), torch.dtype):
        raise LoadError(f"dtype {dtype_name!r} is not a torch dtype")
    torch_dtype = None if dtype_name == "auto" else getattr(torch, dtype_name)
    hub: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if revision is not None:
        hub["revision"] = revision
    tok = tokenizer
    if isinstance(tokenizer, str):
        tok = load_tokenizer(tokenizer, label=label["tokenizer"], **hub)
    if name == "default":
        model, default_tok = _attempt(
            label["model"],
            name,
            "it",
            lambda: load_default_model(dtype=torch_dtype or torch.bfloat16, **spread),
        )
        model = model.eval() if spread else _to_device(model, device, label)
        return model, tok if tokenizer is not None else default_tok

    from transformers import AutoConfig, AutoModelForCausalLM

    files: dict[str, Any] = {**hub, **({"gguf_file": gguf_file} if gguf_file else {})}
    _attempt(label["model"], name, "it", lambda: AutoConfig.from_pretrained(name, **files))
    if tokenizer is None:
        tok = load_tokenizer(
            name,
            gguf_file=gguf_file,
            label=label["model"],
            subject=f"its tokenizer (name one with {label['tokenizer']})",
            **hub,
        )
    weights = {**files, **(dequantized_gguf() if gguf_file else {}), **spread}
    model = _attempt(
        label["model"],
        name,
        "it",
        lambda: AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype or "auto", **weights),
    )
    return (model.eval() if spread else _to_device(model, device, label)), tok


def sharding(tp_size: int, label: str) -> dict[str, Any]:
    """``from_pretrained``'s arguments for ``tp_size`` ranks a copy of the model: none for 1; the
    processes ``torchrun`` launched (WORLD_SIZE) make up whole copies, or a ``LoadError``."""
    if tp_size == 1:
        return {}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp_size < 1 or world < tp_size or world % tp_size:
        raise LoadError(
            f"{label} {tp_size}: tensor parallelism runs under torchrun with a multiple of "
            f"{tp_size} processes (torchrun --nproc-per-node {max(tp_size, 1)} ...); "
            f"{world} launched"
        )
    from transformers import DistributedConfig

    copies = world // tp_size  # data parallel on top: each copy runs its share of the work
    extra = {"dp_replicate_size": copies} if copies > 1 else {}
    return {"distributed_config": DistributedConfig(tp_size=tp_size, **extra)}


def load_tokenizer(
    name: str,
    *,
    gguf_file: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    label: str = "tokenizer",
    subject: str = "it",
) -> Any:
    """The tokenizer in directory or Hub repo ``name`` (from ``gguf_file`` there, if given); a
    ``LoadError`` naming ``label`` if it cannot be loaded."""
    from transformers import AutoTokenizer

    files: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if revision is not None:
        files["revision"] = revision
    if gguf_file:
        files["gguf_file"] = gguf_file
    return _attempt(label, name, subject, lambda: AutoTokenizer.from_pretrained(name, **files))


def _to_device(
    model: torch.nn.Module, device: str | torch.device, label: dict[str, str]
) -> torch.nn.Module:
    try:
        return model.to(device).eval()
    except (
        RuntimeError,
        ValueError,
        TypeError,
        AssertionError,
    ) as err:
        # torch's ways of refusing a device
        raise LoadError(f"{label['device']} {device}: {err}") from None


def _attempt(label: str, name: str, subject: str, load: Callable[[], Any]) -> Any:
    if looks_like_path(name) and not Path(name).expanduser().exists():
        raise LoadError(f"{label} {name}: no such directory")
    try:
        return load()
    except Exception as err:
        # transformers raises OSError, ValueError, KeyError, ... for "not a model here"
        raise LoadError(
            f"{label} {name}: cannot load {subject} ({type(err).__name__}: {err})"
        ) from None


def looks_like_path(name: str) -> bool:
    """A name that cannot be a Hub repo id ("name" or "owner/name"), so it must be a local path."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
