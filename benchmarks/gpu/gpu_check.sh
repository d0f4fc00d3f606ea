#!/usr/bin/env bash
# The CUDA check on a machine with an NVIDIA GPU and no network:
#   bash benchmarks/gpu/gpu_check.sh [gpu_check.py options, e.g. --call 1]
#
# The plan for a lent GPU (15 minutes of device time in all, at most 10 a command; a fresh machine
# starts in a minute or two). Fetch and size the carried set here first:
#   bash benchmarks/gpu/fetch_gpu_wheels.sh            # benchmarks/gpu/wheels/, ~32 MiB of the 64 a call carries
# Call 1 (timeout_s 360; expect ~2-3 min of FlashInfer JIT, FA2 prefill, on 16 cores):
#   run(command="bash benchmarks/gpu/gpu_check.sh --call 1", carry=["benchmarks/gpu/wheels"], timeout_s=360)
#   -> env and versions; the FlashInfer-only smoke test (prefill over shuffled pages, decode on both
#      kernels, a captured graph re-planned and replayed, against fp32); agreement on llama (graphs
#      on and off, torch); paged_hf eager and graphs at 128 requests. No transformers baselines.
# Between the calls: call 1 leaves its compiled kernels in $OUT/flashinfer_jit.tar.xz when they pack
# under 28 MiB (gpu_check.json's "jit_cache" gives the sizes); copy it from files_at into
# benchmarks/gpu/wheels/ and call 2 unpacks it and compiles only what call 1 did not.
# Call 2 (timeout_s 300, the kernels of call 1 compiled again unless carried):
#   run(command="bash benchmarks/gpu/gpu_check.sh --call 2", carry=["benchmarks/gpu/wheels"], timeout_s=300)
#   -> agreement on gemma2 (window + soft-cap) and qwen3; an engine sized by profiling and swap
#      preemption (memory); transformers' generate and generate_batch capped at 45 s; decode step
#      time at batch 64, eager against graphs.
# Every phase runs in a subprocess of its own; $OUT/gpu_check.json, gpu_check.log and summary.md
# are rewritten after each, so a call stopped at its limit keeps what it finished. Without
# flashinfer and tvm_ffi importable the script stops at once (ALLOW_TORCH_ONLY=1 runs anyway).
#
# It installs what is carried next to it in benchmarks/gpu/wheels/ (override with WHEELS=dir) into a
# private target dir (SITE, default /tmp/paged_hf_site), installs this repository there too, then
# runs benchmarks/gpu/gpu_check.py (see its docstring: agreement, then throughput; table + JSON).
#
# What to carry in benchmarks/gpu/wheels/: `bash benchmarks/gpu/fetch_gpu_wheels.sh` fetches and packs it
# where there is network (about 32 MiB, pins from constraints/):
#   flashinfer-python 0.7.2.post1   as flashinfer-*.tar.xz, its installed tree (the 62 MB wheel is
#                                   mostly CUDA sources; kernels are JIT-compiled with the machine's
#                                   nvcc on first use, cached in ~/.cache/flashinfer)
#   apache-tvm-ffi 0.1.15.post2     cp312 wheel (flashinfer imports tvm_ffi)
#   transformers 5.24.0             the version paged_hf is tested against
# Any *.whl there is installed, any *.tar.xz unpacked into SITE as is. paged_hf itself comes from
# this repository (setuptools, --no-build-isolation, offline) unless a paged_hf wheel is carried.
# The GPU image this was written for has Python 3.12, torch 2.11 + CUDA 13, nvcc, ninja, numpy,
# einops, tabulate, nvidia-ml-py, safetensors, tokenizers and transformers 5.17.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$(dirname "$HERE")")"
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
  tar -C "$REPO" --exclude=.git --exclude='.venv*' --exclude=benchmarks/gpu/wheels --exclude=build -cf - . | tar -C "$src" -xf -
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$SITE" "$src"
  rm -rf "$src"
fi
# FlashInfer kernels an earlier call compiled (its $OUT/flashinfer_jit.tar.xz, copied into WHEELS):
# unpacked with their times, so ninja finds them up to date and builds nothing
JIT_DIR="${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer"
if [[ -f "$WHEELS/flashinfer_jit.tar.xz" ]]; then
  echo "gpu_check: unpacking compiled FlashInfer kernels into $JIT_DIR"
  mkdir -p "$JIT_DIR"
  tar -xJf "$WHEELS/flashinfer_jit.tar.xz" -C "$JIT_DIR"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"  # ninja jobs for FlashInfer's JIT builds

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
cd "$HERE"  # so the versions printed are the ones gpu_check.py imports (SITE first, not the repo root)
"$PY" - <<'EOF'
import torch, transformers, paged_hf
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
print("transformers", transformers.__version__, "paged_hf", paged_hf.__file__)
EOF
dry=0
for a in "$@"; do [[ "$a" == "--dry-run" ]] && dry=1; done
if [[ $dry == 0 && "${ALLOW_TORCH_ONLY:-0}" != 1 ]]; then
  # fail fast: a check without FlashInfer would time the torch backend for minutes and prove nothing
  if ! "$PY" -c "import tvm_ffi, flashinfer; print('flashinfer', flashinfer.__version__, 'tvm_ffi ok')"; then
    echo "gpu_check: flashinfer / tvm_ffi do not import (see above): stopping (ALLOW_TORCH_ONLY=1 to run anyway)" >&2
    exit 3
  fi
fi
exec "$PY" "$HERE/gpu_check.py" "$@"
