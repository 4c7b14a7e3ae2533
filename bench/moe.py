"""Benchmark MoE dispatch / combine (TP=1) against torch eager and torch.compile; writes JSON + markdown.

    python bench/moe.py [--out bench/results] [--tokens 1,32,128,512,4096,8192] [--models ...] [--no-compile]
                        [--compile-tokens 1,128,512,8192]

Shapes: Qwen3-30B-A3B (H=2048, E=128, k=8) and DeepSeek-V3-like (H=7168, E=256, k=8), bf16 tokens,
fp32 router weights, a realistic routing (k distinct experts per token from random logits), block
size 128, the default (worst-case) capacity. In the same run: the device copy ceiling (one
1 GiB copy_), rosekernels (auto mode, and both modes forced: where they cross), torch eager
(argsort + index_select/index_copy_ for dispatch, index_add_ for combine, sync-free so that it can
be captured too) and torch.compile of it (compiled once per shape, dynamic=False, after a dynamo reset, and
checked against eager torch; a shape where it fails is recorded and skipped).

Times are per call, the median of repetitions: eager = CUDA events around many back-to-back calls
(host overhead included where it dominates); graph = the same calls captured in one CUDA graph,
replay time / calls (decode sizes, T <= 512); host = wall time per call of a short burst of calls
without synchronisation (what the CPU spends issuing one call; bursts are short enough that the launch
queue does not fill). Inputs AND output buffers rotate over sets spanning
more than twice the L2, so every call reads and writes HBM. Bytes that must move (the brief's model):
dispatch reads x once per (token, choice) and writes that copy: 2*T*k*H*2 B; combine reads k rows per
token and writes one: (T*k + T)*H*2 B. Our dispatch reads each token once, so its effective GB/s may
exceed the copy ceiling. Every rosekernels result is checked against the routing before it is timed.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402
import timing  # noqa: E402
from report import fmt  # noqa: E402
import rosekernels  # noqa: E402
from rosekernels.kernels import moe_combine as mc  # noqa: E402
from rosekernels.kernels import moe_dispatch as md  # noqa: E402

DTYPE = torch.bfloat16
BLOCK = 128
MODELS = md.MODELS  # name -> (hidden, experts, top-k)
TOKENS = (1, 32, 128, 512, 4096, 8192)
GRAPH_MAX_TOKENS = 512
TARGETS = {"prefill_pct_of_copy": 80.0, "decode_graph_us": 10.0, "speedup_vs_torch": 5.0, "eager_host_us": 20.0}


# ---------------------------------------------------------------------------------------------
# Timing (bench/timing.py); call(i) runs on input set i of n.

def timers(n: int) -> tuple:
    """(how, timer): eager host time to enqueue, eager device time, device time inside a CUDA graph."""
    def rotating(call):
        return lambda i: call(i % n)
    return (("host", lambda call: timing.enqueue_time_us(rotating(call), calls=32, reps=11, warmup=3 * n)),
            ("eager", lambda call: timing.event_time_us(rotating(call), max(n, 8), warmup=3 * n)),
            ("graph", lambda call: timing.graph_time_us(rotating(call), max(64, n), warmup=n)))


# ---------------------------------------------------------------------------------------------
# torch reference implementation (sync-free: capturable in a graph).

def torch_dispatch(x, ids, num_experts, block, buffer):
    """argsort by expert, index_select the tokens, index_copy_ them to their padded rows."""
    T, k = ids.shape
    P = T * k
    e = ids.reshape(-1).long()
    e = torch.where(e >= 0, e, num_experts)  # dropped pairs sort last, into a spare row
    order = torch.argsort(e, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=x.device).scatter_add_(0, e, torch.ones_like(e))
    padded = (counts[:num_experts] + block - 1) // block * block
    offsets = torch.cat([padded.new_zeros(1), torch.cumsum(padded, 0)])
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    se = e[order]
    rank = torch.arange(P, device=x.device) - first[se]
    spare = buffer.shape[0] - 1
    slot_sorted = torch.where(se < num_experts, offsets[se.clamp(max=num_experts - 1)] + rank, spare)
    buffer.index_copy_(0, slot_sorted, x.index_select(0, order // k))
    slot_map = torch.empty(P, dtype=torch.long, device=x.device).scatter_(0, order, slot_sorted)
    return buffer, counts[:num_experts], offsets, slot_map.view(T, k)


def torch_combine(expert_out, weights, slot_map):
    """index_select the k rows of every token, weight them, index_add_ them into fp32 rows."""
    T, k = slot_map.shape
    s = slot_map.reshape(-1)
    rows = expert_out.index_select(0, s).float() * weights.reshape(-1, 1).float()
    out = torch.zeros(T, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    out.index_add_(0, torch.arange(T * k, device=s.device) // k, rows)
    return out.to(expert_out.dtype)


def pipeline(dispatch, combine, s, num_experts):
    _, _, _, slot_map = dispatch(s["x"], s["ids"], num_experts, BLOCK, s["buf"])
    return combine(s["rbuf"], s["w"], slot_map)


def compile_shape(s, num_experts, log):
    """torch.compile of the torch reference for this shape only (dynamic=False; a dynamo reset first,
    so no earlier shape's graphs or recompile limits are involved), warmed up and checked against
    eager torch: (dispatch, combine)."""
    torch._dynamo.reset()
    t0 = time.time()
    cd = torch.compile(torch_dispatch, dynamic=False)
    cc = torch.compile(torch_combine, dynamic=False)
    got = cd(s["x"], s["ids"], num_experts, BLOCK, s["buf"])
    ref = torch_dispatch(s["x"], s["ids"], num_experts, BLOCK, s["buf"].clone())
    for a, b in zip(got[1:], ref[1:]):
        if not torch.equal(a, b):
            raise AssertionError("compiled dispatch differs from eager torch")
    slot_map = s["res"].slot_map
    got_c, ref_c = cc(s["rbuf"], s["w"], slot_map), torch_combine(s["rbuf"], s["w"], slot_map)
    if not torch.allclose(got_c.float(), ref_c.float(), rtol=2**-7, atol=1e-2):
        raise AssertionError("compiled combine differs from eager torch")
    torch.cuda.synchronize()
    log(f"  torch.compile: {time.time() - t0:.1f} s")
    return cd, cc


# ---------------------------------------------------------------------------------------------
# One shape.

def make_sets(T, H, E, k, l2_bytes, seed=0):
    """Input/output sets spanning > 2 L2s (at least 2): x, ids, weights, dispatch buffer (one spare
    row for the torch reference's dropped pairs), combine output."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    capacity = md.default_capacity(T, k, E, BLOCK)
    per_set = (T + capacity + 1 + T) * H * 2
    n = max(2, min(64, math.ceil(2 * l2_bytes / per_set)))
    sets = []
    for _ in range(n):
        x = torch.randn(T, H, generator=g).to(device="cuda", dtype=DTYPE)
        ids = md.random_topk_ids(T, E, k, g, "cuda")
        w = torch.rand(T, k, generator=g).softmax(1).cuda()
        buf = torch.empty(capacity + 1, H, dtype=DTYPE, device="cuda")
        sets.append({"x": x, "ids": ids, "w": w, "buf": buf, "rbuf": buf[:-1],  # ours: no spare row
                     "out": torch.empty(T, H, dtype=DTYPE, device="cuda")})
    return sets


def bench_shape(model, T, compile_peer, log):
    H, E, k = MODELS[model]
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    sets = make_sets(T, H, E, k, l2)
    n = len(sets)
    row = {"model": model, "tokens": T, "hidden": H, "experts": E, "topk": k, "sets": n,
           "mode": md.choose_mode(T, k), "combine_mode": mc.choose_mode(T),
           "bytes_dispatch": 2 * T * k * H * 2, "bytes_combine": (T * k + T) * H * 2}
    errors = []

    # Our results per set: the combine reads the dispatch buffer as its "expert output".
    def ours_dispatch(i, mode=None):
        s = sets[i]
        s["res"] = rosekernels.moe_dispatch(s["x"], s["ids"], E, block_size=BLOCK, buffer=s["rbuf"], mode=mode)

    def ours_combine(i):
        s = sets[i]
        rosekernels.moe_combine(s["res"].buffer, s["w"], s["res"].slot_map, s["out"])

    def ours_both(i):
        ours_dispatch(i)
        ours_combine(i)

    for i in range(n):
        ours_dispatch(i)
    for mode in ("decode", "prefill")[T * k > md.DECODE_PAIRS_LIMIT:]:  # correctness, before any timing
        ours_dispatch(0, mode)
        md.check_dispatch(sets[0]["x"], sets[0]["ids"], E, BLOCK, sets[0]["res"])
    ours_combine(0)
    mc.check_combine(sets[0]["res"].buffer, sets[0]["w"], sets[0]["res"].slot_map, sets[0]["out"])
    ours_dispatch(0)

    impls = {
        "rk_dispatch": ours_dispatch,
        "rk_dispatch_prefill": lambda i: ours_dispatch(i, "prefill"),
        "rk_combine": ours_combine,
        "rk_both": ours_both,
        "torch_dispatch": lambda i: torch_dispatch(sets[i]["x"], sets[i]["ids"], E, BLOCK, sets[i]["buf"]),
        "torch_combine": lambda i: torch_combine(sets[i]["rbuf"], sets[i]["w"], sets[i]["res"].slot_map),
    }
    if T * k <= md.DECODE_PAIRS_LIMIT:
        impls["rk_dispatch_decode"] = lambda i: ours_dispatch(i, "decode")
    impls["torch_both"] = lambda i: pipeline(torch_dispatch, torch_combine, sets[i], E)
    if compile_peer:
        missing = []
        compiled = report.try_peer("torch.compile", lambda: compile_shape(sets[0], E, log), missing)
        row["compile"] = missing[0] if missing else "ok"
        if compiled is not None:
            cd, cc = compiled
            impls["compile_dispatch"] = lambda i: cd(sets[i]["x"], sets[i]["ids"], E, BLOCK, sets[i]["buf"])
            impls["compile_combine"] = lambda i: cc(sets[i]["rbuf"], sets[i]["w"], sets[i]["res"].slot_map)
            impls["compile_both"] = lambda i: pipeline(cd, cc, sets[i], E)
    else:
        row["compile"] = "not run"

    for name, call in impls.items():
        for how, timer in timers(n):
            if how == "graph" and T > GRAPH_MAX_TOKENS:
                continue
            us = report.measure(f"{name} {how}", lambda: timer(call), errors)
            if us is not None:
                row[f"{name}_{how}_us"] = us
    row["errors"] = errors
    log(f"{model:14s} T={T:5d} " + " ".join(
        f"{k[:-3]}={v:.1f}" for k, v in row.items() if k.endswith("_us") and k.startswith("rk_")))
    return row


# ---------------------------------------------------------------------------------------------
# Report.

def best(row, name):
    """Graph time where measured (decode sizes), else eager."""
    return row.get(f"{name}_graph_us", row.get(f"{name}_eager_us"))


def summarize(rows, copy_gbps):
    for r in rows:
        for op, nbytes in (("dispatch", r["bytes_dispatch"]), ("combine", r["bytes_combine"])):
            t = best(r, f"rk_{op}")
            r[f"rk_{op}_gbps"] = None if t is None else nbytes / t / 1e3
            r[f"rk_{op}_pct_copy"] = None if t is None else 100 * nbytes / t / 1e3 / copy_gbps
            for peer in ("torch", "compile"):
                r[f"speedup_vs_{peer}_{op}"] = report.ratio(best(r, f"{peer}_{op}"), t)
        r["speedup_vs_torch_both"] = report.ratio(best(r, "torch_both"), best(r, "rk_both"))


def markdown(env, copy_gbps, rows):
    lines = [f"# MoE dispatch / combine (TP=1) on {env['gpu']}", "",
             f"torch {env['torch']}, {env['toolchain']}; device copy ceiling {copy_gbps:.0f} GB/s "
             "(read + write). Times in us per call: `graph` = inside a CUDA graph (T <= "
             f"{GRAPH_MAX_TOKENS}), else eager. GB/s on the bytes that must move (dispatch 2*T*k*H*2 B, "
             "combine (T*k+T)*H*2 B); our dispatch reads each token once, so it can beat the copy ceiling.", ""]
    for op in ("dispatch", "combine"):
        lines += [f"## {op}", "",
                  "| model | T | mode | rk us | rk GB/s | % copy | torch us | compile us | vs torch | vs compile "
                  "| rk eager us |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            mode = r["mode"] if op == "dispatch" else r["combine_mode"]
            lines.append(
                f"| {r['model']} | {r['tokens']} | {mode} | {fmt(best(r, f'rk_{op}'))} | {fmt(r[f'rk_{op}_gbps'], 0)} "
                f"| {fmt(r[f'rk_{op}_pct_copy'], 0)} | {fmt(best(r, f'torch_{op}'))} | {fmt(best(r, f'compile_{op}'))} "
                f"| {fmt(r[f'speedup_vs_torch_{op}'])}x | {fmt(r[f'speedup_vs_compile_{op}'])}x "
                f"| {fmt(r.get(f'rk_{op}_eager_us'))} |")
        lines.append("")
    lines += ["## dispatch + combine", "", "| model | T | rk us | torch us | compile us | vs torch |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens']} | {fmt(best(r, 'rk_both'))} | {fmt(best(r, 'torch_both'))} "
                     f"| {fmt(best(r, 'compile_both'))} | {fmt(r['speedup_vs_torch_both'])}x |")
    lines += ["", "## eager host time per call (us, CPU time to issue one call)", "",
              "| model | T | rk dispatch | torch dispatch | compile dispatch | rk combine | torch combine "
              "| compile combine | rk both | torch both | compile both | torch.compile |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cells = [fmt(r.get(f"{impl}_{op}_host_us")) for op in ("dispatch", "combine", "both")
                 for impl in ("rk", "torch", "compile")]
        lines.append(f"| {r['model']} | {r['tokens']} | " + " | ".join(cells) + f" | {r['compile']} |")
    lines += ["", "## dispatch: decode vs prefill variant (forced)", "",
              "| model | T | auto | decode us | prefill us |", "|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['mode']} | {fmt(best(r, 'rk_dispatch_decode'))} "
                     f"| {fmt(best(r, 'rk_dispatch_prefill'))} |")
    lines += ["", "## targets", ""] + [f"- {t}" for t in targets(rows)]
    errors = [f"{r['model']} T={r['tokens']}: {e}" for r in rows for e in r["errors"]]
    if errors:
        lines += ["", "## errors", ""] + [f"- {e}" for e in errors]
    return "\n".join(lines) + "\n"


def targets(rows):
    out = []
    for r in rows:
        tag = f"{r['model']} T={r['tokens']}"
        if r["tokens"] >= 4096:
            for op in ("dispatch", "combine"):
                p = r[f"rk_{op}_pct_copy"]
                ok = p is not None and p >= TARGETS["prefill_pct_of_copy"]
                out.append(f"{'PASS' if ok else 'MISS'} {tag} prefill {op}: {fmt(p, 0)}% of copy "
                           f"(target >= {TARGETS['prefill_pct_of_copy']:.0f}%)")
        if r["tokens"] == 128:
            for op in ("dispatch", "combine"):
                t = r.get(f"rk_{op}_graph_us")
                ok = t is not None and t <= TARGETS["decode_graph_us"]
                out.append(f"{'PASS' if ok else 'MISS'} {tag} decode {op} in a graph: {fmt(t, 2)} us "
                           f"(target <= {TARGETS['decode_graph_us']:.0f} us)")
                t = r.get(f"rk_{op}_host_us")
                ok = t is not None and t <= TARGETS["eager_host_us"]
                out.append(f"{'PASS' if ok else 'MISS'} {tag} {op} eager host time: {fmt(t, 1)} us per call "
                           f"(target <= {TARGETS['eager_host_us']:.0f} us)")
        for op in ("dispatch", "combine", "both"):
            s = r[f"speedup_vs_torch_{op}"]
            ok = s is not None and s >= TARGETS["speedup_vs_torch"]
            out.append(f"{'PASS' if ok else 'MISS'} {tag} {op} vs torch eager: {fmt(s)}x "
                       f"(target >= {TARGETS['speedup_vs_torch']:.0f}x)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    report.add_out(ap)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--compile-tokens", default=None,
                    help="token counts at which to run the torch.compile peer (default: all); each costs a compile")
    args = ap.parse_args()
    report.require_gpu()
    log = lambda m: print(m, flush=True)  # noqa: E731
    t0 = time.time()
    env = report.environment()
    copy_gbps = timing.copy_gbs()
    log(f"{env['gpu']}: device copy {copy_gbps:.0f} GB/s")
    tokens = [int(t) for t in args.tokens.split(",")]
    compile_tokens = set(tokens if args.compile_tokens is None else map(int, args.compile_tokens.split(",")))
    rows = []
    for model in args.models.split(","):
        for T in tokens:
            rows.append(bench_shape(model, T, not args.no_compile and T in compile_tokens, log))
            torch.cuda.empty_cache()
    summarize(rows, copy_gbps)
    doc = {"env": env, "copy_gbps": copy_gbps, "rows": rows, "targets": targets(rows),
           "seconds": time.time() - t0}
    where = report.write(args.out, "moe", doc, markdown(env, copy_gbps, rows))
    log(f"wrote moe.json and moe.md under {where} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
