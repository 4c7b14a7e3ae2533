"""SIP on the GPU: which kernels can be tuned, the tune loop, its report, and the `sip-tune` command.

    tune(factory, TuneConfig(...)) -> TuneReport

`factory` is a picklable zero-argument callable returning a `sip.runner.Workload` (the compiled kernel
and its input generator); `workload_factory(kernel, mode, shape)` makes one for the rosekernels ops.
The loop:

1. the parent compiles the kernel (CPU only) and reads its cubin into an engine Schedule;
2. K independent annealing runs (seeds seed, seed+1, ...) share the budget; each proposal is a legal
   move of the engine (sip.mutate), rendered to a cubin (`apply`) and sent to the GPU worker, which
   tests it on fresh random inputs against the original and times it against the original
   (energy = relative time; failed or crashed candidates get +inf);
3. every distinct cubin seen is ranked by its search energy; the best few are re-timed together with
   the original in one interleaved run in a fresh worker, and taken greedily, fastest first: the first
   one that is at least `min_speedup` faster and passes `samples` fresh random samples is cached.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import time
from typing import Any, Callable

import rosekernels  # cheap: the ops themselves load lazily
from sip import SipError, cache, search
from sip.runner import Evaluation, Options, Runner, Workload, WorkerFailure

# ---------------------------------------------------------------------------------------------
# The kernels sip-tune knows: name -> module; the workload builder of each is _<name>_workload below.

KERNELS: dict[str, str] = dict(rosekernels.OPS)


def availability(kernel: str) -> tuple[bool, str]:
    """(tunable now?, why not) -- checked at run time: kernels land in the package over time."""
    if importlib.util.find_spec(KERNELS[kernel]) is None:
        return False, f"module {KERNELS[kernel]} does not exist yet"
    return True, ""


def workload_factory(kernel: str, mode: str, shape: dict[str, Any] | None = None) -> Callable[[], Workload]:
    """A picklable factory of the Workload tuning `kernel` in `mode` at `shape` (None: defaults)."""
    ok, why = availability(kernel)
    if not ok:
        raise LookupError(f"kernel {kernel!r} is not available: {why}")
    return functools.partial(globals()[f"_{kernel}_workload"], mode, dict(shape or {}))


def _module(kernel: str) -> Any:
    import importlib

    from rosekernels import jit  # noqa: F401 - first: it selects sm_90a before CuTeDSL is imported

    return importlib.import_module(KERNELS[kernel])


def _size_range(mode: str, mode_of: Callable[[int], str], cap: int = 1 << 16) -> tuple[int, int]:
    """The sizes to test a variant on: every size of its mode (decode), or the first ones (prefill:
    the same code with more blocks; small sizes keep samples cheap and exercise the ragged tails)."""
    lo = 1
    while lo < cap and mode_of(lo) != mode:
        lo = lo * 2 if mode_of(lo * 2) != mode else lo + 1
    hi = lo
    limit = cap if mode == "decode" else 2 * lo + 64
    while hi < limit and mode_of(hi + 1) == mode:
        hi += 1
    return lo, hi


def _check_mode(kernel: str, mode: str, got: str, shape: dict[str, Any]) -> None:
    if got != mode:
        raise ValueError(f"{kernel}: shape {shape} selects the {got} variant, not {mode}; "
                         f"pass --mode {got} or another size")


def _shape(kernel: str, defaults: dict[str, Any], shape: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(shape) - set(defaults))
    if unknown:
        raise ValueError(f"{kernel}: unknown --shape keys {unknown}; it takes {sorted(defaults)}")
    return {**defaults, **shape}


def _pick(seed: int, lo: int, hi: int) -> int:
    return random.Random(seed).randint(lo, hi)


def _qk_norm_workload(mode: str, shape: dict[str, Any]) -> Workload:
    m = _module("qk_norm")
    s = _shape("qk_norm", {"tokens": 1 if mode == "decode" else 4096, "q_heads": 32, "k_heads": 8,
                           "head_dim": 128, "dtype": "bf16", "weight_dtype": None, "eps": 1e-6,
                           "weight_bias": 0.0}, shape)
    dt, wdt = m.TORCH_DTYPE[s["dtype"]], m.TORCH_DTYPE[s["weight_dtype"] or s["dtype"]]

    def cfg(tokens: int) -> Any:
        return m.config_for(tokens, s["q_heads"], s["k_heads"], s["head_dim"], dt, wdt, s["eps"], s["weight_bias"])

    _check_mode("qk_norm", mode, cfg(s["tokens"]).mode, s)
    variant = cfg(s["tokens"]).variant()
    lo, hi = _size_range(mode, lambda t: cfg(t).mode)
    return Workload(m.compile(variant), lambda seed: m.sample_args(variant, s["tokens"], seed),
                    outputs=lambda a: a[4:6],
                    test_args=lambda seed: m.sample_args(variant, _pick(seed, lo, hi), seed), name="qk_norm")


def _rmsnorm_workload(mode: str, shape: dict[str, Any]) -> Workload:
    m = _module("rmsnorm")
    s = _shape("rmsnorm", {"rows": 1 if mode == "decode" else 4096, "hidden": 4096, "dtype": "bf16",
                           "weight_dtype": None, "residual": False, "eps": 1e-6}, shape)
    dt, wdt = m.TORCH_DTYPE[s["dtype"]], m.TORCH_DTYPE[s["weight_dtype"] or s["dtype"]]

    def cfg(rows: int) -> Any:
        return m.config_for(rows, s["hidden"], dt, wdt, bool(s["residual"]), s["eps"])

    _check_mode("rmsnorm", mode, cfg(s["rows"]).mode, s)
    variant = cfg(s["rows"]).variant()
    lo, hi = _size_range(mode, lambda r: cfg(r).mode)
    return Workload(m.compile(variant), lambda seed: m.sample_args(variant, s["rows"], seed),
                    outputs=lambda a: [t for t in a[3:5] if t is not None],
                    test_args=lambda seed: m.sample_args(variant, _pick(seed, lo, hi), seed), name="rmsnorm")


def _moe_dispatch_workload(mode: str, shape: dict[str, Any]) -> Workload:
    from rosekernels.checks import TORCH_DTYPE

    m = _module("moe_dispatch")
    s = _shape("moe_dispatch", {"tokens": 128 if mode == "decode" else 4096, "hidden": 2048, "experts": 128,
                                "topk": 8, "dtype": "bf16"}, shape)
    dt = TORCH_DTYPE[s["dtype"]]

    def cfg(tokens: int) -> Any:
        return m.config_for(tokens, s["hidden"], s["experts"], s["topk"], dt)

    _check_mode("moe_dispatch", mode, cfg(s["tokens"]).mode, s)
    variant = cfg(s["tokens"]).variant()
    lo, hi = _size_range(mode, lambda t: cfg(t).mode)
    return Workload(m.compile(variant), lambda seed: m.sample_args(variant, s["tokens"], seed),
                    outputs=lambda a: m.outputs(variant, a), launch=m.launch,
                    test_args=lambda seed: m.sample_args(variant, _pick(seed, lo, hi), seed), name="moe_dispatch")


def _moe_combine_workload(mode: str, shape: dict[str, Any]) -> Workload:
    from rosekernels.checks import TORCH_DTYPE

    m = _module("moe_combine")
    s = _shape("moe_combine", {"tokens": 128 if mode == "decode" else 4096, "hidden": 2048, "topk": 8,
                               "dtype": "bf16", "weight_dtype": "fp32"}, shape)
    def cfg(tokens: int) -> Any:
        return m.config_for(tokens, s["hidden"], s["topk"], TORCH_DTYPE[s["dtype"]], TORCH_DTYPE[s["weight_dtype"]])

    _check_mode("moe_combine", mode, cfg(s["tokens"]).mode, s)
    variant = cfg(s["tokens"]).variant()
    lo, hi = _size_range(mode, lambda t: cfg(t).mode)
    return Workload(m.compile(variant), lambda seed: m.sample_args(variant, s["tokens"], seed),
                    outputs=lambda a: a[3:4],
                    test_args=lambda seed: m.sample_args(variant, _pick(seed, lo, hi), seed), name="moe_combine")


def _gemm_leakyrelu_workload(mode: str, shape: dict[str, Any]) -> Workload:
    from rosekernels import modes

    m = _module("gemm_leakyrelu")
    s = _shape("gemm_leakyrelu", {"m": 16 if mode == "decode" else 8192, "n": 14336, "k": 4096, "dtype": "bf16",
                                  "b_major": "k", "bias": "none", "slope": 0.01}, shape)
    sms = modes.sm_count(0)

    def cfg(rows: int) -> Any:
        return m.select_config(rows, s["n"], s["k"], s["dtype"], s["b_major"], s["bias"], s["slope"], sms)[0]

    config = cfg(s["m"])
    _check_mode("gemm_leakyrelu", mode, config.mode, s)
    if mode == "decode":  # the M range that selects this very tile shape
        lo, hi = _size_range(mode, lambda r: mode if cfg(r) == config else "x", cap=m.DECODE_MAX_M)
    else:  # any M past the decode range runs the same code; small ones keep samples cheap
        lo, hi = m.DECODE_MAX_M + 1, 4 * m.DECODE_MAX_M + 64

    def test_args(seed: int) -> tuple:
        r = random.Random(seed)  # ragged M, N and K tails, small enough for cheap samples
        case = m.TuningCase(config, r.randint(lo, hi), 8 * r.randint(1, 200), 8 * r.randint(1, 200))
        return case.make_args(seed=seed)

    return Workload(m.compiled(config),
                    lambda seed: m.TuningCase(config, s["m"], s["n"], s["k"]).make_args(seed=seed),
                    outputs=lambda a: a[2:3], test_args=test_args, name="gemm_leakyrelu")


def _attention_workload(mode: str, shape: dict[str, Any]) -> Workload:
    m = _module("attention")
    if mode != "prefill":
        raise ValueError("attention: the prefill kernel serves every sequence length; tune it with --mode prefill "
                         "(the split-KV kernel of short queries is --kernel attention_decode --mode decode)")
    s = _shape("attention", {"batch": 2, "seqlen": 2048, "heads_q": 16, "heads_kv": 16, "head_dim": 128,
                             "dtype": "bf16", "causal": False}, shape)
    config = m.default_config(s["head_dim"], s["dtype"], bool(s["causal"]), s["seqlen"])

    def poisoned(args: tuple) -> tuple:
        args[3].fill_(math.nan)  # out and lse come back empty(): poison them
        args[4].fill_(math.nan)
        return args

    def test_args(seed: int) -> tuple:
        r = random.Random(seed)
        return poisoned(m.example_inputs(config, r.randint(1, 2), r.randint(1, 3 * config.tile_m + 7),
                                         s["heads_q"], s["heads_kv"], seed=seed))

    return Workload(m.compiled(config),
                    lambda seed: poisoned(m.example_inputs(config, s["batch"], s["seqlen"], s["heads_q"],
                                                           s["heads_kv"], seed=seed)),
                    outputs=lambda a: a[3:5], test_args=test_args, name="attention")


def _attention_decode_workload(mode: str, shape: dict[str, Any]) -> Workload:
    m = _module("attention_decode")
    if mode != "decode":
        raise ValueError("attention_decode: the split-KV kernel of short queries; tune it with --mode decode")
    s = _shape("attention_decode", {"batch": 16, "seqlen_q": 1, "seqlen_kv": 4096, "heads_q": 32, "heads_kv": 8,
                                    "head_dim": 128, "dtype": "bf16", "causal": False}, shape)
    config = m.config_for(s["head_dim"], s["dtype"], s["seqlen_q"] * s["heads_q"] // s["heads_kv"])

    def inputs(batch: int, seqlen_kv: int, seed: int) -> tuple:
        return m.example_inputs(config, batch, s["seqlen_q"], seqlen_kv, s["heads_q"], s["heads_kv"],
                                bool(s["causal"]), seed=seed)

    def test_args(seed: int) -> tuple:
        r = random.Random(seed)  # other batch sizes and ragged KV lengths: other split counts and tails
        return inputs(r.randint(1, 3), r.randint(1, 5000), seed)

    return Workload(m.compiled(config), lambda seed: inputs(s["batch"], s["seqlen_kv"], seed),
                    outputs=lambda a: a[3:5], test_args=test_args, name="attention_decode")


# ---------------------------------------------------------------------------------------------
# The engine: sip.cubin / sip.sass / sip.deps / sip.mutate, behind four functions.

def engine_initial(cubin: bytes) -> Any:
    """The schedule the cubin has (of its largest kernel: CuTeDSL cubins hold one)."""
    from sip import cubin as elf, deps, mutate, sass

    parsed = elf.parse_cubin(cubin)
    kernels = [k for k in parsed.kernels() if k.entry] or parsed.kernels()
    if not kernels:
        raise ValueError("the cubin holds no kernel code")
    name = max(kernels, key=lambda k: k.instruction_count).name
    return mutate.Schedule.initial(deps.DependencyModel(sass.disassemble_kernel(parsed, name)))


def engine_neighbour(schedule: Any, rng: random.Random) -> Any | None:
    """One random legal move away (the engine's own policy, seeded from `rng`); None: no legal move."""
    from sip import mutate

    moved, moves = mutate.random_walk(schedule, 1, rng.getrandbits(63))
    return moved if moves else None


def engine_apply(schedule: Any) -> bytes:
    from sip import mutate

    return mutate.apply(schedule)


def engine_stats(schedule: Any) -> tuple[int, int, int]:
    """(instructions, movable instructions, legal moves) of a schedule, for the report."""
    from sip import mutate

    return len(schedule.model.instructions), len(mutate.movable(schedule.model)), len(schedule.moves())


def with_extra_stalls(cubin: bytes, stall: int = 11, every: int = 1) -> bytes:
    """The cubin with the stall count of every `every`-th instruction raised to `stall`: same code,
    same results, only slower. Shows that the energy resolves a real difference. (nvdisasm rejects
    stalls of 12-15 on a no-yield instruction as undefined encodings, hence 11.)"""
    from sip import cubin as elf, sass

    parsed = elf.parse_cubin(cubin)
    for code in parsed.kernels():
        text = bytearray(parsed.text(code.name))
        for k in range(0, len(text) // elf.INSTRUCTION_BYTES, every):
            at = slice(k * elf.INSTRUCTION_BYTES, (k + 1) * elf.INSTRUCTION_BYTES)
            word = int.from_bytes(text[at], "little")
            ctl = sass.Control.from_word(word)
            if ctl.stall < stall:
                ctl = dataclasses.replace(ctl, stall=stall)
                text[at] = sass.with_control(word, ctl.bits).to_bytes(elf.INSTRUCTION_BYTES, "little")
        parsed = elf.parse_cubin(parsed.with_text(code.name, bytes(text)))
    return parsed.to_bytes()


# ---------------------------------------------------------------------------------------------
# The tune loop.

@dataclasses.dataclass(frozen=True)
class TuneConfig:
    budget_iters: int | None = None  # total over all runs
    budget_seconds: float | None = None  # total search time over all runs
    runs: int = 2
    seed: int = 0
    samples: int = 10_000  # final validation: fresh random samples through both kernels
    search_samples: int = 2  # per candidate during the search
    t_max: float = 0.02
    t_min: float = 2e-4
    cooling: float | None = None
    finalists: int = 4
    compare_reps: int = 60
    min_speedup: float = 1.01  # cache only a schedule at least this much faster (0: the best one that passes)
    exhausted_after: int = 500  # end a run when this many proposals in a row were measured before
    tolerance: tuple[float, float] | None = None
    options: Options = Options()

    def __post_init__(self) -> None:
        if (self.budget_iters is None) == (self.budget_seconds is None):
            raise ValueError("give exactly one budget: iterations or seconds")
        if self.runs < 1 or self.samples < 1 or self.search_samples < 1 or self.finalists < 1:
            raise ValueError("runs, samples, search_samples and finalists must be >= 1")

    def anneal(self) -> search.AnnealConfig:
        return search.AnnealConfig(self.t_max, self.t_min, self.cooling, self.budget_iters,
                                   self.budget_seconds).split(self.runs)


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
    original_sha256: str = ""
    cubin_bytes: int = 0
    movable: int = 0  # instructions the mutation policy may move
    legal_moves: int = 0  # at the start
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
    speedup: float = 1.0
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
            f"  timing       {self.worker.get('launches_per_graph', '?')} launches per CUDA graph over "
            f"{self.worker.get('input_sets', '?')} input sets ({self.worker.get('bytes_cycled', 0) / 2**20:.1f} MiB)",
            f"  search       {self.iterations} iterations in {len(self.runs)} runs, {self.search_seconds:.1f} s; "
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
        for f in self.finalists:
            lines.append(f"  finalist {f['digest'][:12]}: search {f['search_rel']:.4f}, re-timed {f['rel']:.4f}"
                         + (f", validation: {f['validation']}" if f.get("validation") else ""))
        lines += [
            f"  result       original {self.baseline_us:.3f} us, tuned {self.tuned_us:.3f} us per launch: "
            f"{self.speedup:.3f}x ({self.samples_passed} samples passed)",
            f"  outcome      {self.outcome}",
            f"  total        {self.total_seconds:.1f} s",
        ]
        return "\n".join(lines)


def _digest(cubin: bytes) -> str:
    return hashlib.sha256(cubin).hexdigest()


def tune(factory: Callable[[], Workload], config: TuneConfig, *, kernel: str | None = None,
         cache_root: str | os.PathLike | None = None, log: Callable[[str], None] = print,
         candidate_hook: Callable[[bytes], bytes] | None = None) -> TuneReport:
    """Search, validate and (if it pays) cache a tuned cubin for the workload `factory` builds.

    `candidate_hook` (tests only) rewrites every proposed cubin before it is run."""
    t_start = time.monotonic()
    workload = factory()  # compiles (CPU); the worker builds its own from the disk cache
    original, variant = workload.kernel.cubin, workload.kernel.variant
    kernel = kernel or workload.name or variant.op
    report = TuneReport(kernel, variant.key(), variant.mode, original_sha256=_digest(original),
                        cubin_bytes=len(original), config=_config_dict(config))
    options = dataclasses.replace(config.options, tolerance=config.tolerance)
    memo: dict[str, float] = {_digest(original): 1.0}
    costs: dict[str, list[float]] = {k: [] for k in ("apply", "load", "test", "time", "total")}
    t0 = time.perf_counter()
    initial = engine_initial(original)  # CPU only: fails fast, before any GPU work, on a cubin SIP cannot read
    count, report.movable, report.legal_moves = engine_stats(initial)
    log(f"[sip-tune] {kernel}: {count} instructions, {report.movable} movable, "
        f"{report.legal_moves} legal moves at the start ({time.perf_counter() - t0:.1f} s to disassemble)")
    if report.legal_moves == 0:
        report.outcome = ("the engine finds no legal move in this kernel (its memory instructions are pinned); "
                          "nothing to tune")
        report.total_seconds = time.monotonic() - t_start
        return report
    runner = Runner(factory, options, log=lambda m: log(f"[sip-tune] {m}"))
    try:
        info = runner.start()
        report.gpu, report.worker = info["gpu"], info
        log(f"[sip-tune] {kernel} {variant.key()} on {info['gpu']}: original {info['base_us']:.3f} us per launch, "
            f"{info['launches_per_graph']} launches per graph over {info['input_sets']} input sets")

        seen_in_a_row = [0]  # proposals in a row whose cubin was measured before

        def neighbour(state: Candidate, rng: random.Random) -> Candidate | None:
            if seen_in_a_row[0] >= config.exhausted_after:
                return None  # the space around here is exhausted: end the run early
            t0 = time.perf_counter()
            schedule = engine_neighbour(state.schedule, rng)
            if schedule is None:
                return None
            cubin = engine_apply(schedule)
            if candidate_hook is not None:
                cubin = candidate_hook(cubin)
            costs["apply"].append(time.perf_counter() - t0)
            return Candidate(schedule, cubin, _digest(cubin))

        sample_seeds = random.Random(f"sip-samples-{config.seed}")

        def energy(c: Candidate) -> float:
            if c.digest in memo:
                seen_in_a_row[0] += 1
                return memo[c.digest]
            seen_in_a_row[0] = 0
            ev: Evaluation = runner.evaluate(c.cubin, sample_seeds.getrandbits(63), config.search_samples)
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

        pool: dict[str, tuple[float, bytes]] = {}
        acfg = config.anneal()
        t_search = time.monotonic()
        for r in range(config.runs):
            seed = config.seed + r
            seen_in_a_row[0] = 0
            start = Candidate(initial, original, _digest(original))
            progress = _Progress(log, f"run {r + 1}/{config.runs}", acfg)
            result = search.anneal(start, neighbour, energy, acfg, seed, key=lambda c: c.digest,
                                   keep=config.finalists, on_step=progress)
            progress.done(result)
            report.runs.append({"seed": seed, "iterations": result.iterations, "accepted": result.accepted,
                                "best_rel": result.best_energy, "seconds": result.seconds,
                                "exhausted": seen_in_a_row[0] >= config.exhausted_after,
                                "feedback": sum(s.reward for s in result.steps)})
            report.iterations += result.iterations
            for e, digest, cand in result.top:
                if digest != report.original_sha256 and math.isfinite(e) and e < pool.get(digest, (math.inf,))[0]:
                    pool[digest] = (e, cand.cubin)
        report.search_seconds = time.monotonic() - t_search
        report.crashed, report.timeouts = runner.crashes, runner.timeouts
        _fill_costs(report, costs)
        _finish(report, runner, pool, config, kernel, variant, original, cache_root, log)
        report.worker_starts = runner.starts
    finally:
        runner.close()
        report.total_seconds = time.monotonic() - t_start
    return report


def _finish(report: TuneReport, runner: Runner, pool: dict[str, tuple[float, bytes]], config: TuneConfig,
            kernel: str, variant: Any, original: bytes, cache_root: Any, log: Callable[[str], None]) -> None:
    """Greedy pick: re-time the best few against the original in one interleaved run (fresh worker),
    then validate fastest first; cache the first that is fast enough and passes."""
    ranked = sorted(pool.items(), key=lambda kv: kv[1][0])[:config.finalists]
    if not ranked:
        report.outcome = "no candidate passed testing; nothing cached"
        return
    runner.restart()  # nothing a candidate did during the search can leak into the final checks
    timing = runner.compare([cubin for _, (_, cubin) in ranked], config.compare_reps)
    report.baseline_us = timing["median_us"][0]
    for i, (digest, (e, cubin)) in enumerate(ranked):
        report.finalists.append({"digest": digest, "search_rel": e, "rel": timing["rel"][i + 1],
                                 "median_us": timing["median_us"][i + 1], "cubin": cubin})
    report.finalists.sort(key=lambda f: f["rel"])
    for f in report.finalists:
        speedup = 1.0 / f["rel"]
        if speedup < config.min_speedup:
            f["validation"] = f"skipped: {speedup:.3f}x < {config.min_speedup}x"
            continue
        log(f"[sip-tune] validating {f['digest'][:12]} ({speedup:.3f}x) on {config.samples} fresh samples")
        v = runner.validate(f["cubin"], random.Random(f"sip-final-{config.seed}").getrandbits(63), config.samples)
        f["validation"] = f"{v['status']}: {v['passed']} passed in {v['seconds']:.1f} s" + (
            f" ({_last_line(v['detail'])})" if v.get("detail") else "")
        if v["status"] != "ok":
            continue
        report.tuned_us, report.speedup, report.samples_passed = f["median_us"], speedup, v["passed"]
        meta = {"baseline_median_us": report.baseline_us, "tuned_median_us": f["median_us"],
                "speedup": speedup, "samples_passed": v["passed"], "search": report.config,
                "seed": config.seed, "gpu": report.gpu, "iterations": report.iterations,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        path, written = cache.store(cache_root, kernel, variant, original, f["cubin"], meta)
        report.cached = str(path)
        report.outcome = (f"cached {speedup:.3f}x at {path}" if written else
                          f"kept the existing, faster entry at {path} (this run: {speedup:.3f}x)")
        break
    else:
        report.outcome = ("no finalist was faster by the required margin and correct on every sample; "
                          "nothing cached (the untuned kernel stays)")
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


# ---------------------------------------------------------------------------------------------
# The command line: sip-tune.

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code 2, our wording
        self.print_usage(sys.stderr)
        self.exit(2, f"sip-tune: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sip-tune", description="Tune the SASS schedule of a rosekernels kernel on this GPU "
                "(simulated annealing + probabilistic testing) and cache the result for rosekernels.warmup.")
    p.add_argument("--kernel", choices=sorted(KERNELS), help="the kernel to tune")
    p.add_argument("--mode", choices=("prefill", "decode"), default="decode")
    p.add_argument("--shape", default="", metavar="K=V,...",
                   help="sizes and options of the kernel, e.g. tokens=4,q_heads=32,k_heads=8,head_dim=128,dtype=bf16")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-iters", type=int, metavar="N", help="annealing iterations over all runs")
    budget.add_argument("--budget-minutes", type=float, metavar="M",
                        help="search time over all runs (default 10 when no budget is given)")
    p.add_argument("--runs", type=int, default=2, metavar="K", help="independent annealing runs (seeds S..S+K-1)")
    p.add_argument("--samples", type=int, default=10_000, metavar="N",
                   help="fresh random samples the winner must pass before it is cached (up to 1e7)")
    p.add_argument("--search-samples", type=int, default=2, metavar="N", help="samples per candidate in the search")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", metavar="DIR", help=f"tuned-cubin cache (default ${cache.ENV_VAR} or "
                   "<rosekernels cache>/sip)")
    p.add_argument("--min-speedup", type=float, default=1.01, help="cache only if at least this much faster")
    p.add_argument("--rtol", type=float, help="compare outputs with this tolerance instead of bitwise")
    p.add_argument("--atol", type=float, help="(with --rtol) absolute tolerance")
    p.add_argument("--t-max", type=float, default=0.02, help="initial temperature (relative time units)")
    p.add_argument("--t-min", type=float, default=2e-4, help="final temperature")
    p.add_argument("--cooling", type=float, help="cooling factor L (T <- T/L); default: derived from the budget")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--list", action="store_true", help="list the cache entries and exit")
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


def gpu_problem() -> str | None:
    """Why this machine cannot tune (None: it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    cap = torch.cuda.get_device_capability(0)
    if cap != (9, 0):
        return f"device 0 is sm_{cap[0]}{cap[1]} ({torch.cuda.get_device_name(0)})"
    return None


def _print_entries(root: str | None) -> None:
    rows = cache.list_entries(root)
    print(f"tuned-cubin cache {cache.resolve_root(root)}: {len(rows)} entries")
    for r in rows:
        if r["valid"]:
            print(f"  {r['kernel']:<15} {r['mode']:<8} {r.get('speedup', math.nan):.3f}x  "
                  f"{r.get('samples_passed', '?'):>8} samples  {r.get('gpu', '?')}  {r.get('date', '?')}  "
                  f"{r['spec_key']}")
        else:
            print(f"  {r['kernel']:<15} BROKEN: {r['error']}  ({r['path']})")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        _print_entries(args.cache)
        return 0
    if args.kernel is None:
        parser.error("--kernel is required (or --list)")
    if args.budget_iters is not None and args.budget_iters < 1:
        parser.error("--budget-iters must be >= 1")
    if args.budget_minutes is not None and not args.budget_minutes > 0:
        parser.error("--budget-minutes must be > 0")
    if not 1 <= args.samples <= 10**7:
        parser.error("--samples must be in [1, 1e7]")
    if args.runs < 1 or args.search_samples < 1:
        parser.error("--runs and --search-samples must be >= 1")
    if (args.atol is not None) and args.rtol is None:
        parser.error("--atol needs --rtol")
    try:
        shape = parse_shape(args.shape)
    except ValueError as e:
        parser.error(str(e))
    ok, why = availability(args.kernel)
    if not ok:
        tunable = [k for k in sorted(KERNELS) if availability(k)[0]]
        print(f"sip-tune: kernel {args.kernel!r} is not available yet ({why}). "
              f"Tunable now: {', '.join(tunable) or 'none'}.", file=sys.stderr)
        return 2
    problem = gpu_problem()
    if problem:
        print(f"sip-tune: needs a CUDA sm_90 GPU (H100/H200) to run and time candidates: {problem}.",
              file=sys.stderr)
        return 2
    minutes = args.budget_minutes  # (the two budgets exclude each other)
    if args.budget_iters is None and minutes is None:
        minutes = 10.0
    config = TuneConfig(
        budget_iters=args.budget_iters, budget_seconds=None if minutes is None else minutes * 60,
        runs=args.runs, seed=args.seed, samples=args.samples, search_samples=args.search_samples,
        t_max=args.t_max, t_min=args.t_min, cooling=args.cooling, min_speedup=args.min_speedup,
        tolerance=None if args.rtol is None else (args.rtol, args.atol or 0.0))
    try:
        factory = workload_factory(args.kernel, args.mode, shape)
        report = tune(factory, config, kernel=args.kernel, cache_root=args.cache)
    except (SipError, ValueError, LookupError, WorkerFailure) as e:
        print(f"sip-tune: {e}", file=sys.stderr)
        return 1
    print(report.text())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    return 0


if __name__ == "__main__":  # python -m sip.tuning: run the importable module, which workers unpickle from
    from sip.tuning import main as _main

    sys.exit(_main())
