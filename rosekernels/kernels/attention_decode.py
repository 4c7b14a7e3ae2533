"""Split-KV decode attention for Hopper (FlashDecoding style), in CuTeDSL.

Same contract as `rosekernels.attention` (q [B, S_q, Hq, d], k/v [B, S_kv, Hkv, d], causal aligned
bottom-right, lse [B, Hq, S_q] fp32 natural log, a row that sees no key gets out 0 and lse -inf), for
decode shapes: `attention()` sends every call with S_q <= MAX_SEQLEN_Q here. Decode attention reads
each K/V element once and does 4 * S_q * Hq/Hkv flops per element, so the K/V read bandwidth is the
whole story; the design spreads that read over every SM:

- GQA packing: the S_q * Hq/Hkv query rows sharing a KV head (row p = s * ratio + head in group)
  form the M dimension of one CTA, so K/V are read once for all of them; `tile_m` (16/32/64) rows
  per CTA, more rows take more CTAs (m-blocks, adjacent in the grid so they share K/V in L2).
- Split-KV: the keys are cut into `num_splits` chunks of whole `tile_n` tiles; one CTA per
  (split, m-block, KV head, batch). The host picks the split count from B * Hkv against the SM
  count (`choose_splits`) so the grid fills the SMs (two CTAs fit per SM; one streams as fast).
- One producer warp streams the chunk's K and V tiles with TMA into a `num_stages` ring of
  shared-memory buffers (one mbarrier pair per stage). Four MMA warps each take 16 rows and a
  slice of the tile's keys (tile_m 16: each warp 1/4 of the keys; 32: 1/2; 64: all of them):
  S = Q K^T and O += P V with warp-level mma.sync m16n8k16 (fp32 accumulate; Q stays in
  registers, K and V come in with ldmatrix, or an e4m3 cache's straight from the ring: attention_fp8),
  online softmax in registers (exp2, scale folded in).
- Epilogue: warps holding the same rows merge their (max, sum, O) through shared memory in warp
  order. With one split the CTA writes out and lse; otherwise it writes its normalized fp32
  partial O and its partial lse to a workspace and bumps a per-(batch, KV head, m-block) counter:
  the last CTA to arrive combines all splits in split order (deterministic) and resets the
  counter to 0 for the next launch (attention_splits: the methods of both).
- Programmatic dependent launch: a CTA sets up before `griddepcontrol.wait` (the previous kernel in
  the stream may still run) and, its work done, lets the next kernel launch.

KV-cache variants (`varlen`, `page_rows`; rosekernels.attention_with_kvcache, rosekernels/ops/kvcache.py):
the same kernel over a cache [B, S_max, Hkv, d] or a paged one [num_blocks, block_size, Hkv, d] with a
block table, each sequence's key count read on the device after the PDL wait. A CTA loads only the
tiles that hold keys of its sequence (none past its end: it still writes a neutral partial, lse -inf,
which the combine weighs 0); a paged tile is loaded as boxes of page_rows rows, each inside one page
(the page a TMA coordinate; a tile's table entries are read while the previous tile loads); the last
tile's V rows past the length are zeroed before P V (P is 0 there, but the cache may hold NaN).

Configs, the split-count model (`choose_splits`), the tuner's search space and the warm-up set are
in attention_decode_plan.py (re-exported here). This module holds the device code, `compile(config)`
and `workload(config, shape)`; the launches of a call and the registered ops are in
rosekernels/ops/attention.py (`attention_decode()`, the split-KV kernel for any S_q) and
rosekernels/ops/kvcache.py.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import random

import torch

from rosekernels import jit  # first: it pins CUTE_DSL_ARCH=sm_90a before cutlass loads
from rosekernels import checks, modes
from rosekernels.kernels.attention_common import (
    CUTE_DTYPES, LOG2_E, acc_as_a, acc_rows, check, convert_pairs, fake_qkv_out_lse, pack_pairs, quad_max, quad_sum,
    tma_tiles, warp_mma)
from rosekernels.kernels.attention_fp8 import Fp8KVTiles, pv_cols, qk_cols
from rosekernels.kernels.attention_splits import SplitRows
from rosekernels.kernels.attention_decode_plan import (  # noqa: F401 - the plan's names are this kernel's
    BAR_MMA, MAX_SEQLEN_Q, MMA_WARPS, OP, WIDEN_WARPS, DecodeConfig, DecodeShape, candidates, causal_shift_for,
    config_for, kvcache_config_for, kvcache_variants_for, rank, split_plan, variants_for)
from rosekernels.workload import Workload

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
from cutlass.tensor_utils import LayoutEnum

Config, Shape = DecodeConfig, DecodeShape



# ---------------------------------------------------------------------------------------------
# Device code.


class _DecodeAttentionSm90(SplitRows):
    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg
        self.dtype = CUTE_DTYPES[cfg.dtype]
        # The MMAs' operand type (DecodeConfig.mma_dtype): fp16 for an e4m3 cache's 16-row tiles, a bf16 query
        # scaled into it by `load_q_scaled`.
        self.mma_dtype = CUTE_DTYPES[cfg.mma_dtype]
        self.d = cfg.head_dim
        self.tile_m, self.tile_n, self.stages = cfg.tile_m, cfg.tile_n, cfg.num_stages
        self.ks = cfg.key_slices
        self.warp_keys = self.tile_n // self.ks
        # Warp MMA_WARPS is the TMA producer; widen_warps: WIDEN_WARPS widen warps follow it, and they, not
        # the MMA warps, consume the ring.
        self.num_threads = 32 * cfg.warps
        self.ring_consumers = WIDEN_WARPS if cfg.widen_warps else MMA_WARPS
        self.scratch_stride = self.d + 8  # fp32 row stride of the merge scratch: no bank conflicts

    def _smem_layout(self, buffers: int | None = None):
        """K (and V) tiles of the MMAs' dtype in shared memory (the query's, or fp16 widened from an e4m3
        cache): (tile_n, d, the ring's stages or `buffers`)."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.mma_dtype, self.d), self.mma_dtype)
        return cute.tile_to_shape(atom, (self.tile_n, self.d, buffers or self.stages), order=(0, 1, 2))

    # Set-up both kernels share (called while they are traced).

    def _tiled_mma(self):
        """One warp per tiled MMA; N permuted to 16 so ldmatrix.x4 feeds two n8 blocks at once."""
        return cute.make_tiled_mma(warp.MmaF16BF16Op(self.mma_dtype, Float32, (16, 8, 16)), (1, 1, 1),
                                   permutation_mnk=(16, 16, 16))

    @cute.jit  # traced like __call__: the struct's annotations are evaluated there
    def _set_storage(self, sKV_layout, dtype=None):
        """The CTA's shared memory: the ring's barriers, the combine's flag, the key slices' row statistics and
        the K and V tiles of `sKV_layout` (the query's dtype unless `dtype`)."""
        tiles = self.dtype if cutlass.const_expr(dtype is None) else dtype

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            last: cute.struct.MemRange[Int32, 1]
            row_stats: cute.struct.MemRange[Float32, 2 * self.ks * self.tile_m]
            sK: cute.struct.Align[cute.struct.MemRange[tiles, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[tiles, cute.cosize(sKV_layout)], 1024]

        self.shared_storage = SharedStorage

    def _storage_and_pipeline(self):
        """The CTA's shared storage and its K/V ring (a stage holds one K and one V tile)."""
        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.ring_consumers),  # lane 0 of each
            tx_count=2 * self.tile_bytes, defer_sync=True)
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()
        return storage, pipe

    def _occupancy(self) -> dict:
        """Launch options: room in the registers for the CTAs per SM the plan counts on (min_ctas_per_sm), and
        then the whole carveout for shared memory, which their rings need (given it, the DSL does not ask a
        device for its size while compiling)."""
        if self.cfg.min_ctas_per_sm == 1:
            return {}
        return {"min_blocks_per_mp": self.cfg.min_ctas_per_sm, "preferred_smem_carveout": 100}

    def _grid(self, q: cute.Tensor, k: cute.Tensor, num_splits: Int32, batches) -> list:
        """One CTA per (split, m-block of the GQA-packed query rows), KV head and sequence."""
        rows = q.shape[1] * (q.shape[2] // k.shape[2])
        return [num_splits * ((rows + self.tile_m - 1) // self.tile_m), k.shape[2], batches]

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
                 o_part: cute.Tensor, lse_part: cute.Tensor, counters: cute.Tensor, scale_log2: Float32,
                 causal_shift: Int32, num_splits: Int32, tiles_per_split: Int32, stream):
        # [B, S, H, d] -> (S, d, H, B) for TMA and local_tile.
        mK, mV = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in (k, v)]
        sKV_layout = self._smem_layout()
        tile_layout = cute.select(sKV_layout, mode=[0, 1])
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(tma_load, mK, tile_layout, (self.tile_n, self.d))
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(tma_load, mV, tile_layout, (self.tile_n, self.d))
        self.tile_bytes = cute.size_in_bytes(self.dtype, tile_layout)
        tiled_mma = self._tiled_mma()

        self._set_storage(sKV_layout)

        self.kernel(q, tma_atom_k, tma_k, tma_atom_v, tma_v, o, lse, o_part, lse_part, counters,
                    scale_log2, causal_shift, num_splits, tiles_per_split, sKV_layout, tiled_mma).launch(
            grid=self._grid(q, k, num_splits, k.shape[0]),
            block=[self.num_threads, 1, 1],
            stream=stream,
            use_pdl=self.cfg.pdl,
        )

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, tma_atom_k: cute.CopyAtom, mK: cute.Tensor, tma_atom_v: cute.CopyAtom,
               mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor,
               mCount: cute.Tensor, scale_log2: Float32, causal_shift: Int32, num_splits: Int32,
               tiles_per_split: Int32, sKV_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, head_kv, batch = cute.arch.block_idx()

        seqlen_q, seqlen_k = mQ.shape[1], mK.shape[0]
        ratio = mQ.shape[2] // mK.shape[2]
        rows = seqlen_q * ratio
        m_blocks = (rows + self.tile_m - 1) // self.tile_m
        split = bidx // m_blocks
        m_block = bidx - split * m_blocks
        n_tiles = (seqlen_k + self.tile_n - 1) // self.tile_n
        t_begin = split * tiles_per_split
        n_local = cutlass.min(tiles_per_split, n_tiles - t_begin)  # >= 1: the host sizes the splits
        # (batch, KV head, m-block): the unit whose splits combine; one workspace counter each.
        num_groups = mK.shape[3] * mK.shape[2] * m_blocks
        group = (batch * mK.shape[2] + head_kv) * m_blocks + m_block

        if warp_idx == MMA_WARPS:
            for atom in (tma_atom_k, tma_atom_v):
                cpasync.prefetch_descriptor(atom)

        storage, pipe = self._storage_and_pipeline()
        # Programmatic dependent launch: the set-up above may overlap the previous kernel in the
        # stream; every global access below waits for it to complete.
        cute.arch.griddepcontrol_wait()
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)

        if warp_idx == MMA_WARPS:
            gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.d), (None, 0))
            gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.d), (None, 0))
            tKsK, tKgK = tma_tiles(tma_atom_k, sK, gK)
            tVsV, tVgV = tma_tiles(tma_atom_v, sV, gV)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for i in cutlass.range(n_local, unroll=1):
                pipe.producer_acquire(state)
                bar = pipe.producer_get_barrier(state)
                cute.copy(tma_atom_k, tKgK[None, t_begin + i], tKsK[None, state.index], tma_bar_ptr=bar)
                cute.copy(tma_atom_v, tVgV[None, t_begin + i], tVsV[None, state.index], tma_bar_ptr=bar)
                state.advance()
        else:
            self.mma(mQ, mO, mLSE, mOp, mLSEp, mCount, sK, sV, storage, pipe, tiled_mma, scale_log2,
                     causal_shift, num_splits, num_groups, group, tidx, warp_idx, head_kv, batch, split,
                     m_block, ratio, rows, seqlen_k, t_begin, n_local)

    @cute.jit
    def mma(self, mQ, mO, mLSE, mOp, mLSEp, mCount, sK, sV, storage, pipe, tiled_mma, scale_log2,
            causal_shift, num_splits, num_groups, group, tidx, warp_idx, head_kv, batch, split, m_block,
            ratio, rows, seqlen_k, t_begin, n_local, mTable=None, block_size=None, num_blocks=None, fp8=None):
        """The MMA warps' work (the KV-cache kernel passes its block table, page size and page count
        when paged; with an e4m3 cache, fp8 = (its K ring, V ring, v_descale): sK and sV are the widened
        tiles, or with widen_regs the ring itself, attention_fp8)."""
        lane = tidx % 32
        rb = warp_idx // self.ks  # this warp's 16-row block
        ks = warp_idx - rb * self.ks  # and its slice of each tile's keys
        row0 = m_block * self.tile_m + rb * 16  # packed row of the warp's first row
        thr_mma = tiled_mma.get_slice(lane)

        regs = fp8 is not None and self.cfg.widen_regs  # e4m3 widened in registers: sK, sV are the ring
        q_cols = o_cols = cute.make_identity_tensor((16, self.d))
        if cutlass.const_expr(regs):
            tSsK, tOsV, tVcV = self.reg_operands(sK, sV, thr_mma, ks)
            q_cols = cute.composition(q_cols, qk_cols(16, self.d))
            o_cols = cute.composition(o_cols, pv_cols(16, self.d))
        else:
            # This warp's keys of every stage, and V^T (d, keys, stage) as the B operand of P @ V.
            stages = cute.size(sK, mode=[2])  # the ring's (an e4m3 cache: its two widened tiles, attention_fp8)
            sKw = cute.local_tile(sK, (self.warp_keys, self.d, stages), (ks, 0, 0))
            sVw = cute.local_tile(sV, (self.warp_keys, self.d, stages), (ks, 0, 0))
            sVtw = cute.composition(
                sVw, cute.make_ordered_layout((self.d, self.warp_keys, stages), order=(1, 0, 2)))
            copy_K = cute.make_tiled_copy_B(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.mma_dtype),
                tiled_mma).get_slice(lane)
            copy_V = cute.make_tiled_copy_B(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.mma_dtype),
                tiled_mma).get_slice(lane)
            tSsK = copy_K.partition_S(sKw)
            tOsV = copy_V.partition_S(sVtw)
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKw[None, None, 0]))
            tOrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVtw[None, None, 0]))
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((16, self.warp_keys)), Float32)
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((16, self.d)), Float32)
        acc_O.fill(0.0)

        # Q rows straight into the A fragment (read once; zero past the last packed row; regs: columns as K's).
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_shape_A((16, self.d)))
        tQcQ = thr_mma.partition_A(q_cols)
        if cutlass.const_expr(self.mma_dtype == self.dtype):
            for i in cutlass.range_constexpr(cute.size(tSrQ)):
                tSrQ[i] = self.q_element(mQ, tQcQ[i], row0, ratio, rows, batch, head_kv)
            pack_pairs(tSrQ)
        else:
            scale_log2 = self.load_q_scaled(tSrQ, tQcQ, mQ, row0, ratio, rows, batch, head_kv, scale_log2)

        # Keys row r may see: [0, seqlen_k) and, causal, [0, s + causal_shift] (causal_shift =
        # S_kv - S_q; without causal it is S_kv, which never binds).
        S = acc_rows(acc_S)
        tScS = acc_rows(thr_mma.partition_C(cute.make_identity_tensor((16, self.warp_keys))))
        n_rows = cute.size(S, mode=[0])
        limit = cute.make_rmem_tensor(n_rows, Int32)
        for r in cutlass.range_constexpr(n_rows):
            limit[r] = cutlass.min(seqlen_k, (row0 + tScS[r, 0][0]) // ratio + causal_shift + 1)
        # Tiles from this one on hold a key past some row's limit in this CTA: they need the mask.
        first_s = (m_block * self.tile_m) // ratio
        t_mask = cutlass.min(seqlen_k, first_s + causal_shift + 1) // self.tile_n

        row_max = cute.make_rmem_tensor(n_rows, Float32)
        row_sum = cute.make_rmem_tensor(n_rows, Float32)
        rescales = cute.make_rmem_tensor(n_rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        O = acc_rows(acc_O)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if cutlass.const_expr(self.cfg.paged):
            # This warp's table entries of the next tile, read a tile ahead (as the producer does).
            entries = cute.make_rmem_tensor(max(1, self.warp_keys // self.cfg.page_rows), Int32)
            self.read_entries(entries, mTable, batch, t_begin * self.tile_n + ks * self.warp_keys, block_size)
        for i in cutlass.range(n_local, unroll=1):
            t = t_begin + i
            if cutlass.const_expr(self.cfg.paged):
                bad = self.bad_boxes(entries, t * self.tile_n + ks * self.warp_keys, seqlen_k, num_blocks)
                self.read_entries(entries, mTable, batch, (t + 1) * self.tile_n + ks * self.warp_keys, block_size)
            if cutlass.const_expr(fp8 is not None and self.cfg.widen_warps):
                stage = self.mma_tile(i)  # widened by the widen warps (attention_fp8)
            elif cutlass.const_expr(regs):
                pipe.consumer_wait(state)
                rK8, rV8 = self.load_regs(tSsK, tOsV, state.index)
                # Lane 0 releases the stage for the warp (its lanes' loads first): the producer refills it while
                # this warp computes on its registers.
                cute.arch.sync_warp()
                pipe.consumer_release(state)
                state.advance()
            else:
                pipe.consumer_wait(state)
                stage = state.index
                if cutlass.const_expr(fp8 is not None):  # the e4m3 tile widened, V past the end zeroed
                    stage = self.widen(fp8[0], fp8[1], sK, sV, state.index, i % 2, seqlen_k - t * self.tile_n,
                                       tidx)
                    # Every MMA warp is past widen's barrier and done with the ring stage: the producer refills
                    # it during this tile's MMAs (held to their end, a stage would sit out of flight).
                    pipe.consumer_release(state)
                    state.advance()
                elif cutlass.const_expr(self.cfg.varlen):
                    self.clear_v_tail(sV, stage, seqlen_k - t * self.tile_n, ks, lane)
            acc_S.fill(0.0)
            if cutlass.const_expr(regs):
                warp_mma(tiled_mma, acc_S, tSrQ, self.widened_k(rK8))
            else:
                warp_mma(tiled_mma, acc_S, tSrQ, tSrK, tSsK[None, None, None, stage], copy_K)
            if cutlass.const_expr(self.cfg.paged):
                if t >= t_mask or bad != 0:
                    col0 = t * self.tile_n + ks * self.warp_keys
                    for r in cutlass.range_constexpr(n_rows):
                        for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                            key = tScS[r, c][1]  # in this warp's slice
                            box = 0
                            if cutlass.const_expr(self.warp_keys > self.cfg.page_rows):
                                box = key // self.cfg.page_rows
                            hidden = col0 + key >= limit[r] or ((bad >> box) & 1) != 0
                            S[r, c] = -Float32.inf if hidden else S[r, c]
            else:
                if t >= t_mask:
                    col0 = t * self.tile_n + ks * self.warp_keys
                    for r in cutlass.range_constexpr(n_rows):
                        for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                            S[r, c] = -Float32.inf if col0 + tScS[r, c][1] >= limit[r] else S[r, c]
            # The online softmax, one max and one sum chain per row: attention_softmax.py says why it is
            # not that module's (the cubins).
            grew = cutlass.Boolean(False)
            for r in cutlass.range_constexpr(n_rows):
                mx = row_max[r]
                for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                    mx = cute.arch.fmax(mx, S[r, c])
                mx = quad_max(mx)
                # A row with no visible key yet keeps max -inf; exponentiate against 0 so P = 0, not NaN.
                mx_safe = 0.0 if mx == -Float32.inf else mx
                mx_scaled = mx_safe * scale_log2
                total = Float32(0.0)
                for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                    pv = cute.math.exp2(S[r, c] * scale_log2 - mx_scaled, fastmath=True)
                    S[r, c] = pv
                    total = total + pv
                rescale = cute.math.exp2((row_max[r] - mx_safe) * scale_log2, fastmath=True)
                grew = grew | (mx != row_max[r])
                row_max[r] = mx
                row_sum[r] = row_sum[r] * rescale + total
                rescales[r] = rescale
            # O's rescale only when a row of the warp has a new maximum (else every factor is 1): late tiles of a
            # long sequence seldom do, and it is a multiply per accumulator.
            if cute.arch.vote_any_sync(grew):
                for r in cutlass.range_constexpr(n_rows):
                    for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                        O[r, c] = O[r, c] * rescales[r]
            rP = cute.make_rmem_tensor_like(acc_S, self.mma_dtype)
            rP.store(acc_S.load().to(self.mma_dtype))
            if cutlass.const_expr(regs):
                self.zero_tail(rV8, tVcV, ks * self.warp_keys, seqlen_k - t * self.tile_n)
                warp_mma(tiled_mma, acc_O, acc_as_a(rP), self.widened_v(rV8))
            else:
                warp_mma(tiled_mma, acc_O, acc_as_a(rP), tOrV, tOsV[None, None, None, stage], copy_V)
            if cutlass.const_expr(fp8 is None):  # (an e4m3 tile's stage went back once widened or loaded)
                pipe.consumer_release(state)
                state.advance()
            elif cutlass.const_expr(self.cfg.widen_warps):
                self.mma_done(stage)

        for r in cutlass.range_constexpr(n_rows):
            row_sum[r] = quad_sum(row_sum[r])
        if cutlass.const_expr(fp8 is not None):  # the cache's V times v_descale
            for i in cutlass.range(cute.size(acc_O), unroll_full=True):
                acc_O[i] = acc_O[i] * fp8[2]
        if cutlass.const_expr(self.ks > 1):
            self.merge_key_slices(acc_O, row_max, row_sum, tScS, storage, scale_log2, tidx, rb, ks, thr_mma)
        if ks == 0:
            # Partial rows of split `split` of `group`: workspace row (split * num_groups + group) * tile_m + i.
            part_row = (split * num_groups + group) * self.tile_m - m_block * self.tile_m
            self.store_rows(acc_O, row_max, row_sum, thr_mma, o_cols, mO, mLSE, mOp, mLSEp, scale_log2, num_splits,
                            lane, head_kv, batch, ratio, rows, row0, part_row)
        if num_splits > 1:
            self.combine_splits(mO, mLSE, mOp, mLSEp, mCount, storage, num_splits, num_groups, group, tidx,
                                head_kv, batch, m_block, ratio, rows)
        # This CTA's work is done: the next kernel in the stream may launch and run its set-up.
        # (Triggered earlier, the next grid's CTAs shared SMs with this one's, two fitting per SM,
        # and long launches ran up to 13% slower on the H200.)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def q_element(self, mQ, coord, row0, ratio, rows, batch, head_kv):
        """The query element at `coord` (row, column) of a warp's 16 packed rows from `row0`: GQA-packed row p
        is query head p % ratio of sequence position p // ratio; zero past the last packed row."""
        p = row0 + coord[0]
        s = p // ratio
        val = mQ.element_type(0.0)
        if p < rows:
            val = mQ[batch, s, head_kv * ratio + (p - s * ratio), coord[1]]
        return val

    @cute.jit
    def load_q_scaled(self, tSrQ, tQcQ, mQ, row0, ratio, rows, batch, head_kv, scale_log2) -> Float32:
        """A bf16 query's 16 rows into the fp16 A fragment of a warp, times 2^-e, and scale_log2 times 2^e
        returned: e puts the rows' largest |q| in [2^14, 2^15), so every element keeps its bits (a bf16
        significand fits fp16's) unless it is 2^29 times smaller than that largest. Every warp of a row
        block reads the same rows, so its key slices share e; the scores, maxima and sums are of q * 2^-e
        and scale_log2 brings them back."""
        q = cute.make_rmem_tensor_like(tSrQ, self.dtype)  # held as bf16: half the registers of fp32
        amax = Float32(0.0)
        for i in cutlass.range_constexpr(cute.size(tSrQ)):
            q[i] = self.q_element(mQ, tQcQ[i], row0, ratio, rows, batch, head_kv)
            val = q[i].to(Float32)
            amax = cute.arch.fmax(amax, cute.arch.fmax(val, -val))
        for shift in cutlass.range_constexpr(5):  # the warp's lanes hold the 16 rows between them
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=16 >> shift))
        word = cute.make_rmem_tensor((1,), Float32)
        word[0] = amax
        # amax's exponent less 14, within what 2^-e and 2^e stay normal for (a zero query: e = 0)
        e = cutlass.min(cutlass.max(((cute.recast_tensor(word, Int32)[0] >> 23) & 0xFF) - 127 - 14, -64), 113)
        if amax == Float32(0.0):
            e = Int32(0)
        e = cute.arch.make_warp_uniform(e)  # the same in every lane: a uniform register, not one of each thread's
        bits = cute.make_rmem_tensor((2,), Int32)
        bits[0] = (127 - e) << 23
        bits[1] = (127 + e) << 23
        powers = cute.recast_tensor(bits, Float32)
        scaled = cute.make_rmem_tensor_like(tSrQ, Float32)
        for i in cutlass.range_constexpr(cute.size(tSrQ)):
            scaled[i] = q[i].to(Float32) * powers[0]
        # A pair per conversion, here: converted element by element, ptxas moved the conversions (a pack each)
        # into the mainloop, where every tile repeated them and the fp32 values held 64 registers.
        convert_pairs(scaled, tSrQ)
        return scale_log2 * powers[1]

    @cute.jit
    def bad_boxes(self, entries, first, seqlen_k, num_blocks) -> Int32:
        """Paged: bit j set when box j of this warp's keys (from key `first` on, page_rows keys per box,
        table entries `entries`) holds keys of the sequence and its entry is outside [0, num_blocks);
        the producer loaded page 0 there instead and its keys are masked."""
        bad = Int32(0)
        for j in cutlass.range_constexpr(cute.size(entries)):
            page = entries[j]
            if first + j * self.cfg.page_rows < seqlen_k and (page < 0 or page >= num_blocks):
                bad = bad | (1 << j)
        return bad

    @cute.jit
    def clear_v_tail(self, sV, stage, valid, ks, lane):
        """Varlen: in the sequence's last tile (valid < tile_n keys), zero the V rows of this warp's
        keys past its end. The cache may hold anything there (NaN included): P is 0 on those keys,
        but 0 * NaN is not. Each warp clears only the rows it reads itself, so a warp barrier orders it."""
        if valid < self.tile_n:
            vecs = self.d // 8  # 16-byte vectors per row
            sVw = cute.local_tile(sV[None, None, stage], (self.warp_keys, self.d), (ks, 0))
            zero = cute.make_rmem_tensor((1, 8), self.dtype)
            zero.fill(0.0)
            first = cutlass.max(valid - ks * self.warp_keys, 0)
            for it in cutlass.range(first * vecs + lane, self.warp_keys * vecs, 32, unroll=1):
                row = it // vecs
                cute.autovec_copy(zero, cute.local_tile(sVw, (1, 8), (row, it - row * vecs)))
            cute.arch.sync_warp()


class _KVCacheDecodeSm90(_DecodeAttentionSm90, Fp8KVTiles):
    """The split-KV kernel over a KV cache (configs with `varlen`): sequence b has
    seqlens[b] keys (read on the device, clamped to [0, capacity]), and its causal rows align
    bottom-right to that count. A CTA loads only the tiles holding its split's keys (none for a
    split past the sequence's end: it writes a neutral partial, lse -inf and O 0, that the combine
    weighs 0).

    Contiguous cache (page_rows 0): k/v [B, S_max, Hkv, d], one TMA box per tile, as the dense kernel.
    Paged (page_rows > 0): k/v [num_blocks, block_size, Hkv, d] (the TMA view (block_size, d, Hkv,
    num_blocks): a page is a coordinate, so any page stride TMA takes will do), key p of sequence b
    at row p % block_size of page table[b, p // block_size]. A tile is tile_n / page_rows boxes, each
    inside one page (block_size is a multiple of page_rows), their page ids read a tile ahead. A box
    past the sequence's keys, and one whose id is outside [0, num_blocks), is not loaded from its
    page: both load page 0 instead (memory of the cache, whatever the table holds) and their keys
    are masked.

    e4m3 caches (`kv_fp8`): the tiles are widened in registers or shared memory (attention_fp8), the scores scaled by
    k_descale, the output by v_descale (fp32 [Hkv]; one value for every head: a stride-0 view)."""

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
                 o_part: cute.Tensor, lse_part: cute.Tensor, counters: cute.Tensor, seqlens: cute.Tensor,
                 table: cute.Tensor, scale_log2: Float32, causal_offset: Int32, num_splits: Int32,
                 tiles_per_split: Int32, stream, k_descale=None, v_descale=None):
        # [B or pages, S, H, d] -> (S, d, H, B or pages) for TMA and local_tile.
        mK, mV = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in (k, v)]
        sKV_layout = ring_layout = self._smem_layout()  # the tiles the MMAs read, the ring TMA fills
        if cutlass.const_expr(self.cfg.kv_fp8):
            sKV_layout, ring_layout = self._fp8_layouts()  # (widen_regs: the ring alone)
        tile_layout = cute.select(ring_layout, mode=[0, 1])
        box = (self.tile_n, self.d)
        box_layout = tile_layout
        if cutlass.const_expr(self.cfg.paged):
            # One box: page_rows rows of the tile, as they lie in its shared-memory layout (with d = 128
            # not contiguous: TMA writes each 64-column half of the box where the tile keeps it).
            box = (self.cfg.page_rows, self.d)
            box_layout = cute.composition(tile_layout, cute.make_layout(box, stride=(1, self.tile_n)))
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(tma_load, mK, box_layout, box)
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(tma_load, mV, box_layout, box)
        self.tile_bytes = cute.size_in_bytes(k.element_type, tile_layout)  # every box of a stage: one tx count
        tiled_mma = self._tiled_mma()

        if cutlass.const_expr(self.cfg.kv_fp8):
            self._set_fp8_storage(sKV_layout, ring_layout)
        else:
            self._set_storage(sKV_layout)

        self.kernel(q, tma_atom_k, tma_k, tma_atom_v, tma_v, o, lse, o_part, lse_part, counters, seqlens, table,
                    scale_log2, causal_offset, num_splits, tiles_per_split, sKV_layout, tiled_mma, ring_layout,
                    k_descale, v_descale).launch(
            grid=self._grid(q, k, num_splits, q.shape[0]),
            block=[self.num_threads, 1, 1],
            stream=stream,
            use_pdl=self.cfg.pdl,
            **self._occupancy(),
        )

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, tma_atom_k: cute.CopyAtom, mK: cute.Tensor, tma_atom_v: cute.CopyAtom,
               mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor,
               mCount: cute.Tensor, mSeqlens: cute.Tensor, mTable: cute.Tensor, scale_log2: Float32,
               causal_offset: Int32, num_splits: Int32, tiles_per_split: Int32, sKV_layout: cute.ComposedLayout,
               tiled_mma: cute.TiledMma, ring_layout: cute.ComposedLayout, mKDescale, mVDescale):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, head_kv, batch = cute.arch.block_idx()

        seqlen_q, heads_kv = mQ.shape[1], mK.shape[2]
        ratio = mQ.shape[2] // heads_kv
        rows = seqlen_q * ratio
        m_blocks = (rows + self.tile_m - 1) // self.tile_m
        split = bidx // m_blocks
        m_block = bidx - split * m_blocks
        t_begin = split * tiles_per_split
        num_groups = mQ.shape[0] * heads_kv * m_blocks
        group = (batch * heads_kv + head_kv) * m_blocks + m_block
        block_size, num_blocks = mK.shape[0], mK.shape[3]  # paged; contiguous: S_max and B
        capacity = mTable.shape[1] * block_size if cutlass.const_expr(self.cfg.paged) else block_size

        if warp_idx == MMA_WARPS:
            for atom in (tma_atom_k, tma_atom_v):
                cpasync.prefetch_descriptor(atom)

        storage, pipe = self._storage_and_pipeline()
        cute.arch.griddepcontrol_wait()
        # After the wait: the previous kernel in the stream may have written the lengths.
        seqlen_k = cutlass.max(cutlass.min(mSeqlens[batch], capacity), 0)
        n_tiles = (seqlen_k + self.tile_n - 1) // self.tile_n
        n_local = cutlass.max(cutlass.min(tiles_per_split, n_tiles - t_begin), 0)  # 0: a split past the end
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        # e4m3: TMA fills the ring, sK and sV hold the widened tiles (widen_regs: none, sK and sV are the ring)
        sK_ring, sV_ring, fp8 = sK, sV, None
        if cutlass.const_expr(self.cfg.kv_fp8):
            if cutlass.const_expr(not self.cfg.widen_regs):
                sK_ring = storage.sK8.get_tensor(ring_layout.outer, swizzle=ring_layout.inner)
                sV_ring = storage.sV8.get_tensor(ring_layout.outer, swizzle=ring_layout.inner)
            fp8 = (sK_ring, sV_ring, mVDescale[head_kv])
            scale_log2 = scale_log2 * mKDescale[head_kv]  # the scores of the cache's K times k_descale

        load_args = (tma_atom_k, mK, tma_atom_v, mV, sK_ring, sV_ring, pipe, mTable, head_kv, batch, seqlen_k,
                     t_begin, n_local, block_size, num_blocks)
        mma_args = (mQ, mO, mLSE, mOp, mLSEp, mCount, sK, sV, storage, pipe, tiled_mma, scale_log2,
                    seqlen_k + causal_offset, num_splits, num_groups, group, tidx, warp_idx, head_kv, batch, split,
                    m_block, ratio, rows, seqlen_k, t_begin, n_local, mTable, block_size, num_blocks, fp8)
        if cutlass.const_expr(self.cfg.widen_warps):
            if warp_idx == MMA_WARPS:
                self.load(*load_args)
            elif warp_idx > MMA_WARPS:
                self.widen_tiles(sK_ring, sV_ring, sK, sV, pipe, seqlen_k, t_begin, n_local,
                                 tidx - 32 * (MMA_WARPS + 1))
            else:
                self.mma(*mma_args)
        elif warp_idx == MMA_WARPS:
            self.load(*load_args)
        else:
            self.mma(*mma_args)

    @cute.jit
    def load(self, tma_atom_k, mK, tma_atom_v, mV, sK, sV, pipe, mTable, head_kv, batch, seqlen_k, t_begin,
             n_local, block_size, num_blocks):
        """The producer warp: tiles t_begin .. t_begin + n_local - 1 into the ring, one stage each."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        if cutlass.const_expr(not self.cfg.paged):
            gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.d), (None, 0))
            gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.d), (None, 0))
            tKsK, tKgK = tma_tiles(tma_atom_k, sK, gK)
            tVsV, tVgV = tma_tiles(tma_atom_v, sV, gV)
            for i in cutlass.range(n_local, unroll=1):
                pipe.producer_acquire(state)
                bar = pipe.producer_get_barrier(state)
                cute.copy(tma_atom_k, tKgK[None, t_begin + i], tKsK[None, state.index], tma_bar_ptr=bar)
                cute.copy(tma_atom_v, tVgV[None, t_begin + i], tVsV[None, state.index], tma_bar_ptr=bar)
                state.advance()
        else:
            rows = self.cfg.page_rows
            box = (rows, self.d)
            boxes = self.tile_n // rows
            # The ring as boxes: (rows, d, box of the tile, 1, stage).
            sKb, sVb = cute.flat_divide(sK, box), cute.flat_divide(sV, box)
            # The table entries of the next tile, read one tile ahead: their latency hides behind the
            # wait for a free stage instead of delaying each box's load.
            entries = cute.make_rmem_tensor(boxes, Int32)
            self.read_entries(entries, mTable, batch, t_begin * self.tile_n, block_size)
            for i in cutlass.range(n_local, unroll=1):
                t = t_begin + i
                pages, ats = [], []
                for j in cutlass.range_constexpr(boxes):
                    p = t * self.tile_n + j * rows  # the box's first key
                    found = entries[j]
                    ok = p < seqlen_k and found >= 0 and found < num_blocks
                    pages.append(found if ok else 0)
                    ats.append((p % block_size) // rows if ok else 0)  # the box's index in its page
                self.read_entries(entries, mTable, batch, (t + 1) * self.tile_n, block_size)
                pipe.producer_acquire(state)
                bar = pipe.producer_get_barrier(state)
                for j in cutlass.range_constexpr(boxes):
                    gK = cute.local_tile(mK[None, None, head_kv, pages[j]], box, (None, 0))
                    gV = cute.local_tile(mV[None, None, head_kv, pages[j]], box, (None, 0))
                    tKsK, tKgK = tma_tiles(tma_atom_k, sKb, gK)
                    tVsV, tVgV = tma_tiles(tma_atom_v, sVb, gV)
                    cute.copy(tma_atom_k, tKgK[None, ats[j]], tKsK[None, j, 0, state.index], tma_bar_ptr=bar)
                    cute.copy(tma_atom_v, tVgV[None, ats[j]], tVsV[None, j, 0, state.index], tma_bar_ptr=bar)
                state.advance()

    @cute.jit
    def read_entries(self, entries, mTable, batch, first, block_size):
        """Paged: entries[j] = the block-table entry of the page holding key first + j * page_rows of
        sequence `batch`, the column clamped to the table (keys past the sequence read a real entry,
        which the caller ignores)."""
        last = mTable.shape[1] - 1
        for j in cutlass.range_constexpr(cute.size(entries)):
            entries[j] = mTable[batch, cutlass.min((first + j * self.cfg.page_rows) // block_size, last)]


# ---------------------------------------------------------------------------------------------
# Host side.


def _fake_kvcache_args(cfg: DecodeConfig) -> tuple:
    """Compile-time stand-ins for (q, k_cache, v_cache, out, lse, seqlens, table): as the dense
    kernel's, but the caches' first dim is their own (pages, or B again); seqlens [B] and table
    [*, max_blocks] int32 with a unit last stride (table rows may be strided; a contiguous cache's
    launch passes any stand-in)."""
    b, s_q, h_q, n, s_k, h_k, t, m = (cute.sym_int() for _ in range(8))

    def bshd(*shape, dtype=CUTE_DTYPES[cfg.dtype]):  # 16-byte aligned strides
        strides = tuple(cute.sym_int(divisibility=128 // dtype.width) for _ in range(3))
        return make_fake_tensor(dtype, (*shape, cfg.head_dim), stride=(*strides, 1), assumed_align=16)

    lse = make_fake_compact_tensor(Float32, (b, h_q, s_q), stride_order=(2, 1, 0), assumed_align=16)
    seqlens = make_fake_tensor(Int32, (b,), stride=(1,), assumed_align=4)
    table = make_fake_tensor(Int32, (t, m), stride=(cute.sym_int(), 1), assumed_align=4)
    cache = cutlass.Float8E4M3FN if cfg.kv_fp8 else CUTE_DTYPES[cfg.dtype]
    return (bshd(b, s_q, h_q), bshd(n, s_k, h_k, dtype=cache), bshd(n, s_k, h_k, dtype=cache), bshd(b, s_q, h_q), lse,
            seqlens, table)


def _build(cfg: DecodeConfig):
    o_part = make_fake_tensor(Float32, (cute.sym_int(),), stride=(1,), assumed_align=16)
    lse_part = make_fake_tensor(Float32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    counters = make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    if cfg.varlen:
        q, k, v, out, lse, seqlens, table = _fake_kvcache_args(cfg)
        descales = ()
        if cfg.kv_fp8:  # [Hkv] each (stride 0: one value for every head)
            descales = tuple(make_fake_tensor(Float32, (k.shape[2],), stride=(cute.sym_int(),), assumed_align=4)
                             for _ in range(2))
        args = (q, k, v, out, lse, o_part, lse_part, counters, seqlens, table, Float32(1.0), Int32(0), Int32(1),
                Int32(1), stream, *descales)
        return _KVCacheDecodeSm90(cfg), args
    args = (*fake_qkv_out_lse(cfg.dtype, cfg.head_dim), o_part, lse_part, counters,
            Float32(1.0), Int32(0), Int32(1), Int32(1), stream)
    return _DecodeAttentionSm90(cfg), args


@functools.lru_cache(maxsize=None)
def _variant(cfg: DecodeConfig) -> jit.Variant:
    return cfg.variant()


# What a KV-cache launch of a bf16 / fp16 cache passes for (k_descale, v_descale): nothing, compiled in as
# such. The compiled function takes every parameter of __call__, those left at their defaults included.
NOT_FP8 = (None, None)


def compile(config: DecodeConfig) -> jit.CompiledKernel:  # noqa: A001 - the contract's name
    """The loaded kernel of one config:
    fn(q, k, v, out, lse, o_part, lse_part, counters, scale_log2, causal_shift, num_splits, tiles_per_split);
    with `varlen` (the KV-cache kernel): fn(q, k_cache, v_cache, out, lse, o_part, lse_part, counters,
    seqlens, table, scale_log2, causal_offset, num_splits, tiles_per_split) (causal_offset: -S_q causal, else 0;
    table: the block table, paged, else any int32 [*, 1] stand-in, k_descale, v_descale) (the descales [Hkv]
    fp32 with `kv_fp8`, e4m3 caches; NOT_FP8 without)."""
    return jit.compile_variant(_variant(config), lambda: _build(config))


def precompile(configs=None, processes: int | None = None) -> list[jit.CompiledKernel]:
    """compile() of each config (default: variants_for()), the cold ones first compiled in parallel
    processes into the disk cache (jit.precompile)."""
    return jit.precompile(compile, variants_for() if configs is None else configs, processes)


def _inputs(cfg: DecodeConfig, shape: DecodeShape, seed: int, device: str = "cuda") -> tuple:
    """Random arguments of `compile(cfg).fn` at `shape`, its split count and workspace included;
    out and lse NaN."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt = checks.TORCH_DTYPE[cfg.dtype]
    d = cfg.head_dim

    def randn(*size):
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(dt)

    q = randn(shape.batch, shape.seqlen_q, shape.heads_q, d)
    k, v = randn(shape.batch, shape.seqlen_kv, shape.heads_kv, d), randn(shape.batch, shape.seqlen_kv, shape.heads_kv, d)
    splits, per, groups = split_plan(cfg, shape, modes.sm_count(q.device.index))
    out = torch.full_like(q, math.nan)
    lse = torch.full((shape.batch, shape.heads_q, shape.seqlen_q), math.nan, device=device)
    rows = splits * groups * cfg.tile_m
    o_part = torch.empty(max(rows * d, 4), device=device)
    lse_part = torch.empty(max(rows, 4), device=device)
    counters = torch.zeros(max(groups, 4), dtype=torch.int32, device=device)
    return (q, k, v, out, lse, o_part, lse_part, counters, (1.0 / math.sqrt(d)) * LOG2_E,
            causal_shift_for(bool(shape.causal), shape.seqlen_q, shape.seqlen_kv), splits, per)


def workload(config: DecodeConfig, shape: DecodeShape) -> Workload:
    """`config`'s kernel on inputs of `shape` (sip-tune, tests). A compiled kernel serves every
    size, so test_args draw 1-3 batches and 1-5000 keys (other split counts, ragged last tiles)."""
    if (config.head_dim, config.dtype) != (shape.head_dim, shape.dtype):
        raise ValueError(f"{config} does not serve {shape}")
    if config.varlen:
        raise ValueError(f"{config}: the KV-cache variants have no workload (their tests: "
                         "tests/kernels/test_attention_kvcache.py)")
    scale = 1.0 / math.sqrt(config.head_dim)

    def test_args(seed: int) -> tuple:
        # Each sample also draws its split count (the model's choice included): one compiled kernel
        # serves them all, and the split/combine path must be tested even where `config` runs one split.
        r = random.Random(seed)
        sample = dataclasses.replace(shape, batch=r.randint(1, 3), seqlen_kv=r.randint(1, 5000))
        return _inputs(dataclasses.replace(config, splits=r.choice((None, 1, 2, 3, 7, 16))), sample, seed)

    def verify(args: tuple) -> float:
        q, k, v, out, lse = args[:5]
        return check(out, lse, q, k, v, bool(shape.causal), scale, f"{config} on q{list(q.shape)} k{list(k.shape)}")

    return Workload(compile(config), lambda seed: _inputs(config, shape, seed), outputs=lambda args: args[3:5],
                    check=verify, test_args=test_args, name=OP)
