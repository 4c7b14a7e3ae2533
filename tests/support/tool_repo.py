"""A throwaway git repository holding a copy of one of tools/' scripts, for the tools' CPU tests."""
import shutil
import subprocess
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def git(repo: Path, *args: str) -> str:
    """git's output in `repo`, with an identity for commits (a CI host may have none)."""
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout


def tool_repo(root: Path, script: str, files: dict[str, str]) -> Path:
    """root/r: `files` (path: text) and tools/<script>, committed once; skips the test where git is missing."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    r = root / "r"
    for path, text in files.items():
        (r / path).parent.mkdir(parents=True, exist_ok=True)
        (r / path).write_text(text)
    (r / "tools").mkdir(parents=True, exist_ok=True)
    shutil.copy(TOOLS / script, r / "tools" / script)
    git(r, "init", "-q")
    git(r, "add", "-A")
    git(r, "commit", "-q", "-m", "c")
    return r
