/* cpu_attn.c — the cpu backend's latent attention (attn_latent, attn_latent_causal,
 * K3-MODEL.md §3.2): the (query, head) rows of a call cut into tiles of a few queries × a group
 * of heads, run on the pool (the ISA's attn_rows, kernels/cpu/kern_attn.h: blocks of cache rows
 * at fixed absolute boundaries, online softmax). attn_latent is the causal op's one-query case,
 * so a decode step and a prefill of the same tokens give the same bits. How rows are grouped
 * into tiles and tiles into threads never changes a row's result. A decode step over a long
 * context also splits its keys: the superblocks of one query run as tasks into partials (the
 * first into o_lat, the others into work), and the caller merges them in ascending order, the
 * same steps a tile takes one after another (kern_attn.h), so the bits stay those of one tile. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include "cpu_kern.h"

/* Rows of one task (queries × heads of a group); the kernel's tiles take up to 48. */
#define ATT_TASK_ROWS 48
/* A decode step's head groups: small enough to give the pool several tasks. */
#define ATT_DECODE_HEADS 16

typedef struct {
    const float *qc, *cache;
    const int32_t *blk;
    int64_t pos0, n_q, qb, n_qb;
    int H, W, Rkv, hg, n_hg;
    float scale;
    float *o;
    const k3_cpu_kern *kern;
} lat_job;
/* Task i: query block n_qb − 1 − i / n_hg (the longest contexts first, for balance), head group
 * i % n_hg. */
static void lat_task(void *ctx, int64_t i) {
    const lat_job *j = ctx;
    const int64_t b = j->n_qb - 1 - i / j->n_hg, j0 = b * j->qb,
                  j1 = j0 + j->qb < j->n_q ? j0 + j->qb : j->n_q;
    const int h0 = (int)(i % j->n_hg) * j->hg, h1 = h0 + j->hg < j->H ? h0 + j->hg : j->H;
    j->kern->attn_rows(j->qc, j->cache, j->blk, j->pos0, j0, j1, h0, h1, j->H, j->W, j->Rkv,
                       j->scale, j->o);
}

/* A decode step by superblocks: task i of a wave is head group i % n_hg of superblock
 * s0 + i / n_hg. Superblock 0 writes o_lat and the running max / sum (ML: M [H], then L [H]);
 * any other goes to slot s − s0 − (s0 == 0) of slots ([H·Rkv] outputs, then m [H], l [H]). */
typedef struct {
    const float *qc, *cache;
    const int32_t *blk;
    int64_t n_ctx, s0;
    int H, W, Rkv, hg, n_hg;
    float scale;
    float *o, *ML, *slots;
    const k3_cpu_kern *kern;
} dec_job;
static int64_t dec_slot_floats(const dec_job *j) {
    return (int64_t)j->H * (j->Rkv + 2);
}
static void dec_task(void *ctx, int64_t i) {
    const dec_job *j = ctx;
    const int64_t s = j->s0 + i / j->n_hg;
    const int h0 = (int)(i % j->n_hg) * j->hg, h1 = h0 + j->hg < j->H ? h0 + j->hg : j->H;
    float *o = j->o, *m = j->ML;
    if (s > 0)
        o = j->slots + (s - j->s0 - (j->s0 == 0)) * dec_slot_floats(j), m = o + j->H * j->Rkv;
    j->kern->attn_part(j->qc, j->cache, j->blk, j->n_ctx, h0, h1, j->W, j->Rkv, j->scale,
                       s * j->kern->attn_sb, o + (int64_t)h0 * j->Rkv, m + h0, m + j->H + h0);
}
/* Runs the decode step of context n_ctx in waves of superblocks (as many as work holds) and
 * merges each wave in order on the caller; false when work holds no slot beside o_lat's. */
static bool attn_decode_split(k3_backend *be, const float *qc, const float *cache,
                              const int32_t *blk, int64_t n_ctx, int H, int W, int Rkv, float scale,
                              float *o_lat, float *work) {
    const k3_cpu_kern *kern = k3_cpu_kern_of(be);
    const int64_t n_sb = (n_ctx + kern->attn_sb - 1) / kern->attn_sb;
    dec_job j = {.qc = qc,
                 .cache = cache,
                 .blk = blk,
                 .n_ctx = n_ctx,
                 .H = H,
                 .W = W,
                 .Rkv = Rkv,
                 .hg = H < ATT_DECODE_HEADS ? H : ATT_DECODE_HEADS,
                 .scale = scale,
                 .o = o_lat,
                 .ML = work,
                 .slots = work + 2 * (int64_t)H,
                 .kern = kern};
    j.n_hg = (H + j.hg - 1) / j.hg;
    const int64_t n_slots = ((int64_t)H * n_ctx - 2 * (int64_t)H) / dec_slot_floats(&j);
    if (n_slots < 1) return false;
    for (int64_t s0 = 0; s0 < n_sb;) {
        const int64_t n_w = K3_MIN(n_sb - s0, n_slots + (s0 == 0));
        j.s0 = s0;
        k3_pool_run(k3_cpu_pool(be), n_w * j.n_hg, dec_task, &j);
        for (int64_t s = s0 > 0 ? s0 : 1; s < s0 + n_w; s++) {
            const float *op = j.slots + (s - s0 - (s0 == 0)) * dec_slot_floats(&j);
            const float *m = op + (int64_t)H * Rkv;
            for (int h0 = 0; h0 < H; h0 += j.hg) {
                const int R = H - h0 < j.hg ? H - h0 : j.hg;
                kern->attn_merge(R, j.ML + h0, j.ML + H + h0, o_lat + (int64_t)h0 * Rkv, m + h0,
                                 m + H + h0, op + (int64_t)h0 * Rkv, Rkv);
            }
        }
        s0 += n_w;
    }
    kern->attn_final(H, o_lat, j.ML + H, Rkv);
    return true;
}

k3_status k3_cpu_attn_latent_causal(k3_backend *be, const float *qc, const float *cache,
                                    int64_t pos0, int64_t n_q, int H, int W, int Rkv, float scale,
                                    float *o_lat, float *work) {
    /* the tiles' scratch is on each thread's stack; work holds a split decode's partials */
    K3_TRY(k3_kernels_check_attn("attn_latent_causal", pos0, n_q, H, W, Rkv));
    if (n_q == 0) return K3_OK;
    const k3_cpu_kern *kern = k3_cpu_kern_of(be);
    /* a decode step over more than one superblock: its keys split over the pool */
    if (n_q == 1 && pos0 + 1 > kern->attn_sb && k3_pool_threads(k3_cpu_pool(be)) > 1 && work &&
        attn_decode_split(be, qc, cache, NULL, pos0 + 1, H, W, Rkv, scale, o_lat, work))
        return K3_OK;
    lat_job j = {.qc = qc,
                 .cache = cache,
                 .pos0 = pos0,
                 .n_q = n_q,
                 .H = H,
                 .W = W,
                 .Rkv = Rkv,
                 .scale = scale,
                 .o = o_lat,
                 .kern = kern};
    j.hg = H < ATT_TASK_ROWS ? H : ATT_TASK_ROWS;
    if (n_q == 1 && j.hg > ATT_DECODE_HEADS) j.hg = ATT_DECODE_HEADS;
    j.qb = ATT_TASK_ROWS / j.hg;
    j.n_hg = (H + j.hg - 1) / j.hg;
    j.n_qb = (n_q + j.qb - 1) / j.qb;
    const int64_t n_tasks = j.n_qb * j.n_hg;
    if (n_tasks == 1 || n_q * (pos0 + n_q) * H * (int64_t)(W + Rkv) < K3_CPU_PAR_MIN_MACS) {
        for (int64_t i = 0; i < n_tasks; i++) lat_task(&j, i);
        return K3_OK;
    }
    k3_pool_run(k3_cpu_pool(be), n_tasks, lat_task, &j);
    return K3_OK;
}

k3_status k3_cpu_attn_latent(k3_backend *be, const float *qc, const float *cache, int64_t n_ctx,
                             int H, int W, int Rkv, float scale, float *o_lat, float *work) {
    K3_TRY(k3_kernels_check_attn("attn_latent", 0, n_ctx, H, W, Rkv));
    if (n_ctx == 0) { /* no context: ref's empty sum */
        for (int64_t i = 0; i < (int64_t)H * Rkv; i++) o_lat[i] = 0.0f;
        return K3_OK;
    }
    return k3_cpu_attn_latent_causal(be, qc, cache, n_ctx - 1, 1, H, W, Rkv, scale, o_lat, work);
}

/* ---- attn_paged: the whole varlen batch in one call ----------------------------------------
 * A decode row of a long context splits its keys as above (attn_decode_split, one sequence at a
 * time: the pool is busy with its superblocks); every other (sequence, query block, head group)
 * is one task of a single pool run over the grid n_seqs × ceil(max_new / qb) × n_hg (a cell past
 * a sequence's tokens is empty). How rows meet in tiles never changes a row's bits, so each
 * token's result is attn_latent_causal's on a contiguous copy of its sequence's cache. */
typedef struct {
    const k3_seqs *sq;
    const float *qc, *cache;
    int H, W, Rkv, hg, n_hg;
    int64_t qb, n_qb; /* query block rows, blocks per sequence in the grid */
    float scale;
    float *o;
    const bool *skip; /* [n_seqs] done apart (decode split) */
    const k3_cpu_kern *kern;
} paged_job;
static void paged_task(void *ctx, int64_t i) {
    const paged_job *j = ctx;
    const int64_t per_seq = j->n_qb * j->n_hg;
    const int s = (int)(i / per_seq);
    const int64_t b = (i % per_seq) / j->n_hg;
    const int h0 = (int)(i % j->n_hg) * j->hg, h1 = h0 + j->hg < j->H ? h0 + j->hg : j->H;
    const int64_t t0 = j->sq->tok0[s], n = j->sq->tok0[s + 1] - t0;
    const int64_t q0 = b * j->qb, q1 = q0 + j->qb < n ? q0 + j->qb : n;
    if (q0 >= n || (j->skip && j->skip[s])) return;
    j->kern->attn_rows(j->qc + t0 * j->H * j->W, j->cache,
                       j->sq->blocks + (int64_t)s * j->sq->max_blocks, j->sq->pos[s], q0, q1, h0,
                       h1, j->H, j->W, j->Rkv, j->scale, j->o + t0 * j->H * j->Rkv);
}

#define PAGED_MAX_SPLIT 256 /* sequences whose decode row is split apart, per call at most */

k3_status k3_cpu_attn_paged(k3_backend *be, const k3_seqs *sq, const float *qc, const float *cache,
                            int H, int W, int Rkv, float scale, float *o_lat, float *work) {
    K3_TRY(k3_kernels_check_attn("attn_paged", 0, sq->max_ctx, H, W, Rkv));
    if (sq->n_seqs == 0) return K3_OK;
    if (!sq->blocks) return K3_ERR(K3_ERR_ARG, "attn_paged: the descriptor has no block table");
    const k3_cpu_kern *kern = k3_cpu_kern_of(be);
    const bool par = k3_pool_threads(k3_cpu_pool(be)) > 1;
    /* long-context decode rows: their superblocks split over the pool, one sequence at a time */
    bool skip[PAGED_MAX_SPLIT] = {false};
    int n_skip = 0;
    for (int s = 0; par && work && s < sq->n_seqs && s < PAGED_MAX_SPLIT; s++) {
        const int64_t t0 = sq->tok0[s], n = sq->tok0[s + 1] - t0, ctx = sq->pos[s] + n;
        if (n != 1 || ctx <= kern->attn_sb) continue;
        if (attn_decode_split(be, qc + t0 * H * W, cache, sq->blocks + (int64_t)s * sq->max_blocks,
                              ctx, H, W, Rkv, scale, o_lat + t0 * H * Rkv, work))
            skip[s] = true, n_skip++;
    }
    if (n_skip == sq->n_seqs) return K3_OK;
    paged_job j = {.sq = sq,
                   .qc = qc,
                   .cache = cache,
                   .H = H,
                   .W = W,
                   .Rkv = Rkv,
                   .scale = scale,
                   .o = o_lat,
                   .skip = n_skip ? skip : NULL,
                   .kern = kern};
    j.hg = H < ATT_TASK_ROWS ? H : ATT_TASK_ROWS;
    if (sq->max_new == 1 && j.hg > ATT_DECODE_HEADS) j.hg = ATT_DECODE_HEADS;
    j.qb = ATT_TASK_ROWS / j.hg;
    j.n_hg = (H + j.hg - 1) / j.hg;
    j.n_qb = (sq->max_new + j.qb - 1) / j.qb;
    const int64_t n_tasks = (int64_t)sq->n_seqs * j.n_qb * j.n_hg;
    if (!par || n_tasks == 1 ||
        sq->T * sq->max_ctx * H * (int64_t)(W + Rkv) < K3_CPU_PAR_MIN_MACS) {
        for (int64_t i = 0; i < n_tasks; i++) paged_task(&j, i);
        return K3_OK;
    }
    k3_pool_run(k3_cpu_pool(be), n_tasks, paged_task, &j);
    return K3_OK;
}
