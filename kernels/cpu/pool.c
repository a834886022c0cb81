/* pool.c — the cpu backend's small persistent thread pool (process-wide, created lazily).
 *
 * Owns: the worker threads and the one job slot. A job is n_tasks independent tasks; the caller
 * and the workers claim task indices from an atomic counter. Because tasks own disjoint outputs
 * and never split one reduction, WHICH thread runs a task never changes a bit of the result.
 * Invariants: no allocation per job; a call from inside a task, or while another thread holds
 * the pool, runs its tasks inline (same results, no deadlock). Workers sleep on a condition
 * variable between jobs (no busy-spinning on a shared 2-core box) and live until process exit.
 * This is the one piece of mutable global state in kernels/ (STYLE.md §14 allows immutable
 * tables only; a pool is by nature process-wide — it is private to kernels/cpu). */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#define K3_POOL_MAX 64

static struct {
    pthread_mutex_t run_mu; /* held by the thread that owns the current job */
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    int n_started; /* worker threads created */
    int want;      /* participants wanted (caller + workers) */
    uint64_t gen;  /* job generation */
    k3_task_fn fn;
    void *ctx;
    int64_t n_tasks;
    atomic_llong next;
    int busy;                        /* workers still inside the current job */
    int participants;                /* workers allowed in the current job */
    uint64_t start_gen[K3_POOL_MAX]; /* gen at each worker's creation (it may first run later) */
} g_pool = {
    .run_mu = PTHREAD_MUTEX_INITIALIZER,
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .cv_work = PTHREAD_COND_INITIALIZER,
    .cv_done = PTHREAD_COND_INITIALIZER,
};
static _Thread_local bool t_in_pool;

static int default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    if (n > K3_POOL_MAX) n = K3_POOL_MAX;
    return (int)n;
}

void k3_kernels_set_threads(int n) {
    if (n <= 0) n = default_threads();
    if (n > K3_POOL_MAX) n = K3_POOL_MAX;
    pthread_mutex_lock(&g_pool.mu);
    g_pool.want = n;
    pthread_mutex_unlock(&g_pool.mu);
}

int k3_kernels_threads(void) {
    pthread_mutex_lock(&g_pool.mu);
    int n = g_pool.want > 0 ? g_pool.want : default_threads();
    pthread_mutex_unlock(&g_pool.mu);
    return n;
}

static void drain(void) {
    int64_t i;
    while ((i = atomic_fetch_add(&g_pool.next, 1)) < g_pool.n_tasks) g_pool.fn(g_pool.ctx, i);
}

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg; /* 0-based worker index */
    t_in_pool = true;
    uint64_t seen = 0;
    pthread_mutex_lock(&g_pool.mu);
    seen = g_pool.start_gen[id]; /* not g_pool.gen: a job may have been posted before we ran */
    for (;;) {
        while (g_pool.gen == seen) pthread_cond_wait(&g_pool.cv_work, &g_pool.mu);
        seen = g_pool.gen;
        if (id >= g_pool.participants) continue;
        pthread_mutex_unlock(&g_pool.mu);
        drain();
        pthread_mutex_lock(&g_pool.mu);
        if (--g_pool.busy == 0) pthread_cond_signal(&g_pool.cv_done);
    }
    return NULL;
}

void k3_pool_run(int64_t n_tasks, k3_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    int want = k3_kernels_threads();
    if (n_tasks == 1 || want <= 1 || t_in_pool || pthread_mutex_trylock(&g_pool.run_mu) != 0) {
        for (int64_t i = 0; i < n_tasks; i++) fn(ctx, i);
        return;
    }
    pthread_mutex_lock(&g_pool.mu);
    while (g_pool.n_started < want - 1) {
        pthread_t th;
        g_pool.start_gen[g_pool.n_started] = g_pool.gen;
        if (pthread_create(&th, NULL, worker, (void *)(intptr_t)g_pool.n_started) != 0) break;
        pthread_detach(th);
        g_pool.n_started++;
    }
    int workers = K3_MIN(want - 1, g_pool.n_started);
    workers = (int)K3_MIN((int64_t)workers, n_tasks - 1);
    g_pool.fn = fn;
    g_pool.ctx = ctx;
    g_pool.n_tasks = n_tasks;
    atomic_store(&g_pool.next, 0);
    g_pool.participants = workers;
    g_pool.busy = workers;
    g_pool.gen++;
    pthread_cond_broadcast(&g_pool.cv_work);
    pthread_mutex_unlock(&g_pool.mu);

    t_in_pool = true;
    drain();
    t_in_pool = false;

    pthread_mutex_lock(&g_pool.mu);
    while (g_pool.busy > 0) pthread_cond_wait(&g_pool.cv_done, &g_pool.mu);
    pthread_mutex_unlock(&g_pool.mu);
    pthread_mutex_unlock(&g_pool.run_mu);
}
