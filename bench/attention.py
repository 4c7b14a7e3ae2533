"""Benchmark the fused attention forward against torch SDPA (flash, cuDNN, efficient) and flash-attn-4.

    python bench/attention.py --out bench/results            # full prefill table (+ decode-shaped rows)
    python bench/attention.py --quick                        # the reference shape only
    python bench/attention.py --sweep                        # tile configs on the reference shapes

TFLOP/s = 4 * B * Hq * S_q * S_kv * d / time, halved when causal. Each timing: warm-up, then one CUDA
event pair per launch, median; the inputs rotate over enough copies to exceed the 50 MB L2. Every
implementation's output is compared with ours (max |diff|), so a fast wrong kernel shows. Decode-shaped
rows (S_q = 1) are timed inside a CUDA graph. Results: <out>/attention.json and <out>/attention.md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rosekernels.kernels import attention as A  # noqa: E402

L2_BYTES = 50 * 2**20
REFERENCE = dict(b=2, s=8192, hq=32, hkv=8, d=128, causal=False)  # FA4 752, cuDNN 693, SDPA flash 341


def prefill_shapes():
    for d in (128, 64):
        for hq, hkv in ((32, 8), (16, 16)):
            for causal in (False, True):
                for b, s in ((16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)):
                    yield dict(b=b, s=s, hq=hq, hkv=hkv, d=d, causal=causal)


def tflops(shape, s_q, s_k, ms):
    flops = 4 * shape["b"] * shape["hq"] * s_q * s_k * shape["d"] / (2 if shape["causal"] else 1)
    return flops / ms / 1e9


def time_ms(fn, sets, warmup=3, iters=10):
    """Median of per-launch CUDA-event times; fn(i) runs on input set i % len(sets)."""
    for i in range(warmup):
        fn(i % sets)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (start, end) in enumerate(events):
        start.record()
        fn(i % sets)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def time_graph_ms(fn, launches=50, replays=5):
    """Per-launch time of `launches` calls captured in one CUDA graph (decode-sized work)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(launches):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return statistics.median(times)


def ceilings():
    """Measured in this run: device copy bandwidth (read + write) and a dense bf16 GEMM."""
    n = 1 << 28
    a, b = torch.empty(n, device="cuda", dtype=torch.uint8), torch.empty(n, device="cuda", dtype=torch.uint8)
    copy_ms = time_ms(lambda i: b.copy_(a), 1, warmup=3, iters=10)
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_ms = time_ms(lambda i: m @ m, 1, warmup=3, iters=10)
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "bf16_gemm_8192_TFLOPs": 2 * 8192**3 / gemm_ms / 1e9}


def make_sets(shape, s_q, s_k, dtype=torch.bfloat16):
    """Enough input copies to exceed the L2 cache; each is (q, k, v, out)."""
    b, hq, hkv, d = shape["b"], shape["hq"], shape["hkv"], shape["d"]
    per_set = 2 * (2 * b * s_q * hq * d + 2 * b * s_k * hkv * d)
    count = max(2, math.ceil(3 * L2_BYTES / per_set))
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
        self.unavailable = {}
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
            self.impls[name] = self._sdpa(sdpa_kernel, backend)
        try:
            os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
            from flash_attn.cute.interface import flash_attn_func

            self.impls["fa4"] = lambda q, k, v, causal: _first(flash_attn_func(q, k, v, causal=causal))
        except Exception as e:  # noqa: BLE001 - any import failure means "not installed here"
            self.unavailable["fa4"] = f"{type(e).__name__}: {e}"

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


def bench_shape(shape, peers, s_q=None, iters=10):
    s_q = shape["s"] if s_q is None else s_q
    s_k = shape["s"]
    sets = make_sets(shape, s_q, s_k)
    row = dict(shape, s_q=s_q, s_kv=s_k)
    ours = lambda i: A.attention(*sets[i][:3], causal=shape["causal"], out=sets[i][3])  # noqa: E731
    ours(0)
    torch.cuda.synchronize()
    ref = sets[0][3].clone()
    impls = {"rosekernels": None, **peers.impls}
    for name, fn in impls.items():
        try:
            run = ours if fn is None else (lambda i, fn=fn: fn(*sets[i][:3], shape["causal"]))
            if fn is not None:
                diff = (run(0).float() - ref.float()).abs().max().item()
                row[f"{name}_maxdiff"] = diff
            if s_q == 1:
                ms = time_graph_ms(lambda: run(0))
            else:
                ms = time_ms(run, len(sets), iters=iters)
            row[f"{name}_ms"] = ms
            row[f"{name}_TFLOPs"] = tflops(shape, s_q, s_k, ms)
        except Exception as e:  # noqa: BLE001 - a backend refusing a shape is a result, not a crash
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    for peer in ("sdpa_cudnn", "sdpa_flash", "fa4"):
        if f"{peer}_ms" in row:
            row[f"vs_{peer}"] = row[f"{peer}_ms"] / row["rosekernels_ms"]
    del sets
    torch.cuda.empty_cache()
    return row


def sweep(shapes, iters):
    """Time alternative tile configs of our kernel (compiled directly) on the given shapes."""
    rows = []
    for shape in shapes:
        d, causal = shape["d"], shape["causal"]
        cands = [A.default_config(d, "bf16", causal)]
        if d == 128:
            cands += [A.AttentionConfig(128, "bf16", causal, tile_n=n) for n in (112, 144, 160, 176)]
            cands += [A.AttentionConfig(128, "bf16", causal, overlap=False)]
        else:
            cands += [A.AttentionConfig(64, "bf16", causal, tile_m=m, tile_n=n, num_stages=st)
                      for m, n, st in ((192, 128, 2), (192, 112, 3), (128, 128, 3), (128, 176, 3), (128, 192, 3))]
        cands = list(dict.fromkeys(cands))
        A.precompile(cands)
        sets = make_sets(shape, shape["s"], shape["s"])
        ref = A.attention(*sets[0][:3], causal=causal)
        for cfg in cands:
            kernel = A.compiled(cfg)
            scale_log2 = A.LOG2_E / math.sqrt(d)

            def run(i, kernel=kernel):
                q, k, v, out = sets[i]
                lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device="cuda")
                kernel.fn(q, k, v, out, lse, scale_log2)
                return out

            diff = (run(0).float() - ref.float()).abs().max().item()
            ms = time_ms(run, len(sets), iters=iters)
            rows.append(dict(shape, config=cfg.variant().key(), ms=ms, TFLOPs=tflops(shape, shape["s"], shape["s"], ms),
                             maxdiff_vs_default=diff))
            print(f"{rows[-1]['config']:<90} {rows[-1]['TFLOPs']:7.1f} TFLOP/s  maxdiff {diff:.3g}", flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--quick", action="store_true", help="only the reference shape")
    ap.add_argument("--sweep", action="store_true", help="tile configs on the reference shapes")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False

    t0 = time.time()
    A.precompile()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "compile_s": round(time.time() - t0, 1), "ceilings": ceilings()}
    print(json.dumps(result), flush=True)

    if args.sweep:
        shapes = [REFERENCE, dict(REFERENCE, causal=True), dict(REFERENCE, d=64), dict(REFERENCE, d=64, causal=True)]
        result["sweep"] = sweep(shapes, args.iters)
        (out / "attention_sweep.json").write_text(json.dumps(result, indent=1))
        return

    peers = Peers()
    result["unavailable"] = peers.unavailable
    names = ["rosekernels", *peers.impls]
    shapes = [REFERENCE] if args.quick else list(prefill_shapes())
    rows = []
    for shape in shapes:
        t = time.time()
        rows.append(bench_shape(shape, peers, iters=args.iters))
        r = rows[-1]
        print(f"B={r['b']:<2} S={r['s']:<5} H={r['hq']}/{r['hkv']} d={r['d']} causal={r['causal']:d}  " +
              "  ".join(f"{n}={r[n + '_TFLOPs']:.0f}" if f"{n}_TFLOPs" in r else f"{n}=ERR" for n in names) +
              f"  ({time.time() - t:.1f}s)", flush=True)
        errs = {k: v for k, v in r.items() if k.endswith("_error") or (k.endswith("_maxdiff") and v > 0.05)}
        if errs:
            print("   ", errs, flush=True)
    decode = []
    if not args.quick:
        # Decode-shaped: one query token per sequence over a long KV cache (no split-KV here yet).
        for shape in (dict(b=16, s=8192, hq=32, hkv=8, d=128, causal=False),
                      dict(b=64, s=2048, hq=32, hkv=8, d=128, causal=False)):
            decode.append(bench_shape(shape, peers, s_q=1))
    result["prefill"], result["decode"] = rows, decode
    (out / "attention.json").write_text(json.dumps(result, indent=1))
    md = [f"# attention forward, {result['device']}", "",
          f"ceilings: copy {result['ceilings']['copy_GBps']:.0f} GB/s, "
          f"bf16 GEMM {result['ceilings']['bf16_gemm_8192_TFLOPs']:.0f} TFLOP/s; unavailable: {peers.unavailable or 'none'}",
          "", markdown(rows, names)]
    if decode:
        md += ["", "Decode-shaped (S_q = 1, CUDA graph, per launch):", "", markdown(decode, names)]
    (out / "attention.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
