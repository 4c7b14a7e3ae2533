"""FP8 quantization: the math (rosekernels.fp8, quantize_weight_fp8) against float64 on the CPU; the
quantize_fp8 kernel's plan (CPU), its compiles with SASS checks (CPU), argument errors before any launch
(CPU), and its numerics against the float64 reference (GPU)."""
import dataclasses
import math
import re

import pytest
import torch

import rosekernels
from kernel_sass import sass_of
from rosekernels import fp8
from rosekernels.kernels import quantize_fp8 as qk
from rosekernels.kernels import quantize_fp8_plan as plan
from rosekernels.models import ModelDims

BF16, FP16, FP32, E4M3 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# CPU: the quantization math.

def _steps_off(x, q, scale):
    """|q - x / scale| in half-steps of e4m3 at the value (the step of its binade, or the subnormals')."""
    scaled = x.double() / scale
    step = torch.exp2(torch.floor(torch.log2(scaled.abs().clamp_min(2.0 ** -6))) - 3)
    return (q.double() - scaled).abs() / (0.5 * step)


@pytest.mark.parametrize("blocks", [(None, None), (1, None), (1, 128), (128, 128)])
def test_quantize_rounds_each_block_to_the_nearest_e4m3(blocks):
    """Against an element-by-element float64 quantization: the scales are the blocks' amax / 448, each q
    the nearest e4m3 of x / scale (within fp32's rounding of the product), the block's amax lands on 448."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 520, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-20, 20, (300, 1),
                                                                                          generator=g))
    q, scales = fp8.quantize(x, *blocks)
    br, bc = blocks[0] or 300, blocks[1] or 520
    for i0 in range(0, 300, br):
        for j0 in range(0, 520, bc):
            block = x[i0:i0 + br, j0:j0 + bc]
            want = block.abs().max().item() / 448.0
            got = scales.reshape(-(-300 // br), -(-520 // bc))[i0 // br, j0 // bc].item()
            assert got == pytest.approx(want, rel=1e-6)
            assert (_steps_off(block, q[i0:i0 + br, j0:j0 + bc], got) <= 1 + 1e-5).all()
            assert q[i0:i0 + br, j0:j0 + bc].float().abs().max().item() == 448.0
    d = fp8.dequantize(q, scales, *blocks)
    assert ((d - x).abs() <= x.abs() * 2.0 ** -4 + 2.0 ** -10 * scales.max().double()).all()


def test_quantize_saturates_and_handles_zero_and_equal_rows():
    x = torch.zeros(4, 256)
    x[1] = 3.5  # all equal: every element is the amax
    x[2, 0], x[2, 1:] = 1e30, -1e-30  # a huge and tiny values in one row: tiny ones flush to zero
    x[3] = torch.linspace(-448.0, 448.0, 256) * 7
    q, scales = fp8.quantize(x, 1, None)
    assert torch.isfinite(q.float()).all() and q.float().abs().max() <= 448
    assert (q[0].float() == 0).all() and scales[0].item() == pytest.approx(fp8.AMAX_FLOOR / 448.0)
    assert (q[1].float() == 448.0).all() and scales[1].item() == pytest.approx(3.5 / 448.0)
    assert q[2, 0].float() == 448.0 and (q[2, 1:].float() == 0).all()
    assert q[3, 0].float() == -448.0 and q[3, -1].float() == 448.0
    # x exactly at the limits of a block scaled by 1: q is x.
    y = torch.tensor([[448.0, -448.0, 2.0 ** -9, 0.0] + [1.0] * 12])
    qy, sy = fp8.quantize(y, 1, None)
    assert sy.item() == 1.0 and torch.equal(qy.float(), y)


@pytest.mark.parametrize("scheme, shape", [("tensor", (1,)), ("channel", (200,)), ("block", (2, 3))])
def test_quantize_weight_fp8(scheme, shape):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(200, 264, generator=g) * 0.02).to(BF16)
    q, scales = rosekernels.quantize_weight_fp8(w, scheme)
    assert q.dtype == E4M3 and q.shape == w.shape and scales.dtype == FP32 and scales.shape == shape
    blocks = fp8.WEIGHT_SCHEMES[scheme]
    d = fp8.dequantize(q, scales, *blocks)
    assert ((d - w.double()).abs() <= w.double().abs() * 2.0 ** -4 + 2.0 ** -10 * scales.max().double()).all()
    assert (q.float().abs().max() == 448.0)


def test_quantize_weight_fp8_saturates_float64_beyond_fp32_and_takes_empty_weights():
    """float64 values past fp32's range saturate (q +-448, a finite scale), never inf or NaN; an empty weight
    gets the scales of its scheme's shape, per tensor the one scale of an all-zero block."""
    w = torch.zeros(4, 256, dtype=torch.float64)
    w[0, 0], w[1, 0], w[2, :] = 1e300, -1e39, 1.0
    for scheme in fp8.WEIGHT_SCHEMES:
        q, scales = rosekernels.quantize_weight_fp8(w, scheme)
        assert torch.isfinite(q.float()).all() and torch.isfinite(scales).all(), scheme
        assert q[0, 0].float() == 448.0 and q[1, 0].float() == -448.0, scheme
    for scheme, rows, cols, shape in (("tensor", 0, 256, (1,)), ("channel", 0, 256, (0,)), ("block", 0, 256, (0, 2)),
                                      ("tensor", 3, 0, (1,)), ("channel", 3, 0, (3,)), ("block", 3, 0, (1, 0))):
        q, scales = rosekernels.quantize_weight_fp8(torch.zeros(rows, cols), scheme)
        assert q.shape == (rows, cols) and scales.shape == shape, (scheme, rows, cols)
        assert scales.flatten().tolist() == pytest.approx([fp8.AMAX_FLOOR / fp8.E4M3_MAX] * scales.numel())
        assert fp8.dequantize(q, scales, *fp8.WEIGHT_SCHEMES[scheme]).shape == (rows, cols)


def test_quantize_weight_fp8_errors():
    with pytest.raises(ValueError, match="scheme must be one of"):
        rosekernels.quantize_weight_fp8(torch.zeros(8, 16), "row")
    with pytest.raises(ValueError, match="2-D floating-point"):
        rosekernels.quantize_weight_fp8(torch.zeros(8, 16, 2))
    with pytest.raises(ValueError, match="2-D floating-point"):
        rosekernels.quantize_weight_fp8(torch.zeros(8, 16, dtype=torch.int32))


def test_the_check_can_fail():
    """The GPU tests' check accepts the reference's own quantization and refuses one step off, a wrong
    scale and an unwritten element."""
    x = torch.randn(3, 256, dtype=torch.float64)
    for group in (0, 128):
        q, scales = qk.reference(x, group)
        fp8.check_quantized(x, q, scales.float(), group)
        # One step toward zero at row 1's amax, always +-448: a step up from there is the NaN code.
        bumped = q.view(torch.uint8).clone()
        bumped[1, q[1].float().abs().argmax()] -= 1
        with pytest.raises(AssertionError, match="half-steps"):
            fp8.check_quantized(x, bumped.view(E4M3), scales.float(), group)
        with pytest.raises(AssertionError, match="scales differ"):
            fp8.check_quantized(x, q, scales.float() * 1.001, group)
        poisoned = q.view(torch.uint8).clone()
        poisoned[2, 3] = 0x7F
        with pytest.raises(AssertionError, match="NaN"):
            fp8.check_quantized(x, poisoned.view(E4M3), scales.float(), group)


# ---------------------------------------------------------------------------------------------
# CPU: the plan.

def test_plan_geometry_and_checks():
    c = plan.config_for(plan.QuantizeShape(1, 4096, "bf16", 128), 132)
    assert (c.mode, c.threads_per_row, c.vecs_per_thread, c.group_lanes) == ("decode", 64, 8, 16)
    c = plan.config_for(plan.QuantizeShape(8192, 18944, "bf16", 0), 132)
    assert c.mode == "prefill" and c.threads_per_row == 512 and c.rows_per_block == 1
    assert plan.config_for(plan.QuantizeShape(1, 32768), 132).threads_per_row == 512
    with pytest.raises(ValueError, match="too long"):
        plan.check_hidden(65536, "bf16", 0)
    assert {c.warps for c in plan.candidates(plan.QuantizeShape(8192, 4096), 132)} == {8, 16}
    with pytest.raises(ValueError, match="does not divide"):
        plan.config_for(plan.QuantizeShape(1, 4112, group=128), 132)
    with pytest.raises(ValueError, match="multiple of 16"):
        plan.check_hidden(4100, "bf16", 0)
    with pytest.raises(ValueError, match="too long"):
        plan.check_hidden(32768, "fp32", 0)
    with pytest.raises(ValueError, match="group_size"):
        plan.check_hidden(4096, "bf16", 64)


def test_variants_for_models_run_in_fp8():
    bf16 = ModelDims("m", 4096, 14336, 32, 8, 128)
    assert plan.variants_for([bf16]) == []
    block = plan.variants_for([dataclasses.replace(bf16, fp8="block")], ["decode"])
    assert {(c.hidden, c.group, c.mode) for c in block} == {(4096, 128, "decode"), (14336, 128, "decode")}
    channel = plan.variants_for([dataclasses.replace(bf16, fp8="channel")])
    assert {(c.hidden, c.group) for c in channel} == {(4096, 0), (14336, 0)}
    assert {c.mode for c in channel} == {"decode", "prefill"}


# ---------------------------------------------------------------------------------------------
# CPU: compiles, with the instructions that make it what it is.

_COMPILED = [plan.config_for(plan.QuantizeShape(rows, k, dt, g), 132)
             for rows, k, dt, g in [(1, 4096, "bf16", 0), (1, 4096, "bf16", 128), (4096, 14336, "bf16", 128),
                                    (4096, 18944, "fp16", 0), (7, 2880, "fp32", 0), (4096, 256, "fp32", 128),
                                    (1, 32768, "bf16", 0), (8192, 32768, "bf16", 128)]]
_COMPILED.append(dataclasses.replace(_COMPILED[2], warps=16, cache_hint="evict_first"))


@pytest.mark.parametrize("cfg", _COMPILED, ids=lambda c: c.variant().key())
def test_compiles_with_e4m3_conversions(fresh_cache, cfg, tmp_path):
    kernel = qk.compile(cfg)
    sass = sass_of(kernel, tmp_path)
    if sass is None:
        pytest.skip("nvdisasm not found: compiled, SASS not inspected")
    ops = re.findall(r"^\s*/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    assert any(o.startswith("F2FP.SATFINITE.E4M3.F32") for o in ops), "no saturating e4m3 conversion"
    assert any(o.startswith("LDG.E") and o.endswith(".128") for o in ops), "16-byte loads"
    assert not {"LDL", "STL"} & set(ops), "register spills"
    store = ".64" if cfg.vec == 8 else ""  # one e4m3 store per 16-byte input vector
    assert any(re.fullmatch(rf"STG\.E(\.EF)?{store}", o) for o in ops), sorted(set(ops))
    if cfg.group:
        assert "SHFL.BFLY" in ops


def test_contract():
    assert qk.Config is plan.QuantizeConfig and qk.Shape is plan.QuantizeShape


# ---------------------------------------------------------------------------------------------
# CPU: argument errors before anything is compiled or launched.

@pytest.fixture
def no_launch(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("validation should have failed before compiling/launching")
    monkeypatch.setattr(qk, "compile", fail)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(x=torch.zeros(4, 256, dtype=BF16)), ValueError, "CUDA"),
    (dict(x=torch.zeros(4, 256, dtype=torch.float64)), TypeError, "x has dtype"),
    (dict(x=torch.zeros(4, 200, dtype=BF16)), ValueError, "multiple of 16"),
    (dict(x=torch.zeros(4, 272, dtype=BF16), group_size=128), ValueError, "does not divide K = 272"),
    (dict(x=torch.zeros(4, 256, dtype=BF16), group_size=64), ValueError, "group_size must be None"),
    (dict(x=torch.zeros(4, 256, dtype=BF16), out=torch.zeros(4, 256, dtype=BF16)), TypeError, "q has dtype"),
    (dict(x=torch.zeros(4, 256, dtype=BF16), out=torch.zeros(4, 128, dtype=E4M3)), ValueError, "out must be"),
    (dict(x=torch.zeros(4, 256, dtype=BF16), scales=torch.zeros(4, 2)), ValueError, "scales must be"),
    (dict(x=torch.zeros(4, 256, dtype=BF16), group_size=128, scales=torch.zeros(4)), ValueError, "scales must be"),
    (dict(x=torch.zeros(4, 256, dtype=BF16), scales=torch.zeros(4, dtype=BF16)), TypeError, "scales has dtype"),
    (dict(x=torch.zeros(4, 260, dtype=BF16)[:, :256]), ValueError, "aligned"),
    (dict(x=torch.zeros(2, 3, 128, dtype=BF16), out=torch.zeros(3, 2, 128, dtype=E4M3).transpose(0, 1)), ValueError,
     "out must be viewable as rows"),
    (dict(x=torch.zeros(2, 3, 128, dtype=BF16), scales=torch.zeros(3, 2).t()), ValueError,
     "scales must be viewable as rows"),
    # Scales [M, 1] keep a unit last stride: the kernel's signature wants it.
    (dict(x=torch.zeros(4, 128, dtype=BF16), group_size=128, scales=torch.zeros(1, 4).t()), ValueError,
     "contiguous along its last dimension"),
])
def test_argument_errors(no_launch, kwargs, error, match):
    out = kwargs.get("out")
    before = None if out is None else out.clone()
    with pytest.raises(error, match=match):
        rosekernels.quantize_fp8(**kwargs)
    assert out is None or torch.equal(out, before)


def test_outputs_of_new_strides_are_validated_on_a_planned_signature(monkeypatch):
    """A planned signature's fast path does not validate: outputs with other strides (here q's rows overlapping
    one another, which the compiled host code lets through) make a new plan, which validates them."""
    from types import SimpleNamespace

    from rosekernels import launch
    from rosekernels.ops import quantize as op

    planned = []
    monkeypatch.setattr(op, "_plans", launch.PlanCache())
    monkeypatch.setattr(op, "_new_plan", lambda x, q, s, *rest: planned.append(q.stride()) or
                        (SimpleNamespace(launch=lambda *args: None), op._disjoint(x, q, s)))
    x = torch.randn(4, 256).to(BF16)
    rosekernels.quantize_fp8(x, out=torch.empty(4, 256, dtype=E4M3))
    rosekernels.quantize_fp8(x, out=torch.empty(4, 256, dtype=E4M3))
    overlapping = torch.empty(640, dtype=E4M3).as_strided((4, 256), (128, 1))
    rosekernels.quantize_fp8(x, out=overlapping)
    assert planned == [(256, 1), (128, 1)]


@pytest.mark.parametrize("case", ["q on x", "scales on x", "scales on q"])
def test_outputs_overlapping_x_or_each_other_are_refused_before_anything_is_written(monkeypatch, case):
    """Given outputs overlapping x or each other are refused with nothing written, also on a planned signature,
    whose fast path launches (here a stand-in plan that writes q and scales) without the full checks."""
    from types import SimpleNamespace

    from rosekernels import launch
    from rosekernels.ops import quantize as op

    def write(x, q, scales):
        q.view(torch.uint8).fill_(0x7F)
        scales.fill_(math.nan)

    monkeypatch.setattr(op, "_plans", launch.PlanCache())
    monkeypatch.setattr(op, "_new_plan", lambda x, q, s, *rest: (SimpleNamespace(launch=write), op._disjoint(x, q, s)))
    mem = torch.randint(0, 64, (4096,), dtype=torch.uint8)
    x = mem[:2048].view(BF16).view(4, 256)
    out = (mem[1024:2048] if case == "q on x" else mem[2048:3072]).view(E4M3).view(4, 256)
    scales = {"q on x": None, "scales on x": mem[2032:2048].view(FP32), "scales on q": mem[3056:3072].view(FP32)}[case]
    before = mem.clone()
    with pytest.raises(ValueError, match=case.replace(" on ", " must not overlap ")):
        rosekernels.quantize_fp8(x, out=out, scales=scales)
    assert torch.equal(mem, before)


@pytest.mark.parametrize("case", ["q on x", "scales on x", "scales on q"])
def test_the_registered_op_refuses_overlapping_outputs_on_a_planned_signature(monkeypatch, case):
    """torch.compile's path, the registered op, checks its outputs on a planned signature too: after a call whose
    outputs keep apart from x launched, one of the same signature whose outputs overlap x or each other is refused
    with nothing launched, and so is an x of new strides whose rows reach into q (a contiguous x of its shape
    would end before q). CPU: the launch stubbed."""
    from stub_launch import stub_launches

    from rosekernels.ops import quantize as op

    launches = stub_launches(monkeypatch, qk, op)
    mem = torch.randint(0, 64, (8192,), dtype=torch.uint8)
    x = mem[:2048].view(BF16).view(4, 256)
    apart_q, apart_s = mem[4096:5120].view(E4M3).view(4, 256), mem[7680:7696].view(FP32)
    torch.ops.rosekernels.quantize_fp8(x, apart_q, apart_s, 0, True)
    assert len(launches) == 1
    q = (mem[1024:2048] if case == "q on x" else mem[2048:3072]).view(E4M3).view(4, 256)
    scales = {"q on x": apart_s, "scales on x": mem[2032:2048].view(FP32), "scales on q": mem[3056:3072].view(FP32)}
    with pytest.raises(ValueError, match=case.replace(" on ", " must not overlap ")):
        torch.ops.rosekernels.quantize_fp8(x, q, scales[case], 0, True)
    far_rows = mem.view(BF16).as_strided((4, 256), (1024, 1))  # its third row inside apart_q
    with pytest.raises(ValueError, match="q must not overlap x"):
        torch.ops.rosekernels.quantize_fp8(far_rows, apart_q, apart_s, 0, True)
    assert len(launches) == 1


def test_an_output_of_another_dtype_is_validated_not_checked_by_a_plan_of_1_byte_elements(monkeypatch):
    """The plan's overlap test measures spans in the first call's element sizes: a q of the same strides in bf16
    (twice the bytes, reaching into x) is a new signature, refused for its dtype with nothing launched (the plan
    of the e4m3 q would have found no overlap and launched)."""
    from stub_launch import stub_launches

    from rosekernels.ops import quantize as op

    launches = stub_launches(monkeypatch, qk, op)
    mem = torch.zeros(8192, dtype=torch.uint8)
    x = mem[:2048].view(BF16).view(4, 256)
    torch.ops.rosekernels.quantize_fp8(x, mem[2048:3072].view(E4M3).view(4, 256), mem[7680:7696].view(FP32), 0, True)
    x2, wide_q = mem[4096:6144].view(BF16).view(4, 256), mem[2560:4608].view(BF16).view(4, 256)
    with pytest.raises(TypeError, match="q has dtype bfloat16"):
        torch.ops.rosekernels.quantize_fp8(x2, wide_q, mem[7680:7696].view(FP32), 0, True)
    assert len(launches) == 1


def test_meta_tensors_infer_shapes(no_launch):
    q, s = rosekernels.quantize_fp8(torch.empty(2, 3, 512, device="meta", dtype=BF16), group_size=128)
    assert q.shape == (2, 3, 512) and q.dtype == E4M3 and s.shape == (2, 3, 4) and s.is_meta


# ---------------------------------------------------------------------------------------------
# GPU: numerics.

def _x(rows, k, dtype, seed=0, pad=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, k + pad, generator=g) * torch.exp2(torch.randint(-10, 11, (rows, 1), generator=g))
    if rows > 2:
        x[1] = 0  # a zero row
        x[2] = -2.5  # an all-equal row
    return x.to(device="cuda", dtype=dtype)[:, :k]


_SIZES = [(1, 4096), (3, 128), (200, 2944), (4097, 14336), (5, 18944), (2, 16384)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, group, rows, k", [(dt, g, r, k) for dt in (BF16, FP16, FP32) for g in (None, 128)
                                                    for r, k in _SIZES + [(2, 32768)]
                                                    if not (g and k % g) and (dt != FP32 or k <= 16384)])
def test_matches_the_reference(dtype, group, rows, k):
    x = _x(rows, k, dtype, seed=rows + k)
    q = torch.full((rows, k), 0x7F, dtype=torch.uint8, device="cuda").view(E4M3)  # NaN-poisoned
    scales = torch.full((rows, k // group) if group else (rows,), math.nan, device="cuda")
    got_q, got_s = rosekernels.quantize_fp8(x, group, out=q, scales=scales)
    assert got_q is q and got_s is scales
    fp8.check_quantized(x, q, scales, group or 0)


@pytest.mark.gpu
def test_strided_rows_3d_and_extremes():
    x = _x(64, 4096, BF16, pad=64)  # row stride 4160 elements
    x[5, 7] = 3.0e38  # bf16's range: the row's other values flush to zero
    x[6] = 1e-6  # a row of tiny values still gets 448 at its amax
    q, s = rosekernels.quantize_fp8(x, 128)
    fp8.check_quantized(x, q, s, 128)
    assert q[5, 7].float() == 448.0 and (q[6].float() == 448.0).all()
    x3 = _x(2 * 7, 512, FP16).view(2, 7, 512)
    q3, s3 = rosekernels.quantize_fp8(x3)
    assert q3.shape == (2, 7, 512) and s3.shape == (2, 7)
    fp8.check_quantized(x3.reshape(14, 512), q3.view(14, 512), s3.view(14), 0)


@pytest.mark.gpu
def test_cuda_graph_and_compile():
    x = _x(16, 4096, BF16)
    q, s = rosekernels.quantize_fp8(x, 128)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rosekernels.quantize_fp8(x, 128, out=q, scales=s)
    x.copy_(_x(16, 4096, BF16, seed=5))
    s.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    fp8.check_quantized(x, q, s, 128)
    compiled = torch.compile(lambda t: rosekernels.quantize_fp8(t * 2, 128), fullgraph=True)
    cq, cs = compiled(x)
    zero = (x.view(16, -1, 128) == 0).all(-1)  # all-zero groups keep the floor's scale (x[1] is zero)
    assert zero.any() and not zero.all()
    assert torch.equal(cq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(cs, torch.where(zero, s, 2 * s))


@pytest.mark.gpu
def test_workload():
    for cfg in qk.variants_for()[:6]:
        w = qk.workload(cfg, qk.Shape(qk.Shape.defaults(cfg.mode).rows, cfg.hidden, cfg.dtype, cfg.group))
        for args in (w.make_args(1), w.sample(2)):
            w.run(w.kernel.fn, args)
            torch.cuda.synchronize()
            w.check(args)
