"""The `sip-tune` command: tune the kernels of the package on this GPU and store the results for the
ops and `rosekernels.warmup`. Two levels: `config` searches a kernel's configurations for a shape
(`sip_tune.configs`), `sass` anneals the SASS schedule of the chosen one (`sip_tune.tuning`).

    sip-tune --model config.json --mode decode [--budget-minutes M] [--plan]   (the main job: level 1 for
                                       every kernel and shape of a model, within M minutes; then what it gained)
    sip-tune --kernel qk_norm --mode decode [--shape tokens=4,...] [--levels config,sass] [--budget-minutes 10] ...
    sip-tune --kernel gemm_leakyrelu --mode decode --shape m=8 --plan    (the config search space; no GPU)
    sip-tune --list [--store-root DIR]         (--cache DIR: its former name, still taken)

What is stored must meet the tuned store's default bar, or ops and warmup do not load it: outputs
bitwise equal (or within the kernel's own float64 tolerance) on >= 10^4 fresh samples and at the tuned
shape (configs: at their bucket's edges too), compute-sanitizer clean, and a gain past the A/A
spread through the public op, re-timed in a fresh process over inputs rotated past L2. Entries made
with weaker checks (--samples below 10^4, --rtol, --no-sanitize) are stored but not loaded unless the
user opts in (warmup(allow_unverified=True) or SIP_ALLOW_UNVERIFIED=1); `--list` says why, and lists the
entries shipped with rosekernels as well.

Exit codes: 0 done (whether or not anything faster was stored), 1 the tuning failed (a kernel the
engine cannot read, a worker that cannot start; --model: any of its shapes, or a model with nothing to
tune), 2 bad arguments (refused before any work, nothing written), 3 (rosekernels.device.NO_GPU_EXIT)
no sm_90 GPU.

Nothing here imports torch or CuTeDSL before a tuning or `--plan` starts: `--list` reads the store only.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from rosekernels import paths, tuned
from rosekernels.device import NO_GPU_EXIT, gpu_problem
from rosekernels.kernels import KERNELS
from rosekernels.models import FP32_NOTE, ModelDims
from rosekernels.variant import MODES
from sip import SipError, mutate
from sip_tune import configs, model, probe, tuning, workloads
from sip_tune.runner import WorkerFailure


LEVELS = ("config", "sass")


# A --shape the kernel cannot take fails in its plan module with one of these (an unknown dtype name is
# a KeyError, a size that is not a number a TypeError): a one-line error, not a traceback.
_BAD_REQUEST = (ValueError, LookupError, TypeError)


def _reason(e: Exception) -> str:
    return f"no such value {e}" if isinstance(e, LookupError) else str(e)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code 2, our wording
        self.print_usage(sys.stderr)
        self.exit(2, f"sip-tune: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sip-tune", description="Tune a rosekernels kernel on this GPU: search its configurations "
                "for the shape (level 'config'), then the SASS schedule of the chosen one (level 'sass': simulated "
                "annealing + probabilistic testing); the results go into the tuned store the ops read. A result is "
                "stored only after it has been re-timed through the public op in a fresh process (over inputs "
                "rotated past L2, against the heuristic and the best peer) and beaten max(--min-speedup, 1 + the "
                "A/A spread) there; ops and warmup load only entries that meet the store's default bar (bitwise or "
                "the kernel's tolerance on >= 10^4 samples and at the tuned shape, compute-sanitizer clean, that "
                f"op-level gain), unless {tuned.ALLOW_ENV}=1 or warmup(allow_unverified=True) opts in to weaker "
                "ones. --list shows every entry and why one is below the bar.")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--kernel", choices=sorted(KERNELS), help="the kernel to tune")
    what.add_argument("--model", metavar="CONFIG.json",
                      help="tune every kernel and shape a forward pass of this Hugging Face model config runs in "
                      "--mode, over the mode's token buckets (smallest first), level 'config' only (SASS annealing "
                      "is per kernel: use --kernel), within --budget-minutes; shapes whose bucket already has a "
                      "tuned entry are skipped, so a run that ran out of budget resumes; ends with what the store "
                      "gained")
    p.add_argument("--mode", choices=MODES, default="decode")
    p.add_argument("--shape", default="", metavar="K=V,...",
                   help="sizes and options of the kernel, e.g. tokens=4,q_heads=32,k_heads=8,head_dim=128,dtype=bf16")
    p.add_argument("--levels", metavar="L,...",
                   help="what to tune, in this order: 'config' (configuration search), 'sass' (annealing of the "
                   "chosen config's schedule), or both (default; --model: config only)")
    p.add_argument("--plan", action="store_true",
                   help="print the configurations the config level would try for the shape and exit (no GPU); "
                   "with --model, each shape's count of them and the total")
    p.add_argument("--max-candidates", type=int, default=configs.MAX_CANDIDATES, metavar="N",
                   help="configs tried besides the heuristic's; more are pruned by the kernel's cost model")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-iters", type=int, metavar="N", help="annealing iterations over all runs (0 with "
                        "--start floor: no search, the floor itself through the final checks into the store)")
    budget.add_argument("--budget-minutes", type=float, metavar="M",
                        help="--kernel: the sass level's search time over all runs (default 10 when no budget is "
                        "given); --model: the whole run's time, a shape started only while what is left exceeds the "
                        "longest search so far (an estimate: a search can still run past the budget; default: no "
                        "limit)")
    p.add_argument("--runs", type=int, default=2, metavar="K",
                   help="independent annealing runs (seeds S..S+K-1); with several GPUs visible, one worker per GPU "
                   "runs them at once")
    p.add_argument("--samples", type=int, default=0, metavar="N",
                   help="fresh random samples (the kernel's test sizes) a winner of either level must pass before "
                        "it is stored (up to 1e7; default 10^4, 10^5 when --moves goes past global; below 10^4 the "
                        "entry is below the store's bar)")
    p.add_argument("--search-samples", type=int, default=2, metavar="N", help="samples per candidate in the search")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store-root", "--cache", metavar="DIR",
                   help=f"the tuned store's folder (default ${paths.TUNED_STORE_ENV} or <rosekernels cache>/sip); "
                   "--cache is its former name")
    p.add_argument("--min-speedup", type=float, default=1.01,
                   help="store only if at least this much faster (and past 1 + the A/A spread), in the worker and "
                   "through the public op")
    p.add_argument("--rtol", type=float, help="(level 'sass') compare outputs with this tolerance instead of bitwise; "
                   "the entry is then below the store's bar")
    p.add_argument("--atol", type=float, help="(with --rtol) absolute tolerance")
    p.add_argument("--moves", metavar="CLASSES", help="SASS changes the 'sass' level may make: comma list of "
                   "global, shared, alu, control, or all (default: global; sip.mutate)")
    p.add_argument("--hot", choices=tuning.HOT_SOURCES, default="loops",
                   help="where the 'sass' level proposes changes: loops (by loop depth, the default) or ncu "
                   "(in proportion to Nsight Compute's PC samples of the kernel's blocks; needs ncu)")
    p.add_argument("--start", choices=tuning.STARTS, default="original",
                   help="where the 'sass' level's annealing starts: the original schedule (default); its floor, "
                   "every stall count lowered as far as the latency table proves (needs control in --moves); or "
                   "stored: the fastest entry for this kernel that meets the bar (the store's, else one shipped "
                   "with rosekernels), so that a search resumes where the last one ended, and only a finalist "
                   "faster than it past the A/A spread is checked (none stored: the floor, or the original "
                   "where --moves do not edit stall counts); the report and the stored entry then give each "
                   "finalist's speedup over the start as well, timed in the same runs")
    p.add_argument("--no-sanitize", action="store_true",
                   help="store a tuned config or cubin without running it under compute-sanitizer memcheck, "
                   "racecheck and synccheck first (the entry records that it was not run: below the store's bar)")
    p.add_argument("--t-max", type=float, default=0.02, help="initial temperature (relative time units)")
    p.add_argument("--t-min", type=float, default=2e-4, help="final temperature")
    p.add_argument("--cooling", type=float, help="cooling factor L (T <- T/L); default: derived from the budget")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON (with both levels: "
                   "{\"config\": ..., \"sass\": ...}; with --plan, the plan)")
    p.add_argument("--list", action="store_true",
                   help="list the tuned store's entries (configs and cubins), then those shipped with rosekernels, "
                   "and exit, each entry below the default bar with the reason")
    return p


def parse_shape(text: str) -> dict[str, Any]:
    """'tokens=4,dtype=bf16,eps=1e-6,residual=true' -> typed dict."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ValueError(f"bad --shape item {item!r}: expected KEY=VALUE")
        k, v = (s.strip() for s in item.split("=", 1))
        if v.lower() in ("true", "false"):
            out[k] = v.lower() == "true"
            continue
        for conv in (int, float):
            try:
                out[k] = conv(v)
                break
            except ValueError:
                pass
        else:
            out[k] = v
    return out


def _list_store(store_root: str | None) -> int:
    """The --list output. A --store-root that does not name a folder is a bad argument (2); the default
    store not existing yet is not."""
    folder = paths.tuned_store_root(store_root)
    if store_root is not None and not folder.is_dir():
        why = "is a file, not a folder" if folder.exists() else "does not exist"
        print(f"sip-tune: --store-root {folder} {why}: give the tuned store's folder (default "
              f"${paths.TUNED_STORE_ENV} or <rosekernels cache>/sip)", file=sys.stderr)
        return 2
    rows = tuned.list_entries(folder) if folder.is_dir() else []
    kinds = [r.get("kind") for r in rows]
    below = sum(1 for r in rows if r["valid"] and r["problems"])
    print(f"tuned store {folder}: {kinds.count('config')} tuned configs, {kinds.count('cubin')} tuned cubins"
          + ("" if rows else " (nothing tuned there yet)")
          + (f", {below} below the default bar (not loaded unless {tuned.ALLOW_ENV}=1)" if below else ""))
    _print_rows(rows)
    shipped = tuned.list_entries(tuned.SHIPPED_ROOT) if tuned.SHIPPED_ROOT.is_dir() and \
        tuned.SHIPPED_ROOT.resolve() != folder.resolve() else []
    if shipped:
        toolchains = sorted({r.get("toolchain", "?") for r in shipped})
        print(f"shipped with rosekernels ({tuned.SHIPPED_ROOT}): {len(shipped)} tuned cubins, which warmup loads beside "
              f"the store (warmup(shipped=False): not) where this install compiles their originals "
              f"(made with {', '.join(toolchains)})")
        _print_rows(shipped)
    return 0


def _print_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        if not r["valid"]:
            print(f"  {r['kernel']:<15} BROKEN: {r['error']}  ({r['path']})")
            continue
        checks = r.get("checks") if isinstance(r.get("checks"), dict) else {}
        record = checks.get("samples") if isinstance(checks.get("samples"), dict) else {}
        samples = record.get("passed", r.get("samples_passed", "?"))
        speedup = r.get("speedup")
        if not isinstance(speedup, (int, float)) or not abs(speedup) <= sys.float_info.max:  # hand edits
            speedup = math.nan  # an int past the float range would not format
        if r["kind"] == "cubin":
            what = r["spec_key"]
        elif r.get("config_key") == r.get("heuristic_key"):
            what = f"the heuristic stays: {r.get('config_key', '?')}"
        else:
            what = f"{r.get('heuristic_key', '?')} -> {r.get('config_key', '?')}"
        print(f"  {r.get('kernel')!s:<15} {r['kind']:<6} {r.get('mode', '?')!s:<8} {speedup:.3f}x  "
              f"{samples!s:>8} samples  {r.get('gpu', '?')}  {r.get('date', '?')}  {what}")
        if r["problems"]:
            print(f"    below the bar: {'; '.join(r['problems'])}")


def _writable_file(option: str, path: str) -> str | None:
    """Why `path` cannot be written as a new or replaced file (None: it can), checked before any work."""
    target = Path(path)
    if target.is_dir():
        return f"{option} {path} is a folder"
    parent = target.parent
    if not parent.is_dir():
        return f"{option} {path}: the folder {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"{option} {path}: not writable"
    return None


def _write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def _missing_tools(args: argparse.Namespace) -> list[str]:
    """What a winner of either level needs to be stored and is not here, checked before any GPU time:
    compute-sanitizer, unless --no-sanitize."""
    return [] if args.no_sanitize else [p for p in [probe.sanitizer_problem()] if p]


def _require_gpu() -> int | None:
    problem = gpu_problem()
    if problem:
        print(f"sip-tune: needs a CUDA sm_90 GPU (H100/H200) to run and time candidates: {problem}.",
              file=sys.stderr)
        return NO_GPU_EXIT
    return None


def _main_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--model: the plan (no GPU), or level 1 of every (kernel, shape) of the model within the budget,
    then what the store gained."""
    try:
        dims = ModelDims.from_config(args.model)
    except OSError as e:
        parser.error(f"--model {args.model}: {e.strerror or e}")
    except ValueError as e:  # the message names the file and the key
        parser.error(f"--model {e}")
    found = model.shapes(dims, args.mode)
    no_gpu = None if args.plan or not found.jobs else _require_gpu()
    if no_gpu:
        return no_gpu
    tokens = model.TOKENS[args.mode]
    print(f"{dims.name} ({args.mode}): {len(found.jobs)} kernel shapes over {len(tokens)} token counts "
          f"{tokens[0]}..{tokens[-1]}")
    for job, why in found.dropped:
        print(f"  dropped  {job.kernel} {job.label()}: {why}")
    if dims.dtype == "fp32":
        print(f"note: {args.model}: {FP32_NOTE}")
    if not found.jobs:
        print(f"sip-tune: {args.model}: no shape of this model has a configuration to search in {args.mode} mode "
              "(the dropped shapes above say why): nothing to tune", file=sys.stderr)
        return 1
    if args.plan:
        return _model_plan(args, found)
    missing = _missing_tools(args)
    if missing:
        print(f"sip-tune: {'; '.join(missing)} (see --no-sanitize)", file=sys.stderr)
        return 2
    budget_s = None if args.budget_minutes is None else args.budget_minutes * 60
    rows = model.tune(found, store_root=args.store_root, max_candidates=args.max_candidates,
                      min_speedup=args.min_speedup, seed=args.seed, budget_s=budget_s, sanitize=not args.no_sanitize)
    print(model.table(rows))
    gains = model.gains(rows, args.mode, args.store_root)
    print(gains.text())
    if args.json:
        _write_json(args.json, {"rows": [{"kernel": r.job.kernel, "role": r.job.role, "shape": r.job.shape,
                                          "status": r.status, "report": r.report.to_dict() if r.report else None}
                                         for r in rows],
                                "gains": gains.to_dict()})
    return 1 if any(r.status.startswith("failed") for r in rows) else 0


def _model_plan(args: argparse.Namespace, found: model.ModelShapes) -> int:
    searched = total = failed = 0
    width = max(len(job.label()) for job in found.jobs)
    planned = []
    for job in found.jobs:
        try:
            space = configs.plan(job.kernel, args.mode, job.shape, args.max_candidates)
        except _BAD_REQUEST as e:
            failed += 1
            print(f"sip-tune: {job.kernel} {job.label()}: {_reason(e)}", file=sys.stderr)
            continue
        searched, total = searched + len(space.candidates), total + space.total
        planned.append({"kernel": job.kernel, "role": job.role, "shape": job.shape,
                        "searched": len(space.candidates), "candidates": space.total})
        print(f"  {job.kernel:<16} {job.label():<{width}}  {space.lines()[-1]}")
    print(f"total: {len(found.jobs) - failed} shapes, {searched} configs to search ({total} candidates before "
          f"pruning), {len(found.dropped)} shapes dropped" + (f", {failed} failed" if failed else ""))
    if args.json:
        _write_json(args.json, {"model": found.dims.name, "mode": args.mode, "shapes": planned,
                                "dropped": [{"kernel": j.kernel, "role": j.role, "shape": j.shape, "why": why}
                                            for j, why in found.dropped]})
        print(f"plan written to {args.json}")
    return 1 if failed else 0


def _kernel_plan(args: argparse.Namespace, space: configs.SearchSpace) -> int:
    print("\n".join(space.lines()))
    if args.json:
        _write_json(args.json, {"kernel": space.kernel, "mode": args.mode, "shape": dataclasses.asdict(space.shape),
                                "heuristic": configs.describe(space.heuristic), "candidates": space.total,
                                "pruned_by": space.ranked_by if space.pruned else None,
                                "searched": [configs.describe(c) for c in space.candidates]})
        print(f"plan written to {args.json}")
    return 0


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Every check that needs no kernel and no GPU; the levels asked for."""
    if args.kernel is None and args.model is None:
        parser.error("--kernel is required (or --model, or --list)")
    if args.budget_iters is not None and args.budget_iters < (0 if args.start == "floor" else 1):
        parser.error("--budget-iters must be >= 1 (0, with --start floor: the floor alone, checked and stored)")
    if args.budget_minutes is not None and not args.budget_minutes > 0:
        parser.error("--budget-minutes must be > 0")
    if not 0 <= args.samples <= 10**7:
        parser.error("--samples must be in [0, 1e7] (0: the default for the move classes)")
    if args.runs < 1 or args.search_samples < 1:
        parser.error("--runs and --search-samples must be >= 1")
    if (args.atol is not None) and args.rtol is None:
        parser.error("--atol needs --rtol")
    if args.max_candidates < 0:
        parser.error("--max-candidates must be >= 0")
    if args.moves is not None:
        try:
            mutate.latencies_for(mutate.parse_moves(args.moves))
        except SipError as e:
            parser.error(str(e))
    if args.store_root is not None and Path(args.store_root).exists() and not Path(args.store_root).is_dir():
        parser.error(f"--store-root {args.store_root} is a file: give the tuned store's folder")
    if args.json is not None:
        problem = _writable_file("--json", args.json)
        if problem:
            parser.error(problem)
    text = args.levels if args.levels is not None else ("config" if args.model else ",".join(LEVELS))
    levels = [s.strip() for s in text.split(",") if s.strip()]
    if not levels or any(lv not in LEVELS for lv in levels) or len(set(levels)) != len(levels):
        parser.error(f"--levels takes a comma-separated subset of {','.join(LEVELS)}, got {text!r}")
    if args.model is not None:
        if levels != ["config"]:
            parser.error("--model tunes level 'config' only; anneal a kernel's SASS with --kernel")
        if args.shape:
            parser.error("--shape is for --kernel; --model derives the shapes from the model")
        if args.budget_iters is not None:
            parser.error("--budget-iters counts the sass level's iterations (--kernel); give --model --budget-minutes")
        if args.start != "original":
            parser.error("--start is where the sass level's annealing starts (--kernel); --model tunes configs")
    return levels


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        return _list_store(args.store_root)
    levels = _check_arguments(parser, args)
    if args.model is not None:
        return _main_model(parser, args)
    try:
        shape = parse_shape(args.shape)
        space = configs.plan(args.kernel, args.mode, shape, args.max_candidates)  # CPU: refuses a bad shape now
    except _BAD_REQUEST as e:
        parser.error(_reason(e))
    minutes = args.budget_minutes  # (the two budgets exclude each other)
    if args.budget_iters is None and minutes is None:
        minutes = 10.0
    try:
        config = tuning.TuneConfig(
            budget_iters=args.budget_iters, budget_seconds=None if minutes is None else minutes * 60,
            runs=1 if args.budget_iters == 0 else args.runs,  # no search: one run, one worker
            seed=args.seed, samples=args.samples, search_samples=args.search_samples,
            t_max=args.t_max, t_min=args.t_min, cooling=args.cooling, min_speedup=args.min_speedup,
            tolerance=None if args.rtol is None else (args.rtol, args.atol or 0.0), moves=args.moves, hot=args.hot,
            start=args.start, sanitize=not args.no_sanitize)
    except ValueError as e:  # e.g. --start floor without control in --moves: refused before any GPU work
        parser.error(str(e))
    if args.plan:
        return _kernel_plan(args, space)
    no_gpu = _require_gpu()
    if no_gpu:
        return no_gpu
    missing = _missing_tools(args)
    if "sass" in levels and args.hot == "ncu" and not shutil.which("ncu"):
        missing.append("ncu not found on PATH")
    if missing:
        print(f"sip-tune: {'; '.join(missing)} (see --no-sanitize, --hot)", file=sys.stderr)
        return 2
    reports: dict[str, Any] = {}
    try:
        if "config" in levels:
            reports["config"] = configs.tune_configs(
                args.kernel, args.mode, shape, max_candidates=args.max_candidates, min_speedup=args.min_speedup,
                seed=args.seed, validation_samples=args.samples or tuned.BAR_SAMPLES, sanitize=not args.no_sanitize,
                store_root=args.store_root)
            print(reports["config"].text())
        if "sass" in levels:
            if "config" in reports and reports["config"].winner is not None:
                chosen, full = configs.chosen(reports["config"])
                factory = configs.workload_factory(args.kernel, chosen, full)
            else:  # the heuristic's config: what the op runs for the shape
                factory = workloads.factory(args.kernel, args.mode, shape)
                full = workloads.resolve(args.kernel, args.mode, shape)[1]
            reports["sass"] = tuning.tune(factory, config, kernel=args.kernel, shape=full, store_root=args.store_root)
            print(reports["sass"].text())
    except (*_BAD_REQUEST, SipError, WorkerFailure, probe.ProbeError) as e:
        print(f"sip-tune: {_reason(e)}", file=sys.stderr)
        return 1
    if args.json:
        _write_json(args.json, reports["sass"].to_dict() if levels == ["sass"]
                    else {k: r.to_dict() for k, r in reports.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
