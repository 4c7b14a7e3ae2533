#!/usr/bin/env bash
# Make .gpu-deepgemm/ for tools/gpu_env.sh: DeepGEMM, bench/fp8.py's block-scaled FP8 GEMM peer, for the GPU host,
# which has nvcc 13.0 and g++ but no network. DeepGEMM has no wheel on the index: this carries its source at
# DEEPGEMM_REV with the CUTLASS and fmt headers its submodules pin, and `wheel` (its setup.py imports it); the
# host builds its small C++ extension (one .cpp against torch) and JIT-compiles the kernels on first use.
# Sources: DEEPGEMM_GIT, CUTLASS_GIT and FMT_GIT may name local git directories (clones or bare mirrors) that
# hold the commits; otherwise each commit is fetched alone (depth 1) from GitHub.
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${DEEPGEMM_REV:-54e22612409371d6364144b69086735beb54e98b}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
repo() {  # repo NAME URL COMMIT [LOCAL]: a git directory that holds COMMIT
  if [ -n "${4:-}" ]; then echo "$4"; return; fi
  git init -q --bare "$tmp/$1.git"
  git -C "$tmp/$1.git" fetch -q --depth 1 "$2" "$3"
  echo "$tmp/$1.git"
}
dg=$(repo deepgemm https://github.com/deepseek-ai/DeepGEMM.git "$REV" "${DEEPGEMM_GIT:-}")
pinned() { git -C "$dg" ls-tree "$REV" "third-party/$1" | awk '{print $3}'; }
cutlass_rev=$(pinned cutlass)
fmt_rev=$(pinned fmt)
cutlass=$(repo cutlass https://github.com/NVIDIA/cutlass.git "$cutlass_rev" "${CUTLASS_GIT:-}")
fmt=$(repo fmt https://github.com/fmtlib/fmt.git "$fmt_rev" "${FMT_GIT:-}")
mkdir -p "$tmp/tree"
git -C "$dg" archive "$REV" | tar x -C "$tmp/tree"
git -C "$cutlass" archive "$cutlass_rev" include | tar x -C "$tmp/tree/third-party/cutlass"
git -C "$fmt" archive "$fmt_rev" include | tar x -C "$tmp/tree/third-party/fmt"
rm -rf .gpu-deepgemm && mkdir -p .gpu-deepgemm
tar cf - -C "$tmp/tree" . | xz -9 -T2 > .gpu-deepgemm/deepgemm.tar.xz
printf 'DeepGEMM %s\nCUTLASS %s\nfmt %s\n' "$REV" "$cutlass_rev" "$fmt_rev" > .gpu-deepgemm/VERSION
python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu-deepgemm wheel==0.48.0
cat > .gpu-deepgemm/install.sh <<'INS'
#!/usr/bin/env bash
# Build DeepGEMM in /tmp/deepgemm (about a minute) and link its package into /tmp/site, once per host: a build
# that failed is not tried again on that host (its log: /tmp/deepgemm/build.log). Exits 1 when DeepGEMM is not
# usable; tools/gpu_env.sh goes on without it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
D=/tmp/deepgemm
[ -f $D/.built ] && exit 0
if [ -f $D/.failed ]; then echo "DeepGEMM: its build failed earlier on this host ($D/build.log)" >&2; exit 1; fi
rm -rf $D && mkdir -p $D
tar xJf "$here/deepgemm.tar.xz" -C $D
touch $D/.failed  # until the build below succeeds
python3 -c "import wheel" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site "$here"/wheel-*.whl
cuda=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc | sort -V | tail -n 1)")")}
cd $D
ln -sf $D/third-party/cutlass/include/cutlass $D/third-party/cutlass/include/cute deep_gemm/include/
if ! CUDA_HOME=$cuda DG_USE_LOCAL_VERSION=0 PYTHONPATH=/tmp/site:${PYTHONPATH:-} python3 setup.py build \
    > build.log 2>&1; then
  echo "DeepGEMM did not build (tail of $D/build.log):" >&2; tail -n 20 build.log >&2; exit 1
fi
so=$(find build -name '_C*.so' | head -n 1)
[ -n "$so" ] || { echo "DeepGEMM: the build made no _C extension ($D/build.log)" >&2; exit 1; }
ln -sf "$D/$so" deep_gemm/
ln -sfn $D/deep_gemm /tmp/site/deep_gemm
rm $D/.failed && touch $D/.built
INS
chmod +x .gpu-deepgemm/install.sh
du -sh .gpu-deepgemm
