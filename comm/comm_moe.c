/* comm_moe.c — the MoE exchange protocol of k3_comm, written once over the transport's two EP
 * collectives (alltoall of int32 words, alltoallv counted in 4-byte words; comm_internal.h).
 *
 * Dispatch: the sender deduplicates its items into (row, lane) pairs (each source row goes once
 * to each lane that owns >= 1 of its items), packs one block per destination lane — the pair rows
 * [rows, width] floats, then the items' (lane-local row, tag, weight bits) word triples — and the
 * lanes exchange a 6-word header per lane (status, mode, width, rows, items, exchange number)
 * before the alltoallv. Status, mode, width and exchange number must agree on every lane; a lane
 * whose route fails validation still joins the header exchange with status 1, so every lane fails
 * at once instead of waiting for a timeout. The receiver checks the item triples (rows in range,
 * nondecreasing, no row without items) and builds item_row / row_seg.
 * Combine: the owners return v->out — one row per item (PER_ITEM) or per received row (PRESUM) —
 * with the reverse alltoallv; the sender permutes the blocks into its item order or its
 * (row, lane ascending) pair order. Counts are known from the dispatch, so no header.
 * Backend buffers (x, rows, item_w, out, y) are read only through k3_backend_download and written
 * only through k3_backend_upload, staged in host arrays; when the backend is host-visible the
 * staging copy is skipped. Every array grows to the largest exchange seen, then is reused.
 * Device path (a transport with ep_alltoallv_dev, e.g. nccl, and a device backend): the rows never
 * cross to the host. The sender packs its pair rows into lane blocks with one rows_gather on the
 * backend, the blocks go backend to backend, and arrive in the view's order (source lane, then
 * source row), so the receiver uses them as they land; the item triples alone travel as host
 * words (their own alltoallv). The combine returns v->out backend to backend and the sender puts
 * the blocks in item / pair order with one rows_gather. Same protocol, same bytes per row. */
#include "k3_comm.h"
#include "comm_internal.h"

#include <stdio.h>

#define ITEM_WORDS 3 /* lane-local row, tag, weight bits */

const char *k3_combine_mode_name(k3_combine_mode m) {
    return m == K3_COMBINE_PER_ITEM ? "per-item" : m == K3_COMBINE_PRESUM ? "presum" : "?";
}

/* ---- state -------------------------------------------------------------------------------- */
static k3_status lanes_alloc(k3_comm *c) {
    comm_moe *mo = &c->moe;
    if (mo->s_rows) return K3_OK;
    size_t E = (size_t)c->n_lanes;
    int64_t **a64[] = {&mo->s_rows, &mo->s_items, &mo->r_rows, &mo->r_items, &mo->scount,
                       &mo->sdispl, &mo->rcount,  &mo->rdispl, &mo->mark,    &mo->cur,
                       &mo->rows_s, &mo->rows_sd, &mo->rows_r, &mo->rows_rd};
    for (size_t i = 0; i < K3_ARRAY_LEN(a64); i++)
        K3_TRY(k3_calloc((void **)a64[i], E * sizeof(int64_t), "MoE lane counts"));
    K3_TRY(k3_calloc((void **)&mo->hdr_s, E * COMM_MOE_HDR_WORDS * 4, "MoE counts header"));
    K3_TRY(k3_calloc((void **)&mo->hdr_r, E * COMM_MOE_HDR_WORDS * 4, "MoE counts header"));
    K3_TRY(k3_calloc((void **)&mo->lanes, E * sizeof(int32_t), "MoE lane list"));
    return K3_OK;
}

static void free_backend(comm_moe *mo) {
    if (mo->be) {
        k3_backend_free(mo->be, mo->b_rows);
        k3_backend_free(mo->be, mo->b_w);
        k3_backend_free(mo->be, mo->b_out);
        k3_backend_free(mo->be, mo->b_send);
        k3_backend_free(mo->be, mo->b_ret);
    }
    mo->b_rows = mo->b_w = mo->b_out = mo->b_send = mo->b_ret = NULL;
    mo->cap_b_rows = mo->cap_b_w = mo->cap_b_out = mo->cap_b_send = mo->cap_b_ret = 0;
    mo->be = NULL;
}

void comm_moe_free(k3_comm *c) {
    comm_moe *mo = &c->moe;
    free_backend(mo);
    void *p[] = {mo->s_rows,    mo->s_items,  mo->r_rows,   mo->r_items,  mo->scount,
                 mo->sdispl,    mo->rcount,   mo->rdispl,   mo->hdr_s,    mo->hdr_r,
                 mo->mark,      mo->cur,      mo->lanes,    mo->item_pos, mo->item_prow,
                 mo->pair_lane, mo->pair_pos, mo->pair_seg, mo->item_row, mo->row_seg,
                 mo->item_tag,  mo->item_wh,  mo->sbuf,     mo->rbuf,     mo->xh,
                 mo->hh,        mo->gidx,     mo->rows_s,   mo->rows_sd,  mo->rows_r,
                 mo->rows_rd};
    for (size_t i = 0; i < K3_ARRAY_LEN(p); i++) k3_free(p[i]);
    memset(mo, 0, sizeof *mo);
}

/* Grow a backend buffer of mo->be to >= need bytes (contents not kept; 1.5x steps so a slowly
 * growing exchange does not reallocate every step). */
static k3_status grow_be(comm_moe *mo, float **p, size_t *cap, size_t need, const char *what) {
    if (need <= *cap && *p) return K3_OK;
    size_t n = K3_MAX(K3_MAX(need, *cap + *cap / 2), (size_t)256);
    k3_backend_free(mo->be, *p);
    *p = NULL;
    *cap = 0;
    K3_TRY(k3_backend_alloc(mo->be, n, what, (void **)p));
    *cap = n;
    return K3_OK;
}

/* Grow host array mo->f (capacity mo->cap_f, elements) to >= n elements. */
#define GROW(mo, f, n, what)                                                                       \
    comm_grow((void **)&(mo)->f, &(mo)->cap_##f, (size_t)(n), sizeof *(mo)->f, what)

/* A host pointer to n floats of backend buffer src: src itself when host-visible, else a download
 * into the staging array (*stage, *cap). */
static k3_status read_be(k3_backend *be, const float *src, int64_t n, float **stage, size_t *cap,
                         const float **out) {
    *out = src;
    if (n == 0 || k3_backend_host_visible(be)) return K3_OK;
    K3_TRY(comm_grow((void **)stage, cap, (size_t)n, sizeof(float), "MoE host staging"));
    K3_TRY(k3_backend_download(be, *stage, src, (size_t)n * sizeof(float)));
    *out = *stage;
    return K3_OK;
}

/* Exchange the per-lane headers (COMM_MOE_HDR_WORDS words each, status first) and check that
 * every lane reports status 0. `bad`: this lane's own validation result, carried in its status
 * word. */
static k3_status exchange_headers(k3_comm *c, k3_status bad, const char *what) {
    comm_moe *mo = &c->moe;
    const int k = COMM_MOE_HDR_WORDS;
    for (int e = 0; e < c->n_lanes; e++) mo->hdr_s[e * k] = bad != K3_OK;
    k3_status st = c->iface->ep_alltoall(c, mo->hdr_s, mo->hdr_r, k, what);
    if (st == K3_OK) mo->n_calls++; /* on every lane, so a failed exchange keeps them in step */
    if (bad != K3_OK) return bad;   /* this lane's own error message stays the one reported */
    K3_TRY(st);
    for (int e = 0; e < c->n_lanes; e++)
        if (mo->hdr_r[e * k] != 0) {
            char grp[96], who[64];
            comm_group_name(c, grp, sizeof grp);
            comm_describe(c, c->first_worker + c->stage * c->n_lanes + e, who, sizeof who);
            return K3_ERR(K3_ERR_COMM,
                          "%s in %s: lane %d, %s, rejected its own input (see its error)", what,
                          grp, e, who);
        }
    return K3_OK;
}

/* A mismatch of one header word between this lane and lane e. */
static k3_status mismatch(k3_comm *c, const char *what, int e, const char *field, const char *mine,
                          const char *theirs) {
    char grp[96], who[64];
    comm_group_name(c, grp, sizeof grp);
    comm_describe(c, c->first_worker + c->stage * c->n_lanes + e, who, sizeof who);
    return K3_ERR(K3_ERR_ARG,
                  "%s in %s: lane %d, %s, uses %s %s but this lane (%d) uses %s: every lane must "
                  "agree",
                  what, grp, e, who, field, theirs, c->lane, mine);
}

/* Counters of a dispatch: the words of the alltoallv (mo->scount) and of the headers, all lanes
 * including this one. */
static void count_dispatch(k3_comm *c, int64_t rows_sent) {
    uint64_t words = (uint64_t)c->n_lanes * COMM_MOE_HDR_WORDS;
    for (int e = 0; e < c->n_lanes; e++)
        words += (uint64_t)c->moe.scount[e] + (c->moe.dev ? (uint64_t)c->moe.rows_s[e] : 0);
    c->stats.dispatch_bytes += 4 * words;
    c->stats.dispatch_rows += (uint64_t)rows_sent;
    c->stats.n_exchanges++;
}

static void set_displ(const int64_t *count, int64_t *displ, int E, int64_t *total) {
    int64_t acc = 0;
    for (int e = 0; e < E; e++) displ[e] = acc, acc += count[e];
    *total = acc;
}

/* ---- dispatch: sender ----------------------------------------------------------------------- */
static k3_status check_route(const k3_comm *c, const k3_backend *be, const float *x, int64_t width,
                             const k3_moe_route *r, k3_combine_mode mode) {
    if (!be) return K3_ERR(K3_ERR_ARG, "MoE dispatch: no backend");
    if (mode != K3_COMBINE_PER_ITEM && mode != K3_COMBINE_PRESUM)
        return K3_ERR(K3_ERR_ARG, "MoE dispatch: unknown combine mode %d", (int)mode);
    if (!r || width < 1 || width > INT32_MAX / 4 || r->n_rows < 0 || r->n_rows > INT32_MAX ||
        r->n_items < 0 || r->n_items > INT32_MAX)
        return K3_ERR(K3_ERR_ARG, "MoE dispatch: bad shape (%lld rows, %lld items, width %lld)",
                      r ? (long long)r->n_rows : -1LL, r ? (long long)r->n_items : -1LL,
                      (long long)width);
    if ((r->n_rows > 0 && !x) ||
        (r->n_items > 0 && (!r->item_row || !r->item_lane || !r->item_tag || !r->item_w)))
        return K3_ERR(K3_ERR_ARG, "MoE dispatch: NULL input for %lld rows, %lld items",
                      (long long)r->n_rows, (long long)r->n_items);
    for (int64_t i = 0; i < r->n_items; i++) {
        int32_t row = r->item_row[i], lane = r->item_lane[i];
        if (row < 0 || row >= r->n_rows || (i > 0 && row < r->item_row[i - 1]))
            return K3_ERR(K3_ERR_ARG,
                          "MoE dispatch: item %lld has row %d (rows 0..%lld, nondecreasing; the "
                          "previous item has row %d)",
                          (long long)i, row, (long long)r->n_rows - 1,
                          i > 0 ? r->item_row[i - 1] : -1);
        if (lane < 0 || lane >= c->n_lanes)
            return K3_ERR(K3_ERR_ARG,
                          "MoE dispatch: item %lld goes to lane %d (the EP group has %d)",
                          (long long)i, lane, c->n_lanes);
    }
    return K3_OK;
}

/* Deduplicate into (row, lane) pairs, ordered by row then lane ascending; lane-local indices of
 * every pair (its row in the lane's block) and item (its triple in the lane's block). */
static k3_status plan(k3_comm *c, const k3_moe_route *r) {
    comm_moe *mo = &c->moe;
    const int E = c->n_lanes;
    int64_t n_items = r->n_items, n_rows = r->n_rows;
    size_t ni1 = (size_t)K3_MAX(n_items, 1); /* pairs <= items */
    K3_TRY(GROW(mo, item_pos, ni1, "MoE item positions"));
    K3_TRY(GROW(mo, item_prow, ni1, "MoE item rows"));
    K3_TRY(GROW(mo, pair_pos, ni1, "MoE pair positions"));
    K3_TRY(GROW(mo, pair_lane, ni1, "MoE pair lanes"));
    K3_TRY(GROW(mo, pair_seg, n_rows + 1, "MoE pair segments"));
    for (int e = 0; e < E; e++) mo->s_rows[e] = mo->s_items[e] = 0, mo->mark[e] = -1;
    int64_t np = 0, i = 0;
    for (int64_t row = 0; row < n_rows; row++) {
        mo->pair_seg[row] = np;
        int64_t a = i;
        while (i < n_items && r->item_row[i] == row) i++;
        int nl = 0;
        for (int64_t k = a; k < i; k++) {
            int e = r->item_lane[k];
            if (mo->mark[e] != row) mo->mark[e] = row, mo->lanes[nl++] = e;
        }
        for (int s = 1; s < nl; s++) /* insertion sort: a row has at most K distinct lanes */
            for (int t = s; t > 0 && mo->lanes[t - 1] > mo->lanes[t]; t--) {
                int32_t tmp = mo->lanes[t];
                mo->lanes[t] = mo->lanes[t - 1], mo->lanes[t - 1] = tmp;
            }
        for (int s = 0; s < nl; s++) {
            int e = mo->lanes[s];
            mo->pair_lane[np] = e;
            mo->pair_pos[np++] = mo->cur[e] = mo->s_rows[e]++;
        }
        for (int64_t k = a; k < i; k++) {
            int e = r->item_lane[k];
            mo->item_pos[k] = mo->s_items[e]++;
            mo->item_prow[k] = mo->cur[e];
        }
    }
    mo->pair_seg[n_rows] = np;
    mo->n_items = n_items;
    mo->n_pairs = np;
    return K3_OK;
}

/* Pack the per-lane blocks: pair rows, then item triples (host path); on the device path the
 * pair rows go into b_send's lane blocks (one rows_gather) and the host blocks hold the triples. */
static k3_status pack(k3_comm *c, k3_backend *be, const float *x, int64_t W,
                      const k3_moe_route *r) {
    comm_moe *mo = &c->moe;
    const int E = c->n_lanes;
    const int64_t Wh = mo->dev ? 0 : W; /* row words in the host blocks */
    int64_t total = 0;
    for (int e = 0; e < E; e++) mo->scount[e] = mo->s_rows[e] * Wh + mo->s_items[e] * ITEM_WORDS;
    set_displ(mo->scount, mo->sdispl, E, &total);
    K3_TRY(GROW(mo, sbuf, K3_MAX(total, 1), "MoE send buffer"));
    if (mo->dev) {
        int64_t n_rows_s = 0;
        for (int e = 0; e < E; e++) mo->rows_s[e] = mo->s_rows[e] * W;
        set_displ(mo->rows_s, mo->rows_sd, E, &n_rows_s);
        n_rows_s /= W;
        K3_TRY(GROW(mo, gidx, K3_MAX(n_rows_s, 1), "MoE gather indices"));
        for (int64_t row = 0; row < r->n_rows; row++)
            for (int64_t p = mo->pair_seg[row]; p < mo->pair_seg[row + 1]; p++) {
                int e = mo->pair_lane[p];
                mo->gidx[mo->rows_sd[e] / W + mo->pair_pos[p]] = row;
            }
        K3_TRY(grow_be(mo, &mo->b_send, &mo->cap_b_send, (size_t)(n_rows_s * W) * sizeof(float),
                       "MoE packed rows"));
        if (n_rows_s) K3_TRY(be->ops->rows_gather(be, x, W, mo->gidx, n_rows_s, mo->b_send));
    } else {
        const float *xs = NULL;
        K3_TRY(read_be(be, x, r->n_rows * W, &mo->xh, &mo->cap_xh, &xs));
        for (int64_t row = 0; row < r->n_rows; row++)
            for (int64_t p = mo->pair_seg[row]; p < mo->pair_seg[row + 1]; p++) {
                int e = mo->pair_lane[p];
                memcpy(mo->sbuf + mo->sdispl[e] + mo->pair_pos[p] * W, xs + row * W,
                       (size_t)W * sizeof(float));
            }
    }
    for (int64_t k = 0; k < r->n_items; k++) {
        int e = r->item_lane[k];
        uint32_t *t = mo->sbuf + mo->sdispl[e] + mo->s_rows[e] * Wh + mo->item_pos[k] * ITEM_WORDS;
        uint32_t wbits;
        memcpy(&wbits, &r->item_w[k], 4);
        t[0] = (uint32_t)mo->item_prow[k];
        t[1] = (uint32_t)r->item_tag[k];
        t[2] = wbits;
    }
    /* lane-local -> global positions in the combine's return order (lanes ascending); the dedup
     * scratch mark/cur now holds each lane's first row / first item in that order */
    int64_t acc_i = 0, acc_r = 0;
    for (int e = 0; e < E; e++) {
        mo->cur[e] = acc_i, acc_i += mo->s_items[e];
        mo->mark[e] = acc_r, acc_r += mo->s_rows[e];
    }
    for (int64_t k = 0; k < r->n_items; k++) mo->item_pos[k] += mo->cur[r->item_lane[k]];
    for (int64_t p = 0; p < mo->n_pairs; p++) mo->pair_pos[p] += mo->mark[mo->pair_lane[p]];
    return K3_OK;
}

/* ---- dispatch: receiver ------------------------------------------------------------------- */
/* Unpack the received blocks: rows into rows_host [n_rows_r, W] (NULL on the device path, whose
 * blocks hold no rows), the triples into the view's host arrays (checked: rows in range,
 * nondecreasing, none without items). */
static k3_status unpack(k3_comm *c, int64_t W, float *rows_host) {
    comm_moe *mo = &c->moe;
    char grp[96];
    const int64_t Wh = rows_host ? W : 0;
    int64_t row_base = 0, item_base = 0;
    for (int e = 0; e < c->n_lanes; e++) {
        const uint32_t *blk = mo->rbuf + mo->rdispl[e];
        int64_t nr = mo->r_rows[e], ni = mo->r_items[e];
        if (nr && rows_host)
            memcpy(rows_host + row_base * W, blk, (size_t)(nr * W) * sizeof(float));
        const uint32_t *t = blk + nr * Wh;
        int64_t expect = 0; /* the next new row of this lane's block */
        for (int64_t k = 0; k < ni; k++, t += ITEM_WORDS) {
            int64_t prow = (int32_t)t[0];
            if (prow == expect && prow < nr) {
                mo->row_seg[row_base + prow] = item_base + k;
                expect++;
            } else if (prow != expect - 1 || prow < 0) {
                comm_group_name(c, grp, sizeof grp);
                return K3_ERR(K3_ERR_COMM,
                              "MoE dispatch in %s: item %lld from lane %d names row %lld (it sent "
                              "%lld rows; rows must be nondecreasing, none without items)",
                              grp, (long long)k, e, (long long)prow, (long long)nr);
            }
            int32_t tag = (int32_t)t[1];
            float w;
            memcpy(&w, &t[2], 4);
            mo->item_row[item_base + k] = row_base + prow;
            mo->item_tag[item_base + k] = tag;
            mo->item_wh[item_base + k] = w;
        }
        if (expect != nr) {
            comm_group_name(c, grp, sizeof grp);
            return K3_ERR(K3_ERR_COMM,
                          "MoE dispatch in %s: lane %d sent %lld rows but items for only %lld", grp,
                          e, (long long)nr, (long long)expect);
        }
        row_base += nr;
        item_base += ni;
    }
    mo->row_seg[row_base] = item_base;
    return K3_OK;
}

k3_status k3_comm_moe_dispatch(k3_comm *c, k3_backend *be, const float *x, int64_t width,
                               const k3_moe_route *r, k3_combine_mode mode, k3_dispatch_view *v) {
    static const char what[] = "MoE dispatch";
    comm_moe *mo = &c->moe;
    memset(v, 0, sizeof *v);
    mo->dispatched = false;
    if (c->stage < 0)
        return K3_ERR(K3_ERR_STATE, "MoE dispatch on a rank without a stage (rank %d)", c->rank);
    K3_TRY(lanes_alloc(c));
    const int E = c->n_lanes;
    const int64_t W = width;
    mo->dev = c->iface->ep_alltoallv_dev && be && !k3_backend_host_visible(be);
    const int64_t Wh = mo->dev ? 0 : W; /* row words in the host blocks */
    if (mo->be != be) free_backend(mo);
    mo->be = be;
    /* 1. local work; an error is carried into the header exchange so every lane stops */
    k3_status bad = check_route(c, be, x, width, r, mode);
    if (bad == K3_OK) bad = plan(c, r);
    if (bad == K3_OK) bad = pack(c, be, x, W, r);
    for (int e = 0; e < E; e++) {
        int32_t *h = mo->hdr_s + e * COMM_MOE_HDR_WORDS;
        h[1] = (int32_t)mode;
        h[2] = bad == K3_OK ? (int32_t)W : 0;
        h[3] = bad == K3_OK ? (int32_t)mo->s_rows[e] : 0;
        h[4] = bad == K3_OK ? (int32_t)mo->s_items[e] : 0;
        h[5] = (int32_t)(mo->n_calls & 0x7fffffffu);
    }
    /* count unit: COMM_MOE_HDR_WORDS int32 words per lane */
    K3_TRY(exchange_headers(c, bad, what));
    /* 2. every lane must agree on mode, width and the exchange number */
    int64_t n_rows_r = 0, n_items_r = 0;
    for (int e = 0; e < E; e++) {
        const int32_t *h = mo->hdr_r + e * COMM_MOE_HDR_WORDS;
        char mine[32], theirs[32];
        if (h[1] != (int32_t)mode)
            return mismatch(c, what, e, "combine mode", k3_combine_mode_name(mode),
                            k3_combine_mode_name((k3_combine_mode)h[1]));
        if (h[2] != (int32_t)W) {
            snprintf(mine, sizeof mine, "%lld", (long long)W);
            snprintf(theirs, sizeof theirs, "%d", h[2]);
            return mismatch(c, what, e, "row width", mine, theirs);
        }
        if (h[5] != (int32_t)((mo->n_calls - 1) & 0x7fffffffu)) {
            snprintf(mine, sizeof mine, "%u", (unsigned)((mo->n_calls - 1) & 0x7fffffffu));
            snprintf(theirs, sizeof theirs, "%d", h[5]);
            return mismatch(c, what, e, "exchange number (lanes out of step)", mine, theirs);
        }
        if (h[3] < 0 || h[4] < 0 || (h[3] > 0) != (h[4] > 0) || h[4] < h[3])
            return K3_ERR(K3_ERR_COMM, "MoE dispatch: lane %d announced %d rows, %d items", e, h[3],
                          h[4]);
        mo->r_rows[e] = h[3];
        mo->r_items[e] = h[4];
        mo->rcount[e] = mo->r_rows[e] * Wh + mo->r_items[e] * ITEM_WORDS;
        mo->rows_r[e] = mo->r_rows[e] * W;
        n_rows_r += h[3];
        n_items_r += h[4];
    }
    int64_t total_r = 0;
    set_displ(mo->rcount, mo->rdispl, E, &total_r);
    /* 3. buffers (grow-only), the exchange, the receiver's view */
    size_t nir1 = (size_t)K3_MAX(n_items_r, 1);
    K3_TRY(GROW(mo, rbuf, K3_MAX(total_r, 1), "MoE recv buffer"));
    K3_TRY(GROW(mo, item_row, nir1, "MoE item rows"));
    K3_TRY(GROW(mo, item_tag, nir1, "MoE item tags"));
    K3_TRY(GROW(mo, item_wh, nir1, "MoE item weights"));
    K3_TRY(GROW(mo, row_seg, n_rows_r + 1, "MoE row segments"));
    int64_t n_out = mode == K3_COMBINE_PER_ITEM ? n_items_r : n_rows_r;
    K3_TRY(grow_be(mo, &mo->b_rows, &mo->cap_b_rows, (size_t)(n_rows_r * W) * sizeof(float),
                   "MoE received rows"));
    K3_TRY(grow_be(mo, &mo->b_w, &mo->cap_b_w, (size_t)n_items_r * sizeof(float),
                   "MoE received weights"));
    K3_TRY(grow_be(mo, &mo->b_out, &mo->cap_b_out, (size_t)(n_out * W) * sizeof(float),
                   "MoE expert outputs"));
    /* count unit: 4-byte words (rows · width floats + items · 3 words per lane; the device
       path: the triples here, the rows backend to backend) */
    K3_TRY(c->iface->ep_alltoallv(c, mo->sbuf, mo->scount, mo->sdispl, mo->rbuf, mo->rcount,
                                  mo->rdispl, what));
    if (mo->dev) {
        int64_t tot = 0;
        set_displ(mo->rows_r, mo->rows_rd, E, &tot);
        K3_TRY(c->iface->ep_alltoallv_dev(c, be, mo->b_send, mo->rows_s, mo->rows_sd, mo->b_rows,
                                          mo->rows_r, mo->rows_rd, what));
    }
    bool host = k3_backend_host_visible(be);
    float *rows_host = mo->dev ? NULL : mo->b_rows;
    if (!host && !mo->dev) {
        K3_TRY(GROW(mo, hh, K3_MAX(n_rows_r * W, 1), "MoE host staging"));
        rows_host = mo->hh;
    }
    K3_TRY(unpack(c, W, rows_host));
    if (!host && !mo->dev && n_rows_r)
        K3_TRY(k3_backend_upload(be, mo->b_rows, mo->hh, (size_t)(n_rows_r * W) * sizeof(float)));
    if (n_items_r)
        K3_TRY(k3_backend_upload(be, mo->b_w, mo->item_wh, (size_t)n_items_r * sizeof(float)));
    count_dispatch(c, mo->n_pairs);
    mo->mode = mode;
    mo->width = W;
    mo->n_rows_r = n_rows_r;
    mo->n_items_r = n_items_r;
    mo->dispatched = true;
    *v = (k3_dispatch_view){.n_rows = n_rows_r,
                            .width = W,
                            .rows = mo->b_rows,
                            .n_items = n_items_r,
                            .item_row = mo->item_row,
                            .row_seg = mo->row_seg,
                            .item_tag = mo->item_tag,
                            .item_w_host = mo->item_wh,
                            .item_w = mo->b_w,
                            .out = mo->b_out,
                            .mode = mode};
    return K3_OK;
}

/* ---- combine ------------------------------------------------------------------------------ */
/* The reverse exchange: owner rows src_host [Σ back[e], W] (back[e] rows to lane e) go back; the
 * sender receives ret[e] rows from lane e into mo->rbuf. */
static k3_status return_rows(k3_comm *c, const float *src_host, const int64_t *back,
                             const int64_t *ret, int64_t W, const char *what) {
    comm_moe *mo = &c->moe;
    const int E = c->n_lanes;
    int64_t total_s = 0, total_r = 0;
    for (int e = 0; e < E; e++) mo->scount[e] = back[e] * W, mo->rcount[e] = ret[e] * W;
    set_displ(mo->scount, mo->sdispl, E, &total_s);
    set_displ(mo->rcount, mo->rdispl, E, &total_r);
    K3_TRY(GROW(mo, rbuf, K3_MAX(total_r, 1), "MoE return buffer"));
    /* count unit: 4-byte words (rows · width floats per lane) */
    K3_TRY(c->iface->ep_alltoallv(c, src_host, mo->scount, mo->sdispl, mo->rbuf, mo->rcount,
                                  mo->rdispl, what));
    c->stats.combine_bytes += 4 * (uint64_t)total_s;
    c->stats.combine_rows += (uint64_t)(total_s / W);
    return K3_OK;
}

k3_status k3_comm_moe_combine(k3_comm *c, k3_backend *be, float *y, const int64_t **pair_seg) {
    comm_moe *mo = &c->moe;
    if (pair_seg) *pair_seg = NULL;
    if (!mo->dispatched)
        return K3_ERR(K3_ERR_STATE, "MoE combine without a k3_comm_moe_dispatch before it");
    if (be != mo->be)
        return K3_ERR(K3_ERR_ARG, "MoE combine: backend %s is not the dispatch's (%s)",
                      be ? be->name : "NULL", mo->be->name);
    const bool per_item = mo->mode == K3_COMBINE_PER_ITEM;
    const int64_t W = mo->width, n_y = per_item ? mo->n_items : mo->n_pairs;
    if (!per_item && !pair_seg)
        return K3_ERR(K3_ERR_ARG, "MoE combine (presum): pair_seg is required");
    if (n_y > 0 && !y)
        return K3_ERR(K3_ERR_ARG, "MoE combine: y is NULL for %lld rows", (long long)n_y);
    mo->dispatched = false;
    const int64_t *pos = per_item ? mo->item_pos : mo->pair_pos;
    if (mo->dev) { /* v->out's lane blocks backend to backend, then into item / pair order */
        const int E = c->n_lanes;
        const int64_t *back = per_item ? mo->r_items : mo->r_rows,
                      *ret = per_item ? mo->s_items : mo->s_rows;
        int64_t total_s = 0, total_r = 0;
        for (int e = 0; e < E; e++) mo->scount[e] = back[e] * W, mo->rcount[e] = ret[e] * W;
        set_displ(mo->scount, mo->sdispl, E, &total_s);
        set_displ(mo->rcount, mo->rdispl, E, &total_r);
        K3_TRY(grow_be(mo, &mo->b_ret, &mo->cap_b_ret, (size_t)total_r * sizeof(float),
                       "MoE returned rows"));
        K3_TRY(c->iface->ep_alltoallv_dev(c, be, mo->b_out, mo->scount, mo->sdispl, mo->b_ret,
                                          mo->rcount, mo->rdispl, "MoE combine"));
        c->stats.combine_bytes += 4 * (uint64_t)total_s;
        c->stats.combine_rows += (uint64_t)(total_s / W);
        if (n_y) K3_TRY(be->ops->rows_gather(be, mo->b_ret, W, pos, n_y, y));
        if (pair_seg && !per_item) *pair_seg = mo->pair_seg;
        return K3_OK;
    }
    /* owner side: v->out goes back to its sources */
    const float *outs = NULL;
    K3_TRY(read_be(be, mo->b_out, (per_item ? mo->n_items_r : mo->n_rows_r) * W, &mo->hh,
                   &mo->cap_hh, &outs));
    K3_TRY(return_rows(c, outs, per_item ? mo->r_items : mo->r_rows,
                       per_item ? mo->s_items : mo->s_rows, W, "MoE combine"));
    /* sender side: blocks -> item order (PER_ITEM) or (row, lane) pair order (PRESUM) */
    bool host = k3_backend_host_visible(be);
    float *dst = y;
    if (!host) {
        K3_TRY(GROW(mo, xh, K3_MAX(n_y * W, 1), "MoE host staging"));
        dst = mo->xh;
    }
    const float *back = (const float *)(const void *)mo->rbuf;
    for (int64_t i = 0; i < n_y; i++)
        memcpy(dst + i * W, back + pos[i] * W, (size_t)W * sizeof(float));
    if (!host && n_y) K3_TRY(k3_backend_upload(be, y, dst, (size_t)(n_y * W) * sizeof(float)));
    if (pair_seg && !per_item) *pair_seg = mo->pair_seg;
    return K3_OK;
}

/* ---- the device-routed exchange (fixed lane blocks) ------------------------------------------ */
bool k3_comm_moe_dev(const k3_comm *c, const k3_backend *be) {
    return c && be && c->iface->ep_alltoallv_dev && !k3_backend_host_visible(be) && c->stage >= 0;
}

k3_status k3_comm_moe_exchange_dev(k3_comm *c, k3_backend *be, const float *send, float *recv,
                                   int64_t blk, bool combine, const char *what) {
    if (!k3_comm_moe_dev(c, be))
        return K3_ERR(K3_ERR_STATE, "%s: the transport moves no backend buffers", what);
    comm_moe *mo = &c->moe;
    K3_TRY(lanes_alloc(c));
    const int E = c->n_lanes;
    for (int e = 0; e < E; e++) mo->scount[e] = blk, mo->sdispl[e] = (int64_t)e * blk;
    /* count unit: 4-byte words, one fixed block per lane each way */
    K3_TRY((c->iface->ep_alltoallv_dev_async ? c->iface->ep_alltoallv_dev_async
                                             : c->iface->ep_alltoallv_dev)(
        c, be, send, mo->scount, mo->sdispl, recv, mo->scount, mo->sdispl, what));
    const uint64_t bytes = 4 * (uint64_t)blk * (uint64_t)E;
    if (combine) {
        c->stats.combine_bytes += bytes;
    } else {
        c->stats.dispatch_bytes += bytes;
        c->stats.n_exchanges++;
    }
    return K3_OK;
}
