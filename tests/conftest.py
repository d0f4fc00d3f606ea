import importlib
import os
import sys

import pytest
import torch
from stand_in_engines import forget_flashinfer_backend


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """Where the default model's safetensors cache lives: $PAGED_HF_CACHE when set (shared
    across runs; the first build dequantizes the GGUF, ~15-20 s), else a per-session temp dir."""
    return os.environ.get("PAGED_HF_CACHE") or tmp_path_factory.mktemp("paged_hf_cache")


@pytest.fixture(scope="session")
def smollm2(smollm2_cache):
    """(model, tokenizer) of the default model, SmolLM2-135M-Instruct, in bfloat16."""
    from paged_hf.model.default_model import load_default_model

    return load_default_model(dtype=torch.bfloat16, cache_dir=smollm2_cache)


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_cache):
    """The same in float32: greedy tokens of the engine and of transformers then agree exactly."""
    from paged_hf.model.default_model import load_default_model

    return load_default_model(dtype=torch.float32, cache_dir=smollm2_cache)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2, smollm2_cache):
    """The cache directory itself: a plain transformers checkpoint (config, safetensors, tokenizer)."""
    from paged_hf.model.default_model import default_cache_dir

    return default_cache_dir(smollm2_cache)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random llama and the tiny byte-level tokenizer saved as a checkpoint directory
    (for the front ends that load a model by name); tests only read it."""
    from tiny_models import make_tiny_model
    from tiny_tokenizer import make_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model("llama").save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: tiny models gain nothing from more, and on a busy
    2-core machine OpenMP threads wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """paged_hf.execution.backends.flashinfer_backend imported against tests/fake_flashinfer.py (fp32 and
    the tiny models' head_dim 16 allowed, so outputs can be compared with the torch backend)."""
    import fake_flashinfer as fake

    forget_flashinfer_backend()
    monkeypatch.setitem(sys.modules, "flashinfer", fake.as_module())
    mod = importlib.import_module("paged_hf.execution.backends.flashinfer_backend")
    monkeypatch.setattr(mod, "SUPPORTED_DTYPES", (torch.float32, torch.float16, torch.bfloat16))
    monkeypatch.setattr(mod, "SUPPORTED_HEAD_DIMS", (16,))
    yield mod
    forget_flashinfer_backend()


def pytest_collection_modifyitems(config, items):
    """Every test under tests/kernels/ builds or loads the C++ library: mark it ``compiler``."""
    kernels = os.path.join(os.path.dirname(__file__), "kernels") + os.sep
    for item in items:
        if str(item.fspath).startswith(kernels):
            item.add_marker(pytest.mark.compiler)


def pytest_report_header(config):
    """Which CPU kernels this run tests (tests for another CPU's are reported as skipped)."""
    from cpu_isa import header

    return header()


def pytest_terminal_summary(terminalreporter):
    """The same at the end, where ``-q`` shows it too, with how many tests of other CPUs' kernels
    were skipped (their reasons: ``-rs``)."""
    from cpu_isa import THIS_CPU, header

    other = [
        r
        for r in terminalreporter.stats.get("skipped", [])
        if THIS_CPU in str(getattr(r, "longrepr", ""))
    ]
    terminalreporter.write_line(f"{header()}; {len(other)} test(s) of other CPUs' kernels skipped")
