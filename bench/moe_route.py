"""A MoE router after its GEMM: rosekernels.moe_route against the stock router's torch ops; JSON + markdown.

    python bench/moe_route.py [--out bench/results] [--tokens 1,16,64,128,512,4096] [--models ...]

Each arm is a whole router as a model calls it, the GEMM included: hidden states [T, H] (bf16) -> logits
(F.linear, cuBLAS, the same in both arms) -> weights (bf16) and ids. "torch" is transformers' Qwen3-MoE
router (softmax in fp32, torch.topk, the division by the chosen sum, the cast); "rosekernels" is
F.linear + moe_route(weight_dtype=bf16), what rosekernels.hf runs; "rosekernels (A/A)" is the same arm
again, its spread the run's noise. Device time per call in CUDA graphs, the arms interleaved round by
round (timing.interleaved_graph_time_us); hidden states and router weights rotate over sets past the L2.
Before timing, each size's rosekernels ids are checked against torch.topk's (the same sets: distinct
logits) and its weights against the float64 reference.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402
import timing  # noqa: E402
from report import fmt  # noqa: E402
import rosekernels  # noqa: E402
from rosekernels.kernels import moe_route as mr  # noqa: E402

DTYPE = torch.bfloat16
# name -> (hidden, experts, top-k, renormalise): the routers transformers runs this way (softmax, top-k).
MODELS = {"qwen3-30b-a3b": (2048, 128, 8, True), "qwen3-235b-a22b": (4096, 128, 8, True),
          "mixtral-8x7b": (4096, 8, 2, True), "qwen1.5-moe-a2.7b": (2048, 60, 4, False)}
TOKENS = (1, 16, 64, 128, 512, 4096)


def torch_router(h: torch.Tensor, w: torch.Tensor, k: int, renormalize: bool):
    """transformers' Qwen3MoeTopKRouter.forward after its reshape."""
    logits = F.linear(h, w)
    p = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, ids = torch.topk(p, k, dim=-1)
    if renormalize:
        top /= top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def our_router(h: torch.Tensor, w: torch.Tensor, k: int, renormalize: bool):
    logits = F.linear(h, w)
    return rosekernels.moe_route(logits, k, renormalize, weight_dtype=logits.dtype)


def measure(model: str, tokens: int, rounds: int) -> dict:
    hidden, experts, k, renorm = MODELS[model]
    per_set = (tokens * hidden + experts * hidden) * 2
    n = timing.input_sets(per_set, most=64)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    hs = [torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, generator=g) for _ in range(n)]
    ws = [torch.randn(experts, hidden, device="cuda", dtype=DTYPE, generator=g) / hidden**0.5 for _ in range(n)]
    # Check first: distinct logits (a permutation per token) give one right set of experts.
    distinct = (torch.stack([torch.randperm(experts) for _ in range(tokens)]) / 4).to(device="cuda", dtype=DTYPE)
    weights, ids = rosekernels.moe_route(distinct, k, renorm, weight_dtype=DTYPE)
    want_w, want_ids = mr.reference(distinct, k, renorm)
    if not torch.equal(ids.long(), want_ids) or not torch.equal(
            torch.topk(torch.softmax(distinct.float(), -1), k).indices, want_ids):
        raise AssertionError(f"{model} T={tokens}: ids differ from torch.topk's")
    torch.testing.assert_close(weights.double(), want_w.to(DTYPE).double(), rtol=2**-7, atol=0)
    steps = {"torch": lambda i: torch_router(hs[i % n], ws[i % n], k, renorm),
             "rosekernels": lambda i: our_router(hs[i % n], ws[i % n], k, renorm),
             "rosekernels (A/A)": lambda i: our_router(hs[i % n], ws[i % n], k, renorm)}
    us = timing.interleaved_graph_time_us(steps, calls=max(2 * n, 64), rounds=rounds)
    aa = abs(us["rosekernels (A/A)"] / us["rosekernels"] - 1)
    return {"model": model, "tokens": tokens, "hidden": hidden, "experts": experts, "topk": k,
            "renormalize": renorm, "us": us, "speedup": us["torch"] / us["rosekernels"], "aa": aa}


def markdown(env: dict, rows: list[dict], errors: list[str]) -> str:
    out = [f"# MoE router on {env['gpu']}", "",
           "bench/moe_route.py: the router's GEMM (F.linear, the same in both arms), then torch's softmax + topk + "
           "renormalise + cast, or rosekernels.moe_route. Device time per call (us) in CUDA graphs, arms interleaved; "
           "inputs rotated past the L2. A/A: the rosekernels arm timed twice.", "",
           "| model | E | k | T | torch | rosekernels | speedup | A/A |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['experts']} | {r['topk']} | {r['tokens']} | {fmt(r['us']['torch'], 2)} | "
                   f"{fmt(r['us']['rosekernels'], 2)} | {r['speedup']:.2f}x | {100 * r['aa']:.1f}% |")
    out += [""] + [f"- error: {e}" for e in errors]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    return report.model_sweep(argv, __doc__, "moe_route", MODELS, TOKENS, measure,
                              lambda row: f"torch {row['us']['torch']:.2f} us, rosekernels "
                              f"{row['us']['rosekernels']:.2f} us ({row['speedup']:.2f}x, A/A {100 * row['aa']:.1f}%)",
                              markdown)


if __name__ == "__main__":
    sys.exit(main())
