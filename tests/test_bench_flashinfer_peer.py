"""bench/flashinfer_peer.py on the CPU: FlashInfer's paged layout built from our block tables. FlashInfer itself
runs on the GPU (bench/attention.py --kvcache, bench/fp8.py's KV section)."""
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import flashinfer_peer as peer  # noqa: E402


def test_flashinfer_pages_follow_the_block_table_for_ragged_lengths():
    """CSR of the pages each sequence uses, in table order, and the rows used of its last page, for lengths
    that end on a page boundary, inside a page, at one row and at the table's end."""
    rng = random.Random(5)
    for page in (1, 16, 64):
        width = 7
        lengths = [1, page, page + 1, width * page, rng.randrange(1, width * page + 1), 3 * page - 1]
        table = torch.randperm(len(lengths) * width).view(len(lengths), width).to(torch.int32)
        indptr, indices, last = peer.pages(table, torch.tensor(lengths, dtype=torch.int32), page)
        want_indices, want_indptr, want_last = [], [0], []
        for i, n in enumerate(lengths):
            used = -(-n // page)
            want_indices += table[i, :used].tolist()
            want_indptr.append(want_indptr[-1] + used)
            want_last.append(n - (used - 1) * page)
            assert 1 <= want_last[-1] <= page
        assert indptr.tolist() == want_indptr and indices.tolist() == want_indices and last.tolist() == want_last
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32


def test_a_contiguous_cache_read_as_pages_gives_each_sequence_its_own_rows_in_order():
    """contiguous_table over [B, S, H, d] viewed as [B * S / page, page, H, d]: the rows FlashInfer's CSR (pages())
    walks for sequence b, to a ragged length, are that sequence's first rows, in order."""
    b, s, h, d, page = 3, 48, 2, 4, 16
    cache = torch.randn(b, s, h, d)
    table = peer.contiguous_table(b, s, page, device="cpu")
    lengths = torch.tensor([48, 17, 1], dtype=torch.int32)
    indptr, indices, last = peer.pages(table, lengths, page)
    paged = cache.view(b * s // page, page, h, d)
    for i, n in enumerate(lengths.tolist()):
        rows = paged[indices[indptr[i]:indptr[i + 1]].long()].reshape(-1, h, d)
        rows = rows[: (indptr[i + 1] - indptr[i] - 1) * page + last[i]]
        assert torch.equal(rows, cache[i, :n])
    with pytest.raises(ValueError, match="whole number of pages"):
        peer.contiguous_table(b, 40, page)
