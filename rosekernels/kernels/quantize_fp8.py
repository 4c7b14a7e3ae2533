"""FP8 quantization of rows: x [M, K] (bf16/fp16/fp32) -> q [M, K] e4m3 and fp32 scales per row ([M]) or
per 1 x 128 group ([M, K / 128]), q * scale ~ x (rosekernels.fp8 defines the math).

A row is split over `threads_per_row` threads, each loading its 128-bit vectors of the row at once (the
RMSNorm kernel's geometry: enough bytes in flight to stream at HBM speed without shared memory); the
amax reductions and the stores are fp8_rows.quantize_row, which the norm's fused quantization shares.
Rows past the end are clamped for loading and masked for storing, so every thread reaches the
shuffles and the barrier.

Configs, the call's shape and the choice between decode and prefill live in quantize_fp8_plan (no
CuTeDSL), the op in rosekernels/ops/quantize.py.
"""
from __future__ import annotations

import dataclasses
import math
import random

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32

from rosekernels import checks, jit, modes
from rosekernels.fp8 import check_quantized, quantize
from rosekernels.kernels.fp8_rows import quantize_row
from rosekernels.kernels.quantize_fp8_plan import (  # noqa: F401  (the plan's names are the kernel's: the contract)
    OP, TORCH_DTYPE, QuantizeConfig, QuantizeShape, candidates, config_for, rank, variants_for)
from rosekernels.vector_copy import row_chunks, vec_load
from rosekernels.workload import Workload

Config, Shape = QuantizeConfig, QuantizeShape


class QuantizeFp8Kernel:
    def __init__(self, cfg: QuantizeConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, stream):
        c = self.cfg
        grid = cute.ceil_div(mX.shape[0], c.rows_per_block)
        self.kernel(mX, mQ, mS).launch(grid=[grid, 1, 1], block=[c.block_warps * 32, 1, 1], stream=stream,
                                       use_pdl=c.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        c = self.cfg
        tpr = c.threads_per_row
        if cutlass.const_expr(c.pdl):
            cute.arch.griddepcontrol_wait()  # x may come from the kernel before this one
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rows = mX.shape[0]
        row, row_ok, lane, chunks, chunk_ok = row_chunks(c, tidx, bidx, rows)

        gX = cute.zipped_divide(mX[row, None], (c.vec,))
        xs = [vec_load(gX[None, ch], c.cache_hint) for ch in chunks]
        if cutlass.const_expr(c.pdl):
            # Every load is issued: the next kernel may launch and set up (its own wait still holds it
            # until this grid has finished and its stores are visible).
            cute.arch.griddepcontrol_launch_dependents()
        ys = [v.load().to(Float32) for v in xs]
        quantize_row(ys, chunks, chunk_ok, row_ok, mQ[row, None], mS, row, lane, tidx, c.vec, tpr, c.warps_per_row,
                     c.block_warps, c.group, c.cache_hint)


def _build(cfg: QuantizeConfig):
    def build():
        rows = cute.sym_int32()
        x = cute.runtime.make_fake_tensor(checks.cute_dtype(cfg.dtype), (rows, cfg.hidden),
                                          (cute.sym_int64(divisibility=cfg.vec), 1), assumed_align=16)
        q = cute.runtime.make_fake_tensor(cutlass.Float8E4M3FN, (rows, cfg.hidden), (cute.sym_int64(divisibility=16), 1),
                                          assumed_align=16)
        if cfg.group:
            scales = cute.runtime.make_fake_tensor(Float32, (rows, cfg.hidden // cfg.group), (cute.sym_int64(), 1),
                                                   assumed_align=4)
        else:
            scales = cute.runtime.make_fake_tensor(Float32, (rows,), (1,), assumed_align=4)
        return QuantizeFp8Kernel(cfg), (x, q, scales, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
    return build


def compile(config: QuantizeConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config`; call `.fn(x, q, scales)`."""
    return jit.compile_variant(config.variant(), _build(config))


def precompile(configs=None, processes: int | None = None) -> list[jit.CompiledKernel]:
    """compile() of each config (default: variants_for()), the cold ones first compiled in parallel
    processes into the disk cache (jit.precompile)."""
    return jit.precompile(compile, variants_for() if configs is None else configs, processes)


# ---------------------------------------------------------------------------------------------
# The float64 reference, and inputs for a config (tests, benchmark, SIP tuner); the check is
# rosekernels.fp8.check_quantized.

def reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3, float64 scales) of x by rosekernels.fp8.quantize in float64: blocks of one row x the
    whole row (group 0) or x `group` columns."""
    return quantize(x, 1, group or None, torch.float64)


def workload(config: QuantizeConfig, shape: QuantizeShape) -> Workload:
    """`compile(config)` with its inputs: make_args(seed) at `shape`'s row count, test_args(seed) at a random
    row count of config's mode (small ones for prefill); args are (x, q, scales) on the GPU, q
    NaN-poisoned (0x7f), scales NaN; rows of x span several binades, one all zero."""
    lo, hi = modes.size_range(config.mode, lambda r: config_for(dataclasses.replace(shape, rows=r)).mode)

    def args(rows: int, seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator(device="cpu").manual_seed(seed)
        x = torch.randn(rows, config.hidden, generator=g) * torch.exp2(torch.randint(-8, 9, (rows, 1), generator=g))
        x[rows // 2] = 0
        x = x.to(device="cuda", dtype=TORCH_DTYPE[config.dtype])
        q = torch.full((rows, config.hidden), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        groups = (rows, config.hidden // config.group) if config.group else (rows,)
        return x, q, torch.full(groups, math.nan, device="cuda")

    return Workload(compile(config), lambda seed: args(shape.rows, seed), outputs=lambda a: (a[1].view(torch.uint8), a[2]),
                    check=lambda a: check_quantized(a[0], a[1], a[2], config.group),
                    test_args=lambda seed: args(random.Random(seed).randint(lo, hi), seed), name=OP)
