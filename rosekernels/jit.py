"""Compile CuTeDSL kernels once per specialization: in-memory and on-disk caches, and the cubin hook.

Every compiled variant goes the same way:

1. `cute.compile(..., options="--enable-tvm-ffi")` builds it; the wrapped `Compiler.jit` (the one hook
   point every CuTeDSL module passes before its JIT engine is built) records the cubin found in the
   module's `*_binary` global, so any specialization's cubin can be handed to SIP.
2. The host+device code is exported as an object file into the disk cache, so a second process
   skips the JIT.
3. The object is loaded with `cute.runtime.load_module`; on the way, `swap_cubins` replaces each
   embedded cubin for which a tuned one is installed (same size, in place). Loading from the object
   also in the compiling process keeps one path for fresh, cached and tuned variants.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # unset, CuTeDSL silently targets sm_100a

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import tvm_ffi  # noqa: E402
from cutlass._mlir import ir  # noqa: E402
from cutlass.base_dsl import compiler as _dsl_compiler  # noqa: E402

from rosekernels.paths import cache_dir  # noqa: E402,F401  (re-exported: jit.cache_dir)
from rosekernels.variant import ARCH, Variant  # noqa: E402,F401  (re-exported: jit.Variant)
from sip import fatbin  # noqa: E402

TOOLCHAIN = f"cutedsl-{cutlass.__version__}_tvmffi-{tvm_ffi.__version__}"
_ENTRY_NAME = "rk_entry"  # symbol prefix of every exported function


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    variant: Variant
    fn: Callable[..., Any]  # TVM-FFI function: call it with torch tensors
    object_bytes: bytes  # exported host+device object, with the ORIGINAL cubin
    cubin: bytes  # the original cubin as ptxas produced it
    tuned: bool  # a tuned cubin replaced the original when loading

    @property
    def cubin_sha256(self) -> str:
        return hashlib.sha256(self.cubin).hexdigest()


# ---------------------------------------------------------------------------------------------
# The cubin hook: capture at compile time, substitute at load time.

_tuned_cubins: dict[str, bytes] = {}  # sha256(original cubin) -> tuned cubin of the same size
_capture = threading.local()


def install_tuned_cubin(original: bytes, tuned: bytes) -> None:
    """Load `tuned` wherever a kernel embeds `original`, from now on (for variants not yet loaded)."""
    if len(tuned) != len(original):
        raise ValueError(f"tuned cubin has {len(tuned)} bytes, the original {len(original)}")
    _tuned_cubins[hashlib.sha256(original).hexdigest()] = bytes(tuned)


def uninstall_tuned_cubins() -> None:
    _tuned_cubins.clear()


def swap_cubins(blob: bytes, replacements: dict[str, bytes] | None = None) -> tuple[bytes, bool]:
    """`blob` (a fatbin or an object file embedding fatbins) with tuned cubins swapped in."""
    table = _tuned_cubins if replacements is None else replacements
    if not table:
        return blob, False
    out = bytearray(blob)
    changed = False
    for offset, cubin in embedded_cubins(blob):
        tuned = table.get(hashlib.sha256(cubin).hexdigest())
        if tuned is not None:
            out[offset:offset + len(cubin)] = tuned
            changed = True
    return bytes(out), changed


def embedded_cubins(blob: bytes) -> list[tuple[int, bytes]]:
    """(absolute offset, bytes) of every cubin in every fatbin embedded in `blob`."""
    magic = fatbin.FATBIN_MAGIC.to_bytes(4, "little")
    found = []
    start = blob.find(magic)
    while start >= 0:
        try:
            found += [(start + off, c) for off, c in fatbin.cubins(blob[start:])]
        except fatbin.FatbinError:
            pass  # the magic number occurred by chance
        start = blob.find(magic, start + 4)
    return found


def _binary_globals(module: ir.Module) -> list[bytes]:
    blobs = []

    def visit(op: Any) -> Any:
        o = op.operation
        if o.name == "llvm.mlir.global" and "sym_name" in o.attributes:
            if ir.StringAttr(o.attributes["sym_name"]).value.endswith("_binary"):
                blobs.append(ir.StringAttr(o.attributes["value"]).value_bytes)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return blobs


def _hooked_jit(self: Any, module: ir.Module, *args: Any, **kwargs: Any) -> Any:
    sink = getattr(_capture, "cubins", None)
    if sink is not None:
        for blob in _binary_globals(module):
            sink += [c for _, c in fatbin.cubins(blob)]
    return _original_jit(self, module, *args, **kwargs)


# Idempotent under importlib.reload: always wrap the DSL's own method.
_original_jit = getattr(_dsl_compiler.Compiler.jit, "__wrapped__", _dsl_compiler.Compiler.jit)
_hooked_jit.__wrapped__ = _original_jit  # type: ignore[attr-defined]
_dsl_compiler.Compiler.jit = _hooked_jit


def compile_to_object(fn: Callable[..., Any], args: tuple) -> tuple[bytes, bytes]:
    """Compile a `@cute.jit` function for sm_90a; return (object file bytes, its single cubin)."""
    _capture.cubins = []
    try:
        compiled = cute.compile(fn, *args, options="--enable-tvm-ffi")
        cubins = _capture.cubins
    finally:
        _capture.cubins = None
    if len(cubins) != 1:
        raise RuntimeError(f"expected one cubin in the compiled module, found {len(cubins)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.o")
        compiled.export_to_c(path, function_name=_ENTRY_NAME)
        return Path(path).read_bytes(), cubins[0]


def load_object(object_bytes: bytes, replacements: dict[str, bytes] | None = None) -> tuple[Any, bool]:
    """Load an exported object (tuned cubins swapped in); return (TVM-FFI function, tuned?)."""
    data, tuned = swap_cubins(object_bytes, replacements)
    with tempfile.NamedTemporaryFile(suffix=".o", delete=False) as f:
        f.write(data)
    try:
        module = cute.runtime.load_module(f.name, enable_tvm_ffi=True)
        return getattr(module, _ENTRY_NAME), tuned
    finally:
        os.unlink(f.name)  # the JIT linker has copied what it needs


# ---------------------------------------------------------------------------------------------
# The caches.

_memory: dict[Variant, CompiledKernel] = {}
_locks: dict[Variant, threading.Lock] = {}
_locks_guard = threading.Lock()


@functools.lru_cache(maxsize=None)
def _package_digest() -> str:
    """Digest of every source file of the package, so that an edit to a kernel or to anything it
    imports (checks, modes, shared device helpers) invalidates the objects cached on disk."""
    h = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _source_digest(build: Callable[..., Any]) -> str:
    """The package digest, plus the builder's own file when it lives outside the package."""
    import inspect

    source = Path(inspect.getsourcefile(build) or __file__).resolve()
    if Path(__file__).parent.resolve() in source.parents:
        return _package_digest()
    return hashlib.sha256((_package_digest() + source.read_text()).encode()).hexdigest()[:16]


def _disk_paths(variant: Variant, digest: str) -> tuple[Path, Path]:
    folder = cache_dir() / "jit" / TOOLCHAIN
    name = f"{variant.key()}-{digest}"  # keys hold dots (eps=1e-06, 0.0): never use with_suffix
    return folder / f"{name}.o", folder / f"{name}.json"


def _read_disk(variant: Variant, digest: str) -> tuple[bytes, bytes] | None:
    obj_path, meta_path = _disk_paths(variant, digest)
    if not obj_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        obj = obj_path.read_bytes()
        cubins = [c for _, c in embedded_cubins(obj)]
        if len(cubins) != 1 or hashlib.sha256(cubins[0]).hexdigest() != meta["cubin_sha256"]:
            raise ValueError("embedded cubin does not match its metadata")
        return obj, cubins[0]
    except (OSError, ValueError, KeyError) as e:
        warnings.warn(f"rosekernels: ignoring corrupt cache entry {obj_path}: {e}", stacklevel=3)
        return None


def _write_disk(variant: Variant, digest: str, obj: bytes, cubin: bytes) -> None:
    obj_path, meta_path = _disk_paths(variant, digest)
    try:
        obj_path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"variant": variant.as_dict(), "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
                "toolchain": TOOLCHAIN}
        for path, data in ((obj_path, obj), (meta_path, json.dumps(meta, indent=1).encode())):
            fd, tmp = tempfile.mkstemp(dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: readers never see a half-written entry
    except OSError as e:
        warnings.warn(f"rosekernels: cannot write the compile cache at {obj_path}: {e}", stacklevel=3)


def compile_variant(variant: Variant, build: Callable[[], tuple[Callable[..., Any], tuple]]) -> CompiledKernel:
    """The loaded kernel for `variant`; `build()` returns (`@cute.jit` function, compile args)
    and runs only when neither cache holds the variant."""
    hit = _memory.get(variant)
    if hit is not None:
        return hit
    with _locks_guard:
        lock = _locks.setdefault(variant, threading.Lock())
    with lock:
        hit = _memory.get(variant)
        if hit is not None:
            return hit
        digest = _source_digest(build)
        cached = _read_disk(variant, digest)
        if cached is None:
            obj, cubin = compile_to_object(*build())
            _write_disk(variant, digest, obj, cubin)
        else:
            obj, cubin = cached
        fn, tuned = load_object(obj)
        kernel = CompiledKernel(variant, fn, obj, cubin, tuned)
        _memory[variant] = kernel
        return kernel


def loaded_variants() -> list[CompiledKernel]:
    return list(_memory.values())


def forget_loaded() -> None:
    """Drop the in-memory cache (the next call loads from disk again): for tests and warmup."""
    _memory.clear()


def precompile(module: str, configs: Any, processes: int | None = None) -> list[CompiledKernel]:
    """`compile(cfg)` of kernel module `module` for each config, the cold ones compiled in parallel
    processes into the disk cache first, then loaded here: a cold cache costs about one compile time
    instead of one per config. Configs that share a variant (they differ only in launch policy)
    compile once."""
    import concurrent.futures
    import importlib
    import multiprocessing

    compile_config = importlib.import_module(module).compile
    configs = list(configs)
    loaded = {k.variant for k in loaded_variants()}
    todo = list({c.variant(): c for c in configs if c.variant() not in loaded}.values())
    processes = processes or min(len(todo), os.cpu_count() or 1)
    if processes > 1:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx) as pool:
            list(pool.map(functools.partial(_compile_in_worker, module), todo))
    return [compile_config(c) for c in configs]


def _compile_in_worker(module: str, cfg: Any) -> str:
    import importlib

    return importlib.import_module(module).compile(cfg).cubin_sha256
