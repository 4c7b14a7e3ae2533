"""The FP8 (e4m3) KV cache: append_kvcache quantizes the new tokens on the way in, attention_with_kvcache reads
the e4m3 cache with k_descale / v_descale (per tensor or per KV head). Plans and keys, compiles with the SASS
that makes them (CPU), argument errors before any launch (CPU), the append's bitwise reference (CPU); the
append byte for byte, attention against the float64 reference on the dequantized cache (GPU)."""
import dataclasses
import math
import os
import re

import pytest
import torch
import lying_tables
from attention_reference import check_kvcache, decode_sass, paged_cache, sync

import rosekernels
from kernel_sass import loop_instructions, sass_of
from rosekernels.kernels import append_kvcache as A
from rosekernels.kernels import attention_decode as D
from rosekernels.kernels import attention_decode_plan
from rosekernels.models import ModelDims
from rosekernels.ops.kvcache import plan_kvcache

BF16, FP16, E4M3 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
QWEN3_8B = ModelDims("qwen3-8b", 4096, 12288, 32, 8, 128)


# ---------------------------------------------------------------------------------------------
# CPU: plans and keys.

def test_keys_and_plans():
    plain = D.kvcache_config_for(D.Shape(batch=16, seqlen_kv=8192), 16, 132)
    fp8 = D.kvcache_config_for(D.Shape(batch=16, seqlen_kv=8192), 16, 132, kv_fp8=True)
    assert "kv_fp8" not in plain.variant().key() and "kv_fp8=True" in fp8.variant().key()
    assert D.DecodeConfig.from_variant(fp8.variant()) == dataclasses.replace(fp8, splits=None)
    assert fp8.tile_bytes * 2 == plain.tile_bytes
    with pytest.raises(ValueError, match="KV-cache variants"):
        D.DecodeConfig(128, "bf16", kv_fp8=True)
    # the plan widens a 16-row e4m3 tile (fp16 MMAs) in registers, a larger one in shared memory
    assert fp8.widen_regs and "widen_regs=True" in fp8.variant().key() and not plain.widen_regs
    shared = dataclasses.replace(fp8, widen_regs=False)
    assert "widen_regs" not in shared.variant().key()
    assert D.DecodeConfig.from_variant(shared.variant()) == dataclasses.replace(shared, splits=None)
    rows32 = D.kvcache_config_for(D.Shape(batch=16, seqlen_q=8, seqlen_kv=8192), 16, 132, kv_fp8=True)
    assert rows32.tile_m == 32 and not rows32.widen_regs
    fp16_rows32 = D.kvcache_config_for(D.Shape(batch=16, seqlen_q=8, seqlen_kv=8192, dtype="fp16"), 16, 132, kv_fp8=True)
    assert fp16_rows32.mma_dtype == "fp16" and not fp16_rows32.widen_regs  # fp16 MMAs, but not 16 rows
    for bad in (dict(tile_m=32), dict(widen_warps=True), dict(kv_fp8=False)):
        with pytest.raises(ValueError, match="widen_regs widens an e4m3 cache"):
            dataclasses.replace(fp8, **bad)
    widen = dataclasses.replace(shared, widen_warps=True)
    assert "widen_warps" not in fp8.variant().key() and "widen_warps=True" in widen.variant().key()
    assert D.DecodeConfig.from_variant(widen.variant()) == dataclasses.replace(widen, splits=None)
    with pytest.raises(ValueError, match="widen_warps widen an e4m3 cache"):
        dataclasses.replace(plain, widen_warps=True)
    found = D.kvcache_variants_for([QWEN3_8B, dataclasses.replace(QWEN3_8B, name="fp8", head_dim=64, fp8_kv=True)])
    assert {(c.head_dim, c.kv_fp8) for c in found} == {(128, False), (64, False), (64, True)}
    assert A.Config.from_variant(A.config_for(A.Shape(16, fp8=True)).variant()).fp8
    assert "fp8" not in A.config_for(A.Shape(16)).variant().key()
    assert {c.fp8 for c in A.variants_for([dataclasses.replace(QWEN3_8B, fp8_kv=True)])} == {False, True}


def test_an_e4m3_cache_is_split_for_two_ctas_per_sm():
    """The e4m3 split model (attention_decode_plan.E4M3_*): a CTA's widening, not its bytes in flight, sets its
    rate, so a second CTA per SM pays. At B = 16 (128 groups, 132 SMs) and 8k keys it splits in two where the
    bf16 cache does not, and it ranks the split counts as the H100 did on full lengths (2, then 4, then 3,
    then 1); with groups for two CTAs per SM already (B = 32, 64) and chunks within E4M3_MAX_SPLIT_BYTES, it
    does not split."""
    for context in (8192, 32768):
        n_tiles = context // 64
        us = {s: attention_decode_plan.launch_us(128, s, -(-n_tiles // s), 16384, 132, kv_fp8=True)
              for s in (1, 2, 3, 4)}
        assert sorted(us, key=us.get) == [2, 4, 3, 1], us
    shape = D.Shape(batch=16, seqlen_kv=8192)
    assert D.kvcache_config_for(shape, None, 132, kv_fp8=True).splits == 2
    assert D.kvcache_config_for(shape, None, 132).splits == 1
    for batch in (32, 64):
        assert D.kvcache_config_for(D.Shape(batch=batch, seqlen_kv=4096), None, 132, kv_fp8=True).splits == 1


def test_an_e4m3_cache_splits_in_chunks_of_at_most_a_mebibyte():
    """The plan sees the capacity, not the lengths: an e4m3 launch's chunks hold at most E4M3_MAX_SPLIT_BYTES
    of K and V (more only where the workspace's indices allow too few splits), so that short sequences leave little time
    to the longest ones' CTAs. The picks the H100 sweep favoured over full and ragged lengths
    (bench/results/gemm/sweeps/fp8_kv_splits_sweep.json): B = 16 at 32k keys 8 splits (the old pick, 2, ran
    1.51x the best where lengths were uniform in [1, S]), B = 1 at 4k 16 (32 ran 1.17x the best on every
    length distribution), B = 64 at 4k unsplit. The bf16 cache's plan is not this model's."""
    cap = attention_decode_plan.E4M3_MAX_SPLIT_BYTES
    for batch, context, heads in [(b, s, h) for b in (1, 3, 16, 64, 128) for s in (1000, 4096, 12288, 65536, 262144)
                                  for h in ((32, 8), (28, 4), (64, 8))]:
        shape = D.Shape(batch=batch, seqlen_kv=context, heads_q=heads[0], heads_kv=heads[1])
        cfg = D.kvcache_config_for(shape, None, 132, kv_fp8=True)
        splits, per, groups = attention_decode_plan.split_plan(cfg, shape, 132)
        assert per * cfg.tile_bytes <= cap, (shape, splits, per)
    # where the workspace's indices allow fewer splits than the cap asks, the most they allow
    assert attention_decode_plan.choose_splits(128, 4096, 16384, 132, max_splits=4, kv_fp8=True) == (4, 1024)
    assert D.kvcache_config_for(D.Shape(batch=16, seqlen_kv=32768), None, 132, kv_fp8=True).splits == 8
    assert D.kvcache_config_for(D.Shape(batch=1, seqlen_kv=4096), None, 132, kv_fp8=True).splits == 16
    assert D.kvcache_config_for(D.Shape(batch=64, seqlen_kv=4096), None, 132, kv_fp8=True).splits == 1
    assert D.kvcache_config_for(D.Shape(batch=16, seqlen_kv=32768), None, 132).splits == 1


def test_the_e4m3_split_model_counts_the_ctas_an_sm_runs():
    """The split model plans waves of min_ctas_per_sm: two for 16-row tiles (built for two) and bf16 MMAs'
    32-row d=128 tiles (asked, ptxas fits both), one for fp16 32-row and all 64-row tiles (GQA 32 and 64), which
    ptxas gives more registers than two CTAs leave. At 132 groups on 132 SMs a launch of two resident CTAs
    splits in two (one wave of two CTAs an SM), one of a single CTA does not (a second wave)."""
    assert attention_decode_plan.choose_splits(132, 64, 16384, 132, kv_fp8=True) == (2, 32)
    assert attention_decode_plan.choose_splits(132, 64, 16384, 132, kv_fp8=True, ctas_per_sm=1) == (1, 64)
    for dtype, heads, tile_m, resident in (("bf16", (32, 8), 16, 2), ("fp16", (32, 8), 16, 2), ("bf16", (32, 1), 32, 2),
                                           ("fp16", (32, 1), 32, 1), ("bf16", (64, 1), 64, 1)):
        for batch in (2, 16, 64, 132):
            shape = D.Shape(batch=batch, seqlen_kv=4096, heads_q=heads[0], heads_kv=heads[1], dtype=dtype)
            cfg = D.kvcache_config_for(shape, None, 132, kv_fp8=True)
            assert (cfg.tile_m, cfg.min_ctas_per_sm) == (tile_m, resident)
            splits, per, groups = attention_decode_plan.split_plan(dataclasses.replace(cfg, splits=None), shape, 132)
            assert (splits, per) == attention_decode_plan.choose_splits(
                groups, -(-4096 // cfg.tile_n), cfg.tile_bytes, 132, attention_decode_plan.MAX_SPLITS, True, resident,
                cfg.partial_bytes)


def test_the_e4m3_combine_is_charged_by_the_partial_sums_it_reads():
    """The last CTA of a group reads every split's partial rows: the split model charges the combine per split in
    proportion to a row tile's partial bytes (tile_m x head_dim fp32), so 64-row tiles take fewer splits than
    16-row ones of the same groups. On an H200 (bench/results/gemm/sweeps/fp8_kv_splits_h200_sweep.json) GQA 64 at
    B = 4, 8k keys ran 59.5 us on the 22 splits the plan took when it charged 16 rows, 39.8 on 16."""
    P = attention_decode_plan
    base = P.launch_us(4, 22, 6, 16384, 132, True, 1)
    assert P.launch_us(4, 22, 6, 16384, 132, True, 1, 4 * P.E4M3_PARTIAL_BYTES) == pytest.approx(
        base + 3 * 22 * P.E4M3_COMBINE_US_PER_SPLIT)
    # smaller partials (d = 64's) are charged as the fitted 16-row d = 128 ones: not measured smaller
    assert P.launch_us(4, 22, 6, 16384, 132, True, 1, P.E4M3_PARTIAL_BYTES // 2) == base
    shape = D.Shape(batch=4, seqlen_kv=8192, heads_q=64, heads_kv=1)
    cfg = D.kvcache_config_for(shape, None, 132, kv_fp8=True)
    assert cfg.tile_m == 64 and cfg.partial_bytes == 4 * P.E4M3_PARTIAL_BYTES and cfg.splits < 22
    assert D.kvcache_config_for(D.Shape(batch=4, seqlen_kv=8192), None, 132, kv_fp8=True).splits == 8  # 16 rows


def test_append_reference_quantizes_as_the_kernel_does():
    """The host reference: e4m3(x * (1 / descale)) per head in fp32, saturating at 448, NaN kept."""
    x = torch.tensor([[[1.0, -3.0, 1e6, float("nan")], [0.5, 7.0, -1e6, 0.0]]], dtype=BF16)[None]  # [1, 1, 2, 4]
    q = A.quantized(x, torch.tensor([0.5, 2.0]))
    assert q.dtype == E4M3
    assert q[0, 0, 0, :3].float().tolist() == [2.0, -6.0, 448.0] and q[0, 0, 0, 3].float().isnan()
    assert q[0, 0, 1].float().tolist() == [0.25, 3.5, -448.0, 0.0]
    one = A.quantized(x, torch.tensor([0.25]))  # one descale for every head
    assert one[0, 0, 1, 1].float() == 28.0


def _e4m3_rn_satfinite(y: torch.Tensor) -> torch.Tensor:
    """The bytes cvt.rn.satfinite.e4m3x2.f32 gives for fp32 values y (NaN: 0x7f), without torch's e4m3 cast:
    the nearest of the finite e4m3 magnitudes (ties to the even code), 448 past it, the sign kept."""
    codes = torch.arange(0x7F, dtype=torch.float64)  # 0x00 .. 0x7e: +0 to 448
    exp, man = codes.div(8, rounding_mode="floor"), codes % 8
    values = torch.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * torch.exp2(exp - 7))
    a = y.double().abs().clamp(max=448.0).nan_to_num(0.0).reshape(-1, 1)
    dist = (a - values).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best  # one code, or two neighbours: the even one
    code = torch.where(tied & (codes.long() % 2 == 0), codes, codes.new_full((), 1000.0)).min(dim=1).values
    code = torch.where(tied.sum(1) == 1, dist.argmin(1).double(), code).long().view(y.shape)
    code = code | y.signbit().long() << 7
    return torch.where(y.isnan(), 0x7F, code).to(torch.uint8)


def test_append_reference_rounds_as_the_hardware_whatever_torch():
    """quantized against a model of the kernel's conversion that is not torch's cast (which
    gives NaN from 464 on before pytorch#178817: it did on an H200 image with torch 2.11): every e4m3
    value, the midpoints between neighbours and a float32 step either side of them, overflow up to inf, NaN."""
    codes = torch.arange(0x7F, dtype=torch.uint8).view(E4M3).float()
    mid = (codes[1:] + codes[:-1]) / 2
    y = torch.cat([codes, mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e9)),
                   torch.tensor([448.5, 463.9, 464.0, 464.1, 479.0, 480.0, 1e4, 3e38, float("inf"), float("nan")])])
    y = torch.cat([y, -y])
    got = A.quantized(y.view(1, 1, -1, 1), torch.ones(1)).view(-1).view(torch.uint8)
    want = _e4m3_rn_satfinite(y)
    nan = y.isnan()
    assert torch.equal(got[~nan], want[~nan]), y[~nan][got[~nan] != want[~nan]]
    assert got[nan].view(E4M3).float().isnan().all()


# ---------------------------------------------------------------------------------------------
# CPU: compiles.

_APPEND = [A.config_for(A.Shape(b, n, paged=paged, dtype=dt, fp8=True))
           for b, n, paged, dt in [(16, 1, True, "bf16"), (1, 4096, False, "fp16"), (4, 3, True, "fp32")]]


@pytest.mark.parametrize("cfg", _APPEND, ids=lambda c: c.variant().key())
def test_append_compiles_to_e4m3_stores(fresh_cache, cfg, tmp_path):
    sass = sass_of(A.compile(cfg), tmp_path)
    if sass is None:
        pytest.skip("nvdisasm not found")
    ops = re.findall(r"^\s*/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    assert any(o.startswith("F2FP.SATFINITE.E4M3.F32") for o in ops) and not {"LDL", "STL"} & set(ops)
    assert ops.count("STG.E.64" if cfg.vec == 8 else "STG.E") == 2, "one e4m3 vector each of k and v"


_ATTENTION = [D.DecodeConfig(128, "bf16", 16, varlen=True, kv_fp8=True),
              D.DecodeConfig(128, "fp16", 16, varlen=True, kv_fp8=True),  # ptxas alone: 169 registers, one CTA an SM
              D.DecodeConfig(128, "bf16", 16, varlen=True, page_rows=16, kv_fp8=True),
              D.DecodeConfig(128, "bf16", 32, varlen=True, kv_fp8=True),  # two CTAs an SM
              D.DecodeConfig(128, "bf16", 32, varlen=True, page_rows=64, kv_fp8=True, num_stages=2),
              D.DecodeConfig(128, "fp16", 64, varlen=True, page_rows=64, kv_fp8=True),
              D.DecodeConfig(64, "bf16", 32, varlen=True, page_rows=16, kv_fp8=True),
              D.DecodeConfig(64, "fp16", 16, varlen=True, kv_fp8=True, num_stages=4),
              D.DecodeConfig(128, "bf16", 16, varlen=True, page_rows=16, kv_fp8=True, num_stages=6)]


_WIDEN_WARPS = [D.DecodeConfig(128, "bf16", 16, varlen=True, kv_fp8=True, widen_warps=True, num_stages=6),
                D.DecodeConfig(128, "bf16", 16, varlen=True, page_rows=16, kv_fp8=True, widen_warps=True),
                D.DecodeConfig(64, "fp16", 64, varlen=True, page_rows=64, kv_fp8=True, widen_warps=True)]


@pytest.mark.parametrize("cfg", _WIDEN_WARPS, ids=lambda c: c.variant().key())
def test_widen_warps_hand_tiles_to_the_mma_warps(fresh_cache, cfg, tmp_path):
    """widen_warps: the widen warps' loop waits for the tile to be free (BAR.SYNC of 224 threads: the MMA
    and widen warps), then for a ring stage, widens it (e4m3 -> f16), releases the stage once read (an
    mbarrier arrive after the last LDS) and hands the tile over once written (BAR.ARV after the last STS);
    the MMA warps' loop waits for the tile before reading it (BAR.SYNC before its first ldmatrix and
    mma.sync) and hands it back once read (BAR.ARV after its last ldmatrix; mma.sync only reads registers,
    so ptxas may place some after it), and neither widens nor touches the ring's mbarriers. (Which barrier
    each uses, base + tile in a register, the GPU tests check: a wrong one hangs.)"""
    sass = decode_sass(cfg, D.compile(cfg), tmp_path)
    mma = loop_instructions(sass, "HMMA")
    widen = loop_instructions(sass, "F2FP.F16.E4M3.UNPACK_B")
    assert not any(line.startswith(("F2FP.F16.E4M3", "SYNCS")) for line in mma), mma
    handoff = 32 * (D.MMA_WARPS + D.WIDEN_WARPS)

    def barriers(lines, op):
        return [i for i, line in enumerate(lines) if line.startswith(op) and line.endswith(f", {handoff:#x}")]

    def at(lines, op):
        return [i for i, line in enumerate(lines) if line.startswith(op)]

    for lines, firsts, lasts in ((mma, ("LDSM", "HMMA"), ("LDSM",)), (widen, ("SYNCS.PHASECHK", "LDS"), ("STS",))):
        (sync,), (arrive,) = barriers(lines, "BAR.SYNC"), barriers(lines, "BAR.ARV")
        assert all(sync < min(at(lines, op)) for op in firsts), (sync, lines)
        assert all(arrive > max(at(lines, op)) for op in lasts), (arrive, lines)
    released = at(widen, "SYNCS.ARRIVE")
    assert released and min(released) > max(at(widen, "LDS.")), widen


_WIDEN_REGS = [D.DecodeConfig(128, "bf16", 16, varlen=True, kv_fp8=True, widen_regs=True),
               D.DecodeConfig(128, "fp16", 16, varlen=True, page_rows=16, kv_fp8=True, widen_regs=True, num_stages=6),
               D.DecodeConfig(64, "bf16", 16, varlen=True, page_rows=32, kv_fp8=True, widen_regs=True)]


@pytest.mark.parametrize("cfg", _WIDEN_REGS, ids=lambda c: c.variant().key())
def test_widen_regs_loads_the_fragments_straight_from_the_ring(fresh_cache, cfg, tmp_path):
    """widen_regs: in the mainloop each MMA warp loads its keys' e4m3 bytes from the ring, 8 or 16 at a time (the
    permuted columns put a thread's bytes of a key together), hands the stage back after its last load and
    before the tile's softmax, and widens in registers: one conversion a fragment register, one byte permute
    for two of V's; no ldmatrix, shared-memory store or barrier of the MMA warps per tile."""
    sass = decode_sass(cfg, D.compile(cfg), tmp_path)
    lines = loop_instructions(sass, "HMMA")
    ops = [line.split()[0] for line in lines]
    keys = cfg.tile_n // cfg.key_slices  # a warp's
    per_thread = 2 * keys * cfg.head_dim // 32  # e4m3 bytes of K and V a thread widens each tile
    widths = {"LDS.128": 16, "LDS.64": 8}
    assert {o for o in ops if o.startswith("LDS")} <= set(widths), ops
    assert sum(widths.get(o, 0) for o in ops) == per_thread
    assert ops.count("F2FP.F16.E4M3.UNPACK_B") == per_thread // 2
    assert ops.count("PRMT") == per_thread // 8  # V's half: a permute per two registers
    assert not [o for o in ops if o.startswith(("LDSM", "STS", "BAR.SYNC"))], ops
    assert ops.count("HMMA.16816.F32") == keys // 8 * cfg.head_dim // 16 + cfg.head_dim // 8 * keys // 16
    released = [i for i, o in enumerate(ops) if o.startswith("SYNCS.ARRIVE")]
    loads = [i for i, o in enumerate(ops) if o.startswith("LDS")]
    assert len(released) == 1 and max(loads) < released[0] < ops.index("MUFU.EX2"), lines  # before the softmax


@pytest.mark.parametrize("cfg", _ATTENTION, ids=lambda c: c.variant().key())
def test_attention_compiles_with_the_widening(fresh_cache, cfg, tmp_path):
    """TMA loads e4m3 tiles (one box per page slice; a row of d bytes: one swizzle atom wide at d = 128),
    the MMA warps widen them (e4m3 -> f16 conversions, a barrier per tile), hand the ring stage back to the
    producer right after that barrier (the mbarrier arrive before the tile's first mma.sync, none after it),
    and run the same mma.sync work per tile as a cache of the query's dtype."""
    sass = decode_sass(cfg, D.compile(cfg), tmp_path)
    boxes = cfg.tile_n // cfg.page_rows if cfg.paged else 1
    assert len(re.findall(r"\bUTMALDG\b", sass)) == 2 * boxes, cfg
    assert re.search(r"F2FP\.F16\.E4M3\.UNPACK_B", sass), "no e4m3 -> f16 conversion"
    # 16-row tiles widen into fp16 whatever the query's dtype: a pair in one conversion, no detour through fp32;
    # larger bf16 tiles keep bf16 MMAs (DecodeConfig.mma_dtype), whose widening takes that detour
    assert bool(re.search(r"\bHADD2\.F32\b", sass)) == (cfg.mma_dtype == "bf16"), cfg
    keys = cfg.tile_n // cfg.key_slices
    assert len(re.findall(r"\bHMMA\.16816", sass)) == keys // 8 * cfg.head_dim // 16 + cfg.head_dim // 8 * keys // 16
    assert re.search(r"BAR\.SYNC(\.DEFER_BLOCKING)? 0x1, 0x80", sass), "no barrier of the MMA warps"
    lines = loop_instructions(sass, "HMMA")
    first_mma = next(i for i, line in enumerate(lines) if line.startswith("HMMA"))
    widened = max(i for i, line in enumerate(lines[:first_mma]) if re.match(r"BAR\.SYNC\S* 0x1, 0x80", line))
    released = [i for i, line in enumerate(lines) if line.startswith("SYNCS.ARRIVE")]
    assert released and all(widened < i < first_mma for i in released), (widened, first_mma, released)


# ---------------------------------------------------------------------------------------------
# CPU: argument errors (CPU tensors: the device check comes last).

def _cache(dtype=E4M3, heads=2):
    return torch.zeros(3, 32, heads, 128, dtype=dtype)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(), TypeError, "needs k_descale"),
    (dict(k_descale=torch.ones(1)), TypeError, "needs v_descale"),
    (dict(k_descale=torch.ones(3), v_descale=torch.ones(1)), ValueError, "k_descale has shape"),
    (dict(k_descale=torch.ones(1, dtype=BF16), v_descale=torch.ones(1)), TypeError, "k_descale has dtype"),
    (dict(k_descale=torch.ones(2), v_descale=torch.ones(2), v_cache=_cache(BF16)), TypeError, "v_cache has dtype"),
    (dict(k_descale=torch.ones(2), v_descale=torch.ones(2)), ValueError, "CUDA"),
    (dict(k_descale=torch.ones(1), v_descale=torch.ones(1), k_cache=_cache(BF16), v_cache=_cache(BF16)),
     ValueError, "for e4m3"),
])
def test_attention_argument_errors(kwargs, error, match):
    args = dict(q=torch.zeros(3, 1, 4, 128, dtype=BF16), k_cache=_cache(), v_cache=_cache(),
                cache_seqlens=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(error, match=match):
        rosekernels.attention_with_kvcache(**{**args, **kwargs})


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(), TypeError, "needs k_descale"),
    (dict(k=torch.zeros(3, 1, 2, 128, dtype=E4M3)), TypeError, "k has dtype"),
    (dict(v=torch.zeros(3, 1, 2, 128, dtype=FP16)), TypeError, "v has dtype"),
    (dict(k_descale=torch.ones(4), v_descale=torch.ones(1)), ValueError, "k_descale has shape"),
    (dict(k_descale=torch.ones(2), v_descale=torch.ones(2)), ValueError, "CUDA"),
])
def test_append_argument_errors(kwargs, error, match):
    args = dict(k_cache=_cache(), v_cache=_cache(), k=torch.zeros(3, 1, 2, 128, dtype=BF16),
                v=torch.zeros(3, 1, 2, 128, dtype=BF16), cache_seqlens=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(error, match=match):
        rosekernels.append_kvcache(**{**args, **kwargs})



def test_append_descales_on_another_device_are_refused(monkeypatch):
    """The descales go through the device checks of the other tensors (as attention_with_kvcache's do): on
    another device than the cache they are refused."""
    from rosekernels import checks
    from rosekernels.ops import append_kvcache as op

    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)  # the CPU tensors stand in for the GPU's
    meta = torch.ones(2, device="meta")
    k = torch.zeros(3, 1, 2, 128, dtype=BF16)
    with pytest.raises(ValueError, match="different devices"):
        op._validate(_cache(), _cache(), k, k.clone(), torch.zeros(3, dtype=torch.int32), None, meta, meta)

# ---------------------------------------------------------------------------------------------
# GPU

def _descales(heads, per_head, g):
    """Powers of two (the dequantized cache is then exact in the query's dtype), one per head or one."""
    exponents = torch.randint(-4, 2, (heads if per_head else 1,), generator=g).float()
    return torch.exp2(exponents).cuda(), torch.exp2(exponents.flip(0) - 1).cuda()


def _dequantized(cache, descale, dtype):
    return (cache.float() * descale.view(-1, 1).expand(cache.shape[2], 1)).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_append_writes_the_reference_bytes(paged, per_head):
    g = torch.Generator().manual_seed(paged + 2 * per_head)
    for dtype, new in ((BF16, 1), (FP16, 5), (torch.float32, 40)):
        case = A.random_case(g, 6, new, 4, 128, dtype, paged, fp8=True)
        k_d, v_d = case[6:] if per_head else (case[6][:1], case[7][:1])
        want = A.reference(*case[:6], k_d, v_d)
        rosekernels.append_kvcache(*case[:6], k_d, v_d)
        for got, ref in zip(case[:2], want):
            assert torch.equal(got.cpu().view(torch.uint8), ref.view(torch.uint8)), (dtype, new)


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [{}, {"splits": 1}, {"num_stages": 6, "splits": 1}, {"widen_regs": False},
                                    {"widen_regs": False, "splits": 1},
                                    {"widen_warps": True, "widen_regs": False},
                                    {"widen_warps": True, "widen_regs": False, "splits": 1},
                                    {"widen_warps": True, "widen_regs": False, "num_stages": 6, "splits": 1}],
                         ids=["planned", "1-split", "6-stages-1-split", "shared-widening", "shared-widening-1-split", "widen-warps",
                              "widen-warps-1-split", "widen-warps-6-stages-1-split"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
def test_attention_matches_the_dequantized_reference(d, dtype, paged, fields):
    """B = 5 with lengths 0, 1 and the full cache among random ones, S_q 1 and 4 (causal), S_q 1 at GQA 8 (not),
    per-tensor and per-head descales; the cache rows past each length NaN (e4m3 0x7f): they must not reach the
    output. Through the op (16-row tiles: widened in registers), and into NaN-filled outputs on one split (so
    that a CTA runs up to 11 tiles: the rings wrap, the widened tiles go round, the hand-backs are waited for;
    the plan's 10 groups get 1-2 tiles a split) and on the variants the plan does not take (a 6-stage ring, the
    widening in shared memory, widen warps)."""
    g = torch.Generator().manual_seed(d + paged)
    scale = 1.0 / math.sqrt(d)
    for i, (s_q, per_head) in enumerate(((1, False), (4, True), (1, True))):
        s_max = int(torch.randint(64, 700, (1,), generator=g))
        lengths = torch.cat([torch.tensor([0, 1, s_max]), torch.randint(0, s_max + 1, (2,), generator=g)])
        lengths = lengths[torch.randperm(5, generator=g)].to(torch.int32).cuda()
        k_descale, v_descale = _descales(2, per_head, g)
        k, v = (torch.randn(5, s_max, 2, d, generator=g).cuda() * 4 for _ in range(2))
        k_q, v_q = A.quantized(k, k_descale), A.quantized(v, v_descale)
        past = torch.arange(s_max, device="cuda")[None, :] >= lengths[:, None]
        assert not (k_q.float()[~past].isnan().any() or v_q.float()[~past].isnan().any()), "the reference's e4m3 NaN"
        k_q.view(torch.uint8)[past] = 0x7F  # NaN past each length
        v_q.view(torch.uint8)[past] = 0x7F
        table = None
        if paged:
            k_q, v_q, table = paged_cache(k_q.view(torch.uint8), v_q.view(torch.uint8), lengths.cpu(), 16, 3, g)
            k_q, v_q = k_q.view(E4M3), v_q.view(E4M3)
        heads = 16 if i == 2 else 8  # GQA 8 in the last case, 4 in the others
        q = torch.randn(5, s_q, heads, d, generator=g).to(dtype).cuda()
        causal = i < 2
        if not fields:
            out, lse = rosekernels.attention_with_kvcache(q, k_q, v_q, lengths, table, softmax_scale=scale,
                                                          causal=causal, return_lse=True, k_descale=k_descale,
                                                          v_descale=v_descale)
        else:
            out = torch.full_like(q, math.nan)
            lse = torch.full((5, heads, s_q), math.nan, device="cuda")
            plan = plan_kvcache(q, k_q, v_q, out, lengths, table, causal, scale, **fields)
            assert all(getattr(plan.cfg, f) == v for f, v in fields.items())
            plan.launch(q, k_q, v_q, out, lse, lengths, table, k_descale, v_descale)
        sync(f"fp8 cache d={d} {dtype} paged={paged} {fields}")
        k_ref, v_ref = _dequantized(k_q, k_descale, dtype), _dequantized(v_q, v_descale, dtype)  # NaN rows unread
        check_kvcache(out, lse, q, k_ref, v_ref, lengths, table, causal, scale,
                      f"e4m3 cache d={d} {dtype} paged={paged} s_q={s_q} per_head={per_head}")


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [2.0 ** 14, 2.0 ** -20, 0.0], ids=["past-fp16-range", "tiny", "zero"])
def test_bf16_queries_of_any_magnitude_meet_the_fp16_mmas(q_scale):
    """The e4m3 cache's MMAs run in fp16, a bf16 query scaled into it by a power of two per row block:
    queries past fp16's range (N(0, 1) x 2^14: some elements over 65504), tiny ones (x 2^-20, under fp16's
    normal range) and zero ones (a uniform softmax), with the softmax scale divided by the same factor so
    that the logits stay those of N(0, 1) queries, match the dequantized reference."""
    g = torch.Generator().manual_seed(7)
    d, s_max = 128, 600
    lengths = torch.tensor([s_max, 1, 333, 0, 517], dtype=torch.int32).cuda()
    k_descale, v_descale = _descales(2, True, g)
    k, v = (torch.randn(5, s_max, 2, d, generator=g).cuda() * 4 for _ in range(2))
    k_q, v_q = A.quantized(k, k_descale), A.quantized(v, v_descale)
    q = (torch.randn(5, 1, 8, d, generator=g) * q_scale).to(BF16).cuda()
    scale = 1.0 / math.sqrt(d) / (q_scale or 1.0)
    out, lse = rosekernels.attention_with_kvcache(q, k_q, v_q, lengths, None, softmax_scale=scale, causal=False,
                                                  return_lse=True, k_descale=k_descale, v_descale=v_descale)
    sync(f"bf16 queries x {q_scale}")
    k_ref, v_ref = _dequantized(k_q, k_descale, BF16), _dequantized(v_q, v_descale, BF16)
    check_kvcache(out, lse, q, k_ref, v_ref, lengths, None, False, scale, f"bf16 queries x {q_scale}")

@pytest.mark.gpu
def test_append_then_attend():
    """A decode loop on an e4m3 paged cache: each step appends one token (quantized on the way in) and attends
    to everything so far, against the float64 reference on the dequantized cache."""
    g = torch.Generator().manual_seed(3)
    heads, d, steps = 8, 128, 40
    k_descale, v_descale = torch.full((heads,), 2.0 ** -5, device="cuda"), torch.full((1,), 2.0 ** -4, device="cuda")
    cache = torch.full((4 * 8, 16, heads, d), 0x7F, dtype=torch.uint8, device="cuda").view(E4M3)
    k_cache, v_cache = cache, cache.clone()
    table = torch.randperm(32, generator=g)[:4 * 3].view(4, 3).to(torch.int32).cuda()
    # Sequences start at lengths 0, 5, 0, 2: their first rows hold tokens (the rest of the cache NaN).
    lengths = torch.zeros(4, dtype=torch.int32, device="cuda")
    k, v = (torch.randn(4, 5, heads, d, generator=g).to(BF16).cuda() for _ in "kv")
    rosekernels.append_kvcache(k_cache, v_cache, k, v, lengths, table, k_descale, v_descale)
    lengths = torch.tensor([0, 5, 0, 2], dtype=torch.int32, device="cuda")
    for _ in range(steps):
        k, v = (torch.randn(4, 1, heads, d, generator=g).to(BF16).cuda() for _ in "kv")
        rosekernels.append_kvcache(k_cache, v_cache, k, v, lengths, table, k_descale, v_descale)
        lengths += 1
        q = torch.randn(4, 1, 32, d, generator=g).to(BF16).cuda()
        out, lse = rosekernels.attention_with_kvcache(q, k_cache, v_cache, lengths, table, return_lse=True,
                                                      k_descale=k_descale, v_descale=v_descale)
    # (The NaN rows past each length dequantize to NaN: the reference reads only the sequences' rows.)
    k_ref, v_ref = _dequantized(k_cache, k_descale, BF16), _dequantized(v_cache, v_descale, BF16)
    check_kvcache(out, lse, q, k_ref, v_ref, lengths, table, True, 1 / math.sqrt(d), "append then attend")


@pytest.mark.gpu
def test_append_refuses_host_descales_on_a_planned_signature():
    """The descales' device is in the fast path's key: after a call has planned the signature, descales on the
    host are refused as on a first call, and nothing is written."""
    k_cache, v_cache = (torch.zeros(3, 32, 2, 128, dtype=E4M3, device="cuda") for _ in "kv")
    k = torch.ones(3, 1, 2, 128, dtype=BF16, device="cuda")
    lengths, descale = torch.zeros(3, dtype=torch.int32, device="cuda"), torch.ones(1, device="cuda")
    rosekernels.append_kvcache(k_cache, v_cache, k, k, lengths, None, descale, descale)
    written = [c.view(torch.uint8).clone() for c in (k_cache, v_cache)]
    with pytest.raises(ValueError, match="k_descale must be on a CUDA device"):
        rosekernels.append_kvcache(k_cache, v_cache, 2 * k, 2 * k, lengths, None, descale.cpu(), descale.cpu())
    torch.cuda.synchronize()
    assert all(torch.equal(c.view(torch.uint8), w) for c, w in zip((k_cache, v_cache), written))


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_lying_tables_and_lengths_on_e4m3_caches_touch_only_the_cache(paged):
    """tests/support/lying_tables.py's lies on e4m3 caches with per-head descales, between canary pages of the
    same allocation: attention reads each sequence's valid keys dequantized and never the NaN canaries, and
    writes no cache; append quantizes into the cache as its reference does and leaves every canary byte."""
    seed = int.from_bytes(os.urandom(4), "little")
    lying_tables.attention_lies(paged, 128, BF16, seed=seed, canaries=2, fp8=True)
    lying_tables.append_lies(paged, seed=seed + 1, canaries=2, fp8=True)
