"""sip.cubin: ELF structure, arch check, references into code, in-place patching."""
import re
import subprocess

import pytest
from sip_corpus import CORPUS_NAMES, CORPUS_SOURCES, compile_cu, corpus, corpus_entry  # noqa: F401

from sip import SipError
from sip.cubin import (INSTRUCTION_BYTES, cubins_in_fatbin, load_cubin, parse_cubin,
                       replace_in_fatbin)
from sip.sass import find_nvdisasm


@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_unmodified_cubin_is_written_back_byte_identical(corpus, name):
    data = corpus_entry(corpus, name)
    cubin = parse_cubin(data)
    assert cubin.arch == "sm_90a"
    assert cubin.kernel_names
    patched = data
    for kernel in cubin.kernels():
        patched = parse_cubin(patched).with_text(kernel.name, cubin.text(kernel.name))
    assert patched == data == cubin.to_bytes()


@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_patching_changes_only_that_kernels_code(corpus, name):
    data = corpus_entry(corpus, name)
    cubin = parse_cubin(data)
    kernel = cubin.kernels()[0]
    sec = kernel.section
    new = bytes(b ^ 0xFF for b in cubin.text(kernel.name))
    out = cubin.with_text(kernel.name, new)
    assert len(out) == len(data)
    assert out[sec.offset:sec.offset + sec.size] == new
    assert out[:sec.offset] == data[:sec.offset]
    assert out[sec.offset + sec.size:] == data[sec.offset + sec.size:]
    with pytest.raises(SipError, match="bytes"):
        cubin.with_text(kernel.name, new[:-16])


def test_every_code_offset_nvdisasm_names_in_nv_info_is_pinned(corpus):
    """nvdisasm prints the .nv.info words that are code offsets as `.L_x_N@srel` labels; each
    such instruction must be pinned, and our attribute ids must match its names."""
    tool = find_nvdisasm()
    checked = 0
    for name, data in corpus.items():
        cubin = parse_cubin(data)
        listing = _nvdisasm_listing(tool, data, tmp_name=name)
        labels = _code_labels(listing)
        for section, attrs in _nvinfo_attributes(listing).items():
            ours = {(a.offset, a.attr): a for a in cubin.nvinfo
                    if cubin.sections[a.section].name == section}
            assert set(ours) == {(off, attr) for off, attr, _, _ in attrs}, section
            for off, attr, their_name, srel_labels in attrs:
                if their_name != "EIATTR_UNKNOWN":
                    assert ours[(off, attr)].name == their_name
                for label in srel_labels:
                    text_section, at = labels[label]
                    kernel = cubin.kernel(text_section[len(".text."):])
                    assert at in kernel.pins, (name, section, their_name, hex(at))
                    checked += 1
    assert checked > 20


def test_relocated_and_debug_frame_instructions_are_pinned(corpus):
    cubin = parse_cubin(corpus_entry(corpus, "control_mix"))
    kernel = cubin.kernels()[0]
    # The frame is set up by `VIADD R1, R1, -0x80` at 0x10; .debug_frame marks that place.
    assert "debug_frame" in kernel.pins[0x10] and "debug_frame" in kernel.pins[0x20]
    # poly() and the two slow paths live inside the kernel's section: they are entry points.
    funcs = {s.value for s in cubin.symbols if s.shndx == kernel.section.index and s.type == 2}
    assert {v for v in funcs if v} <= kernel.entries
    assert len(kernel.entries) == 4


def test_arch_comes_from_e_flags_and_the_a_variant_is_recognised(tmp_path):
    source = CORPUS_SOURCES / "warp_reduce_atomics.cu"
    assert load_cubin(compile_cu(source, tmp_path, "sm_90")).arch == "sm_90"
    assert load_cubin(compile_cu(source, tmp_path, "sm_90a")).arch == "sm_90a"


@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
def test_other_architectures_are_refused_by_name(tmp_path, arch):
    data = compile_cu(CORPUS_SOURCES / "warp_reduce_atomics.cu", tmp_path, arch)
    with pytest.raises(SipError, match=f"unsupported architecture {arch}"):
        parse_cubin(data)


@pytest.mark.parametrize("data, message", [
    (b"", "not an ELF"),
    (b"#!/bin/sh\necho hi\n", "not an ELF"),
    (b"\x7fELF" + bytes(60), "not a 64-bit little-endian ELF"),
])
def test_non_cubin_input_is_refused(data, message):
    with pytest.raises(SipError, match=message):
        parse_cubin(data)


def test_host_elf_is_refused_by_machine(tmp_path):
    with pytest.raises(SipError, match="not EM_CUDA"):
        load_cubin("/bin/sh")


def test_a_fatbin_is_named_as_such(corpus):
    cubin = parse_cubin(corpus_entry(corpus, "cute_row_sum"))
    fatbin = _fatbin_around(cubin.data)
    with pytest.raises(SipError, match="fatbin"):
        parse_cubin(fatbin)


def test_missing_kernel_lists_the_existing_ones(corpus):
    cubin = parse_cubin(corpus_entry(corpus, "smem_tiled_gemm"))
    with pytest.raises(SipError) as err:
        cubin.kernel("no_such_kernel")
    assert "no_such_kernel" in str(err.value)
    assert "_Z15smem_tiled_gemmPfPKfS1_i" in str(err.value)


def test_fatbin_cubins_can_be_extracted_and_replaced(corpus):
    data = corpus_entry(corpus, "cute_vector_scale_add")
    fatbin = _fatbin_around(data)
    [(offset, found)] = cubins_in_fatbin(fatbin)
    assert found == data
    flipped = data[:-1] + bytes([data[-1] ^ 1])
    out = replace_in_fatbin(fatbin, data, flipped)
    assert out[offset:offset + len(data)] == flipped and len(out) == len(fatbin)
    with pytest.raises(SipError, match="not in this fatbin"):
        replace_in_fatbin(out, data, flipped)


def test_kernel_code_sizes_are_whole_instructions(corpus):
    for data in corpus.values():
        for kernel in parse_cubin(data).kernels():
            assert kernel.section.size % INSTRUCTION_BYTES == 0
            assert all(off % INSTRUCTION_BYTES == 0 and off < kernel.section.size for off in kernel.pins)


# ---------------------------------------------------------------- helpers

def _fatbin_around(cubin: bytes) -> bytes:
    """A one-entry fatbin (the layout CuTeDSL and nvcc emit) holding `cubin`."""
    import struct
    payload = cubin + bytes(-len(cubin) % 8)
    entry = bytearray(64)
    struct.pack_into("<HHIQ", entry, 0, 2, 0x101, 64, len(payload))
    struct.pack_into("<I", entry, 28, 90)
    struct.pack_into("<Q", entry, 40, 0x11)
    body = bytes(entry) + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def _nvdisasm_listing(tool: str, data: bytes, tmp_name: str) -> str:
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{tmp_name}.cubin"
        path.write_bytes(data)
        return subprocess.run([tool, str(path)], capture_output=True, text=True, check=True).stdout


def _code_labels(listing: str) -> dict[str, tuple[str, int]]:
    """label -> (text section, offset of the instruction it marks)."""
    labels, pending, section = {}, [], None
    for line in listing.splitlines():
        m = re.match(r"\s*\.section\s+([^,]+),", line)
        if m:
            section, pending = m.group(1), []
            continue
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+\S", line)
        if m and section and section.startswith(".text.") and pending:
            for label in pending:
                labels[label] = (section, int(m.group(1), 16))
            pending = []
    return labels


def _nvinfo_attributes(listing: str):
    """.nv.info section -> [(offset, attribute id, nvdisasm's name, @srel labels)]."""
    out: dict[str, list] = {}
    section = current = None
    for line in listing.splitlines():
        m = re.match(r"\s*\.section\s+([^,]+),", line)
        if m:
            section = m.group(1) if m.group(1).startswith(".nv.info") else None
            current = None
            if section:
                out[section] = []
            continue
        if section is None:
            continue
        m = re.search(r"nvinfo : (\S+)", line)
        if m:
            current = [None, None, m.group(1), []]
            out[section].append(current)
            continue
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+\.byte\s+0x([0-9a-f]+), 0x([0-9a-f]+)", line)
        if m and current is not None and current[0] is None:
            current[0], current[1] = int(m.group(1), 16), int(m.group(3), 16)
            continue
        m = re.search(r"\.word\s+(\.L_x_\d+)@srel", line)
        if m and current is not None:
            current[3].append(m.group(1))
    return {s: [tuple(a) for a in attrs] for s, attrs in out.items()}


def test_a_frame_location_after_which_no_rule_changes_pins_nothing():
    from sip.cubin import _cfa_locations
    # advance_loc4 0x48c (x4), def_cfa, advance_loc4 0x35c (x4), nop padding: the nvcc / CuTeDSL kernel FDE
    program = bytes.fromhex("048c0400000c8180802800045c03000000000000")
    assert list(_cfa_locations(program, 4)) == [0x48c * 4]
    # advance_loc 3, DW_CFA_offset r2 at 1, advance_loc 2, advance_loc 1, def_cfa_offset 16
    program = bytes([0x43, 0x82, 0x01, 0x42, 0x41, 0x0E, 0x10])
    assert list(_cfa_locations(program, 16)) == [48, 96]


def test_kernels_keep_the_pins_of_their_frame_rule_changes(corpus):
    kernel = parse_cubin(corpus_entry(corpus, "smem_tiled_gemm")).kernels()[0]
    frame = sorted(off for off, why in kernel.pins.items() if "frame-rule" in why)
    assert frame == [frame[0], frame[0] + 16]  # the one place the rule changes; none at the end


def test_only_annotating_attributes_leave_their_instructions_crossable():
    """Offsets in an annotation list (ANNOTATION_ATTRS) are pinned; in any other list (a software
    workaround, an id this module does not know) they are fenced too."""
    from types import SimpleNamespace

    from sip.cubin import ANNOTATION_ATTRS, NvInfoAttribute, Section, _pin_nvinfo

    text = Section(3, ".text.k", 1, 6, 0, 0x100, 0, 0)
    info = Section(4, ".nv.info.k", 0x70000000, 0, 0, 0, 0, 3)
    words = lambda *v: b"".join(x.to_bytes(4, "little") for x in v)  # noqa: E731
    attrs = [NvInfoAttribute(4, 0, 4, 0x28, None, words(0x10, 0x20)),  # COOP_GROUP_INSTR_OFFSETS
             NvInfoAttribute(4, 12, 4, 0x36, None, words(0x20, 0x40)),  # SW_WAR
             NvInfoAttribute(4, 24, 4, 0x7E, None, words(0x50))]  # unknown id
    cubin = SimpleNamespace(nvinfo=attrs, sections={3: text, 4: info})
    pins, entries, fenced = {}, set(), set()
    _pin_nvinfo(cubin, text, pins, entries, fenced)
    assert set(pins) == {0x10, 0x20, 0x40, 0x50} and fenced == {0x20, 0x40, 0x50}
    assert 0x28 in ANNOTATION_ATTRS and 0x36 not in ANNOTATION_ATTRS
