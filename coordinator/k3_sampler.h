/* k3_sampler — next-token sampling and stop detection for one sequence, on the coordinator.
 *
 * Owns: the per-sequence sampling state: parameters, the PRNG (k3_rng, seeded: same seed + same
 * logits -> same tokens), the penalty history (token counts), work arrays preallocated for the
 * vocabulary (no allocation per token), the streaming detokenizer and the stop-string matcher.
 * Callers must not: share one sampler between sequences or threads, or modify `logits` semantics
 * (they are raw LM-head outputs, one float per id, n_vocab of them).
 *
 * Semantics (documented choices; vLLM / HF order — temperature BEFORE the truncations):
 *  0. grammar (k3_grammar.h, structured outputs): ids the grammar does not allow here get -inf;
 *     the mask is computed once per step (at the first use after an accept) and every accepted
 *     id advances the grammar (an id it refuses is K3_ERR_ARG: the request fails).
 *  1. logit_bias: l[id] += bias (OpenAI logit_bias; any finite value accepted).
 *  2. repetition_penalty r (CTRL / HF / llama.cpp): for every id seen in the penalty window,
 *     l = l > 0 ? l / r : l * r (r >= K3_SAMPLER_MIN_REPETITION_PENALTY). Steps 1-3 compute in
 *     double and saturate at +-FLT_MAX, so a processed logit is never +-inf unless the input was
 *     (-inf = banned id).
 *  3. presence / frequency (OpenAI): l -= frequency * count + presence * (count > 0), count = the
 *     id's occurrences in the penalty window.
 *     Penalty window = every id passed to k3_sampler_accept / _accept_prompt (prompt ids count only
 *     if the caller passes them), or only the last `penalty_last_n` of them when > 0.
 *  4. temperature == 0 -> greedy: argmax (lowest id on ties); steps 5-8 are skipped.
 *  5. top_k > 0: keep the k largest logits (ties at the boundary broken by lower id).
 *  6. p = softmax(l / temperature) over the kept ids, as exp((l - max) / t) in double: a tiny
 *     temperature (1/t overflowing a float) tends to greedy (ties share the mass), never NaN.
 *  7. top_p < 1: sort kept ids by p descending (id ascending on ties), keep the shortest prefix
 *     whose cumulative p >= top_p (at least one id).
 *  8. min_p > 0: keep ids with p >= min_p * max(p) (on the tempered p of step 6).
 *  9. Renormalise and draw u in [0,1) from k3_rng; pick the first id whose cumulative p > u.
 * Stop: an accepted id in stop_ids ends the sequence (its text is not emitted). Stop strings are
 * matched on the decoded UTF-8 text stream, across token boundaries; text that could still be the
 * start of a stop string is held back; on a match the text before the match is emitted and the
 * rest dropped. */
#ifndef K3_SAMPLER_H
#define K3_SAMPLER_H

#include "k3_base.h"
#include "k3_grammar.h"
#include "k3_tokenizer.h"

typedef struct k3_sampler k3_sampler;

/* The smallest repetition penalty accepted: l / r then stays a sane logit (|l| <= 1e4 gives
 * <= 1e8); smaller values are rejected at validation rather than overflowing to inf. */
#define K3_SAMPLER_MIN_REPETITION_PENALTY 1e-4f

typedef struct k3_logit_bias {
    int32_t id;
    float bias;
} k3_logit_bias;

typedef struct k3_sampler_params {
    float temperature;               /* 0 = greedy; must be >= 0 and finite                      */
    int32_t top_k;                   /* 0 = off                                                   */
    float top_p;                     /* (0, 1]; 1 = off. 0 in a zeroed struct is read as 1 (off)  */
    float min_p;                     /* [0, 1]; 0 = off                                           */
    float repetition_penalty;        /* >= K3_SAMPLER_MIN_REPETITION_PENALTY, finite; 1 = off.
                                      * 0 in a zeroed struct is read as 1 (off)                  */
    float presence_penalty;          /* OpenAI range [-2, 2]; 0 = off                            */
    float frequency_penalty;         /* OpenAI range [-2, 2]; 0 = off                            */
    int32_t penalty_last_n;          /* > 0: window of the last n accepted ids; <= 0: all of them */
    const k3_logit_bias *logit_bias; /* (n_logit_bias) copied at create                      */
    size_t n_logit_bias;
    uint64_t seed;
    const int32_t *stop_ids; /* (n_stop_ids) copied                                       */
    size_t n_stop_ids;
    const char *const *stop_strings; /* (n_stop_strings) NUL-terminated UTF-8, copied        */
    size_t n_stop_strings;
    k3_grammar *grammar; /* NULL = unconstrained; retained by the sampler (its vocabulary size
                            must equal n_vocab) */
    bool skip_special;   /* special tokens add no text (vLLM's skip_special_tokens); they still
                            count as tokens and stop ids still stop */
} k3_sampler_params;

/* `tok` may be NULL when no text is needed (then stop strings are rejected and _accept emits no
 * text); it is borrowed and must outlive the sampler. n_vocab = logits per step. */
k3_status k3_sampler_create(k3_sampler **out, const k3_sampler_params *p, int64_t n_vocab,
                            const k3_tokenizer *tok);
void k3_sampler_destroy(k3_sampler *s);
/* Forget history, held text and stop state; reseed with `seed`. */
void k3_sampler_reset(k3_sampler *s, uint64_t seed);

/* Steps 1-3 (bias + penalties) into out[n_vocab]; for tests and logprobs. */
k3_status k3_sampler_process_logits(k3_sampler *s, const float *logits, float *out);
/* Steps 1-8: the final distribution in probs[n_vocab] (0 for removed ids; one-hot when greedy). */
k3_status k3_sampler_probs(k3_sampler *s, const float *logits, float *probs);
/* Steps 1-9: choose the next id. Does not change the history (call _accept with the result). */
k3_status k3_sampler_sample(k3_sampler *s, const float *logits, int32_t *out_id);

typedef enum k3_stop_kind {
    K3_STOP_NONE = 0,
    K3_STOP_ID,     /* the accepted id is a stop id */
    K3_STOP_STRING, /* a stop string appeared in the text */
} k3_stop_kind;

/* Record a generated id: penalty history, stop ids, detokenize, stop strings. Text safe to show is
 * APPENDED to `emit` (may be NULL when tok is NULL). After a stop, further accepts are
 * K3_ERR_STATE. On K3_STOP_ID the held text (if any) is flushed to `emit` first. */
k3_status k3_sampler_accept(k3_sampler *s, int32_t id, k3_tok_bytes *emit, k3_stop_kind *stop);
/* Add prompt ids to the penalty history only (no text, no stop checks). */
k3_status k3_sampler_accept_prompt(k3_sampler *s, const int32_t *ids, size_t n);
/* End of generation without a stop (length limit): flush held text (incomplete UTF-8 -> U+FFFD). */
k3_status k3_sampler_finish(k3_sampler *s, k3_tok_bytes *emit);
/* The stop string that matched (index into params.stop_strings), or -1. */
int k3_sampler_matched_stop(const k3_sampler *s);

#endif /* K3_SAMPLER_H */
