"""GEMM with a fused epilogue for Hopper (sm_90a): out = act(a @ b^T + bias), act one of none, relu,
leaky_relu, silu, gelu_tanh; gated (SwiGLU): out = act(a @ b_gate^T) * (a @ b_up^T) in one kernel.

One persistent, warp-specialized kernel serves every specialization:

- a producer warp streams A/B k-tiles with TMA into a `stages`-deep shared-memory ring guarded by
  mbarriers (PipelineTmaAsync); on a cluster (prefill: 2 CTAs; decode: up to 4 x 2) a tile that
  several CTAs of a cluster row or column share is multicast to them, each loading a slice of it;
- consumer warpgroups run WGMMA (bf16/fp16 in, fp32 accumulate; e4m3: fp8_tiles). "Cooperative" tiles
  split one tile across 2 warpgroups (64 rows each); "pingpong" tiles give each warpgroup a whole tile
  and alternate mainloops (an ordering barrier), so one warpgroup's epilogue hides under the other's MMAs;
- the epilogue adds the bias (staged once per tile in shared memory), applies the activation (the
  LeakyReLU slope constant-folded; gated: act(gate) * up of column pairs that one thread holds, see
  GATE_BLOCK), converts to the input dtype and stores through shared memory with TMA (which clips
  ragged M/N edges; ragged K is zero-filled by the TMA loads);
- decode variants may swap the operands (`swap_ab`): the weights fill the MMA's M side and the few
  tokens its N side (8-128), the kernel computes out^T and stores it from registers;
- decode variants for M <= 32 load only the first `a_rows` rows of each A k-tile (a smaller TMA box
  instead of a mostly zero-filled 64-row one) and pack the A stages `a_rows` rows apart, which
  leaves room for more stages of weights in flight (gemm_splitk.a_smem_layouts);
- a static persistent scheduler walks the output tiles in bands of `raster_group` cluster rows
  (L2 reuse of both operands); decode shapes (M <= 128) may split K to fill the SMs: each split
  stores the fp32 partials of the tile's rows < M (16-byte vectors), and the last split to finish
  (a per-tile counter that it resets) sums them in split order (deterministic) and runs the
  epilogue (gemm_splitk.py). The K split count and raster group are launch arguments, not compiled in;
- launches use programmatic dependent launch: a CTA sets up its barriers before
  `griddepcontrol.wait` (the previous kernel in the stream may still run), and once its last
  mainloop is done lets the next kernel launch while it reduces and stores.

Configs, shapes and the cost models that choose a tile and split count: `gemm_leakyrelu_plan`; the ops (`gemm`,
`gemm_leakyrelu`, `gate_up_rows`, `run` of a given config): rosekernels/ops/gemm.py. Contract: rosekernels.contract.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import random
from typing import Optional

from rosekernels import jit  # first: it pins CUTE_DSL_ARCH=sm_90a before cutlass is imported

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
from cutlass.tensor_utils import LayoutEnum

from rosekernels import checks, modes
from rosekernels.kernels import gemm_splitk as splitk
from rosekernels.kernels.fp8_tiles import Fp8Tiles
from rosekernels.kernels.gemm_leakyrelu_plan import (  # noqa: F401  (candidates, variants_for: the contract)
    COUNTER_SLOTS, GATE_BLOCK, MAX_SPLITS, OP, SMEM_CAPACITY, TILE_K, GemmConfig, GemmShape, candidates, check_fits,
    config_for, epi_tile, m_range, mma_warpgroups, out_n, partial_floats, rank, smem_stages, tile_slots, variants_for,
    wg_per_tile)
from rosekernels.kernels.grouped_gemm_plan import GROUP_TABLE_INTS
from rosekernels.kernels.grouped_tiles import GroupedTiles
from rosekernels.workload import Workload

Config, Shape = GemmConfig, GemmShape

_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}

# Named barrier ids (0 is __syncthreads; DESIGN.md lists every kernel's): epilogue groups 1..2, MMA order 3..4.
_EPI_BARRIER = 1
_MMA_ORDER_BARRIER = 3


# ---------------------------------------------------------------------------------------------
# The kernel.


class _GemmLeakyReluSm90(GroupedTiles, Fp8Tiles):
    """Host launcher (`__call__`, a `@cute.jit`) and device body (`kernel`) of one GemmConfig; with a
    grouped_gemm_plan.GroupedConfig, the grouped GEMM's device body (launched by grouped_gemm's
    launcher; the grouped parts are GroupedTiles' methods)."""

    def __init__(self, cfg: GemmConfig):
        self.cfg = cfg
        self.ab_dtype = self.d_dtype = _DTYPES[cfg.dtype]
        self.acc_dtype = Float32
        self.swap = cfg.swap_ab  # the weights are A (tile_m of N), the tokens B (tile_n of M)
        self._fp8_options(cfg)  # fp8, tile_k; an FP8 config's A and B are e4m3
        self.tile_shape = (cfg.tile_m, cfg.tile_n, self.tile_k)
        self.cluster_shape = (cfg.cluster_m, cfg.cluster_n, 1)
        # Cooperative: tile_m/64 warpgroups share a tile. Pingpong: 2 warpgroups, a tile each.
        self.wg_per_tile = wg_per_tile(cfg)
        self.num_mma_wg = mma_warpgroups(cfg)
        self.epi_threads = 128 * self.wg_per_tile  # threads sharing one tile's epilogue
        self.threads = 128 * (self.num_mma_wg + 1)  # + the producer warpgroup (last)
        self.load_warp = 4 * self.num_mma_wg
        self.atom_layout = (self.wg_per_tile, 1, 1)
        acc_regs = cfg.tile_m * cfg.tile_n // self.epi_threads
        # Registers: the producer warpgroup gives its share to the MMA warpgroups.
        self.regs_load, self.regs_mma = (24, 240) if acc_regs >= 192 else (40, 232)
        self._grouped_options(cfg, acc_regs)  # grouped, gather, gather_threads, row_scale (all off for a GemmConfig)
        self.tile_slots = tile_slots(cfg)
        self.mcast_a = cfg.cluster_n  # CTAs of a cluster row load the same A tile
        self.mcast_b = cfg.cluster_m
        self.out_n = out_n(cfg)
        self.epi_tile = epi_tile(cfg)
        self.ab_stage, self.epi_stage = smem_stages(cfg, 4 * GROUP_TABLE_INTS if self.grouped else 0)
        self.prefetch_tiles, self.prefetch_unsplit = splitk.prefetch_plan(cfg, self.mcast_a, self.mcast_b, self.tile_k,
                                                                          self.ab_dtype.width)

    # -----------------------------------------------------------------------------------------
    # Host side.

    def _layouts(self):
        """(tiled_mma, tiled_mma_out, a_smem, a_load_smem, b_smem, d_smem, d_elems): the MMA and the
        shared-memory layouts of this config (traced inside a `@cute.jit` launcher)."""
        w_layout = LayoutEnum.ROW_MAJOR if const_expr(self.cfg.b_major == "k") else LayoutEnum.COL_MAJOR
        a_layout, b_layout = LayoutEnum.ROW_MAJOR, w_layout
        if const_expr(self.swap):
            a_layout, b_layout = w_layout, LayoutEnum.ROW_MAJOR
        d_layout = LayoutEnum.ROW_MAJOR
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            a_layout.sm90_mma_major_mode(),
            b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            self.atom_layout,
            tiler_mn=(64, self.cfg.tile_n),
        )
        # The layout of the output tile's fragment (gated plain tiles: half as wide as the MMA's).
        tiled_mma_out = tiled_mma
        if const_expr(self.out_n != self.cfg.tile_n):
            tiled_mma_out = sm90_utils.make_trivial_tiled_mma(
                self.ab_dtype, self.ab_dtype, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
                self.acc_dtype, self.atom_layout, tiler_mn=(64, self.out_n),
            )
        if const_expr(self.swap):
            a_smem = sm90_utils.make_smem_layout_a(a_layout, self.tile_shape, self.ab_dtype, self.ab_stage)
            a_load_smem = a_smem
        else:
            a_smem, a_load_smem = splitk.a_smem_layouts(self.cfg, self.ab_dtype, self.ab_stage, self.tile_k)
        b_smem = sm90_utils.make_smem_layout_b(b_layout, self.tile_shape, self.ab_dtype, self.ab_stage)
        d_smem = None
        d_elems = 16  # swapped tiles store from registers
        if const_expr(not self.swap):
            d_smem = sm90_utils.make_smem_layout_epi(
                self.d_dtype, d_layout, self.epi_tile, self.epi_stage * self.tile_slots
            )
            d_elems = cute.cosize(d_smem)
        return tiled_mma, tiled_mma_out, a_smem, a_load_smem, b_smem, d_smem, d_elems

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # [M, K], K contiguous (swapped: the weights [N, K], K or N contiguous)
        mB: cute.Tensor,  # [N, K], K or N contiguous (swapped: the tokens [M, K], K contiguous)
        mD: cute.Tensor,  # [M, N], N contiguous (swapped: out^T, [N, M], N contiguous)
        mBias: Optional[cute.Tensor],  # [N] or None
        mPartials: Optional[cute.Tensor],  # split-K: fp32 partial tiles
        mCounters: Optional[cute.Tensor],  # split-K: int32 per output tile, zero between launches
        num_splits: Int32,
        raster_group: Int32,
        max_clusters: Int32,
        stream,
        mScaleA: Optional[cute.Tensor] = None, mScaleB: Optional[cute.Tensor] = None,  # FP8 configs (gemm_fp8)
    ):
        tiled_mma, tiled_mma_out, a_smem, a_load_smem, b_smem, d_smem, d_elems = self._layouts()
        a_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.mcast_a > 1) else cpasync.CopyBulkTensorTileG2SOp()
        b_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.mcast_b > 1) else cpasync.CopyBulkTensorTileG2SOp()
        a_smem_one = cute.slice_(a_load_smem, (None, None, 0))  # a_rows x tile_k
        b_smem_one = cute.slice_(b_smem, (None, None, 0))
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
            a_op, mA, a_smem_one, (self.cfg.a_rows, self.tile_k), num_multicast=self.mcast_a
        )
        tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(
            b_op, mB, b_smem_one, (self.cfg.tile_n, self.tile_k), num_multicast=self.mcast_b
        )
        tma_atom_d, tma_d = None, mD
        if const_expr(not self.swap):
            tma_atom_d, tma_d = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mD, cute.slice_(d_smem, (None, None, 0)), self.epi_tile
            )
        tx_bytes = cute.size_in_bytes(self.ab_dtype, a_smem_one) + cute.size_in_bytes(self.ab_dtype, b_smem_one)

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.ab_stage]
            last_split: cute.struct.MemRange[Int32, 4]
            bias: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_slots * self.cfg.tile_n], 16]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.d_dtype, d_elems], 1024]

        self.shared_storage = SharedStorage
        if const_expr(SharedStorage.size_in_bytes() > SMEM_CAPACITY):
            raise ValueError(f"{self.cfg}: {SharedStorage.size_in_bytes()} bytes of shared memory")

        # Persistent grid: one cluster per (cluster-sized) output tile, at most max_clusters.
        m, n = mA.shape[0], mB.shape[0]
        clusters_m = cute.ceil_div(cute.ceil_div(m, self.cfg.tile_m), self.cfg.cluster_m)
        clusters_n = cute.ceil_div(cute.ceil_div(n, self.cfg.tile_n), self.cfg.cluster_n)
        units = clusters_m * clusters_n * num_splits
        grid_clusters = cutlass.min(units, max_clusters)
        self.kernel(
            tiled_mma, tiled_mma_out, tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_d, tma_d,
            mBias, mPartials, mCounters, num_splits, raster_group, clusters_m, clusters_n,
            a_smem, a_load_smem, b_smem, d_smem, tx_bytes, None, None, None, None, mScaleA, mScaleB,
        ).launch(
            grid=(self.cfg.cluster_m, self.cfg.cluster_n, grid_clusters),
            block=(self.threads, 1, 1),
            cluster=self.cluster_shape,
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.cfg.pdl,
        )

    # -----------------------------------------------------------------------------------------
    # Device side.

    @cute.jit
    def _work_unit(self, unit: Int32, num_splits: Int32, raster_group: Int32, clusters_m: Int32,
                   clusters_n: Int32, k_tiles: Int32, cluster_coord):
        """(tile_m index, tile_n index, split, first k-tile, k-tile count) of work unit `unit`.
        Cluster tiles are walked in bands of `raster_group` cluster rows, column by column."""
        split = unit % num_splits
        tile = unit // num_splits
        band_size = raster_group * clusters_n
        band = tile // band_size
        first_row = band * raster_group
        rows = cutlass.min(raster_group, clusters_m - first_row)
        in_band = tile - band * band_size
        cm = first_row + in_band % rows
        cn = in_band // rows
        k_begin = split * k_tiles // num_splits
        k_end = (split + 1) * k_tiles // num_splits
        return (cm * self.cfg.cluster_m + cluster_coord[0], cn * self.cfg.cluster_n + cluster_coord[1],
                split, k_begin, k_end - k_begin)

    @cute.jit
    def _act(self, x: Float32) -> Float32:
        """The config's activation, in fp32."""
        act = self.cfg.activation
        y = x
        if const_expr(act == "relu"):
            y = cute.arch.fmax(x, Float32(0.0))
        elif const_expr(act == "leaky_relu"):
            slope = self.cfg.slope
            if const_expr(0.0 <= slope <= 1.0):
                y = cute.arch.fmax(x, x * slope)  # two instructions; NaN stays NaN
            else:
                y = cutlass.select_(x > 0.0, x, x * slope)
        elif const_expr(act == "silu"):
            y = x / (Float32(1.0) + cute.math.exp(-x))
        elif const_expr(act == "gelu_tanh"):
            inner = Float32(0.7978845608028654) * (x + Float32(0.044715) * x * x * x)
            y = Float32(0.5) * x * (Float32(1.0) + cute.math.tanh(inner))
        return y

    @cute.jit
    def _gate(self, acc: cute.Tensor, out: cute.Tensor):
        """out = act(gate) * up for a gated plain tile: accumulator column blocks 2i (gate) and
        2i + 1 (up) of 8 columns each give output block i (fragment mode 0 is (column pair, row
        half, 8-column block))."""
        blocks = cute.size(out.shape[0][2])
        for mm in cutlass.range_constexpr(cute.size(acc, mode=[1])):
            for nn in cutlass.range_constexpr(cute.size(acc, mode=[2])):
                for i in cutlass.range_constexpr(blocks):
                    for h in cutlass.range_constexpr(2):
                        for c in cutlass.range_constexpr(2):
                            gate = acc[((c, h, 2 * i), mm, nn)]
                            up = acc[((c, h, 2 * i + 1), mm, nn)]
                            out[((c, h, i), mm, nn)] = self._act(gate) * up

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tiled_mma_out: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_d: Optional[cute.CopyAtom],
        mD: cute.Tensor,
        mBias: Optional[cute.Tensor],
        mPartials: Optional[cute.Tensor],
        mCounters: Optional[cute.Tensor],
        num_splits: Int32,
        raster_group: Int32,
        clusters_m: Int32,
        clusters_n: Int32,
        a_smem: cute.ComposedLayout,
        a_load_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        d_smem: Optional[cute.ComposedLayout],
        tx_bytes: cutlass.Constexpr,
        mOffsets: Optional[cute.Tensor],  # grouped: [E + 1] int32, group e's rows offsets[e] .. offsets[e + 1] - 1
        mIndex: Optional[cute.Tensor],  # grouped, gather: [rows] int32, the row of x each row reads
        mRowScale: Optional[cute.Tensor],  # grouped, row_scale: [rows] fp32
        max_units: Optional[Int32],  # grouped: the most work units a valid grouping gives
        mScaleA: Optional[cute.Tensor], mScaleB: Optional[cute.Tensor],  # fp8: the scales of A's, B's rows
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == self.load_warp:
            if const_expr(tma_atom_a is not None):  # (gathered rows come without a TMA atom)
                cpasync.prefetch_descriptor(tma_atom_a)
            if const_expr(tma_atom_b is not None):
                cpasync.prefetch_descriptor(tma_atom_b)
            if const_expr(tma_atom_d is not None):
                cpasync.prefetch_descriptor(tma_atom_d)

        cta_layout = cute.make_layout(self.cluster_shape)
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout.get_flat_coord(cta_rank)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        # Each consumer warp releases a stage to every CTA that multicast into it.
        consumer_warps = 4 * self.wg_per_tile
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.ab_stage,
            # the TMA thread, and with gather each gathering thread's cp.async arrival
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + self.gather_threads),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, consumer_warps * (self.mcast_a + self.mcast_b - 1)
            ),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, *self.cluster_shape)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_shape[:2], is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sA_load = storage.sA.get_tensor(a_load_smem.outer, swizzle=a_load_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sBias = storage.bias.get_tensor(cute.make_layout((cfg.tile_n, self.tile_slots)))
        sLast = storage.last_split.get_tensor(cute.make_layout(4))

        if const_expr(not self.grouped):  # (grouped: per work unit, in _produce_grouped)
            # (bM, bK, RestM, RestK) / (bN, bK, RestN, RestK) / (bM, bN, RestM, RestN)
            # a_rows < tile_m only runs with M <= a_rows: one M tile, whose first a_rows rows are loaded.
            gA = cute.local_tile(mA, (cfg.a_rows, self.tile_k), (None, None))
            gB = cute.local_tile(mB, (cfg.tile_n, self.tile_k), (None, None))
            tAsA, tAgA = cpasync.tma_partition(
                tma_atom_a, cluster_coord[1], cute.make_layout(self.mcast_a),
                cute.group_modes(sA_load, 0, 2), cute.group_modes(gA, 0, 2),
            )
            tBsB, tBgB = cpasync.tma_partition(
                tma_atom_b, cluster_coord[0], cute.make_layout(self.mcast_b),
                cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2),
            )
        a_mcast_mask = 0
        b_mcast_mask = 0
        if const_expr(self.mcast_a > 1):
            a_mcast_mask = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=1)
        if const_expr(self.mcast_b > 1):
            b_mcast_mask = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=0)

        k_tiles = cute.ceil_div(mA.shape[1], self.tile_k)
        units = clusters_m * clusters_n * num_splits
        first_unit = cute.arch.block_idx()[2]
        unit_stride = cute.arch.grid_dim()[2]

        if const_expr(self.prefetch_tiles > 0 and not self.grouped):  # decode: the first weights toward the L2
            if warp_idx == self.load_warp and first_unit < units and (self.prefetch_unsplit or num_splits > 1):
                tile_m, tile_n, _, k_begin, k_count = self._work_unit(
                    first_unit, num_splits, raster_group, clusters_m, clusters_n, k_tiles, cluster_coord
                )
                count = cutlass.min(k_count, self.prefetch_tiles)
                if const_expr(self.swap):
                    splitk.prefetch_weights(tma_atom_a, tAgA[(None, tile_m, None)], k_begin, count)
                else:
                    splitk.prefetch_weights(tma_atom_b, tBgB[(None, tile_n, None)], k_begin, count)
        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_shape[:2])
        # Programmatic dependent launch: the set-up above may overlap the previous kernel in the
        # stream; every global access below waits for it to complete.
        cute.arch.griddepcontrol_wait()
        groups = None
        if const_expr(self.grouped):  # the group table, and the launch's units, from the offsets
            groups, units = self._group_setup(storage, mOffsets, mA, mB, mD, max_units, tidx)

        # ---------------------------------------------------------------- producer warp
        if warp_idx >= self.load_warp:
            cute.arch.setmaxregister_decrease(self.regs_load)
            if const_expr(self.grouped):
                self._produce_grouped(ab_pipeline, groups, units, first_unit, unit_stride, k_tiles, tma_atom_a, mA,
                                      sA_load, tma_atom_b, mB, sB, mIndex, tidx, warp_idx, cluster_coord[0],
                                      b_mcast_mask)
            elif warp_idx == self.load_warp:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
                unit = first_unit
                while unit < units:
                    tile_m, tile_n, _, k_begin, k_count = self._work_unit(
                        unit, num_splits, raster_group, clusters_m, clusters_n, k_tiles, cluster_coord
                    )
                    tAgA_m = tAgA[(None, tile_m, None)]
                    tBgB_n = tBgB[(None, tile_n, None)]
                    for k in cutlass.range(k_count, unroll=1):
                        ab_pipeline.producer_acquire(state)
                        barrier = ab_pipeline.producer_get_barrier(state)
                        cute.copy(tma_atom_a, tAgA_m[(None, k_begin + k)], tAsA[(None, state.index)],
                                  tma_bar_ptr=barrier, mcast_mask=a_mcast_mask)
                        cute.copy(tma_atom_b, tBgB_n[(None, k_begin + k)], tBsB[(None, state.index)],
                                  tma_bar_ptr=barrier, mcast_mask=b_mcast_mask)
                        ab_pipeline.producer_commit(state)
                        state.advance()
                    unit += unit_stride
                ab_pipeline.producer_tail(state)

        # ---------------------------------------------------------------- MMA warpgroups
        if warp_idx < self.load_warp:
            cute.arch.setmaxregister_increase(self.regs_mma)
            slot = wg_idx if const_expr(cfg.pingpong) else 0  # which concurrent tile (pingpong)
            t = tidx - slot * self.epi_threads  # thread index within the tile's warpgroups
            epi_warp = slot * 4  # its first warp issues the TMA stores
            thr_mma = tiled_mma.get_slice(t)
            # FP8 slices A and B at the warpgroup's first thread (a warp-uniform index): WGMMA descriptors in
            # uniform registers, not copied over from vector ones. bf16 keeps t's (DESIGN.md, "GEMM tiles").
            wg_mma = tiled_mma.get_slice((wg_idx - slot) * 128) if const_expr(self.fp8) else thr_mma
            tCsA = wg_mma.partition_A(sA)
            tCsB = wg_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            # Tile coordinates of each accumulator element: the bias column (swapped: row).
            tCcD = thr_mma.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
            acc = cute.make_rmem_tensor(tCcD.shape, self.acc_dtype)
            num_k_blocks = cute.size(tCrA, mode=[2])

            if const_expr(not self.swap):
                # Epilogue: registers -> shared memory (stmatrix) -> global (TMA store).
                acc_out = acc
                if const_expr(cfg.gated):
                    acc_out = cute.make_rmem_tensor(
                        tiled_mma_out.get_slice(t).partition_C(
                            cute.make_identity_tensor((cfg.tile_m, self.out_n))).shape, self.acc_dtype)
                sD = storage.sD.get_tensor(d_smem.outer, swizzle=d_smem.inner)
                if const_expr(not self.grouped):  # (grouped: stored row by row, _store_rows)
                    gD = cute.local_tile(mD, (cfg.tile_m, self.out_n), (None, None))
                copy_atom_c = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), self.d_dtype)
                tiled_copy_r2s = cute.make_tiled_copy_S(
                    sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.d_dtype, self.acc_dtype),
                    cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma_out),
                )
                thr_copy_r2s = tiled_copy_r2s.get_slice(t)
                tRS_sD = thr_copy_r2s.partition_D(sD)  # (R2S, R2S_M, R2S_N, buffer)
                tRS_rAcc = tiled_copy_r2s.retile(acc_out)
                rD_shape = cute.shape(thr_copy_r2s.partition_S(sD))
                tRS_rD = cute.make_rmem_tensor(rD_shape[:3], self.acc_dtype)
                tRS_rD_out = cute.make_rmem_tensor(rD_shape[:3], self.d_dtype)
                subtile_size = cute.size(tRS_rD)
                if const_expr(not self.grouped):
                    store_pipeline = pipeline.PipelineTmaStore.create(
                        num_stages=self.epi_stage,
                        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.epi_threads),
                    )
                subtiles = cute.zipped_divide(cute.make_layout((cfg.tile_m, self.out_n)), self.epi_tile).shape[1]
                subtile_order = cute.make_layout(subtiles, stride=(subtiles[1], 1))  # N fastest
                num_subtiles = cute.size(subtiles)
                bias_per_thread = cute.ceil_div(cfg.tile_n, self.epi_threads)
                bias_regs = cute.make_rmem_tensor((bias_per_thread,), Float32)

            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            unit = first_unit
            if const_expr(cfg.pingpong):
                # Warpgroup 1 starts at the CTA's second tile, whose stages follow the first's.
                unit += wg_idx * unit_stride
                if wg_idx == 1:
                    read_state.advance(k_tiles)
                else:
                    cute.arch.barrier_arrive(barrier_id=_MMA_ORDER_BARRIER, number_of_threads=256)
            self._fp8_first_turn(wg_idx, _MMA_ORDER_BARRIER)  # FP8 stagger only
            epi_count = Int32(0)  # subtiles stored so far: selects the epilogue buffer
            if const_expr(self.grouped):
                expert = Int32(0)  # the expert of the last unit (units come in increasing order)

            while unit < units:
                if const_expr(self.grouped):
                    expert, first, count, tile_m, tile_n, scales = self._grouped_unit(unit, expert, groups, mRowScale,
                                                                                      tCcD, cluster_coord[0])
                    split, k_begin, k_count = 0, 0, k_tiles
                else:
                    tile_m, tile_n, split, k_begin, k_count = self._work_unit(
                        unit, num_splits, raster_group, clusters_m, clusters_n, k_tiles, cluster_coord
                    )
                if const_expr(cfg.bias != "none" and not self.swap):
                    # Fetched now, used after the mainloop: its latency hides under the MMAs.
                    for j in cutlass.range_constexpr(bias_per_thread):
                        col = t + j * self.epi_threads
                        n_idx = tile_n * cfg.tile_n + col
                        bias_regs[j] = Float32(0.0)
                        # (gated: the bias is per weight row, twice as many as output columns)
                        if const_expr(self.grouped):  # bias [E, N]
                            if col < cfg.tile_n and n_idx < cute.size(mBias, mode=[1]):
                                bias_regs[j] = mBias[expert, n_idx].to(Float32)
                        elif col < cfg.tile_n and n_idx < mBias.shape[0]:
                            bias_regs[j] = mBias[n_idx].to(Float32)

                # ------------------------------------------------ mainloop
                if const_expr(cfg.pingpong):
                    cute.arch.barrier(barrier_id=_MMA_ORDER_BARRIER + wg_idx, number_of_threads=256)
                release_state = read_state.clone()
                acc.fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                if const_expr(self.fp8):  # each k-tile's sums promoted to fp32 (fp8_tiles)
                    self._fp8_mainloop(tiled_mma, acc, tCrA, tCrB, tCcD, ab_pipeline, read_state, release_state,
                                       k_begin, k_count, tile_m, tile_n, mScaleA, mScaleB, wg_idx, _MMA_ORDER_BARRIER)
                else:
                    for k in cutlass.range(k_count, unroll=1):
                        ab_pipeline.consumer_wait(read_state)
                        if const_expr(self.gather):  # cp.async wrote the rows: WGMMA reads through the async proxy
                            cute.arch.fence_view_async_shared()
                        for kb in cutlass.range_constexpr(num_k_blocks):
                            coord = (None, None, kb, read_state.index)
                            cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                        warpgroup.commit_group()
                        read_state.advance()
                        if k > 0:
                            # Keep one WGMMA batch in flight; the one before it has read its stage.
                            warpgroup.wait_group(1)
                            ab_pipeline.consumer_release(release_state)
                            release_state.advance()
                if const_expr(cfg.pingpong):
                    cute.arch.barrier_arrive(barrier_id=_MMA_ORDER_BARRIER + 1 - wg_idx, number_of_threads=256)
                warpgroup.wait_group(0)
                if unit + unit_stride * self.tile_slots >= units:
                    # The CTA's last mainloop is done: the next kernel in the stream may launch and
                    # run its set-up while this one reduces splits and stores (split-K decode launches
                    # 2-7% faster on the H200). Triggered as soon as the loads were issued, the next
                    # grid's CTAs took the idle SMs early and unsplit decode launches ran up to 7% slower.
                    cute.arch.griddepcontrol_launch_dependents()
                if k_count > 0:
                    ab_pipeline.consumer_release(release_state)
                if const_expr(cfg.pingpong):
                    read_state.advance(k_tiles)  # skip the other warpgroup's tile

                # ------------------------------------------------ split-K: last split reduces
                run_epilogue = True
                if const_expr(cfg.split_k):
                    if num_splits > 1:
                        if const_expr(self.swap):
                            tiles_n = clusters_n * cfg.cluster_n  # tiles, not clusters
                            run_epilogue = splitk.reduce_whole_tiles(
                                acc, mPartials, mCounters, sLast, tile_m * tiles_n + tile_n, split,
                                num_splits, clusters_m * cfg.cluster_m * tiles_n, t, slot, self.epi_threads,
                                self._epi_sync,
                            )
                        else:
                            run_epilogue = splitk.reduce_rows(
                                acc, tCcD, mPartials, mCounters, sLast, tile_m, tile_n, split,
                                num_splits, mD.shape[0], clusters_n * cfg.cluster_n, t, slot, cfg.tile_m,
                                cfg.tile_n, self._epi_sync,
                            )

                # ------------------------------------------------ epilogue
                if const_expr(self.swap):
                    if const_expr(self.grouped):
                        self._store_swapped_grouped(acc, tCcD, mD, mBias, mRowScale, tile_m, tile_n, expert, first,
                                                    count)
                    elif run_epilogue:
                        self._store_swapped(acc, tCcD, mD, mBias, tile_m, tile_n)
                elif run_epilogue:
                    if const_expr(cfg.bias != "none"):
                        for j in cutlass.range_constexpr(bias_per_thread):
                            col = t + j * self.epi_threads
                            if col < cfg.tile_n:
                                sBias[col, slot] = bias_regs[j]
                        self._epi_sync(slot)
                    if const_expr(not cfg.gated):
                        for i in cutlass.range(cute.size(acc), unroll_full=True):
                            x = acc[i]
                            if const_expr(cfg.bias != "none"):
                                x = x + sBias[tCcD[i][1], slot]
                            acc[i] = self._act(x)
                    else:
                        if const_expr(cfg.bias != "none"):
                            for i in cutlass.range(cute.size(acc), unroll_full=True):
                                acc[i] = acc[i] + sBias[tCcD[i][1], slot]
                        self._gate(acc, acc_out)
                    if const_expr(self.row_scale):
                        self._scale_rows(acc_out, scales)

                    if const_expr(not self.grouped):
                        gD_tile = gD[(None, None, tile_m, tile_n)]
                        bSG_sD, bSG_gD = cpasync.tma_partition(
                            tma_atom_d, 0, cute.make_layout(1),
                            cute.group_modes(sD, 0, 2), cute.zipped_divide(gD_tile, self.epi_tile),
                        )
                    for s in cutlass.range_constexpr(num_subtiles):
                        for v in cutlass.range_constexpr(subtile_size):
                            tRS_rD[v] = tRS_rAcc[s * subtile_size + v]
                        tRS_rD_out.store(tRS_rD.load().to(self.d_dtype))
                        buf = slot * self.epi_stage + epi_count % self.epi_stage
                        cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, buf)])
                        if const_expr(self.grouped):  # rows of the group only: 16-byte stores
                            self._store_subtile(sD[(None, None, buf)], mD, first, count, tile_m, tile_n,
                                                subtile_order.get_hier_coord(s), t, slot)
                            epi_count += 1
                            continue
                        # Make the smem writes visible to the TMA (async proxy), then store.
                        cute.arch.fence_proxy("async.shared", space="cta")
                        self._epi_sync(slot)
                        if warp_idx == epi_warp:
                            cute.copy(tma_atom_d, bSG_sD[(None, buf)],
                                      bSG_gD[(None, subtile_order.get_hier_coord(s))])
                            store_pipeline.producer_commit()
                            store_pipeline.producer_acquire()  # the next buffer's store has read it
                        self._epi_sync(slot)
                        epi_count += 1

                unit += unit_stride * self.tile_slots
            if const_expr(not self.swap and not self.grouped):
                if warp_idx == epi_warp:
                    store_pipeline.producer_tail()

    @cute.jit
    def _store_swapped(self, acc: cute.Tensor, tCcD: cute.Tensor, mD: cute.Tensor,
                       mBias: Optional[cute.Tensor], tile_m: Int32, tile_n: Int32):
        """Epilogue of a swapped tile: out^T[n, m] = act(acc + bias[n]) straight from registers,
        element by element inside [N, M]. A thread's elements are two tokens of one weight row,
        so neither TMA nor vector stores apply; the output (M x N) is small next to the weights.
        Gated: rows r and r + 8 of each 16 (row halves h = 0, 1 of the fragment, one thread) are a
        gate/up pair, output row (r // 16) * 8 + r % 8."""
        cfg = self.cfg
        if const_expr(not cfg.gated):
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                n_idx = tile_m * cfg.tile_m + tCcD[i][0]
                m_idx = tile_n * cfg.tile_n + tCcD[i][1]
                if n_idx < mD.shape[0] and m_idx < mD.shape[1]:
                    x = acc[i]
                    if const_expr(cfg.bias != "none"):
                        x = x + mBias[n_idx].to(Float32)
                    mD[n_idx, m_idx] = self._act(x).to(self.d_dtype)
        else:
            if const_expr(cfg.bias != "none"):
                for i in cutlass.range(cute.size(acc), unroll_full=True):
                    n_idx = tile_m * cfg.tile_m + tCcD[i][0]
                    if n_idx < mBias.shape[0]:
                        acc[i] = acc[i] + mBias[n_idx].to(Float32)
            # Fragment mode 0 is (2 columns, 2 row halves, tile_n / 8), indexed flat: at tile_n = 8
            # its last mode is gone. Element c + 4 j is a gate, c + 2 + 4 j its up.
            for mm in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                for nn in cutlass.range_constexpr(cute.size(acc, mode=[2])):
                    for j in cutlass.range_constexpr(cute.size(acc, mode=[0]) // 4):
                        for c in cutlass.range_constexpr(2):
                            coord = tCcD[(c + 4 * j, mm, nn)]
                            n_idx = tile_m * (cfg.tile_m // 2) + coord[0] // 16 * 8 + coord[0] % 8
                            m_idx = tile_n * cfg.tile_n + coord[1]
                            if n_idx < mD.shape[0] and m_idx < mD.shape[1]:
                                y = self._act(acc[(c + 4 * j, mm, nn)]) * acc[(c + 2 + 4 * j, mm, nn)]
                                mD[n_idx, m_idx] = y.to(self.d_dtype)

    @cute.jit
    def _epi_sync(self, slot: Int32):
        cute.arch.barrier(barrier_id=_EPI_BARRIER + slot, number_of_threads=self.epi_threads)


GemmSm90 = _GemmLeakyReluSm90  # for grouped_gemm's launcher (CuTeDSL names the kernel symbol after the class)


# ---------------------------------------------------------------------------------------------
# Compilation.


def _build(cfg: GemmConfig):
    """(launcher, fake compile arguments): one compile serves every M, N, K and stride."""
    elem = _DTYPES[cfg.dtype]
    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int()
    a = make_fake_tensor(elem, (m, k), (cute.sym_int64(divisibility=8), 1), assumed_align=16)
    if cfg.b_major == "k":
        b = make_fake_tensor(elem, (n, k), (cute.sym_int64(divisibility=8), 1), assumed_align=16)
    else:
        b = make_fake_tensor(elem, (n, k), (1, cute.sym_int64(divisibility=8)), assumed_align=16)
    n_out = cute.sym_int() if cfg.gated else n  # gated: half as many columns as weight rows
    if cfg.swap_ab:  # the kernel's A is the weights, its B the tokens, its D out^T (stored per element)
        a, b = b, a
        d = make_fake_tensor(elem, (n_out, m), (1, cute.sym_int64()), assumed_align=16)
    else:
        d = make_fake_tensor(elem, (m, n_out), (cute.sym_int64(divisibility=8), 1), assumed_align=16)
    bias = None
    if cfg.bias != "none":
        bias = make_fake_tensor(_DTYPES[cfg.bias], (n,), (1,), assumed_align=_DTYPES[cfg.bias].width // 8)
    partials = counters = None
    if cfg.split_k:
        partials = make_fake_tensor(Float32, (cute.sym_int(),), (1,), assumed_align=16)
        counters = make_fake_tensor(Int32, (cute.sym_int(),), (1,), assumed_align=4)
    args = (a, b, d, bias, partials, counters, Int32(1), Int32(8), Int32(132),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return _GemmLeakyReluSm90(cfg), args


NOT_FP8 = (None, None)  # a bf16/fp16 launch's mScaleA, mScaleB: compiled functions take every __call__ parameter


def compile(config: GemmConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config` (once per variant and process, cached on disk; jit's in-memory cache is the
    only one, so that jit.forget_loaded() and tuned cubins reach it). Its function takes (a, b_nk, out, bias,
    partials, counters, splits, raster_group, max_clusters, *NOT_FP8), swapped configs (b_nk, a, out.t(), ...)."""
    return jit.compile_variant(config.variant(), lambda: _build(config))


def precompile(configs=None, processes: int | None = None) -> list[jit.CompiledKernel]:
    """compile() of each config (default: variants_for()), cold ones first in parallel processes (jit.precompile)."""
    return jit.precompile(compile, variants_for() if configs is None else configs, processes)


# ---------------------------------------------------------------------------------------------
# The reference, and workloads: a config's kernel with its inputs, for tests and SIP.


def epilogue_reference(y: torch.Tensor, activation: str = "leaky_relu", gated: bool = False,
                       negative_slope: float = 0.01) -> torch.Tensor:
    """The kernel's epilogue in torch, on y = a @ b^T + bias: act(y), or for gated, act(gate) * up
    over the GATE_BLOCK-interleaved columns of y (half as many columns). For references and K = 0."""
    f = torch.nn.functional
    act = {"none": lambda x: x, "relu": f.relu, "leaky_relu": lambda x: f.leaky_relu(x, negative_slope),
           "silu": f.silu, "gelu_tanh": lambda x: f.gelu(x, approximate="tanh")}[activation]
    if not gated:
        return act(y)
    pairs = y.unflatten(-1, (-1, 2, GATE_BLOCK))
    return (act(pairs[..., 0, :]) * pairs[..., 1, :]).flatten(-2)


def _args(config: GemmConfig, m: int, n: int, k: int, seed: int) -> tuple:
    """Arguments of compile(config).fn for one [m, k] x [n, k] problem on the current CUDA device:
    random inputs (b scaled so outputs stay O(1)), the output NaN-filled so that a skipped element
    shows, fresh split-K workspace."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = checks.TORCH_DTYPE[config.dtype]
    a = torch.randn(m, k, generator=g, device="cuda").to(dt)
    b = torch.randn(n, k, generator=g, device="cuda").div_(k ** 0.5).to(dt)
    if config.b_major == "n":
        b = b.t().contiguous().t()
    bias = None
    if config.bias != "none":
        bias = torch.randn(n, generator=g, device="cuda").to(checks.TORCH_DTYPE[config.bias])
    out = torch.full((m, n // 2 if config.gated else n), float("nan"), dtype=dt, device="cuda")
    partials = counters = None
    if config.split_k:
        counters = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device="cuda")
        partials = torch.empty(max(4, partial_floats(config, m, n)), dtype=torch.float32, device="cuda")
    clusters = modes.max_active_clusters(torch.cuda.current_device(), config.cluster_m * config.cluster_n)
    if config.swap_ab:
        return (b, a, out.t(), bias, partials, counters, config.splits, config.raster_group, clusters, *NOT_FP8)
    return (a, b, out, bias, partials, counters, config.splits, config.raster_group, clusters, *NOT_FP8)


def _check(config: GemmConfig, args: tuple) -> float:
    """Raise AssertionError unless out (args[2]) is within one ulp of its dtype of the float64
    reference rounded to that dtype (+ 1e-4 absolute near zero): fp32 accumulation leaves the
    rounding of the output as the only visible error. Returns the worst error / tolerance."""
    a, b, out, bias = args[:4]
    if config.swap_ab:  # the launch took (b_nk, a, out^T)
        a, b, out = b, a, out.t()
    ref = a.double() @ b.double().t()
    if bias is not None:
        ref += bias.double()
    ref = epilogue_reference(ref, config.activation, config.gated, config.slope)
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite elements"
    ulp = 2.0 ** (-7 if out.dtype == torch.bfloat16 else -10)
    err = (out.double() - ref.to(out.dtype).double()).abs() / (1.01 * ulp * ref.abs() + 1e-4)
    worst = err.argmax().item()
    assert err.flatten()[worst] <= 1, (f"element {divmod(worst, out.shape[1])} = {out.flatten()[worst].item()}, "
                                       f"reference {ref.flatten()[worst].item()}")
    return err.flatten()[worst].item()


def workload(config: GemmConfig, shape: GemmShape) -> Workload:
    """`config`'s kernel on `shape` (with the config's K splits and raster group). test_args draws ragged M
    (m_range(config)), N and K up to 1600, and for split-K configs the split count: one kernel serves every count."""
    options = (shape.dtype, shape.b_major, shape.bias, float(shape.slope), shape.activation, shape.gated)
    if options != (config.dtype, config.b_major, config.bias, config.slope, config.activation, config.gated):
        raise ValueError(f"{config} does not serve {shape}: dtype, b_major, bias, slope, activation and gating "
                         "must match")
    check_fits(config, shape.m, shape.n)
    lo, hi = m_range(config)

    def test_args(seed: int) -> tuple:
        r = random.Random(seed)
        m, n, k = r.randint(lo, hi), 16 * r.randint(1, 100), 8 * r.randint(1, 200)
        splits = r.randint(1, min(MAX_SPLITS, math.ceil(k / TILE_K))) if config.split_k else 1
        return _args(dataclasses.replace(config, splits=splits), m, n, k, seed)

    return Workload(compile(config), lambda seed: _args(config, shape.m, shape.n, shape.k, seed),
                    outputs=lambda args: (args[2].t(),) if config.swap_ab else args[2:3],
                    check=functools.partial(_check, config),
                    test_args=test_args, name=OP)
