"""bench/qk_norm.py on the CPU: a peer is timed only if its per-head norms agree with the float64 reference."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import qk_norm as bench  # noqa: E402
from rosekernels.kernels import qk_norm as qkn  # noqa: E402


def test_peers_are_held_to_the_reference_per_head():
    g = torch.Generator().manual_seed(6)
    t, hq, hk, d = 3, 4, 2, bench.HEAD_DIM
    q = torch.randn(t, hq, d, generator=g).to(torch.bfloat16)
    k = torch.randn(t, hk, d, generator=g).to(torch.bfloat16)
    wq, wk = ((torch.randn(d, generator=g) * 0.1 + 1).to(torch.bfloat16) for _ in "qk")
    ref_q, ref_k = qkn.reference(q, k, wq, wk, bench.EPS)

    def flat(q, k, wq, wk):  # per head on [T * h, d], as quack and liger return it
        return tuple(F.rms_norm(x.reshape(-1, d).float(), (d,), w.float(), bench.EPS).to(x.dtype)
                     for x, w in ((q, wq), (k, wk)))

    def whole_row(q, k, wq, wk):  # one norm over all of a token's heads: not Qwen3's q/k norm
        return tuple((x.float() * torch.rsqrt(x.float().pow(2).mean((-2, -1), keepdim=True) + bench.EPS)
                      * w.float()).to(x.dtype) for x, w in ((q, wq), (k, wk)))

    errors = []
    assert bench.peer_agrees("flat", flat, q, k, wq, wk, ref_q, ref_k, errors) and not errors
    assert not bench.peer_agrees("whole row", whole_row, q, k, wq, wk, ref_q, ref_k, errors)
    assert len(errors) == 1 and errors[0].startswith("whole row: error") and errors[0].endswith("not timed")
