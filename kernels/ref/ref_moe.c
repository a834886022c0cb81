/* ref_moe.c — the reference backend's moe_experts op (k3_kernels.h): the routed experts of a MoE
 * layer, defined row by row. Each slot row i is its own three products through the backend's
 * matmul (T = 1) and one activation: item_i = W2_e·act(W1_e·r_i, W3_e·r_i), e = ids[i],
 * r_i = src row i / row_div; with weights, output row t is rows_wsum of its row_div items (the
 * backend's own op, so its order and first-term rule are rows_wsum's by construction).
 * No sorting, no tiles: this is the meaning the cpu backend's grouped form (cpu_moe.c) must
 * reproduce bit for bit on its own ops. A matmul's row never depends on the other rows of its
 * call (the determinism rule), so one row at a time gives the bits k3_moe_expert_rows gives.
 * Work: the items of one token [row_div, Lw] and the two inner rows [I] each, inside the layout
 * k3_moe_experts_work_floats sizes (xin | o | g | u | host ints). Every argument is checked
 * (ids, loaded experts, shapes) before any buffer is written. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#define TILE K3_MOE_EXPERTS_TILE

static size_t pad16(size_t n) {
    return (n + 15) & ~(size_t)15;
}

static k3_status check_shape(const k3_tensor *t, int64_t out, int64_t in, const char *what, int e,
                             int e0) {
    if (t->ndim != 2 || t->shape[0] != out || t->shape[1] != in)
        return K3_ERR(K3_ERR_SHAPE,
                      "moe_experts: %s of expert %d has shape [%lld, %lld] (ndim %d), expected "
                      "[%lld, %lld] as expert %d's",
                      what, e, (long long)(t->ndim >= 1 ? t->shape[0] : -1),
                      (long long)(t->ndim >= 2 ? t->shape[1] : -1), t->ndim, (long long)out,
                      (long long)in, e0);
    return K3_OK;
}

k3_status k3_kernels_check_moe(int64_t row_div, const float *w, int64_t n, int E) {
    if (row_div < 1 || E < 1)
        return K3_ERR(K3_ERR_ARG, "moe_experts: row_div %lld, %d experts (both must be >= 1)",
                      (long long)row_div, E);
    if (w && (n % row_div != 0 || row_div > TILE))
        return K3_ERR(K3_ERR_ARG,
                      "moe_experts: %lld slot rows are not whole tokens of row_div %lld slots "
                      "(at most %d)",
                      (long long)n, (long long)row_div, TILE);
    return K3_OK;
}

/* The checks of the host backends (ref, cpu: one definition, the same errors): the scalars, ids in
 * [0, E), every expert used loaded (tables not NULL, data in w1, w3, w2), every expert used shaped
 * as the first row's (w1, w3 [I, Lw], w2 [Lw, I]) and row_of >= 0. n > 0. */
k3_status k3_ref_moe_check(int64_t row_div, const int32_t *row_of, const int32_t *ids,
                           const float *w, int64_t n, int E, const k3_tensor *w1,
                           const k3_tensor *w3, const k3_tensor *w2, size_t e_stride,
                           const float *work, int64_t *Lw, int64_t *I) {
    K3_TRY(k3_kernels_check_moe(row_div, w, n, E));
    if ((uintptr_t)work % sizeof(int64_t) != 0)
        return K3_ERR(K3_ERR_ARG, "moe_experts: work is not 8-byte aligned");
    for (int64_t i = 0; i < n; i++) {
        const int32_t e = ids[i];
        if (e < 0 || e >= E)
            return K3_ERR(K3_ERR_ARG, "moe_experts: row %lld has expert id %d outside [0, %d)",
                          (long long)i, e, E);
        if (!w1 || !w3 || !w2 || !k3_moe_expert_t(w1, e, e_stride)->data ||
            !k3_moe_expert_t(w3, e, e_stride)->data || !k3_moe_expert_t(w2, e, e_stride)->data)
            return K3_ERR(K3_ERR_MISSING,
                          "moe_experts: row %lld needs expert %d, which is not loaded on this rank",
                          (long long)i, e);
        if (row_of && row_of[i] < 0)
            return K3_ERR(K3_ERR_ARG, "moe_experts: row %lld reads source row %d", (long long)i,
                          row_of[i]);
    }
    const int e0 = ids[0];
    const k3_tensor *f = k3_moe_expert_t(w1, e0, e_stride);
    if (f->ndim != 2 || f->shape[0] < 1 || f->shape[1] < 1)
        return K3_ERR(K3_ERR_SHAPE, "moe_experts: w1 of expert %d is not a 2-D [I, Lw] weight", e0);
    *I = f->shape[0], *Lw = f->shape[1];
    for (int64_t i = 0; i < n; i++) {
        const int e = ids[i];
        K3_TRY(check_shape(k3_moe_expert_t(w1, e, e_stride), *I, *Lw, "w1", e, e0));
        K3_TRY(check_shape(k3_moe_expert_t(w3, e, e_stride), *I, *Lw, "w3", e, e0));
        K3_TRY(check_shape(k3_moe_expert_t(w2, e, e_stride), *Lw, *I, "w2", e, e0));
    }
    return K3_OK;
}

k3_status k3_ref_moe_experts(k3_backend *be, const float *src, int64_t row_div,
                             const int32_t *row_of, const int32_t *ids, const float *w, int64_t n,
                             int E, const k3_tensor *w1, const k3_tensor *w3, const k3_tensor *w2,
                             size_t e_stride, float beta, float lin_beta, float *out, float *work) {
    if (n <= 0) return K3_OK;
    int64_t Lw = 0, I = 0;
    K3_TRY(k3_ref_moe_check(row_div, row_of, ids, w, n, E, w1, w3, w2, e_stride, work, &Lw, &I));
    float *items = work; /* [row_div, Lw] in the xin part (row_div <= TILE with weights) */
    float *g = work + 2 * pad16((size_t)TILE * (size_t)Lw);
    float *u = g + pad16((size_t)TILE * (size_t)I);
    const int64_t per = w ? row_div : 1; /* items per output row */
    for (int64_t t = 0; t < n / per; t++) {
        for (int64_t k = 0; k < per; k++) {
            const int64_t i = t * per + k;
            const int e = ids[i];
            const float *r = src + (row_of ? row_of[i] : i / row_div) * Lw;
            float *item = w ? items + k * Lw : out + i * Lw;
            K3_TRY(be->ops->matmul(be, r, 1, k3_moe_expert_t(w1, e, e_stride), g));
            K3_TRY(be->ops->matmul(be, r, 1, k3_moe_expert_t(w3, e, e_stride), u));
            if (beta < 0)
                K3_TRY(be->ops->swiglu(be, g, u, I, g));
            else
                K3_TRY(be->ops->situ(be, g, u, I, beta, lin_beta, g));
            K3_TRY(be->ops->matmul(be, g, 1, k3_moe_expert_t(w2, e, e_stride), item));
        }
        if (w) K3_TRY(be->ops->rows_wsum(be, items, w + t * per, NULL, per, 1, Lw, out + t * Lw));
    }
    return K3_OK;
}
