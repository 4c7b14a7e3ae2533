"""rosekernels: CuTeDSL kernels for LLM inference on Hopper (sm_90a)."""
