/* k3_engine_test — the engine's test-only interface: fault injection and forced tokens, kept out
 * of k3_engine_opts. The launcher wires the environment to it (K3_TEST_FAIL, K3_TEST_FORCE); the
 * mpi, fault and chaos tests set those variables.
 *   fail:  "load:R" rank R fails its load; "stall-load:R" / "kill-load:R" rank R stops (SIGSTOP)
 *          or kills (SIGKILL) itself half-way through its load; "plan:R" rank R's plan hash
 *          differs (every rank must refuse to start); "decode:R:N" / "stop:R:N" rank R kills /
 *          stops itself when it starts its N-th forward step (a worker) or has received N logits
 *          messages (a dedicated coordinator); "hang:R:N" it stops answering there instead;
 *          "alloc:SITE:N" rank 0's N-th allocation at SITE (submit, step, fork) fails: only
 *          the request it was for fails, with an error naming the allocation; "graph-sync:R"
 *          rank R makes a host read inside each capture of a decode step (cuda graphs): the
 *          capture fails, the step runs eagerly, and rank 0 stops choosing that size.
 *   force: "id,id,...": the tokens every request generates first, whatever the logits (a random
 *          tiny model never writes e.g. a tool call by itself). */
#ifndef K3_ENGINE_TEST_H
#define K3_ENGINE_TEST_H

#include "k3_engine.h"

typedef struct k3_engine_test {
    const char *fail;  /* K3_TEST_FAIL value or NULL */
    const char *force; /* K3_TEST_FORCE value or NULL */
} k3_engine_test;

/* The hooks the environment names (K3_TEST_FAIL, K3_TEST_FORCE); NULL when neither is set. */
const k3_engine_test *k3_engine_test_from_env(void);
/* k3_engine_open with test hooks (t may be NULL: none). */
k3_status k3_engine_open_test(const k3_engine_opts *o, const k3_engine_test *t, k3_engine **out);

#endif /* K3_ENGINE_TEST_H */
