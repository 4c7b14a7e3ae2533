"""MoE across the GPUs of one node: expert parallel and tensor parallel over NVLink.

    ep = ExpertParallel(num_experts=256, hidden=7168, max_tokens=128, topk=8, group=dist.group.WORLD)
    got = ep.dispatch(x, topk_ids, topk_weights)   # MoeDispatch of this rank's experts, from every rank's tokens
    ep.combine(grouped_gemm(got.buffer, got.offsets)) -> [T, H]: this rank's tokens, weighted sums

    tp = TensorParallel(num_experts=128, hidden=2048, max_tokens=4096, topk=8, group=...)
    got = tp.dispatch(x, topk_ids)                 # the same x on every rank; this rank's experts
    tp.combine(grouped_gemm(got.buffer, got.offsets), topk_weights, got.slot_map) -> [T, H] summed over ranks

Both keep their cross-rank state in a per-rank arena mapped into every rank (`Peers`: torch
SymmetricMemory over a process group, or `Peers.emulated`: n arenas on one GPU, for testing a
protocol where one GPU is all there is; SymmetricMemory refuses two ranks on one device). The kernels
and the flag protocol (step counters that live in the arena, flags that carry the step and the call's
shape, no reset, a timeout instead of a hang) are described in rosekernels/kernels/moe_peer.py.
Nothing synchronises with the host: every call can be captured in a CUDA graph, and `check()` (which
does synchronise) turns a failed step, a dropped pair or an invalid id into an exception.

Errors. A wait past `timeout_ms`, ranks that pass different token counts to a tensor-parallel call,
or a flag too far ahead fail the step on every rank at once (the device writes the error into every
rank's error word, also inside a CUDA graph; nothing clears it): every rank's next `check()` raises
(TimeoutError for a timeout, else RuntimeError), and from then on every call of every rank runs
without waiting, in bounded time, with meaningless results, until its `check()`; after that raised,
the object refuses further calls. The state is unusable after an error (the ranks' steps disagree and
an arena may hold half of a step). Rebuild: drop every rank's object and build new ones, with new
arenas (`peers=None` allocates one per object, collectively; emulated ranks: new `Peers.emulated`):
an arena that holds an error refuses new objects.

One object per arena: its step state lives in the arena, so an object claims its `Peers` and a
second live object on them is refused; once the first is gone, a new object of the same layout
continues its step (one of another layout is refused: it would misread the flags; so is any on an
arena left mid-step, an expert-parallel dispatch whose combine never ran, as when an exception between
the two drops the object: its first dispatch would repeat the abandoned step, whose flags the peers
already hold; `Peers` track that by the calls made, not by graph replays). The claim is the
last step of a construction, after every kernel was loaded, and it is collective: every rank's object
must agree on the layout (its class, world, experts, hidden size, max_tokens, topk, dtypes, SM count
and arena regions: ranks that differ would misread each other's flags or write past each other's
regions), compared by an all_gather that also keeps any rank from starting a step before all are
built; a disagreement, or an arena that cannot serve on any rank, refuses the construction on every
rank. A construction that raises on some ranks only before the claim (an argument only they reject,
a kernel that fails to build or load, memory they cannot get) is not told to the others: they wait
in their collective steps (`Peers.symmetric`'s allocation and rendezvous, the claim's all_gather)
until the process group's timeout. Pass every rank the same arguments, and let an exception end the
job (torchrun does). Emulated ranks are built one after another: each is compared with the other
ranks' live objects, and on a disagreement those are marked failed too (their next call raises).
Eager calls run on one stream (an emulated rank's own `stream`; else the first eager call's): the
protocol reuses the arena on the strength of stream order, so a call from another stream is refused.
Calls captured in a CUDA graph are not checked: replay them on that stream, or order them with it by
events.

Expert parallel (DP = n): rank r owns experts r*E/n .. (r+1)*E/n - 1. dispatch sends each token once
to every rank owning one of its experts (16-byte vectors into a per-sender receive region, then a
per-token release flag), waits for every sender's flags, and groups what arrived with the local
`moe_dispatch` (ranged to this rank's experts) for the grouped GEMM. combine sends each expert output
row back to its token's pair row on the source rank (flag per token), waits, and reduces with the
routing weights there (`moe_combine`): bitwise what one GPU's dispatch + combine of the same rows give.
Ids outside [-1, E) reach every rank, so every rank's dispatch refuses the step (see moe_dispatch).

Tensor parallel (TP = n): every rank holds all tokens; dispatch is `moe_dispatch` ranged to this
rank's experts; combine is the local weighted sum followed by a sum over the ranks: for decode (up to
moe_combine's decode token count) one launch that pushes each CTA's partial to every rank and adds
the n partials (`tp_reduce`); for prefill `moe_combine` then the same reduce of its output. Each
rank's partial is rounded once to the dtype, then the n partials are added in rank order in fp32, so
every rank gets the same bits.

Every rank makes the same calls in the same order (expert parallel: dispatch, combine, dispatch, ...;
a call out of turn raises); tensor parallel also needs the same token count on every rank (its flags
carry the count: ranks that disagree fail the step on all of them). A call one rank skips is seen only
when a wait times out: until then the peers' calls pair with the wrong ones (no rank can tell a call
skipped from one added), so treat every result since the last clean `check()` as suspect. Emulated
ranks share one GPU: run each rank's calls on its own `stream` (their kernels wait for each other, so
one host thread must launch all ranks' work before waiting on any).
"""
from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from rosekernels import checks, launch
from rosekernels.kernels import moe_peer
from rosekernels.kernels.moe_combine_plan import DECODE_MAX_TOKENS
from rosekernels.kernels.moe_combine_plan import choose_mode as combine_mode
from rosekernels.kernels.moe_common import DTYPES, MoeDispatch, check_sm90
from rosekernels.kernels.moe_dispatch_plan import DECODE_MAX_PAIRS, DEFAULT_BLOCK_SIZE
from rosekernels.ops.moe_combine import moe_combine
from rosekernels.ops.moe_dispatch import moe_dispatch

ALIGN = 256  # arena regions start on 256-byte boundaries
MAX_WORLD = 32  # ranks: a bit each in the send kernel's destination mask
MAX_TOPK = 64  # moe_combine's limit; the send kernel writes the ids with one thread each
MAX_TOKENS = moe_peer.MAX_SHAPE  # a token count must fit an error code
DEFAULT_TIMEOUT_MS = 10_000
FORMS = ("ExpertParallel", "TensorParallel")
MAX_REGIONS = 6  # an arena's regions (expert parallel's)
# What every rank's object must agree on, in the order of _Parallel.layout_key (ints).
LAYOUT_FIELDS = ("form", "world", "num_experts", "hidden", "max_tokens", "topk", "dtype", "weight_dtype", "sms",
                 "arena bytes") + tuple(f"region {i}'s offset" for i in range(MAX_REGIONS))
# Why a rank's arena cannot serve a new object (codes exchanged with the layout; 0: it can).
IN_USE, OTHER_LAYOUT, HOLDS_ERROR, MID_STEP = 1, 2, 3, 4


class Peers:
    """The arenas of `world` ranks as seen from `rank`: this rank's own (`arena`, uint8) and every
    rank's base address in this process (`bases`; bases[rank] must be the arena's own address)."""

    def __init__(self, rank: int, world: int, arena: torch.Tensor, bases: list[int], group: Any = None,
                 sms: int | None = None, keep: Any = None):
        _check_bases(rank, world, arena.data_ptr(), bases)
        self.rank, self.world, self.arena, self.bases, self.group = rank, world, arena, bases, group
        self.device = arena.device
        self.stream = torch.cuda.Stream(self.device) if group is None else None
        # Grids that wait for each other's CTAs must match on every rank: the fewest SMs of any.
        self.sms = _sms(self.device) if sms is None else sms
        self._keep = keep  # what keeps every arena mapped (all of them, for emulated ranks)
        self._owner: weakref.ref | None = None
        self._layout: tuple | None = None
        self._siblings: list[Peers] | None = None  # emulated ranks: every rank's Peers (claim compares them)
        # An expert-parallel dispatch whose combine has not been issued. Kept here, not in the object: a
        # new object on an arena left mid-step would publish the abandoned step's number again, which the
        # peers' flags already carry (their waits would pass at once, on rows still being rewritten).
        self._mid_step = False

    @classmethod
    def symmetric(cls, nbytes: int, group: Any = None, device: Any = None) -> "Peers":
        """One arena per rank of `group` (default: the world) in torch SymmetricMemory, zeroed."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        group = group or dist.group.WORLD
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        arena = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(arena, group)
        arena.zero_()
        sms = torch.tensor([_sms(device)], dtype=torch.int32, device=device)
        dist.all_reduce(sms, dist.ReduceOp.MIN, group)  # also orders the zeroing before any rank's first step
        torch.cuda.synchronize(device)
        # A tensor may start past its rank's buffer (an allocation from a pool): every rank's address of
        # this arena is buffer + offset (torch without `offset` places it at the start).
        offset = getattr(handle, "offset", 0)
        return cls(handle.rank, handle.world_size, arena, [p + offset for p in handle.buffer_ptrs], group,
                   int(sms.item()), handle)

    @classmethod
    def emulated(cls, world: int, nbytes: int, device: Any = None) -> list["Peers"]:
        """`world` ranks on one GPU: one zeroed arena each, every rank seeing all of them."""
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        arenas = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world)]
        bases = [a.data_ptr() for a in arenas]
        peers = [cls(r, world, arenas[r], bases, keep=arenas) for r in range(world)]
        for p in peers:
            p._siblings = peers
        return peers

    def claim(self, owner: Any, layout: tuple[int, ...]) -> None:
        """Make `owner` the one object on this arena (its step state and flags are the arena's) if every
        rank's object agrees on `layout` (ints, LAYOUT_FIELDS) and every rank's arena can serve it
        (none in use by a live object, none that served another layout, none holding an error, none left
        mid-step);
        otherwise refuse on every rank (see the module docstring; emulated ranks: a rank whose own
        arena cannot serve refuses alone, a disagreement also fails the other ranks' live objects)."""
        code, problem = self._problem(layout)
        rows = self._exchange([code, *layout])
        refusal = problem if problem is not None else _refusal(rows)
        if refusal is not None:
            if not code and self.group is None:
                for other in self._siblings or ():
                    live = other._owner() if other is not self and other._owner is not None else None
                    if live is not None:
                        live._failed = str(refusal)
            raise refusal
        self._owner, self._layout = weakref.ref(owner), layout

    def _problem(self, layout: tuple[int, ...]) -> tuple[int, Exception | None]:
        """(code, exception) of why this arena cannot serve an object of `layout`; (0, None) if it can."""
        other = self._owner() if self._owner is not None else None
        if other is not None:
            return IN_USE, ValueError(f"rank {self.rank}'s arena is in use by a live {type(other).__name__}: one "
                                      "object per arena (build new Peers for another)")
        if self._layout is not None and self._layout != layout:
            return OTHER_LAYOUT, _problem_error(self.rank, OTHER_LAYOUT)
        error = self.arena[moe_peer.ERROR_OFFSET:moe_peer.ERROR_OFFSET + 8].view(torch.int64)
        if int(error.item()):
            return HOLDS_ERROR, _problem_error(self.rank, HOLDS_ERROR)
        if self._mid_step:
            return MID_STEP, _problem_error(self.rank, MID_STEP)
        return 0, None

    def _exchange(self, row: list[int]) -> list[list[int] | None]:
        """Every rank's `row`, by rank: an all_gather over the process group; emulated ranks (no group):
        for the others, the layout their live objects claimed with, None for a rank without one."""
        if self.group is not None:
            import torch.distributed as dist

            mine = torch.tensor(row, dtype=torch.int64, device=self.device)
            every = torch.empty(self.world, len(row), dtype=torch.int64, device=self.device)
            dist.all_gather_into_tensor(every, mine, group=self.group)
            return every.tolist()
        rows: list[list[int] | None] = [None] * self.world
        for p in self._siblings or [self]:
            live = p._owner() if p._owner is not None else None
            rows[p.rank] = row if p is self else [0, *p._layout] if live is not None else None
        return rows

    def addresses(self, offsets: list[int]) -> torch.Tensor:
        """[world, regions] int64: where each region of each rank's arena is, for the kernels."""
        return torch.tensor([[b + o for o in offsets] for b in self.bases], dtype=torch.int64, device=self.device)

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A region of this rank's own arena as a tensor."""
        n = math.prod(shape) * dtype.itemsize
        return self.arena[offset:offset + n].view(dtype).view(shape)


def _check_bases(rank: int, world: int, own: int, bases: list[int]) -> None:
    """The kernels reach every arena, this rank's included, through `bases`; the ops through the
    arena tensor: both must name the same memory."""
    if not 0 <= rank < world or len(bases) != world:
        raise ValueError(f"rank {rank} of {world} with {len(bases)} arena addresses")
    if bases[rank] != own:
        raise ValueError(f"rank {rank}'s arena is at {own:#x}, but its address for the kernels is "
                         f"{bases[rank]:#x}: the address translation is wrong")
    if any(b % 16 for b in bases):
        raise ValueError(f"arena addresses must be 16-byte aligned, got {[hex(b) for b in bases]}")


def _problem_error(rank: int, code: int) -> Exception:
    if code == IN_USE:
        return ValueError(f"rank {rank}'s arena is in use by a live object: one object per arena (build new Peers "
                          "for another)")
    if code == OTHER_LAYOUT:
        return ValueError(f"rank {rank}'s arena served an object of another layout, whose flags this one would "
                          "misread: build new Peers")
    if code == MID_STEP:
        return RuntimeError(f"rank {rank}'s arena was left mid-step (a dispatch whose combine never ran: its object "
                            "was dropped between them), which a new object would misread: build new Peers")
    return RuntimeError(f"rank {rank}'s arena holds the error of an earlier step: build new Peers")


def _show(field: str, value: int) -> str:
    if field == "form":
        return FORMS[value]
    if field in ("dtype", "weight_dtype"):
        return str(list(checks.DTYPE_NAME)[value]).replace("torch.", "")
    return str(value)


def _refusal(rows: list[list[int] | None]) -> Exception | None:
    """Why every rank's new object is refused, given every rank's [problem code, *layout key] (None:
    an emulated rank not built yet): the first rank whose arena cannot serve, else the first field
    of LAYOUT_FIELDS on which the ranks disagree; None when they all agree."""
    for r, row in enumerate(rows):
        if row is not None and row[0]:
            return _problem_error(r, row[0])
    built = [(r, row[1:]) for r, row in enumerate(rows) if row is not None]
    for i, field in enumerate(LAYOUT_FIELDS):
        if len({key[i] for _, key in built}) > 1:
            values = ", ".join(f"rank {r}: {_show(field, key[i])}" for r, key in built)
            return ValueError(f"the ranks' objects disagree on {field} ({values}): every rank must build the "
                              "same object (one that differs would misread the others' flags or write past their "
                              "regions)")
    return None


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    return offsets, end


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _flag_value(step: int) -> int:
    """The int64 flag a step publishes with shape 0, as torch stores it."""
    v = (step % (1 << 32)) << 32
    return v - (1 << 64) if v >= 1 << 63 else v


class _Parallel:
    """What both forms share: sizes, the arena and its step state, the timeout, the stream, check()."""

    FORM = -1  # index into FORMS
    FLAG_REGIONS: tuple[int, ...] = ()
    fence = "sys"  # the peer kernels' release side (tests build weakened subclasses: moe_peer.PeerConfig)

    def __init__(self, num_experts: int, hidden: int, max_tokens: int, topk: int, dtype: torch.dtype,
                 weight_dtype: torch.dtype, group: Any, peers: Peers | None, timeout_ms: float):
        world = peers.world if peers is not None else _world(group)
        _check_args(world, num_experts, hidden, max_tokens, topk, dtype, weight_dtype, timeout_ms)
        self.num_experts, self.hidden, self.max_tokens, self.topk, self.dtype, self.weight_dtype = (
            num_experts, hidden, max_tokens, topk, dtype, weight_dtype)
        self.experts_per_rank = num_experts // world
        self.timeout_ns = int(timeout_ms * 1e6)
        self.sizes = self.regions(world, hidden, max_tokens, topk, dtype)
        self.offsets, nbytes = _layout(self.sizes)
        self.arena_bytes = nbytes
        if peers is None:
            peers = Peers.symmetric(nbytes, group)
        elif peers.arena.numel() < nbytes:
            raise ValueError(f"the peers' arenas hold {peers.arena.numel()} bytes; this needs {nbytes}")
        check_sm90(peers.device)
        self.peers, self.rank, self.world, self.device = peers, peers.rank, peers.world, peers.device
        self.addr = peers.addresses(self.offsets)
        # see moe_peer: step, arrivals, the error word (int64): the arena's, so that peers can set it
        self.state = peers.view(self.offsets[moe_peer.STATE], (4,), torch.int32)
        self.sms = peers.sms
        self.dtype_name = checks.DTYPE_NAME[dtype]
        self._stream = None if peers.stream is None else peers.stream.cuda_stream  # see _enter
        self._failed = ""  # why this object is unusable, once it is

    @classmethod
    def emulated(cls, world: int, num_experts: int, hidden: int, max_tokens: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16, **kw: Any) -> list:
        """`world` ranks on the current GPU, each with its own stream (`.stream`)."""
        _check_args(world, num_experts, hidden, max_tokens, topk, dtype, kw.get("weight_dtype", torch.float32),
                    kw.get("timeout_ms", DEFAULT_TIMEOUT_MS))
        _, nbytes = _layout(cls.regions(world, hidden, max_tokens, topk, dtype))
        return [cls(num_experts, hidden, max_tokens, topk, dtype, peers=p, **kw)
                for p in Peers.emulated(world, nbytes)]

    @classmethod
    def layout_key(cls, world: int, num_experts: int, hidden: int, max_tokens: int, topk: int, dtype: torch.dtype,
                   weight_dtype: torch.dtype, sms: int) -> tuple[int, ...]:
        """What every rank's object must agree on, as ints (LAYOUT_FIELDS)."""
        sizes = cls.regions(world, hidden, max_tokens, topk, dtype)
        offsets, nbytes = _layout(sizes)
        dtypes = list(checks.DTYPE_NAME)
        return (cls.FORM, world, num_experts, hidden, max_tokens, topk, dtypes.index(dtype), dtypes.index(weight_dtype),
                sms, nbytes, *offsets, *[-1] * (MAX_REGIONS - len(offsets)))

    @property
    def local_experts(self) -> tuple[int, int]:
        """(first, count) of this rank's experts."""
        return self.rank * self.experts_per_rank, self.experts_per_rank

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The stream an emulated rank runs on (None for real ranks)."""
        return self.peers.stream

    def _enter(self) -> None:
        """Before a call launches peer kernels: refused after a failed step, or from a second stream."""
        if self._failed:
            raise RuntimeError(f"rank {self.rank}: {self._failed}; this object is unusable: build new ones on every "
                               "rank (see rosekernels.moe)")
        if torch._C._cuda_isCurrentStreamCapturing():
            return  # replays run on whatever stream replays them (see the module docstring)
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)  # a microsecond less than Stream objects
        if self._stream is None:
            self._stream = stream
        elif stream != self._stream:
            raise RuntimeError(f"rank {self.rank}: a call on stream {stream:#x}, but this object's calls run on "
                               f"stream {self._stream:#x}: the protocol relies on their order (one stream per "
                               "object)")

    def _check_error(self) -> None:
        torch.cuda.synchronize(self.device)  # every stream: the calls may run on one that is not current
        code = int(self.state[2:].view(torch.int64).item())
        if code:
            self._failed = "a step failed (check() raised)"
            raise _error(code, self.rank, self.timeout_ns)

    def _check_rows(self, name: str, t: Any, rows: int | None = None) -> None:
        checks.check_cuda(name, t)
        checks.check_dtype(name, t, (self.dtype,))
        checks.check_shape(name, t, (rows, self.hidden))
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}; this rank runs on {self.device}")
        checks.check_unit_last_stride(name, t)
        checks.check_aligned(name, t)

    def _check_routing(self, name: str, t: Any, tokens: int, dtypes: tuple[torch.dtype, ...]) -> None:
        checks.check_cuda(name, t)
        checks.check_dtype(name, t, dtypes)
        checks.check_shape(name, t, (tokens, self.topk))
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}; this rank runs on {self.device}")
        checks.check_unit_last_stride(name, t)

    def _kernel(self, op: str, **params: Any):
        return moe_peer.compile(moe_peer.PeerConfig(op, self.world, fence=self.fence, **params)).fn

    def _scratch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(state, addr, buffer) for launches on nothing: every rank's state region at the buffer's
        start and every other region after it (room for a reduce's CTA flags: launches on nothing touch
        no other); keep the buffer until they ran."""
        buf = torch.zeros(moe_peer.STATE_BYTES + self.world * moe_peer.MAX_CTAS * moe_peer.FLAG_BYTES,
                          dtype=torch.uint8, device=self.device)
        row = [buf.data_ptr()] + [buf.data_ptr() + moe_peer.STATE_BYTES] * (len(self.offsets) - 1)
        addr = torch.tensor([row] * self.world, dtype=torch.int64, device=self.device)
        return buf[:16].view(torch.int32), addr, buf

    def _preloaded(self) -> None:
        # CUDA loads a kernel at its first launch and, to do so, waits for the device to idle, which
        # a spinning wait for a peer does not allow (with ranks emulated on one GPU it never would;
        # across GPUs a first step could outlast the timeout): so every kernel a step launches was
        # launched once, on nothing, before the first step, and no rank starts one before all are ready
        # (the claim's all_gather). Only then is the arena claimed: a construction that failed before
        # leaves it as it was.
        torch.cuda.synchronize(self.device)
        self.peers.claim(self, self.layout_key(self.world, self.num_experts, self.hidden, self.max_tokens, self.topk,
                                               self.dtype, self.weight_dtype, self.sms))

    def _wait(self, fn: Any, rows: int, state: torch.Tensor | None = None, addr: torch.Tensor | None = None) -> None:
        """Launch a `wait` kernel on the first `rows` flags of each sender."""
        grid = max(1, -(-self.world * rows // moe_peer.THREADS))
        launch.on_device(self.device.index, fn, self.addr if addr is None else addr,
                         self.state if state is None else state, self.rank, rows, self.max_tokens,
                         self.timeout_ns, grid)

    def _preset_step(self, steps: int) -> None:
        """Put this rank's arena where `steps` clean steps would have left it: the step counter, every
        flag at that step (tests: the counter near 2^31 and 2^32 without running 2^31 steps). Every
        rank must be preset to the same count, with no call in flight."""
        torch.cuda.synchronize(self.device)
        self.state.zero_()
        self.state[moe_peer.STATE_STEP] = (steps + (1 << 31)) % (1 << 32) - (1 << 31)
        for region in self.FLAG_REGIONS:
            self.peers.view(self.offsets[region], (self.sizes[region] // moe_peer.FLAG_BYTES,),
                            torch.int64).fill_(_flag_value(steps))
        torch.cuda.synchronize(self.device)


# Given outs' checks by signature: what the strides decide (elements of its own, the Disjoint) made once.
_out_checks = launch.PlanCache()


def _check_out(out: torch.Tensor, in_place: str | None, **inputs: torch.Tensor) -> None:
    """Before any launch: a given out's elements are distinct, and it shares memory with none of the `inputs`,
    which other CTAs (or moe_combine, after the step's peer kernels) still read while one writes out, except
    that it may be exactly `in_place`."""
    key = (in_place, out.shape, out.stride(), out.dtype, *[(t.shape, t.stride(), t.dtype) for t in inputs.values()],
           *inputs)
    disjoint = _out_checks.get(key)
    if disjoint is None:
        checks.check_not_expanded("out", out)
        disjoint = _out_checks.put(key, checks.Disjoint({**inputs, "out": out}, ("out",),
                                                        {"out": in_place} if in_place else {}))
    disjoint.check(*inputs.values(), out)


def _error(code: int, rank: int, timeout_ns: int) -> Exception:
    """The exception of an error word (moe_peer: kind, reporting rank, peer, both token counts)."""
    kind, reporter, peer, theirs, mine = moe_peer.error_fields(code)
    rebuild = "; the ranks are out of step: build new objects on every rank (see rosekernels.moe)"
    if kind == moe_peer.ERR_TIMEOUT:
        return TimeoutError(f"rank {rank}: rank {peer} did not signal within {timeout_ns / 1e6:g} ms (seen by "
                            f"rank {reporter}){rebuild}")
    if kind == moe_peer.ERR_SHAPE:
        return RuntimeError(f"rank {rank}: a tensor-parallel call with {mine} tokens on rank {reporter} and "
                            f"{theirs} on rank {peer} (every rank must pass the same count){rebuild}")
    if kind == moe_peer.ERR_AHEAD:
        return RuntimeError(f"rank {rank}: rank {reporter} read a flag of rank {peer} from a later step than "
                            f"any peer can be at (another object on the arena, or a corrupt one){rebuild}")
    return RuntimeError(f"rank {rank}: unknown error word {code:#x}{rebuild}")


def _world(group: Any) -> int:
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("no process group: call torch.distributed.init_process_group (torchrun), or pass "
                           "peers=Peers.emulated(...)[rank]")
    return dist.get_world_size(group)


def _check_args(world: int, num_experts: Any, hidden: Any, max_tokens: Any, topk: Any, dtype: Any,
                weight_dtype: Any, timeout_ms: Any) -> None:
    """Every constructor argument, before anything is allocated."""
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be one of {[str(d) for d in DTYPES]}, got {dtype!r}")
    if weight_dtype not in (torch.float32, dtype):
        raise TypeError(f"weight_dtype must be float32 or {dtype}, got {weight_dtype!r}")
    for name, v in (("world", world), ("num_experts", num_experts), ("hidden", hidden), ("max_tokens", max_tokens),
                    ("topk", topk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if world > MAX_WORLD:
        raise ValueError(f"at most {MAX_WORLD} ranks, got {world}")
    if max_tokens > MAX_TOKENS:
        raise ValueError(f"max_tokens must be at most {MAX_TOKENS}, got {max_tokens}")
    if num_experts % world:
        raise ValueError(f"num_experts {num_experts} must split evenly over {world} ranks")
    if topk > MAX_TOPK:
        raise ValueError(f"topk must be at most {MAX_TOPK}, got {topk}")
    if hidden % checks.vector_width(dtype):
        raise ValueError(f"hidden {hidden} must be a multiple of {checks.vector_width(dtype)} (16 bytes)")
    # tp_reduce's int32 vector index reaches tokens * hidden / vec plus one grid-stride step, up to
    # MAX_CTAS * TP_THREADS (more than checks.INDEX_SLACK, the margin of moe_combine's bound).
    if max_tokens * (hidden // checks.vector_width(dtype)) + moe_peer.MAX_CTAS * moe_peer.TP_THREADS >= 2**31:
        raise ValueError(f"max_tokens x hidden ({max_tokens} x {hidden}) exceeds the kernels' 32-bit indexing")
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, (int, float)) or not 0 < timeout_ms < 1e9:
        raise ValueError(f"timeout_ms must be a positive number of milliseconds (under 1e9), got {timeout_ms!r}")


class ExpertParallel(_Parallel):
    """Expert-parallel dispatch/combine over the ranks of a node (see the module docstring)."""

    FORM = FORMS.index("ExpertParallel")
    FLAG_REGIONS = (moe_peer.EP_FLAG, moe_peer.EP_RFLAG)

    def __init__(self, num_experts: int, hidden: int, max_tokens: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16, *, weight_dtype: torch.dtype = torch.float32,
                 group: Any = None, peers: Peers | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 timeout_ms: float = DEFAULT_TIMEOUT_MS):
        super().__init__(num_experts, hidden, max_tokens, topk, dtype, weight_dtype, group, peers, timeout_ms)
        self.block_size = block_size
        p, world, m = self.peers, self.world, max_tokens
        self.recv_x = p.view(self.offsets[moe_peer.EP_X], (world * m, hidden), dtype)
        self.recv_ids = p.view(self.offsets[moe_peer.EP_IDS], (world * m, topk), torch.int32)
        self.returned = p.view(self.offsets[moe_peer.EP_RET], (m * topk, hidden), dtype)
        self.src_slot = torch.empty(m, topk, dtype=torch.int32, device=self.device)
        self._received: MoeDispatch | None = None
        self._weights: torch.Tensor | None = None
        self._tokens = 0
        params = dict(dtype=self.dtype_name, hidden=self.hidden, topk=self.topk, experts=self.experts_per_rank)
        self._send, self._return = self._kernel("ep_send", **params), self._kernel("ep_return", **params)
        self._wait_sent = self._kernel("wait", region=moe_peer.EP_FLAG, bump=False)
        self._wait_returned = self._kernel("wait", region=moe_peer.EP_RFLAG, bump=True)  # the step's last
        self._send_grid = min(max_tokens, 8 * self.sms)
        self._return_grid = min(world * max_tokens, 8 * self.sms)
        self._preload()

    def _receive(self, buffer: torch.Tensor | None) -> MoeDispatch:
        return moe_dispatch(self.recv_x, self.recv_ids, self.num_experts, block_size=self.block_size,
                            local_experts=self.local_experts, buffer=buffer)

    def _preload(self) -> None:
        """Every kernel of a step launched once on nothing (see _Parallel._preloaded); the receive
        grouping reads the arena (never writes it: a peer may already be sending)."""
        state, addr, _keep = self._scratch()
        on = self.device.index
        launch.on_device(on, self._send, self.recv_x[:0], self.recv_ids[:0], addr, self.src_slot, state, self.rank,
                         0, 1)
        launch.on_device(on, self._return, self.recv_x[:0], self.recv_ids[:0], addr, state, self.rank, 0, 1)
        for fn in (self._wait_sent, self._wait_returned):
            self._wait(fn, 0, state, addr)
        self._buffer = self._receive(None).buffer
        for tokens in {1, min(self.max_tokens, DECODE_MAX_TOKENS + 1)}:  # both combine variants a step may use
            moe_combine(self.returned, torch.zeros(tokens, self.topk, dtype=self.weight_dtype, device=self.device),
                        torch.full((tokens, self.topk), -1, dtype=torch.int32, device=self.device))
        self._preloaded()

    @staticmethod
    def regions(world: int, hidden: int, max_tokens: int, topk: int, dtype: torch.dtype) -> list[int]:
        m, row, flags = max_tokens, hidden * dtype.itemsize, world * max_tokens * moe_peer.FLAG_BYTES
        # the step state; receive rows and ids (per sender), their flags, the return rows (per pair), their flags
        return [moe_peer.STATE_BYTES, world * m * row, world * m * topk * 4, flags, m * topk * row, flags]

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> MoeDispatch:
        """Send this rank's tokens x [T, H] (T <= max_tokens) to the ranks of their experts and group
        every rank's tokens for this rank's experts: a MoeDispatch whose counts/offsets index the
        local experts (expert e of the model is local e - first). Keeps topk_weights for combine."""
        if self.peers._mid_step:
            raise RuntimeError("dispatch called twice: combine the last dispatch first (every rank runs "
                               "dispatch, combine, dispatch, ... in that order)")
        self._check_rows("x", x)
        tokens = x.shape[0]
        if tokens > self.max_tokens:
            raise ValueError(f"x has {tokens} tokens; this ExpertParallel holds at most {self.max_tokens}")
        self._check_routing("topk_ids", topk_ids, tokens, (torch.int32,))
        self._check_routing("topk_weights", topk_weights, tokens, (self.weight_dtype,))
        self._enter()
        self.peers._mid_step = True  # from the send on: the arena holds half of a step
        launch.on_device(self.device.index, self._send, x, topk_ids, self.addr, self.src_slot, self.state, self.rank,
                         self.max_tokens, self._send_grid)
        self._wait(self._wait_sent, self.max_tokens)
        self._received = self._receive(self._buffer)
        self._weights, self._tokens = topk_weights, tokens
        return self._received

    def combine(self, expert_out: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """expert_out: the grouped GEMM's output over the last dispatch's buffer (same rows). Returns
        out [T, H]: for each of this rank's tokens, sum_j w[t, j] * its expert rows (dropped pairs 0);
        out must not overlap the dispatch's topk_weights."""
        if not self.peers._mid_step:
            raise RuntimeError("combine needs a dispatch first (every rank runs dispatch, combine, dispatch, "
                               "... in that order)")
        self._check_rows("expert_out", expert_out, self._received.buffer.shape[0])
        if out is not None:  # (moe_combine allocates one otherwise)
            self._check_rows("out", out, self._tokens)
            _check_out(out, None, topk_weights=self._weights)
        self._enter()
        launch.on_device(self.device.index, self._return, expert_out, self._received.slot_map, self.addr, self.state,
                         self.rank, self.max_tokens, self._return_grid)
        # Every row, also those past this rank's batch: its next step overwrites its rows in the peers'
        # receive regions, which their ep_return reads until it flags them (moe_peer: reuse).
        self._wait(self._wait_returned, self.max_tokens)
        self.peers._mid_step = False
        return moe_combine(self.returned, self._weights, self.src_slot[:self._tokens], out)

    def check(self) -> None:
        """Raise on a failed step (on any rank), or on the last dispatch's dropped pairs or invalid ids
        (synchronises)."""
        self._check_error()
        if self._received is not None:
            self._received.check()


class TensorParallel(_Parallel):
    """Tensor-parallel MoE over the ranks of a node (see the module docstring)."""

    FORM = FORMS.index("TensorParallel")
    FLAG_REGIONS = (moe_peer.TP_FLAG,)

    def __init__(self, num_experts: int, hidden: int, max_tokens: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16, *, weight_dtype: torch.dtype = torch.float32,
                 group: Any = None, peers: Peers | None = None, timeout_ms: float = DEFAULT_TIMEOUT_MS):
        super().__init__(num_experts, hidden, max_tokens, topk, dtype, weight_dtype, group, peers, timeout_ms)
        self.slots = min(self.sms, moe_peer.MAX_CTAS)  # CTA flags a step writes: its largest grid
        # by top-k: 0 reduces a tensor, topk fuses the combine
        self._reducers = {k: self._kernel("tp_reduce", dtype=self.dtype_name, hidden=hidden, topk=k,
                                          weight_dtype=checks.DTYPE_NAME[weight_dtype]) for k in (0, topk)}
        self._preload()

    def _preload(self) -> None:
        """Every kernel a step may launch, once on nothing (see _Parallel._preloaded)."""
        state, addr, _keep = self._scratch()
        dev, k, m = self.device, self.topk, self.max_tokens
        rows = torch.zeros(0, self.hidden, dtype=self.dtype, device=dev)
        for topk in (0, k):
            self._reduce(rows, torch.zeros(0, k, dtype=self.weight_dtype, device=dev) if topk else None,
                         torch.zeros(0, k, dtype=torch.int32, device=dev) if topk else None, rows, 0,
                         state=state, addr=addr)
        for tokens in {1, min(m, DECODE_MAX_PAIRS // k + 1)}:  # both dispatch variants a step may use
            self.dispatch(torch.zeros(tokens, self.hidden, dtype=self.dtype, device=dev),
                          torch.full((tokens, k), -1, dtype=torch.int32, device=dev))
        if m > DECODE_MAX_TOKENS:  # the prefill combine
            moe_combine(rows.new_zeros(1, self.hidden), torch.zeros(m, k, dtype=self.weight_dtype, device=dev),
                        torch.full((m, k), -1, dtype=torch.int32, device=dev))
        self._preloaded()

    @staticmethod
    def regions(world: int, hidden: int, max_tokens: int, topk: int, dtype: torch.dtype) -> list[int]:
        inbox = world * max_tokens * hidden * dtype.itemsize
        # the step state, two inboxes (step parity), the CTA flags
        return [moe_peer.STATE_BYTES, inbox, inbox, world * moe_peer.MAX_CTAS * moe_peer.FLAG_BYTES]

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, **kw: Any) -> MoeDispatch:
        """`moe_dispatch` of x [T, H] (the same on every rank) for this rank's experts."""
        return moe_dispatch(x, topk_ids, self.num_experts, local_experts=self.local_experts, **kw)

    def combine(self, expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """out [T, H] = sum over ranks of each rank's moe_combine(expert_out, topk_weights, slot_map);
        out must not overlap an input."""
        tokens = slot_map.shape[0] if isinstance(slot_map, torch.Tensor) and slot_map.dim() == 2 else -1
        self._check_rows("expert_out", expert_out)
        self._check_routing("slot_map", slot_map, tokens, (torch.int32,))
        self._check_routing("topk_weights", topk_weights, tokens, (self.weight_dtype,))
        if out is not None:
            self._check_rows("out", out, tokens)
            _check_out(out, None, expert_out=expert_out, topk_weights=topk_weights, slot_map=slot_map)
        self._check_tokens(tokens)
        self._enter()
        if combine_mode(tokens) == "prefill":
            return self.all_reduce(moe_combine(expert_out, topk_weights, slot_map), out)
        if out is None:
            out = expert_out.new_empty(tokens, self.hidden)
        self._reduce(expert_out, topk_weights, slot_map, out, tokens)
        return out

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out [T, H] = the sum of every rank's x [T, H] (T the same on every rank). out may be x itself (in
        place: each thread reads its vectors of x before it writes the same ones of out); no other out may
        share memory with x."""
        self._check_rows("x", x)
        if out is None:
            out = torch.empty_like(x)
        else:
            self._check_rows("out", out, x.shape[0])
            _check_out(out, "x", x=x)
        self._check_tokens(x.shape[0])
        self._enter()
        self._reduce(x, None, None, out, x.shape[0])
        return out

    def _check_tokens(self, tokens: int) -> None:
        if tokens > self.max_tokens:
            raise ValueError(f"{tokens} tokens; this TensorParallel holds at most {self.max_tokens}")

    def _reduce(self, rows: torch.Tensor, weights: torch.Tensor | None, slot_map: torch.Tensor | None,
                out: torch.Tensor, tokens: int, state: torch.Tensor | None = None,
                addr: torch.Tensor | None = None) -> None:
        fn = self._reducers[0 if slot_map is None else self.topk]
        vectors = tokens * self.hidden // checks.vector_width(self.dtype)
        grid = max(1, min(-(-vectors // moe_peer.TP_THREADS), self.slots))
        launch.on_device(self.device.index, fn, rows, weights, slot_map, out,
                         self.addr if addr is None else addr, self.state if state is None else state, self.rank,
                         self.max_tokens, 0 if state is not None else self.timeout_ns, self.slots, grid)

    def check(self) -> None:
        """Raise on a failed step, on any rank (synchronises)."""
        self._check_error()
