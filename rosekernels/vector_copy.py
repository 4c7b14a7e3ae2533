"""128-bit copies between global memory and registers, with optional cache hints (device helpers).

Memory-bound kernels read and write each element once; 16-byte accesses per thread are what keep
HBM saturated, and the hints let the benchmark pick how streamed data is kept in L1/L2.
"""
import cutlass
import cutlass.cute as cute  # after the package __init__, which pins CUTE_DSL_ARCH

# Cache hints for streamed data (read once, written once): (load, store) copy-atom attributes.
_HINTS = {
    "evict_first": ({"l1c_evict_priority": cute.nvgpu.CacheEvictionPriority.EVICT_FIRST},
                    {"l1c_evict_priority": cute.nvgpu.CacheEvictionPriority.EVICT_FIRST}),
    "last_use": ({"load_cache_mode": cute.nvgpu.LoadCacheMode.LAST_USE}, {}),
}


def vec_load(src: cute.Tensor, hint: str = "none") -> cute.Tensor:
    """Registers holding the 1-D gmem slice `src`, read with 128-bit loads."""
    dst = cute.make_rmem_tensor(src.shape, src.element_type)
    op = cute.nvgpu.CopyUniversalOp() if hint == "none" else cute.nvgpu.CopyG2ROp()
    _copy(op, {} if hint == "none" else _HINTS[hint][0], src, dst)
    return dst


def vec_store(src: cute.Tensor, dst: cute.Tensor, hint: str = "none", bits: int = 128) -> None:
    """Write registers `src` to the 1-D gmem slice `dst` with `bits`-bit stores (narrower for e4m3 rows
    quantized from 16-byte input vectors)."""
    op = cute.nvgpu.CopyUniversalOp() if hint == "none" else cute.nvgpu.CopyR2GOp()
    _copy(op, {} if hint == "none" else _HINTS[hint][1], src, dst, bits)


def _copy(op, attrs: dict, src: cute.Tensor, dst: cute.Tensor, bits: int = 128) -> None:
    per_access = bits // src.element_type.width
    atom = cute.make_copy_atom(op, src.element_type, num_bits_per_copy=bits, **attrs)
    cute.copy(atom, cute.zipped_divide(src, (per_access,)), cute.zipped_divide(dst, (per_access,)))


def row_chunks(c, tidx, bidx, rows):
    """A row kernel's thread (rmsnorm, quantize_fp8: `c` a RowGeometry, threads_per_row threads to a row,
    rows_per_block rows to a block): (row, row_ok, lane, chunks, chunk_ok). row is clamped into the `rows` rows,
    so that loads stay in bounds without predicates, and row_ok says whether it is real; chunks are the vector
    columns j * threads_per_row + lane it holds, the ragged last ones clamped too, with chunk_ok (None for the
    columns every lane has). Plain Python, unrolled as the kernel is traced."""
    tpr = c.threads_per_row
    full = c.vecs // tpr  # vector columns every lane has; column `full` is ragged when vecs_per_thread > full
    lane = tidx % tpr
    row = bidx * c.rows_per_block + tidx // tpr
    row_ok = row < rows
    row = cutlass.min(row, rows - 1)
    chunks, chunk_ok = [], []
    for j in range(c.vecs_per_thread):
        if j < full:
            chunks.append(j * tpr + lane)
            chunk_ok.append(None)
        else:
            chunk_ok.append(j * tpr + lane < c.vecs)
            chunks.append(cutlass.min(j * tpr + lane, c.vecs - 1))
    return row, row_ok, lane, chunks, chunk_ok
