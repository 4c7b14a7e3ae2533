"""Whether this machine has the GPU the kernels run on (an sm_90 H100/H200), as every command and script
checks it, and the exit status they share when it has not:

    0 done, 1 failed, 2 bad arguments, NO_GPU_EXIT (3) no sm_90 GPU visible

so that a script can tell "nothing to run on" from a failure. torch is imported only when asked.
"""
from __future__ import annotations

import sys

NO_GPU_EXIT = 3


def gpu_problem() -> str | None:
    """Why this machine cannot run the kernels (None: it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    cap = torch.cuda.get_device_capability(0)
    if cap != (9, 0):
        return f"device 0 is sm_{cap[0]}{cap[1]} ({torch.cuda.get_device_name(0)})"
    return None


def require_gpu(program: str, purpose: str = "to run") -> None:
    """Exit with NO_GPU_EXIT and one line on stderr where there is no sm_90 GPU."""
    problem = gpu_problem()
    if problem:
        print(f"{program}: needs a CUDA sm_90 GPU (H100/H200) {purpose}: {problem}.", file=sys.stderr)
        raise SystemExit(NO_GPU_EXIT)
