"""bench/attention.py --kvcache on the CPU: FlashInfer's paged layout built from our block table, and the table
with the FlashInfer columns. The timing itself needs the GPU."""
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import attention as bench  # noqa: E402


def test_flashinfer_pages_follow_the_block_table_for_ragged_lengths():
    """CSR of the pages each sequence uses, in table order, and the rows used of its last page, for lengths
    that end on a page boundary, inside a page, at one row and at the table's end."""
    rng = random.Random(5)
    for page in (1, 16, 64):
        width = 7
        lengths = [1, page, page + 1, width * page, rng.randrange(1, width * page + 1), 3 * page - 1]
        table = torch.randperm(len(lengths) * width).view(len(lengths), width).to(torch.int32)
        indptr, indices, last = bench.flashinfer_pages(table, torch.tensor(lengths, dtype=torch.int32), page)
        want_indices, want_indptr, want_last = [], [0], []
        for i, n in enumerate(lengths):
            used = -(-n // page)
            want_indices += table[i, :used].tolist()
            want_indptr.append(want_indptr[-1] + used)
            want_last.append(n - (used - 1) * page)
            assert 1 <= want_last[-1] <= page
        assert indptr.tolist() == want_indptr and indices.tolist() == want_indices and last.tolist() == want_last
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32


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
