"""rosekernels.attention_with_kvcache: the KV-cache variants of the split-KV decode kernel compile to TMA
kernels with one box per page slice (CPU), argument checks (CPU), the test helpers' paged caches (CPU);
numerics against a float64 reference with per-sequence lengths (0, 1 and full included), contiguous and
paged caches (random page order, ragged last pages, garbage table entries past each length), masked
out-of-range block ids, lying tables and lengths between NaN canary pages, NaN in the cache past the
lengths, check=True, CUDA-graph replays with new lengths and torch.compile (GPU). Plan and variant keys: test_attention_decode_plan.py."""
import math
import os
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from attention_reference import (check, check_kvcache, decode_sass, paged_cache, refuses_an_out_overlapping_k_or_v,
                                 refuses_an_out_whose_elements_overlap, sequence_kv, sync)
import lying_tables

import rosekernels
from rosekernels import checks, scratch
from rosekernels.kernels import attention_decode as D
from rosekernels.ops import kvcache
from rosekernels.ops.kvcache import check_cache_tables, plan_kvcache

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Compiled on the CPU: contiguous and paged, both head dims, each box height class.
CPU_CONFIGS = [
    D.DecodeConfig(128, "bf16", 16, varlen=True),
    D.DecodeConfig(128, "bf16", 16, varlen=True, page_rows=16),
    D.DecodeConfig(128, "fp16", 64, varlen=True, page_rows=64),
    D.DecodeConfig(64, "bf16", 32, varlen=True, page_rows=16),
    D.DecodeConfig(64, "fp16", 16, varlen=True, page_rows=128),
]


@pytest.fixture(scope="module")
def cpu_kernels():
    return dict(zip(CPU_CONFIGS, D.precompile(CPU_CONFIGS)))


@pytest.fixture(scope="module")
def kernels():
    """What the GPU tests launch: every head dim, dtype and row tile, contiguous and with the box
    heights of 16-row pages and of pages that hold whole tiles (compiled in parallel)."""
    configs = [c for bs in (None, 16, 256) for c in D.kvcache_variants_for(block_size=bs)]
    return D.precompile(configs)


# ---------------------------------------------------------------------------------------------
# CPU


def test_kvcache_variants_compile_to_tma_kernels_with_one_box_per_page_slice(cpu_kernels, tmp_path):
    for cfg, k in cpu_kernels.items():
        sass = decode_sass(cfg, k, tmp_path)
        # K and V of a tile: one TMA per box and 64-column half (128-byte swizzle rows).
        boxes = cfg.tile_n // cfg.page_rows if cfg.paged else 1
        assert len(re.findall(r"\bUTMALDG\b", sass)) == 2 * boxes * (cfg.head_dim // 64), cfg
        # The same MMA work per tile as the dense kernel: S = Q K^T and O += P V of each warp's keys.
        keys = cfg.tile_n // cfg.key_slices
        assert len(re.findall(r"\bHMMA\.16816", sass)) == keys // 8 * cfg.head_dim // 16 + cfg.head_dim // 8 * keys // 16
        assert re.search(r"\bSTS\.128\b", sass), f"{cfg}: V rows past the length are not cleared 16 bytes at a time"


def test_dense_decode_variants_stay_apart_from_the_kvcache_ones():
    dense = D.DecodeConfig(128, "bf16", 16)
    assert D.compile(dense).variant == dense.variant()
    assert "varlen" not in dense.variant().key() and "page_rows" not in dense.variant().key()
    with pytest.raises(ValueError, match="no workload"):
        D.workload(D.DecodeConfig(128, "bf16", 16, varlen=True), D.Shape())


def test_registered_op_takes_an_optional_block_table():
    schema = str(torch.ops.rosekernels.attention_with_kvcache.default._schema)
    assert "Tensor? block_table" in schema and "Tensor(a5!) out" in schema and "Tensor(a6!) lse" in schema


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_traces_into_its_registered_op_under_torch_compile(paged):
    """fullgraph torch.compile on fake CUDA tensors (no GPU needed): the checks trace without data
    pointers or syncs, and the graph holds one call of rosekernels::attention_with_kvcache."""
    mode = FakeTensorMode()
    with mode:
        q = torch.empty(3, 2, 16, 128, device="cuda", dtype=torch.bfloat16)
        cache = torch.empty(20 if paged else 3, 32, 4, 128, device="cuda", dtype=torch.bfloat16)
        lengths = torch.empty(3, device="cuda", dtype=torch.int32)
        table = torch.empty(3, 7, device="cuda", dtype=torch.int32) if paged else None
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    step = torch.compile(lambda *args: rosekernels.attention_with_kvcache(*args, return_lse=True), backend=backend,
                         fullgraph=True)
    with mode:
        out, lse = step(q, cache, cache, lengths, table)
    assert out.shape == q.shape and lse.shape == (3, 16, 2)
    assert len(graphs) == 1 and graphs[0].count("torch.ops.rosekernels.attention_with_kvcache(") == 1


def test_paged_cache_helper_gathers_back_every_sequence():
    """The GPU tests' paged caches: pages in random order, garbage past each sequence, gathered back
    through the table to the contiguous cache they came from."""
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 4, 133, 3, 64, generator=g).to(torch.bfloat16)
    lengths = torch.tensor([0, 1, 133, 47], dtype=torch.int32)
    k_cache, v_cache, table = paged_cache(k, v, lengths, 16, 3, g)
    assert k_cache.shape == (0 + 1 + 9 + 3 + 3, 16, 3, 64) and table.shape == (4, 9)
    used = table[table.ge(0) & table.lt(len(k_cache))]
    assert len(used) == len(set(used.tolist())) == 13, "pages are shared or lost"
    assert table[0].lt(0).any() and table[1, 1:].ge(len(k_cache)).any(), "no garbage past the lengths"
    for b in range(4):
        kb, vb = sequence_kv(k_cache, v_cache, lengths, b, table)
        assert torch.equal(kb[0], k[b, :lengths[b]]) and torch.equal(vb[0], v[b, :lengths[b]])


def test_check_raises_on_lengths_outside_the_cache_and_out_of_range_ids_in_use():
    """check=True's host check (CPU tensors here): garbage past each sequence's pages passes."""
    table = torch.tensor([[3, 0, -1], [1, 9, 2**31 - 1]], dtype=torch.int32)  # 16-row pages, 4 blocks
    for lengths in ([32, 16], [0, 0], [17, 1]):
        check_cache_tables(torch.tensor(lengths, dtype=torch.int32), table, 48, 4)
    for lengths, match in (([32, 17], r"block_table\[1, 1\] = 9 is outside \[0, 4\)"),
                           ([33, 0], r"block_table\[0, 2\] = -1"),
                           ([49, 0], r"cache_seqlens\[0\] = 49 is outside \[0, 48\]"),
                           ([0, -2], r"cache_seqlens\[1\] = -2")):
        with pytest.raises(ValueError, match=match):
            check_cache_tables(torch.tensor(lengths, dtype=torch.int32), table, 48, 4)
    check_cache_tables(torch.tensor([0, 7], dtype=torch.int32), None, 7, 2)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 8 is outside \[0, 7\]"):
        check_cache_tables(torch.tensor([0, 8], dtype=torch.int32), None, 7, 2)


def _cpu(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def _args(**change):
    """Valid arguments of a paged call on the CPU (B 2, S_q 3, 8 on 2 heads, d 64, 32-row pages),
    with some replaced."""
    args = dict(q=_cpu(2, 3, 8, 64), k_cache=_cpu(5, 32, 2, 64), v_cache=_cpu(5, 32, 2, 64),
                cache_seqlens=torch.tensor([7, 40], dtype=torch.int32),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    args.update(change)
    return args


@pytest.mark.parametrize("change, exc, match", [
    (dict(q=_cpu(2, 3, 8)), ValueError, "4-D"),
    (dict(q=_cpu(2, 17, 8, 64)), ValueError, "1 to 16 query tokens"),
    (dict(q=_cpu(2, 0, 8, 64)), ValueError, "1 to 16 query tokens"),
    (dict(q=_cpu(2, 3, 8, 64, dtype=torch.float32)), TypeError, "q has dtype"),
    (dict(v_cache=_cpu(5, 32, 2, 64, dtype=torch.float16)), TypeError, "v_cache has dtype"),
    (dict(q=_cpu(2, 3, 8, 96), k_cache=_cpu(5, 32, 2, 96), v_cache=_cpu(5, 32, 2, 96)), ValueError, "head_dim"),
    (dict(q=_cpu(2, 3, 6, 64), k_cache=_cpu(5, 32, 4, 64), v_cache=_cpu(5, 32, 4, 64)), ValueError, "multiple"),
    (dict(v_cache=_cpu(5, 32, 1, 64)), ValueError, "v_cache has shape"),
    (dict(cache_seqlens=torch.tensor([7, 40])), TypeError, "cache_seqlens has dtype"),
    (dict(cache_seqlens=torch.tensor([7, 40, 1], dtype=torch.int32)), ValueError, "cache_seqlens has shape"),
    (dict(block_table=torch.tensor([[0, 1], [2, 3]])), TypeError, "block_table has dtype"),
    (dict(block_table=torch.tensor([[0, 1]], dtype=torch.int32)), ValueError, "block_table has shape"),
    (dict(block_table=torch.zeros(2, 0, dtype=torch.int32)), ValueError, "at least one column"),
    (dict(k_cache=_cpu(5, 24, 2, 64), v_cache=_cpu(5, 24, 2, 64)), ValueError, "block_size must be a positive multiple"),
    (dict(k_cache=_cpu(5, 8, 2, 64), v_cache=_cpu(5, 8, 2, 64)), ValueError, "block_size must be a positive multiple"),
    (dict(block_table=None), ValueError, r"k_cache has shape \[5, 32, 2, 64\]; expected \[2, \*, \*, 64\]"),
    (dict(block_table=None, k_cache=_cpu(2, 0, 2, 64), v_cache=_cpu(2, 0, 2, 64)), ValueError, "at least one key"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    (dict(softmax_scale=math.nan), ValueError, "softmax_scale"),
    (dict(softmax_scale=1e39), ValueError, "softmax_scale"),  # scale * log2(e) is inf in fp32
    # 2^31 - 1024 keys per sequence: the block-table look-ahead past the last tile would wrap
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int32).expand(2, 2**26 - 32)), ValueError, "32 bits"),
    (dict(cache_seqlens=[7, 40]), TypeError, "cache_seqlens must be a torch.Tensor"),
    (dict(), ValueError, "CUDA"),
    (dict(block_table=None, k_cache=_cpu(2, 50, 2, 64), v_cache=_cpu(2, 50, 2, 64)), ValueError, "CUDA"),
])
def test_invalid_arguments_raise_before_anything_is_written(change, exc, match):
    args = _args(**change)
    q = args["q"]
    out = torch.full(q.shape if q.dim() == 4 else (1, 1, 1, 64), 7.0).to(q.dtype)
    before = out.clone()
    with pytest.raises(exc, match=match):
        rosekernels.attention_with_kvcache(**args, out=out)
    assert torch.equal(out, before)


def test_the_out_the_op_allocates_is_held_to_the_span_limit(monkeypatch):
    """out=None: the op allocates out contiguous, so it spans more than a q whose heads overlap (a
    legal input); past 2^31 elements it is refused, as the same out passed in is."""
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)  # meta tensors stand in for CUDA ones
    b = 65535
    q = torch.empty_strided((b, 1, 512, 128), (4096, 4096, 8, 1), device="meta", dtype=torch.bfloat16)  # out 2^32
    cache = torch.empty(b, 16, 8, 128, device="meta", dtype=torch.bfloat16)
    lengths = torch.empty(b, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"out \(allocated contiguous in q's shape\) spans 2\^31"):
        rosekernels.attention_with_kvcache(q, cache, cache, lengths)
    with pytest.raises(ValueError, match=r"out spans 2\^31"):
        rosekernels.attention_with_kvcache(q, cache, cache, lengths, out=torch.empty(q.shape, device="meta",
                                                                                      dtype=q.dtype))


def test_an_out_whose_elements_overlap_is_refused(monkeypatch):
    """Rows of out 8 elements apart (as_strided): refused before anything is written."""
    call = lambda out: rosekernels.attention_with_kvcache(**_args(), out=out)  # noqa: E731
    refuses_an_out_whose_elements_overlap(monkeypatch, call, (2, 3, 8, 64), (1536, 64, 8, 1))


def test_an_out_overlapping_a_cache_is_refused_also_by_a_cached_plan(monkeypatch):
    """Other CTAs read the caches while one writes out: an out overlapping either is refused before
    anything is written, on a new signature and on one already planned (the key holds no pointers);
    out = q is not refused."""
    args = _args()
    q, _, v = (args.pop(name) for name in ("q", "k_cache", "v_cache"))
    call = lambda q, k, v, out: rosekernels.attention_with_kvcache(q, k, v, **args, out=out)  # noqa: E731
    refuses_an_out_overlapping_k_or_v(monkeypatch, kvcache, "plan_kvcache", call, q, v, ("k_cache", "v_cache"))


# ---------------------------------------------------------------------------------------------
# GPU

HEADS = ((4, 4), (8, 2), (16, 2))  # GQA ratios 1, 4, 8 (S_q 16 at ratio 8: two 64-row m-blocks)
SEQLENS_Q = (1, 3, 16)


def _lengths(batch, capacity, g):
    """0, 1 and the full cache among random lengths, shuffled, int32 on the GPU."""
    n = torch.cat([torch.tensor([0, 1, capacity]), torch.randint(0, capacity + 1, (batch - 3,), generator=g)])
    return n[torch.randperm(batch, generator=g)].to(torch.int32).cuda()


def _randn(*shape, dtype, g):
    return torch.randn(*shape, generator=g).to(dtype).cuda()


def _call(q, k_cache, v_cache, lengths, table, causal, scale, splits=None):
    """attention_with_kvcache into NaN-filled out and lse (`splits`: through the kernel's plan, forced)."""
    out = torch.full_like(q, math.nan)
    if splits is None:
        res, lse = rosekernels.attention_with_kvcache(q, k_cache, v_cache, lengths, table, softmax_scale=scale,
                                                      causal=causal, out=out, return_lse=True)
        assert res is out
    else:
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), math.nan, device="cuda")
        plan_kvcache(q, k_cache, v_cache, out, lengths, table, causal, scale, splits).launch(
            q, k_cache, v_cache, out, lse, lengths, table)
    sync(f"q{list(q.shape)} cache{list(k_cache.shape)} paged={table is not None} causal={causal} splits={splits}")
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
def test_matches_float64_reference(kernels, d, dtype, paged):
    """Every S_q and GQA ratio, causal and not, B = 5 with lengths 0, 1 and S_max among random ones; one
    split, the op's split count, and one tile per split (most splits of short sequences empty).
    Contiguous: every other cache a strided view ([B, Hkv, S_max, d] transposed, as transformers keeps
    it). Paged: pages of 16, 48 (three 16-row boxes), tile_n and 2 tile_n rows in turn, in random
    order, with noise in the ragged last pages and spare blocks and garbage table entries past the
    lengths."""
    g = torch.Generator().manual_seed(d + len(dtype) + paged)
    tdtype, tile_n = DTYPES[dtype], D.DecodeConfig(d, dtype).tile_n
    scale = 1.0 / math.sqrt(d)
    i = 0
    for s_q in SEQLENS_Q:
        for hq, hkv in HEADS:
            causal = i % 2 == 0
            s_max = 1 + int(torch.randint(1, 700, (1,), generator=g))
            lengths = _lengths(5, s_max, g)
            q = _randn(5, s_q, hq, d, dtype=tdtype, g=g)
            if i % 2:
                k, v = (_randn(5, hkv, s_max, d, dtype=tdtype, g=g).transpose(1, 2) for _ in range(2))
            else:
                k, v = _randn(2, 5, s_max, hkv, d, dtype=tdtype, g=g)
            table = None
            if paged:
                block_size = (16, 48, tile_n, 2 * tile_n)[i % 4]
                k, v, table = paged_cache(k, v, lengths, block_size, 2, g)
            n_tiles = -(-(s_max if table is None else table.shape[1] * k.shape[1]) // tile_n)
            for splits in (1, None, n_tiles):
                out, lse = _call(q, k, v, lengths, table, causal, scale, splits)
                check_kvcache(out, lse, q, k, v, lengths, table, causal, scale,
                              f"S_q {s_q} heads {hq}/{hkv} S_max {s_max} causal={causal} splits={splits}")
            i += 1
    assert all(int(c.sum()) == 0 for c in scratch.shared_buffers().values()), "a split counter was not reset to 0"


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cache_rows_past_the_lengths_never_reach_the_output(kernels, paged):
    """NaN everywhere past each sequence's keys (ragged last tiles, spare pages): the output is the
    reference over the keys alone, for one split and for many."""
    g = torch.Generator().manual_seed(7)
    q = _randn(6, 2, 16, 128, dtype=torch.bfloat16, g=g)
    k, v = _randn(2, 6, 333, 4, 128, dtype=torch.bfloat16, g=g)
    lengths = torch.tensor([333, 0, 1, 65, 200, 64], dtype=torch.int32, device="cuda")
    past = torch.arange(333, device="cuda")[None, :] >= lengths[:, None]
    for t in (k, v):
        t[past] = math.nan
    table = None
    if paged:
        k, v, table = paged_cache(k, v, lengths, 16, 3, g)
        keys = torch.zeros(k.shape[:2], dtype=torch.bool, device="cuda")  # (page, row) holding a key
        for b, n in enumerate(lengths.tolist()):
            pos = torch.arange(n, device="cuda")
            keys[table[b].long()[pos // 16], pos % 16] = True
        for t in (k, v):
            t[~keys] = math.nan  # spare pages and the tails of last pages
    for splits in (1, 8):
        out, lse = _call(q, k, v, lengths, table, True, 0.1, splits)
        check_kvcache(out, lse, q, k, v, lengths, table, True, 0.1, f"NaN past the lengths, splits={splits}")


@pytest.mark.gpu
def test_out_of_range_block_ids_are_masked_not_read():
    """Block ids outside [0, num_blocks) among a sequence's pages: their keys get no weight (the
    reference over the other keys, non-causal so positions do not matter); a sequence whose pages
    are all invalid sees no key."""
    g = torch.Generator().manual_seed(11)
    q = _randn(4, 1, 8, 64, dtype=torch.float16, g=g)
    k, v = _randn(2, 4, 300, 2, 64, dtype=torch.float16, g=g)
    lengths = torch.tensor([300, 150, 37, 40], dtype=torch.int32, device="cuda")
    k_cache, v_cache, table = paged_cache(k, v, lengths, 16, 0, g)
    bad = {(0, 0): -1, (0, 7): 2**31 - 1, (1, 9): len(k_cache), (2, 1): -5, (3, 0): -1, (3, 1): -1, (3, 2): len(k_cache)}
    for (b, j), page in bad.items():
        table[b, j] = page
    for splits in (1, None):
        out, lse = _call(q, k_cache, v_cache, lengths, table, False, 0.125, splits)
        for b in range(4):
            keep = [p for p in range(int(lengths[b])) if (b, p // 16) not in bad]
            check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k[b:b + 1, keep], v[b:b + 1, keep], False, 0.125,
                  f"sequence {b} with out-of-range block ids, splits={splits}")
    assert (lse[3] == -math.inf).all() and (out[3] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("paged, d, dtype", [(True, 128, torch.bfloat16), (False, 128, torch.bfloat16),
                                             (True, 64, torch.float16)], ids=["paged", "contiguous", "paged-d64"])
def test_lying_tables_and_lengths_read_only_the_cache(paged, d, dtype):
    """Block ids -1, -2^31, 2^31 - 1 and num_blocks among a sequence's pages, lengths at the int32
    extremes, negative and past the capacity (tests/support/lying_tables.py): each sequence attends to
    the keys of its valid pages up to its clamped length, the NaN canary pages and rows around the
    caches (same allocation) never reach the output, and the caches are not written."""
    lying_tables.attention_lies(paged, d, dtype, seed=int.from_bytes(os.urandom(4), "little"), canaries=2)


@pytest.mark.gpu
def test_check_raises_on_what_the_kernel_would_clamp_or_mask():
    g = torch.Generator().manual_seed(5)
    q = _randn(2, 1, 4, 128, dtype=torch.bfloat16, g=g)
    k, v = _randn(2, 2, 100, 4, 128, dtype=torch.bfloat16, g=g)
    lengths = torch.tensor([100, 20], dtype=torch.int32, device="cuda")
    k_cache, v_cache, table = paged_cache(k, v, lengths, 16, 0, g)  # garbage past each length: fine
    out, lse = rosekernels.attention_with_kvcache(q, k_cache, v_cache, lengths, table, return_lse=True, check=True)
    sync("check=True")
    check_kvcache(out, lse, q, k_cache, v_cache, lengths, table, True, 1 / math.sqrt(128), "check=True")
    holed = table.clone()
    holed[:, 1] = -1
    cases = [([100, 113], table, r"cache_seqlens\[1\] = 113 is outside \[0, 112\]"),
             ([-1, 20], table, r"cache_seqlens\[0\] = -1"),
             ([100, 17], holed, r"block_table\[0, 1\] = -1 is outside \[0, 9\)"),
             ([101, 20], None, r"cache_seqlens\[0\] = 101 is outside \[0, 100\]")]
    for n, t, match in cases:
        n = torch.tensor(n, dtype=torch.int32, device="cuda")
        cache = (k_cache, v_cache) if t is not None else (k, v)
        out = torch.full_like(q, 3.0)
        with pytest.raises(ValueError, match=match):
            rosekernels.attention_with_kvcache(q, *cache, n, t, out=out, check=True)
        assert (out == 3.0).all(), "written before the check"


@pytest.mark.gpu
def test_captures_in_a_cuda_graph_and_replays_with_new_lengths(kernels):
    """A paged launch that splits and a contiguous one that does not, captured once; each replay
    with new lengths, a new block table and new cache contents."""
    g = torch.Generator().manual_seed(3)
    q = _randn(2, 4, 32, 128, dtype=torch.bfloat16, g=g)
    k, v = _randn(2, 2, 4096, 8, 128, dtype=torch.bfloat16, g=g)
    lengths = torch.zeros(2, dtype=torch.int32, device="cuda")
    k_cache, v_cache, table = paged_cache(k, v, torch.tensor([4096, 4096]), 64, 0, g)
    q2 = _randn(48, 1, 8, 64, dtype=torch.float16, g=g)
    k2, v2 = _randn(2, 48, 300, 8, 64, dtype=torch.float16, g=g)
    lengths2 = torch.zeros(48, dtype=torch.int32, device="cuda")
    assert plan_kvcache(q, k_cache, v_cache, None, lengths, table, True, 0.1).num_splits > 1
    assert plan_kvcache(q2, k2, v2, None, lengths2, None, False, 0.1).num_splits == 1
    out, out2 = torch.empty_like(q), torch.empty_like(q2)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        rosekernels.attention_with_kvcache(q, k_cache, v_cache, lengths, table, 0.1, out=out)  # warm up
        rosekernels.attention_with_kvcache(q2, k2, v2, lengths2, None, 0.1, causal=False, out=out2)
        sync("graph warm-up")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            _, lse = rosekernels.attention_with_kvcache(q, k_cache, v_cache, lengths, table, 0.1, out=out,
                                                        return_lse=True)
            _, lse2 = rosekernels.attention_with_kvcache(q2, k2, v2, lengths2, None, 0.1, causal=False, out=out2,
                                                         return_lse=True)
    for replay, new_lengths in enumerate(([4096, 3], [0, 1], [2049, 3000])):
        lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        lengths2.copy_(_lengths(48, 300, g))
        new_k, new_v, new_table = paged_cache(*_randn(2, 2, 4096, 8, 128, dtype=torch.bfloat16, g=g),
                                              torch.tensor([4096, 4096]), 64, 0, g)
        for t, new in ((k_cache, new_k), (v_cache, new_v), (table, new_table), (q, torch.randn_like(q)),
                       (k2, torch.randn_like(k2)), (q2, torch.randn_like(q2))):
            t.copy_(new)
        for t in (out, out2, lse, lse2):
            t.fill_(math.nan)
        graph.replay()
        sync("graph replay")
        check_kvcache(out, lse, q, k_cache, v_cache, lengths, table, True, 0.1, f"graph replay {replay} (paged, split)")
        check_kvcache(out2, lse2, q2, k2, v2, lengths2, None, False, 0.1, f"graph replay {replay} (contiguous)")


@pytest.mark.gpu
def test_under_torch_compile_with_cuda_graphs(kernels):
    """attention_with_kvcache traced by torch.compile into its registered op, reduce-overhead mode
    (CUDA-graph trees), the lengths changing from call to call."""
    g = torch.Generator().manual_seed(9)
    q = _randn(3, 2, 16, 128, dtype=torch.bfloat16, g=g)
    k, v = _randn(2, 3, 5000, 4, 128, dtype=torch.bfloat16, g=g)
    k_cache, v_cache, table = paged_cache(k, v, torch.tensor([5000] * 3), 32, 4, g)

    def step(q, k_cache, v_cache, lengths, table):
        return rosekernels.attention_with_kvcache(q, k_cache, v_cache, lengths, table, return_lse=True)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for i in range(4):  # warm-up, recording, replays
        lengths = _lengths(3, 5000, g)
        q = torch.randn_like(q)
        out, lse = compiled(q, k_cache, v_cache, lengths, table)
        sync(f"torch.compile call {i}")
        check_kvcache(out.clone(), lse.clone(), q, k_cache, v_cache, lengths, table, True, 1 / math.sqrt(128),
                      f"torch.compile call {i}")


@pytest.mark.gpu
def test_opcheck(kernels):
    g = torch.Generator().manual_seed(13)
    q = _randn(2, 3, 8, 64, dtype=torch.bfloat16, g=g)
    k, v = _randn(2, 2, 100, 2, 64, dtype=torch.bfloat16, g=g)
    lengths = torch.tensor([100, 30], dtype=torch.int32, device="cuda")
    k_cache, v_cache, table = paged_cache(k, v, lengths, 16, 1, g)
    for args in ((q, k, v, lengths, None), (q, k_cache, v_cache, lengths, table)):
        out, lse = torch.empty_like(q), torch.empty(2, 8, 3, device="cuda")
        torch.library.opcheck(torch.ops.rosekernels.attention_with_kvcache.default, (*args, out, lse, True, 0.125),
                              test_utils=("test_schema", "test_faketensor"))
