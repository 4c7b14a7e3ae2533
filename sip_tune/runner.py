"""Run candidate cubins on the GPU, in a worker process: load, test against the original, time.

A `rosekernels.workload.Workload` says what to tune and how to feed it: the compiled kernel (its
exported object embeds the original cubin) and a generator of fresh random arguments. Every kernel
module makes one with `workload(config, shape)` (`sip_tune.workloads.factory` wraps that); any other
CuTeDSL kernel compiled through `rosekernels.jit.compile_variant` can be tuned by writing a
module-level function that returns one (`tests/tuner/test_sip_gpu.py` has a small example). The
`Runner` pickles that function into a spawned worker, which builds the workload itself.

For every candidate the worker
1. loads it: `jit.load_object(object, {sha256(original): candidate})` patches the cubin inside the
   exported object and loads that (a few ms, no recompilation);
2. tests it: fresh random inputs (seeded by the caller) go through the original and the candidate;
   outputs must match bit for bit (or within a tolerance, if one is given), and the integer scratch
   the candidate found zero must be zero again after it (`launch_checked`: the ops reuse theirs);
3. times it against the original: each kernel is captured in a CUDA graph of many launches cycling
   over input sets that together exceed the L2 cache, and the two graphs are replayed alternately;
   the energy is the median of the per-pair time ratios, so drift of the card cancels out.

Any exception in the worker (an illegal address poisons its CUDA context) ends the worker; a hang is
cut by a timeout. Either way the parent records the failure, and the next request starts a new worker.

The same worker runs level 1 (`sip_tune.configs`) with `ConfigBench` in place of the cubin bench:
whole configurations of a kernel for one shape, each its own compiled kernel, tested against the
heuristic's and timed with the same graphs, L2 rotation and interleaved replay.
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import random
import statistics
import time
import traceback
from typing import Any, Callable, Sequence

from rosekernels.workload import Workload


@dataclasses.dataclass(frozen=True)
class Options:
    tolerance: tuple[float, float] | None = None  # (rtol, atol); None: bitwise equality
    timing_reps: int = 10  # replay pairs (original, candidate) per candidate
    graph_ms: float = 1.0  # a graph replay lasts at least this long (timer resolution, launch gaps) ...
    max_graph_ms: float = 8.0  # ... and at most this long (cost per candidate)
    max_launches: int = 4096  # per graph
    ring_l2_multiple: float = 2.0  # the timing input sets together span this many L2 caches (0: one hot set)
    max_ring_sets: int = 4096
    memory_cap_bytes: int = 2 << 30  # for the timing input sets
    test_batch: int = 64  # argument sets per test round (final validation)
    eval_timeout_s: float = 120.0
    start_timeout_s: float = 900.0
    recycle_every: int = 3000  # restart the worker after this many loaded candidates (loaded modules pile up)
    device: int = 0  # the CUDA device the worker runs on


@dataclasses.dataclass
class Evaluation:
    status: str  # "ok" | "incorrect" | "crash" | "timeout"
    rel: float  # candidate time / original time (median of interleaved pairs); inf unless ok
    cand_us: float = math.nan  # per launch
    base_us: float = math.nan
    load_s: float = 0.0
    test_s: float = 0.0
    time_s: float = 0.0
    wall_s: float = 0.0  # round trip as the parent saw it
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class WorkerFailure(RuntimeError):
    """The worker died, hung or could not start."""


# ---------------------------------------------------------------------------------------------
# Parent side.

class Runner:
    """Owns one worker process at a time; restarts it after a crash, hang or every `recycle_every`
    candidates. Use as a context manager."""

    def __init__(self, factory: Callable[[], Workload], options: Options = Options(),
                 log: Callable[[str], None] | None = None, bench: Callable[[Any, Options], Any] | None = None):
        self.factory = factory
        self.options = options
        self.bench = bench or _Bench  # what the worker runs requests on (tests pass a CPU stand-in)
        self.log = log or (lambda msg: None)
        self.info: dict[str, Any] = {}
        self.crashes = 0
        self.timeouts = 0
        self.starts = 0
        self._proc = None
        self._conn = None
        self._loaded = 0

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> dict[str, Any]:
        if self._proc is not None:
            return self.info
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child, self.factory, self.options, self.bench),
                           name="sip-worker", daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn, self._loaded = proc, parent, 0
        self.starts += 1
        kind, payload = self._receive(self.options.start_timeout_s)
        if kind != "ready":
            self._kill()
            self.log(f"worker set-up failed:\n{payload}")
            last = [line for line in str(payload).strip().splitlines() if line.strip()][-1:]
            raise WorkerFailure(f"the worker could not set up the kernel: {''.join(last)}")
        self.info = payload
        return payload

    def restart(self) -> None:
        self.close()
        self.start()

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send(("quit", None))
            self._proc.join(10)
        except (OSError, EOFError, BrokenPipeError):
            pass
        self._kill()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(10)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _receive(self, timeout: float) -> tuple[str, Any]:
        try:
            if not self._conn.poll(timeout):
                return "timeout", f"no answer within {timeout:.0f} s"
            return self._conn.recv()
        except (EOFError, OSError) as e:
            code = self._proc.exitcode if self._proc is not None else None
            return "crash", f"worker died (exit code {code}): {e!r}"

    def request(self, cmd: str, payload: Any, timeout: float) -> tuple[str, Any]:
        """Send one request; ('crash'|'timeout', message) if the worker failed (it is then gone)."""
        if self._proc is None:
            self.start()
        if cmd != "compare" and self._loaded >= self.options.recycle_every:
            self.restart()
        self._loaded += 1
        self._conn.send((cmd, payload))
        kind, answer = self._receive(timeout)
        if kind in ("crash", "timeout"):
            if kind == "crash":
                self.crashes += 1
            else:
                self.timeouts += 1
            self.log(f"worker {kind}: {str(answer).strip().splitlines()[-1] if answer else ''}; restarting it")
            self._kill()
        elif isinstance(answer, dict) and answer.pop("recycle", False):
            self.log("worker memory is filling up (loaded candidates); restarting it")
            self.restart()
        return kind, answer

    def evaluate(self, cubin: bytes, seed: int, samples: int = 2) -> Evaluation:
        t0 = time.perf_counter()
        kind, answer = self.request("eval", (cubin, seed, samples), self.options.eval_timeout_s)
        wall = time.perf_counter() - t0
        if kind in ("crash", "timeout"):
            return Evaluation(kind, math.inf, wall_s=wall, detail=str(answer))
        return Evaluation(**answer, wall_s=wall)

    def validate(self, cubin: bytes, seed: int, samples: int, shape_samples: int = 0) -> dict[str, Any]:
        """Test `cubin` on `shape_samples` input sets of the tuned shape, then `samples` fresh ones of
        the workload's test sizes; {'passed', 'shape_passed', 'failed', 'seconds', 'detail', 'status'}."""
        timeout = self.options.eval_timeout_s + (samples + 20 * shape_samples) * 0.05
        kind, answer = self.request("validate", (cubin, seed, samples, shape_samples), timeout)
        if kind in ("crash", "timeout"):
            return {"status": kind, "passed": 0, "shape_passed": 0, "failed": True, "detail": str(answer),
                    "seconds": math.nan}
        return answer

    def compare(self, cubins: Sequence[bytes], reps: int) -> dict[str, Any]:
        """Interleaved timing of the original (index 0 of the result) and each cubin."""
        timeout = self.options.eval_timeout_s * (1 + len(cubins))
        kind, answer = self.request("compare", (list(cubins), reps), timeout)
        if kind in ("crash", "timeout"):
            raise WorkerFailure(f"the final timing run failed: {answer}")
        return answer


# ---------------------------------------------------------------------------------------------
# Worker side.

def _worker_main(conn: Any, factory: Callable[[], Workload], options: Options,
                 bench_class: Callable[[Any, Options], Any]) -> None:
    try:
        if options.device:  # before the workload allocates its tensors on the current device
            import torch

            torch.cuda.set_device(options.device)
        bench = bench_class(factory(), options)
        conn.send(("ready", bench.info()))
    except BaseException:  # noqa: BLE001 - report anything, then die
        conn.send(("error", traceback.format_exc()))
        os._exit(3)
    while True:
        try:
            cmd, payload = conn.recv()
        except EOFError:
            os._exit(0)
        if cmd == "quit":
            os._exit(0)
        try:
            answer = getattr(bench, cmd)(*payload)
            conn.send(("ok", answer))
        except BaseException:  # noqa: BLE001 - the CUDA context may be poisoned: report and die
            try:
                conn.send(("crash", traceback.format_exc()))
            finally:
                os._exit(4)


def _tensors(args: Any) -> list[Any]:
    import torch

    return [a for a in args if isinstance(a, torch.Tensor)]


# What a launch that leaves scratch set gets as its verdict (`launch_checked`).
SCRATCH_LEFT = ("an integer buffer that was zero at launch (a tile or split counter, a barrier) is not zero after "
                "it: the op reuses its scratch, so the next launch would find it set")


def launch_checked(w: Workload, fn: Callable[..., Any], args: tuple) -> list[Any]:
    """w.run(fn, args), and per integer tensor of `args` that was all zero at launch a device bool:
    whether it is not zero after it. Such tensors are scratch (tile and split counters, grid
    barriers) that the ops share from launch to launch (rosekernels.scratch: each launch finds them
    zero and leaves them zero); outputs are poisoned, never zero, and inputs are not written. Every
    sample draws fresh arguments, so a kernel that left a counter set would pass on its first launch
    and skip work on the op's next one: this makes the scratch part of what is compared."""
    ints = [t for t in _tensors(args) if not (t.is_floating_point() or t.is_complex())]
    zero = [~t.any() for t in ints]
    w.run(fn, args)
    return [z & t.any() for z, t in zip(zero, ints)]


def _clone(args: tuple) -> tuple:
    import torch

    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _set_bytes(args: tuple) -> int:
    """Device bytes of one input set, each storage once: what must rotate past L2 (host tensors, such
    as a reference a workload keeps beside its arguments, take none)."""
    seen = {}
    for t in _tensors(args):
        if t.is_cuda:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return max(1, sum(seen.values()))


def device_info() -> tuple[str, int]:
    """(name, L2 bytes) of the current CUDA device."""
    import torch

    props = torch.cuda.get_device_properties(0)
    return props.name, getattr(props, "L2_cache_size", 0) or (50 << 20)


def _ring_sets(set_bytes: int, l2: int, options: Options) -> int:
    """Input sets that together exceed L2, so that cycling over them keeps the cache from flattering
    (each launch of a graph takes the next set)."""
    want = math.ceil(options.ring_l2_multiple * l2 / set_bytes)
    return max(1, min(want, options.max_ring_sets, options.memory_cap_bytes // set_bytes))


def launches_per_graph(ms_per_launch: float, ring: int, options: Options) -> int:
    """Launches per graph, from the per-launch time of the original: the whole ring once and at
    least graph_ms, but at most max_graph_ms of work."""
    t = max(ms_per_launch, 1e-4)
    return max(1, min(options.max_launches, round(options.max_graph_ms / t), max(ring, round(options.graph_ms / t))))


class GraphTimer:
    """CUDA graph capture, interleaved replay and output comparison, for the benches below."""

    torch: Any
    stream: Any
    o: Options

    def _capture(self, body: Callable[[], None]) -> Any:
        """A CUDA graph of what `body` launches (captured on a side stream, no gc/empty_cache)."""
        torch = self.torch
        g = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            # Each graph gets a private memory pool: a shared one is released when its last graph
            # is freed, and capturing into it again trips an allocator assertion.
            g.capture_begin()
            try:
                body()
            finally:
                g.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        return g

    def _replay(self, graphs: list[Any], reps: int) -> list[list[float]]:
        """Milliseconds per replay, graphs alternated (each rep rotates the order)."""
        torch = self.torch
        for g in graphs:
            g.replay()
        n = len(graphs)
        ev = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(reps)] for _ in graphs]
        for r in range(reps):
            for k in range(n):
                gi = (k + r) % n
                a, b = ev[gi][r]
                a.record()
                graphs[gi].replay()
                b.record()
        torch.cuda.synchronize()
        return [[a.elapsed_time(b) for a, b in row] for row in ev]

    def _mismatch(self, ref: Any, out: Any) -> Any:
        torch = self.torch
        if ref.shape != out.shape or ref.dtype != out.dtype:
            return torch.ones((), dtype=torch.bool, device=ref.device)
        if self.o.tolerance is not None and ref.is_floating_point():
            rtol, atol = self.o.tolerance
            return ~torch.isclose(out, ref, rtol=rtol, atol=atol, equal_nan=True).all()
        a = ref.contiguous().view(-1).view(torch.uint8)
        b = out.contiguous().view(-1).view(torch.uint8)
        return (a != b).any()


class _Bench(GraphTimer):
    """Everything the worker does, on the GPU."""

    def __init__(self, workload: Workload, options: Options):
        import torch

        self.torch = torch
        self.w = workload
        self.o = options
        self.original = workload.kernel.cubin
        self.base = workload.kernel.fn
        self.stream = torch.cuda.Stream()
        self.free0 = torch.cuda.mem_get_info()[0]
        probe = workload.make_args(0x5EED)
        self.set_bytes = _set_bytes(probe)
        self._check_deterministic()
        self.gpu, self.l2 = device_info()
        n_ring = _ring_sets(self.set_bytes, self.l2, self.o)
        self.ring = [probe] + [workload.make_args(0x5EED + i) for i in range(1, n_ring)]
        self.launches = min(len(self.ring), 32)
        t = statistics.median(self._replay([self._graph(self.base)], 5)[0]) / self.launches
        self.launches = launches_per_graph(t, len(self.ring), self.o)
        self.base_graph = self._graph(self.base)
        self.base_us = statistics.median(self._replay([self.base_graph], 5)[0]) / self.launches * 1e3

    def info(self) -> dict[str, Any]:
        used = min(len(self.ring), self.launches)
        return {"gpu": self.gpu, "base_us": self.base_us, "launches_per_graph": self.launches,
                "input_sets": used, "bytes_cycled": used * self.set_bytes, "l2_bytes": self.l2,
                "set_bytes": self.set_bytes, "pid": os.getpid(),
                "tolerance": self.o.tolerance}

    # -- pieces

    def _load(self, cubin: bytes, fresh: bool = False) -> Callable[..., Any]:
        """The kernel function of `cubin`; the original's own unless `fresh` (then loaded anew, as
        candidates are: the A/A copy)."""
        if cubin == self.original and not fresh:
            return self.base
        if len(cubin) != len(self.original):
            raise ValueError(f"candidate has {len(cubin)} bytes, the original {len(self.original)}")
        from rosekernels import jit

        fn, swapped = jit.load_object(self.w.kernel.object_bytes, {self.w.kernel.cubin_sha256: cubin})
        if not swapped:
            raise RuntimeError("the original cubin was not found in the kernel's object")
        return fn

    def _graph(self, fn: Callable[..., Any]) -> Any:
        """`launches` launches of `fn` cycling over the timing input sets."""
        self.w.run(fn, self.ring[0])  # a first call outside capture (the module loads lazily)

        def body() -> None:
            for j in range(self.launches):
                self.w.run(fn, self.ring[j % len(self.ring)])
        return self._capture(body)

    def _check_deterministic(self) -> None:
        """Bitwise testing needs an original that repeats itself exactly."""
        result = self._test(self.base, 0xD7, 8, batch=8)
        if result["failed"]:
            raise RuntimeError("the original kernel does not repeat itself on the same inputs "
                               f"({result['detail']}); compare canonical outputs or give a tolerance")

    def _test(self, fn: Callable[..., Any], seed: int, samples: int, batch: int,
              draw: Callable[[int], tuple] | None = None) -> dict[str, Any]:
        """Run `samples` fresh input sets (seeds drawn from `seed`; `draw`: how a seed becomes one,
        default the workload's test sizes) through the original and `fn`; `batch` samples per
        round, compared on the device, one host synchronisation per round."""
        torch = self.torch
        draw = draw or self.w.sample
        seeds = random.Random(seed)
        done = 0
        t0 = time.perf_counter()
        while done < samples:
            k = min(batch, samples - done)
            pairs = []
            for _ in range(k):
                ref = draw(seeds.getrandbits(63))
                cand = _clone(ref)
                self.w.run(self.base, ref)
                pairs.append((ref, cand, launch_checked(self.w, fn, cand)))
            flags = [torch.stack([*(self._mismatch(r, c) for r, c in zip(self.w.outputs(ref), self.w.outputs(cand))),
                                  *left]).any() for ref, cand, left in pairs]
            bad = torch.stack(flags).nonzero()
            if len(bad):
                j = int(bad[0])
                return {"passed": done + j, "failed": True, "seconds": time.perf_counter() - t0,
                        "detail": f"sample {done + j}: " + self._describe(*pairs[j])}
            done += k
        return {"passed": done, "failed": False, "seconds": time.perf_counter() - t0, "detail": ""}

    def _describe(self, ref_args: tuple, cand_args: tuple, left: list[Any]) -> str:
        torch = self.torch
        parts = [SCRATCH_LEFT] if any(bool(flag) for flag in left) else []
        for i, (r, c) in enumerate(zip(self.w.outputs(ref_args), self.w.outputs(cand_args))):
            a = r.contiguous().view(-1).view(torch.uint8)
            b = c.contiguous().view(-1).view(torch.uint8)
            diff = (a != b).nonzero()
            if len(diff):
                parts.append(f"output {i}: {len(diff)} of {a.numel()} bytes differ, first at byte {int(diff[0])}")
        return "; ".join(parts) or "outputs differ within tolerance"

    def _recycle(self) -> bool:
        free = self.torch.cuda.mem_get_info()[0]
        return free < 0.5 * self.free0 or free < (2 << 30)

    # -- requests

    def eval(self, cubin: bytes, seed: int, samples: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        fn = self._load(cubin)
        t1 = time.perf_counter()
        test = self._test(fn, seed, samples, batch=samples)
        t2 = time.perf_counter()
        if test["failed"]:
            return {"status": "incorrect", "rel": math.inf, "load_s": t1 - t0, "test_s": t2 - t1,
                    "detail": test["detail"], "recycle": self._recycle()}
        g = self._graph(fn)
        base, cand = self._replay([self.base_graph, g], self.o.timing_reps)
        del g
        rel = statistics.median(c / b for b, c in zip(base, cand))
        t3 = time.perf_counter()
        return {"status": "ok", "rel": rel, "cand_us": statistics.median(cand) / self.launches * 1e3,
                "base_us": statistics.median(base) / self.launches * 1e3,
                "load_s": t1 - t0, "test_s": t2 - t1, "time_s": t3 - t2, "recycle": self._recycle()}

    def validate(self, cubin: bytes, seed: int, samples: int, shape_samples: int = 0) -> dict[str, Any]:
        """`cubin` against the original on `shape_samples` input sets of the tuned shape (the
        workload's make_args), then on `samples` of its test sizes; "shape_passed" and "passed"
        count what passed."""
        fn = self._load(cubin)
        at_shape = self._test(fn, seed ^ 0x5A5E, shape_samples, batch=4, draw=self.w.make_args)
        if at_shape["failed"]:
            return {**at_shape, "status": "incorrect", "passed": 0, "shape_passed": at_shape["passed"],
                    "detail": f"at the tuned shape: {at_shape['detail']}"}
        out = self._test(fn, seed, samples, batch=self.o.test_batch)
        out["seconds"] += at_shape["seconds"]
        out["status"], out["shape_passed"] = "incorrect" if out["failed"] else "ok", at_shape["passed"]
        return out

    def compare(self, cubins: list[bytes], reps: int) -> dict[str, Any]:
        """Per-launch median microseconds of the original and each cubin, all replayed interleaved."""
        graphs = [self.base_graph] + [self._graph(self._load(c, fresh=True)) for c in cubins]
        times = self._replay(graphs, reps)
        us = [[t / self.launches * 1e3 for t in row] for row in times]
        ratios = [statistics.median(c / b for b, c in zip(times[0], row)) for row in times]
        return {"median_us": [statistics.median(row) for row in us], "rel": ratios,
                "min_us": [min(row) for row in us], "reps": reps, "launches_per_graph": self.launches}


class ConfigBench(GraphTimer):
    """The worker of level 1 (`sip_tune.configs`): several configurations of one kernel for one
    shape. `space` has `configs` (the heuristic's first) and `workload(i)`, the Workload of
    configs[i] at the shape; workloads are built (loaded from the disk cache) when first asked for,
    so that one that fails to load or crashes costs only its own request.

    test(i, ...) runs the heuristic and configs[i] on the same inputs (make_args of the same seeds:
    the tuned config is for this shape) and compares the outputs bitwise; where they differ, the
    candidate's float64 check must pass. time(indices, ...) replays graphs of the heuristic (twice:
    the A/A pair) and of each candidate interleaved, every graph cycling over its own input sets
    (the configs' arguments differ, e.g. split-K workspaces) that together exceed L2. validate(i,
    ...) tests a winner before it is stored: as `test` at the tuned shape and at its bucket's edges
    (`space.workload_at(i, shape)`), then its float64 check on many samples of its test sizes."""

    RING_SEED = 0x5EED

    def __init__(self, space: Any, options: Options):
        import torch

        self.torch = torch
        self.space = space
        self.o = options
        self.stream = torch.cuda.Stream()
        self.workloads: dict[int, Workload] = {}
        self.rings: dict[int, list[tuple]] = {}
        self.gpu, self.l2 = device_info()
        heuristic = self._workload(0)
        probe = heuristic.make_args(self.RING_SEED)
        self.set_bytes = _set_bytes(probe)
        self.n_ring = _ring_sets(self.set_bytes, self.l2, self.o)
        self._check_deterministic()
        self.launches = min(self.n_ring, 32)
        t = statistics.median(self._replay([self._graph(0)], 5)[0]) / self.launches
        self.launches = launches_per_graph(t, self.n_ring, self.o)
        self.base_us = statistics.median(self._replay([self._graph(0)], 5)[0]) / self.launches * 1e3

    def info(self) -> dict[str, Any]:
        used = min(self.n_ring, self.launches)
        return {"gpu": self.gpu, "base_us": self.base_us, "launches_per_graph": self.launches,
                "input_sets": used, "bytes_cycled": used * self.set_bytes, "l2_bytes": self.l2,
                "set_bytes": self.set_bytes, "pid": os.getpid(), "configs": len(self.space.configs)}

    def _workload(self, i: int) -> Workload:
        if i not in self.workloads:
            self.workloads[i] = self.space.workload(i)
        return self.workloads[i]

    def _ring(self, i: int) -> list[tuple]:
        if i not in self.rings:
            w = self._workload(i)
            self.rings[i] = [w.make_args(self.RING_SEED + j) for j in range(self.n_ring)]
        return self.rings[i]

    def _graph(self, i: int) -> Any:
        """`launches` launches of configs[i] cycling over its input sets."""
        w, ring = self._workload(i), self._ring(i)
        w.run(w.kernel.fn, ring[0])  # a first call outside capture (the module loads lazily)

        def body() -> None:
            for j in range(self.launches):
                w.run(w.kernel.fn, ring[j % len(ring)])
        return self._capture(body)

    def _differs(self, ref: tuple, out: tuple, w_ref: Workload, w_out: Workload) -> bool:
        return bool(self.torch.stack([self._mismatch(r, c) for r, c in zip(w_ref.outputs(ref), w_out.outputs(out))])
                    .any())

    def _check_deterministic(self) -> None:
        """Bitwise comparison needs a heuristic kernel that repeats itself exactly."""
        w = self._workload(0)
        for seed in range(4):
            a, b = w.make_args(0xD7 + seed), w.make_args(0xD7 + seed)
            w.run(w.kernel.fn, a)
            w.run(w.kernel.fn, b)
            if self._differs(a, b, w, w):
                raise RuntimeError("the heuristic's kernel gives different outputs on the same inputs: "
                                   "candidates cannot be compared with it bitwise")

    def _compare(self, ref_w: Workload, w: Workload, seeds: random.Random, samples: int) -> tuple[bool, float, str]:
        """`samples` input sets of the same seeds through both: (bitwise, max_err, "" or why not).
        Where outputs differ, w's float64 check must pass (max_err: the worst, nan when all equal);
        w must leave its scratch zero (`launch_checked`)."""
        bitwise, max_err = True, math.nan
        for n in range(samples):
            s = seeds.getrandbits(63)
            ref, out = ref_w.make_args(s), w.make_args(s)
            ref_w.run(ref_w.kernel.fn, ref)
            if any(bool(flag) for flag in launch_checked(w, w.kernel.fn, out)):
                return False, max_err, f"sample {n}: {SCRATCH_LEFT}"
            if not self._differs(ref, out, ref_w, w):
                continue
            bitwise = False
            if w.check is None:
                return False, max_err, f"sample {n}: outputs differ from the heuristic's and the kernel has no check"
            try:
                err = float(w.check(out))
            except AssertionError as e:
                return False, max_err, f"sample {n}: {e}"
            max_err = err if math.isnan(max_err) else max(max_err, err)
        return bitwise, max_err, ""

    # -- requests

    def test(self, i: int, seed: int, samples: int) -> dict[str, Any]:
        """configs[i] against the heuristic on `samples` input sets drawn from `seed`: status
        ("ok" | "incorrect"), bitwise (every sample equal), max_err (the worst of the float64 checks,
        relative to the kernel's tolerance; nan when every sample was bitwise equal)."""
        t0 = time.perf_counter()
        heuristic, w = self._workload(0), self._workload(i)
        t1 = time.perf_counter()
        bitwise, max_err, detail = self._compare(heuristic, w, random.Random(seed), samples)
        return self._verdict("incorrect" if detail else "ok", bitwise, max_err, t0, t1, detail)

    def validate(self, i: int, seed: int, samples: int, edges: list, edge_samples: int) -> dict[str, Any]:
        """configs[i] wherever its entry will serve, before it is stored: against the heuristic on
        `edge_samples` input sets at the tuned shape and at each shape of `edges` (its bucket's
        edges; as `test`), then its float64 check on `samples` fresh sets of the sizes its workload
        tests (Workload.test_args). {"status", "bitwise" (at the shapes), "max_err", "shape_passed" (at
        the tuned shape), "edges_passed" (at the edges, together), "passed", "seconds", "detail"}."""
        t0 = time.perf_counter()
        seeds = random.Random(seed)
        out = {"status": "ok", "bitwise": True, "max_err": math.nan, "shape_passed": 0, "edges_passed": 0,
               "passed": 0, "detail": ""}
        for shape in [None, *edges]:
            pair = (self._workload(0), self._workload(i)) if shape is None else \
                (self.space.workload_at(0, shape), self.space.workload_at(i, shape))
            bitwise, max_err, detail = self._compare(*pair, seeds, edge_samples)
            out["bitwise"] &= bitwise
            out["max_err"] = max_err if math.isnan(out["max_err"]) else max(out["max_err"], max_err)
            if detail:
                where = "the tuned shape" if shape is None else f"bucket edge {shape}"
                return {**out, "status": "incorrect", "detail": f"at {where}: {detail}",
                        "seconds": time.perf_counter() - t0}
            out["shape_passed" if shape is None else "edges_passed"] += edge_samples
        w = self._workload(i)
        for n in range(samples):
            args = w.sample(seeds.getrandbits(63))
            left = launch_checked(w, w.kernel.fn, args)
            try:
                if w.check is None:
                    raise AssertionError("the kernel has no float64 check")
                if any(bool(flag) for flag in left):
                    raise AssertionError(SCRATCH_LEFT)
                w.check(args)
            except AssertionError as e:
                return {**out, "status": "incorrect", "detail": f"test sample {n}: {e}",
                        "seconds": time.perf_counter() - t0}
            out["passed"] += 1
        return {**out, "seconds": time.perf_counter() - t0}

    @staticmethod
    def _verdict(status: str, bitwise: bool, max_err: float, t0: float, t1: float, detail: str) -> dict[str, Any]:
        return {"status": status, "bitwise": bitwise, "max_err": max_err, "load_s": t1 - t0,
                "test_s": time.perf_counter() - t1, "detail": detail}

    def time(self, indices: list[int], reps: int) -> dict[str, Any]:
        """Per-launch median microseconds of [heuristic, heuristic again, *configs[indices]], all
        replayed interleaved; rel: the median over reps of each one's time / the heuristic's
        (the second entry's is the A/A ratio)."""
        graphs = [self._graph(0), self._graph(0)] + [self._graph(i) for i in indices]
        times = self._replay(graphs, reps)
        ratios = [statistics.median(c / b for b, c in zip(times[0], row)) for row in times]
        return {"median_us": [statistics.median(row) / self.launches * 1e3 for row in times], "rel": ratios,
                "reps": reps, "launches_per_graph": self.launches}
