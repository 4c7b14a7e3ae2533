"""A workload's kernel run once more under a tool that wraps a whole process: compute-sanitizer and
Nsight Compute. Both need a process of their own, which this module starts:

    sanitize(factory, cubin)  ->  {"memcheck": "clean", "racecheck": "clean", "synccheck": "clean"}
    profile(factory, cubin)   ->  the ncu PC-sampling listing of the kernel (sip.profile reads it)

The wrapped process is a python that takes this process's import path (so a factory defined in a test
or bench module unpickles there too) and runs `main(PAYLOAD)`: it builds the workload from the pickled
factory (as the tuner's GPU worker does), swaps `cubin` into the kernel's object (None: the original),
and launches it on the tuned shape's arguments (more than once when profiled: the profiler samples a
steady-state launch) and on `samples` test argument sets (the ragged sizes the workload draws), then
synchronises.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
PROFILE_CACHE_ENV = "SIP_PROFILE_CACHE"
_DONE = "probe: launches done"


class ProbeError(RuntimeError):
    """A tool the tuner needs is missing, or the profiler could not run or export."""


def sanitizer_problem() -> str | None:
    """Why compute-sanitizer cannot run here (None: it can)."""
    return None if shutil.which("compute-sanitizer") else "compute-sanitizer not found on PATH"


def sanitize(factory: Callable[[], Any], cubin: bytes | None, tools: tuple[str, ...] = SANITIZER_TOOLS,
             samples: int = 4, timeout_s: float = 600.0) -> dict[str, str]:
    """Per tool, "clean" or why not (the tool's last lines), for `cubin` in the workload's kernel.
    torch's caching allocator is off in the probe: memcheck then sees each tensor as an allocation
    of its own, so a write past one into its neighbour is an error, not a write inside a block."""
    problem = sanitizer_problem()
    if problem:
        return dict.fromkeys(tools, problem)
    verdicts = {}
    with _payload(factory, cubin, samples, skip=0) as payload:
        for tool in tools:
            cmd = ["compute-sanitizer", "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "99",
                   *_probe(payload)]
            out, code = run_isolated(cmd, timeout_s, env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
            # memcheck and synccheck end in "ERROR SUMMARY: 0 errors", racecheck in "... 0 hazards".
            summary = "RACECHECK SUMMARY: 0 hazards" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
            clean = code == 0 and _DONE in out and summary in out
            verdicts[tool] = "clean" if clean else f"exit {code}: " + " | ".join(out.strip().splitlines()[-6:])
    return verdicts


def profile(factory: Callable[[], Any], cubin: bytes, timeout_s: float = 900.0) -> str:
    """Nsight Compute's per-instruction PC samples (and their stall reasons) of one steady-state launch
    of `cubin` in the workload's kernel, as the CSV source listing sip.profile reads; ProbeError when
    ncu cannot profile. With $SIP_PROFILE_CACHE naming a directory, the listing of each (workload,
    cubin) is kept there and read back instead of profiling again (a campaign of many searches of one
    kernel profiles it once)."""
    cache = os.environ.get(PROFILE_CACHE_ENV)
    if not cache:
        return _profile(factory, cubin, timeout_s)
    key = hashlib.sha256(pickle.dumps(factory)).hexdigest()[:16] + "-" + hashlib.sha256(cubin).hexdigest()[:16]
    path = Path(cache) / f"{key}.csv"
    if path.is_file():
        return path.read_text()
    listing = _profile(factory, cubin, timeout_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(listing)
    os.replace(partial, path)  # a reader never sees half a listing
    return listing


def _profile(factory: Callable[[], Any], cubin: bytes, timeout_s: float) -> str:
    """One ncu run of `profile`."""
    if not shutil.which("ncu"):
        raise ProbeError("ncu (Nsight Compute) not found on PATH")
    from sip import cubin as elf

    name = elf.parse_cubin(cubin).main_kernel().name
    with _payload(factory, cubin, samples=0, skip=2) as payload, tempfile.TemporaryDirectory() as tmp:
        report = str(Path(tmp) / "probe")
        # Warp-sampling interval 0 (every 2^5 cycles): the default gave 19 samples of a 1 us launch.
        out, code = run_isolated(["ncu", "--section", "SourceCounters", "--warp-sampling-interval", "0",
                          "--kernel-name-base", "mangled", "--kernel-name", name, "--launch-skip", "2",
                          "--launch-count", "1", "--export", report, "--force-overwrite", *_probe(payload)],
                         timeout_s)
        if code != 0 or not Path(report + ".ncu-rep").is_file():
            raise ProbeError("ncu could not profile the kernel: " + " | ".join(out.strip().splitlines()[-6:]))
        listing, code = run_isolated(["ncu", "--import", report + ".ncu-rep", "--page", "source", "--print-source",
                                      "sass", "--csv"], timeout_s, merge=False)
        if code != 0:
            raise ProbeError(f"ncu could not export the source listing (exit {code})")
    return listing


@contextlib.contextmanager
def _payload(factory: Callable[[], Any], cubin: bytes | None, samples: int, skip: int) -> Iterator[str]:
    """A temporary pickle of what the probe process runs; its path while the context lasts."""
    fd, path = tempfile.mkstemp(suffix=".pkl", prefix="sip-probe-")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump({"factory": factory, "cubin": cubin, "samples": samples, "warm": skip}, f)
        yield path
    finally:
        os.unlink(path)


def python_command(module: str, *args: str) -> list[str]:
    """A command that runs `module.main(args)` in this interpreter with this process's import path
    first (what this process imports, a factory defined in a test module included, imports there
    too); run it with `run_isolated`, which passes the path."""
    boot = ("import json, os, sys; sys.path[:0] = json.loads(os.environ['SIP_PROBE_PATH']); "
            f"from {module} import main; sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-c", boot, *args]


def _probe(payload: str) -> list[str]:
    """The probe process's command."""
    return python_command("sip_tune.probe", payload)


def run_isolated(cmd: list[str], timeout_s: float, merge: bool = True,
                 env: dict[str, str | None] | None = None) -> tuple[str, int]:
    """Output (stdout, + stderr if `merge`) and exit code. The command runs in a process group of
    its own, which goes whole on a timeout or if this process is interrupted (the tool and the
    python under it, which holds the GPU); `env` adds to (a value None: removes from) this
    process's environment."""
    full = dict(os.environ, SIP_PROBE_PATH=json.dumps(sys.path))
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            env=full, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException as e:
        _kill_group(proc)
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        return f"timed out after {timeout_s:.0f} s", -1
    return (stdout + stderr if merge else stdout), proc.returncode


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone and reaped
        pass
    proc.wait()


def main(argv: list[str]) -> int:
    with open(argv[0], "rb") as f:
        data = pickle.load(f)
    import torch

    from rosekernels import jit

    workload = data["factory"]()
    fn = workload.kernel.fn
    if data["cubin"] is not None and data["cubin"] != workload.kernel.cubin:
        fn, swapped = jit.load_object(workload.kernel.object_bytes, {workload.kernel.cubin_sha256: data["cubin"]})
        if not swapped:
            raise RuntimeError("the original cubin was not found in the kernel's object")
    args = workload.make_args(0x5EED)
    for _ in range(data["warm"] + 1):  # the profiler skips the warm launches and samples the last
        workload.run(fn, args)
    for i in range(data["samples"]):
        workload.run(fn, workload.sample(0xC0DE + i))
    torch.cuda.synchronize()
    print(f"{_DONE} ({data['warm'] + 1 + data['samples']})", flush=True)
    return 0

