"""Benchmark gemm_leakyrelu against cuBLAS (+ a separate LeakyReLU), cuBLAS alone, torch.compile and,
when installed, quack's GEMM (+ReLU epilogue) - all in one run, on one GPU.

    python bench/gemm_leakyrelu.py --out bench/results            # the standard table
    python bench/gemm_leakyrelu.py --out DIR --sweep              # + every candidate config (tile,
                                                                  #   split count, rows of A, cluster,
                                                                  #   raster) against the heuristic
    python bench/gemm_leakyrelu.py --out DIR --shapes 1x14336x4096,8192x8192x8192

Prefill shapes: CUDA events around back-to-back launches, inputs rotated through sets larger than
the L2, median of repetitions. Decode shapes (M <= 128): the same inside a CUDA graph of many
launches (time / launches), plus the eager host cost per call, and the achieved weight bandwidth as
a percentage of the device copy bandwidth measured in the same run.
Writes gemm_leakyrelu.json and gemm_leakyrelu.md into --out's gemm/.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import gemm_sweep  # noqa: E402  (bench/gemm_sweep.py: rotating inputs, the config sweep)
import report  # noqa: E402  (bench/report.py: environment, peers and result files)
import timing  # noqa: E402
import rosekernels  # noqa: E402
from rosekernels import checks  # noqa: E402
from rosekernels.kernels import gemm_leakyrelu as glr  # noqa: E402
from rosekernels.kernels import gemm_leakyrelu_plan as plan  # noqa: E402

MLP = [(m, n, k) for m in (1, 16, 128, 1024, 8192) for n, k in ((14336, 4096), (4096, 14336))]
SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192)] + MLP


def _quack():
    from quack.gemm_interface import gemm, gemm_act
    return gemm, gemm_act


def _make_sets(m, n, k, dtype, bias):
    per_set = (m * k + n * k + m * n) * torch.finfo(dtype).bits // 8
    count = timing.input_sets(per_set, least=1, most=8)
    sets = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(count):
        a = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
        b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        sets.append((a, w, b, out))
    return sets


def bench_shape(m, n, k, dtype, slope, bias, copy_gbs, quack, compile_peer, sweep, sweep_splits=None):
    sets = _make_sets(m, n, k, dtype, bias)
    decode = m <= plan.DECODE_MAX_M
    flops = 2 * m * n * k
    weight_bytes = n * k * torch.finfo(dtype).bits // 8

    def ours(a, w, b, out):
        rosekernels.gemm_leakyrelu(a, w, slope, bias=b, out=out)

    def cublas_act(a, w, b, out):
        F.leaky_relu(F.linear(a, w, b), slope, inplace=True)

    def cublas(a, w, b, out):
        torch.mm(a, w.t(), out=out) if b is None else torch.addmm(b, a, w.t(), out=out)

    methods = {"rosekernels": ours, "cublas+leaky_relu": cublas_act, "cublas": cublas}
    if compile_peer:
        compiled = torch.compile(lambda a, w, b: F.leaky_relu(F.linear(a, w, b), slope), dynamic=False)
        methods["torch.compile"] = lambda a, w, b, out: compiled(a, w, b)
    if quack is not None:
        q_gemm, q_gemm_act = quack
        methods["quack"] = lambda a, w, b, out: q_gemm(a, w.t(), out=out, bias=b, tuned=False)
        methods["quack+relu (fused)"] = lambda a, w, b, out: q_gemm_act(
            a, w.t(), bias=b, activation="relu", postact_out=out, store_preact=False, tuned=False)

    # Correctness against cuBLAS + leaky_relu (fp32 accumulation both).
    a, w, b, out = sets[0]
    ours(a, w, b, out)
    ref = F.leaky_relu(F.linear(a.float(), w.float(), None if b is None else b.float()), slope)
    rel = ((out.float() - ref).norm() / ref.norm()).item()

    rows, ready = [], {}
    for name, fn in methods.items():
        try:
            fn(*sets[0])  # compile / autotune / warm up
            torch.cuda.synchronize()
            ready[name] = fn  # timed below, interleaved with the others
        except Exception as e:  # noqa: BLE001 - record the failure, keep benchmarking the rest
            print(f"  {name}: failed: {type(e).__name__}: {str(e)[:300]}")
            rows.append(dict(method=name, error=f"{type(e).__name__}: {e}"[:500]))
    if decode and ready:
        # A CUDA graph per method, replays interleaved; a method that cannot be captured is timed eagerly.
        failed = {}
        steps = {name: gemm_sweep.rotating(fn, sets) for name, fn in ready.items()}
        graph_us = timing.interleaved_graph_time_us(steps, gemm_sweep.graph_calls(sets), rounds=7, warmup=len(sets),
                                                    errors=failed)
        for name, fn in ready.items():
            if name in graph_us:
                ms, how = graph_us[name] / 1e3, "graph"
            else:
                print(f"  {name}: CUDA graph failed ({failed[name]}), timing eagerly")
                ms = timing.event_time_us(gemm_sweep.rotating(fn, sets), 200, reps=5) / 1e3
                how = "events (graph failed)"
            host = timing.enqueue_time_us(gemm_sweep.rotating(fn, sets), calls=200, reps=1)
            rows.append(dict(method=name, ms=ms, tflops=flops / ms / 1e9, host_us=host, timing=how,
                             weight_gbs=weight_bytes / ms / 1e6, pct_copy_ceiling=weight_bytes / ms / 1e4 / copy_gbs))
    elif ready:
        steps = {name: gemm_sweep.rotating(fn, sets) for name, fn in ready.items()}
        for name, us in timing.interleaved_time_us(steps, gemm_sweep.prefill_calls(flops), rounds=7).items():
            rows.append(dict(method=name, ms=us / 1e3, tflops=flops / us / 1e6, host_us=None, timing="events"))
    rows.sort(key=lambda r: list(methods).index(r["method"]))
    by = {r["method"]: r for r in rows if "ms" in r}
    for r in rows:
        if "ms" in r:
            for peer in ("cublas+leaky_relu", "cublas"):
                if peer in by:
                    r[f"speedup_vs_{peer}"] = by[peer]["ms"] / r["ms"]

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    dt = checks.DTYPE_NAME[dtype]
    shape = glr.Shape(m, n, k, dt, "k", dt if bias else "none", slope)
    cfg = glr.config_for(shape, sm)
    result = dict(m=m, n=n, k=k, decode=decode, rel_err_vs_fp32=rel, config=cfg.variant().key(),
                  tile_n=cfg.tile_n, a_rows=cfg.a_rows, splits=cfg.splits, raster_group=cfg.raster_group,
                  methods=rows)
    if sweep:
        result["sweep"] = gemm_sweep.sweep(shape, sets, flops, sm, sweep_splits)
    return result


def _tile_name(key: str) -> str:
    """'128x192 pingpong 2x1' from a variant key."""
    p = dict(part.split("=", 1) for part in key.split("-") if "=" in part)
    kind = "pingpong" if p["pingpong"] == "True" else "cooperative"
    return f"{p['tile_m']}x{p['tile_n']} {kind} {p['cluster_m']}x{p['cluster_n']}"


def _picked(result, sweep):
    """The sweep row of the heuristic's config, or None."""
    key = ("config", "splits", "raster_group")
    return next((s for s in sweep if all(s[f] == result[f] for f in key)), None)


def _markdown(results, copy_gbs, device):
    lines = [f"# gemm_leakyrelu on {device}", "",
             f"Device copy bandwidth (read+write): {copy_gbs:.0f} GB/s. TFLOP/s = 2MNK / time; "
             "speedups are time(peer) / time(method). Prefill rows: methods timed interleaved. Decode rows: "
             "CUDA-graph time per launch (a graph per method, replays interleaved), "
             "weight bandwidth as % of the copy bandwidth, eager host us per call.", "",
             "| M | N | K | method | us | TFLOP/s | vs cuBLAS+act | vs cuBLAS | weights % copy | host us |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for row in r["methods"]:
            if "ms" not in row:
                lines.append(f"| {r['m']} | {r['n']} | {r['k']} | {row['method']} | failed | | | | | |")
                continue
            pct = f"{row['pct_copy_ceiling']:.1f}" if "pct_copy_ceiling" in row else ""
            host = f"{row['host_us']:.1f}" if row.get("host_us") else ""
            lines.append(
                f"| {r['m']} | {r['n']} | {r['k']} | {row['method']} | {row['ms'] * 1e3:.1f} | "
                f"{row['tflops']:.1f} | {row.get('speedup_vs_cublas+leaky_relu', 0):.3f} | "
                f"{row.get('speedup_vs_cublas', 0):.3f} | {pct} | {host} |")
    lines += ["", "Chosen specializations and accuracy (relative error vs fp32 cuBLAS):", ""]
    for r in results:
        lines.append(f"- {r['m']}x{r['n']}x{r['k']}: `{r['config']}` splits={r['splits']} "
                     f"rel_err={r['rel_err_vs_fp32']:.2e}")
    if any("sweep" in r for r in results):
        lines += ["", "## Decode heuristic vs sweep", "",
                  "| M | N | K | picked tile_n x splits (a_rows) | its us | sweep best | best us | picked / best |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in results:
            timed = [s for s in r.get("sweep", []) if "ms" in s and "tile_n" in s]
            if not timed:
                continue
            best = min(timed, key=lambda s: s["ms"])
            picked = _picked(r, timed)
            mine = f"{picked['ms'] * 1e3:.1f}" if picked else "not swept"
            ratio = f"{picked['ms'] / best['ms']:.3f}" if picked else ""
            lines.append(f"| {r['m']} | {r['n']} | {r['k']} | {r['tile_n']} x {r['splits']} ({r['a_rows']}) | "
                         f"{mine} | {best['tile_n']} x {best['splits']} ({best.get('a_rows')}) | "
                         f"{best['ms'] * 1e3:.1f} | {ratio} |")
        lines += ["", "## Prefill heuristic vs sweep", "",
                  "| M | N | K | picked tile | its us | sweep best (cluster, raster) | best us | picked / best |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in results:
            timed = [s for s in r.get("sweep", []) if "ms" in s and "tile_n" not in s]
            if not timed:
                continue
            best = min(timed, key=lambda s: s["ms"])
            picked = _picked(r, timed)
            mine = f"{picked['ms'] * 1e3:.1f}" if picked else "not swept"
            ratio = f"{picked['ms'] / best['ms']:.3f}" if picked else ""
            lines.append(f"| {r['m']} | {r['n']} | {r['k']} | {_tile_name(r['config'])} | {mine} | "
                         f"{_tile_name(best['config'])}, {best['raster_group']} | {best['ms'] * 1e3:.1f} | {ratio} |")
        lines += ["", "## Sweep", "", "| M | N | K | config | a_rows | splits | raster | us | TFLOP/s | model us |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in results:
            for s in r.get("sweep", []):
                us = f"{s['ms'] * 1e3:.1f}" if "ms" in s else "failed"
                tf = f"{s['tflops']:.1f}" if "ms" in s else ""
                model = f"{s['model_us']:.1f}" if s.get("model_us") is not None else ""
                lines.append(f"| {r['m']} | {r['n']} | {r['k']} | `{s['config']}` | {s.get('a_rows', '')} | "
                             f"{s['splits']} | {s['raster_group']} | {us} | {tf} | {model} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_out(p)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--slope", type=float, default=0.01)
    p.add_argument("--bias", action="store_true", help="add a bias [N] (all methods)")
    p.add_argument("--shapes", help="comma-separated MxNxK list (default: the standard set)")
    p.add_argument("--sweep", action="store_true", help="also time every candidate config (glr.candidates)")
    p.add_argument("--sweep-splits", help="comma-separated K split counts the decode sweep tries (default: all)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    args = p.parse_args()
    report.require_gpu()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    peers_log = []
    quack = report.try_peer("quack", _quack, peers_log)
    env = report.environment(("quack",))
    device = env["gpu"]
    copy_gbs = timing.copy_gbs()
    print(f"{device}: copy bandwidth {copy_gbs:.0f} GB/s", *peers_log, sep="\n")
    results = []
    t0 = time.time()
    for m, n, k in shapes:
        print(f"{m}x{n}x{k} ...", flush=True)
        r = bench_shape(m, n, k, dtype, args.slope, args.bias, copy_gbs, quack, not args.no_compile, args.sweep,
                        {int(x) for x in args.sweep_splits.split(",")} if args.sweep_splits else None)
        for row in r["methods"]:
            if "ms" in row:
                print(f"  {row['method']:>22}: {row['ms'] * 1e3:9.1f} us {row['tflops']:7.1f} TFLOP/s"
                      + (f"  {row['pct_copy_ceiling']:.1f}% copy" if "pct_copy_ceiling" in row else ""))
        print(f"  rel err {r['rel_err_vs_fp32']:.2e}  config {r['config']} splits={r['splits']}", flush=True)
        results.append(r)
    meta = dict(env, copy_gbs=copy_gbs, dtype=args.dtype, slope=args.slope, bias=args.bias, peers=peers_log,
                seconds=time.time() - t0)
    where = report.write(args.out, "gemm_leakyrelu", dict(meta=meta, results=results),
                         _markdown(results, copy_gbs, device))
    print(f"wrote {where}/gemm_leakyrelu.json and .md in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
