#!/usr/bin/env bash
# Make .gpu-deepgemm/ for tools/gpu_env.sh: DeepGEMM, bench/fp8.py's block-scaled FP8 GEMM peer, for the GPU host,
# which has nvcc 13.0 and g++ but no network. DeepGEMM has no wheel on the index: this carries its source at
# DEEPGEMM_REV with the CUTLASS and fmt headers its submodules pin, and `wheel` (its setup.py imports it); the
# host builds its small C++ extension (one .cpp against torch) and JIT-compiles the kernels on first use.
# Sources: git repositories (clones or bare mirrors) in DEEPGEMM_GIT, CUTLASS_GIT and FMT_GIT, else GitHub.
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${DEEPGEMM_REV:-54e2261}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
repo() {  # repo NAME URL: the git directory to read NAME from
  local given="${3:-}"
  if [ -n "$given" ]; then echo "$given"; else git clone -q --bare --filter=blob:none "$2" "$tmp/$1.git"; echo "$tmp/$1.git"; fi
}
dg=$(repo deepgemm https://github.com/deepseek-ai/DeepGEMM.git "${DEEPGEMM_GIT:-}")
mkdir -p "$tmp/tree"
git -C "$dg" archive "$REV" | tar x -C "$tmp/tree"
pinned() { git -C "$dg" ls-tree "$REV" "third-party/$1" | awk '{print $3}'; }
cutlass=$(repo cutlass https://github.com/NVIDIA/cutlass.git "${CUTLASS_GIT:-}")
fmt=$(repo fmt https://github.com/fmtlib/fmt.git "${FMT_GIT:-}")
git -C "$cutlass" archive "$(pinned cutlass)" include | tar x -C "$tmp/tree/third-party/cutlass"
git -C "$fmt" archive "$(pinned fmt)" include | tar x -C "$tmp/tree/third-party/fmt"
rm -rf .gpu-deepgemm && mkdir -p .gpu-deepgemm
tar cf - -C "$tmp/tree" . | xz -9 -T2 > .gpu-deepgemm/deepgemm.tar.xz
python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu-deepgemm wheel
cat > .gpu-deepgemm/install.sh <<'INS'
#!/usr/bin/env bash
# Build DeepGEMM in /tmp/deepgemm (once per host: about a minute) and link its package into /tmp/site; the log of
# a failed build is /tmp/deepgemm/build.log, and the failure leaves the other bundles usable.
set -e
here=$(cd "$(dirname "$0")" && pwd)
D=/tmp/deepgemm
[ -f $D/.built ] && exit 0
rm -rf $D && mkdir -p $D
tar xJf "$here/deepgemm.tar.xz" -C $D
python3 -c "import wheel" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site "$here"/wheel-*.whl
nvcc=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | sort -V | tail -n 1)
cd $D
ln -sf $D/third-party/cutlass/include/cutlass $D/third-party/cutlass/include/cute deep_gemm/include/
if CUDA_HOME=$(dirname "$(dirname "$nvcc")") DG_USE_LOCAL_VERSION=0 PYTHONPATH=/tmp/site:${PYTHONPATH:-} \
    python3 setup.py build > build.log 2>&1; then
  ln -sf "$D/$(find build -name '_C*.so' | head -n 1)" deep_gemm/
  ln -sfn $D/deep_gemm /tmp/site/deep_gemm
  touch $D/.built
else
  echo "DeepGEMM did not build (tail of $D/build.log):" >&2; tail -n 20 build.log >&2
fi
INS
chmod +x .gpu-deepgemm/install.sh
du -sh .gpu-deepgemm
