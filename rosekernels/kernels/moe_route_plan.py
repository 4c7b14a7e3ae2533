"""Planning of `moe_route` (see moe_route.py for the kernel): its config, the shape of a call, the
decode/prefill rule, the tuner's search space and the warm-up set. No CuTeDSL here.

One warp routes one token, so the variants differ only in the warps per CTA: few tokens (decode, up to
DECODE_MAX_TOKENS) are spread over more SMs by small CTAs. The expert count is compiled in: a lane holds
ceil(E / 32) logits in registers, at most MAX_EXPERTS / 32 = 16.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rosekernels.contract import KernelConfig, keep_order
from rosekernels.models import ModelDims
from rosekernels.modes import size_range
from rosekernels.variant import MODES, check_mode

if TYPE_CHECKING:  # (sip-tune --model plans without loading torch)
    import torch

OP = "moe_route"
DTYPE_NAMES = ("bf16", "fp16", "fp32")  # of the logits
MAX_EXPERTS = 512  # logits a warp holds in registers (16 a lane)
MAX_TOPK = 32  # a lane per chosen expert
WARPS = {"decode": 4, "prefill": 8}  # per CTA: small CTAs spread few tokens over more SMs
DECODE_MAX_TOKENS = 256  # at or below: the decode shape
WARP_CHOICES = (1, 2, 4, 8, 16)  # the tuner's search space


@dataclasses.dataclass(frozen=True)
class RouteConfig(KernelConfig):
    """Everything a compiled routing kernel is specialised on (the token count stays dynamic)."""

    OP = OP
    KEY_NAMES = {"weight_dtype": "wdtype"}

    dtype: str  # of the logits
    weight_dtype: str  # of topk_weights: "fp32" or `dtype`
    experts: int
    topk: int
    renormalize: bool  # the chosen experts' weights sum to 1 (softmax over them), not their share of all
    mode: str
    warps: int = 0  # per CTA; 0: WARPS[mode]
    pdl: bool = True  # programmatic dependent launch: waits for the kernel before it (the router GEMM)

    def __post_init__(self) -> None:
        if not self.warps and self.mode in WARPS:
            object.__setattr__(self, "warps", WARPS[self.mode])
        super().__post_init__()

    def validate(self) -> None:
        check_mode(self.mode)
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.weight_dtype not in ("fp32", self.dtype):
            raise ValueError(f"weight dtype must be fp32 or {self.dtype}, got {self.weight_dtype!r}")
        if not 1 <= self.experts <= MAX_EXPERTS:
            raise ValueError(f"experts must be in [1, {MAX_EXPERTS}], got {self.experts}")
        if not 1 <= self.topk <= min(self.experts, MAX_TOPK):
            raise ValueError(f"top-k must be in [1, {min(self.experts, MAX_TOPK)}] for {self.experts} experts, "
                             f"got {self.topk}")
        if not 1 <= self.warps <= 32:
            raise ValueError(f"warps per CTA must be in [1, 32], got {self.warps}")


@dataclasses.dataclass(frozen=True)
class RouteShape:
    """The sizes of one routing: T tokens' logits over `experts`, the `topk` largest chosen."""

    SIZE_FIELDS = ("tokens",)  # varies per call: bucketed by the tuned-config store (contract.bucket)
    tokens: int
    experts: int = 128
    topk: int = 8
    dtype: str = "bf16"
    weight_dtype: str = "fp32"
    renormalize: bool = True
    pdl: bool = True

    @classmethod
    def defaults(cls, mode: str) -> "RouteShape":
        """Qwen3-30B-A3B's router at moe_dispatch's default token counts (128 decode, 4096 prefill)."""
        from rosekernels.kernels.moe_dispatch_plan import DEFAULT_TOKENS

        check_mode(mode)
        return cls(DEFAULT_TOKENS[mode])

    @classmethod
    def of(cls, logits: torch.Tensor, topk: int, weight_dtype: torch.dtype, renormalize: bool,
           pdl: bool) -> "RouteShape":
        """The shape of a moe_route call on logits [T, E]."""
        from rosekernels import checks

        return cls(logits.shape[0], logits.shape[1], topk, checks.DTYPE_NAME[logits.dtype],
                   checks.DTYPE_NAME[weight_dtype], bool(renormalize), bool(pdl))


def choose_mode(num_tokens: int) -> str:
    return "decode" if num_tokens <= DECODE_MAX_TOKENS else "prefill"


def config_for(shape: RouteShape, sms: int | None = None) -> RouteConfig:
    """What moe_route() launches for `shape` (on any GPU)."""
    return RouteConfig(shape.dtype, shape.weight_dtype, shape.experts, shape.topk, shape.renormalize,
                       choose_mode(shape.tokens), pdl=shape.pdl)


def candidates(shape: RouteShape, sms: int | None = None) -> list[RouteConfig]:
    """Every CTA size of the tuner's search space, in the mode of `shape`."""
    base = config_for(shape)
    return [dataclasses.replace(base, warps=w) for w in WARP_CHOICES]


rank = keep_order  # no cost model rates the candidates against each other


def variants_for(models: list[ModelDims] | None = None, modes: tuple[str, ...] = MODES,
                 max_tokens: int | None = None) -> list[RouteConfig]:
    """The configs warm-up compiles: of the given models' routers, weights in the model's dtype (what
    rosekernels.hf's router hands the experts, as the stock router does) renormalised as the model's config
    says (dense models and routers past the kernel need none); or (models None) of MODELS in bf16 with bf16
    and fp32 weights (the op's default), renormalised or not."""
    if models is None:
        from rosekernels.kernels.moe_dispatch_plan import MODELS

        dims = [(e, k, "bf16", w) for _, e, k in MODELS.values() for w in ("bf16", "fp32")]
    else:
        dims = [(m.experts, m.topk, m.dtype, m.dtype, m.norm_topk) for m in models if takes(m.experts, m.topk)]
        return [RouteConfig(dtype, wdtype, e, k, renorm, mode) for e, k, dtype, wdtype, renorm in dict.fromkeys(dims)
                for mode in modes]
    return [RouteConfig(dtype, wdtype, e, k, renorm, mode) for e, k, dtype, wdtype in dims
            for renorm in (True, False) for mode in modes]


def takes(experts: int, topk: int) -> bool:
    """Whether the kernel routes `experts` logits to `topk` of them (a model with more keeps torch's router)."""
    return 1 <= experts <= MAX_EXPERTS and 1 <= topk <= min(experts, MAX_TOPK)


def token_range(cfg: RouteConfig) -> tuple[int, int]:
    """The token counts (lo, hi) a workload tests `cfg` on (modes.size_range): every count of decode, or the
    first ones of prefill (the same code with more CTAs; small counts keep samples cheap)."""
    return size_range(cfg.mode, choose_mode)
