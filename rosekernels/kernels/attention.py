"""Fused attention forward for Hopper (FlashAttention-3 style), in CuTeDSL.

    out = softmax(q @ k^T * scale [+ causal mask]) @ v        per (batch, query head)

q [B, S_q, Hq, d], k/v [B, S_kv, Hkv, d] (Hq a multiple of Hkv: GQA/MQA), bf16 or fp16, d in {64, 128}.
Causal masking is aligned bottom-right (query i sees keys j <= i + S_kv - S_q); a query row that sees
no key gets out = 0 and lse = -inf. The LSE output is [B, Hq, S_q] fp32, natural log. Varlen configs
(rosekernels.attention_varlen) take packed sequences instead: q/k/v [1, total, H, d], each sequence's
rows from cumulative lengths read on the device, its tiles' loads offset to its first row and its O
rows stored one by one, from the slab or from registers (a TMA store of 64 rows would run into the
next sequence).

Work is cut into tiles of `tile_m` query rows of one head. Persistent launch (the default): one CTA
per SM takes tile after tile; the first is its block index, the next ones come from an atomic
counter (so uneven causal tiles balance dynamically), in an order that keeps the CTAs that read the
same K/V together (attention_tiles.py). `persistent=False` launches one CTA per tile in that order.

- warp 0 (the producer; its warpgroup drops to a few registers with setmaxnreg) loads each tile's
  Q once and K/V tiles of `tile_n` keys into a `num_stages`-deep ring of shared-memory buffers with
  TMA, each stage guarded by a full/empty mbarrier pair; the ring runs on across tiles, so the next
  tile's first K/V and its Q load while the consumers finish the current one. TMA zero-fills rows
  past S, so ragged edges need no special loads. It then claims the next tile and hands its index
  to the consumers through a 2-slot shared-memory mailbox.
- `tile_m / 64` consumer warpgroups each own 64 query rows: S = Q K^T with WGMMA from shared memory,
  online softmax in registers (row max/sum over the 4 threads of a quad with shuffles, exp2 with
  the scale folded into one FFMA), then O += P V with WGMMA taking P straight from registers.
- A warpgroup skips the math of the KV tiles none of its 64 rows sees and only keeps the pipelines and
  the issue token moving through them (`skip_tiles`), leaving the tensor cores to the others: all of
  them when its rows lie past S_q (the ragged last tile, `idle_mainloop`), and, causal, the last
  diagonal tiles of a 192-row tile, which only its later warpgroups see.
- KV tiles are visited from the last to the first, so the only tiles that need masking (the ragged
  last tile and, when causal, the diagonal ones) come first; tiles entirely above the causal
  diagonal are never loaded.
- `overlap=True` (the fast path): each warpgroup issues S_next = Q K_next^T and O += P V together
  and does the softmax of S_next while the P V product runs; a named-barrier token passed around
  the consumer warpgroups orders their GEMM issue so one warpgroup's softmax hides behind another's
  GEMMs (ping-pong). `overlap=False` is the plain in-order pipeline (kept as the reference path).
- Epilogue, per warpgroup: O / rowsum -> bf16/fp16 -> its own shared-memory slab (stmatrix) -> one
  TMA store of its 64 rows (clipped past S_q) that completes while the next tile runs; the LSE is
  stored straight from registers. `direct_o` configs store O from registers too (a column pair per
  store, rows past S_q skipped) and have no O buffer: its shared memory takes wider K/V tiles
  (d=128: 192 keys x 2 stages), which pay on long keys; on short ones the slab's TMA store, which
  overlaps the next tile, is faster.

Configs, the tile heuristic, the tuner's search space and the warm-up set: attention_plan.py
(re-exported here); the softmax: attention_softmax.py. This module holds the device code, `compile`,
`launch_args` and `workload`; the ops: rosekernels/ops/attention.py (attention(), which sends short
queries, S_q <= 16, to the split-KV kernel of attention_decode.py) and rosekernels/ops/varlen.py.
"""
from __future__ import annotations

import math
import random

import torch

from rosekernels import jit  # first: it pins CUTE_DSL_ARCH=sm_90a before cutlass loads
from rosekernels import checks, modes
from rosekernels.kernels.attention_common import (
    CUTE_DTYPES, LN_2, LOG2_E, acc_rows, check, convert_pairs, fake_qkv_out_lse, quad_sum, tma_tiles, wgmma)
from rosekernels.kernels.attention_plan import (  # noqa: F401 - the plan's names are this kernel's
    LONG_KV, OP, AttentionConfig, AttentionShape, candidates, config_for, default_config, grid_size, num_tiles,
    rank, variants_for, varlen_config, varlen_variants_for)
from rosekernels.kernels.attention_softmax import apply_mask, online_softmax, rescale
from rosekernels.kernels.attention_tiles import Tiles
from rosekernels.workload import Workload

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from cutlass.tensor_utils import LayoutEnum

Config, Shape = AttentionConfig, AttentionShape

# Named barriers (0 is __syncthreads), each + the consumer warpgroup index (at most 3 WGs):
_BAR_EPILOGUE = 1  # a warpgroup's epilogue (its O slab)
_BAR_SCHED = 4  # a warpgroup's GEMM-issue token (ping-pong)


# ---------------------------------------------------------------------------------------------
# Device code.


class _FlashAttentionSm90:
    def __init__(self, cfg: AttentionConfig):
        self.cfg = cfg
        self.dtype = CUTE_DTYPES[cfg.dtype]
        self.d = cfg.head_dim
        self.tile_m, self.tile_n, self.stages = cfg.tile_m, cfg.tile_n, cfg.num_stages
        self.causal = cfg.causal
        self.overlap = cfg.overlap
        self.num_mma_wg = cfg.num_mma_warpgroups
        self.num_mma_threads = 128 * self.num_mma_wg
        self.num_threads = self.num_mma_threads + 128
        # 64K registers per SM: the producer WG gives almost all of its share to the consumers.
        self.mma_regs, self.load_regs = {2: (240, 24), 3: (160, 32)}[self.num_mma_wg]

    def _smem_layout(self, rows: int, stages: int | None):
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, self.d), self.dtype)
        shape = (rows, self.d) if stages is None else (rows, self.d, stages)
        return cute.tile_to_shape(atom, shape, order=(0, 1) if stages is None else (0, 1, 2))

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
                 scale_log2: Float32, tile_counter: cute.Tensor, num_ctas: Int32, cu_seqlens_q, cu_seqlens_k,
                 max_seqlen_q, max_seqlen_k, stream):
        """Dense: cu_seqlens_* and max_seqlen_* are None. Varlen: q/k/v/out are the packed tokens
        [1, total, H, d], lse [1, Hq, total_q], cu_seqlens_* [B + 1] int32, max_seqlen_* Int32."""
        # [B, S, H, d] -> (S, d, H, B): the tile modes first, as TMA and local_tile want them.
        mQ, mK, mV, mO = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
                          for t in (q, k, v, o)]
        mLSE = cute.make_tensor(lse.iterator, cute.select(lse.layout, mode=[2, 1, 0]))  # (S_q, Hq, B)

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, self.tile_n))
        # P (registers) @ V: V is stored [keys, d], i.e. MN-major as the B operand (N = d, K = keys).
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, self.d),
            a_source=warpgroup.OperandSource.RMEM)
        # One warpgroup's share of P @ V: its thread layout places O in that warpgroup's slab.
        tiled_mma_o = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(64, self.d), a_source=warpgroup.OperandSource.RMEM)

        sQ_layout = self._smem_layout(self.tile_m, None)
        sK_layout = self._smem_layout(self.tile_n, self.stages)
        sV_layout = self._smem_layout(self.tile_n, self.stages)
        # One (64, d) O slab per consumer warpgroup, unless O goes from registers to global memory.
        sO_layout = None if cutlass.const_expr(self.cfg.direct_o) else self._smem_layout(64, self.num_mma_wg)

        tma_load, tma_store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(tma_load, mQ, sQ_layout, (self.tile_m, self.d))
        kv_tile_layout = cute.select(sK_layout, mode=[0, 1])
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(tma_load, mK, kv_tile_layout, (self.tile_n, self.d))
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(tma_load, mV, kv_tile_layout, (self.tile_n, self.d))
        tma_atom_o = tma_o = None
        if cutlass.const_expr(not self.cfg.direct_o):
            tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(tma_store, mO, cute.select(sO_layout, mode=[0, 1]),
                                                            (64, self.d))
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_layout)
        self.kv_bytes = cute.size_in_bytes(self.dtype, kv_tile_layout)
        self.shared_storage = self._shared_storage(sQ_layout, sK_layout, sV_layout, sO_layout)

        self.kernel(
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_o, tma_o, mLSE, tile_counter,
            scale_log2, sQ_layout, sK_layout, sV_layout, sO_layout, tiled_mma_qk, tiled_mma_pv, tiled_mma_o,
            mO if cutlass.const_expr(self.cfg.varlen or self.cfg.direct_o) else None, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k,
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    def _shared_storage(self, sQ_layout, sK_layout, sV_layout, sO_layout):
        """The block's shared memory: mbarriers, the tile mailbox, then Q, the K and V rings and,
        unless O is stored directly, the O slabs (each buffer 1 KiB-aligned for the 128-byte swizzle)."""
        def buffer(layout):
            return cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], 1024]
        fields = {
            "mbar_q": cute.struct.MemRange[cutlass.Int64, 2],
            "mbar_k": cute.struct.MemRange[cutlass.Int64, 2 * self.stages],
            "mbar_v": cute.struct.MemRange[cutlass.Int64, 2 * self.stages],
            "mbar_tile": cute.struct.MemRange[cutlass.Int64, 2 * 2],
            "next_tile": cute.struct.MemRange[Int32, 2],
            "sQ": buffer(sQ_layout), "sK": buffer(sK_layout), "sV": buffer(sV_layout),
        }
        if sO_layout is not None:
            fields["sO"] = buffer(sO_layout)
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom, mQ: cute.Tensor,
        tma_atom_k: cute.CopyAtom, mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom, mV: cute.Tensor,
        tma_atom_o: cute.CopyAtom, mO: cute.Tensor,
        mLSE: cute.Tensor,
        tile_counter: cute.Tensor,
        scale_log2: Float32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, tiled_mma_o: cute.TiledMma,
        mOmem, mCuQ, mCuK, max_seqlen_q, max_seqlen_k,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()

        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # PipelineTmaAsync releases from one lane per consumer warp.
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=self.q_bytes, defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.kv_bytes, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.kv_bytes, defer_sync=True)
        # The next tile's index: written by the producer warp (all lanes arrive), read by every consumer thread.
        pipe_tile = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_tile.data_ptr(), num_stages=2,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
            defer_sync=True)
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = None
        if cutlass.const_expr(not self.cfg.direct_o):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sNext = storage.next_tile.get_tensor(cute.make_layout(2))

        if cutlass.const_expr(self.cfg.varlen):
            tiles = Tiles.make(self.cfg, max_seqlen_q, max_seqlen_k, mQ.shape[2], mK.shape[2], mCuQ.shape[0] - 1)
        else:
            tiles = Tiles.make(self.cfg, mQ.shape[0], mK.shape[0], mQ.shape[2], mK.shape[2], mQ.shape[3])
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == 0:
                self.load(mQ, mK, mV, sQ, sK, sV, tma_atom_q, tma_atom_k, tma_atom_v,
                          pipe_q, pipe_k, pipe_v, pipe_tile, sNext, tile_counter, tiles, bidx, num_ctas, mCuQ, mCuK)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.mma(tidx - 128, mO, mLSE, sQ, sK, sV, sO, tma_atom_o, pipe_q, pipe_k, pipe_v, pipe_tile, sNext,
                     tiled_mma_qk, tiled_mma_pv, tiled_mma_o, scale_log2, tiles, bidx,
                     mQ.shape[0], mK.shape[0], mOmem, mCuQ, mCuK)

    @cute.jit
    def sequence(self, batch, seqlen_q, seqlen_k, mCuQ, mCuK):
        """(batch index of the views, first query row, S_q, first key row, S_kv) of a tile's sequence:
        varlen, its slice of the packed tokens (the views hold one batch; seqlen_q / seqlen_k are
        the token counts), each bound clamped into [0, tokens] so that no cumulative length,
        whatever it holds, makes a load or a store leave the tensors; else the whole dims."""
        if cutlass.const_expr(self.cfg.varlen):
            first_q = cutlass.min(cutlass.max(mCuQ[batch], 0), seqlen_q)
            end_q = cutlass.min(cutlass.max(mCuQ[batch + 1], first_q), seqlen_q)
            first_k = cutlass.min(cutlass.max(mCuK[batch], 0), seqlen_k)
            end_k = cutlass.min(cutlass.max(mCuK[batch + 1], first_k), seqlen_k)
            return 0, first_q, end_q - first_q, first_k, end_k - first_k
        return batch, 0, seqlen_q, 0, seqlen_k

    @cute.jit
    def n_blocks(self, m_block, seqlen_q, seqlen_k):
        """The number of KV tiles a query tile reads (0: causal, every row sees no key)."""
        n_block_max = (seqlen_k + self.tile_n - 1) // self.tile_n
        if cutlass.const_expr(self.cfg.varlen):
            # The grid has max_seqlen_q's m blocks per sequence: those past this one's queries idle.
            n_block_max = 0 if m_block * self.tile_m >= seqlen_q else n_block_max
        if cutlass.const_expr(self.causal):
            # Keys past the diagonal of the tile's last valid row are never needed.
            last_row = cutlass.min((m_block + 1) * self.tile_m, seqlen_q)
            limit = cutlass.max(last_row + seqlen_k - seqlen_q, 0)
            n_block_max = cutlass.min(n_block_max, (limit + self.tile_n - 1) // self.tile_n)
        return n_block_max

    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_atom_q, tma_atom_k, tma_atom_v,
             pipe_q, pipe_k, pipe_v, pipe_tile, sNext, tile_counter, tiles, bidx, num_ctas, mCuQ, mCuK):
        head_ratio = mQ.shape[2] // mK.shape[2]
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        tile_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        tile = bidx
        while tile < tiles.total:
            m_block, head, batch = tiles.coords(tile)
            view, first_q, seqlen_q, first_k, seqlen_k = self.sequence(batch, mQ.shape[0], mK.shape[0], mCuQ, mCuK)
            n_block_max = self.n_blocks(m_block, seqlen_q, seqlen_k)
            if n_block_max > 0:
                q_state, kv_state = self.load_tile(
                    mQ, mK, mV, sQ, sK, sV, tma_atom_q, tma_atom_k, tma_atom_v, pipe_q, pipe_k, pipe_v,
                    q_state, kv_state, m_block, head, head // head_ratio, view, n_block_max, first_q, first_k)
            # The next tile: past the first one per CTA, claimed from the counter. The claim that
            # draws the launch's last number (every CTA draws one past the end) zeroes the counter
            # for the next launch.
            nxt = tiles.total
            if num_ctas < tiles.total:
                drawn = Int32(0)
                if cute.arch.lane_idx() == 0:
                    drawn = cute.arch.atomic_add(tile_counter.iterator, Int32(1))
                    if drawn == tiles.total - 1:
                        tile_counter[0] = Int32(0)
                nxt = num_ctas + cute.arch.shuffle_sync(drawn, 0)
            pipe_tile.producer_acquire(tile_state)
            if cute.arch.lane_idx() == 0:
                sNext[tile_state.index] = nxt
            pipe_tile.producer_commit(tile_state)
            tile_state.advance()
            tile = nxt

    @cute.jit
    def load_tile(self, mQ, mK, mV, sQ, sK, sV, tma_atom_q, tma_atom_k, tma_atom_v, pipe_q, pipe_k, pipe_v,
                  q_state, state, m_block, head, head_kv, batch, n_block_max, first_q, first_k):
        """Issue one tile's loads; returns the advanced (Q, K/V) pipeline states. Varlen: the tiles
        start at the sequence's first query and key row (rows past its end are the next sequence's
        or zero-filled past the tokens: masked, or never stored)."""
        mQh, mKh, mVh = mQ[None, None, head, batch], mK[None, None, head_kv, batch], mV[None, None, head_kv, batch]
        if cutlass.const_expr(self.cfg.varlen):
            mQh = cute.domain_offset((first_q, 0), mQh)
            mKh, mVh = cute.domain_offset((first_k, 0), mKh), cute.domain_offset((first_k, 0), mVh)
        gQ = cute.local_tile(mQh, (self.tile_m, self.d), (m_block, 0))
        gK = cute.local_tile(mKh, (self.tile_n, self.d), (None, 0))
        gV = cute.local_tile(mVh, (self.tile_n, self.d), (None, 0))
        tQsQ, tQgQ = tma_tiles(tma_atom_q, sQ, gQ)
        tKsK, tKgK = tma_tiles(tma_atom_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_atom_v, sV, gV)

        # The first K before Q: its stage frees while the previous tile's last steps run, Q only
        # once all of its S GEMMs are done.
        n_last = n_block_max - 1
        pipe_k.producer_acquire(state)
        cute.copy(tma_atom_k, tKgK[None, n_last], tKsK[None, state.index],
                  tma_bar_ptr=pipe_k.producer_get_barrier(state))
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        q_state.advance()
        if cutlass.const_expr(not self.overlap):
            # Consumption order: K_j, V_j, K_{j-1}, V_{j-1}, ...
            pipe_v.producer_acquire(state)
            cute.copy(tma_atom_v, tVgV[None, n_last], tVsV[None, state.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(state))
            state.advance()
            for i in cutlass.range(n_last, unroll=1):
                n = n_last - 1 - i
                pipe_k.producer_acquire(state)
                cute.copy(tma_atom_k, tKgK[None, n], tKsK[None, state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(state))
                pipe_v.producer_acquire(state)
                cute.copy(tma_atom_v, tVgV[None, n], tVsV[None, state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(state))
                state.advance()
        else:
            # Consumption order: K_j, then (K_{j-1}, V_j), (K_{j-2}, V_{j-1}), ..., V_0.
            for i in cutlass.range(n_last, unroll=1):
                n = n_last - 1 - i
                prev = state.clone()
                state.advance()
                pipe_k.producer_acquire(state)
                cute.copy(tma_atom_k, tKgK[None, n], tKsK[None, state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(state))
                pipe_v.producer_acquire(prev)
                cute.copy(tma_atom_v, tVgV[None, n + 1], tVsV[None, prev.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(prev))
            pipe_v.producer_acquire(state)
            cute.copy(tma_atom_v, tVgV[None, 0], tVsV[None, state.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(state))
            state.advance()
        return q_state, state

    @cute.jit
    def mma(self, tidx, mO, mLSE, sQ, sK, sV, sO, tma_atom_o, pipe_q, pipe_k, pipe_v, pipe_tile, sNext,
            tiled_mma_qk, tiled_mma_pv, tiled_mma_o, scale_log2, tiles, bidx, dense_seqlen_q, dense_seqlen_k,
            mOmem, mCuQ, mCuK):
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_mma_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_mma_pv = tiled_mma_pv.get_slice(wg * 128)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)

        # V^T view (d, keys, stage) of the same buffer: the B operand of P @ V.
        sVt = cute.composition(
            sV, cute.make_ordered_layout((self.d, self.tile_n, self.stages), order=(1, 0, 2)))
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrV = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        acc_S = cute.make_rmem_tensor(wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((self.tile_m, self.d)), Float32)
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        # The accumulator of S and the A fragment of P @ V hold the same (row, col) at the same
        # position for 16-bit types (both compact), so P is S converted element by element.
        assert cute.size(tOrP) == cute.size(acc_S)

        # (row, col) of each accumulator element within the tile; the masks compare against them.
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS = acc_rows(thr_mma_qk.partition_C(cS))
        # Thread 0's coordinates are compile-time constants; a thread's are these plus tScS[0, 0].
        t0ScS = acc_rows(tiled_mma_qk.get_slice(0).partition_C(cS))
        rows = cute.size(tScS, mode=[0])
        row_max = cute.make_rmem_tensor(rows, Float32)
        row_sum = cute.make_rmem_tensor(rows, Float32)
        row_scale = cute.make_rmem_tensor(rows, Float32)

        if cutlass.const_expr(self.overlap):
            if wg == 0:  # the first consumer WG holds the GEMM-issue token initially
                cute.arch.barrier_arrive(barrier_id=_BAR_SCHED, number_of_threads=256)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        tile_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
        frags = (acc_S, acc_O, tOrP, tSrQ, tSrK, tOrV, tScS, t0ScS, row_max, row_sum, row_scale)
        tile = bidx
        while tile < tiles.total:
            m_block, head, batch = tiles.coords(tile)
            view, first_q, seqlen_q, first_k, seqlen_k = self.sequence(batch, dense_seqlen_q, dense_seqlen_k,
                                                                       mCuQ, mCuK)
            n_block_max = self.n_blocks(m_block, seqlen_q, seqlen_k)
            row_max.fill(-Float32.inf)
            row_sum.fill(0.0)
            acc_O.fill(0.0)
            if n_block_max > 0:
                n_block_wg = self.wg_n_blocks(m_block, wg, n_block_max, seqlen_q, seqlen_k)
                if n_block_wg > 0:
                    q_state, kv_state = self.mainloop(
                        q_state, kv_state, n_block_max, n_block_wg, m_block, *frags, tiled_mma_qk,
                        tiled_mma_pv, pipe_q, pipe_k, pipe_v, scale_log2, seqlen_q, seqlen_k, wg)
                else:
                    q_state, kv_state = self.idle_mainloop(q_state, kv_state, n_block_max, pipe_q, pipe_k,
                                                           pipe_v, wg)
            self.epilogue(acc_O, row_max, row_sum, scale_log2, mO, mLSE, sO, tma_atom_o, tiled_mma_o,
                          thr_mma_pv, tidx, wg, m_block, head, view, seqlen_q, mOmem, first_q)
            pipe_tile.consumer_wait(tile_state)
            tile = sNext[tile_state.index]
            pipe_tile.consumer_release(tile_state)
            tile_state.advance()
        if cutlass.const_expr(not self.cfg.direct_o):
            if tidx % 128 < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # the last O store has left shared memory

    @cute.jit
    def wg_n_blocks(self, m_block, wg, n_block_max, seqlen_q, seqlen_k):
        """KV tiles [0, n) hold every key a row of warpgroup `wg` sees. n < n_block_max when causal
        and its rows end above the tile's last diagonal tile (the first warpgroups of a 192-row tile
        see no key of the last 128-key tile); 0 when it has no row in S_q, or none that sees a key."""
        first_row = m_block * self.tile_m + wg * 64
        n = n_block_max if first_row < seqlen_q else 0
        if cutlass.const_expr(self.causal):
            last_row = cutlass.min(first_row + 63, seqlen_q - 1)
            keys = cutlass.max(last_row + seqlen_k - seqlen_q + 1, 0)
            n = cutlass.min(n, (keys + self.tile_n - 1) // self.tile_n)
        return n

    @cute.jit
    def mainloop(self, q_state, state, n_block_max, n_block_wg, m_block, acc_S, acc_O, tOrP, tSrQ, tSrK,
                 tOrV, tScS, t0ScS, row_max, row_sum, row_scale, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k,
                 pipe_v, scale_log2, seqlen_q, seqlen_k, wg):
        """The KV tiles [0, n_block_wg) of one query tile into acc_O / row_max / row_sum, the tile's
        later ones only passed through (`skip_tiles`); returns the advanced (Q, K/V) pipeline states."""
        # Keys of KV tile n a row r may see: [0, seqlen_k) and, causal, [0, r + seqlen_k - seqlen_q].
        causal_offset = seqlen_k - seqlen_q
        # Tiles n >= n_block_mask hold a key past the diagonal of this warpgroup's first row.
        n_block_mask = cutlass.max(m_block * self.tile_m + wg * 64 + causal_offset + 1, 0) // self.tile_n
        args = (acc_S, acc_O, tOrP, tSrQ, tSrK, tOrV, tScS, t0ScS, row_max, row_sum,
                row_scale, tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, scale_log2, m_block, seqlen_k,
                causal_offset, wg)

        pipe_q.consumer_wait(q_state)
        n_last = n_block_max - 1
        n_first = n_block_wg - 1  # the first tile this warpgroup computes
        if n_first < n_last:
            state = self.skip_tiles(state, n_last - n_first, pipe_k, pipe_v, wg)
            state = self.step(state, n_first, *args, masked=True, first=True)
        else:
            # The last tile: ragged (seqlen) and, causal, diagonal masking. Issued without the token:
            # each warpgroup's first S GEMM goes as soon as its Q and K are in.
            pipe_k.consumer_wait(state)
            wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
            warpgroup.wait_group(0)
            pipe_k.consumer_release(state)
            apply_mask(acc_S, tScS, t0ScS, n_last, m_block, seqlen_k, causal_offset, self.tile_m, self.tile_n,
                       causal=self.causal)
            online_softmax(acc_S, row_max, row_sum, row_scale, scale_log2, first=True)
            convert_pairs(acc_S, tOrP)
            if cutlass.const_expr(not self.overlap):
                state = self.pv_in_order(state, acc_O, tOrP, tOrV, tiled_mma_pv, pipe_v)

        n_masked_end = n_first
        if cutlass.const_expr(self.causal):
            # The rest of the diagonal tiles.
            n_masked_end = cutlass.max(cutlass.min(n_block_mask, n_first), 0)
            for i in cutlass.range(n_first - n_masked_end, unroll=1):
                state = self.step(state, n_first - 1 - i, *args, masked=True)
        for i in cutlass.range(n_masked_end, unroll=1):
            state = self.step(state, n_masked_end - 1 - i, *args, masked=False)
        # Every S GEMM of the tile is done: the producer may load the next tile's Q.
        pipe_q.consumer_release(q_state)
        q_state.advance()

        if cutlass.const_expr(self.overlap):
            pipe_v.consumer_wait(state)
            wgmma(tiled_mma_pv, acc_O, tOrP, tOrV[None, None, None, state.index], zero_init=False)
            warpgroup.wait_group(0)
            pipe_v.consumer_release(state)
            state.advance()
        return q_state, state

    @cute.jit
    def skip_tiles(self, state, count, pipe_k, pipe_v, wg):
        """Pass through the last `count` KV tiles of a query tile without math: the pipeline waits and
        releases and the GEMM-issue token of as many `step`s (the first K, like mainloop's, without
        the token). Waiting on each stage keeps the releases in the phase the other warpgroups
        release; the next tile's V (overlapped) stays for the caller."""
        pipe_k.consumer_wait(state)
        pipe_k.consumer_release(state)
        if cutlass.const_expr(not self.overlap):
            pipe_v.consumer_wait(state)
            pipe_v.consumer_release(state)
            state.advance()
        for _ in cutlass.range(count - 1, unroll=1):
            state_v = state.clone()
            if cutlass.const_expr(self.overlap):
                state.advance()
            pipe_k.consumer_wait(state)
            if cutlass.const_expr(self.overlap):
                self.take_token(wg)
                pipe_v.consumer_wait(state_v)
                self.pass_token(wg)
                pipe_k.consumer_release(state)
                pipe_v.consumer_release(state_v)
            else:
                pipe_k.consumer_release(state)
                pipe_v.consumer_wait(state)
                pipe_v.consumer_release(state)
                state.advance()
        return state

    @cute.jit
    def idle_mainloop(self, q_state, state, n_block_max, pipe_q, pipe_k, pipe_v, wg):
        """`mainloop` for a warpgroup that computes none of the tile's KV tiles (its 64 rows all lie
        past S_q, as in the last 192-row tile of S_q = 1024, or see no key): the others get the
        tensor cores."""
        pipe_q.consumer_wait(q_state)
        state = self.skip_tiles(state, n_block_max, pipe_k, pipe_v, wg)
        pipe_q.consumer_release(q_state)
        q_state.advance()
        if cutlass.const_expr(self.overlap):
            pipe_v.consumer_wait(state)
            pipe_v.consumer_release(state)
            state.advance()
        return q_state, state

    @cute.jit
    def step(self, state, n_block, acc_S, acc_O, tOrP, tSrQ, tSrK, tOrV, tScS, t0ScS,
             row_max, row_sum, row_scale, tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, scale_log2,
             m_block, seqlen_k, causal_offset, wg, masked: cutlass.Constexpr[bool],
             first: cutlass.Constexpr[bool] = False):
        """One KV tile n_block; returns the advanced pipeline state.

        In order: S = Q K_n^T, softmax, O = O * scale + P_n V_n.
        Overlapped: S = Q K_n^T and O += P_{n+1} V_{n+1} are issued together and the softmax of S
        runs while P V is in flight; P_n V_n is issued by the next step (or after the loop).
        `first`: the warpgroup's first computed tile after skipped ones, which hold no P to multiply."""
        state_v = state.clone()  # in-order: the same tile; overlapped: the tile whose P is in registers
        if cutlass.const_expr(self.overlap):
            state.advance()
        pipe_k.consumer_wait(state)
        if cutlass.const_expr(self.overlap):
            self.take_token(wg)
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
        if cutlass.const_expr(self.overlap):
            pipe_v.consumer_wait(state_v)
            if cutlass.const_expr(not first):
                wgmma(tiled_mma_pv, acc_O, tOrP, tOrV[None, None, None, state_v.index], zero_init=False)
            self.pass_token(wg)
            warpgroup.wait_group(0 if first else 1)  # S is ready; P V may still run
        else:
            warpgroup.wait_group(0)
        pipe_k.consumer_release(state)
        if cutlass.const_expr(masked):
            apply_mask(acc_S, tScS, t0ScS, n_block, m_block, seqlen_k, causal_offset, self.tile_m, self.tile_n,
                       causal=True)
        online_softmax(acc_S, row_max, row_sum, row_scale, scale_log2, first=first)
        if cutlass.const_expr(self.overlap):
            warpgroup.wait_group(0)
            pipe_v.consumer_release(state_v)
        convert_pairs(acc_S, tOrP)
        if cutlass.const_expr(not first):
            rescale(acc_O, row_scale)
        if cutlass.const_expr(not self.overlap):
            state = self.pv_in_order(state, acc_O, tOrP, tOrV, tiled_mma_pv, pipe_v)
        return state

    @cute.jit
    def take_token(self, wg):
        """Wait for the GEMM-issue token: the consumer warpgroups issue their GEMMs in turn."""
        cute.arch.barrier(barrier_id=_BAR_SCHED + wg, number_of_threads=256)

    @cute.jit
    def pass_token(self, wg):
        """Hand the GEMM-issue token to the next consumer warpgroup."""
        nxt = wg + 1 if wg + 1 < self.num_mma_wg else 0
        cute.arch.barrier_arrive(barrier_id=_BAR_SCHED + nxt, number_of_threads=256)

    @cute.jit
    def pv_in_order(self, state, acc_O, tOrP, tOrV, tiled_mma_pv, pipe_v):
        """The in-order pipeline's O += P V on the tile at `state`; returns the next stage."""
        pipe_v.consumer_wait(state)
        wgmma(tiled_mma_pv, acc_O, tOrP, tOrV[None, None, None, state.index], zero_init=False)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(state)
        state.advance()
        return state

    @cute.jit
    def epilogue(self, acc_O, row_max, row_sum, scale_log2, mO, mLSE, sO, tma_atom_o, tiled_mma_o,
                 thr_mma_pv, tidx, wg, m_block, head, batch, seqlen_q, mOmem, first_q):
        """O / rowsum and the LSE of the rows < seqlen_q. Direct O: from registers to out (`store_direct`).
        Else dense: O through this warpgroup's slab and a TMA store (clipped at S_q); varlen: the slab's
        rows < seqlen_q copied out in 16-byte vectors (a TMA store of 64 rows would overwrite the next
        sequence's)."""
        O = acc_rows(acc_O)
        tOcO = acc_rows(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.d))))
        lse = cute.make_rmem_tensor(cute.size(O, mode=[0]), Float32)
        for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
            total = quad_sum(row_sum[r])
            # total == 0: the row saw no key (causal, S_q > S_kv); O is 0 there, lse -inf.
            empty = total == 0.0
            inv = cute.arch.rcp_approx(1.0 if empty else total)
            lse[r] = -Float32.inf if empty else (
                row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
            for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                O[r, c] = O[r, c] * inv

        # LSE: the thread holding column 0 of a row writes it.
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
                row = m_block * self.tile_m + tOcO[r, 0][0]
                if row < seqlen_q:
                    if cutlass.const_expr(self.cfg.varlen):
                        mLSE[first_q + row, head, batch] = lse[r]
                    else:
                        mLSE[row, head, batch] = lse[r]

        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        convert_pairs(acc_O, rO)
        if cutlass.const_expr(self.cfg.direct_o):
            self.store_direct(rO, tiled_mma_o, mOmem, tidx % 128, head, batch, first_q,
                              m_block * self.num_mma_wg + wg, seqlen_q)
        else:
            # O -> this warpgroup's shared-memory slab (stmatrix) -> one TMA store of its 64 rows, left
            # in flight: the slab is only rewritten by the next tile's epilogue, after waiting for it.
            sO_wg = sO[None, None, wg]
            store_warp = tidx % 128 < 32
            if cutlass.const_expr(not self.cfg.varlen):
                if store_warp:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=_BAR_EPILOGUE + wg, number_of_threads=128)
            smem_copy = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                            self.dtype)
            thr_copy = cute.make_tiled_copy_C(smem_copy, tiled_mma_o).get_slice(tidx % 128)
            cute.copy(smem_copy, thr_copy.retile(rO), thr_copy.partition_D(sO_wg))
            row_block = m_block * self.num_mma_wg + wg
            if cutlass.const_expr(self.cfg.varlen):
                cute.arch.barrier(barrier_id=_BAR_EPILOGUE + wg, number_of_threads=128)
                self.store_rows(sO_wg, mOmem, tidx % 128, head, first_q, row_block, seqlen_q)
            else:
                cute.arch.fence_view_async_shared()  # make the stores visible to the TMA (async proxy)
                cute.arch.barrier(barrier_id=_BAR_EPILOGUE + wg, number_of_threads=128)
                if store_warp and row_block * 64 < seqlen_q:
                    gO = cute.local_tile(mO[None, None, head, batch], (64, self.d), (row_block, 0))
                    tOsO, tOgO = tma_tiles(tma_atom_o, sO_wg, gO)
                    cute.copy(tma_atom_o, tOsO, tOgO)
                    cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def store_direct(self, rO, tiled_mma_o, mO, t, head, batch, first_q, row_block, seqlen_q):
        """Direct O: this thread's elements of the warpgroup's 64 rows from registers to out, a column
        pair (4 bytes) per store, rows row_block * 64 + i < seqlen_q only (varlen: from the sequence's
        first row). A warp's stores write whole 16-byte row segments, merged in L2."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32)
        thr = cute.make_tiled_copy_C(atom, tiled_mma_o).get_slice(t)
        mOh = mO[None, None, head, batch]
        if cutlass.const_expr(self.cfg.varlen):
            mOh = cute.domain_offset((first_q, 0), mOh)
        gO = cute.local_tile(mOh, (64, self.d), (row_block, 0))
        parts = (thr.retile(rO), thr.partition_D(gO), thr.partition_D(cute.make_identity_tensor((64, self.d))))
        # The copy's tile is the warpgroup's (64, d): a thread's values all sit in mode 0, which is
        # cut into its column pairs (the thread's two rows alternate among them).
        assert all(cute.size(part, mode=[1]) * cute.size(part, mode=[2]) == 1 for part in parts)
        tS, tD, tC = (cute.logical_divide(part[None, 0, 0], cute.make_layout(2)) for part in parts)
        for k in cutlass.range_constexpr(cute.size(tD, mode=[1])):
            if row_block * 64 + tC[0, k][0] < seqlen_q:
                cute.copy(atom, tS[None, k], tD[None, k])

    @cute.jit
    def store_rows(self, sO_wg, mOmem, t, head, first_q, row_block, seqlen_q):
        """Varlen: rows row_block * 64 + i < seqlen_q of a warpgroup's (64, d) slab to out, 16 bytes
        per thread and copy, d / 8 threads per row."""
        per_row = self.d // 8
        copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
            cute.make_ordered_layout((128 // per_row, per_row), order=(1, 0)), cute.make_layout((1, 8)))
        thr = copy.get_slice(t)
        gO = cute.local_tile(cute.domain_offset((first_q, 0), mOmem[None, None, head, 0]), (64, self.d),
                             (row_block, 0))
        tS = thr.partition_S(sO_wg)
        tD = thr.partition_D(gO)
        tC = thr.partition_D(cute.make_identity_tensor((64, self.d)))
        for i in cutlass.range_constexpr(cute.size(tS, mode=[1])):
            if row_block * 64 + tC[0, i, 0][0] < seqlen_q:
                cute.copy(copy, tS[None, i, None], tD[None, i, None])


# ---------------------------------------------------------------------------------------------
# Host side.


# What a dense launch passes for the varlen arguments (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
# max_seqlen_k): nothing, compiled in as such.
NOT_VARLEN = (None, None, None, None)


def _build(cfg: AttentionConfig):
    counter = make_fake_compact_tensor(Int32, (1,), stride_order=(0,), assumed_align=4)
    varlen = NOT_VARLEN
    if cfg.varlen:
        cu_q, cu_k = (make_fake_compact_tensor(Int32, (cute.sym_int(),), stride_order=(0,), assumed_align=4)
                      for _ in range(2))
        varlen = (cu_q, cu_k, Int32(1), Int32(1))
    args = (*fake_qkv_out_lse(cfg.dtype, cfg.head_dim), Float32(1.0), counter, Int32(1), *varlen,
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return _FlashAttentionSm90(cfg), args


def compile(config: AttentionConfig) -> jit.CompiledKernel:  # noqa: A001 - the contract's name
    """The loaded kernel of one config: fn(q, k, v, out, lse, scale_log2, *launch_args(...), *NOT_VARLEN)
    (varlen: the cumulative lengths and maxima instead: `VarlenLaunch`)."""
    return jit.compile_variant(config.variant(), lambda: _build(config))


def precompile(configs=None, processes: int | None = None) -> list[jit.CompiledKernel]:
    """compile() of each config (default: variants_for()), the cold ones first compiled in parallel
    processes into the disk cache (jit.precompile)."""
    return jit.precompile(compile, variants_for() if configs is None else configs, processes)


def launch_args(cfg: AttentionConfig, q: torch.Tensor, num_ctas: int | None = None) -> tuple[torch.Tensor, int]:
    """(tile counter, grid size) for one launch on q [B, S_q, Hq, d].

    Grid: `grid_size` (min(tiles, SMs) persistent CTAs, or one per tile); `num_ctas` overrides it
    (tests). CTAs past their first tile claim the next from the counter, which must be zero at
    launch: a fresh one here (the kernel re-zeroes it when done, so a counter may be reused by calls
    on one stream)."""
    tiles = num_tiles(cfg, q.shape[0], q.shape[1], q.shape[2])
    if num_ctas is None:
        num_ctas = grid_size(cfg, q.shape[0], q.shape[1], q.shape[2], modes.sm_count(q.device.index))
    if not 0 < num_ctas < 2**31:
        raise ValueError(f"num_ctas must be in [1, 2^31), got {num_ctas}")
    alloc = torch.zeros if num_ctas < tiles else torch.empty  # no claims: the counter is never read
    return alloc(1, device=q.device, dtype=torch.int32), num_ctas


def _inputs(cfg: AttentionConfig, batch: int, seqlen: int, heads_q: int, heads_kv: int, seed: int,
            device: str = "cuda") -> tuple:
    """Random arguments of `compile(cfg).fn`, q, k and v [batch, seqlen, heads, d]; out and lse NaN."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt = checks.TORCH_DTYPE[cfg.dtype]
    d = cfg.head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dt)

    q, k, v = randn(batch, seqlen, heads_q, d), randn(batch, seqlen, heads_kv, d), randn(batch, seqlen, heads_kv, d)
    out = torch.full_like(q, math.nan)
    lse = torch.full((batch, heads_q, seqlen), math.nan, device=device)
    return (q, k, v, out, lse, (1.0 / math.sqrt(d)) * LOG2_E, *launch_args(cfg, q), *NOT_VARLEN)


def workload(config: AttentionConfig, shape: AttentionShape) -> Workload:
    """`config`'s kernel on inputs of `shape` (sip-tune, tests). A compiled kernel serves every
    size, so test_args draw 1-2 batches and 1 to 3 tiles + 7 query rows (ragged last tiles)."""
    if (config.head_dim, config.dtype, config.causal) != (shape.head_dim, shape.dtype, bool(shape.causal)):
        raise ValueError(f"{config} does not serve {shape}")
    if config.varlen:
        raise ValueError(f"{config}: varlen configs take packed sequences, not an {OP} shape (no workload)")
    scale = 1.0 / math.sqrt(config.head_dim)

    def test_args(seed: int) -> tuple:
        r = random.Random(seed)
        return _inputs(config, r.randint(1, 2), r.randint(1, 3 * config.tile_m + 7), shape.heads_q, shape.heads_kv,
                       seed)

    def verify(args: tuple) -> float:
        q, k, v, out, lse = args[:5]
        return check(out, lse, q, k, v, config.causal, scale, f"{config} on q{list(q.shape)} k{list(k.shape)}")

    return Workload(compile(config),
                    lambda seed: _inputs(config, shape.batch, shape.seqlen, shape.heads_q, shape.heads_kv, seed),
                    outputs=lambda args: args[3:5], check=verify, test_args=test_args, name=OP)
