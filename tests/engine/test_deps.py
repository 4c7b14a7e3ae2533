"""sip.deps: which adjacent instructions may swap, and why not."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sip_corpus import corpus, synthetic_kernel  # noqa: F401

from sip.cubin import parse_cubin
from sip.deps import START, DependencyModel
from sip.mutate import IllegalMove, Move, Schedule, movable
from sip.sass import NO_SCOREBOARD, Control, disassemble


def ctl(stall=1, wsb=NO_SCOREBOARD, rsb=NO_SCOREBOARD, wait=(), reuse=0, yield_bit=1):
    return Control(stall, yield_bit, wsb, rsb, sum(1 << b for b in wait), reuse)


def schedule_of(*rows, pins=None) -> Schedule:
    return Schedule.initial(DependencyModel(synthetic_kernel(rows, pins)))


def refusal(schedule: Schedule, instruction: int, direction: int) -> str:
    with pytest.raises(IllegalMove) as err:
        schedule.moved(Move(instruction, direction))
    return err.value.reason


EXIT = ("EXIT ;", ctl(5))


# ---------------------------------------------------------------- refused moves, one per reason

def test_raw_is_refused():
    s = schedule_of(("FADD R1, R2, R3 ;", ctl(4)), ("FMUL R4, R1, R5 ;", ctl(4)), EXIT)
    assert "RAW on R1" in refusal(s, 1, -1)


def test_war_is_refused():
    s = schedule_of(("FADD R1, R2, R3 ;", ctl(4)), ("FMUL R2, R4, R5 ;", ctl(4)), EXIT)
    assert "WAR on R2" in refusal(s, 0, +1)


def test_waw_is_refused():
    s = schedule_of(("FADD R1, R2, R3 ;", ctl(4)), ("FMUL R1, R4, R5 ;", ctl(4)), EXIT)
    assert "WAW on R1" in refusal(s, 0, +1)


def test_vector_and_wide_registers_overlap():
    s = schedule_of(("LDG.E.128 R4, desc[UR4][R2.64] ;", ctl(1, wsb=0)),
                    ("FADD R7, R8, R9 ;", ctl(4, wait=[0])), EXIT)
    assert "R7" in refusal(s, 0, +1)
    s = schedule_of(("IMAD.WIDE R2, R7, 0x4, R2 ;", ctl(4)), ("FADD R3, R8, R9 ;", ctl(4)), EXIT)
    assert "on R3" in refusal(s, 1, -1)  # the .WIDE pair reads and writes R2..R3


def test_scoreboard_wait_is_refused():
    s = schedule_of(("LDG.E R4, desc[UR4][R2.64] ;", ctl(1, wsb=2)),
                    ("FADD R7, R8, R9 ;", ctl(4, wait=[2])), EXIT)
    assert "waits on SB2" in refusal(s, 1, -1)


def test_two_setters_of_one_scoreboard_keep_their_order():
    s = schedule_of(("S2R R4, SR_TID.X ;", ctl(1, wsb=0)), ("S2R R5, SR_LANEID ;", ctl(1, wsb=0)),
                    ("FADD R6, R4, R5 ;", ctl(4, wait=[0])), EXIT)
    assert "both set SB0" in refusal(s, 0, +1)


def test_a_wait_covers_consumers_that_do_not_wait_themselves():
    # The FFMA reads R4 without waiting: the FADD's wait on SB2 covers it, so it stays behind it.
    s = schedule_of(("LDG.E R4, desc[UR4][R2.64] ;", ctl(1, wsb=2)),
                    ("FADD R7, R8, R9 ;", ctl(4, wait=[2])),
                    ("FFMA R10, R4, R4, R11 ;", ctl(4)), EXIT)
    assert "guards R4" in refusal(s, 2, -1)


def test_store_never_passes_a_load_of_the_same_space():
    s = schedule_of(("LDG.E R4, desc[UR4][R2.64] ;", ctl(1, wsb=1)),
                    ("STG.E desc[UR4][R6.64], R8 ;", ctl(1)),
                    ("FADD R9, R4, R4 ;", ctl(4, wait=[1])), EXIT)
    assert "memory order" in refusal(s, 1, -1)


def test_generic_accesses_alias_shared_memory():
    s = schedule_of(("STS [R1], R2 ;", ctl(1)), ("LD.E R3, desc[UR4][R6.64] ;", ctl(1, wsb=0)),
                    ("FADD R9, R3, R3 ;", ctl(4, wait=[0])), EXIT)
    assert "memory order" in refusal(s, 0, +1)


FIRST = ("FADD R20, R21, R22 ;", ctl(2))  # keeps the pair off the block start


def test_a_store_and_a_load_of_different_spaces_may_swap():
    s = schedule_of(FIRST, ("STS [R1], R2 ;", ctl(1)), ("LDG.E R3, desc[UR4][R6.64] ;", ctl(1, wsb=0)),
                    ("FADD R9, R3, R3 ;", ctl(4, wait=[0])), EXIT)
    assert s.moved(Move(1, +1)).order() == (0, 2, 1, 3, 4)


def test_loads_with_their_own_scoreboards_may_pass_each_other():
    s = schedule_of(FIRST, ("LDG.E R4, desc[UR4][R2.64] ;", ctl(1, wsb=0)),
                    ("LDG.E R5, desc[UR4][R6.64] ;", ctl(1, wsb=1)),
                    ("FADD R7, R4, R5 ;", ctl(4, wait=[0, 1])), EXIT)
    assert s.moved(Move(1, +1)).order() == (0, 2, 1, 3, 4)


def test_moving_an_instruction_to_the_block_start_keeps_distances_from_outside():
    s = schedule_of(("FADD R1, R2, R3 ;", ctl(2)), ("FMUL R4, R5, R6 ;", ctl(4)), EXIT)
    assert "from the block start to #1" in refusal(s, 1, -1)


def test_loads_covered_by_a_later_scoreboard_keep_their_order():
    # ptxas lets the first LDS ride on the second one's scoreboard (in-order completion).
    s = schedule_of(("LDS R4, [R2] ;", ctl(1)), ("LDS R5, [R3] ;", ctl(1, wsb=1)),
                    ("FADD R7, R4, R5 ;", ctl(4, wait=[1])), EXIT)
    assert "in-order completion" in refusal(s, 0, +1)


def test_consumers_of_a_covered_load_stay_behind_the_covering_wait():
    # R4 is only safe to read after the wait on SB1 (set by the second LDS).
    s = schedule_of(("LDS R4, [R2] ;", ctl(1)), ("LDS R5, [R3] ;", ctl(1, wsb=1)),
                    ("FADD R7, R5, R5 ;", ctl(4, wait=[1])), ("FMUL R8, R4, R9 ;", ctl(4)), EXIT)
    assert "guards R4" in refusal(s, 3, -1)


def test_strong_loads_are_ordered():
    s = schedule_of(("LDG.E.STRONG.GPU R4, desc[UR4][R2.64] ;", ctl(1, wsb=0)),
                    ("LDG.E R5, desc[UR4][R6.64] ;", ctl(1, wsb=1)),
                    ("FADD R7, R4, R5 ;", ctl(4, wait=[0, 1])), EXIT)
    assert "strong" in refusal(s, 0, +1)


def test_nothing_crosses_a_barrier():
    s = schedule_of(("FADD R1, R2, R3 ;", ctl(4)), ("BAR.SYNC.DEFER_BLOCKING 0x0 ;", ctl(5)),
                    ("FMUL R4, R5, R6 ;", ctl(4)), EXIT)
    assert "synchronisation (BAR.SYNC" in refusal(s, 0, +1)
    assert "synchronisation (BAR.SYNC" in refusal(s, 2, -1)
    assert "pinned instruction" in refusal(s, 1, -1)


@pytest.mark.parametrize("row", ["MEMBAR.ALL.GPU ;", "LDGDEPBAR ;", "DEPBAR.LE SB0, 0x1 ;",
                                 "WARPSYNC 0xffffffff ;", "CS2R R8, SR_CLOCKLO ;",
                                 "UTMACMDFLUSH ;", "NANOSLEEP 0x64 ;"])
def test_synchronisation_and_clock_reads_are_pinned(row):
    s = schedule_of(("FADD R1, R2, R3 ;", ctl(4)), (row, ctl(5)), ("FMUL R4, R5, R6 ;", ctl(4)), EXIT)
    assert s.model.facts[1].pin
    assert refusal(s, 0, +1)


def test_pinned_instructions_never_move():
    s = schedule_of(("FADD R1, R2, R3 ;", ctl(4)), ("FMUL R4, R5, R6 ;", ctl(4)),
                    ("FADD R7, R8, R9 ;", ctl(4)), EXIT, pins={16: "offset listed in EIATTR_X"})
    assert "pinned instruction: offset listed in EIATTR_X" in refusal(s, 1, +1)
    assert not s.model.facts[1].fence and s.model.facts[3].fence


def test_an_address_pin_is_passed_by_independent_instructions_only():
    """An instruction the cubin refers to by offset keeps its slot and control bits; independent
    neighbours trade places across it (the move hops over it), dependent ones do not."""
    rows = [FIRST, ("FADD R1, R2, R3 ;", ctl(1)), ("FMUL R4, R5, R6 ;", ctl(1)),
            ("FADD R7, R8, R9 ;", ctl(1)), ("EXIT ;", ctl(15, yield_bit=0))]
    s = schedule_of(*rows, pins={32: "offset listed in EIATTR_X"})
    hopped = s.moved(Move(1, +1))
    assert hopped.order() == (0, 3, 2, 1, 4) and hopped.slots[2] == 2
    assert hopped.controls[2] == s.controls[2]
    assert hopped.moved(Move(1, -1)) == s  # and back
    assert s.moved(Move(3, -1)).order() == (0, 3, 2, 1, 4)
    rows[2] = ("FMUL R4, R1, R6 ;", ctl(1))  # now reads what #1 writes
    s = schedule_of(*rows, pins={32: "offset listed in EIATTR_X"})
    assert "dependency between #1 and #2: RAW on R1" in refusal(s, 1, +1)
    rows[2] = ("NOP ;", ctl(1))  # a fence: nothing passes it
    s = schedule_of(*rows)
    assert "neighbour #2 is pinned: NOP" in refusal(s, 1, +1)
    rows[2] = ("FMUL R4, R5, R6 ;", ctl(1))  # listed where the driver may patch in other code: a fence
    model = DependencyModel(synthetic_kernel(rows, {32: "offset listed in EIATTR_SW_WAR"}, fenced={32}))
    assert model.facts[2].fence and "may patch" in model.facts[2].pin
    assert "neighbour #2 is pinned" in refusal(Schedule.initial(model), 1, +1)


def test_unknown_instructions_are_pinned():
    s = schedule_of(("FADD R1, R2, R3 ;", ctl(4)), ("FOOBAR R4, R5 ;", ctl(4)), EXIT)
    assert "unknown operand semantics" in refusal(s, 1, -1)
    assert "pinned" in refusal(s, 0, +1)


def test_block_boundaries():
    s = schedule_of(("FADD R1, R2, R3 ;", ctl(4)), ("@P0 BRA 0x40 ;", ctl(5)),
                    ("FMUL R4, R5, R6 ;", ctl(4)), ("FADD R7, R8, R9 ;", ctl(4)), EXIT)
    assert "block boundary" in refusal(s, 0, -1)  # first instruction of the kernel
    assert "block boundary" in refusal(s, 0, +1)  # the branch ends block 0
    assert "block boundary" in refusal(s, 2, -1)  # first of block 1 (the branch target)
    assert "block boundary" in refusal(s, 3, +1)  # EXIT ends block 1


# ---------------------------------------------------------------- latency pairs

def test_fixed_latency_pairs_record_the_original_distance_capped_by_the_horizon():
    model = DependencyModel(synthetic_kernel([
        ("IMAD R1, R2, R3, R4 ;", ctl(4)), ("FADD R5, R6, R7 ;", ctl(2)),
        ("FFMA R8, R1, R9, R10 ;", ctl(1)),
        ("LDG.E R11, desc[UR4][R12.64] ;", ctl(1, wsb=3)),
        ("FADD R13, R13, R13 ;", ctl(15)), ("FADD R14, R14, R14 ;", ctl(15)),
        ("FADD R15, R11, R1 ;", ctl(4, wait=[3])), EXIT]))
    assert model.incoming[2][0] == 6  # IMAD -> FFMA: 4 + 2 cycles
    assert model.incoming[6][0] == 24  # IMAD -> FADD: 39 cycles apart, capped at 24
    assert model.incoming[6][3] == 2  # LDG -> FADD: guarded by SB3, only the setup time
    assert model.incoming[2][START] == 6  # R9, R10 come from before the block


# ---------------------------------------------------------------- legality on real kernels

def _kernels(corpus):
    for name in ("smem_tiled_gemm", "mma_sync_hmma", "control_mix", "isa_zoo", "cute_row_sum"):
        if name in corpus:
            for kernel in disassemble(parse_cubin(corpus[name])).values():
                yield name, kernel


@pytest.fixture(scope="module")
def models(corpus):
    return [(name, DependencyModel(k)) for name, k in _kernels(corpus)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_accepted_move_sequence_inverts_an_original_dependency(models, data):
    name, model = data.draw(st.sampled_from(models))
    schedule = Schedule.initial(model)
    everyone = [i for i, f in enumerate(model.facts) if f.pin is None]
    policy = movable(model, frozenset({"global", "shared"}))
    steps = data.draw(st.lists(st.tuples(st.sampled_from(policy if data.draw(st.booleans()) else everyone),
                                         st.sampled_from([-1, 1])), max_size=300))
    for i, d in steps:
        try:
            schedule = schedule.moved(Move(i, d))
        except IllegalMove as e:
            assert e.reason
    for b, block in enumerate(schedule.blocks):
        slot = {x: k for k, x in enumerate(block)}
        original = model.blocks[b]
        assert sorted(block) == sorted(original)
        for k, x in enumerate(original):
            if model.facts[x].pin:
                assert block[k] == x  # pinned instructions keep their slot
        for x, y, reason in model.dependencies(b):
            assert slot[x] < slot[y], (name, x, y, reason)
