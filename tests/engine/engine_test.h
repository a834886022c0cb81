/* engine_test.h — test helper (header-only) for the engine tests under mpirun: open the engine on
 * every rank; the workers serve until rank 0 closes it. */
#ifndef K3_TEST_ENGINE_TEST_H
#define K3_TEST_ENGINE_TEST_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_comm.h"
#include "k3_engine.h"

/* Rank 0: true with *e open. Every other rank serves until close (a fault ends the job) and
 * gets false with *rc 0; a failed open gives false with *rc 2 (usage) or 1, after finalizing. */
static inline bool engine_test_open(const k3_engine_opts *o, k3_engine **e, int *rc) {
    *e = NULL;
    k3_status ost = k3_engine_open(o, e);
    if (ost != K3_OK && *e) k3_engine_abort(*e);
    if (ost != K3_OK) {
        k3_comm_finalize();
        *rc = ost == K3_ERR_ARG ? 2 : 1;
        return false;
    }
    if (!k3_engine_is_coordinator(*e)) {
        if (k3_engine_serve(*e) != K3_OK) k3_engine_abort(*e); /* serves, then closes */
        k3_comm_finalize();
        *rc = 0; /* rank 0 reports */
        return false;
    }
    return true;
}

/* Rank 0: one engine step; its events (a fault ends the job). */
static inline int engine_test_step(k3_engine *e, const k3_event **ev) {
    int n = 0;
    if (k3_engine_step(e, ev, &n) != K3_OK || k3_engine_failed(e)) k3_engine_abort(e);
    return n;
}

/* argv PP EP MODEL_DIR on|off [...] of the prefix-cache and fork tests: false (after printing
 * usage, *rc 2; or a failed comm init, *rc 1) or true with comm up and the common options set:
 * the split, the model, --deterministic, a 120 s comm timeout and the prefix cache on or off. */
static inline bool engine_test_args(int argc, char **argv, const char *usage, k3_engine_opts *o,
                                    int *rc) {
    *rc = 2;
    if (argc < 5) {
        fprintf(stderr, "usage: %s\n", usage);
        return false;
    }
    *rc = 1;
    if (k3_comm_init() != K3_OK) return false;
    *o = (k3_engine_opts){.model_dir = argv[3],
                          .pp = atoi(argv[1]),
                          .ep = atoi(argv[2]),
                          .deterministic = true,
                          .comm_timeout_s = 120,
                          .no_prefix_cache = strcmp(argv[4], "on") != 0};
    return true;
}

#endif /* K3_TEST_ENGINE_TEST_H */
