"""Peer-memory kernels of MoE across the GPUs of one node (rosekernels.moe: ExpertParallel,
TensorParallel). Not tunable kernels of the contract: they take part in a protocol between ranks.

Every rank owns an *arena*, one byte buffer of the same layout on each rank, mapped into every
rank's address space (torch SymmetricMemory, or n buffers on one GPU when the ranks are emulated).
A kernel gets `addr` [world, regions] int64: the address of each region of each rank's arena as
this process sees it, so one kernel serves any number of ranks. Every access to an arena is
explicit PTX: 16-byte vectors for rows, `st.release.sys` for a flag after the data it publishes
(every thread fences at system scope, the CTA synchronises, then one thread stores the flag), and
`ld.acquire.sys` to poll one.

Flags carry the step: `state` [4] int32 on each rank holds the number of finished steps (word 0);
a step publishes flags equal to it + 1, waiters accept any flag at or past that (a fast peer may
already have published the next step's), and the last kernel of a step counts its CTAs out
(word 2) and the last one advances word 0. No flag is ever reset, so CUDA-graph replays stay
valid. A wait that outlasts `timeout_ns` records 1 + the late rank in word 1 (atomic max) and
gives up, so a peer that never signals ends the launch instead of hanging it; the host reads it
(`rosekernels.moe.*.check`).

Kernels:
- `ep_send`: expert parallel, the sender's half of dispatch. CTA per token (grid-stride over
  max_tokens rows): the token's row, read once, goes to every destination rank that owns one of its
  experts, into row (sender, token) of that rank's receive region; its k expert ids go to every rank
  (-1 for rows past the batch), then the row's flag. It also writes the source slot map of the combine.
- `ep_return`: the receiver's half of combine: every pair of a received row that this rank's
  experts own goes back into pair row (token, j) of the sender's return region (zeros where the
  local dispatch dropped it), then the row's flag on the sender.
- `wait`: every flag of a region up to a row count per sender reaches this step (one thread per
  flag); `bump` makes it the step's last kernel.
- `tp_reduce`: tensor parallel, one launch: each CTA computes its vectors of this rank's partial
  (the weighted sum of its local expert rows, as moe_combine; or rows of a given tensor with
  topk 0), rounds them to the output dtype and pushes them into every rank's inbox (two inboxes,
  by the step's parity, so a fast rank's next step cannot overwrite what a slow one still reads),
  flags the CTA's share on every rank, waits for every rank's flag of the same CTA, and sums the n
  partials in rank order in fp32: every rank's output is bitwise the same. The grid (at most one
  CTA per SM) must be the same on every rank: the same token count on GPUs of the same SM count.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from rosekernels import checks, jit
from rosekernels.kernels.moe_common import load_16b_or_zero, weighted_sum
from rosekernels.variant import Variant

# Regions of an expert-parallel arena (index into `addr`'s second dim).
EP_X, EP_IDS, EP_FLAG, EP_RET, EP_RFLAG = range(5)
# Regions of a tensor-parallel arena: two inboxes (by step parity), the CTA flags.
TP_INBOX, TP_FLAG = 0, 2
MAX_CTAS = 1024  # flags per rank in a tensor-parallel arena: grids never exceed it
STATE_STEP, STATE_ERROR, STATE_ARRIVED = 0, 1, 2
THREADS = 128  # wait
TP_THREADS = 256
# ep_send / ep_return: a CTA moves a row in chunks of UNROLL * ROW_THREADS 16-byte vectors, each
# thread issuing its UNROLL loads before its stores, so UNROLL round trips to memory overlap.
ROW_THREADS = 256
UNROLL = 4


@dataclasses.dataclass(frozen=True)
class PeerConfig:
    op: str  # "ep_send" | "ep_return" | "wait" | "tp_reduce"
    world: int
    dtype: str = "bf16"
    hidden: int = 0
    topk: int = 0  # ep_*: the routing's k; tp_reduce: 0 = reduce a tensor, else fuse the combine
    experts: int = 0  # ep_*: experts per rank
    weight_dtype: str = "fp32"  # tp_reduce with topk > 0
    region: int = 0  # wait: which region's flags
    bump: bool = False  # wait: the step's last kernel

    def __post_init__(self) -> None:
        if self.op not in ("ep_send", "ep_return", "wait", "tp_reduce"):
            raise ValueError(f"no peer kernel {self.op!r}")
        if not 1 <= self.world <= 32:
            raise ValueError(f"world size must be in [1, 32], got {self.world}")
        if self.op != "wait" and (self.hidden <= 0 or self.hidden % checks.vector_elems(self.dtype)):
            raise ValueError(f"hidden size must be a positive multiple of 16 bytes, got {self.hidden}")

    @property
    def vec(self) -> int:
        return checks.vector_elems(self.dtype)

    def variant(self) -> Variant:
        return Variant.of(f"moe_{self.op}", "decode", **{f.name: getattr(self, f.name)
                                                           for f in dataclasses.fields(self) if f.name != "op"})


# ---------------------------------------------------------------------------------------------
# Explicit memory operations on addresses (Int64) of arena memory.

@cute.jit
def _ld16(addr):  # an Int64 address or a cute pointer
    return cute.arch.inline_ptx("ld.global.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[Int32] * 4, read_only_args=[addr])


@cute.jit
def _st16(addr: Int64, w0: Int32, w1: Int32, w2: Int32, w3: Int32):
    cute.arch.inline_ptx("st.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[addr, w0, w1, w2, w3])


@cute.jit
def _st16_if(pred: cutlass.Boolean, addr: Int64, w0: Int32, w1: Int32, w2: Int32, w3: Int32):
    """_st16 when `pred`: a predicated st.global.v4, no branch. (The predicate is set in the PTX:
    inline_ptx's own `predicate=` prints a folded constant as `@0`, which ptxas rejects.)"""
    cute.arch.inline_ptx("{\n.reg .pred p;\nsetp.ne.b32 p, {$r0}, 0;\n"
                         "@p st.global.v4.b32 [{$r1}], {{$r2}, {$r3}, {$r4}, {$r5}};\n}",
                         read_only_args=[Int32(pred), addr, w0, w1, w2, w3])


@cute.jit
def _ld32(addr: Int64) -> Int32:
    return cute.arch.inline_ptx("ld.global.b32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[addr])


@cute.jit
def _st32(addr: Int64, v: Int32):
    cute.arch.inline_ptx("st.global.b32 [{$r0}], {$r1};", read_only_args=[addr, v])


@cute.jit
def _release(addr: Int64, v: Int32):
    cute.arch.inline_ptx("st.release.sys.global.b32 [{$r0}], {$r1};", read_only_args=[addr, v])


@cute.jit
def _acquire(addr: Int64) -> Int32:
    return cute.arch.inline_ptx("ld.acquire.sys.global.b32 {$w0}, [{$r0}];", write_only_types=[Int32],
                                read_only_args=[addr])


@cute.jit
def _await(addr: Int64, step: Int32, rank: Int32, mState: cute.Tensor, timeout_ns: Int64):
    """Poll the flag at `addr` until it reaches `step`; past the timeout record 1 + rank and give up."""
    seen = _acquire(addr)
    start = cute.arch.globaltimer()
    waited = Int64(0)
    while (seen - step < 0) & (waited < timeout_ns):
        seen = _acquire(addr)
        waited = cute.arch.globaltimer() - start
    if seen - step < 0:
        cute.arch.atomic_max(mState.iterator + STATE_ERROR, rank + 1, sem="relaxed", scope="gpu")


@cute.jit
def _publish():
    """Make this CTA's writes visible system-wide before one thread stores a flag."""
    cute.arch.fence_acq_rel_sys()
    cute.arch.sync_threads()


@cute.jit
def _finish_step(mState: cute.Tensor, step: Int32, tid: Int32):
    """The last CTA out of the step's last kernel advances the step (every CTA read it on entry)."""
    cute.arch.sync_threads()
    if tid == 0:
        arrived = cute.arch.atomic_add(mState.iterator + STATE_ARRIVED, Int32(1), sem="acq_rel", scope="gpu")
        if arrived == cute.arch.grid_dim()[0] - 1:
            mState[STATE_ARRIVED] = Int32(0)
            mState[STATE_STEP] = step


class _Rows:
    """What the kernels that move rows know at compile time."""

    def __init__(self, cfg: PeerConfig):
        self.cfg, self.n, self.k, self.er = cfg, cfg.world, cfg.topk, cfg.experts
        self.vec, self.hv = cfg.vec, cfg.hidden // cfg.vec
        self.row_bytes = cfg.hidden * checks.ELEM_BYTES[cfg.dtype]

    @cute.jit
    def load_chunk(self, words: cute.Tensor, gRows: cute.Tensor, row: Int32, c: Int32, ok: cutlass.Boolean):
        """words[u, :] = this thread's vector c + u * ROW_THREADS + tid of row `row` (zeros unless ok)."""
        tid = cute.arch.thread_idx()[0]
        for u in cutlass.range_constexpr(UNROLL):
            v = c + u * ROW_THREADS + tid
            w = load_16b_or_zero(gRows[(None, None), (row, v)].iterator, ok & (v < self.hv))
            for q in cutlass.range_constexpr(4):
                words[u, q] = w[q]

    @cute.jit
    def store_chunk(self, dst: Int64, words: cute.Tensor, c: Int32):
        """The same vectors of `words` into the row at address `dst`."""
        tid = cute.arch.thread_idx()[0]
        for u in cutlass.range_constexpr(UNROLL):
            v = c + u * ROW_THREADS + tid
            _st16_if(v < self.hv, dst + Int64(v) * 16, words[u, 0], words[u, 1], words[u, 2], words[u, 3])


class _EpSend(_Rows):

    @cute.jit
    def __call__(self, mX: cute.Tensor, mIds: cute.Tensor, mAddr: cute.Tensor, mSrcSlot: cute.Tensor,
                 mState: cute.Tensor, rank: Int32, max_tokens: Int32, num_ctas: Int32, stream):
        self.kernel(mX, mIds, mAddr, mSrcSlot, mState, rank, max_tokens).launch(
            grid=[num_ctas, 1, 1], block=[ROW_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mIds: cute.Tensor, mAddr: cute.Tensor, mSrcSlot: cute.Tensor,
               mState: cute.Tensor, rank: Int32, max_tokens: Int32):
        n, k, hv = self.n, self.k, self.hv
        tid = cute.arch.thread_idx()[0]
        step = mState[STATE_STEP] + 1
        tokens = mX.shape[0]
        num_experts = self.er * n
        gX = cute.zipped_divide(mX, (1, self.vec))
        t = cute.arch.block_idx()[0]
        while t < max_tokens:
            row = Int64(rank * max_tokens + t)  # (sender, token) in every receiver's regions
            need = Int32(0)  # bit r: rank r owns one of the token's experts
            if t < tokens:
                for j in cutlass.range_constexpr(k):
                    eid = mIds[t, j]
                    if (eid >= 0) & (eid < num_experts):
                        need = need | (Int32(1) << (eid // self.er))
            if need != 0:  # each chunk of the row read once, stored to every rank that needs it
                for c in cutlass.range(0, hv, UNROLL * ROW_THREADS):
                    words = cute.make_rmem_tensor((UNROLL, 4), Int32)
                    self.load_chunk(words, gX, t, c, True)
                    for r in cutlass.range_constexpr(n):
                        if (need >> r) & 1 != 0:
                            self.store_chunk(mAddr[r, EP_X] + row * self.row_bytes, words, c)
            for r in cutlass.range_constexpr(n):
                if tid < k:
                    eid = Int32(-1)
                    if t < tokens:
                        eid = mIds[t, tid]
                    _st32(mAddr[r, EP_IDS] + (row * k + tid) * 4, eid)
            if (tid < k) & (t < tokens):
                eid = mIds[t, tid]
                mSrcSlot[t, tid] = cutlass.select_((eid >= 0) & (eid < num_experts), t * k + tid, Int32(-1))
            _publish()
            if tid < n:
                _release(mAddr[tid, EP_FLAG] + row * 4, step)
            t += cute.arch.grid_dim()[0]


class _EpReturn(_Rows):

    @cute.jit
    def __call__(self, mY: cute.Tensor, mSlot: cute.Tensor, mAddr: cute.Tensor, mState: cute.Tensor,
                 rank: Int32, max_tokens: Int32, num_ctas: Int32, stream):
        self.kernel(mY, mSlot, mAddr, mState, rank, max_tokens).launch(
            grid=[num_ctas, 1, 1], block=[ROW_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mSlot: cute.Tensor, mAddr: cute.Tensor, mState: cute.Tensor,
               rank: Int32, max_tokens: Int32):
        k, hv = self.k, self.hv
        tid = cute.arch.thread_idx()[0]
        step = mState[STATE_STEP] + 1
        rows = mY.shape[0]
        first = rank * self.er
        gY = cute.zipped_divide(mY, (1, self.vec))
        i = cute.arch.block_idx()[0]
        while i < self.n * max_tokens:  # received row i = (sender s, token t)
            s = i // max_tokens
            t = i - s * max_tokens
            ids = mAddr[rank, EP_IDS] + Int64(i) * (k * 4)
            for j in cutlass.range_constexpr(k):
                eid = _ld32(ids + j * 4)
                if (eid >= first) & (eid < first + self.er):
                    slot = mSlot[i, j]
                    ok = (slot >= 0) & (slot < rows)
                    slot = cutlass.select_(ok, slot, Int32(0))
                    dst = mAddr[s, EP_RET] + Int64(t * k + j) * self.row_bytes
                    for c in cutlass.range(0, hv, UNROLL * ROW_THREADS):
                        words = cute.make_rmem_tensor((UNROLL, 4), Int32)
                        self.load_chunk(words, gY, slot, c, ok)
                        self.store_chunk(dst, words, c)
            _publish()
            if tid == 0:
                _release(mAddr[s, EP_RFLAG] + Int64(rank * max_tokens + t) * 4, step)
            i += cute.arch.grid_dim()[0]


class _Wait:
    def __init__(self, cfg: PeerConfig):
        self.cfg, self.n = cfg, cfg.world

    @cute.jit
    def __call__(self, mAddr: cute.Tensor, mState: cute.Tensor, rank: Int32, rows: Int32, stride: Int32,
                 timeout_ns: Int64, num_ctas: Int32, stream):
        self.kernel(mAddr, mState, rank, rows, stride, timeout_ns).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mAddr: cute.Tensor, mState: cute.Tensor, rank: Int32, rows: Int32, stride: Int32,
               timeout_ns: Int64):
        """Flags [world, stride] of this rank's region; the first `rows` of each sender's."""
        tid = cute.arch.thread_idx()[0]
        step = mState[STATE_STEP] + 1
        i = cute.arch.block_idx()[0] * THREADS + tid
        if i < self.n * rows:
            s = i // rows
            _await(mAddr[rank, self.cfg.region] + Int64(s * stride + i - s * rows) * 4, step, s, mState,
                   timeout_ns)
        if const_expr(self.cfg.bump):
            _finish_step(mState, step, tid)


class _TpReduce(_Rows):

    @cute.jit
    def __call__(self, mY: cute.Tensor, mW: Optional[cute.Tensor], mSlot: Optional[cute.Tensor], mOut: cute.Tensor,
                 mAddr: cute.Tensor, mState: cute.Tensor, rank: Int32, max_tokens: Int32, timeout_ns: Int64,
                 num_ctas: Int32, stream):
        self.kernel(mY, mW, mSlot, mOut, mAddr, mState, rank, max_tokens, timeout_ns).launch(
            grid=[num_ctas, 1, 1], block=[TP_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mW: Optional[cute.Tensor], mSlot: Optional[cute.Tensor], mOut: cute.Tensor,
               mAddr: cute.Tensor, mState: cute.Tensor, rank: Int32, max_tokens: Int32, timeout_ns: Int64):
        n, k, hv = self.n, self.k, self.hv
        tid = cute.arch.thread_idx()[0]
        bid = cute.arch.block_idx()[0]
        grid = cute.arch.grid_dim()[0]
        step = mState[STATE_STEP] + 1
        inbox = TP_INBOX + (step & 1)
        total = mOut.shape[0] * hv
        rows = mY.shape[0]
        gY = cute.zipped_divide(mY, (1, self.vec))
        gOut = cute.zipped_divide(mOut, (1, self.vec))
        # Phase 1: this rank's partial of each of the CTA's vectors, pushed to every rank's inbox.
        i = bid * TP_THREADS + tid
        while i < total:
            t = i // hv
            v = i - t * hv
            words = cute.make_rmem_tensor((4,), Int32)
            if const_expr(k == 0):
                w = _ld16(gY[(None, None), (t, v)].iterator)
                for q in cutlass.range_constexpr(4):
                    words[q] = w[q]
            else:
                acc = weighted_sum(gY, mW, mSlot, t, v, rows, k, self.vec, mY.element_type)
                part = cute.make_rmem_tensor((self.vec,), mOut.element_type)
                part.store(acc.to(mOut.element_type))
                packed = cute.recast_tensor(part, Int32)
                for q in cutlass.range_constexpr(4):
                    words[q] = packed[q]
            offset = Int64(rank * max_tokens + t) * self.row_bytes + Int64(v) * 16
            for r in cutlass.range_constexpr(n):
                _st16(mAddr[r, inbox] + offset, words[0], words[1], words[2], words[3])
            i += grid * TP_THREADS
        _publish()
        if tid < n:
            _release(mAddr[tid, TP_FLAG] + Int64(rank * MAX_CTAS + bid) * 4, step)
            _await(mAddr[rank, TP_FLAG] + Int64(tid * MAX_CTAS + bid) * 4, step, tid, mState, timeout_ns)
        cute.arch.sync_threads()
        # Phase 2: the n partials of the same vectors, summed in rank order.
        i = bid * TP_THREADS + tid
        while i < total:
            t = i // hv
            v = i - t * hv
            acc = cute.full((self.vec,), 0.0, Float32)
            for r in cutlass.range_constexpr(n):
                w = _ld16(mAddr[rank, inbox] + Int64(r * max_tokens + t) * self.row_bytes + Int64(v) * 16)
                words = cute.make_rmem_tensor((4,), Int32)
                for q in cutlass.range_constexpr(4):
                    words[q] = w[q]
                acc = acc + cute.recast_tensor(words, mOut.element_type).load().to(Float32)
            out = cute.make_rmem_tensor((1, self.vec), mOut.element_type)
            out.store(acc.to(mOut.element_type).reshape((1, self.vec)))
            cute.autovec_copy(out, gOut[(None, None), (t, v)])
            i += grid * TP_THREADS
        _finish_step(mState, step, tid)


# ---------------------------------------------------------------------------------------------
# Compilation.

def _rows(dtype: str, vec: int, cols=None):
    return cute.runtime.make_fake_tensor(checks.cute_dtype(dtype), (cute.sym_int(), cols or cute.sym_int()),
                                         (cute.sym_int64(divisibility=vec), 1), assumed_align=16)


def _fake_args(cfg: PeerConfig) -> tuple:
    addr = cute.runtime.make_fake_compact_tensor(Int64, (cfg.world, cute.sym_int()), stride_order=(1, 0),
                                                 assumed_align=8)
    state = cute.runtime.make_fake_compact_tensor(Int32, (4,), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    ints = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(), cfg.topk), (cute.sym_int64(), 1), assumed_align=4)
    if cfg.op == "ep_send":
        slots = cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int(), cfg.topk), stride_order=(1, 0),
                                                      assumed_align=4)
        return (_rows(cfg.dtype, cfg.vec, cfg.hidden), ints, addr, slots, state, Int32(0), Int32(1), Int32(1),
                stream)
    if cfg.op == "ep_return":
        return (_rows(cfg.dtype, cfg.vec, cfg.hidden), ints, addr, state, Int32(0), Int32(1), Int32(1), stream)
    if cfg.op == "wait":
        return (addr, state, Int32(0), Int32(1), Int32(1), Int64(1), Int32(1), stream)
    weights = slots = None
    if cfg.topk:
        weights = cute.runtime.make_fake_tensor(checks.cute_dtype(cfg.weight_dtype), (cute.sym_int(), cfg.topk),
                                                (cute.sym_int64(), 1), assumed_align=4)
        slots = ints
    return (_rows(cfg.dtype, cfg.vec, cfg.hidden), weights, slots, _rows(cfg.dtype, cfg.vec, cfg.hidden), addr,
            state, Int32(0), Int32(1), Int64(1), Int32(1), stream)


_KERNELS = {"ep_send": _EpSend, "ep_return": _EpReturn, "wait": _Wait, "tp_reduce": _TpReduce}


def compile(config: PeerConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config`; its arguments are those of the kernel class's __call__."""
    return jit.compile_variant(config.variant(), lambda: (_KERNELS[config.op](config), _fake_args(config)))
