"""A workload's kernel run once more under a tool that wraps a whole process: compute-sanitizer and
Nsight Compute. Both need a process of their own, which this module starts:

    sanitize(factory, cubin)  ->  {"memcheck": "clean", "racecheck": "clean", "synccheck": "clean"}
    profile(factory, cubin)   ->  the ncu PC-sampling listing of the kernel (sip.profile reads it)

The wrapped process is `python -m sip_tune.probe PAYLOAD`: it builds the workload from the pickled
factory (as the tuner's GPU worker does), swaps `cubin` into the kernel's object (None: the original),
and launches it on the tuned shape's arguments (more than once when profiled: the profiler samples a
steady-state launch) and on `samples` test argument sets (the ragged sizes the workload draws), then
synchronises.
"""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")


class ProbeError(RuntimeError):
    """The profiler could not run or export."""
_DONE = "probe: launches done"


def sanitizer_problem() -> str | None:
    """Why compute-sanitizer cannot run here (None: it can)."""
    return None if shutil.which("compute-sanitizer") else "compute-sanitizer not found on PATH"


def sanitize(factory: Callable[[], Any], cubin: bytes | None, tools: tuple[str, ...] = SANITIZER_TOOLS,
             samples: int = 4, timeout_s: float = 1800.0) -> dict[str, str]:
    """Per tool, "clean" or why not (the tool's last lines), for `cubin` in the workload's kernel."""
    problem = sanitizer_problem()
    if problem:
        return dict.fromkeys(tools, problem)
    verdicts = {}
    with _payload(factory, cubin, samples, skip=0) as payload:
        for tool in tools:
            cmd = ["compute-sanitizer", "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "99",
                   sys.executable, "-m", "sip_tune.probe", payload]
            out, code = _run(cmd, timeout_s)
            # memcheck and synccheck end in "ERROR SUMMARY: 0 errors", racecheck in "... 0 hazards".
            summary = "RACECHECK SUMMARY: 0 hazards" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
            clean = code == 0 and _DONE in out and summary in out
            verdicts[tool] = "clean" if clean else f"exit {code}: " + " | ".join(out.strip().splitlines()[-6:])
    return verdicts


def profile(factory: Callable[[], Any], cubin: bytes, timeout_s: float = 900.0) -> str:
    """Nsight Compute's per-instruction PC samples of one steady-state launch of `cubin` in the
    workload's kernel, as the CSV source listing sip.profile.stall_samples reads; ProbeError when
    ncu cannot profile."""
    if not shutil.which("ncu"):
        raise ProbeError("ncu (Nsight Compute) not found on PATH")
    name = _kernel_name(cubin)
    with _payload(factory, cubin, samples=0, skip=2) as payload, tempfile.TemporaryDirectory() as tmp:
        report = str(Path(tmp) / "probe")
        out, code = _run(["ncu", "--section", "SourceCounters", "--warp-sampling-interval", "0", "--kernel-name-base", "mangled",
                          "--kernel-name", name, "--launch-skip", "2", "--launch-count", "1",
                          "--export", report, "--force-overwrite",
                          sys.executable, "-m", "sip_tune.probe", payload], timeout_s)
        if code != 0 or not Path(report + ".ncu-rep").is_file():
            raise ProbeError("ncu could not profile the kernel: " + " | ".join(out.strip().splitlines()[-6:]))
        listing, code = _run(["ncu", "--import", report + ".ncu-rep", "--page", "source", "--print-source", "sass",
                              "--csv"], timeout_s, merge=False)
        if code != 0:
            raise ProbeError(f"ncu could not export the source listing (exit {code})")
    return listing


def _kernel_name(cubin: bytes) -> str:
    """The kernel SIP tunes in `cubin`: its largest entry (CuTeDSL cubins hold one)."""
    from sip import cubin as elf

    parsed = elf.parse_cubin(cubin)
    kernels = [k for k in parsed.kernels() if k.entry] or parsed.kernels()
    return max(kernels, key=lambda k: k.instruction_count).name


class _payload:
    """A temporary pickle of what the probe process runs; its path while the context lasts."""

    def __init__(self, factory: Callable[[], Any], cubin: bytes | None, samples: int, skip: int):
        self.data = {"factory": factory, "cubin": cubin, "samples": samples, "warm": skip}

    def __enter__(self) -> str:
        fd, self.path = tempfile.mkstemp(suffix=".pkl", prefix="sip-probe-")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(self.data, f)
        return self.path

    def __exit__(self, *exc: Any) -> None:
        os.unlink(self.path)


def _run(cmd: list[str], timeout_s: float, merge: bool = True) -> tuple[str, int]:
    """Output (stdout, + stderr if `merge`) and exit code; the probe sees this process's import path,
    so a factory defined anywhere this process can import unpickles there too."""
    path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    env = dict(os.environ, PYTHONPATH=path)
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f} s", -1
    return (run.stdout + run.stderr if merge else run.stdout), run.returncode


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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
