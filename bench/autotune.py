"""Level 1 of sip-tune (configuration search) over a list of shapes per kernel: what tuning pays over
each kernel's heuristic, next to the A/A spread and, where the bench has them, the best peer.

    python bench/autotune.py --out bench/results                      # the standard shapes
    python bench/autotune.py --shape gemm_leakyrelu:decode:m=8,n=4096,k=4096 --shape qk_norm:decode:tokens=1
    python bench/autotune.py --plan                                   # the search spaces only (no GPU)

Each shape runs `sip_tune.configs.tune_configs` (compile in parallel, test and time in the
crash-isolated worker, re-time the fastest in a fresh one, verify a winner at its bucket's edges and
through the public op in a fresh process); the heuristic and tuned times and the speedup are the op
level's (`sip_tune.oplevel`: the public op, CUDA graphs over inputs rotated past L2, its own A/A
spread and best peer) where a winner was verified there, else the worker's re-time. Peers (GEMM:
cuBLAS + leaky_relu and cuBLAS alone) are timed
in this process in CUDA graphs over input sets rotated past L2. Winners go into the tuned store at
--store-root (default: a temporary directory, so that a benchmark run changes no installed entry).
Writes autotune.json and autotune.md into --out's gemm/.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import report  # noqa: E402  (bench/report.py, beside this script)
from sip_tune import configs  # noqa: E402
from sip_tune.cli import parse_shape  # noqa: E402

# (kernel, mode, shape overrides): decode and prefill sizes of Llama-3-8B / Qwen3-8B layers.
SHAPES = [
    ("gemm_leakyrelu", "decode", {"m": 1, "n": 14336, "k": 4096}),
    ("gemm_leakyrelu", "decode", {"m": 8, "n": 4096, "k": 4096}),
    ("gemm_leakyrelu", "decode", {"m": 16, "n": 4096, "k": 14336}),
    ("gemm_leakyrelu", "decode", {"m": 128, "n": 14336, "k": 4096}),
    ("gemm_leakyrelu", "prefill", {"m": 1024, "n": 14336, "k": 4096}),
    ("gemm_leakyrelu", "prefill", {"m": 4096, "n": 4096, "k": 4096}),
    ("qk_norm", "decode", {"tokens": 1}),
    ("qk_norm", "prefill", {"tokens": 4096}),
    ("rmsnorm", "prefill", {"rows": 4096}),
    ("attention_decode", "decode", {"batch": 16, "seqlen_kv": 4096}),
    ("attention_decode", "decode", {"batch": 1, "seqlen_kv": 32768}),
]


def parse_spec(text: str) -> tuple[str, str, dict[str, Any]]:
    """'kernel:mode:k=v,...' (the shape part as sip-tune --shape takes it) -> (kernel, mode, overrides)."""
    parts = text.split(":", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ValueError(f"bad --shape {text!r}: expected KERNEL:MODE[:K=V,...]")
    return parts[0], parts[1], parse_shape(parts[2] if len(parts) == 3 else "")


def _gemm_peers(shape: Any, result: configs.ConfigReport) -> dict[str, float]:
    """Microseconds per call of cuBLAS + leaky_relu and of cuBLAS alone at `shape` (interleaved,
    CUDA graphs over input sets past L2)."""
    import torch
    import torch.nn.functional as F

    import timing  # bench/timing.py

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[shape.dtype]
    m, n, k = shape.m, shape.n, shape.k
    count = timing.input_sets((m * k + n * k + m * n) * 2, least=1, most=8)
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = []
    for _ in range(count):
        a = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
        b = torch.randn(n, device="cuda", generator=g).to(dtype) if shape.bias != "none" else None
        sets.append((a, w, b, torch.empty(m, n, device="cuda", dtype=dtype)))

    def cublas_act(i):
        a, w, b, _ = sets[i % len(sets)]
        F.leaky_relu(F.linear(a, w, b), shape.slope, inplace=True)

    def cublas(i):
        a, w, b, out = sets[i % len(sets)]
        torch.mm(a, w.t(), out=out) if b is None else torch.addmm(b, a, w.t(), out=out)

    calls = max(20, 200 // len(sets) * len(sets))
    return timing.interleaved_graph_time_us({"cublas+leaky_relu": cublas_act, "cublas": cublas}, calls, rounds=15)


def _attention_peers(shape: Any, result: configs.ConfigReport) -> dict[str, float]:
    """Microseconds per call of FA4 and cuDNN (SDPA) at `shape`, interleaved (CUDA graphs over input
    sets past L2) with our heuristic's and the winner's kernels, so that ours vs the peers is one
    run's ratio (the tuner's worker times ours in another process)."""
    import math

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import timing  # bench/timing.py
    from rosekernels.kernels import attention as A

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[shape.dtype]
    b, s, hq, hkv, d, causal = shape.batch, shape.seqlen, shape.heads_q, shape.heads_kv, shape.head_dim, shape.causal
    count = timing.input_sets(2 * b * s * (2 * hq + 2 * hkv) * d, least=1, most=8)
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = [tuple(torch.randn(b, s, h, d, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv))
            for _ in range(count)]
    out = torch.empty(b, s, hq, d, device="cuda", dtype=dtype)
    lse = torch.empty(b, hq, s, device="cuda")

    def ours(config):
        cfg = A.AttentionConfig(**config)
        fn, launch = A.compile(cfg).fn, A.launch_args(cfg, out)
        return lambda i: fn(*sets[i % count], out, lse, A.LOG2_E / math.sqrt(d), *launch, *A.NOT_VARLEN)

    def cudnn(i):
        q, k, v = (t.transpose(1, 2) for t in sets[i % count])
        if not gqa:  # this backend has no GQA here: expanded K/V (then part of its cost)
            k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa and hq != hkv)

    gqa = True
    try:
        cudnn(0)
    except RuntimeError:
        gqa = False

    steps = {"ours: heuristic": ours(result.heuristic), "cudnn": cudnn}
    if result.winner:
        steps["ours: tuned"] = ours(result.winner)
    try:
        from flash_attn.cute.interface import flash_attn_func
    except ImportError:
        pass
    else:
        steps["fa4"] = lambda i: flash_attn_func(*sets[i % count], causal=causal)
    seconds = 4 * b * hq * s * s * d / (2 if causal else 1) / 600e12
    errors: dict[str, str] = {}
    times = timing.interleaved_graph_time_us(steps, calls=max(1, min(50, int(20e-3 / seconds))), rounds=9,
                                             errors=errors)
    for name, e in errors.items():
        print(f"  peer {name}: {e}", flush=True)
    return times


PEERS = {"gemm_leakyrelu": _gemm_peers, "attention": _attention_peers}
OURS = "ours: "  # peers' keys that time our own kernels in the peers' run


def _row(report: configs.ConfigReport, peers: dict[str, float], errors: list[str]) -> dict[str, Any]:
    others = {k: v for k, v in peers.items() if not k.startswith(OURS)}
    best_peer = min(others.items(), key=lambda kv: kv[1]) if others else None
    # ours against the peer from the peers' own run where it timed ours, else from the tuner's re-time
    ours_us = peers.get(OURS + ("tuned" if report.winner else "heuristic"), report.tuned_us)
    op = report.op_level
    return {
        "kernel": report.kernel, "mode": report.mode, "shape": report.shape,
        "heuristic_us": report.heuristic_us, "tuned_us": report.tuned_us, "speedup": report.speedup,
        "aa_spread": op["aa_spread"] if op.get("speedup") else
        max(report.aa_spread, report.retime_aa_spread) if report.finalists else report.aa_spread,
        "op_level": op or None,
        "winner": report.winner_key or None, "outcome": report.outcome,
        "searched": len(report.candidates), "candidates": report.total, "pruned_by": report.ranked_by,
        "statuses": dict(collections.Counter(r["status"] for r in report.candidates)),
        "shares": report.shares, "seconds": report.seconds.get("total"),
        "peers_us": peers, "best_peer": best_peer[0] if best_peer else None,
        "tuned_vs_best_peer": best_peer[1] / ours_us if best_peer else None,
        "errors": errors,
    }


def _shape_text(shape: dict, keys: dict) -> str:
    return ",".join(f"{k}={shape[k]}" for k in keys) or "defaults"


def _markdown(rows: list[dict], specs: list, env: dict) -> str:

    lines = [f"# sip-tune level 1 (configuration search) on {env.get('gpu')}", "",
             "Heuristic and tuned: per call of the public op, re-timed in a fresh process (sip_tune.oplevel: "
             "CUDA graphs over inputs rotated past L2) where a winner was verified there; else per launch in the "
             "worker's final re-time. A/A: how far the heuristic measured from itself in that same run; a winner "
             "must beat max(1.01, 1 + A/A) in the worker and at the op level. Shares: of each shape's wall time.",
             "",
             "| kernel | mode | shape | heuristic us | tuned us | speedup | A/A | searched / all | best peer us | "
             "tuned vs peer | compile / test / time | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row, (_, _, keys) in zip(rows, specs):
        if "error" in row:
            lines.append(f"| {row['kernel']} | {row['mode']} | {_shape_text(row.get('shape', {}), keys)} | "
                         f"failed: {row['error']} |||||||||")
            continue
        sh = row["shares"]
        peer = f"{row['peers_us'][row['best_peer']]:.2f} ({row['best_peer']})" if row["best_peer"] else "-"
        lines.append(
            f"| {row['kernel']} | {row['mode']} | {_shape_text(row['shape'], keys)} | "
            f"{report.fmt(row['heuristic_us'], 2)} | {report.fmt(row['tuned_us'], 2)} | {row['speedup']:.3f} | {row['aa_spread']:.4f} | "
            f"{row['searched']} / {row['candidates']} | {peer} | {report.fmt(row['tuned_vs_best_peer'], 3)} | "
            f"{sh['compile']:.0%} / {sh['test']:.0%} / {sh['time']:.0%} | {row['seconds']:.0f} |")
    lines += ["", "Winners:"] + [f"- {r['kernel']} {r['mode']} {_shape_text(r['shape'], k)}: {r['outcome']}"
                                 for r, (_, _, k) in zip(rows, specs) if "error" not in r]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_out(p)
    p.add_argument("--shape", action="append", metavar="KERNEL:MODE[:K=V,...]",
                   help="a shape to tune (repeatable; default: the standard list)")
    p.add_argument("--max-candidates", type=int, default=configs.MAX_CANDIDATES)
    p.add_argument("--samples", type=int, default=8, help="input sets each candidate is tested on")
    p.add_argument("--store-root", "--cache",
                   help="tuned store the winners go into (default: a temporary directory); --cache: its former name")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--plan", action="store_true", help="print each shape's search space and exit (no GPU)")
    args = p.parse_args(argv)
    try:  # every shape resolved before any GPU work: a bad key is a one-line usage error
        specs = [parse_spec(s) for s in args.shape] if args.shape else SHAPES
        spaces = [configs.plan(kernel, mode, keys, args.max_candidates) for kernel, mode, keys in specs]
    except (ValueError, LookupError, TypeError) as e:
        p.error(str(e))
    if args.plan:
        for (kernel, mode, keys), space in zip(specs, spaces):
            print(f"{kernel} {mode} {_shape_text(dataclasses.asdict(space.shape), keys)}: {space.lines()[-1]}")
        return 0
    report.require_gpu()
    store_root = args.store_root or tempfile.mkdtemp(prefix="autotune-store-")
    env = report.environment()
    rows = []
    t0 = time.time()
    for kernel, mode, keys in specs:
        print(f"{kernel} {mode} {keys} ...", flush=True)
        errors: list[str] = []
        result = report.measure(f"{kernel} {mode} {keys}", lambda: configs.tune_configs(
            kernel, mode, keys, max_candidates=args.max_candidates, samples=args.samples, store_root=store_root),
            errors)
        if result is None:
            rows.append({"kernel": kernel, "mode": mode, "shape": keys, "error": errors[-1]})
            continue
        print(result.text(), flush=True)
        peers = {}
        if kernel in PEERS and not args.no_peers:
            shape = configs.plan(kernel, mode, keys, 0).shape
            peers = report.measure(f"peers of {kernel}", lambda: PEERS[kernel](shape, result), errors) or {}
        rows.append(_row(result, peers, errors))
    meta = dict(env, store=store_root, max_candidates=args.max_candidates, samples=args.samples,
                seconds=time.time() - t0)
    where = report.write(args.out, "autotune", {"meta": meta, "results": rows}, _markdown(rows, specs, env))
    print(f"wrote {where}/autotune.json and .md in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
