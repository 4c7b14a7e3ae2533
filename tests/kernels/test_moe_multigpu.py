"""The MoE protocol of rosekernels.moe on two GPUs (skipped with fewer): one torchrun command runs
tests/support/moe_multigpu_worker.py on two ranks over SymmetricMemory: the arena mapping, ranks that
disagree on the layout refused on both, both forms against single-GPU references, a soak of 10^4 steps
of each (eager and graph replays, random token counts and delays, checksums compared bitwise) and the
same soak on a build with the fences scoped to one GPU, whose findings are printed (pytest -s), not
asserted."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parents[1] / "support" / "moe_multigpu_worker.py"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_over_symmetric_memory():
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count(": ok") == 2 and run.stdout.count(": soak ") == 2
    print("".join(line + "\n" for line in run.stdout.splitlines() if "soak" in line or "weak" in line))
