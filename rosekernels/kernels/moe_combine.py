"""MoE combine on one GPU (TP=1): out[t] = sum_j w[t, j] * expert_out[slot_map[t, j]], skipping slot -1.

The inverse of `moe_dispatch`: `slot_map` is the one dispatch returned, `expert_out` the grouped GEMM's
output over the dispatch buffer (same rows). A thread owns one 16-byte vector of an output row: it
reads the k slots and weights of its token (the same addresses for the whole warp: one broadcast
transaction each), issues the k row loads back to back (128-bit, predicated rather than branched
around), then accumulates in fp32 registers in the order j = 0..k-1 and stores once in expert_out's
dtype. The launch asks for only one CTA per SM (min_blocks_per_mp=1) so that ptxas keeps all k loads
in flight instead of interleaving them with the arithmetic to save registers; ~56 registers still
leave 36 warps per SM, far more bytes in flight than HBM needs. Slots outside [0, rows of expert_out)
are skipped like -1, so a stale or foreign slot_map can never read out of bounds; a token without
any slot gets zeros. decode and prefill differ only in the CTA size (128 threads: few tokens spread
over more SMs; 256).

Config, mode rule, search space and warm-up set: moe_combine_plan.py (no CuTeDSL there).
"""
from __future__ import annotations

import random
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from rosekernels import checks, jit, launch, tuned
from rosekernels.kernels.moe_combine_plan import (  # noqa: F401  (re-exported: the kernel's contract)
    OP, CombineConfig, CombineShape, candidates, choose_mode, config_for, token_range, variants_for)
from rosekernels.kernels.moe_dispatch import DTYPES, check_sm90, rows_view
from rosekernels.workload import Workload

Config, Shape = CombineConfig, CombineShape


class _Combine:
    def __init__(self, cfg: CombineConfig):
        self.cfg = cfg
        self.k, self.nt = cfg.topk, cfg.threads
        self.vec, self.hv = cfg.vec, cfg.hidden // cfg.vec

    @cute.jit
    def __call__(self, mY: cute.Tensor, mW: cute.Tensor, mSlot: cute.Tensor, mOut: cute.Tensor, stream):
        self.kernel(mY, mW, mSlot, mOut).launch(
            grid=[(mOut.shape[0] * self.hv + self.nt - 1) // self.nt, 1, 1], block=[self.nt, 1, 1],
            min_blocks_per_mp=1,  # lets ptxas keep all k loads in flight instead of chasing occupancy
            stream=stream)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mW: cute.Tensor, mSlot: cute.Tensor, mOut: cute.Tensor):
        k, hv = self.k, self.hv
        i = cute.arch.block_idx()[0] * self.nt + cute.arch.thread_idx()[0]  # this thread's vector
        rows = mY.shape[0]
        if i < mOut.shape[0] * hv:
            t = i // hv
            v = i - t * hv
            gY = cute.zipped_divide(mY, (1, self.vec))  # ((1, vec), (rows, hv))
            gOut = cute.zipped_divide(mOut, (1, self.vec))
            acc = weighted_sum(gY, mW, mSlot, t, v, rows, k, self.vec, mY.element_type)
            out = cute.make_rmem_tensor((1, self.vec), mOut.element_type)
            out.store(acc.to(mOut.element_type).reshape((1, self.vec)))
            cute.autovec_copy(out, gOut[(None, None), (t, v)])


@cute.jit
def weighted_sum(gY: cute.Tensor, mW: cute.Tensor, mSlot: cute.Tensor, t: Int32, v: Int32, rows: Int32,
                 k: cutlass.Constexpr[int], vec: cutlass.Constexpr[int], dtype: cutlass.Constexpr):
    """sum_j mW[t, j] * vector v of row mSlot[t, j] of gY ((1, vec), (rows, vectors)), in fp32 (vec,),
    slots outside [0, rows) skipped. First the k loads, none waited for (predicated, no branches): each vector as 4 x b32, zero when its
    slot is skipped (its weight too); then the sum in the order j = 0..k-1."""
    raw = cute.make_rmem_tensor((4, k), Int32)
    weights = cute.make_rmem_tensor((k,), Float32)
    for j in cutlass.range_constexpr(k):
        s = mSlot[t, j]
        ok = (s >= 0) & (s < rows)
        weights[j] = cutlass.select_(ok, Float32(mW[t, j]), Float32(0.0))
        b = _load_16b_or_zero(gY[(None, None), (s, v)].iterator, ok)
        for q in cutlass.range_constexpr(4):
            raw[q, j] = b[q]
    vals = cute.recast_tensor(raw, dtype)  # (vec, k)
    acc = cute.full((vec,), 0.0, Float32)
    for j in cutlass.range_constexpr(k):
        acc = acc + vals[None, j].load().to(Float32) * weights[j]
    return acc


@cute.jit
def _load_16b_or_zero(ptr: cute.Pointer, pred: cutlass.Boolean):
    """16 bytes at `ptr` when `pred`, else zeros: a predicated ld.global.v4, no branch to wait behind."""
    return cute.arch.inline_ptx(
        "{\n.reg .pred p;\nsetp.ne.b32 p, {$r1}, 0;\n"
        "mov.b32 {$w0}, 0;\nmov.b32 {$w1}, 0;\nmov.b32 {$w2}, 0;\nmov.b32 {$w3}, 0;\n"
        "@p ld.global.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];\n}",
        write_only_types=[Int32] * 4,
        read_only_args=[ptr, Int32(pred)],
    )


def _fake_args(cfg: CombineConfig) -> tuple:
    dt = checks.cute_dtype(cfg.dtype)
    tokens, rows = cute.sym_int(), cute.sym_int()
    y = cute.runtime.make_fake_tensor(dt, (rows, cfg.hidden), (cute.sym_int64(divisibility=cfg.vec), 1),
                                      assumed_align=16)
    w = cute.runtime.make_fake_tensor(checks.cute_dtype(cfg.weight_dtype), (tokens, cfg.topk),
                                      (cute.sym_int64(), 1), assumed_align=checks.ELEM_BYTES[cfg.weight_dtype])
    slot = cute.runtime.make_fake_tensor(Int32, (tokens, cfg.topk), (cute.sym_int64(), 1), assumed_align=4)
    out = cute.runtime.make_fake_tensor(dt, (tokens, cfg.hidden), (cute.sym_int64(divisibility=cfg.vec), 1),
                                        assumed_align=16)
    return (y, w, slot, out, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))


def compile(config: CombineConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config`: fn(expert_out, topk_weights, slot_map, out)."""
    return jit.compile_variant(config.variant(), lambda: (_Combine(config), _fake_args(config)))


# ---------------------------------------------------------------------------------------------
# The op.

def moe_combine(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor,
                out: torch.Tensor | None = None, *, mode: str | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_out[slot_map[t, j]] (fp32 accumulation), slots -1
    skipped; out [T, H] in expert_out's dtype (allocated if not given; it must not overlap expert_out).
    `mode` forces "prefill" or "decode" (default: by T).

    Registered as torch.ops.rosekernels.moe_combine (mutating `out`) for torch.compile and fake
    tensors; eager calls skip the torch dispatcher and reuse the launch plan validated for the same
    shapes, strides, dtypes and devices."""
    if out is None:
        if not (isinstance(expert_out, torch.Tensor) and expert_out.dim() == 2
                and isinstance(slot_map, torch.Tensor) and slot_map.dim() == 2):
            raise ValueError("expert_out must be [rows, hidden] and slot_map [tokens, k]")
        out = expert_out.new_empty((slot_map.shape[0], expert_out.shape[1]))
    if launch.eager(expert_out, topk_weights, slot_map, out):
        _run(expert_out, topk_weights, slot_map, out, mode)
    else:
        _call_op(expert_out, topk_weights, slot_map, out, mode)
    return out


def _call_op(expert_out: Any, topk_weights: Any, slot_map: Any, out: Any, mode: str | None) -> None:
    """Through the registered op: traced (torch.compile), fake/meta tensors, tensor subclasses."""
    if mode is None:
        if not (isinstance(slot_map, torch.Tensor) and slot_map.dim() == 2):
            raise ValueError("slot_map must be a 2-D tensor [tokens, k]")
        mode = choose_mode(slot_map.shape[0])
    torch.ops.rosekernels.moe_combine(expert_out, topk_weights, slot_map, out, mode)


class _Plan(launch.Launch):
    """A combine validated for one signature; fn None: no tokens, nothing to launch. `canonical`: some
    tensor needs `rows_view` (a size-1 dim with an odd stride)."""

    def __init__(self, fn: Any, device: int, canonical: bool):
        super().__init__(fn, device)
        self.canonical = canonical

    def launch(self, expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor,
               out: torch.Tensor) -> None:
        if self.canonical:
            expert_out, topk_weights, slot_map, out = map(rows_view, (expert_out, topk_weights, slot_map, out))
        launch.on_device(self.device, self.fn, expert_out, topk_weights, slot_map, out)


_plans = launch.PlanCache()


def _run(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor, out: torch.Tensor,
         mode: str | None) -> None:
    """Launch on plain tensors. Per call: the plan's key, two pointer checks, the launch; the first
    call with a key validates everything and compiles or loads the kernel."""
    # The plan's signature, written out: a generic builder (a loop over the arguments) costs ~1 us more.
    key = (expert_out.shape, expert_out.stride(), expert_out.dtype, expert_out.get_device(),
           topk_weights.shape, topk_weights.stride(), topk_weights.dtype, topk_weights.get_device(),
           slot_map.shape, slot_map.stride(), slot_map.dtype, slot_map.get_device(),
           out.shape, out.stride(), out.dtype, out.get_device(), mode)
    plan = _plans.get(key) or _plans.put(key, _new_plan(expert_out, topk_weights, slot_map, out, mode))
    if plan.fn is None:
        return
    if expert_out.data_ptr() % 16 or out.data_ptr() % 16:  # the only property the key does not cover
        checks.check_aligned("expert_out", expert_out)
        checks.check_aligned("out", out)
    plan.launch(expert_out, topk_weights, slot_map, out)


def _new_plan(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor, out: torch.Tensor,
              mode: str | None) -> _Plan:
    """The slow path, once per signature: every check, the config, the kernel compiled or loaded."""
    tensors = (expert_out, topk_weights, slot_map, out)
    views = tuple(map(rows_view, tensors))
    cfg = validate(*views, mode or choose_mode(slot_map.shape[0]))
    shape = CombineShape(out.shape[0], cfg.hidden, cfg.topk, cfg.dtype, cfg.weight_dtype)
    cfg = tuned.tuned_config(OP, shape, cfg)
    fn = compile(cfg).fn if out.numel() else None
    return _Plan(fn, out.device.index, any(v.stride() != t.stride() for v, t in zip(views, tensors)))


def validate(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor, out: torch.Tensor,
             mode: str, *, on_device: bool = True) -> CombineConfig:
    """Every argument check, shapes/types first, then device, then alignment; returns the config."""
    for name, t in (("expert_out", expert_out), ("topk_weights", topk_weights), ("slot_map", slot_map),
                    ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    checks.check_dtype("expert_out", expert_out, DTYPES)
    checks.check_dtype("topk_weights", topk_weights, (torch.float32, expert_out.dtype))
    checks.check_dtype("slot_map", slot_map, (torch.int32,))
    checks.check_dtype("out", out, (expert_out.dtype,))
    checks.check_shape("expert_out", expert_out, (None, None))
    checks.check_shape("slot_map", slot_map, (None, None))
    checks.check_shape("topk_weights", topk_weights, tuple(slot_map.shape))
    checks.check_shape("out", out, (slot_map.shape[0], expert_out.shape[1]))
    cfg = CombineConfig(checks.DTYPE_NAME[expert_out.dtype], checks.DTYPE_NAME[topk_weights.dtype],
                        expert_out.shape[1], slot_map.shape[1], mode)
    if max(expert_out.shape[0], out.shape[0] * (out.shape[1] // cfg.vec)) + checks.INDEX_SLACK >= 2**31:
        raise ValueError(f"sizes exceed the kernel's 32-bit indexing: expert_out {list(expert_out.shape)}, "
                         f"out {list(out.shape)}")
    if on_device:
        for name, t in (("expert_out", expert_out), ("topk_weights", topk_weights), ("slot_map", slot_map),
                        ("out", out)):
            checks.check_cuda(name, t)
        checks.check_same_device(expert_out=expert_out, topk_weights=topk_weights, slot_map=slot_map, out=out)
        check_sm90(out.device)
        for name, t in (("expert_out", expert_out), ("topk_weights", topk_weights), ("slot_map", slot_map),
                        ("out", out)):
            checks.check_unit_last_stride(name, t)
        checks.check_aligned("expert_out", expert_out)
        checks.check_aligned("out", out)
        checks.check_not_expanded("out", out)
    return cfg


def _impl(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor, out: torch.Tensor,
          variant_mode: str) -> None:
    # (not `mode`: torch's functionalization of mutating ops passes a `mode` keyword of its own)
    _run(expert_out, topk_weights, slot_map, out, variant_mode)


def _fake(expert_out, topk_weights, slot_map, out, variant_mode):
    validate(expert_out, topk_weights, slot_map, out, variant_mode, on_device=False)


launch.register_op(OP, _impl, mutates_args=("out",), fake=_fake)


# ---------------------------------------------------------------------------------------------
# Inputs and checks: tests, benchmark, the SIP tuner.

def workload(config: CombineConfig, shape: CombineShape) -> Workload:
    """`config`'s kernel fed with `shape.tokens` tokens (make_args) or a random count of
    `token_range(config)` (test_args): args (expert_out, topk_weights, slot_map, out), the rows of a
    dispatch (T*k rows, every pair routed to its own row, in random order), a few pairs dropped (-1),
    softmax weights, out NaN-poisoned; checked by `check_combine`."""
    if (shape.hidden, shape.topk, shape.dtype, shape.weight_dtype) != \
            (config.hidden, config.topk, config.dtype, config.weight_dtype):
        raise ValueError(f"{shape} does not have the sizes of {config}")
    return Workload(compile(config), lambda seed: _args(config, shape.tokens, seed), outputs=lambda a: a[3:4],
                    check=lambda a: check_combine(*a), name=OP,
                    test_args=lambda seed: _args(config, random.Random(seed).randint(*token_range(config)), seed))


def _args(cfg: CombineConfig, tokens: int, seed: int) -> tuple:
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = tokens * cfg.topk
    expert_out = torch.randn(rows, cfg.hidden, generator=g).to(device="cuda", dtype=checks.TORCH_DTYPE[cfg.dtype])
    slot_map = torch.randperm(rows, generator=g).view(tokens, cfg.topk)
    slot_map[torch.rand(tokens, cfg.topk, generator=g) < 0.02] = -1
    weights = torch.rand(tokens, cfg.topk, generator=g).softmax(1)
    out = torch.full((tokens, cfg.hidden), float("nan"), dtype=expert_out.dtype, device="cuda")
    return (expert_out, weights.to(device="cuda", dtype=checks.TORCH_DTYPE[cfg.weight_dtype]),
            slot_map.to(device="cuda", dtype=torch.int32), out)


def reference(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor,
              absolute: bool = False) -> torch.Tensor:
    """float64 combine (slots outside [0, rows) skipped); absolute=True: sum_j |w y| instead."""
    ok = (slot_map >= 0) & (slot_map < expert_out.shape[0])
    rows = expert_out.double()[slot_map.long().clamp(0, max(expert_out.shape[0] - 1, 0))]
    terms = torch.where(ok[..., None], rows * torch.where(ok, topk_weights.double(), 0.0)[..., None], 0.0)
    return (terms.abs() if absolute else terms).sum(1)


def error_bound(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor) -> torch.Tensor:
    """Per element: one rounding of the result to the output dtype, plus k fp32 additions of the terms."""
    rel = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10, torch.float32: 2.0**-23}[expert_out.dtype]
    ref = reference(expert_out, topk_weights, slot_map)
    terms = reference(expert_out, topk_weights, slot_map, absolute=True)
    subnormal = torch.finfo(expert_out.dtype).smallest_normal * rel
    return rel * ref.abs() + (slot_map.shape[1] + 2) * 2.0**-23 * terms + subnormal


def check_combine(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor,
                  out: torch.Tensor) -> float:
    """Raise AssertionError unless `out` is within `error_bound` of the float64 `reference`; returns
    the largest error."""
    err = (out.double() - reference(expert_out, topk_weights, slot_map)).abs()
    bad = ~(err <= error_bound(expert_out, topk_weights, slot_map))  # NaN is bad
    if bad.any():
        first = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"moe_combine: {int(bad.sum())} of {out.numel()} elements off, first at {first}: "
                             f"{out[first].item()} (error {err[first].item():.3g})")
    return float(err.max()) if err.numel() else 0.0
