"""MoE routing: the softmax of each token's router logits and its top-k experts, in one launch.

    p = softmax(logits[t]) (fp32);  ids[t] = the k largest, largest first;
    weights[t, j] = p[ids[t, j]] / (sum of the k chosen, with `renormalize`; else 1)

What transformers' routers (Qwen3-MoE, Mixtral) run as 4-6 torch launches (softmax, topk, sum, divide,
cast), one of them a radix select: at decode batch sizes each costs more than the whole kernel here.

One warp routes one token. Lane l holds logits l, l + 32, ... (E compiled in, at most 16 a lane, -inf
past E; a NaN logit counts as -inf). The softmax takes two warp reductions (max, sum of exp2); the top k
take k rounds of a warp arg-max over the lanes' best untaken logit, which picks the largest logit and,
among equal ones, the lowest expert index (a stable sort's order): selecting on the logits, not on the
rounded probabilities, keeps that order exact. Lane j keeps round j's expert, computes its weight and
stores it: a token's k ids and weights are one contiguous store each. Every id is in [0, E) and the k
ids of a token are distinct, whatever the logits hold. A NaN logit is never chosen while a finite one is
left (torch's softmax would make the whole row NaN); a +inf logit, or a row without a finite one, gives
NaN weights.

Config, mode rule, search space and warm-up set: moe_route_plan.py (no CuTeDSL there); the op (argument
checks, launch plans, eager and traced calls): rosekernels/ops/moe_route.py.
"""
from __future__ import annotations

import math
import random

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Boolean, Float32, Int32

from rosekernels import checks, jit
from rosekernels.kernels.moe_route_plan import (  # noqa: F401  (re-exported: the kernel's contract)
    OP, RouteConfig, RouteShape, candidates, choose_mode, config_for, rank, token_range, variants_for)
from rosekernels.workload import Workload

Config, Shape = RouteConfig, RouteShape

_NONE = 1 << 30  # a lane's pick when all its experts are taken: loses every tie


class _Route:
    def __init__(self, cfg: RouteConfig):
        self.cfg = cfg
        self.per_lane = -(-cfg.experts // 32)

    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mWeights: cute.Tensor, mIds: cute.Tensor, stream):
        warps = self.cfg.warps
        self.kernel(mLogits, mWeights, mIds).launch(
            grid=[(mLogits.shape[0] + warps - 1) // warps, 1, 1], block=[32 * warps, 1, 1], stream=stream,
            use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mWeights: cute.Tensor, mIds: cute.Tensor):
        cfg, per_lane = self.cfg, self.per_lane
        if cutlass.const_expr(cfg.pdl):
            cute.arch.griddepcontrol_wait()  # the logits come from the kernel before this one
        lane = cute.arch.lane_idx()
        t = cute.arch.block_idx()[0] * cfg.warps + cute.arch.warp_idx()
        if t < mLogits.shape[0]:  # (the warp's lanes all take the same side: the shuffles below are whole)
            x = cute.make_rmem_tensor((per_lane,), Float32)
            taken = cute.make_rmem_tensor((per_lane,), Int32)
            for v in cutlass.range_constexpr(per_lane):
                x[v] = Float32(-math.inf)
                taken[v] = Int32(0)
                if lane + 32 * v < cfg.experts:
                    x[v] = mLogits[t, lane + 32 * v].to(Float32)
            if cutlass.const_expr(cfg.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            top = Float32(-math.inf)
            for v in cutlass.range_constexpr(per_lane):
                x[v] = cutlass.select_(x[v] == x[v], x[v], Float32(-math.inf))  # NaN -> -inf
                top = cute.arch.fmax(top, x[v])
            top = cute.arch.warp_reduction(top, lambda a, b: cute.arch.fmax(a, b), threads_in_group=32)
            total = Float32(0.0)
            for v in cutlass.range_constexpr(per_lane):
                total = total + cute.math.exp2((x[v] - top) * math.log2(math.e), fastmath=True)
            total = cute.arch.warp_reduction(total, lambda a, b: a + b, threads_in_group=32)

            mine_id, mine_x = Int32(0), Float32(-math.inf)  # lane j: round j's expert and its logit
            for j in cutlass.range_constexpr(cfg.topk):
                best_x, best_id = Float32(-math.inf), Int32(_NONE)
                for v in cutlass.range_constexpr(per_lane):  # ascending experts: ">" keeps the lowest on ties
                    free = taken[v] == 0
                    better = free & ((best_id == _NONE) | (x[v] > best_x))
                    best_x = cutlass.select_(better, x[v], best_x)
                    best_id = cutlass.select_(better, lane + 32 * v, best_id)
                for shift in cutlass.range_constexpr(5):
                    other_x = cute.arch.shuffle_sync_bfly(best_x, offset=16 >> shift)
                    other_id = cute.arch.shuffle_sync_bfly(best_id, offset=16 >> shift)
                    wins = (other_x > best_x) | ((other_x == best_x) & (other_id < best_id))
                    best_x = cutlass.select_(wins, other_x, best_x)
                    best_id = cutlass.select_(wins, other_id, best_id)
                for v in cutlass.range_constexpr(per_lane):
                    taken[v] = cutlass.select_(best_id == lane + 32 * v, Int32(1), taken[v])
                mine_id = cutlass.select_(lane == j, best_id, mine_id)
                mine_x = cutlass.select_(lane == j, best_x, mine_x)

            chosen = lane < cfg.topk
            e = cute.math.exp2((mine_x - top) * math.log2(math.e), fastmath=True)
            if cutlass.const_expr(cfg.renormalize):
                total = cute.arch.warp_reduction(cutlass.select_(chosen, e, Float32(0.0)), lambda a, b: a + b,
                                                 threads_in_group=32)
            if chosen:
                mWeights[t, lane] = (e / total).to(mWeights.element_type)
                mIds[t, lane] = mine_id


def _fake_args(cfg: RouteConfig) -> tuple:
    tokens = cute.sym_int()
    logits = cute.runtime.make_fake_tensor(checks.cute_dtype(cfg.dtype), (tokens, cfg.experts),
                                           (cute.sym_int64(), 1), assumed_align=checks.ELEM_BYTES[cfg.dtype])
    weights = cute.runtime.make_fake_tensor(checks.cute_dtype(cfg.weight_dtype), (tokens, cfg.topk),
                                            (cute.sym_int64(), 1), assumed_align=checks.ELEM_BYTES[cfg.weight_dtype])
    ids = cute.runtime.make_fake_tensor(Int32, (tokens, cfg.topk), (cute.sym_int64(), 1), assumed_align=4)
    return (logits, weights, ids, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))


def compile(config: RouteConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config`: fn(logits, topk_weights, topk_ids)."""
    return jit.compile_variant(config.variant(), lambda: (_Route(config), _fake_args(config)))


def precompile(configs=None, processes: int | None = None) -> list[jit.CompiledKernel]:
    """compile() of each config (default: variants_for()), the cold ones first compiled in parallel
    processes into the disk cache (jit.precompile)."""
    return jit.precompile(compile, variants_for() if configs is None else configs, processes)


# ---------------------------------------------------------------------------------------------
# Inputs and checks: tests, benchmark, the SIP tuner.

def workload(config: RouteConfig, shape: RouteShape) -> Workload:
    """`config`'s kernel fed with `shape.tokens` tokens (make_args) or a random count of
    `token_range(config)` (test_args): args (logits, topk_weights, topk_ids), logits in the model's
    dtype with ties (a few rows share values), outputs poisoned (NaN, -1); checked by `check_route`."""
    if (shape.experts, shape.topk, shape.dtype, shape.weight_dtype, shape.renormalize) != \
            (config.experts, config.topk, config.dtype, config.weight_dtype, config.renormalize):
        raise ValueError(f"{shape} does not have the sizes of {config}")
    return Workload(compile(config), lambda seed: _args(config, shape.tokens, seed), outputs=lambda a: a[1:3],
                    check=lambda a: check_route(*a, renormalize=config.renormalize), name=OP,
                    test_args=lambda seed: _args(config, random.Random(seed).randint(*token_range(config)), seed))


def _args(cfg: RouteConfig, tokens: int, seed: int) -> tuple:
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, cfg.experts, generator=g) * 2
    logits[::7] = logits[::7].round()  # every 7th token: many equal logits, so ties decide the order
    logits = logits.to(device="cuda", dtype=checks.TORCH_DTYPE[cfg.dtype])
    weights = torch.full((tokens, cfg.topk), float("nan"), device="cuda", dtype=checks.TORCH_DTYPE[cfg.weight_dtype])
    ids = torch.full((tokens, cfg.topk), -1, device="cuda", dtype=torch.int32)
    return logits, weights, ids


def reference(logits: torch.Tensor, topk: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) in float64 / int64: the k largest logits by a stable sort (lowest expert first among
    equal ones), NaN taken as -inf; weights from the float64 softmax."""
    x = logits.double().nan_to_num(nan=-math.inf)
    ids = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :topk]
    p = torch.softmax(x, dim=1).gather(1, ids)
    return (p / p.sum(1, keepdim=True) if renormalize else p), ids


def error_bound(logits: torch.Tensor, ids: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per weight, in fp32 ulps (2^-23 relative): exp2's argument rounded (|x - max| of them) and exp2's own
    error, the sums of up to E terms and the division; check_route adds the rounding to the weights' dtype."""
    x = logits.double().nan_to_num(nan=-math.inf)
    spread = (x.max(1, keepdim=True).values - x.gather(1, ids)).abs()
    fp32 = (16 + 2 * math.log2(max(logits.shape[1], 2)) + spread) * 2.0**-23
    return fp32 * ref + torch.finfo(torch.float32).tiny


def check_route(logits: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                renormalize: bool) -> float:
    """Raise AssertionError unless topk_ids are the reference's exactly and topk_weights within
    `error_bound` (plus the rounding to their dtype) of the float64 reference; returns the largest error."""
    ref_w, ref_ids = reference(logits, topk_ids.shape[1], renormalize)
    wrong = topk_ids.long() != ref_ids
    if wrong.any():
        t = int(wrong.nonzero()[0, 0])
        raise AssertionError(f"moe_route: {int(wrong.any(1).sum())} of {len(wrong)} tokens chose other experts, "
                             f"first token {t}: {topk_ids[t].tolist()} against {ref_ids[t].tolist()}")
    bound = error_bound(logits, ref_ids, ref_w)
    if topk_weights.dtype != torch.float32:  # half an ulp, relative, or of the smallest normal (subnormals)
        info = torch.finfo(topk_weights.dtype)
        bound = bound + (ref_w + info.smallest_normal) * info.eps / 2
    err = (topk_weights.double() - ref_w).abs()
    bad = ~(err <= bound)  # NaN is bad
    if bad.any():
        first = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"moe_route: {int(bad.sum())} of {err.numel()} weights off, first at {first}: "
                             f"{topk_weights[first].item()} against {ref_w[first].item()}")
    return float(err.max()) if err.numel() else 0.0
