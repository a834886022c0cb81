/* ckpt_scan.c — the values check of a checkpoint (k3_ckpt_scan; `k3 inspect --verify`).
 *
 * The header checks (safetensors.c) cannot see values: a NaN weight or an E8M0 scale of 0xFF
 * (NaN in OCP MX) loads fine and only shows at run time, far from its cause, and only when that
 * expert is routed. This streams every selected byte once and names each bad value's file,
 * tensor and row.
 *
 * Work: the selected tensors in file order (shard, offset), cut into items of whole rows that
 * fit one buffer (a row larger than the buffer is one item read in pieces); n_threads workers
 * take items from an atomic counter, each with its own buffer, so memory is bounded by
 * n_threads x buf_bytes whatever the checkpoint size. A worker keeps what it finds per item and
 * merges it under the lock (totals + the first rows_listed rows of the tensor); the reports are
 * made at the end, in file order, so the output does not depend on the thread timing.
 * Not here: what the values should be (any finite weight is accepted), MXFP4 nibbles (every
 * code is a value). */
#include "k3_model.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "model_internal.h"

typedef enum { V_NONE = 0, V_F32, V_BF16, V_F16, V_E8M0 } vkind;
typedef enum { W_NAN = 0, W_PINF, W_NINF, W_FF } what_bad;
static const char *const what_name[] = {"NaN", "+Inf", "-Inf", "0xFF"};

typedef struct item {
    int64_t t;             /* tensor index in the checkpoint */
    uint64_t row0, n_rows; /* rows [row0, row0 + n_rows) */
} item;

typedef struct bad_row {
    uint64_t row, count, col; /* col: of the first bad value of the row */
    what_bad what;            /* of the first bad value */
} bad_row;

/* What was found in one tensor (or one item): totals + the first `cap` bad rows, by row. */
typedef struct found {
    uint64_t n_values, n_rows;
    uint64_t last_row; /* the row found last (an item's rows come in order) */
    bool has_last;
    int n_listed;
    bad_row rows[]; /* [rows_listed] */
} found;

typedef struct scan {
    k3_ckpt *ck;
    const k3_scan_opts *o;
    int rows_listed;
    size_t piece_bytes; /* buffer size, a multiple of 4 (every element size divides it) */
    item *items;
    int64_t n_items;
    _Atomic int64_t next;
    atomic_bool stop;
    pthread_mutex_t mu; /* guards everything below */
    uint64_t done, total;
    found **found; /* [n tensors], NULL until a problem shows */
    k3_status err;
    char err_msg[1024];
} scan;

static vkind kind_of(const k3_ckpt_tensor *t) {
    switch (t->dtype) {
    case K3_DT_F32:
        return V_F32;
    case K3_DT_BF16:
        return V_BF16;
    case K3_DT_F16:
        return V_F16;
    case K3_DT_U8: {
        size_t n = strlen(t->name), m = strlen(".weight_scale");
        return n >= m && strcmp(t->name + n - m, ".weight_scale") == 0 ? V_E8M0 : V_NONE;
    }
    default:
        return V_NONE;
    }
}

/* Elements per row (the last dimension; a 0-D or 1-D tensor is one row). */
static uint64_t row_elems(const k3_ckpt_tensor *t) {
    if (t->ndim <= 1) return t->ndim == 1 ? (uint64_t)t->shape[0] : 1;
    return (uint64_t)t->shape[t->ndim - 1];
}

/* How many of x[0..n) are bad. Branch-free loops the compiler vectorises. */
static uint64_t count_bad(vkind k, const uint8_t *p, uint64_t n) {
    uint64_t c = 0;
    if (k == V_F32) {
        const uint32_t *x = (const uint32_t *)(const void *)p;
        for (uint64_t j = 0; j < n; j++) c += (x[j] & 0x7f800000u) == 0x7f800000u;
    } else if (k == V_BF16) {
        const uint16_t *x = (const uint16_t *)(const void *)p;
        for (uint64_t j = 0; j < n; j++) c += (x[j] & 0x7f80u) == 0x7f80u;
    } else if (k == V_F16) {
        const uint16_t *x = (const uint16_t *)(const void *)p;
        for (uint64_t j = 0; j < n; j++) c += (x[j] & 0x7c00u) == 0x7c00u;
    } else if (k == V_E8M0) {
        for (uint64_t j = 0; j < n; j++) c += p[j] == 0xff;
    }
    return c;
}

/* Index of the first bad element of x[0..n) (there is one) and what it is. */
static uint64_t first_bad(vkind k, const uint8_t *p, uint64_t n, what_bad *w) {
    for (uint64_t j = 0; j < n; j++) {
        uint32_t v, exp, man, sign;
        if (k == V_E8M0) {
            if (p[j] != 0xff) continue;
            *w = W_FF;
            return j;
        }
        if (k == V_F32) {
            memcpy(&v, p + 4 * j, 4);
            exp = 0x7f800000u, man = 0x007fffffu, sign = 0x80000000u;
        } else {
            uint16_t h;
            memcpy(&h, p + 2 * j, 2);
            v = h;
            exp = k == V_BF16 ? 0x7f80u : 0x7c00u;
            man = k == V_BF16 ? 0x007fu : 0x03ffu;
            sign = 0x8000u;
        }
        if ((v & exp) != exp) continue;
        *w = (v & man) ? W_NAN : (v & sign) ? W_NINF : W_PINF;
        return j;
    }
    *w = W_NAN;
    return 0;
}

/* Add `count` bad values of `row` (first at `col`) to f; rows arrive in increasing order within
 * one item, and a row read in pieces arrives more than once. */
static void found_add(found *f, int cap, uint64_t row, uint64_t count, uint64_t col, what_bad w) {
    f->n_values += count;
    if (f->has_last && f->last_row == row) { /* the next piece of the same row */
        if (f->n_listed > 0 && f->rows[f->n_listed - 1].row == row)
            f->rows[f->n_listed - 1].count += count;
        return;
    }
    f->has_last = true;
    f->last_row = row;
    f->n_rows++;
    if (f->n_listed < cap) f->rows[f->n_listed++] = (bad_row){row, count, col, w};
}

/* The bad values of elements [e0, e0 + n) of a tensor, in p. */
static void check_piece(vkind k, const uint8_t *p, uint64_t n, uint64_t e0, uint64_t rlen,
                        size_t esize, found *f, int cap) {
    if (k == V_NONE || count_bad(k, p, n) == 0) return;
    for (uint64_t i = 0; i < n;) {
        uint64_t e = e0 + i, row = e / rlen, col = e % rlen, seg = K3_MIN(n - i, rlen - col);
        uint64_t c = count_bad(k, p + i * esize, seg);
        if (c) {
            what_bad w;
            uint64_t j = first_bad(k, p + i * esize, seg, &w);
            found_add(f, cap, row, c, col + j, w);
        }
        i += seg;
    }
}

/* Merge an item's findings into the tensor's (under S->mu): totals add up, the listed rows are
 * the `cap` lowest of both lists (items hold disjoint rows). */
static k3_status merge(scan *S, int64_t t, const found *f) {
    int cap = S->rows_listed;
    found *g = S->found[t];
    if (!g) {
        g = calloc(1, sizeof *g + (size_t)cap * sizeof(bad_row));
        if (!g) return K3_ERR(K3_ERR_NOMEM, "verify: findings of one tensor");
        S->found[t] = g;
    }
    bad_row m[2 * 64];
    int a = 0, b = 0, n = 0;
    while (n < cap && (a < g->n_listed || b < f->n_listed)) {
        bool take_g = b >= f->n_listed || (a < g->n_listed && g->rows[a].row < f->rows[b].row);
        m[n++] = take_g ? g->rows[a++] : f->rows[b++];
    }
    memcpy(g->rows, m, (size_t)n * sizeof *m);
    g->n_listed = n;
    g->n_values += f->n_values;
    g->n_rows += f->n_rows;
    return K3_OK;
}

static void fail(scan *S, k3_status st) {
    pthread_mutex_lock(&S->mu);
    if (S->err == K3_OK) {
        S->err = st;
        k3_error_capture(S->err_msg, sizeof S->err_msg);
    }
    pthread_mutex_unlock(&S->mu);
    atomic_store(&S->stop, true);
}

static void *worker(void *arg) {
    scan *S = arg;
    int cap = S->rows_listed;
    uint8_t *buf = NULL;
    found *f = calloc(1, sizeof *f + (size_t)cap * sizeof(bad_row));
    k3_status st = f ? k3_alloc((void **)&buf, S->piece_bytes, "verify buffer")
                     : K3_ERR(K3_ERR_NOMEM, "verify: findings");
    if (st != K3_OK) fail(S, st);
    while (st == K3_OK && !atomic_load(&S->stop)) {
        int64_t i = atomic_fetch_add(&S->next, 1);
        if (i >= S->n_items) break;
        const item *it = &S->items[i];
        const k3_ckpt_tensor *t = k3_ckpt_tensor_at(S->ck, it->t);
        vkind k = kind_of(t);
        size_t es = k3_dtype_size(t->dtype);
        uint64_t rlen = row_elems(t), rbytes = rlen * es;
        uint64_t off = it->row0 * rbytes, end = (it->row0 + it->n_rows) * rbytes;
        memset(f, 0, sizeof *f);
        while (st == K3_OK && off < end) {
            uint64_t n = K3_MIN(end - off, (uint64_t)S->piece_bytes);
            st = k3_ckpt_read_range(S->ck, t, off, n, buf);
            if (st != K3_OK) break;
            check_piece(k, buf, n / es, off / es, rlen, es, f, cap);
            off += n;
            pthread_mutex_lock(&S->mu);
            S->done += n;
            if (S->o->progress) st = S->o->progress(S->o->ctx, S->done, S->total);
            pthread_mutex_unlock(&S->mu);
        }
        if (st == K3_OK && f->n_values) {
            pthread_mutex_lock(&S->mu);
            st = merge(S, it->t, f);
            pthread_mutex_unlock(&S->mu);
        }
        if (st != K3_OK) fail(S, st);
    }
    k3_free(buf);
    free(f);
    return NULL;
}

typedef struct ord {
    int shard;
    uint64_t offset;
    int64_t t;
} ord;
static int ord_cmp(const void *a, const void *b) {
    const ord *x = a, *y = b;
    if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
    return x->offset < y->offset ? -1 : (x->offset > y->offset);
}

/* The lines for one tensor's findings. */
static int64_t report_tensor(const scan *S, const k3_ckpt_tensor *t, const found *g) {
    const k3_scan_opts *o = S->o;
    const char *path = k3_ckpt_shard_path(S->ck, t->shard);
    bool e8 = kind_of(t) == V_E8M0, one_row = t->ndim <= 1;
    char msg[1024];
    int64_t n = 0;
    for (int i = 0; i < g->n_listed; i++) {
        const bad_row *r = &g->rows[i];
        const char *s = r->count == 1 ? "" : "s";
        char where[64] = "";
        if (!one_row) snprintf(where, sizeof where, "row %llu: ", (unsigned long long)r->row);
        if (e8)
            snprintf(msg, sizeof msg,
                     "%s: tensor %s: %s%llu E8M0 scale%s of 0xFF (NaN in OCP MX; first at block "
                     "%llu)",
                     path, t->name, where, (unsigned long long)r->count, s,
                     (unsigned long long)r->col);
        else
            snprintf(msg, sizeof msg,
                     "%s: tensor %s: %s%llu non-finite value%s (first: %s at %s %llu)", path,
                     t->name, where, (unsigned long long)r->count, s, what_name[r->what],
                     one_row ? "element" : "column", (unsigned long long)r->col);
        if (o->report) o->report(o->ctx, msg);
        n++;
    }
    if (g->n_rows > (uint64_t)g->n_listed) {
        snprintf(msg, sizeof msg,
                 "%s: tensor %s: %llu %s in %llu rows in all (the first %d listed)", path, t->name,
                 (unsigned long long)g->n_values, e8 ? "0xFF scales" : "non-finite values",
                 (unsigned long long)g->n_rows, g->n_listed);
        if (o->report) o->report(o->ctx, msg);
        n++;
    }
    return n;
}

k3_status k3_ckpt_scan(k3_ckpt *ck, const k3_scan_opts *opts, k3_scan_result *out) {
    static const k3_scan_opts none = {0};
    const k3_scan_opts *o = opts ? opts : &none;
    memset(out, 0, sizeof *out);
    double t0 = k3_now_s();
    scan S = {.ck = ck, .o = o, .err = K3_OK};
    S.rows_listed = o->rows_listed > 0 ? K3_MIN(o->rows_listed, 64) : 4;
    size_t buf = o->buf_bytes ? o->buf_bytes : (size_t)16 << 20;
    S.piece_bytes = K3_MAX(buf & ~(size_t)7, (size_t)8);
    int n_threads = o->n_threads > 0 ? K3_MIN(o->n_threads, 64) : 4;
    atomic_init(&S.next, 0);
    atomic_init(&S.stop, false);
    int64_t nt = k3_ckpt_n_tensors(ck);
    ord *order = NULL;
    k3_status st = k3_alloc((void **)&order, (size_t)(nt + 1) * sizeof *order, "verify order");
    if (st == K3_OK)
        st = k3_calloc((void **)&S.found, (size_t)(nt + 1) * sizeof *S.found, "verify findings");
    /* the tensors in file order, then the items (whole rows, at most a buffer each) */
    int64_t n_sel = 0, n_items = 0;
    for (int64_t i = 0; st == K3_OK && i < nt; i++) {
        const k3_ckpt_tensor *t = k3_ckpt_tensor_at(ck, i);
        if (o->select && !o->select(o->ctx, t)) continue;
        order[n_sel++] = (ord){t->shard, t->offset, i};
        uint64_t rb = row_elems(t) * k3_dtype_size(t->dtype);
        if (t->n_bytes == 0 || rb == 0) continue;
        uint64_t rows = t->n_bytes / rb, per = K3_MAX(S.piece_bytes / rb, (uint64_t)1);
        n_items += (int64_t)((rows + per - 1) / per);
        S.total += t->n_bytes;
    }
    if (st == K3_OK) qsort(order, (size_t)n_sel, sizeof *order, ord_cmp);
    if (st == K3_OK)
        st = k3_alloc((void **)&S.items, (size_t)(n_items + 1) * sizeof *S.items, "verify items");
    for (int64_t k = 0; st == K3_OK && k < n_sel; k++) {
        const k3_ckpt_tensor *t = k3_ckpt_tensor_at(ck, order[k].t);
        uint64_t rb = row_elems(t) * k3_dtype_size(t->dtype);
        if (t->n_bytes == 0 || rb == 0) continue;
        uint64_t rows = t->n_bytes / rb, per = K3_MAX(S.piece_bytes / rb, (uint64_t)1);
        for (uint64_t r = 0; r < rows; r += per)
            S.items[S.n_items++] = (item){order[k].t, r, K3_MIN(per, rows - r)};
    }
    if (st == K3_OK) {
        pthread_mutex_init(&S.mu, NULL);
        pthread_t th[64];
        int started = 0;
        n_threads = (int)K3_MIN((int64_t)n_threads, K3_MAX(S.n_items, (int64_t)1));
        for (int i = 1; i < n_threads; i++)
            if (pthread_create(&th[started], NULL, worker, &S) == 0) started++;
        worker(&S);
        for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
        pthread_mutex_destroy(&S.mu);
        if (S.err != K3_OK) st = K3_ERR(S.err, "%s", S.err_msg);
    }
    if (st == K3_OK) {
        for (int64_t k = 0; k < n_sel; k++) {
            const found *g = S.found[order[k].t];
            if (!g) continue;
            out->n_bad_tensors++;
            out->n_bad_values += (int64_t)g->n_values;
            out->n_reports += report_tensor(&S, k3_ckpt_tensor_at(ck, order[k].t), g);
        }
    }
    out->n_bytes = S.done;
    out->n_tensors = n_sel;
    out->seconds = k3_now_s() - t0;
    if (S.found)
        for (int64_t i = 0; i < nt; i++) free(S.found[i]);
    k3_free(S.found);
    k3_free(S.items);
    k3_free(order);
    return st;
}
