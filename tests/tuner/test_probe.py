"""sip_tune.probe on the CPU: the sanitizer verdicts it reads from compute-sanitizer's output, and the
process group it kills on a timeout (a stand-in `compute-sanitizer` on PATH plays the tool)."""
import os
import stat
import tempfile
import time

import pytest

from sip_tune import probe

FAKE = """#!/bin/bash
# compute-sanitizer stand-in: --tool T ... ; FAKE_SANITIZER says how the run goes.
tool=$2
case "$FAKE_SANITIZER" in
  clean)
    echo "probe: launches done (5)"
    if [ "$tool" = racecheck ]; then echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
    else echo "========= ERROR SUMMARY: 0 errors"; fi ;;
  race)
    echo "probe: launches done (5)"
    if [ "$tool" = racecheck ]; then echo "========= Error: Race reported between Write access and Read access"
      echo "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"; exit 99
    else echo "========= ERROR SUMMARY: 0 errors"; fi ;;
  crash)
    echo "========= Program hit cudaErrorIllegalAddress"; echo "========= ERROR SUMMARY: 1 error"; exit 99 ;;
  hang)
    sleep 300 >/dev/null 2>&1 & echo $! > "$FAKE_PIDFILE"; wait ;;
esac
"""


def factory():
    """Stands for a workload factory: pickled into the payload, never called by the stand-in."""


@pytest.fixture
def fake_sanitizer(tmp_path, monkeypatch):
    tool = tmp_path / "compute-sanitizer"
    tool.write_text(FAKE)
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_clean_only_when_the_tool_says_so_for_every_tool(fake_sanitizer, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(fake_sanitizer))  # where the payloads go
    monkeypatch.setenv("FAKE_SANITIZER", "clean")
    assert probe.sanitizer_problem() is None
    assert probe.sanitize(factory, b"cubin") == dict.fromkeys(probe.SANITIZER_TOOLS, "clean")
    monkeypatch.setenv("FAKE_SANITIZER", "race")
    verdicts = probe.sanitize(factory, b"cubin")
    assert verdicts["memcheck"] == verdicts["synccheck"] == "clean"
    assert verdicts["racecheck"].startswith("exit 99") and "Race reported" in verdicts["racecheck"]
    monkeypatch.setenv("FAKE_SANITIZER", "crash")  # the probe never got to its last line
    assert all(v.startswith("exit 99") and "IllegalAddress" in v for v in probe.sanitize(factory, b"c").values())
    assert not list(fake_sanitizer.glob("sip-probe-*"))  # each run's payload is removed


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc")
def test_a_timeout_kills_the_tool_and_what_runs_under_it(fake_sanitizer, monkeypatch, request):
    pidfile = fake_sanitizer / "pid"
    request.addfinalizer(lambda: _kill(pidfile))
    monkeypatch.setenv("FAKE_SANITIZER", "hang")
    monkeypatch.setenv("FAKE_PIDFILE", str(pidfile))
    t0 = time.monotonic()
    verdicts = probe.sanitize(factory, b"cubin", tools=("memcheck",), timeout_s=1.0)
    assert time.monotonic() - t0 < 30
    assert verdicts["memcheck"].startswith("exit -1") and "timed out after 1 s" in verdicts["memcheck"]
    child = int(pidfile.read_text())
    for _ in range(50):  # killed: gone, or a zombie nobody has reaped yet
        if _state(child) in (None, "Z"):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the tool's child process {child} survived the timeout")


def _kill(pidfile):
    try:
        os.kill(int(pidfile.read_text()), 9)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pass


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_without_the_tool_every_verdict_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert probe.sanitize(factory, b"cubin") == dict.fromkeys(probe.SANITIZER_TOOLS, "compute-sanitizer not found on PATH")
    with pytest.raises(probe.ProbeError, match="ncu"):
        probe.profile(factory, b"cubin")


def test_the_probe_process_imports_what_this_process_can(tmp_path, monkeypatch):
    """The probe's own command (what the tools wrap) takes this process's sys.path: a factory from a
    module only this process's runtime path reaches unpickles there and runs (here it raises before
    any GPU work)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "probe_factory_mod.py").write_text(
        "def factory():\n    raise RuntimeError('the probe process unpickled and called the factory')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    import probe_factory_mod

    with probe._payload(probe_factory_mod.factory, None, samples=0, skip=0) as payload:
        out, code = probe.run_isolated(probe._probe(payload), 120)
    assert code != 0 and "the probe process unpickled and called the factory" in out, out[-2000:]
    assert not list(tmp_path.glob("sip-probe-*"))
