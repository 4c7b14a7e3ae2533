"""Benchmark rosekernels qk_norm against its peers on Qwen3 shapes; writes JSON + markdown.

    python bench/qk_norm.py [--out bench/results] [--quick] [--no-sweep]

Measured in one run on the same inputs (bf16 q/k, bf16 weights, eps 1e-6):
  * copy ceiling: a device-to-device copy of as many bytes as q+k (read + write), per shape, and
    of 1 GiB;
  * ours: rosekernels.qk_norm (one launch for q and k), also on strided views of a fused qkv buffer;
  * peers: torch eager (F.rms_norm on q then k), torch.compile of the same (dynamic shapes),
    liger-kernel RMSNorm, quack rmsnorm, FlashInfer's rmsnorm on [T, h, d] (its per-head form), and
    rosekernels.rmsnorm, each applied per head (two launches, q then k); each checked against the float64
    reference first (within two bf16 roundings, else reported and not timed);
  * prefill (T >= 1024): CUDA-event time per call, median of repeats, inputs rotated through
    more than the 50 MB L2;
  * decode (T <= 128): device time per call inside a CUDA graph (many calls captured, replayed;
    inputs L2-resident as in a real decode step), next to an empty CuTeDSL kernel measured the
    same way, and eager host time per call (wall clock of a long loop);
  * --sweep (default on): every prefill block shape (warps per block x rows per thread) and the
    decode variant at every T; prints the PREFILL_TABLE row to paste into rosekernels/modes.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402
import timing  # noqa: E402
from report import fmt, measure, ratio  # noqa: E402
from timing import auto_event_time_us, copy_gbs, copy_time_us, graph_time_us, host_time_us  # noqa: E402
import rosekernels  # noqa: E402
from rosekernels import checks, modes  # noqa: E402
from rosekernels.kernels import qk_norm as qkn  # noqa: E402
from rosekernels.kernels.qk_norm_plan import ROWS_PER_THREAD  # noqa: E402

import cutlass  # noqa: E402  (after rosekernels, which pins CUTE_DSL_ARCH=sm_90a)
import cutlass.cute as cute  # noqa: E402

MODELS = {"Qwen3-8B": (32, 8), "Qwen3-30B-A3B": (32, 4)}
HEAD_DIM = 128
DTYPE = torch.bfloat16
EPS = 1e-6
DECODE_T = (1, 8, 32, 128)
PREFILL_T = (1024, 4096, 8192, 16384, 32768)
GRAPH_CALLS = 100


def empty_cutedsl_kernel():
    """A CuTeDSL kernel that does nothing (1 block of 32 threads), called like our kernels."""

    @cute.kernel
    def empty_kernel(x: cute.Tensor):
        pass

    @cute.jit
    def empty(x: cute.Tensor, stream):
        empty_kernel(x).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    fake = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (cute.sym_int32(),), assumed_align=16)
    return cute.compile(empty, fake, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                        options="--enable-tvm-ffi")


# ---------------------------------------------------------------------------------------------
# Peers: each returns a function(q, k, wq, wk) doing the whole Q+K normalization.

def peer_factories(d):
    def torch_eager():
        return lambda q, k, wq, wk: (F.rms_norm(q, (d,), wq, EPS), F.rms_norm(k, (d,), wk, EPS))

    def torch_compiled():
        f = torch.compile(lambda q, k, wq, wk: (F.rms_norm(q, (d,), wq, EPS), F.rms_norm(k, (d,), wk, EPS)),
                          dynamic=True)
        return f

    def liger():
        from liger_kernel.ops.rms_norm import rms_norm_forward

        return lambda q, k, wq, wk: (rms_norm_forward(q.view(-1, d), wq, EPS, 0.0, "llama", None)[0],
                                     rms_norm_forward(k.view(-1, d), wk, EPS, 0.0, "llama", None)[0])

    def quack():
        from quack.rmsnorm import rmsnorm_fwd

        return lambda q, k, wq, wk: (rmsnorm_fwd(q.view(-1, d), wq, eps=EPS)[0],
                                     rmsnorm_fwd(k.view(-1, d), wk, eps=EPS)[0])

    def rk_rmsnorm():
        return lambda q, k, wq, wk: (rosekernels.rmsnorm(q.view(-1, d), wq, EPS), rosekernels.rmsnorm(k.view(-1, d), wk, EPS))

    def flashinfer():
        import flashinfer as fi  # its rmsnorm over [T, heads, d] normalizes each head (its q/k norm)

        return lambda q, k, wq, wk: (fi.rmsnorm(q, wq, EPS), fi.rmsnorm(k, wk, EPS))

    return {"torch_eager": torch_eager, "torch_compile": torch_compiled, "liger": liger,
            "quack": quack, "flashinfer": flashinfer, "rk_rmsnorm": rk_rmsnorm}


PEERS = ("quack", "flashinfer", "liger", "torch_eager", "torch_compile", "rk_rmsnorm")


def make_sets(tokens, hq, hk, d, count, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sets = []
    for _ in range(count):
        q = torch.randn(tokens, hq, d, device="cuda", generator=g).to(DTYPE)
        k = torch.randn(tokens, hk, d, device="cuda", generator=g).to(DTYPE)
        sets.append((q, k, torch.empty_like(q), torch.empty_like(k)))
    wq = (torch.randn(d, device="cuda", generator=g) * 0.1 + 1).to(DTYPE)
    wk = (torch.randn(d, device="cuda", generator=g) * 0.1 + 1).to(DTYPE)
    return sets, wq, wk


def qkv_sets(tokens, hq, hk, d, count):
    out = []
    for _ in range(count):
        qkv = torch.randn(tokens, (hq + 2 * hk) * d, device="cuda").to(DTYPE)
        out.append((qkv[:, :hq * d].view(tokens, hq, d), qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d),
                    torch.empty(tokens, hq, d, device="cuda", dtype=DTYPE),
                    torch.empty(tokens, hk, d, device="cuda", dtype=DTYPE)))
    return out


# ---------------------------------------------------------------------------------------------

def peer_agrees(name, fn, q, k, wq, wk, ref_q, ref_k, errors) -> bool:
    """A peer's normed q and k within two bf16 roundings of the float64 reference (on their [T, heads, d]
    shape); off it, the row's errors say so and the peer is not timed."""
    return report.agrees(name, zip(fn(q, k, wq, wk), (ref_q, ref_k)), 2 * qkn.tolerance(DTYPE), errors)


def bench_model(model, hq, hk, tokens_list, peers, empty_fn, sweep, log):
    d = HEAD_DIM
    rows, sweep_rows = [], []
    for tokens in tokens_list:
        nbytes = tokens * (hq + hk) * d * DTYPE.itemsize  # q + k, read once and written once
        decode = tokens <= 128
        count = 1 if decode else timing.input_sets(2 * nbytes)
        sets, wq, wk = make_sets(tokens, hq, hk, d, count)
        errors = []
        shape = qkn.Shape(tokens, hq, hk, d, checks.DTYPE_NAME[DTYPE], eps=EPS)
        cfg = qkn.config_for(shape)
        r = {"model": model, "tokens": tokens, "bytes": 2 * nbytes, "errors": errors, "variant": cfg.variant().key()}

        def ours(i):
            q, k, oq, ok = sets[i % count]
            rosekernels.qk_norm(q, k, wq, wk, EPS, out_q=oq, out_k=ok)

        def peer_step(fn):
            return lambda i: fn(*sets[i % count][:2], wq, wk)

        # correctness guard: a benchmark of wrong results is worthless
        q, k, oq, ok = sets[0]
        ours(0)
        ref_q, ref_k = qkn.reference(q, k, wq, wk, EPS)
        for got, ref in ((oq, ref_q), (ok, ref_k)):
            err = ((got.double() - ref).abs() / (1 + ref.abs())).max().item()
            if not err <= qkn.tolerance(DTYPE):
                errors.append(f"ours: wrong result, error {err:.3g}")
        row_peers = {name: fn for name, fn in peers.items()
                     if fn is not None and peer_agrees(name, fn, q, k, wq, wk, ref_q, ref_k, errors)}
        del ref_q, ref_k

        if decode:
            raw = qkn.compile(cfg).fn
            dummy = torch.empty(16, device="cuda", dtype=torch.float32)
            r["ours_graph_us"] = measure("ours graph", lambda: graph_time_us(lambda _: ours(0), GRAPH_CALLS), errors)
            r["empty_graph_us"] = measure("empty graph", lambda: graph_time_us(lambda _: empty_fn(dummy), GRAPH_CALLS), errors)
            # The floor of any kernel that must read its input before writing: one torch copy of q+k's bytes.
            flat_src = torch.cat([q.flatten(), k.flatten()])
            flat_dst = torch.empty_like(flat_src)
            r["copy_graph_us"] = measure("copy graph", lambda: graph_time_us(lambda _: flat_dst.copy_(flat_src), GRAPH_CALLS), errors)
            for name in PEERS:
                if row_peers.get(name) is not None:
                    fn = row_peers[name]
                    r[f"{name}_graph_us"] = measure(f"{name} graph", lambda: graph_time_us(lambda _: fn(q, k, wq, wk), GRAPH_CALLS), errors)
            r["host_us"] = {
                "qk_norm(out given)": measure("host", lambda: host_time_us(lambda _: ours(0)), errors),
                "qk_norm(allocating)": measure("host", lambda: host_time_us(lambda _: rosekernels.qk_norm(q, k, wq, wk, EPS)), errors),
                "CompiledKernel.fn": measure("host", lambda: host_time_us(lambda _: raw(q, k, wq, wk, oq, ok, None, None)), errors),
                "torch.ops.rosekernels.qk_norm": measure("host", lambda: host_time_us(
                    lambda _: torch.ops.rosekernels.qk_norm(q, k, wq, wk, oq, ok, EPS, 0.0)), errors),
                "empty CuTeDSL kernel": measure("host", lambda: host_time_us(lambda _: empty_fn(dummy)), errors),
            }
            for name in ("quack", "torch_eager"):
                if row_peers.get(name) is not None:
                    fn = row_peers[name]
                    r["host_us"][name] = measure(f"{name} host", lambda: host_time_us(lambda _: fn(q, k, wq, wk)), errors)
        else:
            r["ours_us"] = measure("ours", lambda: auto_event_time_us(ours), errors)
            r["copy_us"] = measure("copy", lambda: copy_time_us(nbytes), errors)
            views = qkv_sets(tokens, hq, hk, d, count)
            r["ours_qkv_views_us"] = measure("ours qkv views", lambda: auto_event_time_us(
                lambda i: rosekernels.qk_norm(*views[i % count][:2], wq, wk, EPS, out_q=views[i % count][2],
                                      out_k=views[i % count][3])), errors)
            del views
            for name in PEERS:
                if row_peers.get(name) is not None:
                    r[f"{name}_us"] = measure(name, lambda: auto_event_time_us(peer_step(row_peers[name])), errors)

        if sweep:
            s = {"model": model, "tokens": tokens,
                 "warps_needed": modes.warps_needed(tokens * (hq + hk), cfg.threads_per_head),
                 "times": {}, "modes": {}}
            for c in sweep_configs(shape, decode):
                fn = qkn.compile(c).fn
                label = "decode" if c.mode == "decode" else f"{c.warps}w x{c.rows_per_thread} {c.cache_hint}"
                s["modes"][label] = (c.warps, c.rows_per_thread, c.cache_hint)
                step = (lambda i, fn=fn: fn(*sets[i % count][:2], wq, wk, *sets[i % count][2:], None, None))
                if decode:
                    s["times"][label] = measure(label, lambda: graph_time_us(lambda _: step(0), GRAPH_CALLS), errors)
                else:
                    s["times"][label] = measure(label, lambda: auto_event_time_us(step), errors)
            sweep_rows.append(s)
        rows.append(r)
        print(json.dumps(r, default=str), flush=True)
        sets.clear()  # free the inputs before the next size
        torch.cuda.empty_cache()
    return rows, sweep_rows


def sweep_configs(shape, decode):
    """The decode config, then the prefill block shapes: every candidate at prefill sizes; at decode
    sizes (where decode should win) without cache hints, which only matter for streaming sizes."""
    decode_cfg = qkn.config_for(dataclasses.replace(shape, tokens=1))
    if not decode:
        return [decode_cfg] + qkn.candidates(shape)
    return [decode_cfg] + [dataclasses.replace(decode_cfg, mode="prefill", warps=w, rows_per_thread=r)
                           for w in modes.PREFILL_WARPS for r in ROWS_PER_THREAD]


def markdown(env, rows, sweep_rows, table, log):
    out = [f"# qk_norm benchmark ({env['gpu']}, {env['sms']} SMs)", "",
           f"torch {env['torch']}, quack {env['quack']}, FlashInfer {env.get('flashinfer', '-')}, "
           f"liger {env['liger_kernel']}, {env['toolchain']}. "
           f"bf16 q/k/weights, d={HEAD_DIM}. Copy of 1 GiB: {fmt(env.get('copy_1gib_gbs'), 0)} GB/s.", ""]
    for model in MODELS:
        pre = [r for r in rows if r["model"] == model and "ours_us" in r]
        if pre:
            out += [f"## {model} prefill (CUDA events, inputs rotated past L2)", "",
                    "| T | ours us | GB/s | % copy | qkv views us | " + " | ".join(f"{p} us | x" for p in PEERS) + " |",
                    "|---" * (5 + 2 * len(PEERS)) + "|"]
            for r in pre:
                gbs = r["bytes"] / r["ours_us"] / 1e3 if r.get("ours_us") else None
                pct = 100 * r["copy_us"] / r["ours_us"] if r.get("copy_us") and r.get("ours_us") else None
                cells = [str(r["tokens"]), fmt(r.get("ours_us")), fmt(gbs, 0), fmt(pct), fmt(r.get("ours_qkv_views_us"))]
                for p in PEERS:
                    cells += [fmt(r.get(f"{p}_us")), fmt(ratio(r.get(f"{p}_us"), r.get("ours_us")), 2)]
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
        dec = [r for r in rows if r["model"] == model and "ours_graph_us" in r]
        if dec:
            out += [f"## {model} decode (device time per call inside a CUDA graph of {GRAPH_CALLS} calls)", "",
                    "| T | ours us | empty kernel us | ours/empty | copy kernel us | ours/copy | "
                    + " | ".join(f"{p} us | x" for p in PEERS) + " |",
                    "|---" * (6 + 2 * len(PEERS)) + "|"]
            for r in dec:
                cells = [str(r["tokens"]), fmt(r.get("ours_graph_us"), 2), fmt(r.get("empty_graph_us"), 2),
                         fmt(ratio(r.get("ours_graph_us"), r.get("empty_graph_us")), 2),
                         fmt(r.get("copy_graph_us"), 2), fmt(ratio(r.get("ours_graph_us"), r.get("copy_graph_us")), 2)]
                for p in PEERS:
                    cells += [fmt(r.get(f"{p}_graph_us"), 2), fmt(ratio(r.get(f"{p}_graph_us"), r.get("ours_graph_us")), 2)]
                out.append("| " + " | ".join(cells) + " |")
            out += ["", f"### {model} eager host time per call (us, wall clock of a 3000-call loop)", ""]
            keys = list(dec[0].get("host_us", {}))
            out += ["| T | " + " | ".join(keys) + " |", "|---" * (1 + len(keys)) + "|"]
            for r in dec:
                out.append(f"| {r['tokens']} | " + " | ".join(fmt(r.get("host_us", {}).get(k), 2) for k in keys) + " |")
            out.append("")
    if sweep_rows:
        labels = list(dict.fromkeys(k for s in sweep_rows for k in s["times"]))
        out += ["## Block-shape sweep (us; decode sizes in a CUDA graph, prefill with events)", "",
                "| model | T | warps needed | " + " | ".join(labels) + " | best |", "|---" * (4 + len(labels)) + "|"]
        for s in sweep_rows:
            t = {k: v for k, v in s["times"].items() if v is not None}
            best = min(t, key=t.get) if t else "-"
            out.append(f"| {s['model']} | {s['tokens']} | {s['warps_needed']} | "
                       + " | ".join(fmt(s["times"].get(k), 2) for k in labels) + f" | {best} |")
        out += ["", "Recommended `PREFILL_TABLE['qk_norm']` (warps needed up to, warps per block, rows per thread, "
                "cache hint):",
                "", f"    {tuple(table)!r}", ""]
    out += ["## Targets", ""] + targets(rows) + [""]
    errs = [f"- T={r['tokens']} {r['model']}: {e}" for r in rows for e in r["errors"]]
    if errs or log:
        out += ["## Errors / unavailable peers", ""] + errs + [f"- {line}" for line in log] + [""]
    return "\n".join(out)


def targets(rows):
    lines = []
    for r in rows:
        tag = f"{r['model']} T={r['tokens']}"
        if r["tokens"] >= 8192 and r.get("ours_us"):
            pct = 100 * r["copy_us"] / r["ours_us"] if r.get("copy_us") else None
            vq = ratio(r.get("quack_us"), r["ours_us"])
            ve = ratio(r.get("torch_eager_us"), r["ours_us"])
            lines.append(f"- {tag}: {fmt(pct)}% of copy (>= 93), {fmt(vq, 3)}x quack (>= 1.03), "
                         f"{fmt(ve, 2)}x torch eager (>= 4)")
        if r.get("ours_graph_us"):
            ve = ratio(r["ours_graph_us"], r.get("empty_graph_us"))
            vq = ratio(r.get("quack_graph_us"), r["ours_graph_us"])
            host = r.get("host_us", {}).get("qk_norm(out given)")
            vc = ratio(r["ours_graph_us"], r.get("copy_graph_us"))
            lines.append(f"- {tag}: graph {fmt(ve, 2)}x empty kernel (<= 1.3; a copy of the same bytes: {fmt(vc, 2)}x), "
                         f"{fmt(vq, 2)}x quack (>= 1.5), host {fmt(host, 2)} us/call (<= 5)")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_out(ap)
    ap.add_argument("--quick", action="store_true", help="Qwen3-8B only, T in (1, 128, 8192, 32768)")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    report.require_gpu()
    torch.manual_seed(0)
    env = report.environment(("quack", "flashinfer", "liger_kernel", "triton"))
    log = []
    env["copy_1gib_gbs"] = copy_gbs()
    empty_fn = empty_cutedsl_kernel()
    models = {"Qwen3-8B": MODELS["Qwen3-8B"]} if args.quick else MODELS
    tokens_list = (1, 128, 8192, 32768) if args.quick else DECODE_T + PREFILL_T
    rows, sweep_rows = [], []
    t0 = time.time()
    factories = peer_factories(HEAD_DIM)  # one set for both models: torch.compile compiles once (dynamic)
    peers = {name: report.try_peer(name, factories[name], log) for name in PEERS}
    for model, (hq, hk) in models.items():
        r, s = bench_model(model, hq, hk, tokens_list, peers, empty_fn, not args.no_sweep, log)
        rows += r
        sweep_rows += s
    table = report.recommend_table(sweep_rows)
    env["wall_s"] = round(time.time() - t0, 1)
    result = {"env": env, "rows": rows, "sweep": sweep_rows, "recommended_prefill_table": table,
              "current_prefill_table": modes.PREFILL_TABLE["qk_norm"], "log": log}
    report.write(args.out, "qk_norm", result, markdown(env, rows, sweep_rows, table, log))


if __name__ == "__main__":
    main()
