"""The prefill attention kernel's softmax (rosekernels.kernels.attention) on one tile of scores S, in
registers: the mask (keys past the sequence, and causal, past the row's diagonal), the online softmax
S -> P with the running row max and sum, and the rescale of O when the max moves.

The split-KV decode kernel (attention_decode.py) computes the same online softmax inline, and cannot
call this one without changing its cubins: its warps hold 4 to 32 columns of a row and fold them into
one max chain that starts at the running max and one sum chain, in column order; this softmax folds
32 to 64 columns in four chains each. One function for both changes one kernel's order of additions,
so the last bits of its results and every byte of its cubins (checked: the decode kernel compiled
with `online_softmax` gave other cubins at tile_m 16 and 64, bf16, d = 128).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from rosekernels.kernels.attention_common import acc_rows, quad_max


@cute.jit
def apply_mask(acc_S, tScS, t0ScS, n_block, m_block, seqlen_k, causal_offset, tile_m: cutlass.Constexpr[int],
               tile_n: cutlass.Constexpr[int], causal: cutlass.Constexpr[bool]):
    """Set S (key tile n_block of query tile m_block) to -inf where the key is past seqlen_k or (causal)
    past the row's diagonal; tScS / t0ScS: this thread's and thread 0's (row, col) of each element."""
    S = acc_rows(acc_S)
    # Limits on this thread's columns, shifted so they compare with thread 0's constant ones.
    col_limit = seqlen_k - n_block * tile_n - tScS[0, 0][1]
    for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
        limit = col_limit
        if cutlass.const_expr(causal):
            row = m_block * tile_m + tScS[r, 0][0]
            limit = cutlass.min(limit, row + causal_offset + 1 - n_block * tile_n - tScS[0, 0][1])
        for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
            # A select, not an `if`: a branch per element would carry the whole tile through it.
            S[r, c] = -Float32.inf if t0ScS[r, c][1] >= limit else S[r, c]


@cute.jit
def online_softmax(acc_S, row_max, row_sum, row_scale, scale_log2, first: cutlass.Constexpr[bool]):
    """S -> P = exp2(S * scale_log2 - max * scale_log2) in place; row_scale = exp2 of the max shift.

    row_sum stays a per-thread partial sum (the quad reduces it once, in the epilogue)."""
    S = acc_rows(acc_S)
    cols = cute.size(S, mode=[1])
    for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
        # Four independent max chains, then the quad.
        m = [S[r, 0], S[r, 1], S[r, 2], S[r, 3]]
        for c in cutlass.range_constexpr(4, cols):
            m[c % 4] = cute.arch.fmax(m[c % 4], S[r, c])
        mx = cute.arch.fmax(cute.arch.fmax(m[0], m[1]), cute.arch.fmax(m[2], m[3]))
        if cutlass.const_expr(not first):
            mx = cute.arch.fmax(mx, row_max[r])
        mx = quad_max(mx)
        prev = row_max[r]
        row_max[r] = mx
        # A row with no visible key yet keeps max -inf; exponentiate against 0 so P = 0, not NaN.
        mx_safe = 0.0 if mx == -Float32.inf else mx
        mx_scaled = mx_safe * scale_log2
        s = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
        for c in cutlass.range_constexpr(cols):
            p = cute.math.exp2(S[r, c] * scale_log2 - mx_scaled, fastmath=True)
            S[r, c] = p
            s[c % 4] = s[c % 4] + p
        total = (s[0] + s[1]) + (s[2] + s[3])
        if cutlass.const_expr(first):
            row_sum[r] = total
        else:
            scale = cute.math.exp2((prev - mx_safe) * scale_log2, fastmath=True)
            row_scale[r] = scale
            row_sum[r] = row_sum[r] * scale + total


@cute.jit
def rescale(acc_O, row_scale):
    """O *= the row's max shift (row_scale), before the next P V adds to it."""
    O = acc_rows(acc_O)
    for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
            O[r, c] = O[r, c] * row_scale[r]
