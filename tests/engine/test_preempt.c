/* test_preempt.c — preemption under a small paged cache (issue 42). Under mpirun on any S x E
 * (argv: PP EP MODEL_DIR on|off KV_TOKENS), --deterministic, 16 slots a lane: 16 requests
 * submitted together (prompts of 40-100 tokens, 120 generated tokens each, half greedy, half
 * seeded at temperature 1, logits rows kept). A request holds the blocks its tokens so far need,
 * so with a small KV_TOKENS the lane runs out as they grow and the scheduler preempts the latest
 * to arrive (recomputed later from its prompt and the tokens it generated). Every request must
 * end with 120 tokens; the run prints `digest <hex>` of every token and logits row (the driver
 * requires one digest for a cache that never runs out and one that preempts) and `preemptions N`.
 * After all, no block is reserved on rank 0 and none leaked on the stages. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_comm.h"
#include "k3_engine.h"
#include "k3_model.h"
#include "engine/engine_test.h"
#include "k3_test.h"

enum { NREQ = 16, NEW = 120 };

int main(int argc, char **argv) {
    k3_engine_opts o;
    int rc;
    if (argc < 6) {
        fprintf(stderr, "usage: test_preempt PP EP MODEL_DIR on|off KV_TOKENS\n");
        return 2;
    }
    if (!engine_test_args(argc, argv, "test_preempt PP EP MODEL_DIR on|off KV_TOKENS", &o, &rc))
        return rc;
    o.max_seqs = NREQ, o.max_ctx = 256, o.max_batch_tokens = 256;
    o.kv_cache_tokens = atoll(argv[5]);
    k3_engine *e;
    if (!engine_test_open(&o, &e, &rc)) return rc;
    k3_config cfg;
    K3_CHECK_OK(k3_config_load(argv[3], &cfg));
    const int64_t V = cfg.vocab_size;
    k3_rng rng;
    k3_rng_seed(&rng, 4243);
    static int32_t ids[NREQ][100], tok[NREQ][NEW];
    float *rows = calloc((size_t)NREQ * NEW * (size_t)V, sizeof(float));
    int n[NREQ] = {0}, left = NREQ;
    for (int i = 0; i < NREQ; i++) {
        const int64_t P = 40 + (int64_t)(k3_rng_u64(&rng) % 61);
        for (int64_t t = 0; t < P; t++)
            ids[i][t] = (int32_t)(k3_rng_u64(&rng) % (uint64_t)(V - 256));
        k3_request r = {.ids = ids[i],
                        .n_ids = P,
                        .max_tokens = NEW,
                        .sampling = {.temperature = i % 2 ? 1.0f : 0.0f, .seed = 70 + (uint64_t)i},
                        .ignore_eos = true,
                        .keep_logits = true,
                        .user = (uint64_t)i};
        int64_t id;
        K3_CHECK_OK(k3_engine_submit(e, &r, &id));
    }
    for (int guard = 0; left > 0 && guard < 1000000; guard++) {
        const k3_event *ev;
        const int ne = engine_test_step(e, &ev);
        for (int k = 0; k < ne; k++) {
            const int i = (int)ev[k].user;
            if (ev[k].kind == K3_EV_TOKEN) {
                K3_CHECK(n[i] < NEW, "request %d: more than %d tokens", i, NEW);
                if (n[i] >= NEW) continue;
                memcpy(rows + ((size_t)i * NEW + (size_t)n[i]) * (size_t)V, ev[k].logits,
                       sizeof(float) * (size_t)V);
                tok[i][n[i]++] = ev[k].token;
            } else {
                K3_CHECK(ev[k].kind == K3_EV_DONE, "request %d failed: %s", i,
                         ev[k].error ? ev[k].error : "?");
                left--;
            }
        }
    }
    K3_CHECK(left == 0, "%d requests never ended", left);
    uint64_t h = 0x6b3442;
    for (int i = 0; i < NREQ; i++) {
        K3_CHECK(n[i] == NEW, "request %d: %d tokens", i, n[i]);
        h = k3_hash_bytes(tok[i], sizeof tok[i], h);
        h = k3_hash_bytes(rows + (size_t)i * NEW * (size_t)V, sizeof(float) * NEW * (size_t)V, h);
    }
    k3_engine_stats es;
    k3_engine_get_stats(e, &es);
    K3_CHECK(es.kv_blocks_reserved == 0, "%lld blocks reserved after every request ended",
             (long long)es.kv_blocks_reserved);
    const int64_t pre = es.preemptions;
    if (k3_engine_close(e, &es) != K3_OK) k3_engine_abort(e);
    K3_CHECK(es.kv_blocks_leaked == 0, "%lld paged-cache blocks leaked on the stages",
             (long long)es.kv_blocks_leaked);
    printf("preemptions %lld\n", (long long)pre);
    printf("digest %016llx\n", (unsigned long long)h);
    free(rows);
    int r = k3_test_done("preempt");
    k3_comm_finalize();
    return r;
}
