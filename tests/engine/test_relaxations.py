"""sip.deps' relaxations (`scoreboard`, `sync`) and the untrusted names of sip.mutate: one refusal or
permission per rule on hand-written code, then random walks on real Hopper kernels (the corpus and a
CuTeDSL attention prefill, the compute-bound code they are for) checked against an independent
simulation of the scoreboards, and written back through nvdisasm."""
import dataclasses
import random
import re

import pytest
from sip_checks import assert_round_trip, assert_schedule_is_correct
from sip_corpus import corpus, synthetic_kernel  # noqa: F401

from sip import SipError, cfg
from sip.cubin import parse_cubin
from sip.deps import RELAXATIONS, DependencyModel
from sip.mutate import (MOVE_CLASSES, UNTRUSTED, IllegalMove, Move, Schedule, initial_schedule, parse_moves,
                        step)
from sip.sass import NO_SCOREBOARD, Control, disassemble, regs_in

SB = frozenset({"scoreboard"})
SYNC = frozenset({"sync"})


def ctl(stall=1, wsb=NO_SCOREBOARD, rsb=NO_SCOREBOARD, wait=()):
    return Control(stall, 1, wsb, rsb, sum(1 << b for b in wait), 0)


EXIT = ("EXIT ;", ctl(5))


def schedule(rows, relax=frozenset(), moves=frozenset({"alu", "shared"})):
    return Schedule.initial(DependencyModel(synthetic_kernel(rows), relax=relax), moves | relax)


def legal(s, instruction, direction):
    try:
        s.moved(Move(instruction, direction))
    except IllegalMove as e:
        return e.reason
    return None


# ---------------------------------------------------------------- names

def test_relaxations_are_named_beside_a_class_and_untrusted():
    assert parse_moves("alu,scoreboard,sync") == {"alu", *RELAXATIONS}
    assert not parse_moves("all") & UNTRUSTED  # `all` keeps to the trusted classes
    assert UNTRUSTED == set(RELAXATIONS)
    rows = [("FADD R1, R2, R3 ;", ctl()), EXIT]
    with pytest.raises(SipError, match="name one beside them"):
        Schedule.initial(DependencyModel(synthetic_kernel(rows), relax=SB), frozenset(SB))
    with pytest.raises(SipError, match="dependency model was built with"):
        Schedule.initial(DependencyModel(synthetic_kernel(rows)), frozenset({"alu", "scoreboard"}))
    with pytest.raises(SipError, match="unknown relaxation"):
        DependencyModel(synthetic_kernel(rows), relax=frozenset({"barriers"}))
    s = initial_schedule(synthetic_kernel(rows), frozenset({"alu", "sync"}))
    assert s.model.relax == SYNC


# ---------------------------------------------------------------- scoreboard: one rule at a time

MUFU_ROWS = [
    ("MUFU.EX2 R30, R30 ;", ctl(1, wsb=1)),       # 0: SB1 guards R30 (kernel-wide) ...
    ("FADD R31, R30, R31 ;", ctl(2, wait=[1])),   # 1: ... but this full wait lands it
    ("MUFU.EX2 R10, R10 ;", ctl(1, wsb=1)),       # 2: R10 in flight on SB1
    ("FADD R20, R21, R22 ;", ctl(2, wait=[1])),   # 3: waits SB1: only R10 is in flight here
    ("FADD R32, R30, R33 ;", ctl(2)),             # 4: reads R30, landed at 1: may pass the wait
    ("FADD R11, R10, R34 ;", ctl(2)),             # 5: reads R10: the wait at 3 protects it
    EXIT,
]


def test_a_wait_protects_only_what_is_in_flight_where_it_stands():
    trusted, relaxed = schedule(MUFU_ROWS), schedule(MUFU_ROWS, SB)
    assert "which guards R30" in legal(trusted, 4, -1)
    assert legal(relaxed, 4, -1) is None
    reason = legal(relaxed.moved(Move(4, -1)), 5, -1)  # R10's reader, now right after the wait
    assert "waits on SB1, where R10 used by 5 may be in flight" in reason
    assert legal(relaxed, 3, +1) is None  # the same swap seen from the waiter


def test_a_full_wait_ends_what_was_in_flight_before_it():
    rows = [("MUFU.EX2 R10, R10 ;", ctl(1, wsb=1)),
            ("FADD R11, R10, R33 ;", ctl(2, wait=[1])),  # full wait: R10 has landed
            ("FADD R20, R21, R22 ;", ctl(2, wait=[1])),  # a second wait on SB1: nothing in flight there
            ("FADD R12, R10, R34 ;", ctl(2)),            # reads R10: the first wait covered it
            EXIT]
    assert legal(schedule(rows, SB), 3, -1) is None
    assert legal(schedule(rows), 3, -1) is not None
    counted = rows[:2] + [("DEPBAR.LE SB1, 0x1 ;", ctl(2))] + rows[3:]  # a count clears nothing
    assert "pinned" in legal(schedule(counted, SB), 3, -1)


def test_what_a_predecessor_leaves_in_flight_is_guarded_at_the_block_start():
    rows = [("MUFU.EX2 R10, R10 ;", ctl(1, wsb=1)),
            ("@P0 BRA 0x30 ;", ctl(5)),                  # block 0 ends with R10 in flight on SB1
            ("FADD R40, R41, R42 ;", ctl(2)),            # block 1
            ("FADD R43, R44, R45 ;", ctl(2)),            # block 2 (the branch target)
            ("FADD R20, R21, R22 ;", ctl(2, wait=[1])),  # the block's first wait on SB1
            ("FADD R11, R10, R33 ;", ctl(2)),            # reads R10 from block 0: stays after the wait
            ("FADD R30, R31, R32 ;", ctl(2)),            # unrelated: may pass it
            EXIT]
    k = synthetic_kernel(rows)
    assert [tuple(b) for b in k.blocks] == [(0, 1), (2,), (3, 4, 5, 6, 7)]
    s = Schedule.initial(DependencyModel(k, relax=SB), frozenset({"alu", "scoreboard"}))
    assert "may be in flight" in legal(s, 5, -1)
    assert legal(s.moved(Move(5, +1)), 6, -1) is None  # R30 passes the wait once R11's FADD is out of the way


def test_setters_of_one_scoreboard_swap_unless_a_depbar_counts_it():
    rows = [("FADD R1, R2, R3 ;", ctl(2)),
            ("MUFU.EX2 R10, R10 ;", ctl(1, wsb=1)),
            ("SHFL.BFLY PT, R12, R13, 0x1, 0x1f ;", ctl(1, wsb=1)),
            ("FADD R14, R10, R12 ;", ctl(4, wait=[1])),
            EXIT]
    assert "both set SB1" in legal(schedule(rows), 2, -1)
    assert legal(schedule(rows, SB), 2, -1) is None
    counted = rows[:4] + [("DEPBAR.LE SB1, 0x0 ;", ctl(2)), EXIT]
    assert "both set SB1" in legal(schedule(counted, SB), 2, -1)


def test_an_uncovered_variable_result_stays_guarded():
    """A MUFU with no scoreboard of its own rides on a later one's: every wait guards its result."""
    rows = [("MUFU.EX2 R10, R10 ;", ctl(1)),
            ("MUFU.EX2 R11, R11 ;", ctl(1, wsb=1)),
            ("FADD R20, R11, R22 ;", ctl(2, wait=[1])),
            ("FADD R12, R10, R34 ;", ctl(2)),
            EXIT]
    assert "R10" in legal(schedule(rows, SB), 3, -1)


# ---------------------------------------------------------------- sync: one rule at a time

HGMMA = "HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR8].tnspB, R24, gsb0 ;"  # R24..R55, R56..R59, UR8..UR11


def sync_rows(middle):
    return [("FADD R1, R2, R3 ;", ctl(2)), ("WARPGROUP.ARRIVE ;", ctl(1)), (HGMMA, ctl(1)),
            ("FADD R4, R5, R6 ;", ctl(2)), middle, ("FADD R7, R8, R9 ;", ctl(2)), EXIT]


@pytest.mark.parametrize("middle", ["BAR.SYNC.DEFER_BLOCKING R0, 0x100 ;", "BAR.ARV 0x4, 0x100 ;",
                                    "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR6+0x28], RZ ;"])
def test_register_only_work_passes_barriers_and_wgmma_waits(middle):
    rows = sync_rows((middle, ctl(2)))
    assert "pinned" in legal(schedule(rows), 5, -1)
    s = schedule(rows, SYNC)
    assert legal(s, 5, -1) is None and legal(s, 3, +1) is None  # hops over it, either way
    hopped = s.moved(Move(5, -1))
    assert hopped.blocks[0][4] == 4 and hopped.blocks[0][3] == 5  # the barrier kept its slot
    assert "pinned" in legal(s, 3, -1)  # the wgmma itself is still a fence


def test_memory_accesses_and_wgmma_registers_do_not_pass():
    for mover in ("LDS R7, [R8] ;", "STS [R8], R7 ;"):
        rows = sync_rows(("BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;", ctl(2)))
        rows[5] = (mover, ctl(2, wsb=0) if mover.startswith("LDS") else ctl(2))
        assert "memory order" in legal(schedule(rows, SYNC), 5, -1)
    for reg in ("R40", "R57", "UR9"):  # accumulator, A fragment, descriptor
        rows = sync_rows(("WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", ctl(2)))
        rows[5] = (f"IADD3 R7, {reg}, 0x1, RZ ;" if reg[0] == "R" else f"UIADD3 UR20, {reg}, 0x1, URZ ;", ctl(2))
        assert "registers of a wgmma" in legal(schedule(rows, SYNC), 5, -1)
    rows = sync_rows(("BAR.SYNC.DEFER_BLOCKING R7, 0x100 ;", ctl(2)))  # reads R7, which the FADD after it writes
    assert "WAR on R7" in legal(schedule(rows, SYNC), 5, -1)
    rows = sync_rows(("BAR.RED.POPC.DEFER_BLOCKING R7, 0x0 ;", ctl(2)))  # writes a result: stays a fence
    assert "pinned" in legal(schedule(rows, SYNC), 5, -1)


# ---------------------------------------------------------------- walks on real kernels

@pytest.fixture(scope="module")
def attention_cubin():
    """The varlen d=64 non-causal attention prefill (issue 40's target): softmax MUFU/FMNMX/FADD chains,
    SHFL reductions, named barriers and WARPGROUP waits in one KV loop."""
    pytest.importorskip("torch")
    pytest.importorskip("cutlass")
    from rosekernels.kernels import attention

    return attention.compile(attention.varlen_config(64, "bf16", False, 0)).cubin


def _kernels(corpus, attention_cubin):
    out = [(name, corpus[name]) for name in ("wgmma_tma", "rosekernels_tma_wgmma_gemm", "smem_tiled_gemm",
                                             "cp_async_pipeline", "warp_reduce_atomics") if name in corpus]
    return out + [("attention_varlen_d64", attention_cubin)]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["alu,scoreboard", "alu,sync", "alu,shared,global,scoreboard,sync"])
def test_relaxed_walks_keep_every_scoreboard_and_barrier_guarantee(corpus, attention_cubin, policy):
    """Random legal walks (hot blocks first) under each relaxed policy: after every 25th change, the
    schedule's own invariants, an independent simulation of the scoreboards over the new order, and
    the relaxed rules checked pair by pair against the trusted model; then nvdisasm reads the cubin
    back. The walks must reach changes the trusted model refuses (else this tests nothing)."""
    moves = parse_moves(policy)
    beyond = 0
    for name, data in _kernels(corpus, attention_cubin):
        for kernel in disassemble(parse_cubin(data)).values():
            model = DependencyModel(kernel, relax=moves & UNTRUSTED)
            trusted = DependencyModel(kernel)
            s = Schedule.initial(model, moves)
            rng = random.Random(f"{policy}/{name}")
            for k in range(600):
                taken = step(s, rng)
                if taken is None:
                    break
                s, change = taken
                if k % 25 == 0:
                    assert_schedule_is_correct(s, check_order=False)
                    beyond += _check_against_trusted(s, trusted)
                    _simulate_scoreboards(s)
            assert_schedule_is_correct(s, check_order=False)
            beyond += _check_against_trusted(s, trusted)
            _simulate_scoreboards(s)
            assert_round_trip(s)
    assert beyond > 0


def _check_against_trusted(s, trusted) -> int:
    """Every pair the schedule inverted is free under the trusted model, or inverted under a rule
    this policy relaxes and sound by that rule's own semantics; returns how many needed a relaxation."""
    model, ins = s.model, s.model.instructions
    relaxed = 0
    for b, block in enumerate(s.blocks):
        slot = {x: k for k, x in enumerate(block)}
        moved = [x for k, x in enumerate(block) if model.blocks[b][k] != x]
        for x in moved:
            for y in block:
                if not (x < y and slot[x] > slot[y]):
                    continue
                reason = trusted.conflict(x, y)
                if reason is None:
                    continue
                relaxed += 1
                if "both set" in reason:
                    assert "scoreboard" in model.relax
                    both = model.facts[x].sets & model.facts[y].sets
                    counted = {int(op[2:]) for i in ins if i.base == "DEPBAR" for op in i.operands if op[:2] == "SB"}
                    assert not any(both >> sb & 1 for sb in counted), (x, y, reason)
                elif "guards" in reason or "in-order completion" in reason:
                    # `scoreboard` narrows what a wait guards; `sync` models the wgmma registers, which
                    # makes more results self-covered: _simulate_scoreboards checks both by semantics
                    assert model.relax, (x, y, reason)
                else:
                    assert "sync" in model.relax and "pinned: synchronisation" in reason, (x, y, reason)
                    barrier, other = (x, y) if model.facts[x].sync else (y, x)
                    assert model.facts[barrier].sync and not model.facts[other].sync, (x, y, reason)
                    o = ins[other]
                    assert not re.match(r"(LD|ST|ATOM|RED)", o.base), o.text
                    if ins[barrier].base == "WARPGROUP":
                        assert not (o.reads | o.writes) & _wgmma_fragments(ins), o.text
    return relaxed


def _wgmma_fragments(ins) -> frozenset[int]:
    """Registers of every HGMMA, by the PTX ISA's fragment sizes: an m64nNk16 F32 accumulator is
    64 * N / 128 registers per thread, a k16 A fragment 4, a descriptor pair 4 uniform registers."""
    out = set()
    for i in ins:
        if i.base == "HGMMA":
            n = int(re.match(r"64x(\d+)x16", i.modifiers[0]).group(1))
            out |= regs_in(i.operands[0], 64 * n // 128)
            for op in i.operands[1:]:
                out |= regs_in(op.split(".")[0], 4) if op[0] in "Rg" else regs_in(op)
    return frozenset(out)


def _simulate_scoreboards(s):
    """Walk the schedule's order, block by block: a variable-latency result is in flight on its write
    scoreboard, and an operand on its read scoreboard, until a full wait on that scoreboard; no
    instruction may read a register whose write is in flight or write one in flight either way.
    What enters a block is what the original order leaves in its CFG predecessors (computed here by
    running the same walk over the original code); for blocks the CFG cannot see into, everything set
    anywhere except what the original block itself touches before its first full wait on that
    scoreboard (ptxas' code says those are not in flight there)."""
    model = s.model
    ins, facts = model.instructions, model.facts
    unseen = any(i.base in ("BRX", "JMX", "CALL", "RET", "BREAK") for i in ins)
    anywhere = [set(), set()]
    for f in facts:
        if f.write_sb != NO_SCOREBOARD:
            anywhere[0] |= {(f.write_sb, r) for r in f.writes}
        if f.read_sb != NO_SCOREBOARD:
            anywhere[1] |= {(f.read_sb, r) for r in f.reads - f.guards}
    entry = {} if unseen else _entries(model)
    for b, block in enumerate(s.blocks):
        start = entry.get(b) or _unseen_entry(model, model.blocks[b], anywhere)
        # ptxas knows where an operand is read at issue although a read scoreboard is set (an mbarrier
        # arrive's uniform address): what its own order does is allowed, nothing more
        allowed = _walk(model, model.blocks[b], start)
        late = _walk(model, block, start) - allowed
        assert not late, "uses while in flight: " + "; ".join(
            f"{model.instructions[x].text} {sorted(r)}" for x, r in sorted(late)[:5])
        _opaque_waits_hold(model, model.blocks[b], block)


def _opaque_waits_hold(model, original, order):
    """A wait on a scoreboard that an instruction of unknown register effects set (since the last full
    wait on it, in the original order) keeps every later instruction of the original after it."""
    opaque = 0  # scoreboards an unknown instruction set, not yet fully waited on
    slot = {x: k for k, x in enumerate(order)}
    for k, x in enumerate(original):
        i, f = model.instructions[x], model.facts[x]
        if f.waits & opaque:
            assert all(slot[y] > slot[x] for y in original[k + 1:]), f"{i.text}: an instruction passed it"
        opaque &= ~i.control.wait
        if i.unknown and not f.sync:
            opaque |= f.sets


def _unseen_entry(model, original, anywhere):
    used = set()  # (SB, register) the original block touches before its first full wait on SB
    waited = 0
    for x in original:
        i, f = model.instructions[x], model.facts[x]
        waited |= i.control.wait
        used |= {(sb, r) for sb in range(6) if not waited >> sb & 1 for r in f.reads | f.writes}
    return frozenset(anywhere[0] - used), frozenset(anywhere[1] - used)


def _walk(model, order, state, leaving=False):
    """The (instruction, registers) that use a register while it is in flight; with `leaving`, what is
    in flight after the last instruction instead."""
    written, read = set(state[0]), set(state[1])  # {(SB, register)}
    found = set()
    for x in order:
        i, f = model.instructions[x], model.facts[x]
        for sb in range(6):
            if i.control.wait >> sb & 1:
                written = {e for e in written if e[0] != sb}
                read = {e for e in read if e[0] != sb}
        if i.unknown and not f.sync:  # unknown effects: _opaque_waits_hold checks these waits instead
            continue
        late = {r for _, r in written} & (f.reads | f.writes) | {r for _, r in read} & f.writes
        if late:
            found.add((x, frozenset(late)))
        if f.write_sb != NO_SCOREBOARD and model.self_covered[x]:
            written |= {(f.write_sb, r) for r in f.writes}
        if f.read_sb != NO_SCOREBOARD:  # a guard predicate is read at issue, not through the scoreboard
            read |= {(f.read_sb, r) for r in f.reads - f.guards}
    return (frozenset(written), frozenset(read)) if leaving else frozenset(found)


def _entries(model):
    kernel = model.kernel
    succ = cfg.successors(kernel)
    state = {e: (frozenset(), frozenset()) for e in cfg.entry_blocks(kernel)}
    work = list(state)
    while work:
        b = work.pop()
        out = _walk(model, model.blocks[b], state[b], leaving=True)
        for t in succ[b]:
            merged = out if t not in state else (state[t][0] | out[0], state[t][1] | out[1])
            if merged != state.get(t):
                state[t] = merged
                work.append(t)
    return state


def test_the_original_code_passes_the_scoreboard_simulation(corpus, attention_cubin):
    """The simulation above is only a check if ptxas' own schedules pass it where every operand is read
    through its scoreboard (the trusted model's view of the barriers), and if it finds what a wait
    protects: the attention loop with one instruction moved above the wait that protects it fails."""
    for name, data in _kernels(corpus, attention_cubin):
        for kernel in disassemble(parse_cubin(data)).values():
            model = DependencyModel(kernel, relax=SB)
            s = Schedule.initial(model, frozenset({"alu", "scoreboard"}))
            entry = _entries(model)
            for b, block in enumerate(model.blocks):
                if b in entry:
                    assert not _walk(model, block, entry[b]), (name, b)
    kernel = max(disassemble(parse_cubin(attention_cubin)).values(), key=lambda k: len(k.instructions))
    model = DependencyModel(kernel, relax=SB)
    s = Schedule.initial(model, frozenset({"alu", "scoreboard"}))
    def protects_next(w):  # a full wait whose next instruction reads a result a setter before it left in flight
        nxt = kernel.instructions[w.index + 1]
        block = kernel.blocks[kernel.block_of[w.index]]
        def last_wait_after(p, sb):  # no full wait on sb between the setter p and w
            return not any(kernel.instructions[q].control.wait >> sb & 1 for q in range(p + 1, w.index))

        return w.control.wait and w.index + 1 in block and any(
            w.control.wait >> model.facts[p].write_sb & 1 and model.self_covered[p] and model.facts[p].writes & nxt.reads
            and last_wait_after(p, model.facts[p].write_sb)
            for p in range(block.start, w.index) if model.facts[p].write_sb != NO_SCOREBOARD)

    x = next(i.index for i in kernel.instructions[:-1] if protects_next(i))
    blocks = list(s.blocks)  # swap the two behind the model's back
    b = kernel.block_of[x]
    order = list(blocks[b])
    k = order.index(x)
    order[k], order[k + 1] = order[k + 1], order[k]
    blocks[b] = tuple(order)
    with pytest.raises(AssertionError, match="while in flight|passed it"):
        _simulate_scoreboards(dataclasses.replace(s, blocks=tuple(blocks)))


def test_relaxations_open_moves_in_the_softmax_loop(attention_cubin):
    """In the attention KV loop, more adjacent pairs may swap under the relaxations than without."""
    kernel = max(disassemble(parse_cubin(attention_cubin)).values(), key=lambda k: len(k.instructions))
    depth = cfg.loop_depth(kernel)
    hot = [b for b, r in enumerate(kernel.blocks) if depth[b] and len(r) > 200]
    assert hot
    free = {}
    for relax in (frozenset(), frozenset(RELAXATIONS)):
        model = DependencyModel(kernel, relax=relax)
        free[relax] = sum(model.conflict(x, y) is None for b in hot
                          for x, y in zip(kernel.blocks[b], kernel.blocks[b][1:]))
    assert free[frozenset(RELAXATIONS)] > free[frozenset()] * 1.05, free
    assert set(MOVE_CLASSES) >= {"alu", "shared", "global"}
