"""RMSNorm over the last dim of [M, N] rows (N up to 16k), optionally fused with a residual add.

    h = x (+ residual);  y = h * rsqrt(mean(h^2) + eps) * w;  returns y (and h, the new residual)

The generic "regular" RMSNorm (the QK-norm kernel is its per-head specialization). A row is split
over `threads_per_row` threads (a power of two), each moving up to 8 128-bit vectors, all loads
issued before any math: enough bytes in flight per SM to stream at HBM speed without staging
through shared memory. The row's sum of squares is a shuffle reduction within each warp, then,
when a row spans several warps, one exchange through shared memory and a single barrier.
N, eps and the dtypes are compile-time constants; the row count and row strides are runtime
values. Rows past the end are clamped for loading and masked for storing, so every thread reaches
the shuffles and the barrier; a row's ragged last vector column is masked the same way.

Modes (rosekernels.modes): decode = one row per block (one warp per block for short rows);
prefill = blocks of the tabled warp count (at least one row), many rows per block.
The config, the call's shape and the choice between them live in rmsnorm_plan (no CuTeDSL).
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Callable

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32
from cutlass.memory import SmemAllocator

from rosekernels import checks, jit, launch, modes, tuned
from rosekernels.kernels.rmsnorm_plan import (  # noqa: F401  (candidates, variants_for: the contract)
    DTYPES, MAX_HIDDEN, OP, TORCH_DTYPE, RMSNormConfig, RMSNormShape, candidates, config_for, variants_for)
from rosekernels.vector_copy import vec_load, vec_store
from rosekernels.workload import Workload

Config, Shape = RMSNormConfig, RMSNormShape


# ---------------------------------------------------------------------------------------------
# The kernel.

class RMSNormKernel:
    def __init__(self, cfg: RMSNormConfig):
        cfg.validate()
        self.cfg = cfg

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mR, mO: cute.Tensor, mRO, stream):
        c = self.cfg
        grid = cute.ceil_div(mX.shape[0], c.rows_per_block)
        self.kernel(mX, mW, mR, mO, mRO).launch(
            grid=[grid, 1, 1], block=[c.block_warps * 32, 1, 1], stream=stream, use_pdl=c.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mR, mO: cute.Tensor, mRO):
        c = self.cfg
        tpr, vpt = c.threads_per_row, c.vecs_per_thread
        full = c.vecs // tpr  # vector columns every lane has; column `full` is ragged when vpt > full
        if cutlass.const_expr(c.pdl):
            cute.arch.griddepcontrol_wait()  # x and the residual may come from the kernel before this one
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rows = mX.shape[0]
        group, lane = tidx // tpr, tidx % tpr
        row = bidx * c.rows_per_block + group
        row_ok = row < rows
        row = cutlass.min(row, rows - 1)  # clamped: loads stay in bounds without predicates

        chunks, chunk_ok = [], []
        for j in cutlass.range_constexpr(vpt):
            if cutlass.const_expr(j < full):
                chunks.append(j * tpr + lane)
                chunk_ok.append(None)
            else:
                chunk_ok.append(j * tpr + lane < c.vecs)
                chunks.append(cutlass.min(j * tpr + lane, c.vecs - 1))

        gX = cute.zipped_divide(mX[row, None], (c.vec,))
        xs = [vec_load(gX[None, ch], c.cache_hint) for ch in chunks]
        if cutlass.const_expr(c.residual):
            gR = cute.zipped_divide(mR[row, None], (c.vec,))
            rs = [vec_load(gR[None, ch], c.cache_hint) for ch in chunks]
        gW = cute.zipped_divide(mW, (c.vec,))
        ws = [vec_load(gW[None, ch]) for ch in chunks]
        if cutlass.const_expr(c.pdl):
            # Every load is issued: the next kernel may launch and set up (its own wait still holds
            # it until this grid has finished and its stores are visible).
            cute.arch.griddepcontrol_launch_dependents()

        hs = [v.load().to(Float32) for v in xs]
        if cutlass.const_expr(c.residual):
            gRO = cute.zipped_divide(mRO[row, None], (c.vec,))
            for j in cutlass.range_constexpr(vpt):
                hs[j] = hs[j] + rs[j].load().to(Float32)
                self.store(hs[j], gRO[None, chunks[j]], row_ok, chunk_ok[j])

        parts = []
        for j in cutlass.range_constexpr(vpt):
            part = (hs[j] * hs[j]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if cutlass.const_expr(chunk_ok[j] is not None):
                part = Float32(cutlass.select_(chunk_ok[j], part, Float32(0.0)))
            parts.append(part)
        sum_sq = parts[0]
        for part in parts[1:]:
            sum_sq = sum_sq + part
        sum_sq = cute.arch.warp_reduction(sum_sq, lambda a, b: a + b, threads_in_group=min(tpr, 32))
        if cutlass.const_expr(c.warps_per_row > 1):
            # One partial per warp through shared memory; the row's warps are consecutive.
            smem = SmemAllocator()
            partials = smem.allocate_tensor(Float32, cute.make_layout(c.block_warps), byte_alignment=16)
            warp = tidx // 32
            if tidx % 32 == 0:
                partials[warp] = sum_sq
            cute.arch.barrier()
            first = (warp // c.warps_per_row) * c.warps_per_row
            sum_sq = partials[first]
            for i in cutlass.range_constexpr(1, c.warps_per_row):
                sum_sq = sum_sq + partials[first + i]
        rstd = cute.math.rsqrt(sum_sq * (1.0 / c.hidden) + c.eps, fastmath=True)

        gO = cute.zipped_divide(mO[row, None], (c.vec,))
        for j in cutlass.range_constexpr(vpt):
            self.store(hs[j] * rstd * ws[j].load().to(Float32), gO[None, chunks[j]], row_ok, chunk_ok[j])

    @cute.jit
    def store(self, value, dst: cute.Tensor, row_ok, chunk_ok):
        y = cute.make_rmem_tensor(dst.shape, dst.element_type)
        y.store(value.to(dst.element_type))
        if row_ok:
            if cutlass.const_expr(chunk_ok is None):
                vec_store(y, dst, self.cfg.cache_hint)
            else:
                if chunk_ok:
                    vec_store(y, dst, self.cfg.cache_hint)


def _build(cfg: RMSNormConfig) -> Callable[[], tuple]:
    def build():
        dt, wdt = checks.cute_dtype(cfg.dtype), checks.cute_dtype(cfg.weight_dtype)
        rows = cute.sym_int32()

        def rows_tensor() -> cute.Tensor:  # [rows, hidden], any 16-byte-aligned row stride
            return cute.runtime.make_fake_tensor(
                dt, (rows, cfg.hidden), (cute.sym_int64(divisibility=cfg.vec), 1), assumed_align=16)

        weight = cute.runtime.make_fake_compact_tensor(wdt, (cfg.hidden,), assumed_align=16)
        residual = rows_tensor() if cfg.residual else None
        residual_out = rows_tensor() if cfg.residual else None
        args = (rows_tensor(), weight, residual, rows_tensor(), residual_out,
                cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
        return RMSNormKernel(cfg), args
    return build


def compile(config: RMSNormConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config`; call `.fn(x, weight, residual, out, residual_out)`
    (residual and residual_out are None for configs without a residual)."""
    config.validate()
    return jit.compile_variant(config.variant(), _build(config))


# ---------------------------------------------------------------------------------------------
# The float64 reference, and inputs for a config (tests, benchmark, SIP tuner).

def reference(x, weight, eps: float = 1e-6, residual=None):
    """float64 (out, new_residual); new_residual is None without a residual."""
    h = x.double() if residual is None else x.double() + residual.double()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return out, (None if residual is None else h)


def tolerance(dtype: torch.dtype) -> float:
    """Max checks.relative_error accepted: one rounding of an fp32-accurate result (the output dtype's)."""
    return checks.ROUNDING_TOLERANCE[dtype]


def workload(config: RMSNormConfig, shape: RMSNormShape) -> Workload:
    """`compile(config)` with its inputs: make_args(seed) at `shape`'s row count, test_args(seed) at a
    random row count of config's mode (small ones for prefill); args are
    (x, weight, residual, out, residual_out) on the GPU, outputs NaN-poisoned, the residual entries
    None without a residual."""
    lo, hi = modes.size_range(config.mode, lambda r: config_for(dataclasses.replace(shape, rows=r)).mode)

    def args(rows: int, seed: int) -> tuple[torch.Tensor | None, ...]:
        g = torch.Generator(device="cpu").manual_seed(seed)
        dt, wdt = TORCH_DTYPE[config.dtype], TORCH_DTYPE[config.weight_dtype]

        def rand(*size, dtype, scale=1.0, shift=0.0):
            return (torch.randn(*size, generator=g) * scale + shift).to(dtype=dtype, device="cuda")

        x = rand(rows, config.hidden, dtype=dt, scale=2.0)
        w = rand(config.hidden, dtype=wdt, scale=0.2, shift=1.0)
        res = rand(rows, config.hidden, dtype=dt) if config.residual else None
        out = torch.full_like(x, math.nan)
        res_out = torch.full_like(x, math.nan) if config.residual else None
        return x, w, res, out, res_out

    def check(a: tuple) -> float:
        x, w, res, out, res_out = a
        ref_out, ref_res = reference(x, w, config.eps, res)
        worst = max(checks.relative_error(got, ref) for got, ref in ((out, ref_out), (res_out, ref_res))
                    if ref is not None)
        if worst > tolerance(x.dtype):
            raise AssertionError(f"{config.variant().key()}: error {worst:.3g} > {tolerance(x.dtype):.3g}")
        return worst

    return Workload(compile(config), lambda seed: args(shape.rows, seed),
                    outputs=lambda a: [t for t in a[3:5] if t is not None], check=check,
                    test_args=lambda seed: args(random.Random(seed).randint(lo, hi), seed), name=OP)


# ---------------------------------------------------------------------------------------------
# Argument checks (the slow path: first call per shape, and after any launch failure).

def _validate(x, weight, residual, out, residual_out) -> None:
    named = {n: t for n, t in (("x", x), ("weight", weight), ("residual", residual), ("out", out),
                               ("residual_out", residual_out)) if t is not None or n in ("x", "weight")}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if residual_out is not None and residual is None:
        raise ValueError("residual_out needs a residual")
    checks.check_dtype("x", x, DTYPES)
    for name in ("residual", "out", "residual_out"):
        if name in named:
            checks.check_dtype(name, named[name], (x.dtype,))
    checks.check_dtype("weight", weight, dict.fromkeys((x.dtype, torch.float32)))
    checks.check_shape("x", x, (None, None))
    hidden = x.shape[1]
    vec = checks.vector_width(x.dtype)
    if not (0 < hidden <= MAX_HIDDEN) or hidden % vec:
        raise ValueError(f"hidden size {hidden} is not supported: it must be a multiple of {vec} "
                         f"(16 bytes) and at most {MAX_HIDDEN}")
    checks.check_shape("weight", weight, (hidden,))
    for name in ("residual", "out", "residual_out"):
        if name in named:
            checks.check_shape(name, named[name], tuple(x.shape))
    for name, t in named.items():
        checks.check_unit_last_stride(name, t)
    for name, t in named.items():
        checks.check_aligned(name, t)
    for name in ("out", "residual_out"):
        if name in named:
            checks.check_not_expanded(name, named[name])
    for name, t in named.items():
        checks.check_cuda(name, t)
    checks.check_same_device(**named)


# ---------------------------------------------------------------------------------------------
# The op.

_plans = launch.PlanCache()


def _new_plan(x, weight, residual, out, residual_out, eps, enable_pdl) -> launch.Launch:
    """Slow path, once per signature: validate everything, pick and load the kernel."""
    _validate(x, weight, residual, out, residual_out)
    rows, hidden = x.shape
    if rows == 0:
        return launch.nothing(x.device.index)
    shape = RMSNormShape(rows, hidden, checks.DTYPE_NAME[x.dtype], checks.DTYPE_NAME[weight.dtype],
                         residual is not None, eps, enable_pdl)
    sms = modes.sm_count(x.device.index)
    return launch.Launch(compile(tuned.tuned_config(OP, shape, config_for(shape, sms), sms)).fn, x.device.index)


def _run(x, weight, residual, out, residual_out, eps, enable_pdl=True) -> None:
    # What the plan depends on (the compiled host code checks every other dtype, shape, stride,
    # alignment and device on each call): a microsecond cheaper than a key of all five tensors.
    key = (x.shape, x.dtype, weight.dtype, residual is None, x.get_device(), eps, enable_pdl)
    plan = _plans.get(key) or _plans.put(key, _new_plan(x, weight, residual, out, residual_out, eps, enable_pdl))
    # A zero stride may be an expanded output, which the compiled checks let through.
    if 0 in out.stride() or (residual_out is not None and 0 in residual_out.stride()):
        _validate(x, weight, residual, out, residual_out)
    try:
        plan.launch(x, weight, residual, out, residual_out)
    except Exception:
        # The compiled host code raises before launching; the full checks say what is wrong.
        _validate(x, weight, residual, out, residual_out)
        raise


launch.register_op(
    OP, _run, mutates_args=("out", "residual_out"),
    schema="(Tensor x, Tensor weight, Tensor? residual, Tensor(a!) out, Tensor(b!)? residual_out, float eps, "
           "bool enable_pdl=True) -> ()")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None,
            out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, enable_pdl: bool = True):
    """RMSNorm of x [..., N] (N a multiple of 16 bytes, at most 16384) with weight [N], fp32 math.

    Without `residual`: returns out = x * rsqrt(mean(x^2) + eps) * weight.
    With `residual`: h = x + residual; returns (out, h) where out normalizes h (in fp32, before
    rounding h to the input dtype). out/residual_out may be given (e.g. residual_out=residual
    updates the residual stream in place). Rows may be strided (16-byte-aligned row stride).
    enable_pdl: launch with programmatic dependent launch (the kernel may start while the previous
    one in the stream finishes and waits for it before its loads; the next kernel may launch early):
    a microsecond less per launch in CUDA graphs.

    Eager calls launch the kernel directly (torch.library dispatch would add several us of host
    time per call); under torch.compile the call goes through the custom op rosekernels::rmsnorm.
    """
    given_out, given_residual_out, shape = out, residual_out, x.shape
    if x.dim() != 2:  # rows of [..., N] as [M, N]; given outputs must be viewable so
        x = x.reshape(-1, shape[-1])
        residual = None if residual is None else residual.reshape(-1, shape[-1])
        out = None if out is None else out.view(-1, shape[-1])
        residual_out = None if residual_out is None else residual_out.view(-1, shape[-1])
    if out is None:
        out = torch.empty_like(x)
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(x)
    # The inputs decide (each tensor checked costs host time on every call): a tensor subclass given
    # only as the weight or an output is refused by the compiled host checks.
    if launch.eager(x, residual):
        _run(x, weight, residual, out, residual_out, eps, bool(enable_pdl))
    elif all(t is None or isinstance(t, torch.Tensor) for t in (x, weight, residual, out, residual_out)):
        torch.ops.rosekernels.rmsnorm(x, weight, residual, out, residual_out, eps, bool(enable_pdl))  # traced
    else:
        _validate(x, weight, residual, out, residual_out)  # raises, naming the argument that is not a tensor
    if len(shape) != 2:
        out = out.view(shape) if given_out is None else given_out
        if residual_out is not None:
            residual_out = residual_out.view(shape) if given_residual_out is None else given_residual_out
    return out if residual is None else (out, residual_out)
