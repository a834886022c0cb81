/* moe.c — the latent MoE of one layer (K3-MODEL.md §4.3): router, grouped top-k, latent
 * down-projection, routed expert rows, slot-order combine + latent RMSNorm + up-projection,
 * shared experts, and the single-process layer forward that strings them together.
 *
 * Owns no state: every function works on caller memory (a float scratch sized by
 * k3_moe_scratch_floats / k3_moe_rows_scratch_floats) and never allocates.
 * All heavy math goes through the op table (ops->matmul etc.); this file only decides WHAT is
 * computed and in which order. Invariants:
 * - the weighted expert sum of token t is Σ_k w[t,k]·out[t·K+k] accumulated for k = 0..K-1;
 * - an expert output row never depends on the other rows of the call (rows of one expert are
 *   batched through ops->matmul, whose per-element reduction order is independent of T);
 * - k3_moe_forward == route → down → expand → expert_rows → finish, bit for bit (token tiles
 *   only bound the scratch; it reads each token's latent row for all K slots instead of
 *   materialising the T·K expanded rows). */
#include "k3_experts.h"

#include <math.h>

/* Rows of one expert pushed through ops->matmul at once (bounds scratch; results do not depend
 * on it). */
#define MOE_ROW_TILE 64
/* Tokens per tile of k3_moe_forward (bounds the T·K·Lw slot-row buffer). */
#define MOE_TOKEN_TILE 256

/* Keep every scratch sub-buffer a multiple of 16 floats (64 bytes) so int64 views and SIMD
 * loads stay aligned when the base is. */
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

/* A weight must be 2-D [out, in] with the expected shape. */
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

/* Index of the largest v[i] over i in [0, n) with allowed[i]; ties -> lowest index. */
static int argmax_lowest(const float *v, int n, const unsigned char *allowed) {
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (!allowed[i]) continue;
        if (best < 0 || v[i] > v[best]) best = i;
    }
    return best;
}

k3_status k3_moe_select(const k3_config *c, const float *scores, float *biased, int64_t T,
                        int32_t *topk_ids, float *topk_w) {
    K3_TRY(k3_moe_check_config(c));
    const int E = c->n_experts, K = c->n_experts_per_tok, G = c->n_group, gsz = E / G;
    /* Group state lives on the stack (n_group <= K3_MOE_MAX_GROUPS); the expert-level "already
     * taken" state is kept in `biased` itself (taken -> -inf; inputs are checked finite). */
    unsigned char gkeep[K3_MOE_MAX_GROUPS];
    float gscore[K3_MOE_MAX_GROUPS];
    for (int64_t t = 0; t < T; t++) {
        const float *s = scores + t * E;
        float *b = biased + t * E;
        for (int e = 0; e < E; e++) {
            if (!isfinite(s[e]) || !isfinite(b[e]))
                return K3_ERR(
                    K3_ERR_INTERNAL,
                    "MoE router: non-finite score at token %lld, expert %d (%g, biased %g)",
                    (long long)t, e, (double)s[e], (double)b[e]);
        }
        /* group scores: sum of the two best biased scores of each group (one if gsz == 1) */
        for (int g = 0; g < G; g++) {
            const float *bg = b + (int64_t)g * gsz;
            int i1 = 0;
            for (int i = 1; i < gsz; i++)
                if (bg[i] > bg[i1]) i1 = i;
            int i2 = -1;
            for (int i = 0; i < gsz; i++)
                if (i != i1 && (i2 < 0 || bg[i] > bg[i2])) i2 = i;
            gscore[g] = i2 < 0 ? bg[i1] : bg[i1] + bg[i2];
            gkeep[g] = 0;
        }
        if (G > 1) {
            unsigned char avail[K3_MOE_MAX_GROUPS];
            memset(avail, 1, (size_t)G);
            for (int j = 0; j < c->topk_group; j++) {
                int g = argmax_lowest(gscore, G, avail);
                avail[g] = 0;
                gkeep[g] = 1;
            }
        } else {
            gkeep[0] = 1;
        }
        /* top-K of the biased scores among experts of kept groups; ties -> lower expert index */
        int32_t *ids = topk_ids + t * K;
        for (int k = 0; k < K; k++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                if (!gkeep[e / gsz] || isinf(b[e])) continue; /* masked group or already taken */
                if (best < 0 || b[e] > b[best]) best = e;
            }
            /* cannot happen: check_config guarantees K <= kept experts and scores are finite */
            if (best < 0)
                return K3_ERR(K3_ERR_INTERNAL, "MoE router: ran out of experts at token %lld",
                              (long long)t);
            ids[k] = best;
            b[best] = -INFINITY;
        }
        float *w = topk_w + t * K;
        float sum = 0.0f;
        for (int k = 0; k < K; k++) {
            w[k] = s[ids[k]];
            sum += w[k];
        }
        if (c->moe_renormalize) {
            float den = sum + 1e-20f;
            for (int k = 0; k < K; k++) w[k] = w[k] / den;
        }
        for (int k = 0; k < K; k++) w[k] *= c->routed_scaling_factor;
    }
    return K3_OK;
}

k3_status k3_moe_route(const k3_ops *ops, const k3_config *c, const k3_layer_w *lw, const float *x,
                       int64_t T, int32_t *topk_ids, float *topk_w, float *scratch) {
    K3_TRY(k3_moe_check_config(c));
    const int64_t E = c->n_experts, D = c->hidden_size;
    K3_TRY(check_w(&lw->router, E, D, "block_sparse_moe.gate.weight", -1));
    if (T <= 0) return K3_OK;
    const bool has_bias = lw->router_bias.data != NULL;
    if (has_bias && k3_tensor_n_elems(&lw->router_bias) != E)
        return K3_ERR(K3_ERR_SHAPE, "MoE: e_score_correction_bias has %lld elements, expected %lld",
                      (long long)k3_tensor_n_elems(&lw->router_bias), (long long)E);
    float *scores = scratch;         /* [T, E] σ(z) */
    float *biased = scratch + T * E; /* [T, E] σ(z) + bias */
    K3_TRY(ops->matmul(x, T, &lw->router, scores));
    ops->sigmoid(scores, T * E, scores);
    if (has_bias) {
        K3_TRY(k3_tensor_to_f32(&lw->router_bias, biased, E)); /* row 0 holds the bias */
        for (int64_t t = T - 1; t >= 0; t--) {
            for (int64_t e = 0; e < E; e++) biased[t * E + e] = scores[t * E + e] + biased[e];
        }
    } else {
        memcpy(biased, scores, (size_t)(T * E) * sizeof(float));
    }
    return k3_moe_select(c, scores, biased, T, topk_ids, topk_w);
}

/* ---- latent down-projection ---------------------------------------------------------------- */

k3_status k3_moe_down(const k3_ops *ops, const k3_config *c, const k3_layer_w *lw, const float *x,
                      int64_t T, float *r) {
    const int64_t D = c->hidden_size;
    if (c->latent_size <= 0) {
        if (T > 0 && r != x) memmove(r, x, (size_t)(T * D) * sizeof(float));
        return K3_OK;
    }
    K3_TRY(check_w(&lw->lat_down, c->latent_size, D, "routed_expert_down_proj.weight", -1));
    if (T <= 0) return K3_OK;
    return ops->matmul(x, T, &lw->lat_down, r);
}

void k3_moe_expand_rows(const float *r, int64_t T, int K, int64_t Lw, float *rows) {
    /* Backwards so that rows may alias r: row t·K+k >= t, so a source r[t'] with t' < t is never
     * overwritten before it is copied. */
    for (int64_t t = T - 1; t >= 0; t--) {
        for (int k = K - 1; k >= 0; k--) {
            memmove(rows + (t * K + k) * Lw, r + t * Lw, (size_t)Lw * sizeof(float));
        }
    }
}

/* ---- routed experts ------------------------------------------------------------------------ */

static void act(const k3_ops *ops, const k3_config *c, float *g, const float *u, int64_t n) {
    if (c->act == K3_ACT_SWIGLU) {
        ops->swiglu(g, u, n, g);
    } else {
        ops->situ(g, u, n, c->situ_beta, c->situ_linear_beta, g);
    }
}

size_t k3_moe_rows_scratch_floats(const k3_config *c, int64_t n) {
    const size_t Lw = (size_t)k3_moe_row_width(c), I = (size_t)c->moe_intermediate_size;
    const size_t E = (size_t)(c->n_experts > 0 ? c->n_experts : 0);
    const size_t nn = (size_t)(n > 0 ? n : 0);
    size_t f = 0;
    f += pad16(2 * nn);            /* order: int64 [n] rows sorted by expert */
    f += pad16(2 * (E + 1));       /* start: int64 [E + 1] */
    f += pad16(MOE_ROW_TILE * Lw); /* xin [tile, Lw] */
    f += pad16(MOE_ROW_TILE * I);  /* g   [tile, I]  */
    f += pad16(MOE_ROW_TILE * I);  /* u   [tile, I]  */
    f += pad16(MOE_ROW_TILE * Lw); /* o   [tile, Lw] */
    return f;
}

/* The expert compute. The input of slot row i is src[i / div] (div = 1: rows as given; div = K:
 * src holds one row per token, shared by its K slots — k3_moe_forward skips the expansion). */
static k3_status expert_rows(const k3_ops *ops, const k3_config *c, const k3_layer_w *lw,
                             const float *src, int64_t div, const int32_t *expert, int64_t n,
                             float *out, float *scratch) {
    K3_TRY(k3_moe_check_config(c));
    const int E = c->n_experts;
    const int64_t Lw = k3_moe_row_width(c), I = c->moe_intermediate_size;
    if (n <= 0) return K3_OK;
    if ((uintptr_t)scratch % 8 != 0)
        return K3_ERR(K3_ERR_ARG, "MoE expert rows: scratch must be 8-byte aligned (k3_alloc)");
    /* validate ids and presence before touching anything */
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
    }
    /* counting sort of the rows by expert (stable: rows of one expert keep their order) */
    size_t off = 0;
    int64_t *order = (int64_t *)(void *)(scratch + off);
    off += pad16(2 * (size_t)n);
    int64_t *start = (int64_t *)(void *)(scratch + off);
    off += pad16(2 * ((size_t)E + 1));
    float *xin = scratch + off;
    off += pad16((size_t)MOE_ROW_TILE * (size_t)Lw);
    float *g = scratch + off;
    off += pad16((size_t)MOE_ROW_TILE * (size_t)I);
    float *u = scratch + off;
    off += pad16((size_t)MOE_ROW_TILE * (size_t)I);
    float *o = scratch + off;

    for (int e = 0; e <= E; e++) start[e] = 0;
    for (int64_t i = 0; i < n; i++) start[expert[i] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t i = 0; i < n; i++) order[start[expert[i]]++] = i; /* start[e] -> end of e */
    for (int e = E; e > 0; e--) start[e] = start[e - 1];           /* shift back to starts */
    start[0] = 0;

    for (int e = 0; e < E; e++) {
        int64_t b = start[e], end = start[e + 1];
        if (b == end) continue;
        const k3_expert_w *ew = &lw->experts[e];
        K3_TRY(check_w(&ew->w1, I, Lw, "w1", e));
        K3_TRY(check_w(&ew->w3, I, Lw, "w3", e));
        K3_TRY(check_w(&ew->w2, Lw, I, "w2", e));
        for (int64_t j0 = b; j0 < end; j0 += MOE_ROW_TILE) {
            int64_t m = K3_MIN((int64_t)MOE_ROW_TILE, end - j0);
            for (int64_t j = 0; j < m; j++)
                memcpy(xin + j * Lw, src + (order[j0 + j] / div) * Lw, (size_t)Lw * sizeof(float));
            K3_TRY(ops->matmul(xin, m, &ew->w1, g));
            K3_TRY(ops->matmul(xin, m, &ew->w3, u));
            act(ops, c, g, u, m * I);
            K3_TRY(ops->matmul(g, m, &ew->w2, o));
            for (int64_t j = 0; j < m; j++)
                memcpy(out + order[j0 + j] * Lw, o + j * Lw, (size_t)Lw * sizeof(float));
        }
    }
    return K3_OK;
}

k3_status k3_moe_expert_rows(const k3_ops *ops, const k3_config *c, const k3_layer_w *lw,
                             const float *rows, const int32_t *expert, int64_t n, float *out,
                             float *scratch) {
    return expert_rows(ops, c, lw, rows, 1, expert, n, out, scratch);
}

/* ---- combine + shared ---------------------------------------------------------------------- */

static size_t finish_scratch_floats(const k3_config *c, int64_t T) {
    const size_t Lw = (size_t)k3_moe_row_width(c), D = (size_t)c->hidden_size,
                 S = (size_t)shared_width(c);
    const size_t TT = (size_t)(T > 0 ? T : 0);
    size_t f = 0;
    f += pad16(TT * Lw); /* acc   [T, Lw] weighted slot sum */
    f += pad16(TT * Lw); /* nrm   [T, Lw] latent RMSNorm    */
    f += pad16(Lw);      /* wn    [Lw] latent norm weight   */
    f += pad16(TT * S);  /* g     [T, S] shared gate        */
    f += pad16(TT * S);  /* u     [T, S] shared up          */
    f += pad16(TT * D);  /* sh    [T, D] shared output      */
    return f;
}

k3_status k3_moe_finish(const k3_ops *ops, const k3_config *c, const k3_layer_w *lw, const float *x,
                        const float *topk_w, const float *expert_out, int64_t T, float *y,
                        float *scratch) {
    const int K = c->n_experts_per_tok;
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
    size_t off = 0;
    float *acc = scratch + off;
    off += pad16((size_t)(T * Lw));
    float *nrm = scratch + off;
    off += pad16((size_t)(T * Lw));
    float *wn = scratch + off;
    off += pad16((size_t)Lw);
    float *g = scratch + off;
    off += pad16((size_t)(T * S));
    float *u = scratch + off;
    off += pad16((size_t)(T * S));
    float *sh = scratch + off;

    /* weighted sum in slot order k = 0..K-1 */
    for (int64_t t = 0; t < T; t++) {
        float *a = acc + t * Lw;
        const float *w = topk_w + t * K;
        const float *o0 = expert_out + (t * K) * Lw;
        for (int64_t d = 0; d < Lw; d++) a[d] = w[0] * o0[d];
        for (int k = 1; k < K; k++) {
            const float *ok = expert_out + (t * K + k) * Lw;
            const float wk = w[k];
            for (int64_t d = 0; d < Lw; d++) a[d] += wk * ok[d];
        }
    }
    if (latent) {
        const float *upin = acc;
        if (c->latent_moe_use_norm) {
            K3_TRY(k3_tensor_to_f32(&lw->lat_norm, wn, Lw));
            ops->rmsnorm(acc, wn, T, Lw, c->rms_norm_eps, nrm);
            upin = nrm;
        }
        K3_TRY(ops->matmul(upin, T, &lw->lat_up, y));
    } else {
        memcpy(y, acc, (size_t)(T * D) * sizeof(float));
    }
    if (S > 0) {
        K3_TRY(ops->matmul(x, T, &lw->sh_gate, g));
        K3_TRY(ops->matmul(x, T, &lw->sh_up, u));
        act(ops, c, g, u, T * S);
        K3_TRY(ops->matmul(g, T, &lw->sh_down, sh));
        for (int64_t i = 0; i < T * D; i++) y[i] += sh[i];
    }
    return K3_OK;
}

/* ---- whole layer ---------------------------------------------------------------------------- */

static size_t forward_tile_floats(const k3_config *c, int64_t Tc) {
    const size_t Lw = (size_t)k3_moe_row_width(c), K = (size_t)c->n_experts_per_tok;
    const size_t TT = (size_t)Tc;
    size_t f = 0;
    f += pad16(TT * Lw);     /* r  [Tc, Lw] latent rows, one per token (shared by its K slots) */
    f += pad16(TT * K * Lw); /* eo [Tc·K, Lw] expert outputs in slot order */
    size_t rs = k3_moe_rows_scratch_floats(c, Tc * (int64_t)K);
    size_t fs = finish_scratch_floats(c, Tc);
    f += K3_MAX(rs, fs);
    return f;
}

static size_t forward_scratch_floats(const k3_config *c, int64_t T) {
    const size_t E = (size_t)c->n_experts, K = (size_t)c->n_experts_per_tok, TT = (size_t)T;
    size_t head = pad16(TT * K) + pad16(TT * K); /* ids (int32) + weights */
    size_t route = pad16(2 * TT * E);
    size_t tile = forward_tile_floats(c, K3_MIN(T, (int64_t)MOE_TOKEN_TILE));
    return head + K3_MAX(route, tile);
}

size_t k3_moe_scratch_floats(const k3_config *c, int64_t T) {
    if (T < 1) T = 1;
    if (c->n_experts <= 0 || c->n_experts_per_tok <= 0) return 0;
    const int64_t K = c->n_experts_per_tok;
    size_t f = pad16(2 * (size_t)T * (size_t)c->n_experts); /* route */
    f = K3_MAX(f, k3_moe_rows_scratch_floats(c, T * K));    /* expert rows, n = T·K */
    f = K3_MAX(f, finish_scratch_floats(c, T));             /* finish */
    f = K3_MAX(f, forward_scratch_floats(c, T));            /* forward */
    return f;
}

k3_status k3_moe_forward(const k3_ops *ops, const k3_config *c, const k3_layer_w *lw,
                         const float *x, int64_t T, float *y, float *scratch) {
    K3_TRY(k3_moe_check_config(c));
    if (T <= 0) return K3_OK;
    if ((uintptr_t)scratch % 8 != 0)
        return K3_ERR(K3_ERR_ARG, "MoE forward: scratch must be 8-byte aligned (k3_alloc)");
    const int K = c->n_experts_per_tok;
    const int64_t Lw = k3_moe_row_width(c), D = c->hidden_size;
    size_t off = 0;
    int32_t *ids = (int32_t *)(void *)(scratch + off);
    off += pad16((size_t)T * (size_t)K);
    float *w = scratch + off;
    off += pad16((size_t)T * (size_t)K);
    float *work = scratch + off;
    K3_TRY(k3_moe_route(ops, c, lw, x, T, ids, w, work));

    const int64_t Tmax = K3_MIN(T, (int64_t)MOE_TOKEN_TILE);
    float *r = work;
    float *eo = r + pad16((size_t)(Tmax * Lw));
    float *tail = eo + pad16((size_t)(Tmax * K * Lw));
    for (int64_t t0 = 0; t0 < T; t0 += Tmax) {
        const int64_t Tc = K3_MIN(Tmax, T - t0);
        const float *src = x + t0 * D; /* no latent: the experts read x itself */
        if (c->latent_size > 0) {
            K3_TRY(k3_moe_down(ops, c, lw, x + t0 * D, Tc, r));
            src = r;
        }
        /* slot row t·K + k reads src[t]: the same bytes k3_moe_expand_rows would copy */
        K3_TRY(expert_rows(ops, c, lw, src, K, ids + t0 * K, Tc * K, eo, tail));
        K3_TRY(k3_moe_finish(ops, c, lw, x + t0 * D, w + t0 * K, eo, Tc, y + t0 * D, tail));
    }
    return K3_OK;
}
