/* test_sampler.c — unit tests of coordinator/k3_sampler.h.
 * Exact, hand-computed cases for each knob (greedy, logit bias, repetition / presence /
 * frequency penalties and their window, top-k, top-p, min-p, temperature and their order), a
 * full-sort cross-check of top-p on a 163,840-id vocabulary, seed determinism, chi-square tests
 * that temperature (and top-k) sampling follows the softmax (threshold in tolerances.h), and stop
 * ids / stop strings across token boundaries with the o200k vocabulary (needs K3_TESTDATA). */
#include "k3_sampler.h"
#include "k3_test.h"
#include "tolerances.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

#define NEAR(a, b) (fabs((double)(a) - (double)(b)) < 1e-6)

static k3_sampler *mk(k3_sampler_params p, int64_t n) {
    k3_sampler *s = NULL;
    k3_status st = k3_sampler_create(&s, &p, n, NULL);
    K3_CHECK(st == K3_OK, "create: %s", k3_last_error());
    return s;
}

static void check_probs(k3_sampler *s, const float *logits, const double *want, int n,
                        const char *what) {
    float probs[16];
    K3_CHECK_OK(k3_sampler_probs(s, logits, probs));
    bool ok = true;
    for (int i = 0; i < n; i++) ok &= NEAR(probs[i], want[i]);
    K3_CHECK(ok, "%s: got %.6f %.6f %.6f %.6f", what, probs[0], probs[1], probs[2], probs[3]);
}

static void test_exact(void) {
    const float l4[4] = {1, 3, 3, 2};
    k3_sampler *s = mk((k3_sampler_params){.temperature = 0}, 4);
    int32_t id = -1;
    K3_CHECK_OK(k3_sampler_sample(s, l4, &id));
    K3_CHECK(id == 1, "greedy picks the lowest id among equal maxima, got %d", id);
    k3_sampler_destroy(s);

    k3_logit_bias b[] = {{0, 5.0f}, {2, -1.5f}};
    s = mk((k3_sampler_params){.temperature = 0, .logit_bias = b, .n_logit_bias = 2}, 4);
    float out[4];
    K3_CHECK_OK(k3_sampler_process_logits(s, l4, out));
    K3_CHECK(out[0] == 6 && out[1] == 3 && out[2] == 1.5f && out[3] == 2, "logit bias adds");
    K3_CHECK_OK(k3_sampler_sample(s, l4, &id));
    K3_CHECK(id == 0, "bias changes the greedy choice");
    k3_sampler_destroy(s);

    /* rep 2, presence 0.5, frequency 0.25; history 1,1,2.
     * id1: 4/2 - 0.25*2 - 0.5 = 1.0; id2: -2*2 - 0.25 - 0.5 = -4.75; ids 0, 3 untouched. */
    const float lp[4] = {1, 4, -2, 3};
    s = mk((k3_sampler_params){.temperature = 1,
                               .repetition_penalty = 2,
                               .presence_penalty = 0.5f,
                               .frequency_penalty = 0.25f},
           4);
    const int32_t hist[] = {1, 1, 2};
    K3_CHECK_OK(k3_sampler_accept_prompt(s, hist, 3));
    K3_CHECK_OK(k3_sampler_process_logits(s, lp, out));
    K3_CHECK(out[0] == 1 && NEAR(out[1], 1.0) && NEAR(out[2], -4.75) && out[3] == 3,
             "penalties: %g %g %g %g", out[0], out[1], out[2], out[3]);
    k3_sampler_destroy(s);

    /* Window of 2: after 1,1,2 only {1, 2} count once each. frequency 1 -> -1 each. */
    const float z[4] = {0, 0, 0, 0};
    s = mk((k3_sampler_params){.temperature = 1, .frequency_penalty = 1, .penalty_last_n = 2}, 4);
    K3_CHECK_OK(k3_sampler_accept_prompt(s, hist, 3));
    K3_CHECK_OK(k3_sampler_process_logits(s, z, out));
    K3_CHECK(out[0] == 0 && out[1] == -1 && out[2] == -1 && out[3] == 0, "window: %g %g %g %g",
             out[0], out[1], out[2], out[3]);
    const int32_t more[] = {3, 3};
    K3_CHECK_OK(k3_sampler_accept_prompt(s, more, 2)); /* window = {3, 3} */
    K3_CHECK_OK(k3_sampler_process_logits(s, z, out));
    K3_CHECK(out[0] == 0 && out[1] == 0 && out[2] == 0 && out[3] == -2,
             "window slides: %g %g %g %g", out[0], out[1], out[2], out[3]);
    K3_CHECK_OK(k3_sampler_accept_prompt(s, hist, 1)); /* window = {3, 1} */
    K3_CHECK_OK(k3_sampler_process_logits(s, z, out));
    K3_CHECK(out[1] == -1 && out[3] == -1 && out[2] == 0, "window re-adds an evicted id");
    k3_sampler_destroy(s);

    /* top-k 2 on 1,2,3,4 (T=1): e^3/(e^3+e^4), e^4/(e^3+e^4). */
    const float lk[4] = {1, 2, 3, 4};
    s = mk((k3_sampler_params){.temperature = 1, .top_k = 2}, 4);
    double e3 = exp(3), e4 = exp(4);
    check_probs(s, lk, (double[]){0, 0, e3 / (e3 + e4), e4 / (e3 + e4)}, 4, "top_k");
    k3_sampler_destroy(s);

    /* p = .1 .2 .3 .4 */
    const float lq[4] = {logf(0.1f), logf(0.2f), logf(0.3f), logf(0.4f)};
    s = mk((k3_sampler_params){.temperature = 1, .top_p = 0.65f}, 4);
    check_probs(s, lq, (double[]){0, 0, 3.0 / 7, 4.0 / 7}, 4, "top_p 0.65 keeps .4 .3");
    k3_sampler_destroy(s);
    s = mk((k3_sampler_params){.temperature = 1, .top_p = 0.75f}, 4);
    check_probs(s, lq, (double[]){0, 2.0 / 9, 3.0 / 9, 4.0 / 9}, 4, "top_p 0.75 keeps .4 .3 .2");
    k3_sampler_destroy(s);
    s = mk((k3_sampler_params){.temperature = 1, .min_p = 0.45f}, 4);
    check_probs(s, lq, (double[]){0, 2.0 / 9, 3.0 / 9, 4.0 / 9}, 4, "min_p 0.45: p >= 0.18");
    k3_sampler_destroy(s);
    s = mk((k3_sampler_params){.temperature = 1, .min_p = 0.8f}, 4);
    check_probs(s, lq, (double[]){0, 0, 0, 1}, 4, "min_p 0.8: p >= 0.32");
    k3_sampler_destroy(s);
    /* T = 2: p ~ sqrt(.1 .2 .3 .4); then top_p 0.5 applies to the tempered p: keeps ids 3, 2. */
    double r[4], sum = 0;
    for (int i = 0; i < 4; i++) sum += r[i] = sqrt(0.1 * (i + 1));
    s = mk((k3_sampler_params){.temperature = 2}, 4);
    check_probs(s, lq, (double[]){r[0] / sum, r[1] / sum, r[2] / sum, r[3] / sum}, 4,
                "temperature 2");
    k3_sampler_destroy(s);
    s = mk((k3_sampler_params){.temperature = 2, .top_p = 0.5f}, 4);
    check_probs(s, lq, (double[]){0, 0, r[2] / (r[2] + r[3]), r[3] / (r[2] + r[3])}, 4,
                "temperature before top_p");
    k3_sampler_destroy(s);
    /* min_p on the tempered distribution: T=2, min_p 0.6 -> thr 0.6 * r3 = 0.379 -> keep r2
     * (0.547), r3. */
    s = mk((k3_sampler_params){.temperature = 2, .min_p = 0.6f}, 4);
    check_probs(s, lq,
                (double[]){0, r[1] / (r[1] + r[2] + r[3]), r[2] / (r[1] + r[2] + r[3]),
                           r[3] / (r[1] + r[2] + r[3])},
                4, "min_p on tempered p");
    k3_sampler_destroy(s);

    /* Validation. */
    k3_sampler *bad = NULL;
    K3_CHECK_ERR(k3_sampler_create(&bad, &(k3_sampler_params){.temperature = -1}, 4, NULL),
                 K3_ERR_ARG, "temperature");
    K3_CHECK_ERR(
        k3_sampler_create(&bad, &(k3_sampler_params){.temperature = 1, .top_p = 1.5f}, 4, NULL),
        K3_ERR_ARG, "top_p");
    K3_CHECK_ERR(
        k3_sampler_create(&bad, &(k3_sampler_params){.temperature = 1, .top_k = -2}, 4, NULL),
        K3_ERR_ARG, "top_k");
    k3_logit_bias bb = {7, 1};
    K3_CHECK_ERR(k3_sampler_create(&bad, &(k3_sampler_params){.logit_bias = &bb, .n_logit_bias = 1},
                                   4, NULL),
                 K3_ERR_ARG, "logit_bias id 7");
    const char *ss[] = {"x"};
    K3_CHECK_ERR(k3_sampler_create(
                     &bad, &(k3_sampler_params){.stop_strings = ss, .n_stop_strings = 1}, 4, NULL),
                 K3_ERR_ARG, "need a tokenizer");
    K3_CHECK(bad == NULL, "no sampler on failure");
    const float nanl[4] = {0, NAN, 0, 0};
    s = mk((k3_sampler_params){.temperature = 1}, 4);
    K3_CHECK_ERR(k3_sampler_sample(s, nanl, &id), K3_ERR_ARG, "NaN");
    k3_sampler_destroy(s);
    k3_sampler_destroy(NULL);
}

/* Wilson-Hilferty upper quantile of chi-square(df) at one-sided normal quantile z. */
static double chi2_crit(int df, double z) {
    double a = 2.0 / (9.0 * df);
    return df * pow(1 - a + z * sqrt(a), 3);
}

static double chi2_stat(const int64_t *obs, const double *p, int k, int64_t n, int *df) {
    double x = 0;
    *df = -1;
    for (int i = 0; i < k; i++) {
        if (p[i] == 0) {
            if (obs[i]) return INFINITY; /* an impossible id was drawn */
            continue;
        }
        double e = p[i] * (double)n;
        x += (obs[i] - e) * (obs[i] - e) / e;
        (*df)++;
    }
    return x;
}

static void test_chi2(void) {
    enum { K = 10 };
    const int64_t N = 200000;
    k3_rng rng;
    k3_rng_seed(&rng, 42);
    float logits[K];
    for (int i = 0; i < K; i++) logits[i] = 1.5f * k3_rng_normal(&rng);
    printf("  chi2 seed 42, logits:");
    for (int i = 0; i < K; i++) printf(" %.3f", logits[i]);
    printf("\n");
    for (int mode = 0; mode < 2; mode++) {
        const double T = 0.7;
        const int top_k = mode ? 4 : 0;
        /* Expected (independent of the sampler): softmax(l / T) over the kept ids, in double. */
        double p[K] = {0}, p_t1[K] = {0}, sum = 0, sum1 = 0;
        int order[K];
        for (int i = 0; i < K; i++) order[i] = i;
        for (int i = 0; i < K; i++)
            for (int j = i + 1; j < K; j++)
                if (logits[order[j]] > logits[order[i]]) {
                    int t = order[i];
                    order[i] = order[j];
                    order[j] = t;
                }
        for (int r = 0; r < (top_k ? top_k : K); r++) {
            int i = order[r];
            sum += p[i] = exp(logits[i] / T);
            sum1 += p_t1[i] = exp(logits[i]);
        }
        for (int i = 0; i < K; i++) {
            p[i] /= sum;
            p_t1[i] /= sum1;
        }
        k3_sampler *s =
            mk((k3_sampler_params){.temperature = (float)T, .top_k = top_k, .seed = 7}, K);
        int64_t obs[K] = {0};
        for (int64_t d = 0; d < N; d++) {
            int32_t id = -1;
            k3_sampler_sample(s, logits, &id);
            if (id >= 0 && id < K) obs[id]++;
        }
        k3_sampler_destroy(s);
        int df, df1;
        double x = chi2_stat(obs, p, K, N, &df), x1 = chi2_stat(obs, p_t1, K, N, &df1);
        double crit = chi2_crit(df, K3_TOL_CHI2_Z);
        printf(
            "  chi2 %s: X2 = %.2f (df %d, critical %.2f at p = %g); vs the T=1 softmax X2 = %.1f\n",
            top_k ? "T=0.7 top_k=4" : "T=0.7", x, df, crit, K3_TOL_CHI2_PVALUE, x1);
        K3_CHECK(x < crit, "sampling does not follow softmax(l/T): X2 %.2f >= %.2f", x, crit);
        /* Power: the same draws must reject the wrong distribution (temperature ignored). */
        K3_CHECK(x1 > chi2_crit(df1, K3_TOL_CHI2_Z), "the test cannot tell T=0.7 from T=1");
    }
}

static void test_determinism_and_big_vocab(void) {
    const int64_t n = 163840;
    float *l = malloc(n * sizeof *l), *pr = malloc(n * sizeof *pr);
    k3_rng rng;
    k3_rng_seed(&rng, 99);
    for (int64_t i = 0; i < n; i++) l[i] = 3.0f * k3_rng_normal(&rng);
    k3_sampler_params P = {.temperature = 0.8f, .top_p = 0.9f, .seed = 1234};
    k3_sampler *a = mk(P, n), *b = mk(P, n);
    P.seed = 1235;
    k3_sampler *c = mk(P, n);
    int same_ab = 0, same_ac = 0;
    for (int i = 0; i < 50; i++) {
        int32_t x = -1, y = -2, w = -3;
        k3_sampler_sample(a, l, &x);
        k3_sampler_sample(b, l, &y);
        k3_sampler_sample(c, l, &w);
        same_ab += x == y;
        same_ac += x == w;
    }
    K3_CHECK(same_ab == 50, "same seed -> same tokens (%d/50)", same_ab);
    K3_CHECK(same_ac < 50, "another seed -> other tokens");
    /* top-p kept set vs an independent full sort (in double). */
    K3_CHECK_OK(k3_sampler_probs(a, l, pr));
    double *q = malloc(n * sizeof *q), sum = 0, mx = -1e30;
    int64_t *idx = malloc(n * sizeof *idx);
    for (int64_t i = 0; i < n; i++) mx = l[i] > mx ? l[i] : mx;
    for (int64_t i = 0; i < n; i++) {
        sum += q[i] = exp((l[i] - mx) / 0.8);
        idx[i] = i;
    }
    /* selection by repeated max over the few top entries: the nucleus is small */
    int64_t kept = 0;
    double cum = 0;
    bool ok = true;
    while (cum < 0.9 * sum) {
        int64_t best = -1;
        for (int64_t i = 0; i < n; i++)
            if (q[i] >= 0 && (best < 0 || q[i] > q[best])) best = i;
        cum += q[best];
        q[best] = -1; /* mark kept */
        kept++;
    }
    int64_t nz = 0;
    for (int64_t i = 0; i < n; i++) {
        if (pr[i] > 0) nz++;
        ok &= (pr[i] > 0) == (q[i] < 0);
    }
    K3_CHECK(ok && nz == kept && kept > 10,
             "top-p nucleus: %lld kept by sampler, %lld by full sort", (long long)nz,
             (long long)kept);
    free(q);
    free(idx);
    k3_sampler_destroy(a);
    k3_sampler_destroy(b);
    k3_sampler_destroy(c);
    free(l);
    free(pr);
}

/* Feed the ids of `text` through accept; returns the stop kind, emitted text in *emit. */
static k3_stop_kind feed(k3_sampler *s, const k3_tokenizer *t, const char *text, k3_tok_bytes *emit,
                         int *n_ids) {
    k3_tok_ids ids = {0};
    K3_CHECK_OK(k3_tok_encode(t, text, strlen(text), true, &ids));
    k3_stop_kind st = K3_STOP_NONE;
    *n_ids = (int)ids.n;
    for (size_t i = 0; i < ids.n && st == K3_STOP_NONE; i++)
        K3_CHECK_OK(k3_sampler_accept(s, ids.ids[i], emit, &st));
    if (st == K3_STOP_NONE) K3_CHECK_OK(k3_sampler_finish(s, emit));
    k3_tok_ids_free(&ids);
    return st;
}

static void test_stops(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/vocab/o200k_base.tiktoken", k3_test_data());
    k3_tokenizer *t = NULL;
    K3_CHECK_OK(k3_tok_create_tiktoken(&t, path, NULL, K3_TOK_K3_LAYOUT, NULL));
    if (!t) return;
    int32_t eom = k3_tok_control_ids(t).end_of_msg;
    const char *stops[] = {"world!", "END", "界"};
    k3_sampler_params P = {.temperature = 1,
                           .stop_ids = &eom,
                           .n_stop_ids = 1,
                           .stop_strings = stops,
                           .n_stop_strings = 3};
    k3_sampler *s = NULL;
    K3_CHECK_OK(k3_sampler_create(&s, &P, k3_tok_n_vocab(t), t));
    if (!s) {
        k3_tok_destroy(t);
        return;
    }
    k3_tok_bytes e = {0};
    int n;
    k3_stop_kind st = feed(s, t, "Hello world! more", &e, &n);
    K3_CHECK(st == K3_STOP_STRING && k3_sampler_matched_stop(s) == 0 && e.n == 6 &&
                 !memcmp(e.data, "Hello ", 6),
             "stop string across tokens: emitted '%s'", e.data ? e.data : "");
    K3_CHECK(n >= 3, "'world!' spans several tokens");
    k3_stop_kind st2;
    K3_CHECK_ERR(k3_sampler_accept(s, 11, &e, &st2), K3_ERR_STATE, "stopped");
    e.n = 0;
    k3_sampler_reset(s, 1);
    st = feed(s, t, "the EN of END", &e, &n);
    K3_CHECK(st == K3_STOP_STRING && e.n == 10 && !memcmp(e.data, "the EN of ", 10),
             "held prefix released: '%s'", e.data ? e.data : "");
    e.n = 0;
    k3_sampler_reset(s, 1);
    st = feed(s, t, "你好世界!", &e, &n);
    K3_CHECK(st == K3_STOP_STRING && !strcmp(e.data, "你好世"), "multi-byte stop string: '%s'",
             e.data);
    e.n = 0;
    k3_sampler_reset(s, 1);
    st = feed(s, t, "Hi worl<|end_of_msg|>tail", &e, &n);
    K3_CHECK(st == K3_STOP_ID && !strcmp(e.data, "Hi worl"), "stop id flushes held text: '%s'",
             e.data);
    e.n = 0;
    k3_sampler_reset(s, 1);
    st = feed(s, t, "no stop here, EN", &e, &n);
    K3_CHECK(st == K3_STOP_NONE && !strcmp(e.data, "no stop here, EN"), "finish flushes: '%s'",
             e.data);
    /* Emission is incremental: text is released before the end when it cannot start a stop. */
    e.n = 0;
    k3_sampler_reset(s, 1);
    k3_tok_ids ids = {0};
    K3_CHECK_OK(k3_tok_encode(t, "alpha beta gamma", 16, false, &ids));
    K3_CHECK_OK(k3_sampler_accept(s, ids.ids[0], &e, &st));
    K3_CHECK(e.n > 0, "first token's text is emitted at once");
    k3_tok_ids_free(&ids);
    k3_tok_bytes_free(&e);
    k3_sampler_destroy(s);
    k3_tok_destroy(t);
}

/* Extreme parameters stay finite: a temperature so small that 1/t overflows a float is greedy in
 * the limit (ties share the mass) instead of NaN -> id 0; a huge bias or penalty saturates at
 * +-FLT_MAX instead of inf (inf - inf = NaN); a repetition penalty below the documented minimum is
 * rejected. Expected values are the analytic limits. */
static void test_extremes(void) {
    const float l4[4] = {1, 3, 2, 3};
    int32_t id = -1;
    k3_sampler *s = mk((k3_sampler_params){.temperature = 1e-39f}, 4);
    K3_CHECK(1.0f / 1e-39f == INFINITY, "1e-39 is a temperature whose float 1/t overflows");
    check_probs(s, l4, (double[]){0, 0.5, 0, 0.5}, 4, "t = 1e-39: the two maxima share the mass");
    const float l1[4] = {-5, 0.25f, 7, 6.5f};
    K3_CHECK_OK(k3_sampler_sample(s, l1, &id));
    K3_CHECK(id == 2, "t = 1e-39 samples the argmax, got %d", id);
    k3_sampler_destroy(s);
    s = mk((k3_sampler_params){.temperature = 1e-39f, .top_p = 0.3f, .min_p = 0.5f}, 4);
    check_probs(s, l1, (double[]){0, 0, 1, 0}, 4, "t = 1e-39 with top_p / min_p");
    k3_sampler_destroy(s);

    /* repetition penalty at the minimum: l / r = 3e4 for seen ids, both finite */
    s = mk((k3_sampler_params){.temperature = 1,
                               .repetition_penalty = (float)K3_SAMPLER_MIN_REPETITION_PENALTY},
           4);
    const int32_t seen[2] = {1, 3};
    K3_CHECK_OK(k3_sampler_accept_prompt(s, seen, 2));
    float out[4];
    K3_CHECK_OK(k3_sampler_process_logits(s, l4, out));
    K3_CHECK(isfinite(out[1]) && isfinite(out[3]) && out[1] == out[3] && out[1] > 2.9e4f,
             "min repetition penalty: finite %g %g", out[1], out[3]);
    check_probs(s, l4, (double[]){0, 0.5, 0, 0.5}, 4, "min repetition penalty: no NaN");
    k3_sampler_destroy(s);
    k3_sampler *bad = NULL;
    K3_CHECK_ERR(
        k3_sampler_create(
            &bad, &(k3_sampler_params){.temperature = 1, .repetition_penalty = 1e-40f}, 4, NULL),
        K3_ERR_ARG, "repetition_penalty");
    K3_CHECK_ERR(
        k3_sampler_create(&bad, &(k3_sampler_params){.temperature = 1, .repetition_penalty = 1e-5f},
                          4, NULL),
        K3_ERR_ARG, "repetition_penalty");
    K3_CHECK(bad == NULL, "no sampler on failure");

    /* saturation: two ids pushed past FLT_MAX by bias + frequency penalty stay finite and tie */
    k3_logit_bias big[2] = {{0, 3e38f}, {2, 3e38f}};
    const float lb[4] = {1e38f, 0, 1e38f, 0};
    s = mk((k3_sampler_params){.temperature = 1, .logit_bias = big, .n_logit_bias = 2}, 4);
    K3_CHECK_OK(k3_sampler_process_logits(s, lb, out));
    K3_CHECK(out[0] == FLT_MAX && out[2] == FLT_MAX, "bias saturates at FLT_MAX: %g", out[0]);
    check_probs(s, lb, (double[]){0.5, 0, 0.5, 0}, 4, "saturated logits: no NaN");
    k3_sampler_destroy(s);
    s = mk((k3_sampler_params){.temperature = 1, .frequency_penalty = -3e38f}, 4);
    const int32_t twice[4] = {1, 1, 3, 3};
    K3_CHECK_OK(k3_sampler_accept_prompt(s, twice, 4));
    K3_CHECK_OK(k3_sampler_process_logits(s, l4, out));
    K3_CHECK(out[1] == FLT_MAX && out[3] == FLT_MAX, "frequency penalty saturates: %g", out[1]);
    check_probs(s, l4, (double[]){0, 0.5, 0, 0.5}, 4, "frequency penalty overflow: no NaN");
    k3_sampler_destroy(s);
}

int main(void) {
    test_exact();
    test_extremes();
    test_chi2();
    test_determinism_and_big_vocab();
    test_stops();
    return k3_test_done("sampler");
}
