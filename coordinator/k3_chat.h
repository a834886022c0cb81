/* chat — OpenAI-style request -> K3 prompt segments, and the canonical JSON reader/writer.
 *
 * Owns: the port of the official K3 encoder `build_chat_segments` (spec/K3-CHAT.md §1), the
 * request normalisation of §5.1 (thinking switches, effort, developer role), and a small JSON
 * DOM with Python `json` semantics (§5.4): numbers keep their lexeme (big ints stay exact),
 * floats print as Python repr, objects keep insertion order (duplicate keys: first position,
 * last value, like a Python dict), strings may hold NUL.
 * Callers must not: render a prompt to one string and re-tokenise it with specials allowed
 * (§5.6) — encode each segment on its own, control segments with specials allowed, text
 * segments without; edit a k3_chat_json tree they did not build.
 * Where the llama.cpp template and the official encoder differ (§5), this follows the official
 * encoder; each such place says so in a comment and has a test (tests/chat/). */
#ifndef K3_CHAT_H
#define K3_CHAT_H

#include "k3_base.h"
#include "k3_tokenizer.h"

/* ---- growable byte buffer (always NUL-terminated once non-empty) --------------------- */
typedef struct k3_chat_buf {
    char *p;
    size_t n, cap; /* bytes used / allocated */
} k3_chat_buf;
k3_status k3_chat_buf_put(k3_chat_buf *b, const void *s, size_t n_bytes);
k3_status k3_chat_buf_puts(k3_chat_buf *b, const char *s);
void k3_chat_buf_free(k3_chat_buf *b);

/* ---- JSON with Python json.loads / json.dumps semantics ---------------------------------- */
typedef enum {
    K3_JSON_NULL,
    K3_JSON_BOOL,
    K3_JSON_INT,    /* exact: `s` holds the canonical decimal lexeme ("-0" becomes "0") */
    K3_JSON_FLOAT,  /* `f` holds the double (NaN/Infinity accepted, like Python) */
    K3_JSON_STRING, /* `s`/`n` hold UTF-8 bytes (may contain NUL) */
    K3_JSON_ARRAY,
    K3_JSON_OBJECT
} k3_json_kind;

typedef struct k3_chat_json k3_chat_json;
struct k3_chat_json {
    k3_json_kind kind;
    bool b;               /* BOOL */
    double f;             /* FLOAT */
    char *s;              /* STRING bytes or INT lexeme, NUL-terminated */
    size_t n;             /* (bytes of s) */
    size_t n_items;       /* ARRAY elements / OBJECT members */
    k3_chat_json **items; /* (n_items) ARRAY elements or OBJECT values, in order */
    k3_chat_json **keys;  /* (n_items) OBJECT keys as STRING nodes; NULL for arrays */
};

/* Parse `n_bytes` of JSON text. `what` names the source in error messages ("request",
 * "messages[2].tool_calls[0].function.arguments"). Rejects what json.loads rejects, plus
 * invalid UTF-8, lone surrogates and nesting deeper than 500. */
k3_status k3_chat_json_parse(const char *text, size_t n_bytes, const char *what,
                             k3_chat_json **out);
void k3_chat_json_free(k3_chat_json *v); /* NULL-safe */
/* Member of an object (last value for duplicate keys); NULL if absent or `obj` is not an object. */
const k3_chat_json *k3_chat_json_get(const k3_chat_json *obj, const char *key);
/* The same for a key of n bytes (which may hold NUL). */
const k3_chat_json *k3_chat_json_get_n(const k3_chat_json *obj, const char *key, size_t n);
/* Python truthiness (None, False, 0, 0.0, "", [], {} are false). NULL counts as absent: false. */
bool k3_chat_json_truthy(const k3_chat_json *v);
bool k3_chat_json_is_str(const k3_chat_json *v, const char *s); /* v is the string s */

enum {
    K3_JSON_SORT_KEYS = 1, /* sort object keys by code point at every level (Python sorted) */
    K3_JSON_COMPACT = 2,   /* separators ("," ":") instead of json.dumps' default (", " ": ") */
};
/* json.dumps(v, ensure_ascii=False, ...) appended to `out`. Never fails on a valid tree except
 * for memory. */
k3_status k3_chat_json_dump(const k3_chat_json *v, int flags, k3_chat_buf *out);
/* json.dumps of one string (quotes + escapes of `"`, `\\`, and controls < 0x20). */
k3_status k3_chat_json_dump_str(const char *s, size_t n_bytes, k3_chat_buf *out);
/* Python repr(float) as json.dumps writes it: 1.0, 100000.0, 1e+16, 1e-05, NaN, -Infinity. */
void k3_chat_json_float_repr(double f, char out[32]);

/* ---- request -> prompt ------------------------------------------------------------------ */
typedef struct k3_chat_request k3_chat_request; /* opaque: parsed + normalised request */

/* Parse and normalise an OpenAI-style chat request (messages, tools, tool_choice,
 * response_format, thinking switches). Request normalisation (§5.1):
 *   thinking = chat_template_kwargs.thinking ?? chat_template_kwargs.enable_thinking
 *              ?? thinking ?? true;  reasoning_effort == "none" => thinking off;
 *   effort   = chat_template_kwargs.thinking_effort ?? thinking_effort ?? reasoning_effort
 *              ?? "max", which must be low|high|max when thinking is on (`??` skips absent AND
 *              null keys: "thinking_effort": null means the default).
 * vLLM's chat-endpoint keys: add_generation_prompt (default true): append the assistant opener;
 * continue_final_message (default false): leave the final message, which must be an assistant
 * message without tool_calls, open in the §1.8 form (inferred: the official encoder cannot
 * continue); refused together with add_generation_prompt true, so it needs an explicit
 * "add_generation_prompt": false (as in HF transformers). With it, the internal system messages
 * of §1.2 steps 4-5 come before the continued message.
 * Validated here, before anything is rendered: tools[i].function.parameters (when present and
 * not null) and a json_schema response format's schema must be JSON objects; tool names must
 * hold no control-token text (k3_tok_k3_special_in, "<|", "|>"): declared tools, tool_calls in
 * the history, tool results' tool/name.
 * Errors (K3_ERR_ARG) name the offending key. */
k3_status k3_chat_request_parse(const char *json, size_t n_bytes, k3_chat_request **out);
void k3_chat_request_destroy(k3_chat_request *r); /* NULL-safe */
bool k3_chat_request_thinking(const k3_chat_request *r);
const char *k3_chat_request_effort(const k3_chat_request *r); /* NULL when thinking is off */
/* Where the rendered prompt ends: inside `think`, inside `response` (the generation prompt, or a
 * continued message), or after a closed message (add_generation_prompt false): the parser's
 * initial state. */
typedef enum k3_chat_prompt_end {
    K3_CHAT_ENDS_IN_THINK,
    K3_CHAT_ENDS_IN_RESPONSE,
    K3_CHAT_ENDS_CLOSED,
} k3_chat_prompt_end;
k3_chat_prompt_end k3_chat_request_prompt_end(const k3_chat_request *r);
/* Override add_generation_prompt (e.g. `k3 render --no-generation-prompt`); returns K3_ERR_ARG
 * when the resulting combination is refused (on with continue_final_message), which
 * k3_chat_render reports too. */
k3_status k3_chat_request_set_generation_prompt(k3_chat_request *r, bool on);
/* The request's top-level "tools" array (NULL if none): the parser types arguments by it. */
const k3_chat_json *k3_chat_request_tools(const k3_chat_request *r);

/* A rendered prompt: the whole text plus its segment boundaries. Segment i is
 * text[start_i .. seg_end[i]) with start_i = i ? seg_end[i-1] : 0; no segment is empty. */
typedef struct k3_chat_prompt {
    char *text; /* (n_bytes + 1) the prompt, NUL-terminated */
    size_t n_bytes;
    size_t n_segs;
    size_t *seg_end; /* (n_segs) end offset of each segment */
    bool *seg_ctrl;  /* (n_segs) true: a control segment (encode with specials allowed) */
    size_t cap_segs;
} k3_chat_prompt;

/* Build the segments (§1.2 order) as the request's keys say: the assistant opener (`think` when
 * thinking is on, `response` when off) when add_generation_prompt, the final message left open
 * when continue_final_message, neither otherwise; K3_ERR_ARG naming both keys when they are
 * both true. On error `out` is left empty. (Not const: it settles where the prompt ends.) */
k3_status k3_chat_render(k3_chat_request *r, k3_chat_prompt *out);
void k3_chat_prompt_free(k3_chat_prompt *p); /* frees the members; NULL-safe */

/* The prompt's token ids, appended to `out`: each segment encoded on its own (§4.6), control
 * segments with specials allowed, text segments without (user-typed "<|open|>" stays text). */
k3_status k3_chat_encode(const k3_chat_prompt *p, const k3_tokenizer *t, k3_tok_ids *out);

/* Segments as JSON `[[text, is_control], ...]` (compact, ensure_ascii=False). */
k3_status k3_chat_prompt_segments_json(const k3_chat_prompt *p, k3_chat_buf *out);

#endif /* K3_CHAT_H */
