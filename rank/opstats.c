/* opstats.c — `--op-stats FILE.json`: what each worker rank's backend did per forward step.
 *
 * Owns: the per-step difference of the backend's counters (k3_op_stats: op calls by op, host
 * syncs, host<->device bytes), summed by phase in struct rank_opstats, the gather of every worker
 * rank's sums at close and the JSON file rank 0 writes. Does not own: the counting itself (the
 * backends: guard, cuda) nor the step (worker.c calls begin / end around all of it, so the logits
 * and activation downloads after the forward are in the step).
 * Phases: decode = every sequence one token, prefill = some sequence more (a step that mixes
 * decode rows and prefill chunks is prefill), idle = no sequence of the lane (it serves its
 * experts). Reading the counters is no host sync and counts nothing.
 * Host syncs are the backend's (downloads, synchronize, event syncs, error-word reads) plus the
 * transport's own waits on the device (k3_comm_stats.host_syncs: each NCCL wait on a stream), the
 * latter also alone as comm_host_syncs_per_step; graph launches are the backend's launches of a
 * captured step (cuda graphs: the step that captures a padded size launches it too, so a decode
 * step with graphs on has 1), and the ops a launch runs count as the step's ops (the op count is
 * the same replayed or eager).
 * File: {"backend", "world", "pp", "ep", "comm" (the transport, "none" on one rank), "routing"
 * ("host" | "device": where the MoE route of decode rounds is built; prefill rounds are
 * host-routed either way), "routing_note" (why the counts are what they
 * are with this transport), "stages": [{"rank", "stage", "lane", "layers": [begin,
 * end), "decode" | "prefill" | "idle": {"steps", "ops_per_step", "host_syncs_per_step",
 * "host_syncs_max_per_step", "comm_host_syncs_per_step", "graph_launches_per_step",
 * "graph_fallbacks" (steps of the phase whose capture failed and ran eagerly: a count),
 * "host_device_bytes_per_step", "h2d_bytes_per_step",
 * "d2h_bytes_per_step", "ops": {op: calls per step, only ops called}, and where the backend counts
 * matrix FLOPs (cuda) "flops_per_step": {op: FLOPs} and "tensor_core_share": {op: the share of
 * them done on tensor cores, 0 .. 1}}}], and with one worker
 * rank its "decode", "prefill", "idle" also at the top level}. Per-step values are averages over
 * the phase's steps (numbers with decimals where they are not integers). */
#include "rank_internal.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdlib.h>

/* A worker step's phase: every sequence one token (decode), some sequence more (prefill), no
   sequence of this lane in the step (idle: it only serves its experts). */
enum { OPS_DECODE, OPS_PREFILL, OPS_IDLE, OPS_PHASES };
static const char *const k_phase_name[OPS_PHASES] = {"decode", "prefill", "idle"};

/* A worker rank's counters: the backend's when the current step began, and each step's
   difference summed by phase. */
struct rank_opstats {
    k3_op_stats begin;
    uint64_t comm_begin; /* the transport's own host syncs (k3_comm_stats) when the step began */
    bool fell;           /* the current step's capture failed (rank_opstats_fallback) */
    struct {
        uint64_t steps, host_syncs_max; /* steps of the phase; the most host syncs in one */
        uint64_t comm_syncs;            /* of sum.host_syncs, the transport's */
        uint64_t fallbacks;             /* steps whose capture failed (they ran eagerly) */
        k3_op_stats sum;
    } phase[OPS_PHASES];
};

/* the transport's host syncs so far (0 without a comm) */
static uint64_t comm_syncs(const rank_ctx *r) {
    if (!r->comm) return 0;
    k3_comm_stats cs;
    k3_comm_get_stats(r->comm, &cs);
    return cs.host_syncs;
}

/* The backends that keep counters (k3_backend_op_stats): checked by name before anything is
   created, so every rank refuses alike; rank_opstats_init checks the backend itself. */
static bool backend_counts(const char *name) {
    return name && (strcmp(name, "guard") == 0 || strcmp(name, "cuda") == 0);
}

k3_status rank_opstats_agree(rank_ctx *r) {
    const k3_engine_opts *o = r->o;
    if (!o->op_stats) return K3_OK;
    const char *be = o->backend ? o->backend : "cpu";
    int local = backend_counts(be) ? 0 : 1, worst = local;
    if (k3_comm_world_max(local, &worst, rank_comm_timeout(r)) != K3_OK)
        RTRY(r, K3_ERR(K3_ERR_COMM, "--op-stats: the ranks could not agree on the backend"));
    if (worst && r->rank == 0) {
        char which[64];
        snprintf(which, sizeof which, local ? "the %s backend" : "another rank's backend", be);
        fprintf(stderr, "%s: --op-stats: %s keeps no op counters; use --backend guard (or cuda)\n",
                rank_cmd_name(r), which);
    }
    return worst ? K3_ERR(K3_ERR_ARG, "--op-stats: no op counters (printed by rank 0)") : K3_OK;
}

k3_status rank_opstats_init(rank_ctx *r) {
    if (!r->o->op_stats || !r->be) return K3_OK;
    RTRY(r, k3_calloc((void **)&r->ops, sizeof *r->ops, "op stats"));
    if (k3_backend_op_stats(r->be, &r->ops->begin) != K3_OK) {
        char why[256];
        snprintf(why, sizeof why, "%s", k3_last_error());
        RTRY(r, K3_ERR(K3_ERR_ARG, "--op-stats: %s; use --backend guard (or cuda)", why));
    }
    return K3_OK;
}

void rank_opstats_destroy(rank_ctx *r) {
    k3_free(r->ops);
    r->ops = NULL;
}

k3_status rank_opstats_begin(rank_ctx *r) {
    if (!r->ops) return K3_OK;
    RTRY(r, k3_backend_op_stats(r->be, &r->ops->begin));
    r->ops->comm_begin = comm_syncs(r);
    r->ops->fell = false;
    return K3_OK;
}

void rank_opstats_fallback(rank_ctx *r) {
    if (r->ops) r->ops->fell = true;
}

k3_status rank_opstats_end(rank_ctx *r, int64_t T, int n_seqs) {
    struct rank_opstats *o = r->ops;
    if (!o) return K3_OK;
    k3_op_stats now;
    RTRY(r, k3_backend_op_stats(r->be, &now));
    const int ph = n_seqs == 0 ? OPS_IDLE : T > n_seqs ? OPS_PREFILL : OPS_DECODE;
    k3_op_stats *sum = &o->phase[ph].sum;
    const k3_op_stats *b = &o->begin;
    for (int i = 0; i < K3_OP_COUNT; i++) sum->calls[i] += now.calls[i] - b->calls[i];
    const uint64_t by_comm = comm_syncs(r) - o->comm_begin;
    const uint64_t syncs = now.host_syncs - b->host_syncs + by_comm;
    for (int i = 0; i < K3_OP_COUNT; i++) {
        sum->flops[i] += now.flops[i] - b->flops[i];
        sum->tc_flops[i] += now.tc_flops[i] - b->tc_flops[i];
    }
    sum->host_syncs += syncs;
    o->phase[ph].comm_syncs += by_comm;
    sum->h2d_bytes += now.h2d_bytes - b->h2d_bytes;
    sum->d2h_bytes += now.d2h_bytes - b->d2h_bytes;
    sum->graph_launches += now.graph_launches - b->graph_launches;
    o->phase[ph].steps++;
    o->phase[ph].fallbacks += o->fell;
    o->phase[ph].host_syncs_max = K3_MAX(o->phase[ph].host_syncs_max, syncs);
    return K3_OK;
}

/* ---- the gather and the file ------------------------------------------------------------------
 */
/* One rank's sums as it travels (u64 each): per phase steps, host_syncs_max, host_syncs,
   h2d_bytes, d2h_bytes, graph_launches, comm_syncs, fallbacks, calls[K3_OP_COUNT],
   flops[K3_OP_COUNT], tc_flops[K3_OP_COUNT]. */
#define PACK_CALLS 8
#define PACK_PHASE (PACK_CALLS + 3 * K3_OP_COUNT)
#define PACK_U64   (OPS_PHASES * PACK_PHASE)

/* A rank without counters (the dedicated coordinator) packs zeros. */
static void pack(const rank_ctx *r, uint64_t *p) {
    memset(p, 0, PACK_U64 * sizeof *p);
    if (!r->ops) return;
    for (int ph = 0; ph < OPS_PHASES; ph++, p += PACK_PHASE) {
        const k3_op_stats *s = &r->ops->phase[ph].sum;
        p[0] = r->ops->phase[ph].steps;
        p[1] = r->ops->phase[ph].host_syncs_max;
        p[2] = s->host_syncs;
        p[3] = s->h2d_bytes;
        p[4] = s->d2h_bytes;
        p[5] = s->graph_launches;
        p[6] = r->ops->phase[ph].comm_syncs;
        p[7] = r->ops->phase[ph].fallbacks;
        memcpy(p + PACK_CALLS, s->calls, sizeof s->calls);
        memcpy(p + PACK_CALLS + K3_OP_COUNT, s->flops, sizeof s->flops);
        memcpy(p + PACK_CALLS + 2 * K3_OP_COUNT, s->tc_flops, sizeof s->tc_flops);
    }
}

static cJSON *phase_json(const uint64_t *p) {
    cJSON *o = cJSON_CreateObject();
    const double n = (double)p[0], d = n > 0 ? n : 1;
    uint64_t ops = 0;
    for (int i = 0; i < K3_OP_COUNT; i++) ops += p[PACK_CALLS + i];
    cJSON_AddNumberToObject(o, "steps", n);
    cJSON_AddNumberToObject(o, "ops_per_step", (double)ops / d);
    cJSON_AddNumberToObject(o, "host_syncs_per_step", (double)p[2] / d);
    cJSON_AddNumberToObject(o, "host_syncs_max_per_step", (double)p[1]);
    cJSON_AddNumberToObject(o, "comm_host_syncs_per_step", (double)p[6] / d);
    cJSON_AddNumberToObject(o, "graph_launches_per_step", (double)p[5] / d);
    cJSON_AddNumberToObject(o, "graph_fallbacks", (double)p[7]);
    cJSON_AddNumberToObject(o, "host_device_bytes_per_step", (double)(p[3] + p[4]) / d);
    cJSON_AddNumberToObject(o, "h2d_bytes_per_step", (double)p[3] / d);
    cJSON_AddNumberToObject(o, "d2h_bytes_per_step", (double)p[4] / d);
    cJSON *by = cJSON_AddObjectToObject(o, "ops");
    for (int i = 0; i < K3_OP_COUNT; i++)
        if (p[PACK_CALLS + i])
            cJSON_AddNumberToObject(by, k3_op_name(i), (double)p[PACK_CALLS + i] / d);
    /* the ops whose matrix FLOPs the backend counts (cuda): FLOPs per step, and the share of
       them a tensor-core kernel did */
    const uint64_t *fl = p + PACK_CALLS + K3_OP_COUNT, *tc = p + PACK_CALLS + 2 * K3_OP_COUNT;
    cJSON *fo = NULL, *sh = NULL;
    for (int i = 0; i < K3_OP_COUNT; i++) {
        if (!fl[i]) continue;
        if (!fo) {
            fo = cJSON_AddObjectToObject(o, "flops_per_step");
            sh = cJSON_AddObjectToObject(o, "tensor_core_share");
        }
        cJSON_AddNumberToObject(fo, k3_op_name(i), (double)fl[i] / d);
        cJSON_AddNumberToObject(sh, k3_op_name(i), (double)tc[i] / (double)fl[i]);
    }
    return o;
}

/* Where the MoE route is built: on the backend with one lane, and with more on the nccl
   transport and a cuda backend (layers/moe_ep.c), unless K3_MOE_HOST_ROUTE asks for the host. */
static bool routing_on_device(const rank_ctx *r, const char *transport) {
    if (r->plan.n_lanes <= 1) return true;
    const char *be = r->o->backend ? r->o->backend : "cpu";
    return transport && strcmp(transport, "nccl") == 0 && strcmp(be, "cuda") == 0 &&
           !getenv("K3_MOE_HOST_ROUTE");
}

/* Why a run's host syncs per step are what they are: the MoE route's path through the transport
   (the same on every rank: one transport, one plan). */
static const char *routing_note(const rank_ctx *r, const char *transport) {
    if (r->plan.n_lanes <= 1)
        return "one lane: no MoE exchange; the route stays in the backend (moe_topk and "
               "moe_experts route on the device; their checks are read once, at the step's end)";
    if (routing_on_device(r, transport))
        return "nccl: decode rounds routed on the device: fixed-capacity slabs per (lane, expert) "
               "with their counts, exchanged lane block to lane block in the backend's stream, "
               "the masked grouped GEMM and the slot-order combine; no count or row crosses to "
               "the host, and the op sequence does not depend on the routing. Prefill rounds (any "
               "lane with a prompt chunk) are host-routed on every lane, eagerly: the router's ids "
               "and weights are read on the host and each NCCL wait polls the stream, so prefill "
               "makes more host syncs, but a skewed prompt (all its tokens to the same experts) "
               "has no capacity to overflow";
    if (transport && strcmp(transport, "nccl") == 0)
        return "nccl: MoE rows move device to device, but the route is built on the host (the "
               "router's ids and weights are downloaded, counts and item triples are host words "
               "staged through pinned memory, and each NCCL wait polls the stream), so each MoE "
               "layer waits on the host and a decode step's CUDA graph capture fails on the first "
               "read: it runs eagerly (graph_fallbacks)";
    return "mpi: MoE rows, counts and item triples cross through host memory (a download before "
           "and an upload after each exchange, each a host sync) and the route is built on the "
           "host, so host syncs and ops per step grow with the MoE layers and the routing, and a "
           "decode step's CUDA graph capture fails on the first read: it runs eagerly "
           "(graph_fallbacks; the device route needs a transport that moves backend buffers: "
           "--comm nccl)";
}

/* Rank 0: the file from every worker rank's pack (all [world, PACK_U64]). */
static int write_file(rank_ctx *r, const uint64_t *all) {
    const char *path = r->o->op_stats;
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "backend", r->o->backend ? r->o->backend : "cpu");
    cJSON_AddNumberToObject(root, "world", r->world);
    cJSON_AddNumberToObject(root, "pp", r->plan.n_stages);
    cJSON_AddNumberToObject(root, "ep", r->plan.n_lanes);
    const char *transport = r->comm ? k3_comm_transport(r->comm) : NULL;
    cJSON_AddStringToObject(root, "comm", transport ? transport : "none");
    cJSON_AddStringToObject(root, "routing", routing_on_device(r, transport) ? "device" : "host");
    cJSON_AddStringToObject(root, "routing_note", routing_note(r, transport));
    cJSON *st = cJSON_AddArrayToObject(root, "stages");
    int n_entries = 0, only = -1;
    for (int w = 0; w < r->world; w++) {
        int s = -1, e = -1;
        if (!k3_plan_coords(&r->plan, w, &s, &e)) continue;
        const uint64_t *p = all + (size_t)w * PACK_U64;
        cJSON *it = cJSON_CreateObject();
        cJSON_AddNumberToObject(it, "rank", w);
        cJSON_AddNumberToObject(it, "stage", s);
        cJSON_AddNumberToObject(it, "lane", e);
        cJSON *ly = cJSON_AddArrayToObject(it, "layers");
        cJSON_AddItemToArray(ly, cJSON_CreateNumber(r->plan.stage_begin[s]));
        cJSON_AddItemToArray(ly, cJSON_CreateNumber(r->plan.stage_begin[s + 1]));
        for (int ph = 0; ph < OPS_PHASES; ph++)
            cJSON_AddItemToObject(it, k_phase_name[ph], phase_json(p + ph * PACK_PHASE));
        cJSON_AddItemToArray(st, it);
        n_entries++;
        only = w;
    }
    if (n_entries == 1) /* a one-rank run: `jq .decode.ops_per_step` */
        for (int ph = 0; ph < OPS_PHASES; ph++)
            cJSON_AddItemToObject(root, k_phase_name[ph],
                                  phase_json(all + (size_t)only * PACK_U64 + ph * PACK_PHASE));
    char *txt = cJSON_Print(root);
    cJSON_Delete(root);
    int rc = 0;
    FILE *f = txt ? fopen(path, "w") : NULL;
    if (!txt) {
        fprintf(stderr, "%s: --op-stats %s: out of memory\n", rank_cmd_name(r), path);
        rc = 1;
    } else if (!f) {
        fprintf(stderr, "%s: --op-stats %s: %s\n", rank_cmd_name(r), path, strerror(errno));
        rc = 1;
    } else {
        bool ok = fputs(txt, f) >= 0 && fputc('\n', f) != EOF;
        if (fclose(f) != 0 || !ok) {
            fprintf(stderr, "%s: --op-stats %s: write failed\n", rank_cmd_name(r), path);
            rc = 1;
        }
    }
    cJSON_free(txt);
    if (rc == 0) K3_LOGI("op stats of %d worker rank(s) written to %s", n_entries, path);
    return rc;
}

k3_status rank_opstats_write(rank_ctx *r, int *rc) {
    *rc = 0;
    if (!r->o->op_stats) return K3_OK;
    /* every worker rank in turn broadcasts its sums (a gather on the helpers comm/ has; at
       close, a few KB a rank); rank 0 keeps them all */
    uint64_t *all = NULL, mine[PACK_U64], scratch[PACK_U64];
    if (r->rank == 0)
        RTRY(r, k3_calloc((void **)&all, (size_t)r->world * sizeof mine, "op stats of every rank"));
    pack(r, mine);
    for (int w = 0; w < r->world; w++) {
        if (!k3_plan_coords(&r->plan, w, NULL, NULL)) continue;
        uint64_t *buf = r->rank == 0 ? all + (size_t)w * PACK_U64 : scratch;
        if (w == r->rank) memcpy(buf, mine, sizeof mine);
        RTRY(r, k3_comm_bcast(r->comm, w, buf, sizeof mine));
    }
    *rc = r->rank == 0 ? write_file(r, all) : 0;
    k3_free(all);
    return K3_OK;
}
