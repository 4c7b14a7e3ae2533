"""Shared by the attention tests: the result check against the float64 reference (the one the kernels'
workloads check with), inputs, a hang-safe sync."""
import os
import re
import sys
import time
import types

import torch

import pytest
from kernel_sass import sass_of
from sip.cubin import parse_cubin

from rosekernels import checks, launch
from rosekernels.kernels.attention_common import check  # noqa: F401
from rosekernels.kernels.attention_decode_plan import register_budget


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


def sequence_kv(k_cache, v_cache, lengths, b, block_table=None):
    """Sequence b's keys and values as dense [1, lengths[b], Hkv, d] tensors, gathered from a contiguous
    cache [B, S_max, Hkv, d] or through a block table from a paged one [num_blocks, block_size, Hkv, d]."""
    n = int(lengths[b])
    if block_table is None:
        return k_cache[b:b + 1, :n], v_cache[b:b + 1, :n]
    pos = torch.arange(n, device=k_cache.device)
    pages, rows = block_table[b].long()[pos // k_cache.shape[1]], pos % k_cache.shape[1]
    return k_cache[pages, rows][None], v_cache[pages, rows][None]


def check_kvcache(out, lse, q, k_cache, v_cache, lengths, block_table, causal, scale, what):
    """`check` of attention_with_kvcache's out and lse, sequence by sequence against the float64 reference
    over the keys it holds (causal bottom-right to its length; length 0: out 0, lse -inf)."""
    for b in range(q.shape[0]):
        k, v = sequence_kv(k_cache, v_cache, lengths, b, block_table)
        check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k, v, causal, scale, f"{what}, sequence {b} of length {len(k[0])}")


def paged_cache(k, v, lengths, block_size, spare_blocks, generator):
    """A paged copy of the contiguous cache k, v [B, S_max, Hkv, d]: each sequence's ceil(length / block_size)
    pages at random places among all the blocks (spare_blocks more than needed, holding noise, as
    freed pages would), its ragged last page's tail noise too. Returns k_cache, v_cache [num_blocks,
    block_size, Hkv, d] and block_table [B, max_blocks] int32 with the entries past each sequence's
    pages set to garbage ids (-1, num_blocks, 2^31 - 1 in turn)."""
    B, S_max, Hkv, d = k.shape
    max_blocks = -(-S_max // block_size)
    used = [-(-int(n) // block_size) for n in lengths]
    num_blocks = sum(used) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator, device="cpu").tolist()
    table = torch.tensor([[-1, num_blocks, 2**31 - 1][j % 3] for j in range(max_blocks)] * B,
                         dtype=torch.int32).view(B, max_blocks)
    noise = torch.randn(2, num_blocks, block_size, Hkv, d, generator=generator, device="cpu").to(k.dtype).to(k.device)
    k_cache, v_cache = noise[0].clone(), noise[1].clone()
    for b in range(B):
        for j in range(used[b]):
            page = order.pop()
            table[b, j] = page
            rows = min(block_size, int(lengths[b]) - j * block_size)
            k_cache[page, :rows] = k[b, j * block_size:j * block_size + rows]
            v_cache[page, :rows] = v[b, j * block_size:j * block_size + rows]
    return k_cache, v_cache, table.to(k.device)


def refuses_an_out_overlapping_k_or_v(monkeypatch, op, planner, call, q, v, names):
    """`call(q, k, v, out=...)` on CPU tensors, with the op module `op`'s plans made anew and its `planner`
    (the attribute that builds a plan) giving a launch that only counts: an out overlapping k or v (named
    `names`) is refused before anything is written, on a new signature and on one already planned (the key
    holds no pointers); out = q is not refused."""
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(op, "_plans", launch.PlanCache())
    launches = []
    plan = types.SimpleNamespace(launch=lambda *args: launches.append(args))  # no kernel on the CPU
    monkeypatch.setattr(op, planner, lambda *args, **kwargs: plan)
    buf = torch.full((v.numel() + q.numel(),), 7.0, dtype=q.dtype)
    k = buf[:v.numel()].view(v.shape)
    overlapping = buf[:q.numel()].view(q.shape)  # its first rows are k
    for planned in (False, True):
        for k_, v_, name in ((k, v, names[0]), (v, k, names[1])):
            with pytest.raises(ValueError, match=f"out must not overlap {name}"):
                call(q, k_, v_, out=overlapping)
        assert bool((buf == 7.0).all()) and len(launches) == planned
        call(q, k, v, out=buf[v.numel():].view(q.shape))  # plans the signature
    call(q, k, v, out=q)
    assert len(launches) == 3


def refuses_an_out_whose_elements_overlap(monkeypatch, call, shape, stride):
    """`call(out=...)` with out as_strided over a poisoned buffer so that CTAs would store the same elements:
    refused before anything is written, as zero strides are."""
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)  # CPU tensors stand in for CUDA ones
    store = torch.full((10**5,), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out's elements overlap one another"):
        call(out=store.as_strided(shape, stride))
    assert bool((store == 7.0).all())


def decode_sass(cfg, kernel, tmp_path) -> str:
    """The SASS of a split-KV decode kernel (dense or KV-cache), after what every one must have: built
    for sm_90, registers for as many CTAs per SM as its plan counts on, mma.sync, TMA loads, ldmatrix, the
    combine's atomics, no register spills. Skips the test without nvdisasm."""
    cubin = parse_cubin(kernel.cubin)
    assert cubin.arch == "sm_90a", cfg
    # the CTAs per SM its plan counts on fit in the registers
    registers = max(a.words()[1] for a in cubin.nvinfo if a.name == "EIATTR_REGCOUNT")
    assert registers <= register_budget(cfg.warps, cfg.min_ctas_per_sm), (cfg, registers)
    sass = sass_of(kernel, tmp_path)
    if sass is None:
        pytest.skip("nvdisasm (nvidia-cuda-nvdisasm) is not installed")
    ops = set(re.findall(r"\b(HMMA|UTMALDG|LDSM|ATOMG|LDL|STL)\b", sass))
    # (an e4m3 cache widened in registers loads its fragments without ldmatrix)
    assert {"HMMA", "UTMALDG", "ATOMG"} | ({"LDSM"} - ({"LDSM"} if cfg.widen_regs else set())) <= ops, (cfg, ops)
    assert not {"LDL", "STL"} & ops, f"{cfg} spills registers to local memory"
    return sass
