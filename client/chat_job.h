/* chat_job — one OpenAI chat request as a generation job, shared by `k3 run --chat`, `k3 batch`
 * and `k3 serve` (the second public header of client/, prefix k3_job_: the OpenAI request layer
 * the HTTP server and the launcher's commands share; it lives in client/, below server/ and
 * launcher/, so that both can use it).
 *
 * Owns: the request body -> prompt ids (render, then segment-wise encode: k3_chat.h); the
 * sampling keys of the request (temperature, top_p, top_k, min_p, repetition_penalty,
 * presence_penalty, frequency_penalty, max_tokens / max_completion_tokens, seed, n, logit_bias,
 * stop) merged with the command line's settings (a flag given explicitly wins, otherwise the
 * request's key, otherwise the flag's default); the one validation of the merged values (an
 * error names the request key, K3_ERR_FORMAT, or the flag, K3_ERR_ARG); and the generated ids ->
 * the assistant message (the sampler's text stream replayed through k3_parser), whole or token by
 * token for streaming (k3_job_feed); the OpenAI logprobs keys and entries.
 * Does not own: generation (rank/; `k3 run`'s driver: k3_run.h), flags (each command's table), the
 * output format of a command. Lifetime: the sampler parameters in k3_job.sp point into the job
 * (bias, stop strings), so the job must outlive every use of sp (an engine copies them at submit).
 */
#ifndef K3_CHAT_JOB_H
#define K3_CHAT_JOB_H

#include "k3_chat.h"
#include "k3_grammar.h"
#include "k3_parser.h"
#include "k3_sampler.h"
#include "k3_tokenizer.h"

/* The numeric sampling settings, in one order for the key and flag tables of chat_job.c. */
typedef enum k3_job_num {
    K3_JOB_TEMPERATURE,
    K3_JOB_TOP_K,
    K3_JOB_TOP_P,
    K3_JOB_MIN_P,
    K3_JOB_REPETITION_PENALTY,
    K3_JOB_PRESENCE_PENALTY,
    K3_JOB_FREQUENCY_PENALTY,
    K3_JOB_MAX_TOKENS,
    K3_JOB_N_NUM
} k3_job_num;

/* What the command line says. A setting that is not `fixed` is a default: the request's key
 * replaces it. */
typedef struct k3_job_settings {
    double num[K3_JOB_N_NUM];
    bool fixed[K3_JOB_N_NUM];
    const char *flag[K3_JOB_N_NUM]; /* the flag that sets it ("top-p"), for messages; NULL: none */
    uint64_t seed;
    bool seed_fixed;
    bool bias_fixed, stop_fixed; /* the caller filled job.bias / job.stops from its flags */
    int64_t n_vocab; /* the model's vocab_size: logit_bias ids must be below it (0: unchecked) */
    k3_grammar_cache *grammars; /* structured outputs (k3_job_grammar); NULL: refused */
    bool n_taken;       /* the caller answers "n" itself (k3 serve); else only n = 1 is accepted */
    bool defer_grammar; /* k3_job_sampling leaves the grammar to a later k3_job_grammar call (k3
                           serve compiles only after the prompt-length checks) */
} k3_job_settings;

typedef struct k3_job {
    k3_chat_json *doc;    /* the request body (NULL: no request, the settings alone) */
    k3_chat_request *req; /* parsed + normalised */
    int32_t *ids;         /* (n_ids) the rendered prompt */
    int64_t n_ids;
    k3_logit_bias *bias; /* (n_bias) */
    size_t n_bias;
    const char **stops; /* (n_stops) point into doc, stop_doc or the caller's strings */
    size_t n_stops;
    k3_chat_json *stop_doc; /* the caller's stop list as JSON (k3_job_stops_json), owned */
    /* k3_job_sampling's result */
    k3_sampler_params sp; /* points into bias / stops */
    int64_t max_tokens;
    bool from_req[K3_JOB_N_NUM]; /* the value came from the request's key */
    k3_grammar *grammar;         /* structured outputs: sp.grammar (retained, released by free) */
} k3_job;

/* Parse an OpenAI chat request (`n_bytes` of JSON text), render it with the generation prompt
 * and encode it with `tok`. Errors start with `what` ("--chat FILE", "line 12"); K3_ERR_FORMAT
 * for a bad request. */
k3_status k3_job_parse(k3_job *j, const char *text, size_t n_bytes, const char *what,
                       const k3_tokenizer *tok);
/* Merge the settings with the request's keys (if j->doc), validate, fill j->sp and
 * j->max_tokens. A request value out of range is K3_ERR_FORMAT "<what>: request key 'top_p': ...",
 * a flag value out of range K3_ERR_ARG "--top-p: ..."; so is a logit_bias id at or past
 * s->n_vocab ("request key 'logit_bias'" or "--logit-bias"), before the sampler would refuse it
 * without naming where it came from. */
k3_status k3_job_sampling(k3_job *j, const k3_job_settings *s, const char *what);
/* Stop strings from a JSON string or array of strings into j->stops (`bad`: the status of an
 * error, which starts with `what`). */
k3_status k3_job_stops_json(k3_job *j, const k3_chat_json *v, const char *what, k3_status bad);
void k3_job_free(k3_job *j); /* frees the members, zeroes; NULL-safe */
/* chat_job_grammar.c: the request's response_format / tool_choice / parallel_tool_calls /
 * structured_outputs / guided_* keys -> j->grammar and j->sp.grammar (none when the request
 * asks for nothing); called by k3_job_sampling. K3_ERR_FORMAT naming the key or the schema
 * keyword that is not supported. */
k3_status k3_job_grammar(k3_job *j, k3_grammar_cache *cache, const char *what);
/* Before the prompt is rendered: the structured-output schemas of a chat request (doc) pass
 * k3_grammar_schema_check, so a hostile one ($ref chain, size) is a 400 in milliseconds, not after
 * rendering and tokenizing it. Other errors of those keys are left to k3_job_grammar. */
k3_status k3_job_grammar_check(const k3_chat_json *doc, const char *what);
/* The grammar cache of a model (its tokenizer and vocab_size), for k3_job_settings.grammars. */
k3_status k3_job_grammar_cache(const k3_tokenizer *tok, int64_t n_vocab, k3_grammar_cache **out);
/* An unsigned 64-bit integer from decimal digits only (no sign, no exponent): seeds. */
bool k3_job_parse_u64(const char *s, uint64_t *out);
/* A logit bias that fits a float; with allow_ban also -inf (the sampler decides). */
bool k3_job_bias_ok(double b, bool allow_ban);

/* How a generation ended, as the parser needs it. */
typedef struct k3_job_gen {
    const int32_t *ids; /* (n) generated ids, a stop id included */
    int64_t n;
    k3_stop_kind stop; /* K3_STOP_NONE: the length limit */
    size_t n_text;     /* bytes of text the sampler emitted: with K3_STOP_STRING, the text
                        * before the stop string */
} k3_job_gen;

/* The assistant message of a finished generation, appended to `out` as k3_parser_message_json
 * writes it ({"role","content","reasoning_content"?,"tool_calls","finish_reason"}). A stop
 * string or a stop id ends the message like <|end_of_msg|> (finish_reason "stop"); nothing at or
 * after a stop string reaches the message. With ignore_eos, <|end_of_msg|> / [EOS] in the ids do
 * not end the message (generation went on past them). */
k3_status k3_job_message(const k3_job *j, const k3_tokenizer *tok, const k3_job_gen *g,
                         bool ignore_eos, k3_chat_buf *out);

/* The same, token by token, for streaming: the parser sees each token as soon as the engine has
 * released its text (`released`: the sum of the events' n_text so far; text held back for a
 * possible stop string is held back from the parser too). k3_parser_take_delta on
 * k3_job_feed_parser gives the streamed deltas; after k3_job_feed_end (the DONE event's stop and
 * the final released count) k3_parser_message_json gives the message k3_job_message gives. */
typedef struct k3_job_feed k3_job_feed;
k3_status k3_job_feed_create(const k3_job *j, const k3_tokenizer *tok, bool ignore_eos,
                             k3_job_feed **out);
k3_status k3_job_feed_token(k3_job_feed *f, int32_t id, size_t released);
k3_status k3_job_feed_end(k3_job_feed *f, k3_stop_kind stop, size_t released);
k3_parser *k3_job_feed_parser(k3_job_feed *f); /* borrowed */
void k3_job_feed_destroy(k3_job_feed *f);      /* NULL-safe */

#define K3_JOB_MAX_TOP 20 /* OpenAI's largest top_logprobs (k3_engine.h: K3_EV_MAX_TOP) */
/* The chat request's "logprobs" (boolean) and "top_logprobs" (0-20, needs logprobs true):
 * *n_top = -1 when off. K3_ERR_FORMAT naming the key. */
k3_status k3_job_logprobs_keys(const k3_chat_json *doc, const char *what, int *n_top);
/* One OpenAI logprob entry {"token": <text, invalid UTF-8 replaced>, "logprob": x, "bytes": [..]
 * (without the closing brace, so a caller can add "top_logprobs"); a logprob that is not finite
 * or below -9999 is written as -9999.0, OpenAI's stand-in for an underflow. */
k3_status k3_job_logprob_entry(const k3_tokenizer *tok, int32_t id, float logprob,
                               k3_chat_buf *out);

/* A token's text as a JSON string (invalid UTF-8 replaced), and a logprob as OpenAI writes it
 * (not finite or below -9999: -9999.0). */
k3_status k3_job_token_str(const k3_tokenizer *tok, int32_t id, k3_chat_buf *out);
k3_status k3_job_logprob_num(float lp, k3_chat_buf *out);

/* One position of a /v1/completions choice's logprobs: its token, logprob (NaN: null, as an
 * echoed prompt's first token has), top entries and text offset (bytes of the choice's text
 * before it). */
typedef struct k3_job_lp_row {
    int32_t id;
    float logprob;
    int n_top;
    const int32_t *top_ids; /* [n_top] */
    const float *top_lps;   /* [n_top] */
    int64_t offset;
} k3_job_lp_row;
/* OpenAI's legacy completion logprobs {"tokens", "token_logprobs", "top_logprobs" (a token ->
 * logprob object per position, null where the logprob is), "text_offset"} of rows[n]. */
k3_status k3_job_completion_logprobs(const k3_tokenizer *tok, const k3_job_lp_row *rows, int64_t n,
                                     k3_chat_buf *out);

#endif /* K3_CHAT_JOB_H */
