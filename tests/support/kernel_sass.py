"""SASS of a compiled rosekernels kernel, for the tests that inspect its instructions."""
import re
import struct
import subprocess

from sip import SipError, sass


def sass_of(kernel, tmp_path) -> str | None:
    """nvdisasm -c of the kernel's cubin (with the program headers that trail its sections in the
    object file; nvdisasm rejects the image without them); None when nvdisasm is not installed."""
    try:
        tool = sass.find_nvdisasm()
    except SipError:
        return None
    start = kernel.object_bytes.find(kernel.cubin)
    phoff, = struct.unpack_from("<Q", kernel.cubin, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", kernel.cubin, 0x36)
    path = tmp_path / "k.cubin"
    path.write_bytes(kernel.object_bytes[start:start + max(len(kernel.cubin), phoff + phentsize * phnum)])
    return subprocess.run([tool, "-c", str(path)], capture_output=True, text=True, check=True).stdout


def opcodes_and_global_memory(kernel, tmp_path) -> tuple[list[str], list[tuple[int, str]]] | None:
    """The kernel's opcodes in program order (predicates dropped) and, for each global load or store,
    (its index among them, "LDG" or "STG"); None when nvdisasm is not installed."""
    text = sass_of(kernel, tmp_path)
    if text is None:
        return None
    ops = re.findall(r"^\s*/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text, re.M)
    return ops, [(i, o[:3]) for i, o in enumerate(ops) if o.startswith(("LDG", "STG"))]
