"""Invariants of SIP schedules, recomputed from scratch (independently of the incremental code in
sip.mutate), for the engine tests."""
import subprocess
import tempfile
from pathlib import Path

from sip.cubin import parse_cubin
from sip.deps import START
from sip.mutate import MAX_STALL, Schedule, apply
from sip.sass import CONTROL_MASK, Control, control_bits, disassemble, find_nvdisasm, regs_in

STALL, YIELD, REUSE = 0xF, 0x10, 0xF << 17
JUMPS = ("BRA", "EXIT", "CALL", "RET", "BRX")


def assert_schedule_is_correct(s: Schedule, check_order: bool = True) -> None:
    """Every guarantee a schedule makes: pinned instructions stay put with their control bits, no
    dependent pair of the original order is inverted, every fixed-latency pair keeps its distance
    in the code's actual stall counts, only stall / yield / reuse bits change (stalls only fall
    with control.stall, yield only flips with control.yield, no reuse flag is ever set where
    ptxas left it clear, and a kept one has its original window), every stall is a defined
    encoding, and the code bytes spell exactly this."""
    model = s.model
    ins = model.instructions
    moves = s.layout.moves
    original = [control_bits(i.word) for i in ins]
    for b, block in enumerate(s.blocks):
        slot = {x: k for k, x in enumerate(block)}
        assert sorted(block) == sorted(model.blocks[b])
        for k, x in enumerate(block):
            if model.facts[x].pin:
                assert model.blocks[b][k] == x and s.controls[x] == original[x]
        if check_order:
            moved = [x for k, x in enumerate(block) if model.blocks[b][k] != x]
            for x in moved:
                for y in block:
                    if x != y and (x < y) != (slot[x] < slot[y]):
                        assert model.conflict(x, y) is None, (x, y, model.conflict(x, y))
        at = [0]
        for x in block:
            at.append(at[-1] + (s.controls[x] & STALL))
        for c in (*block, model.end(b)):
            c_at = at[-1] if c == model.end(b) else at[slot[c]]
            for p, required in model.incoming[c].items():
                p_at = 0 if p == START else at[slot[p]]
                assert c_at - p_at >= required, (p, c, required)
    address = {x: k for k, x in enumerate(s.order())}
    for x in range(len(ins)):
        now, was = s.controls[x], original[x]
        assert (now ^ was) & ~(STALL | YIELD | REUSE) == 0  # wait mask and scoreboards travel unchanged
        if "control.stall" not in moves:
            assert now & STALL >= was & STALL
        if "control.yield" not in moves:
            assert now & YIELD == was & YIELD
        assert now & REUSE & ~was == 0  # never set where it was clear
        assert 1 <= now & STALL <= MAX_STALL[now >> 4 & 1] or now & STALL == was & STALL
        if now & REUSE:  # kept: the code up to the register's next reader is original
            cached = frozenset().union(*(regs_in(o) for o in ins[x].operands if ".reuse" in o))
            y = x + 1
            while y < len(ins) and address[y] == address[x] + (y - x) and not (
                    ins[y].reads & cached or ins[y].base in JUMPS):
                y += 1
            assert y == len(ins) or address[y] == address[x] + (y - x), x
            # and nothing from the flagged instruction up to the reader yields where ptxas did not
            assert not any(s.controls[t] & YIELD == 0 and original[t] & YIELD for t in range(x, y)), x
    text = b"".join(((ins[x].word & ~(CONTROL_MASK << 105)) | (s.controls[x] << 105)).to_bytes(16, "little")
                    for x in s.order())
    assert text == s.text


def assert_round_trip(s: Schedule) -> None:
    """The written cubin differs from the original only in the kernel's code, nvdisasm decodes it
    without complaint, and it lists exactly this schedule's instructions and control codes (the
    instruction multiset of the kernel is unchanged)."""
    cubin = s.model.kernel.cubin
    data = apply(s)
    sec = cubin.kernel(s.model.kernel.name).section
    assert len(data) == len(cubin.data)
    assert data[:sec.offset] == cubin.data[:sec.offset]
    assert data[sec.offset + sec.size:] == cubin.data[sec.offset + sec.size:]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mutated.cubin"
        path.write_bytes(data)
        run = subprocess.run([find_nvdisasm(), "-c", str(path)], capture_output=True, text=True)
    assert run.returncode == 0 and "undefined" not in run.stderr.lower(), run.stderr[:2000]
    rewritten = disassemble(parse_cubin(data))[s.model.kernel.name]
    want_ins = s.model.instructions
    assert sorted(plain(i) for i in rewritten.instructions) == sorted(plain(i) for i in want_ins)
    for k, x in enumerate(s.order()):
        got, want = rewritten.instructions[k], want_ins[x]
        assert plain(got) == plain(want)
        assert control_bits(got.word) == s.controls[x]
        marks = sum(op.count(".reuse") for op in got.operands)
        assert marks == bin(Control.from_bits(s.controls[x]).reuse).count("1")
        assert got.word >> 126 == want.word >> 126
        assert got.word & ((1 << 105) - 1) == want.word & ((1 << 105) - 1)


def plain(ins) -> tuple:
    return ins.predicate, ins.opcode, tuple(op.replace(".reuse", "") for op in ins.operands)
