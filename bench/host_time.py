"""Host time of one eager call of every op (decode shapes, where the host is the bottleneck): the cost of
the launch layer's fast path (plan lookup, dispatcher skip, device guard) on top of the kernel launch.

    python bench/host_time.py [--out DIR] [--label NAME] [--rounds 5]

Only the public API is called, so the same script times any version of the package that is first on
sys.path (an A/B of two trees runs it once per tree, alternately). Writes <out>/host_time_<label>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402
import timing  # noqa: E402

import rosekernels  # noqa: E402


def calls() -> dict:
    """name -> a zero-argument eager call on fixed, pre-allocated decode-sized tensors."""
    dev, bf = "cuda", torch.bfloat16
    q, k = torch.randn(1, 32, 128, device=dev, dtype=bf), torch.randn(1, 8, 128, device=dev, dtype=bf)
    wq, wk = torch.rand(128, device=dev, dtype=bf), torch.rand(128, device=dev, dtype=bf)
    oq, ok = torch.empty_like(q), torch.empty_like(k)
    x, w, r = (torch.randn(4, 4096, device=dev, dtype=bf), torch.rand(4096, device=dev, dtype=bf),
               torch.randn(4, 4096, device=dev, dtype=bf))
    y, ro = torch.empty_like(x), torch.empty_like(x)
    xm = torch.randn(128, 2048, device=dev, dtype=bf)
    ids = torch.stack([torch.randperm(128, device=dev)[:8] for _ in range(128)]).int()
    wts = torch.rand(128, 8, device=dev).softmax(1)
    d = rosekernels.moe_dispatch(xm, ids, 128)
    om = torch.empty_like(xm)
    a, b = torch.randn(16, 4096, device=dev, dtype=bf), torch.randn(4096, 4096, device=dev, dtype=bf)
    og = torch.empty(16, 4096, device=dev, dtype=bf)
    aq = torch.randn(16, 1, 32, 128, device=dev, dtype=bf)
    ak, av = (torch.randn(16, 1024, 8, 128, device=dev, dtype=bf) for _ in range(2))
    ao = torch.empty_like(aq)
    # Serving shapes: 16 sequences over a cache of 64 pages of 16 rows (4 per sequence); 4 packed prompts of 256.
    kc, vc = (torch.randn(64, 16, 8, 128, device=dev, dtype=bf) for _ in range(2))
    table = torch.arange(64, device=dev, dtype=torch.int32).view(16, 4)
    lengths = torch.full((16,), 50, device=dev, dtype=torch.int32)
    kn, vn = (torch.randn(16, 1, 8, 128, device=dev, dtype=bf) for _ in range(2))
    qv, ov = torch.randn(1024, 32, 128, device=dev, dtype=bf), torch.empty(1024, 32, 128, device=dev, dtype=bf)
    kv, vv = (torch.randn(1024, 8, 128, device=dev, dtype=bf) for _ in range(2))
    cu = torch.arange(0, 1025, 256, device=dev, dtype=torch.int32)
    return {
        "qk_norm T=1": lambda: rosekernels.qk_norm(q, k, wq, wk, out_q=oq, out_k=ok),
        "rmsnorm 4x4096 +residual": lambda: rosekernels.rmsnorm(x, w, residual=r, out=y, residual_out=ro),
        "moe_dispatch T=128": lambda: rosekernels.moe_dispatch(xm, ids, 128, buffer=d.buffer),
        "moe_combine T=128": lambda: rosekernels.moe_combine(d.buffer, wts, d.slot_map, out=om),
        "gemm_leakyrelu 16x4096x4096": lambda: rosekernels.gemm_leakyrelu(a, b, out=og),
        "attention decode B16 S1k": lambda: rosekernels.attention(aq, ak, av, out=ao),
        "attention_with_kvcache B16 paged": lambda: rosekernels.attention_with_kvcache(aq, kc, vc, lengths, table,
                                                                                      out=ao),
        "append_kvcache B16 paged": lambda: rosekernels.append_kvcache(kc, vc, kn, vn, lengths, table),
        "attention_varlen 4 x 256": lambda: rosekernels.attention_varlen(qv, kv, vv, cu, cu, 256, 256, causal=True,
                                                                          out=ov),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    report.add_out(p)
    p.add_argument("--label", default="current")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    report.require_gpu()
    fns = calls()
    result = {name: statistics.median(timing.host_time_us(lambda i, f=f: f(), calls=2000, reps=3)
                                      for _ in range(args.rounds)) for name, f in fns.items()}
    for name, us in result.items():
        print(f"{args.label:>10}  {name:<30} {us:7.2f} us")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"host_time_{args.label}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
