// A long straight-line kernel (fully unrolled 1-D stencil over many strided rows) that gives
// the benchmark about ten thousand instructions in a handful of basic blocks.
#ifndef ROWS
#define ROWS 320
#endif

__global__ void unrolled_stencil(float* __restrict__ out, const float* __restrict__ in, int stride) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  const float* p = in + i;
  float acc = 0.f;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float a = __ldg(p + r * stride);
    float b = __ldg(p + r * stride + 1);
    float c = __ldg(p + r * stride + 2);
    acc = fmaf(acc, 0.999f, a * 0.25f + b * 0.5f + c * 0.25f);
    if ((r & 31) == 31) out[i + (r / 32) * stride] = acc;
  }
  out[i + ROWS * stride] = acc;
}
