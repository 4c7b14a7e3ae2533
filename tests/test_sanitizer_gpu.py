"""Every op on ragged shapes under compute-sanitizer memcheck, racecheck and synccheck, and the KV-cache
ops on lying block tables and lengths under memcheck: zero errors. Driver symbol probing
(cuGetProcAddress) shows up as CUDA API errors, hence --report-api-errors no."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "support" / "sanitize_ops.py"
LYING = Path(__file__).parent / "support" / "lying_tables.py"


def _sanitize(tool: str, script: Path) -> tuple[subprocess.CompletedProcess, str]:
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer not found")
    # Without torch's caching allocator each tensor is an allocation of its own: memcheck then sees a
    # write past one tensor into its neighbour, not a write inside one cached block.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH", "")]),
               PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    run = subprocess.run([sanitizer, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "99",
                          sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=1200)
    return run, (run.stdout + run.stderr)[-3000:]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_every_op_is_clean_under_compute_sanitizer(tool):
    run, tail = _sanitize(tool, SCRIPT)
    assert run.returncode == 0, tail
    assert "all ops ran" in run.stdout, tail
    # memcheck and synccheck print "ERROR SUMMARY: 0 errors", racecheck "... (0 errors, 0 warnings)".
    summary = "RACECHECK SUMMARY: 0 hazards" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
    assert summary in run.stdout + run.stderr, tail


@pytest.mark.gpu
@pytest.mark.slow
def test_lying_block_tables_and_lengths_are_clean_under_memcheck():
    """attention_with_kvcache and append_kvcache, on bf16 and e4m3 caches, given block ids past the cache or
    negative and lengths past the table or negative (tests/support/lying_tables.py, which also checks the
    results): no access outside any allocation."""
    run, tail = _sanitize("memcheck", LYING)
    assert run.returncode == 0, tail
    assert "lying tables ran" in run.stdout and "ERROR SUMMARY: 0 errors" in run.stdout + run.stderr, tail
