/* test_arrivals.c — batch invariance with arrivals (issue "The engine"): under mpirun (any S x E,
 * argv: PP EP COORD(shared|dedicated) MODEL_DIR SEED), rank 0 runs N requests with random prompt
 * lengths (1-300) and max tokens, first each one ALONE, then all of them again with requests
 * submitted at random steps (so they share steps with others, join while others decode, and queue
 * for slots), and checks that every request's greedy tokens and the logits rows they were sampled
 * from are bit-identical between the two. Two more requests must fail alone without stopping the
 * others: one longer than --max-ctx, one with invalid sampling parameters.
 * It prints `digest <hex>` of every request's tokens + logits, so a driver can compare splits
 * (with --deterministic the digest must be the same for every split). An optional 7th argument
 * sizes the paged cache (--kv-cache-tokens) below max_seqs x max_ctx: requests then also wait for
 * cache blocks, and the digest must not change. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_comm.h"
#include "k3_engine.h"
#include "k3_model.h"
#include "engine/engine_test.h"
#include "k3_test.h"

#define N_REQ   64
#define MAX_NEW 12

typedef struct {
    int32_t *ids;
    int64_t P;
    int max_tokens;
    int n_gen[2];
    int32_t gen[2][MAX_NEW];
    float *rows[2]; /* [max_tokens, V] */
    bool done[2], failed[2];
    int64_t id[2];
} req;

static int64_t V;

static void submit(k3_engine *e, req *rq, int i, int ph) {
    k3_request r = {.ids = rq[i].ids,
                    .n_ids = rq[i].P,
                    .max_tokens = rq[i].max_tokens,
                    .ignore_eos = true,
                    .keep_logits = true,
                    .user = (uint64_t)i};
    K3_CHECK_OK(k3_engine_submit(e, &r, &rq[i].id[ph]));
}

/* One step: record tokens and logits rows; returns the number of requests that ended. */
static int step(k3_engine *e, req *rq, int ph, int *n_events) {
    const k3_event *ev;
    int ne, ended = 0;
    K3_CHECK_OK(k3_engine_step(e, &ev, &ne));
    if (k3_engine_failed(e)) k3_engine_abort(e); /* the job ends, the rank named */
    for (int k = 0; k < ne; k++) {
        req *q = &rq[ev[k].user];
        if (ev[k].kind == K3_EV_TOKEN) {
            memcpy(q->rows[ph] + q->n_gen[ph] * V, ev[k].logits, sizeof(float) * V);
            q->gen[ph][q->n_gen[ph]++] = ev[k].token;
        } else {
            q->done[ph] = true;
            q->failed[ph] = ev[k].kind == K3_EV_ERROR;
            ended++;
        }
    }
    *n_events = ne;
    return ended;
}

/* Run phase ph: alone (one at a time) or with arrivals. */
static void run_phase(k3_engine *e, req *rq, int n, int ph, k3_rng *rng) {
    int next = 0, left = n, ne;
    if (ph == 0) {
        for (int i = 0; i < n; i++) {
            submit(e, rq, i, ph);
            while (!rq[i].done[ph]) {
                step(e, rq, ph, &ne);
                if (ne == 0 && k3_engine_pending(e) == 0) break;
            }
        }
        return;
    }
    while (left > 0) {
        /* arrivals: 0-3 new requests before this step */
        int arrive = next < n ? (int)(k3_rng_u64(rng) % 4) : 0;
        if (next < n && k3_engine_pending(e) == 0) arrive = K3_MAX(arrive, 1);
        for (int a = 0; a < arrive && next < n; a++, next++) submit(e, rq, next, ph);
        left -= step(e, rq, ph, &ne);
        if (ne == 0 && k3_engine_pending(e) == 0 && next >= n) break;
    }
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr,
                "usage: test_arrivals PP EP shared|dedicated MODEL_DIR SEED [det|nodet [KV]]\n");
        return 2;
    }
    if (k3_comm_init() != K3_OK) return 1;
    k3_engine_opts o = {.model_dir = argv[4],
                        .pp = atoi(argv[1]),
                        .ep = atoi(argv[2]),
                        .coord = strcmp(argv[3], "dedicated") == 0 ? K3_COORD_DEDICATED
                                                                   : K3_COORD_SHARED,
                        .deterministic = argc > 6 && strcmp(argv[6], "det") == 0,
                        .comm_timeout_s = 120,
                        .max_seqs = 6,
                        .max_ctx = 320,
                        .max_batch_tokens = 96,
                        .chunk = 40,
                        .kv_cache_tokens = argc > 7 ? atoll(argv[7]) : 0};
    k3_engine *e;
    int rc;
    if (!engine_test_open(&o, &e, &rc)) return rc;
    k3_config cfg;
    K3_CHECK_OK(k3_config_load(argv[4], &cfg));
    V = cfg.vocab_size;
    k3_rng rng;
    k3_rng_seed(&rng, (uint64_t)strtoull(argv[5], NULL, 10));
    req *rq = calloc(N_REQ, sizeof *rq);
    int64_t total_prompt = 0;
    for (int i = 0; i < N_REQ; i++) {
        rq[i].P = 1 + (int64_t)(k3_rng_u64(&rng) % 300);
        rq[i].max_tokens = 1 + (int)(k3_rng_u64(&rng) % MAX_NEW);
        rq[i].ids = malloc(sizeof(int32_t) * (size_t)rq[i].P);
        for (int64_t t = 0; t < rq[i].P; t++)
            rq[i].ids[t] = (int32_t)(k3_rng_u64(&rng) % (uint64_t)V);
        for (int ph = 0; ph < 2; ph++)
            rq[i].rows[ph] = calloc((size_t)rq[i].max_tokens * (size_t)V, sizeof(float));
        total_prompt += rq[i].P;
    }
    run_phase(e, rq, N_REQ, 0, &rng);
    /* requests that must fail alone, submitted among the others */
    int32_t long_ids[400] = {0};
    k3_request too_long = {.ids = long_ids, .n_ids = 400, .max_tokens = 4, .user = 1000};
    k3_request bad_sampling = {.ids = long_ids,
                               .n_ids = 5,
                               .max_tokens = 4,
                               .sampling = {.temperature = -1},
                               .user = 1001};
    int64_t id_long, id_bad;
    K3_CHECK_OK(k3_engine_submit(e, &too_long, &id_long));
    K3_CHECK_OK(k3_engine_submit(e, &bad_sampling, &id_bad));
    int n_err = 0;
    {
        const k3_event *ev;
        int ne;
        K3_CHECK_OK(k3_engine_step(e, &ev, &ne));
        if (k3_engine_failed(e)) k3_engine_abort(e); /* the job ends, the rank named */
        for (int k = 0; k < ne; k++) {
            K3_CHECK(ev[k].kind == K3_EV_ERROR && ev[k].error,
                     "a bad request gives an error event");
            if (ev[k].kind == K3_EV_ERROR) {
                n_err++;
                printf("  request %llu failed alone: %s\n", (unsigned long long)ev[k].user,
                       ev[k].error);
                /* 404 tokens: past --max-ctx 320, and past a paged cache of 384 (7 blocks of
                   64 > 6), which is checked first: it could never run on this lane */
                const char *flag = argc > 7 ? "--kv-cache-tokens" : "--max-ctx";
                if (ev[k].user == 1000)
                    K3_CHECK(strstr(ev[k].error, flag) != NULL, "names %s", flag);
            }
        }
    }
    K3_CHECK(n_err == 2, "both bad requests failed (%d)", n_err);
    run_phase(e, rq, N_REQ, 1, &rng);
    { /* cancel: a request cancelled after its first token ends with DONE, the others run on */
        int32_t ids[8] = {5, 6, 7, 8, 9, 10, 11, 12};
        int64_t id[3];
        for (int i = 0; i < 3; i++) {
            k3_request r = {.ids = ids,
                            .n_ids = 4 + i,
                            .max_tokens = 8,
                            .ignore_eos = true,
                            .user = 2000 + (uint64_t)i};
            K3_CHECK_OK(k3_engine_submit(e, &r, &id[i]));
        }
        int n_tok[3] = {0}, ended = 0, kinds[3] = {0};
        bool cancelled = false;
        for (int guard = 0; ended < 3 && guard < 1000; guard++) {
            const k3_event *ev;
            int ne;
            K3_CHECK_OK(k3_engine_step(e, &ev, &ne));
            if (k3_engine_failed(e)) k3_engine_abort(e); /* the job ends, the rank named */
            for (int k = 0; k < ne; k++) {
                int i = (int)(ev[k].user - 2000);
                if (ev[k].kind == K3_EV_TOKEN)
                    n_tok[i]++;
                else
                    kinds[i] = ev[k].kind, ended++;
            }
            if (!cancelled && n_tok[1] >= 1) {
                K3_CHECK_OK(k3_engine_cancel(e, id[1]));
                cancelled = true;
            }
        }
        K3_CHECK(ended == 3 && kinds[0] == K3_EV_DONE && kinds[1] == K3_EV_DONE &&
                     kinds[2] == K3_EV_DONE,
                 "cancel: every request ends with DONE (%d ended)", ended);
        K3_CHECK(n_tok[0] == 8 && n_tok[2] == 8 && n_tok[1] >= 1 && n_tok[1] < 8,
                 "cancel: tokens %d %d %d", n_tok[0], n_tok[1], n_tok[2]);
        K3_CHECK(k3_engine_cancel(e, id[1]) != K3_OK, "cancelling an ended request is refused");
        printf("  cancel after the first token: %d of 8 tokens, the others 8 and 8\n", n_tok[1]);
    }
    int same = 0;
    uint64_t h = 0x6b33;
    for (int i = 0; i < N_REQ; i++) {
        req *q = &rq[i];
        K3_CHECK(q->done[0] && q->done[1] && !q->failed[0] && !q->failed[1],
                 "request %d finished in both phases", i);
        K3_CHECK(q->n_gen[0] == q->max_tokens && q->n_gen[1] == q->max_tokens,
                 "request %d: %d / %d tokens of %d", i, q->n_gen[0], q->n_gen[1], q->max_tokens);
        bool eq = q->n_gen[0] == q->n_gen[1] &&
                  memcmp(q->gen[0], q->gen[1], sizeof(int32_t) * (size_t)q->n_gen[0]) == 0 &&
                  memcmp(q->rows[0], q->rows[1], sizeof(float) * (size_t)q->n_gen[0] * V) == 0;
        K3_CHECK(eq,
                 "request %d (prompt %lld, %d new): tokens/logits differ alone vs with arrivals", i,
                 (long long)q->P, q->max_tokens);
        same += eq;
        h = k3_hash_bytes(q->gen[0], sizeof(int32_t) * (size_t)q->n_gen[0], h);
        h = k3_hash_bytes(q->rows[0], sizeof(float) * (size_t)q->n_gen[0] * V, h);
    }
    k3_engine_stats es;
    if (k3_engine_close(e, &es) != K3_OK) k3_engine_abort(e);
    printf("  %s %dx%d (paged cache %s tokens): %d/%d requests bit-identical alone vs with "
           "arrivals (%lld prompt tokens, %lld steps)\n",
           argv[3], o.pp, o.ep, argc > 7 ? argv[7] : "6 x 320", same, N_REQ,
           (long long)total_prompt, (long long)es.steps);
    printf("digest %016llx\n", (unsigned long long)h);
    for (int i = 0; i < N_REQ; i++) free(rq[i].ids), free(rq[i].rows[0]), free(rq[i].rows[1]);
    free(rq);
    int r = k3_test_done("arrivals");
    k3_comm_finalize();
    return r;
}
