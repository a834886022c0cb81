/* responses.c — OpenAI's Responses API (`POST /v1/responses`) as vLLM serves it, on top of the
 * chat path: a Responses body is translated into a chat request (the same renderer, sampler
 * keys, grammar and message parser as /v1/chat/completions), and the parsed K3 message is
 * written back as Responses output items.
 *
 * Owns: the translation (input string or items -> messages: `message` items of any role,
 * `function_call` items -> an assistant message's tool_calls, `function_call_output` items ->
 * tool messages, `reasoning` items -> the next assistant message's reasoning_content;
 * `instructions` -> a system message first; flat function `tools` and `tool_choice`;
 * `text.format` -> response_format; `max_output_tokens` -> max_tokens; `reasoning.effort` ->
 * reasoning_effort), the response object (reasoning, message and function_call items; status
 * "incomplete" with reason max_output_tokens at the length limit) and the typed SSE events
 * (response.created, response.in_progress, response.output_item.added / .done,
 * response.content_part.added / .done, response.reasoning_text.delta / .done,
 * response.output_text.delta / .done, response.function_call_arguments.delta / .done,
 * response.completed; `event: error` when the engine fails). Nothing is stored:
 * `previous_response_id`, `conversation` and `background` are refused with a 400.
 * Does not own: HTTP (server.c), the chat layer (openai.c, client/chat_job.h). */
#include <stdarg.h>
#include <stdio.h>

#include "server_internal.h"

/* The stream's progress through the output items. */
struct srv_rstream {
    int64_t seq;     /* sequence_number of the next event */
    int n_items;     /* output items opened so far (the next output_index) */
    char cur;        /* the open item: 0 none, 'r' reasoning, 'm' message, 'f' function call */
    int cur_index;   /* its output_index */
    size_t cur_call; /* 'f': the parser's index of the call */
    bool msg_opened;
    bool cut;         /* the open call was cut at the length limit (its item ends "incomplete") */
    k3_chat_buf acc;  /* the open item's text (reasoning, content or arguments) */
    k3_chat_buf name; /* 'f': the call's name */
    char call_id[64];
};

static int rfail(char *why, size_t n_why, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int rfail(char *why, size_t n_why, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, n_why, fmt, ap);
    va_end(ap);
    return 400;
}

static const k3_chat_json *val(const k3_chat_json *d, const char *k) {
    const k3_chat_json *v = k3_chat_json_get(d, k);
    return v && v->kind != K3_JSON_NULL ? v : NULL;
}

static k3_status puts_(k3_chat_buf *o, const char *s) {
    return k3_chat_buf_puts(o, s);
}

static k3_status put_str(k3_chat_buf *o, const char *s, size_t n) {
    return k3_chat_json_dump_str(s, n, o);
}

static k3_status put_json(k3_chat_buf *o, const k3_chat_json *v) {
    return k3_chat_json_dump(v, K3_JSON_COMPACT, o);
}

/* `"key":` then v, with a leading comma. */
static k3_status put_kv(k3_chat_buf *o, const char *k, const k3_chat_json *v) {
    K3_TRY(puts_(o, ",\""));
    K3_TRY(puts_(o, k));
    K3_TRY(puts_(o, "\":"));
    return put_json(o, v);
}

/* ---- request: Responses -> chat ------------------------------------------------------------- */
/* A content value (a string, or a list of text parts) as one string into `out`. */
static int content_text(const k3_chat_json *c, const char *where, k3_chat_buf *out, char *why,
                        size_t n_why) {
    if (!c) return 200;
    if (c->kind == K3_JSON_STRING) return k3_chat_buf_put(out, c->s, c->n) == K3_OK ? 200 : 500;
    if (c->kind != K3_JSON_ARRAY)
        return rfail(why, n_why, "%s must be a string or a list of content parts", where);
    for (size_t i = 0; i < c->n_items; i++) {
        const k3_chat_json *p = c->items[i], *t = val(p, "type"), *x = val(p, "text");
        if (t && (k3_chat_json_is_str(t, "input_image") || k3_chat_json_is_str(t, "input_file") ||
                  k3_chat_json_is_str(t, "input_audio")))
            return rfail(why, n_why,
                         "%s[%zu]: '%s' parts are not supported (K3 is served text-only)", where, i,
                         t->s);
        if (!x || x->kind != K3_JSON_STRING)
            return rfail(why, n_why,
                         "%s[%zu] must be a text part ({\"type\": \"input_text\", "
                         "\"text\": ...})",
                         where, i);
        if (k3_chat_buf_put(out, x->s, x->n) != K3_OK) return 500;
    }
    return 200;
}

/* Item i's content value c (input[i].<key>) as one string into `out`. */
static int item_text(const k3_chat_json *c, size_t i, const char *key, k3_chat_buf *out, char *why,
                     size_t n_why) {
    char where[64];
    snprintf(where, sizeof where, "input[%zu].%s", i, key);
    return content_text(c, where, out, why, n_why);
}

/* The messages being built: an assistant message may stay open for the calls that follow it. */
typedef struct msgs {
    k3_chat_buf *b;
    int n;             /* messages written */
    char open;         /* 0, 'a' an assistant message open, 'c' its tool_calls list open */
    k3_chat_buf think; /* a reasoning item's text for the next assistant message */
    bool has_think;
} msgs;

static k3_status msg_start(msgs *m) {
    return puts_(m->b, m->n++ ? ",{" : "{");
}

static k3_status msg_close(msgs *m) {
    if (m->open == 'c') K3_TRY(puts_(m->b, "]}"));
    if (m->open == 'a') K3_TRY(puts_(m->b, "}"));
    m->open = 0;
    return K3_OK;
}

/* An assistant message with `text`, left open for tool calls; a pending reasoning rides on it. */
static k3_status msg_assistant(msgs *m, const char *text, size_t n) {
    K3_TRY(msg_close(m));
    K3_TRY(msg_start(m));
    K3_TRY(puts_(m->b, "\"role\":\"assistant\",\"content\":"));
    K3_TRY(put_str(m->b, text, n));
    if (m->has_think) {
        K3_TRY(puts_(m->b, ",\"reasoning_content\":"));
        K3_TRY(put_str(m->b, m->think.p ? m->think.p : "", m->think.n));
        m->think.n = 0, m->has_think = false;
    }
    m->open = 'a';
    return K3_OK;
}

/* {"role": role, ("tool_call_id": id,) "content": text}, closing an open assistant message. */
static k3_status msg_plain(msgs *m, const char *role, const k3_chat_json *id,
                           const k3_chat_buf *text) {
    K3_TRY(msg_close(m));
    K3_TRY(msg_start(m));
    K3_TRY(puts_(m->b, "\"role\":"));
    K3_TRY(put_str(m->b, role, strlen(role)));
    if (id) K3_TRY(put_kv(m->b, "tool_call_id", id));
    K3_TRY(puts_(m->b, ",\"content\":"));
    K3_TRY(put_str(m->b, text->p ? text->p : "", text->n));
    return puts_(m->b, "}");
}

static int item_message(msgs *m, const k3_chat_json *it, size_t i, char *why, size_t n_why) {
    const k3_chat_json *role = val(it, "role");
    if (!role || role->kind != K3_JSON_STRING)
        return rfail(why, n_why, "input[%zu]: a message item needs a 'role'", i);
    k3_chat_buf t = {0};
    int st = item_text(val(it, "content"), i, "content", &t, why, n_why);
    const char *r = role->s;
    if (st == 200 && strcmp(r, "assistant") == 0) {
        st = msg_assistant(m, t.p ? t.p : "", t.n) == K3_OK ? 200 : 500;
    } else if (st == 200) {
        if (strcmp(r, "developer") == 0) r = "system";
        if (strcmp(r, "user") && strcmp(r, "system"))
            st = rfail(why, n_why,
                       "input[%zu]: role '%.40s' is not one of user, system, "
                       "developer, assistant",
                       i, r);
        if (st == 200 && msg_plain(m, r, NULL, &t) != K3_OK) st = 500;
    }
    k3_chat_buf_free(&t);
    return st;
}

static int item_call(msgs *m, const k3_chat_json *it, size_t i, char *why, size_t n_why) {
    const k3_chat_json *id = val(it, "call_id"), *name = val(it, "name"),
                       *args = val(it, "arguments");
    if (!id || id->kind != K3_JSON_STRING || !name || name->kind != K3_JSON_STRING || !args ||
        args->kind != K3_JSON_STRING)
        return rfail(why, n_why,
                     "input[%zu]: a function_call item needs the strings 'call_id', "
                     "'name' and 'arguments'",
                     i);
    if (m->open == 0 && msg_assistant(m, "", 0) != K3_OK) return 500;
    k3_status r = puts_(m->b, m->open == 'a' ? ",\"tool_calls\":[{\"id\":" : ",{\"id\":");
    m->open = 'c';
    if (r == K3_OK) r = put_json(m->b, id);
    if (r == K3_OK) r = puts_(m->b, ",\"type\":\"function\",\"function\":{\"name\":");
    if (r == K3_OK) r = put_json(m->b, name);
    if (r == K3_OK) r = puts_(m->b, ",\"arguments\":");
    if (r == K3_OK) r = put_json(m->b, args);
    if (r == K3_OK) r = puts_(m->b, "}}");
    return r == K3_OK ? 200 : 500;
}

static int item_output(msgs *m, const k3_chat_json *it, size_t i, char *why, size_t n_why) {
    const k3_chat_json *id = val(it, "call_id");
    if (!id || id->kind != K3_JSON_STRING)
        return rfail(why, n_why, "input[%zu]: a function_call_output item needs 'call_id'", i);
    k3_chat_buf t = {0};
    int st = item_text(val(it, "output"), i, "output", &t, why, n_why);
    if (st == 200 && msg_plain(m, "tool", id, &t) != K3_OK) st = 500;
    k3_chat_buf_free(&t);
    return st;
}

/* A reasoning item: its content (reasoning_text) or else its summary, for the next assistant
 * message. */
static int item_reasoning(msgs *m, const k3_chat_json *it, size_t i, char *why, size_t n_why) {
    const k3_chat_json *parts = val(it, "content");
    if (!parts || parts->kind != K3_JSON_ARRAY || parts->n_items == 0) parts = val(it, "summary");
    m->think.n = 0;
    m->has_think = true;
    return item_text(parts, i, "content", &m->think, why, n_why);
}

static int put_messages(const k3_chat_json *d, k3_chat_buf *b, char *why, size_t n_why) {
    msgs m = {.b = b};
    const k3_chat_json *ins = val(d, "instructions"), *in = val(d, "input");
    int st = 200;
    if (puts_(b, "\"messages\":[") != K3_OK) return 500;
    if (ins) {
        k3_chat_buf t = {0};
        st = content_text(ins, "request key 'instructions'", &t, why, n_why);
        if (st == 200 && msg_plain(&m, "system", NULL, &t) != K3_OK) st = 500;
        k3_chat_buf_free(&t);
    }
    if (st == 200 && !in) st = rfail(why, n_why, "request key 'input' is required");
    if (st == 200 && in->kind == K3_JSON_STRING) {
        if (msg_start(&m) != K3_OK || puts_(b, "\"role\":\"user\",\"content\":") != K3_OK ||
            put_json(b, in) != K3_OK || puts_(b, "}") != K3_OK)
            st = 500;
    } else if (st == 200 && in->kind != K3_JSON_ARRAY) {
        st = rfail(why, n_why, "request key 'input' must be a string or a list of items");
    }
    for (size_t i = 0; st == 200 && in->kind == K3_JSON_ARRAY && i < in->n_items; i++) {
        const k3_chat_json *it = in->items[i], *t = val(it, "type");
        if (it->kind != K3_JSON_OBJECT) {
            st = rfail(why, n_why, "input[%zu] must be an object", i);
        } else if (!t || k3_chat_json_is_str(t, "message")) {
            st = item_message(&m, it, i, why, n_why);
        } else if (k3_chat_json_is_str(t, "function_call")) {
            st = item_call(&m, it, i, why, n_why);
        } else if (k3_chat_json_is_str(t, "function_call_output")) {
            st = item_output(&m, it, i, why, n_why);
        } else if (k3_chat_json_is_str(t, "reasoning")) {
            st = item_reasoning(&m, it, i, why, n_why);
        } else {
            st = rfail(why, n_why,
                       "input[%zu]: item type '%.40s' is not supported (message, function_call, "
                       "function_call_output and reasoning are; nothing is stored, so no "
                       "item_reference)",
                       i, t->kind == K3_JSON_STRING ? t->s : "?");
        }
    }
    if (st == 200 && (msg_close(&m) != K3_OK || puts_(b, "]") != K3_OK)) st = 500;
    k3_chat_buf_free(&m.think);
    return st;
}

/* K3_TRY for the functions below, which return an HTTP status: a failed write (out of memory)
 * is a 500, never the k3_status itself (srv_responses_parse would send it as a status with no
 * message). */
#define TRY_500(expr)                                                                              \
    do {                                                                                           \
        if ((expr) != K3_OK) return 500;                                                           \
    } while (0)

/* tools: [{"type": "function", "name", "description", "parameters", "strict"}] -> chat tools. */
static int put_tools(const k3_chat_json *tools, k3_chat_buf *b, char *why, size_t n_why) {
    if (tools->kind != K3_JSON_ARRAY)
        return rfail(why, n_why, "request key 'tools' must be a list");
    TRY_500(puts_(b, ",\"tools\":["));
    for (size_t i = 0; i < tools->n_items; i++) {
        const k3_chat_json *t = tools->items[i], *ty = val(t, "type"), *name = val(t, "name");
        if (!k3_chat_json_is_str(ty, "function"))
            return rfail(why, n_why,
                         "tools[%zu]: type '%.40s' is not supported (function tools "
                         "only)",
                         i, ty && ty->kind == K3_JSON_STRING ? ty->s : "?");
        if (!name || name->kind != K3_JSON_STRING)
            return rfail(why, n_why, "tools[%zu]: a function tool needs a 'name'", i);
        TRY_500(puts_(b, i ? ",{\"type\":\"function\",\"function\":{\"name\":"
                           : "{\"type\":\"function\",\"function\":{\"name\":"));
        TRY_500(put_json(b, name));
        static const char *const keys[] = {"description", "parameters", "strict"};
        for (size_t k = 0; k < K3_ARRAY_LEN(keys); k++)
            if (val(t, keys[k])) TRY_500(put_kv(b, keys[k], val(t, keys[k])));
        TRY_500(puts_(b, "}}"));
    }
    return puts_(b, "]") == K3_OK ? 200 : 500;
}

static int put_tool_choice(const k3_chat_json *tc, k3_chat_buf *b, char *why, size_t n_why) {
    if (tc->kind == K3_JSON_STRING) return put_kv(b, "tool_choice", tc) == K3_OK ? 200 : 500;
    const k3_chat_json *ty = val(tc, "type"), *name = val(tc, "name");
    if (!k3_chat_json_is_str(ty, "function") || !name || name->kind != K3_JSON_STRING)
        return rfail(why, n_why,
                     "request key 'tool_choice' must be none, auto, required or "
                     "{\"type\": \"function\", \"name\": ...}");
    TRY_500(puts_(b, ",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":"));
    TRY_500(put_json(b, name));
    return puts_(b, "}}") == K3_OK ? 200 : 500;
}

/* text.format -> response_format. */
static int put_format(const k3_chat_json *text, k3_chat_buf *b, char *why, size_t n_why) {
    const k3_chat_json *f = val(text, "format"), *ty = val(f, "type");
    if (!f || k3_chat_json_is_str(ty, "text")) return 200;
    if (k3_chat_json_is_str(ty, "json_object"))
        return puts_(b, ",\"response_format\":{\"type\":\"json_object\"}") == K3_OK ? 200 : 500;
    if (!k3_chat_json_is_str(ty, "json_schema"))
        return rfail(why, n_why,
                     "request key 'text.format.type' must be text, json_object or "
                     "json_schema");
    TRY_500(puts_(b, ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":"));
    const k3_chat_json *name = val(f, "name");
    TRY_500(name ? put_json(b, name) : puts_(b, "\"response\""));
    if (val(f, "schema")) TRY_500(put_kv(b, "schema", val(f, "schema")));
    if (val(f, "strict")) TRY_500(put_kv(b, "strict", val(f, "strict")));
    return puts_(b, "}}") == K3_OK ? 200 : 500;
}

/* reasoning.effort: OpenAI's minimal / medium become K3's low / high; none turns thinking off. */
static int put_effort(const k3_chat_json *r, k3_chat_buf *b) {
    const k3_chat_json *e = val(r, "effort");
    if (!e) return 200;
    const char *s = k3_chat_json_is_str(e, "minimal")  ? "\"low\""
                    : k3_chat_json_is_str(e, "medium") ? "\"high\""
                                                       : NULL;
    TRY_500(puts_(b, ",\"reasoning_effort\":"));
    TRY_500(s ? puts_(b, s) : put_json(b, e));
    return 200;
}

static int to_chat(const k3_chat_json *d, k3_chat_buf *b, char *why, size_t n_why) {
    static const char *const refused[] = {"previous_response_id", "conversation", "prompt"};
    for (size_t i = 0; i < K3_ARRAY_LEN(refused); i++)
        if (val(d, refused[i]))
            return rfail(why, n_why,
                         "request key '%s' is not supported: k3 stores no responses; send the "
                         "whole conversation as 'input' items (the prefix cache makes the "
                         "replayed history cheap)",
                         refused[i]);
    if (k3_chat_json_truthy(val(d, "background")))
        return rfail(why, n_why, "request key 'background' is not supported (nothing is stored)");
    if (puts_(b, "{") != K3_OK) return 500;
    int st = put_messages(d, b, why, n_why);
    /* the chat keys of the same name and meaning (vLLM's extra sampling keys included) */
    static const char *const same[] = {"model",
                                       "stream",
                                       "temperature",
                                       "top_p",
                                       "top_k",
                                       "min_p",
                                       "seed",
                                       "logit_bias",
                                       "stop",
                                       "presence_penalty",
                                       "frequency_penalty",
                                       "repetition_penalty",
                                       "chat_template_kwargs",
                                       "ignore_eos",
                                       "parallel_tool_calls",
                                       "user",
                                       "structured_outputs"};
    for (size_t i = 0; st == 200 && i < K3_ARRAY_LEN(same); i++)
        if (val(d, same[i]) && put_kv(b, same[i], val(d, same[i])) != K3_OK) st = 500;
    if (st == 200 && val(d, "max_output_tokens") &&
        put_kv(b, "max_tokens", val(d, "max_output_tokens")) != K3_OK)
        st = 500;
    if (st == 200 && val(d, "tools")) st = put_tools(val(d, "tools"), b, why, n_why);
    if (st == 200 && val(d, "tool_choice"))
        st = put_tool_choice(val(d, "tool_choice"), b, why, n_why);
    if (st == 200 && val(d, "text")) st = put_format(val(d, "text"), b, why, n_why);
    if (st == 200 && val(d, "reasoning")) st = put_effort(val(d, "reasoning"), b);
    if (st == 200 && puts_(b, "}") != K3_OK) st = 500;
    return st;
}

int srv_responses_parse(const k3_server_opts *o, const char *body, size_t n, sreq **out, char *why,
                        size_t n_why) {
    k3_chat_json *d = NULL;
    *out = NULL;
    if (k3_chat_json_parse(body, n, "request", &d) != K3_OK) {
        snprintf(why, n_why, "%s", k3_last_error());
        return 400;
    }
    k3_chat_buf chat = {0};
    int st = d->kind == K3_JSON_OBJECT
                 ? to_chat(d, &chat, why, n_why)
                 : rfail(why, n_why, "the request body must be a JSON object");
    if (st == 500) snprintf(why, n_why, "out of memory");
    if (st == 200) st = srv_parse(o, SREQ_CHAT, chat.p, chat.n, out, why, n_why);
    k3_chat_buf_free(&chat);
    if (st != 200) {
        k3_chat_json_free(d);
        return st;
    }
    (*out)->responses = true;
    (*out)->resp_doc = d;
    return 200;
}

/* ---- the response object ------------------------------------------------------------------- */
/* Item ids: the response's hex part after a prefix ("msg_", "rs_", "fc_" + the call index). */
static const char *hex_of(const sreq *q) {
    const char *u = strchr(q->id, '_');
    return u ? u + 1 : q->id;
}

static k3_status put_item_id(const sreq *q, char kind, size_t call, k3_chat_buf *out) {
    char t[96];
    if (kind == 'f')
        snprintf(t, sizeof t, "\"fc_%s_%zu\"", hex_of(q), call);
    else
        snprintf(t, sizeof t, "\"%s%s\"", kind == 'r' ? "rs_" : "msg_", hex_of(q));
    return puts_(out, t);
}

static k3_status put_reasoning_item(const sreq *q, const char *t, size_t n, bool with_text,
                                    k3_chat_buf *out) {
    K3_TRY(puts_(out, "{\"id\":"));
    K3_TRY(put_item_id(q, 'r', 0, out));
    K3_TRY(puts_(out, ",\"type\":\"reasoning\",\"summary\":[],\"content\":["));
    if (with_text) {
        K3_TRY(puts_(out, "{\"type\":\"reasoning_text\",\"text\":"));
        K3_TRY(put_str(out, t, n));
        K3_TRY(puts_(out, "}"));
    }
    return puts_(out, "],\"status\":null}");
}

static k3_status put_text_part(const char *t, size_t n, k3_chat_buf *out) {
    K3_TRY(puts_(out, "{\"type\":\"output_text\",\"text\":"));
    K3_TRY(put_str(out, t, n));
    return puts_(out, ",\"annotations\":[],\"logprobs\":[]}");
}

static k3_status put_message_item(const sreq *q, const char *t, size_t n, bool done,
                                  k3_chat_buf *out) {
    K3_TRY(puts_(out, "{\"id\":"));
    K3_TRY(put_item_id(q, 'm', 0, out));
    K3_TRY(puts_(out, ",\"type\":\"message\",\"role\":\"assistant\",\"status\":"));
    K3_TRY(puts_(out, done ? "\"completed\",\"content\":[" : "\"in_progress\",\"content\":["));
    if (done) K3_TRY(put_text_part(t, n, out));
    return puts_(out, "]}");
}

/* status: "in_progress", "completed", or "incomplete" (a call cut at max_output_tokens) */
static k3_status put_call_item(const sreq *q, size_t index, const char *call_id, const char *name,
                               size_t n_name, const char *args, size_t n_args, const char *status,
                               k3_chat_buf *out) {
    K3_TRY(puts_(out, "{\"id\":"));
    K3_TRY(put_item_id(q, 'f', index, out));
    K3_TRY(puts_(out, ",\"type\":\"function_call\",\"call_id\":"));
    K3_TRY(put_str(out, call_id, strlen(call_id)));
    K3_TRY(puts_(out, ",\"name\":"));
    K3_TRY(put_str(out, name, n_name));
    K3_TRY(puts_(out, ",\"arguments\":"));
    K3_TRY(put_str(out, args, n_args));
    K3_TRY(puts_(out, ",\"status\":"));
    K3_TRY(put_str(out, status, strlen(status)));
    return puts_(out, "}");
}

/* The output items of a finished message: reasoning (when there is some), the message (when it
 * has content or there is no call), the calls, and last a call cut at max_output_tokens (status
 * "incomplete", its arguments as far as they came, as the stream sent them). The call ids are the
 * parser's call_<n>. */
static k3_status put_output(const sreq *q, const k3_parser_message *m, const k3_parser_call *cut,
                            k3_chat_buf *out) {
    bool first = true;
    K3_TRY(puts_(out, "["));
    if (m->has_reasoning && m->n_reasoning) {
        K3_TRY(put_reasoning_item(q, m->reasoning, m->n_reasoning, true, out));
        first = false;
    }
    if (m->n_content || (m->n_calls == 0 && !cut)) {
        if (!first) K3_TRY(puts_(out, ","));
        K3_TRY(put_message_item(q, m->content, m->n_content, true, out));
        first = false;
    }
    for (size_t i = 0; i < m->n_calls; i++) {
        if (!first) K3_TRY(puts_(out, ","));
        const k3_parser_call *c = &m->calls[i];
        K3_TRY(put_call_item(q, i, c->id, c->name, c->n_name, c->arguments, c->n_arguments,
                             "completed", out));
        first = false;
    }
    if (cut) {
        if (!first) K3_TRY(puts_(out, ","));
        K3_TRY(put_call_item(q, m->n_calls, cut->id, cut->name, cut->n_name, cut->arguments,
                             cut->n_arguments, "incomplete", out));
    }
    return puts_(out, "]");
}

/* The response object. m: the finished message (NULL: in progress, no output yet); cut: a call
 * cut at the length limit, or NULL. */
static k3_status put_response(const k3_server_opts *o, const sreq *q, const k3_parser_message *m,
                              const k3_parser_call *cut, k3_chat_buf *out) {
    const k3_chat_json *d = q->resp_doc;
    const bool length = m && m->finish_reason && strcmp(m->finish_reason, "length") == 0;
    char t[320];
    K3_TRY(puts_(out, "{\"id\":"));
    K3_TRY(put_str(out, q->id, strlen(q->id)));
    snprintf(t, sizeof t, ",\"object\":\"response\",\"created_at\":%lld,\"status\":\"%s\"",
             (long long)q->created,
             !m              ? "in_progress"
             : length || cut ? "incomplete"
                             : "completed");
    K3_TRY(puts_(out, t));
    K3_TRY(puts_(out, length || cut ? ",\"incomplete_details\":{\"reason\":\"max_output_tokens\"}"
                                    : ",\"incomplete_details\":null"));
    K3_TRY(puts_(out, ",\"error\":null,\"model\":"));
    K3_TRY(put_str(out, o->model_name, strlen(o->model_name)));
    K3_TRY(puts_(out, ",\"output\":"));
    K3_TRY(m ? put_output(q, m, cut, out) : puts_(out, "[]"));
    /* the request's settings, echoed (OpenAI's defaults where it gave none) */
    static const struct {
        const char *key, *dflt;
    } echo[] = {{"instructions", "null"},
                {"max_output_tokens", "null"},
                {"temperature", "1.0"},
                {"top_p", "1.0"},
                {"tool_choice", "\"auto\""},
                {"tools", "[]"},
                {"parallel_tool_calls", "true"},
                {"text", "{\"format\":{\"type\":\"text\"}}"},
                {"reasoning", "{\"effort\":null,\"summary\":null}"},
                {"metadata", "{}"},
                {"user", "null"}};
    for (size_t i = 0; i < K3_ARRAY_LEN(echo); i++) {
        const k3_chat_json *v = val(d, echo[i].key);
        if (v) {
            K3_TRY(put_kv(out, echo[i].key, v));
        } else {
            snprintf(t, sizeof t, ",\"%s\":%s", echo[i].key, echo[i].dflt);
            K3_TRY(puts_(out, t));
        }
    }
    K3_TRY(
        puts_(out, ",\"previous_response_id\":null,\"store\":false,\"truncation\":\"disabled\""));
    if (!m) return puts_(out, ",\"usage\":null}");
    snprintf(t, sizeof t,
             ",\"usage\":{\"input_tokens\":%lld,\"input_tokens_details\":{\"cached_tokens\":%lld},"
             "\"output_tokens\":%lld,\"output_tokens_details\":{\"reasoning_tokens\":0},"
             "\"total_tokens\":%lld}}",
             (long long)q->n_prompt, (long long)q->n_cached, (long long)q->n_gen,
             (long long)(q->n_prompt + q->n_gen));
    return puts_(out, t);
}

k3_status srv_responses_body(const k3_server_opts *o, const sreq *q, k3_chat_buf *out) {
    srv_stream st = {0};
    const srv_snapshot s = {
        .toks = q->gen, .n_gen = q->n_gen, .n_text = q->n_text, .done = true, .stop = q->stop};
    k3_parser_message m = {0};
    k3_parser_call cut;
    k3_status r = srv_feed_chat(q, &st, &s, o->tok);
    if (r == K3_OK) r = k3_parser_message_view(k3_job_feed_parser(st.feed), &m);
    const bool has_cut = r == K3_OK && k3_parser_cut_call(k3_job_feed_parser(st.feed), &cut);
    if (r == K3_OK) r = put_response(o, q, &m, has_cut ? &cut : NULL, out);
    srv_stream_free(&st);
    return r;
}

/* ---- streaming ------------------------------------------------------------------------------ */
static k3_status ev_open(srv_rstream *rs, const char *type, k3_chat_buf *out) {
    char t[160];
    snprintf(t, sizeof t, "event: %s\ndata: {\"type\":\"%s\",\"sequence_number\":%lld", type, type,
             (long long)rs->seq++);
    return puts_(out, t);
}

static k3_status ev_close(k3_chat_buf *out) {
    return puts_(out, "}\n\n");
}

/* `,"item_id":ID,"output_index":N` of the open item, and content_index 0 when `content`. */
static k3_status ev_where(const sreq *q, const srv_rstream *rs, bool content, k3_chat_buf *out) {
    char t[64];
    K3_TRY(puts_(out, ",\"item_id\":"));
    K3_TRY(put_item_id(q, rs->cur, rs->cur_call, out));
    snprintf(t, sizeof t, ",\"output_index\":%d%s", rs->cur_index,
             content ? ",\"content_index\":0" : "");
    return puts_(out, t);
}

static k3_status ev_item(const srv_rstream *rs, k3_chat_buf *out) {
    char t[48];
    snprintf(t, sizeof t, ",\"output_index\":%d,\"item\":", rs->cur_index);
    return puts_(out, t);
}

/* The open item's item, as it stands (done: complete). */
static k3_status cur_item(const sreq *q, const srv_rstream *rs, bool done, k3_chat_buf *out) {
    const char *a = rs->acc.p ? rs->acc.p : "";
    if (rs->cur == 'r') return put_reasoning_item(q, a, rs->acc.n, done, out);
    if (rs->cur == 'm') return put_message_item(q, a, rs->acc.n, done, out);
    return put_call_item(q, rs->cur_call, rs->call_id, rs->name.p ? rs->name.p : "", rs->name.n,
                         done ? a : "", done ? rs->acc.n : 0,
                         !done     ? "in_progress"
                         : rs->cut ? "incomplete"
                                   : "completed",
                         out);
}

static k3_status close_item(const sreq *q, srv_rstream *rs, k3_chat_buf *out) {
    if (!rs->cur) return K3_OK;
    const char *a = rs->acc.p ? rs->acc.p : "";
    if (rs->cur == 'r' || rs->cur == 'm') {
        K3_TRY(ev_open(
            rs, rs->cur == 'r' ? "response.reasoning_text.done" : "response.output_text.done",
            out));
        K3_TRY(ev_where(q, rs, true, out));
        K3_TRY(puts_(out, ",\"text\":"));
        K3_TRY(put_str(out, a, rs->acc.n));
        if (rs->cur == 'm') K3_TRY(puts_(out, ",\"logprobs\":[]"));
        K3_TRY(ev_close(out));
        K3_TRY(ev_open(rs, "response.content_part.done", out));
        K3_TRY(ev_where(q, rs, true, out));
        K3_TRY(puts_(out, ",\"part\":"));
        if (rs->cur == 'm') {
            K3_TRY(put_text_part(a, rs->acc.n, out));
        } else {
            K3_TRY(puts_(out, "{\"type\":\"reasoning_text\",\"text\":"));
            K3_TRY(put_str(out, a, rs->acc.n));
            K3_TRY(puts_(out, "}"));
        }
        K3_TRY(ev_close(out));
    } else {
        K3_TRY(ev_open(rs, "response.function_call_arguments.done", out));
        K3_TRY(ev_where(q, rs, false, out));
        K3_TRY(puts_(out, ",\"name\":"));
        K3_TRY(put_str(out, rs->name.p ? rs->name.p : "", rs->name.n));
        K3_TRY(puts_(out, ",\"arguments\":"));
        K3_TRY(put_str(out, a, rs->acc.n));
        K3_TRY(ev_close(out));
    }
    K3_TRY(ev_open(rs, "response.output_item.done", out));
    K3_TRY(ev_item(rs, out));
    K3_TRY(cur_item(q, rs, true, out));
    K3_TRY(ev_close(out));
    rs->cur = 0;
    return K3_OK;
}

/* Open an item of `kind` (closing the open one). */
static k3_status open_item(const sreq *q, srv_rstream *rs, char kind, k3_chat_buf *out) {
    K3_TRY(close_item(q, rs, out));
    rs->cur = kind, rs->cur_index = rs->n_items++;
    rs->acc.n = 0;
    if (kind == 'm') rs->msg_opened = true;
    K3_TRY(ev_open(rs, "response.output_item.added", out));
    K3_TRY(ev_item(rs, out));
    K3_TRY(cur_item(q, rs, false, out));
    K3_TRY(ev_close(out));
    if (kind == 'f') return K3_OK;
    K3_TRY(ev_open(rs, "response.content_part.added", out));
    K3_TRY(ev_where(q, rs, true, out));
    K3_TRY(puts_(out, kind == 'm' ? ",\"part\":"
                                  : ",\"part\":{\"type\":\"reasoning_text\",\"text\":\"\"}"));
    if (kind == 'm') K3_TRY(put_text_part("", 0, out));
    return ev_close(out);
}

/* A text delta of the open item (reasoning or message). */
static k3_status text_delta(const sreq *q, srv_rstream *rs, char kind, const char *t, size_t n,
                            k3_chat_buf *out) {
    if (rs->cur != kind) K3_TRY(open_item(q, rs, kind, out));
    K3_TRY(ev_open(rs, kind == 'r' ? "response.reasoning_text.delta" : "response.output_text.delta",
                   out));
    K3_TRY(ev_where(q, rs, true, out));
    K3_TRY(puts_(out, ",\"delta\":"));
    K3_TRY(put_str(out, t, n));
    if (kind == 'm') K3_TRY(puts_(out, ",\"logprobs\":[]"));
    K3_TRY(ev_close(out));
    return k3_chat_buf_put(&rs->acc, t, n);
}

static k3_status call_delta(const sreq *q, srv_rstream *rs, const k3_parser_call_delta *c,
                            k3_chat_buf *out) {
    if (c->id) {
        K3_TRY(close_item(q, rs, out));
        rs->name.n = 0;
        K3_TRY(k3_chat_buf_put(&rs->name, c->name, c->n_name));
        snprintf(rs->call_id, sizeof rs->call_id, "%s", c->id);
        rs->cur_call = c->index;
        K3_TRY(open_item(q, rs, 'f', out));
    }
    if (rs->cur != 'f' || rs->cur_call != c->index || !c->n_args) return K3_OK;
    K3_TRY(ev_open(rs, "response.function_call_arguments.delta", out));
    K3_TRY(ev_where(q, rs, false, out));
    K3_TRY(puts_(out, ",\"delta\":"));
    K3_TRY(put_str(out, c->args, c->n_args));
    K3_TRY(ev_close(out));
    return k3_chat_buf_put(&rs->acc, c->args, c->n_args);
}

static k3_status lifecycle(const k3_server_opts *o, const sreq *q, srv_rstream *rs,
                           const char *type, const k3_parser_message *m, const k3_parser_call *cut,
                           k3_chat_buf *out) {
    K3_TRY(ev_open(rs, type, out));
    K3_TRY(puts_(out, ",\"response\":"));
    K3_TRY(put_response(o, q, m, cut, out));
    return ev_close(out);
}

k3_status srv_responses_chunks(const k3_server_opts *o, const sreq *q, srv_stream *st,
                               const srv_snapshot *s, k3_chat_buf *out) {
    if (!st->rs) K3_TRY(k3_calloc((void **)&st->rs, sizeof *st->rs, "response stream"));
    srv_rstream *rs = st->rs;
    if (!st->role_sent) {
        K3_TRY(lifecycle(o, q, rs, "response.created", NULL, NULL, out));
        K3_TRY(lifecycle(o, q, rs, "response.in_progress", NULL, NULL, out));
        st->role_sent = true;
    }
    if (s->failed) return K3_OK;
    K3_TRY(srv_feed_chat(q, st, s, o->tok));
    k3_parser *p = k3_job_feed_parser(st->feed);
    k3_parser_delta d;
    K3_TRY(k3_parser_take_delta(p, &d));
    if (d.n_reasoning) K3_TRY(text_delta(q, rs, 'r', d.reasoning, d.n_reasoning, out));
    if (d.n_content) K3_TRY(text_delta(q, rs, 'm', d.content, d.n_content, out));
    for (size_t i = 0; i < d.n_calls; i++) K3_TRY(call_delta(q, rs, &d.calls[i], out));
    if (!s->done) return K3_OK;
    k3_parser_message m;
    k3_parser_call cut;
    K3_TRY(k3_parser_message_view(p, &m));
    rs->cut = k3_parser_cut_call(p, &cut);
    if (!rs->msg_opened && m.n_calls == 0 && !rs->cut && rs->cur != 'm')
        K3_TRY(open_item(q, rs, 'm', out));
    return close_item(q, rs, out);
}

/* After the last chunk: response.completed (its status "incomplete" at the length limit, as
 * vLLM sends it), or an error event when the engine failed. No [DONE]: the Responses stream
 * ends with its last event. */
k3_status srv_responses_end(const k3_server_opts *o, const sreq *q, k3_chat_buf *out) {
    srv_rstream *rs = q->st ? q->st->rs : NULL;
    srv_rstream tmp = {0};
    if (!rs) rs = &tmp;
    if (q->failed) {
        char why[sizeof q->error];
        snprintf(why, sizeof why, "%s", q->error);
        srv_strip_where(why); /* as the chat stream's error body leaves it out */
        K3_TRY(ev_open(rs, "error", out));
        K3_TRY(puts_(out, ",\"code\":\"server_error\",\"param\":null,\"message\":"));
        K3_TRY(put_str(out, why, strlen(why)));
        return ev_close(out);
    }
    k3_parser_message m;
    k3_parser_call cut;
    k3_parser *p = k3_job_feed_parser(q->st->feed);
    K3_TRY(k3_parser_message_view(p, &m));
    const bool has_cut = k3_parser_cut_call(p, &cut);
    return lifecycle(o, q, rs, "response.completed", &m, has_cut ? &cut : NULL, out);
}

void srv_responses_stream_free(srv_rstream *rs) {
    if (!rs) return;
    k3_chat_buf_free(&rs->acc);
    k3_chat_buf_free(&rs->name);
    k3_free(rs);
}
