"""Where the on-disk caches live: the one place that decides both roots, importing neither CuTeDSL
nor torch (`sip-tune --list` reads the tuned store from a process that loads neither).

    compile_cache_root()   the compile cache (`rosekernels.jit`: <root>/jit/<toolchain>/...):
                           `use_compile_cache_root`'s choice in this process (`warmup(cache_dir=)`,
                           `rosekernels-cache build`), else $ROSEKERNELS_CACHE_DIR, else
                           <user cache dir>/rosekernels.
    tuned_store_root()     the tuned store (`rosekernels.tuned`): a folder the caller names, else
                           `use_tuned_store_root`'s choice in this process (`warmup(store_root=)`),
                           else $SIP_CACHE_DIR, else <compile cache root>/sip.

Everything that reads or writes either cache (warm-up, jit, the store, sip-tune, rosekernels-cache)
asks these two; a parameter naming the tuned store's root is called `store_root` throughout. Both
write their files with `write_atomic`.
"""
from __future__ import annotations

import os
from pathlib import Path

COMPILE_CACHE_ENV = "ROSEKERNELS_CACHE_DIR"
TUNED_STORE_ENV = "SIP_CACHE_DIR"

_compile_cache: Path | None = None  # use_compile_cache_root's choice; None: the environment's
_tuned_store: Path | None = None  # use_tuned_store_root's choice; None: the environment's


def use_compile_cache_root(root: str | os.PathLike | None) -> None:
    """Where this process reads and writes the compile cache from now on (None: the environment's)."""
    global _compile_cache
    _compile_cache = Path(root) if root is not None else None


def use_tuned_store_root(root: str | os.PathLike | None) -> None:
    """Where this process's ops and warm-up read the tuned store from now on (None: the environment's)."""
    global _tuned_store
    _tuned_store = Path(root) if root is not None else None


def compile_cache_root() -> Path:
    if _compile_cache is not None:
        return _compile_cache
    env = os.environ.get(COMPILE_CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rosekernels"


def tuned_store_root(store_root: str | os.PathLike | None = None) -> Path:
    """`store_root` if given, else this process's choice, else $SIP_CACHE_DIR, else <compile cache root>/sip."""
    if store_root is not None:
        return Path(store_root)
    if _tuned_store is not None:
        return _tuned_store
    env = os.environ.get(TUNED_STORE_ENV)
    if env:
        return Path(env)
    return compile_cache_root() / "sip"


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` (a temporary file beside it, then os.replace): a reader sees the old
    file or the new one, never part of one. The file gets the mode open() would give it (0o666 less
    the umask), not tempfile's 0o600: a cache shared between users or baked into an image stays
    readable."""
    tmp = path.with_name(f".{path.name}.{os.urandom(8).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
