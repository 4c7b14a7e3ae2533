"""rosekernels.attention_varlen: the varlen variants of the prefill kernel compile with O stored row by
row and leave the dense kernels' cubins as they were (CPU), argument and length checks (CPU), tracing
into the registered op (CPU); numerics against a float64 reference per sequence on random lengths (0
and 1 included, q and k lengths apart, GQA, both head dims and dtypes, causal and not), bitwise equality
with the dense kernel on equal lengths, rows outside every sequence never written, garbage cumulative
lengths kept inside the tensors, CUDA-graph replays with new lengths, torch.compile, opcheck (GPU)."""
import dataclasses
import math
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from attention_reference import (check, refuses_an_out_overlapping_k_or_v, refuses_an_out_whose_elements_overlap,
                                 sync)
from kernel_sass import sass_of

import rosekernels
from rosekernels import checks
from rosekernels.kernels import attention as A
from rosekernels.ops import varlen
from rosekernels.ops.varlen import VarlenLaunch, check_lengths

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CPU_CONFIGS = [A.varlen_config(128, "bf16", True, 4096), A.varlen_config(64, "fp16", False, 4096)]
# O from registers (direct_o), against the same tiles through the slab.
DIRECT_PAIRS = [(dataclasses.replace(c, direct_o=True), c) for c in (
    A.AttentionConfig(128, "bf16", False, tile_n=144, varlen=True), A.varlen_config(64, "bf16", True, 1))]


@pytest.fixture(scope="module")
def cpu_kernels():
    return dict(zip(CPU_CONFIGS, A.precompile(CPU_CONFIGS)))


@pytest.fixture(scope="module")
def kernels():
    """What the GPU tests launch: every head dim, dtype, causality and key-tile choice, varlen and
    dense (for the bitwise comparison), compiled in parallel."""
    varlen = A.varlen_variants_for()
    return A.precompile(varlen + [dataclasses.replace(c, varlen=False) for c in varlen] +
                        [c for pair in DIRECT_PAIRS for c in pair])


# ---------------------------------------------------------------------------------------------
# CPU


def test_varlen_variants_store_o_row_by_row(cpu_kernels, tmp_path):
    for cfg, k in cpu_kernels.items():
        sass = sass_of(k, tmp_path)
        if sass is None:
            pytest.skip("nvdisasm is not installed")
        assert not re.search(r"\bUTMASTG\b", sass), f"{cfg}: a TMA store of 64 rows would cross into the next sequence"
        # The slab's rows: 16-byte shared-memory reads and global stores, 64 * d / 8 / 128 per thread.
        per_thread = 64 * cfg.head_dim // 8 // 128
        assert len(re.findall(r"\bSTG\.E\.128\b", sass)) == per_thread, cfg
        assert len(re.findall(r"\bLDS\.128\b", sass)) == per_thread, cfg


def test_varlen_keys_and_dense_keys():
    dense = A.default_config(128, "bf16", True)
    varlen = A.varlen_config(128, "bf16", True, 100)
    assert "varlen" not in dense.variant().key() and varlen.variant().key().endswith("varlen=True")
    assert A.AttentionConfig.from_variant(varlen.variant()) == varlen
    assert A.AttentionConfig.from_variant(dense.variant()) == dense
    # d = 128 non-causal takes the long key tiles from the longest sequence on, as the dense kernel.
    assert A.varlen_config(128, "bf16", False, A.LONG_KV).tile_n == 192
    assert {c.varlen for c in A.varlen_variants_for()} == {True}
    # The dense set less the 128-row d=64 tiles (a varlen launch does not size its grid by the wave model).
    assert {dataclasses.replace(c, varlen=False) for c in A.varlen_variants_for()} == \
        {c for c in A.variants_for() if c.tile_m == 192 or c.head_dim == 128}
    with pytest.raises(ValueError, match="no workload"):
        A.workload(varlen, A.AttentionShape(causal=True))


def test_registered_op_schema():
    schema = str(torch.ops.rosekernels.attention_varlen_fwd.default._schema)
    for arg in ("Tensor(a3!) out", "Tensor(a4!) lse", "Tensor cu_seqlens_q", "SymInt max_seqlen_q", "bool causal"):
        assert arg in schema, schema


def test_traces_into_its_registered_op_under_torch_compile():
    mode = FakeTensorMode()
    with mode:
        q = torch.empty(300, 16, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(500, 4, 128, device="cuda", dtype=torch.bfloat16)
        cu_q = torch.empty(4, device="cuda", dtype=torch.int32)
        cu_k = torch.empty(4, device="cuda", dtype=torch.int32)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    step = torch.compile(lambda q, k, cu_q, cu_k: rosekernels.attention_varlen(q, k, k, cu_q, cu_k, 200, 300,
                                                                                causal=True, return_lse=True),
                         backend=backend, fullgraph=True)
    with mode:
        out, lse = step(q, k, cu_q, cu_k)
    assert out.shape == q.shape and lse.shape == (16, 300)
    assert len(graphs) == 1 and graphs[0].count("torch.ops.rosekernels.attention_varlen_fwd(") == 1


def _cpu(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


def _args(**change):
    """Valid arguments but on the CPU (so every call below fails in the checks, before a launch)."""
    args = dict(q=_cpu(40, 8, 64), k=_cpu(50, 2, 64), v=_cpu(50, 2, 64),
                cu_seqlens_q=torch.tensor([0, 10, 40], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 20, 50], dtype=torch.int32), max_seqlen_q=30, max_seqlen_k=30)
    args.update(change)
    return args


@pytest.mark.parametrize("change, exc, match", [
    (dict(q=_cpu(40, 8, 2, 64)), ValueError, r"q must be 3-D \[tokens, heads, head_dim\]"),
    (dict(q=_cpu(40, 8, 64, dtype=torch.float32)), TypeError, "q has dtype float32"),
    (dict(k=_cpu(50, 2, 64, dtype=torch.float16)), TypeError, "k has dtype float16"),
    (dict(q=_cpu(40, 8, 96), k=_cpu(50, 2, 96), v=_cpu(50, 2, 96)), ValueError, "head_dim must be 64 or 128"),
    (dict(v=_cpu(49, 2, 64)), ValueError, "v has shape"),
    (dict(k=_cpu(50, 3, 64), v=_cpu(50, 3, 64)), ValueError, "multiple of the KV heads"),
    (dict(k=_cpu(0, 2, 64), v=_cpu(0, 2, 64)), ValueError, "at least one key"),
    (dict(cu_seqlens_q=torch.tensor([0, 10, 40])), TypeError, "cu_seqlens_q has dtype int64"),
    (dict(cu_seqlens_q=torch.tensor([40], dtype=torch.int32)), ValueError, r"\[batch \+ 1\]"),
    (dict(cu_seqlens_q=torch.tensor([[0, 10, 40]], dtype=torch.int32)), ValueError, r"\[batch \+ 1\]"),
    (dict(cu_seqlens_k=torch.tensor([0, 50], dtype=torch.int32)), ValueError, "same length"),
    (dict(cu_seqlens_q=torch.tensor([0, 0, 10, 0, 40, 0], dtype=torch.int32)[::2]), ValueError, "contiguous"),
    (dict(max_seqlen_q=0), ValueError, "longest sequence"),
    (dict(max_seqlen_k=-1), ValueError, "non-negative int"),
    (dict(max_seqlen_q=30.0), ValueError, "non-negative int"),
    (dict(cu_seqlens_q=[0, 10, 40]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    (dict(softmax_scale=1e39), ValueError, "softmax_scale"),  # scale * log2(e) is inf in fp32
    # 2^31 - 4096 query tiles: the persistent CTAs' next-tile index would wrap past 2^31
    (dict(q=_cpu(40, 512, 64), cu_seqlens_q=torch.zeros(2**22 - 7, dtype=torch.int32),
          cu_seqlens_k=torch.zeros(2**22 - 7, dtype=torch.int32)), ValueError, "32 bits"),
    (dict(), ValueError, "CUDA"),
])
def test_invalid_arguments_raise_before_anything_is_written(change, exc, match):
    args = _args(**change)
    q = args["q"]
    out = torch.full(q.shape if q.dim() == 3 else (1, 1, 64), 7.0).to(q.dtype)
    before = out.clone()
    with pytest.raises(exc, match=match):
        rosekernels.attention_varlen(**args, out=out)
    assert torch.equal(out, before)


def test_the_out_the_op_allocates_is_held_to_the_span_limit(monkeypatch):
    """out=None: the op allocates out contiguous, so it spans more than a q whose heads overlap (a
    legal input); past 2^31 elements it is refused, as the same out passed in is."""
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)  # meta tensors stand in for CUDA ones
    meta = lambda shape, stride: torch.empty_strided(shape, stride, device="meta", dtype=torch.bfloat16)  # noqa: E731
    q = meta((2**21, 16, 128), (128, 8, 1))  # heads 8 elements apart: 2^28 elements, out 2^32
    kv = meta((8192, 4, 128), (512, 128, 1))
    cu = torch.empty(2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"out \(allocated contiguous in q's shape\) spans 2\^31"):
        rosekernels.attention_varlen(q, kv, kv, cu, cu, 2**21, 8192)
    with pytest.raises(ValueError, match=r"out spans 2\^31"):
        rosekernels.attention_varlen(q, kv, kv, cu, cu, 2**21, 8192, out=torch.empty(q.shape, device="meta",
                                                                                      dtype=q.dtype))


def test_an_out_whose_elements_overlap_is_refused(monkeypatch):
    """Rows of out 8 elements apart (as_strided): refused before anything is written."""
    call = lambda out: rosekernels.attention_varlen(**_args(), out=out)  # noqa: E731
    refuses_an_out_whose_elements_overlap(monkeypatch, call, (40, 8, 64), (8, 8, 1))


def test_an_out_overlapping_k_or_v_is_refused_also_by_a_cached_plan(monkeypatch):
    """Other CTAs read K and V while one writes out: an out overlapping either is refused before
    anything is written, on a new signature and on one already planned (the key holds no pointers);
    out = q is not refused."""
    args = _args()
    q, _, v = (args.pop(name) for name in ("q", "k", "v"))
    call = lambda q, k, v, out: rosekernels.attention_varlen(q, k, v, **args, out=out)  # noqa: E731
    refuses_an_out_overlapping_k_or_v(monkeypatch, varlen, "VarlenLaunch", call, q, v, ("k", "v"))


@pytest.mark.parametrize("cu, match", [
    ([1, 10, 40], r"\[0\] must be 0"),
    ([0, 30, 20], "decreases at 2: 30 then 20"),
    ([0, 10, 41], "past the 40 packed tokens"),
    ([0, 5, 40], "sequence 1 is 35 long"),
])
def test_check_lengths_names_what_is_wrong(cu, match):
    with pytest.raises(ValueError, match=match):
        check_lengths(torch.tensor(cu, dtype=torch.int32), 40, 30, "cu_seqlens_q")
    check_lengths(torch.tensor([0, 10, 40], dtype=torch.int32), 40, 30, "cu_seqlens_q")  # a valid one passes


# ---------------------------------------------------------------------------------------------
# GPU


def _packed(lengths, heads, d, dtype, g, spare=0):
    """[sum(lengths) + spare, heads, d] random tokens and their int32 cumulative lengths (cuda)."""
    cu = torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)
    x = torch.randn(int(cu[-1]) + spare, heads, d, generator=g).to(dtype).cuda()
    return x, cu.cuda()


def _check(out, lse, q, k, v, cu_q, cu_k, causal, scale, what):
    """Each sequence against the float64 reference of the dense layout [1, S, H, d]."""
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if qe == qs:
            continue
        if ke == ks:  # no key: out 0, lse -inf
            assert (out[qs:qe] == 0).all() and (lse[:, qs:qe] == -math.inf).all(), f"{what}: sequence {b}"
            continue
        check(out[None, qs:qe], lse[None, :, qs:qe], q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], causal, scale,
              f"{what}: sequence {b} ({qe - qs} queries, {ke - ks} keys)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
def test_matches_float64_reference(kernels, d, dtype):
    """Random batches with lengths 0, 1 and past one tile among random ones, q and k lengths apart
    (so causal rows see keys bottom-right), GQA ratios 1, 4, 8; out and lse NaN-filled, with spare
    rows past the last sequence that must stay NaN."""
    g = torch.Generator().manual_seed(d + len(dtype))
    tdtype = DTYPES[dtype]
    scale = 1.0 / math.sqrt(d)
    for i, (hq, hkv) in enumerate(((4, 4), (8, 2), (16, 2))):
        for causal in (False, True):
            batch = 5 + i
            len_q = [0, 1, 200] + torch.randint(1, 600, (batch - 3,), generator=g).tolist()
            len_k = [5, 300, 1] + [n + int(torch.randint(0, 300, (1,), generator=g)) for n in len_q[3:]]
            order = torch.randperm(batch, generator=g).tolist()
            len_q, len_k = [len_q[j] for j in order], [len_k[j] for j in order]
            q, cu_q = _packed(len_q, hq, d, tdtype, g, spare=37)
            k, cu_k = _packed(len_k, hkv, d, tdtype, g)
            v, _ = _packed(len_k, hkv, d, tdtype, g)
            out = torch.full_like(q, math.nan)
            res, lse = rosekernels.attention_varlen(q, k, v, cu_q, cu_k, max(len_q), max(len_k), causal=causal,
                                                    softmax_scale=scale, out=out, return_lse=True, check=True)
            sync(f"varlen d={d} {dtype} heads {hq}/{hkv} causal={causal}")
            assert res is out and lse.shape == (hq, q.shape[0])
            _check(out, lse, q, k, v, cu_q.cpu(), cu_k.cpu(), causal, scale,
                   f"d={d} {dtype} heads {hq}/{hkv} causal={causal}")
            total = int(cu_q[-1])
            assert out[total:].isnan().all(), "a row outside every sequence was written"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_equal_lengths_match_the_dense_kernel_bitwise(kernels, causal):
    """Sequences of one length packed: the same tiles, the same arithmetic as the dense kernel on
    [B, S, H, d] (S not a multiple of the tiles: ragged last tiles included)."""
    g = torch.Generator().manual_seed(21 + causal)
    for d, s in ((128, 1000), (64, 333)):
        q = torch.randn(3, s, 16, d, generator=g).to(torch.bfloat16).cuda()
        k, v = (torch.randn(3, s, 4, d, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
        cu = torch.arange(0, 4 * s, s, dtype=torch.int32, device="cuda")
        dense, dense_lse = rosekernels.attention(q, k, v, causal=causal, return_lse=True)
        out, lse = rosekernels.attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, s, s,
                                                causal=causal, return_lse=True)
        sync(f"equal lengths d={d}")
        assert torch.equal(out.view(q.shape), dense), f"d={d}: out differs from the dense kernel's"
        assert torch.equal(lse.view(16, 3, s).transpose(0, 1), dense_lse), f"d={d}: lse differs"


@pytest.mark.gpu
@pytest.mark.parametrize("pair", DIRECT_PAIRS, ids=lambda p: p[0].variant().key().split("sm_90a-")[1])
def test_direct_o_stores_the_slab_paths_bytes_and_nothing_outside_the_sequences(kernels, pair):
    """O from registers, row-predicated per sequence: bitwise what the slab path stores, on ragged
    lengths (0, 1, and ends inside a 64-row slab), and the spare rows past the last sequence stay NaN."""
    g = torch.Generator().manual_seed(11)
    len_q, len_k = [70, 0, 1, 333, 129], [90, 5, 1, 400, 129]
    q, cu_q = _packed(len_q, 8, pair[0].head_dim, torch.bfloat16, g, spare=41)
    k, cu_k = _packed(len_k, 2, pair[0].head_dim, torch.bfloat16, g)
    v, _ = _packed(len_k, 2, pair[0].head_dim, torch.bfloat16, g)
    results = []
    for cfg in pair:
        out, lse = torch.full_like(q, math.nan), torch.full((8, q.shape[0]), math.nan, device="cuda")
        VarlenLaunch(cfg, q, len(len_q), max(len_q), max(len_k), 0.1).launch(q, k, v, out, lse, cu_q, cu_k)
        sync(str(cfg))
        total = sum(len_q)
        assert out[total:].isnan().all(), f"{cfg} wrote a row outside every sequence"
        results.append((out[:total], lse[:, :total]))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.gpu
def test_garbage_lengths_stay_inside_the_tensors(kernels):
    """Cumulative lengths that decrease, run past the tokens, go negative or overflow a length
    (2^31 - 1 then -2^31), with max_seqlen_q shorter than what they claim: q and out are views inside
    larger buffers, and out's NaN margins must come back untouched (compute-sanitizer memcheck runs
    the same kernel in test_sanitizer_gpu.py)."""
    g = torch.Generator().manual_seed(5)
    hq, d, total = 8, 128, 400
    q_buf = torch.randn(total + 256, hq, d, generator=g).to(torch.bfloat16).cuda()
    k = torch.randn(300, 2, d, generator=g).to(torch.bfloat16).cuda()
    out_buf = torch.full_like(q_buf, math.nan)
    q, out = q_buf[128:128 + total], out_buf[128:128 + total]
    cases = (([0, 300, 100, 5000], [0, 100, 200, 300]),  # decreasing, then past the tokens
             ([0, 350, 5000, 5000], [0, 100, 200, 300]),  # a sequence from row 350 through 256 rows
             ([-50, 10, 390, 400], [-7, 100, 9999, 250]),  # negative starts; keys past k and decreasing
             ([0, 2**31 - 1, -2**31, 400], [0, 2**31 - 1, -2**31, 300]))  # lengths that overflow
    for cu_q, cu_k in cases:
        rosekernels.attention_varlen(q, k, k, torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
                                     torch.tensor(cu_k, dtype=torch.int32, device="cuda"), 256, 300, out=out)
        sync(f"cu_seqlens_q {cu_q}, cu_seqlens_k {cu_k}")
        assert out_buf[:128].isnan().all() and out_buf[128 + total:].isnan().all(), f"{cu_q}: out margin written"
    # Without the clamps, the second case alone would write rows 400-605 of out: into the margin and past it.


@pytest.mark.gpu
def test_long_keys_take_the_192_key_tiles_with_direct_o(kernels):
    """d = 128 non-causal from LONG_KV keys on: the dense heuristic's 192-key tiles with O stored from
    registers, row by row within each sequence, ragged ends."""
    g = torch.Generator().manual_seed(17)
    len_q, len_k = [100, 5, 300], [A.LONG_KV + 77, 9000, 1]
    cfg = A.varlen_config(128, "bf16", False, max(len_k))
    assert (cfg.tile_n, cfg.direct_o) == (192, True)
    q, cu_q = _packed(len_q, 8, 128, torch.bfloat16, g)
    k, cu_k = _packed(len_k, 2, 128, torch.bfloat16, g)
    v, _ = _packed(len_k, 2, 128, torch.bfloat16, g)
    out, lse = rosekernels.attention_varlen(q, k, v, cu_q, cu_k, max(len_q), max(len_k), return_lse=True)
    sync("192-key tiles")
    _check(out, lse, q, k, v, cu_q.cpu(), cu_k.cpu(), False, 1 / math.sqrt(128), "192-key tiles")


@pytest.mark.gpu
def test_captures_in_a_cuda_graph_and_replays_with_new_lengths(kernels):
    g = torch.Generator().manual_seed(8)
    hq, hkv, d, total = 16, 4, 128, 3000
    q = torch.randn(total, hq, d, generator=g).to(torch.bfloat16).cuda()
    k, v = (torch.randn(total, hkv, d, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
    cu = torch.tensor([0, 1000, 2000, 3000], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        rosekernels.attention_varlen(q, k, v, cu, cu, 2000, 2000, causal=True, out=out)  # warm up
        sync("graph warm-up")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            _, lse = rosekernels.attention_varlen(q, k, v, cu, cu, 2000, 2000, causal=True, out=out, return_lse=True)
    for replay, lengths in enumerate(([1000, 1000, 1000], [2000, 1, 999], [0, 1500, 1500])):
        cu.copy_(torch.tensor([0] + lengths).cumsum(0).to(torch.int32))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        out.fill_(math.nan)
        graph.replay()
        sync("graph replay")
        _check(out, lse, q, k, v, cu.cpu(), cu.cpu(), True, 1 / math.sqrt(d), f"graph replay {replay}")


@pytest.mark.gpu
def test_under_torch_compile(kernels):
    g = torch.Generator().manual_seed(10)
    lengths = [700, 1, 0, 129]
    q, cu = _packed(lengths, 8, 64, torch.float16, g)
    k, _ = _packed(lengths, 8, 64, torch.float16, g)

    def step(q, k, cu):
        return rosekernels.attention_varlen(q, k, k, cu, cu, 700, 700, causal=True, return_lse=True)

    compiled = torch.compile(step, fullgraph=True)
    out, lse = compiled(q, k, cu)
    sync("torch.compile")
    _check(out, lse, q, k, k, cu.cpu(), cu.cpu(), True, 1 / 8, "torch.compile")


@pytest.mark.gpu
def test_opcheck(kernels):
    g = torch.Generator().manual_seed(13)
    q, cu = _packed([100, 30], 8, 64, torch.bfloat16, g)
    k, _ = _packed([100, 30], 2, 64, torch.bfloat16, g)
    out, lse = torch.empty_like(q), torch.empty(8, q.shape[0], device="cuda")
    torch.library.opcheck(torch.ops.rosekernels.attention_varlen_fwd.default,
                          (q, k, k, out, lse, cu, cu, 100, 100, True, 0.125),
                          test_utils=("test_schema", "test_faketensor"))
