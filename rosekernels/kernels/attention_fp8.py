"""Device code of the split-KV decode kernel's e4m3 KV cache (attention_decode's KV-cache variants with
`kv_fp8`); the kernel class inherits these methods and calls them only for such configs.

The producer's TMA fills a ring of e4m3 K and V tiles (half the bytes of a bf16 cache: what decode
attention is bound by). Each tile is widened into one of two fp16 tiles in shared memory (e4m3 values
are exact in fp16, one conversion a pair), V's rows past the sequence's end as zeros (the cache may hold
NaN there), then the fp16 mainloop runs on it: ldmatrix and mma.sync as for an fp16 cache, a bf16 query
scaled into fp16 by a power of two (attention_decode's `load_q_scaled`). The ring stage goes back to the
producer as soon as it is widened (kept through the MMAs, a stage of half a bf16 tile's bytes would sit
out of flight). Who widens:

- the MMA warps, together, before each tile's MMAs (`widen`): one barrier of theirs per tile separates
  the widening from the MMAs; the two tiles alternate, so the next widening never overwrites a tile a
  warp may still read (every warp has passed the barrier after its last MMA on it);
- `widen_warps`: WIDEN_WARPS warps of their own (`widen_tiles`), a tile ahead, so that widening and
  MMAs overlap. Named barriers hand the tiles over: _BAR_WIDENED + tile (the widen warps arrive once it is
  written, the MMA warps wait before reading it) and _BAR_FREE + tile (the MMA warps arrive after their
  last MMA on it, the widen warps wait before writing it again).

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

from rosekernels.kernels.attention_decode_plan import BAR_MMA, MMA_WARPS, WIDEN_WARPS

VEC = 16  # e4m3 elements a thread widens at once (16 bytes in, 32 out)
_BAR_WIDENED = 2  # + the widened tile (0, 1): written (widen_warps)
_BAR_FREE = 4  # + the widened tile: read by every MMA warp (widen_warps)
HANDOFF_THREADS = 32 * (MMA_WARPS + WIDEN_WARPS)  # the MMA warps and the widen warps


class Fp8KVTiles:
    """The e4m3 KV cache's methods (a mixin of the KV-cache decode kernel)."""

    def _fp8_layouts(self):
        """(tiles, ring): shared-memory layouts of the two widened tiles (fp16) and of the TMA
        ring of e4m3 tiles, (tile_n, d, buffers or stages)."""
        e4m3 = cutlass.Float8E4M3FN
        atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, e4m3, self.d),
                                               e4m3)
        ring = cute.tile_to_shape(atom, (self.tile_n, self.d, self.stages), order=(0, 1, 2))
        return self._smem_layout(buffers=2), ring

    @cute.jit  # traced like __call__: the struct's annotations are evaluated there
    def _set_fp8_storage(self, tiles_layout, ring_layout):
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
