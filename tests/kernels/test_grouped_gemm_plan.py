"""grouped_gemm planning on the CPU, without CuTeDSL: configs and their keys, the mode rule, the
work-unit bound the grid is sized by, the search space and the warm-up set."""
import dataclasses
import math
import os
import random
import subprocess
import sys

import pytest

from rosekernels import contract
from rosekernels.kernels import gemm_leakyrelu_plan as gemm_plan
from rosekernels.kernels import grouped_gemm_plan as plan
from rosekernels.models import QWEN3_8B, QWEN3_30B_A3B

Config, Shape = plan.GroupedConfig, plan.GroupedShape


def test_imports_without_cutedsl():
    code = "import sys; sys.modules['cutlass'] = None; import rosekernels.kernels.grouped_gemm_plan"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"})


def test_config_validation():
    Config()  # the dense prefill tile, cooperative 128 x 256
    Config(tile_m=64, tile_n=8, swap_ab=True, gather=True, row_scale=True, bias="fp32", activation="silu",
           gated=True)
    for bad, match in ((dict(dtype="fp32"), "bf16 or fp16"), (dict(bias="fp16"), "bias"),
                       (dict(activation="tanh"), "activation"), (dict(tile_n=200), "plain tiles"),
                       (dict(tile_m=64, tile_n=8, swap_ab=True, pingpong=True), "swapped tiles"),
                       (dict(tile_m=64, tile_n=12, swap_ab=True), "swapped tiles"),
                       (dict(tile_m=256, tile_n=8, swap_ab=True), "swapped tiles"), (dict(stages=1), "stages")):
        with pytest.raises(ValueError, match=match):
            Config(**bad)


def test_the_gemm_device_class_reads_a_grouped_config_as_a_dense_one():
    """What gemm_leakyrelu's device class reads besides the fields: no clusters, no K splits, K-major
    weights, whole A tiles; and which side the rows and the weights are on."""
    plain, swapped = Config(tile_n=192, pingpong=True), Config(tile_m=128, tile_n=32, swap_ab=True)
    for c in (plain, swapped):
        assert c.grouped and (c.cluster_m, c.cluster_n, c.split_k, c.splits, c.b_major) == (1, 1, False, 1, "k")
        assert c.a_rows == c.tile_m
    assert (plain.row_tile, plain.weight_tile, plain.mode) == (128, 192, "prefill")
    assert (swapped.row_tile, swapped.weight_tile, swapped.mode) == (32, 128, "decode")
    assert not getattr(gemm_plan.GemmConfig(), "grouped", False)


def test_variant_keys_leave_defaults_out_and_invert():
    for c in (Config(), Config(tile_m=64, tile_n=8, swap_ab=True, gather=True), Config(activation="leaky_relu",
                                                                                       slope=0.25),
              Config(stages=3, pdl=False, row_scale=True, dtype="fp16", bias="fp32")):
        assert Config.from_variant(c.variant()) == c
        assert c.variant().op == "grouped_gemm" and c.variant().mode == c.mode
    key = Config().variant().key()
    assert "gather" not in key and "row_scale" not in key and "stages" not in key and "slope" not in key
    assert "gather=True" in Config(gather=True).variant().key()
    assert Config(activation="silu", slope=0.5) == Config(activation="silu")  # the slope is unread there
    assert len({c.variant() for c in (Config(), Config(gated=True), Config(bias="bf16"), Config(gather=True),
                                      Config(row_scale=True), Config(activation="silu"))}) == 6


def test_shape_defaults_and_contract():
    from rosekernels.kernels import KERNELS, kernel_module

    module = kernel_module("grouped_gemm")
    assert KERNELS["grouped_gemm"] == "rosekernels.kernels.grouped_gemm" and module.OP == "grouped_gemm"
    assert contract.missing(module) == []
    assert Shape.defaults("decode").rows == 128 and Shape.defaults("prefill").rows == 32768
    assert plan.config_for(Shape.defaults("decode"), 132).mode == "decode"
    assert plan.config_for(Shape.defaults("prefill"), 132).mode == "prefill"
    assert contract.bucket(Shape(1000)) == Shape(1024)


@pytest.mark.parametrize("rows, experts, mode, tile_n", [
    (1, 128, "decode", 8), (8, 128, "decode", 8), (1024, 128, "decode", 16), (8192, 128, "decode", 128),
    (8193, 128, "prefill", None), (32, 8, "decode", 8), (512, 8, "decode", 128), (513, 8, "prefill", None),
    (16384 * 8, 32, "prefill", None)])
def test_the_mode_follows_the_mean_rows_per_expert(rows, experts, mode, tile_n):
    c = plan.config_for(Shape(rows, experts), 132)
    assert c.mode == mode
    if mode == "decode":  # weights on the MMA's M side, 64 rows: the dense model's best weight-streaming tile
        assert (c.tile_m, c.tile_n) == (64, tile_n) and tile_n >= min(128, 2 * math.ceil(rows / experts))
    else:  # on 2x1 clusters where the rows come by TMA; gathered rows (cp.async) on one CTA
        assert (c.tile_m, c.tile_n, c.pingpong) in plan.PLAIN_TILES and c.cluster_m == plan.PREFILL_CLUSTER_M == 2
        assert plan.config_for(Shape(rows, experts, gather=True), 132).cluster_m == 1


def test_the_heuristic_keeps_the_shapes_options():
    s = Shape(64, 16, 512, 256, dtype="fp16", bias="fp32", activation="leaky_relu", gated=False, slope=0.3,
              gather=True, row_scale=True, pdl=False)
    for c in plan.candidates(s, 132):
        assert (c.dtype, c.bias, c.activation, c.gated, c.slope, c.gather, c.row_scale, c.pdl) == (
            "fp16", "fp32", "leaky_relu", False, 0.3, True, True, False)


@pytest.mark.parametrize("rows", [1, 64, 1000, 8192, 8193, 100000])
def test_candidates_are_valid_distinct_of_one_mode_and_hold_the_pick(rows):
    s = Shape(rows)
    found = plan.candidates(s, 132)
    assert found[0] == plan.config_for(s, 132) and len(set(found)) == len(found)
    assert {c.mode for c in found} == {found[0].mode}
    assert len(found) == (len(plan.SWAP_TILE_M) * len(plan.SWAP_TILE_N) if found[0].swap_ab
                          else len(plan.PLAIN_TILES) * len(plan.CLUSTERS_M))
    assert all(c.cluster_m == 1 for c in found if c.swap_ab)
    # gathered rows come by cp.async, not TMA: no cluster shares them
    assert all(c.cluster_m == 1 for c in plan.candidates(Shape(rows, gather=True), 132))


def _units(offsets, rows, n, config):
    """The work units the kernel walks: per group (clamped as the kernel clamps it), plan.units_for."""
    total = 0
    for lo, hi in zip(offsets, offsets[1:]):
        lo = min(max(lo, 0), rows)
        hi = min(max(hi, lo), rows)
        total += plan.units_for(config, hi - lo, n)
    return total


def test_units_of_an_expert_on_2x1_clusters():
    """Row tiles in pairs over every weight tile; an odd last row tile over pairs of weight tiles (its CTAs
    split them), an odd last weight tile still one unit."""
    pair = Config(tile_n=192, pingpong=True, cluster_m=2)
    one = Config(tile_n=192, pingpong=True)
    assert plan.units_for(one, 300, 1536) == 3 * 8
    assert plan.units_for(pair, 256, 1536) == 1 * 8  # two full row tiles: one pair per weight tile
    assert plan.units_for(pair, 300, 1536) == 1 * 8 + 4  # a third row tile: 8 weight tiles in 4 splits
    assert plan.units_for(pair, 300, 1344) == 7 + 4  # 7 weight tiles: 3 splits and a shared last one
    assert plan.units_for(pair, 0, 1536) == 0 and plan.units_for(pair, 1, 192) == 1
    # every unit does whole work: never more units than a CTA per row tile and weight tile needs, halved
    for rows in range(0, 1200, 37):
        for n in (192, 384, 1344, 1536):
            tiles, wt = -(-rows // 128), -(-n // 192)
            assert tiles * wt / 2 <= plan.units_for(pair, rows, n) <= -(-tiles // 2) * wt


def test_the_grid_bound_holds_every_valid_grouping():
    """max_units (the grid's bound) is at least the units of any grouping of the rows into the
    experts, its worst case included: every expert with rows ending in a partial row tile."""
    r = random.Random(0)
    for _ in range(300):
        experts, rows, n = r.randint(1, 300), r.randint(1, 5000), 16 * r.randint(1, 300)
        c = r.choice(plan.candidates(Shape(rows, experts, n), 132) + plan.candidates(Shape(10**5, experts, n), 132))
        cuts = sorted(r.randint(0, rows) for _ in range(experts - 1))
        offsets = [0, *cuts, rows]
        assert _units(offsets, rows, n, c) <= plan.max_units(c, rows, experts, n)
    # 9 rows to each of 10 experts: two row tiles each, 20 where all 90 rows in one group would take 12.
    c = Config(tile_m=64, tile_n=8, swap_ab=True)
    used = _units(list(range(0, 91, 9)), 90, 128, c)
    assert 12 * 2 < used == 20 * 2 <= plan.max_units(c, 90, 10, 128)


def test_clusters_pair_the_row_tiles_of_plain_tiles_by_tma_only():
    c = Config(tile_n=192, pingpong=True, cluster_m=2)
    assert c.unit_rows == 2 * c.row_tile == 256 and "cluster_m=2" in c.variant().key()
    assert "cluster_m" not in Config(tile_n=192, pingpong=True).variant().key()  # the key of cluster 1 is as before
    for bad in (dict(cluster_m=3), dict(cluster_m=2, gather=True), dict(tile_m=64, tile_n=8, swap_ab=True, cluster_m=2)):
        with pytest.raises(ValueError, match="cluster_m"):
            Config(**bad)
    # a cluster's unit covers two row tiles: half the units, never fewer than the groups' row tiles need
    assert plan.max_units(c, 4096, 8, 1536) == (4096 // 256 + 8) * 8 < plan.max_units(Config(), 4096, 8, 1536) * 2


def test_sizes_the_kernel_refuses():
    plan.check_sizes(1024, 512, 1536, 2048, True)
    for args, match in (((8, 513, 64, 64, False), "1 to 512 experts"), ((8, 0, 64, 64, False), "1 to 512"),
                        ((8, 4, 24, 64, True), "multiple of 16"), ((8, 4, 20, 64, False), "multiple of 8"),
                        ((8, 4, 64, 12, False), "K a multiple of 8"), ((10**7, 512, 65536, 64, False), "too large")):
        with pytest.raises(ValueError, match=match):
            plan.check_sizes(*args)


def test_the_kernels_prefix_sums_of_units_fit_int32():
    """At the most work units check_sizes lets through (one expert, 8-row tiles of 64 weight rows: a unit
    per 8 rows), a step of the kernel's scan (32 experts' units, each clamped to max_units, added to a
    carry of at most max_units) stays below 2^31; 8 rows more are refused."""
    rows = 8 * (plan.MAX_UNITS - 2)
    plan.check_sizes(rows, 1, 64, 64, False)
    assert 33 * plan.max_units(Config(tile_m=64, tile_n=8, swap_ab=True), rows, 1, 64) < 2**31
    with pytest.raises(ValueError, match="too large"):
        plan.check_sizes(rows + 8, 1, 64, 64, False)


def test_model_gemms_are_the_expert_gate_up_and_down():
    assert plan.model_gemms(QWEN3_30B_A3B) == [("experts gate/up", 1536, 2048, "silu", True),
                                               ("experts down", 2048, 768, "none", False)]
    assert plan.model_gemms(QWEN3_8B) == []  # dense
    assert plan.model_gemms(dataclasses.replace(QWEN3_30B_A3B, moe_intermediate=100)) == []  # 2 x 100 % 16
    assert plan.model_gemms(dataclasses.replace(QWEN3_30B_A3B, experts=1024)) == []


def test_variants_list_each_config_once_and_every_plain_tile():
    found = plan.variants_for([QWEN3_30B_A3B])
    assert len(set(found)) == len(found)
    prefill = [c for c in found if c.mode == "prefill"]
    assert len(prefill) == 2 * len(plan.PLAIN_TILES)
    assert plan.variants_for([QWEN3_30B_A3B], modes=("decode",)) == [c for c in found if c.mode == "decode"]
    assert not [c for c in plan.variants_for([QWEN3_30B_A3B], max_tokens=64) if c.mode == "prefill"]
    assert plan.variants_for([QWEN3_8B]) == []
    assert plan.variants_for() == plan.variants_for([QWEN3_30B_A3B])  # the default: Qwen3-30B-A3B in bf16


@pytest.mark.parametrize("model", [QWEN3_30B_A3B, dataclasses.replace(QWEN3_30B_A3B, experts=32, topk=6)],
                         ids=["qwen3-30b-a3b", "e32-top6"])
def test_variants_are_the_heuristics_picks_at_every_token_count(model):
    """In each mode asked, for calls of 1 .. max_tokens tokens across the mode boundary (64 rows per
    expert: 1024 tokens of Qwen3-30B-A3B, 341 of 32 experts x top-6): exactly the swapped configs
    config_for picks, and every plain one it picks on GPUs of several SM counts as soon as it picks one."""
    boundary = plan.DECODE_MAX_MEAN_ROWS * model.experts // model.topk
    assert plan.decode_mode(boundary * model.topk, model.experts)
    assert not plan.decode_mode((boundary + 1) * model.topk, model.experts)
    picks = [set()] + [{plan.config_for(Shape(t * model.topk, model.experts, n, k, activation=act, gated=gated), sms)
                        for _, n, k, act, gated in plan.model_gemms(model) for sms in (78, 114, 132)}
                       for t in range(1, 2 * boundary + 1)]
    for max_tokens in (1, 128, boundary - 1, boundary, boundary + 1, None):
        want_all = set().union(*picks[:len(picks) if max_tokens is None else max_tokens + 1])
        for modes in (("decode",), ("prefill",), ("prefill", "decode")):
            got = plan.variants_for([model], modes, max_tokens)
            want = {c for c in want_all if c.mode in modes}
            assert {c for c in got if c.swap_ab} == {c for c in want if c.swap_ab}, (max_tokens, modes)
            plain = {c for c in got if not c.swap_ab}
            assert {c for c in want if not c.swap_ab} <= plain and bool(plain) == any(not c.swap_ab for c in want)


def test_row_ranges_are_of_the_configs_mode():
    for c in (Config(tile_m=64, tile_n=8, swap_ab=True), Config()):
        for experts in (1, 7, 16):
            lo, hi = plan.row_range(c, experts)
            assert 1 <= lo <= hi
            assert {plan.config_for(Shape(rows, experts), 132).mode for rows in (lo, hi)} == {c.mode}
