"""RMSNorm over the last dim of [M, N] rows (N up to 16k), optionally fused with a residual add.

    h = x (+ residual);  y = h * rsqrt(mean(h^2) + eps) * w;  returns y (and h, the new residual)

The generic "regular" RMSNorm (the QK-norm kernel is its per-head specialization). A row is split
over `threads_per_row` threads (a power of two), each moving up to 8 128-bit vectors, all loads
issued before any math: enough bytes in flight per SM to stream at HBM speed without staging
through shared memory. The row's sum of squares is a shuffle reduction within each warp, then,
when a row spans several warps, one exchange through shared memory and a single barrier.
N, eps and the dtypes are compile-time constants; the row count and row strides are runtime
values. Rows past the end are clamped for loading and masked for storing, so every thread reaches
the shuffles and the barrier; a row's ragged last vector column is masked the same way.

Modes (rosekernels.modes): decode = one row per block (one warp per block for short rows);
prefill = blocks of the tabled warp count (at least one row), many rows per block.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32
from cutlass.memory import SmemAllocator

from rosekernels import checks, jit, modes
from rosekernels.vector_copy import vec_load, vec_store

OP = "rmsnorm"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TORCH_DTYPE = {checks.DTYPE_NAME[d]: d for d in DTYPES}
MAX_HIDDEN = 16384
MAX_VECS_PER_THREAD = 8
# Hidden sizes all_variants() covers by default (Llama/Qwen/Mixtral-class models).
MODEL_HIDDEN = (2048, 4096, 5120, 8192)


def threads_per_row(hidden: int, vec: int) -> int:
    """Power of two: at most MAX_VECS_PER_THREAD vectors per thread, and a full warp per row
    unless the row has fewer vectors than that."""
    vecs = hidden // vec
    tpr = 1 << max(0, math.ceil(math.log2(-(-vecs // MAX_VECS_PER_THREAD))))
    return max(tpr, min(32, 1 << math.ceil(math.log2(vecs))))


@dataclasses.dataclass(frozen=True)
class RMSNormConfig:
    dtype: str  # x, residual and outputs: "bf16" | "fp16" | "fp32"
    weight_dtype: str  # the input dtype or "fp32"
    hidden: int
    residual: bool
    eps: float
    mode: str  # "decode" | "prefill"
    warps: int  # warps per block asked by the mode (raised to cover a whole row)
    cache_hint: str  # for x/residual loads and output stores: one of modes.CACHE_HINTS

    @property
    def vec(self) -> int:
        return 128 // checks.cute_dtype(self.dtype).width

    @property
    def vecs(self) -> int:
        """128-bit vectors per row."""
        return self.hidden // self.vec

    @property
    def threads_per_row(self) -> int:
        return threads_per_row(self.hidden, self.vec)

    @property
    def vecs_per_thread(self) -> int:
        return -(-self.vecs // self.threads_per_row)

    @property
    def warps_per_row(self) -> int:
        return max(1, self.threads_per_row // 32)

    @property
    def block_warps(self) -> int:
        if self.mode == "decode":
            return self.warps_per_row
        return max(self.warps, self.warps_per_row)

    @property
    def rows_per_block(self) -> int:
        return self.block_warps * 32 // self.threads_per_row

    def variant(self) -> jit.Variant:
        params = dataclasses.asdict(self)
        mode = params.pop("mode")
        return jit.Variant.of(OP, mode, **params)

    @classmethod
    def from_variant(cls, variant: jit.Variant) -> "RMSNormConfig":
        if variant.op != OP:
            raise ValueError(f"not an {OP} variant: {variant}")
        return cls(mode=variant.mode, **dict(variant.params))

    def validate(self) -> None:
        if self.dtype not in TORCH_DTYPE or self.weight_dtype not in (self.dtype, "fp32"):
            raise ValueError(f"unsupported dtypes {self.dtype}/{self.weight_dtype}")
        if not (0 < self.hidden <= MAX_HIDDEN) or self.hidden % self.vec:
            raise ValueError(f"hidden size {self.hidden} must be a multiple of {self.vec} up to {MAX_HIDDEN}")
        if self.warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"unsupported warps per block {self.warps}")
        if self.cache_hint not in modes.CACHE_HINTS:
            raise ValueError(f"unknown cache hint {self.cache_hint!r}")


# ---------------------------------------------------------------------------------------------
# The kernel.

class RMSNormKernel:
    def __init__(self, cfg: RMSNormConfig):
        cfg.validate()
        self.cfg = cfg

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mR, mO: cute.Tensor, mRO, stream):
        c = self.cfg
        grid = cute.ceil_div(mX.shape[0], c.rows_per_block)
        self.kernel(mX, mW, mR, mO, mRO).launch(
            grid=[grid, 1, 1], block=[c.block_warps * 32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mR, mO: cute.Tensor, mRO):
        c = self.cfg
        tpr, vpt = c.threads_per_row, c.vecs_per_thread
        full = c.vecs // tpr  # vector columns every lane has; column `full` is ragged when vpt > full
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rows = mX.shape[0]
        group, lane = tidx // tpr, tidx % tpr
        row = bidx * c.rows_per_block + group
        row_ok = row < rows
        row = cutlass.min(row, rows - 1)  # clamped: loads stay in bounds without predicates

        chunks, chunk_ok = [], []
        for j in cutlass.range_constexpr(vpt):
            if cutlass.const_expr(j < full):
                chunks.append(j * tpr + lane)
                chunk_ok.append(None)
            else:
                chunk_ok.append(j * tpr + lane < c.vecs)
                chunks.append(cutlass.min(j * tpr + lane, c.vecs - 1))

        gX = cute.zipped_divide(mX[row, None], (c.vec,))
        xs = [vec_load(gX[None, ch], c.cache_hint) for ch in chunks]
        if cutlass.const_expr(c.residual):
            gR = cute.zipped_divide(mR[row, None], (c.vec,))
            rs = [vec_load(gR[None, ch], c.cache_hint) for ch in chunks]
        gW = cute.zipped_divide(mW, (c.vec,))
        ws = [vec_load(gW[None, ch]) for ch in chunks]

        hs = [v.load().to(Float32) for v in xs]
        if cutlass.const_expr(c.residual):
            gRO = cute.zipped_divide(mRO[row, None], (c.vec,))
            for j in cutlass.range_constexpr(vpt):
                hs[j] = hs[j] + rs[j].load().to(Float32)
                self.store(hs[j], gRO[None, chunks[j]], row_ok, chunk_ok[j])

        parts = []
        for j in cutlass.range_constexpr(vpt):
            part = (hs[j] * hs[j]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if cutlass.const_expr(chunk_ok[j] is not None):
                part = Float32(cutlass.select_(chunk_ok[j], part, Float32(0.0)))
            parts.append(part)
        sum_sq = parts[0]
        for part in parts[1:]:
            sum_sq = sum_sq + part
        sum_sq = cute.arch.warp_reduction(sum_sq, lambda a, b: a + b, threads_in_group=min(tpr, 32))
        if cutlass.const_expr(c.warps_per_row > 1):
            # One partial per warp through shared memory; the row's warps are consecutive.
            smem = SmemAllocator()
            partials = smem.allocate_tensor(Float32, cute.make_layout(c.block_warps), byte_alignment=16)
            warp = tidx // 32
            if tidx % 32 == 0:
                partials[warp] = sum_sq
            cute.arch.barrier()
            first = (warp // c.warps_per_row) * c.warps_per_row
            sum_sq = partials[first]
            for i in cutlass.range_constexpr(1, c.warps_per_row):
                sum_sq = sum_sq + partials[first + i]
        rstd = cute.math.rsqrt(sum_sq * (1.0 / c.hidden) + c.eps, fastmath=True)

        gO = cute.zipped_divide(mO[row, None], (c.vec,))
        for j in cutlass.range_constexpr(vpt):
            self.store(hs[j] * rstd * ws[j].load().to(Float32), gO[None, chunks[j]], row_ok, chunk_ok[j])

    @cute.jit
    def store(self, value, dst: cute.Tensor, row_ok, chunk_ok):
        y = cute.make_rmem_tensor(dst.shape, dst.element_type)
        y.store(value.to(dst.element_type))
        if row_ok:
            if cutlass.const_expr(chunk_ok is None):
                vec_store(y, dst, self.cfg.cache_hint)
            else:
                if chunk_ok:
                    vec_store(y, dst, self.cfg.cache_hint)


def _build(cfg: RMSNormConfig) -> Callable[[], tuple]:
    def build():
        dt, wdt = checks.cute_dtype(cfg.dtype), checks.cute_dtype(cfg.weight_dtype)
        rows = cute.sym_int32()

        def rows_tensor() -> cute.Tensor:  # [rows, hidden], any 16-byte-aligned row stride
            return cute.runtime.make_fake_tensor(
                dt, (rows, cfg.hidden), (cute.sym_int64(divisibility=cfg.vec), 1), assumed_align=16)

        weight = cute.runtime.make_fake_compact_tensor(wdt, (cfg.hidden,), assumed_align=16)
        residual = rows_tensor() if cfg.residual else None
        residual_out = rows_tensor() if cfg.residual else None
        args = (rows_tensor(), weight, residual, rows_tensor(), residual_out,
                cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
        return RMSNormKernel(cfg), args
    return build


def compile(variant: jit.Variant) -> jit.CompiledKernel:
    """The loaded kernel of `variant`; call `.fn(x, weight, residual, out, residual_out)`
    (residual and residual_out are None for variants without a residual)."""
    cfg = RMSNormConfig.from_variant(variant)
    cfg.validate()
    return jit.compile_variant(variant, _build(cfg))


# ---------------------------------------------------------------------------------------------
# Variant selection and the list of specializations.

def config_for(rows: int, hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype,
               residual: bool, eps: float = 1e-6, sms: int | None = None) -> RMSNormConfig:
    """What rmsnorm() launches for these sizes (decode below the SM count, else the prefill table)."""
    vec = checks.vector_width(dtype)
    mode = modes.select(OP, modes.warps_needed(rows, threads_per_row(hidden, vec)), sms)
    return _config(dtype, weight_dtype, hidden, residual, eps, mode)


def _config(dtype, weight_dtype, hidden, residual, eps, mode: modes.Mode) -> RMSNormConfig:
    return RMSNormConfig(checks.DTYPE_NAME[dtype], checks.DTYPE_NAME[weight_dtype], int(hidden),
                         bool(residual), float(eps), mode.name, mode.warps, mode.cache_hint)


def all_variants(hidden=MODEL_HIDDEN, eps: float = 1e-6, dtypes=DTYPES,
                 residual=(False, True)) -> list[jit.Variant]:
    """Every specialization rmsnorm() can launch for these hidden sizes: dtype x weight dtype x
    residual x (decode + each prefill mode of the table)."""
    out = []
    for n in hidden:
        for dt in dtypes:
            for wdt in dict.fromkeys((dt, torch.float32)):
                for res in residual:
                    for mode in modes.all_modes(OP):
                        out.append(_config(dt, wdt, n, res, eps, mode).variant())
    return out


def sweep_variants(base: jit.Variant, warps=(8, 16, 32), cache_hints=modes.CACHE_HINTS) -> list[jit.Variant]:
    """Prefill variants of `base` with other block sizes and cache hints (the benchmark's sweep)."""
    cfg = RMSNormConfig.from_variant(base)
    return [dataclasses.replace(cfg, mode="prefill", warps=w, cache_hint=h).variant()
            for w in warps for h in cache_hints]


# ---------------------------------------------------------------------------------------------
# Inputs for a variant, and the float64 reference (tests, benchmark, SIP tuner).

def sample_args(variant: jit.Variant, rows: int | None = None, seed: int = 0,
                device: str = "cuda") -> tuple[torch.Tensor | None, ...]:
    """Fresh random args for `compile(variant).fn(*args)`: (x, weight, residual, out, residual_out),
    outputs NaN-poisoned, residual entries None without a residual. Default rows: 1 for decode,
    4096 for prefill."""
    cfg = RMSNormConfig.from_variant(variant)
    if rows is None:
        rows = 1 if cfg.mode == "decode" else 4096
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt, wdt = TORCH_DTYPE[cfg.dtype], TORCH_DTYPE[cfg.weight_dtype]

    def rand(*shape, dtype, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(dtype=dtype, device=device)

    x = rand(rows, cfg.hidden, dtype=dt, scale=2.0)
    w = rand(cfg.hidden, dtype=wdt, scale=0.2, shift=1.0)
    res = rand(rows, cfg.hidden, dtype=dt) if cfg.residual else None
    out = torch.full_like(x, math.nan)
    res_out = torch.full_like(x, math.nan) if cfg.residual else None
    return x, w, res, out, res_out


def reference(x, weight, eps: float = 1e-6, residual=None):
    """float64 (out, new_residual); new_residual is None without a residual."""
    h = x.double() if residual is None else x.double() + residual.double()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return out, (None if residual is None else h)


def tolerance(dtype: torch.dtype) -> float:
    """Max |out - ref| / (1 + |ref|) accepted: a few output roundings."""
    return {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}[dtype]


def check_args(variant: jit.Variant, args: tuple) -> float:
    """Error of the outputs in `args` (after a launch) against the reference; raises if too large."""
    cfg = RMSNormConfig.from_variant(variant)
    x, w, res, out, res_out = args
    ref_out, ref_res = reference(x, w, cfg.eps, res)
    worst = 0.0
    for got, ref in ((out, ref_out), (res_out, ref_res)):
        if ref is not None:
            err = ((got.double() - ref).abs() / (1 + ref.abs())).nan_to_num(math.inf).max().item()
            worst = max(worst, err)
    if worst > tolerance(x.dtype):
        raise AssertionError(f"{variant.key()}: error {worst:.3g} > {tolerance(x.dtype):.3g}")
    return worst


# ---------------------------------------------------------------------------------------------
# Argument checks (the slow path: first call per shape, and after any launch failure).

def _validate(x, weight, residual, out, residual_out) -> None:
    named = {n: t for n, t in (("x", x), ("weight", weight), ("residual", residual), ("out", out),
                               ("residual_out", residual_out)) if t is not None or n in ("x", "weight")}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if residual_out is not None and residual is None:
        raise ValueError("residual_out needs a residual")
    checks.check_dtype("x", x, DTYPES)
    for name in ("residual", "out", "residual_out"):
        if name in named:
            checks.check_dtype(name, named[name], (x.dtype,))
    checks.check_dtype("weight", weight, dict.fromkeys((x.dtype, torch.float32)))
    checks.check_shape("x", x, (None, None))
    hidden = x.shape[1]
    vec = checks.vector_width(x.dtype)
    if not (0 < hidden <= MAX_HIDDEN) or hidden % vec:
        raise ValueError(f"hidden size {hidden} is not supported: it must be a multiple of {vec} "
                         f"(16 bytes) and at most {MAX_HIDDEN}")
    checks.check_shape("weight", weight, (hidden,))
    for name in ("residual", "out", "residual_out"):
        if name in named:
            checks.check_shape(name, named[name], tuple(x.shape))
    for name, t in named.items():
        checks.check_unit_last_stride(name, t)
    for name, t in named.items():
        checks.check_aligned(name, t)
    for name, t in named.items():
        checks.check_cuda(name, t)
    checks.check_same_device(**named)


# ---------------------------------------------------------------------------------------------
# The op.

_NOOP = lambda *args: None  # noqa: E731  (zero rows: nothing to launch)
_dispatch: dict[tuple, Callable] = {}  # (shape, dtypes, residual?, eps) -> loaded kernel function


def _launcher(x, weight, residual, out, residual_out, eps) -> Callable:
    """Slow path, once per shape: validate everything, pick and load the variant, cache it."""
    _validate(x, weight, residual, out, residual_out)
    rows, hidden = x.shape
    if rows == 0:
        return _NOOP
    cfg = config_for(rows, hidden, x.dtype, weight.dtype, residual is not None, eps)
    fn = compile(cfg.variant()).fn
    if len(_dispatch) > 4096:  # many distinct row counts: start over rather than grow unbounded
        _dispatch.clear()
    _dispatch[(x.shape, x.dtype, weight.dtype, residual is None, eps)] = fn
    return fn


def _run(x, weight, residual, out, residual_out, eps) -> None:
    fn = _dispatch.get((x.shape, x.dtype, weight.dtype, residual is None, eps))
    if fn is None:
        fn = _launcher(x, weight, residual, out, residual_out, eps)
    try:
        # The compiled host code checks dtypes, shapes, strides, alignment and devices itself
        # and raises before launching; on any failure the full checks say what is wrong.
        fn(x, weight, residual, out, residual_out)
    except Exception:
        _validate(x, weight, residual, out, residual_out)
        raise


@torch.library.custom_op(
    "rosekernels::rmsnorm", mutates_args=("out", "residual_out"),
    schema="(Tensor x, Tensor weight, Tensor? residual, Tensor(a!) out, Tensor(b!)? residual_out, "
           "float eps) -> ()")
def _rmsnorm_op(x, weight, residual, out, residual_out, eps) -> None:
    _run(x, weight, residual, out, residual_out, eps)


@_rmsnorm_op.register_fake
def _(x, weight, residual, out, residual_out, eps) -> None:
    return None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None,
            out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None):
    """RMSNorm of x [..., N] (N a multiple of 16 bytes, at most 16384) with weight [N], fp32 math.

    Without `residual`: returns out = x * rsqrt(mean(x^2) + eps) * weight.
    With `residual`: h = x + residual; returns (out, h) where out normalizes h (in fp32, before
    rounding h to the input dtype). out/residual_out may be given (e.g. residual_out=residual
    updates the residual stream in place). Rows may be strided (16-byte-aligned row stride).

    Eager calls launch the kernel directly (torch.library dispatch would add several us of host
    time per call); under torch.compile the call goes through the custom op rosekernels::rmsnorm.
    """
    given_out, given_residual_out, shape = out, residual_out, x.shape
    if x.dim() != 2:  # rows of [..., N] as [M, N]; given outputs must be viewable so
        x = x.reshape(-1, shape[-1])
        residual = None if residual is None else residual.reshape(-1, shape[-1])
        out = None if out is None else out.view(-1, shape[-1])
        residual_out = None if residual_out is None else residual_out.view(-1, shape[-1])
    if out is None:
        out = torch.empty_like(x)
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(x)
    if torch.compiler.is_compiling():
        torch.ops.rosekernels.rmsnorm(x, weight, residual, out, residual_out, eps)
    else:
        _run(x, weight, residual, out, residual_out, eps)
    if len(shape) != 2:
        out = out.view(shape) if given_out is None else given_out
        if residual_out is not None:
            residual_out = residual_out.view(shape) if given_residual_out is None else given_residual_out
    return out if residual is None else (out, residual_out)
