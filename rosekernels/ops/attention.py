"""attention(): softmax(q k^T * scale [+ causal mask]) v over the two attention kernels, and
attention_decode(), the split-KV kernel for any query length.

q [B, S_q, Hq, d], k/v [B, S_kv, Hkv, d] (Hq a multiple of Hkv), bf16 or fp16, d in {64, 128}; causal
aligned bottom-right; lse [B, Hq, S_q] fp32, natural log; a row that sees no key gets out 0, lse -inf.
out may be q (each tile reads its Q rows before it writes them), also q's slot of a fused qkv buffer, but
must share no memory with k or v.

The kernel follows from the query length: short queries (S_q <= attention_decode_plan.MAX_SEQLEN_Q,
decode steps) take the split-KV kernel (rosekernels/kernels/attention_decode.py), since one CTA per 128
query rows of the prefill kernel would leave most SMs idle; longer ones take the prefill kernel
(rosekernels/kernels/attention.py). Eager calls keep the launch of each argument signature in a plan
(checks and kernel choice once); traced calls go through the kernel's registered op
(rosekernels::attention_decode or rosekernels::attention_fwd). A batch that one launch cannot take
(operands spanning 2^31 elements or more, or more than 65535 entries) runs in slices of the batch.
"""
from __future__ import annotations

import dataclasses

import torch

from rosekernels import launch, modes, scratch, tuned
from rosekernels.kernels import attention as prefill
from rosekernels.kernels import attention_decode as decode
from rosekernels.kernels.attention_common import (
    LOG2_E, TORCH_DTYPES, OutApart, batch_per_launch, tma_view, validate, views_needed)
from rosekernels.kernels.attention_decode_plan import MAX_SEQLEN_Q, DecodeConfig, DecodeShape, split_plan
from rosekernels.kernels.attention_plan import AttentionConfig, AttentionShape, default_config, grid_size

# ---------------------------------------------------------------------------------------------
# The prefill kernel's launch.


class PrefillLaunch(launch.Launch):
    """One launch of `cfg` planned for an argument signature (validated arguments, q non-empty): the
    loaded kernel, its grid, the scale and whether TMA needs views of the tensors; a call only takes
    the stream's tile counter (the kernel re-zeroes it: one per stream serves every eager call)."""

    def __init__(self, cfg: AttentionConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor | None, scale: float):
        super().__init__(prefill.compile(cfg).fn, q.device.index)
        self.num_ctas = grid_size(cfg, q.shape[0], q.shape[1], q.shape[2], modes.sm_count(q.device.index))
        self.scale_log2 = scale * LOG2_E
        self.views = views_needed(q, k, v, out)

    def launch(self, q, k, v, out, lse) -> None:
        if self.views:
            q, k, v, out = (tma_view(t) for t in (q, k, v, out))
        launch.on_device(self.device, self.fn, q, k, v, out, lse, self.scale_log2,
                         scratch.zeroed_int32(self.device, 1), self.num_ctas, *prefill.NOT_VARLEN)


def prefill_config(q, k, causal: bool) -> AttentionConfig:
    """The heuristic's config, or the tuned store's for the call's shape. The shape the tuner
    measures (AttentionShape) has one sequence length, so a call with S_q != S_kv keeps the heuristic."""
    cfg = default_config(q.shape[-1], TORCH_DTYPES[q.dtype], causal, k.shape[1], q.shape[1], q.shape[0] * q.shape[2],
                         modes.sm_count(q.device.index))
    if q.shape[1] != k.shape[1]:
        return cfg
    return tuned.tuned_config(prefill, AttentionShape.of(q, k, causal), cfg)


def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   causal: bool, softmax_scale: float) -> None:
    """The registered op (torch.compile, tensor subclasses): validated arguments, TMA views; a fresh
    tile counter per call (CUDA-graph trees keep no tensor across calls)."""
    cfg = prefill_config(q, k, causal)  # as eager calls plan it: both give the same results
    launch.on_device(q.device.index, prefill.compile(cfg).fn, q, k, v, out, lse, softmax_scale * LOG2_E,
                     *prefill.launch_args(cfg, q), *prefill.NOT_VARLEN)


launch.register_op("attention_fwd", _attention_fwd, mutates_args=("out", "lse"))


# ---------------------------------------------------------------------------------------------
# The split-KV kernel's launches (rosekernels/ops/kvcache.py launches its KV-cache variants).


class SplitLaunch(launch.Launch):
    """What a launch of the split-KV kernel fixes for an argument signature (validated arguments,
    B >= 1): the loaded kernel, the split count, whether TMA needs views, the scale; each call takes
    the split workspace (`workspace`). `private_scratch`: a fresh split counter per call (the
    registered ops: CUDA-graph trees keep no tensor across calls)."""

    def __init__(self, cfg: DecodeConfig, shape: DecodeShape, tensors: tuple, scale: float,
                 private_scratch: bool = False):
        super().__init__(decode.compile(cfg).fn, tensors[0].device.index)
        self.cfg = cfg
        self.num_splits, self.per, self.groups = split_plan(cfg, shape, modes.sm_count(self.device))
        self.torch_device = tensors[0].device
        self.views = views_needed(*tensors)
        self.scale_log2 = scale * LOG2_E
        self.private_scratch = private_scratch

    def workspace(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(o_part, lse_part, counters) of one launch on the current stream. Split: the partials from
        the caching allocator per call (inside a CUDA graph capture: the graph's pool, alive as long
        as the graph); counters that the kernel returns to zero (rosekernels.scratch), sized in powers
        of two so that few shared buffers serve every shape. One split reads none of them."""
        if self.num_splits == 1:
            unread = scratch.unread_float32(self.device)
            return unread, unread, unread.view(torch.int32)
        rows = self.num_splits * self.groups * self.cfg.tile_m
        counters = scratch.zeroed_int32(self.device, max(4096, 1 << (self.groups - 1).bit_length()),
                                        self.private_scratch)
        o_part = torch.empty(rows * self.cfg.head_dim, dtype=torch.float32, device=self.torch_device)
        lse_part = torch.empty(rows, dtype=torch.float32, device=self.torch_device)
        return o_part, lse_part, counters


class DecodeLaunch(SplitLaunch):
    """One launch of the split-KV kernel on q/k/v [B, S, H, d], planned for an argument signature."""

    def __init__(self, cfg: DecodeConfig, shape: DecodeShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor | None, scale: float, private_scratch: bool = False):
        super().__init__(cfg, shape, (q, k, v, out), scale, private_scratch)
        self.causal_shift = decode.causal_shift_for(shape.causal, shape.seqlen_q, shape.seqlen_kv)

    def launch(self, q, k, v, out, lse) -> None:
        if self.views:
            q, k, v, out = (tma_view(t) for t in (q, k, v, out))
        launch.on_device(self.device, self.fn, q, k, v, out, lse, *self.workspace(), self.scale_log2,
                         self.causal_shift, self.num_splits, self.per)


def plan_decode(q, k, v, out, causal: bool, scale: float, splits: int | None = None,
                private_scratch: bool = False, enable_pdl: bool = True) -> DecodeLaunch:
    """The launch of validated arguments (q non-empty) with the heuristic's config (`config_for`);
    `splits` forces the number of KV chunks."""
    shape, sms = DecodeShape.of(q, k, causal, enable_pdl), modes.sm_count(q.device.index)
    cfg = tuned.tuned_config(decode, shape, decode.config_for(shape, sms), sms)
    if splits is not None:
        cfg = dataclasses.replace(cfg, splits=splits)
    return DecodeLaunch(cfg, shape, q, k, v, out, scale, private_scratch)


def _attention_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, causal: bool, softmax_scale: float, enable_pdl: bool = True) -> None:
    """The registered op (torch.compile, tensor subclasses): validated arguments, TMA views."""
    plan_decode(q, k, v, out, causal, softmax_scale, private_scratch=True, enable_pdl=enable_pdl).launch(
        q, k, v, out, lse)


launch.register_op("attention_decode", _attention_decode_op, mutates_args=("out", "lse"))


def attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                     softmax_scale: float | None = None, out: torch.Tensor | None = None,
                     return_lse: bool = False, splits: int | None = None, enable_pdl: bool = True):
    """`rosekernels.attention` forced onto the split-KV kernel (any S_q; meant for S_q <= 16);
    `splits` overrides the number of KV chunks of an eager call (tests and benchmarks); enable_pdl as
    attention's."""
    causal = bool(causal)
    scale = validate(q, k, v, out, softmax_scale)
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    if q.numel():
        if launch.eager(q, k, v, out):
            plan_decode(q, k, v, out, causal, scale, splits, enable_pdl=bool(enable_pdl)).launch(q, k, v, out, lse)
        else:
            torch.ops.rosekernels.attention_decode(*(tma_view(t) for t in (q, k, v, out)), lse, causal, scale,
                                                   bool(enable_pdl))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# attention(): the kernel for the query length.

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
        plan = _Sliced(slices, q, k, v, out, causal, scale, enable_pdl)
    else:
        plan = _plan(q, k, v, out, causal, scale, enable_pdl)
    return plan if out is None else OutApart(plan, out, q, k, v)


def _slices(batch, per: int) -> list[tuple]:
    """(first entry, entries) of each launch: one launch while it takes the whole batch (a traced batch
    size stays symbolic), else slices of `per` entries."""
    if per >= batch:
        return [(0, batch)]
    return [(b, min(per, batch - b)) for b in range(0, batch, per)]


def _plan(q, k, v, out, causal: bool, scale: float, enable_pdl: bool) -> launch.Launch:
    if q.shape[1] <= MAX_SEQLEN_Q:
        return plan_decode(q, k, v, out, causal, scale, enable_pdl=enable_pdl)
    return PrefillLaunch(prefill_config(q, k, causal), q, k, v, out, scale)


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
    (the checks run once per signature; per call only the 16-byte alignment of the pointers and,
    with out given, that out misses k and v);
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
            if q.shape[1] <= MAX_SEQLEN_Q:
                torch.ops.rosekernels.attention_decode(*views, part, causal, scale, enable_pdl)
            else:
                torch.ops.rosekernels.attention_fwd(*views, part, causal, scale)
    return (out, lse) if return_lse else out
