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

from rosekernels.models import ModelDims
from rosekernels.modes import sm_count
from rosekernels.variant import MODES, Variant

OP = "attention"
# What both attention kernels take (q, k, v, out): the head dims and dtypes they are compiled for.
HEAD_DIMS = (64, 128)
DTYPES = ("bf16", "fp16")
SMEM_BYTES = 227 * 1024  # sm_90 opt-in shared memory per block
# Keys from which d=128 non-causal attention takes 144-key tiles.
LONG_KV = 8192
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


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """One compiled specialization, and how it is launched."""

    head_dim: int  # 64 or 128
    dtype: str  # "bf16" or "fp16"
    causal: bool
    tile_m: int = 128  # query rows per CTA: 64 per consumer warpgroup (128 -> 2 WGs, 192 -> 3 WGs)
    tile_n: int = 128  # keys per K/V tile (the N of the S GEMM, the K of the P V GEMM)
    num_stages: int = 2  # K/V buffers in flight
    overlap: bool = True  # intra-WG softmax/GEMM overlap + inter-WG ping-pong
    # Packed variable-length sequences (rosekernels.attention_varlen): q/k/v [total, H, d] sliced by
    # cumulative lengths, O stored row by row within each sequence.
    varlen: bool = False
    # Launch policy, not compiled in (variant() leaves it out): one CTA per SM walking the tiles,
    # else one CTA per tile.
    persistent: bool = True

    def __post_init__(self) -> None:
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
        q = o = self.tile_m * self.head_dim * elem
        kv = 2 * self.num_stages * self.tile_n * self.head_dim * elem
        # + up to 1 KiB of alignment before each of the 4 buffers, the mbarriers, the tile mailbox
        return q + o + kv + 1024 * 4 + 8 * 2 * (1 + 2 * self.num_stages + 2) + 4 * 2

    def variant(self) -> Variant:
        params = dataclasses.asdict(self)
        del params["persistent"]
        if not self.varlen:
            del params["varlen"]  # the dense keys predate it
        return Variant.of(OP, "prefill", **params)

    @classmethod
    def from_variant(cls, variant: Variant) -> "AttentionConfig":
        if variant.op != OP:
            raise ValueError(f"not an {OP} variant: {variant}")
        return cls(**dict(variant.params))


def default_config(head_dim: int, dtype: str, causal: bool, seqlen_k: int = 0) -> AttentionConfig:
    """The tile shape the op uses: FA3's choices for Hopper (d=64 takes 3 consumer WGs, 192 rows).
    The warpgroups of a last tile that hold no row skip its math (`idle_mainloop`), which made the
    192-row tile as fast as 128 rows even at S_q = 1024 causal. d=128 non-causal with at least
    LONG_KV keys takes 144-key tiles (one softmax round per 144 keys, not 128): 2% faster from
    8k keys on the H200; at 4k even, below that the ragged last tile costs more, and causal gains
    at most 0.6% (bench/results/attention_sweep.md, attention_tile_n.md). The grid is sized per
    call from the shape (`grid_size`): min(tiles, SMs) CTAs."""
    if head_dim == 64:
        return AttentionConfig(64, dtype, causal, tile_m=192, tile_n=128, num_stages=3)
    tile_n = 144 if not causal and seqlen_k >= LONG_KV else 128
    return AttentionConfig(head_dim, dtype, causal, tile_m=128, tile_n=tile_n, num_stages=2)


def config_for(shape: AttentionShape, sms: int | None = None) -> AttentionConfig:
    """What attention() launches for `shape` (with S_q > attention_decode.MAX_SEQLEN_Q; shorter
    queries take the split-KV kernel). The grid is not part of it: `grid_size` sizes it per call."""
    return default_config(shape.head_dim, shape.dtype, bool(shape.causal), shape.seqlen)


def candidates(shape: AttentionShape, sms: int | None = None) -> list[AttentionConfig]:
    """Every config that serves `shape`'s head dim, dtype and causality: 128- or 192-row tiles x
    every legal key tile x STAGES x overlapped or in-order, as far as shared memory holds them,
    each launched persistent or one CTA per tile. config_for(shape) is among them."""
    base = config_for(shape)
    found = []
    for tile_m, tile_n, stages in itertools.product((128, 192), range(64, 257, 16), STAGES):
        try:
            tiles = dataclasses.replace(base, tile_m=tile_m, tile_n=tile_n, num_stages=stages)
        except ValueError:  # more shared memory than a block gets
            continue
        found += [dataclasses.replace(tiles, overlap=o, persistent=p) for o in (True, False) for p in (True, False)]
    return found


def rank(shape: AttentionShape, configs: Iterable[AttentionConfig], sms: int | None = None) -> list[AttentionConfig]:
    """`configs` (candidates of `shape`) nearest the heuristic's first, for the tuner's pruning: the
    kernel has no cost model that rates tile shapes against each other (their MMA efficiencies are
    only measured), so the search stays local. Distance: one per field changed (row tile, stages,
    overlap, persistence), one per 32 keys of key-tile width. Equal distances go by a wave model:
    rounds of one tile per SM times one tile's padded work (its rows by its keys rounded up to whole
    key tiles), which sees wave quantization and ragged last tiles, not the tiles' speeds."""
    sms = sm_count() if sms is None else sms
    home = config_for(shape, sms)

    def key(c: AttentionConfig) -> tuple[float, float]:
        changed = sum(getattr(c, f) != getattr(home, f) for f in ("tile_m", "num_stages", "overlap", "persistent"))
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
    return list(dict.fromkeys(default_config(d, dt, c, s) for d, dt in kinds for c in (False, True)
                              for s in (0, LONG_KV)))


def num_tiles(cfg: AttentionConfig, batch: int, seqlen_q: int, heads_q: int) -> int:
    return -(-seqlen_q // cfg.tile_m) * heads_q * batch


def grid_size(cfg: AttentionConfig, batch: int, seqlen_q: int, heads_q: int, sms: int) -> int:
    """CTAs of a launch: min(tiles, SMs) persistent CTAs, or one per tile."""
    tiles = num_tiles(cfg, batch, seqlen_q, heads_q)
    return min(tiles, sms) if cfg.persistent else tiles
