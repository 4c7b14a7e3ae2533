"""tools/gpu_env.sh: runs started side by side install the carried bundles one at a time (no GPU)."""
import shutil
import subprocess

import pytest
from tool_repo import tool_repo

# A stand-in bundle: its install marks its start and end around a pause, so overlapping installs interleave.
INSTALL = 'echo "start $$" >> "$LOG"; sleep 0.5; echo "end $$" >> "$LOG"\n'


def test_side_by_side_runs_install_one_at_a_time(tmp_path):
    if shutil.which("flock", path="/usr/bin:/bin") is None:  # the PATH the script runs with below
        pytest.skip("needs flock (util-linux)")
    repo = tool_repo(tmp_path, "gpu_env.sh", {".gpu/install.sh": INSTALL})
    log = tmp_path / "log"
    env = {"PATH": "/usr/bin:/bin", "LOG": str(log)}
    runs = [subprocess.Popen(["bash", str(repo / "tools" / "gpu_env.sh"), "true"], cwd=repo, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    for r in runs:
        r.communicate(timeout=30)
    marks = [line.split()[0] for line in log.read_text().splitlines()]
    assert marks == ["start", "end", "start", "end"], log.read_text()
