"""Level 1 of sip-tune: search a kernel's configurations for one shape.

    plan("gemm_leakyrelu", "decode", {"m": 8})          -> SearchSpace     (CPU only)
    tune_configs("gemm_leakyrelu", "decode", {"m": 8})  -> ConfigReport    (GPU)

1. The space: the kernel module's `candidates(shape)`. Where there are more than `max_candidates`
   besides the heuristic's, the kernel's cost model prunes them: its `rank(shape, configs)`, best first
   (`contract.keep_order` where the kernel has no cost model: the candidates' own order). The
   heuristic's config is always kept.
2. Compile: every distinct variant in parallel processes, into the disk cache (CPU); each row gets
   the seconds its variant took (a disk hit shows as the load time).
3. Test, in the crash-isolated worker (`runner.ConfigBench`): the heuristic and each candidate on the
   same input sets of the shape; equal outputs bit for bit, or the candidate passes the kernel's
   float64 check on every sample. A crash or hang marks that candidate and restarts the worker.
4. Time: every passing candidate, the heuristic and the heuristic again (the A/A pair, whose ratio
   says how far apart two identical kernels measure) in one interleaved replay of CUDA graphs.
5. The fastest few are re-timed against the heuristic in a fresh worker; those that beat it by more
   than max(min_speedup, 1 + A/A spread) there are verified, fastest first, and the first that passes
   is the winner:
   - where its entry will serve: against the heuristic at the tuned shape and at the edges of its
     bucket (`bucket_edges`: per size field the smallest and the largest size the entry serves, their
     combinations, and a ragged size between; bitwise, else the kernel's float64 check), then the
     kernel's float64 check on `validation_samples` fresh input sets of its test sizes;
   - at the op level (`sip_tune.oplevel`): the public op re-timed in a fresh process with the entry
     loaded from a tuned store, against the heuristic and the best peer, over inputs rotated past
     L2; it must beat max(min_speedup, 1 + that run's A/A spread) there too;
   - under compute-sanitizer memcheck, racecheck and synccheck (`probe.sanitize`: its kernel at the
     tuned shape and on a few of its test sizes), clean.
   The winner goes into the tuned store (`rosekernels.tuned.store_config`) with how it was checked
   and the op-level speedup (the one reported), unless the entry already there is better checked,
   or as well and faster (the outcome says it was kept); ops consult the store when they plan a
   call. When every finalist was refused on its merits (wrong outputs, an op-level speedup
   measured and not past the bar, a sanitizer finding the heuristic's kernel does not have), or
   none timed faster, the store records that the heuristic stays (its own config at 1.0x), so the
   bucket counts as tuned (`sip-tune --model` resumes past it). Where a check failed to run instead (a worker or
   the op-level process crashed or timed out), nothing is recorded, nor by a failed run.

Why bucket edges rather than entries keyed to exact shapes: the token count of a call varies from
step to step (decode batches, prefill chunks), and an entry per exact count would serve almost no
call; the edges are where a config's tiling, split counts and tails differ most from the shape it
was timed at, so testing them covers what the bucket asks of it.

Level 2 (`sip_tune.tuning.tune`, SASS annealing) then runs on the winner's config:
`workload_factory(kernel, winner, shape)` is its factory.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import functools
import itertools
import math
import multiprocessing
import os
import random
import time
from types import ModuleType
from typing import Any, Callable, Mapping

from rosekernels import contract
from rosekernels.kernels import kernel_module
from rosekernels.workload import Workload
from sip_tune import oplevel, probe, workloads
from sip_tune.runner import ConfigBench, Options, Runner, WorkerFailure

# The outcome of a search that cannot tell whether the heuristic stays (a check failed to run).
NOT_SETTLED = "nothing recorded (the next run searches the bucket again)"

# Configs searched besides the heuristic's: 36 keeps the swapped tiles on clusters (the gemm's cost model
# ties them with their unclustered twins) without crowding out the plain widths; compiles run in parallel,
# so a decode GEMM shape took 13-28 s on the H200 host at 36, against 12-25 s at 24.
MAX_CANDIDATES = 36


# ---------------------------------------------------------------------------------------------
# The space (CPU only).

@dataclasses.dataclass
class SearchSpace:
    kernel: str
    module: ModuleType  # the kernel module
    shape: Any
    heuristic: Any
    candidates: list  # what is searched: the heuristic's config first, then the kept ones best first
    total: int  # candidates(shape) before pruning
    ranked_by: str  # "<module>.rank" or "candidates order"

    @property
    def pruned(self) -> int:
        return self.total - len(self.candidates)

    def lines(self) -> list[str]:
        """One line per candidate (variant key, then launch-policy fields), then the counts."""
        out = [describe(c) + ("   (heuristic)" if i == 0 else "") for i, c in enumerate(self.candidates)]
        out.append(f"{self.total} candidates ({len(self.candidates)} after pruning"
                   + (f" by {self.ranked_by}" if self.pruned else "") + ")")
        return out


def describe(config: Any) -> str:
    """The config's variant key, then its launch policy (the Config's POLICY_FIELDS: K splits, split
    counts, raster groups), which one compiled kernel takes at run time."""
    policy = [f"{name}={getattr(config, name)}" for name in type(config).POLICY_FIELDS]
    return " ".join([config.variant().key(), *policy])


def plan(kernel: str, mode: str, overrides: Mapping[str, Any] | None = None,
         max_candidates: int = MAX_CANDIDATES) -> SearchSpace:
    """The configurations level 1 tries for `kernel` at Shape.defaults(mode) + overrides: the
    heuristic's, then the first `max_candidates` others in the cost model's order. No GPU needed."""
    if max_candidates < 0:
        raise ValueError(f"max_candidates must be >= 0, got {max_candidates}")
    m = kernel_module(kernel)
    heuristic, shape = workloads.resolve(kernel, mode, overrides)
    found = list(m.candidates(shape))
    if heuristic not in found:
        raise ValueError(f"{kernel}: the heuristic's config is not among candidates({shape}): {heuristic}")
    ranked_by = "candidates order" if m.rank is contract.keep_order else f"{m.rank.__module__}.rank"
    ordered = m.rank(shape, found)
    if sorted(map(repr, ordered)) != sorted(map(repr, found)):
        raise ValueError(f"{ranked_by} did not return a permutation of the candidates")
    others = [c for c in ordered if c != heuristic][:max_candidates]
    return SearchSpace(kernel, m, shape, heuristic, [heuristic, *others], len(found), ranked_by)


# ---------------------------------------------------------------------------------------------
# Compile (CPU, parallel).

def _timed_compile(compile_config: Callable[[Any], Any], config: Any) -> float:
    t0 = time.perf_counter()
    compile_config(config)
    return time.perf_counter() - t0


def compile_configs(compile_config: Callable[[Any], Any], configs: list, processes: int | None = None
                    ) -> dict[str, float]:
    """Compile every distinct variant of `configs` with `compile_config` (a kernel module's `compile`,
    which a spawned process unpickles by its module and name) into the disk cache, in `processes`
    processes (None: one per CPU core, at most one per variant); seconds per variant key, as each
    process saw it (the worker loads them from disk)."""
    todo = {c.variant().key(): c for c in configs}
    processes = processes or min(len(todo), os.cpu_count() or 1)
    if processes > 1:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx) as pool:
            seconds = list(pool.map(functools.partial(_timed_compile, compile_config), todo.values()))
    else:
        seconds = [_timed_compile(compile_config, c) for c in todo.values()]
    return dict(zip(todo, seconds))


# ---------------------------------------------------------------------------------------------
# What the worker builds.

@dataclasses.dataclass(frozen=True)
class ConfigSpace:
    """Picklable: the worker's view of a search (`runner.ConfigBench` takes it)."""

    build: Callable[[Any, Any], Workload]  # the kernel module's workload(config, shape)
    shape: Any
    configs: tuple

    def workload(self, i: int) -> Workload:
        return self.workload_at(i, self.shape)

    def workload_at(self, i: int, shape: Any) -> Workload:
        """configs[i]'s workload at another shape of the bucket (its edges)."""
        return self.build(self.configs[i], shape)


def _config_workload(kernel: str, config: Any, shape: Any) -> Workload:
    workload = kernel_module(kernel).workload(config, shape)
    return dataclasses.replace(workload, name=kernel)  # the tuned store files entries by kernel name


def workload_factory(kernel: str, config: Any, shape: Any) -> Callable[[], Workload]:
    """A picklable factory of `config`'s workload at `shape`: what level 2 (`tuning.tune`) anneals."""
    return functools.partial(_config_workload, kernel, config, shape)


# ---------------------------------------------------------------------------------------------
# Where an entry serves: its bucket's edges (CPU).

EDGE_STEPS = 256  # a size field's range is scanned in at most this many steps, then refined at its ends


def bucket_edges(kernel: str, shape: Any, config: Any, heuristic: Any, seed: int = 0) -> list:
    """The shapes at the edges of bucket(shape) where an entry of `config` tuned against `heuristic`
    serves (the heuristic picks `heuristic` there and `config` is among the candidates): per size
    field the smallest and the largest such size (the other fields as in `shape`), every combination
    of those that the entry serves, and a ragged shape strictly between; `shape` itself left out."""
    m = kernel_module(kernel)

    def serves(s: Any) -> bool:
        try:
            return m.config_for(s) == heuristic and config in m.candidates(s)
        except (ValueError, LookupError, TypeError, ZeroDivisionError):  # a size the kernel refuses
            return False

    bucket = contract.bucket(shape)
    ranges = {}
    for name in type(shape).SIZE_FIELDS:
        hi = getattr(bucket, name)
        ranges[name] = _served_range(lambda v, n=name: serves(dataclasses.replace(shape, **{n: v})),
                                     hi // 2 + 1 if hi > 1 else hi, hi, getattr(shape, name))
    found = [dataclasses.replace(shape, **dict(zip(ranges, corner))) for corner in itertools.product(*ranges.values())]
    rng = random.Random(f"sip-edges-{seed}")
    for _ in range(16):  # a ragged shape: every size field strictly inside its range, where it has an inside
        ragged = dataclasses.replace(shape, **{n: rng.randint(lo + 1, hi - 1) if hi - lo > 1 else lo
                                               for n, (lo, hi) in ranges.items()})
        if ragged not in found and serves(ragged):
            found.append(ragged)
            break
    return [s for s in dict.fromkeys(found) if s != shape and serves(s)]


def _served_range(serves: Callable[[int], bool], lo: int, hi: int, own: int) -> tuple[int, int]:
    """The smallest and the largest size in [lo, hi] that `serves` (own, own if none does): a scan in
    steps of (hi - lo) / EDGE_STEPS, then every size between the extreme hits and their unscanned
    neighbours."""
    step = max(1, (hi - lo) // EDGE_STEPS)
    hits = [v for v in sorted({*range(lo, hi + 1, step), hi, own}) if serves(v)]
    if not hits:
        return own, own
    first = next((v for v in range(max(lo, hits[0] - step + 1), hits[0]) if serves(v)), hits[0])
    last = next((v for v in range(min(hi, hits[-1] + step - 1), hits[-1], -1) if serves(v)), hits[-1])
    return first, last


# ---------------------------------------------------------------------------------------------
# The search (GPU).

@dataclasses.dataclass
class ConfigReport:
    kernel: str
    mode: str
    shape: dict
    heuristic: dict
    ranked_by: str = ""
    total: int = 0  # candidates(shape)
    pruned: int = 0
    gpu: str = ""
    worker: dict = dataclasses.field(default_factory=dict)
    # per config searched, the heuristic's first: key (describe()), config (asdict), compile_s,
    # status ("ok" | "incorrect" | "crash" | "timeout" | "untimed"), bitwise, max_err, median_us, rel
    candidates: list = dataclasses.field(default_factory=list)
    heuristic_us: float = math.nan
    aa_spread: float = math.nan  # |A/A ratio - 1| of the joint timing run
    finalists: list = dataclasses.field(default_factory=list)  # the re-timed ones
    retime_aa_spread: float = math.nan
    winner: dict | None = None  # asdict of the stored config; None: no candidate passed
    settled: bool = False  # no winner, and every refusal was on its merits: the heuristic stays (recorded)
    winner_key: str = ""
    tuned_us: float = math.nan
    # Of the winner over the heuristic: at the op level (heuristic_us and tuned_us too, per call of
    # the public op) when the winner was verified there, else in the worker's re-time.
    speedup: float = 1.0
    op_level: dict = dataclasses.field(default_factory=dict)  # the winner's op-level re-time (oplevel.OpTiming)
    checks: dict = dataclasses.field(default_factory=dict)  # how the stored winner was checked (tuned store meta)
    outcome: str = ""
    stored: str = ""  # the store entry's path
    # plan, compile, setup, test, time, retime, verify (the winner's validation and op-level re-time), total
    seconds: dict = dataclasses.field(default_factory=dict)
    shares: dict = dataclasses.field(default_factory=dict)  # compile, test, time, verify: fractions of the total

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self) -> str:
        s, sh = self.seconds, self.shares
        counts = {}
        for row in self.candidates[1:]:
            counts[row["status"]] = counts.get(row["status"], 0) + 1
        lines = [
            f"sip-tune level 1 (configs): {self.kernel} ({self.mode}) {self.shape}",
            f"  space        {self.total} candidates, {len(self.candidates)} searched"
            + (f" ({self.pruned} pruned by {self.ranked_by})" if self.pruned else "") + f"; gpu {self.gpu}",
            f"  timing       {self.worker.get('launches_per_graph', '?')} launches per CUDA graph over "
            f"{self.worker.get('input_sets', '?')} input sets per config; A/A spread {self.aa_spread:.4f}",
            "  results      " + (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no other candidate"),
        ]
        heuristic = self.candidates[0]["key"] if self.candidates else None
        for row in sorted(self.candidates, key=lambda r: r["rel"]):
            err = "bitwise" if row["bitwise"] else f"max_err {row['max_err']:.3g}"
            lines.append(f"    {row['rel']:7.4f}  {row['median_us']:9.3f} us  {row['status']:<9} "
                         f"{err if row['status'] == 'ok' else '':<16} {row['key']}"
                         + ("   (heuristic)" if row["key"] == heuristic else ""))
        for f in self.finalists:
            lines.append(f"  re-timed     {f['speedup']:.4f}x  {f['median_us']:.3f} us  {f['key']}"
                         + (f"; {f['verdict']}" if f.get("verdict") else ""))
        lines += [
            f"  result       heuristic {self.heuristic_us:.3f} us, tuned {self.tuned_us:.3f} us: {self.speedup:.3f}x"
            + (" (the public op, fresh process)" if self.op_level and not self.op_level.get("error") else ""),
            f"  outcome      {self.outcome}",
            f"  time         {s.get('total', 0):.1f} s: compile {sh.get('compile', 0):.0%}, test "
            f"{sh.get('test', 0):.0%}, time {sh.get('time', 0):.0%}, verify {sh.get('verify', 0):.0%} "
            f"(setup {s.get('setup', 0):.1f} s, "
            f"plan {s.get('plan', 0):.1f} s)",
        ]
        return "\n".join(lines)


def chosen(report: ConfigReport) -> tuple[Any, Any]:
    """(config, shape) that level 2 anneals after `report`: the winner's config, else the heuristic's."""
    m = kernel_module(report.kernel)
    return m.Config(**(report.winner or report.heuristic)), m.Shape(**report.shape)


def _row(config: Any, compile_s: float) -> dict[str, Any]:
    return {"key": describe(config), "config": dataclasses.asdict(config), "compile_s": compile_s,
            "status": "untimed", "bitwise": False, "max_err": math.nan, "median_us": math.nan, "rel": math.inf,
            "detail": ""}


def tune_configs(kernel: str, mode: str, overrides: Mapping[str, Any] | None = None, *,
                 max_candidates: int = MAX_CANDIDATES, samples: int = 8, reps: int = 30, finalists: int = 3,
                 retime_reps: int = 60, min_speedup: float = 1.01, seed: int = 0, processes: int | None = None,
                 validation_samples: int = 10_000, edge_samples: int = 4, op_rounds: int = oplevel.ROUNDS,
                 sanitize: bool = True, options: Options = Options(),
                 store_root: str | os.PathLike | None = None, log: Callable[[str], None] = print,
                 bench: Callable[[Any, Options], Any] | None = None) -> ConfigReport:
    """Level 1 for `kernel` at Shape.defaults(mode) + overrides (see the module docstring); the
    winner, if any, is stored in the tuned store at `store_root` (None: `paths.tuned_store_root()`).
    samples: input sets each candidate is tested on; validation_samples: fresh sets of its test
    sizes a winner must pass (the store's bar asks for 10^4); edge_samples: sets compared at the
    tuned shape and at each bucket edge; op_rounds: interleaved rounds of the op-level re-time;
    sanitize: run the winner under compute-sanitizer before storing it (False: the entry records
    that it was not, and is below the store's bar; True without compute-sanitizer: ProbeError
    before any work). `bench` replaces the worker's GPU bench (tests pass a CPU stand-in)."""
    missing = sanitize and probe.sanitizer_problem()
    if missing:
        raise probe.ProbeError(f"{missing}: a tuned config is stored only once compute-sanitizer has run it "
                               "(sanitize=False / sip-tune --no-sanitize stores it unchecked)")
    t_start = time.perf_counter()
    space = plan(kernel, mode, overrides, max_candidates)
    report = ConfigReport(kernel, mode, dataclasses.asdict(space.shape), dataclasses.asdict(space.heuristic),
                          space.ranked_by, space.total, space.pruned)
    seconds = report.seconds
    seconds["plan"] = time.perf_counter() - t_start
    say = lambda msg: log(f"[sip-tune configs] {msg}")  # noqa: E731
    say(f"{kernel} {mode}: {space.total} candidates, searching {len(space.candidates)} "
        f"({space.pruned} pruned by {space.ranked_by})")

    t0 = time.perf_counter()
    compiled = compile_configs(space.module.compile, space.candidates, processes)
    original_sha256 = space.module.compile(space.heuristic).cubin_sha256
    seconds["compile"] = time.perf_counter() - t0
    say(f"compiled {len(compiled)} variants in {seconds['compile']:.1f} s")
    rows = [_row(c, compiled[c.variant().key()]) for c in space.candidates]
    report.candidates = rows
    rows[0].update(status="ok", bitwise=True, rel=1.0)

    factory = functools.partial(ConfigSpace, space.module.workload, space.shape, tuple(space.candidates))
    runner = Runner(factory, options, log=say, bench=bench or ConfigBench)
    try:
        t0 = time.perf_counter()
        info = runner.start()
        seconds["setup"] = time.perf_counter() - t0
        report.gpu, report.worker = info["gpu"], info
        say(f"heuristic {info['base_us']:.3f} us per launch on {info['gpu']}")

        t0 = time.perf_counter()
        sample_seed = random.Random(f"sip-configs-{seed}").getrandbits(63)  # the same input sets for every candidate
        for i, row in enumerate(rows[1:], 1):
            kind, answer = runner.request("test", (i, sample_seed, samples), options.eval_timeout_s)
            if kind in ("crash", "timeout"):
                row.update(status=kind, detail=_last_line(answer))
                continue
            row.update(status=answer["status"], bitwise=answer["bitwise"], max_err=answer["max_err"],
                       detail=answer["detail"])
        seconds["test"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        passing = [i for i, row in enumerate(rows) if i and row["status"] == "ok"]
        timing = _time(runner, passing, reps, options, rows)
        report.heuristic_us, report.aa_spread = timing["median_us"][0], abs(timing["rel"][1] - 1)
        rows[0]["median_us"] = report.heuristic_us
        for j, i in enumerate(timing["indices"]):
            rows[i].update(median_us=timing["median_us"][j + 2], rel=timing["rel"][j + 2])
        seconds["time"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        ranked = _pick(report, runner, rows, finalists, retime_reps, min_speedup, options)
        seconds["retime"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        winner = _verify(report, runner, space, ranked, original_sha256, min_speedup, seed, validation_samples,
                         edge_samples, op_rounds, sanitize, options, say)
        seconds["verify"] = time.perf_counter() - t0
    finally:
        runner.close()
    if winner is not None or report.settled:
        # A search that kept the heuristic is recorded too (its config, 1.0x): a resumed
        # `sip-tune --model` skips the bucket, and a later, better result still replaces it.
        from rosekernels import tuned

        meta = {"heuristic_median_us": report.heuristic_us, "tuned_median_us": report.tuned_us,
                "speedup": report.speedup, "aa_spread": max(report.aa_spread, report.retime_aa_spread),
                "outcome": report.outcome, "checks": report.checks,
                "samples": samples, "searched": len(rows), "candidates": space.total, "gpu": report.gpu,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        path, written = tuned.store_config(store_root, space.module, space.shape, winner or space.heuristic,
                                           space.heuristic, original_sha256, meta)
        report.stored = str(path)
        report.outcome += (f"; {'stored' if winner is not None else 'recorded'} at {path}" if written else
                           f"; the entry at {path} is kept (better checked, or as well and faster)")
    seconds["total"] = time.perf_counter() - t_start
    # Re-timing is timing: the shares say where a level-1 run's wall time goes.
    report.shares = {"compile": seconds["compile"] / seconds["total"], "test": seconds["test"] / seconds["total"],
                     "time": (seconds["time"] + seconds["retime"]) / seconds["total"],
                     "verify": seconds["verify"] / seconds["total"]}
    return report


def _time(runner: Runner, indices: list[int], reps: int, options: Options, rows: list[dict]) -> dict[str, Any]:
    """One interleaved timing run of the heuristic (twice) and configs[indices]. Should it crash
    (a candidate that passed its test can still fail in a graph), each candidate is timed alone
    with the heuristic in a fresh worker: the crashing ones are marked and left out."""
    timeout = options.eval_timeout_s * (2 + len(indices))
    kind, answer = runner.request("time", (indices, reps), timeout)
    if kind == "ok":
        return {**answer, "indices": indices}
    kept = []
    for i in indices:
        kind, alone = runner.request("time", ([i], reps), options.eval_timeout_s * 3)
        if kind == "ok":
            kept.append(i)
        else:
            rows[i].update(status=kind, detail=f"in timing: {_last_line(alone)}")
    kind, answer = runner.request("time", (kept, reps), options.eval_timeout_s * (2 + len(kept)))
    if kind != "ok":
        raise WorkerFailure(f"the timing run failed: {_last_line(answer)}")
    return {**answer, "indices": kept}


def _pick(report: ConfigReport, runner: Runner, rows: list[dict], finalists: int, retime_reps: int,
          min_speedup: float, options: Options) -> list[int]:
    """Re-time the fastest `finalists` against the heuristic in a fresh worker; those that beat
    max(min_speedup, 1 + the larger A/A spread) there, fastest first (empty: the heuristic stays)."""
    ranked = sorted((i for i, r in enumerate(rows) if i and r["status"] == "ok" and r["rel"] < 1.0),
                    key=lambda i: rows[i]["rel"])[:finalists]
    report.tuned_us = report.heuristic_us
    if not ranked:
        report.outcome = "no candidate timed faster than the heuristic; the heuristic stays"
        report.settled = True
        return []
    runner.restart()  # nothing the search ran can leak into the re-time
    kind, answer = runner.request("time", (ranked, retime_reps), options.eval_timeout_s * (2 + len(ranked)))
    if kind != "ok":
        report.outcome = f"the re-time failed ({_last_line(answer)}); {NOT_SETTLED}"
        return []
    report.retime_aa_spread = abs(answer["rel"][1] - 1)
    for j, i in enumerate(ranked):
        report.finalists.append({"index": i, "key": rows[i]["key"], "median_us": answer["median_us"][j + 2],
                                 "heuristic_us": answer["median_us"][0], "speedup": 1 / answer["rel"][j + 2]})
    bar = max(min_speedup, 1 + max(report.aa_spread, report.retime_aa_spread))
    past = sorted((f for f in report.finalists if f["speedup"] > bar), key=lambda f: -f["speedup"])
    if not past:
        best = max(f["speedup"] for f in report.finalists)
        report.outcome = (f"the fastest candidate re-timed {best:.4f}x, not above {bar:.4f}x "
                          "(max of min_speedup and the A/A spread); the heuristic stays")
        report.settled = True
    return [f["index"] for f in past]


def _verify(report: ConfigReport, runner: Runner, space: SearchSpace, ranked: list[int], original_sha256: str,
            min_speedup: float, seed: int, validation_samples: int, edge_samples: int, op_rounds: int,
            sanitize: bool, options: Options, say: Callable[[str], None]) -> Any:
    """The first of `ranked` that passes where it will serve (the tuned shape, its bucket's edges,
    `validation_samples` of its test sizes), at the op level and under compute-sanitizer; its
    config, with report.checks, report.op_level and the op-level times filled in. None: no finalist
    passed; report.settled says whether each was refused on its merits (wrong outputs, an op-level
    speedup measured and not past the bar, a sanitizer finding the heuristic does not have), so
    that the heuristic stays, or a check failed to run (a crash, a timeout), which says nothing."""
    heuristic = space.heuristic
    unsettled = False  # a refusal that says nothing about the candidate
    heuristic_verdicts = None  # the heuristic under compute-sanitizer, asked once a finalist is flagged
    for i in ranked:
        config = space.candidates[i]
        finalist = next(f for f in report.finalists if f["index"] == i)
        edges = bucket_edges(space.kernel, space.shape, config, heuristic, seed)
        say(f"verifying {finalist['key']} ({finalist['speedup']:.3f}x): {len(edges)} bucket edges, "
            f"{validation_samples} samples, then the public op" + (", then compute-sanitizer" if sanitize else ""))
        kind, v = runner.request("validate", (i, random.Random(f"sip-validate-{seed}").getrandbits(63),
                                              validation_samples, edges, edge_samples),
                                 options.eval_timeout_s + (validation_samples + edge_samples * len(edges)) * 0.05)
        if kind != "ok":
            finalist["verdict"] = f"not checked: the validation request failed ({kind}: {_last_line(v)})"
            unsettled = True
            continue
        if v["status"] != "ok":
            finalist["verdict"] = f"refused: {v['detail']}"
            continue
        timing = oplevel.retime(space.kernel, space.shape, oplevel.ConfigCandidate(config, heuristic,
                                                                                    original_sha256),
                                rounds=op_rounds)
        say(timing.text())
        if timing.error:
            finalist["verdict"] = f"not checked at the op level: {timing.error}"
            unsettled = True
            continue
        if not timing.passes(min_speedup):
            finalist["verdict"] = f"refused at the op level: {timing.speedup:.4f}x"
            continue
        verdicts: dict[str, str] | str = "not run"
        if sanitize:
            say(f"compute-sanitizer {', '.join(probe.SANITIZER_TOOLS)} on {finalist['key']} at the tuned shape")
            verdicts = probe.sanitize(workload_factory(space.kernel, config, space.shape), None)
            unclean = "; ".join(f"{t} {v}" for t, v in verdicts.items() if v != "clean")
            if unclean:
                if heuristic_verdicts is None:
                    heuristic_verdicts = probe.sanitize(workload_factory(space.kernel, heuristic, space.shape), None)
                if any(v != "clean" for v in heuristic_verdicts.values()):  # not the candidate's doing
                    finalist["verdict"] = ("not checked: compute-sanitizer does not pass the heuristic either "
                                           f"({unclean})")
                    unsettled = True
                    break  # no finalist can pass it here
                finalist["verdict"] = f"refused: compute-sanitizer: {unclean}"
                continue
        finalist["verdict"] = f"verified: {timing.speedup:.4f}x at the op level"
        report.op_level = timing.meta()
        report.checks = {
            "samples": {"run": validation_samples, "passed": v["passed"]},
            "compare": "reference", "tolerance": None, "sanitizer": verdicts,
            "shapes": {"tuned": dataclasses.asdict(space.shape), "tuned_samples": v["shape_passed"],
                       "edges": [dataclasses.asdict(e) for e in edges], "edge_samples": v["edges_passed"],
                       "bitwise_at_shapes": v["bitwise"],
                       "samples": "the kernel's test sizes (Workload.test_args), float64 check"},
            "op_level": report.op_level}
        report.winner, report.winner_key = dataclasses.asdict(config), finalist["key"]
        report.heuristic_us, report.tuned_us, report.speedup = timing.heuristic_us, timing.tuned_us, timing.speedup
        report.outcome = (f"{finalist['key']} is {timing.speedup:.3f}x the heuristic through {timing.op} "
                          f"(worker re-time {finalist['speedup']:.3f}x; A/A {timing.aa_spread:.4f})")
        return config
    if ranked:
        why = "; ".join(f"{f['key']}: {f['verdict']}" for f in report.finalists if f.get("verdict"))
        report.settled = not unsettled
        report.outcome = (f"no candidate past the bar held where it will serve, at the op level and under "
                          f"compute-sanitizer ({why}); " + ("the heuristic stays" if report.settled else
                                                            f"{NOT_SETTLED}: a check failed to run"))
    return None


def _last_line(text: Any) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
