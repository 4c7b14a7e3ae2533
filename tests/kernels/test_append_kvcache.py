"""rosekernels.append_kvcache (its kernel module): CPU: it compiles for sm_90a with 128-bit
copies, its plan, argument checks that raise before anything is written. GPU: against a per-token
Python reference on random paged caches (pages in random order, tables with garbage entries, positions
from before the cache to past it) and contiguous ones (a transposed strided view included): written
rows hold the new tokens, every other byte is untouched; CUDA-graph replays with new lengths,
torch.compile (one graph) and opcheck; the workload's check on sampled sizes; append-then-attend
through attention_with_kvcache."""
import dataclasses
import os

import pytest
import torch
from attention_reference import check_kvcache, paged_cache
import lying_tables
from kernel_sass import opcodes_and_global_memory
from stub_launch import stub_launches

import rosekernels
from rosekernels.kernels import append_kvcache as ka
from rosekernels.kernels import append_kvcache_plan as plan
from rosekernels.models import ModelDims
from rosekernels.ops import append_kvcache as append_op

BF16, I32 = torch.bfloat16, torch.int32


def _bits(t):
    return t.contiguous().view(torch.uint8)


# ---------------------------------------------------------------------------------------------
# CPU

@pytest.mark.parametrize("paged", [True, False])
def test_compiles_with_128_bit_copies(fresh_cache, tmp_path, paged):
    cfg = ka.Config("bf16", 128, paged, "decode", 128)
    kernel = ka.compile(cfg)
    assert kernel.variant == cfg.variant()
    found = opcodes_and_global_memory(kernel, tmp_path)
    if found is None:
        return  # nvdisasm not installed: compiled, SASS not inspected
    ops, _ = found
    assert ops.count("LDG.E.128") == 2 and ops.count("STG.E.128") == 2  # k and v, one vector each
    assert not any(o.startswith(("LDL", "STL")) for o in ops)


def test_plan_modes_candidates_and_variants():
    decode, prefill = plan.AppendShape(16, 1), plan.AppendShape(1, 4096)
    assert (decode.mode, prefill.mode) == ("decode", "prefill")
    assert plan.AppendShape(3, plan.DECODE_MAX_TOKENS).mode == "decode"
    assert plan.AppendShape(3, plan.DECODE_MAX_TOKENS + 1).mode == "prefill"
    for shape in (decode, prefill, dataclasses.replace(decode, paged=False, dtype="fp32", head_dim=64)):
        found = plan.candidates(shape)
        assert found[0] == plan.config_for(shape) and {c.threads for c in found} == set(plan.THREADS)
        for c in found:
            c.validate()
            assert plan.AppendConfig.from_variant(c.variant()) == c
    qwen = ModelDims("q", 4096, 12288, 32, 8, 128)
    got = plan.variants_for([qwen], modes=("decode",))
    assert {(c.head_dim, c.paged, c.mode) for c in got} == {(128, True, "decode"), (128, False, "decode")}
    assert plan.variants_for([dataclasses.replace(qwen, head_dim=80)]) == []
    assert len(plan.variants_for()) == len(plan.TORCH_DTYPE) * len(plan.HEAD_DIMS) * 2 * 2


def _good_args(device="cpu"):
    return dict(k_cache=torch.zeros(4, 16, 2, 64, dtype=BF16, device=device),
                v_cache=torch.zeros(4, 16, 2, 64, dtype=BF16, device=device),
                k=torch.ones(2, 1, 2, 64, dtype=BF16, device=device), v=torch.ones(2, 1, 2, 64, dtype=BF16, device=device),
                cache_seqlens=torch.zeros(2, dtype=I32, device=device),
                block_table=torch.zeros(2, 3, dtype=I32, device=device))


_BAD = [
    (lambda a: a.update(k=a["k"].float()), TypeError, "k has dtype float32"),
    (lambda a: a.update(v=a["v"][:1]), ValueError, "v has shape"),
    (lambda a: a.update(k_cache=a["k_cache"][..., :32]), ValueError, "k_cache has shape"),
    (lambda a: a.update(k=a["k"][..., :32], v=a["v"][..., :32], k_cache=a["k_cache"][..., :32],
                        v_cache=a["v_cache"][..., :32]), ValueError, "head dim 32"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"].long()), TypeError, "cache_seqlens has dtype int64"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"][:1]), ValueError, "cache_seqlens has shape"),
    (lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table has dtype int64"),
    (lambda a: a.update(block_table=a["block_table"][:1]), ValueError, "block_table has shape"),
    (lambda a: a.update(block_table=a["block_table"][:, :0]), ValueError, "at least one column"),
    (lambda a: a.update(block_table=None), ValueError, "k_cache has shape"),  # contiguous: one row per sequence
    (lambda a: a.update(k_cache=a["k_cache"][:0], v_cache=a["v_cache"][:0]), ValueError, "no rows"),
    (lambda a: a.update(k=a["k"][0]), ValueError, "4-D"),
    (lambda a: a.update(v=None), TypeError, "v must be a torch.Tensor"),
    (lambda a: a.update(k_cache=a["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "unit stride"),
    (lambda a: a.update(k=torch.ones(300, dtype=BF16)[1:257].view(2, 1, 2, 64)), ValueError, "aligned"),
    (lambda a: a.update(v_cache=torch.zeros(1, 16, 2, 64, dtype=BF16).expand(4, 16, 2, 64)), ValueError, "expanded"),
    (lambda a: a.update(v_cache=a["k_cache"]), ValueError, "v_cache must not overlap k_cache"),
    (lambda a: a.update(k=a["k_cache"][:2, :1]), ValueError, "k_cache must not overlap k"),
]


@pytest.mark.parametrize("change, exc, match", _BAD)
def test_bad_arguments_raise_before_anything_is_written(change, exc, match):
    args = _good_args()
    change(args)
    with pytest.raises(exc, match=match):
        rosekernels.append_kvcache(**args)
    for name in ("k_cache", "v_cache"):
        assert not args[name].any(), f"{name} written before the error"


def test_cpu_tensors_are_refused():
    with pytest.raises(ValueError, match="CUDA device"):
        rosekernels.append_kvcache(**_good_args())


def test_k_and_v_halves_of_one_cache_buffer_pass_the_overlap_check():
    """A cache laid out [blocks, 2, block, Hkv, d] (k and v interleaved by block, as vLLM keeps it): the halves
    share a span, not an element, so only the device is wrong here."""
    args = _good_args()
    kv = torch.zeros(args["k_cache"].shape[0], 2, *args["k_cache"].shape[1:], dtype=args["k_cache"].dtype)
    args.update(k_cache=kv[:, 0], v_cache=kv[:, 1])
    with pytest.raises(ValueError, match="CUDA device"):
        rosekernels.append_kvcache(**args)


def test_a_planned_signature_still_refuses_caches_overlapping_each_other_or_an_input(monkeypatch):
    """The plan key holds shapes and strides, not addresses: a later call of the signature whose caches overlap
    each other or an input is refused with nothing launched, and an input of new strides (k reaching into
    v_cache, where a contiguous k of its shape would end before k_cache) is measured by its own (CPU: the
    launch stubbed)."""
    launches = stub_launches(monkeypatch, ka, append_op)
    args = _good_args()
    rosekernels.append_kvcache(**args)
    assert len(launches) == 1
    mem = torch.zeros(2 * 4 * 16 * 2 * 64 + 512, dtype=BF16)
    caches = mem[256:256 + 2 * 8192].view(2, 4, 16, 2, 64)
    k_cache, v_cache = caches[0], caches[1]
    rosekernels.append_kvcache(**{**args, "k_cache": k_cache, "v_cache": v_cache})
    assert len(launches) == 2
    shifted = mem[256 + 128:256 + 128 + 8192].view(4, 16, 2, 64)  # one row into k_cache, the same strides
    in_cache = mem[512:512 + 256].view(2, 1, 2, 64)
    far_k = mem.as_strided((2, 1, 2, 64), (9000, 128, 64, 1))  # its second row inside v_cache
    for change, match in ((dict(v_cache=shifted), "v_cache must not overlap k_cache"),
                          (dict(k=in_cache), "k_cache must not overlap k"),
                          (dict(v=in_cache), "k_cache must not overlap v"),
                          (dict(cache_seqlens=k_cache.view(I32).view(-1)[:2]), "k_cache must not overlap cache_seqlens"),
                          (dict(block_table=v_cache.view(I32).view(-1)[:6].view(2, 3)),
                           "v_cache must not overlap block_table"),
                          (dict(k=far_k), "must not overlap k")):
        with pytest.raises(ValueError, match=match):
            rosekernels.append_kvcache(**{**args, "k_cache": k_cache, "v_cache": v_cache, **change})
    assert len(launches) == 2


def test_exported():
    assert rosekernels.append_kvcache is append_op.append_kvcache


# ---------------------------------------------------------------------------------------------
# GPU

def _guarded(cache):
    """`cache` copied into the middle of a buffer one row and one block (or sequence) larger on each
    side, in the same dimension order: a strided view whose guard rows show any write past its edges."""
    order = sorted(range(cache.dim()), key=lambda i: -cache.stride(i))  # keep its layout (a transposed view)
    size = [n + 2 if i < 2 else n for i, n in enumerate(cache.shape)]
    buffer = torch.randn([size[i] for i in order], dtype=cache.dtype, device=cache.device)
    buffer = buffer.permute([order.index(i) for i in range(cache.dim())])
    view = buffer[1:-1, 1:-1]
    view.copy_(cache)
    return buffer, view


def _check(case):
    """Append `case` into guarded copies of its caches: the caches equal the per-token reference and
    every guard byte is unchanged. Returns the copies the op wrote."""
    (kb, kc), (vb, vc) = _guarded(case[0]), _guarded(case[1])
    case = (kc, vc, *case[2:])
    before = (kb.clone(), vb.clone())
    want = ka.reference(*case)
    rosekernels.append_kvcache(*case)
    for got, ref in zip(case[:2], want):
        assert torch.equal(_bits(got.cpu()), _bits(ref)), "a written row differs, or another row changed"
    written = [c.clone() for c in case[:2]]  # the guard check below puts the old rows back
    for buffer, old in zip((kb, vb), before):
        buffer[1:-1, 1:-1] = old[1:-1, 1:-1]
        assert torch.equal(_bits(buffer), _bits(old)), "a write left the cache"
    return written


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("paged", [True, False])
def test_append_matches_the_reference_and_touches_nothing_else(dtype, paged):
    g = torch.Generator().manual_seed(1)
    sizes = [(1, 1, 8, 128, 16), (33, 1, 8, 128, 64), (7, 4, 2, 64, 16), (3, 16, 1, 256, 1), (4, 3, 5, 64, 5),
             (2, 40, 3, 128, 16)]
    for batch, new_tokens, heads, d, block_size in sizes:
        _check(ka.random_case(g, batch, new_tokens, heads, d, dtype, paged, block_size,
                              max_blocks=-(-(new_tokens + 40) // block_size)))


@pytest.mark.gpu
def test_contiguous_append_into_a_transposed_cache_view():
    g = torch.Generator().manual_seed(5)
    B, S_max, Hkv, d, S_new = 4, 9, 2, 64, 3
    lengths = torch.tensor([0, 7, 9, -1], dtype=I32).cuda()  # ends past the cache, starts past it, starts before
    k, v = (torch.randn(B, S_new, Hkv, d, generator=g).to(BF16).cuda() for _ in range(2))
    # transformers' static cache is [B, Hkv, S_max, d]: its transpose is a strided [B, S_max, Hkv, d] view.
    caches = [torch.randn(B, Hkv, S_max, d, generator=g).to(BF16).cuda().transpose(1, 2) for _ in range(2)]
    written = _check((*caches, k, v, lengths, None))[0]
    assert torch.equal(written[1, 7:], k[1, :2]) and torch.equal(written[0, :3], k[0])


@pytest.mark.gpu
def test_no_token_written_leaves_the_cache_as_it_was():
    g = torch.Generator().manual_seed(6)
    caches = [torch.randn(3, 4, 1, 64, generator=g).to(BF16).cuda() for _ in range(2)]
    before = [c.clone() for c in caches]
    table = torch.tensor([[-1, 3], [2, 2**31 - 1]], dtype=I32).cuda()
    k, v = (torch.randn(2, 5, 1, 64, generator=g).to(BF16).cuda() for _ in range(2))
    # Sequence 0: columns 0 and 1 (blocks -1 and 3 = num_blocks); sequence 1: column 1 (2^31 - 1), then past the table.
    rosekernels.append_kvcache(*caches, k, v, torch.tensor([1, 4], dtype=I32).cuda(), table)
    for got, ref in zip(caches, before):
        assert torch.equal(_bits(got), _bits(ref))


@pytest.mark.gpu
def test_append_in_a_cuda_graph_replays_with_new_lengths():
    g = torch.Generator().manual_seed(9)
    case = ka.random_case(g, 6, 2, 8, 64, BF16, True, 16, 4)
    caches, k, v, lengths, table = case[:2], case[2], case[3], case[4], case[5]
    rosekernels.append_kvcache(*case)  # plan outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rosekernels.append_kvcache(*case)
    for _ in range(4):
        new = ka.random_case(g, 6, 2, 8, 64, BF16, True, 16, 4)
        for dst, src in zip((k, v, lengths, table), new[2:]):
            dst.copy_(src)
        want = ka.reference(*case)
        graph.replay()
        for got, ref in zip(caches, want):
            assert torch.equal(_bits(got.cpu()), _bits(ref))


@pytest.mark.gpu
def test_torch_compile_makes_one_graph_and_opcheck_passes():
    g = torch.Generator().manual_seed(11)
    case = ka.random_case(g, 3, 2, 2, 64, BF16, True, 16, 3)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    want = ka.reference(*case)
    torch.compile(rosekernels.append_kvcache, backend=backend, fullgraph=True)(*case)
    assert len(graphs) == 1
    for got, ref in zip(case[:2], want):
        assert torch.equal(_bits(got.cpu()), _bits(ref))
    torch.library.opcheck(torch.ops.rosekernels.append_kvcache.default, case)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("paged", [True, False])
def test_workloads_check_their_kernels(mode, paged):
    shape = dataclasses.replace(plan.AppendShape.defaults(mode), paged=paged, head_dim=64)
    for cfg in plan.candidates(shape)[:2]:
        w = ka.workload(cfg, shape)
        for seed in range(3):
            args = w.sample(seed)
            w.run(w.kernel.fn, args)
            w.check(args)


@pytest.mark.gpu
def test_strided_views_and_extreme_lengths():
    """k and v as slices of a fused projection buffer (the caches are strided views in _check),
    lengths of -2^31 and 2^31 - 1 (their positions wrap or run past the table: skipped); the plan of
    one call serves calls of other strides with the same shapes."""
    g = torch.Generator().manual_seed(12)
    B, S_new, Hkv, d, bs, max_blocks = 5, 3, 4, 128, 16, 3
    k_cache, v_cache, k, v, lengths, table = ka.random_case(g, B, S_new, Hkv, d, BF16, True, bs, max_blocks)
    fused = torch.randn(B, S_new, 3 * Hkv, d, generator=g).to(BF16).cuda()
    lengths[:2] = torch.tensor([-2**31, 2**31 - 1], dtype=I32)
    _check((k_cache, v_cache, fused[:, :, :Hkv], fused[:, :, Hkv:2 * Hkv], lengths, table))
    _check((k_cache, v_cache, k, v, lengths, table))
    _check((k_cache, v_cache, fused[:, :, Hkv:2 * Hkv], fused[:, :, 2 * Hkv:], lengths, table))


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_lying_tables_and_lengths_write_only_the_cache(paged):
    """Every lie at once (tests/support/lying_tables.py: ids -1, -2^31, 2^31 - 1 and num_blocks among
    a sequence's pages; lengths at the int32 extremes, negative and past the table), two canary pages
    and rows on each side of the caches in one allocation: the caches as the reference, every canary
    byte unchanged."""
    lying_tables.append_lies(paged, seed=int.from_bytes(os.urandom(4), "little"), canaries=2)


@pytest.mark.gpu
def test_bad_arguments_on_a_planned_signature_raise_and_write_nothing():
    """After a good call has planned the signature, calls with the same shapes but bad tensors go
    through the fast path: the compiled host code or the kernel's own guards must refuse them."""
    g = torch.Generator().manual_seed(13)
    case = ka.random_case(g, 4, 1, 2, 64, BF16, True, 16, 3)
    rosekernels.append_kvcache(*case)
    caches = [c.clone() for c in case[:2]]
    k_cache, v_cache, k, v, lengths, table = case
    misaligned = torch.empty(k.numel() + 8, dtype=BF16, device="cuda")[1:k.numel() + 1].view(k.shape)
    for bad, match in ((dict(cache_seqlens=lengths.cpu()), "CUDA device|device"),
                       (dict(v_cache=v_cache[:1].expand(v_cache.shape)), "expanded"),
                       (dict(cache_seqlens=lengths.long()), "int64|dtype"),
                       (dict(k=misaligned), "aligned"),
                       (dict(block_table=table[:3]), "block_table has shape")):
        args = {**dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=lengths, block_table=table), **bad}
        with pytest.raises((ValueError, TypeError), match=match):
            rosekernels.append_kvcache(**args)
    # A table of no columns: refused by the compiled host code, or else the kernel reads no table
    # entry and writes nothing (the full checks do not run on the fast path).
    try:
        rosekernels.append_kvcache(k_cache, v_cache, k, v, lengths, table[:, :0])
    except ValueError as e:
        assert "at least one column" in str(e)
    torch.cuda.synchronize()
    for got, ref in zip((k_cache, v_cache), caches):
        assert torch.equal(_bits(got), _bits(ref)), "written by a refused call"


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
    rosekernels.append_kvcache(k_cache, v_cache, k_new, v_new, lengths, table)
    lengths += 1
    q = torch.randn(B, 1, Hq, d, generator=g).to(BF16).cuda()
    out, lse = rosekernels.attention_with_kvcache(q, k_cache, v_cache, lengths, table, return_lse=True)
    for b in range(B):
        dense[0][b, int(lengths[b]) - 1], dense[1][b, int(lengths[b]) - 1] = k_new[b, 0], v_new[b, 0]
    check_kvcache(out, lse, q, *dense, lengths.cpu(), None, True, d ** -0.5, "append then attend")
