"""rmsnorm planning on the CPU, without CuTeDSL: config selection, candidates, the warm-up list."""
import subprocess
import sys

import pytest

from rosekernels import checks, modes
from rosekernels.kernels import rmsnorm_plan as plan
from rosekernels.kernels.rmsnorm_plan import RMSNormConfig, RMSNormShape, candidates, config_for, variants_for
from rosekernels.models import QWEN3_8B, QWEN3_30B_A3B, ModelDims

SMS = 132
DTYPE_PAIRS = (("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"), ("fp16", "fp32"), ("fp32", "fp32"))
HIDDEN = (64, 136, 2048, 2880, 4096, 5120, 8192, 16384)


def test_imports_without_cutlass():
    code = ("import sys; sys.modules['cutlass'] = None\n"
            "from rosekernels.kernels import rmsnorm_plan as p\n"
            "assert len(p.variants_for()) == 80 and p.config_for(p.RMSNormShape(1)).mode == 'decode'\n"
            "assert 'rosekernels.jit' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_default_variants():
    """variants_for() is the warm-up set the library always listed (variant keys are cache keys)."""
    configs = variants_for()
    keys = {c.variant().key() for c in configs}
    assert len(configs) == len(keys) == 80  # 4 hidden sizes x 5 dtype pairs x 2 residual x 2 modes
    assert {c.hidden for c in configs} == set(plan.MODEL_HIDDEN)
    assert {(c.dtype, c.weight_dtype) for c in configs} == set(DTYPE_PAIRS)
    for key in (
        "rmsnorm-decode-sm_90a-cache_hint=none-dtype=bf16-eps=1e-06-hidden=4096-residual=False-warps=1"
        "-weight_dtype=bf16",
        "rmsnorm-prefill-sm_90a-cache_hint=none-dtype=fp16-eps=1e-06-hidden=5120-residual=True-warps=8"
        "-weight_dtype=fp32",
        "rmsnorm-prefill-sm_90a-cache_hint=none-dtype=fp32-eps=1e-06-hidden=8192-residual=False-warps=8"
        "-weight_dtype=fp32",
    ):
        assert key in keys, key
    decode, prefill = variants_for(modes=("decode",)), variants_for(modes=("prefill",))
    assert len(decode) == len(prefill) == 40
    assert {c.mode for c in decode} == {"decode"} and {c.mode for c in prefill} == {"prefill"}
    assert set(decode) | set(prefill) == set(configs)


def test_variants_for_models():
    configs = variants_for([QWEN3_8B, QWEN3_30B_A3B])
    assert len(configs) == len(set(configs)) == 2 * 2 * 2 * 2  # hidden sizes x weight dtypes x residual x modes
    assert {(c.hidden, c.dtype) for c in configs} == {(4096, "bf16"), (2048, "bf16")}
    assert {(c.weight_dtype, c.residual) for c in configs} == {(w, r) for w in ("bf16", "fp32") for r in (False, True)}
    assert set(configs) <= set(variants_for())
    assert variants_for([ModelDims("wide", 32768, 65536, 64, 8, 512)]) == []  # past MAX_HIDDEN


def test_variants_cover_config_for():
    """What rmsnorm() picks for any row count of the default hidden sizes is in variants_for()."""
    listed = set(variants_for())
    for n in plan.MODEL_HIDDEN:
        for rows in (1, 31, 128, 1000, 4097, 65536):
            for dt, wdt in DTYPE_PAIRS:
                for residual in (False, True):
                    assert config_for(RMSNormShape(rows, n, dt, wdt, residual)) in listed


def test_config_geometry():
    for n in HIDDEN:
        for dt in ("bf16", "fp16", "fp32"):
            if n % checks.vector_elems(dt):
                continue
            for rows in (1, 100000):
                cfg = config_for(RMSNormShape(rows, n, dt))
                assert RMSNormConfig.from_variant(cfg.variant()) == cfg
                cfg.validate()
                tpr = cfg.threads_per_row
                assert tpr & (tpr - 1) == 0 and cfg.vecs_per_thread <= plan.MAX_VECS_PER_THREAD
                assert tpr * cfg.vecs_per_thread >= cfg.vecs > tpr * (cfg.vecs_per_thread - 1)
                assert cfg.block_warps * 32 % tpr == 0 and cfg.block_warps <= 32
    assert config_for(RMSNormShape(1)).mode == "decode"
    assert config_for(RMSNormShape(4096)).mode == "prefill"


def test_mode_selection():
    # hidden 4096 bf16: 512 vectors per row, 64 threads of 8 vectors: 2 warps per row
    assert config_for(RMSNormShape(SMS // 2), sms=SMS).mode == "decode"
    assert config_for(RMSNormShape(SMS // 2 + 1), sms=SMS).mode == "prefill"


@pytest.mark.parametrize("mode", ("decode", "prefill"))
def test_shape_defaults(mode):
    shape = RMSNormShape.defaults(mode)
    assert (shape.hidden, shape.dtype, shape.residual) == (4096, "bf16", False)
    assert config_for(shape, sms=SMS).mode == mode


def test_shape_defaults_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        RMSNormShape.defaults("fast")


@pytest.mark.parametrize("rows", (1, 64, 132, 133, 4096, 65536))
@pytest.mark.parametrize("hidden,dtype,residual", [(4096, "bf16", False), (2880, "fp16", True), (16384, "fp32", False)])
def test_candidates(rows, hidden, dtype, residual):
    shape = RMSNormShape(rows, hidden, dtype, residual=residual)
    cfg = config_for(shape, sms=SMS)
    cands = candidates(shape, sms=SMS)
    assert cfg in cands and len(set(cands)) == len(cands)
    assert {c.mode for c in cands} == {cfg.mode}
    assert len(cands) == (1 if cfg.mode == "decode" else 3 * 3)  # warps x cache hints
    for c in cands:
        c.validate()
        assert (c.hidden, c.dtype, c.residual) == (hidden, dtype, residual)


def test_size_range():
    """The row counts a workload tests a config on: all of decode, the first ones of prefill."""
    def mode_of(rows):
        return config_for(RMSNormShape(rows), sms=SMS).mode
    assert modes.size_range("decode", mode_of) == (1, 66)
    assert modes.size_range("prefill", mode_of) == (67, 2 * 67 + 64)


def test_a_weight_dtype_equal_to_the_input_dtype_is_spelled_once():
    assert plan.RMSNormShape(5, weight_dtype="bf16") == plan.RMSNormShape(5)
