"""tools/gpu_suite.py without a GPU: how it cuts tests into pieces and schedules them, what it records of a
piece that finished, crashed or ran out of time, the report, and whole calls on a fake project whose
tests pass, fail, skip, crash their process and outlive the deadline (the second call resumes)."""
import importlib.util
import gzip
import io
import json
import math
import os
import re
import signal
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from grid import sample

from rosekernels.variant import Variant

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_suite", TOOLS / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


suite = _load()


def test_pieces_keep_to_one_file_are_even_and_put_the_timing_files_then_the_slow_tests_first():
    tests = [f"tests/a.py::t[{i}]" for i in range(10)] + ["tests/b.py::t", "tests/c.py::slow1", "tests/c.py::slow2"] \
        + [f"tests/tuner/test_sip_gpu.py::t{i}" for i in range(3)]
    pieces = suite.plan_pieces(tests, 4, single=frozenset({"tests/c.py::slow1", "tests/c.py::slow2"}))
    assert [(p.file, len(p.tests), p.alone) for p in pieces] == [
        ("tests/tuner/test_sip_gpu.py", 3, True), ("tests/c.py", 1, False), ("tests/c.py", 1, False),
        ("tests/a.py", 4, False), ("tests/a.py", 3, False), ("tests/a.py", 3, False), ("tests/b.py", 1, False)]
    assert sorted(t for p in pieces for t in p.tests) == sorted(tests)
    first = suite.plan_pieces(tests, 4, single=frozenset({"tests/c.py::slow1", "tests/c.py::slow2"}),
                              first=("tests/b.py", "tests/a"))
    assert [(p.file, len(p.tests)) for p in first] == [  # in the order given, then as without it
        ("tests/b.py", 1), ("tests/a.py", 4), ("tests/a.py", 3), ("tests/a.py", 3), ("tests/tuner/test_sip_gpu.py", 3),
        ("tests/c.py", 1), ("tests/c.py", 1)]


class FakeProcess:
    def __init__(self, piece, clock, seconds, records_every=1.0):
        self.clock, self.end, self.started, self.every = clock, clock.now + seconds, clock.now, records_every
        self.stalled = None

    def poll(self):
        return 0 if self.clock.now >= self.end else None

    def idle(self):  # a record every `every` seconds
        return (self.clock.now - self.started) % self.every if self.every < math.inf else self.clock.now - self.started

    def terminate(self):
        pass

    def reap(self):
        pass


class Clock:
    """Time that moves only while the scheduler sleeps, a second per tick."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += 1.0


def test_schedule_runs_jobs_side_by_side_the_alone_pieces_by_themselves_and_stops_at_the_deadline(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(suite.time, "sleep", clock.sleep)
    pieces = [suite.Piece("alone.py", ["x"], True)] + [suite.Piece(f"f{i}.py", [f"t{i}"]) for i in range(6)]
    started, finished, beside_alone = [], [], []
    running = set()

    def launch(piece):
        if piece.alone:
            beside_alone.append(set(running))
        running.add(piece.file)
        started.append((piece.file, clock.now))
        return FakeProcess(piece, clock, 10)

    def finish(piece, process, killed):
        running.discard(piece.file)
        finished.append((piece.file, killed))
        return [suite.Piece("f0.py", ["again"], retried=True)] if piece.file == "f0.py" else []

    suite.schedule(pieces, 3, 25.0, launch, finish, min_start=5, clock=clock)
    # The alone piece by itself, then three at a time; f0's leftover test queued again as a piece of its
    # file; at t = 20, 5 s left: f3-f5 start and are killed at the deadline; the leftover never starts.
    assert beside_alone == [set()]
    assert started == [("alone.py", 0), ("f0.py", 10), ("f1.py", 10), ("f2.py", 10), ("f3.py", 20), ("f4.py", 20),
                       ("f5.py", 20)]
    assert finished[:4] == [("alone.py", False), ("f0.py", False), ("f1.py", False), ("f2.py", False)]
    assert sorted(finished[4:]) == [("f3.py", True), ("f4.py", True), ("f5.py", True)]


def test_a_piece_without_a_record_for_the_stall_limit_is_stopped_and_the_rest_run_again(monkeypatch):
    """A hung test (no record for `stall` s) is stopped as a crash: its test an error, the rest queued again,
    and the piece waiting to run alone starts then, not at the deadline; a slow test's piece, which records
    nothing for minutes, runs to its end."""
    clock = Clock()
    monkeypatch.setattr(suite.time, "sleep", clock.sleep)
    hung = suite.Piece("moe.py", ["moe.py::t0", "moe.py::hang", "moe.py::t2"])
    slow = suite.Piece("hf.py", ["hf.py::model"], slow=True)
    alone = suite.Piece("tuner.py", ["tuner.py::t"], True)
    started, stopped = [], []

    def launch(piece):
        started.append((piece.file, piece.retried, clock.now))
        if piece.file == "moe.py" and not piece.retried:
            return FakeProcess(piece, clock, 1000, records_every=math.inf)
        return FakeProcess(piece, clock, 60 if piece.slow else 5, records_every=math.inf if piece.slow else 1.0)

    def finish(piece, process, killed):
        stopped.append((piece.file, process.stalled, killed))
        return [suite.Piece("moe.py", ["moe.py::t2"], retried=True)] if process.stalled else []

    suite.schedule([hung, slow, alone], 2, 500.0, launch, finish, min_start=5, clock=clock, stall=30)
    assert ("moe.py", 30, False) in stopped and ("hf.py", None, False) in stopped
    assert started[:2] == [("moe.py", False, 0), ("hf.py", False, 0)]
    moe_again = next(t for f, retried, t in started if f == "moe.py" and retried)
    tuner = next(t for f, _, t in started if f == "tuner.py")
    # stopped at 31: its rest is queued behind the alone piece, which starts once the slow one ends (60),
    # not at the deadline (500)
    assert 60 <= tuner <= 62 and tuner < moe_again <= 70
    state = {"results": {}}
    records = [{"event": "start", "nodeid": "moe.py::t0"},
               {"event": "result", "nodeid": "moe.py::t0", "outcome": "passed", "duration": 1.0, "message": ""},
               {"event": "start", "nodeid": "moe.py::hang"}]
    assert suite.merge(state, hung, records, -15, killed=False, stalled=30) == ["moe.py::t2"]
    assert state["results"]["moe.py::hang"]["outcome"] == "error"
    assert "stopped after 30 s without a result" in state["results"]["moe.py::hang"]["message"]


def test_merge_records_results_and_tells_a_crash_from_a_deadline():
    piece = suite.Piece("a.py", ["a.py::t1", "a.py::t2", "a.py::t3", "a.py::t4"])
    records = [{"event": "start", "nodeid": "a.py::t1"},
               {"event": "result", "nodeid": "a.py::t1", "outcome": "passed", "duration": 1.5, "message": ""},
               {"event": "start", "nodeid": "a.py::t2"}]
    state = {"results": {}}
    assert suite.merge(state, piece, records, -9, killed=True) == []
    assert list(state["results"]) == ["a.py::t1"] and state["cut"] == {"a.py::t2": 1}  # t2: pending still
    suite.merge(state, piece, records[2:], -9, killed=True)  # cut short again: a hang
    assert state["results"]["a.py::t2"]["outcome"] == "error" and "two calls" in state["results"]["a.py::t2"]["message"]
    state = {"results": {}}
    rest = suite.merge(state, piece, records, -11, killed=False)
    assert rest == ["a.py::t3", "a.py::t4"]
    assert state["results"]["a.py::t2"]["outcome"] == "error" and "code -11" in state["results"]["a.py::t2"]["message"]
    state = {"results": {}}
    assert suite.merge(state, piece, [], 2, killed=False, output_tail="ImportError: no module x") == []
    assert all(r["outcome"] == "error" and "no module x" in r["message"] for r in state["results"].values())
    assert len(state["results"]) == 4
    state = {"results": {}}  # pytest ended on its own before t3 and t4: they were not collected
    assert suite.merge(state, piece, records[:2], 0, killed=False) == []
    assert [state["results"][t]["outcome"] for t in piece.tests] == ["passed", "error", "error", "error"]


def test_a_test_out_of_gpu_memory_beside_other_pieces_runs_again_alone_where_its_result_stands():
    """The fourth session's suite on an 80 GB H100: the 30B MoE model's test ran out of memory beside five
    other pieces, and passed alone."""
    oom = {"event": "result", "nodeid": "hf.py::big", "outcome": "error", "duration": 1.0,
           "message": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.16 GiB"}
    records = [{"event": "start", "nodeid": "hf.py::big"}, oom, {"event": "start", "nodeid": "hf.py::t1"},
               {"event": "result", "nodeid": "hf.py::t1", "outcome": "failed", "duration": 1.0, "message": "wrong"}]
    state = {"results": {}}
    beside = suite.Piece("hf.py", ["hf.py::big", "hf.py::t1", "hf.py::t2"])
    assert suite.merge(state, beside, records, -11, killed=False) == ["hf.py::t2", "hf.py::big"]
    assert list(state["results"]) == ["hf.py::t1"] and state["alone"] == ["hf.py::big"]  # the other failure stands
    state = {"results": {}}
    assert suite.merge(state, beside, records, 1, killed=False) == ["hf.py::big"]  # pytest ended: t2 an error
    assert state["results"]["hf.py::t2"]["outcome"] == "error" and "hf.py::big" not in state["results"]
    assert suite.merge(state, beside, records[:2], -9, killed=True) == ["hf.py::big"]  # pending for the next call
    alone = suite.Piece("hf.py", ["hf.py::big"], True)
    assert suite.merge(state, alone, records[:2], 1, killed=False) == []
    assert state["results"]["hf.py::big"]["outcome"] == "error"  # alone, out of memory is its result


def test_the_suite_runs_a_test_out_of_memory_again_alone_in_the_same_call(project, tmp_path):
    (project / "tests" / "test_mem.py").write_text(textwrap.dedent(f"""\
        import os, pytest

        @pytest.mark.gpu
        def test_big():
            marker = {str(tmp_path / "ran")!r}
            if not os.path.exists(marker):  # the first run: as if the pieces beside it held the memory
                open(marker, "w").close()
                raise RuntimeError("CUDA error: out of memory")
        """))
    out = tmp_path / "out"
    assert _call(project, out, "--budget", "120") == 1  # red: test_fail
    s = json.loads((out / "gpu_suite.json").read_text())
    assert s["files"]["tests/test_mem.py"]["passed"] == 1 and s["total"]["pending"] == 0
    with gzip.open(out / "gpu_suite_state.json.gz") as f:
        assert json.load(f)["alone"] == ["tests/test_mem.py::test_big"]


def test_a_piece_whose_process_crashes_before_finishing_a_test_is_retried_once_not_once_per_test(monkeypatch):
    """A module fixture that kills its process: the first crash leaves the rest to a retry; a retry
    that dies before finishing a test too makes the rest errors, instead of one start per test."""
    piece = suite.Piece("a.py", [f"a.py::t{i}" for i in range(6)])
    state = {"results": {}}
    rest = suite.merge(state, piece, [{"event": "start", "nodeid": "a.py::t0"}], -11, killed=False)
    assert rest == piece.tests[1:]
    clock = Clock()
    monkeypatch.setattr(suite.time, "sleep", clock.sleep)
    launched = []

    def launch(p):
        launched.append(p)
        return FakeProcess(p, clock, 1)

    def finish(p, process, killed):  # every process dies in its first test
        rest = suite.merge(state, p, [{"event": "start", "nodeid": p.tests[0]}], -11, killed)
        return [suite.Piece(p.file, rest, retried=True)] if rest else []

    suite.schedule([piece], 1, 100.0, launch, finish, min_start=1, clock=clock)
    assert [(len(p.tests), p.retried) for p in launched] == [(6, False), (5, True)]  # two starts, not six
    assert [state["results"][t]["outcome"] for t in piece.tests] == ["error"] * 6
    assert "as the process before it did" in state["results"]["a.py::t5"]["message"]
    # A retry that finishes tests before it dies leaves the rest to another retry.
    state = {"results": {}}
    records = [{"event": "start", "nodeid": "a.py::t1"},
               {"event": "result", "nodeid": "a.py::t1", "outcome": "passed", "duration": 1.0, "message": ""},
               {"event": "start", "nodeid": "a.py::t2"}]
    again = suite.Piece("a.py", piece.tests[1:], retried=True)
    assert suite.merge(state, again, records, -11, killed=False) == piece.tests[3:]


def test_every_gpu_test_file_that_asserts_on_timings_runs_alone():
    """A test asserting a timing ratio (A/A, speedup, re-timed rel) or a wall-time bound measures the
    GPU it shares: beside other pieces it fails for their load, not its own code."""
    root = Path(__file__).resolve().parents[1]
    timing = re.compile(r"assert .*(\.rel\b|\[.rel.\]|aa_spread|speedup|monotonic\(\) - )")
    found = {str(f.relative_to(root)) for f in (root / "tests").rglob("test_*.py")
             if f != Path(__file__).resolve() and "mark.gpu" in (text := f.read_text()) and timing.search(text)}
    assert {"tests/tuner/test_oplevel.py", "tests/tuner/test_compute_gpu.py"} <= found  # the pattern sees them
    assert found <= set(suite.ALONE), sorted(found - set(suite.ALONE))


def test_summary_counts_per_file_and_says_why_two_gpu_tests_did_not_run(tmp_path):
    call = {"started": "2026-12-04 10:00", "gpus": 1, "gpu_name": "H200", "jobs": 6, "wall_s": 100.0, "finished": 3}
    state = {"commit": "abc", "digest": "d1", "mode": "full", "calls": [call],
             "plan": {"tests": ["a.py::x", "a.py::y", "b.py::z", "b.py::w"], "gpu_tests": ["a.py::x", "a.py::y"],
                      "two_gpu": {"tests": ["m.py::two"], "visible_gpus": 1, "note": "not run: 1 GPU(s) visible"}},
             "results": {"a.py::x": {"outcome": "passed", "duration": 2.0, "message": ""},
                         "a.py::y": {"outcome": "skipped", "duration": 0.1, "message": "no nvdisasm"},
                         "b.py::z": {"outcome": "failed", "duration": 3.0, "message": "assert 1 == 2"}}}
    s = suite.write_report(state, tmp_path)
    assert s["status"] == "partial" and s["total"]["pending"] == 1 and s["gpu_tests"] == {"collected": 2, "run": 1}
    assert s["files"]["a.py"]["passed"] == 1
    assert s["files"]["b.py"]["failed"] == 1 and s["files"]["b.py"]["pending"] == 1
    md = (tmp_path / "gpu_suite.md").read_text()
    assert "Commit `abc`" in md and "not run: 1 GPU(s) visible" in md and "`b.py::z`: failed: assert 1 == 2" in md
    assert "1 x no nvdisasm" in md
    assert json.loads((tmp_path / "gpu_suite.json").read_text())["status"] == "partial"
    state["results"]["b.py::w"] = {"outcome": "passed", "duration": 1.0, "message": ""}
    assert suite.summarize(state)["status"] == "red"
    state["results"]["b.py::z"]["outcome"] = "passed"
    assert suite.summarize(state)["status"] == "green"


FAKE_TESTS = '''
import os, time
import pytest
from grid import sample

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(5))
def test_pass(i):
    pass

@pytest.mark.gpu
@pytest.mark.parametrize("s", ["a b", "x::y", "[z]"])
def test_odd_ids(s):
    pass

@pytest.mark.gpu
def test_fail():
    assert 1 == 2, "wrong on purpose"

@pytest.mark.gpu
def test_skip():
    pytest.skip("needs something else")

@pytest.mark.gpu
def test_crash():
    if os.environ.get("FAKE_CRASH"):
        os._exit(7)

@pytest.mark.gpu
@pytest.mark.slow
def test_slow():
    if os.environ.get("FAKE_SLOW"):
        time.sleep(60)

@pytest.mark.grid
@pytest.mark.parametrize("n", sample(list(range(6)), [lambda n: n % 2], key=str))
def test_grid(n):
    pass

def test_cpu_only_not_selected():
    pass
'''


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "project"
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text(textwrap.dedent("""\
        [pytest]
        markers =
            gpu: gpu
            grid: grid
            slow: slow
        pythonpath = support
        """))
    (root / "support").mkdir()
    (root / "support" / "grid.py").write_text((Path(__file__).parent / "support" / "grid.py").read_text())
    (root / "tests" / "test_fake.py").write_text(FAKE_TESTS)
    (root / "tests" / "test_two.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_two_ranks():\n    pass\n")
    return root


def _call(project, out, *extra):
    return suite.main(["run", "--root", str(project), "--out", str(out), "--gpus", "1", "--commit", "c0ffee",
                       "--jobs", "2", "--piece", "3", "--min-start", "1", "--two-gpu-files", "tests/test_two.py",
                       *extra])


def test_a_call_cut_by_its_deadline_resumes_and_the_report_counts_everything(project, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("FAKE_SLOW", "1")
    monkeypatch.setenv("FAKE_CRASH", "1")
    assert _call(project, out, "--budget", "12") == 4  # partial: test_slow outlives the deadline
    first = json.loads((out / "gpu_suite.json").read_text())
    assert first["status"] == "partial" and first["total"]["pending"] >= 1
    assert "test_fake.py::test_slow" not in json.dumps(first["not_passed"])
    # A fresh host: the returned state carried back in; the tree's own state is gone.
    carried = tmp_path / "carried.json.gz"
    carried.write_bytes((out / "gpu_suite_state.json.gz").read_bytes())
    (project / ".gpu_suite" / suite.STATE_FILE).unlink()
    monkeypatch.delenv("FAKE_SLOW")
    assert _call(project, out, "--budget", "120", "--resume", str(carried)) == 1  # done, red: a failure
    s = json.loads((out / "gpu_suite.json").read_text())
    assert s["commit"] == "c0ffee" and len(s["calls"]) == 2 and s["status"] == "red"
    # 5 + 3 odd ids + fail + skip + crash + slow + the whole grid of 6
    assert s["total"] == {"tests": 18, "passed": 15, "failed": 1, "skipped": 1, "error": 1, "xfailed": 0, "xpassed": 0,
                          "pending": 0}
    assert s["gpu_tests"] == {"collected": 12, "run": 11}
    assert s["not_passed"]["tests/test_fake.py::test_crash"]["outcome"] == "error"
    assert "exited with code 7" in s["not_passed"]["tests/test_fake.py::test_crash"]["message"]
    assert "wrong on purpose" in s["not_passed"]["tests/test_fake.py::test_fail"]["message"]
    assert s["two_gpu"]["note"].startswith("not run: 1 GPU(s) visible") and "tests/test_two.py" in s["two_gpu"]["note"]
    assert "test_two" not in json.dumps(s["files"])
    assert _call(project, out, "--budget", "60") == 1  # complete: nothing runs, no call added
    assert len(json.loads((out / "gpu_suite.json").read_text())["calls"]) == 2
    # The tree changed: its state is not resumed.
    (project / "tests" / "test_fake.py").write_text(FAKE_TESTS + "\n")
    assert _call(project, out, "--budget", "60") == 2


def test_sample_takes_the_grids_ci_sample_and_two_gpus_bring_the_two_gpu_tests(project, tmp_path):
    out = tmp_path / "out"
    argv = ["run", "--root", str(project), "--out", str(out), "--gpus", "2", "--commit", "c", "--jobs", "3",
            "--min-start", "1", "--budget", "120", "--two-gpu-files", "tests/test_two.py", "--sample"]
    assert suite.main(argv) == 1  # red: test_fail
    s = json.loads((out / "gpu_suite.json").read_text())
    assert s["mode"] == "sample" and s["files"]["tests/test_fake.py"]["tests"] == 12 + 2  # one per family of two
    assert s["files"]["tests/test_two.py"]["passed"] == 1 and s["two_gpu"]["note"].startswith("in the plan")


def test_grid_sample_covers_every_family_of_every_cut_with_few_cases():
    cases = [(kind, dtype, tile) for kind in "abc" for dtype in ("bf16", "fp16") for tile in (8, 16, 32, 64)]
    by_kind_dtype, by_tile = (lambda c: c[:2]), (lambda c: c[2])
    key = lambda c: "-".join(map(str, c))
    picked = sample(cases, [by_kind_dtype], key, full=False)
    assert sorted(c[:2] for c in picked) == sorted({c[:2] for c in cases})  # one of each
    assert len({c[2] for c in picked}) > 1  # not always the first of each family
    both = sample(cases, [by_kind_dtype, by_tile], key, full=False)
    assert {c[:2] for c in both} == {c[:2] for c in cases} and {c[2] for c in both} == {8, 16, 32, 64}
    assert len(both) == 6  # the six kind/dtype families already hold the four tiles
    assert both == sample(list(reversed(cases)), [by_kind_dtype, by_tile], key, full=False)[::-1]  # order-free
    assert sample(cases, [by_tile], key, full=True) == cases


LEFT_BEHIND = '''
import os, subprocess, sys, time
import pytest

@pytest.mark.gpu
def test_starts_a_tool_in_its_own_session_and_hangs():
    """As sip_tune.probe.run_isolated starts compute-sanitizer or ncu; this test never stops it."""
    tool = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    with open(os.environ["FAKE_PIDS"], "a") as f:
        f.write(f"{tool.pid}\\n")
    time.sleep(300)
'''

CLEANS_UP = '''
import os, time
import pytest

@pytest.mark.gpu
def test_cleans_up_when_interrupted():
    try:
        time.sleep(300)
    finally:  # runs on KeyboardInterrupt, not when SIGTERM ends the process outright
        open(os.environ["FAKE_CLEANED"], "w").write("cleaned up")
'''


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def test_the_deadline_ends_every_process_of_a_piece_and_lets_tests_clean_up(project, tmp_path, monkeypatch):
    """Killed at the deadline, a piece's tests get a KeyboardInterrupt (their cleanup runs), and a
    process it started in a session of its own, which a signal to its process group misses, is ended
    too: left running, it would share the GPU with the timing tests after it."""
    for f in (project / "tests").iterdir():
        f.unlink()
    (project / "tests" / "test_left_behind.py").write_text(LEFT_BEHIND)
    (project / "tests" / "test_cleans_up.py").write_text(CLEANS_UP)
    pids, cleaned = tmp_path / "pids", tmp_path / "cleaned"
    monkeypatch.setenv("FAKE_PIDS", str(pids))
    monkeypatch.setenv("FAKE_CLEANED", str(cleaned))
    monkeypatch.setattr(suite, "GRACE_S", 2.0)
    try:
        assert _call(project, tmp_path / "out", "--budget", "15") == 4  # partial: both cut short
        started = [int(p) for p in pids.read_text().split()]
        assert len(started) == 1 and not _running(started[0])
        assert cleaned.read_text() == "cleaned up"
    finally:  # whatever the outcome, leave nothing running
        for pid in (int(p) for p in pids.read_text().split()) if pids.exists() else ():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_descendants_follow_parent_links_across_sessions():
    table = {10: (1, "a"), 11: (10, "b"), 12: (11, "c"), 13: (1, "d"), 14: (12, "e")}
    assert suite.descendants({10}, table) == {11: "b", 12: "c", 14: "e"}
    assert suite.descendants({13}, table) == {} and suite.descendants({99}, table) == {}
    me = os.getpid()
    assert me in suite.processes() and suite.processes()[me][0] == os.getppid()


def test_the_compile_cache_travels_in_parts_and_fills_only_what_is_missing(tmp_path, monkeypatch):
    """--cache-out packs the call's objects into parts a runner brings back; --cache-in puts them into another
    host's cache, keeping what is there, taking nothing outside jit/; past CACHE_PARTS nothing is written."""
    cache = tmp_path / "cache"
    entries = {f"jit/tc/k{i}-{i:016x}.{ext}": os.urandom(3000 + i) for i in range(6) for ext in ("o", "json")}
    for name, data in entries.items():
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(data)
    monkeypatch.setattr(suite, "CACHE_PART_BYTES", 10_000)  # random bytes do not compress: several parts
    parts = suite.pack_cache(cache, tmp_path / "out")
    assert len(parts) > 1 and all(p.stat().st_size <= 10_000 for p in parts)
    other = tmp_path / "other"
    (other / "jit/tc").mkdir(parents=True)
    (other / "jit/tc/k0-0000000000000000.o").write_bytes(b"already here")
    assert suite.unpack_cache([str(p) for p in reversed(parts)], other) == len(entries) - 1
    assert (other / "jit/tc/k0-0000000000000000.o").read_bytes() == b"already here"
    for name, data in entries.items():
        if name != "jit/tc/k0-0000000000000000.o":
            assert (other / name).read_bytes() == data, name
    monkeypatch.setattr(suite, "CACHE_PARTS", 1)
    assert suite.pack_cache(cache, tmp_path / "out2") == [] and not (tmp_path / "out2").exists()
    assert suite.pack_cache(tmp_path / "empty", tmp_path / "out3") == []
    stray = tmp_path / "stray.tar.xz"  # members outside jit/ (or climbing out of it) are not extracted
    with tarfile.open(stray, "w:xz") as tar:
        for name in ("jit/../evil.o", "notjit/x.o"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    assert suite.unpack_cache([str(stray)], other) == 0 and not (other / "evil.o").exists()


# ---------------------------------------------------------------------------------------------
# tools/gpu_precache.py: what a CPU host compiles ahead of a suite call.

def _load_precache():
    spec = importlib.util.spec_from_file_location("gpu_precache", TOOLS / "gpu_precache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


precache = _load_precache()

KERNEL_TESTS = '''
import pytest
from rosekernels import jit
from rosekernels.kernels import qk_norm, qk_norm_plan

CONFIGS = qk_norm_plan.variants_for()


@pytest.fixture
def forgets():
    yield
    jit.forget_loaded()  # as some fixtures do: the loaded list is empty again before the result

@pytest.mark.gpu
@pytest.mark.parametrize("cfg, n", [(CONFIGS[0], 1), (CONFIGS[1], 2), (CONFIGS[0], 3)])
def test_takes_a_config(cfg, n):
    pass

@pytest.mark.gpu
@pytest.mark.parametrize("pair", [(CONFIGS[2], [CONFIGS[3]])])
def test_nested(pair):
    pass

@pytest.mark.gpu
def test_compiles_inside(forgets):
    qk_norm.compile(CONFIGS[4])

def test_cpu_only_not_selected():
    qk_norm.compile(CONFIGS[5])
'''


def test_the_precache_sees_the_configs_tests_take_and_the_suite_records_what_they_loaded(project, tmp_path):
    """Collection lists the kernel configs of the selected tests' parameters (nested ones too, each variant once);
    a suite call records in its state the variants its tests loaded, those built inside a test body included,
    even where a fixture drops the loaded kernels before the result, and each recorded variant rebuilds
    (Config.from_variant) into the config of the same key; one this source no longer builds is an error the
    precache catches."""
    from rosekernels.kernels import qk_norm_plan

    configs = qk_norm_plan.variants_for()
    (project / "tests" / "test_kernel.py").write_text(KERNEL_TESTS)
    seen = precache.param_variants(False, project)
    assert sorted(Variant.from_dict(d).key() for d in seen) == sorted(c.variant().key() for c in configs[:4])
    out = tmp_path / "out"
    assert suite.main(["run", "--root", str(project), "--out", str(out), "--gpus", "1", "--commit", "c",
                       "--jobs", "2", "--min-start", "1", "--budget", "300", "--select", "gpu and not slow",
                       "--two-gpu-files", "tests/test_two.py"]) == 1  # red: test_fake's failures
    assert json.loads((out / "gpu_suite.json").read_text())["files"]["tests/test_kernel.py"]["passed"] == 5
    loaded = precache.state_variants(str(out / "gpu_suite_state.json.gz"))
    assert [Variant.from_dict(d).key() for d in loaded] == [configs[4].variant().key()]
    compile_config, cfg = precache._job(loaded[0])
    assert cfg.variant() == configs[4].variant() and compile_config.__module__.endswith("qk_norm")
    renamed = {**loaded[0], "params": {**loaded[0]["params"], "a_field_of_an_older_commit": 1}}
    for stale in (renamed, {**loaded[0], "op": "a_kernel_since_removed"}):
        with pytest.raises((TypeError, ValueError, KeyError)):
            precache._job(stale)


def test_every_variant_the_precache_compiles_rebuilds_from_its_key():
    """A variant recorded on the GPU host comes back as a config only through Config.from_variant: for every
    variant the kernels list (and the hf models launch), it gives back the same variant."""
    import cubin_hashes
    from rosekernels.kernels import KERNELS

    jobs = cubin_hashes.every_spec(list(KERNELS), extras=True) + precache.hf_specs()  # MoE peer kernels too
    assert len(jobs) > 500
    for _, cfg in jobs:
        variant = cfg.variant()
        assert precache._job(json.loads(json.dumps(variant.as_dict())))[1].variant() == variant, variant.key()


def test_the_precache_packs_only_the_entries_asked_for_at_this_source_and_toolchain(tmp_path):
    from rosekernels import jit

    digest, tc = jit.package_digest(), jit.TOOLCHAIN
    names = {"a": (tc, digest), "b": (tc, digest), "old": (tc, "0" * 16), "other": ("cutedsl-0-cu12", digest)}
    for key, (toolchain, d) in names.items():
        folder = tmp_path / "cache" / "jit" / toolchain
        folder.mkdir(parents=True, exist_ok=True)
        for ext in ("o", "json"):
            (folder / f"{key}-{d}.{ext}").write_bytes(key.encode())
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "compile_cache.tar.xz.07").write_bytes(b"a stale part")
    packed, parts = precache.pack(tmp_path / "cache", {"a", "old", "other", "missing"}, tmp_path / "out")
    assert packed == 1 and [p.name for p in parts] == ["compile_cache.tar.xz.00"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["compile_cache.tar.xz.00"]
    assert suite.unpack_cache([str(p) for p in parts], tmp_path / "host") == 2
    assert sorted(p.name for p in (tmp_path / "host" / "jit" / tc).iterdir()) == [f"a-{digest}.json", f"a-{digest}.o"]
