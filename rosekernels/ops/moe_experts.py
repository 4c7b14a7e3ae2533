"""moe_experts(): a routed-experts block (SwiGLU experts, top-k routing) on one GPU, [T, H] -> [T, H], in
four launches: moe_dispatch (the tokens grouped by expert, no padding rows), the gate-up grouped GEMM with
SwiGLU, the down grouped GEMM, moe_combine (each token's k rows summed with its routing weights).

Why four: the grouping needs every token's routing first (a count per expert, then a prefix sum), so the
gate-up GEMM cannot start before a pass over the ids has ended; the combine sums rows that different
CTAs of the down GEMM produce, so fusing it into that GEMM means atomics (run-to-run nondeterministic
sums) or a grid-wide wait. The routing weights are applied in the combine, where each token's rows
meet in fp32 anyway (grouped_gemm's row_scale would multiply them one rounding earlier and leave the
combine an unweighted sum: the same launches, a [T, k] tensor of ones more). Every step reads its
sizes on the device: no host sync, CUDA graphs capture the call and replay it with new routings.

Why the dispatch copy, not grouped_gemm's gather (a_index): the dispatch runs anyway (the grouping's
offsets and the combine's slot map come out of it), and its copy of the rows (T x k rows of H, written
once, read once by the gate-up GEMM) lets that GEMM load them by TMA, as the down GEMM loads its rows,
where the gather moves them by 16-byte cp.async from the producer warpgroup's threads, on one CTA
without the cluster's multicast. Measured (H100, Qwen3-30B-A3B and Qwen3-235B-A22B at T = 4096 and
16384): the gathered gate-up GEMM alone takes 1.30-1.86x the dispatch and the gate-up GEMM together
(bench/results/moe/sweeps/moe_experts_prefill_gather_ab_h100.md). The weights in the combine stand
until a measurement of row_scale says otherwise.
"""
from __future__ import annotations

from typing import Optional

import torch

from rosekernels import checks, launch
from rosekernels.kernels.gemm_leakyrelu_plan import ACTIVATIONS
from rosekernels.kernels.grouped_gemm_plan import check_sizes
from rosekernels.kernels.moe_common import check_sm90, rows_view
from rosekernels.ops.grouped_gemm import grouped_gemm
from rosekernels.ops.moe_combine import moe_combine
from rosekernels.ops.moe_dispatch import moe_dispatch

_DTYPES = (torch.bfloat16, torch.float16)


def validate(x, w_gate_up, w_down, topk_ids, topk_weights, out, activation: str = "silu", *,
             on_device: bool = True) -> None:
    """Every check of a moe_experts call, before anything runs: types, dtypes, the sizes the weights
    and the routing must agree on (E, H, I, k), strides, then the device."""
    named = {"x": x, "w_gate_up": w_gate_up, "w_down": w_down, "topk_ids": topk_ids, "topk_weights": topk_weights}
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    checks.check_dtype("x", x, _DTYPES)
    for name in ("w_gate_up", "w_down") + (("out",) if out is not None else ()):
        checks.check_dtype(name, named[name], (x.dtype,))
    checks.check_dtype("topk_ids", topk_ids, (torch.int32,))
    checks.check_dtype("topk_weights", topk_weights, (torch.float32, x.dtype))
    checks.check_shape("x", x, (None, None))
    checks.check_shape("w_gate_up", w_gate_up, (None, None, None))
    checks.check_shape("w_down", w_down, (None, None, None))
    tokens, hidden = x.shape
    experts, two_i, h_gate_up = w_gate_up.shape
    if w_down.shape[0] != experts:
        raise ValueError(f"w_gate_up has {experts} experts, w_down {w_down.shape[0]}")
    if h_gate_up != hidden or w_down.shape[1] != hidden:
        raise ValueError(f"x's hidden size is {hidden}; w_gate_up is [E, 2I, H] = {list(w_gate_up.shape)} and "
                         f"w_down [E, H, I] = {list(w_down.shape)}")
    if two_i % 2 or w_down.shape[2] != two_i // 2:
        raise ValueError(f"w_gate_up holds the gate and up rows ([E, 2I, H] = {list(w_gate_up.shape)}), so w_down "
                         f"must be [E, H, {two_i // 2}]; got {list(w_down.shape)}")
    if not hidden or not two_i:
        raise ValueError(f"x is [T, H] = {list(x.shape)} and w_down [E, H, I] = {list(w_down.shape)}: H and I "
                         "must be positive")
    checks.check_shape("topk_ids", topk_ids, (tokens, None))
    checks.check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    if topk_ids.shape[1] < 1:
        raise ValueError("topk_ids must route each token to at least one expert (k >= 1)")
    if out is not None:
        checks.check_shape("out", out, (tokens, hidden))
    rows = tokens * topk_ids.shape[1]
    check_sizes(rows, experts, two_i, hidden, True)
    check_sizes(rows, experts, hidden, two_i // 2, False)
    for name, t in named.items():
        checks.check_unit_last_stride(name, t)
    for name in ("x", "w_gate_up", "w_down") + (("out",) if out is not None else ()):
        # rows_view: the ops take any stride on a size-1 dim
        checks.check_aligned(name, rows_view(named[name]), pointer=on_device)
    if out is not None:
        checks.check_not_expanded("out", out)
        if on_device:
            _disjoint(topk_ids, topk_weights, out).check(topk_ids, topk_weights, out)
    if on_device:
        for name, t in named.items():
            checks.check_cuda(name, t)
        checks.check_same_device(**named)
        check_sm90(x.device)


def _disjoint(topk_ids, topk_weights, out) -> checks.Disjoint:
    """out may share memory with neither routing tensor, which moe_combine reads while it writes out (x it may:
    the dispatch read it before)."""
    return checks.Disjoint(dict(topk_ids=topk_ids, topk_weights=topk_weights, out=out), ("out",), {})


# Argument signatures validated once, each with out's overlap test: what depends on the pointers is checked on
# every call (the ops' own plans check theirs, an out given here is checked before anything runs).
_checked = launch.PlanCache()


def moe_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, *, out: Optional[torch.Tensor] = None, activation: str = "silu",
                check: bool = False, enable_pdl: bool = True) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * w_down[e] @ (act(w_gate[e] @ x[t]) * (w_up[e] @ x[t])),
    e = topk_ids[t, j], for x [T, H] (bf16/fp16): transformers' routed experts (Qwen3-MoE, Mixtral,
    DeepSeek's routed part) in four launches (see the module docstring).

    w_gate_up: [E, 2I, H], expert e's gate rows then its up rows (transformers' gate_up_proj, as
    stored: no conversion); w_down: [E, H, I] (down_proj); both in x's dtype, contiguous along the
    last dim. topk_ids: [T, k] int32, -1 = not routed (that choice adds nothing); topk_weights:
    [T, k] fp32 or x's dtype. activation: the gate's ("silu": SwiGLU). E <= 512.

    Ids outside [-1, E) make moe_dispatch refuse the whole routing on the device (no host sync): out
    is then all zeros; check=True raises instead, after the dispatch and before anything else runs
    (out untouched; it synchronises: not inside CUDA graphs). out:
    [T, H] in x's dtype (allocated when None; it may be x itself, read before out is written).
    """
    key = (x.shape, x.stride(), x.dtype, x.device, w_gate_up.shape, w_gate_up.stride(), w_gate_up.dtype,
           w_gate_up.device, w_down.shape, w_down.stride(), w_down.dtype, w_down.device, topk_ids.shape,
           topk_ids.stride(), topk_ids.dtype, topk_ids.device, topk_weights.shape, topk_weights.stride(),
           topk_weights.dtype, topk_weights.device,
           None if out is None else (out.shape, out.stride(), out.dtype, out.device), activation)
    eager = launch.eager(x, w_gate_up, w_down, topk_ids, topk_weights, out)
    disjoint = _checked.get(key) if eager else None
    if disjoint is None:
        validate(x, w_gate_up, w_down, topk_ids, topk_weights, out, activation, on_device=eager)
        if eager:
            _checked.put(key, _disjoint(topk_ids, topk_weights, out))
    elif out is not None and (out.data_ptr() % 16 or disjoint.clash(topk_ids, topk_weights, out)):
        validate(x, w_gate_up, w_down, topk_ids, topk_weights, out, activation)  # raises, saying which
    if out is None:
        out = x.new_empty(x.shape)
    if x.shape[0] == 0:
        return out
    # check: the dispatch raises before returning, so nothing after it runs on a refused routing.
    d = moe_dispatch(x, topk_ids, w_gate_up.shape[0], block_size=1, check=check)
    h = grouped_gemm(d.buffer, w_gate_up, d.offsets, activation=activation, gated=True, enable_pdl=enable_pdl)
    y = grouped_gemm(h, w_down, d.offsets, enable_pdl=enable_pdl)
    moe_combine(y, topk_weights, d.slot_map, out=out)
    return out
