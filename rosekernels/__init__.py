"""rosekernels: CuTeDSL kernels for LLM inference on Hopper (sm_90a)."""
import os

# Before anything imports cutlass: unset, CuTeDSL silently targets sm_100a.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
