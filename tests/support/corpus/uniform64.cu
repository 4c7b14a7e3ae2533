// 64-bit uniform-datapath arithmetic that SIP models rather than pins: UIADD3.64 (ptxas makes it for
// wgmma shared-memory descriptors advanced along K) and USHF.*.U64 / .S64 (64-bit shifts of values
// that are the same for the whole warp). Built for sm_90a.
#include <cstdint>
#include <cuda_fp16.h>

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

__global__ void __launch_bounds__(128) wgmma_descriptors(float* __restrict__ out, const half* __restrict__ in,
                                                         int ktiles) {
  __shared__ __align__(128) half sa[64 * 64];
  __shared__ __align__(128) half sb[8 * 64];
  for (int i = threadIdx.x; i < 64 * 64; i += 128) sa[i] = in[i];
  for (int i = threadIdx.x; i < 8 * 64; i += 128) sb[i] = in[i + 64 * 64];
  __syncthreads();
  unsigned long long da = ((smem_u32(sa) & 0x3FFFF) >> 4) | (1ull << 16) | (8ull << 32) | (1ull << 62);
  unsigned long long db = ((smem_u32(sb) & 0x3FFFF) >> 4) | (1ull << 16) | (8ull << 32) | (1ull << 62);
  float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
  for (int kt = 0; kt < ktiles; ++kt) {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 0;"
          : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "l"(da + 2 * k + 0x400 * (kt & 1)), "l"(db + 2 * k));
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
  out[threadIdx.x * 4 + 0] = d0;
  out[threadIdx.x * 4 + 1] = d1;
  out[threadIdx.x * 4 + 2] = d2;
  out[threadIdx.x * 4 + 3] = d3;
}

__global__ void uniform_u64(uint64_t* out, uint64_t a, uint64_t b, int64_t c, int n) {
  uint64_t x = a + blockIdx.x, y = b ^ (uint64_t)blockIdx.y;
  int64_t s = c - (int64_t)blockIdx.z;
  uint64_t acc = 0;
#pragma unroll 1
  for (int i = 0; i < n; ++i) {
    x = x + y + 3;
    y = (y << 7) | (x >> 3);
    s = s > (int64_t)x ? s - 1 : (int64_t)y;
    acc += (x < y ? x : y) + (s >> 2) + (x & y) + (x * 5) + (x != y);
    x = max(x, y);
    y = min(y, (uint64_t)s);
  }
  out[threadIdx.x] = acc + x + y + s;
}
