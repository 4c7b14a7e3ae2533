"""append_kvcache(): a step's new keys and values into a KV cache at each sequence's length (the kernel,
its layouts and what it skips: rosekernels/kernels/append_kvcache.py).

validate -> config (append_kvcache_plan.config_for, or the tuned store's) -> compile -> plan -> launch:
the first call with an argument signature does all of it; later ones test the caches' addresses for overlaps
and launch.
"""
from __future__ import annotations

import torch

from rosekernels import checks, fp8, launch, modes, tuned
from rosekernels.kernels import append_kvcache as kernel
from rosekernels.kernels.append_kvcache_plan import DTYPES, HEAD_DIMS, OP, AppendShape, config_for


# ---------------------------------------------------------------------------------------------
# Argument checks (the slow path: first call per signature, and after any launch failure).

def check_descales(k_descale, v_descale, fp8_cache: bool, kv_heads: int) -> None:
    """An e4m3 cache's descales: fp32, one value or one per KV head ([1] or [Hkv]); none for another cache."""
    if not fp8_cache:
        if k_descale is not None or v_descale is not None:
            raise ValueError("k_descale and v_descale are for e4m3 (float8_e4m3fn) caches")
        return
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"an e4m3 cache needs {name}: a float32 tensor of 1 or {kv_heads} (KV heads) values")
        checks.check_dtype(name, t, (torch.float32,))
        if t.dim() > 1 or t.numel() not in (1, kv_heads):
            raise ValueError(f"{name} has shape {list(t.shape)}; expected [1] (per tensor) or [{kv_heads}] (per KV head)")


def per_head(descale: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A checked descale as the kernels read it: [Hkv], one value broadcast with stride 0."""
    return descale.reshape(-1).expand(kv_heads)


def _validate(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale=None, v_descale=None) -> None:
    named = dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table)
    for name, t in named.items():
        if not (t is None and name == "block_table") and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name in ("k_cache", "v_cache", "k", "v"):
        if named[name].dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {list(named[name].shape)}")
    checks.check_dtype("k_cache", k_cache, (*DTYPES, fp8.E4M3))
    fp8_cache = k_cache.dtype == fp8.E4M3  # new tokens of any float dtype, quantized on the way in
    checks.check_dtype("v_cache", v_cache, (k_cache.dtype,))
    checks.check_dtype("k", k, DTYPES if fp8_cache else (k_cache.dtype,))
    checks.check_dtype("v", v, (k.dtype,))
    checks.check_dtype("cache_seqlens", cache_seqlens, (torch.int32,))
    B, _, Hkv, d = k.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim {d} is not supported; expected one of {HEAD_DIMS}")
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
    if k.numel() >= 2**31 or max(k_cache.shape[:2]) >= 2**31:
        raise ValueError("too many rows for 32-bit indexing")
    check_descales(k_descale, v_descale, fp8_cache, Hkv)
    tensors = (k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale)
    _disjoint(*tensors).check(*tensors)
    checks.check_vectors(dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v), ("k_cache", "v_cache"),
                         cache_seqlens=cache_seqlens, block_table=block_table, k_descale=k_descale,
                         v_descale=v_descale)


def _disjoint(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale) -> checks.Disjoint:
    """The caches, which CTAs write while others read the inputs, may share memory with no input and not with each
    other (the k and v halves of one [blocks, 2, ...] buffer interleave: they pass)."""
    return checks.Disjoint(dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                                block_table=block_table, k_descale=k_descale, v_descale=v_descale),
                           ("k_cache", "v_cache"), {})


# ---------------------------------------------------------------------------------------------
# The op.

_plans = launch.PlanCache()


class _Plan(launch.Launch):
    """The kernel of one signature; contiguous caches pass a placeholder table of their own."""

    def __init__(self, fn, device: int, paged: bool, fp8_heads: int | None):
        super().__init__(fn, device)
        self.unused_table = None if paged else kernel.unread_table(f"cuda:{device}")
        self.fp8_heads = fp8_heads  # an e4m3 cache's KV heads (its descales per head); None: another cache

    def launch(self, k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale=None, v_descale=None) -> None:
        table = self.unused_table if block_table is None else block_table
        if self.fp8_heads is None:
            launch.on_device(self.device, self.fn, k_cache, v_cache, k, v, cache_seqlens, table, *kernel.NOT_FP8)
        else:
            launch.on_device(self.device, self.fn, k_cache, v_cache, k, v, cache_seqlens, table,
                             per_head(k_descale, self.fp8_heads), per_head(v_descale, self.fp8_heads))


def _new_plan(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale,
              v_descale) -> tuple[launch.Launch, checks.Disjoint]:
    """Slow path, once per signature: validate everything, pick and load the kernel; the overlap test of the
    signature's later calls."""
    tensors = (k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale)
    _validate(*tensors)
    device, disjoint = k.device.index, _disjoint(*tensors)
    if not k.numel():
        return launch.nothing(device), disjoint
    fp8_cache = k_cache.dtype == fp8.E4M3
    shape = AppendShape.of(k, block_table, fp8_cache)
    sms = modes.sm_count(device)
    return _Plan(kernel.compile(tuned.tuned_config(kernel, shape, config_for(shape, sms), sms)).fn, device, shape.paged,
                 k.shape[2] if fp8_cache else None), disjoint


def _run(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_seqlens: torch.Tensor,
         block_table: torch.Tensor | None, k_descale: torch.Tensor | None = None,
         v_descale: torch.Tensor | None = None) -> None:
    # What the plan depends on (the compiled host code checks the alignment and the agreement of sizes on each
    # call), and every shape and stride, which decide whether a cache's elements overlap one another (expanded,
    # or rows overlapping, which the compiled checks let through) and the spans the overlap test compares.
    key = (k_cache.shape, k_cache.stride(), v_cache.stride(), k.shape, k.stride(), v.stride(), k.dtype, k_cache.dtype,
           k.get_device(), cache_seqlens.stride(), cache_seqlens.dtype,
           None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype),
           None if k_descale is None else (k_descale.shape, k_descale.stride(), k_descale.dtype,
                                           k_descale.get_device()),
           None if v_descale is None else (v_descale.shape, v_descale.stride(), v_descale.dtype,
                                           v_descale.get_device()))
    plan, disjoint = _plans.get(key) or _plans.put(key, _new_plan(k_cache, v_cache, k, v, cache_seqlens, block_table,
                                                                  k_descale, v_descale))
    if disjoint.clash(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale):
        _validate(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale)  # raises, saying which
    try:
        plan.launch(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale)
    except Exception:
        # The compiled host code raises before launching; the full checks say what is wrong.
        _validate(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale)
        raise


launch.register_op(OP, _run, mutates_args=("k_cache", "v_cache"))


def append_kvcache(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                   k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None) -> None:
    """Write k, v [B, S_new, Hkv, d] (d in 64/128/256) into k_cache, v_cache at positions
    cache_seqlens[b] + i, in place, in one launch (see the module docstring for the layouts and what
    is skipped). Nothing syncs; cache_seqlens is not changed. Graph-capturable; under torch.compile
    the call goes through the custom op rosekernels::append_kvcache.

    e4m3 caches (torch.float8_e4m3fn, 16-byte aligned rows): k and v of any float dtype are quantized on
    the way in, cache = e4m3(x / descale) (saturating), with k_descale and v_descale fp32 of one value or
    one per KV head ([1] or [Hkv]): what attention_with_kvcache multiplies the cache by."""
    tensors = (k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale)
    if v is not None and launch.eager(*tensors):  # (the plan's key reads v's strides; None is refused below)
        _run(*tensors)
    elif all(isinstance(t, torch.Tensor) for t in (k_cache, v_cache, k, v, cache_seqlens)):  # traced, fake, meta
        torch.ops.rosekernels.append_kvcache(*tensors)
    else:
        _validate(*tensors)  # raises, naming the argument
