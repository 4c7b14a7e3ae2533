"""Split-KV decode attention planning: what a launch of the split-KV kernel
(rosekernels.kernels.attention_decode) is specialized on, which config and split count a call gets,
the configs the tuner may try and the ones warm-up compiles.

No CuTeDSL here: configs and split counts are chosen, listed and tested on a CPU without compiling.

The S_q * Hq/Hkv query rows that share a KV head are packed into the M dimension of a CTA, `tile_m`
rows per CTA (more rows: more m-blocks); the keys are cut into `splits` chunks of whole `tile_n`
tiles, one CTA per (split, m-block, KV head, batch). Head dim, dtype, tile_m and the stage count are
compiled in; the split count, causality and every size are launch-time values.

The KV-cache variants (rosekernels.attention_with_kvcache) are the same kernel with two more
compile-time fields: `varlen` (each sequence's key count is read from device memory) and
`page_rows` (a paged cache: each K/V tile is loaded as tile_n / page_rows boxes of page_rows rows,
each inside one page; 0: a contiguous cache), and `kv_fp8` (an e4m3 cache: each tile widened to the
MMAs' dtype, the scores and the output times the descales): 16-row tiles in the MMA warps' registers
(`widen_regs`, the plan's), else in shared memory by the MMA warps or, with `widen_warps`, by warps of their
own. All of them are left out of the variant key at their
defaults, so the keys of the dense variants are unchanged.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar, Iterable

import torch

from rosekernels import checks
from rosekernels.contract import KernelConfig
from rosekernels.kernels.attention_plan import DTYPES, HEAD_DIMS
from rosekernels.models import ModelDims
from rosekernels.modes import sm_count
from rosekernels.variant import MODES

OP = "attention_decode"
MAX_SEQLEN_Q = 16  # attention() sends S_q <= this here
MMA_WARPS = 4
BAR_MMA = 1  # the MMA warps' named barrier (the device code's: the producer warp may have exited by then)
# widen_warps: 3, so that the CTA is 8 warps (the MMA warps, the producer and these): two warpgroups, whose
# register file allows ptxas up to 255 registers a thread (with 4, 288 threads held it to 168 and it spilled).
WIDEN_WARPS = 3
TILE_M = (16, 32, 64)
STAGES = (2, 3, 4, 5, 6)  # the legal K/V ring depths (6 x 32 KB: one CTA per SM still fits)
PAGE_ROWS = 16  # the smallest page (block_size) of a paged KV cache: one TMA box of 16 rows

# How many KV splits: a fluid model of the launch. Every CTA streams its chunk at the lesser of
# what one CTA keeps in flight (CTA_GBPS) and its share of HBM (HBM_GBPS over the CTAs of its wave);
# a wave is one CTA per SM (two fit, but on the H200 a second resident CTA added no bandwidth:
# B=16 S_kv=1k-4k ran 6-14% faster unsplit, 128 CTAs, than split in two); each wave costs CTA_US of
# ramp, and a split launch COMBINE_US for the last CTA's combine; more splits must win by SPLIT_GAIN
# (each costs workspace traffic the model leaves out). Fitted to an H200 sweep of split counts
# (B 1-64, S_kv 1k-32k, GQA 4 and 1): the picks are within 0.5% of the best. `splits=` overrides.
HBM_GBPS = 4300.0
CTA_GBPS = 25.0
CTA_US = 0.5
COMBINE_US = 1.0
MAX_SPLITS = 128
SPLIT_GAIN = 0.97
WAVE_CTAS_PER_SM = 1
# An e4m3 cache (kv_fp8): a CTA widens each tile before its MMAs, so its instructions, not the bytes in
# flight, set its rate (E4M3_CTA_GBPS of e4m3 bytes), and a second resident CTA per SM adds throughput up to
# E4M3_SM_GBPS for the two. H100, B = 16, Qwen3-8B heads, S_kv 8k and 32k, 1-4 splits (ninth session of
# 2026-12-05): one CTA per SM streamed 15.1 GB/s, two 10.3 GB/s each; two splits ran 1.34x / 1.42x one
# (1.69x / 1.79x the bf16 cache), four 1.23x / 1.39x, three 1.00x / 1.24x (a second, partial wave).
# The 16-row tiles widened in registers (widen_regs) stream about 31 GB/s a CTA, and the H100 runs them at its
# copy rate from B = 16 on, whatever the split; with these constants the picks are 1.035 / 1.011 / 1.012 of the
# best on average (worst 1.059) there (H100, B 4-64, 8k and 32k: bench/results/gemm/sweeps/fp8_kv_regs_h100_sweep),
# which no refit of them improved. Not measured on an H200.
E4M3_CTA_GBPS = 15.0
E4M3_SM_GBPS = 20.5
E4M3_WAVE_CTAS_PER_SM = 2
# The plan sees the cache's capacity, not the lengths (they live on the device), and a chunk past a sequence's
# end loads nothing: with lengths below the capacity, large chunks leave the time to the CTAs of the longest
# sequences. An e4m3 launch cuts its chunks to at most E4M3_MAX_SPLIT_BYTES of K and V, so that those CTAs'
# work spreads over the SMs, and each split costs E4M3_COMBINE_US_PER_SPLIT in the combine. Fitted to an H100
# sweep (B 1-64, S_kv 4k-32k, every sequence full, lengths uniform in [S/2, S] and in [1, S]: splits 1-32,
# bench/results/gemm/sweeps/fp8_kv_splits_sweep.json): the mean time over the best split count went
# 1.024 / 1.038 / 1.177 -> 1.014 / 1.004 / 1.077 (full / [S/2, S] / [1, S]); on held-out shapes (B 2-32, 12k-64k,
# heads 32/8 and 28/4: fp8_kv_splits_heldout_sweep.json) 1.001 / 1.032 / 1.238 -> 1.027 / 1.014 / 1.061: full
# lengths pay up to 7.6% (B = 32), lengths that vary gain up to 1.55x.
E4M3_MAX_SPLIT_BYTES = 1 << 20
E4M3_COMBINE_US_PER_SPLIT = 0.2
# ... for a 16-row d=128 tile's partial sums (8 KB a split and group): the last CTA of a group reads every
# split's, so more rows or a wider head cost in proportion (an H200 sweep of GQA 32 and 64, 2026-12-06: 22
# splits of 64-row tiles ran 1.49x the time of 16 at B = 4, 8k keys, when the model charged them as 16 rows).
E4M3_PARTIAL_BYTES = 16 * 128 * 4
# An SM's registers: SUBPARTITIONS files of SUBPARTITION_REGISTERS 32-bit registers (Hopper); a thread takes at
# most MAX_REGISTERS.
SUBPARTITIONS = 4
SUBPARTITION_REGISTERS = 16384
MAX_REGISTERS = 255


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """The sizes and options of a call (the keys of `sip-tune --kernel attention_decode --shape`):
    q [batch, seqlen_q, heads_q, head_dim], k and v [batch, seqlen_kv, heads_kv, head_dim]."""

    SIZE_FIELDS = ("batch", "seqlen_kv")  # vary per call: bucketed by the tuned-config store (contract.bucket)
    batch: int = 16
    seqlen_q: int = 1
    seqlen_kv: int = 4096
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    causal: bool = False
    pdl: bool = True  # programmatic dependent launch (attention(enable_pdl=...))

    @classmethod
    def defaults(cls, mode: str) -> "DecodeShape":
        if mode != "decode":
            raise ValueError("attention_decode: the split-KV kernel of short queries; tune it with --mode decode")
        return cls()

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, causal: bool = False, pdl: bool = True) -> "DecodeShape":
        """The shape of a call on q [B, S_q, Hq, d] and k [B, S_kv, Hkv, d]."""
        batch, seqlen_q, heads_q, head_dim = q.shape
        return cls(batch, seqlen_q, k.shape[1], heads_q, k.shape[2], head_dim, checks.DTYPE_NAME[q.dtype], causal,
                   pdl)

    @classmethod
    def of_cache(cls, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None, causal: bool,
                 pdl: bool = True) -> "DecodeShape":
        """The shape of an attention_with_kvcache call on q [B, S_q, Hq, d] and a cache [B, S_max, Hkv, d]
        (or pages [num_blocks, block_size, Hkv, d] with a block table [B, max_blocks]): seqlen_kv is the
        cache's capacity per sequence."""
        capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
        batch, seqlen_q, heads_q, head_dim = q.shape
        return cls(batch, seqlen_q, capacity, heads_q, k_cache.shape[2], head_dim, checks.DTYPE_NAME[q.dtype], causal,
                   pdl)

    @property
    def rows(self) -> int:
        """Query rows that share one KV head: S_q * Hq / Hkv."""
        return self.seqlen_q * (self.heads_q // self.heads_kv)


@dataclasses.dataclass(frozen=True)
class DecodeConfig(KernelConfig):
    """One compiled specialization, and how it is launched."""

    OP = OP
    mode: ClassVar[str] = "decode"
    POLICY_FIELDS = ("splits",)
    # The keys of the dense variants predate these.
    KEY_DEFAULTS = {"varlen": False, "page_rows": 0, "pdl": True, "kv_fp8": False, "widen_warps": False,
                    "widen_regs": False}

    head_dim: int  # 64 or 128
    dtype: str  # "bf16" or "fp16"
    tile_m: int = 16  # packed query rows per CTA: 16, 32 or 64
    num_stages: int = 3  # K/V tiles in flight per CTA (3 x 32 KB: two CTAs fit per SM)
    # Launch policy, not compiled in (variant() leaves it out): the KV chunks wanted, at most one
    # per tile (`split_plan`); None: the split-count model's choice for each call's shape.
    splits: int | None = None
    # KV-cache variants (kvcache_config_for): per-sequence key counts read on the device, and for a
    # paged cache the rows of one TMA box (a power of two from PAGE_ROWS up to tile_n; 0: contiguous).
    varlen: bool = False
    page_rows: int = 0
    # Programmatic dependent launch: the launch attribute (the kernel waits with griddepcontrol.wait
    # before reading what the previous kernel writes either way); attention(enable_pdl=...).
    pdl: bool = True
    # KV-cache variants: an e4m3 cache (attention_fp8), with k and v descales per KV head.
    kv_fp8: bool = False
    # An e4m3 cache widened by WIDEN_WARPS warps of their own, a tile ahead of the MMA warps, instead of by
    # the MMA warps before each tile's MMAs (attention_fp8); the CTA's registers then allow one CTA per SM.
    widen_warps: bool = False
    # An e4m3 cache whose MMAs are fp16 (16-row tiles) widened by the MMA warps in their registers: each warp
    # loads its own keys' e4m3 bytes from the ring into its B fragments and converts them there (attention_fp8),
    # with no widened tile in shared memory, no barrier between the warps and no ldmatrix.
    widen_regs: bool = False

    def validate(self) -> None:
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be 64 or 128, got {self.head_dim}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.tile_m not in TILE_M:
            raise ValueError(f"tile_m must be 16, 32 or 64, got {self.tile_m}")
        if not 2 <= self.num_stages <= 6:
            raise ValueError(f"num_stages must be in [2, 6], got {self.num_stages}")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"splits must be None or >= 1, got {self.splits}")
        if self.page_rows and not (self.varlen and self.page_rows in _page_rows_choices(self.tile_n)):
            raise ValueError(f"page_rows must be 0 or, with varlen, a power of two in [{PAGE_ROWS}, "
                             f"{self.tile_n}] (tile_n), got {self.page_rows} (varlen={self.varlen})")
        if self.kv_fp8 and not self.varlen:
            raise ValueError("an e4m3 KV cache (kv_fp8) is for the KV-cache variants (varlen)")
        if self.widen_warps and not self.kv_fp8:
            raise ValueError("widen_warps widen an e4m3 cache (kv_fp8)")
        if self.widen_regs and not (self.kv_fp8 and self.tile_m == 16 and not self.widen_warps):
            raise ValueError("widen_regs widens an e4m3 cache (kv_fp8) of 16-row tiles (fp16 MMAs) without widen_warps")

    @property
    def tile_n(self) -> int:
        return tile_n_for(self.head_dim)

    @property
    def key_slices(self) -> int:
        """MMA warps sharing one 16-row block, each taking 1/key_slices of every tile's keys."""
        return MMA_WARPS // (self.tile_m // 16)

    @property
    def paged(self) -> bool:
        return self.page_rows > 0

    @property
    def tile_bytes(self) -> int:
        """Bytes of K and V a tile of keys reads."""
        return 2 * self.tile_n * self.head_dim * (1 if self.kv_fp8 else 2)

    @property
    def mma_dtype(self) -> str:
        """The MMAs' operand type. An e4m3 cache's 16-row tiles widen into fp16 whatever the query's dtype:
        e4m3 into fp16 is one conversion a pair, into bf16 four instructions (through fp32), and the widening
        is what the MMA warps spend their issue slots on; a bf16 query goes into fp16 exactly, by a power of
        two per row block. Larger row tiles keep the query's dtype: there ptxas gives the fp16 MMAs more
        registers than the bf16 ones (a 32-row d=128 tile 212 against 168), past two CTAs per SM."""
        return "fp16" if self.kv_fp8 and self.tile_m == 16 else self.dtype

    @property
    def warps(self) -> int:
        """Warps of a CTA: the MMA warps, the producer, the widen warps."""
        return MMA_WARPS + 1 + (WIDEN_WARPS if self.widen_warps else 0)

    @property
    def min_ctas_per_sm(self) -> int:
        """CTAs per SM the launch asks room for (min_blocks_per_mp, and the whole shared-memory carveout), and
        the waves the e4m3 split model plans (`launch_us`' ctas_per_sm). Two for 16-row tiles where the shared memory
        holds them (up to 3 stages, no widen warps; widened in registers, 6) and ptxas fits them without spilling.
        Left to itself ptxas took more than two CTAs leave (register_budget) for fp16 queries, so one CTA ran per SM
        and the plan's two splits in two waves (a 170-register build ran 1.54x slower than a 156-register one,
        H100). Two also for the bf16 32-row d=128 tiles (168 registers asked, no spills): left to itself ptxas
        now takes 219-224 for them, and one CTA an SM ran GQA 40/2 at B16, 8 splits, 1.4x slower (H100,
        2026-12-06). The other 32- and 64-row tiles keep ptxas's count and one CTA per SM: asked for two, some
        spill (d=64's bf16 32-row paged tile 74 spill instructions)."""
        two = self.tile_m == 16 or (self.tile_m == 32 and self.mma_dtype == "bf16" and self.head_dim == 128)
        # widen_regs: the ring is the CTA's only tiles in shared memory, and 6 stages of it leave room for two
        if self.kv_fp8 and not self.widen_warps and (self.num_stages <= 3 or self.widen_regs) and two:
            return E4M3_WAVE_CTAS_PER_SM
        return 1

    @property
    def partial_bytes(self) -> int:
        """Bytes of fp32 partial sums a split writes for its group (a row tile's output rows)."""
        return self.tile_m * self.head_dim * 4


def register_budget(warps_per_cta: int, ctas: int) -> int:
    """The most registers a thread may take for `ctas` CTAs of `warps_per_cta` warps to be resident on one SM:
    a warp takes its registers (a thread's count rounded up to 8) from one of the SM's SUBPARTITIONS register
    files, and the CTAs' warps spread over them evenly."""
    per_partition = -(-warps_per_cta * ctas // SUBPARTITIONS)
    return min(MAX_REGISTERS, SUBPARTITION_REGISTERS // (32 * per_partition) // 8 * 8)


def tile_n_for(head_dim: int) -> int:
    """Keys per K/V tile: 16 KB of K (and of V) per stage."""
    return 8192 // head_dim


def _page_rows_choices(tile_n: int) -> tuple[int, ...]:
    return tuple(r for r in (16, 32, 64, 128) if r <= tile_n)


def page_rows_for(block_size: int, tile_n: int) -> int:
    """The TMA box height for pages of `block_size` rows and key tiles of `tile_n`: the largest power
    of two dividing both (each box then lies inside one page: one box per tile when the page is a
    multiple of the tile); ValueError for a block size the kernel cannot take."""
    if block_size < PAGE_ROWS or block_size % PAGE_ROWS:
        raise ValueError(f"block_size must be a positive multiple of {PAGE_ROWS} (the kernel loads K/V pages "
                         f"with TMA boxes of at least {PAGE_ROWS} rows), got {block_size}")
    return math.gcd(block_size, tile_n)


def tile_m_for(rows: int) -> int:
    """The smallest row tile that holds `rows` packed query rows (more than 64: several m-blocks)."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


@functools.lru_cache(maxsize=4096)
def choose_splits(groups: int, n_tiles: int, tile_bytes: int, sms: int, max_splits: int = MAX_SPLITS,
                  kv_fp8: bool = False, ctas_per_sm: int = E4M3_WAVE_CTAS_PER_SM,
                  partial_bytes: int = E4M3_PARTIAL_BYTES) -> tuple[int, int]:
    """(num_splits, tiles_per_split) for `groups` CTAs' worth of rows over `n_tiles` K/V tiles each (an e4m3
    cache's chunks of at most E4M3_MAX_SPLIT_BYTES where max_splits allows, `ctas_per_sm` of them resident,
    `partial_bytes` of partial sums a split and group)."""
    most = max(1, min(n_tiles, max_splits))
    least = min(most, -(-n_tiles * tile_bytes // E4M3_MAX_SPLIT_BYTES)) if kv_fp8 else 1
    best = None
    for want in range(max(1, least), most + 1):
        per = -(-n_tiles // want)
        splits = -(-n_tiles // per)
        if best is not None and splits == best[1]:
            continue
        us = launch_us(groups, splits, per, tile_bytes, sms, kv_fp8, ctas_per_sm, partial_bytes)
        if best is None or us < SPLIT_GAIN * best[0]:
            best = (us, splits, per)
    return best[1], best[2]


def launch_us(groups: int, splits: int, per: int, tile_bytes: int, sms: int, kv_fp8: bool = False,
              ctas_per_sm: int = E4M3_WAVE_CTAS_PER_SM, partial_bytes: int = E4M3_PARTIAL_BYTES) -> float:
    """Modelled microseconds of a launch of `groups` x `splits` CTAs streaming `per` tiles of
    `tile_bytes` each: the fluid model above (an e4m3 cache's, kv_fp8, with waves of `ctas_per_sm` CTAs
    an SM: the config's min_ctas_per_sm), wave by wave, plus the combine of a split launch (an e4m3
    cache's, of `partial_bytes` a split and group: the config's `partial_bytes`)."""
    slots = (ctas_per_sm if kv_fp8 else WAVE_CTAS_PER_SM) * sms
    ctas = groups * splits
    us = 0.0
    while ctas > 0:
        wave = min(ctas, slots)
        cta_gbps = min(E4M3_CTA_GBPS, E4M3_SM_GBPS / -(-wave // sms)) if kv_fp8 else CTA_GBPS
        us += per * tile_bytes / 1e3 / min(cta_gbps, HBM_GBPS / wave) + CTA_US
        ctas -= wave
    # (no less than the fitted 16-row d=128 charge: smaller partials, d=64's, are not measured)
    per_split = E4M3_COMBINE_US_PER_SPLIT * max(1.0, partial_bytes / E4M3_PARTIAL_BYTES)
    combine = COMBINE_US + (per_split * splits if kv_fp8 else 0.0)
    return us + (combine if splits > 1 else 0.0)


def split_plan(cfg: DecodeConfig, shape: DecodeShape, sms: int | None = None) -> tuple[int, int, int]:
    """(num_splits, tiles_per_split, groups) of a launch of `cfg` on `shape`: `cfg.splits` chunks of
    whole tiles (cfg.splits None: the model's choice for a GPU of `sms` SMs, the current device's
    when sms is None), never more than there are tiles or than the workspace's 32-bit indices
    reach; groups = CTAs per split."""
    groups = shape.batch * shape.heads_kv * -(-shape.rows // cfg.tile_m)
    n_tiles = -(-shape.seqlen_kv // cfg.tile_n)
    fits = (2**31 - 1) // (groups * cfg.tile_m * cfg.head_dim)
    if cfg.splits is None:
        splits, per = choose_splits(groups, n_tiles, cfg.tile_bytes,
                                    sm_count() if sms is None else sms, min(MAX_SPLITS, fits), cfg.kv_fp8,
                                    cfg.min_ctas_per_sm, cfg.partial_bytes)
    else:
        per = -(-n_tiles // max(1, min(cfg.splits, n_tiles, fits)))
        splits = -(-n_tiles // per)
    return splits, per, groups


def causal_shift_for(causal: bool, seqlen_q: int, seqlen_kv: int) -> int:
    """Keys row s sees: [0, s + causal_shift]; without causal S_kv, which never binds."""
    return seqlen_kv - seqlen_q if causal else seqlen_kv


@functools.lru_cache(maxsize=4096)
def config_for(shape: DecodeShape, sms: int | None = None) -> DecodeConfig:
    """What attention() launches for `shape` (S_q <= MAX_SEQLEN_Q) on a GPU of `sms` SMs (None: the
    current device's): the smallest row tile that holds the packed rows, and the split count of
    the model."""
    cfg = DecodeConfig(shape.head_dim, shape.dtype, tile_m_for(shape.rows), pdl=shape.pdl)
    return dataclasses.replace(cfg, splits=split_plan(cfg, shape, sms)[0])


def kvcache_config_for(shape: DecodeShape, block_size: int | None = None, sms: int | None = None,
                       kv_fp8: bool = False) -> DecodeConfig:
    """What attention_with_kvcache launches: config_for's row tile for `shape`, whose seqlen_kv is the
    cache's capacity per sequence (S_max, or max_blocks * block_size: the splits are planned for a full
    cache, and a shorter sequence's surplus splits load nothing), with `varlen`, for a paged cache
    (`block_size` given) the box height page_rows_for(block_size, tile_n), for an e4m3 cache `kv_fp8`; the
    split count the model gives that cache's tile bytes."""
    cfg = _kvcache(config_for(shape, sms), block_size, kv_fp8)
    if kv_fp8:
        cfg = dataclasses.replace(cfg, splits=split_plan(dataclasses.replace(cfg, splits=None), shape, sms)[0])
    return cfg


def _kvcache(cfg: DecodeConfig, block_size: int | None, kv_fp8: bool = False) -> DecodeConfig:
    """`cfg`'s KV-cache variant for a contiguous cache (block_size None) or pages of `block_size` rows, of
    the query's dtype or e4m3 (kv_fp8)."""
    page_rows = 0 if block_size is None else page_rows_for(block_size, cfg.tile_n)
    cfg = dataclasses.replace(cfg, varlen=True, page_rows=page_rows, kv_fp8=kv_fp8)
    return dataclasses.replace(cfg, widen_regs=kv_fp8 and cfg.tile_m == 16)


def candidates(shape: DecodeShape, sms: int | None = None) -> list[DecodeConfig]:
    """Every row tile that holds `shape`'s packed rows (or 64 rows) x every stage count x split
    counts: powers of two up to MAX_SPLITS, and the model's choice for the tile, as far as `shape`
    has tiles to split. config_for(shape, sms) is among them."""
    found = []
    for tile_m in TILE_M[TILE_M.index(tile_m_for(shape.rows)):]:
        for stages in STAGES:
            cfg = DecodeConfig(shape.head_dim, shape.dtype, tile_m, stages, pdl=shape.pdl)
            wanted = (None, *(2**i for i in range(MAX_SPLITS.bit_length())))
            counts = {split_plan(dataclasses.replace(cfg, splits=s), shape, sms)[0] for s in wanted}
            found += [dataclasses.replace(cfg, splits=s) for s in sorted(counts)]
    return found


def rank(shape: DecodeShape, configs: Iterable[DecodeConfig], sms: int | None = None) -> list[DecodeConfig]:
    """`configs` (candidates of `shape`) best first by the split model's time (`launch_us`) of their
    split plan, for the tuner's pruning; the stage count, which the model does not see, keeps the
    given order among equal times (the sort is stable)."""
    sms = sm_count() if sms is None else sms

    def cost(c: DecodeConfig) -> float:
        splits, per, groups = split_plan(c, shape, sms)
        return launch_us(groups, splits, per, c.tile_bytes, sms, c.kv_fp8, c.min_ctas_per_sm,
                         c.partial_bytes)
    return sorted(configs, key=cost)


def variants_for(models: Iterable[ModelDims] | None = None, modes: Iterable[str] = MODES,
                 max_tokens: int | None = None) -> list[DecodeConfig]:
    """The configs attention() can launch for `models` (rosekernels.models.ModelDims: their head dim
    and dtype, the row tiles of S_q = 1..MAX_SEQLEN_Q at their GQA ratio; a head dim or dtype the
    kernel lacks needs none). None: every head dim, dtype and row tile. The kernel has only a
    decode mode."""
    if "decode" not in set(modes):
        return []
    if models is None:
        return [DecodeConfig(d, dt, m) for d in HEAD_DIMS for dt in DTYPES for m in TILE_M]
    found = {}
    for m in models:
        if m.head_dim in HEAD_DIMS and m.dtype in DTYPES:
            ratio = m.heads_q // m.heads_kv
            for s_q in range(1, MAX_SEQLEN_Q + 1):
                found[DecodeConfig(m.head_dim, m.dtype, tile_m_for(s_q * ratio))] = None
    return list(found)


def kvcache_variants_for(models: Iterable[ModelDims] | None = None,
                         block_size: int | None = None) -> list[DecodeConfig]:
    """The configs attention_with_kvcache can launch for `models` (S_q = 1..MAX_SEQLEN_Q; a head dim or
    dtype the kernel lacks needs none) on a contiguous cache (block_size None) or a paged one of
    `block_size`-row pages, e4m3 ones too for models with an FP8 KV cache (ModelDims.fp8_kv); pass them to
    rosekernels.warmup(specs=...). models None: every head dim, dtype and row tile, caches of the query's
    dtype."""
    groups = [(None, False)] if models is None else [([m], m.fp8_kv) for m in models]
    return list(dict.fromkeys(_kvcache(cfg, block_size, kv_fp8) for ms, fp8 in groups
                              for cfg in variants_for(ms, ("decode",)) for kv_fp8 in dict.fromkeys((False, fp8))))
