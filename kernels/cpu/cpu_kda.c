/* cpu_kda.c — the cpu backend's KDA ops (K3-MODEL.md §2): the delta-rule recurrence per head (and
 * block of value columns, for a prompt) on the pool (the table's kda_head, kern_kda.h), its chunked
 * form per head (ref's chunks, then the table's recurrence for the tokens after the last whole
 * chunk), and the decay gate per token. A head's (and a column's) state and outputs are its own,
 * and a column's arithmetic does not depend on its block, so the split never changes a bit. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include "cpu_kern.h"

#include <math.h>
#include <string.h>

/* The recurrence's tasks. A prompt (n >= KDA_SLICE_MIN_N tokens): (head, block of KDA_COLS value
 * columns), the block's slice of S copied into a contiguous buffer on the task's stack for the call
 * and back. In place, a block is 256 bytes of every 512-byte row (dk 128, dv 128): the rows fall on
 * a quarter of L1's sets (16 lines a set for 8 ways), and the neighbour block of the same rows,
 * another thread's task, sits in the lines the hardware prefetcher fetches next, so the two cores
 * took the lines from each other: 2 threads ran a 512-token prompt of small's 8 heads slower than
 * one (8.1 -> 7.5-13.3 ms; with the copy 6.9 -> 3.4). A decode step (fewer tokens): task = head,
 * its state one contiguous stream, in place (2 threads: 41-57 -> 13 us a step of 8 heads; 1
 * thread 16-23 either way). The copy moves floats only: the same bits either way.
 * KDA_COLS: a multiple of every table's column block (4·VL <= 64). */
#define KDA_COLS         64
#define KDA_SLICE_MIN_N  8
#define KDA_SLICE_MAX_DK 256 /* the stack buffer: dk × KDA_COLS floats, 64 KiB at most */

typedef struct {
    const k3_cpu_kern *kern;
    const float *q, *k, *v, *g, *beta;
    int64_t n;
    int H, dk, dv, C, nb; /* nb: column blocks per head (recurrent tasks; 1: whole heads) */
    float scale;
    float *S, *o, *work;
} kda_job;
static void kda_rec_task(void *ctx, int64_t tb) {
    const kda_job *j = ctx;
    const int64_t h = tb / j->nb, sqk = (int64_t)j->H * j->dk, svo = (int64_t)j->H * j->dv;
    const int cols = j->nb == 1 ? j->dv : KDA_COLS;
    const int j0 = (int)(tb % j->nb) * cols, j1 = j0 + cols < j->dv ? j0 + cols : j->dv;
    const float *q = j->q + h * j->dk, *k = j->k + h * j->dk, *g = j->g + h * j->dk;
    float *S = j->S + h * j->dk * j->dv, *o = j->o + h * j->dv;
    if (j->nb > 1 && j->dk <= KDA_SLICE_MAX_DK) {
        _Alignas(64) float buf[KDA_SLICE_MAX_DK * KDA_COLS];
        const size_t w = sizeof(float) * (size_t)(j1 - j0);
        for (int i = 0; i < j->dk; i++) memcpy(buf + i * KDA_COLS, S + (int64_t)i * j->dv + j0, w);
        j->kern->kda_head(q, k, j->v + h * j->dv + j0, g, j->beta + h, j->n, sqk, svo, j->H, j->dk,
                          KDA_COLS, 0, j1 - j0, j->scale, buf, o + j0);
        for (int i = 0; i < j->dk; i++) memcpy(S + (int64_t)i * j->dv + j0, buf + i * KDA_COLS, w);
        return;
    }
    j->kern->kda_head(q, k, j->v + h * j->dv, g, j->beta + h, j->n, sqk, svo, j->H, j->dk, j->dv,
                      j0, j1, j->scale, S, o);
}
/* chunked: task = head; the whole chunks in ref's form, the rest by the recurrence */
static void kda_chunk_task(void *ctx, int64_t h) {
    const kda_job *j = ctx;
    int64_t sqk = (int64_t)j->H * j->dk, svo = (int64_t)j->H * j->dv, nc = j->n / j->C * j->C;
    float *S = j->S + h * j->dk * j->dv;
    k3_ref_kda_head_chunked(j->q + h * j->dk, j->k + h * j->dk, j->v + h * j->dv, j->g + h * j->dk,
                            j->beta + h, nc, sqk, svo, j->H, j->dk, j->dv, j->scale, S,
                            j->o + h * j->dv, j->C,
                            j->work + (size_t)h * k3_kda_chunk_work_floats(j->C, j->dk, j->dv));
    if (nc < j->n)
        j->kern->kda_head(j->q + nc * sqk + h * j->dk, j->k + nc * sqk + h * j->dk,
                          j->v + nc * svo + h * j->dv, j->g + nc * sqk + h * j->dk,
                          j->beta + nc * j->H + h, j->n - nc, sqk, svo, j->H, j->dk, j->dv, 0,
                          j->dv, j->scale, S, j->o + nc * svo + h * j->dv);
}
k3_status k3_cpu_kda_recurrent(k3_backend *be, const float *q, const float *k, const float *v,
                               const float *g, const float *beta, int64_t n, int H, int dk, int dv,
                               float scale, float *S, float *o) {
    K3_TRY(k3_kernels_check_kda(dk, dv, 1));
    const int nb = n >= KDA_SLICE_MIN_N ? (dv + KDA_COLS - 1) / KDA_COLS : 1;
    kda_job j = {k3_cpu_kern_of(be), q, k, v, g, beta, n, H, dk, dv, 1, nb, scale, S, o, NULL};
    if (n * H * dk * dv < K3_CPU_PAR_MIN_MACS) { /* a decode step of small heads: inline */
        for (int64_t t = 0; t < (int64_t)H * nb; t++) kda_rec_task(&j, t);
        return K3_OK;
    }
    k3_pool_run(k3_cpu_pool(be), (int64_t)H * nb, kda_rec_task, &j);
    return K3_OK;
}
k3_status k3_cpu_kda_chunked(k3_backend *be, const float *q, const float *k, const float *v,
                             const float *g, const float *beta, int64_t n, int H, int dk, int dv,
                             float scale, float *S, float *o, int C, float *work) {
    K3_TRY(k3_kernels_check_kda(dk, dv, C));
    if (C == 1) return k3_cpu_kda_recurrent(be, q, k, v, g, beta, n, H, dk, dv, scale, S, o);
    kda_job j = {k3_cpu_kern_of(be), q, k, v, g, beta, n, H, dk, dv, C, 1, scale, S, o, work};
    k3_pool_run(k3_cpu_pool(be), H, kda_chunk_task, &j);
    return K3_OK;
}

/* kda_gate: per token on the pool (each token's outputs are its own). The lower-bound form (K3)
 * is lb·σ(a·(r + dt_bias)) with the table's vector sigmoid; the softplus form keeps ref's rows. */
typedef struct {
    const k3_cpu_kern *kern;
    float *r;
    const float *dt_bias, *a_log;
    int64_t T;
    int H, dk;
    bool lb_form;
    float lb;
} gate_job;
static void gate_rows(const gate_job *j, int64_t t0, int64_t t1) {
    if (!j->lb_form) {
        k3_ref_kda_gate_rows(j->r, j->dt_bias, j->a_log, t0, t1, j->H, j->dk, false, 0.0f);
        return;
    }
    const int64_t P = (int64_t)j->H * j->dk;
    for (int64_t t = t0; t < t1; t++)
        for (int h = 0; h < j->H; h++) {
            float *x = j->r + t * P + (int64_t)h * j->dk;
            const float *db = j->dt_bias + (int64_t)h * j->dk, a = expf(j->a_log[h]);
            for (int i = 0; i < j->dk; i++) x[i] = a * (x[i] + db[i]);
            j->kern->sigmoid(x, j->dk, x);
            for (int i = 0; i < j->dk; i++) x[i] = j->lb * x[i];
        }
}
static void gate_task(void *ctx, int64_t t) {
    gate_rows(ctx, t, t + 1);
}
k3_status k3_cpu_kda_gate(k3_backend *be, float *r, const float *dt_bias, const float *a_log,
                          int64_t T, int H, int dk, bool has_lower_bound, float lower_bound) {
    gate_job j = {k3_cpu_kern_of(be), r, dt_bias, a_log, T, H, dk, has_lower_bound, lower_bound};
    if (T * H * dk < K3_CPU_PAR_MIN_MACS / 8) {
        gate_rows(&j, 0, T);
        return K3_OK;
    }
    k3_pool_run(k3_cpu_pool(be), T, gate_task, &j);
    return K3_OK;
}

/* ---- kda_seqs: the whole varlen batch ------------------------------------------------------
 * Sequences of fewer than KDA_SLICE_MIN_N tokens (a decode step's) are whole-head tasks of one
 * pool run over (sequence, head), their states in place — what kda_recurrent does for each of
 * them; a prompt piece runs as its own kda_recurrent / kda_chunked call (its column blocks or
 * heads fill the pool). A head's recurrence is the same function either way: the same bits. */
typedef struct {
    const k3_cpu_kern *kern;
    const k3_seqs *sq;
    const float *q, *k, *v, *g, *beta;
    int H, dk, dv, C;
    float scale;
    float *S, *o;
    int64_t S_stride;
} kda_seqs_job;
static bool kda_seq_short(const kda_seqs_job *j, int s) {
    const int64_t n = j->sq->tok0[s + 1] - j->sq->tok0[s];
    return n < KDA_SLICE_MIN_N && !(j->C > 1 && n >= j->C);
}
static void kda_seqs_task(void *ctx, int64_t i) {
    const kda_seqs_job *j = ctx;
    const int s = (int)(i / j->H), h = (int)(i % j->H);
    if (!kda_seq_short(j, s)) return;
    const int64_t t0 = j->sq->tok0[s], n = j->sq->tok0[s + 1] - t0;
    const int64_t sqk = (int64_t)j->H * j->dk, svo = (int64_t)j->H * j->dv;
    float *S = j->S + (int64_t)j->sq->slot[s] * j->S_stride + (int64_t)h * j->dk * j->dv;
    j->kern->kda_head(j->q + t0 * sqk + h * j->dk, j->k + t0 * sqk + h * j->dk,
                      j->v + t0 * svo + h * j->dv, j->g + t0 * sqk + h * j->dk,
                      j->beta + t0 * j->H + h, n, sqk, svo, j->H, j->dk, j->dv, 0, j->dv, j->scale,
                      S, j->o + t0 * svo + h * j->dv);
}
k3_status k3_cpu_kda_seqs(k3_backend *be, const k3_seqs *sq, const float *q, const float *k,
                          const float *v, const float *g, const float *beta, int H, int dk, int dv,
                          float scale, float *S, int64_t S_stride, float *o, int C, float *work) {
    K3_TRY(k3_kernels_check_kda(dk, dv, C > 1 ? C : 1));
    kda_seqs_job j = {
        k3_cpu_kern_of(be), sq, q, k, v, g, beta, H, dk, dv, C, scale, S, o, S_stride};
    int64_t n_short = 0, macs = 0;
    for (int s = 0; s < sq->n_seqs; s++) /* a sequence at position 0 starts from S = 0 */
        if (sq->pos[s] == 0)
            memset(S + (int64_t)sq->slot[s] * S_stride, 0,
                   (size_t)H * (size_t)dk * (size_t)dv * sizeof(float));
    for (int s = 0; s < sq->n_seqs; s++)
        if (kda_seq_short(&j, s)) {
            n_short++;
            macs += (int64_t)(sq->tok0[s + 1] - sq->tok0[s]) * H * dk * dv;
        }
    if (n_short > 0) {
        const int64_t n_tasks = (int64_t)sq->n_seqs * H;
        if (macs < K3_CPU_PAR_MIN_MACS)
            for (int64_t i = 0; i < n_tasks; i++) kda_seqs_task(&j, i);
        else
            k3_pool_run(k3_cpu_pool(be), n_tasks, kda_seqs_task, &j);
    }
    if (n_short == sq->n_seqs) return K3_OK;
    const int64_t sqk = (int64_t)H * dk, svo = (int64_t)H * dv;
    for (int s = 0; s < sq->n_seqs; s++) {
        if (kda_seq_short(&j, s)) continue;
        const int64_t t0 = sq->tok0[s], n = sq->tok0[s + 1] - t0;
        float *Si = S + (int64_t)sq->slot[s] * S_stride;
        if (C > 1 && n >= C)
            K3_TRY(k3_cpu_kda_chunked(be, q + t0 * sqk, k + t0 * sqk, v + t0 * svo, g + t0 * sqk,
                                      beta + t0 * H, n, H, dk, dv, scale, Si, o + t0 * svo, C,
                                      work));
        else
            K3_TRY(k3_cpu_kda_recurrent(be, q + t0 * sqk, k + t0 * sqk, v + t0 * svo, g + t0 * sqk,
                                        beta + t0 * H, n, H, dk, dv, scale, Si, o + t0 * svo));
    }
    return K3_OK;
}
