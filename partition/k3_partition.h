/* partition — the plan: who holds what, as a PURE function of (config, world, options).
 *
 * Owns: stage boundaries (contiguous layer ranges balanced by a per-layer cost model), the rank
 * grid (rank <-> (stage, lane), optional dedicated coordinator), the expert -> lane map of every
 * MoE layer (contiguous by default, or parsed from an expert-map text), the bytes each rank must
 * hold (weights, caches, buffers), the plan hash ranks compare, and the plan table rank 0 prints.
 * Must not: do I/O (callers read a map file and pass its contents), call MPI, or allocate anything
 * the caller cannot free with k3_plan_free.
 *
 * Grid: world = [coordinator] + S x E workers. Worker index w = rank - first_worker,
 * stage = w / E, lane = w % E (a stage's EP group is E consecutive ranks). With a shared
 * coordinator rank 0 is also (stage 0, lane 0).
 *
 * Expert-map text format (version 1), one entry per line, '#' starts a comment:
 *     * L0 L1 ... L{n_experts-1}      lanes of experts 0.. for every MoE layer not listed
 *     LAYER L0 L1 ... L{n_experts-1}  lanes for one MoE layer (0-based layer index)
 * Every MoE layer must be covered (by its own line or '*'); lanes in [0, E). A lane may own no
 * expert of a layer (it then only sends). */
#ifndef K3_PARTITION_H
#define K3_PARTITION_H

#include "k3_model.h"

typedef enum { K3_COORD_SHARED = 0, K3_COORD_DEDICATED = 1 } k3_coord_mode;
k3_status k3_coord_mode_parse(const char *s, k3_coord_mode *out); /* "shared" | "dedicated" */

typedef struct k3_plan_req {
    int world;  /* MPI world size */
    int pp, ep; /* S stages, E lanes */
    k3_coord_mode coord;
    const char *expert_map;      /* expert-map text (see above); NULL = contiguous ranges */
    const char *expert_map_name; /* file name for error messages (may be NULL) */
    int64_t max_ctx;             /* per-sequence context capacity (sizes MLA caches) */
    int max_seqs_per_lane;       /* sequences one lane holds at once (sizes caches) */
    int64_t max_tokens;          /* tokens per forward call on a lane (sizes buffers) */
    int64_t kv_cache_tokens;     /* paged MLA cache of a lane, tokens (0 = max_seqs x max_ctx;
                                    rounded up to whole blocks of K3_KV_BLOCK) */
    int prefix_snapshots;        /* KDA state snapshots of a lane's prefix cache
                                    (k3_plan_prefix_snapshots; 0: the cache is off) */
    bool moe_device;             /* the MoE exchange routes on the device (cuda + nccl,
                                    layers/moe_ep.c): its fixed slabs are counted in buffers */
    bool graphs;                 /* decode steps are CUDA graphs (cuda, --cuda-graphs on): each
                                    stage keeps one more slot and one more cache block for the
                                    pad rows (layers/graph.c), counted in caches */
} k3_plan_req;

/* The prefix cache's snapshot pool of a lane (docs/DESIGN.md §3c): one snapshot per
 * K3_PREFIX_SNAP_EVERY blocks of its budget, plus one, at most 2 x max_seqs (a snapshot is a
 * slot's KDA state: the pool is at most twice the slots' own). */
#define K3_PREFIX_SNAP_EVERY 8
int k3_plan_prefix_snapshots(int64_t budget_blocks, int max_seqs);

/* Bytes one rank must hold, by kind. The engine sizes its allocations from the same numbers
 * (rank/setup.c checks k3_rank_mem_total against each node's memory), and `k3 plan` prints them,
 * so what the plan says is what run, batch and serve allocate. */
typedef struct k3_rank_mem {
    uint64_t weights; /* as stored: the stage's non-expert tensors + owned experts (+embed/head) */
    uint64_t weights_bf16, weights_mxfp4, weights_other; /* `weights` by stored dtype: BF16;
                         MXFP4 (U8 nibbles + E8M0 scales); F32 and the rest */
    uint64_t caches;        /* = mla_cache + kda_state + kda_snapshots */
    uint64_t mla_cache;     /* the paged cache: MLA layers x kv_cache_tokens (whole blocks) x
                               (kv_lora + rope), fp32 */
    uint64_t kda_state;     /* max_seqs_per_lane x KDA layers x (conv + recurrent state), fp32 */
    uint64_t kda_snapshots; /* prefix_snapshots x the same per-sequence state (the prefix cache) */
    uint64_t buffers;   /* comm: the stage hand-off activation (h + AttnRes bank) and its message
                           copies, MoE dispatch/combine rows, logits (fp32) */
    uint64_t workspace; /* per-step scratch of the stage forward (k3_plan_workspace_bytes) */
} k3_rank_mem;
/* weights + caches + buffers + workspace: what rank/setup.c checks against a node's memory. */
uint64_t k3_rank_mem_total(const k3_rank_mem *m);

/* AttnRes blocks banked with the hand-off activation: ceil(n_layers / block), 0 without. */
int k3_plan_max_bank(const k3_config *c);

/* The sizing functions the plan is made of (pure; exported for `k3 plan` and the tests).
 * Per-sequence cache bytes of layers [lb, lb + n): the MLA latent cache at max_ctx tokens and
 * the KDA conv + recurrent state, fp32 as layers/ allocates them (k3_seq_state_create). */
void k3_plan_seq_bytes(const k3_config *c, int lb, int le, int64_t max_ctx, uint64_t *mla,
                       uint64_t *kda_conv, uint64_t *kda_rec);
/* Scratch of one stage's forward for steps of up to T tokens (layers/stage.c make_scratch and the
 * attention scratch k3_seq_state_create grows to max_ctx): the [T, *]-sized buffers of the
 * layer kinds present, the MoE scratch and, with n_lanes > 1, the expert-parallel rows. The
 * tile-sized MoE scratch (64-row tiles) is not counted. */
uint64_t k3_plan_workspace_bytes(const k3_config *c, int lb, int le, bool first, int64_t T,
                                 int n_lanes, int64_t max_ctx, int max_seqs);

typedef struct k3_plan {
    int world, n_stages, n_lanes;
    k3_coord_mode coord;
    int first_worker; /* rank of (stage 0, lane 0): 0 shared, 1 dedicated */
    int n_layers, n_experts;
    int stage_begin[K3_MAX_LAYERS + 1]; /* stage s owns layers [stage_begin[s], stage_begin[s+1]) */
    double layer_cost[K3_MAX_LAYERS];   /* cost units (bytes touched per decode token) */
    double stage_cost[K3_MAX_LAYERS];   /* [n_stages] incl. embedding (stage 0) and head (last) */
    int16_t *expert_lane; /* [n_layers, n_experts] owning lane; -1 on non-MoE layers */
    k3_rank_mem *mem;     /* [world] */
    uint64_t hash;        /* over everything above (k3_plan_hash) */
    /* [n_stages] a stage's weights less its routed experts (its layers' other tensors, with the
       embedding on stage 0 and the head side on the last): the bytes every lane of the stage
       holds alike, which the lanes on one node read and hold once (rank/setup.c) */
    uint64_t stage_dense[K3_MAX_LAYERS];
} k3_plan;

/* Build the plan. Invalid requests (S x E != world, or world - 1 with a dedicated coordinator;
 * more stages than layers; E not dividing n_experts when the contiguous map is used; a bad map)
 * fail with K3_ERR_ARG and a message naming the flag or map line. */
k3_status k3_plan_make(const k3_config *c, const k3_plan_req *req, k3_plan *out);
void k3_plan_free(k3_plan *p); /* NULL-safe; leaves *p zeroed */

/* The per-layer cost model used for balancing (exported for tests and `k3 plan`): bytes touched
 * per decode token, i.e. non-expert weights + top-k active experts + KDA state / MLA cache at a
 * nominal context. `extra_first`/`extra_last` receive the embedding/head cost (may be NULL). */
void k3_plan_layer_costs(const k3_config *c, int64_t nominal_ctx, double *cost /* [n_layers] */,
                         double *extra_first, double *extra_last);

int k3_plan_rank(const k3_plan *p, int stage, int lane); /* world rank of a worker */
/* Worker coordinates of `rank`; false for a dedicated coordinator (rank 0, no weights). */
bool k3_plan_coords(const k3_plan *p, int rank, int *stage, int *lane);
int k3_plan_stage_of_layer(const k3_plan *p, int layer);
static inline int k3_plan_owner_lane(const k3_plan *p, int layer, int expert) {
    return p->expert_lane[(int64_t)layer * p->n_experts + expert];
}
static inline int k3_plan_lane_of_seq(const k3_plan *p, int seq) {
    return seq % p->n_lanes;
}
uint64_t k3_plan_hash(const k3_plan *p);

/* The bytes of the distinct checkpoint tensors that the ranks ranks[0..n_ranks) read together
 * (e.g. the ranks of one node; `k3 bench load`'s unique bytes): a tensor counts once however
 * many of them read it. Each rank reads what fill_mem gives it: its stage's non-expert tensors
 * (stage 0 the embedding, the last stage the head side, which with tied embeddings reads the
 * embedding), and the routed experts its lane owns; a dedicated coordinator reads nothing. So
 * the lanes of one stage share its non-expert bytes, and their experts are disjoint. Ranks
 * outside the world are refused (K3_ERR_ARG). Pure: allocates only the catalogue it walks. */
k3_status k3_plan_unique_weights(const k3_config *c, const k3_plan *p, const int *ranks,
                                 int n_ranks, uint64_t *out);

/* Of the ranks ranks[0..n_ranks) on one node, the bytes held once instead of once a rank: the
 * lanes of a stage share its dense weights (stage_dense), so each stage with k of them there
 * counts (k - 1) x stage_dense[s] off. A dedicated coordinator and ranks outside the world count
 * nothing; a rank listed twice counts once. The same rule as rank/setup.c's node memory check and
 * `k3 plan`'s node table (with --load-private, or a device backend's device memory, nothing is
 * shared). */
uint64_t k3_plan_node_shared(const k3_plan *p, const int *ranks, int n_ranks);

/* The plan as a human table (stages, layers, costs, per-rank bytes). Truncates at cap. */
void k3_plan_format(const k3_plan *p, const k3_config *c, char *buf, size_t cap);

/* ---- sites and the cost model (site.c) -----------------------------------------------------
 * A site is where a plan runs: nodes x devices per node (a device is a GPU, or a cpu rank's share
 * of a node) and the rates of one device. k3_site_builtin has profiles with their sources;
 * `k3 plan --site FILE.json` fills the same struct (launcher/cmd_plan.c reads the file). */
typedef struct k3_site {
    char name[32];      /* "h200", "h100", "b200", "cpu" or the site file's "name" */
    int nodes;          /* nodes of the allocation */
    int ranks_per_node; /* one rank per GPU; cpu: ranks sharing a node */
    int cores_per_node; /* CPU cores of a node (binding, #SBATCH --cpus-per-task) */
    bool gpu;           /* ranks drive a GPU each (local rank -> device) */
    double mem_bytes;   /* memory of one device (cpu: the node's memory / ranks_per_node) */
    double mem_bw;      /* bytes/s one device streams from its memory */
    double flops;       /* dense FLOP/s of one device at the engine's matmul precision */
    double intra_bw;    /* bytes/s one device sends to a peer of its node (one direction) */
    double inter_bw;    /* bytes/s one device sends to other nodes */
    double intra_lat_s, inter_lat_s; /* one message's latency inside / across nodes */
    char source[512];                /* where the figures come from */
} k3_site;

/* "h200" | "h100" | "b200" | "cpu" for nodes x ranks_per_node; K3_ERR_ARG naming --gpu. */
k3_status k3_site_builtin(const char *gpu, int nodes, int ranks_per_node, k3_site *out);
/* Rejects a site with a non-positive rate or count (name the field). */
k3_status k3_site_check(const k3_site *s);

/* The predicted performance of a plan on a site (the model is documented in site.c). */
typedef struct k3_perf {
    int micro_batches;             /* M: groups in flight (the engine's default: S) */
    int seqs_per_group;            /* b: decode sequences per lane per group step */
    double decode_tok_s;           /* generated tokens/s of the whole job, all slots busy */
    double prefill_tok_s;          /* prompt tokens/s of the whole job, chunks of max_tokens */
    double stage_s[K3_MAX_LAYERS]; /* [S] one decode group step of each stage */
    double stage_mem_s[K3_MAX_LAYERS], stage_flop_s[K3_MAX_LAYERS], stage_a2a_s[K3_MAX_LAYERS];
    double handoff_s;    /* one group's activation hand-off between two stages */
    double logits_s;     /* one group's logits of every lane into rank 0 */
    double latency_s;    /* one group through every stage + hand-offs + logits */
    double period_s;     /* one decode round: every group advanced by one token */
    double bubble;       /* fraction of the round the slowest stage idles */
    double decode_bytes; /* bytes one decode round reads from device memory (all ranks) */
    double decode_flops; /* FLOPs of one round (all ranks) */
    double a2a_bytes;    /* MoE dispatch + combine bytes of one round (all ranks) */
    double load_s;       /* weights at fs_bps per node */
    const char *bound;   /* "memory", "compute", "all-to-all", "pipeline latency", "logits" */
} k3_perf;

/* fs_bps: file-system read bandwidth of one node in bytes/s (load time). max_ctx of the request
 * sizes attention (sequences are taken half-way through their context). */
void k3_plan_predict(const k3_config *c, const k3_plan *p, const k3_plan_req *r, const k3_site *s,
                     double fs_bps, k3_perf *out);

/* Ranks a plan on a site fits: on GPUs, every rank's k3_rank_mem_total within its device's memory
 * less the engine's margin (10%, as rank/setup.c); on cpu ranks, every node's ranks together, less
 * what they hold once (k3_plan_node_shared), within the node's memory less the margin. Returns the
 * largest rank total in *max_bytes. */
bool k3_plan_fits(const k3_plan *p, const k3_site *s, uint64_t *max_bytes);
/* Node `node` of a site (ranks node x ranks_per_node ..): its ranks' summed totals, what they
 * hold once (k3_plan_node_shared; host memory, so 0 on a GPU site), and the checkpoint bytes the
 * node reads (its ranks' weights less the shared: a stage's dense weights are read once a node on
 * every backend). */
void k3_plan_node_bytes(const k3_plan *p, const k3_site *s, int node, uint64_t *sum,
                        uint64_t *shared, uint64_t *read);

/* Without --pp/--ep: every S x E = nodes x ranks_per_node with E dividing n_experts and
 * S <= n_layers, ranked: plans that fit first, then by predicted decode throughput, then by less
 * memory. `req` gives the capacity (its world/pp/ep are ignored). Fills *best_pp, *best_ep and a
 * one-line reason; the candidates (at most cap) go to cand[] when non-NULL. K3_ERR_ARG when no
 * split exists at all. */
typedef struct k3_plan_cand {
    int pp, ep;
    bool fits;
    uint64_t max_bytes;
    double decode_tok_s, prefill_tok_s;
} k3_plan_cand;
k3_status k3_plan_search(const k3_config *c, const k3_plan_req *req, const k3_site *s, int *best_pp,
                         int *best_ep, char *reason, size_t reason_cap, k3_plan_cand *cand, int cap,
                         int *n_cand);

#endif /* K3_PARTITION_H */
