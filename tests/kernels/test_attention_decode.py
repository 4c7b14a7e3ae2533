"""Split-KV decode attention: every specialization compiles to an mma.sync/TMA kernel (CPU), the
workload and argument checks (CPU), numerics against a float64 reference on fresh random inputs,
the split/combine paths, the attention() dispatch, CUDA graphs and torch.compile (GPU). Configs and
split counts: test_attention_plan.py."""
import math
import re

import pytest
import torch
from attention_reference import decode_sass, check, inputs, sync

import rosekernels
from rosekernels import scratch
from rosekernels.kernels import attention_decode as D
import rosekernels.ops.attention  # noqa: F401  (registers torch.ops.rosekernels.attention_decode)


@pytest.fixture(scope="module")
def kernels():
    """Every specialization compiled (in parallel processes when the disk cache is cold)."""
    configs = D.variants_for()
    return dict(zip(configs, D.precompile(configs)))


# ---------------------------------------------------------------------------------------------
# CPU


def test_every_specialization_compiles_to_an_mma_sync_tma_kernel(kernels, tmp_path):
    for cfg, k in kernels.items():
        sass = decode_sass(cfg, k, tmp_path)
        # One K/V tile per loop pass: each warp's S = Q K^T over its keys and O += P V.
        keys = cfg.tile_n // cfg.key_slices
        per_tile = keys // 8 * cfg.head_dim // 16 + cfg.head_dim // 8 * keys // 16
        assert len(re.findall(r"\bHMMA\.16816", sass)) == per_tile, cfg
        assert len(re.findall(r"\bLDSM\.16\.MT88", sass)) > 0, f"{cfg}: V is not read with ldmatrix.trans"


def test_pdl_switch_is_a_launch_attribute(kernels):
    """DecodeConfig(pdl=False): its own variant (the key names it only when off), the same cubin (the
    kernel waits for the previous one either way; only the launch attribute differs)."""
    on = D.DecodeConfig(128, "bf16", tile_m=16)
    off = D.DecodeConfig(128, "bf16", tile_m=16, pdl=False)
    assert "pdl" not in on.variant().key() and "pdl=False" in off.variant().key()
    assert D.compile(off).cubin_sha256 == kernels[on].cubin_sha256


def test_workload_runs_the_given_config_and_refuses_a_shape_it_does_not_serve(kernels):
    shape = D.Shape.defaults("decode")
    cfg = D.DecodeConfig(128, "bf16", tile_m=64, splits=2)  # not config_for's pick (16 rows hold the 4)
    assert D.workload(cfg, shape).kernel.variant == cfg.variant()
    with pytest.raises(ValueError, match="does not serve"):
        D.workload(cfg, D.Shape(head_dim=64))


def _cpu(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: (_cpu(2, 1, 4, 64)[0], _cpu(2, 16, 4, 64), _cpu(2, 16, 4, 64), {}), ValueError, "4-D"),
    (lambda: (_cpu(2, 1, 4, 64, dtype=torch.float32),) + (_cpu(2, 16, 4, 64),) * 2 + ({},), TypeError, "dtype"),
    (lambda: (_cpu(2, 1, 4, 96), _cpu(2, 16, 4, 96), _cpu(2, 16, 4, 96), {}), ValueError, "head_dim"),
    (lambda: (_cpu(2, 1, 6, 64), _cpu(2, 16, 4, 64), _cpu(2, 16, 4, 64), {}), ValueError, "multiple"),
    (lambda: (_cpu(2, 1, 4, 64), _cpu(2, 0, 4, 64), _cpu(2, 0, 4, 64), {}), ValueError, "at least one key"),
    (lambda: (_cpu(2, 1, 4, 64), _cpu(2, 16, 4, 64), _cpu(2, 16, 4, 64), dict(softmax_scale=0.0)),
     ValueError, "softmax_scale"),
    (lambda: (_cpu(2, 1, 4, 64), _cpu(2, 16, 4, 64), _cpu(2, 16, 4, 64), dict(softmax_scale=1e39)),
     ValueError, "softmax_scale"),  # scale * log2(e) is inf in fp32
    (lambda: (_cpu(2, 1, 4, 64), _cpu(2, 16, 4, 64), _cpu(2, 16, 4, 64), {}), ValueError, "CUDA"),
])
@pytest.mark.parametrize("entry", ["attention", "attention_decode"])
def test_invalid_arguments_raise_before_anything_is_written(make, exc, match, entry):
    q, k, v, kwargs = make()
    out = kwargs.setdefault("out", torch.full(q.shape if q.dim() == 4 else (1, 1, 1, 64), 7.0).to(q.dtype))
    before = out.clone()
    fn = rosekernels.attention if entry == "attention" else rosekernels.attention_decode
    with pytest.raises(exc, match=match):
        fn(q, k, v, **kwargs)
    assert torch.equal(out, before)


# ---------------------------------------------------------------------------------------------
# GPU

SEQLENS_Q = (1, 2, 5, 16)
SEQLENS_K = (1, 7, 129, 1000, 8191)  # one key, less than a tile, ragged tiles, long
HEADS = ((4, 4), (8, 2), (16, 2))  # GQA ratios 1, 4, 8 (S_q = 16 at ratio 8: two 64-row m-blocks)


def _run(q, k, v, causal, scale, splits=None):
    out = torch.full_like(q, float("nan"))
    res, lse = rosekernels.attention_decode(q, k, v, causal=causal, softmax_scale=scale, out=out, return_lse=True,
                                  splits=splits)
    what = f"q{list(q.shape)} k{list(k.shape)} causal={causal} splits={splits}"
    sync(what)
    assert res is out
    return out, lse, what


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
def test_matches_float64_reference(kernels, d, dtype, causal):
    """Every (S_q, S_kv) pair, the GQA ratios in turn; the split count the op picks, then one
    split and one tile per split (the most partials to combine)."""
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    scale = 1.0 / math.sqrt(d)
    i = 0
    for s_q in SEQLENS_Q:
        for s_k in SEQLENS_K:
            hq, hkv = HEADS[i % len(HEADS)]
            q, k, v = inputs(2, s_q, s_k, hq, hkv, d, tdtype, seed=i)
            n_tiles = -(-s_k // D.DecodeConfig(d, dtype).tile_n)
            for splits in dict.fromkeys((None, 1, n_tiles)):
                out, lse, what = _run(q, k, v, causal, scale, splits)
                check(out, lse, q, k, v, causal, scale, what)
            i += 1
    assert all(int(c.sum()) == 0 for c in scratch.shared_buffers().values()), "a split counter was not reset to 0"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [D.DecodeConfig(128, "bf16", 16), D.DecodeConfig(64, "fp16", 32, splits=3),
                                 D.DecodeConfig(128, "bf16", 64, splits=1)], ids=str)
def test_workload_samples_pass_their_check(kernels, cfg):
    """What sip-tune runs: the shape's arguments and test samples of other batches and KV lengths
    (other split counts and tails), checked by the workload; a forced split count holds in all."""
    shape = D.Shape(batch=2, seqlen_q=3, seqlen_kv=3000, heads_q=16, heads_kv=4, head_dim=cfg.head_dim,
                    dtype=cfg.dtype, causal=True)
    w = D.workload(cfg, shape)
    for args in [w.make_args(0)] + [w.sample(seed) for seed in range(1, 4)]:
        w.run(w.kernel.fn, args)
        sync(f"workload of {cfg} on q{list(args[0].shape)} k{list(args[1].shape)}")
        w.check(args)


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv", [(32, 8), (16, 16), (64, 1)])
def test_decode_shapes_with_many_splits(kernels, hq, hkv):
    """Batch 1 over a long cache: the split count the op picks for a small grid (dozens of chunks)."""
    q, k, v = inputs(1, 1, 32768 + 77, hq, hkv, 128, torch.bfloat16, seed=hq)
    cfg = D.config_for(D.Shape.of(q, k))
    assert cfg.splits >= 8, cfg
    out, lse, what = _run(q, k, v, False, 0.1)
    check(out, lse, q, k, v, False, 0.1, what)


def test_the_combine_loads_a_batch_of_splits_before_using_any(tmp_path):
    """The combine's loop reads COMBINE_BATCH splits' partials (an lse and 4 values each, .cg loads from L2) before
    its first exp2, so that they share one round trip whatever the split count (no remainder loop of one a split)."""
    from kernel_sass import loop_instructions, sass_of
    from rosekernels.kernels.attention_splits import COMBINE_BATCH

    sass = sass_of(D.compile(D.DecodeConfig(128, "bf16", 64)), tmp_path)
    if sass is None:
        pytest.skip("nvdisasm not found")
    loop = loop_instructions(sass, "LDG.E.STRONG.GPU")
    first_exp = next(i for i, line in enumerate(loop) if line.startswith("MUFU.EX2"))
    loads = [line for line in loop if line.startswith("LDG.E.STRONG.GPU")]
    # one batch in the loop, and no other loop or remainder of them anywhere (main's unrolled loop and its remainder: 75)
    assert len(loads) == len(re.findall(r"\bLDG\.E\.STRONG\.GPU\b", sass)) == 5 * COMBINE_BATCH, loop
    assert not any(line.startswith("LDG.E.STRONG.GPU") for line in loop[first_exp:]), loop


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [3, 8, 9, 22, 33])
def test_every_split_count_combines_to_the_reference(kernels, splits):
    """Split counts below, at and past one combine batch, and past it by a partial batch (the slots beyond the last
    split reread its row and must count as empty): 64-row tiles (GQA 64) and 16-row ones (GQA 4)."""
    for hq, hkv in ((64, 1), (16, 4)):
        q, k, v = inputs(3, 1, 4096 + 29, hq, hkv, 128, torch.bfloat16, seed=splits)
        out, lse, what = _run(q, k, v, False, 0.1, splits=splits)
        check(out, lse, q, k, v, False, 0.1, what)


@pytest.mark.gpu
def test_attention_dispatches_short_queries_to_the_decode_kernel(kernels):
    q, k, v = inputs(3, 4, 3000, 16, 4, 128, torch.bfloat16, seed=11)
    for causal in (False, True):
        out, lse = rosekernels.attention(q, k, v, causal=causal, return_lse=True)
        ref, ref_lse = rosekernels.attention_decode(q, k, v, causal=causal, return_lse=True)
        sync("dispatch")
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse), "attention() did not run the decode kernel"
        check(out, lse, q, k, v, causal, 1 / math.sqrt(128), f"attention() causal={causal}")


@pytest.mark.gpu
def test_without_pdl_the_results_are_bitwise_the_same(kernels):
    q, k, v = inputs(3, 4, 3000, 16, 4, 128, torch.bfloat16, seed=12)
    lengths = torch.tensor([3000, 1, 1777], dtype=torch.int32, device="cuda")
    for causal in (False, True):
        with_pdl = rosekernels.attention(q, k, v, causal=causal)
        without = rosekernels.attention(q, k, v, causal=causal, enable_pdl=False)
        cached = rosekernels.attention_with_kvcache(q, k, v, lengths, causal=causal)
        cached_without = rosekernels.attention_with_kvcache(q, k, v, lengths, causal=causal, enable_pdl=False)
        sync("pdl on and off")
        assert torch.equal(with_pdl, without) and torch.equal(cached, cached_without)


@pytest.mark.gpu
def test_strided_views_in_and_out(kernels):
    b, s, h, d = 2, 700, 4, 128
    kv = torch.randn(b, s, 2, h, d, device="cuda").to(torch.float16)
    k, v = kv.unbind(2)  # strides (s*2*h*d, 2*h*d, d, 1)
    q = torch.randn(b, 3, h, 2 * d, device="cuda").to(torch.float16)[..., d:]
    big = torch.full((b, 3, h, 2 * d), float("nan"), device="cuda", dtype=torch.float16)
    out = big[..., :d]
    _, lse = rosekernels.attention(q, k, v, causal=True, out=out, return_lse=True)
    sync("strided")
    check(out, lse, q, k, v, True, 1 / math.sqrt(d), "strided")
    assert big[..., d:].isnan().all(), "wrote outside out"
    # S_q = 1 with an odd stride on that dim (it never addresses memory): TMA takes a regular view;
    # the second call reuses the cached plan, views included.
    q1 = q[:, :1].as_strided((b, 1, h, d), (q.stride(0), 5, d * 2, 1), q.storage_offset())
    for rep in range(2):
        q1.copy_(torch.randn_like(q1))
        out1, lse1 = rosekernels.attention(q1, k, v, return_lse=True)
        sync("odd S_q stride")
        check(out1, lse1, q1, k, v, False, 1 / math.sqrt(d), f"odd S_q stride, call {rep}")


@pytest.mark.gpu
def test_captures_in_a_cuda_graph_and_replays_with_new_inputs(kernels):
    """Two launches per graph (a split one and a one-split one), replayed twice with fresh inputs."""
    q, k, v = inputs(1, 1, 20000, 32, 8, 128, torch.bfloat16, seed=3)
    q2, k2, v2 = inputs(64, 2, 300, 8, 8, 64, torch.float16, seed=4)
    assert D.config_for(D.Shape.of(q, k)).splits > 1 and D.config_for(D.Shape.of(q2, k2, True)).splits == 1
    out, out2 = torch.empty_like(q), torch.empty_like(q2)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        rosekernels.attention(q, k, v, out=out)  # warm up outside the capture
        rosekernels.attention(q2, k2, v2, causal=True, out=out2)
        sync("graph warm-up")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            _, lse = rosekernels.attention(q, k, v, out=out, return_lse=True)
            _, lse2 = rosekernels.attention(q2, k2, v2, causal=True, out=out2, return_lse=True)
    for seed in range(2):
        for t in (q, k, v, q2, k2, v2):
            t.copy_(torch.randn_like(t))
        for t in (out, out2, lse, lse2):
            t.fill_(float("nan"))
        g.replay()
        sync("graph replay")
        check(out, lse, q, k, v, False, 1 / math.sqrt(128), f"graph replay {seed} (split)")
        check(out2, lse2, q2, k2, v2, True, 1 / math.sqrt(64), f"graph replay {seed} (one split)")


@pytest.mark.gpu
def test_registered_op_under_torch_compile_with_cuda_graphs(kernels):
    """The op as torch.compile sees it (attention() traces into it), in reduce-overhead mode."""
    q, k, v = inputs(2, 1, 5000, 16, 4, 128, torch.bfloat16, seed=5)

    def step(q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
        torch.ops.rosekernels.attention_decode(q, k, v, out, lse, True, 0.125)
        return out, lse

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for i in range(3):  # warm-up, recording, replay
        q, k, v = (torch.randn_like(t) for t in (q, k, v))
        out, lse = compiled(q, k, v)
        sync(f"torch.compile call {i}")
        check(out.clone(), lse.clone(), q, k, v, True, 0.125, f"torch.compile call {i}")
