#!/usr/bin/env bash
# Fetch, where there is network, what benchmarks/gpu/gpu_check.sh installs on a GPU machine without it:
#   bash benchmarks/gpu/fetch_gpu_wheels.sh            # -> benchmarks/gpu/wheels/ (gitignored)
#   PYVER=3.11 OUT=/tmp/w bash benchmarks/gpu/fetch_gpu_wheels.sh   # for another Python
#
# Pins come from constraints/flashinfer.txt (flashinfer-python, apache-tvm-ffi) and
# constraints/cpu.txt (transformers, the version paged_hf is tested against). flashinfer's wheel
# is 62 MB, mostly CUDA sources for its JIT; it is installed here and packed as a .tar.xz of the
# installed tree (~17 MB), which gpu_check.sh unpacks as is, so the whole set stays under the
# 64 MiB a device call may carry. nvidia-ml-py and the rest of flashinfer's import needs are in
# the GPU image (see gpu_check.sh's header).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$(dirname "$HERE")")"
OUT="${OUT:-$HERE/wheels}"
PYVER="${PYVER:-3.12}"           # the GPU image's Python
PY="${PYTHON:-python3}"
LIMIT_MIB="${LIMIT_MIB:-64}"

pin() { grep -E "^$1==" "$2" | head -1; }
FLASHINFER="$(pin flashinfer-python "$REPO/constraints/flashinfer.txt")"
TVM_FFI="$(pin apache-tvm-ffi "$REPO/constraints/flashinfer.txt")"
TRANSFORMERS="$(pin transformers "$REPO/constraints/cpu.txt")"
for p in FLASHINFER TVM_FFI TRANSFORMERS; do
  [[ -n "${!p}" ]] || { echo "fetch_gpu_wheels: no pin for $p in constraints/" >&2; exit 2; }
done

mkdir -p "$OUT"
rm -f "$OUT"/*.whl "$OUT"/*.tar.xz
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
abi="cp${PYVER/./}"
echo "fetch_gpu_wheels: $FLASHINFER $TVM_FFI $TRANSFORMERS for CPython $PYVER -> $OUT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --abi "$abi" --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform any -d "$tmp" \
  "$FLASHINFER" "$TVM_FFI" "$TRANSFORMERS"
mv "$tmp"/apache_tvm_ffi-*.whl "$tmp"/transformers-*.whl "$OUT"/

# flashinfer: install the wheel's files into a scratch tree and pack that (pure Python + sources).
"$PY" -m pip install -q --no-deps --no-compile --target "$tmp/site" "$tmp"/flashinfer_python-*.whl
version="${FLASHINFER#*==}"
( cd "$tmp/site" && tar -cf - flashinfer flashinfer_python-*.dist-info | xz -T0 -6 > "$OUT/flashinfer-$version.tar.xz" )

ls -l "$OUT"
total=$(du -cb "$OUT"/* | tail -1 | cut -f1)
echo "fetch_gpu_wheels: $((total / 1048576)) MiB in all (limit $LIMIT_MIB MiB per device call)"
if (( total > LIMIT_MIB * 1048576 )); then
  echo "fetch_gpu_wheels: over the limit: carry the flashinfer archive in a separate call" >&2
  exit 1
fi
