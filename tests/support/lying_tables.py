"""KV-cache calls whose block tables and lengths lie: block ids past the cache, negative and at the int32
extremes among a sequence's own pages; lengths negative, past the table's (or the cache's) capacity
and at the int32 extremes. What the ops promise for them (rosekernels/ops/kvcache.py and
rosekernels/kernels/append_kvcache.py): nothing outside the caches is read or written. attention_with_kvcache
clamps each length to [0, capacity] and gives the keys of a page whose id is out of range no weight;
append_kvcache skips a token whose row is not in the cache. `fp8`: the same lies on e4m3 caches with a
descale per KV head (attention reads them dequantized, append quantizes into them).

The GPU tests put the caches between canary pages of the same allocation (NaN for attention: a read
that reached the output shows; random bits for append: they must stay); run as a script, each
tensor its own allocation, for compute-sanitizer memcheck (tests/test_sanitizer_gpu.py)."""
import math

import torch

import rosekernels
from attention_reference import check
from rosekernels.kernels.append_kvcache import reference as append_reference

BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 16, 6, 64  # pages enough for every sequence to have its own
CAPACITY = BLOCK_SIZE * MAX_BLOCKS
LIES = (-1, -2**31, 2**31 - 1)  # and NUM_BLOCKS, the first id past the cache
LENGTHS = (-2**31, -1, 0, 1, CAPACITY + 1, 2**31 - 1, CAPACITY, 50, 77, 33)
E4M3 = torch.float8_e4m3fn


def descales(g: torch.Generator, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_descale, v_descale) [heads] fp32 on the GPU: powers of two, so the dequantized cache is exact."""
    return tuple(torch.exp2(torch.randint(-4, 2, (heads,), generator=g).float()).cuda() for _ in "kv")


def lying_table(g: torch.Generator, batch: int, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """[batch, MAX_BLOCKS] int32 (CPU): distinct pages in random order, about a third of the entries
    (in use or not) replaced by an id outside [0, num_blocks)."""
    pages = torch.randperm(num_blocks, generator=g)[:batch * MAX_BLOCKS].view(batch, MAX_BLOCKS).to(torch.int32)
    lies = torch.tensor([*LIES, num_blocks], dtype=torch.int32)[torch.randint(0, 4, pages.shape, generator=g)]
    table = torch.where(torch.rand(pages.shape, generator=g) < 0.35, lies, pages)
    table[-1, :3] = lies[-1, :3]  # every page of the last sequence (33 keys) lies: it sees no key
    return table


def cache_storage(shape, dtype, canaries: int, fill: float | None, g: torch.Generator):
    """(storage, cache): the cache [n0, n1, H, d] random, inside `storage`, which has `canaries` more
    entries of dims 0 and 1 on each side, holding `fill` (random when None)."""
    big = (shape[0] + 2 * canaries, shape[1] + 2 * canaries, *shape[2:])
    storage = (torch.randn(*big, generator=g) if fill is None else torch.full(big, fill)).to(dtype).cuda()
    cache = storage[canaries:canaries + shape[0], canaries:canaries + shape[1]]
    cache.copy_(torch.randn(*shape, generator=g).to(dtype))
    return storage, cache


def attention_lies(paged: bool, head_dim: int, dtype: torch.dtype, seed: int, canaries: int = 0,
                   fp8: bool = False) -> None:
    """attention_with_kvcache on LENGTHS and, paged, lying_table: out and lse must be those of each
    sequence's clamped length over the keys of its valid pages (non-causal, S_q = 2), the canary
    pages (NaN) unread, nothing written to the caches."""
    g = torch.Generator().manual_seed(seed)
    batch, hkv = len(LENGTHS), 2
    rows = (NUM_BLOCKS, BLOCK_SIZE) if paged else (batch, CAPACITY)
    cache_dtype = E4M3 if fp8 else dtype  # e4m3's NaN (0x7f) is as loud a canary as bf16's
    k_store, k_cache = cache_storage((*rows, hkv, head_dim), cache_dtype, canaries, math.nan, g)
    v_store, v_cache = cache_storage((*rows, hkv, head_dim), cache_dtype, canaries, math.nan, g)
    k_descale, v_descale = descales(g, hkv) if fp8 else (None, None)
    before = (k_store.clone(), v_store.clone())
    table = lying_table(g, batch) if paged else None
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    q = torch.randn(batch, 2, 4 * hkv, head_dim, generator=g).to(dtype).cuda()
    scale = head_dim ** -0.5
    out, lse = rosekernels.attention_with_kvcache(q, k_cache, v_cache, lengths.cuda(),
                                                  None if table is None else table.cuda(), softmax_scale=scale,
                                                  causal=False, return_lse=True, k_descale=k_descale, v_descale=v_descale)
    torch.cuda.synchronize()
    for b, n in enumerate(LENGTHS):
        pos = torch.arange(max(0, min(n, CAPACITY)))
        if paged:
            ids = table[b].long()[pos // BLOCK_SIZE]
            valid = (ids >= 0) & (ids < NUM_BLOCKS)
            at = (ids[valid].cuda(), (pos % BLOCK_SIZE)[valid].cuda())
        else:
            at = (torch.full_like(pos, b).cuda(), pos.cuda())
        k, v = k_cache[at][None], v_cache[at][None]
        if fp8:
            k, v = ((c.float() * d.view(1, 1, hkv, 1)).to(dtype) for c, d in ((k, k_descale), (v, v_descale)))
        check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k, v, False, scale,
              f"seed {seed}: sequence {b}, length {n}, {len(k[0])} valid keys, paged={paged}")
    assert (lse[-1] == -math.inf).all() or not paged, "the sequence with no valid page saw a key"
    for store, old in zip((k_store, v_store), before):
        assert torch.equal(store.view(torch.uint8), old.view(torch.uint8)), f"seed {seed}: attention wrote a cache"


def append_lies(paged: bool, seed: int, dtype: torch.dtype = torch.bfloat16, canaries: int = 0,
                fp8: bool = False) -> None:
    """append_kvcache of 3 new tokens per sequence at LENGTHS and, paged, lying_table: the caches must
    equal the per-token reference (a token whose row lies outside the cache skipped) and every canary
    byte (random bits around the caches) stay."""
    g = torch.Generator().manual_seed(seed)
    batch, hkv, d = len(LENGTHS), 2, 64
    rows = (NUM_BLOCKS, BLOCK_SIZE) if paged else (batch, CAPACITY)
    cache_dtype = E4M3 if fp8 else dtype
    k_store, k_cache = cache_storage((*rows, hkv, d), cache_dtype, canaries, None, g)
    v_store, v_cache = cache_storage((*rows, hkv, d), cache_dtype, canaries, None, g)
    scales = descales(g, hkv) if fp8 else ()
    table = lying_table(g, batch).cuda() if paged else None
    k, v = (torch.randn(batch, 3, hkv, d, generator=g).to(dtype).cuda() for _ in "kv")
    lengths = torch.tensor(LENGTHS, dtype=torch.int32).cuda()
    want = append_reference(k_cache, v_cache, k, v, lengths, table, *scales)
    stores = (k_store.clone(), v_store.clone())
    rosekernels.append_kvcache(k_cache, v_cache, k, v, lengths, table, *scales)
    for got, ref, store, old in zip((k_cache, v_cache), want, (k_store, v_store), stores):
        assert torch.equal(got.cpu().view(torch.uint8), ref.view(torch.uint8)), f"seed {seed}: a row differs"
        got.copy_(old[canaries:canaries + rows[0], canaries:canaries + rows[1]])  # the canaries alone may differ now
        assert torch.equal(store.view(torch.uint8), old.view(torch.uint8)), f"seed {seed}: a write left the cache"


def main() -> None:
    for paged in (True, False):
        attention_lies(paged, 128, torch.bfloat16, seed=1)
        append_lies(paged, seed=2)
    attention_lies(True, 64, torch.float16, seed=3)
    attention_lies(True, 128, torch.bfloat16, seed=4, fp8=True)
    append_lies(True, seed=5, fp8=True)
    torch.cuda.synchronize()
    print("lying tables ran")


if __name__ == "__main__":
    main()
