/* cpu_moe.c — the cpu backend's moe_experts op (k3_kernels.h): the routed experts of a MoE layer
 * in one call, grouped by expert. cpu memory is host memory, so the op reads the expert ids
 * itself and sorts the slot rows by expert (counting sort, stable) in the host part of its work;
 * the arithmetic is the backend's own ops (be->ops: rows_gather, matmul_group, swiglu / situ,
 * rows_scatter, rows_wsum), the same calls and tiles as experts/moe.c k3_moe_expert_rows makes.
 * Under the guard backend be is the inner cpu backend and every buffer is open for the call.
 * Invariants:
 * - every item is W2_e·act(W1_e·r_i, W3_e·r_i) through matmul_group, whose rows do not depend on
 *   the other rows of the call: the bits of ref_moe.c's row-by-row definition on cpu ops, and of
 *   k3_moe_expert_rows, whatever the tiles;
 * - with weights, tokens go in tiles of K3_MOE_EXPERTS_ITEMS / row_div (256 tokens of K3's 16
 *   slots): their items land in the items part of the work in slot order and one rows_wsum sums
 *   each token's row_div of them, so the output is rows_wsum(items, w, NULL, row_div, T, Lw) bit
 *   for bit with no [n, Lw] buffer. The token tile is large on purpose: the rows of a tile are
 *   grouped by expert, and an expert's rows share one pass over its weights (tiles of 32 tokens
 *   left ~4 rows an expert on small's 64 experts: prefill 1.3x slower in the experts);
 * - ids, experts and shapes are checked (k3_ref_moe_check, shared with ref) before any buffer is
 *   written.
 * Work (k3_moe_experts_work_floats): xin [tile, Lw] | o [tile, Lw] | g, u [tile, I] | items
 * [min(n, K3_MOE_EXPERTS_ITEMS), Lw] | host int64 order [n], start [E + 1], idx [tile], each part
 * 16-float aligned. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#define TILE K3_MOE_EXPERTS_TILE

static size_t pad16(size_t n) {
    return (n + 15) & ~(size_t)15;
}

_Static_assert(K3_MOE_EXPERTS_ITEMS % TILE == 0 && K3_MOE_EXPERTS_ITEMS >= TILE,
               "a token tile of the weighted form holds whole row tiles");

typedef struct {
    const float *src;
    const int32_t *row_of; /* NULL: slot row i reads src row i / row_div */
    int64_t row_div, Lw, I;
    const int32_t *ids;
    int E;
    const k3_tensor *w1, *w3, *w2;
    size_t e_stride;
    float beta, lin_beta;
    float *xin, *o, *g, *u;       /* [TILE, Lw], [TILE, Lw], [TILE, I], [TILE, I] */
    float *items;                 /* [min(n, K3_MOE_EXPERTS_ITEMS), Lw] (the weighted form) */
    int64_t *order, *start, *idx; /* host: [n], [E + 1], [TILE] */
} moe_args;

/* The items of slot rows [r0, r0 + n_rows): item of row r0 + j -> dst row j. The rows are
 * sorted by expert (stable) and run in tiles of up to TILE consecutive sorted rows: whole experts
 * while they fit, an expert with more rows in tiles of its own (its last piece then shares). Per
 * tile one gather, one matmul_group for every expert's w1 and w3 over its rows of the tile, one
 * activation, one matmul_group for the w2s, one scatter. dst may be the xin part only when the
 * rows fit one tile (its gather is consumed before the scatter). */
static k3_status expert_items(k3_backend *be, const moe_args *a, int64_t r0, int64_t n_rows,
                              float *dst) {
    const int32_t *ex = a->ids + r0;
    int64_t *order = a->order, *start = a->start, *idx = a->idx;
    const int64_t Lw = a->Lw, I = a->I;
    const int E = a->E;
    K3_ASSERT(dst != a->xin || n_rows <= TILE);
    for (int e = 0; e <= E; e++) start[e] = 0;
    for (int64_t j = 0; j < n_rows; j++) start[ex[j] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t j = 0; j < n_rows; j++) order[start[ex[j]]++] = j; /* start[e] -> end of e */
    for (int e = E; e > 0; e--) start[e] = start[e - 1];            /* shift back to starts */
    start[0] = 0;

    k3_mm mm[2 * TILE];
    int seg_e[TILE];
    int64_t seg_j[TILE], seg_r[TILE];
    for (int64_t p0 = 0, m; p0 < n_rows; p0 += m) {
        int64_t p1 = start[ex[order[p0]] + 1]; /* the end of p0's expert */
        if (p1 - p0 >= TILE)
            p1 = p0 + TILE;
        else
            while (p1 < n_rows && start[ex[order[p1]] + 1] - p0 <= TILE)
                p1 = start[ex[order[p1]] + 1];
        m = p1 - p0;
        for (int64_t j = 0; j < m; j++) {
            const int64_t i = r0 + order[p0 + j];
            idx[j] = a->row_of ? a->row_of[i] : i / a->row_div;
        }
        K3_TRY(be->ops->rows_gather(be, a->src, Lw, idx, m, a->xin));
        int ns = 0; /* segment s: rows [seg_j, seg_j + seg_r) of the tile, all of expert seg_e */
        for (int64_t j = 0; j < m; j += seg_r[ns++]) {
            seg_e[ns] = ex[order[p0 + j]];
            seg_j[ns] = j;
            seg_r[ns] = K3_MIN(start[seg_e[ns] + 1] - (p0 + j), m - j);
        }
        for (int q = 0; q < ns; q++) {
            const float *xq = a->xin + seg_j[q] * Lw;
            mm[2 * q] = (k3_mm){xq, seg_r[q], k3_moe_expert_t(a->w1, seg_e[q], a->e_stride),
                                a->g + seg_j[q] * I};
            mm[2 * q + 1] = (k3_mm){xq, seg_r[q], k3_moe_expert_t(a->w3, seg_e[q], a->e_stride),
                                    a->u + seg_j[q] * I};
        }
        K3_TRY(be->ops->matmul_group(be, mm, 2 * ns));
        if (a->beta < 0)
            K3_TRY(be->ops->swiglu(be, a->g, a->u, m * I, a->g));
        else
            K3_TRY(be->ops->situ(be, a->g, a->u, m * I, a->beta, a->lin_beta, a->g));
        for (int q = 0; q < ns; q++)
            mm[q] = (k3_mm){a->g + seg_j[q] * I, seg_r[q],
                            k3_moe_expert_t(a->w2, seg_e[q], a->e_stride), a->o + seg_j[q] * Lw};
        K3_TRY(be->ops->matmul_group(be, mm, ns));
        K3_TRY(be->ops->rows_scatter(be, a->o, Lw, order + p0, m, dst));
    }
    return K3_OK;
}

k3_status k3_cpu_moe_experts(k3_backend *be, const float *src, int64_t row_div,
                             const int32_t *row_of, const int32_t *ids, const float *w, int64_t n,
                             int E, const k3_tensor *w1, const k3_tensor *w3, const k3_tensor *w2,
                             size_t e_stride, float beta, float lin_beta, float *out, float *work) {
    if (n <= 0) return K3_OK;
    int64_t Lw = 0, I = 0;
    K3_TRY(k3_ref_moe_check(row_div, row_of, ids, w, n, E, w1, w3, w2, e_stride, work, &Lw, &I));
    moe_args a = {.src = src,
                  .row_of = row_of,
                  .row_div = row_div,
                  .Lw = Lw,
                  .I = I,
                  .ids = ids,
                  .E = E,
                  .w1 = w1,
                  .w3 = w3,
                  .w2 = w2,
                  .e_stride = e_stride,
                  .beta = beta,
                  .lin_beta = lin_beta};
    a.xin = work;
    a.o = a.xin + pad16((size_t)TILE * (size_t)Lw);
    a.g = a.o + pad16((size_t)TILE * (size_t)Lw);
    a.u = a.g + pad16((size_t)TILE * (size_t)I);
    a.items = a.u + pad16((size_t)TILE * (size_t)I);
    a.order =
        (int64_t *)(void *)(a.items + pad16((size_t)K3_MIN(n, K3_MOE_EXPERTS_ITEMS) * (size_t)Lw));
    a.start = a.order + n;
    a.idx = a.start + E + 1;
    if (!w) return expert_items(be, &a, 0, n, out);
    /* tokens in tiles whose items fit the items part; each tile's slot sum in one rows_wsum */
    const int64_t T = n / row_div, Tt = K3_MOE_EXPERTS_ITEMS / row_div;
    for (int64_t t0 = 0; t0 < T; t0 += Tt) {
        const int64_t Tc = K3_MIN(Tt, T - t0);
        K3_TRY(expert_items(be, &a, t0 * row_div, Tc * row_div, a.items));
        K3_TRY(be->ops->rows_wsum(be, a.items, w + t0 * row_div, NULL, row_div, Tc, Lw,
                                  out + t0 * Lw));
    }
    return K3_OK;
}
