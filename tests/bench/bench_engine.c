/* bench_engine.c — continuous batching through the engine API, measured (a benchmark, never
 * pass/fail). Under mpirun on any split:
 *   mpirun -np W bench_engine --model DIR [--pp S --ep E] [--requests N] [--prompt P] [--gen G]
 *                             [--max-seqs N] [--max-batch-tokens T] [--micro-batches M]
 *                             [--json FILE]
 * rank 0 runs N requests (random prompts of P tokens, G new tokens each, greedy, ignore EOS)
 * twice: all submitted at once (continuous batching), then one at a time. It prints a table and
 * writes JSON: wall time and tok/s of both, and for the batched run each rank's busy fraction
 * (time inside forward steps / wall) and the measured pipeline bubble (1 - mean busy of the
 * busiest lane per stage) next to the ideal (S-1)/(M+S-1) with M micro-batches in flight. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "k3_comm.h"
#include "k3_engine.h"
#include "k3_model.h"

typedef struct {
    double wall;
    int64_t gen, prompt;
    k3_engine_stats es;
} run_res;

static int parse(int argc, char **argv, const char *name, int def) {
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0) return atoi(argv[i + 1]);
    return def;
}
static const char *parse_s(int argc, char **argv, const char *name, const char *def) {
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0) return argv[i + 1];
    return def;
}

/* One engine lifetime: N requests, all at once (batched) or one at a time. */
static int run(const k3_engine_opts *o, int n_req, int P, int G, bool batched, int64_t vocab,
               run_res *res) {
    k3_engine *e = NULL;
    k3_status ost = k3_engine_open(o, &e);
    if (ost != K3_OK && e) k3_engine_abort(e);
    if (ost != K3_OK) return ost == K3_ERR_ARG ? 2 : 1;
    if (!k3_engine_is_coordinator(e)) {
        if (k3_engine_serve(e) != K3_OK) k3_engine_abort(e); /* serves, then closes */
        return 0;
    }
    k3_rng rng;
    k3_rng_seed(&rng, 1234);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)P);
    double t0 = k3_now_s();
    int done = 0, next = 0;
    res->gen = res->prompt = 0;
    while (done < n_req) {
        while (next < n_req && (batched || k3_engine_pending(e) == 0)) {
            for (int t = 0; t < P; t++) ids[t] = (int32_t)(k3_rng_u64(&rng) % (uint64_t)vocab);
            k3_request rq = {.ids = ids,
                             .n_ids = P,
                             .max_tokens = G,
                             .ignore_eos = true,
                             .user = (uint64_t)next};
            int64_t id;
            if (k3_engine_submit(e, &rq, &id) != K3_OK) return 1;
            next++;
        }
        const k3_event *ev;
        int n;
        if (k3_engine_step(e, &ev, &n) != K3_OK) k3_engine_abort(e);
        for (int k = 0; k < n; k++) {
            if (ev[k].kind == K3_EV_TOKEN) res->gen++;
            if (ev[k].kind != K3_EV_TOKEN) done++, res->prompt += ev[k].n_prompt;
            if (ev[k].kind == K3_EV_ERROR) fprintf(stderr, "request failed: %s\n", ev[k].error);
        }
    }
    res->wall = k3_now_s() - t0;
    free(ids);
    if (k3_engine_close(e, &res->es) != K3_OK) k3_engine_abort(e);
    return 0;
}

int main(int argc, char **argv) {
    if (k3_comm_init() != K3_OK) return 1;
    int rank, world;
    k3_comm_world(&rank, &world);
    const char *model = parse_s(argc, argv, "--model", NULL);
    if (!model) {
        fprintf(stderr, "bench_engine: --model DIR is required\n");
        return 2;
    }
    int n_req = parse(argc, argv, "--requests", 32), P = parse(argc, argv, "--prompt", 128),
        G = parse(argc, argv, "--gen", 32);
    k3_engine_opts o = {.model_dir = model,
                        .pp = parse(argc, argv, "--pp", 1),
                        .ep = parse(argc, argv, "--ep", 1),
                        .comm_timeout_s = 600,
                        .max_seqs = parse(argc, argv, "--max-seqs", 16),
                        .max_ctx = P + G,
                        .max_batch_tokens = parse(argc, argv, "--max-batch-tokens", 256),
                        .micro_batches = parse(argc, argv, "--micro-batches", 0)};
    k3_config cfg;
    if (k3_config_load(model, &cfg) != K3_OK) {
        fprintf(stderr, "bench_engine: %s\n", k3_last_error());
        return 1;
    }
    run_res b = {0}, one = {0};
    if (run(&o, n_req, P, G, true, cfg.vocab_size, &b) ||
        run(&o, n_req, P, G, false, cfg.vocab_size, &one))
        return 1;
    if (rank == 0) {
        const int S = b.es.pp, E = b.es.ep, M = b.es.micro_batches;
        double tps_b = (b.gen + b.prompt) / b.wall, tps_1 = (one.gen + one.prompt) / one.wall;
        printf("%-26s %10s %12s %12s %12s\n", "run", "wall s", "prompt tok", "gen tok",
               "tok/s (all)");
        printf("%-26s %10.2f %12lld %12lld %12.1f\n", "continuous batching", b.wall,
               (long long)b.prompt, (long long)b.gen, tps_b);
        printf("%-26s %10.2f %12lld %12lld %12.1f\n", "one at a time", one.wall,
               (long long)one.prompt, (long long)one.gen, tps_1);
        printf("speed-up %.2fx; busy fraction per rank (batched):", tps_b / tps_1);
        double stage_busy[64] = {0};
        for (int r = 0; r < b.es.world && r < 256; r++) {
            double f = b.es.busy_s[r] / b.wall;
            printf(" r%d %.0f%%", r, 100 * f);
        }
        printf("\n");
        /* stage busy = its lanes' mean; the bubble is what the slowest stage leaves idle */
        int base = b.es.dedicated ? 1 : 0;
        double bubble = 0;
        for (int s = 0; s < S && s < 64; s++) {
            for (int l = 0; l < E; l++) stage_busy[s] += b.es.busy_s[base + s * E + l] / b.wall / E;
            bubble += (1 - stage_busy[s]) / S;
        }
        double ideal = (double)(S - 1) / (double)(M + S - 1);
        printf("pipeline: %d stages x %d lanes, %d micro-batches: measured bubble %.1f%% (mean "
               "idle of the stages), ideal (S-1)/(M+S-1) = %.1f%%\n",
               S, E, M, 100 * bubble, 100 * ideal);
        cJSON *j = cJSON_CreateObject();
        cJSON_AddNumberToObject(j, "pp", S);
        cJSON_AddNumberToObject(j, "ep", E);
        cJSON_AddNumberToObject(j, "micro_batches", M);
        cJSON_AddNumberToObject(j, "requests", n_req);
        cJSON_AddNumberToObject(j, "prompt_tokens_each", P);
        cJSON_AddNumberToObject(j, "gen_tokens_each", G);
        cJSON_AddNumberToObject(j, "batched_wall_s", b.wall);
        cJSON_AddNumberToObject(j, "batched_tok_s", tps_b);
        cJSON_AddNumberToObject(j, "batched_gen_tok_s", b.gen / b.wall);
        cJSON_AddNumberToObject(j, "one_at_a_time_wall_s", one.wall);
        cJSON_AddNumberToObject(j, "one_at_a_time_tok_s", tps_1);
        cJSON_AddNumberToObject(j, "bubble_measured", bubble);
        cJSON_AddNumberToObject(j, "bubble_ideal", ideal);
        cJSON *busy = cJSON_AddArrayToObject(j, "busy_fraction");
        for (int r = 0; r < b.es.world && r < 256; r++)
            cJSON_AddItemToArray(busy, cJSON_CreateNumber(b.es.busy_s[r] / b.wall));
        char *txt = cJSON_Print(j);
        const char *path = parse_s(argc, argv, "--json", "bench_engine.json");
        FILE *f = fopen(path, "w");
        if (f && txt) fprintf(f, "%s\n", txt), printf("wrote %s\n", path);
        if (f) fclose(f);
        cJSON_free(txt);
        cJSON_Delete(j);
    }
    k3_comm_finalize();
    return 0;
}
