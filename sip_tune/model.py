"""`sip-tune --model CONFIG.json --mode decode|prefill`: level 1 (configs) for every kernel and shape
one forward pass of a model runs.

    shapes(ModelDims.from_config("config.json"), "decode")  -> ModelShapes   (CPU only)
    tune(shapes, budget_s=600, ...)                          -> list[Row]     (GPU)
    gains(rows, "decode")                                    -> Gains         (what the store now holds)

The shapes are those of a Qwen3/Llama decoder block as rosekernels.hf runs it (its GEMMs:
gemm_leakyrelu_plan.model_gemms; where the model has experts, rosekernels.moe_experts' kernels: the
routing and the expert GEMMs, grouped_gemm_plan.model_gemms, at T x top-k rows), one set per token count
T of the mode's buckets:

- decode, DECODE_TOKENS = 1, 2, 4, ..., 128: T concurrent sequences, one new token each, up to
  gemm_leakyrelu's DECODE_MAX_M (beyond it the GEMM runs its prefill kernels); attention reads a
  KV cache of DECODE_CONTEXT tokens per sequence.
- prefill, PREFILL_TOKENS = 512, 1024, ..., 16384: the chunk sizes serving engines prefill in; one
  sequence of T tokens for attention (causal).

Powers of two because the tuned store keys entries by bucket (every size field raised to the next
power of two, `rosekernels.contract.bucket`): the entry tuned at T serves every count in (T/2, T].

A shape whose config the kernel's heuristic (`config_for`, on this CPU) does not put in the mode
asked for, or rejects, is dropped and reported (e.g. qk_norm at 64 decode tokens already runs its
prefill kernel; `sip-tune --kernel qk_norm --mode prefill --shape tokens=64` tunes that one), and so
is one whose kernel has a single config there (the norms' decode mode): level 1 would only time it.
Resuming: a shape whose bucket has a stored entry tuned against the heuristic's cubin as it compiles
now, meeting the tuned store's bar, is skipped, one where the heuristic stayed included (its search is
recorded as the bucket's config at 1.0x; a later, better result replaces it); an entry below the bar
(written before entries recorded their checks, or with weaker ones) is tuned again.

The budget: shapes run in order (token count by token count, smallest first: the batches a server
sees most), and a shape is started only if the longest search so far (SHAPE_ESTIMATE_S before the
first) fits in what is left; the rest are reported as not reached, and the next run resumes there.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Iterable

from rosekernels import tuned
from rosekernels.kernels import grouped_gemm_plan, kernel_module, moe_route_plan
from rosekernels.kernels.gemm_leakyrelu_plan import DECODE_MAX_M, model_gemms
from rosekernels.models import ModelDims
from sip import SipError
from sip_tune import configs, workloads
from sip_tune.runner import WorkerFailure

DECODE_TOKENS = tuple(2**i for i in range(DECODE_MAX_M.bit_length()))  # 1 .. 128
PREFILL_TOKENS = tuple(2**i for i in range(9, 15))  # 512 .. 16384
TOKENS = {"decode": DECODE_TOKENS, "prefill": PREFILL_TOKENS}
DECODE_CONTEXT = 4096  # KV-cache tokens per sequence that decode attention is tuned at (bucket 2049..4096)

# A shape the kernel cannot take fails in its plan module with one of these (as for --shape in cli).
BAD_SHAPE = (ValueError, LookupError, TypeError)
# What one shape's search is assumed to take before any has run: decode GEMM shapes took 13-28 s on
# the H200 host, Qwen3-8B's 40 decode shapes about 17 minutes in all.
SHAPE_ESTIMATE_S = 30.0
NOT_REACHED = "not reached: budget spent"
NOT_RECORDED = "not recorded"  # a search whose checks failed to run: no entry, searched again next time


@dataclasses.dataclass(frozen=True)
class Job:
    """One (kernel, shape) to tune: `overrides` on the kernel's Shape.defaults(mode)."""

    kernel: str
    role: str  # which part of the block runs it, for the table ("qkv", "mlp down", "residual", ...)
    overrides: tuple[tuple[str, Any], ...]
    tokens: int = 0  # the token count of the block it belongs to

    @property
    def shape(self) -> dict[str, Any]:
        return dict(self.overrides)

    def label(self) -> str:
        sizes = ",".join(f"{k}={v}" for k, v in self.overrides if k != "dtype")
        return f"{self.role} {sizes}".strip()


@dataclasses.dataclass
class ModelShapes:
    dims: ModelDims
    mode: str
    jobs: list[Job]  # what the kernels accept in `mode`, in block order, token count by token count
    dropped: list[tuple[Job, str]]  # and why each of the others was left out


def _job(kernel: str, role: str, block_tokens: int, **overrides: Any) -> Job:
    return Job(kernel, role, tuple(overrides.items()), block_tokens)


def _block(dims: ModelDims, mode: str, tokens: int) -> list[Job]:
    """The kernel calls of one decoder block at `tokens` tokens, in the order it runs them."""
    dt = dims.dtype
    heads = dict(heads_q=dims.heads_q, heads_kv=dims.heads_kv, head_dim=dims.head_dim, dtype=dt)
    gemm = {role: _job("gemm_leakyrelu", role, tokens, m=tokens, n=n, k=k, dtype=dt, activation=activation,
                       gated=gated)
            for role, n, k, activation, gated in model_gemms(dims)}

    def gemms(*roles: str) -> list[Job]:  # those of `roles` that run on rosekernels
        return [gemm[r] for r in roles if r in gemm]

    # The first norm of a layer has no residual to add; every later one adds the previous sub-layer's output.
    jobs = [_job("rmsnorm", "norm", tokens, rows=tokens, hidden=dims.hidden, dtype=dt, residual=False),
            _job("rmsnorm", "norm + residual", tokens, rows=tokens, hidden=dims.hidden, dtype=dt, residual=True),
            *gemms("q/k/v", "q", "k/v")]
    if dims.qk_norm:  # Qwen3's per-head norms; Llama and most others have none
        jobs.append(_job("qk_norm", "q/k norm + rope", tokens, tokens=tokens, q_heads=dims.heads_q,
                         k_heads=dims.heads_kv, head_dim=dims.head_dim, dtype=dt, rope=dt))
    if mode == "decode":
        jobs.append(_job("attention_decode", "attention", tokens, batch=tokens, seqlen_q=1,
                         seqlen_kv=DECODE_CONTEXT, **heads))
    else:
        jobs.append(_job("attention", "attention", tokens, batch=1, seqlen=tokens, causal=True, **heads))
    jobs += gemms("o")
    if moe_route_plan.takes(dims.experts, dims.topk):  # the router after its GEMM (hf); none for dense models
        jobs.append(_job("moe_route", "moe router", tokens, tokens=tokens, experts=dims.experts, topk=dims.topk,
                         dtype=dt, weight_dtype=dt, renormalize=dims.norm_topk))
    if dims.experts:  # rosekernels.moe_experts: dispatch, the expert GEMMs on T x top-k rows, combine
        jobs += [_job("moe_dispatch", "moe dispatch", tokens, tokens=tokens, hidden=dims.hidden,
                      experts=dims.experts, topk=dims.topk, dtype=dt),
                 *[_job("grouped_gemm", role, tokens, rows=tokens * dims.topk, experts=dims.experts, n=n, k=k,
                        dtype=dt, activation=activation, gated=gated)
                   for role, n, k, activation, gated in grouped_gemm_plan.model_gemms(dims)],
                 _job("moe_combine", "moe combine", tokens, tokens=tokens, hidden=dims.hidden, topk=dims.topk,
                      dtype=dt)]
    else:
        jobs += gemms("mlp gate/up", "mlp down")
    return jobs


def shapes(dims: ModelDims, mode: str) -> ModelShapes:
    """Every (kernel, shape) a forward pass of `dims` runs in `mode` over TOKENS[mode] (duplicates,
    e.g. an o projection as wide as the MLP's down one, once), split into those the kernels accept in
    `mode` and the dropped ones with the reason."""
    if mode not in TOKENS:
        raise ValueError(f"mode must be one of {sorted(TOKENS)}, got {mode!r}")
    found = ModelShapes(dims, mode, [], [])
    seen: set[tuple[str, tuple]] = set()
    for tokens in TOKENS[mode]:
        for job in _block(dims, mode, tokens):
            if (job.kernel, job.overrides) in seen:
                continue
            seen.add((job.kernel, job.overrides))
            try:
                _, shape = workloads.resolve(job.kernel, mode, job.shape)
            except BAD_SHAPE as e:
                found.dropped.append((job, str(e)))
                continue
            if len(kernel_module(job.kernel).candidates(shape)) == 1:
                found.dropped.append((job, f"one config in {mode} mode: nothing to search (its SASS: "
                                           f"sip-tune --kernel {job.kernel} --levels sass)"))
                continue
            found.jobs.append(job)
    return found


# ---------------------------------------------------------------------------------------------
# Tuning (GPU).

@dataclasses.dataclass
class Row:
    """One line of the final table."""

    job: Job
    status: str  # the report's outcome, "skipped: already tuned", or "failed: <reason>"
    heuristic_us: float = math.nan
    tuned_us: float = math.nan
    speedup: float = math.nan
    aa_spread: float = math.nan
    report: configs.ConfigReport | None = None


def stored_entry(job: Job, mode: str, store_root: Any = None) -> tuned.ConfigEntry | None:
    """The tuned-store entry for `job`'s bucket tuned against its heuristic's cubin as it compiles
    now, if one meets the store's bar. The heuristic is compiled only when the store holds an entry
    for this bucket and heuristic config at all (compiling costs seconds; most shapes have none on a
    first run)."""
    heuristic, shape = workloads.resolve(job.kernel, mode, job.shape)
    bkey = tuned.bucket_key(shape)
    m = kernel_module(job.kernel)
    if not any(tuned.bucket_key(m.Shape(**e.meta["bucket"])) == bkey and e.heuristic == heuristic
               for e in tuned.config_entries(store_root, m)):
        return None
    entry = tuned.lookup_config(store_root, m, shape, heuristic, m.compile(heuristic).cubin_sha256)
    return entry if entry is not None and not entry.problems else None


def _progress(jobs: list[Job]) -> tuple[Iterable[Job], Callable[[str], None]]:
    """The jobs wrapped in a tqdm bar and the matching way to print beside it, or the plain jobs and print."""
    try:
        from tqdm import tqdm
    except ImportError:
        return jobs, print
    return tqdm(jobs, desc="sip-tune --model", unit="shape"), tqdm.write


def tune(found: ModelShapes, *, store_root: Any = None, max_candidates: int = configs.MAX_CANDIDATES,
         min_speedup: float = 1.01, seed: int = 0, budget_s: float | None = None, sanitize: bool = True,
         clock: Callable[[], float] = time.monotonic) -> list[Row]:
    """Level 1 (`configs.tune_configs`, its winners run under compute-sanitizer unless `sanitize` is
    False) for every job of `found` in turn, skipping those already tuned, within `budget_s` seconds
    (None: no limit; see the module docstring); a job that fails is reported in its row and the next
    one runs, and so is one whose search recorded nothing (a check failed to run: the next run
    searches it again)."""
    rows: list[Row] = []
    start, searches = clock(), []  # the seconds each search took
    jobs, write = _progress(found.jobs)
    for i, job in enumerate(jobs, 1):
        if budget_s is not None:
            left = budget_s - (clock() - start)
            if left < (max(searches) if searches else SHAPE_ESTIMATE_S):
                rest = found.jobs[i - 1:]
                write(f"budget: {left:.0f} s left, less than a shape's search: {len(rest)} shapes not reached")
                rows += [Row(j, NOT_REACHED) for j in rest]
                break
        write(f"[{i}/{len(found.jobs)}] {job.kernel} {job.label()}")
        try:
            entry = stored_entry(job, found.mode, store_root)
            if entry is not None:
                meta = entry.meta
                rows.append(Row(job, "skipped: already tuned", meta.get("heuristic_median_us", math.nan),
                                meta.get("tuned_median_us", math.nan), entry.speedup, meta.get("aa_spread", math.nan)))
                write(f"  skipped: {entry.path} holds {entry.config.variant().key()} ({entry.speedup:.3f}x)")
                continue
            t0 = clock()
            try:
                report = configs.tune_configs(job.kernel, found.mode, job.shape, max_candidates=max_candidates,
                                              min_speedup=min_speedup, seed=seed, sanitize=sanitize,
                                              store_root=store_root, log=write)
            finally:
                searches.append(clock() - t0)
        except (*BAD_SHAPE, SipError, WorkerFailure) as e:
            rows.append(Row(job, f"failed: {e}"))
            write(f"  failed: {e}")
            continue
        write(report.text())
        status = ("tuned" if report.winner is not None else "heuristic stays" if report.settled else
                  f"{NOT_RECORDED}: {report.outcome}")
        rows.append(Row(job, status, report.heuristic_us, report.tuned_us, report.speedup, report.aa_spread, report))
    return rows


# ---------------------------------------------------------------------------------------------
# What it gained: read back from the store, so that the summary says what the ops will launch.

# The speedup the summary reports for a stored entry, and what it measures. Level 1 re-times its winner
# against the heuristic in a fresh worker, each kernel alone in a CUDA graph, and stores that ratio; an
# op-level re-time recorded in the entry (issue 41) is read here, in this one place.
GAIN_LABEL = ("time of the public op in a CUDA graph over inputs rotated past L2, re-timed in a fresh process: "
              "heuristic / tuned config (entries without that re-time: the kernel time level 1 measured)")


def stored_gain(entry: tuned.ConfigEntry) -> tuple[float, float]:
    """(the heuristic's time in us, the speedup over it) that the store records for `entry`: the
    op-level re-time (`sip_tune.oplevel`) where there is one, which is also what meta["speedup"] holds."""
    checks = entry.meta.get("checks")
    op = checks.get("op_level") if isinstance(checks, dict) else None
    if isinstance(op, dict) and isinstance(op.get("heuristic_us"), (int, float)):
        return float(op["heuristic_us"]), entry.speedup
    kernel_us = entry.meta.get("heuristic_median_us")
    return float(kernel_us) if isinstance(kernel_us, (int, float)) else math.nan, entry.speedup


@dataclasses.dataclass
class Gains:
    mode: str
    label: str
    # per shape with a stored entry: kernel, shape (label), tokens, heuristic_us, speedup, config (its
    # variant key; None where the heuristic stays)
    shapes: list[dict[str, Any]]
    not_tuned: int  # shapes with no entry: not reached within the budget, failed, or not recorded

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self) -> str:
        faster = [g for g in self.shapes if g["config"] is not None and g["speedup"] > 1]
        lines = [f"What the tuned store gives this model in {self.mode} (speedup: {self.label}):"]
        if faster:
            ups = sorted(g["speedup"] for g in faster)
            mean = math.exp(sum(map(math.log, ups)) / len(ups))
            lines.append(f"  {len(faster)} of {len(self.shapes)} tuned shapes launch a faster config: "
                         f"{ups[0]:.3f}-{ups[-1]:.3f}x (geometric mean {mean:.3f}x); the others keep the heuristic")
        else:
            lines.append(f"  none of the {len(self.shapes)} tuned shapes found a config faster than the heuristic "
                         "past the A/A spread: the heuristic stays for all")
        timed = [g for g in self.shapes if g["heuristic_us"] > 0 and g["speedup"] > 0]
        if timed:
            lines.append("  kernel time of the tuned shapes per decoder block (each distinct shape once):")
            lines.append(f"    {'tokens':>6}  {'shapes':>6}  {'heuristic us':>12}  {'tuned us':>9}  speedup")
            for tokens in sorted({g["tokens"] for g in timed}):
                at = [g for g in timed if g["tokens"] == tokens]
                before = sum(g["heuristic_us"] for g in at)
                after = sum(g["heuristic_us"] / g["speedup"] for g in at)
                lines.append(f"    {tokens:>6}  {len(at):>6}  {before:>12.2f}  {after:>9.2f}  {before / after:.3f}x")
        if self.not_tuned:
            lines.append(f"  {self.not_tuned} shapes have no entry (not reached within the budget, failed, or a "
                         "check of theirs failed to run): the same command resumes with them")
        return "\n".join(lines)


def gains(rows: list[Row], mode: str, store_root: Any = None) -> Gains:
    """What the store now holds for the jobs of `rows` (entries of earlier runs included)."""
    shapes, not_tuned = [], 0
    for row in rows:
        entry = None if row.status.startswith("failed") else stored_entry(row.job, mode, store_root)
        if entry is None:
            not_tuned += 1
            continue
        heuristic_us, speedup = stored_gain(entry)
        shapes.append({"kernel": row.job.kernel, "shape": row.job.label(), "tokens": row.job.tokens,
                       "heuristic_us": heuristic_us, "speedup": speedup,
                       "config": None if entry.config == entry.heuristic else entry.config.variant().key()})
    return Gains(mode, GAIN_LABEL, shapes, not_tuned)


def table(rows: list[Row]) -> str:
    """The final table: kernel, shape, heuristic and tuned medians, speedup, A/A spread, outcome."""
    head = ("kernel", "shape", "heuristic us", "tuned us", "speedup", "A/A", "outcome")
    body = [(r.job.kernel, r.job.label(), _num(r.heuristic_us, "{:.3f}"), _num(r.tuned_us, "{:.3f}"),
             _num(r.speedup, "{:.3f}x"), _num(r.aa_spread, "{:.4f}"), r.status) for r in rows]
    widths = [max(len(line[c]) for line in [head, *body]) for c in range(len(head) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1]
                     for line in [head, *body])


def _num(x: float, fmt: str) -> str:
    return "-" if math.isnan(x) else fmt.format(x)  # a failed job has no measurements
