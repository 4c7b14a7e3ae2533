#!/usr/bin/env bash
# Run a command on a GPU host that has no package index (the lent H200), with CuTeDSL and the benchmark peers
# importable from /tmp/site. What is carried gets installed:
#   .gpu/        CuTeDSL bundle (../shared/gpu/bundle.sh)
#   .whl/        tvm_ffi.tar.xz (tools/tvm_ffi_bundle.sh)
#   .gpu-peers/  quack, flash-attn-4, liger (../shared/gpu/bundle.sh --peers)
# The bundles do not all fit in one 64 MiB transfer: carry .gpu + .whl first, then .gpu-peers in the next call while
# the machine is still warm (it keeps /tmp/site).
set -e
cd "$(dirname "$0")/.."
if [ -f .gpu/install.sh ]; then bash .gpu/install.sh; fi
if [ -f .whl/tvm_ffi.tar.xz ]; then tar xJf .whl/tvm_ffi.tar.xz -C /tmp/site; fi
if [ -f .gpu-peers/install.sh ]; then bash .gpu-peers/install.sh; fi
ls /tmp/site/.dsl-* /tmp/site/tvm_ffi >/dev/null 2>&1 || { echo "CuTeDSL or TVM-FFI missing: carry .gpu and .whl" >&2; exit 3; }
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
export PYTHONUNBUFFERED=1
exec "$@"
