"""The norms' float64 check, as their workloads run it (the tuner's non-bitwise path and test_workload)
and as the GPU tests do (checks.relative_error against the kernel's tolerance): an output rounded once
from fp32-accurate math passes, one uniformly 1% off fails, on fresh random rows of ordinary, large and
near-zero magnitude (CPU: the check on host tensors, the kernel not compiled)."""
import math
import os

import pytest
import torch

from rosekernels import checks
from rosekernels.kernels import qk_norm as qkn
from rosekernels.kernels import rmsnorm as rms

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LARGE = {"bf16": 1e4, "fp16": 300.0, "fp32": 1e4}  # fp16 stops at 65504


def _rows(g, shape, dtype):
    """Random values whose leading rows cycle through magnitudes 1, large, 1e-4 (eps dominates the
    mean of squares there), 3 and 0."""
    scale = torch.tensor([1.0, LARGE[dtype], 1e-4, 3.0, 0.0], dtype=torch.float64)
    rows = scale[torch.arange(shape[0]) % 5].view(-1, *[1] * (len(shape) - 1))
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * rows).to(DTYPES[dtype])


def _fp32_norm(h, w, eps, bias=0.0):
    """What the kernels compute: fp32 throughout, rounded once at the end."""
    h = h.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (w.float() + bias)


def _stub_compile(monkeypatch, module):
    monkeypatch.setattr(module, "compile", lambda config: None)  # check() never launches


@pytest.mark.parametrize("dtype, wdtype, residual", [("bf16", "bf16", False), ("bf16", "fp32", True),
                                                      ("fp16", "fp16", True), ("fp32", "fp32", False)])
def test_rmsnorm_check_passes_one_rounding_and_fails_one_percent(monkeypatch, dtype, wdtype, residual):
    _stub_compile(monkeypatch, rms)
    shape = rms.Shape(rows=40, hidden=2048, dtype=dtype, weight_dtype=wdtype, residual=residual)
    check = rms.workload(rms.config_for(shape, sms=132), shape).check
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    dt = DTYPES[dtype]
    x = _rows(g, (40, 2048), dtype)
    w = (torch.randn(2048, generator=g, dtype=torch.float64) * 0.2 + 1).to(DTYPES[wdtype])
    r = _rows(g, (40, 2048), dtype).flip(0) if residual else None
    ref_out, ref_h = rms.reference(x, w, shape.eps, r)
    h = x if r is None else (x.float() + r.float())
    rounded_h = None if r is None else h.to(dt)

    assert check((x, w, r, ref_out.to(dt), None if r is None else ref_h.to(dt))) <= rms.tolerance(dt)
    assert check((x, w, r, _fp32_norm(h, w, shape.eps).to(dt), rounded_h)) <= rms.tolerance(dt)
    for off in ((ref_out * 1.01).to(dt), (ref_out * 0.99).to(dt)):
        with pytest.raises(AssertionError, match="error"):
            check((x, w, r, off, rounded_h))
    if residual:
        with pytest.raises(AssertionError, match="error"):
            check((x, w, r, ref_out.to(dt), (ref_h * 1.01).to(dt)))
    unwritten = ref_out.to(dt)
    unwritten[7, 100] = math.nan
    with pytest.raises(AssertionError, match="error inf"):
        check((x, w, r, unwritten, rounded_h))


@pytest.mark.parametrize("dtype, wdtype, bias", [("bf16", "bf16", 0.0), ("bf16", "fp32", 1.0), ("fp16", "fp16", 0.0),
                                                 ("fp32", "fp32", 0.0)])
def test_qk_norm_check_passes_one_rounding_and_fails_one_percent(monkeypatch, dtype, wdtype, bias):
    _stub_compile(monkeypatch, qkn)
    shape = qkn.Shape(tokens=20, q_heads=6, k_heads=2, head_dim=128, dtype=dtype, weight_dtype=wdtype,
                      weight_bias=bias)
    check = qkn.workload(qkn.config_for(shape, sms=132), shape).check
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    dt = DTYPES[dtype]
    # Heads of every magnitude: the rows cycle over tokens x heads.
    q = _rows(g, (20 * 6, 128), dtype).view(20, 6, 128)
    k = _rows(g, (20 * 2, 128), dtype).view(20, 2, 128)
    wq, wk = ((torch.randn(128, generator=g, dtype=torch.float64) * 0.2 + 1 - bias).to(DTYPES[wdtype]) for _ in "qk")
    ref_q, ref_k = qkn.reference(q, k, wq, wk, shape.eps, bias)

    no_rope = (None, None)
    assert check((q, k, wq, wk, ref_q.to(dt), ref_k.to(dt), *no_rope)) <= qkn.tolerance(dt)
    fp32 = (_fp32_norm(q, wq, shape.eps, bias).to(dt), _fp32_norm(k, wk, shape.eps, bias).to(dt))
    assert check((q, k, wq, wk, *fp32, *no_rope)) <= qkn.tolerance(dt)
    for off in ((ref_q * 1.01).to(dt), (ref_q * 0.99).to(dt)):
        with pytest.raises(AssertionError, match="error"):
            check((q, k, wq, wk, off, ref_k.to(dt), *no_rope))
    with pytest.raises(AssertionError, match="error"):
        check((q, k, wq, wk, ref_q.to(dt), (ref_k * 1.01).to(dt), *no_rope))


@pytest.mark.parametrize("dtype, table", [("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"), ("fp32", "fp32")])
def test_qk_norm_check_with_rope_passes_one_rounding_and_fails_one_percent_or_a_sign(monkeypatch, dtype, table):
    """With rope: an fp32 emulation of the kernel rounded once passes, also where the rotation's two terms cancel
    (random tables in [-1, 1]); 1% off, a flipped rotation or the tables swapped fail."""
    _stub_compile(monkeypatch, qkn)
    shape = qkn.Shape(tokens=20, q_heads=6, k_heads=2, head_dim=128, dtype=dtype, rope=table)
    check = qkn.workload(qkn.config_for(shape, sms=132), shape).check
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    dt = DTYPES[dtype]
    q = _rows(g, (20 * 6, 128), dtype).view(20, 6, 128)
    k = _rows(g, (20 * 2, 128), dtype).view(20, 2, 128)
    wq, wk = ((torch.randn(128, generator=g, dtype=torch.float64) * 0.2 + 1).to(dt) for _ in "qk")
    cos, sin = ((torch.rand(20, 128, generator=g, dtype=torch.float64) * 2 - 1).to(DTYPES[table]) for _ in "cs")

    def rotated(x, w, c, s):
        y = _fp32_norm(x, w, shape.eps, 0.0).float()
        half = y.shape[-1] // 2
        return (y * c.float()[:, None] + torch.cat((-y[..., half:], y[..., :half]), -1) * s.float()[:, None]).to(dt)

    good = (rotated(q, wq, cos, sin), rotated(k, wk, cos, sin))
    assert check((q, k, wq, wk, *good, cos, sin)) <= qkn.tolerance(dt)
    for bad in ((good[0].double() * 1.01).to(dt), rotated(q, wq, cos, -sin), rotated(q, wq, sin, cos)):
        with pytest.raises(AssertionError, match="error"):
            check((q, k, wq, wk, bad, good[1], cos, sin))


def test_the_tolerances_are_half_an_ulp_and_a_little():
    for dtype, half_ulp in ((torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)):
        for module in (rms, qkn):
            assert half_ulp < module.tolerance(dtype) < 1.03 * half_ulp
    # A subnormal fp16 output is measured against the smallest normal: its rounding step still fits.
    tiny = torch.finfo(torch.float16).tiny
    ref = torch.tensor([tiny / 3], dtype=torch.float64)
    assert checks.relative_error(ref.to(torch.float16), ref) <= rms.tolerance(torch.float16)
    assert checks.relative_error(torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float64)) == 0
