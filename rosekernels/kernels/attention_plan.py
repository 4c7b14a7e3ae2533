"""Prefill attention planning: what a launch of the prefill kernel (rosekernels.kernels.attention) is
specialized on, which config a call gets, the configs the tuner may try and the ones warm-up compiles.

No CuTeDSL here: configs are chosen, listed and tested on a CPU without compiling.

A launch cuts the queries into tiles of `tile_m` rows of one head (64 per consumer warpgroup) and
streams the keys in tiles of `tile_n` through a ring of `num_stages` shared-memory buffers. Head dim,
dtype, causality and the tile shape are compiled in; batch, lengths, head counts and strides are not,
so one compile serves every call of its (head_dim, dtype, causal) at any size.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Iterable

from typing import TYPE_CHECKING, ClassVar

from rosekernels.contract import KernelConfig
from rosekernels.models import ModelDims
from rosekernels.modes import sm_count
from rosekernels.variant import MODES

if TYPE_CHECKING:
    import torch

OP = "attention"
# What both attention kernels take (q, k, v, out): the head dims and dtypes they are compiled for.
HEAD_DIMS = (64, 128)
DTYPES = ("bf16", "fp16")
SMEM_BYTES = 227 * 1024  # sm_90 opt-in shared memory per block
# Keys from which d=128 takes 192-key tiles with O stored from registers (non-causal; causal from
# twice as many).
LONG_KV = 8192
# d=64 non-causal: the per-row speed of 128-row tiles (2 consumer warpgroups) relative to 192-row
# ones (3), H200 sweep at B1 S 8k-32k: 0.76-0.80.
ROWS_128_SPEED = 0.8
# The K/V ring depths the tuner tries: one stage leaves no load in flight while the math runs; the
# defaults take two (d=128) and three (d=64), and a deeper ring mostly takes shared memory.
STAGES = (2, 3, 4)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """The sizes and options of a call (the keys of `sip-tune --kernel attention --shape`): q, k and
    v [batch, seqlen, heads, head_dim]."""

    SIZE_FIELDS = ("batch", "seqlen")  # vary per call: bucketed by the tuned-config store (contract.bucket)
    batch: int = 2
    seqlen: int = 2048
    heads_q: int = 16
    heads_kv: int = 16
    head_dim: int = 128
    dtype: str = "bf16"
    causal: bool = False

    @classmethod
    def defaults(cls, mode: str) -> "AttentionShape":
        if mode != "prefill":
            raise ValueError("attention: the prefill kernel serves every sequence length; tune it with --mode "
                             "prefill (the split-KV kernel of short queries is --kernel attention_decode --mode decode)")
        return cls()

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, causal: bool) -> "AttentionShape":
        """The shape of an attention call on q [B, S, Hq, d] and k [B, S, Hkv, d]: the tuner's shapes have
        one sequence length, so a call with S_q != S_kv has none (ValueError)."""
        from rosekernels import checks  # not at the top: this module loads without torch

        batch, seqlen, heads_q, head_dim = q.shape
        if k.shape[1] != seqlen:
            raise ValueError(f"no {OP} shape has S_q = {seqlen} != S_kv = {k.shape[1]}")
        return cls(batch, seqlen, heads_q, k.shape[2], head_dim, checks.DTYPE_NAME[q.dtype], causal)


@dataclasses.dataclass(frozen=True)
class AttentionConfig(KernelConfig):
    """One compiled specialization, and how it is launched."""

    OP = OP
    mode: ClassVar[str] = "prefill"
    POLICY_FIELDS = ("persistent",)
    KEY_DEFAULTS = {"varlen": False, "direct_o": False}  # the keys predate them

    head_dim: int  # 64 or 128
    dtype: str  # "bf16" or "fp16"
    causal: bool
    tile_m: int = 128  # query rows per CTA: 64 per consumer warpgroup (128 -> 2 WGs, 192 -> 3 WGs)
    tile_n: int = 128  # keys per K/V tile (the N of the S GEMM, the K of the P V GEMM)
    num_stages: int = 2  # K/V buffers in flight
    overlap: bool = True  # intra-WG softmax/GEMM overlap + inter-WG ping-pong
    # O stored from registers straight to global memory (a column pair per store, rows past the
    # sequence skipped) instead of through a shared-memory slab and a TMA store: no O buffer, so
    # d=128 fits 176- and 192-key tiles x 2 stages.
    direct_o: bool = False
    # Packed variable-length sequences (rosekernels.attention_varlen): q/k/v [total, H, d] sliced by
    # cumulative lengths, O stored row by row within each sequence.
    varlen: bool = False
    # Launch policy, not compiled in (variant() leaves it out): one CTA per SM walking the tiles,
    # else one CTA per tile.
    persistent: bool = True

    def validate(self) -> None:
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be 64 or 128, got {self.head_dim}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.tile_m not in (128, 192):
            raise ValueError(f"tile_m must be 128 or 192, got {self.tile_m}")
        if self.tile_n % 16 or not 64 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 16 in [64, 256], got {self.tile_n}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.smem_bytes() > SMEM_BYTES:
            raise ValueError(f"{self} needs {self.smem_bytes()} bytes of shared memory (> {SMEM_BYTES})")

    @property
    def num_mma_warpgroups(self) -> int:
        return self.tile_m // 64

    def smem_bytes(self) -> int:
        elem = 2
        q = self.tile_m * self.head_dim * elem
        o = 0 if self.direct_o else q
        kv = 2 * self.num_stages * self.tile_n * self.head_dim * elem
        # The mbarriers and the tile mailbox (under 1 KiB), then the buffers, each 1 KiB-aligned: up to
        # 1 KiB of padding before the first, none between them (their sizes are multiples of 1 KiB).
        return 2048 + q + o + kv


def default_config(head_dim: int, dtype: str, causal: bool, seqlen_k: int = 0, seqlen_q: int = 0,
                   query_heads: int = 0, sms: int | None = None) -> AttentionConfig:
    """The tile shape the op uses (bench/results/attention/sweeps/attention_sweep_long.md has the sweep behind it).

    d=64: 192-row tiles (3 consumer warpgroups), FA3's choice; the warpgroups of a last tile that
    hold no row skip its math (`idle_mainloop`). Non-causal, 128-row tiles where they finish first
    by a wave model (`_d64_rows`), which needs the call's S_q and query heads (batch x Hq; 0: not
    known, 192 rows): at B1 S1k Hq 32 they were 1.17x faster, from S2k or B8 on 0.84-0.90x.
    d=128: 128 x 128 tiles; from LONG_KV keys non-causal and 2 x LONG_KV causal, 192-key tiles
    with O stored from registers (the O buffer's shared memory holds the wider K/V stages): one
    softmax round per 192 keys, 1-2.6% faster there, 2-10% slower at 1k-4k keys (direct O stores
    do not overlap the next tile as a TMA store does). The grid is sized per call (`grid_size`)."""
    if head_dim == 64:
        return AttentionConfig(64, dtype, causal, tile_m=_d64_rows(causal, seqlen_q, query_heads, sms), tile_n=128,
                               num_stages=3)
    if seqlen_k >= (2 if causal else 1) * LONG_KV:
        return AttentionConfig(head_dim, dtype, causal, tile_m=128, tile_n=192, num_stages=2, direct_o=True)
    return AttentionConfig(head_dim, dtype, causal, tile_m=128, tile_n=128, num_stages=2)


def _d64_rows(causal: bool, seqlen_q: int, query_heads: int, sms: int | None) -> int:
    """192, unless 128-row tiles take less time by the wave model: rounds of one tile per SM times
    a tile's rows over their per-row speed (ROWS_128_SPEED). It sees grids of under two rounds, as
    B1 S1k Hq 32 (192 tiles of 192 rows on 132 SMs: two rounds; 256 of 128 rows: two shorter ones).
    Not causal: causal tiles differ in length (the scheduler balances them), and at B1 S1k both
    row tiles measured the same."""
    if causal or seqlen_q <= 0 or query_heads <= 0:
        return 192
    sms = sm_count() if sms is None else sms

    def time(rows: int, speed: float) -> float:
        return -(-(-(-seqlen_q // rows) * query_heads) // sms) * rows / speed
    return 128 if time(128, ROWS_128_SPEED) < time(192, 1.0) else 192


def heuristic_configs(head_dim: int, dtype: str, causal: bool) -> list[AttentionConfig]:
    """Every config default_config returns for a head dim, dtype and causality (the warm-up set)."""
    if head_dim == 64:
        rows_192 = default_config(64, dtype, causal)
        return [rows_192] + ([] if causal else [dataclasses.replace(rows_192, tile_m=128)])
    return [default_config(head_dim, dtype, causal), default_config(head_dim, dtype, causal, 2 * LONG_KV)]


def config_for(shape: AttentionShape, sms: int | None = None) -> AttentionConfig:
    """What attention() launches for `shape` (with S_q > attention_decode.MAX_SEQLEN_Q; shorter
    queries take the split-KV kernel). The grid is not part of it: `grid_size` sizes it per call."""
    return default_config(shape.head_dim, shape.dtype, bool(shape.causal), shape.seqlen, shape.seqlen,
                          shape.batch * shape.heads_q, sms)


def candidates(shape: AttentionShape, sms: int | None = None) -> list[AttentionConfig]:
    """Every config that serves `shape`'s head dim, dtype and causality: 128- or 192-row tiles x
    every legal key tile x STAGES x O through shared memory or direct, as far as shared memory
    holds them, x overlapped or in-order, each launched persistent or one CTA per tile.
    config_for(shape) is among them."""
    base = config_for(shape)
    found = []
    for tile_m, tile_n, stages, direct_o in itertools.product((128, 192), range(64, 257, 16), STAGES, (False, True)):
        try:
            tiles = dataclasses.replace(base, tile_m=tile_m, tile_n=tile_n, num_stages=stages, direct_o=direct_o)
        except ValueError:  # more shared memory than a block gets
            continue
        found += [dataclasses.replace(tiles, overlap=o, persistent=p) for o in (True, False) for p in (True, False)]
    return found


def rank(shape: AttentionShape, configs: Iterable[AttentionConfig], sms: int | None = None) -> list[AttentionConfig]:
    """`configs` (candidates of `shape`) nearest the heuristic's first, for the tuner's pruning: the
    kernel has no cost model that rates tile shapes against each other (their MMA efficiencies are
    only measured), so the search stays local. Distance: one per field changed (row tile, stages,
    overlap, persistence, direct O), one per 32 keys of key-tile width. Equal distances go by a wave
    model: rounds of one tile per SM times one tile's padded work (its rows by its keys rounded up to
    whole key tiles), which sees wave quantization and ragged last tiles, not the tiles' speeds."""
    sms = sm_count() if sms is None else sms
    home = config_for(shape, sms)
    fields = ("tile_m", "num_stages", "overlap", "persistent", "direct_o")

    def key(c: AttentionConfig) -> tuple[float, float]:
        changed = sum(getattr(c, f) != getattr(home, f) for f in fields)
        rounds = -(-num_tiles(c, shape.batch, shape.seqlen, shape.heads_q) // sms)
        work = rounds * c.tile_m * -(-shape.seqlen // c.tile_n) * c.tile_n
        return changed + abs(c.tile_n - home.tile_n) / 32, work
    return sorted(configs, key=key)


def variants_for(models: Iterable[ModelDims] | None = None, modes: Iterable[str] = MODES,
                 max_tokens: int | None = None) -> list[AttentionConfig]:
    """The configs attention() can launch for `models` (rosekernels.models.ModelDims: their head dim
    and dtype, causal and not, short and long key ranges; a head dim or dtype the kernel lacks needs
    none). None: every head dim and dtype. The kernel has only a prefill mode."""
    if "prefill" not in set(modes):
        return []
    if models is None:
        kinds = [(d, dt) for d in HEAD_DIMS for dt in DTYPES]
    else:
        kinds = [(m.head_dim, m.dtype) for m in models if m.head_dim in HEAD_DIMS and m.dtype in DTYPES]
    return list(dict.fromkeys(cfg for d, dt in kinds for c in (False, True) for cfg in heuristic_configs(d, dt, c)))


def varlen_config(head_dim: int, dtype: str, causal: bool, max_seqlen_k: int) -> AttentionConfig:
    """The varlen launch: the dense heuristic's tiles for the longest sequence, `varlen` compiled in
    (the tuned store, keyed by one sequence length, is not consulted; without the grid's size d=64
    keeps 192-row tiles)."""
    return dataclasses.replace(default_config(head_dim, dtype, causal, max_seqlen_k), varlen=True)


def varlen_variants_for(models=None) -> list[AttentionConfig]:
    """The configs attention_varlen can launch for `models` (as variants_for; pass them to
    rosekernels.warmup(specs=...))."""
    return list(dict.fromkeys(varlen_config(c.head_dim, c.dtype, c.causal, keys)
                              for c in variants_for(models, ("prefill",)) for keys in (0, 2 * LONG_KV)))


def num_tiles(cfg: AttentionConfig, batch: int, seqlen_q: int, heads_q: int) -> int:
    return -(-seqlen_q // cfg.tile_m) * heads_q * batch


def grid_size(cfg: AttentionConfig, batch: int, seqlen_q: int, heads_q: int, sms: int) -> int:
    """CTAs of a launch: min(tiles, SMs) persistent CTAs, or one per tile."""
    tiles = num_tiles(cfg, batch, seqlen_q, heads_q)
    return min(tiles, sms) if cfg.persistent else tiles
