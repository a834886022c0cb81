/* graph.c — a decode step of a stage as one CUDA graph (docs/DESIGN.md §5, "What a graph holds").
 *
 * Owns: the pad rows' slot and cache block, the step buffer of a padded decode batch, and the
 * graphs of the stage, one per padded size. Does not own: the ops (stage.c's
 * k3_layers_forward_ops, the same code an eager step runs), the decision to capture (rank 0's,
 * carried by the step message: rank/worker.c), the capture itself (the backend's).
 * A graph's inputs live at fixed addresses: the step buffer (descriptor of n_pad sequences with
 * block tables max_blocks wide and max_ctx = the stage's, so the kernels' launch shapes are the
 * same at every step of n_pad; the non-finite flags; the token ids), the activation and the
 * logits. They are uploaded before the launch and read after it; the graph holds no host sync. */
#include "layers_internal.h"

#include <stdio.h>

k3_status k3_layers_graph_init(k3_stage *s) {
    const int n = s->n_slots + 1;
    K3_TRY(k3_calloc((void **)&s->graph, (size_t)n * sizeof *s->graph, "captured steps"));
    K3_TRY(k3_calloc((void **)&s->graph_bank_in, (size_t)n * sizeof(int), "captured steps"));
    K3_TRY(k3_calloc((void **)&s->graph_bank_out, (size_t)n * sizeof(int), "captured steps"));
    K3_TRY(k3_calloc((void **)&s->graph_off, (size_t)n * sizeof(bool), "captured steps"));
    /* the last slot and the last block: never handed out (the free list keeps its order, so the
       sequences get the blocks they would get without graphs) */
    s->pad_slot = s->n_slots - 1;
    s->slot_used[s->pad_slot] = true;
    if (s->n_blocks > 0) {
        K3_ASSERT(s->n_free == s->n_blocks && s->free_blk[0] == s->n_blocks - 1);
        s->pad_blk = s->free_blk[0];
        memmove(s->free_blk, s->free_blk + 1, (size_t)(s->n_free - 1) * sizeof(int32_t));
        s->n_free--;
        s->blk_ref[s->pad_blk] = 1;
    }
    return K3_OK;
}

void k3_layers_graph_free(k3_stage *s) {
    if (s->graph)
        for (int i = 0; i <= s->n_slots; i++) k3_backend_graph_destroy(s->be, s->graph[i]);
    k3_free(s->graph), k3_free(s->graph_bank_in), k3_free(s->graph_bank_out);
    k3_free(s->graph_off);
    s->graph = NULL;
}

/* The padded batch into the step buffer (one upload, before the graph): the real sequences'
   blocks taken, then n_pad rows: the batch's, and pad rows (token 0 at position 0 in the pad
   slot, whose block table names the pad block). */
static k3_status upload_padded(k3_stage *s, const k3_batch *b, int n_pad, k3_seqs *sq,
                               int32_t **flags, int32_t **ids) {
    K3_TRY(k3_layers_take_blocks(s, b));
    const int n = b->n_seqs, mb = s->max_blocks;
    for (int i = 0; i < n_pad; i++) {
        const k3_seq_state *st = i < n ? b->states[i] : NULL;
        s->h_ntok[i] = 1;
        s->h_pos[i] = st ? (int32_t)st->pos : 0;
        s->h_slot[i] = st ? st->slot : s->pad_slot;
        int32_t *row = s->h_blk + (size_t)i * (size_t)mb;
        int have = 0;
        if (st) {
            memcpy(row, st->blk, (size_t)st->n_blk * sizeof(int32_t));
            have = st->n_blk;
        } else if (s->pad_blk >= 0) {
            row[have++] = s->pad_blk;
        }
        for (int j = have; j < mb; j++) row[j] = -1;
    }
    const size_t nd = k3_seqs_floats(n_pad, mb);
    K3_TRY(k3_seqs_build(n_pad, s->h_ntok, s->h_pos, s->h_slot, mb > 0 ? s->h_blk : NULL, mb,
                         s->step_host, s->step_dev, sq));
    sq->max_ctx = s->max_ctx; /* the launch shapes of every step of n_pad */
    int32_t *hf = s->step_host + nd, *hi = hf + n_pad;
    for (int i = 0; i < n_pad; i++) {
        hf[i] = i < n && b->nonfinite ? b->nonfinite[i] : 0;
        hi[i] = i < n && b->token_ids ? b->token_ids[i] : 0;
    }
    *flags = s->step_dev + nd;
    *ids = s->step_dev + nd + n_pad;
    return k3_backend_upload_async(s->be, s->step_dev, s->step_host,
                                   (nd + 2 * (size_t)n_pad) * sizeof(int32_t));
}

/* Capture the step's ops as the graph of n_pad and launch it; K3_OK with *ok false when the
   capture failed (the graph dropped, the size marked off, act as it was). */
static k3_status capture(k3_stage *s, const k3_seqs *sq, int n_pad, bool nf, bool inject_sync,
                         k3_activ *act, float *logits, int32_t *flags, const int32_t *ids,
                         bool *ok) {
    const int bank_in = act->n_bank;
    const int64_t T_in = act->T;
    K3_TRY(k3_backend_capture_begin(s->be));
    k3_status st = k3_layers_forward_ops(s, sq, nf, act, false, logits, flags, ids);
    char why[512] = "";
    if (st == K3_OK && inject_sync) { /* the test hook: what a per-layer read would do */
        int32_t probe;
        st = k3_backend_download(s->be, &probe, flags, sizeof probe);
    }
    if (st != K3_OK) snprintf(why, sizeof why, "%s", k3_last_error());
    k3_backend_graph *g = NULL;
    const k3_status end = k3_backend_capture_end(s->be, &g);
    if (st == K3_OK && end != K3_OK) snprintf(why, sizeof why, "%s", k3_last_error());
    if (st != K3_OK || end != K3_OK) {
        k3_backend_graph_destroy(s->be, g);
        s->graph_off[n_pad] = true;
        act->n_bank = bank_in;
        act->T = T_in;
        *ok = false;
        K3_LOGW("a decode step of %d rows could not be captured as a CUDA graph (%s); it runs "
                "eagerly, as every later step of that size",
                n_pad, why);
        return K3_OK;
    }
    s->graph[n_pad] = g;
    s->graph_bank_in[n_pad] = bank_in;
    s->graph_bank_out[n_pad] = act->n_bank;
    *ok = true;
    return k3_backend_graph_launch(s->be, g);
}

/* The step's ops: replayed, captured and launched, or eager (a size whose capture failed). */
static k3_status run_ops(k3_stage *s, const k3_seqs *sq, int n_pad, bool nf, bool inject_sync,
                         k3_activ *act, float *logits, int32_t *flags, const int32_t *ids,
                         bool *fell_back) {
    if (s->graph[n_pad]) {
        if (!s->p.first && act->n_bank != s->graph_bank_in[n_pad]) /* the first stage starts
                                                                      with none */
            return K3_ERR(K3_ERR_STATE,
                          "captured step of %d rows: the activation has %d AttnRes slabs, the "
                          "graph was captured with %d",
                          n_pad, act->n_bank, s->graph_bank_in[n_pad]);
        K3_TRY(k3_backend_graph_launch(s->be, s->graph[n_pad]));
        act->n_bank = s->graph_bank_out[n_pad];
        if (s->p.first) act->T = n_pad;
        return K3_OK;
    }
    if (!s->graph_off[n_pad] && !s->tap) {
        bool ok = false;
        K3_TRY(capture(s, sq, n_pad, nf, inject_sync, act, logits, flags, ids, &ok));
        if (ok) return K3_OK;
        *fell_back = true;
        K3_TRY(k3_backend_errors_defer(s->be, true)); /* the failed capture's checks dropped */
    }
    return k3_layers_forward_ops(s, sq, nf, act, false, logits, flags, ids);
}

k3_status k3_stage_forward_graph(k3_stage *s, const k3_batch *b, int n_pad, bool inject_sync,
                                 k3_activ *act, float *logits, bool *fell_back) {
    *fell_back = false;
    s->logits_fetched = false;
    float *logits_host = s->p.last ? s->logits_host : NULL;
    if (!s->graph || !k3_backend_has_graphs(s->be))
        return K3_ERR(K3_ERR_ARG, "captured step: the stage was made without graphs");
    if (!b || b->n_seqs < 1 || n_pad < b->n_seqs || n_pad > s->n_slots - 1 || n_pad > s->T_max)
        return K3_ERR(K3_ERR_ARG, "captured step: %d sequences padded to %d (of %d slots)",
                      b ? b->n_seqs : 0, n_pad, s->n_slots - 1);
    for (int i = 0; i < b->n_seqs; i++)
        if (b->n_tokens[i] != 1)
            return K3_ERR(K3_ERR_ARG, "captured step: sequence %d has %d tokens (a decode step)", i,
                          b->n_tokens[i]);
    if (s->p.last && !logits)
        return K3_ERR(K3_ERR_ARG, "forward: last stage needs a logits buffer");
    if (!s->p.first && act->T != n_pad)
        return K3_ERR(K3_ERR_ARG, "captured step: the activation has %lld rows, not %d",
                      (long long)act->T, n_pad);
    /* the usual checks, on the real rows (the activation's first T of n_pad) */
    k3_activ real = *act;
    real.T = b->n_seqs;
    int64_t T = 0;
    K3_TRY(k3_layers_check_batch(s, b, &real, &T));
    K3_TRY(k3_backend_errors_defer(s->be, true));
    k3_seqs sq;
    int32_t *flags = NULL, *ids = NULL;
    const bool nf = b->nonfinite != NULL;
    k3_status st = upload_padded(s, b, n_pad, &sq, &flags, &ids);
    if (st == K3_OK)
        st = run_ops(s, &sq, n_pad, nf, inject_sync, act, logits, flags, ids, fell_back);
    if (st == K3_OK)
        for (int i = 0; i < b->n_seqs; i++) b->states[i]->pos += 1;
    /* the one read of the step: the flags with the deferred checks (and, asked for, the
       sequences' logits rows: copies queued behind the graph, then one wait) */
    if (st == K3_OK) st = k3_backend_errors_fetch(s->be);
    const size_t nf_bytes = (size_t)b->n_seqs * sizeof(int32_t);
    if (st == K3_OK && logits_host) {
        if (nf) st = k3_backend_download_async(s->be, s->h_nf, flags, nf_bytes);
        if (st == K3_OK)
            st = k3_backend_download_async(s->be, logits_host, logits,
                                           (size_t)b->n_seqs * (size_t)s->c->vocab_size *
                                               sizeof(float));
        if (st == K3_OK) st = k3_backend_sync(s->be);
        s->logits_fetched = st == K3_OK;
    } else if (st == K3_OK && nf) {
        st = k3_backend_download(s->be, s->h_nf, flags, nf_bytes);
    }
    if (st == K3_OK && nf) memcpy(b->nonfinite, s->h_nf, nf_bytes);
    if (st == K3_OK) st = k3_backend_errors_verdict(s->be);
    const k3_status off = k3_backend_errors_defer(s->be, false);
    return st != K3_OK ? st : off;
}
