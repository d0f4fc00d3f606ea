#!/usr/bin/env bash
# The CUDA check of issue 5 on a machine with an NVIDIA GPU and no network:
#   bash benchmarks/gpu_check.sh [gpu_check.py options, e.g. --json out.json --fa2]
#
# It installs what is carried next to it in benchmarks/wheels/ (override with WHEELS=dir) into a
# private target dir (SITE, default /tmp/paged_hf_site), installs this repository there too, then
# runs benchmarks/gpu_check.py (see its docstring: agreement, then throughput; table + JSON).
#
# What to carry in benchmarks/wheels/ (fetch them where there is network; the GPU image used here
# has Python 3.12, torch 2.11 + CUDA 13, nvcc, ninja, numpy, einops, tabulate, nvidia-ml-py,
# safetensors, tokenizers 0.23, huggingface_hub 1.33 and transformers 5.17):
#   flashinfer-python 0.7.2.post1   py3-none-any (62 MB; kernels are JIT-compiled with the machine's
#                                   nvcc on first use, cached in ~/.cache/flashinfer)
#   apache-tvm-ffi 0.1.15.post2     cp312 manylinux_2_28_x86_64 (flashinfer >= 0.6 imports tvm_ffi)
#   transformers 5.24.0             py3-none-any (the version paged_hf is checked against)
#   paged_hf itself                 optional: without a paged_hf wheel the repository is installed
#                                   from source (setuptools, --no-build-isolation, offline)
# e.g.:  pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#          --platform manylinux_2_28_x86_64 -d benchmarks/wheels \
#          flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 transformers==5.24.0
# If the carried files must stay small (a 64 MiB transfer limit, say), a package may come as a
# .tar.xz of its installed tree instead of a wheel, unpacked into SITE as is: flashinfer's wheel,
# installed with `pip install --no-deps --target T` and packed with `tar -C T -cJf
# flashinfer.tar.xz flashinfer flashinfer_python-0.7.2.post1.dist-info`, is about 18 MB.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
WHEELS="${WHEELS:-$HERE/wheels}"
SITE="${SITE:-/tmp/paged_hf_site}"
PY="${PYTHON:-python3}"
mkdir -p "$SITE"

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
archives=("$WHEELS"/*.tar.xz)
if ((${#wheels[@]})); then
  echo "gpu_check: installing ${#wheels[@]} wheel(s) from $WHEELS into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
fi
for a in "${archives[@]}"; do
  echo "gpu_check: unpacking $a into $SITE"
  tar -xJf "$a" -C "$SITE"
done
if ! compgen -G "$WHEELS/paged_hf-*.whl" >/dev/null; then
  echo "gpu_check: installing paged_hf from $REPO (offline build, from a copy: the tree stays clean)"
  src="$(mktemp -d)"
  tar -C "$REPO" --exclude=.git --exclude=.venv --exclude=benchmarks/wheels --exclude=build -cf - . | tar -C "$src" -xf -
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$SITE" "$src"
  rm -rf "$src"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"  # ninja jobs for FlashInfer's JIT builds

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" - <<'EOF'
import torch, transformers, paged_hf
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
print("transformers", transformers.__version__, "paged_hf", paged_hf.__file__)
try:
    import flashinfer
    print("flashinfer", flashinfer.__version__)
except Exception as e:  # the check still runs: the torch backend rows show what is missing
    print("flashinfer NOT importable:", type(e).__name__, e)
EOF
exec "$PY" "$HERE/gpu_check.py" "$@"
