/* cmd_bench.c — `k3 bench`: throughput evaluations with the field names users know from vLLM's
 * bench and llama-bench.
 *   k3 bench [-p 512 -n 128 -r 5]     llama-bench's table: prompt processing (pp512) and text
 *                                      generation (tg128) tok/s, mean ± stddev over repetitions
 *   k3 bench throughput ...            offline through the engine (vLLM's `bench throughput`):
 *                                      sweeps input length x output length x concurrency
 *   k3 bench serve --base-url URL ...  online against an OpenAI-compatible server (bench_serve.c)
 *   k3 bench kernels [--threads N ...] each kernel's GB/s and GFLOP/s against this machine's
 *                                      measured triad bandwidth and fp32 FMA peak (bench_kernels.c)
 *   k3 bench load --model DIR ...      the checkpoint load: per rank and node bytes, seconds,
 *                                      GB/s, peak RSS; serial, parallel, mmap loaders, warm vs
 * cold, against the raw read rate of the shards (bench_load.c) The engine modes and load run on any
 * S x E under mpirun (every rank opens the engine; rank 0 drives it, writes the outputs); serve and
 * kernels are one process with no MPI.
 *
 * Owns: the flag table (one table for all modes: each flag names the modes it applies to, and a
 * flag given to a mode it does not apply to is a usage error), the workloads and their timing.
 * Does not own: the outputs (bench_report.c), the engine (rank/k3_engine.h).
 * Invariants: every request is greedy with ignore_eos, so the tokens counted are exactly
 * num_prompts x output_len; prompts are random ids from a seeded stream (--seed); warm-up requests
 * (--num-warmups) run before the clock starts and are not counted; the load is timed apart. */
#include "k3_launcher.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "bench.h"
#include "engine_args.h"
#include "k3_engine_test.h"
#include "k3_comm.h"
#include "k3_model.h"

/* The modes a flag applies to. */
enum {
    M_PT = 1,
    M_TP = 2,
    M_SV = 4,
    M_KN = 8,
    M_LD = 16,
    M_GR = 32,
    M_ENG = M_PT | M_TP,
    M_ALL = 63
};

/* X(name, kind, metavar, default, modes, help) */
#define BENCH_FLAGS(X)                                                                             \
    X("model", K3_FLAG_STR, "DIR", NULL, M_ENG | M_SV | M_LD | M_GR,                               \
      "checkpoint directory (pp/tg, throughput, load; grammar: the model whose decode step is "    \
      "timed beside the mask); serve: the model name in request bodies "                           \
      "(default: the server's first /v1/models entry)")                                            \
    X("vocab", K3_FLAG_STR, "FILE", NULL, M_GR,                                                    \
      "grammar: a .tiktoken rank file; its first 163,584 ranks + the K3 specials make K3's "       \
      "163,840 ids (required)")                                                                    \
    X("n-prompt", K3_FLAG_STR, "N[,N]", "512", M_PT,                                               \
      "pp/tg: prompt tokens of each pp test (llama-bench's -p; 0 = none)")                         \
    X("n-gen", K3_FLAG_STR, "N[,N]", "128", M_PT,                                                  \
      "pp/tg: generated tokens of each tg test (llama-bench's -n; 0 = none)")                      \
    X("repetitions", K3_FLAG_INT, "R", "5", M_PT | M_KN | M_LD,                                    \
      "pp/tg: timed runs of each test; kernels: timed calls of each op (the median is reported); " \
      "load: warm raw reads and warm loads, interleaved (the median; default 3)")                  \
    X("input-len", K3_FLAG_STR, "N[,N]", "1024", M_TP | M_SV,                                      \
      "prompt tokens of each request (throughput: a comma list sweeps)")                           \
    X("output-len", K3_FLAG_STR, "N[,N]", "128", M_TP | M_SV,                                      \
      "generated tokens of each request, exactly (ignore_eos; throughput: a list sweeps)")         \
    X("num-prompts", K3_FLAG_INT, "N", "64", M_TP | M_SV, "requests of each run")                  \
    X("random-prefix-len", K3_FLAG_INT, "N", "0", M_SV,                                            \
      "serve: one random prefix of N tokens that every prompt starts with, before its own "        \
      "--input-len tokens (vLLM's --random-prefix-len: a prefix-cache workload; the report gives " \
      "the cached tokens and hit rate from the server's usage)")                                   \
    X("max-concurrency", K3_FLAG_STR, "C[,C]", NULL, M_TP | M_SV,                                  \
      "requests in flight at most (default: all; a comma list sweeps, a run each; throughput: "    \
      "requests beyond the engine's slots wait in its queue)")                                     \
    X("request-rate", K3_FLAG_STR, "R", "inf", M_SV,                                               \
      "serve: requests per second, Poisson arrivals (inf = all at once)")                          \
    X("base-url", K3_FLAG_STR, "URL", NULL, M_SV,                                                  \
      "serve: the server, e.g. http://127.0.0.1:8000 (required)")                                  \
    X("endpoint", K3_FLAG_STR, "PATH", "/v1/completions", M_SV,                                    \
      "serve: /v1/completions (prompts as token ids) or /v1/chat/completions (text prompts)")      \
    X("api-key", K3_FLAG_STR, "KEY", NULL, M_SV,                                                   \
      "serve: bearer token (default: $OPENAI_API_KEY when set)")                                   \
    X("tokenizer", K3_FLAG_STR, "DIR", NULL, M_SV,                                                 \
      "serve: the model's checkpoint directory: its vocab_size bounds the random prompt ids "      \
      "(default: ids below 1000); the chat endpoint needs it for prompts of --input-len tokens")   \
    X("request-timeout", K3_FLAG_FLOAT, "SEC", "600", M_SV, "serve: limit of one request")         \
    X("num-warmups", K3_FLAG_INT, "N", "1", M_ALL & ~M_LD,                                         \
      "warm-up requests before each timed run (not counted); kernels: untimed calls of each op")   \
    X("prefill", K3_FLAG_INT, "T", "64", M_KN,                                                     \
      "kernels: tokens of the compute-bound (prefill) matmuls")                                    \
    X("size-mb", K3_FLAG_INT, "MB", "0", M_KN,                                                     \
      "kernels: MB of each weight matrix, triad array and elementwise array (0 = 2 x the L3 "      \
      "cache, so T = 1 matmuls stream from DRAM)")                                                 \
    X("seed", K3_FLAG_INT, "S", "0", M_ALL & ~M_LD,                                                \
      "seed of the random prompts and arrivals (sampling is greedy)")                              \
    X("output-json", K3_FLAG_STR, "FILE", NULL, M_ALL,                                             \
      "results as JSON (vLLM's / llama-bench's field names) with hardware, versions, commit, "     \
      "plan")                                                                                      \
    X("output-csv", K3_FLAG_STR, "FILE", NULL, M_ALL, "results as CSV, one line per run")          \
    X("plot", K3_FLAG_STR, "FILE.svg", NULL, M_TP | M_SV,                                          \
      "throughput, serve: an SVG image of the results: tokens/s against the concurrency, and "     \
      "TTFT / ITL / E2EL at p50, p90 and p99")                                                     \
    X("op-stats", K3_FLAG_STR, "FILE", NULL, M_TP,                                                 \
      "throughput: write JSON: each worker rank's backend op calls, host syncs and host<->device " \
      "bytes (cuda: and matrix FLOPs with their tensor-core share) per forward step (decode, "     \
      "prefill, idle; warm-ups included); needs --backend guard (or cuda)")

#define FLAG_ENTRY(n, k, mv, d, m, h) {n, k, mv, d, h},
#define FLAG_MODES(n, k, mv, d, m, h) m,
static const k3_flag flags[] = {BENCH_FLAGS(FLAG_ENTRY) K3_ENGINE_FLAGS};
static const int own_modes[] = {BENCH_FLAGS(FLAG_MODES)};
/* the engine flags follow the bench's own; they apply to the engine modes and load (the engine
 * opens with them; --threads and --backend to kernels too) */
static int flag_modes(int i) {
    if (i < (int)K3_ARRAY_LEN(own_modes)) return own_modes[i];
    return strcmp(flags[i].name, "threads") == 0 || strcmp(flags[i].name, "backend") == 0
               ? M_ENG | M_LD | M_KN
               : M_ENG | M_LD;
}

static const k3_flag_alias aliases[] = {{'p', "n-prompt"}, {'n', "n-gen"}, {'r', "repetitions"}};

#define MAX_LIST 16

/* What the engine modes run, the same on every rank. */
typedef struct bench_plan {
    int mode; /* M_PT or M_TP */
    int64_t in_len[MAX_LIST], out_len[MAX_LIST], conc[MAX_LIST];
    int n_in, n_out, n_conc;
    int64_t num_prompts, reps, warmups, n_vocab;
    uint64_t seed;
    k3_config_counts counts;
    char model_name[256];
} bench_plan;

/* ---- flags
 * --------------------------------------------------------------------------------------- */
static const char *mode_name(int mode) {
    return mode == M_PT   ? "pp/tg"
           : mode == M_TP ? "throughput"
           : mode == M_KN ? "kernels"
           : mode == M_LD ? "load"
           : mode == M_GR ? "grammar"
                          : "serve";
}

/* --help: the modes each flag applies to, from the same masks check_modes refuses by. */
static void flag_note(int i, char *buf, size_t n) {
    const int m = flag_modes(i);
    size_t off = 0;
    buf[0] = 0;
    if (m == M_ALL) {
        snprintf(buf, n, "all modes");
        return;
    }
    for (int b = M_PT; b <= M_GR && off < n; b <<= 1)
        if (m & b) {
            int w = snprintf(buf + off, n - off, "%s%s", off ? ", " : "", mode_name(b));
            if (w > 0) off += (size_t)w;
        }
}

static k3_status check_modes(const k3_args *a, int mode) {
    for (int i = 0; i < a->cmd->n_flags; i++)
        if (a->values[i] && !(flag_modes(i) & mode))
            return K3_ERR(K3_ERR_ARG, "--%s does not apply to `k3 bench%s%s`", flags[i].name,
                          mode == M_PT ? "" : " ", mode == M_PT ? "" : mode_name(mode));
    return K3_OK;
}

static k3_status nonneg(const k3_args *a, const char *flag, int64_t lo, int64_t hi) {
    int64_t v = k3_args_int(a, flag);
    if (v < lo || v > hi)
        return K3_ERR(K3_ERR_ARG, "--%s: %lld must be in [%lld, %lld]", flag, (long long)v,
                      (long long)lo, (long long)hi);
    return K3_OK;
}

static k3_status plan_of(const k3_args *a, int mode, int64_t max_ctx, bench_plan *p) {
    memset(p, 0, sizeof *p);
    p->mode = mode;
    K3_TRY(check_modes(a, mode));
    const char *model = k3_args_str(a, "model");
    if (!model) return K3_ERR(K3_ERR_ARG, "--model DIR is required");
    K3_TRY(nonneg(a, "num-warmups", 0, 1000));
    K3_TRY(nonneg(a, "seed", 0, INT64_MAX));
    p->warmups = k3_args_int(a, "num-warmups");
    p->seed = (uint64_t)k3_args_int(a, "seed");
    int64_t need = 0;
    if (mode == M_PT) {
        K3_TRY(nonneg(a, "repetitions", 1, 100000));
        p->reps = k3_args_int(a, "repetitions");
        K3_TRY(bench_parse_list("n-prompt", k3_args_str(a, "n-prompt"), 0, 1 << 24, p->in_len,
                                MAX_LIST, &p->n_in));
        K3_TRY(bench_parse_list("n-gen", k3_args_str(a, "n-gen"), 0, 1 << 24, p->out_len, MAX_LIST,
                                &p->n_out));
        for (int i = 0; i < p->n_in; i++) need = K3_MAX(need, p->in_len[i]);
        for (int i = 0; i < p->n_out; i++) need = K3_MAX(need, 1 + p->out_len[i]);
    } else {
        K3_TRY(nonneg(a, "num-prompts", 1, 1 << 24));
        p->num_prompts = k3_args_int(a, "num-prompts");
        K3_TRY(bench_parse_list("input-len", k3_args_str(a, "input-len"), 1, 1 << 24, p->in_len,
                                MAX_LIST, &p->n_in));
        K3_TRY(bench_parse_list("output-len", k3_args_str(a, "output-len"), 1, 1 << 24, p->out_len,
                                MAX_LIST, &p->n_out));
        if (k3_args_has(a, "max-concurrency"))
            K3_TRY(bench_parse_list("max-concurrency", k3_args_str(a, "max-concurrency"), 1,
                                    1 << 24, p->conc, MAX_LIST, &p->n_conc));
        else
            p->conc[p->n_conc++] = p->num_prompts;
        for (int i = 0; i < p->n_in; i++)
            for (int j = 0; j < p->n_out; j++) need = K3_MAX(need, p->in_len[i] + p->out_len[j]);
    }
    if (need > max_ctx)
        return K3_ERR(K3_ERR_ARG,
                      "a request of %lld tokens (prompt + generated) does not fit --max-ctx %lld",
                      (long long)need, (long long)max_ctx);
    k3_config cfg;
    K3_TRY(k3_config_load(model, &cfg));
    K3_TRY(k3_config_count(&cfg, &p->counts));
    p->n_vocab = cfg.vocab_size;
    bench_model_name(model, p->model_name, sizeof p->model_name);
    return K3_OK;
}

/* ---- driving the engine (rank 0)
 * ------------------------------------------------------------------ */
/* One timed (or warm-up) run: n requests of in_len random ids each, max_tokens out_len, at most
 * conc in the engine at once. Everything is counted from the engine's DONE events. */
typedef struct run_res {
    int64_t prompt_tokens, gen_tokens;
    double elapsed_s; /* first submit -> last DONE */
    /* latencies (seconds; each request from its submit, as a client of the engine sees them):
       ttft[n], e2e[n] and every gap between two tokens of a request, itl[n_itl] */
    double *ttft, *e2e, *itl, *t_sub, *t_last;
    int64_t n_itl;
} run_res;

static void run_res_free(run_res *r) {
    k3_free(r->ttft), k3_free(r->e2e), k3_free(r->itl), k3_free(r->t_sub), k3_free(r->t_last);
    r->ttft = r->e2e = r->itl = r->t_sub = r->t_last = NULL;
}

static k3_status drive(k3_engine *e, k3_rng *rng, int64_t n_vocab, int64_t n, int64_t in_len,
                       int64_t out_len, int64_t conc, uint64_t seed, run_res *out) {
    memset(out, 0, sizeof *out);
    int32_t *ids = NULL;
    const size_t nb = (size_t)n * sizeof(double);
    K3_TRY(k3_calloc((void **)&out->ttft, nb, "bench latencies"));
    K3_TRY(k3_calloc((void **)&out->e2e, nb, "bench latencies"));
    K3_TRY(k3_calloc((void **)&out->t_sub, nb, "bench latencies"));
    K3_TRY(k3_calloc((void **)&out->t_last, nb, "bench latencies"));
    K3_TRY(k3_calloc((void **)&out->itl, (size_t)(n * K3_MAX(out_len, 1)) * sizeof(double),
                     "bench latencies"));
    K3_TRY(k3_alloc((void **)&ids, (size_t)(n * in_len) * sizeof(int32_t), "bench prompts"));
    for (int64_t i = 0; i < n; i++) bench_random_ids(rng, n_vocab, ids + i * in_len, in_len);
    k3_status st = K3_OK;
    int64_t submitted = 0, done = 0;
    double t0 = k3_now_s();
    while (st == K3_OK && done < n) {
        while (st == K3_OK && submitted < n && submitted - done < conc) {
            k3_request rq = {.ids = ids + submitted * in_len,
                             .n_ids = in_len,
                             .max_tokens = (int)out_len,
                             .sampling = {.temperature = 0, .seed = seed},
                             .ignore_eos = true,
                             .user = (uint64_t)submitted};
            int64_t id;
            out->t_sub[submitted] = k3_now_s();
            st = k3_engine_submit(e, &rq, &id);
            submitted++;
        }
        const k3_event *ev;
        int n_ev = 0;
        if (st == K3_OK) st = k3_engine_step(e, &ev, &n_ev);
        const double now = k3_now_s();
        for (int k = 0; st == K3_OK && k < n_ev; k++) {
            const int64_t u = (int64_t)ev[k].user;
            if (ev[k].kind == K3_EV_TOKEN) {
                if (out->t_last[u] > 0)
                    out->itl[out->n_itl++] = now - out->t_last[u];
                else
                    out->ttft[u] = now - out->t_sub[u];
                out->t_last[u] = now;
            }
            if (ev[k].kind == K3_EV_DONE) out->e2e[u] = now - out->t_sub[u];
            if (ev[k].kind == K3_EV_ERROR)
                st = K3_ERR(K3_ERR_STATE, "bench request %llu failed: %s",
                            (unsigned long long)ev[k].user, ev[k].error ? ev[k].error : "?");
            else if (ev[k].kind == K3_EV_DONE)
                done++, out->prompt_tokens += ev[k].n_prompt, out->gen_tokens += ev[k].n_gen;
        }
        if (st == K3_OK && n_ev == 0 && k3_engine_pending(e) == 0 && done < n)
            st = K3_ERR(K3_ERR_INTERNAL, "bench: the engine is idle with %lld requests open",
                        (long long)(submitted - done));
    }
    out->elapsed_s = k3_now_s() - t0;
    k3_free(ids);
    return st;
}

/* ---- metadata of an engine run
 * ------------------------------------------------------------------- */
static k3_status meta_engine(bench_row *m, const bench_plan *p, const k3_engine_stats *es,
                             const char *backend) {
    K3_TRY(bench_meta_host(m));
    K3_TRY(bench_put_str(m, "model", "model", p->model_name));
    K3_TRY(bench_put_str(m, "backend", "backend", backend));
    K3_TRY(bench_put_num(m, "pp", "stages (S)", -1, es->pp));
    K3_TRY(bench_put_num(m, "ep", "lanes (E)", -1, es->ep));
    K3_TRY(bench_put_num(m, "world", "ranks", -1, es->world));
    K3_TRY(bench_put_str(m, "coordinator", "coordinator", es->dedicated ? "dedicated" : "shared"));
    K3_TRY(bench_put_num(m, "micro_batches", "micro-batches", -1, es->micro_batches));
    K3_TRY(bench_put_num(m, "max_seqs", "slots per lane", -1, es->max_seqs));
    K3_TRY(bench_put_num(m, "max_ctx", "context per slot", -1, (double)es->max_ctx));
    K3_TRY(
        bench_put_num(m, "max_batch_tokens", "tokens per step", -1, (double)es->max_batch_tokens));
    K3_TRY(bench_put_num(m, "load_time_s", "load time (s, not in the results)", 2, es->load_s));
    K3_TRY(bench_put_num(m, "seed", "seed", -1, (double)p->seed));
    return bench_put_num(m, "num_warmups", "warm-up requests", -1, (double)p->warmups);
}

/* ---- throughput
 * ---------------------------------------------------------------------------------- */
/* One sweep point's row: vLLM's throughput keys, and the latencies as the engine's client sees
 * them (JSON only: median / p90 / p99 of TTFT, ITL and E2EL in ms, as `bench serve` names them). */
static k3_status throughput_row(bench_report *rep, run_res *res, int64_t n, int64_t in, int64_t out,
                                int64_t conc, int world) {
    const run_res r = *res;
    const double t = r.elapsed_s, tot = (double)(r.prompt_tokens + r.gen_tokens);
    K3_LOGI("bench throughput: in %lld out %lld concurrency %lld: %.2f s, %.1f tok/s",
            (long long)in, (long long)out, (long long)conc, t, tot / t);
    bench_row *row;
    K3_TRY(bench_add_row(rep, &row));
    K3_TRY(bench_put_num(row, "input_len", "input len", -1, (double)in));
    K3_TRY(bench_put_num(row, "output_len", "output len", -1, (double)out));
    K3_TRY(bench_put_num(row, "max_concurrency", "concurrency", -1, (double)conc));
    K3_TRY(bench_put_num(row, "num_requests", "requests", -1, (double)n));
    K3_TRY(bench_put_num(row, "elapsed_time", "elapsed (s)", 3, t));
    K3_TRY(bench_put_num(row, "total_input_tokens", NULL, -1, (double)r.prompt_tokens));
    K3_TRY(bench_put_num(row, "total_output_tokens", NULL, -1, (double)r.gen_tokens));
    K3_TRY(bench_put_num(row, "total_num_tokens", "tokens", -1, tot));
    K3_TRY(bench_put_num(row, "requests_per_second", "req/s", 2, (double)n / t));
    K3_TRY(bench_put_num(row, "tokens_per_second", "tok/s", 1, tot / t));
    K3_TRY(bench_put_num(row, "input_tokens_per_second", "input tok/s", 1,
                         (double)r.prompt_tokens / t));
    K3_TRY(bench_put_num(row, "output_tokens_per_second", "output tok/s", 1,
                         (double)r.gen_tokens / t));
    K3_TRY(bench_put_num(row, "tokens_per_second_per_rank", "tok/s/rank", 1, tot / t / world));
    K3_TRY(bench_put_num(row, "output_tokens_per_second_per_rank", "output tok/s/rank", 1,
                         (double)r.gen_tokens / t / world));
    static const char *const keys[3][3] = {{"median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"},
                                           {"median_itl_ms", "p90_itl_ms", "p99_itl_ms"},
                                           {"median_e2el_ms", "p90_e2el_ms", "p99_e2el_ms"}};
    double *v[3] = {res->ttft, res->itl, res->e2e};
    const int64_t nv[3] = {n, res->n_itl, n};
    for (int m = 0; m < 3; m++) {
        bench_stats bs;
        bench_stats_of(v[m], nv[m], &bs);
        K3_TRY(bench_put_num(row, keys[m][0], NULL, 2, 1e3 * bs.median));
        K3_TRY(bench_put_num(row, keys[m][1], NULL, 2, 1e3 * bs.p90));
        K3_TRY(bench_put_num(row, keys[m][2], NULL, 2, 1e3 * bs.p99));
    }
    return K3_OK;
}

static k3_status run_throughput(k3_engine *e, const bench_plan *p, int world, bench_report *rep) {
    k3_rng rng;
    k3_rng_seed(&rng, p->seed);
    for (int i = 0; i < p->n_in; i++)
        for (int j = 0; j < p->n_out; j++)
            for (int c = 0; c < p->n_conc; c++) {
                int64_t in = p->in_len[i], out = p->out_len[j], conc = p->conc[c];
                run_res w, r;
                if (p->warmups > 0) {
                    k3_status ws =
                        drive(e, &rng, p->n_vocab, p->warmups, in, out, conc, p->seed, &w);
                    run_res_free(&w);
                    K3_TRY(ws);
                }
                k3_status st =
                    drive(e, &rng, p->n_vocab, p->num_prompts, in, out, conc, p->seed, &r);
                if (st == K3_OK) st = throughput_row(rep, &r, p->num_prompts, in, out, conc, world);
                run_res_free(&r);
                K3_TRY(st);
            }
    return K3_OK;
}

/* ---- pp / tg (llama-bench)
 * ------------------------------------------------------------------------ */
/* One llama-bench row: its table cells and JSON fields (n_prompt, n_gen, avg_ns, stddev_ns, avg_ts,
 * stddev_ts, samples_ns, samples_ts, model_size, model_n_params as llama-bench names them). */
static k3_status pt_row(bench_row *row, const bench_plan *p, int64_t n_prompt, int64_t n_gen,
                        const char *backend, const k3_engine_stats *es, double *ns, double *ts) {
    char test[40], size[32], params[32], grid[32], tps[64];
    const int64_t counted = n_prompt ? n_prompt : n_gen;
    snprintf(test, sizeof test, "%s%lld", n_prompt ? "pp" : "tg", (long long)counted);
    const double gib = (double)p->counts.bytes_total / (1 << 30),
                 pr = (double)p->counts.params_total;
    snprintf(size, sizeof size, gib >= 1 ? "%.2f GiB" : "%.2f MiB", gib >= 1 ? gib : gib * 1024);
    snprintf(params, sizeof params, pr >= 1e9 ? "%.2f B" : "%.2f M",
             pr >= 1e9 ? pr / 1e9 : pr / 1e6);
    snprintf(grid, sizeof grid, "%d x %d", es->pp, es->ep);
    K3_TRY(bench_put_arr(row, "samples_ns", ns, p->reps)); /* in run order, before the sort */
    K3_TRY(bench_put_arr(row, "samples_ts", ts, p->reps));
    bench_stats sn, stt;
    bench_stats_of(ns, p->reps, &sn);
    bench_stats_of(ts, p->reps, &stt);
    snprintf(tps, sizeof tps, "%.2f ± %.2f", stt.mean, stt.stddev);
    K3_TRY(bench_put_str(row, "model_filename", "model", p->model_name));
    K3_TRY(bench_put_str(row, NULL, "size", size));
    K3_TRY(bench_put_str(row, NULL, "params", params));
    K3_TRY(bench_put_str(row, "backends", "backend", backend));
    K3_TRY(bench_put_str(row, NULL, "S x E", grid));
    K3_TRY(bench_put_str(row, "test", "test", test));
    K3_TRY(bench_put_str(row, NULL, "t/s", tps));
    K3_TRY(bench_put_num(row, "model_size", NULL, -1, (double)p->counts.bytes_total));
    K3_TRY(bench_put_num(row, "model_n_params", NULL, -1, pr));
    K3_TRY(bench_put_num(row, "n_prompt", NULL, -1, (double)n_prompt));
    K3_TRY(bench_put_num(row, "n_gen", NULL, -1, (double)n_gen));
    K3_TRY(bench_put_num(row, "avg_ns", NULL, -1, sn.mean));
    K3_TRY(bench_put_num(row, "stddev_ns", NULL, -1, sn.stddev));
    K3_TRY(bench_put_num(row, "avg_ts", NULL, 2, stt.mean));
    return bench_put_num(row, "stddev_ts", NULL, 2, stt.stddev);
}

static k3_status pt_test(k3_engine *e, const bench_plan *p, k3_rng *rng, int64_t n_prompt,
                         int64_t n_gen, const char *backend, const k3_engine_stats *es,
                         bench_report *rep) {
    /* pp: a prompt of n_prompt ids, prefill only; tg: one id, then n_gen tokens one at a time */
    const int64_t in = n_prompt ? n_prompt : 1, out = n_prompt ? 0 : n_gen,
                  counted = n_prompt ? n_prompt : n_gen;
    run_res r;
    for (int64_t w = 0; w < p->warmups; w++)
        K3_TRY(drive(e, rng, p->n_vocab, 1, in, out, 1, p->seed, &r));
    double *ns = NULL, *ts = NULL;
    K3_TRY(k3_alloc((void **)&ns, (size_t)p->reps * sizeof(double), "bench samples"));
    k3_status st = k3_alloc((void **)&ts, (size_t)p->reps * sizeof(double), "bench samples");
    for (int64_t k = 0; st == K3_OK && k < p->reps; k++) {
        st = drive(e, rng, p->n_vocab, 1, in, out, 1, p->seed, &r);
        ns[k] = r.elapsed_s * 1e9;
        ts[k] = (double)counted / r.elapsed_s;
    }
    bench_row *row = NULL;
    if (st == K3_OK) st = bench_add_row(rep, &row);
    if (st == K3_OK) st = pt_row(row, p, n_prompt, n_gen, backend, es, ns, ts);
    k3_free(ns), k3_free(ts);
    return st;
}

static k3_status run_pt(k3_engine *e, const bench_plan *p, const char *backend,
                        const k3_engine_stats *es, bench_report *rep) {
    k3_rng rng;
    k3_rng_seed(&rng, p->seed);
    for (int i = 0; i < p->n_in; i++)
        if (p->in_len[i] > 0) K3_TRY(pt_test(e, p, &rng, p->in_len[i], 0, backend, es, rep));
    for (int i = 0; i < p->n_out; i++)
        if (p->out_len[i] > 0) K3_TRY(pt_test(e, p, &rng, 0, p->out_len[i], backend, es, rep));
    return K3_OK;
}

/* ---- the command
 * ------------------------------------------------------------------------------------ */
static int run_engine_mode(const k3_args *a, int mode) {
    if (k3_comm_init() != K3_OK) {
        fprintf(stderr, "k3 bench: %s\n", k3_last_error());
        return 1;
    }
    int rank = 0, world = 1;
    k3_comm_world(&rank, &world);
    k3_log_set_rank(rank, -1, -1);
    k3_engine_opts eo = {.name = "k3 bench"};
    bench_plan p;
    int rc = k3_engine_args(a, rank == 0, &eo);
    if (rc == 0) k3_engine_backend_say(a, rank == 0);
    if (rc == 0) {
        /* every rank decides the same; rank 0 says why */
        k3_status st = plan_of(a, mode, eo.max_ctx, &p);
        if (st != K3_OK && rank == 0) fprintf(stderr, "k3 bench: %s\n", k3_last_error());
        rc = st == K3_OK ? 0 : st == K3_ERR_ARG ? 2 : 1;
    }
    if (rc) {
        k3_comm_finalize();
        return rc;
    }
    eo.model_dir = k3_args_str(a, "model");
    eo.op_stats = k3_args_str(a, "op-stats"); /* NULL but in throughput (check_modes) */
    eo.progress = true;
    k3_engine *e = NULL;
    k3_status ost = k3_engine_open_test(&eo, k3_engine_test_from_env(), &e);
    if (ost != K3_OK && e) k3_engine_abort(e); /* a fatal fault: the job ends, the rank named */
    rc = ost == K3_OK ? 0 : ost == K3_ERR_ARG ? 2 : 1;
    if (rc == 0 && !k3_engine_is_coordinator(e)) {
        if (k3_engine_serve(e) != K3_OK) k3_engine_abort(e); /* serves, then closes */
    } else if (rc == 0) {
        k3_engine_stats es;
        k3_engine_get_stats(e, &es);
        bench_report rep = {.mode = mode == M_PT ? "pp-tg" : "throughput"};
        k3_status st = meta_engine(&rep.meta, &p, &es, eo.backend ? eo.backend : "cpu");
        if (st == K3_OK && mode == M_TP) st = run_throughput(e, &p, es.world, &rep);
        if (st == K3_OK && mode == M_PT)
            st = run_pt(e, &p, eo.backend ? eo.backend : "cpu", &es, &rep);
        if (k3_engine_failed(e)) k3_engine_abort(e);
        k3_engine_stats fin;
        if (k3_engine_close(e, &fin) != K3_OK) k3_engine_abort(e);
        if (st == K3_OK && fin.op_stats_rc) /* --op-stats FILE not written (printed) */
            st = K3_ERR(K3_ERR_IO, "--op-stats %s was not written", eo.op_stats);
        if (st == K3_OK)
            st = bench_report_write(&rep, k3_args_str(a, "output-json"),
                                    k3_args_str(a, "output-csv"));
        if (st == K3_OK && mode == M_TP && k3_args_has(a, "plot"))
            st = bench_plot_svg(&rep, k3_args_str(a, "plot"));
        if (st != K3_OK) fprintf(stderr, "k3 bench: %s\n", k3_last_error());
        bench_report_free(&rep);
        rc = st == K3_OK ? 0 : 1;
    }
    k3_comm_finalize();
    return rc;
}

/* ---- kernels
 * -------------------------------------------------------------------------------------- */
static int run_kernels(const k3_args *a) {
    k3_status st = check_modes(a, M_KN);
    if (st == K3_OK) st = nonneg(a, "repetitions", 1, 1000);
    if (st == K3_OK) st = nonneg(a, "num-warmups", 0, 1000);
    if (st == K3_OK) st = nonneg(a, "prefill", 1, 65536);
    if (st == K3_OK) st = nonneg(a, "size-mb", 0, 1 << 20);
    if (st == K3_OK) st = nonneg(a, "threads", 0, 256);
    if (st == K3_OK) st = nonneg(a, "seed", 0, INT64_MAX);
    const char *backend = k3_args_str(a, "backend");
    if (st == K3_OK && !k3_engine_backend_ok(backend))
        st = K3_ERR(K3_ERR_ARG, "--backend: '%s' is not auto, cpu, ref, guard or cuda", backend);
    if (st != K3_OK) {
        fprintf(stderr, "k3 bench: %s\n", k3_last_error());
        return 2;
    }
    int64_t threads = k3_args_int(a, "threads");
    bench_kernels_opts o = {.backend = k3_engine_backend_pick(backend, true),
                            .threads = threads ? (int)threads : (int)sysconf(_SC_NPROCESSORS_ONLN),
                            .reps = (int)k3_args_int(a, "repetitions"),
                            .warmups = (int)k3_args_int(a, "num-warmups"),
                            .prefill = k3_args_int(a, "prefill"),
                            .bytes = k3_args_int(a, "size-mb") << 20,
                            .seed = (uint64_t)k3_args_int(a, "seed")};
    bench_report rep = {.mode = "kernels"};
    st = bench_kernels_run(&o, &rep);
    if (st == K3_OK)
        st = bench_report_write(&rep, k3_args_str(a, "output-json"), k3_args_str(a, "output-csv"));
    if (st != K3_OK) fprintf(stderr, "k3 bench: %s\n", k3_last_error());
    bench_report_free(&rep);
    return st == K3_OK ? 0 : st == K3_ERR_ARG ? 2 : 1;
}

static int run_bench(const k3_args *a) {
    const char *m = a->n_pos ? a->pos[0] : NULL;
    if (!m) return run_engine_mode(a, M_PT);
    if (strcmp(m, "throughput") == 0) return run_engine_mode(a, M_TP);
    if (strcmp(m, "serve") == 0) {
        if (check_modes(a, M_SV) != K3_OK) {
            fprintf(stderr, "k3 bench: %s\n", k3_last_error());
            return 2;
        }
        return bench_serve(a);
    }
    if (strcmp(m, "kernels") == 0) return run_kernels(a);
    if (strcmp(m, "grammar") == 0) { /* bench_grammar.c */
        if (check_modes(a, M_GR) != K3_OK) {
            fprintf(stderr, "k3 bench: %s\n", k3_last_error());
            return 2;
        }
        return bench_grammar(a);
    }
    if (strcmp(m, "load") == 0) { /* under mpirun: rank 0 prints the usage error (bench_load) */
        char why[512] = "";
        if (check_modes(a, M_LD) != K3_OK) snprintf(why, sizeof why, "%s", k3_last_error());
        return bench_load(a, why[0] ? why : NULL);
    }
    fprintf(stderr,
            "k3 bench: '%s' is not a mode (throughput, serve, kernels, load, grammar, or none for "
            "pp/tg)\n",
            m);
    return 2;
}

const k3_command k3_cmd_bench = {
    .name = "bench",
    .positional = "[throughput|serve|kernels|load|grammar]",
    .min_pos = 0,
    .max_pos = 1,
    .summary =
        "throughput evaluation: pp/tg table (llama-bench), `throughput` offline through "
        "the engine, `serve` online against a server (vLLM's field names), `kernels` each "
        "kernel vs this machine's measured triad bandwidth and FMA peak, `load` the "
        "checkpoint load (serial, parallel and mmap loaders, warm vs cold) vs the raw read rate, "
        "`grammar` the structured-output mask per step and compile time at K3's vocabulary "
        "beside a model's decode step; [...] after a flag: the modes it applies to",
    .flags = flags,
    .n_flags = (int)K3_ARRAY_LEN(flags),
    .run = run_bench,
    .aliases = aliases,
    .n_aliases = (int)K3_ARRAY_LEN(aliases),
    .flag_note = flag_note,
};
