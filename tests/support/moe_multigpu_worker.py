"""One rank of the two-GPU MoE checks (tests/kernels/test_moe_multigpu.py launches it with torchrun), in order:
- the mapping: each rank stamps sentinels at both ends of every region of every rank's arena through the
  kernels' address table, and each rank reads them back through its own arena views;
- the layout agreement: ranks built with other experts, or another hidden size on arenas that hold
  either, refuse the construction on every rank;
- expert parallel and tensor parallel over SymmetricMemory against single-GPU references built from every
  rank's inputs (gathered with NCCL), on random, dropped and skewed routings, T from 1 to 8192, bf16 and
  fp16, and CUDA-graph replays;
- a soak: --soak-steps steps of each form, half eager and half CUDA-graph replays, random token counts
  (0 included), random delays on random ranks; every step's output against its single-GPU reference on the
  device, mismatching steps counted and both summed into checksums, compared bitwise at the end (and,
  tensor parallel, across ranks);
- the same soak on a build with the fences and flag stores scoped to one GPU (.gpu): it reports what it
  catches (an ordering fault need not show in a given run), and fails nothing.
Exits non-zero on the first failure; prints "rank R: ok" at the end."""
import argparse
import json
import os
import random

import torch
import torch.distributed as dist

import rosekernels
from rosekernels import moe
from rosekernels.kernels import moe_combine as mc


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _routing(tokens, num_experts, topk, gen, skew_to=None):
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:topk] for _ in range(tokens)]) \
        if tokens else torch.empty(0, topk, dtype=torch.long)
    if skew_to is not None:  # every token to one rank's experts
        first, count = skew_to
        ids = first + torch.stack([torch.randperm(count, generator=gen)[:topk] for _ in range(tokens)])
    ids[torch.rand(ids.shape, generator=gen) < 0.05] = -1
    return ids.to(torch.int32).cuda(), torch.rand(tokens, topk, generator=gen).softmax(-1).cuda()


def _expected(x, ids, w, scale):
    tokens, topk = ids.shape
    rows = (x[:, None, :] * scale[ids.clamp(0).long()][..., None]).reshape(tokens * topk, x.shape[1])
    slot = torch.where(ids >= 0, torch.arange(tokens * topk, device="cuda", dtype=torch.int32).view(tokens, topk), -1)
    return rosekernels.moe_combine(rows, w, slot.to(torch.int32))


def _experts(got, first, scale):
    rows = got.buffer.shape[0]
    local = torch.searchsorted(got.offsets[1:], torch.arange(rows, device="cuda", dtype=torch.int32), right=True)
    return got.buffer * scale[first + local.clamp(max=got.counts.shape[0] - 1)][:, None]


def check_expert_parallel(rank, world, gen):
    for num_experts, hidden, topk, dtype, max_tokens, tokens in (
            (256, 7168, 8, torch.bfloat16, 128, (128, 1)),
            (128, 2048, 8, torch.float16, 8192, (8192, 4097))):
        ep = moe.ExpertParallel(num_experts, hidden, max_tokens, topk, dtype)
        scale = (torch.arange(num_experts, device="cuda", dtype=torch.float32) / num_experts + 0.5).to(dtype)
        mine = tokens[rank % len(tokens)]
        for skew in (None, (num_experts // world, num_experts // world)):
            x = torch.randn(mine, hidden, generator=gen).to("cuda", dtype)
            ids, w = _routing(mine, num_experts, topk, gen, skew)
            got = ep.dispatch(x, ids, w)
            out = ep.combine(_experts(got, ep.local_experts[0], scale))
            ep.check()
            assert torch.equal(out, _expected(x, ids, w, scale)), (rank, hidden, skew)
    # graphs: one capture, replays with new inputs
    ep = moe.ExpertParallel(64, 2048, 64, 4, torch.bfloat16)
    scale = torch.linspace(0.5, 1.5, 64, device="cuda").to(torch.bfloat16)
    x = torch.zeros(64, 2048, dtype=torch.bfloat16, device="cuda")
    ids = torch.full((64, 4), -1, dtype=torch.int32, device="cuda")
    w = torch.zeros(64, 4, device="cuda")
    ep.combine(_experts(ep.dispatch(x, ids, w), ep.local_experts[0], scale))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ep.combine(_experts(ep.dispatch(x, ids, w), ep.local_experts[0], scale))
    for _ in range(3):
        new_ids, new_w = _routing(64, 64, 4, gen)
        x.copy_(torch.randn(64, 2048, generator=gen)), ids.copy_(new_ids), w.copy_(new_w)
        g.replay()
        torch.cuda.synchronize()
        ep.check()
        assert torch.equal(out, _expected(x, ids, w, scale))


def check_tensor_parallel(rank, world, gen):
    tp = moe.TensorParallel(128, 2048, 8192, 8, torch.bfloat16)
    for tokens in (1, 128, 256, 257, 8192):
        gen_shared = torch.Generator().manual_seed(tokens)  # the same x and routing on every rank
        x = torch.randn(tokens, 2048, generator=gen_shared).to("cuda", torch.bfloat16)
        ids, w = _routing(tokens, 128, 8, gen_shared)
        got = tp.dispatch(x, ids)
        y = torch.randn(got.buffer.shape, generator=gen).to("cuda", torch.bfloat16)
        out = tp.combine(y, w, got.slot_map)
        tp.check()
        parts = _gather(mc.reference(y, w, got.slot_map).float())
        ref = sum(p.double() for p in parts)
        assert torch.allclose(out.double(), ref, rtol=2**-6, atol=1e-2), (rank, tokens)
        assert all(torch.equal(o, out) for o in _gather(out)), "ranks disagree"


def _at(address, nbytes):
    """A tensor at a raw address of this process, on this rank's device, as the peer kernels reach it."""
    device = torch.device("cuda", torch.cuda.current_device())
    storage = torch._C._construct_storage_from_data_pointer(address, device, nbytes)
    return torch.empty(0, dtype=torch.int64, device=device).set_(storage)


def _sentinel(writer, owner, region, end):
    return 0x5E47 << 48 | writer << 32 | owner << 16 | region << 1 | end


def check_mapping(rank, world):
    """Both ends of every region of every rank's arena, stamped by every rank through `addr` (what the
    kernels use), hold exactly what was stamped when read through each rank's own arena."""
    for obj in (moe.ExpertParallel(16, 512, 16, 2, torch.bfloat16), moe.TensorParallel(16, 512, 16, 2, torch.bfloat16)):
        addr = obj.addr.tolist()
        for owner in range(world):
            for region, size in enumerate(obj.sizes):
                _at(addr[owner][region] + 8 * rank, 8).fill_(_sentinel(rank, owner, region, 0))
                _at(addr[owner][region] + size - 8 * (rank + 1), 8).fill_(_sentinel(rank, owner, region, 1))
        torch.cuda.synchronize()
        dist.barrier()
        words = obj.peers.arena.view(torch.int64)
        for region, (offset, size) in enumerate(zip(obj.offsets, obj.sizes)):
            view = obj.peers.view(offset, (size // 8,), torch.int64)
            for writer in range(world):
                got = [int(view[writer]), int(view[-1 - writer])]
                want = [_sentinel(writer, rank, region, 0), _sentinel(writer, rank, region, 1)]
                assert got == want, (type(obj).__name__, rank, region, writer, [hex(g) for g in got])
        assert int(words.count_nonzero()) == 2 * world * len(obj.sizes), "a stamp landed elsewhere"
        dist.barrier()  # the objects go (their arenas now hold sentinels, never a step)


def check_layout_agreement(rank, world):
    """Objects whose ranks disagree (rank 0 another expert count, then another hidden size, on arenas
    big enough for both) raise on every rank, naming what differs; nothing reaches a step."""
    nbytes = moe._layout(moe.ExpertParallel.regions(world, 4096, 64, 4, torch.bfloat16))[1]
    for field, experts, hidden in (("num_experts", 32 if rank else 64, 2048), ("hidden", 64, 4096 if rank else 2048)):
        peers = moe.Peers.symmetric(nbytes)
        try:
            moe.ExpertParallel(experts, hidden, 64, 4, peers=peers)
        except ValueError as e:
            assert f"disagree on {field}" in str(e), (rank, e)
        else:
            raise AssertionError(f"rank {rank}: built with another {field} than its peers")
        assert peers._owner is None and int(peers.arena.count_nonzero()) == 0, rank
        del peers
        dist.barrier()


class WeakExpertParallel(moe.ExpertParallel):
    fence = "gpu"


class WeakTensorParallel(moe.TensorParallel):
    fence = "gpu"


class _Tally:
    """Per step on the device, no host sync: whether the output differs from the reference anywhere, and
    position-weighted sums of both (checksums compared at the end)."""

    def __init__(self, max_elems, gen):
        self.weights = torch.randint(1, 256, (max_elems,), generator=gen, device="cuda")
        self.bad, self.got, self.want = (torch.zeros((), dtype=torch.int64, device="cuda") for _ in range(3))

    def add(self, out, want):
        bits, ref = out.view(torch.int16).flatten().long(), want.view(torch.int16).flatten().long()
        self.bad.add_((bits != ref).any().long())
        self.got.add_((bits * self.weights[:bits.numel()]).sum())
        self.want.add_((ref * self.weights[:ref.numel()]).sum())

    def result(self):
        return {"bad_steps": int(self.bad), "checksum": int(self.got), "reference_checksum": int(self.want)}


def _random_routing(tokens, experts, topk, gen):
    ids = torch.rand(tokens, experts, generator=gen, device="cuda").argsort(1)[:, :topk].to(torch.int32)
    ids.masked_fill_(torch.rand(tokens, topk, generator=gen, device="cuda") < 0.05, -1)
    return ids, torch.rand(tokens, topk, generator=gen, device="cuda").softmax(-1)


def _delay(rng):
    """Random delays on random ranks: a tenth of the steps wait up to ~25 us on this rank's stream."""
    if rng.random() < 0.1:
        torch.cuda._sleep(rng.randrange(50_000))


def soak_expert_parallel(cls, steps, rank, seed):
    """`steps` steps (half eager, half graph replays of captured token counts) with random token counts
    per rank; every step's output against one GPU's dispatch + combine of the same expert rows."""
    experts, hidden, max_tokens, topk = 32, 2048, 64, 4
    ep = cls(experts, hidden, max_tokens, topk, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    rng = random.Random(seed * 31 + rank)
    scale = torch.linspace(0.5, 1.5, experts, device="cuda").to(torch.bfloat16)
    tally = _Tally(max_tokens * hidden, gen)
    stream = torch.cuda.Stream()

    def step(x, ids, w):
        out = ep.combine(_experts(ep.dispatch(x, ids, w), ep.local_experts[0], scale))
        tally.add(out, _expected(x, ids, w, scale))

    def inputs(tokens):
        return (torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16),
                *_random_routing(tokens, experts, topk, gen))

    _eager_then_graphs(step, inputs, (0, 1, 7, 33, max_tokens), steps, max_tokens, rng, rng, stream, ep.check)
    return tally.result()


def _eager_then_graphs(step, inputs, buckets, steps, max_tokens, draw, delay, stream, check) -> None:
    """Half of `steps` eager, the rest as replays of graphs captured at the `buckets` token counts (fresh inputs
    copied in), each after a random delay: token counts (10% zero) and buckets drawn from `draw` (shared by the
    ranks where they must agree), delays from `delay` (this rank's); `check` after each half."""
    with torch.cuda.stream(stream):
        for tokens in buckets:  # plans and allocations of the captured sizes, outside the capture
            step(*inputs(tokens))
        for _ in range(steps // 2):
            _delay(delay)
            step(*inputs(0 if draw.random() < 0.1 else draw.randint(1, max_tokens)))
    torch.cuda.synchronize()
    check()
    graphs = {}
    for tokens in buckets:
        static = inputs(tokens)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            step(*static)
        graphs[tokens] = (g, static)
    with torch.cuda.stream(stream):
        for _ in range(steps - steps // 2):
            g, (x, ids, w) = graphs[draw.choice(buckets)]
            fresh = inputs(x.shape[0])
            x.copy_(fresh[0]), ids.copy_(fresh[1]), w.copy_(fresh[2])
            _delay(delay)
            g.replay()
    torch.cuda.synchronize()
    check()


def soak_tensor_parallel(cls, steps, rank, world, seed):
    """The same for tensor parallel: one token count per step on every rank (a shared draw); the
    reference is every rank's partial computed here (the same dispatch, expert and moe_combine), rounded,
    added in rank order in fp32."""
    experts, hidden, max_tokens, topk = 32, 2048, 320, 4  # past 256 tokens: the prefill combine too
    tp = cls(experts, hidden, max_tokens, topk, torch.bfloat16)
    shared = torch.Generator(device="cuda").manual_seed(seed)
    shared_rng, rng = random.Random(seed), random.Random(seed * 31 + rank)
    scale = torch.linspace(0.5, 1.5, experts, device="cuda").to(torch.bfloat16)
    per_rank = experts // world
    tally = _Tally(max_tokens * hidden, torch.Generator(device="cuda").manual_seed(seed))
    stream = torch.cuda.Stream()

    def step(x, ids, w):
        partials, out = [], None
        for r in range(world):
            got = rosekernels.moe_dispatch(x, ids, experts, local_experts=(r * per_rank, per_rank))
            y = _experts(got, r * per_rank, scale)
            partials.append(rosekernels.moe_combine(y, w, got.slot_map))
            if r == rank:
                out = tp.combine(y, w, got.slot_map)
        tally.add(out, sum(p.float() for p in partials).to(torch.bfloat16))

    def inputs(tokens):
        return (torch.randn(tokens, hidden, generator=shared, device="cuda").to(torch.bfloat16),
                *_random_routing(tokens, experts, topk, shared))

    _eager_then_graphs(step, inputs, (0, 1, 40, 256, max_tokens), steps, max_tokens, shared_rng, rng, stream,
                       tp.check)
    return tally.result()


def soak(steps, rank, world, weak):
    """Both forms' soaks: the protocol's build must be exact; the weakened one reports what it saw."""
    ep_cls, tp_cls = (WeakExpertParallel, WeakTensorParallel) if weak else (moe.ExpertParallel, moe.TensorParallel)
    report = {}
    for name, run in (("expert_parallel", lambda: soak_expert_parallel(ep_cls, steps, rank, 1234)),
                      ("tensor_parallel", lambda: soak_tensor_parallel(tp_cls, steps, rank, world, 4321))):
        try:
            report[name] = run()
        except (TimeoutError, RuntimeError, ValueError) as e:  # check() raised
            if not weak:
                raise
            report[name] = {"error": str(e)}
        dist.barrier()
    # tensor parallel: every rank the same bits (a collective every rank reaches, whatever it raised)
    mine = torch.tensor([report["tensor_parallel"].get("checksum", 0)], dtype=torch.int64, device="cuda")
    report["tensor_parallel"]["checksums_of_every_rank"] = [int(c) for c in _gather(mine)]
    print(f"rank {rank}: {'weak (.gpu) build' if weak else 'soak'} {json.dumps(report)}", flush=True)
    if not weak:
        for name, r in report.items():
            assert r["bad_steps"] == 0 and r["checksum"] == r["reference_checksum"], (rank, name, r)
        assert len(set(report["tensor_parallel"]["checksums_of_every_rank"])) == 1, report


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--soak-steps", type=int, default=10_000, help="steps of each form (half of them graph replays)")
    args = p.parse_args()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(100 + rank)
    check_mapping(rank, world)
    check_layout_agreement(rank, world)
    check_expert_parallel(rank, world, gen)
    check_tensor_parallel(rank, world, gen)
    soak(args.soak_steps, rank, world, weak=False)
    soak(args.soak_steps, rank, world, weak=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    main()
