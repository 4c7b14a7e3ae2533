"""grouped_gemm(): rows grouped by expert, each group times its expert's weight, with the GEMM's epilogues,
in one kernel (rosekernels/kernels/grouped_gemm.py).

validate -> config (grouped_gemm_plan.config_for, or the tuned store's) -> compile -> plan -> launch:
the first call with an argument signature does all of it; later ones check the pointers (alignment,
out overlapping an input: by the overlap test the plan made once) and launch.
"""
from __future__ import annotations

from typing import Optional

import torch

from rosekernels import checks, launch, modes, tuned
from rosekernels.kernels import grouped_gemm as kernel
from rosekernels.kernels.gemm_leakyrelu_plan import ACTIVATIONS
from rosekernels.kernels.grouped_gemm_plan import OP, GroupedShape, check_sizes, config_for
from rosekernels.kernels.moe_common import check_sm90, rows_view

_DTYPES = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# Argument checks (the slow path: first call per signature, and after any launch failure).

def _rows(a: torch.Tensor, a_index: Optional[torch.Tensor]) -> int:
    return a_index.shape[0] if a_index is not None else a.shape[0]


def _check_shapes(a, w, group_offsets, bias, a_index, row_scale, out, gated: bool) -> None:
    """Types, dtypes and shapes (also checked on fake tensors, when torch.compile traces the op)."""
    named = {"a": a, "w": w, "group_offsets": group_offsets, "out": out}
    named.update({k: v for k, v in (("bias", bias), ("a_index", a_index), ("row_scale", row_scale)) if v is not None})
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    checks.check_dtype("a", a, _DTYPES)
    for name in ("w", "out"):
        checks.check_dtype(name, named[name], (a.dtype,))
    checks.check_dtype("group_offsets", group_offsets, (torch.int32,))
    checks.check_shape("a", a, (None, None))
    checks.check_shape("w", w, (None, None, a.shape[1]))
    experts, n, k = w.shape
    checks.check_shape("group_offsets", group_offsets, (experts + 1,))
    if bias is not None:
        checks.check_dtype("bias", bias, (a.dtype, torch.float32))
        checks.check_shape("bias", bias, (experts, n))
    if a_index is not None:
        checks.check_dtype("a_index", a_index, (torch.int32,))
        checks.check_shape("a_index", a_index, (None,))
    rows = _rows(a, a_index)
    if a_index is not None and rows and not a.shape[0]:
        raise ValueError(f"a has 0 rows, but a_index gathers {rows}")
    if row_scale is not None:
        checks.check_dtype("row_scale", row_scale, (torch.float32,))
        checks.check_shape("row_scale", row_scale, (rows,))
    checks.check_shape("out", out, (rows, n // 2 if gated else n))
    if k == 0 or n == 0:
        raise ValueError(f"w is [E, N, K] = {list(w.shape)}: N and K must be positive")
    check_sizes(rows, experts, n, k, gated)


def _check_memory(a, w, group_offsets, bias, a_index, row_scale, out) -> None:
    """Strides, alignment, aliasing and the device (last, so that every other error shows on CPU
    tensors too)."""
    for name, t in (("a", a), ("w", w), ("out", out)):
        checks.check_unit_last_stride(name, t)
        checks.check_aligned(name, rows_view(t))
    for name, t in (("group_offsets", group_offsets), ("bias", bias), ("a_index", a_index), ("row_scale", row_scale)):
        if t is not None:
            checks.check_unit_last_stride(name, t)
    checks.check_not_expanded("out", out)
    _disjoint(a, w, group_offsets, bias, a_index, row_scale, out).check(a, w, group_offsets, bias, a_index,
                                                                         row_scale, out)
    checks.check_same_device(a=a, w=w, group_offsets=group_offsets, bias=bias, a_index=a_index,
                             row_scale=row_scale, out=out)
    checks.check_cuda("a", a)
    check_sm90(a.device)


def _disjoint(a, w, group_offsets, bias, a_index, row_scale, out) -> checks.Disjoint:
    """out may share memory with no input (other CTAs still read them while one writes out)."""
    return checks.Disjoint(dict(a=a, w=w, group_offsets=group_offsets, bias=bias, a_index=a_index,
                                row_scale=row_scale, out=out), ("out",), {})


# ---------------------------------------------------------------------------------------------
# The op.

class _Plan(launch.Launch):
    """One config launched on one argument signature: the launch arguments' bounds and out's overlap test
    computed once; a launch checks what depends on the data pointers (16-byte alignment, out overlapping
    an input) with a few integer comparisons."""

    def __init__(self, config, a, w, group_offsets, bias, a_index, row_scale, out):
        super().__init__(kernel.compile(config).fn, a.device.index)
        self.config = config
        self.canonical = any(rows_view(t) is not t for t in (a, w, out))
        self.scalars = kernel.launch_args(config, a, w, out, bias, group_offsets, a_index, row_scale)[-2:]
        self.disjoint = _disjoint(a, w, group_offsets, bias, a_index, row_scale, out)

    def launch(self, a, w, group_offsets, bias, a_index, row_scale, out) -> None:
        if (a.data_ptr() | w.data_ptr() | out.data_ptr()) % 16 or self.disjoint.clash(
                a, w, group_offsets, bias, a_index, row_scale, out):
            _check_memory(a, w, group_offsets, bias, a_index, row_scale, out)  # raises, saying which
        if self.canonical:
            a, w, out = rows_view(a), rows_view(w), rows_view(out)
        try:
            launch.on_device(self.device, self.fn, a, w, out, bias, group_offsets, a_index, row_scale, *self.scalars)
        except Exception:
            # The compiled host code checks its arguments and raises before launching; the full
            # checks say what is wrong in this op's terms.
            _check_shapes(a, w, group_offsets, bias, a_index, row_scale, out, self.config.gated)
            _check_memory(a, w, group_offsets, bias, a_index, row_scale, out)
            raise


_plans = launch.PlanCache()


def _new_plan(a, w, group_offsets, bias, a_index, row_scale, out, activation: str, gated: bool,
              negative_slope: float, enable_pdl: bool):
    """Slow path, once per argument signature: every check, the heuristic, the compile."""
    _check_shapes(a, w, group_offsets, bias, a_index, row_scale, out, gated)
    _check_memory(a, w, group_offsets, bias, a_index, row_scale, out)
    rows = _rows(a, a_index)
    if rows == 0:
        return launch.nothing(a.device.index)
    shape = GroupedShape.of(a, w, rows, bias, activation, gated, negative_slope, a_index is not None,
                            row_scale is not None, enable_pdl)
    sms = modes.sm_count(a.device.index)
    config = tuned.tuned_config(kernel, shape, config_for(shape, sms), sms)
    return _Plan(config, a, w, group_offsets, bias, a_index, row_scale, out)


def _signature(t: Optional[torch.Tensor]) -> Optional[tuple]:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())


def _run(a: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, bias: Optional[torch.Tensor],
         a_index: Optional[torch.Tensor], row_scale: Optional[torch.Tensor], out: torch.Tensor, activation: str,
         gated: bool, negative_slope: float, enable_pdl: bool = True) -> None:
    key = (a.shape, a.stride(), a.dtype, a.get_device(), w.shape, w.stride(), w.dtype, w.get_device(),
           group_offsets.shape, group_offsets.stride(), group_offsets.dtype, group_offsets.get_device(),
           out.shape, out.stride(), out.dtype, out.get_device(), _signature(bias), _signature(a_index),
           _signature(row_scale), activation, gated, negative_slope, enable_pdl)
    plan = _plans.get(key) or _plans.put(key, _new_plan(a, w, group_offsets, bias, a_index, row_scale, out,
                                                        activation, gated, negative_slope, enable_pdl))
    plan.launch(a, w, group_offsets, bias, a_index, row_scale, out)


def _fake(a, w, group_offsets, bias, a_index, row_scale, out, activation, gated, negative_slope,
          enable_pdl=True) -> None:
    _check_shapes(a, w, group_offsets, bias, a_index, row_scale, out, gated)


_op = launch.register_op(OP, _run, mutates_args=("out",), fake=_fake)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
                 activation: Optional[str] = None, gated: bool = False, negative_slope: float = 0.01,
                 a_index: Optional[torch.Tensor] = None, row_scale: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None, enable_pdl: bool = True) -> torch.Tensor:
    """For each expert e: out[r] = act(a[r] @ w[e]^T + bias[e]) * row_scale[r] for the rows
    group_offsets[e] <= r < group_offsets[e + 1] (moe_dispatch's `offsets`; rows in no group are not
    written), in one kernel: swapped decode tiles visit only the experts that have rows, prefill tiles
    are the dense GEMM's. fp32 accumulation, one rounding to a's dtype.

    a: [R, K] bf16/fp16, K contiguous (with a_index: [T, K] and row r is a[a_index[r]], gathered
    in the kernel: no dispatched copy); w: [E, N, K] in a's dtype, K contiguous (an nn.Linear weight
    per expert: transformers' gate_up_proj / down_proj); group_offsets: [E + 1] int32 on the device,
    read there only (no host sync: CUDA graphs capture the call, new groupings replay); E <= 512.
    activation: None, "relu", "leaky_relu" (negative_slope), "silu" or "gelu_tanh". gated=True:
    out = act(a @ gate[e]^T) * (a @ up[e]^T) with w[e] = [gate; up] stacked along N (transformers'
    gate_up_proj, no conversion), out [R, N / 2], N a multiple of 16; bias [E, N] stacked the same
    way (a's dtype or fp32). row_scale: [R] fp32, multiplies each out row after the activation (a
    routing weight). a_index [R] int32. Garbage offsets or indices give garbage rows, never an access
    outside the tensors (each is clamped into them). out: [R, N] (gated: N / 2) in a's dtype,
    allocated when None; it must not overlap an input. Rows past the last group (offsets[E] <= r) are
    not written.

    Registered as torch.ops.rosekernels.grouped_gemm (mutating `out`) for torch.compile; eager calls
    skip the dispatcher.
    """
    activation = "none" if activation is None else activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS[1:]}, got {activation!r}")
    gated, slope = bool(gated), float(negative_slope) if activation == "leaky_relu" else 0.01
    if out is None:
        if not (isinstance(a, torch.Tensor) and a.dim() == 2 and isinstance(w, torch.Tensor) and w.dim() == 3):
            raise ValueError("a must be a 2-D tensor [rows, K] and w a 3-D tensor [E, N, K]")
        rows = a_index.shape[0] if isinstance(a_index, torch.Tensor) else a.shape[0]
        out = a.new_empty((rows, w.shape[1] // 2 if gated else w.shape[1]))
    if launch.eager(a, w, group_offsets, bias, a_index, row_scale, out):
        _run(a, w, group_offsets, bias, a_index, row_scale, out, activation, gated, slope, bool(enable_pdl))
    else:
        _op(a, w, group_offsets, bias, a_index, row_scale, out, activation, gated, slope, bool(enable_pdl))
    return out
