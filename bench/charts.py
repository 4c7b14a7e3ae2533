"""PNG charts of the benchmark results, drawn with matplotlib (Agg canvas) from the dicts the benchmark
scripts write as JSON: each op's share of the copy (or MMA) ceiling against its peers, decode latency
against tokens, and tuning before/after.

    python bench/charts.py bench/results      # redraw NAME.png beside every NAME.json under it that has a chart

`report.write` calls `draw` after writing NAME.json and NAME.md, so every benchmark run draws its chart
(pip install 'rosekernels[bench]' for matplotlib). A result gets a chart by adding a function to CHARTS.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter
from PIL import Image  # matplotlib depends on Pillow

OURS = "rosekernels"
PANEL = (5.2, 3.8)  # inches per panel
DPI = 120  # legible; the 256-colour encoding (`draw`) keeps the committed charts small
LINESTYLES = ("-", "--", ":", "-.")


# ---------------------------------------------------------------------------------------------
# Drawing helpers.

def _figure(title: str, rows: int, cols: int) -> tuple[Figure, list[list[Any]]]:
    # A bare Figure on an Agg canvas: no pyplot state, nothing left open between charts.
    fig = Figure(figsize=(cols * PANEL[0], rows * PANEL[1] + 0.4), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    return fig, fig.subplots(rows, cols, squeeze=False).tolist()


def _style(label: str, order: list[str]) -> dict[str, Any]:
    """Ours in black and heavier; each peer a colour fixed by its place in the chart's method list."""
    if label == OURS:
        return {"color": "black", "linewidth": 2.2, "marker": "o", "markersize": 4, "zorder": 3}
    return {"color": f"C{order.index(label) % 10}", "linewidth": 1.2, "marker": ".", "markersize": 5}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _lines(ax: Any, x: list, series: dict[str, list], order: list[str], *, linestyle: str = "-",
           suffix: str = "") -> None:
    """One line per method over x, skipping points a method has no value for."""
    for label, ys in series.items():
        pts = [(a, b) for a, b in zip(x, ys) if _finite(b)]
        if pts:
            ax.plot(*zip(*pts), label=label + suffix, linestyle=linestyle, **_style(label, order))


def _bars(ax: Any, groups: list[str], series: dict[str, list], order: list[str], base: float = 0.0) -> None:
    """Grouped bars from `base`: one group per shape, one bar per method (a gap where a method has no value)."""
    width = 0.8 / max(len(series), 1)
    for i, (label, ys) in enumerate(series.items()):
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))],
               [v - base if _finite(v) else 0.0 for v in ys], width, bottom=base, label=label,
               color=_style(label, order)["color"])
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.margins(y=0.25)  # room for the legend above the bars


def _axes(ax: Any, title: str, xlabel: str, ylabel: str, *, logx: bool = False, logy: bool = False,
          ceiling: float | None = None, legend: bool = True) -> None:
    measured = ax.has_data()  # before the reference line, which is data too
    if ceiling is not None:
        ax.axhline(ceiling, color="grey", linestyle=":", linewidth=1)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if not measured:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    elif legend:
        ax.legend(fontsize=7, ncols=2 if ax.containers else 1)  # bar panels: a flat legend above the bars


def _pct(ceiling_us: float | None, us: float | None) -> float | None:
    """Share of the ceiling: the ceiling's time over the method's time, in %."""
    return 100 * ceiling_us / us if _finite(ceiling_us) and _finite(us) and us > 0 else None


def _before_after(title: str, labels: list[str], before: list[float], after: list[float],
                  names: tuple[str, str], peers: list[float | None] | None = None) -> Figure:
    """Horizontal bars of time relative to `before` (= 1): the tuned time and, where known, the best peer's."""
    if not labels:
        raise ValueError("no row with both times to chart")
    fig = Figure(figsize=(8, 1.2 + 0.55 * len(labels)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    series = {names[0]: [1.0] * len(labels), names[1]: [a / b for a, b in zip(after, before)]}
    if peers and any(_finite(p) for p in peers):
        series["best peer"] = [p / b if _finite(p) else math.nan for p, b in zip(peers, before)]
    height = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ys = [y - (i - (len(series) - 1) / 2) * height for y in range(len(labels))]
        ax.barh(ys, [v if _finite(v) else 0.0 for v in values], height, label=name, color=f"C{i}")
        if i == 1:
            for y, v, b, a in zip(ys, values, before, after):
                ax.text(v, y, f" {b / a:.3f}x ({a:.2f} us)", va="center", fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel(f"time relative to {names[0]} (lower is faster)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    return fig


# ---------------------------------------------------------------------------------------------
# One function per result file: the dict its benchmark writes -> a Figure.

QK_NORM_PEERS = {"quack": "quack", "liger": "liger", "torch_eager": "torch eager", "torch_compile": "torch.compile",
                 "rk_rmsnorm": "rosekernels.rmsnorm per head"}


def qk_norm(data: dict) -> Figure:
    """bench/qk_norm.py: per model, prefill % of the copy ceiling and decode latency against tokens."""
    rows = data["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = {"ours": OURS, **QK_NORM_PEERS}
    order = list(methods.values())
    fig, axes = _figure(f"qk_norm on {data['env'].get('gpu', '?')}", 2, len(models))
    for col, model in enumerate(models):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["tokens"])
        pre = [r for r in mine if "ours_us" in r]
        _lines(axes[0][col], [r["tokens"] for r in pre],
               {label: [_pct(r.get("copy_us"), r.get(f"{key}_us")) for r in pre] for key, label in methods.items()},
               order)
        _axes(axes[0][col], f"{model} prefill (a copy of the same bytes = 100%)", "tokens",
              "% of copy ceiling", logx=True, ceiling=100)
        dec = [r for r in mine if "ours_graph_us" in r]
        ax = axes[1][col]
        _lines(ax, [r["tokens"] for r in dec],
               {label: [r.get(f"{key}_graph_us") for r in dec] for key, label in methods.items()}, order)
        for key, label, style in (("copy_graph_us", "torch copy of the same bytes", "--"),
                                  ("empty_graph_us", "empty kernel", ":")):
            pts = [(r["tokens"], r[key]) for r in dec if _finite(r.get(key))]
            if pts:
                ax.plot(*zip(*pts), color="grey", linestyle=style, label=label)
        _axes(ax, f"{model} decode (in a CUDA graph)", "tokens", "us per call", logx=True)
    return fig


RMSNORM_PEERS = {"quack": "quack", "liger": "liger", "torch_eager": "torch eager", "torch_compile": "torch.compile"}


def rmsnorm(data: dict) -> Figure:
    """bench/rmsnorm.py: prefill % of the copy ceiling and decode latency per shape."""
    rows = data["rows"]
    methods = {"ours": OURS, **RMSNORM_PEERS}
    order = list(methods.values())
    fig, axes = _figure(f"rmsnorm on {data['env'].get('gpu', '?')}", 1, 2)

    def shape(r: dict) -> str:
        return f"{r['rows']} x {r['hidden']}" + (" +res" if r["residual"] else "")

    pre = [r for r in rows if "ours_us" in r]
    _bars(axes[0][0], [shape(r) for r in pre],
          {label: [_pct(r.get("copy_us"), r.get(f"{key}_us")) for r in pre] for key, label in methods.items()}, order)
    _axes(axes[0][0], "prefill (a copy of the same bytes = 100%)", "rows x hidden", "% of copy ceiling", ceiling=100)
    dec = [r for r in rows if "ours_graph_us" in r]
    _bars(axes[0][1], [shape(r) for r in dec],
          {label: [r.get(f"{key}_graph_us") for r in dec] for key, label in methods.items()}, order)
    _axes(axes[0][1], "decode (in a CUDA graph)", "rows x hidden", "us per call")
    return fig


def _moe_time(row: dict, name: str) -> float | None:
    # As bench/moe.py reports it: CUDA-graph time where measured (decode sizes), else eager.
    return row.get(f"{name}_graph_us", row.get(f"{name}_eager_us"))


def moe(data: dict) -> Figure:
    """bench/moe.py: dispatch and combine, % of the copy ceiling (prefill) and latency (decode) against tokens."""
    rows, copy_gbps = data["rows"], data["copy_gbps"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = {"rk": OURS, "torch": "torch eager", "compile": "torch.compile"}
    order = list(methods.values())
    fig, axes = _figure(f"MoE dispatch / combine on {data['env'].get('gpu', '?')}", 2, 2)
    for col, op in enumerate(("dispatch", "combine")):
        mode_key = "mode" if op == "dispatch" else "combine_mode"
        for i, model in enumerate(models):
            mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["tokens"])
            pre = [r for r in mine if r[mode_key] == "prefill"]
            dec = [r for r in mine if r[mode_key] == "decode"]
            style = LINESTYLES[i % len(LINESTYLES)]
            # The share of the copy ceiling of the bytes that must move: that copy's time over ours.
            pct = {label: [_pct(r[f"bytes_{op}"] / copy_gbps / 1e3, _moe_time(r, f"{key}_{op}")) for r in pre]
                   for key, label in methods.items()}
            _lines(axes[0][col], [r["tokens"] for r in pre], pct, order, linestyle=style, suffix=f" ({model})")
            _lines(axes[1][col], [r["tokens"] for r in dec],
                   {label: [_moe_time(r, f"{key}_{op}") for r in dec] for key, label in methods.items()},
                   order, linestyle=style, suffix=f" ({model})")
        _axes(axes[0][col], f"{op}, prefill (bytes that must move at copy speed = 100%)", "tokens",
              "% of copy ceiling", logx=True, ceiling=100)
        _axes(axes[1][col], f"{op}, decode (in a CUDA graph)", "tokens", "us per call", logx=True, logy=True)
    return fig


def gemm_leakyrelu(data: dict) -> Figure:
    """bench/gemm_leakyrelu.py: speedup over cuBLAS per prefill shape, and decode latency against M per weight
    shape."""
    results, meta = data["results"], data["meta"]
    ok = [[m for m in r["methods"] if _finite(m.get("ms"))] for r in results]
    order = list(dict.fromkeys(m["method"] for ms in ok for m in ms))
    pre = [(r, ms) for r, ms in zip(results, ok) if not r["decode"]]
    weights = list(dict.fromkeys((r["n"], r["k"]) for r in results if r["decode"]))
    fig = Figure(figsize=(max(len(weights), 1) * PANEL[0] * 1.2, 2 * PANEL[1] + 0.4), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"gemm_leakyrelu on {meta.get('device', '?')}")
    top, bottom = fig.subfigures(2, 1)
    ax = top.subplots()
    times = [{m["method"]: m["ms"] for m in ms} for _, ms in pre]
    ours = [next((m.get("tflops") for m in ms if m["method"] == OURS), None) for _, ms in pre]
    _bars(ax, [f"{r['m']}x{r['n']}x{r['k']}" + (f"\n{t:.0f} TFLOP/s" if _finite(t) else "") for (r, _), t in zip(pre, ours)],
          {method: [t["cublas"] / t[method] if "cublas" in t and method in t else None for t in times]
           for method in order if method != "cublas"}, order, base=1.0)
    _axes(ax, "prefill: speedup over cuBLAS alone (time of cuBLAS / time; M x N x K, our TFLOP/s)", "shape",
          "speedup over cuBLAS", ceiling=1.0)
    for ax, (n, k) in zip(bottom.subplots(1, max(len(weights), 1), squeeze=False)[0], weights):
        dec = sorted(((r, ms) for r, ms in zip(results, ok) if r["decode"] and (r["n"], r["k"]) == (n, k)),
                     key=lambda p: p[0]["m"])
        _lines(ax, [r["m"] for r, _ in dec],
               {method: [next((1e3 * m["ms"] for m in ms if m["method"] == method), None) for _, ms in dec]
                for method in order}, order)
        if _finite(meta.get("copy_gbs")):
            # The floor of a decode GEMM: its 2-byte weights read once at the copy rate.
            ax.axhline(2 * n * k / meta["copy_gbs"] / 1e3, color="grey", linestyle="--", linewidth=1,
                       label="weights at copy speed")
        _axes(ax, f"decode, weights N={n} x K={k} (in a CUDA graph)", "M (tokens)", "us per call", logx=True)
    return fig


ATTENTION_METHODS = {"rosekernels": OURS, "sdpa_cudnn": "cuDNN (sdpa)", "fa4": "FA4", "sdpa_flash": "sdpa flash",
                     "sdpa_efficient": "sdpa efficient"}


def attention(data: dict) -> Figure:
    """bench/attention.py: prefill % of the bf16 GEMM ceiling against sequence length, per head shape, and
    decode latency against KV length, per batch and head shape."""
    ceiling, copy_gbps = data["ceilings"]["bf16_gemm_8192_TFLOPs"], data["ceilings"]["copy_GBps"]
    order = list(ATTENTION_METHODS.values())
    fig = Figure(figsize=(4 * PANEL[0], 3 * PANEL[1] + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"attention on {data.get('device', '?')}")
    top, bottom = fig.subfigures(2, 1, height_ratios=[1, 2])
    heads = list(dict.fromkeys((r["hq"], r["hkv"], r["d"]) for r in data["prefill"]))
    for ax, (hq, hkv, d) in zip(top.subplots(1, max(len(heads), 1), squeeze=False)[0], heads):
        for causal, style in ((False, "-"), (True, "--")):
            rows = sorted((r for r in data["prefill"] if (r["hq"], r["hkv"], r["d"], r["causal"]) == (hq, hkv, d, causal)),
                          key=lambda r: r["s"])
            _lines(ax, [r["s"] for r in rows],
                   {label: [_pct(r.get(f"{key}_TFLOPs"), ceiling) for r in rows] for key, label in ATTENTION_METHODS.items()},
                   order, linestyle=style, suffix=" causal" if causal else "")
        _axes(ax, f"prefill Hq/Hkv {hq}/{hkv}, d {d} (B*S = const)", "sequence length",
              "% of bf16 GEMM ceiling", logx=True, legend=(hq, hkv, d) == heads[0])
    groups = list(dict.fromkeys((r["b"], r["hq"], r["hkv"], r["d"]) for r in data["decode"] if r["s_q"] == 1))
    cols = min(3, max(len(groups), 1))
    panels = bottom.subplots(max(math.ceil(len(groups) / cols), 1), cols, squeeze=False).ravel()
    for ax, (b, hq, hkv, d) in zip(panels, groups):
        rows = sorted((r for r in data["decode"] if r["s_q"] == 1 and (r["b"], r["hq"], r["hkv"], r["d"]) == (b, hq, hkv, d)),
                      key=lambda r: r["s_kv"])
        x = [r["s_kv"] for r in rows]
        _lines(ax, x, {label: [r.get(f"{key}_us") for r in rows] for key, label in ATTENTION_METHODS.items()}, order)
        # The floor: K and V (2-byte elements) read once at the copy rate.
        ax.plot(x, [2 * 2 * b * s * hkv * d / copy_gbps / 1e3 for s in x], color="grey", linestyle="--",
                linewidth=1, label="K+V at copy speed")
        _axes(ax, f"decode B={b}, Hq/Hkv {hq}/{hkv}, d {d}, S_q=1", "KV length (tokens)", "us per call",
              logx=True, logy=True, legend=(b, hq, hkv, d) == groups[0])
    for ax in panels[len(groups):]:
        ax.set_axis_off()
    return fig


def _shape_label(shape: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items() if isinstance(v, int) and not isinstance(v, bool))


def autotune(data: dict) -> Figure:
    """bench/autotune.py: the heuristic's config against the tuned one (and the best peer) per shape."""
    rows = [r for r in data["results"] if _finite(r.get("heuristic_us")) and _finite(r.get("tuned_us"))]
    return _before_after(
        f"sip-tune level 1 (configuration search) on {data['meta'].get('gpu', '?')}",
        [f"{r['kernel']} {r['mode']} {_shape_label(r['shape'])}" for r in rows],
        [r["heuristic_us"] for r in rows], [r["tuned_us"] for r in rows], ("heuristic", "tuned"),
        [(r.get("peers_us") or {}).get(r.get("best_peer")) for r in rows])


def sip_tuning(data: dict) -> Figure:
    """bench/sip_tuning.py: each kernel's original cubin against its SASS-tuned one."""
    rows = [r for r in data["rows"] if _finite(r.get("original_us")) and _finite(r.get("tuned_us"))]
    return _before_after(f"SIP (SASS schedule) tuning on {data['meta'].get('gpu', '?')}",
                         [f"{r['kernel']} {r['mode']}" + (f" {r['moves']}" if r.get("moves") else "") for r in rows],
                         [r["original_us"] for r in rows],
                         [r["tuned_us"] for r in rows], ("original", "SIP-tuned"))


def e2e(data: dict) -> Figure:
    """bench/e2e.py: per model, rosekernels' tokens/s over the faster stock arm, for each prefill and decode
    row (bars from 1: above it faster than stock, below slower; a row without a speedup is left empty)."""
    results = data["results"]
    if not results:
        raise ValueError("no model in the result")
    fig, axes = _figure(f"transformers, stock vs rosekernels.hf.apply, on {data['env'].get('gpu', '?')}",
                        1, len(results))
    for ax, (name, r) in zip(axes[0], results.items()):
        labels = [f"prefill B{p['batch']} S{p['seqlen'] // 1024}k" for p in r["prefill"]]
        labels += [f"decode {d['mode']} B{d['batch']}" for d in r["decode"]]
        speedups = [p.get("speedup") for p in r["prefill"]] + [d.get("speedup") for d in r["decode"]]
        _bars(ax, labels, {OURS: [v if _finite(v) else math.nan for v in speedups]}, [OURS], base=1.0)
        for i, v in enumerate(speedups):
            if _finite(v):
                ax.text(i, v, f"{v:.2f}x", ha="center", va="bottom" if v >= 1 else "top", fontsize=7)
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.tick_params(axis="x", labelrotation=60)
        _axes(ax, f"{name} ({r.get('layers', '?')} layers)", "", "speedup over stock (tokens/s)", ceiling=1.0,
              legend=False)
    return fig


MOE_EXPERTS_ARMS = ("rosekernels", "rk+grouped_mm", "stock", "quack", "cublas loop")


def moe_experts(data: dict) -> Figure:
    """bench/moe_experts.py: per geometry, decode latency against tokens (the active experts' weights at
    copy speed as the floor line) and prefill TFLOP/s per arm (the dense GEMM pair's as the ceiling)."""
    rows = data["rows"]
    geometries = list(dict.fromkeys(r["geometry"] for r in rows))
    if not geometries:
        raise ValueError("no row to chart")
    order = list(MOE_EXPERTS_ARMS)
    fig, axes = _figure(f"MoE experts block on {data['env'].get('gpu', '?')}", 2, len(geometries))
    for col, name in enumerate(geometries):
        dec = sorted((r for r in rows if r["geometry"] == name and r["mode"] == "decode"), key=lambda r: r["tokens"])
        pre = sorted((r for r in rows if r["geometry"] == name and r["mode"] == "prefill"), key=lambda r: r["tokens"])
        ax = axes[0][col]
        _lines(ax, [r["tokens"] for r in dec], {arm: [r["times_us"].get(arm) for r in dec] for arm in order}, order)
        if dec:
            ax.plot([r["tokens"] for r in dec], [r["weight_bytes"] / data["copy_gbps"] / 1e3 for r in dec],
                    color="grey", linestyle="--", linewidth=1, label="active weights at copy speed")
        _axes(ax, f"{name}: decode (CUDA graphs)", "tokens", "us per call", logx=True, logy=True)
        ax = axes[1][col]
        _bars(ax, [str(r["tokens"]) for r in pre],
              {arm: [r["flops"] / r["times_us"][arm] / 1e6 if _finite(r["times_us"].get(arm)) else None for r in pre]
               for arm in order}, order)
        dense = [r["flops"] / r["dense_us"] / 1e6 for r in pre if _finite(r.get("dense_us"))]
        _axes(ax, f"{name}: prefill (dense GEMM pair: dotted)", "tokens", "TFLOP/s",
              ceiling=max(dense) if dense else None)
    return fig


def fp8(data: dict) -> Figure:
    """bench/fp8.py: decode GEMMs (the FP8 methods' speedup over our bf16 GEMM, geometric mean over the weight
    shapes, and their weight bandwidth as % of copy, median) against M; prefill TFLOP/s per shape; decode
    attention's e4m3 cache over the bf16 one against context."""
    fig, axes = _figure(f"FP8 on {data['env'].get('gpu', '?')}", 2, 2)
    dec, pre, kv = data.get("decode", []), data.get("prefill", []), data.get("kv", [])
    order = list(dict.fromkeys(m for r in dec + pre for m in r["times_us"]))
    ms = sorted({r["m"] for r in dec})

    def over(m: int, fn: Callable[[dict], Any], reduce: Callable[[list], float]) -> float | None:
        vals = [v for r in dec if r["m"] == m and _finite(v := fn(r))]
        return reduce(vals) if vals else None

    def geomean(vals: list) -> float:
        return math.exp(sum(math.log(v) for v in vals) / len(vals))

    def median(vals: list) -> float:
        return sorted(vals)[len(vals) // 2]

    fp8_methods = [m for m in order if m != "rosekernels bf16"]
    _lines(axes[0][0], ms, {m: [over(x, lambda r, m=m: r["times_us"].get("rosekernels bf16", math.nan)
                                     / r["times_us"].get(m, math.nan), geomean) for x in ms] for m in fp8_methods},
           order)
    _axes(axes[0][0], "decode GEMMs: speedup over our bf16 GEMM (geomean)", "M (tokens)", "x bf16", logx=True,
          ceiling=1.0)
    _lines(axes[0][1], ms, {m: [over(x, lambda r, m=m: r["summary"]["pct_copy"].get(m), median) for x in ms]
                            for m in fp8_methods}, order)
    _axes(axes[0][1], "decode GEMMs: weight bytes at % of copy (median)", "M (tokens)", "% of copy", logx=True,
          ceiling=100)
    _bars(axes[1][0], [f"{r['m']}x{r['n']}x{r['k']}" for r in pre],
          {m: [r["tflops"].get(m) for r in pre] for m in order}, order)
    _axes(axes[1][0], "prefill GEMMs", "shape", "TFLOP/s")
    # one line per (lengths, query dtype): the e4m3 cache over a cache of the query's dtype
    contexts = sorted({r["context"] for r in kv})
    speedups: dict[str, dict[int, float]] = {}
    for r in kv:
        query, t = r.get("query", "bf16"), r["times_us"]
        line = speedups.setdefault(f"{r.get('lengths', 'full')} lengths, {query} query", {})
        line[r["context"]] = t.get(f"{query} cache", math.nan) / t.get("e4m3 cache", math.nan)
    _lines(axes[1][1], contexts, {name: [line.get(c, math.nan) for c in contexts] for name, line in speedups.items()},
           list(speedups))
    _axes(axes[1][1], "decode attention: speedup of the e4m3 KV cache", "context", "x the query dtype's cache",
          logx=True, ceiling=1.0)
    return fig


CHARTS: dict[str, Callable[[dict], Figure]] = {
    "qk_norm": qk_norm, "rmsnorm": rmsnorm, "moe": moe, "gemm_leakyrelu": gemm_leakyrelu, "attention": attention,
    "autotune": autotune, "sip_tuning": sip_tuning, "e2e": e2e, "moe_experts": moe_experts,
    "fp8": fp8}


def draw(name: str, data: dict, out: str | Path) -> Path | None:
    """<out>/<name>.png from the result dict of benchmark `name`; None when `name` has no chart."""
    chart = CHARTS.get(name)
    if chart is None:
        return None
    fig = chart(data)  # built fully before anything is written: bad data leaves no file behind
    path = Path(out) / f"{name}.png"
    # Committed charts travel to the GPU host with the tree: 256 colours (lines, text and their
    # antialiasing need no more; no dithering, so flat areas stay flat) in the smallest zlib
    # encoding: at 120 dpi 1.6-1.9x fewer bytes than RGB at 90.
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    buffer.seek(0)
    Image.open(buffer).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT,
                                               dither=Image.Dither.NONE).save(path, optimize=True)
    return path


def results(folder: Path) -> list[tuple[str, Path]]:
    """(NAME, file) for each charted result in `folder` or below it (bench/results keeps one folder per
    family): NAME.json, or NAME.json.gz where no NAME.json is beside it (committed results are kept small)."""
    found: dict[tuple[str, Path], Path] = {}
    for path in sorted(folder.rglob("*.json*")):  # sorted: NAME.json before NAME.json.gz
        name = path.name.removesuffix(".gz").removesuffix(".json")
        if name in CHARTS:
            found.setdefault((name, path.parent), path)
    return [(name, path) for (name, _), path in found.items()]


def load(path: Path) -> Any:
    """A result file's data, gzipped or not."""
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="a folder of NAME.json (or NAME.json.gz) results, at any depth, e.g. bench/results")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        p.error(f"{folder} is not a folder")
    found = results(folder)
    if not found:
        p.error(f"{folder} holds none of " + ", ".join(f"{name}.json" for name in CHARTS))
    failed = 0
    for name, path in found:
        try:
            print(draw(name, load(path), path.parent))
        except Exception as e:  # noqa: BLE001 - one bad file does not stop the others
            failed += 1
            print(f"{path}: no chart ({type(e).__name__}: {e})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
