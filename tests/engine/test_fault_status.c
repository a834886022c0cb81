/* test_fault_status.c — a fault inside a step comes back to the client as a status (issue "The
 * house in order", deliverable 3). Under mpirun (argv: PP EP MODEL_DIR COMM_TIMEOUT_S) with a
 * K3_TEST_FAIL hook from the environment, rank 0 submits requests and steps; when
 * k3_engine_step (or open, serve, close) returns a status other than K3_OK, the rank prints one
 * stdout line "fault: <call> returned <status>, failed=<0|1>" and ends the job with
 * k3_engine_abort. fault_status.py checks that line, the one-line message naming the rank and
 * the exit code. Without a fault every rank prints "no fault" and exits 0. */
#include <stdio.h>
#include <stdlib.h>

#include "k3_comm.h"
#include "k3_engine_test.h"

static _Noreturn void ended(k3_engine *e, const char *call, k3_status st) {
    printf("fault: %s returned %s, failed=%d\n", call, k3_status_name(st), k3_engine_failed(e));
    fflush(stdout);
    k3_engine_abort(e);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: test_fault_status PP EP MODEL_DIR COMM_TIMEOUT_S\n");
        return 2;
    }
    if (k3_comm_init() != K3_OK) return 1;
    k3_engine_opts o = {.model_dir = argv[3],
                        .pp = atoi(argv[1]),
                        .ep = atoi(argv[2]),
                        .comm_timeout_s = atof(argv[4]),
                        .max_seqs = 4,
                        .max_ctx = 96,
                        .max_batch_tokens = 64};
    k3_engine *e = NULL;
    k3_status st = k3_engine_open_test(&o, k3_engine_test_from_env(), &e);
    if (st != K3_OK && e) ended(e, "k3_engine_open", st);
    if (st != K3_OK) {
        k3_comm_finalize();
        return st == K3_ERR_ARG ? 2 : 1;
    }
    if (!k3_engine_is_coordinator(e)) {
        st = k3_engine_serve(e); /* serves, then closes */
        if (st != K3_OK) ended(e, "k3_engine_serve", st);
        printf("no fault\n");
        k3_comm_finalize();
        return 0;
    }
    int32_t ids[16];
    for (int i = 0; i < 16; i++) ids[i] = 3 + 7 * i;
    for (int i = 0; i < 4; i++) {
        k3_request rq = {.ids = ids, .n_ids = 8 + i, .max_tokens = 24, .ignore_eos = true};
        int64_t id;
        st = k3_engine_submit(e, &rq, &id);
        if (st != K3_OK) ended(e, "k3_engine_submit", st);
    }
    while (k3_engine_pending(e) > 0) {
        const k3_event *ev;
        int n;
        st = k3_engine_step(e, &ev, &n);
        if (st != K3_OK) ended(e, "k3_engine_step", st);
    }
    st = k3_engine_close(e, NULL);
    if (st != K3_OK) ended(e, "k3_engine_close", st);
    printf("no fault\n");
    k3_comm_finalize();
    return 0;
}
