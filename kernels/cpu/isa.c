/* isa.c — which kernel table (cpu_kern.h) a cpu backend runs: chosen once, at backend creation,
 * from cpuid (AVX-512 F/BW/VL, else AVX2 + FMA, else scalar), or forced by the environment
 * variable K3_ISA=avx512|avx2|scalar (tests run every path the machine has). An unknown value,
 * or one the CPU cannot run, is an error naming it — never a silent fallback. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <stdlib.h>
#include <string.h>

#include "cpu_kern.h"

static bool has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
static bool has_avx512(void) {
    __builtin_cpu_init();
    return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool k3_cpu_isa_supported(const char *name) {
    if (strcmp(name, "scalar") == 0) return true;
    if (strcmp(name, "avx2") == 0) return has_avx2();
    if (strcmp(name, "avx512") == 0) return has_avx512();
    return false;
}

/* The decode rows' walk, measured on both CPUs this project runs on (one thread, DRAM-resident
 * BF16, k3 bench kernels and bench_forward): an AMD EPYC (Zen 4) streams one row after another
 * with its hardware prefetcher at the read-only stream's rate (rows of 1024: ~27 vs ~13 GB/s for
 * 8 rows side by side; small decode 34 -> 58 tok/s; two such streams, 68 -> 79: kern_gemv.h's
 * gemv_seq), software prefetches a group of rows ahead only cost it (one a few KB ahead in each
 * stream helps two threads on Zen 5: kern_gemv.h GV_SPF); the Xeon reached 95% of its read-only
 * stream with rows side by side and a prefetch a group ahead. So AMD: seq, others: rows;
 * K3_GEMV=seq|rows forces one (tests run both; the same bits). Each backend keeps its pick in its
 * context (k3_cpu_ctx.gemv_seq), read by its decode matmuls. */
static k3_status gemv_select(bool *seq) {
    const char *g = getenv("K3_GEMV");
    if (!g || !*g) {
        __builtin_cpu_init();
        *seq = __builtin_cpu_is("amd");
    } else if (strcmp(g, "seq") == 0 || strcmp(g, "rows") == 0) {
        *seq = strcmp(g, "seq") == 0;
    } else {
        return K3_ERR(K3_ERR_ARG, "K3_GEMV='%s' is not a decode row order (seq, rows)", g);
    }
    return K3_OK;
}

const char *k3_cpu_gemv_name(const k3_backend *be) {
    if (!be || !be->ctx || (strcmp(be->name, "cpu") != 0 && strcmp(be->name, "guard") != 0))
        return "-";
    return ((const k3_cpu_ctx *)be->ctx)->gemv_seq ? "seq" : "rows";
}

k3_status k3_cpu_kern_select(const k3_cpu_kern **out, bool *gemv_seq) {
    *out = NULL;
    K3_TRY(gemv_select(gemv_seq));
    const char *want = getenv("K3_ISA");
    if (!want || !*want) {
        *out = has_avx512() ? &k3_cpu_kern_avx512
               : has_avx2() ? &k3_cpu_kern_avx2
                            : &k3_cpu_kern_scalar;
        return K3_OK;
    }
    const k3_cpu_kern *k = strcmp(want, "avx512") == 0   ? &k3_cpu_kern_avx512
                           : strcmp(want, "avx2") == 0   ? &k3_cpu_kern_avx2
                           : strcmp(want, "scalar") == 0 ? &k3_cpu_kern_scalar
                                                         : NULL;
    if (!k)
        return K3_ERR(K3_ERR_ARG,
                      "K3_ISA='%s' is not an ISA of the cpu backend (avx512, avx2, scalar)", want);
    if (!k3_cpu_isa_supported(want))
        return K3_ERR(K3_ERR_ARG, "K3_ISA='%s': this CPU does not support it (cpuid)", want);
    *out = k;
    return K3_OK;
}

const char *k3_cpu_isa_name(const k3_backend *be) {
    if (!be || !be->ctx || (strcmp(be->name, "cpu") != 0 && strcmp(be->name, "guard") != 0))
        return "-";
    const k3_cpu_ctx *c = be->ctx;
    return c->kern ? c->kern->name : "-";
}
