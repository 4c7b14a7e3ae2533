// 64-bit division by a runtime value: ptxas calls an internal subroutine
// ($__internal_..._div_s64) that lives in the kernel's .text section after its EXIT.
extern "C" __global__ void div64(const long long* a, const long long* b, long long* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] / b[i];
}
