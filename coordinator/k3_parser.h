/* parser — incremental K3 output parser: generated ids -> reasoning / content / typed tool calls.
 *
 * Owns: the §3.2 state machine of spec/K3-CHAT.md (lexing on marker ids, never on marker text),
 * the argument type rules of §3.3, the append-only streaming deltas of §3.4, the finish reason,
 * and synthesized call ids `call_<n>` (unique per response).
 * Callers must not: feed marker *text* expecting markers (user-typed "<|open|>" is ordinary BPE
 * and stays text — that is the point of id lexing); read views after the next feed/destroy.
 * Invariants: every string the parser returns is valid UTF-8 (invalid bytes become U+FFFD as
 * in Python's errors="replace"); tool-call `arguments` are always valid JSON built by a JSON
 * writer, except a raw `json` block, which is passed through verbatim (§3.3 rule 6); the
 * concatenation of all deltas equals the final fields of every call that completed, and the
 * final reasoning and content. Nothing is trimmed.
 * Streaming note: a call's deltas start at its header; a call that never closes (truncation, or
 * a new call opened before it closed) is left out of the final message, but its deltas were
 * already sent — its index is not reused. */
#ifndef K3_PARSER_H
#define K3_PARSER_H

#include "k3_base.h"
#include "k3_chat.h"
#include "k3_tokenizer.h"

typedef struct k3_parser k3_parser;

typedef struct k3_parser_opts {
    bool thinking; /* thinking is on: reasoning_content is reported; the completion starts in
                      `think` unless start_in_response (off: always in `response`) */
    bool start_in_response;    /* the prompt ended inside `response` (a continued message) */
    const k3_chat_json *tools; /* the request's OpenAI tools list, borrowed; NULL = untyped */
} k3_parser_opts;

k3_status k3_parser_create(const k3_parser_opts *o, k3_parser **out);
/* Options from a request: its thinking flag (the same bit the renderer used), where its prompt
 * ends (k3_chat_request_prompt_end) and its tools. The request must outlive the parser. */
k3_status k3_parser_create_for(const k3_chat_request *r, k3_parser **out);
void k3_parser_destroy(k3_parser *p); /* NULL-safe */

/* ---- input ---------------------------------------------------------------------------- */
typedef enum k3_parser_marker {
    K3_MARK_OPEN,  /* <|open|>        */
    K3_MARK_CLOSE, /* <|close|>       */
    K3_MARK_SEP,   /* <|sep|>         */
    K3_MARK_EOM,   /* <|end_of_msg|>  : end of message (the stop token) */
    K3_MARK_STOP,  /* [EOS]           : also the end */
    K3_MARK_OTHER, /* any other special id: ignored, never content */
} k3_parser_marker;
k3_status k3_parser_feed_marker(k3_parser *p, k3_parser_marker m);
/* Ordinary (non-special) token bytes; may split UTF-8 sequences anywhere. */
k3_status k3_parser_feed_text(k3_parser *p, const char *bytes, size_t n_bytes);
/* Generated ids: markers found by the tokenizer's control ids, other specials ignored, the rest
 * decoded to bytes. */
k3_status k3_parser_feed_ids(k3_parser *p, const k3_tokenizer *t, const int32_t *ids, size_t n);
/* End of generation: flushes held bytes, drops an unclosed call, fixes the finish reason
 * ("tool_calls" if >= 1 complete call, else "stop" if the message ended, else "length").
 * Feeding after finish is an error. */
k3_status k3_parser_finish(k3_parser *p);
bool k3_parser_ended(const k3_parser *p); /* an end-of-message/stop marker arrived */

/* ---- output --------------------------------------------------------------------------- */
typedef struct k3_parser_call {
    const char *id;   /* "call_<n>" */
    const char *name; /* (n_name) unescaped tool attribute, NUL-terminated (may hold NUL) */
    size_t n_name;
    const char *arguments; /* compact JSON object text (or a raw json block verbatim) */
    size_t n_arguments;
} k3_parser_call;

typedef struct k3_parser_message {
    bool has_reasoning;    /* thinking was on: reasoning_content is reported even if empty */
    const char *reasoning; /* (n_reasoning) */
    size_t n_reasoning;
    const char *content; /* (n_content) */
    size_t n_content;
    k3_parser_call *calls; /* (n_calls) complete calls, in order */
    size_t n_calls;
    const char *finish_reason; /* NULL before k3_parser_finish */
} k3_parser_message;
/* A view of the message so far (valid until the next feed/finish/destroy). */
k3_status k3_parser_message_view(k3_parser *p, k3_parser_message *out);
/* After k3_parser_finish: the call the generation was cut inside (max_tokens: opened, never
 * closed), with the argument text its deltas carried (JSON cut short, not valid in general); false
 * when there is none. The message leaves it out (spec §3.2); `k3 serve` reports it after the
 * complete calls, as vLLM reports a call cut at max_tokens, so that a stream (whose deltas
 * carried it) and a whole response agree. */
bool k3_parser_cut_call(k3_parser *p, k3_parser_call *out);
/* {"role":"assistant","content":..,"reasoning_content":..(thinking only),"tool_calls":[..],
 *  "finish_reason":..} appended to `out`. */
k3_status k3_parser_message_json(k3_parser *p, k3_chat_buf *out);

/* ---- streaming deltas ----------------------------------------------------------------- */
typedef struct k3_parser_call_delta {
    size_t index;     /* OpenAI tool_calls[].index: order in which calls opened */
    const char *id;   /* non-NULL only in the call's first delta */
    const char *name; /* idem; (n_name) bytes, may hold NUL */
    size_t n_name;
    const char *args; /* (n_args) bytes appended to function.arguments */
    size_t n_args;
} k3_parser_call_delta;

typedef struct k3_parser_delta {
    const char *reasoning; /* (n_reasoning) new reasoning text */
    size_t n_reasoning;
    const char *content; /* (n_content) new content text */
    size_t n_content;
    const k3_parser_call_delta *calls; /* (n_calls) calls with news */
    size_t n_calls;
} k3_parser_delta;
/* Everything appended since the previous take (valid until the next feed/take/destroy). */
k3_status k3_parser_take_delta(k3_parser *p, k3_parser_delta *out);
bool k3_parser_delta_empty(const k3_parser_delta *d);
/* The OpenAI chunk `delta` object for d: {"reasoning_content":..,"content":..,"tool_calls":[..]}
 * with only the fields that changed. */
k3_status k3_parser_delta_json(const k3_parser_delta *d, k3_chat_buf *out);

#endif /* K3_PARSER_H */
