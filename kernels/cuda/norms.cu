// norms.cu — the per-row reductions of the cuda backend: rmsnorm (and rmsnorm_rows, its strided
// form: the same kernel, so the same bits), l2norm, softmax and the AttnRes mix. One block of
// K3C_ROW_THREADS per row (token); each thread takes a strided slice of the row, and the partials
// meet in the fixed tree of k3c_block_reduce (cuda_math.cuh), so a row's result depends only on its
// length, never on T or timing. out may alias the input (every thread writes only elements it read
// itself, after the block's last reduction).
//
// Verified on host math only; device run pending.
#include "cuda_launch.h"
#include "cuda_math.cuh"

#define K3C_MAX_SOURCES 64 /* = ref's K3_MAX_SOURCES (AttnRes sources, checked by the caller) */

/* row t at x + t·xs -> y + t·ys (rmsnorm / l2norm: xs = ys = n; rmsnorm_rows: the strides) */
static __global__ void rownorm_kernel(int l2, const float *x, int64_t xs, const float *w, int64_t n,
                                      float eps, float *y, int64_t ys) {
    K3C_SHARED(float, sh, [32]);
    const int64_t t = blockIdx.x;
    const float *xt = x + t * xs;
    float ss = k3c_block_reduce(k3c_sumsq_part(xt, n, threadIdx.x, blockDim.x), sh, false);
    float r = l2 ? k3c_l2_scale(ss, eps) : k3c_rms_scale(ss, n, eps);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        y[t * ys + i] = (w ? w[i] : 1.0f) * (xt[i] * r);
}

static __global__ void softmax_kernel(const float *x, int64_t n, float *y) {
    K3C_SHARED(float, sh, [32]);
    const int64_t t = blockIdx.x;
    const float *xt = x + t * n;
    float *yt = y + t * n;
    float m = k3c_block_reduce(k3c_max_part(xt, n, threadIdx.x, blockDim.x), sh, true);
    float z = k3c_block_reduce(k3c_expsum_part(xt, m, n, threadIdx.x, blockDim.x, yt), sh, false);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yt[i] /= z;
}

static __global__ void attnres_kernel(const float *bank, int n_bank, const float *p, const float *w,
                                      int64_t T, int64_t D, float eps, float *out) {
    K3C_SHARED(float, sh, [32]);
    K3C_SHARED(float, s, [K3C_MAX_SOURCES]);
    const int64_t t = blockIdx.x;
    for (int i = 0; i <= n_bank; i++) {
        const float *v = i < n_bank ? bank + ((int64_t)i * T + t) * D : p + t * D;
        float ss = k3c_block_reduce(k3c_sumsq_part(v, D, threadIdx.x, blockDim.x), sh, false);
        float r = k3c_rms_scale(ss, D, eps);
        float dot =
            k3c_block_reduce(k3c_normdot_part(v, r, w, D, threadIdx.x, blockDim.x), sh, false);
        if (threadIdx.x == 0) s[i] = dot;
    }
    __syncthreads();
    if (threadIdx.x == 0) { /* softmax over <= 64 sources, the ref's order */
        float m = -INFINITY, z = 0.0f;
        for (int i = 0; i <= n_bank; i++) m = s[i] > m ? s[i] : m;
        for (int i = 0; i <= n_bank; i++) {
            s[i] = expf(s[i] - m);
            z += s[i];
        }
        for (int i = 0; i <= n_bank; i++) s[i] /= z;
    }
    __syncthreads();
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < n_bank; i++) acc = fmaf(s[i], bank[((int64_t)i * T + t) * D + d], acc);
        acc = fmaf(s[n_bank], p[t * D + d], acc);
        out[t * D + d] = acc;
    }
}

extern "C" int k3c_rownorm(cudaStream_t s, int l2, const float *x, int64_t xs, const float *w,
                           int64_t T, int64_t n, float eps, float *y, int64_t ys) {
    if (T <= 0 || n <= 0) return 0;
    K3C_LAUNCH((unsigned)T, K3C_ROW_THREADS, 0, s, rownorm_kernel)(l2, x, xs, w, n, eps, y, ys);
    return (int)cudaGetLastError();
}

extern "C" int k3c_softmax(cudaStream_t s, const float *x, int64_t T, int64_t n, float *y) {
    if (T <= 0 || n <= 0) return 0;
    K3C_LAUNCH((unsigned)T, K3C_ROW_THREADS, 0, s, softmax_kernel)(x, n, y);
    return (int)cudaGetLastError();
}

extern "C" int k3c_attnres_mix(cudaStream_t s, const float *bank, int n_bank, const float *p,
                               const float *w, int64_t T, int64_t D, float eps, float *out) {
    if (T <= 0 || D <= 0) return 0;
    K3C_LAUNCH((unsigned)T, K3C_ROW_THREADS, 0, s, attnres_kernel)
    (bank, n_bank, p, w, T, D, eps, out);
    return (int)cudaGetLastError();
}
