"""What the GEMM benchmarks share: calls over rotating input sets, and the sweep that times every
candidate config of a shape (bench/gemm_leakyrelu.py --sweep, bench/gemm_swiglu.py --sweep)."""
from __future__ import annotations

import torch

import timing
from rosekernels.kernels import gemm_leakyrelu as glr
from rosekernels.kernels import gemm_leakyrelu_plan as plan
from rosekernels.ops import gemm as gemm_op


def rotating(fn, sets):
    """fn on input set i % len(sets) for call i (bench/timing.py's step)."""
    return lambda i: fn(*sets[i % len(sets)])


def graph_calls(sets) -> int:
    """Calls per CUDA graph: about 200, whole rounds over the sets."""
    return max(20, 200 // len(sets) * len(sets))


def graph_ms(fn, sets):
    """Device ms per call of a CUDA graph of about 200 calls over the sets."""
    return timing.graph_time_us(rotating(fn, sets), graph_calls(sets), reps=5, warmup=len(sets)) / 1e3


def prefill_calls(flops: int) -> int:
    """Calls per method per interleaved round: about 100 ms of work at 700 TFLOP/s, 5 to 50."""
    return max(5, min(50, int(100 / max(flops / 700e12 * 1e3, 1e-3))))


def sweep(shape, sets, flops, sm, splits=None):
    """Every candidate config of the shape (glr.candidates: the tuner's search space), forced past
    the heuristic; decode ones up to three waves of work units (swapped 128-row tiles won at 2.2
    waves on the H200: M = 1, 37888 x 3584; more never won), with
    split counts in `splits` (None: all) and only the fewest rows of A that hold M."""
    m, n, k = shape.m, shape.n, shape.k
    decode = shape.mode == "decode"
    fewest = next((r for r in plan.A_ROWS if r >= m), None)
    trials = [cfg for cfg in glr.candidates(shape, sm)
              if not decode or (plan.output_tiles(cfg, m, n) * cfg.splits <= 3 * sm
                                and (splits is None or cfg.splits in splits)
                                and (cfg.tile_m != 64 or cfg.swap_ab or cfg.a_rows == fewest))]
    glr.precompile(trials)
    fns, rows = {}, {}
    for cfg in trials:
        rows[cfg] = dict(config=cfg.variant().key(), splits=cfg.splits, raster_group=cfg.raster_group)

        def fn(a, w, b, o, cfg=cfg):
            gemm_op.run(a, w, b, o, cfg)
        try:
            fn(*sets[0])
            torch.cuda.synchronize()
            fns[cfg] = fn
        except Exception as e:  # noqa: BLE001
            rows[cfg]["error"] = f"{type(e).__name__}: {e}"[:300]
    if decode:  # each in its own CUDA graph, next to the heuristic's cost model
        times = {cfg: graph_ms(fn, sets) for cfg, fn in fns.items()}
        for cfg, row in rows.items():
            row.update(tile_m=cfg.tile_m, tile_n=cfg.tile_n, a_rows=cfg.a_rows, swap_ab=cfg.swap_ab,
                       cluster_m=cfg.cluster_m, cluster_n=cfg.cluster_n, model_us=plan.decode_cost(cfg, m, n, k, sm))
    else:  # every trial timed in each round (timing.interleaved_time_us)
        steps = {cfg: rotating(fn, sets) for cfg, fn in fns.items()}
        times = timing.interleaved_time_us(steps, prefill_calls(flops), rounds=11)
        times = {cfg: us / 1e3 for cfg, us in times.items()}
    for cfg, ms in times.items():
        rows[cfg].update(ms=ms, tflops=flops / ms / 1e9)
    for row in rows.values():
        print(f"    sweep {row}")
    return list(rows.values())
