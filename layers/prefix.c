/* prefix.c — the stage's side of the prefix cache (k3_layers.h "Prefix cache"): holders of the
 * paged cache's blocks and the snapshot pool of KDA + short-conv states.
 *
 * Owns: nothing but bookkeeping on the stage's pools (stage.c allocates them). The index that
 * decides what is cached, shared and evicted lives on rank 0 (rank/prefix_cache.c); every stage
 * applies its decisions through these calls in the order the step messages carry them.
 * Invariants: blk_ref[b] counts the block tables and the cache entries that name b; a block is on
 * the free list exactly when blk_ref[b] == 0. A restored sequence names only full blocks below its
 * position, so no shared block is written again; a fork (k3_seq_state_fork) shares the full blocks
 * and copies the partial last one, which both sequences go on writing. */
#include "layers_internal.h"

void k3_layers_block_drop(k3_stage *s, int32_t blk) {
    K3_ASSERT(blk >= 0 && blk < s->n_blocks && s->blk_ref[blk] > 0);
    if (--s->blk_ref[blk] == 0) s->free_blk[s->n_free++] = blk;
}

int32_t k3_seq_state_block(const k3_seq_state *st, int j) {
    return j >= 0 && j < st->n_blk ? st->blk[j] : -1;
}

static k3_status check_blk(const k3_stage *s, int32_t blk, const char *what) {
    if (blk < 0 || blk >= s->n_blocks || s->blk_ref[blk] <= 0)
        return K3_ERR(K3_ERR_STATE, "prefix cache: %s block %d (of %d) that is not in use", what,
                      blk, s->n_blocks);
    return K3_OK;
}

k3_status k3_stage_block_hold(k3_stage *s, int32_t blk) {
    K3_TRY(check_blk(s, blk, "hold of"));
    s->blk_ref[blk]++;
    return K3_OK;
}

k3_status k3_stage_block_drop(k3_stage *s, int32_t blk) {
    K3_TRY(check_blk(s, blk, "drop of"));
    k3_layers_block_drop(s, blk);
    return K3_OK;
}

int k3_stage_block_holders(const k3_stage *s, int32_t blk) {
    return blk >= 0 && blk < s->n_blocks ? s->blk_ref[blk] : 0;
}

int k3_stage_n_snapshots(const k3_stage *s) {
    return s->n_snaps;
}

size_t k3_stage_snapshot_bytes(const k3_stage *s) {
    return (size_t)(s->conv_slot + s->S_slot) * sizeof(float);
}

/* Copy one slot's states to (save) or from (restore) snapshot snap: two stream-ordered copies,
   the conv range then the recurrent range (slot-major pools: each is one contiguous range). */
static k3_status snap_copy(k3_stage *s, int slot, int snap, bool save) {
    if (snap < 0 || snap >= s->n_snaps)
        return K3_ERR(K3_ERR_STATE, "prefix cache: snapshot %d of %d", snap, s->n_snaps);
    k3_backend *be = s->be;
    float *sp = s->snap_pool + (size_t)snap * (size_t)(s->conv_slot + s->S_slot);
    float *conv = s->conv_pool + (size_t)slot * (size_t)s->conv_slot;
    float *rec = s->S_pool + (size_t)slot * (size_t)s->S_slot;
    if (s->conv_slot > 0)
        K3_TRY(save ? be->ops->copy2d(be, sp, s->conv_slot, conv, s->conv_slot, 1, s->conv_slot)
                    : be->ops->copy2d(be, conv, s->conv_slot, sp, s->conv_slot, 1, s->conv_slot));
    if (s->S_slot > 0)
        K3_TRY(
            save ? be->ops->copy2d(be, sp + s->conv_slot, s->S_slot, rec, s->S_slot, 1, s->S_slot)
                 : be->ops->copy2d(be, rec, s->S_slot, sp + s->conv_slot, s->S_slot, 1, s->S_slot));
    return K3_OK;
}

k3_status k3_stage_snapshot(k3_stage *s, const k3_seq_state *st, int snap) {
    if (st->s != s) return K3_ERR(K3_ERR_ARG, "prefix cache: a sequence of another stage");
    if (st->pos % K3_KV_BLOCK != 0)
        return K3_ERR(K3_ERR_STATE, "prefix cache: snapshot at position %lld, not a block boundary",
                      (long long)st->pos);
    if (s->conv_slot + s->S_slot == 0) return K3_OK; /* no KDA layers here */
    return snap_copy(s, st->slot, snap, true);
}

k3_status k3_seq_state_restore(k3_seq_state *st, int64_t pos, const int32_t *blocks, int snap) {
    k3_stage *s = st->s;
    if (st->pos != 0 || st->n_blk != 0)
        return K3_ERR(K3_ERR_STATE, "prefix cache: restore into a sequence at position %lld",
                      (long long)st->pos);
    if (pos < 0 || pos % K3_KV_BLOCK != 0 || pos > st->max_ctx)
        return K3_ERR(K3_ERR_STATE,
                      "prefix cache: restore at position %lld (blocks of %d, max %lld)",
                      (long long)pos, K3_KV_BLOCK, (long long)st->max_ctx);
    const int n = (int)(pos / K3_KV_BLOCK);
    if (s->n_mla > 0) {
        if (!blocks && n > 0) return K3_ERR(K3_ERR_ARG, "prefix cache: restore without blocks");
        for (int j = 0; j < n; j++) K3_TRY(check_blk(s, blocks[j], "restore with"));
        for (int j = 0; j < n; j++) s->blk_ref[blocks[j]]++, st->blk[j] = blocks[j];
        st->n_blk = n;
    }
    if (s->conv_slot + s->S_slot > 0 && pos > 0) K3_TRY(snap_copy(s, st->slot, snap, false));
    st->pos = pos;
    return K3_OK;
}

k3_status k3_seq_state_fork(k3_seq_state *dst, const k3_seq_state *src) {
    k3_stage *s = dst->s;
    if (src->s != s || src == dst)
        return K3_ERR(K3_ERR_ARG, "fork: a sequence of another stage, or itself");
    if (src->pos > dst->max_ctx)
        return K3_ERR(K3_ERR_STATE, "fork: position %lld past the child's max_ctx %lld",
                      (long long)src->pos, (long long)dst->max_ctx);
    k3_seq_state_release(dst);
    const int full = (int)(src->pos / K3_KV_BLOCK);
    const bool part = src->pos % K3_KV_BLOCK != 0;
    if (s->n_mla > 0) {
        if (part && s->n_free < 1)
            return K3_ERR(K3_ERR_NOMEM,
                          "fork: the paged MLA cache is full (%d blocks): no block for the copy "
                          "of the partial one",
                          s->n_blocks);
        for (int j = 0; j < full; j++) K3_TRY(check_blk(s, src->blk[j], "fork of"));
        for (int j = 0; j < full; j++) s->blk_ref[src->blk[j]]++, dst->blk[j] = src->blk[j];
        dst->n_blk = full;
        if (part) { /* copy-on-write: the child writes other tokens into the rest of it */
            const int32_t b = s->free_blk[--s->n_free];
            s->blk_ref[b] = 1;
            dst->blk[dst->n_blk++] = b;
            const int64_t bf = (int64_t)K3_KV_BLOCK * (s->c->kv_lora_rank + s->c->qk_rope_head_dim);
            const int64_t stride = (int64_t)s->n_blocks * bf;
            K3_TRY(s->be->ops->copy2d(s->be, s->kv_pool + (int64_t)b * bf, stride,
                                      s->kv_pool + (int64_t)src->blk[full] * bf, stride, s->n_mla,
                                      bf));
        }
    }
    k3_backend *be = s->be;
    if (s->conv_slot > 0)
        K3_TRY(be->ops->copy2d(be, s->conv_pool + (size_t)dst->slot * s->conv_slot, s->conv_slot,
                               s->conv_pool + (size_t)src->slot * s->conv_slot, s->conv_slot, 1,
                               s->conv_slot));
    if (s->S_slot > 0)
        K3_TRY(be->ops->copy2d(be, s->S_pool + (size_t)dst->slot * s->S_slot, s->S_slot,
                               s->S_pool + (size_t)src->slot * s->S_slot, s->S_slot, 1, s->S_slot));
    dst->pos = src->pos;
    return K3_OK;
}

k3_status k3_seq_state_read(const k3_seq_state *st, float *out) {
    const k3_stage *s = st->s;
    if (s->conv_slot > 0)
        K3_TRY(k3_backend_download(s->be, out, s->conv_pool + (size_t)st->slot * s->conv_slot,
                                   (size_t)s->conv_slot * sizeof(float)));
    if (s->S_slot > 0)
        K3_TRY(k3_backend_download(s->be, out + s->conv_slot,
                                   s->S_pool + (size_t)st->slot * s->S_slot,
                                   (size_t)s->S_slot * sizeof(float)));
    return K3_OK;
}
