"""gemm_leakyrelu: every specialization compiles for sm_90a (with HGMMA), argument errors fire before
any launch (CPU); results match a float64 reference on fresh random inputs (GPU). The cost models and
heuristics are tested without CuTeDSL in test_gemm_leakyrelu_plan.py."""
import dataclasses
import re

import pytest
import torch

from grid import sample
from kernel_sass import sass_of
import rosekernels
from rosekernels import checks, launch
from rosekernels.kernels import gemm_leakyrelu as glr
from rosekernels.kernels import gemm_leakyrelu_plan as plan
from rosekernels.kernels import gemm_splitk as splitk
from rosekernels.ops import gemm as gemm_op

# ---------------------------------------------------------------------------------------------
# CPU: compilation.

# Each prefill tile shape and a spread of decode tiles, both B orders, all bias kinds, both
# dtypes; the rest under `slow` (sampled in CI: `grid`).
_SPECS = glr.variants_for()
_QUICK = [c for c in _SPECS if c.dtype == "bf16" and c.b_major == "k" and c.bias == "none" and not c.split_k]
_QUICK += [glr.Config(b_major="n", bias="fp32"),
           glr.Config(tile_m=64, tile_n=128, cluster_m=1, split_k=True),
           glr.Config(tile_m=64, tile_n=128, cluster_m=1, split_k=True, a_rows=8),
           glr.Config(dtype="fp16", bias="fp32", tile_m=64, tile_n=256, cluster_m=1,
                      split_k=True, b_major="n", a_rows=32),
           glr.Config(tile_m=128, tile_n=256, cluster_m=1, split_k=True, bias="bf16"),
           glr.Config(dtype="fp16", bias="fp32", tile_m=64, tile_n=64, cluster_m=1,
                      split_k=True, b_major="n"),
           glr.Config(dtype="fp16", bias="fp16", tile_m=128, tile_n=128, cluster_m=1,
                      split_k=True, b_major="n"),
           glr.Config(tile_m=64, tile_n=8, cluster_m=1, split_k=True, swap_ab=True),
           glr.Config(activation="silu", gated=True, bias="fp32"),
           glr.Config(tile_m=128, tile_n=128, pingpong=True, activation="gelu_tanh", gated=True),
           glr.Config(tile_m=64, tile_n=128, cluster_m=1, split_k=True, a_rows=16, activation="relu", gated=True),
           glr.Config(tile_m=128, tile_n=32, cluster_m=1, split_k=True, swap_ab=True, activation="silu", gated=True),
           glr.Config(tile_m=128, tile_n=8, cluster_m=1, split_k=True, swap_ab=True, activation="silu", gated=True),
           glr.Config(dtype="fp16", bias="fp32", tile_m=128, tile_n=96, cluster_m=1, split_k=True,
                      swap_ab=True, b_major="n"),
           glr.Config(tile_m=128, tile_n=144, cluster_m=1, split_k=True, bias="fp32"),
           glr.Config(tile_m=64, tile_n=64, cluster_m=1, cluster_n=2, split_k=True, swap_ab=True),
           glr.Config(tile_m=64, tile_n=16, cluster_m=1, cluster_n=2, split_k=True, swap_ab=True, bias="fp32",
                      activation="silu", gated=True),
           glr.Config(tile_m=64, tile_n=32, cluster_m=2, cluster_n=2, split_k=True, swap_ab=True),
           glr.Config(tile_m=64, tile_n=64, cluster_m=2, cluster_n=1, split_k=True, swap_ab=True),
           glr.Config(tile_m=64, tile_n=8, cluster_m=4, cluster_n=1, split_k=True, swap_ab=True),
           glr.Config(tile_m=64, tile_n=32, cluster_m=2, cluster_n=4, split_k=True, swap_ab=True, bias="bf16",
                      activation="silu", gated=True),
           glr.Config(tile_m=64, tile_n=96, cluster_m=2, cluster_n=2, split_k=True),
           glr.Config(tile_m=128, tile_n=112, cluster_m=1, cluster_n=4, split_k=True, bias="bf16"),
           glr.Config(tile_m=128, tile_n=96, cluster_m=4, cluster_n=1, split_k=True, swap_ab=True)]


def _compile_and_inspect(cfg, tmp_path):
    kernel = glr.compile(cfg)
    assert kernel.variant.mode == cfg.mode
    sass = sass_of(kernel, tmp_path)
    if sass is None:
        pytest.skip("nvdisasm not found: compiled, SASS not inspected")
    ops = set(re.findall(r"\b(HGMMA|UTMALDG|UTMASTG|STSM|LDL|STL|STG\.E\.U16|STG\.E\.128|LDG\.E\.128)\b", sass))
    # Swapped tiles store out^T element by element from registers; the others through shared
    # memory (stmatrix) and TMA.
    stores = {"STG.E.U16"} if cfg.swap_ab else {"UTMASTG", "STSM"}
    assert {"HGMMA", "UTMALDG"} | stores <= ops, (cfg, ops)
    assert not {"LDL", "STL"} & ops, f"{cfg}: register spills"
    if cfg.split_k:  # split-K partials move as 16-byte vectors
        assert {"STG.E.128", "LDG.E.128"} <= ops, (cfg, ops)
    # Decode (split-K) tiles of K-major weights send their first weight k-tiles toward the L2 before
    # griddepcontrol.wait (ACQBULK); the others prefetch nothing.
    prefetch, wait = sass.find("UTMAPF.L2"), sass.find("ACQBULK")
    assert wait >= 0, f"{cfg}: no griddepcontrol.wait"
    if cfg.split_k and cfg.b_major == "k":
        assert 0 <= prefetch < wait, f"{cfg}: no weight prefetch before griddepcontrol.wait"
    else:
        assert prefetch < 0, f"{cfg}: prefetches (a prefill tile, or N-major weights)"


@pytest.mark.parametrize("cfg", _QUICK, ids=lambda c: c.variant().key())
def test_compiles_for_sm90a(cfg, tmp_path):
    _compile_and_inspect(cfg, tmp_path)


def _kind(c):
    return "swapped" if c.swap_ab else "split-K" if c.split_k else "pingpong" if c.pingpong else "prefill"


# The rest of the specializations: CI compiles a sample holding every kind of tile (clustered or not,
# a_rows or not) with every dtype, B order and bias, and every tile shape and cluster of every kind
# (tests/support/grid.py); the GPU suite compiles all of them.
_REST = sample([c for c in _SPECS if c not in _QUICK],
               [lambda c: (_kind(c), c.a_rows != c.tile_m, c.cluster_m * c.cluster_n > 1, c.dtype, c.b_major, c.bias),
                lambda c: (_kind(c), c.tile_m, c.tile_n, c.a_rows, c.cluster_m, c.cluster_n)],
               key=lambda c: c.variant().key())


@pytest.mark.slow
@pytest.mark.grid
@pytest.mark.parametrize("cfg", _REST, ids=lambda c: c.variant().key())
def test_every_specialization_compiles(cfg, tmp_path):
    _compile_and_inspect(cfg, tmp_path)


def test_pdl_switch_is_a_launch_attribute(tmp_path):
    """enable_pdl=False: its own variant (the key names it only when off), every candidate keeps it,
    and the device code is the same cubin (the kernel waits and releases either way; only the launch
    attribute differs)."""
    on, off = (plan.config_for(plan.GemmShape(16, 4096, 4096, activation="none", pdl=pdl), 132)
               for pdl in (True, False))
    assert on.pdl and not off.pdl and dataclasses.replace(off, pdl=True) == on
    assert "pdl" not in on.variant().key() and "pdl=False" in off.variant().key()
    assert all(not c.pdl for c in plan.candidates(plan.GemmShape(16, 4096, 4096, pdl=False), 132))
    assert glr.compile(on).cubin_sha256 == glr.compile(off).cubin_sha256


def test_module_follows_the_contract():
    assert glr.Config is plan.GemmConfig and glr.Shape is plan.GemmShape


@pytest.mark.parametrize("a_rows", plan.A_ROWS)
@pytest.mark.parametrize("tile_n", sorted(plan.DECODE_TILE_N))
def test_a_smem_layouts(a_rows, tile_n):
    """The TMA view of the A stages is the first a_rows rows of the WGMMA view (same swizzle,
    same offsets), stages sit a_rows * 128 bytes apart (a multiple of the 1024-byte swizzle
    period) and the stage count the kernel derives fits shared memory. Device internals: the
    kernel class and its layout helper have no public counterpart."""
    import cutlass
    import cutlass.cute as cute

    cfg = glr.Config(tile_m=64, tile_n=tile_n, cluster_m=1, split_k=True, a_rows=a_rows)
    stages = glr._GemmLeakyReluSm90(cfg).ab_stage
    whole = glr._GemmLeakyReluSm90(glr.Config(tile_m=64, tile_n=tile_n, cluster_m=1, split_k=True))
    assert stages >= whole.ab_stage, "packing the A stages must not cost stages of weights"
    found = {}

    coords = [(r, c, s) for s in (0, 1, stages - 1) for r in range(a_rows) for c in (0, 1, 7, 8, 31, 63)]

    @cute.jit
    def check():  # plain Python values out: no control flow inside the traced function
        mma, load = splitk.a_smem_layouts(cfg, cutlass.BFloat16, stages)
        found["swizzles"] = (str(mma.inner), str(load.inner))
        found["load_shape"] = str(cute.shape(load.outer))
        found["cosize"] = cute.cosize(mma.outer)
        found["load"] = [load.outer(c) for c in coords]
        found["mma"] = [mma.outer(c) for c in coords]
        found["stage_starts"] = [mma.outer((0, 0, s)) for s in range(stages)]

    cute.compile(check)  # traces (and checks) without a GPU
    assert found["swizzles"][0] == found["swizzles"][1] == "S<3,4,3>"
    assert found["load"] == found["mma"]
    assert all(isinstance(x, int) for x in found["mma"]), "layouts must be static"
    starts = found["stage_starts"]
    assert starts == [s * a_rows * plan.TILE_K for s in range(stages)]
    assert all(x * 2 % 1024 == 0 for x in starts), "stages must keep the 1024-byte swizzle phase"
    # The last stage's 64-row WGMMA view ends inside the buffer.
    assert found["cosize"] == (stages - 1) * a_rows * plan.TILE_K + 64 * plan.TILE_K


def test_a_rows_variant_refuses_larger_m():
    cfg = glr.Config(tile_m=64, tile_n=128, cluster_m=1, split_k=True, a_rows=8)
    with pytest.raises(ValueError, match="loads 8 rows of A: M = 9"):
        gemm_op.run(_cpu(9, 64), _cpu(128, 64), None, _cpu(9, 128), cfg)
    with pytest.raises(ValueError, match="loads 8 rows of A: M = 9"):
        glr.workload(cfg, glr.Shape(9, 128, 64))


def test_workload_refuses_a_shape_its_config_does_not_serve():
    cfg = glr.config_for(glr.Shape(16, 4096, 4096), 132)
    with pytest.raises(ValueError, match="does not serve"):
        glr.workload(cfg, glr.Shape(16, 4096, 4096, dtype="fp16"))
    with pytest.raises(ValueError, match="does not serve"):
        glr.workload(cfg, glr.Shape(16, 4096, 4096, slope=0.2))


# ---------------------------------------------------------------------------------------------
# CPU: argument errors fire before anything runs (CPU tensors never reach a kernel: the device
# check comes last, so every other error is reachable without a GPU).


def _cpu(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize("case, error, match", [
    (dict(a=_cpu(4, 16, dtype=torch.float32), b=_cpu(8, 16, dtype=torch.float32)), TypeError, "a has dtype"),
    (dict(a=_cpu(4, 16), b=_cpu(8, 16, dtype=torch.float16)), TypeError, "must match"),
    (dict(a=_cpu(4, 16), b=_cpu(8, 24)), ValueError, "K ="),
    (dict(a=_cpu(4, 12), b=_cpu(8, 12)), ValueError, "multiples of 8"),
    (dict(a=_cpu(4, 16), b=_cpu(12, 16)), ValueError, "multiples of 8"),
    (dict(a=_cpu(4, 16, 2), b=_cpu(8, 16)), ValueError, "2-D"),
    (dict(a=_cpu(4, 16), b=_cpu(8, 16), bias=_cpu(16)), ValueError, "bias has shape"),
    (dict(a=_cpu(4, 16), b=_cpu(8, 16), bias=_cpu(8, dtype=torch.int32)), TypeError, "bias has dtype"),
    (dict(a=_cpu(4, 16), b=_cpu(8, 16), bias=_cpu(16)[::2]), ValueError, "contiguous"),
    (dict(a=_cpu(4, 16), b=_cpu(8, 16), out=_cpu(4, 8, dtype=torch.float32)), TypeError, "out has dtype"),
    (dict(a=_cpu(4, 16), b=_cpu(8, 16), out=_cpu(4, 16)), ValueError, "out has shape"),
    (dict(a=_cpu(4, 16), b=_cpu(8, 16), out=_cpu(8, 4).t()), ValueError, "unit stride"),
    (dict(a=_cpu(16, 4).t(), b=_cpu(8, 16)), ValueError, "unit stride"),
    (dict(a=_cpu(4, 20)[:, :16], b=_cpu(8, 16)), ValueError, "aligned"),
    (dict(a=_cpu(4, 16), b=_cpu(8, 16, 2)[:, :, 0]), ValueError, "contiguous along N or K"),
    (dict(a=_cpu(4, 16), b=_cpu(8, 16), b_layout="mk"), ValueError, "b_layout"),
    (dict(a=_cpu(4, 16), b=_cpu(8, 16), b_layout="kn"), ValueError, "K ="),
    (dict(a=_cpu(4, 16), b=_cpu(8, 16)), ValueError, "CUDA device"),
])
def test_argument_errors(case, error, match):
    with pytest.raises(error, match=match):
        rosekernels.gemm_leakyrelu(**case)


def test_registered_op_checks_too():
    out = _cpu(4, 8)
    with pytest.raises(ValueError, match="multiples of 8"):
        torch.ops.rosekernels.gemm_leakyrelu(_cpu(4, 12), _cpu(8, 12), None, out, 0.01)
    with pytest.raises(ValueError, match="CUDA device"):
        torch.ops.rosekernels.gemm_leakyrelu(_cpu(4, 16), _cpu(8, 16), None, out, 0.01)


def test_out_overlapping_an_input_is_rejected():
    buf = _cpu(64, 16)
    with pytest.raises(ValueError, match="overlap a"):
        rosekernels.gemm_leakyrelu(buf[:4], _cpu(8, 16), out=buf[2:6, :8])


def test_out_may_interleave_rows_with_a_but_not_share_its_elements(monkeypatch):
    """a and out as column blocks of one [M, K + N] buffer share a span, not an element: the kernel reads only
    a's and writes only out's (TMA clips to each tensor), so the call launches, planned and then on its fast
    path; an out of the same strides half a row over, on a's elements, is refused by the fast path with nothing
    launched (CPU: the device parts stubbed)."""
    from stub_launch import stub_launches

    launched = stub_launches(monkeypatch, glr, gemm_op)
    monkeypatch.setattr(gemm_op, "config_for", lambda shape, sms=None: glr.Config(activation="none"))  # no split-K
    buf, w = _cpu(5, 64 + 32), _cpu(32, 64)
    for _ in range(2):
        rosekernels.gemm(buf[:4, :64], w, out=buf[:4, 64:])
    assert len(launched) == 2
    with pytest.raises(ValueError, match="out must not overlap a"):
        rosekernels.gemm(buf[:4, :64], w, out=buf[1:5, 32:64])
    assert len(launched) == 2


def test_an_expanded_out_is_rejected():
    with pytest.raises(ValueError, match="expanded"):
        rosekernels.gemm_leakyrelu(_cpu(4, 16), _cpu(8, 16), out=torch.zeros(1, 8, dtype=torch.bfloat16).expand(4, 8))


def test_a_failed_launch_of_a_gated_plan_raises_its_own_error(monkeypatch):
    """After a failed launch the op re-checks the arguments to name what is wrong: a gated plan's good
    arguments pass those checks (out [M, N / 2]), so the launch's own error comes through (CPU: the device
    parts stubbed, the compiled function raising)."""
    from types import SimpleNamespace

    from rosekernels import modes, tuned

    def fail(*args):
        raise RuntimeError("the launch failed")

    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(modes, "sm_count", lambda *args: 132)
    monkeypatch.setattr(modes, "max_active_clusters", lambda *args: 66)
    monkeypatch.setattr(tuned, "tuned_config", lambda module, shape, config, sms=None: config)
    monkeypatch.setattr(launch, "on_device", lambda device, fn, *args: fn(*args))
    monkeypatch.setattr(glr, "compile", lambda config: SimpleNamespace(fn=fail))
    monkeypatch.setattr(gemm_op, "_plans", launch.PlanCache())
    monkeypatch.setattr(gemm_op, "config_for", lambda shape, sms=None: glr.Config(activation="silu", gated=True))
    with pytest.raises(RuntimeError, match="the launch failed"):
        rosekernels.gemm(_cpu(4, 64), _cpu(32, 64), activation="silu", gated=True)


def test_meta_tensors_infer_shapes_and_check_them():
    """Meta (and torch.compile's fake) tensors take the op's fake path: shapes are checked too."""
    a = torch.empty(4, 16, dtype=torch.bfloat16, device="meta")
    out = rosekernels.gemm_leakyrelu(a, torch.empty(16, 8, dtype=torch.bfloat16, device="meta"), b_layout="kn")
    assert out.shape == (4, 8) and out.device.type == "meta"
    with pytest.raises(ValueError, match="multiples of 8"):
        rosekernels.gemm_leakyrelu(a, torch.empty(12, 16, dtype=torch.bfloat16, device="meta"))


# ---------------------------------------------------------------------------------------------
# GPU: correctness.

_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(m, n, k, dtype, b_layout="nk", bias=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(dtype)
    b = w if b_layout == "nk" else w.t().contiguous()
    bias_t = None
    if bias is not None:
        bias_t = torch.randn(n, generator=g, device="cuda").to(bias)
    return a, b, bias_t


def _reference(a, b, bias, slope, b_layout="nk"):
    w = b.double() if b_layout == "nk" else b.double().t()
    ref = a.double() @ w.t()
    if bias is not None:
        ref += bias.double()
    return torch.nn.functional.leaky_relu(ref, slope)


def _assert_close(out, ref, dtype, what=""):
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), f"{what}: unwritten (NaN) or non-finite elements"
    o = out.double()
    rel = ((o - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3), f"{what}: relative error {rel:.3g}"
    # Against the reference rounded like the output: at most one ulp of the output type apart.
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    rounded = ref.to(dtype).double()
    excess = (o - rounded).abs() - (ulp * 1.01 * ref.abs() + 1e-4)
    worst = excess.argmax()
    assert excess.max() <= 0, (f"{what}: element {divmod(worst.item(), out.shape[1])} = "
                               f"{o.flatten()[worst].item()}, reference {ref.flatten()[worst].item()}")


def _run(m, n, k, dtype=torch.bfloat16, b_layout="nk", bias=None, slope=0.01, seed=0):
    a, b, bias_t = _inputs(m, n, k, dtype, b_layout, bias, seed)
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    res = rosekernels.gemm_leakyrelu(a, b, slope, bias=bias_t, out=out, b_layout=b_layout)
    assert res is out
    _assert_close(out, _reference(a, b, bias_t, slope, b_layout), dtype,
                  f"m={m} n={n} k={k} {dtype} {b_layout} bias={bias} slope={slope}")
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 129, 1000])
@pytest.mark.parametrize("n", [8, 136, 4104])
@pytest.mark.parametrize("k", [8, 72, 4104])
def test_ragged_shapes(m, n, k):
    _run(m, n, k, bias=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 96, 1000])
def test_without_pdl_the_results_are_bitwise_the_same(m):
    a, b, bias_t = _inputs(m, 4104, 4096, torch.bfloat16, "nk", torch.bfloat16, seed=m)
    with_pdl = rosekernels.gemm(a, b, bias_t, activation="silu")
    without = rosekernels.gemm(a, b, bias_t, activation="silu", enable_pdl=False)
    assert torch.equal(with_pdl, without)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
@pytest.mark.parametrize("bias", [None, "same", torch.float32])
@pytest.mark.parametrize("m", [7, 1000])
def test_layouts_and_bias(dtype, b_layout, bias, m):
    _run(m, 136, 4104, dtype, b_layout, dtype if bias == "same" else bias)


@pytest.mark.gpu
@pytest.mark.parametrize("slope", [0.2, -0.5, 1.5, 0.0])
@pytest.mark.parametrize("m", [7, 1000])
def test_slopes(slope, m):
    _run(m, 264, 200, torch.float16, "kn", torch.float32, slope=slope)


def _every_config():
    return [dataclasses.replace(c, dtype=dt, b_major=bm, bias=bias, slope=0.2)
            for c in glr.variants_for() if c.dtype == "bf16" and c.b_major == "k" and c.bias == "none"
            for dt, bm, bias in [("bf16", "k", "bf16"), ("fp16", "n", "fp32")]]


# Every config on every shape it takes (a_rows variants only take M <= a_rows) in the GPU suite; a plain
# run samples them: every tile shape and cluster of every kind, every shape with every kind and epilogue.
_TILE_CASES = sample(
    [(cfg, m, n, k) for cfg in _every_config()
     for m, n, k in [(129, 520, 264), (300, 776, 1032), (1, 8, 8), (64, 4104, 72), (5, 4104, 72)]
     if m <= cfg.a_rows or cfg.a_rows == cfg.tile_m],
    [lambda c: (_kind(c[0]), c[0].tile_m, c[0].tile_n, c[0].a_rows, c[0].cluster_m, c[0].cluster_n),
     lambda c: (_kind(c[0]), c[0].dtype, c[0].cluster_m * c[0].cluster_n > 1, c[1:])],
    key=lambda c: f"{c[0].variant().key()}-{c[1]}x{c[2]}x{c[3]}")


@pytest.mark.gpu
@pytest.mark.grid
@pytest.mark.parametrize("cfg, m, n, k", [pytest.param(*c, id=f"{c[0].variant().key()}-{c[1]}x{c[2]}x{c[3]}")
                                          for c in _TILE_CASES])
def test_every_tile_config(cfg, m, n, k):
    """Each kernel variant on ragged shapes, whatever the heuristic would pick; split-K configs
    with every split count that leaves each split at least one k-tile."""
    dtype = _TORCH[cfg.dtype]
    a, b, bias = _inputs(m, n, k, dtype, "nk" if cfg.b_major == "k" else "kn", _TORCH.get(cfg.bias, torch.float32))
    b_nk = b if cfg.b_major == "k" else b.t()
    ref = _reference(a, b_nk, bias, cfg.slope)
    k_tiles = -(-k // plan.TILE_K)
    for splits in sorted({1, 2, 3, k_tiles}) if cfg.split_k else [1]:
        if splits > k_tiles:
            continue
        for rep in range(2):  # the split counters must be back at zero for the second run
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            gemm_op.run(a, b_nk, bias, out, dataclasses.replace(cfg, splits=splits))
            _assert_close(out, ref, dtype, f"{cfg} m={m} n={n} k={k} splits={splits} run {rep}")


@pytest.mark.gpu
@pytest.mark.parametrize("tile_n", sorted(plan.DECODE_TILE_N))
@pytest.mark.parametrize("m, tile_m", [(1, 64), (7, 64), (64, 64), (7, 128), (100, 128), (128, 128)])
@pytest.mark.parametrize("b_layout, bias", [("nk", None), ("kn", torch.float32), ("nk", torch.bfloat16)])
def test_split_k(m, tile_m, tile_n, b_layout, bias):
    """Every split count on ragged N and K tiles: N = 776 leaves a partial last tile for every
    width, K = 1000 a partial 16th k-tile; 16 splits give each split a single k-tile."""
    n, k = 776, 1000
    cfg = glr.Config(tile_m=tile_m, tile_n=tile_n, cluster_m=1, split_k=True,
                     b_major="k" if b_layout == "nk" else "n",
                     bias=checks.DTYPE_NAME[bias] if bias is not None else "none")
    a, b, bias_t = _inputs(m, n, k, torch.bfloat16, b_layout, bias, seed=m + tile_n)
    b_nk = b if b_layout == "nk" else b.t()
    ref = _reference(a, b_nk, bias_t, cfg.slope)
    for splits in (1, 2, 3, 5, 7, 16):
        for rep in range(2):  # the tile counters must be back at zero for the second run
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            gemm_op.run(a, b_nk, bias_t, out, dataclasses.replace(cfg, splits=splits))
            _assert_close(out, ref, torch.bfloat16, f"{cfg} m={m} splits={splits} run {rep}")


_ODD_WIDTHS = [(100, 128, 144, "nk", None), (128, 128, 208, "kn", torch.float32), (65, 128, 48, "nk", torch.bfloat16),
               (128, 128, 240, "nk", torch.float32), (7, 64, 80, "kn", None)]


@pytest.mark.gpu
@pytest.mark.parametrize("m, tile_m, tile_n, b_layout, bias", _ODD_WIDTHS,
                         ids=[f"m{c[0]}-{c[1]}x{c[2]}-{c[3]}" for c in _ODD_WIDTHS])
def test_odd_multiple_of_16_widths(m, tile_m, tile_n, b_layout, bias):
    """Tiles an odd multiple of 16 wide (fitted_width's; 16-column epilogue subtiles) on ragged N
    and K, with K splits."""
    n, k = 1000, 1000
    cfg = glr.Config(tile_m=tile_m, tile_n=tile_n, cluster_m=1, split_k=True, b_major="k" if b_layout == "nk" else "n",
                     bias=checks.DTYPE_NAME[bias] if bias is not None else "none")
    a, b, bias_t = _inputs(m, n, k, torch.bfloat16, b_layout, bias, seed=tile_n)
    b_nk = b if b_layout == "nk" else b.t()
    ref = _reference(a, b_nk, bias_t, cfg.slope)
    for splits in (1, 2, 5):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemm_op.run(a, b_nk, bias_t, out, dataclasses.replace(cfg, splits=splits))
        _assert_close(out, ref, torch.bfloat16, f"{cfg} m={m} splits={splits}")


_SWAP_CASES = [(1, 64, 8), (8, 64, 8), (9, 128, 16), (16, 64, 16), (17, 128, 32), (33, 64, 64),
                (64, 128, 64), (65, 128, 96), (96, 64, 96), (97, 128, 128), (128, 64, 128), (200, 128, 64),
                (100, 64, 64), (128, 128, 64)]  # the tuner's two token tiles (plan.TWO_TOKEN_TILES)


@pytest.mark.gpu
@pytest.mark.parametrize("m, tile_m, tile_n", _SWAP_CASES, ids=[f"m{m}-{tm}x{tn}" for m, tm, tn in _SWAP_CASES])
@pytest.mark.parametrize("b_layout, bias", [("nk", None), ("kn", torch.float32), ("nk", torch.bfloat16)])
def test_swapped_tiles(m, tile_m, tile_n, b_layout, bias):
    """Swapped decode tiles (weights on the MMA's M side, tokens on its N side, out^T stored per
    element) on ragged N and K with every split count; M past tile_n takes several token tiles.
    The output starts NaN, so an element the epilogue skips shows."""
    n, k = 776, 1000
    cfg = glr.Config(tile_m=tile_m, tile_n=tile_n, cluster_m=1, split_k=True, swap_ab=True,
                     b_major="k" if b_layout == "nk" else "n",
                     bias=checks.DTYPE_NAME[bias] if bias is not None else "none")
    a, b, bias_t = _inputs(m, n, k, torch.bfloat16, b_layout, bias, seed=m + tile_n)
    b_nk = b if b_layout == "nk" else b.t()
    ref = _reference(a, b_nk, bias_t, cfg.slope)
    outs = []
    for splits in (1, 2, 3, 7, 16):
        for rep in range(2):  # the tile counters must be back at zero for the second run
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            gemm_op.run(a, b_nk, bias_t, out, dataclasses.replace(cfg, splits=splits))
            _assert_close(out, ref, torch.bfloat16, f"{cfg} m={m} splits={splits} run {rep}")
            outs.append(out)
        assert torch.equal(outs[-1], outs[-2]), f"splits={splits}: two runs differ"


# (M, tile_m, tile_n, cluster_m, cluster_n, swapped)
_CLUSTER_CASES = [(m, 64, tn, cm, cn, True) for m, tn, cm, cn in (
    (9, 8, 1, 2), (16, 8, 2, 2), (17, 16, 1, 2), (33, 32, 2, 2), (64, 32, 1, 2), (65, 64, 2, 2), (100, 64, 1, 2),
    (128, 64, 2, 2), (200, 64, 1, 2), (200, 64, 2, 2), (5, 8, 2, 1), (64, 64, 2, 1), (128, 128, 2, 1), (25, 8, 1, 4),
    (128, 32, 1, 4), (200, 32, 1, 4), (100, 32, 2, 4), (7, 8, 4, 1), (64, 64, 4, 1), (128, 128, 4, 1), (33, 32, 4, 2),
    (128, 64, 4, 2))]
_CLUSTER_CASES += [(96, 128, 96, 4, 1, True), (128, 128, 64, 2, 2, True)]
_CLUSTER_CASES += [(m, tm, tn, cm, cn, False) for m, tm, tn, cm, cn in (
    (100, 64, 96, 2, 1), (65, 64, 96, 2, 2), (128, 64, 80, 2, 4), (128, 64, 256, 2, 1), (40, 64, 128, 1, 2),
    (64, 64, 64, 1, 4), (100, 128, 48, 1, 2), (128, 128, 112, 1, 4))]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _CLUSTER_CASES,
                         ids=[f"m{m}-{tm}x{tn}-{cm}x{cn}-{'swapped' if sw else 'plain'}"
                              for m, tm, tn, cm, cn, sw in _CLUSTER_CASES])
@pytest.mark.parametrize("gated", [False, True])
def test_decode_tiles_on_clusters(case, gated):
    """Decode tiles on clusters, bitwise the same tile without one: swapped (1xC: the weight tile
    multicast to C token tiles; Cx1: the token tile to C weight tiles; both at once; 64 or 128 weight
    rows) and plain (1xC: the token tile multicast to C weight tiles; 2xC: two 64-token tiles sharing
    each weight tile too). Ragged N (13 weight tiles of 64: the last 2x1 and 4x1 clusters have CTAs
    past N) and K, every split count; the last CTA holds 1 token at M = 9, 25 and 65, M = 200 takes
    two clusters of token tiles (on 1x4, the last CTA lies past M). The output starts NaN, so a
    skipped element shows."""
    m, tile_m, tile_n, cluster_m, cluster_n, swap = case
    if gated and not swap and tile_n % 32:
        pytest.skip("gated plain tiles are multiples of 32 wide")
    n, k = 784 if gated else 776, 1000
    fields = dict(tile_m=tile_m, tile_n=tile_n, split_k=True, swap_ab=swap, bias="fp32",
                  activation="silu" if gated else "leaky_relu", gated=gated)
    cfg = glr.Config(cluster_m=cluster_m, cluster_n=cluster_n, **fields)
    unicast = glr.Config(cluster_m=1, cluster_n=1, **fields)
    a, b, bias_t = _inputs(m, n, k, torch.bfloat16, "nk", torch.float32, seed=m + 7 * tile_n)
    width = n // 2 if gated else n
    ref = glr.epilogue_reference(a.double() @ b.double().t() + bias_t.double(), cfg.activation, gated, cfg.slope)
    for splits in (1, 2, 3, 7, 16):
        outs = []
        for c in (cfg, cfg, unicast):  # twice: the tile counters must be back at zero
            out = torch.full((m, width), float("nan"), dtype=torch.bfloat16, device="cuda")
            gemm_op.run(a, b, bias_t, out, dataclasses.replace(c, splits=splits))
            outs.append(out)
        _assert_close(outs[0], ref, torch.bfloat16, f"{cfg} m={m} splits={splits}")
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), f"splits={splits}"


def test_cluster_cases_cover_the_tuners_clusters():
    """The GPU cases above take every cluster shape the tuner searches, and tokens the shapes' m_range
    gives them (M = 200 lies past the decode range on purpose: two clusters of token tiles)."""
    swapped = {(cm, cn) for m, tm, tn, cm, cn, sw in _CLUSTER_CASES if sw and tm == 64}
    plain = {(cm, cn) for m, tm, tn, cm, cn, sw in _CLUSTER_CASES if not sw}
    assert swapped == set(plan.SWAP_CLUSTERS)
    assert {(cm, cn) for m, tm, tn, cm, cn, sw in _CLUSTER_CASES if sw and tm == 128} <= set(plan.SWAP128_CLUSTERS)
    assert plain == set(plan.PLAIN_CLUSTERS) | set(plan.TWO_TOKEN_CLUSTERS)
    for m, tm, tn, cm, cn, sw in _CLUSTER_CASES:
        lo, hi = plan.m_range(glr.Config(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, split_k=True, swap_ab=sw))
        assert lo <= min(m, hi) and (m <= hi or m == 200), (m, tm, tn, cm, cn, sw)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3, 5])
def test_stage_counts(stages):
    """Fewer A/B stages than fit (the stages field): same bits as the default count."""
    a, b, _ = _inputs(33, 1032, 1000, torch.bfloat16, seed=stages)
    outs = []
    for cfg in (glr.Config(tile_m=64, tile_n=128, cluster_m=1, split_k=True, splits=2),
                glr.Config(tile_m=128, tile_n=64, cluster_m=1, split_k=True, swap_ab=True, splits=3)):
        for s in (0, stages):
            out = torch.full((33, 1032), float("nan"), dtype=torch.bfloat16, device="cuda")
            gemm_op.run(a, b, None, out, dataclasses.replace(cfg, stages=s))
            outs.append(out)
        assert torch.equal(outs[-2], outs[-1]), cfg
    _assert_close(outs[0], _reference(a, b, None, 0.01), torch.bfloat16, "stages")


def test_gemm_arguments_and_gate_up_rows():
    a = torch.empty(4, 16, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="activation must be"):
        rosekernels.gemm(a, torch.empty(32, 16, dtype=torch.bfloat16, device="meta"), activation="tanh")
    with pytest.raises(ValueError, match="multiple of 16"):
        rosekernels.gemm(a, torch.empty(24, 16, dtype=torch.bfloat16, device="meta"), gated=True)
    out = rosekernels.gemm(a, torch.empty(32, 16, dtype=torch.bfloat16, device="meta"), activation="silu", gated=True)
    assert out.shape == (4, 16)
    # gate_up_rows interleaves blocks of 8 rows; the epilogue's torch definition undoes it.
    g, u = torch.randn(24, 5, dtype=torch.float64), torch.randn(24, 5, dtype=torch.float64)
    w = rosekernels.gate_up_rows(g, u)
    assert torch.equal(w[:8], g[:8]) and torch.equal(w[8:16], u[:8]) and torch.equal(w[16:24], g[8:16])
    x = torch.randn(3, 5, dtype=torch.float64)
    ref = torch.nn.functional.silu(x @ g.t()) * (x @ u.t())
    assert torch.allclose(glr.epilogue_reference(x @ w.t(), "silu", True), ref)
    with pytest.raises(ValueError, match="multiple of 8"):
        rosekernels.gate_up_rows(g[:12], u[:12])


_TILE_KINDS = {  # (m, config fields): plain and swapped decode tiles, cooperative and pingpong prefill tiles
    "plain": (5, dict(tile_m=64, tile_n=128, cluster_m=1, split_k=True, a_rows=8)),
    "plain128": (100, dict(tile_m=128, tile_n=64, cluster_m=1, split_k=True)),
    "swap64": (33, dict(tile_m=64, tile_n=64, cluster_m=1, split_k=True, swap_ab=True)),
    "swap128": (7, dict(tile_m=128, tile_n=8, cluster_m=1, split_k=True, swap_ab=True)),
    "coop": (300, dict()),
    "pingpong": (300, dict(tile_m=128, tile_n=128, pingpong=True)),
}
# Every activation plain and gated on three tile kinds; the other kinds gated with silu.
_EPILOGUE_CASES = [(act, gated, kind) for act in ("none", "relu", "silu", "gelu_tanh") for gated in (False, True)
                   for kind in ("plain", "swap64", "coop")]
_EPILOGUE_CASES += [("silu", True, kind) for kind in ("plain128", "swap128", "pingpong")]


def _epilogue_config(activation, gated, kind):
    return glr.Config(activation=activation, gated=gated, bias="fp32", **_TILE_KINDS[kind][1])


@pytest.fixture(scope="module")
def epilogue_kernels():
    """Compile the epilogue variants in parallel processes once, not one by one in the tests."""
    glr.precompile([_epilogue_config(*case) for case in _EPILOGUE_CASES])


@pytest.mark.gpu
@pytest.mark.parametrize("activation, gated, kind", _EPILOGUE_CASES)
def test_activations_and_gating(activation, gated, kind, epilogue_kernels):
    """Each activation, plain and gated, on ragged N and K, two split counts where the tile splits,
    against float64 (bias included: it goes in before the activation)."""
    n, k = 784, 1000
    m = _TILE_KINDS[kind][0]
    cfg = _epilogue_config(activation, gated, kind)
    a, b, bias = _inputs(m, n, k, torch.bfloat16, bias=torch.float32, seed=m)
    ref = glr.epilogue_reference(a.double() @ b.double().t() + bias.double(), activation, gated)
    for splits in (1, 3) if cfg.split_k else (1,):
        out = torch.full((m, n // 2 if gated else n), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemm_op.run(a, b, bias, out, dataclasses.replace(cfg, splits=splits))
        _assert_close(out, ref, torch.bfloat16, f"{cfg} splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 96, 1000])
def test_swiglu_through_the_op(m):
    """gemm(..., activation="silu", gated=True) on gate_up_rows(w_gate, w_up) is the SwiGLU of a
    Qwen3-like MLP: silu(a @ w_gate^T) * (a @ w_up^T); the registered op agrees (torch.compile path)."""
    a, wg, _ = _inputs(m, 1536, 1024, torch.bfloat16, seed=m)
    _, wu, _ = _inputs(m, 1536, 1024, torch.bfloat16, seed=m + 1)
    w = rosekernels.gate_up_rows(wg, wu)
    out = rosekernels.gemm(a, w, activation="silu", gated=True)
    ref = torch.nn.functional.silu(a.double() @ wg.double().t()) * (a.double() @ wu.double().t())
    _assert_close(out, ref, torch.bfloat16, f"swiglu m={m}")
    via_op = torch.empty_like(out)
    torch.ops.rosekernels.gemm(a, w, None, via_op, "silu", True, 0.01)
    assert torch.equal(via_op, out)


_A_ROWS_CASES = [(1, 8), (1, 16), (7, 8), (7, 16), (8, 8), (8, 16), (9, 16), (9, 32), (16, 16),
                 (16, 32), (17, 32), (17, 64), (32, 32), (33, 64), (64, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("tile_n", sorted(plan.DECODE_TILE_N))
@pytest.mark.parametrize("m, a_rows", _A_ROWS_CASES, ids=[f"m{m}-a_rows{r}" for m, r in _A_ROWS_CASES])
@pytest.mark.parametrize("b_layout, bias", [("nk", None), ("kn", torch.float32)])
def test_split_k_a_rows(m, a_rows, tile_n, b_layout, bias):
    """Decode tiles that load only a_rows rows of A (the matching and the next larger a_rows
    for each M), every split count on ragged N and K. Before each run a whole-tile launch on
    all-NaN inputs leaves NaN in the A stages' shared memory (rows >= a_rows are never written
    by the a_rows variant): it must not reach any stored row."""
    n, k = 776, 1000
    common = dict(tile_m=64, tile_n=tile_n, cluster_m=1, split_k=True,
                  b_major="k" if b_layout == "nk" else "n",
                  bias=checks.DTYPE_NAME[bias] if bias is not None else "none")
    cfg = glr.Config(**common, a_rows=a_rows)
    poison_cfg = glr.Config(**common)
    a, b, bias_t = _inputs(m, n, k, torch.bfloat16, b_layout, bias, seed=m + a_rows + tile_n)
    b_nk = b if b_layout == "nk" else b.t()
    ref = _reference(a, b_nk, bias_t, cfg.slope)
    nan_a = torch.full((64, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    nan_b = torch.full_like(b_nk, float("nan"))
    sink = torch.empty(64, n, dtype=torch.bfloat16, device="cuda")
    for splits in (1, 2, 3, 7, 16):
        for rep in range(2):  # the tile counters must be back at zero for the second run
            gemm_op.run(nan_a, nan_b, bias_t, sink, poison_cfg)
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            gemm_op.run(a, b_nk, bias_t, out, dataclasses.replace(cfg, splits=splits))
            _assert_close(out, ref, torch.bfloat16, f"{cfg} m={m} splits={splits} run {rep}")


@pytest.mark.gpu
def test_split_k_a_rows_matches_whole_tile_bitwise():
    """Loading fewer rows of A changes nothing in the valid rows: same bits as the whole tile."""
    for m in (1, 8, 9, 17, 32):
        a, b, _ = _inputs(m, 14336, 4096, torch.bfloat16, seed=m)
        a_rows = next(r for r in plan.A_ROWS if r >= m)
        outs = []
        for rows in (a_rows, 64):
            cfg = glr.Config(tile_m=64, tile_n=128, cluster_m=1, split_k=True, a_rows=rows, splits=2)
            out = torch.full((m, 14336), float("nan"), dtype=torch.bfloat16, device="cuda")
            gemm_op.run(a, b, None, out, cfg)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), f"m={m} a_rows={a_rows}"
        _assert_close(outs[0], _reference(a, b, None, 0.01), torch.bfloat16, f"m={m}")


def _force_splits(monkeypatch, splits: int = 4) -> list:
    """Make the op plan `splits` K splits wherever its heuristic picks a split-K tile family (which
    shapes the cost model splits moves as it is refit), with plans made anew; returns the configs
    it planned."""
    planned = []

    def config_for(shape, sms=None):
        cfg = plan.config_for(shape, sms)
        cfg = dataclasses.replace(cfg, splits=splits) if cfg.split_k else cfg
        planned.append(cfg)
        return cfg

    monkeypatch.setattr(gemm_op, "config_for", config_for)
    monkeypatch.setattr(gemm_op, "_plans", launch.PlanCache())
    return planned


@pytest.mark.gpu
def test_split_k_is_deterministic(monkeypatch):
    planned = _force_splits(monkeypatch)
    a, b, bias = _inputs(16, 4096, 14336, torch.bfloat16, bias=torch.float32)
    first = rosekernels.gemm_leakyrelu(a, b, bias=bias)
    for _ in range(3):
        assert torch.equal(rosekernels.gemm_leakyrelu(a, b, bias=bias), first)
    assert [c.splits for c in planned] == [4], planned
    _assert_close(first, _reference(a, b, bias, 0.01), torch.bfloat16, "split-K decode shape")


@pytest.mark.gpu
@pytest.mark.parametrize("warm_capture_stream", [True, False])
def test_split_k_graph_survives_later_launches(monkeypatch, warm_capture_stream):
    """A captured split-K launch keeps valid workspace pointers: larger split launches after the
    capture (which need more partials) must not free or replace what the graph uses. Without a
    warm-up on the capture stream, the capture gets tile counters of its own."""
    planned = _force_splits(monkeypatch, splits=2)
    a, b, _ = _inputs(16, 4096, 4096, torch.bfloat16, seed=1)
    ref = _reference(a, b, None, 0.01)
    out = torch.full((16, 4096), float("nan"), dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    rosekernels.gemm_leakyrelu(a, b, out=out)  # compile and load outside the capture
    if warm_capture_stream:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            rosekernels.gemm_leakyrelu(a, b, out=out)
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        rosekernels.gemm_leakyrelu(a, b, out=out)
    # Larger split launches, on the default and on the capture stream, then churn the allocator.
    later = _force_splits(monkeypatch, splits=8)  # more partials than the captured launch's
    for m, n, k in [(64, 4096, 14336), (128, 2048, 14336)]:
        a2, b2, _ = _inputs(m, n, k, torch.bfloat16, seed=2)
        for s in (torch.cuda.current_stream(), stream):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                out2 = rosekernels.gemm_leakyrelu(a2, b2)
            torch.cuda.current_stream().wait_stream(s)
            _assert_close(out2, _reference(a2, b2, None, 0.01), torch.bfloat16,
                          f"eager {m}x{n}x{k}")
    assert planned[0].splits == 2 and [c.splits for c in later] == [8, 8], (planned, later)
    junk = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(64)]  # reuse freed blocks
    del junk
    for rep in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, ref, torch.bfloat16, f"graph replay {rep}")


@pytest.mark.gpu
def test_strided_views_and_large_problem():
    # a with a padded row stride, b given as the transposed view of a [K, N] buffer, out a column
    # slice of a wider buffer; an MLP-sized problem to run many persistent tiles per CTA.
    m, n, k = 2000, 4096, 1024
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(m, k + 64, generator=g, device="cuda").to(torch.bfloat16)[:, :k]
    w_kn = (torch.randn(k, n, generator=g, device="cuda") / k ** 0.5).to(torch.bfloat16)
    wide = torch.full((m, n + 8), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = wide[:, 8:]
    rosekernels.gemm_leakyrelu(a, w_kn.t(), 0.1, out=out)
    _assert_close(out, _reference(a, w_kn.t(), None, 0.1), torch.bfloat16, "strided views")
    assert torch.isnan(wide[:, :8]).all(), "wrote outside out"
    rosekernels.gemm_leakyrelu(a, w_kn, 0.1, out=out, b_layout="kn")
    _assert_close(out, _reference(a, w_kn.t(), None, 0.1), torch.bfloat16, "b_layout=kn")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 100, 2000])
def test_an_out_interleaved_with_a_in_one_buffer(m):
    """a and out as column blocks of one [M, K + 8 + N] buffer (rows interleave, no element shared: accepted):
    whatever path the heuristic takes at each M (decode swap-AB at 8, prefill tiles at 2000) writes out's columns
    only; a's and the 8 between stay."""
    n, k = 3072, 1024
    g = torch.Generator(device="cuda").manual_seed(m)
    buf = torch.randn(m, k + 8 + n, generator=g, device="cuda").to(torch.bfloat16)
    buf[:, k:k + n + 8] = float("nan")
    before = buf[:, :k + 8].clone()
    a, out = buf[:, :k], buf[:, k + 8:]
    w = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(torch.bfloat16)
    rosekernels.gemm_leakyrelu(a, w, 0.1, out=out)
    assert torch.equal(buf[:, :k + 8].view(torch.int16), before.view(torch.int16)), "wrote outside out"
    _assert_close(out, _reference(before[:, :k], w, None, 0.1), torch.bfloat16, "interleaved out")


@pytest.mark.gpu
def test_empty_and_k_zero():
    a = torch.randn(0, 64, device="cuda", dtype=torch.bfloat16)
    assert rosekernels.gemm_leakyrelu(a, torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)).shape == (0, 16)
    a = torch.randn(5, 0, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(16, device="cuda")
    out = rosekernels.gemm_leakyrelu(a, torch.randn(16, 0, device="cuda", dtype=torch.bfloat16), 0.1, bias=bias)
    torch.testing.assert_close(out, torch.nn.functional.leaky_relu(bias, 0.1).expand(5, 16).bfloat16())


@pytest.mark.gpu
def test_eager_calls_reuse_the_launch_plan(monkeypatch):
    """The slow path (checks, heuristic, compile) runs once per argument signature; later calls
    only run the plan, which still rejects what depends on the data pointers."""
    picked = []

    def config_for(shape, sms=None):
        picked.append(shape.slope)
        return plan.config_for(shape, sms)

    monkeypatch.setattr(gemm_op, "config_for", config_for)  # what the op calls
    a, b, _ = _inputs(3, 24, 40, torch.bfloat16)  # a signature no other test uses
    for _ in range(3):
        rosekernels.gemm_leakyrelu(a, b, 0.125, out=torch.empty(3, 24, dtype=torch.bfloat16, device="cuda"))
    rosekernels.gemm_leakyrelu(a, b, 0.25)
    rosekernels.gemm_leakyrelu(a[:2], b, 0.25)
    assert picked == [0.125, 0.25, 0.25]
    # Same signature, data pointers the plan must still reject: a misaligned a, out overlapping a.
    flat = torch.zeros(3 * 40 + 1, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="aligned"):
        rosekernels.gemm_leakyrelu(flat[1:].view(3, 40), b, 0.125)
    buf = torch.zeros(6, 40, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="overlap a"):
        rosekernels.gemm_leakyrelu(buf[:3], b, 0.125, out=buf[2:5, :24].as_strided((3, 24), (24, 1)))
    assert picked == [0.125, 0.25, 0.25]


_WORKLOAD_SHAPES = [glr.Shape(1, 4096, 4096), glr.Shape(16, 4096, 14336, bias="fp32"),
                    glr.Shape(100, 776, 1000, dtype="fp16", b_major="n", bias="fp16"), glr.Shape(1000, 1032, 264)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", _WORKLOAD_SHAPES, ids=lambda s: f"{s.m}x{s.n}x{s.k}")
def test_workloads_check_their_kernels(shape):
    """workload(config, shape) for the heuristic's config and the search space's ends (first and
    last candidates): make_args at the shape and ragged test_args pass the workload's check."""
    found = glr.candidates(shape)
    for cfg in (found[0], found[1], found[-1]):
        w = glr.workload(cfg, shape)
        for args in [w.make_args(0)] + [w.sample(seed) for seed in range(1, 4)]:
            w.run(w.kernel.fn, args)
            torch.cuda.synchronize()
            assert w.check(args) <= 1, cfg
            assert len(w.outputs(args)) == 1


@pytest.mark.gpu
def test_opcheck():
    a, b, bias = _inputs(130, 264, 136, torch.bfloat16, bias=torch.float32)
    out = torch.empty(130, 264, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(torch.ops.rosekernels.gemm_leakyrelu.default, (a, b, bias, out, 0.2),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_torch_compile_and_cuda_graph():
    a, b, bias = _inputs(64, 512, 256, torch.bfloat16, bias=torch.bfloat16)
    ref = _reference(a, b, bias, 0.01)
    fn = torch.compile(lambda x: rosekernels.gemm_leakyrelu(x, b, bias=bias) * 2, fullgraph=True)
    _assert_close(fn(a) / 2, ref, torch.bfloat16, "torch.compile")
    out = torch.full((64, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    rosekernels.gemm_leakyrelu(a, b, bias=bias, out=out)  # compile + warm up outside the capture
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rosekernels.gemm_leakyrelu(a, b, bias=bias, out=out)
    graph.replay()
    _assert_close(out, ref, torch.bfloat16, "CUDA graph")
