"""Planning for gemm_leakyrelu: its configs and problem shapes, and the cost models that choose a tile
shape and K split count for a problem. No CuTeDSL here: everything is tested and swept on a CPU.

- Prefill (M > DECODE_MAX_M) is compute bound: a wave model trades each tile shape's MMA efficiency
  against wave quantization on the SMs (`prefill_choice`); 2-CTA clusters multicast the B tiles.
- Decode (M <= DECODE_MAX_M) streams the weights: one tile of tokens, and K split across CTAs when the
  weight tiles alone would leave SMs idle. Plain tiles put the tokens on the MMA's M side (64 rows, of
  which only the `a_rows` that hold M are loaded, or 128); swapped tiles put the weights there and the
  tokens on its N side (8-128), as cuBLAS does at small M. A cost model fitted to a broad H200 sweep
  picks the tile kind, width and split count (`decode_cost`, `decode_choice`).

`config_for(shape)` is the heuristic's choice, `candidates(shape)` every config that can run the shape
(the tuner's and the benchmark sweep's search space), `variants_for()` what warm-up compiles.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Iterable, Optional

from rosekernels.contract import KernelConfig
from rosekernels.modes import sm_count
from rosekernels.variant import MODES, check_mode

if TYPE_CHECKING:
    import torch

OP = "gemm_leakyrelu"
# Epilogue activations: act(x) after the bias. "gelu_tanh" is GELU's tanh approximation.
ACTIVATIONS = ("none", "relu", "leaky_relu", "silu", "gelu_tanh")
# Gated GEMMs (SwiGLU: out = act(a @ w_gate^T) * (a @ w_up^T)) take the gate and up rows of w
# interleaved in blocks of GATE_BLOCK rows: w[16 i + j] = gate[8 i + j], w[16 i + 8 + j] = up[8 i + j]
# (j < 8). Both halves of a pair then sit in one thread's accumulator, plain or swapped, so the
# product needs no data exchange. `gate_up_rows` makes that layout from separate gate and up.
GATE_BLOCK = 8
TILE_K = 64  # 128 bytes of bf16/fp16: one SW128 swizzle atom along K
SMEM_CAPACITY = 232448  # sm_90: 227 KiB of shared memory per block
DECODE_MAX_M = 128  # token counts up to this use the decode variants (one M tile, split-K)
DTYPES = ("bf16", "fp16")

# Prefill tile candidates and their relative MMA efficiency per output element (the wave model
# trades it against wave quantization).
PREFILL_TILES = (
    # (tile_m, tile_n, pingpong, efficiency)
    (128, 256, False, 1.00),
    (128, 192, True, 1.00),
    (128, 128, True, 0.99),
)
# A cooperative tile's epilogue stalls its MMAs for about as long as this many k-tiles of its
# mainloop take (pingpong hides it under the other warpgroup's mainloop). This constant and the
# efficiencies above are fitted to H200 sweeps over 23 prefill shapes
# (bench/results/gemm/sweeps/gemm_leakyrelu_prefill_sweep.md): the model's tile is within 1.2% of the fastest
# of the three on each.
COOP_EPILOGUE_K_TILES = 2
RASTER_GROUP = 8  # cluster rows per band of the tile walk: both operands' bands stay in L2
# What the prefill search space adds to the heuristic's 2x1 clusters and raster groups of 8. 2x2
# clusters (both operands multicast) ran 3-21% slower than 2x1 on the H200: left out.
PREFILL_CLUSTERS = ((2, 1), (1, 2))
PREFILL_RASTER_GROUPS = (RASTER_GROUP, 2)

# Decode (M <= 128): weight-bandwidth bound. Plain tiles: tile_m rows of tokens (64: a_rows of
# them loaded, 128) x tile_n weight rows; swapped tiles: tile_m weight rows x tile_n tokens.
DECODE_TILE_N = (64, 128, 256)  # weight rows of plain tiles
# Past 64 tokens, plain 128-row tiles may also take the width that fills the SMs with one wave of
# tiles x K splits (`fitted_width`: a multiple of 16): at 18944 weight rows, 256-wide tiles leave 58
# of 132 SMs idle and 128-wide ones make two waves.
FIT_TILE_M = 128
MAX_SPLITS = 16
# The split counts the decode cost model was fitted on (the sweeps' --sweep-splits): the heuristic picks
# among these only. Between them the model was guessing: at 1024 x 4096 and M = 1-16 it picked 5 splits,
# which sip-tune level 1 measured 1.038-1.045x slower than 6 on the H200; the tuner still searches all.
FITTED_SPLITS = (1, 2, 3, 4, 6, 8)
A_ROWS = (8, 16, 32, 64)  # rows of A a 64-row decode tile loads: the smallest that holds M
# Swapped decode tiles: tokens per tile (the MMA's N side, the smallest that holds M) and weight
# rows per tile (64: one warpgroup, 128: two).
SWAP_TILE_N = (8, 16, 32, 64, 96, 128)
SWAP_TILE_M = (64, 128)
# The tuner also searches swapped 64 x 64 tiles past 64 tokens (two token tiles: twice the CTAs
# without splitting K; cuBLAS runs 64 x 64 tiles at M = 128): on the H200 sweep of M = 96 and 128
# (bench/results/gemm/sweeps/gemm_leakyrelu_decode_m64x2.md) they were the fastest config on 6 of 34 shapes
# (128 x 3584 x 3584: 1.05x the next, 128 x 768 x 2048: 1.07x), a few % behind elsewhere. The cost
# model was not fitted to them and rates them too well at M = 96 (its pick would lose 1.47x at
# 96 x 4096 x 4096), so the heuristic does not consider them. 128-row swapped and plain 64-row
# tiles on two M tiles won on no shape there and are not searched.
TWO_TOKEN_TILES = 64
# The tuner also searches swapped 64-row tiles on clusters of cluster_m x cluster_n CTAs: cluster_n
# token tiles (M's tokens split into the fewest SWAP_TILE_N that hold 1/cluster_n of them, the last
# holding at least one token) share each weight tile, which is multicast to them (read from L2 once;
# cuBLAS's choice at M = 128: nvjet 64 x 64 tiles on clusters); cluster_m weight tiles share each
# token tile the same way (cuBLAS's most common choice at every M: 4 weight tiles, TNT 64 x 8 on 4x1).
CLUSTERS = ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (4, 2), (2, 4))  # (cluster_m, cluster_n)
SWAP_CLUSTERS = CLUSTERS[1:]
SWAP128_CLUSTERS = ((2, 1), (4, 1), (1, 2), (2, 2))  # swapped 128-row tiles (cuBLAS: 128 x 96 on 4x1)
# The heuristic takes clusters from this many tokens (the sweeps its cost model was fitted to timed
# clusters from 16 tokens, and on four shapes at 8), not for gated GEMMs (no sweep timed them on
# clusters), and only the cluster shapes its fitted model picks on some model shape (28 N x K,
# M = 16-128); the rest are the tuner's.
CLUSTER_MIN_M = 16
HEURISTIC_CLUSTERS = {("swapped", 64): ((4, 1), (1, 2), (2, 1))}  # (kind, tile_m): cluster shapes
# Plain tiles whose A tile is whole (a_rows = tile_m, from 33 tokens) on clusters: the token tile
# multicast to 2 or 4 weight tiles. The tuner also searches, past 64 tokens, two 64-token tiles
# sharing each weight tile (2xC: cuBLAS's nvjet 96 x 64 kernels at M = 128 on N = 4608-6144); on the
# H200 they won on none of 51 shapes (bench/results/gemm/sweeps/gemm_leakyrelu_decode_clusters.md).
PLAIN_CLUSTERS = ((1, 2), (1, 4))
TWO_TOKEN_CLUSTERS = ((2, 1), (2, 2), (2, 4))
MIN_SPLIT_K_TILES = 4  # k-tiles per split at least: shorter splits are mostly pipeline fill
# The sweeps time configs of at most this many waves of work units (more never won on the H200), so
# the heuristic prefers them: past them its cost model extrapolates (it rated 5 waves of gated
# 64 x 64 tiles best at 37888 x 3584, a config no sweep timed).
FITTED_WAVES = 3
COUNTER_SLOTS = 4096  # split-K tile counters per stream: a split launch has at most this many tiles
# The decode cost model (`decode_cost`), fitted (tools/fit_gemm_decode.py) to nine H200 sweeps by
# minimising the time lost by the model's pick: 1,813 timed configs on 91 shapes (13 MLP and
# attention-projection N x K of Llama-3-8B, Qwen3-8B and Qwen2.5-7B, M = 1-128;
# bench/results/gemm/sweeps/gemm_leakyrelu_decode_broad.md), 34 shapes at M = 96 and 128 with the fitted widths
# (gemm_leakyrelu_decode_fitted.md), the gated (SwiGLU) GEMMs of those three models at M = 1-128
# (21 shapes, gemm_swiglu_sweep.md), 10 wide-N non-gated shapes (gemm_leakyrelu_decode_wide*.md) and
# three sweeps with clusters (7,170 configs on 136 shapes of 17 N x K, M = 16-128:
# gemm_leakyrelu_decode_clusters.md). Its picks lose 2.9% on average to each shape's fastest config,
# 20% at worst (96 x 37888 x 3584, gated); on a fourth cluster sweep of 16 shapes it was not fitted to
# (gemm_leakyrelu_decode_clusters_unseen), 2.2% (the model before clusters: 4.8%). The L2 term is
# what makes clusters pay at M = 64-128: there the token tiles that every CTA along N re-reads from
# L2 outweigh the weights, and multicast reads them once per cluster.
_DRAM_BW = 3.9e6  # bytes per us: the whole GPU streaming weights (measured, not fitted)
_SM_BW = 4.102e4  # bytes per us one SM streams, times the tile family's efficiency below
_MMA_RATE = 3.046e6  # multiply-adds per us per SM
_WAVE_US = 2.431  # fixed cost per unit a CTA runs in sequence (pipeline fill, epilogue)
_SPLIT_US = 4.0  # fixed cost of a plain split-K launch
_SPLIT_SWAPPED_US = 1.369  # and of a swapped one
_PARTIALS_BW = 4.416e4  # bytes per us the last split reads partials at
_L2_BW = 1.107e7  # bytes per us the SMs read from L2 together
# Weight-streaming efficiency per tile family (_efficiency): (kind, tile_m, width of plain tiles),
# kind "plain", "gated" (plain tiles of a gated GEMM) or "swapped" (gated or not: the same speed).
_EFFICIENCY = {
    ("plain", 64, 64): 1.09, ("plain", 64, 128): 1.98, ("plain", 64, 256): 1.56,
    ("plain", 128, 32): 0.59, ("plain", 128, 64): 0.75, ("plain", 128, 128): 2.30, ("plain", 128, 256): 1.72,
    ("gated", 64, 64): 0.90, ("gated", 64, 128): 0.67, ("gated", 64, 256): 0.65,
    ("gated", 128, 64): 0.87, ("gated", 128, 128): 1.78, ("gated", 128, 256): 0.61,
    ("swapped", 64, None): 1.03, ("swapped", 128, None): 0.80,
}
# A cluster shape's factor on its tile family's efficiency (kind "plain" or "swapped", cluster_m,
# cluster_n; 1 without a cluster).
_MULTICAST = {
    ("plain", 1, 2): 0.89, ("plain", 1, 4): 0.96,
    ("swapped", 1, 2): 1.38, ("swapped", 1, 4): 0.77, ("swapped", 2, 1): 0.76, ("swapped", 2, 2): 0.96,
    ("swapped", 2, 4): 0.80, ("swapped", 4, 1): 1.45, ("swapped", 4, 2): 0.91,
}
_PLAIN_EFFICIENCY = {  # (kind, tile_m): the (width, efficiency) anchors of plain tiles
    (kind, tile_m): sorted((w, e) for (k, tm, w), e in _EFFICIENCY.items() if (k, tm) == (kind, tile_m))
    for kind in ("plain", "gated") for tile_m in (64, 128)}



# ---------------------------------------------------------------------------------------------
# Configs and shapes.


def one_slope(options) -> None:
    """Give a frozen config or shape with `activation` and `slope` the slope 0.01 unless its activation is
    leaky_relu: only that one reads it, so every other activation has one spelling (one key, one kernel)."""
    if options.activation != "leaky_relu":
        object.__setattr__(options, "slope", 0.01)


@dataclasses.dataclass(frozen=True)
class GemmConfig(KernelConfig):
    """One launch: the compile-time choices of a specialization (its `variant()`), then the launch
    policy the same compiled kernel takes at run time (K splits, raster group)."""

    OP = OP
    POLICY_FIELDS = ("splits", "raster_group")  # not compiled in: left out of variant()
    # The keys predate these fields (a_rows: of whole A tiles); slope is left out where the activation
    # does not read it.
    KEY_DEFAULTS = {"a_rows": lambda c: c.tile_m, "swap_ab": False, "stages": 0, "activation": "leaky_relu",
                    "gated": False, "pdl": True, "slope": lambda c: None if c.activation == "leaky_relu" else c.slope}

    dtype: str = "bf16"  # a, b and out: "bf16" | "fp16"
    b_major: str = "k"  # memory order of b seen as [N, K]: "k" (row-major [N, K]) | "n" ([K, N])
    bias: str = "none"  # "none" | the bias dtype: "bf16" | "fp16" | "fp32"
    slope: float = 0.01  # LeakyReLU negative slope, constant-folded (leaky_relu only)
    tile_m: int = 128
    tile_n: int = 256
    cluster_m: int = 2  # CTAs along M sharing (multicasting) each B tile
    cluster_n: int = 1  # CTAs along N sharing each A tile
    pingpong: bool = False  # one tile per warpgroup, alternating mainloops
    split_k: bool = False  # decode: K may be split across CTAs at runtime
    # Decode with M <= a_rows < tile_m = 64: rows of A loaded per k-tile (None: tile_m).
    a_rows: Optional[int] = None
    # Decode: the weights are the MMA's M side (tile_m of N) and the tokens its N side (tile_n of
    # M, down to 8), so no MMA row is padding; the kernel computes out^T.
    swap_ab: bool = False
    stages: int = 0  # A/B shared-memory stages; 0: as many as fit
    activation: str = "leaky_relu"  # one of ACTIVATIONS
    gated: bool = False  # out = act(gate) * up over GATE_BLOCK-interleaved weight rows: N / 2 columns
    # Programmatic dependent launch (the kernel waits with griddepcontrol.wait before its loads and
    # releases the next kernel after its last mainloop either way; this sets the launch attribute).
    pdl: bool = True
    # Launch policy, not compiled in (left out of variant()):
    splits: int = 1  # K splits (split-K variants only)
    raster_group: int = RASTER_GROUP  # cluster rows per band of the persistent tile walk

    def __post_init__(self) -> None:
        if self.a_rows is None:
            object.__setattr__(self, "a_rows", self.tile_m)
        one_slope(self)
        super().__post_init__()

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be bf16 or fp16, got {self.dtype!r}")
        if self.b_major not in ("k", "n"):
            raise ValueError(f"b_major must be 'k' or 'n', got {self.b_major!r}")
        if self.bias not in ("none", "bf16", "fp16", "fp32"):
            raise ValueError(f"bias must be none/bf16/fp16/fp32, got {self.bias!r}")
        if self.bias not in ("none", self.dtype, "fp32"):
            raise ValueError(f"a {self.dtype} GEMM takes a {self.dtype} or fp32 bias, not {self.bias}")
        if self.pingpong and (self.tile_m != 128 or self.tile_n > 192):
            raise ValueError("pingpong tiles are 128 x (<= 192): one warpgroup holds the accumulator")
        if not self.pingpong and self.tile_m not in (64, 128):
            raise ValueError("cooperative tiles are 64 or 128 rows (one 64-row warpgroup each)")
        if self.swap_ab:
            if not self.split_k or self.tile_n not in SWAP_TILE_N:
                raise ValueError(f"swapped tiles are decode (split-K) tiles with tile_n in {SWAP_TILE_N}")
        elif self.tile_n % (32 if self.gated else 16) or not 32 <= self.tile_n <= 256:
            raise ValueError("tile_n must be a multiple of 16 (gated: 32) in [32, 256]")
        if (self.cluster_m, self.cluster_n) not in CLUSTERS:
            raise ValueError(f"clusters are {CLUSTERS}, got {self.cluster_m}x{self.cluster_n}")
        if self.cluster_m * self.cluster_n > 2 and not self.split_k:
            raise ValueError("clusters of more than 2 CTAs are for decode tiles only")
        if self.split_k and self.pingpong:
            raise ValueError("split-K variants are cooperative")
        if self.split_k and self.cluster_m * self.cluster_n > 1 and self.a_rows not in (None, self.tile_m):
            raise ValueError("decode tiles that load a_rows < tile_m rows of A take no cluster")
        if self.split_k and not self.swap_ab and self.cluster_m > 1 and self.tile_m != 64:
            raise ValueError("plain decode tiles share weight tiles only between two 64-token tiles")
        if self.a_rows != self.tile_m and (self.a_rows not in (8, 16, 32) or self.tile_m != 64
                                           or not self.split_k or self.swap_ab):
            raise ValueError("a_rows < tile_m is 8, 16 or 32 and only for split-K tiles of 64 rows")
        if self.splits < 1 or (self.splits > 1 and not self.split_k):
            raise ValueError(f"{self.splits} K splits: at least 1, and more only for split-K variants")
        if self.raster_group < 1:
            raise ValueError(f"raster_group must be at least 1, got {self.raster_group}")
        if self.stages == 1 or self.stages < 0:
            raise ValueError(f"stages must be 0 (as many as fit) or at least 2, got {self.stages}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")

    @property
    def mode(self) -> str:
        return "decode" if self.split_k else "prefill"



# ---------------------------------------------------------------------------------------------
# The kernel's geometry, from a config alone: a GemmConfig's, or a grouped one's (grouped_gemm_plan), which
# the same device class runs.


def wg_per_tile(config) -> int:
    """MMA warpgroups sharing one tile: tile_m / 64 (cooperative), 1 (pingpong: a tile each)."""
    return 1 if config.pingpong else config.tile_m // 64


def mma_warpgroups(config) -> int:
    return 2 if config.pingpong else wg_per_tile(config)


def tile_slots(config) -> int:
    """Tiles in flight per CTA."""
    return mma_warpgroups(config) // wg_per_tile(config)


def out_n(config) -> int:
    """Output columns of a plain tile (gated: the products of its gate/up column pairs)."""
    return config.tile_n // 2 if config.gated and not config.swap_ab else config.tile_n


def epi_tile(config) -> tuple[int, int]:
    """The epilogue's subtile: the rows one pass of the tile's warpgroups covers, 32 columns (16 where
    the tile is an odd multiple of 16 wide)."""
    return 64 * wg_per_tile(config), 32 if out_n(config) % 32 == 0 else 16


def smem_stages(config, table_bytes: int = 0) -> tuple[int, int]:
    """(A/B stages, epilogue buffers per tile slot): shared memory filled with A/B stages after 2
    epilogue buffers per tile slot and `table_bytes` of other tables (the grouped option's), the
    leftover to more epilogue buffers (up to 4). A stages are a_rows rows apart, plus a tail so that the
    last stage's WGMMA view stays inside the buffer. Swapped tiles store from registers (no epilogue
    buffers); `stages`, when set, caps the A/B stages."""
    elem = 2  # bf16/fp16
    ab_bytes = (config.a_rows + config.tile_n) * TILE_K * elem
    if config.swap_ab:
        ab_stage = (SMEM_CAPACITY - 2048 - table_bytes) // ab_bytes
        return (min(ab_stage, config.stages) if config.stages else ab_stage), 0
    epi = epi_tile(config)
    epi_bytes = epi[0] * epi[1] * elem * tile_slots(config)
    fixed = 2048 + 4 * config.tile_n * tile_slots(config)  # mbarriers, flags, alignment, bias
    fixed += (config.tile_m - config.a_rows) * TILE_K * elem + table_bytes  # the A tail
    ab_stage = (SMEM_CAPACITY - fixed - 2 * epi_bytes) // ab_bytes
    if config.stages:
        ab_stage = min(ab_stage, config.stages)
    left = SMEM_CAPACITY - fixed - ab_stage * ab_bytes
    return ab_stage, min(4, left // epi_bytes)


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """One call: out[m, n] = act(a[m, k] @ b[n, k]^T + bias) (leaky_relu: with `slope`); gated:
    out[m, n // 2] = act(gate) * up, n counting the interleaved gate and up rows of b."""

    SIZE_FIELDS = ("m",)  # varies per call (tokens): bucketed by the tuned-config store (contract.bucket)
    m: int
    n: int = 14336
    k: int = 4096
    dtype: str = "bf16"
    b_major: str = "k"
    bias: str = "none"
    slope: float = 0.01
    activation: str = "leaky_relu"
    gated: bool = False
    pdl: bool = True  # programmatic dependent launch (gemm(enable_pdl=...))

    def __post_init__(self) -> None:
        one_slope(self)

    @property
    def mode(self) -> str:
        return "decode" if self.m <= DECODE_MAX_M else "prefill"

    @classmethod
    def defaults(cls, mode: str) -> "GemmShape":
        """What `sip-tune --mode` tunes without --shape: an MLP up projection (Llama-3-8B sizes)."""
        check_mode(mode)
        return cls(m=16 if mode == "decode" else 8192)

    @classmethod
    def of(cls, a: torch.Tensor, b_nk: torch.Tensor, bias: torch.Tensor | None, activation: str, gated: bool,
           slope: float, pdl: bool) -> "GemmShape":
        """The shape of a gemm call on a [M, K], b seen as [N, K] and a bias [N] or None."""
        from rosekernels import checks  # not at the top: sip-tune --list reads this module without torch

        (m, k), n = a.shape, b_nk.shape[0]
        name = checks.DTYPE_NAME
        return cls(m, n, k, name[a.dtype], "k" if b_nk.stride(1) == 1 else "n",
                   name[bias.dtype] if bias is not None else "none", slope, activation, gated, pdl)


def tiles_n(config: GemmConfig, n: int) -> int:
    """Plain tiles along N that the grid covers: whole clusters of them, the last maybe past N."""
    return math.ceil(n / (config.tile_n * config.cluster_n)) * config.cluster_n


def output_tiles(config: GemmConfig, m: int, n: int) -> int:
    """Output tiles of an [m, K] x [n, K] problem (swapped: tile_m along N, tile_n along M), those of
    a 1x2 cluster past N (swapped: past M) included."""
    if config.swap_ab:
        return (math.ceil(n / (config.tile_m * config.cluster_m)) * config.cluster_m
                * math.ceil(m / (config.tile_n * config.cluster_n)) * config.cluster_n)
    return math.ceil(m / config.tile_m) * tiles_n(config, n)


def partial_floats(config: GemmConfig, m: int, n: int) -> int:
    """fp32 split-K partials of a launch: the valid rows (M) of each split's tiles, or, swapped,
    whole tiles."""
    if config.swap_ab:
        return config.splits * output_tiles(config, m, n) * config.tile_m * config.tile_n
    return config.splits * m * tiles_n(config, n) * config.tile_n


def cluster_tokens(m: int, cluster_n: int) -> Optional[int]:
    """Tokens per CTA (tile_n) of a swapped tile whose M tokens are split over `cluster_n` CTAs: the
    fewest SWAP_TILE_N that hold 1/cluster_n of them; None where the last CTA would hold none."""
    tokens = next((t for t in SWAP_TILE_N if cluster_n * t >= m), None)
    return tokens if tokens is not None and (cluster_n - 1) * tokens < m else None


def two_m_tiles(config: GemmConfig, m: int) -> bool:
    """Whether a decode config covers M's tokens with two M tiles (past 64 tokens: plain 64-row tiles,
    TWO_TOKEN_TILES-token swapped tiles off clusters): the tuner's, never decode_configs', so the
    cost model is not fitted to them."""
    if m <= 64:
        return False
    return config.tile_n == TWO_TOKEN_TILES and config.cluster_n == 1 if config.swap_ab else config.tile_m == 64


def check_fits(config: GemmConfig, m: int, n: int) -> None:
    """Raise ValueError unless `config` can run an [m, K] x [n, K] problem: its K splits fit the tile
    counters and 32-bit partials indexing, and a tile that loads a_rows rows of A holds M."""
    # A plain tile's counter is indexed over whole clusters along M too (tiles past M included).
    counters = output_tiles(config, m, n) if config.swap_ab else (
        math.ceil(m / (config.tile_m * config.cluster_m)) * config.cluster_m * tiles_n(config, n))
    if config.split_k and config.splits > 1 and (counters > COUNTER_SLOTS or partial_floats(config, m, n) >= 2**31):
        raise ValueError(f"{m}x{n} is too large for {config.splits} K splits of {config}")
    if config.a_rows < config.tile_m and m > config.a_rows:
        raise ValueError(f"{config} loads {config.a_rows} rows of A: M = {m} is too many")


def m_range(config: GemmConfig) -> tuple[int, int]:
    """The token counts (M) that config_for (or, for TWO_TOKEN_TILES, the tuner) gives `config`'s
    tiling along M (tile_m, a_rows), at any N and K: what tests of the config sample. Prefill: the
    same code serves every M past the decode range; small ones keep samples cheap and exercise the
    ragged tails."""
    if not config.split_k:
        return DECODE_MAX_M + 1, 4 * DECODE_MAX_M + 64
    if config.swap_ab and config.cluster_n > 1:  # 1/cluster_n of M's tokens per CTA (cluster_tokens)
        c, smaller = config.cluster_n, [t for t in SWAP_TILE_N if t < config.tile_n]
        return max(c * smaller[-1] if smaller else 0, (c - 1) * config.tile_n) + 1, c * config.tile_n
    if config.swap_ab:  # the tuner's TWO_TOKEN_TILES also serve M up to 128
        smaller = [t for t in SWAP_TILE_N if t < config.tile_n]
        largest = DECODE_MAX_M if config.tile_n == TWO_TOKEN_TILES else config.tile_n
        return (smaller[-1] + 1 if smaller else 1), largest
    if config.tile_m == 128 or config.cluster_m > 1:  # one 128-row or two 64-row token tiles
        return 65, DECODE_MAX_M
    smaller = [r for r in A_ROWS if r < config.a_rows]
    return (smaller[-1] + 1 if smaller else 1), config.a_rows


# ---------------------------------------------------------------------------------------------
# Cost models.


def fitted_width(n: int, splits: int, num_sms: int, step: int = 16) -> Optional[int]:
    """The narrowest plain tile width (a multiple of `step`, at least 32) whose tiles of N times
    `splits` fit in one wave on the SMs; None past 256 (the widest MMA) or with more splits than SMs."""
    if splits > num_sms:
        return None
    width = max(32, step * math.ceil(n / (step * (num_sms // splits))))
    return width if width <= 256 else None


def resident_ctas(config: GemmConfig, num_sms: int) -> int:
    """CTAs of `config`'s clusters resident at once, one per SM: whole clusters (the kernel's
    persistent grid asks the device; this is the estimate the cost model plans with)."""
    size = config.cluster_m * config.cluster_n
    return num_sms // size * size


def _efficiency(config: GemmConfig) -> float:
    """The weight-streaming efficiency of a tile family (_EFFICIENCY) times its cluster shape's
    factor (_MULTICAST); plain widths between the fitted ones are interpolated linearly, those
    outside take the nearest fitted one."""
    factor = _MULTICAST.get(("swapped" if config.swap_ab else "plain", config.cluster_m, config.cluster_n), 1.0)
    return factor * _tile_efficiency(config)


def _tile_efficiency(config: GemmConfig) -> float:
    if config.swap_ab:
        return _EFFICIENCY[("swapped", config.tile_m, None)]
    fitted = _PLAIN_EFFICIENCY[("gated" if config.gated else "plain", config.tile_m)]
    w = min(max(config.tile_n, fitted[0][0]), fitted[-1][0])
    (w0, e0), (w1, e1) = next((a, b) for a, b in zip(fitted, fitted[1:]) if w <= b[0])
    return e0 + (e1 - e0) * (w - w0) / (w1 - w0)


def l2_bytes(config: GemmConfig, m: int, n: int, k: int) -> int:
    """Bytes a decode launch reads from L2: every output tile's weight and token tiles over the whole
    K, a tile multicast to the CTAs of a cluster row or column read once for them. At M = 128 the
    token tiles dominate for narrow plain tiles (128 x 48: 2.7 bytes of tokens per weight byte)."""
    if config.swap_ab:
        weights, tokens, weights_shared, tokens_shared = config.tile_m, config.tile_n, config.cluster_n, config.cluster_m
    else:
        weights, tokens, weights_shared, tokens_shared = config.tile_n, config.a_rows, config.cluster_m, config.cluster_n
    k_padded = math.ceil(k / TILE_K) * TILE_K
    return output_tiles(config, m, n) * (weights / weights_shared + tokens / tokens_shared) * k_padded * 2


def decode_cost(config: GemmConfig, m: int, n: int, k: int, num_sms: int) -> float:
    """Modelled microseconds of a decode launch. Units (output tile x K split) are dealt round-robin
    to at most one CTA per SM, so the busiest CTA runs ceil(units / SMs) of them, streaming its
    weight slice (bounded by the whole GPU's bandwidth) or running its MMAs, whichever is longer;
    each unit in sequence adds a fixed cost; with splits, the last split of a tile reads every
    split's partials alone; and the whole GPU reads both operands' tiles from L2 (`l2_bytes`)."""
    k_tiles = math.ceil(k / TILE_K)
    weight_rows = config.tile_m if config.swap_ab else config.tile_n
    waves = math.ceil(output_tiles(config, m, n) * config.splits / resident_ctas(config, num_sms))
    unit_k = math.ceil(k_tiles / config.splits) * TILE_K
    stream = max(n * k * 2 / _DRAM_BW, waves * weight_rows * unit_k * 2 / (_SM_BW * _efficiency(config)),
                 l2_bytes(config, m, n, k) / _L2_BW)
    mma = waves * config.tile_m * config.tile_n * unit_k / _MMA_RATE
    cost = max(stream, mma) + waves * _WAVE_US
    if config.splits > 1:
        tile_rows = config.tile_m if config.swap_ab else min(m, config.tile_m)  # rows with partials
        cost += _SPLIT_SWAPPED_US if config.swap_ab else _SPLIT_US
        cost += tile_rows * config.tile_n * 4 * config.splits / _PARTIALS_BW
    return cost


def decode_configs(shape: GemmShape, splits: Iterable[int], num_sms: int) -> list[GemmConfig]:
    """The decode configs of `shape` with each of `splits` that fits: plain tiles of every width
    (one M tile: 64 rows, of which the fewest A_ROWS that hold M are loaded, or 128; 128-row tiles
    also at each split count's fitted_width) and swapped tiles of 64 and 128 weight rows with the
    fewest SWAP_TILE_N tokens that hold M; not gated, from CLUSTER_MIN_M tokens, each also on the
    HEURISTIC_CLUSTERS `on_clusters` gives it."""
    m, splits = shape.m, list(splits)
    tile_m = 64 if m <= 64 else 128
    a_rows = next(r for r in A_ROWS if r >= m) if tile_m == 64 else tile_m
    swap_n = next(t for t in SWAP_TILE_N if t >= min(m, SWAP_TILE_N[-1]))
    kinds = [dict(tile_m=tile_m, tile_n=tile_n, a_rows=a_rows) for tile_n in DECODE_TILE_N]
    kinds += [dict(tile_m=tile_m, tile_n=swap_n, swap_ab=True) for tile_m in SWAP_TILE_M]
    configs = [GemmConfig(**_base(shape), cluster_m=1, split_k=True, splits=s, **kind)
               for kind in kinds for s in splits]
    if tile_m == FIT_TILE_M:
        widths = {s: fitted_width(shape.n, s, num_sms, 32 if shape.gated else 16) for s in splits}
        configs += [GemmConfig(**_base(shape), cluster_m=1, split_k=True, splits=s, tile_m=tile_m, tile_n=w)
                    for s, w in widths.items() if w is not None and w not in DECODE_TILE_N]
    if m >= CLUSTER_MIN_M and not shape.gated:
        configs += on_clusters(m, configs, HEURISTIC_CLUSTERS)
    return [c for c in configs if _fits(c, m, shape.n)]


def on_clusters(m: int, configs: Iterable[GemmConfig], families: Optional[dict] = None) -> list[GemmConfig]:
    """The unclustered decode `configs` of an M-token problem on clusters: swapped tiles on
    SWAP_CLUSTERS (64 rows) or SWAP128_CLUSTERS (128 rows), their tokens the `cluster_tokens` of a
    cluster row; plain tiles whose A tile is whole, from 33 tokens, on PLAIN_CLUSTERS. `families`
    ({(kind, tile_m): cluster shapes}, a family it does not name on none) narrows the shapes
    (HEURISTIC_CLUSTERS)."""
    out = []
    for c in configs:
        if c.swap_ab:
            shapes = SWAP_CLUSTERS if c.tile_m == 64 else SWAP128_CLUSTERS
        elif c.a_rows == c.tile_m and m > 32:
            shapes = PLAIN_CLUSTERS
        else:
            continue
        if families is not None:
            shapes = [s for s in shapes if s in families.get(("swapped" if c.swap_ab else "plain", c.tile_m), ())]
        for cluster_m, cluster_n in shapes:
            tile_n = cluster_tokens(m, cluster_n) if c.swap_ab else c.tile_n
            if tile_n is not None:
                out.append(dataclasses.replace(c, tile_n=tile_n, cluster_m=cluster_m, cluster_n=cluster_n))
    return out


@functools.lru_cache(maxsize=4096)
def decode_choice(shape: GemmShape, num_sms: int) -> GemmConfig:
    """The decode config of least modelled cost (`least_cost`) over decode_configs with the split counts
    of `fitted_splits`."""
    return least_cost(shape, decode_configs(shape, fitted_splits(shape), num_sms), num_sms)


def fitted_splits(shape: GemmShape) -> list[int]:
    """The split counts of FITTED_SPLITS that leave each split MIN_SPLIT_K_TILES k-tiles."""
    max_splits = max(1, min(MAX_SPLITS, math.ceil(shape.k / TILE_K) // MIN_SPLIT_K_TILES))
    return [s for s in FITTED_SPLITS if s <= max_splits]


def least_cost(shape: GemmShape, configs: Iterable[GemmConfig], num_sms: int) -> GemmConfig:
    """The decode config of least modelled cost (`decode_cost`) among `configs`: where any has at most
    FITTED_WAVES waves of work units, among those; fewer splits (earlier configs) unless more win by 1%."""
    configs = list(configs)
    fitted = [c for c in configs
              if output_tiles(c, shape.m, shape.n) * c.splits <= FITTED_WAVES * resident_ctas(c, num_sms)]
    best = None
    for config in fitted or configs:
        cost = decode_cost(config, shape.m, shape.n, shape.k, num_sms)
        if best is None or cost < 0.99 * best[0]:
            best = (cost, config)
    return best[1]


def prefill_cost(m: int, n: int, k: int, tile_m: int, tile_n: int, pingpong: bool, num_sms: int,
                 cluster_m: int = 2, cluster_n: int = 1) -> tuple[float, int]:
    """(modelled time in MMA work units, waves) of a prefill launch of one PREFILL_TILES tile on
    cluster_m x cluster_n clusters: waves of clusters x tile work / efficiency."""
    efficiency = next(e for tm, tn, pp, e in PREFILL_TILES if (tm, tn, pp) == (tile_m, tile_n, pingpong))
    clusters = math.ceil(math.ceil(m / tile_m) / cluster_m) * math.ceil(math.ceil(n / tile_n) / cluster_n)
    waves = math.ceil(clusters / (num_sms // (cluster_m * cluster_n)))
    tile_k_tiles = math.ceil(k / TILE_K) + (0 if pingpong else COOP_EPILOGUE_K_TILES)
    return waves * tile_m * tile_n * tile_k_tiles / efficiency, waves


def prefill_choice(m: int, n: int, k: int, num_sms: int) -> tuple[int, int, bool]:
    """(tile_m, tile_n, pingpong) for an M > DECODE_MAX_M problem on 2x1 clusters: the tile of
    least modelled time (`prefill_cost`)."""
    best = None
    for tile_m, tile_n, pingpong, _ in PREFILL_TILES:
        cost, waves = prefill_cost(m, n, k, tile_m, tile_n, pingpong, num_sms)
        if best is None or cost < best[0]:
            best = (cost, tile_m, tile_n, pingpong, waves)
    _, tile_m, tile_n, pingpong, waves = best
    if waves == 1 and not pingpong:
        # Where cooperative tiles make a single wave (one tile per CTA), pingpong 128 x 128 tiles
        # (two per CTA) measured 2-9% faster on the H200 (e.g. 1024 x 4096 x 14336); the model
        # above rates them even.
        return 128, 128, True
    return tile_m, tile_n, pingpong


# ---------------------------------------------------------------------------------------------
# The contract: the heuristic, the search space, the warm-up set.


def _base(shape: GemmShape) -> dict:
    return dict(dtype=shape.dtype, b_major=shape.b_major, bias=shape.bias, slope=float(shape.slope),
                activation=shape.activation, gated=shape.gated, pdl=bool(shape.pdl))


def config_for(shape: GemmShape, sms: int | None = None) -> GemmConfig:
    """The heuristic's config (tile shape and K splits) for `shape` on a GPU with `sms` SMs (None:
    the current device's)."""
    sms = sm_count() if sms is None else sms
    if shape.m <= DECODE_MAX_M:
        return decode_choice(shape, sms)
    tile_m, tile_n, pingpong = prefill_choice(shape.m, shape.n, shape.k, sms)
    return GemmConfig(**_base(shape), tile_m=tile_m, tile_n=tile_n, pingpong=pingpong)


def candidates(shape: GemmShape, sms: int | None = None) -> list[GemmConfig]:
    """Every config that can run `shape`, config_for's first. Decode: decode_configs with each split
    count up to MAX_SPLITS that leaves every split a k-tile, plain 64-row tiles also with each
    larger a_rows, every unclustered one on each cluster shape `on_clusters` gives it (swapped tiles
    where each token tile holds a token: `cluster_tokens`), and past 64 tokens TWO_TOKEN_TILES and two
    64-token plain tiles on TWO_TOKEN_CLUSTERS (`stages` stays at as many as fit: not searched). Prefill: each tile of PREFILL_TILES on PREFILL_CLUSTERS, walked in
    PREFILL_RASTER_GROUPS."""
    sms = sm_count() if sms is None else sms
    pick = config_for(shape, sms)
    if shape.m <= DECODE_MAX_M:
        splits = range(1, max(1, min(MAX_SPLITS, math.ceil(shape.k / TILE_K))) + 1)
        found = decode_configs(shape, splits, sms)
        found += [dataclasses.replace(c, a_rows=r) for c in found if not c.swap_ab and c.tile_m == 64
                  for r in A_ROWS if r > c.a_rows]
        wider = on_clusters(shape.m, [c for c in found if c.cluster_m * c.cluster_n == 1])
        if shape.m > TWO_TOKEN_TILES:  # M takes two token tiles: see TWO_TOKEN_TILES and TWO_TOKEN_CLUSTERS
            wider += [dataclasses.replace(c, tile_n=TWO_TOKEN_TILES) for c in found
                    if c.swap_ab and c.tile_m == 64 and c.cluster_m * c.cluster_n == 1]
            step = 32 if shape.gated else 16
            widths = set(DECODE_TILE_N) | {fitted_width(shape.n, 2 * s, sms, step) for s in splits} - {None}
            wider += [GemmConfig(**_base(shape), tile_m=64, tile_n=w, cluster_m=cm, cluster_n=cn, split_k=True,
                               splits=s) for w in sorted(widths) for s in splits for cm, cn in TWO_TOKEN_CLUSTERS]
        found += [c for c in wider if _fits(c, shape.m, shape.n)]
    else:
        found = [GemmConfig(**_base(shape), tile_m=tile_m, tile_n=tile_n, pingpong=pingpong,
                            cluster_m=cluster_m, cluster_n=cluster_n, raster_group=group)
                 for tile_m, tile_n, pingpong, _ in PREFILL_TILES
                 for cluster_m, cluster_n in PREFILL_CLUSTERS for group in PREFILL_RASTER_GROUPS]
    return list(dict.fromkeys([pick, *found]))


def _fits(config: GemmConfig, m: int, n: int) -> bool:
    try:
        check_fits(config, m, n)
        return True
    except ValueError:
        return False


def rank(shape: GemmShape, configs: Iterable[GemmConfig], sms: int | None = None) -> list[GemmConfig]:
    """`configs` (candidates of `shape`) best first by the cost models, for the tuner's pruning:
    decode configs by `decode_cost` of their tile and split count, prefill ones by the wave model
    (`prefill_cost`) of their tile and cluster shape. Fields the models do not see (a_rows, raster
    group) keep the given order among equal costs (the sort is stable), except that every tile and
    split count with the fewest A rows that hold M comes before any with more: they load rows that do
    not exist, and would otherwise fill the pruned list with copies of one modelled cost."""
    sms = sm_count() if sms is None else sms
    fewest = next((r for r in A_ROWS if r >= shape.m), None)

    def cost(c: GemmConfig) -> tuple[bool, float]:
        if c.split_k:
            extra_rows = not c.swap_ab and c.tile_m == 64 and c.a_rows != fewest
            return extra_rows, decode_cost(c, shape.m, shape.n, shape.k, sms)
        return False, prefill_cost(shape.m, shape.n, shape.k, c.tile_m, c.tile_n, c.pingpong, sms,
                                   c.cluster_m, c.cluster_n)[0]
    return sorted(configs, key=cost)


def _library_variants() -> list[GemmConfig]:
    """Every kernel variant `gemm_leakyrelu` can launch at the default slope (bias dtype "fp32"
    and the input dtype both count; b contiguous along K or N)."""
    tiles = [dict(tile_m=tm, tile_n=tn, pingpong=pp) for tm, tn, pp, _ in PREFILL_TILES]
    tiles += [dict(tile_m=64, tile_n=tn, cluster_m=1, split_k=True, a_rows=r)
              for tn in DECODE_TILE_N for r in A_ROWS]
    tiles += [dict(tile_m=FIT_TILE_M, tile_n=tn, cluster_m=1, split_k=True) for tn in range(32, 257, 16)]
    tiles += [dict(tile_m=tm, tile_n=tn, cluster_m=1, split_k=True, swap_ab=True)
              for tm in SWAP_TILE_M for tn in SWAP_TILE_N]
    configs = [GemmConfig(dtype=dt, b_major=bm, bias=bias, **t)
               for dt in DTYPES for bm in ("k", "n") for bias in ("none", dt, "fp32") for t in tiles]
    # on_clusters sets a swapped tile's tile_n (from M): one of each other field does for all
    decode = {dataclasses.replace(c, tile_n=SWAP_TILE_N[0]) if c.swap_ab else c: None for c in configs if c.split_k}
    clustered = {c: None for m in range(CLUSTER_MIN_M, DECODE_MAX_M + 1)
                 for c in on_clusters(m, decode, HEURISTIC_CLUSTERS)}
    return configs + list(clustered)


def takes(n: int, k: int, gated: bool = False) -> bool:
    """Whether the kernel takes an [M, K] x [N, K] problem: whole 16-byte rows for TMA (N and K
    multiples of 8); gated, whole pairs of GATE_BLOCK gate and up rows."""
    return n % (2 * GATE_BLOCK if gated else 8) == 0 and k % 8 == 0


def fuses_qkv(q_rows: int, kv_rows: int, k: int) -> bool:
    """Whether rosekernels.hf runs the q, k and v projections ([q_rows, K], [kv_rows, K] twice) as one GEMM over
    their rows concatenated: each output a whole number of 16-byte columns (its slice stays aligned), and the
    kernel takes the whole."""
    return q_rows % 8 == 0 and kv_rows % 8 == 0 and takes(q_rows + 2 * kv_rows, k)


def model_gemms(model, fused_qkv: bool = True) -> list[tuple[str, int, int, str, bool]]:
    """(role, N, K, activation, gated) of the GEMMs a decoder layer of `model` (a
    rosekernels.models.ModelDims) runs on rosekernels (as rosekernels.hf.apply patches it): the q, k and v
    projections, as one GEMM where `fused_qkv` and `fuses_qkv` (else q and k/v, k and v alike), o, and a
    dense model's MLP: the gated gate/up GEMM (N = 2 x intermediate, SwiGLU) and the down projection; the
    MLP whole or not at all. Projections the kernel does not take (`takes`) stay on torch, and MoE experts
    run their own kernels (the dense layers a MoE config may name in mlp_only_layers are not listed: rare,
    compiled on first use)."""
    q, kv = model.heads_q * model.head_dim, model.heads_kv * model.head_dim
    if fused_qkv and fuses_qkv(q, kv, model.hidden):
        gemms = [("q/k/v", q + 2 * kv, model.hidden, "none", False)]
    else:
        gemms = [("q", q, model.hidden, "none", False), ("k/v", kv, model.hidden, "none", False)]
    gemms.append(("o", model.hidden, q, "none", False))
    mlp = [("mlp gate/up", 2 * model.intermediate, model.hidden, "silu", True),
           ("mlp down", model.hidden, model.intermediate, "none", False)]
    if model.intermediate and not model.experts and all(takes(n, k, gated) for _, n, k, _, gated in mlp):
        gemms += mlp
    return [g for g in gemms if takes(g[1], g[2], g[4])]


def variants_for(models: Optional[Iterable] = None, modes: Iterable[str] = MODES,
                 max_tokens: Optional[int] = None) -> list[GemmConfig]:
    """The configs warm-up compiles, one per variant (launch policy at its defaults). models None:
    every variant the op can launch at the default slope; else, for each
    `rosekernels.models.ModelDims`, those of its `model_gemms` (bf16/fp16 models; b as nn.Linear stores
    it, no bias) that a call can launch on the current device: decode, config_for's pick at every
    token count up to DECODE_MAX_M (or max_tokens); prefill (when max_tokens, if given, passes
    DECODE_MAX_M), every PREFILL_TILES tile, so that no prefill length compiles anything."""
    modes = tuple(modes)
    if models is None:
        configs = _library_variants()
    else:
        last = DECODE_MAX_M if max_tokens is None else min(max_tokens, DECODE_MAX_M)
        prefill = "prefill" in modes and (max_tokens is None or max_tokens > DECODE_MAX_M)
        configs = []
        for model in models:
            if model.dtype not in DTYPES:
                continue
            for _, n, k, activation, gated in model_gemms(model):
                shape = GemmShape(1, n, k, dtype=model.dtype, activation=activation, gated=gated)
                if "decode" in modes:
                    configs += [config_for(dataclasses.replace(shape, m=m)) for m in range(1, last + 1)]
                if prefill:  # config_for's prefill picks, whatever M
                    configs += [GemmConfig(**_base(shape), tile_m=tile_m, tile_n=tile_n, pingpong=pingpong)
                                for tile_m, tile_n, pingpong, _ in PREFILL_TILES]
    unique = {c.variant(): dataclasses.replace(c, splits=1, raster_group=RASTER_GROUP) for c in configs}
    return [c for c in unique.values() if c.mode in modes]
