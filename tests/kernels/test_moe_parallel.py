"""MoE across GPUs (rosekernels.moe): the peer kernels compile for sm_90a with the release/acquire
protocol in their SASS (CPU); on one GPU, ranks emulated on streams (SymmetricMemory refuses two ranks
on one device) against single-GPU references: expert parallel bitwise equal to one GPU's dispatch +
combine of the same expert rows (random, dropped, skewed and invalid routings, ragged batches, T up to
8192, bf16/fp16), tensor parallel within the float64 bound and bitwise equal across ranks, many steps
in a row and CUDA-graph replays (the step counter), a peer that never signals (timeout, no hang).
The same protocol on two GPUs: tests/kernels/test_moe_multigpu.py (torchrun)."""
import re

import pytest
import torch

from kernel_sass import sass_of
import rosekernels
from rosekernels import moe
from rosekernels.kernels import moe_combine as mc
from rosekernels.kernels import moe_peer as mp

BF16, FP16 = torch.bfloat16, torch.float16


# ---------------------------------------------------------------------------------------------
# CPU

CONFIGS = [mp.PeerConfig("ep_send", 2, "bf16", 7168, 8, 128), mp.PeerConfig("ep_send", 4, "fp16", 2048, 6, 16),
           mp.PeerConfig("ep_return", 2, "bf16", 7168, 8, 128), mp.PeerConfig("ep_return", 8, "fp16", 2880, 1, 4),
           mp.PeerConfig("wait", 2, region=mp.EP_FLAG), mp.PeerConfig("wait", 8, region=mp.EP_RFLAG, bump=True),
           mp.PeerConfig("tp_reduce", 2, "bf16", 2048, 0), mp.PeerConfig("tp_reduce", 2, "bf16", 2048, 8),
           mp.PeerConfig("tp_reduce", 4, "fp16", 2880, 6, weight_dtype="fp16")]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.variant().key())
def test_peer_kernels_compile_with_the_flag_protocol(fresh_cache, tmp_path, cfg):
    kernel = mp.compile(cfg)
    sass = sass_of(kernel, tmp_path)
    if sass is None:
        return
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills)"
    releases = re.findall(r"STG\.E\.STRONG\.SYS", sass)
    acquires = re.findall(r"LDG\.E\.STRONG\.SYS", sass)
    if cfg.op in ("ep_send", "ep_return", "tp_reduce"):
        assert releases and "MEMBAR.ALL.SYS" in sass, "a flag without a system-scope fence before it"
        assert sass.index("MEMBAR.ALL.SYS") < sass.index("STG.E.STRONG.SYS")
    if cfg.op in ("wait", "tp_reduce"):
        assert acquires and "SR_GLOBALTIMER" in sass, "a wait without a deadline"
    if cfg.op != "wait":
        assert "LDG.E.128" in sass or "LDG.E.ENL2.128" in sass or re.search(r"LDG\.E\.\S*128", sass)


@pytest.mark.parametrize("op", ["ep_send", "ep_return"])
def test_row_copies_issue_their_loads_before_their_stores(fresh_cache, tmp_path, op):
    """DeepSeek-V3 widths (896 vectors a row: one chunk, UNROLL vectors a thread): each copy issues
    its UNROLL 16-byte loads back to back, then its stores; ep_send reads the row once for both ranks."""
    cfg = mp.PeerConfig(op, 2, "bf16", 7168, 8, 128)
    sass = sass_of(mp.compile(cfg), tmp_path)
    if sass is None:
        return
    order = "".join(m[0] for m in re.findall(r"\b(LDG|STG)\.E[.\w]*128\b", sass))
    if op == "ep_send":
        assert order == "L" * mp.UNROLL + "S" * mp.UNROLL * cfg.world
    else:  # one copy per owned pair
        assert order == ("L" * mp.UNROLL + "S" * mp.UNROLL) * cfg.topk


def test_peer_config_refuses_bad_sizes():
    with pytest.raises(ValueError, match="world"):
        mp.PeerConfig("wait", 0)
    with pytest.raises(ValueError, match="16 bytes"):
        mp.PeerConfig("ep_send", 2, "bf16", 100, 8, 4)
    with pytest.raises(ValueError, match="no peer kernel"):
        mp.PeerConfig("gather", 2)


def test_arena_regions_are_aligned_and_disjoint():
    offsets, total = moe._layout(moe.ExpertParallel.regions(2, 7168, 128, 8, BF16))
    sizes = moe.ExpertParallel.regions(2, 7168, 128, 8, BF16)
    assert all(o % moe.ALIGN == 0 for o in offsets) and total % moe.ALIGN == 0
    assert all(offsets[i] + sizes[i] <= offsets[i + 1] for i in range(len(sizes) - 1))
    assert offsets[-1] + sizes[-1] <= total


@pytest.mark.parametrize("kw,error", [
    (dict(dtype="bf16"), TypeError), (dict(max_tokens=None), ValueError), (dict(world=33), ValueError),
    (dict(topk=65), ValueError), (dict(hidden=100), ValueError), (dict(timeout_ms=0), ValueError),
    (dict(weight_dtype=torch.float16), TypeError)])
def test_constructor_arguments_are_checked_before_anything_is_allocated(kw, error):
    args = dict(world=2, num_experts=16, hidden=256, max_tokens=8, topk=2, dtype=BF16, weight_dtype=torch.float32,
                timeout_ms=100)
    args.update(kw)
    with pytest.raises(error):
        moe._check_args(*args.values())


def test_without_a_process_group_construction_says_how():
    with pytest.raises(RuntimeError, match="init_process_group"):
        moe.ExpertParallel(8, 256, 16, 2)


# ---------------------------------------------------------------------------------------------
# GPU: emulated ranks

def _routing(tokens, num_experts, topk, gen, drop=0.05, only=None):
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:topk] for _ in range(tokens)]) if tokens else \
        torch.empty(0, topk, dtype=torch.long)
    if only is not None:  # every token to the experts `only` (a range)
        ids = only[0] + torch.stack([torch.randperm(only[1], generator=gen)[:topk] for _ in range(tokens)])
    ids[torch.rand(ids.shape, generator=gen) < drop] = -1
    w = torch.rand(tokens, topk, generator=gen).softmax(-1)
    return ids.to(torch.int32).cuda(), w.cuda()


def _scale(num_experts, dtype):
    return (torch.arange(num_experts, dtype=torch.float32, device="cuda") / num_experts + 0.5).to(dtype)


def _experts_apply(got, first, scale):
    """A row-wise 'expert' on the device (graph-capturable): row * scale[its expert]."""
    rows = got.buffer.shape[0]
    local = torch.searchsorted(got.offsets[1:], torch.arange(rows, device="cuda", dtype=torch.int32), right=True)
    local = local.clamp(max=got.counts.shape[0] - 1)
    return got.buffer * scale[first + local][:, None]


def _single_gpu(x, ids, w, scale):
    """What one GPU's dispatch + the same expert + combine give: each pair's row x[t] * scale[e]."""
    tokens, topk = ids.shape
    valid = (ids >= 0) & (ids < scale.shape[0])
    rows = (x[:, None, :] * scale[ids.clamp(0, scale.shape[0] - 1).long()][..., None]).reshape(tokens * topk, x.shape[1])
    slot = torch.where(valid, torch.arange(tokens * topk, device="cuda", dtype=torch.int32).view(tokens, topk), -1)
    return rosekernels.moe_combine(rows, w, slot.to(torch.int32))


def _ep_step(ranks, xs, ids, ws, scale, sync=True):
    """One dispatch + expert + combine on every emulated rank, each on its stream; outputs per rank."""
    got = []
    for r, ep in enumerate(ranks):
        with torch.cuda.stream(ep.stream):
            got.append(ep.dispatch(xs[r], ids[r], ws[r]))
    outs = []
    for r, ep in enumerate(ranks):
        with torch.cuda.stream(ep.stream):
            outs.append(ep.combine(_experts_apply(got[r], ep.local_experts[0], scale)))
    if sync:
        torch.cuda.synchronize()
    return got, outs


@pytest.mark.gpu
@pytest.mark.parametrize("world,num_experts,hidden,topk,dtype,max_tokens,tokens", [
    (2, 256, 7168, 8, BF16, 128, (128, 37)),      # DeepSeek-V3 widths, decode
    (2, 128, 2048, 8, BF16, 128, (1, 0)),         # Qwen3-30B-A3B widths; an empty rank
    (3, 24, 2880, 6, FP16, 64, (5, 64, 33)),      # three ranks, ragged vectors per row
    (2, 128, 2048, 8, BF16, 8192, (8192, 4097)),  # prefill sizes (the receiver groups 16k rows)
])
def test_expert_parallel_equals_one_gpu(world, num_experts, hidden, topk, dtype, max_tokens, tokens):
    gen = torch.Generator().manual_seed(world * 1000 + hidden)
    ranks = moe.ExpertParallel.emulated(world, num_experts, hidden, max_tokens, topk, dtype)
    scale = _scale(num_experts, dtype)
    for step in range(2):  # the step counter: a second step with new data
        xs = [torch.randn(t, hidden, generator=gen).to("cuda", dtype) for t in tokens]
        routing = [_routing(t, num_experts, topk, gen) for t in tokens]
        ids, ws = [r[0] for r in routing], [r[1] for r in routing]
        got, outs = _ep_step(ranks, xs, ids, ws, scale)
        for r, ep in enumerate(ranks):
            ep.check()
            first, count = ep.local_experts
            mine = sum(int(((i >= first) & (i < first + count)).sum()) for i in ids)
            assert int(got[r].counts.sum()) == mine  # every pair routed here arrived, once
            assert torch.equal(outs[r], _single_gpu(xs[r], ids[r], ws[r], scale)), (step, r)


@pytest.mark.gpu
def test_expert_parallel_skew_and_dropped_pairs():
    """Every token of both ranks to rank 1's experts; then every pair dropped."""
    gen = torch.Generator().manual_seed(7)
    ranks = moe.ExpertParallel.emulated(2, 64, 1024, 128, 4, BF16)
    scale = _scale(64, BF16)
    xs = [torch.randn(100, 1024, generator=gen).to("cuda", BF16) for _ in range(2)]
    routing = [_routing(100, 64, 4, gen, drop=0.0, only=(32, 32)) for _ in range(2)]
    got, outs = _ep_step(ranks, xs, [r[0] for r in routing], [r[1] for r in routing], scale)
    assert int(got[0].counts.sum()) == 0 and int(got[1].counts.sum()) == 800
    for r in range(2):
        assert torch.equal(outs[r], _single_gpu(xs[r], routing[r][0], routing[r][1], scale))
    none = [torch.full((100, 4), -1, dtype=torch.int32, device="cuda") for _ in range(2)]
    got, outs = _ep_step(ranks, xs, none, [routing[0][1], routing[1][1]], scale)
    assert all(int(g.counts.sum()) == 0 for g in got) and all(not o.any() for o in outs)


@pytest.mark.gpu
def test_expert_parallel_invalid_ids_refuse_the_step_on_every_rank():
    gen = torch.Generator().manual_seed(8)
    ranks = moe.ExpertParallel.emulated(2, 16, 512, 32, 2, BF16)
    xs = [torch.randn(20, 512, generator=gen).to("cuda", BF16) for _ in range(2)]
    routing = [_routing(20, 16, 2, gen) for _ in range(2)]
    routing[0][0][3, 1] = 16  # one id past the experts, on rank 0 only
    got, outs = _ep_step(ranks, xs, [r[0] for r in routing], [r[1] for r in routing], _scale(16, BF16))
    for ep, out in zip(ranks, outs):
        with pytest.raises(ValueError, match="outside"):
            ep.check()
        assert not out.any()


@pytest.mark.gpu
def test_expert_parallel_graph_replays():
    """Both ranks' steps captured once, replayed with new inputs: the device-side step counter keeps
    every replay's flags fresh."""
    gen = torch.Generator().manual_seed(9)
    ranks = moe.ExpertParallel.emulated(2, 32, 2048, 64, 4, BF16)
    scale = _scale(32, BF16)
    xs = [torch.zeros(64, 2048, dtype=BF16, device="cuda") for _ in range(2)]
    ids = [torch.full((64, 4), -1, dtype=torch.int32, device="cuda") for _ in range(2)]
    ws = [torch.zeros(64, 4, device="cuda") for _ in range(2)]
    _ep_step(ranks, xs, ids, ws, scale)  # compiles and plans everything outside the capture
    graphs, outs = [], []
    for r, ep in enumerate(ranks):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=ep.stream):
            got = ep.dispatch(xs[r], ids[r], ws[r])
            outs.append(ep.combine(_experts_apply(got, ep.local_experts[0], scale)))
        graphs.append(g)
    for _ in range(3):
        for r in range(2):
            x, (i, w) = torch.randn(64, 2048, generator=gen).to("cuda", BF16), _routing(64, 32, 4, gen)
            xs[r].copy_(x), ids[r].copy_(i), ws[r].copy_(w)
        torch.cuda.synchronize()
        for r, ep in enumerate(ranks):
            with torch.cuda.stream(ep.stream):
                graphs[r].replay()
        torch.cuda.synchronize()
        for r, ep in enumerate(ranks):
            ep.check()
            assert torch.equal(outs[r], _single_gpu(xs[r], ids[r], ws[r], scale))


@pytest.mark.gpu
def test_a_peer_that_never_signals_times_out():
    ranks = moe.ExpertParallel.emulated(2, 16, 512, 8, 2, BF16, timeout_ms=50)
    x = torch.randn(8, 512, device="cuda").to(BF16)
    ids, w = _routing(8, 16, 2, torch.Generator().manual_seed(1))
    with torch.cuda.stream(ranks[0].stream):
        got = ranks[0].dispatch(x, ids, w)  # rank 1 never calls
        ranks[0].combine(got.buffer)
    torch.cuda.synchronize()
    with pytest.raises(TimeoutError, match="rank 1 did not signal"):
        ranks[0].check()
    tp = moe.TensorParallel.emulated(2, 16, 512, 8, 2, BF16, timeout_ms=50)
    with torch.cuda.stream(tp[1].stream):
        tp[1].all_reduce(x)
    torch.cuda.synchronize()
    with pytest.raises(TimeoutError, match="rank 0 did not signal"):
        tp[1].check()


def _tp_reference(expert_outs, w, slots):
    return sum(mc.reference(y, w, s) for y, s in zip(expert_outs, slots))


@pytest.mark.gpu
@pytest.mark.parametrize("world,num_experts,hidden,topk,dtype,tokens", [
    (2, 128, 2048, 8, BF16, (1, 7, 128, 256)),   # decode: one fused launch
    (2, 128, 2048, 8, BF16, (257, 3000)),        # prefill: combine, then the reduce
    (4, 64, 2880, 6, FP16, (33,)),
])
def test_tensor_parallel_combine(world, num_experts, hidden, topk, dtype, tokens):
    gen = torch.Generator().manual_seed(world + hidden)
    ranks = moe.TensorParallel.emulated(world, num_experts, hidden, max(tokens), topk, dtype)
    for t in tokens:
        x = torch.randn(t, hidden, generator=gen).to("cuda", dtype)
        ids, w = _routing(t, num_experts, topk, gen)
        got = [tp.dispatch(x, ids) for tp in ranks]
        ys = [torch.randn(g.buffer.shape, generator=gen).to("cuda", dtype) for g in got]
        torch.cuda.synchronize()
        outs = []
        for tp, g, y in zip(ranks, got, ys):
            with torch.cuda.stream(tp.stream):
                outs.append(tp.combine(y, w, g.slot_map))
        torch.cuda.synchronize()
        ref = _tp_reference(ys, w, [g.slot_map for g in got])
        terms = sum(mc.reference(y, w, g.slot_map, absolute=True) for y, g in zip(ys, got))
        rel = {BF16: 2.0**-8, FP16: 2.0**-10}[dtype]
        bound = rel * ref.abs() + (world + 1) * rel * terms + (topk + world + 2) * 2.0**-23 * terms + 1e-30
        for tp, out in zip(ranks, outs):
            tp.check()
            assert torch.equal(out, outs[0])  # every rank the same bits
            err = (out.double() - ref).abs()
            assert (err <= bound).all(), float((err / bound).max())


@pytest.mark.gpu
def test_tensor_parallel_all_reduce_steps_and_graphs():
    gen = torch.Generator().manual_seed(3)
    ranks = moe.TensorParallel.emulated(2, 8, 4096, 64, 2, BF16)
    xs = [torch.zeros(64, 4096, dtype=BF16, device="cuda") for _ in ranks]
    for _ in range(5):  # back to back: the inbox parity and the step counter
        for x in xs:
            x.copy_(torch.randn(64, 4096, generator=gen))
        torch.cuda.synchronize()
        outs = []
        for tp, x in zip(ranks, xs):
            with torch.cuda.stream(tp.stream):
                outs.append(tp.all_reduce(x))
        torch.cuda.synchronize()
        want = (xs[0].float() + xs[1].float()).to(BF16)
        assert all(torch.equal(o, want) for o in outs)
    graphs, outs = [], []
    for tp, x in zip(ranks, xs):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=tp.stream):
            outs.append(tp.all_reduce(x))
        graphs.append(g)
    for _ in range(3):
        for x in xs:
            x.copy_(torch.randn(64, 4096, generator=gen))
        torch.cuda.synchronize()
        for tp, g in zip(ranks, graphs):
            with torch.cuda.stream(tp.stream):
                g.replay()
        torch.cuda.synchronize()
        want = (xs[0].float() + xs[1].float()).to(BF16)
        assert all(torch.equal(o, want) for o in outs)
    for tp in ranks:
        tp.check()


@pytest.mark.gpu
def test_ranks_running_ahead_of_each_other():
    """Ten steps queued on both ranks without a synchronisation, one rank's stream held back at the
    start, one rank without tokens on some steps: a fast rank may publish a step before a slow one has
    read the last (flags at or past the step are accepted; inboxes alternate by parity)."""
    gen = torch.Generator().manual_seed(11)
    ranks = moe.ExpertParallel.emulated(2, 32, 1024, 64, 4, BF16)
    scale = _scale(32, BF16)
    steps = []
    for i in range(10):
        tokens = (64, 0 if i % 3 == 0 else 17)
        xs = [torch.randn(t, 1024, generator=gen).to("cuda", BF16) for t in tokens]
        routing = [_routing(t, 32, 4, gen) for t in tokens]
        steps.append((xs, [r[0] for r in routing], [r[1] for r in routing]))
    torch.cuda.synchronize()
    with torch.cuda.stream(ranks[0].stream):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds
    outs = [_ep_step(ranks, xs, ids, ws, scale, sync=False)[1] for xs, ids, ws in steps]
    torch.cuda.synchronize()
    for ep in ranks:
        ep.check()
    for (xs, ids, ws), step_outs in zip(steps, outs):
        for r in range(2):
            assert torch.equal(step_outs[r], _single_gpu(xs[r], ids[r], ws[r], scale))
    tps = moe.TensorParallel.emulated(2, 8, 2048, 64, 2, BF16)
    xs = [[torch.randn(64, 2048, generator=gen).to("cuda", BF16) for _ in tps] for _ in range(10)]
    torch.cuda.synchronize()
    with torch.cuda.stream(tps[1].stream):
        torch.cuda._sleep(50_000_000)
    outs = []
    for pair in xs:
        step_outs = []
        for tp, x in zip(tps, pair):
            with torch.cuda.stream(tp.stream):
                step_outs.append(tp.all_reduce(x))
        outs.append(step_outs)
    torch.cuda.synchronize()
    for tp in tps:
        tp.check()
    for pair, step_outs in zip(xs, outs):
        want = (pair[0].float() + pair[1].float()).to(BF16)
        assert all(torch.equal(o, want) for o in step_outs)


@pytest.mark.gpu
def test_bad_input_is_refused_before_any_launch():
    ranks = moe.ExpertParallel.emulated(2, 16, 512, 8, 2, BF16, timeout_ms=50)
    ep = ranks[0]
    x = torch.randn(8, 512, device="cuda").to(BF16)
    ids, w = _routing(8, 16, 2, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="at most 8"):
        ep.dispatch(torch.cat([x, x]), torch.cat([ids, ids]), torch.cat([w, w]))
    with pytest.raises(TypeError, match="dtype"):
        ep.dispatch(x.half(), ids, w)
    with pytest.raises(ValueError, match="shape"):
        ep.dispatch(x, ids[:, :1], w)
    with pytest.raises(RuntimeError, match="dispatch first"):
        ep.combine(x)
    with pytest.raises(ValueError, match="split evenly"):
        moe.ExpertParallel.emulated(3, 16, 512, 8, 2, BF16)
    torch.cuda.synchronize()
    assert all(int(r.peers.arena.count_nonzero()) == 0 for r in ranks)  # nothing was sent anywhere
    assert int(ep.state.count_nonzero()) == 0
    with torch.cuda.stream(ep.stream):  # out of turn (rank 1 never answers: the waits time out)
        got = ep.dispatch(x, ids, w)
        with pytest.raises(RuntimeError, match="dispatch called twice"):
            ep.dispatch(x, ids, w)
        ep.combine(got.buffer)
        with pytest.raises(RuntimeError, match="dispatch first"):
            ep.combine(got.buffer)
    torch.cuda.synchronize()
    with pytest.raises(TimeoutError):
        ep.check()
