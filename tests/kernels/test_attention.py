"""Fused attention forward: every specialization compiles to an sm_90a WGMMA/TMA kernel (CPU), the
workload, argument validation and the grid (CPU), and numerics against a float64 reference on fresh
random inputs (GPU). Configs and the tile heuristic: test_attention_plan.py."""
import dataclasses
import math
import re

import pytest
import torch
from attention_reference import check, inputs, sync
from kernel_sass import sass_of

import rosekernels
from rosekernels import scratch
from rosekernels.kernels import attention as A

# The in-order pipeline (no softmax/GEMM overlap, no ping-pong) is kept as the reference schedule.
IN_ORDER = (
    A.AttentionConfig(128, "bf16", False, overlap=False),
    A.AttentionConfig(128, "bf16", True, overlap=False),
    A.AttentionConfig(64, "fp16", True, tile_m=192, num_stages=3, overlap=False),
)
# One CTA per tile instead of persistent CTAs: the same compiled kernel, another grid.
PER_TILE = (dataclasses.replace(A.default_config(128, "bf16", True), persistent=False),)
ALL_CONFIGS = tuple(A.variants_for()) + IN_ORDER + PER_TILE
CPU_CONFIGS = tuple(A.variants_for()) + IN_ORDER[1:2]  # what CI compiles


@pytest.fixture(scope="module")
def kernels():
    """Every config compiled (in parallel processes when the disk cache is cold)."""
    return dict(zip(ALL_CONFIGS, A.precompile(ALL_CONFIGS)))


@pytest.fixture(scope="module")
def cpu_kernels():
    return dict(zip(CPU_CONFIGS, A.precompile(CPU_CONFIGS)))


# ---------------------------------------------------------------------------------------------
# CPU


def test_every_specialization_compiles_to_a_warp_specialized_wgmma_kernel(cpu_kernels, tmp_path):
    for cfg, k in cpu_kernels.items():
        assert int.from_bytes(k.cubin[0x30:0x34], "little") & 0xFF == 90, cfg  # e_flags: sm_90
        sass = sass_of(k, tmp_path)
        if sass is None:
            pytest.skip("nvdisasm (nvidia-cuda-nvdisasm) is not installed")
        ops = set(re.findall(r"\b(HGMMA|UTMALDG|UTMASTG|USETMAXREG|STSM|ATOMG|LDL|STL)\b", sass))
        assert {"HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG", "STSM", "ATOMG"} <= ops, (cfg, ops)
        assert not {"LDL", "STL"} & ops, f"{cfg} spills registers to local memory"
        gemm_n = {int(n) for n in re.findall(r"HGMMA\.64x(\d+)x16", sass)}
        assert gemm_n == {cfg.tile_n, cfg.head_dim}, (cfg, gemm_n)  # S = Q K^T and O += P V


def test_in_order_configs_are_kernels_of_their_own():
    keys = [c.variant().key() for c in A.variants_for() + list(IN_ORDER)]
    assert len(set(keys)) == len(keys)
    # The launch policy is not compiled in: both grids share one kernel.
    assert PER_TILE[0].variant() == A.default_config(128, "bf16", True).variant()


def test_workload_runs_the_given_config_and_refuses_a_shape_it_does_not_serve(cpu_kernels):
    cfg = IN_ORDER[1]  # causal, in order: not what config_for picks
    assert A.workload(cfg, A.Shape(causal=True)).kernel.variant == cfg.variant()
    with pytest.raises(ValueError, match="does not serve"):
        A.workload(cfg, A.Shape.defaults("prefill"))  # not causal


def _cpu(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: (_cpu(2, 16, 4, 64)[0], _cpu(2, 16, 4, 64), _cpu(2, 16, 4, 64), {}), ValueError, "4-D"),
    (lambda: (_cpu(2, 16, 4, 64, dtype=torch.float32),) * 3 + ({},), TypeError, "dtype"),
    (lambda: (_cpu(2, 16, 4, 64), _cpu(2, 16, 4, 64, dtype=torch.float16), _cpu(2, 16, 4, 64), {}),
     TypeError, "dtype"),
    (lambda: (_cpu(2, 16, 4, 96), _cpu(2, 16, 4, 96), _cpu(2, 16, 4, 96), {}), ValueError, "head_dim"),
    (lambda: (_cpu(2, 16, 6, 64), _cpu(2, 16, 4, 64), _cpu(2, 16, 4, 64), {}), ValueError, "multiple"),
    (lambda: (_cpu(2, 16, 4, 64), _cpu(3, 16, 4, 64), _cpu(3, 16, 4, 64), {}), ValueError, "shape"),
    (lambda: (_cpu(2, 16, 4, 64), _cpu(2, 16, 4, 64), _cpu(2, 15, 4, 64), {}), ValueError, "shape"),
    (lambda: (_cpu(2, 16, 4, 64), _cpu(2, 0, 4, 64), _cpu(2, 0, 4, 64), {}), ValueError, "at least one key"),
    (lambda: (_cpu(2, 16, 4, 64),) * 3 + (dict(softmax_scale=-1.0),), ValueError, "softmax_scale"),
    (lambda: (_cpu(2, 16, 4, 64),) * 3 + (dict(softmax_scale=float("nan")),), ValueError, "softmax_scale"),
    (lambda: (_cpu(2, 16, 4, 64),) * 3 + (dict(out=_cpu(2, 16, 4, 32)),), ValueError, "shape"),
    (lambda: (_cpu(2, 16, 4, 64),) * 3 + ({},), ValueError, "CUDA"),
])
def test_invalid_arguments_raise_before_anything_is_written(make, exc, match):
    q, k, v, kwargs = make()
    out = kwargs.setdefault("out", torch.full(q.shape if q.dim() == 4 else (1, 1, 1, 64), 7.0).to(q.dtype))
    before = out.clone()
    with pytest.raises(exc, match=match):
        rosekernels.attention(q, k, v, **kwargs)
    assert torch.equal(out, before)


def test_launch_args_size_the_grid_and_zero_the_counter_only_when_ctas_claim_tiles():
    cfg = A.default_config(128, "bf16", True)  # tile_m 128
    q = torch.empty(3, 300, 5, 128, device="meta")  # 3 m blocks * 5 heads * 3 batches = 45 tiles
    assert A.num_tiles(cfg, 3, 300, 5) == 45
    counter, ctas = A.launch_args(dataclasses.replace(cfg, persistent=False), q)
    assert ctas == 45 and counter.shape == (1,) and counter.dtype == torch.int32
    q = torch.empty(3, 300, 5, 128)
    counter, ctas = A.launch_args(cfg, q, num_ctas=7)
    assert ctas == 7 and counter.tolist() == [0]  # 7 CTAs claim the other 38 tiles from it
    for bad in (0, -1, 2**31):
        with pytest.raises(ValueError, match="num_ctas"):
            A.launch_args(cfg, q, num_ctas=bad)


# ---------------------------------------------------------------------------------------------
# GPU

TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (S_q, S_kv): single tokens, sizes off the tile grid on both sides, decode-shaped, S_q < S_kv, S_q > S_kv.
# With 192-row tiles, S_q = 1, 17, 127, 1000 and 255 leave warpgroups with no row in their last tile
# (they only keep the pipelines in step: idle_mainloop); causal, the first warpgroups of a 192-row
# tile skip its last KV tile, and at (200, 264) so does the first of a 128-row one (skip_tiles).
SEQLENS = [(1, 1), (17, 17), (127, 127), (129, 129), (1000, 1000), (1, 1000), (129, 1000), (1000, 129),
           (255, 17), (200, 264)]
HEADS = [(4, 4), (8, 2), (8, 1)]  # GQA ratios 1, 4, 8


def _run_poisoned(kernel, cfg, q, k, v, scale, num_ctas=None):
    """One launch into NaN-filled out/lse; num_ctas: the grid (default: the op's choice)."""
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda")
    counter, ctas = A.launch_args(cfg, q, num_ctas)
    kernel.fn(q, k, v, out, lse, scale * A.LOG2_E, counter, ctas, *A.NOT_VARLEN)
    sync(f"{cfg} on q{list(q.shape)} k{list(k.shape)} with {ctas} CTAs")
    assert counter.item() == 0 or ctas >= A.num_tiles(cfg, q.shape[0], q.shape[1], q.shape[2]), \
        "the tile counter was not re-zeroed"
    return out, lse


def _ids(cfg):
    return cfg.variant().key().split("sm_90a-")[1] + ("" if cfg.persistent else "-per_tile")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=_ids)
def test_matches_float64_reference(kernels, cfg):
    # The small shapes fit one wave; 1 and 5 CTAs make each CTA walk many tiles (5: a ragged last
    # round), 1000 leaves CTAs with no tile at all.
    for i, (s_q, s_k) in enumerate(SEQLENS):
        hq, hkv = HEADS[i % len(HEADS)]
        q, k, v = inputs(2, s_q, s_k, hq, hkv, cfg.head_dim, TORCH_DTYPE[cfg.dtype], seed=i)
        scale = 1.0 / math.sqrt(cfg.head_dim)
        for num_ctas in (None, 1, 5, 1000):
            out, lse = _run_poisoned(kernels[cfg], cfg, q, k, v, scale, num_ctas)
            check(out, lse, q, k, v, cfg.causal, scale, f"S_q={s_q} S_kv={s_k} Hq={hq} Hkv={hkv} ctas={num_ctas}")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [A.default_config(64, "fp16", True), IN_ORDER[0]], ids=_ids)
def test_workload_samples_pass_their_check(kernels, cfg):
    """What sip-tune runs: the shape's arguments and ragged test samples, checked by the workload."""
    w = A.workload(cfg, A.Shape(batch=1, seqlen=777, heads_q=8, heads_kv=2, head_dim=cfg.head_dim,
                                dtype=cfg.dtype, causal=cfg.causal))
    for args in [w.make_args(0)] + [w.sample(seed) for seed in range(1, 4)]:
        w.run(w.kernel.fn, args)
        sync(f"workload of {cfg} on q{list(args[0].shape)}")
        w.check(args)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_more_tiles_than_sms_through_the_public_op(kernels, causal, d):
    """The op's own persistent grid (tiles > SMs): CTAs claim tiles from the counter."""
    q, k, v = inputs(3, 1111, 1500, 12, 4, d, torch.bfloat16, seed=10 + d + causal)
    cfg = A.default_config(d, "bf16", causal)
    assert A.num_tiles(cfg, 3, 1111, 12) > torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.full_like(q, float("nan"))
    res, lse = rosekernels.attention(q, k, v, causal=causal, out=out, return_lse=True)
    sync("public op, persistent")
    check(out, lse, q, k, v, causal, 1 / math.sqrt(d), f"d={d} causal={causal} S_q=1111 S_kv=1500")


@pytest.mark.gpu
def test_causal_l2_sections_with_a_narrower_last_one(kernels):
    """Long keys make each causal L2 section 2 heads wide; 5 heads leave a last section of 1."""
    cfg = A.default_config(128, "bf16", True)
    s_k = 30000
    assert (A.L2_KV_BYTES // (4 * 128)) // s_k == 2
    q, k, v = inputs(1, 200, s_k, 5, 5, 128, torch.bfloat16, seed=11)
    for num_ctas in (None, 3):
        out, lse = _run_poisoned(kernels[cfg], cfg, q, k, v, 1 / math.sqrt(128), num_ctas)
        check(out, lse, q, k, v, True, 1 / math.sqrt(128), f"sections, ctas={num_ctas}")


@pytest.mark.gpu
def test_a_reused_counter_serves_back_to_back_launches(kernels):
    """The kernel leaves the counter at zero, so launches on one stream may share it."""
    cfg = A.default_config(64, "fp16", True)
    q, k, v = inputs(2, 700, 700, 8, 2, 64, torch.float16, seed=12)
    counter, ctas = A.launch_args(cfg, q, num_ctas=4)
    scale = 1 / 8
    outs = []
    for _ in range(3):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((2, 8, 700), float("nan"), device="cuda")
        kernels[cfg].fn(q, k, v, out, lse, scale * A.LOG2_E, counter, ctas, *A.NOT_VARLEN)
        outs.append((out, lse))
    sync("back-to-back launches")
    assert counter.item() == 0
    for i, (out, lse) in enumerate(outs):
        check(out, lse, q, k, v, True, scale, f"launch {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_public_op_long_sequence_custom_scale_and_lse(kernels, causal, d):
    q, k, v = inputs(1, 2048 + 77, 2048 + 77, 4, 2, d, torch.bfloat16, seed=d + causal)
    out = torch.full_like(q, float("nan"))
    res, lse = rosekernels.attention(q, k, v, causal=causal, softmax_scale=0.3, out=out, return_lse=True)
    sync("public op")
    assert res is out
    check(out, lse, q, k, v, causal, 0.3, f"d={d} causal={causal}")


@pytest.mark.gpu
def test_long_keys_take_144_key_tiles_through_the_public_op(kernels):
    q, k, v = inputs(1, 300, A.LONG_KV + 77, 4, 2, 128, torch.bfloat16, seed=21)
    assert A.default_config(128, "bf16", False, k.shape[1]).tile_n == 144
    out, lse = rosekernels.attention(q, k, v, out=torch.full_like(q, float("nan")), return_lse=True)
    sync("public op, 144-key tiles")
    check(out, lse, q, k, v, False, 1 / math.sqrt(128), "S_kv past LONG_KV")


@pytest.mark.gpu
def test_strided_views_in_and_out(kernels):
    b, s, h, d = 2, 300, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda").to(torch.float16)
    q, k, v = qkv.unbind(2)  # strides (s*3*h*d, 3*h*d, d, 1)
    big = torch.full((b, s, h, 2 * d), float("nan"), device="cuda", dtype=torch.float16)
    out = big[..., d:]
    rosekernels.attention(q, k, v, causal=True, out=out)
    sync("strided")
    check(out, None, q, k, v, True, 1 / math.sqrt(d), "strided")
    assert big[..., :d].isnan().all(), "wrote outside out"
    # A size-1 batch with an odd batch stride: the stride never addresses memory.
    q1 = torch.randn(3, 64, h, d, device="cuda", dtype=torch.float16)[1:2]
    q1 = q1.as_strided(q1.shape, (7, *q1.stride()[1:]), q1.storage_offset())
    k1, v1 = k[:1, :64].contiguous(), v[:1, :64].contiguous()
    out1 = rosekernels.attention(q1, k1, v1)
    sync("size-1 batch")
    check(out1, None, q1, k1, v1, False, 1 / math.sqrt(d), "size-1 batch")


@pytest.mark.gpu
def test_fully_masked_rows_and_empty_query(kernels):
    q, k, v = inputs(1, 300, 40, 2, 2, 64, torch.bfloat16, seed=7)
    out, lse = rosekernels.attention(q, k, v, causal=True, return_lse=True)
    sync("fully masked rows")
    assert (out[:, :260] == 0).all() and (lse[:, :, :260] == float("-inf")).all()
    check(out, lse, q, k, v, True, 1 / 8, "S_q > S_kv causal")
    empty = rosekernels.attention(q[:, :0], k, v, causal=True)
    assert empty.shape == (1, 0, 2, 64)


@pytest.mark.gpu
def test_captures_in_a_cuda_graph_on_the_current_stream(kernels):
    # More tiles than SMs: the capture holds the counter's zeroing too.
    q, k, v = inputs(4, 1025, 1025, 8, 2, 128, torch.bfloat16, seed=3)
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        rosekernels.attention(q, k, v, causal=True, out=out)  # warm up outside the capture
        sync("graph warm-up")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            rosekernels.attention(q, k, v, causal=True, out=out)
    for replay in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        out.fill_(float("nan"))
        g.replay()
        sync("graph replay")
        check(out, None, q, k, v, True, 1 / math.sqrt(128), f"graph replay {replay}")


@pytest.mark.gpu
def test_cached_plans_serve_new_data_and_still_check_pointers(kernels):
    """Eager calls reuse the launch plan of their argument signature (and one tile or split
    counter per stream, re-zeroed by each launch): back-to-back calls on new data stay right, across
    signatures; a misaligned pointer with a cached signature is still refused before any launch."""
    shapes = [(3, 1111, 1500, 12, 4, 128, True), (2, 700, 700, 8, 8, 64, False),
              (2, 5, 9000, 16, 4, 128, True)]  # the last: the split-KV decode kernel
    for rep in range(3):
        for i, (b, s_q, s_k, hq, hkv, d, causal) in enumerate(shapes):
            q, k, v = inputs(b, s_q, s_k, hq, hkv, d, torch.bfloat16, seed=100 + 10 * rep + i)
            out = torch.full_like(q, float("nan"))
            _, lse = rosekernels.attention(q, k, v, causal=causal, out=out, return_lse=True)
            sync("cached plan")
            check(out, lse, q, k, v, causal, 1 / math.sqrt(d), f"rep {rep} shape {i}")
    assert all(int(c.sum()) == 0 for c in scratch.shared_buffers().values()), "a tile counter was left nonzero"
    b, s_q, s_k, hq, hkv, d, causal = shapes[0]
    q, k, v = inputs(b, s_q, s_k, hq, hkv, d, torch.bfloat16, seed=7)
    base = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    out = base[1:].view(q.shape)  # same shape and strides as a cached signature, pointer off by 2 bytes
    out.fill_(1.0)
    with pytest.raises(ValueError, match="align"):
        rosekernels.attention(q, k, v, causal=causal, out=out)
    assert bool((out == 1.0).all()), "the refused call wrote to out"


@pytest.mark.parametrize("s_q", [1, 300], ids=["decode", "prefill"])
def test_traces_into_its_registered_op_under_torch_compile(s_q):
    """fullgraph torch.compile on fake CUDA tensors (no GPU needed): the checks trace without reading
    data pointers, and the graph holds one call of the kernel's registered op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        q = torch.empty(2, s_q, 16, 128, device="cuda", dtype=torch.bfloat16)
        kv = torch.empty(2, 512, 4, 128, device="cuda", dtype=torch.bfloat16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    step = torch.compile(lambda q, k, v: rosekernels.attention(q, k, v, causal=True, return_lse=True),
                         backend=backend, fullgraph=True)
    with mode:
        out, lse = step(q, kv, kv)
    assert out.shape == q.shape and lse.shape == (2, 16, s_q)
    op = "attention_decode" if s_q == 1 else "attention_fwd"
    assert len(graphs) == 1 and graphs[0].count(f"torch.ops.rosekernels.{op}(") == 1
