"""MoE dispatch / combine: specializations compile for sm_90a (CPU), argument checks (CPU, meta, and on
the eager fast path with a cached plan), correctness against independent references, cached plans
across shapes, the prefill workspace (back to back, two streams, graphs), CUDA graphs and torch.compile
(GPU). The plan modules alone: test_moe_plan.py."""
import re
import time
import types
import zlib

import pytest
import torch

from kernel_sass import sass_of
import rosekernels
from rosekernels import checks, launch, scratch
from rosekernels.kernels import moe_combine as mc
from rosekernels.kernels import moe_dispatch as md
from rosekernels.ops import moe_combine as combine_op
from rosekernels.ops import moe_dispatch as dispatch_op
from sip import cubin as sip_cubin

BF16, FP16, FP32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32


# ---------------------------------------------------------------------------------------------
# CPU: every specialization compiles for sm_90a, without spills.

def _cpu_configs():
    out = md.variants_for() + mc.variants_for()
    # Other geometries: ragged vectors per row (2880/8 = 360), fp16/fp32, k = 1 and 6, E = 1 and 1024.
    out += [md.Config("fp16", 2880, 64, 6, "prefill"),
            md.Config("fp32", 1028, 1024, 1, "decode"),
            md.Config("bf16", 64, 1, 3, "prefill"),
            mc.Config("fp16", "fp16", 2880, 6, "prefill"),
            mc.Config("fp32", "fp32", 1028, 1, "decode"),
            # Tensor parallel (local_experts): a rank's quarter of 128 experts, and the first of 256 in fp16.
            md.Config("bf16", 2048, 32, 8, "decode", expert_first=96, experts_total=128),
            md.Config("fp16", 2880, 64, 6, "prefill", expert_first=0, experts_total=256)]
    return out


@pytest.mark.parametrize("cfg", _cpu_configs(), ids=lambda c: c.variant().key())
def test_variant_compiles(fresh_cache, tmp_path, cfg):
    module = md if isinstance(cfg, md.Config) else mc
    kernel = module.compile(cfg)
    assert kernel.variant == cfg.variant() and callable(kernel.fn)
    parsed = sip_cubin.parse_cubin(kernel.cubin)
    assert parsed.arch == "sm_90a"
    attrs = {a.name: a for a in parsed.nvinfo}
    threads = cfg.threads
    regs = attrs["EIATTR_REGCOUNT"].words()[1]
    assert regs * threads <= 65536, f"{regs} registers x {threads} threads do not fit one SM"
    frame = attrs.get("EIATTR_FRAME_SIZE")
    assert frame is None or frame.words()[1] == 0, "registers spilled to local memory"
    sass = sass_of(kernel, tmp_path)
    if sass is None:
        return  # nvdisasm not installed: compiled, SASS not inspected
    ops = re.findall(r"\b(LDG\.E\.128|STG\.E\.128|FFMA|LDL|STL)\b", sass)
    assert "LDL" not in ops and "STL" not in ops
    assert "LDG.E.128" in ops and "STG.E.128" in ops, "the row copies are not 128-bit accesses"
    if module is mc:  # all k row loads issued before the first use
        k = cfg.topk
        first_ffma = ops.index("FFMA") if "FFMA" in ops else len(ops)
        assert ops[:first_ffma].count("LDG.E.128") == k, ops[:first_ffma]


def test_local_experts_keys():
    """A whole-range config keeps the key it always had (compile caches, tuned store); a ranged one
    names its range and round-trips."""
    whole = md.Config("bf16", 2048, 128, 8, "decode")
    assert whole.variant() == md.Config("bf16", 2048, 128, 8, "decode", experts_total=128).variant()
    assert "first" not in whole.variant().key()
    ranged = md.Config("bf16", 2048, 64, 8, "prefill", expert_first=64, experts_total=128)
    assert ranged.ranged and "first=64" in ranged.variant().key() and "total=128" in ranged.variant().key()
    assert md.Config.from_variant(ranged.variant()) == ranged
    for bad in (dict(expert_first=65, experts_total=128), dict(expert_first=-1, experts_total=128),
                dict(expert_first=1)):
        with pytest.raises(ValueError):
            md.Config("bf16", 2048, 64, 8, "prefill", **bad)


def test_local_experts_on_meta_tensors_as_a_list_too():
    x = torch.empty(5, 64, dtype=BF16, device="meta")
    ids = torch.empty(5, 2, dtype=I32, device="meta")
    res = rosekernels.moe_dispatch(x, ids, 8, local_experts=[4, 4])
    assert res.counts.shape == (4,) and res.offsets.shape == (5,) and res.num_experts == 8
    assert res.buffer.shape == (md.default_capacity(5, 2, 4, md.DEFAULT_BLOCK_SIZE), 64)


@pytest.mark.parametrize("local", [(0, 0), (-1, 4), (6, 4), (0, 9), (True, 2), (1.0, 2)])
def test_bad_local_experts_rejected(local):
    x, ids = torch.zeros(4, 64, dtype=BF16), torch.zeros(4, 2, dtype=I32)
    with pytest.raises(ValueError, match="local_experts"):
        rosekernels.moe_dispatch(x, ids, 8, local_experts=local)


def test_custom_ops_registered():
    d = str(torch.ops.rosekernels.moe_dispatch.default._schema)
    c = str(torch.ops.rosekernels.moe_combine.default._schema)
    assert re.search(r"Tensor\(a\d*!\) buffer", d) and "!) x" not in d, d
    assert re.search(r"Tensor\(a\d*!\) out", c) and "!) expert_out" not in c, c


# ---------------------------------------------------------------------------------------------
# CPU: argument checks fire before anything is launched.

@pytest.fixture
def no_launch(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("reached the compile/launch step")
    monkeypatch.setattr(md, "compile", fail)
    monkeypatch.setattr(mc, "compile", fail)


def _dispatch_args(device="cpu", T=4, H=64, E=8, k=2, dtype=BF16):
    return dict(x=torch.randn(T, H, device=device).to(dtype),
                topk_ids=torch.randint(0, E, (T, k), device=device, dtype=I32), num_experts=E)


@pytest.mark.parametrize("change, error, match", [
    (lambda a: a.update(x=a["x"].to(torch.int8)), TypeError, "x has dtype int8"),
    (lambda a: a.update(topk_ids=a["topk_ids"].long()), TypeError, "topk_ids has dtype int64"),
    (lambda a: a.update(topk_ids=a["topk_ids"][:3]), ValueError, r"topk_ids has shape \[3, 2\]"),
    (lambda a: a.update(x=a["x"][:, :60]), ValueError, "multiple of 8"),
    (lambda a: a.update(topk_ids=a["topk_ids"][:, :0]), ValueError, "top-k must be in"),
    (lambda a: a.update(num_experts=0), ValueError, "num_experts must be in"),
    (lambda a: a.update(num_experts=1025), ValueError, "num_experts must be in"),
    (lambda a: a.update(block_size=0), ValueError, "block_size must be a positive int"),
    (lambda a: a.update(mode="fast"), ValueError, "mode must be"),
    (lambda a: a.update(capacity=-1), ValueError, "capacity must be >= 0"),
    (lambda a: a.update(buffer=torch.empty(10, 64, dtype=FP16)), TypeError, "buffer has dtype float16"),
    (lambda a: a.update(buffer=torch.empty(10, 72, dtype=BF16)), ValueError, r"buffer has shape \[10, 72\]"),
    (lambda a: a.update(buffer=torch.empty(10, 64, dtype=BF16), capacity=12), ValueError, "disagrees"),
    (lambda a: None, ValueError, "must be on a CUDA device"),  # valid shapes, CPU tensors
])
def test_dispatch_rejects(no_launch, change, error, match):
    args = _dispatch_args()
    change(args)
    with pytest.raises(error, match=match):
        rosekernels.moe_dispatch(**args)


def test_dispatch_rejects_32bit_overflow_and_misalignment(no_launch):
    meta = _dispatch_args(device="meta", T=2**20, H=4096, k=8)
    with pytest.raises(ValueError, match="32-bit"):
        rosekernels.moe_dispatch(**meta, capacity=2**31)
    with pytest.raises(ValueError, match="decode variant routes at most 8192"):
        rosekernels.moe_dispatch(**_dispatch_args(device="meta", T=1025, k=8), mode="decode")
    # The kernel's loops step a block's worth past their bound before testing it: sizes within that
    # much of 2^31 would wrap (T * H / 8 = 2^31 - 128 here, the audit's DeepSeek-V3 case).
    near = _dispatch_args(device="meta", T=2_396_745, H=7168, k=8, E=256)
    with pytest.raises(ValueError, match="32-bit"):
        rosekernels.moe_dispatch(**near, capacity=1024)
    x = torch.randn(3, 72).to(BF16)[:, 4:68]  # row stride 72: fine; base misaligned by 8 bytes
    assert x.data_ptr() % 16
    with pytest.raises(ValueError, match="16-byte aligned|CUDA device"):
        dispatch_op.validate(x, torch.zeros(3, 2, dtype=I32), torch.empty(8, 64, dtype=BF16), 8, 4, "decode")


def test_dispatch_fake_impl_shapes():
    a = _dispatch_args(device="meta", T=5, H=128, E=16, k=3)
    res = rosekernels.moe_dispatch(**a, block_size=32)
    assert res.buffer.shape == (md.default_capacity(5, 3, 16, 32), 128) and res.buffer.dtype == BF16
    assert res.slot_map.shape == (5, 3) and res.slot_map.dtype == I32
    assert res.counts.shape == (16,) and res.offsets.shape == (17,)
    assert res.overflow.shape == (1,) and res.invalid.shape == (1,)
    with pytest.raises(ValueError, match="multiple of 8"):
        rosekernels.moe_dispatch(**_dispatch_args(device="meta", H=100))


@pytest.fixture
def cpu_kernels(monkeypatch):
    """The ops on CPU tensors, with the device checks passed and a "kernel" that only records its
    calls (returned): the eager fast path with a cached plan can be exercised without a GPU. The plans
    made stay cached after the test: its sizes are its own."""
    calls = []
    kernel = types.SimpleNamespace(fn=lambda *args: calls.append(args))
    for kernel_module, op_module in ((md, dispatch_op), (mc, combine_op)):
        monkeypatch.setattr(kernel_module, "compile", lambda cfg: kernel)
        monkeypatch.setattr(op_module, "check_sm90", lambda device: None)
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(launch, "on_device", lambda device, fn, *args: fn(*args))
    return calls


def test_cached_plan_still_rejects_before_launch(cpu_kernels):
    """A cached plan covers shapes, strides, dtypes and devices; a misaligned pointer with the same
    key, or a different stride, must still raise before the kernel is called, writing nothing."""
    T, H, E, k = 4, 72, 5, 2
    x = torch.randn(T, H).to(BF16)
    ids = torch.randint(0, E, (T, k), dtype=I32)
    buffer = torch.full((16, H), float("nan"), dtype=BF16)
    calls = cpu_kernels
    res = rosekernels.moe_dispatch(x, ids, E, block_size=16, buffer=buffer)  # a new plan: fn called, outputs made
    assert len(calls) == 1 and res.slot_map.shape == (T, k) and res.meta.shape == (2 * E + 3,)
    assert calls[0][:3] == (x, ids, buffer) and calls[0][5] is None  # decode: no workspace
    misaligned = torch.randn(T * H + 8).to(BF16)[4:4 + T * H].view(T, H)  # same key, 8-byte offset
    with pytest.raises(ValueError, match="x must be 16-byte aligned"):
        rosekernels.moe_dispatch(misaligned, ids, E, block_size=16, buffer=buffer)
    wide = torch.randn(T, 2 * H).to(BF16)[:, ::2]  # same shape, stride 2: a new key, validated
    with pytest.raises(ValueError, match="unit stride"):
        rosekernels.moe_dispatch(wide, ids, E, block_size=16, buffer=buffer)
    assert len(calls) == 1 and buffer.isnan().all()

    w = torch.rand(T, k)
    out = torch.full((T, H), float("nan"), dtype=BF16)
    assert rosekernels.moe_combine(buffer, w, res.slot_map, out) is out and len(calls) == 2
    assert calls[1] == (buffer, w, res.slot_map, out)
    bad_out = torch.randn(T * H + 8).to(BF16)[4:4 + T * H].view(T, H)
    with pytest.raises(ValueError, match="out must be 16-byte aligned"):
        rosekernels.moe_combine(buffer, w, res.slot_map, bad_out)
    with pytest.raises(TypeError, match="topk_weights has dtype float16"):  # a new key: validated
        rosekernels.moe_combine(buffer, w.half(), res.slot_map, out)
    assert len(calls) == 2 and out.isnan().all()


def test_outputs_overlapping_an_input_are_rejected_before_launch(cpu_kernels):
    """The kernels write their outputs while other threads still read the inputs: a buffer overlapping
    x or topk_ids, or a combine's out overlapping an input, raises before the kernel is called, on a new
    plan and on a cached one (its key holds shapes and strides, not addresses). Sizes of its own: the
    plans stay cached."""
    T, H, E, k, C = 3, 96, 6, 2, 16
    calls = cpu_kernels
    ids = torch.randint(0, E, (T, k), dtype=I32)
    rows = torch.zeros(C + T, H, dtype=BF16)
    for x, buffer, match in ((rows[C:], rows[:C], None), (rows[C - 1:C - 1 + T], rows[:C], "x")):
        if match is None:  # disjoint: plans the key
            rosekernels.moe_dispatch(x, ids, E, block_size=4, buffer=buffer)
            continue
        with pytest.raises(ValueError, match=f"buffer must not overlap {match}"):
            rosekernels.moe_dispatch(x, ids, E, block_size=4, buffer=buffer)
    as_ids = rows.view(I32)[:T, :k]  # a new key: validated
    with pytest.raises(ValueError, match="buffer must not overlap topk_ids"):
        rosekernels.moe_dispatch(rows[C:], as_ids, E, block_size=4, buffer=rows[:C])
    assert len(calls) == 1

    w, slots = torch.rand(T, k), torch.zeros(T, k, dtype=I32)
    expert_out = rows[:C]
    rosekernels.moe_combine(expert_out, w, slots, rows[C:])  # disjoint: plans the key
    for out, name in ((rows[C - 2:C - 2 + T], "expert_out"), (rows[:T], "expert_out")):
        with pytest.raises(ValueError, match=f"out must not overlap {name}"):
            rosekernels.moe_combine(expert_out, w, slots, out)
    weights_out = torch.zeros(T, H, dtype=BF16)
    with pytest.raises(ValueError, match="out must not overlap topk_weights"):  # a new key: validated
        rosekernels.moe_combine(expert_out, weights_out.view(torch.float32)[:, :k], slots, weights_out)
    assert len(calls) == 2 and not rows.any()


def test_outputs_the_ops_allocate_take_no_pointer_check(cpu_kernels, monkeypatch):
    """A buffer moe_dispatch allocates, or an out moe_combine does, is aligned and overlaps nothing: once the
    signature is planned, the call never reads its address on the host (the per-call pointer checks are for
    outputs given them, as the last call's out). Sizes of its own: the plans stay cached."""
    T, H, E, k = 5, 56, 7, 3
    x, w = torch.randn(T, H).to(BF16), torch.rand(T, k)
    ids = torch.randint(0, E, (T, k), dtype=I32)
    read, address = [], torch.Tensor.data_ptr
    monkeypatch.setattr(torch.Tensor, "data_ptr", lambda t: read.append(address(t)) or address(t))
    for _ in range(2):  # the first plans both signatures, validating every argument once
        read.clear()
        res = rosekernels.moe_dispatch(x, ids, E, block_size=4)
        dispatch_read = set(read)
        read.clear()
        out = rosekernels.moe_combine(res.buffer, w, res.slot_map)
        combine_read = set(read)
    assert address(res.buffer) not in dispatch_read and address(out) not in combine_read
    read.clear()
    rosekernels.moe_combine(res.buffer, w, res.slot_map, out)
    assert address(out) in read


def test_result_views():
    E = 5
    meta = torch.arange(2 * E + 3, dtype=I32)
    res = md.MoeDispatch(torch.empty(0, 8), torch.empty(0, 2, dtype=I32), meta)
    assert res.counts.tolist() == list(range(E))
    assert res.offsets.tolist() == list(range(E, 2 * E + 1))
    assert res.overflow.tolist() == [2 * E + 1] and res.invalid.tolist() == [2 * E + 2]
    assert all(v.data_ptr() >= meta.data_ptr() for v in (res.counts, res.offsets, res.overflow, res.invalid))


def _combine_args(device="cpu", T=4, H=64, k=2, rows=16, dtype=BF16, wdtype=FP32):
    return dict(expert_out=torch.randn(rows, H, device=device).to(dtype),
                topk_weights=torch.rand(T, k, device=device).to(wdtype),
                slot_map=torch.randint(-1, rows, (T, k), device=device, dtype=I32))


@pytest.mark.parametrize("change, error, match", [
    (lambda a: a.update(expert_out=a["expert_out"].long()), TypeError, "expert_out has dtype int64"),
    (lambda a: a.update(topk_weights=a["topk_weights"].half()), TypeError, "topk_weights has dtype float16"),
    (lambda a: a.update(slot_map=a["slot_map"].long()), TypeError, "slot_map has dtype int64"),
    (lambda a: a.update(topk_weights=a["topk_weights"][:, :1]), ValueError, r"topk_weights has shape \[4, 1\]"),
    (lambda a: a.update(expert_out=a["expert_out"][:, :63]), ValueError, "multiple of 8"),
    (lambda a: a.update(out=torch.empty(4, 64, dtype=FP32)), TypeError, "out has dtype float32"),
    (lambda a: a.update(out=torch.empty(5, 64, dtype=BF16)), ValueError, r"out has shape \[5, 64\]"),
    (lambda a: a.update(mode="slow"), ValueError, "mode must be"),
    (lambda a: None, ValueError, "must be on a CUDA device"),
])
def test_combine_rejects(no_launch, change, error, match):
    args = _combine_args()
    change(args)
    with pytest.raises(error, match=match):
        rosekernels.moe_combine(**args)


def test_combine_rejects_sizes_whose_grid_would_wrap(no_launch):
    """T * H / 8 = 2^31 - 128: the grid's vector count rounded up to whole CTAs passes 2^31."""
    with pytest.raises(ValueError, match="32-bit"):
        rosekernels.moe_combine(**_combine_args(device="meta", T=268_435_440, H=64))


def test_combine_fake_impl():
    out = rosekernels.moe_combine(**_combine_args(device="meta", T=7, H=256, k=3, dtype=FP16, wdtype=FP16))
    assert out.shape == (7, 256) and out.dtype == FP16 and out.device.type == "meta"
    with pytest.raises(ValueError, match=r"topk_weights has shape"):
        a = _combine_args(device="meta")
        rosekernels.moe_combine(a["expert_out"], a["topk_weights"][:2], a["slot_map"])


# ---------------------------------------------------------------------------------------------
# GPU: an independent reference of the layout, exact checks of every output.

def _layout(ids, E, B, C):
    """(counts stored, offsets [E+1], overflow) of a valid routing, computed in float64-free integer math."""
    flat = ids.flatten().long().cpu()
    cnt = [int((flat == e).sum()) for e in range(E)]
    offsets, stored, start = [], [], 0
    for c in cnt:
        pad = -(-c // B) * B
        off = min(start, C)
        offsets.append(off)
        stored.append(min(c, min(start + pad, C) - off))
        start += pad
    offsets.append(min(start, C))
    return torch.tensor(stored), torch.tensor(offsets), sum(cnt) - sum(stored)


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_dispatch(x, ids, E, B, res, poison):
    """Every output exact; rows not holding a stored pair still hold `poison` (untouched)."""
    T, k = ids.shape
    C = res.buffer.shape[0]
    torch.cuda.synchronize()
    flat = ids.flatten().long()
    n_invalid = int(((flat < -1) | (flat >= E)).sum())
    assert int(res.invalid) == n_invalid
    slots = res.slot_map.flatten().long()
    if n_invalid:
        assert not res.counts.any() and not res.offsets.any() and int(res.overflow) == 0
        assert (slots == -1).all()
        assert torch.equal(_bits(res.buffer), _bits(poison)), "an invalid routing wrote the buffer"
        return
    stored, offsets, overflow = _layout(ids, E, B, C)
    assert torch.equal(res.counts.cpu().long(), stored), (res.counts.cpu(), stored)
    assert torch.equal(res.offsets.cpu().long(), offsets), (res.offsets.cpu(), offsets)
    assert int(res.overflow) == overflow
    assert (slots[flat < 0] == -1).all(), "a dropped pair got a slot"
    placed = slots >= 0
    assert (slots[~placed] == -1).all(), "a slot below -1"
    e = flat[placed]
    s = slots[placed]
    assert torch.equal(torch.bincount(e, minlength=E).cpu(), stored), "placed pairs per expert"
    lo = offsets.to(s.device)[e]
    assert ((s >= lo) & (s < lo + stored.to(s.device)[e])).all(), "slot outside its expert's stored rows"
    assert torch.unique(s).numel() == s.numel(), "two pairs share a row"
    tok = torch.arange(T * k, device=x.device)[placed] // k
    assert torch.equal(_bits(res.buffer[s]), _bits(x[tok])), "a row differs from its token"
    untouched = torch.ones(C, dtype=torch.bool, device=x.device)
    untouched[s] = False
    assert torch.equal(_bits(res.buffer[untouched]), _bits(poison[untouched])), "padding/unused rows written"


def assert_pair_order(ids, res):
    """decode: the pairs of an expert fill its rows in (token, choice) order."""
    flat = ids.flatten().long()
    slots = res.slot_map.flatten().long()
    placed = (slots >= 0).nonzero().flatten()  # ascending pair index
    order = torch.argsort(flat[placed], stable=True)  # by expert, pair order kept within one
    e, s = flat[placed][order], slots[placed][order]
    same = e[1:] == e[:-1]
    assert (s[1:][same] == s[:-1][same] + 1).all(), "decode: an expert's pairs out of (token, choice) order"


def _routing(kind, T, E, k, gen, device="cuda"):
    if kind == "uniform":
        ids = torch.rand(T, E, generator=gen).topk(k, dim=1).indices
    elif kind == "hot":  # nearly every token picks the first min(k, 3) experts
        logits = torch.rand(T, E, generator=gen)
        logits[:, :3] += 10 * (torch.rand(T, 1, generator=gen) < 0.9)
        ids = logits.topk(k, dim=1).indices
    elif kind == "one_expert":  # every choice of every token: the same expert (k copies per token)
        ids = torch.full((T, k), E - 1)
    elif kind == "dropped":
        ids = torch.rand(T, E, generator=gen).topk(k, dim=1).indices
        ids[torch.rand(T, k, generator=gen) < 0.3] = -1
    else:
        raise ValueError(kind)
    return ids.to(device=device, dtype=I32)


def _seed(*key):
    return zlib.crc32(repr(key).encode())


def _randn(shape, dtype, seed):
    """Large random tensors straight on the GPU."""
    return torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).to(dtype)


def _poisoned(rows, H, dtype):
    return torch.full((rows, H), float("nan"), dtype=dtype, device="cuda")


# (dtype, hidden, experts, top-k, block size)
GPU_CONFIGS = [(BF16, 2048, 128, 8, 128), (BF16, 7168, 256, 8, 128), (FP16, 2880, 32, 4, 64),
               (FP32, 1028, 8, 2, 16), (BF16, 512, 1024, 6, 1), (BF16, 64, 1, 1, 8)]
TOKENS = [1, 3, 37, 128, 256, 1000, 4096]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "decode", "prefill"])
@pytest.mark.parametrize("kind", ["uniform", "hot", "one_expert", "dropped"])
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-H{c[1]}-E{c[2]}-k{c[3]}-B{c[4]}")
def test_dispatch(cfg, kind, mode):
    dtype, H, E, k, B = cfg
    gen = torch.Generator().manual_seed(_seed(cfg, kind, mode))
    for T in TOKENS:
        x = _randn((T, H), dtype, _seed(cfg, kind, mode, T))
        ids = _routing(kind, T, E, k, gen)
        C = md.default_capacity(T, k, E, B)
        poison = _poisoned(C, H, dtype)
        if mode == "decode" and T * k > md.DECODE_PAIRS_LIMIT:
            with pytest.raises(ValueError, match="decode variant routes at most"):
                rosekernels.moe_dispatch(x, ids, E, block_size=B, buffer=poison, mode=mode)
            continue
        res = rosekernels.moe_dispatch(x, ids, E, block_size=B, buffer=poison.clone(), mode=mode)
        assert_dispatch(x, ids, E, B, res, poison)
        res.check()  # nothing dropped, nothing invalid: no exception
        if (mode or md.choose_mode(T, k)) == "decode":
            assert_pair_order(ids, res)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "decode", "prefill"])
def test_dispatch_many_tokens(mode):
    gen = torch.Generator().manual_seed(7)
    for T, kind in ((16384, "uniform"), (16384, "hot"), (9000, "one_expert"), (1024, "hot")):
        if mode == "decode" and T * 8 > md.DECODE_PAIRS_LIMIT:
            continue  # decode: only the largest routing it takes, 1024 x 8 pairs
        x = torch.randn(T, 2048, generator=gen).to(device="cuda", dtype=BF16)
        ids = _routing(kind, T, 128, 8, gen)
        poison = _poisoned(md.default_capacity(T, 8, 128, 128), 2048, BF16)
        assert_dispatch(x, ids, 128, 128, rosekernels.moe_dispatch(x, ids, 128, buffer=poison.clone(), mode=mode), poison)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_dispatch_overflow(mode):
    gen = torch.Generator().manual_seed(11)
    E, k, B, H = 16, 4, 32, 256
    for T, capacity in ((300, 700), (300, 0), (40, 33), (2000, 4096)):
        x = torch.randn(T, H, generator=gen).to(device="cuda", dtype=BF16)
        ids = _routing("hot", T, E, k, gen)
        poison = _poisoned(capacity, H, BF16)
        res = rosekernels.moe_dispatch(x, ids, E, capacity, B, buffer=poison.clone(), mode=mode)
        assert_dispatch(x, ids, E, B, res, poison)
        assert int(res.overflow) > 0
        with pytest.raises(RuntimeError, match="did not fit"):
            res.check()
        with pytest.raises(RuntimeError, match="did not fit"):  # the debug switch checks every call
            rosekernels.moe_dispatch(x, ids, E, capacity, B, buffer=poison.clone(), mode=mode, check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("bad", [8, 1000, -2, -1000])
def test_dispatch_invalid_ids(mode, bad):
    gen = torch.Generator().manual_seed(13)
    E, k, H = 8, 2, 128
    for T in (1, 50, 3000):
        x = torch.randn(T, H, generator=gen).to(device="cuda", dtype=BF16)
        ids = _routing("uniform", T, E, k, gen)
        ids.view(-1)[torch.randint(0, T * k, (1 + T // 100,), generator=gen)] = bad
        poison = _poisoned(md.default_capacity(T, k, E, 16), H, BF16)
        res = rosekernels.moe_dispatch(x, ids, E, block_size=16, buffer=poison.clone(), mode=mode)
        assert_dispatch(x, ids, E, 16, res, poison)
        with pytest.raises(ValueError, match="outside"):
            res.check()
        with pytest.raises(ValueError, match="outside"):
            rosekernels.moe_dispatch(x, ids, E, block_size=16, buffer=poison.clone(), mode=mode, check=True)


@pytest.mark.gpu
def test_prefill_ids_rewritten_mid_launch_never_index_past_the_experts():
    """The prefill variant reads each id twice, counting and then placing: an id rewritten in between
    (an expert-parallel receive region written out of turn, after an error) must give slot -1, not a
    slot from shared memory past the experts. The launch is held at its grid barrier (the workspace's
    counter preset one below zero) while every id becomes -1: no slot, nothing written in the buffer
    or past it (unbounded, e = -1 read the neighbours of s_off, s_stored and s_base: here the last
    expert's count of 64 as an offset, slots 64.. of a 16-row buffer)."""
    E, k, H, B, C = 8, 1, 256, 16, 16
    fn = md.compile(md.Config("bf16", H, E, k, "prefill")).fn
    ids = torch.tensor([0] * 16 + [E - 1] * 64, dtype=I32, device="cuda")[:, None]
    T = ids.shape[0]
    x = torch.randn(T, H, device="cuda").to(BF16)
    backing = _poisoned(C + 128, H, BF16)  # the buffer, then rows no slot may reach
    poison = backing.clone()
    slot_map = torch.full((T, k), -7, dtype=I32, device="cuda")
    meta = torch.full((md.meta_layout(E)["size"],), -7, dtype=I32, device="cuda")
    ws = torch.zeros(md.WS_INTS, dtype=I32, device="cuda")
    ws[md.WS_SYNC] = -1
    # CUDA loads modules lazily, and loading one may wait for the running kernels: the two kernels the
    # other stream runs while the launch spins (int32 fill_ and add_) are loaded here, before it starts
    ids.clone().fill_(-1)
    ws.clone()[md.WS_SYNC:md.WS_SYNC + 1].add_(1)
    torch.cuda.synchronize()
    launch_stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(launch_stream):
        fn(x, ids, backing[:C], slot_map, meta, ws, B, 1)
    with torch.cuda.stream(other):
        deadline = time.monotonic() + 10
        while int(ws[md.WS_SYNC]) != 0 and time.monotonic() < deadline:  # until the CTA counted and waits
            time.sleep(0.001)
        ids.fill_(-1)
        ws[md.WS_SYNC:md.WS_SYNC + 1].add_(1)  # the barrier opens
    torch.cuda.synchronize()
    assert (slot_map == -1).all()
    assert torch.equal(_bits(backing), _bits(poison))
    assert not ws.any()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_dispatch_local_experts(mode, ranks):
    """Each rank's dispatch (local_experts) is the whole-range dispatch of its share of the routing
    (other ranks' ids as -1, expert e as e - first); ids outside [-1, E) are invalid on every rank;
    the ranks' combines add up to the single-GPU combine (tensor parallel)."""
    gen = torch.Generator().manual_seed(_seed(mode, ranks))
    E, k, H, B = 16, 4, 264, 16  # 33 vectors per row: ragged copies
    n = E // ranks
    for T, kind in ((1, "uniform"), (37, "hot"), (300, "dropped"), (500, "one_expert")):
        x = torch.randn(T, H, generator=gen).to(device="cuda", dtype=BF16)
        ids = _routing(kind, T, E, k, gen)
        w = torch.rand(T, k, generator=gen).softmax(1).cuda()
        total = torch.zeros(T, H, dtype=torch.float64, device="cuda")
        bound = torch.zeros(T, H, dtype=torch.float64, device="cuda")
        for r in range(ranks):
            first = r * n
            mine = torch.where((ids >= first) & (ids < first + n), ids - first, -1)
            poison = _poisoned(md.default_capacity(T, k, n, B), H, BF16)
            res = rosekernels.moe_dispatch(x, ids, E, block_size=B, buffer=poison.clone(), mode=mode,
                                  local_experts=(first, n))
            assert_dispatch(x, mine, n, B, res, poison)
            md.check_dispatch(x, ids, E, B, res, (first, n))
            if mode == "decode":
                assert_pair_order(mine, res)
            total += rosekernels.moe_combine(res.buffer, w, res.slot_map).double()
            bound += mc.error_bound(res.buffer, w, res.slot_map)
        whole = rosekernels.moe_dispatch(x, ids, E, block_size=B, mode=mode)
        ref = mc.reference(whole.buffer, w, whole.slot_map)
        assert ((total - ref).abs() <= bound).all(), f"T={T} {kind}"  # each rank's combine within its bound
        for wrong in (E, -2, -2**31):  # outside [-1, E): invalid on every rank, ranks with first > 0 too
            bad = ids.clone()
            bad[T // 2, 0] = wrong
            for r in range(ranks):
                res = rosekernels.moe_dispatch(x, bad, E, block_size=B, mode=mode, local_experts=(r * n, n))
                with pytest.raises(ValueError, match=f"outside \\[-1, {E}\\)"):
                    res.check()


@pytest.mark.gpu
def test_dispatch_edge_inputs():
    gen = torch.Generator().manual_seed(17)
    # no tokens
    empty_x, empty_ids = torch.empty(0, 256, dtype=BF16, device="cuda"), torch.empty(0, 4, dtype=I32, device="cuda")
    res = rosekernels.moe_dispatch(empty_x, empty_ids, 8)
    assert res.buffer.shape == (0, 256) and not res.counts.any() and not res.offsets.any()
    # strided x and ids (views into wider tensors), every mode
    for mode, T in (("decode", 5), ("prefill", 700)):
        x = torch.randn(T, 264, generator=gen).to(device="cuda", dtype=BF16)[:, 8:264]
        ids = _routing("uniform", T, 32, 6, gen).repeat(1, 2)[:, 3:9]
        poison = _poisoned(md.default_capacity(T, 6, 32, 128), 256, BF16)
        assert_dispatch(x, ids, 32, 128, rosekernels.moe_dispatch(x, ids, 32, buffer=poison.clone(), mode=mode), poison)
    # the module's own checker agrees
    w = md.workload(md.Config("bf16", 2048, 128, 8, "prefill"), md.Shape(600))
    args = w.make_args(0)
    w.run(w.kernel.fn, args)
    w.check(args)


def _assert_workspaces_zero():
    torch.cuda.synchronize()
    for key, ws in scratch.shared_buffers().items():
        assert not ws.any(), f"workspace {key} not returned to zero: {ws.nonzero().flatten().tolist()[:8]}"


@pytest.mark.gpu
def test_dispatch_back_to_back():
    """Many launches without synchronisation: each prefill launch must leave the stream's shared
    workspace zero for the next one."""
    gen = torch.Generator().manual_seed(19)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = []
    for i in range(60):
        mode = ("decode", "prefill")[i % 2]
        T = (8 * sms + 7, 2000)[i % 2]  # decode: 32 vectors per token, 256 per CTA: a CTA per SM
        x = torch.randn(T, 256, generator=gen).to(device="cuda", dtype=BF16)
        ids = _routing(("uniform", "hot")[i % 3 == 0], T, 64, 4, gen)
        poison = _poisoned(md.default_capacity(T, 4, 64, 32), 256, BF16)
        cases.append((x, ids, poison, rosekernels.moe_dispatch(x, ids, 64, block_size=32, buffer=poison.clone(), mode=mode)))
    for x, ids, poison, res in cases:
        assert_dispatch(x, ids, 64, 32, res, poison)
    _assert_workspaces_zero()


def _count_validations(monkeypatch):
    """{op module: calls of its validate()}: one per new plan."""
    counts = {dispatch_op: 0, combine_op: 0}
    for module in counts:
        def counted(*args, _module=module, _validate=module.validate, **kwargs):
            counts[_module] += 1
            return _validate(*args, **kwargs)
        monkeypatch.setattr(module, "validate", counted)
    return counts


@pytest.mark.gpu
def test_plans_reused_across_shapes(monkeypatch):
    """Calls alternating between token counts (decode and prefill) reuse the plan of each shape (one
    validation per shape; no other test uses these sizes); every result is checked, so a plan applied
    to the wrong shape would show."""
    gen = torch.Generator().manual_seed(41)
    E, k, H, B = 32, 4, 256, 16
    validations = _count_validations(monkeypatch)
    sequence = (5, 128, 5, 700, 128, 3000, 5, 700)
    for T in sequence:
        x = torch.randn(T, H, generator=gen).to(device="cuda", dtype=BF16)
        ids = _routing("dropped", T, E, k, gen)
        poison = _poisoned(md.default_capacity(T, k, E, B), H, BF16)
        res = rosekernels.moe_dispatch(x, ids, E, block_size=B, buffer=poison.clone())
        assert_dispatch(x, ids, E, B, res, poison)
        w = torch.rand(T, k, generator=gen).cuda()
        out = torch.full((T, H), float("nan"), dtype=BF16, device="cuda")
        rosekernels.moe_combine(res.buffer, w, res.slot_map, out)
        _assert_combine(out, res.buffer, w, res.slot_map)
    assert validations == {dispatch_op: len(set(sequence)), combine_op: len(set(sequence))}
    # A cached plan does not cover the pointer: a misaligned x of a cached shape is still rejected.
    T = 128
    x = torch.randn(T * H + 8, generator=gen).to(device="cuda", dtype=BF16)[4:4 + T * H].view(T, H)
    poison = _poisoned(md.default_capacity(T, k, E, B), H, BF16)
    buffer = poison.clone()
    with pytest.raises(ValueError, match="16-byte aligned"):
        rosekernels.moe_dispatch(x, _routing("uniform", T, E, k, gen), E, block_size=B, buffer=buffer)
    torch.cuda.synchronize()
    assert torch.equal(_bits(buffer), _bits(poison))
    _assert_workspaces_zero()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [128, 700])
def test_graph_then_eager_other_shapes_then_replay(T):
    """Capture at one T, run other T eagerly (other plans, the eager workspace), replay: the graph
    still computes the right thing and the eager calls did too."""
    E, k, H, B = 64, 4, 512, 32
    gen = torch.Generator().manual_seed(43 + T)
    x = torch.empty(T, H, dtype=BF16, device="cuda")
    ids = torch.empty(T, k, dtype=I32, device="cuda")
    w = torch.empty(T, k, dtype=FP32, device="cuda")
    buffer = torch.empty(md.default_capacity(T, k, E, B), H, dtype=BF16, device="cuda")

    def step():
        res = rosekernels.moe_dispatch(x, ids, E, block_size=B, buffer=buffer)
        return res, rosekernels.moe_combine(res.buffer, w, res.slot_map)

    def fill():
        x.copy_(torch.randn(T, H, generator=gen))
        ids.copy_(_routing("hot", T, E, k, gen))
        w.copy_(torch.rand(T, k, generator=gen))
        buffer.fill_(float("nan"))
        return buffer.clone()

    fill()
    step()  # compile and plan outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res, out = step()
    for T2 in (T + 13, 3 * T, 1):
        x2 = torch.randn(T2, H, generator=gen).to(device="cuda", dtype=BF16)
        ids2 = _routing("uniform", T2, E, k, gen)
        poison = _poisoned(md.default_capacity(T2, k, E, B), H, BF16)
        assert_dispatch(x2, ids2, E, B, rosekernels.moe_dispatch(x2, ids2, E, block_size=B, buffer=poison.clone()), poison)
        for _ in range(2):
            poison = fill()
            graph.replay()
            assert_dispatch(x, ids, E, B, res, poison)
            _assert_combine(out, res.buffer, w, res.slot_map)
    _assert_workspaces_zero()


def _small_grid_prefill_inputs(gen, n, T=48, E=128, k=64, H=256):
    """Prefill dispatches of few tokens (T*k > the decode limit, one CTA per token): two of them fit
    the GPU side by side, so launches on two streams can really overlap."""
    cases = []
    for _ in range(n):
        x = torch.randn(T, H, generator=gen).to(device="cuda", dtype=BF16)
        ids = _routing("uniform", T, E, k, gen)
        cases.append((x, ids, _poisoned(md.default_capacity(T, k, E, 16), H, BF16)))
    return cases


@pytest.mark.gpu
def test_dispatch_two_streams():
    """Prefill dispatches issued alternately on two streams, which run them concurrently: each stream
    has its own workspace."""
    gen = torch.Generator().manual_seed(47)
    E = 128
    cases = _small_grid_prefill_inputs(gen, 40)
    assert md.choose_mode(*cases[0][1].shape) == "prefill"
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    results = []
    for i, (x, ids, poison) in enumerate(cases):
        with torch.cuda.stream(streams[i % 2]):
            results.append(rosekernels.moe_dispatch(x, ids, E, block_size=16, buffer=poison.clone()))
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    for (x, ids, poison), res in zip(cases, results):
        assert_dispatch(x, ids, E, 16, res, poison)
    _assert_workspaces_zero()


@pytest.mark.gpu
def test_two_graphs_replayed_concurrently():
    """Two graphs captured one after the other (the same capture stream) replayed on two streams at
    once, with eager dispatches on a third: every capture has its own workspace."""
    gen = torch.Generator().manual_seed(53)
    E = 128
    groups = [_small_grid_prefill_inputs(gen, 4) for _ in range(3)]
    for x, ids, poison in groups[0]:
        rosekernels.moe_dispatch(x, ids, E, block_size=16, buffer=poison.clone())  # compile, plan
    torch.cuda.synchronize()
    graphs, captured = [], []
    for cases in groups[:2]:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            captured.append([rosekernels.moe_dispatch(x, ids, E, block_size=16, buffer=p.clone()) for x, ids, p in cases])
        graphs.append(g)
    streams = [torch.cuda.Stream() for _ in range(3)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    eager = []
    for _ in range(10):
        for g, s in zip(graphs, streams):
            with torch.cuda.stream(s):
                g.replay()
        with torch.cuda.stream(streams[2]):
            eager.append([rosekernels.moe_dispatch(x, ids, E, block_size=16, buffer=p.clone()) for x, ids, p in groups[2]])
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    for cases, results in zip(groups[:2] + [groups[2]] * len(eager), captured + eager):
        for (x, ids, poison), res in zip(cases, results):
            assert_dispatch(x, ids, E, 16, res, poison)
    _assert_workspaces_zero()


def _assert_combine(out, expert_out, w, slot_map):
    torch.cuda.synchronize()
    mc.check_combine(expert_out, w, slot_map, out)
    empty = ((slot_map < 0) | (slot_map >= expert_out.shape[0])).all(1)
    assert (out[empty] == 0).all(), "a token without slots is not zero"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "decode", "prefill"])
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-H{c[1]}-E{c[2]}-k{c[3]}-B{c[4]}")
def test_combine(cfg, mode):
    dtype, H, E, k, B = cfg
    gen = torch.Generator().manual_seed(_seed(cfg, mode))
    for T in TOKENS:
        for wdtype in dict.fromkeys((FP32, dtype)):
            ids = _routing("dropped", T, E, k, gen)
            res = rosekernels.moe_dispatch(_randn((T, H), dtype, T), ids, E, block_size=B)
            expert_out = _randn(res.buffer.shape, dtype, _seed(cfg, mode, T)) * 3
            w = torch.rand(T, k, generator=gen).to(device="cuda", dtype=wdtype)
            slot_map = res.slot_map.clone()
            slot_map[T // 2:T // 2 + 1] = -1  # one token with no slot at all
            out = torch.full((T, H), float("nan"), dtype=dtype, device="cuda")
            assert rosekernels.moe_combine(expert_out, w, slot_map, out, mode=mode) is out
            _assert_combine(out, expert_out, w, slot_map)


@pytest.mark.gpu
def test_combine_foreign_slots_and_strides():
    gen = torch.Generator().manual_seed(23)
    T, k, H, rows = 300, 4, 512, 1000
    expert_out = torch.randn(rows, H + 8, generator=gen).to(device="cuda", dtype=BF16)[:, :H]
    slot_map = torch.randint(-3, rows + 5, (T, k), generator=gen).to(device="cuda", dtype=I32)  # some out of range
    w = torch.randn(T, k + 1, generator=gen).to(device="cuda")[:, 1:]
    out = torch.full((T, H + 16), float("nan"), dtype=BF16, device="cuda")[:, 16:]
    for mode in ("decode", "prefill"):
        rosekernels.moe_combine(expert_out, w, slot_map, out, mode=mode)
        _assert_combine(out, expert_out, w, slot_map)
    assert rosekernels.moe_combine(expert_out, w[:0], slot_map[:0]).shape == (0, H)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [128, 4096])
def test_cuda_graph_replay_with_new_routing(T):
    """Capture dispatch -> (a per-row 'expert') -> combine once; replay with new routings."""
    E, k, H, B = 128, 8, 2048, 128
    gen = torch.Generator().manual_seed(29)
    x = torch.empty(T, H, dtype=BF16, device="cuda")
    ids = torch.empty(T, k, dtype=I32, device="cuda")
    w = torch.empty(T, k, dtype=FP32, device="cuda")
    buffer = torch.empty(md.default_capacity(T, k, E, B), H, dtype=BF16, device="cuda")

    def step():
        res = rosekernels.moe_dispatch(x, ids, E, block_size=B, buffer=buffer)
        return res, rosekernels.moe_combine(res.buffer * 2, w, res.slot_map)

    x.copy_(torch.randn(T, H, generator=gen))
    ids.copy_(_routing("uniform", T, E, k, gen))
    w.copy_(torch.rand(T, k, generator=gen))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up (compile, allocator) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res, out = step()
    for kind in ("hot", "dropped", "uniform", "one_expert"):
        x.copy_(torch.randn(T, H, generator=gen))
        ids.copy_(_routing(kind, T, E, k, gen))
        w.copy_(torch.rand(T, k, generator=gen))
        buffer.fill_(float("nan"))
        poison = buffer.clone()
        graph.replay()
        assert_dispatch(x, ids, E, B, res, poison)
        routed = (ids >= 0).double()
        ref = 2 * x.double() * (w.double() * routed).sum(1, keepdim=True)
        _assert_combine(out, res.buffer * 2, w, res.slot_map)
        assert torch.allclose(out.double(), ref, rtol=2**-7, atol=1e-2)


@pytest.mark.gpu
def test_graph_of_many_launches():
    """20 dispatches of different sizes captured in one graph, replayed twice: no state leaks."""
    gen = torch.Generator().manual_seed(31)
    cases = [(T, torch.randn(T, 256, generator=gen).to(device="cuda", dtype=BF16),
              _routing("uniform", T, 32, 4, gen)) for T in (1, 100, 700, 1500) * 5]
    for _, x, ids in cases:
        rosekernels.moe_dispatch(x, ids, 32)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = [rosekernels.moe_dispatch(x, ids, 32) for _, x, ids in cases]
    for _ in range(2):
        for r in results:
            r.buffer.fill_(float("nan"))
        poisons = [r.buffer.clone() for r in results]
        graph.replay()
        for (_, x, ids), r, p in zip(cases, results, poisons):
            assert_dispatch(x, ids, 32, md.DEFAULT_BLOCK_SIZE, r, p)


@pytest.mark.gpu
def test_torch_compile_and_opcheck():
    gen = torch.Generator().manual_seed(37)
    T, E, k, H = 200, 16, 4, 256
    x = torch.randn(T, H, generator=gen).to(device="cuda", dtype=BF16)
    ids = _routing("dropped", T, E, k, gen)
    w = torch.rand(T, k, generator=gen, device="cpu").cuda()

    def f(x, ids, w):
        res = rosekernels.moe_dispatch(x, ids, E, block_size=16)
        return rosekernels.moe_combine(res.buffer, w, res.slot_map), res.counts

    out, counts = torch.compile(f, fullgraph=True)(x, ids, w)
    ref = x.double() * (w.double() * (ids >= 0)).sum(1, keepdim=True)
    assert torch.allclose(out.double(), ref, rtol=2**-7, atol=1e-3)
    assert torch.equal(counts.cpu().long(), torch.bincount(ids[ids >= 0].long().cpu(), minlength=E))
    torch.library.opcheck(torch.ops.rosekernels.moe_combine.default,
                          (x, w, torch.randint(-1, T, (T, k), dtype=I32, device="cuda"),
                           torch.empty_like(x), "decode"))
    buffer = torch.empty(md.default_capacity(T, k, E, 16), H, dtype=BF16, device="cuda")
    for first, count in ((0, 0), (E // 2, E // 2)):  # every expert; the second half's (local_experts)
        torch.library.opcheck(torch.ops.rosekernels.moe_dispatch.default,
                              (x, ids, buffer, E, 16, "prefill", first, count),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def _shape_of(cfg, tokens):
    """The shape of `tokens` tokens with the sizes of `cfg`."""
    if isinstance(cfg, md.Config):
        return md.Shape(tokens, cfg.hidden, cfg.num_experts, cfg.topk, cfg.dtype)
    return mc.Shape(tokens, cfg.hidden, cfg.topk, cfg.dtype, cfg.weight_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("module", [md, mc], ids=["dispatch", "combine"])
def test_workloads(module):
    """The SIP tuner's view: make_args -> launch -> check, outputs (dispatch: in canonical form) that
    two correct launches agree on bitwise, and test_args at random sizes of the config's mode."""
    for cfg in module.variants_for():
        for tokens in (module.Shape.defaults(cfg.mode).tokens, 3):
            w = module.workload(cfg, _shape_of(cfg, tokens))
            a1, a2 = w.make_args(5), w.make_args(5)
            w.run(w.kernel.fn, a1)
            w.run(w.kernel.fn, a2)
            w.check(a1)
            for o1, o2 in zip(w.outputs(a1), w.outputs(a2)):
                assert torch.equal(_bits(o1) if o1.is_floating_point() else o1,
                                   _bits(o2) if o2.is_floating_point() else o2)
        lo, hi = module.token_range(cfg)
        for seed in range(4):
            args = w.sample(seed)
            out_rows = args[0] if module is md else args[3]  # x [T, H] / out [T, H]
            assert lo <= out_rows.shape[0] <= hi
            w.run(w.kernel.fn, args)
            w.check(args)


def test_both_ops_trace_under_torch_compile_with_functionalization():
    """Mutating custom ops are functionalized by torch.compile; an op argument named `mode` used to
    collide with the functionalization's own keyword."""
    T, E, k, H = 200, 16, 4, 256
    x = torch.empty(T, H, dtype=BF16, device="meta")
    ids = torch.empty(T, k, dtype=I32, device="meta")
    w = torch.empty(T, k, device="meta")

    def f(x, ids, w):
        res = rosekernels.moe_dispatch(x, ids, E, block_size=16)
        return rosekernels.moe_combine(res.buffer, w, res.slot_map), res.counts

    out, counts = torch.compile(f, fullgraph=True, backend="aot_eager")(x, ids, w)
    assert out.shape == (T, H) and counts.shape == (E,)
