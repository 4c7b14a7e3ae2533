"""sip.sass: control codes, the register model, nvdisasm lookup, basic blocks."""
import os
import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sip_corpus import CORPUS_NAMES, CORPUS_SOURCES, compile_cu, corpus, corpus_entry, nvcc_path  # noqa: F401

from sip import SipError, sass
from sip.cubin import parse_cubin
from sip.deps import FENCES
from sip.sass import (CONTROL_FLOW, NO_SCOREBOARD, Control, disassemble, format_regs,
                      operand_semantics, with_control)


# ---------------------------------------------------------------- control codes

def test_control_text_form():
    c = Control(stall=2, yield_bit=1, write_sb=2, read_sb=NO_SCOREBOARD, wait=0, reuse=0)
    assert str(c) == "[B------:R-:W2:-:S02]"
    c = Control(stall=13, yield_bit=0, write_sb=NO_SCOREBOARD, read_sb=3, wait=0b100101, reuse=0)
    assert str(c) == "[B0-2--5:R3:W-:Y:S13]"


def test_control_bit_positions():
    word = (0xF << 105) | (1 << 109) | (5 << 110) | (2 << 113) | (0b110000 << 116) | (0b1010 << 122)
    c = Control.from_word(word)
    assert (c.stall, c.yield_bit, c.write_sb, c.read_sb, c.wait, c.reuse) == (15, 1, 5, 2, 0b110000, 0b1010)
    assert c.sets == (1 << 5) | (1 << 2)
    assert with_control(word, c.bits) == word


@given(st.integers(0, (1 << 128) - 1), st.integers(0, (1 << 21) - 1))
def test_control_round_trip(word, bits):
    assert Control.from_bits(bits).bits == bits
    rewritten = with_control(word, bits)
    assert Control.from_word(rewritten).bits == bits
    assert rewritten & ((1 << 105) - 1) == word & ((1 << 105) - 1)  # instruction bits untouched
    assert rewritten >> 128 == 0


@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_reuse_bits_match_the_reuse_operands_nvdisasm_prints(corpus, name):
    """Validates the control layout on real code: one reuse bit per `.reuse` operand."""
    for kernel in disassemble(parse_cubin(corpus_entry(corpus, name))).values():
        for ins in kernel.instructions:
            marked = sum(op.count(".reuse") for op in ins.operands)
            assert bin(ins.control.reuse).count("1") == marked, ins.text


@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_memory_loads_set_write_scoreboards_and_waiters_follow_them(corpus, name):
    for kernel in disassemble(parse_cubin(corpus_entry(corpus, name))).values():
        for ins in kernel.instructions:
            if ins.base in ("LDG", "S2R", "MUFU", "SHFL") and ins.writes:
                assert ins.control.write_sb != NO_SCOREBOARD, ins.text
            assert ins.control.write_sb in (*range(6), NO_SCOREBOARD)
            assert ins.control.read_sb in (*range(6), NO_SCOREBOARD)


# ---------------------------------------------------------------- the register model

def regs(text: str) -> set[str]:
    return set(text.split()) if text else set()


def sem(opcode: str, operands: str):
    reads, writes, unknown = operand_semantics(opcode, tuple(operands.split(",")) if operands else ())
    return format_regs(reads), format_regs(writes), unknown


@pytest.mark.parametrize("opcode, operands, reads, writes", [
    ("FFMA", "R9,R2,2,R9", "R2 R9", "R9"),
    ("IMAD.WIDE", "R2,R7,0x4,R2", "R2..R3 R7", "R2..R3"),
    ("IMAD.WIDE.U32", "R14,R6,R12,R14", "R6 R12 R14..R15", "R14..R15"),
    ("IADD3", "R17,P2,P3,R17,R19,R18", "R17..R19", "R17 P2..P3"),
    ("IADD3.X", "R2,RZ,RZ,R2,P2,P3", "R2 P2..P3", "R2"),
    ("LEA.HI.X", "R3,R16,UR11,R3,0x2,P1", "R3 R16 UR11 P1", "R3"),
    ("ISETP.GE.AND", "P0,PT,R7,UR4,PT", "R7 UR4", "P0"),
    ("LOP3.LUT", "P0,RZ,R0.reuse,0x1f,RZ,0xc0,!PT", "R0", "P0"),
    ("LDG.E.128", "R8,desc[UR8][R26.64]", "R26..R27 UR8..UR9", "R8..R11"),
    ("LDG.E.64", "R32,desc[UR8][R34.64+0x10]", "R34..R35 UR8..UR9", "R32..R33"),
    ("STG.E.128", "desc[UR8][R26.64],R12", "R12..R15 R26..R27 UR8..UR9", ""),
    ("ATOMG.E.CAS.STRONG.GPU", "PT,R5,[R8],R12,R13", "R8..R9 R12..R13", "R5"),
    ("ATOMG.E.ADD.64.STRONG.GPU", "PT,R24,desc[UR8][R24.64],R6", "R6..R7 R24..R25 UR8..UR9", "R24..R25"),
    ("REDG.E.ADD.F32.FTZ.RN.STRONG.GPU", "desc[UR4][R2.64],R13", "R2..R3 R13 UR4..UR5", ""),
    ("LDS.128", "R12,[R13+UR4]", "R13 UR4", "R12..R15"),
    ("LDSM.16.M88.4", "R12,[R0]", "R0", "R12..R15"),
    ("LDGSTS.E.BYPASS.128", "[R2+0x1000],desc[UR8][R12.64],P0", "R2 R12..R13 UR8..UR9 P0", ""),
    ("DFMA", "R6,R6,UR4,R8", "R6..R9 UR4..UR5", "R6..R7"),
    ("DSETP.NAN.AND", "P0,PT,R10,R10,PT", "R10..R11", "P0"),
    ("F2F.F64.F32", "R6,R5", "R5..R6", "R6..R7"),
    ("HMMA.16816.F32", "R8,R12,R18,R8", "R8..R15 R18..R21", "R8..R11"),
    ("IMMA.16832.S8.S8", "R12,R20.ROW,R38.COL,R12", "R12..R15 R20..R23 R38..R41", "R12..R15"),
    ("CS2R", "R24,SRZ", "", "R24..R25"),
    ("SHFL.BFLY", "PT,R9,R2,0x1,0x1f", "R2", "R9"),
    ("VOTE.ANY", "R8,PT,P0", "", "R8 P0"),
    ("P2R", "R0,PR,RZ,0x7f", "P0..P6", "R0"),
    ("R2P", "PR,R0,0x7f", "R0", "P0..P6"),
    ("ULDC.64", "UR4,c[0x0][0x208]", "", "UR4..UR5"),
    ("LDC", "R3,c[0x0][R5+0x10]", "R5", "R3"),
    ("S2R", "R0,SR_TID.X", "", "R0"),
    ("UIADD3.64", "UR18,UR50,0x2,URZ", "UR50..UR51", "UR18..UR19"),
    ("UIADD3.64", "UR4,UR4,UR8,UR12", "UR4..UR5 UR8..UR9 UR12..UR13", "UR4..UR5"),
    ("USHF.L.U64.HI", "UR5,UR4,0x3,UR5", "UR4..UR5", "UR5"),
    ("USHF.R.S64", "UR6,UR6,0x2,UR7", "UR6..UR7", "UR6"),
])
def test_register_model(opcode, operands, reads, writes):
    got_reads, got_writes, unknown = sem(opcode, operands)
    assert unknown is None
    assert regs(got_reads) == regs(reads)
    assert regs(got_writes) == regs(writes)


@pytest.mark.parametrize("opcode, operands, why", [
    ("TEX.SCR.LL", "R4,R2,R0,0x0,2D", "no operand model for TEX"),
    ("IADD3.64", "R4,R4,0x10,RZ", "width modifier"),
    ("USHF.L.W.128", "UR4,UR4,0x1,UR5", "USHF variant"),
    ("HMMA.884.F32.F16", "R8,R12,R18,R8", "fragment table"),
    ("LDG.E.ENL2.256", "R8,desc[UR4][R2.64]", "size"),
    ("DMMA.16x8x16", "R8,R12,R18,R8", "fragment table"),
])
def test_unknown_semantics_are_reported_not_guessed(opcode, operands, why):
    reads, writes, unknown = sem(opcode, operands)
    assert unknown and why in unknown
    assert not reads and not writes


def test_corpus_compute_opcodes_are_all_modeled(corpus):
    """Everything ptxas emitted for the corpus is either modeled or control/synchronisation."""
    unmodeled = set()
    for data in corpus.values():
        for kernel in disassemble(parse_cubin(data)).values():
            unmodeled |= {i.base for i in kernel.instructions if i.unknown}
    assert unmodeled <= CONTROL_FLOW | FENCES | {"NOP", "BRA", "CALL", "RET", "EXIT"} | {"UTMACMDFLUSH"}


# ---------------------------------------------------------------- nvdisasm lookup

def test_missing_nvdisasm_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(sass, "_nvdisasm_candidates", lambda: [])
    with pytest.raises(SipError, match="pip install nvidia-cuda-nvdisasm"):
        sass.find_nvdisasm()


def test_nvdisasm_is_found_under_cuda_home(monkeypatch, tmp_path):
    fake = tmp_path / "bin" / "nvdisasm"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert sass.find_nvdisasm() == str(fake)


def test_nvdisasm_is_found_in_the_wheel(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sass, "TOOLKIT_NVDISASM", "/nonexistent/nvdisasm")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    found = sass.find_nvdisasm()
    assert os.sep + "nvidia" + os.sep in found and found.endswith("nvdisasm")


def test_disassembly_without_nvdisasm_fails_clearly(monkeypatch, corpus):
    monkeypatch.setattr(sass, "_nvdisasm_candidates", lambda: ["/nonexistent/nvdisasm"])
    monkeypatch.setattr(sass, "_JSON_CACHE", {})
    with pytest.raises(SipError, match="nvidia-cuda-nvdisasm"):
        disassemble(parse_cubin(corpus_entry(corpus, "smem_tiled_gemm")))


# ---------------------------------------------------------------- decoding and blocks

@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_instructions_carry_their_words_and_blocks_partition_the_code(corpus, name):
    cubin = parse_cubin(corpus_entry(corpus, name))
    for kernel in disassemble(cubin).values():
        text = cubin.text(kernel.name)
        ins = kernel.instructions
        assert len(ins) * 16 == len(text)
        for i in ins:
            assert i.word == int.from_bytes(text[i.offset:i.offset + 16], "little")
        covered = [i for r in kernel.blocks for i in r]
        assert covered == list(range(len(ins)))
        starts = {r.start for r in kernel.blocks}
        for i in ins:
            for target in i.targets:
                assert target // 16 in starts, (i.text, hex(target))
            if i.control_flow and i.index + 1 < len(ins):
                assert i.index + 1 in starts
        for off in kernel.code.entries:
            assert off // 16 in starts


def test_internal_subroutines_listed_apart_by_nvdisasm_are_joined(tmp_path, monkeypatch):
    """nvdisasm 13.0 gives a kernel's internal subroutine its own JSON function; 13.5 lists it inside
    the kernel. Both must decode to the same instructions."""
    if nvcc_path() is None:
        pytest.skip("nvcc not found")
    from sip import cubin as cubin_mod

    data = compile_cu(CORPUS_SOURCES / "div64_subroutine.cu", tmp_path)
    parsed = cubin_mod.parse_cubin(data)
    (name,) = parsed.kernel_names
    whole = sass.disassemble_kernel(parsed, name)
    code = parsed.kernel(name)
    subs = [s for s in parsed.symbols if s.shndx == code.section.index and s.value > 0 and s.name != name]
    assert subs, "expected an internal subroutine symbol in the kernel's section"
    cut = subs[0].value // cubin_mod.INSTRUCTION_BYTES
    records = sass.nvdisasm_functions(parsed)[name]
    assert len(records) == code.instruction_count  # this nvdisasm lists it inside the kernel
    split = {name: records[:cut], subs[0].name: records[cut:]}
    monkeypatch.setattr(sass, "nvdisasm_functions", lambda c: split)
    apart = sass.disassemble_kernel(parsed, name)
    assert apart.instructions == whole.instructions and apart.blocks == whole.blocks
    gap = {name: records[:cut], subs[0].name: records[cut + 1:]}
    monkeypatch.setattr(sass, "nvdisasm_functions", lambda c: gap)
    with pytest.raises(SipError, match="nvdisasm gave"):
        sass.disassemble_kernel(parsed, name)
