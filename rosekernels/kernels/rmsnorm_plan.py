"""RMSNorm planning: what a launch of the RMSNorm kernel (rosekernels.kernels.rmsnorm) is specialized
on, which config a call gets, the configs the tuner may try and the ones warm-up compiles.

No CuTeDSL here: configs are chosen, listed and tested on a CPU without compiling.

A row of `hidden` elements is split over `threads_per_row` threads moving 128 bits each. Fewer warps
than SMs -> the decode config (one row per block); otherwise the prefill row of
rosekernels.modes.PREFILL_TABLE (warps per block, cache hint).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import torch

from rosekernels import checks
from rosekernels.contract import KernelConfig, keep_order
from rosekernels.fp8 import BLOCK
from rosekernels.models import ModelDims
from rosekernels.modes import CACHE_HINTS, PREFILL_WARPS, Mode, all_modes, select, warps_needed
from rosekernels.variant import MODES, check_mode

OP = "rmsnorm"
# The fused FP8 quantization of the output (rosekernels.fp8): none, a scale per row, or per 1 x 128 group.
FP8 = {"none": None, "row": 0, "group": BLOCK}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TORCH_DTYPE = {checks.DTYPE_NAME[d]: d for d in DTYPES}
MAX_HIDDEN = 16384
MAX_VECS_PER_THREAD = 8
# Hidden sizes variants_for() covers by default (Llama/Qwen/Mixtral-class models).
MODEL_HIDDEN = (2048, 4096, 5120, 8192)


def threads_per_row(hidden: int, vec: int) -> int:
    """Power of two: at most MAX_VECS_PER_THREAD vectors per thread, and a full warp per row
    unless the row has fewer vectors than that."""
    vecs = hidden // vec
    tpr = 1 << max(0, math.ceil(math.log2(-(-vecs // MAX_VECS_PER_THREAD))))
    return max(tpr, min(32, 1 << math.ceil(math.log2(vecs))))


class RowGeometry:
    """How a row kernel's config (fields dtype, hidden, mode, warps) lays rows over threads: 128-bit
    vectors, threads_per_row() of them per row, a decode block of one row's warps, a prefill block of
    `warps` warps (at least a row's). Shared by rmsnorm and quantize_fp8 (fp8_rows)."""

    @property
    def vec(self) -> int:
        return checks.vector_elems(self.dtype)

    @property
    def vecs(self) -> int:
        """128-bit vectors per row."""
        return self.hidden // self.vec

    @property
    def threads_per_row(self) -> int:
        return threads_per_row(self.hidden, self.vec)

    @property
    def vecs_per_thread(self) -> int:
        return -(-self.vecs // self.threads_per_row)

    @property
    def warps_per_row(self) -> int:
        return max(1, self.threads_per_row // 32)

    @property
    def block_warps(self) -> int:
        return self.warps_per_row if self.mode == "decode" else max(self.warps, self.warps_per_row)

    @property
    def rows_per_block(self) -> int:
        return self.block_warps * 32 // self.threads_per_row


@dataclasses.dataclass(frozen=True)
class RMSNormShape:
    """The sizes and options of a call (the keys of `sip-tune --kernel rmsnorm --shape`)."""

    SIZE_FIELDS = ("rows",)  # varies per call: bucketed by the tuned-config store (contract.bucket)
    rows: int
    hidden: int = 4096
    dtype: str = "bf16"  # x, residual and the outputs
    weight_dtype: str | None = None  # None: the input dtype
    residual: bool = False
    eps: float = 1e-6
    pdl: bool = True  # programmatic dependent launch (rmsnorm(enable_pdl=...))
    fp8: str = "none"  # the output quantized to e4m3 (a key of FP8)

    def __post_init__(self) -> None:
        if self.weight_dtype == self.dtype:  # one spelling per problem: the tuned store keys on it
            object.__setattr__(self, "weight_dtype", None)

    @classmethod
    def defaults(cls, mode: str) -> "RMSNormShape":
        """Hidden 4096, bf16, no residual: one row (decode) or 4096 (prefill)."""
        check_mode(mode)
        return cls(rows=1 if mode == "decode" else 4096)

    @classmethod
    def of(cls, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float,
           pdl: bool, fp8: str = "none") -> "RMSNormShape":
        """The shape of an rmsnorm call on x [M, N]."""
        rows, hidden = x.shape
        return cls(rows, hidden, checks.DTYPE_NAME[x.dtype], checks.DTYPE_NAME[weight.dtype], residual is not None, eps,
                   pdl, fp8)


@dataclasses.dataclass(frozen=True)
class RMSNormConfig(RowGeometry, KernelConfig):
    """Everything a compiled variant is specialized on: every field is compiled in."""

    OP = OP
    KEY_DEFAULTS = {"pdl": True, "fp8": "none"}  # the keys predate them

    dtype: str  # x, residual and outputs: "bf16" | "fp16" | "fp32"
    weight_dtype: str  # the input dtype or "fp32"
    hidden: int
    residual: bool
    eps: float
    mode: str  # "decode" | "prefill"
    warps: int  # warps per block asked by the mode (raised to cover a whole row)
    cache_hint: str  # for x/residual loads and output stores: one of modes.CACHE_HINTS
    # Programmatic dependent launch: the block waits for the previous kernel (griddepcontrol.wait)
    # before its loads and lets the next one launch once they are issued.
    pdl: bool = True
    # The output in e4m3 with its scales, in the same launch (fp8_rows): "none", "row" or "group" (FP8).
    fp8: str = "none"

    @property
    def fp8_group(self) -> int:
        """Elements per scale of the fp8 output: 0 for a scale per row."""
        return FP8[self.fp8] or 0

    def validate(self) -> None:
        check_mode(self.mode)
        if self.dtype not in TORCH_DTYPE or self.weight_dtype not in (self.dtype, "fp32"):
            raise ValueError(f"unsupported dtypes {self.dtype}/{self.weight_dtype}")
        if not (0 < self.hidden <= MAX_HIDDEN) or self.hidden % self.vec:
            raise ValueError(f"hidden size {self.hidden} must be a multiple of {self.vec} up to {MAX_HIDDEN}")
        if self.warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"unsupported warps per block {self.warps}")
        if self.cache_hint not in CACHE_HINTS:
            raise ValueError(f"unknown cache hint {self.cache_hint!r}")
        check_fp8(self.fp8, self.hidden)


def check_fp8(fp8: str, hidden: int) -> None:
    """ValueError unless the kernel quantizes rows of `hidden` elements as `fp8` (a key of FP8) says: e4m3
    rows of whole 16-byte vectors, and groups that divide the row."""
    if fp8 not in FP8:
        raise ValueError(f"fp8 must be one of {sorted(FP8)}, got {fp8!r}")
    if fp8 != "none" and hidden % 16:
        raise ValueError(f"an e4m3 output takes hidden sizes that are multiples of 16 (16-byte rows), got {hidden}")
    if FP8[fp8] and hidden % FP8[fp8]:
        raise ValueError(f"group_size {FP8[fp8]} does not divide the hidden size {hidden}")


def config_for(shape: RMSNormShape, sms: int | None = None) -> RMSNormConfig:
    """What rmsnorm() launches for `shape` on a GPU of `sms` SMs (None: the current device's):
    decode below the SM count, else the prefill table."""
    tpr = threads_per_row(shape.hidden, checks.vector_elems(shape.dtype))
    return _config(shape, select(OP, warps_needed(shape.rows, tpr), sms))


def candidates(shape: RMSNormShape, sms: int | None = None) -> list[RMSNormConfig]:
    """Every config of `shape`'s mode: the decode config, or every prefill block size with every
    cache hint. config_for(shape) is among them."""
    cfg = config_for(shape, sms)
    if cfg.mode == "decode":
        return [cfg]
    return [dataclasses.replace(cfg, warps=w, cache_hint=h) for w in PREFILL_WARPS for h in CACHE_HINTS]


rank = keep_order  # no cost model rates the candidates against each other


def variants_for(models: Iterable[ModelDims] | None = None, modes: Iterable[str] = MODES,
                 max_tokens: int | None = None) -> list[RMSNormConfig]:
    """The configs rmsnorm() can launch in `modes` for `models` (rosekernels.models.ModelDims: their
    hidden size and dtype, weights in that dtype or fp32, with and without the residual add; a hidden
    size the kernel lacks needs none). None: the MODEL_HIDDEN sizes in every dtype."""
    # Shapes of no rows: the row count only picks the mode, and every mode is listed.
    if models is None:
        shapes = [RMSNormShape(0, n, dt, wdt, res) for n in MODEL_HIDDEN for dt in TORCH_DTYPE
                  for wdt in dict.fromkeys((dt, "fp32")) for res in (False, True)]
    else:
        shapes = [RMSNormShape(0, m.hidden, m.dtype, wdt, res, fp8=fp8)
                  for m in models if 0 < m.hidden <= MAX_HIDDEN and m.hidden % checks.vector_elems(m.dtype) == 0
                  for wdt in dict.fromkeys((m.dtype, "fp32")) for res in (False, True) for fp8 in _fp8_outputs(m)]
    modes = set(modes)
    return list(dict.fromkeys(_config(s, mode) for s in shapes for mode in all_modes(OP) if mode.name in modes))


def _fp8_outputs(model: ModelDims) -> list[str]:
    """The outputs the norms of `model` write: theirs, and, for a model run in FP8 (rosekernels.hf), the e4m3
    activations of its linear layers (per 1 x 128 group for block-scaled weights, else per row)."""
    fp8 = "none" if model.fp8 == "none" else "group" if model.fp8 == "block" else "row"
    try:
        check_fp8(fp8, model.hidden)
    except ValueError:
        return ["none"]
    return list(dict.fromkeys(["none", fp8]))


def _config(shape: RMSNormShape, mode: Mode) -> RMSNormConfig:
    return RMSNormConfig(shape.dtype, shape.weight_dtype or shape.dtype, int(shape.hidden), bool(shape.residual),
                         float(shape.eps), mode.name, mode.warps, mode.cache_hint, bool(shape.pdl), shape.fp8)
