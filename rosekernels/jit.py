"""Compile CuTeDSL kernels once per specialization: in-memory and on-disk caches, and the cubin hook.

Every compiled variant goes the same way:

1. `cute.compile(..., options="--enable-tvm-ffi")` builds it; the wrapped `Compiler.jit` (the one hook
   point every CuTeDSL module passes before its JIT engine is built) records the cubin found in the
   module's `*_binary` global, so any specialization's cubin can be handed to SIP.
2. The host+device code is exported as an object file into the disk cache
   (<root>/jit/<TOOLCHAIN>/<variant key>-<source digest>.o, with a .json beside it; the root is
   `paths.compile_cache_root()`), so a second
   process skips the JIT. The cache is plain files: `rosekernels-cache` builds one on a machine
   without a GPU, lists and verifies it.
3. The object is loaded with `cute.runtime.load_module`; on the way, `swap_cubins` replaces each
   embedded cubin for which a tuned one is installed (same size, in place). Loading from the object
   also in the compiling process keeps one path for fresh, cached and tuned variants.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # unset, CuTeDSL silently targets sm_100a

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import tvm_ffi  # noqa: E402
from cutlass._mlir import ir  # noqa: E402
from cutlass.base_dsl import compiler as _dsl_compiler  # noqa: E402

from rosekernels import paths  # noqa: E402
from rosekernels.variant import ARCH, Variant  # noqa: E402,F401  (re-exported: jit.Variant)
from sip import fatbin  # noqa: E402
from sip.fatbin import embedded_cubins  # noqa: E402


def _cuda_flavor() -> str:
    """cu12 or cu13: the CUDA build of CuTeDSL's compiler that CuTeDSL loaded (the newest installed one
    that the driver supports; the newest, without a driver). Their ptxas builds differ, so the same
    CuTeDSL version makes other cubins with each."""
    import cutlass._mlir._mlir_libs._cutlass_ir as cutlass_ir

    loaded = cutlass_ir.__file__ or ""
    found = re.match(r"_cutlass_ir\.(cu\d+)\.", os.path.basename(loaded))
    if found is None:
        raise RuntimeError(f"cannot tell which CUDA build of CuTeDSL is loaded from {loaded!r}")
    return found.group(1)


TOOLCHAIN = f"cutedsl-{cutlass.__version__}-{_cuda_flavor()}_tvmffi-{tvm_ffi.__version__}"
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


def uninstall_tuned_cubin(original: bytes, tuned: bytes) -> bool:
    """Stop loading `tuned` for `original` (if it is what is installed for it: another tuned cubin
    installed since stays); whether it was. Kernels loaded with it keep it until forgotten."""
    key = hashlib.sha256(original).hexdigest()
    if _tuned_cubins.get(key) != tuned:
        return False
    del _tuned_cubins[key]
    return True


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
_no_compile = threading.local()


class NotCached(LookupError):
    """compile_variant inside `cached_only()`, for a variant that neither cache holds."""


@contextlib.contextmanager
def cached_only():
    """Within it, compile_variant (in this thread) loads from the caches and raises NotCached instead
    of compiling: how warm-up tells the cold variants from the others without compiling."""
    before = getattr(_no_compile, "on", False)
    _no_compile.on = True
    try:
        yield
    finally:
        _no_compile.on = before


@functools.lru_cache(maxsize=None)
def package_digest() -> str:
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
        return package_digest()
    return hashlib.sha256((package_digest() + source.read_text()).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class DiskEntry:
    """One variant in a disk cache: <root>/jit/<toolchain>/<variant key>-<source digest>.o, and the
    .json beside it (variant, cubin SHA-256, toolchain)."""

    object_path: Path
    meta_path: Path

    @property
    def toolchain(self) -> str:
        return self.object_path.parent.name

    @property
    def key(self) -> str:
        return self.object_path.name[:-len(".o")].rsplit("-", 1)[0]

    @property
    def digest(self) -> str:
        return self.object_path.name[:-len(".o")].rsplit("-", 1)[-1]

    @property
    def op(self) -> str:
        return self.key.split("-", 1)[0]


def _disk_entry(variant: Variant, digest: str) -> DiskEntry:
    folder = paths.compile_cache_root() / "jit" / TOOLCHAIN
    name = f"{variant.key()}-{digest}"  # keys hold dots (eps=1e-06, 0.0): never use with_suffix
    return DiskEntry(folder / f"{name}.o", folder / f"{name}.json")


def disk_entries(root: str | os.PathLike) -> list[DiskEntry]:
    """Every entry of the disk cache at `root`, of any toolchain, sorted; an object or metadata file
    whose other half is missing counts as an entry too (`read_entry` then says so)."""
    stems = sorted({path.with_name(path.name[:-len(path.suffix)]) for path in (Path(root) / "jit").glob("*/*")
                    if path.suffix in (".o", ".json")})
    return [DiskEntry(stem.with_name(stem.name + ".o"), stem.with_name(stem.name + ".json")) for stem in stems]


def read_entry(entry: DiskEntry) -> tuple[bytes, bytes, dict[str, Any]]:
    """(object bytes, its cubin, metadata) of a whole entry; OSError or ValueError saying what is wrong."""
    meta = json.loads(entry.meta_path.read_text())
    if not isinstance(meta, dict) or not isinstance(meta.get("cubin_sha256"), str):
        raise ValueError("its metadata has no cubin_sha256")
    obj = entry.object_path.read_bytes()
    cubins = [c for _, c in embedded_cubins(obj)]
    if len(cubins) != 1:
        raise ValueError(f"the object embeds {len(cubins)} cubins, not one")
    if hashlib.sha256(cubins[0]).hexdigest() != meta["cubin_sha256"]:
        raise ValueError("its cubin does not match the SHA-256 in its metadata")
    return obj, cubins[0], meta


def _read_disk(variant: Variant, digest: str) -> tuple[bytes, bytes] | None:
    entry = _disk_entry(variant, digest)
    if not entry.object_path.exists():
        return None
    try:
        obj, cubin, _ = read_entry(entry)
        return obj, cubin
    except (OSError, ValueError) as e:
        warnings.warn(f"rosekernels: ignoring corrupt cache entry {entry.object_path}: {e}", stacklevel=3)
        return None


def _write_disk(variant: Variant, digest: str, obj: bytes, cubin: bytes) -> None:
    entry = _disk_entry(variant, digest)
    try:
        entry.object_path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"variant": variant.as_dict(), "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
                "toolchain": TOOLCHAIN}
        for path, data in ((entry.object_path, obj), (entry.meta_path, json.dumps(meta, indent=1).encode())):
            paths.write_atomic(path, data)  # readers never see a half-written entry
    except OSError as e:
        warnings.warn(f"rosekernels: cannot write the compile cache at {entry.object_path}: {e}", stacklevel=3)


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
            if getattr(_no_compile, "on", False):
                raise NotCached(variant)
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


# ---------------------------------------------------------------------------------------------
# Compiling many variants at once: cold ones in parallel processes.

# Peak resident memory of one compile worker (a spawned process that imports torch and CuTeDSL,
# then compiles): 450-470 MiB measured on the CPU build host for the largest kernels (GEMM,
# attention), rounded up for other hosts' builds of the libraries.
COMPILE_PEAK_BYTES = 640 << 20


def _available_memory() -> int | None:
    """Bytes new processes may take: the kernel's MemAvailable, capped by a cgroup (v2) limit; None
    where neither can be read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def compile_processes(jobs: int) -> int:
    """Worker processes for `jobs` cold compiles: one per core this process may run on, no more than
    fit in the available memory at COMPILE_PEAK_BYTES each, nor than there are jobs; at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = _available_memory()
    fit = cores if memory is None else memory // COMPILE_PEAK_BYTES
    return max(1, min(jobs, cores, fit))


def compile_cold(jobs: Iterable[tuple[Callable[[Any], CompiledKernel], Any]], processes: int | None = None,
                 progress: bool = False) -> list[Variant]:
    """Compile into the disk cache each (compile, config) of `jobs` (a kernel module's `compile`, which
    a worker process unpickles by its module and name) whose variant neither cache holds, in
    `processes` spawned processes (None: `compile_processes`; 1: here), with a tqdm bar when
    `progress` and stderr is a terminal; the warm ones are loaded here on the way. Returns the
    variants compiled."""
    cold: dict[Variant, tuple[Callable[[Any], CompiledKernel], Any]] = {}
    for compile_config, cfg in jobs:
        variant = cfg.variant()
        if variant in cold:
            continue
        try:
            with cached_only():
                compile_config(cfg)
        except NotCached:
            cold[variant] = (compile_config, cfg)
    if not cold:
        return []
    import concurrent.futures
    import multiprocessing

    from tqdm import tqdm

    todo = list(cold.values())
    processes = min(processes or compile_processes(len(todo)), len(todo))
    with tqdm(total=len(todo), desc=f"rosekernels: compiling in {processes} process{'es' * (processes > 1)}",
              unit="kernel", disable=None if progress else True) as bar:
        if processes == 1:
            for compile_config, cfg in todo:
                compile_config(cfg)
                bar.update()
        else:
            ctx = multiprocessing.get_context("spawn")  # CuTeDSL's and CUDA's state do not survive fork
            root = str(paths.compile_cache_root())
            with concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx) as pool:
                futures = [pool.submit(_compile_in_worker, root, compile_config, cfg) for compile_config, cfg in todo]
                try:
                    for future in concurrent.futures.as_completed(futures):
                        future.result()
                        bar.update()
                except BaseException:
                    pool.shutdown(wait=False, cancel_futures=True)  # the first failure ends the build
                    raise
    return list(cold)


def _compile_in_worker(root: str, compile_config: Callable[[Any], CompiledKernel], cfg: Any) -> None:
    paths.use_compile_cache_root(root)
    compile_config(cfg)


def precompile(compile_config: Callable[[Any], CompiledKernel], configs: Any, processes: int | None = None,
               progress: bool = False) -> list[CompiledKernel]:
    """`compile_config(cfg)` (a kernel module's `compile`) of each config, the cold ones compiled in
    parallel processes into the disk cache first (`compile_cold`), then loaded here: a cold cache costs
    about one compile time per process instead of one per config. Configs that share a variant (they
    differ only in launch policy) compile once."""
    configs = list(configs)
    compile_cold([(compile_config, c) for c in configs], processes, progress)
    return [compile_config(c) for c in configs]
