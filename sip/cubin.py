"""Read a Hopper cubin (ELF64, ET_EXEC, EM_CUDA) and patch its kernels' `.text` in place.

What SIP needs from the container, besides the code bytes:

* arch: sm_90 / sm_90a only. The SM number lives in e_flags (bits 0-7 in the old ELF ABI
  (EI_ABIVERSION < 8, what CuTeDSL emits), bits 8-15 in the new one); the `a` suffix is e_flags
  bit 0x800 in the old ABI and `.nv.compat` attribute 9 = 1 in the new one.
* Which instruction offsets other parts of the file refer to. SIP PINS those instructions (they
  keep their address, word and control bits; sip.deps lets independent instructions pass them)
  instead of rewriting the references: that is simple and safe by construction. The references are
    - `.nv.info` attributes (format: u8 format, u8 attribute id, then a u16 value, or a u16 size
      and that many payload bytes). Attributes known to hold no code offsets (register counts,
      parameter layout, ...) are skipped; in every other attribute - the *_INSTR_OFFSETS lists,
      SW_WAR lists, mbarrier records, indirect-branch tables, and any attribute id this module
      does not know - every 16-byte-aligned value inside the kernel's code pins the instruction
      there (over-pinning is harmless, under-pinning is not);
    - relocations that patch an instruction (`.rel[a].text.<kernel>`);
    - relocations (anywhere) whose symbol is in the kernel's code - call targets, jump
      tables, `.debug_frame` FDEs - and function symbols inside the code: those are entry
      points, so they also become basic-block leaders;
    - the `.debug_frame` CFA programs: the instructions where the frame rule changes (an advance
      that no rule change follows changes nothing and pins nothing).
* Writing back: `Cubin.with_text` splices same-length code into a copy of the original bytes, so
  an unmodified cubin is written back byte for byte and nothing else in the file ever changes.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Iterator, Mapping

from sip import SipError
from sip.fatbin import FatbinError, is_fatbin, replace_cubin
from sip.fatbin import cubins as fatbin_cubins

INSTRUCTION_BYTES = 16

EM_CUDA = 190
ET_REL, ET_EXEC = 1, 2
SHT_SYMTAB, SHT_RELA, SHT_NOBITS, SHT_REL = 2, 4, 8, 9
SHT_CUDA_INFO = 0x70000000
SHT_CUDA_COMPAT = 0x70000086
STT_FUNC = 2
STO_CUDA_ENTRY = 0x10
SUPPORTED_ARCHS = ("sm_90", "sm_90a")

# EIATTR ids, as named by nvdisasm 13.x (the SW*_WAR ones it prints as EIATTR_UNKNOWN).
EIATTR_NAMES = {
    0x01: "PAD", 0x02: "IMAGE_SLOT", 0x03: "JUMPTABLE_RELOCS", 0x04: "CTAIDZ_USED",
    0x05: "MAX_THREADS", 0x06: "IMAGE_OFFSET", 0x07: "IMAGE_SIZE", 0x08: "TEXTURE_NORMALIZED",
    0x09: "SAMPLER_INIT", 0x0A: "PARAM_CBANK", 0x0B: "SMEM_PARAM_OFFSETS",
    0x0C: "CBANK_PARAM_OFFSETS", 0x0D: "SYNC_STACK", 0x0E: "TEXID_SAMPID_MAP", 0x0F: "EXTERNS",
    0x10: "REQNTID", 0x11: "FRAME_SIZE", 0x12: "MIN_STACK_SIZE",
    0x13: "SAMPLER_FORCE_UNNORMALIZED", 0x14: "BINDLESS_IMAGE_OFFSETS",
    0x15: "BINDLESS_TEXTURE_BANK", 0x16: "BINDLESS_SURFACE_BANK", 0x17: "KPARAM_INFO",
    0x18: "SMEM_PARAM_SIZE", 0x19: "CBANK_PARAM_SIZE", 0x1A: "QUERY_NUMATTRIB",
    0x1B: "MAXREG_COUNT", 0x1C: "EXIT_INSTR_OFFSETS", 0x1D: "S2RCTAID_INSTR_OFFSETS",
    0x1E: "CRS_STACK_SIZE", 0x1F: "NEED_CNP_WRAPPER", 0x20: "NEED_CNP_PATCH",
    0x21: "EXPLICIT_CACHING", 0x22: "ISTYPEP_USED", 0x23: "MAX_STACK_SIZE", 0x24: "SUQ_USED",
    0x25: "LD_CACHEMOD_INSTR_OFFSETS", 0x26: "LOAD_CACHE_REQUEST", 0x27: "ATOM_SYS_INSTR_OFFSETS",
    0x28: "COOP_GROUP_INSTR_OFFSETS", 0x29: "COOP_GROUP_MASK_REGIDS", 0x2A: "SW1850030_WAR",
    0x2B: "WMMA_USED", 0x2C: "HAS_PRE_V10_OBJECT", 0x2D: "ATOMF16_EMUL_INSTR_OFFSETS",
    0x2E: "ATOM16_EMUL_INSTR_REG_MAP", 0x2F: "REGCOUNT", 0x30: "SW2393858_WAR",
    0x31: "INT_WARP_WIDE_INSTR_OFFSETS", 0x32: "SHARED_SCRATCH", 0x33: "STATISTICS",
    0x34: "INDIRECT_BRANCH_TARGETS", 0x35: "SW2861232_WAR", 0x36: "SW_WAR",
    0x37: "CUDA_API_VERSION", 0x38: "NUM_MBARRIERS", 0x39: "MBARRIER_INSTR_OFFSETS",
    0x3A: "COROUTINE_RESUME_ID_OFFSETS", 0x3B: "SAM_REGION_STACK_SIZE",
    0x3C: "PER_REG_TARGET_PERF_STATS", 0x3D: "CTA_PER_CLUSTER", 0x3E: "EXPLICIT_CLUSTER",
    0x3F: "MAX_CLUSTER_RANK", 0x40: "INSTR_REG_MAP", 0x41: "RESERVED_SMEM_USED",
    0x42: "RESERVED_SMEM_0_SIZE", 0x43: "UCODE_SECTION_DATA", 0x44: "UNUSED_LOAD_BYTE_OFFSET",
    0x45: "KPARAM_INFO_V2", 0x46: "SYSCALL_OFFSETS", 0x47: "SW_WAR_MEMBAR_SYS_INSTR_OFFSETS",
    0x48: "GRAPHICS_GLOBAL_CBANK", 0x49: "SHADER_TYPE", 0x4A: "VRC_CTA_INIT_COUNT",
    0x4B: "TOOLS_PATCH_FUNC", 0x4C: "NUM_BARRIERS", 0x4D: "TEXMODE_INDEPENDENT",
    0x4E: "PERF_STATISTICS", 0x4F: "AT_ENTRY_FRAGMENTS", 0x50: "SPARSE_MMA_MASK",
    0x51: "TCGEN05_1CTA_USED", 0x52: "TCGEN05_2CTA_USED", 0x53: "GEN_ERRBAR_AT_EXIT",
    0x54: "REG_RECONFIG", 0x55: "ANNOTATIONS", 0x57: "STACK_CANARY_TRAP_OFFSETS",
    0x58: "STUB_FUNCTION_KIND", 0x59: "LOCAL_CTA_ASYNC_STORE_OFFSETS",
    0x5B: "BLOCKS_ARE_CLUSTERS", 0x5C: "SANITIZE", 0x5D: "SYSCALLS_FALLBACK", 0x5E: "CUDA_REQ",
    0x61: "RTCORE_ENTRY", 0x62: "CLUSTER_LAUNCH_CONTROL_USED", 0x64: "MIN_PER_CTA_MEMORY_SIZE",
    0x65: "IGNOREOOB_CP_ASYNC_BULK_INSTR_OFFSETS", 0x66: "LANGUAGE", 0x68: "GRID_ATTRIBUTES",
    0x69: "STACK_OFFSET", 0x6A: "RT_LIVESTATE_SASS_MAP", 0x6C: "INSTR_OFFSETS",
    0x6D: "PREEXIT_USED",
}

# Attributes whose payload is known to be sizes, counts, flags or parameter layout - never code
# offsets. Every other attribute (including ids not in EIATTR_NAMES) is scanned for offsets.
NO_CODE_OFFSETS = frozenset({
    0x01, 0x02, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x0E, 0x0F, 0x10,
    0x11, 0x12, 0x13, 0x15, 0x16, 0x17, 0x18, 0x19, 0x1A, 0x1B, 0x1E, 0x1F, 0x20, 0x21, 0x22,
    0x23, 0x24, 0x26, 0x29, 0x2B, 0x2C, 0x2F, 0x32, 0x37, 0x38, 0x3B, 0x3D, 0x3E, 0x3F, 0x41,
    0x42, 0x45, 0x4C, 0x4D, 0x50, 0x51, 0x52, 0x53, 0x5B, 0x5E, 0x62, 0x64, 0x66, 0x68, 0x6D,
})
# Offsets in these attributes are places control may enter, not just annotated instructions.
ENTRY_POINT_ATTRS = frozenset({0x34})
# Attributes that annotate the instruction at an offset for tools and the driver (exits, CTA-id
# reads, cache-modifier loads, cooperative-group and warp-wide operations, mbarrier records,
# register reconfiguration) without standing for code that could be swapped in there. Any other
# attribute (software workarounds, syscalls, emulated atomics, tool patch points, ids this module
# does not know) may mark a place where the driver or a tool patches in different code, so its
# instructions are fences too (sip.deps).
ANNOTATION_ATTRS = frozenset({0x1C, 0x1D, 0x25, 0x28, 0x31, 0x39, 0x54})

_EIFMT_SVAL = 4  # u16 size + payload; formats 1-3 carry at most a u16 inline value


@dataclass(frozen=True)
class Section:
    index: int
    name: str
    type: int
    flags: int
    offset: int
    size: int
    link: int
    info: int


@dataclass(frozen=True)
class Symbol:
    index: int
    name: str
    value: int
    size: int
    type: int
    other: int
    shndx: int


@dataclass(frozen=True)
class Relocation:
    section: int  # index of the .rel/.rela section holding it
    target: int  # index of the section it patches (sh_info of the .rel section)
    offset: int
    symbol: int
    type: int
    addend: int


@dataclass(frozen=True)
class NvInfoAttribute:
    section: int
    offset: int  # of the attribute header inside the section
    fmt: int
    attr: int
    value: int | None  # formats 1-3
    payload: bytes  # format 4

    @property
    def name(self) -> str:
        return "EIATTR_" + EIATTR_NAMES.get(self.attr, f"UNKNOWN_{self.attr:#04x}")

    def words(self) -> list[int]:
        """The payload as little-endian u32 words (offset lists are stored that way)."""
        n = len(self.payload) // 4
        return list(struct.unpack_from(f"<{n}I", self.payload))

    def candidate_values(self) -> list[int]:
        return self.words() if self.fmt == _EIFMT_SVAL else [self.value or 0]


@dataclass(frozen=True)
class KernelText:
    """One `.text.<name>` section and every reference into it found elsewhere in the cubin."""
    name: str
    section: Section
    entry: bool  # a __global__ kernel (STO_CUDA_ENTRY), not a device function
    pins: Mapping[int, str]  # instruction offset -> why it must not move
    entries: frozenset[int]  # offsets control can enter from outside the section's own branches
    fenced: frozenset[int] = frozenset()  # pinned offsets that may be patch points: nothing crosses them

    @property
    def instruction_count(self) -> int:
        return self.section.size // INSTRUCTION_BYTES


@dataclass
class Cubin:
    data: bytes
    sections: list[Section]
    symbols: list[Symbol]
    relocations: list[Relocation]
    nvinfo: list[NvInfoAttribute]
    arch: str
    _kernels: dict[str, KernelText] = field(default_factory=dict, repr=False)

    @property
    def kernel_names(self) -> list[str]:
        return list(self._kernels)

    def kernels(self) -> list[KernelText]:
        return list(self._kernels.values())

    def main_kernel(self) -> KernelText:
        """The kernel a tuner works on: the largest entry (CuTeDSL cubins hold one), else the largest
        function; SipError when there is no code."""
        candidates = [k for k in self.kernels() if k.entry] or self.kernels()
        if not candidates:
            raise SipError("the cubin holds no kernel code")
        return max(candidates, key=lambda k: k.instruction_count)

    def kernel(self, name: str) -> KernelText:
        try:
            return self._kernels[name]
        except KeyError:
            raise SipError(f"kernel {name!r} not found; this cubin has: "
                           + ", ".join(self._kernels)) from None

    def text(self, name: str) -> bytes:
        sec = self.kernel(name).section
        return self.data[sec.offset:sec.offset + sec.size]

    def with_text(self, name: str, text: bytes) -> bytes:
        """The cubin's bytes with kernel `name`'s code replaced by `text` (same length)."""
        sec = self.kernel(name).section
        if len(text) != sec.size:
            raise SipError(f"new code for {name} has {len(text)} bytes, the section {sec.size}")
        return self.data[:sec.offset] + text + self.data[sec.offset + sec.size:]

    def to_bytes(self) -> bytes:
        return self.data


def load_cubin(source: bytes | str | Path) -> Cubin:
    """Parse a cubin from bytes or a file path; raises SipError for anything SIP cannot handle."""
    data = Path(source).read_bytes() if isinstance(source, (str, Path)) else bytes(source)
    return parse_cubin(data)


def parse_cubin(data: bytes) -> Cubin:
    _check_header(data)
    sections = _sections(data)
    symbols = _symbols(data, sections)
    relocations = _relocations(data, sections)
    nvinfo = [a for s in sections if s.type == SHT_CUDA_INFO for a in _attributes(data, s)]
    cubin = Cubin(data, sections, symbols, relocations, nvinfo, _arch(data, sections))
    if cubin.arch not in SUPPORTED_ARCHS:
        raise SipError(f"unsupported architecture {cubin.arch}: SIP handles "
                       f"{' and '.join(SUPPORTED_ARCHS)} cubins only (compile with -arch=sm_90a)")
    for kt in _kernel_texts(cubin):
        cubin._kernels[kt.name] = kt
    return cubin


def cubins_in_fatbin(fatbin: bytes) -> list[tuple[int, bytes]]:
    """(offset, cubin bytes) of each uncompressed ELF entry of a fatbin container."""
    try:
        return fatbin_cubins(fatbin)
    except FatbinError as e:
        raise SipError(str(e)) from None


def replace_in_fatbin(fatbin: bytes, old: bytes, new: bytes) -> bytes:
    """The fatbin with cubin `old` replaced by same-size `new`; no header changes are needed."""
    try:
        return replace_cubin(fatbin, old, new)
    except FatbinError as e:
        raise SipError(str(e)) from None


# ---------------------------------------------------------------- ELF structure

def _check_header(data: bytes) -> None:
    if data[:4] != b"\x7fELF":
        hint = " (it is a fatbin: extract its cubins with sip.cubin.cubins_in_fatbin)" \
            if is_fatbin(data) else ""
        raise SipError(f"not an ELF file{hint}: expected a cubin (nvcc -cubin / CuTeDSL)")
    if data[4] != 2 or data[5] != 1:
        raise SipError("not a 64-bit little-endian ELF: not a CUDA cubin")
    e_type, e_machine = struct.unpack_from("<HH", data, 0x10)
    if e_machine != EM_CUDA:
        raise SipError(f"ELF machine {e_machine} is not EM_CUDA ({EM_CUDA}): not a cubin")
    if e_type != ET_EXEC:
        kind = "a relocatable object (ET_REL): link it first (nvcc -cubin without -rdc)" \
            if e_type == ET_REL else f"ELF type {e_type}"
        raise SipError(f"SIP reads executable cubins (ET_EXEC); this is {kind}")


def _sections(data: bytes) -> list[Section]:
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff + shentsize * shnum > len(data):
        raise SipError("truncated cubin: section headers run past the end of the file")
    raw = [struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = raw[shstrndx][4]
    out = []
    for i, (name, typ, flags, _addr, off, size, link, info) in enumerate(raw):
        if typ != SHT_NOBITS and off + size > len(data):
            raise SipError(f"truncated cubin: section {i} runs past the end of the file")
        out.append(Section(i, _cstr(data, names_at + name), typ, flags, off, size, link, info))
    return out


def _symbols(data: bytes, sections: list[Section]) -> list[Symbol]:
    tabs = [s for s in sections if s.type == SHT_SYMTAB]
    if not tabs:
        return []
    tab = tabs[0]
    strings = sections[tab.link].offset
    out = []
    for i in range(tab.size // 24):
        name, info, other, shndx, value, size = struct.unpack_from("<IBBHQQ", data, tab.offset + 24 * i)
        out.append(Symbol(i, _cstr(data, strings + name), value, size, info & 0xF, other, shndx))
    return out


def _relocations(data: bytes, sections: list[Section]) -> list[Relocation]:
    out = []
    for s in sections:
        if s.type not in (SHT_REL, SHT_RELA):
            continue
        size = 24 if s.type == SHT_RELA else 16
        for k in range(s.size // size):
            off, info = struct.unpack_from("<QQ", data, s.offset + k * size)
            addend = struct.unpack_from("<q", data, s.offset + k * size + 16)[0] \
                if s.type == SHT_RELA else 0
            out.append(Relocation(s.index, s.info, off, info >> 32, info & 0xFFFFFFFF, addend))
    return out


def _attributes(data: bytes, sec: Section) -> Iterator[NvInfoAttribute]:
    pos, end = sec.offset, sec.offset + sec.size
    while pos + 4 <= end:
        fmt, attr = data[pos], data[pos + 1]
        if fmt == _EIFMT_SVAL:
            size, = struct.unpack_from("<H", data, pos + 2)
            if pos + 4 + size > end:
                raise SipError(f"corrupt {sec.name}: attribute {attr:#x} runs past the section")
            yield NvInfoAttribute(sec.index, pos - sec.offset, fmt, attr, None,
                                  bytes(data[pos + 4:pos + 4 + size]))
            pos += 4 + (size + 3) // 4 * 4
        elif fmt in (1, 2, 3):
            value = {1: None, 2: data[pos + 2], 3: struct.unpack_from("<H", data, pos + 2)[0]}[fmt]
            yield NvInfoAttribute(sec.index, pos - sec.offset, fmt, attr, value, b"")
            pos += 4
        else:
            raise SipError(f"corrupt {sec.name}: unknown attribute format {fmt} at {pos - sec.offset}")


def _arch(data: bytes, sections: list[Section]) -> str:
    e_flags, = struct.unpack_from("<I", data, 0x30)
    if data[8] >= 8:  # EI_ABIVERSION: the new CUDA ELF ABI moved the SM number up one byte
        sm = (e_flags >> 8) & 0xFF
        specific = any(a.attr == 9 and a.value == 1
                       for s in sections if s.type == SHT_CUDA_COMPAT for a in _attributes(data, s))
    else:
        sm = e_flags & 0xFF
        specific = bool(e_flags & 0x800)
    return f"sm_{sm}{'a' if specific else ''}"


def _cstr(data: bytes, at: int) -> str:
    return data[at:data.index(b"\0", at)].decode("utf-8", "replace")


# ---------------------------------------------------------------- references into code

def _kernel_texts(cubin: Cubin) -> Iterator[KernelText]:
    entries_by_name = {s.name: bool(s.other & STO_CUDA_ENTRY) for s in cubin.symbols
                       if s.type == STT_FUNC}
    for sec in cubin.sections:
        if not sec.name.startswith(".text."):
            continue
        pins: dict[int, str] = {}
        entries: set[int] = {0}
        fenced: set[int] = set()
        _pin_nvinfo(cubin, sec, pins, entries, fenced)
        _pin_relocations(cubin, sec, pins, entries)
        _pin_debug_frame(cubin, sec, pins)
        for sym in cubin.symbols:
            if sym.shndx == sec.index and sym.type == STT_FUNC and 0 < sym.value < sec.size:
                entries.add(sym.value)
        name = sec.name[len(".text."):]
        yield KernelText(name, sec, entries_by_name.get(name, False), MappingProxyType(pins),
                         frozenset(entries), frozenset(fenced))


def _code_offset(value: int, sec: Section) -> bool:
    return value % INSTRUCTION_BYTES == 0 and 0 <= value < sec.size


def _pin_nvinfo(cubin: Cubin, sec: Section, pins: dict[int, str], entries: set[int], fenced: set[int]) -> None:
    for attr in cubin.nvinfo:
        info_sec = cubin.sections[attr.section]
        applies = info_sec.info == sec.index or info_sec.info == 0  # per-kernel or global .nv.info
        if not applies or attr.attr in NO_CODE_OFFSETS:
            continue
        for value in attr.candidate_values():
            if _code_offset(value, sec):
                pins.setdefault(value, f"offset listed in {attr.name}")
                if attr.attr not in ANNOTATION_ATTRS:
                    fenced.add(value)
                if attr.attr in ENTRY_POINT_ATTRS or attr.attr not in EIATTR_NAMES:
                    entries.add(value)


def _pin_relocations(cubin: Cubin, sec: Section, pins: dict[int, str], entries: set[int]) -> None:
    for rel in cubin.relocations:
        if rel.target == sec.index:  # the loader patches this instruction's bits
            at = rel.offset - rel.offset % INSTRUCTION_BYTES
            pins.setdefault(at, f"patched by relocation type {rel.type}")
        sym = cubin.symbols[rel.symbol] if rel.symbol < len(cubin.symbols) else None
        if sym is not None and sym.shndx == sec.index:  # a code address someone takes
            where = sym.value + rel.addend
            if _code_offset(where, sec):
                entries.add(where)
                pins.setdefault(where, f"address taken by {cubin.sections[rel.section].name}")


def _pin_debug_frame(cubin: Cubin, sec: Section, pins: dict[int, str]) -> None:
    """Pin the instructions around each place a `.debug_frame` FDE changes the frame rule."""
    frames = [s for s in cubin.sections if s.name == ".debug_frame"]
    if not frames:
        return
    frame = frames[0]
    relocs = {r.offset: r for r in cubin.relocations if r.target == frame.index}
    body = cubin.data[frame.offset:frame.offset + frame.size]
    for fde in _fdes(body):
        rel = relocs.get(fde.location_field)
        if rel is None or cubin.symbols[rel.symbol].shndx != sec.index:
            continue
        start = cubin.symbols[rel.symbol].value + rel.addend
        try:
            locations = list(_cfa_locations(fde.program, fde.code_align))
        except ValueError:
            # A CFA program we cannot decode: pin the whole range it describes.
            locations = range(0, fde.length, INSTRUCTION_BYTES)
        for loc in locations:
            for at in (start + loc - INSTRUCTION_BYTES, start + loc):
                if _code_offset(at, sec):
                    pins.setdefault(at, "frame-rule change in .debug_frame")


@dataclass(frozen=True)
class _Fde:
    location_field: int  # offset, inside .debug_frame, of the FDE's initial_location
    length: int  # address_range
    code_align: int
    program: bytes


def _fdes(body: bytes) -> Iterator[_Fde]:
    """FDEs of a DWARF (32- or 64-bit format) .debug_frame, with their CIE's code alignment."""
    cies: dict[int, int] = {}
    pos = 0
    while pos + 4 <= len(body):
        start = pos
        length, = struct.unpack_from("<I", body, pos)
        if length == 0xFFFFFFFF:
            length, = struct.unpack_from("<Q", body, pos + 4)
            header, word, id_mask = 12, "<Q", 0xFFFFFFFFFFFFFFFF
        else:
            header, word, id_mask = 4, "<I", 0xFFFFFFFF
        end = start + header + length
        idsize = struct.calcsize(word)
        cie_id, = struct.unpack_from(word, body, start + header)
        p = start + header + idsize
        if cie_id == id_mask:  # a CIE: version, augmentation, code alignment, ...
            p += 1
            p = body.index(b"\0", p) + 1
            code_align, p = _uleb(body, p)
            cies[start] = code_align
        else:
            location_field = p
            _, length_range = struct.unpack_from("<QQ" if idsize == 8 else "<II", body, p)
            program = body[p + 2 * idsize:end]
            yield _Fde(location_field, length_range, cies.get(cie_id, 1), program)
        pos = end


def _cfa_locations(program: bytes, code_align: int) -> Iterator[int]:
    """Code offsets (from the FDE start) where a DW_CFA program changes a rule. An advance that
    only more advances or DW_CFA_nop padding follow changes nothing, and yields nothing."""
    loc, p = 0, 0
    pending = None  # the location of the last advance, until a rule-changing op follows it
    while p < len(program):
        op = program[p]
        p += 1
        hi, lo = op & 0xC0, op & 0x3F
        if hi == 0x40:  # DW_CFA_advance_loc
            loc += lo * code_align
            pending = loc
            continue
        if op in (0x02, 0x03, 0x04):  # DW_CFA_advance_loc1/2/4
            n = {0x02: 1, 0x03: 2, 0x04: 4}[op]
            loc += int.from_bytes(program[p:p + n], "little") * code_align
            p += n
            pending = loc
            continue
        if op == 0x00:  # DW_CFA_nop
            continue
        if op == 0x01:  # DW_CFA_set_loc: an absolute address we cannot relate; give up
            raise ValueError("DW_CFA_set_loc")
        if pending is not None:
            yield pending
            pending = None
        if hi == 0x80:  # DW_CFA_offset reg, ULEB
            _, p = _uleb(program, p)
        elif hi == 0xC0:  # DW_CFA_restore reg
            pass
        elif op in (0x0A, 0x0B):  # remember_state, restore_state
            pass
        elif op in (0x06, 0x07, 0x08, 0x0D, 0x0E, 0x13, 0x2E):  # one ULEB/SLEB operand
            _, p = _uleb(program, p)
        elif op in (0x05, 0x09, 0x0C, 0x11, 0x12, 0x14, 0x15):  # two operands
            _, p = _uleb(program, p)
            _, p = _uleb(program, p)
        elif op == 0x0F:  # DW_CFA_def_cfa_expression: block
            n, p = _uleb(program, p)
            p += n
        elif op in (0x10, 0x16):  # DW_CFA_expression / val_expression: reg, block
            _, p = _uleb(program, p)
            n, p = _uleb(program, p)
            p += n
        else:
            raise ValueError(f"DW_CFA opcode {op:#x}")


def _uleb(data: bytes, p: int) -> tuple[int, int]:
    """LEB128 value and the position after it (SLEB operands only need skipping here)."""
    value = shift = 0
    while True:
        b = data[p]
        p += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, p
