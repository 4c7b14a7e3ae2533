"""What the two attention kernels share: the prefill kernel (rosekernels.kernels.attention) and the
split-KV decode kernel (rosekernels.kernels.attention_decode) take the same arguments (q [B, S_q, Hq, d],
k/v [B, S_kv, Hkv, d], out like q, lse [B, Hq, S_q] fp32), so they share the argument checks, the TMA
views and the compile-time stand-ins of those arguments, the register-level device helpers (quad
reductions, accumulator views, conversions, MMA issue), and the float64 reference their workloads and
tests check against.
"""
from __future__ import annotations

import math

import torch

from rosekernels import jit  # noqa: F401 - first: it pins CUTE_DSL_ARCH=sm_90a before cutlass loads
from rosekernels import checks
from rosekernels.kernels.attention_plan import DTYPES, HEAD_DIMS

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
FP32 = torch.finfo(torch.float32)

CUTE_DTYPES = {name: checks.cute_dtype(name) for name in DTYPES}
TORCH_DTYPES = {checks.TORCH_DTYPE[name]: name for name in DTYPES}
MAX_INDEX = 2**31  # the attention kernels index elements, keys and tiles with 32 bits
GRID_BATCH = 65535  # batch entries in one launch: the decode kernel's grid has a batch dimension
ALLOCATED_OUT = "out (allocated contiguous in q's shape)"  # what the span checks call out when out=None

# ---------------------------------------------------------------------------------------------
# Device helpers.


@cute.jit
def quad_max(x: Float32) -> Float32:
    """The max over the 4 threads of a quad (the threads that share an accumulator row)."""
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def quad_sum(x: Float32) -> Float32:
    """The sum over the 4 threads of a quad."""
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


def acc_rows(t: cute.Tensor) -> cute.Tensor:
    """An MMA accumulator seen as (rows, cols) of this thread: a WGMMA one ((2, 2, N/8), MMA_M, MMA_N) or
    an mma.sync one ((2, 2), MMA_M, MMA_N). Value mode (0, 0) steps a column, (0, 1) 8 rows, (0, 2) 8
    columns: a thread holds 2 * MMA_M rows, each shared with the 3 other threads of its quad."""
    cm = cute.make_layout(t.layout.shape)  # compact indices, composed with the real layout below
    values, value_strides = cm.shape[0], cm.stride[0]
    shape = ((values[1], cm.shape[1]), (values[0], *values[2:], cm.shape[2]))
    stride = ((value_strides[1], cm.stride[1]), (value_strides[0], *value_strides[2:], cm.stride[2]))
    return cute.make_tensor(t.iterator, cute.composition(t.layout, cute.make_layout(shape, stride=stride)))


def acc_as_a(t: cute.Tensor) -> cute.Tensor:
    """An accumulator ((2, 2), MMA_M, MMA_N) as the A operand ((2, 2, 2), MMA_M, MMA_N / 2) of the
    next mma.sync: two neighbouring n8 blocks of C are the two k halves of one k16 block of A."""
    l = cute.logical_divide(t.layout, (None, None, 2))
    layout = cute.make_layout(
        ((l.shape[0][0], l.shape[0][1], l.shape[2][0]), l.shape[1], l.shape[2][1]),
        stride=((l.stride[0][0], l.stride[0][1], l.stride[2][0]), l.stride[1], l.stride[2][1]))
    return cute.make_tensor(t.iterator, layout)


def _asm_i32(ptx: str, constraints: str, args: list, loc, ip) -> Int32:
    """One 32-bit register out of an inline PTX instruction (`constraints`: its output's, then its inputs')."""
    return Int32(llvm.inline_asm(T.i32(), [a.ir_value(loc=loc, ip=ip) for a in args], ptx, constraints,
                                 has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))


@dsl_user_op
def cvt_pair(lo: Float32, hi: Float32, to: cutlass.Constexpr, *, loc=None, ip=None) -> Int32:
    """Two fp32 -> one packed bf16x2/f16x2 register (cvt.rn puts its first source in the high half)."""
    kind = "bf16x2" if to is cutlass.BFloat16 else "f16x2"
    return _asm_i32(f"cvt.rn.{kind}.f32 $0, $1, $2;", "=r,f,f", [Float32(hi), Float32(lo)], loc, ip)


@dsl_user_op
def byte_perm(a: Int32, b: Int32, selector: cutlass.Constexpr, *, loc=None, ip=None) -> Int32:
    """prmt.b32: byte i of the result is byte (selector >> 4 i) & 7 of the eight bytes of a (0-3) and b (4-7)."""
    return _asm_i32(f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r", [Int32(a), Int32(b)], loc, ip)


@dsl_user_op
def e4m3x2_to_f16x2(word: Int32, high: cutlass.Constexpr, *, loc=None, ip=None) -> Int32:
    """The low (or `high`) two e4m3 bytes of `word` as f16x2, the lower byte into the lower half: one conversion,
    which reads the upper half in place (an extract first, when the DSL's vector conversion does it)."""
    half = "hi" if high else "lo"
    return _asm_i32(f"{{ .reg .b16 lo, hi; mov.b32 {{lo, hi}}, $1; cvt.rn.f16x2.e4m3x2 $0, {half}; }}", "=r,r",
                    [Int32(word)], loc, ip)


@dsl_user_op
def opaque(word: Int32, *, loc=None, ip=None) -> Int32:
    """`word` through an instruction the compilers cannot see through, so that what made it stays where it was made."""
    return _asm_i32("mov.b32 $0, $1;", "=r,r", [Int32(word)], loc, ip)


@cute.jit
def pack_pairs(frag: cute.Tensor):
    """A 16-bit register fragment's pairs packed once, here: left to themselves the compilers pack each pair where
    a loop's MMA reads it (every iteration), holding the halves in a register each."""
    words = cute.recast_tensor(frag, Int32)
    for i in cutlass.range_constexpr(cute.size(words)):
        words[i] = opaque(words[i])


@cute.jit
def convert_pairs(src: cute.Tensor, dst: cute.Tensor):
    """fp32 registers -> 16-bit registers, same element order, one cvt per pair.

    (TensorSSA.to() converts element by element for most tile shapes, doubling the work.)"""
    dst32 = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(dst32)):
        dst32[i] = cvt_pair(src[2 * i], src[2 * i + 1], dst.element_type)


@cute.jit
def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
          zero_init: cutlass.Constexpr[bool]):
    """Issue acc (+)= A @ B as one WGMMA commit group over all k blocks (no wait)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)  # a fresh atom: its ACCUMULATE field is mutated below
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@cute.jit
def warp_mma(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
             tBs: cute.Tensor | None = None, copy_B: cute.TiledCopy | None = None):
    """acc += A @ B for one warp: A in registers, B loaded from shared memory (`tBs`, by `copy_B`) one k block at
    a time, or in registers already (tBs None)."""
    for kb in cutlass.range_constexpr(cute.size(tB.shape[2])):
        if cutlass.const_expr(tBs is not None):
            cute.copy(copy_B, tBs[None, None, kb], copy_B.retile(tB)[None, None, kb])
        cute.gemm(tiled_mma, acc, tA[None, None, kb], tB[None, None, kb], acc)


def tma_tiles(atom: cute.CopyAtom, smem: cute.Tensor, gmem: cute.Tensor) -> tuple:
    """(smem, gmem) views of a one-CTA TMA copy: `gmem` tiled like `smem` (first two modes one tile)."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
                                 cute.group_modes(gmem, 0, 2))


def fake_qkv_out_lse(dtype: str, head_dim: int) -> tuple:
    """Compile-time stand-ins for (q, k, v, out, lse), so one compile serves every batch, length,
    head count and stride: [B, S, H, d] with any 16-byte-aligned strides and a unit last stride
    (TMA needs that much); lse [B, Hq, S_q] compact fp32."""
    b, s_q, s_k, h_q, h_k = (cute.sym_int() for _ in range(5))

    def qkv(s, h):
        strides = tuple(cute.sym_int(divisibility=8) for _ in range(3))
        return make_fake_tensor(CUTE_DTYPES[dtype], (b, s, h, head_dim), stride=(*strides, 1), assumed_align=16)

    lse = make_fake_compact_tensor(Float32, (b, h_q, s_q), stride_order=(2, 1, 0), assumed_align=16)
    return qkv(s_q, h_q), qkv(s_k, h_k), qkv(s_k, h_k), qkv(s_q, h_q), lse


# ---------------------------------------------------------------------------------------------
# Host helpers.


def validate(q, k, v, out, softmax_scale, pointers: bool = True, sliced: bool = False) -> float:
    """Check every argument of an attention call before any launch (shapes first, then devices and
    memory layout); return the softmax scale. pointers=False (traced calls: torch.compile cannot read
    a data pointer) checks the strides' alignment only; the compiled launch checks the pointers'.
    sliced: the caller launches the batch in slices of `batch_per_launch` entries, so the grid and
    32-bit span limits apply to one slice."""
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t is None and name == "out":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seqlen, heads, head_dim], got shape {list(t.shape)}")
    checks.check_dtype("q", q, TORCH_DTYPES)
    for name, t in (("k", k), ("v", v), ("out", out)):
        if t is not None:
            checks.check_dtype(name, t, (q.dtype,))
    B, _, Hq, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be 64 or 128, got {d}")
    checks.check_shape("k", k, (B, None, None, d))
    checks.check_shape("v", v, tuple(k.shape))
    if out is not None:
        checks.check_shape("out", out, tuple(q.shape))
    if Hq > 65535 or (B > GRID_BATCH and not sliced):  # the prefill grid is 1-D, the decode kernel's is not
        raise ValueError(f"batch ({B}) and heads ({Hq}) must each be at most 65535 (grid limits)")
    # out=None: the limits apply to the out the op allocates, contiguous (a q whose rows overlap spans less).
    out_like = torch.empty(q.shape, device="meta") if out is None else out
    # Sliced: the span limit holds per launch.
    per = min(batch_per_launch(q, k, v, out_like), B) if sliced else B
    Hkv = k.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the KV heads ({Hkv})")
    if k.shape[1] == 0 and q.numel():
        raise ValueError("k and v must hold at least one key")
    scale = scale_of(d, softmax_scale)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t is not None:
            check_operand(name, t, pointers, entries=per)
    check_out(out, q, k, v, pointers, per)
    checks.check_same_device(q=q, k=k, v=v, out=out)
    return scale


def batch_per_launch(*tensors) -> int:
    """The most batch entries one launch takes: the grid's GRID_BATCH and, for each operand (4-D, None
    skipped), a span under MAX_INDEX elements (the kernels index with 32 bits). At least 1: one entry
    that reaches further is refused by validate()."""
    most = GRID_BATCH
    for t in tensors:
        if t is not None and t.shape[0] > 1 and t.stride(0) > 0:
            inner = sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:]))
            most = min(most, (MAX_INDEX - 1 - inner) // t.stride(0) + 1)
    return max(1, most)


def scale_of(head_dim: int, softmax_scale) -> float:
    """The softmax scale a call asks for (None: 1 / sqrt(head_dim)); ValueError unless scale * log2(e),
    which the kernels take in fp32, is a positive normal fp32 number (past its range it is inf, and the
    output NaN; a subnormal one flushes to 0 in fast-math code)."""
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not FP32.tiny <= scale * LOG2_E <= FP32.max:
        raise ValueError(f"softmax_scale must be positive, with scale * log2(e) (what the kernels take) a normal "
                         f"fp32 number, got {softmax_scale}")
    return scale


def check_operand(name: str, t: torch.Tensor, pointers: bool = True, vectors: bool = True,
                  entries: int | None = None) -> None:
    """The device and memory layout of one tensor argument: on CUDA, unit last stride, 16-byte aligned
    (`vectors`: TMA and vector loads read it; pointers=False checks the strides only, for traced
    calls), no zero stride, and a span the kernels' 32-bit indexing reaches (over its first `entries`
    entries of dim 0, where a launch takes no more)."""
    checks.check_cuda(name, t)
    if t.numel() == 0:
        return
    checks.check_unit_last_stride(name, t)
    if vectors:
        checks.check_aligned(name, tma_view(t), 16, pointer=pointers)
    if any(s == 0 for n, s in zip(t.shape, t.stride()) if n > 1):
        raise ValueError(f"{name} has a zero stride (an expanded view); pass a materialized tensor")
    check_span(name, t, entries)


def check_out(out: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pointers: bool,
              entries: int | None = None, names: tuple[str, str] = ("k", "v")) -> None:
    """What out needs beyond check_operand's: None, the out the op allocates (contiguous in q's shape: it may
    span more than a q whose rows overlap) within the span limit over `entries`; given, elements of its own
    (CTAs' stores would race) and, with `pointers`, apart from q, k and v (`apart`)."""
    if out is None:
        check_span(ALLOCATED_OUT, torch.empty(q.shape, device="meta"), entries)
        return
    checks.check_not_expanded("out", out)
    if pointers:
        apart(out, q, k, v, names).check(out, q, k, v)


def check_span(name: str, t: torch.Tensor, entries: int | None = None) -> None:
    """ValueError unless t's span (over its first `entries` entries of dim 0) stays under MAX_INDEX."""
    shape = t.shape if entries is None else (min(entries, t.shape[0]), *t.shape[1:])
    if t.numel() and sum((n - 1) * s for n, s in zip(shape, t.stride())) >= MAX_INDEX:
        raise ValueError(f"{name} spans 2^31 elements or more; the kernel indexes with 32 bits")


def apart(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          names: tuple[str, str] = ("k", "v")) -> checks.Disjoint:
    """The check that out shares no memory with k and v, which other CTAs read while one writes out, nor
    with q unless it is q itself (each CTA reads its Q rows before it writes its O rows there; out a row
    off q would overwrite another CTA's). Interleaved rows of one buffer pass: q's slot of a fused qkv
    buffer as out."""
    return checks.Disjoint({"out": out, "q": q, names[0]: k, names[1]: v}, ("out",), {"out": "q"})


class OutApart:
    """The plan of a signature with out given, for launch(q, k, v, out, ...): each call first checks that
    out keeps apart from q, k and v (`apart`), whose pointers the plan's key leaves out: pointer arithmetic."""

    def __init__(self, plan, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 names=("k", "v")):
        self.plan, self.apart = plan, apart(out, q, k, v, names)

    def launch(self, q, k, v, out, *rest) -> None:
        self.apart.check(out, q, k, v)
        self.plan.launch(q, k, v, out, *rest)


def tma_view(t: torch.Tensor) -> torch.Tensor:
    """The same view, with the strides of size-1 dims made those of a contiguous tensor: they never
    address memory, but the TMA descriptor wants every stride a multiple of 16 bytes."""
    vec = 16 // t.element_size()
    if all(n > 1 or s % vec == 0 for n, s in zip(t.shape[:-1], t.stride()[:-1])):
        return t
    regular = torch.empty(t.shape, device="meta").stride()
    return t.as_strided(t.shape, tuple(s if n > 1 else r for n, s, r in zip(t.shape, t.stride(), regular)))


def views_needed(*tensors) -> bool:
    """Whether any of `tensors` (None skipped) needs `tma_view`: decided once per argument
    signature, since the strides are part of it."""
    return any(tma_view(t) is not t for t in tensors if t is not None)


def reference(q, k, v, causal, scale, lowp=False, rows=None):
    """(out, lse) in float64; lowp: the kernels' rounding (P and out in the input dtype, fp32 math);
    rows: only these query rows (a 1-D index tensor), out [B, len(rows), Hq, d], lse [B, Hq, len(rows)].

    Causal is bottom-right aligned; a row that sees no key gets out = 0, lse = -inf."""
    b, _, hq, d = q.shape
    hkv = k.shape[2]
    ratio = hq // hkv
    acc = torch.float32 if lowp else torch.float64
    s_q, s_k = q.shape[1], k.shape[1]
    i = torch.arange(s_q, device=q.device) if rows is None else rows.to(q.device)
    n = i.numel()
    # Query head h reads KV head h // ratio: each KV head's query heads as one [ratio * rows] block of rows.
    qh = q[:, i].to(acc).view(b, n, hkv, ratio, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, ratio * n, d)
    kh, vh = (t.transpose(1, 2).to(acc) for t in (k, v))  # [B, Hkv, S_kv, d]
    s = qh @ kh.transpose(-1, -2) * scale
    if causal:
        j = torch.arange(s_k, device=q.device)[None, :]
        s = s.masked_fill(j > i.repeat(ratio)[:, None] + s_k - s_q, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if lowp:
        p = p.to(q.dtype).to(acc)
    out = (p @ vh).view(b, hkv, ratio, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, hq, d)
    if lowp:
        out = out.to(q.dtype)
    return out.double(), lse.view(b, hq, n).double()


CHECK_SCORES = 2**26  # float64 scores a check computes at most (512 MiB); larger calls check sampled rows


def check(out, lse, q, k, v, causal, scale, what) -> float:
    """Raise AssertionError unless out is within 2x the error of a same-precision reference (+1e-3)
    and every element is written; with lse: lse within 1e-3, -inf exactly on the rows that see no
    key, and those rows of out 0. Returns the largest |out - reference|. Where the scores of every
    row would exceed CHECK_SCORES, the references cover query rows drawn at random (the first and
    last among them) against every key; the unwritten-element check still covers all of out."""
    assert not out.isnan().any(), f"{what}: {out.isnan().sum().item()} output elements unwritten (NaN)"
    assert lse is None or not lse.isnan().any(), f"{what}: {lse.isnan().sum().item()} lse elements unwritten (NaN)"
    b, s_q, h = q.shape[:3]
    rows = None
    if b * h * s_q * k.shape[1] > CHECK_SCORES:
        count = min(s_q, max(16, CHECK_SCORES // (b * h * k.shape[1])))
        g = torch.Generator().manual_seed(s_q * 7919 + k.shape[1])
        rows = torch.cat([torch.tensor([0, s_q - 1]), torch.randperm(s_q, generator=g)[:count - 2]]).unique()
        out, lse = out[:, rows.to(out.device)], None if lse is None else lse[:, :, rows.to(lse.device)]
    ref, ref_lse = reference(q, k, v, causal, scale, rows=rows)
    lowp, _ = reference(q, k, v, causal, scale, lowp=True, rows=rows)
    err = (out.double() - ref).abs().max().item()
    err_lowp = (lowp - ref).abs().max().item()
    assert err <= 2 * err_lowp + 1e-3, f"{what}: max |out - ref| = {err:.3g}, same-precision reference {err_lowp:.3g}"
    if lse is None:
        return err
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), f"{what}: -inf lse rows differ from the reference"
    assert (out.double()[empty.transpose(1, 2)] == 0).all(), f"{what}: a row that sees no key is not 0"
    lse_err = (lse.double() - ref_lse)[~empty].abs().max().item() if (~empty).any() else 0.0
    assert lse_err <= 1e-3, f"{what}: max |lse - ref| = {lse_err:.3g}"
    return err
