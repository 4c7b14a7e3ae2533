"""attention_varlen(): prefill attention over packed sequences of different lengths, without padding
(how engines batch requests).

q [total_q, Hq, d], k/v [total_k, Hkv, d] (Hq a multiple of Hkv), bf16 or fp16, d in {64, 128};
cu_seqlens_q, cu_seqlens_k [B + 1] int32 on the device, cumulative: sequence b is rows
cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q and cu_seqlens_k[b] .. cu_seqlens_k[b + 1] of k and v.
max_seqlen_q, max_seqlen_k (host ints): the longest query and key lengths (the grid has
ceil(max_seqlen_q / tile) query tiles per sequence and head). Causal is aligned bottom-right per
sequence (query i of a sequence sees keys j <= i + S_kv - S_q). out [total_q, Hq, d]; lse [Hq, total_q]
fp32, natural log (FlashAttention's varlen layout); a row that sees no key (S_kv = 0, or causal rows
before the first key) gets out 0 and lse -inf. Rows outside every sequence reach no result, and
their rows of out and lse are not written. out may be q but must not overlap k or v.

Nothing syncs: the lengths are read on the device (graph-capturable); shapes, dtypes, devices and
layouts are checked on the host once per argument signature. What the kernel does with bad device data:
each cumulative length is clamped into [0, tokens] and each sequence's end to at least its start, so no
load or store leaves the tensors; where they decrease (cu_seqlens_q [0, 30, 10, 40]), the sequence at
the drop is empty and the next starts lower, over rows of earlier ones (10-29), which two CTAs then
write: the results of sequences that overlap are unspecified. Query rows of a sequence past
max_seqlen_q are not computed (their out and lse are left as they were). check=True reads the
lengths first (a sync) and raises instead.
The lengths must not change while the kernel runs (written from another stream, say): its loading
warp and its math warps read them apart, and a disagreement stalls the kernel. Rows of k and v past
cu_seqlens_k[-1] must be finite: a sequence's last key tile reaches into them (with zero weight,
but 0 * NaN is NaN), as the next sequence's rows, which are real tokens.

The kernel is the prefill kernel (rosekernels/kernels/attention.py) with `varlen` compiled in; its
variants are not in a model's warm-up set: pass rosekernels.kernels.attention.varlen_variants_for(...)
to rosekernels.warmup(specs=...) to compile them ahead of the first call.
"""
from __future__ import annotations

import torch

from rosekernels import checks, launch, modes, scratch
from rosekernels.kernels import attention as prefill
from rosekernels.kernels.attention_common import (
    LOG2_E, MAX_INDEX, TORCH_DTYPES, OutApart, check_operand, check_out, scale_of, tma_view)
from rosekernels.kernels.attention_plan import HEAD_DIMS, AttentionConfig, grid_size, varlen_config

_plans = launch.PlanCache()


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, softmax_scale,
                    pointers: bool = True) -> tuple[float, int, int]:
    """Check every argument of attention_varlen before any launch, without reading device data;
    return the softmax scale and max_seqlen_q / max_seqlen_k bounded by the tokens (no sequence is
    longer: the kernel clamps each to them, and a looser bound would only add idle tiles or overflow
    the 32-bit tile count). pointers=False (traced calls) checks the strides' alignment only."""
    named = (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
             ("out", out))
    for name, t in named:
        if t is None and name == "out":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t is not None and t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [tokens, heads, head_dim] (packed sequences), got shape "
                             f"{list(t.shape)}")
    checks.check_dtype("q", q, TORCH_DTYPES)
    for name, t in (("k", k), ("v", v), ("out", out)):
        if t is not None:
            checks.check_dtype(name, t, (q.dtype,))
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        checks.check_dtype(name, t, (torch.int32,))
        if t.dim() != 1 or t.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D [batch + 1] (cumulative lengths from 0), got shape {list(t.shape)}")
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    total_q, Hq, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be 64 or 128, got {d}")
    checks.check_shape("k", k, (None, None, d))
    checks.check_shape("v", v, tuple(k.shape))
    if out is not None:
        checks.check_shape("out", out, tuple(q.shape))
    Hkv = k.shape[1]
    if k.shape[0] == 0 and q.numel():
        raise ValueError("k and v must hold at least one key")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the KV heads ({Hkv})")
    for name, n, total in (("max_seqlen_q", max_seqlen_q, total_q), ("max_seqlen_k", max_seqlen_k, k.shape[0])):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
        if total and not n:
            raise ValueError(f"{name} is 0 but there are {total} tokens: it must be the longest sequence's length")
    max_seqlen_q, max_seqlen_k = min(max_seqlen_q, total_q), min(max_seqlen_k, k.shape[0])
    batch = cu_seqlens_q.shape[0] - 1
    tiles = batch * Hq * -(-max_seqlen_q // 128)
    if max(total_q, k.shape[0], tiles) + checks.INDEX_SLACK >= MAX_INDEX:
        raise ValueError("the kernel counts tokens and tiles with 32 bits: too many tokens or query tiles")
    scale = scale_of(d, softmax_scale)
    for name, t in named:
        if t is not None:
            check_operand(name, t, pointers, vectors=t.dtype != torch.int32)
    check_out(out, q, k, v, pointers)
    checks.check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, out=out)
    return scale, max_seqlen_q, max_seqlen_k


def check_lengths(cu_seqlens: torch.Tensor, tokens: int, max_seqlen: int, name: str) -> None:
    """Raise ValueError unless cu_seqlens starts at 0, never decreases, ends at most at `tokens` and
    no sequence is longer than `max_seqlen`. Reads the device tensor: a sync (check=True)."""
    cu = cu_seqlens.cpu().long()
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}")
    if (lengths < 0).any():
        b = int((lengths < 0).nonzero()[0])
        raise ValueError(f"{name} decreases at {b + 1}: {int(cu[b])} then {int(cu[b + 1])}")
    if int(cu[-1]) > tokens:
        raise ValueError(f"{name}[-1] = {int(cu[-1])} is past the {tokens} packed tokens")
    if int(lengths.max()) > max_seqlen:
        b = int(lengths.argmax())
        raise ValueError(f"sequence {b} is {int(lengths[b])} long by {name}, more than max_seqlen "
                         f"{'q' if name.endswith('q') else 'k'} = {max_seqlen}")


# ---------------------------------------------------------------------------------------------
# The launch: the prefill kernel's varlen variants.


class VarlenLaunch(launch.Launch):
    """One varlen launch planned for an argument signature and its max_seqlen_q / max_seqlen_k: the
    grid covers max_seqlen_q's query tiles for every sequence and head (those past a sequence's
    queries idle)."""

    def __init__(self, cfg: AttentionConfig, q: torch.Tensor, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                 scale: float):
        super().__init__(prefill.compile(cfg).fn, q.device.index)
        self.num_ctas = grid_size(cfg, batch, max_seqlen_q, q.shape[1], modes.sm_count(q.device.index))
        self.scalars = (max_seqlen_q, max_seqlen_k)
        self.scale_log2 = scale * LOG2_E

    def launch(self, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, private_scratch: bool = False) -> None:
        """q/k/v/out [total, H, d], lse [Hq, total_q]: the kernel sees them as one batch."""
        q, k, v, out = (tma_view(t.unsqueeze(0)) for t in (q, k, v, out))
        launch.on_device(self.device, self.fn, q, k, v, out, lse.unsqueeze(0), self.scale_log2,
                         scratch.zeroed_int32(self.device, 1, private_scratch), self.num_ctas, cu_seqlens_q,
                         cu_seqlens_k, *self.scalars)


def _attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                          max_seqlen_k: int, causal: bool, softmax_scale: float) -> None:
    """The registered op (torch.compile): validated arguments; a tile counter of its own per call
    (CUDA-graph trees keep no tensor across calls)."""
    cfg = varlen_config(q.shape[-1], TORCH_DTYPES[q.dtype], causal, max_seqlen_k)
    VarlenLaunch(cfg, q, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, softmax_scale).launch(
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, private_scratch=True)


launch.register_op("attention_varlen_fwd", _attention_varlen_fwd, mutates_args=("out", "lse"))


def _new_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, causal: bool,
              softmax_scale) -> launch.Launch:
    """The slow path, once per argument signature: every check, then the kernel's plan."""
    scale, max_q, max_k = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out,
                                          softmax_scale)
    if not q.numel():
        return launch.nothing(q.device.index)
    cfg = varlen_config(q.shape[-1], TORCH_DTYPES[q.dtype], causal, max_k)
    plan = VarlenLaunch(cfg, q, cu_seqlens_q.shape[0] - 1, max_q, max_k, scale)
    return plan if out is None else OutApart(plan, out, q, k, v)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                     softmax_scale: float | None = None, out: torch.Tensor | None = None,
                     return_lse: bool = False, check: bool = False):
    """softmax(q k^T * softmax_scale [causal, bottom-right per sequence]) v for each packed sequence;
    see the module docstring for the layouts.

    Returns out [total_q, Hq, d], or (out, lse [Hq, total_q] fp32) with return_lse. Nothing syncs:
    check=True reads cu_seqlens_q/k first and raises unless they start at 0, never decrease, stay
    within the tokens and no sequence is longer than its max_seqlen (a sync per call: debugging).
    Eager calls on plain tensors skip the torch dispatcher and reuse a launch plan per argument
    signature; under torch.compile the kernel runs through the op rosekernels::attention_varlen_fwd.
    """
    causal = bool(causal)
    eager = launch.eager(q, k, v, cu_seqlens_q, cu_seqlens_k, out)
    if eager:
        # The plan's signature, written out: a generic builder (a loop over the arguments) costs ~1 us more.
        key = (q.shape, q.stride(), q.dtype, q.get_device(), k.shape, k.stride(), k.dtype, k.get_device(),
               v.shape, v.stride(), v.dtype, v.get_device(), cu_seqlens_q.shape, cu_seqlens_q.stride(),
               cu_seqlens_q.dtype, cu_seqlens_q.get_device(), cu_seqlens_k.shape, cu_seqlens_k.stride(),
               cu_seqlens_k.dtype, cu_seqlens_k.get_device(),
               None if out is None else (out.shape, out.stride(), out.dtype, out.get_device()), max_seqlen_q,
               max_seqlen_k, causal, softmax_scale)
        plan = _plans.get(key)
        # A cached plan still needs 16-byte aligned pointers (if not, the full checks say which is not).
        if plan is None or (q.data_ptr() | k.data_ptr() | v.data_ptr() | (0 if out is None else out.data_ptr())) % 16:
            plan = _plans.put(key, _new_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out,
                                             causal, softmax_scale))
    else:
        scale, max_q, max_k = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              out, softmax_scale, pointers=False)
    if check:
        if not eager:
            raise ValueError("check=True reads cu_seqlens_q/k on the host: eager calls only")
        check_lengths(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
        check_lengths(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[1], q.shape[0], device=q.device, dtype=torch.float32)
    if eager:
        plan.launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    elif q.numel():
        torch.ops.rosekernels.attention_varlen_fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k,
                                                   causal, scale)
    return (out, lse) if return_lse else out
