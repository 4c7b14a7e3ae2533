"""Qwen3's attention prologue, q/k norms then the rotary embedding: one rosekernels.qk_norm launch with the cos
and sin rows against the unfused paths; JSON + markdown.

    python bench/qk_norm_rope.py [--out bench/results] [--tokens 1,16,64,128,4096,16384] [--models ...]

Each arm takes the q and k projections' outputs ([T, H*d], bf16), the norms' weights and the layer's cos and sin
([T, d], bf16, as transformers' rotary embedding gives them) and returns the rotated q and k:
  "stock": transformers' Qwen3 code (Qwen3RMSNorm on q, then k, apply_rotary_pos_emb: about a dozen launches);
  "stock compiled": the same function under torch.compile (Inductor fuses the elementwise ops);
  "rosekernels qk_norm + torch rope": qk_norm, then apply_rotary_pos_emb (what rosekernels.hf ran before);
  "FlashInfer": FlashInfer's kernels as SGLang runs Qwen3: its rmsnorm over q's heads, then k's, then
  apply_rope_with_cos_sin_cache_inplace on a float32 cos|sin table indexed by position (three launches; its
  error beside the table);
  "rosekernels": qk_norm(..., cos=cos, sin=sin), what rosekernels.hf runs now; "rosekernels (A/A)": the same
  arm again, its spread the run's noise.
Device time per call in CUDA graphs, the arms interleaved round by round (timing.interleaved_graph_time_us);
inputs rotate over sets past the L2. Before timing, each size's rosekernels result is checked against the float64
reference (qk_norm.reference, error()), FlashInfer's against the same on its own float32 table (its norm rounds to
bf16 before the rotation: two roundings allowed).
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
THETA, MAX_POSITION = 1e6, 32768  # Qwen3's rope_theta; positions drawn below this
PEERS = ("stock", "stock compiled", "rosekernels qk_norm + torch rope", "FlashInfer")
ARMS = PEERS + ("rosekernels", "rosekernels (A/A)")


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


def angles(positions: torch.Tensor, d: int) -> torch.Tensor:
    """float64 [T, d / 2]: each position's rotation angle per frequency (transformers' default rope)."""
    return positions.double()[:, None] / THETA ** (torch.arange(0, d, 2, device=positions.device).double() / d)


def tables(tokens: int, d: int, g: torch.Generator, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """Random positions [T] and their cos and sin rows [T, d], as transformers' rotary embedding gives them (bf16,
    each frequency's angle twice)."""
    positions = torch.randint(0, MAX_POSITION, (tokens,), device=device, generator=g)
    emb = angles(positions, d).repeat(1, 2)
    return positions, emb.cos().to(DTYPE), emb.sin().to(DTYPE)


def cos_sin_cache(d: int, device: str = "cuda") -> torch.Tensor:
    """FlashInfer's (and vLLM's) table: float32 [MAX_POSITION, d], row p = cos of p's angles | their sin."""
    a = angles(torch.arange(MAX_POSITION, device=device), d)
    return torch.cat((a.cos(), a.sin()), dim=-1).float()


def flashinfer_arm():
    """fn(q, k, wq, wk, positions, cache, heads_q, heads_kv, d) -> rotated (q, k) [T, H, d] with FlashInfer."""
    import flashinfer

    def run(q, k, wq, wk, positions, cache, heads_q, heads_kv, d):
        qn = flashinfer.rmsnorm(q.view(-1, heads_q, d), wq, eps=EPS)
        kn = flashinfer.rmsnorm(k.view(-1, heads_kv, d), wk, eps=EPS)
        flashinfer.apply_rope_with_cos_sin_cache_inplace(positions, qn.view(len(q), -1), kn.view(len(k), -1), d,
                                                         cache, is_neox=True)
        return qn, kn
    return run


def errors_of(got, q, k, wq, wk, cos, sin) -> tuple[float, float]:
    """An arm's rotated (q, k) against the float64 reference on these tables: (error(), the rosekernels bar:
    within a rounding of an fp32-accurate rotation; the larger |got - ref| / (|ref| + the terms' magnitude),
    the bar of a norm rounded to bf16 before its rotation (FlashInfer's two launches), where a result the two
    terms cancel toward zero keeps the first rounding's error)."""
    inputs = (q.view(*got[0].shape), k.view(*got[1].shape), wq, wk, EPS, 0.0, cos, sin)
    strict, terms = 0.0, 0.0
    for out, ref, scale in zip(got, qkn.reference(*inputs), qkn.rope_scales(*inputs)):
        strict = max(strict, qkn.error(out, ref, scale))
        terms = max(terms, ((out.double() - ref).abs() / (ref.abs() + scale)).max().item())
    return strict, terms


def measure(model: str, tokens: int, rounds: int, flashinfer=None) -> dict:
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
    q, k, positions, cos, sin = sets[0]
    strict, terms = errors_of(ours(q, k, q_norm, k_norm, cos, sin, hq, hk, d), q, k, wq, wk, cos, sin)
    if strict > qkn.tolerance(DTYPE):
        raise AssertionError(f"{model} T={tokens}: error {strict:.3g} > {qkn.tolerance(DTYPE):.3g}")
    errors = {"rosekernels": terms}
    torch._dynamo.reset()  # each size compiles anew: past dynamo's recompile limit (8) it would run eagerly
    compiled = torch.compile(stock_prologue, dynamic=False)
    fns = {"stock": stock_prologue, "stock compiled": compiled,
           "rosekernels qk_norm + torch rope": ours_then_torch_rope, "rosekernels": ours, "rosekernels (A/A)": ours}
    steps = {name: (lambda i, f=f: f(*sets[i % n][:2], q_norm, k_norm, *sets[i % n][3:], hq, hk, d))
             for name, f in fns.items()}
    if flashinfer is not None:
        cache = cos_sin_cache(d)
        cos32, sin32 = (half.repeat(1, 2) for half in cache[positions].chunk(2, dim=-1))  # its rows, our layout
        _, errors["FlashInfer"] = errors_of(flashinfer(q, k, wq, wk, positions, cache, hq, hk, d),
                                            q, k, wq, wk, cos32, sin32)
        if errors["FlashInfer"] <= 2 * qkn.tolerance(DTYPE):  # a peer off the reference is reported, not timed
            steps["FlashInfer"] = lambda i: flashinfer(*sets[i % n][:2], wq, wk, sets[i % n][2], cache, hq, hk, d)
    us = timing.interleaved_graph_time_us(steps, calls=max(2 * n, 64), rounds=rounds)
    aa = abs(us["rosekernels (A/A)"] / us["rosekernels"] - 1)
    return {"model": model, "tokens": tokens, "heads": [hq, hk], "head_dim": d, "us": us, "aa": aa,
            "errors": errors, "speedup": {a: us[a] / us["rosekernels"] for a in PEERS if a in us}}


def markdown(env: dict, rows: list[dict], errors: list[str]) -> str:
    out = [f"# Qwen3 q/k norms + rotary embedding on {env['gpu']}", "",
           "bench/qk_norm_rope.py: from the q and k projections to the rotated heads. Device time per call (us) in "
           "CUDA graphs, arms interleaved, inputs rotated past the L2; x: that arm's time over rosekernels' "
           "(one qk_norm launch with the tables). A/A: the rosekernels arm timed twice. FlashInfer: its rmsnorm on "
           "q, on k, then its rope on a float32 table (SGLang's Qwen3 path). error: the largest |out - ref| / "
           "(|ref| + the rotation's terms) against the float64 reference, in bf16 roundings (a peer past 2 is "
           "not timed; rosekernels also meets the stricter error() bar, within a rounding of |ref|).", "",
           "| model | T | " + " | ".join(PEERS) + " | rosekernels | A/A | error: FlashInfer / rosekernels |",
           "|---|---:|" + "---:|" * (len(PEERS) + 3)]
    tol = qkn.tolerance(DTYPE)
    for r in rows:
        cells = [f"{fmt(r['us'][a], 2)} ({r['speedup'][a]:.2f}x)" if a in r["us"] else "-" for a in PEERS]
        err = r.get("errors", {})
        out.append(f"| {r['model']} | {r['tokens']} | " + " | ".join(cells)
                   + f" | {fmt(r['us']['rosekernels'], 2)} | {100 * r['aa']:.1f}% | "
                   + " / ".join(fmt(err[a] / tol, 2) if a in err else "-" for a in ("FlashInfer", "rosekernels"))
                   + " |")
    out += [""] + [f"- error: {e}" for e in errors]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    unavailable: list[str] = []
    flashinfer = report.try_peer("FlashInfer", flashinfer_arm, unavailable)
    return report.model_sweep(argv, __doc__, "qk_norm_rope", MODELS, TOKENS,
                              lambda m, t, rounds: measure(m, t, rounds, flashinfer),
                              lambda row: ", ".join(f"{a} {us:.2f} us" for a, us in row["us"].items())
                              + f" (A/A {100 * row['aa']:.1f}%)",
                              lambda env, rows, errors: markdown(env, rows, unavailable + errors), ("flashinfer",))


if __name__ == "__main__":
    sys.exit(main())
