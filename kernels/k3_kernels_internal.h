/* k3_kernels_internal.h — private to kernels/: the per-head pieces of the reference backend that
 * the cpu backend reuses from its worker threads (so the two cannot drift), and the pool API.
 * Nothing outside kernels/ includes this. */
#ifndef K3_KERNELS_INTERNAL_H
#define K3_KERNELS_INTERNAL_H

#include "k3_kernels.h"

/* One KDA head over n tokens. Row strides (floats) of q/k/g (sqk), v/o (svo) and beta (sb);
 * pointers already offset to the head. S [dk, dv]. */
void k3_ref_kda_head_recurrent(const float *q, const float *k, const float *v, const float *g,
                               const float *beta, int64_t n, int64_t sqk, int64_t svo, int64_t sb,
                               int dk, int dv, float scale, float *S, float *o);
void k3_ref_kda_head_chunked(const float *q, const float *k, const float *v, const float *g,
                             const float *beta, int64_t n, int64_t sqk, int64_t svo, int64_t sb,
                             int dk, int dv, float scale, float *S, float *o, int C, float *work);
/* One head of attn_latent: qc [W], cache [n_ctx, W], o [Rkv], work [n_ctx]. */
void k3_ref_attn_latent_head(const float *qc, const float *cache, int64_t n_ctx, int W, int Rkv,
                             float scale, float *o, float *work);

/* The cpu pool: run fn(ctx, i) for i in [0, n_tasks) on the workers + the caller; returns when
 * all are done. Which thread runs a task never changes a result (tasks own disjoint outputs). */
/* A matmul weight must be 2-D [out, in], F32/BF16/MXFP4 (MXFP4: in % 32 == 0, with scales). */
k3_status k3_kernels_check_weight(const k3_tensor *W, const char *op);

typedef void (*k3_task_fn)(void *ctx, int64_t i);
void k3_pool_run(int64_t n_tasks, k3_task_fn fn, void *ctx);

#endif /* K3_KERNELS_INTERNAL_H */
