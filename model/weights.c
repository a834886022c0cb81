/* weights.c — load the tensors a rank owns into memory (k3_weights_load).
 *
 * Selection: layers [layer_begin, layer_end), the embedding and/or the head side, and the routed
 * experts for which expert_owned() says yes. Every selected catalogue entry must exist in the
 * checkpoint with the catalogue's dtype and shape (K3_ERR_MISSING / K3_ERR_SHAPE naming it).
 * Storage: one 64-byte-aligned arena sized up front; tensors keep their stored format (BF16 stays
 * raw bf16, F32 stays F32, a routed expert becomes one K3_DT_MXFP4 tensor whose data is the
 * weight_packed bytes and whose scale is the weight_scale bytes). The AttnRes pairs
 * res_norm [D] and res_proj [1, D] are fused at load into one F32 score vector
 * w = res_norm ⊙ res_proj (products of two bf16 values, exact in f32).
 * Reads go through k3_ckpt_read_many (sel->n_readers pieces in flight, O_DIRECT with sel->direct)
 * in (shard, offset) order, reported through sel->progress. A backend whose memory the host
 * cannot touch gets its arena first and every piece is uploaded as it arrives, through the
 * reader's bounded staging (2 x n_readers pieces of K3_LOAD_PIECE_BYTES): the host never holds
 * the rank's weights, only the staging and the AttnRes halves being fused. With sel->map (host
 * memory) the shard files are mapped instead (ckpt_map.c): a tensor points into its file's pages,
 * populated here, and the arena holds only the fused AttnRes scores and any misaligned tensor. */
#include "k3_model.h"

#include <stdlib.h>

#include "k3_kernels.h"
#include "model_internal.h"

struct k3_weights {
    k3_config cfg; /* copy: the view points here */
    k3_weights_view view;
    k3_layer_w *layers; /* [n_layers] */
    uint8_t *arena;     /* all tensor bytes (with a shared dense region: the routed experts) */
    uint64_t arena_bytes;
    uint64_t dense_bytes; /* in k3_load_sel.dense (not owned), 0 without */
    k3_backend *be;       /* owner of the arena (NULL: k3_alloc) */
    k3_ckpt_map *maps;    /* [n_maps] with sel->map: the shard files (unmapped at destroy) */
    int n_maps;
    uint64_t mapped_bytes; /* of the tensors in the maps (k3_weights_mapped) */
};

typedef struct job {
    const k3_ckpt_tensor *src;
    void *dst;
    k3_tensor *t; /* the tensor whose data (part 0) or scale (part 1) this is; NULL: staged */
    int part;
    bool mapped; /* dst points into the shard's mapping: populated, not read */
} job;

typedef struct fuse {
    k3_tensor *t;         /* the F32 score */
    const uint16_t *norm; /* staged bf16 res_norm [D] */
    const uint16_t *proj; /* staged bf16 res_proj [1, D] */
} fuse;

/* Device loads: each staged piece into the backend's arena (k3_read_opts.upload). */
typedef struct upload_ctx {
    k3_backend *be;
    k3_status (*progress)(void *ctx, uint64_t done, uint64_t total);
    void *ctx;
} upload_ctx;
static k3_status upload_piece(void *ctx, void *dst, const void *src, size_t n) {
    return k3_backend_upload(((upload_ctx *)ctx)->be, dst, src, n);
}
static k3_status progress_fwd(void *ctx, uint64_t done, uint64_t total) {
    const upload_ctx *u = ctx;
    return u->progress(u->ctx, done, total);
}

static int job_cmp(const void *a, const void *b) {
    const job *x = a, *y = b;
    if (x->src->shard != y->src->shard) return x->src->shard < y->src->shard ? -1 : 1;
    return x->src->offset < y->src->offset ? -1 : (x->src->offset > y->src->offset);
}

/* Where a catalogue entry lands. *part: 0 = data, 1 = MXFP4 scale, 2 = AttnRes norm half,
 * 3 = AttnRes proj half (both staged, then fused into the F32 score). */
static int part_of(const k3_tensor_spec *s) {
    switch (s->role) {
    case K3_R_OUT_RES_NORM:
    case K3_R_ATTN_RES_NORM:
    case K3_R_MLP_RES_NORM:
        return 2;
    case K3_R_OUT_RES_PROJ:
    case K3_R_ATTN_RES_PROJ:
    case K3_R_MLP_RES_PROJ:
        return 3;
    case K3_R_EXP_W1_SCALE:
    case K3_R_EXP_W2_SCALE:
    case K3_R_EXP_W3_SCALE:
        return 1;
    default:
        return 0;
    }
}

static k3_tensor *slot(k3_weights *w, const k3_tensor_spec *s, int *part) {
    *part = part_of(s); /* 1: an expert scale, 2/3: AttnRes norm/proj halves */
    k3_weights_view *v = &w->view;
    k3_layer_w *L = s->layer >= 0 ? &w->layers[s->layer] : NULL;
    k3_expert_w *E = (L && s->expert >= 0) ? &L->experts[s->expert] : NULL;
    switch (s->role) {
    case K3_R_EMBED:
        return &v->embed;
    case K3_R_FINAL_NORM:
        return &v->final_norm;
    case K3_R_OUT_RES_NORM:
        return &v->out_res_score;
    case K3_R_OUT_RES_PROJ:
        return &v->out_res_score;
    case K3_R_LM_HEAD:
        return &v->lm_head;
    case K3_R_INPUT_NORM:
        return &L->input_norm;
    case K3_R_POST_NORM:
        return &L->post_attn_norm;
    case K3_R_ATTN_RES_NORM:
        return &L->attn_res_score;
    case K3_R_ATTN_RES_PROJ:
        return &L->attn_res_score;
    case K3_R_MLP_RES_NORM:
        return &L->mlp_res_score;
    case K3_R_MLP_RES_PROJ:
        return &L->mlp_res_score;
    case K3_R_KDA_Q:
        return &L->q_proj;
    case K3_R_KDA_K:
        return &L->k_proj;
    case K3_R_KDA_V:
        return &L->v_proj;
    case K3_R_KDA_QCONV:
        return &L->q_conv;
    case K3_R_KDA_KCONV:
        return &L->k_conv;
    case K3_R_KDA_VCONV:
        return &L->v_conv;
    case K3_R_KDA_FA:
        return &L->f_a;
    case K3_R_KDA_FB:
        return &L->f_b;
    case K3_R_KDA_DT_BIAS:
        return &L->dt_bias;
    case K3_R_KDA_A_LOG:
        return &L->a_log;
    case K3_R_KDA_B:
        return &L->b_proj;
    case K3_R_KDA_G:
    case K3_R_MLA_G:
        return &L->g_proj;
    case K3_R_KDA_GA:
        return &L->g_a;
    case K3_R_KDA_GB:
        return &L->g_b;
    case K3_R_KDA_O_NORM:
        return &L->o_norm;
    case K3_R_KDA_O:
    case K3_R_MLA_O:
        return &L->o_proj;
    case K3_R_MLA_QA:
        return &L->q_a_proj;
    case K3_R_MLA_QA_NORM:
        return &L->q_a_norm;
    case K3_R_MLA_QB:
        return &L->q_b_proj;
    case K3_R_MLA_Q:
        return &L->q_proj_mla;
    case K3_R_MLA_KVA:
        return &L->kv_a_proj;
    case K3_R_MLA_KVA_NORM:
        return &L->kv_a_norm;
    case K3_R_MLA_KVB:
        return &L->kv_b_proj;
    case K3_R_FFN_GATE:
        return &L->gate_proj;
    case K3_R_FFN_UP:
        return &L->up_proj;
    case K3_R_FFN_DOWN:
        return &L->down_proj;
    case K3_R_ROUTER:
        return &L->router;
    case K3_R_ROUTER_BIAS:
        return &L->router_bias;
    case K3_R_LAT_DOWN:
        return &L->lat_down;
    case K3_R_LAT_NORM:
        return &L->lat_norm;
    case K3_R_LAT_UP:
        return &L->lat_up;
    case K3_R_SH_GATE:
        return &L->sh_gate;
    case K3_R_SH_UP:
        return &L->sh_up;
    case K3_R_SH_DOWN:
        return &L->sh_down;
    case K3_R_EXP_W1_SCALE:
        return &E->w1;
    case K3_R_EXP_W2_SCALE:
        return &E->w2;
    case K3_R_EXP_W3_SCALE:
        return &E->w3;
    case K3_R_EXP_W1_PACKED:
    case K3_R_EXP_W1:
        return &E->w1;
    case K3_R_EXP_W2_PACKED:
    case K3_R_EXP_W2:
        return &E->w2;
    case K3_R_EXP_W3_PACKED:
    case K3_R_EXP_W3:
        return &E->w3;
    default:
        return NULL;
    }
}

static bool selected(const k3_config *c, const k3_load_sel *sel, const k3_tensor_spec *s) {
    if (s->kind == K3_TK_GLOBAL) {
        if (s->role == K3_R_EMBED) return sel->embed || (sel->head && c->tie_word_embeddings);
        return sel->head;
    }
    if (s->layer < sel->layer_begin || s->layer >= sel->layer_end) return false;
    if (s->kind == K3_TK_EXPERT && sel->expert_owned)
        return sel->expert_owned(sel->ctx, s->layer, s->expert);
    return true;
}

static uint64_t align64(uint64_t x) {
    return (x + 63) & ~(uint64_t)63;
}

/* The bytes a selected tensor takes in its region: the AttnRes norm half stands for the fused
 * F32 score (the proj half takes none); everything else as stored. */
static uint64_t placed_bytes(const k3_config *c, const k3_tensor_spec *s, int part) {
    if (part == 2) return align64((uint64_t)c->hidden_size * 4);
    if (part == 3) return 0;
    return align64((uint64_t)k3_tensor_spec_bytes(s));
}

k3_status k3_weights_dense_bytes(const k3_config *c, const k3_load_sel *sel, uint64_t *out,
                                 uint64_t *stored) {
    *out = 0;
    if (stored) *stored = 0;
    const int64_t n = k3_catalog(c, NULL, 0);
    k3_tensor_spec *specs = NULL;
    K3_TRY(k3_alloc((void **)&specs, (size_t)n * sizeof *specs, "catalogue"));
    k3_catalog(c, specs, n);
    for (int64_t i = 0; i < n; i++)
        if (specs[i].kind != K3_TK_EXPERT && selected(c, sel, &specs[i])) {
            *out += placed_bytes(c, &specs[i], part_of(&specs[i]));
            if (stored) *stored += (uint64_t)k3_tensor_spec_bytes(&specs[i]);
        }
    k3_free(specs);
    return K3_OK;
}

static k3_status check_src(const k3_ckpt *ck, const k3_tensor_spec *s, const k3_ckpt_tensor **out) {
    const k3_ckpt_tensor *t = k3_ckpt_find(ck, s->name);
    if (!t) return K3_ERR(K3_ERR_MISSING, "checkpoint lacks tensor %s", s->name);
    bool ok = t->dtype == s->dtype && t->ndim == s->ndim;
    for (int d = 0; ok && d < s->ndim; d++) ok = t->shape[d] == s->shape[d];
    if (!ok)
        return K3_ERR(K3_ERR_SHAPE,
                      "%s: tensor %s: stored as %s with %d dims [%lld, ...], the "
                      "config implies %s [%lld, ...] (%d dims)",
                      k3_ckpt_shard_path(ck, t->shard), s->name, k3_dtype_name(t->dtype), t->ndim,
                      (long long)t->shape[0], k3_dtype_name(s->dtype), (long long)s->shape[0],
                      s->ndim);
    *out = t;
    return K3_OK;
}

/* With sel->map: a tensor's data or scale stays in its file's pages when its offset suits its
 * element type (the AttnRes halves are fused into the arena either way). */
static bool mappable(const k3_load_sel *sel, const k3_ckpt_tensor *t, int part) {
    const size_t el = K3_MAX(k3_dtype_size(t->dtype), (size_t)1);
    return sel->map && part < 2 && t->offset % el == 0;
}

/* A mapped load's progress: the reads' own count (k3_ckpt_read_many), then the populated bytes
 * after them (before = the bytes read), both against every byte of the load. */
typedef struct map_progress {
    k3_status (*progress)(void *ctx, uint64_t done, uint64_t total);
    void *ctx;
    uint64_t before, total;
} map_progress;
static k3_status progress_of_all(void *ctx, uint64_t done, uint64_t total) {
    (void)total;
    const map_progress *m = ctx;
    return m->progress(m->ctx, m->before + done, m->total);
}

/* Fault the mapped jobs' bytes in: file by file in offset order, tensors closer than a piece
 * merged into ranges of at most 4 pieces, which the readers take one at a time. */
static k3_status populate(k3_ckpt *ck, k3_weights *w, const job *jobs, int64_t nj, map_progress *mp,
                          int readers) {
    k3_map_range *r = NULL;
    K3_TRY(k3_alloc((void **)&r, (size_t)K3_MAX(nj, 1) * sizeof *r, "populate ranges"));
    int64_t nr = 0;
    uint64_t all = 0;
    for (int64_t j = 0; j < nj;) {
        if (!jobs[j].mapped) {
            j++;
            continue;
        }
        const k3_ckpt_tensor *t = jobs[j].src;
        k3_map_range x = {t->shard, t->offset, t->n_bytes, t->n_bytes};
        for (j++; j < nj && jobs[j].mapped && jobs[j].src->shard == t->shard &&
                  jobs[j].src->offset <= x.off + x.n + K3_LOAD_PIECE_BYTES &&
                  x.n < 4 * K3_LOAD_PIECE_BYTES;
             j++) {
            x.n = K3_MAX(x.n, jobs[j].src->offset + jobs[j].src->n_bytes - x.off);
            x.tensor_bytes += jobs[j].src->n_bytes;
        }
        all += x.tensor_bytes;
        r[nr++] = x;
    }
    k3_status st = k3_ckpt_map_populate_many(ck, w->maps, r, nr,
                                             readers > 0 ? readers : K3_LOAD_READERS_DEFAULT,
                                             mp->progress ? progress_of_all : NULL, mp);
    k3_free(r);
    K3_TRY(st);
    k3_ckpt_count_read(ck, all); /* the tensors' bytes, not the gaps between them */
    return K3_OK;
}

k3_status k3_weights_load(k3_ckpt *ck, const k3_config *c, const k3_load_sel *sel,
                          k3_weights **out) {
    *out = NULL;
    if (sel->layer_begin < 0 || sel->layer_end > c->n_layers || sel->layer_begin > sel->layer_end)
        return K3_ERR(K3_ERR_ARG, "load selection: layers [%d, %d) outside 0..%d", sel->layer_begin,
                      sel->layer_end, c->n_layers);
    k3_weights *w = NULL;
    K3_TRY(k3_calloc((void **)&w, sizeof *w, "weights"));
    w->cfg = *c;
    w->view.cfg = &w->cfg;
    int64_t n = k3_catalog(c, NULL, 0);
    k3_tensor_spec *specs = NULL;
    job *jobs = NULL;
    uint8_t *stage = NULL; /* AttnRes halves before fusing */
    k3_status st =
        k3_calloc((void **)&w->layers, (size_t)c->n_layers * sizeof *w->layers, "layers");
    if (st == K3_OK) st = k3_alloc((void **)&specs, (size_t)n * sizeof *specs, "catalogue");
    if (st == K3_OK) st = k3_alloc((void **)&jobs, (size_t)n * sizeof *jobs, "read list");
    if (st != K3_OK) goto fail;
    k3_catalog(c, specs, n);
    w->view.layers = w->layers;
    for (int l = sel->layer_begin; l < sel->layer_end; l++) {
        w->layers[l].present = true;
        if (k3_config_is_moe(c, l) &&
            (st = k3_calloc((void **)&w->layers[l].experts,
                            (size_t)c->n_experts * sizeof(k3_expert_w), "expert table")) != K3_OK)
            goto fail;
    }

    /* a dense region shared with other ranks (host: node memory; device: this device's copy,
       which the caller fills from the reader's): exactly the selection's size */
    const bool share = sel->dense != NULL;
    if (sel->map && (share || (sel->be && sel->be->mem != K3_MEM_HOST))) {
        st = K3_ERR(K3_ERR_ARG, "load selection: mapping the files needs host memory and no "
                                "shared dense region (the page cache is shared already)");
        goto fail;
    }
    if (sel->map &&
        (st = k3_calloc((void **)&w->maps, (size_t)k3_ckpt_n_shards(ck) * sizeof *w->maps,
                        "maps")) != K3_OK)
        goto fail;
    w->n_maps = sel->map ? k3_ckpt_n_shards(ck) : 0;

    /* pass 1: check and size */
    uint64_t bytes = 0, dense_bytes = 0, stage_bytes = 0;
    const k3_ckpt_tensor **src = NULL;
    if ((st = k3_calloc((void **)&src, (size_t)n * sizeof *src, "sources")) != K3_OK) goto fail;
    for (int64_t i = 0; i < n; i++) {
        if (!selected(c, sel, &specs[i])) continue;
        if ((st = check_src(ck, &specs[i], &src[i])) != K3_OK) {
            k3_free(src);
            goto fail;
        }
        const int part = part_of(&specs[i]);
        const bool dense = share && specs[i].kind != K3_TK_EXPERT;
        uint64_t nb = (uint64_t)k3_tensor_spec_bytes(&specs[i]);
        if (part >= 2) stage_bytes += align64(nb);
        if (mappable(sel, src[i], part)) continue; /* in its file's pages */
        *(dense ? &dense_bytes : &bytes) += placed_bytes(c, &specs[i], part);
    }
    if (share && dense_bytes != sel->dense_bytes) {
        k3_free(src);
        st = K3_ERR(K3_ERR_ARG,
                    "load selection: the shared dense region has %llu bytes, the selection's "
                    "dense tensors take %llu",
                    (unsigned long long)sel->dense_bytes, (unsigned long long)dense_bytes);
        goto fail;
    }
    /* device: the arena is backend memory from the start; tensors point into it, and the reads
       reach it through the staging (device requests) */
    const bool device = sel->be && !k3_backend_host_visible(sel->be);
    if (sel->be && sel->be->mem == K3_MEM_HOST) { /* plain host memory: not zeroed first (every
                                                     tensor byte is read into it); the backend's
                                                     free is k3_free */
        w->be = sel->be;
        st = k3_alloc_large((void **)&w->arena, bytes ? bytes : 64, "weights");
    } else if (sel->be) {
        w->be = sel->be;
        st = k3_backend_alloc(sel->be, bytes ? bytes : 64, "weights", (void **)&w->arena);
    } else {
        st = k3_alloc_large((void **)&w->arena, bytes ? bytes : 64, "weights");
    }
    if (st != K3_OK || (st = k3_alloc((void **)&stage, stage_bytes ? stage_bytes : 64,
                                      "AttnRes staging")) != K3_OK) {
        k3_free(src);
        goto fail;
    }
    w->arena_bytes = bytes;
    w->dense_bytes = dense_bytes;

    /* pass 2: place, describe, list reads (a dense tensor of a region another rank reads: placed
       and described only) */
    uint64_t at = 0, dat = 0, sat = 0;
    int64_t nj = 0;
    fuse fz[2 * K3_MAX_LAYERS + 1];
    int nf = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!src[i]) continue;
        const k3_tensor_spec *s = &specs[i];
        int part;
        k3_tensor *t = slot(w, s, &part);
        uint64_t nb = (uint64_t)k3_tensor_spec_bytes(s);
        void *dst;
        const bool dense = share && s->kind != K3_TK_EXPERT, read = !dense || sel->dense_reader;
        const bool in_map = mappable(sel, src[i], part); /* data or scale left in the file */
        uint8_t *const base = dense ? (uint8_t *)sel->dense : w->arena;
        uint64_t *const pos = dense ? &dat : &at;
        if (s->kind == K3_TK_EXPERT) w->layers[s->layer].experts[s->expert].present = true;
        if (sel->be) t->mem = sel->be->mem;
        if (part >= 2) {
            dst = stage + sat;
            sat += align64(nb);
            int f = 0;
            while (f < nf && fz[f].t != t) f++;
            if (f == nf) {
                fz[nf++] = (fuse){t, NULL, NULL};
                t->dtype = K3_DT_F32;
                t->ndim = 1;
                t->shape[0] = c->hidden_size;
                t->data = base + *pos;
                *pos += align64((uint64_t)c->hidden_size * 4);
            }
            if (part == 2)
                fz[f].norm = dst;
            else
                fz[f].proj = dst;
        } else {
            if (in_map) {
                k3_ckpt_map *m = &w->maps[src[i]->shard];
                if (!m->base && (st = k3_ckpt_map_shard(ck, src[i]->shard, m)) != K3_OK) {
                    k3_free(src);
                    goto fail;
                }
                dst = m->base + src[i]->offset;
                w->mapped_bytes += align64(nb); /* as placed in an arena: the plan's count */
            } else {
                dst = base + *pos;
                *pos += align64(nb);
            }
            if (part == 1) {
                t->scale = dst;
            } else {
                bool mx = s->role == K3_R_EXP_W1_PACKED || s->role == K3_R_EXP_W2_PACKED ||
                          s->role == K3_R_EXP_W3_PACKED;
                t->data = dst;
                t->ndim = s->ndim;
                memcpy(t->shape, s->shape, sizeof t->shape);
                t->dtype = s->dtype;
                if (mx) {
                    t->dtype = K3_DT_MXFP4;
                    t->shape[1] = s->shape[1] * 2; /* logical [out, in] */
                }
            }
        }
        if (read) jobs[nj++] = (job){src[i], dst, part < 2 ? t : NULL, part, in_map};
    }
    if (share && !sel->dense_reader) nf = 0; /* the reader fuses the shared scores */
    k3_free(src);
    qsort(jobs, (size_t)nj, sizeof *jobs, job_cmp);
    uint64_t mapped_total = 0, all_total = 0;
    for (int64_t j = 0; j < nj; j++) {
        all_total += jobs[j].src->n_bytes;
        mapped_total += jobs[j].mapped ? jobs[j].src->n_bytes : 0;
    }
    map_progress mp = {sel->progress, sel->ctx, 0, all_total};
    { /* the reads: staged AttnRes halves to host memory, everything else to the arena */
        k3_read_req *rq = NULL;
        if ((st = k3_alloc((void **)&rq, (size_t)K3_MAX(nj, 1) * sizeof *rq, "read requests")) !=
            K3_OK)
            goto fail;
        int64_t nr = 0;
        for (int64_t j = 0; j < nj; j++)
            if (!jobs[j].mapped)
                rq[nr++] = (k3_read_req){jobs[j].src, jobs[j].dst, device && jobs[j].part < 2};
        k3_read_opts ro = {.n_readers = sel->n_readers,
                           .direct = sel->direct,
                           .progress = sel->progress,
                           .upload = device ? upload_piece : NULL,
                           .ctx = sel->ctx};
        upload_ctx uc = {sel->be, sel->progress, sel->ctx};
        if (device) ro.ctx = &uc, ro.progress = sel->progress ? progress_fwd : NULL;
        if (sel->map) ro.ctx = &mp, ro.progress = sel->progress ? progress_of_all : NULL;
        st = k3_ckpt_read_many(ck, rq, nr, &ro, NULL);
        k3_free(rq);
        if (st != K3_OK) goto fail;
    }
    /* then the mapped tensors, the progress going on from the reads to all of it */
    mp.before = all_total - mapped_total;
    if (sel->map && (st = populate(ck, w, jobs, nj, &mp, sel->n_readers)) != K3_OK) goto fail;
    for (int64_t j = 0; j < nj && sel->on_read; j++)
        if ((st = sel->on_read(sel->ctx, jobs[j].src)) != K3_OK) goto fail;

    /* fuse AttnRes: w = res_norm ⊙ res_proj in F32 (both halves are selected together) */
    if (nf > 0) { /* built in host memory, then to the arena (backend memory or not) */
        float *o = NULL;
        if ((st = k3_alloc((void **)&o, (size_t)c->hidden_size * 4, "AttnRes score")) != K3_OK)
            goto fail;
        for (int f = 0; f < nf && st == K3_OK; f++) {
            K3_ASSERT(fz[f].norm && fz[f].proj);
            for (int64_t d = 0; d < c->hidden_size; d++)
                o[d] = k3_bf16_to_f32(fz[f].norm[d]) * k3_bf16_to_f32(fz[f].proj[d]);
            if (sel->be)
                st = k3_backend_upload(sel->be, fz[f].t->data, o, (size_t)c->hidden_size * 4);
            else
                memcpy(fz[f].t->data, o, (size_t)c->hidden_size * 4);
        }
        k3_free(o);
        if (st != K3_OK) goto fail;
    }
    if (sel->head && c->tie_word_embeddings) w->view.lm_head = w->view.embed;
    k3_free(stage);
    k3_free(jobs);
    k3_free(specs);
    *out = w;
    return K3_OK;
fail:
    k3_free(stage);
    k3_free(jobs);
    k3_free(specs);
    k3_weights_destroy(w);
    return st;
}

const k3_weights_view *k3_weights_get(const k3_weights *w) {
    return w ? &w->view : NULL;
}
uint64_t k3_weights_bytes(const k3_weights *w) {
    return w ? w->arena_bytes + w->dense_bytes + w->mapped_bytes : 0;
}
k3_status k3_weights_mapped(const k3_weights *w, uint64_t *mapped, uint64_t *resident,
                            uint64_t *pmd) {
    *mapped = *resident = *pmd = 0;
    if (!w || !w->n_maps) return K3_OK;
    *mapped = w->mapped_bytes;
    return k3_ckpt_map_pmd(w->maps, w->n_maps, resident, pmd);
}

void k3_weights_destroy(k3_weights *w) {
    if (!w) return;
    if (w->layers)
        for (int l = 0; l < w->cfg.n_layers; l++) k3_free(w->layers[l].experts);
    k3_free(w->layers);
    for (int i = 0; i < w->n_maps; i++) k3_ckpt_unmap(&w->maps[i]);
    k3_free(w->maps);
    if (w->be)
        k3_backend_free(w->be, w->arena);
    else
        k3_free(w->arena);
    k3_free(w);
}
