// Hopper async path via inline PTX: mbarrier + TMA load (UTMALDG), bulk copy (UBLKCP), one
// warpgroup wgmma (HGMMA) from shared-memory descriptors, TMA store (UTMASTG). Built for sm_90a.
#include <cuda.h>
#include <cuda_fp16.h>

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ unsigned long long smem_desc(const void* p) {
  unsigned long long addr = (smem_u32(p) & 0x3FFFF) >> 4;
  return addr | (1ull << 16) | (8ull << 32);  // leading / stride byte offsets in 16-byte units
}

__global__ void __launch_bounds__(128) wgmma_tma(const __grid_constant__ CUtensorMap tmap_a,
                                                 const __grid_constant__ CUtensorMap tmap_c,
                                                 const half* __restrict__ b, int ktiles) {
  __shared__ __align__(128) half sa[64 * 16];
  __shared__ __align__(128) half sb[8 * 16];
  __shared__ __align__(128) float sc[64 * 8];
  __shared__ __align__(8) unsigned long long bar[2];
  unsigned bar0 = smem_u32(&bar[0]), bar1 = smem_u32(&bar[1]);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar1));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
  for (int kt = 0; kt < ktiles; ++kt) {
    unsigned phase = kt & 1;
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar0), "r"(64 * 16 * 2));
      asm volatile(
          "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
          ::"r"(smem_u32(sa)), "l"(&tmap_a), "r"(kt * 16), "r"((int)blockIdx.x * 64), "r"(bar0) : "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar1), "r"(8 * 16 * 2));
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(smem_u32(sb)), "l"(b + kt * 128), "r"(8 * 16 * 2), "r"(bar1) : "memory");
    }
    unsigned done = 0;
    while (!done) {
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(bar0), "r"(phase) : "memory");
    }
    done = 0;
    while (!done) {
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(bar1), "r"(phase) : "memory");
    }
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 0;"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "l"(smem_desc(sa)), "l"(smem_desc(sb)));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    __syncthreads();
  }
  int t = threadIdx.x;
  sc[t * 4 + 0] = d0; sc[t * 4 + 1] = d1; sc[t * 4 + 2] = d2; sc[t * 4 + 3] = d3;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 ::"l"(&tmap_c), "r"(0), "r"((int)blockIdx.x * 64), "r"(smem_u32(sc)) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
}
