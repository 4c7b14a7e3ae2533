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
The config, the call's shape and the choice between them live in rmsnorm_plan (no CuTeDSL), the op
(argument checks, launch plans, eager and traced calls) in rosekernels/ops/rmsnorm.py.
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

from rosekernels import checks, jit, modes
from rosekernels.fp8 import check_quantized
from rosekernels.kernels.fp8_rows import quantize_row
from rosekernels.kernels.rmsnorm_plan import (  # noqa: F401  (the plan's names are the kernel's: the contract)
    OP, TORCH_DTYPE, RMSNormConfig, RMSNormShape, candidates, config_for, rank, variants_for)
from rosekernels.vector_copy import row_chunks, vec_load, vec_store
from rosekernels.workload import Workload

Config, Shape = RMSNormConfig, RMSNormShape


# ---------------------------------------------------------------------------------------------
# The kernel.

class RMSNormKernel:
    def __init__(self, cfg: RMSNormConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mR, mO: cute.Tensor, mRO, stream, mS=None):
        c = self.cfg
        grid = cute.ceil_div(mX.shape[0], c.rows_per_block)
        self.kernel(mX, mW, mR, mO, mRO, mS).launch(
            grid=[grid, 1, 1], block=[c.block_warps * 32, 1, 1], stream=stream, use_pdl=c.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mR, mO: cute.Tensor, mRO, mS):
        c = self.cfg
        tpr, vpt = c.threads_per_row, c.vecs_per_thread
        if cutlass.const_expr(c.pdl):
            cute.arch.griddepcontrol_wait()  # x and the residual may come from the kernel before this one
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rows = mX.shape[0]
        row, row_ok, lane, chunks, chunk_ok = row_chunks(c, tidx, bidx, rows)

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

        if cutlass.const_expr(c.fp8 != "none"):  # out in e4m3, its scales in mS (fp8_rows)
            ys = [hs[j] * rstd * ws[j].load().to(Float32) for j in range(vpt)]
            quantize_row(ys, chunks, chunk_ok, row_ok, mO[row, None], mS, row, lane, tidx, c.vec, tpr, c.warps_per_row,
                         c.block_warps, c.fp8_group, c.cache_hint)
        else:
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
        out, scales = rows_tensor(), ()
        if cfg.fp8 != "none":  # e4m3 rows (16-byte aligned) and their scales per row or 1 x 128 group
            out = cute.runtime.make_fake_tensor(cutlass.Float8E4M3FN, (rows, cfg.hidden),
                                                (cute.sym_int64(divisibility=16), 1), assumed_align=16)
            if cfg.fp8_group:
                scales = (cute.runtime.make_fake_tensor(Float32, (rows, cfg.hidden // cfg.fp8_group),
                                                        (cute.sym_int64(), 1), assumed_align=4),)
            else:
                scales = (cute.runtime.make_fake_tensor(Float32, (rows,), (1,), assumed_align=4),)
        args = (rows_tensor(), weight, residual, out, residual_out,
                cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), *scales)
        return RMSNormKernel(cfg), args
    return build


def compile(config: RMSNormConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config`; call `.fn(x, weight, residual, out, residual_out, scales)`
    (residual and residual_out are None for configs without a residual, scales None without fp8; with
    fp8, out is e4m3). The compiled function takes every parameter of the kernel's __call__, those
    left at their defaults when it was compiled included."""
    return jit.compile_variant(config.variant(), _build(config))


def precompile(configs=None, processes: int | None = None) -> list[jit.CompiledKernel]:
    """compile() of each config (default: variants_for()), the cold ones first compiled in parallel
    processes into the disk cache (jit.precompile)."""
    return jit.precompile(compile, variants_for() if configs is None else configs, processes)


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
    (x, weight, residual, out, residual_out, scales) on the GPU (scales None without fp8; fp8 configs: out
    e4m3), outputs NaN-poisoned, the residual entries None without a residual."""
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
        if config.fp8 == "none":
            return x, w, res, out, res_out, None
        q = torch.full(x.shape, 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)  # NaN
        group = config.fp8_group
        return x, w, res, q, res_out, torch.full((rows, config.hidden // group) if group else (rows,), math.nan,
                                                 device="cuda")

    def check(a: tuple) -> float:
        x, w, res, out, res_out = a[:5]
        ref_out, ref_res = reference(x, w, config.eps, res)
        if config.fp8 != "none":  # the fp32-accurate norm quantized (its error within fp32's: 1e-5)
            check_quantized(ref_out, out, a[5], config.fp8_group, rel=1e-5)
            ref_out = None
        worst = max((checks.relative_error(got, ref) for got, ref in ((out, ref_out), (res_out, ref_res))
                     if ref is not None), default=0.0)
        if worst > tolerance(x.dtype):
            raise AssertionError(f"{config.variant().key()}: error {worst:.3g} > {tolerance(x.dtype):.3g}")
        return worst

    def outputs(a: tuple) -> list:
        found = [t for t in a[3:] if t is not None]
        return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in found]

    return Workload(compile(config), lambda seed: args(shape.rows, seed), outputs=outputs, check=check,
                    test_args=lambda seed: args(random.Random(seed).randint(lo, hi), seed), name=OP)
