/* wire.c — the typed payloads of wire.h over comm's messages: the step meta's one layout
 * (rank_step: encode, decode), post a step message, poll for one and check it (magic, version,
 * kind, lengths) with errors naming the sender. */
#include "rank_internal.h"

/* ---- the step meta (wire.h rank_step) -------------------------------------------------------- */
/* Every element is a whole number of int32 words (the meta is an int32 array). */
#define RANK_STEP_CHECK(name, type)                                                                \
    _Static_assert(sizeof(type) % sizeof(int32_t) == 0 && _Alignof(type) == _Alignof(int32_t),     \
                   "rank_step section " #name ": not whole int32 words (K3_WIRE_VERSION 12)");
RANK_STEP_SECTIONS(RANK_STEP_CHECK)
#undef RANK_STEP_CHECK
#define RANK_STEP_ONE(name, type) +1
enum {
    RANK_STEP_HDR = 6 RANK_STEP_SECTIONS(RANK_STEP_ONE)
}; /* group, step, all_logits, n_pad,
       graph_fell, moe_host, counts */
#undef RANK_STEP_ONE

int64_t rank_step_words(const rank_step *m) {
    int64_t n = RANK_STEP_HDR;
#define RANK_STEP_LEN(name, type) n += (int64_t)m->n_##name * (int64_t)(sizeof(type) / 4);
    RANK_STEP_SECTIONS(RANK_STEP_LEN)
#undef RANK_STEP_LEN
    return n;
}

void rank_step_encode(const rank_step *m, int32_t *out) {
    int32_t *w = out;
    *w++ = m->group, *w++ = m->step, *w++ = m->all_logits, *w++ = m->n_pad, *w++ = m->graph_fell;
    *w++ = m->moe_host;
#define RANK_STEP_COUNT(name, type) *w++ = m->n_##name;
    RANK_STEP_SECTIONS(RANK_STEP_COUNT)
#undef RANK_STEP_COUNT
#define RANK_STEP_PUT(name, type)                                                                  \
    if (m->n_##name > 0) memcpy(w, m->name, (size_t)m->n_##name * sizeof(type));                   \
    w += (size_t)m->n_##name * (sizeof(type) / 4);
    RANK_STEP_SECTIONS(RANK_STEP_PUT)
#undef RANK_STEP_PUT
}

k3_status rank_step_decode(const int32_t *in, int64_t n, rank_step *m, const char *who) {
    memset(m, 0, sizeof *m);
    if (n < RANK_STEP_HDR)
        return K3_ERR(K3_ERR_FORMAT, "step meta from %s: %lld words, less than its header (%d)",
                      who, (long long)n, (int)RANK_STEP_HDR);
    const int32_t *w = in;
    m->group = *w++, m->step = *w++, m->all_logits = *w++, m->n_pad = *w++, m->graph_fell = *w++;
    m->moe_host = *w++;
    int64_t len = RANK_STEP_HDR;
    bool bad = false;
#define RANK_STEP_COUNT(name, type)                                                                \
    m->n_##name = *w++;                                                                            \
    bad |= m->n_##name < 0;                                                                        \
    len += (int64_t)m->n_##name * (int64_t)(sizeof(type) / 4);
    RANK_STEP_SECTIONS(RANK_STEP_COUNT)
#undef RANK_STEP_COUNT
    if (bad || len != n)
        return K3_ERR(K3_ERR_FORMAT,
                      "step meta from %s: section counts (%d sequences, %d freed, %d forks, %d "
                      "evictions, %d hits, %d tokens, %d targets) make %lld words, not %lld",
                      who, m->n_seqs, m->n_freed, m->n_forks, m->n_evicts, m->n_hits, m->n_tokens,
                      m->n_targets, (long long)len, (long long)n);
#define RANK_STEP_GET(name, type)                                                                  \
    m->name = m->n_##name > 0 ? (const type *)(const void *)w : NULL;                              \
    w += (size_t)m->n_##name * (sizeof(type) / 4);
    RANK_STEP_SECTIONS(RANK_STEP_GET)
#undef RANK_STEP_GET
    return K3_OK;
}

/* ---- the wire (wire.h) --------------------------------------------------------------------- */
k3_status rank_post_step(rank_ctx *r, int peer, k3_msg_kind kind, k3_wire_step h,
                         const rank_step *m, const k3_f32_seg *seg, int n_seg) {
    const int64_t words = rank_step_words(m);
    if (words > INT32_MAX)
        RTRY(r, K3_ERR(K3_ERR_INTERNAL, "step meta of %lld words", (long long)words));
    h.magic = K3_WIRE_MAGIC;
    h.version = K3_WIRE_VERSION;
    h.kind = (uint32_t)kind;
    h.n_meta = (int32_t)words;
    h.pad = 0;
    size_t nb = sizeof h + (size_t)words * sizeof(int32_t);
    if (nb > r->wire_cap) {
        k3_free(r->wire);
        r->wire = NULL;
        r->wire_cap = 0;
        RTRY(r, k3_alloc((void **)&r->wire, nb, "step message"));
        r->wire_cap = nb;
    }
    memcpy(r->wire, &h, sizeof h);
    rank_step_encode(m, (int32_t *)(void *)(r->wire + sizeof h));
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
    if (h.magic != K3_WIRE_MAGIC || h.version != K3_WIRE_VERSION || h.kind != (uint32_t)kind ||
        h.n_meta < 0 || m.n_meta_bytes != (int64_t)(sizeof h + (size_t)h.n_meta * sizeof(int32_t)))
        RTRY(r, K3_ERR(K3_ERR_FORMAT,
                       "step message from rank %d: magic %08x (want %08x), wire version %u (want "
                       "%u), kind %u (want %d), %d meta in %lld bytes",
                       m.src, h.magic, K3_WIRE_MAGIC, h.version, K3_WIRE_VERSION, h.kind, (int)kind,
                       h.n_meta, (long long)m.n_meta_bytes));
    *out = (step_msg){.h = h, .src = m.src, .f32 = m.f32, .n_f32 = m.n_f32, .n_bytes = m.n_bytes};
    snprintf(out->who, sizeof out->who, "rank %d", m.src);
    RTRY(r, rank_step_decode((const int32_t *)(const void *)((const uint8_t *)m.meta + sizeof h),
                             h.n_meta, &out->st, out->who));
    return K3_OK;
}
