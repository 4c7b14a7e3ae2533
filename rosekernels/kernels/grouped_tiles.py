"""Device code of the GEMM kernel's `grouped` option (rosekernels.kernels.grouped_gemm): rows grouped by
expert, each group times its own weight. The GEMM device class (gemm_leakyrelu._GemmLeakyReluSm90)
inherits these methods and calls them where a grouped config (grouped_gemm_plan.GroupedConfig) differs
from a dense one; a dense config never reaches them.

- `_group_scan`: each CTA reads the offsets once (after griddepcontrol.wait: the dispatch before it
  writes them), clamps every group into [0, rows), and keeps per expert its first row, its row count
  and its first work unit (a prefix sum over the experts of row tiles x weight tiles) in shared memory.
  Experts without rows have no units: they are never visited.
- `_locate`: a unit's expert (a forward scan from the last one: every role walks its units in
  increasing order), row tile and weight tile; on a 2x1 cluster (`cluster_m` 2) a unit is the cluster's:
  its two CTAs take row tiles 2u and 2u + 1 of the expert and the same weight tile, which each CTA loads
  half of and multicasts to both (the dense kernel's multicast of B); after an expert's pairs, an odd
  last row tile takes units of two weight tiles, one per CTA, each loaded whole by its CTA.
- `_produce_grouped`: the producer, per unit: the weights' k-tiles of the unit's expert by TMA, the
  rows by TMA at the group's first row (`cute.domain_offset`: rows past the group's end are the next
  group's, or zero-filled past the tensor; they only reach accumulator rows that are never stored) or,
  with `gather`, by 16-byte cp.async from a's rows a_index[r] by the whole producer warpgroup, each row
  and K index clamped into the tensors, rows past the group and K past its end zero-filled.
- `_store_rows`: the plain tiles' epilogue stores from the shared-memory subtile to out in 16-byte
  vectors, rows past the group and columns past N skipped (a TMA store of the whole tile would
  overwrite the next group's rows).
- `_row_scales` / `_scale_rows`: out row r times row_scale[r] (plain tiles);
  `_store_swapped_grouped`: the swapped tiles' epilogue (the dense one's, on the group's rows, with the
  expert's bias and the row scales).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from rosekernels.kernels.grouped_gemm_plan import (GATHER_THREADS, GROUP_TABLE_INTS, MAX_EXPERTS, TILE_K,
                                                   unit_count)

WEIGHT_TILES_AT = GROUP_TABLE_INTS - 1  # the group table's last int: the weight tiles of an expert

VEC = 8  # bf16/fp16 elements per 16-byte vector


class GroupedTiles:
    """The grouped option's device methods (a mixin of the GEMM device class)."""

    def _grouped_options(self, cfg, acc_regs: int) -> None:
        """The device class's grouped attributes: off for a dense GemmConfig (which has no `grouped`)."""
        self.grouped = getattr(cfg, "grouped", False)  # rows grouped by expert, a weight per group
        self.gather = self.grouped and cfg.gather  # rows gathered by index with cp.async
        self.gather_threads = min(GATHER_THREADS, cfg.row_tile * VEC) if self.gather else 0
        self.row_scale = self.grouped and cfg.row_scale
        self.unit_rows = cfg.unit_rows if self.grouped else 0  # an expert's rows per unit (a cluster's)
        if self.gather:  # the gathering producer threads hold row indices and addresses
            self.regs_load, self.regs_mma = (40, 232) if acc_regs >= 192 else (56, 224)

    @cute.jit
    def _group_setup(self, storage, mOffsets: cute.Tensor, mA: cute.Tensor, mB: cute.Tensor, mD: cute.Tensor,
                     max_units: Int32, tidx: Int32):
        """(group table, the launch's work units): `_group_scan` over the output's rows (swapped: out^T's
        columns) and the weight tiles of the weights (swapped: the kernel's A)."""
        groups = storage.groups.get_tensor(cute.make_layout(GROUP_TABLE_INTS))
        weight_rows = cute.size(mA if const_expr(self.swap) else mB, mode=[0])
        rows = mD.shape[1] if const_expr(self.swap) else mD.shape[0]
        return groups, self._group_scan(groups, mOffsets, rows, cute.ceil_div(weight_rows, self.cfg.weight_tile),
                                        max_units, tidx)

    @cute.jit
    def _grouped_unit(self, unit: Int32, expert: Int32, groups: cute.Tensor, mRowScale, tCcD: cute.Tensor,
                      rank_m: Int32):
        """A consumer's view of `unit` in the CTA of cluster row `rank_m`: (expert, the group's first row,
        its row count, tile_m index, tile_n index, the row scales of a plain tile's rows or None)."""
        sFirst, sCount, _ = self._group_tables(groups)
        expert, row_tile, weight_tile, _ = self._locate(unit, expert, groups, rank_m)
        first, count = sFirst[expert], sCount[expert]
        tile_m, tile_n = (weight_tile, row_tile) if const_expr(self.swap) else (row_tile, weight_tile)
        scales = None
        if const_expr(self.row_scale and not self.swap):  # fetched now: the loads hide under the mainloop
            scales = self._row_scales(mRowScale, tCcD, first, count, tile_m * self.cfg.tile_m)
        return expert, first, count, tile_m, tile_n, scales

    @cute.jit
    def _group_tables(self, groups: cute.Tensor):
        """(first row, row count, first unit) per expert: views of the shared-memory table (its last
        int, WEIGHT_TILES_AT, holds the weight tiles of an expert)."""
        first = cute.make_tensor(groups.iterator, cute.make_layout(MAX_EXPERTS))
        count = cute.make_tensor(groups.iterator + MAX_EXPERTS, cute.make_layout(MAX_EXPERTS))
        prefix = cute.make_tensor(groups.iterator + 2 * MAX_EXPERTS, cute.make_layout(MAX_EXPERTS + 1))
        return first, count, prefix

    @cute.jit
    def _group_scan(self, groups: cute.Tensor, mOffsets: cute.Tensor, rows: Int32, weight_tiles: Int32,
                    max_units: Int32, tidx: Int32) -> Int32:
        """Fill the group table from the offsets (every thread of the CTA takes part) and return the
        launch's work units: at most max_units, whatever the offsets hold; groups are clamped into
        [0, rows), each starting no earlier than 0 and ending no earlier than it starts."""
        sFirst, sCount, sPrefix = self._group_tables(groups)
        experts = cutlass.min(mOffsets.shape[0] - 1, MAX_EXPERTS)  # (the op refuses more: the table's size)
        for e in cutlass.range(tidx, experts, self.threads):
            lo = cutlass.min(cutlass.max(mOffsets[e], Int32(0)), rows)
            hi = cutlass.min(cutlass.max(mOffsets[e + 1], lo), rows)
            sFirst[e] = lo
            sCount[e] = hi - lo
            units = unit_count(cute.ceil_div(hi - lo, self.cfg.row_tile), weight_tiles, self.cfg.cluster_m,
                               cute.ceil_div)
            # each <= max_units < MAX_UNITS: a step adds 32 to a carry <= max_units, 33 x MAX_UNITS < 2^31
            sPrefix[e + 1] = cutlass.min(units, max_units)
        if const_expr(self.cfg.cluster_m == 2):
            if tidx == 0:
                groups[WEIGHT_TILES_AT] = weight_tiles
        cute.arch.sync_threads()
        if tidx < 32:  # warp 0: inclusive prefix sums, 32 experts a step, saturating at max_units
            carry = Int32(0)
            for base in cutlass.range(0, experts, 32):
                e = base + tidx
                v = Int32(0)
                if e < experts:
                    v = sPrefix[e + 1]
                for d in cutlass.range_constexpr(5):
                    up = cute.arch.shuffle_sync_up(v, 1 << d)
                    if tidx >= (1 << d):
                        v = v + up
                total = cutlass.min(carry + v, max_units)
                if e < experts:
                    sPrefix[e + 1] = total
                carry = cute.arch.shuffle_sync(total, 31)
            if tidx == 0:
                sPrefix[0] = Int32(0)
        cute.arch.sync_threads()
        return sPrefix[experts]

    @cute.jit
    def _locate(self, unit: Int32, expert: Int32, groups: cute.Tensor, rank_m: Int32):
        """(expert, row tile, weight tile, shared) of `unit` (< the launch's units) for the CTA of cluster
        row `rank_m`, scanning forward from `expert` (a unit at or after that expert's first); an
        expert's row units come first. shared (1 or 0): the weight tile is the cluster's, each CTA
        loading half of it for both; 0 on an odd last row tile's units, whose CTAs take adjacent
        weight tiles of the same rows."""
        _, sCount, sPrefix = self._group_tables(groups)
        e = expert
        while sPrefix[e + 1] <= unit:
            e = e + 1
        local = unit - sPrefix[e]
        tiles = cute.ceil_div(sCount[e], self.cfg.row_tile)
        shared = Int32(1)
        if const_expr(self.cfg.cluster_m == 1):
            weight_tile = local // tiles
            row_tile = local - weight_tile * tiles
        else:
            pairs = tiles // 2
            pair_units = pairs * groups[WEIGHT_TILES_AT]
            # past the pairs: the odd last row tile (rank 1's is past the group where it stays shared)
            weight_tile = 2 * (local - pair_units)
            row_tile = tiles - 1 + rank_m
            if local < pair_units:
                weight_tile = local // pairs
                row_tile = (local - weight_tile * pairs) * 2 + rank_m
            elif weight_tile + 1 < groups[WEIGHT_TILES_AT]:
                weight_tile = weight_tile + rank_m
                row_tile = tiles - 1
                shared = Int32(0)
        return e, row_tile, weight_tile, shared

    @cute.jit
    def _produce_grouped(self, ab_pipeline, groups: cute.Tensor, units: Int32, first_unit: Int32,
                         unit_stride: Int32, k_tiles: Int32, tma_atom_a, mA: cute.Tensor, sA_load: cute.Tensor,
                         tma_atom_b, mB: cute.Tensor, sB: cute.Tensor, mIndex, tidx: Int32, warp_idx: Int32,
                         rank_m: Int32, w_mcast_mask):
        """The producer warpgroup's loop over the CTA's units (see the module docstring). Without
        `gather` only its first warp works; with it the threads `_gather_unit` needs, the first warp
        also issuing the weights' TMA and arming each stage's barrier for them (the barrier counts 1 +
        the gathering threads). On a 2x1 cluster (plain tiles, rows by TMA) the CTA of cluster row
        `rank_m` loads its half of a shared weight tile into both CTAs (`w_mcast_mask`), and both halves
        of its own weight tile into itself only."""
        cfg = self.cfg
        sFirst, sCount, _ = self._group_tables(groups)
        tma_warp = warp_idx == self.load_warp
        gtid = tidx - 32 * self.load_warp  # 0 .. 127 in the producer warpgroup
        works = tma_warp
        if const_expr(self.gather):
            works = gtid < self.gather_threads
        if works:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
            unit = first_unit
            expert = Int32(0)
            while unit < units:
                expert, row_tile, weight_tile, shared = self._locate(unit, expert, groups, rank_m)
                first = sFirst[expert]
                # The weights' TMA (swapped: the kernel's A), the rows (swapped: its B).
                tma_atom_w, mW, sW, tma_atom_x, mX, sX = tma_atom_b, mB, sB, tma_atom_a, mA, sA_load
                if const_expr(self.swap):
                    tma_atom_w, mW, sW, tma_atom_x, mX, sX = tma_atom_a, mA, sA_load, tma_atom_b, mB, sB
                gW = cute.local_tile(mW, (cfg.weight_tile, TILE_K), (weight_tile, None, expert))
                tWs, tWg = cpasync.tma_partition(tma_atom_w, rank_m, cute.make_layout(self.cfg.cluster_m),
                                                 cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
                tWs_peer, tWg_peer = tWs, tWg  # 2x1: the other half, which a unit not shared loads too
                if const_expr(self.cfg.cluster_m == 2):
                    tWs_peer, tWg_peer = cpasync.tma_partition(tma_atom_w, 1 - rank_m, cute.make_layout(2),
                                                               cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
                if const_expr(self.gather):
                    state = self._gather_unit(ab_pipeline, state, mX, sX, mIndex, tma_atom_w, tWs, tWg, first,
                                              sCount[expert], row_tile, k_tiles, gtid, tma_warp)
                else:
                    # Rows past the group's end are the next group's (or zero-filled past a): they only
                    # reach accumulator rows that are never stored.
                    gX = cute.local_tile(cute.domain_offset((first, 0), mX), (cfg.row_tile, TILE_K), (row_tile, None))
                    tXs, tXg = cpasync.tma_partition(tma_atom_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                                     cute.group_modes(gX, 0, 2))
                    for k in cutlass.range(k_tiles, unroll=1):
                        ab_pipeline.producer_acquire(state)
                        barrier = ab_pipeline.producer_get_barrier(state)
                        if shared == 1:
                            cute.copy(tma_atom_w, tWg[(None, k)], tWs[(None, state.index)], tma_bar_ptr=barrier,
                                      mcast_mask=w_mcast_mask)
                        else:
                            if const_expr(self.cfg.cluster_m == 2):  # both halves, into this CTA only
                                cute.copy(tma_atom_w, tWg[(None, k)], tWs[(None, state.index)],
                                          tma_bar_ptr=barrier, mcast_mask=Int32(1) << rank_m)
                                cute.copy(tma_atom_w, tWg_peer[(None, k)], tWs_peer[(None, state.index)],
                                          tma_bar_ptr=barrier, mcast_mask=Int32(1) << rank_m)
                        cute.copy(tma_atom_x, tXg[(None, k)], tXs[(None, state.index)], tma_bar_ptr=barrier)
                        ab_pipeline.producer_commit(state)
                        state.advance()
                unit += unit_stride
            if const_expr(self.gather):  # no thread leaves with its copies in flight
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
            if tma_warp:
                ab_pipeline.producer_tail(state)

    @cute.jit
    def _gather_unit(self, ab_pipeline, state, mX: cute.Tensor, sX: cute.Tensor, mIndex: cute.Tensor, tma_atom_w,
                     tWs: cute.Tensor, tWg: cute.Tensor, first: Int32, count: Int32, row_tile: Int32,
                     k_tiles: Int32, gtid: Int32, tma_warp):
        """One unit's k-tiles with `gather`; returns the advanced pipeline state. Thread gtid copies
        16-byte vector gtid % 8 of rows gtid // 8 + j * (threads / 8) of the row tile; a row past the
        group or a vector past K is zero-filled (a cp.async of 0 source bytes) from an address clamped
        into x (row 0 of an empty x: a copy of 0 source bytes reads nothing). The empty barrier is waited
        on by every gathering thread, armed by the TMA warp only."""
        rows = self.cfg.row_tile
        threads = self.gather_threads
        row_stride = threads // VEC
        tokens, k = mX.shape[0], mX.shape[1]
        copy = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), mX.element_type,
                                   num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(copy, cute.make_ordered_layout((row_stride, VEC), order=(1, 0)),
                                        cute.make_layout((1, VEC)))
        tXs = tiled.get_slice(gtid).partition_D(sX)  # (vector, row passes, 1, stages)
        gX = cute.zipped_divide(mX, (1, VEC))  # ((1, VEC), (tokens, K / VEC))
        chunk = gtid % VEC
        tokens_of, valid = [], []
        for j in cutlass.range_constexpr(rows // row_stride):
            local = row_tile * rows + gtid // VEC + j * row_stride
            valid.append((local < count) & (tokens > 0))  # (no row to read in an empty x: the op refuses it)
            r = cutlass.min(first + local, mIndex.shape[0] - 1)
            tokens_of.append(cutlass.max(cutlass.min(mIndex[r], tokens - 1), Int32(0)))
        pred = cute.make_rmem_tensor(cute.make_layout((1, 1)), cutlass.Boolean)
        for kt in cutlass.range(k_tiles, unroll=1):
            ab_pipeline.sync_object_empty.wait(state.index, state.phase)
            if tma_warp:
                ab_pipeline.sync_object_full.arrive(state.index, ab_pipeline.producer_mask)  # expects the weights
                cute.copy(tma_atom_w, tWg[(None, kt)], tWs[(None, state.index)],
                          tma_bar_ptr=ab_pipeline.producer_get_barrier(state))
            vec = kt * (TILE_K // VEC) + chunk
            inside = vec * VEC < k
            vec = cutlass.min(vec, k // VEC - 1)
            for j in cutlass.range_constexpr(rows // row_stride):
                pred[0] = valid[j] & inside
                src = gX[(None, None), (tokens_of[j], vec)]
                cute.copy(copy, cute.make_tensor(src.iterator, cute.make_layout(((VEC, 1),), stride=((1, 0),))),
                          tXs[(None, j, 0, state.index)], pred=pred)
            cute.arch.cp_async_mbarrier_arrive_noinc(ab_pipeline.producer_get_barrier(state))
            state.advance()
        return state

    @cute.jit
    def _store_rows(self, sD: cute.Tensor, mD: cute.Tensor, first: Int32, count: Int32, row0: Int32,
                    col_tile: Int32, t: Int32):
        """Subtile sD (epi rows x epi columns) to out rows first + row0 + i (those below first + count)
        and column subtile col_tile (columns below N), in 16-byte vectors, by the tile's epi_threads threads."""
        per_row = self.epi_tile[1] // VEC
        copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mD.element_type, num_bits_per_copy=128),
            cute.make_ordered_layout((self.epi_threads // per_row, per_row), order=(1, 0)), cute.make_layout((1, VEC)))
        thr = copy.get_slice(t)
        gD = cute.local_tile(cute.domain_offset((first + row0, 0), mD), self.epi_tile, (0, col_tile))
        col0 = col_tile * self.epi_tile[1]
        tS = thr.partition_S(sD)
        tD = thr.partition_D(gD)
        tC = thr.partition_D(cute.make_identity_tensor(self.epi_tile))
        for i in cutlass.range_constexpr(cute.size(tS, mode=[1])):
            if (row0 + tC[0, i, 0][0] < count) & (col0 + tC[0, i, 0][1] < mD.shape[1]):
                cute.copy(copy, tS[None, i, None], tD[None, i, None])

    @cute.jit
    def _store_subtile(self, sD: cute.Tensor, mD: cute.Tensor, first: Int32, count: Int32, tile_m: Int32,
                       tile_n: Int32, subtile, t: Int32, slot: Int32):
        """A plain tile's epilogue subtile `subtile` ((row, column) subtile of the tile), just written to
        sD, to out by `_store_rows`, between the barriers that make it whole and free its buffer."""
        self._epi_sync(slot)
        self._store_rows(sD, mD, first, count, tile_m * self.cfg.tile_m + subtile[0] * self.epi_tile[0],
                         tile_n * (self.out_n // self.epi_tile[1]) + subtile[1], t)
        self._epi_sync(slot)

    @cute.jit
    def _row_scales(self, mRowScale: cute.Tensor, tCcO: cute.Tensor, first: Int32, count: Int32, row0: Int32):
        """row_scale of the rows this thread holds in a plain tile ((row half, MMA_M) of its fragment),
        0 for rows past the group (never stored)."""
        scales = cute.make_rmem_tensor((2, cute.size(tCcO, mode=[1])), Float32)
        for mm in cutlass.range_constexpr(cute.size(tCcO, mode=[1])):
            for h in cutlass.range_constexpr(2):
                local = row0 + tCcO[((0, h, 0), mm, 0)][0]
                r = cutlass.min(first + local, mRowScale.shape[0] - 1)
                scales[h, mm] = cutlass.select_(local < count, mRowScale[r], Float32(0.0))
        return scales

    @cute.jit
    def _scale_rows(self, acc: cute.Tensor, scales: cute.Tensor):
        """acc (a plain tile's fragment, ((2 columns, 2 row halves, blocks), MMA_M, MMA_N)) times its rows' scales."""
        for mm in cutlass.range_constexpr(cute.size(acc, mode=[1])):
            for nn in cutlass.range_constexpr(cute.size(acc, mode=[2])):
                for j in cutlass.range_constexpr(cute.size(acc.shape[0][2])):
                    for h in cutlass.range_constexpr(2):
                        for c in cutlass.range_constexpr(2):
                            acc[((c, h, j), mm, nn)] = acc[((c, h, j), mm, nn)] * scales[h, mm]

    @cute.jit
    def _store_swapped_grouped(self, acc: cute.Tensor, tCcD: cute.Tensor, mD: cute.Tensor, mBias, mRowScale,
                               tile_m: Int32, tile_n: Int32, expert: Int32, first: Int32, count: Int32):
        """The dense `_store_swapped` for a group: out^T[n, first + m] for the group's rows m < count,
        the expert's bias (bias [E, N]), the activation (gated: act(gate) * up of the row pairs r, r + 8
        one thread holds), then times row_scale[first + m]."""
        cfg = self.cfg
        if const_expr(cfg.bias != "none"):
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                n_idx = tile_m * cfg.tile_m + tCcD[i][0]
                if n_idx < cute.size(mBias, mode=[1]):
                    acc[i] = acc[i] + mBias[expert, n_idx].to(Float32)
        if const_expr(not cfg.gated):
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                n_idx = tile_m * cfg.tile_m + tCcD[i][0]
                m_idx = tile_n * cfg.tile_n + tCcD[i][1]
                if n_idx < mD.shape[0] and m_idx < count:
                    y = self._act(acc[i])
                    if const_expr(mRowScale is not None):
                        y = y * mRowScale[first + m_idx]
                    mD[n_idx, first + m_idx] = y.to(mD.element_type)
        else:
            for mm in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                for nn in cutlass.range_constexpr(cute.size(acc, mode=[2])):
                    for j in cutlass.range_constexpr(cute.size(acc, mode=[0]) // 4):
                        for c in cutlass.range_constexpr(2):
                            coord = tCcD[(c + 4 * j, mm, nn)]
                            n_idx = tile_m * (cfg.tile_m // 2) + coord[0] // 16 * 8 + coord[0] % 8
                            m_idx = tile_n * cfg.tile_n + coord[1]
                            if n_idx < mD.shape[0] and m_idx < count:
                                y = self._act(acc[(c + 4 * j, mm, nn)]) * acc[(c + 2 + 4 * j, mm, nn)]
                                if const_expr(mRowScale is not None):
                                    y = y * mRowScale[first + m_idx]
                                mD[n_idx, first + m_idx] = y.to(mD.element_type)
