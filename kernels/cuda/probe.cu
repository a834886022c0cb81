// probe.cu — the CUDA backend's first file: device discovery, so the CUDA configuration is
// compiled in CI and cannot rot. Real kernels come with the CUDA issue.
#include <cuda_runtime.h>

extern "C" int k3_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return 0; /* no driver / no GPU */
    return n;
}
