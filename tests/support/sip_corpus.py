"""The SIP test corpus: Hopper cubins built at test time (no binaries in the repository).

`CORPUS` is the list of (name, builder) pairs every corpus-wide test iterates over; a builder
gets a scratch directory and returns cubin bytes, or raises pytest.skip when its toolchain is
missing. Add entries by appending to CORPUS.

`corpus` is a session fixture: {name: cubin bytes} for the builders that could run, built once
per session (nvcc runs in parallel).
"""

import csv
import functools
import io
import importlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

CORPUS_SOURCES = Path(__file__).parent / "corpus"


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidate = os.path.join(home, "bin", "nvcc")
    return candidate if os.access(candidate, os.X_OK) else None


def compile_cu(source: Path, workdir: Path, arch: str = "sm_90a", defines: tuple[str, ...] = (),
               flags: tuple[str, ...] = ()) -> bytes:
    """nvcc -cubin for one architecture (`flags`: more nvcc options); `sm_90a` builds with the
    arch-specific PTX target."""
    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin): the CUDA part of the corpus needs it")
    out = workdir / f"{source.stem}.{arch}.{'_'.join(defines + flags).replace('-', '') or 'default'}.cubin"
    gencode = (["-gencode", "arch=compute_90a,code=sm_90a"] if arch == "sm_90a"
               else [f"-arch={arch}"])
    cmd = [nvcc, "-cubin", *gencode, *flags, *(f"-D{d}" for d in defines), str(source), "-o", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr}")
    return out.read_bytes()


def _nvcc_builder(stem: str) -> Callable[[Path], bytes]:
    def build(workdir: Path) -> bytes:
        return compile_cu(CORPUS_SOURCES / f"{stem}.cu", workdir)
    build.__name__ = f"build_{stem}"
    build.runs_in_subprocess = True  # safe to run next to other builders
    return build


# ---------------------------------------------------------------- CuTeDSL kernels

def cubin_from_cute(compiled) -> bytes:
    """The sm_90a cubin inside a cute.compile() result: its module holds the fatbin in an
    `llvm.mlir.global` whose name ends with `_binary`."""
    from cutlass._mlir import ir

    from sip.cubin import cubins_in_fatbin

    blobs = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if child.name == "llvm.mlir.global":
                        name = ir.StringAttr(child.attributes["sym_name"]).value
                        if name.endswith("_binary"):
                            blobs.append(ir.StringAttr(child.attributes["value"]).value_bytes)
                    walk(child)

    walk(compiled.ir_module.operation)
    cubins = [c for blob in blobs for _, c in cubins_in_fatbin(blob)]
    if len(cubins) != 1:
        raise RuntimeError(f"expected one cubin in the compiled module, found {len(cubins)}")
    return cubins[0]


def _cute():
    try:
        import cutlass
        import cutlass.cute as cute
    except ImportError as e:
        pytest.skip(f"CuTeDSL (nvidia-cutlass-dsl) not importable: {e}")
    return cutlass, cute


def _needs(*modules: str) -> Callable[[Callable[[Path], bytes]], Callable[[Path], bytes]]:
    """The builder, skipped where one of `modules` cannot be imported (the engine's tests also run
    without torch, CuTeDSL and rosekernels)."""
    def wrap(builder: Callable[[Path], bytes]) -> Callable[[Path], bytes]:
        @functools.wraps(builder)
        def build(workdir: Path) -> bytes:
            for name in modules:
                try:
                    importlib.import_module(name)
                except ImportError as e:
                    pytest.skip(f"{name} not importable: {e}")
            return builder(workdir)
        return build
    return wrap


def build_cute_vector_scale_add(workdir: Path) -> bytes:
    """out = 2 * a + b, 8 floats per thread through 128-bit vector loads and stores."""
    cutlass, cute = _cute()
    from cutlass.cute.runtime import make_fake_compact_tensor

    @cute.kernel
    def scale_add_kernel(ga: cute.Tensor, gb: cute.Tensor, gc: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        bdim, _, _ = cute.arch.block_dim()
        i = bidx * bdim + tidx
        a = ga[(None, i)].load()
        b = gb[(None, i)].load()
        gc[(None, i)] = a * 2.0 + b

    @cute.jit
    def scale_add(ma: cute.Tensor, mb: cute.Tensor, mc: cute.Tensor):
        tiles = [cute.zipped_divide(m, (8,)) for m in (ma, mb, mc)]
        scale_add_kernel(*tiles).launch(grid=[16, 1, 1], block=[128, 1, 1])

    n = 16 * 128 * 8
    args = [make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16) for _ in range(3)]
    return cubin_from_cute(cute.compile(scale_add, *args))


def build_cute_row_sum(workdir: Path) -> bytes:
    """y[row] = sum(x[row, :]): strided loads, a shuffle reduction, shared memory across warps."""
    cutlass, cute = _cute()
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.memory import SmemAllocator

    @cute.kernel
    def row_sum_kernel(gx: cute.Tensor, gy: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        acc = cutlass.Float32(0.0)
        for j in cutlass.range(tidx, gx.shape[1], 128):
            acc = acc + gx[row, j]
        acc = cute.arch.warp_reduction_sum(acc)
        partial = SmemAllocator().allocate_tensor(cutlass.Float32, cute.make_layout(4),
                                                  byte_alignment=16)
        if tidx % 32 == 0:
            partial[tidx // 32] = acc
        cute.arch.sync_threads()
        if tidx == 0:
            gy[row] = partial[0] + partial[1] + partial[2] + partial[3]

    @cute.jit
    def row_sum(mx: cute.Tensor, my: cute.Tensor):
        row_sum_kernel(mx, my).launch(grid=[mx.shape[0], 1, 1], block=[128, 1, 1])

    x = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int32(), cute.sym_int32(divisibility=4)),
                                 stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int32(),), assumed_align=16)
    return cubin_from_cute(cute.compile(row_sum, x, y))


def build_rosekernels_gemm(workdir: Path) -> bytes:
    """The project's own Hopper GEMM: TMA loads, mbarrier pipeline, WGMMA warpgroups, TMA store."""
    from rosekernels.kernels import gemm_leakyrelu as gemm

    return gemm.compile(gemm.Config()).cubin  # bf16, cooperative 128 x 256 tiles on 2x1 clusters


CORPUS: list[tuple[str, Callable[[Path], bytes]]] = [
    ("cute_vector_scale_add", build_cute_vector_scale_add),
    ("cute_row_sum", build_cute_row_sum),
    ("rosekernels_tma_wgmma_gemm", _needs("torch", "rosekernels.jit")(build_rosekernels_gemm)),
    *((stem, _nvcc_builder(stem)) for stem in (
        "smem_tiled_gemm", "cp_async_pipeline", "warp_reduce_atomics", "mma_sync_hmma",
        "wgmma_tma", "control_mix", "isa_zoo", "unrolled_stencil", "uniform64")),
]
CORPUS_NAMES = [name for name, _ in CORPUS]


_BUILT: dict[str, bytes] | None = None  # test modules import the fixture; build only once


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, bytes]:
    """{name: cubin} for every CORPUS entry whose toolchain is available."""
    global _BUILT
    if _BUILT is None:
        _BUILT = _build_all(tmp_path_factory.mktemp("sip_corpus"))
    return _BUILT


def _build_all(workdir: Path) -> dict[str, bytes]:
    def build(entry):
        name, builder = entry
        try:
            return name, builder(workdir)
        except pytest.skip.Exception:
            return name, None

    # In-process builders (CuTeDSL) run one at a time; nvcc builds run two at a time.
    parallel = [e for e in CORPUS if getattr(e[1], "runs_in_subprocess", False)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        pending = pool.map(build, parallel)
        built = dict(build(e) for e in CORPUS if e not in parallel)
        built.update(pending)
    return {name: data for name, data in built.items() if data is not None}


def corpus_entry(corpus: dict[str, bytes], name: str) -> bytes:
    if name not in corpus:
        pytest.skip(f"corpus entry {name} could not be built here (toolchain missing)")
    return corpus[name]


# ---------------------------------------------------------------- hand-written kernels

class SyntheticCubin:
    """Just enough of sip.cubin.Cubin for a hand-written kernel: its code bytes (and no other section)."""

    sections = ()

    def __init__(self, text: bytes):
        self._text = text

    def text(self, name: str) -> bytes:
        return self._text

    def with_text(self, name: str, text: bytes) -> bytes:
        return text


def synthetic_kernel(rows, pins: dict[int, str] | None = None, fenced=frozenset()):
    """A Kernel from (sass text, Control) rows, e.g. ("@P0 FADD R1, R2, R3 ;", Control(...)).
    Instruction words hold the row number in their low bits and the control code on top; `pins`
    and `fenced` are the cubin's references into the code (sip.cubin.KernelText)."""
    from types import MappingProxyType

    from sip.cubin import KernelText, Section
    from sip.sass import Kernel, basic_blocks, decode

    instructions = []
    for k, (text, control) in enumerate(rows):
        text = text.rstrip(" ;")
        predicate = ""
        if text.startswith("@"):
            predicate, text = text.split(" ", 1)
        opcode, _, operands = text.partition(" ")
        record = {"opcode": opcode, "operands": operands.replace(" ", "")}
        if predicate:
            record["predicate"] = predicate
        word = (k + 1) | control.bits << 105
        instructions.append(decode(k, 16 * k, word, record, {}, 16 * len(rows)))
    instructions = tuple(instructions)
    size = 16 * len(rows)
    section = Section(1, ".text.synthetic", 1, 6, 0, size, 0, 0)
    code = KernelText("synthetic", section, True, MappingProxyType(dict(pins or {})), frozenset({0}),
                      frozenset(fenced))
    blocks = basic_blocks(instructions, code.entries)
    block_of = tuple(b for b, r in enumerate(blocks) for _ in r)
    text = b"".join(i.word.to_bytes(16, "little") for i in instructions)
    return Kernel("synthetic", "sm_90a", code, instructions, blocks, block_of, SyntheticCubin(text))


BASE = 0x7F3A_0000_1000  # ncu lists absolute addresses (ncu_listing)


def ncu_listing(kernel, samples, base=BASE, name=None):
    """An ncu `--page source --print-source sass --csv` listing of `kernel` with these sample counts, in
    the layout the H200's ncu writes: a "Kernel Name" line, the header, then one row per instruction."""
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    out.write(f'"Kernel Name","{name or kernel.name}",\n')
    w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
                "# Samples", "Instructions Executed"])
    for ins, n in zip(kernel.instructions, samples):
        text = f"{ins.predicate} {ins.opcode} {', '.join(ins.operands)}".strip()
        w.writerow([f"{base + ins.offset:#x}", "      " + text, f"{n:,}", str(n // 2), str(n), "64"])
    return out.getvalue()
