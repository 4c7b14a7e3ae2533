"""The store of tuned cubins: what `sip-tune` writes and `rosekernels.warmup` loads.

Layout: <root>/<toolchain>/<kernel>/<Variant.key()>/<sha256 of the original cubin>/ holding
`tuned.cubin`, `original.cubin` and `meta.json` (medians, speedup, samples passed, search parameters,
seed, GPU, date). The variant key names op, mode, arch and every compile-time parameter; the toolchain
and the original's hash make an entry unusable the moment the kernel compiles differently, and the
stored original lets `warmup` install a tuned cubin before compiling (`jit.install_tuned_cubin` keys by
the original's bytes, so a tuned cubin can never be loaded for another original).

Writers hold a file lock per entry and replace each file atomically (tempfile + os.replace);
`meta.json` goes last and records the tuned cubin's hash, so a reader can always tell a whole entry
from a broken one. Anything wrong with an entry (truncated cubin, bad JSON, hash or size mismatch,
not an sm_90 cubin) gives a warning and no tuned cubin: the untuned kernel runs.

It lives with the code that loads it; the tuner (`sip_tune`) writes through it. The default root and
the current toolchain come from `rosekernels.jit` (which imports CuTeDSL), imported only when needed:
listing a given root imports neither CuTeDSL nor torch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import tempfile
import warnings
from pathlib import Path
from typing import Any

import filelock

from sip import SipError, cubin, fatbin

ENV_VAR = "SIP_CACHE_DIR"
FORMAT = 1
_LOCK_TIMEOUT_S = 60.0


class CacheError(ValueError):
    """An entry that must not be used."""


def default_root() -> Path:
    """$SIP_CACHE_DIR, else <rosekernels cache dir>/sip."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    from rosekernels import jit

    return jit.cache_dir() / "sip"


def resolve_root(root: str | os.PathLike | None) -> Path:
    return Path(root) if root is not None else default_root()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_sm90_cubin(data: bytes) -> None:
    """Raise CacheError unless `data` is one whole sm_90/sm_90a cubin with kernel code (read with
    the engine's parser: arch, sections, symbols, kernels)."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise CacheError("not an ELF image")
    try:
        parsed = cubin.parse_cubin(data)  # refuses other architectures
        size = fatbin.elf_size(data)
    except (SipError, fatbin.FatbinError, struct.error, IndexError, ValueError) as e:
        raise CacheError(f"not a cubin SIP can read: {e}") from None
    if size != len(data):
        raise CacheError(f"ELF headers describe {size} bytes, the file has {len(data)}")
    if not parsed.kernel_names:
        raise CacheError("the cubin holds no kernel code")


@dataclasses.dataclass(frozen=True)
class Entry:
    path: Path  # the entry's directory
    meta: dict[str, Any]
    original: bytes
    tuned: bytes

    @property
    def speedup(self) -> float:
        return float(self.meta.get("speedup", 0.0))


def current_toolchain() -> str:
    from rosekernels import jit

    return jit.TOOLCHAIN


def entry_dir(root: Path, kernel: str, variant_key: str, original_sha256: str, toolchain: str | None = None) -> Path:
    toolchain = toolchain or current_toolchain()
    for part in (kernel, variant_key, toolchain):
        if not part or "/" in part or part in (".", ".."):
            raise ValueError(f"bad cache key component {part!r}")
    if len(original_sha256) != 64:
        raise ValueError("original_sha256 must be a full SHA-256 hex digest")
    return root / toolchain / kernel / variant_key / original_sha256


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
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


def _lock(directory: Path) -> filelock.FileLock:
    return filelock.FileLock(str(directory / ".lock"), timeout=_LOCK_TIMEOUT_S)


def _read_entry(directory: Path) -> Entry:
    """The entry in `directory`, fully verified; CacheError on any defect."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        tuned = (directory / "tuned.cubin").read_bytes()
        original = (directory / "original.cubin").read_bytes()
    except FileNotFoundError as e:
        raise CacheError(f"missing {Path(e.filename).name}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheError(f"unreadable: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CacheError("meta.json is not a format-1 entry")
    try:
        want_original, want_tuned = meta["original_sha256"], meta["tuned_sha256"]
    except KeyError as e:
        raise CacheError(f"meta.json lacks {e}") from None
    if directory.name != want_original or sha256(original) != want_original:
        raise CacheError("the stored original cubin does not match the entry's hash")
    if sha256(tuned) != want_tuned:
        raise CacheError("tuned.cubin does not match the hash in meta.json (truncated or overwritten)")
    if len(tuned) != len(original):
        raise CacheError(f"tuned cubin has {len(tuned)} bytes, the original {len(original)}")
    check_sm90_cubin(tuned)
    return Entry(directory, meta, original, tuned)


def _read_locked(directory: Path) -> Entry:
    try:
        lock = _lock(directory)
        with lock:
            return _read_entry(directory)
    except (OSError, filelock.Timeout):  # read-only cache or a stuck writer: the hashes still guard us
        return _read_entry(directory)


def store(root: str | os.PathLike | None, kernel: str, variant: Any, original: bytes, tuned: bytes,
          meta: dict[str, Any], *, keep_better: bool = True, toolchain: str | None = None) -> tuple[Path, bool]:
    """Write an entry for `variant` (a jit.Variant); return (its directory, written?).

    With `keep_better`, an existing valid entry with a higher measured speedup is kept (two tuners of
    the same kernel: the better result wins, whichever finishes last)."""
    toolchain = toolchain or current_toolchain()
    if len(tuned) != len(original):
        raise ValueError(f"tuned cubin has {len(tuned)} bytes, the original {len(original)}")
    check_sm90_cubin(tuned)
    root = resolve_root(root)
    directory = entry_dir(root, kernel, variant.key(), sha256(original), toolchain)
    directory.mkdir(parents=True, exist_ok=True)
    full = {
        **meta,
        "format": FORMAT,
        "kernel": kernel,
        "variant": variant.as_dict(),
        "spec_key": variant.key(),
        "mode": variant.mode,
        "arch": variant.arch,
        "toolchain": toolchain,
        "original_sha256": sha256(original),
        "tuned_sha256": sha256(tuned),
        "cubin_bytes": len(tuned),
    }
    with _lock(directory):
        if keep_better:
            try:
                old = _read_entry(directory)
            except CacheError:
                old = None
            if old is not None and old.speedup > float(full.get("speedup", 0.0)):
                return directory, False
        _atomic_write(directory / "original.cubin", original)
        _atomic_write(directory / "tuned.cubin", tuned)
        _atomic_write(directory / "meta.json", json.dumps(full, indent=1, sort_keys=True).encode())
    return directory, True


def lookup(root: str | os.PathLike | None, kernel: str, variant: Any, original: bytes,
           toolchain: str | None = None) -> Entry | None:
    """The verified entry for exactly this original cubin, or None (with a warning if it is broken)."""
    directory = entry_dir(resolve_root(root), kernel, variant.key(), sha256(original), toolchain)
    if not directory.is_dir():
        return None
    try:
        entry = _read_locked(directory)
    except CacheError as e:
        warnings.warn(f"sip: ignoring tuned-cubin cache entry {directory}: {e}; using the untuned kernel",
                      stacklevel=2)
        return None
    if entry.original != original:  # a SHA-256 collision would be news; checked anyway
        return None
    return entry


def entries_for_variant(root: str | os.PathLike | None, variant: Any, toolchain: str | None = None) -> list[Entry]:
    """Every valid entry for this variant under the toolchain (default: the current one; any kernel
    name, any original); broken entries give a warning and are skipped."""
    base = resolve_root(root) / (toolchain or current_toolchain())
    found = []
    for directory in sorted(base.glob(f"*/{_glob_escape(variant.key())}/*")):
        if not directory.is_dir():
            continue
        try:
            found.append(_read_locked(directory))
        except CacheError as e:
            warnings.warn(f"sip: ignoring tuned-cubin cache entry {directory}: {e}; using the untuned kernel",
                          stacklevel=2)
    return found


def list_entries(root: str | os.PathLike | None) -> list[dict[str, Any]]:
    """One row per entry directory under `root` (all toolchains), valid or not, for `sip-tune --list`."""
    root = resolve_root(root)
    rows = []
    for meta_dir in sorted({p.parent for p in root.glob("*/*/*/*/*") if p.name in ("meta.json", "tuned.cubin")}):
        row: dict[str, Any] = {"path": str(meta_dir)}
        try:
            entry = _read_entry(meta_dir)
            row.update(entry.meta, valid=True)
        except CacheError as e:
            row.update(valid=False, error=str(e), toolchain=meta_dir.parents[2].name,
                       kernel=meta_dir.parents[1].name, spec_key=meta_dir.parent.name)
        rows.append(row)
    return rows


def _glob_escape(s: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in s)
