"""append_kvcache(): write a step's new keys and values into a KV cache, contiguous or paged, at each
sequence's own position (held on the device), without a sync: the companion of attention_with_kvcache.

k, v [B, S_new, Hkv, d]; token i of sequence b goes to position cache_seqlens[b] + i: row p % block_size
of block block_table[b, p // block_size] (paged: k_cache, v_cache [num_blocks, block_size, Hkv, d],
block_table [B, max_blocks] int32), or row p of sequence b (contiguous: [B, S_max, Hkv, d], strided views
such as transformers' transposed static cache included). cache_seqlens is not advanced: the caller adds
S_new once the step's attention has run (attention_with_kvcache takes the lengths with the new tokens).

A token whose position falls outside the cache (negative, past S_max or past the table) or whose block id
is outside [0, num_blocks) is not written: nothing outside the cache is ever touched, whatever the
lengths and the table hold. Two tokens that the tables send to the same row (two sequences sharing a
block) leave that row's contents unspecified (on the GPU, possibly a mix of both).

Plain torch (index_put_ on the cache's own strides, about ten small launches): no kernel to compile, and
it runs in CUDA graphs and under torch.compile as is. A skipped token still needs an index (index_put_
cannot skip one without a sync): it rewrites the row and the value of a written token of the same call
(or, when no token is written, the cache's first row with its own value), so every duplicate index
carries the same value and the result does not depend on their order.
"""
from __future__ import annotations

import torch

from rosekernels import checks

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def validate_append(k_cache, v_cache, k, v, cache_seqlens, block_table) -> None:
    """Check every argument of append_kvcache without reading device data."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("cache_seqlens", cache_seqlens),
                    ("block_table", block_table)):
        if t is None and name == "block_table":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {list(t.shape)}")
    checks.check_dtype("k_cache", k_cache, DTYPES)
    for name, t in (("v_cache", v_cache), ("k", k), ("v", v)):
        checks.check_dtype(name, t, (k_cache.dtype,))
    checks.check_dtype("cache_seqlens", cache_seqlens, (torch.int32,))
    B, _, Hkv, d = k.shape
    checks.check_shape("v", v, tuple(k.shape))
    checks.check_shape("k_cache", k_cache, (None, None, Hkv, d))
    checks.check_shape("v_cache", v_cache, tuple(k_cache.shape))
    checks.check_shape("cache_seqlens", cache_seqlens, (B,))
    if block_table is None:
        checks.check_shape("k_cache", k_cache, (B, None, Hkv, d))
    else:
        checks.check_dtype("block_table", block_table, (torch.int32,))
        checks.check_shape("block_table", block_table, (B, None))
        if block_table.shape[1] == 0 and k.numel():
            raise ValueError("block_table must have at least one column")
    if k_cache.shape[0] * k_cache.shape[1] == 0 and k.numel():
        raise ValueError(f"the cache holds no rows: k_cache {list(k_cache.shape)}")
    checks.check_same_device(k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                             block_table=block_table)


def cache_rows(cache_seqlens: torch.Tensor, block_table: torch.Tensor | None, new_tokens: int,
               cache_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first index, second index, written) [B * new_tokens] of each new token's row in a cache of
    `cache_shape` (paged: block and row in it; contiguous: sequence and position), `written` false where
    the position or the block falls outside the cache (those indices are clamped, not meaningful)."""
    device = cache_seqlens.device
    B = cache_seqlens.shape[0]
    pos = cache_seqlens.long()[:, None] + torch.arange(new_tokens, device=device)
    if block_table is None:
        written = (pos >= 0) & (pos < cache_shape[1])
        first = torch.arange(B, device=device)[:, None].expand(B, new_tokens)
        second = pos.clamp(0, cache_shape[1] - 1)
    else:
        block_size, max_blocks = cache_shape[1], block_table.shape[1]
        column = torch.div(pos, block_size, rounding_mode="floor")
        inside = (pos >= 0) & (column < max_blocks)
        block = block_table.long().gather(1, column.clamp(0, max_blocks - 1))
        written = inside & (block >= 0) & (block < cache_shape[0])
        first = block.clamp(0, cache_shape[0] - 1)
        second = pos.remainder(block_size)
    return first.reshape(-1), second.reshape(-1), written.reshape(-1)


def append_kvcache(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None) -> None:
    """Write k, v [B, S_new, Hkv, d] into k_cache, v_cache at positions cache_seqlens[b] + i (in place;
    see the module docstring for the layouts and what is skipped). Nothing syncs; cache_seqlens is not
    changed."""
    validate_append(k_cache, v_cache, k, v, cache_seqlens, block_table)
    B, S_new, Hkv, d = k.shape
    if not k.numel():
        return
    first, second, written = cache_rows(cache_seqlens, block_table, S_new, k_cache.shape)
    # A skipped token takes the row and value of a written one (the first, if any), so duplicate indices
    # agree; with no written token, row (0, 0) gets its own value back.
    # (Indexed with a one-element tensor, not a 0-d one: torch.compile would read it as a Python int.)
    j = written.int().argmax().reshape(1)
    some = written.index_select(0, j)
    first = torch.where(written, first, torch.where(some, first.index_select(0, j), 0))
    second = torch.where(written, second, torch.where(some, second.index_select(0, j), 0))
    for cache, new in ((k_cache, k), (v_cache, v)):
        rows = new.reshape(B * S_new, Hkv, d)
        fill = torch.where(some[:, None, None], rows.index_select(0, j), cache[0, 0][None])
        cache.index_put_((first, second), torch.where(written[:, None, None], rows, fill))
