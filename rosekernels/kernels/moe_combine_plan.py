"""Planning of `moe_combine` (see moe_combine.py for the kernel): its config, the shape of a call, the
decode/prefill rule, the tuner's search space and the warm-up set. No CuTeDSL here.

The variants differ only in the CTA size: a thread owns one 16-byte vector of an output row, so few
tokens (decode, up to DECODE_MAX_TOKENS) are spread over more SMs by small CTAs.
"""
from __future__ import annotations

import dataclasses

import torch

from rosekernels import checks
from rosekernels.contract import KernelConfig, keep_order
from rosekernels.kernels.moe_dispatch_plan import DEFAULT_TOKENS, DTYPE_NAMES, MODELS
from rosekernels.models import ModelDims
from rosekernels.variant import MODES, check_mode

OP = "moe_combine"
THREADS = {"decode": 128, "prefill": 256}  # per CTA: small CTAs spread few tokens over more SMs
DECODE_MAX_TOKENS = 256  # at or below: the decode shape
THREAD_CHOICES = (64, 128, 256, 512, 1024)  # the tuner's search space


@dataclasses.dataclass(frozen=True)
class CombineConfig(KernelConfig):
    """Everything a compiled combine kernel is specialised on (all runtime sizes stay dynamic)."""

    OP = OP
    KEY_NAMES = {"weight_dtype": "wdtype"}

    dtype: str  # of expert_out and out
    weight_dtype: str  # of topk_weights: "fp32" or `dtype`
    hidden: int
    topk: int
    mode: str
    threads: int = 0  # per CTA; 0: THREADS[mode]

    def __post_init__(self) -> None:
        if not self.threads and self.mode in THREADS:
            object.__setattr__(self, "threads", THREADS[self.mode])
        super().__post_init__()

    def validate(self) -> None:
        check_mode(self.mode)
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.weight_dtype not in ("fp32", self.dtype):
            raise ValueError(f"weight dtype must be fp32 or {self.dtype}, got {self.weight_dtype!r}")
        if self.hidden <= 0 or self.hidden % self.vec:
            raise ValueError(f"hidden size must be a positive multiple of {self.vec} (16 bytes) "
                             f"for {self.dtype}, got {self.hidden}")
        if not 1 <= self.topk <= 64:
            raise ValueError(f"top-k must be in [1, 64], got {self.topk}")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads per CTA must be a multiple of 32 in [32, 1024], got {self.threads}")

    @property
    def vec(self) -> int:
        return checks.vector_elems(self.dtype)


@dataclasses.dataclass(frozen=True)
class CombineShape:
    """The sizes of one combine: T tokens of `hidden` elements, each the weighted sum of `topk` rows."""

    SIZE_FIELDS = ("tokens",)  # varies per call: bucketed by the tuned-config store (contract.bucket)
    tokens: int
    hidden: int = 2048
    topk: int = 8
    dtype: str = "bf16"
    weight_dtype: str = "fp32"

    @classmethod
    def defaults(cls, mode: str) -> "CombineShape":
        """Qwen3-30B-A3B's MoE layer at 128 tokens (decode) or 4096 (prefill)."""
        check_mode(mode)
        return cls(DEFAULT_TOKENS[mode])

    @classmethod
    def of(cls, expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor) -> "CombineShape":
        """The shape of a moe_combine call on expert_out [rows, H] and topk_weights, slot_map [T, k]."""
        return cls(slot_map.shape[0], expert_out.shape[1], slot_map.shape[1], checks.DTYPE_NAME[expert_out.dtype],
                   checks.DTYPE_NAME[topk_weights.dtype])


def choose_mode(num_tokens: int) -> str:
    return "decode" if num_tokens <= DECODE_MAX_TOKENS else "prefill"


def config_for(shape: CombineShape, sms: int | None = None) -> CombineConfig:
    """What moe_combine() launches for `shape` (on any GPU)."""
    return CombineConfig(shape.dtype, shape.weight_dtype, shape.hidden, shape.topk, choose_mode(shape.tokens))


def candidates(shape: CombineShape, sms: int | None = None) -> list[CombineConfig]:
    """Every CTA size of the tuner's search space, in the mode of `shape`."""
    base = config_for(shape)
    return [dataclasses.replace(base, threads=t) for t in THREAD_CHOICES]


rank = keep_order  # no cost model rates the candidates against each other


def variants_for(models: list[ModelDims] | None = None, modes: tuple[str, ...] = MODES,
                 max_tokens: int | None = None) -> list[CombineConfig]:
    """The configs warm-up compiles, with fp32 weights and weights in the model's dtype: of MODELS in
    bf16 (models None), or of the given models' MoE layers (dense models need none)."""
    if models is None:
        dims = [(h, k, "bf16") for h, _, k in MODELS.values()]
    else:
        dims = [(m.hidden, m.topk, m.dtype) for m in models if m.experts]
    return [CombineConfig(dtype, wdtype, h, k, mode) for h, k, dtype in dims
            for wdtype in dict.fromkeys(("fp32", dtype)) for mode in modes]


def token_range(cfg: CombineConfig) -> tuple[int, int]:
    """The token counts (lo, hi) a workload tests `cfg` on: every count of decode, or the first ones
    of prefill (the same code with more CTAs; small counts keep samples cheap)."""
    if cfg.mode == "decode":
        return 1, DECODE_MAX_TOKENS
    lo = DECODE_MAX_TOKENS + 1
    return lo, 2 * lo + 64
