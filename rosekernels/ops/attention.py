"""attention(): softmax(q k^T * scale [+ causal mask]) v over the two attention kernels.

q [B, S_q, Hq, d], k/v [B, S_kv, Hkv, d] (Hq a multiple of Hkv), bf16 or fp16, d in {64, 128}; causal
aligned bottom-right; lse [B, Hq, S_q] fp32, natural log; a row that sees no key gets out 0, lse -inf.

The kernel follows from the query length: short queries (S_q <= attention_decode.MAX_SEQLEN_Q, decode
steps) take the split-KV kernel (rosekernels/kernels/attention_decode.py), since one CTA per 128 query
rows of the prefill kernel would leave most SMs idle; longer ones take the prefill kernel
(rosekernels/kernels/attention.py). Eager calls keep the launch of each argument signature in a plan
(checks and kernel choice once); traced calls go through the kernel's registered op
(rosekernels::attention_decode or rosekernels::attention_fwd). A batch that one launch cannot take
(operands spanning 2^31 elements or more, or more than 65535 entries) runs in slices of the batch.
"""
from __future__ import annotations

import torch

from rosekernels import launch
from rosekernels.kernels import attention as prefill
from rosekernels.kernels import attention_decode as decode
from rosekernels.kernels.attention_common import batch_per_launch, tma_view, validate

_plans = launch.PlanCache()


def _new_plan(q, k, v, out, causal: bool, softmax_scale, enable_pdl: bool) -> launch.Launch:
    """The slow path, once per argument signature: every check, then the kernel for the query length,
    one launch per slice of the batch where a single launch would exceed the kernels' reach."""
    scale = validate(q, k, v, out, softmax_scale, sliced=True)
    if not q.numel():
        return launch.nothing(q.device.index)
    out_like = torch.empty(q.shape, device="meta") if out is None else out  # the op allocates out contiguous
    slices = _slices(q.shape[0], batch_per_launch(q, k, v, out_like))
    if len(slices) > 1:
        return _Sliced(slices, q, k, v, out, causal, scale, enable_pdl)
    return _plan(q, k, v, out, causal, scale, enable_pdl)


def _slices(batch, per: int) -> list[tuple]:
    """(first entry, entries) of each launch: one launch while it takes the whole batch (a traced batch
    size stays symbolic), else slices of `per` entries."""
    if per >= batch:
        return [(0, batch)]
    return [(b, min(per, batch - b)) for b in range(0, batch, per)]


def _plan(q, k, v, out, causal: bool, scale: float, enable_pdl: bool) -> launch.Launch:
    if q.shape[1] <= decode.MAX_SEQLEN_Q:
        return decode.plan(q, k, v, out, causal, scale, enable_pdl=enable_pdl)
    return prefill.plan(q, k, v, out, causal, scale)


class _Sliced:
    """A batch too large for one launch (attention_common.batch_per_launch): the launches of its
    slices, in order."""

    def __init__(self, slices, q, k, v, out, causal: bool, scale: float, enable_pdl: bool):
        cut = lambda t, b, n: None if t is None else t.narrow(0, b, n)  # noqa: E731
        self.parts = [(b, n, _plan(cut(q, b, n), cut(k, b, n), cut(v, b, n), cut(out, b, n), causal, scale,
                                   enable_pdl)) for b, n in slices]

    def launch(self, q, k, v, out, lse) -> None:
        for b, n, part in self.parts:
            part.launch(*(t.narrow(0, b, n) for t in (q, k, v, out, lse)))


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
        scale = validate(q, k, v, out, softmax_scale, pointers=not torch.compiler.is_compiling(), sliced=True)
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    if eager:
        plan.launch(q, k, v, out, lse)
    elif q.numel():
        for b, n in _slices(q.shape[0], batch_per_launch(q, k, v, out)):
            views = [tma_view(t if n == q.shape[0] else t.narrow(0, b, n)) for t in (q, k, v, out)]
            part = lse if n == q.shape[0] else lse.narrow(0, b, n)
            if q.shape[1] <= decode.MAX_SEQLEN_Q:
                torch.ops.rosekernels.attention_decode(*views, part, causal, scale, enable_pdl)
            else:
                torch.ops.rosekernels.attention_fwd(*views, part, causal, scale)
    return (out, lse) if return_lse else out
