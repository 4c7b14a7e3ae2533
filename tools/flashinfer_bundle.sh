#!/usr/bin/env bash
# Make .gpu-flashinfer/ for tools/gpu_env.sh: FlashInfer (the paged-decode peer of bench/attention.py --kvcache)
# for the Python 3.12 GPU host, which has no package index but has nvcc (FlashInfer compiles its kernels there
# on first use, with ninja). The 101 MB wheel is cut to what its import and its decode kernels need: every
# Python file, the headers it compiles against (its own, CUTLASS, CCCL, spdlog) and the top level of its
# csrc (the decode sources), plus TVM-FFI's headers (tools/tvm_ffi_bundle.sh leaves them out) and the small
# packages its import reaches that the GPU image lacks (cuda-bindings is not one: CuTeDSL needs it, so the image
# has it, and a second copy here would shadow the one CuTeDSL runs with).
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHINFER=${FLASHINFER:-flashinfer-python==0.7.4}
DEPS="nvidia-ml-py ninja requests urllib3 idna certifi charset-normalizer tabulate click apache-tvm-ffi==0.1.15.post2"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
opts="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
--platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# shellcheck disable=SC2086
python3 -m pip download -q $opts -d "$tmp/w" "$FLASHINFER" $DEPS
mkdir "$tmp/site"
for w in "$tmp"/w/*.whl; do (cd "$tmp/site" && python3 -m zipfile -e "$w" .); done
python3 - "$tmp/site" <<'PY'
import pathlib, shutil, sys
site = pathlib.Path(sys.argv[1])
keep_trees = [site / "flashinfer" / "data" / p for p in ("include", "cutlass", "cccl", "spdlog")]
csrc = site / "flashinfer" / "data" / "csrc"
for path in sorted(site.joinpath("flashinfer").rglob("*"), reverse=True):
    if path.is_dir():
        if not any(path.iterdir()):
            path.rmdir()
        continue
    if path.suffix in (".py", ".pyi", ".json", ".jinja", ".txt", ".typed") or path.parent == csrc:
        continue
    if any(tree in path.parents for tree in keep_trees):
        continue
    path.unlink()
for path in site.glob("*.dist-info/RECORD"):
    path.unlink()
# The ninja wheel keeps its binary among the wheel's scripts, which unzipping leaves unexecutable.
(site / "bin").mkdir()
for script in site.glob("ninja-*.data/scripts/ninja"):
    script.rename(site / "bin" / "ninja")
    (site / "bin" / "ninja").chmod(0o755)
for data in site.glob("ninja-*.data"):
    shutil.rmtree(data)
# TVM-FFI is installed from .whl/ already: keep only the headers FlashInfer's builds include.
tvm = site / "tvm_ffi"
for child in list(tvm.iterdir()):
    if child.name not in ("include", "3rdparty"):
        shutil.rmtree(child) if child.is_dir() else child.unlink()
for child in list((tvm / "3rdparty").iterdir()) if (tvm / "3rdparty").is_dir() else []:
    if child.name != "dlpack":
        shutil.rmtree(child) if child.is_dir() else child.unlink()
for info in site.glob("apache_tvm_ffi-*.dist-info"):
    shutil.rmtree(info)
PY
mkdir -p .gpu-flashinfer
tar cf - -C "$tmp/site" . | xz -9 -T2 > .gpu-flashinfer/flashinfer.tar.xz
cat > .gpu-flashinfer/install.sh <<'INS'
#!/usr/bin/env bash
# Unpack FlashInfer into /tmp/site (after .gpu and .whl); ninja, which its builds call, lands in /tmp/site/bin.
set -e
here=$(dirname "$0")
[ -d /tmp/site/tvm_ffi ] || { echo "TVM-FFI is not installed on this host yet: carry .whl first" >&2; exit 1; }
if [ ! -f /tmp/site/.flashinfer ]; then
  tar xJf "$here/flashinfer.tar.xz" -C /tmp/site
  touch /tmp/site/.flashinfer
fi
INS
chmod +x .gpu-flashinfer/install.sh
du -sh .gpu-flashinfer
