"""FP8 (e4m3) quantization shared by the kernels, the ops and the references, without CuTeDSL.

A tensor is quantized in blocks: each block's scale is amax / E4M3_MAX (amax: its largest magnitude, at
least AMAX_FLOOR so that an all-zero block gets a finite scale and zeros), and its elements are rounded
to e4m3 after multiplying by E4M3_MAX / amax, saturating at +-E4M3_MAX (never inf or NaN from finite
input). x ~ q * scale. The blocks (rows x columns of a 2-D tensor; None: the whole dimension):

    per tensor      (None, None)   scales [1]
    per row         (1, None)      scales [R]            tokens (activations) or output channels (weights)
    per 1 x 128     (1, 128)       scales [R, C / 128]   activations for 128 x 128 block-scaled weights
    per 128 x 128   (128, 128)     scales [ceil(R / 128), ceil(C / 128)]   weights (DeepSeek-V3's blocks)

The kernels compute the same in fp32 (`quantize_fp8`, the norms' fused quantization); `quantize` here
does it in torch, in fp32 for the weights (`quantize_weight_fp8`) or float64 for the references.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3 value
BLOCK = 128  # the group and block edge of the block-scaled scheme
# The smallest amax a scale is taken from: an all-zero block gets scale AMAX_FLOOR / E4M3_MAX (and zeros),
# not 0 / 0. Small enough to leave any real data's scale alone, large enough that E4M3_MAX / amax is finite.
AMAX_FLOOR = 1e-12
# Weight schemes of quantize_weight_fp8 and their blocks.
WEIGHT_SCHEMES = {"tensor": (None, None), "channel": (1, None), "block": (BLOCK, BLOCK)}


def quantize(x: torch.Tensor, block_rows: Optional[int], block_cols: Optional[int],
             dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3, scales) of the 2-D `x` in blocks of block_rows x block_cols (None: the whole dimension),
    with the math in `dtype` (the scales come back in it): see the module docstring for the layouts."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {list(x.shape)}")
    rows, cols = x.shape
    br, bc = block_rows or max(rows, 1), block_cols or max(cols, 1)
    # A dimension taken whole is one block, also when empty (an empty weight's per-tensor scale: of zeros).
    nr, nc = math.ceil(rows / br) if block_rows else 1, math.ceil(cols / bc) if block_cols else 1
    padded = torch.zeros(nr * br, nc * bc, dtype=dtype, device=x.device)
    big = torch.finfo(dtype).max  # finite values beyond it (float64 in fp32 math) saturate, not overflow to inf
    padded[:rows, :cols] = x.clamp(-big, big) if torch.finfo(x.dtype).max > big else x
    blocks = padded.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)  # [nr, nc]
    q = (blocks * (E4M3_MAX / amax)[:, None, :, None]).view(nr * br, nc * bc)[:rows, :cols].to(E4M3)
    scales = amax / E4M3_MAX
    if block_rows is None and block_cols is None:
        scales = scales.view(1)
    elif block_cols is None:
        scales = scales.view(nr)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, block_rows: Optional[int], block_cols: Optional[int],
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """q * scale of its block, in `dtype`: the inverse of `quantize` up to e4m3's rounding."""
    rows, cols = q.shape
    br, bc = block_rows or max(rows, 1), block_cols or max(cols, 1)
    s = scales.to(dtype).reshape(math.ceil(rows / br) if block_rows else 1, math.ceil(cols / bc) if block_cols else 1)
    s = s.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return q.to(dtype) * s


def check_quantized(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int, rel: float = 1e-6) -> float:
    """Raise AssertionError unless (q, scales) quantize x (float64 truth; the kernel rounded its fp32 values,
    within `rel` of x) per row (group 0) or per 1 x `group` group: each scale within `rel` of the group's
    amax / E4M3_MAX, each q within half an e4m3 step of x / scale (the step of its binade, or of the
    subnormals; widened by what `rel` moves the value) and finite. Returns the worst error in half-steps."""
    x = x.double()
    want_s = quantize(x, 1, group or None, torch.float64)[1]
    got_s = scales.double().reshape(want_s.shape)
    assert torch.isfinite(q.float()).all(), "q holds a NaN (an unwritten element, or e4m3 overflow)"
    assert ((got_s - want_s).abs() <= rel * want_s).all(), f"scales differ: {got_s} vs {want_s}"
    s = got_s.view(-1, 1) if group == 0 else got_s.repeat_interleave(group, 1)
    scaled = (x / s).clamp(-E4M3_MAX, E4M3_MAX)
    step = torch.exp2(torch.floor(torch.log2(scaled.abs().clamp_min(2.0 ** -6))) - 3)  # 3 mantissa bits
    err = (q.double() - scaled).abs() / (0.5 * step)
    worst = err.max().item() if err.numel() else 0.0
    # A value within `rel` of a rounding tie may round either way: 16 rel half-steps (a half-step is at least
    # 2^-4 of the value) plus fp32's rounding of the scaled value.
    assert worst <= 1 + 16 * rel + 1e-5, f"q off by {worst:.6g} half-steps at {divmod(err.argmax().item(), x.shape[1])}"
    return worst
