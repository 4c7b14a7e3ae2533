"""pytest plugin of tools/gpu_suite.py (loaded with `-p gpu_suite_plugin`, tools/ on PYTHONPATH).

GPU_SUITE_COLLECT=FILE (with --collect-only): write the collected tests to FILE as JSON,
    [{"nodeid": ..., "gpu": bool, "slow": bool}]: whether each carries the `gpu` and `slow` marks.
GPU_SUITE_SELECT=FILE: run only the tests whose node ids FILE lists (JSON), of the paths given: node ids
    on the command line would be parsed again, and parameter ids can hold anything.
GPU_SUITE_LOG=FILE: append one JSON line per test as it starts ({"event": "start", "nodeid"}) and as
    it finishes ({"event": "result", "nodeid", "outcome", "duration", "message"}), flushed at once, so
    that a process killed at its deadline or by a crash has recorded every test it finished.
    outcome is pytest's word: passed, failed, skipped, error (setup or teardown failed), xfailed,
    xpassed; duration the seconds of setup, call and teardown together.
    With GPU_SUITE_LOG set (a piece of the suite), SIGTERM (the suite's deadline) raises
    KeyboardInterrupt: the test's cleanup then runs (sip_tune.probe.run_isolated kills the tool it
    started, the tuner's Runner its worker) instead of the process ending at once.
"""
import json
import os
import signal

_COLLECT = os.environ.get("GPU_SUITE_COLLECT")
_SELECT = os.environ.get("GPU_SUITE_SELECT")
_LOG = os.environ.get("GPU_SUITE_LOG")
_phases: dict[str, list] = {}


def _append(record: dict) -> None:
    with open(_LOG, "a") as f:
        f.write(json.dumps(record) + "\n")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}: the GPU suite's deadline")


def pytest_configure(config):
    if _LOG:
        signal.signal(signal.SIGTERM, _interrupt)


def pytest_collection_modifyitems(config, items):
    if _SELECT:
        with open(_SELECT) as f:
            wanted = set(json.load(f))
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in wanted])
        items[:] = [i for i in items if i.nodeid in wanted]


def pytest_collection_finish(session):
    if _COLLECT:
        with open(_COLLECT, "w") as f:
            json.dump([{"nodeid": item.nodeid, "gpu": item.get_closest_marker("gpu") is not None,
                        "slow": item.get_closest_marker("slow") is not None} for item in session.items], f)


def pytest_runtest_logstart(nodeid, location):
    if _LOG:
        _append({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report):
    if _LOG:
        _phases.setdefault(report.nodeid, []).append(report)


def _message(report) -> str:
    """What a non-passing phase says, in one short line or a few."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr or "")
    return text[-1000:]


def _outcome(reports) -> tuple[str, str]:
    for r in reports:
        if r.when != "call" and r.failed:
            return "error", _message(r)
    for r in reports:
        if r.when == "call" and hasattr(r, "wasxfail"):
            return ("xfailed", r.wasxfail) if r.skipped else ("xpassed", r.wasxfail)
        if r.failed:
            return "failed", _message(r)
        if r.skipped:
            return "skipped", _message(r)
    return "passed", ""


def pytest_runtest_logfinish(nodeid, location):
    if _LOG:
        reports = _phases.pop(nodeid, [])
        outcome, message = _outcome(reports)
        _append({"event": "result", "nodeid": nodeid, "outcome": outcome, "message": message,
                 "duration": round(sum(r.duration for r in reports), 3)})
