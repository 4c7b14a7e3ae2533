// Control flow and odd corners: a switch (indirect branch), a non-inlined device call (CALL/RET),
// a local-memory array, generic pointers (LD/ST), volatile and fenced accesses, clock reads,
// nanosleep, double precision and integer division.
__device__ __noinline__ float poly(float x, int k) {
  float r = 1.f;
  for (int i = 0; i < k; ++i) r = r * x + 0.5f;
  return r;
}

__device__ float* pick(float* shared_buf, float* global_buf, int which) {
  return which ? shared_buf : global_buf;  // a generic pointer: LD/ST, not LDS/LDG
}

__global__ void control_mix(float* __restrict__ out, const float* __restrict__ in, double* dout,
                            volatile int* flag, long long* clocks, int mode, int n) {
  __shared__ float sbuf[256];
  float local_arr[32];
  int t = threadIdx.x;
  long long c0 = clock64();
  for (int i = 0; i < 32; ++i) local_arr[i] = in[(t + i) % n];
  float v = local_arr[(t * 7 + mode) & 31];
  switch ((mode + t) & 7) {
    case 0: v += 1.f; break;
    case 1: v *= 3.f; break;
    case 2: v = __sinf(v); break;
    case 3: v = poly(v, mode); break;
    case 4: v = sqrtf(v); break;
    case 5: v -= 7.f; break;
    case 6: v = v / (float)(mode + 1); break;
    default: v = -v; break;
  }
  sbuf[t] = v;
  __syncthreads();
  float* p = pick(sbuf, out, mode & 1);
  p[(t + 1) & 255] = v * 2.f;
  float w = p[(t + 3) & 255];
  double d = (double)w * 1.000001 + (double)(t / (mode | 1)) + (double)(t % (n | 1));
  dout[blockIdx.x * blockDim.x + t] = d;
  __threadfence();
  if (t == 0) {
    while (*flag == 0) __nanosleep(100);
    *flag = 0;
  }
  clocks[blockIdx.x] = clock64() - c0;
}
