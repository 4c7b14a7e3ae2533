"""FP8 GEMM for Hopper (sm_90a): out = act((a @ w^T) * scales + bias), a [M, K] and w [N, K] e4m3, out bf16 or
fp16, with the bf16 GEMM's epilogues (bias, relu / leaky_relu / silu / gelu_tanh, gated SwiGLU). Scales:

    rowcol   a_scale[m] * w_scale[n]: per token x per channel, either of them one value for the whole
             tensor (broadcast with stride 0): per tensor is both
    block    a_scale[m, k // 128] * w_scale[n // 128, k // 128]: a's 1 x 128 groups times w's 128 x 128
             blocks (DeepSeek-V3's), K a multiple of 128

The kernel is the bf16 GEMM's (gemm_leakyrelu.GemmSm90: persistent, warp-specialized, TMA + WGMMA, the
same plain and swapped decode tiles, split-K, clusters and prefill tiles) with its FP8 option: e4m3
k-tiles of 128 elements, and each k-tile's WGMMA sums promoted into fp32 registers (fp8_tiles.Fp8Tiles),
because Hopper's FP8 tensor cores accumulate with less than fp32 precision. Swapped (decode) tiles put the
weights on the MMA's M side: the kernel's A is w (with w_scale), its B is a (with a_scale), its D out^T.

This module holds the compile, the float64 reference and the workload; configs and the heuristic are in
gemm_fp8_plan, the op in rosekernels/ops/gemm_fp8.py.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import random
from typing import Optional

from rosekernels import jit  # first: it pins CUTE_DSL_ARCH=sm_90a before cutlass is imported

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from rosekernels import checks, fp8, modes
from rosekernels.kernels.gemm_fp8_plan import (  # noqa: F401  (the plan's names are the contract)
    OP, TILE_K, Fp8GemmConfig, Fp8GemmShape, candidates, config_for, rank, variants_for, workload_fits)
from rosekernels.kernels.gemm_leakyrelu import GemmSm90, epilogue_reference
from rosekernels.kernels.gemm_leakyrelu_plan import COUNTER_SLOTS, GATE_BLOCK, MAX_SPLITS, m_range, partial_floats
from rosekernels.workload import Workload

Config, Shape = Fp8GemmConfig, Fp8GemmShape


# ---------------------------------------------------------------------------------------------
# Compilation.


def _build(cfg: Fp8GemmConfig):
    """(launcher, fake compile arguments): one compile serves every M, N, K and stride, and both a
    per-tensor and a per-row scale on either side of `rowcol`."""
    e4m3, out_dt = cutlass.Float8E4M3FN, checks.cute_dtype(cfg.dtype)
    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int()
    a = make_fake_tensor(e4m3, (m, k), (cute.sym_int64(divisibility=16), 1), assumed_align=16)
    w = make_fake_tensor(e4m3, (n, k), (cute.sym_int64(divisibility=16), 1), assumed_align=16)
    if cfg.scales == "rowcol":
        a_scale = make_fake_tensor(Float32, (m,), (cute.sym_int64(),), assumed_align=4)
        w_scale = make_fake_tensor(Float32, (n,), (cute.sym_int64(),), assumed_align=4)
    else:
        k_blocks = cute.sym_int()
        a_scale = make_fake_tensor(Float32, (m, k_blocks), (cute.sym_int64(), cute.sym_int64()), assumed_align=4)
        w_scale = make_fake_tensor(Float32, (cute.sym_int(), k_blocks), (cute.sym_int64(), cute.sym_int64()),
                                   assumed_align=4)
    n_out = cute.sym_int() if cfg.gated else n  # gated: half as many columns as weight rows
    if cfg.swap_ab:  # the kernel's A is the weights, its B the tokens, its D out^T (stored per element)
        a, w, a_scale, w_scale = w, a, w_scale, a_scale
        d = make_fake_tensor(out_dt, (n_out, m), (1, cute.sym_int64()), assumed_align=16)
    else:
        d = make_fake_tensor(out_dt, (m, n_out), (cute.sym_int64(divisibility=8), 1), assumed_align=16)
    bias = None
    if cfg.bias != "none":
        bias_dt = checks.cute_dtype(cfg.bias)
        bias = make_fake_tensor(bias_dt, (n,), (1,), assumed_align=bias_dt.width // 8)
    partials = counters = None
    if cfg.split_k:
        partials = make_fake_tensor(Float32, (cute.sym_int(),), (1,), assumed_align=16)
        counters = make_fake_tensor(Int32, (cute.sym_int(),), (1,), assumed_align=4)
    args = (a, w, d, bias, partials, counters, Int32(1), Int32(8), Int32(132),
            make_fake_stream(use_tvm_ffi_env_stream=True), a_scale, w_scale)
    return GemmSm90(cfg), args


def compile(config: Fp8GemmConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config`; its function takes (a, w, out, bias, partials, counters, splits,
    raster_group, max_clusters, a_scale, w_scale), swapped configs (w, a, out.t(), ..., w_scale, a_scale):
    `launch_args` builds them."""
    return jit.compile_variant(config.variant(), lambda: _build(config))


def precompile(configs=None, processes: int | None = None) -> list[jit.CompiledKernel]:
    """compile() of each config (default: variants_for()), the cold ones first compiled in parallel
    processes into the disk cache (jit.precompile)."""
    return jit.precompile(compile, variants_for() if configs is None else configs, processes)


def kernel_scales(config: Fp8GemmConfig, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A scale as the kernel reads it: for rowcol, [rows] (one value broadcast with stride 0, or a [rows, 1]
    column as [rows]); block scales as they are."""
    if config.scales == "block":
        return scale
    return scale.reshape(-1).expand(rows) if scale.numel() == 1 else scale.reshape(rows)


def launch_args(config: Fp8GemmConfig, a, a_scale, w, w_scale, bias, out, partials, counters,
                max_clusters: int) -> tuple:
    """The arguments of compile(config).fn for one call (M, N, K > 0), in the kernel's operand order."""
    a_scale, w_scale = kernel_scales(config, a_scale, a.shape[0]), kernel_scales(config, w_scale, w.shape[0])
    policy = (config.splits, config.raster_group, max_clusters)
    if config.swap_ab:
        return (w, a, out.t(), bias, partials, counters, *policy, w_scale, a_scale)
    return (a, w, out, bias, partials, counters, *policy, a_scale, w_scale)


# ---------------------------------------------------------------------------------------------
# The reference, and workloads: a config's kernel with its inputs, for tests and SIP.


def dequantized(q: torch.Tensor, scale: torch.Tensor, block_rows: int) -> torch.Tensor:
    """float64 q * scale: `scale` a value per tensor ([1]), per row ([R] or [R, 1]), or per block of
    block_rows x 128 ([ceil(R / block_rows), ceil(C / 128)])."""
    rows = q.shape[0]
    if scale.numel() == 1 or (scale.shape[0] == rows and scale.numel() == rows):
        return q.double() * scale.double().reshape(-1, 1)
    return fp8.dequantize(q, scale, block_rows, fp8.BLOCK)


# The error of the kernel's FP8 sums, per element, in units of sigma = sqrt(sum_k (a_k w_k)^2) (dequantized):
# the size of the partial sums WGMMA carries. Hopper's FP8 WGMMA adds a chain's products into an e8m13
# accumulator that truncates (FP22: DeepSeek-V3's "about 14 bits"; the H100 models of Khattak & Mikaitis,
# arXiv 2512.07004): each step loses less than one unit of the 13th fraction bit of the running partial
# sum. The kernel ends each chain after one 128-element k-tile and adds it in fp32, so an element's error
# is that of K / 128 independent chains, each on partial sums of its tile's sigma: it scales with the
# element's sigma (not with |out|, whose cancellations leave the partial sums' error; nor with the
# tensor's rms: random_operands' rows span 2^8 in magnitude) and does not grow with K. A simulation of that
# accumulator (exact products, each group of 4..32 of them and the accumulator aligned to the largest and
# truncated to 13 fraction bits, the sum truncated to 13 bits) on random_operands' e4m3 operands, rowcol
# and block, gives |err| / sigma of rms 1.3e-4 .. 1.6e-4 at every K from 128 to 4096, and at most 2^-9.4
# (K = 128, 6.6e4 elements; 2^-9.9 over 2.6e5 at K = 1024); 2^-8 leaves 2.6x that for the tails of larger
# outputs and for gated epilogues (act(gate) * up carries both sums' errors: about 1.4x). The bound it
# replaces, 2^-10 of the reference's rms, failed test_workload on the H200 (one element 0.0115 off at 0.40:
# 2^-10.5 of the rms of a row scaled by 2^4, within the model's tail, which fails ~50 elements of those
# 8192 x 1024 so). A chain carried over k-tiles (no promotion)
# grows the error with the square root of its length in k-tiles: the norm-wise bound at K = 16384
# (test_long_k_is_promoted) and the SASS test catch that.
ACC_ERROR = 2.0 ** -8
# The epilogue runs in fp32, and gelu_tanh's 1 + tanh(u) cancels as tanh(u) -> -1: the result keeps tanh's
# absolute error (a few 2^-24) times 0.5 |y|, so a tiny output of a large negative y is off by up to about
# |y| 2^-23 (silu's 1 + exp(-y) and the others stay under that). 2^-22 x |y| (x |up| when gated) leaves 2x;
# the H200 run saw 2^-26 |y| (y near -5.4: 8e-8 on an output of 1e-7, an fp16 value a few subnormal steps wide).
EVAL_ERROR = 2.0 ** -22


def _sums(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
          bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, sigma): float64 deq(a) @ deq(w)^T + bias, and sqrt(deq(a)^2 @ deq(w)^2^T) (each sum's products'
    root-sum-square: the scale of its accumulation error, ACC_ERROR)."""
    da, dw = dequantized(a, a_scale, 1), dequantized(w, w_scale, fp8.BLOCK)
    y = da @ dw.t()
    if bias is not None:
        y = y + bias.double()
    return y, (da.square() @ dw.square().t()).sqrt()


def reference(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              bias: Optional[torch.Tensor] = None, activation: str = "none", gated: bool = False,
              slope: float = 0.01) -> torch.Tensor:
    """The float64 result on the dequantized operands: epilogue(deq(a) @ deq(w)^T + bias)."""
    y = dequantized(a, a_scale, 1) @ dequantized(w, w_scale, fp8.BLOCK).t()
    if bias is not None:
        y = y + bias.double()
    return epilogue_reference(y, activation, gated, slope)


def reference_and_spread(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, activation: str = "none", gated: bool = False,
                         slope: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, spread): the reference and, per element, how far the epilogue moves it when each sum
    moves by its accumulation error (ACC_ERROR x sigma; gated: the gate's and the up sum's, each sign), plus
    the fp32 epilogue's own error (EVAL_ERROR)."""
    y, sigma = _sums(a, a_scale, w, w_scale, bias)
    delta = ACC_ERROR * sigma
    ref = epilogue_reference(y, activation, gated, slope)
    if activation == "none":
        spread = torch.zeros_like(ref)
    elif gated:
        pairs = y.unflatten(-1, (-1, 2, GATE_BLOCK)).abs()
        spread = (EVAL_ERROR * pairs[..., 0, :] * pairs[..., 1, :]).flatten(-2)
    else:
        spread = EVAL_ERROR * y.abs()
    moved = torch.zeros_like(ref)
    for g, u in ((1, 1), (1, -1), (-1, 1), (-1, -1)) if gated else ((1, 1), (-1, -1)):
        if gated:  # gate and up rows interleaved in GATE_BLOCKs (epilogue_reference)
            signs = torch.tensor([[g], [u]], dtype=y.dtype, device=y.device)
            d = (delta.unflatten(-1, (-1, 2, GATE_BLOCK)) * signs).flatten(-3)
        else:
            d = g * delta
        moved = torch.maximum(moved, (epilogue_reference(y + d, activation, gated, slope) - ref).abs())
    return ref, spread + moved


def check_out(out: torch.Tensor, ref: torch.Tensor, spread) -> float:
    """Raise AssertionError unless out is within 2x of rounding the reference to out's dtype (norm-wise),
    and each element within one ulp of its dtype (or one subnormal step) plus its `spread`
    (reference_and_spread: what the error of WGMMA's FP8 sums, promoted to fp32 after each 128-element
    k-tile, and of the fp32 epilogue moves it; a tensor or a number).
    Returns ||out - ref|| / ||rounded - ref||."""
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite elements"
    got = out.double()
    rounding = (ref.to(out.dtype).double() - ref).norm().item()
    err = (got - ref).norm().item()
    ratio = err / rounding if rounding else (0.0 if err == 0 else math.inf)
    assert ratio <= 2.0, f"error norm {err:.4g} is {ratio:.3g}x that of rounding the reference ({rounding:.4g})"
    info = torch.finfo(out.dtype)
    # one ulp, or one subnormal step below the normal range (fp16 from 6.1e-5: steps of 2^-24)
    excess = (got - ref).abs() - (1.01 * info.eps * ref.abs() + info.smallest_normal * info.eps + spread)
    worst = excess.argmax().item() if excess.numel() else 0
    assert excess.numel() == 0 or excess.flatten()[worst] <= 0, (
        f"element {divmod(worst, out.shape[1])} = {got.flatten()[worst].item()}, reference {ref.flatten()[worst].item()}")
    return ratio


def check(out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
          bias: Optional[torch.Tensor] = None, activation: str = "none", gated: bool = False,
          slope: float = 0.01) -> float:
    """check_out of a kernel's `out` against the reference of its operands and epilogue."""
    return check_out(out, *reference_and_spread(a, a_scale, w, w_scale, bias, activation, gated, slope))


def random_operands(m: int, n: int, k: int, scales: str, generator: torch.Generator, device: str,
                    per_tensor: bool = False) -> tuple[torch.Tensor, ...]:
    """(a, a_scale, w, w_scale): random rows a (N(0, 1), each row scaled by a random power of two) and w
    (scaled so that outputs stay O(1)), quantized by rosekernels.fp8: rowcol per row and channel (or per
    tensor), block 1 x 128 and 128 x 128."""
    x = torch.randn(m, k, generator=generator, device=device)
    x *= torch.exp2(torch.randint(-4, 5, (m, 1), generator=generator, device=device).float())
    y = torch.randn(n, k, generator=generator, device=device) / k ** 0.5
    if scales == "block":
        return (*fp8.quantize(x, 1, fp8.BLOCK), *fp8.quantize(y, fp8.BLOCK, fp8.BLOCK))
    rows = (None, None) if per_tensor else (1, None)
    return (*fp8.quantize(x, *rows), *fp8.quantize(y, *rows))


def _args(config: Fp8GemmConfig, m: int, n: int, k: int, seed: int) -> tuple:
    """Arguments of compile(config).fn for one problem on the current CUDA device (see random_operands), the
    output NaN-filled so that a skipped element shows, fresh split-K workspace."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a, a_scale, w, w_scale = random_operands(m, n, k, config.scales, g, "cuda", per_tensor=seed % 3 == 0)
    bias = None
    if config.bias != "none":
        bias = torch.randn(n, generator=g, device="cuda").to(checks.TORCH_DTYPE[config.bias])
    out = torch.full((m, n // 2 if config.gated else n), math.nan, dtype=checks.TORCH_DTYPE[config.dtype],
                     device="cuda")
    partials = counters = None
    if config.split_k:
        counters = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device="cuda")
        partials = torch.empty(max(4, partial_floats(config, m, n)), dtype=torch.float32, device="cuda")
    clusters = modes.max_active_clusters(torch.cuda.current_device(), config.cluster_m * config.cluster_n)
    return launch_args(config, a, a_scale, w, w_scale, bias, out, partials, counters, clusters)


def _operands(config: Fp8GemmConfig, args: tuple) -> tuple:
    """(a, a_scale, w, w_scale, bias, out) of launch_args' arguments."""
    if config.swap_ab:
        w, a, out_t, bias, *_, w_scale, a_scale = args
        return a, a_scale, w, w_scale, bias, out_t.t()
    a, w, out, bias, *_, a_scale, w_scale = args
    return a, a_scale, w, w_scale, bias, out


def _check(config: Fp8GemmConfig, args: tuple) -> float:
    a, a_scale, w, w_scale, bias, out = _operands(config, args)
    return check(out, a, a_scale, w, w_scale, bias, config.activation, config.gated, config.slope)


def workload(config: Fp8GemmConfig, shape: Fp8GemmShape) -> Workload:
    """`config`'s kernel on `shape` (make_args, with the config's K splits and raster group). test_args
    draws ragged M (m_range(config)), N and K up to 1600 (K whole 128-element groups for block scales),
    and for split-K configs the split count too: one compiled kernel serves every count."""
    workload_fits(config, shape)
    lo, hi = m_range(config)
    k_step = 128 if config.scales == "block" else 16

    def test_args(seed: int) -> tuple:
        r = random.Random(seed)
        m, n, k = r.randint(lo, hi), 16 * r.randint(1, 100), k_step * r.randint(1, 1600 // k_step)
        splits = r.randint(1, min(MAX_SPLITS, math.ceil(k / TILE_K))) if config.split_k else 1
        return _args(dataclasses.replace(config, splits=splits), m, n, k, seed)

    return Workload(compile(config), lambda seed: _args(config, shape.m, shape.n, shape.k, seed),
                    outputs=lambda args: (_operands(config, args)[-1],), check=functools.partial(_check, config),
                    test_args=test_args, name=OP)
