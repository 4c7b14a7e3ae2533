#!/usr/bin/env bash
# Make .whl/tvm_ffi.tar.xz for tools/gpu_env.sh: apache-tvm-ffi for Python 3.12 x86_64, without headers and sources
# (not needed to call kernels), so it fits beside the CuTeDSL bundle in one 64 MiB transfer.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$tmp" apache-tvm-ffi==0.1.15.post2
mkdir "$tmp/x" && (cd "$tmp/x" && python3 -m zipfile -e "$tmp"/apache_tvm_ffi-*.whl .)
rm -rf "$tmp/x/tvm_ffi/include" "$tmp/x/tvm_ffi/3rdparty" "$tmp/x/tvm_ffi/src"
mkdir -p .whl && tar cf - -C "$tmp/x" . | xz -9e > .whl/tvm_ffi.tar.xz
rm -rf "$tmp"; ls -la .whl/tvm_ffi.tar.xz
