"""The tune loop and its report: search, validate and store a tuned cubin for one workload.

    tune(factory, TuneConfig(...)) -> TuneReport

`factory` is a picklable zero-argument callable returning a `rosekernels.workload.Workload` (the
compiled kernel and its input generator); `sip_tune.workloads.factory(kernel, mode, shape)` makes one
for the kernels of the package. The loop:

1. the parent compiles the kernel (CPU only) and reads its cubin into an engine Schedule (with
   hot="ncu", its proposals weighted by Nsight Compute's PC samples of the original: sip_tune.probe);
2. K independent annealing runs (seeds seed, seed+1, ...) share the budget; each proposal is a legal
   move of the engine (sip.mutate), rendered to a cubin (`apply`) and sent to the GPU worker, which
   tests it on fresh random inputs against the original and times it against the original
   (energy = relative time; failed or crashed candidates get +inf). With more than one GPU visible,
   the runs go to one worker per GPU at once (run r on GPU r mod #GPUs; a candidate is only ever
   timed against the original on the same GPU);
3. every distinct cubin seen is ranked by its search energy; the best few are re-timed, interleaved
   with the original and a byte-identical copy of it (the A/A pair: the pipeline's noise floor), in
   `retimes` fresh workers; each finalist's time is its median over those runs. They are taken
   greedily, fastest first: the first one that beats both `min_speedup` and 1 + the A/A spread,
   matches the original on `shape_samples` input sets of the tuned shape itself and on `samples`
   fresh random samples of the kernel's test sizes, runs clean under compute-sanitizer memcheck,
   racecheck and synccheck (`sanitize`), and (given the tuned `shape`) beats max(min_speedup, 1 + A/A)
   through the public op too (`sip_tune.oplevel`: a fresh process that installs it as warmup does,
   over inputs rotated past L2, against the original and the best peer) is stored
   (`rosekernels.tuned`) with how it was checked; the op-level speedup is the one stored and reported.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
import os
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from rosekernels import tuned
from rosekernels.workload import Workload
from sip import cfg, cubin as elf, mutate, profile, sass, search
from sip_tune import oplevel, probe
from sip_tune.runner import Evaluation, Options, Runner

# ---------------------------------------------------------------------------------------------
# The engine (sip.cubin / sip.sass / sip.deps / sip.mutate) behind four functions: what the loop
# asks of a schedule, and where the CPU tests put a toy engine in.

def engine_initial(cubin: bytes, moves: str | None = None) -> mutate.Schedule:
    """The schedule the cubin has (of its largest kernel: CuTeDSL cubins hold one), under the move
    classes `moves` (comma list, sip.mutate.parse_moves; None: the engine's default)."""
    parsed = elf.parse_cubin(cubin)
    name = parsed.main_kernel().name
    classes = mutate.DEFAULT_MOVES if moves is None else mutate.parse_moves(moves)
    return mutate.initial_schedule(sass.disassemble_kernel(parsed, name), classes)


def engine_weighted(schedule: mutate.Schedule, listing: str, top: int = 3) -> tuple[mutate.Schedule, list[dict]]:
    """The same schedule with its proposals weighted by the PC samples of an ncu `listing` of its
    cubin (sip.profile), and the `top` blocks of those samples, for the report."""
    kernel = schedule.model.kernel
    samples = profile.stall_samples(listing, kernel)
    weights = profile.block_weights(kernel, samples)
    weighted = mutate.Schedule.initial(schedule.model, schedule.layout.moves, weights=weights)
    depth = cfg.loop_depth(kernel)
    return weighted, [{"offset": kernel.instructions[kernel.blocks[b].start].offset, "share": share,
                       "instructions": len(kernel.blocks[b]), "loop_depth": depth[b]}
                      for share, b in profile.hot_blocks(kernel, samples)[:top]]


def engine_floor_schedule(cubin: bytes) -> mutate.Schedule:
    """The schedule with every stall count at the floor the latency table proves under the trusted dependency
    model (sip.mutate.lowered), whatever relaxations the run's own classes hold."""
    return mutate.lowered(engine_initial(cubin, "control.stall"))


def engine_floor(cubin: bytes) -> bytes:
    """engine_floor_schedule's cubin (`sip floor`'s)."""
    return engine_apply(engine_floor_schedule(cubin))


def engine_neighbour(schedule: mutate.Schedule, rng: random.Random) -> mutate.Schedule | None:
    """One random legal move away (the engine's own policy, seeded from `rng`); None: no legal move."""
    moved, moves = mutate.random_walk(schedule, 1, rng.getrandbits(63))
    return moved if moves else None


def engine_apply(schedule: mutate.Schedule) -> bytes:
    return mutate.apply(schedule)


def _real_or_zero(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def stored_start(store_root: Any, kernel: str, variant: Any, original: bytes) -> tuned.Entry | None:
    """The fastest entry for exactly `original` that meets the store's bar, in the store at `store_root`
    or among those shipped with the package; None where neither holds one."""
    found = [entry for root in dict.fromkeys([store_root, tuned.SHIPPED_ROOT])
             if (entry := tuned.lookup(root, kernel, variant, original)) is not None and not entry.problems]
    return max(found, key=lambda entry: entry.speedup, default=None)


def engine_stats(schedule: mutate.Schedule) -> tuple[int, int, int]:
    """(instructions, movable instructions, legal moves) of a schedule under its classes, for the report."""
    return len(schedule.model.instructions), len(schedule.movable()), len(schedule.moves())


# ---------------------------------------------------------------------------------------------
# The tune loop.

HOT_SOURCES = ("loops", "ncu")
STARTS = ("original", "floor", "stored")


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    budget_iters: int | None = None  # total over all runs; 0: no search, the start alone goes to the final checks
    budget_seconds: float | None = None  # total search time over all runs
    runs: int = 2
    seed: int = 0
    # Final validation: fresh random samples through both kernels; 0: 10^4, or 10^5 when the moves go
    # past global-memory instructions (ALU, shared memory and control-code edits are new ground).
    samples: int = 0
    shape_samples: int = 8  # input sets of the tuned shape itself a finalist is compared on (final validation)
    search_samples: int = 2  # per candidate during the search
    t_max: float = 0.02
    t_min: float = 2e-4
    cooling: float | None = None
    finalists: int = 4
    compare_reps: int = 60
    retimes: int = 3  # fresh worker processes that re-time the finalists
    min_speedup: float = 1.01  # cache only a schedule at least this much faster (0: the best one that passes)
    exhausted_after: int = 500  # end a run when this many proposals in a row were measured before
    tolerance: tuple[float, float] | None = None
    moves: str | None = None  # move classes of the engine (sip.mutate.parse_moves); None: its default
    hot: str = "loops"  # where proposals go: "loops" (loop depth) or "ncu" (PC samples of the original)
    # Where the annealing starts: the original schedule, or its floor (every stall count lowered as far as
    # the latency table proves: on the H200 alone 1.006-1.037x on the attention prefill kernels, which
    # random walks from the original did not reach). "floor" needs control.stall in `moves`. "stored": the
    # tuned cubin of the fastest entry for this original that meets the store's bar (`stored_start`), so
    # that a search resumes where the last stored one ended (runs from the floor found 1.0006-1.0052x over
    # it on an H100, each from scratch); with no such entry, the floor (or the original where `moves` do
    # not edit stall counts).
    start: str = "original"
    # A cubin is stored only if compute-sanitizer finds it clean (sip_tune.probe; a few minutes per
    # finalist that gets that far, outside the search budget).
    sanitize: bool = True
    options: Options = Options()

    def __post_init__(self) -> None:
        if (self.budget_iters is None) == (self.budget_seconds is None):
            raise ValueError("give exactly one budget: iterations or seconds")
        if self.budget_iters is not None and self.budget_iters < 0:
            raise ValueError(f"budget_iters must be >= 0, got {self.budget_iters}")
        if self.budget_iters == 0 and self.start != "floor":
            raise ValueError("budget_iters=0 checks the start alone: only a floor start is a candidate")
        if self.runs < 1 or self.samples < 0 or self.search_samples < 1 or self.finalists < 1 or self.retimes < 1 \
                or self.shape_samples < 1:
            raise ValueError("runs, search_samples, shape_samples, finalists and retimes must be >= 1, samples >= 0")
        if self.hot not in HOT_SOURCES:
            raise ValueError(f"hot must be one of {HOT_SOURCES}, got {self.hot!r}")
        if self.start not in STARTS:
            raise ValueError(f"start must be one of {STARTS}, got {self.start!r}")
        classes = mutate.DEFAULT_MOVES if self.moves is None else mutate.parse_moves(self.moves)
        if self.start == "floor" and "control.stall" not in classes:
            raise ValueError(f"start='floor' lowers stall counts: the moves {self.moves or 'default'} do not edit "
                             "them (add control)")

    @property
    def validation_samples(self) -> int:
        classes = mutate.DEFAULT_MOVES if self.moves is None else mutate.parse_moves(self.moves)
        if self.samples:  # never fewer than an untrusted relaxation needs (sip.mutate.UNTRUSTED)
            return max(self.samples, mutate.UNTRUSTED_SAMPLES) if classes & mutate.UNTRUSTED else self.samples
        return 10_000 if classes <= mutate.DEFAULT_MOVES else 100_000

    def anneal(self) -> search.AnnealConfig:
        iters = None if self.budget_iters is None else max(1, self.budget_iters)  # 0: the start alone (tune)
        return search.AnnealConfig(self.t_max, self.t_min, self.cooling, iters, self.budget_seconds).split(self.runs)


@dataclasses.dataclass
class Candidate:
    """An annealing state: the schedule and the cubin it renders to."""

    schedule: Any
    cubin: bytes
    digest: str


@dataclasses.dataclass
class TuneReport:
    kernel: str
    variant: str
    mode: str
    gpu: str = ""
    gpus: int = 1  # workers searching at once, one per GPU
    original_sha256: str = ""
    start_sha256: str = ""  # the cubin the runs start from: the original's, or its floor's (TuneConfig.start)
    start_from: str = ""  # "original", "floor", or the stored entry's directory (TuneConfig.start "stored")
    cubin_bytes: int = 0
    movable: int = 0  # instructions the mutation policy may move
    legal_moves: int = 0  # at the start
    hot_blocks: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # with hot="ncu": the top blocks
    worker: dict[str, Any] = dataclasses.field(default_factory=dict)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    iterations: int = 0
    evaluated: int = 0  # distinct cubins run on the GPU
    incorrect: int = 0
    crashed: int = 0
    timeouts: int = 0
    worker_starts: int = 0
    cost_s: dict[str, float] = dataclasses.field(default_factory=dict)  # mean per evaluated candidate
    finalists: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    baseline_us: float = math.nan
    tuned_us: float = math.nan
    aa_spread: float = math.nan  # max |1 - time(copy) / time(original)| over the re-time runs
    bar: float = math.nan  # the speedup a finalist had to reach: max(min_speedup, 1 + aa_spread)
    # The start's own speedup over the original in the same re-times (1.0 when the runs start at the original):
    # a finalist's gain over the start (its "over_start") is what the search added to it.
    start_speedup: float = 1.0
    speedup: float = 1.0  # of the stored cubin: at the op level where it was re-timed there, else in the worker
    op_level: dict = dataclasses.field(default_factory=dict)  # its op-level re-time (oplevel.OpTiming)
    samples_passed: int = 0
    cached: str = ""  # entry path, or ""
    outcome: str = ""
    search_seconds: float = 0.0
    total_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self) -> str:
        c = self.cost_s
        lines = [
            f"sip-tune report: {self.kernel} ({self.mode})",
            f"  variant      {self.variant}",
            f"  gpu          {self.gpu}   original cubin {self.cubin_bytes} B, sha256 {self.original_sha256[:16]}",
            f"  engine       {self.movable} movable instructions, {self.legal_moves} legal moves at the start",
            *([f"  hot blocks   " + ", ".join(f"{h['offset']:#06x} ({h['instructions']} instructions, loop depth "
                                              f"{h['loop_depth']}): {h['share']:.0%}" for h in self.hot_blocks)
               + " of the ncu PC samples"] if self.hot_blocks else []),
            f"  timing       {self.worker.get('launches_per_graph', '?')} launches per CUDA graph over "
            f"{self.worker.get('input_sets', '?')} input sets ({self.worker.get('bytes_cycled', 0) / 2**20:.1f} MiB)",
            f"  search       {self.iterations} iterations in {len(self.runs)} runs"
            + (f" on {self.gpus} GPUs" if self.gpus > 1 else "") + f", {self.search_seconds:.1f} s; "
            f"{self.evaluated} distinct cubins run: {self.incorrect} incorrect, {self.crashed} crashed, "
            f"{self.timeouts} hung; worker started {self.worker_starts}x",
            f"  per cubin    {c.get('total', math.nan):.3f} s = apply {c.get('apply', math.nan):.3f} + load "
            f"{c.get('load', math.nan):.3f} + test {c.get('test', math.nan):.3f} + time {c.get('time', math.nan):.3f} "
            f"+ transfer {c.get('other', math.nan):.3f}",
        ]
        for r in self.runs:
            lines.append(f"  run seed {r['seed']}: {r['iterations']} iters, {r['accepted']} accepted, best "
                         f"{r['best_rel']:.4f} (search energy)" + (", ended early: no new schedule nearby"
                                                                   if r["exhausted"] else ""))
        if self.finalists:
            lines.append(f"  A/A          the original against a byte-identical copy: spread {self.aa_spread:.4f} "
                         f"over {self.config.get('retimes', '?')} fresh workers; bar {self.bar:.4f}x")
        if self.finalists and self.start_sha256 != self.original_sha256:
            lines.append(f"  start        {self.start_sha256[:12]} ({self.start_from}) re-timed {self.start_speedup:.4f}x "
                         "the original")
        for f in self.finalists:
            lines.append(f"  finalist {f['digest'][:12]}: search {f['search_rel']:.4f}, re-timed {f['rel']:.4f} "
                         f"({', '.join(f'{r:.4f}' for r in f['rels'])})"
                         + (f", {f['over_start']:.4f}x the start" if self.start_sha256 != self.original_sha256
                            else "")
                         + (" (the start itself)" if f["digest"] == self.start_sha256 else "")
                         + (f", validation: {f['validation']}" if f.get("validation") else ""))
        lines += [
            f"  result       original {self.baseline_us:.3f} us, tuned {self.tuned_us:.3f} us per launch: "
            f"{self.speedup:.3f}x ({self.samples_passed} samples passed)"
            + (" (the public op, fresh process)" if self.op_level and not self.op_level.get("error") else ""),
            f"  outcome      {self.outcome}",
            f"  total        {self.total_seconds:.1f} s",
        ]
        return "\n".join(lines)


def _digest(cubin: bytes) -> str:
    return hashlib.sha256(cubin).hexdigest()


def tune(factory: Callable[[], Workload], config: TuneConfig, *, kernel: str | None = None,
         shape: Any = None, store_root: str | os.PathLike | None = None, log: Callable[[str], None] = print,
         candidate_hook: Callable[[bytes], bytes] | None = None) -> TuneReport:
    """Search, validate and (if it pays) cache a tuned cubin for the workload `factory` builds.

    shape: the kernel module's Shape the workload is at (its make_args), which the op-level re-time
    calls the public op with; None: no op-level re-time (the entry records "not run" and stays below
    the store's bar). `candidate_hook` (tests only) rewrites every proposed cubin before it is run."""
    t_start = time.monotonic()
    workload = factory()  # compiles (CPU); the worker builds its own from the disk cache
    original, variant = workload.kernel.cubin, workload.kernel.variant
    kernel = kernel or workload.name or variant.op
    report = TuneReport(kernel, variant.key(), variant.mode, original_sha256=_digest(original),
                        cubin_bytes=len(original), config={**_config_dict(config), "samples": config.validation_samples})
    options = dataclasses.replace(config.options, tolerance=config.tolerance)
    memo: dict[str, float] = {_digest(original): 1.0}
    costs: dict[str, list[float]] = {k: [] for k in ("apply", "load", "test", "time", "total")}
    t0 = time.perf_counter()
    missing = config.sanitize and probe.sanitizer_problem()
    if missing:  # found out now, not after the search
        raise probe.ProbeError(f"{missing}: a tuned cubin is stored only once compute-sanitizer has run it "
                               "(sanitize=False / sip-tune --no-sanitize stores it unchecked)")
    # CPU only: fails fast, before any GPU work, on a cubin SIP cannot read
    initial = engine_initial(original) if config.moves is None else engine_initial(original, config.moves)
    count, report.movable, report.legal_moves = engine_stats(initial)
    log(f"[sip-tune] {kernel}: {count} instructions, {report.movable} movable, "
        f"{report.legal_moves} legal moves at the start ({time.perf_counter() - t0:.1f} s to disassemble)")
    if report.legal_moves == 0:
        report.outcome = ("the engine finds no legal move in this kernel (its memory instructions are pinned); "
                          "nothing to tune")
        report.total_seconds = time.monotonic() - t_start
        return report
    start_schedule, start_cubin = initial, original
    start, start_samples = config.start, 0
    if start == "stored":
        kept = stored_start(store_root, kernel, variant, original)
        if kept is not None:
            # its finalists carry the stored entry's edits: checked on at least as many samples as it was
            start_samples = int(_real_or_zero(kept.meta.get("samples_passed")))
            start_cubin = kept.tuned
            start_schedule = engine_initial(start_cubin, config.moves)
            report.start_from = str(kept.path)
            log(f"[sip-tune] the runs start from the stored entry {kept.path} ({kept.speedup:.4f}x, cubin "
                f"{_digest(start_cubin)[:12]})")
        else:
            classes = mutate.DEFAULT_MOVES if config.moves is None else mutate.parse_moves(config.moves)
            start = "floor" if "control.stall" in classes else "original"
            log(f"[sip-tune] no stored entry for this kernel meets the bar: the runs start from the {start}")
    if start == "floor":
        start_cubin = engine_floor(original)
        if candidate_hook is not None:
            start_cubin = candidate_hook(start_cubin)
        start_schedule = engine_initial(start_cubin, config.moves)  # the floor's code, read under the run's classes
        log(f"[sip-tune] the runs start from the floor of the stall counts (cubin {_digest(start_cubin)[:12]})")
    report.start_sha256 = _digest(start_cubin)
    report.start_from = report.start_from or start
    if config.hot == "ncu":
        # the floor changes control bits only: the original's samples weight it alike; a stored entry may have
        # moved instructions, so its own cubin is profiled
        profiled = original if report.start_from in ("original", "floor") else start_cubin
        start_schedule, report.hot_blocks = engine_weighted(start_schedule, probe.profile(factory, profiled))
        log("[sip-tune] hottest blocks (ncu PC samples): " + ", ".join(
            f"{h['offset']:#06x} {h['share']:.0%}" for h in report.hot_blocks))
    gpus = 1 if config.budget_iters == 0 else max(1, min(_gpu_count(), config.runs))  # no search: one worker
    runners = [Runner(factory, dataclasses.replace(options, device=d), log=lambda m: log(f"[sip-tune] {m}"))
               for d in range(gpus)]
    runner = runners[0]  # GPU 0's: the one the finalists are re-timed and validated with
    try:
        info = runner.start()
        report.gpu, report.worker, report.gpus = info["gpu"], info, gpus
        log(f"[sip-tune] {kernel} {variant.key()} on {info['gpu']}: original {info['base_us']:.3f} us per launch, "
            f"{info['launches_per_graph']} launches per graph over {info['input_sets']} input sets"
            + (f"; {gpus} workers, one per GPU" if gpus > 1 else ""))
        shared = threading.Lock()  # the memo, the counters, the sample seeds and the pool, across workers
        inflight: dict[str, threading.Event] = {}  # digests being measured (set when their energy is known)
        sample_seeds = random.Random(f"sip-samples-{config.seed}")
        pool: dict[str, tuple[float, bytes]] = {}
        acfg = config.anneal()

        def one_run(r: int, runner: Runner) -> dict[str, Any]:
            seen_in_a_row = [0]  # proposals in a row whose cubin was measured before

            def neighbour(state: Candidate, rng: random.Random) -> Candidate | None:
                if config.budget_iters == 0:
                    return None  # no search: the start is measured, then judged like any finalist
                if seen_in_a_row[0] >= config.exhausted_after:
                    return None  # the space around here is exhausted: end the run early
                t0 = time.perf_counter()
                schedule = engine_neighbour(state.schedule, rng)
                if schedule is None:
                    return None
                cubin = engine_apply(schedule)
                if candidate_hook is not None:
                    cubin = candidate_hook(cubin)
                with shared:
                    costs["apply"].append(time.perf_counter() - t0)
                return Candidate(schedule, cubin, _digest(cubin))

            def energy(c: Candidate) -> float:
                with shared:
                    known = c.digest in memo
                    running = inflight.get(c.digest)
                    if not known and running is None:
                        inflight[c.digest] = threading.Event()
                        seed = sample_seeds.getrandbits(63)
                if known or running is not None:  # measured, or being measured on another GPU
                    if running is not None:
                        running.wait()
                    seen_in_a_row[0] += 1
                    with shared:
                        return memo.get(c.digest, math.inf)
                seen_in_a_row[0] = 0
                try:
                    ev: Evaluation = runner.evaluate(c.cubin, seed, config.search_samples)
                    with shared:
                        report.evaluated += 1
                        if ev.status == "incorrect":
                            report.incorrect += 1
                        elif ev.status in ("crash", "timeout"):
                            log(f"[sip-tune] candidate {c.digest[:12]}: {ev.status}: {_last_line(ev.detail)}")
                        if ev.ok:
                            costs["load"].append(ev.load_s)
                            costs["test"].append(ev.test_s)
                            costs["time"].append(ev.time_s)
                            costs["total"].append(ev.wall_s + (costs["apply"][-1] if costs["apply"] else 0.0))
                        memo[c.digest] = ev.rel if ev.ok else math.inf
                        return memo[c.digest]
                finally:  # after the memo has the energy: whoever waits on this digest reads it
                    with shared:
                        inflight.pop(c.digest).set()

            seed = config.seed + r
            start = Candidate(start_schedule, start_cubin, _digest(start_cubin))
            progress = _Progress(log, f"run {r + 1}/{config.runs}", acfg)
            result = search.anneal(start, neighbour, energy, acfg, seed, key=lambda c: c.digest,
                                   keep=config.finalists, on_step=progress)
            progress.done(result)
            with shared:
                for e, digest, cand in result.top:
                    new = digest != report.original_sha256 and math.isfinite(e)
                    if new and e < pool.get(digest, (math.inf,))[0]:
                        pool[digest] = (e, cand.cubin)
            return {"seed": seed, "iterations": result.iterations, "accepted": result.accepted,
                    "best_rel": result.best_energy, "seconds": result.seconds,
                    "exhausted": seen_in_a_row[0] >= config.exhausted_after,
                    "feedback": sum(s.reward for s in result.steps)}

        def worker_runs(g: int) -> list[tuple[int, dict[str, Any]]]:  # GPU g's runs, one after another
            return [(r, one_run(r, runners[g])) for r in range(g, config.runs, gpus)]

        t_search = time.monotonic()
        if gpus == 1:
            done = worker_runs(0)
        else:
            with ThreadPoolExecutor(gpus) as threads:
                done = [run for runs in threads.map(worker_runs, range(gpus)) for run in runs]
        report.runs = [run for _, run in sorted(done, key=lambda x: x[0])]
        report.iterations = sum(run["iterations"] for run in report.runs)
        report.search_seconds = time.monotonic() - t_search
        for extra in runners[1:]:
            extra.close()
        report.crashed = sum(r.crashes for r in runners)
        report.timeouts = sum(r.timeouts for r in runners)
        _fill_costs(report, costs)
        _finish(report, runner, pool, config, factory, kernel, variant, original, start_cubin, shape, store_root, log,
                start_samples)
        report.worker_starts = sum(r.starts for r in runners)
    finally:
        for r in runners:
            r.close()
        report.total_seconds = time.monotonic() - t_start
    return report


def _gpu_count() -> int:
    """CUDA devices visible here (0 without torch or a driver); the workers do the GPU work."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch, no driver: one worker, which then says what is wrong
        return 0


def _finish(report: TuneReport, runner: Runner, pool: dict[str, tuple[float, bytes]], config: TuneConfig,
            factory: Callable[[], Workload], kernel: str, variant: Any, original: bytes, start: bytes, shape: Any,
            store_root: Any, log: Callable[[str], None], start_samples: int = 0) -> None:
    """Greedy pick: re-time the best few, the original and a copy of it interleaved (and the start, when
    the runs did not start at the original and it is not a finalist), in `config.retimes` fresh workers;
    then verify fastest first (the tuned shape and the samples, compute-sanitizer, the public op) and cache
    the first that passes everything past the bar."""
    ranked = sorted(pool.items(), key=lambda kv: kv[1][0])[:config.finalists]
    if not ranked:
        report.outcome = ("the floor is the original (no stall count to lower); nothing cached"
                          if config.budget_iters == 0 and start == original
                          else "no candidate passed testing; nothing cached")
        return
    start_digest = report.start_sha256
    extra = [start] if start != original and start_digest not in dict(ranked) else []
    runs = []
    for _ in range(config.retimes):
        runner.restart()  # nothing a candidate (or an earlier re-time) did can leak into this one
        runs.append(runner.compare([original] + [cubin for _, (_, cubin) in ranked] + extra, config.compare_reps))
    report.baseline_us = statistics.median(r["median_us"][0] for r in runs)
    report.aa_spread = max(abs(1.0 - r["rel"][1]) for r in runs)
    # min_speedup below 1 (tests): cache the fastest that passes, whatever the noise
    report.bar = max(config.min_speedup, 1.0 + report.aa_spread) if config.min_speedup >= 1 else config.min_speedup
    for i, (digest, (e, cubin)) in enumerate(ranked):
        rels = [r["rel"][i + 2] for r in runs]
        report.finalists.append({"digest": digest, "search_rel": e, "rel": statistics.median(rels), "rels": rels,
                                 "median_us": statistics.median(r["median_us"][i + 2] for r in runs),
                                 "cubin": cubin})
    # The start's time over the original's in each re-time (1.0: the start is the original).
    start_rels = ([r["rel"][-1] for r in runs] if extra
                  else next((f["rels"] for f in report.finalists if f["digest"] == start_digest), [1.0] * len(runs)))
    report.start_speedup = 1.0 / statistics.median(start_rels)
    for f in report.finalists:
        f["over_start"] = statistics.median(s / t for s, t in zip(start_rels, f["rels"]))
    report.finalists.sort(key=lambda f: f["rel"])
    samples = max(config.validation_samples, start_samples)
    original_clean = None  # the original under the sanitizer, asked once a finalist is flagged
    resumed = report.start_from not in ("original", "floor")  # from a stored entry: it must be beaten
    for f in report.finalists:
        speedup = 1.0 / f["rel"]
        if speedup < report.bar:
            f["validation"] = f"skipped: {speedup:.4f}x < bar {report.bar:.4f}x"
            continue
        if resumed and f["over_start"] <= 1.0 + report.aa_spread:
            f["validation"] = (f"skipped: {f['over_start']:.4f}x the stored entry it started from, not past the "
                               f"A/A spread {report.aa_spread:.4f}")
            continue
        log(f"[sip-tune] validating {f['digest'][:12]} ({speedup:.3f}x) on {config.shape_samples} input sets of the "
            f"tuned shape and {samples} fresh samples")
        v = runner.validate(f["cubin"], random.Random(f"sip-final-{config.seed}").getrandbits(63), samples,
                            config.shape_samples)
        rate = v["passed"] / v["seconds"] if v.get("seconds") else math.nan
        f["validation"] = (f"{v['status']}: {v.get('shape_passed', 0)} at the tuned shape and {v['passed']} "
                           f"samples passed in {v['seconds']:.1f} s ({rate:.0f}/s)") + (
            f" ({_last_line(v['detail'])})" if v.get("detail") else "")
        if v["status"] != "ok":
            continue
        if config.sanitize:
            log(f"[sip-tune] compute-sanitizer {', '.join(probe.SANITIZER_TOOLS)} on {f['digest'][:12]}")
            f["sanitizer"] = probe.sanitize(factory, f["cubin"])
            unclean = {tool: verdict for tool, verdict in f["sanitizer"].items() if verdict != "clean"}
            if unclean:
                f["validation"] += "; compute-sanitizer: " + "; ".join(f"{t} {v}" for t, v in unclean.items())
                if original_clean is None:
                    verdicts = probe.sanitize(factory, None)
                    original_clean = all(v == "clean" for v in verdicts.values())
                if not original_clean:  # not the candidate's doing
                    found = "; ".join(f"{t} {v}" for t, v in verdicts.items())
                    report.outcome = f"compute-sanitizer does not pass the original kernel either ({found}); nothing cached"
                    break
                continue
        timing = None
        if shape is not None:
            log(f"[sip-tune] the public op with {f['digest'][:12]}, in a fresh process")
            timing = oplevel.retime(kernel, shape, oplevel.CubinCandidate(variant, original, f["cubin"]),
                                    store_root=store_root)
            log(f"[sip-tune] {timing.text()}")
            f["validation"] += f"; {timing.text()}"
            if config.min_speedup >= 1 and not timing.passes(config.min_speedup):
                f["validation"] += " (not past the bar)"
                continue
        measured = timing is not None and not timing.error
        report.tuned_us, report.samples_passed = f["median_us"], v["passed"]
        report.speedup = timing.speedup if measured else speedup
        report.op_level = timing.meta() if timing is not None else {}
        checks = {"samples": {"run": samples, "passed": v["passed"]},
                  "compare": "bitwise" if config.tolerance is None else "tolerance",
                  "tolerance": None if config.tolerance is None else dict(zip(("rtol", "atol"), config.tolerance)),
                  "sanitizer": f.get("sanitizer", "not run"),
                  "shapes": {"tuned": dataclasses.asdict(shape) if shape is not None else None,
                             "tuned_samples": v.get("shape_passed", 0),
                             "samples": "the kernel's test sizes (Workload.test_args)"},
                  "op_level": report.op_level or "not run (no shape given)"}
        meta = {"baseline_median_us": report.baseline_us, "tuned_median_us": f["median_us"],
                "speedup": report.speedup, "worker_speedup": speedup, "aa_spread": report.aa_spread,
                "retimed": f["rels"], "samples_passed": v["passed"], "sanitizer": checks["sanitizer"],
                "checks": checks, "search": report.config, "seed": config.seed, "gpu": report.gpu,
                "iterations": report.iterations,
                "start": {"sha256": report.start_sha256, "speedup": report.start_speedup,
                          "over_start": f["over_start"], "from": report.start_from},
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        path, written = tuned.store(store_root, kernel, variant, original, f["cubin"], meta)
        report.cached = str(path)
        problems = tuned.bar_problems(meta, "cubin")
        report.outcome = (f"cached {report.speedup:.3f}x at {path}" if written else
                          f"kept the existing, stronger or faster entry at {path} (this run: "
                          f"{report.speedup:.3f}x)")
        if problems and written:
            report.outcome += f"; below the store's bar, not loaded by default ({'; '.join(problems)})"
        break
    else:
        report.outcome = ("no finalist beat the bar (min_speedup and the A/A spread), passed every sample and "
                          "compute-sanitizer and held at the op level; nothing cached "
                          + (f"(the stored entry it started from stays: {report.start_from})" if resumed
                             else "(the untuned kernel stays)"))
    for f in report.finalists:
        del f["cubin"]


def _fill_costs(report: TuneReport, costs: dict[str, list[float]]) -> None:
    mean = {k: statistics.fmean(v) if v else math.nan for k, v in costs.items()}
    mean["other"] = mean["total"] - sum(mean[k] for k in ("apply", "load", "test", "time"))
    report.cost_s = mean


def _config_dict(config: TuneConfig) -> dict[str, Any]:
    d = dataclasses.asdict(config)
    d["options"] = dataclasses.asdict(config.options)
    return d


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


class _Progress:
    """One plain line every few seconds: iteration, temperature, current and best speedup."""

    def __init__(self, log: Callable[[str], None], label: str, cfg: search.AnnealConfig, every_s: float = 2.0):
        self.log, self.label, self.cfg, self.every_s = log, label, cfg, every_s
        self.last = -math.inf

    def __call__(self, step: search.Step) -> None:
        if step.seconds - self.last < self.every_s:
            return
        self.last = step.seconds
        cfg = self.cfg
        total = f"/{cfg.max_iters}" if cfg.max_iters else f" ({step.seconds:.0f}/{cfg.max_seconds:.0f} s)"
        self.log(f"[sip-tune] {self.label} iter {step.i + 1}{total}  T={step.temperature:.2e}  "
                 f"current {_x(step.current)}  best {_x(step.best)}")

    def done(self, result: search.AnnealResult) -> None:
        self.log(f"[sip-tune] {self.label} done: {result.iterations} iterations, {result.accepted} accepted, "
                 f"best {_x(result.best_energy)} in {result.seconds:.1f} s")


def _x(rel: float) -> str:
    return f"{1 / rel:.3f}x" if math.isfinite(rel) and rel > 0 else "failed"
