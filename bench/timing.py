"""CUDA timing shared by the benchmarks.

Each `step(i)` enqueues the work of call i (benchmarks rotate their input sets with i % sets, so that
inputs larger than the L2 cache are not served from it); every result is a median in microseconds.
"""
from __future__ import annotations

import math
import random
import statistics
import time

import torch

L2_BYTES = 50 << 20  # H100/H200: 50 MB


def input_sets(bytes_per_set: int, least: int = 2, most: int | None = None) -> int:
    """How many input sets to rotate through so that together they hold three L2 caches' worth:
    a launch then reads its inputs from HBM, not from what the previous launch left in L2."""
    count = max(least, math.ceil(3 * L2_BYTES / bytes_per_set))
    return count if most is None else min(most, count)


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def event_time_us(step, calls_per_rep: int, reps: int = 15, warmup: int = 3) -> float:
    """Device time per call: median over `reps` of one CUDA-event pair around `calls_per_rep`
    back-to-back calls."""
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    times = []
    start, end = _events()
    n = 0
    for _ in range(reps):
        start.record()
        for _ in range(calls_per_rep):
            step(n)
            n += 1
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls_per_rep)
    return statistics.median(times)


def auto_event_time_us(step, reps: int = 15) -> float:
    """event_time_us with enough calls per repetition to last >= 2 ms."""
    probe = event_time_us(step, 3, reps=3, warmup=2)
    return event_time_us(step, max(3, min(2000, math.ceil(2000 / max(probe, 1e-3)))), reps=reps)


def _round_order(names: list, r: int) -> list:
    """The order of round r, shuffled (seeded by r): what ran just before a kernel sets the clocks
    and power state it starts in, so no method may always follow the same one."""
    return random.Random(r).sample(names, len(names))


def interleaved_time_us(steps: dict, calls_per_round: int, rounds: int, warmup: int = 3) -> dict:
    """{name: device time per call}: in every round each step runs `calls_per_round` calls between
    its own event pair, one step after another (_round_order), with one synchronization at the
    end. Clock and power drift over a long run then reach every method alike (timed one after
    another, the same kernel measured up to 10% apart between runs on the H200)."""
    for step in steps.values():
        for i in range(warmup):
            step(i)
    torch.cuda.synchronize()
    pairs = {name: [] for name in steps}
    n = 0
    for r in range(rounds):
        for name in _round_order(list(steps), r):
            step = steps[name]
            start, end = _events()
            start.record()
            for i in range(calls_per_round):
                step(n + i)
            end.record()
            pairs[name].append((start, end))
        n += calls_per_round
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) * 1e3 / calls_per_round for s, e in p)
            for name, p in pairs.items()}


def error_line(e: BaseException) -> str:
    """An exception as one short line for a result's errors: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _capture(step, calls: int, warmup: int) -> torch.cuda.CUDAGraph:
    """step(0), ..., step(calls - 1) in one CUDA graph (warm-up and capture on a side stream, as
    torch's graph docs advise)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warmup):
            step(i)  # compile, autotune, allocate outside the capture
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for i in range(calls):
                step(i)
    torch.cuda.current_stream().wait_stream(side)
    return graph


def interleaved_graph_time_us(steps: dict, calls: int = 100, rounds: int = 15, warmup: int = 3,
                              errors: dict | None = None) -> dict:
    """{name: device time per call}: each step's `calls` calls captured in a CUDA graph of its own;
    every round replays each graph once between its own event pair (_round_order), one
    synchronization at the end (drift reaches every method alike, as in
    interleaved_time_us). With `errors`, a step that fails to capture is left out and its error
    recorded there."""
    graphs = {}
    for name, step in steps.items():
        try:
            graphs[name] = _capture(step, calls, warmup)
        except Exception as e:  # noqa: BLE001 - a method that cannot be captured is a result
            if errors is None:
                raise
            torch.cuda.synchronize()
            errors[name] = error_line(e)
    for graph in graphs.values():
        for _ in range(3):
            graph.replay()
    torch.cuda.synchronize()
    pairs = {name: [] for name in graphs}
    for r in range(rounds):
        for name in _round_order(list(graphs), r):
            start, end = _events()
            start.record()
            graphs[name].replay()
            end.record()
            pairs[name].append((start, end))
    torch.cuda.synchronize()
    del graphs
    return {name: statistics.median(s.elapsed_time(e) * 1e3 / calls for s, e in p) for name, p in pairs.items()}


def graph_time_us(step, calls: int = 100, reps: int = 15, warmup: int = 3) -> float:
    """Device time per call: step(0), ..., step(calls - 1) captured in one CUDA graph, replayed
    `reps` times."""
    return interleaved_graph_time_us({"step": step}, calls, reps, warmup)["step"]


def host_time_us(step, calls: int = 3000, reps: int = 5, warmup: int = 20) -> float:
    """Wall-clock time per call of a loop of `calls` calls, synchronized at its end: the host cost
    of an eager call when kernels are shorter than it."""
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(calls):
            step(i)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(times)


def enqueue_time_us(step, calls: int, reps: int, warmup: int = 0) -> float:
    """Host time per call to enqueue `calls` calls on an idle device (the drain is not timed)."""
    for i in range(warmup):
        step(i)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(calls):
            step(i)
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    return statistics.median(times)


def copy_time_us(nbytes: int) -> float:
    """One device-to-device copy of nbytes, buffers rotated past L2."""
    n = max(1, nbytes // 4)
    sets = input_sets(2 * nbytes)
    bufs = [(torch.empty(n, device="cuda", dtype=torch.float32).normal_(),
             torch.empty(n, device="cuda", dtype=torch.float32)) for _ in range(sets)]
    return auto_event_time_us(lambda i: bufs[i % sets][1].copy_(bufs[i % sets][0]))


def copy_gbs(nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth, read + write bytes, GB/s: the ceiling of bandwidth-bound kernels."""
    return 2 * nbytes / copy_time_us(nbytes) / 1e3
