/* test_prefix_engine.c — the prefix cache through the engine (issue 31), under mpirun on any
 * S x E (argv: PP EP MODEL_DIR on|off [PREFIX_CACHE_TOKENS [KV_CACHE_TOKENS]]), --deterministic:
 *  - shared system prompt: 6 requests with one 200-token prefix and their own 24-token tails,
 *    one after another (each later one finds the prefix), then the same 6 again all at once;
 *  - a 6-turn conversation: each turn is a new request with the whole history (the previous
 *    prompt, its generated tokens, a new 40-token user turn); with the cache on every turn after
 *    the first must find at least the previous prompt's full blocks;
 * greedy, 6 tokens each, the logits rows kept. Every request's n_cached must be a multiple of the
 * block, less than its prompt, 0 with the cache off, and the engine's prefix_hits the sum of them.
 * It prints `digest <hex>` of every token and logits row: the driver requires the same digest
 * with the cache on, off, under a small budget that evicts, and on every split. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_comm.h"
#include "k3_engine.h"
#include "k3_model.h"
#include "engine/engine_test.h"
#include "k3_test.h"

enum { N_SYS = 6, SYS_LEN = 200, TAIL = 24, TURNS = 6, TURN_LEN = 40, NEW = 6 };
static int64_t V;
static uint64_t g_hash = 0x6b33;
static int64_t g_cached_sum;

/* Run requests [n] (submitted together) to the end; tokens into gen[i][NEW], cached[i]. */
static void run(k3_engine *e, int32_t *const *ids, const int64_t *P, int n, int32_t (*gen)[NEW],
                int64_t *cached, bool on) {
    int64_t id[16];
    float *rows = calloc((size_t)n * NEW * (size_t)V, sizeof(float));
    int n_gen[16] = {0}, left = n;
    for (int i = 0; i < n; i++) {
        k3_request r = {.ids = ids[i],
                        .n_ids = P[i],
                        .max_tokens = NEW,
                        .ignore_eos = true,
                        .keep_logits = true,
                        .user = (uint64_t)i};
        K3_CHECK_OK(k3_engine_submit(e, &r, &id[i]));
    }
    for (int guard = 0; left > 0 && guard < 100000; guard++) {
        const k3_event *ev;
        const int ne = engine_test_step(e, &ev);
        for (int k = 0; k < ne; k++) {
            const int i = (int)ev[k].user;
            if (ev[k].kind == K3_EV_TOKEN) {
                memcpy(rows + ((size_t)i * NEW + (size_t)n_gen[i]) * (size_t)V, ev[k].logits,
                       sizeof(float) * (size_t)V);
                gen[i][n_gen[i]++] = ev[k].token;
            } else {
                K3_CHECK(ev[k].kind == K3_EV_DONE, "request %d failed: %s", i,
                         ev[k].error ? ev[k].error : "?");
                cached[i] = ev[k].n_cached;
                left--;
            }
        }
    }
    for (int i = 0; i < n; i++) {
        K3_CHECK(n_gen[i] == NEW, "request %d: %d tokens", i, n_gen[i]);
        K3_CHECK(cached[i] % K3_KV_BLOCK == 0 && cached[i] < P[i] && (on || cached[i] == 0),
                 "request %d: %lld cached of %lld", i, (long long)cached[i], (long long)P[i]);
        g_cached_sum += cached[i];
        g_hash = k3_hash_bytes(gen[i], sizeof(int32_t) * NEW, g_hash);
        g_hash = k3_hash_bytes(rows + (size_t)i * NEW * (size_t)V, sizeof(float) * NEW * V, g_hash);
    }
    free(rows);
}

int main(int argc, char **argv) {
    k3_engine_opts o;
    int rc;
    if (!engine_test_args(argc, argv, "test_prefix_engine PP EP MODEL_DIR on|off [PC_TOKENS [KV]]",
                          &o, &rc))
        return rc;
    const bool on = !o.no_prefix_cache;
    o.max_seqs = 6, o.max_ctx = 640, o.max_batch_tokens = 160;
    o.prefix_cache_tokens = argc > 5 ? atoll(argv[5]) : 0;
    o.kv_cache_tokens = argc > 6 ? atoll(argv[6]) : 0;
    k3_engine *e;
    if (!engine_test_open(&o, &e, &rc)) return rc;
    k3_config cfg;
    K3_CHECK_OK(k3_config_load(argv[3], &cfg));
    V = cfg.vocab_size;
    k3_rng rng;
    k3_rng_seed(&rng, 3131);
    const uint64_t vt = (uint64_t)V - 256; /* text ids */
    /* shared system prompt */
    int32_t *ids[N_SYS];
    int64_t P[N_SYS], cached[N_SYS];
    int32_t gen[N_SYS][NEW];
    int32_t sys[SYS_LEN];
    for (int t = 0; t < SYS_LEN; t++) sys[t] = (int32_t)(k3_rng_u64(&rng) % vt);
    for (int i = 0; i < N_SYS; i++) {
        P[i] = SYS_LEN + TAIL;
        ids[i] = malloc(sizeof(int32_t) * (size_t)P[i]);
        memcpy(ids[i], sys, sizeof sys);
        for (int t = SYS_LEN; t < P[i]; t++) ids[i][t] = (int32_t)(k3_rng_u64(&rng) % vt);
    }
    int64_t hits_alone = 0;
    for (int i = 0; i < N_SYS; i++) {
        run(e, ids + i, P + i, 1, gen + i, cached + i, on);
        hits_alone += cached[i];
        if (on && i > 0) /* 200 tokens: 3 full blocks; a snapshot at the prompt's last boundary */
            K3_CHECK(cached[i] == 3 * K3_KV_BLOCK, "system prompt request %d: %lld cached", i,
                     (long long)cached[i]);
    }
    run(e, ids, P, N_SYS, gen, cached, on); /* all at once */
    /* a conversation of TURNS turns */
    int32_t *hist = malloc(sizeof(int32_t) * 600);
    int64_t H = 0, prev_P = 0;
    for (int t = 0; t < TURNS; t++) {
        for (int i = 0; i < TURN_LEN; i++) hist[H++] = (int32_t)(k3_rng_u64(&rng) % vt);
        int64_t c1;
        int32_t g1[1][NEW];
        int32_t *hp = hist;
        run(e, &hp, &H, 1, g1, &c1, on);
        if (on && t > 0)
            K3_CHECK(c1 >= prev_P / K3_KV_BLOCK * K3_KV_BLOCK && (prev_P < K3_KV_BLOCK || c1 > 0),
                     "turn %d: %lld cached, the previous prompt had %lld", t, (long long)c1,
                     (long long)prev_P);
        printf("  turn %d: prompt %lld, cached %lld\n", t, (long long)H, (long long)c1);
        prev_P = H;
        memcpy(hist + H, g1[0], sizeof g1[0]);
        H += NEW;
    }
    k3_engine_stats es;
    if (k3_engine_close(e, &es) != K3_OK) k3_engine_abort(e);
    K3_CHECK(es.prefix_cache == on && es.prefix_hits == g_cached_sum,
             "engine prefix hits %lld, events say %lld", (long long)es.prefix_hits,
             (long long)g_cached_sum);
    printf("  %dx%d cache %s (budget %s): hits %lld of %lld prompt tokens looked up, %lld "
           "evictions\n",
           o.pp, o.ep, argv[4], argc > 5 ? argv[5] : "all", (long long)es.prefix_hits,
           (long long)es.prefix_queries, (long long)es.prefix_evictions);
    printf("digest %016llx\n", (unsigned long long)g_hash);
    for (int i = 0; i < N_SYS; i++) free(ids[i]);
    free(hist);
    int r = k3_test_done("prefix_engine");
    k3_comm_finalize();
    return r;
}
