/* test_paged.c — the paged MLA cache and the slot pool of a stage (layers/k3_layers.h "Paged cache
 * and slots") on the tiny checkpoint:
 *  - 8 sequences of very different lengths (1 to 200 prompt tokens, then 4 decode steps, all in
 *    shared batches) through a pool too small for 8 × max_ctx but large enough for their real
 *    lengths give the same logits, bit for bit, as with a pool of 8 × max_ctx, and as each
 *    sequence alone;
 *  - a second wave after the first ended reuses the freed blocks in another order (the stale
 *    rows of the first wave must never be read) and again matches the big pool;
 *  - a sequence that does not fit the pool fails that forward with an error naming the cache,
 *    changes no state, and the other sequences go on to the same logits.
 * Every comparison checks the logits are finite and not degenerate. */
#include "k3_layers.h"
#include "k3_test.h"
#include "layers/tiny_model.h"

#include <math.h>
#include <string.h>

enum { N_SEQ = 8, N_DEC = 4, MAX_CTX = 512 };
static tiny_model g_m;
static k3_backend *g_be;
static const uint64_t k_seed = 777;

typedef struct {
    k3_stage *s;
    k3_seq_state *st[N_SEQ + 1];
    k3_activ act;
    float *logits; /* [max_tokens, V] */
} runner;

static void runner_open(runner *r, int max_seqs, int64_t kv_tokens, int64_t max_tokens) {
    memset(r, 0, sizeof *r);
    const k3_config *c = &g_m.cfg;
    k3_stage_params sp = tiny_whole_stage(&g_m, g_be, max_tokens, max_seqs, MAX_CTX, kv_tokens);
    K3_CHECK_OK(k3_stage_create(&sp, &r->s));
    K3_CHECK_OK(k3_activ_alloc(g_be, &r->act, c, max_tokens));
    K3_CHECK_OK(k3_alloc((void **)&r->logits,
                         (size_t)max_tokens * (size_t)c->vocab_size * sizeof(float), "logits"));
}
static void runner_close(runner *r) {
    for (int i = 0; i <= N_SEQ; i++) k3_seq_state_destroy(r->st[i]);
    k3_activ_free(g_be, &r->act);
    k3_free(r->logits);
    k3_stage_destroy(r->s);
}

/* One forward of sequences idx[0..n) with nt[i] tokens each from ids[i] + off[i]; the last-token
   logits of each into out[idx[i]] (+ step·V). */
static k3_status step(runner *r, const int *idx, int n, const int32_t *nt, int32_t *const *ids,
                      const int *off, float *out, int step_i) {
    const int64_t V = g_m.cfg.vocab_size;
    k3_seq_state *st[N_SEQ + 1];
    int32_t flat[1024];
    int64_t T = 0;
    for (int i = 0; i < n; i++) {
        st[i] = r->st[idx[i]];
        memcpy(flat + T, ids[idx[i]] + off[idx[i]], (size_t)nt[i] * sizeof(int32_t));
        T += nt[i];
    }
    k3_batch b = {.n_seqs = n, .states = st, .n_tokens = nt, .token_ids = flat};
    K3_TRY(k3_stage_forward(r->s, &b, &r->act, false, r->logits));
    for (int i = 0; i < n; i++)
        memcpy(out + ((int64_t)idx[i] * (N_DEC + 1) + step_i) * V, r->logits + (int64_t)i * V,
               (size_t)V * sizeof(float));
    return K3_OK;
}

/* A wave: create the states, prefill all sequences in one batch, then N_DEC decode steps of all
   of them; out [N_SEQ, N_DEC + 1, V]. order: the slot/creation order. */
static void wave(runner *r, const int *len, int32_t *const *ids, const int *order, float *out) {
    int idx[N_SEQ], off[N_SEQ] = {0};
    int32_t nt[N_SEQ];
    for (int i = 0; i < N_SEQ; i++)
        K3_CHECK_OK(k3_seq_state_create(r->s, MAX_CTX, &r->st[order[i]]));
    for (int i = 0; i < N_SEQ; i++) idx[i] = order[i], nt[i] = len[order[i]];
    K3_CHECK_OK(step(r, idx, N_SEQ, nt, ids, off, out, 0));
    for (int d = 1; d <= N_DEC; d++) {
        for (int i = 0; i < N_SEQ; i++) off[idx[i]] = len[idx[i]] + d - 1, nt[i] = 1;
        K3_CHECK_OK(step(r, idx, N_SEQ, nt, ids, off, out, d));
    }
}
static void end_wave(runner *r) {
    for (int i = 0; i < N_SEQ; i++) {
        k3_seq_state_destroy(r->st[i]);
        r->st[i] = NULL;
    }
}

static void check_same(const float *a, const float *b, int64_t n, const char *what) {
    k3_check_same_bits(a, b, n, 1e-3, what);
}

int main(void) {
    printf("test_paged seed %llu\n", (unsigned long long)k_seed);
    k3_backend_params bp = {.n_threads = 2};
    K3_CHECK_OK(k3_backend_create("cpu", &bp, &g_be));
    K3_CHECK_OK(tiny_make(&g_m, "tiny", 7));
    if (k3_t_fail) return k3_test_done("paged");
    const k3_config *c = &g_m.cfg;
    const int64_t V = c->vocab_size, per = (int64_t)N_SEQ * (N_DEC + 1) * V;
    k3_rng rng;
    k3_rng_seed(&rng, k_seed);
    const int len[2][N_SEQ] = {{3, 70, 130, 1, 200, 9, 64, 33}, {150, 2, 66, 129, 5, 40, 1, 90}};
    int32_t *ids[2][N_SEQ];
    int blocks = 0; /* what the real lengths need: the smaller pool */
    for (int w = 0; w < 2; w++)
        for (int i = 0; i < N_SEQ; i++) {
            K3_CHECK_OK(
                k3_alloc((void **)&ids[w][i], sizeof(int32_t) * (len[w][i] + N_DEC), "ids"));
            for (int t = 0; t < len[w][i] + N_DEC; t++)
                ids[w][i][t] = (int32_t)(k3_rng_u64(&rng) % (uint64_t)V);
        }
    for (int w = 0; w < 2; w++) {
        int b = 0;
        for (int i = 0; i < N_SEQ; i++) b += (len[w][i] + N_DEC + K3_KV_BLOCK - 1) / K3_KV_BLOCK;
        blocks = K3_MAX(blocks, b);
    }
    const int64_t small_tokens = (int64_t)blocks * K3_KV_BLOCK;
    printf("  pool: %lld tokens (%d blocks) against %d x %d = %d\n", (long long)small_tokens,
           blocks, N_SEQ, MAX_CTX, N_SEQ * MAX_CTX);
    K3_CHECK(small_tokens < (int64_t)N_SEQ * MAX_CTX, "the small pool is smaller than 8 x max_ctx");

    float *big = NULL, *small = NULL, *alone = NULL;
    K3_CHECK_OK(k3_alloc((void **)&big, (size_t)(2 * per) * sizeof(float), "big"));
    K3_CHECK_OK(k3_alloc((void **)&small, (size_t)(2 * per) * sizeof(float), "small"));
    K3_CHECK_OK(k3_alloc((void **)&alone, (size_t)per * sizeof(float), "alone"));
    const int fwd[N_SEQ] = {0, 1, 2, 3, 4, 5, 6, 7}, rev[N_SEQ] = {7, 5, 3, 1, 6, 4, 2, 0};
    runner R;
    for (int pool = 0; pool < 2; pool++) { /* 0: 8 x max_ctx, 1: the real lengths' blocks */
        runner_open(&R, N_SEQ + 1, pool ? small_tokens : 0, 1024);
        float *out = pool ? small : big;
        if (pool == 0) { /* a sequence holding 2 blocks first: the waves get other block ids */
            K3_CHECK_OK(k3_seq_state_create(R.s, MAX_CTX, &R.st[N_SEQ]));
            int32_t n100 = 100;
            k3_batch b = {
                .n_seqs = 1, .states = &R.st[N_SEQ], .n_tokens = &n100, .token_ids = ids[1][0]};
            K3_CHECK_OK(k3_stage_forward(R.s, &b, &R.act, false, R.logits));
        }
        /* the pools see the sequences in other orders: other block tables for the same logits */
        wave(&R, len[0], ids[0], pool ? rev : fwd, out);
        end_wave(&R);
        int fr = 0, tot = 0;
        k3_stage_cache_usage(R.s, &fr, &tot);
        K3_CHECK(fr == tot - (pool == 0 ? 2 : 0),
                 "every block of the wave back in the pool after it (%d of %d free)", fr, tot);
        wave(&R, len[1], ids[1], pool ? fwd : rev, out + per); /* the freed blocks, reused */
        if (pool == 1) {
            /* one more sequence of 300 tokens does not fit: refused, nothing changed */
            int fr0 = 0;
            k3_stage_cache_usage(R.s, &fr0, NULL);
            K3_CHECK_OK(k3_seq_state_create(R.s, MAX_CTX, &R.st[N_SEQ]));
            int32_t *big_ids = NULL;
            K3_CHECK_OK(k3_alloc((void **)&big_ids, 300 * sizeof(int32_t), "ids"));
            for (int t = 0; t < 300; t++) big_ids[t] = t % (int)V;
            int32_t n300 = 300;
            k3_batch b = {
                .n_seqs = 1, .states = &R.st[N_SEQ], .n_tokens = &n300, .token_ids = big_ids};
            K3_CHECK_ERR(k3_stage_forward(R.s, &b, &R.act, false, R.logits), K3_ERR_NOMEM,
                         "paged MLA cache is full");
            int fr1 = 0;
            k3_stage_cache_usage(R.s, &fr1, NULL);
            K3_CHECK(fr1 == fr0 && k3_seq_state_pos(R.st[N_SEQ]) == 0,
                     "a refused forward changes nothing (free %d -> %d, pos %lld)", fr0, fr1,
                     (long long)k3_seq_state_pos(R.st[N_SEQ]));
            k3_free(big_ids);
        }
        runner_close(&R);
    }
    check_same(small, big, per, "wave 1: small pool vs 8 x max_ctx");
    check_same(small + per, big + per, per, "wave 2 (reused blocks): small pool vs 8 x max_ctx");

    /* each sequence alone (a stage that grows its pools), same bits */
    for (int i = 0; i < N_SEQ; i++) {
        runner_open(&R, 0, 0, 1024);
        K3_CHECK_OK(k3_seq_state_create(R.s, MAX_CTX, &R.st[i]));
        int idx = i, off[N_SEQ] = {0};
        int32_t nt = len[0][i];
        K3_CHECK_OK(step(&R, &idx, 1, &nt, ids[0], off, alone, 0));
        for (int d = 1; d <= N_DEC; d++) {
            off[i] = len[0][i] + d - 1, nt = 1;
            K3_CHECK_OK(step(&R, &idx, 1, &nt, ids[0], off, alone, d));
        }
        runner_close(&R);
    }
    check_same(alone, big, per, "each sequence alone vs the shared batches");

    for (int w = 0; w < 2; w++)
        for (int i = 0; i < N_SEQ; i++) k3_free(ids[w][i]);
    k3_free(big), k3_free(small), k3_free(alone);
    tiny_close(&g_m);
    k3_backend_destroy(g_be);
    return k3_test_done("paged");
}
