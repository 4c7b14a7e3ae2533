"""The MoE plan modules on the CPU, without CuTeDSL: configs, the modes at their boundaries, shapes,
the tuner's candidates, the warm-up set, the grid and the token counts a workload tests."""
import dataclasses
import subprocess
import sys

import pytest

from rosekernels import modes
from rosekernels.kernels import moe_combine_plan as cp
from rosekernels.kernels import moe_dispatch_plan as dp
from rosekernels.models import QWEN3_8B, QWEN3_30B_A3B

# Today's warm-up set (variant keys: the disk caches and the tuned store are keyed by them).
DISPATCH_KEYS = {
    "moe_dispatch-decode-sm_90a-dtype=bf16-experts=128-hidden=2048-threads=1024-topk=8-unroll=4",
    "moe_dispatch-prefill-sm_90a-dtype=bf16-experts=128-hidden=2048-threads=1024-topk=8-unroll=4",
    "moe_dispatch-decode-sm_90a-dtype=bf16-experts=256-hidden=7168-threads=1024-topk=8-unroll=4",
    "moe_dispatch-prefill-sm_90a-dtype=bf16-experts=256-hidden=7168-threads=1024-topk=8-unroll=4",
}
COMBINE_KEYS = {
    f"moe_combine-{mode}-sm_90a-dtype=bf16-hidden={h}-threads={threads}-topk=8-wdtype={w}"
    for mode, threads in (("decode", 128), ("prefill", 256)) for h in (2048, 7168) for w in ("bf16", "fp32")
}


def test_plans_import_without_cutedsl():
    code = ("import sys; sys.modules['cutlass'] = None; "
            "import rosekernels.kernels.moe_dispatch_plan, rosekernels.kernels.moe_combine_plan")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_variants_for_none_is_the_warmup_set():
    dispatch, combine = dp.variants_for(), cp.variants_for()
    assert len(dispatch) == 4 and len(combine) == 8
    assert {c.variant().key() for c in dispatch} == DISPATCH_KEYS
    assert {c.variant().key() for c in combine} == COMBINE_KEYS
    for cfg in dispatch:
        assert dp.DispatchConfig.from_variant(cfg.variant()) == cfg
    for cfg in combine:
        assert cp.CombineConfig.from_variant(cfg.variant()) == cfg


def test_variants_for_models():
    assert dp.variants_for([QWEN3_8B]) == [] and cp.variants_for([QWEN3_8B]) == []  # dense: no MoE
    qwen = {c.variant().key() for c in dp.variants_for([QWEN3_8B, QWEN3_30B_A3B])}
    assert qwen == {k for k in DISPATCH_KEYS if "experts=128-hidden=2048" in k}
    decode = cp.variants_for([QWEN3_30B_A3B], modes=("decode",))
    assert {c.variant().key() for c in decode} == {k for k in COMBINE_KEYS if "decode" in k and "hidden=2048" in k}
    fp16 = dataclasses.replace(QWEN3_30B_A3B, dtype="fp16")
    assert {(c.dtype, c.weight_dtype) for c in cp.variants_for([fp16])} == {("fp16", "fp32"), ("fp16", "fp16")}


@pytest.mark.parametrize("topk", [1, 3, 8, 64])
def test_dispatch_mode_boundary(topk):
    last = dp.DECODE_MAX_PAIRS // topk  # the most tokens the decode variant takes by default
    for tokens, mode in ((1, "decode"), (last, "decode"), (last + 1, "prefill"), (100_000, "prefill")):
        assert dp.choose_mode(tokens, topk) == mode
        assert dp.config_for(dp.DispatchShape(tokens, topk=topk)).mode == mode
    assert dp.DECODE_PAIRS_LIMIT >= dp.DECODE_MAX_PAIRS  # the default decode config takes every decode size


def test_combine_mode_boundary():
    for tokens, mode in ((1, "decode"), (cp.DECODE_MAX_TOKENS, "decode"), (cp.DECODE_MAX_TOKENS + 1, "prefill")):
        assert cp.choose_mode(tokens) == mode
        cfg = cp.config_for(cp.CombineShape(tokens))
        assert cfg.mode == mode and cfg.threads == cp.THREADS[mode]


def test_shape_defaults():
    for shape_type in (dp.DispatchShape, cp.CombineShape):
        assert shape_type.defaults("decode").tokens == 128 and shape_type.defaults("prefill").tokens == 4096
        with pytest.raises(ValueError, match="mode must be"):
            shape_type.defaults("fast")
    assert dp.DispatchShape.defaults("decode") == dp.DispatchShape(128, 2048, 128, 8, "bf16")
    assert cp.CombineShape.defaults("prefill") == cp.CombineShape(4096, 2048, 8, "bf16", "fp32")
    assert dp.config_for(dp.DispatchShape.defaults("decode")).mode == "decode"
    assert cp.config_for(cp.CombineShape.defaults("prefill")).mode == "prefill"


def test_config_checks():
    with pytest.raises(ValueError, match=r"dtype must be one of \['bf16', 'fp16', 'fp32'\]"):
        dp.DispatchConfig("i32", 2048, 8, 2, "decode")
    with pytest.raises(ValueError, match="multiple of 4"):
        dp.DispatchConfig("fp32", 2050, 8, 2, "decode")
    with pytest.raises(ValueError, match=r"num_experts must be in \[1, 256\]"):
        dp.DispatchConfig("bf16", 2048, 257, 2, "decode", threads=256)
    with pytest.raises(ValueError, match="weight dtype must be fp32 or bf16"):
        cp.CombineConfig("bf16", "fp16", 2048, 8, "decode")
    with pytest.raises(ValueError, match="mode must be"):
        cp.CombineConfig("bf16", "fp32", 2048, 8, "fast")


@pytest.mark.parametrize("shape", [
    dp.DispatchShape(1), dp.DispatchShape(128), dp.DispatchShape(256), dp.DispatchShape(4096),
    dp.DispatchShape(3, 7168, 256, 8), dp.DispatchShape(5000, 64, 1024, 1, "fp32"), dp.DispatchShape(700, 2880, 8, 3),
], ids=repr)
def test_dispatch_candidates(shape):
    pick = dp.config_for(shape)
    found = dp.candidates(shape)
    assert pick in found
    assert len({c.variant().key() for c in found}) == len(found)  # distinct kernels
    for cfg in found:
        assert cfg.mode == pick.mode and cfg.threads >= shape.experts
        assert cfg.threads * cfg.unroll <= dp.MAX_VECS_PER_CTA  # no spills
        assert (cfg.hidden, cfg.num_experts, cfg.topk, cfg.dtype) == (shape.hidden, shape.experts, shape.topk,
                                                                       shape.dtype)
        if cfg.mode == "decode":  # it serves every size of the decode mode
            assert cfg.decode_pairs_limit >= dp.DECODE_MAX_PAIRS
        assert dp.DispatchConfig.from_variant(cfg.variant()) == cfg
    if shape.experts == 1024:
        assert {c.threads for c in found} == {1024}


@pytest.mark.parametrize("shape", [
    cp.CombineShape(1), cp.CombineShape(4096), cp.CombineShape(300, 2880, 6, "fp16", "fp16"),
], ids=repr)
def test_combine_candidates(shape):
    pick = cp.config_for(shape)
    found = cp.candidates(shape)
    assert pick in found
    assert len({c.variant().key() for c in found}) == len(found) > 1
    assert all(c.mode == pick.mode and cp.CombineConfig.from_variant(c.variant()) == c for c in found)


def test_num_ctas():
    decode = dp.DispatchConfig("bf16", 2048, 128, 8, "decode")  # 256 vectors per token
    prefill = dataclasses.replace(decode, mode="prefill")
    assert dp.num_ctas(decode, 0, 132) == 1
    assert dp.num_ctas(decode, 1, 132) == 1
    assert dp.num_ctas(decode, 5, 132) == 5
    assert dp.num_ctas(decode, 256, 132) == 132  # at most one CTA per SM
    assert dp.num_ctas(prefill, 100, 132) == 100  # one CTA per token
    assert dp.num_ctas(prefill, 4096, 78) == 78


def test_capacity_and_meta():
    assert dp.default_capacity(1, 8, 128, 128) == 8 + 8 * 127  # only non-empty experts are padded
    assert dp.default_capacity(4096, 8, 128, 128) == 4096 * 8 + 128 * 127
    assert dp.default_capacity(0, 8, 128, 128) == 0
    assert dp.meta_layout(5) == {"counts": 0, "offsets": 5, "overflow": 11, "invalid": 12, "size": 13}


@pytest.mark.parametrize("topk", [1, 2, 3, 6, 8, 64])
def test_token_range_is_the_modes_size_range(topk):
    """A workload tests every token count of decode and the first ones of prefill (the rule every
    kernel's test_args follows, rosekernels.modes.size_range)."""
    for mode in ("decode", "prefill"):
        cfg = dp.DispatchConfig("bf16", 2048, 128, topk, mode)
        assert dp.token_range(cfg) == modes.size_range(mode, lambda t: dp.choose_mode(t, topk))
        ccfg = cp.CombineConfig("bf16", "fp32", 2048, topk, mode)
        assert cp.token_range(ccfg) == modes.size_range(mode, cp.choose_mode)
    small = dp.DispatchConfig("bf16", 2048, 128, topk, "decode", threads=128)  # a forced config: its own limit
    assert dp.token_range(small) == (1, 1024 // topk)
