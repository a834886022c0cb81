/* bench_forward.c — single-process forward throughput against this machine's measured limits
 * (never pass/fail; STYLE.md §22).
 *
 * For each model (--model DIR or --preset tiny|small, repeatable; default: the tiny and small
 * presets written with k3_make_tiny into temp dirs), on the cpu backend with --threads threads,
 * --reps times: prefill of --prompt random tokens into a fresh sequence (one forward call, or
 * calls of --chunk tokens), then --decode steps of one token, after --warmup untimed passes
 * (default 1: the first chunk and up to 4 decode steps). Reported: the MEDIAN of the reps
 * (and the best), as
 *   decode:  tok/s, the weight bytes one token reads (k3_config_count: non-expert weights + top-k
 *            experts of every MoE layer + one embedding row), GB/s = bytes x tok/s, and % of the
 *            measured triad bandwidth (the decode bound: bytes per token / triad); beside it the
 *            same with the state a step reads (MLA cache: (W)·4 bytes a cached token and MLA
 *            layer, at the mean decode position; KDA state read and written: 2·H·dk·dv·4 bytes a
 *            KDA layer), which passes the weights for a long prompt;
 *   prefill: tok/s and GFLOP/s as % of the measured fp32 FMA peak, counted two ways (below).
 * The limits are measured at start with the same thread count (launcher/bench_limits.c: best of
 * 5 trials; arrays past the L3), never constants.
 *
 * FLOPs of one prefill of P tokens into an empty sequence (analytic; the kernels' extra work, the
 * norms, gates, softmax and RoPE are not counted):
 *   weights:   2·(A − D − L)·P + 2·L·n_calls, A = active params (k3_config_count), D = the one
 *              embedding row in A (a lookup, no FLOPs), L = V·D the LM head (logits of the last
 *              token of each forward call only). MLA's absorbed W_UK / W_UV products are
 *              kv_b_proj's parameters, so they are in A already.
 *   attention: per MLA layer Σ_{p<P} 2·(p+1)·H·(W + Rkv) = H·(W + Rkv)·P·(P + 1), with
 *              W = kv_lora_rank + qk_rope_head_dim (scores q_abs·[c | k_pe]) and Rkv =
 *              kv_lora_rank (o_lat = Σ p_s c_s), H = num_attention_heads; per KDA layer
 *              P·H_kda·7·dk·dv (the recurrent delta rule per token and head: the decay of the
 *              state dk·dv multiplies, kᵀS, the rank-1 update and qᵀS dk·dv FMAs each; the
 *              chunked form's extra intra-chunk work is not counted).
 * Columns: % peak of the weight FLOPs alone, and of weights + attention.
 * Prints a table and writes JSON (--json FILE, default bench_forward.json) with every number:
 * the host, versions, commit and limits; per model the samples of every rep.
 * Usage: bench_forward [--model DIR | --preset tiny|small]... [--threads N] [--prompt N]
 *                      [--decode N] [--reps N] [--warmup N] [--chunk C] [--kda-chunk C]
 *                      [--json FILE]
 *                      [--profile 1|decode|prefill]  (per model: each op's share of a decode
 *                      token, or of the prefill's time, on stderr) */
#include <stdio.h>
#include <stdlib.h>

#include "k3_layers.h"
#include "k3_model.h"
#include "k3_tiny.h"
#include "layers/tiny_model.h"

#include "bench.h"

#define MAX_REPS 1000

typedef struct {
    int n_prompt, n_decode, reps, chunk, kda_chunk, warmup;
} bench_args;

typedef struct {
    double prefill_s[MAX_REPS], decode_s[MAX_REPS];
    int64_t n_calls; /* forward calls of one prefill */
} bench_times;

static k3_backend *g_be;
/* --profile 1 (or decode) | prefill: the forward runs on a wrapper backend that times each op call
 * (the cpu ops are synchronous) during the decode steps (or the prefill calls), with the weight
 * bytes of the matmuls; printed per model as where a decode token's (a prompt's) time goes. One
 * run's ops share the host's phase, so their shares compare where whole runs minutes apart do not
 * (this host moves those by ±20%). */
static struct {
    k3_backend *inner, outer;
    k3_ops ops;
    k3_backend_iface iface;
    bool on;
    int phase; /* 0 off, 1 the decode steps, 2 the prefill */
    /* per op and weight kind: 0 none or F32, 1 BF16, 2 MXFP4, 3 a group of several kinds */
    double s[K3_OP_COUNT][4], bytes[K3_OP_COUNT][4], flops[K3_OP_COUNT][4];
    int64_t calls[K3_OP_COUNT][4];
} g_prof;
static const char *const k_prof_kind[4] = {"", " BF16", " MXFP4", " mixed"};
static int w_kind(const k3_tensor *W) {
    return W->dtype == K3_DT_BF16 ? 1 : W->dtype == K3_DT_MXFP4 ? 2 : 0;
}
static double w_bytes(const k3_tensor *W) {
    const double n = (double)W->shape[0] * (double)W->shape[1];
    return W->dtype == K3_DT_MXFP4 ? n / 2 + n / 32 : n * (double)k3_dtype_size(W->dtype);
}
static double w_flops(const k3_tensor *W, int64_t T) {
    return 2.0 * (double)W->shape[0] * (double)W->shape[1] * (double)T;
}
static void prof_note(int op, int kind, double t0, double bytes, double flops) {
    if (!g_prof.on) return;
    g_prof.s[op][kind] += k3_now_s() - t0;
    g_prof.calls[op][kind]++;
    g_prof.bytes[op][kind] += bytes;
    g_prof.flops[op][kind] += flops;
}
/* every op: the inner backend's op, timed (be shadowed so the argument list forwards as written) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wshadow"
#define PROF_OP(name, params, args)                                                                \
    static k3_status prof_##name params {                                                          \
        (void)be;                                                                                  \
        const double t0_ = k3_now_s();                                                             \
        k3_status st_;                                                                             \
        {                                                                                          \
            k3_backend *be = g_prof.inner;                                                         \
            st_ = be->ops->name args;                                                              \
        }                                                                                          \
        prof_note(K3_OP_##name, 0, t0_, 0, 0);                                                     \
        return st_;                                                                                \
    }
K3_OP_LIST(PROF_OP)
#undef PROF_OP
#pragma GCC diagnostic pop
/* the matmuls again, with their weight bytes */
static k3_status prof_mm(k3_backend *be, const float *x, int64_t T, const k3_tensor *W, float *y) {
    (void)be;
    const double t0 = k3_now_s();
    k3_status st = g_prof.inner->ops->matmul(g_prof.inner, x, T, W, y);
    prof_note(K3_OP_matmul, w_kind(W), t0, w_bytes(W), w_flops(W, T));
    return st;
}
static k3_status prof_mm_tn(k3_backend *be, const float *x, int64_t T, const k3_tensor *W,
                            float *y) {
    (void)be;
    const double t0 = k3_now_s();
    k3_status st = g_prof.inner->ops->matmul_tn(g_prof.inner, x, T, W, y);
    prof_note(K3_OP_matmul_tn, w_kind(W), t0, w_bytes(W), w_flops(W, T));
    return st;
}
static k3_status prof_mm_group(k3_backend *be, const k3_mm *mm, int n) {
    (void)be;
    const double t0 = k3_now_s();
    k3_status st = g_prof.inner->ops->matmul_group(g_prof.inner, mm, n);
    double b = 0, f = 0;
    int kind = n > 0 ? w_kind(mm[0].W) : 0;
    for (int i = 0; i < n; i++) {
        b += w_bytes(mm[i].W), f += w_flops(mm[i].W, mm[i].T);
        if (w_kind(mm[i].W) != kind) kind = 3;
    }
    prof_note(K3_OP_matmul_group, kind, t0, b, f);
    return st;
}
/* memory calls go straight to the inner backend */
static k3_status pm_alloc(k3_backend *be, size_t n, void **out) {
    (void)be;
    return g_prof.inner->mem_->alloc(g_prof.inner, n, out);
}
static void pm_free(k3_backend *be, void *p) {
    (void)be;
    g_prof.inner->mem_->free(g_prof.inner, p);
}
static k3_status pm_upload(k3_backend *be, void *dst, const void *src, size_t n) {
    (void)be;
    return g_prof.inner->mem_->upload(g_prof.inner, dst, src, n);
}
static k3_status pm_download(k3_backend *be, void *dst, const void *src, size_t n) {
    (void)be;
    return g_prof.inner->mem_->download(g_prof.inner, dst, src, n);
}
static k3_status pm_sync(k3_backend *be) {
    (void)be;
    return g_prof.inner->mem_->synchronize(g_prof.inner);
}
static bool pm_supports(const k3_backend *be, int op, k3_dtype wt) {
    (void)be;
    return g_prof.inner->mem_->supports_op(g_prof.inner, op, wt);
}
static k3_status pm_memory(const k3_backend *be, size_t *fr, size_t *tot) {
    (void)be;
    return g_prof.inner->mem_->memory(g_prof.inner, fr, tot);
}
/* The wrapper of inner (which stays owned by the caller). */
static k3_backend *prof_wrap(k3_backend *inner) {
    g_prof.inner = inner;
#define PROF_FIELD(name, params, args) g_prof.ops.name = prof_##name;
    K3_OP_LIST(PROF_FIELD)
#undef PROF_FIELD
    g_prof.ops.matmul = prof_mm, g_prof.ops.matmul_tn = prof_mm_tn,
    g_prof.ops.matmul_group = prof_mm_group;
    g_prof.iface = (k3_backend_iface){.alloc = pm_alloc,
                                      .free = pm_free,
                                      .upload = pm_upload,
                                      .download = pm_download,
                                      .synchronize = pm_sync,
                                      .supports_op = pm_supports,
                                      .memory = pm_memory};
    g_prof.outer = (k3_backend){.name = inner->name,
                                .mem = inner->mem,
                                .ops = &g_prof.ops,
                                .mem_ = &g_prof.iface,
                                .ctx = inner->ctx};
    return &g_prof.outer;
}
/* The profiled phase's op table of one model (stderr), then the counters cleared: per token of
 * that phase (decode: generated tokens; prefill: prompt tokens). */
static void prof_print(const char *label, int64_t n_tokens, double decode_s) {
    const char *ph = g_prof.phase == 2 ? "prefill" : "decode";
    double sum = 0;
    for (int op = 0; op < K3_OP_COUNT; op++)
        for (int k = 0; k < 4; k++) sum += g_prof.s[op][k];
    fprintf(stderr, "\n%s profile, %s: %lld tokens, %.1f us/token (ops %.1f, between ops %.1f)\n",
            ph, label, (long long)n_tokens, 1e6 * decode_s / (double)n_tokens,
            1e6 * sum / (double)n_tokens, 1e6 * (decode_s - sum) / (double)n_tokens);
    fprintf(stderr,
            "| op | calls/token | us/token | %% of %s | weight GB/s | GFLOP/s |\n"
            "|---|---|---|---|---|---|\n",
            ph);
    for (;;) { /* largest first */
        int bo = -1, bk = 0;
        for (int op = 0; op < K3_OP_COUNT; op++)
            for (int k = 0; k < 4; k++)
                if (g_prof.calls[op][k] && (bo < 0 || g_prof.s[op][k] > g_prof.s[bo][bk]))
                    bo = op, bk = k;
        if (bo < 0) break;
        const double t = g_prof.s[bo][bk];
        char gbs[32] = "", gfs[32] = "";
        if (g_prof.bytes[bo][bk] > 0)
            snprintf(gbs, sizeof gbs, "%.1f", g_prof.bytes[bo][bk] / t / 1e9);
        if (g_prof.flops[bo][bk] > 0)
            snprintf(gfs, sizeof gfs, "%.1f", g_prof.flops[bo][bk] / t / 1e9);
        fprintf(stderr, "| %s%s | %.1f | %.1f | %.1f | %s | %s |\n", k3_op_name(bo),
                k_prof_kind[bk], (double)g_prof.calls[bo][bk] / (double)n_tokens,
                1e6 * t / (double)n_tokens, 100 * t / decode_s, gbs, gfs);
        g_prof.calls[bo][bk] = 0;
    }
    memset(g_prof.s, 0, sizeof g_prof.s), memset(g_prof.bytes, 0, sizeof g_prof.bytes);
    memset(g_prof.flops, 0, sizeof g_prof.flops);
}

static k3_status bench_one(const tiny_model *m, const bench_args *a, bench_times *r) {
    const k3_config *c = &m->cfg;
    const int C = a->chunk > 0 ? K3_MIN(a->chunk, a->n_prompt) : a->n_prompt;
    k3_stage_params sp = {.cfg = c,
                          .w = m->view,
                          .be = g_be,
                          .layer_begin = 0,
                          .layer_end = c->n_layers,
                          .first = true,
                          .last = true,
                          .max_tokens = C,
                          .kda_chunk = a->kda_chunk};
    k3_stage *s = NULL;
    k3_seq_state *st = NULL;
    k3_activ act = {0};
    float *logits = NULL;
    int32_t *ids = NULL;
    k3_status e = k3_stage_create(&sp, &s);
    if (e == K3_OK) e = k3_seq_state_create(s, a->n_prompt + a->n_decode, &st);
    if (e == K3_OK) e = k3_activ_alloc(g_be, &act, c, C);
    if (e == K3_OK) e = k3_alloc((void **)&logits, sizeof(float) * (size_t)c->vocab_size, "logits");
    if (e == K3_OK)
        e = k3_alloc((void **)&ids, sizeof(int32_t) * (size_t)(a->n_prompt + a->n_decode), "ids");
    k3_rng rng;
    k3_rng_seed(&rng, 99);
    if (e == K3_OK) bench_random_ids(&rng, c->vocab_size, ids, a->n_prompt + a->n_decode);
    r->n_calls = (a->n_prompt + C - 1) / C;
    /* untimed passes first (--warmup): one forward call of the first chunk and a few decode
       steps, so the timed reps meet started pool workers, touched scratch and KV pages and
       warm code, as a serving engine does after its first request (a first pass, all of that
       included, was 1-2% slower at one thread and 3-11% at two on the small preset) */
    for (int w = 0; e == K3_OK && w < a->warmup; w++) {
        e = k3_seq_state_reset(st);
        int32_t n = C;
        k3_batch b = {.n_seqs = 1, .states = &st, .n_tokens = &n, .token_ids = ids};
        if (e == K3_OK) e = k3_stage_forward(s, &b, &act, false, logits);
        for (int i = 0; e == K3_OK && i < K3_MIN(a->n_decode, 4); i++) {
            int32_t one = 1;
            k3_batch d = {.n_seqs = 1, .states = &st, .n_tokens = &one, .token_ids = ids + C + i};
            e = k3_stage_forward(s, &d, &act, false, logits);
        }
    }
    for (int rep = 0; e == K3_OK && rep < a->reps; rep++) {
        e = k3_seq_state_reset(st);
        double t0 = k3_now_s();
        g_prof.on = g_prof.inner != NULL && g_prof.phase == 2;
        for (int p0 = 0; e == K3_OK && p0 < a->n_prompt; p0 += C) {
            int32_t n = K3_MIN(C, a->n_prompt - p0);
            k3_batch b = {.n_seqs = 1, .states = &st, .n_tokens = &n, .token_ids = ids + p0};
            e = k3_stage_forward(s, &b, &act, false, logits);
            if (r->n_calls > 1) /* a long prompt: minutes; say how far it is */
                K3_LOGI("bench_forward: rep %d: prefill %d / %d tokens, %.1f s", rep + 1, p0 + n,
                        a->n_prompt, k3_now_s() - t0);
        }
        double t1 = k3_now_s();
        g_prof.on = g_prof.inner != NULL && g_prof.phase == 1;
        for (int i = 0; e == K3_OK && i < a->n_decode; i++) {
            int32_t one = 1;
            k3_batch d = {
                .n_seqs = 1, .states = &st, .n_tokens = &one, .token_ids = ids + a->n_prompt + i};
            e = k3_stage_forward(s, &d, &act, false, logits);
        }
        g_prof.on = false;
        r->prefill_s[rep] = t1 - t0;
        r->decode_s[rep] = k3_now_s() - t1;
    }
    k3_free(ids);
    k3_free(logits);
    k3_activ_free(g_be, &act);
    k3_seq_state_destroy(st);
    k3_stage_destroy(s);
    return e;
}

/* The analytic counts of the header comment. */
typedef struct {
    double weight, mla, kda;      /* FLOPs of one prefill */
    double bytes_per_token;       /* decode: weights */
    double state_bytes_per_token; /* decode: MLA cache read + KDA state read and written */
    int n_mla, n_kda;
} flop_count;

static k3_status count(const k3_config *c, const bench_args *a, int64_t n_calls, flop_count *f) {
    k3_config_counts cc;
    K3_TRY(k3_config_count(c, &cc));
    memset(f, 0, sizeof *f);
    for (int l = 0; l < c->n_layers; l++) c->mixer[l] == K3_MIXER_MLA ? f->n_mla++ : f->n_kda++;
    const double P = a->n_prompt, D = (double)c->hidden_size, L = (double)c->vocab_size * D;
    const double body = (double)cc.params_active - D - (c->tie_word_embeddings ? 0 : L);
    f->weight = 2 * body * P + 2 * L * (double)n_calls;
    const double W = c->kv_lora_rank + c->qk_rope_head_dim, Rkv = c->kv_lora_rank;
    f->mla = f->n_mla * (double)c->n_heads * (W + Rkv) * P * (P + 1);
    const double dk = c->kda_head_dim, dv = c->kda_head_dim;
    f->kda = f->n_kda * P * (double)c->kda_n_heads * 7 * dk * dv;
    f->bytes_per_token = (double)cc.bytes_active;
    const double mean_ctx = a->n_prompt + 0.5 * (a->n_decode + 1); /* cached tokens a step reads */
    f->state_bytes_per_token =
        f->n_mla * mean_ctx * W * 4 + f->n_kda * 2.0 * c->kda_n_heads * dk * dv * 4;
    return K3_OK;
}

static void stats(double *v, int n, bench_stats *s) {
    double tmp[MAX_REPS];
    memcpy(tmp, v, (size_t)n * sizeof *v);
    bench_stats_of(tmp, n, s);
}

static k3_status put_row(bench_report *rep, const char *label, const k3_config *c,
                         const bench_args *a, const bench_times *t, const flop_count *f,
                         const bench_limits *lim) {
    bench_stats ps, ds;
    stats((double *)t->prefill_s, a->reps, &ps);
    stats((double *)t->decode_s, a->reps, &ds);
    double best_p = t->prefill_s[0], best_d = t->decode_s[0];
    for (int i = 1; i < a->reps; i++)
        best_p = K3_MIN(best_p, t->prefill_s[i]), best_d = K3_MIN(best_d, t->decode_s[i]);
    const double P = a->n_prompt, N = a->n_decode;
    const double pf_w = f->weight / ps.median / 1e9,
                 pf_t = (f->weight + f->mla + f->kda) / ps.median / 1e9;
    const double dec = N / ds.median, gbs = f->bytes_per_token * dec / 1e9;
    const double pk = lim->fma_gflops > 0 ? lim->fma_gflops : 1,
                 tr = lim->triad_gbs > 0 ? lim->triad_gbs : 1;
    bench_row *r;
    K3_TRY(bench_add_row(rep, &r));
    K3_TRY(bench_put_str(r, "model", "model", label));
    K3_TRY(bench_put_num(r, "n_layers", "layers", -1, c->n_layers));
    K3_TRY(bench_put_num(r, "n_mla_layers", NULL, -1, f->n_mla));
    K3_TRY(bench_put_num(r, "n_kda_layers", NULL, -1, f->n_kda));
    K3_TRY(bench_put_num(r, "hidden_size", NULL, -1, (double)c->hidden_size));
    K3_TRY(bench_put_num(r, "prompt_tokens", "prompt", -1, P));
    K3_TRY(bench_put_num(r, "decode_tokens", NULL, -1, N));
    K3_TRY(bench_put_num(r, "prefill_calls", NULL, -1, (double)t->n_calls));
    K3_TRY(bench_put_num(r, "reps", NULL, -1, a->reps));
    K3_TRY(bench_put_num(r, "prefill_tok_s", "prefill t/s", 1, P / ps.median));
    K3_TRY(bench_put_num(r, "prefill_tok_s_best", NULL, 1, P / best_p));
    K3_TRY(bench_put_arr(r, "prefill_samples_s", t->prefill_s, a->reps));
    K3_TRY(bench_put_num(r, "prefill_weight_flops", NULL, -1, f->weight));
    K3_TRY(bench_put_num(r, "prefill_mla_attn_flops", NULL, -1, f->mla));
    K3_TRY(bench_put_num(r, "prefill_kda_flops", NULL, -1, f->kda));
    K3_TRY(bench_put_num(r, "prefill_gflops", "GFLOP/s (w)", 1, pf_w));
    K3_TRY(bench_put_num(r, "peak_fraction", NULL, 4, pf_w / pk));
    K3_TRY(bench_put_num(r, NULL, "% peak (w)", 1, 100 * pf_w / pk));
    K3_TRY(bench_put_num(r, "prefill_gflops_with_attention", "GFLOP/s (w+attn)", 1, pf_t));
    K3_TRY(bench_put_num(r, "peak_fraction_with_attention", NULL, 4, pf_t / pk));
    K3_TRY(bench_put_num(r, NULL, "% peak (w+attn)", 1, 100 * pf_t / pk));
    K3_TRY(bench_put_num(r, "decode_tok_s", "decode t/s", 1, dec));
    K3_TRY(bench_put_num(r, "decode_tok_s_best", NULL, 1, N / best_d));
    K3_TRY(bench_put_arr(r, "decode_samples_s", t->decode_s, a->reps));
    K3_TRY(bench_put_num(r, "decode_bytes_per_token", NULL, -1, f->bytes_per_token));
    K3_TRY(bench_put_num(r, NULL, "MB/token", 1, f->bytes_per_token / 1e6));
    K3_TRY(bench_put_num(r, "decode_state_bytes_per_token", NULL, -1, f->state_bytes_per_token));
    K3_TRY(bench_put_num(r, "decode_gbs", "GB/s", 2, gbs));
    K3_TRY(bench_put_num(r, "decode_bound_tok_s", "bound t/s", 1, tr * 1e9 / f->bytes_per_token));
    K3_TRY(bench_put_num(r, "triad_fraction", NULL, 4, gbs / tr));
    K3_TRY(bench_put_num(r, NULL, "% triad", 1, 100 * gbs / tr));
    /* a long context: the MLA cache and KDA state a step reads can pass the weights */
    const double gbs_s = (f->bytes_per_token + f->state_bytes_per_token) * dec / 1e9;
    K3_TRY(bench_put_num(r, "decode_gbs_with_state", NULL, 2, gbs_s));
    K3_TRY(bench_put_num(r, "triad_fraction_with_state", NULL, 4, gbs_s / tr));
    return bench_put_num(r, NULL, "% triad (w+state)", 1, 100 * gbs_s / tr);
}

static const char flop_text[] =
    "prefill weights 2(A-D-L)P + 2L per call (A active params, D embed row, L=V*D head); MLA "
    "attention per layer H(W+Rkv)P(P+1), W=kv_lora_rank+qk_rope_head_dim, Rkv=kv_lora_rank; KDA "
    "per layer 7*P*H*dk*dv; decode bound = active weight bytes per token / triad";

int main(int argc, char **argv) {
    const char *models[8], *presets[8];
    int n_models = 0, n_presets = 0, threads = 2;
    bench_args a = {.n_prompt = 128, .n_decode = 32, .reps = 5, .warmup = 1};
    const char *json_path = "bench_forward.json";
    int profile = 0;
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "bench_forward: %s needs a value\n", k);
            return 2;
        }
        if (strcmp(k, "--model") == 0 && n_models + n_presets < 8)
            models[n_models++] = v;
        else if (strcmp(k, "--preset") == 0 && n_models + n_presets < 8)
            presets[n_presets++] = v;
        else if (strcmp(k, "--threads") == 0)
            threads = atoi(v);
        else if (strcmp(k, "--prompt") == 0)
            a.n_prompt = atoi(v);
        else if (strcmp(k, "--decode") == 0)
            a.n_decode = atoi(v);
        else if (strcmp(k, "--reps") == 0)
            a.reps = atoi(v);
        else if (strcmp(k, "--warmup") == 0)
            a.warmup = atoi(v);
        else if (strcmp(k, "--chunk") == 0)
            a.chunk = atoi(v);
        else if (strcmp(k, "--kda-chunk") == 0)
            a.kda_chunk = atoi(v);
        else if (strcmp(k, "--json") == 0)
            json_path = v;
        else if (strcmp(k, "--profile") == 0) {
            profile = strcmp(v, "prefill") == 0                         ? 2
                      : strcmp(v, "decode") == 0 || strcmp(v, "1") == 0 ? 1
                      : strcmp(v, "0") == 0                             ? 0
                                                                        : -1;
            if (profile < 0) {
                fprintf(stderr,
                        "bench_forward: --profile %s: want 0, 1 (decode), decode or "
                        "prefill\n",
                        v);
                return 2;
            }
        } else {
            fprintf(stderr, "bench_forward: unknown flag %s (or more than 8 models)\n", k);
            return 2;
        }
        i++;
    }
    if (threads < 1 || threads > 256 || a.n_prompt < 1 || a.n_decode < 1 || a.reps < 1 ||
        a.reps > MAX_REPS || a.chunk < 0 || a.kda_chunk < 0 || a.warmup < 0 || a.warmup > 100) {
        fprintf(stderr, "bench_forward: --threads in [1, 256], --prompt, --decode >= 1, --reps in "
                        "[1, 1000], --warmup in [0, 100], --chunk, --kda-chunk >= 0\n");
        return 2;
    }
    if (!n_models && !n_presets) presets[n_presets++] = "tiny", presets[n_presets++] = "small";
    if (k3_backend_create("cpu", &(k3_backend_params){.n_threads = threads}, &g_be) != K3_OK) {
        fprintf(stderr, "bench_forward: %s\n", k3_last_error());
        return 1;
    }
    k3_backend *cpu_be = g_be;
    if (profile) g_be = prof_wrap(cpu_be), g_prof.phase = profile;
    bench_limits lim;
    bench_report rep = {.mode = "forward"};
    bench_row *m = &rep.meta;
    k3_status e = bench_measure_limits(threads, 5, 0, &lim);
    if (e == K3_OK) e = bench_meta_host(m);
    if (e == K3_OK) e = bench_put_str(m, "backend", "backend", g_be->name);
    if (e == K3_OK) e = bench_put_str(m, "isa", "ISA", k3_cpu_isa_name(cpu_be));
    if (e == K3_OK)
        e = bench_put_str(m, "gemv", "decode row order (K3_GEMV)", k3_cpu_gemv_name(cpu_be));
    if (e == K3_OK) e = bench_put_num(m, "threads", "threads", -1, threads);
    if (e == K3_OK) e = bench_put_num(m, "repetitions", "repetitions (median)", -1, a.reps);
    if (e == K3_OK) e = bench_put_num(m, "warmup", "untimed passes first", -1, a.warmup);
    if (e == K3_OK) e = bench_put_num(m, "chunk", "prefill chunk (0 = whole)", -1, a.chunk);
    if (e == K3_OK) e = bench_put_num(m, "kda_chunk", "kda chunk", -1, a.kda_chunk);
    if (e == K3_OK) e = bench_put_str(m, "flop_count", "counted", flop_text);
    if (e == K3_OK) e = bench_put_limits(m, &lim);
    if (e == K3_OK) {
        char how[400];
        bench_limits_describe(&lim, how, sizeof how);
        K3_LOGI("bench_forward: measured with %s", how);
    }
    int rc = 0;
    for (int i = 0; e == K3_OK && i < n_models + n_presets; i++) {
        tiny_model tm;
        memset(&tm, 0, sizeof tm);
        char label[300];
        if (i < n_models) {
            e = tiny_open_dir(&tm, models[i]);
            snprintf(label, sizeof label, "%s", models[i]);
        } else {
            char tmpl[] = "/tmp/k3-bench-XXXXXX";
            k3_preset p;
            e = k3_preset_parse(presets[i - n_models], &p);
            if (e == K3_OK && !mkdtemp(tmpl)) e = K3_ERR(K3_ERR_IO, "mkdtemp failed");
            if (e == K3_OK) e = k3_make_tiny(tmpl, p, 1);
            if (e == K3_OK) e = tiny_open_dir(&tm, tmpl);
            tm.own_dir = e == K3_OK;
            snprintf(label, sizeof label, "%s (preset)", presets[i - n_models]);
        }
        bench_times *t = calloc(1, sizeof *t);
        flop_count f;
        if (!t) e = K3_ERR(K3_ERR_NOMEM, "bench times");
        if (e == K3_OK) K3_LOGI("bench_forward: %s: %d reps", label, a.reps);
        if (e == K3_OK) e = bench_one(&tm, &a, t);
        if (e == K3_OK) e = count(&tm.cfg, &a, t->n_calls, &f);
        if (e == K3_OK) e = put_row(&rep, label, &tm.cfg, &a, t, &f, &lim);
        if (e == K3_OK && profile) {
            double ds = 0;
            for (int r = 0; r < a.reps; r++) ds += profile == 2 ? t->prefill_s[r] : t->decode_s[r];
            prof_print(label, (int64_t)(profile == 2 ? a.n_prompt : a.n_decode) * a.reps, ds);
        }
        if (e != K3_OK) {
            fprintf(stderr, "bench_forward: %s: %s\n", label, k3_last_error());
            rc = 1;
            e = K3_OK; /* the next model still runs */
        }
        free(t);
        tiny_close(&tm);
    }
    if (e == K3_OK) e = bench_report_write(&rep, json_path, NULL);
    if (e != K3_OK) {
        fprintf(stderr, "bench_forward: %s\n", k3_last_error());
        rc = 1;
    }
    bench_report_free(&rep);
    k3_backend_destroy(cpu_be);
    return rc;
}
