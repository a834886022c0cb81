/* k3_tokenizer — the tiktoken-style BPE tokenizer of the coordinator (spec/K3-CHAT.md §4).
 *
 * Owns: the rank table (bytes <-> rank, from a `tiktoken.model` / `.tiktoken` file), the special
 * tokens (id <-> content), the PCRE2 pre-tokenizer (K3 regex by default; o200k/cl100k for tests),
 * the Kimi chunking of §4.4, BPE per piece (§4.3), special-token scanning (§4.5), per-segment
 * encoding (§4.6), decoding and a streaming UTF-8-safe detokenizer (§4.7).
 * Callers must not: render a chat to one string and encode it with specials allowed (encode the
 * segments: user text must never yield control ids), hard-code special ids (look them up by
 * content: a tiny model's ids are not 163586...), or modify a tokenizer after creation.
 *
 * Invariants:
 *  - A k3_tokenizer is immutable after _create; every function taking `const k3_tokenizer *` is
 *    thread-safe (scratch is per call).
 *  - Input text must be valid UTF-8 (what tiktoken's `str` guarantees). Invalid UTF-8 is rejected
 *    with K3_ERR_ARG naming the byte offset; nothing is replaced silently. Every text carries its
 *    length: U+0000 is an ordinary character (byte 0), as in tiktoken.
 *  - The pre-tokenizer splits as tiktoken 0.14 does over all of Unicode (its regex crate's
 *    Unicode 16.0 classes, whatever the PCRE2 library's tables; tests/tokenizer/unicode_sweep.py).
 *  - encode(text, allow_special=false) never yields a special id.
 *  - For valid UTF-8 `s`: decode(encode(s, any)) == s byte for byte.
 *  - Ids are int32_t; ordinary ids are ranks (0..n_ranks-1), specials sit past them. */
#ifndef K3_TOKENIZER_H
#define K3_TOKENIZER_H

#include "k3_base.h"

typedef struct k3_tokenizer k3_tokenizer;

/* Pre-tokenizer patterns. K3 is the PCRE2 rewrite of §4.2 (class intersection spelled with
 * lookaheads). O200K / CL100K are tiktoken's `pat_str` of those encodings (tests only). */
typedef enum k3_tok_pattern {
    K3_TOK_PAT_K3 = 0,
    K3_TOK_PAT_O200K,
    K3_TOK_PAT_CL100K,
} k3_tok_pattern;

/* Parse "k3" | "o200k" | "cl100k". */
k3_status k3_tok_pattern_from_name(const char *name, k3_tok_pattern *out);

typedef struct k3_tok_special {
    const char *content; /* the token's text, e.g. "<|open|>" (NUL-terminated, copied at create) */
    int32_t id;
} k3_tok_special;

typedef struct k3_tok_options {
    k3_tok_pattern pattern; /* default (zero) = K3 */
    /* Apply the Kimi chunking of §4.4 (400,000 code points; runs > 25,000 whitespace /
     * non-whitespace split). tokenization_kimi.py does it, raw tiktoken does not.
     * The zero value means ON; set `no_kimi_chunking` to get raw tiktoken behaviour. */
    bool no_kimi_chunking;
    /* Spell the pattern's Unicode classes as explicit code point ranges even where PCRE2's own
     * tables fit (tests compare the two spellings; both give the classes of Unicode 16.0, the
     * version of tiktoken 0.14's regex crate). Slower on non-Latin text. */
    bool explicit_unicode_classes;
} k3_tok_options;

/* The K3 special-token layout of §4.1 relative to `base` (the first special id; 163584 in the real
 * model): [BOS] [EOS] <|end_of_msg|> <|open|> <|close|> <|sep|> [start_header_id] [end_header_id]
 * [EOT] media_*, <osagent_mode>, [UNK], [PAD], and <|reserved_token_{id}|> in every other of the
 * 256 slots. Returns a new array the caller frees with k3_tok_specials_free. */
#define K3_TOK_N_K3_SPECIALS 256
k3_status k3_tok_k3_specials(int32_t base, k3_tok_special **out, size_t *n_out);
void k3_tok_specials_free(k3_tok_special *sp, size_t n);
/* The first K3 special-token text of that layout found in s[0..n_bytes) (any of the named slots,
 * or a "<|reserved_token_" prefix), as a static string naming it; NULL when there is none. Needs
 * no loaded tokenizer: request validation uses it to refuse names that hold control-token text. */
const char *k3_tok_k3_special_in(const char *s, size_t n_bytes);

/* Load a tiktoken rank file ("<base64> <rank>" per line). `specials` (may be NULL with n = 0)
 * are copied. specials == NULL && n_specials == SIZE_MAX means "K3 layout at max_rank + 1". */
k3_status k3_tok_create_tiktoken(k3_tokenizer **out, const char *path,
                                 const k3_tok_special *specials, size_t n_specials,
                                 const k3_tok_options *opts /* NULL = defaults */);
#define K3_TOK_K3_LAYOUT SIZE_MAX
/* Load a model directory: DIR/tiktoken.model + DIR/tokenizer_config.json (`added_tokens_decoder`:
 * id -> {"content": ...}). Without tokenizer_config.json the K3 layout past the last rank is used
 * (logged as a warning). */
k3_status k3_tok_create_model_dir(k3_tokenizer **out, const char *dir,
                                  const k3_tok_options *opts /* NULL = defaults */);
void k3_tok_destroy(k3_tokenizer *t);

/* ---- queries -------------------------------------------------------------------------- */
int64_t k3_tok_n_vocab(const k3_tokenizer *t); /* max(id) + 1 over ranks and specials */
int64_t k3_tok_n_ranks(const k3_tokenizer *t); /* max rank + 1 */
/* True when the pre-tokenizer spells its Unicode classes as explicit ranges (PCRE2's tables are of
 * another Unicode version than [14.0, 16.0], or k3_tok_options.explicit_unicode_classes). */
bool k3_tok_explicit_classes(const k3_tokenizer *t);
/* Id of a special token by content ("<|open|>"); -1 if the tokenizer has none. */
int32_t k3_tok_special_id(const k3_tokenizer *t, const char *content);
bool k3_tok_is_special(const k3_tokenizer *t, int32_t id);
/* The K3 control ids, looked up by content (-1 where absent). */
typedef struct k3_tok_ctrl {
    int32_t open;       /* <|open|>       */
    int32_t close;      /* <|close|>      */
    int32_t sep;        /* <|sep|>        */
    int32_t end_of_msg; /* <|end_of_msg|> : the stop token */
    int32_t eos;        /* [EOS]          : also a stop     */
} k3_tok_ctrl;
k3_tok_ctrl k3_tok_control_ids(const k3_tokenizer *t);
/* The bytes of one id (a special decodes to its content). Borrowed, valid while `t` lives.
 * K3_ERR_ARG for an id that is neither a rank nor a special. */
k3_status k3_tok_id_bytes(const k3_tokenizer *t, int32_t id, const char **bytes, size_t *n_bytes);

/* ---- growable outputs ------------------------------------------------------------------ */
typedef struct k3_tok_ids {
    int32_t *ids; /* (n) */
    size_t n, cap;
} k3_tok_ids;
void k3_tok_ids_free(k3_tok_ids *v); /* frees and zeroes; NULL-safe */

typedef struct k3_tok_bytes {
    char *data; /* (n + 1): always NUL-terminated when non-NULL */
    size_t n, cap;
} k3_tok_bytes;
void k3_tok_bytes_free(k3_tok_bytes *b);
/* Append n bytes (keeps the NUL terminator); K3_ERR_NOMEM on failure. */
k3_status k3_tok_bytes_append(k3_tok_bytes *b, const char *p, size_t n);

/* ---- encoding -------------------------------------------------------------------------- */
/* Encode `text` and APPEND the ids to `out`. allow_special = true: every special string (longest
 * match at each position) becomes its id and the text between is BPE'd (tiktoken
 * allowed_special="all"). allow_special = false: specials are plain text (disallowed_special=()).
 */
k3_status k3_tok_encode(const k3_tokenizer *t, const char *text, size_t n_bytes, bool allow_special,
                        k3_tok_ids *out);

/* One segment of a rendered chat (what the chat builder produces; §4.6). */
typedef struct k3_tok_segment {
    const char *text;
    size_t n_bytes;
    bool allow_special; /* true for control segments (markers, image prompts) */
} k3_tok_segment;
/* ids = concat(encode(seg[i].text, seg[i].allow_special)), appended to `out`. */
k3_status k3_tok_encode_segments(const k3_tokenizer *t, const k3_tok_segment *segs, size_t n_segs,
                                 k3_tok_ids *out);

/* The pre-tokenizer alone: the regex pieces of `text` (no specials, no chunking), appended as
 * [start, end) byte offsets: out[2i] = start, out[2i+1] = end. *n_pieces counts all pieces. */
k3_status k3_tok_split(const k3_tokenizer *t, const char *text, size_t n_bytes, size_t **offsets,
                       size_t *n_pieces);

/* ---- decoding -------------------------------------------------------------------------- */
/* Raw bytes of the ids, appended (may be invalid UTF-8 if the ids split a character). */
k3_status k3_tok_decode_bytes(const k3_tokenizer *t, const int32_t *ids, size_t n,
                              k3_tok_bytes *out);
/* UTF-8 text of the ids, appended: invalid sequences become U+FFFD exactly like Python's
 * bytes.decode("utf-8", errors="replace") (one U+FFFD per maximal invalid subpart). */
k3_status k3_tok_decode(const k3_tokenizer *t, const int32_t *ids, size_t n, k3_tok_bytes *out);
/* Append bytes as UTF-8 with Python "replace" semantics (the helper behind k3_tok_decode). */
k3_status k3_tok_utf8_replace(const char *bytes, size_t n, k3_tok_bytes *out);

/* Streaming detokenizer: push ids one at a time; each push appends only complete, valid UTF-8 to
 * `out`; an incomplete trailing sequence is held for the next push. _finish flushes a held
 * incomplete sequence as U+FFFD. The concatenation of all outputs equals k3_tok_decode(all ids).
 * No allocation per push beyond growing `out`. */
typedef struct k3_tok_stream k3_tok_stream;
k3_status k3_tok_stream_create(k3_tok_stream **out, const k3_tokenizer *t);
void k3_tok_stream_destroy(k3_tok_stream *s);
k3_status k3_tok_stream_push(k3_tok_stream *s, int32_t id, k3_tok_bytes *out);
k3_status k3_tok_stream_push_bytes(k3_tok_stream *s, const char *bytes, size_t n,
                                   k3_tok_bytes *out);
k3_status k3_tok_stream_finish(k3_tok_stream *s, k3_tok_bytes *out);
void k3_tok_stream_reset(k3_tok_stream *s);

#endif /* K3_TOKENIZER_H */
