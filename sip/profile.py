"""Where a kernel's warps spend their time, from the GPU's PC sampling, as proposal weights for sip.mutate.

Nsight Compute samples the program counter of resident warps (its SourceCounters section) and
attributes each sample to one SASS instruction. `ncu --import REPORT --page source --print-source sass
--csv` lists, per profiled launch, a `"Kernel Name",NAME` line, a header, and the function's
instructions in code order (absolute addresses) with their sample counts. `stall_samples` reads the
sections of a listing that profile `kernel` back onto its disassembly, adding up the sections of
several launches: every listed address must be an instruction of the kernel with the same base opcode
(else the listing is of another build: SipError; modifiers, reuse flags and branch targets are
printed differently by ncu and nvdisasm, so they are not compared).

`block_weights` turns the samples into one weight per instruction: a block's samples spread evenly over
its instructions, so a block is proposed in proportion to its samples times the share of its
instructions a move class can change. Blocks nobody sampled keep `floor` times the mean weight: rarely
proposed, never unreachable. Too few samples (under `min_samples`) say nothing about where the time
goes: SipError, rather than weights drawn from noise.
"""
from __future__ import annotations

import csv
import io

from sip import SipError
from sip.cubin import INSTRUCTION_BYTES
from sip.sass import Kernel

SAMPLES_COLUMN = "Warp Stall Sampling (All Samples)"
MIN_SAMPLES = 100


def stall_samples(listing: str, kernel: Kernel) -> tuple[int, ...]:
    """Per instruction of `kernel`, the PC samples the listing's sections of this kernel attribute to it
    (sections under this kernel's name, or unnamed ones; a same-named section of another build is
    skipped as long as one section matches)."""
    sections = _sections(listing)
    if not sections:
        raise SipError("not an ncu source listing: no header with Address and Source columns "
                       "(export it with: ncu --import REPORT --page source --print-source sass --csv)")
    ours = [rows for name, rows in sections if _names(name, kernel.name)]
    if not ours:
        raise SipError(f"the listing profiles {sorted({str(n) for n, _ in sections})}, not {kernel.name}")
    samples, errors = [0] * len(kernel.instructions), []
    for rows in ours:
        try:
            counts = _counts(rows, kernel)
        except SipError as e:
            errors.append(e)
            continue
        samples = [a + b for a, b in zip(samples, counts)]
    if len(errors) == len(ours):
        raise errors[0]
    return tuple(samples)


def block_weights(kernel: Kernel, samples: tuple[int, ...], floor: float = 0.01,
                  min_samples: int = MIN_SAMPLES) -> tuple[float, ...]:
    """Per instruction: its block's samples / the block's length, at least `floor` x the mean."""
    if len(samples) != len(kernel.instructions):
        raise SipError(f"{len(samples)} sample counts for {len(kernel.instructions)} instructions")
    if sum(samples) < min_samples:
        raise SipError(f"{sum(samples)} PC samples of {kernel.name}: too few to say where its time goes "
                       f"(at least {min_samples}; profile with a shorter warp-sampling interval or a longer run)")
    per = [sum(samples[i] for i in block) / len(block) for block in kernel.blocks]
    least = floor * sum(samples) / len(samples)
    return tuple(max(per[b], least) for b in kernel.block_of)


def hot_blocks(kernel: Kernel, samples: tuple[int, ...]) -> list[tuple[float, int]]:
    """(share of all samples, block) of every block, hottest first."""
    total = sum(samples) or 1
    return sorted(((sum(samples[i] for i in r) / total, b) for b, r in enumerate(kernel.blocks)),
                  key=lambda x: (-x[0], x[1]))


def _names(listed: str | None, name: str) -> bool:
    """Whether a section's kernel name is `name`: unnamed sections count; ncu may print a mangled C++
    name demangled (`_Z15smem_tiled_gemmPfPKfS1_i` as `smem_tiled_gemm(float *, ...)`)."""
    if listed is None or listed == name:
        return True
    base = listed.split("(", 1)[0].rsplit("::", 1)[-1]
    return name.startswith("_Z") and bool(base) and f"{len(base)}{base}" in name


def _is_header(line: str) -> bool:
    return '"Address"' in line and '"Source"' in line


def _sections(listing: str) -> list[tuple[str | None, list[dict]]]:
    """(kernel name or None, rows) of each header-led section of the listing."""
    out: list[tuple[str | None, list[dict]]] = []
    name, lines = None, listing.splitlines()
    k = 0
    while k < len(lines):
        line = lines[k]
        if line.startswith('"Kernel Name"'):
            fields = next(csv.reader([line]))
            name = fields[1] if len(fields) > 1 else None
        elif _is_header(line):
            end = next((j for j in range(k + 1, len(lines))
                        if lines[j].startswith('"Kernel Name"') or _is_header(lines[j])), len(lines))
            reader = csv.DictReader(io.StringIO("\n".join(lines[k:end])))
            column = next((c for c in reader.fieldnames or () if c.startswith(SAMPLES_COLUMN)), None)
            if column is None:
                raise SipError(f"the listing has no {SAMPLES_COLUMN!r} column: profile with --section SourceCounters")
            out.append((name, [{"address": r["Address"], "source": r["Source"], "count": r[column]} for r in reader]))
            name, k = None, end
            continue
        k += 1
    return out


def _counts(rows: list[dict], kernel: Kernel) -> list[int]:
    """One section's counts per instruction, checking that it lists this kernel's code."""
    try:
        listed = [(int(r["address"], 16), r["source"].strip(), _count(r["count"])) for r in rows]
    except (TypeError, ValueError, AttributeError) as e:  # a short row has None fields
        raise SipError(f"unreadable row in the ncu listing: {e}") from None
    if not listed:
        raise SipError("the ncu listing lists no instructions")
    base = min(address for address, _, _ in listed)
    samples: list[int | None] = [None] * len(kernel.instructions)
    for address, source, count in listed:
        index, rest = divmod(address - base, INSTRUCTION_BYTES)
        ins = kernel.instructions[index] if not rest and index < len(kernel.instructions) else None
        if ins is None or _opcode(source) != ins.base:
            raise SipError(f"the listing's instruction at +{address - base:#x} ({source!r}) is not "
                           f"{kernel.name}'s there: it profiles another build of the kernel")
        if samples[index] is not None:
            raise SipError(f"the listing lists the instruction at +{address - base:#x} twice")
        samples[index] = count
    return [n or 0 for n in samples]


def _count(text: str) -> int:
    return int(float(text.replace(",", ""))) if text.strip() else 0


def _opcode(source: str) -> str:
    """The base mnemonic of a listed instruction: `@!P0 LDG.E.128 R4, desc[UR6][R2.64] ;` -> LDG."""
    words = source.replace(";", " ").split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".", 1)[0] if words else ""
