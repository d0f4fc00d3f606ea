import os

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """(model, tokenizer) of the default model, SmolLM2-135M-Instruct, in bfloat16.

    The safetensors cache lives in $PAGED_HF_CACHE when set (shared across runs; the
    first build dequantizes the GGUF, ~15-20 s), else in a per-session temp dir.
    """
    from paged_hf.models import load_default_model

    cache_dir = os.environ.get("PAGED_HF_CACHE") or tmp_path_factory.mktemp("paged_hf_cache")
    return load_default_model(dtype=torch.bfloat16, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: tiny models gain nothing from more, and on a busy
    2-core machine OpenMP threads wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
