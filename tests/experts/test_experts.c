/* test_experts.c — the latent MoE (experts/) against float64 computations written here from
 * K3-MODEL.md §4.3 and §7.1 (own MXFP4 decode, own SiTU, own sort-based top-k), never against
 * k3's own output. Covers: the moe_topk op (the router's selection) with exact ties (grid-valued
 * scores) in experts and group sums, the full router through a backend, experts with zero
 * tokens, all tokens to one expert, K = 1, bitwise row independence of k3_moe_expert_rows (a row
 * alone vs inside batches of 37 and 600 rows; row_of indirection vs copied rows), the whole layer
 * (latent K3 form and the Kimi-Linear form) vs float64, k3_moe_forward == router → down → expert
 * rows (row_of = i/K) → rows_wsum → finish by hand (bitwise), thread-count invariance, error
 * paths naming row / expert / config key (the forward's too: an expert not loaded, misshapen),
 * scratch sizes and guard bands, and the whole layer on the guard backend (weights and
 * activations in PROT_NONE memory: any host loop over them in experts/ faults) == the cpu
 * backend, bit for bit, with no host sync and the same op calls whatever T and the routing.
 * Runs every check for each host backend (ref, cpu), then the guard check. Seed printed; inputs
 * checked non-degenerate. */
#include <float.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "k3_experts.h"
#include "k3_kernels.h"
#include "k3_test.h"
#include "k3_tiny.h"
#include "tolerances.h"

#define SEED  20261129ull
#define GUARD 64 /* guard floats after every scratch buffer */
/* A routing decided by a float64 score gap below this may legitimately differ in fp32: such
 * tokens are "ambiguous" and skipped (and counted). Derived in tests/tolerances.h. */
#define NEAR_TIE K3_TOL_ROUTER_NEAR_TIE

/* ---- synthetic weights --------------------------------------------------------------------- */
typedef struct {
    k3_config cfg;
    k3_layer_w lw;
    k3_expert_w *ex;
    void *bufs[256];
    int n_bufs;
} moe_model;

static void *mm_alloc(moe_model *m, size_t n) {
    void *p = calloc(1, n ? n : 1);
    if (!p) abort();
    m->bufs[m->n_bufs++] = p;
    return p;
}

static void mk_bf16(moe_model *m, k3_rng *r, k3_tensor *t, int64_t out, int64_t in, float std) {
    memset(t, 0, sizeof *t);
    t->dtype = K3_DT_BF16;
    t->ndim = in > 0 ? 2 : 1;
    t->shape[0] = out;
    t->shape[1] = in;
    int64_t n = out * (in > 0 ? in : 1);
    uint16_t *d = mm_alloc(m, (size_t)n * 2);
    for (int64_t i = 0; i < n; i++) d[i] = k3_f32_to_bf16(std * k3_rng_normal(r));
    t->data = d;
}

static void mk_f32(moe_model *m, k3_rng *r, k3_tensor *t, int64_t n, float std, float mean) {
    memset(t, 0, sizeof *t);
    t->dtype = K3_DT_F32;
    t->ndim = 1;
    t->shape[0] = n;
    float *d = mm_alloc(m, (size_t)n * 4);
    for (int64_t i = 0; i < n; i++) d[i] = mean + std * k3_rng_normal(r);
    t->data = d;
}

/* MXFP4: random codes, E8M0 scales in [e_lo, e_lo + 2]. */
static void mk_mxfp4(moe_model *m, k3_rng *r, k3_tensor *t, int64_t out, int64_t in, int e_lo) {
    memset(t, 0, sizeof *t);
    t->dtype = K3_DT_MXFP4;
    t->ndim = 2;
    t->shape[0] = out;
    t->shape[1] = in;
    uint8_t *p = mm_alloc(m, (size_t)(out * in / 2));
    uint8_t *s = mm_alloc(m, (size_t)(out * in / 32));
    for (int64_t i = 0; i < out * in / 2; i++) p[i] = (uint8_t)(k3_rng_u64(r) & 0xff);
    for (int64_t i = 0; i < out * in / 32; i++) s[i] = (uint8_t)(e_lo + (int)(k3_rng_u64(r) % 3));
    t->data = p;
    t->scale = s;
}

typedef struct {
    int D, E, K, G, TG, I, L, n_shared;
    bool mxfp4, renorm, use_norm;
    float scale;
    k3_act act;
} moe_shape;

static void model_make(moe_model *m, const moe_shape *sh, uint64_t seed) {
    memset(m, 0, sizeof *m);
    k3_config *c = &m->cfg;
    c->hidden_size = sh->D;
    c->rms_norm_eps = 1e-5f;
    c->act = sh->act;
    c->situ_beta = 4.0f;
    c->situ_linear_beta = 25.0f;
    c->n_experts = sh->E;
    c->n_experts_per_tok = sh->K;
    c->n_group = sh->G;
    c->topk_group = sh->TG;
    c->n_shared_experts = sh->n_shared;
    c->moe_intermediate_size = sh->I;
    c->latent_size = sh->L;
    c->latent_moe_use_norm = sh->use_norm;
    c->moe_renormalize = sh->renorm;
    c->routed_scaling_factor = sh->scale;
    c->experts_mxfp4 = sh->mxfp4;
    c->first_k_dense_replace = 0;
    c->moe_layer_freq = 1;
    k3_rng r;
    k3_rng_seed(&r, seed);
    k3_layer_w *lw = &m->lw;
    lw->present = true;
    const int D = sh->D, Lw = sh->L > 0 ? sh->L : sh->D, S = sh->n_shared * sh->I;
    mk_bf16(m, &r, &lw->router, sh->E, D, 1.0f / sqrtf((float)D));
    mk_f32(m, &r, &lw->router_bias, sh->E, 0.05f, 0.0f);
    if (sh->L > 0) {
        mk_bf16(m, &r, &lw->lat_down, sh->L, D, 1.0f / sqrtf((float)D));
        mk_bf16(m, &r, &lw->lat_norm, sh->L, 0, 0.2f);
        uint16_t *wn = lw->lat_norm.data; /* around 1, like a trained norm */
        for (int i = 0; i < sh->L; i++) wn[i] = k3_f32_to_bf16(1.0f + k3_bf16_to_f32(wn[i]));
        mk_bf16(m, &r, &lw->lat_up, D, sh->L, 1.0f / sqrtf((float)sh->L));
    }
    if (S > 0) {
        mk_bf16(m, &r, &lw->sh_gate, S, D, 1.0f / sqrtf((float)D));
        mk_bf16(m, &r, &lw->sh_up, S, D, 1.0f / sqrtf((float)D));
        mk_bf16(m, &r, &lw->sh_down, D, S, 1.0f / sqrtf((float)S));
    }
    m->ex = mm_alloc(m, sizeof(k3_expert_w) * (size_t)sh->E);
    for (int e = 0; e < sh->E; e++) {
        k3_expert_w *ew = &m->ex[e];
        ew->present = true;
        if (sh->mxfp4) {
            mk_mxfp4(m, &r, &ew->w1, sh->I, Lw, 122);
            mk_mxfp4(m, &r, &ew->w3, sh->I, Lw, 122);
            mk_mxfp4(m, &r, &ew->w2, Lw, sh->I, 122);
        } else {
            mk_bf16(m, &r, &ew->w1, sh->I, Lw, 1.0f / sqrtf((float)Lw));
            mk_bf16(m, &r, &ew->w3, sh->I, Lw, 1.0f / sqrtf((float)Lw));
            mk_bf16(m, &r, &ew->w2, Lw, sh->I, 1.0f / sqrtf((float)sh->I));
        }
    }
    lw->experts = m->ex;
}

static void model_free(moe_model *m) {
    for (int i = 0; i < m->n_bufs; i++) free(m->bufs[i]);
    m->n_bufs = 0;
}

/* ---- float64 reference (independent decode, from the spec) ----------------------------------- */
static double e2m1(int code) {
    static const double v[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
    return (code & 8) ? -v[code & 7] : v[code & 7];
}

/* element (o, i) of a BF16 / F32 / MXFP4 weight, as double */
static double wget(const k3_tensor *t, int64_t o, int64_t i) {
    int64_t in = t->ndim >= 2 ? t->shape[1] : 0;
    int64_t idx = t->ndim >= 2 ? o * in + i : o;
    switch (t->dtype) {
    case K3_DT_F32:
        return ((const float *)t->data)[idx];
    case K3_DT_BF16: {
        uint32_t u = (uint32_t)((const uint16_t *)t->data)[idx] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    case K3_DT_MXFP4: {
        uint8_t b = ((const uint8_t *)t->data)[o * (in / 2) + i / 2];
        int code = (i % 2 == 0) ? (b & 0x0f) : (b >> 4); /* low nibble = even element (§7.1) */
        int e = t->scale[o * (in / 32) + i / 32];
        return e2m1(code) * pow(2.0, e - 127);
    }
    default:
        abort();
    }
}

static void dmatvec(const k3_tensor *W, const double *x, double *y) {
    for (int64_t o = 0; o < W->shape[0]; o++) {
        double a = 0;
        for (int64_t i = 0; i < W->shape[1]; i++) a += wget(W, o, i) * x[i];
        y[o] = a;
    }
}

static double dsig(double z) {
    return 1.0 / (1.0 + exp(-z));
}

static double dact(const k3_config *c, double g, double u) {
    if (c->act == K3_ACT_SWIGLU) return g * dsig(g) * u;
    double b = c->situ_beta, l = c->situ_linear_beta;
    double up = l > 0 ? l * tanh(u / l) : u;
    return b * tanh(g / b) * dsig(g) * up;
}

/* Sort idx[0..n) by (key desc, idx asc): insertion sort (stable), O(n²) — brute force on purpose.
 */
static void sort_desc(const double *key, int *idx, int n) {
    for (int i = 1; i < n; i++) {
        int v = idx[i], j = i - 1;
        while (j >= 0 && key[idx[j]] < key[v]) {
            idx[j + 1] = idx[j];
            j--;
        }
        idx[j + 1] = v;
    }
}

/* Reference selection from float64 scores s and biased scores sb; also returns the smallest
 * gap that decides the result (group boundary, expert boundary, slot order) in *gap. */
static void ref_select(const k3_config *c, const double *s, const double *sb, int32_t *ids,
                       double *w, double *gap) {
    const int E = c->n_experts, K = c->n_experts_per_tok, G = c->n_group, gsz = E / G;
    double gscore[4096] = {0};
    int gidx[4096], eidx[4096], keep[4096];
    *gap = INFINITY;
    for (int g = 0; g < G; g++) {
        int loc[4096];
        for (int i = 0; i < gsz; i++) loc[i] = g * gsz + i;
        sort_desc(sb, loc, gsz);
        gscore[g] = gsz >= 2 ? sb[loc[0]] + sb[loc[1]] : sb[loc[0]];
        gidx[g] = g;
        keep[g] = 0;
    }
    sort_desc(gscore, gidx, G);
    for (int j = 0; j < c->topk_group; j++) keep[gidx[j]] = 1;
    if (G > 1 && c->topk_group < G)
        *gap = fmin(*gap, gscore[gidx[c->topk_group - 1]] - gscore[gidx[c->topk_group]]);
    int n = 0;
    for (int e = 0; e < E; e++)
        if (keep[e / gsz]) eidx[n++] = e;
    sort_desc(sb, eidx, n);
    for (int k = 0; k < K; k++) {
        ids[k] = eidx[k];
        if (k + 1 < n) *gap = fmin(*gap, sb[eidx[k]] - sb[eidx[k + 1]]);
    }
    double sum = 0;
    for (int k = 0; k < K; k++) sum += s[ids[k]];
    for (int k = 0; k < K; k++) {
        w[k] = s[ids[k]];
        if (c->moe_renormalize) w[k] /= (sum + 1e-20);
        w[k] *= c->routed_scaling_factor;
    }
}

/* Whole MoE for one token in float64; returns the chosen ids (and decision gap). */
static void ref_moe_token(const moe_model *m, const float *xf, double *y, int32_t *ids,
                          double *gap) {
    const k3_config *c = &m->cfg;
    const k3_layer_w *lw = &m->lw;
    const int D = (int)c->hidden_size, E = c->n_experts, K = c->n_experts_per_tok,
              I = c->moe_intermediate_size;
    const int Lw = c->latent_size > 0 ? c->latent_size : D, S = c->n_shared_experts * I;
    double *x = calloc((size_t)D, 8), *z = calloc((size_t)E, 8), *sb = calloc((size_t)E, 8);
    double *r = calloc((size_t)Lw, 8), *acc = calloc((size_t)Lw, 8), *o = calloc((size_t)Lw, 8);
    double *g = calloc((size_t)(I > S ? I : S) + 1, 8), *u = calloc((size_t)(I > S ? I : S) + 1, 8);
    double *sh = calloc((size_t)D, 8), w[64];
    for (int d = 0; d < D; d++) x[d] = xf[d];
    dmatvec(&lw->router, x, z);
    for (int e = 0; e < E; e++) {
        z[e] = dsig(z[e]);
        sb[e] = z[e] + (lw->router_bias.data ? wget(&lw->router_bias, e, 0) : 0.0);
    }
    ref_select(c, z, sb, ids, w, gap);
    if (c->latent_size > 0)
        dmatvec(&lw->lat_down, x, r);
    else
        memcpy(r, x, (size_t)D * 8);
    for (int i = 0; i < Lw; i++) acc[i] = 0;
    for (int k = 0; k < K; k++) {
        const k3_expert_w *ew = &lw->experts[ids[k]];
        dmatvec(&ew->w1, r, g);
        dmatvec(&ew->w3, r, u);
        for (int i = 0; i < I; i++) g[i] = dact(c, g[i], u[i]);
        dmatvec(&ew->w2, g, o);
        for (int i = 0; i < Lw; i++) acc[i] += w[k] * o[i];
    }
    if (c->latent_size > 0) {
        if (c->latent_moe_use_norm) {
            double ss = 0;
            for (int i = 0; i < Lw; i++) ss += acc[i] * acc[i];
            double rs = 1.0 / sqrt(ss / Lw + (double)c->rms_norm_eps);
            for (int i = 0; i < Lw; i++) acc[i] = wget(&lw->lat_norm, i, 0) * acc[i] * rs;
        }
        dmatvec(&lw->lat_up, acc, y);
    } else {
        memcpy(y, acc, (size_t)D * 8);
    }
    if (S > 0) {
        dmatvec(&lw->sh_gate, x, g);
        dmatvec(&lw->sh_up, x, u);
        for (int i = 0; i < S; i++) g[i] = dact(c, g[i], u[i]);
        dmatvec(&lw->sh_down, g, sh);
        for (int d = 0; d < D; d++) y[d] += sh[d];
    }
    free(x), free(z), free(sb), free(r), free(acc), free(o), free(g), free(u), free(sh);
}

/* ---- scratch with a guard band ----------------------------------------------------------------
 */
/* Float scratch of n floats + GUARD NaN floats, 64-byte aligned like a backend buffer. */
static float *scratch_new(size_t n) {
    size_t bytes = ((n + GUARD) * sizeof(float) + 63) / 64 * 64;
    float *p = aligned_alloc(64, bytes);
    if (!p) abort();
    for (size_t i = 0; i < n + GUARD; i++) p[i] = NAN;
    return p;
}
static bool guard_ok(const float *p, size_t n) {
    for (size_t i = n; i < n + GUARD; i++)
        if (!isnan(p[i])) return false;
    return true;
}
static void poison(float *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = NAN;
}

/* Host int64 scratch of n + GUARD entries, all HSENT; the band must stay HSENT. */
#define HSENT ((int64_t)0x5a5a5a5a5a5a5a5bll)
static int64_t *hscratch_new(size_t n) {
    int64_t *p = malloc((n + GUARD) * sizeof(int64_t));
    if (!p) abort();
    for (size_t i = 0; i < n + GUARD; i++) p[i] = HSENT;
    return p;
}
static bool hguard_ok(const int64_t *p, size_t n) {
    for (size_t i = n; i < n + GUARD; i++)
        if (p[i] != HSENT) return false;
    return true;
}

static void randn(k3_rng *r, float *x, size_t n, float std) {
    for (size_t i = 0; i < n; i++) x[i] = std * k3_rng_normal(r);
}

/* ---- tests ------------------------------------------------------------------------------------
 */

/* The moe_topk op on grid-valued scores: many exact ties in expert scores and group sums, vs the
 * float64 brute force; scores are read-only; hand cases; errors. */
static void test_topk_ties(k3_backend *be) {
    k3_config c;
    memset(&c, 0, sizeof c);
    const int E = 16, T = 400, K = 4;
    c.n_experts = E;
    c.n_experts_per_tok = K;
    c.n_group = 4;
    c.topk_group = 2;
    c.moe_intermediate_size = 8;
    c.moe_renormalize = true;
    c.routed_scaling_factor = 2.5f;
    k3_rng r;
    k3_rng_seed(&r, SEED + 1);
    float *s = malloc(sizeof(float) * T * E), *s_copy = malloc(sizeof(float) * T * E);
    float bias[16];
    float *work = scratch_new((size_t)T * E);
    int32_t *ids = malloc(sizeof(int32_t) * T * K);
    float *w = malloc(sizeof(float) * T * K);
    int ties_e = 0, ties_g = 0, mism = 0;
    for (int variant = 0; variant < 3; variant++) {
        if (variant == 1) c.moe_renormalize = false;
        if (variant == 2) { /* plain top-k, no bias */
            c.n_group = 1;
            c.topk_group = 1;
            c.moe_renormalize = true;
            c.routed_scaling_factor = 1.0f;
        }
        const bool use_bias = variant < 2;
        for (int i = 0; i < T * E; i++)
            s[i] = (float)(k3_rng_u64(&r) % 9) / 8.0f; /* {0, 1/8, ..., 1} */
        for (int e = 0; e < E; e++)                    /* bias in {-1/8, 0, 1/8}: sums exact */
            bias[e] = use_bias ? (float)((int)(k3_rng_u64(&r) % 3) - 1) / 8.0f : 0.0f;
        memcpy(s_copy, s, sizeof(float) * T * E);
        for (int i = 0; i < T * K; i++) ids[i] = -7;
        poison(w, (size_t)T * K);
        K3_CHECK_OK(be->ops->moe_topk(be, s, use_bias ? bias : NULL, T, E, K, c.n_group,
                                      c.topk_group, c.moe_renormalize, c.routed_scaling_factor,
                                      work, ids, w));
        K3_CHECK(memcmp(s, s_copy, sizeof(float) * T * E) == 0,
                 "%s variant %d: moe_topk wrote its (const) scores", be->name, variant);
        K3_CHECK(guard_ok(work, (size_t)T * E), "%s: moe_topk wrote past its work [T, E]",
                 be->name);
        for (int t = 0; t < T; t++) {
            double ds[16], db[16], rw[16], gap;
            int32_t rid[16];
            for (int e = 0; e < E; e++) ds[e] = s[t * E + e], db[e] = ds[e] + bias[e];
            ref_select(&c, ds, db, rid, rw, &gap);
            if (gap == 0.0) ties_e++;
            for (int k = 0; k < K; k++) {
                if (ids[t * K + k] != rid[k]) mism++;
                K3_CHECK(fabs(w[t * K + k] - rw[k]) <= 4 * K3_FP32_U * fabs(rw[k]) + 1e-30,
                         "%s variant %d token %d slot %d weight %g vs %g", be->name, variant, t, k,
                         (double)w[t * K + k], rw[k]);
            }
        }
        /* ties across groups: equal group sums happen on this grid — verify directly */
        if (c.n_group > 1) {
            for (int t = 0; t < T; t++) {
                double gs[4];
                for (int g = 0; g < 4; g++) {
                    double a = -1e9, bb = -1e9;
                    for (int i = 0; i < 4; i++) {
                        double v = (double)s[t * E + g * 4 + i] + bias[g * 4 + i];
                        if (v > a) {
                            bb = a;
                            a = v;
                        } else if (v > bb)
                            bb = v;
                    }
                    gs[g] = a + bb;
                }
                for (int g = 0; g < 4; g++)
                    for (int h = g + 1; h < 4; h++)
                        if (gs[g] == gs[h]) {
                            ties_g++;
                            g = 4;
                            break;
                        }
            }
        }
    }
    K3_CHECK(mism == 0, "%s: %d slot ids differ from the float64 brute force", be->name, mism);
    K3_CHECK(ties_e > 50,
             "grid produced only %d tokens with an exact expert tie (degenerate input)", ties_e);
    K3_CHECK(ties_g > 50, "grid produced only %d tokens with an exact group tie (degenerate input)",
             ties_g);
    printf("topk[%s]: %d tokens with exact expert ties, %d with group ties\n", be->name, ties_e,
           ties_g);
    /* a hand case: all equal -> experts 0..3 (groups 0 and 1 kept, lowest indices) */
    for (int e = 0; e < E; e++) s[e] = 0.5f;
    K3_CHECK_OK(be->ops->moe_topk(be, s, NULL, 1, E, K, 4, 2, true, 1.0f, work, ids, w));
    K3_CHECK(ids[0] == 0 && ids[1] == 1 && ids[2] == 2 && ids[3] == 3, "all-equal -> %d %d %d %d",
             ids[0], ids[1], ids[2], ids[3]);
    /* hand case: group 3 holds the best single expert but group sums prefer groups 0 and 2 */
    for (int e = 0; e < E; e++) s[e] = 0.1f;
    s[15] = 0.9f;               /* group 3: 0.9 + 0.1 = 1.0 */
    s[0] = 0.6f, s[1] = 0.6f;   /* group 0: 1.2 */
    s[9] = 0.55f, s[10] = 0.5f; /* group 2: 1.05 */
    K3_CHECK_OK(be->ops->moe_topk(be, s, NULL, 1, E, K, 4, 2, true, 1.0f, work, ids, w));
    K3_CHECK(ids[0] == 0 && ids[1] == 1 && ids[2] == 9 && ids[3] == 10,
             "grouped hand case -> %d %d %d %d", ids[0], ids[1], ids[2], ids[3]);
    /* the bias selects, the weights stay unbiased: 0.1 + 0.6 lifts expert 3 above experts 0, 1 */
    for (int e = 0; e < E; e++) bias[e] = 0.0f;
    bias[3] = 0.6f;
    K3_CHECK_OK(be->ops->moe_topk(be, s, bias, 1, E, K, 4, 2, false, 1.0f, work, ids, w));
    K3_CHECK(ids[0] == 3 && ids[1] == 0 && ids[2] == 1 && ids[3] == 9 && w[0] == s[3],
             "biased hand case -> %d %d %d %d, w0 %g (want 3 0 1 9, w0 = sigma = %g)", ids[0],
             ids[1], ids[2], ids[3], (double)w[0], (double)s[3]);
    /* a non-finite router score is its token's fault, not the step's (k3_kernels.h): that token
       gets experts 0..K-1 with NaN weights, so the step's non-finite check fails its sequence
       alone; every other token is routed as usual (T = 400: the cpu backend's pooled path for
       the first 256 tokens) */
    for (int i = 0; i < T * E; i++) s[i] = 0.25f;
    s[300 * E + 7] = NAN;
    s[200 * E + 3] = NAN;
    K3_CHECK_OK(be->ops->moe_topk(be, s, NULL, T, E, K, 4, 2, true, 1.0f, work, ids, w));
    for (int t = 0; t < T; t++) {
        const bool bad = t == 200 || t == 300;
        int nan_w = 0, first_ids = 0;
        for (int k = 0; k < K; k++) nan_w += isnan(w[t * K + k]), first_ids += ids[t * K + k] == k;
        K3_CHECK(bad ? nan_w == K && first_ids == K : nan_w == 0,
                 "non-finite score: token %d (%s) has %d NaN weights", t, bad ? "bad" : "good",
                 nan_w);
    }
    s[200 * E + 3] = 0.25f;
    s[300 * E + 7] = 0.25f;
    bias[5] = INFINITY; /* a bad bias: every token's biased score */
    K3_CHECK_OK(be->ops->moe_topk(be, s, bias, 3, E, K, 4, 2, true, 1.0f, work, ids, w));
    for (int i = 0; i < 3 * K; i++)
        K3_CHECK(isnan(w[i]) && ids[i] == i % K, "infinite bias: weight %d = %g, id %d", i,
                 (double)w[i], ids[i]);
    bias[5] = 0.0f;
    /* an impossible selection is an argument error of the op (the config keys are checked by
       k3_moe_router: test_route) */
    K3_CHECK_ERR(be->ops->moe_topk(be, s, NULL, 1, E, 5, 4, 1, true, 1.0f, work, ids, w),
                 K3_ERR_ARG, "K=5 n_group=4 topk_group=1");
    K3_CHECK_ERR(be->ops->moe_topk(be, s, NULL, 1, E, K, 3, 1, true, 1.0f, work, ids, w),
                 K3_ERR_ARG, "n_group=3");
    free(s), free(s_copy), free(work), free(ids), free(w);
}

/* The full router (matmul + sigmoid + bias + grouped top-k) vs float64, plus exact ties made by
 * duplicated router rows and biases; config errors name the config key. */
static void test_route(k3_backend *be) {
    moe_shape sh = {.D = 96,
                    .E = 16,
                    .K = 4,
                    .G = 4,
                    .TG = 2,
                    .I = 32,
                    .L = 64,
                    .n_shared = 1,
                    .mxfp4 = true,
                    .renorm = true,
                    .use_norm = true,
                    .scale = 2.5f,
                    .act = K3_ACT_SITU};
    moe_model m;
    model_make(&m, &sh, SEED + 2);
    /* experts 5 and 6 identical (same group 1) and 12 identical to 4 (groups 3 vs 1): exact ties */
    uint16_t *rw = m.lw.router.data;
    float *rb = m.lw.router_bias.data;
    memcpy(rw + 6 * 96, rw + 5 * 96, 96 * 2);
    rb[6] = rb[5];
    memcpy(rw + 12 * 96, rw + 4 * 96, 96 * 2);
    rb[12] = rb[4];
    const int T = 300;
    k3_rng r;
    k3_rng_seed(&r, SEED + 3);
    float *x = malloc(sizeof(float) * T * 96);
    randn(&r, x, (size_t)T * 96, 1.0f);
    size_t ns = k3_moe_scratch_floats(&m.cfg, T);
    K3_CHECK(ns >= (size_t)T * 16 * 2, "scratch %zu < T*E*2", ns);
    float *scr = scratch_new(ns);
    int32_t *ids = malloc(sizeof(int32_t) * T * 4);
    float *w = malloc(sizeof(float) * T * 4);
    poison(w, (size_t)T * 4);
    K3_CHECK_OK(k3_moe_router(be, &m.cfg, &m.lw, x, T, ids, w, scr));
    K3_CHECK(guard_ok(scr, ns), "router wrote past its scratch");
    int ambiguous = 0, bad = 0, both56 = 0, used[16] = {0};
    for (int t = 0; t < T; t++) {
        double gap, rwt[16];
        int32_t rid[16];
        double ds[16], db[16], z[16], xd[96];
        for (int d = 0; d < 96; d++) xd[d] = x[t * 96 + d];
        dmatvec(&m.lw.router, xd, z);
        for (int e = 0; e < 16; e++) ds[e] = dsig(z[e]), db[e] = ds[e] + rb[e];
        ref_select(&m.cfg, ds, db, rid, rwt, &gap);
        bool same = true;
        for (int k = 0; k < 4; k++) same = same && ids[t * 4 + k] == rid[k];
        bool amb =
            gap > 0 && gap < NEAR_TIE; /* an fp32 rounding could legitimately flip this token */
        if (amb) ambiguous++;
        if (!same && !amb) bad++;
        if (same) {
            for (int k = 0; k < 4; k++) {
                K3_CHECK(fabs(w[t * 4 + k] - rwt[k]) <= K3_TOL_MOE_F64_REL_L2 * fabs(rwt[k]),
                         "token %d slot %d w %g vs %g", t, k, (double)w[t * 4 + k], rwt[k]);
            }
        }
        int has5 = 0, has6 = 0;
        for (int k = 0; k < 4; k++) {
            used[ids[t * 4 + k]]++;
            if (ids[t * 4 + k] == 5) has5 = k + 1;
            if (ids[t * 4 + k] == 6) has6 = k + 1;
        }
        if (has6) {
            K3_CHECK(has5 && has5 == has6 - 1,
                     "token %d: tied experts 5/6 in slots %d/%d (5 must come first)", t, has5 - 1,
                     has6 - 1);
            both56++;
        }
        double wsum = 0;
        for (int k = 0; k < 4; k++) wsum += w[t * 4 + k];
        K3_CHECK(fabs(wsum - 2.5) < K3_TOL_MOE_F64_REL_L2,
                 "token %d weights sum %g, want routed_scaling_factor 2.5", t, wsum);
    }
    K3_CHECK(bad == 0, "%s: %d tokens route differently from float64 without being ambiguous",
             be->name, bad);
    K3_CHECK(ambiguous <= T / 50, "%d ambiguous tokens (too many near-ties: degenerate input?)",
             ambiguous);
    K3_CHECK(both56 > 5,
             "the tied pair 5/6 was chosen together only %d times (test not exercising ties)",
             both56);
    int n_used = 0;
    for (int e = 0; e < 16; e++) n_used += used[e] > 0;
    K3_CHECK(n_used >= 12, "only %d experts ever used (degenerate router)", n_used);
    printf("route[%s]: %d ambiguous tokens, tie pair chosen %d times, %d experts used\n", be->name,
           ambiguous, both56, n_used);
    /* config errors name the config key (K3_ERR_CONFIG), missing / misshapen router tensors
       name the tensor */
    k3_config keep = m.cfg;
    m.cfg.topk_group = 1;
    m.cfg.n_experts_per_tok = 5; /* one group of 4 cannot supply 5 */
    K3_CHECK_ERR(k3_moe_router(be, &m.cfg, &m.lw, x, 1, ids, w, scr), K3_ERR_CONFIG,
                 "num_experts_per_token = 5");
    m.cfg = keep;
    m.cfg.n_group = 3;
    m.cfg.topk_group = 1;
    K3_CHECK_ERR(k3_moe_router(be, &m.cfg, &m.lw, x, 1, ids, w, scr), K3_ERR_CONFIG,
                 "num_expert_group = 3");
    m.cfg = keep;
    m.cfg.topk_group = 5;
    K3_CHECK_ERR(k3_moe_router(be, &m.cfg, &m.lw, x, 1, ids, w, scr), K3_ERR_CONFIG,
                 "topk_group = 5");
    m.cfg = keep;
    m.lw.router_bias.shape[0] = 15;
    K3_CHECK_ERR(k3_moe_router(be, &m.cfg, &m.lw, x, 1, ids, w, scr), K3_ERR_SHAPE,
                 "e_score_correction_bias has 15 elements");
    m.lw.router_bias.shape[0] = 16;
    void *keep_router = m.lw.router.data;
    m.lw.router.data = NULL;
    K3_CHECK_ERR(k3_moe_router(be, &m.cfg, &m.lw, x, 1, ids, w, scr), K3_ERR_MISSING,
                 "block_sparse_moe.gate.weight");
    m.lw.router.data = keep_router;
    free(x), free(scr), free(ids), free(w);
    model_free(&m);
}

/* The layer of the expert-rows and forward-error tests: D 96, 16 experts top-4 in 4 groups (2
 * kept), I 32, latent 64, one shared expert, SiTU. */
static moe_shape rows_shape(bool mxfp4) {
    return (moe_shape){.D = 96,
                       .E = 16,
                       .K = 4,
                       .G = 4,
                       .TG = 2,
                       .I = 32,
                       .L = 64,
                       .n_shared = 1,
                       .mxfp4 = mxfp4,
                       .renorm = true,
                       .use_norm = true,
                       .scale = 1.0f,
                       .act = K3_ACT_SITU};
}

/* Expert rows vs float64; a row alone vs inside batches (bitwise); row_of indirection vs the rows
 * copied out (bitwise); zero-token experts; one expert for every row; missing experts and bad
 * ids (errors name the row and the expert). */
static void test_rows(k3_backend *be, bool mxfp4) {
    moe_shape sh = rows_shape(mxfp4);
    moe_model m;
    model_make(&m, &sh, SEED + 4);
    const int Lw = 64, I = 32, N = 600, NS = 37 * 4; /* NS <= N: 37 tokens × 4 slots */
    const char *wt = mxfp4 ? "mxfp4" : "bf16";
    k3_rng r;
    k3_rng_seed(&r, SEED + 5);
    float *rows = malloc(sizeof(float) * N * Lw), *out = malloc(sizeof(float) * N * Lw);
    float *one = malloc(sizeof(float) * Lw);
    int32_t *ex = malloc(sizeof(int32_t) * N);
    randn(&r, rows, (size_t)N * Lw, 1.0f);
    /* 37 rows over experts {0..5} (experts 6..15 get zero rows), then 563 rows all to expert 3 */
    for (int i = 0; i < N; i++) ex[i] = i < 37 ? (int32_t)(k3_rng_u64(&r) % 6) : 3;
    /* sized for the largest call (N rows); a guard band after each */
    size_t ns = k3_moe_rows_scratch_floats(&m.cfg, N), nh = k3_moe_rows_host_ints(&m.cfg, N);
    float *scr = scratch_new(ns);
    int64_t *hs = hscratch_new(nh);
    /* batch of 37 */
    poison(out, (size_t)N * Lw);
    K3_CHECK_OK(k3_moe_expert_rows(be, &m.cfg, &m.lw, rows, NULL, ex, 37, out, scr, hs));
    K3_CHECK(guard_ok(scr, ns), "expert_rows wrote past its scratch");
    int bit_bad = 0;
    double num = 0, den = 0;
    for (int i = 0; i < 37; i++) {
        K3_CHECK_OK(
            k3_moe_expert_rows(be, &m.cfg, &m.lw, rows + i * Lw, NULL, ex + i, 1, one, scr, hs));
        if (memcmp(one, out + i * Lw, sizeof(float) * Lw) != 0) bit_bad++;
        /* float64 */
        double rd[64], g[32], u[32], o[64];
        for (int d = 0; d < Lw; d++) rd[d] = rows[i * Lw + d];
        dmatvec(&m.ex[ex[i]].w1, rd, g);
        dmatvec(&m.ex[ex[i]].w3, rd, u);
        for (int j = 0; j < I; j++) g[j] = dact(&m.cfg, g[j], u[j]);
        dmatvec(&m.ex[ex[i]].w2, g, o);
        for (int d = 0; d < Lw; d++) {
            double e = out[i * Lw + d] - o[d];
            num += e * e;
            den += o[d] * o[d];
        }
    }
    double rel = sqrt(num / den);
    K3_CHECK(bit_bad == 0, "%s %s: %d of 37 rows differ (bits) between alone and in the batch",
             be->name, wt, bit_bad);
    K3_CHECK(rel <= K3_TOL_MOE_F64_REL_L2, "%s %s: expert rows rel-L2 vs float64 %.3g", be->name,
             wt, rel);
    K3_CHECK(sqrt(den / (37.0 * Lw)) > 0.05, "expert outputs nearly zero (rms %g): degenerate",
             sqrt(den / (37.0 * Lw)));
    /* all 600 rows (563 to expert 3: more than two row tiles of 256) vs alone */
    poison(out, (size_t)N * Lw);
    K3_CHECK_OK(k3_moe_expert_rows(be, &m.cfg, &m.lw, rows, NULL, ex, N, out, scr, hs));
    bit_bad = 0;
    for (int i = 0; i < N; i++) {
        K3_CHECK_OK(
            k3_moe_expert_rows(be, &m.cfg, &m.lw, rows + i * Lw, NULL, ex + i, 1, one, scr, hs));
        if (memcmp(one, out + i * Lw, sizeof(float) * Lw) != 0) bit_bad++;
    }
    K3_CHECK(bit_bad == 0, "%s %s: %d of %d rows differ between alone and a %d-row batch", be->name,
             wt, bit_bad, N, N);
    K3_CHECK(guard_ok(scr, ns), "expert_rows wrote past its scratch (600 rows)");
    /* row_of: out[i] reads src[row_of[i]]. The slot form (row_of[i] = i/4: each source row read
       by 4 rows of different experts) and a permutation, vs the rows copied out, bit for bit. */
    {
        float *cp = malloc(sizeof(float) * N * Lw), *o1 = malloc(sizeof(float) * N * Lw),
              *o2 = malloc(sizeof(float) * N * Lw);
        int64_t *row_of = malloc(sizeof(int64_t) * N);
        int32_t *ex2 = malloc(sizeof(int32_t) * N);
        for (int form = 0; form < 2; form++) {
            const int n = form == 0 ? NS : N;
            for (int i = 0; i < n; i++) {
                row_of[i] = form == 0 ? i / 4 : (i * 37 + 11) % N; /* gcd(37, 600) = 1 */
                ex2[i] = (int32_t)(k3_rng_u64(&r) % 16);
                memcpy(cp + (size_t)i * Lw, rows + row_of[i] * Lw, sizeof(float) * Lw);
            }
            poison(o1, (size_t)N * Lw);
            poison(o2, (size_t)N * Lw);
            K3_CHECK_OK(k3_moe_expert_rows(be, &m.cfg, &m.lw, rows, row_of, ex2, n, o1, scr, hs));
            K3_CHECK_OK(k3_moe_expert_rows(be, &m.cfg, &m.lw, cp, NULL, ex2, n, o2, scr, hs));
            K3_CHECK(memcmp(o1, o2, sizeof(float) * (size_t)n * Lw) == 0,
                     "%s %s: row_of (%s) differs from the copied rows (bits)", be->name, wt,
                     form == 0 ? "i/4" : "permutation");
        }
        K3_CHECK(guard_ok(scr, ns) && hguard_ok(hs, nh),
                 "expert_rows wrote past its scratch (%d rows with row_of)", NS);
        free(cp), free(o1), free(o2), free(row_of), free(ex2);
    }
    /* n = 0 is fine and touches nothing */
    K3_CHECK_OK(k3_moe_expert_rows(be, &m.cfg, &m.lw, rows, NULL, ex, 0, out, scr, hs));
    /* errors name the row and the expert */
    int32_t bad_id[3] = {0, 4, 16};
    K3_CHECK_ERR(k3_moe_expert_rows(be, &m.cfg, &m.lw, rows, NULL, bad_id, 3, out, scr, hs),
                 K3_ERR_ARG, "row 2 has expert id 16");
    bad_id[2] = -1;
    K3_CHECK_ERR(k3_moe_expert_rows(be, &m.cfg, &m.lw, rows, NULL, bad_id, 3, out, scr, hs),
                 K3_ERR_ARG, "row 2 has expert id -1");
    k3_expert_w keep7 = m.ex[7];
    memset(&m.ex[7], 0, sizeof m.ex[7]); /* what a rank that does not own expert 7 holds */
    int32_t e7[2] = {1, 7};
    K3_CHECK_ERR(k3_moe_expert_rows(be, &m.cfg, &m.lw, rows, NULL, e7, 2, out, scr, hs),
                 K3_ERR_MISSING, "row 1 needs expert 7");
    m.ex[7] = keep7;
    m.ex[2].w2.shape[0] = 63;
    int32_t e2 = 2;
    K3_CHECK_ERR(k3_moe_expert_rows(be, &m.cfg, &m.lw, rows, NULL, &e2, 1, out, scr, hs),
                 K3_ERR_SHAPE, "w2 (expert 2) has shape [63, 32]");
    m.ex[2].w2.shape[0] = 64;
    K3_CHECK(hguard_ok(hs, nh), "expert_rows wrote past its host scratch");
    free(rows), free(out), free(one), free(ex), free(scr), free(hs);
    model_free(&m);
}

/* The single-process layer driven by hand, the way k3_moe_forward documents itself: router →
 * down → expert rows (row_of[i] = i/K: slot row t·K + k reads the latent row of token t) →
 * rows_wsum (segments of K slots) → finish. ids/w/r/eo/acc/y are buffers of be. */
static void moe_steps(k3_backend *be, const k3_config *c, const k3_layer_w *lw, const float *x,
                      int T, int32_t *ids, int32_t *ids_host, float *w, float *r, int64_t *row_of,
                      float *eo, float *acc, float *y, float *scr, int64_t *hs) {
    const int K = c->n_experts_per_tok;
    const int64_t Lw = k3_moe_row_width(c);
    K3_CHECK_OK(k3_moe_router(be, c, lw, x, T, ids, w, scr));
    K3_CHECK_OK(k3_backend_download(be, ids_host, ids, sizeof(int32_t) * (size_t)T * K));
    K3_CHECK_OK(k3_moe_down(be, c, lw, x, T, r));
    for (int64_t i = 0; i < (int64_t)T * K; i++) row_of[i] = i / K;
    K3_CHECK_OK(k3_moe_expert_rows(be, c, lw, r, row_of, ids_host, (int64_t)T * K, eo, scr, hs));
    K3_CHECK_OK(be->ops->rows_wsum(be, eo, w, NULL, K, T, Lw, acc));
    K3_CHECK_OK(k3_moe_finish(be, c, lw, x, acc, T, y, scr));
}

/* Whole layer vs float64, forward == the steps by hand (bitwise), thread-count and token-count
 * invariance (bitwise). */
static void test_layer(k3_backend *be, const moe_shape *sh, int T, const char *name) {
    moe_model m;
    model_make(&m, sh, SEED + 6 + (uint64_t)T);
    const k3_config *c = &m.cfg;
    const int D = sh->D, K = sh->K, Lw = sh->L > 0 ? sh->L : sh->D;
    k3_rng r;
    k3_rng_seed(&r, SEED + 7);
    float *x = malloc(sizeof(float) * T * D), *y = malloc(sizeof(float) * T * D),
          *y2 = malloc(sizeof(float) * T * D);
    randn(&r, x, (size_t)T * D, 1.0f);
    size_t ns = k3_moe_scratch_floats(c, T), nh = k3_moe_host_ints(c, T);
    float *scr = scratch_new(ns);
    poison(y, (size_t)T * D);
    K3_CHECK_OK(k3_moe_forward(be, c, &m.lw, x, T, y, scr));
    K3_CHECK(guard_ok(scr, ns), "%s: forward wrote past its scratch", name);
    /* by hand, the whole batch at once (forward tiles tokens: T = 300 spans two tiles), with the
       scratch sizes the header promises for T tokens */
    int32_t *ids = malloc(sizeof(int32_t) * T * K), *ids_h = malloc(sizeof(int32_t) * T * K);
    float *w = malloc(sizeof(float) * T * K);
    float *lat = malloc(sizeof(float) * T * Lw), *eo = malloc(sizeof(float) * T * K * Lw),
          *acc = malloc(sizeof(float) * T * Lw);
    int64_t *row_of = malloc(sizeof(int64_t) * T * K);
    float *scr2 = scratch_new(ns);
    int64_t *hs2 = hscratch_new(nh);
    poison(y2, (size_t)T * D);
    moe_steps(be, c, &m.lw, x, T, ids, ids_h, w, lat, row_of, eo, acc, y2, scr2, hs2);
    K3_CHECK(guard_ok(scr2, ns) && hguard_ok(hs2, nh), "%s: steps wrote past the scratch", name);
    K3_CHECK(memcmp(y, y2, sizeof(float) * T * D) == 0,
             "%s[%s]: forward differs from router→down→rows→rows_wsum→finish (bits)", name,
             be->name);
    /* thread-count invariance (cpu backend): 1 and 3 workers vs the default pool, bit for bit */
    if (strcmp(be->name, "cpu") == 0) {
        for (int nt = 1; nt <= 3; nt += 2) {
            k3_backend *b1 = NULL;
            K3_CHECK_OK(k3_backend_create("cpu", &(k3_backend_params){.n_threads = nt}, &b1));
            if (!b1) continue;
            poison(y2, (size_t)T * D);
            K3_CHECK_OK(k3_moe_forward(b1, c, &m.lw, x, T, y2, scr2));
            K3_CHECK(memcmp(y, y2, sizeof(float) * T * D) == 0,
                     "%s[cpu]: %d threads differ from %d threads (bits)", name,
                     k3_backend_threads(b1), k3_backend_threads(be));
            k3_backend_destroy(b1);
        }
    }
    /* token-count invariance: the last token alone */
    float *y1 = malloc(sizeof(float) * D);
    K3_CHECK_OK(k3_moe_forward(be, c, &m.lw, x + (T - 1) * D, 1, y1, scr2));
    K3_CHECK(memcmp(y1, y + (T - 1) * D, sizeof(float) * D) == 0,
             "%s[%s]: last token alone differs (bits)", name, be->name);
    /* float64 */
    double num = 0, den = 0;
    int amb = 0, bad = 0, used[4096] = {0};
    double *yd = malloc(sizeof(double) * D);
    for (int t = 0; t < T; t++) {
        int32_t rid[64];
        double gap;
        ref_moe_token(&m, x + t * D, yd, rid, &gap);
        bool same = true;
        for (int k = 0; k < K; k++) same = same && rid[k] == ids_h[t * K + k];
        for (int k = 0; k < K; k++) used[ids_h[t * K + k]]++;
        if (!same) {
            if (gap < NEAR_TIE)
                amb++;
            else
                bad++;
            continue;
        }
        for (int d = 0; d < D; d++) {
            double e = y[t * D + d] - yd[d];
            num += e * e;
            den += yd[d] * yd[d];
        }
    }
    double rel = sqrt(num / den);
    int n_used = 0;
    for (int e = 0; e < sh->E; e++) n_used += used[e] > 0;
    printf("layer %s[%s] T=%d: rel-L2 vs float64 %.3g (%d ambiguous tokens skipped), %d experts "
           "used\n",
           name, be->name, T, rel, amb, n_used);
    K3_CHECK(bad == 0, "%s: %d tokens routed differently from float64 (not near-ties)", name, bad);
    K3_CHECK(amb <= T / 50 + 1, "%s: %d ambiguous tokens", name, amb);
    K3_CHECK(rel <= K3_TOL_MOE_F64_REL_L2, "%s[%s]: layer rel-L2 vs float64 %.3g", name, be->name,
             rel);
    K3_CHECK(sqrt(den / ((double)T * D)) > 0.05, "%s: outputs nearly zero: degenerate", name);
    K3_CHECK(n_used >= (sh->E < 8 ? sh->E : 8), "%s: only %d experts used", name, n_used);
    free(x), free(y), free(y2), free(ids), free(ids_h), free(w), free(lat), free(eo), free(acc),
        free(row_of), free(scr), free(scr2), free(hs2), free(y1), free(yd);
    model_free(&m);
}

/* The forward's errors: an expert a row needs that is not loaded names the row and the expert
 * (the moe_experts op reads the ids; the output is not written), no expert table at all, and a
 * misshapen expert (checked against the config whether used or not, before anything runs). */
static void test_forward_errors(k3_backend *be) {
    moe_shape sh = rows_shape(true);
    moe_model m;
    model_make(&m, &sh, SEED + 14);
    const int T = 37, D = 96, K = 4;
    k3_rng r;
    k3_rng_seed(&r, SEED + 15);
    float *x = malloc(sizeof(float) * T * D), *y = malloc(sizeof(float) * T * D);
    randn(&r, x, (size_t)T * D, 1.0f);
    size_t ns = k3_moe_scratch_floats(&m.cfg, T);
    float *scr = scratch_new(ns);
    int32_t ids[37 * 4];
    float w[37 * 4];
    K3_CHECK_OK(k3_moe_router(be, &m.cfg, &m.lw, x, T, ids, w, scr));
    int first7 = -1;
    for (int i = 0; i < T * K && first7 < 0; i++)
        if (ids[i] == 7) first7 = i;
    K3_CHECK(first7 >= 0, "no token routed to expert 7: the test needs one");
    char needle[64];
    snprintf(needle, sizeof needle, "row %d needs expert 7, which is not loaded", first7);
    k3_expert_w keep7 = m.ex[7];
    memset(&m.ex[7], 0, sizeof m.ex[7]); /* what a rank that does not own expert 7 holds */
    for (int i = 0; i < T * D; i++) y[i] = 3.0f;
    K3_CHECK_ERR(k3_moe_forward(be, &m.cfg, &m.lw, x, T, y, scr), K3_ERR_MISSING, needle);
    bool untouched = true;
    for (int i = 0; i < T * D; i++) untouched = untouched && y[i] == 3.0f;
    K3_CHECK(untouched, "%s: a forward that failed wrote its output", be->name);
    m.ex[7] = keep7;
    m.lw.experts = NULL;
    K3_CHECK_ERR(k3_moe_forward(be, &m.cfg, &m.lw, x, T, y, scr), K3_ERR_MISSING,
                 "row 0 needs expert");
    m.lw.experts = m.ex;
    m.ex[11].w2.shape[0] = 63;
    K3_CHECK_ERR(k3_moe_forward(be, &m.cfg, &m.lw, x, T, y, scr), K3_ERR_SHAPE,
                 "w2 (expert 11) has shape [63, 32]");
    m.ex[11].w2.shape[0] = 64;
    K3_CHECK_OK(k3_moe_forward(be, &m.cfg, &m.lw, x, T, y, scr));
    K3_CHECK(guard_ok(scr, ns), "forward errors: scratch overrun");
    /* a token's K slots must fit one tile of the moe_experts op */
    k3_config wide = m.cfg;
    wide.n_experts = 1024, wide.n_experts_per_tok = 300, wide.n_group = 1, wide.topk_group = 1;
    K3_CHECK_ERR(k3_moe_check_config(&wide), K3_ERR_CONFIG, "num_experts_per_token = 300");
    free(x), free(y), free(scr);
    model_free(&m);
}

/* Every token to one expert: a router whose bias makes expert 9 win by far; K = 1. */
static void test_one_expert(k3_backend *be) {
    moe_shape sh = {.D = 64,
                    .E = 16,
                    .K = 1,
                    .G = 1,
                    .TG = 1,
                    .I = 32,
                    .L = 32,
                    .n_shared = 0,
                    .mxfp4 = true,
                    .renorm = true,
                    .use_norm = true,
                    .scale = 1.0f,
                    .act = K3_ACT_SITU};
    moe_model m;
    model_make(&m, &sh, SEED + 8);
    ((float *)m.lw.router_bias.data)[9] = 10.0f;
    const int T = 70, D = 64;
    k3_rng r;
    k3_rng_seed(&r, SEED + 9);
    float *x = malloc(sizeof(float) * T * D), *y = malloc(sizeof(float) * T * D);
    randn(&r, x, (size_t)T * D, 1.0f);
    size_t ns = k3_moe_scratch_floats(&m.cfg, T);
    float *scr = scratch_new(ns);
    int32_t ids[70];
    float w[70];
    K3_CHECK_OK(k3_moe_router(be, &m.cfg, &m.lw, x, T, ids, w, scr));
    int n9 = 0;
    for (int t = 0; t < T; t++)
        n9 += ids[t] == 9 && w[t] == 1.0f; /* K = 1 renormalised: exactly s/(s+1e-20) = 1 */
    K3_CHECK(n9 == T, "K=1: %d of %d tokens routed to expert 9 with weight 1", n9, T);
    K3_CHECK_OK(k3_moe_forward(be, &m.cfg, &m.lw, x, T, y, scr));
    double num = 0, den = 0, yd[64], gap;
    int32_t rid[1];
    for (int t = 0; t < T; t++) {
        ref_moe_token(&m, x + t * D, yd, rid, &gap);
        K3_CHECK(rid[0] == 9, "reference routed token %d to %d", t, rid[0]);
        for (int d = 0; d < D; d++) {
            double e = y[t * D + d] - yd[d];
            num += e * e;
            den += yd[d] * yd[d];
        }
    }
    K3_CHECK(sqrt(num / den) <= K3_TOL_MOE_F64_REL_L2, "one expert: rel-L2 %.3g", sqrt(num / den));
    K3_CHECK(guard_ok(scr, ns), "one expert: scratch overrun");
    free(x), free(y), free(scr);
    model_free(&m);
}

/* The scratch contract of experts/k3_experts.h: k3_moe_scratch_floats(c, T) and
 * k3_moe_host_ints(c, T) are enough for every function called with T tokens, k3_moe_expert_rows
 * with n <= T·K rows included. Checked on the sizes alone, over T that cross the forward's token
 * tile, for the test shapes and the presets. */
static void test_scratch_sizes(void) {
    k3_config cs[4];
    memset(&cs[0], 0, sizeof cs[0]);
    cs[0].hidden_size = 96, cs[0].n_experts = 16, cs[0].n_experts_per_tok = 4, cs[0].n_group = 4;
    cs[0].topk_group = 2, cs[0].moe_intermediate_size = 32, cs[0].latent_size = 64;
    cs[0].n_shared_experts = 2;
    for (int p = 0; p < 3; p++) k3_preset_config((k3_preset)p, &cs[1 + p]);
    const int64_t Ts[] = {1, 37, 255, 256, 257, 300, 1024, 1025, 2048, 8192};
    int bad_f = 0, bad_h = 0;
    for (int i = 0; i < 4; i++) {
        const k3_config *c = &cs[i];
        const int64_t K = c->n_experts_per_tok;
        for (size_t j = 0; j < sizeof Ts / sizeof Ts[0]; j++) {
            const int64_t T = Ts[j];
            size_t f = k3_moe_scratch_floats(c, T), h = k3_moe_host_ints(c, T);
            size_t fr = k3_moe_rows_scratch_floats(c, T * K), hr = k3_moe_rows_host_ints(c, T * K);
            if (f < fr && bad_f++ < 3)
                K3_CHECK(false,
                         "config %d T=%lld: k3_moe_scratch_floats %zu < rows scratch %zu "
                         "for T·K = %lld rows",
                         i, (long long)T, f, fr, (long long)(T * K));
            if (h < hr && bad_h++ < 3)
                K3_CHECK(false,
                         "config %d T=%lld: k3_moe_host_ints %zu < k3_moe_rows_host_ints "
                         "%zu for T·K = %lld rows",
                         i, (long long)T, h, hr, (long long)(T * K));
        }
    }
    K3_CHECK(bad_f == 0 && bad_h == 0,
             "scratch contract: %d float and %d host-int sizes too small (first 3 of each above)",
             bad_f, bad_h);
}
/* The MoE layers of a real tiny checkpoint (k3_make_tiny -> k3_ckpt_open -> k3_weights_load):
 * checks that the loader's conventions (MXFP4 data/scale, BF16 norms, F32 bias, expert table)
 * are the ones experts/ reads, vs the float64 reference. Also: presets pass the MoE config check,
 * and experts not loaded on a rank give a clear error. */
static int rm_cb(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static bool own_even(void *ctx, int layer, int expert) {
    (void)ctx, (void)layer;
    return expert % 2 == 0;
}

static void test_tiny(k3_backend *be) {
    for (int p = 0; p < 3; p++) {
        k3_config pc;
        k3_preset_config((k3_preset)p, &pc);
        K3_CHECK_OK(k3_moe_check_config(&pc));
        K3_CHECK(k3_moe_scratch_floats(&pc, 1) > 0, "preset %d: zero scratch", p);
    }
    char dir[] = "/tmp/k3_experts_tiny_XXXXXX";
    if (!mkdtemp(dir)) {
        K3_CHECK(false, "mkdtemp failed");
        return;
    }
    k3_ckpt *ck = NULL;
    k3_weights *wts = NULL, *half = NULL;
    k3_config c;
    K3_CHECK_OK(k3_make_tiny(dir, K3_PRESET_TINY, 1));
    K3_CHECK_OK(k3_config_load(dir, &c));
    K3_CHECK_OK(k3_ckpt_open(dir, &ck));
    k3_load_sel sel = {.layer_begin = 0, .layer_end = c.n_layers};
    if (ck) K3_CHECK_OK(k3_weights_load(ck, &c, &sel, &wts));
    if (!wts) goto out;
    const k3_weights_view *v = k3_weights_get(wts);
    const int T = 40, D = (int)c.hidden_size, K = c.n_experts_per_tok;
    k3_rng r;
    k3_rng_seed(&r, SEED + 11);
    float *x = malloc(sizeof(float) * T * D), *y = malloc(sizeof(float) * T * D);
    double *yd = malloc(sizeof(double) * D);
    size_t ns = k3_moe_scratch_floats(&c, T), nh = k3_moe_host_ints(&c, T);
    float *scr = scratch_new(ns);
    int64_t *hs = hscratch_new(nh);
    int n_moe = 0;
    for (int l = 0; l < c.n_layers; l++) {
        if (!k3_config_is_moe(&c, l)) continue;
        n_moe++;
        randn(&r, x, (size_t)T * D, 1.0f);
        poison(y, (size_t)T * D);
        K3_CHECK_OK(k3_moe_forward(be, &c, &v->layers[l], x, T, y, scr));
        K3_CHECK(guard_ok(scr, ns), "tiny layer %d: scratch overrun", l);
        moe_model m;
        memset(&m, 0, sizeof m);
        m.cfg = c;
        m.lw = v->layers[l];
        double num = 0, den = 0;
        int amb = 0, bad = 0;
        int32_t ids_ref[64], ids_c[64];
        float wtmp[64];
        for (int t = 0; t < T; t++) {
            double gap;
            ref_moe_token(&m, x + t * D, yd, ids_ref, &gap);
            K3_CHECK_OK(k3_moe_router(be, &c, &v->layers[l], x + t * D, 1, ids_c, wtmp, scr));
            bool same = memcmp(ids_ref, ids_c, sizeof(int32_t) * (size_t)K) == 0;
            if (!same) {
                if (gap < NEAR_TIE)
                    amb++;
                else
                    bad++;
                continue;
            }
            for (int d = 0; d < D; d++) {
                double e = y[t * D + d] - yd[d];
                num += e * e;
                den += yd[d] * yd[d];
            }
        }
        double rel = sqrt(num / den);
        printf("tiny[%s] layer %d: rel-L2 vs float64 %.3g, output rms %.3g, %d ambiguous\n",
               be->name, l, rel, sqrt(den / ((double)T * D)), amb);
        K3_CHECK(bad == 0, "tiny layer %d: %d tokens routed differently from float64", l, bad);
        K3_CHECK(amb <= 2, "tiny layer %d: %d ambiguous tokens", l, amb);
        K3_CHECK(rel <= K3_TOL_MOE_F64_REL_L2, "tiny layer %d: rel-L2 %.3g", l, rel);
        K3_CHECK(den > 0 && isfinite(den), "tiny layer %d: degenerate output", l);
    }
    K3_CHECK(n_moe >= 1, "tiny preset has no MoE layer");
    /* a rank holding only the even experts: rows for an odd expert must fail clearly */
    k3_load_sel half_sel = {.layer_begin = 1, .layer_end = 2, .expert_owned = own_even};
    K3_CHECK_OK(k3_weights_load(ck, &c, &half_sel, &half));
    if (half) {
        const k3_layer_w *hl = &k3_weights_get(half)->layers[1];
        int32_t ex2[2] = {2, 3};
        float *o2 = malloc(sizeof(float) * 2 * (size_t)k3_moe_row_width(&c));
        K3_CHECK_OK(k3_moe_expert_rows(be, &c, hl, x, NULL, ex2, 1, o2, scr, hs));
        K3_CHECK_ERR(k3_moe_expert_rows(be, &c, hl, x, NULL, ex2, 2, o2, scr, hs), K3_ERR_MISSING,
                     "row 1 needs expert 3");
        free(o2);
    }
    free(x), free(y), free(yd), free(scr), free(hs);
out:
    k3_weights_destroy(half);
    k3_weights_destroy(wts);
    k3_ckpt_destroy(ck);
    nftw(dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
}

/* Dump mode for the PyTorch cross-check (tests/experts/moe_vs_torch.py): for every MoE layer of
 * the checkpoint in MODEL_DIR, random x [T, D] -> k3_moe_forward with the cpu backend; writes
 * OUT/x_L.f32, OUT/y_L.f32 (float32 [T, D]) and OUT/ids_L.i32 (int32 [T, K], slot order). */
static int write_raw(const char *dir, const char *stem, int l, const void *p, size_t n_bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s_%d.%s", dir, stem, l,
             strcmp(stem, "ids") == 0 ? "i32" : "f32");
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    size_t w = fwrite(p, 1, n_bytes, f);
    return (fclose(f) != 0 || w != n_bytes) ? 1 : 0;
}

static int dump_layers(const char *model_dir, const char *out_dir) {
    k3_config c;
    k3_ckpt *ck = NULL;
    k3_weights *wts = NULL;
    if (k3_config_load(model_dir, &c) != K3_OK || k3_ckpt_open(model_dir, &ck) != K3_OK) {
        fprintf(stderr, "dump: %s\n", k3_last_error());
        k3_ckpt_destroy(ck);
        return 1;
    }
    k3_load_sel sel = {.layer_begin = 0, .layer_end = c.n_layers};
    if (k3_weights_load(ck, &c, &sel, &wts) != K3_OK) {
        fprintf(stderr, "dump: %s\n", k3_last_error());
        k3_ckpt_destroy(ck);
        return 1;
    }
    const k3_weights_view *v = k3_weights_get(wts);
    k3_backend *be = NULL;
    if (k3_backend_create("cpu", &(k3_backend_params){.n_threads = 0}, &be) != K3_OK) {
        fprintf(stderr, "dump: %s\n", k3_last_error());
        k3_weights_destroy(wts);
        k3_ckpt_destroy(ck);
        return 1;
    }
    const int T = 48, D = (int)c.hidden_size, K = c.n_experts_per_tok;
    float *x = malloc(sizeof(float) * T * D), *y = malloc(sizeof(float) * T * D),
          *w = malloc(sizeof(float) * T * K);
    int32_t *ids = malloc(sizeof(int32_t) * T * K);
    float *scr = scratch_new(k3_moe_scratch_floats(&c, T));
    int rc = 0;
    for (int l = 0; l < c.n_layers && rc == 0; l++) {
        if (!k3_config_is_moe(&c, l)) continue;
        k3_rng r;
        k3_rng_seed(&r, SEED + 100 + (uint64_t)l);
        randn(&r, x, (size_t)T * D, 1.0f);
        if (k3_moe_forward(be, &c, &v->layers[l], x, T, y, scr) != K3_OK ||
            k3_moe_router(be, &c, &v->layers[l], x, T, ids, w, scr) != K3_OK) {
            fprintf(stderr, "dump: layer %d: %s\n", l, k3_last_error());
            rc = 1;
            break;
        }
        rc |= write_raw(out_dir, "x", l, x, sizeof(float) * T * D);
        rc |= write_raw(out_dir, "y", l, y, sizeof(float) * T * D);
        rc |= write_raw(out_dir, "ids", l, ids, sizeof(int32_t) * T * K);
    }
    free(x), free(y), free(w), free(ids), free(scr);
    k3_backend_destroy(be);
    k3_weights_destroy(wts);
    k3_ckpt_destroy(ck);
    return rc;
}

/* ---- the guard backend ------------------------------------------------------------------------
 */
/* Replace t's data (and MXFP4 scale) by copies in be's memory; a tensor without data stays. */
static void tensor_to_backend(k3_backend *be, k3_tensor *t) {
    if (!t->data) return;
    const int64_t n = k3_tensor_n_elems(t);
    const bool fp4 = t->dtype == K3_DT_MXFP4;
    const size_t db = fp4 ? (size_t)n / 2 : (size_t)n * k3_dtype_size(t->dtype);
    const size_t sb = fp4 ? (size_t)n / 32 : 0;
    void *d = NULL, *s = NULL;
    K3_CHECK_OK(k3_backend_alloc(be, db, "test weight", &d));
    if (d) K3_CHECK_OK(k3_backend_upload(be, d, t->data, db));
    if (sb) {
        K3_CHECK_OK(k3_backend_alloc(be, sb, "test weight scale", &s));
        if (s) K3_CHECK_OK(k3_backend_upload(be, s, t->scale, sb));
    }
    t->data = d;
    t->scale = s;
    t->mem = be->mem;
}

static void *be_alloc_upload(k3_backend *be, const void *host, size_t n_bytes) {
    void *p = NULL;
    K3_CHECK_OK(k3_backend_alloc(be, n_bytes, "test buffer", &p));
    if (p && host) K3_CHECK_OK(k3_backend_upload(be, p, host, n_bytes));
    return p;
}

/* k3_moe_forward on the guard backend — every weight, the input, the output and the scratch in
 * guard memory (PROT_NONE outside the backend's ops and transfers, so a host loop over any of
 * them in experts/ takes SIGSEGV) — equals the cpu backend bit for bit; so do the steps driven
 * by hand on the guard backend. Only the routing metadata (expert ids, row_of, the row sort) is
 * host memory. */
static void test_guard(k3_backend *cpu, k3_backend *gb, const moe_shape *sh, int T,
                       const char *name) {
    moe_model m;
    model_make(&m, sh, SEED + 12 + (uint64_t)T);
    const k3_config *c = &m.cfg;
    const int D = sh->D, K = sh->K, E = sh->E, Lw = sh->L > 0 ? sh->L : sh->D;
    k3_rng r;
    k3_rng_seed(&r, SEED + 13);
    float *x = malloc(sizeof(float) * T * D), *y_c = malloc(sizeof(float) * T * D),
          *y_g = malloc(sizeof(float) * T * D), *y_s = malloc(sizeof(float) * T * D);
    randn(&r, x, (size_t)T * D, 1.0f);
    const size_t ns = k3_moe_scratch_floats(c, T), nh = k3_moe_host_ints(c, T);
    float *scr = scratch_new(ns); /* also the NaN pattern uploaded to the guard scratch */
    int64_t *hs = hscratch_new(nh);
    poison(y_c, (size_t)T * D);
    K3_CHECK_OK(k3_moe_forward(cpu, c, &m.lw, x, T, y_c, scr));
    for (size_t i = 0; i < ns + GUARD; i++) scr[i] = NAN;

    /* the layer's weights, copied into guard memory (the descriptors stay host structs) */
    k3_layer_w glw = m.lw;
    k3_expert_w *gex = malloc(sizeof(k3_expert_w) * (size_t)E);
    memcpy(gex, m.ex, sizeof(k3_expert_w) * (size_t)E);
    glw.experts = gex;
    k3_tensor *ts[] = {&glw.router, &glw.router_bias, &glw.lat_down, &glw.lat_norm,
                       &glw.lat_up, &glw.sh_gate,     &glw.sh_up,    &glw.sh_down};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) tensor_to_backend(gb, ts[i]);
    for (int e = 0; e < E; e++) {
        tensor_to_backend(gb, &gex[e].w1);
        tensor_to_backend(gb, &gex[e].w3);
        tensor_to_backend(gb, &gex[e].w2);
    }
    float *x_d = be_alloc_upload(gb, x, sizeof(float) * T * D);
    float *y_d = be_alloc_upload(gb, NULL, sizeof(float) * T * D);
    float *scr_d = be_alloc_upload(gb, scr, sizeof(float) * (ns + GUARD));
    int32_t *ids_d = be_alloc_upload(gb, NULL, sizeof(int32_t) * T * K);
    float *w_d = be_alloc_upload(gb, NULL, sizeof(float) * T * K);
    float *lat_d = be_alloc_upload(gb, NULL, sizeof(float) * T * Lw);
    float *eo_d = be_alloc_upload(gb, NULL, sizeof(float) * T * K * Lw);
    float *acc_d = be_alloc_upload(gb, NULL, sizeof(float) * T * Lw);
    float *ys_d = be_alloc_upload(gb, NULL, sizeof(float) * T * D);
    int32_t *ids_h = malloc(sizeof(int32_t) * T * K);
    int64_t *row_of = malloc(sizeof(int64_t) * T * K);
    if (!x_d || !y_d || !scr_d || !ids_d || !w_d || !lat_d || !eo_d || !acc_d || !ys_d) goto out;

    poison(y_g, (size_t)T * D);
    K3_CHECK_OK(k3_moe_forward(gb, c, &glw, x_d, T, y_d, scr_d));
    K3_CHECK_OK(k3_backend_download(gb, y_g, y_d, sizeof(float) * T * D));
    K3_CHECK(memcmp(y_g, y_c, sizeof(float) * T * D) == 0,
             "%s: forward on the guard backend differs from cpu (bits; rel-L2 %.3g)", name,
             k3_rel_l2(y_g, y_c, (size_t)T * D));
    K3_CHECK_OK(k3_backend_download(gb, scr, scr_d, sizeof(float) * (ns + GUARD)));
    K3_CHECK(guard_ok(scr, ns), "%s[guard]: forward wrote past its scratch", name);
    /* the layer stays on the backend: no host sync, no byte back to the host, one moe_experts
       call, and the same op calls for T tokens as for the last token alone (another T, another
       routing) */
    {
        k3_op_stats a, b, c1;
        K3_CHECK_OK(k3_backend_op_stats(gb, &a));
        K3_CHECK_OK(k3_moe_forward(gb, c, &glw, x_d, T, y_d, scr_d));
        K3_CHECK_OK(k3_backend_op_stats(gb, &b));
        K3_CHECK_OK(k3_moe_forward(gb, c, &glw, x_d + (int64_t)(T - 1) * D, 1, y_d, scr_d));
        K3_CHECK_OK(k3_backend_op_stats(gb, &c1));
        uint64_t n_t = 0, n_1 = 0;
        int differ = 0;
        for (int op = 0; op < K3_OP_COUNT; op++) {
            n_t += b.calls[op] - a.calls[op];
            n_1 += c1.calls[op] - b.calls[op];
            differ += b.calls[op] - a.calls[op] != c1.calls[op] - b.calls[op];
        }
        K3_CHECK(c1.host_syncs == a.host_syncs && c1.d2h_bytes == a.d2h_bytes,
                 "%s[guard]: forward synced with the host %llu times, read %llu bytes back", name,
                 (unsigned long long)(c1.host_syncs - a.host_syncs),
                 (unsigned long long)(c1.d2h_bytes - a.d2h_bytes));
        K3_CHECK(b.calls[K3_OP_moe_experts] - a.calls[K3_OP_moe_experts] == 1,
                 "%s[guard]: %llu moe_experts calls in one forward", name,
                 (unsigned long long)(b.calls[K3_OP_moe_experts] - a.calls[K3_OP_moe_experts]));
        K3_CHECK(differ == 0 && n_t == n_1 && n_t <= 16,
                 "%s[guard]: forward made %llu op calls for T = %d, %llu for T = 1 (%d ops differ)",
                 name, (unsigned long long)n_t, T, (unsigned long long)n_1, differ);
        printf("guard %s: %llu op calls a layer for T = %d and T = 1, no host sync\n", name,
               (unsigned long long)n_t, T);
    }
    /* the steps by hand, on the guard backend */
    poison(y_s, (size_t)T * D);
    moe_steps(gb, c, &glw, x_d, T, ids_d, ids_h, w_d, lat_d, row_of, eo_d, acc_d, ys_d, scr_d, hs);
    K3_CHECK_OK(k3_backend_download(gb, y_s, ys_d, sizeof(float) * T * D));
    K3_CHECK(memcmp(y_s, y_g, sizeof(float) * T * D) == 0,
             "%s[guard]: forward differs from the steps by hand (bits)", name);
    /* an error path on guard memory: refused before any buffer is touched */
    ids_h[0] = (int32_t)E;
    K3_CHECK_ERR(k3_moe_expert_rows(gb, c, &glw, lat_d, NULL, ids_h, 1, eo_d, scr_d, hs),
                 K3_ERR_ARG, "row 0 has expert id");
    printf("guard %s T=%d: forward and steps == cpu, bit for bit\n", name, T);
out:
    /* guard buffers are never reused; free them anyway (the contract every backend keeps) */
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) {
        k3_backend_free(gb, ts[i]->data);
        k3_backend_free(gb, ts[i]->scale);
    }
    for (int e = 0; e < E; e++) {
        k3_tensor *et[3] = {&gex[e].w1, &gex[e].w3, &gex[e].w2};
        for (int j = 0; j < 3; j++) {
            k3_backend_free(gb, et[j]->data);
            k3_backend_free(gb, et[j]->scale);
        }
    }
    void *bufs[] = {x_d, y_d, scr_d, ids_d, w_d, lat_d, eo_d, acc_d, ys_d};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) k3_backend_free(gb, bufs[i]);
    free(gex), free(x), free(y_c), free(y_g), free(y_s), free(scr), free(hs), free(ids_h),
        free(row_of);
    model_free(&m);
}

/* usage: test_experts [ref|cpu|guard|tiny]  (default: ref and cpu backends, then guard; no
 *        checkpoint)
 *        test_experts dump MODEL_DIR OUT_DIR */
int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc == 4 && strcmp(argv[1], "dump") == 0) return dump_layers(argv[2], argv[3]);
    const char *only = argc > 1 ? argv[1] : NULL;
    if (argc > 2 || (only && strcmp(only, "tiny") != 0 && strcmp(only, "ref") != 0 &&
                     strcmp(only, "cpu") != 0 && strcmp(only, "guard") != 0)) {
        fprintf(stderr, "usage: test_experts [ref|cpu|guard|tiny] | dump MODEL_DIR OUT_DIR\n");
        return 2;
    }
    printf("test_experts: seed %llu\n", (unsigned long long)SEED);
    if (only && strcmp(only, "tiny") == 0) {
        k3_backend *ref = NULL;
        K3_CHECK_OK(k3_backend_create("ref", NULL, &ref));
        if (ref) test_tiny(ref);
        k3_backend_destroy(ref);
        return k3_test_done("experts_tiny");
    }
    moe_shape k3s = {.D = 96,
                     .E = 16,
                     .K = 4,
                     .G = 4,
                     .TG = 2,
                     .I = 32,
                     .L = 64,
                     .n_shared = 2,
                     .mxfp4 = true,
                     .renorm = true,
                     .use_norm = true,
                     .scale = 2.5f,
                     .act = K3_ACT_SITU};
    moe_shape kl = {.D = 64,
                    .E = 8,
                    .K = 2,
                    .G = 1,
                    .TG = 1,
                    .I = 48,
                    .L = 0,
                    .n_shared = 1,
                    .mxfp4 = false,
                    .renorm = true,
                    .use_norm = false,
                    .scale = 1.0f,
                    .act = K3_ACT_SWIGLU};
    moe_shape nonorm = k3s;
    nonorm.use_norm = false;
    nonorm.renorm = false;
    nonorm.n_shared = 0;
    if (!only) test_scratch_sizes();
    const char *names[2] = {"ref", "cpu"};
    for (int b = 0; b < 2; b++) {
        if (only && strcmp(only, names[b]) != 0) continue;
        k3_backend *be = NULL;
        K3_CHECK_OK(k3_backend_create(names[b], &(k3_backend_params){.n_threads = 0}, &be));
        if (!be) continue;
        test_topk_ties(be);
        test_route(be);
        test_rows(be, true);
        test_rows(be, false);
        test_one_expert(be);
        test_forward_errors(be);
        test_layer(be, &k3s, 37, "latent-k3");
        test_layer(be, &k3s, 300, "latent-k3-tiled"); /* > the 256-token tile of k3_moe_forward */
        test_layer(be, &kl, 29, "kimi-linear");
        test_layer(be, &nonorm, 21, "latent-no-norm-no-renorm");
        k3_backend_destroy(be);
    }
    if (!only || strcmp(only, "guard") == 0) {
        k3_backend *cpu = NULL, *gb = NULL;
        K3_CHECK_OK(k3_backend_create("cpu", &(k3_backend_params){.n_threads = 0}, &cpu));
        K3_CHECK_OK(k3_backend_create(
            "guard", &(k3_backend_params){.n_threads = 0, .guard_reserve = (size_t)1 << 30}, &gb));
        if (cpu && gb) {
            test_guard(cpu, gb, &k3s, 300, "latent-k3-tiled");
            test_guard(cpu, gb, &kl, 29, "kimi-linear");
            test_guard(cpu, gb, &nonorm, 21, "latent-no-norm-no-renorm");
        }
        k3_backend_destroy(gb);
        k3_backend_destroy(cpu);
    }
    return k3_test_done("experts");
}
