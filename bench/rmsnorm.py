"""Benchmark rosekernels rmsnorm against quack, FlashInfer, liger-kernel and torch; writes JSON + markdown.

    python bench/rmsnorm.py [--out bench/results] [--quick] [--no-sweep]

Rows of hidden 2k..16k, bf16 x and weight, eps 1e-6, with and without a residual add (liger has
no fused residual; torch adds, then normalizes). Prefill sizes: CUDA-event time per call, inputs
rotated past L2, next to a same-size device copy (the ceiling). Decode sizes: device time per
call inside a CUDA graph. --sweep (default on) times every prefill block size (8/16/32 warps) and
prints the PREFILL_TABLE row for rosekernels/modes.py.
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
import rosekernels  # noqa: E402
from rosekernels import checks, modes  # noqa: E402
from rosekernels.kernels import rmsnorm as rms  # noqa: E402

DTYPE = torch.bfloat16
EPS = 1e-6
HIDDEN = (2048, 4096, 5120, 8192, 16384)
DECODE_ROWS = (1, 32, 128)
PREFILL_ROWS = (4096, 16384, 65536)
MAX_TENSOR_BYTES = 1 << 30


def peer_factories(residual: bool):
    def torch_eager():
        if residual:
            def f(x, w, r):
                h = x + r
                return F.rms_norm(h, (x.shape[-1],), w, EPS), h
            return f
        return lambda x, w, r: F.rms_norm(x, (x.shape[-1],), w, EPS)

    def torch_compiled():
        return torch.compile(torch_eager(), dynamic=True)

    def liger():
        if residual:
            raise RuntimeError("no fused residual add")
        from liger_kernel.ops.rms_norm import rms_norm_forward

        return lambda x, w, r: rms_norm_forward(x, w, EPS, 0.0, "llama", None)[0]

    def quack():
        from quack.rmsnorm import rmsnorm_fwd

        return lambda x, w, r: rmsnorm_fwd(x, w, residual=r, eps=EPS)[:2]

    def flashinfer():
        import flashinfer as fi

        if residual:
            def f(x, w, r):
                fi.fused_add_rmsnorm(x, r, w, EPS)  # in place (r += x, x = norm(r)): the bytes ours moves
                return x, r
            return f
        return lambda x, w, r: fi.rmsnorm(x, w, EPS)

    return {"quack": quack, "flashinfer": flashinfer, "liger": liger, "torch_eager": torch_eager,
            "torch_compile": torch_compiled}


PEERS = ("quack", "flashinfer", "liger", "torch_eager", "torch_compile")


def make_sets(rows, hidden, residual, count):
    sets = []
    for _ in range(count):
        x = torch.randn(rows, hidden, device="cuda").to(DTYPE)
        r = torch.randn(rows, hidden, device="cuda").to(DTYPE) if residual else None
        sets.append((x, r, torch.empty_like(x), torch.empty_like(x) if residual else None))
    w = (torch.randn(hidden, device="cuda") * 0.1 + 1).to(DTYPE)
    return sets, w


def peer_agrees(name, fn, x, w, r, ref_out, ref_h, errors) -> bool:
    """A peer's output on copies of the first set (FlashInfer's residual form works in place) within two bf16
    roundings of the float64 reference; off it, the row's errors say so and the peer is not timed."""
    got = fn(x.clone(), w, None if r is None else r.clone())
    outs = got if isinstance(got, tuple) else (got,)  # (out, h) with a residual; quack's (out, None) without
    refs = (ref_out, ref_h) if r is not None else (ref_out,)
    return report.agrees(name, zip(outs, refs), 2 * rms.tolerance(DTYPE), errors)


def bench_case(hidden, rows, residual, peers, sweep, log):
    nbytes = rows * hidden * DTYPE.itemsize  # x once; traffic counts x (+ residual) read, out (+ h) written
    traffic = nbytes * (4 if residual else 2)
    decode = rows <= 128
    count = 1 if decode else timing.input_sets(traffic)
    sets, w = make_sets(rows, hidden, residual, count)
    errors = []
    shape = rms.Shape(rows, hidden, checks.DTYPE_NAME[DTYPE], residual=residual, eps=EPS)
    cfg = rms.config_for(shape)
    res = {"hidden": hidden, "rows": rows, "residual": residual, "bytes": traffic, "errors": errors,
           "variant": cfg.variant().key()}

    def ours(i):
        x, r, out, ro = sets[i % count]
        rosekernels.rmsnorm(x, w, EPS, residual=r, out=out, residual_out=ro)

    x, r, out, ro = sets[0]
    ours(0)
    ref_out, ref_h = rms.reference(x, w, EPS, r)
    for got, ref in ((out, ref_out), (ro, ref_h)):
        if ref is not None:
            err = ((got.double() - ref).abs() / (1 + ref.abs())).max().item()
            if not err <= rms.tolerance(DTYPE):
                errors.append(f"ours: wrong result, error {err:.3g}")
    peers = {name: fn for name, fn in peers.items()
             if fn is not None and peer_agrees(name, fn, x, w, r, ref_out, ref_h, errors)}
    del ref_out, ref_h

    if decode:
        res["ours_graph_us"] = measure("ours graph", lambda: timing.graph_time_us(lambda _: ours(0)), errors)
        for name in PEERS:
            if peers.get(name) is not None:
                fn = peers[name]
                res[f"{name}_graph_us"] = measure(name, lambda: timing.graph_time_us(lambda _: fn(x, w, r)), errors)
    else:
        res["ours_us"] = measure("ours", lambda: timing.auto_event_time_us(ours), errors)
        res["copy_us"] = measure("copy", lambda: timing.copy_time_us(traffic // 2), errors)
        for name in PEERS:
            if peers.get(name) is not None:
                fn = peers[name]
                res[f"{name}_us"] = measure(name, lambda: timing.auto_event_time_us(
                    lambda i: fn(sets[i % count][0], w, sets[i % count][1])), errors)
    sweep_row = None
    if sweep and not decode and not residual:  # one table serves both; sweep the plain norm
        sweep_row = {"hidden": hidden, "rows": rows, "residual": residual,
                     "warps_needed": modes.warps_needed(rows, cfg.threads_per_row), "times": {}, "modes": {}}
        for c in [rms.config_for(dataclasses.replace(shape, rows=1))] + rms.candidates(shape):
            fn = rms.compile(c).fn
            label = "decode" if c.mode == "decode" else f"{c.block_warps}w {c.cache_hint}"
            sweep_row["modes"][label] = (c.warps, 1, c.cache_hint)
            sweep_row["times"][label] = measure(label, lambda: timing.auto_event_time_us(
                lambda i: fn(sets[i % count][0], w, *sets[i % count][1:], None)), errors)  # no fp8 scales
    print(json.dumps(res, default=str), flush=True)
    sets.clear()  # free the inputs before the next size
    torch.cuda.empty_cache()
    return res, sweep_row


def markdown(env, rows, sweep_rows, table, log):
    out = [f"# rmsnorm benchmark ({env['gpu']}, {env['sms']} SMs)", "",
           f"torch {env['torch']}, quack {env['quack']}, FlashInfer {env.get('flashinfer', '-')}, "
           f"liger {env['liger_kernel']}, {env['toolchain']}. "
           f"bf16 x/weight. Copy of 1 GiB: {fmt(env.get('copy_1gib_gbs'), 0)} GB/s.", ""]
    for residual in (False, True):
        pre = [r for r in rows if r["residual"] == residual and "ours_us" in r]
        title = "with residual add" if residual else "no residual"
        if pre:
            out += [f"## Prefill, {title} (CUDA events, inputs rotated past L2)", "",
                    "| hidden | rows | ours us | GB/s | % copy | " + " | ".join(f"{p} us | x" for p in PEERS) + " |",
                    "|---" * (5 + 2 * len(PEERS)) + "|"]
            for r in pre:
                gbs = r["bytes"] / r["ours_us"] / 1e3 if r.get("ours_us") else None
                pct = 100 * r["copy_us"] / r["ours_us"] if r.get("copy_us") and r.get("ours_us") else None
                cells = [str(r["hidden"]), str(r["rows"]), fmt(r.get("ours_us")), fmt(gbs, 0), fmt(pct)]
                for p in PEERS:
                    cells += [fmt(r.get(f"{p}_us")), fmt(ratio(r.get(f"{p}_us"), r.get("ours_us")), 2)]
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
        dec = [r for r in rows if r["residual"] == residual and "ours_graph_us" in r]
        if dec:
            out += [f"## Decode, {title} (device time per call in a CUDA graph)", "",
                    "| hidden | rows | ours us | " + " | ".join(f"{p} us | x" for p in PEERS) + " |",
                    "|---" * (3 + 2 * len(PEERS)) + "|"]
            for r in dec:
                cells = [str(r["hidden"]), str(r["rows"]), fmt(r.get("ours_graph_us"), 2)]
                for p in PEERS:
                    cells += [fmt(r.get(f"{p}_graph_us"), 2), fmt(ratio(r.get(f"{p}_graph_us"), r.get("ours_graph_us")), 2)]
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
    if sweep_rows:
        labels = list(dict.fromkeys(k for s in sweep_rows for k in s["times"]))
        out += ["## Block-size sweep (us, CUDA events)", "",
                "| hidden | rows | residual | warps needed | " + " | ".join(labels) + " | best |",
                "|---" * (5 + len(labels)) + "|"]
        for s in sweep_rows:
            t = {k: v for k, v in s["times"].items() if v is not None}
            best = min(t, key=t.get) if t else "-"
            out.append(f"| {s['hidden']} | {s['rows']} | {s['residual']} | {s['warps_needed']} | "
                       + " | ".join(fmt(s["times"].get(k), 2) for k in labels) + f" | {best} |")
        out += ["", "Recommended `PREFILL_TABLE['rmsnorm']` (warps needed up to, warps per block, rows per thread, "
                "cache hint):",
                "", f"    {tuple(table)!r}", ""]
    lines = []
    for r in rows:
        if r["hidden"] >= 4096 and r.get("ours_us") and r.get("quack_us"):
            lines.append(f"- hidden={r['hidden']} rows={r['rows']} residual={r['residual']}: "
                         f"{fmt(r['quack_us'] / r['ours_us'], 3)}x quack (>= 0.95)")
    out += ["## Targets", ""] + lines + [""]
    errs = [f"- hidden={r['hidden']} rows={r['rows']} residual={r['residual']}: {e}" for r in rows for e in r["errors"]]
    if errs or log:
        out += ["## Errors / unavailable peers", ""] + errs + [f"- {line}" for line in log] + [""]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_out(ap)
    ap.add_argument("--quick", action="store_true", help="hidden 4096/16384, rows 1 and 16384, no residual")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    report.require_gpu()
    env = report.environment(("quack", "flashinfer", "liger_kernel", "triton"))
    env["copy_1gib_gbs"] = timing.copy_gbs()
    hidden = (4096, 16384) if args.quick else HIDDEN
    row_list = (1, 16384) if args.quick else DECODE_ROWS + PREFILL_ROWS
    residuals = (False,) if args.quick else (False, True)
    log, rows, sweep_rows = [], [], []
    t0 = time.time()
    for residual in residuals:
        factories = peer_factories(residual)
        peers = {name: report.try_peer(f"{name} (residual={residual})", factories[name], log) for name in PEERS}
        for n in hidden:
            for m in row_list:
                if m * n * DTYPE.itemsize > MAX_TENSOR_BYTES:
                    continue
                r, s = bench_case(n, m, residual, peers, not args.no_sweep, log)
                rows.append(r)
                if s:
                    sweep_rows.append(s)
    table = report.recommend_table(sweep_rows)
    env["wall_s"] = round(time.time() - t0, 1)
    result = {"env": env, "rows": rows, "sweep": sweep_rows, "recommended_prefill_table": table,
              "current_prefill_table": modes.PREFILL_TABLE["rmsnorm"], "log": log}
    report.write(args.out, "rmsnorm", result, markdown(env, rows, sweep_rows, table, log))


if __name__ == "__main__":
    main()
