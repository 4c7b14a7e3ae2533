"""Grouped GEMM for Hopper (sm_90a): rows grouped by expert, each group times its expert's weight, with
the dense GEMM's epilogues.

    out[r] = act(a[r] @ w[e]^T + bias[e]) * row_scale[r]      offsets[e] <= r < offsets[e + 1]

a [R, K] holds the groups as moe_dispatch lays them out (or, `gather`, row r is a[a_index[r]]); w
[E, N, K] is transformers' per-expert layout (nn.Linear's [N, K] per expert, K contiguous). gated:
out = act(gate) * up with w[e] = [gate rows; up rows] ([2I, K], transformers' gate_up_proj), out
[R, I]; the kernel reads the two halves interleaved in blocks of 8 rows (the dense gated GEMM's order,
so its epilogue applies unchanged) through one 5-D TMA box over the view ((8, 2, I / 8), K, E): no
conversion of the weights. Rows of out outside every group are not written.

The kernel is the dense GEMM's (gemm_leakyrelu.GemmSm90) with its `grouped` option: the
same warp-specialized TMA + WGMMA mainloop, pipelines, swapped decode tiles and epilogues; what grouping
changes is in grouped_tiles.GroupedTiles (the group table, the walk over (expert, row tile, weight
tile) units, the per-unit TMA coordinates, the gathered rows, the row-predicated stores). This module
holds its launcher (`_GroupedGemmSm90.__call__`: the weight views and TMA atoms, the grid), the compile,
the float64 reference and the workload; configs and the heuristic are in grouped_gemm_plan, the op in
rosekernels/ops/grouped_gemm.py.

Graph-capturable: the offsets (and indices) are read on the device only; the grid is sized by the
most work units a valid grouping of R rows can have (`grouped_gemm_plan.max_units`), and every address
the kernel forms from offsets or indices is clamped into the tensors, so garbage in them gives garbage
rows, never an access out of bounds.
"""
from __future__ import annotations

import functools
import math
import random
from typing import Optional

from rosekernels import jit  # first: it pins CUTE_DSL_ARCH=sm_90a before cutlass is imported

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from rosekernels import checks, modes
from rosekernels.kernels.gemm_leakyrelu import SMEM_CAPACITY, GemmSm90, epilogue_reference
from rosekernels.kernels.grouped_gemm_plan import (  # noqa: F401  (the plan's names are the contract)
    GATE_BLOCK, GROUP_TABLE_INTS, MAX_EXPERTS, OP, TILE_K, GroupedConfig, GroupedShape, candidates, check_sizes,
    config_for, max_units, rank, row_range, variants_for)
from rosekernels.workload import Workload

Config, Shape = GroupedConfig, GroupedShape


class _GroupedGemmSm90(GemmSm90):
    """The grouped launcher of the GEMM kernel (its device body and every grouped method inherited)."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [R, K] (gather: [T, K], the rows a_index picks), K contiguous
        mW: cute.Tensor,  # [E, N, K], K contiguous
        mOut: cute.Tensor,  # [R, N] (gated: [R, N / 2]), N contiguous
        mBias: Optional[cute.Tensor],  # [E, N] or None
        mOffsets: cute.Tensor,  # [E + 1] int32
        mIndex: Optional[cute.Tensor],  # gather: [R] int32
        mRowScale: Optional[cute.Tensor],  # row_scale: [R] fp32
        max_units: Int32,
        max_clusters: Int32,  # of cluster_m CTAs that can be resident at once (modes.max_active_clusters)
        stream,
    ):
        cfg = self.cfg
        tiled_mma, tiled_mma_out, a_smem, a_load_smem, b_smem, d_smem, d_elems = self._layouts()
        experts, n, k = mW.shape
        w_rows, w_stride, e_stride = n, mW.stride[1], mW.stride[0]
        bias_rows = n
        if const_expr(cfg.gated):
            # Row 16 i + 8 h + j of the view is row h * N / 2 + 8 i + j of w[e]: gate and up in blocks of 8.
            half = n // 2
            w_rows = (GATE_BLOCK, 2, half // GATE_BLOCK)
            w_stride = (w_stride, half * w_stride, GATE_BLOCK * w_stride)
            bias_rows = (GATE_BLOCK, 2, half // GATE_BLOCK)
        weights = cute.make_tensor(mW.iterator, cute.make_layout((w_rows, k, experts), stride=(w_stride, 1, e_stride)))
        bias = None
        if const_expr(mBias is not None):
            bias_stride = 1 if const_expr(not cfg.gated) else (1, n // 2, GATE_BLOCK)
            bias = cute.make_tensor(mBias.iterator, cute.make_layout((experts, bias_rows),
                                                                     stride=(mBias.stride[0], bias_stride)))
        # The weights are the kernel's A when swapped (the MMA's M side), else its B.
        w_smem, x_smem = (a_load_smem, b_smem) if const_expr(self.swap) else (b_smem, a_load_smem)
        w_one, x_one = cute.slice_(w_smem, (None, None, 0)), cute.slice_(x_smem, (None, None, 0))
        # On a 2x1 cluster (plain tiles) each CTA loads half of the weight tile into both.
        w_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(cfg.cluster_m > 1) else \
            cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_w, tma_w = cpasync.make_tiled_tma_atom(w_op, weights, w_one, (cfg.weight_tile, TILE_K),
                                                        num_multicast=cfg.cluster_m)
        tx_bytes = cute.size_in_bytes(self.ab_dtype, w_one)
        tma_atom_x, tma_x = None, mX  # gather: cp.async from mX itself
        if const_expr(not cfg.gather):
            tma_atom_x, tma_x = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mX, x_one, (cfg.row_tile, TILE_K))
            tx_bytes += cute.size_in_bytes(self.ab_dtype, x_one)
        rows = mOut.shape[0]
        mD = mOut
        if const_expr(self.swap):  # out^T: the kernel stores [N, R]
            mD = cute.make_tensor(mOut.iterator, cute.make_layout((mOut.shape[1], rows), stride=(1, mOut.stride[0])))

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.ab_stage]
            last_split: cute.struct.MemRange[Int32, 4]
            bias: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_slots * self.cfg.tile_n], 16]
            groups: cute.struct.Align[cute.struct.MemRange[Int32, GROUP_TABLE_INTS], 16]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, d_elems], 1024]

        self.shared_storage = SharedStorage
        if const_expr(SharedStorage.size_in_bytes() > SMEM_CAPACITY):
            raise ValueError(f"{cfg}: {SharedStorage.size_in_bytes()} bytes of shared memory")

        atoms = (tma_atom_w, tma_w, tma_atom_x, tma_x) if const_expr(self.swap) else (tma_atom_x, tma_x, tma_atom_w,
                                                                                      tma_w)
        one = Int32(1)
        self.kernel(
            tiled_mma, tiled_mma_out, *atoms, None, mD, bias, None, None, one, one, one, one,
            a_smem, a_load_smem, b_smem, d_smem, tx_bytes, mOffsets, mIndex, mRowScale, max_units, None, None,
        ).launch(
            grid=(cfg.cluster_m, 1, cutlass.min(max_units, max_clusters)),
            block=(self.threads, 1, 1),
            cluster=(cfg.cluster_m, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=cfg.pdl,
        )


# ---------------------------------------------------------------------------------------------
# Compilation.


def _build(cfg: GroupedConfig):
    """(launcher, fake compile arguments): one compile serves every R, T, E, N and K."""
    elem = checks.cute_dtype(cfg.dtype)
    rows, tokens, experts, n, k = (cute.sym_int() for _ in range(5))
    row_stride = cute.sym_int64(divisibility=8)
    x = make_fake_tensor(elem, (tokens if cfg.gather else rows, k), (row_stride, 1), assumed_align=16)
    w = make_fake_tensor(elem, (experts, n, k), (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1),
                         assumed_align=16)
    out = make_fake_tensor(elem, (rows, cute.sym_int()), (cute.sym_int64(divisibility=8), 1), assumed_align=16)
    bias = None
    if cfg.bias != "none":
        bias_dt = checks.cute_dtype(cfg.bias)
        bias = make_fake_tensor(bias_dt, (experts, n), (cute.sym_int64(), 1), assumed_align=bias_dt.width // 8)
    offsets = make_fake_tensor(Int32, (cute.sym_int(),), (1,), assumed_align=4)
    index = make_fake_tensor(Int32, (rows,), (1,), assumed_align=4) if cfg.gather else None
    scale = make_fake_tensor(Float32, (rows,), (1,), assumed_align=4) if cfg.row_scale else None
    args = (x, w, out, bias, offsets, index, scale, Int32(1), Int32(132), make_fake_stream(use_tvm_ffi_env_stream=True))
    return _GroupedGemmSm90(cfg), args


def compile(config: GroupedConfig) -> jit.CompiledKernel:
    """The loaded kernel of `config`; its function takes (x, w, out, bias, offsets, a_index, row_scale,
    max_units, max_clusters): `launch_args` builds them."""
    return jit.compile_variant(config.variant(), lambda: _build(config))


def precompile(configs=None, processes: int | None = None) -> list[jit.CompiledKernel]:
    """compile() of each config (default: variants_for()), the cold ones first compiled in parallel
    processes into the disk cache (jit.precompile)."""
    return jit.precompile(compile, variants_for() if configs is None else configs, processes)


def launch_args(config: GroupedConfig, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                bias: Optional[torch.Tensor], offsets: torch.Tensor, a_index: Optional[torch.Tensor],
                row_scale: Optional[torch.Tensor]) -> tuple:
    """The arguments of compile(config).fn for a call whose out has R > 0 rows: the grid's bound on
    work units and the clusters that fit on the device at once appended."""
    units = max_units(config, out.shape[0], w.shape[0], w.shape[1])
    # a persistent grid of the clusters that fit at once (an odd SM count in a GPC fits fewer 2-CTA
    # clusters than SMs / 2; clusters past it would wait for a resident one to finish all its units)
    return x, w, out, bias, offsets, a_index, row_scale, units, modes.max_active_clusters(out.device.index,
                                                                                          config.cluster_m)


# ---------------------------------------------------------------------------------------------
# The float64 reference, and workloads: a config's kernel with its inputs, for tests and SIP.


def reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, bias: Optional[torch.Tensor] = None,
              activation: str = "none", gated: bool = False, slope: float = 0.01,
              a_index: Optional[torch.Tensor] = None, row_scale: Optional[torch.Tensor] = None,
              rows: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 out, written): out rows of every group expert by expert (gated: w[e]'s first half the
    gate rows, the second the up rows), NaN elsewhere; `written` [R] marks the rows in a group. The
    offsets are clamped as the kernel clamps them (each group within [0, R), never before its start),
    indices into x, and a group overlapping an earlier one overwrites it (the kernel would race)."""
    rows = (a_index.shape[0] if a_index is not None else x.shape[0]) if rows is None else rows
    n = w.shape[1]
    out = torch.full((rows, n // 2 if gated else n), math.nan, dtype=torch.float64, device=x.device)
    written = torch.zeros(rows, dtype=torch.bool, device=x.device)
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        lo = min(max(bounds[e], 0), rows)
        hi = min(max(bounds[e + 1], lo), rows)
        if hi == lo:
            continue
        picked = torch.arange(lo, hi, device=x.device)
        if a_index is not None:
            picked = a_index[lo:hi].long().clamp(0, x.shape[0] - 1)
        y = x[picked].double() @ w[e].double().t()
        if bias is not None:
            y += bias[e].double()
        if gated:
            act = epilogue_reference(y[:, :n // 2], activation, False, slope)
            y = act * y[:, n // 2:]
        else:
            y = epilogue_reference(y, activation, False, slope)
        if row_scale is not None:
            y *= row_scale[lo:hi, None].double()
        out[lo:hi] = y
        written[lo:hi] = True
    return out, written


def check_out(out: torch.Tensor, ref: torch.Tensor, written: torch.Tensor) -> float:
    """Raise AssertionError unless out's written rows are within one rounding of the float64 reference
    (fp32 accumulation: one ulp of the output dtype, + 1e-4 near zero) and the others untouched (still
    NaN, as poisoned); the worst error / tolerance."""
    assert torch.isnan(out[~written]).all(), "a row outside every group was written"
    got, want = out[written].double(), ref[written]
    assert torch.isfinite(got).all(), "unwritten (NaN) or non-finite elements in a group's rows"
    ulp = 2.0 ** (-7 if out.dtype == torch.bfloat16 else -10)
    err = (got - want.to(out.dtype).double()).abs() / (1.01 * ulp * want.abs() + 1e-4)
    if err.numel() == 0:
        return 0.0
    worst = err.argmax().item()
    assert err.flatten()[worst] <= 1, (f"element {divmod(worst, out.shape[1])} of the written rows = "
                                       f"{got.flatten()[worst].item()}, reference {want.flatten()[worst].item()}")
    return err.flatten()[worst].item()


def random_offsets(rows: int, experts: int, generator: torch.Generator, empty: float = 0.25,
                   covered: Optional[int] = None) -> torch.Tensor:
    """int32 [experts + 1] offsets of `covered` (default: all) of `rows` rows over `experts` groups: a
    random share of the experts (`empty`) gets none, the others' sizes drawn as a routing draws them."""
    covered = rows if covered is None else covered
    live = torch.rand(experts, generator=generator) >= empty
    if not live.any():
        live[torch.randint(experts, (1,), generator=generator)] = True
    choice = torch.multinomial(live.double(), covered, replacement=True, generator=generator) if covered else \
        torch.zeros(0, dtype=torch.long)
    counts = torch.bincount(choice, minlength=experts)
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)


def _args(config: GroupedConfig, rows: int, experts: int, n: int, k: int, seed: int) -> tuple:
    """compile(config).fn's arguments for one problem on the current device: random inputs (w scaled so
    outputs stay O(1)), offsets covering all rows but a few at the end, groups of 0 rows included,
    out NaN-poisoned."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = checks.TORCH_DTYPE[config.dtype]
    tokens = max(1, rows // 2) if config.gather else rows
    x = torch.randn(tokens, k, generator=g).to(dt).cuda()
    w = torch.randn(experts, n, k, generator=g).div_(k ** 0.5).to(dt).cuda()
    bias = None
    if config.bias != "none":
        bias = torch.randn(experts, n, generator=g).to(checks.TORCH_DTYPE[config.bias]).cuda()
    offsets = random_offsets(rows, experts, g, covered=rows - min(rows // 8, 3)).cuda()
    a_index = torch.randint(tokens, (rows,), generator=g, dtype=torch.int32).cuda() if config.gather else None
    row_scale = torch.rand(rows, generator=g).cuda() if config.row_scale else None
    out = torch.full((rows, n // 2 if config.gated else n), math.nan, dtype=dt, device="cuda")
    return launch_args(config, x, w, out, bias, offsets, a_index, row_scale)


def _check(config: GroupedConfig, args: tuple) -> float:
    x, w, out, bias, offsets, a_index, row_scale = args[:7]
    ref, written = reference(x, w, offsets, bias, config.activation, config.gated, config.slope, a_index,
                             row_scale, rows=out.shape[0])
    return check_out(out, ref, written)


def workload(config: GroupedConfig, shape: GroupedShape) -> Workload:
    """`config`'s kernel at `shape` (make_args: its rows over its experts, random groups); test_args
    draws the rows from the config's mode (`row_range`), 1 to 16 experts, N and K up to 1024."""
    options = (shape.dtype, shape.bias, shape.activation, shape.gated, float(shape.slope), shape.gather,
               shape.row_scale)
    if options != (config.dtype, config.bias, config.activation, config.gated, config.slope, config.gather,
                   config.row_scale):
        raise ValueError(f"{config} does not serve {shape}: dtype, bias, activation, gating, gather and row "
                         "scaling must match")
    check_sizes(shape.rows, shape.experts, shape.n, shape.k, shape.gated)

    def test_args(seed: int) -> tuple:
        r = random.Random(seed)
        experts = r.randint(1, 16)
        rows = r.randint(*row_range(config, experts))
        n = 16 * r.randint(1, 64)
        return _args(config, rows, experts, n, 8 * r.randint(1, 128), seed)

    return Workload(compile(config), lambda seed: _args(config, shape.rows, shape.experts, shape.n, shape.k, seed),
                    outputs=lambda args: args[2:3], check=functools.partial(_check, config), test_args=test_args,
                    name=OP)
