"""Shared by the attention tests: the float64 reference, the result check, inputs, a hang-safe sync."""
import os
import sys
import time

import torch


def reference(q, k, v, causal, scale, lowp=False):
    """(out, lse) in float64; lowp: the kernel's rounding (P and out in the input dtype, fp32 math).

    Causal is bottom-right aligned; a row that sees no key gets out = 0, lse = -inf."""
    ratio = q.shape[2] // k.shape[2]
    acc = torch.float32 if lowp else torch.float64
    qh, kh, vh = (t.transpose(1, 2).to(acc) for t in (q, k, v))  # [B, H, S, d]
    kh, vh = kh.repeat_interleave(ratio, dim=1), vh.repeat_interleave(ratio, dim=1)
    s = qh @ kh.transpose(-1, -2) * scale
    s_q, s_k = q.shape[1], k.shape[1]
    if causal:
        i = torch.arange(s_q, device=q.device)[:, None]
        j = torch.arange(s_k, device=q.device)[None, :]
        s = s.masked_fill(j > i + s_k - s_q, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if lowp:
        p = p.to(q.dtype).to(acc)
    out = (p @ vh).transpose(1, 2)
    if lowp:
        out = out.to(q.dtype)
    return out.double(), lse.double()


def check(out, lse, q, k, v, causal, scale, what):
    """out within 2x the error of a same-precision reference (+1e-3), every element written; with
    lse: lse to 1e-3, -inf exactly on the rows that see no key, and those rows of out 0."""
    ref, ref_lse = reference(q, k, v, causal, scale)
    lowp, _ = reference(q, k, v, causal, scale, lowp=True)
    assert not out.isnan().any(), f"{what}: {out.isnan().sum().item()} output elements unwritten (NaN)"
    err = (out.double() - ref).abs().max().item()
    err_lowp = (lowp - ref).abs().max().item()
    assert err <= 2 * err_lowp + 1e-3, f"{what}: max |out - ref| = {err:.3g}, same-precision reference {err_lowp:.3g}"
    if lse is None:
        return
    assert not lse.isnan().any(), f"{what}: {lse.isnan().sum().item()} lse elements unwritten (NaN)"
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), f"{what}: -inf lse rows differ from the reference"
    assert (out.double()[empty.transpose(1, 2)] == 0).all(), f"{what}: a row that sees no key is not 0"
    lse_err = (lse.double() - ref_lse)[~empty].abs().max().item() if (~empty).any() else 0.0
    assert lse_err <= 1e-3, f"{what}: max |lse - ref| = {lse_err:.3g}"


def inputs(b, s_q, s_k, hq, hkv, d, dtype, seed):
    """Fresh random q [b, s_q, hq, d], k and v [b, s_k, hkv, d] on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g, device="cuda").to(dtype)
            for s, h in ((s_q, hq), (s_k, hkv), (s_k, hkv))]


def sync(what, timeout_s=60.0):
    """Synchronize, but end the process with a message if the kernel hangs (a pipeline deadlock
    would otherwise hold the GPU until the job's time runs out)."""
    done = torch.cuda.Event()
    done.record()
    start = time.time()
    while not done.query():
        if time.time() - start > timeout_s:
            print(f"\nKERNEL HANG: {what} did not finish in {timeout_s:.0f} s", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.001)
