/* test_fork_storm.c — families of n > 1 choices on a full lane (issue 42). Under mpirun on any
 * S x E (argv: PP EP MODEL_DIR on|off KV_TOKENS N_REQUESTS), --deterministic, 8 slots a lane:
 *  - two families of n = 4 (a parent and 3 forks each; the parent has max_tokens 1, so it ends in
 *    the step that forks it) submitted together, so both prefill in one step and fork in the same
 *    next message, on a paged cache that they fill exactly; 6 rounds of prompt lengths on and
 *    off a block boundary. A parent's blocks are free on rank 0's books when it ends, but the
 *    stages hold them until its forks are applied: granting them to the other family's forks
 *    made the stage run out of blocks (a rank fault that ends the job);
 *  - the reliability battery's repro: 10 prefixes of 200 random ids, N_REQUESTS families of
 *    n = 4, max_tokens 1, each a prefix + 1..99 random ids, one family at a time;
 *  - every choice of every family ends with DONE; in the two families (choices of 1 and 2 tokens,
 *    so some forks are made) each choice's tokens equal the choice run alone (seeded,
 *    temperature 1); after all, no block is reserved on rank 0 and no stage block leaked.
 * Runs on KV_TOKENS of cache a lane (the battery used 2048 with the prefix cache on). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_comm.h"
#include "k3_engine.h"
#include "k3_model.h"
#include "engine/engine_test.h"
#include "k3_test.h"

enum { NCH = 4, MAXF = 2, MAXP = 300 };

/* Run `nf` families of NCH choices (family f: prompt ids[f][0, P[f]), seeds seed0 + 10 f + c,
 * max_tokens 1 + c % 2 with `two`, else 1), submitted together, forks of each family's first
 * choice when fork (else choice c0 alone); tokens into tok[f][c][2]. */
static void run(k3_engine *e, int32_t (*ids)[MAXP], const int64_t *P, int nf, uint64_t seed0,
                bool fork, int c0, bool two, int32_t (*tok)[NCH][2]) {
    int64_t id[MAXF][NCH];
    int left = 0;
    for (int f = 0; f < nf; f++)
        for (int c = fork ? 0 : c0; c < (fork ? NCH : c0 + 1); c++) {
            k3_request r = {
                .ids = ids[f],
                .n_ids = P[f],
                .max_tokens = two ? 1 + c % 2 : 1,
                .sampling = {.temperature = 1.0f, .seed = seed0 + 10 * (uint64_t)f + (uint64_t)c},
                .ignore_eos = true,
                .user = (uint64_t)(f * NCH + c),
                .fork = fork && c > 0,
                .fork_of = fork && c > 0 ? id[f][0] : 0};
            K3_CHECK_OK(k3_engine_submit(e, &r, &id[f][c]));
            tok[f][c][0] = tok[f][c][1] = -1;
            left++;
        }
    for (int guard = 0; left > 0 && guard < 100000; guard++) {
        const k3_event *ev;
        const int ne = engine_test_step(e, &ev);
        for (int k = 0; k < ne; k++) {
            const int f = (int)ev[k].user / NCH, c = (int)ev[k].user % NCH;
            if (ev[k].kind == K3_EV_TOKEN) {
                tok[f][c][ev[k].n_gen > 1] = ev[k].token;
                continue;
            }
            K3_CHECK(ev[k].kind == K3_EV_DONE, "family %d choice %d failed: %s", f, c,
                     ev[k].error ? ev[k].error : "?");
            left--;
        }
    }
    K3_CHECK(left == 0, "%d choices never ended", left);
}

/* Families [nf] forked (choices of 1 and 2 tokens: the parent ends in the step that forks it),
 * then each choice alone with its seed: the same tokens. */
static void check(k3_engine *e, int32_t (*ids)[MAXP], const int64_t *P, int nf, uint64_t seed0,
                  const char *what) {
    int32_t fam[MAXF][NCH][2], one[MAXF][NCH][2];
    run(e, ids, P, nf, seed0, true, 0, true, fam);
    for (int f = 0; f < nf; f++)
        for (int c = 0; c < NCH; c++)
            run(e, ids + f, P + f, 1, seed0 + 10 * (uint64_t)f, false, c, true, one + f);
    for (int f = 0; f < nf; f++)
        for (int c = 0; c < NCH; c++)
            K3_CHECK(memcmp(fam[f][c], one[f][c], sizeof fam[f][c]) == 0 && fam[f][c][0] >= 0 &&
                         (fam[f][c][1] >= 0) == (c % 2 == 1),
                     "%s: family %d choice %d: forked tokens %d %d, alone %d %d", what, f, c,
                     fam[f][c][0], fam[f][c][1], one[f][c][0], one[f][c][1]);
}

int main(int argc, char **argv) {
    k3_engine_opts o;
    int rc;
    if (argc < 7) {
        fprintf(stderr, "usage: test_fork_storm PP EP MODEL_DIR on|off KV_TOKENS N_REQUESTS\n");
        return 2;
    }
    if (!engine_test_args(argc, argv, "test_fork_storm PP EP MODEL_DIR on|off KV N", &o, &rc))
        return rc;
    o.max_seqs = 8, o.max_ctx = 512, o.max_batch_tokens = 640;
    o.kv_cache_tokens = atoll(argv[5]);
    const int n_req = atoi(argv[6]);
    k3_engine *e;
    if (!engine_test_open(&o, &e, &rc)) return rc;
    k3_config cfg;
    K3_CHECK_OK(k3_config_load(argv[3], &cfg));
    const int64_t V = cfg.vocab_size;
    k3_rng rng;
    k3_rng_seed(&rng, 4242);
    static int32_t ids[MAXF][MAXP];
    /* two families forking in one step on a full lane */
    const int64_t lens[6] = {165, 128, 200, 64, 190, 255};
    for (int round = 0; round < 6; round++) {
        int64_t P[MAXF];
        for (int f = 0; f < MAXF; f++) {
            P[f] = lens[round] + f;
            for (int64_t t = 0; t < P[f]; t++)
                ids[f][t] = (int32_t)(k3_rng_u64(&rng) % (uint64_t)(V - 256));
        }
        char what[64];
        snprintf(what, sizeof what, "two families, prompts %lld", (long long)lens[round]);
        check(e, ids, P, MAXF, 100 + 100 * (uint64_t)round, what);
    }
    /* the battery: 10 prefixes, families one at a time */
    static int32_t pre[10][200];
    for (int i = 0; i < 10; i++)
        for (int t = 0; t < 200; t++) pre[i][t] = (int32_t)(k3_rng_u64(&rng) % (uint64_t)(V - 256));
    for (int q = 0; q < n_req; q++) {
        const int i = (int)(k3_rng_u64(&rng) % 10);
        int64_t P = 200 + 1 + (int64_t)(k3_rng_u64(&rng) % 99);
        memcpy(ids[0], pre[i], sizeof pre[i]);
        for (int64_t t = 200; t < P; t++)
            ids[0][t] = (int32_t)(k3_rng_u64(&rng) % (uint64_t)(V - 256));
        int32_t tok[MAXF][NCH][2];
        run(e, ids, &P, 1, 5000 + (uint64_t)q, true, 0, false, tok);
        if (k3_t_fail > 0) break;
    }
    k3_engine_stats es;
    k3_engine_get_stats(e, &es);
    K3_CHECK(es.kv_blocks_reserved == 0, "%lld blocks reserved after every request ended",
             (long long)es.kv_blocks_reserved);
    const int64_t forks = es.forks;
    if (k3_engine_close(e, &es) != K3_OK) k3_engine_abort(e);
    K3_CHECK(es.kv_blocks_leaked == 0, "%lld paged-cache blocks leaked on the stages",
             (long long)es.kv_blocks_leaked);
    K3_CHECK(forks > 0, "no request forked");
    printf("  %dx%d cache %s kv %lld: %d battery families, %lld forks, %lld fallbacks, %lld "
           "evictions\n",
           o.pp, o.ep, argv[4], (long long)o.kv_cache_tokens, n_req, (long long)forks,
           (long long)es.fork_fallbacks, (long long)es.prefix_evictions);
    int r = k3_test_done("fork_storm");
    k3_comm_finalize();
    return r;
}
