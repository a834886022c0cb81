/* bench_serve.c — `k3 bench serve` (placeholder while the client is written). */
#include "bench.h"

#include <stdio.h>

int bench_serve(const k3_args *a) {
    (void)a;
    fprintf(stderr, "k3 bench serve: not yet\n");
    return 1;
}
