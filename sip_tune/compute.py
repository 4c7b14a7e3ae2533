"""The compute-bound kernels SIP's level 2 is aimed at (issue 40), as tuner workloads.

    CELLS: the kernels of the campaign (bench/sip_compute.py), each a Cell: how to build its workload,
    and the public op and shape the op-level check (sip_tune.oplevel) times it through.

Attention prefill (dense: d = 64 and 128, causal and not), the GEMM + activation prefill (M >= 4096,
plain and gated SwiGLU) and the FP8 GEMM prefill (channel and block scales) are the package's own
workloads (sip_tune.workloads). The varlen attention
kernel has none there (its launches take packed sequences), so `varlen_workload` is its: a few packed
sequences of ragged lengths for timing, one to three short ragged ones per test sample, each sequence
checked against the float64 reference of the dense kernel's check (rosekernels.kernels.attention_common).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random
from typing import Any, Callable

from rosekernels.workload import Workload
from sip_tune import oplevel, workloads

VARLEN = "attention_varlen"
TIMING_LENGTHS = (1536, 2048, 2560, 1024)  # the packed sequences timed: ragged, 7168 tokens


def varlen_workload(head_dim: int = 64, causal: bool = False, lengths: tuple[int, ...] = TIMING_LENGTHS,
                    heads: int = 16, dtype: str = "bf16") -> Workload:
    """The varlen prefill kernel (`attention.varlen_config` for the longest sequence) on packed
    self-attention sequences of `lengths`."""
    from rosekernels.kernels import attention as A

    if not lengths or min(lengths) < 1:
        raise ValueError(f"need at least one sequence, each of at least one token, got {lengths}")
    config = A.varlen_config(head_dim, dtype, causal, max(lengths))
    scale = 1.0 / math.sqrt(head_dim)

    def args_for(seqs: tuple[int, ...], seed: int) -> tuple:
        return _varlen_args(config, seqs, heads, seed, scale * A.LOG2_E)

    def test_args(seed: int) -> tuple:
        r = random.Random(seed)
        return args_for(tuple(r.randint(1, 3 * config.tile_m + 7) for _ in range(r.randint(1, 3))), seed)

    def verify(args: tuple) -> float:
        q, k, v, out, lse, cu = args[0][0], args[1][0], args[2][0], args[3][0], args[4][0], args[8]
        bounds = cu.tolist()
        worst = 0.0
        for s, e in zip(bounds, bounds[1:]):
            one = (lambda t: t[s:e].unsqueeze(0))  # noqa: E731 - one sequence as a batch of one
            worst = max(worst, A.check(one(out), lse[:, s:e].unsqueeze(0), one(q), one(k), one(v), causal, scale,
                                       f"{config} on a sequence of {e - s} of {bounds[-1]} packed tokens"))
        return worst

    return Workload(A.compile(config), lambda seed: args_for(tuple(lengths), seed), outputs=lambda args: args[3:5],
                    check=verify, test_args=test_args, name=VARLEN)


def _varlen_args(config: Any, lengths: tuple[int, ...], heads: int, seed: int, scale_log2: float) -> tuple:
    """The kernel's arguments as VarlenLaunch passes them: q/k/v/out [1, total, H, d] (TMA views),
    lse [1, H, total], the scale, a zeroed tile counter, the grid, the cumulative lengths and maxima;
    out and lse NaN, so that an element never written shows up."""
    import torch

    from rosekernels import checks, modes
    from rosekernels.kernels import attention as A
    from rosekernels.kernels import attention_common as AC

    g = torch.Generator(device="cuda").manual_seed(seed)
    total, dt, d = sum(lengths), checks.TORCH_DTYPE[config.dtype], config.head_dim

    def randn() -> torch.Tensor:
        return AC.tma_view(torch.randn(1, total, heads, d, generator=g, device="cuda").to(dt))

    q, k, v = randn(), randn(), randn()
    out = AC.tma_view(torch.full((1, total, heads, d), math.nan, device="cuda", dtype=dt))
    lse = torch.full((1, heads, total), math.nan, device="cuda")
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda", dtype=torch.int32)
    grid = A.grid_size(config, len(lengths), max(lengths), heads, modes.sm_count(q.device.index))
    return (q, k, v, out, lse, scale_log2, torch.zeros(1, device="cuda", dtype=torch.int32), grid, cu, cu,
            max(lengths), max(lengths))


def varlen_factory(head_dim: int = 64, causal: bool = False, lengths: tuple[int, ...] = TIMING_LENGTHS,
                   heads: int = 16, dtype: str = "bf16") -> Callable[[], Workload]:
    """`varlen_workload` with these arguments, picklable (the tuner's worker builds it again)."""
    return functools.partial(varlen_workload, head_dim, causal, tuple(lengths), heads, dtype)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One kernel of the campaign: its workload factory and where the op-level check reaches it."""

    name: str
    factory: Callable[[], Workload]
    op: str  # the kernel name sip_tune.oplevel knows the public op by
    shape: Any  # the shape sip_tune.oplevel times the op at (a kernel module's Shape, or oplevel.VarlenShape)
    about: str


def _dense(name: str, kernel: str, shape: dict[str, Any], about: str) -> Cell:
    _, full = workloads.resolve(kernel, "prefill", shape)
    return Cell(name, workloads.factory(kernel, "prefill", shape), kernel, full, about)


def cells() -> dict[str, Cell]:
    """The campaign's kernels, in its priority order (issue 40: the varlen d=64 loop first)."""
    out = [
        Cell("attention_varlen_d64", varlen_factory(64, False), VARLEN, oplevel.VarlenShape(64, False, TIMING_LENGTHS),
             "varlen attention prefill d=64 non-causal, 4 packed sequences (7168 tokens), 16 heads"),
        _dense("attention_d64", "attention", {"head_dim": 64, "causal": False},
               "attention prefill d=64 non-causal, B=2 S=2048 H=16"),
        _dense("attention_d64_causal", "attention", {"head_dim": 64, "causal": True},
               "attention prefill d=64 causal, B=2 S=2048 H=16"),
        _dense("attention_d128", "attention", {"head_dim": 128, "causal": False},
               "attention prefill d=128 non-causal, B=2 S=2048 H=16"),
        _dense("attention_d128_causal", "attention", {"head_dim": 128, "causal": True},
               "attention prefill d=128 causal, B=2 S=2048 H=16"),
        # From about 8k keys on, d=128 non-causal launches its 192-key variant (attention_plan.config_for):
        # another cubin, which the 2k cell's entry does not serve.
        _dense("attention_d128_long", "attention", {"head_dim": 128, "causal": False, "seqlen": 8192},
               "attention prefill d=128 non-causal, 192-key tiles, B=2 S=8192 H=16"),
        _dense("gemm_prefill", "gemm_leakyrelu", {"m": 4096},
               "GEMM + LeakyReLU prefill, M=4096 N=14336 K=4096"),
        _dense("gemm_swiglu_prefill", "gemm_leakyrelu", {"m": 4096, "gated": True, "activation": "silu"},
               "gated GEMM (SwiGLU) prefill, M=4096 N=14336 (7168 out) K=4096"),
        # The FP8 GEMM adds each k-tile's WGMMA sums into fp32 with 64 FADDs / FFMAs a thread, between the
        # wait for them and the next k-tile's WGMMAs: instructions, not barriers, on its critical path.
        _dense("gemm_fp8_prefill", "gemm_fp8", {"m": 4096, "n": 14336, "k": 4096},
               "FP8 GEMM prefill, per-token x per-channel scales, M=4096 N=14336 K=4096"),
        _dense("gemm_fp8_block_prefill", "gemm_fp8", {"m": 4096, "n": 14336, "k": 4096, "scales": "block"},
               "FP8 GEMM prefill, 1x128 x 128x128 block scales, M=4096 N=14336 K=4096"),
    ]
    return {c.name: c for c in out}
