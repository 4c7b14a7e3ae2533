"""FlashInfer's batch decode over a paged KV cache: the decode peer of bench/attention.py --kvcache (bf16 caches)
and of bench/fp8.py's KV section (bf16, fp16 and e4m3 caches). FlashInfer builds its kernels on first use; the
offline GPU host gets it from tools/flashinfer_bundle.sh."""
from __future__ import annotations

from typing import Callable

import torch


def pages(table: torch.Tensor, lengths: torch.Tensor, page: int) -> tuple[torch.Tensor, ...]:
    """FlashInfer's paged-KV layout (CSR) of a block table [B, pages] and per-sequence lengths: (indptr [B + 1],
    the pages each sequence uses in order, the rows used of each sequence's last page). Lengths of at least 1."""
    used = (lengths.long() + page - 1) // page
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=table.device)
    indptr[1:] = torch.cumsum(used, 0)
    columns = torch.arange(table.shape[1], device=table.device)
    indices = table[columns[None, :] < used[:, None]].to(torch.int32)
    last = (lengths.long() - (used - 1) * page).to(torch.int32)
    return indptr, indices, last


def contiguous_table(batch: int, context: int, page: int, device="cuda") -> torch.Tensor:
    """The block table [B, context / page] that reads a contiguous cache [B, context, H, d], viewed as
    [B * context / page, page, H, d], as pages: sequence b's pages in order."""
    if context % page:
        raise ValueError(f"context {context} is not a whole number of pages of {page} rows")
    per = context // page
    return torch.arange(batch * per, dtype=torch.int32, device=device).view(batch, per)


def decode() -> Callable:
    """make(table, lengths, page, hq, hkv, d, q_dtype=bf16, kv_dtype=bf16) -> run(q [B, 1, Hq, d], k_pages,
    v_pages, k_scale=None, v_scale=None): FlashInfer's batch decode, planned once per table outside the CUDA
    graphs as an engine plans a step; its tensor-core kernel where the GQA group is 4 or more, as SGLang picks
    it (should_use_tensor_core), else the CUDA-core one. Scales: floats that dequantize an e4m3 cache."""
    import flashinfer

    def make(table, lengths, page, hq, hkv, d, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16):
        indptr, indices, last = pages(table, lengths, page)
        workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=hq // hkv >= 4, paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last, backend="fa2")
        wrapper.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=q_dtype, kv_data_type=kv_dtype)
        return lambda q, kp, vp, k_scale=None, v_scale=None: wrapper.run(
            q.view(q.shape[0], hq, d), (kp, vp), k_scale=k_scale, v_scale=v_scale).view(q.shape)

    return make
