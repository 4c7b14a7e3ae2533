"""Peer-memory kernels of MoE across the GPUs of one node (rosekernels.moe: ExpertParallel,
TensorParallel). Not tunable kernels of the contract: they take part in a protocol between ranks.

Every rank owns an *arena*, one byte buffer of the same layout on each rank, mapped into every
rank's address space (torch SymmetricMemory, or n buffers on one GPU when the ranks are emulated).
A kernel gets `addr` [world, regions] int64: the address of each region of each rank's arena as
this process sees it, so one kernel serves any number of ranks. Every access to an arena is
explicit PTX: 16-byte vectors for rows, a system-scope release for a flag after the data it
publishes (every thread fences at system scope, the CTA synchronises, then a thread stores the flag
with `st.release.sys`, or, storing several, fences once and stores them `st.relaxed.sys`), and
`ld.acquire.sys` to poll one (with a nanosleep backoff; the error word and the clock every few polls).

Why the flag thread's release covers every thread's data stores (PTX ISA, memory consistency model):
a `bar.sync` synchronizes with the `bar.sync` of every other thread on the same barrier, and a release
synchronizes with an acquire (both morally strong: `.sys`) that reads its value (8.9.4, Memory
synchronization); base causality order chains program order and synchronization transitively (8.9.5:
"the transitivity of base causality order accounts for the cumulativity of synchronizing
operations"). So any thread's data store -> its barrier -> the flag thread's barrier -> its
`st.release.sys` -> a peer's `ld.acquire.sys` of the flag -> the peer's later reads is one causality
chain, and those reads return the data or something later (axiom Causality). CUTLASS's arrive_inc and
cooperative groups' grid sync rest on the same pattern. The per-thread `fence.acq_rel.sys` before the
barrier is therefore redundant; it stays until a two-GPU measurement says what dropping it saves (the
`fence="none"` build). Stream order is the model's too (8.9.4, API synchronization: a task's
completion synchronizes with the start of the next task in its stream).

Step state. The arena's first region (`STATE`, the same place in every layout, so the step stays
with the arena and not with the Python object driving it) holds `state` [4] int32: the number of
finished steps mod 2^32 (word 0), the CTAs counted out of the step's last kernel (word 1) and the
error word (int64, bytes 8-15). A step publishes flags for step = finished + 1; the last CTA out of
its last kernel advances word 0. No flag is ever reset, so CUDA-graph replays stay valid.

Flags are 64-bit: the step (mod 2^32) in the high half, the call's shape in the low half (tensor
parallel: the token count; expert parallel: 0). Steps compare mod 2^32 (int32(seen - step)), which
is exact because no flag a waiter reads is ever more than one step away from its own step: every flag
slot is written on every step (expert parallel: every row of every sender, whatever the batch;
tensor parallel: every one of the `slots` CTA flags, also those of CTAs a small batch does not
launch), and no rank starts step s + 2 before every peer has started s + 1. An expert-parallel wait
accepts exactly its step (a peer cannot be ahead: it would need this rank's returns first); a
tensor-parallel one its step or the next (a fast peer's), and a flag of its own step must carry its
own token count.

Reuse without resets: a region is written for step s + 1 only once nothing reads its step s. Expert
parallel: a rank's step s ends with a wait on every row of every peer's returns (all max_tokens,
also those past its batch), and a peer's ep_return flags a row only after its threads have read that
row's ids (and its grouping of step s read the rows before, in the peer's stream order); so when the
rank's ep_send of s + 1 overwrites its rows in the peers' receive regions, no peer still reads them.
A peer returns rows of s + 1 into this rank's return region only after receiving this rank's rows of
s + 1, sent after this rank's combine of s read that region (stream order). Tensor parallel: the two
inboxes alternate by parity, and a rank writes an inbox again (step s + 2) only after every rank's
CTA flag of step s + 1, which that rank stores after its whole kernel of step s has read the inbox.

Errors. A wait that outlasts `timeout_ns` (ERR_TIMEOUT), a flag further ahead than that
(ERR_AHEAD: another object on the arena, or a corrupt one), or a tensor-parallel flag of this step
with another token count (ERR_SHAPE) makes the waiting thread write one code (kind, its rank, the
peer's, both shapes) into the error word of every rank, its own included, by compare-and-swap from 0:
the first error stays, and nothing clears it. A wait also ends within CHECK_EVERY polls of its own
rank's error word being set, so after an error every later step of every rank runs without waiting
(in bounded time; its results are meaningless) until the host reads the word
(`rosekernels.moe.*.check`) and the ranks are rebuilt.

`fence` builds other release sides, for tests: "none" drops the redundant per-thread fences (correct,
see above: to be measured); "gpu" scopes the fences and flag stores to one GPU and "relaxed" stores
the flag `st.relaxed.sys` with no fence on its thread: both broken across GPUs, so the SASS check of
tests/kernels/test_moe_parallel.py must fail them, and the two-GPU soak runs the first to see what it
shows.

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
  flags its share of the `slots` CTA flags on every rank, waits for every rank's flag of its own
  index, and sums the n partials in rank order in fp32: every rank's output is bitwise the same. The
  grid (at most `slots`, one CTA per SM) is the same on every rank that passes the same token count.
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

# Regions of an arena (index into `addr`'s second dim): the step state first in every layout, then
# expert parallel: receive rows, ids, their flags, return rows, their flags;
# tensor parallel: two inboxes (by step parity), the CTA flags.
STATE = 0
EP_X, EP_IDS, EP_FLAG, EP_RET, EP_RFLAG = range(1, 6)
TP_INBOX, TP_FLAG = 1, 3
STATE_BYTES = 256  # the state region (16 bytes used)
STATE_STEP, STATE_ARRIVED = 0, 1  # int32 words of `state`; the error word is bytes 8-15
ERROR_OFFSET = 8
FLAG_BYTES = 8
MAX_CTAS = 1024  # flags per rank in a tensor-parallel arena: `slots` never exceeds it
MAX_SHAPE = (1 << 24) - 1  # the largest token count an error code records
# Error codes: kind << 60 | reporting rank << 54 | peer << 48 | the peer's shape << 24 | the reporter's.
ERR_TIMEOUT, ERR_AHEAD, ERR_SHAPE = 1, 2, 3
FENCES = ("sys", "none", "gpu", "relaxed")
THREADS = 128  # wait
# A waiting thread sleeps between polls of its flag (from SLEEP_MIN_NS, doubling up to SLEEP_MAX_NS: a
# flag is seen at most ~2 x SLEEP_MAX_NS late) and reads the error word and the clock every
# CHECK_EVERY polls only: thousands of waiting threads would otherwise poll the one error word and
# the timer back to back.
SLEEP_MIN_NS, SLEEP_MAX_NS = 32, 256
CHECK_EVERY = 8  # a power of two
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
    # The release side: "sys" is the protocol; "none" drops the (redundant) fences before the CTA
    # barrier; "gpu" scopes fences and flags to one GPU; "relaxed" stores the flags without a release.
    # Only tests build the last three (see the module docstring).
    fence: str = "sys"

    def __post_init__(self) -> None:
        if self.op not in ("ep_send", "ep_return", "wait", "tp_reduce"):
            raise ValueError(f"no peer kernel {self.op!r}")
        if not 1 <= self.world <= 32:
            raise ValueError(f"world size must be in [1, 32], got {self.world}")
        if self.op != "wait" and (self.hidden <= 0 or self.hidden % checks.vector_elems(self.dtype)):
            raise ValueError(f"hidden size must be a positive multiple of 16 bytes, got {self.hidden}")
        if self.fence not in FENCES:
            raise ValueError(f"fence must be one of {FENCES}, got {self.fence!r}")

    @property
    def vec(self) -> int:
        return checks.vector_elems(self.dtype)

    def variant(self) -> Variant:
        return Variant.of(f"moe_{self.op}", "decode", **{f.name: getattr(self, f.name)
                                                           for f in dataclasses.fields(self) if f.name != "op"})


def error_fields(code: int) -> tuple[int, int, int, int, int]:
    """(kind, reporting rank, peer, the peer's shape, the reporter's shape) of an error word."""
    return code >> 60 & 7, code >> 54 & 63, code >> 48 & 63, code >> 24 & MAX_SHAPE, code & MAX_SHAPE


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
def _release(addr: Int64, flag: Int64, fence: cutlass.Constexpr[str], sem: cutlass.Constexpr[str] = "release"):
    """st.release of a flag; sem="relaxed" after this thread's own release fence (`_release_fence`),
    for a thread storing several (one fence instead of one per store)."""
    scope = "gpu" if fence == "gpu" else "sys"
    sem = "relaxed" if fence == "relaxed" else sem
    cute.arch.inline_ptx("st." + sem + "." + scope + ".global.b64 [{$r0}], {$r1};", read_only_args=[addr, flag])


@cute.jit
def _release_fence(fence: cutlass.Constexpr[str]):
    if const_expr(fence == "gpu"):
        cute.arch.fence_acq_rel_gpu()
    if const_expr(fence in ("sys", "none")):
        cute.arch.fence_acq_rel_sys()


@cute.jit
def _acquire(addr: Int64) -> Int64:
    return cute.arch.inline_ptx("ld.acquire.sys.global.b64 {$w0}, [{$r0}];", write_only_types=[Int64],
                                read_only_args=[addr])


@cute.jit
def _load_error(addr: Int64) -> Int64:
    return cute.arch.inline_ptx("ld.relaxed.sys.global.b64 {$w0}, [{$r0}];", write_only_types=[Int64],
                                read_only_args=[addr])


@cute.jit
def _nanosleep(ns: Int32):
    cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[ns])


@cute.jit
def _flag(step: Int32, shape: Int32) -> Int64:
    return (Int64(step) << 32) | Int64(shape)


@cute.jit
def _steps_apart(seen: Int64, step: Int32) -> Int32:
    """The flag's step minus `step`, mod 2^32 (exact: see the module docstring)."""
    return Int32(seen >> 32) - step


@cute.jit
def _fail(mAddr: cute.Tensor, world: cutlass.Constexpr[int], kind: Int32, me: Int32, peer: Int32, theirs: Int32,
          mine: Int32):
    """Write the error's code into every rank's error word that holds none yet."""
    code = ((Int64(kind) << 60) | (Int64(me) << 54) | (Int64(peer) << 48) | (Int64(theirs & MAX_SHAPE) << 24)
            | Int64(mine & MAX_SHAPE))
    for r in cutlass.range_constexpr(world):
        cute.arch.inline_ptx("atom.relaxed.sys.global.cas.b64 {$w0}, [{$r0}], {$r1}, {$r2};",
                             write_only_types=[Int64], read_only_args=[mAddr[r, STATE] + ERROR_OFFSET, Int64(0),
                                                                       code])


@cute.jit
def _await(flag: Int64, step: Int32, shape: Int32, me: Int32, peer: Int32, mAddr: cute.Tensor, timeout_ns: Int64,
           world: cutlass.Constexpr[int], ahead_ok: cutlass.Constexpr[int], check_shape: cutlass.Constexpr[bool]):
    """Poll the flag at `flag` (in rank `me`'s arena, written by `peer`) until it carries `step` or a
    later step, `me`'s error word is set, or `timeout_ns` passes (both seen every CHECK_EVERY polls,
    the polls spaced by a growing sleep). Then a flag still behind, one more than `ahead_ok` steps
    ahead, or (check_shape) one of this step with another shape fails the step on every rank, unless
    it has failed already."""
    own = mAddr[me, STATE] + ERROR_OFFSET
    seen = _acquire(flag)
    error = _load_error(own)
    start = cute.arch.globaltimer()
    waited = Int64(0)
    polls = Int32(0)
    sleep = Int32(SLEEP_MIN_NS)
    while (_steps_apart(seen, step) < 0) & (error == 0) & (waited < timeout_ns):
        _nanosleep(sleep)
        sleep = cutlass.min(sleep * 2, Int32(SLEEP_MAX_NS))
        seen = _acquire(flag)
        polls = polls + 1
        if polls & (CHECK_EVERY - 1) == 0:
            error = _load_error(own)
            waited = cute.arch.globaltimer() - start
    if error == 0:
        apart = _steps_apart(seen, step)
        kind = Int32(0)
        if apart < 0:
            kind = Int32(ERR_TIMEOUT)
        if apart > ahead_ok:
            kind = Int32(ERR_AHEAD)
        if const_expr(check_shape):
            if (apart == 0) & (Int32(seen) != shape):
                kind = Int32(ERR_SHAPE)
        if kind != 0:
            _fail(mAddr, world, kind, me, peer, Int32(seen), shape)


@cute.jit
def _publish(fence: cutlass.Constexpr[str]):
    """Make this thread's writes visible system-wide, then let one thread of the CTA store a flag."""
    if const_expr(fence == "sys"):
        cute.arch.fence_acq_rel_sys()
    if const_expr(fence == "gpu"):
        cute.arch.fence_acq_rel_gpu()
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
            _publish(self.cfg.fence)
            if tid < n:
                _release(mAddr[tid, EP_FLAG] + row * FLAG_BYTES, _flag(step, Int32(0)), self.cfg.fence)
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
            _publish(self.cfg.fence)
            if tid == 0:
                _release(mAddr[s, EP_RFLAG] + Int64(rank * max_tokens + t) * FLAG_BYTES, _flag(step, Int32(0)),
                         self.cfg.fence)
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
            _await(mAddr[rank, self.cfg.region] + Int64(s * stride + i - s * rows) * FLAG_BYTES, step, Int32(0),
                   rank, s, mAddr, timeout_ns, self.n, 0, False)
        if const_expr(self.cfg.bump):
            _finish_step(mState, step, tid)


class _TpReduce(_Rows):

    @cute.jit
    def __call__(self, mY: cute.Tensor, mW: Optional[cute.Tensor], mSlot: Optional[cute.Tensor], mOut: cute.Tensor,
                 mAddr: cute.Tensor, mState: cute.Tensor, rank: Int32, max_tokens: Int32, timeout_ns: Int64,
                 slots: Int32, num_ctas: Int32, stream):
        self.kernel(mY, mW, mSlot, mOut, mAddr, mState, rank, max_tokens, timeout_ns, slots).launch(
            grid=[num_ctas, 1, 1], block=[TP_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mW: Optional[cute.Tensor], mSlot: Optional[cute.Tensor], mOut: cute.Tensor,
               mAddr: cute.Tensor, mState: cute.Tensor, rank: Int32, max_tokens: Int32, timeout_ns: Int64,
               slots: Int32):
        n, k, hv = self.n, self.k, self.hv
        tid = cute.arch.thread_idx()[0]
        bid = cute.arch.block_idx()[0]
        grid = cute.arch.grid_dim()[0]
        step = mState[STATE_STEP] + 1
        inbox = TP_INBOX + (step & 1)
        tokens = mOut.shape[0]
        total = tokens * hv
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
        _publish(self.cfg.fence)
        # Every one of the `slots` flags on every rank, also those of CTAs this grid lacks (this CTA
        # takes slots bid, bid + grid, ...): no flag is ever more than a step old (module docstring).
        # One release fence per thread, then its stores (a small grid gives a thread several).
        flag = _flag(step, tokens)
        flags = n * ((slots - bid + grid - 1) // grid)
        if tid < flags:
            _release_fence(self.cfg.fence)
        j = tid
        while j < flags:
            c = j // n
            _release(mAddr[j - c * n, TP_FLAG] + Int64(rank * MAX_CTAS + bid + c * grid) * FLAG_BYTES, flag,
                     self.cfg.fence, "relaxed")
            j += TP_THREADS
        if tid < n:
            _await(mAddr[rank, TP_FLAG] + Int64(tid * MAX_CTAS + bid) * FLAG_BYTES, step, tokens, rank, tid, mAddr,
                   timeout_ns, n, 1, True)
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
            state, Int32(0), Int32(1), Int64(1), Int32(1), Int32(1), stream)


_KERNELS = {"ep_send": _EpSend, "ep_return": _EpReturn, "wait": _Wait, "tp_reduce": _TpReduce}


def compile(config: PeerConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config`; its arguments are those of the kernel class's __call__."""
    return jit.compile_variant(config.variant(), lambda: (_KERNELS[config.op](config), _fake_args(config)))
