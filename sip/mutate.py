"""SIP schedules: immutable instruction orders and control codes, the changes a search may make to
them, and the code bytes they produce.

A `Schedule` is a value: the order of every basic block, the control code of every instruction,
and the two control fields a search may edit (each instruction's own stall count and the reuse
flags it may still set). `Schedule.moved(change)` returns a new schedule or raises `IllegalMove`
with the reason; `Schedule.moves()` lists the legal changes of its policy; `apply(schedule)` gives
the cubin bytes. `with_extra_stalls(cubin)` is the one mutation outside that policy: the same code,
only slower (it shows that a timing resolves a schedule difference).

Classes of changes (`--moves`, `parse_moves`), each switchable:

* move classes: pick an unpinned instruction of the class and move it one slot up or down in its
  basic block, which swaps it with its neighbour. `global`: global-memory accesses (LDG, STG,
  LDGSTS, ATOMG, RED, REDG; the SIP paper's policy and the default); `shared`: shared-memory
  accesses (LDS, STS, LDSM, STSM, ATOMS); `alu`: every other instruction that is no memory access
  - integer, FP, conversion, MMA, warp-collective and uniform-datapath instructions, and the
  read-only constant loads LDC / ULDC. Local and generic accesses (LDL, STL, LD, ST, ATOM) are in
  no class. A neighbour pinned only to its address is hopped over (sip.deps); a move is legal iff
  the two instructions that trade slots (and every address-pinned one between them) are
  independent under sip.deps and the control codes can be repaired.
* `control`: edits of one unpinned instruction's control code, of three kinds that can also be
  chosen alone. `control.yield` flips the yield bit (a scheduling hint; an instruction that does
  not yield must keep its stall in 1..11, the encodings nvdisasm defines; a yield ptxas put inside
  a loop body is never removed, since a spin loop may need it for other warps to make progress).
  `control.reuse` clears one operand-reuse flag set in the code (always legal: the operand is read
  from the register file instead of the reuse cache; setting one is never attempted).
  `control.stall` sets the instruction's own stall count anywhere between the lowest value every
  fixed-latency pair across it allows and the stall ptxas wrote. The lowest value comes from the
  distances of sip.deps, which only fall below what ptxas wrote with a latency table measured on
  the GPU (sip.latency): `control.stall` refuses to start without one.

Proposals, hot blocks first: a step picks one enabled class uniformly among those with a legal
change, then an instruction of the class with weight `loop_weight ** depth`, where depth is its
block's loop depth (sip.cfg): with the default 4, an instruction in a loop body is proposed 4 times
as often as one outside every loop, 16 times in a nested loop. Measured weights replace that rule
when given (`weights`: sip.profile.block_weights of the GPU's PC samples). A move goes up or down
with equal odds; an edit picks uniformly among the kinds that apply. Refused proposals are redrawn (rejection
sampling keeps those weights over the legal changes); after `attempts` refusals in a row (at most
4 per instruction of the class) the step draws from the class's full list of legal changes with
the same weights.

Control codes travel with their instruction (stall, yield, scoreboards, wait mask), then two
repairs make the new order correct. Both are functions of the order and the edited fields alone,
so moving an instruction back restores the code exactly and random walks do not pile up stalls:

* reuse flags: an instruction's `.reuse` operands stay in the operand-reuse cache for a later
  instruction reading the same register - not always the next one (ptxas reuses across memory
  instructions and across a BSSY). An instruction keeps the reuse flags it may still set only
  while the code from it to the first later instruction reading one of its `.reuse` registers
  (its reuse window, which may cross a fall-through block boundary and ends at the first jump)
  is exactly the original sequence and yields nowhere ptxas did not make it yield (ptxas never
  yields inside a reuse window; nvdisasm prints no reuse on a yielding instruction);
* stall counts: every fixed-latency pair from sip.deps must stay at least `required` stall cycles
  apart. With the instructions' own stall counts summed over the current span, the deficit of a
  consumer is added to the stall of the last movable slot before it (at most 15, or 11 for an
  instruction that does not yield: larger values are undefined encodings; otherwise the change
  is refused).

Instructions that are pinned never change their control bits (tools may patch them).

Relaxations (`scoreboard`, `sync`; sip.deps.RELAXATIONS): names in the same list that widen what
the move classes may do rather than add instructions to them: `scoreboard` lets moves cross
scoreboard waits that guard none of their registers where they stand and swap setters of one
scoreboard; `sync` lets register-only instructions pass named barriers, mbarrier arrives and the
WARPGROUP fence and wait (see sip.deps for both). They need a move class beside them. Both are in
UNTRUSTED: the tuner validates any schedule reached with an untrusted name on at least
UNTRUSTED_SAMPLES fresh random samples whatever it is asked for (sip_tune.tuning), and a name leaves
UNTRUSTED only once the GPU campaign (bench/sip_compute.py) has passed that many on every kernel it
tuned with it.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence, Union

from sip import SipError, cfg, latency
from sip.cubin import INSTRUCTION_BYTES, parse_cubin
from sip.deps import RELAXATIONS, START, DependencyModel
from sip.sass import Instruction, Kernel, control_bits, regs_in, with_control

# The 5-bit stall + yield field is not free: nvdisasm's sm_90 tables leave stall 12-15 (and 0)
# undefined when the yield bit is 1 (no yield). Repairs and edits never go past these.
MAX_STALL = {0: 15, 1: 11}  # by yield bit
GLOBAL_MEMORY = frozenset({"LDG", "STG", "LDGSTS", "ATOMG", "RED", "REDG"})
SHARED_MEMORY = frozenset({"LDS", "STS", "LDSM", "STSM", "ATOMS"})
OTHER_MEMORY = frozenset({"LDL", "STL", "LD", "ST", "ATOM"})  # local and generic: in no class
MOVE_CLASSES = ("global", "shared", "alu")
CONTROL_KINDS = ("control.yield", "control.reuse", "control.stall")
DEFAULT_MOVES = frozenset({"global"})
UNTRUSTED = frozenset(RELAXATIONS)  # see the module doc: validated on UNTRUSTED_SAMPLES, whatever is asked
UNTRUSTED_SAMPLES = 100_000
LOOP_WEIGHT = 4.0
_STALL_BITS = 0xF
LINE_TABLES = frozenset({".debug_line", ".nv_debug_line_sass"})  # what nvcc -lineinfo adds
_YIELD_BIT = 0x10
_REUSE_SHIFT = 17
_REUSE_BITS = 0xF << _REUSE_SHIFT
_NO_TABLE = ("control.stall lowers stall counts, which needs a latency table measured on the GPU by "
             "tools/sass_latency.py; none is at {} (sip mutate also takes --latency-table FILE)")


def parse_moves(text: str) -> frozenset[str]:
    """'global,alu' / 'all' / 'control' / 'control.yield,...' / 'alu,scoreboard' -> the set of
    classes, control kinds and relaxations ('all' names the trusted classes and kinds only); SipError
    (one line) for an unknown name."""
    out: set[str] = set()
    for token in (t.strip() for t in text.split(",")):
        if token == "all":
            out |= {*MOVE_CLASSES, *CONTROL_KINDS}
        elif token == "control":
            out |= set(CONTROL_KINDS)
        elif token in MOVE_CLASSES or token in CONTROL_KINDS or token in RELAXATIONS:
            out.add(token)
        else:
            raise SipError(f"unknown move class {token!r}: choose from {', '.join(MOVE_CLASSES)}, control "
                           f"({', '.join(CONTROL_KINDS)}), all, or the relaxations {', '.join(RELAXATIONS)}, "
                           "comma-separated")
    return frozenset(out)


def move_class(ins: Instruction) -> str | None:
    """The move class of an instruction (see the module doc); None: local or generic memory."""
    if ins.base in GLOBAL_MEMORY:
        return "global"
    if ins.base in SHARED_MEMORY:
        return "shared"
    return None if ins.base in OTHER_MEMORY else "alu"


def movable(model: DependencyModel, moves: frozenset[str] = DEFAULT_MOVES) -> list[int]:
    """Unpinned instructions the move classes in `moves` may pick."""
    return [i.index for i in model.instructions
            if model.facts[i.index].pin is None and move_class(i) in moves]


class IllegalMove(SipError):
    def __init__(self, change: Change, reason: str):
        super().__init__(f"{change}: {reason}")
        self.move = change
        self.reason = reason


@dataclass(frozen=True, order=True)
class Move:
    instruction: int  # index in the kernel's original instruction order
    direction: int  # -1: one slot up (earlier), +1: one slot down (later)

    def __str__(self) -> str:
        return f"move #{self.instruction} {'up' if self.direction < 0 else 'down'}"


@dataclass(frozen=True, order=True)
class Edit:
    instruction: int
    kind: str  # one of CONTROL_KINDS
    value: int  # yield: the new bit; reuse: the flag (0-3) to clear; stall: the new own stall

    def __str__(self) -> str:
        what = {"control.yield": "yield bit", "control.reuse": "clear reuse flag",
                "control.stall": "stall"}[self.kind]
        return f"edit #{self.instruction} {what} {self.value}"


Change = Union[Move, Edit]


@dataclass(frozen=True)
class _Layout:
    """Per-kernel constants the change code needs, derived once from the dependency model and the
    policy (which classes, how hot loops are)."""
    model: DependencyModel
    moves: frozenset[str]
    free: tuple[tuple[bool, ...], ...]  # block -> slot -> holds a movable (unpinned) instruction
    prev_free: tuple[tuple[int, ...], ...]  # block -> slot (0..len) -> last free slot before it
    block_start: tuple[int, ...]  # first instruction index (= slot 0 address) of each block
    orig_controls: tuple[int, ...]
    stall: tuple[int, ...]  # original stall count of each instruction
    max_required: int  # the largest distance any latency pair requires
    reuse_end: Mapping[int, int]  # reuse-flagged instruction -> last instruction of its window
    in_windows: Mapping[int, tuple[int, ...]]  # instruction -> reuse-flagged windows holding it
    depth: tuple[int, ...]  # loop depth of each instruction's block (sip.cfg)
    weight: tuple[float, ...]  # proposal weight of each instruction (loop_weight ** depth, or measured)
    candidates: Mapping[str, tuple[int, ...]]  # class ('control' for edits) -> instructions
    cum_weights: Mapping[str, tuple[float, ...]]  # class -> running sum of its candidates' weights

    @classmethod
    def of(cls, model: DependencyModel, moves: frozenset[str], loop_weight: float,
           weights: tuple[float, ...] | None) -> _Layout:
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
        kernel = model.kernel
        depth = tuple(cfg.loop_depth(kernel)[b] for b in kernel.block_of)
        weight = weights if weights is not None else tuple(loop_weight ** d for d in depth)
        candidates = {c: tuple(movable(model, frozenset({c}))) for c in MOVE_CLASSES if c in moves}
        if moves & set(CONTROL_KINDS):
            candidates["control"] = tuple(i for i, f in enumerate(model.facts) if f.pin is None)
        cum_weights = {c: tuple(itertools.accumulate(weight[i] for i in xs)) for c, xs in candidates.items()}
        return cls(model, moves, tuple(free), tuple(prev_free), tuple(b[0] for b in model.blocks),
                   controls, tuple(c & _STALL_BITS for c in controls),
                   max((r for inc in model.incoming for r in inc.values()), default=0), reuse_end,
                   {t: tuple(xs) for t, xs in in_windows.items()}, depth, weight, candidates, cum_weights)


@dataclass(frozen=True)
class Schedule:
    layout: _Layout = field(repr=False, compare=False)
    blocks: tuple[tuple[int, ...], ...]  # current instruction order of each basic block
    controls: tuple[int, ...]  # current control code (21 bits) of each instruction
    own: tuple[int, ...]  # each instruction's own stall count (ptxas' unless edited)
    reuse: tuple[int, ...]  # the reuse flags (4 bits) each instruction may still set
    slots: tuple[int, ...] = field(repr=False, compare=False)  # instruction -> slot in its block
    # consumer -> {producer: stall cycles missing between them}; only pairs that miss some
    deficits: Mapping[int, Mapping[int, int]] = field(repr=False, compare=False)
    text: bytes = field(repr=False, compare=False)  # the kernel's code in this order

    @classmethod
    def initial(cls, model: DependencyModel, moves: frozenset[str] = DEFAULT_MOVES,
                loop_weight: float = LOOP_WEIGHT, weights: Sequence[float] | None = None) -> Schedule:
        """The schedule the cubin already has, under a policy of change classes; proposals weighted by
        loop depth, or by `weights` (one per instruction, > 0) where given."""
        unknown = moves - {*MOVE_CLASSES, *CONTROL_KINDS, *RELAXATIONS}
        if unknown:
            raise SipError(f"unknown move class {sorted(unknown)[0]!r} (see sip.mutate.parse_moves)")
        if model.relax != moves & set(RELAXATIONS):
            raise SipError(f"the moves name the relaxations {sorted(moves & set(RELAXATIONS))}, the dependency "
                           f"model was built with {sorted(model.relax)} (sip.mutate.initial_schedule builds both)")
        if model.relax and not moves & set(MOVE_CLASSES):
            raise SipError(f"{', '.join(sorted(model.relax))} widen the move classes: name one beside them "
                           f"({', '.join(MOVE_CLASSES)})")
        if "control.stall" in moves and model.latencies is None:
            raise SipError(_NO_TABLE.format(latency.DEFAULT_PATH))
        if not loop_weight > 0:
            raise SipError(f"the loop weight must be > 0, got {loop_weight}")
        if weights is not None:
            weights = tuple(float(w) for w in weights)
            if len(weights) != len(model.instructions):
                raise SipError(f"need one weight per instruction: {len(model.instructions)}, got {len(weights)}")
            if not all(0 < w < math.inf for w in weights):
                raise SipError("every weight must be finite and > 0")
        lines = sorted({sec.name for sec in model.kernel.cubin.sections} & LINE_TABLES)
        if lines and moves & set(MOVE_CLASSES):
            # The tables map code offsets to source lines; a moved instruction would keep the old
            # offset's line, so profilers and debuggers would point at the wrong source.
            raise SipError(f"{model.kernel.name} has -lineinfo line tables ({', '.join(lines)}): moving "
                           "instructions would leave them pointing at the wrong lines; recompile without "
                           "-lineinfo, or edit control codes only (--moves control)")
        layout = _Layout.of(model, frozenset(moves), loop_weight, weights)
        slots = [0] * len(model.facts)
        for block in model.blocks:
            for k, i in enumerate(block):
                slots[i] = k
        kernel = model.kernel
        return cls(layout, model.blocks, layout.orig_controls, layout.stall,
                   tuple(c >> _REUSE_SHIFT & 0xF for c in layout.orig_controls), tuple(slots), {},
                   kernel.cubin.text(kernel.name))

    @property
    def model(self) -> DependencyModel:
        return self.layout.model

    # ------------------------------------------------------------ views

    def order(self) -> tuple[int, ...]:
        """Instruction indices in code order."""
        return tuple(i for block in self.blocks for i in block)

    def movable(self) -> list[int]:
        """Instructions the policy's classes may change."""
        return sorted({i for xs in self.layout.candidates.values() for i in xs})

    def moves(self, kind: str | None = None) -> list[Change]:
        """Every legal change of the policy (or of one class: 'global', ..., 'control')."""
        kinds = [kind] if kind is not None else list(self.layout.candidates)
        out: list[Change] = []
        for k in kinds:
            for x in self.layout.candidates.get(k, ()):
                out += [c for c in self._options(k, x) if self.check(c) is None]
        return out

    def _options(self, kind: str, x: int) -> list[Change]:
        """Every change of instruction x in class `kind`, legal or not."""
        if kind != "control":
            return [Move(x, -1), Move(x, 1)]
        moves = self.layout.moves
        out: list[Change] = []
        if "control.yield" in moves:
            out.append(Edit(x, "control.yield", 1 - (self.controls[x] >> 4 & 1)))
        if "control.reuse" in moves:
            out += [Edit(x, "control.reuse", bit) for bit in range(4) if self.controls[x] >> (_REUSE_SHIFT + bit) & 1]
        if "control.stall" in moves:
            out += [Edit(x, "control.stall", v) for v in range(1, self.layout.stall[x] + 1) if v != self.own[x]]
        return out

    def check(self, change: Change) -> str | None:
        """Why `change` is illegal, or None."""
        try:
            self.moved(change)
        except IllegalMove as e:
            return e.reason
        return None

    # ------------------------------------------------------------ changes

    def moved(self, change: Change) -> Schedule:
        """The schedule after `change`; raises IllegalMove (with .reason) when it is not legal."""
        model = self.model
        i = change.instruction
        if not 0 <= i < len(model.facts):
            raise IllegalMove(change, "no such instruction")
        if model.facts[i].pin:
            raise IllegalMove(change, f"pinned instruction: {model.facts[i].pin}")
        if isinstance(change, Edit):
            return self._edited(change)
        if change.direction not in (-1, 1):
            raise IllegalMove(change, "no such direction")
        b = model.kernel.block_of[i]
        order = self.blocks[b]
        k = self.slots[i]
        j = k + change.direction
        hopped = []  # address-pinned instructions the move passes (sip.deps)
        while 0 <= j < len(order) and model.facts[order[j]].pin and not model.facts[order[j]].fence:
            hopped.append(order[j])
            j += change.direction
        if not 0 <= j < len(order):
            edge = "first" if j < 0 else "last"
            past = f" after passing {len(hopped)} address-pinned instruction(s)" if hopped else ""
            raise IllegalMove(change, f"block boundary: #{i} is the {edge} instruction of basic block {b}{past}")
        other = order[j]
        if model.facts[other].pin:
            raise IllegalMove(change, _neighbour_reason(model, other))
        for x, y in [(i, other)] + [(a, m) for m in hopped for a in (i, other)]:
            reason = model.conflict(x, y)
            if reason:
                raise IllegalMove(change, f"dependency between #{x} and #{y}: {reason}")
        return _Repair(self, change, b, min(k, j), max(k, j)).schedule()

    def _edited(self, edit: Edit) -> Schedule:
        x, lay = edit.instruction, self.layout
        if edit.kind not in lay.moves:
            raise IllegalMove(edit, f"{edit.kind} is not in this schedule's classes")
        bits = self.controls[x]
        if edit.kind == "control.yield":
            if edit.value not in (0, 1) or edit.value == bits >> 4 & 1:
                raise IllegalMove(edit, f"the yield bit is {bits >> 4 & 1} already (or {edit.value} is no bit)")
            stall = bits & _STALL_BITS
            if edit.value == 1 and not 1 <= stall <= MAX_STALL[1]:
                raise IllegalMove(edit, f"stall {stall} is undefined without yield (1..{MAX_STALL[1]})")
            if edit.value == 1 and not lay.orig_controls[x] & _YIELD_BIT and lay.depth[x]:
                raise IllegalMove(edit, "a yield ptxas put in a loop body stays (a spin loop may need it "
                                        "for other warps to progress)")
            changed = {x: bits ^ _YIELD_BIT}
            controls = lambda t: changed.get(t, self.controls[t])  # noqa: E731
            address = lambda t: lay.block_start[self.model.kernel.block_of[t]] + self.slots[t]  # noqa: E731
            for w in lay.in_windows.get(x, ()):  # a yield inside a reuse window ends its reuse
                have = controls(w)
                want = self.reuse[w] << _REUSE_SHIFT if _window_intact(lay, w, address, controls) else 0
                if have & _REUSE_BITS != want:
                    if self.model.facts[w].pin:
                        raise IllegalMove(edit, f"the operand-reuse flags of pinned #{w} would change")
                    changed[w] = (have & ~_REUSE_BITS) | want
            return self._with_controls(changed)
        if edit.kind == "control.reuse":
            if not 0 <= edit.value < 4 or not bits >> (_REUSE_SHIFT + edit.value) & 1:
                raise IllegalMove(edit, f"reuse flag {edit.value} is not set")
            reuse = list(self.reuse)
            reuse[x] &= ~(1 << edit.value)
            return self._with_controls({x: bits & ~(1 << (_REUSE_SHIFT + edit.value))}, reuse=tuple(reuse))
        if edit.kind == "control.stall":
            if not 1 <= edit.value <= lay.stall[x] or edit.value == self.own[x]:
                raise IllegalMove(edit, f"stall {edit.value} is not in 1..{lay.stall[x]} (ptxas' value) "
                                        f"or is the current one")
            b = self.model.kernel.block_of[x]
            return _Repair(self, edit, b, self.slots[x], self.slots[x], own=edit.value).schedule()
        raise IllegalMove(edit, f"unknown edit kind {edit.kind!r}")

    def _with_controls(self, changed: dict[int, int], reuse: tuple[int, ...] | None = None) -> Schedule:
        """This schedule with new control bits for some instructions (their slots unchanged)."""
        lay, block_of = self.layout, self.model.kernel.block_of
        controls = list(self.controls)
        text = bytearray(self.text)
        ins = self.model.instructions
        for x, bits in changed.items():
            controls[x] = bits
            at = (lay.block_start[block_of[x]] + self.slots[x]) * INSTRUCTION_BYTES
            text[at:at + INSTRUCTION_BYTES] = with_control(ins[x].word, bits).to_bytes(INSTRUCTION_BYTES, "little")
        return Schedule(lay, self.blocks, tuple(controls), self.own, self.reuse if reuse is None else reuse,
                        self.slots, self.deficits, bytes(text))

    def stall_floor(self, x: int) -> int:
        """The lowest own stall count instruction x may get: every fixed-latency pair across its
        slot keeps its required distance without extra stall elsewhere (a pair that already
        needs extra stall allows no lowering)."""
        return self.floor_and_binding(x)[0]

    def floor_and_binding(self, x: int) -> tuple[int, tuple[int, int] | None]:
        """stall_floor(x), and the (producer, consumer) pair of sip.deps that keeps it there (None: the
        least stall of one does; the producer may be START, the consumer a block end)."""
        model, own = self.model, self.own
        b = model.kernel.block_of[x]
        order = self.blocks[b]
        k = self.slots[x]
        slack, binding = own[x] - 1, None
        for c, _, run in _spanned(self, b, k):
            for p, required in model.incoming[c].items():
                start = 0 if p == START else self.slots[p]
                if start > k:
                    continue
                have, s = run, k  # stall cycles from p to c: what lies before c back to p
                while s >= start and have < required + slack:
                    have += own[order[s]]
                    s -= 1
                if have - required < slack:
                    slack, binding = have - required, (p, c)
                if slack <= 0:
                    return own[x], binding
        return own[x] - slack, binding


def _spanned(s: Schedule, b: int, k: int):
    """(consumer, its slot, own stall cycles between slot k and it) for the consumers after slot k
    of block b (the block end last) that a latency pair across slot k may reach."""
    order, own, end = s.blocks[b], s.own, s.model.end(b)
    run = 0
    for q in range(k + 1, len(order) + 1):
        yield (order[q] if q < len(order) else end), q, run
        if q < len(order):
            run += own[order[q]]
            if run >= s.layout.max_required:
                return


class _Repair:
    """Control-code repair after slots lo and hi of block b traded instructions, or (lo == hi)
    after the instruction there got a new own stall count (see the module doc)."""

    def __init__(self, old: Schedule, change: Change, b: int, lo: int, hi: int, own: int | None = None):
        self.old, self.change, self.b, self.lo, self.hi = old, change, b, lo, hi
        order = old.blocks[b]
        self.up, self.down = order[hi], order[lo]  # `up` takes slot lo, `down` slot hi
        self.order = order[:lo] + (self.up,) + order[lo + 1:hi] + ((self.down,) if hi > lo else ()) + order[hi + 1:]
        self.lay = old.layout
        self.model = old.layout.model
        self.end = self.model.end(b)
        self.own = old.own
        if own is not None:
            changed_own = list(old.own)
            changed_own[self.up] = own
            self.own = tuple(changed_own)
        self.deficits = dict(old.deficits)
        self.changed: set[int] = set()  # consumers whose deficits changed

    def pos(self, c: int) -> int:
        if c == self.up:
            return self.lo
        if c == self.down:
            return self.hi
        return len(self.order) if c == self.end else self.old.slots[c]

    def set_deficit(self, p: int, c: int, start: int, missing: int) -> None:
        if missing > 0 and self.lay.prev_free[self.b][self.pos(c)] < start:
            source = "the block start" if p == START else f"#{p}"
            target = "the block end" if c == self.end else f"#{c}"
            raise IllegalMove(self.change, f"cannot keep the fixed-latency distance from {source} "
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
        """Recompute the deficit of pair (p, c) from the own stalls over its span."""
        start = 0 if p == START else self.pos(p)
        at, have, q = self.pos(c), 0, start
        while q < at and have < required:
            have += self.own[self.order[q]]
            q += 1
        self.set_deficit(p, c, start, required - have)

    def schedule(self) -> Schedule:
        model, lo, hi = self.model, self.lo, self.hi
        if lo == hi:  # a new own stall: every pair across the slot changed its distance
            x = self.up
            lowered = self.own[x] < self.old.own[x]
            floor = self.old.stall_floor(x) if lowered else 0
            if lowered and self.own[x] < floor:
                raise IllegalMove(self.change, f"a fixed-latency pair across #{x} needs its stall >= {floor}")
            for c, _, _ in _spanned(self.old, self.b, lo):
                for p, required in model.incoming[c].items():
                    if (p == START or self.pos(p) <= lo) and p in self.deficits.get(c, ()):
                        self.recheck(p, c, required)
            return self._controls({lo}, ())
        moved = self.order[lo:hi + 1]  # up, the address-pinned instructions it passed, down
        for z in moved:
            for p, required in model.incoming[z].items():
                self.recheck(p, z, required)
            for c, required in model.outgoing[z].items():
                self.recheck(z, c, required)
        return self._controls({lo - 1, lo, lo + 1, hi - 1, hi, hi + 1}, (self.up, self.down))

    def _controls(self, touched: set[int], moved: tuple[int, ...]) -> Schedule:
        """Stall and reuse bits of the slots the change touched; then the new schedule."""
        model, lay, order, b = self.model, self.lay, self.order, self.b
        old_slots = self.old.slots
        block_of = model.kernel.block_of
        prev_free = lay.prev_free[b]
        touched |= {prev_free[self.lo], prev_free[self.hi]}
        for c in self.changed:
            touched.add(prev_free[self.pos(c)])
        current = self.old.controls
        bits: dict[int, int] = {}  # instruction -> new control bits
        for q in touched:
            if not (0 <= q < len(order) and lay.free[b][q]):
                continue
            x = order[q]
            stall = self.own[x] + self._extra(q)
            limit = MAX_STALL[(current[x] >> 4) & 1]
            if stall > limit:
                raise IllegalMove(self.change, f"cannot keep fixed-latency distances: #{x} would "
                                               f"need a stall of {stall} cycles (max {limit})")
            if stall != current[x] & _STALL_BITS:
                bits[x] = (current[x] & ~_STALL_BITS) | stall
        blocks = self.old.blocks[:b] + (order,) + self.old.blocks[b + 1:]
        for x in {w for m in moved for w in lay.in_windows.get(m, ())}:
            have = bits.get(x, current[x])
            intact = _window_intact(lay, x, self.address, lambda t: current[t])
            want = self.old.reuse[x] << _REUSE_SHIFT if intact else 0
            if have & _REUSE_BITS != want:
                if model.facts[x].pin:
                    raise IllegalMove(self.change, f"the operand-reuse flags of pinned #{x} would change")
                bits[x] = (have & ~_REUSE_BITS) | want
        controls = list(current)
        for x, v in bits.items():
            controls[x] = v
        text = bytearray(self.old.text)
        ins = model.instructions
        for x in bits.keys() | set(moved):
            slot = self.pos(x) if block_of[x] == b else old_slots[x]
            at = (lay.block_start[block_of[x]] + slot) * INSTRUCTION_BYTES
            text[at:at + INSTRUCTION_BYTES] = with_control(ins[x].word, controls[x]).to_bytes(
                INSTRUCTION_BYTES, "little")
        slots = list(old_slots)
        slots[self.up], slots[self.down] = self.lo, self.hi
        return Schedule(lay, blocks, tuple(controls), self.own, self.old.reuse, tuple(slots), self.deficits,
                        bytes(text))

    def address(self, t: int) -> int:
        """Code address (in instructions) of t after the change."""
        b = self.model.kernel.block_of[t]
        return self.lay.block_start[b] + (self.pos(t) if b == self.b else self.old.slots[t])

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


def _window_intact(lay: _Layout, x: int, address, controls) -> bool:
    """Whether x's reuse window (sip.mutate doc) still holds: the code from x to the window's end
    sits at consecutive addresses in the original order, and no instruction from x up to the
    reader yields where ptxas did not make it yield (ptxas never lets an instruction that caches
    operands, or one after it before their reader, yield; nvdisasm shows no reuse on a yielding
    instruction)."""
    shift = address(x) - x
    last = lay.reuse_end[x]
    if any(address(t) - t != shift for t in range(x + 1, last + 1)):
        return False
    return not any(controls(t) & _YIELD_BIT == 0 and lay.orig_controls[t] & _YIELD_BIT
                   for t in range(x, last))


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


# ---------------------------------------------------------------- proposals and walks

def propose(schedule: Schedule, kind: str, rng: random.Random) -> Change | None:
    """One random change of class `kind`, legal or not (see the module doc for the weights);
    None when the drawn instruction has no change of that kind."""
    lay = schedule.layout
    x = rng.choices(lay.candidates[kind], cum_weights=lay.cum_weights[kind])[0]
    if kind != "control":
        return Move(x, rng.choice((-1, 1)))
    reuse = schedule.controls[x] >> _REUSE_SHIFT & 0xF
    kinds = [k for k in CONTROL_KINDS if k in lay.moves
             and (k != "control.reuse" or reuse) and (k != "control.stall" or lay.stall[x] > 1)]
    if not kinds:
        return None
    k = rng.choice(kinds)
    if k == "control.yield":
        return Edit(x, k, 1 - (schedule.controls[x] >> 4 & 1))
    if k == "control.reuse":
        return Edit(x, k, rng.choice([bit for bit in range(4) if reuse >> bit & 1]))
    values = [v for v in range(schedule.stall_floor(x), lay.stall[x] + 1) if v != schedule.own[x]]
    return Edit(x, k, rng.choice(values)) if values else None


def step(schedule: Schedule, rng: random.Random, attempts: int = 64) -> tuple[Schedule, Change] | None:
    """One random legal change (see the module doc); None when the policy has none left."""
    lay = schedule.layout
    kinds = [k for k in lay.candidates if lay.candidates[k]]
    while kinds:
        kind = rng.choice(kinds)
        for _ in range(min(attempts, 4 * len(lay.candidates[kind]))):  # a small class is listed sooner
            change = propose(schedule, kind, rng)
            if change is None:
                continue
            try:
                return schedule.moved(change), change
            except IllegalMove:
                continue
        legal = schedule.moves(kind)
        if legal:
            change = rng.choices(legal, weights=[lay.weight[c.instruction] for c in legal])[0]
            return schedule.moved(change), change
        kinds.remove(kind)
    return None


def random_walk(schedule: Schedule, steps: int, seed: int, attempts: int = 64) -> tuple[Schedule, list[Change]]:
    """Apply `steps` random legal changes of the schedule's policy, reproducibly for a given seed;
    stops early when no legal change is left."""
    rng = random.Random(seed)
    done: list[Change] = []
    for _ in range(steps):
        taken = step(schedule, rng, attempts)
        if taken is None:
            break
        schedule, change = taken
        done.append(change)
    return schedule, done


def lowered(schedule: Schedule, instructions: Sequence[int] | None = None) -> Schedule:
    """Every stall count of `instructions` (default: every unpinned one) lowered to its floor, in code
    order, again until none goes lower: each step a legal control.stall edit, so the result keeps every
    guarantee a walk does. What stall counts alone can take off statically (the GPU says what that is
    worth: a pipe's throughput, not a stall count, may be what spaced them)."""
    if "control.stall" not in schedule.layout.moves:
        raise SipError("lowering stall counts needs control.stall in the schedule's classes")
    xs = [x for x in (schedule.order() if instructions is None else instructions)
          if schedule.model.facts[x].pin is None]
    changed = True
    while changed:
        changed = False
        for x in xs:
            floor = schedule.stall_floor(x)
            if floor < schedule.own[x]:
                try:
                    schedule = schedule.moved(Edit(x, "control.stall", floor))
                except IllegalMove:
                    continue
                changed = True
    return schedule


HOLDS = ("latency pair", "anchor", "block start", "block end", "pinned", "above the floor")


def floor_holds(schedule: Schedule, instructions: Iterable[int]) -> dict[str, int]:
    """Of the stall cycles above one that `instructions` keep in `schedule` (a floor: `lowered`), how many
    each kind of constraint holds: a fixed-latency pair of sip.deps between two instructions of the block
    (the latency table's distance, or the horizon where it has none), one from an anchor (an instruction
    whose register effects the model cannot see: HGMMA, mbarrier ops), from the block's start or into its end
    (producers and consumers in other blocks), a pinned instruction's own control bits, and, outside a
    floor, what lowering would still take off."""
    model, own = schedule.model, schedule.own
    held = dict.fromkeys(HOLDS, 0)
    for x in instructions:
        if own[x] <= 1:
            continue
        if model.facts[x].pin is not None:
            held["pinned"] += own[x] - 1
            continue
        floor, binding = schedule.floor_and_binding(x)
        held["above the floor"] += own[x] - floor
        if binding is None:
            continue
        p, c = binding
        kind = ("block start" if p == START else "block end" if c >= len(model.facts)
                else "anchor" if model.facts[p].anchor else "latency pair")
        held[kind] += floor - 1
    return held


def latencies_for(moves: frozenset[str], path: str | Path | None = None) -> latency.LatencyTable | None:
    """The latency table a policy runs with: `path` if given, else (when control.stall needs one)
    the repository's measured table, sip.latency.DEFAULT_PATH; SipError when control.stall has
    none."""
    if path is not None:
        return latency.load(path)
    if "control.stall" not in moves:
        return None
    if not latency.DEFAULT_PATH.is_file():
        raise SipError(_NO_TABLE.format(latency.DEFAULT_PATH))
    return latency.load(latency.DEFAULT_PATH)


def initial_schedule(kernel: Kernel, moves: frozenset[str] = DEFAULT_MOVES,
                     latency_table: str | Path | None = None, loop_weight: float = LOOP_WEIGHT,
                     weights: Sequence[float] | None = None) -> Schedule:
    """The kernel's schedule under a policy, with its dependency model (latency table: see
    latencies_for)."""
    return Schedule.initial(model_for(kernel, moves, latency_table), moves, loop_weight, weights)


def model_for(kernel: Kernel, moves: frozenset[str], latency_table: str | Path | None = None) -> DependencyModel:
    """The dependency model a policy runs on: its latency table (latencies_for) and relaxations."""
    return DependencyModel(kernel, latencies_for(moves, latency_table), moves & frozenset(RELAXATIONS))


def apply(schedule: Schedule) -> bytes:
    """The cubin's bytes with this schedule's code for its kernel."""
    kernel = schedule.model.kernel
    return kernel.cubin.with_text(kernel.name, schedule.text)


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
