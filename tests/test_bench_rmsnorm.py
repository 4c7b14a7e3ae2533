"""bench/rmsnorm.py on the CPU: a peer is timed only if it agrees with the float64 reference on the first set."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import rmsnorm as bench  # noqa: E402
from rosekernels.kernels import rmsnorm as rms  # noqa: E402


def _inputs(residual: bool):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    r = torch.randn(5, 256, generator=g).to(torch.bfloat16) if residual else None
    w = (torch.randn(256, generator=g) * 0.1 + 1).to(torch.bfloat16)
    return x, w, r, *rms.reference(x, w, bench.EPS, r)


def test_a_peer_within_the_references_roundings_is_kept_and_its_inputs_left_alone():
    for residual in (False, True):
        x, w, r, ref_out, ref_h = _inputs(residual)
        before = (x.clone(), None if r is None else r.clone())

        def in_place(x, w, r):  # FlashInfer's residual form: r += x, x = norm(r)
            if r is None:
                return F.rms_norm(x.float(), (x.shape[-1],), w.float(), bench.EPS).to(x.dtype), None
            r += x
            x.copy_(F.rms_norm(r.float(), (x.shape[-1],), w.float(), bench.EPS).to(x.dtype))
            return x, r

        errors = []
        assert bench.peer_agrees("p", in_place, x, w, r, ref_out, ref_h, errors) and not errors
        assert torch.equal(x, before[0]) and (r is None or torch.equal(r, before[1]))


def test_a_peer_off_the_reference_is_named_and_not_timed():
    for residual in (False, True):
        x, w, r, ref_out, ref_h = _inputs(residual)

        def unweighted(x, w, r):
            h = x if r is None else x + r
            out = F.rms_norm(h.float(), (x.shape[-1],), None, bench.EPS).to(x.dtype)
            return out if r is None else (out, h)

        errors = []
        assert not bench.peer_agrees("no weight", unweighted, x, w, r, ref_out, ref_h, errors)
        assert len(errors) == 1 and errors[0].startswith("no weight: error") and "not timed" in errors[0]
