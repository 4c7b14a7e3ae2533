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

Stall reasons: the same listing has one column per warp-stall reason of the PC sampler, `stall_<reason>`
(all samples: the reasons a sampled warp had, `selected` when it issued) and `stall_<reason> (Not
Issued)`. `stall_reasons` reads the all-samples columns per instruction; `breakdown` adds them up over
instructions (a block, a loop); `REASONS` says what each means on Hopper.

Two shares of the samples, two different claims:

- `headroom`: the share of samples outside issue cycles, 1 - the share of `ISSUED` (`selected`: the
  warp issued; `not_selected`: it was ready and another warp issued). Either kind falls in a cycle in
  which its warp scheduler issued, so their share is at most the share of such cycles; every
  instruction issues once (one a cycle per scheduler) whatever the order, so no reordering of the
  same instructions, nor any change of stall counts, yield or reuse bits, removes those cycles, and
  the kernel cannot get faster than by `headroom`. This is the upper bound: a share under the A/A
  spread of the timing leaves no schedule change measurable (the campaign's --min-headroom). 1.0
  without samples: nothing is known.
- `sensitive_share`: the share in `SCHEDULE_SENSITIVE`, the reasons SIP's moves aim at: a stall count
  (`wait`), a consumer issued before its variable-latency producer is done (`short_sb`: MUFU, shared
  memory, SHFL; `long_sb`: global memory), a pipe or queue taken by this warp's previous instructions
  (`math`, `mio`, `dispatch`), and the waits the `sync` relaxation lets register-only work move ahead
  of (`gmma`: WARPGROUP.DEPBAR on the tensor core; `barrier`: BAR.SYNC). It says where a search can
  act, not what it can save: the other waits (`sleeping`: mbarrier try-wait, `membar`, the `lg` / `tex`
  queues, `drain`, instruction fetch: `no_inst`, `imc`, `branch_resolving`) are outside it yet
  inside `headroom`, and a shorter stall may turn into another wait.
"""
from __future__ import annotations

import csv
import io

from sip import SipError
from sip.cubin import INSTRUCTION_BYTES
from sip.sass import Kernel

SAMPLES_COLUMN = "Warp Stall Sampling (All Samples)"
MIN_SAMPLES = 100
STALL_PREFIX = "stall_"
NOT_ISSUED = " (Not Issued)"
REASONS = {  # Nsight Compute's warp-stall reasons (sm_90), by their source-page column names
    "selected": "issued",
    "not_selected": "eligible, another warp issued",
    "wait": "fixed-latency dependency (stall count)",
    "short_sb": "short scoreboard (MUFU, shared memory, SHFL)",
    "long_sb": "long scoreboard (global / local memory)",
    "math": "math pipe throttle",
    "mio": "MIO queue throttle",
    "dispatch": "dispatch stall",
    "gmma": "wgmma (tensor pipe)",
    "barrier": "barrier",
    "membar": "memory barrier",
    "sleeping": "sleeping (nanosleep, try-wait)",
    "lg": "local / global queue throttle",
    "tex": "texture queue throttle",
    "drain": "drain (stores at exit)",
    "branch_resolving": "branch resolving",
    "no_inst": "no instruction fetched",
    "imc": "instruction cache miss",
    "misc": "miscellaneous",
}
SCHEDULE_SENSITIVE = frozenset({"wait", "short_sb", "long_sb", "math", "mio", "dispatch", "gmma", "barrier"})
ISSUED = frozenset({"selected", "not_selected"})  # samples in a cycle the scheduler issued in
_REASON_ALIASES = {"sleep": "sleeping", "imc_miss": "imc", "no_instruction": "no_inst"}


def stall_samples(listing: str, kernel: Kernel) -> tuple[int, ...]:
    """Per instruction of `kernel`, the PC samples the listing's sections of this kernel attribute to it
    (sections under this kernel's name, or unnamed ones; a same-named section of another build is
    skipped as long as one section matches)."""
    return tuple(row["count"] for row in _per_instruction(listing, kernel))


def stall_reasons(listing: str, kernel: Kernel) -> tuple[dict[str, int], ...]:
    """Per instruction of `kernel`, its PC samples by stall reason (REASONS' names; a reason this
    module does not know keeps the listing's name), from the listing's `stall_*` columns; SipError
    when it has none (an ncu that was not asked for them: sip_tune.probe asks)."""
    rows = _per_instruction(listing, kernel)
    if not any(row["reasons"] for row in rows) and not _has_reason_columns(listing):
        raise SipError("the listing has no stall_* columns: profile with the SourceCounters section and "
                       "the metric groups smsp__pcsamp_warp_stall_reasons (sip_tune.probe.profile does)")
    return tuple(row["reasons"] for row in rows)


def breakdown(reasons, instructions) -> dict[str, int]:
    """Samples by reason over some instructions (indices into `reasons`), largest first."""
    total: dict[str, int] = {}
    for i in instructions:
        for reason, n in reasons[i].items():
            total[reason] = total.get(reason, 0) + n
    return dict(sorted(((r, n) for r, n in total.items() if n), key=lambda kv: (-kv[1], kv[0])))


def headroom(reasons) -> float:
    """The share of all samples outside issue cycles (not in ISSUED): the most any reordering of the
    kernel's instructions could save (see the module doc); 1.0 without samples."""
    total = breakdown(reasons, range(len(reasons)))
    every = sum(total.values())
    return 1.0 - sum(n for r, n in total.items() if r in ISSUED) / every if every else 1.0


def sensitive_share(reasons) -> float:
    """The share of all samples in SCHEDULE_SENSITIVE reasons, those SIP's moves aim at (see the
    module doc); 0 without samples."""
    total = breakdown(reasons, range(len(reasons)))
    every = sum(total.values())
    return sum(n for r, n in total.items() if r in SCHEDULE_SENSITIVE) / every if every else 0.0


def _per_instruction(listing: str, kernel: Kernel) -> list[dict]:
    """Per instruction: {"count": samples, "reasons": {reason: samples}}, summed over the listing's
    sections of this kernel (see stall_samples)."""
    sections = _sections(listing)
    if not sections:
        raise SipError("not an ncu source listing: no header with Address and Source columns "
                       "(export it with: ncu --import REPORT --page source --print-source sass --csv)")
    ours = [rows for name, rows in sections if _names(name, kernel.name)]
    if not ours:
        raise SipError(f"the listing profiles {sorted({str(n) for n, _ in sections})}, not {kernel.name}")
    total = [{"count": 0, "reasons": {}} for _ in kernel.instructions]
    errors = []
    for rows in ours:
        try:
            mapped = _counts(rows, kernel)
        except SipError as e:
            errors.append(e)
            continue
        for into, row in zip(total, mapped):
            if row is None:
                continue
            into["count"] += row["count"]
            for reason, n in row["reasons"].items():
                into["reasons"][reason] = into["reasons"].get(reason, 0) + n
    if len(errors) == len(ours):
        raise errors[0]
    return total


def _has_reason_columns(listing: str) -> bool:
    return any(_is_header(line) and f'"{STALL_PREFIX}' in line for line in listing.splitlines())


def _reason(column: str) -> str | None:
    """REASONS' name of an all-samples stall column; None for any other column."""
    if not column.startswith(STALL_PREFIX) or column.endswith(NOT_ISSUED):
        return None
    name = column[len(STALL_PREFIX):].strip()
    return _REASON_ALIASES.get(name, name)


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
            reasons = {c: r for c in reader.fieldnames or () if (r := _reason(c))}
            out.append((name, [{"address": r["Address"], "source": r["Source"], "count": r[column],
                                "reasons": {reason: r[c] for c, reason in reasons.items()}} for r in reader]))
            name, k = None, end
            continue
        k += 1
    return out


def _counts(rows: list[dict], kernel: Kernel) -> list[dict | None]:
    """One section's {"count", "reasons"} per instruction (None: not listed), checking that it lists
    this kernel's code."""
    try:
        listed = [(int(r["address"], 16), r["source"].strip(), _count(r["count"]),
                   {reason: n for reason, text in r["reasons"].items() if (n := _count(text))}) for r in rows]
    except (TypeError, ValueError, AttributeError) as e:  # a short row has None fields
        raise SipError(f"unreadable row in the ncu listing: {e}") from None
    if not listed:
        raise SipError("the ncu listing lists no instructions")
    base = min(address for address, _, _, _ in listed)
    out: list[dict | None] = [None] * len(kernel.instructions)
    for address, source, count, reasons in listed:
        index, rest = divmod(address - base, INSTRUCTION_BYTES)
        ins = kernel.instructions[index] if not rest and index < len(kernel.instructions) else None
        if ins is None or _opcode(source) != ins.base:
            raise SipError(f"the listing's instruction at +{address - base:#x} ({source!r}) is not "
                           f"{kernel.name}'s there: it profiles another build of the kernel")
        if out[index] is not None:
            raise SipError(f"the listing lists the instruction at +{address - base:#x} twice")
        out[index] = {"count": count, "reasons": reasons}
    return out


def _count(text: str | None) -> int:
    """A listed count: "1,024" -> 1024; blank or "-" (no value) -> 0."""
    if text is None:
        raise ValueError("a row with fewer fields than its header")
    text = text.strip().replace(",", "")
    return int(float(text)) if text and text != "-" else 0


def _opcode(source: str) -> str:
    """The base mnemonic of a listed instruction: `@!P0 LDG.E.128 R4, desc[UR6][R2.64] ;` -> LDG."""
    words = source.replace(";", " ").split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".", 1)[0] if words else ""
