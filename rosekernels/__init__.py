"""rosekernels: CuTeDSL kernels for LLM inference on Hopper (sm_90a).

The ops load on first use (importing CuTeDSL takes seconds), e.g. `rosekernels.qk_norm(q, k, wq, wk)`.
"""
import importlib
import os

# Before anything imports cutlass: unset, CuTeDSL silently targets sm_100a.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# Each op and the kernel module that defines it (the SIP tuner reads this too).
OPS = {name: f"rosekernels.kernels.{name}" for name in (
    "qk_norm", "rmsnorm", "moe_dispatch", "moe_combine", "gemm_leakyrelu", "attention", "attention_decode")}
# warmup lives in `startup`: a submodule named `warmup` would shadow the function once imported.
_EXPORTS = {**OPS, "warmup": "rosekernels.startup"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rosekernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
