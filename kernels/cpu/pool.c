/* pool.c — the cpu backend's small persistent thread pool, one per backend object (it lives in
 * the backend's context, not in a global).
 *
 * Owns: the worker threads and the one job slot. A job is n_tasks independent tasks; the caller
 * and the workers claim task indices from an atomic counter. Because tasks own disjoint outputs
 * and never split one reduction, WHICH thread runs a task never changes a bit of the result.
 * Invariants: no allocation per job; a call from inside a task, or while another thread holds
 * the pool, runs its tasks inline (same results, no deadlock). Workers are started lazily by the
 * first job, sleep on a condition variable between jobs (no busy-spinning on a shared 2-core
 * box) and are joined by k3_pool_destroy. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#define K3_POOL_MAX 64

struct k3_pool {
    pthread_mutex_t run_mu; /* held by the thread that owns the current job */
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    pthread_t th[K3_POOL_MAX];
    int n_started; /* worker threads created */
    int want;      /* participants wanted (caller + workers) */
    bool quit;
    uint64_t gen; /* job generation */
    k3_task_fn fn;
    void *ctx;
    int64_t n_tasks;
    atomic_llong next;
    int busy;                        /* workers still inside the current job */
    int participants;                /* workers allowed in the current job */
    uint64_t start_gen[K3_POOL_MAX]; /* gen at each worker's creation (it may first run later) */
};
/* The pool whose task this thread is running (nested calls run inline). */
static _Thread_local const k3_pool *t_in_pool;

typedef struct {
    k3_pool *p;
    int id;
} worker_arg;

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
    p->want = n;
    *out = p;
    return K3_OK;
}

int k3_pool_threads(const k3_pool *p) {
    return p ? p->want : 1;
}

static void drain(k3_pool *p) {
    int64_t i;
    while ((i = atomic_fetch_add(&p->next, 1)) < p->n_tasks) p->fn(p->ctx, i);
}

static void *worker(void *arg) {
    k3_pool *p = ((worker_arg *)arg)->p;
    int id = ((worker_arg *)arg)->id; /* 0-based worker index */
    k3_free(arg);
    t_in_pool = p;
    pthread_mutex_lock(&p->mu);
    uint64_t seen = p->start_gen[id]; /* not p->gen: a job may have been posted before we ran */
    for (;;) {
        while (p->gen == seen && !p->quit) pthread_cond_wait(&p->cv_work, &p->mu);
        if (p->quit) break;
        seen = p->gen;
        if (id >= p->participants) continue;
        pthread_mutex_unlock(&p->mu);
        drain(p);
        pthread_mutex_lock(&p->mu);
        if (--p->busy == 0) pthread_cond_signal(&p->cv_done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

void k3_pool_run(k3_pool *p, int64_t n_tasks, k3_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!p || n_tasks == 1 || p->want <= 1 || t_in_pool == p ||
        pthread_mutex_trylock(&p->run_mu) != 0) {
        for (int64_t i = 0; i < n_tasks; i++) fn(ctx, i);
        return;
    }
    pthread_mutex_lock(&p->mu);
    while (p->n_started < p->want - 1) {
        worker_arg *a;
        if (k3_alloc((void **)&a, sizeof *a, "pool worker") != K3_OK) break;
        *a = (worker_arg){p, p->n_started};
        p->start_gen[p->n_started] = p->gen;
        if (pthread_create(&p->th[p->n_started], NULL, worker, a) != 0) {
            k3_free(a);
            break;
        }
        p->n_started++;
    }
    int workers = K3_MIN(p->want - 1, p->n_started);
    workers = (int)K3_MIN((int64_t)workers, n_tasks - 1);
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next, 0);
    p->participants = workers;
    p->busy = workers;
    p->gen++;
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);

    const k3_pool *outer = t_in_pool;
    t_in_pool = p;
    drain(p);
    t_in_pool = outer;

    pthread_mutex_lock(&p->mu);
    while (p->busy > 0) pthread_cond_wait(&p->cv_done, &p->mu);
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_unlock(&p->run_mu);
}

void k3_pool_destroy(k3_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->quit = true;
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_started; i++) pthread_join(p->th[i], NULL);
    pthread_cond_destroy(&p->cv_work);
    pthread_cond_destroy(&p->cv_done);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->run_mu);
    k3_free(p);
}
