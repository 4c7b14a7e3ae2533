"""gemm_fp8(): act((a @ w^T) * scales + bias) with e4m3 a and w, in one kernel (rosekernels/kernels/gemm_fp8.py:
the GEMM kernel with its FP8 option).

validate -> config (gemm_fp8_plan.config_for, or the tuned store's) -> compile -> plan -> launch: the first call
with an argument signature does all of it; later ones check the pointers (alignment, overlap), fetch the split-K
workspace and launch. `run(...)` launches a given config (tests, the benchmark's sweep, the tuner).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from rosekernels import checks, fp8, launch, modes, scratch, tuned
from rosekernels.kernels import gemm_fp8 as kernel
from rosekernels.kernels.gemm_fp8_plan import OP, OUT_DTYPES, Fp8GemmConfig, Fp8GemmShape, check_sizes, config_for
from rosekernels.kernels.gemm_leakyrelu_plan import ACTIVATIONS, COUNTER_SLOTS, check_fits, partial_floats

_OUT_DTYPES = tuple(checks.TORCH_DTYPE[d] for d in OUT_DTYPES)
SCHEMES = ("per tensor: a_scale and w_scale of one element; per token x per channel: a_scale [M] (or [M, 1]) and "
           "w_scale [N] (or [N, 1]), either may be one element; 128 x 128 blocks: a_scale [M, K / 128] and "
           "w_scale [ceil(N / 128), K / 128]")


# ---------------------------------------------------------------------------------------------
# Argument checks (the slow path: first call per signature, and after any launch failure).

def _scales_kind(a_scale: torch.Tensor, w_scale: torch.Tensor, m: int, n: int, k: int) -> str:
    """"rowcol" or "block", from the scales' shapes; ValueError naming the accepted shapes otherwise."""
    def per_row(s: torch.Tensor, rows: int) -> bool:
        return s.numel() == 1 and s.dim() <= 2 or tuple(s.shape) in ((rows,), (rows, 1))

    if per_row(a_scale, m) and per_row(w_scale, n):
        return "rowcol"
    groups = math.ceil(k / fp8.BLOCK)
    if tuple(a_scale.shape) == (m, groups) and tuple(w_scale.shape) == (math.ceil(n / fp8.BLOCK), groups):
        return "block"
    raise ValueError(f"a_scale {list(a_scale.shape)} and w_scale {list(w_scale.shape)} are no scale scheme of an "
                     f"[{m}, {k}] x [{n}, {k}] product; the schemes: {SCHEMES}")


def _check_shapes(a, a_scale, w, w_scale, bias, out, gated: bool) -> str:
    """Dtypes and shapes (also checked on fake tensors, when torch.compile traces the op); the scales' kind."""
    for name, t in (("a", a), ("a_scale", a_scale), ("w", w), ("w_scale", w_scale), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    checks.check_dtype("a", a, (fp8.E4M3,))
    checks.check_dtype("w", w, (fp8.E4M3,))
    checks.check_dtype("a_scale", a_scale, (torch.float32,))
    checks.check_dtype("w_scale", w_scale, (torch.float32,))
    if a.dim() != 2 or w.dim() != 2:
        raise ValueError(f"a and w must be 2-D, got shapes {list(a.shape)} and {list(w.shape)}")
    (m, k), n = a.shape, w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"a is [M, K] = {list(a.shape)} but w gives K = {w.shape[1]}")
    kind = _scales_kind(a_scale, w_scale, m, n, k)
    check_sizes(n, k, gated, kind)
    checks.check_dtype("out", out, _OUT_DTYPES)
    checks.check_shape("out", out, (m, n // 2 if gated else n))
    if bias is not None:
        checks.check_dtype("bias", bias, dict.fromkeys((out.dtype, torch.float32)))
        checks.check_shape("bias", bias, (n,))
        if n > 1 and bias.stride(0) != 1:
            raise ValueError("bias must be contiguous")
    return kind


def _check_memory(a, a_scale, w, w_scale, bias, out) -> None:
    """Strides, alignment, aliasing and the device (last, so that every other error shows on CPU tensors too)."""
    for name, t in (("a", a), ("w", w), ("out", out)):
        if t.numel():
            checks.check_unit_last_stride(name, t)
            if t.shape[0] > 1:
                checks.check_aligned(name, t)
            elif t.data_ptr() % 16:
                raise ValueError(f"{name} must be 16-byte aligned")
    _disjoint(a, a_scale, w, w_scale, bias, out).check(a, a_scale, w, w_scale, bias, out)
    checks.check_not_expanded("out", out)
    checks.check_same_device(a=a, a_scale=a_scale, w=w, w_scale=w_scale, bias=bias, out=out)
    checks.check_cuda("a", a)


def _disjoint(a, a_scale, w, w_scale, bias, out) -> checks.Disjoint:
    """out may share memory with no input (other CTAs still read them while one writes out)."""
    return checks.Disjoint(dict(a=a, a_scale=a_scale, w=w, w_scale=w_scale, bias=bias, out=out), ("out",), {})


# ---------------------------------------------------------------------------------------------
# Launching.

class _Plan(launch.Launch):
    """One config launched on one argument signature: what the signature decides is computed once (out's
    overlap test among it); a launch checks what depends on the data pointers (16-byte alignment, out
    overlapping an input), fetches the split-K workspace and launches."""

    def __init__(self, a, a_scale, w, w_scale, bias, out, config: Fp8GemmConfig):
        m, n = a.shape[0], w.shape[0]
        check_fits(config, m, n)
        super().__init__(kernel.compile(config).fn, a.device.index)
        self.config = config
        self.partial_floats = partial_floats(config, m, n) if config.splits > 1 else 0
        self.clusters = modes.max_active_clusters(self.device, config.cluster_m * config.cluster_n)
        # A single row may carry any stride: the kernel's TMA view wants a 16-byte multiple.
        self.row_stride = 16 * math.ceil(a.shape[1] / 16) if m == 1 and a.stride(0) % 16 else None
        self.disjoint = _disjoint(a, a_scale, w, w_scale, bias, out)

    def launch(self, a, a_scale, w, w_scale, bias, out, private_scratch: bool = False) -> None:
        if (a.data_ptr() | w.data_ptr() | out.data_ptr()) % 16 or self.disjoint.clash(a, a_scale, w, w_scale,
                                                                                       bias, out):
            _check_memory(a, a_scale, w, w_scale, bias, out)  # raises, saying which
        partials = counters = None
        if self.config.split_k:
            # Tile counters that the last split of each tile returns to zero (see rosekernels.scratch).
            counters = scratch.zeroed_int32(self.device, COUNTER_SLOTS, private_scratch)
            partials = (torch.empty(self.partial_floats, dtype=torch.float32, device=a.device) if self.partial_floats
                        else scratch.unread_float32(self.device))
        if self.row_stride is not None:
            a = a.as_strided(a.shape, (self.row_stride, 1))
        args = kernel.launch_args(self.config, a, a_scale, w, w_scale, bias, out, partials, counters, self.clusters)
        try:
            launch.on_device(self.device, self.fn, *args)
        except Exception:
            # The compiled host code checks its arguments and raises before launching; the full checks say
            # what is wrong in this op's terms.
            _check_shapes(a, a_scale, w, w_scale, bias, out, self.config.gated)
            _check_memory(a, a_scale, w, w_scale, bias, out)
            raise


class _NoProduct:
    """The plan of a problem without K tiles or without outputs: out = act(bias) for K = 0, nothing to write
    for M = 0 or N = 0."""

    def __init__(self, activation: str, gated: bool, negative_slope: float):
        self.epilogue = (activation, gated, negative_slope)

    def launch(self, a, a_scale, w, w_scale, bias, out, private_scratch: bool = False) -> None:
        if out.numel() == 0:
            return
        _check_memory(a, a_scale, w, w_scale, bias, out)
        y = bias.float() if bias is not None else out.new_zeros(w.shape[0], dtype=torch.float32)
        out.copy_(kernel.epilogue_reference(y, *self.epilogue).expand(out.shape))


def run(a, a_scale, w, w_scale, bias, out, config: Fp8GemmConfig) -> None:
    """Launch `config` (its tile shape, K splits and raster group) on arguments gemm_fp8 accepts (M, N, K > 0),
    whatever config_for would pick: for tests, the benchmark's sweep and the tuner. Plans anew on every call."""
    if _check_shapes(a, a_scale, w, w_scale, bias, out, config.gated) != config.scales:
        raise ValueError(f"{config} takes {config.scales} scales")
    _Plan(a, a_scale, w, w_scale, bias, out, config).launch(a, a_scale, w, w_scale, bias, out)


# ---------------------------------------------------------------------------------------------
# The op.

_plans = launch.PlanCache()


def _new_plan(a, a_scale, w, w_scale, bias, out, activation: str, gated: bool, negative_slope: float,
              enable_pdl: bool):
    """Slow path, once per argument signature: every check, the heuristic, the compile."""
    kind = _check_shapes(a, a_scale, w, w_scale, bias, out, gated)
    _check_memory(a, a_scale, w, w_scale, bias, out)
    if 0 in (*a.shape, w.shape[0]):
        return _NoProduct(activation, gated, negative_slope)
    shape = Fp8GemmShape.of(a, w, bias, out, kind, activation, gated, negative_slope, enable_pdl)
    sms = modes.sm_count(a.device.index)
    return _Plan(a, a_scale, w, w_scale, bias, out, tuned.tuned_config(kernel, shape, config_for(shape, sms), sms))


def _run(a, a_scale, w, w_scale, bias, out, activation: str, gated: bool, negative_slope: float,
         enable_pdl: bool = True, private_scratch: bool = False) -> None:
    # The plan's signature, written out (a generic builder costs about a microsecond more).
    key = (a.shape, a.stride(), w.shape, w.stride(), a_scale.shape, a_scale.stride(), w_scale.shape, w_scale.stride(),
           out.shape, out.stride(), a.dtype, w.dtype, a_scale.dtype, w_scale.dtype, out.dtype, a.get_device(),
           w.get_device(), a_scale.get_device(), w_scale.get_device(), out.get_device(), activation, gated,
           negative_slope, enable_pdl,
           None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.get_device()))
    plan = _plans.get(key) or _plans.put(key, _new_plan(a, a_scale, w, w_scale, bias, out, activation, gated,
                                                        negative_slope, enable_pdl))
    plan.launch(a, a_scale, w, w_scale, bias, out, private_scratch)


def _impl(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
          bias: Optional[torch.Tensor], out: torch.Tensor, activation: str, gated: bool, negative_slope: float,
          enable_pdl: bool = True) -> None:
    # private_scratch: rosekernels.scratch
    _run(a, a_scale, w, w_scale, bias, out, activation, gated, negative_slope, enable_pdl, private_scratch=True)


def _fake(a, a_scale, w, w_scale, bias, out, activation, gated, negative_slope, enable_pdl=True) -> None:
    _check_shapes(a, a_scale, w, w_scale, bias, out, gated)


_op = launch.register_op(OP, _impl, mutates_args=("out",), fake=_fake)


def gemm_fp8(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             bias: Optional[torch.Tensor] = None, activation: Optional[str] = None, gated: bool = False,
             out_dtype: torch.dtype = torch.bfloat16, negative_slope: float = 0.01, out: Optional[torch.Tensor] = None,
             enable_pdl: bool = True) -> torch.Tensor:
    """act((a @ w^T) * scales + bias) for e4m3 a [M, K] and w [N, K] (nn.Linear's layout, K contiguous), in one
    kernel with fp32 accumulation (each 128-element k-tile's tensor-core sums promoted to fp32), out [M, N] in
    out_dtype (bf16 or fp16). The scales (fp32) say what a and w hold:

        per tensor                 a_scale and w_scale of one element
        per token x per channel    a_scale [M] (or [M, 1]), w_scale [N] (or [N, 1]); either may be one element
        128 x 128 blocks           a_scale [M, K / 128] (1 x 128 groups), w_scale [ceil(N / 128), K / 128]

    quantize_fp8 makes a and its scales (per row, or group_size=128 for blocks), quantize_weight_fp8 w and
    its scales ("tensor", "channel" or "block"). activation None, "relu", "leaky_relu" (negative_slope),
    "silu" or "gelu_tanh"; gated=True: out = act(gate) * up over w's gate and up rows interleaved in blocks
    of 8 (`gate_up_rows`, then quantize_weight_fp8), out [M, N / 2]. bias: [N] in out_dtype or fp32.
    K a multiple of 16 (of 128 with block scales), N of 8 (gated: 16); rows 16-byte aligned. Prefill and
    decode variants as `gemm` (decode swaps the operands for few tokens). enable_pdl: programmatic dependent
    launch. Registered as torch.ops.rosekernels.gemm_fp8 (mutating `out`); eager calls skip the dispatcher.
    """
    activation = "none" if activation is None else activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS[1:]}, got {activation!r}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    slope = float(negative_slope) if activation == "leaky_relu" else 0.01
    if out is None:
        if not isinstance(a, torch.Tensor) or not isinstance(w, torch.Tensor) or a.dim() != 2 or w.dim() != 2:
            raise ValueError("a and w must be 2-D tensors")
        out = torch.empty((a.shape[0], w.shape[0] // 2 if gated else w.shape[0]), dtype=out_dtype, device=a.device)
    if launch.eager(a, a_scale, w, w_scale, bias, out):
        _run(a, a_scale, w, w_scale, bias, out, activation, bool(gated), slope, bool(enable_pdl))
    else:
        _op(a, a_scale, w, w_scale, bias, out, activation, bool(gated), slope, bool(enable_pdl))
    return out
