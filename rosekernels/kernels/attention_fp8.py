"""Device code of the split-KV decode kernel's e4m3 KV cache (attention_decode's KV-cache variants with
`kv_fp8`); the kernel class inherits these methods and calls them only for such configs.

The producer's TMA fills a ring of e4m3 K and V tiles (half the bytes of a bf16 cache: what decode attention is
bound by). 16-row tiles are widened in registers (`widen_regs`, below). Otherwise each tile is widened into one of
two fp16 tiles in shared memory (e4m3 values are exact in fp16, one conversion a pair), V's rows past the
sequence's end as zeros (the cache may hold NaN there), then the fp16 mainloop runs on it: ldmatrix and mma.sync as
for an fp16 cache, a bf16 query scaled into fp16 by a power of two (attention_decode's `load_q_scaled`). The ring
stage goes back to the producer as soon as it is widened (kept through the MMAs, a stage of half a bf16 tile's
bytes would sit out of flight). Who widens:

- the MMA warps, together, before each tile's MMAs (`widen`): one barrier of theirs per tile separates
  the widening from the MMAs; the two tiles alternate, so the next widening never overwrites a tile a
  warp may still read (every warp has passed the barrier after its last MMA on it);
- `widen_warps`: WIDEN_WARPS warps of their own (`widen_tiles`), a tile ahead, so that widening and
  MMAs overlap. Named barriers hand the tiles over: _BAR_WIDENED + tile (the widen warps arrive once it is
  written, the MMA warps wait before reading it) and _BAR_FREE + tile (the MMA warps arrive after their
  last MMA on it, the widen warps wait before writing it again).

`widen_regs` (16-row tiles, fp16 MMAs) widens in registers instead: each MMA warp loads its own keys' e4m3
bytes from the ring straight into the layout of its mma.sync B fragments and converts them there, so no
widened tile, barrier or ldmatrix stands between the TMA and the MMAs, and the stage goes back as soon as
the warp's loads have read it. The columns are permuted to make that layout contiguous (`reg_operands`):
for Q @ K^T the sum runs over d in any order, so K's columns and the query's take the same permutation
(`qk_cols`: a thread's elements of a key are d / 4 consecutive bytes); for P @ V, V's columns are the
output's, whose permutation (`pv_cols`: d / 8 consecutive bytes of a key a thread) the stores undo.

The descales are per KV head: k_descale multiplies the scores (folded into the softmax scale), v_descale
the output (which the split combine takes as it is: it is linear in the partial outputs).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from rosekernels.kernels.attention_common import byte_perm, e4m3x2_to_f16x2
from rosekernels.kernels.attention_decode_plan import BAR_MMA, MMA_WARPS, WIDEN_WARPS

VEC = 16  # e4m3 elements a thread widens at once (16 bytes in, 32 out)
_BAR_WIDENED = 2  # + the widened tile (0, 1): written (widen_warps)
_BAR_FREE = 4  # + the widened tile: read by every MMA warp (widen_warps)
HANDOFF_THREADS = 32 * (MMA_WARPS + WIDEN_WARPS)  # the MMA warps and the widen warps


def qk_cols(rows: int, d: int) -> cute.Layout:
    """(rows, k) -> the index of (row, column) in a column-major (rows, d) tile: the column of the mma.sync
    k position k = k0 + 2 c + 8 h + 16 j (k0, h: a thread's pair and half; c: its lane % 4; j: the k16
    block) is k0 + 2 h + 4 j + (d / 4) c, so that lane c's columns of a row are d / 4 consecutive ones."""
    return cute.make_layout((rows, (2, 4, 2, d // 16)), stride=(1, (rows, rows * (d // 4), 2 * rows, 4 * rows)))


def pv_cols(rows: int, d: int) -> cute.Layout:
    """(rows, n) -> the index of (row, column) in a column-major (rows, d) tile: the column of n = g + 8 j
    (g: a thread's lane // 4 in the B fragment; j: the n8 block) is (d / 8) g + j, so that lane g's
    columns of a row of V are d / 8 consecutive ones."""
    return cute.make_layout((rows, (8, d // 8)), stride=(1, (rows * (d // 8), rows)))


class Fp8KVTiles:
    """The e4m3 KV cache's methods (a mixin of the KV-cache decode kernel)."""

    def _fp8_layouts(self):
        """(tiles, ring): shared-memory layouts of the two widened tiles (fp16) and of the TMA
        ring of e4m3 tiles, (tile_n, d, buffers or stages); widen_regs: (ring, ring), no widened tiles."""
        e4m3 = cutlass.Float8E4M3FN
        atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, e4m3, self.d),
                                               e4m3)
        ring = cute.tile_to_shape(atom, (self.tile_n, self.d, self.stages), order=(0, 1, 2))
        if cutlass.const_expr(self.cfg.widen_regs):
            return ring, ring
        return self._smem_layout(buffers=2), ring

    @cute.jit  # traced like __call__: the struct's annotations are evaluated there
    def _set_fp8_storage(self, tiles_layout, ring_layout):
        if cutlass.const_expr(self.cfg.widen_regs):  # the ring alone (sK, sV: the merge reuses them as scratch)
            # The key slices' merge writes (ks - 1) x tile_m rows of d + 8 fp32 from sK on, into sV past it.
            scratch = (self.ks - 1) * self.tile_m * self.scratch_stride * 4
            assert scratch <= 2 * cute.cosize(ring_layout), (scratch, cute.cosize(ring_layout))
            self._set_storage(ring_layout, cutlass.Float8E4M3FN)
            return

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            last: cute.struct.MemRange[Int32, 1]
            row_stats: cute.struct.MemRange[Float32, 2 * self.ks * self.tile_m]
            sK: cute.struct.Align[cute.struct.MemRange[self.mma_dtype, cute.cosize(tiles_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.mma_dtype, cute.cosize(tiles_layout)], 1024]
            sK8: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(ring_layout)], 1024]
            sV8: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(ring_layout)], 1024]

        self.shared_storage = SharedStorage

    @cute.jit
    def widen(self, sK8: cute.Tensor, sV8: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, stage: Int32, tile: Int32,
              valid: Int32, tidx: Int32) -> Int32:
        """Ring stage `stage` (e4m3) into tile `tile` of sK/sV (fp16) by the MMA warps, V's rows from
        `valid` on as zeros; returns `tile`, whose stage index the mainloop then reads."""
        self._widen_tile(sK8, sV8, sK, sV, stage, tile, valid, tidx, 32 * MMA_WARPS)
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=32 * MMA_WARPS)
        return tile

    @cute.jit
    def widen_tiles(self, sK8: cute.Tensor, sV8: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, pipe,
                    seqlen_k: Int32, t_begin: Int32, n_local: Int32, wtid: Int32):
        """The widen warps (`widen_warps`; wtid: the thread's index among them): the CTA's tiles from the ring
        into the two widened tiles in turn, each handed to the MMA warps (mma_tile waits for it)."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for i in cutlass.range(n_local, unroll=1):
            tile = i % 2
            if i >= 2:  # the MMA warps are done with the tile two back
                cute.arch.barrier(barrier_id=_BAR_FREE + tile, number_of_threads=HANDOFF_THREADS)
            pipe.consumer_wait(state)
            self._widen_tile(sK8, sV8, sK, sV, state.index, tile, seqlen_k - (t_begin + i) * self.tile_n, wtid,
                             32 * WIDEN_WARPS)
            # Lane 0 releases for its warp: the warp's reads first. The stage is free once every warp has.
            cute.arch.sync_warp()
            pipe.consumer_release(state)
            state.advance()
            cute.arch.barrier_arrive(barrier_id=_BAR_WIDENED + tile, number_of_threads=HANDOFF_THREADS)
        # Take the MMA warps' last hand-backs (of the last two tiles), so that no arrival outlives the CTA.
        for j in cutlass.range(cutlass.max(n_local - 2, 0), n_local, unroll=1):
            cute.arch.barrier(barrier_id=_BAR_FREE + j % 2, number_of_threads=HANDOFF_THREADS)

    @cute.jit
    def mma_tile(self, i: Int32) -> Int32:
        """The MMA warps, widen_warps: wait for the i-th widened tile; returns its index."""
        tile = i % 2
        cute.arch.barrier(barrier_id=_BAR_WIDENED + tile, number_of_threads=HANDOFF_THREADS)
        return tile

    @cute.jit
    def mma_done(self, tile: Int32):
        """The MMA warps, widen_warps: their last MMA on `tile` is issued and its operands read."""
        cute.arch.barrier_arrive(barrier_id=_BAR_FREE + tile, number_of_threads=HANDOFF_THREADS)

    @cute.jit
    def _widen_tile(self, sK8: cute.Tensor, sV8: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, stage: Int32,
                    tile: Int32, valid: Int32, tid: Int32, threads: int):
        """widen's work by `threads` threads (tid: the thread's index among them), no barrier."""
        chunks = self.d // VEC
        for it in cutlass.range(tid, self.tile_n * chunks, threads, unroll=2):
            row = it // chunks
            col = it - row * chunks
            self._widen_chunk(sK8, sK, stage, tile, row, col, None)
            self._widen_chunk(sV8, sV, stage, tile, row, col, row < valid)

    @cute.jit
    def _widen_chunk(self, src: cute.Tensor, dst: cute.Tensor, stage: Int32, tile: Int32, row: Int32, col: Int32,
                     keep):
        """VEC elements of a row: e4m3 from the ring to the fp16 tile; zeros where `keep` (a
        predicate, or None for always) is false: past the sequence's end P is 0, but 0 * NaN is not."""
        narrow = cute.make_rmem_tensor((1, VEC), cutlass.Float8E4M3FN)
        cute.autovec_copy(cute.local_tile(src[None, None, stage], (1, VEC), (row, col)), narrow)
        wide = cute.make_rmem_tensor((1, VEC), self.mma_dtype)
        wide.store(narrow.load().to(self.mma_dtype))
        if cutlass.const_expr(keep is not None):
            if not keep:
                wide.fill(0.0)
        cute.autovec_copy(wide, cute.local_tile(dst[None, None, tile], (1, VEC), (row, col)))

    @cute.jit
    def reg_operands(self, sK8: cute.Tensor, sV8: cute.Tensor, thr_mma, ks: Int32) -> tuple:
        """widen_regs: this warp's keys of every ring stage (e4m3) partitioned as the B fragments of its
        MMAs, ((2, 2), n8 blocks, k16 blocks, stage): K by `qk_cols` (n: the key), V^T by `pv_cols` (k:
        the key); and the (key, column) of each element of V's, for the tail's zeros."""
        w, d = self.warp_keys, self.d
        stages = cute.size(sK8, mode=[2])
        sKw = cute.local_tile(sK8, (w, d, stages), (ks, 0, 0))
        sVw = cute.local_tile(sV8, (w, d, stages), (ks, 0, 0))
        k_view = qk_cols(w, d)
        v_view = pv_cols(w, d)  # (key, n): V^T below takes its modes the other way round
        k_view = cute.make_layout((*k_view.shape, stages), stride=(*k_view.stride, w * d))
        vt_view = cute.make_layout((v_view.shape[1], w, stages), stride=(v_view.stride[1], 1, w * d))
        tVcV = thr_mma.partition_B(cute.composition(cute.make_identity_tensor((w, d)),
                                                    cute.select(vt_view, mode=[0, 1])))
        return (thr_mma.partition_B(cute.composition(sKw, k_view)),
                thr_mma.partition_B(cute.composition(sVw, vt_view)), tVcV)

    @cute.jit
    def load_regs(self, tSsK: cute.Tensor, tOsV: cute.Tensor, stage: Int32) -> tuple:
        """widen_regs: this warp's e4m3 K and V of ring stage `stage` into registers, in the order their
        shared-memory bytes lie (a thread's bytes of a key together: 16-byte loads), (rK8, rV8)."""
        kb, vb = tSsK.shape, tOsV.shape
        nk, kk = cute.size(kb[1]), cute.size(kb[2])
        nv, kv = cute.size(vb[1]), cute.size(vb[2])
        rK8 = cute.make_rmem_tensor(cute.make_layout((kb[0], nk, kk), stride=((1, 2), 4 * kk, 4)),
                                    cutlass.Float8E4M3FN)
        rV8 = cute.make_rmem_tensor(cute.make_layout((vb[0], nv, kv), stride=((nv, 2 * nv), 1, 4 * nv)),
                                    cutlass.Float8E4M3FN)
        cute.autovec_copy(tSsK[None, None, None, stage], rK8)
        cute.autovec_copy(tOsV[None, None, None, stage], rV8)
        return rK8, rV8

    @cute.jit
    def widened_k(self, r8: cute.Tensor) -> cute.Tensor:
        """K's e4m3 registers as the fp16 B fragment ((2, 2), n8 blocks, k16 blocks): a fragment register is two
        neighbouring bytes of a key, one conversion."""
        wide = cute.make_rmem_tensor(r8.shape, self.mma_dtype)
        wide.store(r8.load().to(self.mma_dtype))
        return wide

    @cute.jit
    def widened_v(self, r8: cute.Tensor) -> cute.Tensor:
        """V's e4m3 registers (load_regs: a thread's bytes of a key together) as the fp16 B fragment ((2, 2),
        n8 blocks, k16 blocks): a fragment register holds two keys' bytes of one column (k0 = 0, 1), which
        one byte permute gathers for two registers (two n8 blocks), each then one conversion."""
        words = cute.recast_tensor(r8, Int32)  # ((k0, h), n8 blocks / 4, k16 blocks)
        wide = cute.make_rmem_tensor(r8.shape, self.mma_dtype)
        wide32 = cute.recast_tensor(wide, Int32)  # ((1, h), n8 blocks, k16 blocks)
        for kb in cutlass.range_constexpr(cute.size(words, mode=[2])):
            for h in cutlass.range_constexpr(2):
                for q in cutlass.range_constexpr(cute.size(words, mode=[1])):
                    for x in cutlass.range_constexpr(2):  # bytes 2x, 2x + 1 of each key's word: blocks 4q + 2x, + 1
                        pair = byte_perm(words[(0, h), q, kb], words[(1, h), q, kb], 0x5140 + 0x2222 * x)
                        wide32[(0, h), 4 * q + 2 * x, kb] = e4m3x2_to_f16x2(pair, False)
                        wide32[(0, h), 4 * q + 2 * x + 1, kb] = e4m3x2_to_f16x2(pair, True)
        return wide

    @cute.jit
    def zero_tail(self, r8: cute.Tensor, tVcV: cute.Tensor, first: Int32, valid: Int32):
        """V's e4m3 registers (load_regs) of keys from `valid` on as zeros (this warp's keys start at `first` in
        the tile): past the sequence's end P is 0, but 0 * NaN is not."""
        if valid < self.tile_n:
            words = cute.recast_tensor(r8, Int32)  # ((k0, h), n8 blocks / 4, k16 blocks): a key's bytes
            for kb in cutlass.range_constexpr(cute.size(words, mode=[2])):
                for v in cutlass.range_constexpr(4):
                    if first + tVcV[(v % 2, v // 2), 0, kb][0] >= valid:
                        for q in cutlass.range_constexpr(cute.size(words, mode=[1])):
                            words[(v % 2, v // 2), q, kb] = Int32(0)
