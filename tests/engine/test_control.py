"""sip.mutate's control class: yield bits, reuse flags, and stall counts lowered no further than a
measured latency table proves safe."""
import json

import pytest
from sip_checks import assert_schedule_is_correct
from sip_corpus import synthetic_kernel

from sip import SipError, latency
from sip.deps import DependencyModel
from sip.mutate import CONTROL_KINDS, Edit, IllegalMove, Move, Schedule
from sip.sass import NO_SCOREBOARD, Control

CONTROL = frozenset(CONTROL_KINDS)
YR = frozenset({"control.yield", "control.reuse"})
_STALL, _YIELD, _REUSE = 0xF, 0x10, 0xF << 17


def ctl(stall=1, wsb=NO_SCOREBOARD, wait=(), reuse=0, yield_bit=1):
    return Control(stall, yield_bit, wsb, NO_SCOREBOARD, sum(1 << b for b in wait), reuse)


def table(tmp_path, pairs):
    path = tmp_path / "latency.json"
    path.write_text(json.dumps({"format": latency.FORMAT, "pairs": [
        {"producer": p, "consumer": c, "file": f, "latency": v} for (p, c, f), v in pairs.items()]}))
    return latency.load(path)


def schedule(rows, moves=CONTROL | {"alu"}, latencies=None, pins=None):
    return Schedule.initial(DependencyModel(synthetic_kernel(rows, pins), latencies), moves)


def refusal(s, change):
    with pytest.raises(IllegalMove) as e:
        s.moved(change)
    return e.value.reason


PAD = [("FADD R20, R21, R22 ;", ctl(15, yield_bit=0)), ("FADD R23, R24, R25 ;", ctl(15, yield_bit=0))]
TAIL = [("FADD R30, R31, R32 ;", ctl(15, yield_bit=0)), ("FADD R33, R34, R35 ;", ctl(15, yield_bit=0)),
        ("EXIT ;", ctl(5))]
CHAIN = PAD + [("FFMA R1, R2, R3, R4 ;", ctl(6)), ("FFMA R5, R1, R6, R7 ;", ctl(2))] + TAIL  # #2 feeds #3


# ---------------------------------------------------------------- stall counts

def test_stall_lowering_needs_a_latency_table():
    with pytest.raises(SipError, match="needs a latency table measured on the GPU"):
        schedule(CHAIN)
    s = schedule(CHAIN, YR)  # yield and reuse edits need none
    assert "control.stall is not in this schedule's classes" in refusal(s, Edit(2, "control.stall", 4))


def test_a_stall_goes_down_to_the_measured_latency_and_no_further(tmp_path):
    s = schedule(CHAIN, latencies=table(tmp_path, {("FFMA", "FFMA", "R"): 4}))
    assert s.stall_floor(2) == 4  # FFMA -> FFMA through R1: 4 cycles proven, ptxas wrote 6
    low = s.moved(Edit(2, "control.stall", 4))
    assert low.controls[2] & _STALL == 4 and low.own[2] == 4
    assert_schedule_is_correct(low)
    assert "needs its stall >= 4" in refusal(s, Edit(2, "control.stall", 3))
    assert low.moved(Edit(2, "control.stall", 6)) == s  # back up to ptxas' value
    assert "not in 1..6" in refusal(s, Edit(2, "control.stall", 7))  # never above it


def test_without_a_covering_entry_nothing_is_lowered(tmp_path):
    other = table(tmp_path, {("FFMA", "FADD", "R"): 1, ("IMAD", "FFMA", "R"): 1})
    s = schedule(CHAIN, latencies=other)
    assert s.stall_floor(2) == 6  # the table says nothing about FFMA -> FFMA: the original distance stays
    assert "needs its stall >= 6" in refusal(s, Edit(2, "control.stall", 5))


def test_a_predicated_producer_is_a_class_of_its_own(tmp_path):
    rows = list(CHAIN)
    rows[2] = ("@P1 FFMA R1, R2, R3, R4 ;", ctl(6))
    s = schedule(rows, latencies=table(tmp_path, {("FFMA", "FFMA", "R"): 4}))
    assert s.stall_floor(2) == 6
    s = schedule(rows, latencies=table(tmp_path, {("FFMA@", "FFMA", "R"): 5}))
    assert s.stall_floor(2) == 5


def test_moves_keep_the_lowered_distances_and_refuse_what_they_cannot_repair(tmp_path):
    """After a lowering, a move repairs distances from the lowered own stalls; a pair that needs
    extra stall allows no further lowering across it."""
    rows = PAD + [("IMAD R1, R2, R3, R4 ;", ctl(6)), ("FADD R9, R10, R11 ;", ctl(2)),
                  ("FFMA R5, R1, R6, R7 ;", ctl(1))] + TAIL
    t = table(tmp_path, {("IMAD", "FFMA", "R"): 4})
    s = schedule(rows, latencies=t)
    assert s.layout.model.incoming[4][2] == 4  # min(8 cycles kept by ptxas, 4 proven)
    moved = s.moved(Move(4, -1))  # FFMA up next to the IMAD: 6 cycles apart, 4 needed
    assert moved.controls[2] & _STALL == 6 and moved.deficits == {}
    low = moved.moved(Edit(2, "control.stall", 4))
    assert_schedule_is_correct(low)
    assert "needs its stall >= 4" in refusal(moved, Edit(2, "control.stall", 3))
    back = low.moved(Move(4, +1))
    assert back.order() == s.order() and back.controls[2] & _STALL == 4
    assert_schedule_is_correct(back)
    # Raising a lowered stall gives back the extra cycles a later move had to add.
    s = schedule(rows, latencies=table(tmp_path, {("IMAD", "FFMA", "R"): 5}))
    low = s.moved(Edit(2, "control.stall", 3)).moved(Move(4, -1))  # 3 cycles apart, 5 needed
    assert low.deficits == {4: {2: 2}} and low.controls[2] & _STALL == 5
    raised = low.moved(Edit(2, "control.stall", 6))
    assert raised.deficits == {} and raised.controls[2] & _STALL == 6
    assert_schedule_is_correct(raised)
    # Without a proven IMAD -> FFMA latency the move needs 2 extra cycles on the IMAD: no lowering there.
    s = schedule(rows, latencies=table(tmp_path, {("FADD", "FADD", "R"): 1}))
    moved = s.moved(Move(4, -1))
    assert moved.deficits == {4: {2: 2}} and moved.controls[2] & _STALL == 8
    assert moved.stall_floor(2) == 6 and "needs its stall >= 6" in refusal(moved, Edit(2, "control.stall", 5))


# ---------------------------------------------------------------- yield bits

def test_yield_flips_and_the_encodings_it_must_respect():
    s = schedule(CHAIN, YR)
    up = s.moved(Edit(3, "control.yield", 0))
    assert up.controls[3] & _YIELD == 0 and up.controls[3] ^ s.controls[3] == _YIELD
    assert up.moved(Edit(3, "control.yield", 1)) == s
    assert "undefined without yield" in refusal(s, Edit(0, "control.yield", 1))  # stall 15 needs the yield
    assert "already" in refusal(s, Edit(3, "control.yield", 1))


def test_a_yield_ptxas_put_in_a_loop_body_stays():
    rows = [("FADD R1, R2, R3 ;", ctl(4, yield_bit=0)), ("FADD R4, R5, R6 ;", ctl(4)),
            ("@P0 BRA 0x0 ;", ctl(5)), ("FADD R7, R8, R9 ;", ctl(4, yield_bit=0)), ("EXIT ;", ctl(5))]
    s = schedule(rows, YR)
    assert s.layout.depth[:4] == (1, 1, 1, 0)
    assert "spin loop" in refusal(s, Edit(0, "control.yield", 1))
    assert s.moved(Edit(1, "control.yield", 0)).moved(Edit(1, "control.yield", 1)) == s
    assert s.moved(Edit(3, "control.yield", 1)).controls[3] & _YIELD  # outside every loop it may go


# ---------------------------------------------------------------- reuse flags

REUSE = [("FADD R20, R21, R22 ;", ctl(2)), ("FADD R1, R2.reuse, R3.reuse ;", ctl(2, reuse=0b0011)),
         ("FADD R23, R24, R25 ;", ctl(2)), ("FMUL R4, R2, R3 ;", ctl(2)),  # reads R2, R3 again: window end
         ("FADD R30, R31, R32 ;", ctl(2)), ("EXIT ;", ctl(5))]


def test_clearing_a_reuse_flag_sticks_and_nothing_sets_one():
    s = schedule(REUSE, YR | {"alu"})
    one = s.moved(Edit(1, "control.reuse", 1))
    assert one.controls[1] & _REUSE == 0b0001 << 17 and one.reuse[1] == 0b0001
    assert "is not set" in refusal(one, Edit(1, "control.reuse", 1))
    out = one.moved(Move(2, -1)).moved(Move(2, +1))  # the window breaks and is restored
    assert out.controls[1] & _REUSE == 0b0001 << 17  # the cleared flag stays cleared
    assert_schedule_is_correct(out)
    assert "is not set" in refusal(s, Edit(0, "control.reuse", 0))  # ptxas set none there


def test_a_yield_in_a_reuse_window_ends_the_reuse_until_it_goes():
    s = schedule(REUSE, YR)
    y = s.moved(Edit(2, "control.yield", 0))  # between the flagged FADD and the FMUL that reads R2, R3
    assert y.controls[1] & _REUSE == 0
    assert_schedule_is_correct(y)
    assert y.moved(Edit(2, "control.yield", 1)) == s
    own = s.moved(Edit(1, "control.yield", 0))  # the flagged instruction itself yields
    assert own.controls[1] & _REUSE == 0 and own.moved(Edit(1, "control.yield", 1)) == s
    pinned = schedule(REUSE, YR, pins={16: "offset listed in EIATTR_X"})
    assert "reuse flags of pinned #1" in refusal(pinned, Edit(2, "control.yield", 0))


def test_pinned_instructions_get_no_edits():
    s = schedule(REUSE, YR, pins={16: "offset listed in EIATTR_X"})
    assert "pinned instruction" in refusal(s, Edit(1, "control.reuse", 0))
    assert "pinned instruction" in refusal(s, Edit(5, "control.yield", 0))  # EXIT
