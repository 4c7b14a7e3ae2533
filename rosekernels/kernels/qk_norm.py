"""QK norm: Qwen3-style per-head RMSNorm of Q and K in one launch.

    y = x * rsqrt(mean(x^2) + eps) * (w + weight_bias)     per head of d elements, fp32 math

Design (ROSE's QK-norm kernel): a head is d <= 256 elements, so a (sub-)warp owns it. Each thread
moves 128 bits (8 bf16/fp16 or 4 fp32 values) per access, so d=128 bf16 takes a half-warp
(16 threads x 8 values) and the head's sum of squares is a butterfly shuffle over 16 lanes: 4
rounds, fixed when the kernel is compiled. Head counts, head dim, eps and the weight bias are
compile-time constants; the token count and every row/head stride are runtime values, so one
compile serves every T of a mode and strided views into a fused qkv buffer.

Grid: blocks [0, q_blocks) normalize Q heads, the rest K heads (one launch for both); a block is
uniformly Q or K, so shuffles never diverge. Heads are numbered token-major (row = t*heads + h);
a thread group handles `rows_per_thread` heads a block-stride apart, issuing all their loads
before any reduction. Rows past the end are clamped for loading (no predicated loads, no
divergence around the shuffles) and masked for storing.

Modes (rosekernels.modes): decode = one warp per block, a tiny grid of one-warp blocks;
prefill = 8/16/32-warp blocks and several heads per thread group, from the benchmarked table.
The config, the call's shape and the choice between them live in qk_norm_plan (no CuTeDSL), the op
(argument checks, launch plans, eager and traced calls) in rosekernels/ops/qk_norm.py.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Callable

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from rosekernels import checks, jit, modes
from rosekernels.kernels.qk_norm_plan import (  # noqa: F401  (the plan's names are the kernel's: the contract)
    HEAD_DIMS, OP, TORCH_DTYPE, QKNormConfig, QKNormShape, candidates, config_for, rank, variants_for)
from rosekernels.vector_copy import vec_load, vec_store
from rosekernels.workload import Workload

Config, Shape = QKNormConfig, QKNormShape


# ---------------------------------------------------------------------------------------------
# The kernel.

class QKNormKernel:
    def __init__(self, cfg: QKNormConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mWQ: cute.Tensor, mWK: cute.Tensor,
                 mOQ: cute.Tensor, mOK: cute.Tensor, stream):
        c = self.cfg
        tokens = mQ.shape[0]
        grid = (cute.ceil_div(tokens * c.q_heads, c.heads_per_block)
                + cute.ceil_div(tokens * c.k_heads, c.heads_per_block))
        self.kernel(mQ, mK, mWQ, mWK, mOQ, mOK).launch(
            grid=[grid, 1, 1], block=[c.warps * 32, 1, 1], stream=stream, use_pdl=c.pdl)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mWQ: cute.Tensor, mWK: cute.Tensor,
               mOQ: cute.Tensor, mOK: cute.Tensor):
        c = self.cfg
        if cutlass.const_expr(c.pdl):
            cute.arch.griddepcontrol_wait()  # q and k may come from the kernel before this one
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        tokens = mQ.shape[0]
        q_blocks = cute.ceil_div(tokens * c.q_heads, c.heads_per_block)
        if bidx < q_blocks:
            self.norm_heads(mQ, mWQ, mOQ, bidx, tidx, tokens * c.q_heads, c.q_heads)
        else:
            self.norm_heads(mK, mWK, mOK, bidx - q_blocks, tidx, tokens * c.k_heads, c.k_heads)

    @cute.jit
    def norm_heads(self, mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, block: Int32,
                   tidx: Int32, rows: Int32, heads: cutlass.Constexpr[int]):
        c = self.cfg
        tph, vpt = c.threads_per_head, c.vecs_per_thread
        group, lane = tidx // tph, tidx % tph
        # Thread `lane` owns the 128-bit chunks lane, lane + tph, ... of every head it handles.
        chunks = [j * tph + lane for j in range(vpt)]

        xs, dsts, valid = [], [], []
        for r in cutlass.range_constexpr(c.rows_per_thread):
            row = block * c.heads_per_block + r * c.groups_per_block + group
            valid.append(row < rows)
            row = cutlass.min(row, rows - 1)  # clamped: loads stay in bounds without predicates
            t = Int32(cutlass.Uint32(row) // heads)  # unsigned: a multiply-shift, rows are >= 0
            h = row - t * heads
            src = cute.zipped_divide(mX[t, h, None], (c.vec,))
            xs.append([vec_load(src[None, ch], c.cache_hint) for ch in chunks])
            dst = cute.zipped_divide(mO[t, h, None], (c.vec,))
            dsts.append([dst[None, ch] for ch in chunks])
        ws = []
        gW = cute.zipped_divide(mW, (c.vec,))
        for ch in chunks:
            w = vec_load(gW[None, ch]).load().to(Float32)
            if cutlass.const_expr(c.weight_bias != 0.0):
                w = w + Float32(c.weight_bias)
            ws.append(w)
        if cutlass.const_expr(c.pdl):
            # Every load is issued: the next kernel may launch and set up (its own wait still holds
            # it until this grid has finished and its stores are visible).
            cute.arch.griddepcontrol_launch_dependents()

        for r in cutlass.range_constexpr(c.rows_per_thread):
            x = [v.load().to(Float32) for v in xs[r]]
            sum_sq = (x[0] * x[0]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            for j in cutlass.range_constexpr(1, vpt):
                sum_sq = sum_sq + (x[j] * x[j]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if cutlass.const_expr(tph > 1):
                sum_sq = cute.arch.warp_reduction(sum_sq, lambda a, b: a + b, threads_in_group=tph)
            rstd = cute.math.rsqrt(sum_sq * (1.0 / c.head_dim) + c.eps, fastmath=True)
            if valid[r]:
                for j in cutlass.range_constexpr(vpt):
                    y = cute.make_rmem_tensor((c.vec,), mO.element_type)
                    y.store((x[j] * rstd * ws[j]).to(mO.element_type))
                    vec_store(y, dsts[r][j], c.cache_hint)


def _build(cfg: QKNormConfig) -> Callable[[], tuple]:
    def build():
        dt, wdt = checks.cute_dtype(cfg.dtype), checks.cute_dtype(cfg.weight_dtype)
        tokens = cute.sym_int32()

        def heads(h: int) -> cute.Tensor:  # [tokens, h, d], any 16-byte-aligned row/head strides
            strides = (cute.sym_int64(divisibility=cfg.vec), cute.sym_int64(divisibility=cfg.vec), 1)
            return cute.runtime.make_fake_tensor(dt, (tokens, h, cfg.head_dim), strides, assumed_align=16)

        def weight() -> cute.Tensor:
            return cute.runtime.make_fake_compact_tensor(wdt, (cfg.head_dim,), assumed_align=16)

        args = (heads(cfg.q_heads), heads(cfg.k_heads), weight(), weight(),
                heads(cfg.q_heads), heads(cfg.k_heads),
                cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
        return QKNormKernel(cfg), args
    return build


def compile(config: QKNormConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config`; call `.fn(q, k, q_weight, k_weight, out_q, out_k)`."""
    return jit.compile_variant(config.variant(), _build(config))


def precompile(configs=None, processes: int | None = None) -> list[jit.CompiledKernel]:
    """compile() of each config (default: variants_for()), the cold ones first compiled in parallel
    processes into the disk cache (jit.precompile)."""
    return jit.precompile(compile, variants_for() if configs is None else configs, processes)


# ---------------------------------------------------------------------------------------------
# The float64 reference, and inputs for a config (tests, benchmark, SIP tuner).

def reference(q, k, q_weight, k_weight, eps: float = 1e-6, weight_bias: float = 0.0):
    """float64 (out_q, out_k)."""
    def norm(x, w):
        x = x.double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + weight_bias)
    return norm(q, q_weight), norm(k, k_weight)


def tolerance(dtype: torch.dtype) -> float:
    """Max checks.relative_error accepted: one rounding of an fp32-accurate result (the output dtype's)."""
    return checks.ROUNDING_TOLERANCE[dtype]


def workload(config: QKNormConfig, shape: QKNormShape) -> Workload:
    """`compile(config)` with its inputs: make_args(seed) at `shape`'s token count, test_args(seed) at
    a random token count of config's mode (small ones for prefill); args are
    (q, k, q_weight, k_weight, out_q, out_k) on the GPU, outputs NaN-poisoned."""
    lo, hi = modes.size_range(config.mode, lambda t: config_for(dataclasses.replace(shape, tokens=t)).mode)

    def args(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator(device="cpu").manual_seed(seed)
        dt, wdt = TORCH_DTYPE[config.dtype], TORCH_DTYPE[config.weight_dtype]

        def rand(*size, dtype, scale=1.0, shift=0.0):
            return (torch.randn(*size, generator=g) * scale + shift).to(dtype=dtype, device="cuda")

        q = rand(tokens, config.q_heads, config.head_dim, dtype=dt, scale=3.0)
        k = rand(tokens, config.k_heads, config.head_dim, dtype=dt, scale=3.0)
        wq = rand(config.head_dim, dtype=wdt, scale=0.2, shift=1.0)
        wk = rand(config.head_dim, dtype=wdt, scale=0.2, shift=1.0)
        return q, k, wq, wk, torch.full_like(q, math.nan), torch.full_like(k, math.nan)

    def check(a: tuple) -> float:
        q, k, wq, wk, oq, ok = a
        worst = max(checks.relative_error(out, ref)
                    for out, ref in zip((oq, ok), reference(q, k, wq, wk, config.eps, config.weight_bias)))
        if worst > tolerance(q.dtype):
            raise AssertionError(f"{config.variant().key()}: error {worst:.3g} > {tolerance(q.dtype):.3g}")
        return worst

    return Workload(compile(config), lambda seed: args(shape.tokens, seed), outputs=lambda a: a[4:6], check=check,
                    test_args=lambda seed: args(random.Random(seed).randint(lo, hi), seed), name=OP)
