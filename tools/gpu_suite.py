#!/usr/bin/env python3
"""The whole GPU suite at one commit on the GPU host, in calls of at most ~9 minutes that each resume
where the last one stopped; writes gpu_suite.md and gpu_suite.json (the commit, per-file counts, wall
time). Run it through tools/gpu_suite.sh (which installs the carried CuTeDSL bundles first).

What runs: every `gpu` test, and every `grid` test whole (the parametrized grids CI samples,
ROSEKERNELS_TEST_GRID=full: compile-every-variant and the like). --sample runs the grids' CI sample
instead (a quick pass). The two-GPU files run only when two GPUs are visible; otherwise the report
says so and why.

How: the tests are collected once per run of the suite and cut into pieces of one file each; `--jobs`
pytest processes run pieces side by side on the one GPU, so that the compiles of many kernel variants
spread over the host's cores (the compile cache, .gpu_suite/cache, is shared and outlives the call);
files whose tests time kernels run alone. tools/gpu_suite_plugin.py appends each test's outcome to a
log as it finishes: a call that reaches its deadline stops its pieces (SIGTERM, which the plugin turns
into KeyboardInterrupt so that the tests stop the tools they started; then SIGKILL to every process
under the piece, in whatever session) and loses only the tests in flight, which the next call runs.
A test during which its process died is an error; the rest of its piece run in a new process, once:
if that one too dies before finishing a test (a crash in a module fixture), they are errors. A piece
that goes --test-timeout seconds (default 180) without a test starting or ending is stopped the same
way, its test in flight an error: a hang must not hold its job, nor a piece waiting to run alone, for
the rest of the call (the first call's MoE test did). Slow GPU tests (the hf models, the sanitizer) run
in pieces of their own, bounded only by the deadline. A test that runs out of GPU memory beside other
pieces runs again alone (an 80 GB card holds fewer of the hf models at once than a 141 GB one); alone,
its result stands.

State: .gpu_suite/state.json.gz in the tree (it stays while the host is warm), copied to --out as
gpu_suite_state.json.gz: on a fresh host, carry that file back in and pass it as --resume.

The compile cache: a fresh host compiles every variant again (minutes of each call). --cache-out writes
the call's compile objects to --out as compile_cache.tar.xz.NN parts (at most CACHE_PARTS of
CACHE_PART_BYTES: what a runner brings back); carried to the next host, --cache-in PART... puts them back
before the tests start (entries of other sources or toolchains are simply not found). tools/gpu_precache.py
builds such parts on the CPU host (same cubins); the state's "variants" (every kernel variant the tests
loaded, recorded by the plugin) tell it what the tests build in their bodies.

    tools/gpu_suite.sh --out "$OUT" [--resume FILE] [--sample] [--jobs N] [--budget SECONDS]
        exit status: 0 green, 1 red, 2 the state is of another tree, 4 partial (call again)
    python3 tools/gpu_suite.py report STATE --out bench/results/suite   # the report again, from a state
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent
STATE_DIR = ".gpu_suite"
STATE_FILE = "state.json.gz"
SELECT = "gpu or grid"
CACHE_PART_BYTES = 15 << 20
CACHE_PARTS = 4
GRID_ENV = "ROSEKERNELS_TEST_GRID"
# Tests of these files assert on kernel timings (A/A ratios, speedups, latency tables, wall-time bounds of
# emulated ranks waiting on each other): no other piece runs beside them on the GPU.
ALONE = ("tests/tuner/test_configs_gpu.py", "tests/tuner/test_sip_gpu.py", "tests/engine/test_sass_latency_tool.py",
         "tests/tuner/test_oplevel.py", "tests/tuner/test_compute_gpu.py", "tests/kernels/test_moe_parallel.py")
TWO_GPU = ("tests/kernels/test_moe_multigpu.py",)
TWO_GPU_BENCH = "torchrun --standalone --nproc-per-node 2 bench/moe_multigpu.py"
# What the tests depend on: a state is resumed only at the same digest of these.
SOURCES = ("pyproject.toml", "rosekernels", "sip", "sip_tune", "tests", "tools", "examples", "bench/*.py")
OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")
OUT_OF_MEMORY = ("out of memory", "outofmemoryerror")  # torch's and CUDA's words, lower case
GRACE_S = 10.0  # after the deadline's SIGTERM, what a piece has to unwind (its tools' cleanup) before SIGKILL
KILL_WAIT_S = 10.0  # how long reap() waits for SIGKILLed processes to be gone


# ---------------------------------------------------------------------------------------------
# Planning.

@dataclasses.dataclass
class Piece:
    """Tests of one file, run by one pytest process; `retried`: the tests a crashed process left."""
    file: str
    tests: list[str]
    alone: bool = False
    retried: bool = False
    slow: bool = False  # a slow GPU test's own piece: only the deadline bounds it, not --test-timeout


def file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def plan_pieces(tests: list[str], size: int, alone: tuple[str, ...] = ALONE, single: frozenset = frozenset(),
                first: tuple[str, ...] = ()) -> list[Piece]:
    """Each file's tests in pieces of at most `size` (as even as possible), in the given order; first
    the files that `first` names (path prefixes: what a short session must not miss), then the files that
    must run alone, then the tests of `single` (slow GPU tests: minutes each under the sanitizer) in a piece
    each, so that they start early and side by side."""
    pieces = [Piece(file_of(t), [t], file_of(t).startswith(alone), slow=True) for t in tests if t in single]
    by_file: dict[str, list[str]] = {}
    for t in tests:
        if t not in single:
            by_file.setdefault(file_of(t), []).append(t)
    for f, ts in by_file.items():
        per, extra = divmod(len(ts), -(-len(ts) // size))  # pieces of per or per + 1 tests
        start = 0
        for i in range(-(-len(ts) // size)):
            end = start + per + (i < extra)
            pieces.append(Piece(f, ts[start:end], f.startswith(alone)))
            start = end
    rank = [next((i for i, f in enumerate(first) if p.file.startswith(f)), len(first)) for p in pieces]
    return [p for _, p in sorted(zip(rank, pieces), key=lambda rp: (rp[0], not rp[1].alone))]


def source_digest(root: Path) -> str:
    """SHA-256 (16 hex digits) of the files the tests depend on, caches and bytecode left out."""
    h = hashlib.sha256()
    paths = set()
    for part in SOURCES:
        for p in root.glob(part):
            paths |= {p} if p.is_file() else {q for q in p.rglob("*") if q.is_file()}
    for p in sorted(paths):
        rel = p.relative_to(root)
        if "__pycache__" in rel.parts or p.suffix == ".pyc" or any(s.startswith(".") for s in rel.parts):
            continue
        h.update(str(rel).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def pending(state: dict) -> list[str]:
    return [t for t in state["plan"]["tests"] if t not in state["results"]]


# ---------------------------------------------------------------------------------------------
# Recording what a piece did.

def read_log(path: Path) -> list[dict]:
    """The plugin's records; a line cut short by a kill is dropped."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def merge(state: dict, piece: Piece, records: list[dict], exit_code: int | None, killed: bool,
          output_tail: str = "", stalled: float | None = None) -> list[str]:
    """Record the piece's finished tests in `state`. Returns the tests to run again: those its process
    had not started when it died on its own (a crash), once: a retried piece whose process too died
    before finishing a test (a crash in a module fixture) makes the rest errors, rather than one
    process per test. A test in flight when its process died is an error; a process that died before
    starting any test (an import or collection error) makes all its tests errors. Killed at the
    deadline, the unfinished tests stay pending, but a test in flight at the deadline of two calls is
    an error (a hang, or longer than a call). `stalled`: the process was stopped after that many seconds
    without a record (schedule's stall limit): the test in flight is an error, the rest run again.
    A test of a piece not alone that failed for want of GPU memory is not recorded: it joins
    state["alone"] and the tests returned (the caller runs it again alone), or stays pending."""
    results = state["results"]
    done = set()
    oom = []
    for r in records:
        if r.get("event") == "result":
            if not piece.alone and r["outcome"] in ("failed", "error") and any(
                    w in r["message"].lower() for w in OUT_OF_MEMORY):
                oom.append(r["nodeid"])
                alone = state.setdefault("alone", [])
                if r["nodeid"] not in alone:
                    alone.append(r["nodeid"])
            else:
                results[r["nodeid"]] = {"outcome": r["outcome"], "duration": r["duration"], "message": r["message"]}
            done.add(r["nodeid"])
        elif r.get("event") == "loaded":  # kernel variants the tests loaded: what gpu_precache.py compiles next
            state.setdefault("variants", {}).update(r["variants"])
    in_flight = [r["nodeid"] for r in records if r.get("event") == "start" and r["nodeid"] not in done]
    if killed:
        cut = state.setdefault("cut", {})
        for t in in_flight:
            cut[t] = cut.get(t, 0) + 1
            if cut[t] >= 2:
                results[t] = {"outcome": "error", "duration": 0.0,
                              "message": "still running when two calls reached their deadline"}
        return oom
    died = (f"its pytest process was stopped after {stalled:.0f} s without a result (--test-timeout: a hang, or a "
            f"test slower than that)" if stalled else f"its pytest process exited with code {exit_code}")
    for t in in_flight:
        results[t] = {"outcome": "error", "duration": 0.0, "message": f"{died} during this test"}
    rest = [t for t in piece.tests if t not in results and t not in oom]
    # pytest's own ends (0 passed, 1 failed, 5 none collected) and a death before any test leave the
    # rest never to run (not collected, an import error): errors, not tests to try again.
    if exit_code in (0, 1, 5) or not any(r.get("event") == "start" for r in records):
        why = "without running this test"
    elif piece.retried and not done:
        why = "before finishing a test, as the process before it did, without running this test"
    else:
        return rest + oom
    for t in rest:
        results[t] = {"outcome": "error", "duration": 0.0, "message": f"{died} {why}: {output_tail[-1500:]}"}
    return oom


# ---------------------------------------------------------------------------------------------
# Running pieces side by side.

def processes() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, start time)} of every process (Linux /proc); the start time tells a process
    from a later one that reuses its pid."""
    out = {}
    for entry in os.scandir("/proc"):
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None:
            out[int(entry.name)] = (int(fields[1]), fields[19])
    return out


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command's name (state, parent, ..., start time at 19); None once
    the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(roots: set[int], table: dict[int, tuple[int, str]] | None = None) -> dict[int, str]:
    """{pid: start time} of every process under `roots` (not the roots themselves), whatever their
    session: the tools sip_tune.probe.run_isolated starts (compute-sanitizer, ncu, the op-level
    process) run in sessions of their own."""
    table = processes() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found: dict[int, str] = {}
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found[child] = table[child][1]
                todo.append(child)
    return found


def _alive(pid: int, started: str) -> bool:
    """Whether the process `pid` that started at `started` still runs (a zombie has ended)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z" and fields[19] == started


class Process:
    """A piece's pytest process, in a process group of its own. At the deadline it gets SIGTERM (the
    plugin turns it into KeyboardInterrupt, so that the tests' cleanup stops their tools), then, after
    GRACE_S, SIGKILL, as does every process under it that is left, in whatever session: a tool left
    running would hold the GPU under the timing tests that come after."""

    def __init__(self, argv: list[str], cwd: Path, env: dict, output: Path, log: Path):
        self.output, self.log = output, log
        self.started = time.time()
        self.stalled: float | None = None  # set when schedule stops it for want of a record
        self._tree: dict[int, str] = {}
        with open(output, "w") as out:
            self.popen = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    def poll(self) -> int | None:
        return self.popen.poll()

    def idle(self) -> float:
        """Seconds since the plugin's last record (a test starting or ending), or since the start."""
        try:
            last = max(self.started, self.log.stat().st_mtime)
        except FileNotFoundError:
            last = self.started
        return time.time() - last

    def terminate(self) -> None:
        self._tree = descendants({self.popen.pid})  # now: once the process is gone, its orphans are no longer under it
        self._signal(signal.SIGTERM)

    def reap(self, grace: float = GRACE_S) -> None:
        """Wait up to `grace` seconds for the group to end after terminate(), then kill it and every
        process under it still running."""
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.popen.wait()
        table = processes()
        tree = {**self._tree, **descendants(set(self._tree), table)}  # what they started since, too
        killed = {}
        for pid, started in tree.items():
            if table.get(pid, (0, None))[1] == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed[pid] = started
                except ProcessLookupError:
                    pass
        # SIGKILL is delivered, not yet acted on, when kill() returns: on a busy host a killed tool can
        # still hold the GPU when the next piece starts timing, so return only once each one has ended.
        until = time.time() + KILL_WAIT_S
        while any(_alive(pid, started) for pid, started in killed.items()) and time.time() < until:
            time.sleep(0.01)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass


def schedule(pieces: list[Piece], jobs: int, deadline: float, launch: Callable[[Piece], object],
             finish: Callable[[Piece, object, bool], list[str]], min_start: float,
             clock: Callable[[], float] = time.monotonic, tick: float = 0.2, stall: float = math.inf) -> None:
    """Run `pieces` in order, `jobs` at a time, a piece marked alone with no other beside it; start
    none with less than `min_start` seconds left; at `deadline` kill those running. A piece (not slow)
    that goes `stall` seconds without a record is stopped and finished as a crash (handle.stalled says
    so): one hung test must not hold its job, and a piece waiting to run alone, until the deadline.
    launch(piece) returns a handle with poll(), idle(), terminate() and reap(); finish(piece, handle,
    killed) records the piece and returns the pieces to run again (queued at the end)."""
    queue, running = list(pieces), []
    while queue or running:
        if clock() >= deadline:
            for _, handle in running:  # all at once: their grace periods overlap
                handle.terminate()
            for piece, handle in running:
                handle.reap()
                finish(piece, handle, True)
            return
        for item in list(running):
            piece, handle = item
            if handle.poll() is None:
                if piece.slow or handle.idle() <= stall:
                    continue
                handle.stalled = stall
                handle.terminate()
                handle.reap()
            running.remove(item)
            queue += finish(piece, handle, False)
        while queue and len(running) < jobs and deadline - clock() >= min_start:
            if running and (queue[0].alone or running[0][0].alone):
                break
            piece = queue.pop(0)
            running.append((piece, launch(piece)))
        if not running and queue and deadline - clock() < min_start:
            return
        time.sleep(tick)


# ---------------------------------------------------------------------------------------------
# The host.

def visible_gpus(python: str) -> tuple[int, str]:
    """(count, name of the first) as torch sees them; (0, "") without CUDA."""
    code = "import torch; n = torch.cuda.device_count(); print(n); print(torch.cuda.get_device_name(0) if n else '')"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120).stdout.splitlines()
        return int(out[0]), out[1] if len(out) > 1 else ""
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0, ""


def head_commit(root: Path) -> str:
    """HEAD's hash, "+dirty" when tracked files differ from it; "unknown" without git (the GPU host's
    copy of the tree may have no .git: pass --commit then)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev.stdout.strip() + ("+dirty" if dirty else "")


def pytest_env(root: Path, grid: str, extra: dict | None = None) -> dict:
    env = dict(os.environ, **{GRID_ENV: grid}, **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TOOLS), str(root), os.environ.get("PYTHONPATH", "")) if p)
    return env


def collect(root: Path, python: str, select: str, grid: str, listing_env: str = "GPU_SUITE_COLLECT") -> list:
    """What the plugin writes of the tests `select` picks under `listing_env` (gpu_suite_plugin): by default
    the tests, as [{"nodeid", "gpu", "slow"}]."""
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "tests.json"
        run = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-p", "gpu_suite_plugin", "-m", select], cwd=root, capture_output=True, text=True,
                             env=pytest_env(root, grid, {listing_env: str(listing)}))
        if run.returncode not in (0, 5) or not listing.exists():  # 5: nothing collected
            raise SystemExit(f"gpu_suite: collecting the tests failed:\n{(run.stdout + run.stderr)[-4000:]}")
        return json.loads(listing.read_text())


# ---------------------------------------------------------------------------------------------
# State and report.

def pack_cache(cache: Path, out: Path) -> list[Path]:
    """cache's objects as out/compile_cache.tar.xz.NN parts, or none (and a line saying so) past CACHE_PARTS."""
    jit_dir = cache / "jit"
    if not jit_dir.is_dir():
        return []
    with tempfile.TemporaryDirectory() as tmp:
        packed = Path(tmp) / "cache.tar.xz"
        with tarfile.open(packed, "w:xz", preset=3) as tar:  # seconds, not a minute, of the call's end
            tar.add(jit_dir, arcname="jit")
        data = packed.read_bytes()
    parts = [data[i:i + CACHE_PART_BYTES] for i in range(0, len(data), CACHE_PART_BYTES)]
    if len(parts) > CACHE_PARTS:
        print(f"gpu_suite: the compile cache packs to {len(data) >> 20} MiB, past {CACHE_PARTS} parts: not written",
              file=sys.stderr)
        return []
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"compile_cache.tar.xz.{i:02d}" for i in range(len(parts))]
    for path, part in zip(paths, parts):
        path.write_bytes(part)
    return paths


def unpack_cache(parts: list[str], cache: Path) -> int:
    """Put the objects of pack_cache's parts (in their order) into cache, leaving entries already there;
    returns how many files it added."""
    with tempfile.TemporaryDirectory() as tmp:
        packed = Path(tmp) / "cache.tar.xz"
        packed.write_bytes(b"".join(Path(p).read_bytes() for p in sorted(parts)))
        added = 0
        with tarfile.open(packed, "r:xz") as tar:
            for member in tar.getmembers():
                if not member.isfile() or not member.name.startswith("jit/") or ".." in Path(member.name).parts:
                    continue
                target = cache / member.name
                if not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(member).read())
                    added += 1
    return added


def load_state(path: Path) -> dict | None:
    return json.loads(gzip.decompress(path.read_bytes())) if path.exists() else None


def save_state(state: dict, *paths: Path) -> None:
    data = gzip.compress(json.dumps(state, separators=(",", ":")).encode())
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)


def summarize(state: dict) -> dict:
    """Counts per file and in all, the GPU tests apart, and the suite's status."""
    plan, results = state["plan"], state["results"]
    files: dict[str, dict] = {}
    for t in plan["tests"]:
        row = files.setdefault(file_of(t), {"tests": 0, **dict.fromkeys(OUTCOMES, 0), "pending": 0, "test_s": 0.0})
        row["tests"] += 1
        r = results.get(t)
        if r is None:
            row["pending"] += 1
        else:
            row[r["outcome"]] += 1
            row["test_s"] = round(row["test_s"] + r["duration"], 1)
    total = {k: sum(f[k] for f in files.values()) for k in ("tests", *OUTCOMES, "pending")}
    gpu = set(plan["gpu_tests"])
    gpu_run = sum(1 for t in gpu if t in results and results[t]["outcome"] != "skipped")
    bad = total["failed"] + total["error"] + total["xpassed"]
    status = "partial" if total["pending"] else ("green" if not bad else "red")
    return {"commit": state["commit"], "source_digest": state["digest"], "mode": state["mode"], "status": status,
            "total": total, "gpu_tests": {"collected": len(gpu), "run": gpu_run},
            "wall_s": round(sum(c["wall_s"] for c in state["calls"]), 1), "calls": state["calls"],
            "two_gpu": plan["two_gpu"], "files": files,
            "not_passed": {t: r for t, r in sorted(results.items()) if r["outcome"] not in ("passed", "skipped")},
            "skipped": {t: r["message"] for t, r in sorted(results.items()) if r["outcome"] == "skipped"}}


def markdown(s: dict) -> str:
    t = s["total"]
    mode = ("every `gpu` test, the `grid` tests whole" if s["mode"] == "full"
            else "every `gpu` test, the `grid` tests as CI samples them (--sample)")
    lines = [
        "# GPU suite (tools/gpu_suite.py)", "",
        f"Commit `{s['commit']}` (source digest `{s['source_digest']}`); {mode}.", "",
        f"**Status: {s['status']}.** {t['tests']} tests: {t['passed']} passed, {t['failed']} failed, "
        f"{t['error']} errors, {t['skipped']} skipped"
        + "".join(f", {t[k]} {word}" for k, word in (("xfailed", "xfailed"), ("xpassed", "xpassed"),
                                                     ("pending", "not run yet")) if t[k])
        + f". GPU tests run (not skipped): {s['gpu_tests']['run']} of {s['gpu_tests']['collected']} collected. "
        f"Wall time {s['wall_s']:.0f} s over {len(s['calls'])} call(s).", "",
        f"Two-GPU tests: {s['two_gpu']['note']}", "",
        "| file | tests | passed | failed | errors | skipped | not run | test s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for f, r in sorted(s["files"].items()):
        lines.append(f"| {f} | {r['tests']} | {r['passed']} | {r['failed']} | {r['error']} | {r['skipped']} | "
                     f"{r['pending']} | {r['test_s']:.0f} |")
    lines.append("")
    if s["not_passed"]:
        lines += ["## Not passed", ""]
        lines += [f"- `{t}`: {r['outcome']}: {' '.join(r['message'].split())[:300]}"
                  for t, r in s["not_passed"].items()]
        lines.append("")
    reasons: dict[str, int] = {}
    for message in s["skipped"].values():
        reasons[message] = reasons.get(message, 0) + 1
    if reasons:
        lines += ["## Skipped, by reason", ""]
        lines += [f"- {n} x {' '.join(m.split())[:200]}" for m, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
        lines.append("")
    lines += ["## Calls", "", "| started (UTC) | GPU | jobs | wall s | tests finished |", "|---|---|---:|---:|---:|"]
    lines += [f"| {c['started']} | {c['gpus']} x {c['gpu_name']} | {c['jobs']} | {c['wall_s']:.0f} | "
              f"{c['finished']} |" for c in s["calls"]]
    return "\n".join(lines) + "\n"


def write_report(state: dict, out: Path) -> dict:
    """gpu_suite.md and gpu_suite.json (the summary; every test's result stays in the state)."""
    s = summarize(state)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_suite.json").write_text(json.dumps(s, indent=1) + "\n")
    (out / "gpu_suite.md").write_text(markdown(s))
    return s


# ---------------------------------------------------------------------------------------------
# A call.

def new_state(args, root: Path, digest: str, gpus: int) -> dict:
    tests = collect(root, args.python, args.select, "sample" if args.sample else "full")
    two = [t["nodeid"] for t in tests if file_of(t["nodeid"]).startswith(tuple(args.two_gpu_files))]
    if gpus >= 2 or not two:
        note = f"in the plan ({gpus} GPUs visible)" if two else "none collected"
    else:
        note = (f"not run: {gpus} GPU(s) visible, and {len(two)} test(s) "
                f"({', '.join(sorted({file_of(t) for t in two}))}) need two")
        tests = [t for t in tests if t["nodeid"] not in set(two)]
    # The two-GPU benchmark is not a test: say where it stands beside the tests.
    note += f"; {TWO_GPU_BENCH} (issue 18's targets) runs apart on two GPUs, not in this suite"
    return {"version": 1, "commit": args.commit or head_commit(root), "digest": digest,
            "mode": "sample" if args.sample else "full",
            "plan": {"tests": [t["nodeid"] for t in tests], "gpu_tests": [t["nodeid"] for t in tests if t["gpu"]],
                     "slow_gpu_tests": [t["nodeid"] for t in tests if t["gpu"] and t["slow"]],
                     "two_gpu": {"tests": two, "visible_gpus": gpus, "note": note}},
            "results": {}, "calls": []}


def run(args) -> int:
    t0 = args.started if args.started is not None else time.time()
    deadline = time.monotonic() + args.budget - (time.time() - t0)
    root = Path(args.root).resolve()
    here = root / STATE_DIR
    digest = source_digest(root)
    state = load_state(Path(args.resume)) if args.resume else load_state(here / STATE_FILE)
    if state is not None and args.restart:
        state = None
    if state is not None and (state["digest"] != digest or state["mode"] != ("sample" if args.sample else "full")):
        print(f"gpu_suite: the state is of source digest {state['digest']} ({state['mode']}), this tree is {digest} "
              f"({'sample' if args.sample else 'full'}): pass --restart to begin anew", file=sys.stderr)
        return 2
    gpus, name = (args.gpus, "(count given)") if args.gpus is not None else visible_gpus(args.python)
    if state is None:
        state = new_state(args, root, digest, gpus)
    out = Path(args.out)
    if not pending(state):
        s = write_report(state, out)
        print(f"gpu_suite: {s['status']}: complete already ({s['total']['tests']} tests); --restart runs it again")
        return 0 if s["status"] == "green" else 1
    logs = here / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if args.cache_in:
        print(f"gpu_suite: {unpack_cache(args.cache_in, here / 'cache')} compile-cache files carried in")
    call = {"started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"), "gpus": gpus,
            "gpu_name": name, "jobs": args.jobs, "wall_s": 0.0, "finished": 0}
    state["calls"].append(call)
    before = len(state["results"])
    serial = [0]
    slow = frozenset(state["plan"]["slow_gpu_tests"])

    def launch(piece: Piece) -> Process:
        serial[0] += 1
        tag = f"{len(state['calls'])}-{serial[0]}"
        sip = here / "tmp" / f"sip-{tag}"  # a tuned store per process: a test's entries never steer another's
        env = pytest_env(root, state["mode"], {"GPU_SUITE_LOG": str(logs / f"{tag}.jsonl"), "SIP_CACHE_DIR": str(sip),
                                               "ROSEKERNELS_CACHE_DIR": str(here / "cache")})
        (logs / f"{tag}.select.json").write_text(json.dumps(piece.tests))
        env["GPU_SUITE_SELECT"] = str(logs / f"{tag}.select.json")
        argv = [args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_suite_plugin",
                "--tb=short", piece.file]
        return Process(argv, root, env, logs / f"{tag}.txt", logs / f"{tag}.jsonl")

    def finish(piece: Piece, process: Process, killed: bool) -> list[Piece]:
        tail = process.output.read_text(errors="replace")[-4000:] if process.output.exists() else ""
        rest = merge(state, piece, read_log(process.log), process.poll(), killed, tail, process.stalled)
        call["finished"] = len(state["results"]) - before
        call["wall_s"] = round(time.time() - t0, 1)
        save_state(state, here / STATE_FILE, out / "gpu_suite_state.json.gz")
        write_report(state, out)
        alone = state.get("alone", ())
        again = [t for t in rest if t not in alone]
        return ([Piece(piece.file, again, piece.alone, retried=True)] if again else []) + [
            Piece(file_of(t), [t], True, slow=t in slow) for t in rest if t in alone]

    # A test a deadline cut short goes first, in a piece of its own: this call's whole budget is its.
    todo = pending(state)
    for prefix in args.first:
        if not any(file_of(t).startswith(prefix) for t in todo):
            print(f"gpu_suite: --first {prefix}: no pending test of such a file", file=sys.stderr)
    # and so does one that ran out of GPU memory beside others (alone now)
    cut = [t for t in todo if t in state.get("cut", {}) or t in state.get("alone", ())]
    pieces = [Piece(file_of(t), [t], file_of(t).startswith(ALONE) or t in state.get("alone", ()), slow=t in slow)
              for t in cut]
    pieces += plan_pieces([t for t in todo if t not in cut], args.piece,
                          single=slow, first=tuple(args.first))
    schedule(pieces, args.jobs, deadline, launch, finish, args.min_start, stall=args.test_timeout)
    call["wall_s"] = round(time.time() - t0, 1)
    save_state(state, here / STATE_FILE, out / "gpu_suite_state.json.gz")
    s = write_report(state, out)
    shutil.rmtree(here / "tmp", ignore_errors=True)
    if args.cache_out:
        pack_cache(here / "cache", out)
    t = s["total"]
    print(f"gpu_suite: {s['status']}: {t['tests'] - t['pending']} of {t['tests']} done ({call['finished']} in this "
          f"call, {call['wall_s']:.0f} s); {t['failed']} failed, {t['error']} errors, {t['skipped']} skipped"
          + ("; run again to resume" if t["pending"] else ""))
    return 0 if s["status"] == "green" else (4 if s["status"] == "partial" else 1)  # 3: gpu_env.sh found no CuTeDSL


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run (or resume) the suite for at most --budget seconds")
    r.add_argument("--out", required=True, help="where the report and the state's copy go ($OUT on the host)")
    r.add_argument("--resume", help="a previous call's gpu_suite_state.json.gz (instead of .gpu_suite's)")
    r.add_argument("--restart", action="store_true", help="drop the state: collect and begin anew")
    r.add_argument("--sample", action="store_true", help="the grids' CI sample instead of the whole grids")
    r.add_argument("--budget", type=float, default=540, help="seconds for this call, counted from --started")
    r.add_argument("--started", type=float, help="epoch seconds the call began (default: now)")
    r.add_argument("--jobs", type=int, default=6, help="pytest processes side by side (default 6)")
    r.add_argument("--piece", type=int, default=80, help="at most this many tests per process (default 80)")
    r.add_argument("--min-start", type=float, default=30, help="start no piece with fewer seconds left")
    r.add_argument("--test-timeout", type=float, default=180, metavar="S",
                   help="stop a piece S seconds without a test starting or ending (its test in flight an error, "
                        "the rest run again); slow GPU tests only by the deadline (default 180)")
    r.add_argument("--commit", help="the commit the tree is at (default: git rev-parse HEAD)")
    r.add_argument("--gpus", type=int, help="GPUs to assume visible (default: ask torch)")
    r.add_argument("--select", default=SELECT, help=f"pytest -m expression (default {SELECT!r})")
    r.add_argument("--two-gpu-files", nargs="*", default=list(TWO_GPU), help="files whose tests need two GPUs")
    r.add_argument("--first", nargs="*", default=[], metavar="PATH",
                   help="files (path prefixes) whose pending tests this call runs before the others")
    r.add_argument("--cache-in", nargs="+", help="compile_cache.tar.xz.NN parts of an earlier call (--cache-out)")
    r.add_argument("--cache-out", action="store_true",
                   help="write the compile cache to --out in parts (after the budget: keep the budget under 540)")
    r.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    r.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    w = sub.add_parser("report", help="write gpu_suite.md and .json from a state file")
    w.add_argument("state")
    w.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.command == "report":
        s = write_report(load_state(Path(args.state)), Path(args.out))
        print(f"gpu_suite: {s['status']}, {s['total']['tests']} tests; wrote {args.out}/gpu_suite.md and .json")
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
