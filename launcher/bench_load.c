/* bench_load.c — `k3 bench load`: how fast the checkpoint loads, and how fast the same shard
 * files can be read at all (the physical limit), measured in the same run.
 *
 *   1. raw: the lowest rank of each node reads every *.safetensors of --model DIR with several
 *      threads in large sequential pieces (like cat): cold after dropping the files' page cache
 *      (posix_fadvise DONTNEED per file, checked with mincore: a file system that keeps the pages,
 *      tmpfs for one, is "cold: not permitted"), then warm over the same bytes; the other ranks
 *      wait in a world collective. A pass stops claiming pieces after RAW_PASS_S (the engine's
 *      timeouts, a huge checkpoint), and reads at most half of the node's available memory.
 *   2. loads: the engine opened and closed once per (loader, cache): "serial" (load_readers = 1:
 *      one read in flight, the old loader), "parallel" (--load-readers, 0 = the default) and, for
 *      host backends, "mmap" (--load-mmap: the files mapped and populated, nothing copied), warm
 *      and, where the drop works, cold (the node leaders drop the shards' cache before the open).
 *      Each rank's bytes read, plan bytes and load seconds come from k3_engine_rank_info on rank 0;
 *      its peak RSS (VmHWM, reset before each open through /proc/self/clear_refs where allowed) is
 *      read after the open and gathered with k3_comm_world_where, which also places it on a node.
 *   3. per node: the bytes its ranks read, and the unique bytes (k3_plan_unique_weights: the
 *      distinct checkpoint tensors the node's ranks read). With node sharing the lanes of a stage
 *      read its non-expert tensors once, so the two agree; with --load-private every lane reads
 *      them and bytes read > unique bytes with E > 1 on one node.
 * Owns: the raw read and the sequence of loads. Does not own: the loader (model/weights.c), the
 * outputs (bench_report.c), the flag table (cmd_bench.c checks the modes first).
 * Invariants: every rank runs the same sequence of collectives (the decisions come from gathered
 * values); only rank 0 writes outputs; a fault after an open ends the job (k3_engine_abort). */
#include "bench.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine_args.h"
#include "k3_comm.h"
#include "k3_engine_test.h"
#include "k3_kernels.h"
#include "k3_model.h"
#include "k3_partition.h"

#define RAW_PIECE_BYTES   ((size_t)8 << 20) /* one raw read: large and sequential, like cat's */
#define RAW_PASS_S        3.0               /* a raw pass claims no piece after this long */
#define RAW_MIN_THREADS   4                 /* raw readers at least (else the parallel readers) */
#define COLD_MAX_RESIDENT 0.05 /* after the drop, a larger share still cached is not cold */

/* ---- the shard files ------------------------------------------------------------------------ */
typedef struct shard {
    char *path;
    uint64_t n_bytes;
} shard;
typedef struct shards {
    shard *f; /* (n) by name */
    int n;
    uint64_t n_bytes; /* all of them */
} shards;

static void shards_free(shards *s) {
    for (int i = 0; s->f && i < s->n; i++) k3_free(s->f[i].path);
    k3_free(s->f);
    memset(s, 0, sizeof *s);
}

static int is_shard(const struct dirent *e) {
    const size_t n = strlen(e->d_name), x = strlen(".safetensors");
    return n > x && strcmp(e->d_name + n - x, ".safetensors") == 0;
}

/* Every *.safetensors of dir, by name, with its size. */
static k3_status shards_list(const char *dir, shards *out) {
    memset(out, 0, sizeof *out);
    struct dirent **names = NULL;
    const int n = scandir(dir, &names, is_shard, alphasort);
    if (n < 0) return K3_ERR(K3_ERR_IO, "--model %s: %s", dir, strerror(errno));
    k3_status st = n == 0 ? K3_ERR(K3_ERR_ARG, "--model %s: no *.safetensors shard files", dir)
                          : k3_calloc((void **)&out->f, (size_t)n * sizeof *out->f, "shards");
    for (int i = 0; i < n; i++) {
        shard *f = &out->f[i];
        const size_t len = strlen(dir) + strlen(names[i]->d_name) + 2;
        struct stat sb;
        if (st == K3_OK && (st = k3_alloc((void **)&f->path, len, "shard path")) == K3_OK) {
            out->n++;
            snprintf(f->path, len, "%s/%s", dir, names[i]->d_name);
            if (stat(f->path, &sb) != 0)
                st = K3_ERR(K3_ERR_IO, "%s: %s", f->path, strerror(errno));
            else
                f->n_bytes = (uint64_t)sb.st_size, out->n_bytes += f->n_bytes;
        }
        free(names[i]);
    }
    free(names);
    if (st != K3_OK) shards_free(out);
    return st;
}

/* Drop the page cache of every shard (fdatasync, as DONTNEED leaves dirty pages, e.g. of a
 * checkpoint just written; then posix_fadvise DONTNEED per file), then the share of the first
 * check_bytes of the shards (in file order) still resident (mincore). < 0: the drop itself failed
 * (the reason in why). */
static double drop_cache(const shards *s, uint64_t check_bytes, char *why, size_t n_why) {
    why[0] = 0;
    uint64_t checked = 0, resident = 0;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), window = (size_t)1 << 30;
    unsigned char *vec = malloc(window / page + 1);
    if (!vec) {
        snprintf(why, n_why, "out of memory");
        return -1;
    }
    for (int i = 0; i < s->n; i++) {
        int fd = open(s->f[i].path, O_RDONLY);
        if (fd >= 0) (void)fdatasync(fd); /* a failure shows as pages still resident */
        int rc = fd < 0 ? errno : posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        if (rc != 0) {
            snprintf(why, n_why, "%s: %s", s->f[i].path, strerror(rc));
            if (fd >= 0) close(fd);
            free(vec);
            return -1;
        }
        for (uint64_t off = 0; off < s->f[i].n_bytes && checked < check_bytes; off += window) {
            const size_t len = (size_t)K3_MIN((uint64_t)window, s->f[i].n_bytes - off);
            void *m = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, (off_t)off);
            if (m == MAP_FAILED) break; /* unknown: not counted as checked */
            if (mincore(m, len, vec) == 0) {
                for (size_t p = 0; p < (len + page - 1) / page; p++)
                    resident += (vec[p] & 1) ? K3_MIN(page, len - p * page) : 0;
                checked += len;
            }
            munmap(m, len);
        }
        close(fd);
    }
    free(vec);
    if (check_bytes > 0 && checked == 0) {
        snprintf(why, n_why, "what stays cached cannot be seen (mmap + mincore failed)");
        return -1;
    }
    return checked ? (double)resident / (double)checked : 0;
}

/* ---- the raw read --------------------------------------------------------------------------- */
typedef struct piece {
    int file;
    uint64_t off;
    size_t n_bytes;
    uint64_t at; /* where it lands in a pass into fresh memory (the bytes before it) */
} piece;

typedef struct raw_pass {
    const piece *p;
    const int *fds;     /* [files] */
    uint8_t *dst;       /* NULL: each reader reuses one buffer (cat); else piece k lands at at */
    int64_t n_pieces;   /* claimable */
    double t_stop;      /* no piece is claimed past this k3_now_s(); 0 = none */
    atomic_llong next;  /* the next piece to claim */
    atomic_ullong done; /* bytes read */
    atomic_int err;     /* the first errno */
    int err_file;       /* its file (written by the one reader that set err) */
} raw_pass;

static void *raw_reader(void *arg) {
    raw_pass *P = arg;
    char *buf = P->dst ? NULL : malloc(RAW_PIECE_BYTES);
    if (!buf && !P->dst) atomic_store(&P->err, ENOMEM);
    while ((buf || P->dst) && atomic_load(&P->err) == 0) {
        if (P->t_stop > 0 && k3_now_s() > P->t_stop) break;
        const long long k = atomic_fetch_add(&P->next, 1);
        if (k >= P->n_pieces) break;
        const piece *x = &P->p[k];
        for (size_t got = 0; got < x->n_bytes;) {
            char *to = P->dst ? (char *)P->dst + x->at + got : buf;
            ssize_t r = pread(P->fds[x->file], to, x->n_bytes - got, (off_t)(x->off + got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                int expected = 0;
                if (atomic_compare_exchange_strong(&P->err, &expected, r < 0 ? errno : EIO))
                    P->err_file = x->file;
                break;
            }
            got += (size_t)r;
            atomic_fetch_add(&P->done, (unsigned long long)r);
        }
    }
    free(buf);
    return NULL;
}

/* One pass over pieces [0, n) with `threads` readers; *claimed: the pieces it read (all of them
 * but when t_cap_s > 0 stopped it early). */
static k3_status raw_pass_run(const shards *s, const piece *p, int64_t n, const int *fds,
                              uint8_t *dst, int threads, double t_cap_s, int64_t *claimed,
                              uint64_t *bytes, double *seconds) {
    raw_pass P = {.p = p, .fds = fds, .dst = dst, .n_pieces = n};
    atomic_init(&P.next, 0);
    atomic_init(&P.done, 0);
    atomic_init(&P.err, 0);
    pthread_t th[64];
    threads = K3_MAX(1, K3_MIN(threads, (int)K3_ARRAY_LEN(th)));
    const double t0 = k3_now_s();
    P.t_stop = t_cap_s > 0 ? t0 + t_cap_s : 0;
    int started = 0;
    for (; started < threads; started++)
        if (pthread_create(&th[started], NULL, raw_reader, &P) != 0) break;
    if (started == 0) raw_reader(&P);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    *seconds = k3_now_s() - t0;
    *claimed = K3_MIN((int64_t)atomic_load(&P.next), n);
    *bytes = (uint64_t)atomic_load(&P.done);
    const int err = atomic_load(&P.err);
    if (err) return K3_ERR(K3_ERR_IO, "raw read of %s: %s", s->f[P.err_file].path, strerror(err));
    return K3_OK;
}

#define MAX_REPS  16                                 /* --repetitions of the warm measurements */
#define N_LOADERS 3                                  /* serial, parallel, mmap */
#define MAX_LOADS (N_LOADERS * MAX_REPS + N_LOADERS) /* the warm runs, one cold each */

typedef struct raw_result {
    double warm_gbs, cold_gbs; /* warm: the median of the passes; cold < 0: not permitted */
    double warm_runs[MAX_REPS];
    int n_warm;
    /* the same warm pass into freshly allocated memory, as a load's destination is (the weights
       arena's allocation, k3_alloc_large): what keeping the bytes costs over reading them */
    double fresh_gbs, fresh_runs[MAX_REPS];
    int n_fresh;
    uint64_t bytes; /* read by each warm pass */
    int threads;
    double cold_resident; /* share still cached after the drop */
    char cold_why[256];
    /* the open files and pieces the passes share (raw_open .. raw_close) */
    int *fds;
    piece *p;
    int64_t n_pieces, claimed; /* planned pieces; those the cold pass read (the warm passes') */
} raw_result;

static void raw_close(const shards *s, raw_result *out) {
    for (int i = 0; out->fds && i < s->n; i++)
        if (out->fds[i] >= 0) close(out->fds[i]);
    k3_free(out->fds), k3_free(out->p);
    out->fds = NULL, out->p = NULL;
}

static double median_of(const double *v, int n) {
    double x[MAX_REPS];
    n = K3_MIN(n, MAX_REPS);
    memcpy(x, v, (size_t)n * sizeof *x);
    for (int i = 1; i < n; i++) /* insertion sort: n is small */
        for (int j = i; j > 0 && x[j - 1] > x[j]; j--) {
            const double t = x[j];
            x[j] = x[j - 1], x[j - 1] = t;
        }
    return n ? (n % 2 ? x[n / 2] : (x[n / 2 - 1] + x[n / 2]) / 2) : 0;
}

/* The slowest (dir < 0) or fastest (dir > 0) warm pass. */
static double raw_extreme(const raw_result *r, int dir) {
    double x = r->n_warm ? r->warm_runs[0] : 0;
    for (int i = 1; i < r->n_warm; i++)
        x = dir < 0 ? K3_MIN(x, r->warm_runs[i]) : K3_MAX(x, r->warm_runs[i]);
    return x;
}

/* One more warm pass over the cold pass's pieces; warm_gbs becomes the median so far. */
static k3_status raw_warm(const shards *s, raw_result *out) {
    int64_t claimed = 0;
    uint64_t b = 0;
    double t = 0;
    K3_TRY(
        raw_pass_run(s, out->p, out->claimed, out->fds, NULL, out->threads, 0, &claimed, &b, &t));
    out->bytes = b;
    if (out->n_warm < MAX_REPS) out->warm_runs[out->n_warm++] = t > 0 ? (double)b / t / 1e9 : 0;
    out->warm_gbs = median_of(out->warm_runs, out->n_warm);
    /* into fresh memory: allocated here, every page first touched by the reads, then freed */
    uint8_t *dst = NULL;
    K3_TRY(k3_alloc_large((void **)&dst, K3_MAX(b, 1), "raw pass into fresh memory"));
    k3_status st =
        raw_pass_run(s, out->p, out->claimed, out->fds, dst, out->threads, 0, &claimed, &b, &t);
    k3_free(dst);
    K3_TRY(st);
    if (out->n_fresh < MAX_REPS) out->fresh_runs[out->n_fresh++] = t > 0 ? (double)b / t / 1e9 : 0;
    out->fresh_gbs = median_of(out->fresh_runs, out->n_fresh);
    return K3_OK;
}

/* The raw read rates of the shards on this node (see the top of the file): the files opened and
 * kept for raw_warm, the cold pass, and the first warm pass. */
static k3_status raw_measure(const shards *s, int threads, raw_result *out) {
    memset(out, 0, sizeof *out);
    out->threads = threads;
    size_t avail = 0, total = 0;
    uint64_t cap = s->n_bytes;
    if (k3_host_memory(&avail, &total) == K3_OK && avail > 0) /* warm must fit the page cache */
        cap = K3_MIN(cap, (uint64_t)avail / 2);
    int64_t n = 0;
    for (int i = 0; i < s->n; i++)
        n += (int64_t)((s->f[i].n_bytes + RAW_PIECE_BYTES - 1) / RAW_PIECE_BYTES);
    K3_TRY(k3_calloc((void **)&out->p, (size_t)K3_MAX(n, 1) * sizeof *out->p, "raw pieces"));
    k3_status st = k3_calloc((void **)&out->fds, (size_t)s->n * sizeof *out->fds, "raw files");
    int64_t k = 0;
    uint64_t planned = 0;
    for (int i = 0; st == K3_OK && i < s->n; i++) out->fds[i] = -1;
    for (int i = 0; st == K3_OK && i < s->n; i++) {
        out->fds[i] = open(s->f[i].path, O_RDONLY);
        if (out->fds[i] < 0) st = K3_ERR(K3_ERR_IO, "%s: %s", s->f[i].path, strerror(errno));
        for (uint64_t off = 0; st == K3_OK && off < s->f[i].n_bytes && planned < cap;
             off += RAW_PIECE_BYTES) {
            out->p[k] = (piece){
                i, off, (size_t)K3_MIN((uint64_t)RAW_PIECE_BYTES, s->f[i].n_bytes - off), planned};
            planned += out->p[k++].n_bytes;
        }
    }
    out->n_pieces = k;
    uint64_t b1 = 0;
    double t1 = 0;
    if (st == K3_OK) {
        out->cold_resident = drop_cache(s, planned, out->cold_why, sizeof out->cold_why);
        st = raw_pass_run(s, out->p, k, out->fds, NULL, threads, RAW_PASS_S, &out->claimed, &b1,
                          &t1);
    }
    if (st == K3_OK) st = raw_warm(s, out);
    if (st == K3_OK) {
        if (out->cold_resident >= 0 && out->cold_resident <= COLD_MAX_RESIDENT) {
            out->cold_gbs = t1 > 0 ? (double)b1 / t1 / 1e9 : 0;
            snprintf(out->cold_why, sizeof out->cold_why,
                     "page cache dropped (fdatasync + posix_fadvise DONTNEED), %.0f%% left",
                     100 * out->cold_resident);
        } else {
            out->cold_gbs = -1;
            if (out->cold_resident >= 0)
                snprintf(out->cold_why, sizeof out->cold_why,
                         "%.0f%% still cached after posix_fadvise DONTNEED",
                         100 * out->cold_resident);
        }
    }
    if (st != K3_OK) raw_close(s, out);
    return st;
}

/* ---- peak RSS ------------------------------------------------------------------------------- */
/* Reset this process's peak RSS to its current RSS (Linux: "5" to /proc/self/clear_refs). */
static bool rss_reset(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return false;
    bool ok = fputs("5", f) >= 0;
    if (fclose(f) != 0) ok = false;
    return ok;
}

/* This process's peak RSS in bytes: VmHWM, else getrusage's ru_maxrss. */
static uint64_t rss_peak(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    unsigned long long kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %llu kB", &kb) == 1) break;
    if (f) fclose(f);
    if (kb == 0) {
        struct rusage ru;
        if (getrusage(RUSAGE_SELF, &ru) == 0) kb = (unsigned long long)ru.ru_maxrss;
    }
    return (uint64_t)kb * 1024;
}

/* ---- the job -------------------------------------------------------------------------------- */
typedef struct rank_rec {
    int stage, lane;
    uint64_t bytes_read, plan_bytes, peak_rss;
    double load_s;
} rank_rec;

typedef struct load_res {
    const char *loader, *cache;
    int readers;
    double seconds;  /* the slowest rank's load */
    rank_rec *ranks; /* [world] */
    /* the runs of this (loader, cache): the reported one is the median's (pick_medians) */
    int reps;            /* 0: a run another one reports */
    double min_s, max_s; /* of all the runs */
} load_res;

typedef struct job {
    int rank, world;
    double tmo;           /* --comm-timeout: every collective of the bench */
    k3_engine_opts eo;    /* as the flags gave them */
    k3_comm_where *where; /* [world] node and host of each rank */
    raw_result raw;       /* this rank's (a node leader's) */
    uint64_t *raw_all[4]; /* [world] each rank's raw warm, cold (double bits), bytes, fresh */
    load_res loads[MAX_LOADS];
    int n_loads;
    int reps;       /* --repetitions: warm rounds */
    bool rss_reset; /* rank 0 could reset its peak RSS before each open */
    k3_plan plan;   /* plan_of */
} job;

static double dbl_of(uint64_t u) {
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}
static uint64_t bits_of(double d) {
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

/* v of every rank into all[world] (a world collective through k3_comm_world_where, which is also
 * this bench's barrier). A failure ends the job: a rank that left would hang the others. */
static void gather(job *J, uint64_t v, uint64_t *all) {
    k3_comm_where *w = NULL;
    k3_status st = k3_calloc((void **)&w, (size_t)J->world * sizeof *w, "bench gather");
    if (st == K3_OK) st = k3_comm_world_where(v, w, J->tmo);
    if (st != K3_OK) {
        K3_LOGE("k3 bench load: %s", k3_last_error());
        k3_comm_world_abort(1);
    }
    for (int r = 0; all && r < J->world; r++) all[r] = w[r].v;
    k3_free(w);
}

/* Every rank: open the engine with `readers`, note the ranks' bytes and times (rank 0), close.
 * Returns the exit code of a failed open every rank agreed on (0 = loaded). */
static int one_load(job *J, const shards *s, bool cold, int readers, bool map, load_res *out) {
    if (cold && J->where[J->rank].node == J->rank) { /* the node leaders drop the cache */
        char why[256];
        const double left = drop_cache(s, J->raw.bytes, why, sizeof why);
        if (left < 0)
            K3_LOGW("bench load: the %s cold load is not cold: %s", out->loader, why);
        else if (left > COLD_MAX_RESIDENT)
            K3_LOGW("bench load: the %s cold load is not cold: %.0f%% still cached", out->loader,
                    100 * left);
    }
    if (cold) gather(J, 0, NULL); /* nobody opens before every node dropped its cache */
    const bool reset = rss_reset();
    if (J->rank == 0) J->rss_reset = reset;
    k3_engine_opts eo = J->eo;
    eo.load_readers = readers;
    eo.load_mmap = map;
    k3_engine *e = NULL;
    k3_status ost = k3_engine_open_test(&eo, k3_engine_test_from_env(), &e);
    if (ost != K3_OK && e) k3_engine_abort(e); /* a fatal fault: the job ends, the rank named */
    if (ost != K3_OK) return ost == K3_ERR_ARG ? 2 : 1;
    const uint64_t peak = rss_peak();
    if (!k3_engine_is_coordinator(e)) {
        if (k3_engine_serve(e) != K3_OK) k3_engine_abort(e); /* serves, then closes */
    } else {
        k3_engine_stats es;
        k3_engine_get_stats(e, &es);
        out->seconds = es.load_s;
        for (int r = 0; r < J->world; r++) {
            rank_rec *x = &out->ranks[r];
            k3_engine_rank_info(e, r, &x->stage, &x->lane, &x->bytes_read, &x->plan_bytes,
                                &x->load_s);
        }
        if (k3_engine_close(e, NULL) != K3_OK) k3_engine_abort(e);
    }
    uint64_t *all = NULL;
    if (k3_calloc((void **)&all, (size_t)J->world * sizeof *all, "bench rss") != K3_OK)
        k3_comm_world_abort(1);
    gather(J, peak, all);
    for (int r = 0; J->rank == 0 && r < J->world; r++) out->ranks[r].peak_rss = all[r];
    k3_free(all);
    if (J->rank == 0)
        K3_LOGI("bench load: %s, %s cache, %d readers: %.3f s (slowest rank)", out->loader,
                out->cache, readers, out->seconds);
    return 0;
}

/* ---- the report (rank 0) -------------------------------------------------------------------- */
typedef struct node_sum {
    int n_ranks;
    uint64_t bytes_read, unique, rss_sum;
    double load_s; /* the node's slowest rank */
} node_sum;

static double raw_of(const job *J, int node, bool cold) {
    return dbl_of(J->raw_all[cold ? 1 : 0][node]);
}
/* The warm pass into fresh memory of a node (0 for a cold load: not measured cold). */
static double fresh_of(const job *J, int node, bool cold) {
    return cold ? 0 : dbl_of(J->raw_all[3][node]);
}

/* 100 x gbs / raw, or null without a raw rate. */
static k3_status put_pct(bench_row *r, const char *key, const char *label, double gbs, double raw) {
    if (!(raw > 0)) return bench_put_null(r, key, label);
    return bench_put_num(r, key, label, 1, 100 * gbs / raw);
}

static k3_status put_ranks(const job *J, const load_res *L, bench_row *row) {
    bench_row *rows = NULL;
    K3_TRY(k3_calloc((void **)&rows, (size_t)J->world * sizeof *rows, "bench ranks"));
    k3_status st = K3_OK;
    for (int r = 0; st == K3_OK && r < J->world; r++) {
        const rank_rec *x = &L->ranks[r];
        bench_row *o = &rows[r];
        st = bench_put_num(o, "rank", "rank", -1, r);
        if (st == K3_OK) st = bench_put_num(o, "stage", "stage", -1, x->stage);
        if (st == K3_OK) st = bench_put_num(o, "lane", "lane", -1, x->lane);
        if (st == K3_OK) st = bench_put_num(o, "node", "node", -1, J->where[r].node);
        if (st == K3_OK) st = bench_put_str(o, "host", "host", J->where[r].host);
        if (st == K3_OK)
            st = bench_put_num(o, "bytes_read", "bytes read", -1, (double)x->bytes_read);
        if (st == K3_OK)
            st = bench_put_num(o, "plan_weight_bytes", "plan bytes", -1, (double)x->plan_bytes);
        if (st == K3_OK) st = bench_put_num(o, "load_s", "load (s)", 3, x->load_s);
        if (st == K3_OK)
            st = bench_put_num(o, "gbs", "GB/s", 2,
                               x->load_s > 0 ? (double)x->bytes_read / x->load_s / 1e9 : 0);
        if (st == K3_OK) st = bench_put_num(o, "peak_rss_bytes", NULL, -1, (double)x->peak_rss);
        if (st == K3_OK) st = bench_put_num(o, NULL, "peak RSS (MB)", 1, (double)x->peak_rss / 1e6);
    }
    if (st != K3_OK) {
        for (int r = 0; r < J->world; r++) bench_row_free(&rows[r]);
        k3_free(rows);
        return st;
    }
    return bench_put_rows(row, "ranks", "ranks", &rows, J->world, false);
}

static k3_status put_nodes(const job *J, const node_sum *ns, int n_nodes, bool cold,
                           bench_row *row) {
    bench_row *rows = NULL;
    K3_TRY(k3_calloc((void **)&rows, (size_t)n_nodes * sizeof *rows, "bench nodes"));
    k3_status st = K3_OK;
    int k = 0;
    for (int node = 0; st == K3_OK && node < J->world; node++) {
        if (J->where[node].node != node) continue;
        const node_sum *x = &ns[node];
        const double gbs = x->load_s > 0 ? (double)x->bytes_read / x->load_s / 1e9 : 0;
        bench_row *o = &rows[k++];
        st = bench_put_num(o, "node", "node", -1, node);
        if (st == K3_OK) st = bench_put_str(o, "host", "host", J->where[node].host);
        if (st == K3_OK) st = bench_put_num(o, "ranks", "ranks", -1, x->n_ranks);
        if (st == K3_OK)
            st = bench_put_num(o, "bytes_read", "bytes read", -1, (double)x->bytes_read);
        if (st == K3_OK)
            st = bench_put_num(o, "unique_bytes", "unique bytes", -1, (double)x->unique);
        if (st == K3_OK) st = bench_put_num(o, "load_s", "load (s)", 3, x->load_s);
        if (st == K3_OK) st = bench_put_num(o, "gbs", "GB/s", 2, gbs);
        if (st == K3_OK) st = bench_put_num(o, "raw_gbs", "raw GB/s", 2, raw_of(J, node, cold));
        if (st == K3_OK) st = put_pct(o, "pct_of_raw", "% of raw", gbs, raw_of(J, node, cold));
        if (st == K3_OK)
            st = cold ? bench_put_null(o, "fresh_gbs", "raw into fresh memory GB/s")
                      : bench_put_num(o, "fresh_gbs", "raw into fresh memory GB/s", 2,
                                      fresh_of(J, node, cold));
        if (st == K3_OK)
            st = put_pct(o, "pct_of_fresh", "% of fresh", gbs, fresh_of(J, node, cold));
        if (st == K3_OK) st = bench_put_num(o, "peak_rss_sum_bytes", NULL, -1, (double)x->rss_sum);
        if (st == K3_OK)
            st = bench_put_num(o, NULL, "peak RSS sum (MB)", 1, (double)x->rss_sum / 1e6);
    }
    if (st != K3_OK) {
        for (int r = 0; r < n_nodes; r++) bench_row_free(&rows[r]);
        k3_free(rows);
        return st;
    }
    return bench_put_rows(row, "nodes", "nodes", &rows, n_nodes, false);
}

/* The plan the engine will make, made here first (it is pure): a grid that does not fit the
 * world is a usage error before the raw read, and rank 0 takes the unique bytes from it. The
 * capacity flags size no weights, so the defaults do. */
static k3_status plan_of(const job *J, const k3_config *cfg, k3_plan *plan) {
    char *map = NULL;
    size_t nb = 0;
    if (J->eo.expert_map_path) K3_TRY(k3_read_file(J->eo.expert_map_path, &map, &nb));
    k3_plan_req req = {.world = J->world,
                       .pp = J->eo.pp,
                       .ep = J->eo.ep,
                       .coord = J->eo.coord,
                       .expert_map = map,
                       .expert_map_name = J->eo.expert_map_path,
                       .max_ctx = K3_ENGINE_DEFAULT_MAX_CTX,
                       .max_seqs_per_lane = K3_ENGINE_DEFAULT_MAX_SEQS,
                       .max_tokens = K3_ENGINE_DEFAULT_MAX_BATCH_TOKENS};
    k3_status st = k3_plan_make(cfg, &req, plan);
    k3_free(map);
    return st;
}

/* unique[node]: the unique bytes of each node's ranks (k3_plan_unique_weights on J's plan,
 * checked first against the engine's per-rank weight bytes). */
static k3_status unique_per_node(const job *J, const k3_config *cfg, const load_res *L,
                                 uint64_t *unique) {
    int *ranks = NULL;
    k3_status st = k3_alloc((void **)&ranks, (size_t)J->world * sizeof *ranks, "bench node ranks");
    for (int r = 0; st == K3_OK && r < J->world; r++)
        if (J->plan.mem[r].weights != L->ranks[r].plan_bytes)
            st = K3_ERR(K3_ERR_INTERNAL,
                        "bench load: the plan made here gives rank %d %llu weight bytes, the "
                        "engine's %llu",
                        r, (unsigned long long)J->plan.mem[r].weights,
                        (unsigned long long)L->ranks[r].plan_bytes);
    for (int node = 0; st == K3_OK && node < J->world; node++) {
        if (J->where[node].node != node) continue;
        int n = 0;
        for (int r = 0; r < J->world; r++)
            if (J->where[r].node == node) ranks[n++] = r;
        st = k3_plan_unique_weights(cfg, &J->plan, ranks, n, &unique[node]);
    }
    k3_free(ranks);
    return st;
}

static k3_status put_load(const job *J, const load_res *L, const uint64_t *unique,
                          bench_report *rep) {
    node_sum *ns = NULL;
    K3_TRY(k3_calloc((void **)&ns, (size_t)J->world * sizeof *ns, "bench node sums"));
    const bool cold = strcmp(L->cache, "cold") == 0;
    uint64_t bytes = 0, uniq = 0, rss_max = 0;
    double raw = 0, fresh = 0;
    int n_nodes = 0;
    for (int r = 0; r < J->world; r++) {
        const rank_rec *x = &L->ranks[r];
        node_sum *n = &ns[J->where[r].node];
        n->n_ranks++;
        n->bytes_read += x->bytes_read;
        n->rss_sum += x->peak_rss;
        n->load_s = K3_MAX(n->load_s, x->load_s);
        bytes += x->bytes_read;
        rss_max = K3_MAX(rss_max, x->peak_rss);
        if (J->where[r].node == r) {
            n_nodes++;
            ns[r].unique = unique[r];
            uniq += unique[r];
            raw += raw_of(J, r, cold);
            fresh += fresh_of(J, r, cold);
        }
    }
    const double gbs = L->seconds > 0 ? (double)bytes / L->seconds / 1e9 : 0;
    char name[64];
    snprintf(name, sizeof name, "%s %s", L->loader, L->cache);
    bench_row *row = NULL;
    k3_status st = bench_add_row(rep, &row);
    if (st == K3_OK) st = bench_put_str(row, NULL, "load", name);
    if (st == K3_OK) st = bench_put_str(row, "loader", NULL, L->loader);
    if (st == K3_OK) st = bench_put_str(row, "cache", NULL, L->cache);
    if (st == K3_OK) st = bench_put_num(row, "readers", "readers", -1, L->readers);
    if (st == K3_OK) st = bench_put_num(row, "repetitions", "runs", -1, L->reps);
    if (st == K3_OK) st = bench_put_num(row, "seconds", "seconds (median)", 3, L->seconds);
    if (st == K3_OK) st = bench_put_num(row, "seconds_min", "min", 3, L->min_s);
    if (st == K3_OK) st = bench_put_num(row, "seconds_max", "max", 3, L->max_s);
    if (st == K3_OK) st = bench_put_num(row, "bytes_read", "bytes read", -1, (double)bytes);
    if (st == K3_OK) st = bench_put_num(row, "unique_bytes", "unique bytes", -1, (double)uniq);
    if (st == K3_OK) st = bench_put_num(row, "gbs", "GB/s", 2, gbs);
    if (st == K3_OK) st = put_pct(row, "pct_of_raw", "% of raw", gbs, raw);
    if (st == K3_OK) st = put_pct(row, "pct_of_fresh", "% of fresh", gbs, fresh);
    if (st == K3_OK) st = bench_put_num(row, "peak_rss_max_bytes", NULL, -1, (double)rss_max);
    if (st == K3_OK) st = bench_put_num(row, NULL, "peak RSS max (MB)", 1, (double)rss_max / 1e6);
    if (st == K3_OK) st = put_ranks(J, L, row);
    if (st == K3_OK) st = put_nodes(J, ns, n_nodes, cold, row);
    k3_free(ns);
    return st;
}

static k3_status put_meta(const job *J, const char *model_dir, int readers, bench_row *m) {
    char name[256];
    int n_nodes = 0;
    for (int r = 0; r < J->world; r++) n_nodes += J->where[r].node == r;
    bench_model_name(model_dir, name, sizeof name);
    K3_TRY(bench_meta_host(m));
    K3_TRY(bench_put_str(m, "mode", NULL, "load"));
    K3_TRY(bench_put_str(m, "model", "model", name));
    K3_TRY(bench_put_str(m, "backend", "backend", J->eo.backend ? J->eo.backend : "cpu"));
    K3_TRY(bench_put_num(m, "pp", "stages (S)", -1, J->eo.pp));
    K3_TRY(bench_put_num(m, "ep", "lanes (E)", -1, J->eo.ep));
    K3_TRY(bench_put_num(m, "world", "ranks", -1, J->world));
    K3_TRY(bench_put_num(m, "nodes", "nodes", -1, n_nodes));
    K3_TRY(bench_put_str(m, "coordinator", "coordinator",
                         J->eo.coord == K3_COORD_DEDICATED ? "dedicated" : "shared"));
    K3_TRY(bench_put_num(m, "parallel_readers", "parallel loader's readers", -1, readers));
    K3_TRY(bench_put_str(m, "load_direct", "reads", J->eo.load_direct ? "O_DIRECT" : "buffered"));
    K3_TRY(bench_put_str(m, "peak_rss", "peak RSS",
                         J->rss_reset ? "VmHWM of each rank, reset before each open"
                                      : "VmHWM of each rank since it started (no reset)"));
    /* raw: rank 0's node (each node's own is in the loads' node rows) */
    const double warm = raw_of(J, 0, false), cold = raw_of(J, 0, true);
    bench_row *raw = NULL;
    K3_TRY(k3_calloc((void **)&raw, sizeof *raw, "bench raw"));
    k3_status st = bench_put_num(raw, "warm_gbs", NULL, 2, warm);
    if (st == K3_OK)
        st = cold >= 0 ? bench_put_num(raw, "cold_gbs", NULL, 2, cold)
                       : bench_put_null(raw, "cold_gbs", NULL);
    if (st == K3_OK) st = bench_put_num(raw, "bytes", NULL, -1, (double)J->raw_all[2][0]);
    if (st == K3_OK) st = bench_put_num(raw, "threads", NULL, -1, J->raw.threads);
    if (st == K3_OK) st = bench_put_num(raw, "warm_repetitions", NULL, -1, J->raw.n_warm);
    if (st == K3_OK) st = bench_put_num(raw, "fresh_gbs", NULL, 2, fresh_of(J, 0, false));
    if (st == K3_OK) st = bench_put_num(raw, "piece_bytes", NULL, -1, (double)RAW_PIECE_BYTES);
    if (st == K3_OK) st = bench_put_str(raw, "cold_note", NULL, J->raw.cold_why);
    if (st == K3_OK)
        st = bench_put_rows(m, "raw", NULL, &raw, 1, true);
    else {
        bench_row_free(raw);
        k3_free(raw);
    }
    K3_TRY(st);
    char line[384];
    snprintf(line, sizeof line,
             "%.2f GB/s (median of %d passes, %.2f-%.2f) over %.1f MB, %d threads, %zu MB reads",
             warm, J->raw.n_warm, raw_extreme(&J->raw, -1), raw_extreme(&J->raw, 1),
             (double)J->raw_all[2][0] / 1e6, J->raw.threads, RAW_PIECE_BYTES >> 20);
    K3_TRY(bench_put_str(m, NULL, "raw read, warm", line));
    snprintf(line, sizeof line,
             "%.2f GB/s (median of %d passes; the same reads into newly allocated memory, as a "
             "load's destination is)",
             fresh_of(J, 0, false), J->raw.n_fresh);
    K3_TRY(bench_put_str(m, NULL, "raw read into fresh memory, warm", line));
    if (cold >= 0)
        snprintf(line, sizeof line, "%.2f GB/s, %s", cold, J->raw.cold_why);
    else
        snprintf(line, sizeof line, "not permitted (%s)", J->raw.cold_why);
    return bench_put_str(m, NULL, "raw read, cold", line);
}

static k3_status report(const job *J, const k3_args *a, const k3_config *cfg, int readers) {
    uint64_t *unique = NULL;
    bench_report rep = {.mode = "load", .rows_key = "loads"};
    k3_status st = k3_calloc((void **)&unique, (size_t)J->world * sizeof *unique, "bench unique");
    if (st == K3_OK) st = unique_per_node(J, cfg, &J->loads[0], unique);
    if (st == K3_OK) st = put_meta(J, k3_args_str(a, "model"), readers, &rep.meta);
    static const char *const order[2 * N_LOADERS][2] = {{"serial", "warm"},   {"parallel", "warm"},
                                                        {"mmap", "warm"},     {"serial", "cold"},
                                                        {"parallel", "cold"}, {"mmap", "cold"}};
    for (int o = 0; o < 2 * N_LOADERS; o++) /* one row each, the run pick_medians chose */
        for (int k = 0; st == K3_OK && k < J->n_loads; k++)
            if (J->loads[k].reps > 0 && strcmp(J->loads[k].loader, order[o][0]) == 0 &&
                strcmp(J->loads[k].cache, order[o][1]) == 0)
                st = put_load(J, &J->loads[k], unique, &rep);
    if (st == K3_OK)
        st = bench_report_write(&rep, k3_args_str(a, "output-json"), k3_args_str(a, "output-csv"));
    bench_report_free(&rep);
    k3_free(unique);
    return st;
}

/* Between warm rounds: one more raw pass on each node leader (the others wait); the verdict is
 * every rank's. */
static int raw_again(job *J, const shards *s) {
    const bool leader = J->where[J->rank].node == J->rank;
    k3_status rs = leader ? raw_warm(s, &J->raw) : K3_OK;
    if (rs != K3_OK) fprintf(stderr, "k3 bench: rank %d: %s\n", J->rank, k3_last_error());
    int worst = 0;
    if (k3_comm_world_max(rs != K3_OK, &worst, J->tmo) != K3_OK) k3_comm_world_abort(1);
    return worst ? 1 : 0;
}

/* Of the runs of each (loader, cache), the one with the median time reports them all (the lower
 * middle one of an even count); the others get reps = 0. */
static void pick_medians(job *J) {
    for (int k = 0; k < J->n_loads; k++) {
        load_res *L = &J->loads[k];
        int same[MAX_LOADS], n = 0;
        for (int i = 0; i < J->n_loads; i++)
            if (strcmp(J->loads[i].loader, L->loader) == 0 &&
                strcmp(J->loads[i].cache, L->cache) == 0)
                same[n++] = i;
        if (same[0] != k) continue; /* the group was settled at its first run */
        for (int i = 1; i < n; i++) /* by time */
            for (int j = i; j > 0 && J->loads[same[j - 1]].seconds > J->loads[same[j]].seconds;
                 j--) {
                const int t = same[j];
                same[j] = same[j - 1], same[j - 1] = t;
            }
        load_res *M = &J->loads[same[(n - 1) / 2]];
        for (int i = 0; i < n; i++) J->loads[same[i]].reps = 0;
        M->reps = n;
        M->min_s = J->loads[same[0]].seconds, M->max_s = J->loads[same[n - 1]].seconds;
    }
}

/* ---- the command ---------------------------------------------------------------------------- */
static void job_free(job *J) {
    k3_plan_free(&J->plan);
    k3_free(J->where);
    for (int i = 0; i < 4; i++) k3_free(J->raw_all[i]);
    for (int k = 0; k < MAX_LOADS; k++) k3_free(J->loads[k].ranks);
}

/* Every rank: flags, config and shards checked the same everywhere (rank 0 says why). */
static int check(job *J, const k3_args *a, const char *usage, k3_config *cfg, shards *s) {
    if (usage) {
        if (J->rank == 0) fprintf(stderr, "k3 bench: %s\n", usage);
        return 2;
    }
    int rc = k3_engine_args(a, J->rank == 0, &J->eo);
    if (rc) return rc;
    const int64_t reps = k3_args_has(a, "repetitions") ? k3_args_int(a, "repetitions") : 3;
    J->reps = (int)K3_MAX(1, K3_MIN(reps, MAX_REPS));
    if (reps != J->reps) {
        if (J->rank == 0)
            fprintf(stderr, "k3 bench: --repetitions must be in [1, %d] for load\n", MAX_REPS);
        return 2;
    }
    const char *model = k3_args_str(a, "model");
    k3_status st = model ? K3_OK : K3_ERR(K3_ERR_ARG, "--model DIR is required");
    if (st == K3_OK) st = k3_config_load(model, cfg);
    if (st == K3_OK) st = shards_list(model, s);
    if (st == K3_OK) st = plan_of(J, cfg, &J->plan);
    if (st != K3_OK && J->rank == 0) fprintf(stderr, "k3 bench: %s\n", k3_last_error());
    return st == K3_OK ? 0 : st == K3_ERR_ARG ? 2 : 1;
}

int bench_load(const k3_args *a, const char *usage) {
    if (k3_comm_init() != K3_OK) {
        fprintf(stderr, "k3 bench: %s\n", k3_last_error());
        return 1;
    }
    job J = {.eo = {.name = "k3 bench", .progress = true}};
    k3_comm_world(&J.rank, &J.world);
    k3_log_set_rank(J.rank, -1, -1);
    k3_config cfg;
    shards s = {0};
    int rc = check(&J, a, usage, &cfg, &s);
    J.eo.model_dir = k3_args_str(a, "model");
    J.tmo = J.eo.comm_timeout_s > 0 ? J.eo.comm_timeout_s : 600;
    const int readers = J.eo.load_readers > 0 ? J.eo.load_readers : K3_LOAD_READERS_DEFAULT;
    k3_status st = K3_OK;
    for (int i = 0; rc == 0 && st == K3_OK && i < 4; i++)
        st = k3_calloc((void **)&J.raw_all[i], (size_t)J.world * sizeof(uint64_t), "bench raw");
    if (rc == 0 && st == K3_OK)
        st = k3_calloc((void **)&J.where, (size_t)J.world * sizeof *J.where, "bench where");
    for (int k = 0; rc == 0 && st == K3_OK && k < MAX_LOADS; k++)
        st = k3_calloc((void **)&J.loads[k].ranks, (size_t)J.world * sizeof(rank_rec),
                       "bench ranks");
    if (rc == 0 && st != K3_OK) fprintf(stderr, "k3 bench: %s\n", k3_last_error()), rc = 1;
    /* one verdict before the first collective of the bench itself */
    int worst = 0;
    if (k3_comm_world_max(rc, &worst, J.tmo) != K3_OK) k3_comm_world_abort(1);
    if (worst == 0 && k3_comm_world_where(0, J.where, J.tmo) != K3_OK) k3_comm_world_abort(1);
    if (worst == 0) { /* the raw read on each node's lowest rank; the others wait */
        const bool leader = J.where[J.rank].node == J.rank;
        k3_status rs = leader ? raw_measure(&s, K3_MAX(readers, RAW_MIN_THREADS), &J.raw) : K3_OK;
        if (rs != K3_OK) fprintf(stderr, "k3 bench: rank %d: %s\n", J.rank, k3_last_error());
        if (k3_comm_world_max(rs != K3_OK, &worst, J.tmo) != K3_OK) k3_comm_world_abort(1);
        rc = worst ? 1 : 0;
    } else
        rc = worst;
    /* cold loads only where every node could drop its cache (the same decision everywhere) */
    if (rc == 0) gather(&J, bits_of(J.raw.cold_gbs), J.raw_all[1]);
    bool cold_ok = true;
    for (int r = 0; rc == 0 && r < J.world; r++)
        if (J.where[r].node == r && dbl_of(J.raw_all[1][r]) < 0) cold_ok = false;
    /* warm: --repetitions rounds of (a raw pass on the node leaders, serial, parallel, mmap), so
       the raw rate and the loads see the same machine; then one cold load of each. mmap is for
       host backends only (a device backend would read the files anyway). */
    const char *be = J.eo.backend ? J.eo.backend : "cpu";
    const bool host = strcmp(be, "cuda") != 0 && strcmp(be, "guard") != 0;
    for (int k = 0; rc == 0 && k < N_LOADERS * (J.reps + 1); k++) {
        const bool cold = k >= N_LOADERS * J.reps;
        const int which = k % N_LOADERS; /* 0 serial, 1 parallel, 2 mmap */
        if ((cold && !cold_ok) || (which == 2 && !host)) continue;
        if (!cold && which == 0 && k > 0) rc = raw_again(&J, &s);
        load_res *L = &J.loads[J.n_loads];
        static const char *const names[N_LOADERS] = {"serial", "parallel", "mmap"};
        L->loader = names[which], L->cache = cold ? "cold" : "warm";
        L->readers = which == 0 ? 1 : readers; /* mmap: the files populated by that many */
        if (rc == 0) rc = one_load(&J, &s, cold, L->readers, which == 2, L);
        J.n_loads += rc == 0;
    }
    if (J.where && J.where[J.rank].node == J.rank) raw_close(&s, &J.raw);
    if (rc == 0) {
        gather(&J, bits_of(J.raw.warm_gbs), J.raw_all[0]);
        gather(&J, J.raw.bytes, J.raw_all[2]);
        gather(&J, bits_of(J.raw.fresh_gbs), J.raw_all[3]);
        if (J.rank == 0 && J.raw.cold_gbs >= 0)
            K3_LOGI("bench load: raw read %.2f GB/s warm (median of %d), %.2f GB/s cold",
                    J.raw.warm_gbs, J.raw.n_warm, J.raw.cold_gbs);
        else if (J.rank == 0)
            K3_LOGI("bench load: raw read %.2f GB/s warm (median of %d); cold: not permitted (%s)",
                    J.raw.warm_gbs, J.raw.n_warm, J.raw.cold_why);
        pick_medians(&J);
    }
    if (rc == 0 && J.rank == 0 && report(&J, a, &cfg, readers) != K3_OK) {
        fprintf(stderr, "k3 bench: %s\n", k3_last_error());
        rc = 1;
    }
    shards_free(&s);
    job_free(&J);
    k3_comm_finalize();
    return rc;
}
