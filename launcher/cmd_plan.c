/* cmd_plan.c — `k3 plan`: the plan a distributed run would use (stages, costs, expert ranges,
 * per-rank bytes by kind) for a checkpoint's config.json or a preset, without MPI or weights; on a
 * site (--nodes/--gpus-per-node/--gpu or --site FILE.json) also the rank placement with each
 * local rank's cores as this machine's hwloc binds them, the fit against device memory, the load
 * time, the predicted throughput (partition/site.c's cost model), a recommended S x E when --pp
 * and --ep are not given, and with --slurm the #SBATCH header and launch line.
 * Owns: the flags and the site file reader; the plan and every byte count come from partition/
 * (the same pure functions every rank of run/batch/serve calls at open), and the capacity flags
 * and their defaults are the engine's, so what this prints is what they allocate. */
#include "k3_launcher.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "engine_args.h"
#include "k3_bind.h"
#include "k3_partition.h"

static const k3_flag flags[] = {
    {"model", K3_FLAG_STR, "DIR", NULL, "checkpoint directory (its config.json)"},
    {"preset", K3_FLAG_STR, "NAME", NULL, "tiny | small | k3 instead of --model"},
    {"world", K3_FLAG_INT, "N", NULL, "MPI world size (default: pp x ep [+1], or the site's)"},
    {"pp", K3_FLAG_INT, "S", NULL, "pipeline stages (default 1; on a site: searched)"},
    {"ep", K3_FLAG_INT, "E", NULL,
     "expert-parallel lanes per stage (default 1; on a site: searched)"},
    {"coordinator", K3_FLAG_STR, "MODE", "shared", "shared | dedicated (world = 1 + S x E)"},
    {"expert-map", K3_FLAG_STR, "FILE", NULL, "expert -> lane map (see partition/k3_partition.h)"},
    {"max-ctx", K3_FLAG_INT, "T", K3_ENGINE_ARGS_STR(K3_ENGINE_DEFAULT_MAX_CTX),
     "tokens per sequence (sizes MLA caches; as run/batch/serve)"},
    {"max-seqs", K3_FLAG_INT, "N", K3_ENGINE_ARGS_STR(K3_ENGINE_DEFAULT_MAX_SEQS),
     "sequence slots per lane (sizes caches; as run/batch/serve)"},
    {"max-batch-tokens", K3_FLAG_INT, "T", K3_ENGINE_ARGS_STR(K3_ENGINE_DEFAULT_MAX_BATCH_TOKENS),
     "tokens per forward step of a lane (sizes buffers and workspace; as run/batch/serve)"},
    {"kv-cache-tokens", K3_FLAG_INT, "N", "0",
     "paged MLA cache per lane in tokens (0 = max-seqs x max-ctx; as run/batch/serve)"},
    {"no-prefix-cache", K3_FLAG_BOOL, NULL, NULL,
     "plan without the prefix cache's KDA snapshots (as run/batch/serve)"},
    {"prefix-cache-tokens", K3_FLAG_INT, "N", "0",
     "the prefix cache's budget per lane (0 = the paged cache; sizes its snapshot pool; as "
     "run/batch/serve)"},
    {"max-tokens", K3_FLAG_INT, "N", NULL, "old name of --max-batch-tokens"},
    {"backend", K3_FLAG_STR, "NAME", NULL,
     "cpu | cuda: the ranks' backend (default: cuda on a GPU site, else cpu); cuda adds the "
     "captured steps' pad slot and block, and cuda with nccl the device-routed MoE exchange's "
     "slabs (docs/DESIGN.md §5)"},
    {"comm", K3_FLAG_STR, "NAME", "auto", "auto | mpi | nccl: the transport (auto: nccl on cuda)"},
    {"nodes", K3_FLAG_INT, "N", NULL, "nodes of the site (with --gpu; default 1)"},
    {"gpus-per-node", K3_FLAG_INT, "G", NULL,
     "ranks per node: one per GPU (with --gpu cpu: cpu ranks per node; default 8, cpu 1)"},
    {"gpu", K3_FLAG_STR, "NAME", NULL,
     "built-in device profile h200 | h100 | b200 | cpu (sources in partition/site.c)"},
    {"site", K3_FLAG_STR, "FILE", NULL,
     "site profile JSON instead of --gpu (keys: see slurm/site-example.json)"},
    {"fs-gbps", K3_FLAG_FLOAT, "GB/s", "2", "file-system read GB/s of one node (load time)"},
    {"link-latency-us", K3_FLAG_FLOAT, "US", NULL,
     "one message's latency between nodes in microseconds (a site's inter_us; e.g. a slow or "
     "distant link)"},
    {"slurm", K3_FLAG_BOOL, NULL, NULL, "print the #SBATCH header and srun line for the plan"},
    {"json", K3_FLAG_BOOL, NULL, NULL, "print one JSON object instead of the tables"},
};

/* ---- the site file --------------------------------------------------------------------------- */
static k3_status site_num(const cJSON *j, const char *key, double scale, bool need, double *out,
                          const char *path) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!v) {
        if (need) return K3_ERR(K3_ERR_FORMAT, "%s: key \"%s\" is missing", path, key);
        return K3_OK;
    }
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return K3_ERR(K3_ERR_FORMAT, "%s: \"%s\" must be a number", path, key);
    *out = v->valuedouble * scale;
    return K3_OK;
}

/* {"name", "gpu": bool, "nodes", "gpus_per_node", "cores_per_node", "mem_gb", "mem_bw_gbs",
 *  "tflops", "intra_gbs", "inter_gbs", "intra_us", "inter_us", "source"}: per-device figures
 * (a cpu rank's share of its node when "gpu" is false). */
static k3_status site_read(const char *path, k3_site *s) {
    memset(s, 0, sizeof *s);
    char *text = NULL;
    size_t n;
    K3_TRY(k3_read_file(path, &text, &n));
    cJSON *j = cJSON_ParseWithLength(text, n);
    k3_free(text);
    if (!j || !cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return K3_ERR(K3_ERR_FORMAT, "%s: not a JSON object", path);
    }
    double nodes = 1, rpn = 0, cores = 0, mem = 0, bw = 0, tf = 0, intra = 0, inter = 0,
           intra_us = 10, inter_us = 20;
    k3_status st = K3_OK;
    const struct {
        const char *key;
        double scale, *dst;
        bool need;
    } f[] = {{"nodes", 1, &nodes, false},         {"gpus_per_node", 1, &rpn, true},
             {"cores_per_node", 1, &cores, true}, {"mem_gb", 1e9, &mem, true},
             {"mem_bw_gbs", 1e9, &bw, true},      {"tflops", 1e12, &tf, true},
             {"intra_gbs", 1e9, &intra, true},    {"inter_gbs", 1e9, &inter, true},
             {"intra_us", 1, &intra_us, false},   {"inter_us", 1, &inter_us, false}};
    for (size_t i = 0; i < K3_ARRAY_LEN(f) && st == K3_OK; i++)
        st = site_num(j, f[i].key, f[i].scale, f[i].need, f[i].dst, path);
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(j, "name");
    const cJSON *src = cJSON_GetObjectItemCaseSensitive(j, "source");
    const cJSON *gpu = cJSON_GetObjectItemCaseSensitive(j, "gpu");
    snprintf(s->name, sizeof s->name, "%s", cJSON_IsString(name) ? name->valuestring : "site");
    snprintf(s->source, sizeof s->source, "%s: %s", path,
             cJSON_IsString(src) ? src->valuestring : "(no source given)");
    s->gpu = !gpu || cJSON_IsTrue(gpu);
    cJSON_Delete(j);
    K3_TRY(st);
    if (nodes < 1 || nodes > 1 << 16 || rpn < 1 || rpn > 1024 || cores < 1 || cores > 1 << 16)
        return K3_ERR(K3_ERR_FORMAT, "%s: nodes, gpus_per_node, cores_per_node out of range", path);
    s->nodes = (int)nodes, s->ranks_per_node = (int)rpn, s->cores_per_node = (int)cores;
    s->mem_bytes = mem, s->mem_bw = bw, s->flops = tf, s->intra_bw = intra, s->inter_bw = inter;
    s->intra_lat_s = intra_us * 1e-6, s->inter_lat_s = inter_us * 1e-6;
    return k3_site_check(s);
}

/* ---- output ---------------------------------------------------------------------------------- */
typedef struct plan_out {
    const k3_config *cfg;
    const k3_plan *plan;
    const k3_plan_req *req;
    const k3_site *site; /* NULL: no site given */
    const k3_perf *perf;
    const k3_bind_info *bind; /* [ranks_per_node] this machine's share of each local rank */
    bool searched;
    int best_pp, best_ep;
    const char *reason;
    const k3_plan_cand *cand;
    int n_cand;
    double fs_bps;
    const char *model_arg; /* --model DIR (or NULL for a preset) */
} plan_out;

static void add_mem(cJSON *o, const k3_rank_mem *m, double device) {
    cJSON_AddNumberToObject(o, "weight_bytes", (double)m->weights);
    cJSON_AddNumberToObject(o, "cache_bytes", (double)m->caches);
    cJSON_AddNumberToObject(o, "buffer_bytes", (double)m->buffers);
    cJSON *mm = cJSON_AddObjectToObject(o, "memory");
    cJSON_AddNumberToObject(mm, "weights_bf16", (double)m->weights_bf16);
    cJSON_AddNumberToObject(mm, "weights_mxfp4", (double)m->weights_mxfp4);
    cJSON_AddNumberToObject(mm, "weights_other", (double)m->weights_other);
    cJSON_AddNumberToObject(mm, "mla_cache", (double)m->mla_cache);
    cJSON_AddNumberToObject(mm, "kda_state", (double)m->kda_state);
    cJSON_AddNumberToObject(mm, "kda_snapshots", (double)m->kda_snapshots);
    cJSON_AddNumberToObject(mm, "comm_buffers", (double)m->buffers);
    cJSON_AddNumberToObject(mm, "workspace", (double)m->workspace);
    cJSON_AddNumberToObject(mm, "total", (double)k3_rank_mem_total(m));
    if (device > 0) cJSON_AddNumberToObject(mm, "device", device);
}

/* One node of the site: its ranks' totals, what they hold once, the bytes it reads. */
typedef struct node_mem {
    int n_ranks;
    uint64_t sum, shared, read;
    double memory; /* cpu: the node's memory (a rank's share x ranks) */
    bool fits;
} node_mem;

static void node_of(const k3_plan *p, const k3_site *s, int node, node_mem *o) {
    k3_plan_node_bytes(p, s, node, &o->sum, &o->shared, &o->read);
    o->n_ranks = K3_MAX(0, K3_MIN(s->ranks_per_node, p->world - node * s->ranks_per_node));
    o->memory = s->mem_bytes * s->ranks_per_node;
    o->fits = s->gpu || (double)(o->sum - o->shared) <= o->memory * 0.9;
}

/* A GPU rank fits its device; a cpu rank fits when its node does (k3_plan_fits). */
static bool rank_fits(const k3_plan *p, const k3_site *s, int r) {
    if (s->gpu) return (double)k3_rank_mem_total(&p->mem[r]) <= s->mem_bytes * 0.9;
    node_mem nm;
    node_of(p, s, r / s->ranks_per_node, &nm);
    return nm.fits;
}

static void print_json(const plan_out *po) {
    const k3_plan *p = po->plan;
    const k3_site *s = po->site;
    cJSON *j = cJSON_CreateObject();
    char hx[24];
    snprintf(hx, sizeof hx, "%016llx", (unsigned long long)p->hash);
    cJSON_AddStringToObject(j, "hash", hx);
    cJSON_AddNumberToObject(j, "world", p->world);
    cJSON_AddNumberToObject(j, "pp", p->n_stages);
    cJSON_AddNumberToObject(j, "ep", p->n_lanes);
    cJSON_AddStringToObject(j, "coordinator",
                            p->coord == K3_COORD_DEDICATED ? "dedicated" : "shared");
    cJSON *cap = cJSON_AddObjectToObject(j, "capacity");
    cJSON_AddNumberToObject(cap, "max_seqs", po->req->max_seqs_per_lane);
    cJSON_AddNumberToObject(cap, "max_ctx", (double)po->req->max_ctx);
    cJSON_AddNumberToObject(cap, "max_batch_tokens", (double)po->req->max_tokens);
    cJSON_AddBoolToObject(cap, "graph_pad_slot", po->req->graphs);       /* cuda: one more slot */
    cJSON_AddBoolToObject(cap, "moe_device_slabs", po->req->moe_device); /* cuda + nccl */
    { /* per-sequence and per-token sizes of the whole model (every layer) */
        uint64_t mla, kc, kr;
        k3_plan_seq_bytes(po->cfg, 0, po->cfg->n_layers, 1, &mla, &kc, &kr);
        cJSON *md = cJSON_AddObjectToObject(j, "model");
        cJSON_AddNumberToObject(md, "mla_cache_bytes_per_token", (double)mla);
        cJSON_AddNumberToObject(md, "kda_recurrent_bytes_per_seq", (double)kr);
        cJSON_AddNumberToObject(md, "kda_conv_bytes_per_seq", (double)kc);
    }
    cJSON *st_a = cJSON_AddArrayToObject(j, "stages");
    for (int st = 0; st < p->n_stages; st++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "layer_begin", p->stage_begin[st]);
        cJSON_AddNumberToObject(o, "layer_end", p->stage_begin[st + 1]);
        cJSON_AddNumberToObject(o, "cost_bytes_per_token", p->stage_cost[st]);
        cJSON_AddNumberToObject(o, "dense_bytes", (double)p->stage_dense[st]);
        if (po->perf) {
            cJSON_AddNumberToObject(o, "decode_step_s", po->perf->stage_s[st]);
            cJSON_AddNumberToObject(o, "decode_mem_s", po->perf->stage_mem_s[st]);
            cJSON_AddNumberToObject(o, "decode_flop_s", po->perf->stage_flop_s[st]);
            cJSON_AddNumberToObject(o, "decode_a2a_s", po->perf->stage_a2a_s[st]);
        }
        cJSON_AddItemToArray(st_a, o);
    }
    if (s) { /* cores / numa are hwloc's answer on this machine, shown for every node */
        char host[256] = "?";
        gethostname(host, sizeof host - 1);
        cJSON_AddStringToObject(j, "cores_numa_of_host", host);
    }
    cJSON *rk = cJSON_AddArrayToObject(j, "ranks");
    for (int r = 0; r < p->world; r++) {
        int stg, lane;
        k3_plan_coords(p, r, &stg, &lane);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "rank", r);
        cJSON_AddNumberToObject(o, "stage", stg);
        cJSON_AddNumberToObject(o, "lane", lane);
        if (s) {
            int loc = r % s->ranks_per_node;
            cJSON_AddNumberToObject(o, "node", r / s->ranks_per_node);
            cJSON_AddNumberToObject(o, "local_rank", loc);
            cJSON_AddNumberToObject(o, "device", s->gpu ? loc : -1);
            cJSON_AddStringToObject(o, "cores", po->bind[loc].cores);
            cJSON_AddStringToObject(o, "numa", po->bind[loc].numa);
        }
        add_mem(o, &p->mem[r], s ? s->mem_bytes : 0);
        if (s) cJSON_AddBoolToObject(o, "fits", rank_fits(p, s, r));
        cJSON_AddItemToArray(rk, o);
    }
    if (s) {
        cJSON *na = cJSON_AddArrayToObject(j, "nodes");
        for (int n = 0; n < s->nodes; n++) {
            node_mem nm;
            node_of(p, s, n, &nm);
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "node", n);
            cJSON_AddNumberToObject(o, "ranks", nm.n_ranks);
            cJSON_AddNumberToObject(o, "ranks_bytes", (double)nm.sum);
            cJSON_AddNumberToObject(o, "shared_bytes", (double)nm.shared);
            cJSON_AddNumberToObject(o, "total_bytes", (double)(nm.sum - nm.shared));
            cJSON_AddNumberToObject(o, "read_bytes", (double)nm.read);
            if (!s->gpu) cJSON_AddNumberToObject(o, "memory_bytes", nm.memory);
            cJSON_AddBoolToObject(o, "fits", nm.fits);
            cJSON_AddItemToArray(na, o);
        }
        cJSON *so = cJSON_AddObjectToObject(j, "site");
        cJSON_AddStringToObject(so, "name", s->name);
        cJSON_AddNumberToObject(so, "nodes", s->nodes);
        cJSON_AddNumberToObject(so, "gpus_per_node", s->ranks_per_node);
        cJSON_AddBoolToObject(so, "gpu", s->gpu);
        cJSON_AddNumberToObject(so, "device_memory_bytes", s->mem_bytes);
        cJSON_AddNumberToObject(so, "mem_bw_bytes_per_s", s->mem_bw);
        cJSON_AddNumberToObject(so, "flops", s->flops);
        cJSON_AddNumberToObject(so, "intra_node_bytes_per_s", s->intra_bw);
        cJSON_AddNumberToObject(so, "inter_node_bytes_per_s", s->inter_bw);
        cJSON_AddStringToObject(so, "source", s->source);
        uint64_t most;
        cJSON_AddBoolToObject(j, "fits", k3_plan_fits(p, s, &most));
        cJSON_AddNumberToObject(j, "max_rank_bytes", (double)most);
        const k3_perf *f = po->perf;
        cJSON *pr = cJSON_AddObjectToObject(j, "prediction");
        cJSON_AddNumberToObject(pr, "decode_tok_s", f->decode_tok_s);
        cJSON_AddNumberToObject(pr, "prefill_tok_s", f->prefill_tok_s);
        cJSON_AddNumberToObject(pr, "micro_batches", f->micro_batches);
        cJSON_AddNumberToObject(pr, "seqs_per_group", f->seqs_per_group);
        cJSON_AddNumberToObject(pr, "decode_round_s", f->period_s);
        cJSON_AddNumberToObject(pr, "group_latency_s", f->latency_s);
        cJSON_AddNumberToObject(pr, "bubble", f->bubble);
        cJSON_AddNumberToObject(pr, "handoff_s", f->handoff_s);
        cJSON_AddNumberToObject(pr, "logits_s", f->logits_s);
        cJSON_AddNumberToObject(pr, "decode_round_bytes", f->decode_bytes);
        cJSON_AddNumberToObject(pr, "decode_round_flops", f->decode_flops);
        cJSON_AddNumberToObject(pr, "decode_round_a2a_bytes", f->a2a_bytes);
        cJSON_AddStringToObject(pr, "bound", f->bound);
        cJSON_AddNumberToObject(pr, "load_s", f->load_s);
        cJSON_AddNumberToObject(pr, "fs_gbps", po->fs_bps / 1e9);
    }
    if (po->searched) {
        cJSON *rc = cJSON_AddObjectToObject(j, "recommendation");
        cJSON_AddNumberToObject(rc, "pp", po->best_pp);
        cJSON_AddNumberToObject(rc, "ep", po->best_ep);
        cJSON_AddStringToObject(rc, "reason", po->reason);
        cJSON *ca = cJSON_AddArrayToObject(rc, "candidates");
        for (int i = 0; i < po->n_cand; i++) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "pp", po->cand[i].pp);
            cJSON_AddNumberToObject(o, "ep", po->cand[i].ep);
            cJSON_AddBoolToObject(o, "fits", po->cand[i].fits);
            cJSON_AddNumberToObject(o, "max_rank_bytes", (double)po->cand[i].max_bytes);
            cJSON_AddNumberToObject(o, "decode_tok_s", po->cand[i].decode_tok_s);
            cJSON_AddNumberToObject(o, "prefill_tok_s", po->cand[i].prefill_tok_s);
            cJSON_AddItemToArray(ca, o);
        }
    }
    char *txt = cJSON_PrintUnformatted(j);
    printf("%s\n", txt ? txt : "{}");
    cJSON_free(txt);
    cJSON_Delete(j);
}

static void print_nodes(const plan_out *po) {
    const k3_plan *p = po->plan;
    const k3_site *s = po->site;
    const double GB = 1e9;
    printf("memory by node (GB): the lanes of a stage on one node read its dense weights once%s\n",
           s->gpu ? " (each GPU still holds its own copy)" : " and hold them once (shared memory)");
    printf("  node  ranks  ranks' sum  held once   node total  %s  read from files\n",
           s->gpu ? "" : "of node  ");
    for (int n = 0; n < s->nodes; n++) {
        node_mem nm;
        node_of(p, s, n, &nm);
        printf("  %4d  %5d  %10.2f  %9.2f  %11.2f  ", n, nm.n_ranks, nm.sum / GB, nm.shared / GB,
               (nm.sum - nm.shared) / GB);
        if (!s->gpu)
            printf("%6.1f%%%s  ", 100 * (nm.sum - nm.shared) / nm.memory,
                   nm.fits ? "" : " DOES NOT FIT");
        printf("%15.2f\n", nm.read / GB);
    }
}

static void print_tables(const plan_out *po) {
    const k3_plan *p = po->plan;
    const k3_site *s = po->site;
    const double GB = 1e9;
    if (s) {
        printf("site: %s, %d node%s x %d %s, %.1f GB a device; figures: %s\n", s->name, s->nodes,
               s->nodes == 1 ? "" : "s", s->ranks_per_node, s->gpu ? "GPUs" : "cpu ranks",
               s->mem_bytes / GB, s->source);
    }
    if (po->searched) {
        printf("search (--pp/--ep not given):\n     pp    ep  fits  largest rank GB  decode tok/s  "
               "prefill tok/s\n");
        for (int i = 0; i < po->n_cand; i++)
            printf("  %5d %5d  %4s  %15.2f  %12.1f  %13.1f\n", po->cand[i].pp, po->cand[i].ep,
                   po->cand[i].fits ? "yes" : "no", po->cand[i].max_bytes / GB,
                   po->cand[i].decode_tok_s, po->cand[i].prefill_tok_s);
        printf("recommended: %s\n", po->reason);
    }
    size_t cap = 4096 + (size_t)p->world * 96 + (size_t)p->n_stages * 128;
    char *buf = NULL;
    if (k3_alloc((void **)&buf, cap, "plan table") == K3_OK) {
        k3_plan_format(p, po->cfg, buf, cap);
        fputs(buf, stdout);
        k3_free(buf);
    }
    printf(
        "memory by kind (GB): capacity %d seqs x %lld tokens per lane, %lld tokens per step%s%s\n",
        po->req->max_seqs_per_lane, (long long)po->req->max_ctx, (long long)po->req->max_tokens,
        po->req->graphs ? "; + 1 pad slot (cuda graphs)" : "",
        po->req->moe_device ? "; the device-routed MoE slabs in buffers (cuda + nccl)" : "");
    if (s && s->nodes > 1) {
        char host[256] = "?";
        gethostname(host, sizeof host - 1);
        printf("  (cores and numa: how hwloc binds each local rank on this machine, %s, repeated "
               "for every node; the other nodes bind by their own layout)\n",
               host);
    }
    printf("  rank  node  local  device  cores        numa  w.bf16  w.mxfp4  w.other  mla  "
           "     kda      comm     work     total  %s\n",
           s ? "of device" : "");
    for (int r = 0; r < p->world; r++) {
        const k3_rank_mem *m = &p->mem[r];
        int node = s ? r / s->ranks_per_node : 0, loc = s ? r % s->ranks_per_node : r;
        const k3_bind_info *b = s ? &po->bind[loc] : NULL;
        char dev[16];
        snprintf(dev, sizeof dev, "%s", s && s->gpu ? "" : "cpu");
        if (s && s->gpu) snprintf(dev, sizeof dev, "gpu%d", loc);
        double tot = (double)k3_rank_mem_total(m);
        printf("  %4d  %4d  %5d  %6s  %-11s  %4s  %6.2f  %7.2f  %7.2f  %7.3f  %7.3f  %7.3f  "
               "%7.3f  %8.2f",
               r, node, loc, dev, b ? b->cores : "-", b ? b->numa : "-", m->weights_bf16 / GB,
               m->weights_mxfp4 / GB, m->weights_other / GB, m->mla_cache / GB,
               (m->kda_state + m->kda_snapshots) / GB, m->buffers / GB, m->workspace / GB,
               tot / GB);
        if (s)
            printf("  %.1f%%%s", 100 * tot / s->mem_bytes,
                   rank_fits(p, s, r) ? "" : " DOES NOT FIT");
        printf("\n");
    }
    if (!s) return;
    print_nodes(po);
    const k3_perf *f = po->perf;
    uint64_t most;
    bool fits = k3_plan_fits(p, s, &most);
    if (s->gpu)
        printf("fit: %s (largest rank %.2f GB; a device %.2f GB less the engine's 10%% margin)\n",
               fits ? "yes" : "NO", most / GB, s->mem_bytes / GB);
    else
        printf("fit: %s (each node's ranks, the shared dense weights once, within %.2f GB of node "
               "memory less the engine's 10%% margin)\n",
               fits ? "yes" : "NO", s->mem_bytes * s->ranks_per_node / GB);
    printf("load: %.0f s at %.2f GB/s a node (the largest node's reads)\n", f->load_s,
           po->fs_bps / GB);
    printf("predicted (cost model in partition/site.c; nominal rates, an upper bound):\n");
    printf("  decode  %.1f tok/s: %d micro-batches of %d seqs a lane; round %.3f ms, one group's "
           "trip %.3f ms, bubble %.0f%%; bound by %s\n",
           f->decode_tok_s, f->micro_batches, f->seqs_per_group, f->period_s * 1e3,
           f->latency_s * 1e3, f->bubble * 100, f->bound);
    printf("  prefill %.1f tok/s (chunks of %lld tokens a lane)\n", f->prefill_tok_s,
           (long long)po->req->max_tokens);
    printf("  per decode round: %.2f GB read, %.2f TFLOP, %.3f GB all-to-all; hand-off %.3f ms, "
           "logits into rank 0 %.3f ms\n",
           f->decode_bytes / GB, f->decode_flops / 1e12, f->a2a_bytes / GB, f->handoff_s * 1e3,
           f->logits_s * 1e3);
    printf("  stage  decode step ms  memory ms  compute ms  all-to-all ms\n");
    for (int st = 0; st < p->n_stages; st++)
        printf("  %5d  %14.3f  %9.3f  %10.3f  %13.3f\n", st, f->stage_s[st] * 1e3,
               f->stage_mem_s[st] * 1e3, f->stage_flop_s[st] * 1e3, f->stage_a2a_s[st] * 1e3);
}

/* #SBATCH header + launch line (slurm/k3.sbatch is the full script with the same shape). */
static void print_slurm(const plan_out *po) {
    const k3_plan *p = po->plan;
    const k3_site *s = po->site;
    const int cpt = K3_MAX(1, s->cores_per_node / s->ranks_per_node);
    const bool over = s->ranks_per_node > s->cores_per_node;
    printf("#!/bin/bash\n");
    printf("#SBATCH --job-name=k3\n");
    printf("#SBATCH --nodes=%d\n", s->nodes);
    if (over) { /* more ranks than cores: Slurm refuses --ntasks-per-node above the CPUs */
        printf("#SBATCH --ntasks=%d\n", s->nodes * s->ranks_per_node);
        printf("#SBATCH --overcommit\n");
    } else {
        printf("#SBATCH --ntasks-per-node=%d\n", s->ranks_per_node);
        printf("#SBATCH --cpus-per-task=%d\n", cpt);
    }
    if (s->gpu) printf("#SBATCH --gpus-per-node=%d\n", s->ranks_per_node);
    printf("#SBATCH --time=%02d:00:00\n", 1 + (int)(po->perf->load_s / 3600));
    printf("#SBATCH --output=k3-%%j.out\n");
    uint64_t most;
    bool fits = k3_plan_fits(p, s, &most);
    printf("# plan %016llx: %d stages x %d lanes; largest rank %.2f GB of %.2f GB%s; load ~%.0f "
           "s\n",
           (unsigned long long)p->hash, p->n_stages, p->n_lanes, most / 1e9, s->mem_bytes / 1e9,
           fits ? "" : " (DOES NOT FIT)", po->perf->load_s);
    printf("# the same with the site knobs of slurm/site.env: K3_MODEL=DIR K3_PP=%d K3_EP=%d "
           "sbatch <these options> slurm/k3.sbatch run ...\n",
           p->n_stages, p->n_lanes);
    printf("set -euo pipefail\n");
    printf("srun --mpi=pmix --cpu-bind=none k3 run --model %s --pp %d --ep %d --max-seqs %d "
           "--max-ctx %lld --max-batch-tokens %lld%s --bind auto \"$@\"\n",
           po->model_arg ? po->model_arg : "\"$K3_MODEL\"", p->n_stages, p->n_lanes,
           po->req->max_seqs_per_lane, (long long)po->req->max_ctx, (long long)po->req->max_tokens,
           s->gpu ? " --backend cuda" : "");
}

/* ---- the command ----------------------------------------------------------------------------- */
static int fail(const char *what, int rc) {
    fprintf(stderr, "k3 plan: %s%s\n", what ? what : "", k3_last_error());
    return rc;
}

static int run_plan(const k3_args *a) {
    const char *model = k3_args_str(a, "model"), *preset = k3_args_str(a, "preset");
    if (!model == !preset) {
        fprintf(stderr, "k3 plan: give exactly one of --model DIR or --preset NAME\n");
        return 2;
    }
    k3_config cfg;
    if (preset) {
        k3_preset p;
        if (k3_preset_parse(preset, &p) != K3_OK) return fail(NULL, 2);
        k3_preset_config(p, &cfg);
    } else if (k3_config_load(model, &cfg) != K3_OK) {
        return fail(NULL, 1);
    }
    k3_coord_mode cm;
    if (k3_coord_mode_parse(k3_args_str(a, "coordinator"), &cm) != K3_OK) return fail(NULL, 2);
    /* the site */
    k3_site site;
    bool have_site = false;
    const char *site_path = k3_args_str(a, "site"), *gpu = k3_args_str(a, "gpu");
    bool site_flags = k3_args_has(a, "nodes") || k3_args_has(a, "gpus-per-node");
    if (site_path && gpu) {
        fprintf(stderr, "k3 plan: give --site FILE or --gpu NAME, not both\n");
        return 2;
    }
    if (site_flags && !site_path && !gpu) {
        fprintf(stderr, "k3 plan: --nodes/--gpus-per-node need --gpu h200|h100|b200|cpu or "
                        "--site FILE.json\n");
        return 2;
    }
    int64_t nodes = k3_args_has(a, "nodes") ? k3_args_int(a, "nodes") : 1;
    int64_t gpn = k3_args_has(a, "gpus-per-node")  ? k3_args_int(a, "gpus-per-node")
                  : gpu && strcmp(gpu, "cpu") == 0 ? 1
                                                   : 8;
    if (nodes < 1 || nodes > 1 << 16 || gpn < 1 || gpn > 1024) {
        fprintf(stderr, "k3 plan: --nodes must be in [1, 65536], --gpus-per-node in [1, 1024]\n");
        return 2;
    }
    if (gpu) {
        if (k3_site_builtin(gpu, (int)nodes, (int)gpn, &site) != K3_OK) return fail(NULL, 2);
        have_site = true;
    } else if (site_path) {
        if (site_read(site_path, &site) != K3_OK) return fail("--site: ", 2);
        if (k3_args_has(a, "nodes")) site.nodes = (int)nodes;
        if (k3_args_has(a, "gpus-per-node")) site.ranks_per_node = (int)gpn;
        have_site = true;
    }
    if (k3_args_has(a, "link-latency-us")) {
        const double us = k3_args_float(a, "link-latency-us");
        if (!have_site || !(us >= 0) || us > 1e7) {
            fprintf(stderr, "k3 plan: --link-latency-us needs a site (--gpu or --site) and a "
                            "value in [0, 1e7]\n");
            return 2;
        }
        site.inter_lat_s = us * 1e-6;
    }
    const double fs = k3_args_float(a, "fs-gbps") * 1e9;
    if (!(fs > 0)) {
        fprintf(stderr, "k3 plan: --fs-gbps must be > 0\n");
        return 2;
    }
    /* capacity: the engine's flags, bounds and defaults */
    const char *toks_flag = k3_args_has(a, "max-tokens") ? "max-tokens" : "max-batch-tokens";
    int64_t ctx = k3_args_int(a, "max-ctx"), seqs = k3_args_int(a, "max-seqs"),
            toks = k3_args_int(a, toks_flag);
    const int64_t kvt = k3_args_int(a, "kv-cache-tokens");
    /* the ranges are the engine flags' (engine_args.c); --max-tokens is --max-batch-tokens */
    const int64_t pct = k3_args_int(a, "prefix-cache-tokens");
    const char *const cap_flag[] = {"max-ctx", "max-seqs", "max-batch-tokens", "kv-cache-tokens",
                                    "prefix-cache-tokens"};
    const char *const cap_name[] = {"max-ctx", "max-seqs", toks_flag, "kv-cache-tokens",
                                    "prefix-cache-tokens"};
    const int64_t val[] = {ctx, seqs, toks, kvt, pct};
    for (size_t i = 0; i < K3_ARRAY_LEN(cap_flag); i++) {
        int64_t lo = 0, hi = 0;
        const bool known = k3_engine_flag_range(cap_flag[i], &lo, &hi);
        K3_ASSERT(known);
        if (val[i] < lo || val[i] > hi) {
            fprintf(stderr, "k3 plan: --%s %lld is outside [%lld, %lld]\n", cap_name[i],
                    (long long)val[i], (long long)lo, (long long)hi);
            return 2;
        }
    }
    const int ded = cm == K3_COORD_DEDICATED;
    int64_t world = have_site ? (int64_t)site.nodes * site.ranks_per_node : 0;
    if (k3_args_has(a, "world")) {
        if (have_site && k3_args_int(a, "world") != world) {
            fprintf(stderr,
                    "k3 plan: --world %lld but the site has %lld ranks (nodes x "
                    "gpus-per-node)\n",
                    (long long)k3_args_int(a, "world"), (long long)world);
            return 2;
        }
        world = k3_args_int(a, "world");
    }
    int64_t pp = k3_args_has(a, "pp") ? k3_args_int(a, "pp") : 0;
    int64_t ep = k3_args_has(a, "ep") ? k3_args_int(a, "ep") : 0;
    if (!have_site && !world) {
        pp = pp ? pp : 1, ep = ep ? ep : 1;
        world = pp * ep + ded;
    }
    if (have_site && ded) {
        fprintf(stderr, "k3 plan: a site plan puts one rank on each device; --coordinator "
                        "dedicated is not planned on a site\n");
        return 2;
    }
    if (pp < 0 || pp > 4096 || ep < 0 || ep > 4096 || world < 1 || world > 1 << 20) {
        fprintf(stderr, "k3 plan: --pp and --ep must be in [1, 4096], --world in [1, %d]\n",
                1 << 20);
        return 2;
    }
    if (!pp && ep) pp = (world - ded) / ep;
    if (pp && !ep) ep = (world - ded) / pp;
    /* the prefix cache's snapshot pool, as the engine sizes it (rank/setup.c) */
    const int64_t kv_blocks = ((kvt > 0 ? kvt : seqs * ctx) + K3_KV_BLOCK - 1) / K3_KV_BLOCK;
    const int snaps =
        k3_args_bool(a, "no-prefix-cache")
            ? 0
            : k3_plan_prefix_snapshots(pct > 0 ? (pct + K3_KV_BLOCK - 1) / K3_KV_BLOCK : kv_blocks,
                                       (int)seqs);
    /* the backend and transport, as the engine resolves them (rank/setup.c's plan request) */
    const char *be = k3_args_str(a, "backend"), *comm = k3_args_str(a, "comm");
    if (!be) be = have_site && site.gpu ? "cuda" : "cpu";
    if (strcmp(be, "cpu") != 0 && strcmp(be, "cuda") != 0) {
        fprintf(stderr, "k3 plan: --backend '%s': want cpu or cuda\n", be);
        return 2;
    }
    if (strcmp(comm, "auto") != 0 && strcmp(comm, "mpi") != 0 && strcmp(comm, "nccl") != 0) {
        fprintf(stderr, "k3 plan: --comm '%s': want auto, mpi or nccl\n", comm);
        return 2;
    }
    const bool cuda = strcmp(be, "cuda") == 0;
    if (!cuda && strcmp(comm, "nccl") == 0) {
        fprintf(stderr, "k3 plan: --comm nccl needs --backend cuda\n");
        return 2;
    }
    const bool nccl = cuda && strcmp(comm, "mpi") != 0;
    k3_plan_req req = {.world = (int)world,
                       .coord = cm,
                       .max_ctx = ctx,
                       .max_seqs_per_lane = (int)seqs,
                       .max_tokens = toks,
                       .kv_cache_tokens = kvt,
                       .prefix_snapshots = snaps,
                       .moe_device = nccl && !getenv("K3_MOE_HOST_ROUTE"),
                       .graphs = cuda};
    plan_out po = {.cfg = &cfg,
                   .req = &req,
                   .site = have_site ? &site : NULL,
                   .fs_bps = fs,
                   .model_arg = model};
    char reason[512] = "";
    k3_plan_cand cand[64];
    if (!pp && !ep) { /* search (a site is given: the only way to get here without pp/ep) */
        if (k3_plan_search(&cfg, &req, &site, &po.best_pp, &po.best_ep, reason, sizeof reason, cand,
                           (int)K3_ARRAY_LEN(cand), &po.n_cand) != K3_OK)
            return fail(NULL, 2);
        po.n_cand = K3_MIN(po.n_cand, (int)K3_ARRAY_LEN(cand));
        po.searched = true, po.reason = reason, po.cand = cand;
        pp = po.best_pp, ep = po.best_ep;
    }
    req.pp = (int)pp, req.ep = (int)ep;
    char *map = NULL;
    const char *map_path = k3_args_str(a, "expert-map");
    if (map_path) {
        size_t n;
        if (k3_read_file(map_path, &map, &n) != K3_OK) return fail("--expert-map: ", 1);
    }
    req.expert_map = map, req.expert_map_name = map_path;
    k3_plan plan;
    k3_status st = k3_plan_make(&cfg, &req, &plan);
    k3_free(map);
    if (st != K3_OK) return fail(NULL, st == K3_ERR_ARG ? 2 : 1);
    po.plan = &plan;
    k3_perf perf;
    k3_bind_info *bind = NULL;
    if (have_site) {
        k3_plan_predict(&cfg, &plan, &req, &site, fs, &perf);
        po.perf = &perf;
        if (k3_calloc((void **)&bind, (size_t)site.ranks_per_node * sizeof *bind, "binds") !=
            K3_OK) {
            k3_plan_free(&plan);
            return fail(NULL, 1);
        }
        for (int l = 0; l < site.ranks_per_node; l++)
            if (k3_bind_describe(l, site.ranks_per_node, site.gpu, &bind[l]) != K3_OK)
                snprintf(bind[l].cores, sizeof bind[l].cores, "?");
        po.bind = bind;
    }
    if (k3_args_bool(a, "slurm")) {
        if (!have_site) {
            k3_plan_free(&plan);
            fprintf(stderr, "k3 plan: --slurm needs a site (--gpu or --site)\n");
            return 2;
        }
        print_slurm(&po);
    } else if (k3_args_bool(a, "json")) {
        print_json(&po);
    } else {
        print_tables(&po);
    }
    k3_free(bind);
    k3_plan_free(&plan);
    return 0;
}

const k3_command k3_cmd_plan = {
    .name = "plan",
    .positional = "",
    .min_pos = 0,
    .max_pos = 0,
    .summary = "the distributed plan (stages, experts, memory by kind per rank) for a model or "
               "preset; on a site: placement, fit, load time, predicted throughput, --slurm",
    .flags = flags,
    .n_flags = (int)K3_ARRAY_LEN(flags),
    .run = run_plan,
};
