/* bench_kernels.c — the kernels benchmark as a test-tree program (never pass/fail; STYLE.md §22):
 * the same run as `k3 bench kernels` (launcher/bench_kernels.c owns the ops, their shapes, bytes
 * and FLOPs, and the limits they are measured against), with the flags scripts/device-check.sh
 * gives it. Prints the table; writes JSON (--json FILE, default bench_kernels.json: the host,
 * backend and limits, then results[] with op, seconds, bytes, flops, gbs, triad_fraction, gflops,
 * peak_fraction, samples_s).
 * Usage: bench_kernels [--backend cpu|cuda|...] [--threads N] [--reps N] [--prefill T]
 *                      [--size-mb MB] [--json FILE]      (K3_ISA=avx512|avx2|scalar for one ISA) */
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"

int main(int argc, char **argv) {
    bench_kernels_opts o = {.backend = "cpu", .threads = 2, .reps = 7, .warmups = 1, .prefill = 64};
    const char *json_path = "bench_kernels.json";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "bench_kernels: %s needs a value\n", a);
            return 2;
        }
        if (strcmp(a, "--threads") == 0)
            o.threads = atoi(v);
        else if (strcmp(a, "--reps") == 0)
            o.reps = atoi(v);
        else if (strcmp(a, "--prefill") == 0)
            o.prefill = atoi(v);
        else if (strcmp(a, "--size-mb") == 0)
            o.bytes = (int64_t)atoi(v) << 20;
        else if (strcmp(a, "--json") == 0)
            json_path = v;
        else if (strcmp(a, "--backend") == 0)
            o.backend = v;
        else {
            fprintf(stderr, "bench_kernels: unknown flag %s\n", a);
            return 2;
        }
        i++;
    }
    bench_report rep = {.mode = "kernels"};
    k3_status st = bench_kernels_run(&o, &rep);
    if (st == K3_OK) st = bench_report_write(&rep, json_path, NULL);
    if (st != K3_OK) fprintf(stderr, "bench_kernels: %s\n", k3_last_error());
    bench_report_free(&rep);
    return st == K3_OK ? 0 : st == K3_ERR_ARG ? 2 : 1;
}
