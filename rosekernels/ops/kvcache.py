"""attention_with_kvcache(): decode attention over a KV cache, contiguous or paged, each sequence with
its own key count held on the device (so a call never syncs and is CUDA-graph capturable).

q [B, S_q, Hq, d] (S_q 1..16: decode, speculative decoding), bf16 or fp16, d in {64, 128}, Hq a multiple
of Hkv; cache_seqlens [B] int32 on the device: sequence b attends to its first cache_seqlens[b] keys,
causal aligned bottom-right to that count (query row s sees keys < cache_seqlens[b] - S_q + 1 + s).
- Contiguous cache (block_table None): k_cache, v_cache [B, S_max, Hkv, d] (views strided along B, S and
  H work, e.g. transformers' [B, Hkv, S_max, d] static cache transposed).
- Paged cache: k_cache, v_cache [num_blocks, block_size, Hkv, d], block_table [B, max_blocks] int32; key p
  of sequence b is row p % block_size of block block_table[b, p // block_size]. block_size: any multiple
  of 16 (the kernel loads each K/V tile as boxes of gcd(block_size, tile_n) rows, each inside one page;
  tile_n is 64 keys at d = 128 and 128 at d = 64); others are refused.
Out [B, S_q, Hq, d]; lse [B, Hq, S_q] fp32, natural log; a row that sees no key (a sequence of length 0,
or causal rows before its first key) gets out 0 and lse -inf. out may be q but must not overlap the caches.
- e4m3 caches (torch.float8_e4m3fn, both; 16-byte aligned strides): the cache holds k / k_descale and
  v / v_descale (append_kvcache writes it so), k_descale and v_descale fp32 of one value or one per KV head
  ([1] or [Hkv]): the scores are (q . k_cache) * k_descale * softmax_scale and the output is times v_descale.

What the kernel does with bad device data, which eager calls cannot see without a sync: a length is
clamped to [0, capacity] (S_max, or max_blocks * block_size); a block id outside [0, num_blocks) is never
dereferenced: the keys of that block are masked (they get no weight). Table entries past a sequence's
length are never read, and cache rows past it never reach the output (whatever they hold, NaN
included). `check=True` syncs and raises on either instead (debugging).

The kernel is the split-KV decode kernel (rosekernels/kernels/attention_decode.py) with its KV-cache
variants; splits are planned for a full cache, and splits past a shorter sequence's end load nothing.
"""
from __future__ import annotations

import dataclasses

import torch

from rosekernels import checks, fp8, launch, modes, scratch
from rosekernels.kernels import attention_decode as decode
from rosekernels.kernels.attention_common import (
    MAX_INDEX, TORCH_DTYPES, OutApart, check_operand, check_out, scale_of, tma_view)
from rosekernels.kernels.attention_decode_plan import (
    MAX_SEQLEN_Q, DecodeConfig, DecodeShape, kvcache_config_for, page_rows_for, tile_n_for)
from rosekernels.kernels.attention_plan import HEAD_DIMS
from rosekernels.ops.append_kvcache import check_descales, per_head
from rosekernels.ops.attention import SplitLaunch

_plans = launch.PlanCache()


def validate_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, out, softmax_scale,
                     pointers: bool = True, k_descale=None, v_descale=None) -> float:
    """Check every argument of attention_with_kvcache before any launch, without reading device data
    (shapes first, then devices and memory layout); return the softmax scale. pointers=False (traced
    calls: no data pointers yet) checks the strides' alignment only; the compiled launch checks the
    pointers'."""
    named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens),
             ("block_table", block_table), ("out", out))
    for name, t in named:
        if t is None and name in ("block_table", "out"):
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t is not None and t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {list(t.shape)}")
    checks.check_dtype("q", q, TORCH_DTYPES)
    checks.check_dtype("k_cache", k_cache, (q.dtype, fp8.E4M3))
    checks.check_dtype("v_cache", v_cache, (k_cache.dtype,))
    if out is not None:
        checks.check_dtype("out", out, (q.dtype,))
    checks.check_dtype("cache_seqlens", cache_seqlens, (torch.int32,))
    B, S_q, Hq, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be 64 or 128, got {d}")
    if not 1 <= S_q <= MAX_SEQLEN_Q:
        raise ValueError(f"q must hold 1 to {MAX_SEQLEN_Q} query tokens per sequence (decode, speculative "
                         f"decoding), got {S_q}")
    checks.check_shape("k_cache", k_cache, (None, None, None, d))
    checks.check_shape("v_cache", v_cache, tuple(k_cache.shape))
    checks.check_shape("cache_seqlens", cache_seqlens, (B,))
    if out is not None:
        checks.check_shape("out", out, tuple(q.shape))
    blocks, rows, Hkv = k_cache.shape[:3]
    if block_table is None:
        checks.check_shape("k_cache", k_cache, (B, None, None, d))
        if rows == 0:
            raise ValueError("k_cache and v_cache must hold at least one key per sequence (S_max >= 1)")
        capacity = rows
    else:
        checks.check_dtype("block_table", block_table, (torch.int32,))
        checks.check_shape("block_table", block_table, (B, None))
        if block_table.shape[1] == 0 or blocks == 0:
            raise ValueError(f"a paged cache needs blocks and a block table with at least one column, got "
                             f"{blocks} blocks and block_table {list(block_table.shape)}")
        page_rows_for(rows, tile_n_for(d))  # raises for a block size the kernel cannot take
        capacity = rows * block_table.shape[1]
    if capacity + checks.INDEX_SLACK >= MAX_INDEX:  # the table look-ahead reads past the last tile
        raise ValueError(f"the cache holds {capacity} keys per sequence; the kernel counts keys with 32 bits")
    if B > 65535 or Hkv > 65535:
        raise ValueError(f"batch ({B}) and KV heads ({Hkv}) must each be at most 65535 (grid limits)")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the KV heads ({Hkv})")
    check_descales(k_descale, v_descale, k_cache.dtype == fp8.E4M3, Hkv)
    scale = scale_of(d, softmax_scale)
    for name, t in named:
        if t is not None:  # the int32 tables are read as scalars: no vector alignment
            check_operand(name, t, pointers, vectors=t.dtype != torch.int32)
    check_out(out, q, k_cache, v_cache, pointers, names=("k_cache", "v_cache"))
    checks.check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                             block_table=block_table, out=out, k_descale=k_descale, v_descale=v_descale)
    return scale


def check_cache_tables(cache_seqlens: torch.Tensor, block_table: torch.Tensor | None, capacity: int,
                       num_blocks: int) -> None:
    """Raise ValueError unless every length is in [0, capacity] and every block id a sequence's keys
    use is in [0, num_blocks). Reads the device tensors: a sync (attention_with_kvcache(check=True))."""
    lengths = cache_seqlens.cpu()
    wrong = ((lengths < 0) | (lengths > capacity)).nonzero()
    if len(wrong):
        b = int(wrong[0])
        raise ValueError(f"cache_seqlens[{b}] = {int(lengths[b])} is outside [0, {capacity}] (the keys the cache "
                         "holds per sequence)")
    if block_table is None:
        return
    table = block_table.cpu()
    block_size = capacity // table.shape[1]
    used = torch.arange(table.shape[1])[None, :] < ((lengths + block_size - 1) // block_size)[:, None]
    wrong = (used & ((table < 0) | (table >= num_blocks))).nonzero()
    if len(wrong):
        b, j = (int(i) for i in wrong[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(table[b, j])} is outside [0, {num_blocks}) and holds keys of "
                         f"sequence {b} (length {int(lengths[b])})")


# ---------------------------------------------------------------------------------------------
# The launch: the split-KV kernel's KV-cache variants.


def _unit_strides(t: torch.Tensor) -> torch.Tensor:
    """An int32 index tensor whose last stride is 1 (size-1 dims: any stride, which never addresses
    memory) as the kernel's compiled layout wants it."""
    if t.dim() and t.shape[-1] == 1 and t.stride(-1) != 1:
        return t.as_strided(t.shape, (*t.stride()[:-1], 1))
    return t


class KVCacheLaunch(SplitLaunch):
    """One launch of a KV-cache config (`varlen`) planned for an argument signature (validated
    arguments, B >= 1): split count for the cache's capacity, loaded kernel, views and scalars fixed
    up front."""

    def __init__(self, cfg: DecodeConfig, shape: DecodeShape, q, k_cache, v_cache, out, cache_seqlens, block_table,
                 scale: float, private_scratch: bool = False):
        super().__init__(cfg, shape, (q, k_cache, v_cache, out), scale, private_scratch)
        self.int_views = any(_unit_strides(t) is not t for t in (cache_seqlens, block_table) if t is not None)
        # A contiguous cache reads no table: any int32 [*, 1] stands in.
        self.no_table = None if cfg.paged else scratch.unread_float32(self.device).view(torch.int32)[:1].view(1, 1)
        self.causal_offset = -shape.seqlen_q if shape.causal else 0  # row s sees keys < len - S_q + 1 + s
        self.kv_heads = shape.heads_kv

    def launch(self, q, k_cache, v_cache, out, lse, cache_seqlens, block_table, k_descale=None,
               v_descale=None) -> None:
        if self.views:
            q, k_cache, v_cache, out = (tma_view(t) for t in (q, k_cache, v_cache, out))
        if self.no_table is not None:
            block_table = self.no_table
        if self.int_views:
            cache_seqlens, block_table = _unit_strides(cache_seqlens), _unit_strides(block_table)
        descales = decode.NOT_FP8
        if self.cfg.kv_fp8:
            descales = (per_head(k_descale, self.kv_heads), per_head(v_descale, self.kv_heads))
        launch.on_device(self.device, self.fn, q, k_cache, v_cache, out, lse, *self.workspace(), cache_seqlens,
                         block_table, self.scale_log2, self.causal_offset, self.num_splits, self.per, *descales)


def plan_kvcache(q, k_cache, v_cache, out, cache_seqlens, block_table, causal: bool, scale: float,
                 splits: int | None = None, private_scratch: bool = False, enable_pdl: bool = True,
                 **fields) -> KVCacheLaunch:
    """The launch of validated attention_with_kvcache arguments (B >= 1) with kvcache_config_for's
    config, planned for a full cache (S_max, or max_blocks * block_size keys per sequence);
    `splits` forces the number of KV chunks, `fields` other fields of the config (tests and benchmarks
    of variants the plan does not take: num_stages, widen_warps)."""
    shape = DecodeShape.of_cache(q, k_cache, block_table, causal, enable_pdl)
    block_size = None if block_table is None else k_cache.shape[1]
    cfg = kvcache_config_for(shape, block_size, modes.sm_count(q.device.index), k_cache.dtype == fp8.E4M3)
    if splits is not None:
        cfg = dataclasses.replace(cfg, splits=splits)
    cfg = dataclasses.replace(cfg, **fields)
    return KVCacheLaunch(cfg, shape, q, k_cache, v_cache, out, cache_seqlens, block_table, scale, private_scratch)


def _attention_with_kvcache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               cache_seqlens: torch.Tensor, block_table: torch.Tensor | None, out: torch.Tensor,
                               lse: torch.Tensor, causal: bool, softmax_scale: float, enable_pdl: bool = True,
                               k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None) -> None:
    """The registered op (torch.compile, tensor subclasses): validated arguments, B >= 1, TMA views."""
    plan_kvcache(q, k_cache, v_cache, out, cache_seqlens, block_table, causal, softmax_scale,
                 private_scratch=True, enable_pdl=enable_pdl).launch(
        q, k_cache, v_cache, out, lse, cache_seqlens, block_table, k_descale, v_descale)


launch.register_op("attention_with_kvcache", _attention_with_kvcache_op, mutates_args=("out", "lse"))


def _new_plan(q, k_cache, v_cache, cache_seqlens, block_table, out, causal: bool, softmax_scale,
              enable_pdl: bool, k_descale, v_descale) -> launch.Launch:
    """The slow path, once per argument signature: every check, then the kernel's plan."""
    scale = validate_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, out, softmax_scale, True, k_descale,
                             v_descale)
    if not q.numel():
        return launch.nothing(q.device.index)
    plan = plan_kvcache(q, k_cache, v_cache, out, cache_seqlens, block_table, causal, scale, enable_pdl=enable_pdl)
    return plan if out is None else OutApart(plan, out, q, k_cache, v_cache, names=("k_cache", "v_cache"))


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                           softmax_scale: float | None = None, causal: bool = True, out: torch.Tensor | None = None,
                           return_lse: bool = False, check: bool = False, enable_pdl: bool = True,
                           k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None):
    """softmax(q k^T * softmax_scale [causal, bottom-right per sequence]) v over each sequence's first
    cache_seqlens[b] cached keys; see the module docstring for the layouts.

    Returns out [B, S_q, Hq, d], or (out, lse [B, Hq, S_q] fp32) with return_lse. Nothing syncs: the
    lengths and the block table are read on the device (shapes, dtypes, devices and layouts are checked
    on the host once per argument signature; what they hold is not, see the module docstring);
    check=True reads them first and raises on a length outside the cache or a block id out of range
    that a sequence uses (a sync per call: debugging). Eager calls on plain tensors skip the torch
    dispatcher; under torch.compile the kernel runs through the op rosekernels::attention_with_kvcache.
    enable_pdl: launch with programmatic dependent launch (as attention's). k_descale, v_descale: an e4m3
    cache's (module docstring).
    """
    causal, enable_pdl = bool(causal), bool(enable_pdl)
    eager = launch.eager(q, k_cache, v_cache, cache_seqlens, block_table, out)
    if eager:
        # The plan's signature, written out: a generic builder (a loop over the arguments) costs ~1 us more.
        key = (q.shape, q.stride(), q.dtype, q.get_device(), k_cache.shape, k_cache.stride(), k_cache.dtype,
               k_cache.get_device(), v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.get_device(),
               cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.get_device(),
               None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype,
                                                 block_table.get_device()),
               None if out is None else (out.shape, out.stride(), out.dtype, out.get_device()), causal, softmax_scale,
               enable_pdl, None if k_descale is None else (k_descale.shape, k_descale.dtype, k_descale.get_device()),
               None if v_descale is None else (v_descale.shape, v_descale.dtype, v_descale.get_device()))
        plan = _plans.get(key)
        # A cached plan still needs 16-byte aligned pointers (if not, the full checks say which is not).
        if plan is None or (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()
                            | (0 if out is None else out.data_ptr())) % 16:
            plan = _plans.put(key, _new_plan(q, k_cache, v_cache, cache_seqlens, block_table, out, causal,
                                             softmax_scale, enable_pdl, k_descale, v_descale))
    else:
        scale = validate_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, out, softmax_scale, False,
                                 k_descale, v_descale)
    if check:
        if not eager:
            raise ValueError("check=True reads the lengths and the block table on the host: eager calls only")
        pages = 1 if block_table is None else block_table.shape[1]
        check_cache_tables(cache_seqlens, block_table, k_cache.shape[1] * pages, k_cache.shape[0])
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    if eager:
        plan.launch(q, k_cache, v_cache, out, lse, cache_seqlens, block_table, k_descale, v_descale)
    elif q.numel():
        torch.ops.rosekernels.attention_with_kvcache(*(tma_view(t) for t in (q, k_cache, v_cache)), cache_seqlens,
                                                     block_table, tma_view(out), lse, causal, scale, enable_pdl,
                                                     k_descale, v_descale)
    return (out, lse) if return_lse else out
