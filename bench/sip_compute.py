"""SIP level 2 on the compute-bound kernels (issue 40): every kernel x move class, in one resumable command.

    python bench/sip_compute.py --static [--out bench/results]            CPU: movable / legal per class
    python bench/sip_compute.py --state DIR [--minutes 8.5] [--out ...]   GPU: the next steps that fit
        [--kernels A,B] [--classes 'X;Y']    only these cells of DIR's state (the rest wait for a later call)
    python bench/sip_compute.py --state DIR --report [--out ...]          rewrite the results from DIR
    python bench/sip_compute.py --state DIR --prepare                     CPU: DIR's static part, to carry
    python bench/sip_compute.py --store-floors STORE [--kernels A,B]      GPU: each kernel's floor, stored

Kernels: sip_tune.compute.cells() (varlen attention d=64 first, dense attention d=64/128 causal and not,
the GEMM + activation prefill plain and gated, the FP8 GEMM prefill with channel and block scales). Classes (sip.mutate.parse_moves): CLASSES below; a class
with no legal move in a kernel is recorded as such and never sent to the GPU.

A GPU call does, in order, what is left and fits before its deadline (--minutes; keep it under the
lender's 10 minutes per call), and writes DIR/state.json after every step, so the next call resumes
where this one stopped. A step starts only with its estimated time left (PROFILE_SECONDS, ...), runs
under a limit of the time left in the call (time_limit: its child processes go with it), and is marked
attempted in the state before it starts: a step cut short by the limit, or by a kill of the whole
call, is tried again by the next call, and recorded as failed after ATTEMPTS tries, so that a step
longer than a call cannot stall the campaign.

1. profile: per kernel, Nsight Compute's PC samples and stall reasons of the original
   (sip_tune.probe.profile, kept in DIR/profiles and reused by every search of the kernel): its hot
   blocks, their stall breakdown, the share of samples outside issue cycles (sip.profile.headroom:
   the most any schedule change could save; --min-headroom skips the kernels under it) and the
   schedule-sensitive share (what the moves aim at); then the floor: every stall count lowered as far
   as the latency table proves (sip.mutate.lowered), timed against the original and its A/A, checked
   bitwise on 10^5 fresh samples and 8 input sets of the timed shape; a floor past FLOOR_BAR and its
   A/A is then judged as a result of its own, (b) and (c) below, before any search;
2. search: per (kernel, class), sip_tune.tuning.tune runs of at most the time left, each with new
   seeds and proposals weighted by the ncu samples, from the floor for a class that edits stall
   counts (once the floor passed its checks), else from the original, until the cell has had BASE_SECONDS of search or
   BASE_CANDIDATES distinct cubins run (or its last run ended with no new schedule nearby); a run
   keeps its finalists only past 1 + the A/A spread of fresh re-time workers and the class's fresh
   samples (sip_tune.tuning.TuneConfig.validation_samples: 10^4 for `global`, 10^5 for every class
   that moves more), and stores the winner in the cell's own store (store_dir: the store keeps the
   faster entry across the cell's runs, never another class's); then the two cells whose best
   re-timed finalist is furthest past its A/A spread get EXTENDED_SECONDS in all;
3. judge: per cell with a stored winner (its tuned cubin's hash checked against the run's record),
   (a) re-timed in a fresh worker process, interleaved with the original and a byte-identical copy
   of it (the A/A), (b) through the public op (sip_tune.oplevel: CUDA graphs, inputs rotated past L2,
   interleaved with FA4 / cuBLAS, an empty tuned store beside the candidate; the one call site is
   op_level()), (c) compute-sanitizer memcheck, racecheck and synccheck, (d) outputs bitwise equal to
   the original's (the tuner's validation: the test sizes, and the tuned shape once the tuner checks it).

--store-floors puts each selected kernel's floor (no search) into the tuned store STORE through the tuner
itself (sip_tune.tuning.tune from the floor with no iteration: re-timed against the A/A, 10^5 samples and the
timed shape, compute-sanitizer, the public op), so that `rosekernels.warmup(store_root=STORE)` loads it: what
the campaign measured becomes what a user's op runs. A kernel that STORE/floors.json records without an
error is not stored again (a second call goes on with the rest, and tries the failed ones again).

Results: <out>/sip/sip_compute.json and .md, one row per kernel and class: movable instructions, legal moves,
candidates run, best re-timed, A/A, the fresh re-time, the op-level ratio, the sanitizer; per kernel the
stall breakdown of its hot blocks. Columns not measured yet say so.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402  (bench/report.py: environment and result files)
from sip import cfg, cubin as elf, deps, mutate, profile, sass  # noqa: E402
from rosekernels import tuned  # noqa: E402
from sip_tune import compute, oplevel, probe, tuning  # noqa: E402

CLASSES = ("all,scoreboard,sync", "alu,scoreboard,sync", "alu", "control", "shared", "all", "global")
BASE_SECONDS = 300.0
BASE_CANDIDATES = 10_000
EXTENDED_SECONDS = 1200.0
PROMISING = 2  # cells that get EXTENDED_SECONDS
MIN_RUN_SECONDS = 60.0  # a search run shorter than this is not worth its start-up
FINISH_SECONDS = 150.0  # what a run takes past its search budget: re-time workers, 10^4-10^5 samples
PROFILE_SECONDS = 150.0
FLOOR_SECONDS = 150.0
JUDGE_SECONDS = {"retime": 90.0, "op_level": 90.0, "sanitizer": 150.0}  # H200, attention: 16-27 s, 41 s
FLOOR_JUDGE = ("op_level", "sanitizer")  # a floor's own re-time and samples are its floor step
FLOOR_BAR = tuning.TuneConfig.min_speedup  # a floor is judged only past this (a search's winner's bar) and its A/A
SAVE_SECONDS = 20.0  # kept back from a step's limit: the step's processes are stopped and the state written
ATTEMPTS = 2  # a step cut short this many times (time limit, or the call killed) is recorded as failed
NOT_RUN = "not run"  # a GPU column not measured yet


# ---------------------------------------------------------------------------------------------
# CPU: what each class may change in each kernel

def static_row(cubin: bytes, moves: str) -> dict[str, Any]:
    """Movable instructions and legal moves (at the start) of the cubin's main kernel under `moves`."""
    parsed = elf.parse_cubin(cubin)
    kernel = sass.disassemble_kernel(parsed, parsed.main_kernel().name)
    schedule = mutate.initial_schedule(kernel, mutate.parse_moves(moves))
    return {"instructions": len(kernel.instructions), "movable": len(schedule.movable()),
            "legal_moves": len(schedule.moves())}


def loop_rows(cubin: bytes, top: int = 4, least: int = 30) -> list[dict[str, Any]]:
    """Up to `top` loops of the cubin's main kernel with at least `least` instructions (no spin-wait
    loops), deepest first (sip loops): where a pass of the mainloop spends its issue slots."""
    parsed = elf.parse_cubin(cubin)
    kernel = sass.disassemble_kernel(parsed, parsed.main_kernel().name)
    loops = [s for s in cfg.loop_summaries(kernel) if s.instructions >= least][:top]  # deepest first already
    return [{"offset": s.offset, "depth": s.depth, "instructions": s.instructions, "stall_cycles": s.stall_cycles,
             "opcodes": dict(s.opcodes[:6])} for s in loops]


def floor_holds(cubin: bytes) -> dict[str, int]:
    """What keeps the floor's stall counts in the main kernel's loop blocks where they are
    (sip.mutate.floor_holds): the bound the stall counts leave once at their floor."""
    schedule = tuning.engine_floor_schedule(cubin)
    kernel = schedule.model.kernel
    depth = cfg.loop_depth(kernel)
    return mutate.floor_holds(schedule, [x for x in range(len(kernel.instructions)) if depth[kernel.block_of[x]]])


def main_loop(kernel: sass.Kernel) -> tuple[int, list[int]] | None:
    """(header block, its blocks) of the deepest loop that issues wgmma instructions and holds at least
    60 instructions (the largest such at that depth): the mainloop of these kernels."""
    depth = cfg.loop_depth(kernel)
    found = []
    for header, body in cfg.loops(kernel).items():
        members = [i for b in body for i in kernel.blocks[b]]
        if len(members) >= 60 and any(kernel.instructions[i].base in deps.WGMMA for i in members):
            found.append((depth[header], len(members), header, sorted(body)))
    if not found:
        return None
    _, _, header, body = max(found)
    return header, body


def _reason_kind(reason: str | None) -> str:
    """A conflict reason of sip.deps, by kind."""
    if reason is None:
        return "free"
    for prefix, kind in (("RAW", "registers"), ("WAR", "registers"), ("WAW", "registers"),
                         ("memory order", "memory"), ("in-order", "in-order completion"), ("wgmma", "wgmma registers"),
                         ("synchronisation:", "two synchronisations")):
        if reason.startswith(prefix):
            return kind
    if reason.startswith("scoreboard"):
        return "scoreboard set -> wait" if "sets" in reason else "scoreboard guard"
    pinned = re.search(r"pinned: (?:synchronisation|control flow) \((\w+)", reason)
    return f"fence {pinned.group(1)}" if pinned else "pinned"


def mainloop_pairs(cubin: bytes) -> dict[str, Any] | None:
    """Why adjacent instructions of the mainloop may not swap, trusted model vs the relaxations:
    {"offset", "instructions", "pairs", "trusted": {kind: n}, "relaxed": {kind: n}}."""
    parsed = elf.parse_cubin(cubin)
    kernel = sass.disassemble_kernel(parsed, parsed.main_kernel().name)
    loop = main_loop(kernel)
    if loop is None:
        return None
    header, body = loop
    pairs = [(x, y) for b in body for x, y in zip(kernel.blocks[b], kernel.blocks[b][1:])]
    out: dict[str, Any] = {"offset": kernel.instructions[kernel.blocks[header].start].offset,
                           "instructions": sum(len(kernel.blocks[b]) for b in body), "pairs": len(pairs)}
    for label, relax in (("trusted", frozenset()), ("relaxed", frozenset(deps.RELAXATIONS))):
        model = deps.DependencyModel(kernel, relax=relax)
        kinds: dict[str, int] = {}
        for x, y in pairs:
            kind = _reason_kind(model.conflict(x, y))
            kinds[kind] = kinds.get(kind, 0) + 1
        out[label] = dict(sorted(kinds.items(), key=lambda kv: -kv[1]))
    return out


def static_state(cells: dict[str, compute.Cell], classes: tuple[str, ...],
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """The CPU part of the campaign: per kernel its variant, cubin hash and loops; per (kernel, class)
    the movable instructions and legal moves."""
    state: dict[str, Any] = {"kernels": {}, "cells": {}}
    for name, cell in cells.items():
        workload = cell.factory()
        original = workload.kernel.cubin
        state["kernels"][name] = {"about": cell.about, "variant": workload.kernel.variant.key(),
                                  "cubin_sha256": hashlib.sha256(original).hexdigest(),
                                  "loops": loop_rows(original), "floor_loops": loop_rows(tuning.engine_floor(original)),
                                  "floor_holds": floor_holds(original), "mainloop_pairs": mainloop_pairs(original)}
        for moves in classes:
            row = static_row(original, moves)
            state["cells"][cell_key(name, moves)] = {"kernel": name, "moves": moves, "static": row, "runs": []}
            log(f"[sip-compute] {name} {moves}: {row['movable']} movable, {row['legal_moves']} legal moves")
    return state


def cell_key(kernel: str, moves: str) -> str:
    return f"{kernel} | {moves}"


# ---------------------------------------------------------------------------------------------
# What is left to do, in order (pure functions of the state: tested on the CPU)

def searched(cell: dict[str, Any]) -> tuple[float, int, bool]:
    """(search seconds, distinct cubins run, the last run ended with no new schedule nearby) so far."""
    runs = cell["runs"]
    return (sum(r["search_seconds"] for r in runs), sum(r["evaluated"] for r in runs),
            bool(runs) and all(r["exhausted"] for r in runs[-1:]))


def budget(cell: dict[str, Any]) -> float:
    return cell.get("budget_seconds", BASE_SECONDS)


def search_done(cell: dict[str, Any]) -> bool:
    if cell["static"]["legal_moves"] == 0:
        return True
    seconds, evaluated, exhausted = searched(cell)
    if exhausted:
        return True
    if cell.get("budget_seconds", BASE_SECONDS) > BASE_SECONDS:  # extended: time only
        return seconds >= budget(cell)
    return seconds >= budget(cell) or evaluated >= BASE_CANDIDATES


def over_start(run: dict[str, Any]) -> float:
    """The run's best re-timed finalist against the run's start, timed in the same re-times: what the search
    added (a run from the floor also reports its speedup over the original, which holds the floor's gain).
    nan for a run from the floor recorded before the start was re-timed beside its finalists."""
    if "best_over_start" in run:
        return run["best_over_start"]
    return run["best_speedup"] if run.get("start", "original") == "original" else math.nan


def best_margin(cell: dict[str, Any]) -> float:
    """How far the cell's best re-timed finalist got past its start and the run's A/A spread (nan: none
    re-timed)."""
    margins = [over_start(r) - 1 - r["aa_spread"] for r in cell["runs"]
               if math.isfinite(over_start(r)) and math.isfinite(r.get("aa_spread", math.nan))]
    return max(margins, default=math.nan)


def skipped(state: dict[str, Any], kernel: str) -> bool:
    """Whether the kernel's searches are skipped: its share of samples outside issue cycles (ncu;
    sip.profile.headroom, the most any schedule change could save) is under the campaign's
    --min-headroom."""
    share = state.get("profiles", {}).get(kernel, {}).get("headroom", math.inf)
    return share < state.get("meta", {}).get("min_headroom", 0.0)


def extend_promising(state: dict[str, Any], keys: list[str], count: int = PROMISING) -> list[str]:
    """Once every cell of `keys` has had its base search (or is skipped), give the `count` cells of
    `keys` with the largest best margin (ties: the earlier kernel in priority order) EXTENDED_SECONDS;
    their keys (already extended ones count)."""
    cells = {k: state["cells"][k] for k in keys}
    if not all(search_done(c) or skipped(state, c["kernel"]) for c in cells.values()
               if c.get("budget_seconds", BASE_SECONDS) == BASE_SECONDS):
        return []
    extended = [k for k, c in cells.items() if c.get("budget_seconds", BASE_SECONDS) > BASE_SECONDS]
    ranked = sorted((k for k, c in cells.items() if math.isfinite(best_margin(c)) and k not in extended
                     and c["static"]["legal_moves"] and not searched(c)[2]),
                    key=lambda k: -best_margin(cells[k]))
    for key in ranked[:max(count - len(extended), 0)]:
        cells[key]["budget_seconds"] = EXTENDED_SECONDS
        extended.append(key)
    return extended


def selected(state: dict[str, Any], order: list[str], classes: tuple[str, ...] | None = None) -> list[str]:
    """The keys of the state's cells of the kernels `order` names (in that order) and of `classes`
    (None: every class): what this call works on (--kernels, --classes)."""
    return [k for kernel in order for k, c in state["cells"].items()
            if c["kernel"] == kernel and (classes is None or c["moves"] in classes)]


def next_step(state: dict[str, Any], order: list[str], classes: tuple[str, ...] | None = None
              ) -> tuple[str, str] | None:
    """(what, key) to do next among the kernels `order` names and `classes` (selected); None: done.
    First every kernel's profile and floor (where its cycles go, cheaply), in `order` (priority);
    then the judging of each floor that pays (floor_pays: it is a schedule the user can have as it is);
    then the searches, kernel by kernel, except skipped kernels; once every base search is done, the
    promising cells are extended (in the state) and searched on; judging comes last."""
    for kernel in order:
        if kernel not in state.get("profiles", {}):
            return "profile", kernel
        if not floor_done(state.get("floors", {}).get(kernel)):
            return "floor", kernel
    for kernel in order:
        floor = state["floors"][kernel]
        if floor_pays(floor):
            for part in FLOOR_JUDGE:
                if part not in floor.get("judge", {}):
                    return f"floor:{part}", kernel
    keys = selected(state, order, classes)
    for key in keys:
        if not skipped(state, state["cells"][key]["kernel"]) and not search_done(state["cells"][key]):
            return "search", key
    extend_promising(state, keys)
    for key in keys:
        cell = state["cells"][key]
        if cell.get("budget_seconds", BASE_SECONDS) > BASE_SECONDS and not search_done(cell):
            return "search", key
    for key in keys:
        if winner(state["cells"][key]) and not judged_as_floor(state, state["cells"][key]):
            for part in JUDGE_SECONDS:
                if part not in state["cells"][key].get("judge", {}):
                    return part, key
    return None


def winner(cell: dict[str, Any]) -> dict[str, Any] | None:
    """The run whose stored entry is the cell's: the cell's store keeps its fastest, and the last run
    that stored or kept one names it and records the hash of its tuned cubin (run_record)."""
    stored = [r for r in cell["runs"] if r.get("cached")]
    return stored[-1] if stored else None


def judged_as_floor(state: dict[str, Any], cell: dict[str, Any]) -> bool:
    """Whether the cell's stored winner is its kernel's floor itself, which the floor's own steps judge (a floor
    that pays: floor_pays); any other winner, a floor below that bar included, is judged as the cell's."""
    win = winner(cell)
    return bool(win) and bool(win.get("winner_is_start")) and floor_pays(state.get("floors", {}).get(cell["kernel"]))


def store_dir(state_dir: Path, cell: dict[str, Any]) -> Path:
    """The tuned store of one (kernel, class) cell. One store for every class of a kernel would file
    them all under one entry (the kernel's variant and original cubin) and keep the fastest across
    classes, so that one class's winner would be judged as another's."""
    return state_dir / "store" / cell["kernel"] / cell["moves"].replace(",", "+")


def validation_samples(moves: str) -> int:
    """The fresh samples a run of class `moves` validates its finalists on (sip_tune.tuning)."""
    return tuning.TuneConfig(budget_seconds=1.0, moves=moves).validation_samples


# ---------------------------------------------------------------------------------------------
# GPU steps

def run_profile(state: dict[str, Any], kernel: str, cell: compute.Cell, top: int = 3) -> None:
    """ncu of the original: hot blocks, each block's stall reasons, the kernel's share of samples outside
    issue cycles (headroom: the upper bound) and its schedule-sensitive share."""
    workload = cell.factory()
    original = workload.kernel.cubin
    listing = probe.profile(cell.factory, original)
    parsed = elf.parse_cubin(original)
    kern = sass.disassemble_kernel(parsed, parsed.main_kernel().name)
    samples = profile.stall_samples(listing, kern)
    entry: dict[str, Any] = {"samples": sum(samples)}
    try:
        reasons = profile.stall_reasons(listing, kern)
    except Exception as e:  # noqa: BLE001 - an ncu that lists no reasons still gives the hot blocks
        reasons, entry["reasons_error"] = None, str(e)
    depth = cfg.loop_depth(kern)
    blocks = []
    for share, b in profile.hot_blocks(kern, samples)[:top]:
        r = kern.blocks[b]
        blocks.append({"offset": kern.instructions[r.start].offset, "share": share, "instructions": len(r),
                       "loop_depth": depth[b], "stalls": profile.breakdown(reasons, r) if reasons else {}})
    entry["hot_blocks"] = blocks
    if reasons is not None:
        entry["stalls"] = profile.breakdown(reasons, range(len(reasons)))
        entry["headroom"] = profile.headroom(reasons)
        entry["sensitive"] = profile.sensitive_share(reasons)
    state.setdefault("profiles", {})[kernel] = entry


def run_search(state: dict[str, Any], key: str, cell: compute.Cell, seconds: float, state_dir: Path,
               tune: Callable[..., Any] = tuning.tune) -> None:
    """One tune() run of the cell's class: `seconds` of search, seeds new to the cell, the cell's own
    store (store_dir); a class that edits stall counts starts its walks at the floor (on the H200 the
    floor alone gave the attention kernels 1.006-1.037x, which walks from the original never reached)."""
    entry = state["cells"][key]
    seed = 1000 * len(entry["runs"]) + 17
    profiled = "error" not in state.get("profiles", {}).get(entry["kernel"], {})
    start = ("floor" if "control.stall" in mutate.parse_moves(entry["moves"])
             and floor_correct(state.get("floors", {}).get(entry["kernel"])) else "original")
    config = tuning.TuneConfig(budget_seconds=seconds, runs=2, seed=seed, moves=entry["moves"],
                               hot="ncu" if profiled else "loops", start=start,
                               sanitize=False)  # the judge runs compute-sanitizer once, on the winner
    result = tune(cell.factory, config, kernel=cell.name, store_root=str(store_dir(state_dir, entry)))
    entry["runs"].append({**run_record(result, seed), "start": start})


def stored_sha256(result: Any) -> str:
    """The SHA-256 of the tuned cubin in the entry a tune() report names ("" where it stored none)."""
    return hashlib.sha256((Path(result.cached) / "tuned.cubin").read_bytes()).hexdigest() if result.cached else ""


def run_record(result: Any, seed: int) -> dict[str, Any]:
    """What the campaign keeps of a tune() report; with an entry in the store (stored by this run, or
    an earlier one the store kept: kept_older), the SHA-256 of its tuned cubin, which the judge checks."""
    best = min(result.finalists, key=lambda f: f["rel"], default=None)
    tuned_sha256 = stored_sha256(result)
    from_start = result.start_sha256 != result.original_sha256
    return {"seed": seed, "search_seconds": result.search_seconds, "total_seconds": result.total_seconds,
            "iterations": result.iterations, "evaluated": result.evaluated, "incorrect": result.incorrect,
            "crashed": result.crashed, "exhausted": bool(result.runs) and all(r["exhausted"] for r in result.runs),
            "best_speedup": 1 / best["rel"] if best else math.nan, "best_validation": best.get("validation", "")
            if best else "", "aa_spread": result.aa_spread, "bar": result.bar, "speedup": result.speedup,
            "samples_passed": result.samples_passed, "cached": result.cached, "tuned_sha256": tuned_sha256,
            "kept_older": bool(tuned_sha256) and tuned_sha256 not in {f["digest"] for f in result.finalists},
            "start_speedup": result.start_speedup, "best_over_start": best["over_start"] if best else math.nan,
            "winner_is_start": from_start and bool(tuned_sha256) and tuned_sha256 == result.start_sha256,
            "outcome": result.outcome, "gpu": result.gpu}


def retime_fresh(factory: Callable[[], Any], original: bytes, tuned: bytes, repeats: int = 5, reps: int = 60,
                 samples: int = 0, shape_samples: int = 0) -> dict[str, Any]:
    """(a) In a fresh worker: the original, a byte-identical copy of it and the tuned cubin, interleaved;
    per run the copy's and the tuned one's time relative to the original; medians over `repeats` runs;
    with `samples`, the tuned cubin then checked against the original on `shape_samples` input sets of
    the timed shape and that many fresh random samples of the test sizes (bitwise)."""
    from sip_tune.runner import Runner

    copies, tuned_rel = [], []
    with Runner(factory) as runner:
        runner.start()
        for _ in range(repeats):
            t = runner.compare([bytes(original), tuned], reps)
            copies.append(t["rel"][1])
            tuned_rel.append(t["rel"][2])
        checked = runner.validate(tuned, 0x5A17, samples, shape_samples) if samples else None
    out = {"speedup": 1 / statistics.median(tuned_rel), "aa_spread": max(abs(1 - r) for r in copies),
           "runs": [1 / r for r in tuned_rel]}
    if checked is not None:
        out["validation"] = (f"{checked['status']}: {checked['passed']} of {samples} samples, "
                             f"{checked['shape_passed']} of {shape_samples} at the timed shape")
    return out


def run_floor(state: dict[str, Any], kernel: str, cell: compute.Cell, samples: int | None = None,
              shape_samples: int = 8) -> None:
    """The original with every stall count lowered as far as the latency table proves (sip floor): its
    loops' stall sums, then re-timed in a fresh worker against the A/A and checked on fresh samples.
    A static saving that does not show in time says the loop waits on something else than stall
    counts (a pipe's throughput, the tensor core, a barrier)."""
    original = cell.factory().kernel.cubin
    floor = tuning.engine_floor(original)
    samples = validation_samples("control") if samples is None else samples  # what a control.stall edit needs
    state.setdefault("floors", {})[kernel] = {
        **retime_fresh(cell.factory, original, floor, samples=samples, shape_samples=shape_samples),
        "floor_sha256": hashlib.sha256(floor).hexdigest()}


def floor_done(floor: dict[str, Any] | None) -> bool:
    """Whether the kernel's floor step has its record: an error, or a timing with the floor's hash (a
    record without it predates the timed-shape check and the 10^5 samples, and is made again)."""
    return floor is not None and ("error" in floor or "floor_sha256" in floor)


def floor_correct(floor: dict[str, Any] | None) -> bool:
    """Whether the floor passed every check it has had: its samples, and the sanitizer once judged."""
    return (floor is not None and "error" not in floor and floor.get("validation", "").startswith("ok")
            and all(v == "clean" for v in floor.get("judge", {}).get("sanitizer", {}).values()))


def floor_pays(floor: dict[str, Any] | None) -> bool:
    """Whether a kernel's floor is a schedule worth judging as a result of its own: it passed its samples
    and re-timed past FLOOR_BAR and its A/A spread."""
    return floor_correct(floor) and floor["speedup"] > max(FLOOR_BAR, 1 + floor["aa_spread"])


def run_floor_judge(state: dict[str, Any], part: str, kernel: str, cell: compute.Cell) -> None:
    """(b) or (c) of the judge on the kernel's floor cubin (its (a) and (d) are the floor step's)."""
    workload = cell.factory()
    original = workload.kernel.cubin
    floor = tuning.engine_floor(original)
    entry = state["floors"][kernel]
    if entry["floor_sha256"] != hashlib.sha256(floor).hexdigest():
        raise RuntimeError("the floor differs from the one re-timed (another engine or latency table): not judged")
    result = (op_level(cell, workload.kernel.variant, original, floor) if part == "op_level"
              else probe.sanitize(cell.factory, floor))
    entry.setdefault("judge", {})[part] = result


def op_level(cell: compute.Cell, variant: Any, original: bytes, tuned: bytes) -> dict[str, Any]:
    """(b) The public op with and without the tuned cubin, through sip_tune.oplevel, beside an empty
    tuned store: the op runs the config the campaign tuned, whatever the user's store holds."""
    with tempfile.TemporaryDirectory(prefix="sip-compute-empty-store-") as empty:
        timing = oplevel.retime(cell.op, cell.shape, oplevel.CubinCandidate(variant, original, tuned),
                                store_root=empty)
    return op_level_record(timing)


def op_level_record(timing: Any) -> dict[str, Any]:
    """What the campaign keeps of an oplevel.OpTiming: the op-level ratio (original op time / tuned op
    time), its A/A spread, the fastest peer and the tuned op's ratio to it, or the error."""
    if getattr(timing, "error", ""):
        return {"error": timing.error}
    return {"speedup": timing.speedup, "aa_spread": timing.aa_spread, "past_aa": timing.speedup > 1 + timing.aa_spread,
            "peer": timing.peer, "vs_peer": timing.vs_peer, "op": timing.op,
            "heuristic_us": timing.heuristic_us, "tuned_us": timing.tuned_us}


def run_judge(state: dict[str, Any], part: str, key: str, cell: compute.Cell) -> None:
    entry = state["cells"][key]
    win = winner(entry)
    tuned = (Path(win["cached"]) / "tuned.cubin").read_bytes()
    if hashlib.sha256(tuned).hexdigest() != win.get("tuned_sha256"):
        raise RuntimeError(f"the entry at {win['cached']} no longer holds the tuned cubin its run recorded "
                           f"({win.get('tuned_sha256') or 'none'}): not judged")
    workload = cell.factory()
    original = workload.kernel.cubin
    if part == "retime":
        result = retime_fresh(cell.factory, original, tuned)
    elif part == "op_level":
        result = op_level(cell, workload.kernel.variant, original, tuned)
    else:
        result = probe.sanitize(cell.factory, tuned)
    entry.setdefault("judge", {})[part] = result


# ---------------------------------------------------------------------------------------------
# The results

def rows(state: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key, c in state["cells"].items():
        seconds, evaluated, exhausted = searched(c)
        judge, win = c.get("judge", {}), winner(c)
        best_run = max((r for r in c["runs"] if math.isfinite(r["best_speedup"])), key=lambda r: r["best_speedup"],
                       default=None)
        best = best_run["best_speedup"] if best_run else math.nan
        aa = best_run["aa_spread"] if best_run else math.nan
        from_floor = best_run is not None and best_run.get("start") == "floor"
        out.append({"kernel": c["kernel"], "moves": c["moves"], **c["static"],
                    "search_seconds": seconds if c["runs"] else None, "candidates": evaluated if c["runs"] else None,
                    "runs": len(c["runs"]), "exhausted": exhausted, "budget_seconds": budget(c),
                    "best_retimed": best if c["runs"] else None, "aa_spread": aa if c["runs"] else None,
                    "over_start": over_start(best_run) if from_floor else "from the original" if best_run else None,
                    "stored": bool(win), "fresh_retime": judge.get("retime"), "op_level": judge.get("op_level"),
                    "sanitizer": judge.get("sanitizer"),
                    "status": status(c, state)})
    return out


def status(cell: dict[str, Any], state: dict[str, Any]) -> str:
    if cell["static"]["legal_moves"] == 0:
        return "no legal move: nothing to search"
    if not cell["runs"] and skipped(state, cell["kernel"]):
        return (f"skipped: samples outside issue cycles {state['profiles'][cell['kernel']]['headroom']:.2%} < "
                f"{state['meta']['min_headroom']:.2%}")
    if not cell["runs"]:
        return NOT_RUN
    if not search_done(cell):
        return "searching"
    if not winner(cell):
        return f"searched: no finalist past 1 + A/A and {validation_samples(cell['moves'])} samples"
    if judged_as_floor(state, cell):
        return "stored the floor itself: no gain over it (judged in the floor table)"
    judge = cell.get("judge", {})
    return "judged" if all(p in judge for p in JUDGE_SECONDS) else "stored, judging"


def markdown(state: dict[str, Any]) -> str:
    meta = state.get("meta", {})
    lines = [f"# SIP level 2 on the compute-bound kernels ({meta.get('gpu', 'no GPU run yet')})", "",
             "`python bench/sip_compute.py` (issue 40). Per kernel and move class: instructions the class may move "
             "or edit and the legal changes at the start (CPU); then, on the GPU, distinct cubins run in the search, "
             "the best finalist re-timed in fresh workers against the A/A spread of the same runs, and the winner "
             "judged: re-timed in a fresh process (a), through the public op (b), under compute-sanitizer (c). "
             f"Base budget {BASE_SECONDS / 60:.0f} min of search or {BASE_CANDIDATES} cubins per cell, "
             f"{EXTENDED_SECONDS / 60:.0f} min for the {PROMISING} most promising cells. Relaxations `scoreboard` and "
             "`sync` are untrusted (sip.mutate.UNTRUSTED): their winners are validated on 10^5 samples. "
             f"\"{NOT_RUN}\": not yet measured on a GPU.", "",
             "Best re-timed: against the original, so a run from the floor includes the floor's gain; over the "
             "floor: the same finalist against the floor, timed in the same re-times (runs from the floor only).", "",
             "| kernel | moves | movable | legal moves | cubins run | search s | best re-timed | over the floor | A/A "
             "| fresh re-time (a) | op level (b) | sanitizer (c) | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows(state):
        lines.append(" | ".join([
            f"| {r['kernel']}", f"`{r['moves']}`", str(r["movable"]), str(r["legal_moves"]), _n(r["candidates"]),
            _n(r["search_seconds"], "{:.0f}"), _n(r["best_retimed"], "{:.4f}x"),
            r["over_start"] if isinstance(r["over_start"], str) else _n(r["over_start"], "{:.4f}x"),
            _n(r["aa_spread"], "{:.2%}"),
            _judged(r["fresh_retime"], lambda j: f"{j['speedup']:.4f}x (A/A {j['aa_spread']:.2%})"),
            _judged(r["op_level"], _op_text), _judged(r["sanitizer"], _sanitizer_text),
            r["status"]]) + " |")
    lines += ["", "The floor of each kernel: every stall count of its main kernel lowered as far as the measured latency "
              "table proves (`sip floor`, no search), re-timed in a fresh worker against the A/A pair (a), checked "
              "bitwise against the original on fresh samples of the test sizes and, where the column says so, on input "
              "sets of the timed shape (d), and where it re-timed past "
              f"{FLOOR_BAR}x and its A/A, through the public op (b) and under compute-sanitizer (c):", "",
              "| kernel | re-timed (a) | A/A | samples (d) | op level (b) | sanitizer (c) |", "|---|---|---|---|---|---|"]
    for name in state["kernels"]:
        floor = state.get("floors", {}).get(name)
        if floor is None or "error" in floor:
            lines.append(f"| {name} | {floor['error'] if floor else NOT_RUN} | | | | |")
            continue
        judge = floor.get("judge", {})
        pending = (NOT_RUN if floor_pays(floor) else "not judged: under the bar" if floor_correct(floor)
                   else "not judged: failed a check")
        lines.append(" | ".join([
            f"| {name}", f"{floor['speedup']:.4f}x", f"{floor['aa_spread']:.2%}", floor.get("validation", ""),
            _judged(judge.get("op_level"), _op_text) if "op_level" in judge else pending,
            _judged(judge.get("sanitizer"), _sanitizer_text) if "sanitizer" in judge else pending]) + " |")
    lines += ["", "Per kernel: its largest loops (static stall cycles per pass, `sip loops`); the stall counts at their "
              "floor (`sip floor`: every stall count lowered as far as the measured latency table proves, timed "
              "against the original); what holds the floor's stall counts in the loop blocks "
              "(sip.mutate.floor_holds: a latency pair the table proves, or its horizon where it has none; an anchor, "
              "HGMMA or an mbarrier op "
              "whose register effects the model cannot see; the start or end of a block, for producers and "
              "consumers in other blocks; a pinned instruction, whose control bits never change); the stall reasons "
              "of its hot blocks (ncu PC samples of the original; "
              "outside issue cycles: the share of samples in which the warp neither issued nor lost the issue "
              "slot to another warp, the most any schedule change could save; schedule-sensitive: the share in "
              f"{', '.join(sorted(profile.SCHEDULE_SENSITIVE))}, the stalls the moves aim at):"]
    for name, k in state["kernels"].items():
        p = state.get("profiles", {}).get(name)
        loops = "; ".join(f"loop {lp['offset']:#06x}: {lp['instructions']} instructions, {lp['stall_cycles']} stall "
                          "cycles" for lp in k["loops"])
        lines.append(f"- {name} ({k['about']}): {loops}")
        pairs = k.get("mainloop_pairs")
        if pairs:
            kinds = sorted(set(pairs["trusted"]) | set(pairs["relaxed"]),
                           key=lambda x: (-pairs["trusted"].get(x, 0), x))  # ties by name: the same text every run
            lines.append(f"  - mainloop {pairs['offset']:#06x}, {pairs['pairs']} adjacent pairs, trusted -> relaxed "
                         "(scoreboard, sync): " + ", ".join(
                             f"{kind} {pairs['trusted'].get(kind, 0)} -> {pairs['relaxed'].get(kind, 0)}" for kind in kinds))
        lines.append(f"  - floor: {floor_text(state.get('floors', {}).get(name), k)}")
        if k.get("floor_holds"):
            held = k["floor_holds"]
            lines.append("  - at the floor, the loop blocks' stall cycles above one per instruction are held by: "
                         + ", ".join(f"{kind} {held[kind]}" for kind in mutate.HOLDS if kind != "above the floor"))
        if p is None:
            lines.append(f"  - ncu: {NOT_RUN} yet")
            continue
        if "error" in p:
            lines.append(f"  - ncu: error: {p['error']}")
            continue
        head = (f"{p['headroom']:.1%} of them outside issue cycles, {p['sensitive']:.1%} schedule-sensitive"
                if "headroom" in p else p.get("reasons_error", ""))
        lines.append(f"  - ncu: {p['samples']} samples, {head}")
        for b in p["hot_blocks"]:
            total = sum(b["stalls"].values()) or 1
            top = ", ".join(f"{r} {n / total:.0%}" for r, n in list(b["stalls"].items())[:6])
            lines.append(f"  - block {b['offset']:#06x} ({b['instructions']} instructions, loop depth "
                         f"{b['loop_depth']}): {b['share']:.0%} of the samples; {top or 'no reasons listed'}")
    return "\n".join(lines) + "\n"


def floor_text(floor: dict[str, Any] | None, kernel: dict[str, Any]) -> str:
    """A kernel's floor: its largest loops' stall sums before -> after (CPU), then what it timed at."""
    after = {lp["offset"]: lp["stall_cycles"] for lp in kernel.get("floor_loops", [])}
    text = ", ".join(f"loop {lp['offset']:#06x} {lp['stall_cycles']} -> {after[lp['offset']]} stall cycles"
                     for lp in kernel["loops"] if lp["offset"] in after)
    if floor is None:
        return f"{text}; timing {NOT_RUN}"
    if "error" in floor:
        return f"{text}; error: {floor['error']}"
    return (f"{text}; re-timed {floor['speedup']:.4f}x (A/A {floor['aa_spread']:.2%}), "
            f"{floor.get('validation', 'not validated')}")


def _op_text(j: dict[str, Any]) -> str:
    return f"{j['speedup']:.4f}x (A/A {j['aa_spread']:.2%}; {j['peer']} {j['vs_peer']:.3f}x)"


def _sanitizer_text(j: dict[str, Any]) -> str:
    return ", ".join(f"{t} {v if v == 'clean' else 'FAILED'}" for t, v in j.items())


def _n(x: Any, form: str = "{}") -> str:
    return NOT_RUN if x is None else form.format(x)


def _judged(result: Any, text: Callable[[dict], str]) -> str:
    if result is None:
        return NOT_RUN
    return f"error: {result['error']}" if set(result) == {"error"} else text(result)


def write(state: dict[str, Any], out: str) -> None:
    data = {"meta": state.get("meta", {}), "kernels": state["kernels"], "profiles": state.get("profiles", {}),
            "floors": state.get("floors", {}), "rows": rows(state)}
    report.write(out, "sip_compute", data, markdown(state))


# ---------------------------------------------------------------------------------------------
# One call

def save(state: dict[str, Any], path: Path) -> None:
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(state, indent=1, default=str))
    os.replace(partial, path)


def load_or_start(state_dir: Path, cells: dict[str, compute.Cell], classes: tuple[str, ...]) -> dict[str, Any]:
    path = state_dir / "state.json"
    if path.is_file():
        state = json.loads(path.read_text())
        missing = [n for n in cells if n not in state["kernels"]]
        if missing:
            raise SystemExit(f"sip_compute: {path} has no kernels {missing}: start another state directory")
        missing = [f"{m!r}" for m in classes if any(cell_key(n, m) not in state["cells"] for n in cells)]
        if missing:
            raise SystemExit(f"sip_compute: {path} has no cells of the classes {', '.join(missing)}: pass the "
                             "classes the state was started with (--classes), or start another state directory")
        return state
    state_dir.mkdir(parents=True, exist_ok=True)
    state = static_state(cells, classes)
    save(state, path)
    return state


def campaign(state_dir: Path, deadline: float, cells: dict[str, compute.Cell], classes: tuple[str, ...],
             min_headroom: float = 0.0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Do the next steps that fit before `deadline` (time.monotonic()); the state, saved after each.
    Kernels whose share of samples outside issue cycles is under `min_headroom` are not searched."""
    previous = os.environ.get(probe.PROFILE_CACHE_ENV)
    os.environ[probe.PROFILE_CACHE_ENV] = str(state_dir / "profiles")  # every tune() of a kernel reuses its listing
    try:
        return _steps(state_dir, deadline, cells, classes, min_headroom, log)
    finally:
        if previous is None:
            os.environ.pop(probe.PROFILE_CACHE_ENV, None)
        else:
            os.environ[probe.PROFILE_CACHE_ENV] = previous


class StepTimeout(BaseException):
    """A step ran past the time left in the call. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way up takes it for the step's own failure."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise StepTimeout in this (the main) thread after `seconds`. The processes a step starts go with
    it: sip_tune.probe.run_isolated kills its process group when interrupted, the tuner's Runner its
    worker on leaving."""
    def expire(signum: int, frame: Any) -> None:
        raise StepTimeout(f"ran past the {seconds:.0f} s left in the call")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def step_seconds(what: str) -> float:
    """The time a step is estimated to need: it starts only with that much left in the call."""
    if what == "search":
        return MIN_RUN_SECONDS + FINISH_SECONDS
    return {"profile": PROFILE_SECONDS, "floor": FLOOR_SECONDS, **JUDGE_SECONDS}[what.removeprefix("floor:")]


def _steps(state_dir: Path, deadline: float, cells: dict[str, compute.Cell], classes: tuple[str, ...],
           min_headroom: float, log: Callable[[str], None]) -> dict[str, Any]:
    state = load_or_start(state_dir, cells, classes)
    path = state_dir / "state.json"
    state.setdefault("meta", {}).update({k: v for k, v in report.environment().items() if k in ("gpu", "toolchain")})
    state["meta"]["min_headroom"] = min_headroom
    attempts = state.setdefault("attempts", {})  # "what key": tries begun and not ended (a kill ends none)
    while True:
        step = next_step(state, list(cells), classes)
        if step is None:
            log("[sip-compute] every step is done")
            break
        what, key = step
        tag = f"{what} {key}"
        if attempts.get(tag, 0) >= ATTEMPTS:
            record_failure(state, what, key, f"cut short {attempts.pop(tag)} times (by the time left in a call, or "
                           "a kill of the call): longer than a call")
            save(state, path)
            continue
        left = deadline - time.monotonic() - SAVE_SECONDS
        if left < step_seconds(what):
            log(f"[sip-compute] {tag} needs ~{step_seconds(what):.0f} s, {left:.0f} s left: next call")
            break
        attempts[tag] = attempts.get(tag, 0) + 1
        save(state, path)  # before the step: a call killed during it leaves the try counted
        log(f"[sip-compute] {tag} (try {attempts[tag]} of {ATTEMPTS}, at most {left:.0f} s)")
        t0 = time.monotonic()
        cell = cells[key] if what.startswith(("profile", "floor")) else cells[state["cells"][key]["kernel"]]
        try:
            with time_limit(left):
                if what == "profile":
                    run_profile(state, key, cell)
                elif what == "floor":
                    run_floor(state, key, cell)
                elif what.startswith("floor:"):
                    run_floor_judge(state, what.removeprefix("floor:"), key, cell)
                elif what == "search":
                    remaining = budget(state["cells"][key]) - searched(state["cells"][key])[0]
                    run_search(state, key, cell, max(MIN_RUN_SECONDS, min(remaining, left - FINISH_SECONDS)),
                               state_dir)
                else:
                    run_judge(state, what, key, cell)
            del attempts[tag]
        except StepTimeout as e:  # the try stays counted: the next call, with its whole time, tries again
            log(f"[sip-compute] {tag}: {e}")
        except Exception as e:  # noqa: BLE001 - recorded; the next call goes on with the other steps
            traceback.print_exc()
            del attempts[tag]
            record_failure(state, what, key, f"{type(e).__name__}: {e}"[:500])
        state["meta"]["date"] = datetime.datetime.now().isoformat(timespec="seconds")
        save(state, path)
        log(f"[sip-compute] {tag}: {time.monotonic() - t0:.0f} s")
    return state


def record_failure(state: dict[str, Any], what: str, key: str, error: str) -> None:
    """A step that raised or was cut short ATTEMPTS times: a profile records the error (the kernel's
    searches then place proposals by loop depth), so does a floor; a search records a run of no time
    with the error (the third in a row ends the cell); a judge part records it as its result."""
    if what == "profile":
        state.setdefault("profiles", {})[key] = {"samples": 0, "hot_blocks": [], "error": error}
    elif what == "floor":
        state.setdefault("floors", {})[key] = {"error": error}
    elif what.startswith("floor:"):
        state["floors"][key].setdefault("judge", {})[what.removeprefix("floor:")] = {"error": error}
    elif what == "search":
        runs = state["cells"][key]["runs"]
        runs.append({"seed": None, "search_seconds": 0.0, "total_seconds": 0.0, "iterations": 0, "evaluated": 0,
                     "incorrect": 0, "crashed": 0, "exhausted": sum(1 for r in runs[-2:] if r.get("error")) == 2,
                     "best_speedup": math.nan, "aa_spread": math.nan, "cached": "", "outcome": "", "error": error})
    else:
        state["cells"][key].setdefault("judge", {})[what] = {"error": error}


STORE_FLOOR_SECONDS = 240.0  # one kernel's floor through the tuner: worker, re-times, 10^5 samples, sanitizer, op


def store_floors(cells: dict[str, compute.Cell], root: Path, deadline: float = math.inf,
                 tune: Callable[..., Any] = tuning.tune, clock: Callable[[], float] = time.monotonic
                 ) -> dict[str, Any]:
    """Each cell's floor through the tuner's checks into the tuned store at `root` (the module doc), one
    record per kernel in root/floors.json, written after each: a floor under FLOOR_BAR and its A/A, failing a
    check or not holding through the public op is not stored, and its record says why. A kernel recorded
    without an error is not done again; one that failed is tried again; none starts with less than
    STORE_FLOOR_SECONDS before `deadline`."""
    path = root / "floors.json"
    done = json.loads(path.read_text()) if path.exists() else {}
    for name, cell in cells.items():
        if name in done and "error" not in done[name]:
            continue
        if deadline - clock() < STORE_FLOOR_SECONDS:
            break
        config = tuning.TuneConfig(budget_iters=0, runs=1, moves="control", start="floor", min_speedup=FLOOR_BAR)
        try:
            result = tune(cell.factory, config, kernel=cell.op, shape=cell.shape, store_root=str(root))
        except Exception as e:  # noqa: BLE001 - one kernel's failure is its record, the others go on
            done[name] = {"error": f"{type(e).__name__}: {e}"}
        else:
            tuned_sha256 = stored_sha256(result)
            meta_path = Path(result.cached) / "meta.json"
            meta = json.loads(meta_path.read_text()) if result.cached and meta_path.exists() else {}
            done[name] = {"outcome": result.outcome, "cached": result.cached, "speedup": result.speedup,
                          "aa_spread": result.aa_spread, "floor_sha256": result.start_sha256,
                          # the entry the store holds is this floor (not an older one it kept), and meets the bar
                          # that ops and warmup load by (rosekernels.tuned.bar_problems)
                          "stored_the_floor": bool(tuned_sha256) and tuned_sha256 == result.start_sha256,
                          "below_the_bar": tuned.bar_problems(meta, "cubin") if meta else None,
                          "validation": [f.get("validation", "") for f in result.finalists],
                          "op_level": result.op_level, "gpu": result.gpu}
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(done, indent=1) + "\n")
        os.replace(tmp, path)  # a call killed mid-write leaves the last whole record
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    report.add_out(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--static", action="store_true", help="CPU only: movable / legal per kernel and class")
    what.add_argument("--state", type=Path, help="the campaign's directory (state.json, profiles, store)")
    what.add_argument("--store-floors", type=Path, metavar="STORE",
                      help="GPU: store each selected kernel's floor in the tuned store STORE, with the tuner's checks")
    p.add_argument("--report", action="store_true", help="with --state: rewrite the results, run nothing")
    p.add_argument("--prepare", action="store_true", help="with --state: write its static part (CPU; minutes on a "
                   "busy GPU host, and a CPU host with the same CuTeDSL build compiles the same cubins), run nothing")
    p.add_argument("--minutes", type=float, default=8.5, help="this call's time (default 8.5)")
    p.add_argument("--kernels", default="", help="comma list of sip_tune.compute.cells() names (default: all, in "
                   "their priority order)")
    p.add_argument("--classes", default=";".join(CLASSES), help="move classes separated by ';'")
    p.add_argument("--min-headroom", type=float, default=0.0, metavar="SHARE",
                   help="search no kernel whose share of ncu samples outside issue cycles (the most any schedule "
                   "change could save) is under SHARE (e.g. the "
                   "A/A spread, 0.005: no schedule change could show); default 0: search every kernel")
    args = p.parse_args()
    cells = compute.cells()
    if args.kernels:
        unknown = set(args.kernels.split(",")) - set(cells)
        if unknown:
            p.error(f"unknown kernels {sorted(unknown)}; choose from {', '.join(cells)}")
        cells = {k: cells[k] for k in args.kernels.split(",")}
    classes = tuple(c for c in args.classes.split(";") if c)
    for c in classes:
        mutate.parse_moves(c)  # a bad name fails here, before any work
    if args.static:
        state = static_state(cells, classes)
        state["meta"] = {"gpu": "no GPU run yet", "date": datetime.datetime.now().isoformat(timespec="seconds")}
        write(state, args.out)
        return 0
    if (args.report or args.prepare) and not args.state:
        p.error("--report and --prepare go with --state")
    if args.report:
        write(json.loads((args.state / "state.json").read_text()), args.out)
        return 0
    if args.prepare:
        load_or_start(args.state, cells, classes)
        return 0
    report.require_gpu()
    if args.store_floors:
        deadline = time.monotonic() + args.minutes * 60
        for name, record in store_floors(cells, args.store_floors, deadline).items():
            print(f"{name}: {record.get('error') or record['outcome']}")
        return 0
    deadline = time.monotonic() + args.minutes * 60
    write(campaign(args.state, deadline, cells, classes, args.min_headroom), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
