"""The GEMM kernel's decode tiles (rosekernels.kernels.gemm_leakyrelu, its split-K variants).

Split-K: each split of an output tile stores its fp32 partials to a workspace and counts itself in the
tile's counter; the split that arrives last sums every split's partials in split order (run-to-run
deterministic), returns the counter to zero for the next launch, and runs the epilogue. `sync(slot)` is the
named barrier of the tile's epilogue threads, `t` a thread's index among them. Also the A stages of tiles
that load a_rows < tile_m rows, and the weights' prefetch before griddepcontrol.wait.
"""
from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.tensor_utils import LayoutEnum

from rosekernels.kernels.gemm_leakyrelu_plan import TILE_K, GemmConfig

# Weight bytes a decode CTA sends toward the L2 before the previous kernel ends (132 CTAs: 8.7 MB of the 50 MB),
# and the most tokens a tile holds to do so when K is not split: from one H100 sweep (DESIGN.md, "GEMM tiles").
PREFETCH_BYTES = 64 << 10
PREFETCH_TOKENS = 32


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


def a_smem_layouts(cfg: GemmConfig, dtype, stages: int, tile_k: int = TILE_K):
    """(WGMMA view, TMA view) of the A stages in shared memory: K-major, 128-byte swizzle.

    The WGMMA view keeps each stage a whole tile_m-row tile; the TMA view is its first a_rows rows: in this
    layout (8-row swizzle atoms stacked along M) the stage's first a_rows * 128 bytes (a test checks that the
    views agree). Stages start a_rows rows apart, so for a_rows < tile_m a stage's rows >= a_rows alias the next
    stages' rows (or the tail's): garbage, possibly NaN/Inf or being written by TMA, that only reaches
    accumulator rows >= a_rows >= M (row i of a product depends on row i of A alone), which are never stored
    (the TMA store clips at M, partials hold rows < M). Stage offsets are multiples of 1024 bytes: the swizzle
    (a function of address bits 4-9) is the same in every stage.
    """

    def staged(rows: int):  # rows x tile_k per stage, stages a_rows rows apart
        one = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (rows, cfg.tile_n, tile_k), dtype, 1)
        outer = cute.append(cute.slice_(one.outer, (None, None, 0)),
                            cute.make_layout(stages, stride=cfg.a_rows * tile_k))
        return cute.make_composed_layout(one.inner, 0, outer)

    return staged(cfg.tile_m), staged(cfg.a_rows)


def prefetch_plan(cfg: GemmConfig, mcast_a: int, mcast_b: int, tile_k: int, elem_bits: int) -> tuple[int, bool]:
    """(k-tiles of its first unit's weights a CTA prefetches, whether it does so when K is not split): its slice
    of each k-tile is the weight tile over the CTAs that multicast it. 0 for prefill tiles and N-major weights,
    whose k-tile is several TMA boxes (their unrolled prefetches made a 128 x 240 tile spill)."""
    if not cfg.split_k or cfg.b_major != "k":
        return 0, False
    rows = cfg.tile_m // mcast_a if cfg.swap_ab else cfg.tile_n // mcast_b
    tokens = cfg.tile_n if cfg.swap_ab else cfg.a_rows
    return PREFETCH_BYTES // (rows * tile_k * elem_bits // 8), tokens <= PREFETCH_TOKENS


@cute.jit
def prefetch_weights(atom: cute.CopyAtom, weights: cute.Tensor, k_begin: Int32, count: Int32):
    """k-tiles k_begin .. k_begin + count - 1 of `weights` (a CTA's TMA view of a tile's weights, (box, k-tile))
    toward the L2. A decode GEMM streams weights that no kernel before it writes in a forward, so their latency
    may overlap that kernel's end: a prefetch moves nothing into the CTA, so it stays correct whatever that
    kernel writes, where loading them into shared memory before griddepcontrol.wait would not."""
    for k in cutlass.range(count, unroll=1):
        cute.prefetch(atom, weights[(None, k_begin + k)])
