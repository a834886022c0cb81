/* cmd_run.c — `k3 run`: the flags, the prompt (ids, text or an OpenAI chat request), the sampling
 * parameters, then ONE generation loop: k3_run_generate (client/), on a world of one (MPI
 * singleton, initialised here lazily) for a plain run or on every rank under mpirun.
 *
 * Owns: the run's own flags (prompt, sampling, output) and their validation, --prompt
 * tokenisation, printing the --chat message. The engine's flags (grid, backend, transport,
 * capacity with the engine's defaults) are K3_ENGINE_FLAGS, read by k3_engine_args exactly as in
 * batch/serve/bench (engine_args.h).
 * Does not own: the --chat request (render -> encode, its sampling keys merged with the flags: a
 * flag given explicitly wins, otherwise the request's key, otherwise the flag default; the
 * generated ids -> the assistant message): chat_job.h, shared with `k3 batch`. Nor any math
 * (layers/, experts/), the generation loop, the sampler, the report of a plain run
 * (client/k3_run.h), tokenisation (coordinator/).
 * Stop strings: --stop STR is one stop string; a value starting with '[' must be a JSON array of
 * strings (--stop '["\n\n", "###"]') and gives several. The penalty history holds generated ids
 * only (the prompt is not penalised).
 * Exit codes: a bad flag is a usage error (2); a bad request file or request content (including a
 * sampling field of the request out of range) is a failure (1). */
#include "k3_launcher.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench.h"
#include "chat_job.h"
#include "engine_args.h"
#include "k3_comm.h"
#include "k3_kernels.h"
#include "k3_model.h"
#include "k3_run.h"
#include "k3_sampler.h"
#include "k3_tokenizer.h"

static const k3_flag flags[] = {
    {"model", K3_FLAG_STR, "DIR", NULL, "checkpoint directory (config.json + safetensors)"},
    {"prompt-ids", K3_FLAG_STR, "IDS", NULL,
     "prompt as comma-separated token ids: 1,2,3 (several: 1,2;3,4)"},
    {"prompt", K3_FLAG_STR, "TEXT", NULL, "prompt text (tokenised with the model's tokenizer)"},
    {"chat", K3_FLAG_STR, "FILE", NULL,
     "OpenAI-style chat request (JSON): render, generate, print the parsed assistant message; "
     "its max_tokens/temperature/top_p/seed/stop/... apply unless the flag is given; "
     "add_generation_prompt (default true) and continue_final_message (default false: continue "
     "the last assistant message in the form of spec/K3-CHAT.md §1.8, inferred from llama.cpp, "
     "not the official encoder) are honoured"},
    {"n", K3_FLAG_INT, "N", "16", "most new tokens per prompt (fewer when EOS or --stop hits)"},
    {"temperature", K3_FLAG_FLOAT, "T", "0", "sampling temperature (0 = greedy argmax)"},
    {"greedy", K3_FLAG_BOOL, NULL, NULL, "greedy decoding: an alias of --temperature 0"},
    {"top-k", K3_FLAG_INT, "K", "0", "keep the K most likely ids (0 = off)"},
    {"top-p", K3_FLAG_FLOAT, "P", "1", "nucleus: smallest set with probability >= P (1 = off)"},
    {"min-p", K3_FLAG_FLOAT, "P", "0", "drop ids with p < P x max p (0 = off)"},
    {"repetition-penalty", K3_FLAG_FLOAT, "R", "1",
     "divide positive / multiply negative logits of generated ids by R (1 = off, R >= 1e-4)"},
    {"presence-penalty", K3_FLAG_FLOAT, "X", "0", "subtract X from logits of generated ids"},
    {"frequency-penalty", K3_FLAG_FLOAT, "X", "0",
     "subtract X x count from logits of generated ids"},
    {"logit-bias", K3_FLAG_STR, "ID:B,...", NULL, "add B to the logit of ID (several: 5:-100,7:2)"},
    {"seed", K3_FLAG_STR, "S", "0",
     "sampling seed, an integer in [0, 2^64); prompt i samples with a seed derived from S and i "
     "(same for every split)"},
    {"stop", K3_FLAG_STR, "STR", NULL,
     "stop string (neither it nor what follows is printed, in every mode); a value starting with "
     "'[' must be a JSON array of strings and gives several: '[\"a\",\"b\"]'"},
    {"ignore-eos", K3_FLAG_BOOL, NULL, NULL,
     "do not stop at EOS / <|end_of_msg|> (stop strings still apply); with --chat they do not "
     "end the message either"},
    {"dump-logits", K3_FLAG_STR, "FILE", NULL,
     "write float32 logits [positions, V] as .npy (every consumed token, prompts concatenated)"},
    {"json", K3_FLAG_BOOL, NULL, NULL, "print one JSON object instead of ids + text lines"},
    {"op-stats", K3_FLAG_STR, "FILE", NULL,
     "write JSON: each worker rank's backend op calls, host syncs and host<->device bytes (cuda: "
     "and matrix FLOPs with their tensor-core share) per forward step, for decode, prefill and "
     "idle steps; needs --backend guard (or cuda)"},
    {"bench-limits", K3_FLAG_BOOL, NULL, NULL,
     "before loading, measure this machine's triad bandwidth and fp32 FMA peak (a few seconds, "
     "rank 0, --threads threads or all cores) and give decode GB/s and prefill GFLOP/s as % of "
     "them (without it: GB/s and GFLOP/s alone)"},
    K3_ENGINE_FLAGS,
};

/* Everything a run needs besides the flags; freed by run_free. */
typedef struct run_in {
    k3_tokenizer *tok;
    int32_t *ids; /* all prompts concatenated */
    int64_t *lens;
    int n_prompts;
    k3_job job; /* --chat: the request; always: the sampling parameters (job.sp, job.max_tokens) */
    k3_grammar_cache *grammars; /* --chat: structured outputs */
} run_in;

static void run_free(run_in *in) {
    k3_tok_destroy(in->tok);
    k3_free(in->ids), k3_free(in->lens);
    k3_job_free(&in->job);
    k3_grammar_cache_destroy(in->grammars); /* after the job: it holds a grammar */
}

/* ---- prompts ----------------------------------------------------------------------------- */
static k3_status ids_to_prompt(run_in *in, const int32_t *ids, size_t n, const char *what) {
    if (n == 0) return K3_ERR(K3_ERR_ARG, "%s: encodes to no tokens", what);
    K3_TRY(k3_alloc((void **)&in->ids, n * sizeof(int32_t), "prompt"));
    K3_TRY(k3_alloc((void **)&in->lens, sizeof(int64_t), "prompt"));
    memcpy(in->ids, ids, n * sizeof(int32_t));
    in->lens[0] = (int64_t)n;
    in->n_prompts = 1;
    return K3_OK;
}

static k3_status load_chat(run_in *in, const char *path) {
    char *text = NULL, what[4200];
    size_t n = 0;
    K3_TRY(k3_read_file(path, &text, &n));
    snprintf(what, sizeof what, "--chat %s", path);
    k3_status st = k3_job_parse(&in->job, text, n, what, in->tok);
    k3_free(text);
    if (st == K3_OK) st = ids_to_prompt(in, in->job.ids, (size_t)in->job.n_ids, "--chat");
    return st;
}

/* ---- sampling parameters ----------------------------------------------------------------- */
static k3_status parse_bias(k3_job *j, const char *s) {
    size_t n = 1;
    for (const char *p = s; *p; p++) n += *p == ',';
    K3_TRY(k3_alloc((void **)&j->bias, n * sizeof *j->bias, "logit bias"));
    const char *p = s;
    for (size_t i = 0; i < n; i++) {
        char *end;
        errno = 0;
        long id = strtol(p, &end, 10);
        if (end == p || errno || id < 0 || id > INT32_MAX || *end != ':')
            return K3_ERR(K3_ERR_ARG, "--logit-bias: '%s' is not a list like 5:-100,7:2.5", s);
        p = end + 1;
        double b = strtod(p, &end);
        if (end == p || (*end && *end != ','))
            return K3_ERR(K3_ERR_ARG, "--logit-bias: '%s' is not a list like 5:-100,7:2.5", s);
        if (!k3_job_bias_ok(b, false))
            return K3_ERR(K3_ERR_ARG,
                          "--logit-bias: the bias of id %ld (%.*s) does not fit a float", id,
                          (int)(end - p), p);
        j->bias[i] = (k3_logit_bias){(int32_t)id, (float)b};
        p = *end ? end + 1 : end;
    }
    j->n_bias = n;
    return K3_OK;
}

static k3_status parse_stop(k3_job *j, const char *stop) {
    if (!*stop) return K3_ERR(K3_ERR_ARG, "--stop: the stop string is empty");
    if (stop[0] != '[') {
        K3_TRY(k3_alloc((void **)&j->stops, sizeof(char *), "stop strings"));
        j->stops[0] = stop;
        j->n_stops = 1;
        return K3_OK;
    }
    if (k3_chat_json_parse(stop, strlen(stop), "--stop", &j->stop_doc) != K3_OK) {
        char why[400];
        snprintf(why, sizeof why, "%s", k3_last_error());
        return K3_ERR(K3_ERR_ARG,
                      "--stop: a value starting with '[' must be a JSON array of strings (%s)",
                      why);
    }
    return k3_job_stops_json(j, j->stop_doc, "--stop", K3_ERR_ARG);
}

/* The flags of the numeric settings, in k3_job_num order. */
static const char *const num_flag[K3_JOB_N_NUM] = {
    [K3_JOB_TEMPERATURE] = "temperature",
    [K3_JOB_TOP_K] = "top-k",
    [K3_JOB_TOP_P] = "top-p",
    [K3_JOB_MIN_P] = "min-p",
    [K3_JOB_REPETITION_PENALTY] = "repetition-penalty",
    [K3_JOB_PRESENCE_PENALTY] = "presence-penalty",
    [K3_JOB_FREQUENCY_PENALTY] = "frequency-penalty",
    [K3_JOB_MAX_TOKENS] = "n",
};

/* The flags (explicit ones win over the request's keys) + the request -> in->job.sp. */
static k3_status sampling(run_in *in, const k3_args *a) {
    k3_job_settings s = {0};
    for (int i = 0; i < K3_JOB_N_NUM; i++) {
        s.flag[i] = num_flag[i];
        s.fixed[i] = k3_args_has(a, num_flag[i]);
        s.num[i] = k3_args_float(a, num_flag[i]);
    }
    if (k3_args_bool(a, "greedy")) {
        if (s.fixed[K3_JOB_TEMPERATURE] && s.num[K3_JOB_TEMPERATURE] != 0)
            return K3_ERR(K3_ERR_ARG, "--greedy contradicts --temperature %g",
                          s.num[K3_JOB_TEMPERATURE]);
        s.num[K3_JOB_TEMPERATURE] = 0;
        s.fixed[K3_JOB_TEMPERATURE] = true;
    }
    if (!k3_job_parse_u64(k3_args_str(a, "seed"), &s.seed))
        return K3_ERR(K3_ERR_ARG, "--seed: '%s' must be an integer in [0, 2^64)",
                      k3_args_str(a, "seed"));
    s.seed_fixed = k3_args_has(a, "seed");
    s.stop_fixed = k3_args_has(a, "stop");
    s.bias_fixed = k3_args_has(a, "logit-bias");
    if (s.stop_fixed) {
        K3_TRY(parse_stop(&in->job, k3_args_str(a, "stop")));
        if (!in->tok) return K3_ERR(K3_ERR_ARG, "--stop: the model directory has no tokenizer");
    }
    if (s.bias_fixed) K3_TRY(parse_bias(&in->job, k3_args_str(a, "logit-bias")));
    /* logit_bias ids are checked against vocab_size here, where the error can name the request
     * key or the flag; a config that does not load is reported by k3_run_generate */
    k3_config cfg;
    if (k3_config_load(k3_args_str(a, "model"), &cfg) == K3_OK)
        s.n_vocab = cfg.vocab_size;
    else
        k3_clear_error();
    if (in->job.req && in->tok && s.n_vocab > 0)
        K3_TRY(k3_job_grammar_cache(in->tok, s.n_vocab, &in->grammars));
    s.grammars = in->grammars;
    K3_TRY(k3_job_sampling(&in->job, &s, "--chat"));
    /* A request's logit_bias -Infinity (a ban) passes k3_job_sampling for the sampler to judge;
     * ask it now, with the bias alone, so that a refusal is a request error (exit 1) naming the
     * key rather than a usage error from the run. (The flag's biases are finite.) */
    if (!in->job.req || s.bias_fixed || in->job.n_bias == 0 || s.n_vocab <= 0) return K3_OK;
    k3_sampler *probe = NULL;
    k3_sampler_params bias_only = {.logit_bias = in->job.bias, .n_logit_bias = in->job.n_bias};
    k3_status st = k3_sampler_create(&probe, &bias_only, s.n_vocab, NULL);
    k3_sampler_destroy(probe);
    if (st == K3_OK || st == K3_ERR_NOMEM) return st;
    char why[512];
    snprintf(why, sizeof why, "%s", k3_last_error());
    return K3_ERR(K3_ERR_FORMAT, "--chat: request key 'logit_bias': %s", why);
}

/* ---- --chat output ------------------------------------------------------------------------ */
static k3_status print_chat(run_in *in, const k3_run_seq_result *res, bool ignore_eos) {
    k3_job_gen g = {.ids = res->gen, .n = res->n_gen, .stop = res->stop, .n_text = res->n_text};
    k3_chat_buf out = {0};
    k3_status st = k3_job_message(&in->job, in->tok, &g, ignore_eos, &out);
    if (st == K3_OK) printf("%s\n", out.p ? out.p : "{}");
    k3_chat_buf_free(&out);
    return st;
}

/* ---- the command ---------------------------------------------------------------------------- */
static int fail(k3_status st) {
    fprintf(stderr, "k3 run: %s\n", k3_last_error());
    return st == K3_ERR_ARG ? 2 : 1;
}

static int run_run(const k3_args *a) {
    const char *model = k3_args_str(a, "model");
    if (!model) {
        fprintf(stderr, "k3 run: --model DIR is required\n");
        return 2;
    }
    int n_src = k3_args_has(a, "prompt-ids") + k3_args_has(a, "prompt") + k3_args_has(a, "chat");
    if (n_src != 1) {
        fprintf(stderr,
                "k3 run: give exactly one of --prompt-ids IDS, --prompt TEXT or --chat FILE\n");
        return 2;
    }
    /* the engine's flags, as batch/serve/bench read them; MPI is not up yet, so every rank of an
     * mpirun prints the same usage error (as it always did for run's flags) */
    k3_engine_opts eo = {.name = "k3 run"};
    if (k3_engine_args(a, true, &eo)) return 2;
    run_in in;
    memset(&in, 0, sizeof in);
    int rc = 0;
    k3_status st = K3_OK;
    /* the tokenizer: required for --prompt / --chat; for --prompt-ids only when present (text) */
    char tpath[4096];
    struct stat sb;
    snprintf(tpath, sizeof tpath, "%s/tiktoken.model", model);
    bool need_tok = !k3_args_has(a, "prompt-ids");
    if (need_tok || stat(tpath, &sb) == 0) {
        st = k3_tok_create_model_dir(&in.tok, model, NULL);
        if (st != K3_OK && need_tok) {
            rc = fail(K3_ERR_IO); /* a missing/broken model dir is not a usage error */
            goto done;
        }
        if (st != K3_OK) K3_LOGW("no decoded text: %s", k3_last_error());
        st = K3_OK;
    }
    if (k3_args_has(a, "prompt-ids")) {
        st = k3_run_parse_prompts(k3_args_str(a, "prompt-ids"), &in.ids, &in.lens, &in.n_prompts);
    } else if (k3_args_has(a, "prompt")) {
        const char *text = k3_args_str(a, "prompt");
        k3_tok_ids v = {0};
        st = k3_tok_encode(in.tok, text, strlen(text), false, &v);
        if (st == K3_OK) st = ids_to_prompt(&in, v.ids, v.n, "--prompt");
        k3_tok_ids_free(&v);
    } else {
        st = load_chat(&in, k3_args_str(a, "chat"));
        if (st != K3_OK) {
            rc = fail(K3_ERR_IO); /* a bad request file: exit 1 (the error names the problem) */
            goto done;
        }
    }
    if (st == K3_OK) st = sampling(&in, a); /* K3_ERR_ARG: a flag (2); else the request (1) */
    if (st != K3_OK) {
        rc = fail(st);
        goto done;
    }

    if (k3_comm_init() != K3_OK) { /* MPI: a singleton world of one without mpirun */
        rc = fail(K3_ERR_COMM);
        goto done;
    }
    bool chat = in.job.req != NULL;
    bench_limits lim = {0};
    if (k3_args_bool(a, "bench-limits")) {
        int wr = 0, ws = 1;
        k3_comm_world(&wr, &ws);
        if (wr == 0) {
            char how[400];
            st = bench_measure_limits(
                eo.n_threads ? eo.n_threads : (int)sysconf(_SC_NPROCESSORS_ONLN), 5, 0, &lim);
            bench_limits_describe(&lim, how, sizeof how);
            if (st == K3_OK) K3_LOGI("measured limits, %s", how);
            if (st != K3_OK) K3_LOGW("--bench-limits: %s", k3_last_error());
            st = K3_OK;
        }
    }
    k3_run_result res = {0};
    eo.model_dir = model;
    eo.tok = in.tok;
    eo.progress = true;
    eo.op_stats = k3_args_str(a, "op-stats");
    k3_run_opts o = {.prompt_ids = in.ids,
                     .prompt_lens = in.lens,
                     .n_prompts = in.n_prompts,
                     .n_new = (int)in.job.max_tokens,
                     .sampling = in.job.sp,
                     .ignore_eos = k3_args_bool(a, "ignore-eos"),
                     .dump_logits = k3_args_str(a, "dump-logits"),
                     .json = k3_args_bool(a, "json"),
                     .quiet = chat,
                     .limit_triad_gbs = lim.triad_gbs,
                     .limit_fma_gflops = lim.fma_gflops,
                     .limit_threads = lim.threads,
                     .result = chat ? &res : NULL};
    {
        int wr = 0, ws = 1;
        k3_comm_world(&wr, &ws);
        k3_engine_backend_say(a, wr == 0); /* --backend auto: what and why, flags known good */
    }
    rc = k3_run_generate(&eo, &o);
    if (rc == 0 && chat && res.n_seqs == 1 &&
        (st = print_chat(&in, &res.seqs[0], k3_args_bool(a, "ignore-eos"))) != K3_OK)
        rc = fail(st);
    fflush(stdout);
    k3_run_result_free(&res);
    k3_comm_finalize();
done:
    run_free(&in);
    return rc;
}

const k3_command k3_cmd_run = {
    .name = "run",
    .positional = "",
    .min_pos = 0,
    .max_pos = 0,
    .summary = "generate from prompts or a chat request (one process, or every rank under mpirun)",
    .flags = flags,
    .n_flags = (int)K3_ARRAY_LEN(flags),
    .run = run_run,
};
