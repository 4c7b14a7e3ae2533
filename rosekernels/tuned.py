"""The store of tuned cubins and tuned configs: what `sip-tune` writes, `rosekernels.warmup` loads
and the ops consult when they plan a call (`tuned_config`; the config half is at the end).

Layout: <root>/<toolchain>/<kernel>/<Variant.key()>/<sha256 of the original cubin>/ holding
`tuned.cubin`, `original.cubin` and `meta.json` (medians, speedup, how it was checked, search
parameters, seed, GPU, date). The variant key names op, mode, arch and every compile-time parameter;
the toolchain and the original's hash make an entry unusable the moment the kernel compiles
differently, and the stored original lets `warmup` install a tuned cubin before compiling
(`jit.install_tuned_cubin` keys by the original's bytes, so a tuned cubin can never be loaded for
another original). A tuned cubin must differ from its original only in the code section of the
kernel SIP tunes (the largest: `sip.cubin.Cubin.main_kernel`); headers, symbols, `.nv.info` and every
other section byte-identical, or the entry is refused with the place it differs.

How an entry was checked (meta["checks"], both kinds; `bar_problems` reads it):
    samples    {"run", "passed"}: fresh random samples (the kernel's test sizes) the tuned kernel passed
    compare    "bitwise" (equal to the original's / the heuristic's outputs bit for bit), "reference"
               (the kernel's own float64 check at its stated tolerance) or "tolerance" (`tolerance`:
               {"rtol", "atol"}, a looser comparison a user asked for)
    sanitizer  compute-sanitizer {"memcheck", "racecheck", "synccheck"} verdicts (cubins: the tuned
               cubin; configs: the winner's kernel at the tuned shape), or "not run"
    shapes     {"tuned": the shape tuned, "tuned_samples": samples compared at it, "samples": what
               the sample sizes are, "edges": (configs) the bucket's edge shapes tested}
    op_level   the public op re-timed in a fresh process (`sip_tune.oplevel`): speedup over the
               heuristic / original cubin, A/A spread, the best peer and its ratio; or "not run"
and meta["speedup"] is the op-level speedup where one was measured.

The default bar (`bar_problems`): bitwise or the kernel's own tolerance, on >= BAR_SAMPLES samples,
all passed; compared at the tuned shape (configs: and at their bucket's edges); compute-sanitizer
clean; an op-level speedup past 1 + its A/A spread (a record of the wrong type, hand-edited, meets
no part). Ops and warmup load only entries that meet it (`admitted`), unless the user opts in to
weaker ones: `warmup(allow_unverified=True)` or $SIP_ALLOW_UNVERIFIED=1, until the opt-in is
withdrawn (`allow_unverified(False)`, which also drops what it loaded). An entry below the bar is
reported (a warning once per process, the reason in `sip-tune --list`), never loaded silently;
entries written before checks were recorded are below it, and so are config entries from before
level 1 ran compute-sanitizer. A config entry that keeps the heuristic's own config (a tuning that
found nothing faster) changes nothing and needs no checks. A new entry replaces an existing one only
if it is not weaker (`strength`: the bar's parts it meets) and, at equal strength, not slower.

Writers hold a file lock per entry and replace each file atomically (`paths.write_atomic`);
`meta.json` goes last and records the tuned cubin's hash, so a reader can always tell a whole entry
from a broken one. Anything wrong with an entry (truncated cubin, bad JSON, hash or size mismatch,
not an sm_90 cubin, bytes changed outside the tuned kernel's code) gives a warning and no tuned
cubin: the untuned kernel runs.

It lives with the code that loads it; the tuner (`sip_tune`) writes through it. Its root is
`paths.tuned_store_root(store_root)`: the folder a caller names as `store_root`, else the process's
or the environment's. The current toolchain comes from `rosekernels.jit` (which imports CuTeDSL),
imported only when needed: listing a store imports neither CuTeDSL nor torch. Reading a tuned
config needs the kernel's Config and Shape, and choosing one its `compile` and `candidates`: the
caller passes the kernel module (an op its own; warm-up and sip-tune the one
`rosekernels.kernels.kernel_module` finds), so the store never imports a kernel.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import struct
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import filelock

from rosekernels import contract, paths
from sip import SipError, cubin, fatbin

FORMAT = 1
_LOCK_TIMEOUT_S = 60.0
# Entries verified on the GPU and shipped with the package (stored by `bench/sip_compute.py --store-floors`,
# then copied here): warmup loads them beside the user's store's, unless told not to (the tuner's own
# measurements must see the original). tests/tuner/test_shipped_entries.py checks that each is tuned from
# the cubin this source and toolchain compile.
SHIPPED_ROOT = Path(__file__).resolve().parent / "tuned_entries"


class CacheError(ValueError):
    """An entry that must not be used."""


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


def check_only_code_differs(original: bytes, tuned: bytes) -> str:
    """Raise CacheError unless `tuned` (as long as `original`) differs from `original` only inside
    the code section of the kernel SIP tunes (`main_kernel`, read with the engine's parser); return
    that kernel's name. Everything else (ELF and section headers, symbols, relocations, `.nv.info`,
    constants, other kernels' code) must be byte-identical: a swap of the code is all a tuner does."""
    try:
        parsed = cubin.parse_cubin(original)
        kernel = parsed.main_kernel()
    except (SipError, struct.error, IndexError, ValueError) as e:
        raise CacheError(f"the original is not a cubin SIP can read: {e}") from None
    lo, hi = kernel.section.offset, kernel.section.offset + kernel.section.size
    if original[:lo] != tuned[:lo] or original[hi:] != tuned[hi:]:
        outside = next(i for i in itertools.chain(range(lo), range(hi, len(original))) if original[i] != tuned[i])
        raise CacheError(f"the tuned cubin differs from its original outside {kernel.name}'s code, at byte "
                         f"{outside} ({_region(parsed, outside)}): a tuned cubin may change that code only")
    return kernel.name


def _region(parsed: cubin.Cubin, offset: int) -> str:
    """What holds byte `offset` of a cubin: a section's name, or the ELF / section headers."""
    for sec in parsed.sections:
        if sec.type != cubin.SHT_NOBITS and sec.size and sec.offset <= offset < sec.offset + sec.size:
            return f"section {sec.name}"
    phoff, shoff = struct.unpack_from("<QQ", parsed.data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", parsed.data, 0x36)
    if offset < 64:
        return "the ELF header"
    if phoff <= offset < phoff + phentsize * phnum:
        return "the program headers"
    if shoff <= offset < shoff + shentsize * shnum:
        return "the section headers"
    return "bytes outside every section"


# ---------------------------------------------------------------------------------------------
# How an entry was checked, and the bar it must meet to be loaded (the module docstring).

BAR_SAMPLES = 10_000
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
ALLOW_ENV = "SIP_ALLOW_UNVERIFIED"
_allow: bool | None = None  # allow_unverified's choice; None: $SIP_ALLOW_UNVERIFIED decides
_reported: set[tuple[Path, bool]] = set()  # (entry, loaded?) already warned about in this process
_opted_in: dict[Path, "Entry"] = {}  # cubin entries below the bar admitted because the user opted in


def _keeps_heuristic(meta: dict[str, Any]) -> bool:
    """A config entry recording that tuning kept the heuristic's config: loading it changes nothing."""
    return "heuristic" in meta and meta.get("config") == meta.get("heuristic")


def _count(value: Any) -> int | None:
    """`value` if it is a count (a JSON integer), else None: a hand-edited or truncated record."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _real(value: Any) -> float | None:
    """`value` as a float if it is a finite JSON number, else None (NaN, Infinity and an integer past
    the float range are hand edits, as a string is)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _bar_parts(meta: dict[str, Any], kind: str) -> dict[str, str | None]:
    """Per part of the bar (in the order of `strength`), why the entry falls short of it (None: met).
    kind: "cubin" or "config" (bucket edges are part of a config's bar).
    A record of the wrong type (null, a string for a number) falls short of its part with the
    reason, never raises: a reader is an op planning a call."""
    parts = ("compare", "samples", "sanitizer", "shapes", "op_level")
    if kind == "config" and _keeps_heuristic(meta):
        return dict.fromkeys(parts)
    checks = meta.get("checks")
    if not isinstance(checks, dict):
        return dict.fromkeys(parts, "unverified: written before entries recorded how they were checked "
                                    "(re-run sip-tune)")
    out: dict[str, str | None] = dict.fromkeys(parts)
    compare = checks.get("compare")
    if compare not in ("bitwise", "reference"):
        out["compare"] = f"compared {_compared(checks)}, not bitwise or at the kernel's own tolerance"
    samples = checks.get("samples", {})
    run, passed = (_count(samples.get("run", 0)), _count(samples.get("passed", 0))) if isinstance(samples, dict) \
        else (None, None)
    if run is None or passed is None:
        out["samples"] = f"malformed samples record {str(samples)[:80]}"
    elif passed < BAR_SAMPLES or passed != run:
        out["samples"] = f"{passed} of {run} samples passed (the bar: all of at least {BAR_SAMPLES})"
    verdicts = checks.get("sanitizer")
    if not isinstance(verdicts, dict):
        out["sanitizer"] = "compute-sanitizer not run"
    elif any(verdicts.get(t) != "clean" for t in SANITIZER_TOOLS):
        out["sanitizer"] = "compute-sanitizer: " + "; ".join(
            f"{t} {str(verdicts.get(t, 'not run'))[:80]}" for t in SANITIZER_TOOLS if verdicts.get(t) != "clean")
    shapes = checks.get("shapes") if isinstance(checks.get("shapes"), dict) else {}
    if not _count(shapes.get("tuned_samples")):
        out["shapes"] = "not compared at the tuned shape"
    elif kind == "config" and not isinstance(shapes.get("edges"), list):
        out["shapes"] = "not tested at its bucket's edges"
    op = checks.get("op_level")
    speedup, spread = (_real(op.get("speedup")), _real(op.get("aa_spread"))) if isinstance(op, dict) else (None, None)
    if speedup is None:
        out["op_level"] = "no op-level re-time" + (f" ({op})" if isinstance(op, str) and op != "not run" else "")
    elif spread is None:
        out["op_level"] = f"malformed op-level record: A/A spread {str(op.get('aa_spread'))[:40]}"
    elif not speedup > 1 + spread:
        out["op_level"] = (f"op-level {speedup:.4f}x the {'original' if kind == 'cubin' else 'heuristic'}, "
                           f"not past 1 + its A/A spread {spread:.4f}")
    return out


def _compared(checks: dict[str, Any]) -> str:
    tol = checks.get("tolerance")
    if checks.get("compare") == "tolerance" and isinstance(tol, dict):
        return f"at rtol={tol.get('rtol')}, atol={tol.get('atol')}"
    return f"as {checks.get('compare')!r}"


def bar_problems(meta: dict[str, Any], kind: str) -> list[str]:
    """Why an entry ("cubin" or "config") falls short of the default bar; [] when it meets it."""
    return list(dict.fromkeys(p for p in _bar_parts(meta, kind).values() if p))


def strength(meta: dict[str, Any], kind: str) -> tuple[bool, ...]:
    """How well an entry was checked, for comparing two: whether it meets the bar, then each part of
    the bar it meets (correctness, samples, compute-sanitizer, shapes, op level), in that order."""
    parts = _bar_parts(meta, kind)
    return (not any(parts.values()), *(p is None for p in parts.values()))


def _speedup(meta: dict[str, Any]) -> float:
    """The speedup an entry records (0.0 where it records none, or not as a number)."""
    value = _real(meta.get("speedup", 0.0))
    return 0.0 if value is None else value


def _keep_old(old: dict[str, Any], new: dict[str, Any], kind: str) -> bool:
    """Whether an existing entry stays: it is stronger, or as strong and faster (see strength). A new
    cubin whose search started from the old one and beat it past the A/A spread in the same re-times
    replaces it when at least as strong: the speedup the old one recorded in another run is no measure
    against it."""
    if kind == "cubin" and _beat_its_start(old, new):
        return strength(old, kind) > strength(new, kind)
    def rank(meta: dict[str, Any]) -> tuple:
        return strength(meta, kind), _speedup(meta)
    return rank(old) > rank(new)


def _beat_its_start(old: dict[str, Any], new: dict[str, Any]) -> bool:
    start = new.get("start") if isinstance(new.get("start"), dict) else {}
    over, spread = _real(start.get("over_start")), _real(new.get("aa_spread", 0.0))
    return (bool(old.get("tuned_sha256")) and start.get("sha256") == old.get("tuned_sha256") and over is not None
            and over > 1.0 + (spread or 0.0))


def allow_unverified(allow: bool | None) -> None:
    """Whether ops and warmup load entries below the bar from now on (None: $SIP_ALLOW_UNVERIFIED
    decides, "1" to allow); `warmup(allow_unverified=...)` calls it. Opting in or withdrawing makes
    every op plan its next call again (a plan keeps the config it chose). Withdrawing also undoes
    what the opt-in loaded: the tuned cubins of entries below the bar are uninstalled and the loaded
    kernels forgotten (the next call loads them as compiled). CUDA graphs captured before launch
    what they captured: capture them again, as after a warmup that reloads kernels."""
    global _allow
    was = unverified_allowed()
    _allow = allow
    _chosen.clear()  # configs chosen under the other rule
    if was and not unverified_allowed():
        _withdraw()
    elif unverified_allowed() and not was:
        _forget_plans()


def _forget_plans() -> None:
    """Every op plans its next call again. What launch never imported holds no plan (and the store
    imports neither launch nor jit: `sip-tune --list` loads no torch)."""
    launch = sys.modules.get("rosekernels.launch")
    if launch is not None:
        launch.forget_plans()


def _withdraw() -> None:
    """Drop what entries below the bar put in this process (what jit never imported holds nothing)."""
    _forget_plans()
    jit = sys.modules.get("rosekernels.jit")
    if jit is not None:
        removed = [jit.uninstall_tuned_cubin(e.original, e.tuned) for e in _opted_in.values()]
        if any(removed):
            jit.forget_loaded()
    _opted_in.clear()


def unverified_allowed() -> bool:
    if _allow is not None:
        return _allow
    return os.environ.get(ALLOW_ENV, "").strip().lower() not in ("", "0", "false", "no")


def admitted(entry: "Entry | ConfigEntry") -> bool:
    """Whether ops and warmup may load `entry`: it meets the bar, or the user opted in to weaker ones.
    An entry below the bar is reported once per process either way, never loaded silently."""
    problems = entry.problems
    if not problems:
        return True
    allow = unverified_allowed()
    if allow and isinstance(entry, Entry):  # warmup installs it: withdrawing the opt-in uninstalls it
        _opted_in[entry.path] = entry
    if (entry.path, allow) not in _reported:
        _reported.add((entry.path, allow))
        what = ("loading it anyway (opted in)" if allow else
                f"not loaded; re-run sip-tune, or opt in with {ALLOW_ENV}=1 or warmup(allow_unverified=True)")
        warnings.warn(f"sip: tuned entry {entry.path} is below the default bar ({'; '.join(problems)}): {what}",
                      stacklevel=3)
    return allow


@dataclasses.dataclass(frozen=True)
class Entry:
    path: Path  # the entry's directory
    meta: dict[str, Any]
    original: bytes
    tuned: bytes

    @property
    def speedup(self) -> float:
        return _speedup(self.meta)

    @property
    def problems(self) -> list[str]:
        """Why the entry is below the default bar ([]: it meets it)."""
        return bar_problems(self.meta, "cubin")


def current_toolchain() -> str:
    from rosekernels import jit

    return jit.TOOLCHAIN


def _check_key(parts: tuple[str, ...], original_sha256: str) -> None:
    """Each part names one folder or file of the store, and the original is named by a full hash."""
    for part in parts:
        if not part or "/" in part or part in (".", ".."):
            raise ValueError(f"bad cache key component {part!r}")
    if len(original_sha256) != 64:
        raise ValueError("original_sha256 must be a full SHA-256 hex digest")


def entry_dir(store_root: str | os.PathLike | None, kernel: str, variant_key: str, original_sha256: str,
              toolchain: str | None = None) -> Path:
    toolchain = toolchain or current_toolchain()
    _check_key((kernel, variant_key, toolchain), original_sha256)
    return paths.tuned_store_root(store_root) / toolchain / kernel / variant_key / original_sha256


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
    except (OSError, ValueError) as e:  # bad UTF-8 or JSON, or an integer past int()'s digit limit
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
    check_only_code_differs(original, tuned)
    return Entry(directory, meta, original, tuned)


def _read_locked(directory: Path) -> Entry:
    if SHIPPED_ROOT in directory.parents:  # written by no one: no lock file inside the package
        return _read_entry(directory)
    try:
        lock = _lock(directory)
        with lock:
            return _read_entry(directory)
    except (OSError, filelock.Timeout):  # read-only cache or a stuck writer: the hashes still guard us
        return _read_entry(directory)


def store(store_root: str | os.PathLike | None, kernel: str, variant: Any, original: bytes, tuned: bytes,
          meta: dict[str, Any], *, keep_better: bool = True, toolchain: str | None = None) -> tuple[Path, bool]:
    """Write an entry for `variant` (a jit.Variant); return (its directory, written?). `meta` holds
    the measurements and "checks" (the module docstring); CacheError for a tuned cubin that is not an
    sm_90 cubin of the original's size differing from it only in the tuned kernel's code.

    With `keep_better`, an existing valid entry that is stronger (`strength`), or as strong and
    faster, is kept (two tuners of the same kernel: the better-checked, then the faster result wins,
    whichever finishes last)."""
    toolchain = toolchain or current_toolchain()
    if len(tuned) != len(original):
        raise CacheError(f"tuned cubin has {len(tuned)} bytes, the original {len(original)}")
    check_sm90_cubin(tuned)
    check_only_code_differs(original, tuned)
    directory = entry_dir(store_root, kernel, variant.key(), sha256(original), toolchain)
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
            if old is not None and _keep_old(old.meta, full, "cubin"):
                return directory, False
        paths.write_atomic(directory / "original.cubin", original)
        paths.write_atomic(directory / "tuned.cubin", tuned)
        paths.write_atomic(directory / "meta.json", json.dumps(full, indent=1, sort_keys=True).encode())
    return directory, True


def lookup(store_root: str | os.PathLike | None, kernel: str, variant: Any, original: bytes,
           toolchain: str | None = None) -> Entry | None:
    """The entry for exactly this original cubin, its integrity verified (whether it meets the bar
    is `admitted`'s question), or None (with a warning if it is broken)."""
    directory = entry_dir(store_root, kernel, variant.key(), sha256(original), toolchain)
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


def entries_for_variant(store_root: str | os.PathLike | None, variant: Any,
                        toolchain: str | None = None) -> list[Entry]:
    """Every valid entry for this variant under the toolchain (default: the current one; any kernel
    name, any original), below the bar or not (warmup installs the `admitted` ones); broken entries
    give a warning and are skipped."""
    base = paths.tuned_store_root(store_root) / (toolchain or current_toolchain())
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


def list_entries(store_root: str | os.PathLike | None) -> list[dict[str, Any]]:
    """One row per entry of the store (all toolchains), valid or not, for `sip-tune --list`: cubin
    entries (kind "cubin") and tuned configs (kind "config", read from their JSON alone: listing
    imports no kernel module); each valid row says whether it meets the bar ("problems": [] if so)."""
    root = paths.tuned_store_root(store_root)
    rows = []
    for meta_dir in sorted({p.parent for p in root.glob("*/*/*/*/*") if p.name in ("meta.json", "tuned.cubin")}):
        row: dict[str, Any] = {"path": str(meta_dir), "kind": "cubin"}
        try:
            entry = _read_entry(meta_dir)
            row.update(entry.meta, valid=True, problems=entry.problems)
        except CacheError as e:
            row.update(valid=False, error=str(e), toolchain=meta_dir.parents[2].name,
                       kernel=meta_dir.parents[1].name, spec_key=meta_dir.parent.name)
        rows.append(row)
    for path in sorted(root.glob(f"*/*/{CONFIGS_DIR}/*.json")):
        row = {"path": str(path), "kind": "config"}
        try:
            meta = json.loads(path.read_text())
            if not isinstance(meta, dict) or meta.get("format") != CONFIG_FORMAT:
                raise CacheError(f"not a format-{CONFIG_FORMAT} tuned-config entry (re-run sip-tune)")
            row.update(meta, valid=True, problems=bar_problems(meta, "config"))
        except (OSError, ValueError) as e:  # CacheError, bad UTF-8 or JSON, an integer past int()'s limit
            row.update(valid=False, error=str(e), toolchain=path.parents[2].name, kernel=path.parents[1].name)
        rows.append(row)
    return rows


def _glob_escape(s: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in s)


# ---------------------------------------------------------------------------------------------
# Tuned configs (sip-tune level 1): which Config a shape bucket launches instead of the heuristic's.
#
# Layout: <root>/<toolchain>/<kernel>/configs/<mode>-<bucket key>-<heuristic digest>-<original
# sha256[:16]>.json, beside the variant-key folders of the cubin entries. An entry names the
# heuristic's config and the hash of its cubin ("the original"): it applies only where the op's
# heuristic picks that same config and it still compiles to those bytes (same toolchain, same kernel
# source), and only where the stored config is among the kernel's `candidates` for the call's exact
# shape (a bucket spans shapes a config may not serve, e.g. a split count with too few tiles). The
# heuristic digest hashes every field of the heuristic's config: the cubin's hash leaves out launch
# settings (split counts), which differ between GPUs and between shapes of one bucket, and each such
# heuristic has its own entry. One JSON file per entry, replaced atomically under the folder's lock:
# a reader sees a whole file or none, so it reads unlocked.

CONFIG_FORMAT = 2  # 1: named without the heuristic digest (two heuristics could share a file); not read
CONFIGS_DIR = "configs"  # no variant key is this name: every key starts with its op
_MEMO_SIZE = 4096  # like launch.PLAN_CACHE_SIZE: many distinct token counts start the memo over


@dataclasses.dataclass(frozen=True)
class ConfigEntry:
    path: Path  # the entry's JSON file
    meta: dict[str, Any]  # kernel, mode, shape, bucket, config, heuristic (asdict), original_sha256,
    #                       toolchain, arch, and the tuner's medians/speedup/aa_spread/gpu/date
    config: Any  # the kernel's Config, rebuilt with Config(**meta["config"])
    heuristic: Any  # the heuristic's Config the entry was tuned against

    @property
    def original_sha256(self) -> str:
        return self.meta["original_sha256"]

    @property
    def speedup(self) -> float:
        return _speedup(self.meta)

    @property
    def problems(self) -> list[str]:
        """Why the entry is below the default bar ([]: it meets it, or it keeps the heuristic)."""
        return bar_problems(self.meta, "config")


@dataclasses.dataclass
class _Index:
    """The entries of one kernel under one root, by bucket key: those of the current toolchain, and
    those of other toolchains (only to say that a bucket needs re-tuning)."""
    current: dict[str, list[ConfigEntry]]
    other: dict[str, list[ConfigEntry]]


_indexes: dict[tuple[str, str], _Index] = {}  # (root, kernel) -> entries read from disk
_chosen: dict[tuple, Any] = {}  # (root, kernel, shape, heuristic, sms) -> the config tuned_config gave
_original_hashes: dict[Any, str] = {}  # heuristic variant -> sha256 of its compiled cubin
_warned: set[Path] = set()  # stale entries already warned about in this process


def bucket_key(shape: Any) -> str:
    """The file-name-safe name of `shape`'s bucket: every field of contract.bucket(shape)."""
    b = contract.bucket(shape)
    return ",".join(f"{f.name}={getattr(b, f.name)}" for f in dataclasses.fields(b)).replace("/", "_").replace(" ", "")


def config_path(store_root: str | os.PathLike | None, kernel: str, shape: Any, heuristic: Any, original_sha256: str,
                toolchain: str | None = None) -> Path:
    """The file of the entry for bucket(shape) tuned against `heuristic` (every field) whose cubin
    hashes to `original_sha256`."""
    toolchain = toolchain or current_toolchain()
    mode = heuristic.variant().mode
    _check_key((kernel, mode, toolchain), original_sha256)
    digest = sha256(json.dumps(dataclasses.asdict(heuristic), sort_keys=True).encode())[:16]
    name = f"{mode}-{bucket_key(shape)}-{digest}-{original_sha256[:16]}.json"
    return paths.tuned_store_root(store_root) / toolchain / kernel / CONFIGS_DIR / name


def _read_config(path: Path, module: ModuleType, toolchain: str) -> ConfigEntry:
    """The entry in `path` (of `module`'s kernel), checked against its place in the store; CacheError
    on any defect."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # bad UTF-8 or JSON, or an integer past int()'s digit limit
        raise CacheError(f"unreadable: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != CONFIG_FORMAT:
        raise CacheError(f"not a format-{CONFIG_FORMAT} tuned-config entry (re-run sip-tune)")
    if meta.get("kernel") != module.OP or meta.get("toolchain") != toolchain:
        raise CacheError(f"written for {meta.get('kernel')!r} under toolchain {meta.get('toolchain')!r}")
    try:
        config, heuristic = module.Config(**meta["config"]), module.Config(**meta["heuristic"])
        shape = module.Shape(**meta["bucket"])
        name = config_path(path.parents[3], module.OP, shape, heuristic, meta["original_sha256"], toolchain).name
    except (KeyError, TypeError, ValueError) as e:
        raise CacheError(f"does not describe a {module.OP} config: {e!r}") from None
    if name != path.name:  # copied or edited by hand: the name is what lookups find it by
        raise CacheError(f"its contents belong in {name}")
    return ConfigEntry(path, meta, config, heuristic)


def _index(root: Path, module: ModuleType) -> _Index:
    """The entries of `module`'s kernel under `root`, read from disk on first use in this process."""
    key = (str(root), module.OP)
    found = _indexes.get(key)
    if found is not None:
        return found
    toolchain = current_toolchain()
    found = _Index({}, {})
    for path in sorted(root.glob(f"*/{_glob_escape(module.OP)}/{CONFIGS_DIR}/*.json")):
        ours = path.parents[2].name == toolchain
        try:
            entry = _read_config(path, module, path.parents[2].name)
        except CacheError as e:
            if ours:  # another toolchain's broken entry could not have been used anyway
                warnings.warn(f"sip: ignoring tuned-config entry {path}: {e}; using the heuristic's config",
                              stacklevel=3)
            continue
        bkey = bucket_key(module.Shape(**entry.meta["bucket"]))
        (found.current if ours else found.other).setdefault(bkey, []).append(entry)
    _indexes[key] = found
    return found


def store_config(store_root: str | os.PathLike | None, module: ModuleType, shape: Any, config: Any, heuristic: Any,
                 original_sha256: str, meta: dict[str, Any], *, keep_better: bool = True,
                 toolchain: str | None = None) -> tuple[Path, bool]:
    """Write the entry of `module`'s kernel: `config` serves bucket(shape) where the heuristic picks
    `heuristic`, whose cubin hashes to `original_sha256`; `meta` adds the measurements and "checks".
    Returns (the entry's file, written?). With `keep_better`, an existing valid entry that is
    stronger, or as strong and faster, is kept (as for cubins)."""
    toolchain = toolchain or current_toolchain()
    variant = heuristic.variant()
    path = config_path(store_root, module.OP, shape, heuristic, original_sha256, toolchain)
    full = {
        **meta,
        "format": CONFIG_FORMAT,
        "kernel": module.OP,
        "mode": variant.mode,
        "arch": variant.arch,
        "toolchain": toolchain,
        "shape": dataclasses.asdict(shape),
        "bucket": dataclasses.asdict(contract.bucket(shape)),
        "config": dataclasses.asdict(config),
        "config_key": config.variant().key(),
        "heuristic": dataclasses.asdict(heuristic),
        "heuristic_key": variant.key(),
        "original_sha256": original_sha256,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(path.parent):
        if keep_better and path.exists():
            try:
                old = _read_config(path, module, toolchain)
            except CacheError:
                old = None
            if old is not None and _keep_old(old.meta, full, "config"):
                return path, False
        paths.write_atomic(path, json.dumps(full, indent=1, sort_keys=True).encode())
    forget_configs()  # this process reads the new entry next time
    return path, True


def config_entries(store_root: str | os.PathLike | None, module: ModuleType) -> list[ConfigEntry]:
    """Every valid entry of `module`'s kernel under the current toolchain, below the bar or not
    (warmup compiles the `admitted` ones)."""
    return [e for found in _index(paths.tuned_store_root(store_root), module).current.values() for e in found]


def lookup_config(store_root: str | os.PathLike | None, module: ModuleType, shape: Any, heuristic: Any,
                  original_sha256: str) -> ConfigEntry | None:
    """The entry of `module`'s kernel for bucket(shape) tuned against the heuristic config `heuristic`
    (every field, launch policy included) whose cubin hashes to `original_sha256` (below the bar or
    not), or None."""
    for entry in _index(paths.tuned_store_root(store_root), module).current.get(bucket_key(shape), ()):
        if entry.heuristic == heuristic and entry.original_sha256 == original_sha256:
            return entry
    return None


def forget_configs() -> None:
    """Drop what was read from disk and chosen (the next plan reads the store again)."""
    _indexes.clear()
    _chosen.clear()
    _original_hashes.clear()


def tuned_config(module: ModuleType, shape: Any, heuristic: Any, sms: int | None = None) -> Any:
    """The config an op launches for `shape` with `module`'s kernel, where the heuristic picked
    `heuristic` (for a GPU of `sms` SMs where the kernel's candidates depend on it): the stored
    entry's config for bucket(shape) if it was tuned against this very heuristic config (launch
    policy included), whose cubin is as compiled now, and is legal for this exact shape, else
    `heuristic`. The store is `paths.tuned_store_root()`.
    Called once per plan; a shape already seen costs one dict lookup, a bucket with no entries two.
    An entry below the bar gives the heuristic (and a warning once) unless the user opted in
    (`allow_unverified`)."""
    root = paths.tuned_store_root()
    key = (str(root), module.OP, shape, heuristic, sms)
    chosen = _chosen.get(key)
    if chosen is None:
        chosen = _choose(root, module, shape, heuristic, sms)
        if len(_chosen) >= _MEMO_SIZE:
            _chosen.clear()
        _chosen[key] = chosen
    return chosen


def _choose(root: Path, module: ModuleType, shape: Any, heuristic: Any, sms: int | None) -> Any:
    index = _index(root, module)
    bkey = bucket_key(shape)
    here = index.current.get(bkey, [])
    # Only where the heuristic picks the very config the entry was tuned against: the cubin's hash
    # leaves out the launch policy (split counts, raster groups), and the entry was tested only at
    # the shapes of its bucket where the heuristic picks that config (sip_tune.configs.bucket_edges).
    mine = [e for e in here if e.heuristic == heuristic]
    if mine:
        original = _original_hashes.get(heuristic.variant())
        if original is None:  # compiled (or loaded) anyway when the heuristic wins: the op needs it then
            original = _original_hashes[heuristic.variant()] = module.compile(heuristic).cubin_sha256
        for entry in mine:
            if entry.original_sha256 == original:
                if not admitted(entry):
                    return heuristic
                legal = module.candidates(shape) if sms is None else module.candidates(shape, sms)
                return entry.config if entry.config in legal else heuristic
    # Entries of this bucket tuned against this same heuristic config, but for a kernel that no
    # longer compiles to the same cubin (source or toolchain changed): say so, once per entry.
    for entry in here + index.other.get(bkey, []):
        if entry.heuristic == heuristic and entry.path not in _warned:
            _warned.add(entry.path)
            warnings.warn(f"sip: ignoring tuned-config entry {entry.path}: it was tuned against another build "
                          f"of {heuristic.variant().key()} (the kernel or toolchain changed); using the "
                          "heuristic's config: re-run sip-tune", stacklevel=4)
    return heuristic
