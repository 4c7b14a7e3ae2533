"""CuTeDSL kernels, one per module (config, host launcher, device body, torch op)."""
