"""tools/gpu_ab.sh: a branch and its base (the branch's tree with a patch reversed) run a command in turns (no GPU)."""
import subprocess
import time
from pathlib import Path

import pytest
from tool_repo import git, tool_repo


def ab(repo: Path, tmp: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "AB_BASE": str(tmp / "base"), "AB_LOGS": str(tmp / "logs"), **extra}
    return subprocess.run(["bash", str(repo / "tools" / "gpu_ab.sh"), *args], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def repo(tmp_path):
    # tools/gpu_env.sh's stand-in: it marks the install it would do, in the order file when a test names one.
    r = tool_repo(tmp_path, "gpu_ab.sh", {"k.py": "speed = 1\n", "same.txt": "unchanged\n",
                                          "tools/gpu_env.sh": '[ -z "${ORDER:-}" ] || echo install >> "$ORDER"\n'})
    (r / "k.py").write_text("speed = 2\n")
    (r / "new.py").write_text("added = True\n")
    git(r, "add", "-A")
    git(r, "commit", "-q", "-m", "branch")
    (tmp_path / "x.patch").write_text(git(r, "diff", "HEAD~1", "HEAD"))
    (r / ".gpu").mkdir()  # a bundle: not copied into the base
    (r / ".gpu" / "bundle.xz").write_bytes(b"\0" * 100)
    return r


def test_the_arms_alternate_each_on_its_own_tree(repo, tmp_path):
    order = tmp_path / "order"
    cmd = f'echo "$ARM $ROUND" >> {order}; cat k.py; ls new.py .gpu 2>&1; echo "cache $ROSEKERNELS_CACHE_DIR"'
    run = ab(repo, tmp_path, str(tmp_path / "x.patch"), "2", cmd)
    assert run.returncode == 0, run.stderr
    assert order.read_text().split("\n")[:-1] == ["base 1", "branch 1", "base 2", "branch 2"]
    for r in (1, 2):
        base = (tmp_path / "logs" / f"ab_base_{r}.log").read_text()
        branch = (tmp_path / "logs" / f"ab_branch_{r}.log").read_text()
        assert "speed = 1" in base and "speed = 2" not in base and "No such file" in base  # new.py, .gpu absent
        assert "speed = 2" in branch and "new.py" in branch and "No such file" not in branch
        assert "cache /tmp/ab_cache_base" in base and "cache /tmp/ab_cache_branch" in branch
    assert "== branch, round 2: exit 0" in run.stdout
    assert (repo / "k.py").read_text() == "speed = 2\n"  # the branch's tree is left as it was


def test_a_failing_run_fails_the_call_and_the_others_still_run(repo, tmp_path):
    run = ab(repo, tmp_path, str(tmp_path / "x.patch"), "1", '[ "$ARM" = branch ]')
    assert run.returncode == 1
    assert "== base, round 1: exit 1" in run.stdout and "== branch, round 1: exit 0" in run.stdout


def test_the_warm_up_runs_both_arms_side_by_side_before_the_rounds_and_is_not_counted(repo, tmp_path):
    order = tmp_path / "order"
    # Each warm-up run waits for the other's mark: they only both finish if they run at the same time.
    cmd = (f'echo "$ARM $ROUND" >> {order}; if [ "$ROUND" = 0 ]; then touch {tmp_path}/w_$ARM; '
           f'other=base; [ "$ARM" = base ] && other=branch; '
           f'for i in $(seq 100); do [ -e {tmp_path}/w_$other ] && break; sleep 0.05; done; '
           f'[ -e {tmp_path}/w_$other ] || echo alone; exit 3; fi')
    run = ab(repo, tmp_path, str(tmp_path / "x.patch"), "1", cmd, AB_WARM="20", ORDER=str(order))
    assert run.returncode == 0, run.stdout + run.stderr  # the warm-up's exit 3 is not counted, but reported
    assert "== base, warm-up: exit 3" in run.stdout and "== branch, warm-up: exit 3" in run.stdout
    lines = order.read_text().split("\n")[:-1]
    # the bundles installed once, before both warm-ups
    assert lines[0] == "install" and sorted(lines[1:3]) == ["base 0", "branch 0"] and lines[3:] == ["base 1", "branch 1"]
    for arm in ("base", "branch"):
        assert "alone" not in (tmp_path / "logs" / f"ab_{arm}_warm.log").read_text()


@pytest.mark.parametrize("warm", ["exec sleep 30", "trap '' TERM; sleep 30 & wait"],
                         ids=["direct", "ignores-TERM"])
def test_a_warm_up_past_its_seconds_is_stopped(repo, tmp_path, warm):
    started = time.monotonic()
    run = ab(repo, tmp_path, str(tmp_path / "x.patch"), "1", f'if [ "$ROUND" = 0 ]; then {warm}; fi; true',
             AB_WARM="1")
    assert run.returncode == 0 and "== branch, round 1: exit 0" in run.stdout
    assert "warm-up: exit" in run.stdout and "stopped at 1 s" in run.stdout
    assert time.monotonic() - started < 25  # not the 30 s the warm-up asked for


@pytest.mark.parametrize("warm", ["0", "x", "-5"])
def test_a_bad_warm_up_runs_nothing(repo, tmp_path, warm):
    run = ab(repo, tmp_path, str(tmp_path / "x.patch"), "1", "true", AB_WARM=warm)
    assert run.returncode == 2 and "usage" in run.stderr and not (tmp_path / "base").exists()


@pytest.mark.parametrize("args", [("missing.patch", "1", "true"), ("x.patch", "0", "true"), ("x.patch", "two", "true"),
                                  ("x.patch", "1")])
def test_bad_arguments_run_nothing(repo, tmp_path, args):
    args = (str(tmp_path / args[0]), *args[1:])
    run = ab(repo, tmp_path, *args)
    assert run.returncode == 2 and "usage" in run.stderr
    assert not (tmp_path / "base").exists() and not (tmp_path / "logs").exists()


def test_a_patch_that_does_not_reverse_runs_nothing(repo, tmp_path):
    (repo / "k.py").write_text("speed = 3\n")  # the tree is not the patch's branch
    run = ab(repo, tmp_path, str(tmp_path / "x.patch"), "1", f"touch {tmp_path / 'ran'}")
    assert run.returncode == 2 and "does not reverse" in run.stderr
    assert not (tmp_path / "ran").exists() and not (tmp_path / "base").exists()
