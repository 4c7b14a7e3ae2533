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

Config, mode rule, search space and warm-up set: moe_combine_plan.py (no CuTeDSL there); the weighted sum
itself: moe_common.weighted_sum (the tensor-parallel reduce of moe_peer runs it too); the op (argument
checks, launch plans, eager and traced calls): rosekernels/ops/moe_combine.py.
"""
from __future__ import annotations

import random

import cutlass.cute as cute
import torch
from cutlass import Int32

from rosekernels import checks, jit
from rosekernels.kernels.moe_combine_plan import (  # noqa: F401  (re-exported: the kernel's contract)
    OP, CombineConfig, CombineShape, candidates, choose_mode, config_for, rank, token_range, variants_for)
from rosekernels.kernels.moe_common import weighted_sum
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


def precompile(configs=None, processes: int | None = None) -> list[jit.CompiledKernel]:
    """compile() of each config (default: variants_for()), the cold ones first compiled in parallel
    processes into the disk cache (jit.precompile)."""
    return jit.precompile(compile, variants_for() if configs is None else configs, processes)


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
