"""sip.cfg (loops from the control-flow graph) and the hot-block weighting of sip.mutate's proposals."""
import math
import random

import pytest
from sip_corpus import corpus, corpus_entry, synthetic_kernel  # noqa: F401

from sip import cfg
from sip.cubin import parse_cubin
from sip.deps import DependencyModel
from sip.mutate import Schedule, step
from sip.sass import NO_SCOREBOARD, Control, disassemble

C = Control(2, 1, NO_SCOREBOARD, NO_SCOREBOARD, 0, 0)


def kernel(*texts):
    return synthetic_kernel([(t, C) for t in texts])


def test_nested_loops_and_their_depths():
    k = kernel(
        "FADD R1, R2, R3 ;",  # 0: block 0, before the loops
        "FADD R4, R5, R6 ;",  # 1: block 1, outer loop header (target of the BRA at 5)
        "FADD R7, R8, R9 ;",  # 2: block 2, inner loop header (target of the BRA at 3)
        "@P0 BRA 0x20 ;",  # 3: inner back edge
        "FADD R10, R11, R12 ;",  # 4: block 3, outer loop body
        "@P1 BRA 0x10 ;",  # 5: outer back edge
        "@P2 BRA 0x80 ;",  # 6: block 4, a forward branch: no loop
        "FADD R13, R14, R15 ;",  # 7: block 5
        "EXIT ;")  # 8: block 6 (target of the BRA at 6)
    assert [list(r) for r in k.blocks] == [[0], [1], [2, 3], [4, 5], [6], [7], [8]]
    assert cfg.successors(k) == ((1,), (2,), (2, 3), (1, 4), (6, 5), (6,), ())
    assert cfg.loops(k) == {1: frozenset({1, 2, 3}), 2: frozenset({2})}
    assert cfg.loop_depth(k) == (0, 1, 2, 1, 0, 0, 0)


def test_loop_summaries_deepest_first():
    k = kernel("FADD R1, R2, R3 ;", "FADD R4, R5, R6 ;", "FADD R7, R8, R9 ;", "@P0 BRA 0x20 ;",
               "FADD R10, R11, R12 ;", "@P1 BRA 0x10 ;", "EXIT ;")
    inner, outer = cfg.loop_summaries(k)
    assert (inner.header, inner.offset, inner.depth, inner.blocks, inner.instructions) == (2, 0x20, 2, 1, 2)
    assert (outer.header, outer.offset, outer.depth, outer.blocks, outer.instructions) == (1, 0x10, 1, 3, 5)
    assert outer.stall_cycles == 5 * C.stall and dict(outer.opcodes) == {"FADD": 3, "BRA": 2}
    assert outer.opcodes[0] == ("FADD", 3)


def test_unconditional_transfers_do_not_fall_through():
    k = kernel("FADD R1, R2, R3 ;", "BRA 0x30 ;", "FADD R4, R5, R6 ;", "@P0 EXIT ;", "EXIT ;")
    succ = cfg.successors(k)
    assert succ[0] == (2,)  # BRA: only its target (block 1, the FADD after it, is never reached)
    assert succ[2] == (3,)  # @P0 EXIT may fall through
    assert succ[3] == ()
    idom = cfg.dominators(succ, cfg.entry_blocks(k))
    assert idom[1] is None and idom[2] == 0


def test_a_branch_back_into_a_block_it_does_not_dominate_is_no_loop():
    # block 1 is entered both from block 0 and by the branch at 4: 2 -> 1 is a back edge (1 dominates 2),
    # but the jump from block 3 into block 2 (a second entry into the cycle) makes 2 -> 3 -> 2 irreducible.
    k = kernel("@P0 BRA 0x30 ;", "FADD R1, R2, R3 ;", "@P1 BRA 0x10 ;", "FADD R4, R5, R6 ;", "@P2 BRA 0x10 ;",
               "EXIT ;")
    loops = cfg.loops(k)
    assert set(loops) <= {1}


def test_the_corpus_gemm_inner_loop_is_found(corpus):
    k = disassemble(parse_cubin(corpus_entry(corpus, "smem_tiled_gemm")))["_Z15smem_tiled_gemmPfPKfS1_i"]
    depth = cfg.loop_depth(k)
    by_op = {}
    for i in k.instructions:
        by_op.setdefault(i.base, set()).add(depth[k.block_of[i.index]])
    # ptxas unrolled the tile loop by 4: the unrolled body is the loop, the remainder tiles run once
    assert by_op["FFMA"] == by_op["LDS"] == by_op["BAR"] == {0, 1}
    assert by_op["STG"] == {0} and by_op["EXIT"] == {0}
    (header, body), = cfg.loops(k).items()
    assert body == {header} and sum(i.base == "FFMA" for i in k.instructions
                                    if k.block_of[i.index] == header) == 4 * 16


@pytest.mark.parametrize("weight", [4.0, 1.0])
def test_changes_land_in_loop_bodies_with_the_stated_probability(corpus, weight):
    """One step from the original schedule: the change is legal, and its instruction is in a loop
    body with probability sum(w over legal changes in loops) / sum(w over all legal changes), where
    w = weight ** depth (sip.mutate); checked over many seeds against a binomial bound."""
    k = disassemble(parse_cubin(corpus_entry(corpus, "smem_tiled_gemm")))["_Z15smem_tiled_gemmPfPKfS1_i"]
    s0 = Schedule.initial(DependencyModel(k), frozenset({"alu"}), loop_weight=weight)
    depth = s0.layout.depth
    legal = s0.moves()
    inside = sum(weight ** depth[c.instruction] for c in legal if depth[c.instruction])
    p = inside / sum(weight ** depth[c.instruction] for c in legal)
    assert 0.05 < p < 0.95  # both sides have legal moves
    n = 1500
    hits = 0
    for seed in range(n):
        _, change = step(s0, random.Random(seed))
        assert change in legal
        hits += bool(depth[change.instruction])
    assert abs(hits / n - p) < 4 * math.sqrt(p * (1 - p) / n), (hits / n, p)
    if weight == 4.0:  # the weighting moves the mass towards the loop
        unweighted = sum(1 for c in legal if depth[c.instruction]) / len(legal)
        assert p > unweighted + 0.1
