"""gemm() and gemm_leakyrelu(): act(a @ w^T + bias) and its gated (SwiGLU) form in one kernel (the
kernel: rosekernels/kernels/gemm_leakyrelu.py), and `gate_up_rows`, the weight layout a gated GEMM takes.

validate -> config (gemm_leakyrelu_plan.config_for, or the tuned store's) -> compile -> plan -> launch:
the first call with an argument signature does all of it; later ones check the pointers (alignment,
overlap), fetch the split-K workspace and launch. `run(a, b_nk, bias, out, config)` launches a given
config (tests, the benchmark's sweep, the tuner).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from rosekernels import checks, launch, modes, scratch, tuned
from rosekernels.kernels import gemm_leakyrelu as kernel
from rosekernels.kernels.gemm_leakyrelu_plan import (
    ACTIVATIONS, COUNTER_SLOTS, GATE_BLOCK, OP, GemmConfig, GemmShape, check_fits, config_for, partial_floats)


# ---------------------------------------------------------------------------------------------
# Launching.

def _row_stride_ok(t: torch.Tensor) -> torch.Tensor:
    """`t` with a 16-byte multiple row stride: a size-1 leading dim may carry any stride."""
    return t.as_strided(t.shape, (8 * math.ceil(t.shape[1] / 8), t.stride(1)))


class _Plan(launch.Launch):
    """One config launched on one argument signature (shapes, strides, dtypes, device): everything
    derived from the signature is computed once (out's overlap test among it); a launch only checks what
    depends on the data pointers (16-byte alignment, out overlapping an input), fetches the split-K
    workspace and launches."""

    def __init__(self, a, b_nk, bias, out, config: GemmConfig):
        m = a.shape[0]
        n = b_nk.shape[0]
        check_fits(config, m, n)
        super().__init__(kernel.compile(config).fn, a.device.index)
        self.split_k = config.split_k
        self.swap = config.swap_ab
        self.gated = config.gated  # for the shape checks after a failed launch
        self.partial_floats = partial_floats(config, m, n) if config.splits > 1 else 0
        # The arguments after the tensors: the launch policy, then the FP8 scales a bf16/fp16 launch leaves out.
        self.tail = (config.splits, config.raster_group,
                     modes.max_active_clusters(self.device, config.cluster_m * config.cluster_n), *kernel.NOT_FP8)
        self.fix_a = m == 1 and a.stride(0) % 8 != 0
        self.fix_out = m == 1 and out.stride(0) % 8 != 0
        self.disjoint = _disjoint(a, b_nk, bias, out)

    def launch(self, a, b_nk, bias, out, private_scratch: bool = False) -> None:
        if (a.data_ptr() | b_nk.data_ptr() | out.data_ptr()) % 16 or self.disjoint.clash(a, b_nk, bias, out):
            _check_memory(a, b_nk, bias, out)  # raises, saying which
        partials = counters = None
        if self.split_k:
            # Tile counters that the last split of each tile returns to zero (see rosekernels.scratch).
            counters = scratch.zeroed_int32(self.device, COUNTER_SLOTS, private_scratch)
            if self.partial_floats:
                partials = torch.empty(self.partial_floats, dtype=torch.float32, device=a.device)
            else:
                partials = scratch.unread_float32(self.device)
        a = _row_stride_ok(a) if self.fix_a else a
        try:
            if self.swap:
                launch.on_device(self.device, self.fn, b_nk, a, out.t(), bias, partials, counters, *self.tail)
            else:
                launch.on_device(self.device, self.fn, a, b_nk, _row_stride_ok(out) if self.fix_out else out, bias,
                                 partials, counters, *self.tail)
        except Exception:
            # The compiled host code checks its arguments and raises before launching; the full
            # checks say what is wrong in this op's terms.
            _check_shapes(a, b_nk, bias, out, self.gated)
            _check_memory(a, b_nk, bias, out)
            raise


class _NoProduct:
    """The plan of a problem without K tiles or without outputs: out = act(bias) for K = 0 (no K
    tiles for TMA to describe), nothing to write for M = 0 or N = 0."""

    def __init__(self, activation: str, gated: bool, negative_slope: float):
        self.epilogue = (activation, gated, negative_slope)

    def launch(self, a, b_nk, bias, out, private_scratch: bool = False) -> None:
        if out.numel() == 0:
            return
        _check_memory(a, b_nk, bias, out)
        n = b_nk.shape[0]
        y = bias.float() if bias is not None else out.new_zeros(n, dtype=torch.float32)
        out.copy_(kernel.epilogue_reference(y, *self.epilogue).expand(out.shape))


def run(a: torch.Tensor, b_nk: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
        config: GemmConfig) -> None:
    """Launch `config` (its tile shape, K splits and raster group) on arguments that gemm_leakyrelu
    accepts (b_nk: b seen as [N, K]; M, N, K > 0), whatever config_for would pick: for tests, the
    benchmark's sweep and the tuner. Plans anew on every call."""
    _Plan(a, b_nk, bias, out, config).launch(a, b_nk, bias, out)


# ---------------------------------------------------------------------------------------------
# Argument checks (the slow path: first call per signature, and after any launch failure).

def _check_shapes(a, b_nk, bias, out, gated: bool = False) -> None:
    """Dtypes and shapes (also checked on fake tensors, when torch.compile traces the op)."""
    checks.check_dtype("a", a, (torch.bfloat16, torch.float16))
    if b_nk.dtype != a.dtype:
        raise TypeError(f"b has dtype {b_nk.dtype}, a has {a.dtype}: they must match")
    if a.dim() != 2 or b_nk.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got shapes {list(a.shape)} and {list(b_nk.shape)}")
    m, k = a.shape
    n = b_nk.shape[0]
    if b_nk.shape[1] != k:
        raise ValueError(f"a is [M, K] = {list(a.shape)} but b gives K = {b_nk.shape[1]}")
    if n % 8 or k % 8:
        raise ValueError(f"N and K must be multiples of 8 (16-byte rows for TMA), got N={n}, K={k}")
    if gated and n % (2 * GATE_BLOCK):
        raise ValueError(f"a gated GEMM takes gate and up rows in blocks of {GATE_BLOCK}: N must be a multiple "
                         f"of {2 * GATE_BLOCK}, got {n}")
    if bias is not None:
        checks.check_dtype("bias", bias, (a.dtype, torch.float32))
        checks.check_shape("bias", bias, (n,))
        if n > 1 and bias.stride(0) != 1:
            raise ValueError("bias must be contiguous")
    checks.check_dtype("out", out, (a.dtype,))
    checks.check_shape("out", out, (m, n // 2 if gated else n))


def _check_memory(a, b_nk, bias, out) -> None:
    """Strides, alignment, aliasing and the device (last, so that every other error shows on CPU
    tensors too)."""
    for name, t in (("a", a), ("out", out)):
        if t.numel():
            checks.check_unit_last_stride(name, t)
            if t.shape[0] > 1:
                checks.check_aligned(name, t)
            elif t.data_ptr() % 16:
                raise ValueError(f"{name} must be 16-byte aligned")
    if b_nk.numel():
        if b_nk.stride(1) != 1 and b_nk.stride(0) != 1:
            raise ValueError(f"b must be contiguous along N or K, got strides {b_nk.stride()}")
        checks.check_aligned("b", b_nk if b_nk.stride(1) == 1 else b_nk.t())
    _disjoint(a, b_nk, bias, out).check(a, b_nk, bias, out)
    checks.check_not_expanded("out", out)
    checks.check_same_device(a=a, b=b_nk, bias=bias, out=out)
    checks.check_cuda("a", a)


def _disjoint(a, b_nk, bias, out) -> checks.Disjoint:
    """out may share memory with no input (other CTAs still read them while one writes out)."""
    return checks.Disjoint(dict(a=a, b=b_nk, bias=bias, out=out), ("out",), {})


def _b_as_nk(b: torch.Tensor, b_layout: str) -> torch.Tensor:
    if b_layout not in ("nk", "kn"):
        raise ValueError(f"b_layout must be 'nk' (b is [N, K]) or 'kn' (b is [K, N]), got {b_layout!r}")
    if not isinstance(b, torch.Tensor) or b.dim() != 2:
        raise ValueError("b must be a 2-D tensor")
    return b if b_layout == "nk" else b.t()


# ---------------------------------------------------------------------------------------------
# The ops.

_plans = launch.PlanCache()


def _new_plan(a, b_nk, bias, out, activation: str, gated: bool, negative_slope: float, enable_pdl: bool):
    """Slow path, once per argument signature: every check, the heuristic, the compile."""
    _check_shapes(a, b_nk, bias, out, gated)
    _check_memory(a, b_nk, bias, out)
    if 0 in (*a.shape, b_nk.shape[0]):
        return _NoProduct(activation, gated, negative_slope)
    shape = GemmShape.of(a, b_nk, bias, activation, gated, negative_slope, enable_pdl)
    sms = modes.sm_count(a.device.index)
    return _Plan(a, b_nk, bias, out, tuned.tuned_config(kernel, shape, config_for(shape, sms), sms))


def _run(a, b_nk, bias, out, activation: str, gated: bool, negative_slope: float, enable_pdl: bool = True,
         private_scratch: bool = False) -> None:
    # The plan's signature, written out: a generic builder (a loop over the arguments) costs ~1 us more.
    key = (a.shape, a.stride(), b_nk.shape, b_nk.stride(), out.shape, out.stride(), a.dtype, b_nk.dtype,
           out.dtype, a.get_device(), b_nk.get_device(), out.get_device(), activation, gated, negative_slope,
           enable_pdl, None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.get_device()))
    plan = _plans.get(key) or _plans.put(key, _new_plan(a, b_nk, bias, out, activation, gated, negative_slope,
                                                        enable_pdl))
    plan.launch(a, b_nk, bias, out, private_scratch)


def _leaky_impl(a: torch.Tensor, b_nk: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
                negative_slope: float, enable_pdl: bool = True) -> None:
    # private_scratch: rosekernels.scratch
    _run(a, b_nk, bias, out, "leaky_relu", False, negative_slope, enable_pdl, private_scratch=True)


def _leaky_fake(a, b_nk, bias, out, negative_slope, enable_pdl=True) -> None:
    _check_shapes(a, b_nk, bias, out)


def _gemm_impl(a: torch.Tensor, b_nk: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
               activation: str, gated: bool, negative_slope: float, enable_pdl: bool = True) -> None:
    _run(a, b_nk, bias, out, activation, gated, negative_slope, enable_pdl, private_scratch=True)


def _gemm_fake(a, b_nk, bias, out, activation, gated, negative_slope, enable_pdl=True) -> None:
    _check_shapes(a, b_nk, bias, out, gated)


_leaky_op = launch.register_op(OP, _leaky_impl, mutates_args=("out",), fake=_leaky_fake)
_gemm_op = launch.register_op("gemm", _gemm_impl, mutates_args=("out",), fake=_gemm_fake)


def _launch(a, b, bias, out, b_layout: str, activation: str, gated: bool, negative_slope: float,
            enable_pdl: bool) -> torch.Tensor:
    b_nk = _b_as_nk(b, b_layout)
    if out is None:
        if not isinstance(a, torch.Tensor) or a.dim() != 2:
            raise ValueError("a must be a 2-D tensor")
        n = b_nk.shape[0]
        out = torch.empty((a.shape[0], n // 2 if gated else n), dtype=a.dtype, device=a.device)
    if launch.eager(a, b_nk, bias, out):
        _run(a, b_nk, bias, out, activation, gated, negative_slope, enable_pdl)
    elif activation == "leaky_relu" and not gated:
        _leaky_op(a, b_nk, bias, out, negative_slope, enable_pdl)
    else:
        _gemm_op(a, b_nk, bias, out, activation, gated, negative_slope, enable_pdl)
    return out


def gemm(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
         gated: bool = False, negative_slope: float = 0.01, out: Optional[torch.Tensor] = None,
         b_layout: str = "nk", enable_pdl: bool = True) -> torch.Tensor:
    """act(a @ w^T + bias) with activation None, "relu", "leaky_relu" (negative_slope), "silu" or
    "gelu_tanh" (GELU, tanh approximation), in one kernel (prefill and decode variants, as
    gemm_leakyrelu).

    gated=True: out = act(a @ w_gate^T + b_gate) * (a @ w_up^T + b_up) (SwiGLU with "silu"), one kernel,
    out [M, N / 2]; w [N, K] holds the gate and up rows interleaved in blocks of 8 (w[16 i + j] is gate
    row 8 i + j, w[16 i + 8 + j] up row 8 i + j): `gate_up_rows(w_gate, w_up)` builds it, the bias
    likewise. N a multiple of 16.

    a: [M, K] bf16/fp16, unit stride along K; w: same dtype, contiguous along K or N (b_layout="kn":
    w is [K, N]); bias: [N] in a's dtype or fp32. enable_pdl: launch with programmatic dependent
    launch (set-up overlaps the previous kernel; the next one may launch during the epilogue).
    Registered as torch.ops.rosekernels.gemm (mutating `out`) for torch.compile; eager calls skip the
    dispatcher.
    """
    activation = "none" if activation is None else activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS[1:]}, got {activation!r}")
    return _launch(a, w, bias, out, b_layout, activation, bool(gated),
                   float(negative_slope) if activation == "leaky_relu" else 0.01, bool(enable_pdl))


def gemm_leakyrelu(a: torch.Tensor, b: torch.Tensor, negative_slope: float = 0.01,
                   bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                   b_layout: str = "nk", enable_pdl: bool = True) -> torch.Tensor:
    """leaky_relu(a @ b^T + bias) for b_layout="nk" (b: [N, K], the weight layout of nn.Linear),
    leaky_relu(a @ b + bias) for b_layout="kn" (b: [K, N]): gemm(..., activation="leaky_relu").

    a: [M, K] bf16/fp16, unit stride along K; b: same dtype, contiguous along K or along N (a
    transposed view works: b_layout only says which dim is N); bias: [N] in a's dtype or fp32;
    out: [M, N] in a's dtype (allocated when None). Any M; N and K multiples of 8; rows 16-byte
    aligned. fp32 accumulation; the slope is compiled into the kernel (one variant per value).
    Registered as torch.ops.rosekernels.gemm_leakyrelu (mutating `out`) for torch.compile and fake
    tensors; eager calls skip the dispatcher (tens of microseconds), no autograd either way.
    """
    return _launch(a, b, bias, out, b_layout, "leaky_relu", False, float(negative_slope), bool(enable_pdl))


def gate_up_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The weight of a gated `gemm` from the gate and up projections' weights (each [N, K], as
    nn.Linear stores them; N a multiple of 8): their rows interleaved in blocks of GATE_BLOCK
    ([2N, K]), so that gemm(a, gate_up_rows(g, u), activation="silu", gated=True) is
    silu(a @ g^T) * (a @ u^T). A bias of the gated GEMM is interleaved the same way
    (gate_up_rows(bias_g[:, None], bias_u[:, None])[:, 0])."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.shape[0] % GATE_BLOCK:
        raise ValueError(f"gate and up must be [N, K] alike with N a multiple of {GATE_BLOCK}, got "
                         f"{list(gate.shape)} and {list(up.shape)}")
    k = gate.shape[1]
    return torch.stack([gate.reshape(-1, GATE_BLOCK, k), up.reshape(-1, GATE_BLOCK, k)], 1).reshape(-1, k)
