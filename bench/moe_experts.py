"""The routed-experts block (issue 43): rosekernels.moe_experts against its peers; moe_experts.json + .md + .png.

    python bench/moe_experts.py [--out bench/results] [--geometries qwen3-30b-a3b,...] [--tokens 1,16,...] [--quick]

Geometries (bf16, random weights): Qwen3-30B-A3B (E128 k8 H2048 I768), one Qwen3-235B-A22B layer (E128 k8
H4096 I1536), Mixtral-8x7B (E8 k2 H4096 I14336), one EP8 rank of DeepSeek-V3 (its 32 local experts of 256,
k8, H7168, I2048: a token's choices of other ranks' experts are not routed here). Tokens: decode 1, 16,
64, 128; prefill 4096, 16384. Routing: each token's top-k of uniform random logits (distinct experts),
weights softmax-normalised, fresh per input set.

Arms, the same inputs, each checked against a float64 reference of the block before it is timed (an arm
that fails the check or cannot run is reported with the reason, not timed):
- rosekernels: rosekernels.moe_experts (dispatch, gate-up grouped GEMM with SwiGLU, down grouped GEMM,
  combine);
- rk+grouped_mm: today's rosekernels.hf path (moe_dispatch, torch._grouped_mm x2 with SiLU-and-mul in
  torch, moe_combine);
- stock: transformers' grouped_mm experts forward (its default for these models; sort, histc,
  torch._grouped_mm x2, index_add);
- quack: sync-free torch routing (sort, scatter_add; sorted_routing) then quack's varlen GEMM with gathered rows (cu_seqlens_m +
  A_idx) for gate-up, SiLU-and-mul in torch, quack's varlen GEMM for down, moe_combine; where quack's
  API runs on SM90;
- cublas loop: the floor: each expert with rows as two dense cuBLAS GEMMs (F.linear) over its rows,
  sizes fixed when captured (the routing known on the host: no routing work at all).

Timing: every arm's calls captured in a CUDA graph, the graphs replayed interleaved (timing.
interleaved_graph_time_us); input sets (tokens, routing) rotate, and so do weight sets until a cycle's
distinct weight bytes pass three L2 caches, so no call finds its experts' weights in L2. Ceilings in
the same run: the device copy bandwidth (decode: the active experts' weight bytes streamed at it) and,
for prefill, the dense rosekernels GEMM pair (gated gate-up, then down) on the same rows and FLOPs. Prefill
also times the rosekernels arm's four launches apart (LAUNCHES) and each dense GEMM alone: which launch holds
the block back; and the gate-up GEMM gathering its rows by index (GATHERED) against the dispatch copy.

Targets (issue 43): decode streams the active experts' weights at >= 70% of copy (T >= 16), >= 50% at
T = 1, >= 1.5x stock, >= 1.1x quack; prefill >= 85% of the dense GEMM pair's TFLOP/s and >= 1.05x quack;
never slower than stock. The end-to-end target (Qwen3-MoE decode B = 16 in graphs, >= 1.3x today's arm)
is bench/e2e.py's.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402
import timing  # noqa: E402
from report import fmt  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Geometry:
    experts: int  # routed over (all ranks')
    topk: int
    hidden: int
    inter: int  # each expert's intermediate size
    local: int = 0  # expert-parallel: this rank's experts, 0 .. local - 1 (0: all)

    @property
    def local_experts(self) -> int:
        return self.local or self.experts

    @property
    def expert_bytes(self) -> int:
        """bf16 bytes of one expert's gate, up and down weights."""
        return 3 * self.hidden * self.inter * 2


GEOMETRIES = {
    "qwen3-30b-a3b": Geometry(128, 8, 2048, 768),
    "qwen3-235b-a22b": Geometry(128, 8, 4096, 1536),
    "mixtral-8x7b": Geometry(8, 2, 4096, 14336),
    "deepseek-v3-ep8": Geometry(256, 8, 7168, 2048, local=32),
}
DECODE_TOKENS = (1, 16, 64, 128)
PREFILL_TOKENS = (4096, 16384)
ARMS = ("rosekernels", "rk+grouped_mm", "stock", "quack", "cublas loop")
LAUNCHES = ("dispatch", "gate-up", "down", "combine")  # rosekernels.moe_experts', in order
# The alternative to the dispatch copy (rosekernels/ops/moe_experts.py's docstring): the gate-up GEMM gathering
# the token rows by index (grouped_gemm's a_index), timed beside the launches.
GATHERED = "gate-up, gathered"
TARGETS = {"decode_pct_of_copy": 70.0, "decode_pct_of_copy_t1": 50.0, "decode_vs_stock": 1.5, "decode_vs_quack": 1.1,
           "prefill_pct_of_dense": 85.0, "prefill_vs_quack": 1.05, "vs_stock_min": 1.0}
WEIGHT_BYTES_MAX = 48 << 30  # weight sets held at once, at most
CHECK_BOUND = 2e-2  # per-token relative L2 error vs the float64 block (a few bf16 roundings)


# ---------------------------------------------------------------------------------------------
# Planning (CPU: tests/test_bench_moe_experts.py).


def routing(tokens: int, g: Geometry, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k] int64 over all ranks' experts, distinct per token; weights [T, k] fp32, rows summing to 1)."""
    ids = torch.rand(tokens, g.experts, generator=gen).topk(g.topk, dim=1).indices
    return ids, torch.rand(tokens, g.topk, generator=gen).softmax(1)


def local_ids(ids: torch.Tensor, g: Geometry, sentinel: int) -> torch.Tensor:
    """This rank's view: ids of its experts kept, the others `sentinel` (moe_experts: -1, not routed;
    transformers' grouped_mm: the expert count, its expert-parallel sentinel)."""
    return torch.where(ids < g.local_experts, ids, torch.full_like(ids, sentinel))


def active_experts(ids: torch.Tensor, g: Geometry) -> int:
    """This rank's experts that get at least one token."""
    kept = ids[(ids >= 0) & (ids < g.local_experts)]
    return int(torch.unique(kept).numel())


def routed_rows(ids: torch.Tensor, g: Geometry) -> int:
    return int(((ids >= 0) & (ids < g.local_experts)).sum())


def routed_tokens(ids: torch.Tensor, g: Geometry) -> int:
    """Tokens with at least one of this rank's experts: the rows the dispatch reads."""
    return int(((ids >= 0) & (ids < g.local_experts)).any(dim=1).sum())


def flops(rows: int, g: Geometry) -> int:
    """Multiply-adds x 2 of the gate-up (2I x H) and down (H x I) GEMMs over `rows` routed rows."""
    return 2 * rows * 3 * g.hidden * g.inter


def launch_bytes(tokens: int, rows: float, active: float, g: Geometry, tokens_routed: float | None = None
                 ) -> dict[str, float]:
    """The DRAM bytes each of the four launches must move at least (bf16): the dispatch reads the tokens routed
    to this rank's experts (`tokens_routed`; None: every token) and writes their routed rows; gate-up reads the
    active experts' gate and up weights and those rows and writes the intermediate rows; down reads the down
    weights and those and writes the rows; the combine reads them and writes every token."""
    h, i = g.hidden * 2, g.inter * 2
    t, r = tokens * h, rows * h
    read = t if tokens_routed is None else tokens_routed * h
    return {"dispatch": read + r, "gate-up": active * 2 * g.inter * h + r + rows * i,
            "down": active * g.hidden * i + rows * i + r, "combine": r + t}


def weight_sets(g: Geometry, active_bytes: float, l2_bytes: int) -> int:
    """Weight sets to rotate: enough that a cycle's distinct active weight bytes pass three L2 caches,
    at most what WEIGHT_BYTES_MAX holds (one set: every local expert)."""
    want = max(1, math.ceil(3 * l2_bytes / max(active_bytes, 1)))
    return max(1, min(want, WEIGHT_BYTES_MAX // (g.local_experts * g.expert_bytes)))


def summarize(row: dict, copy_gbps: float) -> dict:
    """The row's derived numbers: ours' weight GB/s and share of copy (decode), TFLOP/s and share of the
    dense pair's (prefill), and each peer's time over ours (> 1: ours faster)."""
    t = row["times_us"]
    ours = t.get("rosekernels")
    out: dict[str, Any] = {"vs": {arm: t[arm] / ours for arm in t if arm != "rosekernels" and ours}}
    if ours:
        out["weight_gbps"] = row["weight_bytes"] / ours / 1e3
        out["pct_of_copy"] = 100 * out["weight_gbps"] / copy_gbps
        out["tflops"] = row["flops"] / ours / 1e6
        dense = row.get("dense_us")
        if dense:
            out["pct_of_dense"] = 100 * dense / ours
            if row.get("launch_bytes"):
                # The block cannot beat its bytes at the copy rate, whatever overlaps: the most of the dense
                # pair's rate it can reach.
                out["bytes_floor_us"] = sum(row["launch_bytes"].values()) / copy_gbps / 1e3
                out["pct_of_dense_at_most"] = 100 * dense / max(dense, out["bytes_floor_us"])
    return out


def verdicts(rows: list[dict]) -> list[dict]:
    """Each measured target of TARGETS per row: {geometry, tokens, target, value, bar, met}."""
    found = []

    def add(r, target, value, bar):
        if value is not None and math.isfinite(value):
            found.append({"geometry": r["geometry"], "tokens": r["tokens"], "target": target, "value": value,
                          "bar": bar, "met": value >= bar})

    for r in rows:
        s, vs = r["summary"], r["summary"].get("vs", {})
        if r["mode"] == "decode":
            key = "decode_pct_of_copy_t1" if r["tokens"] == 1 else "decode_pct_of_copy"
            add(r, key, s.get("pct_of_copy"), TARGETS[key])
            add(r, "decode_vs_stock", vs.get("stock"), TARGETS["decode_vs_stock"])
            add(r, "decode_vs_quack", vs.get("quack"), TARGETS["decode_vs_quack"])
        else:
            add(r, "prefill_pct_of_dense", s.get("pct_of_dense"), TARGETS["prefill_pct_of_dense"])
            add(r, "prefill_vs_quack", vs.get("quack"), TARGETS["prefill_vs_quack"])
        add(r, "vs_stock_min", vs.get("stock"), TARGETS["vs_stock_min"])
    return found


def markdown(data: dict) -> str:
    """The report: one table per mode (times per arm, ours' share of its ceiling, speedups), then the
    targets and every arm that did not run."""
    env, rows = data["env"], data["rows"]
    lines = [f"# MoE experts block (issue 43) on {env.get('gpu', '?')}", "",
             f"bf16, CUDA graphs replayed interleaved, weights and inputs rotated past L2. Device copy: "
             f"{fmt(data['copy_gbps'], 0)} GB/s. Times in us per call; `x` columns: the arm's time over ours.", ""]
    for mode in ("decode", "prefill"):
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        ceiling = "% of copy (active weights)" if mode == "decode" else "% of dense pair"
        lines += [f"## {mode}", "", "| geometry | T | experts hit | " + " | ".join(ARMS) + f" | {ceiling} | TFLOP/s | "
                  + " | ".join(f"x {a}" for a in ARMS[1:]) + " |", "|" + "---|" * (4 + 2 * len(ARMS))]
        for r in mine:
            s = r["summary"]
            share = s.get("pct_of_copy") if mode == "decode" else s.get("pct_of_dense")
            lines.append(f"| {r['geometry']} | {r['tokens']} | {r['active_experts']} | "
                         + " | ".join(fmt(r["times_us"].get(a), 2) for a in ARMS) + f" | {fmt(share)} | "
                         + f"{fmt(s.get('tflops'))} | " + " | ".join(fmt(s.get("vs", {}).get(a), 2) for a in ARMS[1:])
                         + " |")
        lines.append("")
    parts = [r for r in rows if r.get("launches_us")]
    if parts:
        lines += ["## prefill, launch by launch", "",
                  "The rosekernels arm's four launches timed apart (interleaved, each on inputs made ahead); each "
                  "grouped GEMM's share of the dense GEMM on the same rows (timed apart too); the gate-up GEMM "
                  "gathering the token rows by index (a_index) instead of reading the dispatch's copy, its time over "
                  "the dispatch and the gate-up GEMM together (a lower bound on the gather's cost: it still needs the "
                  "dispatch's offsets and an index per row); the bytes the four launches must move at "
                  "the copy rate, and so the most of the dense pair's rate the block can reach (launch_bytes).", "",
                  "| geometry | T | " + " | ".join(f"{k} us" for k in LAUNCHES) + " | sum | whole block | "
                  "gate-up % of dense | down % of dense | gathered gate-up us | its time over dispatch + gate-up | "
                  "block's bytes at copy us | % of dense pair at most |",
                  "|" + "---|" * (10 + len(LAUNCHES))]
        for r in parts:
            t, dense = r["launches_us"], r.get("dense_parts_us", {})
            pct = {k: None if t.get(k) is None or dense.get(k) is None else 100 * dense[k] / t[k]
                   for k in ("gate-up", "down")}
            total = sum(t[k] for k in LAUNCHES) if all(k in t for k in LAUNCHES) else None
            copied = t["dispatch"] + t["gate-up"] if "dispatch" in t and "gate-up" in t else None
            gathered = None if copied is None or t.get(GATHERED) is None else t[GATHERED] / copied
            lines.append(f"| {r['geometry']} | {r['tokens']} | " + " | ".join(fmt(t.get(k)) for k in LAUNCHES)
                         + f" | {fmt(total)} | {fmt(r['times_us'].get('rosekernels'))} | {fmt(pct['gate-up'])} | "
                         f"{fmt(pct['down'])} | {fmt(t.get(GATHERED))} | {fmt(gathered, 3)} | "
                         f"{fmt(r['summary'].get('bytes_floor_us'))} | {fmt(r['summary'].get('pct_of_dense_at_most'))} |")
        lines.append("")
    found = data["verdicts"]
    met = sum(v["met"] for v in found)
    lines += ["## targets", "", f"{met} of {len(found)} measured targets met.", "",
              "| geometry | T | target | value | bar | |", "|---|---|---|---|---|---|"]
    lines += [f"| {v['geometry']} | {v['tokens']} | {v['target']} | {v['value']:.2f} | {v['bar']:.2f} | "
              f"{'met' if v['met'] else 'MISS'} |" for v in found]
    skipped = [f"- {r['geometry']} T={r['tokens']} {arm}: {why}" for r in rows for arm, why in r["errors"].items()]
    if skipped:
        lines += ["", "## not measured", "", *skipped]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The arms (GPU). Each builder returns step(i) running input set i % len(sets) on weight set
# i % len(weights).


def _silu_mul(y: torch.Tensor) -> torch.Tensor:
    inter = y.shape[-1] // 2
    return torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]


def rosekernels_arm(sets, weights) -> Callable[[int], Any]:
    import rosekernels

    def step(i):
        s, (wgu, wd) = sets[i % len(sets)], weights[i % len(weights)]
        return rosekernels.moe_experts(s["x"], wgu, wd, s["ids_rk"], s["w"], out=s["out"])
    return step


def today_arm(sets, weights) -> Callable[[int], Any]:
    """rosekernels.hf's experts path before issue 43."""
    import rosekernels

    def step(i):
        s, (wgu, wd) = sets[i % len(sets)], weights[i % len(weights)]
        d = rosekernels.moe_dispatch(s["x"], s["ids_rk"], wgu.shape[0], block_size=1)
        ends = d.offsets[1:]
        h = _silu_mul(torch._grouped_mm(d.buffer, wgu.transpose(-2, -1), offs=ends))
        return rosekernels.moe_combine(torch._grouped_mm(h, wd.transpose(-2, -1), offs=ends), s["w"], d.slot_map,
                                       out=s["out"])
    return step


def stock_arm(sets, weights, g: Geometry) -> Callable[[int], Any]:
    """transformers' grouped_mm experts forward on an experts module holding each weight set."""
    from transformers import Qwen3MoeConfig
    from transformers.integrations.moe import grouped_mm_experts_forward
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(num_experts=g.local_experts, hidden_size=g.hidden, moe_intermediate_size=g.inter,
                            num_experts_per_tok=g.topk, hidden_act="silu")
    modules = []
    for wgu, wd in weights:
        with torch.device("meta"):
            m = Qwen3MoeExperts(config)
        m.gate_up_proj, m.down_proj = torch.nn.Parameter(wgu, False), torch.nn.Parameter(wd, False)
        modules.append(m)

    def step(i):
        s = sets[i % len(sets)]
        return grouped_mm_experts_forward(modules[i % len(modules)], s["x"], s["ids_stock"], s["w"])
    return step


def sorted_routing(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens [E + 1] int32, token of each expert-sorted pair int32, slot of each (token, choice) pair in
    that order int32, -1 where unrouted) from ids [T, k], with no host synchronization: the counts come from
    scatter_add_, not torch.bincount, which reads the largest id back to the host (a CUDA graph refuses it)."""
    flat = ids.reshape(-1).long()
    e = torch.where(flat >= 0, flat, experts)  # unrouted pairs sort last, outside every group
    order = torch.argsort(e, stable=True)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, e, torch.ones_like(e))
    cu = torch.cat([counts.new_zeros(1), counts[:experts].cumsum(0)]).to(torch.int32)
    slot = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=ids.device))
    slot = torch.where(flat >= 0, slot, -1).view(ids.shape).to(torch.int32)
    return cu, (order // ids.shape[1]).to(torch.int32), slot


def quack_arm(sets, weights) -> Callable[[int], Any]:
    """quack's varlen GEMM over rows gathered by index (sorted_routing), then moe_combine."""
    from quack.gemm_interface import gemm  # ImportError: not in reach

    import rosekernels

    def step(i):
        s, (wgu, wd) = sets[i % len(sets)], weights[i % len(weights)]
        cu, a_idx, slot = sorted_routing(s["ids_rk"], wgu.shape[0])
        h = _silu_mul(gemm(s["x"], wgu.transpose(-2, -1), cu_seqlens_m=cu, A_idx=a_idx))
        return rosekernels.moe_combine(gemm(h, wd.transpose(-2, -1), cu_seqlens_m=cu), s["w"], slot, out=s["out"])
    return step


def cublas_arm(sets, weights) -> Callable[[int], Any]:
    """Each expert's rows through two dense cuBLAS GEMMs, sizes fixed per input set at capture."""
    F = torch.nn.functional
    plans = []
    for s in sets:
        ids = s["ids_rk"].reshape(-1).long().cpu()
        per = [(e, (ids == e).nonzero().flatten()) for e in ids[ids >= 0].unique().tolist()]
        plans.append([(e, (pairs // s["ids_rk"].shape[1]).cuda(), pairs.cuda()) for e, pairs in per])

    def step(i):
        s, (wgu, wd) = sets[i % len(sets)], weights[i % len(weights)]
        out = torch.zeros(s["x"].shape, dtype=torch.float32, device=s["x"].device)
        w = s["w"].reshape(-1)
        for e, tokens, pairs in plans[i % len(sets)]:
            y = F.linear(_silu_mul(F.linear(s["x"][tokens], wgu[e])), wd[e])
            out.index_add_(0, tokens, y.float() * w[pairs, None])
        return out.to(s["x"].dtype)
    return step


def reference(x, wgu, wd, ids, weights) -> torch.Tensor:
    """float64 block output with the intermediates rounded to x's dtype (as every arm stores them)."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        if e < 0 or e >= wgu.shape[0]:
            continue
        tok, choice = (ids == e).nonzero(as_tuple=True)
        h = _silu_mul(x[tok].double() @ wgu[e].double().t()).to(x.dtype).double()
        y = (h @ wd[e].double().t()).to(x.dtype).double()
        out.index_add_(0, tok, y * weights[tok, choice, None].double())
    return out


def check(got: torch.Tensor, ref: torch.Tensor) -> None:
    err = (got.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-6)
    if not torch.isfinite(got).all() or err.max() > CHECK_BOUND:
        raise AssertionError(f"worst token's relative error {err.max().item():.3g} (bound {CHECK_BOUND})")


# ---------------------------------------------------------------------------------------------
# One shape.


def make_sets(tokens: int, g: Geometry, count: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    sets = []
    for _ in range(count):
        ids, w = routing(tokens, g, gen)
        sets.append({"x": torch.randn(tokens, g.hidden, generator=gen).to(torch.bfloat16).cuda(),
                     "ids_rk": local_ids(ids, g, -1).to(torch.int32).cuda(),
                     "ids_stock": local_ids(ids, g, g.local_experts).cuda(), "w": w.cuda(),
                     "out": torch.empty(tokens, g.hidden, dtype=torch.bfloat16, device="cuda")})
    return sets


def make_weights(g: Geometry, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e, h, i = g.local_experts, g.hidden, g.inter
    return [(torch.randn(e, 2 * i, h, generator=gen, device="cuda").div_(h ** 0.5).to(torch.bfloat16),
             torch.randn(e, h, i, generator=gen, device="cuda").div_(i ** 0.5).to(torch.bfloat16))
            for _ in range(count)]


def dense_us(rows: int, g: Geometry, calls: int) -> dict:
    """The ceiling of prefill: rosekernels' dense gated GEMM (rows x 2I x H) then its down GEMM (rows x H x
    I), one weight per GEMM, inputs rotated past L2; {"pair", "gate-up", "down"}: the two in one graph, and
    each alone, replayed interleaved."""
    import rosekernels

    n = timing.input_sets(rows * (g.hidden + g.inter) * 2, most=8)
    xs = [torch.randn(rows, g.hidden, device="cuda").to(torch.bfloat16) for _ in range(n)]
    wgu = torch.randn(2 * g.inter, g.hidden, device="cuda").div_(g.hidden ** 0.5).to(torch.bfloat16)
    wd = torch.randn(g.hidden, g.inter, device="cuda").div_(g.inter ** 0.5).to(torch.bfloat16)
    hs = [rosekernels.gemm(x, wgu, activation="silu", gated=True) for x in xs]
    steps = {"pair": lambda i: rosekernels.gemm(rosekernels.gemm(xs[i % n], wgu, activation="silu", gated=True), wd),
             "gate-up": lambda i: rosekernels.gemm(xs[i % n], wgu, activation="silu", gated=True),
             "down": lambda i: rosekernels.gemm(hs[i % n], wd)}
    return timing.interleaved_graph_time_us(steps, calls=calls, rounds=7)


def launches_arm(sets, weights) -> dict[str, Callable[[int], Any]]:
    """The rosekernels arm's four launches (rosekernels.ops.moe_experts), each a step of its own on inputs the
    launch before it made ahead of the timing: where a prefill block's time goes."""
    import rosekernels

    wgu, wd = weights[0]
    for s in sets:
        s["d"] = rosekernels.moe_dispatch(s["x"], s["ids_rk"], wgu.shape[0], block_size=1)
        s["h"] = rosekernels.grouped_gemm(s["d"].buffer, wgu, s["d"].offsets, activation="silu", gated=True)
        s["y"] = rosekernels.grouped_gemm(s["h"], wd, s["d"].offsets)
        # a dispatched row's token (block_size 1: no padding rows; an unrouted slot (-1) has no row)
        slots = s["d"].slot_map.long().flatten()
        token = torch.arange(s["d"].slot_map.shape[0], device=slots.device).repeat_interleave(s["d"].slot_map.shape[1])
        kept = slots >= 0
        s["a_index"] = torch.zeros(s["d"].buffer.shape[0], dtype=torch.int32, device=slots.device)
        s["a_index"][slots[kept]] = token[kept].int()
        s["h_gathered"] = rosekernels.grouped_gemm(s["x"], wgu, s["d"].offsets, activation="silu", gated=True,
                                                   a_index=s["a_index"])
        routed = int(s["d"].offsets[-1])  # rows past the groups (an EP rank's other experts') are never written
        if not torch.equal(s["h_gathered"][:routed], s["h"][:routed]):  # the same rows and MMAs: the same bits
            raise AssertionError("the gathered gate-up GEMM differs from the dispatched one")

    def pick(i):
        return sets[i % len(sets)], weights[i % len(weights)]

    def dispatch(i):
        s, (wgu, _) = pick(i)
        return rosekernels.moe_dispatch(s["x"], s["ids_rk"], wgu.shape[0], block_size=1, buffer=s["d"].buffer)

    def gate_up(i):
        s, (wgu, _) = pick(i)
        return rosekernels.grouped_gemm(s["d"].buffer, wgu, s["d"].offsets, activation="silu", gated=True,
                                        out=s["h"])

    def down(i):
        s, (_, wd) = pick(i)
        return rosekernels.grouped_gemm(s["h"], wd, s["d"].offsets, out=s["y"])

    def combine(i):
        s, _ = pick(i)
        return rosekernels.moe_combine(s["y"], s["w"], s["d"].slot_map, out=s["out"])

    def gathered(i):
        s, (wgu, _) = pick(i)
        return rosekernels.grouped_gemm(s["x"], wgu, s["d"].offsets, activation="silu", gated=True,
                                        a_index=s["a_index"], out=s["h_gathered"])
    return {"dispatch": dispatch, "gate-up": gate_up, "down": down, "combine": combine, GATHERED: gathered}


def bench_shape(name: str, g: Geometry, tokens: int, l2_bytes: int, log: list[str], quick: bool) -> dict:
    mode = "decode" if tokens <= 128 else "prefill"
    sets = make_sets(tokens, g, 4 if quick else 8, seed=tokens)
    active = sum(active_experts(s["ids_rk"].cpu(), g) for s in sets) / len(sets)
    weights = make_weights(g, weight_sets(g, active * g.expert_bytes, l2_bytes), seed=1)
    rows = sum(routed_rows(s["ids_rk"].cpu(), g) for s in sets) / len(sets)
    row = {"geometry": name, "tokens": tokens, "mode": mode, "active_experts": round(active, 1),
           "rows": rows, "weight_bytes": active * g.expert_bytes, "flops": flops(rows, g),
           "weight_sets": len(weights), "times_us": {}, "errors": {}}
    if mode == "prefill":
        routed = sum(routed_tokens(s["ids_rk"].cpu(), g) for s in sets) / len(sets)
        row["launch_bytes"] = launch_bytes(tokens, rows, active, g, routed)
    builders = {"rosekernels": lambda: rosekernels_arm(sets, weights), "rk+grouped_mm": lambda: today_arm(sets, weights),
                "stock": lambda: stock_arm(sets, weights, g), "quack": lambda: quack_arm(sets, weights),
                "cublas loop": lambda: cublas_arm(sets, weights)}
    ref = reference(sets[0]["x"], *weights[0], sets[0]["ids_rk"].long(), sets[0]["w"])
    steps = {}
    for arm, build in builders.items():
        try:
            step = build()
            check(step(0), ref)
            steps[arm] = step
        except Exception as e:  # noqa: BLE001 - an arm that cannot run or fails its check is a result
            row["errors"][arm] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    torch.cuda.synchronize()
    calls = len(sets) * len(weights) * (1 if mode == "prefill" else 4)
    errors: dict[str, str] = {}
    row["times_us"] = timing.interleaved_graph_time_us(steps, calls=calls, rounds=5 if quick else 15, errors=errors)
    row["errors"].update(errors)
    if mode == "prefill":
        dense = report.measure("dense GEMMs", lambda: dense_us(round(rows), g, 4), log) or {}
        row["dense_us"] = dense.get("pair")
        row["dense_parts_us"] = {k: v for k, v in dense.items() if k != "pair"}
        row["launches_us"] = report.measure(
            "launches", lambda: timing.interleaved_graph_time_us(launches_arm(sets, weights), calls=calls,
                                                                  rounds=5 if quick else 15), log) or {}
    log.append(f"{name} T={tokens}: " + ", ".join(f"{a} {t:.1f} us" for a, t in row["times_us"].items()))
    print(log[-1], flush=True)
    del steps, sets, weights
    torch.cuda.empty_cache()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    report.add_out(p)
    p.add_argument("--geometries", default=",".join(GEOMETRIES))
    p.add_argument("--tokens", default=",".join(map(str, DECODE_TOKENS + PREFILL_TOKENS)))
    p.add_argument("--quick", action="store_true", help="fewer input sets and rounds")
    args = p.parse_args()
    names = args.geometries.split(",")
    unknown = sorted(set(names) - set(GEOMETRIES))
    if unknown:
        p.error(f"unknown geometries {unknown}; choose from {sorted(GEOMETRIES)}")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens takes integers, got {args.tokens!r}")
    if min(tokens) < 1:
        p.error("token counts are at least 1")
    report.require_gpu()
    env = report.environment(("quack", "transformers"))
    copy_gbps = timing.copy_gbs()
    log: list[str] = []
    rows = [bench_shape(name, GEOMETRIES[name], t, env.get("l2_bytes") or timing.L2_BYTES, log, args.quick)
            for name in names for t in tokens]
    for r in rows:
        r["summary"] = summarize(r, copy_gbps)
    data = {"env": env, "copy_gbps": copy_gbps, "targets": TARGETS, "rows": rows, "verdicts": verdicts(rows),
            "log": log}
    report.write(args.out, "moe_experts", data, markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
