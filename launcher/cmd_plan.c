/* cmd_plan.c — `k3 plan`: print the plan a distributed run would use (stages, costs, expert
 * ranges, per-rank bytes) for a checkpoint's config.json or a preset, without MPI or weights.
 * Owns: the flags; the plan itself comes from partition/ (the same pure function every rank of
 * `k3 run` calls), so what this prints is what the run does. */
#include "k3_launcher.h"

#include <cjson/cJSON.h>
#include <stdio.h>

#include "k3_partition.h"

static const k3_flag flags[] = {
    {"model", K3_FLAG_STR, "DIR", NULL, "checkpoint directory (its config.json)"},
    {"preset", K3_FLAG_STR, "NAME", NULL, "tiny | small | k3 instead of --model"},
    {"world", K3_FLAG_INT, "N", NULL, "MPI world size (default: pp x ep [+1])"},
    {"pp", K3_FLAG_INT, "S", "1", "pipeline stages"},
    {"ep", K3_FLAG_INT, "E", "1", "expert-parallel lanes per stage"},
    {"coordinator", K3_FLAG_STR, "MODE", "shared", "shared | dedicated (world = 1 + S x E)"},
    {"expert-map", K3_FLAG_STR, "FILE", NULL, "expert -> lane map (see partition/k3_partition.h)"},
    {"max-ctx", K3_FLAG_INT, "N", "4096", "context per sequence (sizes caches)"},
    {"max-seqs", K3_FLAG_INT, "N", "8", "sequence slots per lane (sizes caches; as run/batch)"},
    {"max-batch-tokens", K3_FLAG_INT, "N", "512",
     "tokens per forward step of a lane (sizes buffers; the same flag as run/batch)"},
    {"max-tokens", K3_FLAG_INT, "N", NULL, "old name of --max-batch-tokens"},
    {"json", K3_FLAG_BOOL, NULL, NULL, "print one JSON object instead of the table"},
};

static int run_plan(const k3_args *a) {
    const char *model = k3_args_str(a, "model"), *preset = k3_args_str(a, "preset");
    if (!model == !preset) {
        fprintf(stderr, "k3 plan: give exactly one of --model DIR or --preset NAME\n");
        return 2;
    }
    k3_config cfg;
    if (preset) {
        k3_preset p;
        if (k3_preset_parse(preset, &p) != K3_OK) {
            fprintf(stderr, "k3 plan: %s\n", k3_last_error());
            return 2;
        }
        k3_preset_config(p, &cfg);
    } else if (k3_config_load(model, &cfg) != K3_OK) {
        fprintf(stderr, "k3 plan: %s\n", k3_last_error());
        return 1;
    }
    k3_coord_mode cm;
    if (k3_coord_mode_parse(k3_args_str(a, "coordinator"), &cm) != K3_OK) {
        fprintf(stderr, "k3 plan: %s\n", k3_last_error());
        return 2;
    }
    int64_t pp = k3_args_int(a, "pp"), ep = k3_args_int(a, "ep");
    int64_t world =
        k3_args_has(a, "world") ? k3_args_int(a, "world") : pp * ep + (cm == K3_COORD_DEDICATED);
    /* --max-tokens is the old name of --max-batch-tokens */
    const char *toks_flag = k3_args_has(a, "max-tokens") ? "max-tokens" : "max-batch-tokens";
    int64_t ctx = k3_args_int(a, "max-ctx"), seqs = k3_args_int(a, "max-seqs"),
            toks = k3_args_int(a, toks_flag);
    if (pp < 1 || pp > 4096 || ep < 1 || ep > 4096 || world < 1 || world > 1 << 20) {
        fprintf(stderr, "k3 plan: --pp and --ep must be in [1, 4096], --world in [1, %d]\n",
                1 << 20);
        return 2;
    }
    /* Bounds far above any real run (K3's max_position_embeddings is 2^20) that keep the byte
     * estimates inside 64 bits; k3_plan_make also checks its products. */
    const struct {
        const char *flag;
        int64_t max;
    } lim[] = {{"max-ctx", (int64_t)1 << 30}, {"max-seqs", 1 << 20}, {toks_flag, 1 << 24}};
    const int64_t val[] = {ctx, seqs, toks};
    for (size_t i = 0; i < K3_ARRAY_LEN(lim); i++)
        if (val[i] < 1 || val[i] > lim[i].max) {
            fprintf(stderr, "k3 plan: --%s %lld is outside [1, %lld]\n", lim[i].flag,
                    (long long)val[i], (long long)lim[i].max);
            return 2;
        }
    char *map = NULL;
    const char *map_path = k3_args_str(a, "expert-map");
    if (map_path) {
        size_t n;
        if (k3_read_file(map_path, &map, &n) != K3_OK) {
            fprintf(stderr, "k3 plan: --expert-map: %s\n", k3_last_error());
            return 1;
        }
    }
    k3_plan_req req = {.world = (int)world,
                       .pp = (int)pp,
                       .ep = (int)ep,
                       .coord = cm,
                       .expert_map = map,
                       .expert_map_name = map_path,
                       .max_ctx = ctx,
                       .max_seqs_per_lane = (int)seqs,
                       .max_tokens = toks};
    k3_plan plan;
    k3_status st = k3_plan_make(&cfg, &req, &plan);
    k3_free(map);
    if (st != K3_OK) {
        fprintf(stderr, "k3 plan: %s\n", k3_last_error());
        return st == K3_ERR_ARG ? 2 : 1;
    }
    if (k3_args_bool(a, "json")) {
        cJSON *j = cJSON_CreateObject();
        char hx[24];
        snprintf(hx, sizeof hx, "%016llx", (unsigned long long)plan.hash);
        cJSON_AddStringToObject(j, "hash", hx);
        cJSON_AddNumberToObject(j, "world", plan.world);
        cJSON_AddNumberToObject(j, "pp", plan.n_stages);
        cJSON_AddNumberToObject(j, "ep", plan.n_lanes);
        cJSON_AddStringToObject(j, "coordinator",
                                cm == K3_COORD_DEDICATED ? "dedicated" : "shared");
        cJSON *st_a = cJSON_AddArrayToObject(j, "stages");
        for (int s = 0; s < plan.n_stages; s++) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "layer_begin", plan.stage_begin[s]);
            cJSON_AddNumberToObject(o, "layer_end", plan.stage_begin[s + 1]);
            cJSON_AddNumberToObject(o, "cost_bytes_per_token", plan.stage_cost[s]);
            cJSON_AddItemToArray(st_a, o);
        }
        cJSON *rk = cJSON_AddArrayToObject(j, "ranks");
        for (int r = 0; r < plan.world; r++) {
            int s, e;
            k3_plan_coords(&plan, r, &s, &e);
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "rank", r);
            cJSON_AddNumberToObject(o, "stage", s);
            cJSON_AddNumberToObject(o, "lane", e);
            cJSON_AddNumberToObject(o, "weight_bytes", (double)plan.mem[r].weights);
            cJSON_AddNumberToObject(o, "cache_bytes", (double)plan.mem[r].caches);
            cJSON_AddNumberToObject(o, "buffer_bytes", (double)plan.mem[r].buffers);
            cJSON_AddItemToArray(rk, o);
        }
        char *s = cJSON_PrintUnformatted(j);
        printf("%s\n", s ? s : "{}");
        cJSON_free(s);
        cJSON_Delete(j);
    } else {
        size_t cap = 4096 + (size_t)plan.world * 96 + (size_t)plan.n_stages * 128;
        char *buf = NULL;
        if (k3_alloc((void **)&buf, cap, "plan table") != K3_OK) {
            k3_plan_free(&plan);
            fprintf(stderr, "k3 plan: %s\n", k3_last_error());
            return 1;
        }
        k3_plan_format(&plan, &cfg, buf, cap);
        fputs(buf, stdout);
        k3_free(buf);
    }
    k3_plan_free(&plan);
    return 0;
}

const k3_command k3_cmd_plan = {
    .name = "plan",
    .positional = "",
    .min_pos = 0,
    .max_pos = 0,
    .summary = "print the distributed plan (stages, experts, bytes per rank) for a model or preset",
    .flags = flags,
    .n_flags = (int)K3_ARRAY_LEN(flags),
    .run = run_plan,
};
