"""rosekernels.append_kvcache: against a per-token Python reference on random paged caches (pages in
random order, ragged positions, tables with garbage entries, positions past the cache, shared-nothing
sequences) and contiguous ones (strided views included): written rows hold the new tokens, every other
byte of the caches is untouched; argument checks. The op is plain torch, so these run on the CPU; on
the GPU: the same, CUDA-graph replays with new lengths, and append-then-attend against the reference
cache through attention_with_kvcache."""
import pytest
import torch
from attention_reference import check_kvcache, paged_cache

import rosekernels
from rosekernels.ops.kvcache_append import append_kvcache

BF16, I32 = torch.bfloat16, torch.int32


def _reference(k_cache, v_cache, k, v, lengths, table):
    """The caches after the append, one token at a time in Python (skipped tokens skipped)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    B, S_new = k.shape[:2]
    for b in range(B):
        for i in range(S_new):
            p = int(lengths[b]) + i
            if table is None:
                if 0 <= p < k_cache.shape[1]:
                    k_cache[b, p], v_cache[b, p] = k[b, i], v[b, i]
                continue
            column = p // k_cache.shape[1] if p >= 0 else -1
            if not 0 <= column < table.shape[1]:
                continue
            block = int(table[b, column])
            if 0 <= block < k_cache.shape[0]:
                k_cache[block, p % k_cache.shape[1]], v_cache[block, p % k_cache.shape[1]] = k[b, i], v[b, i]
    return k_cache, v_cache


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _paged_case(g, B, S_new, block_size, max_blocks, num_blocks, device):
    """Distinct blocks for every (sequence, column), garbage (-1, num_blocks, 2^31 - 1) in some entries,
    lengths anywhere from -2 to past the table."""
    order = torch.randperm(num_blocks, generator=g)[:B * max_blocks].view(B, max_blocks).to(I32)
    garbage = torch.tensor([-1, num_blocks, 2**31 - 1], dtype=I32)[torch.randint(0, 3, (B, max_blocks), generator=g)]
    table = torch.where(torch.rand(B, max_blocks, generator=g) < 0.2, garbage, order)
    lengths = torch.randint(-2, max_blocks * block_size + 3, (B,), generator=g, dtype=I32)
    return table.to(device), lengths.to(device)


def _check_append(device, dtype, B, S_new, Hkv, d, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    max_blocks, num_blocks = 5, B * 5 + 3
    caches = [torch.randn(num_blocks, block_size, Hkv, d, generator=g).to(dtype).to(device) for _ in range(2)]
    k, v = (torch.randn(B, S_new, Hkv, d, generator=g).to(dtype).to(device) for _ in range(2))
    table, lengths = _paged_case(g, B, S_new, block_size, max_blocks, num_blocks, device)
    want = _reference(*caches, k, v, lengths.cpu(), table.cpu())
    append_kvcache(*caches, k, v, lengths, table)
    for got, ref in zip(caches, want):
        assert torch.equal(_bits(got), _bits(ref.to(device))), "written rows differ, or another row changed"


@pytest.mark.parametrize("B, S_new, block_size", [(1, 1, 16), (7, 1, 16), (5, 4, 64), (3, 16, 1), (4, 3, 5)])
def test_paged_append_matches_the_reference_and_touches_nothing_else(B, S_new, block_size):
    for seed in range(4):
        _check_append("cpu", BF16, B, S_new, 2, 8, block_size, seed)


def test_contiguous_append_including_a_transposed_cache_view():
    g = torch.Generator().manual_seed(5)
    B, S_max, Hkv, d, S_new = 4, 9, 2, 8, 3
    lengths = torch.tensor([0, 7, 9, -1], dtype=I32)  # ends past the cache, starts past it, starts before it
    k, v = (torch.randn(B, S_new, Hkv, d, generator=g).to(BF16) for _ in range(2))
    # transformers' static cache is [B, Hkv, S_max, d]: its transpose is a strided [B, S_max, Hkv, d] view.
    storage = [torch.randn(B, Hkv, S_max, d, generator=g).to(BF16) for _ in range(2)]
    caches = [s.transpose(1, 2) for s in storage]
    want = _reference(*caches, k, v, lengths, None)
    append_kvcache(*caches, k, v, lengths)
    for got, ref in zip(caches, want):
        assert torch.equal(_bits(got.contiguous()), _bits(ref.contiguous()))
    assert torch.equal(caches[0][1, 7:], k[1, :2]) and torch.equal(caches[0][0, :3], k[0])


def test_no_token_written_leaves_the_cache_as_it_was():
    g = torch.Generator().manual_seed(6)
    caches = [torch.randn(3, 4, 1, 8, generator=g).to(BF16) for _ in range(2)]
    before = [c.clone() for c in caches]
    table = torch.tensor([[-1, 3], [2, 2**31 - 1]], dtype=I32)
    k, v = (torch.randn(2, 2, 1, 8, generator=g).to(BF16) for _ in range(2))
    append_kvcache(*caches, k, v, torch.tensor([1, 4], dtype=I32), table)  # block -1, then id 2^31 - 1
    for got, ref in zip(caches, before):
        assert torch.equal(_bits(got), _bits(ref))


def test_a_skipped_token_never_undoes_a_written_one():
    """Skipped tokens still go through index_put_: after a written token, and aimed (clamped) at the
    same row as it, they must carry its value, not the row's old one."""
    caches = [torch.zeros(2, 4, 1, 8, dtype=BF16) for _ in range(2)]
    k, v = torch.ones(2, 1, 1, 8, dtype=BF16), torch.full((2, 1, 1, 8), 2.0, dtype=BF16)
    table = torch.tensor([[0], [0]], dtype=I32)
    append_kvcache(*caches, k, v, torch.tensor([0, -4], dtype=I32), table)  # writes (0, 0), then skips (0, 0)
    assert torch.equal(caches[0][0, 0], k[0, 0]) and torch.equal(caches[1][0, 0], v[0, 0])
    assert not caches[0][0, 1:].any() and not caches[0][1].any()


@pytest.mark.parametrize("change, exc, match", [
    (lambda a: a.update(k=a["k"].float()), TypeError, "k has dtype float32"),
    (lambda a: a.update(v=a["v"][:1]), ValueError, "v has shape"),
    (lambda a: a.update(k_cache=a["k_cache"][..., :4]), ValueError, "k_cache has shape"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"].long()), TypeError, "cache_seqlens has dtype int64"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"][:1]), ValueError, "cache_seqlens has shape"),
    (lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table has dtype int64"),
    (lambda a: a.update(block_table=a["block_table"][:, :0]), ValueError, "at least one column"),
    (lambda a: a.update(k_cache=a["k_cache"][:0], v_cache=a["v_cache"][:0]), ValueError, "no rows"),
    (lambda a: a.update(k=a["k"][0]), ValueError, "4-D"),
    (lambda a: a.update(v=None), TypeError, "v must be a torch.Tensor"),
])
def test_bad_arguments_raise_and_write_nothing(change, exc, match):
    args = dict(k_cache=torch.zeros(4, 16, 2, 8, dtype=BF16), v_cache=torch.zeros(4, 16, 2, 8, dtype=BF16),
                k=torch.ones(2, 1, 2, 8, dtype=BF16), v=torch.ones(2, 1, 2, 8, dtype=BF16),
                cache_seqlens=torch.zeros(2, dtype=I32), block_table=torch.zeros(2, 3, dtype=I32))
    change(args)
    with pytest.raises(exc, match=match):
        append_kvcache(**args)
    for name in ("k_cache", "v_cache"):
        assert not args[name].any(), f"{name} written before the error"


def test_compiles_into_one_graph_and_matches_eager():
    """fullgraph torch.compile: nothing in the op breaks the graph (no sync, no data-dependent shape)."""
    g = torch.Generator().manual_seed(11)
    caches = [torch.randn(9, 16, 2, 8, generator=g).to(BF16) for _ in range(2)]
    k, v = (torch.randn(3, 2, 2, 8, generator=g).to(BF16) for _ in range(2))
    table, lengths = _paged_case(g, 3, 2, 16, 3, 9, "cpu")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    want = _reference(*caches, k, v, lengths, table)
    torch.compile(append_kvcache, backend=backend, fullgraph=True)(*caches, k, v, lengths, table)
    assert len(graphs) == 1
    for got, ref in zip(caches, want):
        assert torch.equal(_bits(got), _bits(ref))


def test_exported():
    assert rosekernels.append_kvcache is append_kvcache


# ---------------------------------------------------------------------------------------------
# GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_append_on_the_gpu(dtype):
    for seed, (B, S_new, block_size) in enumerate([(1, 1, 16), (33, 1, 64), (8, 16, 16), (5, 3, 256)]):
        _check_append("cuda", dtype, B, S_new, 8, 128, block_size, seed)


@pytest.mark.gpu
def test_append_in_a_cuda_graph_replays_with_new_lengths():
    g = torch.Generator().manual_seed(9)
    B, S_new, Hkv, d, block_size, max_blocks = 6, 2, 8, 64, 16, 4
    num_blocks = B * max_blocks + 2
    caches = [torch.randn(num_blocks, block_size, Hkv, d, generator=g).to(BF16).cuda() for _ in range(2)]
    k, v = (torch.randn(B, S_new, Hkv, d, generator=g).to(BF16).cuda() for _ in range(2))
    table, lengths = _paged_case(g, B, S_new, block_size, max_blocks, num_blocks, "cuda")
    append_kvcache(*caches, k, v, lengths, table)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        append_kvcache(*caches, k, v, lengths, table)
    for _ in range(4):
        new_table, new_lengths = _paged_case(g, B, S_new, block_size, max_blocks, num_blocks, "cuda")
        table.copy_(new_table), lengths.copy_(new_lengths)
        k.copy_(torch.randn(B, S_new, Hkv, d, generator=g).to(BF16)), v.copy_(torch.randn(B, S_new, Hkv, d, generator=g))
        want = _reference(*(c.cpu() for c in caches), k.cpu(), v.cpu(), lengths.cpu(), table.cpu())
        graph.replay()
        for got, ref in zip(caches, want):
            assert torch.equal(_bits(got.cpu()), _bits(ref))


@pytest.mark.gpu
def test_append_then_attend_matches_the_reference_cache():
    """A decode step as an engine runs it: append the step's k/v at each length, advance the lengths,
    then attention_with_kvcache over the paged cache: the float64 reference over the grown sequences."""
    g = torch.Generator().manual_seed(10)
    B, Hq, Hkv, d, block_size, S_max = 4, 32, 8, 128, 16, 200
    lengths = torch.tensor([0, 1, 77, 199], dtype=I32)
    dense = [torch.randn(B, S_max, Hkv, d, generator=g).to(BF16).cuda() for _ in range(2)]
    k_cache, v_cache, table = paged_cache(*dense, lengths + 1, block_size, 3, g)
    k_new, v_new = (torch.randn(B, 1, Hkv, d, generator=g).to(BF16).cuda() for _ in range(2))
    lengths = lengths.cuda()
    append_kvcache(k_cache, v_cache, k_new, v_new, lengths, table)
    lengths += 1
    q = torch.randn(B, 1, Hq, d, generator=g).to(BF16).cuda()
    out, lse = rosekernels.attention_with_kvcache(q, k_cache, v_cache, lengths, table, return_lse=True)
    for b in range(B):
        dense[0][b, int(lengths[b]) - 1], dense[1][b, int(lengths[b]) - 1] = k_new[b, 0], v_new[b, 0]
    check_kvcache(out, lse, q, *dense, lengths.cpu(), None, True, d ** -0.5, "append then attend")
