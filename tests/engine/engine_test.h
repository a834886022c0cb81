/* engine_test.h — test helper (header-only) for the engine tests under mpirun: open the engine on
 * every rank; the workers serve until rank 0 closes it. */
#ifndef K3_TEST_ENGINE_TEST_H
#define K3_TEST_ENGINE_TEST_H

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

#endif /* K3_TEST_ENGINE_TEST_H */
