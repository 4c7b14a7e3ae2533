"""The `sip` command: look at a Hopper cubin's schedule and mutate it.

    sip disasm FILE.cubin [--kernel NAME]
    sip inspect FILE.cubin [--moves CLASSES] [--latency-table FILE]
    sip loops FILE.cubin [--kernel NAME] [--opcodes N]
    sip hot FILE.cubin --profile LISTING.csv [--kernel NAME] [--top N]
    sip floor IN.cubin -o OUT.cubin [--kernel NAME] [--latency-table FILE]
    sip mutate IN.cubin -o OUT.cubin [--kernel NAME] --steps N --seed S [--moves CLASSES]
               [--latency-table FILE] [--loop-weight W | --profile LISTING.csv]

FILE.cubin may also be a host object that embeds exactly one cubin (a rosekernels compile-cache
entry's .o): its cubin is read. LISTING.csv is Nsight Compute's PC-sampling listing of the kernel (sip.profile). CLASSES is a comma
list of global, shared, alu, control (or its kinds control.yield, control.reuse, control.stall), or
all; the default is global, the SIP paper's policy (sip.mutate). Exit codes: 0 done, 1 an input SIP
cannot work with, 2 bad arguments (an unknown class, control.stall without a latency table); nothing
is written unless the exit code is 0.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sip import SipError
from sip import profile
from sip.cfg import loop_depth, loop_summaries, loops as cfg_loops
from sip.cubin import EM_CUDA, Cubin, parse_cubin
from sip.deps import RELAXATIONS, DependencyModel
from sip.fatbin import embedded_cubins
from sip.mutate import (DEFAULT_MOVES, HOLDS, LOOP_WEIGHT, Schedule, apply, floor_holds, latencies_for, lowered,
                        parse_moves, random_walk)
from sip.sass import Kernel, disassemble, disassemble_kernel


class _Usage(SipError):
    """Bad arguments: exit code 2."""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except _Usage as e:
        print(f"sip: error: {e}", file=sys.stderr)
        return 2
    except (SipError, OSError) as e:
        print(f"sip: error: {e}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sip", description="SASS schedule engine for sm_90 cubins")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("disasm", help="list instructions with offsets and control codes")
    d.add_argument("cubin", type=Path)
    d.add_argument("--kernel", help="only this kernel (default: all)")
    d.set_defaults(run=_disasm)

    moves_help = ("comma list of move classes: global, shared, alu, control (control.yield, control.reuse, "
                  "control.stall), or all (default: global); the relaxations scoreboard and sync widen the "
                  "move classes named beside them (untrusted: sip.mutate.UNTRUSTED)")
    table_help = ("latency table measured on the GPU (tools/sass_latency.py); control.stall needs one "
                  "(default: bench/results/sip/sass_latency.json.gz when it exists)")
    i = sub.add_parser("inspect", help="per kernel: instructions, blocks, pinned; per class: movable, legal moves")
    i.add_argument("cubin", type=Path)
    i.add_argument("--moves", default=",".join(sorted(DEFAULT_MOVES)), help=moves_help)
    i.add_argument("--latency-table", type=Path, metavar="FILE", help=table_help)
    i.set_defaults(run=_inspect)

    lp = sub.add_parser("loops", help="per kernel, its loops deepest first: size, stall cycles, opcodes")
    lp.add_argument("cubin", type=Path)
    lp.add_argument("--kernel", help="only this kernel (default: all)")
    lp.add_argument("--opcodes", type=int, default=8, metavar="N", help="the N most frequent opcodes (default 8)")
    lp.set_defaults(run=_loops)

    profile_help = ("ncu source listing of this kernel (ncu --import REPORT --page source --print-source sass "
                    "--csv, profiled with --section SourceCounters)")
    h = sub.add_parser("hot", help="basic blocks by PC samples and their stall reasons: where the warps spend their time")
    h.add_argument("cubin", type=Path)
    h.add_argument("--profile", type=Path, required=True, metavar="LISTING.csv", help=profile_help)
    h.add_argument("--kernel", help="kernel the listing profiles (default: the only one, or the largest)")
    h.add_argument("--top", type=int, default=10, metavar="N", help="the N hottest blocks (default 10)")
    h.set_defaults(run=_hot)

    f = sub.add_parser("floor", help="every stall count lowered as far as the latency table proves; loops "
                       "before/after, and what holds the loops' stall cycles left (sip.mutate.floor_holds)")
    f.add_argument("cubin", type=Path)
    f.add_argument("-o", "--output", type=Path, required=True)
    f.add_argument("--kernel", help="kernel to lower (default: the only one, or the largest)")
    f.add_argument("--latency-table", type=Path, metavar="FILE", help=table_help)
    f.set_defaults(run=_floor)

    m = sub.add_parser("mutate", help="apply N random legal changes, reproducibly")
    m.add_argument("cubin", type=Path)
    m.add_argument("-o", "--output", type=Path, required=True)
    m.add_argument("--kernel", help="kernel to mutate (default: the only one, or the largest)")
    m.add_argument("--steps", type=_steps, required=True, help="changes to make (>= 0)")
    m.add_argument("--seed", type=int, required=True)
    m.add_argument("--moves", default=",".join(sorted(DEFAULT_MOVES)), help=moves_help)
    m.add_argument("--latency-table", type=Path, metavar="FILE", help=table_help)
    hot = m.add_mutually_exclusive_group()
    hot.add_argument("--loop-weight", type=float, default=LOOP_WEIGHT, metavar="W",
                     help=f"an instruction at loop depth d is proposed W**d times as often (default "
                     f"{LOOP_WEIGHT:g}; 1: uniform)")
    hot.add_argument("--profile", type=Path, metavar="LISTING.csv",
                     help=profile_help + ": propose changes in proportion to each block's samples")
    m.set_defaults(run=_mutate)
    return p


def _steps(text: str) -> int:
    steps = int(text)
    if steps < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {steps}")
    return steps


def _policy(args) -> tuple[frozenset[str], object]:
    """The classes and latency table the arguments ask for; _Usage when they cannot run."""
    try:
        moves = parse_moves(args.moves)
    except SipError as e:
        raise _Usage(str(e)) from None
    if not moves:
        raise _Usage("--moves names no class")
    if args.latency_table is None and "control.stall" in moves:
        try:
            return moves, latencies_for(moves)
        except SipError as e:
            raise _Usage(str(e)) from None
    return moves, latencies_for(moves, args.latency_table)


def _read_cubin(path: Path) -> Cubin:
    """The cubin at `path`, or the one cubin a host object at `path` embeds (said on stderr)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or len(data) < 20 or int.from_bytes(data[18:20], "little") == EM_CUDA:
        return parse_cubin(data)  # a cubin, or an error that says what the file is
    found = embedded_cubins(data)
    if len(found) != 1:
        what = "no cubin" if not found else f"{len(found)} cubins"
        raise SipError(f"{path} is a host object (ELF machine {int.from_bytes(data[18:20], 'little')}) that embeds "
                       f"{what}: give a cubin (a rosekernels compile-cache entry's: "
                       "rosekernels-cache cubin ENTRY.o -o kernel.cubin)")
    print(f"sip: {path} is a host object: reading the cubin it embeds", file=sys.stderr)
    return parse_cubin(found[0][1])


def _kernels(cubin: Cubin, name: str | None) -> list[Kernel]:
    if name is not None:
        return [disassemble_kernel(cubin, name)]
    return list(disassemble(cubin).values())


def _disasm(args) -> int:
    cubin = _read_cubin(args.cubin)
    for kernel in _kernels(cubin, args.kernel):
        print(f"// {kernel.name} ({cubin.arch}, {len(kernel.instructions)} instructions)")
        starts = {r.start for r in kernel.blocks}
        for ins in kernel.instructions:
            if ins.index in starts:
                print(f"  // block {kernel.block_of[ins.index]}")
            print(f"  /*{ins.offset:04x}*/ {ins.control} {ins.text}")
    return 0


def _loops(args) -> int:
    cubin = _read_cubin(args.cubin)
    for kernel in _kernels(cubin, args.kernel):
        summaries = loop_summaries(kernel)
        print(f"{kernel.name}: {len(summaries)} loop(s)")
        for s in summaries:
            ops = ", ".join(f"{op} {n}" for op, n in s.opcodes[:max(args.opcodes, 0)])
            print(f"  loop at {s.offset:#06x} (block {s.header}), depth {s.depth}: {s.blocks} blocks, "
                  f"{s.instructions} instructions, {s.stall_cycles} stall cycles; {ops}")
    return 0


def _inspect(args) -> int:
    moves, table = _policy(args)
    cubin = _read_cubin(args.cubin)
    print(f"{args.cubin}: {cubin.arch}, {len(cubin.kernel_names)} kernel(s)")
    for kernel in disassemble(cubin).values():
        model = DependencyModel(kernel, table, moves & frozenset(RELAXATIONS))
        schedule = Schedule.initial(model, moves)
        pinned = sum(1 for f in model.facts if f.pin)
        print(f"{kernel.name}: {len(kernel.instructions)} instructions, {len(kernel.blocks)} blocks, "
              f"{pinned} pinned, {len(schedule.movable())} movable, {len(schedule.moves())} legal moves now")
        for kind, xs in schedule.layout.candidates.items():
            print(f"  {kind}: {len(xs)} movable, {len(schedule.moves(kind))} legal moves now")
    return 0


def _main_kernel(args) -> Kernel:
    """--kernel, or the cubin's only (largest) kernel."""
    cubin = _read_cubin(args.cubin)
    if args.kernel is None:
        names = cubin.kernel_names
        if not names:
            raise SipError(f"{args.cubin} has no kernels")
        return disassemble_kernel(cubin, max(names, key=lambda n: cubin.kernel(n).instruction_count))
    return disassemble_kernel(cubin, args.kernel)


def _samples(args, kernel: Kernel) -> tuple[int, ...]:
    return profile.stall_samples(args.profile.read_text(), kernel)


def _hot(args) -> int:
    kernel = _main_kernel(args)
    listing = args.profile.read_text()
    samples = profile.stall_samples(listing, kernel)
    try:
        reasons = profile.stall_reasons(listing, kernel)
    except SipError as e:
        reasons = None
        print(f"(no stall reasons: {e})")
    depth = loop_depth(kernel)
    print(f"{kernel.name}: {sum(samples)} samples over {len(kernel.blocks)} blocks"
          + (f" (fewer than {profile.MIN_SAMPLES}: shares this small say little)" if sum(samples) < profile.MIN_SAMPLES
             else ""))
    if reasons is not None:
        print(f"  outside issue cycles: {profile.headroom(reasons):.1%} of all samples, the most any schedule change "
              f"could save; schedule-sensitive stalls ({', '.join(sorted(profile.SCHEDULE_SENSITIVE))}), what "
              f"SIP's moves aim at: {profile.sensitive_share(reasons):.1%}")
    for share, b in profile.hot_blocks(kernel, samples)[:max(args.top, 0)]:
        r = kernel.blocks[b]
        print(f"  block {b} at {kernel.instructions[r.start].offset:#06x}: {share:6.1%} of the samples, "
              f"{len(r)} instructions, loop depth {depth[b]}")
        if reasons is not None:
            print("    stalls: " + _stall_line(profile.breakdown(reasons, r)))
    return 0


def _stall_line(by_reason: dict[str, int], top: int = 6) -> str:
    """`wait 31%, short_sb 22%, ... (schedule-sensitive 58%)` of one block's samples."""
    total = sum(by_reason.values())
    if not total:
        return "no samples"
    parts = [f"{r} {n / total:.0%}" for r, n in list(by_reason.items())[:top]]
    sensitive = sum(n for r, n in by_reason.items() if r in profile.SCHEDULE_SENSITIVE) / total
    return ", ".join(parts) + f" (schedule-sensitive {sensitive:.0%})"


def _floor(args) -> int:
    args.moves = "control.stall"
    moves, table = _policy(args)
    kernel = _main_kernel(args)
    schedule = lowered(Schedule.initial(DependencyModel(kernel, table), moves))
    args.output.write_bytes(apply(schedule))
    edited = sum(schedule.own[x] != schedule.layout.stall[x] for x in range(len(kernel.instructions)))
    print(f"{kernel.name}: {edited} stall counts lowered -> {args.output}")
    bodies = cfg_loops(kernel)
    for s in loop_summaries(kernel):
        after = sum(schedule.controls[i] & 0xF for b in bodies[s.header] for i in kernel.blocks[b])
        print(f"  loop at {s.offset:#06x} (block {s.header}), depth {s.depth}: {s.stall_cycles} -> {after} stall cycles")
    in_loops = sorted({i for body in bodies.values() for b in body for i in kernel.blocks[b]})
    held = floor_holds(schedule, in_loops)
    print("  in the loops, the stall cycles above one left are held by: "
          + ", ".join(f"{kind} {held[kind]}" for kind in HOLDS if kind != "above the floor"))
    return 0


def _mutate(args) -> int:
    moves, table = _policy(args)
    if not args.loop_weight > 0:
        raise _Usage(f"--loop-weight must be > 0, got {args.loop_weight}")
    kernel = _main_kernel(args)
    name = kernel.name
    weights = profile.block_weights(kernel, _samples(args, kernel)) if args.profile else None
    model = DependencyModel(kernel, table, moves & frozenset(RELAXATIONS))
    initial = Schedule.initial(model, moves, args.loop_weight, weights)
    schedule, changes = random_walk(initial, args.steps, args.seed)
    if args.steps and not changes:
        raise SipError(f"{name} has no legal move (of {len(initial.movable())} movable instructions in "
                       f"{args.moves} none can change); nothing written")
    args.output.write_bytes(apply(schedule))
    print(f"{name}: applied {len(changes)} of {args.steps} moves (seed {args.seed}, {args.moves}) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
