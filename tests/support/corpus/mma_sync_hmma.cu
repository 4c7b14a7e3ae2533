// One m16n8k16 f16 mma.sync per k-step (HMMA.16816) fed by ldmatrix (LDSM) from shared memory.
#include <cuda_fp16.h>

__global__ void mma_sync_hmma(float* __restrict__ d, const half* __restrict__ a,
                              const half* __restrict__ b, int ksteps) {
  __shared__ __align__(16) half sa[16 * 16];
  __shared__ __align__(16) half sb[16 * 8];
  int lane = threadIdx.x;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int ks = 0; ks < ksteps; ++ks) {
    for (int j = lane; j < 256; j += 32) sa[j] = a[ks * 256 + j];
    for (int j = lane; j < 128; j += 32) sb[j] = b[ks * 128 + j];
    __syncwarp();
    unsigned ra[4], rb[2];
    unsigned sa_addr = (unsigned)__cvta_generic_to_shared(&sa[(lane % 16) * 16 + (lane / 16) * 8]);
    unsigned sb_addr = (unsigned)__cvta_generic_to_shared(&sb[(lane % 16) * 8]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(ra[0]), "=r"(ra[1]), "=r"(ra[2]), "=r"(ra[3]) : "r"(sa_addr));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(rb[0]), "=r"(rb[1]) : "r"(sb_addr));
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(ra[0]), "r"(ra[1]), "r"(ra[2]), "r"(ra[3]), "r"(rb[0]), "r"(rb[1]));
    __syncwarp();
  }
  for (int r = 0; r < 4; ++r) d[lane * 4 + r] = acc[r];
}
