"""`rosekernels-cache`: a compile cache built ahead of time, on a machine without a GPU, for the GPU
hosts that run a model.

    rosekernels-cache build --model CONFIG.json -o DIR [--modes decode,prefill] [--max-tokens N] [-j N] [--sms 132]
    rosekernels-cache list DIR
    rosekernels-cache verify DIR
    rosekernels-cache cubin ENTRY -o OUT.cubin [--dir DIR]

`build` compiles into DIR (a compile-cache root) what `rosekernels.warmup(model=CONFIG, modes=...,
max_tokens=...)` needs; CuTeDSL compiles sm_90a without a GPU, and the heuristics that choose
specializations by SM count take it from --sms (132: H100/H200 SXM). A GPU host loads DIR with no
compilation (`ROSEKERNELS_CACHE_DIR=DIR`, or `warmup(..., cache_dir=DIR)`) when it runs the same
rosekernels source under the same toolchain (`jit.TOOLCHAIN`: CuTeDSL version and CUDA build, TVM-FFI
version; the cu12 and cu13 builds of CuTeDSL make different cubins, so build with the one the GPU
host loads). `list` shows the entries; `verify` checks that each is whole (its cubin matches the
SHA-256 of its metadata) and would be loaded here (this toolchain, this source). `cubin` writes the
cubin an entry's object embeds (ENTRY: its .o file, or its variant key as `list` prints it, looked up
in DIR, default the compile cache) for `sip disasm` and the other SASS tools.

Exit status: 0 done; 1 verify found a bad entry, build found nothing the model needs or could not write
an entry; 2 bad input (one line, refused before compiling, nothing written).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from rosekernels.models import FP32_NOTE
from rosekernels.variant import MODES

DEFAULT_SMS = 132  # H100 and H200 SXM


class BadInput(Exception):
    """Bad arguments: one line, exit 2, nothing written."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own prints the usage too: keep it to one line
        raise BadInput(message)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(m.strip() for m in text.split(",")))
    if not modes or any(m not in MODES for m in modes):
        raise argparse.ArgumentTypeError(f"modes are a comma-separated subset of {','.join(MODES)}, got {text!r}")
    return modes


def _parser() -> _Parser:
    parser = _Parser(prog="rosekernels-cache", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="compile what a model needs into a cache folder (no GPU needed)")
    build.add_argument("--model", required=True, metavar="CONFIG.json", help="the model's Hugging Face config.json")
    build.add_argument("-o", "--output", required=True, metavar="DIR", help="the cache folder (new, empty, or a cache)")
    build.add_argument("--modes", type=_modes, default=MODES, help="decode,prefill (default: both)")
    build.add_argument("--max-tokens", type=_positive, metavar="N",
                       help="the most tokens one forward pass carries: skip what only larger calls select")
    build.add_argument("-j", "--jobs", type=_positive, metavar="N",
                       help="compile processes (default: one per core, as many as the memory holds)")
    build.add_argument("--sms", type=_positive, default=DEFAULT_SMS,
                       help=f"SM count of the GPU that will load the cache (default {DEFAULT_SMS}: H100/H200 SXM)")
    for name, text in (("list", "the entries of a cache: kernel, variant key, toolchain, size"),
                       ("verify", "check every entry: whole, and built by this toolchain from this source")):
        command = commands.add_parser(name, help=text)
        command.add_argument("dir", metavar="DIR")
    cubin = commands.add_parser("cubin", help="write the cubin of an entry (for sip disasm, sip inspect, ...)")
    cubin.add_argument("entry", metavar="ENTRY", help="the entry's .o file, or its variant key as `list` prints it")
    cubin.add_argument("-o", "--output", required=True, metavar="OUT.cubin")
    cubin.add_argument("--dir", metavar="DIR", help="the cache a variant key is looked up in (default: "
                       "$ROSEKERNELS_CACHE_DIR, else ~/.cache/rosekernels)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        return {"build": _build, "list": _list, "verify": _verify, "cubin": _cubin}[args.command](args)
    except BadInput as e:
        print(f"rosekernels-cache: error: {e}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------
# build


def _model(path: str) -> Any:
    from rosekernels.models import ModelDims

    try:
        return ModelDims.from_config(path)
    except OSError as e:
        raise BadInput(f"--model {path}: {e.strerror or e}") from None
    except ValueError as e:  # its message names the file and the key
        raise BadInput(f"--model {e}") from None


def _writable_folder(out: Path, folder: Path) -> None:
    """Create `folder` (under -o `out`) and check that a file can be written in it: a build that would
    compile for minutes and then fail to write every entry is refused first."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise BadInput(f"-o {out}: cannot write a cache there ({folder}: {e.strerror or e})") from None


def _build(args: argparse.Namespace) -> int:
    dims = _model(args.model)
    out = Path(args.output)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "jit").is_dir())):
        raise BadInput(f"-o {out}: exists and is not a rosekernels cache (no jit/ folder): give a new or empty folder")
    import torch

    from rosekernels import jit, modes, paths, startup
    from rosekernels.kernels import kernel_module

    if torch.cuda.is_available() and modes.sm_count() != args.sms:
        raise BadInput(f"--sms {args.sms}: the GPU visible here has {modes.sm_count()} SMs; build on a machine "
                       "without a GPU, or for this one")
    modes.DEFAULT_SM_COUNT = args.sms  # what the heuristics see when no GPU is visible
    modes.sm_count.cache_clear()
    configs = startup.model_specs(dims, args.modes, args.max_tokens)
    what = f"{dims.name} ({','.join(args.modes)}" + (f", at most {args.max_tokens} tokens" if args.max_tokens else "") \
        + f", {args.sms} SMs)"
    if dims.dtype == "fp32":
        print(f"rosekernels-cache: note: {args.model}: {FP32_NOTE}")
    if not configs:
        print(f"rosekernels-cache: no kernel of rosekernels serves {what}: nothing to build")
        return 1
    _writable_folder(out, out / "jit" / jit.TOOLCHAIN)
    t0 = time.perf_counter()
    paths.use_compile_cache_root(out)
    jobs = [(kernel_module(c.variant().op).compile, c) for c in configs]
    compiled = jit.compile_cold(jobs, args.jobs, progress=True)
    keys = {c.variant().key() for c in configs}
    written = {e.key for e in jit.disk_entries(out)
               if e.toolchain == jit.TOOLCHAIN and e.digest == jit.package_digest()}
    if keys - written:
        print(f"rosekernels-cache: {len(keys - written)} of {len(keys)} specializations were not written to {out} "
              "(see the warnings above)", file=sys.stderr)
        return 1
    print(f"rosekernels-cache: {len(keys)} specializations of {what} in {out}: {len(compiled)} compiled, "
          f"{len(keys) - len(compiled)} already there, {time.perf_counter() - t0:.1f} s")
    print(f"toolchain {jit.TOOLCHAIN}, rosekernels source {jit.package_digest()}: a GPU host with both loads it "
          f"with no compilation (ROSEKERNELS_CACHE_DIR={out}); `rosekernels-cache verify {out}` there checks")
    return 0


# ---------------------------------------------------------------------------------------------
# list, verify


def _cache(path: str) -> Path:
    root = Path(path)
    if not root.exists():
        raise BadInput(f"{root}: no such folder")
    if not (root / "jit").is_dir():
        raise BadInput(f"{root}: not a rosekernels compile cache (no jit/ folder)")
    return root


def _size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def _list(args: argparse.Namespace) -> int:
    root = _cache(args.dir)
    from rosekernels import jit

    entries = jit.disk_entries(root)
    sizes = [e.object_path.stat().st_size if e.object_path.exists() else None for e in entries]
    rows = [(e.op, e.toolchain, "no object" if s is None else _size(s), e.key) for e, s in zip(entries, sizes)]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(("kernel", "toolchain", "size"))]
    for row in [("kernel", "toolchain", "size", "variant key"), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    print(f"{len(entries)} entries, {_size(sum(s or 0 for s in sizes))}, in {root}")
    return 0


def _problem(entry: Any) -> str | None:
    """Why `entry` would not load here with no compilation, or None."""
    from rosekernels import jit
    from rosekernels.variant import Variant

    for path, what in ((entry.meta_path, "metadata (.json)"), (entry.object_path, "object (.o)")):
        if not path.exists():
            return f"its {what} is missing"
    try:
        _, _, meta = jit.read_entry(entry)
        key = Variant.from_dict(meta["variant"]).key()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable: {e}"
    if key != entry.key:
        return f"its metadata names another variant ({key})"
    if meta.get("toolchain") != entry.toolchain:
        return f"its metadata says toolchain {meta.get('toolchain')}, its folder {entry.toolchain}"
    if entry.toolchain != jit.TOOLCHAIN:
        return f"built by toolchain {entry.toolchain}, this install is {jit.TOOLCHAIN}: it would not be loaded here"
    if entry.digest != jit.package_digest():
        return (f"built from another rosekernels source (digest {entry.digest}, this install's "
                f"{jit.package_digest()}): it would not be loaded here")
    return None


def _verify(args: argparse.Namespace) -> int:
    root = _cache(args.dir)
    from rosekernels import jit

    entries = jit.disk_entries(root)
    bad = 0
    for entry in entries:
        problem = _problem(entry)
        if problem is not None:
            bad += 1
            print(f"BAD  {entry.object_path.relative_to(root)}: {problem}")
    here = f"toolchain {jit.TOOLCHAIN}, rosekernels source {jit.package_digest()}"
    if not entries:
        print(f"{root}: no entries ({here})")
        return 1
    print(f"{len(entries)} entries: {len(entries) - bad} good, {bad} bad ({here})")
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------------
# cubin


def _cubin(args: argparse.Namespace) -> int:
    out = Path(args.output)
    if out.is_dir() or not out.parent.is_dir():
        raise BadInput(f"-o {out}: " + ("is a folder" if out.is_dir() else f"the folder {out.parent} does not exist"))
    from rosekernels import jit

    entry = _entry(args.entry, args.dir)
    try:
        _, cubin, _ = jit.read_entry(entry)
    except (OSError, ValueError) as e:
        raise BadInput(f"{entry.object_path}: {getattr(e, 'strerror', None) or e}") from None
    out.write_bytes(cubin)
    print(f"{out}: the sm_90a cubin of {entry.key} ({len(cubin)} bytes; toolchain {entry.toolchain}): "
          f"sip disasm {out}")
    return 0


def _entry(spec: str, folder: str | None) -> Any:
    """The cache entry `spec` names: an entry's .o (or .json) file, or a variant key in `folder`."""
    from rosekernels import jit, paths

    path = Path(spec)
    if path.suffix in (".o", ".json") and path.exists():
        stem = path.with_name(path.name[:-len(path.suffix)])
        return jit.DiskEntry(stem.with_name(stem.name + ".o"), stem.with_name(stem.name + ".json"))
    root = Path(folder) if folder is not None else paths.compile_cache_root()
    found = [e for e in jit.disk_entries(root) if e.key == spec]
    here = [e for e in found if e.toolchain == jit.TOOLCHAIN and e.digest == jit.package_digest()]
    if len(here) == 1 or len(found) == 1:
        return (here or found)[0]
    if not found:
        raise BadInput(f"{spec}: no such file, and no entry with this variant key in {root} "
                       f"(`rosekernels-cache list {root}` shows the keys)")
    raise BadInput(f"{spec}: {len(found)} entries in {root} have this key (other toolchains or sources): give one's "
                   f".o file, e.g. {found[0].object_path}")


if __name__ == "__main__":
    sys.exit(main())
