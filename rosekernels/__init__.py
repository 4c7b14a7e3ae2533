"""rosekernels: CuTeDSL kernels for LLM inference on Hopper (sm_90a).

The ops load on first use (importing CuTeDSL takes seconds), e.g. `rosekernels.qk_norm(q, k, wq, wk)`.
"""
import importlib
import os

# Before anything imports cutlass: unset, CuTeDSL silently targets sm_100a.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# The kernel modules, each following the contract of rosekernels.contract (warm-up and sip-tune use it).
KERNELS = {name: f"rosekernels.kernels.{name}" for name in (
    "qk_norm", "rmsnorm", "moe_dispatch", "moe_combine", "gemm_leakyrelu", "attention", "attention_decode")}
# The public ops and where each is defined: a kernel's own module, or rosekernels.ops where an op
# chooses between kernels. warmup lives in `startup`: a submodule named `warmup` would shadow the
# function once imported.
_EXPORTS = {**KERNELS, "attention": "rosekernels.ops.attention", "warmup": "rosekernels.startup"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rosekernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
