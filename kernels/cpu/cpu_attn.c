/* cpu_attn.c — the cpu backend's latent attention (attn_latent, K3-MODEL.md §3.2): one query
 * token's heads over its sequence's latent cache, per head on the pool (the ISA's attn_head). */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include "cpu_kern.h"

/* Work below this many multiply-adds runs on the calling thread only (as in cpu.c). */
#define K3_CPU_PAR_MIN_MACS (1 << 15)

typedef struct {
    const float *qc, *cache;
    int64_t n_ctx;
    int W, Rkv;
    float scale;
    float *o, *work;
    const k3_cpu_kern *kern;
} lat_job;
static void lat_task(void *ctx, int64_t h) {
    const lat_job *j = ctx;
    j->kern->attn_head(j->qc + h * j->W, j->cache, j->n_ctx, j->W, j->Rkv, j->scale,
                       j->o + h * j->Rkv, j->work + h * j->n_ctx);
}
k3_status k3_cpu_attn_latent(k3_backend *be, const float *qc, const float *cache, int64_t n_ctx,
                             int H, int W, int Rkv, float scale, float *o_lat, float *work) {
    lat_job j = {qc, cache, n_ctx, W, Rkv, scale, o_lat, work, k3_cpu_kern_of(be)};
    if (n_ctx * H * W < K3_CPU_PAR_MIN_MACS) {
        for (int h = 0; h < H; h++) lat_task(&j, h);
        return K3_OK;
    }
    k3_pool_run(k3_cpu_pool(be), H, lat_task, &j);
    return K3_OK;
}
