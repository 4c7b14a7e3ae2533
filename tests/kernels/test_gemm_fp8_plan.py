"""gemm_fp8_plan (CPU, no CuTeDSL): the FP8 configs, the heuristic on the bf16 cost model's equivalent
problem, the search space, the warm-up set."""
import dataclasses
import subprocess
import sys

import pytest

from rosekernels.kernels import gemm_fp8_plan as plan
from rosekernels.kernels import gemm_leakyrelu_plan as bf16
from rosekernels.models import ModelDims

QWEN3_8B = ModelDims("qwen3-8b", 4096, 12288, 32, 8, 128)


def test_imports_without_cutlass():
    code = "import sys; import rosekernels.kernels.gemm_fp8_plan; print('cutlass' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"


@pytest.mark.parametrize("fields, match", [
    (dict(scales="tensor"), "scales must be one of"),
    (dict(b_major="n"), "K-major"),
    (dict(tile_m=64, tile_n=256, cluster_m=1, split_k=True), "registers"),
    (dict(tile_m=128, tile_n=192, pingpong=True), "registers"),
    (dict(tile_m=128, tile_n=256), "registers"),
    (dict(tile_m=128, tile_n=96, cluster_m=1, split_k=True, scales="block"), "divisor of 128"),
    (dict(dtype="fp32"), "dtype"),
    (dict(tile_n=64, pingpong=True, stagger=True), "stagger"),
    (dict(tile_m=64, cluster_m=1, stagger=True), "stagger"),
    (dict(tile_n=32, cluster_m=1, split_k=True, swap_ab=True, stagger=True), "stagger"),
    (dict(tile_n=64, cluster_m=1, split_k=True, stagger=True), "stagger"),
])
def test_config_validation(fields, match):
    with pytest.raises(ValueError, match=match):
        plan.Fp8GemmConfig(**{"tile_m": 128, "tile_n": 128, **fields})


def test_a_config_is_a_gemm_config_of_its_own_op():
    c = plan.Fp8GemmConfig(tile_m=64, tile_n=8, cluster_m=1, split_k=True, swap_ab=True, activation="none",
                           scales="block")
    key = c.variant().key()
    assert key.startswith("gemm_fp8-decode-") and "scales=block" in key and "b_major" not in key
    assert plan.Fp8GemmConfig.from_variant(c.variant()) == c and c.fp8
    bf16_twin = bf16.GemmConfig(**{f.name: getattr(c, f.name) for f in dataclasses.fields(bf16.GemmConfig)})
    assert not getattr(bf16_twin, "fp8", False) and plan.as_fp8(bf16_twin, "block") == c
    assert plan.as_fp8(dataclasses.replace(bf16_twin, tile_m=64, tile_n=256, swap_ab=False), "rowcol") is None


def test_check_sizes():
    plan.check_sizes(8, 16, False, "rowcol")
    for n, k, gated, scales, match in [(12, 16, False, "rowcol", "multiple of 8"), (24, 16, True, "rowcol", "of 16"),
                                       (8, 24, False, "rowcol", "K = 24"), (8, 1040, False, "block", "1 x 128")]:
        with pytest.raises(ValueError, match=match):
            plan.check_sizes(n, k, gated, scales)


def test_the_equivalent_problem_has_the_bytes_and_k_tiles_of_the_fp8_one():
    for k in (16, 128, 1040, 4096, 16384):
        eq = plan.equivalent(plan.Fp8GemmShape(8, 4096, k))
        assert -(-eq.k // bf16.TILE_K) == -(-k // plan.TILE_K) and eq.n * eq.k * 2 >= 4096 * k


@pytest.mark.parametrize("scales", plan.SCALES)
@pytest.mark.parametrize("m", [1, 8, 16, 33, 64, 100, 128, 129, 8192])
@pytest.mark.parametrize("n, k", [(4096, 4096), (24576, 4096), (4096, 12288), (1024, 4096), (18944, 3584)])
def test_heuristic_and_candidates(scales, m, n, k):
    if scales == "block" and k % 128:
        pytest.skip("block scales take K multiple of 128")
    shape = plan.Fp8GemmShape(m, n, k, scales=scales)
    pick = plan.config_for(shape, 132)
    assert isinstance(pick, plan.Fp8GemmConfig) and pick.scales == scales and pick.mode == shape.mode
    bf16.check_fits(pick, m, n)
    found = plan.candidates(shape, 132)
    assert found[0] == pick and len(found) == len(set(found)) > 1
    assert all(c.scales == scales and c.mode == shape.mode for c in found)
    ranked = plan.rank(shape, found, 132)
    assert sorted(map(str, ranked)) == sorted(map(str, found))
    if m <= bf16.DECODE_MAX_M:  # the bf16 cost model's least-cost pick among the FP8 kernel's configs
        eq = plan.equivalent(shape)
        assert pick == bf16.least_cost(eq, [plan.as_fp8(c, scales) for c in bf16.decode_configs(
            eq, bf16.fitted_splits(eq), 132) if plan.as_fp8(c, scales)], 132)


def test_stagger_is_searched_on_cooperative_prefill_tiles_and_keyed_only_when_on():
    shape = plan.Fp8GemmShape(8192, 4096, 4096)
    found = plan.candidates(shape, 132)
    assert not plan.config_for(shape, 132).stagger  # not the heuristic until a GPU measures it
    staggered = [c for c in found if c.stagger]
    assert staggered and all(not c.pingpong and c.tile_m == 128 for c in staggered)
    assert {dataclasses.replace(c, stagger=False) for c in staggered} == {c for c in found if not c.pingpong and not c.stagger}
    assert not any(c.stagger for c in plan.candidates(plan.Fp8GemmShape(16, 4096, 4096), 132))
    off, on = found[0], dataclasses.replace(found[0], stagger=True)
    assert "stagger" not in off.variant().key() and "stagger=True" in on.variant().key()
    assert plan.Fp8GemmConfig.from_variant(on.variant()) == on


def test_wide_tiles_are_prefill_candidates_of_per_channel_scales_only():
    """128 x 160 and 128 x 176 (176 accumulator registers) join the per-channel prefill search, gated only
    where the tile holds whole gate/up pairs (160); block scales keep weight tiles that divide 128, decode
    keeps the 128-register bound, and the heuristic stays 128 x 128 until a GPU measures them."""
    C = plan.Fp8GemmConfig
    def tiles(shape):
        return {(c.tile_m, c.tile_n) for c in plan.candidates(shape, 132)}

    assert tiles(plan.Fp8GemmShape(8192, 4096, 4096)) == {(128, 128), (128, 64), (128, 160), (128, 176)}
    assert tiles(plan.Fp8GemmShape(8192, 4096, 4096, gated=True, activation="silu")) == {
        (128, 128), (128, 64), (128, 160)}
    assert tiles(plan.Fp8GemmShape(8192, 4096, 4096, scales="block")) == {(128, 128), (128, 64)}
    assert (plan.config_for(plan.Fp8GemmShape(8192, 4096, 4096), 132).tile_n) == 128
    for m in (1, 16, 64, 128):
        assert all(plan.acc_regs(c) <= plan.MAX_ACC_REGS for c in plan.candidates(plan.Fp8GemmShape(m, 4096, 4096), 132))
    wide = C(tile_m=128, tile_n=176, activation="none")
    assert plan.acc_regs(wide) == plan.WIDE_ACC_REGS and C.from_variant(wide.variant()) == wide
    with pytest.raises(ValueError, match="registers"):
        C(tile_m=128, tile_n=176, activation="none", split_k=True, cluster_m=1)  # a decode tile, 176 registers
    with pytest.raises(ValueError, match="registers"):
        C(tile_m=128, tile_n=192, activation="none")
    with pytest.raises(ValueError, match="divisor of 128"):
        C(tile_m=128, tile_n=160, activation="none", scales="block")


def test_small_m_swaps_like_the_bf16_gemm():
    pick = plan.config_for(plan.Fp8GemmShape(4, 4096, 4096), 132)
    assert pick.swap_ab and pick.tile_n == 8


def test_variants_for():
    assert plan.variants_for([QWEN3_8B]) == []  # a model not run in FP8 needs none
    channel = plan.variants_for([dataclasses.replace(QWEN3_8B, fp8="channel")], ["decode"], max_tokens=16)
    assert channel and {c.scales for c in channel} == {"rowcol"} and {c.mode for c in channel} == {"decode"}
    assert {c.gated for c in channel} == {False, True}
    block = plan.variants_for([dataclasses.replace(QWEN3_8B, fp8="block")])
    assert {c.scales for c in block} == {"block"} and {c.mode for c in block} == {"decode", "prefill"}
    assert {(c.tile_m, c.tile_n, c.pingpong) for c in block if c.mode == "prefill"} == set(plan.PREFILL_TILES)
    default = plan.variants_for()
    assert {c.scales for c in default} == set(plan.SCALES)
    assert all(c.splits == 1 and c.raster_group == bf16.RASTER_GROUP for c in default)


def test_model_gemms_need_the_sizes_the_kernel_takes():
    odd = dataclasses.replace(QWEN3_8B, hidden=4112, fp8="block")  # K = 4112: no whole 1 x 128 groups
    assert {role for role, *_ in plan.model_gemms(odd)} == {"o", "mlp down"}  # K = 4096 and 12288
    # per channel: q, k and v as one weight (the scales of the three apart); per tensor: apart (one scale each)
    assert [role for role, *_ in plan.model_gemms(dataclasses.replace(odd, fp8="channel"))] == [
        "q/k/v", "o", "mlp gate/up", "mlp down"]
    assert [role for role, *_ in plan.model_gemms(dataclasses.replace(odd, fp8="tensor"))] == [
        "q", "k/v", "o", "mlp gate/up", "mlp down"]
    assert plan.model_gemms(QWEN3_8B) == []


def test_fp8_q_k_and_v_fuse_where_the_scales_of_the_whole_are_those_of_the_three():
    assert plan.fuses_qkv(4096, 1024, 4096, "channel") and plan.fuses_qkv(4096, 512, 2048, "block")
    assert not plan.fuses_qkv(4096, 1024, 4096, "tensor")
    assert not plan.fuses_qkv(4096, 64, 4096, "block")  # a 128-row block would hold k and v rows
    assert plan.fuses_qkv(4096, 64, 4096, "channel")
    assert not plan.fuses_qkv(4096, 1024, 4104, "channel")  # K: 16-byte e4m3 rows


def test_workload_fits():
    shape = plan.Fp8GemmShape(16, 4096, 4096)
    config = plan.config_for(shape, 132)
    plan.workload_fits(config, shape)
    with pytest.raises(ValueError, match="does not serve"):
        plan.workload_fits(config, dataclasses.replace(shape, scales="block"))


def test_prefill_candidates_take_every_cluster_cuBLAS_and_bf16_use():
    """FP8 prefill candidates: each tile on 2x1, 1x1 (cuBLAS's FP8 tile runs without a cluster) and 1x2 clusters."""
    found = plan.candidates(plan.Fp8GemmShape(m=4096, n=14336, k=4096), 132)
    coop = [c for c in found if (c.tile_m, c.tile_n, c.pingpong, c.stagger, c.raster_group) == (128, 128, False, False, 8)]
    assert {(c.cluster_m, c.cluster_n) for c in coop} == {(2, 1), (1, 1), (1, 2)} == set(plan.PREFILL_CLUSTERS)
