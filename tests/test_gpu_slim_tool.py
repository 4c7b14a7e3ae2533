"""tools/gpu_slim.sh: what a fresh GPU host's first call leaves out of the tree, and back (no GPU)."""
import subprocess
from pathlib import Path

import pytest
from tool_repo import git, tool_repo


def slim(repo: Path, what: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "tools" / "gpu_slim.sh"), what], cwd=repo / "rosekernels",
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def repo(tmp_path):
    files = ("rosekernels/x.py", "rosekernels/tuned_entries/e/meta.json", "tests/test_a.py", "README.md",
             "bench/results/sip/t.json", "bench/b.py")
    r = tool_repo(tmp_path, "gpu_slim.sh", {**{f: f"{f}\n" for f in files}, ".gitignore": ".gpu/\n"})
    (r / ".gpu").mkdir()
    (r / ".gpu" / "bundle.xz").write_bytes(b"\0" * 1000)
    return r


def test_on_leaves_out_what_the_first_call_does_not_read_and_off_puts_it_back(repo):
    tracked = git(repo, "ls-files")
    exclude = (repo / ".git" / "info" / "exclude").read_text()
    on = slim(repo, "on")
    assert on.returncode == 0, on.stderr
    # the travelling tree: what is tracked and what is untracked but not ignored, and nothing of the rest
    travels = set(git(repo, "ls-files").split()) | set(git(repo, "ls-files", "--others", "--exclude-standard").split())
    assert travels == {".gitignore", "bench/b.py", "rosekernels/x.py", "tools/gpu_slim.sh"}
    size = sum((repo / f).stat().st_size for f in travels)
    assert f"the tree {size} bytes + .gpu and .whl 1000 bytes = {size + 1000} of {64 << 20}" in on.stdout
    assert (repo / "tests" / "test_a.py").is_file()  # left in the working tree, only out of the call
    assert slim(repo, "on").returncode == 1  # twice: refused, nothing changes
    off = slim(repo, "off")
    assert off.returncode == 0, off.stderr
    assert git(repo, "status", "--porcelain") == "" and git(repo, "ls-files") == tracked
    assert (repo / ".git" / "info" / "exclude").read_text() == exclude
    assert slim(repo, "off").returncode == 1


def test_on_refuses_staged_changes(repo):
    (repo / "rosekernels" / "x.py").write_text("changed\n")
    git(repo, "add", "rosekernels/x.py")
    r = slim(repo, "on")
    assert r.returncode == 1 and "staged" in r.stderr
    assert "gpu_slim" not in (repo / ".git" / "info" / "exclude").read_text()
