"""bench/attention.py --kvcache on the CPU: the table with the FlashInfer columns. The timing itself needs the
GPU."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import attention as bench  # noqa: E402


def test_the_table_puts_flashinfer_beside_ours_and_says_what_did_not_run():
    row = {"d": 128, "b": 8, "s_kv": 8192, "errors": {"FlashInfer paged, 256 rows": "RuntimeError: no plan"},
           "us": {"dense decode": 100.0, "cache, contiguous": 101.0, "paged, 16 rows": 102.0, "paged, 64 rows": 101.5,
                  "paged, 256 rows": 101.0, "FlashInfer paged, 16 rows": 122.4},
           "vs dense": {"dense decode": 1.0, "cache, contiguous": 1.01, "paged, 16 rows": 1.02, "paged, 64 rows": 1.015,
                        "paged, 256 rows": 1.01},
           "vs FlashInfer": {"16": 1.2}}
    text = bench.markdown_kvcache([row], "H200", ["FlashInfer: unavailable (ImportError: x)"])
    line = next(x for x in text.splitlines() if x.startswith("| 128 |"))
    assert line.endswith("| 102.0 (1.020x) | 101.5 (1.015x) | 101.0 (1.010x) | 122.4 (1.200x) | not run | err |")
    assert "FlashInfer paged, 256 rows: RuntimeError: no plan" in text
    assert "- FlashInfer: unavailable (ImportError: x)" in text
    header = next(x for x in text.splitlines() if x.startswith("| d |"))
    assert header.count("|") == next(x for x in text.splitlines() if x.startswith("|---")).count("|")
