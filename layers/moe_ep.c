/* moe_ep.c — the device-routed expert-parallel MoE step of a stage (issue 45; docs/DESIGN.md §3a
 * "dispatch layout"), used when the transport moves backend buffers (nccl) and the backend has
 * the dispatch's device halves (k3_backend_has_moe_ep: cuda). Per MoE layer, every lane:
 * route + down (its T tokens; none on an idle lane) → moe_ep_pack (the items into fixed slabs of
 * cap rows per (destination lane, expert), counts in each lane block's header, on the device) →
 * one fixed-size exchange of the lane blocks → moe_ep_experts (this lane's experts over the
 * received slabs: the masked grouped GEMM, outputs back into the rows they came from) → the
 * reverse exchange → moe_combine (each token's K rows in slot order: the bits of the host-routed
 * path's per-item combine, --deterministic or not) → finish. No count and no row crosses to the
 * host, the op sequence does not depend on the routing, and an expert over its capacity is a
 * deferred check naming layer, expert and capacity (never a dropped row).
 *
 * Owns (in the stage): the layout (k3_moe_ep), the per-layer expert maps on the backend (dest:
 * expert -> lane·EL + local index; glob: this lane's local index -> expert), the send / receive
 * buffers of L lane blocks (the send buffer takes the returned rows), the experts' scratch and
 * the items' rows (pos). Allocated once at create (the plan's step buffers), never per step. */
#include "layers_internal.h"

#include <stdlib.h>

#include "k3_experts.h"

/* The capacity factor: K3_MOE_CAPACITY_FACTOR in the environment, else 2 (docs/DESIGN.md). */
static k3_status cap_factor(double *f) {
    const char *v = getenv("K3_MOE_CAPACITY_FACTOR");
    *f = 2.0;
    if (!v || !*v) return K3_OK;
    char *end = NULL;
    *f = strtod(v, &end);
    if (*end || !(*f > 0.0) || *f > 1e6)
        return K3_ERR(K3_ERR_ARG, "K3_MOE_CAPACITY_FACTOR=%s: want a number > 0", v);
    return K3_OK;
}

/* The masked grouped GEMM takes MXFP4 experts with Lw and I multiples of 32 (K3's): the model's
 * dtype, the same on every lane, so every lane of a group decides alike. */
static bool experts_fit(const k3_stage *s) {
    const k3_config *c = s->c;
    if (k3_moe_row_width(c) % 32 || c->moe_intermediate_size % 32) return false;
    for (int l = s->p.layer_begin; l < s->p.layer_end; l++) {
        if (!k3_config_is_moe(c, l) || !s->w->layers[l].experts) continue;
        for (int e = 0; e < c->n_experts; e++) {
            const k3_expert_w *ex = &s->w->layers[l].experts[e];
            if (ex->w1.data) return ex->w1.dtype == K3_DT_MXFP4;
        }
    }
    return false;
}

bool k3_layers_moe_ep_usable(const k3_stage *s) {
    return s->p.comm && k3_backend_has_moe_ep(s->be) && k3_comm_moe_dev(s->p.comm, s->be) &&
           getenv("K3_MOE_HOST_ROUTE") == NULL && experts_fit(s);
}

k3_status k3_layers_moe_ep_create(k3_stage *s) {
    const k3_config *c = s->c;
    const int E = c->n_experts, L = s->p.n_lanes, me = k3_comm_lane(s->p.comm);
    const int nl = s->p.layer_end - s->p.layer_begin;
    int EL = 1;
    int32_t *cnt = NULL, *dest = NULL, *glob = NULL;
    K3_TRY(k3_calloc((void **)&cnt, (size_t)L * sizeof *cnt, "MoE lane counts"));
    k3_status st = k3_calloc((void **)&dest, (size_t)nl * (size_t)E * sizeof *dest, "MoE dest");
    for (int l = s->p.layer_begin; st == K3_OK && l < s->p.layer_end; l++) {
        if (!k3_config_is_moe(c, l)) continue;
        memset(cnt, 0, (size_t)L * sizeof *cnt);
        for (int e = 0; e < E; e++) {
            const int32_t lane = s->p.expert_lane[(size_t)l * (size_t)E + (size_t)e];
            if (lane < 0 || lane >= L) {
                st = K3_ERR(K3_ERR_ARG, "layer %d: expert %d has lane %d (the group has %d)", l, e,
                            lane, L);
                break;
            }
            dest[(size_t)(l - s->p.layer_begin) * (size_t)E + (size_t)e] = lane;
            EL = K3_MAX(EL, ++cnt[lane]);
        }
    }
    if (st == K3_OK)
        st = k3_calloc((void **)&glob, (size_t)nl * (size_t)EL * sizeof *glob, "MoE local experts");
    for (int l = s->p.layer_begin; st == K3_OK && l < s->p.layer_end; l++) {
        int32_t *d = dest + (size_t)(l - s->p.layer_begin) * (size_t)E;
        int32_t *g = glob + (size_t)(l - s->p.layer_begin) * (size_t)EL;
        for (int q = 0; q < EL; q++) g[q] = -1;
        if (!k3_config_is_moe(c, l)) continue;
        memset(cnt, 0, (size_t)L * sizeof *cnt);
        for (int e = 0; e < E; e++) { /* ascending ids: each lane's local index */
            const int lane = d[e], q = cnt[lane]++;
            if (lane == me) g[q] = e;
            d[e] = lane * EL + q;
        }
    }
    double factor = 2.0;
    if (st == K3_OK) st = cap_factor(&factor);
    if (st == K3_OK) {
        /* a decode round's rows on a sender: at most max_seqs (its batch, padded or not) */
        const int64_t decode_rows = s->p.max_seqs > 0 ? K3_MIN(s->T_max, s->p.max_seqs) : 0;
        k3_moe_ep_layout(&s->ep, E, c->n_experts_per_tok, L, EL, k3_moe_row_width(c), s->T_max,
                         factor, decode_rows);
        const size_t blk = (size_t)(s->ep.blk_rows * s->ep.Lw), C = (size_t)L * (size_t)s->ep.cap;
        k3_backend *be = s->be;
        const size_t nd = (size_t)nl * (size_t)E * 4, ng = (size_t)nl * (size_t)EL * 4;
        st = k3_backend_alloc(be, nd, "MoE expert lanes", (void **)&s->ep_dest);
        if (st == K3_OK) st = k3_backend_alloc(be, ng, "MoE local experts", (void **)&s->ep_glob);
        if (st == K3_OK) st = k3_backend_upload(be, s->ep_dest, dest, nd);
        if (st == K3_OK) st = k3_backend_upload(be, s->ep_glob, glob, ng);
        if (st == K3_OK)
            st = k3_backend_alloc(be, (size_t)L * blk * 4, "MoE dispatch slabs (send, return)",
                                  (void **)&s->ep_send);
        if (st == K3_OK)
            st = k3_backend_alloc(be, (size_t)L * blk * 4, "MoE dispatch slabs (receive)",
                                  (void **)&s->ep_recv);
        if (st == K3_OK)
            st = k3_backend_alloc(be, (size_t)L * blk * 4, "MoE dispatch slabs (expert outputs)",
                                  (void **)&s->ep_ret);
        if (st == K3_OK)
            st = k3_backend_alloc(be, (size_t)EL * C * (size_t)c->moe_intermediate_size * 4,
                                  "MoE dispatch expert scratch", (void **)&s->ep_h);
        if (st == K3_OK)
            st = k3_backend_alloc(be, (2 * (size_t)EL + (size_t)EL * C) * 4,
                                  "MoE dispatch row maps", (void **)&s->ep_iwork);
        if (st == K3_OK)
            st =
                k3_backend_alloc(be, (size_t)K3_MAX(s->T_max, 1) * (size_t)c->n_experts_per_tok * 4,
                                 "MoE dispatch item rows", (void **)&s->ep_pos);
    }
    k3_free(cnt), k3_free(dest), k3_free(glob);
    /* Each MoE layer's experts through the (zero-filled: no rows) receive slabs once, now: the
       backend builds a layer's expert table at its first call, an allocation that a captured
       step cannot make, and the first device-routed step of a lane may be captured (prefill is
       host-routed, and a lane may get no rows of a layer there). */
    for (int l = s->p.layer_begin; st == K3_OK && l < s->p.layer_end; l++) {
        const k3_expert_w *ex = s->w->layers[l].experts;
        if (!k3_config_is_moe(c, l) || !ex) continue;
        st = s->be->mem_->moe_ep_experts(
            s->be, &s->ep, s->ep_recv, s->ep_glob + (size_t)(l - s->p.layer_begin) * (size_t)EL,
            &ex->w1, &ex->w3, &ex->w2, sizeof *ex, c->act == K3_ACT_SWIGLU ? -1.0f : c->situ_beta,
            c->situ_linear_beta, s->ep_h, s->ep_iwork, s->ep_ret);
    }
    return st;
}

void k3_layers_moe_ep_free(k3_stage *s) {
    void *p[] = {s->ep_dest, s->ep_glob, s->ep_send,  s->ep_recv,
                 s->ep_ret,  s->ep_h,    s->ep_iwork, s->ep_pos};
    for (size_t i = 0; i < K3_ARRAY_LEN(p); i++) k3_backend_free(s->be, p[i]);
}

k3_status k3_layers_moe_ep_step(k3_stage *s, int l, const float *x, int64_t T, float *y) {
    const k3_config *c = s->c;
    const k3_layer_w *lw = &s->w->layers[l];
    k3_backend *be = s->be;
    const int K = c->n_experts_per_tok;
    const int64_t n = T * K, blk = s->ep.blk_rows * s->ep.Lw;
    float *wd = (float *)(void *)(s->moe_ids + n);
    k3_moe_ep ep = s->ep;
    ep.dest = s->ep_dest + (size_t)(l - s->p.layer_begin) * (size_t)c->n_experts;
    if (T > 0) {
        K3_TRY(k3_moe_router(be, c, lw, x, T, s->moe_ids, wd, s->moe_scratch));
        K3_TRY(k3_moe_down(be, c, lw, x, T, s->moe_r));
    }
    K3_TRY(be->mem_->moe_ep_pack(be, &ep, s->moe_ids, T, s->moe_r, s->ep_send, s->ep_pos));
    K3_TRY(k3_comm_moe_exchange_dev(s->p.comm, be, s->ep_send, s->ep_recv, blk, false,
                                    "MoE dispatch"));
    const k3_expert_w *ex = lw->experts;
    if (!ex) return K3_ERR(K3_ERR_MISSING, "layer %d: no expert table on this rank", l);
    K3_TRY(be->mem_->moe_ep_experts(
        be, &ep, s->ep_recv, s->ep_glob + (size_t)(l - s->p.layer_begin) * (size_t)ep.EL, &ex->w1,
        &ex->w3, &ex->w2, sizeof *ex, c->act == K3_ACT_SWIGLU ? -1.0f : c->situ_beta,
        c->situ_linear_beta, s->ep_h, s->ep_iwork, s->ep_ret));
    K3_TRY(
        k3_comm_moe_exchange_dev(s->p.comm, be, s->ep_ret, s->ep_send, blk, true, "MoE combine"));
    if (T == 0) return K3_OK;
    K3_TRY(be->mem_->moe_combine(be, s->ep_send, s->ep_pos, wd, T, K, ep.Lw, s->moe_acc));
    return k3_moe_finish(be, c, lw, x, s->moe_acc, T, y, s->moe_scratch);
}
