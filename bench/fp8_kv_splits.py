"""The e4m3 KV cache's split count (issue 44): decode attention over an e4m3 cache at every split count, on full
and ragged lengths, to fit the plan's choice (attention_decode_plan.choose_splits) to lengths it cannot see.

    python bench/fp8_kv_splits.py [--out bench/results] [--batches 1,4,16,64] [--contexts 4096,8192,32768]
        [--heads 32/8,28/4] [--name fp8_kv_splits_heldout_sweep]

The plan takes the cache's capacity (S_max): lengths live on the device, so that a call stays graph-capturable.
With lengths below the capacity, a split past a sequence's end loads nothing, and what sets the time is how
evenly the CTAs that do load share the SMs. For each batch, context and length distribution (every sequence
full; uniform in [S/2, S]; uniform in [1, S]) this times rosekernels' e4m3 launch at each split count, the
plan's own pick and the bf16 cache (bf16 queries, d128, Qwen3-8B's heads 32/8 or --heads): CUDA graphs, input sets (each
with its own lengths) rotated past L2, every arm interleaved (bench/timing.py).

Results: fp8_kv_splits_sweep.json and .md (or --name's) in <out>/gemm/sweeps (bench/report.py). `best / planned`
takes the best of SPLITS; the plan may pick a count between them.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402
import timing  # noqa: E402

HEAD_DIM = 128
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 32)
LENGTHS = ("full", "half", "any")  # every sequence S; uniform in [S/2, S]; uniform in [1, S]
NAME = "fp8_kv_splits_sweep"


def lengths_of(kind: str, batch: int, context: int, g: torch.Generator) -> torch.Tensor:
    if kind == "full":
        return torch.full((batch,), context, dtype=torch.int32, device="cuda")
    low = context // 2 if kind == "half" else 1
    return torch.randint(low, context + 1, (batch,), generator=g, device="cuda", dtype=torch.int32)


def case(batch: int, context: int, kind: str, heads: tuple[int, int]) -> dict:
    import rosekernels
    from rosekernels.ops.kvcache import plan_kvcache

    g = torch.Generator(device="cuda").manual_seed(batch * 100003 + context)
    hq, hkv = heads
    one = torch.ones(1, device="cuda")
    set_bytes = 2 * batch * context * hkv * HEAD_DIM * 3  # the e4m3 and the bf16 caches, K and V
    sets = []
    for _ in range(timing.input_sets(set_bytes, most=32)):
        q = torch.randn(batch, 1, hq, HEAD_DIM, generator=g, device="cuda").to(torch.bfloat16)
        k, v = (torch.randn(batch, context, hkv, HEAD_DIM, generator=g, device="cuda").to(torch.bfloat16)
                for _ in "kv")
        sets.append({"q": q, "k": k, "v": v, "k8": k.to(torch.float8_e4m3fn), "v8": v.to(torch.float8_e4m3fn),
                     "lengths": lengths_of(kind, batch, context, g), "out": torch.empty_like(q),
                     "lse": torch.empty(batch, hq, 1, device="cuda")})
    s0 = sets[0]
    planned = plan_kvcache(s0["q"], s0["k8"], s0["v8"], s0["out"], s0["lengths"], None, True, HEAD_DIM ** -0.5)
    plans = {"planned": planned}
    plans.update({f"{n} splits": plan_kvcache(s0["q"], s0["k8"], s0["v8"], s0["out"], s0["lengths"], None, True,
                                              HEAD_DIM ** -0.5, splits=n) for n in SPLITS})

    def launch(p):
        def step(i):
            s = sets[i % len(sets)]
            p.launch(s["q"], s["k8"], s["v8"], s["out"], s["lse"], s["lengths"], None, one, one)
        return step

    want = None
    for name, p in plans.items():  # every split count computes the same softmax: equal to rounding
        launch(p)(0)
        if want is None:
            want = s0["out"].float().clone()
        elif not torch.allclose(s0["out"].float(), want, atol=2e-2, rtol=2e-2):
            raise AssertionError(f"{name} differs from the planned launch beyond rounding")

    def bf16(i):
        s = sets[i % len(sets)]
        return rosekernels.attention_with_kvcache(s["q"], s["k"], s["v"], s["lengths"])

    steps = {name: launch(p) for name, p in plans.items()}
    steps["bf16 cache"] = bf16
    # About 2 ms of work per graph: the e4m3 cache streams at about 2 TB/s on a full launch.
    calls = max(4, min(50, round(2000 / (set_bytes / 3 / 2e6 + 5))))
    us = timing.interleaved_graph_time_us(steps, calls=calls, rounds=9)
    return {"batch": batch, "context": context, "lengths": kind, "heads": f"{hq}/{hkv}", "sets": len(sets),
            "planned_splits": planned.cfg.splits, "times_us": us}


def markdown(data: dict) -> str:
    lines = [f"# The e4m3 KV cache's split count on {data['env']['gpu']}", "",
             "bench/fp8_kv_splits.py: decode attention, bf16 queries, d128; lengths `full`: every "
             "sequence S, `half`: uniform in [S/2, S], `any`: uniform in [1, S]. Times in us (CUDA graphs, input sets "
             "rotated past L2, arms interleaved); **bold**: the fastest split count; last column: the bf16 cache over the "
             "plan's pick.", "",
             "| heads | B | S | lengths | planned | " + " | ".join(str(n) for n in SPLITS) + " | best / planned | bf16 cache / planned |",
             "|" + "---|" * (len(SPLITS) + 7)]
    for r in data["rows"]:
        t = r["times_us"]
        split_t = [t[f"{n} splits"] for n in SPLITS]
        best = min(split_t)
        cells = [f"**{x:.1f}**" if x == best else f"{x:.1f}" for x in split_t]
        lines.append(f"| {r['heads']} | {r['batch']} | {r['context']} | {r['lengths']} | {t['planned']:.1f} ({r['planned_splits']}) | "
                     + " | ".join(cells) + f" | {best / t['planned']:.3f} | {t['bf16 cache'] / t['planned']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    report.add_out(ap)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--contexts", default="4096,8192,32768")
    ap.add_argument("--heads", default="32/8", help="query/KV heads, comma-separated pairs (Qwen3-8B: 32/8)")
    ap.add_argument("--name", default=NAME, help=f"the results' name, a sweep's (default {NAME}; a held-out run: "
                    "fp8_kv_splits_heldout_sweep)")
    args = ap.parse_args()
    if not (args.name.startswith("fp8_") and "_sweep" in args.name):
        ap.error(f"--name must start with fp8_ and hold _sweep (bench/report.py files it under gemm/sweeps), got {args.name!r}")
    report.require_gpu()
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    rows = []
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    for hs, batch, context, kind in itertools.product(heads, batches, contexts, LENGTHS):
        rows.append(case(batch, context, kind, hs))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    data = {"env": report.environment(), "splits": SPLITS, "rows": rows}
    report.write(args.out, args.name, data, markdown(data))


if __name__ == "__main__":
    main()
