"""Launch-mode selection shared by the memory-bound ops (decode vs prefill, warps per block).

The rule (Perplexity's ROSE kernels): from the vector width (128-bit accesses) each op knows how
many warps its work needs. Fewer warps than SMs -> the decode variant: one small block per work
unit group, so every warp gets its own SM and the latency is one memory round trip. Otherwise the
prefill variant: bigger blocks (8/16/32 warps) with enough loads in flight to saturate HBM; the
block size, and how many rows each thread handles, come from a table the benchmark measured.

Also what the device holds, which the heuristics and grids of every kernel read: its SM count
(`sm_count`) and the clusters of a given size resident at once (`max_active_clusters`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

DEFAULT_SM_COUNT = 132  # H200 / H100 SXM; used when no GPU is visible (CPU compile tests)

CACHE_HINTS = ("none", "evict_first", "last_use")  # streaming-data load/store cache hints
PREFILL_WARPS = (8, 16, 32)  # prefill block sizes the tuner and the benchmarks try (32: 1024 threads, the limit)


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str  # "decode" or "prefill"
    warps: int  # warps per block
    rows_per_thread: int = 1  # rows (heads) each thread group handles: loads in flight per thread
    cache_hint: str = "none"  # one of CACHE_HINTS, for the streamed (read-once, write-once) data


# Prefill table: per op, rows (warps needed up to, warps per block, rows per thread, cache hint);
# the first row whose limit covers the work wins. qk_norm: the recommendation of the block-shape
# sweep in `python bench/qk_norm.py` on the H200 (Qwen3-8B and Qwen3-30B-A3B, bf16,
# bench/results/norms/qk_norm.md); neighbouring shapes are within 1-4% of the winner. rmsnorm: not swept
# yet (`python bench/rmsnorm.py` prints its row).
PREFILL_TABLE: dict[str, tuple[tuple[int, int, int, str], ...]] = {
    "qk_norm": ((2560, 8, 2, "none"), (20480, 16, 4, "evict_first"), (1 << 62, 8, 1, "evict_first")),
    "rmsnorm": ((1 << 62, 8, 1, "none"),),
    "quantize_fp8": ((1 << 62, 8, 1, "none"),),  # rmsnorm's row: the same row geometry, not swept
}


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int | None = None) -> int:
    """Streaming multiprocessors of the (current) CUDA device; DEFAULT_SM_COUNT without one."""
    import torch

    if not torch.cuda.is_available():
        return DEFAULT_SM_COUNT
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def max_active_clusters(device_index: int, cluster_size: int) -> int:
    """Clusters of `cluster_size` CTAs (one per SM) that can be resident at once on the device: a
    persistent grid's size."""
    sms = sm_count(device_index)
    if cluster_size == 1:
        return sms
    import cutlass.utils  # here, not at the top: plan modules use this module without CuTeDSL
    import torch

    try:  # GPCs with an odd number of free SMs fit fewer 2-CTA clusters than sms // 2
        with torch.cuda.device(device_index):
            torch.cuda.init()
            return int(cutlass.utils.HardwareInfo(device_index).get_max_active_clusters(cluster_size))
    except Exception:  # noqa: BLE001 - an occupancy query failure only costs the estimate
        return sms // cluster_size


def warps_needed(units: int, threads_per_unit: int) -> int:
    """Warps that cover `units` work units of `threads_per_unit` threads each (one vector per thread)."""
    return -(-units * threads_per_unit // 32)


def select(op: str, warps: int, sms: int | None = None) -> Mode:
    """Decode when the work fits in fewer warps than there are SMs, else the tabled prefill mode."""
    if warps <= (sm_count() if sms is None else sms):
        return Mode("decode", 1, 1)
    for limit, block_warps, rows, hint in PREFILL_TABLE[op]:
        if warps <= limit:
            return Mode("prefill", block_warps, rows, hint)
    raise AssertionError(f"PREFILL_TABLE[{op!r}] has no catch-all row")


def prefill_modes(op: str) -> list[Mode]:
    """Every prefill mode the table can select for `op` (the specializations to precompile)."""
    return sorted({Mode("prefill", *row[1:]) for row in PREFILL_TABLE[op]},
                  key=lambda m: (m.warps, m.rows_per_thread, m.cache_hint))


def all_modes(op: str) -> list[Mode]:
    return [Mode("decode", 1, 1)] + prefill_modes(op)


def size_range(mode: str, mode_of: Callable[[int], str], cap: int = 1 << 16) -> tuple[int, int]:
    """(lo, hi): the sizes (token or row counts) to test a `mode` kernel on, given the mode each size
    selects: every size of the mode (decode), or its first ones (prefill: the same code with more
    blocks; small sizes keep test samples cheap and exercise the ragged tails)."""
    lo = 1
    while lo < cap and mode_of(lo) != mode:
        lo = lo * 2 if mode_of(lo * 2) != mode else lo + 1
    hi = lo
    limit = cap if mode == "decode" else 2 * lo + 64
    while hi < limit and mode_of(hi + 1) == mode:
        hi += 1
    return lo, hi
