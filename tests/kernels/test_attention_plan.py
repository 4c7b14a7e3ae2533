"""The attention plan modules on the CPU, without CuTeDSL: configs and their variant keys, the tile and
split-count heuristics, the tuner's candidates and the warm-up sets."""
import dataclasses
import subprocess
import sys

import pytest

from rosekernels.kernels import attention_decode_plan as D
from rosekernels.kernels import attention_plan as P
from rosekernels.models import QWEN3_8B, QWEN3_30B_A3B, ModelDims

DTYPES = ("bf16", "fp16")


def test_plan_modules_import_without_cutedsl():
    code = ("import sys; sys.modules['cutlass'] = None; "
            "import rosekernels.kernels.attention_plan, rosekernels.kernels.attention_decode_plan")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_default_variants_are_the_warm_up_set_with_unchanged_keys():
    prefill = {f"attention-prefill-sm_90a-causal={c}-dtype={dt}-head_dim={d}-num_stages={st}-overlap=True-"
               f"tile_m={m}-tile_n={n}"
               for dt in DTYPES for c in (False, True)
               for d, m, n, st in ((64, 192, 128, 3), (64, 128, 128, 3), (128, 128, 128, 2))
               if m == 192 or d == 128 or not c}
    # d=128 with long keys: O stored from registers (a key of its own; the others are unchanged)
    prefill |= {f"attention-prefill-sm_90a-causal={c}-direct_o=True-dtype={dt}-head_dim=128-num_stages=2-"
                f"overlap=True-tile_m=128-tile_n=192" for dt in DTYPES for c in (False, True)}
    decode = {f"attention_decode-decode-sm_90a-dtype={dt}-head_dim={d}-num_stages=3-tile_m={m}"
              for dt in DTYPES for d in (64, 128) for m in (16, 32, 64)}
    assert len(P.variants_for()) == len(prefill) == 14
    assert {c.variant().key() for c in P.variants_for()} == prefill
    assert len(D.variants_for()) == len(decode) == 12
    assert {c.variant().key() for c in D.variants_for()} == decode


def test_launch_policy_stays_out_of_the_variant_and_from_variant_inverts_it():
    for cfg in P.variants_for():
        assert P.AttentionConfig.from_variant(cfg.variant()) == cfg
        assert dataclasses.replace(cfg, persistent=False).variant() == cfg.variant()
    for cfg in D.variants_for():
        assert D.DecodeConfig.from_variant(cfg.variant()) == cfg
        assert dataclasses.replace(cfg, splits=7).variant() == cfg.variant()
    with pytest.raises(ValueError, match="not an attention variant"):
        P.AttentionConfig.from_variant(D.variants_for()[0].variant())


@pytest.mark.parametrize("kwargs, match", [
    (dict(head_dim=96), "head_dim"),
    (dict(dtype="fp32"), "dtype"),
    (dict(tile_m=64), "tile_m"),
    (dict(tile_n=100), "tile_n"),
    (dict(num_stages=0), "num_stages"),
    (dict(num_stages=6), "shared memory"),
    (dict(tile_n=176), "shared memory"),  # Q, O and 2 stages of 176-key K/V tiles
    (dict(tile_n=208, direct_o=True), "shared memory"),
])
def test_prefill_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        P.AttentionConfig(**{**dict(head_dim=128, dtype="bf16", causal=False), **kwargs})


def test_direct_o_stays_out_of_existing_keys():
    slab = P.AttentionConfig(128, "bf16", False, tile_n=160)
    direct = dataclasses.replace(slab, direct_o=True)
    assert "direct_o" not in slab.variant().key() and "direct_o=True" in direct.variant().key()
    assert P.AttentionConfig.from_variant(direct.variant()) == direct


@pytest.mark.parametrize("kwargs, match", [
    (dict(head_dim=96), "head_dim"),
    (dict(dtype="fp32"), "dtype"),
    (dict(tile_m=48), "tile_m"),
    (dict(num_stages=1), "num_stages"),
    (dict(splits=0), "splits"),
])
def test_decode_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.DecodeConfig(**{**dict(head_dim=128, dtype="bf16"), **kwargs})


def test_shape_defaults_serve_only_the_kernels_mode():
    assert P.AttentionShape.defaults("prefill") == P.AttentionShape(2, 2048, 16, 16, 128, "bf16", False)
    assert D.DecodeShape.defaults("decode") == D.DecodeShape(16, 1, 4096, 32, 8, 128, "bf16", False)
    with pytest.raises(ValueError, match="attention: the prefill kernel serves every sequence length"):
        P.AttentionShape.defaults("decode")
    with pytest.raises(ValueError, match="attention_decode: the split-KV kernel of short queries"):
        D.DecodeShape.defaults("prefill")


def test_prefill_config_for_stays_in_the_warm_up_set():
    for d in (64, 128):
        for dt in DTYPES:
            for causal in (False, True):
                for seqlen in (1, 1024, P.LONG_KV - 1, P.LONG_KV, 2 * P.LONG_KV, 10**6):
                    for batch, heads in ((1, 32), (8, 32), (1, 1), (64, 64)):
                        shape = P.AttentionShape(batch, seqlen, heads, heads, d, dt, causal)
                        cfg = P.config_for(shape, sms=132)
                        assert cfg == P.default_config(d, dt, causal, seqlen, seqlen, batch * heads, 132)
                        assert cfg in P.variants_for() and cfg in P.heuristic_configs(d, dt, causal)
    long_nc, long_c = (P.config_for(P.AttentionShape(seqlen=P.LONG_KV, causal=c)) for c in (False, True))
    assert (long_nc.tile_n, long_nc.direct_o) == (192, True) and (long_c.tile_n, long_c.direct_o) == (128, False)
    assert P.config_for(P.AttentionShape(seqlen=2 * P.LONG_KV, causal=True)).tile_n == 192
    assert P.config_for(P.AttentionShape(seqlen=P.LONG_KV - 1)).tile_n == 128


@pytest.mark.parametrize("batch, seqlen, heads, causal, rows", [
    (1, 1024, 32, False, 128),  # 192 tiles of 192 rows: two rounds on 132 SMs; 256 of 128 rows: two shorter ones
    (1, 1024, 32, True, 192),  # causal tiles differ in length: the wave model does not apply
    (1, 2048, 32, False, 192),  # 352 tiles of 192 rows: 3 rounds; 512 of 128: 4
    (8, 1024, 32, False, 192),
    (1, 512, 16, False, 128),  # one round either way: the shorter tile
    (4, 32768, 32, False, 192),
])
def test_d64_row_tiles_follow_the_wave_model(batch, seqlen, heads, causal, rows):
    shape = P.AttentionShape(batch, seqlen, heads, heads // 4 or 1, 64, "bf16", causal)
    assert P.config_for(shape, sms=132).tile_m == rows
    assert P.default_config(64, "bf16", causal).tile_m == 192  # S_q and heads not known


def test_prefill_grid():
    cfg = P.default_config(128, "bf16", True)  # tile_m 128
    assert P.num_tiles(cfg, 3, 300, 5) == 45  # 3 m blocks * 5 heads * 3 batches
    assert P.grid_size(cfg, 3, 300, 5, sms=132) == 45
    assert P.grid_size(cfg, 3, 300, 50, sms=132) == 132
    assert P.grid_size(dataclasses.replace(cfg, persistent=False), 3, 300, 50, sms=132) == 450


@pytest.mark.parametrize("shape", [P.AttentionShape(), P.AttentionShape(seqlen=P.LONG_KV),
                                   P.AttentionShape(head_dim=64, dtype="fp16", causal=True)])
def test_prefill_candidates_are_distinct_configs_of_the_shape_with_the_heuristics_pick(shape):
    found = P.candidates(shape)
    assert len(set(found)) == len(found) > 10
    assert P.config_for(shape) in found
    for cfg in found:
        assert (cfg.head_dim, cfg.dtype, cfg.causal) == (shape.head_dim, shape.dtype, shape.causal)
        assert cfg.smem_bytes() <= P.SMEM_BYTES and cfg.num_stages in P.STAGES
    assert {c.tile_m for c in found} == {128, 192} and {c.overlap for c in found} == {True, False}
    assert {c.persistent for c in found} == {True, False}


def test_variants_for_models():
    assert P.variants_for([QWEN3_8B]) == [P.default_config(128, "bf16", c, s) for c, s in
                                          ((False, 0), (False, P.LONG_KV), (True, 0), (True, 2 * P.LONG_KV))]
    assert P.variants_for([QWEN3_8B], modes=("decode",)) == []
    # GQA 4 (Qwen3-8B) and 8 (Qwen3-30B-A3B): S_q = 1..16 packs 4..128 rows, every row tile.
    assert D.variants_for([QWEN3_8B, QWEN3_30B_A3B]) == [D.DecodeConfig(128, "bf16", m) for m in (16, 32, 64)]
    mha = ModelDims("mha", 2048, 8192, 16, 16, 64, dtype="fp16")  # 1..16 rows: one row tile
    assert D.variants_for([mha]) == [D.DecodeConfig(64, "fp16", 16)]
    assert D.variants_for([mha], modes=("prefill",)) == []
    odd = ModelDims("odd", 2880, 8192, 32, 8, 96)
    assert P.variants_for([odd]) == [] and D.variants_for([odd]) == []
    for cfg in P.variants_for([QWEN3_8B, mha]):
        assert cfg in P.variants_for()
    for cfg in D.variants_for([QWEN3_8B, mha]):
        assert cfg in D.variants_for()


@pytest.mark.parametrize("groups", [1, 8, 16, 128, 256, 1024, 5000])
@pytest.mark.parametrize("n_tiles", [1, 2, 7, 16, 129, 512, 4096])
def test_split_choice_covers_every_tile_with_nonempty_chunks(groups, n_tiles):
    splits, per = D.choose_splits(groups, n_tiles, 32768, 132)
    assert 1 <= splits <= min(n_tiles, D.MAX_SPLITS)
    assert splits * per >= n_tiles > (splits - 1) * per  # every tile in one chunk, no chunk empty
    # A small batch still keeps most SMs busy, as far as the tiles (and MAX_SPLITS) allow.
    assert 2 * groups * splits >= min(132, groups * min(n_tiles, D.MAX_SPLITS))


DECODE_SHAPES = [D.DecodeShape(), D.DecodeShape(batch=1, seqlen_kv=32768 + 77),
                 D.DecodeShape(batch=64, seqlen_q=2, seqlen_kv=300, heads_q=8, heads_kv=8, head_dim=64, dtype="fp16"),
                 D.DecodeShape(batch=3, seqlen_q=16, seqlen_kv=1, heads_q=16, heads_kv=2, causal=True)]


@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_decode_config_for_is_the_row_tile_and_the_models_split_count(shape):
    cfg = D.config_for(shape, sms=132)
    assert cfg.tile_m == D.tile_m_for(shape.rows) and cfg.num_stages == 3
    assert dataclasses.replace(cfg, splits=None) in D.variants_for()
    # The split count in the config launches exactly what the model picks.
    assert D.split_plan(cfg, shape, 132) == D.split_plan(dataclasses.replace(cfg, splits=None), shape, 132)
    groups, n_tiles = shape.batch * shape.heads_kv * -(-shape.rows // cfg.tile_m), -(-shape.seqlen_kv // cfg.tile_n)
    assert D.split_plan(cfg, shape, 132) == (*D.choose_splits(groups, n_tiles, 4 * cfg.tile_n * cfg.head_dim, 132),
                                             groups)


def test_decode_row_tiles_and_forced_splits():
    assert [D.tile_m_for(r) for r in (1, 16, 17, 32, 33, 64, 65, 512)] == [16, 16, 32, 32, 64, 64, 64, 64]
    shape = D.DecodeShape(batch=2, seqlen_kv=1000)  # 1000 keys: 16 tiles of 64
    cfg = D.DecodeConfig(128, "bf16")
    assert D.split_plan(dataclasses.replace(cfg, splits=1), shape, 132)[:2] == (1, 16)
    assert D.split_plan(dataclasses.replace(cfg, splits=5), shape, 132)[:2] == (4, 4)  # whole tiles per chunk
    assert D.split_plan(dataclasses.replace(cfg, splits=10**6), shape, 132)[:2] == (16, 1)  # one tile each


@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_decode_candidates_are_distinct_configs_of_the_shape_with_the_heuristics_pick(shape):
    found = D.candidates(shape, sms=132)
    assert len(set(found)) == len(found)
    assert D.config_for(shape, sms=132) in found
    n_tiles = -(-shape.seqlen_kv // D.DecodeConfig(shape.head_dim, shape.dtype).tile_n)
    for cfg in found:
        assert (cfg.head_dim, cfg.dtype) == (shape.head_dim, shape.dtype)
        assert cfg.tile_m >= D.tile_m_for(shape.rows) and 1 <= cfg.splits <= min(n_tiles, D.MAX_SPLITS)
        assert D.split_plan(cfg, shape, 132)[0] == cfg.splits  # each count is one the launch runs
    assert {c.num_stages for c in found} == set(D.STAGES)
