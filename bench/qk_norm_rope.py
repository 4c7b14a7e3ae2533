"""Qwen3's attention prologue, q/k norms then the rotary embedding: one rosekernels.qk_norm launch with the cos
and sin rows against the unfused paths; JSON + markdown.

    python bench/qk_norm_rope.py [--out bench/results] [--tokens 1,16,64,128,4096,16384] [--models ...]

Each arm takes the q and k projections' outputs ([T, H*d], bf16), the norms' weights and the layer's cos and sin
([T, d], bf16, as transformers' rotary embedding gives them) and returns the rotated q and k:
  "stock": transformers' Qwen3 code (Qwen3RMSNorm on q, then k, apply_rotary_pos_emb: about a dozen launches);
  "stock compiled": the same function under torch.compile (Inductor fuses the elementwise ops);
  "rosekernels qk_norm + torch rope": qk_norm, then apply_rotary_pos_emb (what rosekernels.hf ran before);
  "rosekernels": qk_norm(..., cos=cos, sin=sin), what rosekernels.hf runs now; "rosekernels (A/A)": the same
  arm again, its spread the run's noise.
Device time per call in CUDA graphs, the arms interleaved round by round (timing.interleaved_graph_time_us);
inputs rotate over sets past the L2. Before timing, each size's rosekernels result is checked against the float64
reference (qk_norm.reference, error()).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402
import timing  # noqa: E402
from report import fmt  # noqa: E402
import rosekernels  # noqa: E402
from rosekernels.kernels import qk_norm as qkn  # noqa: E402

DTYPE = torch.bfloat16
EPS = 1e-6
MODELS = {"qwen3-8b": (32, 8, 128), "qwen3-30b-a3b": (32, 4, 128)}  # q heads, kv heads, head dim
TOKENS = (1, 16, 64, 128, 4096, 16384)
ARMS = ("stock", "stock compiled", "rosekernels qk_norm + torch rope", "rosekernels", "rosekernels (A/A)")


def norms(wq: torch.Tensor, wk: torch.Tensor) -> tuple:
    """transformers' Qwen3RMSNorm modules holding these weights: the stock arms' q_norm and k_norm."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    out = tuple(Qwen3RMSNorm(w.shape[0], eps=EPS).to(w.device, w.dtype) for w in (wq, wk))
    for module, w in zip(out, (wq, wk)):
        module.weight.data = w
    return out


def stock_prologue(q, k, q_norm, k_norm, cos, sin, heads_q, heads_kv, d):
    """transformers' Qwen3Attention.forward from the projections to the rotated q and k (B = 1, S = T)."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    qs = q_norm(q.view(1, -1, heads_q, d)).transpose(1, 2)
    ks = k_norm(k.view(1, -1, heads_kv, d)).transpose(1, 2)
    return apply_rotary_pos_emb(qs, ks, cos[None], sin[None])


def ours_then_torch_rope(q, k, q_norm, k_norm, cos, sin, heads_q, heads_kv, d):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    qn, kn = rosekernels.qk_norm(q.view(-1, heads_q, d), k.view(-1, heads_kv, d), q_norm.weight, k_norm.weight,
                                 eps=EPS)
    return apply_rotary_pos_emb(qn[None].transpose(1, 2), kn[None].transpose(1, 2), cos[None], sin[None])


def ours(q, k, q_norm, k_norm, cos, sin, heads_q, heads_kv, d):
    return rosekernels.qk_norm(q.view(-1, heads_q, d), k.view(-1, heads_kv, d), q_norm.weight, k_norm.weight,
                               eps=EPS, cos=cos, sin=sin)


def tables(tokens: int, d: int, g: torch.Generator, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin rows of random positions, as transformers' rotary embedding gives them (theta 1e6, bf16)."""
    positions = torch.randint(0, 32768, (tokens, 1), device=device, generator=g).double()
    freqs = positions / 1e6 ** (torch.arange(0, d, 2, device=device).double() / d)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DTYPE), emb.sin().to(DTYPE)


def measure(model: str, tokens: int, rounds: int) -> dict:
    hq, hk, d = MODELS[model]
    per_set = tokens * (hq + hk + 2) * d * 2
    n = timing.input_sets(per_set, most=64)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    sets = []
    for _ in range(n):
        q = torch.randn(tokens, hq * d, device="cuda", generator=g).mul_(3).to(DTYPE)
        k = torch.randn(tokens, hk * d, device="cuda", generator=g).to(DTYPE)
        sets.append((q, k, *tables(tokens, d, g)))
    wq, wk = (torch.randn(d, device="cuda", generator=g).mul_(0.3).add_(1).to(DTYPE) for _ in "qk")
    q_norm, k_norm = norms(wq, wk)
    q, k, cos, sin = sets[0]
    got = ours(q, k, q_norm, k_norm, cos, sin, hq, hk, d)
    inputs = (q.view(-1, hq, d), k.view(-1, hk, d), wq, wk, EPS, 0.0, cos, sin)
    for out, ref, scale in zip(got, qkn.reference(*inputs), qkn.rope_scales(*inputs)):
        err = qkn.error(out, ref, scale)
        if err > qkn.tolerance(DTYPE):
            raise AssertionError(f"{model} T={tokens}: error {err:.3g} > {qkn.tolerance(DTYPE):.3g}")
    torch._dynamo.reset()  # each size compiles anew: past dynamo's recompile limit (8) it would run eagerly
    compiled = torch.compile(stock_prologue, dynamic=False)
    fns = dict(zip(ARMS, (stock_prologue, compiled, ours_then_torch_rope, ours, ours)))
    steps = {name: (lambda i, f=f: f(*sets[i % n][:2], q_norm, k_norm, *sets[i % n][2:], hq, hk, d))
             for name, f in fns.items()}
    us = timing.interleaved_graph_time_us(steps, calls=max(2 * n, 64), rounds=rounds)
    aa = abs(us["rosekernels (A/A)"] / us["rosekernels"] - 1)
    return {"model": model, "tokens": tokens, "heads": [hq, hk], "head_dim": d, "us": us, "aa": aa,
            "speedup": {a: us[a] / us["rosekernels"] for a in ARMS[:3]}}


def markdown(env: dict, rows: list[dict], errors: list[str]) -> str:
    out = [f"# Qwen3 q/k norms + rotary embedding on {env['gpu']}", "",
           "bench/qk_norm_rope.py: from the q and k projections to the rotated heads. Device time per call (us) in "
           "CUDA graphs, arms interleaved, inputs rotated past the L2; x: that arm's time over rosekernels' "
           "(one qk_norm launch with the tables). A/A: the rosekernels arm timed twice.", "",
           "| model | T | " + " | ".join(ARMS[:4]) + " | A/A |", "|---|---:|" + "---:|" * 5]
    for r in rows:
        cells = [f"{fmt(r['us'][a], 2)} ({r['speedup'][a]:.2f}x)" for a in ARMS[:3]]
        out.append(f"| {r['model']} | {r['tokens']} | " + " | ".join(cells)
                   + f" | {fmt(r['us']['rosekernels'], 2)} | {100 * r['aa']:.1f}% |")
    out += [""] + [f"- error: {e}" for e in errors]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    return report.model_sweep(argv, __doc__, "qk_norm_rope", MODELS, TOKENS, measure,
                              lambda row: ", ".join(f"{a} {row['us'][a]:.2f} us" for a in ARMS)
                              + f" (A/A {100 * row['aa']:.1f}%)", markdown)


if __name__ == "__main__":
    sys.exit(main())
