"""What the MoE modules share (moe_dispatch, moe_combine, the peer kernels of moe_peer and the ops):
the dtypes they take, the device check, the canonical strides of size-1 dims, the result of a
dispatch, and the weighted sum of expert rows that moe_combine and the tensor-parallel reduce both run.
"""
from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def check_sm90(device: torch.device) -> None:
    cc = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if cc != (9, 0):
        raise RuntimeError(f"rosekernels MoE kernels are compiled for sm_90a (H100/H200); "
                           f"{device} is sm_{cc[0]}{cc[1]}")


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """`t` with the strides of a contiguous tensor on its size-1 dims (any stride is legal there; the
    kernels' signatures want the last one unit and row strides multiples of 16 bytes); `t` itself
    when they already are (and for anything not a tensor)."""
    if not isinstance(t, torch.Tensor) or 1 not in t.shape:
        return t
    strides, inner = list(t.stride()), 1
    for i in range(t.dim() - 1, -1, -1):
        if t.shape[i] == 1:
            strides[i] = inner
        inner = strides[i] * t.shape[i]
    return t if strides == list(t.stride()) else t.as_strided(t.shape, strides)


class MoeDispatch:
    """What `moe_dispatch` returns; every tensor is on x's device, written in the same stream.

    buffer   [capacity, H], x.dtype: expert e's tokens in rows offsets[e] .. +counts[e]-1
    slot_map [T, k] int32: buffer row of each (token, choice), -1 = dropped
    counts   [E] int32: tokens of each expert stored in the buffer (local_experts: E = its count)
    offsets  [E+1] int32: first row of each expert's segment, offsets[E] = rows in use
    overflow [1] int32: routed pairs not stored for lack of capacity
    invalid  [1] int32: ids outside [-1, num_experts) (all ranks' experts); when > 0 nothing was dispatched
    The last four are views of one int32 tensor `meta`, made on access (a view costs host time).
    """

    def __init__(self, buffer: torch.Tensor, slot_map: torch.Tensor, meta: torch.Tensor,
                 num_experts: int | None = None):
        self.buffer, self.slot_map, self.meta = buffer, slot_map, meta
        self.num_experts = self._experts() if num_experts is None else num_experts  # all ranks' (tensor parallel)

    @property
    def counts(self) -> torch.Tensor:
        return self.meta[:self._experts()]

    @property
    def offsets(self) -> torch.Tensor:
        e = self._experts()
        return self.meta[e:2 * e + 1]

    @property
    def overflow(self) -> torch.Tensor:
        return self.meta[-2:-1]

    @property
    def invalid(self) -> torch.Tensor:
        return self.meta[-1:]

    def _experts(self) -> int:
        return (self.meta.shape[0] - 3) // 2

    def check(self) -> None:
        """Raise if the dispatch dropped pairs for lack of capacity or saw invalid ids (synchronises)."""
        invalid, overflow = int(self.invalid.item()), int(self.overflow.item())
        if invalid:
            raise ValueError(f"moe_dispatch: {invalid} expert ids outside [-1, {self.num_experts}); "
                             "nothing was dispatched")
        if overflow:
            raise RuntimeError(f"moe_dispatch: {overflow} routed pairs did not fit the buffer capacity "
                               f"{self.buffer.shape[0]} and were dropped")


# ---------------------------------------------------------------------------------------------
# Device code.


@cute.jit
def weighted_sum(gY: cute.Tensor, mW: cute.Tensor, mSlot: cute.Tensor, t: Int32, v: Int32, rows: Int32,
                 k: cutlass.Constexpr[int], vec: cutlass.Constexpr[int], dtype: cutlass.Constexpr):
    """sum_j mW[t, j] * vector v of row mSlot[t, j] of gY ((1, vec), (rows, vectors)), in fp32 (vec,),
    slots outside [0, rows) skipped. First the k loads, none waited for (predicated, no branches): each
    vector as 4 x b32, zero when its slot is skipped (its weight too); then the sum in the order j = 0..k-1."""
    raw = cute.make_rmem_tensor((4, k), Int32)
    weights = cute.make_rmem_tensor((k,), Float32)
    for j in cutlass.range_constexpr(k):
        s = mSlot[t, j]
        ok = (s >= 0) & (s < rows)
        weights[j] = cutlass.select_(ok, Float32(mW[t, j]), Float32(0.0))
        b = load_16b_or_zero(gY[(None, None), (s, v)].iterator, ok)
        for q in cutlass.range_constexpr(4):
            raw[q, j] = b[q]
    vals = cute.recast_tensor(raw, dtype)  # (vec, k)
    acc = cute.full((vec,), 0.0, Float32)
    for j in cutlass.range_constexpr(k):
        acc = acc + vals[None, j].load().to(Float32) * weights[j]
    return acc


@cute.jit
def load_16b_or_zero(ptr: cute.Pointer, pred: cutlass.Boolean):
    """16 bytes at `ptr` when `pred`, else zeros: a predicated ld.global.v4, no branch to wait behind."""
    return cute.arch.inline_ptx(
        "{\n.reg .pred p;\nsetp.ne.b32 p, {$r1}, 0;\n"
        "mov.b32 {$w0}, 0;\nmov.b32 {$w1}, 0;\nmov.b32 {$w2}, 0;\nmov.b32 {$w3}, 0;\n"
        "@p ld.global.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];\n}",
        write_only_types=[Int32] * 4,
        read_only_args=[ptr, Int32(pred)],
    )
