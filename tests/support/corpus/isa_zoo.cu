// Many instruction families in one kernel, so the operand-semantics table meets them in tests:
// 64-bit integer and double math, half2/bf16 math, conversions, bit ops, 64-bit and vector
// loads/stores, atomics (CAS, EXCH, 64-bit), warp match/redux/vote, tf32/bf16/int8/f64 mma.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__global__ void isa_zoo(unsigned long long* __restrict__ u64, double* __restrict__ f64,
                        __half2* __restrict__ h2, __nv_bfloat162* __restrict__ b2,
                        int4* __restrict__ v4, int* __restrict__ ints, float* __restrict__ fl, int n) {
  __shared__ int4 s4[128];
  __shared__ double sd[128];
  int t = threadIdx.x;
  int i = blockIdx.x * blockDim.x + t;
  unsigned long long a = u64[i], b = u64[i + n];
  unsigned long long m = a * b + (a >> 7) - (b << 3);
  m ^= __brevll(a) + __popcll(b) + __clzll(a | 1);
  double x = f64[i];
  double y = fma(x, x, 1.5) / (x + 3.0) + sqrt(fabs(x)) + (double)(long long)m;
  __half2 h = h2[i];
  h = __hfma2(h, h, __float2half2_rn(0.5f));
  __nv_bfloat162 bb = b2[i];
  bb = __hmul2(bb, __float2bfloat162_rn(1.25f));
  int4 v = v4[i];
  s4[t] = v;
  sd[t] = y;
  __syncthreads();
  int4 w = s4[(t + 5) & 127];
  double z = sd[(t + 9) & 127];
  int k = __byte_perm(w.x, w.y, 0x5410) + __funnelshift_l(w.z, w.w, t & 31) + __sad(w.x, w.y, 3u);
  k += __dp4a(w.x, w.y, w.z);
  unsigned match = __match_any_sync(0xffffffffu, k & 7);
  int red = __reduce_add_sync(0xffffffffu, k);
  unsigned any = __any_sync(0xffffffffu, k > 0);
  int old = atomicCAS(&ints[t & 15], k, red);
  int ex = atomicExch(&ints[16 + (t & 15)], old);
  unsigned long long o64 = atomicAdd(&u64[2 * n + (t & 7)], m);
  atomicMax(&ints[32], ex);
  float f = __int_as_float(k) * (float)z;
  f = __expf(f) + __logf(fabsf(f) + 1.f) + rsqrtf(fabsf(f) + 2.f) + __fdividef(f, 3.f);
  float2 fh = __half22float2(h);
  float2 fb = __bfloat1622float2(bb);
  unsigned fp8pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(*(unsigned short*)&fp8pair) : "f"(fh.x), "f"(fb.y));
  // tf32 m16n8k8, bf16 m16n8k16, int8 m16n8k32, f64 m8n8k4 warp mma
  float c0 = f, c1 = fh.y, c2 = fb.x, c3 = (float)k;
  unsigned ra = __float_as_uint(f), rb = __float_as_uint(fh.x);
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3) : "r"(ra), "r"(rb), "r"(ra), "r"(rb), "r"(rb), "r"(ra));
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3) : "r"(ra), "r"(rb), "r"(rb), "r"(ra), "r"(ra), "r"(rb));
  int d0 = k, d1 = red, d2 = (int)match, d3 = (int)any;
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+r"(d0), "+r"(d1), "+r"(d2), "+r"(d3) : "r"(ra), "r"(rb), "r"(k), "r"(red), "r"(ra), "r"(k));
  double e0 = y, e1 = z;
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
               : "+d"(e0), "+d"(e1) : "d"(x), "d"(z));
  u64[i] = m + o64;
  f64[i] = e0 + e1 + x;
  h2[i] = h;
  b2[i] = bb;
  v4[i] = make_int4(d0, d1, d2, d3 + (int)fp8pair);
  fl[i] = c0 + c1 + c2 + c3;
}
