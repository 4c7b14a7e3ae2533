"""Planning of `moe_dispatch` (see moe_dispatch.py for the kernel): its config, the shape of a call,
the decode/prefill rule, the grid, the tuner's search space and the warm-up set. No CuTeDSL here:
this is tested and swept on a CPU.

Mode: the decode variant routes every pair in every CTA, in shared memory (at most
DECODE_PAIRS_PER_THREAD pairs per thread), so no CTA waits for another; the prefill variant shares
the routing between CTAs through a grid barrier. A call of up to DECODE_MAX_PAIRS (token, choice)
pairs is decode.
Grid: at most one CTA per SM in both variants (prefill CTAs wait for each other at a grid barrier, so
all must be resident; every decode CTA repeats the whole routing, so more CTAs than SMs would only
repeat it). Prefill: one CTA per token up to that; decode: enough CTAs that each copies at least
DECODE_VECS_PER_CTA 16-byte vectors.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rosekernels import checks
from rosekernels.contract import KernelConfig, keep_order
from rosekernels.models import ModelDims
from rosekernels.variant import MODES, check_mode

OP = "moe_dispatch"
DTYPE_NAMES = ("bf16", "fp16", "fp32")  # of the tokens and the buffer (moe_combine: of the rows)
THREADS = 1024  # one expert per thread in the layout scan: num_experts <= threads
UNROLL = 4  # 16-byte vectors per thread in flight in the copy
DECODE_MAX_PAIRS = 2048  # T*k at or below this: routing in every CTA (decode), above: shared (prefill)
DECODE_PAIRS_PER_THREAD = 8  # the decode variant keeps every pair in shared memory and 8 ids per thread
DECODE_PAIRS_LIMIT = DECODE_PAIRS_PER_THREAD * THREADS
DECODE_VECS_PER_CTA = 256  # decode: spread the copy so that each CTA moves at least this many vectors
DEFAULT_BLOCK_SIZE = 128  # tile height of a Hopper grouped GEMM
DEFAULT_TOKENS = {"decode": 128, "prefill": 4096}  # what sip-tune tunes without --shape
# The models warm-up covers by default, and their (hidden, experts, top-k); moe_combine's too.
MODELS = {"qwen3-30b-a3b": (2048, 128, 8), "deepseek-v3": (7168, 256, 8)}
# The tuner's search space: threads per CTA (at least one per expert) x vectors in flight per thread,
# at most MAX_VECS_PER_CTA in flight per CTA: at 1024 threads ptxas has 64 registers per thread, and 8
# vectors (32 registers) spill there.
THREAD_CHOICES = (128, 256, 512, 1024)
UNROLL_CHOICES = (1, 2, 4, 8)
MAX_VECS_PER_CTA = 4096


@dataclasses.dataclass(frozen=True)
class DispatchConfig(KernelConfig):
    """Everything a compiled dispatch kernel is specialised on (all runtime sizes stay dynamic)."""

    OP = OP
    KEY_NAMES = {"num_experts": "experts", "expert_first": "first", "experts_total": "total"}
    # The range only where there is one: whole-range keys (compile caches, tuned store) stay as they were.
    KEY_DEFAULTS = {"experts_total": 0, "expert_first": lambda c: None if c.ranged else 0}

    dtype: str  # "bf16" | "fp16" | "fp32", of x and the buffer
    hidden: int
    num_experts: int
    topk: int
    mode: str  # "prefill" | "decode"
    threads: int = THREADS
    unroll: int = UNROLL
    # Tensor parallel: this kernel routes only to experts expert_first .. expert_first + num_experts - 1
    # of experts_total (0: num_experts, the whole range); ids of the other ranks' experts are skipped
    # (slot -1), ids outside [-1, experts_total) are invalid.
    expert_first: int = 0
    experts_total: int = 0

    def __post_init__(self) -> None:
        if self.experts_total == self.num_experts and not self.expert_first:
            object.__setattr__(self, "experts_total", 0)  # the whole range: one spelling per kernel
        super().__post_init__()

    def validate(self) -> None:
        check_mode(self.mode)
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.hidden <= 0 or self.hidden % self.vec:
            raise ValueError(f"hidden size must be a positive multiple of {self.vec} (16 bytes) "
                             f"for {self.dtype}, got {self.hidden}")
        if not 1 <= self.num_experts <= self.threads:
            raise ValueError(f"num_experts must be in [1, {self.threads}], got {self.num_experts}")
        if not 1 <= self.topk <= 64:
            raise ValueError(f"top-k must be in [1, 64], got {self.topk}")
        if self.threads % 32 or not 32 <= self.threads <= 1024 or self.unroll < 1:
            raise ValueError(f"bad launch shape: threads={self.threads}, unroll={self.unroll}")
        if self.experts_total and not 0 <= self.expert_first <= self.experts_total - self.num_experts:
            raise ValueError(f"experts {self.expert_first} .. {self.expert_first + self.num_experts - 1} are not "
                             f"within the {self.experts_total} experts")
        if not self.experts_total and self.expert_first:
            raise ValueError("expert_first needs experts_total")

    @property
    def vec(self) -> int:
        return checks.vector_elems(self.dtype)

    @property
    def decode_pairs_limit(self) -> int:
        return DECODE_PAIRS_PER_THREAD * self.threads

    @property
    def total_experts(self) -> int:
        """Every rank's experts: the range the ids come from."""
        return self.experts_total or self.num_experts

    @property
    def ranged(self) -> bool:
        """Whether the kernel routes to a part of the experts only (tensor parallel)."""
        return self.total_experts != self.num_experts


@dataclasses.dataclass(frozen=True)
class DispatchShape:
    """The sizes of one dispatch: T tokens of `hidden` elements, each routed to `topk` of `experts`."""

    SIZE_FIELDS = ("tokens",)  # varies per call: bucketed by the tuned-config store (contract.bucket)
    tokens: int
    hidden: int = 2048
    experts: int = 128
    topk: int = 8
    dtype: str = "bf16"

    @classmethod
    def defaults(cls, mode: str) -> "DispatchShape":
        """Qwen3-30B-A3B's MoE layer at 128 tokens (decode) or 4096 (prefill)."""
        check_mode(mode)
        return cls(DEFAULT_TOKENS[mode])

    @classmethod
    def of(cls, x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> "DispatchShape":
        """The shape of a moe_dispatch call on x [T, H] and topk_ids [T, k]."""
        return cls(x.shape[0], x.shape[1], num_experts, topk_ids.shape[1], checks.DTYPE_NAME[x.dtype])


def choose_mode(num_tokens: int, topk: int) -> str:
    return "decode" if num_tokens * topk <= DECODE_MAX_PAIRS else "prefill"


def config_for(shape: DispatchShape, sms: int | None = None) -> DispatchConfig:
    """What moe_dispatch() launches for `shape` (on any GPU: the grid follows the SM count, not the config)."""
    return DispatchConfig(shape.dtype, shape.hidden, shape.experts, shape.topk, choose_mode(shape.tokens, shape.topk))


def candidates(shape: DispatchShape, sms: int | None = None) -> list[DispatchConfig]:
    """Every config of the tuner's search space that serves `shape` in its mode: threads per CTA x
    unroll, with a thread per expert; a decode config must route every pair count of the decode mode."""
    base = config_for(shape)
    return [dataclasses.replace(base, threads=t, unroll=u) for t in THREAD_CHOICES for u in UNROLL_CHOICES
            if t >= shape.experts and t * u <= MAX_VECS_PER_CTA
            and (base.mode == "prefill" or DECODE_PAIRS_PER_THREAD * t >= DECODE_MAX_PAIRS)]


rank = keep_order  # no cost model rates the candidates against each other


def variants_for(models: list[ModelDims] | None = None, modes: tuple[str, ...] = MODES,
                 max_tokens: int | None = None) -> list[DispatchConfig]:
    """The configs warm-up compiles: of MODELS in bf16 (models None), or of the given models' MoE
    layers (dense models need none)."""
    if models is None:
        dims = [(h, e, k, "bf16") for h, e, k in MODELS.values()]
    else:
        dims = [(m.hidden, m.experts, m.topk, m.dtype) for m in models if m.experts]
    return [DispatchConfig(dtype, h, e, k, mode) for h, e, k, dtype in dims for mode in modes]


def token_range(cfg: DispatchConfig) -> tuple[int, int]:
    """The token counts (lo, hi) a workload tests `cfg` on: every count of its mode (decode, as far as
    its pair limit goes), or the first ones of prefill (the same code with more CTAs; small counts keep
    samples cheap and exercise the ragged tails)."""
    if cfg.mode == "decode":
        return 1, min(DECODE_MAX_PAIRS, cfg.decode_pairs_limit) // cfg.topk
    lo = DECODE_MAX_PAIRS // cfg.topk + 1
    return lo, 2 * lo + 64


def num_ctas(cfg: DispatchConfig, num_tokens: int, sms: int) -> int:
    """The grid on a GPU of `sms` SMs (see the module docstring)."""
    if cfg.mode == "decode":
        want = -(-num_tokens * (cfg.hidden // cfg.vec) // DECODE_VECS_PER_CTA)
    else:
        want = num_tokens
    return max(1, min(sms, want))


def meta_layout(num_experts: int) -> dict[str, int]:
    """Offsets into the int32 `meta` output: counts [E], offsets [E+1], overflow [1], invalid [1]."""
    e = num_experts
    return {"counts": 0, "offsets": e, "overflow": 2 * e + 1, "invalid": 2 * e + 2, "size": 2 * e + 3}


def default_capacity(num_tokens: int, topk: int, num_experts: int, block_size: int) -> int:
    """Rows that always suffice: every pair, plus the padding of every expert that can be non-empty
    (at most min(E, T*k) experts are; an empty expert takes no rows)."""
    pairs = num_tokens * topk
    return pairs + min(num_experts, pairs) * (block_size - 1)  # builtin min: dynamo traces it on SymInts


def expert_range(num_experts: Any, local_experts: tuple[int, int] | None) -> tuple[int, int]:
    """(first, count) of local_experts, checked against num_experts; (0, num_experts) for None."""
    if local_experts is None:
        return 0, num_experts
    first, count = local_experts
    if any(isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)) for n in (first, count)) or \
            not (count >= 1 and 0 <= first and first + count <= num_experts):
        raise ValueError(f"local_experts must be (first, count) with 0 <= first, count >= 1 and first + count <= "
                         f"num_experts = {num_experts}, got {local_experts!r}")
    return first, count
