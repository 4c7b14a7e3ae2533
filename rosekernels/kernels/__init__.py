"""The kernel modules, each following `rosekernels.contract` (device code, compile, reference and
workload; configs, shapes and heuristics in its `<kernel>_plan.py`, its op in rosekernels/ops), and
the one lookup of a kernel module by name: `kernel_module`, for warm-up, sip-tune and the tools."""
from __future__ import annotations

import importlib
from types import ModuleType

# name -> module of every kernel (rosekernels.KERNELS is this dict): what warm-up compiles for a model,
# and what sip-tune --kernel accepts.
KERNELS = {name: f"rosekernels.kernels.{name}" for name in (
    "qk_norm", "rmsnorm", "moe_dispatch", "moe_combine", "gemm_leakyrelu", "attention", "attention_decode",
    "append_kvcache", "grouped_gemm", "quantize_fp8", "gemm_fp8", "moe_route")}


def kernel_module(name: str) -> ModuleType:
    """The kernel module `KERNELS[name]`, imported; ValueError naming the kernels for another name."""
    if name not in KERNELS:
        raise ValueError(f"no kernel module for {name!r}; the kernels are {sorted(KERNELS)}")
    # By name, from the registry: a lookup imports the one kernel asked for (each loads CuTeDSL and
    # its device code), and tests register toy kernels here.
    return importlib.import_module(KERNELS[name])
