/* cpu.c — the cpu backend: the ops of k3_kernels.h over the kernel table of its ISA (cpu_kern.h:
 * AVX-512, AVX2 + FMA or scalar, picked by cpuid or K3_ISA at creation) and the persistent pool
 * of pool.c. Semantics are ref/'s; results differ from ref only by summation order inside a dot
 * product (VL-lane partial sums) and by the exp/tanh polynomials of the activations, and are
 * bit-reproducible on their own within one ISA:
 *
 * Determinism: y[t,o] of matmul is one dot product whose lane assignment and final reduction
 * depend only on `in` — the same code path computes it whether the call has 1 token or 512,
 * and threads split over output rows (matmul), columns (matmul_tn), heads (KDA, attention) or
 * tokens (norms), never inside one reduction.
 * Ops that are not bottlenecks reuse the reference code (per head / per row) from the workers. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <math.h>

#include "cpu_kern.h"

/* A matmul task streams at least this many weight bytes (~10 µs at DRAM speed); a decode
   (T < 4) task at least K3_CPU_GEMV_TASK_BYTES (~3 µs: the workers spin between the matmuls of
   a decode step, so a hand-off costs well under that), and a decode call is split at all only
   when two threads get K3_CPU_GEMV_PAR_BYTES each (a hand-off and its wait cost ~2 µs: the tiny
   model's 32 KB matrices, grouped or not, stay on the caller, so 2 threads are never slower),
   its guided shares sized for the threads it keeps busy that way (a 1 MB matrix on a 32-thread
   pool: 8 threads' worth of tasks, not the caller alone as when every thread had to get 128 KB),
   and, while every worker sleeps, only from K3_CPU_WAKE_BYTES: waking one costs tens of µs on
   a VM, more on a loaded host. The tiny model's one split per token, its 1 MB LM head, woke a
   worker each token, and its 2-thread decode fell to 0.7-0.9x of 1 thread in loaded phases; it
   now runs no pool job at all. A decode step of a larger model keeps the workers awake. */
#define K3_CPU_TASK_BYTES (128 * 1024)
/* A prefill task does at least this many multiply-adds (~10 µs on one core; the tiny model's
   64-token prefill stays on the caller: two hand-offs would cost more than its matmuls). */
#define K3_CPU_TASK_MACS       (1 << 20)
#define K3_CPU_GEMV_TASK_BYTES (32 * 1024)
#define K3_CPU_GEMV_PAR_BYTES  (128 * 1024)
#define K3_CPU_WAKE_BYTES      (2 << 20)

/* Bytes of one weight row (F32, BF16, or MXFP4 codes + E8M0 scales). */
static int64_t row_bytes(const k3_tensor *W) {
    int64_t in = W->shape[1];
    return W->dtype == K3_DT_F32 ? 4 * in : W->dtype == K3_DT_BF16 ? 2 * in : in / 2 + in / 32;
}

static const k3_cpu_kern *kern(k3_backend *be) {
    return k3_cpu_kern_of(be);
}

/* matmul and matmul_group: the rows of all items, end to end, cut into tasks all in one pool job
 * (a decode step's 16 expert matrices: one hand-off instead of 16). Smaller products run on the
 * caller: a dispatch costs more than it saves. Guided shares: each task takes 1/(2·threads) of
 * the bytes left, so tasks start long (the prefetchers ramp up once) and end short (a thread
 * that falls behind, on a shared host, costs one small task, not an eighth of the matrix), but
 * no less than K3_CPU_GEMV_TASK_BYTES for decode (all T < 4: weight streaming) or, for prefill,
 * half of an equal share of k tasks (k: at most 4 per thread, each at least K3_CPU_TASK_BYTES
 * or K3_CPU_TASK_MACS multiply-adds). A task is a run of pieces, each rows [r0, r1) of one
 * item, cut at multiples of 4 rows (24 for prefill: whole register tiles), so every output is the
 * kernel's, bit for bit, whichever task has it. */
#define K3_CPU_GROUP_PIECES 512
typedef struct {
    const k3_mm *mm;
    const k3_cpu_kern *kern;
    bool gemv_seq;                             /* the backend's decode row order (k3_cpu_ctx) */
    const float *xpk[K3_CPU_GROUP_PIECES / 2]; /* item i's x packed once (NULL: per task) */
    int n_pieces, n_tasks;
    int32_t item[K3_CPU_GROUP_PIECES];
    int64_t r0[K3_CPU_GROUP_PIECES], r1[K3_CPU_GROUP_PIECES];
    int32_t first[K3_CPU_GROUP_PIECES + 1]; /* task t: pieces [first[t], first[t + 1]) */
} mmg_job;

static void mmg_task(void *ctx, int64_t t) {
    const mmg_job *j = ctx;
    for (int p = j->first[t]; p < j->first[t + 1]; p++) {
        const k3_mm *m = &j->mm[j->item[p]];
        if (j->xpk[j->item[p]])
            j->kern->mm_rows_xpk(m->W, m->x, j->xpk[j->item[p]], m->T, j->r0[p], j->r1[p], m->y);
        else
            j->kern->mm_rows(m->W, m->x, m->T, j->r0[p], j->r1[p], m->y, j->gemv_seq);
    }
}

/* Prefill items' x packed once for all the tasks that split their rows (instead of once per
 * task): one buffer per distinct (x, T, in, MXFP4 or not), packed by a pool job over token
 * blocks, in the backend's scratch (at most K3_CPU_XPK_MAX floats; busy or too big: the tasks
 * pack for themselves, the same bits). */
#define K3_CPU_XPK_MAX   ((size_t)8 << 20) /* floats: 32 MB */
#define K3_CPU_XPK_TASKS 256
typedef struct {
    const k3_cpu_kern *kern;
    int n;
    const k3_mm *mm[K3_CPU_XPK_TASKS];
    float *dst[K3_CPU_XPK_TASKS];
    int64_t t0[K3_CPU_XPK_TASKS], t1[K3_CPU_XPK_TASKS];
} xpk_job;
static void xpk_task(void *ctx, int64_t t) {
    const xpk_job *j = ctx;
    j->kern->xpk_pack(j->mm[t]->W, j->mm[t]->x, j->mm[t]->T, j->t0[t], j->t1[t], j->dst[t]);
}
static bool xpk_share(k3_backend *be, const k3_mm *mm, int n, const float **xpk) {
    k3_cpu_ctx *c = be->ctx;
    int key[K3_CPU_GROUP_PIECES / 2];
    size_t off[K3_CPU_GROUP_PIECES / 2], total = 0;
    int n_keys = 0;
    for (int i = 0; i < n; i++) {
        xpk[i] = NULL, key[i] = -1;
        if (k3_cpu_gemv_path(c->kern, mm[i].W, mm[i].T) || mm[i].W->shape[0] <= 0) continue;
        for (int q = 0; q < i && key[i] < 0; q++)
            if (key[q] >= 0 && mm[q].x == mm[i].x && mm[q].T == mm[i].T &&
                mm[q].W->shape[1] == mm[i].W->shape[1] &&
                (mm[q].W->dtype == K3_DT_MXFP4) == (mm[i].W->dtype == K3_DT_MXFP4))
                key[i] = key[q], off[i] = off[q];
        if (key[i] < 0) {
            key[i] = n_keys++, off[i] = total;
            total += (size_t)c->kern->xpk_floats(mm[i].T, mm[i].W->shape[1]);
        }
    }
    if (total == 0 || total > K3_CPU_XPK_MAX ||
        __atomic_exchange_n(&c->xpk_busy, 1, __ATOMIC_ACQUIRE))
        return false;
    if (c->xpk_cap < total) {
        k3_free(c->xpk);
        c->xpk_cap = 0;
        if (k3_alloc((void **)&c->xpk, total * sizeof(float), "packed prefill x") != K3_OK) {
            c->xpk = NULL;
            __atomic_store_n(&c->xpk_busy, 0, __ATOMIC_RELEASE);
            return false;
        }
        c->xpk_cap = total;
    }
    xpk_job pj = {.kern = c->kern};
    const int64_t per_key = K3_MAX(1, K3_CPU_XPK_TASKS / K3_MAX(n_keys, 1));
    for (int i = 0; i < n; i++) {
        if (key[i] < 0) continue;
        xpk[i] = c->xpk + off[i];
        bool first = true; /* pack each key once, at its first item */
        for (int q = 0; q < i; q++) first = first && key[q] != key[i];
        if (!first) continue;
        const int64_t T = mm[i].T, gt = c->kern->gt;
        const int64_t blk = K3_MAX(16 * gt, ((T + per_key - 1) / per_key + gt - 1) / gt * gt);
        for (int64_t t0 = 0; t0 < T && pj.n < K3_CPU_XPK_TASKS; t0 += blk) {
            pj.mm[pj.n] = &mm[i], pj.dst[pj.n] = c->xpk + off[i];
            pj.t0[pj.n] = t0, pj.t1[pj.n] = K3_MIN(T, t0 + blk);
            pj.n++;
        }
        K3_ASSERT(pj.t1[pj.n - 1] == T); /* per_key · blk >= T: every token packed */
    }
    if (total < ((size_t)1 << 16)) /* 256 KB: a hand-off would cost more than the copy */
        for (int t = 0; t < pj.n; t++) xpk_task(&pj, t);
    else
        k3_pool_run(k3_cpu_pool(be), pj.n, xpk_task, &pj);
    return true;
}

static k3_status cpu_matmul_group(k3_backend *be, const k3_mm *mm, int n) {
    if (n > K3_CPU_GROUP_PIECES / 2) { /* in parts: pieces <= n + tasks stay within the table */
        for (int b = 0; b < n; b += K3_CPU_GROUP_PIECES / 4)
            K3_TRY(cpu_matmul_group(be, mm + b, K3_MIN(n - b, K3_CPU_GROUP_PIECES / 4)));
        return K3_OK;
    }
    K3_TRY(k3_kernels_check_group(mm, n));
    double bytes = 0, macs = 0;
    bool decode = true;
    for (int i = 0; i < n; i++)
        if (mm[i].T > 0 && mm[i].W->shape[0] > 0) {
            const double wb = (double)mm[i].W->shape[0] * (double)row_bytes(mm[i].W);
            bytes += wb;
            macs += (double)mm[i].T * (double)mm[i].W->shape[0] * (double)mm[i].W->shape[1];
            decode = decode && k3_cpu_gemv_path(kern(be), mm[i].W, mm[i].T);
        }
    if (bytes == 0) return K3_OK;
    const int nth = k3_pool_threads(k3_cpu_pool(be));
    /* the tasks' byte boundaries bound[1 .. nb - 1] (bound[nb] = bytes) */
    double bound[K3_CPU_GROUP_PIECES / 2 + 1];
    int nb = 1;
    /* decode: the threads the bytes keep busy, each with K3_CPU_GEMV_PAR_BYTES at least (all of
       them on a big call; on 2 threads: 2 from 256 KB, as "each thread" was) */
    const double busy = K3_MIN((double)nth, floor(bytes / K3_CPU_GEMV_PAR_BYTES));
    if (nth > 1 && decode && busy >= 2 &&
        (bytes >= K3_CPU_WAKE_BYTES || k3_pool_awake(k3_cpu_pool(be)))) {
        for (double at = 0; nb < K3_CPU_GROUP_PIECES / 2;) {
            at += K3_MAX((double)K3_CPU_GEMV_TASK_BYTES, (bytes - at) / (2.0 * busy));
            if (at >= bytes - 0.5 * K3_CPU_GEMV_TASK_BYTES) break;
            bound[nb++] = at;
        }
    } else if (nth > 1 && !decode) { /* prefill: guided too, no task under half an equal share */
        const int64_t k = K3_MIN(
            (int64_t)nth * 4, (int64_t)K3_MAX(bytes / K3_CPU_TASK_BYTES, macs / K3_CPU_TASK_MACS));
        const double minb = bytes / (double)(2 * K3_MAX(k, 1));
        for (double at = 0; k > 1 && nb < K3_CPU_GROUP_PIECES / 2;) {
            at += K3_MAX(minb, (bytes - at) / (2.0 * nth));
            if (at >= bytes - 0.5 * minb) break;
            bound[nb++] = at;
        }
    }
    bound[nb] = bytes;
    mmg_job j = {.mm = mm, .kern = kern(be), .gemv_seq = ((k3_cpu_ctx *)be->ctx)->gemv_seq};
    /* pieces: the items' rows end to end, cut where the running byte count reaches the next
       task's boundary (to the nearest whole 4- or 24-row group); at most n + nb of them */
    double done = 0;
    int cur = 0; /* tasks closed */
    for (int i = 0; i < n; i++) {
        const int64_t out = mm[i].W->shape[0];
        if (mm[i].T <= 0 || out <= 0) continue;
        const double rb = (double)row_bytes(mm[i].W);
        const int64_t gran = k3_cpu_gemv_path(kern(be), mm[i].W, mm[i].T) ? 4 : 24;
        for (int64_t r = 0; r < out;) {
            int64_t r1 = out;
            if (cur + 1 < nb) {
                const int64_t k = llround((bound[cur + 1] - done) / rb / (double)gran) * gran;
                if (k <= 0) { /* the boundary falls here */
                    j.first[++cur] = j.n_pieces;
                    continue;
                }
                if (k < out - r) r1 = r + k;
            }
            K3_ASSERT(j.n_pieces < K3_CPU_GROUP_PIECES);
            j.item[j.n_pieces] = i, j.r0[j.n_pieces] = r, j.r1[j.n_pieces] = r1;
            j.n_pieces++;
            done += (double)(r1 - r) * rb;
            if (r1 < out) j.first[++cur] = j.n_pieces; /* cut at a boundary */
            r = r1;
        }
    }
    j.first[++cur] = j.n_pieces;
    j.n_tasks = cur;
    /* prefill rows split over several tasks: x packed once for all of them */
    const bool shared = !decode && j.n_tasks > 1 && xpk_share(be, mm, n, j.xpk);
    k3_pool_run(k3_cpu_pool(be), j.n_tasks, mmg_task, &j);
    if (shared) __atomic_store_n(&((k3_cpu_ctx *)be->ctx)->xpk_busy, 0, __ATOMIC_RELEASE);
    return K3_OK;
}

static k3_status cpu_matmul(k3_backend *be, const float *x, int64_t T, const k3_tensor *W,
                            float *y) {
    K3_TRY(k3_kernels_check_weight(W, "matmul"));
    const k3_mm one = {x, T, W, y};
    return cpu_matmul_group(be, &one, 1);
}

/* y[t, i] = Σ_o x[t,o] W[o,i] with o ascending for every element; tasks split over columns. */
typedef struct {
    const float *x;
    int64_t T;
    const k3_tensor *W;
    float *y;
    int64_t cols_per_task;
    const k3_cpu_kern *kern;
} mmtn_job;

static void mmtn_task(void *ctx, int64_t task) {
    const mmtn_job *j = ctx;
    int64_t c0 = task * j->cols_per_task, c1 = K3_MIN(j->W->shape[1], c0 + j->cols_per_task);
    j->kern->mmtn_cols(j->W, j->x, j->T, c0, c1, j->y);
}

static k3_status cpu_matmul_tn(k3_backend *be, const float *x, int64_t T, const k3_tensor *W,
                               float *y) {
    K3_TRY(k3_kernels_check_weight(W, "matmul_tn"));
    int64_t out = W->shape[0], in = W->shape[1];
    if (T <= 0 || in <= 0) return K3_OK;
    mmtn_job j = {.x = x, .T = T, .W = W, .y = y, .cols_per_task = in, .kern = kern(be)};
    int nth = k3_pool_threads(k3_cpu_pool(be));
    if (T * out * in >= K3_CPU_PAR_MIN_MACS && nth > 1) {
        /* one column range per thread: each walks its columns of every row in memory order
           (kern_tmpl.h), and longer pieces of a row stream faster (BF16 81920 × 4096, two
           threads: 2 KB of each 8 KB row per task 16 GB/s, 4 KB 23) */
        int64_t n_tasks = K3_MIN((in + 31) / 32, (int64_t)nth);
        j.cols_per_task = ((in + n_tasks - 1) / n_tasks + 31) & ~(int64_t)31;
    }
    k3_pool_run(k3_cpu_pool(be), (in + j.cols_per_task - 1) / j.cols_per_task, mmtn_task, &j);
    return K3_OK;
}

/* ---- norms: the ISA's row blocks (kern_tmpl.h norm_rows: ref's bits, VL tokens in the lanes),
 * tasks of whole blocks of tokens from the pool; small calls on the caller ------------------------
 */
/* tokens of a norm task: a multiple of every ISA's VL */
#define K3_CPU_NORM_BLOCK 16
typedef struct {
    const float *x, *w;
    int64_t xs, ys, n, T, per;
    float eps;
    bool l2;
    float *y;
    const k3_cpu_kern *kern;
} norm_job;
static void norm_task(void *ctx, int64_t i) {
    const norm_job *j = ctx;
    j->kern->norm_rows(j->x, j->xs, j->w, j->n, j->eps, j->l2, j->y, j->ys, i * j->per,
                       K3_MIN(j->T, (i + 1) * j->per));
}
static void run_norm(k3_backend *be, const float *x, int64_t xs, const float *w, int64_t T,
                     int64_t n, float eps, bool l2, float *y, int64_t ys) {
    if (T <= 0) return;
    norm_job j = {x, w, xs, ys, n, T, T, eps, l2, y, kern(be)};
    if (T * n < K3_CPU_PAR_MIN_MACS || T <= K3_CPU_NORM_BLOCK) {
        j.kern->norm_rows(x, xs, w, n, eps, l2, y, ys, 0, T);
        return;
    }
    /* about 4 tasks a thread, each whole blocks */
    const int64_t per = T / (4 * (int64_t)k3_pool_threads(k3_cpu_pool(be)));
    j.per =
        K3_MAX((int64_t)1, (per + K3_CPU_NORM_BLOCK - 1) / K3_CPU_NORM_BLOCK) * K3_CPU_NORM_BLOCK;
    k3_pool_run(k3_cpu_pool(be), (T + j.per - 1) / j.per, norm_task, &j);
}
static k3_status cpu_rmsnorm(k3_backend *be, const float *x, const float *w, int64_t T, int64_t n,
                             float eps, float *y) {
    run_norm(be, x, n, w, T, n, eps, false, y, n);
    return K3_OK;
}
/* strided rmsnorm: the same rows, the same bits as rmsnorm */
k3_status k3_cpu_rmsnorm_rows(k3_backend *be, const float *x, int64_t xs, const float *w, int64_t T,
                              int64_t n, float eps, float *y, int64_t ys) {
    K3_TRY(k3_kernels_check_rows(xs, ys, n));
    run_norm(be, x, xs, w, T, n, eps, false, y, ys);
    return K3_OK;
}
static k3_status cpu_l2norm(k3_backend *be, const float *x, int64_t T, int64_t n, float eps,
                            float *y) {
    run_norm(be, x, n, NULL, T, n, eps, true, y, n);
    return K3_OK;
}

/* Activations and softmax: the ISA's vector code, split over the pool in chunks of whole
 * vectors (every element is one function of its inputs, so chunking never changes a bit). */
typedef struct {
    const float *a, *b;
    int64_t n, chunk, row;
    float beta, lin_beta;
    float *y;
    const k3_cpu_kern *kern;
    int which; /* 0 silu, 1 sigmoid, 2 situ, 3 swiglu, 4 softmax rows */
} ew_job;
static void ew_task(void *ctx, int64_t task) {
    const ew_job *j = ctx;
    int64_t i0 = task * j->chunk, m = K3_MIN(j->n, i0 + j->chunk) - i0;
    const float *a = j->a + i0, *b = j->b ? j->b + i0 : NULL;
    float *y = j->y + i0;
    switch (j->which) {
    case 0:
        j->kern->silu(a, m, y);
        break;
    case 1:
        j->kern->sigmoid(a, m, y);
        break;
    case 2:
        j->kern->situ(a, b, m, j->beta, j->lin_beta, y);
        break;
    case 3:
        j->kern->swiglu(a, b, m, y);
        break;
    default:
        for (int64_t r = 0; r < m; r += j->row) j->kern->softmax_row(a + r, j->row, y + r);
        break;
    }
}
/* n elements (softmax: n = T·row, chunks of whole rows): under 8K elements on the caller, else
   threads × k equal chunks of at most ~16K (a MoE tile's 64 × 384 activations: two halves,
   not 16K and 8K), and none under 2K (a pool of many threads: fewer chunks; on 2 threads the
   chunks are 4K at least anyway). */
static k3_status ew_run(k3_backend *be, ew_job *j) {
    const int64_t per = 1 << 14;
    int64_t unit = j->which == 4 ? j->row : 64;
    int64_t units = unit > 0 ? (j->n + unit - 1) / unit : 0;
    if (units == 0) return K3_OK;
    const int64_t nth = k3_pool_threads(k3_cpu_pool(be));
    const int64_t k =
        j->n < per / 2 ? 1 : K3_MIN(nth * ((j->n + nth * per - 1) / (nth * per)), j->n / (per / 8));
    int64_t per_task = (units + k - 1) / k;
    j->chunk = per_task * unit;
    j->kern = kern(be);
    k3_pool_run(k3_cpu_pool(be), (units + per_task - 1) / per_task, ew_task, j);
    return K3_OK;
}
static k3_status cpu_silu(k3_backend *be, const float *x, int64_t n, float *y) {
    return ew_run(be, &(ew_job){.a = x, .n = n, .y = y, .which = 0});
}
static k3_status cpu_sigmoid(k3_backend *be, const float *x, int64_t n, float *y) {
    return ew_run(be, &(ew_job){.a = x, .n = n, .y = y, .which = 1});
}
static k3_status cpu_situ(k3_backend *be, const float *g, const float *u, int64_t n, float beta,
                          float lin_beta, float *y) {
    return ew_run(
        be,
        &(ew_job){.a = g, .b = u, .n = n, .beta = beta, .lin_beta = lin_beta, .y = y, .which = 2});
}
static k3_status cpu_swiglu(k3_backend *be, const float *g, const float *u, int64_t n, float *y) {
    return ew_run(be, &(ew_job){.a = g, .b = u, .n = n, .y = y, .which = 3});
}
static k3_status cpu_softmax(k3_backend *be, const float *x, int64_t T, int64_t n, float *y) {
    if (n <= 0) return K3_OK;
    return ew_run(be, &(ew_job){.a = x, .n = T * n, .row = n, .y = y, .which = 4});
}
/* ref's code on ranges from the pool: AttnRes per token, add/mul per chunk, short_conv per
   block of channels (every output element is the same function of its inputs as in ref, so
   these stay bit-identical to ref whatever the split). run_ranges calls fn(ctx, i0, i1) over
   [0, n) in ranges of `per` (per >= n: one range, on the caller). */
typedef void (*range_fn)(const void *ctx, int64_t i0, int64_t i1);
typedef struct {
    range_fn fn;
    const void *ctx;
    int64_t n, per;
} range_job;
static void range_task(void *c, int64_t i) {
    const range_job *r = c;
    r->fn(r->ctx, i * r->per, K3_MIN(r->n, (i + 1) * r->per));
}
static void run_ranges(k3_backend *be, int64_t n, int64_t per, range_fn fn, const void *ctx) {
    range_job r = {fn, ctx, n, per};
    k3_pool_run(k3_cpu_pool(be), (n + per - 1) / per, range_task, &r);
}

typedef struct {
    const float *bank, *p, *w;
    int n_bank;
    int64_t T, D;
    float eps;
    float *out;
    const k3_cpu_kern *kern;
} mix_args;
static void mix_range(const void *ctx, int64_t t0, int64_t t1) {
    const mix_args *j = ctx;
    j->kern->attnres_rows(j->bank, j->n_bank, j->p, j->w, j->T, j->D, j->eps, j->out, t0, t1);
}
static k3_status cpu_attnres_mix(k3_backend *be, const float *bank, int n_bank, const float *p,
                                 const float *w, int64_t T, int64_t D, float eps, float *out) {
    K3_TRY(k3_ref_attnres_check(n_bank));
    if (T <= 0) return K3_OK;
    mix_args j = {bank, p, w, n_bank, T, D, eps, out, kern(be)};
    int64_t per = T;
    if (T > 1 && T * D * (n_bank + 1) >= K3_CPU_PAR_MIN_MACS) /* whole blocks of tokens */
        per = K3_MAX((int64_t)1,
                     T / (4 * (int64_t)k3_pool_threads(k3_cpu_pool(be))) / K3_CPU_NORM_BLOCK) *
              K3_CPU_NORM_BLOCK;
    run_ranges(be, T, per, mix_range, &j);
    return K3_OK;
}

typedef struct {
    const float *a, *b;
    float *y;
} bin_args;
static void add_range(const void *ctx, int64_t i0, int64_t i1) {
    const bin_args *j = ctx;
    k3_ref_ops.add(NULL, j->a + i0, j->b + i0, i1 - i0, j->y + i0);
}
static void mul_range(const void *ctx, int64_t i0, int64_t i1) {
    const bin_args *j = ctx;
    k3_ref_ops.mul(NULL, j->a + i0, j->b + i0, i1 - i0, j->y + i0);
}
/* 256 KB of each operand per task, once the whole is worth a dispatch */
static int64_t bin_per(int64_t n) {
    return n >= 4 * K3_CPU_PAR_MIN_MACS ? (int64_t)1 << 16 : K3_MAX(n, (int64_t)1);
}
static k3_status cpu_add(k3_backend *be, const float *a, const float *b, int64_t n, float *y) {
    if (n > 0) run_ranges(be, n, bin_per(n), add_range, &(bin_args){a, b, y});
    return K3_OK;
}
static k3_status cpu_mul(k3_backend *be, const float *a, const float *b, int64_t n, float *y) {
    if (n > 0) run_ranges(be, n, bin_per(n), mul_range, &(bin_args){a, b, y});
    return K3_OK;
}
static k3_status cpu_fill(k3_backend *be, float *y, int64_t n, float v) {
    return k3_ref_ops.fill(be, y, n, v);
}
static k3_status cpu_copy2d(k3_backend *be, float *dst, int64_t dst_stride, const float *src,
                            int64_t src_stride, int64_t rows, int64_t cols) {
    return k3_ref_ops.copy2d(be, dst, dst_stride, src, src_stride, rows, cols);
}
static k3_status cpu_to_f32(k3_backend *be, const k3_tensor *t, int64_t n, float *dst) {
    return k3_ref_ops.to_f32(be, t, n, dst);
}
static k3_status cpu_embed_rows(k3_backend *be, const k3_tensor *W, const int32_t *ids, int64_t T,
                                float *out) {
    return k3_ref_ops.embed_rows(be, W, ids, T, out);
}
typedef struct {
    const float *in, *w, *state;
    int64_t n, P;
    int K;
    float *out;
    const k3_cpu_kern *kern;
} conv_args;
static void conv_range(const void *ctx, int64_t c0, int64_t c1) {
    const conv_args *j = ctx;
    if (j->K <= 16)
        j->kern->conv_cols(j->in, j->n, j->P, j->K, j->w, j->state, j->out, c0, c1);
    else
        k3_ref_short_conv_cols(j->in, j->n, j->P, j->K, j->w, j->state, j->out, c0, c1);
}
static k3_status cpu_short_conv(k3_backend *be, const float *in, int64_t n, int64_t P, int K,
                                const float *w, float *state, float *out) {
    if (n <= 0 || P <= 0) return k3_ref_ops.short_conv(be, in, n, P, K, w, state, out);
    conv_args j = {in, w, state, n, P, K, out, kern(be)};
    int64_t per = P;
    if (n * P * K >= K3_CPU_PAR_MIN_MACS) /* blocks of 64 channels: whole cache lines per task */
        per = K3_MAX((int64_t)64, (P / (4 * (int64_t)k3_pool_threads(k3_cpu_pool(be)))) & ~63);
    run_ranges(be, P, per, conv_range, &j);
    k3_ref_short_conv_state(in, n, P, K, state); /* after every output read the old state */
    return K3_OK;
}

typedef struct {
    const float *scores, *bias;
    int E, K, G, topk_group;
    bool renorm;
    float scale;
    float *work, *w;
    int32_t *ids;
    k3_status *st; /* [T] */
} topk_job;
static void topk_task(void *ctx, int64_t t) {
    const topk_job *j = ctx;
    j->st[t] = k3_ref_moe_topk_rows(j->scores, j->bias, t, t + 1, j->E, j->K, j->G, j->topk_group,
                                    j->renorm, j->scale, j->work, j->ids, j->w);
}
static k3_status cpu_moe_topk(k3_backend *be, const float *scores, const float *bias, int64_t T,
                              int E, int K, int n_group, int topk_group, bool renorm, float scale,
                              float *work, int32_t *ids, float *w) {
    K3_TRY(k3_kernels_check_topk(E, K, n_group, topk_group));
    /* Small batches (and every error path: the first failing token, as ref reports it) run on
       the caller; large ones per token on the pool with the statuses kept on the stack in
       tiles, so an error still names the first bad token. */
    enum { TILE = 256 };
    k3_status st[TILE];
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
        int64_t n = K3_MIN((int64_t)TILE, T - t0);
        if (n * E < K3_CPU_PAR_MIN_MACS / 8) {
            K3_TRY(k3_ref_moe_topk_rows(scores, bias, t0, t0 + n, E, K, n_group, topk_group, renorm,
                                        scale, work, ids, w));
            continue;
        }
        topk_job j = {
            scores + t0 * E, bias,         E, K, n_group, topk_group, renorm, scale, work + t0 * E,
            w + t0 * K,      ids + t0 * K, st};
        k3_pool_run(k3_cpu_pool(be), n, topk_task, &j);
        for (int64_t i = 0; i < n; i++)
            if (st[i] != K3_OK) /* redo serially from this tile for the message of the first */
                return k3_ref_moe_topk_rows(scores, bias, t0, t0 + n, E, K, n_group, topk_group,
                                            renorm, scale, work, ids, w);
    }
    return K3_OK;
}

/* rows_gather / rows_scatter: ref's row copies in ranges of rows from the pool once the whole
   is worth a dispatch (a 512-token prefill moves 4096 rows of 768 per MoE layer each way) */
typedef struct {
    const float *src;
    int64_t width;
    const int64_t *idx;
    float *dst;
    bool scatter;
} rows_args;
static void rows_range(const void *ctx, int64_t j0, int64_t j1) {
    const rows_args *a = ctx;
    if (a->scatter)
        k3_ref_ops.rows_scatter(NULL, a->src + j0 * a->width, a->width, a->idx + j0, j1 - j0,
                                a->dst);
    else
        k3_ref_ops.rows_gather(NULL, a->src, a->width, a->idx + j0, j1 - j0,
                               a->dst + j0 * a->width);
}
static k3_status rows_copy(k3_backend *be, const rows_args *a, int64_t n) {
    if (n <= 0) return K3_OK;
    /* add/mul's rule (bin_per) in whole rows: ~256 KB of rows per task, or all on the caller */
    const int64_t w = K3_MAX(a->width, (int64_t)1);
    run_ranges(be, n, K3_MAX((int64_t)1, bin_per(n * w) / w), rows_range, a);
    return K3_OK;
}
static k3_status cpu_rows_gather(k3_backend *be, const float *src, int64_t width,
                                 const int64_t *idx, int64_t n, float *dst) {
    return rows_copy(be, &(rows_args){src, width, idx, dst, false}, n);
}
static k3_status cpu_rows_scatter(k3_backend *be, const float *src, int64_t width,
                                  const int64_t *idx, int64_t n, float *dst) {
    return rows_copy(be, &(rows_args){src, width, idx, dst, true}, n);
}

typedef struct {
    const float *x, *w;
    const int64_t *seg;
    int64_t seg_len, width;
    float *y;
    const k3_cpu_kern *kern;
} wsum_job;
static void wsum_task(void *ctx, int64_t j) {
    const wsum_job *q = ctx;
    q->kern->wsum_seg(q->x, q->w, q->seg, q->seg_len, j, q->width, q->y);
}
static k3_status cpu_rows_wsum(k3_backend *be, const float *x, const float *w, const int64_t *seg,
                               int64_t seg_len, int64_t n_seg, int64_t width, float *y) {
    K3_TRY(k3_kernels_check_seg(seg, seg_len, n_seg));
    wsum_job j = {x, w, seg, seg_len, width, y, kern(be)};
    int64_t rows = seg ? (n_seg > 0 ? seg[n_seg] - seg[0] : 0) : n_seg * seg_len;
    if (rows * width < K3_CPU_PAR_MIN_MACS) {
        for (int64_t s = 0; s < n_seg; s++) wsum_task(&j, s);
        return K3_OK;
    }
    k3_pool_run(k3_cpu_pool(be), n_seg, wsum_task, &j);
    return K3_OK;
}

/* ops whose bodies live in cpu_kda.c and cpu_attn.c */
#define cpu_kda_recurrent      k3_cpu_kda_recurrent
#define cpu_kda_chunked        k3_cpu_kda_chunked
#define cpu_kda_gate           k3_cpu_kda_gate
#define cpu_attn_latent        k3_cpu_attn_latent
#define cpu_attn_latent_causal k3_cpu_attn_latent_causal
/* the varlen ops: ref's code where it is a loop of this backend's own ops (matmul_heads per
   head, short_conv_seqs per sequence) or plain copies (kv_write, rows_last, nonfinite_rows) */
#define cpu_rmsnorm_rows           k3_cpu_rmsnorm_rows
#define cpu_matmul_heads           k3_ref_matmul_heads
#define cpu_kv_write               k3_ref_kv_write
#define cpu_attn_paged             k3_cpu_attn_paged
#define cpu_short_conv_seqs        k3_ref_short_conv_seqs
#define cpu_kda_seqs               k3_cpu_kda_seqs
#define cpu_nonfinite_rows         k3_ref_nonfinite_rows
#define cpu_rows_last              k3_ref_rows_last
#define cpu_moe_experts            k3_cpu_moe_experts
#define CPU_OP(name, params, args) .name = cpu_##name,
const k3_ops k3_cpu_ops = {K3_OP_LIST(CPU_OP)};
#undef CPU_OP
