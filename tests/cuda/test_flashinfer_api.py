"""The FlashInfer stand-in against the real package's API.

tests/fake_flashinfer.py lets the FlashInfer backend run on CPU; the other CUDA-path tests run
the backend through it, and the stand-in raises TypeError on any argument it does not know. Here
every parameter of the stand-in's constructors, ``plan`` and ``run`` must exist in the real
flashinfer (the release pinned in constraints/flashinfer.txt) with the same kind and default, so
a call the backend makes on CPU is a call the real wrappers accept. The real package is imported
in a subprocess: it imports fine without a GPU, and this process keeps the stand-in.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import fake_flashinfer
import pytest

REPO = Path(__file__).resolve().parents[2]
# (class, method in the stand-in, method in flashinfer that holds the parameters). The decode
# wrapper's public plan() forwards **kwargs to _plan_impl, where the keyword names live.
METHODS = [
    ("BatchDecodeWithPagedKVCacheWrapper", "__init__", "__init__"),
    ("BatchDecodeWithPagedKVCacheWrapper", "plan", "_plan_impl"),
    ("BatchDecodeWithPagedKVCacheWrapper", "run", "run"),
    ("BatchPrefillWithPagedKVCacheWrapper", "__init__", "__init__"),
    ("BatchPrefillWithPagedKVCacheWrapper", "plan", "plan"),
    ("BatchPrefillWithPagedKVCacheWrapper", "run", "run"),
]

_DUMP = """
import inspect, json, sys
import flashinfer
methods = json.loads(sys.argv[1])
out = {"version": flashinfer.__version__, "signatures": {}}
for cls, _, real in methods:
    sig = inspect.signature(getattr(getattr(flashinfer, cls), real))
    out["signatures"][cls + "." + real] = [
        [p.name, p.kind.name, None if p.default is p.empty else repr(p.default)] for p in sig.parameters.values()]
print(json.dumps(out))
"""


def _params(fn) -> list[list]:
    return [
        [p.name, p.kind.name, None if p.default is p.empty else repr(p.default)]
        for p in inspect.signature(fn).parameters.values()
    ]


def _pinned_version() -> str:
    for line in (REPO / "constraints" / "flashinfer.txt").read_text().splitlines():
        if line.startswith("flashinfer-python=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError("constraints/flashinfer.txt pins no flashinfer-python")


@pytest.fixture(scope="module")
def real_api() -> dict:
    if importlib.util.find_spec("flashinfer") is None:
        if os.environ.get("PAGED_HF_REQUIRE_FLASHINFER_API"):
            pytest.fail(
                "flashinfer is not installed, and this run requires it (make install puts it in .venv)"
            )
        pytest.skip(
            "flashinfer not installed: `pip install --no-deps -r constraints/flashinfer.txt`"
        )
    result = subprocess.run(
        [sys.executable, "-c", _DUMP, json.dumps(METHODS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_installed_flashinfer_is_the_pinned_release(real_api):
    assert real_api["version"] == _pinned_version()


@pytest.mark.parametrize("cls,fake_method,real_method", METHODS)
def test_stand_in_accepts_only_what_flashinfer_accepts(real_api, cls, fake_method, real_method):
    real = {
        name: (kind, default)
        for name, kind, default in real_api["signatures"][f"{cls}.{real_method}"]
    }
    fake = _params(getattr(getattr(fake_flashinfer, cls), fake_method))
    assert fake, "the stand-in method takes no parameters"
    for name, kind, default in fake:
        if kind in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            assert any(k == kind for k, _ in real.values()), (
                f"{cls}.{fake_method}: real has no {kind} for *{name}"
            )
            continue
        assert name in real, f"{cls}.{fake_method}: flashinfer has no parameter {name!r}"
        assert real[name] == (kind, default), (
            f"{cls}.{fake_method}({name}): stand-in {kind}={default}, real {real[name]}"
        )


def test_a_required_real_parameter_is_required_by_the_stand_in(real_api):
    """The other direction, for what has no default: the backend cannot leave out an argument the
    real wrapper requires, because the stand-in requires it too."""
    for cls, fake_method, real_method in METHODS:
        fake = {name for name, _, _ in _params(getattr(getattr(fake_flashinfer, cls), fake_method))}
        required = [
            name
            for name, kind, default in real_api["signatures"][f"{cls}.{real_method}"]
            if default is None and kind not in ("VAR_POSITIONAL", "VAR_KEYWORD")
        ]
        assert set(required) <= fake, (cls, fake_method, set(required) - fake)
