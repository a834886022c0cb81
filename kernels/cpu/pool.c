/* pool.c — the cpu backend's small persistent thread pool, one per backend object (it lives in
 * the backend's context, not in a global).
 *
 * Owns: the worker threads and the one job slot. A job is n_tasks independent tasks that the
 * caller and the workers claim one index at a time. Because tasks own disjoint outputs and never
 * split one reduction, WHICH thread runs a task never changes a bit of the result.
 * Invariants: no allocation per job; a call from inside a task, or while another thread holds
 * the pool, runs its tasks inline (same results, no deadlock). Workers are started lazily by the
 * first job and joined by k3_pool_destroy.
 *
 * Hand-off (a decode step dispatches ~400 jobs per token, microseconds apart):
 *  - `job` = (generation << 32) | next task index; tasks are claimed by compare-and-swap on it,
 *    so a claim is valid only for its own generation. The caller closes a finished job by
 *    setting the index to CLOSED, then waits only for the workers inside it (`in_job`); a worker
 *    counts itself in before it reads `job`, so a worker that woke too late finds the job closed
 *    and the caller never waits for a thread the scheduler has not run (a loaded 2-core box).
 *  - Between jobs a worker spins on `epoch` for up to K3_POOL_SPIN_NS (pause instructions), then
 *    sleeps on a condition variable; the caller waits for `in_job` the same way. Sleep and wake
 *    cannot cross: the sleeper counts itself in `sleepers` (or sets `caller_waiting`) before its
 *    last check, the other side checks that after its own store (all sequentially consistent),
 *    and the wake-up is sent under the mutex. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#define K3_POOL_MAX 64
/* 200 µs: a decode step's longest serial stretches (between tokens, a long attention) stay under
   it, so its workers never sleep mid-step (the small preset at 2 threads: 50 µs let them sleep
   ~4 times per token, each a futex wake-up, and made the cpu backend run its smaller matmuls
   inline meanwhile; 200 µs: none in 256 tokens) */
#define K3_POOL_SPIN_NS 200000
#define K3_POOL_STACK   ((size_t)16 << 20) /* bytes of a worker's stack (reserved, not touched) */
#define JOB_CLOSED      0xffffffffu        /* index of a closed job (>= any n_tasks) */

struct k3_pool {
    pthread_mutex_t run_mu; /* held by the thread that owns the current job */
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    pthread_t th[K3_POOL_MAX];
    int n_started; /* worker threads created */
    int want;      /* threads wanted (caller + workers) */
    atomic_bool quit;
    atomic_uint_fast64_t epoch; /* bumped once per job: what sleeping/spinning workers watch */
    atomic_uint_fast64_t job;   /* (generation << 32) | next index (JOB_CLOSED when done) */
    atomic_int in_job;          /* workers inside the current job */
    atomic_int sleepers;        /* workers asleep (or about to be) on cv_work */
    atomic_bool caller_waiting; /* the caller sleeps (or is about to) on cv_done */
    /* the job's fields: written by the caller before `job` opens, stable until it is closed and
       in_job is 0 (a worker reads them only while counted in in_job with the job open) */
    k3_task_fn fn;
    void *ctx;
    int64_t n_tasks;
};
/* The pool whose task this thread is running (nested calls run inline). */
static _Thread_local const k3_pool *t_in_pool;

typedef struct {
    k3_pool *p;
    uint64_t seen; /* the epoch when it was created (a job may be posted before it runs) */
} worker_arg;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}
static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
/* Spin (pause) while cond holds, for at most K3_POOL_SPIN_NS; the clock is read every 64 spins. */
#define SPIN_WHILE(cond)                                                                           \
    do {                                                                                           \
        int64_t t0_ = 0;                                                                           \
        for (int s_ = 1; (cond); s_++) {                                                           \
            cpu_relax();                                                                           \
            if (s_ % 64 == 0) {                                                                    \
                int64_t t_ = now_ns();                                                             \
                if (!t0_) t0_ = t_;                                                                \
                if (t_ - t0_ > K3_POOL_SPIN_NS) break;                                             \
            }                                                                                      \
        }                                                                                          \
    } while (0)

k3_status k3_pool_create(int n, k3_pool **out) {
    *out = NULL;
    if (n <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n = c < 1 ? 1 : (int)c;
    }
    if (n > K3_POOL_MAX) n = K3_POOL_MAX;
    k3_pool *p;
    K3_TRY(k3_calloc((void **)&p, sizeof *p, "thread pool"));
    pthread_mutex_init(&p->run_mu, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    atomic_store(&p->job, (uint64_t)JOB_CLOSED);
    p->want = n;
    *out = p;
    return K3_OK;
}

int k3_pool_threads(const k3_pool *p) {
    return p ? p->want : 1;
}

bool k3_pool_awake(const k3_pool *p) {
    return p && p->n_started > atomic_load(&((k3_pool *)p)->sleepers);
}

/* Claim and run tasks of generation gen until none is left (or the job is closed). */
static void drain(k3_pool *p, uint64_t gen) {
    uint64_t j = atomic_load(&p->job);
    for (;;) {
        uint32_t i = (uint32_t)j;
        if ((j >> 32) != gen || i == JOB_CLOSED || (int64_t)i >= p->n_tasks) return;
        if (atomic_compare_exchange_weak(&p->job, &j, j + 1)) {
            p->fn(p->ctx, i);
            j = atomic_load(&p->job);
        }
    }
}

static void *worker(void *arg) {
    k3_pool *p = ((worker_arg *)arg)->p;
    uint64_t seen = ((worker_arg *)arg)->seen;
    k3_free(arg);
    t_in_pool = p;
    for (;;) {
        SPIN_WHILE(atomic_load(&p->epoch) == seen && !atomic_load(&p->quit));
        if (atomic_load(&p->epoch) == seen && !atomic_load(&p->quit)) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while (atomic_load(&p->epoch) == seen && !atomic_load(&p->quit))
                pthread_cond_wait(&p->cv_work, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->quit)) break;
        seen = atomic_load(&p->epoch);
        atomic_fetch_add(&p->in_job, 1); /* before reading job: see the header */
        drain(p, atomic_load(&p->job) >> 32);
        if (atomic_fetch_sub(&p->in_job, 1) == 1 && atomic_load(&p->caller_waiting)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

void k3_pool_run(k3_pool *p, int64_t n_tasks, k3_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!p || n_tasks == 1 || p->want <= 1 || t_in_pool == p || n_tasks >= (int64_t)JOB_CLOSED ||
        pthread_mutex_trylock(&p->run_mu) != 0) {
        for (int64_t i = 0; i < n_tasks; i++) fn(ctx, i);
        return;
    }
    while (p->n_started < p->want - 1) {
        worker_arg *a;
        if (k3_alloc((void **)&a, sizeof *a, "pool worker") != K3_OK) break;
        *a = (worker_arg){p, atomic_load(&p->epoch)};
        /* the kernels keep their tiles' scratch on the stack (prefill matmul ~0.7 MB, latent
           attention ~0.15 MB): workers get a stack of their own size, whatever the ulimit */
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setstacksize(&at, K3_POOL_STACK);
        int rc = pthread_create(&p->th[p->n_started], &at, worker, a);
        pthread_attr_destroy(&at);
        if (rc != 0) {
            k3_free(a);
            break;
        }
        p->n_started++;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    uint64_t gen = (atomic_load(&p->job) >> 32) + 1;
    atomic_store(&p->job, gen << 32); /* opens the job at index 0 */
    atomic_fetch_add(&p->epoch, 1);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv_work);
        pthread_mutex_unlock(&p->mu);
    }

    const k3_pool *outer = t_in_pool;
    t_in_pool = p;
    drain(p, gen);
    t_in_pool = outer;
    atomic_store(&p->job, (gen << 32) | JOB_CLOSED); /* late workers find nothing to claim */

    SPIN_WHILE(atomic_load(&p->in_job) > 0);
    if (atomic_load(&p->in_job) > 0) {
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->caller_waiting, true);
        while (atomic_load(&p->in_job) > 0) pthread_cond_wait(&p->cv_done, &p->mu);
        atomic_store(&p->caller_waiting, false);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&p->run_mu);
}

void k3_pool_destroy(k3_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->quit, true);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_started; i++) pthread_join(p->th[i], NULL);
    pthread_cond_destroy(&p->cv_work);
    pthread_cond_destroy(&p->cv_done);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->run_mu);
    k3_free(p);
}
