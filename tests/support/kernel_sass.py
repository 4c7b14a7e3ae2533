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


def loop_opcodes(text: str, marker: str) -> list[str]:
    """The opcodes (predicates dropped) of the innermost loop of SASS `text` (nvdisasm -c) that holds an
    instruction whose opcode starts with `marker`: from the target of the first backward branch past the
    marker's first occurrence (a target at or before it) to that branch."""
    return [line.split()[0] for line in loop_instructions(text, marker)]


def loop_instructions(text: str, marker: str) -> list[str]:
    """loop_opcodes' loop, each instruction whole: "OPCODE operands" (predicate and ';' dropped)."""
    labels, instructions = {}, []
    for line in text.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        found = re.match(r"^\s*/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?)\s*;?\s*$", line)
        if found:
            target = re.search(r"`\((\.L_x_\d+)\)", found.group(2))
            instructions.append((found.group(1) + found.group(2).rstrip(" ;"), target.group(1) if target else None))
    first = next(i for i, (ins, _) in enumerate(instructions) if ins.startswith(marker))
    for i in range(first, len(instructions)):
        ins, target = instructions[i]
        if ins.split()[0] == "BRA" and target in labels and labels[target] <= first:
            return [o for o, _ in instructions[labels[target]:i + 1]]
    raise AssertionError(f"no loop around {marker}")


def descriptor_copies(text: str, marker: str) -> tuple[int, int]:
    """(R2UR instructions, WGMMAs) in the mainloop around `marker` ("HGMMA" / "QGMMA"). A WGMMA takes its
    shared-memory descriptors from uniform registers: made from a warp-uniform warpgroup index they are
    computed there; made from a thread's index they live in vector registers, and every WGMMA copies its
    pair over first (two R2UR each). Other R2URs count too (ptxas may keep a constant in a vector register),
    so a test asks for fewer than one a WGMMA, not none."""
    loop = loop_instructions(text, marker)
    return sum(i.startswith("R2UR") for i in loop), sum(i.startswith(marker) for i in loop)
