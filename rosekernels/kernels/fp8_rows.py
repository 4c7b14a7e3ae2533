"""Device code of FP8 row quantization, shared by the quantization kernel (quantize_fp8) and the norm's
fused quantization (rmsnorm's `quant` option): rows split over `threads_per_row` lanes as those kernels
split them (vector j * threads_per_row + lane of the row in a lane's j-th register vector).

`quantize_row` takes the row's values in fp32, finds the amax of the row (every lane of the row, across
its warps through shared memory) or of each 1 x 128 group (the group's 128 / vec consecutive lanes, by
shuffles), and stores e4m3(y * E4M3_MAX / amax) (saturating) and the scale amax / E4M3_MAX: the math of
rosekernels.fp8.quantize.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.memory import SmemAllocator

from rosekernels.fp8 import AMAX_FLOOR, E4M3_MAX
from rosekernels.vector_copy import vec_store


@cute.jit
def _amax(y, ok) -> Float32:
    """max |y| over a register vector (0 where `ok`, a predicate or None for always, is false)."""
    a = abs(y).reduce(cute.ReductionOp.MAX, Float32(0.0), 0)
    if const_expr(ok is not None):
        a = Float32(cutlass.select_(ok, a, Float32(0.0)))
    return a


@cute.jit
def _max(a: Float32, b: Float32) -> Float32:
    return cute.arch.fmax(a, b)


@cute.jit
def _store(y, inv: Float32, dst: cute.Tensor, row_ok, chunk_ok, hint: cutlass.Constexpr[str]):
    """e4m3(y * inv) into the gmem vector `dst`, if the row and the chunk (None: always) are in range."""
    q = cute.make_rmem_tensor(dst.shape, cutlass.Float8E4M3FN)
    q.store((y * inv).to(cutlass.Float8E4M3FN))
    if row_ok:
        if const_expr(chunk_ok is None):
            vec_store(q, dst, hint, bits=8 * cute.size(dst))
        else:
            if chunk_ok:
                vec_store(q, dst, hint, bits=8 * cute.size(dst))


@cute.jit
def row_amax(a: Float32, tidx, threads_per_row: cutlass.Constexpr[int], warps_per_row: cutlass.Constexpr[int],
             block_warps: cutlass.Constexpr[int]) -> Float32:
    """The max of `a` over the row's lanes: a shuffle reduction in each warp, then, when a row spans
    several warps (consecutive ones), one exchange through shared memory."""
    a = cute.arch.warp_reduction(a, _max, threads_in_group=min(threads_per_row, 32))
    if const_expr(warps_per_row > 1):
        partials = SmemAllocator().allocate_tensor(Float32, cute.make_layout(block_warps), byte_alignment=16)
        warp = tidx // 32
        if tidx % 32 == 0:
            partials[warp] = a
        cute.arch.barrier()
        first = (warp // warps_per_row) * warps_per_row
        a = partials[first]
        for i in cutlass.range_constexpr(1, warps_per_row):
            a = cute.arch.fmax(a, partials[first + i])
    return a


@cute.jit
def quantize_row(ys: list, chunks: list, chunk_ok: list, row_ok, mQrow: cute.Tensor, mS: cute.Tensor, row, lane,
                 tidx, vec: cutlass.Constexpr[int], threads_per_row: cutlass.Constexpr[int],
                 warps_per_row: cutlass.Constexpr[int], block_warps: cutlass.Constexpr[int],
                 group: cutlass.Constexpr[int], hint: cutlass.Constexpr[str]):
    """Quantize one row: `ys` the lane's fp32 vectors (at vector indices `chunks`, `chunk_ok` None or
    the predicate of a ragged last column), mQrow the row of q (e4m3), mS the scales ([M], or [M, K / 128]
    for `group` 128). Every lane of the row takes part (the reductions), whatever row_ok says."""
    gQ = cute.zipped_divide(mQrow, (vec,))
    if const_expr(group == 0):
        a = _amax(ys[0], chunk_ok[0])
        for j in cutlass.range_constexpr(1, len(ys)):
            a = cute.arch.fmax(a, _amax(ys[j], chunk_ok[j]))
        a = cute.arch.fmax(row_amax(a, tidx, threads_per_row, warps_per_row, block_warps), Float32(AMAX_FLOOR))
        inv = Float32(E4M3_MAX) / a
        for j in cutlass.range_constexpr(len(ys)):
            _store(ys[j], inv, gQ[None, chunks[j]], row_ok, chunk_ok[j], hint)
        if row_ok and lane == 0:
            mS[row] = a / Float32(E4M3_MAX)
    else:
        # A group's vectors sit in group // vec consecutive lanes of one column j (threads_per_row is a
        # multiple of that): a column's lanes are either all in the row or all past its end.
        lanes = group // vec
        for j in cutlass.range_constexpr(len(ys)):
            a = cute.arch.warp_reduction(_amax(ys[j], chunk_ok[j]), _max, threads_in_group=lanes)
            a = cute.arch.fmax(a, Float32(AMAX_FLOOR))
            _store(ys[j], Float32(E4M3_MAX) / a, gQ[None, chunks[j]], row_ok, chunk_ok[j], hint)
            first_lane = lane % lanes == 0
            if const_expr(chunk_ok[j] is not None):
                first_lane = first_lane & chunk_ok[j]
            if row_ok and first_lane:
                mS[row, chunks[j] // lanes] = a / Float32(E4M3_MAX)
