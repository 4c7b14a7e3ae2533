"""sip.profile: Nsight Compute's PC samples read back onto a kernel, and the proposal weights they give."""
import math
import random

import pytest
from sip_corpus import BASE, corpus, corpus_entry, ncu_listing as listing, synthetic_kernel  # noqa: F401

from sip import SipError, profile
from sip.cubin import parse_cubin
from sip.deps import DependencyModel
from sip.mutate import Schedule, step
from sip.sass import NO_SCOREBOARD, Control, disassemble

C = Control(2, 1, NO_SCOREBOARD, NO_SCOREBOARD, 0, 0)
def loop_kernel():
    return synthetic_kernel([(t, C) for t in (
        "FADD R1, R2, R3 ;",  # block 0
        "FADD R4, R5, R6 ;",  # block 1: the loop
        "FMUL R7, R8, R9 ;",
        "@P0 BRA 0x10 ;",
        "FADD R10, R11, R12 ;",  # block 2
        "EXIT ;")])


def test_samples_land_on_their_instructions_and_weights_follow_the_blocks():
    k = loop_kernel()
    counts = (20, 300, 1200, 0, 0, 0)
    assert profile.stall_samples(listing(k, counts), k) == counts
    w = profile.block_weights(k, counts)
    assert w[1] == w[2] == w[3] == pytest.approx(1500 / 3)  # a block's samples spread over its instructions
    assert w[0] == pytest.approx(20.0)
    least = 0.01 * sum(counts) / len(counts)
    assert w[4] == w[5] == pytest.approx(least)  # cold blocks keep a floor: reachable, rarely proposed
    hot = profile.hot_blocks(k, counts)
    assert hot[0] == (pytest.approx(1500 / 1520), 1) and [b for _, b in hot] == [1, 0, 2]


def test_a_listing_of_another_build_kernel_or_format_is_refused():
    k = loop_kernel()
    good = listing(k, (1,) * 6)
    other = good.replace("FMUL", "FFMA")  # another build: not this kernel's instruction there
    with pytest.raises(SipError, match="another build"):
        profile.stall_samples(other, k)
    shifted = listing(k, (1,) * 6, base=BASE + 8)  # an address between two instructions
    with pytest.raises(SipError, match="another build"):
        profile.stall_samples(shifted.replace(f"{BASE + 8:#x}", f"{BASE:#x}", 1), k)
    rows = good.splitlines()
    twice = "\n".join(rows[:3] + rows[2:]) + "\n"  # the first instruction's row listed twice
    with pytest.raises(SipError, match="lists the instruction at \\+0x0 twice"):
        profile.stall_samples(twice, k)
    with pytest.raises(SipError, match="not an ncu source listing"):
        profile.stall_samples("ID,Kernel Name\n1,foo\n", k)
    no_samples = good.replace("Warp Stall Sampling (All Samples)", "Instructions Issued")
    with pytest.raises(SipError, match="SourceCounters"):
        profile.stall_samples(no_samples, k)
    with pytest.raises(SipError, match="lists no instructions"):
        profile.stall_samples("\n".join(good.splitlines()[:2]), k)
    truncated = good.rsplit("\n", 2)[0] + '\n"0x7f3a00001050"\n'  # a row cut short
    with pytest.raises(SipError, match="unreadable row"):
        profile.stall_samples(truncated, k)
    with pytest.raises(SipError, match="profiles .*other_kernel.*, not synthetic"):
        profile.stall_samples(listing(k, (1,) * 6, name="other_kernel"), k)
    with pytest.raises(SipError, match="sample counts for"):
        profile.block_weights(k, (1, 2))
    with pytest.raises(SipError, match="99 PC samples of synthetic: too few"):
        profile.block_weights(k, (0, 99, 0, 0, 0, 0))


def test_the_sections_of_several_launches_add_up_and_other_kernels_are_skipped():
    k = loop_kernel()
    other = synthetic_kernel([("IADD3 R1, R2, R3, RZ ;", C), ("EXIT ;", C)])
    text = listing(k, (1, 2, 3, 4, 5, 6)) + listing(other, (50, 50), name="other_kernel") + listing(k, (10,) * 6)
    assert profile.stall_samples(text, k) == (11, 12, 13, 14, 15, 16)
    # another build under the same name (CuTeDSL names are truncated) is skipped while one section matches
    same_name = listing(other, (50, 50), name=k.name)
    assert profile.stall_samples(same_name + listing(k, (1,) * 6), k) == (1,) * 6
    with pytest.raises(SipError, match="another build"):
        profile.stall_samples(same_name, k)
    # sections without a name line: each header starts one
    unnamed = "".join(t.split("\n", 1)[1] for t in (listing(k, (1,) * 6), listing(k, (2,) * 6)))
    assert profile.stall_samples(unnamed, k) == (3,) * 6


def test_a_demangled_name_matches_its_mangled_kernel(corpus):
    k = disassemble(parse_cubin(corpus_entry(corpus, "smem_tiled_gemm")))["_Z15smem_tiled_gemmPfPKfS1_i"]
    n = len(k.instructions)
    named = listing(k, (1,) * n, name="smem_tiled_gemm(float *, const float *, const float *, int)")
    assert profile.stall_samples(named, k) == (1,) * n
    with pytest.raises(SipError, match="the listing profiles .*tiled_gemm_v2"):
        profile.stall_samples(listing(k, (1,) * n, name="tiled_gemm_v2(float *)"), k)


def test_measured_weights_steer_the_proposals(corpus):
    """With the samples all in one block, one step's change lands there with the probability the
    weights give it (a binomial bound over many seeds), far above what loop depth alone gives."""
    k = disassemble(parse_cubin(corpus_entry(corpus, "smem_tiled_gemm")))["_Z15smem_tiled_gemmPfPKfS1_i"]
    hot = max(range(len(k.blocks)), key=lambda b: len(k.blocks[b]) if b else 0)
    counts = tuple(10 if k.block_of[i] == hot else 0 for i in range(len(k.instructions)))
    weights = profile.block_weights(k, profile.stall_samples(listing(k, counts), k))
    s0 = Schedule.initial(DependencyModel(k), frozenset({"alu"}), weights=weights)
    legal = s0.moves()
    p = sum(weights[c.instruction] for c in legal if k.block_of[c.instruction] == hot) / sum(
        weights[c.instruction] for c in legal)
    assert p > 0.9
    by_depth = Schedule.initial(DependencyModel(k), frozenset({"alu"}))  # loop depth alone
    w = by_depth.layout.weight
    assert sum(w[c.instruction] for c in legal if k.block_of[c.instruction] == hot) / sum(
        w[c.instruction] for c in legal) < p - 0.3
    n = 600
    hits = sum(k.block_of[step(s0, random.Random(seed))[1].instruction] == hot for seed in range(n))
    assert abs(hits / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1 / n, (hits / n, p)
    with pytest.raises(SipError, match="one weight per instruction"):
        Schedule.initial(DependencyModel(k), frozenset({"alu"}), weights=weights[:-1])
    for bad in (0.0, math.inf):
        with pytest.raises(SipError, match="finite and > 0"):
            Schedule.initial(DependencyModel(k), frozenset({"alu"}), weights=(bad,) + weights[1:])
