"""Shared by the attention tests: the result check against the float64 reference (the one the kernels'
workloads check with), inputs, a hang-safe sync."""
import os
import sys
import time

import torch

from rosekernels.kernels.attention_common import check  # noqa: F401


def inputs(b, s_q, s_k, hq, hkv, d, dtype, seed):
    """Fresh random q [b, s_q, hq, d], k and v [b, s_k, hkv, d] on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g, device="cuda").to(dtype)
            for s, h in ((s_q, hq), (s_k, hkv), (s_k, hkv))]


def sync(what, timeout_s=60.0):
    """Synchronize, but end the process with a message if the kernel hangs (a pipeline deadlock
    would otherwise hold the GPU until the job's time runs out)."""
    done = torch.cuda.Event()
    done.record()
    start = time.time()
    while not done.query():
        if time.time() - start > timeout_s:
            print(f"\nKERNEL HANG: {what} did not finish in {timeout_s:.0f} s", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.001)
