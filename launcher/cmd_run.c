/* cmd_run.c — `k3 run`: load a checkpoint in ONE process, prefill a prompt (in chunks), decode
 * greedily, print the generated ids (or one JSON object), optionally dump every position's
 * logits as .npy.
 *
 * Owns: the flags, the single-process generation loop (run_local: one whole-model stage with
 * local experts — the path the distributed runner reproduces), the .npy writer.
 * Does not own: any math (layers/, experts/), tokenisation (coordinator/k3_tokenizer.h).
 * Logits dumped: row i = logits after consuming token i of prompt ++ generated, for the
 * T + n - 1 tokens that are consumed (the last generated token is never fed back). */
#include "k3_launcher.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "k3_kernels.h"
#include "k3_layers.h"
#include "k3_model.h"
#include "k3_tokenizer.h"
#include "k3_comm.h" /* the distributed path (rank/, comm/: owned by "dist") */
#include "k3_rank.h"

static const k3_flag flags[] = {
    {"model", K3_FLAG_STR, "DIR", NULL, "checkpoint directory (config.json + safetensors)"},
    {"prompt-ids", K3_FLAG_STR, "IDS", NULL,
     "prompt as comma-separated token ids: 1,2,3 (several: 1,2;3,4)"},
    {"prompt", K3_FLAG_STR, "TEXT", NULL, "prompt text (tokenised with the model's tokenizer)"},
    {"n", K3_FLAG_INT, "N", "16", "new tokens to generate (no stop at EOS)"},
    {"greedy", K3_FLAG_BOOL, NULL, NULL, "greedy decoding (the default; sampling comes later)"},
    {"seed", K3_FLAG_INT, "S", "0", "sampling seed (unused while decoding is greedy)"},
    {"chunk", K3_FLAG_INT, "C", "0", "prefill chunk in tokens (0 = whole prompt at once)"},
    {"kda-chunk", K3_FLAG_INT, "C", "0",
     "KDA form: 0/1 = recurrent (bit-exact), C >= 2 = chunked, C tokens"},
    {"threads", K3_FLAG_INT, "N", "0", "cpu threads (0 = all cores)"},
    {"backend", K3_FLAG_STR, "NAME", "cpu", "kernel backend: cpu or ref"},
    {"dump-logits", K3_FLAG_STR, "FILE", NULL, "write float32 logits [positions, V] as .npy"},
    {"json", K3_FLAG_BOOL, NULL, NULL, "print one JSON object instead of plain ids"},
    /* distributed (under mpirun; see run_dist) */
    {"pp", K3_FLAG_INT, "S", "1", "pipeline stages (distributed run; world = S x E [+1])"},
    {"ep", K3_FLAG_INT, "E", "1", "expert-parallel lanes per stage (distributed run)"},
    {"coordinator", K3_FLAG_STR, "MODE", "shared",
     "shared (rank 0 is also stage 0 lane 0) or dedicated"},
    {"expert-map", K3_FLAG_STR, "FILE", NULL,
     "expert -> lane map (partition/k3_partition.h format)"},
    {"deterministic", K3_FLAG_BOOL, NULL, NULL,
     "logits bit-identical for every split (today the combine is per-row in both modes)"},
    {"comm-timeout", K3_FLAG_FLOAT, "SEC", "600", "limit of every blocking wait between ranks"},
};

/* ---- the distributed path: several prompts ("1,2;3,4"), --pp/--ep/..., or under mpirun ------ */
static bool want_dist(const k3_args *a) {
    const char *ids = k3_args_str(a, "prompt-ids");
    return k3_comm_launched() || k3_args_has(a, "pp") || k3_args_has(a, "ep") ||
           k3_args_has(a, "coordinator") || k3_args_has(a, "expert-map") ||
           (ids && strchr(ids, ';'));
}

static int run_dist(const k3_args *a, const int32_t *prompt, int64_t n_prompt, int64_t n_new,
                    int64_t chunk, int kda_chunk, int threads, const k3_ops *ops) {
    int32_t *ids = NULL;
    int64_t *lens = NULL, one = n_prompt;
    int np = 1;
    if (!prompt && k3_rank_parse_prompts(k3_args_str(a, "prompt-ids"), &ids, &lens, &np) != K3_OK) {
        fprintf(stderr, "k3 run: %s\n", k3_last_error());
        return 2;
    }
    k3_coord_mode cm = K3_COORD_SHARED;
    int64_t pp = k3_args_int(a, "pp"), ep = k3_args_int(a, "ep");
    double tmo = k3_args_float(a, "comm-timeout");
    int rc = 2;
    if (k3_coord_mode_parse(k3_args_str(a, "coordinator"), &cm) != K3_OK)
        fprintf(stderr, "k3 run: %s\n", k3_last_error());
    else if (pp < 1 || pp > 4096 || ep < 1 || ep > 4096 || !(tmo > 0))
        fprintf(stderr, "k3 run: --pp and --ep must be in [1, 4096], --comm-timeout > 0\n");
    else if (k3_comm_init() != K3_OK)
        fprintf(stderr, "k3 run: %s\n", k3_last_error()), rc = 1;
    else {
        k3_rank_opts o = {.model_dir = k3_args_str(a, "model"),
                          .pp = (int)pp,
                          .ep = (int)ep,
                          .coord = cm,
                          .expert_map_path = k3_args_str(a, "expert-map"),
                          .deterministic = k3_args_bool(a, "deterministic"),
                          .comm_timeout_s = tmo,
                          .prompt_ids = prompt ? prompt : ids,
                          .prompt_lens = prompt ? &one : lens,
                          .n_prompts = np,
                          .n_new = (int)n_new,
                          .chunk = chunk,
                          .dump_logits = k3_args_str(a, "dump-logits"),
                          .json = k3_args_bool(a, "json"),
                          .n_threads = threads,
                          .kda_chunk = kda_chunk,
                          .ops = ops,
                          .test_fail = getenv("K3_TEST_FAIL")};
        rc = k3_rank_run(&o);
        k3_comm_finalize();
    }
    k3_free(ids);
    k3_free(lens);
    return rc;
}

/* ---- .npy ---------------------------------------------------------------------------------- */
/* NumPy format 1.0: magic, version, uint16 LE header length, dict, spaces, '\n'; data at a
 * multiple of 64 bytes. */
static k3_status npy_write_header(FILE *f, int64_t rows, int64_t cols, const char *path) {
    char dict[128];
    int n = snprintf(dict, sizeof dict,
                     "{'descr': '<f4', 'fortran_order': False, 'shape': (%lld, %lld), }",
                     (long long)rows, (long long)cols);
    size_t total = 10 + (size_t)n + 1;
    size_t padded = (total + 63) / 64 * 64;
    size_t hlen = padded - 10;
    unsigned char pre[10] = {0x93,
                             'N',
                             'U',
                             'M',
                             'P',
                             'Y',
                             1,
                             0,
                             (unsigned char)(hlen & 0xff),
                             (unsigned char)(hlen >> 8)};
    char hdr[256];
    memset(hdr, ' ', sizeof hdr);
    memcpy(hdr, dict, (size_t)n);
    hdr[hlen - 1] = '\n';
    if (fwrite(pre, 1, 10, f) != 10 || fwrite(hdr, 1, hlen, f) != hlen)
        return K3_ERR(K3_ERR_IO, "%s: write failed: %s", path, strerror(errno));
    return K3_OK;
}

/* ---- prompt ------------------------------------------------------------------------------- */
static k3_status parse_ids(const char *s, int32_t **out, int64_t *n_out) {
    int64_t cap = 16, n = 0;
    int32_t *ids;
    K3_TRY(k3_alloc((void **)&ids, (size_t)cap * sizeof(int32_t), "prompt ids"));
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            k3_free(ids);
            return K3_ERR(K3_ERR_ARG, "--prompt-ids: '%s' is not a list of ids like 1,2,3", s);
        }
        if (n == cap) {
            int32_t *bigger;
            k3_status st =
                k3_alloc((void **)&bigger, (size_t)cap * 2 * sizeof(int32_t), "prompt ids");
            if (st != K3_OK) {
                k3_free(ids);
                return st;
            }
            memcpy(bigger, ids, (size_t)n * sizeof(int32_t));
            k3_free(ids);
            ids = bigger;
            cap *= 2;
        }
        ids[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    if (n == 0) {
        k3_free(ids);
        return K3_ERR(K3_ERR_ARG, "--prompt-ids: empty prompt");
    }
    *out = ids;
    *n_out = n;
    return K3_OK;
}

static int32_t argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i; /* ties -> lowest id (torch.argmax) */
    return (int32_t)best;
}

/* ---- the single-process path ---------------------------------------------------------------- */
typedef struct run_opts {
    const char *model_dir;
    const int32_t *prompt;
    int64_t n_prompt, n_new, chunk;
    int kda_chunk, n_threads;
    const k3_ops *ops;
    const char *dump_path;
} run_opts;

typedef struct run_result {
    int32_t *generated; /* [n_new] */
    double load_s, prefill_s, decode_s;
    uint64_t weight_bytes;
} run_result;

static k3_status run_local(const run_opts *o, run_result *r) {
    k3_status st = K3_OK;
    k3_config cfg;
    k3_ckpt *ck = NULL;
    k3_weights *w = NULL;
    k3_stage *stage = NULL;
    k3_seq_state *seq = NULL;
    k3_activ act = {0};
    float *logits = NULL;
    FILE *dump = NULL;
    memset(r, 0, sizeof *r);
    double t0 = k3_now_s();

    K3_TRY(k3_config_load(o->model_dir, &cfg));
    for (int64_t i = 0; i < o->n_prompt; i++)
        if (o->prompt[i] >= cfg.vocab_size)
            return K3_ERR(K3_ERR_ARG, "prompt id %d at position %lld is >= vocab_size %lld",
                          o->prompt[i], (long long)i, (long long)cfg.vocab_size);
    K3_TRY(k3_ckpt_open(o->model_dir, &ck));
    k3_load_sel sel = {.layer_begin = 0, .layer_end = cfg.n_layers, .embed = true, .head = true};
    st = k3_weights_load(ck, &cfg, &sel, &w);
    if (st != K3_OK) goto done;
    r->weight_bytes = k3_weights_bytes(w);
    r->load_s = k3_now_s() - t0;

    int64_t chunk = o->chunk > 0 ? K3_MIN(o->chunk, o->n_prompt) : o->n_prompt;
    k3_stage_params sp = {.cfg = &cfg,
                          .w = k3_weights_get(w),
                          .ops = o->ops,
                          .layer_begin = 0,
                          .layer_end = cfg.n_layers,
                          .first = true,
                          .last = true,
                          .max_tokens = chunk,
                          .n_threads = o->n_threads,
                          .kda_chunk = o->kda_chunk};
    if ((st = k3_stage_create(&sp, &stage)) != K3_OK) goto done;
    if ((st = k3_seq_state_create(stage, o->n_prompt + o->n_new, &seq)) != K3_OK) goto done;
    if ((st = k3_activ_alloc(&act, &cfg, chunk)) != K3_OK) goto done;
    const int64_t V = cfg.vocab_size;
    if ((st = k3_alloc((void **)&logits, (size_t)chunk * (size_t)V * sizeof(float), "logits")) !=
        K3_OK)
        goto done;
    if ((st = k3_calloc((void **)&r->generated, (size_t)K3_MAX(o->n_new, 1) * sizeof(int32_t),
                        "generated ids")) != K3_OK)
        goto done;
    if (o->dump_path) {
        dump = fopen(o->dump_path, "wb");
        if (!dump) {
            st = K3_ERR(K3_ERR_IO, "--dump-logits: cannot create %s: %s", o->dump_path,
                        strerror(errno));
            goto done;
        }
        int64_t rows = o->n_prompt + (o->n_new > 0 ? o->n_new - 1 : 0);
        if ((st = npy_write_header(dump, rows, V, o->dump_path)) != K3_OK) goto done;
    }

    /* prefill */
    double tp = k3_now_s();
    int32_t next = 0;
    for (int64_t p0 = 0; p0 < o->n_prompt; p0 += chunk) {
        int32_t n = (int32_t)K3_MIN(chunk, o->n_prompt - p0);
        k3_batch b = {.n_seqs = 1, .states = &seq, .n_tokens = &n, .token_ids = o->prompt + p0};
        bool all = dump != NULL;
        if ((st = k3_stage_forward(stage, &b, &act, NULL, all, logits)) != K3_OK) goto done;
        const float *last = logits + (all ? (int64_t)(n - 1) * V : 0);
        if (all &&
            fwrite(logits, sizeof(float), (size_t)n * (size_t)V, dump) != (size_t)n * (size_t)V) {
            st = K3_ERR(K3_ERR_IO, "--dump-logits: write to %s failed", o->dump_path);
            goto done;
        }
        next = argmax(last, V);
    }
    r->prefill_s = k3_now_s() - tp;

    /* decode */
    double td = k3_now_s();
    for (int64_t i = 0; i < o->n_new; i++) {
        r->generated[i] = next;
        if (i + 1 == o->n_new) break;
        int32_t one = 1;
        k3_batch b = {.n_seqs = 1, .states = &seq, .n_tokens = &one, .token_ids = &next};
        if ((st = k3_stage_forward(stage, &b, &act, NULL, false, logits)) != K3_OK) goto done;
        if (dump && fwrite(logits, sizeof(float), (size_t)V, dump) != (size_t)V) {
            st = K3_ERR(K3_ERR_IO, "--dump-logits: write to %s failed", o->dump_path);
            goto done;
        }
        next = argmax(logits, V);
    }
    r->decode_s = k3_now_s() - td;

done:
    if (dump && fclose(dump) != 0 && st == K3_OK)
        st = K3_ERR(K3_ERR_IO, "--dump-logits: closing %s failed", o->dump_path);
    k3_free(logits);
    k3_activ_free(&act);
    k3_seq_state_destroy(seq);
    k3_stage_destroy(stage);
    k3_weights_destroy(w);
    k3_ckpt_destroy(ck);
    if (st != K3_OK) {
        k3_free(r->generated);
        r->generated = NULL;
    }
    return st;
}

/* ---- the command ------------------------------------------------------------------------------
 */
static int run_run(const k3_args *a) {
    const char *model = k3_args_str(a, "model");
    if (!model) {
        fprintf(stderr, "k3 run: --model DIR is required\n");
        return 2;
    }
    bool has_ids = k3_args_has(a, "prompt-ids"), has_text = k3_args_has(a, "prompt");
    if (has_ids == has_text) {
        fprintf(stderr, "k3 run: give exactly one of --prompt-ids IDS or --prompt TEXT\n");
        return 2;
    }
    int64_t n_new = k3_args_int(a, "n"), chunk = k3_args_int(a, "chunk"),
            kc = k3_args_int(a, "kda-chunk");
    int64_t threads = k3_args_int(a, "threads");
    if (n_new < 0 || n_new > 1000000) {
        fprintf(stderr, "k3 run: --n: %lld must be in [0, 1000000]\n", (long long)n_new);
        return 2;
    }
    if (chunk < 0 || kc < 0 || kc > 1024 || threads < 0 || threads > 1024) {
        fprintf(stderr, "k3 run: --chunk, --kda-chunk (<= 1024) and --threads must be >= 0\n");
        return 2;
    }
    const k3_ops *ops = k3_ops_by_name(k3_args_str(a, "backend"));
    if (!ops) {
        fprintf(stderr, "k3 run: --backend: '%s' is not cpu or ref\n", k3_args_str(a, "backend"));
        return 2;
    }
    int32_t *prompt = NULL;
    int64_t n_prompt = 0;
    k3_tokenizer *tok = NULL;
    if (has_ids && strchr(k3_args_str(a, "prompt-ids"), ';')) {
        return run_dist(a, NULL, 0, n_new, chunk, (int)kc, (int)threads, ops); /* several prompts */
    } else if (has_ids) {
        if (parse_ids(k3_args_str(a, "prompt-ids"), &prompt, &n_prompt) != K3_OK) {
            fprintf(stderr, "k3 run: %s\n", k3_last_error());
            return 2;
        }
    } else {
        const char *text = k3_args_str(a, "prompt");
        k3_tok_ids ids = {0};
        if (k3_tok_create_model_dir(&tok, model, NULL) != K3_OK ||
            k3_tok_encode(tok, text, strlen(text), false, &ids) != K3_OK) {
            fprintf(stderr, "k3 run: --prompt: %s\n", k3_last_error());
            k3_tok_destroy(tok);
            return 1;
        }
        if (ids.n == 0) {
            fprintf(stderr, "k3 run: --prompt: the text encodes to no tokens\n");
            k3_tok_ids_free(&ids);
            k3_tok_destroy(tok);
            return 2;
        }
        if (k3_alloc((void **)&prompt, ids.n * sizeof(int32_t), "prompt") != K3_OK) {
            k3_tok_ids_free(&ids);
            k3_tok_destroy(tok);
            return 1;
        }
        memcpy(prompt, ids.ids, ids.n * sizeof(int32_t));
        n_prompt = (int64_t)ids.n;
        k3_tok_ids_free(&ids);
    }

    if (want_dist(a)) {
        int rc = run_dist(a, prompt, n_prompt, n_new, chunk, (int)kc, (int)threads, ops);
        k3_free(prompt);
        k3_tok_destroy(tok);
        return rc;
    }
    run_opts o = {.model_dir = model,
                  .prompt = prompt,
                  .n_prompt = n_prompt,
                  .n_new = n_new,
                  .chunk = chunk,
                  .kda_chunk = (int)kc,
                  .n_threads = (int)threads,
                  .ops = ops,
                  .dump_path = k3_args_str(a, "dump-logits")};
    run_result r;
    k3_status st = run_local(&o, &r);
    if (st != K3_OK) {
        fprintf(stderr, "k3 run: %s\n", k3_last_error());
        k3_free(prompt);
        k3_tok_destroy(tok);
        return st == K3_ERR_ARG ? 2 : 1;
    }
    char *text = NULL;
    k3_tok_bytes tb = {0};
    if (tok && k3_tok_decode(tok, r.generated, (size_t)n_new, &tb) == K3_OK) text = tb.data;

    if (k3_args_bool(a, "json")) {
        cJSON *j = cJSON_CreateObject();
        cJSON *pi = cJSON_AddArrayToObject(j, "prompt_ids"),
              *gi = cJSON_AddArrayToObject(j, "generated_ids");
        for (int64_t i = 0; i < n_prompt; i++)
            cJSON_AddItemToArray(pi, cJSON_CreateNumber(prompt[i]));
        for (int64_t i = 0; i < n_new; i++)
            cJSON_AddItemToArray(gi, cJSON_CreateNumber(r.generated[i]));
        if (text) cJSON_AddStringToObject(j, "text", text);
        cJSON *t = cJSON_AddObjectToObject(j, "timings");
        cJSON_AddNumberToObject(t, "load_s", r.load_s);
        cJSON_AddNumberToObject(t, "prefill_s", r.prefill_s);
        cJSON_AddNumberToObject(t, "decode_s", r.decode_s);
        cJSON_AddNumberToObject(t, "prefill_tok_s",
                                r.prefill_s > 0 ? (double)n_prompt / r.prefill_s : 0.0);
        /* decode steps = n_new - 1 forwards (the first new token comes from the prefill) */
        cJSON_AddNumberToObject(t, "decode_tok_s",
                                r.decode_s > 0 && n_new > 1 ? (double)(n_new - 1) / r.decode_s
                                                            : 0.0);
        char *s = cJSON_PrintUnformatted(j);
        printf("%s\n", s ? s : "{}");
        cJSON_free(s);
        cJSON_Delete(j);
    } else {
        for (int64_t i = 0; i < n_new; i++) printf("%s%d", i ? "," : "", r.generated[i]);
        printf("\n");
        if (text) printf("%s\n", text);
        K3_LOGI(
            "prompt %lld tokens: prefill %.3f s (%.1f tok/s), %lld new: decode %.3f s, load %.2f s",
            (long long)n_prompt, r.prefill_s, r.prefill_s > 0 ? n_prompt / r.prefill_s : 0.0,
            (long long)n_new, r.decode_s, r.load_s);
    }
    k3_tok_bytes_free(&tb);
    k3_free(r.generated);
    k3_free(prompt);
    k3_tok_destroy(tok);
    return 0;
}

const k3_command k3_cmd_run = {
    .name = "run",
    .positional = "",
    .min_pos = 0,
    .max_pos = 0,
    .summary = "generate from a prompt in one process (greedy), optionally dumping logits",
    .flags = flags,
    .n_flags = (int)K3_ARRAY_LEN(flags),
    .run = run_run,
};
