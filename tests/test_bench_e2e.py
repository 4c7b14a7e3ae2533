"""bench/e2e.py without a GPU: the decode table's column against issue 43's baseline, and the per-op table
that explains the graph step."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import e2e as bench  # noqa: E402


def _result():
    arms = ("stock", "rosekernels", bench.BASELINE_43)
    decode = [bench.decode_row("eager", 16, dict(zip(arms, (5000.0, 4000.0, 4400.0)))),
              bench.decode_row("graph", 16, dict(zip(arms, (3000.0, 1500.0, 2000.0))))]
    profile = {a: {"groups": {"GEMM": g, "rk grouped gemm": 900.0}, "total_us": g + 900.0, "kernels": []}
               for a, g in zip(arms, (400.0, 300.0, 350.0))}
    return {"warmup": "w", "prefill": [], "decode": decode, "profile": profile, "stats": {}}


def test_the_graph_row_gives_the_speedup_over_issue_43s_baseline():
    row = _result()["decode"][1]
    assert abs(row["vs_issue43_baseline"] - 2000.0 / 1500.0) < 1e-12
    assert abs(row["speedup"] - 3000.0 / 1500.0) < 1e-12


def test_the_profile_table_sets_each_arms_device_total_beside_its_graph_step():
    env = {"gpu": "Fake H100", "torch": "t", "transformers": "x", "toolchain": "c"}
    args = argparse.Namespace(layers=2, quick=True)
    text = bench.markdown(env, args, {"qwen3-30b-a3b": _result()}, [])
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]  # noqa: E731
    table = [cells(x) for x in text.splitlines() if x.startswith("| ")]
    head = next(r for r in table if r[0] == "op")[1:]
    rows = {r[0]: dict(zip(head, r[1:])) for r in table}
    assert rows["graph step"]["rosekernels"] == "1500.0" and rows["total"]["rosekernels"] == "1200.0"
    assert rows["graph step"][bench.BASELINE_43] == "2000.0" and rows["total"]["stock"] == "1300.0"
    assert "StaticCache" in text
