"""QK norm: Qwen3-style per-head RMSNorm of Q and K in one launch.

    y = x * rsqrt(mean(x^2) + eps) * (w + weight_bias)     per head of d elements, fp32 math

Design (ROSE's QK-norm kernel): a head is d <= 256 elements, so a (sub-)warp owns it. Each thread
moves 128 bits (8 bf16/fp16 or 4 fp32 values) per access, so d=128 bf16 takes a half-warp
(16 threads x 8 values) and the head's sum of squares is a butterfly shuffle over 16 lanes: 4
rounds, fixed when the kernel is compiled. Head counts, head dim, eps and the weight bias are
compile-time constants; the token count and every row/head stride are runtime values, so one
compile serves every T of a mode and strided views into a fused qkv buffer.

Grid: blocks [0, q_blocks) normalize Q heads, the rest K heads (one launch for both); a block is
uniformly Q or K, so shuffles never diverge. Heads are numbered token-major (row = t*heads + h);
a thread group handles `rows_per_thread` heads a block-stride apart, issuing all their loads
before any reduction. Rows past the end are clamped for loading (no predicated loads, no
divergence around the shuffles) and masked for storing.

Modes (rosekernels.modes): decode = one warp per block, a tiny grid of one-warp blocks;
prefill = 8/16/32-warp blocks and several heads per thread group, from the benchmarked table.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from rosekernels import checks, jit, modes
from rosekernels.vector_copy import vec_load, vec_store

OP = "qk_norm"
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TORCH_DTYPE = {checks.DTYPE_NAME[d]: d for d in DTYPES}
# (q heads, kv heads) of the models the benchmark and all_variants() cover by default.
MODEL_HEADS = {"qwen3-8b": (32, 8), "qwen3-30b-a3b": (32, 4)}


# ---------------------------------------------------------------------------------------------
# Configuration: everything a compiled variant is specialized on.

@dataclasses.dataclass(frozen=True)
class QKNormConfig:
    dtype: str  # q, k and the outputs: "bf16" | "fp16" | "fp32"
    weight_dtype: str  # both weights: the input dtype or "fp32"
    head_dim: int
    q_heads: int
    k_heads: int
    eps: float
    weight_bias: float
    mode: str  # "decode" | "prefill"
    warps: int  # warps per block
    rows_per_thread: int  # heads per thread group
    cache_hint: str  # for q/k loads and output stores: one of modes.CACHE_HINTS

    @property
    def vec(self) -> int:
        """Elements per 128-bit access."""
        return 128 // checks.cute_dtype(self.dtype).width

    @property
    def threads_per_head(self) -> int:
        return min(32, self.head_dim // self.vec)

    @property
    def vecs_per_thread(self) -> int:
        return self.head_dim // (self.vec * self.threads_per_head)

    @property
    def groups_per_block(self) -> int:
        return self.warps * 32 // self.threads_per_head

    @property
    def heads_per_block(self) -> int:
        return self.groups_per_block * self.rows_per_thread

    def variant(self) -> jit.Variant:
        params = dataclasses.asdict(self)
        mode = params.pop("mode")
        return jit.Variant.of(OP, mode, **params)

    @classmethod
    def from_variant(cls, variant: jit.Variant) -> "QKNormConfig":
        if variant.op != OP:
            raise ValueError(f"not a {OP} variant: {variant}")
        return cls(mode=variant.mode, **dict(variant.params))

    def validate(self) -> None:
        if self.dtype not in TORCH_DTYPE or self.weight_dtype not in (self.dtype, "fp32"):
            raise ValueError(f"unsupported dtypes {self.dtype}/{self.weight_dtype}")
        if self.head_dim not in HEAD_DIMS or min(self.q_heads, self.k_heads) < 1:
            raise ValueError(f"unsupported head_dim {self.head_dim} or head counts")
        if self.warps not in (1, 2, 4, 8, 16, 32) or self.rows_per_thread < 1:
            raise ValueError(f"unsupported block shape: {self.warps} warps x {self.rows_per_thread} rows")
        if self.cache_hint not in modes.CACHE_HINTS:
            raise ValueError(f"unknown cache hint {self.cache_hint!r}")


# ---------------------------------------------------------------------------------------------
# The kernel.

class QKNormKernel:
    def __init__(self, cfg: QKNormConfig):
        cfg.validate()
        self.cfg = cfg

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mWQ: cute.Tensor, mWK: cute.Tensor,
                 mOQ: cute.Tensor, mOK: cute.Tensor, stream):
        c = self.cfg
        tokens = mQ.shape[0]
        grid = (cute.ceil_div(tokens * c.q_heads, c.heads_per_block)
                + cute.ceil_div(tokens * c.k_heads, c.heads_per_block))
        self.kernel(mQ, mK, mWQ, mWK, mOQ, mOK).launch(
            grid=[grid, 1, 1], block=[c.warps * 32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mWQ: cute.Tensor, mWK: cute.Tensor,
               mOQ: cute.Tensor, mOK: cute.Tensor):
        c = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        tokens = mQ.shape[0]
        q_blocks = cute.ceil_div(tokens * c.q_heads, c.heads_per_block)
        if bidx < q_blocks:
            self.norm_heads(mQ, mWQ, mOQ, bidx, tidx, tokens * c.q_heads, c.q_heads)
        else:
            self.norm_heads(mK, mWK, mOK, bidx - q_blocks, tidx, tokens * c.k_heads, c.k_heads)

    @cute.jit
    def norm_heads(self, mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, block: Int32,
                   tidx: Int32, rows: Int32, heads: cutlass.Constexpr[int]):
        c = self.cfg
        tph, vpt = c.threads_per_head, c.vecs_per_thread
        group, lane = tidx // tph, tidx % tph
        # Thread `lane` owns the 128-bit chunks lane, lane + tph, ... of every head it handles.
        chunks = [j * tph + lane for j in range(vpt)]

        xs, dsts, valid = [], [], []
        for r in cutlass.range_constexpr(c.rows_per_thread):
            row = block * c.heads_per_block + r * c.groups_per_block + group
            valid.append(row < rows)
            row = cutlass.min(row, rows - 1)  # clamped: loads stay in bounds without predicates
            t = Int32(cutlass.Uint32(row) // heads)  # unsigned: a multiply-shift, rows are >= 0
            h = row - t * heads
            src = cute.zipped_divide(mX[t, h, None], (c.vec,))
            xs.append([vec_load(src[None, ch], c.cache_hint) for ch in chunks])
            dst = cute.zipped_divide(mO[t, h, None], (c.vec,))
            dsts.append([dst[None, ch] for ch in chunks])
        ws = []
        gW = cute.zipped_divide(mW, (c.vec,))
        for ch in chunks:
            w = vec_load(gW[None, ch]).load().to(Float32)
            if cutlass.const_expr(c.weight_bias != 0.0):
                w = w + Float32(c.weight_bias)
            ws.append(w)

        for r in cutlass.range_constexpr(c.rows_per_thread):
            x = [v.load().to(Float32) for v in xs[r]]
            sum_sq = (x[0] * x[0]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            for j in cutlass.range_constexpr(1, vpt):
                sum_sq = sum_sq + (x[j] * x[j]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if cutlass.const_expr(tph > 1):
                sum_sq = cute.arch.warp_reduction(sum_sq, lambda a, b: a + b, threads_in_group=tph)
            rstd = cute.math.rsqrt(sum_sq * (1.0 / c.head_dim) + c.eps, fastmath=True)
            if valid[r]:
                for j in cutlass.range_constexpr(vpt):
                    y = cute.make_rmem_tensor((c.vec,), mO.element_type)
                    y.store((x[j] * rstd * ws[j]).to(mO.element_type))
                    vec_store(y, dsts[r][j], c.cache_hint)


def _build(cfg: QKNormConfig) -> Callable[[], tuple]:
    def build():
        dt, wdt = checks.cute_dtype(cfg.dtype), checks.cute_dtype(cfg.weight_dtype)
        tokens = cute.sym_int32()

        def heads(h: int) -> cute.Tensor:  # [tokens, h, d], any 16-byte-aligned row/head strides
            strides = (cute.sym_int64(divisibility=cfg.vec), cute.sym_int64(divisibility=cfg.vec), 1)
            return cute.runtime.make_fake_tensor(dt, (tokens, h, cfg.head_dim), strides, assumed_align=16)

        def weight() -> cute.Tensor:
            return cute.runtime.make_fake_compact_tensor(wdt, (cfg.head_dim,), assumed_align=16)

        args = (heads(cfg.q_heads), heads(cfg.k_heads), weight(), weight(),
                heads(cfg.q_heads), heads(cfg.k_heads),
                cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
        return QKNormKernel(cfg), args
    return build


def compile(variant: jit.Variant) -> jit.CompiledKernel:
    """The loaded kernel of `variant`; call `.fn(q, k, q_weight, k_weight, out_q, out_k)`."""
    cfg = QKNormConfig.from_variant(variant)
    cfg.validate()
    return jit.compile_variant(variant, _build(cfg))


# ---------------------------------------------------------------------------------------------
# Variant selection and the list of specializations.

def config_for(tokens: int, q_heads: int, k_heads: int, head_dim: int, dtype: torch.dtype,
               weight_dtype: torch.dtype, eps: float = 1e-6, weight_bias: float = 0.0,
               sms: int | None = None) -> QKNormConfig:
    """What qk_norm() launches for these sizes (decode below the SM count, else the prefill table)."""
    vec = checks.vector_width(dtype)
    per_head = min(32, head_dim // vec)
    mode = modes.select(OP, modes.warps_needed(tokens * (q_heads + k_heads), per_head), sms)
    return _config(dtype, weight_dtype, head_dim, q_heads, k_heads, eps, weight_bias, mode)


def _config(dtype, weight_dtype, head_dim, q_heads, k_heads, eps, weight_bias, mode: modes.Mode) -> QKNormConfig:
    return QKNormConfig(checks.DTYPE_NAME[dtype], checks.DTYPE_NAME[weight_dtype], int(head_dim),
                        int(q_heads), int(k_heads), float(eps), float(weight_bias),
                        mode.name, mode.warps, mode.rows_per_thread, mode.cache_hint)


def all_variants(heads=tuple(MODEL_HEADS.values()), eps: float = 1e-6, weight_bias: float = 0.0,
                 dtypes=DTYPES, head_dims=HEAD_DIMS) -> list[jit.Variant]:
    """Every specialization qk_norm() can launch for these models: dtype x weight dtype x head dim x
    (decode + each prefill mode of the table)."""
    out = []
    for hq, hk in heads:
        for dt in dtypes:
            for wdt in dict.fromkeys((dt, torch.float32)):
                for d in head_dims:
                    for mode in modes.all_modes(OP):
                        out.append(_config(dt, wdt, d, hq, hk, eps, weight_bias, mode).variant())
    return out


def sweep_variants(base: jit.Variant, warps=(8, 16, 32), rows_per_thread=(1, 2, 4),
                   cache_hints=modes.CACHE_HINTS) -> list[jit.Variant]:
    """Prefill variants of `base` with other block shapes and cache hints (the benchmark's sweep)."""
    cfg = QKNormConfig.from_variant(base)
    return [dataclasses.replace(cfg, mode="prefill", warps=w, rows_per_thread=r, cache_hint=h).variant()
            for w in warps for r in rows_per_thread for h in cache_hints]


# ---------------------------------------------------------------------------------------------
# Inputs for a variant, and the float64 reference (tests, benchmark, SIP tuner).

def sample_args(variant: jit.Variant, tokens: int | None = None, seed: int = 0,
                device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """Fresh random args for `compile(variant).fn(*args)`: (q, k, q_weight, k_weight, out_q, out_k),
    outputs NaN-poisoned. Default tokens: 1 for decode, 4096 for prefill."""
    cfg = QKNormConfig.from_variant(variant)
    if tokens is None:
        tokens = 1 if cfg.mode == "decode" else 4096
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt, wdt = TORCH_DTYPE[cfg.dtype], TORCH_DTYPE[cfg.weight_dtype]

    def rand(*shape, dtype, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(dtype=dtype, device=device)

    q = rand(tokens, cfg.q_heads, cfg.head_dim, dtype=dt, scale=3.0)
    k = rand(tokens, cfg.k_heads, cfg.head_dim, dtype=dt, scale=3.0)
    wq = rand(cfg.head_dim, dtype=wdt, scale=0.2, shift=1.0)
    wk = rand(cfg.head_dim, dtype=wdt, scale=0.2, shift=1.0)
    return q, k, wq, wk, torch.full_like(q, math.nan), torch.full_like(k, math.nan)


def reference(q, k, q_weight, k_weight, eps: float = 1e-6, weight_bias: float = 0.0):
    """float64 (out_q, out_k)."""
    def norm(x, w):
        x = x.double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + weight_bias)
    return norm(q, q_weight), norm(k, k_weight)


def tolerance(dtype: torch.dtype) -> float:
    """Max |out - ref| / (1 + |ref|) accepted: a few output roundings."""
    return {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}[dtype]


def check_args(variant: jit.Variant, args: tuple[torch.Tensor, ...]) -> float:
    """Error of the outputs in `args` (after a launch) against the reference; raises if too large."""
    cfg = QKNormConfig.from_variant(variant)
    q, k, wq, wk, oq, ok = args
    worst = 0.0
    for out, ref in zip((oq, ok), reference(q, k, wq, wk, cfg.eps, cfg.weight_bias)):
        err = ((out.double() - ref).abs() / (1 + ref.abs())).nan_to_num(math.inf).max().item()
        worst = max(worst, err)
    if worst > tolerance(q.dtype):
        raise AssertionError(f"{variant.key()}: error {worst:.3g} > {tolerance(q.dtype):.3g}")
    return worst


# ---------------------------------------------------------------------------------------------
# Argument checks (the slow path: first call per shape, and after any launch failure).

def _validate(q, k, q_weight, k_weight, out_q, out_k) -> None:
    named = {"q": q, "k": k, "q_weight": q_weight, "k_weight": k_weight}
    if out_q is not None:
        named["out_q"] = out_q
    if out_k is not None:
        named["out_k"] = out_k
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    checks.check_dtype("q", q, DTYPES)
    for name in ("k", "out_q", "out_k"):
        if name in named:
            checks.check_dtype(name, named[name], (q.dtype,))
    checks.check_dtype("q_weight", q_weight, dict.fromkeys((q.dtype, torch.float32)))
    checks.check_dtype("k_weight", k_weight, (q_weight.dtype,))
    checks.check_shape("q", q, (None, None, None))
    tokens, q_heads, head_dim = q.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} is not supported; expected one of {HEAD_DIMS}")
    checks.check_shape("k", k, (tokens, None, head_dim))
    if q_heads < 1 or k.shape[1] < 1:
        raise ValueError(f"q and k need at least one head, got shapes {list(q.shape)} and {list(k.shape)}")
    checks.check_shape("q_weight", q_weight, (head_dim,))
    checks.check_shape("k_weight", k_weight, (head_dim,))
    if out_q is not None:
        checks.check_shape("out_q", out_q, tuple(q.shape))
    if out_k is not None:
        checks.check_shape("out_k", out_k, tuple(k.shape))
    for name, t in named.items():
        checks.check_unit_last_stride(name, t)
    for name, t in named.items():
        checks.check_aligned(name, t)
    for name, t in named.items():
        checks.check_cuda(name, t)
    checks.check_same_device(**named)


# ---------------------------------------------------------------------------------------------
# The op.

_NOOP = lambda *args: None  # noqa: E731  (zero tokens: nothing to launch)
_dispatch: dict[tuple, Callable] = {}  # (shapes, dtypes, eps, bias) -> loaded kernel function


def _launcher(q, k, q_weight, k_weight, eps, weight_bias, out_q, out_k) -> Callable:
    """Slow path, once per shape: validate everything, pick and load the variant, cache it."""
    _validate(q, k, q_weight, k_weight, out_q, out_k)
    tokens, q_heads, head_dim = q.shape
    if tokens == 0:
        return _NOOP
    cfg = config_for(tokens, q_heads, k.shape[1], head_dim, q.dtype, q_weight.dtype, eps, weight_bias)
    fn = compile(cfg.variant()).fn
    if len(_dispatch) > 4096:  # many distinct token counts: start over rather than grow unbounded
        _dispatch.clear()
    _dispatch[(q.shape, k.shape, q.dtype, q_weight.dtype, eps, weight_bias)] = fn
    return fn


def _run(q, k, q_weight, k_weight, eps, weight_bias, out_q, out_k) -> None:
    fn = _dispatch.get((q.shape, k.shape, q.dtype, q_weight.dtype, eps, weight_bias))
    if fn is None:
        fn = _launcher(q, k, q_weight, k_weight, eps, weight_bias, out_q, out_k)
    try:
        # The compiled host code checks dtypes, shapes, strides, alignment and devices itself
        # and raises before launching; on any failure the full checks say what is wrong.
        fn(q, k, q_weight, k_weight, out_q, out_k)
    except Exception:
        _validate(q, k, q_weight, k_weight, out_q, out_k)
        raise


@torch.library.custom_op("rosekernels::qk_norm", mutates_args=("out_q", "out_k"))
def _qk_norm_op(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                out_q: torch.Tensor, out_k: torch.Tensor, eps: float, weight_bias: float) -> None:
    _run(q, k, q_weight, k_weight, eps, weight_bias, out_q, out_k)


@_qk_norm_op.register_fake
def _(q, k, q_weight, k_weight, out_q, out_k, eps, weight_bias) -> None:
    return None


def qk_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
            eps: float = 1e-6, weight_bias: float = 0.0, out_q: torch.Tensor | None = None,
            out_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [T, hq, d] and k [T, hk, d] (d in 64/128/256) in one launch.

    `y = x * rsqrt(mean(x^2) + eps) * (w + weight_bias)` with fp32 math; q/k may be strided views
    (e.g. of a fused qkv buffer); weights are [d] in the input dtype or fp32. Results go to
    out_q/out_k (new tensors by default; out_q=q, out_k=k normalizes in place).

    Eager calls launch the kernel directly (torch.library dispatch would add several us of host
    time per call); under torch.compile the call goes through the custom op rosekernels::qk_norm.
    """
    if out_q is None:
        out_q = torch.empty_like(q)
    if out_k is None:
        out_k = torch.empty_like(k)
    if torch.compiler.is_compiling():
        torch.ops.rosekernels.qk_norm(q, k, q_weight, k_weight, out_q, out_k, eps, weight_bias)
    else:
        _run(q, k, q_weight, k_weight, eps, weight_bias, out_q, out_k)
    return out_q, out_k
