"""SIP schedules: immutable instruction orders, one-slot moves, and the code bytes they produce.

A `Schedule` is a value: the order of every basic block plus the control code of every
instruction. `Schedule.moved(move)` returns a new schedule or raises `IllegalMove` with the
reason; `Schedule.moves()` lists the legal moves; `apply(schedule)` gives the cubin bytes.
`with_extra_stalls(cubin)` is the one mutation outside that policy: the same code, only slower (it
shows that a timing resolves a schedule difference).

SIP's mutation policy: pick a movable instruction (global memory: LDG, STG, LDGSTS, ATOMG, RED,
REDG; with include_shared also LDS, STS, LDSM) and move it up or down one slot in its basic block,
which swaps it with its neighbour. Legal iff neither is pinned, the neighbour is in the same block,
the dependency model (sip.deps) sees no conflict between the two, and the control codes can be
repaired.

Control codes travel with their instruction (stall, yield, scoreboards, wait mask), then two
repairs make the new order correct. Both are functions of the order alone, so moving an
instruction back restores the original code exactly and random walks do not pile up stalls:

* reuse flags: an instruction's `.reuse` operands stay in the operand-reuse cache for a later
  instruction reading the same register - not always the next one (ptxas reuses across memory
  instructions and across a BSSY). An instruction keeps its original reuse flags only while the
  code from it to the first later instruction reading one of its `.reuse` registers (its reuse
  window, which may cross a fall-through block boundary and ends at the first jump) is exactly
  the original sequence;
* stall counts: every fixed-latency pair from sip.deps must stay at least `required` stall cycles
  apart. With the original stall counts summed over the current span, the deficit of a consumer
  is added to the stall of the last movable slot before it (at most 15, or 11 for an
  instruction that does not yield: larger values are undefined encodings; otherwise the move is
  refused).

Instructions that are pinned never change their control bits (tools may patch them).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Mapping

from sip import SipError
from sip.cubin import INSTRUCTION_BYTES, parse_cubin
from sip.deps import START, DependencyModel
from sip.sass import control_bits, regs_in, with_control

# The 5-bit stall + yield field is not free: nvdisasm's sm_90 tables leave stall 12-15 (and 0)
# undefined when the yield bit is 1 (no yield). Repairs never go past these.
MAX_STALL = {0: 15, 1: 11}  # by yield bit
GLOBAL_MEMORY = frozenset({"LDG", "STG", "LDGSTS", "ATOMG", "RED", "REDG"})
SHARED_MEMORY = frozenset({"LDS", "STS", "LDSM"})
_STALL_BITS = 0xF
_REUSE_BITS = 0xF << 17


class IllegalMove(SipError):
    def __init__(self, move: Move, reason: str):
        super().__init__(f"{move}: {reason}")
        self.move = move
        self.reason = reason


@dataclass(frozen=True, order=True)
class Move:
    instruction: int  # index in the kernel's original instruction order
    direction: int  # -1: one slot up (earlier), +1: one slot down (later)

    def __str__(self) -> str:
        return f"move #{self.instruction} {'up' if self.direction < 0 else 'down'}"


def movable(model: DependencyModel, include_shared: bool = False) -> list[int]:
    """Instructions SIP's policy may pick: unpinned global (and optionally shared) memory ops."""
    kinds = GLOBAL_MEMORY | SHARED_MEMORY if include_shared else GLOBAL_MEMORY
    return [i.index for i in model.instructions if i.base in kinds and model.facts[i.index].pin is None]


@dataclass(frozen=True)
class _Layout:
    """Per-kernel constants the move code needs, derived once from the dependency model."""
    model: DependencyModel
    free: tuple[tuple[bool, ...], ...]  # block -> slot -> holds a movable (unpinned) instruction
    prev_free: tuple[tuple[int, ...], ...]  # block -> slot (0..len) -> last free slot before it
    block_start: tuple[int, ...]  # first instruction index (= slot 0 address) of each block
    orig_controls: tuple[int, ...]
    stall: tuple[int, ...]  # original stall count of each instruction
    reach: tuple[int, ...]  # largest distance any latency pair out of an instruction requires
    reuse_end: Mapping[int, int]  # reuse-flagged instruction -> last instruction of its window
    in_windows: Mapping[int, tuple[int, ...]]  # instruction -> reuse-flagged windows holding it

    @classmethod
    def of(cls, model: DependencyModel) -> _Layout:
        free, prev_free = [], []
        for block in model.blocks:
            flags = tuple(model.facts[i].pin is None for i in block)
            before, last = [], -1
            for k in range(len(block) + 1):
                before.append(last)
                if k < len(block) and flags[k]:
                    last = k
            free.append(flags)
            prev_free.append(tuple(before))
        controls = tuple(control_bits(i.word) for i in model.instructions)
        reuse_end = _reuse_windows(model)
        in_windows: dict[int, list[int]] = {}
        for x, last in reuse_end.items():
            for t in range(x, last + 1):
                in_windows.setdefault(t, []).append(x)
        return cls(model, tuple(free), tuple(prev_free), tuple(b[0] for b in model.blocks),
                   controls, tuple(c & _STALL_BITS for c in controls),
                   tuple(max(out.values(), default=0) for out in model.outgoing), reuse_end,
                   {t: tuple(xs) for t, xs in in_windows.items()})


@dataclass(frozen=True)
class Schedule:
    layout: _Layout = field(repr=False, compare=False)
    blocks: tuple[tuple[int, ...], ...]  # current instruction order of each basic block
    controls: tuple[int, ...]  # current control code (21 bits) of each instruction
    slots: tuple[int, ...] = field(repr=False, compare=False)  # instruction -> slot in its block
    # consumer -> {producer: stall cycles missing between them}; only pairs that miss some
    deficits: Mapping[int, Mapping[int, int]] = field(repr=False, compare=False)
    text: bytes = field(repr=False, compare=False)  # the kernel's code in this order

    @classmethod
    def initial(cls, model: DependencyModel) -> Schedule:
        """The schedule the cubin already has."""
        layout = _Layout.of(model)
        slots = [0] * len(model.facts)
        for block in model.blocks:
            for k, i in enumerate(block):
                slots[i] = k
        kernel = model.kernel
        return cls(layout, model.blocks, layout.orig_controls, tuple(slots), {},
                   kernel.cubin.text(kernel.name))

    @property
    def model(self) -> DependencyModel:
        return self.layout.model

    # ------------------------------------------------------------ views

    def order(self) -> tuple[int, ...]:
        """Instruction indices in code order."""
        return tuple(i for block in self.blocks for i in block)

    def moves(self, include_shared: bool = False) -> list[Move]:
        """Every legal move of the instructions SIP's policy may pick."""
        out = []
        for i in movable(self.model, include_shared):
            for d in (-1, 1):
                if self.check(Move(i, d)) is None:
                    out.append(Move(i, d))
        return out

    def check(self, move: Move) -> str | None:
        """Why `move` is illegal, or None."""
        try:
            self.moved(move)
        except IllegalMove as e:
            return e.reason
        return None

    # ------------------------------------------------------------ the move

    def moved(self, move: Move) -> Schedule:
        """The schedule after `move`; raises IllegalMove (with .reason) when it is not legal."""
        model = self.model
        i = move.instruction
        if not 0 <= i < len(model.facts) or move.direction not in (-1, 1):
            raise IllegalMove(move, "no such instruction or direction")
        b = model.kernel.block_of[i]
        order = self.blocks[b]
        k = self.slots[i]
        j = k + move.direction
        if model.facts[i].pin:
            raise IllegalMove(move, f"pinned instruction: {model.facts[i].pin}")
        if not 0 <= j < len(order):
            edge = "first" if j < 0 else "last"
            raise IllegalMove(move, f"block boundary: #{i} is the {edge} instruction of basic block {b}")
        other = order[j]
        if model.facts[other].pin:
            raise IllegalMove(move, _neighbour_reason(model, other))
        reason = model.conflict(i, other)
        if reason:
            raise IllegalMove(move, f"dependency between #{i} and #{other}: {reason}")
        lo = min(k, j)
        return _Repair(self, move, b, lo).schedule()


class _Repair:
    """Control-code repair after slots lo and lo+1 of block b swapped (see the module doc)."""

    def __init__(self, old: Schedule, move: Move, b: int, lo: int):
        self.old, self.move, self.b, self.lo = old, move, b, lo
        order = old.blocks[b]
        self.up, self.down = order[lo + 1], order[lo]  # `up` takes slot lo, `down` slot lo + 1
        self.order = order[:lo] + (self.up, self.down) + order[lo + 2:]
        self.lay = old.layout
        self.model = old.layout.model
        self.end = self.model.end(b)
        self.deficits = dict(old.deficits)
        self.changed: set[int] = set()  # consumers whose deficits changed

    def pos(self, c: int) -> int:
        if c == self.up:
            return self.lo
        if c == self.down:
            return self.lo + 1
        return len(self.order) if c == self.end else self.old.slots[c]

    def set_deficit(self, p: int, c: int, start: int, missing: int) -> None:
        if missing > 0 and self.lay.prev_free[self.b][self.pos(c)] < start:
            source = "the block start" if p == START else f"#{p}"
            target = "the block end" if c == self.end else f"#{c}"
            raise IllegalMove(self.move, f"cannot keep the fixed-latency distance from {source} "
                                         f"to {target}: no movable slot between them")
        have = self.deficits.get(c, {})
        if have.get(p, 0) == max(missing, 0):
            return
        new = dict(have)
        if missing > 0:
            new[p] = missing
        else:
            del new[p]
        if new:
            self.deficits[c] = new
        else:
            del self.deficits[c]
        self.changed.add(c)

    def recheck(self, p: int, c: int, required: int) -> None:
        """Recompute the deficit of pair (p, c) from the original stalls over its span."""
        start = 0 if p == START else self.pos(p)
        at, have, q = self.pos(c), 0, start
        while q < at and have < required:
            have += self.lay.stall[self.order[q]]
            q += 1
        self.set_deficit(p, c, start, required - have)

    def schedule(self) -> Schedule:
        model, lay, order, lo = self.model, self.lay, self.order, self.lo
        up, down = self.up, self.down
        # `up` moved earlier: pairs into it shrank, pairs out of it grew.
        for p, required in model.incoming[up].items():
            self.recheck(p, up, required)
        for c in [c for c in model.outgoing[up] if up in self.deficits.get(c, ())]:
            self.recheck(up, c, model.outgoing[up][c])
        # `down` moved later: pairs into it grew, pairs out of it shrank - walk forward as far
        # as its longest pair reaches.
        for p in list(self.deficits.get(down, ())):
            self.recheck(p, down, model.incoming[down][p])
        out = model.outgoing[down]
        have, q = 0, lo + 1
        while q <= len(order) and have < lay.reach[down]:
            c = self.end if q == len(order) else order[q]
            if c in out and c != down:
                self.set_deficit(down, c, lo + 1, out[c] - have)
            if q < len(order):
                have += lay.stall[order[q]]
            q += 1
        return self._controls(up, down)

    def _controls(self, up: int, down: int) -> Schedule:
        """Stall and reuse bits of the slots the move touched; then the new schedule."""
        model, lay, order, b, lo = self.model, self.lay, self.order, self.b, self.lo
        old_slots = self.old.slots
        block_of = model.kernel.block_of
        touched = {lo - 1, lo, lo + 1, lay.prev_free[b][lo], lay.prev_free[b][lo + 1]}
        for c in self.changed:
            touched.add(lay.prev_free[b][self.pos(c)])
            if c != self.end and c not in (up, down):
                touched.add(lay.prev_free[b][old_slots[c]])
        current = self.old.controls
        bits: dict[int, int] = {}  # instruction -> new control bits
        for q in touched:
            if not (0 <= q < len(order) and lay.free[b][q]):
                continue
            x = order[q]
            stall = lay.stall[x] + self._extra(q)
            limit = MAX_STALL[(current[x] >> 4) & 1]
            if stall > limit:
                raise IllegalMove(self.move, f"cannot keep fixed-latency distances: #{x} would "
                                             f"need a stall of {stall} cycles (max {limit})")
            if stall != current[x] & _STALL_BITS:
                bits[x] = (current[x] & ~_STALL_BITS) | stall
        blocks = self.old.blocks[:b] + (order,) + self.old.blocks[b + 1:]
        for x in set(lay.in_windows.get(up, ())) | set(lay.in_windows.get(down, ())):
            have = bits.get(x, current[x])
            want = lay.orig_controls[x] & _REUSE_BITS if self._window_intact(x) else 0
            if have & _REUSE_BITS != want:
                if model.facts[x].pin:
                    raise IllegalMove(self.move, f"the operand-reuse flags of pinned #{x} would change")
                bits[x] = (have & ~_REUSE_BITS) | want
        controls = list(current)
        for x, v in bits.items():
            controls[x] = v
        text = bytearray(self.old.text)
        ins = model.instructions
        for x in bits.keys() | {up, down}:
            slot = self.pos(x) if block_of[x] == b else old_slots[x]
            at = (lay.block_start[block_of[x]] + slot) * INSTRUCTION_BYTES
            text[at:at + INSTRUCTION_BYTES] = with_control(ins[x].word, controls[x]).to_bytes(
                INSTRUCTION_BYTES, "little")
        slots = list(old_slots)
        slots[up], slots[down] = lo, lo + 1
        return Schedule(lay, blocks, tuple(controls), tuple(slots), self.deficits, bytes(text))

    def _window_intact(self, x: int) -> bool:
        """Its reuse window still sits at consecutive code addresses, in the original order."""
        lay, block_of, old_slots = self.lay, self.model.kernel.block_of, self.old.slots

        def address(t: int) -> int:
            slot = self.pos(t) if block_of[t] == self.b else old_slots[t]
            return lay.block_start[block_of[t]] + slot

        shift = address(x) - x
        return all(address(t) - t == shift for t in range(x + 1, lay.reuse_end[x] + 1))

    def _extra(self, q: int) -> int:
        """Extra stall at free slot q: the largest deficit of the consumers that place it there
        (the pinned instructions right after q and the next movable one, or the block end)."""
        order, free = self.order, self.lay.free[self.b]
        extra = 0
        for k in range(q + 1, len(order) + 1):
            c = self.end if k == len(order) else order[k]
            extra = max(extra, max(self.deficits.get(c, {}).values(), default=0))
            if k == len(order) or free[k]:
                break
        return extra


def _neighbour_reason(model: DependencyModel, other: int) -> str:
    ins = model.instructions[other]
    if ins.control_flow:
        return f"block boundary: #{other} ({ins.opcode}) ends the basic block"
    return f"neighbour #{other} is pinned: {model.facts[other].pin}"


# Control transfers after which code-order neighbours need not run next: reuse ends there.
_JUMPS = frozenset({"BRA", "BRX", "BRXU", "JMP", "JMX", "JMXU", "CALL", "RET", "EXIT", "BREAK",
                    "KILL", "BPT", "RTT"})


def _reuse_windows(model: DependencyModel) -> dict[int, int]:
    """Reuse-flagged instruction -> the first later instruction in code order that reads one of
    its `.reuse` registers, or the first jump if that comes earlier (ptxas keeps operands across
    fall-through control such as BSSY, so windows may cross blocks)."""
    ins = model.instructions
    windows = {}
    for x in ins:
        if not x.control.reuse:
            continue
        cached = frozenset().union(*(regs_in(op) for op in x.operands if ".reuse" in op))
        end = x.index + 1
        while end < len(ins) - 1 and not ins[end].reads & cached and ins[end].base not in _JUMPS:
            end += 1
        windows[x.index] = min(end, len(ins) - 1)
    return windows


def apply(schedule: Schedule) -> bytes:
    """The cubin's bytes with this schedule's code for its kernel."""
    kernel = schedule.model.kernel
    return kernel.cubin.with_text(kernel.name, schedule.text)


def random_walk(schedule: Schedule, steps: int, seed: int, include_shared: bool = False,
                attempts: int = 64) -> tuple[Schedule, list[Move]]:
    """Apply `steps` random legal moves, reproducibly for a given seed. Candidates are drawn
    uniformly (instruction, direction); after `attempts` refusals in a row the walk draws from
    the full list of legal moves, and stops early if there is none."""
    rng = random.Random(seed)
    candidates = movable(schedule.model, include_shared)
    done: list[Move] = []
    if not candidates:
        return schedule, done
    for _ in range(steps):
        for _ in range(attempts):
            move = Move(rng.choice(candidates), rng.choice((-1, 1)))
            try:
                schedule = schedule.moved(move)
            except IllegalMove:
                continue
            done.append(move)
            break
        else:
            legal = schedule.moves(include_shared)
            if not legal:
                break
            move = rng.choice(legal)
            schedule = schedule.moved(move)
            done.append(move)
    return schedule, done


def with_extra_stalls(cubin: bytes, stall: int = MAX_STALL[1], every: int = 1) -> bytes:
    """The cubin with the stall count of every `every`-th instruction of each kernel raised to
    `stall`: same code, same results, only slower. The default is the largest stall that is defined
    whether or not the instruction yields."""
    parsed = parse_cubin(cubin)
    for code in parsed.kernels():
        text = bytearray(parsed.text(code.name))
        for at in range(0, len(text), every * INSTRUCTION_BYTES):
            word = int.from_bytes(text[at:at + INSTRUCTION_BYTES], "little")
            bits = control_bits(word)
            if bits & _STALL_BITS < stall:
                word = with_control(word, (bits & ~_STALL_BITS) | stall)
                text[at:at + INSTRUCTION_BYTES] = word.to_bytes(INSTRUCTION_BYTES, "little")
        parsed = parse_cubin(parsed.with_text(code.name, bytes(text)))
    return parsed.to_bytes()
