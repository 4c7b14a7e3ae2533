"""Decode a kernel's SASS: nvdisasm for the text, the raw 128-bit words for the control codes.

`Instruction` is the one model of an instruction: its word, mnemonic, operands, decoded control
code, and the registers it reads and writes (expanded to single 32-bit registers / predicates, so
vectors, `.64` addresses, `.WIDE` pairs, FP64 pairs and MMA fragments are all spelled out). The
register model is conservative: an opcode (or a width modifier) missing from the operand table
below leaves `unknown` set, and the dependency model then pins the instruction. Where a family's
exact widths vary by variant, the table over-approximates (extra registers only add dependencies).

Basic blocks start at entry points (sip.cubin), branch / call / reconvergence targets and after
every control-flow instruction. A kernel with an indirect branch (BRX, JMX) whose targets the
cubin does not list (EIATTR_INDIRECT_BRANCH_TARGETS) gets one block per instruction: nothing
in it can move.

Control code of an sm_90 instruction (bits of the little-endian 128-bit word):
stall 105-108, yield 109 (0 = yield, printed `Y`), write scoreboard 110-112, read scoreboard
113-115 (7 = none), wait mask 116-121, reuse flags 122-125 (one per `.reuse` operand). Bits
126-127 belong to the instruction.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sip import SipError
from sip.cubin import INSTRUCTION_BYTES, Cubin, KernelText

CONTROL_SHIFT = 105
CONTROL_MASK = (1 << 21) - 1  # bits 105-125; 126-127 belong to the instruction
NO_SCOREBOARD = 7

# Register ids: every 32-bit register / predicate gets one small int.
R_BASE, UR_BASE, P_BASE, UP_BASE = 0, 256, 512, 520
_FILE_BASE = {"R": R_BASE, "UR": UR_BASE, "P": P_BASE, "UP": UP_BASE}
_FILE_SIZE = {"R": 255, "UR": 63, "P": 7, "UP": 7}  # RZ/URZ/PT/UPT are not registers


def reg_name(reg: int) -> str:
    for file in ("UP", "P", "UR", "R"):
        if reg >= _FILE_BASE[file]:
            return f"{file}{reg - _FILE_BASE[file]}"
    raise ValueError(reg)


def _file_of(reg: int) -> str:
    return reg_name(reg).rstrip("0123456789")


def format_regs(regs) -> str:
    """Registers as compact ranges, e.g. `R4..R7 UR4 P0`."""
    out, run = [], []
    for r in sorted(regs) + [None]:
        if run and r is not None and r == run[-1] + 1 and _file_of(r) == _file_of(run[0]):
            run.append(r)
            continue
        if run:
            out.append(reg_name(run[0]) + (f"..{reg_name(run[-1])}" if len(run) > 1 else ""))
        run = [r]
    return " ".join(out)


# ---------------------------------------------------------------- control codes

@dataclass(frozen=True)
class Control:
    stall: int
    yield_bit: int  # 0 means the warp scheduler may switch warps here (printed `Y`)
    write_sb: int  # 0-5, or NO_SCOREBOARD
    read_sb: int  # 0-5, or NO_SCOREBOARD
    wait: int  # 6-bit mask of scoreboards waited on before issue
    reuse: int  # 4 operand-reuse flags

    @classmethod
    def from_bits(cls, bits: int) -> Control:
        return cls(bits & 0xF, (bits >> 4) & 1, (bits >> 5) & 7, (bits >> 8) & 7,
                   (bits >> 11) & 0x3F, (bits >> 17) & 0xF)

    @classmethod
    def from_word(cls, word: int) -> Control:
        return cls.from_bits(word >> CONTROL_SHIFT)

    @property
    def bits(self) -> int:
        return (self.stall | self.yield_bit << 4 | self.write_sb << 5 | self.read_sb << 8
                | self.wait << 11 | self.reuse << 17)

    @property
    def sets(self) -> int:
        """Mask of the scoreboards this instruction sets (read or write)."""
        mask = 0
        for sb in (self.write_sb, self.read_sb):
            if sb != NO_SCOREBOARD:
                mask |= 1 << sb
        return mask

    def __str__(self) -> str:
        wait = "".join(str(b) if self.wait >> b & 1 else "-" for b in range(6))
        rd = "-" if self.read_sb == NO_SCOREBOARD else str(self.read_sb)
        wr = "-" if self.write_sb == NO_SCOREBOARD else str(self.write_sb)
        return f"[B{wait}:R{rd}:W{wr}:{'Y' if self.yield_bit == 0 else '-'}:S{self.stall:02d}]"


def control_bits(word: int) -> int:
    return (word >> CONTROL_SHIFT) & CONTROL_MASK


def with_control(word: int, bits: int) -> int:
    return (word & ~(CONTROL_MASK << CONTROL_SHIFT)) | (bits << CONTROL_SHIFT)


# ---------------------------------------------------------------- the instruction model

@dataclass(frozen=True)
class Instruction:
    index: int
    offset: int
    word: int
    opcode: str  # full mnemonic with modifiers, e.g. "LDG.E.128"
    predicate: str  # "" or e.g. "@!P0"
    operands: tuple[str, ...]
    reads: frozenset[int]  # register ids, see reg_name()
    writes: frozenset[int]
    control_flow: bool
    inter_warp: bool  # nvdisasm flags it as an inter-warp barrier
    targets: tuple[int, ...]  # static branch / call / reconvergence targets (byte offsets)
    unknown: str | None  # why the register model does not cover it, if it does not

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]

    @property
    def modifiers(self) -> tuple[str, ...]:
        return tuple(self.opcode.split(".")[1:])

    @property
    def control(self) -> Control:
        return Control.from_word(self.word)

    @property
    def text(self) -> str:
        pred = f"{self.predicate} " if self.predicate else ""
        ops = ", ".join(self.operands)
        return f"{pred}{self.opcode}{' ' + ops if ops else ''} ;"


@dataclass(frozen=True)
class Kernel:
    name: str
    arch: str
    code: KernelText
    instructions: tuple[Instruction, ...]
    blocks: tuple[range, ...]  # basic blocks, as index ranges in original order
    block_of: tuple[int, ...]  # instruction index -> block number
    cubin: Cubin = field(repr=False, compare=False)


# ---------------------------------------------------------------- nvdisasm

TOOLKIT_NVDISASM = "/usr/local/cuda/bin/nvdisasm"  # the toolkit's default place, off PATH on some hosts


def find_nvdisasm() -> str:
    """nvdisasm from PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, or the nvidia-cuda-nvdisasm wheel."""
    for candidate in _nvdisasm_candidates():
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise SipError("nvdisasm not found on PATH, in $CUDA_HOME/bin or in the nvidia-cuda-nvdisasm "
                   "wheel; install it with: pip install nvidia-cuda-nvdisasm")


def _nvdisasm_candidates() -> list[str]:
    found = [shutil.which("nvdisasm") or ""]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            found.append(os.path.join(os.environ[var], "bin", "nvdisasm"))
    found.append(TOOLKIT_NVDISASM)
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cu12", "cuda_nvdisasm"):
            found.append(os.path.join(root, sub, "bin", "nvdisasm"))
    return found


_JSON_CACHE: dict[str, list] = {}


def nvdisasm_functions(cubin: Cubin) -> dict[str, list[dict]]:
    """nvdisasm -json of the whole cubin: function name -> its instruction records."""
    key = hashlib.sha256(cubin.data).hexdigest()
    if key not in _JSON_CACHE:
        tool = find_nvdisasm()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "kernel.cubin"
            path.write_bytes(cubin.data)
            run = subprocess.run([tool, "-json", str(path)], capture_output=True, text=True)
        if run.returncode != 0:
            raise SipError(f"nvdisasm failed (exit {run.returncode}): {run.stderr.strip()[:500]}")
        try:
            doc = json.loads(run.stdout)
        except json.JSONDecodeError as e:
            raise SipError(f"nvdisasm printed JSON SIP cannot read: {e}") from None
        if len(_JSON_CACHE) > 32:
            _JSON_CACHE.pop(next(iter(_JSON_CACHE)))
        _JSON_CACHE[key] = doc[1]
    return {f["function-name"]: f["sass-instructions"] for f in _JSON_CACHE[key]}


def disassemble(cubin: Cubin) -> dict[str, Kernel]:
    """Every kernel (`.text.<name>` section) of the cubin, decoded."""
    functions = nvdisasm_functions(cubin)
    return {name: _kernel(cubin, name, functions) for name in cubin.kernel_names}


def disassemble_kernel(cubin: Cubin, name: str) -> Kernel:
    cubin.kernel(name)  # a clear error naming the kernels that exist
    return _kernel(cubin, name, nvdisasm_functions(cubin))


def _kernel_records(cubin: Cubin, code: KernelText, functions: dict[str, list[dict]]) -> list[dict] | None:
    """The records of every function in the kernel's section, in address order.

    nvdisasm 13.0 lists a kernel's internal subroutines (e.g. `$__internal_0_$__cuda_sm20_div_s64`)
    as functions of their own; 13.5 lists them inside the kernel. Joining the section's functions
    gives the same records either way; a gap or an overlap gives None."""
    offsets = {s.name: s.value for s in cubin.symbols if s.shndx == code.section.index}
    records: list[dict] = []
    for start, part in sorted((offsets[n], recs) for n, recs in functions.items() if n in offsets):
        if start != len(records) * INSTRUCTION_BYTES:
            return None
        records += part
    return records or None


def _kernel(cubin: Cubin, name: str, functions: dict[str, list[dict]]) -> Kernel:
    code = cubin.kernel(name)
    records = _kernel_records(cubin, code, functions)
    if records is None or len(records) != code.instruction_count:
        got = "nothing" if records is None else f"{len(records)} instructions"
        raise SipError(f"nvdisasm gave {got} for {name}, whose code holds "
                       f"{code.instruction_count}")
    text = cubin.text(name)
    symbols = {s.name: s.value for s in cubin.symbols if s.shndx == code.section.index}
    instructions = tuple(
        decode(i, i * INSTRUCTION_BYTES,
               int.from_bytes(text[i * INSTRUCTION_BYTES:(i + 1) * INSTRUCTION_BYTES], "little"),
               rec, symbols, code.section.size)
        for i, rec in enumerate(records))
    if any(i.base in INDIRECT_BRANCHES for i in instructions) and not any(
            a.attr == INDIRECT_BRANCH_TARGETS and cubin.sections[a.section].info == code.section.index
            for a in cubin.nvinfo):
        # Targets we cannot see could be anywhere: every instruction starts a block of its own.
        entries = frozenset(range(0, code.section.size, INSTRUCTION_BYTES))
    else:
        entries = code.entries
    blocks = basic_blocks(instructions, entries)
    block_of = [0] * len(instructions)
    for b, rng in enumerate(blocks):
        for i in rng:
            block_of[i] = b
    return Kernel(name, cubin.arch, code, instructions, blocks, tuple(block_of), cubin)


def decode(index: int, offset: int, word: int, record: dict, symbols: dict[str, int],
           code_size: int) -> Instruction:
    """One instruction from its word and its nvdisasm -json record."""
    opcode = record["opcode"]
    operands = tuple(o.strip() for o in record.get("operands", "").split(",") if o.strip())
    predicate = record.get("predicate", "")
    attrs = record.get("other-attributes") or {}
    control_flow = attrs.get("control-flow") == "True" or opcode.split(".")[0] in CONTROL_FLOW
    reads, writes, unknown = operand_semantics(opcode, operands)
    if predicate:
        reads |= regs_in(predicate)
    targets = _targets(opcode, operands, symbols, code_size) if control_flow else ()
    return Instruction(index, offset, word, opcode, predicate, operands, frozenset(reads),
                       frozenset(writes), control_flow, attrs.get("inter-warp-barrier") == "True",
                       targets, unknown)


INDIRECT_BRANCHES = frozenset({"BRX", "BRXU", "JMX", "JMXU"})
INDIRECT_BRANCH_TARGETS = 0x34  # the EIATTR that lists where they may go

# Opcodes that end a basic block even where nvdisasm does not flag them.
CONTROL_FLOW = frozenset({
    "BRA", "BRX", "BRXU", "JMP", "JMX", "JMXU", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "BREAK",
    "BPT", "KILL", "WARPSYNC", "BMOV", "RTT", "YIELD", "NANOSLEEP", "ELECT", "ACQBULK",
})


def _targets(opcode: str, operands: tuple[str, ...], symbols: dict[str, int],
             code_size: int) -> tuple[int, ...]:
    found = []
    for op in operands:
        op = op.strip("`()")
        if re.fullmatch(r"0x[0-9a-f]+", op):
            value = int(op, 16)
        elif op.lstrip("$") in symbols or op in symbols:
            value = symbols.get(op, symbols.get(op.lstrip("$"), -1))
        else:
            continue
        if 0 <= value < code_size and value % INSTRUCTION_BYTES == 0 and opcode.split(".")[0] != "RET":
            found.append(value)
    return tuple(found)


def basic_blocks(instructions: tuple[Instruction, ...], entries) -> tuple[range, ...]:
    """Split at entry points, branch / call / reconvergence targets, and after control flow."""
    n = len(instructions)
    leaders = {0}
    leaders.update(off // INSTRUCTION_BYTES for off in entries)
    for ins in instructions:
        leaders.update(t // INSTRUCTION_BYTES for t in ins.targets)
        if ins.control_flow:
            leaders.add(ins.index + 1)
    starts = sorted(s for s in leaders if 0 <= s < n)
    return tuple(range(a, b) for a, b in zip(starts, starts[1:] + [n]))


# ---------------------------------------------------------------- operand semantics

_REG = re.compile(r"(?<![\w.$])(UR|R|UP|P)(\d+)(\.64|\.128)?(?![\w])")
_ALL_PREDICATES = re.compile(r"(?<![\w])(U?)PR(?![\w])")
_WIDE_TOKENS = frozenset({"64", "128", "U64", "S64", "F64", "B64", "B128", "WIDE", "256"})


@functools.lru_cache(maxsize=1 << 16)
def regs_in(text: str, width: int = 1) -> frozenset[int]:
    """Registers named in an operand string; `width` consecutive ones from each R/UR."""
    out = set()
    for m in _REG.finditer(text):
        file, num = m.group(1), int(m.group(2))
        if num >= _FILE_SIZE[file]:
            continue
        w = {".64": 2, ".128": 4}.get(m.group(3) or "", 1)
        if file in ("R", "UR"):  # widths never spill into predicates
            w = max(w, width)
        base = _FILE_BASE[file]
        out.update(base + r for r in range(num, min(num + w, _FILE_SIZE[file])))
    if "PR" in text:
        for m in _ALL_PREDICATES.finditer(text):
            base = UP_BASE if m.group(1) else P_BASE
            out.update(range(base, base + 7))
    return frozenset(out)


def _is_predicate(op: str) -> bool:
    return re.fullmatch(r"!?U?P(\d|T)", op) is not None


# Destination layouts:
#   "DC"  operand 0, then any predicates right after it (carry-outs; e.g. IADD3 R0, P0, ...)
#   "PDC" leading predicates, one value operand, then predicates (LOP3 P0, R1 / SHFL PT, R9)
#   "PP"  exactly the first two operands (ISETP P0, PT, ...)
#   "N"   nothing: every register operand is read
_ALU = dict.fromkeys((
    "FADD", "FADD32I", "FMUL", "FMUL32I", "FFMA", "FFMA32I", "FMNMX", "FSEL", "FSET", "FSWZADD",
    "FCHK", "IADD3", "IADD32I", "IMNMX", "VIMNMX", "VIMNMX3", "VIADD", "VIADDMNMX", "IABS",
    "LEA", "LOP", "LOP32I", "SEL", "MOV", "MOV32I", "PRMT", "BMSK", "SGXT", "BREV", "FLO", "POPC",
    "IDP", "IDP4A", "VABSDIFF", "VABSDIFF4", "F2FP", "HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSET2",
    "P2R", "S2R", "S2UR", "R2UR", "MUFU", "UIADD3", "ULEA", "ULOP", "USHF", "USEL", "UMOV",
    "UPRMT", "UFLO", "UPOPC", "UBREV", "UBMSK", "USGXT", "UP2UR", "VOTE", "VOTEU", "REDUX",
    "SHF", "IMAD", "UIMAD", "I2FP", "F2IP", "I2IP",
), "DC")
_LAYOUT = {
    **_ALU,
    "LOP3": "PDC", "ULOP3": "PDC", "SHFL": "PDC", "MATCH": "PDC", "ATOMG": "PDC", "ATOM": "PDC",
    "ATOMS": "PDC",
    "ISETP": "PP", "FSETP": "PP", "DSETP": "PP", "HSETP2": "PP", "PLOP3": "PP", "PSETP": "PP",
    "UISETP": "PP", "UPLOP3": "PP", "UPSETP": "PP",
    "DADD": "DC", "DMUL": "DC", "DFMA": "DC", "DMNMX": "DC",
    "F2F": "DC", "F2I": "DC", "I2F": "DC", "I2I": "DC", "FRND": "DC",
    "HMMA": "DC", "IMMA": "DC", "BMMA": "DC", "DMMA": "DC",
    "LDG": "DC", "LD": "DC", "LDS": "DC", "LDL": "DC", "LDSM": "DC", "LDC": "DC", "ULDC": "DC",
    "CS2R": "DC", "R2P": "DC",
    "STG": "N", "ST": "N", "STS": "N", "STL": "N", "STSM": "N", "REDG": "N", "RED": "N",
    "LDGSTS": "N",
}
_FP64 = frozenset({"DADD", "DMUL", "DFMA", "DMNMX", "DSETP"})
_CONVERT = frozenset({"F2F", "F2I", "I2F", "I2I", "FRND"})
_MMA_SHAPES = {
    "HMMA": {"1684", "1688", "16816", "16832"},
    "IMMA": {"8816", "8832", "16816", "16832", "16864"},
    "BMMA": {"88128", "168128", "168256"},
    "DMMA": {"8x8x4"},
}
_MEMORY = frozenset({"LDG", "LD", "LDS", "LDL", "STG", "ST", "STS", "STL", "ATOMG", "ATOM", "ATOMS",
                     "REDG", "RED", "LDC", "ULDC"})
_GLOBAL_ADDRESS = frozenset({"LDG", "LD", "STG", "ST", "ATOMG", "ATOM", "REDG", "RED"})


def operand_semantics(opcode: str, operands: tuple[str, ...]) -> tuple[set[int], set[int], str | None]:
    """(registers read, registers written, why-unknown) of one instruction's operands."""
    base, *mods = opcode.split(".")
    layout = _LAYOUT.get(base)
    if layout is None:
        return set(), set(), f"no operand model for {base}"
    modset = set(mods)
    widths, why = _widths(base, mods, modset, operands)
    if why:
        return set(), set(), why
    dsts = _destinations(layout, operands)
    reads: set[int] = set()
    writes: set[int] = set()
    for k, op in enumerate(operands):
        regs = regs_in(op, widths.get(k, 1))
        if op[0] in "[d":
            if base in _GLOBAL_ADDRESS and "[R" in op:
                # A global/generic address is 64-bit even where nvdisasm prints `[R8]`.
                regs = regs | regs_in(op.split("][")[-1].replace("[", "").replace("]", ""), 2)
            if op.startswith("desc["):
                regs = regs | regs_in(op[:op.index("]") + 1], 2)
        (writes if k in dsts else reads).update(regs)
    return reads, writes, None


def _destinations(layout: str, operands: tuple[str, ...]) -> set[int]:
    if layout == "N":
        return set()
    if layout == "PP":
        return {0, 1}
    k = 0
    dsts = set()
    if layout == "PDC":
        while k < len(operands) and _is_predicate(operands[k]):
            dsts.add(k)
            k += 1
    if k < len(operands):
        dsts.add(k)
        k += 1
    while k < len(operands) and _is_predicate(operands[k]):
        dsts.add(k)
        k += 1
    return dsts


def _widths(base: str, mods: list[str], modset: set[str],
            operands: tuple[str, ...]) -> tuple[dict[int, int], str | None]:
    """Per-operand register widths (operand index -> count); or why the variant is unknown."""
    wide = modset & _WIDE_TOKENS
    n = len(operands)
    if base in _FP64:
        return {k: 2 for k in range(n)}, None
    if base in _CONVERT:
        has64 = any(m.endswith("64") for m in mods)
        return ({k: 2 for k in range(n)} if has64 else {}), None
    if base in _MMA_SHAPES:
        if not set(mods) & _MMA_SHAPES[base]:
            return {}, f"{base} shape {'.'.join(mods)} is not in the fragment table"
        # 4 registers covers every fragment (A, B, C, D) of these shapes.
        return {k: 4 for k in range(n)}, None
    if base in ("IMAD", "UIMAD") and "WIDE" in wide:
        if wide - {"WIDE"}:
            return {}, f"{base} variant {'.'.join(mods)}"
        return {0: 2, n - 1: 2}, None
    if base in ("SHF", "USHF"):
        # Funnel shifts name both 32-bit halves of a 64-bit value as operands of their own.
        return ({}, None) if wide <= {"U64", "S64"} else ({}, f"{base} variant {'.'.join(mods)}")
    if base == "UIADD3" and wide == {"64"}:
        # 64-bit uniform add (wgmma descriptor arithmetic): every UR operand is a register pair.
        return {k: 2 for k in range(n)}, None
    if base == "CS2R":
        return ({0: 1} if "32" in modset else {0: 2}), None
    if base == "MATCH":
        return ({k: 2 for k in range(1, n)} if wide == {"U64"} else {}), \
            (None if wide <= {"U64"} else f"MATCH variant {'.'.join(mods)}")
    if base in ("LDSM", "STSM"):
        counts = [m for m in mods if m in ("1", "2", "4")]
        if not counts or wide:
            return {}, f"{base} variant {'.'.join(mods)}"
        data = 0 if base == "LDSM" else n - 1
        return {data: int(counts[-1])}, None
    if base in _MEMORY or base == "LDGSTS":
        return _memory_widths(base, mods, wide, operands)
    if wide:
        return {}, f"{base} with width modifier {'.'.join(sorted(wide))}"
    return {}, None


def _memory_widths(base: str, mods: list[str], wide: set[str],
                   operands: tuple[str, ...]) -> tuple[dict[int, int], str | None]:
    if base == "LDGSTS":  # copies into shared memory; no register data operand
        return {}, None
    if wide - {"64", "128", "U64", "S64", "F64", "B64", "B128"}:
        return {}, f"{base} with size {'.'.join(sorted(wide))}"
    size = 4 if wide & {"128", "B128"} else 2 if wide else 1
    # Data operands: the non-address, non-predicate operands (loads: the destination).
    data = [k for k, op in enumerate(operands)
            if not op.startswith(("[", "desc[", "c[")) and not _is_predicate(op)]
    return {k: size for k in data}, None
