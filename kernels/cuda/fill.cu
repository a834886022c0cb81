// fill.cu — the first CUDA kernel of the cuda backend: y[i] = v (the `fill` op, used for state
// resets). Everything else of the backend is host code in backend_cuda.c; the other ops follow
// with the CUDA issue, and the backend says so through supports_op.
#include <cuda_runtime.h>
#include <stdint.h>

static __global__ void k3_fill_kernel(float *y, int64_t n, float v) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i < n; i += (int64_t)gridDim.x * blockDim.x) y[i] = v;
}

extern "C" int k3_cuda_fill(float *y, int64_t n, float v) {
    if (n <= 0) return 0;
    int64_t blocks = (n + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    k3_fill_kernel<<<(unsigned)blocks, 256>>>(y, n, v);
    return (int)cudaGetLastError();
}
