"""rmsnorm(): RMSNorm of rows, optionally fused with a residual add and with the quantization of the output
to e4m3 (the kernel: rosekernels/kernels/rmsnorm.py).

validate -> config (rmsnorm_plan.config_for, or the tuned store's) -> compile -> plan -> launch: the
first call with an argument signature does all of it; later ones only test the addresses of given
outputs for overlaps and launch.
"""
from __future__ import annotations

import torch

from rosekernels import checks, fp8 as fp8_math, launch, modes, tuned
from rosekernels.kernels import rmsnorm as kernel
from rosekernels.kernels.rmsnorm_plan import DTYPES, FP8, MAX_HIDDEN, OP, RMSNormShape, check_fp8, config_for


# ---------------------------------------------------------------------------------------------
# Argument checks (the slow path: first call per shape, and after any launch failure).

def _scales_shape(rows: int, hidden: int, fp8: str) -> tuple[int, ...]:
    return (rows, hidden // FP8[fp8]) if FP8[fp8] else (rows,)


def _validate(x, weight, residual, out, residual_out, fp8: str = "none", scales=None) -> None:
    named = {n: t for n, t in (("x", x), ("weight", weight), ("residual", residual), ("out", out),
                               ("residual_out", residual_out)) if t is not None or n in ("x", "weight")}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if residual_out is not None and residual is None:
        raise ValueError("residual_out needs a residual")
    checks.check_dtype("x", x, DTYPES)
    for name in ("residual", "out", "residual_out"):
        if name in named:
            checks.check_dtype(name, named[name], (fp8_math.E4M3,) if name == "out" and fp8 != "none" else (x.dtype,))
    checks.check_dtype("weight", weight, dict.fromkeys((x.dtype, torch.float32)))
    checks.check_shape("x", x, (None, None))
    hidden = x.shape[1]
    vec = checks.vector_width(x.dtype)
    if not (0 < hidden <= MAX_HIDDEN) or hidden % vec:
        raise ValueError(f"hidden size {hidden} is not supported: it must be a multiple of {vec} "
                         f"(16 bytes) and at most {MAX_HIDDEN}")
    checks.check_shape("weight", weight, (hidden,))
    for name in ("residual", "out", "residual_out"):
        if name in named:
            checks.check_shape(name, named[name], tuple(x.shape))
    if fp8 != "none":
        check_fp8(fp8, hidden)
        if not isinstance(scales, torch.Tensor):
            raise TypeError(f"scales must be a torch.Tensor, got {type(scales).__name__}")
        checks.check_dtype("scales", scales, (torch.float32,))
        checks.check_shape("scales", scales, _scales_shape(x.shape[0], hidden, fp8))
        checks.check_not_expanded("scales", scales)
        if scales.numel() > 1 and scales.stride(-1) != 1:
            raise ValueError(f"scales must be contiguous along its last dimension, got strides {scales.stride()}")
    tensors = (x, weight, residual, out, residual_out, scales)
    _disjoint(*tensors).check(*tensors)
    checks.check_vectors(named, [name for name in ("out", "residual_out") if name in named],
                         scales=scales if fp8 != "none" else None)


def _disjoint(x, weight, residual, out, residual_out, scales) -> checks.Disjoint:
    """The outputs may share memory with no input and no other output, but for the in-place forms: out x,
    residual_out residual."""
    return checks.Disjoint(dict(x=x, weight=weight, residual=residual, out=out, residual_out=residual_out,
                                scales=scales), ("out", "residual_out", "scales"),
                           {"out": "x", "residual_out": "residual"})


# ---------------------------------------------------------------------------------------------
# The op.

_plans = launch.PlanCache()


def _new_plan(x, weight, residual, out, residual_out, eps, enable_pdl, fp8,
              scales) -> tuple[launch.Launch, checks.Disjoint]:
    """Slow path, once per signature: validate everything, pick and load the kernel; the overlap test of
    the signature's later calls."""
    _validate(x, weight, residual, out, residual_out, fp8, scales)
    disjoint = _disjoint(x, weight, residual, out, residual_out, scales)
    if x.shape[0] == 0:
        return launch.nothing(x.device.index), disjoint
    shape = RMSNormShape.of(x, weight, residual, eps, enable_pdl, fp8)
    sms = modes.sm_count(x.device.index)
    config = tuned.tuned_config(kernel, shape, config_for(shape, sms), sms)
    return launch.Launch(kernel.compile(config).fn, x.device.index), disjoint


def _run(x, weight, residual, out, residual_out, eps, enable_pdl=True, scales=None, fp8="none", given=True) -> None:
    # What the plan depends on, and the strides, which decide whether an output's elements overlap one
    # another (check_not_expanded) and the spans the overlap test below compares: the compiled host code
    # checks the other dtypes and shapes, the alignment and the devices on each call, not these.
    key = (x.shape, x.stride(), x.dtype, weight.dtype, x.get_device(), eps, enable_pdl, fp8,
           None if residual is None else residual.stride(), out.stride(),
           None if residual_out is None else residual_out.stride(), None if scales is None else scales.stride())
    plan, disjoint = _plans.get(key) or _plans.put(key, _new_plan(x, weight, residual, out, residual_out, eps,
                                                                  enable_pdl, fp8, scales))
    # given: whether the caller gave an output (fresh ones overlap nothing); the addresses decide the rest.
    if given and disjoint.clash(x, weight, residual, out, residual_out, scales):
        _validate(x, weight, residual, out, residual_out, fp8, scales)  # raises, saying which
    try:
        plan.launch(x, weight, residual, out, residual_out, scales)
    except Exception:
        # The compiled host code raises before launching; the full checks say what is wrong.
        _validate(x, weight, residual, out, residual_out, fp8, scales)
        raise


def _run_fp8(x, weight, residual, out, residual_out, scales, eps, enable_pdl, fp8) -> None:
    _run(x, weight, residual, out, residual_out, eps, enable_pdl, scales, fp8)


# Two custom ops: torch 2.11's tracing fails on an optional mutable tensor passed as None (the scales
# of a bf16 norm), so the e4m3 norm has an op of its own whose scales are always given.
launch.register_op(
    OP, _run, mutates_args=("out", "residual_out"),
    schema="(Tensor x, Tensor weight, Tensor? residual, Tensor(a!) out, Tensor(b!)? residual_out, float eps, "
           "bool enable_pdl=True) -> ()")
launch.register_op(
    f"{OP}_fp8", _run_fp8, mutates_args=("out", "residual_out", "scales"),
    schema="(Tensor x, Tensor weight, Tensor? residual, Tensor(a!) out, Tensor(b!)? residual_out, "
           "Tensor(c!) scales, float eps, bool enable_pdl, str fp8) -> ()")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None,
            out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, enable_pdl: bool = True,
            fp8: bool = False, group_size: int | None = None, scales: torch.Tensor | None = None):
    """RMSNorm of x [..., N] (N a multiple of 16 bytes, at most 16384) with weight [N], fp32 math.

    Without `residual`: returns out = x * rsqrt(mean(x^2) + eps) * weight.
    With `residual`: h = x + residual; returns (out, h) where out normalizes h (in fp32, before
    rounding h to the input dtype). out/residual_out may be given (e.g. residual_out=residual
    updates the residual stream in place; out=x normalizes in place); no other output may share memory
    with an input or another output. Rows may be strided (16-byte-aligned row stride).
    enable_pdl: launch with programmatic dependent launch (the kernel may start while the previous
    one in the stream finishes and waits for it before its loads; the next kernel may launch early):
    a microsecond less per launch in CUDA graphs.

    fp8=True: out is quantized to e4m3 in the same launch, as quantize_fp8 would quantize the normalized
    rows (from their fp32 values): returns (out, scales), with a residual (out, scales, h); scales fp32 [...]
    per row, or with group_size=128 per 1 x 128 group, [..., N / 128] (N a multiple of 16, and of 128 for
    groups). The activations of gemm_fp8. out (e4m3) and scales may be given.

    Eager calls launch the kernel directly (torch.library dispatch would add several us of host
    time per call); under torch.compile the call goes through the custom op rosekernels::rmsnorm
    (rosekernels::rmsnorm_fp8 with fp8=True).
    """
    kind = _fp8_kind(fp8, group_size)
    given_out, given_residual_out, shape = out, residual_out, x.shape
    given = out is not None or residual_out is not None or scales is not None
    if x.dim() != 2:  # rows of [..., N] as [M, N]; given outputs must be viewable so
        for name, t in (("residual", residual), ("out", out), ("residual_out", residual_out)):
            if t is not None and t.shape != shape:  # as rows, any shape of as many rows would pass
                checks.check_shape(name, t, tuple(shape))
        x = x.reshape(-1, shape[-1])
        residual = None if residual is None else residual.reshape(-1, shape[-1])
        out = None if out is None else out.view(-1, shape[-1])
        residual_out = None if residual_out is None else residual_out.view(-1, shape[-1])
    rows_scales = None  # the scales as [M] or [M, N / 128]
    if kind != "none":
        hidden, group = shape[-1], FP8[kind]
        if group and hidden % group:
            raise ValueError(f"group_size {group} does not divide the hidden size {hidden}")
        want = (*shape[:-1], hidden // group) if group else tuple(shape[:-1])
        if scales is None:
            scales = torch.empty(want, dtype=torch.float32, device=x.device)
        elif not isinstance(scales, torch.Tensor) or tuple(scales.shape) != want:
            raise ValueError(f"scales must be a tensor of shape {list(want)}")
        rows_scales = scales.view(_scales_shape(x.shape[0], hidden, kind))
    if out is None:
        out = torch.empty_like(x) if kind == "none" else torch.empty(x.shape, dtype=fp8_math.E4M3, device=x.device)
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(x)
    # The inputs decide (each tensor checked costs host time on every call): a tensor subclass given
    # only as the weight or an output is refused by the compiled host checks.
    if launch.eager(x, residual):
        _run(x, weight, residual, out, residual_out, eps, bool(enable_pdl), rows_scales, kind, given)
    elif all(t is None or isinstance(t, torch.Tensor) for t in (x, weight, residual, out, residual_out)):
        if kind == "none":  # traced
            torch.ops.rosekernels.rmsnorm(x, weight, residual, out, residual_out, eps, bool(enable_pdl))
        else:
            torch.ops.rosekernels.rmsnorm_fp8(x, weight, residual, out, residual_out, rows_scales, eps,
                                              bool(enable_pdl), kind)
    else:
        _validate(x, weight, residual, out, residual_out, kind, rows_scales)  # raises, naming what is not a tensor
    if len(shape) != 2:
        out = out.view(shape) if given_out is None else given_out
        if residual_out is not None:
            residual_out = residual_out.view(shape) if given_residual_out is None else given_residual_out
    normed = out if kind == "none" else (out, scales)
    if residual is None:
        return normed
    return (out, residual_out) if kind == "none" else (out, scales, residual_out)


def _fp8_kind(fp8: bool, group_size: int | None) -> str:
    """The kernel's fp8 option (a key of FP8) of rmsnorm's fp8 and group_size arguments."""
    if not fp8:
        if group_size is not None:
            raise ValueError("group_size is for an e4m3 output: pass fp8=True")
        return "none"
    if group_size is None:
        return "row"
    if group_size != fp8_math.BLOCK:
        raise ValueError(f"group_size must be None (a scale per row) or {fp8_math.BLOCK}, got {group_size!r}")
    return "group"
