"""KV-cache append planning: what a launch of the append kernel (rosekernels.kernels.append_kvcache) is
specialized on, which config a call gets, what the tuner may try and what warm-up compiles.

No CuTeDSL here: configs are chosen, listed and tested on a CPU without compiling.

A call moves batch x new_tokens x kv_heads rows of head_dim elements for each of k and v, one 128-bit
vector per thread. Only the dtype, the head dim and the cache layout (paged or contiguous) are
compiled in; every count, length and stride is a runtime value. Decode steps (up to
DECODE_MAX_TOKENS new tokens per sequence, speculative decoding included) and prefill chunks differ
only in the block size. An e4m3 cache (`fp8`) takes new tokens in any of the float dtypes and quantizes
them on the way in with a scale per KV head (or one for all): cache = e4m3(x / descale).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from rosekernels import checks
from rosekernels.contract import KernelConfig, keep_order
from rosekernels.models import ModelDims
from rosekernels.variant import MODES, check_mode

OP = "append_kvcache"
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TORCH_DTYPE = {checks.DTYPE_NAME[d]: d for d in DTYPES}
THREADS = (64, 128, 256, 512)  # threads per block the tuner tries
DEFAULT_THREADS = {"decode": 128, "prefill": 256}
DECODE_MAX_TOKENS = 16  # new tokens per sequence up to which a call is a decode step (attention_with_kvcache's S_q)


@dataclasses.dataclass(frozen=True)
class AppendShape:
    """The sizes and options of a call (the keys of `sip-tune --kernel append_kvcache --shape`)."""

    SIZE_FIELDS = ("batch", "new_tokens")  # vary per call: bucketed by the tuned-config store
    batch: int
    new_tokens: int = 1
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"  # the new tokens (and the cache, unless fp8)
    paged: bool = True
    fp8: bool = False  # an e4m3 cache

    @property
    def mode(self) -> str:
        return "decode" if self.new_tokens <= DECODE_MAX_TOKENS else "prefill"

    @classmethod
    def defaults(cls, mode: str) -> "AppendShape":
        """Qwen3-8B KV heads, bf16, a paged cache: a decode step of 16 sequences, or one 4096-token chunk."""
        check_mode(mode)
        return cls(batch=16, new_tokens=1) if mode == "decode" else cls(batch=1, new_tokens=4096)

    @classmethod
    def of(cls, k: torch.Tensor, block_table: torch.Tensor | None, fp8: bool = False) -> "AppendShape":
        """The shape of an append_kvcache call of k [B, S_new, Hkv, d] (paged: with a block table) into an
        e4m3 cache (fp8) or one of k's dtype."""
        batch, new_tokens, kv_heads, head_dim = k.shape
        return cls(batch, new_tokens, kv_heads, head_dim, checks.DTYPE_NAME[k.dtype], block_table is not None, fp8)


@dataclasses.dataclass(frozen=True)
class AppendConfig(KernelConfig):
    """Everything a compiled variant is specialized on: every field is compiled in."""

    OP = OP
    KEY_DEFAULTS = {"fp8": False}  # the keys predate it

    dtype: str  # new tokens (and the caches, unless fp8): "bf16" | "fp16" | "fp32"
    head_dim: int
    paged: bool  # [num_blocks, block_size, Hkv, d] with a block table, else [B, S_max, Hkv, d]
    mode: str  # "decode" | "prefill"
    threads: int  # per block: one 128-bit vector of k and one of v each
    fp8: bool = False  # e4m3 caches: the new tokens quantized with each KV head's scale

    @property
    def vec(self) -> int:
        """Elements per 128-bit access."""
        return checks.vector_elems(self.dtype)

    def validate(self) -> None:
        check_mode(self.mode)
        if self.dtype not in TORCH_DTYPE or self.head_dim not in HEAD_DIMS:
            raise ValueError(f"unsupported dtype {self.dtype} or head dim {self.head_dim}")
        if self.threads not in THREADS:
            raise ValueError(f"unsupported block size: {self.threads} threads")


def config_for(shape: AppendShape, sms: int | None = None) -> AppendConfig:
    """What append_kvcache() launches for `shape` (the block size of its mode; `sms` is not read:
    the grid covers the rows whatever the GPU)."""
    return AppendConfig(shape.dtype, int(shape.head_dim), bool(shape.paged), shape.mode, DEFAULT_THREADS[shape.mode],
                        bool(shape.fp8))


def candidates(shape: AppendShape, sms: int | None = None) -> list[AppendConfig]:
    """config_for(shape) with every block size of THREADS."""
    pick = config_for(shape, sms)
    return list(dict.fromkeys([pick, *(dataclasses.replace(pick, threads=t) for t in THREADS)]))


rank = keep_order  # no cost model rates the candidates against each other


def variants_for(models: Iterable[ModelDims] | None = None, modes: Iterable[str] = MODES,
                 max_tokens: int | None = None) -> list[AppendConfig]:
    """The configs append_kvcache() can launch in `modes` for `models` (their KV head dim and dtype,
    paged and contiguous caches, e4m3 ones too for a model with an FP8 KV cache; a head dim the kernel
    lacks needs none). None: every dtype and head dim, caches of the same dtype. `max_tokens` does not
    change the set."""
    if models is None:
        keys = [(dt, d, False) for dt in TORCH_DTYPE for d in HEAD_DIMS]
    else:
        keys = [(m.dtype, m.head_dim, fp8) for m in models if m.head_dim in HEAD_DIMS and m.dtype in TORCH_DTYPE
                for fp8 in dict.fromkeys((False, m.fp8_kv))]
    modes = [m for m in MODES if m in set(modes)]
    return list(dict.fromkeys(AppendConfig(dt, d, paged, mode, DEFAULT_THREADS[mode], fp8)
                              for dt, d, fp8 in keys for paged in (True, False) for mode in modes))
