/* wire.c — the typed payloads of wire.h over comm's messages: post a step message, poll for one
 * and check it (version, kind, lengths) with errors naming the sender. */
#include "rank_internal.h"

/* ---- the wire (wire.h) --------------------------------------------------------------------- */

k3_status rank_post_step(rank_ctx *r, int peer, k3_msg_kind kind, k3_wire_step h,
                         const int32_t *meta, const k3_f32_seg *seg, int n_seg) {
    h.version = K3_WIRE_VERSION;
    h.kind = (uint32_t)kind;
    size_t nb = sizeof h + (size_t)h.n_meta * sizeof(int32_t);
    if (nb > r->wire_cap) {
        k3_free(r->wire);
        r->wire = NULL;
        r->wire_cap = 0;
        RTRY(r, k3_alloc((void **)&r->wire, nb, "step message"));
        r->wire_cap = nb;
    }
    memcpy(r->wire, &h, sizeof h);
    if (h.n_meta) memcpy(r->wire + sizeof h, meta, (size_t)h.n_meta * sizeof(int32_t));
    RTRY(r, k3_comm_post(r->comm, peer, kind, r->wire, (int64_t)nb, seg, n_seg));
    return K3_OK;
}

/* Poll for a step message of `kind` from `peer`; *got false when none waits. */
k3_status rank_poll_step(rank_ctx *r, int peer, k3_msg_kind kind, step_msg *out, bool *got) {
    k3_comm_msg m;
    RTRY(r, k3_comm_poll(r->comm, peer, kind, &m, got));
    if (!*got) return K3_OK;
    k3_wire_step h;
    if (m.n_meta_bytes < (int64_t)sizeof h)
        RTRY(r, K3_ERR(K3_ERR_FORMAT, "step message from rank %d: %lld meta bytes < %zu", m.src,
                       (long long)m.n_meta_bytes, sizeof h));
    memcpy(&h, m.meta, sizeof h);
    if (h.version != K3_WIRE_VERSION || h.kind != (uint32_t)kind || h.n_meta < 0 ||
        m.n_meta_bytes != (int64_t)(sizeof h + (size_t)h.n_meta * sizeof(int32_t)))
        RTRY(r, K3_ERR(K3_ERR_FORMAT,
                       "step message from rank %d: wire version %u (want %u), kind %u (want %d), "
                       "%d meta in %lld bytes",
                       m.src, h.version, K3_WIRE_VERSION, h.kind, (int)kind, h.n_meta,
                       (long long)m.n_meta_bytes));
    *out = (step_msg){.h = h,
                      .src = m.src,
                      .meta = (const int32_t *)(const void *)((const uint8_t *)m.meta + sizeof h),
                      .f32 = m.f32,
                      .n_f32 = m.n_f32,
                      .n_bytes = m.n_bytes};
    return K3_OK;
}
