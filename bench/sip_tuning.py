"""SIP benchmark: for every kernel sip-tune can tune, search, validate, then time untuned vs tuned.

    python bench/sip_tuning.py --out bench/results [--kernels qk_norm,rmsnorm] [--modes decode]
                               [--budget-minutes 1.0] [--runs 2] [--moves "global;alu;all"] [--hot ncu]
                               [--samples N]

Per kernel, mode and move policy (`--moves`: policies separated by ';', each a comma list of classes,
one row each):
- the energy check: the original with every stall count raised to 11 must time slower (proves the
  measurement resolves a schedule difference; the noise floor is the search's A/A pair, below);
- the search (`sip_tune.tuning.tune` over the `--moves` classes), search time, candidates, samples tested;
  its finalists re-timed with an A/A pair (original against a byte-identical copy) in 3 fresh workers:
  a schedule is kept only past 1 + the A/A spread (the table shows the best finalist either way), and
  past 1 + the A/A spread of its op-level re-time (the public op in a fresh process, the tuned cubin
  installed as warmup does: `sip_tune.oplevel`; the row's `op_level`);
- the final word: original and tuned cubin re-timed in a FRESH worker, interleaved, `--repeats`
  independent runs of `--reps` replay pairs each (CUDA graphs of many launches cycling over input
  sets larger than L2); the median of the per-run medians.
Results: sip_tuning.json and sip_tuning.md under --out. Tuned cubins go to a cache under --out
(pass --store-root to tune into the real one).
"""
from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402  (bench/report.py: environment and result files)
from rosekernels.kernels import KERNELS, kernel_module  # noqa: E402
from sip.mutate import with_extra_stalls  # noqa: E402
from sip_tune import tuning, workloads  # noqa: E402
from sip_tune.runner import Runner  # noqa: E402


def energy_check(factory, original: bytes) -> dict:
    with Runner(factory) as runner:
        info = runner.start()
        slow = runner.evaluate(with_extra_stalls(original), seed=2)
    return {"stalled_rel": slow.rel, "stalled_status": slow.status, "worker": info}


def confirm(factory, original: bytes, tuned: bytes, repeats: int, reps: int) -> dict:
    """Independent interleaved runs in a fresh worker: per-launch medians of original and tuned."""
    base, cand, rel = [], [], []
    with Runner(factory) as runner:
        runner.start()
        for _ in range(repeats):
            t = runner.compare([tuned], reps)
            base.append(t["median_us"][0])
            cand.append(t["median_us"][1])
            rel.append(t["rel"][1])
    return {"original_us": statistics.median(base), "tuned_us": statistics.median(cand),
            "speedup": 1 / statistics.median(rel), "runs_speedup": [1 / r for r in rel]}


def bench_one(kernel: str, mode: str, moves: str | None, args: argparse.Namespace, store_root: str,
              energy: dict) -> dict:
    row: dict = {"kernel": kernel, "mode": mode, "moves": moves or "global", "hot": args.hot}
    factory = workloads.factory(kernel, mode)
    workload = factory()
    original = workload.kernel.cubin
    row["variant"] = workload.kernel.variant.key()
    if not energy:  # once per kernel and mode
        energy.update(energy_check(factory, original))
    row.update(energy)
    config = tuning.TuneConfig(budget_seconds=args.budget_minutes * 60, runs=args.runs, samples=args.samples,
                               seed=args.seed, min_speedup=1.0, moves=moves, hot=args.hot)
    # a store per policy: an earlier policy's (faster) entry would otherwise be kept and re-timed as this one's
    result = tuning.tune(factory, config, kernel=kernel, shape=workloads.resolve(kernel, mode)[1],
                         store_root=str(Path(store_root) / (moves or "global")))
    print(result.text(), flush=True)
    row["report"] = result.to_dict()
    row.update(search_s=result.search_seconds, total_s=result.total_seconds, iterations=result.iterations,
               evaluated=result.evaluated, incorrect=result.incorrect, crashed=result.crashed,
               samples_passed=result.samples_passed, outcome=result.outcome, movable=result.movable,
               legal_moves=result.legal_moves, aa_spread=result.aa_spread,
               best_finalist=max((1 / f["rel"] for f in result.finalists), default=math.nan),
               op_level=result.op_level or None,
               hot_blocks=result.hot_blocks,
               cost_per_candidate_s=result.cost_s.get("total", math.nan))
    if result.cached:
        tuned = (Path(result.cached) / "tuned.cubin").read_bytes()
        row.update(confirm(factory, original, tuned, args.repeats, args.reps))
    else:
        row.update(original_us=result.baseline_us, tuned_us=result.baseline_us, speedup=1.0)
    return row


def has_mode(kernel: str, mode: str) -> bool:
    """Whether the kernel has a variant of `mode` (attention: prefill only, attention_decode: decode only)."""
    try:
        kernel_module(kernel).Shape.defaults(mode)
    except ValueError:
        return False
    return True


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# SIP tuning ({meta['gpu']}, {meta['date']})", "",
             f"Search budget {meta['budget_minutes']} min per kernel, mode and move policy, {meta['runs']} runs, "
             f"proposals placed by {meta.get('hot', 'loops')}; winner validated on {meta['samples'] or 'the default'} "
             f"fresh samples; final timing: {meta['repeats']} interleaved runs x {meta['reps']} graph-replay pairs "
             "in a fresh worker (median). Best finalist: the fastest schedule of the search re-timed (median of 3 "
             "fresh workers), kept only past 1 + A/A (the original against a byte-identical copy, same runs).", "",
             "| kernel | mode | moves | movable / legal moves | original us | tuned us | speedup | best finalist | A/A | "
             "search s | iterations | cubins run | incorrect | crashed | s/candidate | samples passed | "
             "stalls check |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['mode']} | {r.get('moves', '')} | error: {r['error']} |"
                         + " |" * 13)
            continue
        lines.append(
            f"| {r['kernel']} | {r['mode']} | {r.get('moves', 'global')} | {r['movable']} / {r['legal_moves']} | "
            f"{r['original_us']:.3f} | "
            f"{r['tuned_us']:.3f} | {r['speedup']:.3f}x | {r['best_finalist']:.4f}x | {r['aa_spread'] * 100:.2f} % | "
            f"{r['search_s']:.0f} | {r['iterations']} | {r['evaluated']} | {r['incorrect']} | {r['crashed']} | "
            f"{r['cost_per_candidate_s']:.3f} | {r['samples_passed']} | {r['stalled_rel']:.3f}x slower |")
    lines += ["", "Outcomes:"] + [f"- {r['kernel']} {r['mode']} ({r.get('moves', 'global')}): "
                                  f"{r.get('outcome', r.get('error'))}" for r in rows]
    hot = [r for r in rows if r.get("hot_blocks")]
    if hot:
        lines += ["", "Hottest blocks of each original (ncu PC samples; proposals were weighted by them):"]
        lines += [f"- {r['kernel']} {r['mode']}: " + ", ".join(
            f"{h['offset']:#06x} ({h['instructions']} instructions, loop depth {h['loop_depth']}) {h['share']:.0%}"
            for h in r["hot_blocks"]) for r in hot if r.get("moves") == hot[0].get("moves")]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    report.add_out(p)
    p.add_argument("--kernels", default="", help="comma-separated (default: every tunable kernel)")
    p.add_argument("--modes", default="decode,prefill")
    p.add_argument("--budget-minutes", type=float, default=1.0, help="search time per kernel and mode")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--samples", type=int, default=0, help="0: the tuner's default for the move classes")
    p.add_argument("--moves", default=None, help="move policies separated by ';', each a comma list of SASS "
                   "classes (sip.mutate; default: global), one row each")
    p.add_argument("--hot", choices=tuning.HOT_SOURCES, default="loops",
                   help="where proposals go: by loop depth, or by ncu's PC samples of the original")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--store-root", "--cache",
                   help="the tuned store (default: <out>/sip-cache); --cache: its former name")
    args = p.parse_args()
    report.require_gpu()
    store_root = args.store_root or str(Path(args.out) / "sip-cache")
    kernels = [k for k in args.kernels.split(",") if k] or sorted(KERNELS)
    rows = []
    for kernel in kernels:
        for mode in [m for m in args.modes.split(",") if m]:
            if not has_mode(kernel, mode):
                continue
            energy: dict = {}
            for moves in (args.moves.split(";") if args.moves else [None]):
                print(f"=== {kernel} {mode} {moves or 'global'}", flush=True)
                t0 = time.monotonic()
                try:
                    rows.append(bench_one(kernel, mode, moves, args, store_root, energy))
                except Exception as e:  # noqa: BLE001 - one kernel's failure must not hide the others
                    traceback.print_exc()
                    rows.append({"kernel": kernel, "mode": mode, "moves": moves or "global",
                                 "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"=== {kernel} {mode} {moves or 'global'}: {time.monotonic() - t0:.0f} s", flush=True)
    meta = {**report.environment(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "budget_minutes": args.budget_minutes, "runs": args.runs, "samples": args.samples, "moves": args.moves,
            "hot": args.hot,
            "repeats": args.repeats, "reps": args.reps}
    report.write(args.out, "sip_tuning", {"meta": meta, "rows": rows}, markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
