"""Device code of the split-KV decode kernel's epilogue (attention_decode): the merge of the warps that took
slices of the same rows' keys, a CTA's rows stored as they are (one split) or as an fp32 partial with its lse in
the workspace, and the combine of a group's partials by the last of its splits to arrive. The kernel class
inherits these methods.

The combine is run-to-run deterministic: whichever CTA arrives last, it reads the partials in split order.
A group's counter in the workspace counts the arrivals and is reset by the combining CTA for the next
launch (the workspace's counters start at zero: rosekernels/scratch.py).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from rosekernels.kernels.attention_common import LN_2, LOG2_E, acc_rows
from rosekernels.kernels.attention_decode_plan import BAR_MMA, MMA_WARPS

COMBINE_BATCH = 8  # splits whose partials the combine loads at once


class SplitRows:
    """The split-KV epilogue's device methods (a mixin of the decode kernel class)."""

    @cute.jit
    def merge_key_slices(self, acc_O, row_max, row_sum, tScS, storage, scale_log2, tidx, rb, ks, thr_mma):
        """Fold the key slices of each row block into the warp with ks == 0, in slice order."""
        n_rows = cute.size(row_max)
        stats = cute.make_tensor(storage.row_stats.data_ptr(), cute.make_layout((self.tile_m, self.ks, 2)))
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(n_rows):
                row = rb * 16 + tScS[r, 0][0]
                stats[row, ks, 0] = row_max[r]
                stats[row, ks, 1] = row_sum[r]
        # Every warp is done with the K/V ring (and its loads have landed): reuse it as fp32 scratch.
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=32 * MMA_WARPS)
        O = acc_rows(acc_O)
        for r in cutlass.range_constexpr(n_rows):
            row = rb * 16 + tScS[r, 0][0]
            mx = stats[row, 0, 0]
            for j in cutlass.range_constexpr(1, self.ks):
                mx = cute.arch.fmax(mx, stats[row, j, 0])
            mx_safe = 0.0 if mx == -Float32.inf else mx
            total = Float32(0.0)
            for j in cutlass.range_constexpr(self.ks):
                total = total + stats[row, j, 1] * cute.math.exp2((stats[row, j, 0] - mx_safe) * scale_log2,
                                                                  fastmath=True)
            factor = cute.math.exp2((row_max[r] - mx_safe) * scale_log2, fastmath=True)
            for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                O[r, c] = O[r, c] * factor
            row_max[r] = mx
            row_sum[r] = total
        scratch_layout = cute.make_layout((16, self.d, self.ks - 1, self.tile_m // 16),
                                          stride=(self.scratch_stride, 1, 16 * self.scratch_stride,
                                                  16 * self.scratch_stride * (self.ks - 1)))
        scratch = cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), dtype=Float32), scratch_layout)
        if ks > 0:
            mine = thr_mma.partition_C(scratch[None, None, ks - 1, rb])
            for i in cutlass.range_constexpr(cute.size(acc_O)):
                mine[i] = acc_O[i]
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=32 * MMA_WARPS)
        if ks == 0:
            for j in cutlass.range_constexpr(self.ks - 1):
                theirs = thr_mma.partition_C(scratch[None, None, j, rb])
                for i in cutlass.range_constexpr(cute.size(acc_O)):
                    acc_O[i] = acc_O[i] + theirs[i]

    @cute.jit
    def store_rows(self, acc_O, row_max, row_sum, thr_mma, cols, mO, mLSE, mOp, mLSEp, scale_log2, num_splits,
                   lane, head_kv, batch, ratio, rows, row0, part_row):
        """O / sum and the lse of this warp's rows: to out and lse (one split), else to the workspace
        (fp32 O, natural-log lse) at workspace row part_row + packed row. `cols`: the (row, column) of each
        element of a (16, d) accumulator tile (an identity tensor, or one whose columns the kernel permuted)."""
        O = acc_rows(acc_O)
        tOcO = acc_rows(thr_mma.partition_C(cols))
        for r in cutlass.range_constexpr(cute.size(row_max)):
            total = row_sum[r]
            empty = total == 0.0  # the row saw no key: O is 0 there, lse -inf
            inv = cute.arch.rcp_approx(1.0 if empty else total)
            lse = -Float32.inf if empty else (
                row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
            p = row0 + tOcO[r, 0][0]
            if p < rows:
                if num_splits == 1:
                    s = p // ratio
                    head = head_kv * ratio + (p - s * ratio)
                    for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                        mO[batch, s, head, tOcO[r, c][1]] = (O[r, c] * inv).to(mO.element_type)
                    if lane % 4 == 0:
                        mLSE[batch, head, s] = lse
                else:
                    for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                        mOp[(part_row + p) * self.d + tOcO[r, c][1]] = O[r, c] * inv
                    if lane % 4 == 0:
                        mLSEp[part_row + p] = lse

    @cute.jit
    def combine_splits(self, mO, mLSE, mOp, mLSEp, mCount, storage, num_splits, num_groups, group, tidx,
                       head_kv, batch, m_block, ratio, rows):
        """Count this CTA's split in; the last split of the group to arrive combines all of them in
        split order (run-to-run deterministic) into out and lse, and resets the group's counter."""
        flag = cute.make_tensor(storage.last.data_ptr(), cute.make_layout(1))
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=32 * MMA_WARPS)  # every partial is written
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()  # this CTA's partial stores before the count
            arrived = cute.arch.atomic_add(mCount.iterator + group, Int32(1), sem="acq_rel", scope="gpu")
            flag[0] = Int32(arrived == num_splits - 1)
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=32 * MMA_WARPS)
        if flag[0] != 0:
            cute.arch.fence_acq_rel_gpu()
            first = m_block * self.tile_m
            vecs = self.d // 4  # each item: 4 columns of one row
            items = cutlass.min(self.tile_m, rows - first) * vecs
            acc = cute.make_rmem_tensor(4, Float32)
            lses = cute.make_rmem_tensor(COMBINE_BATCH, Float32)
            outs = cute.make_rmem_tensor((4, COMBINE_BATCH), Float32)
            for it in cutlass.range(tidx, items, 32 * MMA_WARPS, unroll=1):
                i = it // vecs
                col = (it - i * vecs) * 4
                mx = Float32(-Float32.inf)
                total = Float32(0.0)
                acc.fill(0.0)
                # COMBINE_BATCH splits at a time, every load of a batch issued before any is used, so that
                # they share one L2 round trip; a slot past the last split rereads the last one's row and
                # counts as empty (lse -inf). (An unrolled loop over the splits left a remainder loop of
                # one round trip a split: 22 splits of 64-row tiles ran 1.5x the time of 16 or 32.)
                for base in cutlass.range(0, num_splits, COMBINE_BATCH, unroll=1):
                    for u in cutlass.range_constexpr(COMBINE_BATCH):
                        row = (cutlass.min(base + u, num_splits - 1) * num_groups + group) * self.tile_m + i
                        # .cg: read L2, where the other CTAs' partials are, never a stale L1 line.
                        lses[u] = cute.arch.load(mLSEp.iterator + row, Float32, cop="cg")
                        for j in cutlass.range_constexpr(4):
                            outs[j, u] = cute.arch.load(mOp.iterator + (row * self.d + col + j), Float32, cop="cg")
                    for u in cutlass.range_constexpr(COMBINE_BATCH):
                        real = base + u < num_splits
                        lse = lses[u] if real else -Float32.inf
                        new = cute.arch.fmax(mx, lse)
                        new_safe = 0.0 if new == -Float32.inf else new
                        keep = cute.math.exp2((mx - new_safe) * LOG2_E, fastmath=True)
                        w = cute.math.exp2((lse - new_safe) * LOG2_E, fastmath=True)
                        total = total * keep + w
                        for j in cutlass.range_constexpr(4):
                            # (a padding slot adds 0, not 0 x the reread row, which may be inf)
                            acc[j] = acc[j] * keep + w * (outs[j, u] if real else 0.0)
                        mx = new
                empty = total == 0.0
                inv = cute.arch.rcp_approx(1.0 if empty else total)
                p = first + i
                s = p // ratio
                head = head_kv * ratio + (p - s * ratio)
                for j in cutlass.range_constexpr(4):
                    mO[batch, s, head, col + j] = (acc[j] * inv).to(mO.element_type)
                if col == 0:
                    mLSE[batch, head, s] = -Float32.inf if empty else mx + cute.math.log(total, fastmath=True)
            if tidx == 0:
                mCount[group] = Int32(0)  # ready for the next launch
