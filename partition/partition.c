/* partition.c — k3_plan_make: the grid, cost-balanced contiguous stages, the expert map, the
 * per-rank byte budget and the plan hash. Pure: no I/O, no MPI, no globals.
 *
 * Invariants: stages are non-empty and contiguous and cover [0, n_layers); expert_lane holds a
 * lane in [0, E) for every (MoE layer, expert) and -1 elsewhere; the hash covers every field a
 * rank acts on, so two ranks with equal hashes load and route identically.
 * Weight bytes come from the model catalogue (k3_catalog), the one source of truth for which
 * tensors exist, so they equal what the loader reads for the same selection. */
#include "k3_partition.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

k3_status k3_coord_mode_parse(const char *s, k3_coord_mode *out) {
    if (s && strcmp(s, "shared") == 0) {
        *out = K3_COORD_SHARED;
        return K3_OK;
    }
    if (s && strcmp(s, "dedicated") == 0) {
        *out = K3_COORD_DEDICATED;
        return K3_OK;
    }
    return K3_ERR(K3_ERR_ARG, "--coordinator: '%s' is not one of shared|dedicated",
                  s ? s : "(null)");
}

/* Checked uint64 arithmetic: an overflow sets *ovf (the result is then meaningless). */
static uint64_t u_mul(bool *ovf, uint64_t a, uint64_t b) {
    uint64_t r;
    if (__builtin_mul_overflow(a, b, &r)) *ovf = true;
    return r;
}
static uint64_t u_add(bool *ovf, uint64_t a, uint64_t b) {
    uint64_t r;
    if (__builtin_add_overflow(a, b, &r)) *ovf = true;
    return r;
}

/* Byte sizes per layer / expert / global, from the catalogue. */
typedef enum { DT_BF16 = 0, DT_MXFP4, DT_OTHER, DT_N } dt_kind; /* k3_rank_mem weights_* */
typedef struct cat_sizes {
    uint64_t layer[K3_MAX_LAYERS];          /* non-expert tensors of each layer */
    uint64_t layer_dt[K3_MAX_LAYERS][DT_N]; /* the same by stored dtype */
    uint64_t *expert;                       /* [n_layers, n_experts] */
    uint64_t expert_dt[DT_N];               /* one expert's bytes by dtype (all experts alike) */
    uint64_t embed, head;                   /* first-stage globals, last-stage globals */
    uint64_t embed_dt[DT_N], head_dt[DT_N];
} cat_sizes;

static dt_kind dt_of(k3_dtype d) {
    return d == K3_DT_BF16 ? DT_BF16 : d == K3_DT_U8 ? DT_MXFP4 : DT_OTHER;
}

static k3_status cat_sizes_make(const k3_config *c, cat_sizes *cs) {
    memset(cs, 0, sizeof *cs);
    int64_t n = k3_catalog(c, NULL, 0);
    if (n <= 0) return K3_ERR(K3_ERR_CONFIG, "plan: the config implies no tensors");
    k3_tensor_spec *specs = NULL;
    K3_TRY(k3_alloc((void **)&specs, (size_t)n * sizeof *specs, "plan catalogue"));
    k3_status st =
        k3_calloc((void **)&cs->expert,
                  (size_t)c->n_layers * (size_t)K3_MAX(c->n_experts, 1) * sizeof(uint64_t),
                  "plan expert sizes");
    if (st != K3_OK) {
        k3_free(specs);
        return st;
    }
    k3_catalog(c, specs, n);
    bool ovf = false;
    for (int64_t i = 0; i < n; i++) {
        const k3_tensor_spec *t = &specs[i];
        int64_t sb = k3_tensor_spec_bytes(t);
        if (sb < 0) ovf = true;
        uint64_t b = (uint64_t)K3_MAX(sb, 0);
        dt_kind k = dt_of(t->dtype);
        if (t->kind == K3_TK_GLOBAL) {
            if (t->first_stage) {
                cs->embed = u_add(&ovf, cs->embed, b);
                cs->embed_dt[k] = u_add(&ovf, cs->embed_dt[k], b);
            } else {
                cs->head = u_add(&ovf, cs->head, b);
                cs->head_dt[k] = u_add(&ovf, cs->head_dt[k], b);
            }
        } else if (t->layer >= 0 && t->layer < c->n_layers) {
            if (t->kind == K3_TK_LAYER) {
                cs->layer[t->layer] = u_add(&ovf, cs->layer[t->layer], b);
                cs->layer_dt[t->layer][k] = u_add(&ovf, cs->layer_dt[t->layer][k], b);
            } else if (t->expert >= 0 && t->expert < c->n_experts) {
                uint64_t *e = &cs->expert[(int64_t)t->layer * c->n_experts + t->expert];
                *e = u_add(&ovf, *e, b);
                if (t->layer == c->first_k_dense_replace && t->expert == 0) cs->expert_dt[k] += b;
            }
        }
    }
    if (c->tie_word_embeddings) { /* the head reuses the embedding */
        cs->head = u_add(&ovf, cs->head, cs->embed);
        for (int k = 0; k < DT_N; k++)
            cs->head_dt[k] = u_add(&ovf, cs->head_dt[k], cs->embed_dt[k]);
    }
    k3_free(specs);
    if (ovf) {
        k3_free(cs->expert);
        cs->expert = NULL;
        return K3_ERR(K3_ERR_CONFIG, "plan: the model's tensor bytes overflow 64 bits");
    }
    return K3_OK;
}

static double layer_state_cost(const k3_config *c, int l, int64_t nominal_ctx) {
    if (c->mixer[l] == K3_MIXER_KDA) /* recurrent state read + written, fp32 */
        return 2.0 * c->kda_n_heads * (double)c->kda_head_dim * c->kda_head_dim * 4.0;
    return (double)nominal_ctx * (c->kv_lora_rank + c->qk_rope_head_dim) * 4.0; /* latent cache */
}

static void costs_from_sizes(const k3_config *c, const cat_sizes *cs, int64_t nominal_ctx,
                             double *cost, double *extra_first, double *extra_last) {
    for (int l = 0; l < c->n_layers; l++) {
        double x = (double)cs->layer[l] + layer_state_cost(c, l, nominal_ctx);
        if (k3_config_is_moe(c, l) && c->n_experts > 0) {
            uint64_t tot = 0;
            for (int e = 0; e < c->n_experts; e++) tot += cs->expert[(int64_t)l * c->n_experts + e];
            x += (double)tot / c->n_experts * c->n_experts_per_tok; /* top-k experts touched */
        }
        cost[l] = x;
    }
    /* The embedding is a row lookup; the head reads all of lm_head per token. */
    if (extra_first) *extra_first = (double)c->hidden_size * 2.0;
    if (extra_last) *extra_last = (double)cs->head;
}

#define K3_PLAN_NOMINAL_CTX 4096

void k3_plan_layer_costs(const k3_config *c, int64_t nominal_ctx, double *cost, double *extra_first,
                         double *extra_last) {
    cat_sizes cs;
    if (cat_sizes_make(c, &cs) != K3_OK) {
        for (int l = 0; l < c->n_layers; l++) cost[l] = 0;
        if (extra_first) *extra_first = 0;
        if (extra_last) *extra_last = 0;
        return;
    }
    costs_from_sizes(c, &cs, nominal_ctx, cost, extra_first, extra_last);
    k3_free(cs.expert);
}

/* Contiguous split of n layers into S non-empty stages minimising the most expensive stage
 * (stage 0 also pays `first`, the last stage `last`). Exact DP, O(S n^2); ties -> earliest cut. */
static k3_status balance(const double *cost, int n, int S, double first, double last, int *begin) {
    double *pre = NULL, *f = NULL;
    int *arg = NULL;
    K3_TRY(k3_alloc((void **)&pre, (size_t)(n + 1) * sizeof(double), "plan prefix"));
    k3_status st =
        k3_alloc((void **)&f, (size_t)(S + 1) * (size_t)(n + 1) * sizeof(double), "plan dp");
    if (st == K3_OK)
        st = k3_alloc((void **)&arg, (size_t)(S + 1) * (size_t)(n + 1) * sizeof(int), "plan dp");
    if (st != K3_OK) {
        k3_free(pre);
        k3_free(f);
        return st;
    }
    pre[0] = 0;
    for (int i = 0; i < n; i++) pre[i + 1] = pre[i] + cost[i];
#define F(s, i) f[(size_t)(s) * (size_t)(n + 1) + (size_t)(i)]
#define A(s, i) arg[(size_t)(s) * (size_t)(n + 1) + (size_t)(i)]
    /* F(s, i): best max cost placing layers [0, i) into stages 0..s-1 (stage s-1 ends at i). */
    for (int s = 0; s <= S; s++)
        for (int i = 0; i <= n; i++) F(s, i) = INFINITY, A(s, i) = -1;
    F(0, 0) = 0;
    for (int s = 1; s <= S; s++) {
        for (int i = s; i <= n - (S - s); i++) {
            for (int j = s - 1; j < i; j++) {
                if (!isfinite(F(s - 1, j))) continue;
                double c = pre[i] - pre[j];
                if (s == 1) c += first;
                if (s == S) c += last;
                double m = F(s - 1, j) > c ? F(s - 1, j) : c;
                if (m < F(s, i)) F(s, i) = m, A(s, i) = j;
            }
        }
    }
    begin[S] = n;
    for (int s = S, i = n; s >= 1; s--) {
        begin[s - 1] = A(s, i);
        i = A(s, i);
    }
#undef F
#undef A
    k3_free(pre);
    k3_free(f);
    k3_free(arg);
    return K3_OK;
}

/* ---- expert map --------------------------------------------------------------------------- */
static k3_status parse_map(const k3_config *c, const k3_plan_req *r, int16_t *lane /* [L, X] */) {
    const char *name = r->expert_map_name ? r->expert_map_name : "expert map";
    int L = c->n_layers, X = c->n_experts;
    bool *seen = NULL, have_default = false;
    int16_t *def = NULL;
    K3_TRY(k3_calloc((void **)&seen, (size_t)L, "map layers"));
    k3_status st = k3_alloc((void **)&def, (size_t)K3_MAX(X, 1) * sizeof(int16_t), "map default");
    if (st != K3_OK) goto done;
    const char *p = r->expert_map;
    int line_no = 0;
    while (*p) {
        line_no++;
        const char *eol = strchr(p, '\n');
        size_t len = eol ? (size_t)(eol - p) : strlen(p);
        char *line = NULL;
        st = k3_alloc((void **)&line, len + 1, "map line");
        if (st != K3_OK) goto done;
        memcpy(line, p, len);
        line[len] = 0;
        p += len + (eol ? 1 : 0);
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char *save = NULL, *tok = strtok_r(line, " \t\r,", &save);
        if (!tok) {
            k3_free(line);
            continue;
        }
        int16_t *dst;
        if (strcmp(tok, "*") == 0) {
            if (have_default) {
                st = K3_ERR(K3_ERR_ARG, "%s:%d: a second '*' line", name, line_no);
                k3_free(line);
                goto done;
            }
            have_default = true;
            dst = def;
        } else {
            char *end;
            errno = 0;
            long layer = strtol(tok, &end, 10);
            if (*end || errno || layer < 0 || layer >= L) {
                st = K3_ERR(K3_ERR_ARG, "%s:%d: '%s' is not a layer index in [0, %d) or '*'", name,
                            line_no, tok, L);
                k3_free(line);
                goto done;
            }
            if (!k3_config_is_moe(c, (int)layer)) {
                st =
                    K3_ERR(K3_ERR_ARG, "%s:%d: layer %ld is not a MoE layer", name, line_no, layer);
                k3_free(line);
                goto done;
            }
            if (seen[layer]) {
                st = K3_ERR(K3_ERR_ARG, "%s:%d: layer %ld listed twice", name, line_no, layer);
                k3_free(line);
                goto done;
            }
            seen[layer] = true;
            dst = lane + layer * X;
        }
        int n = 0;
        while ((tok = strtok_r(NULL, " \t\r,", &save)) != NULL) {
            char *end;
            errno = 0;
            long v = strtol(tok, &end, 10);
            if (*end || errno || v < 0 || v >= r->ep) {
                st = K3_ERR(K3_ERR_ARG, "%s:%d: expert %d: lane '%s' is not in [0, %d) (--ep %d)",
                            name, line_no, n, tok, r->ep, r->ep);
                k3_free(line);
                goto done;
            }
            if (n >= X) {
                st = K3_ERR(K3_ERR_ARG, "%s:%d: more than n_experts = %d lanes", name, line_no, X);
                k3_free(line);
                goto done;
            }
            dst[n++] = (int16_t)v;
        }
        k3_free(line);
        if (n != X) {
            st = K3_ERR(K3_ERR_ARG, "%s:%d: %d lanes given, n_experts = %d", name, line_no, n, X);
            goto done;
        }
    }
    for (int l = 0; l < L; l++) {
        if (!k3_config_is_moe(c, l) || seen[l]) continue;
        if (!have_default) {
            st = K3_ERR(K3_ERR_ARG, "%s: MoE layer %d has no line and there is no '*' line", name,
                        l);
            goto done;
        }
        memcpy(lane + (int64_t)l * X, def, (size_t)X * sizeof(int16_t));
    }
done:
    k3_free(seen);
    k3_free(def);
    return st;
}

/* ---- the plan ----------------------------------------------------------------------------- */
int k3_plan_rank(const k3_plan *p, int stage, int lane) {
    return p->first_worker + stage * p->n_lanes + lane;
}

bool k3_plan_coords(const k3_plan *p, int rank, int *stage, int *lane) {
    int w = rank - p->first_worker;
    if (w < 0 || w >= p->n_stages * p->n_lanes) {
        if (stage) *stage = -1;
        if (lane) *lane = -1;
        return false;
    }
    if (stage) *stage = w / p->n_lanes;
    if (lane) *lane = w % p->n_lanes;
    return true;
}

int k3_plan_stage_of_layer(const k3_plan *p, int layer) {
    for (int s = 0; s < p->n_stages; s++)
        if (layer >= p->stage_begin[s] && layer < p->stage_begin[s + 1]) return s;
    return -1;
}

uint64_t k3_plan_hash(const k3_plan *p) {
    uint64_t h = K3_HASH_INIT;
    int32_t hdr[7] = {p->world,        p->n_stages, p->n_lanes,  (int32_t)p->coord,
                      p->first_worker, p->n_layers, p->n_experts};
    h = k3_hash_bytes(hdr, sizeof hdr, h);
    h = k3_hash_bytes(p->stage_begin, (size_t)(p->n_stages + 1) * sizeof(int), h);
    if (p->expert_lane)
        h = k3_hash_bytes(p->expert_lane,
                          (size_t)p->n_layers * (size_t)p->n_experts * sizeof(int16_t), h);
    if (p->mem) h = k3_hash_bytes(p->mem, (size_t)p->world * sizeof(k3_rank_mem), h);
    return h;
}

int k3_plan_max_bank(const k3_config *c) {
    return c->attn_res_block_size > 0
               ? (c->n_layers + c->attn_res_block_size - 1) / c->attn_res_block_size
               : 0;
}

uint64_t k3_rank_mem_total(const k3_rank_mem *m) {
    return m->weights + m->caches + m->buffers + m->workspace;
}

void k3_plan_seq_bytes(const k3_config *c, int lb, int le, int64_t max_ctx, uint64_t *mla,
                       uint64_t *kda_conv, uint64_t *kda_rec) {
    const uint64_t P = (uint64_t)c->kda_n_heads * (uint64_t)c->kda_head_dim;
    const uint64_t conv = 3ull * (uint64_t)K3_MAX(c->kda_conv_kernel - 1, 0) * P * 4;
    const uint64_t rec = P * (uint64_t)c->kda_head_dim * 4;
    const uint64_t lat = (uint64_t)K3_MAX(max_ctx, 1) *
                         (uint64_t)(c->kv_lora_rank + c->qk_rope_head_dim) * 4; /* per layer */
    *mla = *kda_conv = *kda_rec = 0;
    for (int l = lb; l < le; l++) {
        if (c->mixer[l] == K3_MIXER_KDA)
            *kda_conv += conv, *kda_rec += rec;
        else
            *mla += lat;
    }
}

/* Floats of the MoE step's scratch (experts/moe.c k3_moe_scratch_floats, mirrored: the
 * whole-layer forward's ids, weights, latent rows and slot sums of all T tokens, then the largest
 * of routing, the moe_experts op's work (k3_moe_experts_work_floats: its row tiles and the host
 * sort of T·K rows) and the finish step; it covers k3_moe_expert_rows of K3_MOE_ROW_TILE-row
 * tiles too); pad16 rounding left out. */
static uint64_t moe_scratch_floats(const k3_config *c, uint64_t T) {
    const uint64_t X = (uint64_t)c->n_experts, K = (uint64_t)c->n_experts_per_tok;
    const uint64_t Lw = (uint64_t)(c->latent_size > 0 ? c->latent_size : c->hidden_size);
    const uint64_t I = (uint64_t)c->moe_intermediate_size;
    const uint64_t S = (uint64_t)c->n_shared_experts * I, D = (uint64_t)c->hidden_size;
    const uint64_t route = 2 * T * X + X, tile = K3_MOE_ROW_TILE;
    /* row tiles, the weighted form's token tile of items (4096 slot rows: k3_kernels.h
       K3_MOE_EXPERTS_ITEMS, not visible here), the host sort */
    const uint64_t work =
        2 * tile * (Lw + I) + K3_MIN(T * K, 4096) * Lw + 2 * (T * K + X + 1 + tile);
    const uint64_t fin = T * Lw + Lw + 2 * T * S + T * D;
    return 2 * T * K + 2 * T * Lw + K3_MAX(work, K3_MAX(route, fin));
}

uint64_t k3_plan_workspace_bytes(const k3_config *c, int lb, int le, bool first, int64_t T_,
                                 int n_lanes, int64_t max_ctx, int max_seqs) {
    const uint64_t T = (uint64_t)K3_MAX(T_, 1), D = (uint64_t)c->hidden_size;
    bool kda = false, mla = false, dense = false, moe = false;
    for (int l = lb; l < le; l++) {
        if (c->mixer[l] == K3_MIXER_KDA)
            kda = true;
        else
            mla = true;
        if (k3_config_is_moe(c, l))
            moe = true;
        else
            dense = true;
    }
    const uint64_t P = (uint64_t)c->kda_n_heads * (uint64_t)c->kda_head_dim;
    const uint64_t seqs = (uint64_t)K3_MAX(max_seqs, 1);
    /* xa, xn, y, head rows; the bank rows of each sequence's last token [bank, seqs, D] */
    uint64_t f = 4 * T * D + (uint64_t)k3_plan_max_bank(c) * seqs * D;
    if (kda) {
        f += 9 * T * P + T * (uint64_t)c->kda_gate_rank + T * (uint64_t)c->kda_n_heads;
    }
    if (mla) {
        const uint64_t H = (uint64_t)c->n_heads, dn = (uint64_t)c->qk_nope_head_dim,
                       dr = (uint64_t)c->qk_rope_head_dim, dv = (uint64_t)c->v_head_dim,
                       R = (uint64_t)c->kv_lora_rank, W = R + dr;
        f += T * (uint64_t)K3_MAX(c->q_lora_rank, 1) + T * H * (dn + dr) + T * W +
             T * K3_MAX(dn, R) + T * K3_MAX(R, dv) + T * H * W + T * H * R + 2 * T * H * dv;
        f += H * (uint64_t)K3_MAX(max_ctx, 1); /* attention scores of one head row at max_ctx */
    }
    if (dense) f += 2 * T * (uint64_t)c->intermediate_size;
    /* the step buffer (layers/stage.c): descriptor [(seqs + 1) + 3 seqs + seqs x blocks], flags,
       token ids, int32 each */
    const uint64_t blocks =
        mla ? ((uint64_t)K3_MAX(max_ctx, 1) + K3_KV_BLOCK - 1) / K3_KV_BLOCK : 0;
    f += (seqs + 1) + 3 * seqs + seqs * blocks + T;
    /* f32 copies of each layer's small vectors (norms, conv taps, dt_bias, A_log; an upper bound
       per layer, as layers/stage.c make_vecs sizes them) + the final norm and mixing score */
    f += (uint64_t)(le - lb) *
             (4 * D + 3 * P * (uint64_t)c->kda_conv_kernel + P + (uint64_t)c->kda_n_heads +
              (uint64_t)c->kda_head_dim + (uint64_t)c->q_lora_rank + (uint64_t)c->kv_lora_rank) +
         2 * D;
    uint64_t host = 0; /* host-side scratch bytes (ids, rows, lanes, weights) */
    if (moe) {
        f += moe_scratch_floats(c, T);
        if (n_lanes > 1) { /* the expert-parallel rows: a lane receives <= n_lanes T K items */
            const uint64_t K = (uint64_t)c->n_experts_per_tok, TK = T * K;
            const uint64_t Lw = (uint64_t)(c->latent_size > 0 ? c->latent_size : c->hidden_size);
            f += 2 * TK + 2 * T * Lw + TK * Lw + (uint64_t)n_lanes * TK * Lw;
            /* the received items' expert rows (k3_moe_expert_rows: ids and rows as int32, the
               moe_experts work beyond the row tiles moe_scratch_floats counts) */
            const uint64_t R = (uint64_t)n_lanes * TK, X = (uint64_t)c->n_experts;
            f += 2 * R + K3_MIN(R, 4096) * Lw + 2 * (R + X + 1 + 256);
            host = TK * 16 + (uint64_t)n_lanes * TK * 8;
        }
    }
    return f * 4 + host;
}

/* The device-routed MoE exchange's buffers of a stage (layers/moe_ep.c, k3_moe_ep_layout): three
 * sets of L lane blocks (send, receive, return), the experts' h [EL·L·cap, I], the row maps and
 * the per-layer expert maps. EL: the most experts one lane holds in a MoE layer of the stage;
 * cap: min(T, max(ceil(T·K·factor / E), max_seqs)), factor K3_MOE_CAPACITY_FACTOR or 2 (a
 * decode round's max_seqs rows never overflow). */
static uint64_t moe_device_bytes(const k3_plan *p, const k3_config *c, const k3_plan_req *r, int lb,
                                 int le) {
    const int L = p->n_lanes, X = c->n_experts;
    uint64_t EL = 1;
    for (int l = lb; l < le; l++) {
        if (!k3_config_is_moe(c, l)) continue;
        for (int lane = 0; lane < L; lane++) {
            uint64_t n = 0;
            for (int e = 0; e < X; e++) n += p->expert_lane[(int64_t)l * X + e] == lane;
            EL = n > EL ? n : EL;
        }
    }
    const char *f = getenv("K3_MOE_CAPACITY_FACTOR");
    double factor = f && *f ? strtod(f, NULL) : 2.0;
    if (!(factor > 0.0) || factor > 1e6) factor = 2.0;
    const uint64_t T = (uint64_t)K3_MAX(r->max_tokens, 1), K = (uint64_t)c->n_experts_per_tok;
    uint64_t cap = (uint64_t)ceil((double)T * (double)K * factor / (double)(X > 0 ? X : 1));
    const uint64_t seqs = (uint64_t)K3_MAX(r->max_seqs_per_lane, 0);
    cap = K3_MIN(K3_MAX(K3_MAX(cap, (uint64_t)1), seqs), T);
    const uint64_t Lw = (uint64_t)(c->latent_size > 0 ? c->latent_size : c->hidden_size);
    const uint64_t blk = ((EL + Lw - 1) / Lw + EL * cap) * Lw, C = (uint64_t)L * cap;
    const uint64_t nl = (uint64_t)(le - lb);
    return 4 * (3 * (uint64_t)L * blk + EL * C * (uint64_t)c->moe_intermediate_size + 2 * EL +
                EL * C + T * K + nl * (uint64_t)X + nl * EL);
}

static void add_dt(k3_rank_mem *m, const uint64_t dt[DT_N]) {
    m->weights_bf16 += dt[DT_BF16];
    m->weights_mxfp4 += dt[DT_MXFP4];
    m->weights_other += dt[DT_OTHER];
}

/* Per-rank bytes; every product and sum is checked (a huge --max-ctx/--max-seqs/--max-tokens
 * must fail, not wrap to a small number): the caller's bounds keep each factor small enough that
 * the sizing functions above cannot overflow once the checked products here pass. */
static k3_status fill_mem(k3_plan *p, const k3_config *c, const k3_plan_req *r,
                          const cat_sizes *cs) {
    int S = p->n_stages, E = p->n_lanes;
    const uint64_t T = (uint64_t)K3_MAX(r->max_tokens, 1), D = (uint64_t)c->hidden_size;
    const uint64_t CTX = (uint64_t)K3_MAX(r->max_ctx, 1);
    const uint64_t SEQS = (uint64_t)K3_MAX(r->max_seqs_per_lane, 1);
    for (int rank = 0; rank < p->world; rank++) {
        k3_rank_mem *m = &p->mem[rank];
        memset(m, 0, sizeof *m);
        bool wo = false, co = false, bo = false; /* overflow of weights / caches / buffers */
        int s, e;
        const uint64_t logits = u_mul(&bo, u_mul(&bo, T, (uint64_t)c->vocab_size), 4);
        /* the coordinator receives logits messages (rows <= T per lane step) */
        if (rank == 0) m->buffers = logits;
        if (k3_plan_coords(p, rank, &s, &e)) {
            int lb = p->stage_begin[s], le = p->stage_begin[s + 1];
            bool has_moe = false;
            uint64_t dense = 0;
            for (int l = lb; l < le; l++) {
                dense = u_add(&wo, dense, cs->layer[l]);
                m->weights = u_add(&wo, m->weights, cs->layer[l]);
                add_dt(m, cs->layer_dt[l]);
                if (k3_config_is_moe(c, l)) {
                    has_moe = true;
                    for (int x = 0; x < c->n_experts; x++)
                        if (k3_plan_owner_lane(p, l, x) == e) {
                            m->weights =
                                u_add(&wo, m->weights, cs->expert[(int64_t)l * c->n_experts + x]);
                            add_dt(m, cs->expert_dt);
                        }
                }
            }
            if (s == 0) {
                dense = u_add(&wo, dense, cs->embed);
                m->weights = u_add(&wo, m->weights, cs->embed);
                add_dt(m, cs->embed_dt);
            }
            if (s == S - 1) {
                dense = u_add(&wo, dense, cs->head);
                m->weights = u_add(&wo, m->weights, cs->head);
                add_dt(m, cs->head_dt);
            }
            p->stage_dense[s] = dense;
            /* caches: per-sequence bytes (checked here first: CTX may be up to 2^30) */
            uint64_t per_tok = 0, n_mla = 0;
            for (int l = lb; l < le; l++) n_mla += c->mixer[l] != K3_MIXER_KDA;
            per_tok = u_mul(&co, n_mla, (uint64_t)(c->kv_lora_rank + c->qk_rope_head_dim) * 4);
            (void)u_mul(&co, u_mul(&co, per_tok, CTX), SEQS);
            if (!co) {
                uint64_t mla, kconv, krec;
                k3_plan_seq_bytes(c, lb, le, r->max_ctx, &mla, &kconv, &krec);
                /* the paged cache: its blocks, however many sequences share them */
                const uint64_t kvt =
                    r->kv_cache_tokens > 0 ? (uint64_t)r->kv_cache_tokens : u_mul(&co, CTX, SEQS);
                const uint64_t pad = r->graphs ? 1 : 0; /* the pad rows' block and slot */
                m->mla_cache =
                    u_mul(&co, per_tok,
                          ((kvt + K3_KV_BLOCK - 1) / K3_KV_BLOCK + pad) * (uint64_t)K3_KV_BLOCK);
                m->kda_state = u_mul(&co, kconv + krec, SEQS + pad);
                m->kda_snapshots =
                    u_mul(&co, kconv + krec, (uint64_t)K3_MAX(r->prefix_snapshots, 0));
                m->caches = u_add(&co, u_add(&co, m->mla_cache, m->kda_state), m->kda_snapshots);
            }
            /* the hand-off activation h | bank [T, D] x (1 + bank): allocated on every worker,
               plus one message copy per neighbour stage (send to s+1, receive from s-1) */
            uint64_t act =
                u_mul(&bo, u_mul(&bo, u_mul(&bo, T, D), (uint64_t)(1 + k3_plan_max_bank(c))), 4);
            m->buffers =
                u_add(&bo, m->buffers, u_mul(&bo, act, (uint64_t)(1 + (s > 0) + (s < S - 1))));
            if (has_moe && E > 1) {
                uint64_t W = (uint64_t)(c->latent_size > 0 ? c->latent_size : c->hidden_size);
                uint64_t rows =
                    u_mul(&bo, u_mul(&bo, u_mul(&bo, T, (uint64_t)c->n_experts_per_tok), W), 4);
                /* send + worst-case recv, rows + outputs */
                m->buffers =
                    u_add(&bo, m->buffers, u_mul(&bo, u_mul(&bo, rows, 2), (uint64_t)(1 + E)));
            }
            if (has_moe && E > 1 && r->moe_device)
                m->buffers = u_add(&bo, m->buffers, moe_device_bytes(p, c, r, lb, le));
            if (s == S - 1) m->buffers = u_add(&bo, m->buffers, logits);
            if (!bo)
                m->workspace =
                    k3_plan_workspace_bytes(c, lb, le, s == 0, r->max_tokens, E, r->max_ctx,
                                            r->max_seqs_per_lane + (r->graphs ? 1 : 0));
        }
        if (wo) return K3_ERR(K3_ERR_CONFIG, "rank %d's weight bytes overflow 64 bits", rank);
        if (co)
            return K3_ERR(K3_ERR_ARG,
                          "rank %d's cache bytes overflow 64 bits (--max-ctx %lld x "
                          "--max-seqs %d is too large)",
                          rank, (long long)r->max_ctx, r->max_seqs_per_lane);
        if (bo)
            return K3_ERR(K3_ERR_ARG,
                          "rank %d's buffer bytes overflow 64 bits (--max-tokens %lld is "
                          "too large)",
                          rank, (long long)r->max_tokens);
    }
    return K3_OK;
}

k3_status k3_plan_make(const k3_config *c, const k3_plan_req *r, k3_plan *out) {
    memset(out, 0, sizeof *out);
    if (r->pp < 1) return K3_ERR(K3_ERR_ARG, "--pp %d: need at least 1 stage", r->pp);
    if (r->ep < 1) return K3_ERR(K3_ERR_ARG, "--ep %d: need at least 1 lane", r->ep);
    if (r->ep > 32767) return K3_ERR(K3_ERR_ARG, "--ep %d: too many lanes", r->ep);
    int ded = r->coord == K3_COORD_DEDICATED;
    /* one process asked for several ranks: say how to launch them, not only that they are missing
     */
    if (r->world == 1 && (int64_t)r->pp * r->ep + ded > 1)
        return K3_ERR(K3_ERR_ARG,
                      "--pp %d x --ep %d%s = %lld ranks, but this is one process: run it under "
                      "mpirun -np %lld (add --allow-run-as-root as root, --oversubscribe with "
                      "fewer cores than ranks)",
                      r->pp, r->ep, ded ? " + 1 coordinator" : "", (long long)r->pp * r->ep + ded,
                      (long long)r->pp * r->ep + ded);
    if ((int64_t)r->pp * r->ep + ded != r->world)
        return K3_ERR(K3_ERR_ARG,
                      "--pp %d x --ep %d%s = %lld ranks, but the world has %d (%s coordinator)",
                      r->pp, r->ep, ded ? " + 1 coordinator" : "", (long long)r->pp * r->ep + ded,
                      r->world, ded ? "dedicated" : "shared");
    if (c->n_layers < 1 || c->n_layers > K3_MAX_LAYERS)
        return K3_ERR(K3_ERR_CONFIG, "plan: n_layers %d out of range", c->n_layers);
    if (r->pp > c->n_layers)
        return K3_ERR(K3_ERR_ARG, "--pp %d: more stages than the model's %d layers", r->pp,
                      c->n_layers);
    if (!r->expert_map && c->n_experts > 0 && c->n_experts % r->ep != 0)
        return K3_ERR(K3_ERR_ARG,
                      "--ep %d does not divide n_experts = %d (the contiguous expert map needs it; "
                      "pass an expert map instead)",
                      r->ep, c->n_experts);

    out->world = r->world;
    out->n_stages = r->pp;
    out->n_lanes = r->ep;
    out->coord = r->coord;
    out->first_worker = ded;
    out->n_layers = c->n_layers;
    out->n_experts = K3_MAX(c->n_experts, 0);

    cat_sizes cs;
    K3_TRY(cat_sizes_make(c, &cs));
    k3_status st =
        k3_alloc((void **)&out->expert_lane,
                 (size_t)c->n_layers * (size_t)K3_MAX(out->n_experts, 1) * sizeof(int16_t),
                 "plan expert map");
    if (st == K3_OK)
        st = k3_calloc((void **)&out->mem, (size_t)r->world * sizeof(k3_rank_mem), "plan mem");
    if (st != K3_OK) goto fail;
    for (int64_t i = 0; i < (int64_t)c->n_layers * out->n_experts; i++) out->expert_lane[i] = -1;
    if (r->expert_map) {
        st = parse_map(c, r, out->expert_lane);
        if (st != K3_OK) goto fail;
    } else if (out->n_experts > 0) {
        int per = out->n_experts / r->ep;
        for (int l = 0; l < c->n_layers; l++)
            if (k3_config_is_moe(c, l))
                for (int x = 0; x < out->n_experts; x++)
                    out->expert_lane[(int64_t)l * out->n_experts + x] = (int16_t)(x / per);
    }

    double first, last;
    costs_from_sizes(c, &cs, K3_MIN(K3_MAX(r->max_ctx, 1), K3_PLAN_NOMINAL_CTX), out->layer_cost,
                     &first, &last);
    st = balance(out->layer_cost, c->n_layers, r->pp, first, last, out->stage_begin);
    if (st != K3_OK) goto fail;
    for (int s = 0; s < r->pp; s++) {
        double x = 0;
        for (int l = out->stage_begin[s]; l < out->stage_begin[s + 1]; l++) x += out->layer_cost[l];
        if (s == 0) x += first;
        if (s == r->pp - 1) x += last;
        out->stage_cost[s] = x;
    }
    st = fill_mem(out, c, r, &cs);
    if (st != K3_OK) goto fail;
    k3_free(cs.expert);
    out->hash = k3_plan_hash(out);
    return K3_OK;
fail:
    k3_free(cs.expert);
    k3_plan_free(out);
    return st;
}

uint64_t k3_plan_node_shared(const k3_plan *p, const int *ranks, int n_ranks) {
    int k[K3_MAX_LAYERS] = {0}; /* distinct ranks of each stage in the list */
    for (int i = 0; i < n_ranks; i++) {
        int s = -1;
        bool first = ranks[i] >= 0 && ranks[i] < p->world;
        for (int j = 0; first && j < i; j++) first = ranks[j] != ranks[i];
        if (first && k3_plan_coords(p, ranks[i], &s, NULL) && s >= 0 && s < p->n_stages) k[s]++;
    }
    uint64_t off = 0;
    for (int s = 0; s < p->n_stages; s++)
        if (k[s] > 1) off += (uint64_t)(k[s] - 1) * p->stage_dense[s];
    return off;
}

/* Whether the ranks' set `in_stage[s]` (any rank of stage s) / `lanes[s * E + e]` (rank (s, e))
 * read catalogue tensor t: the rule of fill_mem and the loader (model/weights.c). */
static bool read_by(const k3_config *c, const k3_plan *p, const k3_tensor_spec *t,
                    const bool *in_stage, const bool *lanes) {
    const int S = p->n_stages, E = p->n_lanes;
    if (t->kind == K3_TK_GLOBAL) {
        if (t->first_stage) /* the embedding; a tied head reads it on the last stage */
            return in_stage[0] ||
                   (c->tie_word_embeddings && t->role == K3_R_EMBED && in_stage[S - 1]);
        return in_stage[S - 1];
    }
    if (t->layer < 0 || t->layer >= c->n_layers) return false;
    const int s = k3_plan_stage_of_layer(p, t->layer);
    if (s < 0) return false;
    if (t->kind == K3_TK_LAYER) return in_stage[s];
    const int e = t->expert >= 0 && t->expert < p->n_experts
                      ? k3_plan_owner_lane(p, t->layer, t->expert)
                      : -1;
    return e >= 0 && e < E && lanes[s * E + e];
}

k3_status k3_plan_unique_weights(const k3_config *c, const k3_plan *p, const int *ranks,
                                 int n_ranks, uint64_t *out) {
    *out = 0;
    const int S = p->n_stages, E = p->n_lanes;
    bool *in_stage = NULL, *lanes = NULL;
    K3_TRY(k3_calloc((void **)&in_stage, (size_t)S, "unique weights"));
    k3_status st = k3_calloc((void **)&lanes, (size_t)S * (size_t)E, "unique weights");
    for (int i = 0; st == K3_OK && i < n_ranks; i++) {
        int s, e;
        if (ranks[i] < 0 || ranks[i] >= p->world)
            st = K3_ERR(K3_ERR_ARG, "plan: rank %d outside the world of %d", ranks[i], p->world);
        else if (k3_plan_coords(p, ranks[i], &s, &e))
            in_stage[s] = lanes[s * E + e] = true;
    }
    k3_tensor_spec *specs = NULL;
    const int64_t n = k3_catalog(c, NULL, 0);
    if (st == K3_OK && n > 0)
        st = k3_alloc((void **)&specs, (size_t)n * sizeof *specs, "unique weights catalogue");
    if (st == K3_OK && n > 0) {
        k3_catalog(c, specs, n);
        bool ovf = false;
        for (int64_t i = 0; i < n; i++)
            if (read_by(c, p, &specs[i], in_stage, lanes))
                *out = u_add(&ovf, *out, (uint64_t)K3_MAX(k3_tensor_spec_bytes(&specs[i]), 0));
        if (ovf) st = K3_ERR(K3_ERR_CONFIG, "plan: the model's tensor bytes overflow 64 bits");
    }
    k3_free(specs), k3_free(lanes), k3_free(in_stage);
    return st;
}

void k3_plan_free(k3_plan *p) {
    if (!p) return;
    k3_free(p->expert_lane);
    k3_free(p->mem);
    memset(p, 0, sizeof *p);
}

/* ---- the table ---------------------------------------------------------------------------- */
#define APPEND(...)                                                                                \
    do {                                                                                           \
        if (off < cap) {                                                                           \
            int n_ = snprintf(buf + off, cap - off, __VA_ARGS__);                                  \
            if (n_ > 0) off += (size_t)n_;                                                         \
        }                                                                                          \
    } while (0)

void k3_plan_format(const k3_plan *p, const k3_config *c, char *buf, size_t cap) {
    size_t off = 0;
    if (cap == 0) return;
    buf[0] = 0;
    const double MB = 1e6;
    APPEND("plan: world %d = %d stage%s x %d lane%s, coordinator %s (rank 0), hash %016llx\n",
           p->world, p->n_stages, p->n_stages > 1 ? "s" : "", p->n_lanes, p->n_lanes > 1 ? "s" : "",
           p->coord == K3_COORD_DEDICATED ? "dedicated" : "shared", (unsigned long long)p->hash);
    APPEND("  stage  layers     kinds (E=embed K=KDA M=MLA lower=dense H=head)  cost MB/token\n");
    for (int s = 0; s < p->n_stages; s++) {
        int lb = p->stage_begin[s], le = p->stage_begin[s + 1];
        char kinds[64];
        int k = 0;
        if (s == 0) kinds[k++] = 'E', kinds[k++] = ' ';
        for (int l = lb; l < le && k < 48; l++) {
            char ch = c->mixer[l] == K3_MIXER_KDA ? 'K' : 'M';
            kinds[k++] = k3_config_is_moe(c, l) ? ch : (char)tolower(ch);
        }
        if (k >= 48) kinds[k++] = '.', kinds[k++] = '.';
        if (s == p->n_stages - 1) kinds[k++] = ' ', kinds[k++] = 'H';
        kinds[k] = 0;
        char range[24];
        snprintf(range, sizeof range, "%d-%d", lb, le - 1);
        APPEND("  %5d  %-9s  %-39s  %12.2f\n", s, range, kinds, p->stage_cost[s] / MB);
    }
    APPEND("  rank  stage  lane  experts/MoE-layer  weights MB  caches MB  buffers MB\n");
    for (int r = 0; r < p->world; r++) {
        int s, e;
        if (!k3_plan_coords(p, r, &s, &e)) {
            APPEND("  %4d  coordinator              -  %10.2f  %9.2f  %10.2f\n", r, 0.0, 0.0,
                   p->mem[r].buffers / MB);
            continue;
        }
        int first_moe = -1;
        for (int l = p->stage_begin[s]; l < p->stage_begin[s + 1] && first_moe < 0; l++)
            if (k3_config_is_moe(c, l)) first_moe = l;
        int owned = 0;
        if (first_moe >= 0)
            for (int x = 0; x < p->n_experts; x++)
                owned += k3_plan_owner_lane(p, first_moe, x) == e;
        APPEND("  %4d  %5d  %4d  %17d  %10.2f  %9.2f  %10.2f\n", r, s, e, owned,
               p->mem[r].weights / MB, p->mem[r].caches / MB, p->mem[r].buffers / MB);
    }
}

int k3_plan_prefix_snapshots(int64_t budget_blocks, int max_seqs) {
    const int64_t n = budget_blocks / K3_PREFIX_SNAP_EVERY + 1;
    return (int)(n < 2 * (int64_t)max_seqs ? n : 2 * (int64_t)max_seqs);
}
