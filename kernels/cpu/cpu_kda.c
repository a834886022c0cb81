/* cpu_kda.c — the cpu backend's KDA ops (K3-MODEL.md §2): the delta-rule recurrence and its
 * chunked form per head on the pool, and the decay gate per token. A head's state and outputs are
 * its own, so the head split never changes a bit. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include "cpu_kern.h"

/* Work below this many multiply-adds runs on the calling thread only (as in cpu.c). */
#define K3_CPU_PAR_MIN_MACS (1 << 15)

typedef struct {
    const float *q, *k, *v, *g, *beta;
    int64_t n;
    int H, dk, dv, C;
    float scale;
    float *S, *o, *work;
} kda_job;
static void kda_task(void *ctx, int64_t h) {
    const kda_job *j = ctx;
    int64_t sqk = (int64_t)j->H * j->dk, svo = (int64_t)j->H * j->dv;
    float *S = j->S + h * j->dk * j->dv;
    if (j->C > 1)
        k3_ref_kda_head_chunked(j->q + h * j->dk, j->k + h * j->dk, j->v + h * j->dv,
                                j->g + h * j->dk, j->beta + h, j->n, sqk, svo, j->H, j->dk, j->dv,
                                j->scale, S, j->o + h * j->dv, j->C,
                                j->work + (size_t)h * k3_kda_chunk_work_floats(j->C, j->dk, j->dv));
    else
        k3_ref_kda_head_recurrent(j->q + h * j->dk, j->k + h * j->dk, j->v + h * j->dv,
                                  j->g + h * j->dk, j->beta + h, j->n, sqk, svo, j->H, j->dk, j->dv,
                                  j->scale, S, j->o + h * j->dv);
}
k3_status k3_cpu_kda_recurrent(k3_backend *be, const float *q, const float *k, const float *v,
                               const float *g, const float *beta, int64_t n, int H, int dk, int dv,
                               float scale, float *S, float *o) {
    K3_TRY(k3_kernels_check_kda(dk, dv, 1));
    kda_job j = {q, k, v, g, beta, n, H, dk, dv, 0, scale, S, o, NULL};
    if (n * H * dk * dv < K3_CPU_PAR_MIN_MACS) { /* a decode step of small heads: inline */
        for (int h = 0; h < H; h++) kda_task(&j, h);
        return K3_OK;
    }
    k3_pool_run(k3_cpu_pool(be), H, kda_task, &j);
    return K3_OK;
}
k3_status k3_cpu_kda_chunked(k3_backend *be, const float *q, const float *k, const float *v,
                             const float *g, const float *beta, int64_t n, int H, int dk, int dv,
                             float scale, float *S, float *o, int C, float *work) {
    K3_TRY(k3_kernels_check_kda(dk, dv, C));
    kda_job j = {q, k, v, g, beta, n, H, dk, dv, C, scale, S, o, work};
    k3_pool_run(k3_cpu_pool(be), H, kda_task, &j);
    return K3_OK;
}

/* kda_gate: per token on the pool (each token's outputs are its own). */
typedef struct {
    float *r;
    const float *dt_bias, *a_log;
    int64_t T;
    int H, dk;
    bool lb_form;
    float lb;
} gate_job;
static void gate_task(void *ctx, int64_t t) {
    const gate_job *j = ctx;
    k3_ref_kda_gate_rows(j->r, j->dt_bias, j->a_log, t, t + 1, j->H, j->dk, j->lb_form, j->lb);
}
k3_status k3_cpu_kda_gate(k3_backend *be, float *r, const float *dt_bias, const float *a_log,
                          int64_t T, int H, int dk, bool has_lower_bound, float lower_bound) {
    gate_job j = {r, dt_bias, a_log, T, H, dk, has_lower_bound, lower_bound};
    if (T * H * dk < K3_CPU_PAR_MIN_MACS / 8) {
        k3_ref_kda_gate_rows(r, dt_bias, a_log, 0, T, H, dk, has_lower_bound, lower_bound);
        return K3_OK;
    }
    k3_pool_run(k3_cpu_pool(be), T, gate_task, &j);
    return K3_OK;
}
