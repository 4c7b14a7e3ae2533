"""Where a kernel's warps spend their time, from the GPU's PC sampling, as proposal weights for sip.mutate.

Nsight Compute samples the program counter of resident warps (its SourceCounters section) and
attributes each sample to one SASS instruction. `ncu --import REPORT --page source --print-source sass
--csv` lists the profiled function's instructions in code order with their sample counts;
`stall_samples` reads that listing back onto a disassembled kernel (every listed instruction must be
the kernel's instruction at that offset, else the listing is of another build: SipError).

`block_weights` turns the samples into one weight per instruction: a block's samples spread evenly
over its instructions, so the proposals a search makes in a block are proportional to the time spent
there. Blocks nobody sampled keep `floor` times the mean weight: rarely proposed, never unreachable.
"""
from __future__ import annotations

import csv
import io

from sip import SipError
from sip.cubin import INSTRUCTION_BYTES
from sip.sass import Kernel

SAMPLES_COLUMN = "Warp Stall Sampling (All Samples)"


def stall_samples(listing: str, kernel: Kernel) -> tuple[int, ...]:
    """Per instruction of `kernel`, the PC samples an ncu source-page CSV listing attributes to it."""
    lines = listing.splitlines()
    start = next((k for k, line in enumerate(lines) if '"Address"' in line and '"Source"' in line), None)
    if start is None:
        raise SipError("not an ncu source listing: no header with Address and Source columns "
                       "(export it with: ncu --import REPORT --page source --print-source sass --csv)")
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    column = next((c for c in rows[0] if c.startswith(SAMPLES_COLUMN)), None) if rows else None
    if column is None:
        raise SipError(f"the listing has no {SAMPLES_COLUMN!r} column: profile with --section SourceCounters")
    try:
        listed = [(int(r["Address"], 16), r["Source"].strip(), _count(r[column])) for r in rows]
    except (TypeError, ValueError) as e:
        raise SipError(f"unreadable row in the ncu listing: {e}") from None
    base = min(address for address, _, _ in listed)
    samples = [0] * len(kernel.instructions)
    for address, source, count in listed:
        index, rest = divmod(address - base, INSTRUCTION_BYTES)
        ins = kernel.instructions[index] if not rest and index < len(kernel.instructions) else None
        if ins is None or _opcode(source) != ins.base:
            raise SipError(f"the listing's instruction at +{address - base:#x} ({source!r}) is not "
                           f"{kernel.name}'s there: it profiles another build of the kernel")
        samples[index] += count
    return tuple(samples)


def block_weights(kernel: Kernel, samples: tuple[int, ...], floor: float = 0.01) -> tuple[float, ...]:
    """Per instruction: its block's samples / the block's length, at least `floor` x the mean."""
    if len(samples) != len(kernel.instructions):
        raise SipError(f"{len(samples)} sample counts for {len(kernel.instructions)} instructions")
    per = [sum(samples[i] for i in block) / len(block) for block in kernel.blocks]
    least = floor * max(sum(samples) / len(samples), 1e-12)
    return tuple(max(per[b], least) for b in kernel.block_of)


def hot_blocks(kernel: Kernel, samples: tuple[int, ...]) -> list[tuple[float, int]]:
    """(share of all samples, block) of every block, hottest first."""
    total = sum(samples) or 1
    return sorted(((sum(samples[i] for i in r) / total, b) for b, r in enumerate(kernel.blocks)),
                  key=lambda x: (-x[0], x[1]))


def _count(text: str) -> int:
    return int(float(text.replace(",", ""))) if text.strip() else 0


def _opcode(source: str) -> str:
    """The base mnemonic of a listed instruction: `@!P0 LDG.E.128 R4, desc[UR6][R2.64] ;` -> LDG."""
    words = source.replace(";", " ").split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".", 1)[0] if words else ""
