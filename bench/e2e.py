"""End to end: stock transformers against rosekernels.hf.apply, Qwen3-8B and Qwen3-30B-A3B geometry; e2e.json + e2e.md.

    python bench/e2e.py [--out bench/results] [--quick] [--layers 4] [--models qwen3-8b,qwen3-30b-a3b]

Models: random weights (rosekernels.hf.random_model), bf16, --layers decoder layers (default 4; the full
vocabulary, so lm_head and embedding are real size). "stock" is the model as transformers builds it (sdpa
attention, grouped_mm experts); "rosekernels" is a copy after rosekernels.hf.apply (kernels compiled and
loaded first: rosekernels.hf.warmup). For the MoE model, decode also runs stock with batched_mm experts,
which generate() switches to for decoding; the speedup is against the faster stock arm. The MoE model also
runs BASELINE_43, the rosekernels arm as it was when issue 43 was filed: hf.apply(experts="grouped_mm")
(rosekernels' dispatch and combine around torch._grouped_mm) with transformers' router (no moe_route); issue
43's end-to-end target is the rosekernels arm's tokens/s over it at B = 16 in graphs ("vs issue 43's
baseline" in the decode table).

- prefill tokens/s: one forward over B prompts of S tokens without a cache, logits of the last position
  only (as generate's prefill), B in {1, 8}, S in {2048, 8192}; the arms timed interleaved with CUDA events
  (timing.interleaved_time_us); the last position's logits checked against stock (cosine similarity).
- decode tokens/s (B tokens per step) at a 2048-token context, B in {1, 16, 64}, two ways:
  eager: a DynamicCache, one forward per token as generate runs it (host time included: events around
  8 steps); graph: a StaticCache and one decode step captured in a CUDA graph per 8 steps, the arms'
  graphs replayed interleaved (timing.interleaved_graph_time_us). Caches are filled with random keys and
  values instead of a prefill (the timing does not depend on them). A static cache's mask covers the
  whole cache; the rosekernels arm's decode attention reads each sequence's key count from it on the
  device (hf.prefix_mask), in graphs too; "stats" in the JSON counts any call that fell back. The graph
  rows add "stock compiled", stock's fastest decode configuration: a static cache and torch.compile
  (Inductor's default mode, compiled once in the warm-up; the step is then captured in the same CUDA graph
  as every arm, which is what mode="reduce-overhead" would add); for the MoE model it compiles the
  batched_mm arm, the one generate() decodes with.
- per-op device time of one decode step (B = 16) per arm (torch.profiler), kernels grouped by op: the
  graph rows' step (a StaticCache), run eagerly.
--quick: 2 layers, prefill S = 2048 only, decode B = 16 only, fewer rounds.
"""
from __future__ import annotations

import argparse
import copy
import gc
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402
import timing  # noqa: E402
from report import fmt  # noqa: E402

CONTEXT = 2048
# The MoE arm as it was when issue 43 was filed, for its experts and router; its attention side is today's
# (fused rotary embedding, one q/k/v GEMM), which the ratio therefore does not count.
BASELINE_43 = "rosekernels grouped_mm, torch router"
DECODE_CALLS = 8  # decode steps between a pair of events (eager) or in one CUDA graph
PROFILE_BATCH = 16
# (label, pattern on the kernel name): the first match names a kernel's op in the per-op breakdown.
OP_GROUPS = (
    ("rk rmsnorm", r"rosekernelskernelsrmsnorm"),
    ("rk qk_norm", r"rosekernelskernelsqk_norm"),
    ("rk attention decode", r"rosekernelskernelsattention_decode"),
    ("rk attention", r"rosekernelskernelsattention"),
    ("rk moe dispatch", r"rosekernelskernelsmoe_dispatch"),
    ("rk moe combine", r"rosekernelskernelsmoe_combine"),
    ("rk moe route", r"rosekernelskernelsmoe_route"),
    ("rk grouped gemm", r"rosekernelskernelsgrouped_gemm"),
    ("router softmax / top-k (torch)", r"(?i)softmax|topk"),  # (the router's; sdpa's kernels are fmha / flash)
    ("attention (torch)", r"(?i)flash|fmha|attention"),
    ("grouped GEMM", r"(?i)group|ptrarray"),
    ("GEMM", r"(?i)gemm|nvjet|xmma|cutlass|sm90_"),
    ("copy / cat / index", r"(?i)copy|cat|index|gather|scatter|memcpy|memset"),
    ("elementwise / reduce", r"(?i)elementwise|reduce|vectorized|unrolled"),
)


def _ids(batch, length, seed, vocab):
    return torch.randint(0, vocab, (batch, length), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))


def filled_cache(model, static, batch, headroom=0):
    """A cache holding CONTEXT random keys and values per layer (a StaticCache with `headroom` more slots)."""
    from transformers import DynamicCache, StaticCache

    c = model.config
    cache = (StaticCache(config=c, max_cache_len=CONTEXT + headroom) if static else DynamicCache(config=c))
    kv = torch.randn(batch, c.num_key_value_heads, CONTEXT, c.head_dim, device="cuda", dtype=torch.bfloat16)
    for layer in range(c.num_hidden_layers):
        cache.update(kv, kv, layer)  # copied in: the layers do not share storage
    return cache


def bench_prefill(arms, batch, length, rounds, vocab):
    ids = _ids(batch, length, seed=batch * length, vocab=vocab)
    prefill = {"stock": arms["stock"], "rosekernels": arms["rosekernels"]}
    steps = {name: (lambda i, m=m: m(input_ids=ids, use_cache=False, logits_to_keep=1)) for name, m in prefill.items()}
    us = timing.interleaved_time_us(steps, calls_per_round=1, rounds=rounds, warmup=1)
    last = {name: m(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float() for name, m in prefill.items()}
    cos = torch.nn.functional.cosine_similarity(last["stock"], last["rosekernels"], dim=-1).min().item()
    tps = {name: batch * length / (t * 1e-6) for name, t in us.items()}
    return {"batch": batch, "seqlen": length, "us": us, "tokens_per_s": tps,
            "speedup": tps["rosekernels"] / tps["stock"], "min_cos": cos}


def bench_decode_eager(arms, batch, rounds, vocab):
    steps = {}
    for name, m in arms.items():
        cache, tok = filled_cache(m, False, batch), _ids(batch, 1, seed=batch, vocab=vocab)
        steps[name] = lambda i, m=m, cache=cache, tok=tok: m(input_ids=tok, past_key_values=cache, use_cache=True)
    return timing.interleaved_time_us(steps, calls_per_round=DECODE_CALLS, rounds=rounds, warmup=2)


def compiled(model):
    """A copy of `model` whose forward is torch.compile'd (static shapes: one compile for a static cache's
    decode step, checked on the CPU to take no recompile as the cache fills)."""
    out = copy.deepcopy(model)
    out.forward = torch.compile(out.forward, dynamic=False)
    return out


def bench_decode_graph(arms, batch, rounds, vocab, errors):
    # Every step advances the static cache: warm-up steps, then (3 warm + `rounds`) replays of DECODE_CALLS.
    headroom = 8 + (3 + rounds) * DECODE_CALLS
    steps = {}
    for name, m in arms.items():
        cache, tok = filled_cache(m, True, batch, headroom), _ids(batch, 1, seed=batch, vocab=vocab)
        steps[name] = lambda i, m=m, cache=cache, tok=tok: m(input_ids=tok, past_key_values=cache, use_cache=True)
    failed = {}
    us = timing.interleaved_graph_time_us(steps, calls=DECODE_CALLS, rounds=rounds, warmup=2, errors=failed)
    errors += [f"graph decode B{batch} {name}: {e}" for name, e in failed.items()]
    return us


def decode_row(mode, batch, us):
    tps = {name: batch / (t * 1e-6) for name, t in us.items()}
    stock = max((v for k, v in tps.items() if k.startswith("stock")), default=None)
    ours, base = tps.get("rosekernels"), tps.get(BASELINE_43)
    return {"mode": mode, "batch": batch, "us": us, "tokens_per_s": tps,
            "speedup": None if stock is None or ours is None else ours / stock,
            "vs_issue43_baseline": None if base is None or ours is None else ours / base}


def op_of(kernel):
    return next((label for label, pattern in OP_GROUPS if re.search(pattern, kernel)), "other")


def profile_decode(model, vocab):
    """{op group: device us} and every kernel, slowest first (the small torch ops of a step are what a fusion
    removes: the JSON keeps them all), of one decode step at B = PROFILE_BATCH on a StaticCache, run eagerly: the
    kernels the graph rows replay (a DynamicCache's step adds a torch.cat of every layer's whole cache, which no
    graph row runs)."""
    cache, tok = filled_cache(model, True, PROFILE_BATCH, headroom=3), _ids(PROFILE_BATCH, 1, seed=3, vocab=vocab)
    for _ in range(2):
        model(input_ids=tok, past_key_values=cache, use_cache=True)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model(input_ids=tok, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total, e.count) for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    groups = {}
    for name, us, _ in kernels:
        groups[op_of(name)] = groups.get(op_of(name), 0.0) + us
    return {"groups": groups, "total_us": sum(groups.values()),
            "kernels": [{"kernel": n[:120], "us": us, "count": c} for n, us, c in sorted(kernels, key=lambda k: -k[1])]}


def bench_model(name, args, errors, log):
    from rosekernels import hf
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q3m

    t0 = time.time()
    stock = hf.random_model(name, args.layers, seed=0)
    ours = copy.deepcopy(stock)
    warm = hf.warmup(ours)
    log(f"{name}: warm-up {warm.seconds:.1f} s ({len(warm.kernels)} kernels, {len(warm.tuned)} SIP-tuned)")
    hf.apply(ours)
    arms = {"stock": stock, "rosekernels": ours}
    if ours.config.model_type == "qwen3_moe":
        arms["stock batched_mm"] = copy.deepcopy(stock)
        arms["stock batched_mm"].set_experts_implementation("batched_mm")
        base = copy.deepcopy(stock)
        hf.warmup(base, experts="grouped_mm")
        hf.apply(base, experts="grouped_mm")
        for m in base.modules():  # transformers' router back, as the arm ran before moe_route
            if isinstance(m, hf.RoseQwen3MoeTopKRouter):
                m.__class__ = q3m.Qwen3MoeTopKRouter
        arms[BASELINE_43] = base
    # graph decode only: with a DynamicCache every step's shapes change, and torch.compile would recompile
    graph_arms = {**arms, "stock compiled": compiled(arms.get("stock batched_mm", stock))}
    vocab = stock.config.vocab_size
    hf.reset_stats()
    result = {"layers": args.layers, "build_s": time.time() - t0, "warmup_s": warm.seconds,
              "warmup": str(warm).splitlines()[0], "prefill": [], "decode": [], "profile": {}}
    with torch.inference_mode():
        for batch, length in args.prefill:
            row = report.measure(f"{name} prefill B{batch} S{length}",
                                 lambda: bench_prefill(arms, batch, length, args.rounds, vocab), errors)
            if row:
                result["prefill"].append(row)
                log(f"  prefill B{batch} S{length}: {row['speedup']:.3f}x (cos {row['min_cos']:.5f})")
            torch.cuda.empty_cache()
        for batch in args.decode:
            for mode, fn in (("eager", lambda: bench_decode_eager(arms, batch, args.rounds, vocab)),
                             ("graph", lambda: bench_decode_graph(graph_arms, batch, args.rounds, vocab, errors))):
                us = report.measure(f"{name} decode {mode} B{batch}", fn, errors)
                if us:
                    result["decode"].append(decode_row(mode, batch, us))
                    log(f"  decode {mode} B{batch}: {fmt(result['decode'][-1]['speedup'], 3)}x")
                torch.cuda.empty_cache()
        for arm, model in arms.items():
            prof = report.measure(f"{name} profile {arm}", lambda: profile_decode(model, vocab), errors)
            if prof:
                result["profile"][arm] = prof
    result["stats"] = hf.stats()
    result["seconds"] = time.time() - t0
    return result


def markdown(env, args, results, errors):
    arms = lambda r: sorted({a for row in r["decode"] for a in row["us"]}, key=lambda a: (a == "rosekernels", a))  # noqa: E731
    out = ["# End to end: stock transformers vs rosekernels.hf.apply", "",
           f"{env['gpu']}, torch {env['torch']}, transformers {env['transformers']}, {env['toolchain']}; "
           f"random weights, bf16, {args.layers} decoder layers{' (--quick)' if args.quick else ''}. "
           "Speedup: rosekernels tokens/s over the fastest stock arm (graph rows: stock compiled among them).", ""]
    for name, r in results.items():
        out += [f"## {name}", "", f"warm-up: {r['warmup']}", "", "### Prefill (tokens/s, no cache)", "",
                "| B | S | stock | rosekernels | speedup | min cos (last logits) |", "|---|---|---|---|---|---|"]
        out += [f"| {p['batch']} | {p['seqlen']} | {p['tokens_per_s']['stock']:,.0f} | "
                f"{p['tokens_per_s']['rosekernels']:,.0f} | {p['speedup']:.3f}x | {p['min_cos']:.5f} |"
                for p in r["prefill"]]
        names = arms(r)
        out += ["", f"### Decode (tokens/s, context {CONTEXT})", "",
                "| mode | B | " + " | ".join(names) + " | speedup | vs issue 43's baseline |",
                "|---|---|" + "---|" * (len(names) + 2)]
        out += [f"| {d['mode']} | {d['batch']} | " + " | ".join(fmt(d["tokens_per_s"].get(a), 0) for a in names)
                + f" | {fmt(d['speedup'], 3)}x | {fmt(d.get('vs_issue43_baseline'), 3)} |" for d in r["decode"]]
        if r["profile"]:
            parts = list(r["profile"])
            labels = sorted({g for p in r["profile"].values() for g in p["groups"]},
                            key=lambda g: -max(p["groups"].get(g, 0) for p in r["profile"].values()))
            out += ["", f"### One decode step, B = {PROFILE_BATCH}, StaticCache (the graph rows' kernels, run "
                    "eagerly): device time per op (us)", "",
                    "| op | " + " | ".join(parts) + " |", "|---|" + "---|" * len(parts)]
            out += [f"| {g} | " + " | ".join(fmt(r["profile"][a]["groups"].get(g), 1) for a in parts) + " |"
                    for g in labels]
            out += ["| total | " + " | ".join(fmt(r["profile"][a]["total_us"], 1) for a in parts) + " |"]
            step = {mode: next((d["us"] for d in r["decode"] if d["mode"] == mode and d["batch"] == PROFILE_BATCH), {})
                    for mode in ("eager", "graph")}
            out += ["| graph step | " + " | ".join(fmt(step["graph"].get(a), 1) for a in parts) + " |",
                    "| eager step (DynamicCache), wall | " + " | ".join(fmt(step["eager"].get(a), 1) for a in parts)
                    + " |", "",
                    "The graph step against the total: what launch gaps add, or overlap (PDL) takes away. Eager rows "
                    "time the host too: where an arm's wall time per step is far above its device time, that arm "
                    "is host-bound and the eager speedup measures host overhead, not kernels."]
        fallbacks = {k: v for k, v in r["stats"].items() if k.startswith("fallback")}
        out += ["", f"rosekernels calls over the run: {r['stats']}" if not fallbacks else
                f"rosekernels calls over the run: {r['stats']} (fallbacks: {fallbacks})", ""]
    if errors:
        out += ["## Errors", ""] + [f"- {e}" for e in errors]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    report.add_out(ap)
    ap.add_argument("--models", default="qwen3-8b,qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers per model (default 4; --quick: 2)")
    ap.add_argument("--quick", action="store_true", help="fewer layers, shapes and rounds (under 90 s warm)")
    args = ap.parse_args()
    report.require_gpu()
    try:
        import transformers
    except ImportError:
        raise SystemExit("e2e.py: needs transformers (pip install 'rosekernels[hf]')")
    args.layers = args.layers or (2 if args.quick else 4)
    args.prefill = [(1, 2048), (8, 2048)] if args.quick else [(1, 2048), (8, 2048), (1, 8192), (8, 8192)]
    args.decode = [16] if args.quick else [1, 16, 64]
    args.rounds = 3 if args.quick else 5
    log = lambda m: print(m, flush=True)  # noqa: E731
    t0 = time.time()
    env = {**report.environment(), "transformers": transformers.__version__}
    errors, results = [], {}
    for name in args.models.split(","):
        results[name] = bench_model(name, args, errors, log)
        gc.collect()  # the models of one geometry go before the next is built
        torch.cuda.empty_cache()
    doc = {"env": env, "layers": args.layers, "quick": args.quick, "context": CONTEXT, "results": results,
           "errors": errors, "seconds": time.time() - t0}
    where = report.write(args.out, "e2e_quick" if args.quick else "e2e", doc, markdown(env, args, results, errors))
    log(f"wrote e2e{'_quick' if args.quick else ''}.json and .md under {where} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
