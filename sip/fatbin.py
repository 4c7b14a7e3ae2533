"""Find and replace cubins inside a CUDA fatbin container.

CuTeDSL embeds each compiled module as a fatbin (in an MLIR global, and later in the exported object
file). A fatbin is a 16-byte header (magic, version, header size, payload size) followed by entries,
each with its own header (kind 1 = PTX, 2 = ELF cubin; target arch; flags) and payload. Replacing a
cubin by one of the same size keeps every header valid, which is all the tuner ever needs: SIP
reorders instructions in place and never changes a cubin's size.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX = 1
KIND_ELF = 2
_FLAG_COMPRESSED = 0x2000  # payload is compressed: its bytes are not a plain cubin

_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of all entries
_ENTRY = struct.Struct("<HHIQ")  # kind, version, header size, payload size


class FatbinError(ValueError):
    """The bytes are not a fatbin this module can read or edit."""


@dataclass(frozen=True)
class FatbinEntry:
    kind: int  # KIND_PTX or KIND_ELF
    arch: int  # e.g. 90 for sm_90 / sm_90a
    offset: int  # of the payload, from the start of the fatbin
    size: int  # of the payload (padded)
    compressed: bool


def is_fatbin(data: bytes) -> bool:
    return len(data) >= _HEADER.size and struct.unpack_from("<I", data)[0] == FATBIN_MAGIC


def parse_fatbin(data: bytes) -> list[FatbinEntry]:
    """The entries of the fatbin that starts at data[0]."""
    if not is_fatbin(data):
        raise FatbinError("not a fatbin: the magic number 0xBA55ED50 is missing")
    _, _, header_size, body_size = _HEADER.unpack_from(data)
    end = header_size + body_size
    if end > len(data):
        raise FatbinError(f"truncated fatbin: header says {end} bytes, have {len(data)}")
    entries = []
    pos = header_size
    while pos + _ENTRY.size <= end:
        kind, _, entry_header, payload = _ENTRY.unpack_from(data, pos)
        if entry_header < 48 or pos + entry_header + payload > end:
            raise FatbinError(f"corrupt fatbin entry at offset {pos}")
        arch = struct.unpack_from("<I", data, pos + 28)[0]
        flags = struct.unpack_from("<Q", data, pos + 40)[0]
        entries.append(FatbinEntry(kind, arch, pos + entry_header, payload,
                                   bool(flags & _FLAG_COMPRESSED)))
        pos += entry_header + payload
    return entries


def elf_size(data: bytes, offset: int = 0) -> int:
    """Exact size of the ELF64 image at `offset` (fatbin payloads are padded past it)."""
    if data[offset:offset + 4] != b"\x7fELF" or data[offset + 4] != 2:
        raise FatbinError(f"no ELF64 image at offset {offset}")
    shoff, = struct.unpack_from("<Q", data, offset + 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, offset + 0x3A)
    phoff, = struct.unpack_from("<Q", data, offset + 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, offset + 0x36)
    # ptxas puts the program headers after the section header table.
    end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
    # Section contents may lie after the section header table.
    for i in range(shnum):
        sh = offset + shoff + i * shentsize
        sh_type, = struct.unpack_from("<I", data, sh + 4)
        sh_off, sh_size = struct.unpack_from("<QQ", data, sh + 0x18)
        if sh_type != 8:  # SHT_NOBITS occupies no file bytes
            end = max(end, sh_off + sh_size)
    return end


def cubins(data: bytes) -> list[tuple[int, bytes]]:
    """(offset, bytes) of every uncompressed ELF cubin in the fatbin."""
    found = []
    for e in parse_fatbin(data):
        if e.kind == KIND_ELF and not e.compressed:
            size = elf_size(data, e.offset)
            found.append((e.offset, bytes(data[e.offset:e.offset + size])))
    return found


def embedded_cubins(blob: bytes) -> list[tuple[int, bytes]]:
    """(absolute offset, bytes) of every cubin in every fatbin embedded in `blob`: a host object or
    library that carries device code, such as a rosekernels compile-cache entry's .o."""
    magic = FATBIN_MAGIC.to_bytes(4, "little")
    found = []
    start = blob.find(magic)
    while start >= 0:
        try:
            found += [(start + off, c) for off, c in cubins(blob[start:])]
        except FatbinError:
            pass  # the magic number occurred by chance
        start = blob.find(magic, start + 4)
    return found


def replace_cubin(data: bytes, old: bytes, new: bytes) -> bytes:
    """The fatbin with cubin `old` swapped for `new` (same size, so no header changes)."""
    if len(old) != len(new):
        raise FatbinError(f"replacement cubin has {len(new)} bytes, the original {len(old)}")
    for offset, cubin in cubins(data):
        if cubin == old:
            return data[:offset] + new + data[offset + len(old):]
    raise FatbinError("the cubin to replace is not in this fatbin")
