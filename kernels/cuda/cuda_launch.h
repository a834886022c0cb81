/* cuda_launch.h — the launchers of the cuda kernels, callable from C (backend_cuda.c). Private to
 * kernels/cuda/. Each launcher enqueues its kernel(s) on stream s and returns the cudaError_t of
 * the launch (cudaGetLastError) as an int, 0 = success; none of them synchronises. Pointers are
 * device memory unless named *_host. Argument checks (shapes, dtypes, limits) are the caller's:
 * backend_cuda.c makes the same checks as kernels/ref before it launches anything.
 * Weight dtypes are K3C_DT_* (cuda_math.cuh), equal to the k3_dtype values. */
#ifndef K3_CUDA_LAUNCH_H
#define K3_CUDA_LAUNCH_H

#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* pointwise ops of k3c_pointwise */
enum { K3C_PW_SILU, K3C_PW_SIGMOID, K3C_PW_SITU, K3C_PW_SWIGLU, K3C_PW_ADD, K3C_PW_MUL };

/* elementwise.cu */
int k3c_fill(cudaStream_t s, float *y, int64_t n, float v);
/* y = op(a, b) elementwise over n; p0, p1: SiTU's beta and lin_beta. */
int k3c_pointwise(cudaStream_t s, int op, const float *a, const float *b, int64_t n, float p0,
                  float p1, float *y);
/* dst [n] = src [n] of dtype dt (F32/BF16/F16) decoded. */
int k3c_decode_f32(cudaStream_t s, int dt, const void *src, int64_t n, float *dst);
/* out[t] = row ids[t] of W [V, D]; *err (preset to ~0 by the caller) = min bad position t. */
int k3c_embed_rows(cudaStream_t s, int dt, const void *W, int64_t V, int64_t D, const int32_t *ids,
                   int64_t T, float *out, unsigned long long *err);

/* norms.cu */
/* rmsnorm (l2 = 0) or l2norm (l2 = 1) of T rows of n; w NULL = ones (rmsnorm only). */
int k3c_rownorm(cudaStream_t s, int l2, const float *x, const float *w, int64_t T, int64_t n,
                float eps, float *y);
int k3c_softmax(cudaStream_t s, const float *x, int64_t T, int64_t n, float *y);
int k3c_attnres_mix(cudaStream_t s, const float *bank, int n_bank, const float *p, const float *w,
                    int64_t T, int64_t D, float eps, float *out);

/* matmul.cu: W [out, in] of dtype dt (data; scale E8M0 [out, in/32] for MXFP4). */
int k3c_matmul(cudaStream_t s, int dt, const void *data, const uint8_t *scale, int64_t out,
               int64_t in, const float *x, int64_t T, float *y);
int k3c_matmul_tn(cudaStream_t s, int dt, const void *data, const uint8_t *scale, int64_t out,
                  int64_t in, const float *x, int64_t T, float *y);

/* kda.cu */
int k3c_kda_gate(cudaStream_t s, float *r, const float *dt_bias, const float *a_log, int64_t T,
                 int H, int dk, bool has_lb, float lb);
int k3c_short_conv(cudaStream_t s, const float *in, int64_t n, int64_t P, int K, const float *w,
                   float *state, float *out);
/* C = 0: the recurrence; else the chunked form with chunk C and work (per head
 * k3_kda_chunk_work_floats(C, dk, dv) floats, wf of them). */
int k3c_kda(cudaStream_t s, const float *q, const float *k, const float *v, const float *g,
            const float *beta, int64_t n, int H, int dk, int dv, float scale, float *S, float *o,
            int C, float *work, size_t wf);

/* attn.cu */
int k3c_attn_latent(cudaStream_t s, const float *qc, const float *cache, int64_t n_ctx, int H,
                    int W, int Rkv, float scale, float *o_lat, float *work);

/* moe.cu */
/* *err (preset to ~0) = min over bad tokens of t·(E+2) + (e, or E+1 = ran out of experts). */
int k3c_moe_topk(cudaStream_t s, const float *scores, const float *bias, int64_t T, int E, int K,
                 int G, int topk_group, bool renorm, float scale, float *work, int32_t *ids,
                 float *w, unsigned long long *err);
/* gather (scatter = 0): dst[j] = src[idx[j]]; scatter: dst[idx[j]] = src[j]; idx device int64. */
int k3c_rows_copy(cudaStream_t s, const float *src, int64_t width, const int64_t *idx, int64_t n,
                  float *dst, int scatter);
/* rows_wsum with seg device int64 [n_seg + 1] or NULL (uniform seg_len). */
int k3c_rows_wsum(cudaStream_t s, const float *x, const float *w, const int64_t *seg,
                  int64_t seg_len, int64_t n_seg, int64_t width, float *y);

#ifdef __cplusplus
}
#endif

#endif /* K3_CUDA_LAUNCH_H */
