// Shared-memory tiled SGEMM: LDG -> STS, BAR.SYNC, LDS + FFMA inner loop, STG epilogue.
#define TILE 16

__global__ void smem_tiled_gemm(float* __restrict__ c, const float* __restrict__ a,
                                const float* __restrict__ b, int n) {
  __shared__ float sa[TILE][TILE + 1];
  __shared__ float sb[TILE][TILE + 1];
  int row = blockIdx.y * TILE + threadIdx.y;
  int col = blockIdx.x * TILE + threadIdx.x;
  float acc = 0.f;
  for (int t = 0; t < n; t += TILE) {
    sa[threadIdx.y][threadIdx.x] = a[row * n + t + threadIdx.x];
    sb[threadIdx.y][threadIdx.x] = b[(t + threadIdx.y) * n + col];
    __syncthreads();
#pragma unroll
    for (int k = 0; k < TILE; ++k) acc += sa[threadIdx.y][k] * sb[k][threadIdx.x];
    __syncthreads();
  }
  c[row * n + col] = acc;
}
