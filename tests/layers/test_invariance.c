/* test_invariance.c — the forward on the tiny checkpoint (made by `k3 make-tiny`) must not
 * depend on how the work is cut:
 *  - prefill chunk sizes 1, 3, 16, 64 and whole: logits within K3_TOL_CHUNK_INVARIANCE_REL_L2
 *    and in fact BIT-identical (the default, recurrent KDA); the opt-in chunked KDA form within
 *    K3_TOL_KDA_FORM_REL_L2 of it;
 *  - decode after prefill == prefill of the longer prompt (same tolerances);
 *  - two sequences in one batch == each alone (bitwise, recurrent KDA);
 *  - two stages [0, s) + [s, n) handing k3_activ over == one stage (bitwise);
 *  - ref and cpu backends agree to K3_TOL_BACKEND_REL_L2.
 * Every comparison also checks the logits are finite and not degenerate. */
#include "k3_experts.h"
#include "k3_layers.h"
#include "k3_test.h"
#include "layers/tiny_model.h"
#include "tolerances.h"

static tiny_model g_m;
static k3_backend *g_cpu, *g_ref; /* cpu with 2 threads; ref */
static const uint64_t k_seed = 4242;

/* Run `n` tokens of ids through a fresh whole-model stage in calls of `chunk` tokens (chunk <=
 * 0: one call); logits of every position -> out [n, V]. */
static k3_status run_chunks(k3_backend *be, int kda_chunk, const int32_t *ids, int n, int chunk,
                            float *out) {
    const k3_config *c = &g_m.cfg;
    if (chunk <= 0) chunk = n;
    k3_stage_params sp = {.cfg = c,
                          .w = g_m.view,
                          .be = be,
                          .layer_begin = 0,
                          .layer_end = c->n_layers,
                          .first = true,
                          .last = true,
                          .max_tokens = chunk,
                          .kda_chunk = kda_chunk};
    k3_stage *s = NULL;
    k3_seq_state *st = NULL;
    k3_activ act = {0};
    k3_status e = k3_stage_create(&sp, &s);
    if (e == K3_OK) e = k3_seq_state_create(s, n, &st);
    if (e == K3_OK) e = k3_activ_alloc(be, &act, c, chunk);
    for (int p = 0; e == K3_OK && p < n; p += chunk) {
        int32_t m = K3_MIN(chunk, n - p);
        k3_batch b = {.n_seqs = 1, .states = &st, .n_tokens = &m, .token_ids = ids + p};
        e = k3_stage_forward(s, &b, &act, true, out + (int64_t)p * c->vocab_size);
    }
    k3_activ_free(be, &act);
    k3_seq_state_destroy(st);
    k3_stage_destroy(s);
    return e;
}

/* Per-layer hidden states of a whole-prompt run (diagnostic: names the layer where two runs part).
 */
typedef struct {
    float *h; /* [n_layers, T, D] */
    int64_t T;
} taps;
static void tap_fn(void *ctx, int layer, const float *h, int64_t T, int64_t D) {
    taps *t = ctx;
    memcpy(t->h + (int64_t)layer * T * D, h, sizeof(float) * T * D);
}
static void run_taps(int kda_chunk, k3_backend *be, const int32_t *ids, int n, float *h,
                     float *logits) {
    const k3_config *c = &g_m.cfg;
    k3_stage_params sp = {.cfg = c,
                          .w = g_m.view,
                          .be = be,
                          .layer_begin = 0,
                          .layer_end = c->n_layers,
                          .first = true,
                          .last = true,
                          .max_tokens = n,
                          .kda_chunk = kda_chunk};
    k3_stage *s = NULL;
    k3_seq_state *st = NULL;
    k3_activ act = {0};
    K3_CHECK_OK(k3_stage_create(&sp, &s));
    K3_CHECK_OK(k3_seq_state_create(s, n, &st));
    K3_CHECK_OK(k3_activ_alloc(be, &act, c, n));
    taps tp = {h, n};
    K3_CHECK_OK(k3_stage_set_tap(s, tap_fn, &tp));
    int32_t m = n;
    k3_batch b = {.n_seqs = 1, .states = &st, .n_tokens = &m, .token_ids = ids};
    K3_CHECK_OK(k3_stage_forward(s, &b, &act, true, logits));
    k3_activ_free(be, &act);
    k3_seq_state_destroy(st);
    k3_stage_destroy(s);
}
static void layer_report(const int32_t *ids, int n) {
    const k3_config *c = &g_m.cfg;
    int64_t TD = (int64_t)n * c->hidden_size, V = c->vocab_size;
    float *h0 = malloc(sizeof(float) * c->n_layers * TD),
          *h1 = malloc(sizeof(float) * c->n_layers * TD);
    float *l0 = malloc(sizeof(float) * n * V), *l1 = malloc(sizeof(float) * n * V);
    run_taps(16, g_cpu, ids, n, h0, l0);
    run_taps(1, g_cpu, ids, n, h1, l1);
    printf("  hidden rel-L2 per layer, chunked vs recurrent KDA form:");
    for (int l = 0; l < c->n_layers; l++)
        printf(" %d:%.1e", l, k3_rel_l2(h0 + l * TD, h1 + l * TD, (size_t)TD));
    printf(" logits:%.1e\n", k3_rel_l2(l0, l1, (size_t)(n * V)));
    free(h0), free(h1), free(l0), free(l1);
}

static bool sane(const float *x, int64_t n) {
    double s = 0, s2 = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) return false;
        s += x[i], s2 += (double)x[i] * x[i];
    }
    double var = s2 / n - (s / n) * (s / n);
    return var > 1e-6;
}

static void test_chunks(const int32_t *ids, int n) {
    const int64_t V = g_m.cfg.vocab_size;
    float *base = malloc(sizeof(float) * n * V), *got = malloc(sizeof(float) * n * V);
    K3_CHECK_OK(run_chunks(g_cpu, 0, ids, n, 0, base)); /* engine default: recurrent KDA */
    K3_CHECK(sane(base, n * V), "whole-prompt logits degenerate or not finite");
    const int chunks[4] = {1, 3, 16, 64};
    for (int i = 0; i < 4; i++) {
        /* the engine default: within the bound, and in fact bit-identical */
        K3_CHECK_OK(run_chunks(g_cpu, 0, ids, n, chunks[i], got));
        double worst = 0;
        for (int t = 0; t < n; t++) {
            double e = k3_rel_l2(got + t * V, base + t * V, (size_t)V);
            worst = e > worst ? e : worst;
        }
        bool bit = memcmp(got, base, sizeof(float) * n * V) == 0;
        K3_CHECK(worst <= K3_TOL_CHUNK_INVARIANCE_REL_L2, "chunk %d: worst position rel-L2 %.3g",
                 chunks[i], worst);
        K3_CHECK(bit, "chunk %d: not bit-identical to the whole prompt (recurrent KDA)", chunks[i]);
        /* the chunked KDA form (WY, C = 16) with the same prompt chunking */
        K3_CHECK_OK(run_chunks(g_cpu, 16, ids, n, chunks[i], got));
        double wc = 0;
        for (int t = 0; t < n; t++) {
            double e = k3_rel_l2(got + t * V, base + t * V, (size_t)V);
            wc = e > wc ? e : wc;
        }
        K3_CHECK(wc <= K3_TOL_KDA_FORM_REL_L2, "chunk %d, chunked KDA form: worst position %.3g",
                 chunks[i], wc);
        printf("  prefill chunk %2d: worst position rel-L2 %.2e, bit-identical %s; chunked-KDA "
               "form %.2e\n",
               chunks[i], worst, bit ? "yes" : "NO", wc);
    }
    /* ref backend vs cpu */
    K3_CHECK_OK(run_chunks(g_ref, 0, ids, n, 7, got));
    double eb = k3_rel_l2(got, base, (size_t)(n * V));
    K3_CHECK(eb < K3_TOL_BACKEND_REL_L2, "ref vs cpu backend: %.3g", eb);
    printf("  ref backend (chunks of 7) vs cpu: %.2e\n", eb);
    free(base), free(got);
}

/* decode one token at a time after a prefill of n0 == prefill of all n */
static void test_decode(const int32_t *ids, int n, int n0) {
    const k3_config *c = &g_m.cfg;
    const int64_t V = c->vocab_size;
    const int forms[2] = {0, 16};
    float *base = malloc(sizeof(float) * n * V), *got = malloc(sizeof(float) * V);
    K3_CHECK_OK(run_chunks(g_cpu, 0, ids, n, 0, base)); /* default form, whole prompt */
    for (int f = 0; f < 2; f++) {
        int kc = forms[f];
        k3_stage_params sp = {.cfg = c,
                              .w = g_m.view,
                              .be = g_cpu,
                              .layer_begin = 0,
                              .layer_end = c->n_layers,
                              .first = true,
                              .last = true,
                              .max_tokens = n0,
                              .kda_chunk = kc};
        k3_stage *s = NULL;
        k3_seq_state *st = NULL;
        k3_activ act = {0};
        K3_CHECK_OK(k3_stage_create(&sp, &s));
        K3_CHECK_OK(k3_seq_state_create(s, n, &st));
        K3_CHECK_OK(k3_activ_alloc(g_cpu, &act, c, n0));
        float *pre = malloc(sizeof(float) * V);
        int32_t m = n0;
        k3_batch b = {.n_seqs = 1, .states = &st, .n_tokens = &m, .token_ids = ids};
        K3_CHECK_OK(k3_stage_forward(s, &b, &act, false, pre)); /* last position only */
        if (kc == 0)
            K3_CHECK(memcmp(pre, base + (int64_t)(n0 - 1) * V, sizeof(float) * V) == 0,
                     "last-token logits differ from the all-logits row");
        double worst = 0;
        bool bit = true;
        for (int t = n0; t < n; t++) {
            int32_t one = 1;
            k3_batch d = {.n_seqs = 1, .states = &st, .n_tokens = &one, .token_ids = ids + t};
            K3_CHECK_OK(k3_stage_forward(s, &d, &act, false, got));
            double e = k3_rel_l2(got, base + (int64_t)t * V, (size_t)V);
            worst = e > worst ? e : worst;
            bit = bit && memcmp(got, base + (int64_t)t * V, sizeof(float) * V) == 0;
        }
        K3_CHECK(k3_seq_state_pos(st) == n, "position %lld", (long long)k3_seq_state_pos(st));
        if (kc == 0) {
            K3_CHECK(worst <= K3_TOL_CHUNK_INVARIANCE_REL_L2, "decode vs prefill: %.3g", worst);
            K3_CHECK(bit, "decode vs prefill: not bit-identical (recurrent KDA)");
        } else {
            K3_CHECK(worst <= K3_TOL_KDA_FORM_REL_L2, "decode vs prefill, chunked form: %.3g",
                     worst);
        }
        printf("  decode after prefill %d (kda_chunk %d): worst rel-L2 %.2e, bit-identical %s\n",
               n0, kc, worst, bit ? "yes" : "no");
        free(pre);
        k3_activ_free(g_cpu, &act);
        k3_seq_state_destroy(st);
        k3_stage_destroy(s);
    }
    free(base), free(got);
}

/* Batch of two sequences (different lengths) == each alone; two stages == one stage. All
 * bitwise (recurrent KDA). */
static void test_batch_split(const int32_t *ids, int n) {
    const k3_config *c = &g_m.cfg;
    const int64_t V = c->vocab_size;
    const int nA = n, nB = n / 2 + 3;
    const int32_t *idsB = ids + 5;
    float *aloneA = malloc(sizeof(float) * nA * V), *aloneB = malloc(sizeof(float) * nB * V);
    K3_CHECK_OK(run_chunks(g_cpu, 1, ids, nA, 0, aloneA));
    K3_CHECK_OK(run_chunks(g_cpu, 1, idsB, nB, 0, aloneB));

    const int split = c->n_layers / 2 + 1; /* not on a block boundary of the tiny preset */
    k3_stage_params p1 = {.cfg = c,
                          .w = g_m.view,
                          .be = g_cpu,
                          .layer_begin = 0,
                          .layer_end = split,
                          .first = true,
                          .max_tokens = nA + nB,
                          .kda_chunk = 1};
    k3_stage_params p2 = p1;
    p2.layer_begin = split, p2.layer_end = c->n_layers, p2.first = false, p2.last = true;
    k3_stage *s1 = NULL, *s2 = NULL;
    K3_CHECK_OK(k3_stage_create(&p1, &s1));
    K3_CHECK_OK(k3_stage_create(&p2, &s2));
    if (!s1 || !s2) return;
    k3_seq_state *st1[2] = {NULL, NULL}, *st2[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++) {
        K3_CHECK_OK(k3_seq_state_create(s1, nA, &st1[i]));
        K3_CHECK_OK(k3_seq_state_create(s2, nA, &st2[i]));
    }
    k3_activ act = {0};
    K3_CHECK_OK(k3_activ_alloc(g_cpu, &act, c, nA + nB));
    int32_t *cat = malloc(sizeof(int32_t) * (nA + nB));
    memcpy(cat, ids, sizeof(int32_t) * nA);
    memcpy(cat + nA, idsB, sizeof(int32_t) * nB);
    int32_t nt[2] = {nA, nB};
    float *lg = malloc(sizeof(float) * (nA + nB) * V);
    k3_batch b1 = {.n_seqs = 2, .states = st1, .n_tokens = nt, .token_ids = cat};
    k3_batch b2 = {.n_seqs = 2, .states = st2, .n_tokens = nt, .token_ids = NULL};
    K3_CHECK_OK(k3_stage_forward(s1, &b1, &act, true, NULL));
    K3_CHECK(act.n_bank == (split + c->attn_res_block_size - 1) / c->attn_res_block_size,
             "bank count %d after %d layers", act.n_bank, split);
    K3_CHECK_OK(k3_stage_forward(s2, &b2, &act, true, lg));
    K3_CHECK(memcmp(lg, aloneA, sizeof(float) * nA * V) == 0,
             "seq A: batch/split not bit-identical");
    K3_CHECK(memcmp(lg + (int64_t)nA * V, aloneB, sizeof(float) * nB * V) == 0,
             "seq B: batch/split not bit-identical");
    printf("  2 sequences in one batch, 2 stages (split at layer %d): %s\n", split,
           memcmp(lg, aloneA, sizeof(float) * nA * V) == 0 ? "bit-identical" : "DIFFERENT");
    /* last-token logits of a 2-sequence batch: the final mix of selected rows */
    for (int i = 0; i < 2; i++) {
        K3_CHECK_OK(k3_seq_state_reset(st1[i]));
        K3_CHECK_OK(k3_seq_state_reset(st2[i]));
    }
    K3_CHECK_OK(k3_stage_forward(s1, &b1, &act, false, NULL));
    K3_CHECK_OK(k3_stage_forward(s2, &b2, &act, false, lg));
    K3_CHECK(memcmp(lg, aloneA + (int64_t)(nA - 1) * V, sizeof(float) * V) == 0 &&
                 memcmp(lg + V, aloneB + (int64_t)(nB - 1) * V, sizeof(float) * V) == 0,
             "last-token logits of a batch differ from the all-logits rows");
    free(cat), free(lg), free(aloneA), free(aloneB);
    k3_activ_free(g_cpu, &act);
    for (int i = 0; i < 2; i++) k3_seq_state_destroy(st1[i]), k3_seq_state_destroy(st2[i]);
    k3_stage_destroy(s1);
    k3_stage_destroy(s2);
}

int main(void) {
    printf("test_invariance seed %llu\n", (unsigned long long)k_seed);
    K3_CHECK_OK(k3_backend_create("cpu", &(k3_backend_params){.n_threads = 2}, &g_cpu));
    K3_CHECK_OK(k3_backend_create("ref", NULL, &g_ref));
    if (!g_cpu || !g_ref) return k3_test_done("invariance");
    k3_status st = tiny_make(&g_m, "tiny", 1);
    K3_CHECK_OK(st);
    if (st != K3_OK) return k3_test_done("invariance");
    k3_rng r;
    k3_rng_seed(&r, k_seed);
    const int n = 100;
    int32_t ids[100];
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(k3_rng_u64(&r) % (uint64_t)g_m.cfg.vocab_size);
    layer_report(ids, n);
    test_chunks(ids, n);
    test_decode(ids, 70, 50);
    test_batch_split(ids, 40);
    tiny_close(&g_m);
    k3_backend_destroy(g_cpu);
    k3_backend_destroy(g_ref);
    return k3_test_done("invariance");
}
