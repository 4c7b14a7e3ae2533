"""attention(): softmax(q k^T * scale [+ causal mask]) v over the two attention kernels.

q [B, S_q, Hq, d], k/v [B, S_kv, Hkv, d] (Hq a multiple of Hkv), bf16 or fp16, d in {64, 128}; causal
aligned bottom-right; lse [B, Hq, S_q] fp32, natural log; a row that sees no key gets out 0, lse -inf.

The kernel follows from the query length: short queries (S_q <= attention_decode.MAX_SEQLEN_Q, decode
steps) take the split-KV kernel (rosekernels/kernels/attention_decode.py), since one CTA per 128 query
rows of the prefill kernel would leave most SMs idle; longer ones take the prefill kernel
(rosekernels/kernels/attention.py). Eager calls keep the launch of each argument signature in a plan
(checks and kernel choice once); traced calls go through the kernel's registered op
(rosekernels::attention_decode or rosekernels::attention_fwd).
"""
from __future__ import annotations

import torch

from rosekernels import launch
from rosekernels.kernels import attention as prefill
from rosekernels.kernels import attention_decode as decode
from rosekernels.kernels.attention_common import tma_view, validate

_plans = launch.PlanCache()


def _new_plan(q, k, v, out, causal: bool, softmax_scale, enable_pdl: bool) -> launch.Launch:
    """The slow path, once per argument signature: every check, then the kernel for the query length."""
    scale = validate(q, k, v, out, softmax_scale)
    if not q.numel():
        return launch.nothing(q.device.index)
    if q.shape[1] <= decode.MAX_SEQLEN_Q:
        return decode.plan(q, k, v, out, causal, scale, enable_pdl=enable_pdl)
    return prefill.plan(q, k, v, out, causal, scale)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None, out: torch.Tensor | None = None,
              return_lse: bool = False, enable_pdl: bool = True):
    """softmax(q k^T * softmax_scale [causal, bottom-right]) v; see the module docstring.

    Returns out [B, S_q, Hq, d], or (out, lse [B, Hq, S_q] fp32) with return_lse. Eager calls on
    plain tensors skip the torch dispatcher and reuse a launch plan cached per argument signature
    (the checks run once per signature; per call only the 16-byte alignment of the pointers);
    under torch.compile the kernel runs through its registered op. enable_pdl: the split-KV kernel
    launches with programmatic dependent launch (its set-up overlaps the previous kernel's end); the
    prefill kernel does not use it.
    """
    causal, enable_pdl = bool(causal), bool(enable_pdl)
    eager = launch.eager(q, k, v, out)
    if eager:
        # The plan's signature, written out: a generic builder (a loop over the arguments) costs ~1 us more.
        key = (q.shape, q.stride(), q.dtype, q.get_device(), k.shape, k.stride(), k.dtype, k.get_device(),
               v.shape, v.stride(), v.dtype, v.get_device(),
               None if out is None else (out.shape, out.stride(), out.dtype, out.get_device()), causal, softmax_scale,
               enable_pdl)
        plan = _plans.get(key)
        # A cached plan still needs 16-byte aligned pointers (if not, the full checks say which is not).
        if plan is None or (q.data_ptr() | k.data_ptr() | v.data_ptr()
                            | (0 if out is None else out.data_ptr())) % 16:
            plan = _plans.put(key, _new_plan(q, k, v, out, causal, softmax_scale, enable_pdl))
    else:
        scale = validate(q, k, v, out, softmax_scale, pointers=not torch.compiler.is_compiling())
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    if eager:
        plan.launch(q, k, v, out, lse)
    elif q.numel():
        views = [tma_view(t) for t in (q, k, v, out)]
        if q.shape[1] <= decode.MAX_SEQLEN_Q:
            torch.ops.rosekernels.attention_decode(*views, lse, causal, scale, enable_pdl)
        else:
            torch.ops.rosekernels.attention_fwd(*views, lse, causal, scale)
    return (out, lse) if return_lse else out
