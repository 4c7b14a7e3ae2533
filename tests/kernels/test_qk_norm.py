"""qk_norm: specializations compile for sm_90a (CPU), argument checks (CPU), numerics (GPU).
Configs and their selection: test_qk_norm_plan.py."""
import dataclasses
import math

import pytest
import torch

import rosekernels
from rosekernels import checks, jit
from rosekernels.kernels import qk_norm as qkn
from rosekernels.kernels import qk_norm_plan as plan
import rosekernels.ops.qk_norm  # noqa: F401  (registers torch.ops.rosekernels.qk_norm)
from stub_launch import stub_launches

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


# ---------------------------------------------------------------------------------------------
# CPU: compile every specialization.

def _cpu_configs():
    # Every dtype x weight dtype x head dim x mode for one model; the other model's head counts
    # only change folded constants, so its bf16 d=128 configs are enough. With rope: the first model's,
    # weights in the input dtype (the weight dtype does not meet the rotation), and fp32 tables beside bf16.
    first = next(iter(plan.MODEL_HEADS.values()))
    plain = [c for c in qkn.variants_for() if c.rope == "none"
             and ((c.q_heads, c.k_heads) == first or (c.dtype == "bf16" and c.head_dim == 128))]
    roped = [c for c in qkn.variants_for() if c.rope != "none" and (c.q_heads, c.k_heads) == first
             and c.weight_dtype == c.dtype]
    return plain + roped + [dataclasses.replace(c, rope="fp32") for c in roped if c.dtype == "bf16"]


@pytest.mark.parametrize("cfg", _cpu_configs(), ids=lambda c: c.variant().key())
def test_config_compiles(fresh_cache, cfg):
    kernel = qkn.compile(cfg)
    assert kernel.cubin[:4] == b"\x7fELF" and kernel.variant == cfg.variant()
    assert callable(kernel.fn)


def test_distinct_variants_get_distinct_kernels(fresh_cache):
    """Variants differing in one parameter (here the weight dtype) must not share a cache entry."""
    a = qkn.config_for(qkn.Shape(1, weight_dtype="bf16"))
    b = qkn.config_for(qkn.Shape(1, weight_dtype="fp32"))
    jit.forget_loaded()
    ka, kb = qkn.compile(a), qkn.compile(b)
    assert ka.cubin_sha256 != kb.cubin_sha256


def test_pdl_switch(fresh_cache, tmp_path):
    """With programmatic dependent launch the kernel waits for the previous one (ACQBULK) before its
    first load and releases the next one (PREEXIT) after its loads, before its stores; without it,
    neither. The key names the switch only when it is off."""
    from kernel_sass import opcodes_and_global_memory

    on, off = qkn.config_for(qkn.Shape(1)), qkn.config_for(qkn.Shape(1, pdl=False))
    assert on.pdl and not off.pdl and on == dataclasses.replace(off, pdl=True)
    assert "pdl" not in on.variant().key() and "pdl=False" in off.variant().key()
    for cfg in (on, off):
        found = opcodes_and_global_memory(qkn.compile(cfg), tmp_path)
        if found is None:
            pytest.skip("nvdisasm not found")
        ops, memory = found
        if cfg.pdl:  # one release per code path (q heads, k heads), each after that path's loads
            releases = [i for i, o in enumerate(ops) if o == "PREEXIT"]
            assert ops.count("ACQBULK") == 1 and ops.index("ACQBULK") < memory[0][0] and releases
            assert all([o for j, o in memory if j < i][-1] == "LDG" for i in releases)
        else:
            assert "ACQBULK" not in ops and "PREEXIT" not in ops


def test_rope_rotates_in_registers(fresh_cache, tmp_path):
    """With rope the kernel reads each token's cos and sin (two more loads a chunk) and pairs element i with
    i + d/2 by a butterfly shuffle of the vector (one a value) where a thread holds one chunk, in registers
    where it holds both (fp32, d = 256); nothing spills, and the stores stay one a chunk."""
    from kernel_sass import opcodes_and_global_memory

    def counts(cfg):
        found = opcodes_and_global_memory(qkn.compile(cfg), tmp_path)
        if found is None:
            pytest.skip("nvdisasm not found")
        ops = [o.split(".")[0] for o in found[0]]
        return {op: ops.count(op) for op in ("SHFL", "LDG", "STG", "LDL", "STL")}

    for shape, shuffles in ((qkn.Shape(1), 8), (qkn.Shape(1, dtype="fp32", head_dim=256), 0),
                            (qkn.Shape(1, dtype="fp16", head_dim=64), 8)):
        plain = counts(qkn.config_for(shape))
        roped = counts(qkn.config_for(dataclasses.replace(shape, rope=shape.dtype)))
        assert roped["LDL"] == roped["STL"] == 0 and roped["STG"] == plain["STG"]
        assert roped["LDG"] == 2 * plain["LDG"]  # q/k and weight chunks, then cos and sin chunks (both paths)
        assert roped["SHFL"] == plain["SHFL"] + 2 * shuffles  # q heads' path and k heads' path


def test_contract():
    assert qkn.Config is plan.QKNormConfig and qkn.Shape is plan.QKNormShape


def test_custom_op_registered():
    op = torch.ops.rosekernels.qk_norm.default
    schema = str(op._schema)
    assert "!) out_q" in schema and "!) out_k" in schema and "!) q," not in schema, schema


# ---------------------------------------------------------------------------------------------
# CPU: argument validation fires before anything is compiled or launched.

@pytest.fixture
def no_launch(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("validation should have failed before compiling/launching")
    monkeypatch.setattr(qkn, "compile", fail)


def _cpu_inputs(tokens=4, hq=4, hk=2, d=128, dtype=BF16, wdtype=None, device="cpu"):
    wdtype = dtype if wdtype is None else wdtype
    q = torch.randn(tokens, hq, d, device=device).to(dtype)
    k = torch.randn(tokens, hk, d, device=device).to(dtype)
    return q, k, torch.ones(d, dtype=wdtype, device=device), torch.ones(d, dtype=wdtype, device=device)


def _expect(exc, match, *args, **kwargs):
    outs = {}
    q, k = args[0], args[1]
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and "out_q" not in kwargs:
        kwargs["out_q"] = outs["q"] = torch.full(q.shape, 7.0, dtype=q.dtype, device=q.device)
        kwargs["out_k"] = outs["k"] = torch.full(k.shape, 7.0, dtype=k.dtype, device=k.device)
    with pytest.raises(exc, match=match):
        rosekernels.qk_norm(*args, **kwargs)
    for t in outs.values():
        assert (t == 7.0).all(), "an output was written although the call failed"


def test_rejects_cpu_tensors(no_launch):
    _expect(ValueError, "CUDA", *_cpu_inputs())


def test_rejects_expanded_outputs(no_launch):
    q, k, wq, wk = _cpu_inputs()
    _expect(ValueError, "out_q has a zero stride", q, k, wq, wk, out_q=torch.zeros_like(q[:1]).expand(q.shape),
            out_k=torch.zeros_like(k))
    _expect(ValueError, "out_k has a zero stride", q, k, wq, wk, out_q=torch.zeros_like(q),
            out_k=torch.zeros_like(k[:, :1]).expand(k.shape))


def test_rejects_dtype_mismatch(no_launch):
    q, k, wq, wk = _cpu_inputs()
    _expect(TypeError, "k has dtype", q, k.half(), wq, wk)
    _expect(TypeError, "q_weight has dtype", q, k, wq.half(), wk)
    _expect(TypeError, "k_weight has dtype", q, k, wq, wk.float())
    _expect(TypeError, "q has dtype", q.double(), k.double(), wq.double(), wk.double())
    _expect(TypeError, "out_q has dtype", q, k, wq, wk, out_q=torch.empty_like(q, dtype=FP16),
            out_k=torch.empty_like(k))


def test_rejects_bad_shapes(no_launch):
    q, k, wq, wk = _cpu_inputs(d=96, dtype=BF16)
    _expect(ValueError, "head dim 96", q, k, wq, wk)
    q, k, wq, wk = _cpu_inputs()
    _expect(ValueError, "k has shape", q, k[:3], wq, wk)  # token counts differ
    _expect(ValueError, "k has shape", q, torch.randn(4, 2, 64).to(BF16), wq, wk)
    _expect(ValueError, "q_weight has shape", q, k, wq[:64], wk)
    _expect(ValueError, "q has shape", q.flatten(1), k, wq, wk)
    _expect(ValueError, "out_k has shape", q, k, wq, wk, out_q=torch.empty_like(q), out_k=torch.empty_like(q))


def test_rejects_non_unit_last_stride(no_launch):
    q, k, wq, wk = _cpu_inputs()
    q2 = torch.randn(4, 4, 256).to(BF16)[:, :, ::2]
    _expect(ValueError, "unit stride", q2, k, wq, wk)


def test_rejects_misaligned_views(no_launch):
    q, k, wq, wk = _cpu_inputs()
    buf = torch.randn(4 * 4 * 128 + 1).to(BF16)
    _expect(ValueError, "aligned", buf[1:].view(4, 4, 128), k, wq, wk)  # base pointer off by 2 bytes
    rows = torch.randn(4, 4 * 128 + 4).to(BF16)
    _expect(ValueError, "aligned", rows[:, :512].view(4, 4, 128), k, wq, wk)  # row stride 1032 bytes
    wbuf = torch.ones(129).to(BF16)
    _expect(ValueError, "aligned", q, k, wbuf[1:], wk)


def test_rejects_non_tensors(no_launch):
    q, k, wq, wk = _cpu_inputs()
    with pytest.raises(TypeError, match="k_weight must be a torch.Tensor"):
        rosekernels.qk_norm(q, k, wq, [1.0] * 128, out_q=torch.empty_like(q), out_k=torch.empty_like(k))


def test_rejects_bad_rope_tables(no_launch):
    q, k, wq, wk = _cpu_inputs()
    cos, sin = torch.rand(4, 128).to(BF16), torch.rand(4, 128).to(BF16)
    _expect(ValueError, "cos and sin go together", q, k, wq, wk, cos=cos)
    _expect(ValueError, "cos and sin go together", q, k, wq, wk, sin=sin)
    _expect(TypeError, "sin must be a torch.Tensor", q, k, wq, wk, cos=cos, sin=[0.0] * 128)
    _expect(TypeError, "cos has dtype", q, k, wq, wk, cos=cos.half(), sin=sin.half())
    _expect(TypeError, "sin has dtype", q, k, wq, wk, cos=cos.float(), sin=sin)
    _expect(ValueError, "cos has shape", q, k, wq, wk, cos=cos[:3], sin=sin[:3])  # a row per token
    _expect(ValueError, "cos has shape", q, k, wq, wk, cos=cos[:, :64], sin=sin[:, :64])  # the whole head
    _expect(ValueError, "sin has shape", q, k, wq, wk, cos=cos, sin=sin[None])
    _expect(ValueError, "unit stride", q, k, wq, wk, cos=torch.rand(4, 256).to(BF16)[:, ::2], sin=sin)
    _expect(ValueError, "aligned", q, k, wq, wk, cos=cos, sin=torch.rand(4, 132).to(BF16)[:, :128])
    _expect(ValueError, "CUDA", q, k, wq, wk, cos=cos, sin=sin)  # all of them on the CPU: last


@pytest.fixture
def launches(monkeypatch):
    return stub_launches(monkeypatch, qkn, rosekernels.ops.qk_norm)


def test_a_planned_signature_still_refuses_outputs_whose_heads_overlap(launches):
    """The fast path of a planned signature skips the full checks; an output whose heads overlap (which the
    compiled host checks let through) must not take it (CPU: the launch stubbed)."""
    q, k, wq, wk = _cpu_inputs()
    rosekernels.qk_norm(q, k, wq, wk)
    assert len(launches) == 1
    heads_overlap = torch.empty(4 * 256 + 64 * 3 + 128, dtype=BF16).as_strided((4, 4, 128), (256, 64, 1))
    with pytest.raises(ValueError, match="out_q's elements overlap"):
        rosekernels.qk_norm(q, k, wq, wk, out_q=heads_overlap)
    with pytest.raises(ValueError, match="out_k's elements overlap"):
        rosekernels.qk_norm(q, k, wq, wk, out_k=heads_overlap[:, :2])
    assert len(launches) == 1


def test_outputs_may_alias_inputs_only_in_place(launches):
    """out_q may be q and out_k k, also as views of a fused qkv buffer, whose rows interleave (as do outputs
    into another such buffer); no other output may share memory with an input or the other output: refused
    with nothing launched, on a first call and on a planned signature, whose fast path tests only the
    addresses (CPU: the launch stubbed)."""
    hq, hk, d = 4, 2, 128
    w = torch.ones(d, dtype=BF16)

    def views(qkv):
        return qkv[:, :hq * d].view(-1, hq, d), qkv[:, hq * d:(hq + hk) * d].view(-1, hk, d)

    for tokens in (1, 5, 5):  # planned, then the fast path
        qkv = torch.randn(tokens, (hq + 2 * hk) * d).to(BF16)
        q, k = views(qkv)
        out_q, out_k = rosekernels.qk_norm(q, k, w, out_q=q, out_k=k)
        assert out_q is q and out_k is k
        rosekernels.qk_norm(q, k, w, out_q=q[:], out_k=k[:])  # other views of the same elements
        other_q, other_k = views(torch.empty_like(qkv))
        rosekernels.qk_norm(q, k, w, out_q=other_q, out_k=other_k)
    assert len(launches) == 9
    fresh = torch.empty(tokens, hq, d, dtype=BF16)
    for args, kwargs, match in [((q[:, :hk], k, w), dict(out_q=k, out_k=k), "out_q must not overlap k"),
                                ((q, k, w), dict(out_q=fresh, out_k=fresh[:, :hk]), "out_k must not overlap out_q"),
                                ((q, k, w), dict(out_q=q, out_k=q[:, :hk]), "out_k must not overlap q"),
                                ((q, k, w), dict(out_q=views(qkv[:, d:])[0], out_k=k), "out_q must not overlap q")]:
        with pytest.raises(ValueError, match=match):
            rosekernels.qk_norm(*args, **kwargs)
    assert len(launches) == 9


def test_rope_tables_go_with_the_plan_and_never_overlap_an_output(launches, monkeypatch):
    """A planned signature with rope launches with the tables; another table dtype or stride plans anew;
    an output over a table is refused on the fast path too (CPU: the launch stubbed)."""
    planned, stub = [], qkn.compile
    monkeypatch.setattr(qkn, "compile", lambda config: planned.append(config.rope) or stub(config))
    q, k, wq, wk = _cpu_inputs()
    cos, sin = torch.rand(4, 128).to(BF16), torch.rand(4, 128).to(BF16)
    rosekernels.qk_norm(q, k, wq, wk, cos=cos, sin=sin)
    rosekernels.qk_norm(q, k, wq, wk, cos=cos.clone(), sin=sin.clone())  # the same plan
    rosekernels.qk_norm(q, k, wq, wk, cos=cos.float(), sin=sin.float())
    both = torch.rand(4, 256).to(BF16)  # cos and sin side by side: row stride 2d
    rosekernels.qk_norm(q, k, wq, wk, cos=both[:, :128], sin=both[:, 128:])
    assert len(launches) == 4 and all(len(args) == 8 and args[6] is not None for args in launches)
    rosekernels.qk_norm(q, k, wq, wk)
    assert launches[-1][6] is None and launches[-1][7] is None
    # Planned with out_k and the tables rows of [T, 4, d] buffers, then the same strides over one buffer: the fast
    # path's address test refuses an output sharing elements with a table.
    def rows():
        return torch.empty(4, 4, 128, dtype=BF16)

    rosekernels.qk_norm(q, k, wq, wk, out_q=torch.empty_like(q), out_k=rows()[:, :2], cos=rows()[:, 0],
                        sin=rows()[:, 1])
    assert len(launches) == 6
    over = rows()
    with pytest.raises(ValueError, match="out_q must not overlap cos"):
        rosekernels.qk_norm(q, k, wq, wk, out_q=over, out_k=rows()[:, :2], cos=over[:, 0], sin=rows()[:, 1])
    with pytest.raises(ValueError, match="out_k must not overlap sin"):
        rosekernels.qk_norm(q, k, wq, wk, out_q=torch.empty_like(q), out_k=over[:, :2], cos=rows()[:, 0],
                            sin=over[:, 1])
    rosekernels.qk_norm(q, k, wq, wk, out_q=torch.empty_like(q), out_k=over[:, :2], cos=rows()[:, 0],
                        sin=over[:, 2])  # rows of one buffer that share no element: allowed
    assert len(launches) == 7 and planned == ["bf16", "fp32", "bf16", "none", "bf16"]


def test_meta_tensors_take_the_registered_op(no_launch):
    q, k, wq, wk = (t.to("meta") for t in _cpu_inputs())
    out_q, out_k = rosekernels.qk_norm(q, k, wq, wk)
    assert out_q.is_meta and out_q.shape == q.shape and out_k.shape == k.shape
    cos, sin = torch.empty(4, 128, dtype=BF16, device="meta"), torch.empty(4, 128, dtype=BF16, device="meta")
    out_q, out_k = rosekernels.qk_norm(q, k, wq, wk, cos=cos, sin=sin)
    assert out_q.is_meta and out_q.shape == q.shape and out_k.shape == k.shape


# ---------------------------------------------------------------------------------------------
# GPU: numerics against a float64 reference.

MODEL = (32, 8)
TOKENS = (1, 2, 3, 7, 31, 128, 1000, 4097, 16384)
DTYPE_PAIRS = ((BF16, BF16), (BF16, FP32), (FP16, FP16), (FP16, FP32), (FP32, FP32))


def _rand(*shape, dtype, scale=1.0, shift=0.0, gen=None):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale + shift).to(dtype)


def _check(got, ref, dtype, what=""):
    assert not got.isnan().any(), f"{what}: {got.isnan().sum().item()} elements never written"
    err = checks.relative_error(got, ref)
    assert err <= qkn.tolerance(dtype), f"{what}: error {err:.3g} > {qkn.tolerance(dtype):.3g}"


def _run_case(tokens, hq, hk, d, dtype, wdtype, eps=1e-6, bias=0.0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = _rand(tokens, hq, d, dtype=dtype, scale=3.0, gen=gen)
    k = _rand(tokens, hk, d, dtype=dtype, scale=0.5, shift=0.2, gen=gen)
    wq = _rand(d, dtype=wdtype, scale=0.3, shift=1.0 - bias, gen=gen)
    wk = _rand(d, dtype=wdtype, scale=0.3, shift=1.0 - bias, gen=gen)
    out_q, out_k = torch.full_like(q, math.nan), torch.full_like(k, math.nan)
    q0, k0 = q.clone(), k.clone()
    res = rosekernels.qk_norm(q, k, wq, wk, eps=eps, weight_bias=bias, out_q=out_q, out_k=out_k)
    assert res[0] is out_q and res[1] is out_k
    ref_q, ref_k = qkn.reference(q, k, wq, wk, eps, bias)
    what = f"T={tokens} heads={hq}/{hk} d={d} {dtype}/{wdtype} eps={eps} bias={bias}"
    _check(out_q, ref_q, dtype, "q " + what)
    _check(out_k, ref_k, dtype, "k " + what)
    assert torch.equal(q, q0) and torch.equal(k, k0), "inputs modified"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", TOKENS)
def test_tokens_bf16_d128(tokens):
    _run_case(tokens, *MODEL, 128, BF16, BF16, seed=tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,wdtype", DTYPE_PAIRS, ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("d", qkn.HEAD_DIMS)
@pytest.mark.parametrize("tokens", (1, 7, 1000, 4097))
def test_dtypes_and_head_dims(tokens, d, dtype, wdtype):
    _run_case(tokens, *MODEL, d, dtype, wdtype, seed=tokens + d)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hk", [(32, 4), (16, 2), (5, 3), (1, 1), (64, 8)])
@pytest.mark.parametrize("tokens", (1, 3, 31, 4097))
def test_head_counts(tokens, hq, hk):
    _run_case(tokens, hq, hk, 128, BF16, BF16, seed=hq * hk + tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("eps,bias", [(1e-5, 0.0), (1e-6, 1.0), (1e-6, -0.5)])
@pytest.mark.parametrize("dtype,wdtype", [(BF16, BF16), (FP16, FP32), (FP32, FP32)],
                         ids=lambda t: str(t).replace("torch.", ""))
def test_eps_and_weight_bias(eps, bias, dtype, wdtype):
    for tokens in (2, 1000):
        _run_case(tokens, *MODEL, 128, dtype, wdtype, eps=eps, bias=bias)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (1, 1000))
def test_one_weight_for_both(tokens):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q = _rand(tokens, 32, 128, dtype=BF16, scale=3.0, gen=gen)
    k = _rand(tokens, 8, 128, dtype=BF16, scale=0.5, shift=0.2, gen=gen)
    w = _rand(128, dtype=BF16, scale=0.3, shift=1.0, gen=gen)
    out_q, out_k = rosekernels.qk_norm(q, k, w)
    ref_q, ref_k = qkn.reference(q, k, w, w)
    _check(out_q, ref_q, BF16, f"q T={tokens}, one weight")
    _check(out_k, ref_k, BF16, f"k T={tokens}, one weight")


def _tables(tokens, d, dtype, gen, stride=None):
    """Random cos and sin rows in [-1, 1] (not a real rotation's: a kernel that took an element's partner's
    value would pass on transformers' duplicated halves), the two halves of rows of `stride` (>= 2d)."""
    stride = stride or 2 * d
    buf = (torch.rand(tokens, stride, generator=gen, device="cuda") * 2 - 1).to(dtype)
    return buf[:, :d], buf[:, stride // 2:stride // 2 + d]


def _check_rope(out, q, k, wq, wk, cos, sin, dtype, what, eps=1e-6, bias=0.0):
    inputs = (q, k, wq, wk, eps, bias, cos, sin)
    for got, ref, scale, name in zip(out, qkn.reference(*inputs), qkn.rope_scales(*inputs), "qk"):
        assert not got.isnan().any(), f"{name} {what}: {got.isnan().sum().item()} elements never written"
        err = qkn.error(got, ref, scale)
        assert err <= qkn.tolerance(dtype), f"{name} {what}: error {err:.3g} > {qkn.tolerance(dtype):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,wdtype", DTYPE_PAIRS, ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("d", qkn.HEAD_DIMS)
@pytest.mark.parametrize("tokens", (1, 7, 1000, 4097))
def test_rope(tokens, d, dtype, wdtype):
    """Norm then rotation against the float64 reference, tables in q's dtype and in fp32, for every thread
    layout (a shuffle partner tph / 2 lanes away at 8, 16 and 32 lanes a head; both chunks in one thread)."""
    gen = torch.Generator(device="cuda").manual_seed(tokens * d)
    hq, hk = MODEL
    q = _rand(tokens, hq, d, dtype=dtype, scale=3.0, gen=gen)
    k = _rand(tokens, hk, d, dtype=dtype, scale=0.5, shift=0.2, gen=gen)
    wq, wk = (_rand(d, dtype=wdtype, scale=0.3, shift=1.0, gen=gen) for _ in "qk")
    for table in dict.fromkeys((dtype, FP32)):
        cos, sin = _tables(tokens, d, table, gen)
        out = torch.full_like(q, math.nan), torch.full_like(k, math.nan)
        rosekernels.qk_norm(q, k, wq, wk, out_q=out[0], out_k=out[1], cos=cos, sin=sin)
        _check_rope(out, q, k, wq, wk, cos, sin, dtype, f"T={tokens} d={d} {dtype}/{wdtype} tables {table}")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (1, 16, 4097))
def test_rope_is_the_stock_qwen3_prologue_rounded_once(tokens):
    """Against transformers' own q_norm, k_norm and apply_rotary_pos_emb on Qwen3RotaryEmbedding's tables (the
    path rosekernels.hf replaces): each element as near the float64 result as stock's, which rounds four
    times, to within one rounding; and within one rounding of it."""
    q3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    config = q3.Qwen3Config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q = _rand(1, tokens, 32, 128, dtype=BF16, scale=3.0, gen=gen)
    k = _rand(1, tokens, 8, 128, dtype=BF16, scale=0.5, gen=gen)
    norms = [q3.Qwen3RMSNorm(128, eps=1e-6).to("cuda", BF16) for _ in "qk"]
    for n in norms:
        n.weight.data = _rand(128, dtype=BF16, scale=0.3, shift=1.0, gen=gen)
    position_ids = torch.arange(5000, 5000 + tokens, device="cuda")[None]
    cos, sin = q3.Qwen3RotaryEmbedding(config).to("cuda")(q, position_ids)
    stock_q, stock_k = q3.apply_rotary_pos_emb(norms[0](q).transpose(1, 2), norms[1](k).transpose(1, 2), cos, sin)
    out = rosekernels.qk_norm(q[0], k[0], norms[0].weight, norms[1].weight, cos=cos[0], sin=sin[0])
    inputs = (q[0], k[0], norms[0].weight, norms[1].weight, 1e-6, 0.0, cos[0], sin[0])
    for got, stock, ref, scale in zip(out, (stock_q[0].transpose(0, 1), stock_k[0].transpose(0, 1)),
                                      qkn.reference(*inputs), qkn.rope_scales(*inputs)):
        assert qkn.error(got, ref, scale) <= qkn.tolerance(BF16)
        ulp = (ref.abs() + scale * 2 ** -12).to(BF16).double() * 2 ** -7  # one bf16 step at the element
        assert ((got.double() - ref).abs() <= (stock.double() - ref).abs() + ulp).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (1, 1000))
def test_rope_in_place_on_qkv_views_with_strided_and_broadcast_tables(tokens):
    """In place on views of a fused qkv buffer, tables of every layout the op takes: cos and sin side by side
    in one buffer (row stride 2d), padded rows, and one row for every token (stride 0)."""
    hq, hk = MODEL
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    w = _rand(128, dtype=BF16, scale=0.3, shift=1.0, gen=gen)
    for stride in (256, 384, 0):
        qkv, q, k = _qkv(tokens, hq, hk, 128, BF16, seed=tokens + stride)
        q0, k0, v0 = q.clone(), k.clone(), qkv[:, (hq + hk) * 128:].clone()
        if stride:
            cos, sin = _tables(tokens, 128, BF16, gen, stride)
        else:
            cos, sin = (t[:1].expand(tokens, 128) for t in _tables(1, 128, BF16, gen))
        rosekernels.qk_norm(q, k, w, out_q=q, out_k=k, cos=cos, sin=sin)
        _check_rope((q, k), q0, k0, w, w, cos, sin, BF16, f"in place, tables of row stride {stride}")
        assert torch.equal(qkv[:, (hq + hk) * 128:], v0), "v was written"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (1, 4097))
def test_rope_in_a_cuda_graph_reads_the_tables_at_each_replay(tokens):
    hq, hk = MODEL
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q, k = _rand(tokens, hq, 128, dtype=BF16, gen=gen), _rand(tokens, hk, 128, dtype=BF16, gen=gen)
    wq, wk = _rand(128, dtype=BF16, shift=1.0, gen=gen), _rand(128, dtype=BF16, shift=1.0, gen=gen)
    cos, sin = _tables(tokens, 128, BF16, gen)
    out = torch.empty_like(q), torch.empty_like(k)
    rosekernels.qk_norm(q, k, wq, wk, out_q=out[0], out_k=out[1], cos=cos, sin=sin)  # compiled outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rosekernels.qk_norm(q, k, wq, wk, out_q=out[0], out_k=out[1], cos=cos, sin=sin)
    for seed in range(3):
        new_cos, new_sin = _tables(tokens, 128, BF16, torch.Generator(device="cuda").manual_seed(seed))
        cos.copy_(new_cos)
        sin.copy_(new_sin)
        q.copy_(_rand(*q.shape, dtype=BF16, scale=2.0, gen=gen))
        for o in out:
            o.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        _check_rope(out, q, k, wq, wk, cos, sin, BF16, f"replay {seed}")


def _qkv(tokens, hq, hk, d, dtype, pad=0, seed=0):
    """A fused qkv buffer (+pad columns) and q/k views into it."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = _rand(tokens, (hq + 2 * hk) * d + pad, dtype=dtype, scale=2.0, gen=gen)
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    return qkv, q, k


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (1, 7, 1000, 4097))
@pytest.mark.parametrize("d,dtype,pad", [(128, BF16, 0), (128, BF16, 64), (64, FP16, 8), (256, FP32, 4)])
def test_strided_qkv_views(tokens, d, dtype, pad):
    hq, hk = MODEL
    qkv, q, k = _qkv(tokens, hq, hk, d, dtype, pad, seed=tokens)
    before = qkv.clone()
    wq, wk = _rand(d, dtype=dtype, shift=1.0), _rand(d, dtype=dtype, shift=1.0)
    out_q, out_k = rosekernels.qk_norm(q, k, wq, wk)
    ref_q, ref_k = qkn.reference(q, k, wq, wk)
    _check(out_q, ref_q, dtype, "q")
    _check(out_k, ref_k, dtype, "k")
    assert torch.equal(qkv, before), "the input buffer was modified"
    # outputs may be strided too: write into another fused buffer
    qkv2, oq, ok = _qkv(tokens, hq, hk, d, dtype, pad, seed=tokens + 1)
    v_before = qkv2[:, (hq + hk) * d:].clone()
    rosekernels.qk_norm(q, k, wq, wk, out_q=oq, out_k=ok)
    _check(oq, ref_q, dtype, "strided out_q")
    _check(ok, ref_k, dtype, "strided out_k")
    assert torch.equal(qkv2[:, (hq + hk) * d:], v_before), "v or the padding was written"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (1, 3, 1000, 16384))
@pytest.mark.parametrize("dtype", (BF16, FP32), ids=str)
def test_in_place(tokens, dtype):
    hq, hk = MODEL
    qkv, q, k = _qkv(tokens, hq, hk, 128, dtype, seed=tokens)
    wq, wk = _rand(128, dtype=dtype, shift=1.0), _rand(128, dtype=dtype, shift=1.0)
    ref_q, ref_k = qkn.reference(q, k, wq, wk)
    v_before = qkv[:, (hq + hk) * 128:].clone()
    out_q, out_k = rosekernels.qk_norm(q, k, wq, wk, out_q=q, out_k=k)
    assert out_q is q and out_k is k
    _check(q, ref_q, dtype, "in-place q")
    _check(k, ref_k, dtype, "in-place k")
    assert torch.equal(qkv[:, (hq + hk) * 128:], v_before), "v was written"


@pytest.mark.gpu
def test_zero_tokens():
    q, k = torch.empty(0, 32, 128, device="cuda", dtype=BF16), torch.empty(0, 8, 128, device="cuda", dtype=BF16)
    w = torch.ones(128, device="cuda", dtype=BF16)
    out_q, out_k = rosekernels.qk_norm(q, k, w, w)
    assert out_q.shape == q.shape and out_k.shape == k.shape


@pytest.mark.gpu
def test_errors_on_gpu_after_a_good_call():
    """The cached fast path must still reject bad inputs of an already-seen shape, writing nothing."""
    hq, hk = MODEL
    tokens = 9
    qkv, q, k = _qkv(tokens, hq, hk, 128, BF16)
    w = _rand(128, dtype=BF16, shift=1.0)
    rosekernels.qk_norm(q, k, w, w)  # plans this shape: the calls below take the fast path
    out_q = torch.full_like(q, 7.0)
    out_k = torch.full_like(k, 7.0)
    rows = torch.randn(tokens, hq * 128 + 4, device="cuda").to(BF16)
    bad_q = rows[:, :hq * 128].view(tokens, hq, 128)  # row stride not a multiple of 16 bytes
    with pytest.raises(ValueError, match="aligned"):
        rosekernels.qk_norm(bad_q, k, w, w, out_q=out_q, out_k=out_k)
    with pytest.raises(TypeError, match="k_weight has dtype"):
        rosekernels.qk_norm(q, k, w, w.float(), out_q=out_q, out_k=out_k)
    with pytest.raises(ValueError, match="CUDA"):
        rosekernels.qk_norm(q, k.cpu(), w, w, out_q=out_q, out_k=out_k)
    with pytest.raises(ValueError, match="expanded"):  # the compiled checks let a zero stride through
        rosekernels.qk_norm(q, k, w, w, out_q=out_q, out_k=out_k[:1].expand(k.shape))
    torch.cuda.synchronize()
    assert (out_q == 7.0).all() and (out_k == 7.0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (1, 128, 4097))
def test_cuda_graph_capture(tokens):
    hq, hk = MODEL
    q, k = _rand(tokens, hq, 128, dtype=BF16), _rand(tokens, hk, 128, dtype=BF16)
    wq, wk = _rand(128, dtype=BF16, shift=1.0), _rand(128, dtype=BF16, shift=1.0)
    out_q, out_k = torch.empty_like(q), torch.empty_like(k)
    rosekernels.qk_norm(q, k, wq, wk, out_q=out_q, out_k=out_k)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rosekernels.qk_norm(q, k, wq, wk, out_q=out_q, out_k=out_k)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(100 + seed)
        q.copy_(_rand(*q.shape, dtype=BF16, scale=2.0, gen=gen))
        k.copy_(_rand(*k.shape, dtype=BF16, scale=2.0, gen=gen))
        out_q.fill_(math.nan)
        out_k.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        ref_q, ref_k = qkn.reference(q, k, wq, wk)
        _check(out_q, ref_q, BF16, f"graph replay {seed} q")
        _check(out_k, ref_k, BF16, f"graph replay {seed} k")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (1, 4097))
@pytest.mark.parametrize("enable_pdl", (True, False))
def test_a_chain_of_launches_in_a_graph_reads_each_previous_result(tokens, enable_pdl):
    """In-place norms back to back in a CUDA graph: each launch reads what the one before wrote, so a
    dependent launch that read before its predecessor finished (PDL done wrong) gives stale heads.
    The replay must equal the same launches run one at a time, each of those checked against the
    float64 reference of its own inputs."""
    hq, hk = MODEL
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q, k = _rand(tokens, hq, 128, dtype=BF16, scale=3.0, gen=gen), _rand(tokens, hk, 128, dtype=BF16, gen=gen)
    ws = [(_rand(128, dtype=BF16, scale=0.5, shift=1.0, gen=gen), _rand(128, dtype=BF16, scale=0.5, shift=1.0, gen=gen))
          for _ in range(6)]
    start_q, start_k = q.clone(), k.clone()
    rosekernels.qk_norm(q, k, *ws[0], out_q=q, out_k=k, enable_pdl=enable_pdl)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for wq, wk in ws:
            rosekernels.qk_norm(q, k, wq, wk, out_q=q, out_k=k, enable_pdl=enable_pdl)
    q.copy_(start_q)
    k.copy_(start_k)
    graph.replay()
    torch.cuda.synchronize()
    want_q, want_k = start_q, start_k
    for i, (wq, wk) in enumerate(ws):
        ref_q, ref_k = qkn.reference(want_q, want_k, wq, wk)
        rosekernels.qk_norm(want_q, want_k, wq, wk, out_q=want_q, out_k=want_k, enable_pdl=enable_pdl)
        torch.cuda.synchronize()
        _check(want_q, ref_q, BF16, f"launch {i} alone, q")
        _check(want_k, ref_k, BF16, f"launch {i} alone, k")
    assert torch.equal(q, want_q) and torch.equal(k, want_k), "the graph's chain differs from the launches one by one"


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", (False, True))
def test_torch_compile(in_place):
    hq, hk = MODEL

    def attention_prologue(qkv, wq, wk):
        q = qkv[:, :hq * 128].view(-1, hq, 128)
        k = qkv[:, hq * 128:(hq + hk) * 128].view(-1, hk, 128)
        # Scaled by powers of two after the norm: exact, so the float64 check still sees one rounding.
        if in_place:
            rosekernels.qk_norm(q, k, wq, wk, out_q=q, out_k=k)
            return q * 2.0, k * 0.5
        nq, nk = rosekernels.qk_norm(q, k, wq, wk, weight_bias=0.5)
        return nq * 2.0, nk * 0.5

    compiled = torch.compile(attention_prologue, fullgraph=True)
    for tokens in (5, 300):
        _, q, k = _qkv(tokens, hq, hk, 128, BF16, seed=tokens)
        wq, wk = _rand(128, dtype=BF16, shift=0.5), _rand(128, dtype=BF16, shift=0.5)
        qkv_a = torch.cat([q.flatten(1), k.flatten(1), torch.zeros(tokens, hk * 128, device="cuda", dtype=BF16)], 1)
        qkv_b = qkv_a.clone()
        got = compiled(qkv_a, wq, wk)
        want = attention_prologue(qkv_b, wq, wk)
        ref_q, ref_k = qkn.reference(q, k, wq, wk, weight_bias=0.0 if in_place else 0.5)
        _check(got[0], ref_q * 2.0, BF16, "compiled q")
        _check(got[1], ref_k * 0.5, BF16, "compiled k")
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        if in_place:
            torch.testing.assert_close(qkv_a, qkv_b, atol=0, rtol=0)


@pytest.mark.gpu
def test_workload():
    """The contract's workload (what the tuner runs): every listed config of one model runs on its
    args at the default size and at a random size of its mode, and passes the float64 check."""
    for cfg in qkn.variants_for():
        if (cfg.q_heads, cfg.k_heads) != MODEL:
            continue
        shape = qkn.Shape(qkn.Shape.defaults(cfg.mode).tokens, cfg.q_heads, cfg.k_heads, cfg.head_dim, cfg.dtype,
                          cfg.weight_dtype, cfg.eps, cfg.weight_bias, rope=None if cfg.rope == "none" else cfg.rope)
        w = qkn.workload(cfg, shape)
        for args in (w.make_args(1), w.sample(2)):
            w.run(w.kernel.fn, args)
            torch.cuda.synchronize()
            w.check(args)
