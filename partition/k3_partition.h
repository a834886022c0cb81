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
} k3_plan_req;

/* Bytes one rank must hold. */
typedef struct k3_rank_mem {
    uint64_t weights; /* as stored: the stage's non-expert tensors + owned experts (+embed/head) */
    uint64_t caches; /* max_seqs_per_lane x (MLA latent cache + KDA conv + recurrent state), fp32 */
    uint64_t buffers; /* hand-off, dispatch/combine and logits buffers (estimate, fp32) */
} k3_rank_mem;

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

/* The plan as a human table (stages, layers, costs, per-rank bytes). Truncates at cap. */
void k3_plan_format(const k3_plan *p, const k3_config *c, char *buf, size_t cap);

#endif /* K3_PARTITION_H */
