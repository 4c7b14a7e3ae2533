#!/usr/bin/env bash
# The GPU suite on the GPU host (tools/gpu_suite.py: what runs, the state, the resume): installs the carried
# CuTeDSL bundles through tools/gpu_env.sh, then runs one call of at most --budget seconds (default 540),
# counted from here, so that the install is part of it.
#   tools/gpu_suite.sh --out "$OUT" [--commit HASH] [--resume FILE] [--sample] [--jobs N] [--budget S]
set -e
started=$(date +%s)
cd "$(dirname "$0")/.."
exec tools/gpu_env.sh python3 tools/gpu_suite.py run --started "$started" "$@"
