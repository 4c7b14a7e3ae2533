"""The prefill attention kernel's tile order (rosekernels.kernels.attention): which query tile (m block,
head, batch) each step of the persistent CTAs takes. Non-causal, the m blocks of one (batch, head) are
adjacent; causal, the (batch, head) pairs are cut into sections whose K/V fit in L2, GQA groups whole,
and within a section the longest tiles (the last m blocks) go first.
"""
from __future__ import annotations

import dataclasses

import cutlass
from cutlass import Int32

from rosekernels.kernels.attention_plan import AttentionConfig

# K/V bytes one causal tile section keeps in L2 (of 50-60 MB on H100/H200: Q, O and the other
# partition's copy need the rest).
L2_KV_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The tiles of one launch in the order CTAs take them, and each one's (m_block, head, batch).

    Frozen: the DSL then treats it as read-only state in the device loops."""

    causal: bool
    num_m: Int32  # m blocks per (batch, head)
    heads: Int32
    total: Int32
    section: Int32  # (batch, head) pairs per L2 section (causal only)
    pairs: Int32  # batch * heads

    @staticmethod
    def make(cfg: AttentionConfig, seqlen_q, seqlen_k, heads, heads_kv, batch) -> "Tiles":
        num_m = (seqlen_q + cfg.tile_m - 1) // cfg.tile_m
        pairs = heads * batch
        section = pairs
        if cfg.causal:
            # K and V of one KV head take 4 * d * seqlen_k bytes; whole GQA groups per section.
            kv_heads = cutlass.max((L2_KV_BYTES // (4 * cfg.head_dim)) // seqlen_k, 1)
            section = cutlass.min(kv_heads * (heads // heads_kv), pairs)
        return Tiles(cfg.causal, num_m, heads, num_m * pairs, section, pairs)

    def coords(self, t):
        if cutlass.const_expr(self.causal):
            per_section = self.section * self.num_m
            first = (t // per_section) * self.section
            width = cutlass.min(self.section, self.pairs - first)  # the last section may be narrower
            r = t - first * self.num_m
            m_idx = r // width
            pair = first + r - m_idx * width
            m_block = self.num_m - 1 - m_idx  # longest first
        else:
            pair = t // self.num_m
            m_block = t - pair * self.num_m
        batch = pair // self.heads
        return m_block, pair - batch * self.heads, batch
