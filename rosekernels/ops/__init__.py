"""Ops that choose between kernels (each kernel's own op lives in its kernel module)."""
