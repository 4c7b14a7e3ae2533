"""The gated GEMM (SwiGLU in one kernel) against what torch runs instead; writes gemm_swiglu.json + .md
(with --sweep: gemm_swiglu_sweep.json + .md, the data tools/fit_gemm_decode.py fits, committed gzipped).

    python bench/gemm_swiglu.py [--out bench/results] [--quick] [--sweep]

out = silu(x @ gate^T) * (x @ up^T), bf16, on the MLP shapes (intermediate x hidden) of Qwen3-8B
(12288 x 4096), Llama-3-8B and Mistral-7B (14336 x 4096) and Qwen2.5-7B (18944 x 3584), at
M = 1, 8, 16, 32, 64, 96, 128 tokens (decode: device time per call in CUDA graphs, the methods'
graphs replayed interleaved) and 1024, 8192 (prefill: CUDA events, methods interleaved). The weights
(200-280 MB) are far larger than the L2, so one input set is read from memory on every call.

- rosekernels: rosekernels.gemm(x, gate_up, activation="silu", gated=True), gate and up rows
  interleaved once (rosekernels.gate_up_rows);
- "2 linears + silu*mul": F.silu(F.linear(x, gate)) * F.linear(x, up), as transformers' Qwen3MLP runs it;
- "stacked linear + silu*mul": one cuBLAS GEMM over the stacked [gate; up] weight, then silu-and-mul
  on its two halves (what engines do without a fused kernel);
- "stacked linear": that GEMM alone (the bar the epilogue is measured against).
Every method's output is checked against a float32 computation of the same bf16 inputs.
--sweep also times every decode config of the gated kernel (as bench/gemm_leakyrelu.py --sweep does),
written as the JSON's "results" in the form tools/fit_gemm_decode.py fits (N counting gate and up rows).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gemm_sweep  # noqa: E402
import report  # noqa: E402
import timing  # noqa: E402
from report import fmt, measure  # noqa: E402
import rosekernels  # noqa: E402
from rosekernels.kernels import gemm_leakyrelu_plan as plan  # noqa: E402

MODELS = {"qwen3-8b": (12288, 4096), "llama-3-8b / mistral-7b": (14336, 4096), "qwen2.5-7b": (18944, 3584)}
DECODE_M = (1, 8, 16, 32, 64, 96, 128)
PREFILL_M = (1024, 8192)
TOLERANCE = 2e-2  # max |out - ref| / (1 + |ref|): bf16 outputs, different summation orders
METHODS = ("rosekernels", "2 linears + silu*mul", "stacked linear + silu*mul", "stacked linear")


def methods(x, gate, up):
    inter = gate.shape[0]
    stacked = torch.cat([gate, up])
    gate_up = rosekernels.gate_up_rows(gate, up)
    out = torch.empty(x.shape[0], inter, device="cuda", dtype=x.dtype)
    y = torch.empty(x.shape[0], 2 * inter, device="cuda", dtype=x.dtype)

    def stacked_silu_mul():
        torch.matmul(x, stacked.t(), out=y)
        return torch.mul(F.silu(y[:, :inter]), y[:, inter:], out=out)

    return {"rosekernels": lambda: rosekernels.gemm(x, gate_up, activation="silu", gated=True, out=out),
            "2 linears + silu*mul": lambda: F.silu(F.linear(x, gate)) * F.linear(x, up),
            "stacked linear + silu*mul": stacked_silu_mul,
            "stacked linear": lambda: torch.matmul(x, stacked.t(), out=y)}


def sweep_shape(x, gate, up):
    """Every decode config of the gated shape timed in a CUDA graph, the heuristic's marked."""
    m, hidden = x.shape
    shape = plan.GemmShape(m=m, n=2 * gate.shape[0], k=hidden, dtype="bf16", activation="silu", gated=True)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    pick = plan.config_for(shape, sm)
    out = torch.empty(m, gate.shape[0], device="cuda", dtype=x.dtype)
    sets = [(x, rosekernels.gate_up_rows(gate, up), None, out)]
    return {"m": m, "n": shape.n, "k": hidden, "gated": True, "config": pick.variant().key(), "splits": pick.splits,
            "raster_group": pick.raster_group, "sweep": gemm_sweep.sweep(shape, sets, 2 * m * shape.n * hidden, sm)}


def bench_shape(m, inter, hidden, rounds, errors, sweep=False):
    g = torch.Generator(device="cuda").manual_seed(m + inter)
    x = torch.randn(m, hidden, device="cuda", generator=g).to(torch.bfloat16)
    gate, up = ((torch.randn(inter, hidden, device="cuda", generator=g) * hidden ** -0.5).to(torch.bfloat16)
                for _ in range(2))
    fns = methods(x, gate, up)
    ref = F.silu(x.float() @ gate.float().t()) * (x.float() @ up.float().t())
    for name in METHODS[:-1]:
        got = fns[name]().float()
        err = ((got - ref).abs() / (1 + ref.abs())).max().item()
        if not err <= TOLERANCE:
            errors.append(f"{m}x{inter}x{hidden} {name}: error {err:.3g} > {TOLERANCE}")
    del ref
    steps = {name: (lambda i, f=fn: f()) for name, fn in fns.items()}
    if m <= DECODE_M[-1]:
        us = timing.interleaved_graph_time_us(steps, calls=50, rounds=rounds, warmup=3)
    else:
        us = timing.interleaved_time_us(steps, calls_per_round=5 if m > 2048 else 20, rounds=rounds)
    weights = 2 * inter * hidden * 2
    row = {"m": m, "inter": inter, "hidden": hidden, "us": us, "weight_gbs": weights / us["rosekernels"] / 1e3,
           "speedup": {name: us[name] / us["rosekernels"] for name in METHODS[1:] if name in us}}
    if sweep and m <= plan.DECODE_MAX_M:
        row["sweep"] = sweep_shape(x, gate, up)
    return row


def markdown(env, rows, errors):
    out = [f"# Gated GEMM (SwiGLU) on {env['gpu']}", "",
           f"torch {env['torch']}, {env['toolchain']}, bf16; copy {fmt(env['copy_gbs'], 0)} GB/s. "
           "Times in us; speedups are the peer's time over rosekernels'.", "",
           "| model | M | " + " | ".join(f"{n} us" for n in METHODS) + " | vs " + " | vs ".join(METHODS[1:])
           + " | weights GB/s |", "|---|---" + "|---" * (2 * len(METHODS)) + "|"]
    for name, (inter, hidden) in MODELS.items():
        for r in (r for r in rows if (r["inter"], r["hidden"]) == (inter, hidden)):
            out.append(f"| {name} | {r['m']} | " + " | ".join(fmt(r["us"].get(n), 1) for n in METHODS) + " | "
                       + " | ".join(f"{fmt(r['speedup'].get(n), 3)}x" for n in METHODS[1:])
                       + f" | {fmt(r['weight_gbs'], 0)} |")
    slower = [r for r in rows if r["speedup"].get("stacked linear + silu*mul", 2) < 1.0]
    out += ["", f"Shapes where the fused kernel is slower than the stacked GEMM + silu*mul: {len(slower)} of {len(rows)}"
            + (": " + ", ".join(f"{r['m']}x{r['inter']}x{r['hidden']}" for r in slower) if slower else "."), ""]
    if errors:
        out += ["## Errors", ""] + [f"- {e}" for e in errors] + [""]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    report.add_out(ap)
    ap.add_argument("--quick", action="store_true", help="Qwen3-8B only, M = 1, 16, 128, 1024")
    ap.add_argument("--sweep", action="store_true", help="also time every decode config of the gated kernel")
    args = ap.parse_args()
    report.require_gpu()
    t0 = time.time()
    env = {**report.environment(), "copy_gbs": timing.copy_gbs()}
    models = {"qwen3-8b": MODELS["qwen3-8b"]} if args.quick else MODELS
    ms = (1, 16, 128, 1024) if args.quick else DECODE_M + PREFILL_M
    rounds = 5 if args.quick else 15
    errors, rows = [], []
    for inter, hidden in models.values():
        for m in ms:
            row = measure(f"{m}x{inter}x{hidden}", lambda: bench_shape(m, inter, hidden, rounds, errors, args.sweep),
                          errors)
            if row:
                rows.append(row)
                print(f"{m}x{inter}x{hidden}: " + ", ".join(f"{n} {fmt(s, 3)}x" for n, s in row["speedup"].items()),
                      flush=True)
            torch.cuda.empty_cache()
    data = {"env": env, "rows": rows, "errors": errors}
    if args.sweep:
        data["results"] = [row.pop("sweep") for row in rows if "sweep" in row]
    stem = "gemm_swiglu_sweep" if args.sweep else "gemm_swiglu"
    where = report.write(args.out, stem, data, markdown(env, rows, errors))
    print(f"wrote {stem}.json and .md under {where} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
