"""The `sip` command: look at a Hopper cubin's schedule and mutate it.

    sip disasm FILE.cubin [--kernel NAME]
    sip inspect FILE.cubin
    sip mutate IN.cubin -o OUT.cubin [--kernel NAME] --steps N --seed S [--include-shared]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sip import SipError
from sip.cubin import Cubin, load_cubin
from sip.deps import DependencyModel
from sip.mutate import Schedule, apply, movable, random_walk
from sip.sass import Kernel, disassemble, disassemble_kernel


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
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

    i = sub.add_parser("inspect", help="per kernel: instructions, blocks, movable, legal moves")
    i.add_argument("cubin", type=Path)
    i.add_argument("--include-shared", action="store_true",
                   help="count LDS/STS/LDSM as movable too")
    i.set_defaults(run=_inspect)

    m = sub.add_parser("mutate", help="apply N random legal moves, reproducibly")
    m.add_argument("cubin", type=Path)
    m.add_argument("-o", "--output", type=Path, required=True)
    m.add_argument("--kernel", help="kernel to mutate (default: the only one, or the largest)")
    m.add_argument("--steps", type=_steps, required=True, help="moves to try (>= 0)")
    m.add_argument("--seed", type=int, required=True)
    m.add_argument("--include-shared", action="store_true",
                   help="also move shared-memory loads and stores (LDS, STS, LDSM)")
    m.set_defaults(run=_mutate)
    return p


def _steps(text: str) -> int:
    steps = int(text)
    if steps < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {steps}")
    return steps


def _kernels(cubin: Cubin, name: str | None) -> list[Kernel]:
    if name is not None:
        return [disassemble_kernel(cubin, name)]
    return list(disassemble(cubin).values())


def _disasm(args) -> int:
    cubin = load_cubin(args.cubin)
    for kernel in _kernels(cubin, args.kernel):
        print(f"// {kernel.name} ({cubin.arch}, {len(kernel.instructions)} instructions)")
        starts = {r.start for r in kernel.blocks}
        for ins in kernel.instructions:
            if ins.index in starts:
                print(f"  // block {kernel.block_of[ins.index]}")
            print(f"  /*{ins.offset:04x}*/ {ins.control} {ins.text}")
    return 0


def _inspect(args) -> int:
    cubin = load_cubin(args.cubin)
    print(f"{args.cubin}: {cubin.arch}, {len(cubin.kernel_names)} kernel(s)")
    for kernel in disassemble(cubin).values():
        model = DependencyModel(kernel)
        schedule = Schedule.initial(model)
        pinned = sum(1 for f in model.facts if f.pin)
        print(f"{kernel.name}: {len(kernel.instructions)} instructions, {len(kernel.blocks)} blocks, "
              f"{pinned} pinned, {len(movable(model, args.include_shared))} movable, "
              f"{len(schedule.moves(args.include_shared))} legal moves now")
    return 0


def _mutate(args) -> int:
    cubin = load_cubin(args.cubin)
    if args.kernel is None:
        names = cubin.kernel_names
        name = max(names, key=lambda n: cubin.kernel(n).instruction_count) if names else None
        if name is None:
            raise SipError(f"{args.cubin} has no kernels")
    else:
        name = args.kernel
    model = DependencyModel(disassemble_kernel(cubin, name))
    initial = Schedule.initial(model)
    if args.steps and not initial.moves(args.include_shared):
        raise SipError(f"{name} has no legal move (of {len(movable(model, args.include_shared))} movable "
                       "instructions none can swap with a neighbour); nothing written")
    schedule, moves = random_walk(initial, args.steps, args.seed, args.include_shared)
    args.output.write_bytes(apply(schedule))
    print(f"{name}: applied {len(moves)} of {args.steps} moves (seed {args.seed}) -> {args.output}")
    return 0
