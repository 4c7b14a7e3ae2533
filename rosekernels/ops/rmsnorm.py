"""rmsnorm(): RMSNorm of rows, optionally fused with a residual add (the kernel:
rosekernels/kernels/rmsnorm.py).

validate -> config (rmsnorm_plan.config_for, or the tuned store's) -> compile -> plan -> launch: the
first call with an argument signature does all of it; later ones only launch.
"""
from __future__ import annotations

import torch

from rosekernels import checks, launch, modes, tuned
from rosekernels.kernels import rmsnorm as kernel
from rosekernels.kernels.rmsnorm_plan import DTYPES, MAX_HIDDEN, OP, RMSNormShape, config_for


# ---------------------------------------------------------------------------------------------
# Argument checks (the slow path: first call per shape, and after any launch failure).

def _validate(x, weight, residual, out, residual_out) -> None:
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
            checks.check_dtype(name, named[name], (x.dtype,))
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
    checks.check_vectors(named, [name for name in ("out", "residual_out") if name in named])


# ---------------------------------------------------------------------------------------------
# The op.

_plans = launch.PlanCache()


def _new_plan(x, weight, residual, out, residual_out, eps, enable_pdl) -> launch.Launch:
    """Slow path, once per signature: validate everything, pick and load the kernel."""
    _validate(x, weight, residual, out, residual_out)
    if x.shape[0] == 0:
        return launch.nothing(x.device.index)
    shape = RMSNormShape.of(x, weight, residual, eps, enable_pdl)
    sms = modes.sm_count(x.device.index)
    config = tuned.tuned_config(kernel, shape, config_for(shape, sms), sms)
    return launch.Launch(kernel.compile(config).fn, x.device.index)


def _run(x, weight, residual, out, residual_out, eps, enable_pdl=True) -> None:
    # What the plan depends on (the compiled host code checks every other dtype, shape, stride,
    # alignment and device on each call): a microsecond cheaper than a key of all five tensors.
    key = (x.shape, x.dtype, weight.dtype, residual is None, x.get_device(), eps, enable_pdl)
    plan = _plans.get(key) or _plans.put(key, _new_plan(x, weight, residual, out, residual_out, eps, enable_pdl))
    # A zero stride may be an expanded output, which the compiled checks let through.
    if 0 in out.stride() or (residual_out is not None and 0 in residual_out.stride()):
        _validate(x, weight, residual, out, residual_out)
    try:
        plan.launch(x, weight, residual, out, residual_out)
    except Exception:
        # The compiled host code raises before launching; the full checks say what is wrong.
        _validate(x, weight, residual, out, residual_out)
        raise


launch.register_op(
    OP, _run, mutates_args=("out", "residual_out"),
    schema="(Tensor x, Tensor weight, Tensor? residual, Tensor(a!) out, Tensor(b!)? residual_out, float eps, "
           "bool enable_pdl=True) -> ()")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None,
            out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, enable_pdl: bool = True):
    """RMSNorm of x [..., N] (N a multiple of 16 bytes, at most 16384) with weight [N], fp32 math.

    Without `residual`: returns out = x * rsqrt(mean(x^2) + eps) * weight.
    With `residual`: h = x + residual; returns (out, h) where out normalizes h (in fp32, before
    rounding h to the input dtype). out/residual_out may be given (e.g. residual_out=residual
    updates the residual stream in place). Rows may be strided (16-byte-aligned row stride).
    enable_pdl: launch with programmatic dependent launch (the kernel may start while the previous
    one in the stream finishes and waits for it before its loads; the next kernel may launch early):
    a microsecond less per launch in CUDA graphs.

    Eager calls launch the kernel directly (torch.library dispatch would add several us of host
    time per call); under torch.compile the call goes through the custom op rosekernels::rmsnorm.
    """
    given_out, given_residual_out, shape = out, residual_out, x.shape
    if x.dim() != 2:  # rows of [..., N] as [M, N]; given outputs must be viewable so
        x = x.reshape(-1, shape[-1])
        residual = None if residual is None else residual.reshape(-1, shape[-1])
        out = None if out is None else out.view(-1, shape[-1])
        residual_out = None if residual_out is None else residual_out.view(-1, shape[-1])
    if out is None:
        out = torch.empty_like(x)
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(x)
    # The inputs decide (each tensor checked costs host time on every call): a tensor subclass given
    # only as the weight or an output is refused by the compiled host checks.
    if launch.eager(x, residual):
        _run(x, weight, residual, out, residual_out, eps, bool(enable_pdl))
    elif all(t is None or isinstance(t, torch.Tensor) for t in (x, weight, residual, out, residual_out)):
        torch.ops.rosekernels.rmsnorm(x, weight, residual, out, residual_out, eps, bool(enable_pdl))  # traced
    else:
        _validate(x, weight, residual, out, residual_out)  # raises, naming the argument that is not a tensor
    if len(shape) != 2:
        out = out.view(shape) if given_out is None else given_out
        if residual_out is not None:
            residual_out = residual_out.view(shape) if given_residual_out is None else given_residual_out
    return out if residual is None else (out, residual_out)
