"""bench/moe_experts.py's planning and report on the CPU: the geometries of issue 43, the routing an
expert-parallel rank sees, the weight bytes and FLOPs its ceilings divide by, how many weight sets keep
the weights out of L2, the derived numbers, the targets and the markdown; its argument errors. The
timing itself needs the GPU (the arms are checked against the float64 block before they are timed)."""
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import moe_experts as bench  # noqa: E402


def test_the_geometries_are_the_issues():
    g = bench.GEOMETRIES
    assert (g["qwen3-30b-a3b"].experts, g["qwen3-30b-a3b"].topk, g["qwen3-30b-a3b"].hidden,
            g["qwen3-30b-a3b"].inter) == (128, 8, 2048, 768)
    assert (g["qwen3-235b-a22b"].hidden, g["qwen3-235b-a22b"].inter) == (4096, 1536)
    assert (g["mixtral-8x7b"].experts, g["mixtral-8x7b"].topk, g["mixtral-8x7b"].inter) == (8, 2, 14336)
    ep = g["deepseek-v3-ep8"]
    assert (ep.experts, ep.local_experts, ep.topk, ep.hidden, ep.inter) == (256, 32, 8, 7168, 2048)
    assert g["qwen3-30b-a3b"].local_experts == 128 and g["qwen3-30b-a3b"].expert_bytes == 3 * 2048 * 768 * 2
    assert bench.DECODE_TOKENS == (1, 16, 64, 128) and bench.PREFILL_TOKENS == (4096, 16384)


def test_routing_and_an_expert_parallel_ranks_view():
    g = bench.GEOMETRIES["deepseek-v3-ep8"]
    ids, w = bench.routing(300, g, torch.Generator().manual_seed(0))
    assert ids.shape == w.shape == (300, 8) and int(ids.max()) < 256
    assert all(len(set(row)) == 8 for row in ids.tolist())  # distinct experts per token
    assert torch.allclose(w.sum(1), torch.ones(300))
    mine = bench.local_ids(ids, g, -1)
    assert bool(((mine == -1) | (mine < 32)).all()) and bool((mine[ids < 32] == ids[ids < 32]).all())
    assert bool((bench.local_ids(ids, g, 32)[ids >= 32] == 32).all())  # transformers' EP sentinel
    # about 1/8 of the choices land on this rank
    assert 0.09 < bench.routed_rows(mine, g) / ids.numel() < 0.16


def test_active_experts_rows_and_flops():
    g = bench.Geometry(8, 2, 64, 32)
    ids = torch.tensor([[0, 3], [3, -1], [7, 0]])
    assert bench.active_experts(ids, g) == 3 and bench.routed_rows(ids, g) == 5
    assert bench.active_experts(torch.tensor([[5, 9]]), bench.Geometry(16, 2, 64, 32, local=8)) == 1
    assert bench.flops(5, g) == 2 * 5 * (64 * 64 + 32 * 64)  # gate-up 2I x H, down H x I


def test_weight_sets_pass_three_l2s_within_the_memory_bound():
    l2 = 60 << 20
    qwen = bench.GEOMETRIES["qwen3-30b-a3b"]
    one_token = 8 * qwen.expert_bytes  # ~75 MB active at T = 1
    assert bench.weight_sets(qwen, one_token, l2) == math.ceil(3 * l2 / one_token) == 3
    assert bench.weight_sets(qwen, 128 * qwen.expert_bytes, l2) == 1  # prefill: every expert, 1.2 GB
    tiny = bench.Geometry(8, 2, 64, 32)
    assert bench.weight_sets(tiny, tiny.expert_bytes, l2) == math.ceil(3 * l2 / tiny.expert_bytes)
    huge = bench.Geometry(512, 8, 16384, 16384)  # one set already past the memory bound: still one
    assert bench.weight_sets(huge, huge.expert_bytes, l2) == 1


def _row(geometry, tokens, times, dense=None, errors=None):
    mode = "decode" if tokens <= 128 else "prefill"
    row = {"geometry": geometry, "tokens": tokens, "mode": mode, "active_experts": 8.0, "rows": 8 * tokens,
           "weight_bytes": 8 * 9.4e6, "flops": 6 * 8 * tokens * 2048 * 768, "weight_sets": 1, "times_us": times,
           "errors": errors or {}}
    if dense is not None:
        row["dense_us"] = dense
    return row


def test_summary_and_targets():
    decode = _row("qwen3-30b-a3b", 16, {"rosekernels": 40.0, "stock": 80.0, "quack": 41.6})  # 1880 GB/s: 47%
    s = bench.summarize(decode, copy_gbps=4000.0)
    assert s["weight_gbps"] == pytest.approx(8 * 9.4e6 / 40.0 / 1e3)
    assert s["pct_of_copy"] == pytest.approx(100 * s["weight_gbps"] / 4000.0)
    assert s["vs"] == {"stock": 2.0, "quack": pytest.approx(1.04)}
    prefill = _row("mixtral-8x7b", 4096, {"rosekernels": 1000.0, "stock": 900.0}, dense=900.0,
                   errors={"quack": "ImportError: no quack"})
    p = bench.summarize(prefill, copy_gbps=4000.0)
    assert p["pct_of_dense"] == pytest.approx(90.0) and p["tflops"] == pytest.approx(prefill["flops"] / 1e9)
    for r in (decode, prefill):
        r["summary"] = bench.summarize(r, 4000.0)
    found = {(v["tokens"], v["target"]): v["met"] for v in bench.verdicts([decode, prefill])}
    assert found == {(16, "decode_pct_of_copy"): False, (16, "decode_vs_stock"): True, (16, "decode_vs_quack"): False,
                     (16, "vs_stock_min"): True, (4096, "prefill_pct_of_dense"): True,
                     (4096, "vs_stock_min"): False}  # no quack at prefill: not measured, not judged
    t1 = _row("qwen3-30b-a3b", 1, {"rosekernels": 100.0})
    t1["summary"] = bench.summarize(t1, 4000.0)
    assert {v["target"] for v in bench.verdicts([t1])} == {"decode_pct_of_copy_t1"}
    assert bench.summarize(_row("x", 1, {"stock": 5.0}), 4000.0) == {"vs": {}}  # ours did not run


def test_markdown_tables_are_whole_and_name_what_did_not_run():
    rows = [_row("qwen3-30b-a3b", t, {a: random.uniform(10, 90) for a in bench.ARMS}) for t in (1, 16)]
    rows.append(_row("mixtral-8x7b", 4096, {"rosekernels": 1000.0, "stock": 900.0}, dense=950.0,
                     errors={"quack": "ImportError: quack"}))
    for r in rows:
        r["summary"] = bench.summarize(r, 4000.0)
    text = bench.markdown({"env": {"gpu": "test GPU"}, "copy_gbps": 4000.0, "rows": rows,
                           "verdicts": bench.verdicts(rows)})
    tables = [line for line in text.splitlines() if line.startswith("|")]
    widths = {line.count("|") for line in tables if "target" not in line and "met" not in line and "MISS" not in line}
    assert len({w for w in widths if w > 7}) == 1, widths  # header, rule and rows of the mode tables agree
    assert "## decode" in text and "## prefill" in text and "MISS" in text and "mixtral-8x7b T=4096 quack: Import" in text


def test_the_launch_table_sums_the_launches_and_rates_each_grouped_gemm_against_its_dense_one():
    """Prefill launch by launch: the four launches' sum (none where one is missing), each grouped GEMM's share
    of its dense GEMM, the gathered gate-up over the dispatch + gate-up it would replace."""
    row = _row("qwen3-30b-a3b", 4096, {"rosekernels": 731.0}, dense=420.0)
    row["launches_us"] = {"dispatch": 60.0, "gate-up": 400.0, "down": 200.0, "combine": 50.0, bench.GATHERED: 437.0}
    row["dense_parts_us"] = {"gate-up": 300.0, "down": 120.0}
    row["launch_bytes"] = {"dispatch": 1e8, "gate-up": 1e9, "down": 5e8, "combine": 1e8}  # 1.7 GB: 425 us at 4 TB/s
    partial = _row("mixtral-8x7b", 4096, {"rosekernels": 1000.0}, dense=950.0)
    partial["launches_us"] = {"dispatch": 10.0, "gate-up": 700.0}  # a launch that failed to capture: no sum
    rows = [row, partial]
    for r in rows:
        r["summary"] = bench.summarize(r, 4000.0)
    text = bench.markdown({"env": {"gpu": "g"}, "copy_gbps": 4000.0, "rows": rows, "verdicts": bench.verdicts(rows)})
    table = text.split("## prefill, launch by launch")[1].split("## targets")[0]
    # the gathered gate-up against the dispatch and the gate-up it replaces: 437 / (60 + 400)
    assert ("| qwen3-30b-a3b | 4096 | 60.0 | 400.0 | 200.0 | 50.0 | 710.0 | 731.0 | 75.0 | 60.0 | 437.0 | 0.950 "
            "| 425.0 | 98.8 |") in table  # the dense pair's 420 us over the bytes' 425
    assert "| mixtral-8x7b | 4096 | 10.0 | 700.0 | - | - | - | 1000.0 | - | - | - | - | - | - |" in table
    lines = [line for line in table.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in lines}) == 1 and len(lines) == 4


def test_reference_and_check():
    gen = torch.Generator().manual_seed(2)
    g = bench.Geometry(4, 2, 32, 16)
    x = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    wgu, wd = torch.randn(4, 32, 32, generator=gen) / 6, torch.randn(4, 32, 16, generator=gen) / 4
    ids = torch.tensor([[0, 1], [1, -1], [3, 3], [-1, -1], [2, 0]])
    w = torch.rand(5, 2, generator=gen)
    ref = bench.reference(x, wgu.to(x.dtype), wd.to(x.dtype), ids, w)
    assert (ref[3] == 0).all()
    e, t = 1, 1  # token 1's one routed choice
    h = bench._silu_mul(x[t:t + 1].double() @ wgu[e].to(x.dtype).double().t()).to(x.dtype).double()
    torch.testing.assert_close(ref[t], (h @ wd[e].to(x.dtype).double().t()).to(x.dtype).double()[0] * w[t, 0].double())
    bench.check(ref.to(x.dtype), ref + 0 * ref)
    with pytest.raises(AssertionError, match="relative error"):
        bench.check((ref * 1.2).to(x.dtype), ref)


def test_quacks_routing_groups_every_routed_pair_once_under_its_expert():
    gen = torch.Generator().manual_seed(5)
    experts, k = 6, 3
    ids = torch.randint(0, experts, (40, k), generator=gen)
    ids[torch.rand(40, k, generator=gen) < 0.2] = -1  # not routed
    ids[7] = -1  # a token with no expert; expert 5 below gets none
    ids[ids == 5] = 4
    cu, token, slot = bench.sorted_routing(ids, experts)
    assert cu.dtype == token.dtype == slot.dtype == torch.int32
    counts = [int((ids == e).sum()) for e in range(experts)]
    assert torch.equal(cu, torch.tensor([0] + counts).cumsum(0).to(torch.int32)) and counts[5] == 0
    for t, choice in zip(*torch.nonzero(ids >= 0, as_tuple=True)):
        s, e = int(slot[t, choice]), int(ids[t, choice])
        assert cu[e] <= s < cu[e + 1] and int(token[s]) == t  # in its expert's group, gathering its token
    routed = slot[ids >= 0]
    assert routed.unique().numel() == routed.numel() == int(cu[-1]) and bool((slot[ids < 0] == -1).all())


@pytest.mark.parametrize("argv, message", [(["--geometries", "qwen9"], "unknown geometries"),
                                           (["--tokens", "1,x"], "integers"), (["--tokens", "0"], "at least 1")])
def test_bad_arguments_exit_2_before_any_work(argv, message):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_experts.py"), *argv], capture_output=True, text=True)
    assert run.returncode == 2 and message in run.stderr


def test_launch_bytes_are_what_each_launch_must_move():
    """Qwen3-30B-A3B at T = 4096: 32,768 routed rows of 2,048 and 768 elements, 128 experts' weights."""
    g = bench.GEOMETRIES["qwen3-30b-a3b"]
    b = bench.launch_bytes(4096, 32768, 128, g)
    rows_h, rows_i, tokens_h = 32768 * 2048 * 2, 32768 * 768 * 2, 4096 * 2048 * 2
    assert b["dispatch"] == b["combine"] == tokens_h + rows_h
    assert b["gate-up"] == 128 * 2 * 768 * 2048 * 2 + rows_h + rows_i
    assert b["down"] == 128 * 2048 * 768 * 2 + rows_i + rows_h
    assert sum(b.values()) == pytest.approx(1.88e9, rel=0.01)  # 622 us at 3.02 TB/s: above the dense pair's 425
    # an EP rank's dispatch reads only the tokens routed to its experts; the combine writes every token
    ep = bench.launch_bytes(4096, 32768, 128, g, tokens_routed=1000)
    assert ep["dispatch"] == 1000 * 2048 * 2 + rows_h and ep["combine"] == b["combine"]
    ids = torch.tensor([[0, 40], [-1, 39], [33, 50], [5, 5]])  # 32 local experts of 64: 0 .. 31
    assert bench.routed_tokens(ids, bench.Geometry(64, 2, 8, 8, local=32)) == 2
