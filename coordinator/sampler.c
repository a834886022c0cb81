/* sampler.c — per-sequence next-token sampling and stop detection (see k3_sampler.h for the
 * exact semantics and their order).
 *
 * Owns: work arrays sized for n_vocab at create (processed logits, candidate (p, id) pairs, token
 * counts, the list of ids with a count, the penalty ring), the PRNG, the detokenizer stream and
 * the pending (held-back) text. Nothing is allocated per token except amortised growth of the
 * caller's `emit` buffer and of the pending text.
 * Top-p never sorts the whole vocabulary: it sorts only the candidates with p >= eps, lowering eps
 * until their mass reaches top_p; every excluded id has a smaller p than every included one, so the
 * sorted prefix is the same as with a full sort. */
#include "k3_sampler.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

typedef struct cand {
    float v; /* logit, then unnormalised probability */
    int32_t id;
} cand;

struct k3_sampler {
    k3_sampler_params p; /* copies: logit_bias, stop_ids, stop_strings point into this object */
    int64_t n_vocab;
    const k3_tokenizer *tok;
    k3_rng rng;
    float *work;       /* (n_vocab) logits after bias + penalties */
    cand *cands;       /* (n_vocab) */
    int32_t *count;    /* (n_vocab) occurrences in the penalty window */
    int32_t *distinct; /* (n_vocab) ids whose count may be > 0 (compacted lazily) */
    int64_t n_distinct;
    int32_t *ring; /* (penalty_last_n) the window, when bounded */
    int64_t ring_pos, ring_fill;
    k3_logit_bias *bias; /* (n_logit_bias) */
    int32_t *stop_ids;   /* (n_stop_ids) */
    char **stop_strings; /* (n_stop_strings) */
    size_t *stop_len;    /* (n_stop_strings) */
    k3_tok_stream *stream;
    k3_tok_bytes pending; /* decoded text not yet emitted (a possible stop-string prefix) */
    bool stopped;
    int matched_stop;
    k3_matcher *gm;  /* the grammar's matcher, or NULL */
    uint64_t *gmask; /* ((n_vocab + 63) / 64) allowed ids of this step */
    bool gmask_ok;   /* gmask is this step's */
};

void k3_sampler_destroy(k3_sampler *s) {
    if (!s) return;
    free(s->work);
    free(s->cands);
    free(s->count);
    free(s->distinct);
    free(s->ring);
    free(s->bias);
    free(s->stop_ids);
    if (s->stop_strings)
        for (size_t i = 0; i < s->p.n_stop_strings; i++) free(s->stop_strings[i]);
    free(s->stop_strings);
    free(s->stop_len);
    k3_tok_stream_destroy(s->stream);
    k3_tok_bytes_free(&s->pending);
    k3_matcher_destroy(s->gm);
    free(s->gmask);
    k3_grammar_release(s->p.grammar);
    free(s);
}

static k3_status validate(const k3_sampler_params *p, int64_t n_vocab, const k3_tokenizer *tok) {
    if (n_vocab <= 0 || n_vocab > INT32_MAX)
        return K3_ERR(K3_ERR_ARG, "sampler: n_vocab %lld invalid", (long long)n_vocab);
    if (!(p->temperature >= 0) || !isfinite(p->temperature))
        return K3_ERR(K3_ERR_ARG, "sampler: temperature %g must be finite and >= 0",
                      p->temperature);
    if (p->top_k < 0) return K3_ERR(K3_ERR_ARG, "sampler: top_k %d must be >= 0", p->top_k);
    if (!(p->top_p >= 0 && p->top_p <= 1))
        return K3_ERR(K3_ERR_ARG, "sampler: top_p %g must be in (0, 1]", p->top_p);
    if (!(p->min_p >= 0 && p->min_p <= 1))
        return K3_ERR(K3_ERR_ARG, "sampler: min_p %g must be in [0, 1]", p->min_p);
    if (p->repetition_penalty != 0 && /* 0 = off (a zeroed struct) */
        (!(p->repetition_penalty >= K3_SAMPLER_MIN_REPETITION_PENALTY) ||
         !isfinite(p->repetition_penalty)))
        return K3_ERR(K3_ERR_ARG, "sampler: repetition_penalty %g must be finite and >= %g",
                      p->repetition_penalty, K3_SAMPLER_MIN_REPETITION_PENALTY);
    if (!isfinite(p->presence_penalty) || !isfinite(p->frequency_penalty))
        return K3_ERR(K3_ERR_ARG, "sampler: presence/frequency penalties must be finite");
    for (size_t i = 0; i < p->n_logit_bias; i++) {
        if (p->logit_bias[i].id < 0 || p->logit_bias[i].id >= n_vocab)
            return K3_ERR(K3_ERR_ARG, "sampler: logit_bias id %d outside the vocabulary (%lld)",
                          p->logit_bias[i].id, (long long)n_vocab);
        if (!isfinite(p->logit_bias[i].bias))
            return K3_ERR(K3_ERR_ARG, "sampler: logit_bias for id %d is not finite",
                          p->logit_bias[i].id);
    }
    for (size_t i = 0; i < p->n_stop_ids; i++)
        if (p->stop_ids[i] < 0 || p->stop_ids[i] >= n_vocab)
            return K3_ERR(K3_ERR_ARG, "sampler: stop id %d outside the vocabulary (%lld)",
                          p->stop_ids[i], (long long)n_vocab);
    if (p->grammar && k3_grammar_vocab_size_of(p->grammar) != n_vocab)
        return K3_ERR(K3_ERR_ARG,
                      "sampler: the grammar's vocabulary (%lld) is not the model's (%lld)",
                      (long long)k3_grammar_vocab_size_of(p->grammar), (long long)n_vocab);
    if (p->n_stop_strings && !tok)
        return K3_ERR(K3_ERR_ARG, "sampler: stop strings need a tokenizer to decode the text");
    for (size_t i = 0; i < p->n_stop_strings; i++)
        if (!p->stop_strings[i] || !p->stop_strings[i][0])
            return K3_ERR(K3_ERR_ARG, "sampler: stop string #%zu is empty", i);
    return K3_OK;
}

k3_status k3_sampler_create(k3_sampler **out, const k3_sampler_params *params, int64_t n_vocab,
                            const k3_tokenizer *tok) {
    *out = NULL;
    K3_TRY(validate(params, n_vocab, tok));
    k3_sampler *s = calloc(1, sizeof *s);
    if (!s) return K3_ERR(K3_ERR_NOMEM, "sampler");
    s->p = *params;
    if (s->p.grammar) k3_grammar_retain(s->p.grammar);
    if (s->p.top_p == 0) s->p.top_p = 1;
    if (s->p.repetition_penalty == 0) s->p.repetition_penalty = 1;
    s->n_vocab = n_vocab;
    s->tok = tok;
    size_t n = (size_t)n_vocab;
    s->work = malloc(n * sizeof *s->work);
    s->cands = malloc(n * sizeof *s->cands);
    s->count = calloc(n, sizeof *s->count);
    s->distinct = malloc(n * sizeof *s->distinct);
    if (s->p.penalty_last_n > 0) s->ring = malloc((size_t)s->p.penalty_last_n * sizeof *s->ring);
    s->bias = malloc((s->p.n_logit_bias + 1) * sizeof *s->bias);
    s->stop_ids = malloc((s->p.n_stop_ids + 1) * sizeof *s->stop_ids);
    s->stop_strings = calloc(s->p.n_stop_strings + 1, sizeof *s->stop_strings);
    s->stop_len = calloc(s->p.n_stop_strings + 1, sizeof *s->stop_len);
    bool ok = s->work && s->cands && s->count && s->distinct &&
              (s->p.penalty_last_n <= 0 || s->ring) && s->bias && s->stop_ids && s->stop_strings &&
              s->stop_len;
    for (size_t i = 0; ok && i < s->p.n_stop_strings; i++) {
        s->stop_strings[i] = strdup(params->stop_strings[i]);
        s->stop_len[i] = strlen(params->stop_strings[i]);
        ok = s->stop_strings[i] != NULL;
    }
    if (ok && tok) ok = k3_tok_stream_create(&s->stream, tok) == K3_OK;
    if (ok && s->p.grammar)
        ok = (s->gmask = malloc((n + 63) / 64 * sizeof *s->gmask)) != NULL &&
             k3_matcher_create(s->p.grammar, &s->gm) == K3_OK;
    if (!ok) {
        k3_sampler_destroy(s);
        return K3_ERR(K3_ERR_NOMEM, "sampler work arrays for %lld ids", (long long)n_vocab);
    }
    if (s->p.n_logit_bias) memcpy(s->bias, params->logit_bias, s->p.n_logit_bias * sizeof *s->bias);
    if (s->p.n_stop_ids)
        memcpy(s->stop_ids, params->stop_ids, s->p.n_stop_ids * sizeof *s->stop_ids);
    s->p.logit_bias = s->bias;
    s->p.stop_ids = s->stop_ids;
    s->p.stop_strings = (const char *const *)s->stop_strings;
    k3_sampler_reset(s, params->seed);
    *out = s;
    return K3_OK;
}

void k3_sampler_reset(k3_sampler *s, uint64_t seed) {
    k3_rng_seed(&s->rng, seed);
    for (int64_t i = 0; i < s->n_distinct; i++) s->count[s->distinct[i]] = 0;
    s->n_distinct = 0;
    s->ring_pos = s->ring_fill = 0;
    if (s->stream) k3_tok_stream_reset(s->stream);
    s->pending.n = 0;
    s->stopped = false;
    s->matched_stop = -1;
    s->gmask_ok = false;
    if (s->gm) { /* back to the grammar's start (a failure leaves the old matcher) */
        k3_matcher *m = NULL;
        if (k3_matcher_create(s->p.grammar, &m) == K3_OK) k3_matcher_destroy(s->gm), s->gm = m;
    }
}

/* ---- logits ------------------------------------------------------------------------------ */
/* A processed logit computed in double, kept finite: an overflow saturates at +-FLT_MAX instead of
 * becoming inf (inf - inf would be NaN later); -inf stays -inf (a banned id). */
static float sat_logit(double x) {
    if (x == -INFINITY) return -INFINITY;
    return x > FLT_MAX ? FLT_MAX : x < -FLT_MAX ? -FLT_MAX : (float)x;
}

/* Step 0: the grammar's mask (once per step) applied to out. */
static k3_status apply_grammar(k3_sampler *s, float *out) {
    if (!s->gm) return K3_OK;
    if (!s->gmask_ok) {
        K3_TRY(k3_matcher_mask(s->gm, s->gmask));
        s->gmask_ok = true;
    }
    const int64_t n = s->n_vocab;
    for (int64_t w = 0; w * 64 < n; w++) {
        uint64_t m = s->gmask[w];
        if (m == ~0ull) continue;
        int64_t end = K3_MIN(n, (w + 1) * 64);
        if (m == 0) { /* most words in a JSON state: no allowed id */
            for (int64_t i = w * 64; i < end; i++) out[i] = -INFINITY;
            continue;
        }
        for (uint64_t z = ~m; z; z &= z - 1) { /* the refused ids of a mixed word */
            int64_t i = w * 64 + __builtin_ctzll(z);
            if (i < end) out[i] = -INFINITY;
        }
    }
    return K3_OK;
}

k3_status k3_sampler_process_logits(k3_sampler *s, const float *logits, float *out) {
    memcpy(out, logits, (size_t)s->n_vocab * sizeof *out);
    K3_TRY(apply_grammar(s, out));
    for (size_t i = 0; i < s->p.n_logit_bias; i++) {
        const int32_t id = s->bias[i].id;
        out[id] = sat_logit((double)out[id] + (double)s->bias[i].bias);
    }
    const float rep = s->p.repetition_penalty, fr = s->p.frequency_penalty,
                pr = s->p.presence_penalty;
    if (rep == 1 && fr == 0 && pr == 0) return K3_OK;
    int64_t k = 0;
    for (int64_t i = 0; i < s->n_distinct; i++) { /* compacts ids whose count fell to 0 */
        int32_t id = s->distinct[i];
        int32_t c = s->count[id];
        if (c == 0) continue;
        s->distinct[k++] = id;
        double l = out[id];
        if (rep != 1) l = l > 0 ? l / rep : l * rep;
        out[id] = sat_logit(l - (double)fr * c - pr);
    }
    s->n_distinct = k;
    return K3_OK;
}

static int cmp_cand_desc(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->v > y->v) return -1;
    if (x->v < y->v) return 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* "a ranks below b" for the top-k min-heap: smaller value, or equal value and larger id. */
static inline bool cand_worse(cand a, cand b) {
    return a.v < b.v || (a.v == b.v && a.id > b.id);
}

static void heap_sift_down(cand *h, int64_t n, int64_t i) {
    cand x = h[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && cand_worse(h[c + 1], h[c])) c++;
        if (!cand_worse(h[c], x)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
}

/* Steps 1-8: candidates in s->cands[0..*n_out) with unnormalised p in .v; *total = their sum.
 * Greedy returns one candidate with v = 1. */
static k3_status build_dist(k3_sampler *s, const float *logits, int64_t *n_out, double *total) {
    K3_TRY(k3_sampler_process_logits(s, logits, s->work));
    const float *w = s->work;
    const int64_t n = s->n_vocab;
    cand *c = s->cands;
    for (int64_t i = 0; i < n; i++)
        if (isnan(w[i]))
            return K3_ERR(K3_ERR_ARG, "sampler: logit of id %lld is NaN", (long long)i);
    if (s->p.temperature == 0) { /* greedy */
        int64_t best = 0;
        for (int64_t i = 1; i < n; i++)
            if (w[i] > w[best]) best = i;
        if (w[best] == -INFINITY)
            return K3_ERR(K3_ERR_ARG, "sampler: every candidate logit is -inf");
        c[0] = (cand){1.0f, (int32_t)best};
        *n_out = 1;
        *total = 1.0;
        return K3_OK;
    }
    int64_t m;
    if (s->p.top_k > 0 && s->p.top_k < n) { /* k best with a min-heap: O(n log k) */
        m = s->p.top_k;
        for (int64_t i = 0; i < m; i++) c[i] = (cand){w[i], (int32_t)i};
        for (int64_t i = m / 2 - 1; i >= 0; i--) heap_sift_down(c, m, i);
        for (int64_t i = m; i < n; i++) {
            cand x = {w[i], (int32_t)i};
            if (cand_worse(c[0], x)) {
                c[0] = x;
                heap_sift_down(c, m, 0);
            }
        }
    } else {
        m = n;
        for (int64_t i = 0; i < n; i++) c[i] = (cand){w[i], (int32_t)i};
    }
    float mx = -INFINITY;
    for (int64_t i = 0; i < m; i++) mx = c[i].v > mx ? c[i].v : mx;
    if (mx == -INFINITY) return K3_ERR(K3_ERR_ARG, "sampler: every candidate logit is -inf");
    /* softmax(l / t) with the max subtracted first, in double: (l - mx) / t is <= 0 and finite for
     * every finite l even when 1/t would overflow a float (t ~ 1e-39: the limit is greedy, ties
     * sharing the mass); a +inf logit (raw input) takes all the mass, shared with other +infs. */
    const double temp = s->p.temperature;
    double sum = 0;
    for (int64_t i = 0; i < m; i++) {
        double d =
            mx == INFINITY ? (c[i].v == INFINITY ? 0 : -INFINITY) : ((double)c[i].v - mx) / temp;
        c[i].v = (float)exp(d);
        sum += c[i].v;
    }
    if (s->p.top_p < 1) {
        /* Move candidates with p >= eps to the front until their mass reaches top_p * sum. */
        const double target = (double)s->p.top_p * sum;
        double eps = 1e-3, got = 0;
        int64_t k = 0;
        for (;;) {
            k = 0;
            got = 0;
            for (int64_t i = 0; i < m; i++)
                if (c[i].v >= eps || eps == 0) {
                    cand t = c[k];
                    c[k] = c[i];
                    c[i] = t;
                    got += c[k].v;
                    k++;
                }
            if (got >= target || eps == 0) break;
            eps = eps > 1e-30 ? eps * 1e-3 : 0;
        }
        qsort(c, (size_t)k, sizeof *c, cmp_cand_desc);
        double cum = 0;
        int64_t keep = 0;
        while (keep < k) {
            cum += c[keep].v;
            keep++;
            if (cum >= target) break;
        }
        m = keep;
        sum = cum;
    }
    if (s->p.min_p > 0) {
        float pmax = 0;
        for (int64_t i = 0; i < m; i++) pmax = c[i].v > pmax ? c[i].v : pmax;
        const float thr = s->p.min_p * pmax;
        int64_t k = 0;
        sum = 0;
        for (int64_t i = 0; i < m; i++)
            if (c[i].v >= thr) {
                c[k++] = c[i];
                sum += c[i].v;
            }
        m = k;
    }
    *n_out = m;
    *total = sum;
    return K3_OK;
}

k3_status k3_sampler_probs(k3_sampler *s, const float *logits, float *probs) {
    int64_t m;
    double total;
    K3_TRY(build_dist(s, logits, &m, &total));
    memset(probs, 0, (size_t)s->n_vocab * sizeof *probs);
    for (int64_t i = 0; i < m; i++) probs[s->cands[i].id] = (float)(s->cands[i].v / total);
    return K3_OK;
}

k3_status k3_sampler_sample(k3_sampler *s, const float *logits, int32_t *out_id) {
    int64_t m;
    double total;
    K3_TRY(build_dist(s, logits, &m, &total));
    if (m == 1) {
        *out_id = s->cands[0].id;
        return K3_OK;
    }
    double u = k3_rng_uniform(&s->rng) * total, cum = 0;
    for (int64_t i = 0; i < m; i++) {
        cum += s->cands[i].v;
        if (u < cum) {
            *out_id = s->cands[i].id;
            return K3_OK;
        }
    }
    /* Rounding left u >= cum: take the last candidate with non-zero mass. */
    for (int64_t i = m - 1; i >= 0; i--)
        if (s->cands[i].v > 0) {
            *out_id = s->cands[i].id;
            return K3_OK;
        }
    *out_id = s->cands[0].id;
    return K3_OK;
}

/* ---- history and stops -------------------------------------------------------------------- */
static void history_add(k3_sampler *s, int32_t id) {
    if (s->p.penalty_last_n > 0) {
        int64_t cap = s->p.penalty_last_n;
        if (s->ring_fill == cap)
            s->count[s->ring[s->ring_pos]]--; /* evict the oldest */
        else
            s->ring_fill++;
        s->ring[s->ring_pos] = id;
        s->ring_pos = (s->ring_pos + 1) % cap;
    }
    if (s->count[id]++ == 0) {
        /* A re-added id may still sit in `distinct` (not compacted yet): look before appending. */
        bool present = false;
        for (int64_t i = s->n_distinct - 1; i >= 0 && s->p.penalty_last_n > 0; i--)
            if (s->distinct[i] == id) {
                present = true;
                break;
            }
        if (!present) s->distinct[s->n_distinct++] = id;
    }
}

k3_status k3_sampler_accept_prompt(k3_sampler *s, const int32_t *ids, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= s->n_vocab)
            return K3_ERR(K3_ERR_ARG, "sampler: prompt id %d outside the vocabulary", ids[i]);
    for (size_t i = 0; i < n; i++) history_add(s, ids[i]);
    return K3_OK;
}

/* Look for a stop string in pending; emit what is safe. `final`: hold nothing back. */
static k3_status scan_pending(k3_sampler *s, bool final, k3_tok_bytes *emit, k3_stop_kind *stop) {
    const char *d = s->pending.data;
    size_t n = s->pending.n;
    size_t best_at = SIZE_MAX;
    int best = -1;
    for (size_t i = 0; i < s->p.n_stop_strings && n; i++) {
        const char *hit = memmem(d, n, s->stop_strings[i], s->stop_len[i]);
        if (hit && (size_t)(hit - d) < best_at) {
            best_at = (size_t)(hit - d);
            best = (int)i;
        }
    }
    if (best >= 0) {
        if (emit) K3_TRY(k3_tok_bytes_append(emit, d, best_at));
        s->pending.n = 0;
        s->stopped = true;
        s->matched_stop = best;
        *stop = K3_STOP_STRING;
        return K3_OK;
    }
    size_t hold = 0;
    if (!final)
        for (size_t i = 0; i < s->p.n_stop_strings; i++) {
            size_t L = s->stop_len[i] - 1 < n ? s->stop_len[i] - 1 : n;
            for (size_t h = L; h > hold; h--)
                if (!memcmp(d + n - h, s->stop_strings[i], h)) {
                    hold = h;
                    break;
                }
        }
    if (emit) K3_TRY(k3_tok_bytes_append(emit, d, n - hold));
    memmove(s->pending.data, d + n - hold, hold);
    s->pending.n = hold;
    return K3_OK;
}

k3_status k3_sampler_accept(k3_sampler *s, int32_t id, k3_tok_bytes *emit, k3_stop_kind *stop) {
    *stop = K3_STOP_NONE;
    if (s->stopped) return K3_ERR(K3_ERR_STATE, "sampler: accept after the sequence stopped");
    if (id < 0 || id >= s->n_vocab)
        return K3_ERR(K3_ERR_ARG, "sampler: id %d outside the vocabulary (%lld)", id,
                      (long long)s->n_vocab);
    if (s->gm) {
        K3_TRY(k3_matcher_accept(s->gm, id));
        s->gmask_ok = false;
    }
    history_add(s, id);
    for (size_t i = 0; i < s->p.n_stop_ids; i++)
        if (s->stop_ids[i] == id) {
            K3_TRY(k3_sampler_finish(s, emit));
            s->stopped = true;
            *stop = K3_STOP_ID;
            return K3_OK;
        }
    if (!s->stream || (s->p.skip_special && k3_tok_is_special(s->tok, id))) return K3_OK;
    K3_TRY(k3_tok_stream_push(s->stream, id, &s->pending));
    return scan_pending(s, false, emit, stop);
}

k3_status k3_sampler_finish(k3_sampler *s, k3_tok_bytes *emit) {
    if (!s->stream || s->stopped) return K3_OK;
    K3_TRY(k3_tok_stream_finish(s->stream, &s->pending));
    k3_stop_kind st = K3_STOP_NONE;
    return scan_pending(s, true, emit, &st);
}

int k3_sampler_matched_stop(const k3_sampler *s) {
    return s->matched_stop;
}
