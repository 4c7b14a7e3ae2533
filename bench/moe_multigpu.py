"""MoE across the GPUs of one node (rosekernels.moe) against NCCL, in one run; writes JSON + markdown.

    torchrun --standalone --nproc-per-node 2 bench/moe_multigpu.py [--out bench/results]
    python bench/moe_multigpu.py --emulate [--out DIR]     # two ranks emulated on one GPU (see below)

Shapes: DeepSeek-V3 (H=7168, 256 experts, top-8) and Qwen3-30B-A3B (H=2048, 128 experts, top-8), bf16,
fp32 routing weights, k distinct random experts per token; decode 128 tokens per rank, prefill 4096.
Measured in the same run:
- the peer-copy bandwidth: one rank's copy_ into the peer's SymmetricMemory buffer (256 MiB), GB/s;
- expert parallel: dispatch and combine each timed by CUDA events around its own CUDA graph, the two
  graphs replayed alternately (the protocol's order), median over the replays (a dispatch's time includes
  any lag of the peer's replay behind this rank's: the ranks are not aligned on the device); against the NCCL
  baseline of the same step: per-destination counts exchanged with all_to_all_single, read on the host,
  tokens and ids sorted by destination and sent with all_to_all_single, the local moe_dispatch of what
  arrived; combine sends each pair's expert row back the same way and reduces with moe_combine (eager:
  the host reads the counts, so it cannot be captured, and its times include that host work). Prefill also reports the bytes that crossed the
  link over the dispatch time against the peer-copy bandwidth;
- tensor parallel, decode: the fused combine + all-reduce (one launch) against moe_combine followed by
  NCCL all_reduce, and by torch's symmetric-memory one-shot all-reduce where this torch has it, each in a
  CUDA graph of 20 calls, replays interleaved.
The expert computation is the identity (the expert output is the dispatched buffer): only the movement is
timed. With --emulate both ranks run on one GPU on two streams: they share its SMs and HBM and no byte
crosses a link, so those numbers check that the protocol runs and what a step costs on one GPU, not a
multi-GPU result; there is no NCCL baseline there.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402
from report import fmt  # noqa: E402
import rosekernels  # noqa: E402
from rosekernels import moe  # noqa: E402

MODELS = {"deepseek-v3": (7168, 256, 8), "qwen3-30b-a3b": (2048, 128, 8)}
TOKENS = {"decode": 128, "prefill": 4096}
REPLAYS = 30
TARGETS_US = {"ep_dispatch": 25.0, "ep_combine": 25.0}


def _routing(tokens: int, experts: int, topk: int, gen: torch.Generator, device) -> tuple:
    ids = torch.rand(tokens, experts, generator=gen).argsort(1)[:, :topk].to(torch.int32)
    return ids.to(device), torch.rand(tokens, topk, generator=gen).softmax(1).to(device)


class _Ranks:
    """The ranks this process drives: one (torchrun) or all of them (--emulate), each with its stream."""

    def __init__(self, emulate: bool):
        self.emulate = emulate
        if not emulate:
            import torch.distributed as dist

            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world = 0, 2

    def build(self, cls, *args) -> list:
        return cls.emulated(self.world, *args) if self.emulate else [cls(*args)]

    def streams(self, objs: list) -> list:
        """Each rank's stream: an emulated rank's own, else a side stream (graphs are not captured on the
        default stream)."""
        return [o.stream or torch.cuda.Stream() for o in objs]


def _graph(fn, stream) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    return g


def _alternate(graph_sets: list[list[torch.cuda.CUDAGraph]], streams: list, replays: int) -> list[float]:
    """Replay graph_sets[i][r] for i in order, rank r on its stream, `replays` times; the median us of
    each graph set as seen on the first rank's stream (events around its replay)."""
    times = [[] for _ in graph_sets]
    for _ in range(replays):
        events = []
        for i, graphs in enumerate(graph_sets):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for r, (g, s) in enumerate(zip(graphs, streams)):
                with torch.cuda.stream(s):
                    if r == 0:
                        start.record()
                    g.replay()
                    if r == 0:
                        end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        for i, (start, end) in enumerate(events):
            times[i].append(start.elapsed_time(end) * 1e3)
    return [statistics.median(t) for t in times]


def expert_parallel(ranks: _Ranks, model: str, mode: str, gen: torch.Generator) -> dict:
    hidden, experts, topk = MODELS[model]
    tokens = TOKENS[mode]
    eps = ranks.build(moe.ExpertParallel, experts, hidden, tokens, topk, torch.bfloat16)
    streams = ranks.streams(eps)
    inputs = []
    for ep in eps:
        x = torch.randn(tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
        inputs.append((x, *_routing(tokens, experts, topk, gen, "cuda")))
    got = [None] * len(eps)
    torch.cuda.synchronize()  # the inputs, made on the default stream, before the ranks' streams read them

    def dispatch(r):
        got[r] = eps[r].dispatch(*inputs[r])

    def combine(r):
        eps[r].combine(got[r].buffer)

    for _ in range(2):  # warm: plans, allocator
        for r, s in enumerate(streams):
            with torch.cuda.stream(s):
                dispatch(r)
        for r, s in enumerate(streams):
            with torch.cuda.stream(s):
                combine(r)
    torch.cuda.synchronize()
    gd = [_graph(lambda r=r: dispatch(r), s) for r, s in enumerate(streams)]
    gc = [_graph(lambda r=r: combine(r), s) for r, s in enumerate(streams)]
    d_us, c_us = _alternate([gd, gc], streams, REPLAYS)
    for ep in eps:
        ep.check()
    x, ids, _ = inputs[0]
    me = eps[0].rank
    owner = torch.where(ids >= 0, ids // (experts // ranks.world), -1)
    crossing = sum(int((owner == r).any(1).sum()) for r in range(ranks.world) if r != me)
    row = {"model": model, "mode": mode, "tokens_per_rank": tokens, "dispatch_us": d_us, "combine_us": c_us,
           "bytes_crossing": crossing * hidden * 2}
    if not ranks.emulate:
        row.update(_nccl_expert_parallel(eps[0], inputs[0], experts, topk))
    return row


def _nccl_expert_parallel(ep, inputs, experts: int, topk: int) -> dict:
    """The NCCL baseline of one EP step, eager (the host reads the counts): median us of dispatch and combine."""
    import torch.distributed as dist

    x, ids, w = inputs
    world, per_rank = ep.world, experts // ep.world
    tokens, hidden = x.shape

    def step():
        t0, t1, t2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        t0.record()
        # dispatch: one copy of a token per destination rank
        dest = torch.where(ids >= 0, ids // per_rank, world)
        pairs = torch.nn.functional.one_hot(dest.long(), world + 1).any(1)
        tok, rank = pairs[:, :world].nonzero(as_tuple=True)  # sorted by token; re-sort by rank
        order = torch.argsort(rank, stable=True)
        tok, rank = tok[order], rank[order]
        send_counts = torch.bincount(rank, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        s, rc = send_counts.tolist(), recv_counts.tolist()
        recv_x = x.new_empty(sum(rc), hidden)
        dist.all_to_all_single(recv_x, x[tok], rc, s)
        recv_ids = ids.new_empty(sum(rc), topk)
        dist.all_to_all_single(recv_ids, ids[tok], rc, s)
        got = rosekernels.moe_dispatch(recv_x, recv_ids, experts, local_experts=ep.local_experts)
        t1.record()
        # combine: each pair's expert row back to its source, then the weighted sum there
        rows = got.buffer[got.slot_map.clamp(min=0)] * (got.slot_map >= 0)[..., None]
        back = rows.new_empty(len(tok), topk, hidden)
        dist.all_to_all_single(back, rows, s, rc)
        out = torch.zeros(tokens, topk, hidden, dtype=x.dtype, device="cuda")
        mine = (dest[tok] == rank[:, None])
        out.index_put_((tok,), torch.where(mine[..., None], back, 0), accumulate=True)
        slot = torch.where(ids >= 0, torch.arange(tokens * topk, device="cuda").view(tokens, topk), -1)
        rosekernels.moe_combine(out.view(tokens * topk, hidden), w, slot.to(torch.int32))
        t2.record()
        t2.synchronize()
        return t0.elapsed_time(t1) * 1e3, t1.elapsed_time(t2) * 1e3

    for _ in range(3):
        step()
    times = [step() for _ in range(REPLAYS)]
    return {"nccl_dispatch_us": statistics.median(t[0] for t in times),
            "nccl_combine_us": statistics.median(t[1] for t in times)}


def tensor_parallel(ranks: _Ranks, model: str, gen: torch.Generator) -> dict:
    hidden, experts, topk = MODELS[model]
    tokens = TOKENS["decode"]
    tps = ranks.build(moe.TensorParallel, experts, hidden, tokens, topk, torch.bfloat16)
    streams = ranks.streams(tps)
    shared = torch.Generator().manual_seed(5)  # the same x and routing on every rank
    x = torch.randn(tokens, hidden, generator=shared).to("cuda", torch.bfloat16)
    ids, w = _routing(tokens, experts, topk, shared, "cuda")
    got = [tp.dispatch(x, ids) for tp in tps]
    ys = [g.buffer.clone() for g in got]
    torch.cuda.synchronize()
    calls = 20
    arms = {"fused": lambda r: [tps[r].combine(ys[r], w, got[r].slot_map) for _ in range(calls)]}
    if not ranks.emulate:
        import torch.distributed as dist

        def nccl(r):
            for _ in range(calls):
                dist.all_reduce(rosekernels.moe_combine(ys[r], w, got[r].slot_map))
        arms["moe_combine + nccl all_reduce"] = nccl
        symm = getattr(torch.ops.symm_mem, "one_shot_all_reduce", None)
        if symm is not None:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
            symm_mem.rendezvous(buf, dist.group.WORLD)

            def one_shot(r):
                for _ in range(calls):
                    buf.copy_(rosekernels.moe_combine(ys[r], w, got[r].slot_map))
                    symm(buf, "sum", dist.group.WORLD.group_name)
            arms["moe_combine + symm_mem one_shot_all_reduce"] = one_shot
    for arm in arms.values():  # warm outside the capture
        for r, s in enumerate(streams):
            with torch.cuda.stream(s):
                arm(r)
    torch.cuda.synchronize()
    graphs = {name: [_graph(lambda r=r, a=arm: a(r), s) for r, s in enumerate(streams)] for name, arm in arms.items()}
    medians = _alternate(list(graphs.values()), streams, REPLAYS)
    for tp in tps:
        tp.check()
    return {"model": model, "tokens": tokens, **{f"{n}_us": m / calls for n, m in zip(graphs, medians)}}


def peer_copy_gbs(ranks: _Ranks) -> float | None:
    """One rank copying 256 MiB into the peer's SymmetricMemory buffer: GB/s (one direction)."""
    if ranks.emulate:
        return None
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    n = 256 << 20
    buf = symm_mem.empty(n, dtype=torch.uint8, device="cuda")
    handle = symm_mem.rendezvous(buf, dist.group.WORLD)
    peer = handle.get_buffer((ranks.rank + 1) % ranks.world, (n,), torch.uint8)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(10):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        peer.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    dist.barrier()
    return n / statistics.median(times[2:]) / 1e3


def markdown(data: dict) -> str:
    env, bw = data["environment"], data["peer_copy_gbs"]
    lines = [f"# MoE across GPUs ({env['gpu']} x {data['world']}{', EMULATED on one GPU' if data['emulated'] else ''})",
             "", "Peer copy bandwidth: " + (f"{bw:.0f} GB/s (one direction)" if bw else "not measured (emulated)"),
             "", "## Expert parallel (per call, us; CUDA graphs)", "",
             "| model | mode | tokens/rank | dispatch | combine | NCCL dispatch | NCCL combine | dispatch x NCCL "
             "| combine x NCCL | link GB/s (% of peer copy) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["expert_parallel"]:
        link = r["bytes_crossing"] / r["dispatch_us"] / 1e3
        pct = f" ({100 * link / bw:.0f}%)" if bw else ""
        lines.append(f"| {r['model']} | {r['mode']} | {r['tokens_per_rank']} | {fmt(r['dispatch_us'])} | "
                     f"{fmt(r['combine_us'])} | {fmt(r.get('nccl_dispatch_us'))} | {fmt(r.get('nccl_combine_us'))} | "
                     f"{fmt(report.ratio(r.get('nccl_dispatch_us'), r['dispatch_us']), 2)} | "
                     f"{fmt(report.ratio(r.get('nccl_combine_us'), r['combine_us']), 2)} | {link:.0f}{pct} |")
    lines += ["", f"Targets (2 x H200, decode, DeepSeek-V3): dispatch <= {TARGETS_US['ep_dispatch']} us, combine <= "
              f"{TARGETS_US['ep_combine']} us, >= 3x NCCL; prefill >= 70% of the peer copy.", "",
              "## Tensor parallel, decode: combine + all-reduce (per call, us; CUDA graphs)", ""]
    for r in data["tensor_parallel"]:
        lines.append(f"- {r['model']}, {r['tokens']} tokens: " + ", ".join(
            f"{k[:-3]} {v:.1f}" for k, v in r.items() if k.endswith("_us")))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    report.add_out(p)
    p.add_argument("--emulate", action="store_true", help="two ranks on one GPU (checks the protocol; not a "
                   "multi-GPU measurement)")
    args = p.parse_args()
    report.require_gpu()
    ranks = _Ranks(args.emulate)
    gen = torch.Generator().manual_seed(1 + ranks.rank)
    data = {"environment": report.environment(), "world": ranks.world, "emulated": args.emulate,
            "peer_copy_gbs": peer_copy_gbs(ranks),
            "expert_parallel": [expert_parallel(ranks, m, mode, gen) for m in MODELS for mode in TOKENS],
            "tensor_parallel": [tensor_parallel(ranks, m, gen) for m in MODELS]}
    if ranks.rank == 0:
        report.write(args.out, "moe_multigpu_emulated" if args.emulate else "moe_multigpu", data, markdown(data))
    if not args.emulate:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
