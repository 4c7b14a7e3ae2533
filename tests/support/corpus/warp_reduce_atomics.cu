// Warp shuffles, votes and global atomics (ATOMG with a used result, RED without).
__global__ void warp_reduce_atomics(float* __restrict__ total, int* __restrict__ counters,
                                    const float* __restrict__ x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = i < n ? x[i] : 0.f;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  unsigned positive = __ballot_sync(0xffffffffu, v > 0.f);
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(total, v);                                    // RED: result unused
    int slot = atomicAdd(&counters[0], __popc(positive));   // ATOMG: result used
    counters[1 + (slot & 63)] = blockIdx.x;
  }
}
