"""rmsnorm's fused FP8 output (fp8=True): the norm, then e4m3 with its scales per row or per 1 x 128 group, in
one launch. Compiles with the SASS that makes it (CPU), the plan's variants (CPU), argument errors before any
launch (CPU), numerics against the float64 norm quantized (GPU). The rest of rmsnorm: test_rmsnorm.py."""
import dataclasses
import math
import re

import pytest
import torch

import rosekernels
from kernel_sass import sass_of
from rosekernels import fp8
from rosekernels.kernels import rmsnorm as rms
from rosekernels.kernels import rmsnorm_plan as plan
from rosekernels.models import ModelDims

BF16, FP16, FP32, E4M3 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# CPU: the plan and the compiles.

def test_the_option_keeps_the_other_keys_and_validates():
    cfg = plan.config_for(plan.RMSNormShape(1, 4096), 132)
    assert cfg.fp8 == "none" and "fp8" not in cfg.variant().key()
    quant = plan.config_for(plan.RMSNormShape(1, 4096, fp8="group"), 132)
    assert "fp8=group" in quant.variant().key() and quant.fp8_group == 128
    assert plan.RMSNormConfig.from_variant(quant.variant()) == quant
    for fp8_kind, hidden, match in [("row", 136, "multiples of 16"), ("group", 2880, "does not divide"),
                                    ("block", 4096, "fp8 must be one of")]:
        with pytest.raises(ValueError, match=match):
            plan.config_for(plan.RMSNormShape(1, hidden, fp8=fp8_kind), 132)


def test_variants_for_models_run_in_fp8():
    m = ModelDims("m", 4096, 12288, 32, 8, 128)
    assert {c.fp8 for c in plan.variants_for([m])} == {"none"}
    assert {c.fp8 for c in plan.variants_for([dataclasses.replace(m, fp8="block")])} == {"none", "group"}
    found = plan.variants_for([dataclasses.replace(m, fp8="channel")])
    assert {(c.fp8, c.residual) for c in found} == {(f, r) for f in ("none", "row") for r in (False, True)}
    odd = dataclasses.replace(m, hidden=2880, fp8="block")  # 2880 = 22.5 groups: its norms stay bf16
    assert {c.fp8 for c in plan.variants_for([odd])} == {"none"}


_COMPILED = [plan.config_for(plan.RMSNormShape(rows, hidden, dt, None, res, fp8=q), 132)
             for rows, hidden, dt, res, q in [(1, 4096, "bf16", True, "row"), (1, 4096, "bf16", False, "group"),
                                              (4096, 4096, "bf16", True, "group"), (4096, 16384, "bf16", False, "row"),
                                              (3, 2048, "fp32", False, "row"), (5, 5120, "fp16", True, "group")]]


@pytest.mark.parametrize("cfg", _COMPILED, ids=lambda c: c.variant().key())
def test_compiles_with_e4m3_stores(fresh_cache, cfg, tmp_path):
    kernel = rms.compile(cfg)
    sass = sass_of(kernel, tmp_path)
    if sass is None:
        pytest.skip("nvdisasm not found: compiled, SASS not inspected")
    ops = re.findall(r"^\s*/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    assert any(o.startswith("F2FP.SATFINITE.E4M3.F32") for o in ops), "no saturating e4m3 conversion"
    assert not {"LDL", "STL"} & set(ops), "register spills"
    vec = 16 // {"bf16": 2, "fp16": 2, "fp32": 4}[cfg.dtype]
    stores = [o for o in ops if o.startswith("STG")]
    assert ops.count("STG.E.64" if vec == 8 else "STG.E") >= cfg.vecs_per_thread, stores  # e4m3 vectors
    if cfg.residual:
        assert "STG.E.128" in ops  # the new residual, in the input dtype
    if cfg.fp8 == "group":
        assert "SHFL.BFLY" in ops


# ---------------------------------------------------------------------------------------------
# CPU: argument errors.

@pytest.fixture
def no_launch(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("validation should have failed before compiling/launching")
    monkeypatch.setattr(rms, "compile", fail)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(fp8=True), ValueError, "CUDA"),
    (dict(fp8=True, group_size=128), ValueError, "CUDA"),
    (dict(group_size=128), ValueError, "pass fp8=True"),
    (dict(fp8=True, group_size=64), ValueError, "group_size must be None"),
    (dict(fp8=True, out=torch.zeros(4, 256, dtype=BF16)), TypeError, "out has dtype"),
    (dict(fp8=True, scales=torch.zeros(4, 2)), ValueError, "scales must be a tensor of shape \\[4\\]"),
    (dict(fp8=True, group_size=128, scales=torch.zeros(4)), ValueError, "shape \\[4, 2\\]"),
    (dict(fp8=True, scales=torch.zeros(4, dtype=BF16)), TypeError, "scales has dtype"),
    (dict(fp8=True, scales=torch.zeros(1).expand(4)), ValueError, "expanded"),
])
def test_argument_errors(no_launch, kwargs, error, match):
    x, w = torch.randn(4, 256).to(BF16), torch.ones(256, dtype=BF16)
    with pytest.raises(error, match=match):
        rosekernels.rmsnorm(x, w, **kwargs)


def test_hidden_sizes_the_option_does_not_take(no_launch):
    with pytest.raises(ValueError, match="does not divide"):
        rosekernels.rmsnorm(torch.randn(4, 2880).to(BF16), torch.ones(2880, dtype=BF16), fp8=True, group_size=128)
    with pytest.raises(ValueError, match="multiples of 16"):
        rosekernels.rmsnorm(torch.randn(4, 136).to(BF16), torch.ones(136, dtype=BF16), fp8=True)


def test_a_planned_signature_still_refuses_scales_whose_rows_overlap(monkeypatch):
    """The fast path of a planned signature skips the full checks; group scales whose rows overlap (which
    the compiled host checks let through) must not take it (CPU: the launch stubbed)."""
    import rosekernels.ops.rmsnorm as op
    from stub_launch import stub_launches

    launches = stub_launches(monkeypatch, rms, op)
    x, w = torch.randn(4, 256).to(BF16), torch.ones(256, dtype=BF16)
    rosekernels.rmsnorm(x, w, fp8=True, group_size=128)
    assert len(launches) == 1
    with pytest.raises(ValueError, match="scales's elements overlap"):
        rosekernels.rmsnorm(x, w, fp8=True, group_size=128, scales=torch.empty(5).as_strided((4, 2), (1, 1)))
    assert len(launches) == 1


@pytest.mark.parametrize("case", ["out on x", "scales on x", "scales on out"])
def test_outputs_overlapping_x_or_each_other_are_refused(monkeypatch, case):
    """Also on a planned signature, whose fast path tests only the addresses (CPU: the launch stubbed)."""
    import rosekernels.ops.rmsnorm as op
    from stub_launch import stub_launches

    launches = stub_launches(monkeypatch, rms, op)
    w = torch.ones(256, dtype=BF16)
    mem = torch.zeros(4096, dtype=torch.uint8)
    x = mem[:2048].view(BF16).view(4, 256)
    rosekernels.rmsnorm(x, w, fp8=True, group_size=128)
    out = (mem[1024:2048] if case == "out on x" else mem[2048:3072]).view(E4M3).view(4, 256)
    scales = {"out on x": None, "scales on x": mem[2016:2048], "scales on out": mem[3040:3072]}[case]
    with pytest.raises(ValueError, match=case.replace(" on ", " must not overlap ")):
        rosekernels.rmsnorm(x, w, fp8=True, group_size=128, out=out,
                            scales=None if scales is None else scales.view(FP32).view(4, 2))
    assert len(launches) == 1


def test_meta_tensors(no_launch):
    x, r = torch.empty(2, 3, 512, device="meta", dtype=BF16), torch.empty(2, 3, 512, device="meta", dtype=BF16)
    q, s, h = rosekernels.rmsnorm(x, torch.empty(512, device="meta", dtype=BF16), residual=r, fp8=True,
                                  group_size=128)
    assert q.dtype == E4M3 and q.shape == x.shape and s.shape == (2, 3, 4) and h.shape == x.shape


# ---------------------------------------------------------------------------------------------
# GPU: the norm quantized, against its float64 reference.

def _case(rows, hidden, dtype, residual, group, seed=0, pad=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, hidden + pad, generator=g, device="cuda") * 2).to(dtype)[:, :hidden]
    if rows > 2:
        x[1] = 0  # a zero row: zeros, the floor's scale
    w = (torch.randn(hidden, generator=g, device="cuda") * 0.2 + 1).to(dtype)
    r = torch.randn(rows, hidden, generator=g, device="cuda").to(dtype) if residual else None
    q = torch.full((rows, hidden), 0x7F, dtype=torch.uint8, device="cuda").view(E4M3)  # NaN-poisoned
    scales = torch.full((rows, hidden // group) if group else (rows,), math.nan, device="cuda")
    got = rosekernels.rmsnorm(x, w, residual=r, out=q, fp8=True, group_size=group, scales=scales)
    assert got[0] is q and got[1] is scales
    ref_out, ref_h = rms.reference(x, w, 1e-6, r)
    fp8.check_quantized(ref_out, q, scales, group or 0, rel=1e-5)
    if residual:
        h = got[2]
        assert h.dtype == dtype and rms.checks.relative_error(h, ref_h) <= rms.tolerance(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("rows, hidden", [(1, 4096), (7, 2048), (4097, 4096), (300, 5120), (3, 16384), (64, 128)])
def test_matches_the_reference(rows, hidden, residual, group):
    _case(rows, hidden, BF16, residual, group, seed=rows)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP16, FP32], ids=str)
def test_other_input_dtypes_and_strided_rows(dtype):
    for rows in (2, 1000):
        _case(rows, 4096, dtype, True, 128, seed=rows, pad=64)
        _case(rows, 1024, dtype, False, None, seed=rows)


@pytest.mark.gpu
def test_quantizes_as_quantize_fp8_does():
    """The fused output equals quantize_fp8 of the norm's fp32 values wherever those round alike: against
    quantize_fp8 of the bf16 norm, the scales agree to the bf16 rounding of the amax."""
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(33, 4096, generator=g, device="cuda").to(BF16)
    w = torch.ones(4096, dtype=BF16, device="cuda")
    q, s = rosekernels.rmsnorm(x, w, fp8=True, group_size=128)
    q2, s2 = rosekernels.quantize_fp8(rosekernels.rmsnorm(x, w), 128)
    assert torch.allclose(s, s2, rtol=2 ** -8)
    assert (q.float() - q2.float()).abs().max() <= 2 * 32  # at most a step of the largest binade apart


@pytest.mark.gpu
def test_workload():
    m = ModelDims("m", 4096, 12288, 32, 8, 128, fp8="block")
    for cfg in [c for c in rms.variants_for([m, dataclasses.replace(m, fp8="channel")]) if c.fp8 != "none"]:
        shape = rms.Shape(rms.Shape.defaults(cfg.mode).rows, cfg.hidden, cfg.dtype, cfg.weight_dtype, cfg.residual,
                          cfg.eps, fp8=cfg.fp8)
        w = rms.workload(cfg, shape)
        for args in (w.make_args(1), w.sample(2)):
            w.run(w.kernel.fn, args)
            torch.cuda.synchronize()
            w.check(args)


def test_the_op_level_case_times_the_fused_output():
    """sip-tune's op-level timing of an fp8 rmsnorm shape calls the op with the e4m3 output and its scales."""
    from sip_tune import oplevel

    case = oplevel.CASES["rmsnorm"](plan.RMSNormShape(4, 256, residual=True, fp8="group"))
    s = case.make_set(1, "cpu")
    assert s[3].dtype == E4M3 and s[5].shape == (4, 2) and case.peers == {}
    assert case.input_bytes(s) == sum(t.nbytes for t in s[:3])
