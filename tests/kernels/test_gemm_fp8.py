"""gemm_fp8: every tile family compiles for sm_90a with FP8 WGMMA (e4m3), TMA, no spills and the promotion of
each k-tile's sums to fp32 inside the mainloop (CPU); argument errors before any launch (CPU); the reference
and its check (CPU); results against the float64 reference on the dequantized operands (GPU). The plan is
tested in test_gemm_fp8_plan.py."""
import dataclasses
import math
import re

import pytest
import torch

import rosekernels
from kernel_sass import descriptor_copies, loop_instructions, loop_opcodes, sass_of
from rosekernels import checks, fp8
from rosekernels.kernels import gemm_fp8 as gk
from rosekernels.kernels import gemm_fp8_plan as plan
from rosekernels.ops import gemm_fp8 as op

E4M3, BF16, FP16, FP32 = torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32
C = plan.Fp8GemmConfig


# ---------------------------------------------------------------------------------------------
# CPU: compilation.

def _families(scales):
    """A config of every tile family: swapped 64 / 128 weight rows (8 .. 128 tokens, clusters), plain decode
    tiles loading a_rows of A or whole ones (clusters), prefill cooperative (with and without `stagger`;
    per-channel scales also the wide tiles, at the most registers: gated, fp32 bias) and pingpong; epilogues."""
    d = dict(split_k=True, cluster_m=1, activation="none", scales=scales)
    wide = [C(tile_m=128, tile_n=160, activation="silu", gated=True, bias="fp32", scales=scales),
            C(tile_m=128, tile_n=160, activation="leaky_relu", slope=0.2, dtype="fp16", bias="fp16", scales=scales,
              stagger=True),
            C(tile_m=128, tile_n=176, activation="silu", dtype="fp16", bias="fp32", scales=scales),
            C(tile_m=128, tile_n=176, cluster_m=1, cluster_n=2, activation="gelu_tanh", bias="bf16", scales=scales,
              stagger=True)] if scales == "rowcol" else []
    return wide + [C(tile_m=64, tile_n=8, swap_ab=True, **d),
            C(tile_m=64, tile_n=128, swap_ab=True, **d),
            C(tile_m=128, tile_n=32, swap_ab=True, **{**d, "activation": "silu"}, gated=True, bias="fp32"),
            C(tile_m=64, tile_n=16, swap_ab=True, **{**d, "cluster_m": 4}),
            C(tile_m=64, tile_n=64, swap_ab=True, **{**d, "cluster_n": 2}, bias="bf16"),
            C(tile_m=64, tile_n=128, a_rows=8, **d),
            C(tile_m=64, tile_n=64, a_rows=32, **{**d, "activation": "relu"}, gated=True),
            C(tile_m=128, tile_n=128, **{**d, "cluster_n": 2}, dtype="fp16", bias="fp16"),
            C(tile_m=64, tile_n=64, **{**d, "cluster_m": 2}),
            C(tile_m=128, tile_n=128, activation="none", scales=scales),
            C(tile_m=128, tile_n=128, cluster_m=1, cluster_n=1, activation="none", scales=scales),  # cuBLAS's
            C(tile_m=128, tile_n=64, pingpong=True, activation="gelu_tanh", gated=True, bias="bf16", scales=scales),
            C(tile_m=128, tile_n=128, cluster_m=1, cluster_n=2, activation="leaky_relu", slope=0.2, scales=scales),
            C(tile_m=128, tile_n=128, activation="silu", gated=True, bias="fp32", scales=scales, stagger=True)]


_CONFIGS = _families("rowcol") + _families("block")
_CONFIGS += [c for c in gk.variants_for() if c not in _CONFIGS][:6]


def _id_source(lines, at, reg):
    """What the barrier id in register `reg` at lines[at] comes from: the uniform register the loop last moved
    into it, else the loop's last other instruction writing it (ptxas short of registers recomputes both ids
    into one from the thread index: `IADD3 R3, R3, 0x3` and `IADD3 R3, -R3, 0x4`), else the register itself."""
    for line in reversed(lines[:at]):
        moved = re.fullmatch(rf"MOV {reg}, (UR\d+)", line)
        if moved:
            return moved.group(1)
        if re.match(rf"\S+ {reg}\b", line):  # written some other way
            return line
    return reg


@pytest.mark.parametrize("cfg", _CONFIGS, ids=lambda c: c.variant().key())
def test_compiles_with_fp8_wgmma_and_promotion(fresh_cache, cfg, tmp_path):
    kernel = gk.compile(cfg)
    assert kernel.variant == cfg.variant()
    sass = sass_of(kernel, tmp_path)
    if sass is None:
        pytest.skip("nvdisasm not found: compiled, SASS not inspected")
    ops = re.findall(r"^\s*/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    assert re.search(r"QGMMA\.64x\d+x32\.F32\.E4M3\.E4M3", sass), "no FP8 (e4m3) WGMMA"
    assert "UTMALDG.2D" in ops and not {"LDL", "STL"} & set(ops), (cfg, sorted(set(ops)))
    # Swapped tiles store out^T element by element from registers; the others through shared memory and TMA.
    stores = ("STG.E.U16",) if cfg.swap_ab else ("UTMASTG", "STSM")
    assert all(any(o.startswith(s) for o in ops) for s in stores), (stores, sorted(set(ops)))
    # Decode tiles send their first weight k-tiles toward the L2 before griddepcontrol.wait (ACQBULK); prefill none.
    prefetch, wait = sass.find("UTMAPF.L2"), sass.find("ACQBULK")
    assert (0 <= prefetch < wait) if cfg.split_k else (prefetch < 0 <= wait), (cfg, prefetch, wait)
    # The mainloop: a k-tile's WGMMAs (4 of K = 32), the wait for them, then the promotion of every
    # accumulator element of the thread: FADDs (rowcol) or FFMAs by the k-tile's scales (block), and for
    # block scales the loads of those scales.
    loop = loop_opcodes(sass, "QGMMA")
    mma_m = cfg.tile_m // (64 * plan.bf16.wg_per_tile(cfg))  # 64-row WGMMAs a warpgroup's tile stacks
    elements = mma_m * cfg.tile_n // 2  # of a thread's accumulator
    qgmma = [i for i, o in enumerate(loop) if o.startswith("QGMMA")]
    assert len(qgmma) == 4 * mma_m and "WARPGROUP.DEPBAR.LE" in loop[qgmma[-1]:]
    after = loop[qgmma[-1]:]
    promotion = "FADD" if cfg.scales == "rowcol" else "FFMA"
    assert after.count(promotion) >= elements, (promotion, after.count(promotion), elements)
    if cfg.scales == "block":
        assert "LDG.E" in loop[:qgmma[0]], "the k-tile's scales are loaded before its WGMMAs"
    copies, wgmmas = descriptor_copies(sass, "QGMMA")
    assert copies < wgmmas, f"{cfg}: {copies} R2UR for {wgmmas} WGMMAs: descriptors copied a WGMMA"
    # One k-tile per promotion: each of the mma_m WGMMA chains starts from zero (no accumulator in: "RZ, !UPT")
    # and its other 3 WGMMAs accumulate into its registers; the promotion waits for all of them (wait_group 0)
    # and reads every register they wrote (a chain carried on into the next k-tile, or promoted before its
    # last WGMMA, sums more than 128 products in WGMMA's reduced precision).
    lines = loop_instructions(sass, "QGMMA")
    chains = [line for line in lines if line.startswith("QGMMA")]
    assert sum(line.endswith(", RZ, !UPT") for line in chains) == mma_m, chains
    dests = {re.match(r"QGMMA\S* R(\d+),", line).group(1) for line in chains}
    assert len(dests) == mma_m, chains
    written = {f"R{int(d) + i}" for d in dests for i in range(cfg.tile_n // 2)}  # 64 x N fp32: N / 2 a thread
    last = max(i for i, line in enumerate(lines) if line.startswith("QGMMA"))
    wait = next(i for i in range(last, len(lines)) if lines[i].startswith("WARPGROUP.DEPBAR"))
    assert lines[wait] == "WARPGROUP.DEPBAR.LE gsb0, 0x0", lines[wait]
    # While the chain runs, the next stage's full barrier is polled (its answer decides, after the promotion,
    # whether the next chain must wait), as cuBLAS's FP8 kernel does (bench/results/gemm/sweeps/
    # fp8_prefill_ncu_h100.md); a stage is released between the wait and the promotion. (Which stage, this
    # k-tile's or the one before, the SASS does not show: the GPU tests' long-K and many-unit cases would
    # hang or corrupt if a stage were released twice or early.)
    assert any(line.startswith("SYNCS.PHASECHK.TRANS64.TRYWAIT") for line in lines[last:wait]), lines[last:wait + 1]
    first_promotion = next(i for i in range(wait, len(lines)) if lines[i].split()[0] == promotion)
    assert any(line.startswith("SYNCS.ARRIVE") for line in lines[wait:first_promotion]), lines[wait:first_promotion]
    # stagger: the warpgroup takes its turn (BAR.SYNC) before the k-tile's first WGMMA and hands it over
    # (BAR.ARV) after the last one, before it waits for them, on the other barrier of the pair (ids in two
    # registers: 3 + its warpgroup, 4 - it), both warpgroups counted (256 threads); warpgroup 0 has had
    # the first turn given (BAR.ARV 0x3 before the loop). Without stagger, no named barrier in the loop.
    first = min(i for i, line in enumerate(lines) if line.startswith("QGMMA"))
    syncs = [(i, line) for i, line in enumerate(lines) if line.startswith("BAR.SYNC")]
    arrives = [(i, line) for i, line in enumerate(lines) if line.startswith("BAR.ARV")]
    if cfg.stagger:
        assert len(syncs) == len(arrives) == 1 and syncs[0][0] < first and last < arrives[0][0] < wait, lines
        (sync_id, sync_count), (arrive_id, arrive_count) = (line.split(None, 1)[1].split(", ")
                                                            for line in (syncs[0][1], arrives[0][1]))
        assert sync_count == arrive_count == "0x100" and sync_id.startswith("R") and arrive_id.startswith("R"), lines
        # Two ids: two registers, or one register loaded from two uniform ones or computed twice (short of registers).
        assert _id_source(lines, syncs[0][0], sync_id) != _id_source(lines, arrives[0][0], arrive_id), lines
        assert re.search(r"BAR\.ARV 0x3, 0x100", sass[:sass.index("QGMMA")]), "warpgroup 0 is given no first turn"
    else:
        assert not syncs and not arrives, lines
    promoting = [line for line in lines[last:] if line.split()[0] == promotion]
    assert all(i > wait for i, line in enumerate(lines) if line in promoting and i > last)
    read = {r for line in promoting for r in re.findall(r"R\d+", line.split(None, 1)[1].split(",", 1)[1])}
    assert written <= read, sorted(written - read)


@pytest.mark.parametrize("a_rows", (8, 16, 32, 64))
def test_a_smem_layouts_with_e4m3(a_rows):
    """The TMA view of the A stages of an FP8 decode tile (128 e4m3 a row: one SW128 atom) is the first a_rows
    rows of the WGMMA view; stages a_rows * 128 bytes apart keep the 1024-byte swizzle phase."""
    import cutlass
    import cutlass.cute as cute

    from rosekernels.kernels import gemm_leakyrelu as glr
    from rosekernels.kernels import gemm_splitk as splitk

    cfg = C(tile_m=64, tile_n=128, cluster_m=1, split_k=True, a_rows=a_rows)
    device = glr.GemmSm90(cfg)
    assert device.tile_k == plan.TILE_K and device.ab_dtype is cutlass.Float8E4M3FN
    stages = device.ab_stage
    coords = [(r, c, s) for s in (0, 1, stages - 1) for r in range(a_rows) for c in (0, 1, 15, 16, 127)]
    found = {}

    @cute.jit
    def check():
        mma, load = splitk.a_smem_layouts(cfg, cutlass.Float8E4M3FN, stages, plan.TILE_K)
        found["load"] = [load.outer(c) for c in coords]
        found["mma"] = [mma.outer(c) for c in coords]
        found["starts"] = [mma.outer((0, 0, s)) for s in range(stages)]
        found["swizzles"] = (str(mma.inner), str(load.inner))

    cute.compile(check)
    assert found["load"] == found["mma"] and found["swizzles"][0] == found["swizzles"][1]
    assert found["starts"] == [s * a_rows * 128 for s in range(stages)]


def test_module_follows_the_contract():
    assert gk.Config is plan.Fp8GemmConfig and gk.Shape is plan.Fp8GemmShape


# ---------------------------------------------------------------------------------------------
# CPU: argument errors fire before anything runs (CPU tensors never reach a kernel: the device check
# comes last, so every other error is reachable without a GPU).

def _operands(m=4, n=16, k=128, scheme="channel", a_dtype=E4M3, **over):
    a = torch.zeros(m, k, dtype=a_dtype)
    w = torch.zeros(n, k, dtype=E4M3)
    scales = {"tensor": (torch.ones(1), torch.ones(1)), "channel": (torch.ones(m), torch.ones(n)),
              "block": (torch.ones(m, -(-k // 128)), torch.ones(-(-n // 128), -(-k // 128)))}[scheme]
    args = dict(a=a, a_scale=scales[0], w=w, w_scale=scales[1])
    args.update(over)
    return args


@pytest.mark.parametrize("case, error, match", [
    (_operands(), ValueError, "CUDA device"),
    (_operands(scheme="tensor"), ValueError, "CUDA device"),
    (_operands(scheme="block"), ValueError, "CUDA device"),
    (_operands(a_dtype=BF16), TypeError, "a has dtype"),
    (_operands(w=torch.zeros(16, 128, dtype=BF16)), TypeError, "w has dtype"),
    (_operands(a_scale=torch.ones(4, dtype=torch.float64)), TypeError, "a_scale has dtype"),
    (_operands(a_scale=torch.ones(5)), ValueError, "no scale scheme"),
    (_operands(w_scale=torch.ones(16, 2)), ValueError, "no scale scheme"),
    (_operands(scheme="block", w_scale=torch.ones(1, 2)), ValueError, "no scale scheme"),
    (_operands(k=256, scheme="block", a_scale=torch.ones(4)), ValueError, "no scale scheme"),
    (_operands(k=144, scheme="block"), ValueError, "not a multiple of 128"),  # groups of 128 do not divide K
    (_operands(k=120), ValueError, "multiple of 16"),
    (_operands(n=12, w_scale=torch.ones(12)), ValueError, "multiple of 8"),
    (_operands(gated=True, n=24, w_scale=torch.ones(24)), ValueError, "multiple of 16"),
    (_operands(w=torch.zeros(16, 64, dtype=E4M3)), ValueError, "K = 64"),
    (_operands(a=torch.zeros(4, 128, 1, dtype=E4M3)), ValueError, "2-D"),
    (_operands(bias=torch.zeros(8)), ValueError, "bias has shape"),
    (_operands(bias=torch.zeros(16, dtype=torch.int32)), TypeError, "bias has dtype"),
    (_operands(out=torch.zeros(4, 16)), TypeError, "out has dtype"),
    (_operands(out=torch.zeros(4, 8, dtype=BF16)), ValueError, "out has shape"),
    (_operands(out_dtype=torch.float32), ValueError, "out_dtype"),
    (_operands(activation="gelu"), ValueError, "activation"),
    (_operands(w=torch.zeros(128, 16, dtype=E4M3).t()), ValueError, "unit stride"),
    (_operands(a=torch.zeros(4, 136, dtype=E4M3)[:, :128]), ValueError, "aligned"),
])
def test_argument_errors(case, error, match):
    out = case.get("out")
    before = None if out is None else out.clone()
    with pytest.raises(error, match=match):
        rosekernels.gemm_fp8(**case)
    assert out is None or torch.equal(out, before)


def test_out_overlapping_an_input_is_rejected():
    scales = torch.ones(64)
    args = _operands(a_scale=scales[:4], out=scales.view(BF16).view(4, 32)[:, :16])
    with pytest.raises(ValueError, match="overlap a_scale"):
        rosekernels.gemm_fp8(**args)


def test_out_may_interleave_rows_with_a_but_not_share_its_elements(monkeypatch):
    """a (e4m3) and out (bf16) as column blocks of one buffer of 160-byte rows share a span, not an element: the
    call launches, planned and then on its fast path; an out of the same strides over a's last 32 bytes of each
    row is refused by the fast path with nothing launched (CPU: the device parts stubbed)."""
    from stub_launch import stub_launches

    launched = stub_launches(monkeypatch, gk, op)
    monkeypatch.setattr(op, "config_for", lambda shape, sms=None: gk.Config(activation="none", tile_n=128))  # no split-K
    rows = torch.zeros(5, 160, dtype=torch.uint8)
    args = _operands(a=rows[:4, :128].view(E4M3))
    for _ in range(2):
        rosekernels.gemm_fp8(**args, out=rows[:4, 128:].view(BF16))
    assert len(launched) == 2
    with pytest.raises(ValueError, match="out must not overlap a"):
        rosekernels.gemm_fp8(**args, out=rows[1:5, 96:128].view(BF16))
    assert len(launched) == 2


def test_meta_tensors_infer_shapes_and_check_them():
    meta = {k: v.to("meta") for k, v in _operands(m=4, n=32, k=256).items()}
    out = rosekernels.gemm_fp8(**meta, gated=True, out_dtype=FP16)
    assert out.shape == (4, 16) and out.dtype == FP16 and out.is_meta
    with pytest.raises(ValueError, match="no scale scheme"):
        rosekernels.gemm_fp8(**{**meta, "a_scale": torch.empty(3, device="meta")})


# ---------------------------------------------------------------------------------------------
# CPU: the reference and its check.

def test_reference_is_the_product_of_the_dequantized_operands():
    g = torch.Generator().manual_seed(0)
    for scales, per_tensor in (("rowcol", True), ("rowcol", False), ("block", False)):
        a, a_scale, w, w_scale = gk.random_operands(5, 264, 384, scales, g, "cpu", per_tensor)
        ref = gk.reference(a, a_scale, w, w_scale)
        blocks_a = (1, 128) if scales == "block" else ((None, None) if per_tensor else (1, None))
        blocks_w = (128, 128) if scales == "block" else ((None, None) if per_tensor else (1, None))
        want = fp8.dequantize(a, a_scale, *blocks_a) @ fp8.dequantize(w, w_scale, *blocks_w).t()
        assert torch.allclose(ref, want, rtol=1e-12, atol=0)


def test_the_check_can_fail():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(64, 256, generator=g, dtype=torch.float64)
    spread = gk.ACC_ERROR  # as if each sum's products had root-sum-square 1
    gk.check_out(ref.to(BF16), ref, spread)
    with pytest.raises(AssertionError, match="error norm"):
        gk.check_out((ref * (1 + 2 ** -6)).to(BF16), ref, spread)
    off = ref.to(BF16)
    off[3, 7] += 0.05
    with pytest.raises(AssertionError, match="element"):
        gk.check_out(off, ref, spread)
    off[3, 7] = math.nan
    with pytest.raises(AssertionError, match="NaN"):
        gk.check_out(off, ref, spread)


def test_the_spread_follows_each_sums_products():
    """random_operands' rows span 2^8 in magnitude: an element's allowance for the error of the FP8 sums scales
    with its own products (sigma), not with the reference's rms (the H200 run's test_workload failed an element
    of a large row, 0.0115 off at 0.40, against 2^-10 of the rms); gated, with both sums' errors."""
    g = torch.Generator().manual_seed(2)
    a, a_scale, w, w_scale = gk.random_operands(64, 32, 256, "rowcol", g, "cpu")
    ref, spread = gk.reference_and_spread(a, a_scale, w, w_scale)
    assert torch.equal(ref, gk.reference(a, a_scale, w, w_scale))
    da, dw = gk.dequantized(a, a_scale, 1), gk.dequantized(w, w_scale, fp8.BLOCK)
    sigma = (da.square() @ dw.square().t()).sqrt()
    assert torch.allclose(spread, gk.ACC_ERROR * sigma, rtol=1e-12, atol=0)
    rows = ref.square().mean(1).sqrt()
    small, large = rows.argmin().item(), rows.argmax().item()
    assert rows[large] > 16 * rows[small]
    for row in (small, large):  # 1.5 spreads past the ulp term fails, 0.5 passes, on a small row as on a large one
        col = ref[row].abs().argmin().item()
        for over, fails in ((1.5, True), (0.5, False)):
            out = ref.to(BF16)
            out[row, col] = ref[row, col] + over * spread[row, col] + 2.0 ** -7 * ref[row, col].abs()
            if fails:
                with pytest.raises(AssertionError, match=rf"element \({row}, {col}\)"):
                    gk.check_out(out, ref, spread)
            else:
                gk.check_out(out, ref, spread)
    bias = torch.randn(32, generator=g, dtype=torch.float64)
    ref, spread = gk.reference_and_spread(a, a_scale, w, w_scale, bias, "silu", gated=True)
    assert ref.shape == (64, 16) and torch.equal(ref, gk.reference(a, a_scale, w, w_scale, bias, "silu", True))
    y, d = (t.unflatten(-1, (-1, 2, 8)) for t in (da @ dw.t() + bias, gk.ACC_ERROR * sigma))
    gate, up, d_gate, d_up = y[..., 0, :], y[..., 1, :], d[..., 0, :], d[..., 1, :]
    s = torch.sigmoid(gate)  # silu'(x) = s (1 + x (1 - s)): to first order, |silu'(gate) up| d_gate + |silu(gate)| d_up
    first_order = ((s * (1 + gate * (1 - s)) * up).abs() * d_gate + (gate * s).abs() * d_up).flatten(-2)
    evaluation = (gk.EVAL_ERROR * (gate * up).abs()).flatten(-2)  # the fp32 epilogue's own error, added
    assert torch.allclose(spread - evaluation, first_order, rtol=0.1, atol=0)  # (second-order terms: a few %)


def test_fp16_subnormal_outputs_round_in_steps():
    """Under fp16's smallest normal (6.1e-5) values round to steps of 2^-24, more than an ulp of the value (the
    H200 run failed a leaky_relu output of 2.3e-5, 2.4e-8 off): the exactly rounded output passes, one step
    more does not."""
    ref = torch.linspace(1e-7, 6e-5, 4096, dtype=torch.float64).reshape(64, 64)
    out = ref.to(FP16)
    gk.check_out(out, ref, 0.0)
    out[5, 7] += 2.0 ** -23
    with pytest.raises(AssertionError, match=r"element \(5, 7\)"):
        gk.check_out(out, ref, 0.0)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("out_dtype", [BF16, FP16])
def test_the_fp32_epilogue_passes_and_a_wrong_output_does_not(out_dtype, gated):
    """gelu_tanh as the kernel evaluates it, in fp32: 0.5 y (1 + tanh(u)) cancels as tanh(u) -> -1, so the tiny
    outputs of y from -5 down keep |y| times tanh's rounding (the H200 run failed fp16 outputs near 1e-7,
    a few subnormal steps wide, and bf16 ones). Sums of like-signed products (y = +-s, sigma = s / 16) keep
    the accumulation's allowance far under that. Such an output passes; one element off by twice its
    allowance does not."""
    m, n, k = 96, 32, 256
    a = torch.ones(m, k).to(E4M3)
    w = torch.ones(n, k)
    w[n // 2:] = -1
    w = w[torch.randperm(n, generator=torch.Generator().manual_seed(3))].to(E4M3)
    a_scale, w_scale = torch.linspace(0.25, 12, m), torch.full((n,), 1 / k)
    ref, spread = gk.reference_and_spread(a, a_scale, w, w_scale, None, "gelu_tanh", gated)
    y = (gk.dequantized(a, a_scale, 1) @ gk.dequantized(w, w_scale, fp8.BLOCK).t()).float()
    gelu = 0.5 * y * (1.0 + torch.tanh(0.7978845608028654 * (y + 0.044715 * y * y * y)))
    if gated:
        pairs, acts = y.unflatten(-1, (-1, 2, 8)), gelu.unflatten(-1, (-1, 2, 8))
        gelu = (acts[..., 0, :] * pairs[..., 1, :]).flatten(-2)
    tiny = (ref.abs() < 1e-6) & (ref != 0)
    assert tiny.sum() > 20 and ((gelu.double() - ref).abs() > ref.abs() / 2)[tiny].any()  # the cancellation shows
    out = gelu.to(out_dtype)
    gk.check_out(out, ref, spread)
    row, col = divmod((ref.abs() - 1).abs().argmin().item(), ref.shape[1])  # an element near 1
    out[row, col] = ref[row, col] + 2 * (spread[row, col] + torch.finfo(out_dtype).eps * ref[row, col].abs())
    with pytest.raises(AssertionError, match=rf"element \({row}, {col}\)"):
        gk.check_out(out, ref, spread)


# ---------------------------------------------------------------------------------------------
# GPU: results against the float64 reference on the dequantized operands.

def _quantized(m, n, k, scheme, seed=0, gated=False):
    """(a, a_scale, w, w_scale) for a scheme of quantize_weight_fp8 and the activations' matching one (a quantized
    by quantize_fp8: the kernel that makes them in a model)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").to(BF16)
    if m > 2:
        x[1] = 0  # a zero row
        x[2] = 0.75  # an all-equal row
    w = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(BF16)
    if gated:
        w = rosekernels.gate_up_rows(w[: n // 2], w[n // 2:])
    q_w, s_w = rosekernels.quantize_weight_fp8(w, scheme)
    if scheme == "tensor":  # per-tensor activations: one scale for the whole of x
        return (*fp8.quantize(x, None, None), q_w, s_w)
    return (*rosekernels.quantize_fp8(x, 128 if scheme == "block" else None), q_w, s_w)


def _check(m, n, k, scheme, out_dtype=BF16, bias=None, activation=None, gated=False, seed=0):
    a, a_scale, w, w_scale = _quantized(m, n, k, scheme, seed, gated)
    bias_t = None if bias is None else torch.randn(n, device="cuda").to(bias)
    out = torch.full((m, n // 2 if gated else n), math.nan, dtype=out_dtype, device="cuda")
    got = rosekernels.gemm_fp8(a, a_scale, w, w_scale, bias_t, activation, gated, out=out)
    assert got is out
    return gk.check(out, a, a_scale, w, w_scale, bias_t, activation or "none", gated)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
@pytest.mark.parametrize("m", [1, 7, 64, 100, 129, 1000])
def test_ragged_shapes(scheme, m):
    """Odd M; N not a multiple of the tiles; K not a multiple of the 128-element k-tile (block: K = 9 groups)."""
    _check(m, 776, 1152 if scheme == "block" else 1040, scheme, seed=m)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("m", [16, 300])
def test_long_k_is_promoted(scheme, m):
    """K = 16384: 128 k-tiles. Without the promotion of each k-tile's sums to fp32, WGMMA's FP8 accumulation
    drifts past 2x the output's rounding; with it, the error stays within it."""
    assert _check(m, 1024, 16384, scheme, seed=m) <= 2.0


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype, bias, activation, gated", [
    (BF16, BF16, "silu", True), (FP16, FP32, "gelu_tanh", False), (BF16, FP32, "relu", True),
    (FP16, FP16, "leaky_relu", False)])
@pytest.mark.parametrize("m", [5, 300])
def test_epilogues(out_dtype, bias, activation, gated, m):
    for scheme in ("channel", "block"):
        _check(m, 512, 1024, scheme, out_dtype, bias, activation, gated, seed=m)


@pytest.mark.gpu
def test_values_at_the_limits_of_e4m3():
    """Operands at +-448 and e4m3's smallest subnormal (2^-9) with unit scales: products from 2^-18 to 448^2
    in one sum (row 0 only small ones), every result within the bf16 output's range."""
    m, n, k = 8, 64, 256
    a = torch.full((m, k), 448.0, device="cuda")
    a[:, 1::2] = -448.0
    a[0] = 2.0 ** -9
    w = torch.full((n, k), 2.0 ** -9, device="cuda")
    w[:, 0] = 448.0
    one = torch.ones(1, device="cuda")
    out = rosekernels.gemm_fp8(a.to(E4M3), one, w.to(E4M3), one)
    gk.check(out, a.to(E4M3), one, w.to(E4M3), one)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _families("rowcol") + _families("block"), ids=lambda c: c.variant().key())
def test_every_tile_family(cfg):
    """Each family on a ragged shape (an odd M in its range, N = 528: 16 x 33, as gated GEMMs need, or 560
    where the weight tile divides 528; K = 9 k-tiles), with 1, 2 and 3 K splits, twice (the split counters
    return to zero), whatever the heuristic would pick."""
    lo, hi = plan.bf16.m_range(cfg)
    m, n, k = (lo + hi) // 2 | 1, 528 if 528 % (cfg.tile_m if cfg.swap_ab else cfg.tile_n) else 560, 1152
    a, a_scale, w, w_scale = _quantized(m, n, k, "block" if cfg.scales == "block" else "channel", m, cfg.gated)
    bias = None if cfg.bias == "none" else torch.randn(n, device="cuda").to(checks.TORCH_DTYPE[cfg.bias])
    ref, spread = gk.reference_and_spread(a, a_scale, w, w_scale, bias, cfg.activation, cfg.gated, cfg.slope)
    for splits in (1, 2, 3) if cfg.split_k else (1,):
        for _ in range(2):
            out = torch.full(ref.shape, math.nan, dtype=BF16 if cfg.dtype == "bf16" else FP16, device="cuda")
            op.run(a, a_scale, w, w_scale, bias, out, dataclasses.replace(cfg, splits=splits))
            gk.check_out(out, ref, spread)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("cluster", [(2, 1), (1, 2)])
@pytest.mark.parametrize("m, n, k", [(1000, 2048, 1152), (300, 1024, 16384)])
def test_stagger_over_many_units_and_long_k(scheme, cluster, m, n, k):
    """The warpgroups' turns carry on from unit to unit: 1000 x 2048 is 128 tiles, more than the grid's
    clusters (max_clusters 16), so each CTA runs several; K = 16384 promotes 128 k-tiles per unit, within 2x
    the output's rounding. The turns order only the issue: the output is bitwise the unstaggered tile's."""
    cfg = C(tile_m=128, tile_n=128, cluster_m=cluster[0], cluster_n=cluster[1], activation="none",
            scales="block" if scheme == "block" else "rowcol", stagger=True)
    a, a_scale, w, w_scale = _quantized(m, n, k, scheme, m)
    ref, spread = gk.reference_and_spread(a, a_scale, w, w_scale, None, "none", False, cfg.slope)
    outs = []
    for c in (cfg, dataclasses.replace(cfg, stagger=False)):
        outs.append(torch.full(ref.shape, math.nan, dtype=BF16, device="cuda"))
        gk.compile(c).fn(*gk.launch_args(c, a, a_scale, w, w_scale, None, outs[-1], None, None, 16))
    gk.check_out(outs[0], ref, spread)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
def test_cuda_graph_and_compile():
    a, a_scale, w, w_scale = _quantized(16, 1024, 1024, "block")
    out = rosekernels.gemm_fp8(a, a_scale, w, w_scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rosekernels.gemm_fp8(a, a_scale, w, w_scale, out=out)
    a2, s2, _, _ = _quantized(16, 1024, 1024, "block", seed=3)
    a.copy_(a2)
    a_scale.copy_(s2)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    gk.check(out, a, a_scale, w, w_scale)
    compiled = torch.compile(lambda *t: rosekernels.gemm_fp8(*t, activation="silu"), fullgraph=True)
    assert torch.equal(compiled(a, a_scale, w, w_scale), rosekernels.gemm_fp8(a, a_scale, w, w_scale,
                                                                              activation="silu"))


@pytest.mark.gpu
def test_workload():
    for cfg in gk.variants_for()[:4] + [c for c in gk.variants_for() if c.mode == "prefill"][:2]:
        m = plan.Fp8GemmShape.defaults(cfg.mode).m
        if cfg.a_rows < cfg.tile_m:  # a tile that loads a_rows token rows serves at most that many
            m = min(m, cfg.a_rows)
        shape = plan.Fp8GemmShape(m, 1024, 1024, cfg.dtype, cfg.scales,
                                  cfg.bias, cfg.activation, cfg.gated, cfg.slope)
        w = gk.workload(cfg, shape)
        for args in (w.make_args(1), w.sample(2)):
            w.run(w.kernel.fn, args)
            torch.cuda.synchronize()
            w.check(args)
