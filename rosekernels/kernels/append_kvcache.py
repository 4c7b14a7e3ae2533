"""The kernel of append_kvcache(): write a step's new keys and values into a KV cache, contiguous or
paged, at each sequence's own position (held on the device), in one launch and without a sync: the
companion of attention_with_kvcache.

k, v [B, S_new, Hkv, d]; token i of sequence b goes to position p = cache_seqlens[b] + i: row p % block_size
of block block_table[b, p // block_size] (paged: k_cache, v_cache [num_blocks, block_size, Hkv, d],
block_table [B, max_blocks] int32), or row p of sequence b (contiguous: [B, S_max, Hkv, d], strided views
such as transformers' transposed static cache included). cache_seqlens is not advanced: the caller adds
S_new once the step's attention has run (attention_with_kvcache takes the lengths with the new tokens).

An e4m3 cache (`fp8` configs) takes new tokens of any float dtype, each element stored as
e4m3(x / descale) (saturating) with the descale of its KV head: k_descale and v_descale [Hkv] fp32 (one
value for all heads: a stride-0 view), what attention_with_kvcache multiplies the cache by.

A token whose position falls outside the cache (negative, past S_max or past the table) or whose block id
is outside [0, num_blocks) is not written: nothing outside the cache (nor outside the table) is ever
touched, whatever the lengths and the table hold. Two tokens that the tables send to the same row (two
sequences sharing a block) leave that row unspecified: each 16-byte piece of its k and v comes from
one of them.

Design: one thread per 128-bit vector of a (sequence, token, head) row, the same vector of k and of v
(both loaded before either store). The thread reads its sequence's length and, paged, the one table
entry of its position when that column lies inside the table, then stores only when the row lies
inside the cache. dtype, head dim and the layout are compiled in; every count,
length and stride is a runtime value. The config and its choice live in append_kvcache_plan, the op
(argument checks, launch plans, eager and traced calls) in rosekernels/ops/append_kvcache.py.
"""
from __future__ import annotations

import random
from typing import Callable

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from rosekernels import checks, jit
from rosekernels.fp8 import E4M3_MAX
from rosekernels.kernels.append_kvcache_plan import (  # noqa: F401  (the plan's names are the kernel's: the contract)
    DECODE_MAX_TOKENS, OP, TORCH_DTYPE, AppendConfig, AppendShape, candidates, config_for, rank, variants_for)
from rosekernels.vector_copy import vec_load, vec_store
from rosekernels.workload import Workload

Config, Shape = AppendConfig, AppendShape


# ---------------------------------------------------------------------------------------------
# The kernel.

class AppendKernel:
    def __init__(self, cfg: AppendConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mKC: cute.Tensor, mVC: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mLens: cute.Tensor,
                 mTable: cute.Tensor, stream, mKDescale=None, mVDescale=None):
        c = self.cfg
        vectors = mK.shape[0] * mK.shape[1] * mK.shape[2] * (c.head_dim // c.vec)
        self.kernel(mKC, mVC, mK, mV, mLens, mTable, mKDescale, mVDescale).launch(
            grid=[cute.ceil_div(vectors, c.threads), 1, 1], block=[c.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mKC: cute.Tensor, mVC: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mLens: cute.Tensor,
               mTable: cute.Tensor, mKDescale, mVDescale):
        c = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        batch, new_tokens, heads = mK.shape[0], mK.shape[1], mK.shape[2]
        per_row = c.head_dim // c.vec
        i = bidx * c.threads + tidx
        if i < batch * new_tokens * heads * per_row:
            row = i // per_row
            v = i - row * per_row
            h = row % heads
            token = row // heads
            s = token % new_tokens
            b = token // new_tokens
            pos = mLens[b] + s
            inside = pos >= 0
            first, second = b, pos
            if cutlass.const_expr(c.paged):
                block_size, max_blocks = mKC.shape[1], mTable.shape[1]
                p = cutlass.max(pos, Int32(0))
                column = p // block_size
                inside = inside & (column < max_blocks)
                block = Int32(-1)
                if inside:  # a table of no columns passes the compiled checks: read nothing then
                    block = mTable[b, column]
                inside = inside & (block >= 0) & (block < mKC.shape[0])
                first, second = block, p - column * block_size
            else:
                inside = inside & (pos < mKC.shape[1])
            if inside:
                k = vec_load(cute.zipped_divide(mK[b, s, h, None], (c.vec,))[None, v])
                vv = vec_load(cute.zipped_divide(mV[b, s, h, None], (c.vec,))[None, v])
                if cutlass.const_expr(c.fp8):  # a vector of vec e4m3 elements
                    k, vv = _e4m3(k, mKDescale[h]), _e4m3(vv, mVDescale[h])
                bits = 8 * c.vec if cutlass.const_expr(c.fp8) else 128
                vec_store(k, cute.zipped_divide(mKC[first, second, h, None], (c.vec,))[None, v], bits=bits)
                vec_store(vv, cute.zipped_divide(mVC[first, second, h, None], (c.vec,))[None, v], bits=bits)


@cute.jit
def _e4m3(x: cute.Tensor, descale: Float32) -> cute.Tensor:
    """e4m3(x / descale) of a register vector, saturating (the reciprocal correctly rounded, as torch's)."""
    q = cute.make_rmem_tensor(x.shape, cutlass.Float8E4M3FN)
    q.store((x.load().to(Float32) * (Float32(1.0) / descale)).to(cutlass.Float8E4M3FN))
    return q


def _build(cfg: AppendConfig) -> Callable[[], tuple]:
    def build():
        dt = checks.cute_dtype(cfg.dtype)
        batch, heads = cute.sym_int32(), cute.sym_int32()

        def rows(n0, n1) -> cute.Tensor:  # [n0, n1, heads, d], any 16-byte-aligned strides but the last
            strides = tuple(cute.sym_int64(divisibility=cfg.vec) for _ in range(3)) + (1,)
            return cute.runtime.make_fake_tensor(dt, (n0, n1, heads, cfg.head_dim), strides, assumed_align=16)

        def cache(n0, n1) -> cute.Tensor:  # e4m3 rows of an fp8 cache: 16-byte aligned strides
            if not cfg.fp8:
                return rows(n0, n1)
            strides = tuple(cute.sym_int64(divisibility=16) for _ in range(3)) + (1,)
            return cute.runtime.make_fake_tensor(cutlass.Float8E4M3FN, (n0, n1, heads, cfg.head_dim), strides,
                                                 assumed_align=16)

        cache_rows, cache_cols, new_tokens = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        lens = cute.runtime.make_fake_tensor(cutlass.Int32, (batch,), (cute.sym_int64(),), assumed_align=4)
        # Paged: one row per sequence (the host code checks it on every call); contiguous: a placeholder.
        table = cute.runtime.make_fake_tensor(cutlass.Int32, (batch if cfg.paged else cute.sym_int32(), cute.sym_int32()),
                                              (cute.sym_int64(), cute.sym_int64()), assumed_align=4)
        descales = ()
        if cfg.fp8:  # [Hkv] each, stride 0 for one value for every head
            descales = tuple(cute.runtime.make_fake_tensor(Float32, (heads,), (cute.sym_int64(),), assumed_align=4)
                             for _ in range(2))
        args = (cache(cache_rows, cache_cols), cache(cache_rows, cache_cols), rows(batch, new_tokens),
                rows(batch, new_tokens), lens, table, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                *descales)
        return AppendKernel(cfg), args
    return build


# What an append into a bf16 / fp16 cache passes for (k_descale, v_descale): nothing, compiled in as such.
# The compiled function takes every parameter of __call__, those left at their defaults included.
NOT_FP8 = (None, None)


def compile(config: AppendConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config`; call `.fn(k_cache, v_cache, k, v, cache_seqlens, block_table,
    k_descale, v_descale)` (contiguous: `unread_table(device)`; the descales [Hkv] fp32 for fp8 configs,
    NOT_FP8 for others)."""
    return jit.compile_variant(config.variant(), _build(config))


def precompile(configs=None, processes: int | None = None) -> list[jit.CompiledKernel]:
    """compile() of each config (default: variants_for()), the cold ones first compiled in parallel
    processes into the disk cache (jit.precompile)."""
    return jit.precompile(compile, variants_for() if configs is None else configs, processes)


def unread_table(device) -> torch.Tensor:
    """The block_table argument of a contiguous-cache kernel, which never reads it."""
    return torch.zeros(1, 1, dtype=torch.int32, device=device)


# ---------------------------------------------------------------------------------------------
# The reference, and inputs for a config (tests, SIP tuner).

def quantized(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, d] as an e4m3 cache holds it: e4m3(x * (1 / descale[head])) in fp32 (the kernel's math, bit
    for bit: a correctly rounded reciprocal and product, round to nearest even, saturating at +-448, NaN kept).

    The clamp saturates here, not torch's cast: before pytorch#178817 (in 2.13, not in 2.11) that cast gives NaN
    (0x7f) from 464 on, the CPU's and the GPU's alike, where the kernel's cvt.rn.satfinite gives 448. Within
    +-448 every version rounds to nearest even, as the kernel does."""
    inv = 1.0 / descale.float().reshape(-1).expand(x.shape[-2])
    return (x.float() * inv[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def reference(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale=None, v_descale=None):
    """The caches after the append, one token at a time in Python on the host (skipped tokens skipped);
    e4m3 caches get the tokens `quantized` with the descales."""
    k_cache, v_cache = k_cache.cpu().clone(), v_cache.cpu().clone()
    k, v, lengths = k.cpu(), v.cpu(), cache_seqlens.cpu()
    if k_descale is not None:
        k, v = quantized(k, k_descale.cpu()), quantized(v, v_descale.cpu())
    table = None if block_table is None else block_table.cpu()
    B, S_new = k.shape[:2]
    for b in range(B):
        for i in range(S_new):
            p = int(lengths[b]) + i
            if table is None:
                if 0 <= p < k_cache.shape[1]:
                    k_cache[b, p], v_cache[b, p] = k[b, i], v[b, i]
                continue
            column = p // k_cache.shape[1] if p >= 0 else -1
            if not 0 <= column < table.shape[1]:
                continue
            block = int(table[b, column])
            if 0 <= block < k_cache.shape[0]:
                k_cache[block, p % k_cache.shape[1]], v_cache[block, p % k_cache.shape[1]] = k[b, i], v[b, i]
    return k_cache, v_cache


def random_case(g: torch.Generator, batch: int, new_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                paged: bool, block_size: int = 16, max_blocks: int = 5, device: str = "cuda", fp8: bool = False) -> tuple:
    """(k_cache, v_cache, k, v, cache_seqlens, block_table) drawn from `g`: paged, blocks in random order
    with garbage ids (-1, num_blocks, 2^31 - 1) in a fifth of the table; lengths from -2 to past the
    cache, so that some tokens are skipped. fp8: e4m3 caches, and (k_descale, v_descale) after them: one per
    KV head, some small enough that the quantized tokens saturate."""
    rows = max_blocks * block_size
    num_blocks = batch * max_blocks + 3
    if paged:
        cache_shape = (num_blocks, block_size, kv_heads, head_dim)
        order = torch.randperm(num_blocks, generator=g)[:batch * max_blocks].view(batch, max_blocks).to(torch.int32)
        garbage = torch.tensor([-1, num_blocks, 2**31 - 1], dtype=torch.int32)[
            torch.randint(0, 3, (batch, max_blocks), generator=g)]
        table = torch.where(torch.rand(batch, max_blocks, generator=g) < 0.2, garbage, order).to(device)
    else:
        cache_shape, table = (batch, rows, kv_heads, head_dim), None
    caches = [torch.randn(*cache_shape, generator=g).to(torch.float8_e4m3fn if fp8 else dtype).to(device)
              for _ in range(2)]
    k, v = (torch.randn(batch, new_tokens, kv_heads, head_dim, generator=g).to(dtype).to(device) for _ in range(2))
    lengths = torch.randint(-2, rows + 3, (batch,), generator=g, dtype=torch.int32).to(device)
    if not fp8:
        return (*caches, k, v, lengths, table)
    descales = [(torch.rand(kv_heads, generator=g) * 0.02 + 2.0 ** -9).to(device) for _ in range(2)]
    return (*caches, k, v, lengths, table, *descales)


def workload(config: AppendConfig, shape: AppendShape) -> Workload:
    """`compile(config)` with its inputs: make_args(seed) at `shape`, test_args(seed) at random sizes of
    config's mode. args are compile's six arguments followed by the reference caches (computed from the
    caches before any launch; an append is idempotent, so they hold after any number of launches); the
    caches are the outputs, and check compares every byte of them with the reference."""
    if (shape.dtype, shape.head_dim, shape.paged, shape.mode, shape.fp8) != (config.dtype, config.head_dim,
                                                                              config.paged, config.mode, config.fp8):
        raise ValueError(f"{config} does not serve {shape}: dtype, head dim, layout, mode and cache dtype must match")
    lo, hi = (1, DECODE_MAX_TOKENS) if config.mode == "decode" else (DECODE_MAX_TOKENS + 1, 300)
    dt = TORCH_DTYPE[config.dtype]

    launched = 8  # compile's arguments, the descales (NOT_FP8 for a bf16 / fp16 cache) included

    def args(batch: int, new_tokens: int, kv_heads: int, seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        max_blocks = -(-(new_tokens + 40) // 16)
        case = random_case(g, batch, new_tokens, kv_heads, config.head_dim, dt, config.paged, 16, max_blocks,
                           fp8=config.fp8)
        table = case[5] if config.paged else unread_table("cuda")
        return (*case[:5], table, *(case[6:] or NOT_FP8), *reference(*case))

    def check(a: tuple) -> float:
        for name, got, want in (("k_cache", a[0], a[launched]), ("v_cache", a[1], a[launched + 1])):
            if not torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)):
                raise AssertionError(f"{name}: a written row differs from the reference, or another row changed")
        return 0.0

    def test_args(seed: int) -> tuple:
        r = random.Random(seed)
        return args(r.randint(1, 40 if config.mode == "decode" else 3), r.randint(lo, hi), r.randint(1, 8), seed)

    return Workload(compile(config), lambda seed: args(shape.batch, shape.new_tokens, shape.kv_heads, seed),
                    outputs=lambda a: a[:2], check=check, test_args=test_args, launch=lambda fn, a: fn(*a[:launched]),
                    name=OP)
