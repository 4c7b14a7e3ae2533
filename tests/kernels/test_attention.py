"""Fused attention forward: every specialization compiles to an sm_90a WGMMA/TMA kernel (CPU), the
workload, argument validation and the grid (CPU), and numerics against a float64 reference on fresh
random inputs (GPU). Configs and the tile heuristic: test_attention_plan.py."""
import dataclasses
import math
import re
import types

import pytest
import torch
from attention_reference import check, inputs, sync
from kernel_sass import sass_of
from sip.cubin import parse_cubin

import rosekernels
from rosekernels import checks, launch, modes, scratch
from rosekernels.kernels import attention as A
from rosekernels.kernels import attention_common as AC
from rosekernels.kernels import attention_tiles
from rosekernels.ops import attention as attention_op

# The in-order pipeline (no softmax/GEMM overlap, no ping-pong) is kept as the reference schedule.
IN_ORDER = (
    A.AttentionConfig(128, "bf16", False, overlap=False),
    A.AttentionConfig(128, "bf16", True, overlap=False),
    A.AttentionConfig(64, "fp16", True, tile_m=192, num_stages=3, overlap=False),
)
# One CTA per tile instead of persistent CTAs: the same compiled kernel, another grid.
PER_TILE = (dataclasses.replace(A.default_config(128, "bf16", True), persistent=False),)
# O stored from registers instead of through shared memory (the long-key d=128 defaults, 192-key
# tiles, take the most shared memory of any config); the last three have slab twins among the variants.
DIRECT_O = (
    A.AttentionConfig(128, "bf16", False, tile_n=176, direct_o=True),
    A.AttentionConfig(64, "bf16", False, tile_m=192, num_stages=3, direct_o=True),
    A.AttentionConfig(128, "bf16", False, tile_n=128, direct_o=True),
    A.AttentionConfig(128, "fp16", True, tile_n=128, direct_o=True),
)
ALL_CONFIGS = tuple(A.variants_for()) + IN_ORDER + PER_TILE + DIRECT_O
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
        assert parse_cubin(k.cubin).arch == "sm_90a", cfg
        sass = sass_of(k, tmp_path)
        if sass is None:
            pytest.skip("nvdisasm (nvidia-cuda-nvdisasm) is not installed")
        ops = set(re.findall(r"\b(HGMMA|UTMALDG|UTMASTG|USETMAXREG|STSM|ATOMG|LDL|STL)\b", sass))
        # O through a shared-memory slab (stmatrix) and a TMA store, or from registers (column pairs).
        o_path = {"UTMASTG", "STSM"}
        assert {"HGMMA", "UTMALDG", "USETMAXREG", "ATOMG"} <= ops and (o_path & ops == set() if cfg.direct_o
                                                                       else o_path <= ops), (cfg, ops)
        if cfg.direct_o:
            assert len(re.findall(r"\bSTG\.E\s", sass)) >= 64 * cfg.head_dim // 2 // 128, cfg
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
    (lambda: (_cpu(2, 16, 4, 64),) * 3 + (dict(softmax_scale=1e39),), ValueError, "softmax_scale"),  # inf in fp32
    (lambda: (_cpu(2, 16, 4, 64),) * 3 + (dict(softmax_scale=1e-40),), ValueError, "softmax_scale"),  # subnormal
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
@pytest.mark.parametrize("direct", DIRECT_O[1:], ids=_ids)
def test_direct_o_stores_the_slab_paths_bytes_and_no_row_past_s_q(kernels, direct):
    """O from registers: bitwise what the same tiles store through shared memory, and rows past S_q
    (a ragged last 64-row slab) never written: out is a view with NaN rows after each entry's S_q."""
    slab = dataclasses.replace(direct, direct_o=False)
    q, k, v = inputs(2, 1000, 1200, 8, 2, direct.head_dim, TORCH_DTYPE[direct.dtype], seed=3)
    scale = 1.0 / math.sqrt(direct.head_dim)
    outs = []
    for cfg in (slab, direct):
        buf = torch.full((2, 1100, 8, direct.head_dim), float("nan"), dtype=q.dtype, device="cuda")
        out, lse = buf[:, :1000], torch.empty(2, 8, 1000, device="cuda")
        A.compile(cfg).fn(q, k, v, out, lse, scale * A.LOG2_E, *A.launch_args(cfg, q), *A.NOT_VARLEN)
        sync(str(cfg))
        assert buf[:, 1000:].isnan().all(), f"{cfg} wrote a row past S_q"
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


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
    assert (attention_tiles.L2_KV_BYTES // (4 * 128)) // s_k == 2
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
@pytest.mark.parametrize("causal", [False, True])
def test_long_keys_take_192_key_tiles_with_direct_o_through_the_public_op(kernels, causal):
    q, k, v = inputs(1, 300, 2 * A.LONG_KV + 77, 4, 2, 128, torch.bfloat16, seed=21)
    cfg = A.default_config(128, "bf16", causal, k.shape[1])
    assert (cfg.tile_n, cfg.direct_o) == (192, True)
    out, lse = rosekernels.attention(q, k, v, causal=causal, out=torch.full_like(q, float("nan")), return_lse=True)
    sync("public op, 192-key tiles")
    check(out, lse, q, k, v, causal, 1 / math.sqrt(128), "S_kv past 2 x LONG_KV")


@pytest.mark.gpu
def test_a_small_d64_grid_takes_128_row_tiles_through_the_public_op(kernels):
    if modes.sm_count() < 128:
        pytest.skip("256 tiles of 128 rows make two rounds only from 128 SMs on")
    q, k, v = inputs(1, 1024, 1024, 32, 8, 64, torch.bfloat16, seed=22)
    assert attention_op.prefill_config(q, k, False).tile_m == 128 and attention_op.prefill_config(q, k, True).tile_m == 192
    out, lse = rosekernels.attention(q, k, v, out=torch.full_like(q, float("nan")), return_lse=True)
    sync("public op, 128-row d=64 tiles")
    check(out, lse, q, k, v, False, 1 / math.sqrt(64), "B1 S1k d64")


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
@pytest.mark.parametrize("s_q", [1, 300], ids=["decode", "prefill"])
def test_a_batch_beyond_32_bit_indexing_runs_in_slices(kernels, s_q):
    """q, k and v as views 2^30 elements apart per batch entry in one 4.3 GB buffer: one launch would
    index past 2^31 elements, so the op launches the batch in slices (entries 0-1, then 2); the result
    is bitwise that of the same slices as contiguous copies, and nothing outside out is written."""
    b, s_k, hq, hkv, d = 3, 700, 8, 2, 128
    apart = 2**30
    buf = torch.empty(apart * (b - 1) + 2**22, device="cuda", dtype=torch.bfloat16).normal_()
    view = lambda offset, s, h: buf.as_strided((b, s, h, d), (apart, h * d, d, 1), offset)  # noqa: E731
    q, k, v = view(0, s_q, hq), view(2**20, s_k, hkv), view(2**21, s_k, hkv)
    assert AC.batch_per_launch(q, k, v) == 2
    big = torch.full((b, s_q, hq, 2 * d), float("nan"), device="cuda", dtype=torch.bfloat16)
    out, lse = rosekernels.attention(q, k, v, causal=True, out=big[..., :d], return_lse=True)
    parts = [rosekernels.attention(*(t[b0:b1].contiguous() for t in (q, k, v)), causal=True, return_lse=True)
             for b0, b1 in ((0, 2), (2, 3))]
    want, want_lse = (torch.cat(t) for t in zip(*parts))
    sync("sliced batch")
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert big[..., d:].isnan().all(), "wrote outside out"
    check(out[2:], lse[2:], q[2:], k[2:], v[2:], True, 1 / math.sqrt(d), "the last slice")


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


def test_batch_per_launch_keeps_every_operand_within_32_bit_indexing():
    meta = lambda shape, stride: torch.empty_strided(shape, stride, device="meta")  # noqa: E731
    small = meta((4, 300, 16, 128), (300 * 16 * 128, 16 * 128, 128, 1))
    assert AC.batch_per_launch(small, None) == 2**31 // (300 * 16 * 128)  # many more than its 4 entries
    for stride in (2**29, 2**30, 2**31 - 2**20, 2**31):
        far = meta((5, 300, 16, 128), (stride, 16 * 128, 128, 1))
        per = AC.batch_per_launch(small, far)
        inner = 299 * 16 * 128 + 15 * 128 + 127
        assert (per - 1) * stride + inner < 2**31 and (per == 1 or per * stride + inner >= 2**31), stride
    many = meta((70000, 1, 1, 64), (64, 64, 64, 1))
    assert AC.batch_per_launch(many) == AC.GRID_BATCH


def _naive_reference(q, k, v, causal, scale):
    """float64, K/V expanded per query head: the textbook form the grouped reference must match."""
    ratio = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2).double() for t in (q, k, v))
    kh, vh = kh.repeat_interleave(ratio, 1), vh.repeat_interleave(ratio, 1)
    s = qh @ kh.transpose(-1, -2) * scale
    s_q, s_k = q.shape[1], k.shape[1]
    if causal:
        s = s.masked_fill(torch.arange(s_k)[None, :] > torch.arange(s_q)[:, None] + s_k - s_q, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]).nan_to_num(0.0) @ vh).transpose(1, 2), lse


@pytest.mark.parametrize("b, s_q, s_k, hq, hkv, causal", [(2, 37, 50, 8, 2, True), (1, 60, 40, 4, 4, True),
                                                          (3, 9, 9, 6, 3, False)])
def test_the_grouped_reference_and_the_sampled_check(monkeypatch, b, s_q, s_k, hq, hkv, causal):
    """The reference groups query heads per KV head instead of expanding K/V: the same numbers as the
    textbook form, also for a subset of rows. Past CHECK_SCORES the check compares sampled rows
    (the first and last among them): a wrong value there fails, unwritten elements fail anywhere."""
    g = torch.Generator().manual_seed(b * s_q + s_k)
    q, k, v = (torch.randn(b, s, h, 16, generator=g).to(torch.bfloat16) for s, h in ((s_q, hq), (s_k, hkv), (s_k, hkv)))
    want, want_lse = _naive_reference(q, k, v, causal, 0.3)
    got, got_lse = AC.reference(q, k, v, causal, 0.3)
    assert torch.allclose(got, want, atol=1e-12) and torch.equal(got_lse.isinf(), want_lse.isinf())
    rows = torch.tensor([0, 5, s_q - 1])
    some, some_lse = AC.reference(q, k, v, causal, 0.3, rows=rows)
    assert torch.allclose(some, want[:, rows], atol=1e-12)
    assert torch.allclose(some_lse[~some_lse.isinf()], want_lse[:, :, rows][~some_lse.isinf()], atol=1e-12)
    monkeypatch.setattr(AC, "CHECK_SCORES", 1)  # every check samples rows
    out, lse = want.to(torch.bfloat16), want_lse.float()
    AC.check(out, lse, q, k, v, causal, 0.3, "sampled")
    for row in (0, s_q - 1):  # always sampled
        bad = out.clone()
        bad[0, row, 0, 0] += 1.0
        with pytest.raises(AssertionError, match="max"):
            AC.check(bad, lse, q, k, v, causal, 0.3, "a wrong sampled row")
    unwritten = out.clone()
    unwritten[-1, s_q // 2, -1, -1] = float("nan")
    with pytest.raises(AssertionError, match="unwritten"):
        AC.check(unwritten, lse, q, k, v, causal, 0.3, "an unwritten element")


def test_sliced_validation_still_checks_the_batch_stride():
    """A batch launched in slices of one entry: the batch stride still has to be 16-byte aligned and
    nonzero, or slice 1 would start misaligned or every slice would write the same rows."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        def fake(shape, stride):
            return torch.empty_strided(shape, stride, device="cuda", dtype=torch.bfloat16)
        kv = fake((2, 64, 4, 128), (2**31 - 2**14, 512, 128, 1))  # one entry per launch
        q = fake((2, 64, 16, 128), (2**31 - 3, 2048, 128, 1))
        with pytest.raises(ValueError, match="align"):
            AC.validate(q, kv, kv, None, None, pointers=False, sliced=True)
        q = fake((2, 64, 16, 128), (64 * 2048, 2048, 128, 1))
        assert AC.batch_per_launch(q, kv, kv) == 1
        AC.validate(q, kv, kv, None, None, pointers=False, sliced=True)
        with pytest.raises(ValueError, match="span"):
            AC.validate(q, kv, kv, None, None, pointers=False)
        with pytest.raises(ValueError, match="zero stride"):
            AC.validate(q, kv, kv, fake((2, 64, 16, 128), (0, 2048, 128, 1)), None, pointers=False, sliced=True)


def _meta(shape, stride):
    return torch.empty_strided(shape, stride, device="meta", dtype=torch.bfloat16)


@pytest.mark.parametrize("entry", ["attention", "attention_decode"])
def test_the_out_the_op_allocates_is_held_to_the_span_limit(monkeypatch, entry):
    """out=None: the op allocates out contiguous, so it spans more than a q whose heads overlap (a
    legal input). One entry of it past 2^31 elements is refused, as the same out passed in is,
    rather than stored through 32-bit indices that wrap; a batch of smaller entries runs in slices."""
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)  # meta tensors stand in for CUDA ones
    s = 2**21
    q = _meta((1, s, 16, 128), (s * 128, 128, 8, 1))  # heads 8 elements apart: 2^28 elements, out 2^32
    kv = _meta((1, 8192, 4, 128), (8192 * 512, 512, 128, 1))
    fn = getattr(rosekernels, entry)
    with pytest.raises(ValueError, match=r"out \(allocated contiguous in q's shape\) spans 2\^31"):
        fn(q, kv, kv)
    with pytest.raises(ValueError, match=r"out spans 2\^31"):
        fn(q, kv, kv, out=torch.empty(q.shape, device="meta", dtype=q.dtype))
    q = _meta((4, s // 4, 16, 128), (s * 32, 128, 8, 1))  # out: 2^30 elements an entry, two per launch
    kv = _meta((4, 8192, 4, 128), (8192 * 512, 512, 128, 1))
    AC.validate(q, kv, kv, None, None, sliced=True)


@pytest.mark.parametrize("entry", ["attention", "attention_decode"])
def test_an_out_whose_elements_overlap_is_refused(monkeypatch, entry):
    """Rows of out 8 elements apart (as_strided): CTAs would store the same elements; refused before
    anything is written, as zero strides are."""
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)  # CPU tensors stand in for CUDA ones
    q, k, v = _cpu(2, 64, 8, 64), _cpu(2, 64, 2, 64), _cpu(2, 64, 2, 64)
    store = torch.full((10**5,), 7.0, dtype=q.dtype)
    with pytest.raises(ValueError, match="out's elements overlap one another"):
        getattr(rosekernels, entry)(q, k, v, out=store.as_strided(q.shape, (4096, 64, 8, 1)))
    assert bool((store == 7.0).all())


@pytest.mark.parametrize("entry", ["attention", "attention_decode"])
def test_an_out_overlapping_k_or_v_is_refused_and_out_q_is_not(monkeypatch, entry):
    """Other CTAs read K and V while one writes out: an out overlapping either is refused before
    anything is written. out = q is not (each tile reads its Q rows before it writes them)."""
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)  # CPU tensors stand in for CUDA ones
    q, v = _cpu(2, 64, 8, 64), _cpu(2, 64, 2, 64)
    buf = torch.full((q.numel(),), 7.0, dtype=q.dtype)
    k, out = buf[:v.numel()].view(v.shape), buf.view(q.shape)  # out's first rows are k
    fn = getattr(rosekernels, entry)
    for k_, v_, name in ((k, v, "k"), (v, k, "v")):
        with pytest.raises(ValueError, match=f"out must not overlap {name}"):
            fn(q, k_, v_, out=out)
    assert bool((buf == 7.0).all())
    AC.validate(q, v, v, q, None)


@pytest.mark.parametrize("batch", [1, 2])
def test_out_q_in_a_fused_qkv_buffer_is_not_taken_for_an_overlap(monkeypatch, batch):
    """q, k and v as slices of one [B, S, (Hq + 2 Hkv) d] projection: their rows interleave, their elements
    do not, so out = q passes on the first call and on a planned signature; out one head later, which overlaps
    other heads' Q rows (and k's), is refused."""
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(attention_op, "_plans", launch.PlanCache())
    launches = []
    monkeypatch.setattr(attention_op, "_plan", lambda *args: types.SimpleNamespace(
        launch=lambda *a: launches.append(a)))
    hq, hkv, d = 8, 2, 64
    qkv = torch.zeros(batch, 64, (hq + 2 * hkv) * d, dtype=torch.bfloat16)
    heads = qkv.view(batch, 64, hq + 2 * hkv, d)
    q, k, v = heads[:, :, :hq], heads[:, :, hq:hq + hkv], heads[:, :, hq + hkv:]
    rosekernels.attention(q, k, v, out=q)
    rosekernels.attention(q, k, v, out=q)
    with pytest.raises(ValueError, match="out must not overlap q"):  # a head off q: other heads' Q rows, and k's
        rosekernels.attention(q, k, v, out=heads[:, :, 1:hq + 1])
    assert len(launches) == 2


def test_a_cached_plan_still_refuses_an_out_overlapping_k_or_v(monkeypatch):
    """The plan key holds no pointers: a call that reuses a plan with an out that now overlaps k or v
    is refused before its launch; out = q still launches."""
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(attention_op, "_plans", launch.PlanCache())
    launches = []
    plan = types.SimpleNamespace(launch=lambda *args: launches.append(args))  # no kernel on the CPU
    monkeypatch.setattr(attention_op, "_plan", lambda *args: plan)
    q, v = _cpu(2, 64, 8, 64), _cpu(2, 64, 2, 64)
    buf = torch.zeros(v.numel() + q.numel(), dtype=q.dtype)
    k = buf[:v.numel()].view(v.shape)
    rosekernels.attention(q, k, v, out=buf[v.numel():].view(q.shape))  # plans the signature
    overlapping = buf[:q.numel()].view(q.shape)  # the same signature, over k
    for k_, v_, name in ((k, v, "k"), (v, k, "v")):
        with pytest.raises(ValueError, match=f"out must not overlap {name}"):
            rosekernels.attention(q, k_, v_, out=overlapping)
    rosekernels.attention(q, k, v, out=q)
    assert len(launches) == 2 and len(attention_op._plans._plans) == 1


def test_a_dynamic_batch_traces_once():
    """Slicing must not make a traced batch size static: a batch marked dynamic traces one graph for
    every size that one launch takes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v: rosekernels.attention(q, k, v, causal=True), backend=backend,
                         fullgraph=True)
    mode = FakeTensorMode()
    for b in (2, 3, 5):
        with mode:
            q = torch.empty(b, 300, 16, 128, device="cuda", dtype=torch.bfloat16)
            kv = torch.empty(b, 512, 4, 128, device="cuda", dtype=torch.bfloat16)
        for t in (q, kv):
            torch._dynamo.mark_dynamic(t, 0)
        with mode:
            step(q, kv, kv)
    assert len(graphs) == 1 and graphs[0].count("rosekernels.attention_fwd") == 1


@pytest.mark.parametrize("s_q", [1, 300], ids=["decode", "prefill"])
def test_traces_a_batch_beyond_32_bit_indexing_into_one_op_call_per_slice(s_q):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        q = torch.empty_strided((3, s_q, 16, 128), (2**30, 2048, 128, 1), device="cuda", dtype=torch.bfloat16)
        kv = torch.empty_strided((3, 512, 4, 128), (2**30, 512, 128, 1), device="cuda", dtype=torch.bfloat16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    step = torch.compile(lambda q, k, v: rosekernels.attention(q, k, v, causal=True), backend=backend,
                         fullgraph=True)
    with mode:
        step(q, kv, kv)
    op = "attention_decode" if s_q == 1 else "attention_fwd"
    assert graphs[0].count(f"rosekernels.{op}") == 2


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
