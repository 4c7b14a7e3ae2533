"""FP8 on Hopper (issue 44): the e4m3 GEMM, the quantization kernels, the e4m3 KV cache and a model in FP8,
against our bf16 kernels and torch's FP8 GEMM; fp8.json + fp8.md (+ the chart), in the gemm results family.

    python bench/fp8.py [--out bench/results] [--quick] [--sections decode,prefill,quantize,kv,e2e]

- decode GEMMs (M in {1, 8, 16, 32, 64, 128}) on the q, k/v, o, gate/up and down weights of Llama-3-8B,
  Qwen3-8B and Qwen2.5-7B: rosekernels.gemm_fp8 with per-tensor, per-channel and 128 x 128 block scales;
  torch._scaled_mm (cuBLASLt FP8) with per-tensor and rowwise scales; our bf16 gemm on the same shape;
  DeepGEMM's 1 x 128 x 128 x 128 GEMM where it imports. Each method's CUDA graph of calls over weight sets
  that together pass the L2 three times, replays interleaved (timing.interleaved_graph_time_us); the weight
  bandwidth as a share of the device copy bandwidth measured in the same run. The error of each of our
  schemes against the float64 product of its dequantized operands, in units of the bf16 output's own
  rounding error (gemm_fp8.check_out's ratio: the issue's bar is 2).
- prefill GEMMs (M = 4096, 8192): TFLOP/s, each method's CUDA graph of 5 calls replayed interleaved; our
  channel scheme also with the config the op plans on each other of gemm_fp8_plan.PREFILL_CLUSTERS (cuBLAS runs
  the same tile on none), until one is the heuristic or they are dropped.
- quantize_fp8 and rmsnorm's fused fp8 output (with the residual add): bytes moved against the copy
  bandwidth, rows of 4096 and of the MLP widths, per row and per 1 x 128 group, in CUDA graphs.
- decode attention over a KV cache, a cache of the query's dtype against e4m3 (attention_with_kvcache), B = 16,
  contexts 8k to 32k, Qwen3-8B's heads, in CUDA graphs; bf16 and fp16 queries, every sequence full or each
  one's length uniform in [S/2, S] (the split plan takes the capacity, so short sequences leave CTAs idle);
  FlashInfer's batch decode over the same caches (its own cache of the query's dtype against e4m3) where it
  imports (bench/flashinfer_peer.py).
- end to end: Qwen3-8B's geometry (rosekernels.hf.random_model, --layers layers, all 36 by default), decode at
  B = 16 after 2048 tokens of context on a static cache in CUDA graphs, the bf16 rosekernels arm against
  rosekernels.hf.apply(fp8=...) on an Fp8StaticCache (FP8 weights and KV cache), and the FP8 model's logits
  against the stock bf16 model's (cosine); also the FP8 arm with layer 0 kept in bf16 (fp8_exclude).
The issue's targets are checked at the end ("verdicts"); a peer that does not import or run is reported.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402
import timing  # noqa: E402
import flashinfer_peer  # noqa: E402
from report import fmt  # noqa: E402
from rosekernels import checks, fp8  # noqa: E402
from rosekernels.kernels.attention_decode_plan import DecodeConfig  # noqa: E402
from rosekernels.kernels.gemm_leakyrelu_plan import DECODE_MAX_M  # noqa: E402
from rosekernels.kernels.rmsnorm_plan import MAX_HIDDEN  # noqa: E402

DECODE_M = (1, 8, 16, 32, 64, 128)
PREFILL_M = (4096, 8192)
# (hidden, intermediate, q heads, kv heads, head dim) of the models whose weights the GEMMs take.
MODELS = {"llama-3-8b": (4096, 14336, 32, 8, 128), "qwen3-8b": (4096, 12288, 32, 8, 128),
          "qwen2.5-7b": (3584, 18944, 28, 4, 128)}
SCHEMES = ("tensor", "channel", "block")
KV_CONTEXTS = (8192, 16384, 32768)
KV_BATCH = 16
KV_QUERIES = ("bf16", "fp16")
KV_LENGTHS = ("full", "ragged")  # ragged: each sequence's length uniform in [S/2, S]
KV_STAGES = DecodeConfig.num_stages  # the ring depth kvcache_config_for keeps
KV_PEER_PAGE = 16  # FlashInfer reads the contiguous caches as pages of this many rows
KV_VARIANTS = {f"e4m3 cache, {2 * KV_STAGES} stages": {"num_stages": 2 * KV_STAGES},
               "e4m3 cache, widened in shared memory": {"widen_regs": False},
               f"e4m3 cache, {2 * KV_STAGES} stages, widen warps": {"num_stages": 2 * KV_STAGES, "widen_warps": True,
                                                                    "widen_regs": False}}
# The targets.
DECODE_VS_BF16, DECODE_VS_SCALED_MM, DECODE_COPY_PCT, BIG_WEIGHT = 1.7, 1.05, 75.0, 16 << 20
PREFILL_VS_BF16, PREFILL_VS_SCALED_MM = 1.5, 1.0
ERROR_RATIO, QUANT_COPY_PCT, KV_SPEEDUP, KV_CONTEXT = 2.0, 90.0, 1.6, 8192
E2E_SPEEDUP, E2E_COS = 1.4, 0.99
E2E_CONTEXT = 2048
E2E_LAYERS = 36  # Qwen3-8B's decoder layers: with fewer, the bf16 lm_head's bytes weigh more in both arms
SECTIONS = ("decode", "prefill", "quantize", "kv", "e2e")  # what --sections may choose
KEEP_FIRST = "fp8, layer 0 in bf16"  # the end-to-end arm with apply(fp8_exclude=["model.layers.0"])


def weights(model: str) -> list[tuple[str, int, int, bool]]:
    """(role, N, K, gated) of a model's dense-layer GEMMs."""
    hidden, inter, hq, hkv, d = MODELS[model]
    return [("q", hq * d, hidden, False), ("k/v", hkv * d, hidden, False), ("o", hidden, hq * d, False),
            ("gate/up", 2 * inter, hidden, True), ("down", hidden, inter, False)]


# ---------------------------------------------------------------------------------------------
# Summaries and verdicts (no GPU: tests/test_bench_fp8.py).

def decode_summary(row: dict, copy_gbps: float) -> dict:
    """A decode row's ratios: each FP8 method over our bf16 GEMM and over torch._scaled_mm with the same scales,
    and the weight bandwidth of each method as % of copy."""
    t = row["times_us"]
    ours = {s: t.get(f"rosekernels fp8 {s}") for s in SCHEMES}
    peers = {"tensor": t.get("torch._scaled_mm per-tensor"), "channel": t.get("torch._scaled_mm rowwise")}
    return {"vs_bf16": {s: report.ratio(t.get("rosekernels bf16"), us) for s, us in ours.items()},
            "vs_scaled_mm": {s: report.ratio(peers.get(s), ours[s]) for s in peers},
            "pct_copy": {name: 100 * row["weight_bytes"] / (us * 1e3) / copy_gbps
                         for name, us in t.items() if us and name != "rosekernels bf16"}}


def verdicts(data: dict) -> list[dict]:
    """The issue's targets, each {target, worst, passes} over the rows it concerns (passes None: not measured)."""
    out = []

    def add(target: str, values: list, bar: float, higher: bool = True) -> None:
        values = [v for v in values if v is not None and math.isfinite(v)]
        worst = (min(values) if higher else max(values)) if values else None
        out.append({"target": target, "worst": worst,
                    "passes": None if worst is None else (worst >= bar if higher else worst <= bar)})

    dec = data.get("decode", [])
    add(f"decode: fp8 per-channel >= {DECODE_VS_BF16}x our bf16", [r["summary"]["vs_bf16"]["channel"] for r in dec],
        DECODE_VS_BF16)
    add(f"decode: fp8 >= {DECODE_VS_SCALED_MM}x torch._scaled_mm (same scales)",
        [v for r in dec for v in r["summary"]["vs_scaled_mm"].values()], DECODE_VS_SCALED_MM)
    add(f"decode: weights >= {DECODE_COPY_PCT}% of copy for N*K >= 16M (fp8 per-channel)",
        [r["summary"]["pct_copy"].get("rosekernels fp8 channel") for r in dec if r["n"] * r["k"] >= BIG_WEIGHT],
        DECODE_COPY_PCT)
    pre = data.get("prefill", [])
    add(f"prefill: fp8 >= {PREFILL_VS_BF16}x our bf16 TFLOP/s",
        [report.ratio(r["times_us"].get("rosekernels bf16"), r["times_us"].get("rosekernels fp8 channel"))
         for r in pre], PREFILL_VS_BF16)
    add(f"prefill: fp8 >= {PREFILL_VS_SCALED_MM}x torch._scaled_mm rowwise",
        [report.ratio(r["times_us"].get("torch._scaled_mm rowwise"), r["times_us"].get("rosekernels fp8 channel"))
         for r in pre], PREFILL_VS_SCALED_MM)
    add(f"error: <= {ERROR_RATIO}x the bf16 output's rounding (float64 on the dequantized operands)",
        [v for r in dec + pre for v in r.get("error_ratio", {}).values()], ERROR_RATIO, higher=False)
    add(f"quantize_fp8 and fused norm + quantize >= {QUANT_COPY_PCT}% of copy",
        [r["pct_copy"] for r in data.get("quantize", [])], QUANT_COPY_PCT)
    add(f"FP8 KV decode >= {KV_SPEEDUP}x the bf16 cache at context >= {KV_CONTEXT}",
        [report.ratio(r["times_us"].get("bf16 cache"), r["times_us"].get("e4m3 cache"))
         for r in data.get("kv", []) if r["context"] >= KV_CONTEXT and r.get("query", "bf16") == "bf16"], KV_SPEEDUP)
    e2e = data.get("e2e") or {}
    add(f"end to end: FP8 weights >= {E2E_SPEEDUP}x the bf16 rosekernels arm (B = 16 decode, graphs)",
        [e2e.get("speedup")], E2E_SPEEDUP)
    add(f"end to end: logits cosine >= {E2E_COS} against the bf16 stock model", [e2e.get("min_cos")], E2E_COS)
    return out


def markdown(data: dict) -> str:
    env = data["env"]
    lines = [f"# FP8 on {env.get('gpu', '?')}", "",
             f"Device copy bandwidth (read + write) {fmt(data['copy_gbps'], 0)} GB/s. Times in us per call (device time: "
             "CUDA graphs replayed interleaved), each method's weights rotated past the L2. Ratios are time(peer) / "
             "time(ours). Error: our output's distance to the float64 product of the dequantized operands over "
             "the bf16 rounding's (<= 2 is the bar)."]
    if data.get("sections") and tuple(data["sections"]) != SECTIONS:  # a partial run: the rest was not asked for
        lines += ["", f"This run measured {', '.join(data['sections'])} only (`--sections`)."]
    lines += ["", "## Verdicts", "", "| target | worst | |", "|---|---|---|"]
    lines += [f"| {v['target']} | {fmt(v['worst'], 3)} | "
              f"{'-' if v['passes'] is None else 'pass' if v['passes'] else 'FAIL'} |" for v in data["verdicts"]]
    methods = list(dict.fromkeys(m for r in data.get("decode", []) + data.get("prefill", []) for m in r["times_us"]))
    for section in ("decode", "prefill"):
        rows = data.get(section, [])
        if not rows:
            continue
        lines += ["", f"## {section.capitalize()} GEMMs", "", "| model | role | M | N | K | " + " | ".join(methods)
                  + " | fp8 ch. / bf16 | ch. / scaled_mm rowwise | error (tensor, channel, block) |",
                  "|" + "---|" * (len(methods) + 8)]
        for r in rows:
            t = r["times_us"]
            err = r.get("error_ratio", {})
            lines.append(f"| {r.get('model', '')} | {r.get('role', '')} | {r['m']} | {r['n']} | {r['k']} | "
                         + " | ".join(fmt(t.get(m)) for m in methods)
                         + f" | {fmt(report.ratio(t.get('rosekernels bf16'), t.get('rosekernels fp8 channel')), 2)}"
                         f" | {fmt(report.ratio(t.get('torch._scaled_mm rowwise'), t.get('rosekernels fp8 channel')), 2)}"
                         f" | {', '.join(fmt(err.get(s), 2) for s in SCHEMES)} |")
    if data.get("quantize"):
        lines += ["", "## Quantization", "", "| op | rows | K | group | us | % copy |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['op']} | {r['rows']} | {r['hidden']} | {r['group'] or 'row'} | {fmt(r['us'])} | "
                  f"{fmt(r['pct_copy'])} |" for r in data["quantize"]]
    if data.get("kv"):
        arms = ["e4m3 cache", *KV_VARIANTS]
        lines += ["", f"## Decode attention, B = {KV_BATCH}, Qwen3-8B heads", "",
                  "Each e4m3 arm's time in us, then the time of a cache of the query's dtype over it; lengths "
                  "`ragged`: each sequence's uniform in [S/2, S].", "",
                  "| context | lengths | query | its dtype's cache us | " + " | ".join(f"{a} us | speedup" for a in arms)
                  + " |", "|---|---|---|---|" + "---|---|" * len(arms)]
        for r in data["kv"]:
            t, query = r["times_us"], r.get("query", "bf16")
            base = t.get(f"{query} cache")
            lines.append(f"| {r['context']} | {r.get('lengths', 'full')} | {query} | {fmt(base)} | "
                         + " | ".join(f"{fmt(t.get(a))} | {fmt(report.ratio(base, t.get(a)), 2)}" for a in arms) + " |")
        peer_rows = [r for r in data["kv"] if any(a.startswith("FlashInfer") for a in r["times_us"])
                     or r.get("errors")]
        if peer_rows:
            lines += ["", "FlashInfer's batch decode over the same caches (pages of "
                      f"{KV_PEER_PAGE} rows): its time for a cache of the query's dtype and for the e4m3 one, its own "
                      "e4m3 speedup, and its e4m3 time over ours (above 1: ours is faster).", "",
                      "| context | lengths | query | FlashInfer, its dtype's cache us | FlashInfer e4m3 us "
                      "| its speedup | e4m3: FlashInfer / ours |", "|---|---|---|---|---|---|---|"]
            for r in peer_rows:
                t, query = r["times_us"], r.get("query", "bf16")
                mine, theirs = t.get(f"FlashInfer {query} cache"), t.get("FlashInfer e4m3 cache")
                ours = t.get("e4m3 cache")
                lines.append(f"| {r['context']} | {r.get('lengths', 'full')} | {query} | {fmt(mine)} | {fmt(theirs)} | "
                             f"{fmt(report.ratio(mine, theirs), 2)} | {fmt(report.ratio(theirs, ours), 2)} |")
            lines += [f"- {r['context']} {r.get('lengths', 'full')} {r.get('query', 'bf16')}: {name}: {why}"
                      for r in peer_rows for name, why in r.get("errors", {}).items()]
    if data.get("e2e"):
        e = data["e2e"]
        lines += ["", "## End to end (Qwen3-8B geometry, decode B = 16, CUDA graphs)", "",
                  f"{e['layers']} layers, {e['scheme']} weights and an e4m3 KV cache: bf16 arm {fmt(e['us'].get('bf16'))} us, FP8 arm "
                  f"{fmt(e['us'].get('fp8'))} us per step ({fmt(e.get('speedup'), 2)}x); logits cosine against the "
                  f"stock bf16 model: min {fmt(e.get('min_cos'), 4)}."]
        keep = e.get(KEEP_FIRST)
        if keep:  # (results before the arm existed have none)
            lines += ["", f"With layer 0 in bf16 (1 of {e['layers']}; apply(fp8_exclude=['model.layers.0'])): "
                      f"{fmt(e['us'].get(KEEP_FIRST))} us per step ({fmt(keep.get('speedup'), 2)}x), logits cosine "
                      f"min {fmt(keep.get('min_cos'), 4)}."]
        lines += [f"- {name} did not run: {why}" for name, why in (e.get("failed") or {}).items()]
    if data.get("errors") or data.get("peers"):
        lines += ["", "## Notes", ""] + [f"- {x}" for x in data.get("peers", []) + data.get("errors", [])]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Measurements (GPU).

def _sets(count: int, make: Callable[[torch.Generator], tuple]) -> list[tuple]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return [make(g) for _ in range(count)]


def _operands(m: int, n: int, k: int, scheme: str, g: torch.Generator) -> tuple:
    """(a, a_scale, w, w_scale) for gemm_fp8 with `scheme` (rosekernels.quantize_weight_fp8's), a by quantize_fp8."""
    import rosekernels

    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(torch.bfloat16)
    q_w, s_w = rosekernels.quantize_weight_fp8(w, scheme)
    if scheme == "tensor":  # per-tensor activations too: torch._scaled_mm's per-tensor case
        return (*fp8.quantize(x, None, None), q_w, s_w)
    return (*rosekernels.quantize_fp8(x, 128 if scheme == "block" else None), q_w, s_w)


def _gemm_methods(m: int, n: int, k: int, gated: bool, peers: dict) -> tuple[dict, int, dict]:
    """({method: step}, weight bytes, {scheme: error ratio}) of one GEMM shape."""
    import rosekernels
    from rosekernels.kernels import gemm_fp8 as gk
    from rosekernels import modes, tuned
    from rosekernels.kernels import gemm_fp8_plan as plan
    from rosekernels.ops import gemm_fp8 as op

    activation = "silu" if gated else None
    count = timing.input_sets(n * k, least=2, most=16)
    steps, errors = {}, {}
    for scheme in SCHEMES:
        sets = _sets(count, lambda g: (*_operands(m, n, k, scheme, g), torch.empty(m, n // 2 if gated else n,
                                                                                     dtype=torch.bfloat16, device="cuda")))
        a, sa, w, sw, out = sets[0]
        rosekernels.gemm_fp8(a, sa, w, sw, activation=activation, gated=gated, out=out)
        errors[scheme] = gk.check(out, a, sa, w, sw, None, activation or "none", gated) \
            if m * n <= 1 << 24 else None  # (the float64 reference of the largest shapes is left out)
        steps[f"rosekernels fp8 {scheme}"] = lambda i, s=sets: rosekernels.gemm_fp8(
            *s[i % len(s)][:4], activation=activation, gated=gated, out=s[i % len(s)][4])
        if scheme == "channel" and m > DECODE_MAX_M:
            # The config the op above plans (a stored entry's or the heuristic's) on each other prefill cluster.
            shape = plan.Fp8GemmShape(m, n, k, scales="rowcol", activation=activation or "none", gated=gated)
            sms = modes.sm_count()
            planned = tuned.tuned_config(gk, shape, plan.config_for(shape, sms), sms)
            for other in cluster_configs(planned):
                steps[f"rosekernels fp8 channel {other.cluster_m}x{other.cluster_n} cluster"] = \
                    lambda i, s=sets, c=other: op.run(*s[i % len(s)][:4], None, s[i % len(s)][4], c)
        if scheme in ("tensor", "channel") and peers.get("scaled_mm") and not gated:
            label = "torch._scaled_mm " + ("per-tensor" if scheme == "tensor" else "rowwise")
            steps[label] = lambda i, s=sets, rowwise=scheme == "channel": peers["scaled_mm"](s[i % len(s)], rowwise)
        if scheme == "block" and peers.get("deep_gemm") and not gated:
            prepare, run = peers["deep_gemm"]
            prepared = [prepare(*s) for s in sets]  # its layout of the scales, made before the timing
            steps["DeepGEMM block"] = lambda i, s=prepared: run(*s[i % len(s)])
    bf16 = _sets(count, lambda g: (torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16),
                                    (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(torch.bfloat16)))
    steps["rosekernels bf16"] = lambda i, s=bf16: rosekernels.gemm(*s[i % len(s)], activation=activation, gated=gated)
    return steps, n * k, errors


def cluster_configs(planned) -> list:
    """The planned prefill config (a gemm_fp8_plan.Fp8GemmConfig) on each other of gemm_fp8_plan.PREFILL_CLUSTERS,
    the rest of it kept. (The wide tiles these arms replaced ran 0.76-1.03x the 128 x 128 one: no gain,
    bench/results/gemm/sweeps/fp8_prefill_wide_h100.md.)"""
    from rosekernels.kernels import gemm_fp8_plan as plan

    return [dataclasses.replace(planned, cluster_m=cm, cluster_n=cn) for cm, cn in plan.PREFILL_CLUSTERS
            if (cm, cn) != (planned.cluster_m, planned.cluster_n)]


def _scaled_mm_peer() -> Callable[[tuple, bool], Any]:
    """torch._scaled_mm (cuBLASLt FP8) on a set of _operands: per-tensor scales, or rowwise ([M, 1] x [1, N])."""
    if not hasattr(torch, "_scaled_mm"):
        raise ImportError("this torch has no _scaled_mm")

    def run(s: tuple, rowwise: bool) -> Any:
        a, sa, w, sw, out = s
        m, n = a.shape[0], w.shape[0]
        scale_a, scale_b = (sa.view(m, 1), sw.view(1, n)) if rowwise else (sa.reshape(()), sw.reshape(()))
        return torch._scaled_mm(a, w.t(), scale_a, scale_b, out_dtype=torch.bfloat16)
    return run


def _deep_gemm() -> tuple[Callable, Callable]:
    """(prepare, run) of DeepGEMM's FP8 GEMM with 1 x 128 activation and 128 x 128 weight scales, where it
    imports: prepare(a, a_scale, w, w_scale, out) puts the activation scales in its M-major TMA-aligned layout
    (once per set, before the timing), run(...) multiplies. Its entry points under their newer and older names."""
    import deep_gemm

    gemm = getattr(deep_gemm, "fp8_gemm_nt", None) or deep_gemm.gemm_fp8_fp8_bf16_nt
    aligned = getattr(deep_gemm, "get_mn_major_tma_aligned_tensor", None) or deep_gemm.get_col_major_tma_aligned_tensor

    def prepare(a, sa, w, sw, out) -> tuple:
        return a, aligned(sa), w, sw, out

    def run(a, sa, w, sw, out) -> Any:
        gemm((a, sa), (w, sw), out)
    return prepare, run


def bench_gemms(ms, models, peers, errors, decode: bool) -> list[dict]:
    rows = []
    for model in models:
        for role, n, k, gated in weights(model):
            for m in ms:
                what = f"{model} {role} {m}x{n}x{k}"
                print(what, flush=True)
                try:
                    steps, weight_bytes, err = _gemm_methods(m, n, k, gated, peers)
                    # Graphs for prefill too: launched eagerly, the host's cost per call (tens of us) would
                    # time the shorter prefill GEMMs instead of their device work.
                    failed = {}
                    us = timing.interleaved_graph_time_us(steps, calls=100 if decode else 5,
                                                          rounds=10 if decode else 7, errors=failed)
                    errors += [f"{what} {name}: {e}" for name, e in failed.items()]
                except Exception as e:  # noqa: BLE001 - one shape failing does not end the run
                    errors.append(f"{what}: {type(e).__name__}: {e}")
                    continue
                rows.append({"model": model, "role": role, "m": m, "n": n, "k": k, "gated": gated,
                             "weight_bytes": weight_bytes, "times_us": us, "error_ratio": err,
                             "tflops": {name: 2 * m * n * k / t / 1e6 for name, t in us.items()}})
    return rows


def bench_quantize(copy_gbps: float, quick: bool) -> list[dict]:
    import rosekernels

    rows = []
    for rows_, hidden in ((4096, 4096), (8192, 4096), (4096, 14336), (8192, 18944))[: 2 if quick else 4]:
        g = torch.Generator(device="cuda").manual_seed(rows_)
        count = timing.input_sets(rows_ * hidden * 2, least=2, most=8)
        xs = [torch.randn(rows_, hidden, generator=g, device="cuda").to(torch.bfloat16) for _ in range(count)]
        w = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
        for group in (None, 128):
            groups = hidden // group if group else 1
            scale_bytes = rows_ * groups * 4
            steps = {"quantize_fp8": lambda i, g_=group: rosekernels.quantize_fp8(xs[i % len(xs)], g_)}
            if hidden <= MAX_HIDDEN:  # a norm runs on the hidden size; the MLP's wider rows are quantized alone
                steps["rmsnorm+residual+fp8"] = lambda i, g_=group: rosekernels.rmsnorm(
                    xs[i % len(xs)], w, residual=xs[(i + 1) % len(xs)], fp8=True, group_size=g_)
            moved = {"quantize_fp8": rows_ * hidden * 3 + scale_bytes,  # bf16 in, e4m3 out
                     "rmsnorm+residual+fp8": rows_ * hidden * 7 + scale_bytes + hidden * 2}  # x, r in; h, q out
            # In graphs: eagerly, a call of 4096 rows (about 17 us of device work) timed the host's
            # launch cost instead (44 us, slower than 8192 rows on the H100, 2026-12-05).
            us = timing.interleaved_graph_time_us(steps, calls=10, rounds=7)
            rows += [{"op": op, "rows": rows_, "hidden": hidden, "group": group, "us": t,
                      "pct_copy": 100 * moved[op] / (t * 1e3) / copy_gbps} for op, t in us.items()]
    return rows


def bench_kv(quick: bool, flashinfer=None) -> list[dict]:
    """Decode attention over a cache of the query's dtype against an e4m3 one (and the KV_VARIANTS), and
    FlashInfer's batch decode over both (`flashinfer`: flashinfer_peer.decode()'s make, or None), reading the
    same contiguous caches as pages of 16 rows; a FlashInfer arm that cannot plan, or whose output is off ours,
    is recorded in the row's errors and not timed."""
    import rosekernels
    from rosekernels.ops.kvcache import plan_kvcache

    hq, hkv, d = 32, 8, 128
    rows = []
    for context in KV_CONTEXTS[:1] if quick else KV_CONTEXTS:
        for kind, query in itertools.product(KV_LENGTHS, KV_QUERIES):
            g = torch.Generator(device="cuda").manual_seed(context)
            dt = checks.TORCH_DTYPE[query]
            q = torch.randn(KV_BATCH, 1, hq, d, generator=g, device="cuda").to(dt)
            lengths = torch.full((KV_BATCH,), context, dtype=torch.int32, device="cuda")
            if kind == "ragged":
                lengths = torch.randint(context // 2, context + 1, (KV_BATCH,), generator=g, device="cuda",
                                        dtype=torch.int32)
            k, v = (torch.randn(KV_BATCH, context, hkv, d, generator=g, device="cuda").to(dt) for _ in "kv")
            one = torch.ones(1, device="cuda")
            k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
            steps = {f"{query} cache": lambda i: rosekernels.attention_with_kvcache(q, k, v, lengths),
                     "e4m3 cache": lambda i: rosekernels.attention_with_kvcache(q, k8, v8, lengths, k_descale=one,
                                                                               v_descale=one)}
            if kind == "full" and query == "bf16":
                # Variants the plan does not take yet (attention_decode_plan.DecodeConfig), until it takes or
                # drops them: the e4m3 ring as deep as the bf16 one in bytes (6 stages of half the bytes: one
                # CTA per SM), and that ring widened by warps of their own.
                out, lse = torch.empty_like(q), torch.empty(KV_BATCH, hq, 1, device="cuda")
                planned = steps["e4m3 cache"](0)
                for name, fields in KV_VARIANTS.items():
                    plan = plan_kvcache(q, k8, v8, out, lengths, None, True, d ** -0.5, **fields)
                    plan.launch(q, k8, v8, out, lse, lengths, None, one, one)
                    if not torch.equal(out, planned):  # the same widened values and MMAs: the same bits
                        raise AssertionError(f"{name} differs from the planned e4m3 kernel's output")
                    steps[name] = lambda i, p=plan: p.launch(q, k8, v8, out, lse, lengths, None, one, one)
            errors = {}
            if flashinfer is not None:
                table = flashinfer_peer.contiguous_table(KV_BATCH, context, KV_PEER_PAGE)
                arms = ((f"FlashInfer {query} cache", (k, v), f"{query} cache"),
                        ("FlashInfer e4m3 cache", (k8, v8), "e4m3 cache"))  # the peer, its caches, our arm on them
                for name, caches, mine in arms:
                    pages = [c.view(-1, KV_PEER_PAGE, hkv, d) for c in caches]
                    try:
                        run = flashinfer(table, lengths, KV_PEER_PAGE, hq, hkv, d, q_dtype=dt, kv_dtype=pages[0].dtype)
                        ours = steps[mine](0)
                        diff = (run(q, *pages).float() - ours.float()).abs().max().item()
                    except Exception as e:  # noqa: BLE001 - a peer that cannot plan this row is a result
                        errors[name] = timing.error_line(e)
                        continue
                    if not diff <= 2e-2:
                        errors[name] = f"max |diff| {diff:.3g} against rosekernels on the same cache"
                        continue
                    steps[name] = lambda i, run=run, pages=pages: run(q, *pages)
            rows.append({"context": context, "batch": KV_BATCH, "lengths": kind, "query": query, "errors": errors,
                         "times_us": timing.interleaved_graph_time_us(steps, calls=50, rounds=10)})
            del k, v, k8, v8
    return rows


def bench_e2e(layers: int, scheme: str) -> dict:
    """Qwen3-8B's geometry: decode at B = 16 after E2E_CONTEXT tokens on a static cache in CUDA graphs, the bf16
    rosekernels arm against the FP8 one (weights and an Fp8StaticCache) and the FP8 one with layer 0 in bf16,
    and the FP8 models' prefill logits against stock bf16's."""
    from rosekernels import hf
    from transformers import StaticCache

    stock = hf.random_model("qwen3-8b", layers, seed=1)
    c = stock.config
    ids = torch.randint(0, 151936, (4, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    with torch.inference_mode():
        want = stock(ids).logits.float()
    arms, cos = {}, {}
    for name, fp8, exclude in (("bf16", None, ()), ("fp8", scheme, ()), (KEEP_FIRST, scheme, ["model.layers.0"])):
        arms[name] = copy.deepcopy(stock)  # one at a time: the FP8 arms drop their bf16 weights in apply()
        hf.warmup(arms[name], fp8=fp8, fp8_kv_cache=fp8 is not None)
        hf.apply(arms[name], fp8=fp8, fp8_exclude=exclude)
        if fp8 is not None:
            with torch.inference_mode():
                got = arms[name](ids).logits.float()
            cos[name] = torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()
    del stock, want
    steps = {}
    tok = torch.randint(0, 151936, (KV_BATCH, 1), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    kv = torch.randn(KV_BATCH, c.num_key_value_heads, E2E_CONTEXT, c.head_dim, device="cuda", dtype=torch.bfloat16)
    for name, model in arms.items():
        kind = StaticCache if name == "bf16" else hf.Fp8StaticCache  # the FP8 arms: e4m3 KV cache too
        cache = kind(config=c, max_cache_len=E2E_CONTEXT + 256)  # the steps below advance it
        for layer in range(c.num_hidden_layers):
            cache.update(kv, kv, layer)  # a context of random keys and values (the timing does not read them)
        steps[name] = lambda i, m=model, cache=cache: m(input_ids=tok, past_key_values=cache, use_cache=True)
    failed: dict[str, str] = {}
    with torch.inference_mode():
        us = timing.interleaved_graph_time_us(steps, calls=8, rounds=15, warmup=2, errors=failed)
    return {"layers": layers, "scheme": scheme, "us": us, "speedup": report.ratio(us.get("bf16"), us.get("fp8")),
            "min_cos": cos["fp8"], "failed": failed,
            KEEP_FIRST: {"speedup": report.ratio(us.get("bf16"), us.get(KEEP_FIRST)), "min_cos": cos[KEEP_FIRST]}}


def _sections(text: str) -> tuple[str, ...]:
    """--sections: a comma-separated subset of SECTIONS."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"sections are a comma-separated subset of {','.join(SECTIONS)}, got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_out(p)
    p.add_argument("--quick", action="store_true", help="one model, M = 1 and 16, one prefill M, fewer sizes")
    p.add_argument("--sections", type=_sections, default=SECTIONS,
                   help=f"which parts to run, comma-separated (default all: {','.join(SECTIONS)})")
    p.add_argument("--layers", type=int, default=E2E_LAYERS, help="decoder layers of the end-to-end model")
    p.add_argument("--scheme", choices=SCHEMES, default="channel", help="the end-to-end model's weight scheme")
    args = p.parse_args(argv)
    report.require_gpu()
    t0 = time.time()
    peers_log: list[str] = []
    peers = {"scaled_mm": report.try_peer("torch._scaled_mm", _scaled_mm_peer, peers_log),
             "deep_gemm": report.try_peer("DeepGEMM", _deep_gemm, peers_log),
             "flashinfer": report.try_peer("FlashInfer", flashinfer_peer.decode, peers_log)}
    errors: list[str] = []
    copy_gbps = timing.copy_gbs()
    models = list(MODELS)[:1] if args.quick else list(MODELS)
    data: dict[str, Any] = {"env": report.environment(("deep_gemm", "flashinfer")), "copy_gbps": copy_gbps,
                            "peers": peers_log, "errors": errors, "sections": list(args.sections)}
    sections = {
        "decode": lambda: bench_gemms((1, 16) if args.quick else DECODE_M, models, peers, errors, decode=True),
        "prefill": lambda: bench_gemms(PREFILL_M[:1] if args.quick else PREFILL_M, models[:1], peers, errors,
                                       decode=False),
        "quantize": lambda: report.measure("quantize", lambda: bench_quantize(copy_gbps, args.quick), errors) or [],
        "kv": lambda: report.measure("kv", lambda: bench_kv(args.quick, peers["flashinfer"]), errors) or [],
        "e2e": lambda: report.measure("e2e", lambda: bench_e2e(args.layers, args.scheme), errors)}
    for name, measure in sections.items():  # a section not asked for: empty (e2e: None), as one that failed
        data[name] = measure() if name in args.sections else (None if name == "e2e" else [])
    for row in data["decode"]:
        row["summary"] = decode_summary(row, copy_gbps)
    data["verdicts"] = verdicts(data)
    data["seconds"] = time.time() - t0
    report.write(args.out, "fp8", data, markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
