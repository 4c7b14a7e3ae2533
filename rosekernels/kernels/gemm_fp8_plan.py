"""Planning of the FP8 GEMM (rosekernels.kernels.gemm_fp8): its configs, the shape of a call, the heuristic,
the tuner's search space and the warm-up set. No CuTeDSL here: everything is tested on a CPU.

The kernel is the bf16 GEMM's (gemm_leakyrelu) with e4m3 operands: the same tiles, clusters, K splits and
epilogues, a k-tile of 128 e4m3 elements (the same 128 bytes per row as bf16's 64) and, in the mainloop,
each k-tile's WGMMA partial sums added into fp32 registers (`scales` "rowcol": the scales multiply the
result once, per row of a and per row of w, either of them maybe one value for the whole tensor) or scaled
into them (`scales` "block": a's 1 x 128 groups times w's 128 x 128 blocks, K a multiple of 128).

Decode GEMMs stream the weights, and an e4m3 [N, K] weight streams the bytes of a bf16 [N, K / 2] one in
as many k-tiles: the heuristic is the bf16 decode cost model's choice for that problem among the configs
the FP8 kernel takes (`equivalent`). Prefill takes 128 x 128 tiles: a second fp32 accumulator for the
promoted sums leaves no registers for the bf16 kernel's 128 x 256. The tuner also tries per-channel
128 x 160 and 128 x 176 (WIDE_TILES: fewer shared-memory bytes per MMA), and each cooperative tile with
`stagger` (the two warpgroups issue their k-tiles' WGMMAs in turns, so that one's promotion runs under the
other's MMAs; no gain measured); neither is the heuristic until a GPU has timed it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Optional

from rosekernels.fp8 import BLOCK
from rosekernels.kernels import gemm_leakyrelu_plan as bf16
from rosekernels.kernels.gemm_leakyrelu_plan import DECODE_MAX_M, GATE_BLOCK, RASTER_GROUP, GemmConfig, check_fits
from rosekernels.modes import sm_count
from rosekernels.variant import MODES, check_mode

if TYPE_CHECKING:
    import torch

OP = "gemm_fp8"
SCALES = ("rowcol", "block")
TILE_K = 128  # e4m3 elements per k-tile: 128 bytes (one SW128 swizzle atom) and one scale block of K
OUT_DTYPES = ("bf16", "fp16")
# The accumulator and the promoted sums take 2 x tile_m x tile_n / (128 x warpgroups) fp32 registers a
# thread; at most this many leave room for the scales, addresses and the epilogue (232 per thread), but in
# the wide prefill tiles below (WIDE_ACC_REGS).
MAX_ACC_REGS = 128
# Prefill tiles (tile_m, tile_n, pingpong): 128 x 128 cooperative (64 accumulator rows a warpgroup), and
# 128 x 64 pingpong (a 128-row tile a warpgroup; the other's epilogue hides under its mainloop).
PREFILL_TILES = ((128, 128, False), (128, 64, True))
# Wider cooperative prefill tiles, tuner candidates for per-channel scales (block scales take weight tiles
# that divide 128): fewer shared-memory bytes per MMA (DESIGN.md, "GEMM tiles and shared-memory reads").
# Their 160 and 176 accumulator registers fit in 230 of the 232 with every epilogue, no spills (ptxas 13).
WIDE_TILES = ((128, 160, False), (128, 176, False))
WIDE_ACC_REGS = 176
# Prefill clusters the tuner tries: bf16's (2x1 and 1x2, the weight or the token tile multicast) and 1x1.
# cuBLAS's FP8 kernel at 4096 x 14336 x 4096 (H200, Nsight Compute, 2026-12-06) runs the same 128 x 128
# cooperative tile with no cluster, at 85% of the SM's throughput (its busiest pipe) against ours 65% on 2x1
# clusters, where each stage waits for both CTAs of the pair: whether the cluster is the cause, a GPU has yet
# to time.
PREFILL_CLUSTERS = ((2, 1), (1, 1), (1, 2))


@dataclasses.dataclass(frozen=True)
class Fp8GemmConfig(GemmConfig):
    """A GemmConfig of the FP8 kernel: `dtype` is the output's (a and w are e4m3, K-major), `scales` how
    the mainloop applies them. Every other field means what it means for the bf16 kernel."""

    OP = OP
    KEY_DEFAULTS = {**GemmConfig.KEY_DEFAULTS, "b_major": "k", "stagger": False}  # w is always K-major

    scales: str = "rowcol"  # "rowcol" | "block"
    # Cooperative 128-row prefill tiles: the two warpgroups take turns issuing their k-tile's WGMMAs
    # (fp8_tiles), meant to let one promote its sums while the tensor cores run the other's.
    stagger: bool = False

    fp8: ClassVar[bool] = True  # what the GEMM device class reads (a GemmConfig has no such attribute)

    def validate(self) -> None:
        super().validate()
        if self.scales not in SCALES:
            raise ValueError(f"scales must be one of {SCALES}, got {self.scales!r}")
        if self.b_major != "k":
            raise ValueError("the FP8 GEMM takes K-major weights ([N, K], K contiguous): WGMMA reads e4m3 K-major only")
        wide = not self.split_k and (self.tile_m, self.tile_n, self.pingpong) in WIDE_TILES
        if acc_regs(self) > (WIDE_ACC_REGS if wide else MAX_ACC_REGS):
            raise ValueError(f"{self.tile_m} x {self.tile_n} tiles need {acc_regs(self)} registers a thread for the "
                             f"accumulator and the promoted sums; at most {MAX_ACC_REGS} ({WIDE_ACC_REGS} in the "
                             "cooperative prefill tiles " + ", ".join(f"{m} x {n}" for m, n, _ in WIDE_TILES)
                             + ", not split-K)")
        if self.stagger and (self.pingpong or self.swap_ab or self.split_k or bf16.wg_per_tile(self) != 2):
            raise ValueError("stagger takes cooperative prefill tiles of 128 rows: two warpgroups share the tile")
        weight_tile = self.tile_m if self.swap_ab else self.tile_n
        if self.scales == "block" and BLOCK % weight_tile:
            raise ValueError(f"block scales take weight tiles of a divisor of {BLOCK} rows (one scale block a "
                             f"k-tile), got {weight_tile}")


def acc_regs(config: GemmConfig) -> int:
    """fp32 registers a thread holds for a tile's accumulator and its promoted sums."""
    return 2 * config.tile_m * config.tile_n // (128 * bf16.wg_per_tile(config))


@dataclasses.dataclass(frozen=True)
class Fp8GemmShape:
    """One call: out[m, n] = act((a[m, k] @ w[n, k]^T) * scales + bias) with e4m3 a and w; gated: out[m, n // 2]
    = act(gate) * up, n counting the interleaved gate and up rows of w."""

    SIZE_FIELDS = ("m",)  # varies per call (tokens): bucketed by the tuned-config store (contract.bucket)
    m: int
    n: int = 4096
    k: int = 4096
    dtype: str = "bf16"  # the output's
    scales: str = "rowcol"
    bias: str = "none"
    activation: str = "none"
    gated: bool = False
    slope: float = 0.01
    pdl: bool = True

    def __post_init__(self) -> None:
        bf16.one_slope(self)

    @property
    def mode(self) -> str:
        return "decode" if self.m <= DECODE_MAX_M else "prefill"

    @classmethod
    def defaults(cls, mode: str) -> "Fp8GemmShape":
        """What `sip-tune --mode` tunes without --shape: a 4096 x 4096 projection (Qwen3-8B's q and o), one
        scale per row and channel; 16 tokens (decode) or 8192 (prefill)."""
        check_mode(mode)
        return cls(m=16 if mode == "decode" else 8192)

    @classmethod
    def of(cls, a: "torch.Tensor", w: "torch.Tensor", bias: "torch.Tensor | None", out: "torch.Tensor", scales: str,
           activation: str, gated: bool, slope: float, pdl: bool) -> "Fp8GemmShape":
        """The shape of a gemm_fp8 call on a [M, K], w [N, K], a bias [N] or None and out."""
        from rosekernels import checks  # not at the top: sip-tune --list reads this module without torch

        (m, k), n = a.shape, w.shape[0]
        name = checks.DTYPE_NAME
        return cls(m, n, k, name[out.dtype], scales, name[bias.dtype] if bias is not None else "none", activation,
                   gated, slope, pdl)


def check_sizes(n: int, k: int, gated: bool, scales: str) -> None:
    """ValueError unless the kernel takes an [M, K] x [N, K] problem: 16-byte e4m3 rows for TMA (K a multiple
    of 16), 16-byte output rows (N a multiple of 8; gated, of 16: whole pairs of GATE_BLOCK rows), and for
    block scales whole 128-element groups of K."""
    if n % (2 * GATE_BLOCK if gated else 8):
        raise ValueError(f"N = {n} must be a multiple of {2 * GATE_BLOCK if gated else 8}"
                         + (f" (gate and up rows in blocks of {GATE_BLOCK})" if gated else " (16-byte output rows)"))
    if k % 16:
        raise ValueError(f"K = {k} must be a multiple of 16 (16-byte e4m3 rows for TMA)")
    if scales == "block" and k % BLOCK:
        raise ValueError(f"block scales take whole 1 x {BLOCK} groups: K = {k} is not a multiple of {BLOCK}")


def takes(n: int, k: int, gated: bool, scales: str) -> bool:
    try:
        check_sizes(n, k, gated, scales)
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# The contract: the heuristic, the search space, the warm-up set.


def equivalent(shape: Fp8GemmShape) -> bf16.GemmShape:
    """The bf16 GEMM problem that streams the same weight bytes in as many k-tiles (K halved): what the
    bf16 decode cost model rates the FP8 kernel's configs on."""
    return bf16.GemmShape(shape.m, shape.n, math.ceil(shape.k / 2), dtype=shape.dtype, bias=shape.bias,
                     slope=float(shape.slope), activation=shape.activation, gated=shape.gated, pdl=bool(shape.pdl))


def as_fp8(config: GemmConfig, scales: str) -> Optional[Fp8GemmConfig]:
    """`config` (a bf16 GEMM config) as an FP8 one with `scales`; None where the FP8 kernel cannot take it."""
    return _valid(**{f.name: getattr(config, f.name) for f in dataclasses.fields(GemmConfig)}, scales=scales)


def _valid(**fields: Any) -> Optional[Fp8GemmConfig]:
    try:
        return Fp8GemmConfig(**fields)
    except ValueError:
        return None


def _fp8(configs: Iterable[GemmConfig], scales: str) -> list[Fp8GemmConfig]:
    return [c for c in (as_fp8(c, scales) for c in configs) if c is not None]


def _base(shape: Fp8GemmShape) -> dict:
    return dict(dtype=shape.dtype, bias=shape.bias, slope=float(shape.slope), activation=shape.activation,
                gated=shape.gated, pdl=bool(shape.pdl), scales=shape.scales)


def config_for(shape: Fp8GemmShape, sms: int | None = None) -> Fp8GemmConfig:
    """The heuristic's config for `shape` on a GPU of `sms` SMs (None: the current device's): decode, the
    bf16 decode cost model's least-cost config of the `equivalent` problem among those the FP8 kernel
    takes; prefill, 128 x 128 tiles on 2x1 clusters."""
    sms = sm_count() if sms is None else sms
    if shape.m <= DECODE_MAX_M:
        eq = equivalent(shape)
        return bf16.least_cost(eq, _fp8(bf16.decode_configs(eq, bf16.fitted_splits(eq), sms), shape.scales), sms)
    tile_m, tile_n, pingpong = PREFILL_TILES[0]
    return Fp8GemmConfig(**_base(shape), tile_m=tile_m, tile_n=tile_n, pingpong=pingpong)


def candidates(shape: Fp8GemmShape, sms: int | None = None) -> list[Fp8GemmConfig]:
    """Every config that can run `shape`, config_for's first: decode, the bf16 GEMM's candidates of the
    `equivalent` problem that the FP8 kernel takes; prefill, each PREFILL_TILES and WIDE_TILES tile the
    shape takes (the cooperative ones with and without `stagger`) on PREFILL_CLUSTERS, walked in bf16's
    PREFILL_RASTER_GROUPS."""
    sms = sm_count() if sms is None else sms
    pick = config_for(shape, sms)
    if shape.m <= DECODE_MAX_M:
        found = _fp8(bf16.candidates(equivalent(shape), sms), shape.scales)
    else:
        # The wide tiles before the pingpong one (1.6x slower than 128 x 128 at 4096^3): a search cut short
        # by --max-candidates keeps them.
        tiles = (PREFILL_TILES[0], *WIDE_TILES, *PREFILL_TILES[1:])
        found = [c for tm, tn, pp in tiles for stagger in ((False,) if pp else (False, True))
                 for cm, cn in PREFILL_CLUSTERS for group in bf16.PREFILL_RASTER_GROUPS
                 if (c := _valid(**_base(shape), tile_m=tm, tile_n=tn, pingpong=pp, cluster_m=cm, cluster_n=cn,
                                 raster_group=group, stagger=stagger))]
    return list(dict.fromkeys([pick, *found]))


def rank(shape: Fp8GemmShape, configs: Iterable[Fp8GemmConfig], sms: int | None = None) -> list[Fp8GemmConfig]:
    """`configs` best first: decode ones by the bf16 cost model on the `equivalent` problem (bf16's rank);
    prefill ones in the given order (no model rates the FP8 prefill tiles against each other yet)."""
    configs = list(configs)
    if shape.m > DECODE_MAX_M:
        return configs
    return bf16.rank(equivalent(shape), configs, sms)


def fuses_qkv(q_rows: int, kv_rows: int, k: int, weight_scheme: str) -> bool:
    """Whether rosekernels.hf runs FP8 q, k and v projections as one GEMM over their rows concatenated, quantized
    as one weight: as bf16.fuses_qkv, with scales that quantize the whole exactly as the three apart (per channel;
    per 128 x 128 block where q's and k's rows are whole blocks), not per tensor (one scale for all three)."""
    rows_fit = weight_scheme == "channel" or (weight_scheme == "block" and q_rows % BLOCK == kv_rows % BLOCK == 0)
    return rows_fit and bf16.fuses_qkv(q_rows, kv_rows, k) and takes(q_rows + 2 * kv_rows, k, False,
                                                                     scales_of(weight_scheme))


def model_gemms(model) -> list[tuple[str, int, int, str, bool]]:
    """(role, N, K, activation, gated) of the GEMMs a decoder layer of `model` (a rosekernels.models.ModelDims
    run in FP8: model.fp8 names the weight scheme) runs on gemm_fp8: the bf16 GEMM's (model_gemms, q, k and v
    fused where `fuses_qkv`) that the FP8 kernel takes; none for a model not run in FP8."""
    if model.fp8 == "none":
        return []
    scales = scales_of(model.fp8)
    q, kv = model.heads_q * model.head_dim, model.heads_kv * model.head_dim
    fused = fuses_qkv(q, kv, model.hidden, model.fp8)
    return [g for g in bf16.model_gemms(model, fused_qkv=fused) if takes(g[1], g[2], g[4], scales)]


def scales_of(weight_scheme: str) -> str:
    """The kernel's scales for a weight scheme of rosekernels.fp8.WEIGHT_SCHEMES."""
    return "block" if weight_scheme == "block" else "rowcol"


# The model whose GEMMs variants_for() covers by default, in both schemes: Qwen3-8B's.
DEFAULT_MODEL = dict(name="qwen3-8b", hidden=4096, intermediate=12288, heads_q=32, heads_kv=8, head_dim=128)


def variants_for(models: Optional[Iterable] = None, modes: Iterable[str] = MODES,
                 max_tokens: Optional[int] = None) -> list[Fp8GemmConfig]:
    """The configs warm-up compiles, one per variant (launch policy at its defaults): for each model run in
    FP8 (rosekernels.models.ModelDims with fp8 set; None: DEFAULT_MODEL with channel and block scales),
    its `model_gemms` with a bf16/fp16 output: decode, config_for's pick at every token count up to
    DECODE_MAX_M (or max_tokens); prefill (when max_tokens, if given, passes DECODE_MAX_M), every
    PREFILL_TILES tile on 2x1 clusters."""
    from rosekernels.models import ModelDims

    modes = tuple(modes)
    if models is None:
        models = [ModelDims(**DEFAULT_MODEL, fp8=scheme) for scheme in ("channel", "block")]
    last = DECODE_MAX_M if max_tokens is None else min(max_tokens, DECODE_MAX_M)
    prefill = "prefill" in modes and (max_tokens is None or max_tokens > DECODE_MAX_M)
    configs = []
    for model in models:
        if model.dtype not in OUT_DTYPES:
            continue
        for _, n, k, activation, gated in model_gemms(model):
            shape = Fp8GemmShape(1, n, k, dtype=model.dtype, scales=scales_of(model.fp8), activation=activation,
                                 gated=gated)
            if "decode" in modes:
                configs += [config_for(dataclasses.replace(shape, m=m)) for m in range(1, last + 1)]
            if prefill:
                configs += [Fp8GemmConfig(**_base(shape), tile_m=tm, tile_n=tn, pingpong=pp)
                            for tm, tn, pp in PREFILL_TILES]
    unique = {c.variant(): dataclasses.replace(c, splits=1, raster_group=RASTER_GROUP) for c in configs}
    return [c for c in unique.values() if c.mode in modes]


def workload_fits(config: Fp8GemmConfig, shape: Fp8GemmShape) -> None:
    """ValueError unless `config` serves `shape` (the options match, the sizes fit its tiles and splits)."""
    options = ("dtype", "scales", "bias", "activation", "gated", "slope")
    if any(getattr(config, o) != getattr(shape, o) for o in options):
        raise ValueError(f"{config} does not serve {shape}: {', '.join(options)} must match")
    check_sizes(shape.n, shape.k, shape.gated, shape.scales)
    check_fits(config, shape.m, shape.n)

