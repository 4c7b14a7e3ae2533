"""QK norm: Qwen3-style per-head RMSNorm of Q and K in one launch, optionally with the rotary embedding.

    y = x * rsqrt(mean(x^2) + eps) * (w + weight_bias)     per head of d elements, fp32 math
    rope: y * cos[t] + rotate_half(y) * sin[t]              rotate_half(y) = (-y[d/2:], y[:d/2])

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

Rope (transformers' apply_rotary_pos_emb on the normed heads, in the same registers): element i pairs
with i + d/2. With one vector a thread (d / vec <= 32 chunks) the pair lies tph / 2 lanes away, one
butterfly shuffle of the vector; with two (fp32 at d = 256) it is the thread's other vector. cos and sin
are [T, d] tables in q's dtype or fp32 (rows 16-byte aligned), each token's row read by the threads of
its heads (an L1/L2 hit after the first). Without rope the kernel takes no tables and is the same code.

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
                 mOQ: cute.Tensor, mOK: cute.Tensor, mCos, mSin, stream):
        c = self.cfg
        tokens = mQ.shape[0]
        grid = (cute.ceil_div(tokens * c.q_heads, c.heads_per_block)
                + cute.ceil_div(tokens * c.k_heads, c.heads_per_block))
        self.kernel(mQ, mK, mWQ, mWK, mOQ, mOK, mCos, mSin).launch(
            grid=[grid, 1, 1], block=[c.warps * 32, 1, 1], stream=stream, use_pdl=c.pdl)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mWQ: cute.Tensor, mWK: cute.Tensor,
               mOQ: cute.Tensor, mOK: cute.Tensor, mCos, mSin):
        c = self.cfg
        if cutlass.const_expr(c.pdl):
            cute.arch.griddepcontrol_wait()  # q and k may come from the kernel before this one
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        tokens = mQ.shape[0]
        q_blocks = cute.ceil_div(tokens * c.q_heads, c.heads_per_block)
        if bidx < q_blocks:
            self.norm_heads(mQ, mWQ, mOQ, mCos, mSin, bidx, tidx, tokens * c.q_heads, c.q_heads)
        else:
            self.norm_heads(mK, mWK, mOK, mCos, mSin, bidx - q_blocks, tidx, tokens * c.k_heads, c.k_heads)

    @cute.jit
    def norm_heads(self, mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, mCos, mSin, block: Int32,
                   tidx: Int32, rows: Int32, heads: cutlass.Constexpr[int]):
        c = self.cfg
        rope = c.rope != "none"
        tph, vpt = c.threads_per_head, c.vecs_per_thread
        group, lane = tidx // tph, tidx % tph
        # Thread `lane` owns the 128-bit chunks lane, lane + tph, ... of every head it handles.
        chunks = [j * tph + lane for j in range(vpt)]

        xs, dsts, valid, tables = [], [], [], []
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
            if cutlass.const_expr(rope):  # the token's cos and sin at the thread's chunks
                cos, sin = cute.zipped_divide(mCos[t, None], (c.vec,)), cute.zipped_divide(mSin[t, None], (c.vec,))
                tables.append([(vec_load(cos[None, ch]), vec_load(sin[None, ch])) for ch in chunks])
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
            if cutlass.const_expr(rope):  # before the store's branch: every lane of the head shuffles
                roped = self.rotate([x[j] * rstd * ws[j] for j in range(vpt)], tables[r], lane)
            if valid[r]:
                for j in cutlass.range_constexpr(vpt):
                    y = cute.make_rmem_tensor((c.vec,), mO.element_type)
                    if cutlass.const_expr(rope):
                        y.store(roped[j].to(mO.element_type))
                    else:
                        y.store((x[j] * rstd * ws[j]).to(mO.element_type))
                    vec_store(y, dsts[r][j], c.cache_hint)

    @cute.jit
    def rotate(self, ys: list, tables: list, lane: Int32) -> list:
        """ys * cos + rotate_half(ys) * sin of one head: ys the thread's fp32 chunks (lane, lane + tph, ...),
        tables their (cos, sin) vectors. Every lane of the head runs it (the shuffle needs them all)."""
        c = self.cfg
        tph, vpt = c.threads_per_head, c.vecs_per_thread
        if cutlass.const_expr(vpt == 1):  # the partner chunk is tph / 2 lanes away; lanes below take -partner
            mine = cute.make_rmem_tensor(ys[0].shape, Float32)
            mine.store(ys[0])
            theirs = cute.make_rmem_tensor(ys[0].shape, Float32)
            for e in cutlass.range_constexpr(c.vec):  # (a shuffle moves 32 bits)
                theirs[e] = cute.arch.shuffle_sync_bfly(mine[e], offset=tph // 2)
            partners = [theirs.load()]
            signs = [Float32(2 * (lane // (tph // 2)) - 1)]
        else:  # vpt == 2 (tph = 32): chunk j pairs with the thread's chunk 1 - j; chunk 0 is the first half
            partners = [ys[1], ys[0]]
            signs = [Float32(-1.0), Float32(1.0)]
        out = []
        for j in cutlass.range_constexpr(vpt):
            cos, sin = (t.load().to(Float32) for t in tables[j])
            out.append(ys[j] * cos + partners[j] * signs[j] * sin)
        return out


def _build(cfg: QKNormConfig) -> Callable[[], tuple]:
    def build():
        dt, wdt = checks.cute_dtype(cfg.dtype), checks.cute_dtype(cfg.weight_dtype)
        tokens = cute.sym_int32()

        def heads(h: int) -> cute.Tensor:  # [tokens, h, d], any 16-byte-aligned row/head strides
            strides = (cute.sym_int64(divisibility=cfg.vec), cute.sym_int64(divisibility=cfg.vec), 1)
            return cute.runtime.make_fake_tensor(dt, (tokens, h, cfg.head_dim), strides, assumed_align=16)

        def weight() -> cute.Tensor:
            return cute.runtime.make_fake_compact_tensor(wdt, (cfg.head_dim,), assumed_align=16)

        def table() -> cute.Tensor | None:  # [tokens, d], 16-byte-aligned rows
            if cfg.rope == "none":
                return None
            tdt = checks.cute_dtype(cfg.rope)
            stride = cute.sym_int64(divisibility=128 // tdt.width)
            return cute.runtime.make_fake_tensor(tdt, (tokens, cfg.head_dim), (stride, 1), assumed_align=16)

        args = (heads(cfg.q_heads), heads(cfg.k_heads), weight(), weight(),
                heads(cfg.q_heads), heads(cfg.k_heads), table(), table(),
                cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
        return QKNormKernel(cfg), args
    return build


def compile(config: QKNormConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config`; call `.fn(q, k, q_weight, k_weight, out_q, out_k, cos, sin)` (cos and
    sin None without rope)."""
    return jit.compile_variant(config.variant(), _build(config))


def precompile(configs=None, processes: int | None = None) -> list[jit.CompiledKernel]:
    """compile() of each config (default: variants_for()), the cold ones first compiled in parallel
    processes into the disk cache (jit.precompile)."""
    return jit.precompile(compile, variants_for() if configs is None else configs, processes)


# ---------------------------------------------------------------------------------------------
# The float64 reference, and inputs for a config (tests, benchmark, SIP tuner).

def reference(q, k, q_weight, k_weight, eps: float = 1e-6, weight_bias: float = 0.0, cos=None, sin=None):
    """float64 (out_q, out_k); with cos and sin ([T, d]) each normed head rotated: y * cos + rotate_half(y) * sin."""
    return tuple(_terms(x, w, eps, weight_bias, cos, sin).sum(0) for x, w in ((q, q_weight), (k, k_weight)))


def rope_scales(q, k, q_weight, k_weight, eps: float = 1e-6, weight_bias: float = 0.0, cos=None, sin=None):
    """float64 |y * cos| + |rotate_half(y) * sin| of each element (cos and sin given): what the fp32 rotation's
    error scales with where its two terms cancel (error(): ROPE_ERROR)."""
    return tuple(_terms(x, w, eps, weight_bias, cos, sin).abs().sum(0) for x, w in ((q, q_weight), (k, k_weight)))


def _terms(x, w, eps, weight_bias, cos, sin) -> torch.Tensor:
    """[1 or 2, *x.shape] float64: the normed heads y, or y * cos and rotate_half(y) * sin."""
    x = x.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + weight_bias)
    if cos is None:
        return y[None]
    half = y.shape[-1] // 2
    rotated = torch.cat((-y[..., half:], y[..., :half]), dim=-1)
    return torch.stack((y * cos.double()[:, None], rotated * sin.double()[:, None]))


def tolerance(dtype: torch.dtype) -> float:
    """Max error() accepted: one rounding of an fp32-accurate result (the output dtype's)."""
    return checks.ROUNDING_TOLERANCE[dtype]


# The fp32 rotation's error, per unit of rope_scales: the norm's rsqrt (approximate, about 2 ulps) and the two
# products and their sum round in fp32 (2^-24 each), so a result its terms cancel toward zero keeps an error of
# a few 2^-24 of the terms; 2^-20 leaves 2x over 8 ulps.
ROPE_ERROR = 2.0 ** -20


def error(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """checks.relative_error(got, ref), with rope (`scale`: rope_scales) measured against |ref| + ROPE_ERROR /
    tolerance x scale: within tolerance(got.dtype) where got is within a rounding of ref plus ROPE_ERROR x scale."""
    if scale is None:
        return checks.relative_error(got, ref)
    if not got.numel():
        return 0.0
    floor = scale * (ROPE_ERROR / tolerance(got.dtype)) + torch.finfo(got.dtype).tiny
    return ((got.double() - ref).abs() / (ref.abs() + floor)).nan_to_num(math.inf).max().item()


def workload(config: QKNormConfig, shape: QKNormShape) -> Workload:
    """`compile(config)` with its inputs: make_args(seed) at `shape`'s token count, test_args(seed) at
    a random token count of config's mode (small ones for prefill); args are
    (q, k, q_weight, k_weight, out_q, out_k, cos, sin) on the GPU, outputs NaN-poisoned, cos and sin None
    without rope, else random values in [-1, 1] (no pairing between an element's and its partner's that a
    wrong index could hide behind)."""
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
        cos = sin = None
        if config.rope != "none":
            cos, sin = (torch.rand(tokens, config.head_dim, generator=g).mul_(2).sub_(1)
                        .to(dtype=TORCH_DTYPE[config.rope], device="cuda") for _ in "cs")
        return q, k, wq, wk, torch.full_like(q, math.nan), torch.full_like(k, math.nan), cos, sin

    def check(a: tuple) -> float:
        q, k, wq, wk, oq, ok, cos, sin = a
        inputs = (q, k, wq, wk, config.eps, config.weight_bias, cos, sin)
        scales = rope_scales(*inputs) if cos is not None else (None, None)
        worst = max(error(out, ref, scale) for out, ref, scale in zip((oq, ok), reference(*inputs), scales))
        if worst > tolerance(q.dtype):
            raise AssertionError(f"{config.variant().key()}: error {worst:.3g} > {tolerance(q.dtype):.3g}")
        return worst

    return Workload(compile(config), lambda seed: args(shape.tokens, seed), outputs=lambda a: a[4:6], check=check,
                    test_args=lambda seed: args(random.Random(seed).randint(lo, hi), seed), name=OP)
