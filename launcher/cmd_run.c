/* cmd_run.c — `k3 run`: the flags, the prompt (ids, text or an OpenAI chat request), the sampling
 * parameters, then ONE generation loop: k3_rank_run (rank/), on a world of one (MPI singleton,
 * initialised here lazily) for a plain run or on every rank under mpirun.
 *
 * Owns: flag parsing and validation, --prompt tokenisation, the --chat request (render ->
 * segment-wise encode -> generate -> k3_parser -> the assistant message as JSON), the merge of the
 * request's sampling fields with the flags (a flag given explicitly wins; otherwise the request's
 * field; otherwise the flag default).
 * Does not own: any math (layers/, experts/), the generation loop, the sampler, the report of a
 * plain run (rank/k3_rank.h), tokenisation (coordinator/).
 * Stop strings: --stop STR is one stop string; a value starting with '[' must be a JSON array of
 * strings (--stop '["\n\n", "###"]') and gives several. The penalty history holds generated ids
 * only (the prompt is not penalised).
 * Exit codes: a bad flag is a usage error (2); a bad request file or request content (including a
 * sampling field of the request out of range) is a failure (1). */
#include "k3_launcher.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "k3_chat.h"
#include "k3_comm.h"
#include "k3_kernels.h"
#include "k3_model.h"
#include "k3_parser.h"
#include "k3_rank.h"
#include "k3_sampler.h"
#include "k3_tokenizer.h"

static const k3_flag flags[] = {
    {"model", K3_FLAG_STR, "DIR", NULL, "checkpoint directory (config.json + safetensors)"},
    {"prompt-ids", K3_FLAG_STR, "IDS", NULL,
     "prompt as comma-separated token ids: 1,2,3 (several: 1,2;3,4)"},
    {"prompt", K3_FLAG_STR, "TEXT", NULL, "prompt text (tokenised with the model's tokenizer)"},
    {"chat", K3_FLAG_STR, "FILE", NULL,
     "OpenAI-style chat request (JSON): render, generate, print the parsed assistant message; "
     "its max_tokens/temperature/top_p/seed/stop/... apply unless the flag is given"},
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
    {"chunk", K3_FLAG_INT, "C", "0", "prefill chunk in tokens (0 = whole prompt at once)"},
    {"kda-chunk", K3_FLAG_INT, "C", "0",
     "KDA form: 0/1 = recurrent (bit-exact), C >= 2 = chunked, C tokens"},
    {"threads", K3_FLAG_INT, "N", "0",
     "cpu threads per rank (0 = all cores alone, 1 under mpirun)"},
    {"backend", K3_FLAG_STR, "NAME", "cpu",
     "kernel backend: cpu, ref, guard (a test backend: cpu ops on memory host code cannot touch) "
     "or cuda (builds with K3_CUDA; device memory, ops still being ported)"},
    {"dump-logits", K3_FLAG_STR, "FILE", NULL,
     "write float32 logits [positions, V] as .npy (every consumed token, prompts concatenated)"},
    {"json", K3_FLAG_BOOL, NULL, NULL, "print one JSON object instead of ids + text lines"},
    /* distributed (under mpirun) */
    {"pp", K3_FLAG_INT, "S", "1", "pipeline stages (under mpirun; world = S x E [+1])"},
    {"ep", K3_FLAG_INT, "E", "1", "expert-parallel lanes per stage (under mpirun)"},
    {"coordinator", K3_FLAG_STR, "MODE", "shared",
     "shared (rank 0 is also stage 0 lane 0) or dedicated"},
    {"expert-map", K3_FLAG_STR, "FILE", NULL,
     "expert -> lane map (partition/k3_partition.h format)"},
    {"deterministic", K3_FLAG_BOOL, NULL, NULL,
     "logits bit-identical for every split (today the combine is per-row in both modes)"},
    {"comm-timeout", K3_FLAG_FLOAT, "SEC", "600", "limit of every blocking wait between ranks"},
};

/* Everything a run needs besides the flags; freed by run_free. */
typedef struct run_in {
    k3_tokenizer *tok;
    int32_t *ids; /* all prompts concatenated */
    int64_t *lens;
    int n_prompts;
    k3_chat_request *req;  /* --chat */
    k3_chat_json *req_doc; /* --chat: the raw request (sampling fields) */
    k3_sampler_params sp;
    k3_logit_bias *bias;
    size_t n_bias;
    const char **stops;
    size_t n_stops;
    k3_chat_json *stop_doc; /* --stop as JSON */
    int64_t n_new;
} run_in;

static void run_free(run_in *in) {
    k3_tok_destroy(in->tok);
    k3_free(in->ids), k3_free(in->lens), k3_free(in->bias), k3_free(in->stops);
    k3_chat_request_destroy(in->req);
    k3_chat_json_free(in->req_doc);
    k3_chat_json_free(in->stop_doc);
}

/* ---- prompts ----------------------------------------------------------------------------- */
static k3_status ids_to_prompt(run_in *in, const k3_tok_ids *v, const char *what) {
    if (v->n == 0) return K3_ERR(K3_ERR_ARG, "%s: encodes to no tokens", what);
    K3_TRY(k3_alloc((void **)&in->ids, v->n * sizeof(int32_t), "prompt"));
    K3_TRY(k3_alloc((void **)&in->lens, sizeof(int64_t), "prompt"));
    memcpy(in->ids, v->ids, v->n * sizeof(int32_t));
    in->lens[0] = (int64_t)v->n;
    in->n_prompts = 1;
    return K3_OK;
}

static k3_status load_chat(run_in *in, const char *path) {
    char *text = NULL;
    size_t n = 0;
    K3_TRY(k3_read_file(path, &text, &n));
    k3_status st = k3_chat_json_parse(text, n, path, &in->req_doc);
    if (st == K3_OK) st = k3_chat_request_parse(text, n, &in->req);
    k3_free(text);
    if (st != K3_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", k3_last_error());
        return K3_ERR(st, "--chat %s: %s", path, why);
    }
    const k3_chat_json *msgs = k3_chat_json_get(in->req_doc, "messages");
    if (msgs && msgs->kind == K3_JSON_ARRAY && msgs->n_items == 0)
        return K3_ERR(K3_ERR_FORMAT, "--chat %s: messages is empty", path);
    k3_chat_prompt pr = {0};
    k3_tok_ids v = {0};
    st = k3_chat_render(in->req, true, &pr);
    if (st == K3_OK) st = k3_chat_encode(&pr, in->tok, &v);
    if (st == K3_OK) st = ids_to_prompt(in, &v, "--chat");
    k3_chat_prompt_free(&pr);
    k3_tok_ids_free(&v);
    return st;
}

/* ---- sampling parameters ----------------------------------------------------------------- */
static bool json_num(const k3_chat_json *v, double *out) {
    if (!v) return false;
    if (v->kind == K3_JSON_INT)
        *out = strtod(v->s, NULL);
    else if (v->kind == K3_JSON_FLOAT)
        *out = v->f;
    else
        return false;
    return true;
}

/* The request's numeric field `key` into *out unless the flag was given; *from_req tells which.
 * A bad request value is K3_ERR_FORMAT (exit 1) naming the key. */
static k3_status req_num(const run_in *in, const k3_args *a, const char *key, const char *flag,
                         double *out, bool *from_req) {
    const k3_chat_json *v = k3_chat_json_get(in->req_doc, key);
    if (!v || v->kind == K3_JSON_NULL || k3_args_has(a, flag)) return K3_OK;
    if (!json_num(v, out))
        return K3_ERR(K3_ERR_FORMAT, "--chat: request key '%s' is not a number", key);
    *from_req = true;
    return K3_OK;
}

/* An out-of-range value: a usage error naming the flag, or (when it came from the request) a bad
 * request naming the key. */
static k3_status bad_value(bool from_req, const char *flag, const char *key, double v,
                           const char *rule) {
    if (from_req) return K3_ERR(K3_ERR_FORMAT, "--chat: request key '%s': %g %s", key, v, rule);
    return K3_ERR(K3_ERR_ARG, "--%s: %g %s", flag, v, rule);
}

/* An unsigned 64-bit integer from decimal digits only (no sign, no exponent). */
static bool parse_u64(const char *s, uint64_t *out) {
    if (!s || *s < '0' || *s > '9') return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end) return false;
    *out = (uint64_t)v;
    return true;
}

/* A bias that must fit a float (finite after the cast). */
static bool bias_ok(double b) {
    return isfinite(b) && fabs(b) <= FLT_MAX;
}

static k3_status parse_bias(run_in *in, const char *s) {
    size_t n = 1;
    for (const char *p = s; *p; p++) n += *p == ',';
    K3_TRY(k3_alloc((void **)&in->bias, n * sizeof *in->bias, "logit bias"));
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
        if (!bias_ok(b))
            return K3_ERR(K3_ERR_ARG,
                          "--logit-bias: the bias of id %ld (%.*s) does not fit a float", id,
                          (int)(end - p), p);
        in->bias[i] = (k3_logit_bias){(int32_t)id, (float)b};
        p = *end ? end + 1 : end;
    }
    in->n_bias = n;
    return K3_OK;
}

/* The request's OpenAI logit_bias: an object {"id": bias, ...} (ids as decimal strings). */
static k3_status req_bias(run_in *in, const k3_chat_json *v) {
    if (v->kind != K3_JSON_OBJECT)
        return K3_ERR(K3_ERR_FORMAT, "--chat: request key 'logit_bias' must be an object");
    K3_TRY(k3_alloc((void **)&in->bias, K3_MAX(v->n_items, 1) * sizeof *in->bias, "logit bias"));
    for (size_t i = 0; i < v->n_items; i++) {
        const char *key = v->keys[i]->s;
        uint64_t id = 0;
        double b = 0;
        if (!parse_u64(key, &id) || id > INT32_MAX)
            return K3_ERR(K3_ERR_FORMAT,
                          "--chat: request key 'logit_bias': '%.40s' is not a token id", key);
        if (!json_num(v->items[i], &b) || !bias_ok(b))
            return K3_ERR(K3_ERR_FORMAT,
                          "--chat: request key 'logit_bias': the bias of id %s is not a number "
                          "that fits a float",
                          key);
        in->bias[i] = (k3_logit_bias){(int32_t)id, (float)b};
    }
    in->n_bias = v->n_items;
    return K3_OK;
}

/* The request's seed: the JSON number lexeme as an unsigned 64-bit integer (never via double). */
static k3_status req_seed(const k3_chat_json *v, uint64_t *seed) {
    if (v->kind == K3_JSON_INT && parse_u64(v->s, seed)) return K3_OK;
    if (v->kind == K3_JSON_FLOAT && v->f >= 0 && v->f < 9007199254740992.0 && v->f == floor(v->f)) {
        *seed = (uint64_t)v->f; /* 5.0: exact below 2^53 */
        return K3_OK;
    }
    return K3_ERR(K3_ERR_FORMAT, "--chat: request key 'seed' must be an integer in [0, 2^64)");
}

/* Stop strings from a JSON value (string or array of strings) or NULL. */
static k3_status stops_from_json(run_in *in, const k3_chat_json *v, const char *what,
                                 k3_status bad) {
    if (v->kind == K3_JSON_STRING) {
        if (v->n == 0 || strlen(v->s) != v->n)
            return K3_ERR(bad, "%s: must be a non-empty string without NUL", what);
        K3_TRY(k3_alloc((void **)&in->stops, sizeof(char *), "stop strings"));
        in->stops[0] = v->s;
        in->n_stops = 1;
        return K3_OK;
    }
    if (v->kind != K3_JSON_ARRAY)
        return K3_ERR(bad, "%s: must be a string or an array of strings", what);
    K3_TRY(k3_alloc((void **)&in->stops, K3_MAX(v->n_items, 1) * sizeof(char *), "stop strings"));
    for (size_t i = 0; i < v->n_items; i++) {
        const k3_chat_json *e = v->items[i];
        if (e->kind != K3_JSON_STRING || e->n == 0 || strlen(e->s) != e->n)
            return K3_ERR(bad, "%s[%zu]: must be a non-empty string without NUL", what, i);
        in->stops[i] = e->s;
    }
    in->n_stops = v->n_items;
    return K3_OK;
}

static k3_status sampling(run_in *in, const k3_args *a) {
    double t = k3_args_float(a, "temperature"), top_p = k3_args_float(a, "top-p"),
           min_p = k3_args_float(a, "min-p"), rep = k3_args_float(a, "repetition-penalty"),
           pres = k3_args_float(a, "presence-penalty"),
           freq = k3_args_float(a, "frequency-penalty");
    double top_k = (double)k3_args_int(a, "top-k"), n = (double)k3_args_int(a, "n");
    uint64_t seed = 0;
    if (!parse_u64(k3_args_str(a, "seed"), &seed))
        return K3_ERR(K3_ERR_ARG, "--seed: '%s' must be an integer in [0, 2^64)",
                      k3_args_str(a, "seed"));
    bool r_t = false, r_top_p = false, r_top_k = false, r_min_p = false, r_rep = false,
         r_pres = false, r_freq = false, r_n = false;
    if (k3_args_bool(a, "greedy")) {
        if (k3_args_has(a, "temperature") && t != 0)
            return K3_ERR(K3_ERR_ARG, "--greedy contradicts --temperature %g", t);
        t = 0;
    }
    if (in->req_doc) { /* request fields, unless the flag was given */
        const k3_chat_json *d = in->req_doc;
        bool t_flag = k3_args_has(a, "temperature") || k3_args_has(a, "greedy");
        if (!t_flag) K3_TRY(req_num(in, a, "temperature", "temperature", &t, &r_t));
        K3_TRY(req_num(in, a, "top_p", "top-p", &top_p, &r_top_p));
        K3_TRY(req_num(in, a, "top_k", "top-k", &top_k, &r_top_k));
        K3_TRY(req_num(in, a, "min_p", "min-p", &min_p, &r_min_p));
        K3_TRY(req_num(in, a, "repetition_penalty", "repetition-penalty", &rep, &r_rep));
        K3_TRY(req_num(in, a, "presence_penalty", "presence-penalty", &pres, &r_pres));
        K3_TRY(req_num(in, a, "frequency_penalty", "frequency-penalty", &freq, &r_freq));
        K3_TRY(req_num(in, a, "max_tokens", "n", &n, &r_n));
        K3_TRY(req_num(in, a, "max_completion_tokens", "n", &n, &r_n));
        const k3_chat_json *v = k3_chat_json_get(d, "seed");
        if (v && v->kind != K3_JSON_NULL && !k3_args_has(a, "seed")) K3_TRY(req_seed(v, &seed));
        v = k3_chat_json_get(d, "n");
        if (v && v->kind != K3_JSON_NULL) {
            double nc = 0;
            if (!json_num(v, &nc) || nc != 1)
                return K3_ERR(K3_ERR_FORMAT,
                              "--chat: request key 'n': only one choice (n = 1) is supported");
        }
        v = k3_chat_json_get(d, "logit_bias");
        if (v && v->kind != K3_JSON_NULL && !k3_args_has(a, "logit-bias")) K3_TRY(req_bias(in, v));
        v = k3_chat_json_get(d, "stop");
        if (v && v->kind != K3_JSON_NULL && !k3_args_has(a, "stop"))
            K3_TRY(stops_from_json(in, v, "--chat: request key 'stop'", K3_ERR_FORMAT));
    }
    if (!(n >= 0 && n <= 1000000) || n != floor(n))
        return bad_value(r_n, "n", "max_tokens", n, "must be an integer in [0, 1000000]");
    if (!(top_k >= 0 && top_k <= INT32_MAX) || top_k != floor(top_k))
        return bad_value(r_top_k, "top-k", "top_k", top_k, "must be an integer >= 0");
    if (!(top_p > 0 && top_p <= 1))
        return bad_value(r_top_p, "top-p", "top_p", top_p, "must be in (0, 1]");
    if (!(rep >= K3_SAMPLER_MIN_REPETITION_PENALTY && rep <= FLT_MAX))
        return bad_value(r_rep, "repetition-penalty", "repetition_penalty", rep,
                         "must be finite and >= 1e-4");
    if (!(t >= 0 && t <= FLT_MAX))
        return bad_value(r_t, "temperature", "temperature", t, "must be finite and >= 0");
    if (!(min_p >= 0 && min_p <= 1))
        return bad_value(r_min_p, "min-p", "min_p", min_p, "must be in [0, 1]");
    if (!(fabs(pres) <= FLT_MAX))
        return bad_value(r_pres, "presence-penalty", "presence_penalty", pres,
                         "must be finite (fit a float)");
    if (!(fabs(freq) <= FLT_MAX))
        return bad_value(r_freq, "frequency-penalty", "frequency_penalty", freq,
                         "must be finite (fit a float)");
    const char *stop = k3_args_str(a, "stop");
    if (stop) {
        if (!*stop) return K3_ERR(K3_ERR_ARG, "--stop: the stop string is empty");
        if (stop[0] == '[') {
            if (k3_chat_json_parse(stop, strlen(stop), "--stop", &in->stop_doc) != K3_OK) {
                char why[400];
                snprintf(why, sizeof why, "%s", k3_last_error());
                return K3_ERR(K3_ERR_ARG,
                              "--stop: a value starting with '[' must be a JSON array of strings "
                              "(%s)",
                              why);
            }
            K3_TRY(stops_from_json(in, in->stop_doc, "--stop", K3_ERR_ARG));
        } else {
            K3_TRY(k3_alloc((void **)&in->stops, sizeof(char *), "stop strings"));
            in->stops[0] = stop;
            in->n_stops = 1;
        }
        if (!in->tok) return K3_ERR(K3_ERR_ARG, "--stop: the model directory has no tokenizer");
    }
    if (k3_args_has(a, "logit-bias")) K3_TRY(parse_bias(in, k3_args_str(a, "logit-bias")));
    in->n_new = (int64_t)n;
    in->sp = (k3_sampler_params){.temperature = (float)t,
                                 .top_k = (int32_t)top_k,
                                 .top_p = (float)top_p,
                                 .min_p = (float)min_p,
                                 .repetition_penalty = (float)rep,
                                 .presence_penalty = (float)pres,
                                 .frequency_penalty = (float)freq,
                                 .logit_bias = in->bias,
                                 .n_logit_bias = in->n_bias,
                                 .seed = seed,
                                 .stop_strings = in->stops,
                                 .n_stop_strings = in->n_stops};
    return K3_OK;
}

/* ---- --chat output ------------------------------------------------------------------------ */
/* Feeds the generated ids to the parser, replaying the sampler's text stream (the same
 * detokenizer, so the same byte offsets as res->text): markers go in as markers, text as text,
 * and nothing at or after byte `cut` of the stream reaches the parser — after a stop string
 * cut = res->n_text (the text before the match), so the stop string and what follows it never
 * become reasoning / content / a call, and markers after it are dropped too. With ignore_eos,
 * <|end_of_msg|> / [EOS] do not end the message (generation went on past them). */
static k3_status feed_chat(k3_parser *p, const k3_tokenizer *tok, const k3_rank_seq_result *res,
                           bool ignore_eos) {
    const size_t cut = res->stop == K3_STOP_STRING ? res->n_text : SIZE_MAX;
    const k3_tok_ctrl c = k3_tok_control_ids(tok);
    k3_tok_stream *ts = NULL;
    k3_tok_bytes txt = {0};
    K3_TRY(k3_tok_stream_create(&ts, tok));
    k3_status st = K3_OK;
    size_t fed = 0; /* stream bytes already handed to the parser (or dropped) */
    for (int i = 0; i <= res->n_gen && st == K3_OK && fed < cut; i++) {
        const bool last = i == res->n_gen;
        const int32_t id = last ? -1 : res->gen[i];
        st = last ? k3_tok_stream_finish(ts, &txt) : k3_tok_stream_push(ts, id, &txt);
        if (st != K3_OK) break;
        bool special = !last && k3_tok_is_special(tok, id);
        size_t nb = 0;
        if (special) {
            const char *b;
            st = k3_tok_id_bytes(tok, id, &b, &nb);
            if (st != K3_OK) break;
            nb = K3_MIN(nb, txt.n - fed); /* the marker's own text closes the chunk */
        }
        size_t text_end = K3_MIN(txt.n - nb, cut); /* text of this step (held UTF-8 included) */
        if (text_end > fed) st = k3_parser_feed_text(p, txt.data + fed, text_end - fed);
        fed = K3_MAX(fed, text_end);
        if (st != K3_OK || !special) continue;
        if (txt.n > cut) break; /* the stop string began inside the marker's text */
        k3_parser_marker m = id == c.open         ? K3_MARK_OPEN
                             : id == c.close      ? K3_MARK_CLOSE
                             : id == c.sep        ? K3_MARK_SEP
                             : id == c.end_of_msg ? K3_MARK_EOM
                             : id == c.eos        ? K3_MARK_STOP
                                                  : K3_MARK_OTHER;
        if (ignore_eos && (m == K3_MARK_EOM || m == K3_MARK_STOP)) m = K3_MARK_OTHER;
        st = k3_parser_feed_marker(p, m);
        fed = txt.n;
    }
    k3_tok_bytes_free(&txt);
    k3_tok_stream_destroy(ts);
    return st;
}

static k3_status print_chat(run_in *in, const k3_rank_seq_result *res, bool ignore_eos) {
    k3_parser *p = NULL;
    k3_chat_buf out = {0};
    K3_TRY(k3_parser_create_for(in->req, &p));
    k3_status st = feed_chat(p, in->tok, res, ignore_eos);
    /* a stop string ends the message like <|end_of_msg|> would (finish_reason "stop") */
    if (st == K3_OK && res->stop == K3_STOP_STRING && !k3_parser_ended(p))
        st = k3_parser_feed_marker(p, K3_MARK_EOM);
    if (st == K3_OK) st = k3_parser_finish(p);
    if (st == K3_OK) st = k3_parser_message_json(p, &out);
    if (st == K3_OK) printf("%s\n", out.p ? out.p : "{}");
    k3_chat_buf_free(&out);
    k3_parser_destroy(p);
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
    int64_t chunk = k3_args_int(a, "chunk"), kc = k3_args_int(a, "kda-chunk"),
            threads = k3_args_int(a, "threads"), pp = k3_args_int(a, "pp"),
            ep = k3_args_int(a, "ep");
    double tmo = k3_args_float(a, "comm-timeout");
    if (chunk < 0 || kc < 0 || kc > 1024 || threads < 0 || threads > 1024) {
        fprintf(stderr, "k3 run: --chunk, --kda-chunk (<= 1024) and --threads must be >= 0\n");
        return 2;
    }
    if (pp < 1 || pp > 4096 || ep < 1 || ep > 4096 || !(tmo > 0)) {
        fprintf(stderr, "k3 run: --pp and --ep must be in [1, 4096], --comm-timeout > 0\n");
        return 2;
    }
    const char *backend = k3_args_str(a, "backend");
    if (strcmp(backend, "cpu") != 0 && strcmp(backend, "ref") != 0 &&
        strcmp(backend, "guard") != 0 && strcmp(backend, "cuda") != 0) {
        fprintf(stderr, "k3 run: --backend: '%s' is not cpu, ref, guard or cuda\n", backend);
        return 2;
    }
    k3_coord_mode cm = K3_COORD_SHARED;
    if (k3_coord_mode_parse(k3_args_str(a, "coordinator"), &cm) != K3_OK) return fail(K3_ERR_ARG);

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
        st = k3_rank_parse_prompts(k3_args_str(a, "prompt-ids"), &in.ids, &in.lens, &in.n_prompts);
    } else if (k3_args_has(a, "prompt")) {
        const char *text = k3_args_str(a, "prompt");
        k3_tok_ids v = {0};
        st = k3_tok_encode(in.tok, text, strlen(text), false, &v);
        if (st == K3_OK) st = ids_to_prompt(&in, &v, "--prompt");
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
    bool chat = in.req != NULL;
    k3_rank_result res = {0};
    k3_rank_opts o = {.model_dir = model,
                      .pp = (int)pp,
                      .ep = (int)ep,
                      .coord = cm,
                      .expert_map_path = k3_args_str(a, "expert-map"),
                      .deterministic = k3_args_bool(a, "deterministic"),
                      .comm_timeout_s = tmo,
                      .prompt_ids = in.ids,
                      .prompt_lens = in.lens,
                      .n_prompts = in.n_prompts,
                      .n_new = (int)in.n_new,
                      .chunk = chunk,
                      .dump_logits = k3_args_str(a, "dump-logits"),
                      .json = k3_args_bool(a, "json"),
                      .n_threads = (int)threads,
                      .kda_chunk = (int)kc,
                      .backend = backend,
                      .test_fail = getenv("K3_TEST_FAIL"),
                      .sampling = in.sp,
                      .ignore_eos = k3_args_bool(a, "ignore-eos"),
                      .tok = in.tok,
                      .quiet = chat,
                      .result = chat ? &res : NULL};
    rc = k3_rank_run(&o);
    if (rc == 0 && chat && res.n_seqs == 1 &&
        (st = print_chat(&in, &res.seqs[0], k3_args_bool(a, "ignore-eos"))) != K3_OK)
        rc = fail(st);
    fflush(stdout);
    k3_rank_result_free(&res);
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
