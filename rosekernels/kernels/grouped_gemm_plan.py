"""Planning of the grouped GEMM (rosekernels.kernels.grouped_gemm): its configs, the shape of a call,
the heuristic, the tuner's search space and the warm-up set. No CuTeDSL here: everything is tested on a
CPU without compiling.

A call multiplies, for each expert e, the rows offsets[e] .. offsets[e+1] - 1 of `a` (moe_dispatch's
layout) by that expert's weight w[e] ([N, K], as nn.Linear stores it). The kernel is the GEMM kernel
of gemm_leakyrelu with its `grouped` option (one device body; see grouped_gemm.py):

- decode (swapped tiles, `swap_ab`): few rows per expert, so the weights fill the MMA's M side
  (tile_m = 64 or 128 weight rows) and an expert's rows its N side (tile_n = 8 .. 128 of them); the
  work units are (expert, row tile, weight tile) over the experts that have rows only;
- prefill (plain tiles): tile_m = 128 rows of an expert x tile_n weight rows, the dense kernel's
  three prefill tiles, on one CTA or (`cluster_m` 2, rows by TMA) a 2x1 cluster: its two CTAs take two
  adjacent row tiles of one expert and the weight tile is multicast to both, halving the weights' reads
  from L2 as the dense kernel's clusters do. An expert with an odd count of row tiles has its last one
  split the other way: the two CTAs take that row tile and two adjacent weight tiles, each loading its
  own (no multicast), so neither idles on rows past the group; with an odd count of weight tiles too,
  the last of them stays a multicast unit whose second CTA's rows are past the group (loaded, never
  stored). At 256 rows per expert (Qwen3-MoE at T = 4096) pairs alone use 68% of the rows they
  load, the split tail 81% (routing uniform at random; units_for).

Both walk the units with a persistent grid of at most one CTA per SM (a unit: one cluster's work, its
`unit_rows` rows of an expert); an expert's units are its row tiles (fastest) x its weight tiles, experts
one after another. The number of units is known only on
the device (it depends on the offsets): the host sizes the grid by `max_units`, the most a valid
routing can give, and the kernel never runs more.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, ClassVar, Iterable, Optional

from rosekernels.contract import KernelConfig, keep_order
from rosekernels.kernels.gemm_leakyrelu_plan import (
    ACTIVATIONS, DTYPES, GATE_BLOCK, PREFILL_TILES, RASTER_GROUP, SWAP_TILE_M, SWAP_TILE_N, TILE_K, one_slope,
    prefill_choice)
from rosekernels.modes import sm_count
from rosekernels.variant import MODES, check_mode

if TYPE_CHECKING:
    import torch

OP = "grouped_gemm"
# Experts per call at most: the kernel keeps each expert's first row, row count and first work unit
# in shared memory (12 bytes each), read while it walks the units.
MAX_EXPERTS = 512
# ... and, last, the weight tiles of a unit's expert (a 2x1 cluster's last odd row tile splits them).
GROUP_TABLE_INTS = 3 * MAX_EXPERTS + 2
# Threads of the producer warpgroup that gather rows by index (`gather`): 16-byte cp.async each, 8 per
# 64-element row of a k-tile.
GATHER_THREADS = 128
# The swapped (decode) tiles serve calls whose experts get this many rows on average at most; past it
# the plain 128-row tiles do.
DECODE_MAX_MEAN_ROWS = 64
# Row tiles of swapped tiles hold twice the mean rows per expert (the smallest SWAP_TILE_N that does):
# with top-k routing most experts get less than that, so few need a second row tile (which streams its
# weights again, from L2).
SWAP_ROWS_FACTOR = 2
# Work units at most (a launch's max_units stays below it): a step of the kernel's prefix sums adds 32
# experts' units, each clamped to max_units, to a carry of at most max_units, in int32.
MAX_UNITS = (2**31 - 1) // 33
# The plain tiles the grouped kernel takes: the dense prefill tiles (tile_m, tile_n, pingpong).
PLAIN_TILES = tuple((tm, tn, pp) for tm, tn, pp, _ in PREFILL_TILES)
# CTAs per cluster along the rows (plain tiles by TMA only): 2 multicasts the weight tile to two row tiles.
CLUSTERS_M = (1, 2)
# Prefill on 2x1 clusters (the weight tile multicast to two row tiles of an expert): on an H100, the gate-up
# GEMM at T = 16384 ran 474 -> 697 TFLOP/s (Mixtral-8x7B) and 405 -> 661 (one Qwen3-235B-A22B layer), 96% and
# 89% of the dense kernel's on the same FLOPs (bench/results/moe/moe_grouped_prefill.md, ninth session).
PREFILL_CLUSTER_M = 2
# The models variants_for() covers by default: (hidden, moe intermediate, experts, top-k).
MODELS = {"qwen3-30b-a3b": (2048, 768, 128, 8)}


@dataclasses.dataclass(frozen=True)
class GroupedConfig(KernelConfig):
    """One compiled grouped GEMM: every field is compiled in. The class attributes below are what the
    GEMM device class (gemm_leakyrelu._GemmLeakyReluSm90) reads besides the fields: a grouped kernel
    has no K splits, K-major weights, and clusters of 1 or 2 CTAs along its rows only."""

    OP = OP
    # Options at their defaults are left out of the key; slope where the activation does not read it.
    KEY_DEFAULTS = {"gather": False, "row_scale": False, "stages": 0, "pdl": True, "cluster_m": 1,
                    "slope": lambda c: None if c.activation == "leaky_relu" else c.slope}

    dtype: str = "bf16"  # a, w and out: "bf16" | "fp16"
    bias: str = "none"  # "none" | the bias dtype (bias [E, N]): the input dtype or "fp32"
    activation: str = "none"  # one of ACTIVATIONS
    gated: bool = False  # out = act(gate) * up: w[e] holds its gate rows, then its up rows (N / 2 columns)
    slope: float = 0.01  # LeakyReLU's negative slope (leaky_relu only)
    tile_m: int = 128
    tile_n: int = 256
    pingpong: bool = False
    swap_ab: bool = False  # decode: the weights on the MMA's M side, an expert's rows on its N side
    gather: bool = False  # the rows are a's rows a_index[r] (cp.async), not a's rows r (TMA)
    row_scale: bool = False  # out row r is multiplied by row_scale[r] (fp32), after the activation
    stages: int = 0  # A/B shared-memory stages; 0: as many as fit
    pdl: bool = True  # programmatic dependent launch
    cluster_m: int = 1  # plain tiles by TMA: 2, two row tiles of an expert share (multicast) the weight tile

    grouped: ClassVar[bool] = True
    b_major: ClassVar[str] = "k"
    cluster_n: ClassVar[int] = 1
    split_k: ClassVar[bool] = False
    splits: ClassVar[int] = 1
    raster_group: ClassVar[int] = RASTER_GROUP

    def __post_init__(self) -> None:
        one_slope(self)
        super().__post_init__()

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be bf16 or fp16, got {self.dtype!r}")
        if self.bias not in ("none", self.dtype, "fp32"):
            raise ValueError(f"a {self.dtype} grouped GEMM takes a {self.dtype} or fp32 bias, not {self.bias!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.swap_ab:
            if self.pingpong or self.tile_m not in SWAP_TILE_M or self.tile_n not in SWAP_TILE_N:
                raise ValueError(f"swapped tiles are cooperative, {SWAP_TILE_M} weight rows x {SWAP_TILE_N} rows")
        elif (self.tile_m, self.tile_n, self.pingpong) not in PLAIN_TILES:
            raise ValueError(f"plain tiles are (tile_m, tile_n, pingpong) in {PLAIN_TILES}")
        if self.stages == 1 or self.stages < 0:
            raise ValueError(f"stages must be 0 (as many as fit) or at least 2, got {self.stages}")
        if self.cluster_m not in CLUSTERS_M or (self.cluster_m > 1 and (self.swap_ab or self.gather)):
            raise ValueError(f"cluster_m must be one of {CLUSTERS_M}; 2 only on plain tiles whose rows come by TMA "
                             "(not swap_ab, not gather)")

    @property
    def mode(self) -> str:
        return "decode" if self.swap_ab else "prefill"

    @property
    def a_rows(self) -> int:
        """Rows of A loaded per k-tile: whole tiles (the dense kernel's field)."""
        return self.tile_m

    @property
    def row_tile(self) -> int:
        """Rows of an expert per work unit (the MMA's N side when swapped)."""
        return self.tile_n if self.swap_ab else self.tile_m

    @property
    def unit_rows(self) -> int:
        """Rows of an expert per work unit: a cluster's row tiles."""
        return self.row_tile * self.cluster_m

    @property
    def weight_tile(self) -> int:
        """Weight rows per work unit (gated: gate and up rows together)."""
        return self.tile_m if self.swap_ab else self.tile_n


@dataclasses.dataclass(frozen=True)
class GroupedShape:
    """One call: `rows` rows grouped over `experts` experts times w [experts, n, k]; gated: n counts the
    gate and up rows (out has n / 2 columns). gather: a's rows by index; row_scale: a scale per row."""

    SIZE_FIELDS = ("rows",)  # varies per call (tokens x top-k): bucketed by the tuned-config store
    rows: int
    experts: int = 128
    n: int = 1536
    k: int = 2048
    dtype: str = "bf16"
    bias: str = "none"
    activation: str = "silu"
    gated: bool = True
    slope: float = 0.01
    gather: bool = False
    row_scale: bool = False
    pdl: bool = True

    def __post_init__(self) -> None:
        one_slope(self)

    @classmethod
    def defaults(cls, mode: str) -> "GroupedShape":
        """Qwen3-30B-A3B's gate-up GEMM (128 experts, top-8): 16 tokens (decode) or 4096 (prefill)."""
        check_mode(mode)
        return cls(rows=(16 if mode == "decode" else 4096) * 8)

    @classmethod
    def of(cls, a: "torch.Tensor", w: "torch.Tensor", rows: int, bias: "torch.Tensor | None", activation: str,
           gated: bool, slope: float, gather: bool, row_scale: bool, pdl: bool) -> "GroupedShape":
        """The shape of a grouped_gemm call on a [., K], w [E, N, K] and `rows` output rows."""
        from rosekernels import checks  # not at the top: this module is read without torch

        experts, n, k = w.shape
        return cls(rows, experts, n, k, checks.DTYPE_NAME[a.dtype],
                   "none" if bias is None else checks.DTYPE_NAME[bias.dtype], activation, gated, slope, gather,
                   row_scale, pdl)


def check_sizes(rows: int, experts: int, n: int, k: int, gated: bool) -> None:
    """ValueError unless the kernel takes the sizes (the op says it before anything is written)."""
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"the grouped GEMM takes 1 to {MAX_EXPERTS} experts, got {experts}")
    if n % (2 * GATE_BLOCK if gated else 8) or k % 8:
        what = f"a multiple of {2 * GATE_BLOCK} (gate and up rows in blocks of {GATE_BLOCK})" if gated else \
            "a multiple of 8"
        raise ValueError(f"N must be {what} and K a multiple of 8 (16-byte rows), got N={n}, K={k}")
    if max_units_for(rows, experts, n, min(SWAP_TILE_N), min(SWAP_TILE_M)) >= MAX_UNITS:
        raise ValueError(f"{rows} rows over {experts} experts x N={n} is too large for the kernel's work "
                         f"units (at most {MAX_UNITS})")


def unit_count(tiles, weight_tiles, cluster_m: int, ceil_div=lambda a, b: -(-a // b)):
    """The work units of an expert of `tiles` row tiles and `weight_tiles` weight tiles: one per pair on
    one CTA; on a 2x1 cluster its row tiles in pairs, an odd last one over pairs of weight tiles. The
    kernel's group scan calls it on Int32 values with cute.ceil_div, the host's model on ints."""
    if cluster_m == 1:
        return tiles * weight_tiles
    return tiles // 2 * weight_tiles + tiles % 2 * ceil_div(weight_tiles, 2)


def units_for(config: GroupedConfig, rows: int, n: int) -> int:
    """The work units of one expert with `rows` rows, as the kernel counts them (`unit_count`)."""
    return unit_count(math.ceil(rows / config.row_tile), math.ceil(n / config.weight_tile), config.cluster_m)


def max_units_for(rows: int, experts: int, n: int, row_tile: int, weight_tile: int) -> int:
    """The most work units a call can have when its offsets are a valid grouping of `rows` rows: every
    expert with rows may end in a partial row tile, and at most min(experts, rows) experts have rows."""
    return (math.ceil(rows / row_tile) + min(experts, rows)) * math.ceil(n / weight_tile)


def max_units(config: GroupedConfig, rows: int, experts: int, n: int) -> int:
    return max_units_for(rows, experts, n, config.unit_rows, config.weight_tile)


# ---------------------------------------------------------------------------------------------
# The contract: the heuristic, the search space, the warm-up set.


def _base(shape: GroupedShape) -> dict:
    return dict(dtype=shape.dtype, bias=shape.bias, activation=shape.activation, gated=shape.gated,
                slope=float(shape.slope), gather=shape.gather, row_scale=shape.row_scale, pdl=bool(shape.pdl))


def decode_mode(rows: int, experts: int) -> bool:
    """Whether the swapped (decode) tiles serve a call: at most DECODE_MAX_MEAN_ROWS rows per expert
    on average."""
    return rows <= DECODE_MAX_MEAN_ROWS * experts


def swap_rows(rows: int, experts: int) -> int:
    """The row tile of the swapped heuristic: the smallest SWAP_TILE_N of at least SWAP_ROWS_FACTOR
    times the mean rows per expert."""
    want = SWAP_ROWS_FACTOR * math.ceil(rows / experts)
    return next((t for t in SWAP_TILE_N if t >= want), SWAP_TILE_N[-1])


def config_for(shape: GroupedShape, sms: int | None = None) -> GroupedConfig:
    """The heuristic's config: swapped 64-row weight tiles with `swap_rows` rows at up to
    DECODE_MAX_MEAN_ROWS rows per expert (64 rows: the weight-streaming tile the dense GEMM's cost
    model rates best); else the dense prefill wave model's tile for all rows together, on 2x1 clusters
    where the rows come by TMA (PREFILL_CLUSTER_M)."""
    if decode_mode(shape.rows, shape.experts):
        return GroupedConfig(**_base(shape), tile_m=64, tile_n=swap_rows(shape.rows, shape.experts), swap_ab=True)
    sms = sm_count() if sms is None else sms
    tile_m, tile_n, pingpong = prefill_choice(shape.rows, shape.n, shape.k, sms)
    return GroupedConfig(**_base(shape), tile_m=tile_m, tile_n=tile_n, pingpong=pingpong,
                         cluster_m=1 if shape.gather else PREFILL_CLUSTER_M)


def candidates(shape: GroupedShape, sms: int | None = None) -> list[GroupedConfig]:
    """config_for's pick first, then every tile of its mode: swapped tiles of each SWAP_TILE_M weight
    rows x SWAP_TILE_N rows (decode), or each plain tile (prefill)."""
    pick = config_for(shape, sms)
    if pick.swap_ab:
        found = [GroupedConfig(**_base(shape), tile_m=tm, tile_n=tn, swap_ab=True)
                 for tm in SWAP_TILE_M for tn in SWAP_TILE_N]
    else:
        clusters = (1,) if shape.gather else CLUSTERS_M
        found = [GroupedConfig(**_base(shape), tile_m=tm, tile_n=tn, pingpong=pp, cluster_m=c)
                 for tm, tn, pp in PLAIN_TILES for c in clusters]
    return list(dict.fromkeys([pick, *found]))


rank = keep_order  # no cost model rates the candidates against each other yet


def model_gemms(model) -> list[tuple[str, int, int, str, bool]]:
    """(role, N, K, activation, gated) of the expert GEMMs of a MoE decoder layer of `model` (a
    rosekernels.models.ModelDims) as rosekernels.moe_experts runs them: gate-up (N = 2 x the experts'
    intermediate size, SwiGLU) and down; none for a dense model or sizes the kernel does not take."""
    if not model.experts or not model.moe_intermediate or model.experts > MAX_EXPERTS:
        return []
    gemms = [("experts gate/up", 2 * model.moe_intermediate, model.hidden, "silu", True),
             ("experts down", model.hidden, model.moe_intermediate, "none", False)]
    ok = all(n % (2 * GATE_BLOCK if gated else 8) == 0 and k % 8 == 0 for _, n, k, _, gated in gemms)
    return gemms if ok else []


def _model_dims(models: Optional[Iterable]) -> list[tuple[int, int, int, int, str]]:
    if models is None:
        return [(h, i, e, k, "bf16") for h, i, e, k in MODELS.values()]
    return [(m.hidden, m.moe_intermediate, m.experts, m.topk, m.dtype) for m in models
            if m.dtype in DTYPES and model_gemms(m)]


def variants_for(models: Optional[Iterable] = None, modes: Iterable[str] = MODES,
                 max_tokens: Optional[int] = None) -> list[GroupedConfig]:
    """The configs warm-up compiles for the expert GEMMs of `models` (rosekernels.models.ModelDims;
    None: MODELS in bf16): every config config_for picks in `modes` for calls of 1 to max_tokens tokens
    (None: any), the rows being tokens x top-k. Decode: its pick at every token count decode_mode gives
    the swapped tiles (up to DECODE_MAX_MEAN_ROWS x experts / top-k tokens); prefill (when max_tokens,
    if given, passes those), every plain tile (config_for's pick depends on the SM count)."""
    modes = tuple(modes)
    configs = []
    for hidden, inter, experts, topk, dtype in _model_dims(models):
        last = 0  # the most tokens of a call on the swapped tiles
        while (max_tokens is None or last < max_tokens) and decode_mode((last + 1) * topk, experts):
            last += 1
        for n, k, activation, gated in ((2 * inter, hidden, "silu", True), (hidden, inter, "none", False)):
            shape = GroupedShape(1, experts, n, k, dtype=dtype, activation=activation, gated=gated)
            if "decode" in modes:
                configs += [config_for(dataclasses.replace(shape, rows=t * topk)) for t in range(1, last + 1)]
            if "prefill" in modes and (max_tokens is None or max_tokens > last):
                configs += [GroupedConfig(**_base(shape), tile_m=tm, tile_n=tn, pingpong=pp,
                                          cluster_m=PREFILL_CLUSTER_M) for tm, tn, pp in PLAIN_TILES]
    return list(dict.fromkeys(configs))


def row_range(config: GroupedConfig, experts: int) -> tuple[int, int]:
    """The rows a workload tests `config` at with `experts` experts: the range of its mode (decode: up to
    DECODE_MAX_MEAN_ROWS per expert; prefill: from there, a few tiles more, small to keep samples cheap)."""
    limit = DECODE_MAX_MEAN_ROWS * experts
    if config.swap_ab:
        return 1, min(limit, 2048)
    return limit + 1, limit + 4 * config.tile_m * min(experts, 4)
