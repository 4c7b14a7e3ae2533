"""Benchmark the fused attention forward against torch SDPA (flash, cuDNN, efficient) and flash-attn-4.

    python bench/attention.py --out bench/results            # full prefill table (+ decode-shaped rows)
    python bench/attention.py --quick                        # the reference shape + one decode row
    python bench/attention.py --decode-only                  # the decode table only (< 1 min)
    python bench/attention.py --decode-only --split-sweep    # + our kernel over forced KV split counts
    python bench/attention.py --sweep                        # candidate configs on the prefill problem shapes
    python bench/attention.py --sweep --grid --where b=1,s=1024   # ... on rows of the parity grid
    python bench/attention.py --kvcache                      # decode over a KV cache: contiguous and paged
    python bench/attention.py --varlen                       # packed sequences against the dense kernel and FA4
    python bench/attention.py --grid                         # dense prefill on B {1,8,32} x S 1k-32k vs FA4, cuDNN

TFLOP/s = 4 * B * Hq * S_q * S_kv * d / time, halved when causal. Each timing: warm-up, then one CUDA
event pair per launch, median; the inputs rotate over enough copies to exceed the 50 MB L2. Every
implementation's output is compared with ours (max |diff|), so a fast wrong kernel shows. Decode-shaped
rows (S_q = 1) are timed inside a CUDA graph. Results: <out>/attention/attention.json and .md.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import report  # noqa: E402
import timing  # noqa: E402
import flashinfer_peer  # noqa: E402
import rosekernels  # noqa: E402
from rosekernels.kernels import attention as A  # noqa: E402
from rosekernels.kernels import attention_decode as D  # noqa: E402

REFERENCE = dict(b=2, s=8192, hq=32, hkv=8, d=128, causal=False)  # FA4 752, cuDNN 693, SDPA flash 341


def prefill_shapes():
    for d in (128, 64):
        for hq, hkv in ((32, 8), (16, 16)):
            for causal in (False, True):
                for b, s in ((16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)):
                    yield dict(b=b, s=s, hq=hq, hkv=hkv, d=d, causal=causal)


def grid_shapes():
    """Issue 19's parity grid: B in {1, 8, 32} x S in 1k..32k, d 64/128, causal and not (Hq/Hkv 32/8)."""
    for d in (64, 128):
        for causal in (False, True):
            for b in (1, 8, 32):
                for s in (1024, 2048, 4096, 8192, 16384, 32768):
                    yield dict(b=b, s=s, hq=32, hkv=8, d=d, causal=causal)


def tflops(shape, s_q, s_k, ms):
    flops = 4 * shape["b"] * shape["hq"] * s_q * s_k * shape["d"] / (2 if shape["causal"] else 1)
    return flops / ms / 1e9


def prefill_graph_us(steps, shape, n_sets, rounds, errors):
    """{name: device us per call}: each step(i) (i cycling over n_sets input sets) captured ~20 ms
    worth of calls at 600 TFLOP/s in a CUDA graph of its own, replays interleaved; `errors` gets the
    steps that could not be captured."""
    seconds = tflops(shape, shape["s"], shape["s"], 1.0) * 1e9 / 600e12
    steps = {name: (lambda i, step=step: step(i % n_sets)) for name, step in steps.items()}
    return timing.interleaved_graph_time_us(steps, calls=max(1, min(50, int(20e-3 / seconds))), rounds=rounds,
                                            errors=errors)


def interleaved_ms(runs, n_sets, iters):
    """{name: median per-launch device ms}, every run(i) launched once per round (timing.interleaved_time_us)."""
    steps = {name: (lambda i, run=run: run(i % n_sets)) for name, run in runs.items()}
    return {name: us / 1e3 for name, us in timing.interleaved_time_us(steps, 1, rounds=iters).items()}


def ceilings():
    """Measured in this run: device copy bandwidth (read + write) and a dense bf16 GEMM."""
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_us = timing.event_time_us(lambda _: m @ m, 10, reps=3)
    return {"copy_GBps": timing.copy_gbs(1 << 28), "bf16_gemm_8192_TFLOPs": 2 * 8192**3 / gemm_us / 1e6}


def make_sets(shape, s_q, s_k, dtype=torch.bfloat16):
    """Enough input copies to exceed the L2 cache; each is (q, k, v, out)."""
    b, hq, hkv, d = shape["b"], shape["hq"], shape["hkv"], shape["d"]
    per_set = 2 * (2 * b * s_q * hq * d + 2 * b * s_k * hkv * d)
    count = timing.input_sets(per_set)
    sets = []
    for _ in range(count):
        q = torch.randn(b, s_q, hq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, s_k, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn(b, s_k, hkv, d, device="cuda", dtype=dtype)
        sets.append((q, k, v, torch.empty_like(q)))
    return sets


class Peers:
    """The implementations compared, each fn(q, k, v, causal) -> out [B, S, H, d]; missing ones are recorded."""

    def __init__(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.impls = {}
        self.unavailable = []  # "name: unavailable (why)"
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
            self.impls[name] = self._sdpa(sdpa_kernel, backend)
        fa4 = report.try_peer("fa4", self._fa4, self.unavailable)
        if fa4 is not None:
            self.impls["fa4"] = fa4

    @staticmethod
    def _fa4():
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
        from flash_attn.cute.interface import flash_attn_func

        return lambda q, k, v, causal: _first(flash_attn_func(q, k, v, causal=causal))

    @staticmethod
    def _sdpa(sdpa_kernel, backend):
        import torch.nn.functional as F

        def run(q, k, v, causal):
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel(backend):
                try:
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=k.shape[2] != q.shape[2])
                except RuntimeError:
                    if k.shape[2] == q.shape[2]:
                        raise
                    # This backend has no GQA: give it expanded K/V (its cost is then partly the expansion).
                    r = q.shape[2] // k.shape[2]
                    kt, vt = (t.repeat_interleave(r, dim=1) for t in (kt, vt))
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            return o.transpose(1, 2)

        return run


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def bench_shape(shape, peers, s_q=None, iters=10, graphs=False):
    """One prefill row: every implementation's output against ours, then their times, interleaved:
    eager launches between CUDA events, or (`graphs`) each method's calls in a CUDA graph of its own
    (device time only: short launches are otherwise timed with their host path)."""
    s_q = shape["s"] if s_q is None else s_q
    s_k = shape["s"]
    sets = make_sets(shape, s_q, s_k)
    row = dict(shape, s_q=s_q, s_kv=s_k)
    ours = lambda i: rosekernels.attention(*sets[i][:3], causal=shape["causal"], out=sets[i][3])  # noqa: E731
    ours(0)
    torch.cuda.synchronize()
    ref = sets[0][3].clone()
    impls = {"rosekernels": None, **peers.impls}
    ready = {}
    for name, fn in impls.items():
        try:
            run = ours if fn is None else (lambda i, fn=fn: fn(*sets[i][:3], shape["causal"]))
            if fn is not None:
                diff = (run(0).float() - ref.float()).abs().max().item()
                row[f"{name}_maxdiff"] = diff
            if s_q == 1:
                ms = graph_ms(lambda i: run(0), 1)
                row[f"{name}_ms"] = ms
                row[f"{name}_TFLOPs"] = tflops(shape, s_q, s_k, ms)
            else:
                ready[name] = run  # timed below, interleaved with the others
        except Exception as e:  # noqa: BLE001 - a backend refusing a shape is a result, not a crash
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    if ready and graphs:
        errors = {}
        times = prefill_graph_us(ready, shape, len(sets), iters, errors)  # the grid: s_q = s_kv = s
        row.update({f"{name}_error": e for name, e in errors.items()})
        ready = {}
        for name, us in times.items():
            row[f"{name}_ms"] = us / 1e3
            row[f"{name}_TFLOPs"] = tflops(shape, s_q, s_k, us / 1e3)
    if ready:
        for name, ms in interleaved_ms(ready, len(sets), iters).items():
            row[f"{name}_ms"] = ms
            row[f"{name}_TFLOPs"] = tflops(shape, s_q, s_k, ms)
    for peer in ("sdpa_cudnn", "sdpa_flash", "fa4"):
        if f"{peer}_ms" in row and "rosekernels_ms" in row:
            row[f"vs_{peer}"] = row[f"{peer}_ms"] / row["rosekernels_ms"]
    del sets
    torch.cuda.empty_cache()
    return row


# The prefill shapes behind issue #7 (short and causal ones) plus two long ones as a check.
SWEEP_SHAPES = [
    *(dict(b=16, s=1024, hq=hq, hkv=hkv, d=d, causal=c)
      for d in (128, 64) for hq, hkv in ((32, 8), (16, 16)) for c in (False, True)),
    dict(b=8, s=2048, hq=16, hkv=16, d=64, causal=True),
    dict(b=8, s=2048, hq=32, hkv=8, d=128, causal=True),
    REFERENCE,
    dict(REFERENCE, causal=True),
]


def sweep_candidates(d, causal):
    """The default config, the same kernel launched one CTA per tile, and other tile shapes; O
    stored from registers (direct_o) at the default tiles and, d=128, with the key tiles only it fits."""
    base = A.default_config(d, "bf16", causal)
    cands = [base, dataclasses.replace(base, persistent=False), dataclasses.replace(base, direct_o=True)]
    if d == 128:
        cands += [dataclasses.replace(base, tile_n=n) for n in (112, 144)]
        cands += [dataclasses.replace(base, overlap=False)]
        cands += [dataclasses.replace(base, tile_n=n, direct_o=True) for n in (144, 160, 176, 192)]
    else:
        cands += [A.AttentionConfig(64, "bf16", causal, tile_m=m, tile_n=n, num_stages=st)
                  for m, n, st in ((192, 128, 2), (192, 112, 3), (128, 128, 3), (128, 176, 3))]
    return list(dict.fromkeys(cands))


def sweep(shapes, iters, peers):
    """Time candidate configs of our kernel (compiled directly, the launch's counter reused: the
    kernel re-zeroes it) next to cuDNN and FA4 on the given shapes, each in CUDA graphs of its own
    replayed interleaved (device time: FA4's host path would dominate the short shapes)."""
    A.precompile([c for shape in shapes for c in sweep_candidates(shape["d"], shape["causal"])])
    rows = []
    for shape in shapes:
        d, causal = shape["d"], shape["causal"]
        sets = make_sets(shape, shape["s"], shape["s"])
        ref = rosekernels.attention(*sets[0][:3], causal=causal)
        row = dict(shape, configs={})
        fns, peer_fns = {}, {}
        for name in ("sdpa_cudnn", "fa4"):
            if name in peers.impls:
                fn = lambda i, fn=peers.impls[name]: fn(*sets[i][:3], causal)  # noqa: E731
                try:
                    fn(0)
                    peer_fns[name] = fns[name] = fn
                except Exception as e:  # noqa: BLE001 - a backend refusing a shape is a result
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        launches = {}
        for cfg in sweep_candidates(d, causal):
            kernel = A.compile(cfg)
            scale_log2 = A.LOG2_E / math.sqrt(d)
            q0 = sets[0][0]
            launch = A.launch_args(cfg, q0)
            lse = torch.empty(q0.shape[0], q0.shape[2], q0.shape[1], device="cuda")

            def run(i, kernel=kernel, launch=launch, lse=lse):
                q, k, v, out = sets[i]
                kernel.fn(q, k, v, out, lse, scale_log2, *launch, *A.NOT_VARLEN)
                return out

            name = _config_name(cfg)
            try:
                diff = (run(0).float() - ref.float()).abs().max().item()
                fns[name] = run
                launches[name] = (diff, launch[1])
            except Exception as e:  # noqa: BLE001
                row["configs"][name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        timed = prefill_graph_us(fns, shape, len(sets), iters, row.setdefault("graph_errors", {}))
        for name, ms in ((name, us / 1e3) for name, us in timed.items()):
            if name in peer_fns:
                row[f"{name}_TFLOPs"] = tflops(shape, shape["s"], shape["s"], ms)
            else:
                diff, ctas = launches[name]
                row["configs"][name] = dict(TFLOPs=tflops(shape, shape["s"], shape["s"], ms), ms=ms,
                                            maxdiff_vs_op=diff, ctas=ctas)
        rows.append(row)
        best = max((c for c in row["configs"].items() if "TFLOPs" in c[1]), key=lambda c: c[1]["TFLOPs"])
        print(f"B={shape['b']} S={shape['s']} H={shape['hq']}/{shape['hkv']} d={d} causal={causal:d}  "
              f"cudnn={row.get('sdpa_cudnn_TFLOPs', 0):.0f} fa4={row.get('fa4_TFLOPs', 0):.0f}  "
              f"best {best[0]} {best[1]['TFLOPs']:.0f}", flush=True)
        for name, c in row["configs"].items():
            print(f"    {name:<44} " + (f"{c['TFLOPs']:7.1f} TFLOP/s  maxdiff {c['maxdiff_vs_op']:.3g}"
                                         if "TFLOPs" in c else c["error"]), flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


def _config_name(cfg):
    return (f"m{cfg.tile_m}n{cfg.tile_n}s{cfg.num_stages}" + ("" if cfg.overlap else "-inorder") +
            ("" if cfg.persistent else "-per_tile") + ("-direct_o" if cfg.direct_o else ""))


def sweep_markdown(rows):
    names = list(dict.fromkeys(n for r in rows for n in r["configs"]))
    cols = ["B", "S", "Hq/Hkv", "d", "causal", "cuDNN", "FA4", *names]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["b"], r["s"], f"{r['hq']}/{r['hkv']}", r["d"], "yes" if r["causal"] else "no",
                 f"{r.get('sdpa_cudnn_TFLOPs', 0):.0f}", f"{r.get('fa4_TFLOPs', 0):.0f}"]
        cells += [f"{r['configs'][n]['TFLOPs']:.0f}" if "TFLOPs" in r["configs"].get(n, {}) else
                  ("err" if n in r["configs"] else "") for n in names]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def markdown(rows, names):
    cols = ["B", "S_q", "S_kv", "Hq/Hkv", "d", "causal"] + [f"{n} TFLOP/s" for n in names] + \
           ["vs cuDNN", "vs flash", "vs FA4"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["b"], r["s_q"], r["s_kv"], f"{r['hq']}/{r['hkv']}", r["d"], "yes" if r["causal"] else "no"]
        for n in names:
            cells.append(f"{r[n + '_TFLOPs']:.0f}" if f"{n}_TFLOPs" in r else "err" if f"{n}_error" in r else "-")
        for p in ("sdpa_cudnn", "sdpa_flash", "fa4"):
            cells.append(f"{r['vs_' + p]:.2f}x" if f"vs_{p}" in r else "-")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Decode: S_q <= 16 over a long KV cache (the split-KV kernel). Bound by reading K and V once, so
# besides TFLOP/s each row reports the K/V read bandwidth and its share of the copy ceiling.

def decode_shapes(quick=False):
    if quick:
        return [dict(b=16, s_q=1, s_kv=8192, hq=32, hkv=8, d=128)]
    shapes = [dict(b=b, s_q=1, s_kv=s, hq=hq, hkv=hkv, d=128)
              for hq, hkv in ((32, 8), (16, 16)) for b in (1, 16, 64) for s in (1024, 4096, 8192, 32768)
              if b * s <= 64 * 8192]  # B=64 x 32K would be 8.6-17 GB per input set
    return shapes + [dict(b=16, s_q=4, s_kv=8192, hq=32, hkv=8, d=128)]


def decode_shape(shape):
    """The kernel's view of a decode row (bf16, not causal)."""
    return D.DecodeShape(shape["b"], shape["s_q"], shape["s_kv"], shape["hq"], shape["hkv"], shape["d"])


def decode_sets(shape, dtype=torch.bfloat16):
    """(q, k, v, out) copies, enough to exceed the L2 three times over (each launch reads a new one)."""
    b, s_q, s_k, hq, hkv, d = (shape[x] for x in ("b", "s_q", "s_kv", "hq", "hkv", "d"))
    per_set = 2 * (2 * b * s_q * hq * d + 2 * b * s_k * hkv * d)
    return [(torch.randn(b, s_q, hq, d, device="cuda", dtype=dtype),
             torch.randn(b, s_k, hkv, d, device="cuda", dtype=dtype),
             torch.randn(b, s_k, hkv, d, device="cuda", dtype=dtype),
             torch.empty(b, s_q, hq, d, device="cuda", dtype=dtype))
            for _ in range(timing.input_sets(per_set))]


def graph_calls(n_sets):
    """Calls per CUDA graph: twice round the input sets, within 20-200."""
    return min(max(2 * n_sets, 20), 200)


def graph_ms(fn, n_sets):
    """Device ms per launch of fn(0), fn(1), ... (cycling over the input sets) in one CUDA graph."""
    return timing.graph_time_us(lambda i: fn(i % n_sets), graph_calls(n_sets), reps=5, warmup=n_sets) / 1e3


def eager_us(fn, n_sets):
    """Wall time per eager call, back to back (host overhead when the kernel is shorter)."""
    return timing.host_time_us(lambda i: fn(i % n_sets), calls=100, reps=3, warmup=5)


def bench_decode(shape, peers, copy_gbps, split_sweep=()):
    sets = decode_sets(shape)
    b, s_q, s_k, hq, hkv, d = (shape[x] for x in ("b", "s_q", "s_kv", "hq", "hkv", "d"))
    kv_bytes = 2 * b * s_k * hkv * d * 2
    row = dict(shape, splits=D.config_for(decode_shape(shape)).splits)
    ours = lambda i: rosekernels.attention(*sets[i][:3], out=sets[i][3])  # noqa: E731
    ref = ours(0).float().clone()
    impls = {"rosekernels": ours}
    impls.update({n: (lambda i, fn=fn: fn(*sets[i][:3], False)) for n, fn in peers.impls.items()})
    ready, errors = {}, {}
    for name, run in impls.items():
        try:
            if name != "rosekernels":
                row[f"{name}_maxdiff"] = (run(0).float() - ref).abs().max().item()
            ready[name] = run
        except Exception as e:  # noqa: BLE001 - a backend refusing a shape is a result, not a crash
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    n_sets = len(sets)
    steps = {name: (lambda i, run=run: run(i % n_sets)) for name, run in ready.items()}
    graph_us = timing.interleaved_graph_time_us(steps, graph_calls(n_sets), rounds=7, warmup=n_sets, errors=errors)
    for name, us in graph_us.items():
        ms = us / 1e3
        row[f"{name}_us"] = us
        row[f"{name}_TFLOPs"] = 4 * b * hq * s_q * s_k * d / ms / 1e9
        row[f"{name}_kv_GBps"] = kv_bytes / ms / 1e6
        row[f"{name}_eager_us"] = eager_us(ready[name], n_sets)
    for name, error in errors.items():
        row[f"{name}_error"] = error
    if "rosekernels_us" in row:
        row["pct_copy"] = 100 * row["rosekernels_kv_GBps"] / copy_gbps
        for peer in peers.impls:
            if f"{peer}_us" in row:
                row[f"vs_{peer}"] = row[f"{peer}_us"] / row["rosekernels_us"]
    for splits in split_sweep:
        try:
            ms = graph_ms(
                lambda i, n=splits: rosekernels.attention_decode(*sets[i][:3], out=sets[i][3], splits=n), len(sets))
            row[f"splits{splits}_us"] = ms * 1e3
        except Exception as e:  # noqa: BLE001
            row[f"splits{splits}_error"] = f"{type(e).__name__}: {e}"
    del sets
    torch.cuda.empty_cache()
    return row


def markdown_decode(rows, peer_names, split_sweep=()):
    cols = (["B", "S_q", "S_kv", "Hq/Hkv", "splits", "ours us", "TFLOP/s", "K/V GB/s", "% copy", "eager us"]
            + [f"{p} us (ours x)" for p in peer_names] + [f"splits={n} us" for n in split_sweep])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["b"], r["s_q"], r["s_kv"], f"{r['hq']}/{r['hkv']}", r["splits"]]
        if "rosekernels_us" in r:
            cells += [f"{r['rosekernels_us']:.1f}", f"{r['rosekernels_TFLOPs']:.1f}",
                      f"{r['rosekernels_kv_GBps']:.0f}", f"{r['pct_copy']:.0f}%", f"{r['rosekernels_eager_us']:.1f}"]
        else:
            cells += ["err"] * 5
        for p in peer_names:
            cells.append(f"{r[p + '_us']:.1f} ({r['vs_' + p]:.2f}x)" if f"vs_{p}" in r else
                         "err" if f"{p}_error" in r else "-")
        cells += [f"{r[f'splits{n}_us']:.1f}" if f"splits{n}_us" in r else "err" for n in split_sweep]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


KVCACHE_BLOCK_SIZES = (16, 64, 256)


def kvcache_shapes(quick=False):
    if quick:
        return [dict(b=8, s_q=1, s_kv=8192, hq=32, hkv=8, d=128)]
    return [dict(b=b, s_q=1, s_kv=s, hq=32, hkv=8, d=d) for d in (128, 64) for b in (1, 8, 32)
            for s in (1024, 8192, 32768) if b * s <= 32 * 8192]


def bench_kvcache(shape, flashinfer=None):
    """One decode row over a KV cache: the dense decode kernel on [B, S, H, d] (the baseline), the same
    keys as a contiguous cache with per-sequence lengths, as paged caches of KVCACHE_BLOCK_SIZES rows per
    page, pages in a random order (block_table a permutation), and FlashInfer's batch decode over the same
    paged caches (`flashinfer`: flashinfer_peer.decode()'s make, or None). The inputs rotate over enough sets to
    exceed the L2 (one set's cache is what a launch reads), CUDA graphs replayed interleaved; outputs compared
    with the dense kernel's."""
    b, s_q, s_k, hq, hkv, d = (shape[x] for x in ("b", "s_q", "s_kv", "hq", "hkv", "d"))
    g = torch.Generator(device="cuda").manual_seed(b * s_k + d)
    n_sets = timing.input_sets(2 * b * s_k * hkv * d * 2, most=200)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(b, s_q, hq, d, device="cuda", generator=g).to(torch.bfloat16)
        k, v = (torch.randn(b, s_k, hkv, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        sets.append({"q": q, "k": k, "v": v})
    lengths = torch.full((b,), s_k, dtype=torch.int32, device="cuda")
    runs = {"dense decode": lambda x: rosekernels.attention(x["q"], x["k"], x["v"]),
            "cache, contiguous": lambda x: rosekernels.attention_with_kvcache(x["q"], x["k"], x["v"], lengths)}
    row, errors = dict(shape), {}
    row["input_sets"] = n_sets
    for bs in KVCACHE_BLOCK_SIZES:
        pages = b * s_k // bs
        order = torch.randperm(pages, device="cuda", generator=g)  # one page order for every set: one plan
        table = order.view(b, s_k // bs).to(torch.int32)
        for x in sets:
            x[bs] = tuple(torch.empty(pages, bs, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            x[bs][0][order], x[bs][1][order] = x["k"].reshape(pages, bs, hkv, d), x["v"].reshape(pages, bs, hkv, d)
        runs[f"paged, {bs} rows"] = lambda x, bs=bs, table=table: rosekernels.attention_with_kvcache(
            x["q"], *x[bs], lengths, block_table=table)
        if flashinfer is not None:
            name = f"FlashInfer paged, {bs} rows"
            try:
                run = flashinfer(table, lengths, bs, hq, hkv, d)
                runs[name] = lambda x, bs=bs, run=run: run(x["q"], *x[bs])
            except Exception as e:  # noqa: BLE001 - a peer that cannot plan this shape is a result
                errors[name] = timing.error_line(e)
    ref = runs["dense decode"](sets[0]).float()
    for name, run in list(runs.items())[1:]:
        try:
            diff = (run(sets[0]).float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001
            errors[name] = timing.error_line(e)
            continue
        row[f"{name} maxdiff"] = diff
        if not diff <= 2e-2:
            errors[name] = f"max |diff| {diff:.3g} against the dense kernel"
    steps = {name: (lambda i, run=run: run(sets[i % n_sets])) for name, run in runs.items() if name not in errors}
    row["us"] = timing.interleaved_graph_time_us(steps, calls=graph_calls(n_sets), rounds=9, warmup=3,
                                                 errors=errors)
    row["vs dense"] = {name: us / row["us"]["dense decode"] for name, us in row["us"].items()
                       if "dense decode" in row["us"]}
    row["vs FlashInfer"] = {str(bs): row["us"][f"FlashInfer paged, {bs} rows"] / row["us"][f"paged, {bs} rows"]
                            for bs in KVCACHE_BLOCK_SIZES
                            if f"FlashInfer paged, {bs} rows" in row["us"] and f"paged, {bs} rows" in row["us"]}
    row["errors"] = errors
    return row


def markdown_kvcache(rows, gpu, unavailable=()):
    names = ["dense decode", "cache, contiguous", *(f"paged, {bs} rows" for bs in KVCACHE_BLOCK_SIZES)]
    peers = [f"FlashInfer paged, {bs} rows" for bs in KVCACHE_BLOCK_SIZES]
    out = [f"# attention decode over a KV cache, {gpu}", "",
           "bf16, S_q = 1, Hq/Hkv 32/8, every sequence at S_kv keys; pages in a random order. Device time per "
           "launch in CUDA graphs replayed interleaved, the inputs rotated over enough sets to exceed the L2; "
           "(x) is the time over the dense decode kernel's (issue 19's bar for paged: within 5% at 16 rows and "
           "more). FlashInfer: its batch decode (tensor cores at GQA groups of 4 or more, as SGLang picks; planned "
           "outside the graphs) over the same paged caches; (x) is its time over ours at the same page size "
           "(above 1: ours is faster).", "",
           "| d | B | S_kv | " + " | ".join(f"{n} us" for n in names + peers) + " |",
           "|---" * (3 + len(names) + len(peers)) + "|"]
    for r in rows:
        cells = [str(r["d"]), str(r["b"]), str(r["s_kv"])]
        for n in names:
            us = r["us"].get(n)
            cells.append("err" if us is None else f"{us:.1f} ({r['vs dense'].get(n, math.nan):.3f}x)")
        for bs, n in zip(KVCACHE_BLOCK_SIZES, peers):
            us = r["us"].get(n)
            ratio = r.get("vs FlashInfer", {}).get(str(bs), math.nan)  # keyed as in the JSON
            cells.append(("err" if n in r["errors"] else "not run") if us is None else f"{us:.1f} ({ratio:.3f}x)")
        out.append("| " + " | ".join(cells) + " |")
    errs = [f"- d={r['d']} B={r['b']} S_kv={r['s_kv']} {n}: {e}" for r in rows for n, e in r["errors"].items()]
    notes = [f"- {u}" for u in unavailable]
    return "\n".join(out + ([""] + errs if errs else []) + ([""] + notes if notes else []))


def varlen_shapes(quick=False):
    if quick:
        return [dict(b=8, s=2048, hq=32, hkv=8, d=128, causal=True)]
    return [dict(b=b, s=s, hq=32, hkv=8, d=d, causal=c) for d in (128, 64) for c in (False, True)
            for b in (1, 8, 32) for s in (1024, 4096, 16384) if b * s <= 65536]


def _fa4_varlen():
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    from flash_attn.cute.interface import flash_attn_varlen_func

    return lambda q, k, v, cu, s_max, causal: _first(flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s_max, max_seqlen_k=s_max, causal=causal))


def bench_varlen(shape, fa4):
    """One varlen row: B sequences of S tokens through the dense kernel ([B, S, H, d]) and through
    attention_varlen (the same tokens packed: issue 19's bar is within 3% of the dense kernel), then B
    sequences of ragged lengths (uniform in [S/4, 7S/4], the same tokens in total) through
    attention_varlen and FA4's varlen kernel. Timed interleaved in CUDA graphs, inputs rotated past
    the L2; outputs compared (equal lengths: with the dense kernel's, bitwise; ragged: with FA4's)."""
    b, s, hq, hkv, d, causal = (shape[x] for x in ("b", "s", "hq", "hkv", "d", "causal"))
    g = torch.Generator(device="cuda").manual_seed(b * s + d + causal)
    tokens = b * s
    copies = max(1, math.ceil(60e6 / (tokens * (hq + 2 * hkv) * d * 2)))

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)

    sets = [(randn(tokens, hq, d), randn(tokens, hkv, d), randn(tokens, hkv, d)) for _ in range(copies)]
    equal = torch.arange(0, tokens + 1, s, dtype=torch.int32, device="cuda")
    # Ragged, the same tokens: weights uniform in [1/4, 7/4], scaled to the total; the last takes the rest.
    w = torch.rand(b, generator=torch.Generator().manual_seed(b + s)) * 1.5 + 0.25
    lengths = (w / w.sum() * tokens).long()
    lengths[-1] += tokens - int(lengths.sum())
    ragged = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32).cuda()
    r_max = int(lengths.max())
    # The dense kernel with the heuristic's config (as varlen launches it), not a tuned one.
    dense_cfg = A.default_config(d, "bf16", causal, s)
    dense_out = torch.empty(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
    dense_lse = torch.empty(b, hq, s, device="cuda")
    dense_fn = A.compile(dense_cfg).fn
    launch = A.launch_args(dense_cfg, dense_out)  # its tile counter: each launch returns it to zero

    def dense(q, k, v):
        dense_fn(q.view(b, s, hq, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d), dense_out, dense_lse,
                 A.LOG2_E / math.sqrt(d), *launch, *A.NOT_VARLEN)
        return dense_out

    runs = {"dense": dense,
            "varlen, equal": lambda q, k, v: rosekernels.attention_varlen(q, k, v, equal, equal, s, s,
                                                                          causal=causal),
            "varlen, ragged": lambda q, k, v: rosekernels.attention_varlen(q, k, v, ragged, ragged, r_max,
                                                                           r_max, causal=causal)}
    if fa4 is not None:
        runs["fa4 varlen, ragged"] = lambda q, k, v: fa4(q, k, v, ragged, r_max, causal)
    row, errors = dict(shape, lengths=lengths.tolist()), {}
    first = sets[0]
    dense = runs["dense"](*first).reshape(tokens, hq, d)
    if not torch.equal(runs["varlen, equal"](*first), dense):
        errors["varlen, equal"] = "differs from the dense kernel's output"
    ours = runs["varlen, ragged"](*first).float()
    if fa4 is not None:
        try:
            peer = runs["fa4 varlen, ragged"](*first).float()
        except Exception as e:  # noqa: BLE001 - a broken peer is recorded, not fatal
            errors["fa4 varlen, ragged"] = f"{type(e).__name__}: {e}"[:300]
        else:
            diff = (ours - peer).abs().max().item()
            row["ragged maxdiff vs fa4"] = diff
            if not diff <= 2e-2:
                errors["varlen, ragged"] = f"max |diff| {diff:.3g} against FA4"
    steps = {name: (lambda i, run=run: run(*sets[i % len(sets)]))
             for name, run in runs.items() if name not in errors}
    flops = 4 * hq * d * int((lengths ** 2).sum()) * (0.5 if causal else 1.0)
    calls = max(3, min(50, int(50e-3 / max(flops / 600e12, 1e-6))))
    # In CUDA graphs: device time only (at B=1, S=1k the eager calls are host-bound, each op by its own
    # host path: events around eager launches measured that, not the kernels).
    row["us"] = timing.interleaved_graph_time_us(steps, calls=calls, rounds=7, errors=errors)
    if "dense" in row["us"] and "varlen, equal" in row["us"]:
        row["equal vs dense"] = row["us"]["varlen, equal"] / row["us"]["dense"]
    if "varlen, ragged" in row["us"] and "fa4 varlen, ragged" in row["us"]:
        row["ragged speedup vs fa4"] = row["us"]["fa4 varlen, ragged"] / row["us"]["varlen, ragged"]
    row["errors"] = errors
    return row


def markdown_varlen(rows, gpu, unavailable):
    out = [f"# attention over packed sequences (varlen), {gpu}", "",
           "bf16, Hq/Hkv 32/8. Equal: B sequences of S tokens, packed, against the dense kernel on "
           "[B, S, H, d] (issue 19's bar: within 3%). Ragged: the same tokens in B sequences of about S/4 to "
           "7S/4, against FA4's varlen kernel. us per call, CUDA graphs (device time), methods interleaved, inputs "
           "rotated past the L2.", "",
           "| d | causal | B | S | dense us | varlen equal us | equal / dense | varlen ragged us | FA4 ragged us "
           "| vs FA4 |", "|---" * 10 + "|"]
    for r in rows:
        us = r["us"]
        cell = (lambda n: f"{us[n]:.1f}" if n in us else "err")
        out.append(f"| {r['d']} | {r['causal']} | {r['b']} | {r['s']} | {cell('dense')} | "
                   f"{cell('varlen, equal')} | {r.get('equal vs dense', math.nan):.3f} | {cell('varlen, ragged')} | "
                   f"{cell('fa4 varlen, ragged')} | {r.get('ragged speedup vs fa4', math.nan):.3f}x |")
    errs = [f"- d={r['d']} causal={r['causal']} B={r['b']} S={r['s']} {n}: {e}" for r in rows
            for n, e in r["errors"].items()]
    notes = [""] + [f"- {u}" for u in unavailable] if unavailable else []
    return "\n".join(out + ([""] + errs if errs else []) + notes)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_out(ap)
    ap.add_argument("--quick", action="store_true", help="only the reference shape (and one decode row)")
    ap.add_argument("--decode-only", action="store_true", help="only the decode table")
    ap.add_argument("--split-sweep", action="store_true", help="decode: also time forced KV split counts")
    ap.add_argument("--sweep", action="store_true", help="candidate configs (tiles, grid) on the prefill problem shapes")
    ap.add_argument("--kvcache", action="store_true",
                    help="decode over a KV cache only: the dense kernel, a contiguous cache and paged ones")
    ap.add_argument("--varlen", action="store_true",
                    help="packed sequences only: equal lengths against the dense kernel, ragged ones against FA4")
    ap.add_argument("--grid", action="store_true",
                    help="dense prefill on the B x S parity grid against FA4 and cuDNN only, in CUDA graphs")
    ap.add_argument("--where", default="", metavar="K=V,...",
                    help="only the prefill rows whose fields match, e.g. d=128,causal=1")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    report.require_gpu()
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.varlen:
        env, unavailable = report.environment(("flash_attn",)), []
        fa4 = report.try_peer("fa4", _fa4_varlen, unavailable)
        A.precompile(A.varlen_variants_for() + A.variants_for())
        rows = []
        for shape in varlen_shapes(args.quick):
            rows.append(bench_varlen(shape, fa4))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "lengths"}), flush=True)
        report.write(args.out, "attention_varlen", {"environment": env, "unavailable": unavailable,
                                                    "rows": rows}, markdown_varlen(rows, env["gpu"], unavailable))
        return
    if args.kvcache:
        env, unavailable = report.environment(("flashinfer",)), []
        flashinfer = report.try_peer("FlashInfer", flashinfer_peer.decode, unavailable)
        rows = []
        for shape in kvcache_shapes(args.quick):
            rows.append(bench_kvcache(shape, flashinfer))
            torch.cuda.empty_cache()  # the row's caches are gone: the next, larger ones get the memory
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "errors"}), flush=True)
        report.write(args.out, "attention_kvcache", {"environment": env, "unavailable": unavailable, "rows": rows},
                     markdown_kvcache(rows, env["gpu"], unavailable))
        return

    t0 = time.time()
    if not args.decode_only:
        A.precompile()
    D.precompile([D.config_for(decode_shape(s)) for s in (() if args.grid else decode_shapes(args.quick))])
    result = {"environment": report.environment(("flash_attn",)), "compile_s": round(time.time() - t0, 1),
              "ceilings": ceilings()}
    print(json.dumps(result), flush=True)
    gpu = result["environment"]["gpu"]

    peers = Peers()
    if args.grid:
        peers.impls = {n: f for n, f in peers.impls.items() if n in ("sdpa_cudnn", "fa4")}
    where = [kv.split("=") for kv in args.where.split(",") if kv]
    if any(len(kv) != 2 or kv[0] not in REFERENCE for kv in where):
        ap.error(f"--where takes K=V,... with K among {sorted(REFERENCE)}, got {args.where!r}")

    def chosen(shapes):
        return [sh for sh in shapes if all(str(int(sh[k])) == v for k, v in where)]

    if args.sweep:
        result["unavailable"] = peers.unavailable
        result["sweep"] = sweep(chosen(grid_shapes() if args.grid else SWEEP_SHAPES), args.iters, peers)
        md = [f"# attention prefill sweep (TFLOP/s), {gpu}", "", sweep_markdown(result["sweep"])]
        report.write(args.out, "attention_sweep_grid" if args.grid else "attention_sweep", result, "\n".join(md))
        return

    result["unavailable"] = peers.unavailable
    names = ["rosekernels", *peers.impls]
    shapes = chosen([] if args.decode_only else [REFERENCE] if args.quick else
                    grid_shapes() if args.grid else prefill_shapes())
    rows = []
    for shape in shapes:
        t = time.time()
        rows.append(bench_shape(shape, peers, iters=args.iters, graphs=args.grid))
        r = rows[-1]
        print(f"B={r['b']:<2} S={r['s']:<5} H={r['hq']}/{r['hkv']} d={r['d']} causal={r['causal']:d}  " +
              "  ".join(f"{n}={r[n + '_TFLOPs']:.0f}" if f"{n}_TFLOPs" in r else f"{n}=ERR" for n in names) +
              f"  ({time.time() - t:.1f}s)", flush=True)
        errs = {k: v for k, v in r.items() if k.endswith("_error") or (k.endswith("_maxdiff") and v > 0.05)}
        if errs:
            print("   ", errs, flush=True)
    decode = []
    split_counts = (1, 2, 4, 8, 16, 32, 64) if args.split_sweep else ()
    for shape in (() if args.grid else decode_shapes(args.quick)):
        t = time.time()
        decode.append(bench_decode(shape, peers, result["ceilings"]["copy_GBps"], split_counts))
        r = decode[-1]
        print(f"decode B={r['b']:<2} S_q={r['s_q']} S_kv={r['s_kv']:<5} H={r['hq']}/{r['hkv']} splits={r['splits']:<3} " +
              "  ".join(f"{n}={r[n + '_us']:.1f}us" if f"{n}_us" in r else f"{n}=ERR" for n in names) +
              (f"  {r['pct_copy']:.0f}% of copy" if "pct_copy" in r else "") + f"  ({time.time() - t:.1f}s)", flush=True)
        errs = {k: v for k, v in r.items() if k.endswith("_error") or (k.endswith("_maxdiff") and v > 0.05)}
        if errs:
            print("   ", errs, flush=True)
    result["prefill"], result["decode"] = rows, decode
    md = [f"# attention forward, {gpu}", "",
          f"ceilings: copy {result['ceilings']['copy_GBps']:.0f} GB/s, "
          f"bf16 GEMM {result['ceilings']['bf16_gemm_8192_TFLOPs']:.0f} TFLOP/s; unavailable: {'; '.join(peers.unavailable) or 'none'}"]
    if args.grid:
        md += ["", "Dense prefill on issue 19's B x S grid (Hq/Hkv 32/8, bf16): each method's calls in a CUDA graph "
               "of its own, replays interleaved (device time only), inputs rotated past the L2."]
    if rows:
        md += ["", markdown(rows, names)]
    if decode:
        md += ["", "Decode (split-KV kernel; d=128 bf16, not causal; a CUDA graph per method over rotating inputs, "
               "replays interleaved across methods, per launch; "
               "eager us = wall time per back-to-back eager call; % copy = K/V read GB/s over the copy ceiling; "
               "peer columns: peer us (peer time / ours)):", "", markdown_decode(decode, list(peers.impls), split_counts)]
    report.write(args.out, "attention_grid" if args.grid else "attention", result, "\n".join(md))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
