#!/usr/bin/env bash
# The first call to a fresh GPU host carries the CuTeDSL bundles (.gpu, .whl: about 62 MiB) beside the working
# tree, under the runner's 64 MiB. `on` leaves out of the tree what such a call does not read (the tests, the
# results, the docs, the shipped tuned entries: the tuner's own measurements run without
# them), by untracking them in the index and ignoring them in .git/info/exclude; `off` puts them back. Nothing
# is committed in between: `on` refuses a tree with staged changes, and a commit made while on would drop those paths.
#   tools/gpu_slim.sh on     # then the call, carry [".gpu", ".whl", "bench/results/sip/sass_latency.json.gz"]
#   tools/gpu_slim.sh off    # before any commit; later calls (the host warm) carry the whole tree
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PATHS=(bench/results tests examples CHANGELOG.md NOTES.md README.md DESIGN.md rosekernels/tuned_entries)
LIMIT=$((64 << 20))
exclude=.git/info/exclude
begin="# gpu_slim: begin" end="# gpu_slim: end"  # gitignore has no comments at a line's end: a block
case "${1:-}" in
  on)
    if grep -qx "$begin" "$exclude" 2>/dev/null; then echo "gpu_slim: on already" >&2; exit 1; fi
    if ! git diff --cached --quiet; then echo "gpu_slim: the index has staged changes: commit them first" >&2; exit 1; fi
    present=()
    for p in "${PATHS[@]}"; do [ -e "$p" ] && present+=("$p"); done
    git rm -r -q --cached -- "${present[@]}"
    mkdir -p "$(dirname "$exclude")"
    { echo "$begin"; printf '/%s\n' "${present[@]}"; echo "$end"; } >> "$exclude"
    # what the call carries: the tree as it will travel (tracked, and untracked but not ignored) and the bundles
    tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s -- 2>/dev/null \
      | awk '{s += $1} END {print s + 0}' || true)
    bundles=$( { find .gpu .whl -type f -printf '%s\n' 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}')
    total=$((tree + bundles))
    echo "gpu_slim: on; the tree $tree bytes + .gpu and .whl $bundles bytes = $total of $LIMIT"
    if [ "$total" -gt "$LIMIT" ]; then echo "gpu_slim: over the limit: leave more out" >&2; exit 2; fi
    ;;
  off)
    if ! grep -qx "$begin" "$exclude" 2>/dev/null; then echo "gpu_slim: off already" >&2; exit 1; fi
    mapfile -t back < <(sed -n "\|^$begin\$|,\|^$end\$|p" "$exclude" | grep -v '^#' | sed 's|^/||')
    sed -i "\|^$begin\$|,\|^$end\$|d" "$exclude"
    git reset -q -- "${back[@]}"
    echo "gpu_slim: off"
    ;;
  *)
    echo "usage: tools/gpu_slim.sh on|off" >&2
    exit 2
    ;;
esac
