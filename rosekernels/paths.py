"""Where the on-disk caches live, without importing CuTeDSL or torch (`sip-tune --list` reads the tuned
store from a process that loads neither)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of the on-disk caches: $ROSEKERNELS_CACHE_DIR, else the user cache dir."""
    env = os.environ.get("ROSEKERNELS_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rosekernels"
