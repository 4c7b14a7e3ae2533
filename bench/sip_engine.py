"""Speed of the SIP schedule engine on a ~10k-instruction kernel (CPU only).

Targets: parsing + dependency analysis under 2 s; at least 1,000 legal moves applied per second
(each move followed by apply(), i.e. producing the cubin bytes).

    python3 bench/sip_engine.py [--rows 1000] [--moves 3000]

Prints a table and writes bench/results/sip/sip_engine.json and .md. The kernel is
tests/support/corpus/unrolled_stencil.cu built with nvcc -DROWS=<rows> (cached in the temp directory).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sip import sass  # noqa: E402
from sip.cubin import load_cubin  # noqa: E402
from sip.deps import DependencyModel  # noqa: E402
from sip.mutate import IllegalMove, Move, Schedule, apply, movable  # noqa: E402

import report  # noqa: E402  (bench/report.py: where a result lives under bench/results)

SOURCE = ROOT / "tests" / "support" / "corpus" / "unrolled_stencil.cu"
RESULTS = report.RESULTS / report.folder("sip_engine")


def build(rows: int) -> bytes:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    key = hashlib.sha256(SOURCE.read_bytes() + str(rows).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / "sip_bench" / f"unrolled_stencil_{key}.cubin"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([nvcc, "-cubin", "-gencode", "arch=compute_90a,code=sm_90a",
                        f"-DROWS={rows}", str(SOURCE), "-o", str(out)], check=True)
    return out.read_bytes()


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def parse_and_analyse(data: bytes):
    """One cold run: ELF, nvdisasm, decoding, dependency model, initial schedule."""
    sass._JSON_CACHE.clear()
    sass.regs_in.cache_clear()
    steps = {}
    cubin, steps["ELF parse"], _ = timed(lambda: load_cubin(data))
    _, steps["nvdisasm -json (subprocess)"], _ = timed(lambda: sass.nvdisasm_functions(cubin))
    kernels, steps["decode + basic blocks"], _ = timed(lambda: sass.disassemble(cubin))
    kernel = max(kernels.values(), key=lambda k: len(k.instructions))
    model, steps["dependency model"], _ = timed(lambda: DependencyModel(kernel))
    schedule, steps["initial schedule"], _ = timed(lambda: Schedule.initial(model))
    return schedule, steps


def moves_per_second(schedule: Schedule, count: int, seed: int) -> dict:
    """Random legal moves (the SIP policy's candidates), each followed by apply()."""
    rng = random.Random(seed)
    candidates = movable(schedule.model)
    accepted = refused = 0
    size = 0
    start = time.perf_counter()
    while accepted < count:
        move = Move(rng.choice(candidates), rng.choice((-1, 1)))
        try:
            schedule = schedule.moved(move)
        except IllegalMove:
            refused += 1
            continue
        size += len(apply(schedule))
        accepted += 1
    elapsed = time.perf_counter() - start
    assert size == accepted * len(apply(schedule))
    return {"moves": accepted, "refused": refused, "seconds": elapsed,
            "moves_per_second": accepted / elapsed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1000, help="unroll depth (1000: ~10k instructions)")
    ap.add_argument("--moves", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3, help="cold parse runs; the best is reported")
    args = ap.parse_args(argv)

    data = build(args.rows)
    runs = [parse_and_analyse(data) for _ in range(args.repeats)]
    schedule, steps = min(runs, key=lambda r: sum(r[1].values()))
    model = schedule.model
    total = sum(steps.values())
    listing, list_seconds, _ = timed(lambda: schedule.moves())
    rate = moves_per_second(schedule, args.moves, seed=1)

    result = {
        "kernel": model.kernel.name,
        "instructions": len(model.instructions),
        "basic_blocks": len(model.blocks),
        "latency_pairs": sum(len(p) for p in model.incoming),
        "movable": len(movable(model)),
        "legal_moves_now": len(listing),
        "parse_and_deps_seconds": total,
        "parse_and_deps_seconds_without_nvdisasm": total - steps["nvdisasm -json (subprocess)"],
        "steps_seconds": steps,
        "list_legal_moves_seconds": list_seconds,
        "moves_applied": rate,
        "targets": {"parse_and_deps_seconds": 2.0, "moves_per_second": 1000},
        "host": {"python": platform.python_version(), "machine": platform.machine(),
                 "cpus": __import__("os").cpu_count()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sip_engine.json").write_text(json.dumps(result, indent=2) + "\n")
    table = _table(result)
    (RESULTS / "sip_engine.md").write_text("# SIP engine speed\n\n" + table + "\n")
    print(table)
    return 0


def _table(r: dict) -> str:
    rows = [("kernel size", f"{r['instructions']} instructions, {r['basic_blocks']} blocks, "
                            f"{r['latency_pairs']} latency pairs"),
            *((f"  {name}", f"{sec * 1000:.0f} ms") for name, sec in r["steps_seconds"].items()),
            ("parse + dependency analysis", f"{r['parse_and_deps_seconds']:.2f} s "
                                            f"(target < 2 s; {r['parse_and_deps_seconds_without_nvdisasm']:.2f} s "
                                            "without nvdisasm)"),
            ("movable / legal moves now", f"{r['movable']} / {r['legal_moves_now']} "
                                          f"(listed in {r['list_legal_moves_seconds']:.2f} s)"),
            ("legal moves applied per second", f"{r['moves_applied']['moves_per_second']:.0f} "
                                               f"(target >= 1000; {r['moves_applied']['moves']} moves, "
                                               f"{r['moves_applied']['refused']} refused draws)")]
    width = max(len(a) for a, _ in rows)
    lines = [f"| {'measure'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {a.ljust(width)} | {b} |" for a, b in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
