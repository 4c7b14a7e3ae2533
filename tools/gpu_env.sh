#!/usr/bin/env bash
# Run a command on a GPU host that has no package index (the lent H200): unpack the carried CuTeDSL bundle
# (.gpu/, from ../shared/gpu/bundle.sh) and TVM-FFI (.whl/tvm_ffi.tar.xz: the apache-tvm-ffi cp312 wheel unpacked,
# headers and sources dropped so both fit the 64 MiB transfer) into /tmp/site, then exec the command.
set -e
cd "$(dirname "$0")/.."
bash .gpu/install.sh
tar xJf .whl/tvm_ffi.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
export PYTHONUNBUFFERED=1
exec "$@"
