"""A tiny CuTeDSL kernel (y = 2x + 1 over a dynamic length) for testing the compile framework."""
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

_THREADS = 128


@cute.kernel
def _axpb_kernel(x: cute.Tensor, y: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * _THREADS + tidx
    if i < x.shape[0]:
        y[i] = x[i] * 2.0 + 1.0


@cute.jit
def _axpb(x: cute.Tensor, y: cute.Tensor, stream):
    n = x.shape[0]
    _axpb_kernel(x, y).launch(grid=[(n + _THREADS - 1) // _THREADS, 1, 1], block=[_THREADS, 1, 1], stream=stream)


def build():
    n = cute.sym_int()
    x = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    y = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    return _axpb, (x, y, make_fake_stream(use_tvm_ffi_env_stream=True))
