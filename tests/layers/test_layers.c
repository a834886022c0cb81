/* test_layers.c — the KDA and MLA layers against float64 evaluations of K3-MODEL.md §2 and §3
 * written here from the spec (MLA in its NAIVE, non-absorbed form: k_nope and v materialised per
 * head), on synthetic random weights (F32 and BF16), both decay-gate forms, full-rank and
 * low-rank output gates, state carried across calls (prefill 5 + prefill 3 + decode 1 + decode 1
 * = one pass of 10 tokens), two sequences in one batch, and a bad-input error. */
#include "k3_layers.h"
#include "k3_test.h"
#include "layers_internal.h"
#include "tolerances.h"

static k3_rng g_rng;
static const uint64_t k_seed = 777;

/* ---- synthetic weights ------------------------------------------------------------------- */
#define MAXT 64
static void *g_mem[MAXT * 8];
static int g_n_mem;
static void *keep(void *p) {
    g_mem[g_n_mem++] = p;
    return p;
}
static k3_tensor mk(k3_dtype dt, int64_t d0, int64_t d1, float sd, float mean) {
    k3_tensor t = {.dtype = dt, .ndim = d1 > 0 ? 2 : 1, .shape = {d0, d1 > 0 ? d1 : 0}};
    int64_t n = d0 * (d1 > 0 ? d1 : 1);
    if (dt == K3_DT_BF16) {
        uint16_t *p = keep(malloc((size_t)n * 2));
        for (int64_t i = 0; i < n; i++) p[i] = k3_f32_to_bf16(mean + sd * k3_rng_normal(&g_rng));
        t.data = p;
    } else {
        float *p = keep(malloc((size_t)n * 4));
        for (int64_t i = 0; i < n; i++) p[i] = mean + sd * k3_rng_normal(&g_rng);
        t.data = p;
    }
    return t;
}
static double W(const k3_tensor *t, int64_t o, int64_t i) {
    return k3_tensor_get(t, o, i);
}
static double V1(const k3_tensor *t, int64_t i) {
    return t->dtype == K3_DT_BF16 ? k3_bf16_to_f32(((uint16_t *)t->data)[i])
                                  : ((float *)t->data)[i];
}

static void config(k3_config *c, bool lower_bound, bool full_gate) {
    memset(c, 0, sizeof *c);
    c->vocab_size = 50;
    c->hidden_size = 48;
    c->n_layers = 2;
    c->rms_norm_eps = 1e-5f;
    c->mla_norm_eps = 1e-6f;
    c->mixer[0] = K3_MIXER_KDA;
    c->mixer[1] = K3_MIXER_MLA;
    c->n_heads = 3, c->q_lora_rank = 16, c->kv_lora_rank = 12, c->qk_nope_head_dim = 8;
    c->qk_rope_head_dim = 4, c->v_head_dim = 8, c->mla_use_output_gate = true;
    c->kda_n_heads = 2, c->kda_head_dim = 16, c->kda_conv_kernel = 4;
    c->kda_has_lower_bound = lower_bound, c->kda_gate_lower_bound = -5.0f;
    c->kda_full_rank_gate = full_gate, c->kda_gate_rank = 16, c->kda_a_log_len = 4;
    c->act = K3_ACT_SITU, c->situ_beta = 4.0f, c->situ_linear_beta = 25.0f;
    c->intermediate_size = 40;
    c->first_k_dense_replace = 2; /* all dense: the MoE is experts/' business */
    c->moe_layer_freq = 1;
}

static void weights(const k3_config *c, k3_layer_w *L) {
    const int64_t D = c->hidden_size, P = (int64_t)c->kda_n_heads * c->kda_head_dim;
    const float s = 0.15f;
    memset(L, 0, 2 * sizeof *L);
    for (int l = 0; l < 2; l++) {
        L[l].present = true;
        L[l].input_norm = mk(K3_DT_BF16, D, 0, 0.1f, 1.0f);
        L[l].post_attn_norm = mk(K3_DT_BF16, D, 0, 0.1f, 1.0f);
        L[l].gate_proj = mk(K3_DT_BF16, c->intermediate_size, D, s, 0);
        L[l].up_proj = mk(K3_DT_BF16, c->intermediate_size, D, s, 0);
        L[l].down_proj = mk(K3_DT_BF16, D, c->intermediate_size, s, 0);
    }
    k3_layer_w *k = &L[0];
    k->q_proj = mk(K3_DT_BF16, P, D, s, 0);
    k->k_proj = mk(K3_DT_F32, P, D, s, 0);
    k->v_proj = mk(K3_DT_BF16, P, D, s, 0);
    k->q_conv = mk(K3_DT_F32, P * c->kda_conv_kernel, 0, 0.5f, 0);
    k->k_conv = mk(K3_DT_F32, P * c->kda_conv_kernel, 0, 0.5f, 0);
    k->v_conv = mk(K3_DT_F32, P * c->kda_conv_kernel, 0, 0.5f, 0);
    k->f_a = mk(K3_DT_BF16, c->kda_gate_rank, D, s, 0);
    k->f_b = mk(K3_DT_BF16, P, c->kda_gate_rank, 0.3f, 0);
    k->dt_bias = mk(K3_DT_F32, P, 0, 0.5f, 0);
    k->a_log = mk(K3_DT_F32, c->kda_a_log_len, 0, 0.5f, 0);
    k->b_proj = mk(K3_DT_BF16, c->kda_n_heads, D, s, 0);
    if (c->kda_full_rank_gate) {
        k->g_proj = mk(K3_DT_BF16, P, D, s, 0);
    } else {
        k->g_a = mk(K3_DT_BF16, c->kda_head_dim, D, s, 0);
        k->g_b = mk(K3_DT_BF16, P, c->kda_head_dim, 0.3f, 0);
    }
    k->o_norm = mk(K3_DT_F32, c->kda_head_dim, 0, 0.1f, 1.0f);
    k->o_proj = mk(K3_DT_BF16, D, P, s, 0);
    k3_layer_w *m = &L[1];
    const int H = c->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
              dv = c->v_head_dim;
    m->q_a_proj = mk(K3_DT_BF16, c->q_lora_rank, D, s, 0);
    m->q_a_norm = mk(K3_DT_BF16, c->q_lora_rank, 0, 0.1f, 1.0f);
    m->q_b_proj = mk(K3_DT_BF16, (int64_t)H * (dn + dr), c->q_lora_rank, 0.4f, 0);
    m->kv_a_proj = mk(K3_DT_BF16, c->kv_lora_rank + dr, D, s, 0);
    m->kv_a_norm = mk(K3_DT_BF16, c->kv_lora_rank, 0, 0.1f, 1.0f);
    m->kv_b_proj = mk(K3_DT_BF16, (int64_t)H * (dn + dv), c->kv_lora_rank, 0.4f, 0);
    m->g_proj = mk(K3_DT_BF16, (int64_t)H * dv, D, s, 0);
    m->o_proj = mk(K3_DT_BF16, D, (int64_t)H * dv, s, 0);
}

/* ---- float64 references ------------------------------------------------------------------ */
static double sg(double x) {
    return 1.0 / (1.0 + exp(-x));
}
static void mv(const k3_tensor *w, const double *x, double *y) { /* y = W x */
    for (int64_t o = 0; o < w->shape[0]; o++) {
        double s = 0;
        for (int64_t i = 0; i < w->shape[1]; i++) s += W(w, o, i) * x[i];
        y[o] = s;
    }
}
static void rms(double *x, int64_t n, const k3_tensor *w, double eps) {
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    double r = 1.0 / sqrt(ss / n + eps);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * r * (w ? V1(w, i) : 1.0);
}

/* KDA over n tokens of x [n, D] from zero state -> y [n, D] (K3-MODEL.md §2.2). */
static void kda_f64(const k3_config *c, const k3_layer_w *L, const float *x, int n, double *y) {
    const int64_t D = c->hidden_size;
    const int H = c->kda_n_heads, dk = c->kda_head_dim, K = c->kda_conv_kernel;
    const int64_t P = (int64_t)H * dk;
    double *pre[3], *post[3];
    const k3_tensor *Wp[3] = {&L->q_proj, &L->k_proj, &L->v_proj},
                    *Wc[3] = {&L->q_conv, &L->k_conv, &L->v_conv};
    double *xd = malloc(sizeof(double) * D), *S = calloc((size_t)H * dk * dk, sizeof(double));
    for (int j = 0; j < 3; j++)
        pre[j] = malloc(sizeof(double) * n * P), post[j] = malloc(sizeof(double) * n * P);
    double *gate = malloc(sizeof(double) * n * P), *beta = malloc(sizeof(double) * n * H),
           *G = malloc(sizeof(double) * n * P), *fa = malloc(sizeof(double) * 64),
           *o = malloc(sizeof(double) * P);
    for (int t = 0; t < n; t++) {
        for (int64_t d = 0; d < D; d++) xd[d] = x[t * D + d];
        for (int j = 0; j < 3; j++) mv(Wp[j], xd, pre[j] + t * P);
        mv(&L->f_a, xd, fa);
        mv(&L->f_b, fa, gate + t * P);
        for (int h = 0; h < H; h++) {
            double a = exp(V1(&L->a_log, h));
            for (int i = 0; i < dk; i++) {
                double r = gate[t * P + h * dk + i] + V1(&L->dt_bias, h * dk + i);
                gate[t * P + h * dk + i] = c->kda_has_lower_bound
                                               ? c->kda_gate_lower_bound * sg(a * r)
                                               : -a * (r > 20 ? r : log1p(exp(r)));
            }
        }
        double bz[16];
        mv(&L->b_proj, xd, bz);
        for (int h = 0; h < H; h++) beta[t * H + h] = sg(bz[h]);
        if (c->kda_full_rank_gate) {
            mv(&L->g_proj, xd, G + t * P);
        } else {
            mv(&L->g_a, xd, fa);
            mv(&L->g_b, fa, G + t * P);
        }
    }
    for (int j = 0; j < 3; j++)
        for (int t = 0; t < n; t++)
            for (int64_t ch = 0; ch < P; ch++) {
                double acc = 0;
                for (int m = 0; m < K; m++) {
                    int src = t - (K - 1) + m;
                    if (src >= 0) acc += V1(Wc[j], ch * K + m) * pre[j][src * P + ch];
                }
                post[j][t * P + ch] = acc * sg(acc);
            }
    const double scale = 1.0 / sqrt((double)dk);
    for (int t = 0; t < n; t++) {
        for (int h = 0; h < H; h++) {
            double *q = post[0] + t * P + h * dk, *k = post[1] + t * P + h * dk,
                   *v = post[2] + t * P + h * dk;
            double nq = 0, nk = 0;
            for (int i = 0; i < dk; i++) nq += q[i] * q[i], nk += k[i] * k[i];
            nq = 1.0 / sqrt(nq + 1e-6), nk = 1.0 / sqrt(nk + 1e-6);
            double *Sh = S + (int64_t)h * dk * dk;
            double u[64] = {0}, oo[64] = {0};
            for (int i = 0; i < dk; i++)
                for (int jj = 0; jj < dk; jj++) {
                    Sh[i * dk + jj] *= exp(gate[t * P + h * dk + i]);
                    u[jj] += k[i] * nk * Sh[i * dk + jj];
                }
            for (int i = 0; i < dk; i++)
                for (int jj = 0; jj < dk; jj++) {
                    Sh[i * dk + jj] += k[i] * nk * beta[t * H + h] * (v[jj] - u[jj]);
                    oo[jj] += q[i] * nq * Sh[i * dk + jj];
                }
            double ss = 0;
            for (int jj = 0; jj < dk; jj++) ss += (scale * oo[jj]) * (scale * oo[jj]);
            double r = 1.0 / sqrt(ss / dk + c->rms_norm_eps);
            for (int jj = 0; jj < dk; jj++)
                o[h * dk + jj] =
                    scale * oo[jj] * r * V1(&L->o_norm, jj) * sg(G[t * P + h * dk + jj]);
        }
        mv(&L->o_proj, o, y + t * D);
    }
    for (int j = 0; j < 3; j++) free(pre[j]), free(post[j]);
    free(xd), free(S), free(gate), free(beta), free(G), free(fa), free(o);
}

/* MLA, naive (non-absorbed) form, causal over n tokens -> y [n, D] (K3-MODEL.md §3.2). */
static void mla_f64(const k3_config *c, const k3_layer_w *L, const float *x, int n, double *y) {
    const int64_t D = c->hidden_size;
    const int H = c->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
              dv = c->v_head_dim;
    const int Rkv = c->kv_lora_rank;
    double *q = malloc(sizeof(double) * n * H * (dn + dr)),
           *kn = malloc(sizeof(double) * n * H * dn), *vv = malloc(sizeof(double) * n * H * dv),
           *kpe = malloc(sizeof(double) * n * dr), *gate = malloc(sizeof(double) * n * H * dv);
    double xd[64], cq[64], ckv[64], a[64];
    for (int t = 0; t < n; t++) {
        for (int64_t d = 0; d < D; d++) xd[d] = x[t * D + d];
        mv(&L->q_a_proj, xd, cq);
        rms(cq, c->q_lora_rank, &L->q_a_norm, c->mla_norm_eps);
        mv(&L->q_b_proj, cq, q + (int64_t)t * H * (dn + dr));
        mv(&L->kv_a_proj, xd, ckv);
        for (int i = 0; i < dr; i++) kpe[t * dr + i] = ckv[Rkv + i];
        rms(ckv, Rkv, &L->kv_a_norm, c->mla_norm_eps);
        for (int h = 0; h < H; h++) {
            for (int i = 0; i < dn; i++) {
                double s = 0;
                for (int r = 0; r < Rkv; r++) s += W(&L->kv_b_proj, h * (dn + dv) + i, r) * ckv[r];
                kn[((int64_t)t * H + h) * dn + i] = s;
            }
            for (int i = 0; i < dv; i++) {
                double s = 0;
                for (int r = 0; r < Rkv; r++)
                    s += W(&L->kv_b_proj, h * (dn + dv) + dn + i, r) * ckv[r];
                vv[((int64_t)t * H + h) * dv + i] = s;
            }
        }
        mv(&L->g_proj, xd, gate + (int64_t)t * H * dv);
    }
    const double scale = 1.0 / sqrt((double)(dn + dr));
    double *p = malloc(sizeof(double) * n);
    for (int t = 0; t < n; t++) {
        for (int h = 0; h < H; h++) {
            const double *qt = q + ((int64_t)t * H + h) * (dn + dr);
            double m = -1e300, z = 0;
            for (int s = 0; s <= t; s++) {
                double d = 0;
                for (int i = 0; i < dn; i++) d += qt[i] * kn[((int64_t)s * H + h) * dn + i];
                for (int i = 0; i < dr; i++) d += qt[dn + i] * kpe[s * dr + i];
                p[s] = d * scale;
                m = p[s] > m ? p[s] : m;
            }
            for (int s = 0; s <= t; s++) z += (p[s] = exp(p[s] - m));
            for (int i = 0; i < dv; i++) {
                double acc = 0;
                for (int s = 0; s <= t; s++) acc += p[s] / z * vv[((int64_t)s * H + h) * dv + i];
                a[h * dv + i] = acc * sg(gate[((int64_t)t * H + h) * dv + i]);
            }
        }
        mv(&L->o_proj, a, y + t * D);
    }
    free(q), free(kn), free(vv), free(kpe), free(gate), free(p);
}

/* ---- the test ------------------------------------------------------------------------------ */
typedef k3_status (*mixer_fn)(k3_stage *, int, const k3_seqs *, const float *, float *);

/* Run `layer` over 10 tokens split 5 + 3 + 1 + 1 for sequence A, with sequence B (4 tokens, the
 * first 4 of A) sharing the first call's batch; compare with the float64 pass. */
static void run_case(const char *name, bool lower_bound, bool full_gate, const char *backend,
                     int kda_chunk) {
    k3_backend *be = NULL;
    K3_CHECK_OK(k3_backend_create(backend, NULL, &be));
    if (!be) return;
    k3_config c;
    config(&c, lower_bound, full_gate);
    k3_layer_w L[2];
    weights(&c, L);
    k3_weights_view wv = {.cfg = &c, .layers = L};
    k3_stage_params sp = {.cfg = &c,
                          .w = &wv,
                          .be = be,
                          .layer_begin = 0,
                          .layer_end = 2,
                          .max_tokens = 16,
                          .kda_chunk = kda_chunk};
    k3_stage *s = NULL;
    K3_CHECK_OK(k3_stage_create(&sp, &s));
    if (!s) return;
    k3_seq_state *A = NULL, *B = NULL;
    K3_CHECK_OK(k3_seq_state_create(s, 32, &A));
    K3_CHECK_OK(k3_seq_state_create(s, 32, &B));
    const int n = 10;
    const int64_t D = c.hidden_size;
    float x[10 * 48];
    for (int i = 0; i < n * D; i++) x[i] = k3_rng_normal(&g_rng);
    for (int layer = 0; layer < 2; layer++) {
        mixer_fn fn = layer == 0 ? k3_layers_kda : k3_layers_mla;
        double want[10 * 48];
        (layer == 0 ? kda_f64 : mla_f64)(&c, &L[layer], x, n, want);
        K3_CHECK_OK(k3_seq_state_reset(A));
        K3_CHECK_OK(k3_seq_state_reset(B));
        float got[10 * 48], gotB[4 * 48], buf[16 * 48], out[16 * 48];
        const int split[4] = {5, 3, 1, 1};
        int t0 = 0;
        for (int call = 0; call < 4; call++) {
            int32_t nt[2] = {split[call], 4};
            k3_seq_state *st[2] = {A, B};
            k3_batch b = {.n_seqs = call == 0 ? 2 : 1, .states = st, .n_tokens = nt};
            memcpy(buf, x + t0 * D, sizeof(float) * split[call] * D);
            if (call == 0) memcpy(buf + split[0] * D, x, sizeof(float) * 4 * D);
            k3_seqs sq;
            K3_CHECK_OK(k3_layers_step_begin(s, &b, &sq));
            K3_CHECK_OK(fn(s, layer, &sq, buf, out));
            memcpy(got + t0 * D, out, sizeof(float) * split[call] * D);
            if (call == 0) memcpy(gotB, out + split[0] * D, sizeof(float) * 4 * D);
            A->pos += split[call]; /* k3_stage_forward does this; here the mixer runs alone */
            if (call == 0) B->pos += 4;
            t0 += split[call];
        }
        double e = 0, eB = 0, num = 0, den = 0;
        for (int i = 0; i < n * D; i++)
            num += (got[i] - want[i]) * (got[i] - want[i]), den += want[i] * want[i];
        e = sqrt(num / den);
        num = den = 0;
        for (int i = 0; i < 4 * D; i++)
            num += (gotB[i] - want[i]) * (gotB[i] - want[i]), den += want[i] * want[i];
        eB = sqrt(num / den);
        K3_CHECK(e < K3_TOL_LAYER_REL_L2 && eB < K3_TOL_LAYER_REL_L2,
                 "%s %s layer (%s): rel-L2 %.3g, seq B %.3g", name, layer == 0 ? "KDA" : "MLA",
                 be->name, e, eB);
        K3_CHECK(den > 1e-3, "degenerate reference output");
        printf("  %-22s %s %s: rel-L2 %.2e (batched seq %.2e)\n", name, layer == 0 ? "KDA" : "MLA",
               be->name, e, eB);
    }
    /* capacity: 32 - 10 = 22 tokens left; a 23-token call is refused up front */
    k3_seq_state_destroy(A);
    k3_seq_state_destroy(B);
    k3_stage_destroy(s);
    k3_backend_destroy(be);
}

/* A whole 2-layer stage (embedding -> KDA+dense -> MLA+dense -> final norm -> tied head) with
 * NO AttnRes (attn_res_block_size 0: Kimi-Linear's plain pre-norm residual,
 * h += mixer(norm(h)); h += ffn(norm(h))) and SwiGLU, vs float64 composed from the pieces above. */
static void ffn_f64(const k3_config *c, const k3_layer_w *L, const double *x, double *y) {
    const int64_t F = c->intermediate_size;
    double g[64], u[64];
    mv(&L->gate_proj, x, g);
    mv(&L->up_proj, x, u);
    for (int64_t i = 0; i < F; i++)
        g[i] = c->act == K3_ACT_SWIGLU
                   ? g[i] * sg(g[i]) * u[i]
                   : 4.0 * tanh(g[i] / 4.0) * sg(g[i]) * 25.0 * tanh(u[i] / 25.0);
    mv(&L->down_proj, g, y);
}
static void test_plain_residual(k3_act act) {
    k3_config c;
    config(&c, true, true);
    c.act = act;
    c.tie_word_embeddings = true;
    k3_layer_w L[2];
    weights(&c, L);
    k3_tensor embed = mk(K3_DT_BF16, c.vocab_size, c.hidden_size, 1.0f, 0),
              fnorm = mk(K3_DT_F32, c.hidden_size, 0, 0.1f, 1.0f);
    k3_weights_view wv = {.cfg = &c, .layers = L, .embed = embed, .final_norm = fnorm};
    k3_stage_params sp = {.cfg = &c,
                          .w = &wv,
                          .layer_begin = 0,
                          .layer_end = 2,
                          .first = true,
                          .last = true,
                          .max_tokens = 8};
    k3_stage *s = NULL;
    K3_CHECK_OK(k3_stage_create(&sp, &s));
    if (!s) return;
    const int n = 7;
    const int64_t D = c.hidden_size, V = c.vocab_size;
    int32_t ids[7] = {3, 17, 42, 0, 49, 17, 8};
    /* float64: h = E[ids]; per layer h += mixer(norm(h)); h += ffn(norm(h)) */
    double h[7 * 48], y[7 * 48], xd[48], fo[48];
    float xn[7 * 48];
    for (int t = 0; t < n; t++)
        for (int64_t d = 0; d < D; d++) h[t * D + d] = W(&embed, ids[t], d);
    for (int l = 0; l < 2; l++) {
        for (int t = 0; t < n; t++) {
            for (int64_t d = 0; d < D; d++) xd[d] = h[t * D + d];
            rms(xd, D, &L[l].input_norm, c.rms_norm_eps);
            for (int64_t d = 0; d < D; d++) xn[t * D + d] = (float)xd[d];
        }
        (l == 0 ? kda_f64 : mla_f64)(&c, &L[l], xn, n, y);
        for (int64_t e = 0; e < n * D; e++) h[e] += y[e];
        for (int t = 0; t < n; t++) {
            for (int64_t d = 0; d < D; d++) xd[d] = h[t * D + d];
            rms(xd, D, &L[l].post_attn_norm, c.rms_norm_eps);
            ffn_f64(&c, &L[l], xd, fo);
            for (int64_t d = 0; d < D; d++) h[t * D + d] += fo[d];
        }
    }
    double want[7 * 50];
    for (int t = 0; t < n; t++) {
        for (int64_t d = 0; d < D; d++) xd[d] = h[t * D + d];
        rms(xd, D, &fnorm, c.rms_norm_eps);
        mv(&embed, xd, want + t * V);
    }
    k3_seq_state *st = NULL;
    K3_CHECK_OK(k3_seq_state_create(s, 16, &st));
    k3_activ act_buf;
    K3_CHECK_OK(k3_activ_alloc(k3_stage_backend(s), &act_buf, &c, 8));
    float got[7 * 50];
    int32_t nt = 4;
    k3_batch b = {.n_seqs = 1, .states = &st, .n_tokens = &nt, .token_ids = ids};
    K3_CHECK_OK(k3_stage_forward(s, &b, &act_buf, true, got));
    nt = 3;
    b.token_ids = ids + 4;
    K3_CHECK_OK(k3_stage_forward(s, &b, &act_buf, true, got + 4 * V));
    double num = 0, den = 0;
    for (int64_t i = 0; i < n * V; i++)
        num += (got[i] - want[i]) * (got[i] - want[i]), den += want[i] * want[i];
    K3_CHECK(sqrt(num / den) < K3_TOL_LAYER_REL_L2, "plain residual stage (%s): logits rel-L2 %.3g",
             act == K3_ACT_SWIGLU ? "SwiGLU" : "SiTU", sqrt(num / den));
    printf("  plain-residual stage, tied head, %s: logits rel-L2 %.2e\n",
           act == K3_ACT_SWIGLU ? "SwiGLU" : "SiTU", sqrt(num / den));
    k3_activ_free(k3_stage_backend(s), &act_buf);
    k3_seq_state_destroy(st);
    k3_stage_destroy(s);
}

static void test_errors(void) {
    k3_config c;
    config(&c, true, true);
    k3_layer_w L[2];
    weights(&c, L);
    k3_weights_view wv = {.cfg = &c, .layers = L};
    L[1].kv_b_proj.shape[1] = 11;
    k3_stage_params sp = {.cfg = &c, .w = &wv, .layer_begin = 0, .layer_end = 2, .max_tokens = 4};
    k3_stage *s = NULL;
    K3_CHECK_ERR(k3_stage_create(&sp, &s), K3_ERR_SHAPE,
                 "layer 1: tensor kv_b_proj has shape [48, 11], expected [48, 12]");
    L[1].kv_b_proj.shape[1] = 12;
    L[0].q_proj.data = NULL;
    K3_CHECK_ERR(k3_stage_create(&sp, &s), K3_ERR_MISSING, "layer 0: tensor q_proj is not loaded");
    L[0].q_proj = L[0].v_proj;
    sp.layer_end = 3;
    K3_CHECK_ERR(k3_stage_create(&sp, &s), K3_ERR_ARG, "layer range");
    sp.layer_end = 2;
    sp.first = true; /* no embedding */
    K3_CHECK_ERR(k3_stage_create(&sp, &s), K3_ERR_MISSING, "embedding");
    sp.first = false;
    K3_CHECK_OK(k3_stage_create(&sp, &s));
    k3_seq_state *A = NULL;
    K3_CHECK_OK(k3_seq_state_create(s, 3, &A));
    k3_activ act;
    K3_CHECK_OK(k3_activ_alloc(k3_stage_backend(s), &act, &c, 4));
    int32_t n = 4;
    k3_batch b = {.n_seqs = 1, .states = &A, .n_tokens = &n};
    act.T = 4;
    K3_CHECK_ERR(k3_stage_forward(s, &b, &act, false, NULL), K3_ERR_STATE, "max_ctx 3");
    k3_seq_state *Z = NULL;
    K3_CHECK_OK(k3_seq_state_create(s, 10, &Z));
    b.states = &Z;
    n = 5;
    K3_CHECK_ERR(k3_stage_forward(s, &b, &act, false, NULL), K3_ERR_ARG, "max_tokens 4");
    n = 0;
    K3_CHECK_ERR(k3_stage_forward(s, &b, &act, false, NULL), K3_ERR_ARG, "has 0 tokens");
    K3_CHECK(k3_seq_state_pos(Z) == 0, "refused calls must not advance the position");
    k3_seq_state_destroy(Z);
    k3_activ_free(k3_stage_backend(s), &act);
    k3_seq_state_destroy(A);
    k3_stage_destroy(s);
    k3_stage_destroy(NULL);
    k3_seq_state_destroy(NULL);
}

int main(void) {
    printf("test_layers seed %llu\n", (unsigned long long)k_seed);
    k3_rng_seed(&g_rng, k_seed);
    run_case("K3 gate, full-rank", true, true, "cpu", 0);
    run_case("K3 gate, recurrent", true, true, "cpu", 1);
    run_case("K3 gate, chunk 2", true, true, "ref", 2);
    run_case("softplus gate, low-rank", false, false, "cpu", 0);
    run_case("softplus gate, ref", false, false, "ref", 0);
    test_plain_residual(K3_ACT_SWIGLU);
    test_plain_residual(K3_ACT_SITU);
    test_errors();
    for (int i = 0; i < g_n_mem; i++) free(g_mem[i]);
    return k3_test_done("layers");
}
