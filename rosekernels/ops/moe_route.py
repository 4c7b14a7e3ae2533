"""moe_route(): the softmax of router logits and each token's top-k experts in one launch (the kernel:
rosekernels/kernels/moe_route.py).

validate -> config (the mode by T, or the tuned store's) -> compile -> plan -> launch: the first call
with an argument signature does all of it; later ones check the pointers (overlap) and launch.
"""
from __future__ import annotations

from typing import Any

import torch

from rosekernels import checks, launch, tuned
from rosekernels.kernels import moe_route as kernel
from rosekernels.kernels.moe_common import DTYPES, check_sm90, rows_view
from rosekernels.kernels.moe_route_plan import MAX_EXPERTS, MAX_TOPK, OP, RouteConfig, RouteShape, choose_mode


def moe_route(logits: torch.Tensor, topk: int, renormalize: bool = True, *, weight_dtype: torch.dtype | None = None,
              topk_weights: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
              enable_pdl: bool = True, mode: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k], topk_ids [T, k] int32) of router logits [T, E] (E <= 512, k <= min(E, 32)):
    the k experts of largest logit, largest first (the lower index first among equal logits), and their
    softmax probabilities (fp32 arithmetic), divided by the sum of the k chosen with `renormalize`
    (Qwen3-MoE's norm_topk_prob, Mixtral). The weights are fp32 unless `weight_dtype` is the logits' dtype;
    topk_weights / topk_ids, if given, are written instead (they must not overlap the logits or each other).
    A NaN logit counts as -inf. `enable_pdl`: launched with programmatic dependent launch (waits on the
    kernel before it, the router GEMM); `mode` forces "prefill" or "decode" (default: by T).

    Registered as torch.ops.rosekernels.moe_route (mutating the two outputs) for torch.compile and fake
    tensors; eager calls skip the torch dispatcher and reuse the launch plan validated for the same
    shapes, strides, dtypes and devices."""
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 2):
        raise ValueError("logits must be a 2-D tensor [tokens, experts]")
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"topk must be an int, got {type(topk).__name__}")
    _check_sizes(logits.shape[1], topk)  # before any output is allocated
    if topk_weights is None:
        dtype = weight_dtype or torch.float32
        if dtype not in (torch.float32, logits.dtype):
            raise ValueError(f"weight_dtype must be torch.float32 or the logits' {logits.dtype}, got {dtype}")
        topk_weights = logits.new_empty((logits.shape[0], topk), dtype=dtype)
    elif weight_dtype is not None and weight_dtype != topk_weights.dtype:
        raise ValueError(f"weight_dtype {weight_dtype} disagrees with the given topk_weights' {topk_weights.dtype}")
    if topk_ids is None:
        topk_ids = logits.new_empty((logits.shape[0], topk), dtype=torch.int32)
    if launch.eager(logits, topk_weights, topk_ids):
        _run(logits, topk_weights, topk_ids, topk, bool(renormalize), bool(enable_pdl), mode)
    else:
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[1] != topk:
            raise ValueError(f"topk_ids must be [tokens, {topk}], got {list(topk_ids.shape)}")
        torch.ops.rosekernels.moe_route(logits, topk_weights, topk_ids, bool(renormalize), bool(enable_pdl),
                                        mode or choose_mode(logits.shape[0]))
    return topk_weights, topk_ids


class _Plan(launch.Launch):
    """A routing validated for one signature; fn None: no tokens, nothing to launch. `canonical`: some
    tensor needs `rows_view`; `disjoint`: the outputs' overlap test."""

    def __init__(self, fn: Any, device: int, canonical: bool, disjoint: checks.Disjoint):
        super().__init__(fn, device)
        self.canonical = canonical
        self.disjoint = disjoint

    def launch(self, logits: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
        if self.canonical:
            logits, topk_weights, topk_ids = map(rows_view, (logits, topk_weights, topk_ids))
        launch.on_device(self.device, self.fn, logits, topk_weights, topk_ids)


_plans = launch.PlanCache()


def _run(logits: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, topk: int, renormalize: bool,
         enable_pdl: bool, mode: str | None) -> None:
    """Launch on plain tensors. Per call: the plan's key, the overlap check, the launch; the first call
    with a key validates everything and compiles or loads the kernel."""
    key = (logits.shape, logits.stride(), logits.dtype, logits.get_device(),
           topk_weights.shape, topk_weights.stride(), topk_weights.dtype, topk_weights.get_device(),
           topk_ids.shape, topk_ids.stride(), topk_ids.dtype, topk_ids.get_device(), topk, renormalize, enable_pdl,
           mode)
    plan = _plans.get(key) or _plans.put(key, _new_plan(logits, topk_weights, topk_ids, topk, renormalize,
                                                        enable_pdl, mode))
    if plan.fn is None:
        return
    if plan.disjoint.clash(logits, topk_weights, topk_ids):
        plan.disjoint.check(logits, topk_weights, topk_ids)  # raises, saying which
    plan.launch(logits, topk_weights, topk_ids)


def _new_plan(logits: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, topk: int,
              renormalize: bool, enable_pdl: bool, mode: str | None) -> _Plan:
    """The slow path, once per signature: every check, the config, the kernel compiled or loaded."""
    tensors = (logits, topk_weights, topk_ids)
    views = tuple(map(rows_view, tensors))
    cfg = validate(*views, topk, renormalize, enable_pdl, mode or choose_mode(logits.shape[0]))
    cfg = tuned.tuned_config(kernel, RouteShape.of(logits, topk, topk_weights.dtype, renormalize, enable_pdl), cfg)
    fn = kernel.compile(cfg).fn if logits.shape[0] else None
    return _Plan(fn, logits.device.index, any(v.stride() != t.stride() for v, t in zip(views, tensors)),
                 _disjoint(*tensors))


def _disjoint(logits: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> checks.Disjoint:
    """The outputs may share memory with neither the logits (read while other warps write) nor each other."""
    return checks.Disjoint(dict(logits=logits, topk_weights=topk_weights, topk_ids=topk_ids),
                           ("topk_weights", "topk_ids"), {})


def validate(logits: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, topk: int,
             renormalize: bool, enable_pdl: bool, mode: str, *, on_device: bool = True) -> RouteConfig:
    """Every argument check, shapes/types first, then device, then overlap; returns the config."""
    for name, t in (("logits", logits), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    checks.check_dtype("logits", logits, DTYPES)
    checks.check_dtype("topk_weights", topk_weights, (torch.float32, logits.dtype))
    checks.check_dtype("topk_ids", topk_ids, (torch.int32,))
    checks.check_shape("logits", logits, (None, None))
    tokens, experts = logits.shape
    _check_sizes(experts, topk)
    checks.check_shape("topk_weights", topk_weights, (tokens, topk))
    checks.check_shape("topk_ids", topk_ids, (tokens, topk))
    cfg = RouteConfig(checks.DTYPE_NAME[logits.dtype], checks.DTYPE_NAME[topk_weights.dtype], experts, topk,
                      renormalize, mode, pdl=enable_pdl)
    if tokens + checks.INDEX_SLACK >= 2**31:
        raise ValueError(f"{tokens} tokens exceed the kernel's 32-bit indexing")
    if on_device:
        for name, t in (("logits", logits), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
            checks.check_cuda(name, t)
        checks.check_same_device(logits=logits, topk_weights=topk_weights, topk_ids=topk_ids)
        check_sm90(logits.device)
        for name, t in (("logits", logits), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
            checks.check_unit_last_stride(name, t)
        _disjoint(logits, topk_weights, topk_ids).check(logits, topk_weights, topk_ids)
        checks.check_not_expanded("topk_weights", topk_weights)
        checks.check_not_expanded("topk_ids", topk_ids)
    return cfg


def _check_sizes(experts: int, topk: int) -> None:
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"logits must have 1 to {MAX_EXPERTS} experts (columns), got {experts}")
    if not 1 <= topk <= min(experts, MAX_TOPK):
        raise ValueError(f"topk must be in [1, {min(experts, MAX_TOPK)}] for {experts} experts, got {topk}")


def _impl(logits: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, renormalize: bool,
          enable_pdl: bool, variant_mode: str) -> None:
    # (not `mode`: torch's functionalization of mutating ops passes a `mode` keyword of its own)
    _run(logits, topk_weights, topk_ids, topk_ids.shape[1], renormalize, enable_pdl, variant_mode)


def _fake(logits, topk_weights, topk_ids, renormalize, enable_pdl, variant_mode):
    validate(logits, topk_weights, topk_ids, topk_ids.shape[1], renormalize, enable_pdl, variant_mode,
             on_device=False)


launch.register_op(OP, _impl, mutates_args=("topk_weights", "topk_ids"), fake=_fake)
