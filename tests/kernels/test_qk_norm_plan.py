"""qk_norm planning on the CPU, without CuTeDSL: config selection, candidates, the warm-up list."""
import dataclasses
import subprocess
import sys

import pytest

from rosekernels import modes
from rosekernels.kernels import qk_norm_plan as plan
from rosekernels.kernels.qk_norm_plan import QKNormConfig, QKNormShape, candidates, config_for, variants_for
from rosekernels.models import QWEN3_8B, QWEN3_30B_A3B, ModelDims

SMS = 132
DTYPE_PAIRS = (("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"), ("fp16", "fp32"), ("fp32", "fp32"))
TOKENS = (1, 2, 3, 6, 7, 31, 128, 1000, 4097, 16384, 32768)


def test_imports_without_cutlass():
    code = ("import sys; sys.modules['cutlass'] = None\n"
            "from rosekernels.kernels import qk_norm_plan as p\n"
            "assert len(p.variants_for()) == 240 and p.config_for(p.QKNormShape(1)).mode == 'decode'\n"
            "assert 'rosekernels.jit' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_default_variants():
    """variants_for() is the warm-up set the library always listed, each with and without the rotary
    embedding (variant keys are cache keys: those without it keep the keys they had)."""
    configs = variants_for()
    keys = {c.variant().key() for c in configs}
    assert len(configs) == len(keys) == 240  # 2 models x 5 dtype pairs x 3 head dims x 4 modes x rope or not
    assert {c.rope for c in configs if c.rope != "none"} == {"bf16", "fp16", "fp32"}
    assert all(c.rope in ("none", c.dtype) for c in configs)
    assert {(c.q_heads, c.k_heads) for c in configs} == set(plan.MODEL_HEADS.values())
    assert {(c.dtype, c.weight_dtype) for c in configs} == set(DTYPE_PAIRS)
    assert {c.head_dim for c in configs} == set(plan.HEAD_DIMS)
    for key in (
        "qk_norm-decode-sm_90a-cache_hint=none-dtype=bf16-eps=1e-06-head_dim=128-k_heads=8-q_heads=32"
        "-rows_per_thread=1-warps=1-weight_bias=0.0-weight_dtype=bf16",
        "qk_norm-prefill-sm_90a-cache_hint=none-dtype=bf16-eps=1e-06-head_dim=128-k_heads=8-q_heads=32"
        "-rows_per_thread=2-warps=8-weight_bias=0.0-weight_dtype=bf16",
        "qk_norm-prefill-sm_90a-cache_hint=evict_first-dtype=fp16-eps=1e-06-head_dim=64-k_heads=4-q_heads=32"
        "-rows_per_thread=4-warps=16-weight_bias=0.0-weight_dtype=fp32",
        "qk_norm-prefill-sm_90a-cache_hint=evict_first-dtype=fp32-eps=1e-06-head_dim=256-k_heads=4-q_heads=32"
        "-rows_per_thread=1-warps=8-weight_bias=0.0-weight_dtype=fp32",
    ):
        assert key in keys, key
    decode, prefill = variants_for(modes=("decode",)), variants_for(modes=("prefill",))
    assert len(decode) == 60 and {c.mode for c in decode} == {"decode"}
    assert len(prefill) == 180 and {c.mode for c in prefill} == {"prefill"}
    assert set(decode) | set(prefill) == set(configs)


def test_variants_for_models():
    configs = variants_for([QWEN3_8B, QWEN3_30B_A3B])
    assert len(configs) == len(set(configs)) == 2 * 2 * 4 * 2  # models x weight dtypes x modes x rope or not
    assert {(c.q_heads, c.k_heads, c.head_dim, c.dtype) for c in configs} == {(32, 8, 128, "bf16"),
                                                                             (32, 4, 128, "bf16")}
    assert {c.weight_dtype for c in configs} == {"bf16", "fp32"}
    assert {c.rope for c in configs} == {"none", "bf16"}  # rosekernels.hf passes the model's cos and sin
    assert set(configs) <= set(variants_for())
    assert variants_for([ModelDims("d96", 3072, 8192, 32, 8, 96)]) == []  # a head dim the kernel lacks


def test_variants_cover_config_for():
    """What qk_norm() picks for any token count of the default models is in variants_for()."""
    listed = set(variants_for())
    for hq, hk in plan.MODEL_HEADS.values():
        for tokens in TOKENS:
            for dt, wdt in DTYPE_PAIRS:
                for d in plan.HEAD_DIMS:
                    for rope in (None, dt):
                        cfg = config_for(QKNormShape(tokens, hq, hk, d, dt, wdt, rope=rope))
                        assert cfg in listed, cfg


def test_config_roundtrip_and_geometry():
    for cfg in variants_for():
        assert QKNormConfig.from_variant(cfg.variant()) == cfg
        assert cfg.vec * cfg.threads_per_head * cfg.vecs_per_thread == cfg.head_dim
        assert 32 % cfg.threads_per_head == 0
        cfg.validate()
    # d=128 bf16: a half-warp per head, 8 elements per thread (the ROSE design point)
    cfg = config_for(QKNormShape(1))
    assert (cfg.threads_per_head, cfg.vec, cfg.mode, cfg.warps) == (16, 8, "decode", 1)
    assert config_for(QKNormShape(1, dtype="fp32")).vec == 4


def test_mode_selection():
    # Qwen3-8B d=128 bf16: 40 heads x 16 threads = 20 warps per token
    assert config_for(QKNormShape(6), sms=SMS).mode == "decode"  # 120 warps
    assert config_for(QKNormShape(7), sms=SMS).mode == "prefill"  # 140 warps
    assert config_for(QKNormShape(7), sms=140).mode == "decode"
    assert modes.select("qk_norm", SMS, SMS).name == "decode"
    assert modes.select("qk_norm", SMS + 1, SMS).name == "prefill"
    for op in modes.PREFILL_TABLE:
        assert modes.PREFILL_TABLE[op][-1][0] >= 1 << 62, "the last row must catch everything"


@pytest.mark.parametrize("mode", ("decode", "prefill"))
def test_shape_defaults(mode):
    shape = QKNormShape.defaults(mode)
    assert (shape.q_heads, shape.k_heads, shape.head_dim, shape.dtype) == (32, 8, 128, "bf16")
    assert config_for(shape, sms=SMS).mode == mode


def test_shape_defaults_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        QKNormShape.defaults("fast")


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("d,dtype", [(128, "bf16"), (64, "fp32"), (256, "fp16")])
def test_candidates(tokens, d, dtype):
    shape = QKNormShape(tokens, 32, 4, d, dtype)
    cfg = config_for(shape, sms=SMS)
    cands = candidates(shape, sms=SMS)
    assert cfg in cands and len(set(cands)) == len(cands)
    assert {c.mode for c in cands} == {cfg.mode}
    assert len(cands) == (1 if cfg.mode == "decode" else 3 * 3 * 3)  # warps x heads per group x hints
    for c in cands:
        c.validate()
        assert (c.dtype, c.head_dim, c.q_heads, c.k_heads) == (dtype, d, 32, 4)


@pytest.mark.parametrize("tokens", (1, 4097))
def test_rope_is_compiled_in_and_its_tables_take_q_dtype_or_fp32(tokens):
    for dtype, table in (("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp32"), ("fp32", "fp32")):
        plain = config_for(QKNormShape(tokens, dtype=dtype), sms=SMS)
        roped = config_for(QKNormShape(tokens, dtype=dtype, rope=table), sms=SMS)
        assert roped == dataclasses.replace(plain, rope=table) and f"rope={table}" in roped.variant().key()
        assert "rope" not in plain.variant().key()
        cands = candidates(QKNormShape(tokens, dtype=dtype, rope=table), sms=SMS)
        assert {c.rope for c in cands} == {table} and roped in cands
        if roped.mode == "prefill":  # no 1024-thread block of several heads a thread group: they spill
            assert len(cands) == 3 * 3 * 3 - 2 * 3 and not any(c.warps == 32 and c.rows_per_thread > 1 for c in cands)
    assert QKNormShape(tokens, rope="none") == QKNormShape(tokens)  # one spelling: the tuned store keys on it
    for dtype, table in (("bf16", "fp16"), ("fp32", "bf16"), ("bf16", "int8")):
        with pytest.raises(ValueError, match="rope tables"):
            dataclasses.replace(config_for(QKNormShape(tokens, dtype=dtype), sms=SMS), rope=table)


def test_size_range():
    """The token counts a workload tests a config on: all of decode, the first ones of prefill."""
    def mode_of(tokens):
        return config_for(QKNormShape(tokens), sms=SMS).mode
    assert modes.size_range("decode", mode_of) == (1, 6)
    lo, hi = modes.size_range("prefill", mode_of)
    assert (lo, hi) == (7, 2 * 7 + 64)


def test_a_weight_dtype_equal_to_the_input_dtype_is_spelled_once():
    # The op names the weight dtype; sip-tune's default shape leaves it None: both must be one
    # problem, or a tuned-config entry stored for one is never found for the other.
    assert plan.QKNormShape(5, weight_dtype="bf16") == plan.QKNormShape(5)
    assert plan.QKNormShape(5, dtype="fp16", weight_dtype="fp32").weight_dtype == "fp32"
