"""bench/sip_oplevel_sweep.py on the CPU: which shipped entries it selects, the lengths where the op launches
another variant (recorded, never timed), the markdown, its argument errors. The timing needs the GPU."""
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import sip_oplevel_sweep as bench  # noqa: E402
from rosekernels import tuned  # noqa: E402

pytestmark = pytest.mark.skipif(not any(tuned.SHIPPED_ROOT.glob("*/attention/*/*/meta.json")),
                                reason="no shipped dense attention entry")


def test_entries_selects_by_head_dim_and_causality():
    found = bench.entries(tuned.SHIPPED_ROOT, "shipped", {(128, True)})
    assert found and all(e["config"].head_dim == 128 and e["config"].causal for e in found)
    for e in found:
        assert tuned.sha256(e["original"]) == tuned._read_entry(tuned.SHIPPED_ROOT / e["path"]).meta["original_sha256"]
        assert e["tuned"] != e["original"]
    assert bench.entries(tuned.SHIPPED_ROOT, "shipped", set()) == []


def test_a_length_served_by_another_variant_is_recorded_not_timed(monkeypatch):
    from sip_tune import oplevel

    def no_timing(*args, **kwargs):
        raise AssertionError("timed a length the entry does not serve")

    monkeypatch.setattr(oplevel, "retime", no_timing)
    found = {e["config"].tile_n: e for e in bench.entries(tuned.SHIPPED_ROOT, "shipped", {(128, False)})}
    assert set(found) == {128, 192}  # attention_d128 and attention_d128_long
    # d=128 non-causal takes 192-key tiles from 8192 keys on (attention_plan.LONG_KV): not the 128-key entry's
    rows = bench.sweep([found[128]], [8192, 16384], 16384, (32, 8), sms=132)
    assert [r["shape"]["seqlen"] for r in rows] == [8192, 16384]
    assert all("another variant" in r["error"] for r in rows)
    assert rows[0]["shape"]["batch"] == 2 and rows[1]["shape"]["batch"] == 1
    (row,) = bench.sweep([found[192]], [2048], 16384, (32, 8), sms=132)  # and the other way round
    assert "another variant" in row["error"]


def test_markdown_rows_and_median():
    shape = {"head_dim": 128, "causal": True, "batch": 4, "seqlen": 4096, "heads_q": 32, "heads_kv": 8}
    timed = {"entry": "shipped", "variant": "v", "shape": shape, "heuristic_us": 103.0, "tuned_us": 100.0,
             "speedup": 1.03, "aa_spread": 0.001, "peer": "fa4", "vs_peer": 1.1, "error": ""}
    other = {"entry": "shipped", "variant": "v", "shape": {**shape, "seqlen": 16384, "batch": 1},
             "error": "the op launches another variant here: w", "speedup": math.nan}
    text = bench.markdown([timed, other], {"gpu": "H", "date": "d", "commit": "c", "command": "x"})
    assert "| shipped | 128 | True | 4 x 4096 | 32/8 | 103.0 | 100.0 | 1.0300x | 0.10% | +0.0290 | fa4 1.100x |" in text
    assert "another variant here: w" in text and "Median speedup over the timed rows: 1.0300x." in text


@pytest.mark.parametrize("argv", [["--kernels", "d96"], ["--heads", "32/7"], ["--heads", "a/b"], ["--heads", "0/8"],
                                  ["--seqlens", "2048,x"], ["--seqlens", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
