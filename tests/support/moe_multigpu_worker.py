"""One rank of the two-GPU MoE checks (tests/kernels/test_moe_multigpu.py launches it with torchrun):
expert parallel and tensor parallel over SymmetricMemory against single-GPU references built from
every rank's inputs (gathered with NCCL), on random, dropped and skewed routings, T from 1 to 8192,
bf16 and fp16, and CUDA-graph replays. Exits non-zero on the first mismatch."""
import os

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


def main():
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(100 + rank)
    check_expert_parallel(rank, world, gen)
    check_tensor_parallel(rank, world, gen)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    main()
