/* test_alloc_faults.c — a failed allocation fails only its request (issue 42). One process
 * (argv: MODEL_DIR SPEC; SPEC "none" or a K3_TEST_FAIL value "alloc:SITE:N", SITE submit, step or
 * fork), --deterministic, 9 slots: 9 requests submitted together — plain ones, ones that keep
 * their logits rows, one with prompt logprobs, one with every prompt logit, and two families of
 * n = 3 (forks) — then stepped to the end. It prints one line per request: `req I ok TOKENS` or
 * `req I fail MESSAGE` (a refused submit or an ERROR event), and exits 1 when the engine faults
 * (the job would end) or a request misbehaves. The driver (alloc_faults.py) requires, for each
 * hooked run, exactly one failed request whose message says out of memory, and every other line
 * equal to the run without the hook. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_comm.h"
#include "k3_engine.h"
#include "k3_engine_test.h"
#include "k3_model.h"

enum { NREQ = 9, NEW = 5 };

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: test_alloc_faults MODEL_DIR none|alloc:SITE:N\n");
        return 2;
    }
    if (k3_comm_init() != K3_OK) return 1;
    k3_engine_opts o = {.model_dir = argv[1],
                        .pp = 1,
                        .ep = 1,
                        .deterministic = true,
                        .comm_timeout_s = 120,
                        .max_seqs = 9,
                        .max_ctx = 512,
                        .max_batch_tokens = 256};
    k3_engine_test t = {.fail = strcmp(argv[2], "none") ? argv[2] : NULL};
    k3_engine *e = NULL;
    if (k3_engine_open_test(&o, &t, &e) != K3_OK) {
        if (e) k3_engine_abort(e);
        fprintf(stderr, "open failed: %s\n", k3_last_error());
        return 1;
    }
    k3_config cfg;
    if (k3_config_load(argv[1], &cfg) != K3_OK) return 1;
    k3_rng rng;
    k3_rng_seed(&rng, 77);
    static int32_t ids[NREQ][200];
    int64_t P[NREQ], id[NREQ];
    int ntok[NREQ] = {0}, fork_of[NREQ];
    int32_t tok[NREQ][NEW];
    char msg[NREQ][400];
    int state[NREQ]; /* 0 running, 1 done, 2 failed */
    for (int i = 0; i < NREQ; i++) {
        fork_of[i] = i == 5 || i == 6 ? 4 : i == 8 ? 7 : -1;
        P[i] = fork_of[i] >= 0 ? P[fork_of[i]] : 40 + 17 * i;
        for (int64_t k = 0; k < P[i]; k++)
            ids[i][k] = fork_of[i] >= 0
                            ? ids[fork_of[i]][k]
                            : (int32_t)(k3_rng_u64(&rng) % (uint64_t)(cfg.vocab_size - 256));
        k3_request r = {.ids = ids[i],
                        .n_ids = P[i],
                        .max_tokens = NEW,
                        .sampling = {.temperature = 1.0f, .seed = 10 + (uint64_t)i},
                        .ignore_eos = true,
                        .keep_logits = i % 2 == 1,
                        .all_logits = i == 2,
                        .prompt_logprobs = i == 3,
                        .prompt_top = i == 3 ? 2 : 0,
                        .user = (uint64_t)i,
                        .fork = fork_of[i] >= 0,
                        .fork_of = fork_of[i] >= 0 ? id[fork_of[i]] : 0};
        state[i] = 0;
        if (k3_engine_submit(e, &r, &id[i]) != K3_OK) {
            state[i] = 2;
            snprintf(msg[i], sizeof msg[i], "%s", k3_last_error());
            id[i] = -1;
        }
    }
    int bad = 0;
    for (int guard = 0; guard < 100000; guard++) {
        int left = 0;
        for (int i = 0; i < NREQ; i++) left += state[i] == 0;
        if (!left) break;
        const k3_event *ev;
        int n = 0;
        if (k3_engine_step(e, &ev, &n) != K3_OK || k3_engine_failed(e)) {
            printf("engine fault: %s\n", k3_last_error());
            fflush(stdout);
            k3_engine_abort(e);
        }
        for (int k = 0; k < n; k++) {
            const int i = (int)ev[k].user;
            if (state[i] != 0) {
                printf("req %d: an event after its end\n", i), bad = 1;
                continue;
            }
            if (ev[k].kind == K3_EV_TOKEN) {
                if (ntok[i] < NEW) tok[i][ntok[i]] = ev[k].token;
                ntok[i]++;
                if ((i % 2 == 1) != (ev[k].logits != NULL))
                    printf("req %d: logits row %s\n", i, ev[k].logits ? "unasked" : "missing"),
                        bad = 1;
            } else if (ev[k].kind == K3_EV_DONE) {
                state[i] = 1;
            } else {
                state[i] = 2;
                snprintf(msg[i], sizeof msg[i], "%s", ev[k].error ? ev[k].error : "?");
            }
        }
    }
    for (int i = 0; i < NREQ; i++) {
        if (state[i] == 2) {
            printf("req %d fail %s\n", i, msg[i]);
            continue;
        }
        printf("req %d %s", i, state[i] == 1 && ntok[i] == NEW ? "ok" : "unfinished");
        for (int k = 0; k < ntok[i] && k < NEW; k++) printf(" %d", tok[i][k]);
        printf("\n");
        bad |= state[i] != 1 || ntok[i] != NEW;
    }
    k3_engine_stats es;
    k3_engine_get_stats(e, &es);
    printf("forks %lld fallbacks %lld\n", (long long)es.forks, (long long)es.fork_fallbacks);
    if (es.kv_blocks_reserved != 0)
        printf("%lld blocks reserved after the end\n", (long long)es.kv_blocks_reserved), bad = 1;
    if (k3_engine_close(e, &es) != K3_OK) k3_engine_abort(e);
    if (es.kv_blocks_leaked != 0)
        printf("%lld blocks leaked\n", (long long)es.kv_blocks_leaked), bad = 1;
    k3_comm_finalize();
    return bad;
}
