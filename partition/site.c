/* site.c — device profiles, the cost model behind `k3 plan`'s predicted throughput, the memory fit
 * and the grid search over S x E. Pure: no I/O (the launcher reads a site file), no MPI.
 *
 * The cost model (one decode round = every micro-batch group advances every sequence by one token;
 * this engine's MoE exchange is synchronous and fp32, so nothing below overlaps):
 *   b  = ceil(max_seqs / M) sequences per lane per group step, M = S micro-batch groups.
 *   Per stage s and group step, per device (every lane of a stage does the same work):
 *     bytes  = non-expert weights of the stage (read once per step, replicated on each lane)
 *            + per MoE layer: the experts this lane owns that the step touches; with n = E b tokens
 *              in the EP group picking K of X experts, X (1 - (1 - K/X)^n) experts are touched,
 *              1/E of them on each lane (x one expert's bytes)
 *            + per sequence: KDA recurrent state read + written (2 x H dk dv x 4 B per KDA layer)
 *              and the MLA latent cache read at half the context (max_ctx/2 x (kv_lora+rope) x 4 B)
 *     flops  = 2 x b x (non-expert parameters + K/X of the stage's expert parameters)
 *            + attention per token: MLA 2 H (2 kv_lora + rope) ctx/2, KDA 4 H dk dv per layer
 *     a2a    = per MoE layer, dispatch + combine: 2 x b K x row width x 4 B x (E-1)/E over the
 *              slowest link of the EP group (NVLink inside a node, the NIC across) + 3 latencies
 *              (comm_moe.c crosses the link 3 times a layer: the headers, the rows, the return)
 *     t_s    = max(bytes / mem_bw, flops / flops_rate) + a2a
 *   hand-off = b x D x (1 + AttnRes bank) x 4 B per stage boundary over its link + latency
 *   logits   = E b V x 4 B into rank 0 (the coordinator samples: its ingress carries every lane)
 *   latency  = sum of t_s + (S-1) hand-offs + logits: one group's trip through the pipeline
 *   period   = max(latency, M max_s t_s, M logits): a round; decode tok/s = E max_seqs / period
 *   bubble   = 1 - M max_s t_s / period (the slowest stage's idle share; (S-1)/(M+S-1) at start-up)
 *   prefill: the same with T = max_tokens prompt tokens per lane per step in place of b decode
 *            rows, attention over T/2, every expert touched; tok/s = E T / max(max t_s, lat / M).
 *   load    = the largest node's read bytes / fs_bps: each node reads its own ranks' tensors, a
 *             stage's dense weights once for its lanes there (k3_plan_node_bytes).
 * The rates are nominal per-direction figures (an upper bound: no kernel reaches them), so the
 * prediction ranks splits and sizes expectations; bench measures. */
#include "k3_partition.h"

#include <math.h>
#include <stdio.h>

/* Link crossings of one MoE layer's exchange (comm_moe.c: the per-lane headers, the dispatched
 * rows, the returned rows), each paying the link's latency. */
enum { K3_MOE_CROSSINGS = 3 };

/* ---- profiles ------------------------------------------------------------------------------ */
typedef struct profile {
    const char *name;
    bool gpu;
    double mem_gb, mem_bw_gbs, tflops, intra_gbs, inter_gbs, intra_us, inter_us;
    int cores_per_node;
    const char *source;
} profile;

/* clang-format off */
static const profile k_profiles[] = {
    {"h200", true, 141, 4800, 989, 450, 50, 10, 20, 112,
     "NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity (989 "
     "dense; Hopper has no FP4 MMA, so MXFP4 experts run as W4A16 at the BF16 rate, "
     "DISTRIBUTED.md §0), NVLink 900 GB/s bidirectional = 450 GB/s a direction; DGX H200: "
     "1 ConnectX-7 400 Gb/s (50 GB/s) per GPU, 2 x 56-core Xeon 8480C per node; latencies "
     "10/20 us per NCCL send/recv group are assumed"},
    {"h100", true, 80, 3350, 989, 450, 50, 10, 20, 112,
     "NVIDIA H100 SXM datasheet: 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity (989 "
     "dense), NVLink 900 GB/s bidirectional; DGX H100: 1 ConnectX-7 400 Gb/s per GPU, 2 x "
     "56-core Xeon 8480C; latencies assumed as h200"},
    {"b200", true, 180, 8000, 2250, 900, 50, 10, 20, 112,
     "NVIDIA DGX B200 datasheet: 1,440 GB HBM3e and 64 TB/s for 8 GPUs (180 GB, 8 TB/s each), "
     "72 PFLOPS FP8 with sparsity for 8 (BF16 dense 2.25 PFLOPS a GPU), NVLink 5 1.8 TB/s "
     "bidirectional = 900 GB/s a direction, 8 ConnectX-7 400 Gb/s, 2 x 56-core Xeon 8570; "
     "latencies assumed as h200"},
    {"cpu", false, 23.5 * 1.073741824, 50, 0.38, 1.0, 1.25, 20, 50, 2,
     "the build environment's measurements (ENVIRONMENT.md), on the 2-core Zen 5 build machine: 23.5 GiB RAM, "
     "STREAM triad 52-69 GB/s on 2 cores (50 used), fp32 SGEMM 186 GFLOP/s a core (0.38 "
     "TFLOPS a node), MPI_Alltoallv 4 MiB a peer on 4 ranks (ob1/vader) 10-13 ms = ~1 GB/s a "
     "rank; across nodes 10 GbE TCP (1.25 GB/s) assumed. Node figures are shared by the node's "
     "ranks"},
};
/* clang-format on */

k3_status k3_site_builtin(const char *gpu, int nodes, int rpn, k3_site *out) {
    memset(out, 0, sizeof *out);
    const profile *p = NULL;
    for (size_t i = 0; i < K3_ARRAY_LEN(k_profiles); i++)
        if (gpu && strcmp(gpu, k_profiles[i].name) == 0) p = &k_profiles[i];
    if (!p)
        return K3_ERR(K3_ERR_ARG, "--gpu: '%s' is not one of h200|h100|b200|cpu",
                      gpu ? gpu : "(null)");
    if (nodes < 1 || rpn < 1)
        return K3_ERR(K3_ERR_ARG, "--nodes %d / --gpus-per-node %d: need at least 1", nodes, rpn);
    snprintf(out->name, sizeof out->name, "%s", p->name);
    snprintf(out->source, sizeof out->source, "%s", p->source);
    out->nodes = nodes;
    out->ranks_per_node = rpn;
    out->cores_per_node = p->cores_per_node;
    out->gpu = p->gpu;
    /* a cpu "device" is a rank's share of its node */
    const double share = p->gpu ? 1.0 : 1.0 / rpn;
    out->mem_bytes = p->mem_gb * 1e9 * share;
    out->mem_bw = p->mem_bw_gbs * 1e9 * share;
    out->flops = p->tflops * 1e12 * share;
    out->intra_bw = p->intra_gbs * 1e9;
    out->inter_bw = p->inter_gbs * 1e9;
    out->intra_lat_s = p->intra_us * 1e-6;
    out->inter_lat_s = p->inter_us * 1e-6;
    return K3_OK;
}

k3_status k3_site_check(const k3_site *s) {
    const struct {
        const char *name;
        double v;
    } f[] = {{"nodes", s->nodes},         {"ranks_per_node", s->ranks_per_node},
             {"mem_bytes", s->mem_bytes}, {"mem_bw", s->mem_bw},
             {"flops", s->flops},         {"intra_bw", s->intra_bw},
             {"inter_bw", s->inter_bw},   {"cores_per_node", s->cores_per_node}};
    for (size_t i = 0; i < K3_ARRAY_LEN(f); i++)
        if (!(f[i].v > 0) || !isfinite(f[i].v))
            return K3_ERR(K3_ERR_ARG, "site %s: %s must be > 0 (got %g)", s->name, f[i].name,
                          f[i].v);
    if (!(s->intra_lat_s >= 0) || !(s->inter_lat_s >= 0))
        return K3_ERR(K3_ERR_ARG, "site %s: latencies must be >= 0", s->name);
    return K3_OK;
}

/* The ranks of node `node` of site s: [*first, *first + *n). */
static void node_ranks(const k3_plan *p, const k3_site *s, int node, int *first, int *n) {
    *first = node * s->ranks_per_node;
    *n = K3_MAX(0, K3_MIN(s->ranks_per_node, p->world - *first));
}

void k3_plan_node_bytes(const k3_plan *p, const k3_site *s, int node, uint64_t *sum,
                        uint64_t *shared, uint64_t *read) {
    int first, n, ranks[1024];
    node_ranks(p, s, node, &first, &n);
    n = K3_MIN(n, (int)K3_ARRAY_LEN(ranks)); /* `k3 plan` takes <= 1024 a node */
    uint64_t tot = 0, w = 0;
    for (int i = 0; i < n; i++) {
        ranks[i] = first + i;
        tot += k3_rank_mem_total(&p->mem[first + i]);
        w += p->mem[first + i].weights;
    }
    const uint64_t once = k3_plan_node_shared(p, ranks, n);
    if (sum) *sum = tot;
    if (shared) *shared = s->gpu ? 0 : once; /* GPUs: each device holds its own copy */
    if (read) *read = w - K3_MIN(once, w);
}

bool k3_plan_fits(const k3_plan *p, const k3_site *s, uint64_t *max_bytes) {
    uint64_t most = 0;
    for (int r = 0; r < p->world; r++) most = K3_MAX(most, k3_rank_mem_total(&p->mem[r]));
    if (max_bytes) *max_bytes = most;
    if (s->gpu) return (double)most <= s->mem_bytes * 0.9; /* rank/setup.c's margin */
    for (int n = 0; n < s->nodes; n++) { /* cpu: a node's memory, less what its ranks share */
        uint64_t sum = 0, shared = 0;
        k3_plan_node_bytes(p, s, n, &sum, &shared, NULL);
        if ((double)(sum - shared) > s->mem_bytes * s->ranks_per_node * 0.9) return false;
    }
    return true;
}

/* ---- the cost model ------------------------------------------------------------------------ */
static int node_of(const k3_site *s, int rank) {
    return rank / s->ranks_per_node;
}

/* Parameters of `bytes` of stored weights by dtype (MXFP4: 4.25 bits a parameter). */
static double params_of(const k3_rank_mem *m) {
    return m->weights_bf16 / 2.0 + m->weights_mxfp4 * 8.0 / 4.25 + m->weights_other / 4.0;
}

typedef struct stage_shape {
    int n_kda, n_mla, n_moe;
    double ne_bytes, ne_params;         /* non-expert weights of one lane */
    double expert_bytes, expert_params; /* one expert (all alike) */
} stage_shape;

static void shape_of(const k3_config *c, const k3_plan *p, int s, stage_shape *o) {
    memset(o, 0, sizeof *o);
    const k3_rank_mem *m = &p->mem[k3_plan_rank(p, s, 0)];
    int owned = 0;
    for (int l = p->stage_begin[s]; l < p->stage_begin[s + 1]; l++) {
        if (c->mixer[l] == K3_MIXER_KDA)
            o->n_kda++;
        else
            o->n_mla++;
        if (k3_config_is_moe(c, l)) {
            o->n_moe++;
            for (int x = 0; x < p->n_experts; x++) owned += k3_plan_owner_lane(p, l, x) == 0;
        }
    }
    /* one expert's bytes: the MXFP4 (or BF16) expert tensors of lane 0 over its owned count */
    double all = (double)m->weights, params = params_of(m);
    if (owned > 0 && c->n_experts > 0) {
        /* every expert has the same tensors: K3 MXFP4 3 x inter x latent x 4.25 bit */
        const double W = c->latent_size > 0 ? c->latent_size : c->hidden_size;
        const double n_par = 3.0 * c->moe_intermediate_size * W;
        const bool mx = m->weights_mxfp4 > 0;
        o->expert_params = n_par;
        o->expert_bytes = mx ? n_par * 4.25 / 8.0 : n_par * 2.0;
        all -= owned * o->expert_bytes;
        params -= owned * n_par;
    }
    o->ne_bytes = K3_MAX(all, 0);
    o->ne_params = K3_MAX(params, 0);
}

/* The slowest link among ranks [a, b] (same node: intra, else inter) and its latency. */
static void link_of(const k3_site *s, int a, int b, double *bw, double *lat) {
    bool same = node_of(s, a) == node_of(s, b);
    *bw = same ? s->intra_bw : s->inter_bw;
    *lat = same ? s->intra_lat_s : s->inter_lat_s;
}

/* One group step of stage s with `rows` tokens per lane, attention at `ctx` positions, `state`
 * sequences per lane (decode: each row a sequence; prefill: 1 sequence of `rows` tokens). */
static void stage_time(const k3_config *c, const k3_plan *p, const k3_site *s, int st, double rows,
                       double seqs, double ctx, double *t_mem, double *t_flop, double *t_a2a,
                       double *bytes, double *flops, double *a2a_bytes) {
    stage_shape sh;
    shape_of(c, p, st, &sh);
    const int E = p->n_lanes;
    const double X = c->n_experts, K = c->n_experts_per_tok;
    const double W = c->kv_lora_rank + c->qk_rope_head_dim;
    const double Lw = c->latent_size > 0 ? c->latent_size : c->hidden_size;
    const double Hk = c->kda_n_heads, dk = c->kda_head_dim;
    double by = sh.ne_bytes, fl = 2.0 * rows * sh.ne_params;
    if (sh.n_moe > 0 && X > 0) {
        double n = E * rows, touched = X * (1.0 - pow(1.0 - K / X, n));
        by += sh.n_moe * touched / E * sh.expert_bytes;
        fl += 2.0 * rows * sh.n_moe * K * sh.expert_params;
    }
    by += seqs * (sh.n_kda * 2.0 * Hk * dk * dk * 4.0 + sh.n_mla * ctx * W * 4.0);
    fl +=
        rows * (sh.n_mla * 2.0 * c->n_heads * (2.0 * c->kv_lora_rank + c->qk_rope_head_dim) * ctx +
                sh.n_kda * 4.0 * Hk * dk * dk);
    double a2a = 0, bw = 1, lat = 0;
    if (sh.n_moe > 0 && E > 1) {
        int r0 = k3_plan_rank(p, st, 0), r1 = k3_plan_rank(p, st, E - 1);
        link_of(s, r0, r1, &bw, &lat);
        a2a = sh.n_moe * 2.0 * rows * K * Lw * 4.0 * (E - 1) / E;
    }
    *t_mem = by / s->mem_bw;
    *t_flop = fl / s->flops;
    *t_a2a = a2a / bw + (a2a > 0 ? sh.n_moe * (double)K3_MOE_CROSSINGS * lat : 0);
    *bytes = by;
    *flops = fl;
    *a2a_bytes = a2a;
}

/* A pipeline of S stages carrying `rows` tokens per lane per group: the stage times, the trip of
 * one group, and the round of M groups. */
static void pipeline(const k3_config *c, const k3_plan *p, const k3_site *s, double rows,
                     double seqs, double ctx, int M, k3_perf *o, double *t_max, double *lat,
                     double *period) {
    const int S = p->n_stages, E = p->n_lanes;
    const double D = c->hidden_size, bank = k3_plan_max_bank(c), V = (double)c->vocab_size;
    double sum = 0, most = 0, by = 0, fl = 0, ab = 0;
    const char *why = "memory";
    for (int st = 0; st < S; st++) {
        double tm, tf, ta, b1, f1, a1;
        stage_time(c, p, s, st, rows, seqs, ctx, &tm, &tf, &ta, &b1, &f1, &a1);
        double t = K3_MAX(tm, tf) + ta;
        o->stage_s[st] = t, o->stage_mem_s[st] = tm, o->stage_flop_s[st] = tf;
        o->stage_a2a_s[st] = ta;
        sum += t;
        if (t > most)
            most = t, why = ta > K3_MAX(tm, tf) ? "all-to-all" : tf > tm ? "compute" : "memory";
        by += b1 * E, fl += f1 * E, ab += a1 * E;
    }
    double hand = 0;
    for (int st = 0; st + 1 < S; st++) {
        double bw, l;
        link_of(s, k3_plan_rank(p, st, 0), k3_plan_rank(p, st + 1, 0), &bw, &l);
        double h = rows * D * (1 + bank) * 4.0 / bw + l;
        hand += h;
        o->handoff_s = K3_MAX(o->handoff_s, h);
    }
    double bw, l;
    link_of(s, 0, k3_plan_rank(p, S - 1, E - 1), &bw, &l);
    o->logits_s = E * seqs * V * 4.0 / bw + l;
    *lat = sum + hand + o->logits_s;
    *t_max = most;
    *period = K3_MAX(*lat, K3_MAX(M * most, M * o->logits_s));
    o->bound = *period == *lat && *lat > M * most ? "pipeline latency"
               : M * o->logits_s > M * most       ? "logits"
                                                  : why;
    o->decode_bytes = by * M, o->decode_flops = fl * M, o->a2a_bytes = ab * M;
}

void k3_plan_predict(const k3_config *c, const k3_plan *p, const k3_plan_req *r, const k3_site *s,
                     double fs_bps, k3_perf *o) {
    memset(o, 0, sizeof *o);
    const int S = p->n_stages, E = p->n_lanes;
    const int M = K3_MAX(S, 1);
    const int B = K3_MAX(r->max_seqs_per_lane, 1);
    const int b = (B + M - 1) / M;
    const double ctx = K3_MAX(r->max_ctx, 1) / 2.0, T = (double)K3_MAX(r->max_tokens, 1);
    o->micro_batches = M;
    o->seqs_per_group = b;
    /* prefill: chunks of T tokens of one sequence per lane, attention over half a chunk */
    double t_max, lat, period;
    k3_perf pf;
    memset(&pf, 0, sizeof pf);
    pipeline(c, p, s, T, 1, T / 2, M, &pf, &t_max, &lat, &period);
    o->prefill_tok_s = E * T / K3_MAX(t_max, lat / M);
    /* decode (last, so the per-stage times kept are decode's) */
    pipeline(c, p, s, b, b, ctx, M, o, &t_max, &lat, &period);
    o->latency_s = lat;
    o->period_s = period;
    o->decode_tok_s = (double)E * b * M / period;
    o->bubble = period > 0 ? 1.0 - M * t_max / period : 0;
    uint64_t most = 0;
    for (int n = 0; n < s->nodes; n++) {
        uint64_t read = 0;
        k3_plan_node_bytes(p, s, n, NULL, NULL, &read);
        most = K3_MAX(most, read);
    }
    o->load_s = fs_bps > 0 ? (double)most / fs_bps : 0;
}

/* ---- the grid search ----------------------------------------------------------------------- */
static bool better(const k3_plan_cand *a, const k3_plan_cand *b) {
    if (a->fits != b->fits) return a->fits;
    if (a->fits && fabs(a->decode_tok_s - b->decode_tok_s) > 1e-9 * b->decode_tok_s)
        return a->decode_tok_s > b->decode_tok_s;
    return a->max_bytes < b->max_bytes;
}

k3_status k3_plan_search(const k3_config *c, const k3_plan_req *req, const k3_site *s, int *best_pp,
                         int *best_ep, char *reason, size_t cap, k3_plan_cand *cand, int cand_cap,
                         int *n_cand) {
    const int world = s->nodes * s->ranks_per_node;
    k3_plan_cand best = {0}, all_best = {0};
    int n = 0, n_fit = 0;
    for (int pp = 1; pp <= world && pp <= c->n_layers; pp++) {
        if (world % pp) continue;
        int ep = world / pp;
        if (c->n_experts > 0 && c->n_experts % ep) continue;
        k3_plan_req q = *req;
        q.world = world, q.pp = pp, q.ep = ep, q.coord = K3_COORD_SHARED, q.expert_map = NULL;
        k3_plan p;
        if (k3_plan_make(c, &q, &p) != K3_OK) continue;
        k3_plan_cand k = {.pp = pp, .ep = ep};
        k.fits = k3_plan_fits(&p, s, &k.max_bytes);
        k3_perf pf;
        k3_plan_predict(c, &p, &q, s, 0, &pf);
        k.decode_tok_s = pf.decode_tok_s;
        k.prefill_tok_s = pf.prefill_tok_s;
        k3_plan_free(&p);
        if (cand && n < cand_cap) cand[n] = k;
        n_fit += k.fits;
        if (n == 0 || better(&k, &all_best)) all_best = k;
        n++;
    }
    if (n_cand) *n_cand = n;
    if (n == 0)
        return K3_ERR(K3_ERR_ARG,
                      "no split S x E of %d ranks has E dividing n_experts = %d and S <= %d layers",
                      world, c->n_experts, c->n_layers);
    best = all_best;
    *best_pp = best.pp, *best_ep = best.ep;
    const bool ep_in_node = best.ep <= s->ranks_per_node && s->ranks_per_node % best.ep == 0;
    if (best.fits)
        snprintf(reason, cap,
                 "pp %d x ep %d: fits (largest rank %.1f GB of %.1f GB less 10%%) and has the "
                 "highest predicted decode throughput (%.0f tok/s) of the %d split%s that fit "
                 "(of %d); its expert-parallel group %s",
                 best.pp, best.ep, best.max_bytes / 1e9, s->mem_bytes / 1e9, best.decode_tok_s,
                 n_fit, n_fit == 1 ? "" : "s", n,
                 ep_in_node ? "stays inside one node's links" : "crosses nodes");
    else
        snprintf(reason, cap,
                 "no split fits: pp %d x ep %d needs the least memory (largest rank %.1f GB, "
                 "device %.1f GB less 10%%); lower --max-seqs/--max-ctx/--max-batch-tokens or "
                 "use more nodes",
                 best.pp, best.ep, best.max_bytes / 1e9, s->mem_bytes / 1e9);
    return K3_OK;
}
