/* tokenizer_decode.c — ids -> bytes / text, and the streaming detokenizer (spec/K3-CHAT.md §4.7).
 *
 * Owns: decoding (special ids decode to their content), UTF-8 repair with Python's
 * errors="replace" semantics (one U+FFFD per maximal invalid subpart, as in Unicode's
 * "substitution of maximal subparts", which CPython follows), and k3_tok_stream, which holds an
 * incomplete trailing sequence (at most 3 bytes) between pushes.
 * Invariant: the concatenation of every stream output + finish equals k3_tok_decode of all ids. */
#include "k3_tokenizer.h"
#include "tokenizer_internal.h"

#include <stdlib.h>

static const char REPLACEMENT[3] = {(char)0xEF, (char)0xBF, (char)0xBD}; /* U+FFFD */

k3_status k3_tok_decode_bytes(const k3_tokenizer *t, const int32_t *ids, size_t n,
                              k3_tok_bytes *out) {
    size_t n0 = out->n;
    for (size_t i = 0; i < n; i++) {
        const char *b;
        size_t nb;
        k3_status st = k3_tok_id_bytes(t, ids[i], &b, &nb);
        if (st == K3_OK) st = k3_tok_bytes_append(out, b, nb);
        if (st != K3_OK) {
            out->n = n0;
            if (out->data) out->data[n0] = 0;
            return st;
        }
    }
    return k3_tok_bytes_reserve(out, 0); /* keep the NUL terminator invariant for n == 0 */
}

/* Process s[0..n): append valid sequences and U+FFFD for invalid subparts. When !final an
 * incomplete sequence at the end is not consumed; *consumed says how far we got. */
static k3_status utf8_repair(const uint8_t *s, size_t n, bool final, k3_tok_bytes *out,
                             size_t *consumed) {
    K3_TRY(k3_tok_bytes_reserve(out, n + 8));
    size_t i = 0;
    while (i < n) {
        size_t run = i; /* copy runs of valid text in one go */
        while (run < n) {
            if (s[run] < 0x80) {
                run++;
                continue;
            }
            int len = k3_utf8_next(s + run, n - run, NULL);
            if (len <= 0) break;
            run += (size_t)len;
        }
        if (run > i) {
            K3_TRY(k3_tok_bytes_append(out, (const char *)s + i, run - i));
            i = run;
            continue;
        }
        int r = k3_utf8_next(s + i, n - i, NULL);
        if (r == 0 && !final) break; /* incomplete at the end: wait for more bytes */
        K3_TRY(k3_tok_bytes_append(out, REPLACEMENT, 3));
        i += r < 0 ? (size_t)-r : n - i; /* an invalid subpart, or a truncated tail */
    }
    *consumed = i;
    return K3_OK;
}

k3_status k3_tok_utf8_replace(const char *bytes, size_t n, k3_tok_bytes *out) {
    size_t used;
    return utf8_repair((const uint8_t *)bytes, n, true, out, &used);
}

k3_status k3_tok_decode(const k3_tokenizer *t, const int32_t *ids, size_t n, k3_tok_bytes *out) {
    k3_tok_bytes raw = {0};
    k3_status st = k3_tok_decode_bytes(t, ids, n, &raw);
    if (st == K3_OK) st = k3_tok_utf8_replace(raw.data, raw.n, out);
    k3_tok_bytes_free(&raw);
    return st;
}

/* ---- streaming ----------------------------------------------------------------------------- */
struct k3_tok_stream {
    const k3_tokenizer *t;
    uint8_t held[4]; /* a valid but incomplete prefix of one sequence */
    size_t n_held;
};

k3_status k3_tok_stream_create(k3_tok_stream **out, const k3_tokenizer *t) {
    *out = calloc(1, sizeof **out);
    if (!*out) return K3_ERR(K3_ERR_NOMEM, "token stream");
    (*out)->t = t;
    return K3_OK;
}

void k3_tok_stream_destroy(k3_tok_stream *s) {
    free(s);
}

void k3_tok_stream_reset(k3_tok_stream *s) {
    s->n_held = 0;
}

k3_status k3_tok_stream_push_bytes(k3_tok_stream *s, const char *bytes, size_t n,
                                   k3_tok_bytes *out) {
    const uint8_t *p = (const uint8_t *)bytes;
    size_t i = 0;
    K3_TRY(k3_tok_bytes_reserve(out, n + 8));
    /* Complete (or reject) the held prefix byte by byte. */
    while (s->n_held > 0 && i < n) {
        s->held[s->n_held++] = p[i++];
        int r = k3_utf8_next(s->held, s->n_held, NULL);
        if (r == 0) continue;
        if (r > 0) {
            K3_TRY(k3_tok_bytes_append(out, (const char *)s->held, (size_t)r));
            s->n_held = 0;
            continue;
        }
        /* Invalid: the held prefix is a maximal subpart; the new byte starts afresh. */
        K3_TRY(k3_tok_bytes_append(out, REPLACEMENT, 3));
        s->n_held = 0;
        i--; /* reprocess the new byte below */
        break;
    }
    if (s->n_held > 0) return K3_OK; /* all input went into the held prefix */
    size_t used = 0;
    K3_TRY(utf8_repair(p + i, n - i, false, out, &used));
    i += used;
    K3_ASSERT(n - i <= 3);
    memcpy(s->held, p + i, n - i);
    s->n_held = n - i;
    return K3_OK;
}

k3_status k3_tok_stream_push(k3_tok_stream *s, int32_t id, k3_tok_bytes *out) {
    const char *b;
    size_t nb;
    K3_TRY(k3_tok_id_bytes(s->t, id, &b, &nb));
    return k3_tok_stream_push_bytes(s, b, nb, out);
}

k3_status k3_tok_stream_finish(k3_tok_stream *s, k3_tok_bytes *out) {
    K3_TRY(k3_tok_bytes_reserve(out, 4));
    if (s->n_held > 0) K3_TRY(k3_tok_bytes_append(out, REPLACEMENT, 3));
    s->n_held = 0;
    return K3_OK;
}
