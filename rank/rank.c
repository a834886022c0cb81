/* rank.c — k3_rank_run: set-up, partial loading with an aggregate progress bar, the worker loop
 * of a stage lane, the coordinator loop, the report.
 *
 * Wire usage (all messages through comm/, tag = kind; payload layouts in wire.h):
 *   BATCH  coordinator -> (stage 0, lane e): meta = [group, step, all_logits, n_seqs,
 *          (seq, n_tokens, want) x n_seqs, token ids x T]
 *   ACTIV  (s, e) -> (s+1, e): meta = the same without the token ids;
 *          f32 = h [T, D] | bank [n_bank, T, D]
 *   LOGITS (S-1, e) -> coordinator: meta as ACTIV; f32 = [R, V] with R = T (all_logits) or the
 *          number of sequences with want = 1 (those the coordinator samples from)
 *   STOP   coordinator -> every worker, after the last logits arrived.
 * Every lane of a stage receives the same sequence of (group, step) messages (possibly with no
 * sequences), so the lanes' MoE collectives line up; a lane with no tokens still serves its
 * experts at each MoE layer (k3_stage_idle_step). The stage drives the MoE step itself through
 * the comm handle it is given; rank only builds the lane map and moves messages. Activations,
 * caches and logits live in the rank's backend; they cross to host memory only by
 * k3_backend_download/upload at a message boundary. The loop allocates nothing per step: buffers
 * are sized from the plan's max_tokens up front (comm buffers grow to the largest message once).
 */
#include "k3_rank.h"

#include "k3_comm.h"
#include "k3_experts.h"
#include "k3_layers.h"
#include "wire.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct seq_run {
    const int32_t *prompt;
    int64_t P, fed; /* prompt length, tokens fed so far */
    int n_gen;
    int32_t *gen; /* [n_new] */
    int lane, group;
    int64_t n_tok_step; /* tokens of this sequence in its group's current step */
    float *dump;        /* [dump_rows, V] when dumping */
    int64_t dump_rows;
    k3_sampler *smp;   /* this sequence's sampler (seeded by k3_rank_seq_seed) */
    k3_stop_kind stop; /* set when a stop id / stop string ended the sequence */
    int stop_string;   /* which stop string, or -1 */
    k3_tok_bytes text; /* decoded text so far (with a tokenizer) */
} seq_run;

typedef struct group_run {
    int step;    /* current step id */
    int pending; /* LOGITS messages still expected for this step */
    bool done;
} group_run;

typedef struct rank_ctx {
    const k3_rank_opts *o;
    int rank, world, stage, lane;
    bool worker, coord;
    k3_config cfg;
    k3_plan plan;
    k3_comm *comm;
    int32_t *stop_ids; /* [n_stop_ids] the caller's + EOS ids unless ignore_eos (below V) */
    size_t n_stop_ids;
    /* test hooks */
    int fail_load_rank, fail_decode_rank, fail_decode_step, fail_plan_rank;
    bool fail_hang; /* "hang:R:N": stop answering instead of dying */
    /* worker */
    k3_ckpt *ck;
    k3_weights *w;
    const k3_weights_view *view;
    k3_stage *st;
    k3_seq_state **states; /* [n_prompts]; non-NULL for this lane's sequences */
    k3_backend *be;        /* the rank's kernel backend: weights, states, activations */
    k3_activ act;
    float *logits;    /* [max_tokens, V] on the last stage (backend memory) */
    float *h_logits;  /* host staging of logits (NULL: the backend is host-visible) */
    float *h_act;     /* host staging of h | bank for ACTIV (NULL: host-visible) */
    int32_t *lane_of; /* [n_layers * n_experts] owner lane of each (layer, expert) */
    int64_t max_tokens;
    int n_forward;
    k3_seq_state **bstates; /* [n_prompts] batch scratch */
    int32_t *bntok;         /* [n_prompts] */
    /* load */
    bool show_progress;
    FILE *tty; /* rank 0: where the bar goes (stderr, or /dev/tty under mpirun) */
    int last_pct_sent;
    int *pct; /* [world] rank 0: progress per rank */
    double load_s;
    uint64_t bytes_read;
    /* coordinator */
    int n_groups;
    seq_run *seqs;
    group_run *groups;
    int32_t *meta; /* message meta scratch */
    int64_t meta_cap;
    uint8_t *wire; /* k3_wire_step + int32 meta: the bytes of one outgoing step message */
    size_t wire_cap;
    uint64_t logits_bytes;
    int n_logits_msgs;
    uint64_t moe_dispatch_bytes, moe_combine_bytes; /* summed over the world */
    uint64_t n_steps;                               /* forward steps the coordinator sent */
    double t_gen0, t_prefill_done;
} rank_ctx;

/* ---- failure ------------------------------------------------------------------------------ */
static _Noreturn void die(rank_ctx *r, k3_status s) {
    if (r->stage >= 0)
        K3_LOGE("rank %d (stage %d, lane %d) failed: %s: %s", r->rank, r->stage, r->lane,
                k3_status_name(s), k3_last_error());
    else
        K3_LOGE("rank %d (coordinator) failed: %s: %s", r->rank, k3_status_name(s),
                k3_last_error());
    if (r->comm) k3_comm_abort(r->comm, 1);
    k3_comm_world_abort(1);
}
#define RTRY(r, expr)                                                                              \
    do {                                                                                           \
        k3_status s_ = (expr);                                                                     \
        if (s_ != K3_OK) die((r), s_);                                                             \
    } while (0)

static void parse_test_fail(rank_ctx *r) {
    r->fail_load_rank = r->fail_decode_rank = r->fail_decode_step = r->fail_plan_rank = -1;
    const char *t = r->o->test_fail;
    if (!t || !*t) return;
    int a = -1, b = -1;
    if (sscanf(t, "load:%d", &a) == 1)
        r->fail_load_rank = a;
    else if (sscanf(t, "plan:%d", &a) == 1)
        r->fail_plan_rank = a;
    else if (sscanf(t, "decode:%d:%d", &a, &b) == 2)
        r->fail_decode_rank = a, r->fail_decode_step = b;
    else if (sscanf(t, "hang:%d:%d", &a, &b) == 2)
        r->fail_decode_rank = a, r->fail_decode_step = b, r->fail_hang = true;
    else if (r->rank == 0)
        K3_LOGW("K3_TEST_FAIL='%s' not understood (load:R | plan:R | decode:R:N | hang:R:N)", t);
}

static void maybe_die_now(rank_ctx *r, int count) {
    if (r->fail_decode_rank == r->rank && count == r->fail_decode_step && r->fail_hang) {
        K3_LOGE("rank %d: test hook K3_TEST_FAIL=hang:%d:%d: no longer answering", r->rank, r->rank,
                count);
        for (;;) pause(); /* the others must time out and end the job */
    }
    if (r->fail_decode_rank == r->rank && count == r->fail_decode_step) {
        K3_LOGE("rank %d: test hook K3_TEST_FAIL=decode:%d:%d: killing myself with SIGKILL",
                r->rank, r->rank, count);
        raise(SIGKILL);
    }
}

/* ---- the wire (wire.h) --------------------------------------------------------------------- */
/* A received step message, checked against wire.h. */
typedef struct step_msg {
    k3_wire_step h;
    int src;
    const int32_t *meta; /* [h.n_meta] */
    const float *f32;    /* [n_f32] */
    int64_t n_f32;
    uint64_t n_bytes; /* on the wire, header included */
} step_msg;

static void post_step(rank_ctx *r, int peer, k3_msg_kind kind, k3_wire_step h, const int32_t *meta,
                      const k3_f32_seg *seg, int n_seg) {
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
}

/* Poll for a step message of `kind` from `peer`; *got false when none waits. */
static void poll_step(rank_ctx *r, int peer, k3_msg_kind kind, step_msg *out, bool *got) {
    k3_comm_msg m;
    RTRY(r, k3_comm_poll(r->comm, peer, kind, &m, got));
    if (!*got) return;
    k3_wire_step h;
    if (m.n_meta_bytes < (int64_t)sizeof h)
        die(r, K3_ERR(K3_ERR_FORMAT, "step message from rank %d: %lld meta bytes < %zu", m.src,
                      (long long)m.n_meta_bytes, sizeof h));
    memcpy(&h, m.meta, sizeof h);
    if (h.version != K3_WIRE_VERSION || h.kind != (uint32_t)kind || h.n_meta < 0 ||
        m.n_meta_bytes != (int64_t)(sizeof h + (size_t)h.n_meta * sizeof(int32_t)))
        die(r, K3_ERR(K3_ERR_FORMAT,
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
}

/* ---- prompts ------------------------------------------------------------------------------ */
k3_status k3_rank_parse_prompts(const char *text, int32_t **ids, int64_t **lens, int *n_prompts) {
    *ids = NULL;
    *lens = NULL;
    *n_prompts = 0;
    size_t n = strlen(text);
    int np = 1;
    for (size_t i = 0; i < n; i++) np += text[i] == ';';
    K3_TRY(k3_alloc((void **)ids, (n / 2 + 2) * sizeof(int32_t), "prompt ids"));
    k3_status st = k3_calloc((void **)lens, (size_t)np * sizeof(int64_t), "prompt lengths");
    if (st != K3_OK) {
        k3_free(*ids);
        *ids = NULL;
        return st;
    }
    const char *p = text;
    int k = 0;
    int64_t tot = 0;
    while (1) {
        while (*p == ' ') p++;
        if (*p == ';' || *p == 0) {
            if ((*lens)[k] == 0) {
                st = K3_ERR(K3_ERR_ARG, "--prompt-ids: prompt %d is empty", k + 1);
                goto fail;
            }
            if (*p == 0) break;
            k++;
            p++;
            continue;
        }
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) {
            st = K3_ERR(K3_ERR_ARG, "--prompt-ids: prompt %d, id %lld: '%.12s' is not a token id",
                        k + 1, (long long)(*lens)[k] + 1, p);
            goto fail;
        }
        (*ids)[tot++] = (int32_t)v;
        (*lens)[k]++;
        p = end;
        while (*p == ' ') p++;
        if (*p == ',') {
            p++;
            while (*p == ' ') p++;
            if (*p == ';' || *p == 0) {
                st = K3_ERR(K3_ERR_ARG, "--prompt-ids: prompt %d ends with ','", k + 1);
                goto fail;
            }
        } else if (*p != ';' && *p != 0) {
            st = K3_ERR(K3_ERR_ARG, "--prompt-ids: prompt %d: unexpected '%c'", k + 1, *p);
            goto fail;
        }
    }
    *n_prompts = k + 1;
    return K3_OK;
fail:
    k3_free(*ids), k3_free(*lens);
    *ids = NULL, *lens = NULL;
    return st;
}

/* ---- set-up ------------------------------------------------------------------------------- */
static int ceil_div(int a, int b) {
    return (a + b - 1) / b;
}

/* Stop ids: the caller's, then (unless ignore_eos) config eos_token_id and the tokenizer's
 * <|end_of_msg|> and [EOS]; duplicates and ids outside the logits (>= vocab_size) dropped. */
static k3_status build_stops(rank_ctx *r) {
    const k3_rank_opts *o = r->o;
    size_t cap = o->sampling.n_stop_ids + 3;
    K3_TRY(k3_alloc((void **)&r->stop_ids, cap * sizeof(int32_t), "stop ids"));
    int32_t cand[3] = {-1, -1, -1};
    if (!o->ignore_eos) {
        cand[0] = r->cfg.eos_token_id;
        if (o->tok) {
            k3_tok_ctrl c = k3_tok_control_ids(o->tok);
            cand[1] = c.end_of_msg;
            cand[2] = c.eos;
        }
    }
    for (size_t i = 0; i < cap; i++) {
        int32_t id =
            i < o->sampling.n_stop_ids ? o->sampling.stop_ids[i] : cand[i - o->sampling.n_stop_ids];
        if (i < o->sampling.n_stop_ids && (id < 0 || id >= r->cfg.vocab_size))
            return K3_ERR(K3_ERR_ARG, "stop id %d is outside the vocabulary (vocab_size %lld)", id,
                          (long long)r->cfg.vocab_size);
        if (id < 0 || id >= r->cfg.vocab_size) continue;
        bool dup = false;
        for (size_t k = 0; k < r->n_stop_ids; k++) dup |= r->stop_ids[k] == id;
        if (!dup) r->stop_ids[r->n_stop_ids++] = id;
    }
    return K3_OK;
}

uint64_t k3_rank_seq_seed(uint64_t seed, int index) {
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * ((uint64_t)(uint32_t)index + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

const char *k3_rank_finish_reason(k3_stop_kind stop) {
    return stop == K3_STOP_NONE ? "length" : "stop";
}

void k3_rank_result_free(k3_rank_result *res) {
    if (!res) return;
    for (int i = 0; i < res->n_seqs; i++) k3_free(res->seqs[i].gen), k3_free(res->seqs[i].text);
    k3_free(res->seqs);
    res->seqs = NULL;
    res->n_seqs = 0;
}

/* Refuse a plan this rank cannot hold before allocating anything: a huge --n or prompt sizes
 * every sequence's caches for its whole context up front, and an OOM kill names nobody. */
static k3_status check_memory(const rank_ctx *r, const k3_plan_req *req) {
    const k3_rank_mem *m = &r->plan.mem[r->rank];
    uint64_t need = m->weights + m->caches + m->buffers;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return K3_OK; /* unknown: nothing to compare against */
    uint64_t have = (uint64_t)pages * (uint64_t)page;
    if (need <= have) return K3_OK;
    return K3_ERR(K3_ERR_NOMEM,
                  "rank %d needs %.2f GB (weights %.2f, caches %.2f for %d sequences of up to "
                  "%lld tokens (prompt + --n), buffers %.2f) but this machine has %.2f GB",
                  r->rank, need / 1e9, m->weights / 1e9, m->caches / 1e9, req->max_seqs_per_lane,
                  (long long)req->max_ctx, m->buffers / 1e9, have / 1e9);
}

/* Usage-type problems are identical on every rank: all return 2, rank 0 prints. Others: agree on
 * the worst status so nobody hangs in the next collective. */
static int setup(rank_ctx *r) {
    const k3_rank_opts *o = r->o;
    k3_status st = K3_OK;
    char *map = NULL;
    if (o->n_prompts < 1 || o->n_new < 0 || o->chunk < 0)
        st = K3_ERR(K3_ERR_ARG, "run: need at least one prompt, --n >= 0 and --chunk >= 0");
    if (st == K3_OK) st = k3_config_load(o->model_dir, &r->cfg);
    int64_t tot = 0;
    for (int i = 0; i < o->n_prompts && st == K3_OK; i++)
        for (int64_t t = 0; t < o->prompt_lens[i] && st == K3_OK; t++, tot++)
            if (o->prompt_ids[tot] < 0 || o->prompt_ids[tot] >= r->cfg.vocab_size)
                st = K3_ERR(K3_ERR_ARG,
                            "prompt %d: id %d at position %lld is not below vocab_size %lld", i + 1,
                            o->prompt_ids[tot], (long long)t, (long long)r->cfg.vocab_size);
    if (st == K3_OK) st = build_stops(r);
    if (st == K3_OK) { /* bad sampling parameters are a usage error every rank sees */
        k3_sampler *probe = NULL;
        k3_sampler_params sp = o->sampling;
        sp.stop_ids = r->stop_ids;
        sp.n_stop_ids = r->n_stop_ids;
        st = k3_sampler_create(&probe, &sp, r->cfg.vocab_size, o->tok);
        k3_sampler_destroy(probe);
    }
    if (st == K3_OK && o->expert_map_path) {
        size_t nb;
        st = k3_read_file(o->expert_map_path, &map, &nb);
    }
    int64_t maxP = 0;
    for (int i = 0; i < o->n_prompts; i++) maxP = K3_MAX(maxP, o->prompt_lens[i]);
    int E = K3_MAX(o->ep, 1), S = K3_MAX(o->pp, 1);
    r->n_groups = K3_MAX(1, K3_MIN(S, ceil_div(o->n_prompts, E)));
    /* the most sequences one lane has in one group */
    int most = 0;
    for (int e = 0; e < E; e++)
        for (int g = 0; g < r->n_groups; g++) {
            int n = 0;
            for (int i = 0; i < o->n_prompts; i++)
                n += (i % E == e) && ((i / E) % r->n_groups == g);
            most = K3_MAX(most, n);
        }
    int64_t step = o->chunk > 0 ? K3_MIN(o->chunk, maxP) : maxP;
    r->max_tokens = K3_MAX(1, (int64_t)most * K3_MAX(step, 1));
    if (st == K3_OK) {
        k3_plan_req req = {.world = r->world,
                           .pp = o->pp,
                           .ep = o->ep,
                           .coord = o->coord,
                           .expert_map = map,
                           .expert_map_name = o->expert_map_path,
                           .max_ctx = maxP + o->n_new,
                           .max_seqs_per_lane = ceil_div(o->n_prompts, E),
                           .max_tokens = r->max_tokens};
        st = k3_plan_make(&r->cfg, &req, &r->plan);
        if (st == K3_OK) st = check_memory(r, &req);
    }
    k3_free(map);
    /* agree before anything collective: 0 ok, 1 usage error, 2 other error */
    int local = st == K3_OK ? 0 : (st == K3_ERR_ARG ? 1 : 2), worst = 0;
    k3_status st2 =
        k3_comm_world_max(local, &worst, o->comm_timeout_s > 0 ? o->comm_timeout_s : 600);
    if (st2 != K3_OK) die(r, st2);
    /* a usage error is the same on every rank: rank 0 prints it; other errors each rank prints */
    if (local == 2 || (local == 1 && r->rank == 0))
        fprintf(stderr, "k3 run: %s\n", k3_last_error());
    if (local == 2 && r->world > 1) K3_LOGE("rank %d failed during set-up (see above)", r->rank);
    if (worst) return worst == 1 ? 2 : 1;
    return 0;
}

/* ---- loading ------------------------------------------------------------------------------ */
static bool expert_owned(void *ctx, int layer, int expert) {
    rank_ctx *r = ctx;
    return k3_plan_owner_lane(&r->plan, layer, expert) == r->lane;
}

static void draw_progress(rank_ctx *r) {
    double have = 0, tot = 0;
    int done = 0;
    for (int i = 0; i < r->world; i++) {
        double w = (double)r->plan.mem[i].weights;
        have += w * r->pct[i] / 100.0;
        tot += w;
        done += r->pct[i] >= 100;
    }
    double f = tot > 0 ? have / tot : 1;
    char bar[41];
    int n = (int)(f * 40 + 0.5);
    for (int i = 0; i < 40; i++) bar[i] = i < n ? '#' : ' ';
    bar[40] = 0;
    fprintf(r->tty, "\r[k3] loading [%s] %3.0f%%  %.1f of %.1f MB, %d/%d ranks done", bar, f * 100,
            have / 1e6, tot / 1e6, done, r->world);
    fflush(r->tty);
}

static bool poll_progress(rank_ctx *r) { /* true when some rank reported */
    bool any = false;
    for (;;) {
        k3_comm_msg m;
        bool got = false;
        RTRY(r, k3_comm_poll(r->comm, K3_ANY_RANK, K3_MSG_PROGRESS, &m, &got));
        if (!got) return any;
        k3_wire_progress wp;
        if (m.n_meta_bytes == (int64_t)sizeof wp && m.src >= 0 && m.src < r->world) {
            memcpy(&wp, m.meta, sizeof wp);
            if (wp.version == K3_WIRE_VERSION) r->pct[m.src] = K3_MAX(r->pct[m.src], wp.pct);
        }
        any = true;
    }
}

static void send_progress(rank_ctx *r, int pct) {
    if (r->rank == 0) {
        r->pct[0] = pct;
        poll_progress(r);
        draw_progress(r);
        return;
    }
    k3_wire_progress wp = {.version = K3_WIRE_VERSION, .pct = pct};
    RTRY(r, k3_comm_post(r->comm, 0, K3_MSG_PROGRESS, &wp, sizeof wp, NULL, 0));
}

static void on_progress(void *ctx, uint64_t done, uint64_t total) {
    rank_ctx *r = ctx;
    if (!r->show_progress || total == 0) return;
    int pct = (int)(100.0 * (double)done / (double)total);
    pct = pct >= 100 ? 100 : pct / 25 * 25; /* a few reports per rank keep it cheap */
    if (pct > r->last_pct_sent) {
        r->last_pct_sent = pct;
        send_progress(r, pct);
    }
}

static void load(rank_ctx *r) {
    double t0 = k3_now_s();
    if (r->worker) {
        if (r->fail_load_rank == r->rank)
            die(r, K3_ERR(K3_ERR_IO, "test hook K3_TEST_FAIL=load:%d: failing the load on purpose",
                          r->rank));
        RTRY(r, k3_ckpt_open(r->o->model_dir, &r->ck));
        int S = r->plan.n_stages;
        k3_backend_params bp = {.n_threads =
                                    r->o->n_threads > 0 ? r->o->n_threads : (r->world > 1 ? 1 : 0)};
        RTRY(r, k3_backend_create(r->o->backend ? r->o->backend : "cpu", &bp, &r->be));
        k3_load_sel sel = {.be = r->be,
                           .layer_begin = r->plan.stage_begin[r->stage],
                           .layer_end = r->plan.stage_begin[r->stage + 1],
                           .embed = r->stage == 0,
                           .head = r->stage == S - 1,
                           .expert_owned = expert_owned,
                           .ctx = r,
                           .progress = on_progress};
        RTRY(r, k3_weights_load(r->ck, &r->cfg, &sel, &r->w));
        r->view = k3_weights_get(r->w);
        r->bytes_read = k3_ckpt_bytes_read(r->ck);
        /* the loader must have honoured the plan: own experts present, others absent */
        for (int l = sel.layer_begin; l < sel.layer_end; l++) {
            const k3_layer_w *lw = &r->view->layers[l];
            if (!lw->present)
                die(r, K3_ERR(K3_ERR_INTERNAL, "layer %d of my stage was not loaded", l));
            if (!k3_config_is_moe(&r->cfg, l)) continue;
            for (int x = 0; x < r->cfg.n_experts; x++) {
                bool own = k3_plan_owner_lane(&r->plan, l, x) == r->lane;
                const k3_expert_w *ew = &lw->experts[x];
                bool loaded = ew->w1.data && ew->w2.data && ew->w3.data;
                if (loaded != own || (ew->present && !loaded))
                    die(r, K3_ERR(K3_ERR_INTERNAL,
                                  "layer %d expert %d: loaded=%d but the plan says owned=%d", l, x,
                                  loaded, own));
            }
        }
        if (r->show_progress && r->last_pct_sent < 100) {
            r->last_pct_sent = 100;
            send_progress(r, 100);
        }
    }
    r->load_s = k3_now_s() - t0;
    if (r->worker)
        K3_LOGI("loaded %.2f MB in %.2f s (%.2f GB/s); plan: %.2f MB", r->bytes_read / 1e6,
                r->load_s, r->load_s > 0 ? r->bytes_read / 1e9 / r->load_s : 0.0,
                r->plan.mem[r->rank].weights / 1e6);
    if (r->rank == 0 && r->show_progress) { /* wait for everyone's last report */
        r->pct[0] = 100 * r->worker + 100 * !r->worker;
        double t1 = k3_now_s();
        int backoff = 0;
        for (;;) {
            bool changed = poll_progress(r);
            int done = 0;
            for (int i = 0; i < r->world; i++)
                done += r->pct[i] >= 100 || !k3_plan_coords(&r->plan, i, NULL, NULL);
            if (changed || done == r->world) draw_progress(r);
            if (done == r->world) break;
            if (k3_now_s() - t1 > (r->o->comm_timeout_s > 0 ? r->o->comm_timeout_s : 600))
                die(r,
                    K3_ERR(K3_ERR_COMM, "load progress: some rank did not finish loading in time"));
            k3_comm_idle(r->comm, &backoff);
        }
        fprintf(r->tty, "\n");
        fflush(r->tty);
    }
}

/* ---- worker ------------------------------------------------------------------------------- */
static void worker_init(rank_ctx *r) {
    const k3_rank_opts *o = r->o;
    const k3_config *c = &r->cfg;
    int S = r->plan.n_stages, E = r->plan.n_lanes;
    const bool moe_remote = E > 1;
    if (moe_remote) { /* the owner lane of every (layer, expert) of this stage */
        RTRY(r, k3_calloc((void **)&r->lane_of,
                          (size_t)c->n_layers * (size_t)K3_MAX(c->n_experts, 1) * sizeof(int32_t),
                          "expert lane map"));
        for (int l = r->plan.stage_begin[r->stage]; l < r->plan.stage_begin[r->stage + 1]; l++)
            if (k3_config_is_moe(c, l))
                for (int x = 0; x < c->n_experts; x++)
                    r->lane_of[(size_t)l * (size_t)c->n_experts + (size_t)x] =
                        k3_plan_owner_lane(&r->plan, l, x);
    }
    k3_stage_params sp = {.cfg = c,
                          .w = r->view,
                          .be = r->be,
                          .layer_begin = r->plan.stage_begin[r->stage],
                          .layer_end = r->plan.stage_begin[r->stage + 1],
                          .first = r->stage == 0,
                          .last = r->stage == S - 1,
                          .max_tokens = r->max_tokens,
                          .kda_chunk = o->kda_chunk,
                          .comm = moe_remote ? r->comm : NULL,
                          .expert_lane = r->lane_of,
                          .n_lanes = E,
                          .deterministic = o->deterministic};
    RTRY(r, k3_stage_create(&sp, &r->st));
    RTRY(r, k3_calloc((void **)&r->states, (size_t)o->n_prompts * sizeof *r->states, "seq states"));
    RTRY(r, k3_calloc((void **)&r->bstates, (size_t)o->n_prompts * sizeof *r->bstates,
                      "batch states"));
    RTRY(r, k3_calloc((void **)&r->bntok, (size_t)o->n_prompts * sizeof *r->bntok, "batch tokens"));
    for (int i = 0; i < o->n_prompts; i++)
        if (k3_plan_lane_of_seq(&r->plan, i) == r->lane)
            RTRY(r, k3_seq_state_create(r->st, o->prompt_lens[i] + o->n_new, &r->states[i]));
    RTRY(r, k3_activ_alloc(r->be, &r->act, c, r->max_tokens));
    const size_t TD = (size_t)r->max_tokens * (size_t)c->hidden_size;
    const bool host = k3_backend_host_visible(r->be);
    if (r->stage == S - 1) {
        size_t nb = (size_t)r->max_tokens * (size_t)c->vocab_size * sizeof(float);
        RTRY(r, k3_backend_alloc(r->be, nb, "logits", (void **)&r->logits));
        if (!host) RTRY(r, k3_alloc((void **)&r->h_logits, nb, "logits (host)"));
    } else if (!host) {
        RTRY(r,
             k3_alloc((void **)&r->h_act, TD * (size_t)(1 + k3_activ_max_bank(c)) * sizeof(float),
                      "activation staging (host)"));
    }
}

static void worker_destroy(rank_ctx *r) {
    if (r->states)
        for (int i = 0; i < r->o->n_prompts; i++) k3_seq_state_destroy(r->states[i]);
    k3_free(r->states), k3_free(r->bstates), k3_free(r->bntok);
    if (r->be) {
        k3_activ_free(r->be, &r->act);
        k3_backend_free(r->be, r->logits);
    }
    k3_free(r->h_logits), k3_free(r->h_act), k3_free(r->lane_of);
    k3_stage_destroy(r->st);
    k3_weights_destroy(r->w);
    k3_ckpt_destroy(r->ck);
    /* r->be outlives the comm handle (its MoE buffers are the backend's): see k3_rank_run */
}

/* Process one BATCH/ACTIV message and send the result on. */
static void worker_step(rank_ctx *r, const step_msg *m) {
    const int S = r->plan.n_stages, D = (int)r->cfg.hidden_size;
    const int64_t V = r->cfg.vocab_size;
    const int32_t *mt = m->meta;
    char who[32];
    snprintf(who, sizeof who, "rank %d", m->src);
    if (m->h.n_meta < META_HDR)
        die(r, K3_ERR(K3_ERR_FORMAT, "step message from %s: %d meta", who, m->h.n_meta));
    int group = mt[0], stepi = mt[1], all_logits = mt[2], n_seqs = mt[3];
    if (n_seqs < 0 || n_seqs > r->o->n_prompts || m->h.n_meta < META_HDR + META_SEQ * n_seqs)
        die(r, K3_ERR(K3_ERR_FORMAT, "step message from %s: %d sequences, %d meta", who, n_seqs,
                      m->h.n_meta));
    int64_t T = 0;
    for (int i = 0; i < n_seqs; i++) {
        int seq = mt[META_HDR + META_SEQ * i], nt = mt[META_HDR + META_SEQ * i + 1];
        if (seq < 0 || seq >= r->o->n_prompts || !r->states[seq] || nt < 1)
            die(r, K3_ERR(K3_ERR_FORMAT,
                          "step %d of group %d from %s: sequence %d (%d tokens) is not on lane %d",
                          stepi, group, who, seq, nt, r->lane));
        r->bstates[i] = r->states[seq];
        r->bntok[i] = nt;
        T += nt;
    }
    if (T > r->max_tokens)
        die(r, K3_ERR(K3_ERR_STATE, "step with %lld tokens > planned %lld", (long long)T,
                      (long long)r->max_tokens));
    const int32_t *tokens = NULL;
    if (r->stage == 0) {
        if (m->h.n_meta != META_HDR + META_SEQ * n_seqs + T || m->h.T != T || m->n_f32 != 0)
            die(r, K3_ERR(K3_ERR_FORMAT, "BATCH from %s: %d meta, %lld floats for %lld tokens", who,
                          m->h.n_meta, (long long)m->n_f32, (long long)T));
        tokens = mt + META_HDR + META_SEQ * n_seqs;
    } else {
        if (m->h.T != T || m->h.D != D || m->h.n_bank < 0 ||
            m->h.n_bank > k3_activ_max_bank(&r->cfg) ||
            m->n_f32 != T * D * (1 + (int64_t)m->h.n_bank))
            die(r, K3_ERR(K3_ERR_FORMAT,
                          "ACTIV from %s: T %lld D %lld bank %d floats %lld (want T %lld D %d)",
                          who, (long long)m->h.T, (long long)m->h.D, m->h.n_bank,
                          (long long)m->n_f32, (long long)T, D));
        r->act.T = T;
        r->act.n_bank = m->h.n_bank;
        /* the message is host memory; the bank slabs follow h: [1 + n_bank, T, D] */
        RTRY(r, k3_backend_upload(r->be, r->act.h, m->f32, (size_t)(T * D) * sizeof(float)));
        if (m->h.n_bank)
            RTRY(r, k3_backend_upload(r->be, r->act.bank, m->f32 + T * D,
                                      (size_t)(T * D * m->h.n_bank) * sizeof(float)));
    }
    r->n_forward++;
    maybe_die_now(r, r->n_forward);
    if (n_seqs > 0) {
        k3_batch b = {
            .n_seqs = n_seqs, .states = r->bstates, .n_tokens = r->bntok, .token_ids = tokens};
        RTRY(r, k3_stage_forward(r->st, &b, &r->act, all_logits != 0,
                                 r->stage == S - 1 ? r->logits : NULL));
    } else {
        /* no sequences of this lane in the step: still serve our experts at every MoE layer */
        r->act.T = 0;
        r->act.n_bank = 0;
        RTRY(r, k3_stage_idle_step(r->st));
    }
    int n_meta_out = META_HDR + META_SEQ * n_seqs;
    if (r->stage == S - 1) {
        int64_t R = all_logits ? T : 0;
        float *lg = r->logits;
        if (r->h_logits) { /* logits cross to host memory here, and only here */
            int64_t rows = all_logits ? T : n_seqs;
            RTRY(r, k3_backend_download(r->be, r->h_logits, r->logits,
                                        (size_t)(rows * V) * sizeof(float)));
            lg = r->h_logits;
        }
        if (!all_logits) /* keep only the rows the coordinator samples from */
            for (int i = 0; i < n_seqs; i++)
                if (mt[META_HDR + META_SEQ * i + 2]) {
                    if (R != i) memmove(lg + R * V, lg + (int64_t)i * V, (size_t)V * sizeof(float));
                    R++;
                }
        post_step(r, 0, K3_MSG_LOGITS, (k3_wire_step){.T = T, .D = V, .R = R, .n_meta = n_meta_out},
                  mt, &(k3_f32_seg){lg, R * V}, 1);
    } else {
        int64_t nb = n_seqs ? r->act.n_bank : 0;
        k3_f32_seg seg[2] = {{r->act.h, T * D}, {r->act.bank, T * D * nb}};
        if (r->h_act) { /* h | bank to host memory for the wire */
            RTRY(r,
                 k3_backend_download(r->be, r->h_act, r->act.h, (size_t)(T * D) * sizeof(float)));
            if (nb)
                RTRY(r, k3_backend_download(r->be, r->h_act + T * D, r->act.bank,
                                            (size_t)(T * D * nb) * sizeof(float)));
            seg[0].p = r->h_act;
            seg[1].p = r->h_act + T * D;
        }
        post_step(
            r, k3_plan_rank(&r->plan, r->stage + 1, r->lane), K3_MSG_ACTIV,
            (k3_wire_step){.T = T, .D = D, .R = T, .n_bank = (int32_t)nb, .n_meta = n_meta_out}, mt,
            seg, 2);
    }
}

/* ---- coordinator -------------------------------------------------------------------------- */
static bool seq_active(const rank_ctx *r, const seq_run *q) {
    if (q->fed < q->P) return true;
    if (q->stop != K3_STOP_NONE) return false; /* a stopped sequence leaves the batch */
    return q->fed - q->P < q->n_gen && q->fed - q->P < r->o->n_new - 1;
}

static void coord_send_step(rank_ctx *r, int g) {
    group_run *gr = &r->groups[g];
    const int E = r->plan.n_lanes;
    const int n = r->o->n_prompts;
    bool any = false;
    for (int i = 0; i < n; i++) any |= r->seqs[i].group == g && seq_active(r, &r->seqs[i]);
    if (!any) {
        gr->done = true;
        return;
    }
    gr->step++;
    gr->pending = E;
    r->n_steps++;
    for (int e = 0; e < E; e++) {
        int32_t *mt = r->meta;
        int ns = 0;
        int64_t T = 0;
        mt[0] = g, mt[1] = gr->step, mt[2] = r->o->dump_logits != NULL;
        for (int i = 0; i < n; i++) {
            seq_run *q = &r->seqs[i];
            q->n_tok_step =
                q->group == g && q->lane == e && seq_active(r, q)
                    ? (q->fed < q->P
                           ? (r->o->chunk > 0 ? K3_MIN(r->o->chunk, q->P - q->fed) : q->P - q->fed)
                           : 1)
                    : 0;
            if (!q->n_tok_step) continue;
            mt[META_HDR + META_SEQ * ns] = i;
            mt[META_HDR + META_SEQ * ns + 1] = (int32_t)q->n_tok_step;
            ns++;
            T += q->n_tok_step;
        }
        mt[3] = ns;
        int32_t *tok = mt + META_HDR + META_SEQ * ns;
        for (int j = 0; j < ns; j++) {
            seq_run *q = &r->seqs[mt[META_HDR + META_SEQ * j]];
            for (int64_t t = 0; t < q->n_tok_step; t++) {
                int64_t pos = q->fed + t;
                *tok++ = pos < q->P ? q->prompt[pos] : q->gen[pos - q->P];
            }
            q->fed += q->n_tok_step;
            mt[META_HDR + META_SEQ * j + 2] = q->fed >= q->P && q->n_gen < r->o->n_new;
        }
        post_step(r, k3_plan_rank(&r->plan, 0, e), K3_MSG_BATCH,
                  (k3_wire_step){.T = T, .n_meta = (int32_t)(META_HDR + META_SEQ * ns + T)}, mt,
                  NULL, 0);
    }
}

/* Sample sequence q's next id from `logits` [V], record it, apply the stop rules. */
static void coord_sample(rank_ctx *r, seq_run *q, const float *logits) {
    int32_t id;
    RTRY(r, k3_sampler_sample(q->smp, logits, &id));
    q->gen[q->n_gen++] = id;
    k3_tok_bytes *emit = r->o->tok ? &q->text : NULL;
    RTRY(r, k3_sampler_accept(q->smp, id, emit, &q->stop));
    if (q->stop == K3_STOP_STRING) q->stop_string = k3_sampler_matched_stop(q->smp);
    if (q->stop == K3_STOP_NONE && q->n_gen == r->o->n_new)
        RTRY(r, k3_sampler_finish(q->smp, emit)); /* length: flush held text */
}

static void coord_on_logits(rank_ctx *r, const step_msg *m) {
    const int64_t V = r->cfg.vocab_size;
    const int32_t *mt = m->meta;
    if (m->h.n_meta < META_HDR)
        die(r, K3_ERR(K3_ERR_FORMAT, "LOGITS from rank %d: %d meta", m->src, m->h.n_meta));
    int g = mt[0], stepi = mt[1], all = mt[2], ns = mt[3];
    if (g < 0 || g >= r->n_groups || stepi != r->groups[g].step || r->groups[g].pending <= 0 ||
        ns < 0 || m->h.n_meta != META_HDR + META_SEQ * ns)
        die(r, K3_ERR(K3_ERR_FORMAT,
                      "LOGITS from rank %d: group %d step %d (expected step %d), %d sequences",
                      m->src, g, stepi, g >= 0 && g < r->n_groups ? r->groups[g].step : -1, ns));
    int64_t T = 0, n_want = 0;
    for (int j = 0; j < ns; j++)
        T += mt[META_HDR + META_SEQ * j + 1], n_want += mt[META_HDR + META_SEQ * j + 2] != 0;
    int64_t R = all ? T : n_want;
    if (m->h.D != V || m->h.R != R || m->n_f32 != R * V)
        die(r, K3_ERR(K3_ERR_FORMAT, "LOGITS from rank %d: [%lld, %lld] rows, want [%lld, %lld]",
                      m->src, (long long)m->h.R, (long long)m->h.D, (long long)R, (long long)V));
    r->logits_bytes += m->n_bytes;
    r->n_logits_msgs++;
    if (!r->worker) maybe_die_now(r, r->n_logits_msgs);
    int64_t row = 0;
    for (int j = 0; j < ns; j++) {
        int i = mt[META_HDR + META_SEQ * j], nt = mt[META_HDR + META_SEQ * j + 1];
        bool want = mt[META_HDR + META_SEQ * j + 2] != 0;
        if (i < 0 || i >= r->o->n_prompts) die(r, K3_ERR(K3_ERR_FORMAT, "LOGITS: sequence %d", i));
        seq_run *q = &r->seqs[i];
        const float *last = NULL;
        if (all) {
            if (q->dump)
                memcpy(q->dump + q->dump_rows * V, m->f32 + row * V,
                       (size_t)(nt * V) * sizeof(float));
            q->dump_rows += nt;
            last = m->f32 + (row + nt - 1) * V;
            row += nt;
        } else if (want) {
            last = m->f32 + row * V;
            row++;
        }
        if (want != (q->fed >= q->P && q->n_gen < r->o->n_new))
            die(r, K3_ERR(K3_ERR_FORMAT, "LOGITS from rank %d: sequence %d: want=%d is out of step",
                          m->src, i, want));
        if (want) {
            for (int64_t v = 0; v < V; v++)
                if (last[v] != last[v])
                    die(r, K3_ERR(K3_ERR_STATE, "sequence %d: NaN logit at vocab %lld", i,
                                  (long long)v));
            coord_sample(r, q, last);
        }
    }
    if (--r->groups[g].pending == 0) {
        bool all_first = true;
        for (int i = 0; i < r->o->n_prompts; i++)
            all_first &=
                r->seqs[i].fed >= r->seqs[i].P && (r->seqs[i].n_gen > 0 || r->o->n_new == 0);
        if (all_first && r->t_prefill_done == 0) r->t_prefill_done = k3_now_s();
        coord_send_step(r, g);
    }
}

static bool coord_done(const rank_ctx *r) {
    for (int g = 0; g < r->n_groups; g++)
        if (!r->groups[g].done) return false;
    return true;
}

static void coord_init(rank_ctx *r) {
    const k3_rank_opts *o = r->o;
    int n = o->n_prompts, E = r->plan.n_lanes;
    RTRY(r, k3_calloc((void **)&r->seqs, (size_t)n * sizeof *r->seqs, "sequences"));
    RTRY(r, k3_calloc((void **)&r->groups, (size_t)r->n_groups * sizeof *r->groups, "groups"));
    const int32_t *p = o->prompt_ids;
    int64_t maxT = 0;
    for (int i = 0; i < n; i++) {
        seq_run *q = &r->seqs[i];
        q->prompt = p;
        q->P = o->prompt_lens[i];
        p += q->P;
        q->lane = k3_plan_lane_of_seq(&r->plan, i);
        q->group = (i / E) % r->n_groups;
        maxT += q->P;
        RTRY(r, k3_calloc((void **)&q->gen, (size_t)K3_MAX(o->n_new, 1) * sizeof(int32_t),
                          "generated ids"));
        k3_sampler_params sp = o->sampling;
        sp.seed = k3_rank_seq_seed(o->sampling.seed, i);
        sp.stop_ids = r->stop_ids;
        sp.n_stop_ids = r->n_stop_ids;
        q->stop_string = -1;
        RTRY(r, k3_sampler_create(&q->smp, &sp, r->cfg.vocab_size, o->tok));
        if (o->dump_logits)
            RTRY(r, k3_alloc((void **)&q->dump,
                             (size_t)(q->P + o->n_new) * (size_t)r->cfg.vocab_size * sizeof(float),
                             "logits dump"));
    }
    r->meta_cap = META_HDR + META_SEQ * n + maxT;
    RTRY(r, k3_alloc((void **)&r->meta, (size_t)r->meta_cap * sizeof(int32_t), "step meta"));
}

static void coord_destroy(rank_ctx *r) {
    if (r->seqs)
        for (int i = 0; i < r->o->n_prompts; i++) {
            k3_free(r->seqs[i].gen), k3_free(r->seqs[i].dump);
            k3_sampler_destroy(r->seqs[i].smp);
            k3_tok_bytes_free(&r->seqs[i].text);
        }
    k3_free(r->seqs), k3_free(r->groups), k3_free(r->meta);
}

/* ---- the event loop: coordinator and/or worker on one thread ----------------------------- */
static void run_loop(rank_ctx *r) {
    double timeout = r->o->comm_timeout_s > 0 ? r->o->comm_timeout_s : 600;
    int in_peer = -1;
    k3_msg_kind in_kind = K3_MSG_BATCH;
    if (r->worker) {
        in_peer = r->stage == 0 ? 0 : k3_plan_rank(&r->plan, r->stage - 1, r->lane);
        in_kind = r->stage == 0 ? K3_MSG_BATCH : K3_MSG_ACTIV;
    }
    if (r->coord) {
        r->t_gen0 = k3_now_s();
        for (int g = 0; g < r->n_groups; g++) coord_send_step(r, g);
    }
    bool worker_live = r->worker, coord_live = r->coord, stop_sent = false;
    double last = k3_now_s();
    int backoff = 0;
    while (worker_live || coord_live) {
        bool progressed = false;
        step_msg m;
        bool got;
        if (coord_live) {
            poll_step(r, K3_ANY_RANK, K3_MSG_LOGITS, &m, &got);
            if (got) {
                coord_on_logits(r, &m);
                progressed = true;
            }
            if (coord_done(r) && !stop_sent) {
                for (int w = 0; w < r->world; w++)
                    if (k3_plan_coords(&r->plan, w, NULL, NULL))
                        RTRY(r, k3_comm_post(r->comm, w, K3_MSG_STOP, NULL, 0, NULL, 0));
                stop_sent = true;
                coord_live = false;
                progressed = true;
            }
        }
        if (worker_live) {
            poll_step(r, in_peer, in_kind, &m, &got);
            if (got) {
                worker_step(r, &m);
                progressed = true;
            } else {
                k3_comm_msg stop;
                RTRY(r, k3_comm_poll(r->comm, 0, K3_MSG_STOP, &stop, &got));
                if (got) worker_live = false, progressed = true;
            }
        }
        if (progressed) {
            last = k3_now_s();
            backoff = 0;
            continue;
        }
        if (k3_now_s() - last > timeout) {
            if (coord_live) {
                int g = 0;
                while (g < r->n_groups && r->groups[g].done) g++;
                die(r, K3_ERR(K3_ERR_COMM,
                              "coordinator: no logits for micro-batch %d step %d (%d of %d lanes "
                              "of the last stage, "
                              "ranks %d-%d, missing) within %.0f s (--comm-timeout)",
                              g, g < r->n_groups ? r->groups[g].step : -1,
                              g < r->n_groups ? r->groups[g].pending : 0, r->plan.n_lanes,
                              k3_plan_rank(&r->plan, r->plan.n_stages - 1, 0),
                              k3_plan_rank(&r->plan, r->plan.n_stages - 1, r->plan.n_lanes - 1),
                              timeout));
            }
            die(r, K3_ERR(K3_ERR_COMM, "worker: no %s from rank %d within %.0f s (--comm-timeout)",
                          in_kind == K3_MSG_BATCH ? "batch" : "activation", in_peer, timeout));
        }
        k3_comm_idle(r->comm, &backoff);
    }
    RTRY(r, k3_comm_flush(r->comm));
}

/* ---- output ------------------------------------------------------------------------------- */
static k3_status write_npy(const char *path, const float *data, int64_t rows, int64_t cols) {
    char hdr[128];
    int n = snprintf(hdr, sizeof hdr,
                     "{'descr': '<f4', 'fortran_order': False, 'shape': (%lld, %lld), }",
                     (long long)rows, (long long)cols);
    int total = 10 + n + 1;
    int pad = (64 - total % 64) % 64;
    FILE *f = fopen(path, "wb");
    if (!f) return K3_ERR(K3_ERR_IO, "--dump-logits %s: %s", path, strerror(errno));
    uint16_t hl = (uint16_t)(n + pad + 1);
    unsigned char magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
    bool ok = fwrite(magic, 1, 8, f) == 8 && fwrite(&hl, 2, 1, f) == 1 &&
              fwrite(hdr, 1, (size_t)n, f) == (size_t)n;
    for (int i = 0; i < pad && ok; i++) ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF;
    ok = ok && fwrite(data, sizeof(float), (size_t)(rows * cols), f) == (size_t)(rows * cols);
    ok = (fclose(f) == 0) && ok;
    return ok ? K3_OK : K3_ERR(K3_ERR_IO, "--dump-logits %s: write failed", path);
}

static cJSON *ids_json(const int32_t *p, int64_t n) {
    cJSON *a = cJSON_CreateArray();
    for (int64_t i = 0; i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(p[i]));
    return a;
}

static const char *seq_text(const seq_run *q) {
    return q->text.data ? q->text.data : "";
}

static void report(rank_ctx *r, const uint64_t *bytes, const uint64_t *load_us, double t_end) {
    const k3_rank_opts *o = r->o;
    int64_t V = r->cfg.vocab_size;
    if (o->dump_logits) {
        int64_t rows = 0;
        for (int i = 0; i < o->n_prompts; i++) rows += r->seqs[i].dump_rows;
        float *all = NULL;
        RTRY(r, k3_alloc((void **)&all, (size_t)K3_MAX(rows, 1) * (size_t)V * sizeof(float),
                         "logits dump"));
        int64_t off = 0;
        for (int i = 0; i < o->n_prompts; i++) {
            memcpy(all + off * V, r->seqs[i].dump,
                   (size_t)(r->seqs[i].dump_rows * V) * sizeof(float));
            off += r->seqs[i].dump_rows;
        }
        k3_status s = write_npy(o->dump_logits, all, rows, V);
        k3_free(all);
        RTRY(r, s);
    }
    int64_t n_prompt_tok = 0, n_gen_tok = 0;
    for (int i = 0; i < o->n_prompts; i++)
        n_prompt_tok += r->seqs[i].P, n_gen_tok += r->seqs[i].n_gen;
    double load_s = 0;
    for (int i = 0; i < r->world; i++) load_s = K3_MAX(load_s, load_us[i] / 1e6);
    double pre = (r->t_prefill_done > 0 ? r->t_prefill_done : t_end) - r->t_gen0,
           dec = t_end - (r->t_prefill_done > 0 ? r->t_prefill_done : t_end);
    int64_t n_dec = n_gen_tok - o->n_prompts * (o->n_new > 0);
    if (o->result) {
        k3_rank_result *res = o->result;
        RTRY(r, k3_calloc((void **)&res->seqs, (size_t)o->n_prompts * sizeof *res->seqs,
                          "run results"));
        res->n_seqs = o->n_prompts;
        for (int i = 0; i < o->n_prompts; i++) {
            seq_run *q = &r->seqs[i];
            k3_rank_seq_result *d = &res->seqs[i];
            RTRY(r, k3_alloc((void **)&d->gen, (size_t)K3_MAX(q->n_gen, 1) * sizeof(int32_t),
                             "run results"));
            memcpy(d->gen, q->gen, (size_t)q->n_gen * sizeof(int32_t));
            d->n_gen = q->n_gen;
            d->stop = q->stop;
            d->stop_string = q->stop_string;
            if (o->tok) {
                RTRY(r, k3_alloc((void **)&d->text, q->text.n + 1, "run results"));
                if (q->text.n) memcpy(d->text, q->text.data, q->text.n);
                d->text[q->text.n] = 0;
                d->n_text = q->text.n;
            }
        }
    }
    if (o->quiet) {
        K3_LOGI("load %.2f s, prefill %.3f s, decode %.3f s", load_s, pre, dec);
        return;
    }
    if (!o->json) {
        /* per prompt: one line of ids, then (with a tokenizer) the decoded text */
        for (int i = 0; i < o->n_prompts; i++) {
            for (int k = 0; k < r->seqs[i].n_gen; k++)
                printf("%s%d", k ? "," : "", r->seqs[i].gen[k]);
            printf("\n");
            if (o->tok) printf("%s\n", r->seqs[i].text.data ? r->seqs[i].text.data : "");
        }
        K3_LOGI("load %.2f s, prefill %.3f s (%.1f tok/s), decode %.3f s (%.1f tok/s), logits %.2f "
                "MB in %d messages",
                load_s, pre, pre > 0 ? n_prompt_tok / pre : 0.0, dec, dec > 0 ? n_dec / dec : 0.0,
                r->logits_bytes / 1e6, r->n_logits_msgs);
        if (r->plan.n_lanes > 1)
            K3_LOGI("MoE exchange (%s combine): dispatch %llu B, combine %llu B, %.0f B per step "
                    "(%llu steps)",
                    o->deterministic ? "deterministic per-item" : "pre-summed",
                    (unsigned long long)r->moe_dispatch_bytes,
                    (unsigned long long)r->moe_combine_bytes,
                    r->n_steps ? (double)(r->moe_dispatch_bytes + r->moe_combine_bytes) /
                                     (double)r->n_steps
                               : 0.0,
                    (unsigned long long)r->n_steps);
        return;
    }
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "prompt_ids", ids_json(r->seqs[0].prompt, r->seqs[0].P));
    cJSON_AddItemToObject(root, "generated_ids", ids_json(r->seqs[0].gen, r->seqs[0].n_gen));
    if (o->tok) cJSON_AddStringToObject(root, "text", seq_text(&r->seqs[0]));
    cJSON_AddStringToObject(root, "finish_reason", k3_rank_finish_reason(r->seqs[0].stop));
    cJSON *res = cJSON_AddArrayToObject(root, "results");
    for (int i = 0; i < o->n_prompts; i++) {
        cJSON *it = cJSON_CreateObject();
        cJSON_AddItemToObject(it, "prompt_ids", ids_json(r->seqs[i].prompt, r->seqs[i].P));
        cJSON_AddItemToObject(it, "generated_ids", ids_json(r->seqs[i].gen, r->seqs[i].n_gen));
        if (o->tok) cJSON_AddStringToObject(it, "text", seq_text(&r->seqs[i]));
        cJSON_AddStringToObject(it, "finish_reason", k3_rank_finish_reason(r->seqs[i].stop));
        cJSON_AddItemToArray(res, it);
    }
    cJSON *tm = cJSON_AddObjectToObject(root, "timings");
    cJSON_AddNumberToObject(tm, "load_s", load_s);
    cJSON_AddNumberToObject(tm, "prefill_s", pre);
    cJSON_AddNumberToObject(tm, "decode_s", dec);
    cJSON_AddNumberToObject(tm, "prefill_tok_s", pre > 0 ? n_prompt_tok / pre : 0);
    cJSON_AddNumberToObject(tm, "decode_tok_s", dec > 0 ? n_dec / dec : 0);
    cJSON *d = cJSON_AddObjectToObject(root, "dist");
    cJSON_AddNumberToObject(d, "world", r->world);
    cJSON_AddNumberToObject(d, "pp", r->plan.n_stages);
    cJSON_AddNumberToObject(d, "ep", r->plan.n_lanes);
    cJSON_AddStringToObject(d, "coordinator",
                            r->plan.coord == K3_COORD_DEDICATED ? "dedicated" : "shared");
    cJSON_AddBoolToObject(d, "deterministic", o->deterministic);
    char hx[24];
    snprintf(hx, sizeof hx, "%016llx", (unsigned long long)r->plan.hash);
    cJSON_AddStringToObject(d, "plan_hash", hx);
    cJSON_AddNumberToObject(d, "micro_batches", r->n_groups);
    cJSON_AddNumberToObject(d, "logits_bytes", (double)r->logits_bytes);
    cJSON_AddNumberToObject(d, "logits_messages", r->n_logits_msgs);
    cJSON_AddStringToObject(d, "combine", o->deterministic ? "per-item" : "presum");
    cJSON_AddNumberToObject(d, "moe_dispatch_bytes", (double)r->moe_dispatch_bytes);
    cJSON_AddNumberToObject(d, "moe_combine_bytes", (double)r->moe_combine_bytes);
    cJSON_AddNumberToObject(d, "steps", (double)r->n_steps);
    cJSON_AddNumberToObject(d, "moe_bytes_per_step",
                            r->n_steps ? (double)(r->moe_dispatch_bytes + r->moe_combine_bytes) /
                                             (double)r->n_steps
                                       : 0.0);
    cJSON *st = cJSON_AddArrayToObject(d, "stages");
    for (int s = 0; s < r->plan.n_stages; s++) {
        cJSON *a = cJSON_CreateArray();
        cJSON_AddItemToArray(a, cJSON_CreateNumber(r->plan.stage_begin[s]));
        cJSON_AddItemToArray(a, cJSON_CreateNumber(r->plan.stage_begin[s + 1]));
        cJSON_AddItemToArray(st, a);
    }
    cJSON *rk = cJSON_AddArrayToObject(d, "ranks");
    for (int i = 0; i < r->world; i++) {
        int s, e;
        k3_plan_coords(&r->plan, i, &s, &e);
        cJSON *it = cJSON_CreateObject();
        cJSON_AddNumberToObject(it, "rank", i);
        cJSON_AddNumberToObject(it, "stage", s);
        cJSON_AddNumberToObject(it, "lane", e);
        cJSON_AddNumberToObject(it, "bytes_read", (double)bytes[i]);
        cJSON_AddNumberToObject(it, "plan_weight_bytes", (double)r->plan.mem[i].weights);
        cJSON_AddNumberToObject(it, "load_s", load_us[i] / 1e6);
        cJSON_AddItemToArray(rk, it);
    }
    char *txt = cJSON_PrintUnformatted(root);
    if (txt) printf("%s\n", txt);
    cJSON_free(txt);
    cJSON_Delete(root);
}

/* ---- entry -------------------------------------------------------------------------------- */
int k3_rank_run(const k3_rank_opts *o) {
    rank_ctx r_, *r = &r_;
    memset(r, 0, sizeof *r);
    r->o = o;
    r->stage = r->lane = -1;
    k3_comm_world(&r->rank, &r->world);
    parse_test_fail(r);
    int rc = setup(r);
    if (rc) {
        k3_plan_free(&r->plan);
        k3_free(r->stop_ids);
        return rc;
    }
    r->worker = k3_plan_coords(&r->plan, r->rank, &r->stage, &r->lane);
    r->coord = r->rank == 0;
    k3_log_set_rank(r->rank, r->stage, r->lane);
    double tmo = o->comm_timeout_s > 0 ? o->comm_timeout_s : 600;
    RTRY(r, k3_comm_create("mpi",
                           &(k3_comm_params){.n_stages = r->plan.n_stages,
                                             .n_lanes = r->plan.n_lanes,
                                             .first_worker = r->plan.first_worker,
                                             .timeout_s = tmo},
                           &r->comm));
    /* every rank derived the plan itself; they must agree */
    uint64_t *all = NULL, *bytes = NULL, *load_us = NULL;
    RTRY(r, k3_calloc((void **)&all, (size_t)r->world * sizeof(uint64_t), "plan hashes"));
    RTRY(r, k3_calloc((void **)&bytes, (size_t)r->world * sizeof(uint64_t), "bytes read"));
    RTRY(r, k3_calloc((void **)&load_us, (size_t)r->world * sizeof(uint64_t), "load times"));
    if (r->fail_plan_rank == r->rank) r->plan.hash ^= 1; /* test hook: a rank with another plan */
    RTRY(r, k3_comm_allgather_u64(r->comm, r->plan.hash, all));
    for (int i = 0; i < r->world; i++)
        if (all[i] != r->plan.hash)
            die(r,
                K3_ERR(K3_ERR_STATE,
                       "plan hash differs: rank %d has %016llx, rank %d has %016llx (different "
                       "config.json or expert map?)",
                       r->rank, (unsigned long long)r->plan.hash, i, (unsigned long long)all[i]));
    if (r->rank == 0 && r->world > 1) { /* a world of one is the plain single-process run */
        char table[16384];
        k3_plan_format(&r->plan, &r->cfg, table, sizeof table);
        fprintf(stderr, "%s", table);
    }
    if (r->rank == 0) {
        K3_LOGI("%d prompt%s, %d micro-batch%s in flight, %s combine", o->n_prompts,
                o->n_prompts > 1 ? "s" : "", r->n_groups, r->n_groups > 1 ? "es" : "",
                o->deterministic ? "deterministic (per-item)" : "pre-summed");
    }
    /* the bar: on rank 0's terminal; under mpirun stderr is a pipe, but /dev/tty may be ours */
    if (r->rank == 0)
        r->tty = isatty(2) ? stderr : (k3_comm_launched() ? fopen("/dev/tty", "w") : NULL);
    int tty = r->tty != NULL;
    int any_tty = 0;
    RTRY(r, k3_comm_world_max(tty, &any_tty, tmo));
    r->show_progress = any_tty != 0;
    if (r->show_progress && r->rank == 0)
        RTRY(r, k3_calloc((void **)&r->pct, (size_t)r->world * sizeof(int), "progress"));
    load(r);
    /* other ranks may still be loading (a real checkpoint takes minutes): wait longer here */
    k3_comm_set_timeout(r->comm, K3_MAX(tmo, 3600.0));
    RTRY(r, k3_comm_allgather_u64(r->comm, r->bytes_read, bytes));
    k3_comm_set_timeout(r->comm, tmo);
    RTRY(r, k3_comm_allgather_u64(r->comm, (uint64_t)(r->load_s * 1e6), load_us));
    if (r->rank == 0) {
        uint64_t sum = 0, plan_sum = 0;
        for (int i = 0; i < r->world; i++) sum += bytes[i], plan_sum += r->plan.mem[i].weights;
        double ls = 0;
        for (int i = 0; i < r->world; i++) ls = K3_MAX(ls, load_us[i] / 1e6);
        K3_LOGI("all ranks loaded %.2f MB in %.2f s (%.2f GB/s aggregate); plan %.2f MB", sum / 1e6,
                ls, ls > 0 ? sum / 1e9 / ls : 0.0, plan_sum / 1e6);
        if (sum != plan_sum)
            K3_LOGW("bytes read (%llu) differ from the plan (%llu)", (unsigned long long)sum,
                    (unsigned long long)plan_sum);
    }
    if (r->worker) worker_init(r);
    if (r->coord) coord_init(r);
    RTRY(r, k3_comm_barrier(r->comm));
    run_loop(r);
    double t_end = k3_now_s();
    { /* MoE traffic of the whole world (both combine modes report it, to be compared) */
        k3_comm_stats cs;
        k3_comm_get_stats(r->comm, &cs);
        RTRY(r, k3_comm_allgather_u64(r->comm, cs.dispatch_bytes, all));
        for (int i = 0; i < r->world; i++) r->moe_dispatch_bytes += all[i];
        RTRY(r, k3_comm_allgather_u64(r->comm, cs.combine_bytes, all));
        for (int i = 0; i < r->world; i++) r->moe_combine_bytes += all[i];
    }
    if (r->coord) report(r, bytes, load_us, t_end);
    fflush(stdout);
    RTRY(r, k3_comm_barrier(r->comm));
    if (r->worker) {
        k3_comm_stats cs;
        k3_comm_get_stats(r->comm, &cs);
        K3_LOGD("forward steps %d, MoE rows sent %llu (dispatch) + %llu (combine)", r->n_forward,
                (unsigned long long)cs.dispatch_rows, (unsigned long long)cs.combine_rows);
    }
    coord_destroy(r);
    worker_destroy(r);
    k3_free(all), k3_free(bytes), k3_free(load_us), k3_free(r->pct);
    if (r->tty && r->tty != stderr) fclose(r->tty);
    k3_comm_destroy(r->comm);
    k3_backend_destroy(r->be);
    k3_plan_free(&r->plan);
    k3_free(r->stop_ids);
    k3_free(r->wire);
    return 0;
}
