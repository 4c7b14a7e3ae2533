"""Planning of the FP8 quantization kernel (rosekernels.kernels.quantize_fp8): its configs, the shape of a
call, which config a call gets, the configs the tuner may try and the ones warm-up compiles.

No CuTeDSL here: configs are chosen, listed and tested on a CPU without compiling.

A row of `hidden` elements is split over `threads_per_row` threads moving 128 bits each (the RMSNorm
kernel's geometry, rmsnorm_plan.threads_per_row, up to a 1024-thread block per row). Fewer warps than
SMs -> the decode config (one row per block); otherwise the prefill row of rosekernels.modes.PREFILL_TABLE.
A scale per row (`group` 0) or per 1 x 128 group (`group` 128: the 128 / vec lanes that hold a group's
vectors reduce its amax among themselves).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from rosekernels import checks
from rosekernels.contract import KernelConfig, keep_order
from rosekernels.fp8 import BLOCK
from rosekernels.kernels.rmsnorm_plan import RowGeometry, threads_per_row
from rosekernels.models import ModelDims
from rosekernels.modes import CACHE_HINTS, PREFILL_WARPS, Mode, all_modes, select, warps_needed
from rosekernels.variant import MODES, check_mode

OP = "quantize_fp8"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TORCH_DTYPE = {checks.DTYPE_NAME[d]: d for d in DTYPES}
GROUPS = (0, BLOCK)  # 0: a scale per row
# Blocks of at most 16 warps: a 1024-thread block leaves a thread 64 registers, too few for its row's 8
# vectors in fp32 (they spilled), so neither a row nor the prefill candidates take one.
MAX_THREADS_PER_ROW = 512
PREFILL_BLOCK_WARPS = tuple(w for w in PREFILL_WARPS if w <= 16)
ROW_BYTES = 16  # e4m3 rows are whole 16-byte vectors (what the FP8 GEMM's TMA loads): K % 16 == 0
# The K of the models variants_for() covers by default: hidden sizes and the MLP intermediate sizes of
# Llama-3-8B, Qwen3-8B and Qwen2.5-7B (the inputs of their o and down projections).
MODEL_K = (3584, 4096, 12288, 14336, 18944)


@dataclasses.dataclass(frozen=True)
class QuantizeShape:
    """The sizes and options of a call (the keys of `sip-tune --kernel quantize_fp8 --shape`)."""

    SIZE_FIELDS = ("rows",)  # varies per call: bucketed by the tuned-config store (contract.bucket)
    rows: int
    hidden: int = 4096
    dtype: str = "bf16"  # x
    group: int = 0  # 0: a scale per row; 128: per 1 x 128 group
    pdl: bool = True  # programmatic dependent launch (quantize_fp8(enable_pdl=...))

    @classmethod
    def defaults(cls, mode: str) -> "QuantizeShape":
        """Hidden 4096, bf16, a scale per row: one row (decode) or 4096 (prefill)."""
        check_mode(mode)
        return cls(rows=1 if mode == "decode" else 4096)

    @classmethod
    def of(cls, x: torch.Tensor, group: int, pdl: bool) -> "QuantizeShape":
        """The shape of a quantize_fp8 call on x [M, K]."""
        rows, hidden = x.shape
        return cls(rows, hidden, checks.DTYPE_NAME[x.dtype], group, pdl)


@dataclasses.dataclass(frozen=True)
class QuantizeConfig(RowGeometry, KernelConfig):
    """Everything a compiled variant is specialized on: every field is compiled in."""

    OP = OP

    dtype: str  # x: "bf16" | "fp16" | "fp32"
    hidden: int
    group: int  # 0 | 128
    mode: str  # "decode" | "prefill"
    warps: int  # warps per block asked by the mode (raised to cover a whole row)
    cache_hint: str  # for the loads of x and the stores of q: one of modes.CACHE_HINTS
    # Programmatic dependent launch: the block waits for the previous kernel before its loads and lets
    # the next one launch once they are issued.
    pdl: bool = True

    @property
    def group_lanes(self) -> int:
        """Consecutive lanes holding one group's vectors (vector j * threads_per_row + lane)."""
        return self.group // self.vec

    def validate(self) -> None:
        check_mode(self.mode)
        if self.dtype not in TORCH_DTYPE:
            raise ValueError(f"quantize_fp8 takes {', '.join(TORCH_DTYPE)} input, got {self.dtype!r}")
        check_hidden(self.hidden, self.dtype, self.group)
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"unsupported warps per block {self.warps}")
        if self.cache_hint not in CACHE_HINTS:
            raise ValueError(f"unknown cache hint {self.cache_hint!r}")


def check_hidden(hidden: int, dtype: str, group: int) -> None:
    """ValueError unless the kernel takes rows of `hidden` elements of `dtype` quantized with `group`."""
    if group not in GROUPS:
        raise ValueError(f"group_size must be None (a scale per row) or {BLOCK}, got {group}")
    if hidden < 1 or hidden % ROW_BYTES:
        raise ValueError(f"K = {hidden}: rows must be a multiple of {ROW_BYTES} elements (16-byte e4m3 rows)")
    if group and hidden % group:
        raise ValueError(f"group_size {group} does not divide K = {hidden}")
    if threads_per_row(hidden, checks.vector_elems(dtype)) > MAX_THREADS_PER_ROW:
        raise ValueError(f"K = {hidden} is too long: rows of {dtype} up to "
                         f"{MAX_THREADS_PER_ROW * 8 * checks.vector_elems(dtype)} elements")


def config_for(shape: QuantizeShape, sms: int | None = None) -> QuantizeConfig:
    """What quantize_fp8() launches for `shape` on a GPU of `sms` SMs (None: the current device's):
    decode below the SM count, else the prefill table."""
    tpr = threads_per_row(shape.hidden, checks.vector_elems(shape.dtype))
    return _config(shape, select(OP, warps_needed(shape.rows, tpr), sms))


def candidates(shape: QuantizeShape, sms: int | None = None) -> list[QuantizeConfig]:
    """Every config of `shape`'s mode: the decode config, or every prefill block size of
    PREFILL_BLOCK_WARPS with every cache hint. config_for(shape) is among them."""
    cfg = config_for(shape, sms)
    if cfg.mode == "decode":
        return [cfg]
    return [dataclasses.replace(cfg, warps=w, cache_hint=h) for w in PREFILL_BLOCK_WARPS for h in CACHE_HINTS]


rank = keep_order  # no cost model rates the candidates against each other


def model_k(model: ModelDims) -> list[tuple[int, int]]:
    """(K, group) of the activations rosekernels.hf quantizes on their own in an FP8 `model` (the inputs
    of o_proj and down_proj; the others come quantized out of the norms): none unless model.fp8."""
    if model.fp8 == "none":
        return []
    group = BLOCK if model.fp8 == "block" else 0
    sizes = [model.heads_q * model.head_dim] + ([model.intermediate] if model.intermediate else [])
    return [(k, group) for k in dict.fromkeys(sizes) if _takes(k, model.dtype, group)]


def _takes(hidden: int, dtype: str, group: int) -> bool:
    try:
        check_hidden(hidden, dtype, group)
        return dtype in TORCH_DTYPE
    except ValueError:
        return False


def variants_for(models: Iterable[ModelDims] | None = None, modes: Iterable[str] = MODES,
                 max_tokens: int | None = None) -> list[QuantizeConfig]:
    """The configs quantize_fp8() can launch in `modes` for `models` (rosekernels.models.ModelDims run in
    FP8: `model_k`); None: MODEL_K in bf16 with both groupings."""
    if models is None:
        shapes = [QuantizeShape(0, k, "bf16", g) for k in MODEL_K for g in GROUPS]
    else:
        shapes = [QuantizeShape(0, k, m.dtype, g) for m in models for k, g in model_k(m)]
    modes = set(modes)
    return list(dict.fromkeys(_config(s, mode) for s in shapes for mode in all_modes(OP) if mode.name in modes))


def _config(shape: QuantizeShape, mode: Mode) -> QuantizeConfig:
    return QuantizeConfig(shape.dtype, int(shape.hidden), int(shape.group), mode.name, mode.warps, mode.cache_hint,
                          bool(shape.pdl))
