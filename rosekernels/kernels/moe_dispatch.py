"""MoE dispatch on one GPU: group the tokens by expert for a grouped GEMM, in one launch.

`moe_dispatch(x, topk_ids, num_experts)` gives every routed (token, choice) pair a row ("slot") of an
expert-grouped buffer and copies the token there. Expert e owns the rows
offsets[e] .. offsets[e+1]-1: its counts[e] tokens first, then padding up to a multiple of
`block_size` (the grouped GEMM's tile height). Padding rows are left untouched (never written, never
read by `moe_combine`): zeroing them would cost up to E*(block_size-1) row writes per call. In the
decode variant the tokens of an expert are in (token, choice) order; in the prefill variant their order
is not deterministic. slot_map[t, j] (the row of pair (t, j), -1 if the pair is dropped) always agrees
with the buffer.

Tensor parallel (every rank holds all tokens and E/n experts): `local_experts=(first, count)` compiles
the kernel for experts first .. first + count - 1; pairs routed elsewhere get slot -1 (not dropped,
not invalid), so the rank's moe_combine is its partial sum and an all-reduce over the ranks (NCCL, say)
completes the layer.

Everything happens on the device, with no host synchronisation, so the op can be captured in a CUDA
graph: the buffer has a capacity fixed up front; pairs that do not fit are not written, get slot -1
and are counted in `overflow`. Ids outside [-1, E) are counted in `invalid`; if there is any, nothing
is dispatched at all (buffer untouched, slot_map all -1, counts and offsets 0), so a bad routing can
never be mistaken for a good one. `MoeDispatch.check()` turns both counters into exceptions (it
synchronises: not for graphs). The kernel writes every output (nothing is zeroed before the launch).

One kernel, a grid of at most one 1024-thread CTA per SM, in two variants:
- decode (T*k <= 2048 by default, at most 8 per thread): no CTA waits for another. Every CTA routes
  all pairs itself, in shared memory and deterministically, so all agree without talking: warp w
  takes a contiguous run of pairs and counts them per expert in its own row of a [warps, E] table
  (warp-aggregated with match.any: one shared-memory update per distinct expert per warp, in
  program order, no atomics), a scan down each column turns the rows into each warp's first rank
  within the expert, a scan over the experts lays them out. A pair's rank is then the number of
  pairs before it with its expert. CTA 0 writes slot_map and the counts; every CTA copies its share
  of the tokens, whose loads it issued before routing.
- prefill: every CTA routes its own tokens with shared-memory counters and adds its per-expert counts
  to global counters (the old value returned is the CTA's first rank within the expert), all CTAs
  meet at a software grid barrier (cooperative launch: the driver guarantees that all CTAs are
  resident at once), each lays the experts out from the global counts (redundantly: E <= 1024 values
  from L2), then turns its own ranks into slots and copies its own tokens. No second barrier, no
  second launch.
The copy reads each token once (not once per choice) and stores it to its k slots with 128-bit
accesses; every thread keeps `unroll` vectors in flight, the first batch issued before the routing.

The prefill scratch (global counters, grid barrier, invalid count) comes from rosekernels.scratch: zero
before a launch, and the last CTA to leave it returns it to zero before it exits (see `_Dispatch.kernel`),
so eager launches in stream order share one buffer and none is zeroed per call.

The config, the mode rule, the grid, the tuner's search space and the warm-up set are planned in
moe_dispatch_plan.py (no CuTeDSL there); the op (argument checks, launch plans, eager and traced calls)
is rosekernels/ops/moe_dispatch.py.
"""
from __future__ import annotations

import random
from typing import Any, Optional

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32, const_expr

from rosekernels import checks, jit, modes
from rosekernels.kernels.moe_common import MoeDispatch
from rosekernels.kernels.moe_dispatch_plan import (  # noqa: F401  (re-exported: the kernel's contract)
    DECODE_PAIRS_LIMIT, DECODE_PAIRS_PER_THREAD, DEFAULT_BLOCK_SIZE, MODELS, OP, THREADS, DispatchConfig,
    DispatchShape, candidates, choose_mode, config_for, default_capacity, expert_range, meta_layout, num_ctas, rank,
    token_range, variants_for)
from rosekernels.workload import Workload

Config, Shape = DispatchConfig, DispatchShape
# Prefill workspace (int32): the barrier counter and the invalid count on 128-byte lines of their own
# (the barrier is polled while the per-expert counters take atomics), then one counter per expert.
WS_SYNC, WS_INVALID, WS_RAW = 0, 32, 64
WS_INTS = WS_RAW + THREADS
_FULL = 0xFFFFFFFF


class _Dispatch:
    """Host launcher and device body of one DispatchConfig."""

    def __init__(self, cfg: DispatchConfig):
        self.cfg = cfg
        self.E, self.k, self.nt, self.unroll = cfg.num_experts, cfg.topk, cfg.threads, cfg.unroll
        self.nw = cfg.threads // 32
        self.vec, self.hv = cfg.vec, cfg.hidden // cfg.vec  # 16-byte vectors per row
        self.decode = cfg.mode == "decode"
        self.m = meta_layout(cfg.num_experts)
        self.ranged, self.first, self.total = cfg.ranged, cfg.expert_first, cfg.total_experts

    @cute.jit
    def __call__(self, mX: cute.Tensor, mIds: cute.Tensor, mBuf: cute.Tensor, mSlot: cute.Tensor,
                 mMeta: cute.Tensor, mWs: Optional[cute.Tensor], block_size: Int32, num_ctas: Int32, stream):
        # prefill is cooperative: the driver guarantees that all CTAs are resident at once (they wait
        # for each other at the grid barrier); decode CTAs never wait for each other.
        self.kernel(mX, mIds, mBuf, mSlot, mMeta, mWs, block_size).launch(
            grid=[num_ctas, 1, 1], block=[self.nt, 1, 1], cooperative=not self.decode, stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mIds: cute.Tensor, mBuf: cute.Tensor, mSlot: cute.Tensor,
               mMeta: cute.Tensor, mWs: Optional[cute.Tensor], block_size: Int32):
        E, k, nt, hv = self.E, self.k, self.nt, self.hv
        tid = cute.arch.thread_idx()[0]
        bid = cute.arch.block_idx()[0]
        grid = cute.arch.grid_dim()[0]
        num_tokens = mX.shape[0]
        num_pairs = num_tokens * k
        capacity = mBuf.shape[0]

        smem = cutlass.memory.SmemAllocator()
        s_cnt = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        s_off = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        s_stored = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        s_warp = smem.allocate_tensor(Int32, cute.make_layout(32), byte_alignment=16)
        s_misc = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)  # see below
        s_pair = None  # decode: rank, then slot, of every pair
        s_tab = None  # decode: [warps, E] per-warp counts, then each warp's first rank within the expert
        s_base = None  # prefill: this CTA's first rank within each expert
        if const_expr(self.decode):
            s_pair = smem.allocate_tensor(Int32, cute.make_layout(DECODE_PAIRS_PER_THREAD * nt),
                                          byte_alignment=16)
            row = E + 1 - E % 2  # odd row stride: a warp reading a column hits 32 different banks
            s_tab = smem.allocate_tensor(Int32, cute.make_layout((self.nw, E), stride=(row, 1)),
                                         byte_alignment=16)
        else:
            s_base = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)

        # This CTA's share of the copy, in the flattened (token, vector) space [i0, i1).
        t0 = Int32(0)
        t1 = Int32(0)
        i0 = Int32(0)
        i1 = Int32(0)
        if const_expr(self.decode):
            n = num_tokens * hv
            i0 = Int32(Int64(bid) * Int64(n) // Int64(grid))
            i1 = Int32(Int64(bid + 1) * Int64(n) // Int64(grid))
        else:
            t0 = Int32(Int64(bid) * Int64(num_tokens) // Int64(grid))
            t1 = Int32(Int64(bid + 1) * Int64(num_tokens) // Int64(grid))
            i0 = t0 * hv
            i1 = t1 * hv

        gX = cute.zipped_divide(mX, (1, self.vec))  # ((1, vec), (T, hv))
        gBuf = cute.zipped_divide(mBuf, (1, self.vec))
        frag = cute.make_rmem_tensor(((1, self.vec), self.unroll), mX.element_type)
        self.load_batch(gX, frag, i0, i1, Int32(0), tid)  # in flight while the routing runs

        # s_misc: [0] invalid ids seen by this CTA, [1] pairs over capacity, [2] last CTA to leave
        # the prefill scratch, [3] the grid's invalid count
        if tid < E:
            s_cnt[tid] = 0
        if tid < 4:
            s_misc[tid] = 0
        cute.arch.sync_threads()

        left = Int32(0)
        if const_expr(self.decode):
            per_warp = self.rank_decode(mIds, s_pair, s_tab, s_cnt, s_misc, num_pairs, tid)
            n_invalid = s_misc[0]
            self.layout(s_cnt, s_off, s_stored, s_warp, s_misc, mMeta, block_size, capacity,
                        n_invalid, bid == 0, tid)
            # Slots of the pairs of this CTA's tokens; CTA 0 does them all and writes slot_map.
            p0 = Int32(0)
            p1 = num_pairs
            if bid > 0:
                p0 = i0 // hv * k
                p1 = (i1 + hv - 1) // hv * k
            self.finalize_decode(mSlot, s_pair, s_tab, s_off, s_stored, p0, p1, per_warp, n_invalid,
                                 bid == 0, tid)
        else:
            ws = mWs.iterator
            p0 = t0 * k
            p1 = t1 * k
            self.count(mIds, mSlot, s_cnt, s_misc, p0, p1, tid)
            cute.arch.sync_threads()
            if tid < E:
                c = s_cnt[tid]
                if c > 0:  # the old value is this CTA's base within the expert
                    s_base[tid] = cute.arch.atomic_add(ws + (WS_RAW + tid), c, sem="relaxed", scope="gpu")
            if tid == 0:
                if s_misc[0] > 0:
                    cute.arch.atomic_add(ws + WS_INVALID, s_misc[0], sem="relaxed", scope="gpu")
            self.grid_barrier(ws + WS_SYNC, grid, tid)
            if tid < E:
                s_cnt[tid] = cute.arch.load(ws + (WS_RAW + tid), Int32, sem="relaxed", scope="gpu")
            if tid == 0:
                s_misc[3] = cute.arch.load(ws + WS_INVALID, Int32, sem="relaxed", scope="gpu")
            cute.arch.sync_threads()
            # Every read of the scratch by this CTA has returned (its value is in shared memory,
            # before the barrier above): leave it. The counter went to `grid` at the grid barrier;
            # the CTA that brings it to 2 * grid is the last to leave and zeroes the scratch at
            # the end. Relaxed: nothing waits for the old value until then.
            if tid == 0:
                left = cute.arch.atomic_add(ws + WS_SYNC, Int32(1), sem="relaxed", scope="gpu")
            n_invalid = s_misc[3]
            self.layout(s_cnt, s_off, s_stored, s_warp, s_misc, mMeta, block_size, capacity,
                        n_invalid, bid == 0, tid)
            self.finalize_prefill(mIds, mSlot, s_base, s_off, s_stored, p0, p1, n_invalid, tid)
        cute.arch.sync_threads()  # the slots, written by other threads, are read below

        num_batches = (i1 - i0 + nt * self.unroll - 1) // (nt * self.unroll)
        for b in cutlass.range(num_batches):
            if b > 0:
                self.load_batch(gX, frag, i0, i1, b, tid)
            self.store_batch(gBuf, mSlot, s_pair, frag, i0, i1, b, tid)

        if const_expr(not self.decode):
            if tid == 0:
                s_misc[2] = Int32(left == 2 * grid - 1)
            cute.arch.sync_threads()
            if s_misc[2] != 0:  # every CTA has read the scratch: zero it for the next launch
                if tid == 0:
                    cute.arch.fence_acq_rel_gpu()
                cute.arch.sync_threads()
                if tid < E:
                    mWs[WS_RAW + tid] = 0
                if tid == 0:
                    mWs[WS_INVALID] = 0
                    mWs[WS_SYNC] = 0

    @cute.jit
    def load_batch(self, gX: cute.Tensor, frag: cute.Tensor, i0: Int32, i1: Int32, b: Int32, tid: Int32):
        for u in cutlass.range_constexpr(self.unroll):
            i = i0 + (b * self.unroll + u) * self.nt + tid
            if i < i1:
                t = i // self.hv
                cute.autovec_copy(gX[(None, None), (t, i - t * self.hv)], frag[(None, None), u])

    @cute.jit
    def store_batch(self, gBuf: cute.Tensor, mSlot: cute.Tensor, s_pair: Optional[cute.Tensor], frag: cute.Tensor,
                    i0: Int32, i1: Int32, b: Int32, tid: Int32):
        for u in cutlass.range_constexpr(self.unroll):
            i = i0 + (b * self.unroll + u) * self.nt + tid
            if i < i1:
                t = i // self.hv
                v = i - t * self.hv
                # The k slot loads before the first store: a store in between could alias them for the
                # compiler, which would then wait for each load separately.
                slots = cute.make_rmem_tensor((self.k,), Int32)
                for j in cutlass.range_constexpr(self.k):
                    if const_expr(self.decode):
                        slots[j] = s_pair[t * self.k + j]
                    else:
                        slots[j] = mSlot[t, j]
                for j in cutlass.range_constexpr(self.k):
                    if slots[j] >= 0:
                        cute.autovec_copy(frag[(None, None), u], gBuf[(None, None), (slots[j], v)])

    @cute.jit
    def rank_decode(self, mIds: cute.Tensor, s_pair: cute.Tensor, s_tab: cute.Tensor, s_cnt: cute.Tensor,
                    s_misc: cute.Tensor, num_pairs: Int32, tid: Int32) -> Int32:
        """Every pair's rank within its expert, the same in every CTA: warp w owns pairs
        [w * per_warp, (w + 1) * per_warp), 32 per step; s_tab[w, e] counts its pairs of expert e
        (in the order of the steps, lanes in order within a step) and becomes, after a scan down the
        column, the number of pairs of e that earlier warps own. s_pair[p] = expert << 16 | rank
        within the warp (-1: not routed); per-expert totals -> s_cnt; ids outside [-1, E) ->
        s_misc[0]. Returns per_warp."""
        E, k, nw = self.E, self.k, self.nw
        lane = tid % 32
        warp = tid // 32
        per_warp = (num_pairs + nw * 32 - 1) // (nw * 32) * 32
        first = warp * per_warp
        ids = cute.make_rmem_tensor((DECODE_PAIRS_PER_THREAD,), Int32)
        for i in cutlass.range_constexpr(DECODE_PAIRS_PER_THREAD):  # all loads in flight at once
            p = first + i * 32 + lane
            ids[i] = -1
            if (i * 32 < per_warp) & (p < num_pairs):
                t = p // k
                ids[i] = mIds[t, p - t * k]
        for c in cutlass.range_constexpr((E + 31) // 32):
            if c * 32 + lane < E:
                s_tab[warp, c * 32 + lane] = 0
        cute.arch.sync_warp()
        lower = (Uint32(1) << Uint32(lane)) - Uint32(1)
        for i in cutlass.range_constexpr(DECODE_PAIRS_PER_THREAD):
            if i * 32 < per_warp:  # uniform across the warp: match.any needs every lane
                p = first + i * 32 + lane
                e = self.local(ids[i])
                inside = p < num_pairs
                valid = inside & (e >= 0) & (e < E)
                peers = cute.arch.match_sync(_FULL, cutlass.select_(valid, e, Int32(E) + lane))
                lane_rank = Int32(cute.arch.popc(peers & lower))
                leader = Int32(31) - Int32(cute.arch.clz(peers & (Uint32(0) - peers)))
                before = Int32(0)
                if valid & (lane_rank == 0):  # one lane per expert in the step: no atomics needed
                    before = s_tab[warp, e]
                    s_tab[warp, e] = before + Int32(cute.arch.popc(peers))
                before = cute.arch.shuffle_sync(before, leader)
                cute.arch.sync_warp()  # this step's counts before the next step reads them
                if inside:
                    s_pair[p] = cutlass.select_(valid, (e << 16) | (before + lane_rank), -1)
                    if self.invalid(ids[i], e, valid):
                        cute.arch.atomic_add(s_misc.iterator, Int32(1), scope="cta")
        cute.arch.sync_threads()
        # Warp w scans columns w, w + nw, ... (lane = table row), unrolled so that the scans of
        # different columns overlap; past the last column a warp scans zeros (its shuffles keep the
        # warp converged) and reads nothing: reading another warp's column while that warp rewrites
        # it was a race (harmless, the value was dropped, but racecheck rightly reported it).
        for col in cutlass.range_constexpr((E + nw - 1) // nw):
            e = warp + col * nw
            c = Int32(0)
            if (lane < nw) & (e < E):
                c = s_tab[lane, e]
            incl = self.warp_inclusive_scan(c, lane)
            if e < E:
                if lane < nw:
                    s_tab[lane, e] = incl - c
                if lane == 31:
                    s_cnt[e] = incl
        cute.arch.sync_threads()
        return per_warp

    @cute.jit
    def local(self, e: Int32) -> Int32:
        """An expert id as this kernel's expert index (ranged: another rank's expert falls outside [0, E))."""
        if const_expr(self.ranged):
            return e - self.first
        return e

    @cute.jit
    def invalid(self, raw: Int32, e: Int32, valid: cutlass.Boolean) -> cutlass.Boolean:
        """Whether id `raw` (e = local(raw), `valid`: routed here) is outside [-1, experts_total)."""
        if const_expr(self.ranged):
            return (raw < -1) | (raw >= self.total)
        return (e != -1) & ~valid

    @cute.jit
    def finalize_decode(self, mSlot: cute.Tensor, s_pair: cute.Tensor, s_tab: cute.Tensor, s_off: cute.Tensor,
                        s_stored: cute.Tensor, p0: Int32, p1: Int32, per_warp: Int32, n_invalid: Int32,
                        write: cutlass.Boolean, tid: Int32):
        """s_pair[p] -> slot (or -1: not routed, does not fit, or the routing is invalid) for p in
        [p0, p1); `write`: to slot_map too."""
        k = self.k
        for base in cutlass.range(p0, p1, self.nt):
            p = base + tid
            if p < p1:
                packed = s_pair[p]
                s = Int32(-1)
                if (packed >= 0) & (n_invalid == 0):
                    e = packed >> 16
                    r = (packed & 0xFFFF) + s_tab[p // per_warp, e]
                    if r < s_stored[e]:
                        s = s_off[e] + r
                s_pair[p] = s
                if write:
                    t = p // k
                    mSlot[t, p - t * k] = s

    @cute.jit
    def count(self, mIds: cute.Tensor, mSlot: cute.Tensor, s_cnt: cute.Tensor, s_misc: cute.Tensor,
              p0: Int32, p1: Int32, tid: Int32):
        """Rank of each pair in [p0, p1) among this CTA's pairs of its expert (-1: not routed) ->
        mSlot; per-expert totals -> s_cnt; ids outside [-1, E) -> s_misc[0]. Ranks are
        warp-aggregated (match.any: one shared atomic per distinct expert per warp), so a hot expert
        does not serialise the CTA."""
        E, k = self.E, self.k
        lane = tid % 32
        lower = (Uint32(1) << Uint32(lane)) - Uint32(1)
        for base in cutlass.range(p0, p1, self.nt):
            p = base + tid
            t = p // k
            j = p - t * k
            raw = Int32(-1)
            if p < p1:
                raw = mIds[t, j]
            e = self.local(raw)
            valid = (p < p1) & (e >= 0) & (e < E)
            peers = cute.arch.match_sync(_FULL, cutlass.select_(valid, e, Int32(E) + lane))
            lane_rank = cute.arch.popc(peers & lower)
            leader = Int32(31) - Int32(cute.arch.clz(peers & (Uint32(0) - peers)))
            first = Int32(0)
            if valid & (lane_rank == 0):
                first = cute.arch.atomic_add(s_cnt.iterator + e, Int32(cute.arch.popc(peers)), scope="cta")
            first = cute.arch.shuffle_sync(first, leader)
            if p < p1:
                mSlot[t, j] = cutlass.select_(valid, first + Int32(lane_rank), -1)
            if (p < p1) & self.invalid(raw, e, valid):
                cute.arch.atomic_add(s_misc.iterator, Int32(1), scope="cta")

    @cute.jit
    def finalize_prefill(self, mIds: cute.Tensor, mSlot: cute.Tensor, s_base: cute.Tensor, s_off: cute.Tensor,
                         s_stored: cute.Tensor, p0: Int32, p1: Int32, n_invalid: Int32, tid: Int32):
        """Rank -> slot (or -1 when the pair is not routed, does not fit, or the routing is invalid)."""
        E, k = self.E, self.k
        for base in cutlass.range(p0, p1, self.nt):
            p = base + tid
            if p < p1:
                t = p // k
                j = p - t * k
                r = mSlot[t, j]
                s = Int32(-1)
                if (r >= 0) & (n_invalid == 0):
                    e = self.local(mIds[t, j])
                    # The id is read again, and one rewritten since count() (a peer's arena written out of
                    # turn, after an error) must still give a slot in [0, capacity), never an index past
                    # the experts (s_off[e] + s_stored[e] <= capacity; s_base[e] may be unset then).
                    if (e >= 0) & (e < E):
                        r = r + s_base[e]
                        if (r >= 0) & (r < s_stored[e]):
                            s = s_off[e] + r
                mSlot[t, j] = s

    @cute.jit
    def layout(self, s_cnt: cute.Tensor, s_off: cute.Tensor, s_stored: cute.Tensor, s_warp: cute.Tensor,
               s_misc: cute.Tensor, mMeta: cute.Tensor, block_size: Int32, capacity: Int32,
               n_invalid: Int32, writer: cutlass.Boolean, tid: Int32):
        """Counts -> padded exclusive prefix sum (one expert per thread) -> each expert's first row and
        how many of its pairs fit; the writer CTA stores counts, offsets, overflow and invalid."""
        E, m = self.E, self.m
        num_warps = self.nw
        lane = tid % 32
        warp = tid // 32
        cnt = Int32(0)
        if tid < E:
            cnt = s_cnt[tid]
        pad = (cnt + block_size - 1) // block_size * block_size
        incl = self.warp_inclusive_scan(pad, lane)
        if lane == 31:
            s_warp[warp] = incl
        cute.arch.sync_threads()
        if warp == 0:
            w = Int32(0)
            if lane < num_warps:
                w = s_warp[lane]
            w = self.warp_inclusive_scan(w, lane)
            s_warp[lane] = w
        cute.arch.sync_threads()
        start = incl - pad
        if warp > 0:
            start = start + s_warp[warp - 1]
        ok = n_invalid == 0
        if tid < E:
            off = cutlass.min(start, capacity)
            stored = cutlass.min(cnt, cutlass.min(start + pad, capacity) - off)
            s_off[tid] = off
            s_stored[tid] = stored
            if cnt > stored:
                cute.arch.atomic_add(s_misc.iterator + 1, cnt - stored, scope="cta")
            if writer:
                mMeta[m["counts"] + tid] = cutlass.select_(ok, stored, 0)
                mMeta[m["offsets"] + tid] = cutlass.select_(ok, off, 0)
        cute.arch.sync_threads()
        if writer & (tid == 0):
            mMeta[m["offsets"] + E] = cutlass.select_(ok, cutlass.min(s_warp[num_warps - 1], capacity), 0)
            mMeta[m["overflow"]] = cutlass.select_(ok, s_misc[1], 0)
            mMeta[m["invalid"]] = n_invalid

    @cute.jit
    def warp_inclusive_scan(self, x: Int32, lane: Int32) -> Int32:
        for d in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_up(x, 1 << d)
            if lane >= (1 << d):
                x = x + y
        return x

    @cute.jit
    def grid_barrier(self, counter: cute.Pointer, grid: Int32, tid: Int32):
        """All CTAs are resident (cooperative launch), so spinning cannot deadlock. The counter only
        grows during a launch (CTAs leaving add to it too), so `>= grid` is the exit test."""
        cute.arch.sync_threads()
        if tid == 0:
            arrived = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu") + 1
            while arrived < grid:
                arrived = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        cute.arch.sync_threads()


def _fake_args(cfg: DispatchConfig) -> tuple:
    dt = checks.cute_dtype(cfg.dtype)
    tokens, rows = cute.sym_int(), cute.sym_int()
    x = cute.runtime.make_fake_tensor(dt, (tokens, cfg.hidden), (cute.sym_int64(divisibility=cfg.vec), 1),
                                      assumed_align=16)
    ids = cute.runtime.make_fake_tensor(Int32, (tokens, cfg.topk), (cute.sym_int64(), 1), assumed_align=4)
    buf = cute.runtime.make_fake_tensor(dt, (rows, cfg.hidden), (cute.sym_int64(divisibility=cfg.vec), 1),
                                        assumed_align=16)
    slot = cute.runtime.make_fake_compact_tensor(Int32, (tokens, cfg.topk), stride_order=(1, 0),
                                                 assumed_align=4)
    meta = cute.runtime.make_fake_compact_tensor(Int32, (meta_layout(cfg.num_experts)["size"],),
                                                 assumed_align=4)
    ws = None if cfg.mode == "decode" else cute.runtime.make_fake_compact_tensor(Int32, (WS_INTS,),
                                                                                   assumed_align=16)
    return (x, ids, buf, slot, meta, ws, Int32(1), Int32(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))


def compile(config: DispatchConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config`: fn(x, topk_ids, buffer, slot_map, meta, workspace, block_size,
    num_ctas); workspace: None for decode, an int32 [WS_INTS] tensor of zeros for prefill (the kernel
    leaves it zero)."""
    return jit.compile_variant(config.variant(), lambda: (_Dispatch(config), _fake_args(config)))


def precompile(configs=None, processes: int | None = None) -> list[jit.CompiledKernel]:
    """compile() of each config (default: variants_for()), the cold ones first compiled in parallel
    processes into the disk cache (jit.precompile)."""
    return jit.precompile(compile, variants_for() if configs is None else configs, processes)


# ---------------------------------------------------------------------------------------------
# Inputs and checks: tests, benchmark, the SIP tuner.

def random_topk_ids(num_tokens: int, num_experts: int, topk: int, generator: torch.Generator | None = None,
                    device: Any = "cpu") -> torch.Tensor:
    """A realistic routing: k distinct experts per token, from random logits."""
    logits = torch.rand(num_tokens, num_experts, generator=generator)
    return logits.topk(topk, dim=1).indices.to(device=device, dtype=torch.int32)


def workload(config: DispatchConfig, shape: DispatchShape) -> Workload:
    """`config`'s kernel fed with `shape.tokens` tokens (make_args) or a random count of
    `token_range(config)` (test_args): args (x, topk_ids, buffer, slot_map, meta, workspace,
    block_size, num_ctas), random x and routing, the default capacity, buffer, slot_map and meta
    poisoned (the kernel writes them all). `launch` zeroes the workspace first: a kernel leaves it
    zero, but a broken candidate of the SIP tuner must not poison the launches after it."""
    if (shape.hidden, shape.experts, shape.topk, shape.dtype) != \
            (config.hidden, config.total_experts, config.topk, config.dtype):
        raise ValueError(f"{shape} does not have the sizes of {config}")

    def zero_then_launch(fn: Any, args: tuple) -> None:
        if args[5] is not None:
            args[5].zero_()
        fn(*args)

    def check(args: tuple) -> float:
        x, ids, buffer, slot_map, meta, ws, block_size = args[:7]
        check_dispatch(x, ids, config.total_experts, block_size,
                       MoeDispatch(buffer, slot_map, meta), (config.expert_first, config.num_experts))
        assert ws is None or not ws.any(), "the workspace was not returned to zero"
        return 0.0  # exact

    return Workload(compile(config), lambda seed: _args(config, shape.tokens, seed), outputs=_outputs,
                    check=check, launch=zero_then_launch, name=OP,
                    test_args=lambda seed: _args(config, random.Random(seed).randint(*token_range(config)), seed))


def _args(cfg: DispatchConfig, tokens: int, seed: int) -> tuple:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden, generator=g).to(device="cuda", dtype=checks.TORCH_DTYPE[cfg.dtype])
    ids = random_topk_ids(tokens, cfg.total_experts, cfg.topk, g, "cuda")
    capacity = default_capacity(tokens, cfg.topk, cfg.num_experts, DEFAULT_BLOCK_SIZE)
    buffer = torch.full((capacity, cfg.hidden), float("nan"), dtype=x.dtype, device="cuda")
    slot_map = torch.full(ids.shape, -7, dtype=torch.int32, device="cuda")
    meta = torch.full((meta_layout(cfg.num_experts)["size"],), -7, dtype=torch.int32, device="cuda")
    ws = None if cfg.mode == "decode" else torch.zeros(WS_INTS, dtype=torch.int32, device="cuda")
    grid = num_ctas(cfg, tokens, modes.sm_count(x.device.index))
    return x, ids, buffer, slot_map, meta, ws, DEFAULT_BLOCK_SIZE, grid


def _outputs(args: tuple) -> list[torch.Tensor]:
    """The outputs of a launch in a canonical form that does not depend on the (free) order of the
    tokens within an expert: counts/offsets/overflow/invalid, each pair's buffer row (zeros when
    dropped), and the sorted slots."""
    x, ids, buffer, slot_map, meta = args[:5]
    s = slot_map.long()
    rows = torch.where((s >= 0)[..., None], buffer[s.clamp(0, max(buffer.shape[0] - 1, 0))], 0)
    return [meta, rows, s.flatten().sort().values]


def check_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, block_size: int,
                   result: MoeDispatch, local_experts: tuple[int, int] | None = None) -> None:
    """Raise AssertionError unless `result` is a correct dispatch of (x, topk_ids) (synchronises);
    local_experts as moe_dispatch's."""
    first, E = expert_range(num_experts, local_experts)
    C = result.buffer.shape[0]
    raw = topk_ids.reshape(-1).long()
    slots = result.slot_map.reshape(-1).long()
    n_invalid = int(((raw < -1) | (raw >= num_experts)).sum())
    assert int(result.invalid) == n_invalid, f"invalid: {int(result.invalid)} != {n_invalid}"
    if n_invalid:
        assert not result.counts.any() and not result.offsets.any() and int(result.overflow) == 0
        assert (slots == -1).all(), "slots written for an invalid routing"
        return
    ids = torch.where((raw >= first) & (raw < first + E), raw - first, -1)  # other ranks' experts: not routed
    routed = ids >= 0
    cnt = torch.bincount(ids[routed], minlength=E)
    pad = (cnt + block_size - 1) // block_size * block_size
    start = torch.cumsum(pad, 0) - pad
    off = start.clamp(max=C)
    stored = torch.minimum(cnt, (start + pad).clamp(max=C) - off)
    assert torch.equal(result.counts.long(), stored), "counts"
    assert torch.equal(result.offsets[:E].long(), off), "offsets"
    assert int(result.offsets[E]) == min(int(pad.sum()), C), "offsets[E]"
    assert int(result.overflow) == int((cnt - stored).sum()), "overflow"
    assert (slots[~routed] == -1).all(), "a slot for a pair that is not routed"
    placed = slots >= 0
    e = ids[placed]
    assert torch.equal(torch.bincount(e, minlength=E), stored), "pairs placed per expert"
    s = slots[placed]
    assert ((s >= off[e]) & (s < off[e] + stored[e])).all(), "a slot outside its expert's rows"
    assert torch.unique(s).numel() == s.numel(), "two pairs share a slot"
    tokens = torch.arange(ids.numel(), device=ids.device)[placed] // topk_ids.shape[1]
    assert torch.equal(result.buffer[s], x[tokens]), "buffer rows differ from their tokens"
