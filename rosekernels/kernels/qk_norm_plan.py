"""QK norm planning: what a launch of the QK-norm kernel (rosekernels.kernels.qk_norm) is specialized
on, which config a call gets, the configs the tuner may try and the ones warm-up compiles.

No CuTeDSL here: configs are chosen, listed and tested on a CPU without compiling.

A call's work is tokens x (q_heads + k_heads) heads of `head_dim` elements, a (sub-)warp per head
(`threads_per_head` threads moving 128 bits each), and with `rope` the rotary embedding of each normed head
by its token's cos and sin rows. Fewer warps than SMs -> the decode config (one-warp
blocks); otherwise the prefill row of rosekernels.modes.PREFILL_TABLE (block size, heads per thread
group, cache hint).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from rosekernels import checks
from rosekernels.contract import KernelConfig, keep_order
from rosekernels.models import ModelDims
from rosekernels.modes import CACHE_HINTS, PREFILL_WARPS, Mode, all_modes, select, warps_needed
from rosekernels.variant import MODES, check_mode

OP = "qk_norm"
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TORCH_DTYPE = {checks.DTYPE_NAME[d]: d for d in DTYPES}
ROWS_PER_THREAD = (1, 2, 4)  # heads per thread group the tuner tries: loads in flight per thread
# (q heads, kv heads) of the models variants_for() covers by default.
MODEL_HEADS = {"qwen3-8b": (32, 8), "qwen3-30b-a3b": (32, 4)}


@dataclasses.dataclass(frozen=True)
class QKNormShape:
    """The sizes and options of a call (the keys of `sip-tune --kernel qk_norm --shape`)."""

    SIZE_FIELDS = ("tokens",)  # varies per call: bucketed by the tuned-config store (contract.bucket)
    tokens: int
    q_heads: int = 32
    k_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"  # q, k and the outputs
    weight_dtype: str | None = None  # None: the input dtype
    eps: float = 1e-6
    weight_bias: float = 0.0
    pdl: bool = True  # programmatic dependent launch (qk_norm(enable_pdl=...))
    rope: str | None = None  # the dtype of the rotary cos/sin tables (qk_norm(cos=..., sin=...)); None: no rope

    def __post_init__(self) -> None:
        if self.weight_dtype == self.dtype:  # one spelling per problem: the tuned store keys on it
            object.__setattr__(self, "weight_dtype", None)
        if self.rope == "none":  # (the config's spelling, as `sip-tune --shape rope=none` gives it)
            object.__setattr__(self, "rope", None)

    @classmethod
    def defaults(cls, mode: str) -> "QKNormShape":
        """Qwen3-8B heads, bf16: one token (decode) or 4096 (prefill)."""
        check_mode(mode)
        return cls(tokens=1 if mode == "decode" else 4096)

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, eps: float, weight_bias: float,
           pdl: bool, cos: torch.Tensor | None = None) -> "QKNormShape":
        """The shape of a qk_norm call on q [T, hq, d], k [T, hk, d], weights like q_weight and rotary tables
        like cos (None: no rope)."""
        tokens, q_heads, head_dim = q.shape
        return cls(tokens, q_heads, k.shape[1], head_dim, checks.DTYPE_NAME[q.dtype], checks.DTYPE_NAME[q_weight.dtype],
                   eps, weight_bias, pdl, None if cos is None else checks.DTYPE_NAME[cos.dtype])


@dataclasses.dataclass(frozen=True)
class QKNormConfig(KernelConfig):
    """Everything a compiled variant is specialized on: every field is compiled in."""

    OP = OP
    KEY_DEFAULTS = {"pdl": True, "rope": "none"}  # the keys predate them

    dtype: str  # q, k and the outputs: "bf16" | "fp16" | "fp32"
    weight_dtype: str  # both weights: the input dtype or "fp32"
    head_dim: int
    q_heads: int
    k_heads: int
    eps: float
    weight_bias: float
    mode: str  # "decode" | "prefill"
    warps: int  # warps per block
    rows_per_thread: int  # heads per thread group
    cache_hint: str  # for q/k loads and output stores: one of modes.CACHE_HINTS
    # Programmatic dependent launch: the block waits for the previous kernel (griddepcontrol.wait)
    # before its loads and lets the next one launch once they are issued.
    pdl: bool = True
    # The rotary embedding after the norm (transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin,
    # each token's cos and sin rows of head_dim values): the tables' dtype, or "none".
    rope: str = "none"

    @property
    def vec(self) -> int:
        """Elements per 128-bit access."""
        return checks.vector_elems(self.dtype)

    @property
    def threads_per_head(self) -> int:
        return min(32, self.head_dim // self.vec)

    @property
    def vecs_per_thread(self) -> int:
        return self.head_dim // (self.vec * self.threads_per_head)

    @property
    def groups_per_block(self) -> int:
        return self.warps * 32 // self.threads_per_head

    @property
    def heads_per_block(self) -> int:
        return self.groups_per_block * self.rows_per_thread

    def validate(self) -> None:
        check_mode(self.mode)
        if self.dtype not in TORCH_DTYPE or self.weight_dtype not in (self.dtype, "fp32"):
            raise ValueError(f"unsupported dtypes {self.dtype}/{self.weight_dtype}")
        if self.head_dim not in HEAD_DIMS or min(self.q_heads, self.k_heads) < 1:
            raise ValueError(f"unsupported head_dim {self.head_dim} or head counts")
        if self.warps not in (1, 2, 4, 8, 16, 32) or self.rows_per_thread < 1:
            raise ValueError(f"unsupported block shape: {self.warps} warps x {self.rows_per_thread} rows")
        if self.cache_hint not in CACHE_HINTS:
            raise ValueError(f"unknown cache hint {self.cache_hint!r}")
        if self.rope not in ("none", self.dtype, "fp32"):  # (a table chunk as wide as q's 16-byte one, or two)
            raise ValueError(f"rope tables must be {self.dtype} or fp32 ('none': no rope), got {self.rope!r}")


def config_for(shape: QKNormShape, sms: int | None = None) -> QKNormConfig:
    """What qk_norm() launches for `shape` on a GPU of `sms` SMs (None: the current device's):
    decode below the SM count, else the prefill table."""
    per_head = min(32, shape.head_dim // checks.vector_elems(shape.dtype))
    mode = select(OP, warps_needed(shape.tokens * (shape.q_heads + shape.k_heads), per_head), sms)
    return _config(shape, mode)


def candidates(shape: QKNormShape, sms: int | None = None) -> list[QKNormConfig]:
    """Every config of `shape`'s mode: the decode config, or every prefill block shape (warps x heads
    per thread group) with every cache hint. config_for(shape) is among them."""
    cfg = config_for(shape, sms)
    if cfg.mode == "decode":
        return [cfg]
    # With rope, 1024-thread blocks (64 registers a thread) hold one head a thread group: at two or four the
    # tables' and partners' values spill (ptxas: 88-229 local loads and stores).
    return [dataclasses.replace(cfg, warps=w, rows_per_thread=r, cache_hint=h)
            for w in PREFILL_WARPS for r in ROWS_PER_THREAD for h in CACHE_HINTS
            if not (shape.rope and w == 32 and r > 1)]


rank = keep_order  # no cost model rates the candidates against each other


def variants_for(models: Iterable[ModelDims] | None = None, modes: Iterable[str] = MODES,
                 max_tokens: int | None = None) -> list[QKNormConfig]:
    """The configs qk_norm() can launch in `modes` for `models` (rosekernels.models.ModelDims: their
    heads, head dim and dtype, weights in that dtype or fp32; a head dim the kernel lacks, or a model
    family without q/k norms, needs none), with the rotary embedding in their dtype (as rosekernels.hf runs
    them) and without it. None: the MODEL_HEADS models in every dtype and head dim, likewise."""
    # Shapes of no tokens: the token count only picks the mode, and every mode is listed.
    if models is None:
        shapes = [QKNormShape(0, hq, hk, d, dt, wdt, rope=rope) for hq, hk in MODEL_HEADS.values()
                  for dt in TORCH_DTYPE for wdt in dict.fromkeys((dt, "fp32")) for d in HEAD_DIMS
                  for rope in (None, dt)]
    else:
        shapes = [QKNormShape(0, m.heads_q, m.heads_kv, m.head_dim, m.dtype, wdt, rope=rope)
                  for m in models if m.qk_norm and m.head_dim in HEAD_DIMS for wdt in dict.fromkeys((m.dtype, "fp32"))
                  for rope in (None, m.dtype)]
    modes = set(modes)
    return list(dict.fromkeys(_config(s, mode) for s in shapes for mode in all_modes(OP) if mode.name in modes))


def _config(shape: QKNormShape, mode: Mode) -> QKNormConfig:
    return QKNormConfig(shape.dtype, shape.weight_dtype or shape.dtype, int(shape.head_dim),
                        int(shape.q_heads), int(shape.k_heads), float(shape.eps), float(shape.weight_bias),
                        mode.name, mode.warps, mode.rows_per_thread, mode.cache_hint, bool(shape.pdl),
                        shape.rope or "none")
