"""MoE dispatch on one GPU (TP=1): group the tokens by expert for a grouped GEMM, in one launch.

`moe_dispatch(x, topk_ids, num_experts)` gives every routed (token, choice) pair a row ("slot") of an
expert-grouped buffer and copies the token there. Expert e owns the rows
offsets[e] .. offsets[e+1]-1: its counts[e] tokens first, then padding up to a multiple of
`block_size` (the grouped GEMM's tile height). Padding rows are left untouched (never written, never
read by `moe_combine`): zeroing them would cost up to E*(block_size-1) row writes per call. The order of
the tokens within an expert is not deterministic; slot_map[t, j] (the row of pair (t, j), -1 if the
pair is dropped) always agrees with the buffer.

Everything happens on the device, with no host synchronisation, so the op can be captured in a CUDA
graph: the buffer has a capacity fixed up front; pairs that do not fit are not written, get slot -1
and are counted in `overflow`. Ids outside [-1, E) are counted in `invalid`; if there is any, nothing
is dispatched at all (buffer untouched, slot_map all -1, counts and offsets 0), so a bad routing can
never be mistaken for a good one. `MoeDispatch.check()` turns both counters into exceptions (it
synchronises: not for graphs).

One kernel, a persistent grid of at most one 1024-thread CTA per SM, launched cooperatively (the driver
guarantees that all CTAs are resident at once, so they may wait for each other), in two variants:
- decode (T*k <= 2048 by default, at most 8192): CTA 0 routes every pair in shared memory (counts,
  ranks, the layout scan, the slots), writes slot_map, then releases a flag in global memory; the other
  CTAs load their share of x meanwhile, spin on the flag (acquire), read their slots and copy.
- prefill: every CTA routes its own tokens with shared-memory counters and adds its per-expert counts
  to global counters (the old value returned is the CTA's first rank within the expert), all CTAs
  meet at a software grid barrier, each lays the experts out from the global counts (redundantly:
  E <= 1024 values from L2), then turns its own ranks into slots and copies its own tokens. No second
  barrier, no second launch.
Ranks are warp-aggregated (match.any: one shared atomic per distinct expert per warp), so a hot expert
does not serialise the CTA.
The copy reads each token once (not once per choice) and stores it to its k slots with 128-bit
accesses; every thread keeps `unroll` vectors in flight, the first batch issued before the routing.

Scratch counters (global counts, barrier, flag) live behind the outputs in the same int32 tensor,
zeroed by the op in the same stream before the launch: no state survives a call.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

from rosekernels import jit  # first: it selects sm_90a before CuTeDSL is imported

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import torch  # noqa: E402
from cutlass import Int32, Int64, Uint32, const_expr  # noqa: E402

from rosekernels import checks  # noqa: E402

OP = "moe_dispatch"
THREADS = 1024  # one expert per thread in the layout scan: num_experts <= THREADS
UNROLL = 4  # 16-byte vectors per thread in flight in the copy
DECODE_MAX_PAIRS = 2048  # T*k at or below this: routing in one CTA (decode), above: in all CTAs
DECODE_PAIRS_LIMIT = 8192  # the decode variant's routing CTA keeps every pair in shared memory (32 KB)
DECODE_VECS_PER_CTA = 256  # decode: spread the copy so that each CTA moves at least this many vectors
DEFAULT_BLOCK_SIZE = 128  # tile height of a Hopper grouped GEMM
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def meta_layout(num_experts: int) -> dict[str, int]:
    """Offsets into the int32 `meta` tensor: outputs first, then the scratch zeroed before each call."""
    e = num_experts
    return {"counts": 0, "offsets": e, "overflow": 2 * e + 1, "invalid": 2 * e + 2,
            "raw": 2 * e + 3, "sync": 3 * e + 3, "invalid_acc": 3 * e + 4, "size": 3 * e + 5}


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """Everything a compiled dispatch kernel is specialised on (all runtime sizes stay dynamic)."""

    dtype: str  # "bf16" | "fp16" | "fp32", of x and the buffer
    hidden: int
    num_experts: int
    topk: int
    mode: str  # "prefill" | "decode"
    threads: int = THREADS
    unroll: int = UNROLL

    def __post_init__(self) -> None:
        if self.dtype not in _ELEM_BYTES:
            raise ValueError(f"dtype must be one of {sorted(_ELEM_BYTES)}, got {self.dtype!r}")
        if self.hidden <= 0 or self.hidden % self.vec:
            raise ValueError(f"hidden size must be a positive multiple of {self.vec} (16 bytes) "
                             f"for {self.dtype}, got {self.hidden}")
        if not 1 <= self.num_experts <= self.threads:
            raise ValueError(f"num_experts must be in [1, {self.threads}], got {self.num_experts}")
        if not 1 <= self.topk <= 64:
            raise ValueError(f"top-k must be in [1, 64], got {self.topk}")
        if self.mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be 'prefill' or 'decode', got {self.mode!r}")
        if self.threads % 32 or not 32 <= self.threads <= 1024 or self.unroll < 1:
            raise ValueError(f"bad launch shape: threads={self.threads}, unroll={self.unroll}")

    @property
    def vec(self) -> int:
        return 16 // _ELEM_BYTES[self.dtype]

    def variant(self) -> jit.Variant:
        return jit.Variant.of(OP, self.mode, dtype=self.dtype, hidden=self.hidden,
                              experts=self.num_experts, topk=self.topk, threads=self.threads,
                              unroll=self.unroll)

    @classmethod
    def from_variant(cls, variant: jit.Variant) -> "DispatchConfig":
        p = dict(variant.params)
        return cls(p["dtype"], p["hidden"], p["experts"], p["topk"], variant.mode, p["threads"], p["unroll"])


_ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_CUTE_DTYPE = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
TORCH_DTYPE = {checks.DTYPE_NAME[d]: d for d in DTYPES}


class _Dispatch:
    """Host launcher and device body of one DispatchConfig."""

    def __init__(self, cfg: DispatchConfig):
        self.cfg = cfg
        self.E, self.k, self.nt, self.unroll = cfg.num_experts, cfg.topk, cfg.threads, cfg.unroll
        self.vec, self.hv = cfg.vec, cfg.hidden // cfg.vec  # 16-byte vectors per row
        self.decode = cfg.mode == "decode"
        self.m = meta_layout(cfg.num_experts)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mIds: cute.Tensor, mBuf: cute.Tensor, mSlot: cute.Tensor,
                 mMeta: cute.Tensor, block_size: Int32, num_ctas: Int32, stream):
        # Cooperative: the driver guarantees that all CTAs are resident at once (they wait for each other).
        self.kernel(mX, mIds, mBuf, mSlot, mMeta, block_size).launch(
            grid=[num_ctas, 1, 1], block=[self.nt, 1, 1], cooperative=True, stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mIds: cute.Tensor, mBuf: cute.Tensor, mSlot: cute.Tensor,
               mMeta: cute.Tensor, block_size: Int32):
        E, k, nt, hv = self.E, self.k, self.nt, self.hv
        tid = cute.arch.thread_idx()[0]
        bid = cute.arch.block_idx()[0]
        grid = cute.arch.grid_dim()[0]
        num_tokens = mX.shape[0]
        capacity = mBuf.shape[0]

        smem = cutlass.memory.SmemAllocator()
        s_cnt = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        s_off = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        s_stored = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        s_warp = smem.allocate_tensor(Int32, cute.make_layout(32), byte_alignment=16)
        s_misc = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)  # invalid, overflow
        s_pair = None  # decode: (expert << 16 | rank) of every pair, -1 if not routed
        s_base = None  # prefill: this CTA's first rank within each expert
        if const_expr(self.decode):
            s_pair = smem.allocate_tensor(Int32, cute.make_layout(DECODE_PAIRS_LIMIT), byte_alignment=16)
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

        if tid < E:
            s_cnt[tid] = 0
        if tid < 4:
            s_misc[tid] = 0
        cute.arch.sync_threads()

        if const_expr(self.decode):
            if bid == 0:
                self.count(mIds, mSlot, s_pair, s_cnt, s_misc, Int32(0), num_tokens * k, tid)
                cute.arch.sync_threads()
                n_invalid = s_misc[0]
                self.layout(s_cnt, s_off, s_stored, s_warp, s_misc, mMeta, block_size, capacity,
                            n_invalid, True, tid)
                self.finalize(mIds, mSlot, s_pair, s_base, s_off, s_stored, Int32(0), num_tokens * k,
                              n_invalid, tid)
                cute.arch.sync_threads()
                if tid == 0:  # release: every write of this CTA (ordered by the barrier) before the flag
                    cute.arch.store(mMeta.iterator + self.m["sync"], Int32(1), sem="release", scope="gpu")
            else:
                if tid == 0:
                    flag = cute.arch.load(mMeta.iterator + self.m["sync"], Int32, sem="acquire", scope="gpu")
                    while flag == 0:
                        flag = cute.arch.load(mMeta.iterator + self.m["sync"], Int32, sem="acquire",
                                              scope="gpu")
                cute.arch.sync_threads()
        else:
            p0 = t0 * k
            p1 = t1 * k
            self.count(mIds, mSlot, s_pair, s_cnt, s_misc, p0, p1, tid)
            cute.arch.sync_threads()
            if tid < E:
                c = s_cnt[tid]
                if c > 0:  # the old value is this CTA's base within the expert
                    s_base[tid] = cute.arch.atomic_add(mMeta.iterator + (self.m["raw"] + tid), c,
                                                       sem="relaxed", scope="gpu")
            if tid == 0:
                if s_misc[0] > 0:
                    cute.arch.atomic_add(mMeta.iterator + self.m["invalid_acc"], s_misc[0],
                                         sem="relaxed", scope="gpu")
            self.grid_barrier(mMeta.iterator + self.m["sync"], grid, tid)
            if tid < E:
                s_cnt[tid] = cute.arch.load(mMeta.iterator + (self.m["raw"] + tid), Int32,
                                            sem="relaxed", scope="gpu")
            n_invalid = cute.arch.load(mMeta.iterator + self.m["invalid_acc"], Int32, sem="relaxed",
                                       scope="gpu")
            cute.arch.sync_threads()
            self.layout(s_cnt, s_off, s_stored, s_warp, s_misc, mMeta, block_size, capacity,
                        n_invalid, bid == 0, tid)
            self.finalize(mIds, mSlot, s_pair, s_base, s_off, s_stored, p0, p1, n_invalid, tid)
            cute.arch.sync_threads()  # this CTA's slots, written by other threads, are read below

        num_batches = (i1 - i0 + nt * self.unroll - 1) // (nt * self.unroll)
        for b in cutlass.range(num_batches):
            if b > 0:
                self.load_batch(gX, frag, i0, i1, b, tid)
            self.store_batch(gBuf, mSlot, frag, i0, i1, b, tid)

    @cute.jit
    def load_batch(self, gX: cute.Tensor, frag: cute.Tensor, i0: Int32, i1: Int32, b: Int32, tid: Int32):
        for u in cutlass.range_constexpr(self.unroll):
            i = i0 + (b * self.unroll + u) * self.nt + tid
            if i < i1:
                t = i // self.hv
                cute.autovec_copy(gX[(None, None), (t, i - t * self.hv)], frag[(None, None), u])

    @cute.jit
    def store_batch(self, gBuf: cute.Tensor, mSlot: cute.Tensor, frag: cute.Tensor, i0: Int32, i1: Int32,
                    b: Int32, tid: Int32):
        for u in cutlass.range_constexpr(self.unroll):
            i = i0 + (b * self.unroll + u) * self.nt + tid
            if i < i1:
                t = i // self.hv
                v = i - t * self.hv
                # The k slot loads before the first store: a store in between could alias them for the
                # compiler, which would then wait for each load separately.
                slots = cute.make_rmem_tensor((self.k,), Int32)
                for j in cutlass.range_constexpr(self.k):
                    slots[j] = mSlot[t, j]
                for j in cutlass.range_constexpr(self.k):
                    if slots[j] >= 0:
                        cute.autovec_copy(frag[(None, None), u], gBuf[(None, None), (slots[j], v)])

    @cute.jit
    def count(self, mIds: cute.Tensor, mSlot: cute.Tensor, s_pair: cute.Tensor, s_cnt: cute.Tensor,
              s_misc: cute.Tensor, p0: Int32, p1: Int32, tid: Int32):
        """Rank of each pair in [p0, p1) among this CTA's pairs of its expert (-1: not routed) -> s_pair
        packed with the expert (decode) or mSlot (prefill); per-expert totals -> s_cnt; ids outside
        [-1, E) -> s_misc[0]."""
        E, k = self.E, self.k
        lane = tid % 32
        for base in cutlass.range(p0, p1, self.nt):
            p = base + tid
            t = p // k
            j = p - t * k
            e = Int32(-1)
            if p < p1:
                e = mIds[t, j]
            valid = (p < p1) & (e >= 0) & (e < E)
            key = Int32(E) + lane  # unique per lane: lanes without an expert match nobody
            if valid:
                key = e
            peers = cute.arch.match_sync(0xFFFFFFFF, key)
            rank = cute.arch.popc(peers & ((Uint32(1) << Uint32(lane)) - Uint32(1)))
            lowest = peers & (Uint32(0) - peers)
            leader = Int32(31) - Int32(cute.arch.clz(lowest))
            first = Int32(0)
            if valid & (rank == 0):
                first = cute.arch.atomic_add(s_cnt.iterator + e, Int32(cute.arch.popc(peers)), scope="cta")
            first = cute.arch.shuffle_sync(first, leader)
            if p < p1:
                r = Int32(-1)
                if valid:
                    r = first + Int32(rank)
                if const_expr(self.decode):
                    s_pair[p] = Int32(cutlass.select_(valid, (e << 16) | r, -1))
                else:
                    mSlot[t, j] = r
            if (p < p1) & (e != -1) & ~valid:
                cute.arch.atomic_add(s_misc.iterator, Int32(1), scope="cta")

    @cute.jit
    def finalize(self, mIds: cute.Tensor, mSlot: cute.Tensor, s_pair: cute.Tensor, s_base: cute.Tensor,
                 s_off: cute.Tensor, s_stored: cute.Tensor, p0: Int32, p1: Int32, n_invalid: Int32, tid: Int32):
        """Rank -> slot (or -1 when the pair is not routed, does not fit, or the routing is invalid)."""
        k = self.k
        for base in cutlass.range(p0, p1, self.nt):
            p = base + tid
            if p < p1:
                t = p // k
                j = p - t * k
                e = Int32(0)
                r = Int32(-1)
                if const_expr(self.decode):
                    packed = s_pair[p]
                    if packed >= 0:
                        e = packed >> 16
                        r = packed & 0xFFFF
                else:
                    r = mSlot[t, j]
                    if r >= 0:
                        e = mIds[t, j]
                        r = r + s_base[e]
                s = Int32(-1)
                if (r >= 0) & (n_invalid == 0):
                    if r < s_stored[e]:
                        s = s_off[e] + r
                mSlot[t, j] = s

    @cute.jit
    def layout(self, s_cnt: cute.Tensor, s_off: cute.Tensor, s_stored: cute.Tensor, s_warp: cute.Tensor,
               s_misc: cute.Tensor, mMeta: cute.Tensor, block_size: Int32, capacity: Int32,
               n_invalid: Int32, writer: cutlass.Boolean, tid: Int32):
        """Counts -> padded exclusive prefix sum (one expert per thread) -> each expert's first row and
        how many of its pairs fit; the writer CTA stores counts, offsets, overflow and invalid."""
        E, m = self.E, self.m
        num_warps = self.nt // 32
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
        """All CTAs are resident (grid <= SMs, one CTA fits per SM), so spinning cannot deadlock."""
        cute.arch.sync_threads()
        if tid == 0:
            arrived = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu") + 1
            while arrived < grid:
                arrived = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        cute.arch.sync_threads()


def _fake_args(cfg: DispatchConfig) -> tuple:
    dt = _CUTE_DTYPE[cfg.dtype]
    tokens, rows = cute.sym_int(), cute.sym_int()
    x = cute.runtime.make_fake_tensor(dt, (tokens, cfg.hidden), (cute.sym_int64(divisibility=cfg.vec), 1),
                                      assumed_align=16)
    ids = cute.runtime.make_fake_tensor(Int32, (tokens, cfg.topk), (cute.sym_int64(), 1), assumed_align=4)
    buf = cute.runtime.make_fake_tensor(dt, (rows, cfg.hidden), (cute.sym_int64(divisibility=cfg.vec), 1),
                                        assumed_align=16)
    slot = cute.runtime.make_fake_compact_tensor(Int32, (tokens, cfg.topk), stride_order=(1, 0),
                                                 assumed_align=4)
    meta = cute.runtime.make_fake_compact_tensor(Int32, (meta_layout(cfg.num_experts)["size"],),
                                                 assumed_align=16)
    return (x, ids, buf, slot, meta, Int32(1), Int32(1), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))


def compile(variant: jit.Variant) -> jit.CompiledKernel:
    """The loaded kernel of `variant`: fn(x, topk_ids, buffer, slot_map, meta, block_size, num_ctas), with
    meta zeroed before every launch (see `launch`)."""
    cfg = DispatchConfig.from_variant(variant)
    return jit.compile_variant(variant, lambda: (_Dispatch(cfg), _fake_args(cfg)))


# ---------------------------------------------------------------------------------------------
# The op.

class MoeDispatch(NamedTuple):
    """What `moe_dispatch` returns; every tensor is on x's device, written in the same stream."""

    buffer: torch.Tensor  # [capacity, H], x.dtype: expert e's tokens in rows offsets[e] .. +counts[e]-1
    counts: torch.Tensor  # [E] int32: tokens of each expert stored in the buffer
    offsets: torch.Tensor  # [E+1] int32: first row of each expert's segment, offsets[E] = rows in use
    slot_map: torch.Tensor  # [T, k] int32: buffer row of each (token, choice), -1 = dropped
    overflow: torch.Tensor  # [1] int32: routed pairs not stored for lack of capacity
    invalid: torch.Tensor  # [1] int32: ids outside [-1, E); when > 0 nothing was dispatched

    def check(self) -> None:
        """Raise if the dispatch dropped pairs for lack of capacity or saw invalid ids (synchronises)."""
        invalid, overflow = int(self.invalid.item()), int(self.overflow.item())
        if invalid:
            raise ValueError(f"moe_dispatch: {invalid} expert ids outside [-1, {self.counts.numel()}); "
                             "nothing was dispatched")
        if overflow:
            raise RuntimeError(f"moe_dispatch: {overflow} routed pairs did not fit the buffer capacity "
                               f"{self.buffer.shape[0]} and were dropped")


def default_capacity(num_tokens: int, topk: int, num_experts: int, block_size: int) -> int:
    """Rows that always suffice: every pair, plus the padding of every expert that can be non-empty
    (at most min(E, T*k) experts are; an empty expert takes no rows)."""
    pairs = num_tokens * topk
    return pairs + min(num_experts, pairs) * (block_size - 1)  # builtin min: dynamo traces it on SymInts


def choose_mode(num_tokens: int, topk: int) -> str:
    return "decode" if num_tokens * topk <= DECODE_MAX_PAIRS else "prefill"


def moe_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, capacity: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, *, buffer: torch.Tensor | None = None,
                 mode: str | None = None) -> MoeDispatch:
    """Group the tokens of x [T, H] by expert: see the module docstring for the layout.

    topk_ids [T, k] int32 (-1 = not routed). `capacity` (rows of the buffer) defaults to the worst case
    `default_capacity(...)`; pass `buffer` [capacity, H] to reuse one (its rows outside the experts'
    stored tokens are left as they were). `mode` forces "prefill" or "decode" (default: by T*k).
    """
    if isinstance(topk_ids, torch.Tensor) and topk_ids.dim() == 2:
        num_tokens, topk = topk_ids.shape
    else:
        raise ValueError("topk_ids must be a 2-D tensor [tokens, k]")
    if buffer is None:
        if capacity is None:
            capacity = default_capacity(num_tokens, topk, num_experts, block_size)
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError("x must be a 2-D tensor [tokens, hidden]")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        buffer = x.new_empty((capacity, x.shape[1]))
    elif capacity is not None and capacity != buffer.shape[0]:
        raise ValueError(f"capacity {capacity} disagrees with the buffer's {buffer.shape[0]} rows")
    slot_map, meta = torch.ops.rosekernels.moe_dispatch(
        x, topk_ids, buffer, num_experts, block_size, mode or choose_mode(num_tokens, topk))
    return _result(buffer, slot_map, meta, num_experts)


def _result(buffer: torch.Tensor, slot_map: torch.Tensor, meta: torch.Tensor, num_experts: int) -> MoeDispatch:
    m = meta_layout(num_experts)
    return MoeDispatch(buffer, meta[m["counts"]:m["offsets"]], meta[m["offsets"]:m["overflow"]], slot_map,
                       meta[m["overflow"]:m["invalid"]], meta[m["invalid"]:m["raw"]])


def validate(x: torch.Tensor, topk_ids: torch.Tensor, buffer: torch.Tensor, num_experts: int,
             block_size: int, mode: str, *, on_device: bool = True) -> DispatchConfig:
    """Every argument check, in the order shapes/types -> device -> alignment, so that each one can be
    exercised with CPU or meta tensors; returns the kernel's config."""
    for name, t in (("x", x), ("topk_ids", topk_ids), ("buffer", buffer)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    checks.check_dtype("x", x, DTYPES)
    checks.check_dtype("topk_ids", topk_ids, (torch.int32,))
    checks.check_dtype("buffer", buffer, (x.dtype,))
    checks.check_shape("x", x, (None, None))
    checks.check_shape("topk_ids", topk_ids, (x.shape[0], None))
    checks.check_shape("buffer", buffer, (None, x.shape[1]))
    key = (checks.DTYPE_NAME[x.dtype], x.shape[1], num_experts, topk_ids.shape[1], mode)
    cfg = _config(*key) if on_device else DispatchConfig(*key)  # fake tensors may carry SymInts
    if not isinstance(block_size, (int, torch.SymInt)) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    tokens, topk, capacity = x.shape[0], topk_ids.shape[1], buffer.shape[0]
    if mode == "decode" and tokens * topk > DECODE_PAIRS_LIMIT:
        raise ValueError(f"the decode variant routes at most {DECODE_PAIRS_LIMIT} (token, choice) pairs, "
                         f"got {tokens} x {topk}; use mode='prefill'")
    worst = tokens * topk + min(num_experts, tokens * topk) * (block_size - 1)
    if max(worst, capacity, tokens * (x.shape[1] // cfg.vec)) >= 2**31:
        raise ValueError("sizes exceed the kernel's 32-bit row/element indexing: "
                         f"T={tokens}, k={topk}, E={num_experts}, block_size={block_size}, capacity={capacity}")
    if on_device:
        for name, t in (("x", x), ("topk_ids", topk_ids), ("buffer", buffer)):
            checks.check_cuda(name, t)
        checks.check_same_device(x=x, topk_ids=topk_ids, buffer=buffer)
        check_sm90(x.device)
        for name, t in (("x", x), ("topk_ids", topk_ids), ("buffer", buffer)):
            checks.check_unit_last_stride(name, t)
        checks.check_aligned("x", x)
        checks.check_aligned("buffer", buffer)
    return cfg


@functools.cache
def _config(*key: Any) -> DispatchConfig:
    return DispatchConfig(*key)


@functools.cache
def _device_info(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


def check_sm90(device: torch.device) -> None:
    cc, _ = _device_info(device.index if device.index is not None else torch.cuda.current_device())
    if cc != (9, 0):
        raise RuntimeError(f"rosekernels MoE kernels are compiled for sm_90a (H100/H200); "
                           f"{device} is sm_{cc[0]}{cc[1]}")


def num_ctas(cfg: DispatchConfig, num_tokens: int, device: torch.device) -> int:
    """At most one CTA per SM: the CTAs wait for each other, so all must be resident at once."""
    _, sms = _device_info(device.index if device.index is not None else torch.cuda.current_device())
    if cfg.mode == "decode":
        want = -(-num_tokens * (cfg.hidden // cfg.vec) // DECODE_VECS_PER_CTA)
    else:
        want = num_tokens
    return max(1, min(sms, want))


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """`t` with canonical strides on its size-1 dims (any stride is legal there; the kernel's
    signature wants the last one unit and the row stride a multiple of 16 bytes)."""
    if isinstance(t, torch.Tensor) and t.dim() == 2 and 1 in t.shape:
        return t.as_strided(t.shape, (t.shape[1] if t.shape[0] == 1 else t.stride(0), 1))
    return t


@torch.library.custom_op("rosekernels::moe_dispatch", mutates_args=("buffer",))
def _moe_dispatch_op(x: torch.Tensor, topk_ids: torch.Tensor, buffer: torch.Tensor, num_experts: int,
                     block_size: int, variant_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    # (not `mode`: torch's functionalization of mutating ops passes a `mode` keyword of its own)
    x, topk_ids, buffer = rows_view(x), rows_view(topk_ids), rows_view(buffer)
    cfg = validate(x, topk_ids, buffer, num_experts, block_size, variant_mode)
    kernel = compile(cfg.variant())
    slot_map = torch.empty(topk_ids.shape, dtype=torch.int32, device=x.device)
    meta = torch.zeros(meta_layout(num_experts)["size"], dtype=torch.int32, device=x.device)
    kernel.fn(x, topk_ids, buffer, slot_map, meta, block_size, num_ctas(cfg, x.shape[0], x.device))
    return slot_map, meta


@_moe_dispatch_op.register_fake
def _(x, topk_ids, buffer, num_experts, block_size, variant_mode):
    validate(x, topk_ids, buffer, num_experts, block_size, variant_mode, on_device=False)
    return (topk_ids.new_empty(topk_ids.shape, dtype=torch.int32),
            topk_ids.new_empty((meta_layout(num_experts)["size"],), dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# Variant selection, the list of specializations, inputs and checks (tests, benchmark, SIP tuner).

MODELS = {"qwen3-30b-a3b": (2048, 128, 8), "deepseek-v3": (7168, 256, 8)}  # hidden, experts, top-k


def config_for(tokens: int, hidden: int, num_experts: int, topk: int, dtype: torch.dtype,
               mode: str | None = None) -> DispatchConfig:
    """What moe_dispatch() launches for these sizes."""
    return DispatchConfig(checks.DTYPE_NAME[dtype], hidden, num_experts, topk, mode or choose_mode(tokens, topk))


def all_variants(models=tuple(MODELS.values()), dtypes=(torch.bfloat16,)) -> list[jit.Variant]:
    """The specializations of these (hidden, experts, top-k) models: dtype x {decode, prefill}."""
    return [DispatchConfig(checks.DTYPE_NAME[dt], h, e, k, mode).variant()
            for h, e, k in models for dt in dtypes for mode in ("decode", "prefill")]


def random_topk_ids(num_tokens: int, num_experts: int, topk: int, generator: torch.Generator | None = None,
                    device: Any = "cpu") -> torch.Tensor:
    """A realistic routing: k distinct experts per token, from random logits."""
    logits = torch.rand(num_tokens, num_experts, generator=generator)
    return logits.topk(topk, dim=1).indices.to(device=device, dtype=torch.int32)


def sample_args(variant: jit.Variant, tokens: int | None = None, seed: int = 0, device: Any = "cuda",
                block_size: int = DEFAULT_BLOCK_SIZE) -> tuple:
    """Fresh args for `launch(compile(variant).fn, args)`: (x, topk_ids, buffer, slot_map, meta,
    block_size, num_ctas), random x and routing, buffer NaN-poisoned, buffer of the default capacity.
    Default tokens: 128 for decode, 4096 for prefill."""
    cfg = DispatchConfig.from_variant(variant)
    tokens = (128 if cfg.mode == "decode" else 4096) if tokens is None else tokens
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden, generator=g).to(device=device, dtype=TORCH_DTYPE[cfg.dtype])
    ids = random_topk_ids(tokens, cfg.num_experts, cfg.topk, g, device)
    capacity = default_capacity(tokens, cfg.topk, cfg.num_experts, block_size)
    buffer = torch.full((capacity, cfg.hidden), float("nan"), dtype=x.dtype, device=device)
    slot_map = torch.full(ids.shape, -7, dtype=torch.int32, device=device)
    meta = torch.zeros(meta_layout(cfg.num_experts)["size"], dtype=torch.int32, device=device)
    return x, ids, buffer, slot_map, meta, block_size, num_ctas(cfg, tokens, x.device)


def launch(fn: Callable[..., Any], args: tuple) -> None:
    """One dispatch with kernel function `fn` (the scratch behind the outputs zeroed first, as the op does)."""
    args[4].zero_()
    fn(*args)


def outputs(variant: jit.Variant, args: tuple) -> list[torch.Tensor]:
    """The outputs of a launch in a canonical form that does not depend on the (free) order of the
    tokens within an expert: counts/offsets/overflow/invalid, each pair's buffer row (zeros when
    dropped), and the sorted slots."""
    x, ids, buffer, slot_map, meta = args[:5]
    s = slot_map.long()
    rows = torch.where((s >= 0)[..., None], buffer[s.clamp(0, max(buffer.shape[0] - 1, 0))], 0)
    return [meta[:meta_layout(DispatchConfig.from_variant(variant).num_experts)["raw"]], rows,
            s.flatten().sort().values]


def check_args(variant: jit.Variant, args: tuple) -> None:
    """Raise AssertionError unless the launch that filled `args` is a correct dispatch."""
    x, ids, buffer, slot_map, meta, block_size = args[:6]
    cfg = DispatchConfig.from_variant(variant)
    check_dispatch(x, ids, cfg.num_experts, block_size, _result(buffer, slot_map, meta, cfg.num_experts))


def check_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, block_size: int,
                   result: MoeDispatch) -> None:
    """Raise AssertionError unless `result` is a correct dispatch of (x, topk_ids) (synchronises)."""
    E, C = num_experts, result.buffer.shape[0]
    ids = topk_ids.reshape(-1).long()
    slots = result.slot_map.reshape(-1).long()
    n_invalid = int(((ids < -1) | (ids >= E)).sum())
    assert int(result.invalid) == n_invalid, f"invalid: {int(result.invalid)} != {n_invalid}"
    if n_invalid:
        assert not result.counts.any() and not result.offsets.any() and int(result.overflow) == 0
        assert (slots == -1).all(), "slots written for an invalid routing"
        return
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
