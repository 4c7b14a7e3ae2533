"""Device code of the GEMM kernel's FP8 option (rosekernels.kernels.gemm_fp8): e4m3 operands, fp32 sums. The
GEMM device class (gemm_leakyrelu._GemmLeakyReluSm90) inherits these methods and calls them where an FP8
config (gemm_fp8_plan.Fp8GemmConfig) differs from a bf16 one; a bf16 config never reaches them.

Hopper's FP8 WGMMA adds its products into the accumulator with limited precision (fewer mantissa bits
than fp32: over K = 16384 the error grows well past bf16's rounding). So each k-tile (128 elements of K)
is multiplied into a second accumulator, `part`, by a fresh WGMMA chain, and once that chain is done
(wait_group 0) `part` is added into the fp32 accumulator with the CUDA cores: FADDs (`rowcol` scales) or
FFMAs by the k-tile's scales (`block`: a's 1 x 128 group of each row times w's 128 x 128 block). A
stage is released as soon as its chain is done, and the next stage's barrier is polled while the chain
runs (cuBLAS's FP8 kernel does both: bench/results/gemm/sweeps/fp8_prefill_ncu_h100.md); the kernel's
common code releases a unit's last stage. `rowcol` scales multiply the accumulator once after the
mainloop: a's per row (tokens, or the one per-tensor value broadcast with stride 0) times w's per row
(output channels, or per tensor).

Scales are read from global memory by each thread for the rows and columns of its accumulator fragment,
before the data they scale is waited for (their latency hides under the TMA wait and the WGMMA). The
fragment of a 64-row warpgroup MMA is ((2 columns, 2 row halves, N / 8), MMA_M, MMA_N), flat index
c + 2 h + 4 j in its first mode (the last sub-mode is gone at N = 8). On the weights' side a tile lies in
one 128-row scale block (the plan keeps weight tiles to divisors of 128): one scale a k-tile.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from rosekernels.fp8 import BLOCK
from rosekernels.kernels import gemm_fp8_plan, gemm_leakyrelu_plan


class Fp8Tiles:
    """The FP8 option's device methods (a mixin of the GEMM device class)."""

    def _fp8_options(self, cfg) -> None:
        """The device class's FP8 attributes (off for a bf16 GemmConfig, which has no `fp8`): e4m3 operands
        (the output keeps the config's dtype) and k-tiles of 128 elements. Called before the geometry."""
        self.fp8 = getattr(cfg, "fp8", False)
        self.stagger = getattr(cfg, "stagger", False)
        self.tile_k = gemm_fp8_plan.TILE_K if self.fp8 else gemm_leakyrelu_plan.TILE_K
        if self.fp8:
            self.ab_dtype = cutlass.Float8E4M3FN

    # ------------------------------------------------------------------------------------------
    # The mainloop.

    @cute.jit
    def _fp8_first_turn(self, wg_idx: Int32, turn_barrier: int):
        """`stagger`, once before the loop over units: warpgroup 0 has the first turn (_fp8_mainloop)."""
        if const_expr(self.stagger):
            if wg_idx == 0:
                cute.arch.barrier_arrive(barrier_id=turn_barrier, number_of_threads=256)

    @cute.jit
    def _fp8_mainloop(self, tiled_mma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor, tCcD: cute.Tensor,
                      ab_pipeline, read_in, release_in, k_begin: Int32, k_count: Int32, tile_m: Int32,
                      tile_n: Int32, mScaleA: cute.Tensor, mScaleB: cute.Tensor, wg_idx: Int32, turn_barrier: int):
        """acc (zero) += the unit's k-tiles k_begin .. k_begin + k_count - 1, each promoted into fp32 (the
        module docstring); the pipeline states read_in and release_in advance past them, the last stage not
        released. (The loop runs on copies and the states advance by its count after it: the kernel's loop
        over units then carries them as it does for the bf16 mainloop, whose cubins stay as they were.)

        `stagger`: warpgroup wg_idx issues a k-tile's WGMMAs on its turn (named barrier turn_barrier +
        wg_idx) and then hands the turn to the other (turn_barrier + 1 - wg_idx); the kernel gives warpgroup
        0 the first turn. The turns order the issue only. The intent, which a GPU has yet to time: issued at
        once, the two chains finish together and both warpgroups promote while the tensor cores idle; issued
        in turns, if the tensor cores run one chain behind the other, each warpgroup promotes under the
        other's WGMMAs."""
        read_state, release_state = read_in.clone(), release_in.clone()
        part = cute.make_rmem_tensor(acc.shape, Float32)
        num_k_blocks = cute.size(tCrA, mode=[2])
        rowcol = const_expr(self.cfg.scales == "rowcol")
        # The scales of the thread's fragment rows (h, mm) and columns (c, j, nn).
        row_s = cute.make_rmem_tensor((2, cute.size(tCcD, mode=[1])), Float32)
        col_s = cute.make_rmem_tensor((2, cute.size(tCcD, mode=[0]) // 4, cute.size(tCcD, mode=[2])), Float32)
        if const_expr(rowcol):  # fetched now, applied after the mainloop
            self._fp8_row_scales(row_s, mScaleA, tCcD, tile_m, None)
            self._fp8_col_scales(col_s, mScaleB, tCcD, tile_n, None)
        tokens = col_s if const_expr(self.swap) else row_s  # the side whose block scales vary per row
        ready = Boolean(False)  # the first k-tile waits; later ones were polled during the chain before
        for k in cutlass.range(k_count, unroll=1):
            if const_expr(not rowcol):
                # The k-tile is a scale block of K: its scales are loaded before the data is waited for and
                # used once the WGMMAs are done, so that the wait and the MMAs hide their latency.
                w = self._fp8_block_scales(tokens, mScaleA, mScaleB, tCcD, tile_m, tile_n, k_begin + k)
            ab_pipeline.consumer_wait(read_state, ready)
            if const_expr(self.stagger):
                cute.arch.barrier(barrier_id=turn_barrier + wg_idx, number_of_threads=256)
            warpgroup.fence()  # part was read by the promotion: order it before the WGMMAs write it
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            for kbk in cutlass.range_constexpr(num_k_blocks):
                coord = (None, None, kbk, read_state.index)
                cute.gemm(tiled_mma, part, tCrA[coord], tCrB[coord], part)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            if const_expr(self.stagger):
                cute.arch.barrier_arrive(barrier_id=turn_barrier + 1 - wg_idx, number_of_threads=256)
            read_state.advance()
            # Poll the next stage's barrier while the chain runs: its answer is there when the promotion
            # ends, and the next chain issues without a blocking wait (the poll's latency and, once
            # it fails, a sleep) between the last FADD and the first WGMMA. Not past the unit's last
            # k-tile: try_wait may hold a thread until its time limit on a stage no producer fills.
            if k + 1 < k_count:
                ready = ab_pipeline.consumer_try_wait(read_state)
            warpgroup.wait_group(0)
            if k + 1 < k_count:
                # The chain is done with its stage (wait_group 0): give it back now, not one k-tile later
                # as the bf16 mainloop must (it keeps a chain in flight), so the ring keeps every stage
                # in flight. The kernel's common code releases the last one.
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
            if const_expr(rowcol):
                for i in cutlass.range(cute.size(acc), unroll_full=True):
                    acc[i] = acc[i] + part[i]
            else:
                for i in cutlass.range_constexpr(cute.size(tokens)):
                    tokens[i] = tokens[i] * w
                self._fp8_fma(acc, part, tokens)
        if const_expr(rowcol):
            self._fp8_scale(acc, row_s, col_s)
        read_in.advance(k_count)
        release_in.advance(cutlass.max(k_count - 1, 0))

    # ------------------------------------------------------------------------------------------
    # Scales.

    @cute.jit
    def _fp8_row_scales(self, dst: cute.Tensor, mScale: cute.Tensor, tCcD: cute.Tensor, tile_m: Int32, kb):
        """dst[h, mm] = the scale of the fragment's row (h, mm): mScale[row], or mScale[row, kb] with a
        k-block; rows clamped into the tensor (those past it are never stored)."""
        for mm in cutlass.range_constexpr(cute.size(tCcD, mode=[1])):
            for h in cutlass.range_constexpr(2):
                row = cutlass.min(tile_m * self.cfg.tile_m + tCcD[(2 * h, mm, 0)][0], cute.size(mScale, mode=[0]) - 1)
                if const_expr(kb is None):
                    dst[h, mm] = mScale[row]
                else:
                    dst[h, mm] = mScale[row, kb]

    @cute.jit
    def _fp8_col_scales(self, dst: cute.Tensor, mScale: cute.Tensor, tCcD: cute.Tensor, tile_n: Int32, kb):
        """dst[c, j, nn] = the scale of the fragment's column (c, j, nn), as _fp8_row_scales."""
        for nn in cutlass.range_constexpr(cute.size(tCcD, mode=[2])):
            for j in cutlass.range_constexpr(cute.size(tCcD, mode=[0]) // 4):
                for c in cutlass.range_constexpr(2):
                    col = cutlass.min(tile_n * self.cfg.tile_n + tCcD[(c + 4 * j, 0, nn)][1],
                                      cute.size(mScale, mode=[0]) - 1)
                    if const_expr(kb is None):
                        dst[c, j, nn] = mScale[col]
                    else:
                        dst[c, j, nn] = mScale[col, kb]

    @cute.jit
    def _fp8_block_scales(self, tokens: cute.Tensor, mScaleA: cute.Tensor, mScaleB: cute.Tensor, tCcD: cute.Tensor,
                          tile_m: Int32, tile_n: Int32, kb: Int32) -> Float32:
        """Load k-block kb's scales: the tokens' into `tokens` (a[rows of a plain tile] or a[columns of a
        swapped one]), and return the weights' (the tile's 128-row block of w)."""
        if const_expr(self.swap):  # the weights are the kernel's A
            self._fp8_col_scales(tokens, mScaleB, tCcD, tile_n, kb)
            return mScaleA[cutlass.min(tile_m * self.cfg.tile_m // BLOCK, cute.size(mScaleA, mode=[0]) - 1), kb]
        self._fp8_row_scales(tokens, mScaleA, tCcD, tile_m, kb)
        return mScaleB[cutlass.min(tile_n * self.cfg.tile_n // BLOCK, cute.size(mScaleB, mode=[0]) - 1), kb]

    @cute.jit
    def _fp8_fma(self, acc: cute.Tensor, part: cute.Tensor, scales: cute.Tensor):
        """acc += part * the scale of its row (plain tiles: scales[h, mm]) or column (swapped: scales[c, j, nn])."""
        for mm in cutlass.range_constexpr(cute.size(acc, mode=[1])):
            for nn in cutlass.range_constexpr(cute.size(acc, mode=[2])):
                for j in cutlass.range_constexpr(cute.size(acc, mode=[0]) // 4):
                    for h in cutlass.range_constexpr(2):
                        for c in cutlass.range_constexpr(2):
                            i = (c + 2 * h + 4 * j, mm, nn)
                            if const_expr(self.swap):
                                acc[i] = part[i] * scales[c, j, nn] + acc[i]
                            else:
                                acc[i] = part[i] * scales[h, mm] + acc[i]

    @cute.jit
    def _fp8_scale(self, acc: cute.Tensor, row_s: cute.Tensor, col_s: cute.Tensor):
        """acc *= the scale of its row times that of its column."""
        for mm in cutlass.range_constexpr(cute.size(acc, mode=[1])):
            for nn in cutlass.range_constexpr(cute.size(acc, mode=[2])):
                for j in cutlass.range_constexpr(cute.size(acc, mode=[0]) // 4):
                    for h in cutlass.range_constexpr(2):
                        for c in cutlass.range_constexpr(2):
                            i = (c + 2 * h + 4 * j, mm, nn)
                            acc[i] = acc[i] * (row_s[h, mm] * col_s[c, j, nn])
