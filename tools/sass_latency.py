"""Measure the read-after-write latencies of fixed-latency SASS on the GPU: the table that lets SIP
lower stall counts (sip.latency, `sip mutate --moves control.stall --latency-table FILE`).

    python3 tools/sass_latency.py --out bench/results/sip/sass_latency.json.gz  (on an H200; .gz: compressed)
    python3 tools/sass_latency.py --build DIR                               (no GPU: generate and check)

Method. For every chain below, one PTX kernel runs a dependent chain A, B, A, B, ... (each
instruction reads the previous one's result) between two clock64 reads, in a loop of a few
iterations (the first one warms the instruction cache), with one warp per block (so a stall count
is the distance in cycles between two instructions of the warp). ptxas compiles the module; SIP's
engine decodes each kernel and checks that the timed part is that chain: consecutive instructions,
each reading what the one before it wrote, only NOPs between them, producers with no scoreboard
(variable-latency instructions are interlocked by the hardware: nothing to measure). A chain gives
one measured pair per producer class P followed by consumer class C through register file F
(R, P, or a guard predicate @P), keyed by sip.latency.opclass as the dependency model reads them.

For each pair and each distance k from ptxas' own stall down to the smallest that can be encoded,
the cubin is rewritten so that every producer of the pair issues its consumer exactly k stall
cycles later (the producer's stall, plus the NOPs between), and run `--trials` times on fresh
inputs. k is proven when every run writes the same results as the unmodified kernel, and the clock
shows the timed part took no more cycles than its stall counts add up to (plus a small margin):
extra cycles (an operand bank conflict, an instruction-cache miss) could otherwise have hidden a
stale read. A chain holds `units` pairs, so a latency above k corrupts many reads at once, and the
inputs make every step change the value (no step is an identity where a stale read would go
unseen; the tool does not measure a producer that is one). The latency of a pair is the smallest k
proven together with every larger one; the table records it, ptxas' stall and every run.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import gzip
import itertools
import json
import os
import platform
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sip import SipError  # noqa: E402
from sip.cubin import INSTRUCTION_BYTES, parse_cubin  # noqa: E402
from sip.latency import FORMAT, opclass, register_file  # noqa: E402
from sip.mutate import MAX_STALL  # noqa: E402
from sip.sass import Instruction, control_bits, disassemble, regs_in, with_control  # noqa: E402

WARP = 32
_STALL = 0xF

# ---------------------------------------------------------------- what is measured

# Constants (u32 words of the `ks` buffer) the chains read. Loaded at run time, so ptxas cannot fold
# them. Float chains (any FP op in them) use values that keep every step finite and changing; the
# integer chains use odd multipliers and large addends.
K = {name: k for k, name in enumerate((
    "fmul", "fadd", "imul", "iadd_a", "ithresh", "hmul", "hadd", "iadd_b", "shift", "prmt_b", "prmt_sel",
    "sel_k", "h0", "h1", "h2", "h3", "h4", "h5", "pad", "pad2", "d_mul_lo", "d_mul_hi", "d_add_lo",
    "d_add_hi", "iterations"))}

# PTX of one chain step per op: %v is the 32-bit chain value, %k<name> the constant K[name], <c> the
# add / xor constant (it alternates between two registers so that ptxas cannot cancel x ^ c ^ c).
OPS = {
    "FFMA": ("float", "fma.rn.f32 %v, %v, %k<fmul>, %k<fadd>;"),
    "FMUL": ("float", "mul.rn.f32 %v, %v, %k<fmul>;"),
    "FADD": ("float", "add.rn.f32 %v, %v, %k<fadd>;"),
    "HFMA2": ("float", "fma.rn.f16x2 %v, %v, %k<hmul>, %k<hadd>;"),
    "IMAD": ("int", "mad.lo.u32 %v, %v, %k<imul>, <c>;"),
    "IADD3": ("int", "add.u32 %v, %v, <c>;"),
    "LOP3": ("int", "lop3.b32 %v, %v, <c>, %k<prmt_b>, 0x78;"),  # v ^ (c & b): two steps are 4 inputs
    "SHF": ("int", "shf.l.wrap.b32 %v, %v, %v, %k<shift>;"),
    "PRMT": ("int", "prmt.b32 %v, %v, %k<prmt_b>, %k<prmt_sel>;"),
    "SEL": ("int", "selp.b32 %v, %v, %k<sel_k>, %lane_odd;"),  # odd lanes reset to a constant
}
# Ops that leave a float chain's value unchanged (SHF rotates by 32 there, to keep floats finite):
# a stale read of their result would go unseen, so they are not measured as producers there.
IDENTITY_IN_FLOAT = {"SHF"}

SPECIAL = {  # name: (kind, ops it is made of, PTX of one unit)
    # guard predicate: ISETP -> @P IADD (ptxas: IMAD.IADD), and back through R
    "ISETP.guard": ("int", ("ISETP", "IADD3"), ["setp.lt.u32 %p0, %v, %k<ithresh>;", "@%p0 add.u32 %v, %v, %k<iadd_a>;"]),
    # carry predicate: IADD3 (carry out) -> IADD3.X (carry in), and back through R
    "IADD3.carry": ("int", ("IADD3",), ["add.cc.u32 %v, %v, %w;", "addc.u32 %w, %w, %k<iadd_a>;"]),
    "HMMA.F16": ("mma", ("HMMA",), ["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%d0, %d1, %d2, %d3}, "
                                    "{%k<h0>, %k<h1>, %k<h2>, %k<h3>}, {%k<h4>, %k<h5>}, {%d0, %d1, %d2, %d3};"]),
    "HMMA.BF16": ("mma", ("HMMA",), ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%d0, %d1, %d2, %d3}, "
                                     "{%k<h0>, %k<h1>, %k<h2>, %k<h3>}, {%k<h4>, %k<h5>}, {%d0, %d1, %d2, %d3};"]),
    "DFMA": ("f64", ("DFMA",), ["fma.rn.f64 %q0, %q0, %q1, %q2;"]),
    "DFMA>DADD": ("f64", ("DFMA", "DADD"), ["fma.rn.f64 %q0, %q0, %q1, %q2;", "add.rn.f64 %q0, %q0, %q2;"]),
    "DFMA>DMUL": ("f64", ("DFMA", "DMUL"), ["fma.rn.f64 %q0, %q0, %q1, %q2;", "mul.rn.f64 %q0, %q0, %q1;"]),
    "DADD>DMUL": ("f64", ("DADD", "DMUL"), ["add.rn.f64 %q0, %q0, %q2;", "mul.rn.f64 %q0, %q0, %q1;"]),
}


@dataclasses.dataclass(frozen=True)
class Chain:
    name: str
    kind: str  # float / int / mma / f64: which constants it runs with
    ops: tuple[str, ...]  # what it is made of (--ops selects by these)
    steps: tuple[str, ...]  # PTX of one unit (repeated `units` times)
    identity: frozenset[str] = frozenset()  # SASS classes that are identities here (not measured as producers)

    @property
    def kernel(self) -> str:
        return "chain_" + "".join(ch if ch.isalnum() else "_" for ch in self.name)


def chains(ops: list[str] | None = None) -> list[Chain]:
    """Every chain: each unordered pair of the register ops (and each op alone), then the special
    chains; `ops` keeps those made of listed ops only."""
    out = []
    for a, b in itertools.combinations_with_replacement(list(OPS), 2):
        kind = "float" if "float" in {OPS[a][0], OPS[b][0]} else "int"
        if a == b == "SEL":  # a selp of itself keeps the value: nothing to see
            continue
        steps = (OPS[a][1],) if a == b else (OPS[a][1], OPS[b][1])
        identity = frozenset(o for o in (a, b) if kind == "float" and o in IDENTITY_IN_FLOAT)
        out.append(Chain(f"{a}>{b}" if a != b else a, kind, (a, b), steps, identity))
    for name, (kind, parts, steps) in SPECIAL.items():
        out.append(Chain(name, kind, parts, tuple(steps)))
    if ops:
        out = [c for c in out if set(c.ops) <= set(ops)]
    return out


def constants(kind: str, iterations: int) -> list[int]:
    """The ks words of a chain kind (see K)."""
    f32 = lambda x: struct.unpack("<I", struct.pack("<f", x))[0]  # noqa: E731
    f64 = lambda x: struct.unpack("<II", struct.pack("<d", x))  # noqa: E731
    ks = [0] * len(K)
    ks[K["fmul"]], ks[K["fadd"]] = f32(1.0001), f32(0.5)
    gentle = kind == "float"  # integer steps inside a float chain only touch low mantissa bits
    ks[K["imul"]] = 1 if gentle else 0x9E3779B1
    ks[K["iadd_a"]], ks[K["iadd_b"]] = (3, 5) if gentle else (0x01000193, 0x7F4A7C15)
    ks[K["ithresh"]] = 0x80000000
    ks[K["hmul"]], ks[K["hadd"]] = 0x3C003C00, 0x00003C00  # (1, 1) and (0 high, 1 low) as half2
    ks[K["shift"]] = 32 if gentle else 7
    ks[K["prmt_b"]], ks[K["prmt_sel"]] = 0xA5A5A5A5, 0x3201 if gentle else 0x6521
    ks[K["sel_k"]] = f32(1.25) if gentle else 0x2545F491
    for k, h in enumerate((0x1C001C00, 0x1C002000, 0x20001C00, 0x1C001C00, 0x1C002000, 0x20001C00)):
        ks[K[f"h{k}"]] = h  # small f16 / bf16 fragments: the accumulators grow slowly
    ks[K["d_mul_lo"]], ks[K["d_mul_hi"]] = f64(1.0001)
    ks[K["d_add_lo"]], ks[K["d_add_hi"]] = f64(0.5)
    ks[K["iterations"]] = iterations
    return ks


def ptx(chain_list: list[Chain], units: int) -> str:
    """One PTX module with a kernel per chain: (out, xs, ks), 8 u32 words per thread in and out."""
    head = [".version 8.0", ".target sm_90a", ".address_size 64", ""]
    return "\n".join(head + [_kernel_ptx(c, units) for c in chain_list]) + "\n"


def _kernel_ptx(chain: Chain, units: int) -> str:
    body = []
    for u in range(units):
        c = "%k" + str(K["iadd_a"] if u % 2 == 0 else K["iadd_b"])
        for step in chain.steps:
            body.append("  " + re.sub(r"<(\w+)>", lambda m: c if m.group(1) == "c" else str(K[m.group(1)]), step))
    ks_loads = "\n".join(f"  ld.global.b32 %k{k}, [%a1+{4 * k}];" for k in range(len(K)))
    return f""".visible .entry {chain.kernel}(.param .u64 p_out, .param .u64 p_xs, .param .u64 p_ks)
{{
  .reg .b32 %v, %w, %d<4>, %k<{len(K)}>, %r<6>;
  .reg .b64 %a<6>, %t<3>, %q<3>;
  .reg .pred %p<2>, %lane_odd, %again;
  ld.param.u64 %a0, [p_xs];
  cvta.to.global.u64 %a0, %a0;
  ld.param.u64 %a1, [p_ks];
  cvta.to.global.u64 %a1, %a1;
  ld.param.u64 %a2, [p_out];
  cvta.to.global.u64 %a2, %a2;
  mov.u32 %r0, %tid.x;
  mov.u32 %r1, %ctaid.x;
  mov.u32 %r2, %ntid.x;
  mad.lo.u32 %r3, %r1, %r2, %r0;
  mul.wide.u32 %a3, %r3, 32;
  add.u64 %a4, %a0, %a3;
  add.u64 %a5, %a2, %a3;
  ld.global.v4.b32 {{%v, %w, %d0, %d1}}, [%a4];
  ld.global.v2.b32 {{%d2, %d3}}, [%a4+16];
{ks_loads}
  mov.b64 %q0, {{%v, %w}};
  mov.b64 %q1, {{%k{K["d_mul_lo"]}, %k{K["d_mul_hi"]}}};
  mov.b64 %q2, {{%k{K["d_add_lo"]}, %k{K["d_add_hi"]}}};
  and.b32 %r4, %r0, 1;
  setp.ne.u32 %lane_odd, %r4, 0;
  mov.u32 %r5, 0;
LOOP:
  .pragma "nounroll";
  mov.u64 %t0, %clock64;
{chr(10).join(body)}
  mov.u64 %t1, %clock64;
  add.u32 %r5, %r5, 1;
  setp.lt.u32 %again, %r5, %k{K["iterations"]};
  @%again bra LOOP;
  sub.u64 %t2, %t1, %t0;
  mov.b64 {{%r0, %r1}}, %q0;
  xor.b32 %v, %v, %r0;
  xor.b32 %w, %w, %r1;
  st.global.v4.b32 [%a5], {{%v, %w, %d0, %d1}};
  st.global.v2.b32 [%a5+16], {{%d2, %d3}};
  st.global.u64 [%a5+24], %t2;
  ret;
}}
"""


# ---------------------------------------------------------------- compile and analyse (CPU)

def compile_ptx(source: str, workdir: Path) -> bytes:
    """ptxas (through nvcc) for sm_90a."""
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    src, out = workdir / "chains.ptx", workdir / "chains.cubin"
    src.write_text(source)
    run = subprocess.run([nvcc, "-cubin", "-arch=sm_90a", str(src), "-o", str(out)], capture_output=True, text=True)
    if run.returncode != 0:
        raise SipError(f"nvcc failed on the generated chains: {run.stderr.strip()[:2000]}")
    return out.read_bytes()


@dataclasses.dataclass
class Pair:
    """One (producer class, consumer class, file) of a chain and where it occurs."""
    producer: str
    consumer: str
    file: str
    sites: list[tuple[int, list[int]]]  # (producer index, NOPs between it and its consumer)
    ptxas_stall: int  # the distance ptxas gave it (the largest over its sites)

    @property
    def key(self) -> str:
        return f"{self.producer}>{self.consumer}:{self.file}"


@dataclasses.dataclass
class Analysis:
    chain: Chain
    kernel: str
    timed: list[int]  # instruction indices from the first clock read up to the second
    links: int  # dependent links in the timed chain
    pairs: list[Pair]
    problems: list[str]  # why some links are not measured


def analyse(cubin: bytes, chain_list: list[Chain]) -> list[Analysis]:
    kernels = disassemble(parse_cubin(cubin))
    return [analyse_kernel(kernels[c.kernel].instructions, c) for c in chain_list]


def analyse_kernel(ins: tuple[Instruction, ...], chain: Chain) -> Analysis:
    """Find the timed chain between the two clock reads of the loop body and its pairs."""
    clocks = [i.index for i in ins if i.base == "CS2R" and any("SR_CLOCK" in op for op in i.operands)]
    problems: list[str] = []
    if len(clocks) != 2:
        return Analysis(chain, chain.kernel, [], 0, [], [f"expected 2 clock reads, found {len(clocks)}"])
    first, second = clocks
    timed = list(range(first, second))
    body = [x for x in range(first + 1, second) if ins[x].base != "NOP"]
    pairs: dict[tuple[str, str, str], Pair] = {}
    links = 0
    for p, c in zip(body, body[1:]):
        shared = ins[p].writes & ins[c].reads
        if not shared:
            problems.append(f"#{c} {ins[c].opcode} does not read #{p} {ins[p].opcode}")
            continue
        links += 1
        between = list(range(p + 1, c))
        guard = regs_in(ins[c].predicate) if ins[c].predicate else frozenset()
        reg = min(shared)
        key = (opclass(ins[p]), opclass(ins[c]), register_file(reg, reg in guard))
        ctl = ins[p].control
        if ctl.write_sb != 7 or ctl.read_sb != 7:
            problems.append(f"{key[0]} sets a scoreboard: variable latency, interlocked by the hardware")
            continue
        if key[0] in chain.identity:
            problems.append(f"{key[0]} is an identity in this chain: a stale read of it would go unseen")
            continue
        distance = sum(ins[x].control.stall for x in [p, *between])
        pair = pairs.setdefault(key, Pair(*key, [], 0))
        pair.sites.append((p, between))
        pair.ptxas_stall = max(pair.ptxas_stall, distance)
    return Analysis(chain, chain.kernel, timed, links, list(pairs.values()), sorted(set(problems)))


def variant(cubin: bytes, analysis: Analysis, pair: Pair, k: int) -> bytes | None:
    """The cubin with every site of `pair` at distance k: the producer's stall plus those of the
    NOPs between it and its consumer add up to k, the producer taking as much as it can encode
    (None: k cannot be encoded there)."""
    parsed = parse_cubin(cubin)
    text = bytearray(parsed.text(analysis.kernel))
    for p, between in pair.sites:
        words = [int.from_bytes(text[x * INSTRUCTION_BYTES:(x + 1) * INSTRUCTION_BYTES], "little")
                 for x in (p, *between)]
        limits = [MAX_STALL[control_bits(w) >> 4 & 1] for w in words]
        if not len(words) <= k <= sum(limits):
            return None
        left = k - len(words)  # each slot keeps at least 1
        for x, word, limit in zip((p, *between), words, limits):
            stall = 1 + min(left, limit - 1)
            left -= stall - 1
            bits = control_bits(word) & ~_STALL | stall
            at = x * INSTRUCTION_BYTES
            text[at:at + INSTRUCTION_BYTES] = with_control(word, bits).to_bytes(INSTRUCTION_BYTES, "little")
    return parsed.with_text(analysis.kernel, bytes(text))


def expected_cycles(cubin: bytes, analysis: Analysis) -> int:
    """Stall cycles from the first clock read to the second: what the timed part takes with no
    extra cycles."""
    parsed = parse_cubin(cubin)
    text = parsed.text(analysis.kernel)
    return sum(control_bits(int.from_bytes(text[x * 16:(x + 1) * 16], "little")) & _STALL for x in analysis.timed)


def plan(cubin: bytes, analyses: list[Analysis]) -> dict[str, Any]:
    """What a GPU run would execute: per chain, its pairs, ptxas' distance and the candidate k."""
    out = {}
    for a in analyses:
        out[a.chain.name] = {
            "kernel": a.kernel, "links": a.links, "problems": a.problems,
            "pairs": {p.key: {"sites": len(p.sites), "ptxas_stall": p.ptxas_stall,
                              "candidates": [k for k in range(p.ptxas_stall, 0, -1)
                                             if variant(cubin, a, p, k) is not None]} for p in a.pairs}}
    return out


# ---------------------------------------------------------------- run (GPU)

class Gpu:
    """A CUDA context through the driver API (cuda-python): load a cubin, launch, read back."""

    def __init__(self):
        from cuda.bindings import driver as cu
        self.cu = cu
        self._ok(cu.cuInit(0))
        self.device = self._ok(cu.cuDeviceGet(0))
        self.context = self._ok(cu.cuDevicePrimaryCtxRetain(self.device))
        self._ok(cu.cuCtxSetCurrent(self.context))
        self.stream = self._ok(cu.cuStreamCreate(0))
        self.name = self._ok(cu.cuDeviceGetName(128, self.device)).split(b"\0")[0].decode()
        major = self._ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                                 self.device))
        if major != 9:
            raise SipError(f"{self.name} is not an sm_90 GPU: the chains are built for sm_90a")

    def _ok(self, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise SipError(f"CUDA driver call failed: {err}")
        return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)

    def alloc(self, nbytes: int):
        return self._ok(self.cu.cuMemAlloc(nbytes))

    def upload(self, dev, data: bytes) -> None:
        buf = ctypes.create_string_buffer(data, len(data))
        self._ok(self.cu.cuMemcpyHtoD(dev, ctypes.addressof(buf), len(data)))

    def download(self, dev, nbytes: int) -> bytes:
        buf = ctypes.create_string_buffer(nbytes)
        self._ok(self.cu.cuMemcpyDtoH(ctypes.addressof(buf), dev, nbytes))
        return buf.raw

    def run(self, cubin: bytes, kernel: str, args: list, blocks: int) -> None:
        cu = self.cu
        image = ctypes.create_string_buffer(cubin, len(cubin))
        module = self._ok(cu.cuModuleLoadData(ctypes.addressof(image)))
        try:
            func = self._ok(cu.cuModuleGetFunction(module, kernel.encode()))
            holders = [ctypes.c_uint64(int(a)) for a in args]
            params = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
            self._ok(cu.cuLaunchKernel(func, blocks, 1, 1, WARP, 1, 1, 0, self.stream, ctypes.addressof(params), 0))
            self._ok(cu.cuStreamSynchronize(self.stream))
        finally:
            self._ok(cu.cuModuleUnload(module))


def inputs(kind: str, threads: int, seed: int) -> bytes:
    """8 u32 words per thread: the chain value(s) and the MMA accumulators, fresh per trial."""
    rng = random.Random(seed)
    words = []
    for _ in range(threads):
        if kind in ("float", "mma"):
            v, w = (struct.unpack("<I", struct.pack("<f", rng.uniform(0.5, 2.0)))[0] for _ in range(2))
        elif kind == "f64":
            v, w = struct.unpack("<II", struct.pack("<d", rng.uniform(0.5, 2.0)))
        else:
            v, w = rng.getrandbits(32), rng.getrandbits(32)
        acc = [struct.unpack("<I", struct.pack("<f", rng.uniform(-1, 1)))[0] for _ in range(4)]
        words += [v, w, *acc, 0, 0]
    return struct.pack(f"<{len(words)}I", *words)


def measure(gpu: Gpu, cubin: bytes, analyses: list[Analysis], trials: int, blocks: int, iterations: int,
            log=print) -> list[dict[str, Any]]:
    threads = blocks * WARP
    d_out, d_xs, d_ks = gpu.alloc(threads * 32), gpu.alloc(threads * 32), gpu.alloc(len(K) * 4)
    rows = []
    for a in analyses:
        ks = constants(a.chain.kind, iterations)
        gpu.upload(d_ks, struct.pack(f"<{len(ks)}I", *ks))
        seeds = [zlib.crc32(f"{a.chain.name}/{t}".encode()) for t in range(trials)]
        reference = []
        for s in seeds:
            gpu.upload(d_xs, inputs(a.chain.kind, threads, s))
            gpu.run(cubin, a.kernel, [d_out, d_xs, d_ks], blocks)
            reference.append(_values(gpu.download(d_out, threads * 32)))
        for pair in a.pairs:
            row = {"producer": pair.producer, "consumer": pair.consumer, "file": pair.file, "chain": a.chain.name,
                   "sites": len(pair.sites), "ptxas_stall": pair.ptxas_stall, "latency": None, "runs": {}}
            proven = None
            for k in range(pair.ptxas_stall, 0, -1):
                mutated = variant(cubin, a, pair, k)
                if mutated is None:
                    break
                budget = expected_cycles(mutated, a)
                ok, cycles = True, []
                for s, ref in zip(seeds, reference):
                    gpu.upload(d_xs, inputs(a.chain.kind, threads, s))
                    gpu.run(mutated, a.kernel, [d_out, d_xs, d_ks], blocks)
                    raw = gpu.download(d_out, threads * 32)
                    ok &= _values(raw) == ref
                    cycles += _cycles(raw)
                margin = max(2, len(pair.sites) // 8)
                clean = max(cycles) <= budget + margin
                row["runs"][str(k)] = {"correct": ok, "expected_cycles": budget, "max_cycles": max(cycles),
                                       "min_cycles": min(cycles), "clean": clean}
                if not (ok and clean):
                    break
                proven = k
            row["latency"] = proven
            log(f"{pair.key:40s} ptxas {pair.ptxas_stall:2d}  proven {proven}  ({a.chain.name})")
            rows.append(row)
    return rows


def _values(raw: bytes) -> list[tuple[int, ...]]:
    n = len(raw) // 32
    return [struct.unpack_from("<6I", raw, 32 * t) for t in range(n)]


def _cycles(raw: bytes) -> list[int]:
    n = len(raw) // 32
    return [struct.unpack_from("<Q", raw, 32 * t + 24)[0] for t in range(n)]


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", type=Path, help="run on the GPU and write the latency table (JSON) here")
    what.add_argument("--build", type=Path, metavar="DIR", help="no GPU: write the PTX, the cubin and the plan here")
    ap.add_argument("--ops", help=f"only chains made of these ops (comma list of {', '.join(OPS)}, ISETP, HMMA, "
                    "DFMA, DADD, DMUL)")
    ap.add_argument("--units", type=int, default=16, help="A/B steps per timed chain (default 16)")
    ap.add_argument("--iterations", type=int, default=4, help="loop iterations; the first warms the caches")
    ap.add_argument("--trials", type=int, default=3, help="runs per distance, fresh inputs each")
    ap.add_argument("--blocks", type=int, default=8, help="blocks of one warp each")
    args = ap.parse_args(argv)
    if min(args.units, args.iterations, args.trials, args.blocks) < 1:
        ap.error("--units, --iterations, --trials and --blocks must be >= 1")
    selected = chains(args.ops.split(",") if args.ops else None)
    if not selected:
        ap.error(f"--ops {args.ops!r} selects no chain")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            source = ptx(selected, args.units)
            cubin = compile_ptx(source, Path(tmp))
        analyses = analyse(cubin, selected)
        if args.build:
            args.build.mkdir(parents=True, exist_ok=True)
            (args.build / "chains.ptx").write_text(source)
            (args.build / "chains.cubin").write_bytes(cubin)
            (args.build / "plan.json").write_text(json.dumps(plan(cubin, analyses), indent=1) + "\n")
            print(f"{len(selected)} chains, {sum(len(a.pairs) for a in analyses)} pairs -> {args.build}")
            return 0
        gpu = Gpu()
        rows = measure(gpu, cubin, analyses, args.trials, args.blocks, args.iterations)
    except SipError as e:
        print(f"sass_latency: {e}", file=sys.stderr)
        return 1
    doc = {"format": FORMAT, "device": gpu.name, "arch": "sm_90a",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "method": "tools/sass_latency.py", "units": args.units,
           "iterations": args.iterations, "trials": args.trials, "blocks": args.blocks,
           "not_measured": {a.chain.name: a.problems for a in analyses if a.problems},
           "pairs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1) + "\n"
    if args.out.suffix == ".gz":
        args.out.write_bytes(gzip.compress(text.encode()))
    else:
        args.out.write_text(text)
    proven = sum(r["latency"] is not None for r in rows)
    print(f"{proven} of {len(rows)} pairs proven -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
