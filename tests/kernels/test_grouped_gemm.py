"""grouped_gemm and moe_experts: every family of the grouped kernel compiles for sm_90a with the SASS its
design promises (CPU), argument errors fire before anything runs (CPU), the float64 reference
itself (CPU); results match a float64 per-expert reference on fresh random inputs with poisoned outputs,
ragged groups, empty experts, gathered rows, row scales, CUDA-graph replays with new routings and
garbage offsets (GPU). The planning is tested without CuTeDSL in test_grouped_gemm_plan.py."""
import dataclasses
import math
import re
import types

import pytest
import torch

from grid import sample
from kernel_sass import sass_of
import rosekernels
from rosekernels import checks, launch, modes
from rosekernels.kernels import grouped_gemm as gg
from rosekernels.kernels import grouped_gemm_plan as plan
from rosekernels.kernels.moe_common import rows_view
from rosekernels.ops import grouped_gemm as gemm_op
from rosekernels.ops import moe_dispatch as dispatch_op
from rosekernels.ops import moe_experts as moe_experts_op
from rosekernels.ops.moe_experts import validate

Config = gg.Config

# ---------------------------------------------------------------------------------------------
# CPU: compilation. One config per family (tile kind x gated x gather x row scale x bias x dtype),
# then the default warm-up set (Qwen3-30B-A3B's expert GEMMs).

FAMILIES = [
    Config(tile_m=64, tile_n=8, swap_ab=True),
    Config(tile_m=64, tile_n=128, swap_ab=True, activation="silu", gated=True),
    Config(tile_m=128, tile_n=16, swap_ab=True, bias="fp32", row_scale=True, activation="gelu_tanh"),
    Config(tile_m=64, tile_n=32, swap_ab=True, gather=True, activation="silu", gated=True),
    Config(tile_m=128, tile_n=96, swap_ab=True, gather=True, dtype="fp16", bias="fp16", row_scale=True),
    Config(),
    Config(tile_n=192, pingpong=True, activation="silu", gated=True),
    Config(tile_n=128, pingpong=True, gather=True, row_scale=True, bias="bf16"),
    Config(gather=True, activation="silu", gated=True, bias="fp32"),
    Config(tile_n=192, pingpong=True, gather=True, dtype="fp16", activation="leaky_relu", slope=0.2),
    Config(tile_n=128, pingpong=True, row_scale=True, activation="relu", stages=3),
    # 2x1 clusters: two row tiles of an expert share the multicast weight tile
    Config(tile_n=192, pingpong=True, activation="silu", gated=True, cluster_m=2),
    Config(bias="bf16", row_scale=True, cluster_m=2),
]


def _compile_and_inspect(cfg, tmp_path):
    kernel = gg.compile(cfg)
    assert kernel.variant == cfg.variant()
    sass = sass_of(kernel, tmp_path)
    if sass is None:
        pytest.skip("nvdisasm not found: compiled, SASS not inspected")
    ops = re.findall(r"\b(HGMMA|UTMALDG\.\dD|UTMASTG|STSM|LDL|STL|STG\.E\.U16|STG\.E\.128|LDGSTS|LDGSTSBAR|"
                     r"FENCE\.VIEW\.ASYNC\.S)\b", sass)
    found = set(ops)
    assert "HGMMA" in found, cfg
    assert not {"LDL", "STL"} & found, f"{cfg}: register spills"
    # The weights: one TMA box per k-tile, 5-D when gated (gate and up rows interleaved by the box).
    assert ("UTMALDG.5D" if cfg.gated else "UTMALDG.3D") in found, (cfg, found)
    # on a 2x1 cluster the weights' box is multicast, the rows' is not
    assert bool(re.search(r"UTMALDG\.[35]D\.MULTICAST", sass)) == (cfg.cluster_m > 1), cfg
    assert "UTMALDG.2D.MULTICAST" not in sass, cfg
    if cfg.gather:  # rows by 16-byte cp.async, tracked by the stage's barrier, fenced before the WGMMAs
        assert {"LDGSTS", "LDGSTSBAR"} <= found and "UTMALDG.2D" not in found, (cfg, found)
        assert ops.count("FENCE.VIEW.ASYNC.S") >= 2, cfg
    else:
        assert "UTMALDG.2D" in found and "LDGSTS" not in found, (cfg, found)
    if cfg.swap_ab:  # out^T from registers, element by element inside the group
        assert "STG.E.U16" in found and "STSM" not in found, (cfg, found)
    else:  # through shared memory, then 16-byte stores of the group's rows (a TMA store would cross groups)
        assert {"STSM", "STG.E.128"} <= found and "UTMASTG" not in found, (cfg, found)


@pytest.mark.parametrize("cfg", FAMILIES, ids=lambda c: c.variant().key())
def test_every_family_compiles_for_sm90a(cfg, tmp_path):
    _compile_and_inspect(cfg, tmp_path)


_WARMUP = sample([c for c in plan.variants_for() if c not in FAMILIES],
                 [lambda c: (c.mode, c.gated, c.tile_m, c.tile_n)], key=lambda c: c.variant().key())


@pytest.mark.slow
@pytest.mark.grid
@pytest.mark.parametrize("cfg", _WARMUP, ids=lambda c: c.variant().key())
def test_the_warmup_set_compiles(cfg, tmp_path):
    _compile_and_inspect(cfg, tmp_path)


def test_module_follows_the_contract():
    from rosekernels import contract

    assert contract.missing(gg) == [] and gg.Config is plan.GroupedConfig and gg.Shape is plan.GroupedShape


# ---------------------------------------------------------------------------------------------
# CPU: the reference and the groupings the workloads draw.


def test_reference_is_each_groups_product_and_leaves_the_rest_nan():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 16, generator=g), torch.randn(3, 32, 16, generator=g)
    bias, scale = torch.randn(3, 32, generator=g), torch.rand(10, generator=g)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int32)  # expert 1 empty, row 9 in no group
    ref, written = gg.reference(x, w, offsets, bias, "silu", True, row_scale=scale)
    assert written.tolist() == [True] * 9 + [False] and torch.isnan(ref[9]).all()
    for r, e in ((0, 0), (3, 0), (4, 2), (8, 2)):
        y = x[r].double() @ w[e].double().t() + bias[e].double()
        want = torch.nn.functional.silu(y[:16]) * y[16:] * scale[r].double()
        torch.testing.assert_close(ref[r], want)
    # The gathered form reads x[a_index[r]]; indices and offsets are clamped as the kernel clamps them.
    index = torch.tensor([9, 0, -3, 99], dtype=torch.int32)
    ref, written = gg.reference(x, w, torch.tensor([-5, 2, 2, 7], dtype=torch.int32), a_index=index)
    assert written.all()  # groups [0, 2) and [2, 4): the last end clamped to the rows
    torch.testing.assert_close(ref[2], x[0].double() @ w[2].double().t())  # index -3 -> row 0
    torch.testing.assert_close(ref[3], x[9].double() @ w[2].double().t())  # index 99 -> the last row


def test_random_offsets_group_the_rows_with_empty_experts():
    g = torch.Generator().manual_seed(1)
    for rows, experts, covered in ((1, 1, 1), (50, 16, 47), (1000, 128, 1000), (5, 64, 0)):
        off = gg.random_offsets(rows, experts, g, covered=covered)
        assert off.dtype == torch.int32 and off.shape == (experts + 1,) and off[0] == 0 and off[-1] == covered
        assert bool((off.diff() >= 0).all())
    counts = gg.random_offsets(2000, 64, g).diff()
    assert (counts == 0).any() and (counts > 0).sum() > 16


# ---------------------------------------------------------------------------------------------
# CPU: argument errors fire before anything runs (CPU tensors never reach a kernel: the device check
# comes last).


def _t(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


def _offsets(experts):
    return torch.zeros(experts + 1, dtype=torch.int32)


_GOOD = dict(a=_t(6, 64), w=_t(4, 32, 64), group_offsets=_offsets(4))


@pytest.mark.parametrize("change, error, match", [
    (dict(a=_t(6, 64, dtype=torch.float32)), TypeError, "a has dtype"),
    (dict(w=_t(4, 32, 64, dtype=torch.float16)), TypeError, "w has dtype"),
    (dict(w=_t(32, 64)), ValueError, "w a 3-D tensor"),
    (dict(w=_t(32, 64), out=_t(6, 32)), ValueError, "w has shape"),
    (dict(w=_t(4, 32, 72)), ValueError, "w has shape"),
    (dict(group_offsets=_offsets(4).long()), TypeError, "group_offsets has dtype"),
    (dict(group_offsets=_offsets(3)), ValueError, "group_offsets has shape"),
    (dict(bias=_t(4, 16)), ValueError, "bias has shape"),
    (dict(bias=_t(4, 32, dtype=torch.int32)), TypeError, "bias has dtype"),
    (dict(a_index=_t(6, dtype=torch.int64)), TypeError, "a_index has dtype"),
    (dict(row_scale=_t(5, dtype=torch.float32)), ValueError, "row_scale has shape"),
    (dict(row_scale=_t(6)), TypeError, "row_scale has dtype"),
    (dict(out=_t(6, 16)), ValueError, "out has shape"),
    (dict(out=_t(6, 32, dtype=torch.float16)), TypeError, "out has dtype"),
    (dict(w=_t(4, 24, 64), gated=True, out=_t(6, 12)), ValueError, "multiple of 16"),
    (dict(a=_t(6, 60), w=_t(4, 32, 60)), ValueError, "K a multiple of 8"),
    (dict(w=_t(4, 32, 0), a=_t(6, 0)), ValueError, "positive"),
    (dict(w=_t(513, 32, 64), group_offsets=_offsets(513)), ValueError, "1 to 512 experts"),
    (dict(a=_t(0, 64), a_index=_t(6, dtype=torch.int32)), ValueError, "a has 0 rows, but a_index gathers 6"),
    (dict(a=_t(64, 6).t()), ValueError, "unit stride"),
    (dict(a=_t(6, 68)[:, :64]), ValueError, "aligned"),
    (dict(w=_t(4, 32, 68)[:, :, :64]), ValueError, "aligned"),
    (dict(activation="swish"), ValueError, "activation must be"),
    (dict(out=torch.zeros(1, 32, dtype=torch.bfloat16).expand(6, 32)), ValueError, "expanded"),
    (dict(out=_t(6 * 32).as_strided((6, 32), (8, 1))), ValueError, "overlap one another"),  # rows race
    ({}, ValueError, "CUDA device"),
])
def test_argument_errors(change, error, match):
    args = {**_GOOD, **change}
    with pytest.raises(error, match=match):
        rosekernels.grouped_gemm(args.pop("a"), args.pop("w"), args.pop("group_offsets"), **args)


def test_outputs_whose_elements_overlap_one_another_are_refused():
    """Rows stepping less than a row (they race), not only zero strides; a permuted, stepped slice of a
    contiguous tensor is distinct memory and passes."""
    for ok in (_t(4, 6, 8).permute(2, 0, 1), _t(4, 6, 8)[:, ::5, 1::3], _t(64, 1).t(), _t(8, 40)[:, :32], _t(0, 8)):
        checks.check_not_expanded("out", ok)
    for shape, stride in (((6, 32), (8, 1)), ((4, 4), (1, 1)), ((2, 3, 4), (12, 3, 1))):
        with pytest.raises(ValueError, match="overlap one another"):
            checks.check_not_expanded("out", _t(100).as_strided(shape, stride))


def test_out_overlapping_an_input_is_rejected():
    buf = _t(8, 64)
    with pytest.raises(ValueError, match="overlap a"):
        rosekernels.grouped_gemm(buf[:6], _t(4, 32, 64), _offsets(4), out=buf[2:8, :32])


def test_each_launch_checks_its_pointers_against_the_plans_extents(monkeypatch):
    """A plan's launch (the per-call path): an out whose last 16 bytes cover the first of any input is
    refused, naming it, with nothing launched; an out that ends where each input begins launches. All
    views of one buffer: the signature (shapes, strides) stays the plan's, only the pointers move."""
    launched = []
    monkeypatch.setattr(gg, "compile", lambda config: types.SimpleNamespace(fn=lambda *args: launched.append(args)))
    monkeypatch.setattr(modes, "sm_count", lambda index: 132)
    monkeypatch.setattr(launch, "on_device", lambda device, fn, *args: fn(*args))
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    specs = {"a": ((6, 64), torch.bfloat16), "w": ((4, 32, 64), torch.bfloat16), "group_offsets": ((5,), torch.int32),
             "bias": ((4, 32), torch.float32), "a_index": ((6,), torch.int32), "row_scale": ((6,), torch.float32)}
    out_bytes = 6 * 32 * 2  # out [6, 32] bf16: a multiple of 16, so every out placed below stays aligned

    def at(offset, shape, dtype):
        return buf[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    starts, end = {}, 1024
    for name, (shape, dtype) in specs.items():  # 16-byte aligned, apart by more than out's size
        starts[name], end = end, end + -(-math.prod(shape) * dtype.itemsize // 16) * 16 + 1024
    args = {name: at(starts[name], *spec) for name, spec in specs.items()}
    order = ("a", "w", "group_offsets", "bias", "a_index", "row_scale")
    plan = gemm_op._Plan(Config(), *(args[n] for n in order), at(0, (6, 32), torch.bfloat16))
    for name in order:
        below = at(starts[name] - out_bytes, (6, 32), torch.bfloat16)  # ends where `name` begins
        plan.launch(*(args[n] for n in order), below)
        assert launched.pop()[2] is below
        covering = at(starts[name] - out_bytes + 16, (6, 32), torch.bfloat16)
        with pytest.raises(ValueError, match=f"out must not overlap {name}$"):
            plan.launch(*(args[n] for n in order), covering)
        assert not launched


def test_out_may_interleave_rows_with_a_but_not_share_its_elements(monkeypatch):
    """a and out as column blocks of one [R, K + N] buffer share a span, not an element: the checks of the first
    call and a plan's launch take them; an out of the same strides half a row over, on a's elements, is refused
    by both, nothing launched."""
    launched = []
    monkeypatch.setattr(gg, "compile", lambda config: types.SimpleNamespace(fn=lambda *args: launched.append(args)))
    monkeypatch.setattr(launch, "on_device", lambda device, fn, *args: fn(*args))
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(gemm_op, "check_sm90", lambda device: None)
    buf, w, offsets = _t(7, 64 + 32), _t(4, 32, 64), _offsets(4)
    a, apart, over = buf[:6, :64], buf[:6, 64:], buf[1:7, 32:64]
    gemm_op._check_memory(a, w, offsets, None, None, None, apart)
    plan = gemm_op._Plan(Config(), a, w, offsets, None, None, None, apart)
    plan.launch(a, w, offsets, None, None, None, apart)
    assert len(launched) == 1
    with pytest.raises(ValueError, match="out must not overlap a$"):
        gemm_op._check_memory(a, w, offsets, None, None, None, over)
    with pytest.raises(ValueError, match="out must not overlap a$"):
        plan.launch(a, w, offsets, None, None, None, over)
    assert len(launched) == 1


def test_rows_view_gives_size_1_dims_contiguous_strides_and_keeps_the_rest():
    w = torch.zeros(1, 64, 32)
    odd = w.as_strided((1, 64, 32), (5, 32, 1))  # any stride is legal on a dim of size 1
    assert rows_view(odd).stride() == (64 * 32, 32, 1) and torch.equal(rows_view(odd), w)
    row = torch.zeros(8, 64)[3:4].as_strided((1, 64), (7, 1))
    assert rows_view(row).stride() == (64, 1)
    column = torch.zeros(64, 1).as_strided((64, 1), (1, 3))
    assert rows_view(column).stride() == (1, 1)
    plain = torch.zeros(6, 64)
    assert rows_view(plain) is plain and rows_view(torch.zeros(1, 64)).stride() == (64, 1)
    assert rows_view(None) is None


def test_gathered_rows_take_their_count_from_the_index():
    with pytest.raises(ValueError, match=r"out has shape \[6, 32\]; expected \[3, 32\]"):
        rosekernels.grouped_gemm(_t(6, 64), _t(4, 32, 64), _offsets(4), a_index=_t(3, dtype=torch.int32),
                                 out=_t(6, 32))


def test_meta_tensors_infer_shapes_and_check_them():
    meta = dict(device="meta", dtype=torch.bfloat16)
    out = rosekernels.grouped_gemm(torch.empty(10, 64, **meta), torch.empty(4, 64, 64, **meta),
                                   torch.empty(5, dtype=torch.int32, device="meta"), gated=True, activation="silu")
    assert out.shape == (10, 32) and out.device.type == "meta"
    with pytest.raises(ValueError, match="K a multiple of 8"):
        rosekernels.grouped_gemm(torch.empty(10, 60, **meta), torch.empty(4, 64, 60, **meta),
                                 torch.empty(5, dtype=torch.int32, device="meta"))


def _moe(t=5, experts=4, k=2, hidden=64, inter=32, **change):
    args = dict(x=_t(t, hidden), w_gate_up=_t(experts, 2 * inter, hidden), w_down=_t(experts, hidden, inter),
                topk_ids=_t(t, k, dtype=torch.int32), topk_weights=_t(t, k, dtype=torch.float32))
    return {**args, **change}


@pytest.mark.parametrize("change, error, match", [
    (dict(w_down=_t(5, 64, 32)), ValueError, "w_gate_up has 4 experts, w_down 5"),
    (dict(x=_t(5, 128)), ValueError, "hidden size is 128"),
    (dict(w_down=_t(4, 32, 32)), ValueError, "hidden size is 64"),
    (dict(w_down=_t(4, 64, 48)), ValueError, r"w_down must be \[E, H, 32\]"),
    (dict(w_gate_up=_t(4, 40, 64), w_down=_t(4, 64, 20)), ValueError, "multiple of 16"),
    (dict(w_gate_up=_t(4, 0, 64), w_down=_t(4, 64, 0)), ValueError, "H and I must be positive"),
    (dict(x=_t(5, 0), w_gate_up=_t(4, 64, 0), w_down=_t(4, 0, 32)), ValueError, "H and I must be positive"),
    (dict(topk_weights=_t(5, 3, dtype=torch.float32)), ValueError, "topk_weights has shape"),
    (dict(topk_ids=_t(4, 2, dtype=torch.int32)), ValueError, "topk_ids has shape"),
    (dict(topk_ids=_t(5, 0, dtype=torch.int32), topk_weights=_t(5, 0, dtype=torch.float32)), ValueError,
     "at least one expert"),
    (dict(topk_ids=_t(5, 2, dtype=torch.int64)), TypeError, "topk_ids has dtype"),
    (dict(topk_weights=_t(5, 2, dtype=torch.float16)), TypeError, "topk_weights has dtype"),
    (dict(w_down=_t(4, 64, 32, dtype=torch.float16)), TypeError, "w_down has dtype"),
    (dict(x=_t(5, 64, dtype=torch.float32)), TypeError, "x has dtype"),
    (dict(w_gate_up=_t(4, 64, 68)[:, :, :64]), ValueError, "aligned"),
    (dict(w_down=_t(4, 32, 64).transpose(1, 2)), ValueError, "unit stride"),
    (dict(w_gate_up=_t(513, 64, 64), w_down=_t(513, 64, 32)), ValueError, "1 to 512 experts"),
    (dict(activation="swish"), ValueError, "activation must be"),
    (dict(out=_t(5 * 64).as_strided((5, 64), (8, 1))), ValueError, "overlap one another"),
    ({}, ValueError, "CUDA device"),
])
def test_moe_experts_argument_errors(change, error, match):
    args = _moe(**change)
    activation = args.pop("activation", "silu")
    out = args.pop("out", _t(5, 64))
    with pytest.raises(error, match=match):
        rosekernels.moe_experts(*args.values(), out=out, activation=activation)
    with pytest.raises(ValueError, match=r"out has shape"):
        rosekernels.moe_experts(*_moe().values(), out=_t(5, 32))


def test_moe_experts_takes_any_stride_on_a_size_1_dim():
    """As grouped_gemm, moe_dispatch and moe_combine do (rows_view): one token's x or out, or one
    expert's weights, with an odd stride on that dim pass every check but the device's."""
    w_gate_up = _t(1, 64, 64).as_strided((1, 64, 64), (3, 64, 1))
    for args in (_moe(t=1, x=_t(64, 1).t()), _moe(t=1, out=_t(64, 1).t()), _moe(experts=1, w_gate_up=w_gate_up)):
        with pytest.raises(ValueError, match="CUDA device"):
            rosekernels.moe_experts(**args)


@pytest.fixture
def host_side(monkeypatch):
    """moe_experts' host side on CPU tensors: its validation, the dispatch's launch (counters of a valid
    routing, or of `invalid` ids outside [-1, E)) and the GEMMs' and the combine's launches recorded in
    `calls`, in order; nothing validated before."""
    state = types.SimpleNamespace(calls=[], invalid=0)

    def dispatch(x, topk_ids, buffer, num_experts, *args, **kwargs):
        state.calls.append("moe_dispatch")
        meta = torch.zeros(2 * num_experts + 3, dtype=torch.int32)
        meta[-1] = state.invalid
        return torch.zeros(topk_ids.shape, dtype=torch.int32), meta

    monkeypatch.setattr(moe_experts_op, "_checked", launch.PlanCache())
    monkeypatch.setattr(moe_experts_op, "validate", lambda *args, **kwargs: state.calls.append("validate"))
    monkeypatch.setattr(dispatch_op, "_run", dispatch)
    monkeypatch.setattr(moe_experts_op, "grouped_gemm", lambda *args, **kwargs: state.calls.append("grouped_gemm"))
    monkeypatch.setattr(moe_experts_op, "moe_combine", lambda *args, **kwargs: state.calls.append("moe_combine"))
    return state


def test_moe_experts_check_raises_before_the_gemms_and_the_combine(host_side):
    """check=True on a routing the dispatch refuses: the error comes before any launch after the
    dispatch, so out (here x itself) is never written."""
    args = _moe()
    host_side.invalid = 1
    with pytest.raises(ValueError, match="outside"):
        rosekernels.moe_experts(*args.values(), out=args["x"], check=True)
    assert host_side.calls == ["validate", "moe_dispatch"]
    host_side.calls.clear()
    host_side.invalid = 0
    rosekernels.moe_experts(*args.values(), out=args["x"], check=True)
    assert host_side.calls == ["moe_dispatch", "grouped_gemm", "grouped_gemm", "moe_combine"]


def test_moe_experts_validates_again_when_any_tensor_moves_to_another_device(host_side, monkeypatch):
    """The signature validated once includes every tensor's device: a call like a validated one but
    with one tensor elsewhere (a meta tensor standing for another GPU) is validated again."""
    monkeypatch.setattr(launch, "eager", lambda *tensors: True)
    args = _moe()
    for name in ("x", "w_gate_up", "w_down", "topk_ids", "topk_weights"):
        rosekernels.moe_experts(**args)
        host_side.calls.clear()
        rosekernels.moe_experts(**{**args, name: args[name].to("meta")})
        assert host_side.calls[0] == "validate", name


def test_moe_experts_checks_the_pointers_of_a_given_out_on_every_call(host_side, monkeypatch):
    """A call of a validated signature whose out overlaps topk_weights (views of one buffer, the same strides)
    is refused before the dispatch; out as x itself passes (CPU: the launches stubbed; the GPU twin below)."""
    monkeypatch.setattr(moe_experts_op, "validate", validate)  # the real one: host_side's records instead
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(moe_experts_op, "check_sm90", lambda device: None)
    buf = _t(8 * 64 + 64)
    args = _moe(t=8, topk_weights=buf[8 * 64:8 * 64 + 16].view(8, 2))
    rosekernels.moe_experts(**args, out=buf[:8 * 64].view(8, 64))
    rosekernels.moe_experts(**args, out=args["x"])
    assert host_side.calls.count("moe_dispatch") == 2
    with pytest.raises(ValueError, match="out must not overlap topk_weights"):
        rosekernels.moe_experts(**args, out=buf[16:16 + 8 * 64].view(8, 64))
    assert host_side.calls.count("moe_dispatch") == 2


# ---------------------------------------------------------------------------------------------
# GPU: the kernel against the float64 reference.

_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", FAMILIES, ids=lambda c: c.variant().key())
def test_every_family_matches_the_reference_on_ragged_groups(cfg):
    """Each family's workload: random rows of its mode over 1-16 experts (a quarter of them empty, a
    few rows at the end in no group), random N and K (ragged tiles and k-tiles), NaN-poisoned out;
    the written rows within one rounding of the float64 reference, the others still NaN."""
    shape = plan.GroupedShape(plan.row_range(cfg, 8)[0], 8, 256, 256, cfg.dtype, cfg.bias, cfg.activation, cfg.gated,
                              cfg.slope, cfg.gather, cfg.row_scale, cfg.pdl)
    w = gg.workload(cfg, shape)
    for seed in range(3):
        args = w.sample(seed)
        w.run(w.kernel.fn, args)
        torch.cuda.synchronize()
        assert w.check(args) <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("tile_n, pingpong", [(tn, pp) for _, tn, pp in plan.PLAIN_TILES])
@pytest.mark.parametrize("weight_tiles", [1, 3, 4])
def test_2x1_clusters_split_an_odd_last_row_tile(tile_n, pingpong, weight_tiles):
    """2x1 clusters over experts of 0, 1, 2, 3 and 5 row tiles (an odd last row tile: its CTAs split the
    weight tiles in pairs, an odd last one shared), with 1, 3 and 4 weight tiles: every row of every
    expert within one rounding of the float64 reference, the rows in no group still NaN."""
    n, k = weight_tiles * tile_n, 200
    base = plan.config_for(plan.GroupedShape(4096, 6, n, k, activation="none", gated=False), 132)
    cfg = dataclasses.replace(base, tile_m=128, tile_n=tile_n, pingpong=pingpong, cluster_m=2)
    counts = [0, 100, 256, 300, 0, 600]
    offsets = torch.tensor([sum(counts[:i]) for i in range(len(counts) + 1)], dtype=torch.int32)
    rows = int(offsets[-1]) + 7  # and 7 rows in no group
    g = torch.Generator().manual_seed(tile_n + weight_tiles)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).cuda()
    w = torch.randn(len(counts), n, k, generator=g).div_(k ** 0.5).to(torch.bfloat16).cuda()
    out = torch.full((rows, n), math.nan, dtype=torch.bfloat16, device="cuda")
    offsets = offsets.cuda()
    gg.compile(cfg).fn(*gg.launch_args(cfg, x, w, out, None, offsets, None, None))
    torch.cuda.synchronize()
    ref, written = gg.reference(x, w, offsets, None, "none", False, rows=rows)
    assert gg.check_out(out, ref, written) <= 1


def _group_case(rows, experts, n, k, dtype=torch.bfloat16, seed=0, gather=False, bias=None, scale=False):
    g = torch.Generator().manual_seed(seed)
    tokens = max(1, rows // 3) if gather else rows
    x = torch.randn(tokens, k, generator=g).to(dtype).cuda()
    w = torch.randn(experts, n, k, generator=g).div_(k ** 0.5).to(dtype).cuda()
    offsets = gg.random_offsets(rows, experts, g, covered=rows - min(rows // 10, 5)).cuda()
    extra = dict(bias=torch.randn(experts, n, generator=g).to(bias).cuda() if bias is not None else None,
                 a_index=torch.randint(tokens, (rows,), generator=g, dtype=torch.int32).cuda() if gather else None,
                 row_scale=torch.rand(rows, generator=g).cuda() if scale else None)
    return x, w, offsets, extra


@pytest.mark.gpu
@pytest.mark.parametrize("rows, experts, n, k, gated, options", [
    (1, 128, 1536, 2048, True, {}),  # one token's one choice: 127 experts without rows
    (16 * 8, 128, 1536, 2048, True, dict(gather=True)),
    (64 * 8, 256, 512, 7168, True, dict(scale=True)),  # E 256, H 7168, I 256
    (33, 8, 4096, 1000, False, dict(bias=torch.float32)),
    (3000, 16, 528, 264, True, dict(gather=True, scale=True, bias=torch.bfloat16)),  # prefill tiles
    (5000, 4, 1032, 520, False, {}),
])
def test_the_op_on_groupings_of_both_modes(rows, experts, n, k, gated, options):
    x, w, offsets, extra = _group_case(rows, experts, n, k, **options)
    out = torch.full((rows, n // 2 if gated else n), math.nan, dtype=x.dtype, device="cuda")
    rosekernels.grouped_gemm(x, w, offsets, activation="silu" if gated else "gelu_tanh", gated=gated, out=out,
                             **extra)
    ref, written = gg.reference(x, w, offsets, extra["bias"], "silu" if gated else "gelu_tanh", gated,
                                a_index=extra["a_index"], row_scale=extra["row_scale"], rows=rows)
    assert gg.check_out(out, ref, written) <= 1


@pytest.mark.gpu
def test_out_overlapping_an_input_is_rejected_and_nothing_is_written():
    """On the GPU, where the kernel could run: refused before it does."""
    buf = torch.full((8, 64), 7.0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="overlap a"):
        rosekernels.grouped_gemm(buf[:6], _t(4, 32, 64).cuda(), _offsets(4).cuda(), out=buf[2:8, :32])
    torch.cuda.synchronize()
    assert (buf == 7).all()


@pytest.mark.gpu
def test_all_rows_to_one_expert_and_no_rows_at_all():
    x, w, _, _ = _group_case(300, 6, 256, 128)
    for offsets in ([0, 0, 0, 300, 300, 300, 300], [0, 0, 0, 0, 0, 0, 0], [0] * 6 + [300]):
        offsets = torch.tensor(offsets, dtype=torch.int32, device="cuda")
        out = torch.full((300, 256), math.nan, dtype=x.dtype, device="cuda")
        rosekernels.grouped_gemm(x, w, offsets, out=out)
        ref, written = gg.reference(x, w, offsets)
        assert gg.check_out(out, ref, written) <= 1
    assert rosekernels.grouped_gemm(x[:0], w, offsets).shape == (0, 256)


@pytest.mark.gpu
def test_garbage_offsets_and_indices_stay_inside_the_tensors():
    """Decreasing, negative, past-the-end and extreme offsets and indices: clamped as the reference
    clamps them, so the rows they select match it, and the device stays healthy (compute-sanitizer
    memcheck runs these calls too: tests/support/sanitize_ops.py)."""
    x, w, _, extra = _group_case(200, 5, 256, 64, gather=True)
    index = extra["a_index"]
    index[:4] = torch.tensor([-1, -2**31, 2**31 - 1, x.shape[0]], dtype=torch.int32)
    # groups [0, 40) and [30, 200); [50, 200) and [0, 200); none at all
    for bad in ([-7, 40, 30, 2**31 - 1, 2**31 - 1, 2**31 - 1], [100, 50, 2**31 - 1, -2**31, -5, 300],
                [199, 0, 0, 0, 0, 0]):
        offsets = torch.tensor(bad, dtype=torch.int32, device="cuda")
        out = torch.full((200, 256), math.nan, dtype=x.dtype, device="cuda")
        rosekernels.grouped_gemm(x, w, offsets, a_index=index, out=out)
        ref, written = gg.reference(x, w, offsets, a_index=index)
        # Groups that overlap an earlier one race for their rows: compare the rows one group owns.
        owners = torch.zeros(200, dtype=torch.int32)
        for e in range(5):
            lo = min(max(bad[e], 0), 200)
            owners[lo:min(max(bad[e + 1], lo), 200)] += 1
        single = (owners == 1).to("cuda")
        assert gg.check_out(out[single], ref[single], written[single]) <= 1
        assert torch.isnan(out[(owners == 0).to("cuda")]).all()
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_groupings():
    x, w, offsets, _ = _group_case(96, 16, 512, 256)
    out = torch.full((96, 256), math.nan, dtype=x.dtype, device="cuda")
    rosekernels.grouped_gemm(x, w, offsets, activation="silu", gated=True, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rosekernels.grouped_gemm(x, w, offsets, activation="silu", gated=True, out=out)
    g = torch.Generator().manual_seed(5)
    for covered in (96, 40, 0, 95):
        offsets.copy_(gg.random_offsets(96, 16, g, covered=covered))
        x.copy_(torch.randn(x.shape, generator=g))
        out.fill_(math.nan)
        graph.replay()
        ref, written = gg.reference(x, w, offsets, activation="silu", gated=True)
        assert gg.check_out(out, ref, written) <= 1


@pytest.mark.gpu
def test_opcheck_and_torch_compile():
    x, w, offsets, _ = _group_case(40, 4, 256, 128)
    out = torch.empty(40, 128, dtype=x.dtype, device="cuda")
    torch.library.opcheck(torch.ops.rosekernels.grouped_gemm.default,
                          (x, w, offsets, None, None, None, out, "silu", True, 0.01, True),
                          test_utils=("test_schema", "test_faketensor"))
    fn = torch.compile(lambda a, o: rosekernels.grouped_gemm(a, w, offsets, activation="silu", gated=True, out=o) * 2,
                       fullgraph=True)
    ref, written = gg.reference(x, w, offsets, activation="silu", gated=True)
    out.fill_(math.nan)  # rows past the last group are not written: they stay NaN
    assert gg.check_out(fn(x, out) / 2, ref, written) <= 1


# ---------------------------------------------------------------------------------------------
# GPU: moe_experts against a float64 reference of the whole block.


def moe_reference(x, w_gate_up, w_down, ids, weights):
    """float64 out [T, H]: each routed (token, choice) through its expert, the intermediate rounded to
    x's dtype as moe_experts stores it (h = silu(gate) * up, then y = h @ down^T), summed with the
    weights in float64."""
    inter = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        if e < 0:
            continue
        tok, choice = (ids == e).nonzero(as_tuple=True)
        y = x[tok].double() @ w_gate_up[e].double().t()
        h = (torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]).to(x.dtype).double()
        down = (h @ w_down[e].double().t()).to(x.dtype).double()
        out.index_add_(0, tok, down * weights[tok, choice, None].double())
    return out


def _routing(tokens, experts, k, g, device="cuda"):
    ids = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices.to(torch.int32)
    weights = torch.rand(tokens, k, generator=g).softmax(1)
    return ids.to(device), weights.to(device)


def _moe_case(tokens, experts, k, hidden, inter, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).cuda()
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g).div_(hidden ** 0.5).to(dtype).cuda()
    w_down = torch.randn(experts, hidden, inter, generator=g).div_(inter ** 0.5).to(dtype).cuda()
    return (x, w_gate_up, w_down, *_routing(tokens, experts, k, g)), g


def _assert_moe_close(out, ref, dtype):
    """Per token: relative L2 error within a few roundings of the output dtype (the intermediates'
    roundings can fall apart by one ulp between fp32 and float64 accumulation); all finite."""
    assert torch.isfinite(out).all(), "non-finite or unwritten elements"
    err = (out.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-6)
    bound = 2e-2 if dtype == torch.bfloat16 else 3e-3
    assert err.max() < bound, f"worst token: relative error {err.max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, experts, k, hidden, inter, dtype", [
    (1, 128, 8, 2048, 768, torch.bfloat16),  # Qwen3-30B-A3B, T = 1
    (16, 128, 8, 2048, 768, torch.float16),
    (16, 256, 8, 7168, 256, torch.bfloat16),  # E 256, H 7168, I 256
    (37, 8, 2, 4096, 512, torch.bfloat16),
    (600, 16, 4, 512, 256, torch.bfloat16),  # 150 rows per expert: the prefill tiles
])
def test_moe_experts_matches_the_float64_block(tokens, experts, k, hidden, inter, dtype):
    (x, wgu, wd, ids, weights), _ = _moe_case(tokens, experts, k, hidden, inter, dtype)
    out = torch.full_like(x, math.nan)
    rosekernels.moe_experts(x, wgu, wd, ids, weights, out=out)
    _assert_moe_close(out, moe_reference(x, wgu, wd, ids, weights), dtype)


@pytest.mark.gpu
def test_moe_experts_unrouted_choices_one_hot_expert_and_in_place():
    (x, wgu, wd, ids, weights), _ = _moe_case(64, 32, 8, 1024, 256)
    ids[:, 0] = 5  # every token's first choice is expert 5 ...
    rest = ids[:, 1:]
    rest[rest == 5] = 6  # ... and no other choice
    ids[:3] = -1  # three tokens not routed at all: their rows are zero
    ids[3:10, 4:] = -1  # some choices not routed
    ref = moe_reference(x, wgu, wd, ids, weights)
    out = rosekernels.moe_experts(x, wgu, wd, ids, weights)
    assert (out[:3] == 0).all()
    _assert_moe_close(out[3:], ref[3:], x.dtype)
    rosekernels.moe_experts(x, wgu, wd, ids, weights, out=x)  # in place: x is read before out is written
    _assert_moe_close(x[3:], ref[3:], x.dtype)


@pytest.mark.gpu
def test_moe_experts_refuses_bad_ids_on_the_device_and_with_check():
    (x, wgu, wd, ids, weights), _ = _moe_case(4, 16, 2, 256, 128)
    ids[1, 1] = 16
    out = rosekernels.moe_experts(x, wgu, wd, ids, weights)
    assert (out == 0).all()  # the whole routing refused: nothing dispatched
    before = x.clone()
    with pytest.raises(ValueError, match="outside"):
        rosekernels.moe_experts(x, wgu, wd, ids, weights, out=x, check=True)
    assert torch.equal(x, before)  # raised before the combine would have written zeros over x


@pytest.mark.gpu
def test_moe_experts_cuda_graph_replays_with_new_routing():
    (x, wgu, wd, ids, weights), g = _moe_case(16, 64, 8, 1024, 256)
    out = torch.empty_like(x)
    rosekernels.moe_experts(x, wgu, wd, ids, weights, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rosekernels.moe_experts(x, wgu, wd, ids, weights, out=out)
    for _ in range(3):
        new_ids, new_weights = _routing(16, 64, 8, g)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        out.fill_(math.nan)
        graph.replay()
        _assert_moe_close(out, moe_reference(x, wgu, wd, ids, weights), x.dtype)


@pytest.mark.gpu
def test_moe_experts_checks_the_pointers_of_every_call_that_passes_out():
    """A second call of one signature whose out overlaps topk_weights (bf16 weights, views of one
    buffer) is refused before anything is written; the first call's pointers were fine."""
    (x, wgu, wd, ids, _), g = _moe_case(8, 16, 2, 256, 128)
    buf = torch.zeros(8 * 256 + 64, dtype=torch.bfloat16, device="cuda")
    weights = buf[8 * 256:8 * 256 + 16].view(8, 2).copy_(torch.rand(8, 2, generator=g).softmax(1))
    out = torch.empty_like(x)
    rosekernels.moe_experts(x, wgu, wd, ids, weights, out=out)
    _assert_moe_close(out, moe_reference(x, wgu, wd, ids, weights), x.dtype)
    overlapping = buf[16:16 + 8 * 256].view(8, 256)  # its last 16 elements are the weights
    before = buf.clone()
    with pytest.raises(ValueError, match="out must not overlap topk_weights"):
        rosekernels.moe_experts(x, wgu, wd, ids, weights, out=overlapping)
    torch.cuda.synchronize()
    assert torch.equal(buf, before)


@pytest.mark.gpu
def test_the_gather_kernel_reads_nothing_from_an_empty_x():
    """The device side of the op's refusal: rows to gather from an x of no rows (a null pointer) are
    zero-filled without a read (gated SwiGLU of zeros: zero rows), not read from before x."""
    cfg = Config(tile_m=64, tile_n=32, swap_ab=True, gather=True, activation="silu", gated=True)
    x = torch.empty(0, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4, 64, 64, dtype=torch.bfloat16, device="cuda")
    offsets = torch.tensor([0, 3, 3, 5, 6], dtype=torch.int32, device="cuda")
    index = torch.tensor([0, 5, -1, 2, 0, 1], dtype=torch.int32, device="cuda")
    out = torch.full((6, 32), math.nan, dtype=torch.bfloat16, device="cuda")
    gg.compile(cfg).fn(*gg.launch_args(cfg, x, w, out, None, offsets, index, None))
    torch.cuda.synchronize()
    assert (out == 0).all()


def test_moe_experts_is_exported_with_its_checks():
    assert rosekernels.moe_experts is moe_experts_op.moe_experts
    assert "grouped_gemm" in rosekernels.__all__ and "moe_experts" in rosekernels.__all__
