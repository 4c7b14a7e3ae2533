"""gemm_leakyrelu: every specialization compiles for sm_90a (with HGMMA), argument errors fire before
any launch (CPU); results match a float64 reference on fresh random inputs (GPU)."""
import os
import re
import shutil
import struct
import subprocess

import pytest
import torch

from rosekernels import jit
from rosekernels.kernels import gemm_leakyrelu as glr

# ---------------------------------------------------------------------------------------------
# CPU: compilation.

_NVDISASM = next((p for p in [shutil.which("nvdisasm")] + [
    os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", cu, "bin", "nvdisasm")
    for cu in ("cu13", "cuda_nvcc", "cuda_nvdisasm")] if p and os.path.exists(p)), None)


def _elf(kernel: jit.CompiledKernel) -> bytes:
    """The kernel's cubin with its program headers (which trail the sections in these ELFs)."""
    blob = kernel.object_bytes
    off = blob.find(kernel.cubin)
    phoff, = struct.unpack_from("<Q", blob, off + 0x20)
    phentsize, phnum = struct.unpack_from("<HH", blob, off + 0x36)
    return blob[off:off + max(len(kernel.cubin), phoff + phentsize * phnum)]


def _sass(kernel: jit.CompiledKernel, tmp_path) -> str:
    path = tmp_path / "k.cubin"
    path.write_bytes(_elf(kernel))
    return subprocess.run([_NVDISASM, "-c", str(path)], check=True, capture_output=True,
                          text=True).stdout


# One of each tile shape, both B orders, all bias kinds, both dtypes; the rest under `slow`.
_SPECS = glr.specializations()
_QUICK = [c for c in _SPECS if c.dtype == "bf16" and c.b_major == "k" and c.bias == "none"]
_QUICK += [glr.GemmConfig(b_major="n", bias="fp32"),
           glr.GemmConfig(dtype="fp16", bias="fp16", tile_m=128, tile_n=128, cluster_m=1,
                          split_k=True, b_major="n")]


def _compile_and_inspect(cfg, tmp_path):
    kernel = glr.compile_config(cfg)
    assert kernel.variant.mode == cfg.mode
    if _NVDISASM is None:
        pytest.skip("nvdisasm not found: compiled, SASS not inspected")
    sass = _sass(kernel, tmp_path)
    ops = set(re.findall(r"\b(HGMMA|UTMALDG|UTMASTG|STSM|LDL|STL)\b", sass))
    assert {"HGMMA", "UTMALDG", "UTMASTG", "STSM"} <= ops, (cfg, ops)
    assert not {"LDL", "STL"} & ops, f"{cfg}: register spills"


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
                    (1024, 14336, 4096), (4096, 4096, 4096), (8192, 14336, 4096)]:
        for b_major in ("k", "n"):
            cfg, splits = glr.select_config(m, n, k, "bf16", b_major, "fp32", 0.01, 132)
            assert cfg in _SPECS and splits >= 1
            assert cfg.split_k == (m <= glr.DECODE_MAX_M)
            if cfg.split_k:
                assert splits <= max(1, -(-k // glr.TILE_K) // 4)


def test_split_heuristic_fills_the_gpu():
    cfg, splits = glr.select_config(16, 4096, 14336, "bf16", "k", "none", 0.01, 132)
    assert splits == 4  # 32 tiles x 4 splits = 128 of 132 SMs
    _, splits = glr.select_config(1, 14336, 4096, "bf16", "k", "none", 0.01, 132)
    assert splits == 1  # 112 N tiles already stream the weights at full bandwidth


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
        k: v for k, v in vars(c).items() if k.startswith(("tile", "cluster", "pingpong", "split"))})
        for c in glr.specializations() if c.dtype == "bf16" and c.b_major == "k" and c.bias == "none"
        for dt, bm, bias in [("bf16", "k", "bf16"), ("fp16", "n", "fp32")]]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _every_config(), ids=lambda c: c.variant().key())
@pytest.mark.parametrize("m, n, k", [(129, 520, 264), (300, 776, 1032), (1, 8, 8), (64, 4104, 72)])
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
def test_split_k_is_deterministic():
    a, b, bias = _inputs(16, 4096, 14336, torch.bfloat16, bias=torch.float32)
    first = glr.gemm_leakyrelu(a, b, bias=bias)
    for _ in range(3):
        assert torch.equal(glr.gemm_leakyrelu(a, b, bias=bias), first)
    _assert_close(first, _reference(a, b, bias, 0.01), torch.bfloat16, "split-K decode shape")


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
