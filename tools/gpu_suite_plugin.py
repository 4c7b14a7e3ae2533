"""pytest plugin of tools/gpu_suite.py (loaded with `-p gpu_suite_plugin`, tools/ on PYTHONPATH).

GPU_SUITE_COLLECT=FILE (with --collect-only): write the collected tests to FILE as JSON,
    [{"nodeid": ..., "gpu": bool, "slow": bool}]: whether each carries the `gpu` and `slow` marks.
GPU_SUITE_SPECS=FILE (with --collect-only): write the kernel configs the collected tests take as parameters
    (dataclasses with .variant(), in tuples and lists too) to FILE as JSON, [Variant.as_dict(), ...] by key:
    what tools/gpu_precache.py compiles ahead of a suite call.
GPU_SUITE_SELECT=FILE: run only the tests whose node ids FILE lists (JSON), of the paths given: node ids
    on the command line would be parsed again, and parameter ids can hold anything.
GPU_SUITE_LOG=FILE: append one JSON line per test as it starts ({"event": "start", "nodeid"}) and as
    it finishes ({"event": "result", "nodeid", "outcome", "duration", "message"}), flushed at once, so
    that a process killed at its deadline or by a crash has recorded every test it finished.
    outcome is pytest's word: passed, failed, skipped, error (setup or teardown failed), xfailed,
    xpassed; duration the seconds of setup, call and teardown together. Before a test's result, the
    kernel variants its process asked rosekernels.jit.compile_variant for since the last record
    ({"event": "loaded", "variants": {key: as_dict}}; the plugin wraps that function once the package is
    imported): the suite keeps them in its state for gpu_precache.py, which compiles them on the CPU host
    for the next call.
    With GPU_SUITE_LOG set (a piece of the suite), SIGTERM (the suite's deadline) raises
    KeyboardInterrupt: the test's cleanup then runs (sip_tune.probe.run_isolated kills the tool it
    started, the tuner's Runner its worker) instead of the process ending at once.
"""
import dataclasses
import json
import os
import signal
import sys

import pytest

_COLLECT = os.environ.get("GPU_SUITE_COLLECT")
_SPECS = os.environ.get("GPU_SUITE_SPECS")
_SELECT = os.environ.get("GPU_SUITE_SELECT")
_LOG = os.environ.get("GPU_SUITE_LOG")
_phases: dict[str, list] = {}
_asked: dict[str, dict] = {}  # variants compile_variant was asked for since the last "loaded" record
_recorded: set[str] = set()  # variant keys already recorded by this process


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


def _configs(value):
    """The kernel configs (dataclass instances with a variant() method) in a test parameter."""
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _configs(v)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type) and callable(getattr(value, "variant", None)):
        yield value


def pytest_collection_finish(session):
    if _COLLECT:
        with open(_COLLECT, "w") as f:
            json.dump([{"nodeid": item.nodeid, "gpu": item.get_closest_marker("gpu") is not None,
                        "slow": item.get_closest_marker("slow") is not None} for item in session.items], f)
    if _SPECS:
        variants = {}
        for item in session.items:
            for value in getattr(getattr(item, "callspec", None), "params", {}).values():
                for cfg in _configs(value):
                    variant = cfg.variant()
                    variants[variant.key()] = variant.as_dict()
        with open(_SPECS, "w") as f:
            json.dump([variants[k] for k in sorted(variants)], f)


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


def _watch_compiles() -> None:
    """Wrap rosekernels.jit.compile_variant (every kernel module calls it through the module) so that each
    variant asked for is noted, cached or not; the loaded list itself would lose those a test or a fixture
    drops (jit.forget_loaded) before its result."""
    jit = sys.modules.get("rosekernels.jit")
    if jit is None or getattr(jit.compile_variant, "gpu_suite_watch", False):
        return
    original = jit.compile_variant

    def compile_variant(variant, build):
        if variant.key() not in _recorded:
            _asked[variant.key()] = variant.as_dict()
        return original(variant, build)

    compile_variant.gpu_suite_watch = True
    jit.compile_variant = compile_variant


@pytest.hookimpl(tryfirst=True)  # before the fixtures, which may compile
def pytest_runtest_setup(item):
    if _LOG:
        _watch_compiles()


def pytest_runtest_logfinish(nodeid, location):
    if _LOG:
        if _asked:
            _append({"event": "loaded", "variants": dict(sorted(_asked.items()))})
            _recorded.update(_asked)
            _asked.clear()
        reports = _phases.pop(nodeid, [])
        outcome, message = _outcome(reports)
        _append({"event": "result", "nodeid": nodeid, "outcome": outcome, "message": message,
                 "duration": round(sum(r.duration for r in reports), 3)})
