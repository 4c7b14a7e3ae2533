"""sip.mutate: schedules, moves, control-code repair, and the bytes they produce."""
import pytest
from sip_checks import assert_schedule_is_correct
from sip_corpus import CORPUS_NAMES, corpus, synthetic_kernel  # noqa: F401

from sip.cubin import parse_cubin
from sip.deps import DependencyModel
from sip.mutate import IllegalMove, Move, Schedule, apply, movable, random_walk, with_extra_stalls
from sip.sass import NO_SCOREBOARD, Control, control_bits, disassemble, with_control

_STALL, _REUSE = 0xF, 0xF << 17
MEMORY = frozenset({"global", "shared"})


def ctl(stall=1, wsb=NO_SCOREBOARD, rsb=NO_SCOREBOARD, wait=(), reuse=0):
    return Control(stall, 1, wsb, rsb, sum(1 << b for b in wait), reuse)


@pytest.fixture(scope="module")
def initial(corpus):
    """(corpus name, cubin, initial schedule moving global and shared accesses) of every corpus kernel."""
    out = []
    for name in CORPUS_NAMES:
        if name in corpus:
            cubin = parse_cubin(corpus[name])
            for kernel in disassemble(cubin).values():
                out.append((name, cubin, Schedule.initial(DependencyModel(kernel), MEMORY)))
    return out


# ---------------------------------------------------------------- identity and round trip

def test_the_initial_schedule_writes_the_cubin_back_unchanged(initial):
    for name, cubin, s in initial:
        assert s.text == cubin.text(s.model.kernel.name)
        assert apply(s) == cubin.data, name
        assert s.order() == tuple(range(len(s.model.instructions)))


def test_round_trip_after_thousands_of_moves(initial):
    """nvdisasm of the written cubin lists exactly the expected instructions and controls."""
    moved_somewhere = 0
    for name, cubin, s0 in initial:
        s, done = random_walk(s0, 3000, seed=11)
        assert_schedule_is_correct(s)
        data = apply(s)
        assert len(data) == len(cubin.data)
        sec = cubin.kernel(s.model.kernel.name).section
        assert data[:sec.offset] == cubin.data[:sec.offset]
        assert data[sec.offset + sec.size:] == cubin.data[sec.offset + sec.size:]
        rewritten = disassemble(parse_cubin(data))[s.model.kernel.name]
        for k, x in enumerate(s.order()):
            got, want = rewritten.instructions[k], s.model.instructions[x]
            assert (got.predicate, got.opcode, _plain(got.operands)) == \
                (want.predicate, want.opcode, _plain(want.operands))
            assert control_bits(got.word) == s.controls[x]
            marks = sum(op.count(".reuse") for op in got.operands)
            assert marks == bin(Control.from_bits(s.controls[x]).reuse).count("1")
            assert got.word >> 126 == want.word >> 126
            assert got.word & ((1 << 105) - 1) == want.word & ((1 << 105) - 1)
        moved_somewhere += s.order() != s0.order()
    assert moved_somewhere > len(initial) / 2  # a walk may come back to the start; most do not


def test_moving_back_restores_the_original_exactly(initial):
    for name, cubin, s0 in initial:
        s, done = random_walk(s0, 400, seed=5)
        for move in reversed(done):
            s = s.moved(Move(move.instruction, -move.direction))
        assert s == s0 and s.text == s0.text, name


def test_random_walks_are_reproducible(initial):
    [s0] = [Schedule.initial(s.model) for name, _, s in initial if name == "isa_zoo"]
    a, moves_a = random_walk(s0, 200, seed=1)
    b, moves_b = random_walk(s0, 200, seed=1)
    c, moves_c = random_walk(s0, 200, seed=2)
    assert moves_a == moves_b and apply(a) == apply(b)
    assert moves_a != moves_c


def test_listed_moves_are_legal_and_the_rest_come_with_reasons(initial):
    import random
    rng = random.Random(0)
    for name, cubin, s in initial:
        legal = set(s.moves())
        candidates = [Move(i, d) for i in movable(s.model, MEMORY) for d in (-1, 1)]
        for move in rng.sample(candidates, min(len(candidates), 60)):
            if move in legal:
                assert_schedule_is_correct(s.moved(move))
            else:
                assert s.check(move)


def _plain(operands):
    return tuple(op.replace(".reuse", "") for op in operands)


# ---------------------------------------------------------------- control-code repair

def test_a_consumer_moved_closer_to_its_fixed_latency_producer_gets_the_stall_back():
    model = DependencyModel(synthetic_kernel([
        ("IMAD R1, R2, R3, R4 ;", ctl(4)),  # fixed latency, feeds the FFMA 6 cycles later
        ("FADD R5, R6, R7 ;", ctl(2)),
        ("FFMA R8, R1, R9, R10 ;", ctl(1)),
        ("EXIT ;", ctl(5))]))
    s0 = Schedule.initial(model)
    s1 = s0.moved(Move(2, -1))
    assert s1.order() == (0, 2, 1, 3)
    assert s1.controls[0] & _STALL == 6  # IMAD now waits 4 + 2 cycles before the FFMA issues
    assert_schedule_is_correct(s1)
    s2 = s1.moved(Move(2, +1))
    assert s2 == s0 and s2.controls[0] & _STALL == 4


def test_a_producer_moved_closer_to_its_consumer_stalls_longer():
    model = DependencyModel(synthetic_kernel([
        ("FADD R20, R21, R22 ;", ctl(3)),
        ("IMAD R1, R2, R3, R4 ;", ctl(2)),
        ("FADD R5, R6, R7 ;", ctl(3)),
        ("FFMA R8, R1, R9, R10 ;", ctl(1)),
        ("EXIT ;", ctl(5))]))
    s = Schedule.initial(model).moved(Move(1, +1))
    assert s.order() == (0, 2, 1, 3, 4)
    assert s.controls[1] & _STALL == 5
    assert_schedule_is_correct(s)


def test_a_repair_past_the_largest_encodable_stall_is_refused():
    model = DependencyModel(synthetic_kernel([
        ("FADD R20, R21, R22 ;", ctl(3)),
        ("IMAD R1, R2, R3, R4 ;", ctl(8)),
        ("FADD R5, R6, R7 ;", ctl(9)),
        ("FFMA R8, R1, R9, R10 ;", ctl(1)),
        ("EXIT ;", ctl(5))]))
    with pytest.raises(IllegalMove, match=r"stall of 17 cycles \(max 11\)"):
        Schedule.initial(model).moved(Move(3, -1))


def test_every_stall_a_repair_may_write_is_a_valid_encoding(corpus, tmp_path):
    """For each opcode of the corpus: its yield bit with every stall from the original up to
    the repair limit decodes (nvdisasm reports undefined stall/yield values per opclass)."""
    import subprocess

    from sip.mutate import MAX_STALL
    from sip.sass import find_nvdisasm
    seen = {}
    for data in corpus.values():
        for kernel in disassemble(parse_cubin(data)).values():
            for i in kernel.instructions:
                seen.setdefault(i.opcode, i)
    words = []
    for i in seen.values():
        c = i.control
        for stall in range(c.stall, MAX_STALL[c.yield_bit] + 1):
            words.append(with_control(i.word, (c.bits & ~0xF) | stall))
    probe = tmp_path / "probe.bin"
    probe.write_bytes(b"".join(w.to_bytes(16, "little") for w in words))
    run = subprocess.run([find_nvdisasm(), "-b", "SM90a", str(probe)], capture_output=True, text=True)
    assert run.returncode == 0 and "undefined value" not in run.stderr, run.stderr[:2000]
    assert len(seen) > 100


def test_extra_stalls_change_only_stall_counts(corpus):
    """The slowed-down cubin (the tuner's check that timing resolves a schedule difference): same
    size, same instructions; every `every`-th instruction of each kernel stalls at least 11 cycles,
    nothing else changes."""
    for name, data in corpus.items():
        slow = with_extra_stalls(data, every=3)
        assert len(slow) == len(data)
        before, after = disassemble(parse_cubin(data)), disassemble(parse_cubin(slow))
        for kernel in before.values():
            for i, j in zip(kernel.instructions, after[kernel.name].instructions):
                assert j.text == i.text and j.word & ~(_STALL << 105) == i.word & ~(_STALL << 105), name
                want = max(i.control.stall, 11) if i.index % 3 == 0 else i.control.stall
                assert j.control.stall == want, (name, kernel.name, i.index)
    assert corpus


def test_reuse_flags_are_cleared_when_their_window_changes_and_restored_after():
    model = DependencyModel(synthetic_kernel([
        ("FADD R20, R21, R22 ;", ctl(2)),
        ("FADD R23, R24, R25 ;", ctl(2)),
        ("FADD R1, R2.reuse, R3 ;", ctl(2, reuse=0b0001)),
        ("LDG.E R11, desc[UR4][R12.64] ;", ctl(1, wsb=0)),
        ("FMUL R4, R2, R5 ;", ctl(2)),  # reads R2 again: the end of the reuse window
        ("FADD R13, R11, R11 ;", ctl(2, wait=[0])),
        ("FADD R30, R31, R32 ;", ctl(2)),
        ("EXIT ;", ctl(5))]))
    s0 = Schedule.initial(model)
    s1 = s0.moved(Move(3, -1))  # the LDG leaves the window
    assert s1.controls[2] & _REUSE == 0
    assert_schedule_is_correct(s1)
    assert s1.moved(Move(3, +1)).controls[2] & _REUSE == 0b0001 << 17
    s2 = s0.moved(Move(1, +1))  # an instruction enters the window
    assert s2.order()[:4] == (0, 2, 1, 3) and s2.controls[2] & _REUSE == 0
    s3 = s0.moved(Move(6, -1)).moved(Move(6, -1)).moved(Move(6, -1))  # into the window ...
    assert s3.order()[:7] == (0, 1, 2, 6, 3, 4, 5) and s3.controls[2] & _REUSE == 0
    s4 = s3.moved(Move(6, +1)).moved(Move(6, +1))  # ... and out behind it again
    assert s4.order()[:7] == (0, 1, 2, 3, 4, 6, 5) and s4.controls[2] & _REUSE == 0b0001 << 17


def test_controls_travel_with_their_instruction():
    model = DependencyModel(synthetic_kernel([
        ("FADD R20, R21, R22 ;", ctl(2)),
        ("FADD R1, R2, R3 ;", ctl(6)),
        ("LDG.E R11, desc[UR4][R12.64] ;", Control(1, 0, 3, 4, 0, 0)),
        ("FADD R13, R11, R11 ;", ctl(2, wait=[3])),
        ("EXIT ;", ctl(5))]))
    s = Schedule.initial(model).moved(Move(2, -1))
    moved = Control.from_bits(s.controls[2])
    assert (moved.write_sb, moved.read_sb, moved.yield_bit, moved.stall) == (3, 4, 0, 1)


def test_a_lineinfo_cubin_takes_control_edits_but_no_moves(tmp_path):
    """nvcc -lineinfo adds line tables keyed by code offset: moving instructions would make them lie,
    so any move class is refused with the reason; control edits keep every offset and go through."""
    from sip_corpus import CORPUS_SOURCES, compile_cu

    from sip import SipError

    cubin = parse_cubin(compile_cu(CORPUS_SOURCES / "unrolled_stencil.cu", tmp_path, flags=("-lineinfo",)))
    assert {s.name for s in cubin.sections} >= {".nv_debug_line_sass"}
    model = DependencyModel(next(iter(disassemble(cubin).values())))
    for moves in ({"global"}, {"alu", "control.yield"}):
        with pytest.raises(SipError, match="-lineinfo line tables"):
            Schedule.initial(model, frozenset(moves))
    control = Schedule.initial(model, frozenset({"control.yield", "control.reuse"}))
    walked, changes = random_walk(control, 50, seed=3)
    assert changes and len(apply(walked)) == len(cubin.to_bytes())
