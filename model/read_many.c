/* read_many.c — a rank's checkpoint reads with many in flight (model_internal.h).
 *
 * A parallel file system (Lustre, GPFS, an NVMe RAID) reaches its bandwidth only with many large
 * reads in flight, so the requests are cut into pieces of K3_LOAD_PIECE_BYTES, in file order, and
 * n_readers threads take the next piece each (an atomic counter). A piece of a host request is
 * read straight into its destination. A piece of a device request is read into one of
 * 2 x n_readers staging buffers and handed to the calling thread, which uploads it (opts.upload)
 * and frees the buffer, so reads and copies overlap and the host memory of a device load is the
 * staging, not the weights. With opts.direct each shard is opened with O_DIRECT as well: a piece
 * is read as the aligned block range around it into an aligned bounce buffer (the piece's bytes
 * are then copied out); a file system that refuses O_DIRECT (tmpfs, some FUSE) falls back to
 * buffered reads, said once.
 * Invariants: callbacks run on the calling thread only; the first error stops the other readers
 * and is returned with its message (file, tensor, bytes); the bytes-read counter grows by exactly
 * the requested bytes, whatever the alignment read. */
#include "model_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define DIRECT_ALIGN   4096 /* the block size O_DIRECT offsets, lengths and buffers keep */
#define PROGRESS_EVERY 0.02 /* seconds between progress calls while the readers work */

typedef struct piece {
    int64_t req;
    uint64_t off, n; /* bytes [off, off + n) of the request's tensor */
} piece;

typedef struct rm {
    k3_ckpt *ck;
    const k3_read_req *reqs;
    const k3_read_opts *o;
    piece *pc;
    int64_t n_pc;
    uint64_t total;
    _Atomic int64_t next;  /* the next piece to take */
    _Atomic uint64_t done; /* bytes in their destination (host) or uploaded (device) */
    _Atomic bool stop;
    /* O_DIRECT */
    _Atomic bool direct; /* still in effect (a refused read turns it off) */
    int *dfd;            /* [n_shards] O_DIRECT descriptors, -1 = none */
    /* everything below under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint8_t **stage; /* [n_stage] device staging buffers */
    int n_stage;
    int *free_slot, n_free;   /* staging buffers not in use */
    int64_t *ready_pc;        /* [n_stage] pieces read, waiting for the upload */
    int *ready_slot, n_ready; /* their buffers */
    int running;              /* readers not finished */
    k3_status err;            /* the first error */
    char err_msg[1024];
} rm;

static void fail(rm *R, k3_status st) {
    pthread_mutex_lock(&R->mu);
    if (R->err == K3_OK) {
        R->err = st;
        k3_error_capture(R->err_msg, sizeof R->err_msg);
    }
    atomic_store(&R->stop, true);
    pthread_cond_broadcast(&R->cv);
    pthread_mutex_unlock(&R->mu);
}

/* One piece into `to` (host memory). bounce: this reader's aligned buffer (direct) or NULL. */
static k3_status read_piece(rm *R, const piece *p, uint8_t *to, uint8_t *bounce) {
    const k3_ckpt_tensor *t = R->reqs[p->req].t;
    const int fd = R->dfd ? R->dfd[t->shard] : -1;
    if (bounce && fd >= 0 && atomic_load(&R->direct)) {
        const uint64_t off = t->offset + p->off, a0 = off & ~(uint64_t)(DIRECT_ALIGN - 1);
        const uint64_t a1 = (off + p->n + DIRECT_ALIGN - 1) & ~(uint64_t)(DIRECT_ALIGN - 1);
        uint64_t got = 0;
        if (k3_pread_all(fd, bounce, a1 - a0, a0, &got) == K3_OK) {
            if (got < off - a0 + p->n)
                return K3_ERR(K3_ERR_IO,
                              "%s: tensor %s: read %llu of %llu bytes at byte %llu of its data "
                              "(file truncated?)",
                              k3_ckpt_shard_path(R->ck, t->shard), t->name,
                              (unsigned long long)(got > off - a0 ? got - (off - a0) : 0),
                              (unsigned long long)p->n, (unsigned long long)p->off);
            memcpy(to, bounce + (off - a0), p->n);
            k3_ckpt_count_read(R->ck, p->n);
            return K3_OK;
        }
        if (errno != EINVAL)
            return K3_ERR(K3_ERR_IO, "%s: tensor %s: read failed: %s",
                          k3_ckpt_shard_path(R->ck, t->shard), t->name, strerror(errno));
        if (atomic_exchange(&R->direct, false)) /* refused after the open: buffered from now on */
            K3_LOGW("load: %s refuses O_DIRECT reads (EINVAL); reading buffered",
                    k3_ckpt_shard_path(R->ck, t->shard));
    }
    return k3_ckpt_read_range(R->ck, t, p->off, p->n, to);
}

/* A device piece: wait for a free staging buffer, read into it, queue it for the upload. */
static k3_status read_staged(rm *R, int64_t i, uint8_t *bounce) {
    pthread_mutex_lock(&R->mu);
    while (R->n_free == 0 && !atomic_load(&R->stop)) pthread_cond_wait(&R->cv, &R->mu);
    if (atomic_load(&R->stop)) {
        pthread_mutex_unlock(&R->mu);
        return K3_OK;
    }
    const int s = R->free_slot[--R->n_free];
    pthread_mutex_unlock(&R->mu);
    k3_status st = read_piece(R, &R->pc[i], R->stage[s], bounce);
    pthread_mutex_lock(&R->mu);
    if (st == K3_OK) {
        R->ready_pc[R->n_ready] = i;
        R->ready_slot[R->n_ready++] = s;
    } else {
        R->free_slot[R->n_free++] = s;
    }
    pthread_cond_broadcast(&R->cv);
    pthread_mutex_unlock(&R->mu);
    return st;
}

static void *reader(void *arg) {
    rm *R = arg;
    uint8_t *bounce = NULL;
    k3_status st = K3_OK;
    if (R->dfd && posix_memalign((void **)&bounce, DIRECT_ALIGN,
                                 K3_LOAD_PIECE_BYTES + 2 * DIRECT_ALIGN) != 0) {
        bounce = NULL; /* no bounce buffer: this reader reads buffered */
    }
    while (st == K3_OK && !atomic_load(&R->stop)) {
        const int64_t i = atomic_fetch_add(&R->next, 1);
        if (i >= R->n_pc) break;
        const piece *p = &R->pc[i];
        const k3_read_req *q = &R->reqs[p->req];
        if (q->device) {
            st = read_staged(R, i, bounce);
        } else {
            st = read_piece(R, p, (uint8_t *)q->dst + p->off, bounce);
            if (st == K3_OK) atomic_fetch_add(&R->done, p->n);
        }
        if (st != K3_OK) fail(R, st);
    }
    free(bounce);
    pthread_mutex_lock(&R->mu);
    R->running--;
    pthread_cond_broadcast(&R->cv);
    pthread_mutex_unlock(&R->mu);
    return NULL;
}

/* The calling thread while the readers work: uploads, progress, until every piece is in. */
static k3_status drive(rm *R) {
    const k3_read_opts *o = R->o;
    uint64_t reported = 0;
    struct timespec last;
    clock_gettime(CLOCK_MONOTONIC, &last);
    pthread_mutex_lock(&R->mu);
    for (;;) {
        while (R->n_ready > 0 && !atomic_load(&R->stop)) {
            const int64_t i = R->ready_pc[--R->n_ready];
            const int s = R->ready_slot[R->n_ready];
            pthread_mutex_unlock(&R->mu);
            const piece *p = &R->pc[i];
            k3_status st =
                o->upload(o->ctx, (uint8_t *)R->reqs[p->req].dst + p->off, R->stage[s], p->n);
            if (st == K3_OK) atomic_fetch_add(&R->done, p->n);
            pthread_mutex_lock(&R->mu);
            R->free_slot[R->n_free++] = s;
            pthread_cond_broadcast(&R->cv);
            if (st != K3_OK) {
                pthread_mutex_unlock(&R->mu);
                fail(R, st);
                pthread_mutex_lock(&R->mu);
            }
        }
        const bool finished = R->running == 0 && R->n_ready == 0;
        if (finished || atomic_load(&R->stop)) break;
        struct timespec now, until;
        clock_gettime(CLOCK_MONOTONIC, &now);
        const double since =
            (double)(now.tv_sec - last.tv_sec) + 1e-9 * (now.tv_nsec - last.tv_nsec);
        const uint64_t done = atomic_load(&R->done);
        if (o->progress && since >= PROGRESS_EVERY && done != reported) {
            pthread_mutex_unlock(&R->mu);
            k3_status st = o->progress(o->ctx, done, R->total);
            reported = done;
            last = now;
            pthread_mutex_lock(&R->mu);
            if (st != K3_OK) {
                pthread_mutex_unlock(&R->mu);
                fail(R, st);
                pthread_mutex_lock(&R->mu);
            }
            continue;
        }
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += (long)(PROGRESS_EVERY * 1e9);
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&R->cv, &R->mu, &until);
    }
    pthread_mutex_unlock(&R->mu);
    return K3_OK;
}

/* One reader, on the calling thread: piece by piece, in file order (one read in flight). */
static k3_status serial(rm *R) {
    const k3_read_opts *o = R->o;
    uint8_t *bounce = NULL;
    if (R->dfd &&
        posix_memalign((void **)&bounce, DIRECT_ALIGN, K3_LOAD_PIECE_BYTES + 2 * DIRECT_ALIGN) != 0)
        bounce = NULL;
    k3_status st = K3_OK;
    for (int64_t i = 0; i < R->n_pc && st == K3_OK; i++) {
        const piece *p = &R->pc[i];
        const k3_read_req *q = &R->reqs[p->req];
        uint8_t *to = q->device ? R->stage[0] : (uint8_t *)q->dst + p->off;
        st = read_piece(R, p, to, bounce);
        if (st == K3_OK && q->device) st = o->upload(o->ctx, (uint8_t *)q->dst + p->off, to, p->n);
        if (st == K3_OK) atomic_fetch_add(&R->done, p->n);
        if (st == K3_OK && o->progress) st = o->progress(o->ctx, atomic_load(&R->done), R->total);
    }
    free(bounce);
    return st;
}

/* O_DIRECT descriptors of the shards the requests touch; false when the file system refuses. */
static bool open_direct(rm *R) {
    const int ns = k3_ckpt_n_shards(R->ck);
    R->dfd = malloc((size_t)ns * sizeof *R->dfd);
    if (!R->dfd) return false;
    for (int s = 0; s < ns; s++) R->dfd[s] = -1;
    for (int64_t i = 0; i < R->n_pc; i++) {
        const int s = R->reqs[R->pc[i].req].t->shard;
        if (R->dfd[s] >= 0) continue;
        if (k3_open_regular(k3_ckpt_shard_path(R->ck, s), O_DIRECT, K3_ERR_IO, &R->dfd[s], NULL) !=
            K3_OK) {
            K3_LOGW("load: %s; reading buffered, without O_DIRECT", k3_last_error());
            return false;
        }
    }
    return true;
}

static void close_direct(rm *R) {
    if (!R->dfd) return;
    for (int s = 0; s < k3_ckpt_n_shards(R->ck); s++)
        if (R->dfd[s] >= 0) close(R->dfd[s]);
    free(R->dfd);
    R->dfd = NULL;
}

static int piece_cmp(const void *a, const void *b, void *ctx) {
    const rm *R = ctx;
    const piece *x = a, *y = b;
    const k3_ckpt_tensor *s = R->reqs[x->req].t, *t = R->reqs[y->req].t;
    if (s->shard != t->shard) return s->shard < t->shard ? -1 : 1;
    const uint64_t u = s->offset + x->off, v = t->offset + y->off;
    return u < v ? -1 : u > v;
}

k3_status k3_ckpt_read_many(k3_ckpt *ck, const k3_read_req *reqs, int64_t n, const k3_read_opts *o,
                            bool *direct_used) {
    rm R = {.ck = ck, .reqs = reqs, .o = o, .err = K3_OK};
    if (direct_used) *direct_used = false;
    int64_t n_pc = 0;
    bool any_device = false;
    for (int64_t i = 0; i < n; i++) {
        n_pc += (int64_t)((reqs[i].t->n_bytes + K3_LOAD_PIECE_BYTES - 1) / K3_LOAD_PIECE_BYTES);
        R.total += reqs[i].t->n_bytes;
        any_device |= reqs[i].device;
    }
    if (any_device && !o->upload)
        return K3_ERR(K3_ERR_ARG, "k3_ckpt_read_many: device requests without an upload");
    K3_TRY(k3_alloc((void **)&R.pc, (size_t)K3_MAX(n_pc, 1) * sizeof *R.pc, "read pieces"));
    for (int64_t i = 0, k = 0; i < n; i++)
        for (uint64_t off = 0; off < reqs[i].t->n_bytes; off += K3_LOAD_PIECE_BYTES)
            R.pc[k++] = (piece){i, off, K3_MIN(reqs[i].t->n_bytes - off, K3_LOAD_PIECE_BYTES)};
    R.n_pc = n_pc;
    qsort_r(R.pc, (size_t)n_pc, sizeof *R.pc, piece_cmp, &R); /* file order */
    const int readers =
        (int)K3_MIN(o->n_readers > 0 ? o->n_readers : K3_LOAD_READERS_DEFAULT, K3_MAX(n_pc, 1));
    atomic_store(&R.direct, o->direct && open_direct(&R));
    if (!atomic_load(&R.direct)) close_direct(&R);
    k3_status st = K3_OK;
    R.n_stage = any_device ? (readers > 1 ? 2 * readers : 1) : 0;
    if (R.n_stage) {
        st = k3_calloc((void **)&R.stage, (size_t)R.n_stage * sizeof *R.stage, "staging");
        if (st == K3_OK)
            st = k3_calloc((void **)&R.free_slot, (size_t)R.n_stage * sizeof(int), "staging");
        if (st == K3_OK)
            st = k3_calloc((void **)&R.ready_slot, (size_t)R.n_stage * sizeof(int), "staging");
        if (st == K3_OK)
            st = k3_calloc((void **)&R.ready_pc, (size_t)R.n_stage * sizeof(int64_t), "staging");
        for (int s = 0; s < R.n_stage && st == K3_OK; s++) {
            st = k3_alloc((void **)&R.stage[s], K3_LOAD_PIECE_BYTES, "staging piece");
            R.free_slot[R.n_free++] = s;
        }
    }
    if (st == K3_OK && readers <= 1) {
        st = serial(&R);
    } else if (st == K3_OK) {
        pthread_mutex_init(&R.mu, NULL);
        pthread_cond_init(&R.cv, NULL);
        pthread_t th[256];
        int started = 0;
        R.running = 0;
        for (int i = 0; i < readers && i < (int)K3_ARRAY_LEN(th); i++) {
            pthread_mutex_lock(&R.mu);
            R.running++;
            pthread_mutex_unlock(&R.mu);
            if (pthread_create(&th[i], NULL, reader, &R) != 0) {
                pthread_mutex_lock(&R.mu);
                R.running--;
                pthread_mutex_unlock(&R.mu);
                break;
            }
            started++;
        }
        if (started == 0) {
            st = K3_ERR(K3_ERR_NOMEM, "load: no reader thread could be started");
        } else {
            drive(&R);
            for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
            if (R.err != K3_OK) st = K3_ERR(R.err, "%s", R.err_msg);
            if (st == K3_OK && atomic_load(&R.done) != R.total)
                st = K3_ERR(K3_ERR_INTERNAL, "load: %llu of %llu bytes read",
                            (unsigned long long)atomic_load(&R.done), (unsigned long long)R.total);
            if (st == K3_OK && o->progress) st = o->progress(o->ctx, atomic_load(&R.done), R.total);
        }
        pthread_cond_destroy(&R.cv);
        pthread_mutex_destroy(&R.mu);
    }
    if (direct_used) *direct_used = atomic_load(&R.direct);
    close_direct(&R);
    for (int s = 0; s < R.n_stage && R.stage; s++) k3_free(R.stage[s]);
    k3_free(R.stage), k3_free(R.free_slot), k3_free(R.ready_slot), k3_free(R.ready_pc);
    k3_free(R.pc);
    return st;
}
