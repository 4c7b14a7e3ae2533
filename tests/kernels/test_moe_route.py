"""moe_route: the plan (CPU), every specialization compiles for sm_90a without spills (CPU), argument
checks before any launch (CPU, meta), the float64 reference and its check (CPU); on the GPU, exact ids and
bounded weights over ragged token counts, expert counts 1-512, ties, NaN and infinite logits, strided
rows, the outputs poisoned, graphs and torch.compile."""
import dataclasses
import math
import re
import types

import pytest
import torch

from kernel_sass import sass_of
import rosekernels
from rosekernels import checks, launch
from rosekernels.kernels import moe_route as mr
from rosekernels.kernels import moe_route_plan as plan
from rosekernels.models import QWEN3_30B_A3B, QWEN3_8B
from rosekernels.ops import moe_route as route_op
from sip import cubin as sip_cubin

BF16, FP16, FP32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32
C = plan.RouteConfig


# ---------------------------------------------------------------------------------------------
# CPU: the plan.

def test_config_defaults_key_and_round_trip():
    cfg = C("bf16", "fp32", 128, 8, True, "decode")
    assert cfg.warps == plan.WARPS["decode"] and cfg.pdl
    assert cfg.variant().key() == ("moe_route-decode-sm_90a-dtype=bf16-experts=128-pdl=True-renormalize=True-"
                                   "topk=8-warps=4-wdtype=fp32")
    assert C.from_variant(cfg.variant()) == cfg


@pytest.mark.parametrize("fields, match", [
    (dict(dtype="fp8"), "dtype must be"),
    (dict(weight_dtype="fp16"), "weight dtype must be fp32 or bf16"),
    (dict(experts=0), r"experts must be in \[1, 512\]"),
    (dict(experts=513), r"experts must be in \[1, 512\]"),
    (dict(topk=0), r"top-k must be in \[1, 32\]"),
    (dict(topk=33), r"top-k must be in \[1, 32\]"),
    (dict(experts=4, topk=5), r"top-k must be in \[1, 4\] for 4 experts"),
    (dict(warps=33), r"warps per CTA must be in \[1, 32\]"),
    (dict(mode="fast"), "mode must be"),
])
def test_config_rejects(fields, match):
    base = dict(dtype="bf16", weight_dtype="fp32", experts=128, topk=8, renormalize=True, mode="decode")
    with pytest.raises(ValueError, match=match):
        C(**{**base, **fields})


def test_mode_candidates_and_warm_up_set():
    assert plan.choose_mode(1) == plan.choose_mode(plan.DECODE_MAX_TOKENS) == "decode"
    assert plan.choose_mode(plan.DECODE_MAX_TOKENS + 1) == "prefill"
    shape = plan.RouteShape(3000, 60, 4, "fp16", "fp16", False, False)
    pick = plan.config_for(shape)
    assert (pick.mode, pick.experts, pick.topk, pick.renormalize, pick.pdl) == ("prefill", 60, 4, False, False)
    found = plan.candidates(shape)
    assert pick in found and sorted(c.warps for c in found) == sorted(plan.WARP_CHOICES)
    # A dense model needs no router; an MoE model its own experts, top-k and dtype, weights in that dtype.
    assert plan.variants_for([QWEN3_8B]) == []
    routers = plan.variants_for([QWEN3_30B_A3B], modes=("decode",))
    assert [(c.experts, c.topk, c.dtype, c.weight_dtype, c.renormalize) for c in routers] == [
        (128, 8, "bf16", "bf16", True)]
    odd = dataclasses.replace(QWEN3_30B_A3B, experts=60, topk=4, dtype="fp16", norm_topk=False)
    assert {(c.experts, c.topk, c.weight_dtype, c.renormalize, c.mode) for c in plan.variants_for([odd])} == {
        (60, 4, "fp16", False, "decode"), (60, 4, "fp16", False, "prefill")}
    assert {c.weight_dtype for c in plan.variants_for()} == {"bf16", "fp32"}


# ---------------------------------------------------------------------------------------------
# CPU: compilation.

CPU_CONFIGS = [C("bf16", "fp32", 128, 8, True, "decode"), C("bf16", "bf16", 128, 8, False, "prefill"),
               C("fp32", "fp32", 8, 2, True, "decode"), C("fp16", "fp16", 60, 4, True, "decode", pdl=False),
               C("bf16", "fp32", 512, 32, False, "prefill"), C("fp32", "fp32", 1, 1, True, "decode", warps=1)]


@pytest.mark.parametrize("cfg", CPU_CONFIGS, ids=lambda c: c.variant().key())
def test_variant_compiles(fresh_cache, tmp_path, cfg):
    kernel = mr.compile(cfg)
    assert kernel.variant == cfg.variant() and callable(kernel.fn)
    parsed = sip_cubin.parse_cubin(kernel.cubin)
    assert parsed.arch == "sm_90a"
    frame = {a.name: a for a in parsed.nvinfo}.get("EIATTR_FRAME_SIZE")
    assert frame is None or frame.words()[1] == 0, "registers spilled to local memory"
    sass = sass_of(kernel, tmp_path)
    if sass is None:
        return  # nvdisasm not installed: compiled, SASS not inspected
    ops = re.findall(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    assert not {"LDL", "STL"} & set(ops)
    # Each round of the top k is a warp arg-max: 5 butterfly steps of (logit, id).
    assert sum(o.startswith("SHFL.BFLY") for o in ops) >= 10 * cfg.topk
    assert ("ACQBULK" in ops) == cfg.pdl  # griddepcontrol.wait: the logits come from the kernel before


def test_module_follows_the_contract():
    from rosekernels import contract
    assert contract.missing(mr) == []
    assert rosekernels.KERNELS["moe_route"] == "rosekernels.kernels.moe_route"


# ---------------------------------------------------------------------------------------------
# CPU: argument checks, before any compile or launch.

@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(mr, "compile", lambda cfg: (_ for _ in ()).throw(AssertionError("reached compile")))


@pytest.mark.parametrize("call, error, match", [
    (lambda x: rosekernels.moe_route(x[0], 2), ValueError, "2-D tensor"),
    (lambda x: rosekernels.moe_route(x.to(torch.int32), 2), TypeError, "logits has dtype int32"),
    (lambda x: rosekernels.moe_route(x, 2.0), TypeError, "topk must be an int"),
    (lambda x: rosekernels.moe_route(x, True), TypeError, "topk must be an int"),
    (lambda x: rosekernels.moe_route(x, 0), ValueError, r"topk must be in \[1, 8\] for 8 experts"),
    (lambda x: rosekernels.moe_route(x, 9), ValueError, r"topk must be in \[1, 8\] for 8 experts"),
    (lambda x: rosekernels.moe_route(torch.zeros(3, 513), 2), ValueError, "1 to 512 experts"),
    (lambda x: rosekernels.moe_route(torch.zeros(3, 0), 1), ValueError, "1 to 512 experts"),
    (lambda x: rosekernels.moe_route(x, 2, weight_dtype=FP16), ValueError, "weight_dtype must be"),
    (lambda x: rosekernels.moe_route(x, 2, weight_dtype=BF16, topk_weights=torch.zeros(3, 2)), ValueError,
     "disagrees"),
    (lambda x: rosekernels.moe_route(x, 2, topk_weights=torch.zeros(3, 3)), ValueError,
     r"topk_weights has shape \[3, 3\]"),
    (lambda x: rosekernels.moe_route(x, 2, topk_ids=torch.zeros(3, 2, dtype=torch.int64)), TypeError,
     "topk_ids has dtype int64"),
    (lambda x: rosekernels.moe_route(x, 2, topk_ids=torch.zeros(2, 2, dtype=I32)), ValueError,
     r"topk_ids has shape \[2, 2\]"),
    (lambda x: rosekernels.moe_route(x, 2), ValueError, "must be on a CUDA device"),  # valid, CPU tensors
])
def test_rejects(no_launch, call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(3, 8))


def test_meta_tensors_take_the_traced_path_and_are_checked():
    x = torch.empty(5, 128, device="meta", dtype=BF16)
    w, ids = rosekernels.moe_route(x, 8)
    assert (w.shape, w.dtype, ids.shape, ids.dtype) == ((5, 8), FP32, (5, 8), I32)
    with pytest.raises(ValueError, match=r"topk_ids must be \[tokens, 8\]"):
        rosekernels.moe_route(x, 8, topk_ids=torch.empty(5, 4, device="meta", dtype=I32))
    with pytest.raises(ValueError, match=r"topk must be in \[1, 32\]"):
        rosekernels.moe_route(x, 40)


@pytest.fixture
def cpu_kernel(monkeypatch):
    """The op on CPU tensors with the device checks passed and a "kernel" that records its calls."""
    calls = []
    monkeypatch.setattr(mr, "compile", lambda cfg: types.SimpleNamespace(fn=lambda *args: calls.append(args)))
    monkeypatch.setattr(route_op, "check_sm90", lambda device: None)
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(launch, "on_device", lambda device, fn, *args: fn(*args))
    return calls


def test_outputs_overlapping_the_logits_or_each_other_are_rejected_on_a_cached_plan(cpu_kernel):
    """Warps write their outputs while others read logits: an overlap raises before the kernel runs, on
    a new plan and on a cached one (its key holds shapes and strides, not addresses)."""
    T, E, k = 6, 16, 2
    store = torch.zeros(T, E + 2 * k)  # logits | weights | ids, side by side in one fp32 buffer
    logits, weights, ids = store[:, :E], store[:, E:E + k], store[:, E + k:].view(I32)
    rosekernels.moe_route(logits, k, topk_weights=weights, topk_ids=ids)  # disjoint: plans the key
    assert len(cpu_kernel) == 1
    with pytest.raises(ValueError, match="topk_weights must not overlap logits"):
        rosekernels.moe_route(logits, k, topk_weights=store[:, E - 1:E - 1 + k], topk_ids=ids)
    with pytest.raises(ValueError, match="topk_ids must not overlap topk_weights"):
        rosekernels.moe_route(logits, k, topk_weights=weights, topk_ids=store[:, E + 1:E + 1 + k].view(I32))
    assert len(cpu_kernel) == 1 and not store.any()


def test_no_tokens_launch_nothing(cpu_kernel):
    w, ids = rosekernels.moe_route(torch.zeros(0, 64), 4)
    assert w.shape == ids.shape == (0, 4) and cpu_kernel == []


# ---------------------------------------------------------------------------------------------
# CPU: the reference and its check.

def test_reference_is_torch_topk_of_the_softmax_with_ties_to_the_lower_expert():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 40, generator=g, dtype=torch.float64)
    w, ids = mr.reference(x, 6, renormalize=False)
    p = torch.softmax(x, 1)
    top = torch.topk(p, 6)
    assert torch.equal(ids, top.indices) and torch.allclose(w, top.values, rtol=0, atol=1e-15)
    w, _ = mr.reference(x, 6, renormalize=True)
    assert torch.allclose(w.sum(1), torch.ones(50, dtype=torch.float64))
    tied = torch.tensor([[1.0, 3.0, 3.0, -1.0, 3.0], [float("nan"), 0.0, float("nan"), 0.0, -5.0]])
    _, ids = mr.reference(tied, 4, renormalize=True)
    assert ids.tolist() == [[1, 2, 4, 0], [1, 3, 4, 0]]  # NaN is -inf: below -5, the lower index first


def test_check_catches_a_wrong_id_a_wrong_weight_and_nan():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 64, generator=g).to(BF16)
    w, ids = mr.reference(x, 8, renormalize=True)
    good_w, good_ids = w.float(), ids.to(I32)
    assert mr.check_route(x, good_w, good_ids, renormalize=True) < 1e-7
    bad_ids = good_ids.clone()
    bad_ids[3, [1, 2]] = bad_ids[3, [2, 1]]
    with pytest.raises(AssertionError, match="1 of 20 tokens chose other experts, first token 3"):
        mr.check_route(x, good_w, bad_ids, renormalize=True)
    for poison in (good_w[7, 5] * (1 + 2.0**-14), float("nan")):
        bad_w = good_w.clone()
        bad_w[7, 5] = poison
        with pytest.raises(AssertionError, match=r"1 of 160 weights off, first at \(7, 5\)"):
            mr.check_route(x, bad_w, good_ids, renormalize=True)
    with pytest.raises(AssertionError, match="weights off"):  # weights of the other normalization
        mr.check_route(x, good_w, good_ids, renormalize=False)


@pytest.mark.parametrize("wdtype", [BF16, FP16])
def test_check_takes_weights_rounded_to_half_precision_subnormals_too_and_not_an_ulp_more(wdtype):
    x = torch.tensor([[0.0, -1.0, -12.0, -13.0, -15.0, -16.0, -17.0, -30.0]] * 3)  # fp16 weights below 2^-14
    x[1] = x[1].flip(0)
    w, ids = mr.reference(x, 6, renormalize=False)
    rounded = w.to(wdtype)
    assert (rounded[:, -1].float() < torch.finfo(FP16).smallest_normal).all() or wdtype == BF16
    assert mr.check_route(x, rounded, ids.to(I32), renormalize=False) > 0
    info = torch.finfo(wdtype)
    for j in (0, 5):  # a normal weight and (fp16) a subnormal one, each moved by one or two of its ulps
        off = rounded.clone()
        v = rounded[2, j].float()
        off[2, j] = (v + torch.maximum(v * info.eps, torch.tensor(info.eps * info.smallest_normal))).to(wdtype)
        assert off[2, j] != rounded[2, j]
        with pytest.raises(AssertionError, match="weights off"):
            mr.check_route(x, off, ids.to(I32), renormalize=False)


def test_models_past_the_kernel_keep_torch_s_router_and_warm_none():
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM
        from rosekernels import hf
        config = hf.model_config("qwen3-30b-a3b", 1)
        config.num_experts = 640  # moe_dispatch serves up to 1024 experts, moe_route 512
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    p = hf.plan(model)
    assert p.swaps["experts"] and not p.swaps["router"]
    assert not [s for s in hf.warmup_specs(model) if s.variant().op == "moe_route"]
    assert not plan.variants_for([dataclasses.replace(QWEN3_30B_A3B, experts=640)])


# ---------------------------------------------------------------------------------------------
# GPU

GPU_CASES = [  # (logits dtype, weights dtype, E, k, renormalize)
    (BF16, FP32, 128, 8, True), (BF16, BF16, 128, 8, False), (FP16, FP32, 60, 4, True), (FP32, FP32, 8, 2, True),
    (BF16, FP32, 256, 8, True), (BF16, FP32, 512, 32, False), (FP32, FP32, 1, 1, True), (FP16, FP16, 33, 16, False),
    (BF16, FP32, 64, 6, True), (FP32, FP32, 100, 1, False), (BF16, FP32, 32, 32, True), (FP32, FP32, 5, 5, False)]


def _poisoned(T, k, wdtype):
    return (torch.full((T, k), float("nan"), device="cuda", dtype=wdtype),
            torch.full((T, k), -1, device="cuda", dtype=I32))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "decode", "prefill"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{str(c[0])[6:]}-{str(c[1])[6:]}-E{c[2]}-k{c[3]}-{c[4]}")
def test_route(case, mode):
    dtype, wdtype, E, k, renorm = case
    g = torch.Generator().manual_seed(E * 100 + k)
    for T in (1, 5, 37, 256, 257, 1000):
        x = (torch.randn(T, E, generator=g) * 3)
        x[::3] = x[::3].round()  # ties
        x = x.to(device="cuda", dtype=dtype)
        w, ids = _poisoned(T, k, wdtype)
        got = rosekernels.moe_route(x, k, renorm, topk_weights=w, topk_ids=ids, mode=mode)
        assert got[0] is w and got[1] is ids
        mr.check_route(x, w, ids, renormalize=renorm)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CPU_CONFIGS, ids=lambda c: c.variant().key())
def test_workload_samples(cfg):
    wl = mr.workload(cfg, plan.RouteShape(300, cfg.experts, cfg.topk, cfg.dtype, cfg.weight_dtype, cfg.renormalize,
                                          cfg.pdl))
    for seed in range(3):
        args = wl.test_args(seed)
        wl.kernel.fn(*args)
        wl.check(args)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1e4, 1e30])
def test_large_logits_are_shifted_by_their_maximum(scale):
    """exp of unshifted logits would overflow to inf (weights NaN) or flush every weight but one to 0."""
    x = torch.randn(50, 128, device="cuda") * scale
    for renorm in (True, False):
        w, ids = rosekernels.moe_route(x, 8, renorm)
        mr.check_route(x, w, ids, renormalize=renorm)
        assert torch.isfinite(w).all() and (w[:, 0] == 1).all()  # the rest underflow to 0 at these spreads


@pytest.mark.gpu
def test_nan_and_infinite_logits_keep_ids_valid_and_distinct():
    T, E, k = 6, 128, 8
    x = torch.randn(T, E, device="cuda", dtype=BF16)
    x[0] = float("nan")  # all NaN: every logit -inf, the first k experts
    x[1, ::2] = float("nan")
    x[2, 5] = float("inf")
    x[3] = float("-inf")
    x[4, 100] = float("inf")
    x[4, 7] = float("inf")
    w, ids = rosekernels.moe_route(x, k)
    ref_w, ref_ids = mr.reference(x, k, True)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu())
    assert all(len(set(r)) == k and all(0 <= i < E for i in r) for r in ids.tolist())
    assert ids[0].tolist() == list(range(k)) and ids[4, :2].tolist() == [7, 100]
    finite = [1, 5]  # rows whose max is finite: weights as the reference's
    torch.testing.assert_close(w[finite].double(), ref_w[finite], rtol=1e-5, atol=1e-30)
    assert w[0].isnan().all() and w[2].isnan().any() and w[3].isnan().all()  # as torch's softmax


@pytest.mark.gpu
def test_strided_rows_and_outputs():
    T, E, k = 40, 128, 8
    wide = torch.randn(T, E + 24, device="cuda", dtype=BF16)
    x = wide[:, 8:8 + E]  # a row stride past E, an offset start
    w_store = torch.full((T, 16), float("nan"), device="cuda")
    id_store = torch.full((T, 16), -1, device="cuda", dtype=I32)
    w, ids = rosekernels.moe_route(x, k, topk_weights=w_store[:, 4:4 + k], topk_ids=id_store[:, 2:2 + k])
    mr.check_route(x, w, ids, renormalize=True)
    assert w_store[:, :4].isnan().all() and w_store[:, 4 + k:].isnan().all()  # nothing written beside
    assert (id_store[:, :2] == -1).all() and (id_store[:, 2 + k:] == -1).all()
    one = rosekernels.moe_route(x[5:6], k)  # one token: size-1 dims of any stride
    assert torch.equal(one[1], ids[5:6])


@pytest.mark.gpu
def test_graph_capture_and_torch_compile():
    T, E, k = 16, 128, 8
    x = torch.randn(T, E, device="cuda", dtype=BF16)
    w, ids = _poisoned(T, k, FP32)
    rosekernels.moe_route(x, k, topk_weights=w, topk_ids=ids)  # planned before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rosekernels.moe_route(x, k, topk_weights=w, topk_ids=ids)
    x.copy_(torch.randn(T, E, device="cuda", dtype=BF16))
    w.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    mr.check_route(x, w, ids, renormalize=True)

    compiled = torch.compile(lambda logits: rosekernels.moe_route(logits, k, False), fullgraph=True)
    cw, cids = compiled(x)
    mr.check_route(x, cw, cids, renormalize=False)


@pytest.mark.gpu
def test_route_feeds_moe_experts_as_torch_topk_does():
    """The router's output in hf's form (weights in the logits' dtype) is what moe_experts takes."""
    T, H, E, k, inter = 9, 256, 16, 4, 128
    x = torch.randn(T, H, device="cuda", dtype=BF16)
    logits = (torch.stack([torch.randperm(E) for _ in range(T)]) / 4).to(device="cuda", dtype=BF16)  # no ties
    w_gate_up = torch.randn(E, 2 * inter, H, device="cuda", dtype=BF16) / math.sqrt(H)
    w_down = torch.randn(E, H, inter, device="cuda", dtype=BF16) / math.sqrt(inter)
    w, ids = rosekernels.moe_route(logits, k, weight_dtype=BF16)
    p = torch.softmax(logits.float(), -1)
    top = torch.topk(p, k)
    ref = rosekernels.moe_experts(x, w_gate_up, w_down, top.indices.to(I32),
                                  (top.values / top.values.sum(-1, keepdim=True)).to(BF16))
    torch.testing.assert_close(rosekernels.moe_experts(x, w_gate_up, w_down, ids, w), ref, rtol=0.02, atol=0.02)
