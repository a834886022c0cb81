/* moe.c — the latent MoE of one layer (K3-MODEL.md §4.3): routing, latent down-projection,
 * routed expert rows, latent RMSNorm + up-projection of the weighted sum, shared experts, and the
 * single-process layer forward that strings them together.
 *
 * Owns no state: every function works on caller memory (a backend float scratch sized by
 * k3_moe_scratch_floats / k3_moe_rows_scratch_floats and, for k3_moe_expert_rows, a host int64
 * scratch for row sorting) and never allocates. Every loop over activations is an op of the
 * backend; this file only decides WHAT is computed and in which order.
 * Invariants:
 * - the weighted expert sum of token t is Σ_k w[t,k]·out[t·K+k] accumulated for k = 0..K-1
 *   (rows_wsum's order over segments of K slots; the moe_experts op keeps it);
 * - an expert output row never depends on the other rows of the call (rows of one expert are
 *   gathered and pushed through ops->matmul_group, whose per-element reduction order is
 *   independent of T);
 * - k3_moe_forward == route → down → expert rows (slot row t·K + k reads the latent row of token
 *   t) → slot sum → finish, bit for bit, in a fixed number of op calls: the routing stays in
 *   backend memory and one moe_experts call groups the rows by expert and sums the slots. Only
 *   k3_moe_expert_rows (the distributed path, whose rows arrive as host metadata) sorts on the
 *   host. */
#include "k3_experts.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* K3_MOE_ROW_TILE (k3_model.h, where k3 plan reads it too; 256): the rows k3_moe_expert_rows
 * pushes through one gather, two matmul_groups, one activation and one scatter (bounds scratch;
 * results do not depend on it). A 512-token prefill's ~64 rows per expert go 4 experts a tile,
 * 16 tiles a layer instead of 64 (a quarter of the dispatches, and each tile's x big enough to
 * pack on the pool). The moe_experts op tiles its rows the same way (K3_MOE_EXPERTS_TILE;
 * with slot weights, tokens first so that a tile's items fit its scratch). */

/* Keep every scratch sub-buffer a multiple of 16 floats (64 bytes) so SIMD loads stay aligned
 * when the base is. */
static size_t pad16(size_t n) {
    return (n + 15) & ~(size_t)15;
}

int64_t k3_moe_row_width(const k3_config *c) {
    return c->latent_size > 0 ? (int64_t)c->latent_size : c->hidden_size;
}

static int64_t shared_width(const k3_config *c) {
    return (int64_t)c->n_shared_experts * c->moe_intermediate_size;
}

k3_status k3_moe_check_config(const k3_config *c) {
    if (c->n_experts <= 0)
        return K3_ERR(K3_ERR_CONFIG, "num_experts = %d: the MoE needs >= 1 expert", c->n_experts);
    if (c->n_experts_per_tok <= 0 || c->n_experts_per_tok > c->n_experts)
        return K3_ERR(K3_ERR_CONFIG, "num_experts_per_token = %d must be in [1, num_experts = %d]",
                      c->n_experts_per_tok, c->n_experts);
    if (c->n_experts_per_tok > K3_MOE_EXPERTS_TILE) /* a token's slots share one op tile */
        return K3_ERR(K3_ERR_CONFIG,
                      "num_experts_per_token = %d: at most %d (the moe_experts op's row tile)",
                      c->n_experts_per_tok, K3_MOE_EXPERTS_TILE);
    if (c->n_group <= 0 || c->n_group > K3_MOE_MAX_GROUPS || c->n_experts % c->n_group != 0)
        return K3_ERR(K3_ERR_CONFIG,
                      "num_expert_group = %d must divide num_experts = %d (and be <= %d)",
                      c->n_group, c->n_experts, K3_MOE_MAX_GROUPS);
    if (c->topk_group <= 0 || c->topk_group > c->n_group)
        return K3_ERR(K3_ERR_CONFIG, "topk_group = %d must be in [1, num_expert_group = %d]",
                      c->topk_group, c->n_group);
    if ((int64_t)c->topk_group * (c->n_experts / c->n_group) < c->n_experts_per_tok)
        return K3_ERR(
            K3_ERR_CONFIG,
            "topk_group = %d groups of %d experts cannot supply num_experts_per_token = %d",
            c->topk_group, c->n_experts / c->n_group, c->n_experts_per_tok);
    if (c->moe_intermediate_size <= 0)
        return K3_ERR(K3_ERR_CONFIG, "moe_intermediate_size = %d must be > 0",
                      c->moe_intermediate_size);
    if (c->latent_size < 0)
        return K3_ERR(K3_ERR_CONFIG, "routed_expert_hidden_size = %d < 0", c->latent_size);
    if (c->n_shared_experts < 0)
        return K3_ERR(K3_ERR_CONFIG, "num_shared_experts = %d < 0", c->n_shared_experts);
    return K3_OK;
}

/* A weight must be 2-D [out, in] with the expected shape (descriptor only: no data access). */
static k3_status check_w(const k3_tensor *w, int64_t out, int64_t in, const char *what,
                         int expert) {
    if (!w->data) {
        if (expert >= 0)
            return K3_ERR(K3_ERR_MISSING, "MoE: expert %d tensor %s is not loaded", expert, what);
        return K3_ERR(K3_ERR_MISSING, "MoE: tensor %s is not loaded", what);
    }
    if (w->ndim != 2 || w->shape[0] != out || w->shape[1] != in) {
        return K3_ERR(K3_ERR_SHAPE,
                      "MoE: %s (expert %d) has shape [%lld, %lld] (ndim %d), expected [%lld, %lld]",
                      what, expert, (long long)(w->ndim >= 1 ? w->shape[0] : -1),
                      (long long)(w->ndim >= 2 ? w->shape[1] : -1), w->ndim, (long long)out,
                      (long long)in);
    }
    return K3_OK;
}

/* ---- routing ------------------------------------------------------------------------------- */
/* Test hook K3_TEST_ROUTES=FILE: every router call appends its [T, K] expert ids (int32) to FILE,
   so two runs of the same tokens (cpu and cuda, say) can count the routes that differ
   (docs/DESIGN.md §3b: route flips under bf16 activations). A host sync per call. */
static k3_status routes_dump(k3_backend *be, const int32_t *ids, int64_t n) {
    const char *path = getenv("K3_TEST_ROUTES");
    if (!path || !*path || n <= 0) return K3_OK;
    int32_t *h;
    K3_TRY(k3_calloc((void **)&h, (size_t)n * sizeof *h, "K3_TEST_ROUTES ids"));
    k3_status st = k3_backend_download(be, h, ids, (size_t)n * sizeof *h);
    FILE *f = st == K3_OK ? fopen(path, "ab") : NULL;
    if (st == K3_OK && (!f || fwrite(h, sizeof *h, (size_t)n, f) != (size_t)n))
        st = K3_ERR(K3_ERR_IO, "K3_TEST_ROUTES: cannot append to %s", path);
    if (f) fclose(f);
    k3_free(h);
    return st;
}

/* Test hook K3_TEST_ROUTE_ONE_EXPERT=e: every slot of every token goes to expert e (weights as
   routed), so a backend with a per-expert capacity (cuda: the device route's) must detect its
   overflow and name it (docs/DEVELOPING.md). One upload per call; never for a real run. */
static k3_status route_one_expert(k3_backend *be, const k3_config *c, int32_t *ids, int64_t n) {
    const char *v = getenv("K3_TEST_ROUTE_ONE_EXPERT");
    if (!v || !*v || n <= 0) return K3_OK;
    char *end = NULL;
    const long e = strtol(v, &end, 10);
    if (*end || e < 0 || e >= c->n_experts)
        return K3_ERR(K3_ERR_ARG, "K3_TEST_ROUTE_ONE_EXPERT=%s: want an expert in [0, %d)", v,
                      c->n_experts);
    int32_t *h;
    K3_TRY(k3_calloc((void **)&h, (size_t)n * sizeof *h, "K3_TEST_ROUTE_ONE_EXPERT ids"));
    for (int64_t i = 0; i < n; i++) h[i] = (int32_t)e;
    k3_status st = k3_backend_upload(be, ids, h, (size_t)n * sizeof *h);
    k3_free(h);
    return st;
}

k3_status k3_moe_router(k3_backend *be, const k3_config *c, const k3_layer_w *lw, const float *x,
                        int64_t T, int32_t *topk_ids, float *topk_w, float *scratch) {
    K3_TRY(k3_moe_check_config(c));
    const int64_t E = c->n_experts, D = c->hidden_size;
    K3_TRY(check_w(&lw->router, E, D, "block_sparse_moe.gate.weight", -1));
    if (T <= 0) return K3_OK;
    const bool has_bias = lw->router_bias.data != NULL;
    if (has_bias && k3_tensor_n_elems(&lw->router_bias) != E)
        return K3_ERR(K3_ERR_SHAPE, "MoE: e_score_correction_bias has %lld elements, expected %lld",
                      (long long)k3_tensor_n_elems(&lw->router_bias), (long long)E);
    float *scores = scratch;                        /* [T, E] σ(z) */
    float *work = scratch + pad16((size_t)(T * E)); /* [T, E] biased scores */
    float *bias = work + pad16((size_t)(T * E));    /* [E] */
    K3_TRY(be->ops->matmul(be, x, T, &lw->router, scores));
    K3_TRY(be->ops->sigmoid(be, scores, T * E, scores));
    if (has_bias) K3_TRY(be->ops->to_f32(be, &lw->router_bias, E, bias));
    K3_TRY(be->ops->moe_topk(be, scores, has_bias ? bias : NULL, T, (int)E, c->n_experts_per_tok,
                             c->n_group, c->topk_group, c->moe_renormalize,
                             c->routed_scaling_factor, work, topk_ids, topk_w));
    K3_TRY(route_one_expert(be, c, topk_ids, T * c->n_experts_per_tok));
    return routes_dump(be, topk_ids, T * c->n_experts_per_tok);
}

/* ---- latent down-projection ---------------------------------------------------------------- */
k3_status k3_moe_down(k3_backend *be, const k3_config *c, const k3_layer_w *lw, const float *x,
                      int64_t T, float *r) {
    const int64_t D = c->hidden_size;
    if (c->latent_size <= 0) {
        if (T > 0) K3_TRY(be->ops->copy2d(be, r, D, x, D, T, D));
        return K3_OK;
    }
    K3_TRY(check_w(&lw->lat_down, c->latent_size, D, "routed_expert_down_proj.weight", -1));
    if (T <= 0) return K3_OK;
    return be->ops->matmul(be, x, T, &lw->lat_down, r);
}

/* ---- routed experts ------------------------------------------------------------------------ */
static k3_status act(k3_backend *be, const k3_config *c, float *g, const float *u, int64_t n) {
    if (c->act == K3_ACT_SWIGLU) return be->ops->swiglu(be, g, u, n, g);
    return be->ops->situ(be, g, u, n, c->situ_beta, c->situ_linear_beta, g);
}

/* k3_moe_expert_rows: ids (int32) [n] | row_of (int32) [n] | the moe_experts op's work. */
size_t k3_moe_rows_scratch_floats(const k3_config *c, int64_t n) {
    const size_t nn = (size_t)(n > 0 ? n : 0);
    return 2 * pad16(nn) + k3_moe_experts_work_floats(k3_moe_row_width(c), c->moe_intermediate_size,
                                                      n, c->n_experts);
}

size_t k3_moe_rows_host_ints(const k3_config *c, int64_t n) {
    (void)c;
    return (size_t)(n > 0 ? n : 0); /* the ids and rows as int32, staged for one upload */
}

k3_status k3_moe_expert_rows(k3_backend *be, const k3_config *c, const k3_layer_w *lw,
                             const float *src, const int64_t *row_of, const int32_t *expert,
                             int64_t n, float *out, float *scratch, int64_t *hscratch) {
    K3_TRY(k3_moe_check_config(c));
    const int E = c->n_experts;
    const int64_t Lw = k3_moe_row_width(c), I = c->moe_intermediate_size;
    if (n <= 0) return K3_OK;
    if (n > INT32_MAX) return K3_ERR(K3_ERR_ARG, "MoE: %lld rows (at most 2^31)", (long long)n);
    /* validate ids, presence and shapes before touching anything (the ids are host metadata) */
    for (int64_t i = 0; i < n; i++) {
        int32_t e = expert[i];
        if (e < 0 || e >= E)
            return K3_ERR(K3_ERR_ARG, "MoE: row %lld has expert id %d outside [0, %d)",
                          (long long)i, e, E);
        /* loaded = flagged present or holding its tensors (a loader may fill one, not both) */
        if (!lw->experts || (!lw->experts[e].present && !lw->experts[e].w1.data))
            return K3_ERR(K3_ERR_MISSING,
                          "MoE: row %lld needs expert %d, which is not loaded on this rank",
                          (long long)i, e);
        if (row_of && (row_of[i] < 0 || row_of[i] > INT32_MAX))
            return K3_ERR(K3_ERR_ARG, "MoE: row %lld reads source row %lld", (long long)i,
                          (long long)row_of[i]);
    }
    for (int64_t i = 0; i < n; i++) {
        const int e = expert[i];
        const k3_expert_w *ew = &lw->experts[e];
        K3_TRY(check_w(&ew->w1, I, Lw, "w1", e));
        K3_TRY(check_w(&ew->w3, I, Lw, "w3", e));
        K3_TRY(check_w(&ew->w2, Lw, I, "w2", e));
    }
    /* the ids and source rows to the backend in one copy, then one op for every row: the op
       groups the rows by expert itself (k3_kernels.h moe_experts; each output row depends only
       on its own row and expert, so this is the bits of every tiling) */
    int32_t *h = (int32_t *)(void *)hscratch, *d = (int32_t *)(void *)scratch;
    memcpy(h, expert, (size_t)n * sizeof(int32_t));
    for (int64_t i = 0; row_of && i < n; i++) h[n + i] = (int32_t)row_of[i];
    K3_TRY(k3_backend_upload_async(be, d, h, (size_t)(row_of ? 2 * n : n) * sizeof(int32_t)));
    const k3_expert_w *ex = lw->experts;
    return be->ops->moe_experts(be, src, 1, row_of ? d + n : NULL, d, NULL, n, E, &ex->w1, &ex->w3,
                                &ex->w2, sizeof *ex, c->act == K3_ACT_SWIGLU ? -1.0f : c->situ_beta,
                                c->situ_linear_beta, out, scratch + 2 * pad16((size_t)n));
}

/* ---- finish: latent norm + up + shared ------------------------------------------------------ */
static size_t finish_scratch_floats(const k3_config *c, int64_t T) {
    const size_t Lw = (size_t)k3_moe_row_width(c), D = (size_t)c->hidden_size,
                 S = (size_t)shared_width(c);
    const size_t TT = (size_t)(T > 0 ? T : 0);
    size_t f = 0;
    f += pad16(TT * Lw); /* nrm   [T, Lw] latent RMSNorm    */
    f += pad16(Lw);      /* wn    [Lw] latent norm weight   */
    f += pad16(TT * S);  /* g     [T, S] shared gate        */
    f += pad16(TT * S);  /* u     [T, S] shared up          */
    f += pad16(TT * D);  /* sh    [T, D] shared output      */
    return f;
}

k3_status k3_moe_finish(k3_backend *be, const k3_config *c, const k3_layer_w *lw, const float *x,
                        const float *acc, int64_t T, float *y, float *scratch) {
    const int64_t Lw = k3_moe_row_width(c), D = c->hidden_size, S = shared_width(c);
    const bool latent = c->latent_size > 0;
    if (latent) {
        K3_TRY(check_w(&lw->lat_up, D, Lw, "routed_expert_up_proj.weight", -1));
        if (c->latent_moe_use_norm &&
            (!lw->lat_norm.data || k3_tensor_n_elems(&lw->lat_norm) != Lw))
            return K3_ERR(lw->lat_norm.data ? K3_ERR_SHAPE : K3_ERR_MISSING,
                          "MoE: routed_expert_norm.weight must hold %lld elements", (long long)Lw);
    }
    if (S > 0) {
        K3_TRY(check_w(&lw->sh_gate, S, D, "shared_experts.gate_proj.weight", -1));
        K3_TRY(check_w(&lw->sh_up, S, D, "shared_experts.up_proj.weight", -1));
        K3_TRY(check_w(&lw->sh_down, D, S, "shared_experts.down_proj.weight", -1));
    }
    if (T <= 0) return K3_OK;
    float *nrm = scratch;
    float *wn = nrm + pad16((size_t)(T * Lw));
    float *g = wn + pad16((size_t)Lw);
    float *u = g + pad16((size_t)(T * S));
    float *sh = u + pad16((size_t)(T * S));

    if (latent) {
        const float *upin = acc;
        if (c->latent_moe_use_norm) {
            K3_TRY(be->ops->to_f32(be, &lw->lat_norm, Lw, wn));
            K3_TRY(be->ops->rmsnorm(be, acc, wn, T, Lw, c->rms_norm_eps, nrm));
            upin = nrm;
        }
        K3_TRY(be->ops->matmul(be, upin, T, &lw->lat_up, y));
    } else {
        K3_TRY(be->ops->copy2d(be, y, D, acc, D, T, D));
    }
    if (S > 0) {
        const k3_mm gu[2] = {{x, T, &lw->sh_gate, g}, {x, T, &lw->sh_up, u}};
        K3_TRY(be->ops->matmul_group(be, gu, 2));
        K3_TRY(act(be, c, g, u, T * S));
        K3_TRY(be->ops->matmul(be, g, T, &lw->sh_down, sh));
        K3_TRY(be->ops->add(be, y, sh, T * D, y));
    }
    return K3_OK;
}

/* ---- whole layer ---------------------------------------------------------------------------- */
/* The expert tensors are checked against the config here, on the descriptors (host structs, no
 * data access): the moe_experts op takes its widths from the tensors of the experts it meets and
 * only checks that they agree with each other. Every loaded expert, since the ids the op reads
 * are backend memory. */
static k3_status check_experts(const k3_config *c, const k3_layer_w *lw) {
    const int64_t Lw = k3_moe_row_width(c), I = c->moe_intermediate_size;
    for (int e = 0; lw->experts && e < c->n_experts; e++) {
        const k3_expert_w *ew = &lw->experts[e];
        if (!ew->w1.data) continue; /* not on this rank: the op names the row that needs it */
        K3_TRY(check_w(&ew->w1, I, Lw, "w1", e));
        K3_TRY(check_w(&ew->w3, I, Lw, "w3", e));
        K3_TRY(check_w(&ew->w2, Lw, I, "w2", e));
    }
    return K3_OK;
}

static size_t route_floats(const k3_config *c, int64_t T) {
    const size_t E = (size_t)c->n_experts, TT = (size_t)T;
    return 2 * pad16(TT * E) + pad16(E);
}

/* k3_moe_forward: ids (int32) | w [T·K] | r [T, Lw] latent rows | acc [T, Lw] slot sums | a tail
 * that the router, then the moe_experts op, then the finish step use in turn. */
static size_t forward_scratch_floats(const k3_config *c, int64_t T) {
    const size_t K = (size_t)c->n_experts_per_tok, TT = (size_t)T;
    const size_t Lw = (size_t)k3_moe_row_width(c);
    size_t head = 2 * pad16(TT * K) + 2 * pad16(TT * Lw);
    size_t tail = k3_moe_experts_work_floats((int64_t)Lw, c->moe_intermediate_size, T * (int64_t)K,
                                             c->n_experts);
    tail = K3_MAX(tail, route_floats(c, T));
    tail = K3_MAX(tail, finish_scratch_floats(c, T));
    return head + tail;
}

size_t k3_moe_scratch_floats(const k3_config *c, int64_t T) {
    if (T < 1) T = 1;
    if (c->n_experts <= 0 || c->n_experts_per_tok <= 0) return 0;
    const int64_t K = c->n_experts_per_tok;
    size_t f = route_floats(c, T);
    f = K3_MAX(f, k3_moe_rows_scratch_floats(c, T * K));
    f = K3_MAX(f, finish_scratch_floats(c, T));
    f = K3_MAX(f, forward_scratch_floats(c, T));
    return f;
}

size_t k3_moe_host_ints(const k3_config *c, int64_t T) {
    if (T < 1) T = 1;
    const int64_t K = c->n_experts_per_tok > 0 ? c->n_experts_per_tok : 1;
    /* k3_moe_forward sorts nothing on the host; k3_moe_expert_rows with up to T·K rows does */
    return k3_moe_rows_host_ints(c, T * K);
}

k3_status k3_moe_forward(k3_backend *be, const k3_config *c, const k3_layer_w *lw, const float *x,
                         int64_t T, float *y, float *scratch) {
    K3_TRY(k3_moe_check_config(c));
    K3_TRY(check_experts(c, lw));
    if (T <= 0) return K3_OK;
    const int K = c->n_experts_per_tok;
    const int64_t Lw = k3_moe_row_width(c);
    int32_t *ids = (int32_t *)(void *)scratch; /* backend */
    float *w = scratch + pad16((size_t)T * (size_t)K);
    float *r = w + pad16((size_t)T * (size_t)K);
    float *acc = r + pad16((size_t)T * (size_t)Lw);
    float *tail = acc + pad16((size_t)T * (size_t)Lw);
    K3_TRY(k3_moe_router(be, c, lw, x, T, ids, w, tail));
    const float *src = x; /* no latent: the experts read x itself */
    if (c->latent_size > 0) {
        K3_TRY(k3_moe_down(be, c, lw, x, T, r));
        src = r;
    }
    /* every slot row t·K + k reads src row t; acc[t] = Σ_k w[t·K + k]·item in k order */
    const k3_expert_w *ex = lw->experts;
    const float beta = c->act == K3_ACT_SWIGLU ? -1.0f : c->situ_beta;
    K3_TRY(be->ops->moe_experts(be, src, K, NULL, ids, w, T * K, c->n_experts, ex ? &ex->w1 : NULL,
                                ex ? &ex->w3 : NULL, ex ? &ex->w2 : NULL, sizeof *ex, beta,
                                c->situ_linear_beta, acc, tail));
    return k3_moe_finish(be, c, lw, x, acc, T, y, tail);
}
