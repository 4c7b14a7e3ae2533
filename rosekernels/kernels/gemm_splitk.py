"""Split-K of the GEMM kernel's decode tiles (rosekernels.kernels.gemm_leakyrelu): each split of an
output tile stores its fp32 partials to a workspace and counts itself in the tile's counter; the split
that arrives last sums every split's partials in split order (run-to-run deterministic), returns the
counter to zero for the next launch, and runs the epilogue. `sync(slot)` is the named barrier of the
tile's epilogue threads, `t` a thread's index among them.
"""
from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


@cute.jit
def reduce_whole_tiles(acc: cute.Tensor, mPartials: cute.Tensor, mCounters: cute.Tensor, sLast: cute.Tensor,
                       tile_idx: Int32, split: Int32, num_splits: Int32, tiles: Int32, t: Int32, slot: Int32,
                       threads: cutlass.Constexpr[int], sync: Callable):
    """`reduce_rows` for swapped tiles, whose every row may be valid: the whole accumulator of the
    tile's `threads` threads goes to the partials, [splits, tiles, acc / 4, threads] 16-byte vectors
    (a warp writes 512 contiguous bytes per vector index); the last split sums them in split order."""
    vecs = cute.size(acc) // 4
    assert cute.size(acc) % 4 == 0
    vectors = cute.make_tensor(
        mPartials.iterator, cute.make_layout((4, num_splits * tiles * vecs * threads), stride=(1, 4))
    )
    store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
    load_atom = cute.make_copy_atom(  # .cg: the other CTAs' partials are in L2, never in L1
        cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128,
        load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL,
    )
    vec = cute.make_rmem_tensor((4,), Float32)
    base = (split * tiles + tile_idx) * vecs * threads + t
    for j in cutlass.range_constexpr(vecs):
        for e in cutlass.range_constexpr(4):
            vec[e] = acc[4 * j + e]
        cute.copy(store_atom, vec, vectors[(None, base + j * threads)])
    is_last = arrive(mCounters, sLast, tile_idx, num_splits, t, slot, sync)
    if is_last:
        acc.fill(0.0)
        for s in cutlass.range(num_splits, unroll=2):
            first = (s * tiles + tile_idx) * vecs * threads + t
            for j in cutlass.range_constexpr(vecs):
                cute.copy(load_atom, vectors[(None, first + j * threads)], vec)
                for e in cutlass.range_constexpr(4):
                    acc[4 * j + e] = acc[4 * j + e] + vec[e]
        if t == 0:
            mCounters[tile_idx] = Int32(0)
    return is_last

@cute.jit
def arrive(mCounters: cute.Tensor, sLast: cute.Tensor, tile_idx: Int32, num_splits: Int32, t: Int32, slot: Int32,
           sync: Callable):
    """After the tile's threads stored this split's partials: count the split in the tile's
    counter; True in every thread of the split that arrives last, which then sees all partials."""
    sync(slot)
    if t == 0:
        cute.arch.fence_acq_rel_gpu()  # the tile's partial stores before the count
        arrived = cute.arch.atomic_add(
            mCounters.iterator + tile_idx, Int32(1), sem="acq_rel", scope="gpu"
        )
        sLast[slot] = Int32(arrived == num_splits - 1)
    sync(slot)
    is_last = sLast[slot] != 0
    if is_last:
        cute.arch.fence_acq_rel_gpu()
    return is_last

@cute.jit
def reduce_rows(acc: cute.Tensor, tCcD: cute.Tensor, mPartials: cute.Tensor, mCounters: cute.Tensor,
                sLast: cute.Tensor, tile_m: Int32, tile_n: Int32, split: Int32, num_splits: Int32, m: Int32,
                tiles_n: Int32, t: Int32, slot: Int32, tile_rows: cutlass.Constexpr[int],
                tile_cols: cutlass.Constexpr[int], sync: Callable):
    """Store this split's fp32 partials of the tile's rows < M; the last split of the tile to
    arrive sums all partials in split order (run-to-run deterministic), resets the tile's
    counter and returns True.

    Partials are [splits, M, n_tiles * tile_n] fp32, each row permuted so that every thread
    moves 16-byte vectors: the WGMMA accumulator gives thread t rows r and r + 8 (h = 0, 1)
    and, in each 16-column chunk v, columns {0, 1, 8, 9} + 2q (q = t % 4). Those four values
    go to floats 16v + 4q .. 16v + 4q + 3 of the row, so the 4 threads of a row write 64
    contiguous bytes per chunk and an M = 1 tile moves tile_n * 4 bytes, not tile_m times that.
    """
    chunks = tile_cols // 16
    # The accumulator layout this relies on: ((2 columns, 2 row halves, tile_n / 8), 1, 1).
    assert cute.size(acc) == tile_cols // 2 and cute.size(acc.shape[0][2]) == tile_cols // 8
    row_vecs = tiles_n * (tile_cols // 4)  # 16-byte vectors per partials row
    vectors = cute.make_tensor(  # (4 floats, vector): slices stay 16-byte aligned
        mPartials.iterator, cute.make_layout((4, num_splits * m * row_vecs), stride=(1, 4))
    )
    first_vec = tile_n * chunks * 4 + tCcD[0][1] // 2  # + 4v: this thread's vector of chunk v
    store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
    # .cg: read L2, where the other CTAs' partials are, never a stale L1 line.
    load_atom = cute.make_copy_atom(
        cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128,
        load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL,
    )
    vec = cute.make_rmem_tensor((4,), Float32)

    for h in cutlass.range_constexpr(2):
        row = tile_m * tile_rows + tCcD[2 * h][0]
        if row < m:
            row_base = (split * m + row) * row_vecs + first_vec
            for v in cutlass.range_constexpr(chunks):
                for e in cutlass.range_constexpr(4):
                    vec[e] = acc[2 * h + 8 * v + e % 2 + 4 * (e // 2)]
                cute.copy(store_atom, vec, vectors[(None, row_base + 4 * v)])
    tile_idx = tile_m * tiles_n + tile_n
    is_last = arrive(mCounters, sLast, tile_idx, num_splits, t, slot, sync)
    if is_last:
        acc.fill(0.0)
        for h in cutlass.range_constexpr(2):
            row = tile_m * tile_rows + tCcD[2 * h][0]
            if row < m:  # rows >= M keep their (unused) values: the TMA store clips them
                for s in cutlass.range(num_splits, unroll=2):
                    row_base = (s * m + row) * row_vecs + first_vec
                    for v in cutlass.range_constexpr(chunks):
                        cute.copy(load_atom, vectors[(None, row_base + 4 * v)], vec)
                        for e in cutlass.range_constexpr(4):
                            i = 2 * h + 8 * v + e % 2 + 4 * (e // 2)
                            acc[i] = acc[i] + vec[e]
        if t == 0:
            mCounters[tile_idx] = Int32(0)
    return is_last
