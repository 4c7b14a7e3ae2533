"""Argument checks shared by every op: each failure is a clear error raised before anything is written;
and the error measure of outputs rounded from fp32 math (norms) against a float64 reference."""
from __future__ import annotations

import math
from typing import Iterable

import torch

DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
              torch.int32: "i32", torch.int64: "i64"}
TORCH_DTYPE = {name: dtype for dtype, name in DTYPE_NAME.items()}
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "i32": 4, "i64": 8}
# Kernels form a 32-bit index up to one block's work (threads x unrolled steps, a grid's CTAs past a
# tile count) beyond the bound they test it against: sizes must leave this much below 2^31.
INDEX_SLACK = 1 << 16


def cute_dtype(name: str):
    """The CuTeDSL element type of a dtype name ("bf16", "fp16", "fp32", ...). CuTeDSL is imported
    here, not at the top: plan modules use this module without it."""
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32,
            "i32": cutlass.Int32, "i64": cutlass.Int64}[name]


def vector_elems(name: str) -> int:
    """Elements of dtype `name` per 128-bit access."""
    return 16 // ELEM_BYTES[name]


def vector_width(dtype: torch.dtype) -> int:
    """Elements per 128-bit access."""
    return 16 // dtype.itemsize


def check_cuda(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")


def check_dtype(name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {names}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """`shape` entries of None match any size."""
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} has shape {list(t.shape)}; expected {want}")


def check_unit_last_stride(name: str, t: torch.Tensor) -> None:
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension, got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")


def check_not_expanded(name: str, t: torch.Tensor) -> None:
    """An output's elements must be distinct memory locations, or the kernel's writes race: no zero
    stride on a dim of size > 1 (an expanded view), and, the dims taken by increasing stride, none
    stepping less than the span of those before it (rows overlapping one another, as as_strided can
    make; a permuted slice of a contiguous tensor passes)."""
    if any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride())):
        raise ValueError(f"{name} has a zero stride (an expanded view); an output must be materialized")
    reach = 0  # the largest element offset of the dims taken so far
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            raise ValueError(f"{name}'s elements overlap one another (shape {list(t.shape)}, strides {t.stride()}); "
                             "an output must not")
        reach += (size - 1) * stride


def extent(t: torch.Tensor) -> int:
    """Bytes from a non-empty tensor's first element to past its last: fixed by its shape, strides and dtype."""
    return (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()


def row_layout(t: torch.Tensor) -> tuple[int, int] | None:
    """(stride, length) in bytes of t's rows: t as rows of contiguous elements (its innermost dims of size > 1
    that are contiguous, at least one dim left) a uniform stride apart (the dims before them, merged where
    each steps over the whole of the next: x [M, N]; q [T, H, d] or [B, S, H, d] with its heads packed, a
    token's H * d, also as a slice of a fused qkv buffer); None for other layouts and a single row."""
    dims = [(n, s) for n, s in zip(t.shape, t.stride()) if n > 1]
    if len(dims) < 2:
        return None
    inner, row = len(dims), 1
    while inner > 1 and dims[inner - 1][1] == row:
        inner -= 1
        row *= dims[inner][0]
    if inner == len(dims):
        return None
    for (_, outer), (n, s) in zip(dims[:inner - 1], dims[1:inner]):
        if outer != n * s:
            return None
    return dims[inner - 1][1] * t.element_size(), row * t.element_size()


class Disjoint:
    """Whether a kernel's outputs share memory with an input or with one another (its writes would race with
    its reads and with each other), except an output that is exactly its in-place input (the same address,
    dtype, shape and strides). Memory is compared by span (from the first element, `extent` bytes), rows of one
    buffer that interleave (row_layout) excepted: no element shared, no race. Built from one call's tensors,
    whose shapes, strides and dtypes fix everything but the addresses (a planned signature): every op's plan
    keeps one, and a later call with those costs pointer arithmetic."""

    def __init__(self, named: dict[str, torch.Tensor | None], outputs: tuple[str, ...], in_place: dict[str, str]):
        self.names = list(named)
        present = {n: t for n, t in named.items() if t is not None and t.numel()}  # an empty tensor spans nothing
        extents = {n: extent(t) for n, t in present.items()}
        layout = {n: row_layout(t) for n, t in present.items()}
        self.pairs = []
        for i, out in enumerate(outputs):
            for other in [n for n in self.names if n not in outputs] + list(outputs[:i]):
                if out not in present or other not in present:
                    continue
                o, t = present[out], present[other]
                # the same elements: a size-1 dim's stride addresses nothing
                alias = in_place.get(out) == other and (o.dtype, o.shape) == (t.dtype, t.shape) and all(
                    a == b for n, a, b in zip(o.shape, o.stride(), t.stride()) if n > 1)
                # Rows of one stride with room for a row of each (q and k of one fused qkv buffer, two column
                # slices of a matrix) interleave where other's start `offset` bytes after out's, modulo the
                # stride, falls in low..high: their spans overlap, their elements do not.
                period = low = high = 0
                if layout[out] and layout[other] and layout[out][0] == layout[other][0]:
                    (period, out_row), other_row = layout[out], layout[other][1]
                    low, high = out_row, period - other_row
                self.pairs.append((self.names.index(out), self.names.index(other), extents[out], extents[other], alias,
                                   period if low <= high else 0, low, high))

    def clash(self, *tensors: torch.Tensor | None) -> tuple[str, str] | None:
        """The first (output, other) of `tensors` (in the order of `named`) that share memory, or None."""
        ptrs = [0 if t is None else t.data_ptr() for t in tensors]
        for o, t, out_extent, other_extent, alias, period, low, high in self.pairs:
            offset = ptrs[t] - ptrs[o]
            if (-other_extent < offset < out_extent and not (alias and offset == 0)
                    and not (period and low <= offset % period <= high)):
                return self.names[o], self.names[t]
        return None

    def check(self, *tensors: torch.Tensor | None) -> None:
        clash = self.clash(*tensors)
        if clash:
            raise ValueError("{} must not overlap {}".format(*clash))


def check_vectors(vectors: dict[str, torch.Tensor], outputs: Iterable[str] = (),
                  **others: torch.Tensor | None) -> None:
    """What a kernel that moves `vectors` in 128-bit accesses needs of their memory, each check over every
    tensor before the next: a unit last stride, 16-byte alignment, the `outputs` not expanded; then
    these and the `others` (None: absent) on CUDA, all on one device."""
    for name, t in vectors.items():
        check_unit_last_stride(name, t)
    for name, t in vectors.items():
        check_aligned(name, t)
    for name in outputs:
        check_not_expanded(name, vectors[name])
    named = {**vectors, **others}
    for name, t in named.items():
        if t is not None:
            check_cuda(name, t)
    check_same_device(**named)


def check_aligned(name: str, t: torch.Tensor, nbytes: int = 16, pointer: bool = True) -> None:
    """Vectorized kernels read 16-byte chunks: the base address and row strides must allow it.
    pointer=False checks the strides only (a traced tensor has no address yet)."""
    elem = t.element_size()
    if (pointer and t.data_ptr() % nbytes) or any(s * elem % nbytes for s in t.stride()[:-1] if s):
        raise ValueError(f"{name} must be {nbytes}-byte aligned (base pointer and row strides)")


# A correct kernel rounds an fp32-accurate result to the output dtype once: at most half an ulp off,
# 2^-8 of the value in bf16 and 2^-11 in fp16; the bounds leave ~2% of that for the fp32 math before.
ROUNDING_TOLERANCE = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 2e-5}


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / |ref| over the elements (ref float64; NaN in got counts as infinite). A
    reference smaller than got's smallest normal number is measured against that number instead:
    subnormal outputs round in absolute steps."""
    if not got.numel():
        return 0.0
    err = (got.double() - ref).abs() / ref.abs().clamp_min(torch.finfo(got.dtype).tiny)
    return err.nan_to_num(math.inf).max().item()
