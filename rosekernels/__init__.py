"""rosekernels: CuTeDSL kernels for LLM inference on Hopper (sm_90a).

The ops load on first use (importing CuTeDSL takes seconds), e.g. `rosekernels.qk_norm(q, k, wq, wk)`.
"""
import importlib
import os

# Before anything imports cutlass: unset, CuTeDSL silently targets sm_100a.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

_EXPORTS = {
    "qk_norm": "rosekernels.kernels.qk_norm",
    "rmsnorm": "rosekernels.kernels.rmsnorm",
    "moe_dispatch": "rosekernels.kernels.moe_dispatch",
    "moe_combine": "rosekernels.kernels.moe_combine",
    "gemm_leakyrelu": "rosekernels.kernels.gemm_leakyrelu",
    "attention": "rosekernels.kernels.attention",
    "warmup": "rosekernels.warmup",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rosekernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
