"""sip.mutate.lowered and `sip floor`: every stall count lowered as far as the measured latency table
proves, each step a legal control.stall edit; a fixed point that keeps every schedule guarantee."""
import re

import pytest
from sip_checks import assert_round_trip, assert_schedule_is_correct
from sip_corpus import corpus, corpus_entry  # noqa: F401

from sip import SipError, latency
from sip.cfg import loop_summaries, loops as cfg_loops
from sip.cli import main
from sip.cubin import parse_cubin
from sip.deps import DependencyModel
from sip.mutate import Schedule, lowered
from sip.sass import disassemble

STALL = frozenset({"control.stall"})


@pytest.mark.parametrize("name", ["rosekernels_tma_wgmma_gemm", "smem_tiled_gemm", "unrolled_stencil"])
def test_lowered_is_a_legal_fixed_point_below_ptxas(corpus, name):
    table = latency.load(latency.DEFAULT_PATH)
    kernel = max(disassemble(parse_cubin(corpus_entry(corpus, name))).values(), key=lambda k: len(k.instructions))
    s0 = Schedule.initial(DependencyModel(kernel, table), STALL)
    s = lowered(s0)
    assert_schedule_is_correct(s)
    assert_round_trip(s)
    assert all(s.own[x] <= s0.own[x] for x in range(len(kernel.instructions)))
    assert all(s.stall_floor(x) == s.own[x] for x in range(len(kernel.instructions)) if s.model.facts[x].pin is None)
    assert lowered(s).text == s.text  # nothing left to lower
    assert s.order() == s0.order()  # stall counts only
    with pytest.raises(SipError, match="needs control.stall"):
        lowered(Schedule.initial(DependencyModel(kernel), frozenset({"alu"})))


def test_sip_floor_writes_the_lowered_cubin_and_its_loops(corpus, tmp_path, capsys):
    data = corpus_entry(corpus, "smem_tiled_gemm")
    src, out = tmp_path / "in.cubin", tmp_path / "out.cubin"
    src.write_bytes(data)
    assert main(["floor", str(src), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    kernel = disassemble(parse_cubin(data))["_Z15smem_tiled_gemmPfPKfS1_i"]
    after = disassemble(parse_cubin(out.read_bytes()))["_Z15smem_tiled_gemmPfPKfS1_i"]
    before_loops, after_loops = loop_summaries(kernel), loop_summaries(after)
    assert before_loops and [s.offset for s in before_loops] == [s.offset for s in after_loops]
    for b, a in zip(before_loops, after_loops):
        line = f"loop at {b.offset:#06x} (block {b.header}), depth {b.depth}: {b.stall_cycles} -> {a.stall_cycles}"
        assert line in text
        assert a.stall_cycles <= b.stall_cycles
    assert sum(a.stall_cycles for a in after_loops) < sum(b.stall_cycles for b in before_loops)
    # what holds the rest: every stall cycle above one in the loops, shared out
    held = re.search(r"the stall cycles above one left are held by: (.*)", text).group(1)
    numbers = [int(part.rsplit(" ", 1)[1]) for part in held.split(", ")]
    bodies = cfg_loops(after)
    in_loops = {i for body in bodies.values() for b in body for i in after.blocks[b]}
    assert len(numbers) == 5 and sum(numbers) == sum(max(after.instructions[i].control.stall - 1, 0)
                                                       for i in in_loops)
    assert main(["floor", str(src), "-o", str(out), "--latency-table", str(tmp_path / "missing.json")]) == 1


@pytest.mark.parametrize("name", ["rosekernels_tma_wgmma_gemm", "unrolled_stencil"])
def test_floor_holds_name_the_pair_across_each_stall_count_and_account_for_every_cycle(corpus, name):
    """floor_and_binding names a pair of the dependency model that spans the instruction's slot (START, a
    block end, or two instructions around it) for every stall count above one it keeps; lowering such a count
    by one is refused; floor_holds shares out every stall cycle above one, and at the floor none is above it."""
    from sip.deps import START
    from sip.mutate import HOLDS, Edit, IllegalMove, floor_holds

    table = latency.load(latency.DEFAULT_PATH)
    kernel = max(disassemble(parse_cubin(corpus_entry(corpus, name))).values(), key=lambda k: len(k.instructions))
    s0 = Schedule.initial(DependencyModel(kernel, table), STALL)
    s = lowered(s0)
    n = len(kernel.instructions)
    kept = 0
    for x in range(n):
        if s.model.facts[x].pin is not None or s.own[x] <= 1:
            continue
        floor, (p, c) = s.floor_and_binding(x)
        assert floor == s.own[x] == s.stall_floor(x)
        block = kernel.block_of[x]
        assert p == START or (kernel.block_of[p] == block and s.slots[p] <= s.slots[x])
        assert c == s.model.end(block) or (kernel.block_of[c] == block and s.slots[c] > s.slots[x])
        with pytest.raises(IllegalMove):
            s.moved(Edit(x, "control.stall", s.own[x] - 1))
        kept += 1
    assert kept > 0
    everything = range(n)
    for schedule in (s0, s):
        held = floor_holds(schedule, everything)
        assert set(held) == set(HOLDS)
        assert sum(held.values()) == sum(schedule.own[x] - 1 for x in everything if schedule.own[x] > 1)
    assert floor_holds(s, everything)["above the floor"] == 0 < floor_holds(s0, everything)["above the floor"]
