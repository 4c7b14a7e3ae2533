#!/usr/bin/env bash
# A branch against its base in one GPU call. The carried tree is the branch; its base is rebuilt in $AB_BASE
# (default /tmp/ab_base) from a copy of the tree with PATCH reversed (`git diff main...BRANCH -- rosekernels
# tests > .gpu-ab/x.patch`, made before the call). CMD (one string, run by bash) runs ROUNDS times in each tree,
# base then branch, with ARM (base / branch) and ROUND exported and a compile cache of its own arm, so clock and
# power drift reach both arms alike. A CMD that times a peer beside itself in the same process (bench/fp8.py,
# bench/attention.py, ...) gives ratios that compare across the processes. Each run's output goes to
# $AB_LOGS/ab_<arm>_<round>.log (default $OUT) and its last lines to the terminal. The carried bundles are installed
# once first (tools/gpu_env.sh: the base tree has none of its own). AB_WARM=S then runs CMD once in both trees side
# by side (ROUND=0: ignore what it writes; each under `timeout S`, ab_<arm>_warm.log, its exit status reported, not
# counted), so that the two arms' compiles share the host's cores; a warm-up that stops early leaves the rest of its
# compiles to round 1.
#   tools/gpu_ab.sh PATCH ROUNDS CMD
#   AB_LOGS=/tmp/ab tools/gpu_ab.sh .gpu-ab/fp8-poll.patch 2 \
#     'tools/gpu_env.sh python3 bench/fp8.py --quick --out /tmp/ab/${ARM}_$ROUND'; tar cJf $OUT/ab.tar.xz -C /tmp ab
#   (a call returns at most 8 files: the arms' results go back as one tarball)
#   AB_WARM=240 AB_LOGS=/tmp/ab tools/gpu_ab.sh ...    (compiles warmed side by side, then the rounds)
# Exit status: 0 every run passed, 1 a run failed (the others still ran), 2 bad arguments or a patch that does
# not reverse onto the tree (nothing run).
set -uo pipefail
if [ $# -ne 3 ] || ! [ -f "$1" ] || ! [[ "$2" =~ ^[1-9][0-9]*$ ]] || ! [[ "${AB_WARM:-1}" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: [AB_WARM=SECONDS] tools/gpu_ab.sh PATCH ROUNDS CMD (PATCH a file, ROUNDS >= 1, SECONDS >= 1)" >&2; exit 2
fi
patch_file=$(realpath "$1") rounds=$2 cmd=$3
cd "$(dirname "$0")/.."
branch=$PWD base=${AB_BASE:-/tmp/ab_base} logs=${AB_LOGS:-${OUT:-$PWD}}
reverse() {  # reverse the patch in the current directory ($1: --check for a dry run)
  if command -v patch >/dev/null; then patch -R -p1 -s -f ${1:+--dry-run} < "$patch_file" >/dev/null
  else git apply -R ${1:+--check} "$patch_file"; fi
}
reverse --check || { echo "gpu_ab: $1 does not reverse onto this tree" >&2; exit 2; }
rm -rf "$base" && mkdir -p "$base" "$logs"
# The bundles and caches stay out of the copy: gpu_env.sh finds what they installed in /tmp/site.
tar cf - --exclude=./.gpu --exclude=./.whl --exclude='./.gpu-*' --exclude=./.gpu_suite --exclude=./.git . \
  | tar xf - -C "$base"
(cd "$base" && reverse) || { echo "gpu_ab: reversing $1 failed in $base" >&2; exit 2; }
run_in() {  # run_in ARM ROUND [PREFIX...]: CMD in ARM's tree, with ARM, ROUND and the arm's compile cache
  local arm=$1 round=$2 dir=$base; shift 2
  [ "$arm" = branch ] && dir=$branch
  (cd "$dir" && ARM=$arm ROUND=$round ROSEKERNELS_CACHE_DIR=/tmp/ab_cache_$arm "$@" bash -c "$cmd")
}
if [ -f tools/gpu_env.sh ]; then
  bash tools/gpu_env.sh true || echo "gpu_ab: tools/gpu_env.sh could not install the carried bundles" >&2
fi
if [ -n "${AB_WARM:-}" ]; then
  declare -A warm
  for arm in base branch; do
    run_in $arm 0 timeout -k 10 "$AB_WARM" > "$logs/ab_${arm}_warm.log" 2>&1 &
    warm[$arm]=$!
  done
  for arm in base branch; do
    wait "${warm[$arm]}"; rc=$?
    echo "== $arm, warm-up: exit $rc$( [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo ", stopped at $AB_WARM s") ($logs/ab_${arm}_warm.log)"
  done
fi
status=0
for round in $(seq 1 "$rounds"); do
  for arm in base branch; do
    log=$logs/ab_${arm}_$round.log
    run_in $arm "$round" > "$log" 2>&1
    rc=$?
    echo "== $arm, round $round: exit $rc ($log)"; tail -n 5 "$log"
    [ $rc -eq 0 ] || status=1
  done
done
exit $status
