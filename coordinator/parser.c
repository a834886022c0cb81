/* parser.c — the K3 output parser (spec/K3-CHAT.md §3): state machine, type rules, deltas.
 *
 * Owns: k3_parser. Input is a stream of events: marker (OPEN/CLOSE/SEP/EOM/STOP/OTHER) or body
 * bytes. A marker header (`<|open|>NAME attrs<|sep|>`, `<|close|>NAME<|sep|>`) is collected
 * until SEP and then drives the §3.2 machine. Body bytes pass a UTF-8 holdback (incomplete
 * sequences wait for the next bytes; a marker flushes them as U+FFFD) and go to the current
 * sink: reasoning, content, an argument value, or a raw json block.
 * Tool-call arguments are built append-only (§3.4): `{`/`,` + key at the argument header;
 * string values stream escaped as they arrive; other values are buffered and written at
 * `<|close|>argument<|sep|>` by the §3.3 rules (valid JSON re-serialised compactly, anything
 * else as a JSON string); `}` at `<|close|>call<|sep|>`.
 * Does not: trim anything, look at marker *text* inside bodies, or invent closing brackets. */
#include "k3_parser.h"
#include "k3_utf8.h"

#include <stdio.h>
#include <stdlib.h>

typedef enum {
    ST_THINK,
    ST_BETWEEN,
    ST_RESPONSE,
    ST_AFTER_RESP,
    ST_TOOLS,
    ST_CALL,
    ST_ARG,
    ST_JSONBLK,
    ST_AFTER_TOOLS,
    ST_DONE,
    ST_END
} pstate;

typedef enum { HDR_NONE, HDR_OPEN, HDR_CLOSE } hdr_kind;

/* What an argument value is typed by (§3.3). */
typedef enum { ARG_STREAM_STRING, ARG_TYPED, ARG_SCHEMA, ARG_SKIP } arg_mode;

typedef struct pcall {
    char id[32];
    char *name; /* (n_name + 1) NUL-terminated, may hold NUL */
    size_t n_name;
    k3_chat_buf args; /* function.arguments as built so far */
    size_t n_args_sent;
    bool header_sent;
    bool complete;             /* its <|close|>call<|sep|> arrived */
    bool has_args, json_block; /* arguments seen / a raw json block is the body */
    const k3_chat_json *props; /* parameters.properties of the matching tool, or NULL */
} pcall;

struct k3_parser {
    k3_parser_opts o;
    pstate st;
    bool any_body; /* a body byte or a non-echo tag arrived (echo tolerance, §2) */
    bool finished, ended;
    hdr_kind hdr;
    k3_chat_buf hbuf;      /* header text between OPEN/CLOSE and SEP */
    unsigned char pend[4]; /* held incomplete UTF-8 sequence */
    int n_pend;
    k3_chat_buf reasoning, content;
    size_t reasoning_sent, content_sent;
    pcall *calls; /* (n_calls) every call opened, in order */
    size_t n_calls, cap_calls;
    /* the argument being read */
    arg_mode amode;
    char atype[16];              /* type attribute (ARG_TYPED) */
    const k3_chat_json *aschema; /* properties[key] (ARG_SCHEMA), may be NULL */
    k3_chat_buf araw;            /* buffered value bytes */
    /* scratch for views / deltas */
    k3_parser_call *view;         /* (cap_out) */
    k3_parser_call_delta *deltas; /* (cap_out) */
    size_t cap_out;
    k3_chat_buf tmp;
};

/* ---- create / destroy -------------------------------------------------------------------- */
k3_status k3_parser_create(const k3_parser_opts *o, k3_parser **out) {
    *out = NULL;
    k3_parser *p = calloc(1, sizeof *p);
    if (!p) return K3_ERR(K3_ERR_NOMEM, "out of memory allocating a parser");
    p->o = *o;
    p->st = o->thinking && !o->start_in_response ? ST_THINK : ST_RESPONSE;
    *out = p;
    return K3_OK;
}

k3_status k3_parser_create_for(const k3_chat_request *r, k3_parser **out) {
    k3_parser_opts o = {.thinking = k3_chat_request_thinking(r),
                        .start_in_response =
                            k3_chat_request_prompt_end(r) == K3_CHAT_ENDS_IN_RESPONSE,
                        .tools = k3_chat_request_tools(r)};
    return k3_parser_create(&o, out);
}

void k3_parser_destroy(k3_parser *p) {
    if (!p) return;
    for (size_t i = 0; i < p->n_calls; i++) {
        free(p->calls[i].name);
        k3_chat_buf_free(&p->calls[i].args);
    }
    free(p->calls);
    free(p->view);
    free(p->deltas);
    k3_chat_buf_free(&p->hbuf);
    k3_chat_buf_free(&p->reasoning);
    k3_chat_buf_free(&p->content);
    k3_chat_buf_free(&p->araw);
    k3_chat_buf_free(&p->tmp);
    free(p);
}

bool k3_parser_ended(const k3_parser *p) {
    return p->ended;
}

/* ---- UTF-8 with Python errors="replace" ------------------------------------------------ */
static const char REPL[] = "\xEF\xBF\xBD"; /* U+FFFD */

/* Append bytes to `sink` as valid UTF-8; an incomplete tail is kept in p->pend. */
static k3_status utf8_feed(k3_parser *p, const char *bytes, size_t n, k3_chat_buf *sink) {
    /* Complete the held sequence first, byte by byte (at most 3 extra bytes). */
    while (p->n_pend && n) {
        p->pend[p->n_pend++] = (unsigned char)*bytes++;
        n--;
        int r = k3_utf8_next(p->pend, (size_t)p->n_pend, NULL);
        if (r == 0) continue;
        int used = r > 0 ? r : -r;
        K3_TRY(r > 0 ? k3_chat_buf_put(sink, p->pend, (size_t)r) : k3_chat_buf_put(sink, REPL, 3));
        /* Bytes after the used part go back to the input (they may start a new sequence). */
        int rest = p->n_pend - used;
        p->n_pend = 0;
        if (rest) {
            unsigned char tmp[4];
            memcpy(tmp, p->pend + used, (size_t)rest);
            K3_TRY(utf8_feed(p, (const char *)tmp, (size_t)rest, sink));
        }
    }
    const unsigned char *s = (const unsigned char *)bytes;
    size_t i = 0, run = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        int r = k3_utf8_next(s + i, n - i, NULL);
        if (r > 0) {
            i += (size_t)r;
            continue;
        }
        K3_TRY(k3_chat_buf_put(sink, s + run, i - run));
        if (r == 0) { /* hold the incomplete tail */
            p->n_pend = (int)(n - i);
            memcpy(p->pend, s + i, n - i);
            return K3_OK;
        }
        K3_TRY(k3_chat_buf_put(sink, REPL, 3));
        i += (size_t)-r;
        run = i;
    }
    return k3_chat_buf_put(sink, s + run, n - run);
}

/* A held incomplete sequence at a boundary becomes one U+FFFD (Python: truncated data). */
static k3_status utf8_flush(k3_parser *p, k3_chat_buf *sink) {
    if (!p->n_pend) return K3_OK;
    p->n_pend = 0;
    return sink ? k3_chat_buf_put(sink, REPL, 3) : K3_OK;
}

/* Whole bytes -> valid UTF-8 with U+FFFD for invalid or truncated sequences (headers). */
static k3_status utf8_sanitize(const char *b, size_t n, k3_chat_buf *out) {
    const unsigned char *s = (const unsigned char *)b;
    size_t i = 0, run = 0;
    while (i < n) {
        int r = s[i] < 0x80 ? 1 : k3_utf8_next(s + i, n - i, NULL);
        if (r > 0) {
            i += (size_t)r;
            continue;
        }
        K3_TRY(k3_chat_buf_put(out, s + run, i - run));
        K3_TRY(k3_chat_buf_put(out, REPL, 3));
        if (r == 0) {
            run = i = n;
            break;
        } /* truncated at the end: one U+FFFD */
        i += (size_t)-r;
        run = i;
    }
    return k3_chat_buf_put(out, s + run, n - run);
}

static k3_status arg_string_bytes(k3_parser *p, const char *s, size_t n);

/* At a section boundary a held (cut) UTF-8 sequence becomes U+FFFD in the current sink; a
 * streamed string argument gets it escaped into the arguments. */
static k3_status flush_pending(k3_parser *p);

/* ---- calls and arguments --------------------------------------------------------------- */
static pcall *cur_call(k3_parser *p) {
    return p->n_calls ? &p->calls[p->n_calls - 1] : NULL;
}

/* Length-carrying string view: header attributes and schema types may hold any byte (NUL too). */
typedef struct sv {
    const char *p;
    size_t n;
} sv;

static bool sv_is(sv a, const char *lit) {
    return a.n == strlen(lit) && memcmp(a.p, lit, a.n) == 0;
}

/* The tool's parameters.properties (OpenAI {"type":"function","function":{...}} or flat). */
static const k3_chat_json *tool_props(const k3_parser *p, sv name) {
    const k3_chat_json *tools = p->o.tools;
    if (!tools || tools->kind != K3_JSON_ARRAY) return NULL;
    for (size_t i = 0; i < tools->n_items; i++) {
        const k3_chat_json *fn = k3_chat_json_get(tools->items[i], "function");
        if (!fn) fn = tools->items[i];
        const k3_chat_json *nm = k3_chat_json_get(fn, "name");
        if (!nm || nm->kind != K3_JSON_STRING || nm->n != name.n ||
            (name.n && memcmp(nm->s, name.p, name.n)))
            continue;
        const k3_chat_json *props =
            k3_chat_json_get(k3_chat_json_get(fn, "parameters"), "properties");
        return props && props->kind == K3_JSON_OBJECT ? props : NULL;
    }
    return NULL;
}

static k3_status open_call(k3_parser *p, sv name) {
    pcall *c = cur_call(p);
    /* A call opened before the previous closed: the previous stays incomplete (dropped). */
    if (p->n_calls == p->cap_calls) {
        size_t cap = p->cap_calls ? p->cap_calls * 2 : 4;
        pcall *v = realloc(p->calls, cap * sizeof *v);
        if (!v) return K3_ERR(K3_ERR_NOMEM, "out of memory growing the tool-call list");
        p->calls = v;
        p->cap_calls = cap;
    }
    c = &p->calls[p->n_calls];
    memset(c, 0, sizeof *c);
    snprintf(c->id, sizeof c->id, "call_%zu", p->n_calls);
    c->name = malloc(name.n + 1);
    if (!c->name) return K3_ERR(K3_ERR_NOMEM, "out of memory copying a tool name");
    if (name.n) memcpy(c->name, name.p, name.n);
    c->name[name.n] = 0;
    c->n_name = name.n;
    p->n_calls++;
    c->props = tool_props(p, name);
    c->header_sent = false;
    return K3_OK;
}

/* Collect the `type` strings of a schema node: "type": "T" | ["T", ...], anyOf/oneOf members. */
static int schema_types(const k3_chat_json *s, sv *out, int max) {
    int n = 0;
    if (!s || s->kind != K3_JSON_OBJECT) return 0;
    const k3_chat_json *t = k3_chat_json_get(s, "type");
    if (t && t->kind == K3_JSON_STRING && n < max) out[n++] = (sv){t->s, t->n};
    if (t && t->kind == K3_JSON_ARRAY)
        for (size_t i = 0; i < t->n_items && n < max; i++)
            if (t->items[i]->kind == K3_JSON_STRING)
                out[n++] = (sv){t->items[i]->s, t->items[i]->n};
    static const char *const unions[] = {"anyOf", "oneOf"};
    for (size_t u = 0; u < 2; u++) {
        const k3_chat_json *a = k3_chat_json_get(s, unions[u]);
        if (!a || a->kind != K3_JSON_ARRAY) continue;
        for (size_t i = 0; i < a->n_items && n < max; i++)
            n += schema_types(a->items[i], out + n, max - n);
    }
    return n;
}

static bool kind_fits(k3_json_kind k, sv type) {
    if (sv_is(type, "string")) return k == K3_JSON_STRING;
    if (sv_is(type, "number") || sv_is(type, "integer"))
        return k == K3_JSON_INT || k == K3_JSON_FLOAT;
    if (sv_is(type, "boolean")) return k == K3_JSON_BOOL;
    if (sv_is(type, "null")) return k == K3_JSON_NULL;
    if (sv_is(type, "object")) return k == K3_JSON_OBJECT;
    if (sv_is(type, "array")) return k == K3_JSON_ARRAY;
    return false;
}

static bool is_xtml_type(sv t) {
    static const char *const ok[] = {"string", "number", "boolean", "null", "object", "array"};
    for (size_t i = 0; i < K3_ARRAY_LEN(ok); i++)
        if (sv_is(t, ok[i])) return true;
    return false;
}

/* Argument header: emit `{`/`,` + "key": and choose how the value is typed (§3.3). `type`
 * has p == NULL when the header has no type attribute. */
static k3_status open_arg(k3_parser *p, sv key, sv type) {
    pcall *c = cur_call(p);
    p->araw.n = 0;
    if (c->json_block) {
        p->amode = ARG_SKIP;
        return K3_OK;
    } /* json block is the whole body */
    K3_TRY(k3_chat_buf_puts(&c->args, c->has_args ? "," : "{"));
    c->has_args = true;
    K3_TRY(k3_chat_json_dump_str(key.p, key.n, &c->args));
    K3_TRY(k3_chat_buf_puts(&c->args, ":"));
    p->aschema = k3_chat_json_get_n(c->props, key.p, key.n);
    if (type.p && is_xtml_type(type)) { /* rule 1/2: the type attribute first */
        p->amode = sv_is(type, "string") ? ARG_STREAM_STRING : ARG_TYPED;
        memcpy(p->atype, type.p, type.n); /* one of the six names: fits */
        p->atype[type.n] = 0;
    } else { /* rule 3: the schema; string-only (or string|null) streams as a string */
        sv ts[16];
        int nt = schema_types(p->aschema, ts, 16), n_str = 0, n_other = 0;
        for (int i = 0; i < nt; i++) {
            if (sv_is(ts[i], "string"))
                n_str++;
            else if (!sv_is(ts[i], "null"))
                n_other++;
        }
        p->amode = n_str && !n_other ? ARG_STREAM_STRING : ARG_SCHEMA;
    }
    if (p->amode == ARG_STREAM_STRING) K3_TRY(k3_chat_buf_puts(&c->args, "\""));
    return K3_OK;
}

/* Escaped string bytes for a streaming string argument: `bytes` are valid UTF-8. */
static k3_status arg_string_bytes(k3_parser *p, const char *s, size_t n) {
    pcall *c = cur_call(p);
    p->tmp.n = 0;
    K3_TRY(k3_chat_json_dump_str(s, n, &p->tmp));
    return k3_chat_buf_put(&c->args, p->tmp.p + 1, p->tmp.n - 2); /* without the quotes */
}

/* `<|close|>argument<|sep|>`: finish the value. */
static k3_status close_arg(k3_parser *p) {
    pcall *c = cur_call(p);
    if (p->amode == ARG_SKIP) return K3_OK;
    if (p->amode == ARG_STREAM_STRING) return k3_chat_buf_puts(&c->args, "\""); /* flushed */
    K3_TRY(utf8_flush(p, &p->araw));
    K3_TRY(k3_chat_buf_put(&p->araw, "", 0));
    k3_chat_json *v = NULL;
    bool ok = k3_chat_json_parse(p->araw.p, p->araw.n, "argument", &v) == K3_OK;
    k3_clear_error();
    if (ok && p->amode == ARG_TYPED) ok = kind_fits(v->kind, (sv){p->atype, strlen(p->atype)});
    if (ok && p->amode == ARG_SCHEMA) {
        sv ts[16];
        int nt = schema_types(p->aschema, ts, 16);
        bool fits = nt == 0; /* no schema entry: any JSON value */
        for (int i = 0; i < nt && !fits; i++)
            fits = !sv_is(ts[i], "string") && kind_fits(v->kind, ts[i]);
        ok = fits;
    }
    k3_status s = ok ? k3_chat_json_dump(v, K3_JSON_COMPACT, &c->args)
                     : k3_chat_json_dump_str(p->araw.p, p->araw.n, &c->args); /* never raw */
    k3_chat_json_free(v);
    return s;
}

static k3_chat_buf *sink(k3_parser *p);

static k3_status flush_pending(k3_parser *p) {
    if (!p->n_pend) return K3_OK;
    if (p->st == ST_ARG && p->amode == ARG_STREAM_STRING) {
        size_t before = p->araw.n;
        K3_TRY(utf8_flush(p, &p->araw));
        return arg_string_bytes(p, p->araw.p + before, p->araw.n - before);
    }
    return utf8_flush(p, sink(p));
}

static k3_status commit_call(k3_parser *p) {
    pcall *c = cur_call(p);
    if (!c->json_block) K3_TRY(k3_chat_buf_puts(&c->args, c->has_args ? "}" : "{}"));
    c->complete = true;
    return K3_OK;
}

/* ---- headers and the state machine ---------------------------------------------------- */
/* Attribute value for `name` in a header (`name attr="v" ...`), unescaped (&quot; first, then
 * &amp;) into `out`. Attribute names follow [A-Za-z_][\w.:-]*. Returns false if absent. */
static bool header_attr(const char *h, size_t n, const char *want, k3_chat_buf *out) {
    size_t i = 0;
    while (i < n && h[i] != ' ') i++; /* skip the tag name */
    while (i < n) {
        if (!((h[i] >= 'A' && h[i] <= 'Z') || (h[i] >= 'a' && h[i] <= 'z') || h[i] == '_')) {
            i++;
            continue;
        }
        size_t k0 = i;
        while (i < n && ((h[i] >= 'A' && h[i] <= 'Z') || (h[i] >= 'a' && h[i] <= 'z') ||
                         (h[i] >= '0' && h[i] <= '9') || h[i] == '_' || h[i] == '.' ||
                         h[i] == ':' || h[i] == '-'))
            i++;
        size_t k1 = i;
        if (i + 1 >= n || h[i] != '=' || h[i + 1] != '"') continue;
        size_t v0 = i + 2, v1 = v0;
        while (v1 < n && h[v1] != '"') v1++;
        if (v1 >= n) return false; /* unterminated value */
        i = v1 + 1;
        if (k1 - k0 != strlen(want) || memcmp(h + k0, want, k1 - k0) != 0) continue;
        out->n = 0;
        k3_chat_buf_put(out, "", 0);
        for (size_t j = v0; j < v1;) {
            if (v1 - j >= 6 && memcmp(h + j, "&quot;", 6) == 0) {
                k3_chat_buf_put(out, "\"", 1);
                j += 6;
            } else if (v1 - j >= 5 && memcmp(h + j, "&amp;", 5) == 0) {
                k3_chat_buf_put(out, "&", 1);
                j += 5;
            } else {
                k3_chat_buf_put(out, h + j, 1);
                j++;
            }
        }
        return out->p != NULL;
    }
    return false;
}

static bool tag_is(const char *name, size_t n, const char *want) {
    return n == strlen(want) && memcmp(name, want, n) == 0;
}

static k3_status on_open(k3_parser *p, const char *h, size_t n) {
    size_t nl = 0;
    while (nl < n && h[nl] != ' ') nl++;
    bool first = !p->any_body;
#define IS(t) tag_is(h, nl, t)
    p->any_body = true;
    switch (p->st) {
    case ST_THINK:
        if (IS("message") && first) {
            p->any_body = false;
            return K3_OK;
        }                                                     /* echoed opener */
        if (IS("think") && p->reasoning.n == 0) return K3_OK; /* echo at offset 0 */
        if (IS("response"))
            p->st = ST_RESPONSE; /* the model skipped </think> */
        else if (IS("tools"))
            p->st = ST_TOOLS;
        return K3_OK;
    case ST_RESPONSE:
        if (IS("message") && first) {
            p->any_body = false;
            return K3_OK;
        }
        if ((IS("response") || IS("think")) && p->content.n == 0 && first) {
            p->any_body = false;
            return K3_OK;
        }
        if (IS("tools")) p->st = ST_TOOLS;
        return K3_OK;
    case ST_BETWEEN:
    case ST_AFTER_RESP:
        if (IS("response") && p->st == ST_BETWEEN)
            p->st = ST_RESPONSE;
        else if (IS("tools"))
            p->st = ST_TOOLS;
        return K3_OK;
    case ST_AFTER_TOOLS:
        if (IS("tools")) p->st = ST_TOOLS;
        return K3_OK;
    case ST_TOOLS:
    case ST_CALL:
    case ST_ARG:
    case ST_JSONBLK:
        if (IS("call")) {
            k3_chat_buf name = {0};
            if (!header_attr(h, n, "tool", &name)) K3_TRY(k3_chat_buf_put(&name, "", 0));
            k3_status s =
                name.p ? open_call(p, (sv){name.p, name.n}) : K3_ERR(K3_ERR_NOMEM, "out of memory");
            k3_chat_buf_free(&name);
            K3_TRY(s);
            p->st = ST_CALL;
            return K3_OK;
        }
        if (p->st == ST_TOOLS) return K3_OK;
        if (IS("argument") && p->st != ST_JSONBLK) {
            if (p->st == ST_ARG) K3_TRY(close_arg(p)); /* missing </argument> */
            k3_chat_buf key = {0}, type = {0};
            bool has_key = header_attr(h, n, "key", &key);
            bool has_type = header_attr(h, n, "type", &type);
            k3_status s = K3_OK;
            if (has_key)
                s = open_arg(p, (sv){key.p, key.n},
                             has_type ? (sv){type.p, type.n} : (sv){NULL, 0});
            else
                p->amode = ARG_SKIP; /* no key: nothing sensible to attach the value to */
            k3_chat_buf_free(&key);
            k3_chat_buf_free(&type);
            p->araw.n = 0;
            p->st = ST_ARG;
            return s;
        }
        if (IS("json") && p->st == ST_CALL) {
            pcall *c = cur_call(p);
            if (!c->has_args) c->json_block = true; /* honoured only as the whole body */
            p->amode = c->json_block ? ARG_STREAM_STRING : ARG_SKIP;
            p->st = ST_JSONBLK;
        }
        return K3_OK;
    default:
        return K3_OK;
    }
#undef IS
}

static k3_status on_close(k3_parser *p, const char *h, size_t n) {
    size_t nl = 0;
    while (nl < n && h[nl] != ' ') nl++;
#define IS(t) tag_is(h, nl, t)
    p->any_body = true;
    if (IS("message") && p->st != ST_END) { /* the message is over whatever state we were in */
        p->st = ST_DONE;                    /* an unclosed call stays incomplete: left out */
        return K3_OK;
    }
    switch (p->st) {
    case ST_THINK:
        if (IS("think")) p->st = ST_BETWEEN;
        return K3_OK;
    case ST_RESPONSE:
        if (IS("response")) p->st = ST_AFTER_RESP;
        return K3_OK;
    case ST_TOOLS:
        if (IS("tools")) p->st = ST_AFTER_TOOLS;
        return K3_OK;
    case ST_ARG:
    case ST_CALL:
    case ST_JSONBLK:
        if (IS("argument") && p->st == ST_ARG) {
            K3_TRY(close_arg(p));
            p->st = ST_CALL;
        } else if (IS("json") && p->st == ST_JSONBLK)
            p->st = ST_CALL;
        else if (IS("call")) {
            if (p->st == ST_ARG) K3_TRY(close_arg(p));
            K3_TRY(commit_call(p));
            p->st = ST_TOOLS;
        } else if (IS("tools"))
            p->st = ST_AFTER_TOOLS; /* unclosed call left out */
        return K3_OK;
    default:
        return K3_OK;
    }
#undef IS
}

/* The sink body bytes go to in the current state (NULL = dropped). */
static k3_chat_buf *sink(k3_parser *p) {
    switch (p->st) {
    case ST_THINK:
        return &p->reasoning;
    case ST_RESPONSE:
        return &p->content;
    case ST_ARG:
        return p->amode == ARG_SKIP ? NULL : &p->araw;
    case ST_JSONBLK:
        return p->amode == ARG_SKIP ? NULL : &cur_call(p)->args;
    default:
        return NULL;
    }
}

/* Move the sanitized header from tmp into hbuf (tmp is reused by the handlers). */
static k3_status swap_header(k3_parser *p) {
    k3_chat_buf t = p->hbuf;
    p->hbuf = p->tmp;
    p->tmp = t;
    p->tmp.n = 0;
    return k3_chat_buf_put(&p->hbuf, "", 0);
}

k3_status k3_parser_feed_text(k3_parser *p, const char *bytes, size_t n) {
    if (p->finished) return K3_ERR(K3_ERR_STATE, "parser: text fed after finish");
    if (n == 0 || p->st == ST_END) return K3_OK;
    if (p->hdr != HDR_NONE) {
        if (p->hbuf.n + n > (1u << 20)) return K3_OK; /* absurd header: keep the first 1 MiB */
        return k3_chat_buf_put(&p->hbuf, bytes, n);
    }
    k3_chat_buf *s = sink(p);
    if (!s) return K3_OK; /* whitespace between sections, text after the message, ... */
    p->any_body = true;
    if (p->st == ST_ARG && p->amode == ARG_STREAM_STRING) { /* decode, then escape into args */
        size_t before = p->araw.n;
        K3_TRY(utf8_feed(p, bytes, n, &p->araw));
        return p->araw.n > before ? arg_string_bytes(p, p->araw.p + before, p->araw.n - before)
                                  : K3_OK;
    }
    return utf8_feed(p, bytes, n, s);
}

k3_status k3_parser_feed_marker(k3_parser *p, k3_parser_marker m) {
    if (p->finished) return K3_ERR(K3_ERR_STATE, "parser: marker fed after finish");
    if (p->st == ST_END) return K3_OK;
    if (p->hdr == HDR_NONE && m != K3_MARK_SEP && m != K3_MARK_OTHER) K3_TRY(flush_pending(p));
    switch (m) {
    case K3_MARK_OPEN:
    case K3_MARK_CLOSE:
        p->hdr = m == K3_MARK_OPEN ? HDR_OPEN : HDR_CLOSE; /* an unfinished header is abandoned */
        p->hbuf.n = 0;
        return K3_OK;
    case K3_MARK_SEP: {
        if (p->hdr == HDR_NONE) return K3_OK; /* stray separator */
        hdr_kind k = p->hdr;
        p->hdr = HDR_NONE;
        p->tmp.n = 0;
        K3_TRY(utf8_sanitize(p->hbuf.p ? p->hbuf.p : "", p->hbuf.n, &p->tmp));
        K3_TRY(swap_header(p));
        return k == HDR_OPEN ? on_open(p, p->hbuf.p, p->hbuf.n) : on_close(p, p->hbuf.p, p->hbuf.n);
    }
    case K3_MARK_EOM:
    case K3_MARK_STOP:
        p->hdr = HDR_NONE;
        p->st = ST_END;
        p->ended = true;
        return K3_OK;
    case K3_MARK_OTHER:
        return K3_OK; /* media / reserved specials: never content */
    }
    return K3_OK;
}

k3_status k3_parser_feed_ids(k3_parser *p, const k3_tokenizer *t, const int32_t *ids, size_t n) {
    k3_tok_ctrl c = k3_tok_control_ids(t);
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id == c.open)
            K3_TRY(k3_parser_feed_marker(p, K3_MARK_OPEN));
        else if (id == c.close)
            K3_TRY(k3_parser_feed_marker(p, K3_MARK_CLOSE));
        else if (id == c.sep)
            K3_TRY(k3_parser_feed_marker(p, K3_MARK_SEP));
        else if (id == c.end_of_msg)
            K3_TRY(k3_parser_feed_marker(p, K3_MARK_EOM));
        else if (id == c.eos)
            K3_TRY(k3_parser_feed_marker(p, K3_MARK_STOP));
        else if (k3_tok_is_special(t, id))
            K3_TRY(k3_parser_feed_marker(p, K3_MARK_OTHER));
        else {
            const char *b;
            size_t nb;
            K3_TRY(k3_tok_id_bytes(t, id, &b, &nb));
            K3_TRY(k3_parser_feed_text(p, b, nb));
        }
    }
    return K3_OK;
}

k3_status k3_parser_finish(k3_parser *p) {
    if (p->finished) return K3_OK;
    if (p->hdr == HDR_NONE) K3_TRY(flush_pending(p));
    /* truncated inside a call: it stays incomplete (never invent a closing bracket) */
    p->finished = true;
    return K3_OK;
}

/* ---- output ------------------------------------------------------------------------- */
static size_t complete_calls(k3_parser *p) {
    size_t n = 0;
    for (size_t i = 0; i < p->n_calls; i++) n += p->calls[i].complete;
    return n;
}

/* Room for one view/delta entry per call; grows only when a call was added (no allocation per
 * token in steady state). */
static k3_status grow_out(k3_parser *p) {
    if (p->n_calls + 1 <= p->cap_out) return K3_OK;
    size_t cap = (p->n_calls + 1) * 2;
    k3_parser_call *v = realloc(p->view, cap * sizeof *v);
    if (!v) return K3_ERR(K3_ERR_NOMEM, "out of memory building a message view");
    p->view = v;
    k3_parser_call_delta *d = realloc(p->deltas, cap * sizeof *d);
    if (!d) return K3_ERR(K3_ERR_NOMEM, "out of memory building a delta");
    p->deltas = d;
    p->cap_out = cap;
    return K3_OK;
}

k3_status k3_parser_message_view(k3_parser *p, k3_parser_message *out) {
    memset(out, 0, sizeof *out);
    out->has_reasoning = p->o.thinking;
    out->reasoning = p->reasoning.p ? p->reasoning.p : "";
    out->n_reasoning = p->reasoning.n;
    out->content = p->content.p ? p->content.p : "";
    out->n_content = p->content.n;
    K3_TRY(grow_out(p));
    for (size_t i = 0; i < p->n_calls; i++) {
        pcall *c = &p->calls[i];
        if (!c->complete) continue;
        p->view[out->n_calls++] =
            (k3_parser_call){c->id, c->name, c->n_name, c->args.p ? c->args.p : "", c->args.n};
    }
    out->calls = p->view;
    if (p->finished)
        out->finish_reason = complete_calls(p)              ? "tool_calls"
                             : p->ended || p->st == ST_DONE ? "stop"
                                                            : "length";
    return K3_OK;
}

bool k3_parser_cut_call(k3_parser *p, k3_parser_call *out) {
    const pcall *c = p->n_calls ? &p->calls[p->n_calls - 1] : NULL;
    if (!p->finished || !c || c->complete || p->ended || p->st == ST_DONE) return false;
    *out = (k3_parser_call){c->id, c->name, c->n_name, c->args.p ? c->args.p : "", c->args.n};
    return true;
}

static k3_status put_key_str(k3_chat_buf *o, const char *key, const char *s, size_t n) {
    K3_TRY(k3_chat_json_dump_str(key, strlen(key), o));
    K3_TRY(k3_chat_buf_puts(o, ":"));
    return k3_chat_json_dump_str(s, n, o);
}

k3_status k3_parser_message_json(k3_parser *p, k3_chat_buf *out) {
    k3_parser_message m;
    K3_TRY(k3_parser_message_view(p, &m));
    K3_TRY(k3_chat_buf_puts(out, "{\"role\":\"assistant\","));
    K3_TRY(put_key_str(out, "content", m.content, m.n_content));
    if (m.has_reasoning) {
        K3_TRY(k3_chat_buf_puts(out, ","));
        K3_TRY(put_key_str(out, "reasoning_content", m.reasoning, m.n_reasoning));
    }
    K3_TRY(k3_chat_buf_puts(out, ",\"tool_calls\":["));
    for (size_t i = 0; i < m.n_calls; i++) {
        K3_TRY(k3_chat_buf_puts(out, i ? ",{" : "{"));
        K3_TRY(put_key_str(out, "id", m.calls[i].id, strlen(m.calls[i].id)));
        K3_TRY(k3_chat_buf_puts(out, ",\"type\":\"function\",\"function\":{"));
        K3_TRY(put_key_str(out, "name", m.calls[i].name, m.calls[i].n_name));
        K3_TRY(k3_chat_buf_puts(out, ","));
        K3_TRY(put_key_str(out, "arguments", m.calls[i].arguments, m.calls[i].n_arguments));
        K3_TRY(k3_chat_buf_puts(out, "}}"));
    }
    K3_TRY(k3_chat_buf_puts(out, "],\"finish_reason\":"));
    if (m.finish_reason)
        K3_TRY(k3_chat_json_dump_str(m.finish_reason, strlen(m.finish_reason), out));
    else
        K3_TRY(k3_chat_buf_puts(out, "null"));
    return k3_chat_buf_puts(out, "}");
}

k3_status k3_parser_take_delta(k3_parser *p, k3_parser_delta *out) {
    memset(out, 0, sizeof *out);
    out->reasoning = p->reasoning.p ? p->reasoning.p + p->reasoning_sent : "";
    out->n_reasoning = p->reasoning.n - p->reasoning_sent;
    p->reasoning_sent = p->reasoning.n;
    out->content = p->content.p ? p->content.p + p->content_sent : "";
    out->n_content = p->content.n - p->content_sent;
    p->content_sent = p->content.n;
    K3_TRY(grow_out(p));
    for (size_t i = 0; i < p->n_calls; i++) {
        pcall *c = &p->calls[i];
        bool news = !c->header_sent || c->args.n > c->n_args_sent;
        if (!news) continue;
        k3_parser_call_delta *d = &p->deltas[out->n_calls++];
        *d = (k3_parser_call_delta){.index = i};
        if (!c->header_sent) {
            d->id = c->id;
            d->name = c->name;
            d->n_name = c->n_name;
            c->header_sent = true;
        }
        d->args = c->args.p ? c->args.p + c->n_args_sent : "";
        d->n_args = c->args.n - c->n_args_sent;
        c->n_args_sent = c->args.n;
    }
    out->calls = p->deltas;
    return K3_OK;
}

bool k3_parser_delta_empty(const k3_parser_delta *d) {
    return d->n_reasoning == 0 && d->n_content == 0 && d->n_calls == 0;
}

k3_status k3_parser_delta_json(const k3_parser_delta *d, k3_chat_buf *out) {
    bool comma = false;
    K3_TRY(k3_chat_buf_puts(out, "{"));
    if (d->n_reasoning) {
        K3_TRY(put_key_str(out, "reasoning_content", d->reasoning, d->n_reasoning));
        comma = true;
    }
    if (d->n_content) {
        if (comma) K3_TRY(k3_chat_buf_puts(out, ","));
        K3_TRY(put_key_str(out, "content", d->content, d->n_content));
        comma = true;
    }
    if (d->n_calls) {
        if (comma) K3_TRY(k3_chat_buf_puts(out, ","));
        K3_TRY(k3_chat_buf_puts(out, "\"tool_calls\":["));
        for (size_t i = 0; i < d->n_calls; i++) {
            const k3_parser_call_delta *c = &d->calls[i];
            char idx[48];
            snprintf(idx, sizeof idx, "%s{\"index\":%zu,", i ? "," : "", c->index);
            K3_TRY(k3_chat_buf_puts(out, idx));
            if (c->id) {
                K3_TRY(put_key_str(out, "id", c->id, strlen(c->id)));
                K3_TRY(k3_chat_buf_puts(out, ",\"type\":\"function\","));
            }
            K3_TRY(k3_chat_buf_puts(out, "\"function\":{"));
            if (c->name) {
                K3_TRY(put_key_str(out, "name", c->name, c->n_name));
                K3_TRY(k3_chat_buf_puts(out, ","));
            }
            K3_TRY(put_key_str(out, "arguments", c->args, c->n_args));
            K3_TRY(k3_chat_buf_puts(out, "}}"));
        }
        K3_TRY(k3_chat_buf_puts(out, "]"));
    }
    return k3_chat_buf_puts(out, "}");
}
