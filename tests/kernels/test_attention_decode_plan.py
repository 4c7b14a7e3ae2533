"""The split-KV decode plan's KV-cache variants on the CPU, without CuTeDSL: the varlen and page_rows
fields and their variant keys, the TMA box height of a page size, the config and warm-up set of
attention_with_kvcache. (The dense decode plan: test_attention_plan.py.)"""
import dataclasses

import pytest

from rosekernels.kernels import attention_decode_plan as D
from rosekernels.models import QWEN3_8B, ModelDims


def test_dense_keys_are_unchanged_and_kvcache_keys_name_their_fields():
    dense = D.DecodeConfig(128, "bf16", 32)
    assert dense.variant().key() == "attention_decode-decode-sm_90a-dtype=bf16-head_dim=128-num_stages=3-tile_m=32"
    contiguous = dataclasses.replace(dense, varlen=True)
    paged = dataclasses.replace(dense, varlen=True, page_rows=16)
    assert contiguous.variant().key() == dense.variant().key() + "-varlen=True"
    assert paged.variant().key() == ("attention_decode-decode-sm_90a-dtype=bf16-head_dim=128-num_stages=3-"
                                     "page_rows=16-tile_m=32-varlen=True")
    for cfg in (dense, contiguous, paged):
        assert D.DecodeConfig.from_variant(cfg.variant()) == cfg
        assert dataclasses.replace(cfg, splits=5).variant() == cfg.variant()
    assert not contiguous.paged and paged.paged


@pytest.mark.parametrize("kwargs", [
    dict(page_rows=16),  # paged without varlen
    dict(varlen=True, page_rows=8),  # below the smallest box
    dict(varlen=True, page_rows=48),  # not a power of two
    dict(varlen=True, page_rows=128),  # d = 128: tiles of 64 keys
])
def test_page_rows_validation(kwargs):
    with pytest.raises(ValueError, match="page_rows"):
        D.DecodeConfig(128, "bf16", **kwargs)


def test_page_rows_of_d64_may_fill_its_128_key_tile():
    assert D.DecodeConfig(64, "fp16", varlen=True, page_rows=128).tile_n == 128


@pytest.mark.parametrize("block_size, tile_n, rows", [
    (16, 64, 16), (32, 64, 32), (48, 64, 16), (80, 128, 16), (96, 128, 32), (64, 64, 64), (256, 64, 64),
    (1024, 128, 128), (192, 128, 64),
])
def test_box_height_is_the_largest_power_of_two_dividing_page_and_tile(block_size, tile_n, rows):
    assert D.page_rows_for(block_size, tile_n) == rows
    assert block_size % rows == 0 and tile_n % rows == 0


@pytest.mark.parametrize("block_size", [0, 1, 8, 24, 100, -16])
def test_block_sizes_the_kernel_cannot_take_are_refused(block_size):
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 16"):
        D.page_rows_for(block_size, 64)


def test_kvcache_config_plans_the_dense_heuristic_for_a_full_cache():
    """Row tile and split count as config_for picks them for the cache's capacity; the kv fields set."""
    for shape in (D.DecodeShape(batch=1, seqlen_q=4, seqlen_kv=32768, heads_q=32, heads_kv=8),
                  D.DecodeShape(batch=64, seqlen_q=1, seqlen_kv=2048, heads_q=16, heads_kv=16, head_dim=64)):
        dense = D.config_for(shape, 132)
        contiguous = D.kvcache_config_for(shape, None, 132)
        paged = D.kvcache_config_for(shape, 48, 132)
        assert contiguous == dataclasses.replace(dense, varlen=True)
        assert paged == dataclasses.replace(dense, varlen=True, page_rows=16)
    long = D.kvcache_config_for(D.DecodeShape(batch=1, seqlen_kv=32768), 256, 132)
    assert long.splits > 8 and long.page_rows == 64  # a long cache is split; pages of 256 hold whole tiles


def test_kvcache_variants_for_a_model_cover_its_decode_row_tiles():
    # Qwen3-8B: 32 query heads on 8 KV heads (4 rows per token), so S_q 1..16 packs 4..64 rows.
    found = D.kvcache_variants_for([QWEN3_8B], block_size=16)
    assert found == [D.DecodeConfig(128, "bf16", m, varlen=True, page_rows=16) for m in (16, 32, 64)]
    assert D.kvcache_variants_for([QWEN3_8B]) == [D.DecodeConfig(128, "bf16", m, varlen=True) for m in (16, 32, 64)]
    odd = ModelDims("odd", hidden=1024, intermediate=4096, heads_q=8, heads_kv=8, head_dim=96)
    assert D.kvcache_variants_for([odd], block_size=64) == []
    everything = D.kvcache_variants_for(block_size=32)
    assert len(everything) == 12 and {c.page_rows for c in everything} == {32}
    with pytest.raises(ValueError, match="block_size"):
        D.kvcache_variants_for([QWEN3_8B], block_size=20)


def test_pdl_comes_with_the_shape():
    """attention(enable_pdl=False) plans a shape with pdl off: the heuristic's config, every candidate
    and the KV-cache config launch without it, so a tuned entry of one never serves the other."""
    on = D.DecodeShape(batch=8, seqlen_q=2, seqlen_kv=4096)
    off = dataclasses.replace(on, pdl=False)
    assert D.config_for(on, 132).pdl
    assert D.config_for(off, 132) == dataclasses.replace(D.config_for(on, 132), pdl=False)
    assert all(not c.pdl for c in D.candidates(off, 132)) and D.config_for(off, 132) in D.candidates(off, 132)
    assert not D.kvcache_config_for(off, 16, 132).pdl
    assert "-pdl=False-" in D.config_for(off, 132).variant().key()


@pytest.mark.parametrize("warps, ctas, budget", [(5, 1, 255), (5, 2, 168), (5, 3, 128), (8, 1, 255), (8, 2, 128),
                                                 (4, 4, 128), (12, 1, 168)])
def test_register_budget_counts_the_warps_of_the_fullest_subpartition(warps, ctas, budget):
    """Two CTAs of 5 warps put 3 warps on one of the 4 register files (16,384 each): 170 a thread, 168 once
    rounded down to ptxas's unit of 8; a budget never passes 255."""
    assert D.register_budget(warps, ctas) == budget


def test_only_the_e4m3_tiles_that_two_ctas_per_sm_hold_ask_for_their_registers():
    e4m3 = D.DecodeConfig(128, "bf16", 16, varlen=True, kv_fp8=True)
    assert e4m3.warps == D.MMA_WARPS + 1 and e4m3.min_ctas_per_sm == D.E4M3_WAVE_CTAS_PER_SM == 2
    for other in (D.DecodeConfig(128, "bf16", 16), D.DecodeConfig(128, "bf16", 16, varlen=True),
                  dataclasses.replace(e4m3, num_stages=6), dataclasses.replace(e4m3, widen_warps=True),
                  dataclasses.replace(e4m3, tile_m=64), dataclasses.replace(e4m3, tile_m=32, dtype="fp16"),
                  dataclasses.replace(e4m3, tile_m=32, head_dim=64)):
        assert other.min_ctas_per_sm == 1, other
    assert dataclasses.replace(e4m3, tile_m=32).min_ctas_per_sm == 2  # bf16 MMAs at d=128: 168 registers
    assert dataclasses.replace(e4m3, widen_warps=True).warps == D.MMA_WARPS + 1 + D.WIDEN_WARPS
    # widened in registers, the ring is all the shared memory: two CTAs hold 6 stages each
    assert dataclasses.replace(e4m3, widen_regs=True, num_stages=6).min_ctas_per_sm == 2


def test_the_e4m3_cache_s_16_row_tiles_run_fp16_mmas_whatever_the_query():
    for dtype in ("bf16", "fp16"):
        e4m3 = D.DecodeConfig(128, dtype, 16, varlen=True, kv_fp8=True)
        assert e4m3.mma_dtype == "fp16"
        assert dataclasses.replace(e4m3, tile_m=32).mma_dtype == dataclasses.replace(e4m3, tile_m=64).mma_dtype == dtype
        assert D.DecodeConfig(128, dtype, 16, varlen=True).mma_dtype == D.DecodeConfig(128, dtype, 16).mma_dtype == dtype
