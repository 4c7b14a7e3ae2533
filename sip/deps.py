"""The dependency model of one kernel: which instructions may trade places.

SIP swaps two instructions of one basic block that are adjacent, or separated only by
instructions pinned to their address (see below), so legality is a property of pairs:
`DependencyModel.conflict(a, b)` says why `a` and `b` must keep their relative order, or None.
Because it only looks at the two instructions (never at their positions), a sequence of accepted
swaps can never invert any dependent pair of the original order. A pair conflicts on

* registers: RAW / WAR / WAW on R, UR, P, UP (vectors, pairs and fragments already expanded);
* scoreboards: one sets a scoreboard the other waits on, or both set the same one; and one waits
  on a scoreboard that guards a register the other touches (the guard of SB s is every register
  some instruction of the kernel protects with s, plus the results of every variable-latency
  instruction that is not self-covered, see below), because a wait can cover consumers that do
  not wait themselves, even consumers of a producer in another block;
* in-order completion: ptxas lets a variable-latency instruction with no scoreboard of its own
  (LDS, POPC, ...) be covered by the scoreboard of a LATER variable-latency instruction, whose
  wait then also guarantees the earlier result. So two variable-latency instructions never swap
  unless every one of them that writes registers is "self-covered" (its own write scoreboard is
  waited on before any use of its results, inside its block), and an instruction that reads
  registers without a read scoreboard never swaps with one that sets a read scoreboard;
* memory, per state space (global, shared, local; generic aliases all three; constant is
  read-only): a store or atomic never passes another access of an aliasing space, loads pass
  loads, and strong (volatile) accesses are ordered against every access of their space.

Pins. Fences never move and nothing crosses them: block terminators and all control flow;
synchronisation (barriers, memory fences, DEPBAR / LDGDEPBAR, mbarrier SYNCS, TMA and bulk copies,
WARPGROUP / HGMMA, WARPSYNC, ELECT, NANOSLEEP, the dependent-launch wait and trigger ACQBULK and
PREEXIT, anything nvdisasm flags as an inter-warp barrier); clock reads; NOPs (ptxas' own padding
and hazard delays, whose reasons the model cannot see); instructions predicated off (`@!PT`: ptxas
placeholders); and every instruction whose operands the register model does not cover. A fence
conflicts with everything. Warp-collective register operations (SHFL, VOTE, MATCH, REDUX) are NOT
fences: inside one basic block the participating threads and the values they exchange are fixed by
the register dependencies alone, which the model keeps.

Rules that relax what used to be pinned (each one is why a former pin is safe to drop):

* Address pins are no fences. An instruction the cubin refers to by offset keeps its address,
  word and control bits, so every reference stays true. Where the reference only annotates that
  instruction (sip.cubin.ANNOTATION_ATTRS: .nv.info lists such as COOP_GROUP_INSTR_OFFSETS or
  MBARRIER_INSTR_OFFSETS; relocations, which patch bits of the instruction itself; frame-rule
  changes), what it needs is the instruction at that address, not the order of the others around
  it: another instruction may pass it (a move hops over it, swapping the movable instructions on
  either side) when the two are independent under every rule above. A frame rule stays true
  because the instruction that changes the frame (writing the stack pointer R1, or saving a
  register to the stack) is the pinned one, and an instruction touching R1 conflicts with it.
  Offsets in any other .nv.info list may be places where the driver or a tool patches in other
  code (software workarounds, syscalls, emulated atomics): those stay fences.
* 64-bit uniform operands are modelled, not pinned (sip.sass): UIADD3.64 reads and writes UR
  pairs; USHF.*.U64 / .S64 name both 32-bit halves as operands of their own, like SHF.
* A frame-rule location after which the CFA program changes no rule (only further advances or
  DW_CFA_nop padding) pins nothing (sip.cubin).

Fixed-latency distances: a producer with no scoreboard has no hardware interlock, so moving its
consumer closer would read a stale value. `incoming` / `outgoing` hold, for the original order,
every (producer, consumer) register pair (RAW, WAR, WAW) and scoreboard (setter, waiter) pair,
with the stall-cycle distance the original schedule kept between them, capped at a bound longer
than the latency it can cover: LATENCY_HORIZON per producer class, SCOREBOARD_SETUP for
scoreboard-protected pairs. Producers and consumers outside the block (and instructions with an
unknown register model) are stood in for by the block start / end with the kernel's largest
horizon. sip.mutate keeps every pair at least that far apart. With a latency table measured on the
GPU (sip.latency), the bound of a pair between two fixed-latency classes the table covers is the
measured distance instead: a RAW pair uses the table's entry for (producer, consumer, register
file); a WAW or WAR pair uses the largest distance measured out of the producer's class (by then
its result is written and its operands were read). Pairs the table does not cover keep the horizon.

Relaxations (`DependencyModel(kernel, relax=...)`, RELAXATIONS): rules that are exact where the ones
above are conservative, each switched on by the sip.mutate class of the same name, which stays
untrusted (sip.mutate.UNTRUSTED) until it has passed the GPU campaign:

* `scoreboard`: a wait on SB s only guards the registers that may be in flight on s where it
  stands. Walking each block in the original order, those are the registers of the setters of s
  since the last full wait on s (a wait-mask bit: the hardware counter of s is zero, so every
  earlier setter has completed), plus, before the block's first full wait on s, what its CFG
  predecessors may leave in flight on s (a dataflow over sip.cfg to a fixed point; the whole guard
  of s where the CFG cannot see every edge: a kernel with CALL, RET, BREAK or an indirect branch,
  or a block it never reaches), plus always the results of variable-latency instructions that are
  not self-covered (they may ride on any scoreboard), and every register at all after a setter
  whose register effects the model does not know. DEPBAR.LE SBn, k (a count, not zero) clears
  nothing. A later instruction that touches none of them may pass the wait; a wait passing an
  earlier instruction upward only waits sooner, which is always safe. Two setters of one
  scoreboard may swap when no DEPBAR of the kernel counts that scoreboard: a full wait waits for
  both either way. Legal moves keep every setter on the same side of every waiter of its
  scoreboard (they conflict), so the in-flight sets of the original order stay true in every
  schedule the moves reach.
* `sync`: named barriers (BAR.SYNC / BAR.ARV), mbarrier arrives with no result (SYNCS.ARRIVE.*
  RZ, ...) and the warpgroup MMA fence and wait (WARPGROUP.ARRIVE / WARPGROUP.DEPBAR) keep their
  slots (address pins, no fences: their registers are modelled), and an instruction passes one
  when it accesses no memory (the barriers order memory), is no synchronisation itself, and, for
  the WARPGROUP pair, touches no register that any wgmma of the kernel (HGMMA, ...) reads or
  writes: accumulators, A fragments in registers and descriptor registers, whose accesses the
  PTX ISA only defines between those fences and waits. Register-only work is invisible to
  other warps and to the tensor core otherwise. wgmma instructions themselves stay fences, with
  those registers modelled (read and written), so that they are no anchors: an instruction that
  touches none of them keeps no fixed-latency distance from them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from sip import SipError, cfg
from sip.latency import LatencyTable, opclass, register_file
from sip.sass import NO_SCOREBOARD, UP_BASE, Instruction, Kernel, format_regs, regs_in

# Cycles after issue within which a fixed-latency result may still be in flight. Measured
# latencies on Hopper are ~4-6 cycles for ALU/FMA work, ~8 for FP64 and ~30 for mma.sync; each
# horizon leaves a wide margin. Pairs further apart than this cannot interact.
LATENCY_HORIZON_DEFAULT = 24
LATENCY_HORIZON = {"DADD": 32, "DMUL": 32, "DFMA": 32, "DMNMX": 32, "DSETP": 32,
                   "HMMA": 128, "IMMA": 128, "BMMA": 128, "DMMA": 128}
UNKNOWN_HORIZON = 128  # an instruction with an unknown register model may write anything
RELAXATIONS = ("scoreboard", "sync")
# A scoreboard is set a cycle after its setter issues; keep setter and waiter this far apart.
SCOREBOARD_SETUP = 2

START = -1  # producer id standing for "before this block"

FENCES = frozenset({
    "BAR", "MEMBAR", "FENCE", "ERRBAR", "CGAERRBAR", "CCTL", "CCTLL", "CCTLT", "DEPBAR",
    "LDGDEPBAR", "ARRIVES", "SYNCS", "UTMALDG", "UTMASTG", "UTMAPF", "UTMACCTL", "UTMACMDFLUSH",
    "UTMAREDG", "UBLKCP", "UBLKRED", "UBLKPF", "WARPGROUP", "HGMMA", "IGMMA", "QGMMA", "BGMMA",
    "WARPSYNC", "NANOSLEEP", "ELECT", "USETMAXREG", "ACQBULK", "PREEXIT", "PMTRIG", "UCGABAR_ARV",
    "UCGABAR_WAIT", "B2R", "R2B", "LEPC", "GETLMEMBASE", "SETLMEMBASE",
})
# Instructions whose completion the hardware tracks with scoreboards (anything that sets one in
# the original code counts too).
VARIABLE_LATENCY = frozenset({
    "LDG", "LDS", "LDL", "LD", "LDC", "LDSM", "ATOMG", "ATOMS", "ATOM", "REDG", "RED", "STG",
    "STS", "STL", "ST", "STSM", "LDGSTS", "MUFU", "S2R", "S2UR", "SHFL", "POPC", "FLO", "BREV",
    "F2F", "F2I", "I2F", "I2I", "FRND", "DMMA", "REDUX", "MATCH", "FCHK", "R2UR",
})
_CLOCK = re.compile(r"SR_(CLOCK|GLOBALTIMER)")
_FENCE_MODIFIERS = frozenset({"ACQUIRE", "RELEASE", "ACQ_REL", "ACQREL", "MMIO"})
_ORDERED_MODIFIERS = frozenset({"STRONG", "VOLATILE"})

# opcode -> (spaces read, spaces written); atomics and reductions do both.
_ACCESS = {
    "LDG": ({"global"}, set()), "STG": (set(), {"global"}),
    "ATOMG": ({"global"}, {"global"}), "REDG": ({"global"}, {"global"}),
    "LD": ({"generic"}, set()), "ST": (set(), {"generic"}),
    "ATOM": ({"generic"}, {"generic"}), "RED": ({"generic"}, {"generic"}),
    "LDS": ({"shared"}, set()), "LDSM": ({"shared"}, set()), "STS": (set(), {"shared"}),
    "STSM": (set(), {"shared"}), "ATOMS": ({"shared"}, {"shared"}),
    "LDL": ({"local"}, set()), "STL": (set(), {"local"}),
    "LDGSTS": ({"global"}, {"shared"}),
}
_ALIASES = {"global": {"global", "generic"}, "shared": {"shared", "generic"},
            "local": {"local", "generic"}, "generic": {"global", "shared", "local", "generic"}}


@dataclass(frozen=True)
class Facts:
    """What the dependency model needs to know about one instruction."""
    reads: frozenset[int]
    writes: frozenset[int]
    write_sb: int
    read_sb: int
    waits: int
    sets: int
    loads: frozenset[str]
    stores: frozenset[str]
    ordered: bool  # strong access: ordered against every access of an aliasing space
    pin: str | None  # why it never moves
    fence: bool  # pinned, and nothing crosses it either (an address pin is no fence)
    anchor: bool  # register effects unknown: latency pairs end and restart here
    horizon: int  # LATENCY_HORIZON of its class
    stall: int  # original stall count
    variable: bool  # variable latency: completion tracked by scoreboards
    opclass: str  # latency class (sip.latency)
    guards: frozenset[int]  # registers read as its guard predicate
    sync: str = ""  # under the `sync` relaxation: "barrier", "mbarrier" or "wgmma" (see the module doc)


_NAMES_REGISTER = re.compile(r"(?<![\w.$])U?(R\d|P\d|PR\b)")


# Control transfers whose targets or return points the CFG (sip.cfg) does not see: with one in the
# kernel, what is in flight at a block's entry is not derived from its predecessors.
_UNSEEN_TARGETS = frozenset({"BRX", "BRXU", "JMX", "JMXU", "CALL", "RET", "BREAK", "RTT"})

# The wgmma family: fences in every model; their registers are what the WARPGROUP pair guards.
WGMMA = frozenset({"HGMMA", "IGMMA", "QGMMA", "BGMMA"})
_WGMMA_SHAPE = re.compile(r"64x(\d+)x\d+")


def sync_kind(ins: Instruction) -> str:
    """The `sync` relaxation's kind of a synchronisation instruction ("" when it stays a fence)."""
    mods = set(ins.modifiers)
    if ins.predicate in ("@!PT", "@!UPT"):
        return ""
    if ins.base == "BAR" and mods & {"SYNC", "ARV"} and not mods & {"RED", "SCAN", "ALL"}:
        return "barrier"
    if ins.base == "SYNCS" and ins.modifiers[:1] == ("ARRIVE",) and "RED" not in mods and ins.operands[:1] == ("RZ",):
        return "mbarrier"
    if ins.opcode in ("WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR.LE"):
        return "wgmma"
    return ""


def wgmma_registers(ins: Instruction) -> frozenset[int] | None:
    """Every register a wgmma instruction may read or write: its accumulator (N/2 registers of
    a 64xN tile, the F32 size, a superset for F16), an A fragment in registers (4), descriptor
    registers (a pair of 64-bit descriptors, 4 uniform registers) and predicates; None when the
    operands are not of a form this knows."""
    shape = _WGMMA_SHAPE.fullmatch(ins.modifiers[0]) if ins.modifiers else None
    if shape is None or not ins.operands or not re.fullmatch(r"R\d+", ins.operands[0]):
        return None
    out = set(regs_in(ins.operands[0], int(shape.group(1)) // 2))
    for op in ins.operands[1:]:
        if op.startswith("gdesc["):
            out |= regs_in(op[:op.index("]") + 1], 4)
        elif re.fullmatch(r"R\d+", op):
            out |= regs_in(op, 4)
        elif re.fullmatch(r"!?U?P(\d|T)|RZ|gsb0", op):
            out |= regs_in(op)
        else:
            return None
    return frozenset(out | regs_in(ins.predicate))


def facts_of(ins: Instruction, cubin_pin: str | None, patch_point: bool = False, sync: bool = False) -> Facts:
    """What the model needs of one instruction; `sync`: under the `sync` relaxation."""
    base = ins.base
    mods = set(ins.modifiers)
    ctl = ins.control
    loads, stores = _ACCESS.get(base, (set(), set()))
    kind = sync_kind(ins) if sync and not patch_point else ""
    if sync and base in WGMMA and not patch_point:
        # Still a fence, but with its registers known: an instruction that touches none of them
        # keeps no fixed-latency distance from it (it is no anchor).
        regs = wgmma_registers(ins)
        if regs is not None:
            return Facts(regs, regs, ctl.write_sb, ctl.read_sb, ctl.wait, ctl.sets, frozenset(), frozenset(), False,
                         f"synchronisation ({ins.opcode}): nothing moves across it", True, False, UNKNOWN_HORIZON,
                         ctl.stall, bool(ctl.sets), opclass(ins),
                         regs_in(ins.predicate) if ins.predicate else frozenset())
    if kind:
        # Its registers are the operands it names (no destination: BAR and WARPGROUP write none,
        # the arrive writes RZ); it keeps its slot, other instructions may pass it (module doc).
        reads = ins.reads | regs_in(",".join(ins.operands))
        pin = cubin_pin or f"synchronisation ({ins.opcode}): keeps its slot, register-only work may pass it"
        return Facts(reads, frozenset(), ctl.write_sb, ctl.read_sb, ctl.wait, ctl.sets, frozenset(), frozenset(),
                     False, pin, False, False, LATENCY_HORIZON_DEFAULT if reads else 0, ctl.stall,
                     bool(ctl.sets), opclass(ins), regs_in(ins.predicate) if ins.predicate else frozenset(), kind)
    fence = None
    if ins.control_flow:
        fence = f"control flow ({base}) never moves"
    elif base in FENCES or ins.inter_warp or (loads | stores and mods & _FENCE_MODIFIERS):
        fence = f"synchronisation ({ins.opcode}): nothing moves across it"
    elif base in ("S2R", "CS2R", "S2UR") and any(_CLOCK.search(op) for op in ins.operands):
        fence = f"reads a clock ({ins.opcode})"
    elif base == "NOP":
        fence = "NOP keeps its slot"
    elif ins.predicate in ("@!PT", "@!UPT"):
        fence = "never executes: ptxas placed it for its side effect on timing"
    elif ins.unknown:
        fence = f"unknown operand semantics: {ins.unknown}"
    elif patch_point:
        fence = f"{cubin_pin}: a place the driver or a tool may patch"
    pin = fence or cubin_pin
    anchor = bool(ins.unknown) and any(_NAMES_REGISTER.search(op) for op in ins.operands)
    waits = ctl.wait
    if base == "DEPBAR":  # DEPBAR.LE SBn, k waits on SBn through its operand
        for op in ins.operands:
            m = re.fullmatch(r"SB(\d)", op)
            waits |= 1 << int(m.group(1)) if m else 0
    if anchor:
        horizon = UNKNOWN_HORIZON
    elif ins.writes or ins.reads:
        horizon = LATENCY_HORIZON.get(base, LATENCY_HORIZON_DEFAULT)
    else:
        horizon = 0
    return Facts(ins.reads, ins.writes, ctl.write_sb, ctl.read_sb, waits, ctl.sets,
                 frozenset(loads), frozenset(stores),
                 bool(mods & _ORDERED_MODIFIERS) and bool(loads | stores),
                 pin, fence is not None, anchor, horizon, ctl.stall,
                 base in VARIABLE_LATENCY or bool(ctl.sets), opclass(ins),
                 regs_in(ins.predicate) if ins.predicate else frozenset())


class DependencyModel:
    """Dependencies of one kernel, computed once from its original instruction order; with
    `latencies`, fixed-latency distances are bounded by the measured table (see the module doc)."""

    def __init__(self, kernel: Kernel, latencies: LatencyTable | None = None, relax: frozenset[str] = frozenset()):
        unknown = set(relax) - set(RELAXATIONS)
        if unknown:
            raise SipError(f"unknown relaxation {sorted(unknown)[0]!r}: choose from {', '.join(RELAXATIONS)}")
        self.kernel = kernel
        self.latencies = latencies
        self.relax = frozenset(relax)
        pins, fenced = kernel.code.pins, kernel.code.fenced
        self.wgmma_regs = self._wgmma_registers() if "sync" in self.relax else None
        sync = self.wgmma_regs is not None
        self.facts = tuple(facts_of(i, pins.get(i.offset), i.offset in fenced, sync) for i in kernel.instructions)
        self.blocks = tuple(tuple(r) for r in kernel.blocks)
        self.self_covered = self._self_covered()
        self.guard = self._guards()
        self.in_flight = self._in_flight() if "scoreboard" in self.relax else None
        self.counted = self._counted()
        self.anchor_horizon = max((f.horizon for f in self.facts), default=0)
        self._conflicts: dict[tuple[int, int], str | None] = {}
        self.incoming, self.outgoing = self._latency_pairs()

    @property
    def instructions(self) -> tuple[Instruction, ...]:
        return self.kernel.instructions

    def end(self, block: int) -> int:
        """Consumer id of the end of `block` (successors' first instructions stand behind it)."""
        return len(self.facts) + block

    # ------------------------------------------------------------ pairwise legality

    def conflict(self, a: int, b: int) -> str | None:
        """Why instructions a and b must keep their relative order; None if they may swap."""
        key = (a, b) if a < b else (b, a)
        if key not in self._conflicts:
            self._conflicts[key] = self._conflict(*key)
        return self._conflicts[key]

    def _conflict(self, a: int, b: int) -> str | None:
        fa, fb = self.facts[a], self.facts[b]
        for i, f in ((a, fa), (b, fb)):
            if f.fence:
                return f"instruction {i} is pinned: {f.pin}"
        raw = fa.writes & fb.reads
        if raw:
            return f"RAW on {format_regs(raw)}"
        war = fa.reads & fb.writes
        if war:
            return f"WAR on {format_regs(war)}"
        waw = fa.writes & fb.writes
        if waw:
            return f"WAW on {format_regs(waw)}"
        for first, second, fs, ss in ((a, b, fa, fb), (b, a, fb, fa)):
            both = fs.sets & ss.waits
            if both:
                return f"scoreboard: {second} waits on SB{_bits(both)} that {first} sets"
        both = fa.sets & fb.sets
        if both and (self.in_flight is None or both & self.counted):
            return f"scoreboard: both set SB{_bits(both)}"
        if self.in_flight is None:
            for waiter, other, fw, fo in ((a, b, fa, fb), (b, a, fb, fa)):
                for sb in _each_bit(fw.waits):
                    hit = (fo.reads | fo.writes) & self.guard[sb]
                    if hit:
                        return (f"scoreboard: {waiter} waits on SB{sb}, which guards "
                                f"{format_regs(hit)} used by {other}")
        else:  # only a later instruction passing a wait upward can lose its protection
            for sb, flying in self.in_flight.get(a, {}).items():
                hit = (fb.reads | fb.writes) & flying
                if hit:
                    return (f"scoreboard: {a} waits on SB{sb}, where {format_regs(hit)} used by {b} "
                            "may be in flight")
        for s, o, fs, fo in ((a, b, fa, fb), (b, a, fb, fa)):
            if fs.sync:
                reason = self._sync_conflict(s, o, fs, fo)
                if reason:
                    return reason
        if fa.variable and fb.variable:
            for x, fx in ((a, fa), (b, fb)):
                if fx.writes and not self.self_covered[x]:
                    return (f"in-order completion: #{x} has variable latency and its results may "
                            "be covered by a later instruction's scoreboard")
            for x, fx, fy in ((a, fa, fb), (b, fb, fa)):
                if fx.reads and fx.read_sb == NO_SCOREBOARD and fy.read_sb != NO_SCOREBOARD:
                    return (f"in-order completion: #{x} reads registers without a read "
                            "scoreboard; the other one's read scoreboard may cover it")
        return _memory_conflict(fa, fb)

    def _sync_conflict(self, s: int, o: int, fs: Facts, fo: Facts) -> str | None:
        """Why `o` may not pass the relaxed synchronisation instruction `s` (module doc)."""
        if fo.sync:
            return f"synchronisation: #{s} and #{o} keep their order"
        if fo.loads or fo.stores:
            return f"memory order: #{o} accesses memory, which #{s} ({self.instructions[s].opcode}) orders"
        if fs.sync == "wgmma":
            hit = (fo.reads | fo.writes) & self.wgmma_regs
            if hit:
                return f"wgmma: #{o} touches {format_regs(hit)}, registers of a wgmma that #{s} fences"
        return None

    def _wgmma_registers(self) -> frozenset[int] | None:
        """Every register some wgmma of the kernel names (None: one has operands of an unknown
        form, and the WARPGROUP fences stay fences)."""
        out: set[int] = set()
        for ins in self.instructions:
            if ins.base in WGMMA:
                regs = wgmma_registers(ins)
                if regs is None:
                    return None
                out |= regs
        return frozenset(out)

    def _counted(self) -> int:
        """Mask of the scoreboards some DEPBAR counts (DEPBAR.LE SBn, k): their setters keep their order."""
        mask = 0
        for ins in self.instructions:
            if ins.base == "DEPBAR":
                for op in ins.operands:
                    m = re.fullmatch(r"SB(\d)", op)
                    mask |= 1 << int(m.group(1)) if m else 0
        return mask

    def _in_flight(self) -> dict[int, dict[int, frozenset[int]]]:
        """waiter -> {SB it waits on: the registers that may be in flight on it there} (module doc)."""
        everything = frozenset(range(UP_BASE + 7))
        loose = frozenset(r for x, f in enumerate(self.facts)
                          if f.variable and f.writes and not self.self_covered[x] for r in f.writes)
        unknown_setter = [False] * 6
        for f, ins in zip(self.facts, self.instructions):
            if ins.unknown and not f.sync:
                for sb in _each_bit(f.sets):
                    unknown_setter[sb] = True
        guard = tuple(everything if unknown_setter[sb] else self.guard[sb] | loose for sb in range(6))
        entries = self._entry_in_flight(loose, everything)
        out: dict[int, dict[int, frozenset[int]]] = {}
        for b, block in enumerate(self.blocks):
            self._walk_in_flight(block, list(entries[b] or guard), loose, everything, out)
        return out

    def _walk_in_flight(self, block, flying: list[frozenset[int]], loose, everything, out=None) -> list[frozenset[int]]:
        """Carry the per-SB in-flight registers through `block` (recording each waiter's in `out`)."""
        for i in block:
            f, ins = self.facts[i], self.instructions[i]
            if f.waits:
                if out is not None:
                    out[i] = {sb: flying[sb] for sb in _each_bit(f.waits)}
                for sb in _each_bit(ins.control.wait):  # full waits; a DEPBAR count clears nothing
                    flying[sb] = loose
            for sb in _each_bit(f.sets):
                if ins.unknown and not f.sync:
                    flying[sb] = everything
                else:
                    mine = (f.writes if f.write_sb == sb else frozenset()) | (f.reads if f.read_sb == sb else frozenset())
                    flying[sb] = flying[sb] | mine
        return flying

    def _entry_in_flight(self, loose, everything) -> list[tuple[frozenset[int], ...] | None]:
        """Per block, what may be in flight on each SB when control enters it: the union over its
        CFG predecessors of what leaves them (nothing at a kernel entry), to a fixed point; None for
        every block (the conservative guard) when the kernel has control transfers whose targets
        the CFG cannot see, and for blocks the CFG never reaches."""
        kernel = self.kernel
        if any(i.base in _UNSEEN_TARGETS for i in self.instructions):
            return [None] * len(self.blocks)
        succ = cfg.successors(kernel)
        state: list[tuple[frozenset[int], ...] | None] = [None] * len(self.blocks)
        work = list(cfg.entry_blocks(kernel))
        for e in work:
            state[e] = (loose,) * 6
        while work:
            b = work.pop()
            leaving = self._walk_in_flight(self.blocks[b], list(state[b]), loose, everything)
            for t in succ[b]:
                merged = leaving if state[t] is None else tuple(x | y for x, y in zip(state[t], leaving))
                if merged != state[t]:
                    state[t] = tuple(merged)
                    work.append(t)
        return state

    def dependencies(self, block: int) -> list[tuple[int, int, str]]:
        """Every (earlier, later, reason) pair of `block` that must keep its order (for tests
        and reports: quadratic in the block length)."""
        ins = self.blocks[block]
        return [(x, y, r) for k, x in enumerate(ins) for y in ins[k + 1:]
                if (r := self.conflict(x, y)) is not None]

    def _guards(self) -> tuple[frozenset[int], ...]:
        """Per scoreboard: the registers a wait on it may be protecting. The results of a
        variable-latency instruction that is not self-covered may ride on any scoreboard."""
        guard: list[set[int]] = [set() for _ in range(6)]
        for x, f in enumerate(self.facts):
            if f.write_sb != NO_SCOREBOARD:
                guard[f.write_sb] |= f.writes
            if f.read_sb != NO_SCOREBOARD:
                guard[f.read_sb] |= f.reads
            if f.variable and f.writes and not self.self_covered[x]:
                for g in guard:
                    g |= f.writes
        return tuple(frozenset(g) for g in guard)

    def _self_covered(self) -> tuple[bool, ...]:
        """Per instruction: it sets a write scoreboard, and inside its block a wait on that
        scoreboard comes before (or with) every use of its results, and before the block end."""
        covered = [False] * len(self.facts)
        waits = [i.control.wait for i in self.kernel.instructions]  # DEPBAR counts are not full waits
        for block in self.blocks:
            for k, x in enumerate(block):
                f = self.facts[x]
                sb = f.write_sb
                if not (f.variable and f.writes and sb != NO_SCOREBOARD):
                    continue
                for q in range(k + 1, len(block)):
                    y = block[q]
                    if waits[y] >> sb & 1:
                        covered[x] = True
                        break
                    fy = self.facts[y]
                    if fy.anchor or not f.writes.isdisjoint(fy.reads) or not f.writes.isdisjoint(fy.writes):
                        break
        return tuple(covered)

    # ------------------------------------------------------------ fixed-latency pairs

    def _latency_pairs(self):
        """incoming[consumer] = {producer: required}, outgoing[producer] = {consumer: required};
        consumers include block ends (see end()), producers include START."""
        n = len(self.facts)
        incoming: list[dict[int, int]] = [dict() for _ in range(n + len(self.blocks))]
        outgoing: list[dict[int, int]] = [dict() for _ in range(n)]
        for b, block in enumerate(self.blocks):
            for p, c, required in self._block_pairs(b, block):
                if required > incoming[c].get(p, 0):
                    incoming[c][p] = required
                    if p != START:
                        outgoing[p][c] = required
        return tuple(incoming), tuple(outgoing)

    def _bound(self, p: int, c: int | None, reg: int | None, raw: bool, guarded: bool) -> int:
        """How far apart producer p and consumer c must stay at most (see the module doc): the
        distance the original kept is capped at this. c None: a consumer the model cannot see."""
        if guarded:
            return SCOREBOARD_SETUP
        facts = self.facts
        if p == START or facts[p].anchor:
            return self.anchor_horizon
        fp = facts[p]
        table = self.latencies
        if table is None or c is None or fp.variable:
            return fp.horizon
        if raw:
            measured = table.raw(fp.opclass, facts[c].opclass, register_file(reg, reg in facts[c].guards))
        else:
            measured = table.producer_bound(fp.opclass)
        return fp.horizon if measured is None else min(measured, fp.horizon)

    def _block_pairs(self, b: int, block: tuple[int, ...]):
        """(producer, consumer, required) for the register and scoreboard pairs of one block."""
        facts = self.facts
        at = {}  # instruction -> stall cycles from the block start to its issue
        total = 0
        for i in block:
            at[i] = total
            total += facts[i].stall
        end = self.end(b)
        at[end] = total
        at[START] = 0
        bound = self._bound

        origin = START  # stands for every producer not seen yet: block start, or the last anchor
        last_write: dict[int, int] = {}
        readers: dict[int, list[int]] = {}
        last_setter: dict[int, int] = {}

        def close(c: int):
            """Pairs from everything tracked so far into c (an anchor, or the block end)."""
            for p in set(last_write.values()):
                yield p, c, min(at[c] - at[p], bound(p, None, None, True, facts[p].write_sb != NO_SCOREBOARD))
            for rs in readers.values():
                for p in rs:
                    yield p, c, min(at[c] - at[p], bound(p, None, None, False, facts[p].read_sb != NO_SCOREBOARD))
            for p in last_setter.values():
                yield p, c, min(at[c] - at[p], SCOREBOARD_SETUP)

        for i in block:
            f = facts[i]
            if f.anchor:
                yield from close(i)
                origin, last_write, readers = i, {}, {}
                continue
            here = at[i]
            for r in f.reads | f.writes:
                p = last_write.get(r, origin)
                guarded = p != origin and facts[p].write_sb != NO_SCOREBOARD
                yield p, i, min(here - at[p], bound(p, i, r, r in f.reads, guarded))
            for r in f.writes:
                for rd in readers.get(r, ()):
                    yield rd, i, min(here - at[rd], bound(rd, i, r, False, facts[rd].read_sb != NO_SCOREBOARD))
            if f.waits:
                for sb in _each_bit(f.waits):
                    p = last_setter.get(sb, origin)
                    yield p, i, min(here - at[p], SCOREBOARD_SETUP)
            for r in f.reads:
                readers.setdefault(r, []).append(i)
            for r in f.writes:
                last_write[r] = i
                readers.pop(r, None)
            if f.sets:
                for sb in _each_bit(f.sets):
                    last_setter[sb] = i
        yield from close(end)


def _memory_conflict(fa: Facts, fb: Facts) -> str | None:
    for x, y in ((fa, fb), (fb, fa)):
        for space in x.stores:
            hit = _ALIASES[space] & (y.loads | y.stores)
            if hit:
                return f"memory order: a store to {space} memory and an access to {min(hit)} memory"
        if x.ordered:
            for space in x.loads | x.stores:
                hit = _ALIASES[space] & (y.loads | y.stores)
                if hit:
                    return f"memory order: a strong {space} access and an access to {min(hit)} memory"
    return None


def _each_bit(mask: int):
    return [b for b in range(6) if mask >> b & 1]


def _bits(mask: int) -> str:
    return ",".join(str(b) for b in _each_bit(mask))
