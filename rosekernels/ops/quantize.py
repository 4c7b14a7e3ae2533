"""quantize_fp8(): rows to e4m3 with a scale per row or per 1 x 128 group, one launch (the kernel:
rosekernels/kernels/quantize_fp8.py); quantize_weight_fp8(): a weight to e4m3 once, in torch, per
tensor, per output channel or per 128 x 128 block. rosekernels.fp8 defines the math of both.

validate -> config (quantize_fp8_plan.config_for, or the tuned store's) -> compile -> plan -> launch: the
first call with an argument signature does all of it; later ones test the addresses of given outputs for
overlaps and launch.
"""
from __future__ import annotations

from typing import Optional

import torch

from rosekernels import checks, fp8, launch, modes, tuned
from rosekernels.kernels import quantize_fp8 as kernel
from rosekernels.kernels.quantize_fp8_plan import DTYPES, OP, QuantizeShape, check_hidden, config_for


# ---------------------------------------------------------------------------------------------
# Argument checks (the slow path: first call per shape, and after any launch failure).

def _group(group_size: Optional[int]) -> int:
    if group_size is None:
        return 0
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size != fp8.BLOCK:
        raise ValueError(f"group_size must be None (a scale per row) or {fp8.BLOCK}, got {group_size!r}")
    return group_size


def _scales_shape(rows: int, k: int, group: int) -> tuple[int, ...]:
    return (rows, k // group) if group else (rows,)


def _validate(x, q, scales, group: int) -> None:
    for name, t in (("x", x), ("q", q), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    checks.check_dtype("x", x, DTYPES)
    checks.check_dtype("q", q, (fp8.E4M3,))
    checks.check_dtype("scales", scales, (torch.float32,))
    checks.check_shape("x", x, (None, None))
    rows, k = x.shape
    check_hidden(k, checks.DTYPE_NAME[x.dtype], group)
    checks.check_shape("q", q, (rows, k))
    checks.check_shape("scales", scales, _scales_shape(rows, k, group))
    checks.check_not_expanded("scales", scales)
    if scales.numel() > 1 and scales.stride(-1) != 1:  # the kernel's signature wants it unit, [M, 1] too
        raise ValueError(f"scales must be contiguous along its last dimension, got strides {scales.stride()}")
    _disjoint(x, q, scales).check(x, q, scales)
    checks.check_vectors({"x": x, "q": q}, ["q"], scales=scales)


def _disjoint(x, q, scales) -> checks.Disjoint:
    """q and scales, which CTAs write while others read x, may share memory with neither x nor each other."""
    return checks.Disjoint(dict(x=x, q=q, scales=scales), ("q", "scales"), {})


# ---------------------------------------------------------------------------------------------
# The op.

_plans = launch.PlanCache()


def _new_plan(x, q, scales, group: int, enable_pdl: bool) -> tuple[launch.Launch, checks.Disjoint]:
    """Slow path, once per signature: validate everything, pick and load the kernel; the overlap test of
    the signature's later calls."""
    _validate(x, q, scales, group)
    disjoint = _disjoint(x, q, scales)
    if x.shape[0] == 0:
        return launch.nothing(x.device.index), disjoint
    shape = QuantizeShape.of(x, group, enable_pdl)
    sms = modes.sm_count(x.device.index)
    config = tuned.tuned_config(kernel, shape, config_for(shape, sms), sms)
    return launch.Launch(kernel.compile(config).fn, x.device.index), disjoint


def _run(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int, enable_pdl: bool = True,
         given: bool = True) -> None:
    # What the plan depends on (the compiled host code checks the other shapes, strides, alignment and
    # devices on each call), and the strides, which decide whether an output's elements overlap one another
    # (expanded, or rows overlapping, which the compiled checks let through) and the spans the overlap test
    # below compares, with the outputs' dtypes (a span is strides times the element size).
    key = (x.shape, x.stride(), x.dtype, x.get_device(), q.stride(), q.dtype, scales.stride(), scales.dtype, group,
           enable_pdl)
    plan, disjoint = _plans.get(key) or _plans.put(key, _new_plan(x, q, scales, group, enable_pdl))
    # given: whether the caller gave an output (fresh ones overlap nothing); the addresses decide the rest.
    if given and disjoint.clash(x, q, scales):
        _validate(x, q, scales, group)  # raises, saying which
    try:
        plan.launch(x, q, scales)
    except Exception:
        # The compiled host code raises before launching; the full checks say what is wrong.
        _validate(x, q, scales, group)
        raise


launch.register_op(OP, _run, mutates_args=("q", "scales"),
                   schema="(Tensor x, Tensor(a!) q, Tensor(b!) scales, SymInt group, bool enable_pdl=True) -> ()")


def quantize_fp8(x: torch.Tensor, group_size: Optional[int] = None, out: Optional[torch.Tensor] = None,
                 scales: Optional[torch.Tensor] = None, enable_pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): x [..., K] (bf16/fp16/fp32) quantized to e4m3 with an fp32 scale per row
    (group_size=None: scales [...]) or per 1 x 128 group (group_size=128: scales [..., K / 128]), in one
    launch: scale = amax / 448, q = e4m3(x * 448 / amax) saturating (never inf or NaN from finite x), so
    q * scale ~ x. An all-zero row or group gets zeros and a tiny positive scale (rosekernels.fp8).
    The activations of `gemm_fp8`: per row with per-tensor or per-channel weights, per group with
    128 x 128 block-scaled ones.

    K a multiple of 16 (and of group_size), up to 32768 (bf16/fp16) or 16384 (fp32); rows may be strided
    (16-byte aligned). out (e4m3, like x) and scales may be given: viewable as rows, overlapping neither x nor
    each other. enable_pdl: launch with programmatic dependent launch. Eager calls launch the kernel directly;
    under torch.compile the call goes through the custom op rosekernels::quantize_fp8.
    """
    group = _group(group_size)
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a tensor of at least one dimension [..., K]")
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    if group and k % group:
        raise ValueError(f"group_size {group} does not divide K = {k}")
    scales_shape = (*lead, k // group) if group else lead
    for name, t, shape in (("out", out, tuple(x.shape)), ("scales", scales, scales_shape)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape):
            raise ValueError(f"{name} must be a tensor of shape {list(shape)}")
    given = out is not None or scales is not None  # fresh outputs overlap nothing
    out = torch.empty(x.shape, dtype=fp8.E4M3, device=x.device) if out is None else out
    scales = torch.empty(scales_shape, dtype=torch.float32, device=x.device) if scales is None else scales
    rows = x.numel() // k if k else 0
    rows_of = []
    for name, t, shape in (("out", out, (rows, k)), ("scales", scales, _scales_shape(rows, k, group))):
        try:
            rows_of.append(t.view(shape))
        except RuntimeError:  # torch's message names no argument
            raise ValueError(f"{name} must be viewable as rows {list(shape)}, got strides {t.stride()}") from None
    x2, (q2, s2) = x.reshape(rows, k), rows_of
    if launch.eager(x2, q2, s2):
        _run(x2, q2, s2, group, bool(enable_pdl), given)
    else:
        torch.ops.rosekernels.quantize_fp8(x2, q2, s2, group, bool(enable_pdl))  # traced, fake, meta
    return out, scales


def quantize_weight_fp8(w: torch.Tensor, scheme: str = "channel") -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): a weight w [N, K] (as nn.Linear stores it, any float dtype and device) quantized to
    e4m3 for `gemm_fp8`, once: scheme "tensor" (scales [1]), "channel" (a scale per output row: [N]) or
    "block" (per 128 x 128 block, DeepSeek-V3's: [ceil(N / 128), ceil(K / 128)]). fp32 math (float64 values
    beyond fp32's range saturate); the same rounding as quantize_fp8 (rosekernels.fp8). A gated GEMM's weight
    is quantized after its gate and up rows are interleaved (`gate_up_rows`), so that its blocks are the rows
    the kernel multiplies together."""
    if scheme not in fp8.WEIGHT_SCHEMES:
        raise ValueError(f"scheme must be one of {sorted(fp8.WEIGHT_SCHEMES)}, got {scheme!r}")
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError("w must be a 2-D floating-point tensor [N, K]")
    return fp8.quantize(w, *fp8.WEIGHT_SCHEMES[scheme])
