"""Why the grouped GEMM's prefill runs at 49-66% of the dense kernel (issue 43): the same gate-up GEMM on the
dense kernel with and without its 2x1 cluster, and walked in the grouped kernel's order, beside the grouped kernel.

    python bench/moe_grouped_prefill.py [--out bench/results] [--geometries mixtral-8x7b,qwen3-235b-a22b]
        [--tokens 16384]

Per geometry, T tokens routed top-k: the grouped kernel (`grouped_gemm`, prefill tiles, gated SwiGLU) on T x k
rows over E experts, and the dense kernel (`gemm_leakyrelu`, gated SwiGLU) on as many rows (the same FLOPs, the
same N = 2I and K = H, one weight matrix) in three walks:
- "dense": its heuristic config (a 2x1 cluster: the weight tile multicast to two row tiles; bands of 8 cluster
  rows walked column by column);
- "dense 1x1": the same tile on one CTA (no multicast), same bands;
- "dense 1x1, expert bands": no multicast, bands of one expert's row tiles: the grouped kernel's walk (an expert's
  row tiles fastest, then its weight tiles), less its per-expert weights; only where an expert has other than
  8 row tiles (Mixtral: 32), since "dense 1x1" walks bands of 8.
"grouped 2x1": the grouped kernel on 2x1 clusters (`cluster_m` 2: two row tiles of an expert share the multicast
weight tile), the dense heuristic's multicast brought to the grouped walk. "grouped swapped WxR": the swapped
(decode) tiles of W weight rows x R expert rows (SWAPPED) at prefill sizes, where 128-row plain tiles pad an
expert's rows. The grouped arms' offsets are a top-k routing's (every expert has rows).
The grouped kernel's and the dense kernel's mainloops are the same code (`sip loops` on the two cubins: 73 and 70
instructions, 219 and 203 stall cycles per k-tile), so the gap is in what they read, not in what they issue. Where
"grouped" lands says what holds it back: beside "dense 1x1", the missing multicast; beside "dense 1x1, expert
bands", the walk as well; below both, something else (Nsight Compute next).

Each arm's kernel is launched as the tuner's worker launches it (its Workload, make_args over input sets rotated
past L2), its calls captured in a CUDA graph, the arms replayed interleaved (timing.interleaved_graph_time_us).
Writes moe_grouped_prefill.json and .md under --out's moe/.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402  (bench/report.py: environment and result files)
import timing  # noqa: E402
from report import fmt  # noqa: E402
from rosekernels.kernels import gemm_leakyrelu as dense_kernel, gemm_leakyrelu_plan as dense_plan  # noqa: E402
from rosekernels.kernels import grouped_gemm as grouped_kernel, grouped_gemm_plan as grouped_plan  # noqa: E402

# (hidden H, MoE intermediate I, experts E, top-k) of bench/moe_experts.py's geometries that hold all their
# experts (a benchmark script imports no other: tests/test_layers.py)
GEOMETRIES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-235b-a22b": (4096, 1536, 128, 8),
              "qwen3-30b-a3b": (2048, 768, 128, 8)}
TOKENS = 16384
SWAPPED = ((128, 96), (128, 128), (64, 128))  # (weight rows, expert rows) of the swapped arms


def arms(geometry: str, tokens: int) -> dict[str, tuple]:
    """{arm: (kernel module, config, shape)} of one geometry (no GPU: planning only)."""
    hidden, inter, experts, top_k = GEOMETRIES[geometry]
    rows = tokens * top_k
    gshape = grouped_plan.GroupedShape(rows, experts, 2 * inter, hidden, activation="silu", gated=True)
    dshape = dense_plan.GemmShape(rows, 2 * inter, hidden, activation="silu", gated=True)
    dense = dense_plan.config_for(dshape)
    one = dataclasses.replace(dense, cluster_m=1, cluster_n=1)
    grouped = grouped_plan.config_for(gshape)
    found = {"grouped": (grouped_kernel, grouped, gshape),
             "grouped 2x1": (grouped_kernel, dataclasses.replace(grouped, cluster_m=2), gshape),
             "dense": (dense_kernel, dense, dshape),
             "dense 1x1": (dense_kernel, one, dshape)}
    expert_tiles = -(-(rows // experts) // one.tile_m)  # an expert's row tiles, on average
    if expert_tiles != one.raster_group:  # else "dense 1x1" walks that way already
        found["dense 1x1, expert bands"] = (dense_kernel, dataclasses.replace(one, raster_group=expert_tiles), dshape)
    # The swapped (decode) tiles at prefill sizes: an expert's rows on the MMA's N side come in tiles of 96 or
    # 128, where the plain tiles' 128-row M side pads about 256 rows an expert (T = 4096, top-8 of 128) to 320.
    for tm, tn in SWAPPED:
        found[f"grouped swapped {tm}x{tn}"] = (grouped_kernel, dataclasses.replace(
            grouped, tile_m=tm, tile_n=tn, swap_ab=True, pingpong=False, cluster_m=1), gshape)
    return found


def routed_args(module, work, shape, seed: int) -> tuple:
    """The workload's arguments of input set `seed`; a grouped kernel's offsets redrawn as a top-k routing draws
    them, every expert with rows (the workload's own draw leaves a quarter of the experts empty)."""
    args = work.make_args(seed)
    if module is grouped_kernel:
        offsets = args[4]  # (x, w, out, bias, offsets, ...): grouped_gemm.launch_args' order
        offsets.copy_(grouped_kernel.random_offsets(shape.rows, shape.experts, torch.Generator().manual_seed(seed),
                                                    empty=0.0))
    return args


def measure(geometry: str, tokens: int, rounds: int) -> dict:
    found = arms(geometry, tokens)
    steps, about = {}, {}
    for name, (module, config, shape) in found.items():
        work = module.workload(config, shape)
        first = routed_args(module, work, shape, 0)
        bytes_per_set = sum(t.numel() * t.element_size() for t in first if hasattr(t, "numel"))
        sets = [first] + [routed_args(module, work, shape, s)
                          for s in range(1, timing.input_sets(bytes_per_set, least=1, most=3))]
        steps[name] = lambda i, w=work, sets=sets: w.run(w.kernel.fn, sets[i % len(sets)])
        about[name] = {"variant": config.variant().key(), "raster_group": getattr(config, "raster_group", None),
                       "input_sets": len(sets)}
    us = timing.interleaved_graph_time_us(steps, calls=2, rounds=rounds, warmup=1)
    hidden, inter, _, top_k = GEOMETRIES[geometry]
    flops = 2.0 * tokens * top_k * 2 * inter * hidden
    return {"geometry": geometry, "tokens": tokens, "flops": flops, "us": us,
            "tflops": {k: flops / (t * 1e-6) / 1e12 for k, t in us.items()}, "arms": about}


def markdown(env: dict, rows: list[dict], errors: list[str]) -> str:
    names = list(dict.fromkeys(k for r in rows for k in r["us"]))
    out = [f"# The grouped GEMM's prefill against the dense kernel's walks ({env.get('gpu', '?')})", "",
           "Gate-up GEMM (gated SwiGLU) of T tokens x top-k rows; TFLOP/s from CUDA graphs over input sets rotated "
           "past L2, arms interleaved; ratio: over the dense heuristic (see bench/moe_grouped_prefill.py).", "",
           "| geometry | T | " + " | ".join(names) + " | " + " | ".join(f"{n} / dense" for n in names[:1] + names[2:])
           + " |", "|---|---|" + "---|" * (2 * len(names) - 1)]
    for r in rows:
        t = r["tflops"]
        out.append(f"| {r['geometry']} | {r['tokens']} | " + " | ".join(fmt(t.get(n), 0) for n in names) + " | "
                   + " | ".join(fmt(report.ratio(t.get(n), t.get("dense")), 3) for n in names[:1] + names[2:]) + " |")
    if errors:
        out += ["", "## Errors", ""] + [f"- {e}" for e in errors]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    report.add_out(p)
    p.add_argument("--geometries", default="mixtral-8x7b,qwen3-235b-a22b")
    p.add_argument("--tokens", type=int, default=TOKENS)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    geometries = report.known_names(p, args.geometries, GEOMETRIES, "geometries")
    cases = [(f"{g} T={args.tokens}", lambda g=g: measure(g, args.tokens, args.rounds)) for g in geometries]
    return report.run_cases(args.out, "moe_grouped_prefill", cases,
                            lambda row: ", ".join(f"{k} {v:.0f}" for k, v in row["tflops"].items()) + " TFLOP/s",
                            markdown)


if __name__ == "__main__":
    sys.exit(main())
