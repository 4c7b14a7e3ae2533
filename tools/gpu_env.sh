#!/usr/bin/env bash
# Run a command on a GPU host that has no package index (the lent H200), with CuTeDSL and the benchmark peers
# importable from /tmp/site. What is carried gets installed:
#   .gpu/        CuTeDSL bundle (../shared/gpu/bundle.sh)
#   .whl/        tvm_ffi.tar.xz (tools/tvm_ffi_bundle.sh)
#   .gpu-peers/  quack, flash-attn-4, liger (../shared/gpu/bundle.sh --peers)
#   .gpu-flashinfer/  FlashInfer, the paged-decode peer (tools/flashinfer_bundle.sh), after .whl
#   .gpu-deepgemm/    DeepGEMM's source, built here on first use (tools/deepgemm_bundle.sh)
# The bundles do not all fit in one 64 MiB transfer: carry .gpu + .whl first, then .gpu-peers in the next call while
# the machine is still warm (it keeps /tmp/site).
set -e
cd "$(dirname "$0")/.."
# One install at a time: runs of trees that carry bundles, started side by side, would otherwise unpack over
# each other or remove each other's DeepGEMM build.
mkdir -p /tmp/site
exec {lock}>/tmp/site/.install.lock
if command -v flock >/dev/null; then flock "$lock"; else echo "gpu_env: no flock: installs are not serialized" >&2; fi
if [ -f .gpu/install.sh ]; then bash .gpu/install.sh; fi
# Once per host (a stamp, as .gpu's): unpacking again would rewrite files that a running process has loaded.
if [ -f .whl/tvm_ffi.tar.xz ] && [ ! -f /tmp/site/.tvm_ffi ]; then
  tar xJf .whl/tvm_ffi.tar.xz -C /tmp/site && touch /tmp/site/.tvm_ffi
fi
if [ -f .gpu-peers/install.sh ]; then bash .gpu-peers/install.sh; fi
if [ -f .gpu-flashinfer/install.sh ]; then bash .gpu-flashinfer/install.sh; fi
if [ -f .gpu-deepgemm/install.sh ]; then bash .gpu-deepgemm/install.sh || echo "DeepGEMM left out" >&2; fi
exec {lock}>&-
ls /tmp/site/.dsl-* /tmp/site/tvm_ffi >/dev/null 2>&1 || { echo "CuTeDSL or TVM-FFI missing: carry .gpu and .whl" >&2; exit 3; }
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
# FlashInfer's JIT builds call ninja and nvcc (.gpu-flashinfer).
if [ -d /tmp/site/bin ]; then export PATH=/tmp/site/bin:$PATH; fi
if [ -z "${CUDA_HOME:-}" ]; then
  nvcc=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$nvcc" ]; then export CUDA_HOME=$(dirname "$(dirname "$nvcc")"); fi
fi
export PYTHONUNBUFFERED=1
exec "$@"
