/* test_fork_engine.c — n > 1 choices of one prefill through the engine (issue 32): a request
 * submitted with k3_request.fork shares the prefill of its parent and goes on from a copy of its
 * state. Under mpirun on any S x E (argv: PP EP MODEL_DIR on|off [KDA_CHUNK [KV_TOKENS]]),
 * --deterministic; a small KV_TOKENS makes the prefix cache evict to make room for the forks.
 * For prompts that end on a block boundary (128), mid-block (165: the copy-on-write block) and
 * long (300: two prefill steps, many KDA chunks with KDA_CHUNK 16):
 *  - a family of 3 (the parent, 2 forks; seeds s, s+1, s+2, temperature 1) gives exactly the
 *    tokens, logprobs and logits rows of 3 requests run on their own with those seeds;
 *  - the engine ran the prompt once for the family (k3_engine_stats.prompt_tokens grows by P) and
 *    made 2 forks;
 *  - the parent and one fork cancelled after their first tokens, or a parent with max_tokens 1
 *    (it ends in the step that forks it): the other choices still equal their runs alone;
 *  - a family larger than the lane's free slots: the forks that do not fit run their own prefill
 *    (fork_fallbacks) and still give the same results (with recurrent KDA: chunked KDA's sums
 *    depend on where prefill steps split a prompt).
 * After everything no block is reserved on rank 0's books, and at close no stage holds a block
 * that is neither a running sequence's nor the prefix cache's (kv_blocks_leaked == 0). It prints
 * `digest <hex>` of every token and logits row (the driver compares splits and cache on/off). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_comm.h"
#include "k3_engine.h"
#include "k3_model.h"
#include "engine/engine_test.h"
#include "k3_test.h"

enum { NEW = 8, MAXN = 8 };
static int64_t V;
static uint64_t g_hash = 0x6b34;

typedef struct choice {
    int max_tokens;
    int cancel_after; /* cancel once it has this many tokens (0: never) */
    uint64_t seed;
    int n;
    bool done;
    int32_t tok[NEW];
    float lp[NEW];
    float *rows; /* [NEW, V] */
} choice;

/* Run n choices of one prompt to the end: with fork, choice i > 0 forks choice 0. */
static void run(k3_engine *e, const int32_t *ids, int64_t P, choice *c, int n, bool fork) {
    int64_t id[MAXN] = {-1};
    for (int i = 0; i < n; i++) {
        c[i].n = 0, c[i].done = false;
        free(c[i].rows);
        c[i].rows = calloc((size_t)NEW * (size_t)V, sizeof(float));
        k3_request r = {.ids = ids,
                        .n_ids = P,
                        .max_tokens = c[i].max_tokens,
                        .sampling = {.temperature = 1.0f, .seed = c[i].seed},
                        .ignore_eos = true,
                        .logprobs = 3,
                        .keep_logits = true,
                        .user = (uint64_t)i,
                        .fork = fork && i > 0,
                        .fork_of = id[0]};
        K3_CHECK_OK(k3_engine_submit(e, &r, &id[i]));
    }
    int left = n;
    for (int guard = 0; left > 0 && guard < 100000; guard++) {
        const k3_event *ev;
        const int ne = engine_test_step(e, &ev);
        for (int k = 0; k < ne; k++) {
            choice *q = &c[ev[k].user];
            if (ev[k].kind == K3_EV_TOKEN) {
                K3_CHECK(q->n < NEW, "choice %d: too many tokens", (int)ev[k].user);
                if (q->n >= NEW) continue;
                memcpy(q->rows + (size_t)q->n * (size_t)V, ev[k].logits, sizeof(float) * (size_t)V);
                q->lp[q->n] = ev[k].logprob;
                q->tok[q->n++] = ev[k].token;
                if (q->cancel_after > 0 && q->n == q->cancel_after)
                    K3_CHECK_OK(k3_engine_cancel(e, id[ev[k].user]));
            } else {
                K3_CHECK(ev[k].kind == K3_EV_DONE, "choice %d failed: %s", (int)ev[k].user,
                         ev[k].error ? ev[k].error : "?");
                q->done = true;
                left--;
            }
        }
    }
    K3_CHECK(left == 0, "%d choices never ended", left);
}

/* The first `upto` tokens of a (forked) and b (alone) are the same, bit for bit. */
static void same(const char *what, int i, const choice *a, const choice *b, int upto) {
    K3_CHECK(a->n >= upto && b->n >= upto, "%s choice %d: %d and %d tokens, want %d", what, i, a->n,
             b->n, upto);
    if (a->n < upto || b->n < upto) return;
    K3_CHECK(memcmp(a->tok, b->tok, sizeof(int32_t) * (size_t)upto) == 0 &&
                 memcmp(a->lp, b->lp, sizeof(float) * (size_t)upto) == 0 &&
                 memcmp(a->rows, b->rows, sizeof(float) * (size_t)upto * (size_t)V) == 0,
             "%s choice %d: forked tokens/logprobs/logits differ from its run alone (first token "
             "%d vs %d)",
             what, i, a->tok[0], b->tok[0]);
    g_hash = k3_hash_bytes(a->tok, sizeof(int32_t) * (size_t)upto, g_hash);
    g_hash = k3_hash_bytes(a->rows, sizeof(float) * (size_t)upto * (size_t)V, g_hash);
}

static int64_t engine_prompt_tokens(k3_engine *e, int64_t *forks, int64_t *fallbacks,
                                    int64_t *reserved) {
    k3_engine_stats es;
    k3_engine_get_stats(e, &es);
    if (forks) *forks = es.forks;
    if (fallbacks) *fallbacks = es.fork_fallbacks;
    if (reserved) *reserved = es.kv_blocks_reserved;
    return es.prompt_tokens;
}

int main(int argc, char **argv) {
    k3_engine_opts o;
    int rc;
    if (!engine_test_args(
            argc, argv, "test_fork_engine PP EP MODEL_DIR on|off [KDA_CHUNK [KV_TOKENS]]", &o, &rc))
        return rc;
    o.max_seqs = 4, o.max_ctx = 512, o.max_batch_tokens = 160;
    o.kda_chunk = argc > 5 ? atoi(argv[5]) : 0;
    o.kv_cache_tokens = argc > 6 ? atoll(argv[6]) : 0; /* small: the cache must evict for forks */
    k3_engine *e;
    if (!engine_test_open(&o, &e, &rc)) return rc;
    const int64_t lens[3] = {2 * K3_KV_BLOCK, 2 * K3_KV_BLOCK + 37, 300};
    int32_t ids[300];
    choice fam[MAXN] = {0}, alone[MAXN] = {0};
    int64_t forks0, forks, fb0, fb, resv;
    k3_config cfg;
    K3_CHECK_OK(k3_config_load(argv[3], &cfg));
    V = cfg.vocab_size;
    k3_rng rng;
    k3_rng_seed(&rng, 3232);
    for (int li = 0; li < 3; li++) {
        const int64_t P = lens[li];
        for (int64_t t = 0; t < P; t++) ids[t] = (int32_t)(k3_rng_u64(&rng) % (uint64_t)(V - 256));
        const uint64_t s0 = 100 + 10 * (uint64_t)li;
        char what[64];
        /* a family of 3 vs 3 alone */
        for (int i = 0; i < 3; i++) {
            free(fam[i].rows), free(alone[i].rows);
            fam[i] = (choice){.max_tokens = NEW, .seed = s0 + (uint64_t)i};
            alone[i] = (choice){.max_tokens = NEW, .seed = s0 + (uint64_t)i};
        }
        const int64_t pt0 = engine_prompt_tokens(e, &forks0, &fb0, NULL);
        run(e, ids, P, fam, 3, true);
        const int64_t pt1 = engine_prompt_tokens(e, &forks, &fb, &resv);
        K3_CHECK(pt1 - pt0 == P,
                 "prompt %lld: the engine ran %lld prompt tokens for n = 3 (want "
                 "one prefill, %lld)",
                 (long long)P, (long long)(pt1 - pt0), (long long)P);
        K3_CHECK(forks - forks0 == 2 && fb == fb0, "prompt %lld: %lld forks, %lld fallbacks",
                 (long long)P, (long long)(forks - forks0), (long long)(fb - fb0));
        K3_CHECK(resv == 0, "prompt %lld: %lld blocks still reserved", (long long)P,
                 (long long)resv);
        for (int i = 0; i < 3; i++) run(e, ids, P, alone + i, 1, false);
        snprintf(what, sizeof what, "prompt %lld", (long long)P);
        for (int i = 0; i < 3; i++) same(what, i, &fam[i], &alone[i], NEW);
        /* the parent and fork 1 cancelled after their first tokens: fork 2 goes on */
        fam[0].cancel_after = 1, fam[1].cancel_after = 2;
        run(e, ids, P, fam, 3, true);
        snprintf(what, sizeof what, "prompt %lld, cancelled", (long long)P);
        same(what, 0, &fam[0], &alone[0], 1);
        same(what, 1, &fam[1], &alone[1], 2);
        same(what, 2, &fam[2], &alone[2], NEW);
        /* a parent that ends in the step that forks it */
        for (int i = 0; i < 3; i++) fam[i].cancel_after = 0;
        fam[0].max_tokens = 1;
        run(e, ids, P, fam, 3, true);
        snprintf(what, sizeof what, "prompt %lld, parent of 1 token", (long long)P);
        same(what, 0, &fam[0], &alone[0], 1);
        for (int i = 1; i < 3; i++) same(what, i, &fam[i], &alone[i], NEW);
    }
    /* 6 choices on lanes of 4 slots: the forks without a slot prefill on their own */
    {
        const int64_t P = lens[1];
        choice big[6] = {0}, one[6] = {0};
        for (int i = 0; i < 6; i++)
            big[i] = one[i] = (choice){.max_tokens = NEW, .seed = 900 + (uint64_t)i};
        engine_prompt_tokens(e, &forks0, &fb0, NULL);
        run(e, ids, P, big, 6, true);
        engine_prompt_tokens(e, &forks, &fb, &resv);
        K3_CHECK(forks - forks0 + fb - fb0 == 5 && fb - fb0 >= 1 && forks - forks0 >= 1,
                 "6 choices, 4 slots: %lld forks, %lld fallbacks", (long long)(forks - forks0),
                 (long long)(fb - fb0));
        for (int i = 0; i < 6; i++) run(e, ids, P, one + i, 1, false);
        /* the forks (choices 0-3 fill the parent's lane) always; the own prefills only with
           recurrent KDA: chunked KDA's sums depend on where a prompt's prefill steps end, and
           two prefills beside each other split their prompts otherwise than one alone */
        for (int i = 0; i < 6; i++)
            if (i < 4 || o.kda_chunk <= 1) same("6 choices", i, &big[i], &one[i], NEW);
        for (int i = 0; i < 6; i++) free(big[i].rows), free(one[i].rows);
        printf("  6 choices on 4 slots: %lld forks, %lld own prefills\n",
               (long long)(forks - forks0), (long long)(fb - fb0));
    }
    engine_prompt_tokens(e, &forks, &fb, &resv);
    K3_CHECK(resv == 0, "%lld blocks reserved after every request ended", (long long)resv);
    k3_engine_stats es;
    if (k3_engine_close(e, &es) != K3_OK) k3_engine_abort(e);
    K3_CHECK(es.kv_blocks_leaked == 0, "%lld paged-cache blocks leaked on the stages",
             (long long)es.kv_blocks_leaked);
    printf("  %dx%d cache %s: %lld forks, %lld fallbacks, %lld blocks leaked, %lld evictions\n",
           o.pp, o.ep, argv[4], (long long)es.forks, (long long)es.fork_fallbacks,
           (long long)es.kv_blocks_leaked, (long long)es.prefix_evictions);
    printf("digest %016llx\n", (unsigned long long)g_hash);
    for (int i = 0; i < MAXN; i++) free(fam[i].rows), free(alone[i].rows);
    int r = k3_test_done("fork_engine");
    k3_comm_finalize();
    return r;
}
