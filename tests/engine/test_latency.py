"""sip.latency: the measured latency table, its classes, and what it does to the dependency model."""
import json

import pytest
from sip_corpus import synthetic_kernel

from sip import SipError, latency, mutate
from sip.deps import LATENCY_HORIZON_DEFAULT, SCOREBOARD_SETUP, START, DependencyModel
from sip.sass import NO_SCOREBOARD, Control, P_BASE, UP_BASE, UR_BASE

C = Control(6, 1, NO_SCOREBOARD, NO_SCOREBOARD, 0, 0)


def write(tmp_path, doc, name="t.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def row(p, c, f, v):
    return {"producer": p, "consumer": c, "file": f, "latency": v}


def test_a_table_loads_and_answers_by_producer_consumer_and_file(tmp_path):
    t = latency.load(write(tmp_path, {"format": latency.FORMAT, "pairs": [
        row("FFMA", "FFMA", "R", 4), row("FFMA", "IMAD", "R", 5), row("FFMA", "FFMA", "R", 3),
        row("ISETP", "FADD@", "@P", 13), row("HMMA.16816.F32", "HMMA.16816.F32", "R", None)]}))
    assert t.raw("FFMA", "FFMA", "R") == 4  # the larger of two measurements
    assert t.raw("FFMA", "FFMA", "P") is None and t.raw("FADD", "FFMA", "R") is None
    assert t.raw("ISETP", "FADD@", "@P") == 13
    assert t.raw("HMMA.16816.F32", "HMMA.16816.F32", "R") is None  # measured, not proven: no entry
    assert t.producer_bound("FFMA") == 5 and t.producer_bound("IMAD") is None


@pytest.mark.parametrize("doc, message", [
    ("{not json", "is not JSON"),
    ({"pairs": []}, "is not a SIP latency table"),
    ({"format": latency.FORMAT, "pairs": [{"producer": "FFMA"}]}, "pair 0 lacks"),
    ({"format": latency.FORMAT, "pairs": [row("FFMA", "FFMA", "R", 0)]}, "has latency 0"),
    ({"format": latency.FORMAT, "pairs": [row("FFMA", "FFMA", "R", 4.5)]}, "has latency 4.5"),
    ({"format": latency.FORMAT, "pairs": [row("FFMA", "FFMA", "Q", 4)]}, "file in"),
    ({"format": latency.FORMAT, "pairs": [row("FFMA", "FFMA", "R", None)]}, "proves no latency"),
])
def test_a_bad_table_is_refused_in_one_line(tmp_path, doc, message):
    with pytest.raises(SipError, match=message) as e:
        latency.load(write(tmp_path, doc))
    assert "\n" not in str(e.value)


def test_a_missing_table_is_refused(tmp_path):
    with pytest.raises(SipError, match="cannot read the latency table"):
        latency.load(tmp_path / "none.json")


def test_the_repository_table_is_the_default_for_stall_lowering(tmp_path, monkeypatch):
    monkeypatch.setattr(latency, "DEFAULT_PATH", tmp_path / "absent.json")
    assert mutate.latencies_for(frozenset({"alu", "control.yield"})) is None
    with pytest.raises(SipError, match="control.stall lowers stall counts.*absent.json"):
        mutate.latencies_for(frozenset({"control.stall"}))
    path = write(tmp_path, {"format": latency.FORMAT, "pairs": [row("FFMA", "FFMA", "R", 4)]}, "absent.json")
    assert mutate.latencies_for(frozenset({"control.stall"})).source == str(path)
    other = write(tmp_path, {"format": latency.FORMAT, "pairs": [row("IMAD", "IMAD", "R", 4)]}, "other.json")
    assert mutate.latencies_for(frozenset({"global"}), other).raw("IMAD", "IMAD", "R") == 4  # explicit wins


@pytest.mark.parametrize("text, cls", [
    ("FFMA.FTZ R1, R2, R3, R4 ;", "FFMA"),
    ("IMAD.MOV.U32 R1, RZ, RZ, R2 ;", "IMAD"),
    ("IMAD.WIDE.U32 R2, R3, 0x4, R4 ;", "IMAD.WIDE"),
    ("IMAD.HI.U32 R1, R2, R3, RZ ;", "IMAD.HI"),
    ("HFMA2.MMA R1, R2, R3, R4 ;", "HFMA2.MMA"),
    ("HFMA2 R1, R2, R3, R4 ;", "HFMA2"),
    ("HMMA.16816.F32.BF16 R4, R8, R12, R4 ;", "HMMA.16816.F32.BF16"),
    ("@!P0 IMAD.IADD R1, R1, 0x1, R2 ;", "IMAD@"),
    ("@PT FADD R1, R2, R3 ;", "FADD"),
    ("ISETP.GE.U32.AND P0, PT, R1, R2, PT ;", "ISETP"),
])
def test_latency_classes(text, cls):
    kernel = synthetic_kernel([(text, C), ("EXIT ;", C)])
    assert latency.opclass(kernel.instructions[0]) == cls


def test_register_files():
    assert latency.register_file(5, False) == "R"
    assert latency.register_file(UR_BASE + 4, False) == "UR"
    assert latency.register_file(P_BASE + 1, False) == "P" and latency.register_file(P_BASE + 1, True) == "@P"
    assert latency.register_file(UP_BASE, True) == "@UP"


ROWS = [("FADD R20, R21, R22 ;", Control(15, 0, NO_SCOREBOARD, NO_SCOREBOARD, 0, 0)),
        ("FADD R23, R24, R25 ;", Control(15, 0, NO_SCOREBOARD, NO_SCOREBOARD, 0, 0)),
        ("FFMA R1, R2, R3, R4 ;", C),  # #2
        ("FFMA R5, R1, R6, R7 ;", C),  # #3: RAW on R1 from #2
        ("FADD R1, R5, R8 ;", C),  # #4: RAW on R5 from #3, WAW on R1 with #2
        ("LDG.E R9, desc[UR4][R10.64] ;", Control(4, 1, 2, NO_SCOREBOARD, 0, 0)),  # #5
        ("FADD R12, R9, R9 ;", Control(6, 1, NO_SCOREBOARD, NO_SCOREBOARD, 1 << 2, 0)),  # #6 waits on SB2
        ("EXIT ;", C)]


def test_the_table_bounds_only_the_pairs_it_covers(tmp_path):
    t = latency.load(write(tmp_path, {"format": latency.FORMAT, "pairs": [
        row("FFMA", "FFMA", "R", 4), row("FFMA", "SEL", "R", 5)]}))
    plain = DependencyModel(synthetic_kernel(ROWS))
    measured = DependencyModel(synthetic_kernel(ROWS), t)
    assert plain.incoming[3][2] == 6 and measured.incoming[3][2] == 4  # RAW FFMA -> FFMA: proven 4
    assert plain.incoming[4][3] == measured.incoming[4][3] == 6  # FFMA -> FADD: not in the table
    assert plain.incoming[4][2] == 12 and measured.incoming[4][2] == 5  # WAW: the producer's largest latency
    assert measured.incoming[6][5] == SCOREBOARD_SETUP  # scoreboard pairs: unchanged
    assert measured.incoming[2][START] == plain.incoming[2][START] == LATENCY_HORIZON_DEFAULT
