"""rmsnorm: specializations compile for sm_90a (CPU), argument checks (CPU), numerics (GPU).
Configs and their selection: test_rmsnorm_plan.py."""
import dataclasses
import math

import pytest
import torch

import rosekernels
from rosekernels import checks
from rosekernels.kernels import rmsnorm as rms
from rosekernels.kernels import rmsnorm_plan as plan
from rosekernels.models import ModelDims
import rosekernels.ops.rmsnorm  # noqa: F401  (registers torch.ops.rosekernels.rmsnorm)
from stub_launch import stub_launches

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _model(hidden, dtype="bf16"):
    """A model that needs rmsnorm at `hidden` (only the hidden size and dtype matter here)."""
    return ModelDims(f"hidden{hidden}", hidden, 4 * hidden, 1, 1, 128, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# CPU: compile every specialization.

def _cpu_configs():
    # All dtype x weight dtype x residual x mode combinations at one hidden size; other sizes
    # change the geometry (threads per row, ragged last column, warps per row), covered by bf16.
    out = [c for c in rms.variants_for() if c.hidden == 4096]
    out += [c for c in rms.variants_for([_model(n) for n in (64, 2880, 16384)]) if c.residual]
    out += [c for c in rms.variants_for([_model(16384, "fp32")]) if not c.residual]
    return out


@pytest.mark.parametrize("cfg", _cpu_configs(), ids=lambda c: c.variant().key())
def test_config_compiles(fresh_cache, cfg):
    kernel = rms.compile(cfg)
    assert kernel.cubin[:4] == b"\x7fELF" and kernel.variant == cfg.variant()
    assert callable(kernel.fn)


@pytest.mark.parametrize("residual", (False, True))
def test_pdl_switch(fresh_cache, tmp_path, residual):
    """With programmatic dependent launch the kernel waits for the previous one (ACQBULK) before its
    first load and releases the next one (PREEXIT) after its loads, before its stores; without it,
    neither. The key names the switch only when it is off."""
    from kernel_sass import opcodes_and_global_memory

    on, off = (rms.config_for(rms.Shape(1, residual=residual, pdl=pdl)) for pdl in (True, False))
    assert on.pdl and not off.pdl and on == dataclasses.replace(off, pdl=True)
    assert "pdl" not in on.variant().key() and "pdl=False" in off.variant().key()
    for cfg in (on, off):
        found = opcodes_and_global_memory(rms.compile(cfg), tmp_path)
        if found is None:
            pytest.skip("nvdisasm not found")
        ops, memory = found
        if cfg.pdl:
            assert ops.count("ACQBULK") == 1 and ops.count("PREEXIT") == 1
            release = ops.index("PREEXIT")
            assert ops.index("ACQBULK") < memory[0][0]
            assert {o for i, o in memory if i < release} == {"LDG"} and {o for i, o in memory if i > release} == {"STG"}
        else:
            assert "ACQBULK" not in ops and "PREEXIT" not in ops


def test_contract():
    assert rms.Config is plan.RMSNormConfig and rms.Shape is plan.RMSNormShape


def test_custom_op_registered():
    schema = str(torch.ops.rosekernels.rmsnorm.default._schema)
    assert "!) out" in schema and "!)? residual_out" in schema and "!) x" not in schema, schema
    # The e4m3 norm's own op: its scales are always given (torch 2.11 cannot trace a None mutable tensor).
    assert "scales" not in schema, schema
    assert "Tensor(c!) scales" in str(torch.ops.rosekernels.rmsnorm_fp8.default._schema)


# ---------------------------------------------------------------------------------------------
# CPU: argument validation fires before anything is compiled or launched.

@pytest.fixture
def no_launch(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("validation should have failed before compiling/launching")
    monkeypatch.setattr(rms, "compile", fail)


def _expect(exc, match, x, weight, **kwargs):
    out = None
    if isinstance(x, torch.Tensor) and x.dim() == 2 and "out" not in kwargs:
        out = kwargs["out"] = torch.full(x.shape, 7.0, dtype=x.dtype)
    with pytest.raises(exc, match=match):
        rosekernels.rmsnorm(x, weight, **kwargs)
    if out is not None:
        assert (out == 7.0).all(), "an output was written although the call failed"


def test_rejects_cpu_tensors(no_launch):
    _expect(ValueError, "CUDA", torch.randn(4, 256).to(BF16), torch.ones(256, dtype=BF16))


def test_rejects_dtype_mismatch(no_launch):
    x, w = torch.randn(4, 256).to(BF16), torch.ones(256, dtype=BF16)
    _expect(TypeError, "weight has dtype", x, w.half())
    _expect(TypeError, "residual has dtype", x, w, residual=x.float())
    _expect(TypeError, "x has dtype", x.double(), w.double())


def test_rejects_bad_shapes(no_launch):
    x, w = torch.randn(4, 256).to(BF16), torch.ones(256, dtype=BF16)
    _expect(ValueError, "weight has shape", x, w[:128])
    _expect(ValueError, "residual has shape", x, w, residual=x[:2])
    # [..., N] is normed as rows: the others must have x's shape, not only its number of rows.
    x3 = torch.randn(2, 3, 256).to(BF16)
    _expect(ValueError, "residual has shape", x3, w, residual=torch.randn(3, 2, 256).to(BF16))
    _expect(ValueError, "residual has shape", x3, w, residual=torch.randn(6, 256).to(BF16))
    _expect(ValueError, "out has shape", x3, w, out=torch.full((1, 6, 256), 7.0, dtype=BF16))
    _expect(ValueError, "hidden size 100", torch.randn(4, 100).to(BF16), torch.ones(100, dtype=BF16))
    _expect(ValueError, "hidden size 32768", torch.randn(2, 32768).to(BF16), torch.ones(32768, dtype=BF16))


def test_rejects_strides_and_alignment(no_launch):
    w = torch.ones(256, dtype=BF16)
    _expect(ValueError, "unit stride", torch.randn(4, 512).to(BF16)[:, ::2], w)
    _expect(ValueError, "aligned", torch.randn(4, 260).to(BF16)[:, :256], w)  # row stride 520 bytes
    _expect(ValueError, "aligned", torch.randn(4 * 256 + 1).to(BF16)[1:].view(4, 256), w)
    x = torch.randn(4, 256).to(BF16)
    _expect(ValueError, "expanded", x, w, out=torch.zeros(1, 256, dtype=BF16).expand(4, 256))  # rows race
    _expect(ValueError, "expanded", x, w, residual=x.clone(), residual_out=torch.zeros(1, 256, dtype=BF16).expand(4, 256))


@pytest.fixture
def launches(monkeypatch):
    return stub_launches(monkeypatch, rms, rosekernels.ops.rmsnorm)


def test_a_planned_signature_still_refuses_outputs_whose_rows_overlap(launches):
    """The fast path of a planned signature skips the full checks; an output whose rows overlap (which the
    compiled host checks let through) must not take it (CPU: the launch stubbed)."""
    x, w, r = torch.randn(4, 256).to(BF16), torch.ones(256, dtype=BF16), torch.randn(4, 256).to(BF16)
    rosekernels.rmsnorm(x, w, out=torch.empty(4, 256, dtype=BF16))
    rosekernels.rmsnorm(x, w, residual=r, residual_out=torch.empty(4, 256, dtype=BF16))
    assert len(launches) == 2
    rows_overlap = torch.empty(4 * 128 + 128, dtype=BF16).as_strided((4, 256), (128, 1))  # row stride < row
    with pytest.raises(ValueError, match="out's elements overlap"):
        rosekernels.rmsnorm(x, w, out=rows_overlap)
    with pytest.raises(ValueError, match="residual_out's elements overlap"):
        rosekernels.rmsnorm(x, w, residual=r, residual_out=rows_overlap)
    assert len(launches) == 2


def test_outputs_may_alias_inputs_only_in_place(launches):
    """out may be x and residual_out residual (the same elements); no other output may share memory with an
    input or another output: refused with nothing launched, also on a planned signature, whose fast path tests
    only the addresses (CPU: the launch stubbed)."""
    w = torch.ones(256, dtype=BF16)
    for _ in range(2):  # planned, then the fast path
        x, r = torch.randn(2, 3, 256).to(BF16), torch.randn(2, 3, 256).to(BF16)
        out, h = rosekernels.rmsnorm(x, w, residual=r, out=x, residual_out=r)
        assert out is x and h is r
        flat = torch.randn(4, 256).to(BF16)
        assert rosekernels.rmsnorm(flat, w, out=flat) is flat
    assert len(launches) == 4
    buf, r = torch.randn(5, 256).to(BF16), torch.randn(4, 256).to(BF16)
    x = buf[:4]
    rosekernels.rmsnorm(x, w, residual=r, out=torch.empty(4, 256, dtype=BF16), residual_out=torch.empty_like(r))
    assert len(launches) == 5
    rosekernels.rmsnorm(x, w, residual=r, residual_out=r[:])  # another view of the same elements is in place too
    assert len(launches) == 6
    one = torch.randn(1, 256).to(BF16)
    assert rosekernels.rmsnorm(one, w, out=one.as_strided((1, 256), (512, 1))).data_ptr() == one.data_ptr()
    assert len(launches) == 7  # a size-1 dim's stride addresses nothing: the same elements
    wbuf = torch.ones(5, 256, dtype=BF16)
    for args, kwargs, match in [((x, w), dict(out=buf[1:]), "out must not overlap x"),
                                ((x, w), dict(residual=r, out=r, residual_out=r), "out must not overlap residual"),
                                ((x, w), dict(residual=r, residual_out=x), "residual_out must not overlap x"),
                                ((x, w), dict(residual=r, residual_out=buf[1:]), "residual_out must not overlap x"),
                                ((x, wbuf[0]), dict(out=wbuf[:4]), "out must not overlap weight")]:
        with pytest.raises(ValueError, match=match):
            rosekernels.rmsnorm(*args, **kwargs)
    assert len(launches) == 7


def test_meta_tensors_take_the_registered_op(no_launch):
    x, r = torch.empty(2, 3, 256, device="meta"), torch.empty(2, 3, 256, device="meta")
    out, h = rosekernels.rmsnorm(x, torch.empty(256, device="meta"), residual=r)
    assert out.is_meta and out.shape == h.shape == x.shape


# ---------------------------------------------------------------------------------------------
# GPU: numerics against a float64 reference.

ROWS = (1, 3, 128, 1000, 4097)
HIDDEN = (64, 136, 2048, 2880, 4096, 5120, 8192, 16384)
DTYPE_PAIRS = ((BF16, BF16), (BF16, FP32), (FP16, FP16), (FP32, FP32))


def _rand(*shape, dtype, scale=1.0, shift=0.0, gen=None):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale + shift).to(dtype)


def _check(got, ref, dtype, what=""):
    assert not got.isnan().any(), f"{what}: {got.isnan().sum().item()} elements never written"
    err = checks.relative_error(got, ref)
    assert err <= rms.tolerance(dtype), f"{what}: error {err:.3g} > {rms.tolerance(dtype):.3g}"


def _case(rows, hidden, dtype, wdtype, residual, eps=1e-6, seed=0, row_pad=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = _rand(rows, hidden + row_pad, dtype=dtype, scale=2.0, gen=gen)[:, :hidden]
    w = _rand(hidden, dtype=wdtype, scale=0.2, shift=1.0, gen=gen)
    r = _rand(rows, hidden, dtype=dtype, gen=gen) if residual else None
    out = torch.full((rows, hidden), math.nan, device="cuda", dtype=dtype)
    res_out = torch.full_like(out, math.nan) if residual else None
    x0 = x.clone()
    got = rosekernels.rmsnorm(x, w, eps=eps, residual=r, out=out, residual_out=res_out)
    ref_out, ref_h = rms.reference(x, w, eps, r)
    what = f"rows={rows} hidden={hidden} {dtype}/{wdtype} residual={residual} pad={row_pad}"
    if residual:
        assert got[0] is out and got[1] is res_out
        _check(res_out, ref_h, dtype, "residual_out " + what)
    else:
        assert got is out
    _check(out, ref_out, dtype, "out " + what)
    assert torch.equal(x, x0), "x modified"


@pytest.mark.gpu
@pytest.mark.parametrize("residual", (False, True))
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_sizes_bf16(rows, hidden, residual):
    _case(rows, hidden, BF16, BF16, residual, seed=rows + hidden)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,wdtype", DTYPE_PAIRS, ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("hidden", (128, 2880, 4096, 16384))
@pytest.mark.parametrize("residual", (False, True))
def test_dtypes(hidden, dtype, wdtype, residual):
    for rows in (2, 1000):
        _case(rows, hidden, dtype, wdtype, residual, eps=1e-5, seed=hidden)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,pad", [(4096, 8), (2880, 64), (136, 8)])
def test_strided_rows(hidden, pad):
    for rows in (1, 77, 4097):
        _case(rows, hidden, BF16, BF16, True, row_pad=pad, seed=rows)


@pytest.mark.gpu
def test_in_place_residual_and_3d():
    x = _rand(2, 33, 4096, dtype=BF16, scale=2.0)
    r = _rand(2, 33, 4096, dtype=BF16)
    w = _rand(4096, dtype=BF16, shift=1.0)
    ref_out, ref_h = rms.reference(x.view(-1, 4096), w, 1e-6, r.view(-1, 4096))
    out, h = rosekernels.rmsnorm(x, w, residual=r, residual_out=r)
    assert h is r and out.shape == x.shape
    _check(out.view(-1, 4096), ref_out, BF16, "3d out")
    _check(r.view(-1, 4096), ref_h, BF16, "in-place residual")
    ref_y = rms.reference(x.view(-1, 4096), w)[0]
    y = rosekernels.rmsnorm(x, w, out=x)  # in place on x
    assert y.data_ptr() == x.data_ptr()
    _check(x.view(-1, 4096), ref_y, BF16, "in-place x")


@pytest.mark.gpu
def test_errors_on_gpu_after_a_good_call():
    x, w = _rand(6, 4096, dtype=BF16), _rand(4096, dtype=BF16, shift=1.0)
    rosekernels.rmsnorm(x, w)
    out = torch.full_like(x, 7.0)
    bad = torch.randn(6, 4096 + 4, device="cuda").to(BF16)[:, :4096]
    with pytest.raises(ValueError, match="aligned"):
        rosekernels.rmsnorm(bad, w, out=out)
    with pytest.raises(TypeError, match="weight has dtype"):
        rosekernels.rmsnorm(x, w.half(), out=out)
    torch.cuda.synchronize()
    assert (out == 7.0).all()


@pytest.mark.gpu
def test_cuda_graph_and_compile():
    x, r = _rand(64, 4096, dtype=BF16), _rand(64, 4096, dtype=BF16)
    w = _rand(4096, dtype=BF16, shift=1.0)
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    rosekernels.rmsnorm(x, w, residual=r, out=out, residual_out=res_out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rosekernels.rmsnorm(x, w, residual=r, out=out, residual_out=res_out)
    x.copy_(_rand(64, 4096, dtype=BF16, scale=3.0))
    out.fill_(math.nan)
    res_out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_h = rms.reference(x, w, 1e-6, r)
    _check(out, ref_out, BF16, "graph out")
    _check(res_out, ref_h, BF16, "graph residual")

    def block(x, r, w):
        return rosekernels.rmsnorm(x * 0.5, w, residual=r)  # x * 0.5 is exact: both paths feed the kernel equal bits

    compiled = torch.compile(block, fullgraph=True)
    for got, want in zip(compiled(x, r, w), block(x, r, w)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", (1, 4097))
@pytest.mark.parametrize("enable_pdl", (True, False))
def test_a_chain_of_launches_in_a_graph_reads_each_previous_result(rows, enable_pdl):
    """Residual norms back to back in a CUDA graph, each reading the output and residual the one
    before wrote in place: a dependent launch that read before its predecessor finished (PDL done
    wrong) gives stale rows. The replay must equal the same launches run one at a time, each of
    those checked against the float64 reference of its own inputs."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x, r = _rand(rows, 4096, dtype=BF16, scale=2.0, gen=gen), _rand(rows, 4096, dtype=BF16, gen=gen)
    ws = [_rand(4096, dtype=BF16, scale=0.5, shift=1.0, gen=gen) for _ in range(6)]
    start_x, start_r = x.clone(), r.clone()
    rosekernels.rmsnorm(x, ws[0], residual=r, out=x, residual_out=r, enable_pdl=enable_pdl)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            rosekernels.rmsnorm(x, w, residual=r, out=x, residual_out=r, enable_pdl=enable_pdl)
    x.copy_(start_x)
    r.copy_(start_r)
    graph.replay()
    torch.cuda.synchronize()
    want_x, want_r = start_x, start_r
    for i, w in enumerate(ws):
        ref_out, ref_h = rms.reference(want_x, w, 1e-6, want_r)
        rosekernels.rmsnorm(want_x, w, residual=want_r, out=want_x, residual_out=want_r, enable_pdl=enable_pdl)
        torch.cuda.synchronize()
        _check(want_x, ref_out, BF16, f"launch {i} alone, out")
        _check(want_r, ref_h, BF16, f"launch {i} alone, residual")
    assert torch.equal(x, want_x) and torch.equal(r, want_r), "the graph's chain differs from the launches one by one"


@pytest.mark.gpu
def test_workload():
    """The contract's workload (what the tuner runs): every listed config at two hidden sizes runs on
    its args at the default size and at a random size of its mode, and passes the float64 check."""
    configs = [c for c in rms.variants_for() if c.hidden == 4096]
    configs += rms.variants_for([_model(2880, dt) for dt in ("bf16", "fp16", "fp32")])
    for cfg in configs:
        shape = rms.Shape(rms.Shape.defaults(cfg.mode).rows, cfg.hidden, cfg.dtype, cfg.weight_dtype, cfg.residual,
                          cfg.eps)
        w = rms.workload(cfg, shape)
        for args in (w.make_args(1), w.sample(2)):
            w.run(w.kernel.fn, args)
            torch.cuda.synchronize()
            w.check(args)
