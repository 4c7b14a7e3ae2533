"""gemm_leakyrelu: every specialization compiles for sm_90a (with HGMMA), argument errors fire before
any launch (CPU); results match a float64 reference on fresh random inputs (GPU)."""
import re

import pytest
import torch

from kernel_sass import sass_of
from rosekernels import modes
from rosekernels.kernels import gemm_leakyrelu as glr

# ---------------------------------------------------------------------------------------------
# CPU: compilation.

# Each prefill tile shape and a spread of decode tiles, both B orders, all bias kinds, both
# dtypes; the rest under `slow`.
_SPECS = glr.specializations()
_QUICK = [c for c in _SPECS if c.dtype == "bf16" and c.b_major == "k" and c.bias == "none" and not c.split_k]
_QUICK += [glr.GemmConfig(b_major="n", bias="fp32"),
           glr.GemmConfig(tile_m=64, tile_n=128, cluster_m=1, split_k=True),
           glr.GemmConfig(tile_m=64, tile_n=128, cluster_m=1, split_k=True, a_rows=8),
           glr.GemmConfig(dtype="fp16", bias="fp32", tile_m=64, tile_n=256, cluster_m=1,
                          split_k=True, b_major="n", a_rows=32),
           glr.GemmConfig(tile_m=128, tile_n=256, cluster_m=1, split_k=True, bias="bf16"),
           glr.GemmConfig(dtype="fp16", bias="fp32", tile_m=64, tile_n=64, cluster_m=1,
                          split_k=True, b_major="n"),
           glr.GemmConfig(dtype="fp16", bias="fp16", tile_m=128, tile_n=128, cluster_m=1,
                          split_k=True, b_major="n")]


def _compile_and_inspect(cfg, tmp_path):
    kernel = glr.compiled(cfg)
    assert kernel.variant.mode == cfg.mode
    sass = sass_of(kernel, tmp_path)
    if sass is None:
        pytest.skip("nvdisasm not found: compiled, SASS not inspected")
    ops = set(re.findall(r"\b(HGMMA|UTMALDG|UTMASTG|STSM|LDL|STL|STG\.E\.128|LDG\.E\.128)\b", sass))
    assert {"HGMMA", "UTMALDG", "UTMASTG", "STSM"} <= ops, (cfg, ops)
    assert not {"LDL", "STL"} & ops, f"{cfg}: register spills"
    if cfg.split_k:  # split-K partials move as 16-byte vectors
        assert {"STG.E.128", "LDG.E.128"} <= ops, (cfg, ops)


@pytest.mark.parametrize("cfg", _QUICK, ids=lambda c: c.variant().key())
def test_compiles_for_sm90a(cfg, tmp_path):
    _compile_and_inspect(cfg, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [c for c in _SPECS if c not in _QUICK], ids=lambda c: c.variant().key())
def test_every_specialization_compiles(cfg, tmp_path):
    _compile_and_inspect(cfg, tmp_path)


def test_specializations_are_distinct_and_cover_the_heuristic():
    keys = {c.variant().key() for c in _SPECS}
    assert len(keys) == len(_SPECS)
    for m, n, k in [(1, 14336, 4096), (16, 4096, 14336), (128, 14336, 4096), (129, 136, 72),
                    (1024, 14336, 4096), (4096, 4096, 4096), (8192, 14336, 4096), (1, 8, 8),
                    (7, 136, 72), (100, 1024, 4096), (64, 128256, 4096), (8, 14336, 4096),
                    (9, 4096, 14336), (17, 28672, 4096), (32, 136, 72), (33, 4096, 4096)]:
        for b_major in ("k", "n"):
            cfg, splits = glr.select_config(m, n, k, "bf16", b_major, "fp32", 0.01, 132)
            assert cfg in _SPECS and splits >= 1
            assert cfg.split_k == (m <= glr.DECODE_MAX_M)
            # Decode loads the fewest rows of A that hold M: 8, 16, 32 or the whole 64-row tile.
            fit = [r for r in glr.A_ROWS if r >= m]
            assert cfg.a_rows == (fit[0] if cfg.split_k and cfg.tile_m == 64 else cfg.tile_m), (m, cfg)
            if cfg.split_k:
                assert splits <= max(1, -(-k // glr.TILE_K) // glr.MIN_SPLIT_K_TILES)
                assert glr.split_fits(m, n, cfg.tile_m, cfg.tile_n, splits)


_MLP = [(14336, 4096), (4096, 14336), (4096, 4096), (28672, 4096)]


@pytest.mark.parametrize("n, k", _MLP)
@pytest.mark.parametrize("m", [1, 16, 64, 128])
def test_decode_heuristic_is_sensible(m, n, k):
    tile_m, tile_n, splits = glr.decode_choice(m, n, k, 132)
    assert tile_m == (64 if m <= 64 else 128) and tile_n in glr.DECODE_TILE_N
    cost = glr.decode_cost(m, n, k, tile_m, tile_n, splits, 132)
    # Never worse than any forced alternative the sweep times (within the 1% hysteresis).
    for tn in glr.DECODE_TILE_N:
        for s in range(1, glr.MAX_SPLITS + 1):
            if glr.split_fits(m, n, tile_m, tn, s) and s <= -(-k // glr.TILE_K) // glr.MIN_SPLIT_K_TILES:
                assert cost <= 1.0202 * glr.decode_cost(m, n, k, tile_m, tn, s, 132), (tn, s)
    # The H200 sweep: a CTA running two units in sequence loses to any one-wave alternative.
    units = -(-m // tile_m) * -(-n // tile_n) * splits
    one_wave = [(tn, s) for tn in glr.DECODE_TILE_N for s in range(1, glr.MAX_SPLITS + 1)
                if -(-m // tile_m) * -(-n // tn) * s <= 132 and s <= -(-k // glr.TILE_K) // glr.MIN_SPLIT_K_TILES]
    assert units <= 132 or not one_wave, (tile_n, splits, units)
    partial_mb = splits * m * n * 4 / 1e6 if splits > 1 else 0
    assert partial_mb <= 0.25 * n * k * 2 / 1e6, (tile_n, splits, partial_mb)
    print(f"M={m} N={n} K={k}: tile_n={tile_n} splits={splits} units={units} model={cost:.1f} us")


def test_decode_heuristic_known_shapes():
    # The fastest configs of the H200 sweep (bench/results/gemm_leakyrelu_decode_sweep.md).
    # Few N tiles: split K until the SMs are full (32 tiles x 4 splits = 128 of 132 SMs).
    assert glr.decode_choice(16, 4096, 14336, 132) == (64, 128, 4)
    # At M = 128 the last split's serial read of 128-row partials favours narrower tiles, fewer splits.
    assert glr.decode_choice(128, 4096, 14336, 132) == (128, 64, 2)
    # 112 N tiles in one wave: splitting further would put two units on some SMs.
    assert glr.decode_choice(1, 14336, 4096, 132) == (64, 128, 1)
    assert glr.decode_choice(128, 14336, 4096, 132)[2] == 1
    # 28672 / 256 = 112 tiles: one wave of wide tiles beats two waves of 128-wide ones.
    assert glr.decode_choice(16, 28672, 4096, 132) == (64, 256, 1)
    # Large N: the tiles fill the GPU without splitting.
    assert glr.decode_choice(1, 128256, 4096, 132)[2] == 1


def test_prefill_heuristic_known_shapes():
    # The fastest configs of the H200 sweep (bench/results/gemm_leakyrelu_prefill_sweep.md).
    def tiles(m, n, k):
        cfg, splits = glr.select_config(m, n, k, "bf16", "k", "none", 0.01, 132)
        assert splits == 1 and not cfg.split_k
        return cfg.tile_m, cfg.tile_n, cfg.pingpong

    assert tiles(8192, 4096, 14336) == (128, 256, False)
    assert tiles(8192, 14336, 4096) == (128, 192, True)
    assert tiles(8192, 8192, 8192) == (128, 192, True)
    assert tiles(1024, 14336, 4096) == (128, 128, True)
    # Same waves as cooperative 128 x 256 tiles, whose epilogue shows at short K: pingpong 128 x 128
    # was 3-7% faster (4096^3, 16384 x 4096 x 4096); at K = 14336 the two were even.
    assert tiles(4096, 4096, 4096) == (128, 128, True)
    assert tiles(16384, 4096, 4096) == (128, 128, True)
    assert tiles(4096, 4096, 14336) == (128, 256, False)
    # 128 cooperative 128 x 256 tiles would be one wave: pingpong 128 x 128 instead (2-9% faster).
    assert tiles(1024, 4096, 14336) == (128, 128, True)


def test_config_validation():
    with pytest.raises(ValueError):
        glr.GemmConfig(dtype="fp32")
    with pytest.raises(ValueError):
        glr.GemmConfig(tile_n=200)
    with pytest.raises(ValueError):
        glr.GemmConfig(pingpong=True, tile_m=64)
    with pytest.raises(ValueError):
        glr.GemmConfig(pingpong=True, tile_n=256)
    with pytest.raises(ValueError):
        glr.GemmConfig(dtype="bf16", bias="fp16")
    with pytest.raises(ValueError):
        glr.GemmConfig(split_k=True)  # clusters are not used with split-K
    decode = dict(cluster_m=1, split_k=True)
    assert glr.GemmConfig(tile_m=64, **decode).a_rows == 64  # default: the whole tile
    assert glr.GemmConfig(tile_m=64, a_rows=64, **decode) == glr.GemmConfig(tile_m=64, **decode)
    for bad in (dict(tile_m=64, a_rows=24, **decode), dict(tile_m=128, a_rows=64, **decode),
                dict(tile_m=64, a_rows=8, cluster_m=1), dict(tile_m=64, a_rows=128, **decode)):
        with pytest.raises(ValueError, match="a_rows"):
            glr.GemmConfig(**bad)
    # Whole-tile variants keep their cache keys; a_rows variants are named by it.
    assert "a_rows" not in glr.GemmConfig(tile_m=64, **decode).variant().key()
    assert "a_rows=8" in glr.GemmConfig(tile_m=64, a_rows=8, **decode).variant().key()


@pytest.mark.parametrize("a_rows", glr.A_ROWS)
@pytest.mark.parametrize("tile_n", sorted(glr.DECODE_TILE_N))
def test_a_smem_layouts(a_rows, tile_n):
    """The TMA view of the A stages is the first a_rows rows of the WGMMA view (same swizzle,
    same offsets), stages sit a_rows * 128 bytes apart (a multiple of the 1024-byte swizzle
    period) and the stage count the kernel derives fits shared memory."""
    import cutlass
    import cutlass.cute as cute

    cfg = glr.GemmConfig(tile_m=64, tile_n=tile_n, cluster_m=1, split_k=True, a_rows=a_rows)
    stages = glr._GemmLeakyReluSm90(cfg).ab_stage
    whole = glr._GemmLeakyReluSm90(glr.GemmConfig(tile_m=64, tile_n=tile_n, cluster_m=1, split_k=True))
    assert stages >= whole.ab_stage, "packing the A stages must not cost stages of weights"
    found = {}

    coords = [(r, c, s) for s in (0, 1, stages - 1) for r in range(a_rows) for c in (0, 1, 7, 8, 31, 63)]

    @cute.jit
    def check():  # plain Python values out: no control flow inside the traced function
        mma, load = glr._a_smem_layouts(cfg, cutlass.BFloat16, stages)
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
    assert starts == [s * a_rows * glr.TILE_K for s in range(stages)]
    assert all(x * 2 % 1024 == 0 for x in starts), "stages must keep the 1024-byte swizzle phase"
    # The last stage's 64-row WGMMA view ends inside the buffer.
    assert found["cosize"] == (stages - 1) * a_rows * glr.TILE_K + 64 * glr.TILE_K


def test_a_rows_variant_refuses_larger_m():
    cfg = glr.GemmConfig(tile_m=64, tile_n=128, cluster_m=1, split_k=True, a_rows=8)
    with pytest.raises(ValueError, match="loads 8 rows of A: M = 9"):
        glr._Plan(_cpu(9, 64), _cpu(128, 64), None, _cpu(9, 128), cfg, 1)


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
        glr.gemm_leakyrelu(**case)


def test_registered_op_checks_too():
    out = _cpu(4, 8)
    with pytest.raises(ValueError, match="multiples of 8"):
        torch.ops.rosekernels.gemm_leakyrelu(_cpu(4, 12), _cpu(8, 12), None, out, 0.01)
    with pytest.raises(ValueError, match="CUDA device"):
        torch.ops.rosekernels.gemm_leakyrelu(_cpu(4, 16), _cpu(8, 16), None, out, 0.01)


def test_out_overlapping_an_input_is_rejected():
    buf = _cpu(64, 16)
    with pytest.raises(ValueError, match="overlap a"):
        glr.gemm_leakyrelu(buf[:4], _cpu(8, 16), out=buf[2:6, :8])


def test_meta_tensors_infer_shapes_and_check_them():
    """Meta (and torch.compile's fake) tensors take the op's fake path: shapes are checked too."""
    a = torch.empty(4, 16, dtype=torch.bfloat16, device="meta")
    out = glr.gemm_leakyrelu(a, torch.empty(16, 8, dtype=torch.bfloat16, device="meta"), b_layout="kn")
    assert out.shape == (4, 8) and out.device.type == "meta"
    with pytest.raises(ValueError, match="multiples of 8"):
        glr.gemm_leakyrelu(a, torch.empty(12, 16, dtype=torch.bfloat16, device="meta"))


def test_eager_calls_reuse_the_launch_plan(monkeypatch):
    """The slow path (checks, heuristic, compile) runs once per argument signature; later calls
    only run the plan, which still rejects what depends on the data pointers."""
    made, ran = [], []

    def new_plan(a, b_nk, bias, out, slope):
        made.append(slope)
        return lambda *args: ran.append(args)

    monkeypatch.setattr(glr, "_new_plan", new_plan)
    monkeypatch.setattr(glr, "_plans", {})
    a, b = _cpu(4, 16), _cpu(8, 16)
    for _ in range(3):
        glr.gemm_leakyrelu(a, b, out=_cpu(4, 8))
    glr.gemm_leakyrelu(a, b, 0.2, out=_cpu(4, 8))
    glr.gemm_leakyrelu(_cpu(5, 16), b, 0.2)
    assert made == [0.01, 0.2, 0.2] and len(ran) == 5


def test_plan_checks_pointers_before_launching():
    launched = []
    a, b, out = _cpu(4, 16), _cpu(8, 16), _cpu(4, 8)
    plan = glr._Plan.__new__(glr._Plan)  # a plan as a CUDA signature would build it, faked on CPU
    plan.fn, plan.device, plan.split_k = (lambda *args: launched.append(args)), None, False
    plan.scalars, plan.fix_a, plan.fix_out = (1, 8, 132), False, False
    plan.extents = (glr._extent(a), glr._extent(b), 0, glr._extent(out))
    buf = _cpu(64, 16)
    with pytest.raises(ValueError, match="aligned"):
        plan(_cpu(4 * 16 + 1)[1:].view(4, 16), b, None, out)
    with pytest.raises(ValueError, match="overlap a"):
        plan(buf[:4], b, None, buf[2:6, :8])
    assert not launched


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
    res = glr.gemm_leakyrelu(a, b, slope, bias=bias_t, out=out, b_layout=b_layout)
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
    return [glr.GemmConfig(dtype=dt, b_major=bm, bias=bias, slope=0.2, **{
        k: v for k, v in vars(c).items() if k.startswith(("tile", "cluster", "pingpong", "split", "a_rows"))})
        for c in glr.specializations() if c.dtype == "bf16" and c.b_major == "k" and c.bias == "none"
        for dt, bm, bias in [("bf16", "k", "bf16"), ("fp16", "n", "fp32")]]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg, m, n, k", [
    pytest.param(cfg, m, n, k, id=f"{cfg.variant().key()}-{m}x{n}x{k}") for cfg in _every_config()
    for m, n, k in [(129, 520, 264), (300, 776, 1032), (1, 8, 8), (64, 4104, 72), (5, 4104, 72)]
    if m <= cfg.a_rows or cfg.a_rows == cfg.tile_m])  # a_rows variants only take M <= a_rows
def test_every_tile_config(cfg, m, n, k):
    """Each kernel variant on ragged shapes, whatever the heuristic would pick; split-K configs
    with every split count that leaves each split at least one k-tile."""
    dtype = _TORCH[cfg.dtype]
    a, b, bias = _inputs(m, n, k, dtype, "nk" if cfg.b_major == "k" else "kn", _TORCH.get(cfg.bias, torch.float32))
    b_nk = b if cfg.b_major == "k" else b.t()
    ref = _reference(a, b_nk, bias, cfg.slope)
    k_tiles = -(-k // glr.TILE_K)
    for splits in sorted({1, 2, 3, k_tiles}) if cfg.split_k else [1]:
        if splits > k_tiles:
            continue
        for rep in range(2):  # the split counters must be back at zero for the second run
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            glr._launch(a, b_nk, bias, out, cfg, splits)
            _assert_close(out, ref, dtype, f"{cfg} m={m} n={n} k={k} splits={splits} run {rep}")


@pytest.mark.gpu
@pytest.mark.parametrize("tile_n", sorted(glr.DECODE_TILE_N))
@pytest.mark.parametrize("m, tile_m", [(1, 64), (7, 64), (64, 64), (7, 128), (100, 128), (128, 128)])
@pytest.mark.parametrize("b_layout, bias", [("nk", None), ("kn", torch.float32), ("nk", torch.bfloat16)])
def test_split_k(m, tile_m, tile_n, b_layout, bias):
    """Every split count on ragged N and K tiles: N = 776 leaves a partial last tile for every
    width, K = 1000 a partial 16th k-tile; 16 splits give each split a single k-tile."""
    n, k = 776, 1000
    cfg = glr.GemmConfig(tile_m=tile_m, tile_n=tile_n, cluster_m=1, split_k=True,
                         b_major="k" if b_layout == "nk" else "n",
                         bias=glr.checks.DTYPE_NAME[bias] if bias is not None else "none")
    a, b, bias_t = _inputs(m, n, k, torch.bfloat16, b_layout, bias, seed=m + tile_n)
    b_nk = b if b_layout == "nk" else b.t()
    ref = _reference(a, b_nk, bias_t, cfg.slope)
    for splits in (1, 2, 3, 5, 7, 16):
        for rep in range(2):  # the tile counters must be back at zero for the second run
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            glr._launch(a, b_nk, bias_t, out, cfg, splits)
            _assert_close(out, ref, torch.bfloat16, f"{cfg} m={m} splits={splits} run {rep}")


_A_ROWS_CASES = [(1, 8), (1, 16), (7, 8), (7, 16), (8, 8), (8, 16), (9, 16), (9, 32), (16, 16),
                 (16, 32), (17, 32), (17, 64), (32, 32), (33, 64), (64, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("tile_n", sorted(glr.DECODE_TILE_N))
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
                  bias=glr.checks.DTYPE_NAME[bias] if bias is not None else "none")
    cfg = glr.GemmConfig(**common, a_rows=a_rows)
    poison_cfg = glr.GemmConfig(**common)
    a, b, bias_t = _inputs(m, n, k, torch.bfloat16, b_layout, bias, seed=m + a_rows + tile_n)
    b_nk = b if b_layout == "nk" else b.t()
    ref = _reference(a, b_nk, bias_t, cfg.slope)
    nan_a = torch.full((64, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    nan_b = torch.full_like(b_nk, float("nan"))
    sink = torch.empty(64, n, dtype=torch.bfloat16, device="cuda")
    for splits in (1, 2, 3, 7, 16):
        for rep in range(2):  # the tile counters must be back at zero for the second run
            glr._launch(nan_a, nan_b, bias_t, sink, poison_cfg, 1)
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            glr._launch(a, b_nk, bias_t, out, cfg, splits)
            _assert_close(out, ref, torch.bfloat16, f"{cfg} m={m} splits={splits} run {rep}")


@pytest.mark.gpu
def test_split_k_a_rows_matches_whole_tile_bitwise():
    """Loading fewer rows of A changes nothing in the valid rows: same bits as the whole tile."""
    for m in (1, 8, 9, 17, 32):
        a, b, _ = _inputs(m, 14336, 4096, torch.bfloat16, seed=m)
        a_rows = next(r for r in glr.A_ROWS if r >= m)
        outs = []
        for rows in (a_rows, 64):
            cfg = glr.GemmConfig(tile_m=64, tile_n=128, cluster_m=1, split_k=True, a_rows=rows)
            out = torch.full((m, 14336), float("nan"), dtype=torch.bfloat16, device="cuda")
            glr._launch(a, b, None, out, cfg, 2)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), f"m={m} a_rows={a_rows}"
        _assert_close(outs[0], _reference(a, b, None, 0.01), torch.bfloat16, f"m={m}")


@pytest.mark.gpu
def test_split_k_is_deterministic():
    a, b, bias = _inputs(16, 4096, 14336, torch.bfloat16, bias=torch.float32)
    cfg, splits = glr.select_config(16, 4096, 14336, "bf16", "k", "fp32", 0.01, modes.sm_count(0))
    assert splits > 1
    first = glr.gemm_leakyrelu(a, b, bias=bias)
    for _ in range(3):
        assert torch.equal(glr.gemm_leakyrelu(a, b, bias=bias), first)
    _assert_close(first, _reference(a, b, bias, 0.01), torch.bfloat16, "split-K decode shape")


@pytest.mark.gpu
@pytest.mark.parametrize("warm_capture_stream", [True, False])
def test_split_k_graph_survives_later_launches(warm_capture_stream):
    """A captured split-K launch keeps valid workspace pointers: larger split launches after the
    capture (which need more partials) must not free or replace what the graph uses. Without a
    warm-up on the capture stream, the capture gets tile counters of its own."""
    cfg, splits = glr.select_config(16, 4096, 4096, "bf16", "k", "none", 0.01, modes.sm_count(0))
    assert cfg.split_k and splits > 1
    a, b, _ = _inputs(16, 4096, 4096, torch.bfloat16, seed=1)
    ref = _reference(a, b, None, 0.01)
    out = torch.full((16, 4096), float("nan"), dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    glr.gemm_leakyrelu(a, b, out=out)  # compile and load outside the capture
    if warm_capture_stream:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            glr.gemm_leakyrelu(a, b, out=out)
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        glr.gemm_leakyrelu(a, b, out=out)
    # Larger split launches, on the default and on the capture stream, then churn the allocator.
    for m, n, k in [(64, 4096, 14336), (128, 8192, 14336)]:
        a2, b2, _ = _inputs(m, n, k, torch.bfloat16, seed=2)
        _, big_splits = glr.select_config(m, n, k, "bf16", "k", "none", 0.01, modes.sm_count(0))
        assert big_splits > 1
        for s in (torch.cuda.current_stream(), stream):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                out2 = glr.gemm_leakyrelu(a2, b2)
            torch.cuda.current_stream().wait_stream(s)
            _assert_close(out2, _reference(a2, b2, None, 0.01), torch.bfloat16,
                          f"eager {m}x{n}x{k}")
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
    glr.gemm_leakyrelu(a, w_kn.t(), 0.1, out=out)
    _assert_close(out, _reference(a, w_kn.t(), None, 0.1), torch.bfloat16, "strided views")
    assert torch.isnan(wide[:, :8]).all(), "wrote outside out"
    glr.gemm_leakyrelu(a, w_kn, 0.1, out=out, b_layout="kn")
    _assert_close(out, _reference(a, w_kn.t(), None, 0.1), torch.bfloat16, "b_layout=kn")


@pytest.mark.gpu
def test_empty_and_k_zero():
    a = torch.randn(0, 64, device="cuda", dtype=torch.bfloat16)
    assert glr.gemm_leakyrelu(a, torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)).shape == (0, 16)
    a = torch.randn(5, 0, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(16, device="cuda")
    out = glr.gemm_leakyrelu(a, torch.randn(16, 0, device="cuda", dtype=torch.bfloat16), 0.1, bias=bias)
    torch.testing.assert_close(out, torch.nn.functional.leaky_relu(bias, 0.1).expand(5, 16).bfloat16())


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
    fn = torch.compile(lambda x: glr.gemm_leakyrelu(x, b, bias=bias) * 2, fullgraph=True)
    _assert_close(fn(a) / 2, ref, torch.bfloat16, "torch.compile")
    out = torch.full((64, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    glr.gemm_leakyrelu(a, b, bias=bias, out=out)  # compile + warm up outside the capture
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        glr.gemm_leakyrelu(a, b, bias=bias, out=out)
    graph.replay()
    _assert_close(out, ref, torch.bfloat16, "CUDA graph")
