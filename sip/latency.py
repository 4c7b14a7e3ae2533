"""Fixed-latency distances measured on the GPU: the table that lets SIP lower stall counts.

A fixed-latency instruction (no scoreboard) has no hardware interlock: the consumer of its result
must issue at least its latency later, and ptxas writes that distance into stall counts. SIP only
lowers a stall below what ptxas wrote where a table measured on the target GPU proves the shorter
distance safe. `tools/sass_latency.py` measures it on an H200: for each (producer class, consumer
class, register file) it builds a dependent chain, rewrites the producer's stall count to every
value from ptxas' down to 1, runs each variant, and records the smallest distance at which every
run still computed the original result while the chain's clock64 timing showed no hidden extra
cycles (which could mask a stale read). The table it writes (JSON, `FORMAT`) is an input of the
dependency model (`sip.deps.DependencyModel(kernel, latencies=...)`); `DEFAULT_PATH` is where the
repository keeps the measured one.

Classes (`opclass`): the opcode without its type, rounding and saturation modifiers, except the
modifiers that select another pipe or shape: IMAD.WIDE and IMAD.HI, HFMA2.MMA, and MMA shapes with
their data types (HMMA.16816.F32.BF16); a predicated instruction is a class of its own (`IMAD@`:
ptxas gives a predicated write more cycles). A consumer reads through a register file: `R`, `UR`,
`P`, `UP`, or a guard predicate (`@P`, `@UP`: `@P0 FADD ...`).
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from sip import SipError
from sip.sass import P_BASE, UP_BASE, UR_BASE, Instruction

FORMAT = "sip-latency-table/1"
DEFAULT_PATH = Path(__file__).resolve().parents[1] / "bench" / "results" / "sip" / "sass_latency.json.gz"
FILES = ("R", "UR", "P", "UP", "@P", "@UP")

_MMA = frozenset({"HMMA", "IMMA", "BMMA", "DMMA"})
_PIPE_MODIFIERS = {"IMAD": ("WIDE", "HI"), "UIMAD": ("WIDE", "HI"), "HFMA2": ("MMA",), "HADD2": ("MMA",),
                   "HMUL2": ("MMA",)}


def opclass(ins: Instruction) -> str:
    """The latency class of an instruction (see the module doc)."""
    base, mods = ins.base, ins.modifiers
    if base in _MMA:
        name = ".".join((base, *mods))
    else:
        name = ".".join((base, *(m for m in mods if m in _PIPE_MODIFIERS.get(base, ()))))
    return name + "@" if ins.predicate not in ("", "@PT", "@UPT") else name


def register_file(reg: int, guard: bool) -> str:
    """The register file a consumer reads `reg` through (sip.sass register ids)."""
    if reg >= UP_BASE:
        return "@UP" if guard else "UP"
    if reg >= P_BASE:
        return "@P" if guard else "P"
    return "UR" if reg >= UR_BASE else "R"


@dataclass(frozen=True)
class LatencyTable:
    """Proven read-after-write distances in stall cycles, by (producer, consumer, file)."""

    source: str
    pairs: Mapping[tuple[str, str, str], int]
    bounds: Mapping[str, int]  # producer class -> the largest distance measured out of it

    @classmethod
    def of(cls, source: str, pairs: Mapping[tuple[str, str, str], int]) -> LatencyTable:
        bounds: dict[str, int] = {}
        for (producer, _, _), v in pairs.items():
            bounds[producer] = max(v, bounds.get(producer, 0))
        return cls(source, dict(pairs), bounds)

    def raw(self, producer: str, consumer: str, file: str) -> int | None:
        return self.pairs.get((producer, consumer, file))

    def producer_bound(self, producer: str) -> int | None:
        """The largest distance measured out of a producer class: by then its result is written
        (write-after-write) and its operands were read (write-after-read)."""
        return self.bounds.get(producer)


def load(path: str | Path) -> LatencyTable:
    """Read a table written by tools/sass_latency.py (.gz: gzip-compressed); SipError (one line) for
    anything else."""
    path = Path(path)
    try:
        doc = json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())
    except OSError as e:
        raise SipError(f"cannot read the latency table {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise SipError(f"latency table {path} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SipError(f"{path} is not a SIP latency table (expected \"format\": \"{FORMAT}\"; "
                       "tools/sass_latency.py writes one)")
    pairs: dict[tuple[str, str, str], int] = {}
    for k, row in enumerate(doc.get("pairs") or []):
        try:
            key = (str(row["producer"]), str(row["consumer"]), str(row["file"]))
            value = row["latency"]
        except (TypeError, KeyError) as e:
            raise SipError(f"latency table {path}: pair {k} lacks {e}") from None
        if value is None:  # measured but not proven (every stall failed or was masked): no entry
            continue
        if not isinstance(value, int) or not 1 <= value <= 255 or key[2] not in FILES:
            raise SipError(f"latency table {path}: pair {k} {key} has latency {value!r} "
                           f"(need an int in 1..255 and a file in {', '.join(FILES)})")
        pairs[key] = max(value, pairs.get(key, 0))
    if not pairs:
        raise SipError(f"latency table {path} proves no latency (no pair with a latency)")
    return LatencyTable.of(str(path), pairs)
