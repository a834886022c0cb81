/* k3_cuda_moe.h — the cuda backend's MoE expert entry points beyond the op table (issue 44): the
 * masked layout of the grouped W4A16 tensor-core GEMM (kernels/cuda/moe_mma.cu), for device-side
 * routing (issue 45) and graph-captured decode. Built only with K3_CUDA (the real or the emulated
 * runtime); implemented in backend_cuda.c on the same repacked weights as the moe_experts op.
 *
 * The masked layout: a fixed capacity of `cap` rows per expert, expert e's rows at [e·cap,
 * e·cap + count[e]) of an [E·cap, width] buffer, the counts in DEVICE memory. Nothing is read back
 * to the host (no synchronisation, fixed grids: graph-capturable) once the expert table has been
 * prepared (k3_cuda_moe_prepare, or the first call, which prepares it).
 *
 * Weights: the expert table exactly as the moe_experts op takes it (k3_kernels.h: expert e's
 * matrices at *(const k3_tensor *)((const char *)w1 + e·e_stride), w3 and w2 alike; data NULL:
 * not on this rank). Every present expert must be MXFP4 with w1, w3 [I, Lw] and w2 [Lw, I], Lw and
 * I multiples of 32 (K3's experts are); anything else is K3_ERR_ARG / K3_ERR_SHAPE naming the
 * expert. At preparation each present expert's bytes and scales are repacked once into mma
 * fragment order (k3c_repack.h) in buffers the backend owns (one host round trip per table; the
 * original tensors are left as they are); an expert that is not on this rank has no slot, and its
 * rows are neither read nor written whatever its count. */
#ifndef K3_CUDA_MOE_H
#define K3_CUDA_MOE_H

#include "k3_kernels.h"

/* The bf16 activation terms of the W4A16 expert GEMMs by default (k3c_split_bf16: 3 keep fp32
 * activations, the products exact); K3_CUDA_MMA_TERMS=1, 2 or 3 in the environment picks another
 * (docs/DESIGN.md §3b: the fidelity of each). */
#define K3_CUDA_MOE_TERMS 3

/* Repack the expert table's weights now (a host sync: download, repack, upload), so that the
 * calls after it, including the first, enqueue kernels only. Idempotent: a prepared table is
 * found by its addresses (w1, w3, w2, e_stride, E) and costs nothing. */
k3_status k3_cuda_moe_prepare(k3_backend *be, const k3_tensor *w1, const k3_tensor *w3,
                              const k3_tensor *w2, size_t e_stride, int E);

/* The experts over the masked layout, enqueued on the backend's stream (returns without waiting):
 *   x     device float [E·cap, Lw]: the rows routed to expert e at rows [e·cap, e·cap + n_e),
 *         n_e = min(max(count[e], 0), cap); other rows are not read;
 *   count device int32 [E], read on the device only;
 *   h     device float [E·cap, I]: scratch, h row r = act(W1_e·x_r, W3_e·x_r) (beta < 0 SwiGLU,
 *         else SiTU(beta, lin_beta), as moe_experts);
 *   y     device float [E·cap, Lw]: y row r = W2_e·h_r for the rows [e·cap, e·cap + n_e) of every
 *         expert e on this rank; every other row of y is left as it was.
 * Arithmetic: x and h split into K3_CUDA_MOE_TERMS bf16 terms (K3_CUDA_MMA_TERMS) at the GEMMs'
 * inputs, exact MXFP4 weights, fp32 accumulation (tests/tolerances.h K3_TOL_SPLIT_GEMM_REL gives
 * the bound). cap <= 8 runs
 * swap-AB (the weights as the M = 16 operand). The caller combines (k3_cuda_moe_combine). */
k3_status k3_cuda_moe_experts_masked(k3_backend *be, const float *x, const int32_t *count,
                                     int64_t cap, int E, const k3_tensor *w1, const k3_tensor *w3,
                                     const k3_tensor *w2, size_t e_stride, float beta,
                                     float lin_beta, float *h, float *y);

/* The weighted top-k combine in slot order, on the device: out row t [width] = Σ_k w[t·K + k] ·
 * y row pos[t·K + k], k = 0 .. K-1 in order, the first term initialising (rows_wsum's arithmetic:
 * deterministic, the same bits whatever the routing's timing). pos, w: device [T·K] (pos: rows of
 * y, e.g. e·cap + the slot's place in expert e; a negative pos contributes nothing). */
k3_status k3_cuda_moe_combine(k3_backend *be, const float *y, const int32_t *pos, const float *w,
                              int64_t T, int K, int64_t width, float *out);

#endif /* K3_CUDA_MOE_H */
