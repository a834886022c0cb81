// elementwise.cu — the pointwise ops of the cuda backend (fill, silu, sigmoid, situ, swiglu, add,
// mul), the weight-vector decode (to_f32) and the embedding rows (embed_rows). Grid-stride loops
// over elements; the math is cuda_math.cuh's (shared with the host test). y may alias an input
// (each thread reads its element before writing it).
//
// Verified on host math only; device run pending.
#include "cuda_launch.h"
#include "cuda_math.cuh"

static __global__ void fill_kernel(float *y, int64_t n, float v) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = v;
}

static __global__ void pointwise_kernel(int op, const float *a, const float *b, int64_t n, float p0,
                                        float p1, float *y) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float x = a[i], r;
        switch (op) {
        case K3C_PW_SILU:
            r = k3c_silu(x);
            break;
        case K3C_PW_SIGMOID:
            r = k3c_sigm(x);
            break;
        case K3C_PW_SITU:
            r = k3c_situ(x, b[i], p0, p1);
            break;
        case K3C_PW_SWIGLU:
            r = k3c_swiglu(x, b[i]);
            break;
        case K3C_PW_ADD:
            r = x + b[i];
            break;
        default:
            r = x * b[i];
            break;
        }
        y[i] = r;
    }
}

static __device__ __forceinline__ float decode_elem(int dt, const void *src, int64_t i) {
    if (dt == K3C_DT_F32) return ((const float *)src)[i];
    uint16_t h = ((const uint16_t *)src)[i];
    return dt == K3C_DT_BF16 ? k3c_bf16(h) : k3c_f16(h);
}

static __global__ void decode_kernel(int dt, const void *src, int64_t n, float *dst) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = decode_elem(dt, src, i);
}

/* one block per token */
static __global__ void embed_kernel(int dt, const void *W, int64_t V, int64_t D, const int32_t *ids,
                                    float *out, unsigned long long *err) {
    const int64_t t = blockIdx.x;
    const int32_t id = ids[t];
    if (id < 0 || id >= V) {
        if (threadIdx.x == 0) atomicMin(err, (unsigned long long)t); /* min: order-free */
        return;
    }
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
        out[t * D + d] = decode_elem(dt, W, (int64_t)id * D + d);
}

extern "C" int k3c_fill(cudaStream_t s, float *y, int64_t n, float v) {
    if (n <= 0) return 0;
    K3C_LAUNCH(k3c_blocks(n, 256), 256, 0, s, fill_kernel)(y, n, v);
    return (int)cudaGetLastError();
}

extern "C" int k3c_pointwise(cudaStream_t s, int op, const float *a, const float *b, int64_t n,
                             float p0, float p1, float *y) {
    if (n <= 0) return 0;
    K3C_LAUNCH(k3c_blocks(n, 256), 256, 0, s, pointwise_kernel)(op, a, b, n, p0, p1, y);
    return (int)cudaGetLastError();
}

extern "C" int k3c_decode_f32(cudaStream_t s, int dt, const void *src, int64_t n, float *dst) {
    if (n <= 0) return 0;
    K3C_LAUNCH(k3c_blocks(n, 256), 256, 0, s, decode_kernel)(dt, src, n, dst);
    return (int)cudaGetLastError();
}

extern "C" int k3c_embed_rows(cudaStream_t s, int dt, const void *W, int64_t V, int64_t D,
                              const int32_t *ids, int64_t T, float *out, unsigned long long *err) {
    if (T <= 0) return 0;
    K3C_LAUNCH((unsigned)T, 256, 0, s, embed_kernel)(dt, W, V, D, ids, out, err);
    return (int)cudaGetLastError();
}
