/* ref_seqs.c — the varlen ops of the reference backend (k3_kernels.h "varlen ops"): one call for a
 * whole step's batch, described by a k3_seqs. Each is defined by the per-sequence / per-head op it
 * replaces, so the reference semantics are those ops' own. The ones written in terms of the
 * backend's own ops (be->ops) serve the cpu backend too (kernels/cpu/cpu.c maps them): there
 * they run the cpu ops, bit for bit what the per-call forms gave. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <math.h>
#include <string.h>

static k3_status check_seqs(const char *op, const k3_seqs *sq) {
    if (!sq || sq->n_seqs < 0 || (sq->n_seqs > 0 && (!sq->tok0 || !sq->pos || !sq->slot)))
        return K3_ERR(K3_ERR_ARG, "%s: no batch descriptor", op);
    return K3_OK;
}

k3_status k3_kernels_check_rows(int64_t xs, int64_t ys, int64_t n) {
    if (xs < n || ys < n)
        return K3_ERR(K3_ERR_ARG, "rmsnorm_rows: strides %lld, %lld < row %lld", (long long)xs,
                      (long long)ys, (long long)n);
    return K3_OK;
}

k3_status k3_kernels_check_heads(const k3_tensor *W, int H, int64_t T, int64_t r0, int64_t rh,
                                 int64_t nr) {
    if (W->ndim != 2 || H < 0 || T < 0 || nr < 1 || r0 < 0 || rh < 0 ||
        (H > 0 && r0 + (int64_t)(H - 1) * rh + nr > W->shape[0]))
        return K3_ERR(K3_ERR_SHAPE,
                      "matmul_heads: %d heads of %lld rows from %lld (step %lld) of a "
                      "[%lld, %lld] weight",
                      H, (long long)nr, (long long)r0, (long long)rh, (long long)W->shape[0],
                      (long long)(W->ndim > 1 ? W->shape[1] : 0));
    return K3_OK;
}

k3_status k3_ref_rmsnorm_rows(k3_backend *be, const float *x, int64_t xs, const float *w, int64_t T,
                              int64_t n, float eps, float *y, int64_t ys) {
    K3_TRY(k3_kernels_check_rows(xs, ys, n));
    for (int64_t t = 0; t < T; t++)
        K3_TRY(k3_ref_ops.rmsnorm(be, x + t * xs, w, 1, n, eps, y + t * ys));
    return K3_OK;
}

/* Each head: its rows copied to work (contiguous), the matmul of the backend, copied out. */
k3_status k3_ref_matmul_heads(k3_backend *be, const float *x, int64_t xt, int64_t xh, int64_t T,
                              int H, const k3_tensor *W, int64_t r0, int64_t rh, int64_t nr,
                              bool trans, float *y, int64_t yt, int64_t yh, float *work) {
    K3_TRY(k3_kernels_check_heads(W, H, T, r0, rh, nr));
    if (T == 0) return K3_OK;
    const int64_t in = trans ? nr : W->shape[1], out = trans ? W->shape[1] : nr;
    float *wi = work, *wo = work + T * in;
    const k3_ops *ops = be->ops;
    for (int h = 0; h < H; h++) {
        k3_tensor wh;
        K3_TRY(k3_tensor_rows(W, r0 + (int64_t)h * rh, nr, &wh));
        K3_TRY(ops->copy2d(be, wi, in, x + (int64_t)h * xh, xt, T, in));
        K3_TRY(trans ? ops->matmul_tn(be, wi, T, &wh, wo) : ops->matmul(be, wi, T, &wh, wo));
        K3_TRY(ops->copy2d(be, y + (int64_t)h * yh, yt, wo, out, T, out));
    }
    return K3_OK;
}

k3_status k3_ref_kv_write(k3_backend *be, const k3_seqs *sq, const float *src, int W,
                          float *cache) {
    K3_TRY(check_seqs("kv_write", sq));
    if (sq->n_seqs > 0 && !sq->blocks)
        return K3_ERR(K3_ERR_ARG, "kv_write: the descriptor has no block table");
    for (int i = 0; i < sq->n_seqs; i++)
        for (int64_t t = sq->tok0[i]; t < sq->tok0[i + 1]; t++) {
            const int64_t p = sq->pos[i] + (t - sq->tok0[i]);
            if (p / K3_KV_BLOCK >= sq->max_blocks)
                return K3_ERR(K3_ERR_ARG, "kv_write: sequence %d position %lld past its %d blocks",
                              i, (long long)p, sq->max_blocks);
            memcpy(cache + k3_seqs_kv_row(sq, i, p) * W, src + t * W, (size_t)W * sizeof(float));
        }
    return K3_OK;
}

k3_status k3_ref_attn_paged(k3_backend *be, const k3_seqs *sq, const float *qc, const float *cache,
                            int H, int W, int Rkv, float scale, float *o_lat, float *work) {
    K3_TRY(check_seqs("attn_paged", sq));
    K3_TRY(k3_kernels_check_attn("attn_paged", 0, sq->max_ctx, H, W, Rkv));
    if (sq->n_seqs > 0 && !sq->blocks)
        return K3_ERR(K3_ERR_ARG, "attn_paged: the descriptor has no block table");
    for (int i = 0; i < sq->n_seqs; i++) {
        const int32_t *blk = sq->blocks + (int64_t)i * sq->max_blocks;
        for (int64_t t = sq->tok0[i]; t < sq->tok0[i + 1]; t++) {
            const int64_t n_ctx = sq->pos[i] + (t - sq->tok0[i]) + 1;
            for (int h = 0; h < H; h++)
                k3_ref_attn_latent_head(qc + (t * H + h) * W, cache, blk, n_ctx, W, Rkv, scale,
                                        o_lat + (t * H + h) * Rkv, work + (int64_t)h * n_ctx);
        }
    }
    return K3_OK;
}

k3_status k3_ref_short_conv_seqs(k3_backend *be, const k3_seqs *sq, const float *in, int64_t P,
                                 int K, const float *w, float *state, int64_t state_stride,
                                 float *out) {
    K3_TRY(check_seqs("short_conv_seqs", sq));
    for (int i = 0; i < sq->n_seqs; i++) {
        const int64_t t0 = sq->tok0[i], n = sq->tok0[i + 1] - t0;
        float *st = state + (int64_t)sq->slot[i] * state_stride;
        if (sq->pos[i] == 0 && K > 1) memset(st, 0, (size_t)(K - 1) * (size_t)P * sizeof(float));
        K3_TRY(be->ops->short_conv(be, in + t0 * P, n, P, K, w, st, out + t0 * P));
    }
    return K3_OK;
}

k3_status k3_ref_kda_seqs(k3_backend *be, const k3_seqs *sq, const float *q, const float *k,
                          const float *v, const float *g, const float *beta, int H, int dk, int dv,
                          float scale, float *S, int64_t S_stride, float *o, int C, float *work) {
    K3_TRY(check_seqs("kda_seqs", sq));
    const int64_t sqk = (int64_t)H * dk, svo = (int64_t)H * dv;
    for (int i = 0; i < sq->n_seqs; i++) {
        const int64_t t0 = sq->tok0[i], n = sq->tok0[i + 1] - t0;
        float *Si = S + (int64_t)sq->slot[i] * S_stride;
        if (sq->pos[i] == 0) memset(Si, 0, (size_t)H * (size_t)dk * (size_t)dv * sizeof(float));
        if (C > 1 && n >= C)
            K3_TRY(be->ops->kda_chunked(be, q + t0 * sqk, k + t0 * sqk, v + t0 * svo, g + t0 * sqk,
                                        beta + t0 * H, n, H, dk, dv, scale, Si, o + t0 * svo, C,
                                        work));
        else
            K3_TRY(be->ops->kda_recurrent(be, q + t0 * sqk, k + t0 * sqk, v + t0 * svo,
                                          g + t0 * sqk, beta + t0 * H, n, H, dk, dv, scale, Si,
                                          o + t0 * svo));
    }
    return K3_OK;
}

k3_status k3_ref_nonfinite_rows(k3_backend *be, const k3_seqs *sq, float *y, int64_t D,
                                bool per_seq, int32_t code, int32_t *flags) {
    K3_TRY(check_seqs("nonfinite_rows", sq));
    for (int i = 0; i < sq->n_seqs; i++) {
        if (flags[i] != 0) continue;
        const int64_t r0 = per_seq ? i : sq->tok0[i], n = per_seq ? 1 : sq->tok0[i + 1] - r0;
        float *rows = y + r0 * D, acc = 0.0f; /* x·0 is NaN exactly when x is NaN or Inf */
        for (int64_t e = 0; e < n * D; e++) acc += rows[e] * 0.0f;
        if (acc == 0.0f) continue;
        flags[i] = code;
        memset(rows, 0, (size_t)(n * D) * sizeof(float));
    }
    return K3_OK;
}

k3_status k3_ref_rows_last(k3_backend *be, const k3_seqs *sq, const float *src, int64_t slab,
                           int n_slab, int64_t D, float *dst) {
    K3_TRY(check_seqs("rows_last", sq));
    for (int j = 0; j < n_slab; j++)
        for (int i = 0; i < sq->n_seqs; i++)
            memcpy(dst + ((int64_t)j * sq->n_seqs + i) * D,
                   src + (int64_t)j * slab + (int64_t)(sq->tok0[i + 1] - 1) * D,
                   (size_t)D * sizeof(float));
    return K3_OK;
}
