// Double-buffered cp.async pipeline: LDGSTS, LDGDEPBAR, DEPBAR, then LDS/STG.
#include <cuda_pipeline.h>

__global__ void cp_async_pipeline(float4* __restrict__ out, const float4* __restrict__ in, int tiles) {
  __shared__ float4 buf[2][256];
  int t = threadIdx.x;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  __pipeline_memcpy_async(&buf[0][t], &in[blockIdx.x * 256 * tiles + t], sizeof(float4));
  __pipeline_commit();
  for (int i = 0; i < tiles; ++i) {
    if (i + 1 < tiles) {
      __pipeline_memcpy_async(&buf[(i + 1) & 1][t], &in[(blockIdx.x * tiles + i + 1) * 256 + t], sizeof(float4));
    }
    __pipeline_commit();
    __pipeline_wait_prior(1);
    __syncthreads();
    float4 v = buf[i & 1][(t + 1) & 255];
    acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    __syncthreads();
  }
  out[blockIdx.x * 256 + t] = acc;
}
