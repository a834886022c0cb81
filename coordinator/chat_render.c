/* chat_render.c — request normalisation (§5.1) and the K3 segment builder (§1).
 *
 * Owns: k3_chat_request (the parsed request + the normalised thinking switches) and
 * k3_chat_render, a port of the official encoder's `build_chat_segments` as spec/K3-CHAT.md §1
 * describes it. Output is a list of segments; control segments are the four XTML markers (and
 * image placeholders), everything else is text the tokenizer must encode with specials
 * disallowed (§4.6).
 * Does not: tokenise (k3_tokenizer does), parse model output (parser.c), sort anything except
 * where the official encoder sorts (tools, response schema: deep key sort by code point).
 * Official encoder vs the llama.cpp template (§5), followed here and tested in tests/chat/:
 *   - JSON key order is Python `sorted` (code point), not jinja `dictsort` (case-insensitive);
 *   - tool-call `arguments` strings are json.loads'ed (raw json block only when that fails; a
 *     non-object is an error) — the template renders any string as a raw block;
 *   - thinking_effort must be low|high|max (`medium` is rejected; the ggml-org template takes it);
 *   - the prompt is a segment list, not one string (no re-tokenisation with specials).
 * Request policy (ours, not the encoder's): role `developer` is rendered as `system` (the
 * encoder would silently drop it, losing the developer's instructions). Malformed requests the
 * encoder would skip or render as garbage are errors naming the field: a message that is not an
 * object, a role that is not a string, `tools` that is not a list of
 * {"function": {"name": "..."}} objects, an `image_url` part whose image_url is not an object
 * or a string. Validated before anything is rendered (issue 11): a tool's `parameters` and a
 * json_schema response format's schema must be JSON objects (the encoder dumps any value, a
 * missing schema as `null`), and a tool name (declared, in a tool call, or of a tool result)
 * must hold no control-token text (K3 special-token text, "<|" or "|>"). Unknown string roles
 * are skipped like the encoder does, with a warning. */
#include "k3_chat.h"
#include "k3_utf8.h"

#include <stdio.h>
#include <stdlib.h>

struct k3_chat_request {
    k3_chat_json *root;
    bool thinking;
    const char *effort;     /* "low" | "high" | "max" (static), NULL when thinking is off */
    bool generation_prompt; /* add_generation_prompt (default true) */
    bool continue_final;    /* continue_final_message (default false) */
    k3_chat_prompt_end end; /* where the rendered prompt ends (derived from the above) */
};

/* ---- request ------------------------------------------------------------------------- */
/* First present, non-null value of the candidates (Python `a ?? b ?? c`). */
static const k3_chat_json *first_set(const k3_chat_json *a, const k3_chat_json *b,
                                     const k3_chat_json *c) {
    if (a && a->kind != K3_JSON_NULL) return a;
    if (b && b->kind != K3_JSON_NULL) return b;
    if (c && c->kind != K3_JSON_NULL) return c;
    return NULL;
}

static const char *kind_name(const k3_chat_json *v) {
    static const char *const names[] = {
        [K3_JSON_NULL] = "null",       [K3_JSON_BOOL] = "a boolean",  [K3_JSON_INT] = "a number",
        [K3_JSON_FLOAT] = "a number",  [K3_JSON_STRING] = "a string", [K3_JSON_ARRAY] = "an array",
        [K3_JSON_OBJECT] = "an object"};
    return names[v->kind];
}

/* A tool name (declared, called, or answered) must hold no control-token text: the K3 special
 * tokens of §4.1 ([EOS], <|open|>, <|reserved_token_N|>, ...) and any "<|" or "|>" (the K2 names
 * such as <|im_end|>, the image placeholder, a marker cut in two). The renderer would put it in a
 * text segment, so it would not become a control id here, but the model was never trained on a
 * tool named like a marker, and the parser, a log or another engine (whole-string tokenisation,
 * §5.6) would read it as one. `what` names the key in the error. */
static k3_status check_tool_name(const k3_chat_json *name, const char *what) {
    if (!name || name->kind != K3_JSON_STRING) return K3_OK; /* the callers judge the kind */
    const char *tok = k3_tok_k3_special_in(name->s, name->n);
    if (!tok && memmem(name->s, name->n, "<|", 2)) tok = "<|";
    if (!tok && memmem(name->s, name->n, "|>", 2)) tok = "|>";
    if (tok)
        return K3_ERR(K3_ERR_ARG,
                      "request: %s holds control-token text '%s' (a tool name must not contain "
                      "special-token text such as <|...|> or [EOS])",
                      what, tok);
    return K3_OK;
}

/* An OpenAI tools list: null, or a list of objects each with a `function` object whose `name`
 * is a non-empty string without control-token text and whose `parameters`, when present and not
 * null, is an object (a JSON Schema; anything else would go into the tool-declare block as
 * written). `where` names it in errors ("tools", "messages[2].tools"). */
static k3_status check_tools(const k3_chat_json *tools, const char *where) {
    if (!tools || tools->kind == K3_JSON_NULL) return K3_OK;
    if (tools->kind != K3_JSON_ARRAY)
        return K3_ERR(K3_ERR_ARG, "request: %s must be a list of tool objects", where);
    for (size_t i = 0; i < tools->n_items; i++) {
        const k3_chat_json *t = tools->items[i];
        if (t->kind != K3_JSON_OBJECT)
            return K3_ERR(K3_ERR_ARG, "request: %s[%zu] must be an object", where, i);
        const k3_chat_json *fn = k3_chat_json_get(t, "function");
        if (!fn || fn->kind != K3_JSON_OBJECT)
            return K3_ERR(K3_ERR_ARG,
                          "request: %s[%zu] has no \"function\" object ({\"type\": "
                          "\"function\", \"function\": {\"name\": ...}})",
                          where, i);
        const k3_chat_json *name = k3_chat_json_get(fn, "name");
        if (!name || name->kind != K3_JSON_STRING || name->n == 0)
            return K3_ERR(K3_ERR_ARG, "request: %s[%zu].function.name must be a non-empty string",
                          where, i);
        char what[96];
        snprintf(what, sizeof what, "%s[%zu].function.name", where, i);
        K3_TRY(check_tool_name(name, what));
        const k3_chat_json *par = k3_chat_json_get(fn, "parameters");
        if (par && par->kind != K3_JSON_NULL && par->kind != K3_JSON_OBJECT)
            return K3_ERR(K3_ERR_ARG,
                          "request: %s[%zu].function.parameters must be a JSON object (a JSON "
                          "Schema), not %s",
                          where, i, kind_name(par));
    }
    return K3_OK;
}

/* response_format {"type": "json_schema", ...}: the schema is json_schema.schema, else
 * json_schema.json_schema, else json_schema itself (§1.6); *key names the one taken. NULL (key
 * "response_format.json_schema") when json_schema is absent or null. */
static const k3_chat_json *rf_schema(const k3_chat_json *rf, const char **key) {
    const k3_chat_json *w = k3_chat_json_get(rf, "json_schema");
    *key = "response_format.json_schema";
    if (!w || w->kind == K3_JSON_NULL) return NULL;
    if (k3_chat_json_get(w, "schema")) {
        *key = "response_format.json_schema.schema";
        return k3_chat_json_get(w, "schema");
    }
    if (k3_chat_json_get(w, "json_schema")) {
        *key = "response_format.json_schema.json_schema";
        return k3_chat_json_get(w, "json_schema");
    }
    return w;
}

/* The response_format's type ("json_object", "json_schema", ...): rf.type, or rf itself when it
 * is not an object (a bare string). */
static const k3_chat_json *rf_type(const k3_chat_json *rf) {
    return rf && rf->kind == K3_JSON_OBJECT ? k3_chat_json_get(rf, "type") : rf;
}

/* A json_schema response format must carry an object schema: the official encoder would render
 * a missing one as `null` and any other value as written. */
static k3_status check_response_format(const k3_chat_json *rf) {
    if (!k3_chat_json_is_str(rf_type(rf), "json_schema")) return K3_OK;
    const char *key;
    const k3_chat_json *schema = rf_schema(rf, &key);
    if (!schema)
        return K3_ERR(K3_ERR_ARG,
                      "request: %s is missing: a \"json_schema\" response format needs "
                      "{\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                      key);
    if (schema->kind != K3_JSON_OBJECT)
        return K3_ERR(K3_ERR_ARG, "request: %s must be a JSON object (a JSON Schema), not %s", key,
                      kind_name(schema));
    return K3_OK;
}

static bool known_role(const k3_chat_json *role) {
    static const char *const known[] = {"user", "system", "developer", "assistant", "tool"};
    for (size_t i = 0; i < K3_ARRAY_LEN(known); i++)
        if (k3_chat_json_is_str(role, known[i])) return true;
    return false;
}

/* The tool names of the history: an assistant's tool_calls[k].function.name (or .name of a call
 * without a function object) and a tool result's `tool` / `name`. Their kinds and presence are
 * render's to judge (it names them); here only their text. */
static k3_status check_history_names(const k3_chat_json *m, size_t i) {
    char what[96];
    const k3_chat_json *role = k3_chat_json_get(m, "role");
    if (k3_chat_json_is_str(role, "tool")) {
        static const char *const keys[] = {"tool", "name"};
        for (size_t k = 0; k < K3_ARRAY_LEN(keys); k++) {
            snprintf(what, sizeof what, "messages[%zu].%s", i, keys[k]);
            K3_TRY(check_tool_name(k3_chat_json_get(m, keys[k]), what));
        }
        return K3_OK;
    }
    const k3_chat_json *calls = k3_chat_json_get(m, "tool_calls");
    if (!k3_chat_json_is_str(role, "assistant") || !calls || calls->kind != K3_JSON_ARRAY)
        return K3_OK;
    for (size_t k = 0; k < calls->n_items; k++) {
        const k3_chat_json *fn = k3_chat_json_get(calls->items[k], "function");
        bool nested = fn && fn->kind == K3_JSON_OBJECT;
        snprintf(what, sizeof what, "messages[%zu].tool_calls[%zu]%s.name", i, k,
                 nested ? ".function" : "");
        K3_TRY(check_tool_name(k3_chat_json_get(nested ? fn : calls->items[k], "name"), what));
    }
    return K3_OK;
}

/* Messages are objects with a string role; unknown roles are warned about (render skips them). */
static k3_status check_messages(const k3_chat_json *msgs) {
    for (size_t i = 0; i < msgs->n_items; i++) {
        const k3_chat_json *m = msgs->items[i];
        if (m->kind != K3_JSON_OBJECT)
            return K3_ERR(K3_ERR_ARG, "request: messages[%zu] must be an object", i);
        const k3_chat_json *role = k3_chat_json_get(m, "role");
        if (!role) return K3_ERR(K3_ERR_ARG, "request: messages[%zu] has no \"role\"", i);
        if (role->kind != K3_JSON_STRING)
            return K3_ERR(K3_ERR_ARG, "request: messages[%zu].role must be a string", i);
        if (!known_role(role))
            K3_LOGW("request: messages[%zu]: unknown role '%.40s' is skipped (as the official "
                    "encoder does)",
                    i, role->s);
        if (k3_chat_json_is_str(role, "system") || k3_chat_json_is_str(role, "developer")) {
            char where[48];
            snprintf(where, sizeof where, "messages[%zu].tools", i);
            K3_TRY(check_tools(k3_chat_json_get(m, "tools"), where));
        }
        K3_TRY(check_history_names(m, i));
    }
    return K3_OK;
}

static bool content_renders(const k3_chat_json *v);

/* A boolean request key: absent or null = the default (the ?? rule of spec §5.1), else a bool. */
static k3_status bool_key(const k3_chat_json *root, const char *key, bool def, bool *out) {
    const k3_chat_json *v = k3_chat_json_get(root, key);
    if (v && v->kind != K3_JSON_NULL && v->kind != K3_JSON_BOOL)
        return K3_ERR(K3_ERR_ARG, "request: \"%s\" must be true or false", key);
    *out = v && v->kind == K3_JSON_BOOL ? v->b : def;
    return K3_OK;
}

/* Where the prompt ends, from the switches (add_generation_prompt, continue_final_message,
 * thinking) and the final message; also refuses the combinations that have no form. */
static k3_status prompt_end(k3_chat_request *r, const k3_chat_json *msgs) {
    if (r->continue_final && r->generation_prompt)
        return K3_ERR(
            K3_ERR_ARG,
            "request: \"continue_final_message\": true cannot be combined with "
            "\"add_generation_prompt\": true (its default): set \"add_generation_prompt\": "
            "false to continue the final assistant message");
    if (!r->continue_final) {
        r->end = !r->generation_prompt ? K3_CHAT_ENDS_CLOSED
                 : r->thinking         ? K3_CHAT_ENDS_IN_THINK
                                       : K3_CHAT_ENDS_IN_RESPONSE;
        return K3_OK;
    }
    size_t n = msgs->n_items;
    const k3_chat_json *last = n ? msgs->items[n - 1] : NULL;
    if (!last || !k3_chat_json_is_str(k3_chat_json_get(last, "role"), "assistant"))
        return K3_ERR(K3_ERR_ARG, "request: \"continue_final_message\": true needs an assistant "
                                  "message last in \"messages\"");
    if (k3_chat_json_truthy(k3_chat_json_get(last, "tool_calls")))
        return K3_ERR(K3_ERR_ARG,
                      "request: \"continue_final_message\": true cannot continue messages[%zu]: it "
                      "has tool_calls (only reasoning and content can be continued)",
                      n - 1);
    /* §1.8: open think (+ reasoning); with content, close think and open response (+ content). */
    r->end = r->thinking && !content_renders(k3_chat_json_get(last, "content"))
                 ? K3_CHAT_ENDS_IN_THINK
                 : K3_CHAT_ENDS_IN_RESPONSE;
    return K3_OK;
}

static k3_status normalise(k3_chat_request *r) {
    const k3_chat_json *root = r->root;
    if (root->kind != K3_JSON_OBJECT) return K3_ERR(K3_ERR_ARG, "request: must be a JSON object");
    const k3_chat_json *msgs = k3_chat_json_get(root, "messages");
    if (!msgs) return K3_ERR(K3_ERR_ARG, "request: missing \"messages\"");
    if (msgs->kind != K3_JSON_ARRAY)
        return K3_ERR(K3_ERR_ARG, "request: \"messages\" must be a list");
    K3_TRY(check_messages(msgs));
    K3_TRY(check_tools(k3_chat_json_get(root, "tools"), "tools"));
    K3_TRY(check_response_format(k3_chat_json_get(root, "response_format")));
    const k3_chat_json *ctk = k3_chat_json_get(root, "chat_template_kwargs");
    if (ctk && ctk->kind != K3_JSON_NULL && ctk->kind != K3_JSON_OBJECT)
        return K3_ERR(K3_ERR_ARG, "request: \"chat_template_kwargs\" must be an object");

    const k3_chat_json *th =
        first_set(k3_chat_json_get(ctk, "thinking"), k3_chat_json_get(ctk, "enable_thinking"),
                  k3_chat_json_get(root, "thinking"));
    if (th && th->kind != K3_JSON_BOOL)
        return K3_ERR(K3_ERR_ARG, "request: the thinking switch (chat_template_kwargs.thinking / "
                                  ".enable_thinking / thinking) must be true or false");
    r->thinking = th ? th->b : true;
    const k3_chat_json *re = k3_chat_json_get(root, "reasoning_effort");
    if (k3_chat_json_is_str(re, "none")) r->thinking = false; /* vLLM/OpenAI: effort none = off */
    /* vLLM's chat endpoint keys */
    K3_TRY(bool_key(root, "add_generation_prompt", true, &r->generation_prompt));
    K3_TRY(bool_key(root, "continue_final_message", false, &r->continue_final));
    /* A refused combination is reported by k3_chat_render, so that an override
     * (k3_chat_request_set_generation_prompt) can still make the request valid. */
    if (prompt_end(r, msgs) != K3_OK) k3_clear_error();
    r->effort = NULL;
    if (!r->thinking) return K3_OK;
    /* null means "not given" at every level (spec §5.1 `??`): thinking_effort: null -> max */
    const k3_chat_json *eff = first_set(k3_chat_json_get(ctk, "thinking_effort"),
                                        k3_chat_json_get(root, "thinking_effort"), re);
    if (!eff) {
        r->effort = "max";
        return K3_OK;
    } /* HF apply_chat_template default */
    static const char *const ok[] = {"low", "high", "max"};
    for (size_t i = 0; i < K3_ARRAY_LEN(ok); i++)
        if (k3_chat_json_is_str(eff, ok[i])) {
            r->effort = ok[i];
            return K3_OK;
        }
    /* Official encoder: asserts effort in {low, high, max}; `medium` (in the prose, and accepted
     * by the later ggml-org template) is rejected. */
    if (eff->kind == K3_JSON_STRING)
        return K3_ERR(K3_ERR_ARG,
                      "request: thinking_effort/reasoning_effort '%.40s' is not supported "
                      "by Kimi-K3 (use low, high, max, or reasoning_effort none)",
                      eff->s);
    return K3_ERR(K3_ERR_ARG, "request: thinking_effort/reasoning_effort must be a string "
                              "(low, high, max)");
}

k3_status k3_chat_request_parse(const char *json, size_t n_bytes, k3_chat_request **out) {
    *out = NULL;
    k3_chat_request *r = calloc(1, sizeof *r);
    if (!r) return K3_ERR(K3_ERR_NOMEM, "out of memory allocating a chat request");
    k3_status s = k3_chat_json_parse(json, n_bytes, "request", &r->root);
    if (s == K3_OK) s = normalise(r);
    if (s != K3_OK) {
        k3_chat_request_destroy(r);
        return s;
    }
    *out = r;
    return K3_OK;
}

void k3_chat_request_destroy(k3_chat_request *r) {
    if (!r) return;
    k3_chat_json_free(r->root);
    free(r);
}

bool k3_chat_request_thinking(const k3_chat_request *r) {
    return r->thinking;
}
const char *k3_chat_request_effort(const k3_chat_request *r) {
    return r->effort;
}
k3_chat_prompt_end k3_chat_request_prompt_end(const k3_chat_request *r) {
    return r->end;
}

k3_status k3_chat_request_set_generation_prompt(k3_chat_request *r, bool on) {
    r->generation_prompt = on;
    return prompt_end(r, k3_chat_json_get(r->root, "messages"));
}

const k3_chat_json *k3_chat_request_tools(const k3_chat_request *r) {
    const k3_chat_json *t = k3_chat_json_get(r->root, "tools");
    return t && t->kind == K3_JSON_ARRAY && t->n_items ? t : NULL;
}

/* ---- prompt -------------------------------------------------------------------------- */
void k3_chat_prompt_free(k3_chat_prompt *p) {
    if (!p) return;
    free(p->text);
    free(p->seg_end);
    free(p->seg_ctrl);
    memset(p, 0, sizeof *p);
}

typedef struct rctx {
    k3_chat_prompt *out;
    k3_chat_buf text;
    bool thinking;
    const k3_chat_json *tool_calls; /* the last assistant's tool_calls (NULL: none yet) */
    int64_t tool_index;             /* tool messages since that assistant */
} rctx;

static k3_status seg(rctx *c, const char *s, size_t n, bool ctrl) {
    if (n == 0) return K3_OK; /* empty strings produce no segment */
    k3_chat_prompt *p = c->out;
    if (p->n_segs == p->cap_segs) {
        size_t cap = p->cap_segs ? p->cap_segs * 2 : 64;
        size_t *e = realloc(p->seg_end, cap * sizeof *e);
        if (!e) return K3_ERR(K3_ERR_NOMEM, "out of memory growing the segment list");
        p->seg_end = e;
        bool *b = realloc(p->seg_ctrl, cap * sizeof *b);
        if (!b) return K3_ERR(K3_ERR_NOMEM, "out of memory growing the segment list");
        p->seg_ctrl = b;
        p->cap_segs = cap;
    }
    K3_TRY(k3_chat_buf_put(&c->text, s, n));
    p->seg_end[p->n_segs] = c->text.n;
    p->seg_ctrl[p->n_segs] = ctrl;
    p->n_segs++;
    return K3_OK;
}
static k3_status text(rctx *c, const char *s) {
    return seg(c, s, strlen(s), false);
}
static k3_status ctrl(rctx *c, const char *s) {
    return seg(c, s, strlen(s), true);
}

/* Python str(v) for a scalar (attribute values, ids). Containers are an error. */
static k3_status py_str(const k3_chat_json *v, const char *what, k3_chat_buf *out) {
    out->n = 0;
    switch (v ? v->kind : K3_JSON_NULL) {
    case K3_JSON_NULL:
        return k3_chat_buf_puts(out, "None");
    case K3_JSON_BOOL:
        return k3_chat_buf_puts(out, v->b ? "True" : "False");
    case K3_JSON_INT:
    case K3_JSON_STRING:
        return k3_chat_buf_put(out, v->s, v->n);
    case K3_JSON_FLOAT: {
        char f[32];
        k3_chat_json_float_repr(v->f, f);
        if (strcmp(f, "NaN") == 0)
            strcpy(f, "nan"); /* str(float) spells these differently */
        else if (strcmp(f, "Infinity") == 0)
            strcpy(f, "inf");
        else if (strcmp(f, "-Infinity") == 0)
            strcpy(f, "-inf");
        return k3_chat_buf_puts(out, f);
    }
    default:
        return K3_ERR(K3_ERR_ARG, "request: %s must be a string, not a list or object", what);
    }
}

typedef struct attr {
    const char *key;
    const k3_chat_json *val;
    const char *sval;
} attr;

/* open_tag(tag, attrs): CTRL <|open|>, TEXT tag, per attr TEXT " key" TEXT `="` TEXT
 * escape(str(v)) TEXT `"`, CTRL <|sep|>. Escaping: & first, then " (< > untouched). */
static k3_status open_tag(rctx *c, const char *tag, const attr *a, int n_attr, const char *what) {
    K3_TRY(ctrl(c, "<|open|>"));
    K3_TRY(text(c, tag));
    k3_chat_buf v = {0}, e = {0};
    k3_status s = K3_OK;
    for (int i = 0; s == K3_OK && i < n_attr; i++) {
        char key[64];
        snprintf(key, sizeof key, " %s", a[i].key);
        if (a[i].sval) {
            v.n = 0;
            s = k3_chat_buf_puts(&v, a[i].sval);
        } else
            s = py_str(a[i].val, what, &v);
        e.n = 0;
        if (!s) s = k3_chat_buf_put(&e, "", 0);
        for (size_t j = 0; s == K3_OK && j < v.n; j++) {
            if (v.p[j] == '&')
                s = k3_chat_buf_puts(&e, "&amp;");
            else if (v.p[j] == '"')
                s = k3_chat_buf_puts(&e, "&quot;");
            else
                s = k3_chat_buf_put(&e, v.p + j, 1);
        }
        if (!s) s = text(c, key);
        if (!s) s = text(c, "=\"");
        if (!s) s = seg(c, e.p, e.n, false);
        if (!s) s = text(c, "\"");
    }
    k3_chat_buf_free(&v);
    k3_chat_buf_free(&e);
    K3_TRY(s);
    return ctrl(c, "<|sep|>");
}

static k3_status close_tag(rctx *c, const char *tag) {
    K3_TRY(ctrl(c, "<|close|>"));
    K3_TRY(text(c, tag));
    return ctrl(c, "<|sep|>");
}

static k3_status end_msg(rctx *c) {
    K3_TRY(close_tag(c, "message"));
    return ctrl(c, "<|end_of_msg|>");
}

/* Wrap `body` as an internal system message of `type` (§1.5, §1.6). Bodies have no leading or
 * trailing whitespace, so the encoder's .strip() changes nothing. */
static k3_status internal_msg(rctx *c, const char *type, const char *body, size_t n) {
    attr a[] = {{"role", NULL, "system"}, {"type", NULL, type}};
    K3_TRY(open_tag(c, "message", a, 2, "type"));
    K3_TRY(seg(c, body, n, false));
    return end_msg(c);
}

/* JC(x) = json.dumps(deep_sort(x), ensure_ascii=False, separators=(",", ":")). Official
 * encoder: Python `sorted` keys (code point order); the llama.cpp template's `dictsort` is
 * case-insensitive and would put "URL" after "_x" and "id". */
static k3_status tool_declare(rctx *c, const k3_chat_json *tools, bool dynamic) {
    k3_chat_buf b = {0};
    k3_status s = k3_chat_buf_puts(
        &b, dynamic
                ? "## New Tools Available\nThe system dynamically extends the toolset via "
                  "lazy-loading.\nYou have access to all existing and extended tools.\nHere are "
                  "the specs for the extended tools.\n\n```json\n"
                : "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n");
    if (!s) s = k3_chat_json_dump(tools, K3_JSON_SORT_KEYS | K3_JSON_COMPACT, &b);
    if (!s) s = k3_chat_buf_puts(&b, "\n```");
    if (!s) s = internal_msg(c, "tool-declare", b.p, b.n);
    k3_chat_buf_free(&b);
    return s;
}

/* CONTENT: a string is one text segment; a list renders part by part (image parts become the
 * placeholder control segment, other parts their `text`); null renders nothing. */
static k3_status content(rctx *c, const k3_chat_json *v, const char *what) {
    if (!v || v->kind == K3_JSON_NULL) return K3_OK;
    if (v->kind == K3_JSON_STRING) return seg(c, v->s, v->n, false);
    if (v->kind != K3_JSON_ARRAY)
        return K3_ERR(K3_ERR_ARG, "request: %s must be a string, a list of parts or null", what);
    k3_chat_buf t = {0};
    k3_status s = K3_OK;
    for (size_t i = 0; s == K3_OK && i < v->n_items; i++) {
        const k3_chat_json *part = v->items[i];
        if (part->kind != K3_JSON_OBJECT) {
            s = K3_ERR(K3_ERR_ARG, "request: %s[%zu] must be an object", what, i);
            break;
        }
        const k3_chat_json *ty = k3_chat_json_get(part, "type");
        if (k3_chat_json_is_str(ty, "image") || k3_chat_json_is_str(ty, "image_url")) {
            const k3_chat_json *iu = k3_chat_json_get(part, "image_url");
            if (iu && iu->kind != K3_JSON_NULL && iu->kind != K3_JSON_OBJECT &&
                iu->kind != K3_JSON_STRING) {
                s = K3_ERR(K3_ERR_ARG,
                           "request: %s[%zu].image_url must be an object {\"url\": ...} or a "
                           "string",
                           what, i);
                break;
            }
            s = ctrl(c, "<|kimi_image_placeholder|>");
            continue;
        }
        const k3_chat_json *tx = k3_chat_json_get(part, "text");
        if (!tx || tx->kind == K3_JSON_NULL) continue;
        s = py_str(tx, "a content part's text", &t);
        if (!s) s = seg(c, t.p, t.n, false);
    }
    k3_chat_buf_free(&t);
    return s;
}

/* Whether CONTENT renders at least one segment (a string that is not empty, an image part, a
 * part with non-empty text); what render would refuse counts as rendering (it fails there). */
static bool content_renders(const k3_chat_json *v) {
    if (!v || v->kind == K3_JSON_NULL) return false;
    if (v->kind == K3_JSON_STRING) return v->n > 0;
    if (v->kind != K3_JSON_ARRAY) return true;
    for (size_t i = 0; i < v->n_items; i++) {
        const k3_chat_json *part = v->items[i], *ty = k3_chat_json_get(part, "type");
        if (part->kind != K3_JSON_OBJECT || k3_chat_json_is_str(ty, "image") ||
            k3_chat_json_is_str(ty, "image_url"))
            return true;
        const k3_chat_json *tx = k3_chat_json_get(part, "text");
        if (tx && tx->kind != K3_JSON_NULL && (tx->kind != K3_JSON_STRING || tx->n > 0))
            return true;
    }
    return false;
}

/* str(s).strip() != "" for valid UTF-8 bytes. */
static bool has_non_space(const char *s, size_t n) {
    const uint8_t *p = (const uint8_t *)s;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int len = k3_utf8_next(p + i, n - i, &cp);
        if (len <= 0) return true; /* not text at all: certainly not blank */
        if (!k3_py_isspace(cp)) return true;
        i += (size_t)len;
    }
    return false;
}

/* _xtml_type: bool first, then null, number, string, object, anything else array. */
static const char *xtml_type(const k3_chat_json *v) {
    switch (v->kind) {
    case K3_JSON_BOOL:
        return "boolean";
    case K3_JSON_NULL:
        return "null";
    case K3_JSON_INT:
    case K3_JSON_FLOAT:
        return "number";
    case K3_JSON_STRING:
        return "string";
    case K3_JSON_OBJECT:
        return "object";
    default:
        return "array";
    }
}

/* One tool call of an assistant message (§1.3). `i` is the 1-based index. */
static k3_status tool_call(rctx *c, const k3_chat_json *tc, size_t i, const char *where) {
    char what[96];
    snprintf(what, sizeof what, "%s.tool_calls[%zu]", where, i - 1);
    if (tc->kind != K3_JSON_OBJECT)
        return K3_ERR(K3_ERR_ARG, "request: %s must be an object", what);
    const k3_chat_json *fn = k3_chat_json_get(tc, "function");
    if (!fn || fn->kind != K3_JSON_OBJECT) fn = tc;
    const k3_chat_json *name = k3_chat_json_get(fn, "name");
    if (!name || name->kind == K3_JSON_NULL)
        return K3_ERR(K3_ERR_ARG, "request: %s has no function name", what);
    char idx[32];
    snprintf(idx, sizeof idx, "%zu", i);
    attr a[] = {{"tool", name, NULL}, {"index", NULL, idx}};
    K3_TRY(open_tag(c, "call", a, 2, "a tool call's function name"));

    /* Official argument normalisation: None or blank string -> {}; dict as is; a string is
     * json.loads'ed: an object is used, a parse failure keeps the raw text as a `json` block,
     * anything else is an error. (The llama.cpp template renders every non-blank string as a
     * raw block without parsing it.) */
    const k3_chat_json *args = k3_chat_json_get(fn, "arguments");
    k3_chat_json *parsed = NULL;
    const char *raw = NULL;
    size_t n_raw = 0;
    if (args && args->kind == K3_JSON_STRING && has_non_space(args->s, args->n)) {
        k3_status ps = k3_chat_json_parse(args->s, args->n, "arguments", &parsed);
        if (ps != K3_OK) {
            raw = args->s;
            n_raw = args->n;
            k3_clear_error();
        } else if (parsed->kind != K3_JSON_OBJECT) {
            k3_chat_json_free(parsed);
            return K3_ERR(K3_ERR_ARG, "request: %s.function.arguments is JSON but not an object",
                          what);
        }
        args = parsed;
    } else if (args && args->kind != K3_JSON_NULL && args->kind != K3_JSON_STRING &&
               args->kind != K3_JSON_OBJECT) {
        return K3_ERR(K3_ERR_ARG,
                      "request: %s.function.arguments must be an object or a JSON "
                      "object string",
                      what);
    }
    k3_status s = K3_OK;
    if (raw) {
        attr ja[] = {{"type", NULL, "object"}};
        s = open_tag(c, "json", ja, 1, "type");
        if (!s) s = seg(c, raw, n_raw, false);
        if (!s) s = close_tag(c, "json");
    } else if (args && args->kind == K3_JSON_OBJECT) {
        k3_chat_buf v = {0};
        for (size_t k = 0; s == K3_OK && k < args->n_items; k++) { /* insertion order */
            const k3_chat_json *val = args->items[k];
            attr aa[] = {{"key", args->keys[k], NULL}, {"type", NULL, xtml_type(val)}};
            s = open_tag(c, "argument", aa, 2, "argument key");
            if (s) break;
            if (val->kind == K3_JSON_STRING)
                s = seg(c, val->s, val->n, false);
            else { /* json.dumps default separators, keys not sorted */
                v.n = 0;
                s = k3_chat_json_dump(val, 0, &v);
                if (!s) s = seg(c, v.p, v.n, false);
            }
            if (!s) s = close_tag(c, "argument");
        }
        k3_chat_buf_free(&v);
    }
    k3_chat_json_free(parsed);
    K3_TRY(s);
    return close_tag(c, "call");
}

static k3_status name_attrs(const k3_chat_json *m, const char *role, attr a[2], int *n) {
    a[0] = (attr){"role", NULL, role};
    *n = 1;
    const k3_chat_json *name = k3_chat_json_get(m, "name");
    if (k3_chat_json_truthy(name)) a[(*n)++] = (attr){"name", name, NULL};
    return K3_OK;
}

/* An assistant message (§1.3), or with `open` the final one left open for continuation in the
 * §1.8 form (inferred from llama.cpp, not the official encoder, which cannot continue): open
 * `think` + reasoning, and when the message has content, close `think`, open `response` + the
 * content; nothing is closed after it (prompt_end() chose where it ends and refused tool_calls). */
static k3_status assistant(rctx *c, const k3_chat_json *m, const char *where, bool open) {
    const k3_chat_json *calls = k3_chat_json_get(m, "tool_calls");
    if (calls && calls->kind != K3_JSON_NULL && calls->kind != K3_JSON_ARRAY)
        return K3_ERR(K3_ERR_ARG, "request: %s.tool_calls must be a list", where);
    c->tool_calls = calls && calls->kind == K3_JSON_ARRAY ? calls : NULL;
    c->tool_index = 0;
    attr a[2];
    int n;
    K3_TRY(name_attrs(m, "assistant", a, &n));
    K3_TRY(open_tag(c, "message", a, n, "an assistant name"));
    const k3_chat_json *body = k3_chat_json_get(m, "content");
    if (c->thinking) { /* with thinking off the think channel is absent, not empty */
        K3_TRY(open_tag(c, "think", NULL, 0, ""));
        const k3_chat_json *r = k3_chat_json_get(m, "reasoning_content");
        if (!k3_chat_json_truthy(r)) r = k3_chat_json_get(m, "reasoning");
        if (r && r->kind != K3_JSON_NULL) {
            k3_chat_buf t = {0};
            k3_status s = py_str(r, "reasoning_content", &t);
            if (!s && has_non_space(t.p, t.n)) s = seg(c, t.p, t.n, false); /* not stripped */
            k3_chat_buf_free(&t);
            K3_TRY(s);
        }
        if (open && !content_renders(body)) return K3_OK; /* the reasoning goes on */
        K3_TRY(close_tag(c, "think"));
    }
    K3_TRY(open_tag(c, "response", NULL, 0, ""));
    char what[64];
    snprintf(what, sizeof what, "%s.content", where);
    K3_TRY(content(c, body, what));
    if (open) return K3_OK; /* the response goes on */
    K3_TRY(close_tag(c, "response"));
    if (calls && calls->kind == K3_JSON_ARRAY && calls->n_items) {
        K3_TRY(open_tag(c, "tools", NULL, 0, ""));
        for (size_t i = 0; i < calls->n_items; i++)
            K3_TRY(tool_call(c, calls->items[i], i + 1, where));
        K3_TRY(close_tag(c, "tools"));
    }
    return end_msg(c);
}

/* The function object of a tool call (tc.function if it is an object, else tc itself). */
static const k3_chat_json *call_fn(const k3_chat_json *tc) {
    const k3_chat_json *fn = k3_chat_json_get(tc, "function");
    return fn && fn->kind == K3_JSON_OBJECT ? fn : tc;
}

/* msg.get('tool_call_id', msg.get('id')): a present tool_call_id wins even when null. */
static const k3_chat_json *result_id(const k3_chat_json *m) {
    const k3_chat_json *v = k3_chat_json_get(m, "tool_call_id");
    return v ? v : k3_chat_json_get(m, "id");
}

/* str(a) == str(b) for scalars (ids may be numbers). */
static bool same_str(const k3_chat_json *a, const k3_chat_json *b) {
    k3_chat_buf x = {0}, y = {0};
    bool eq = py_str(a, "id", &x) == K3_OK && py_str(b, "id", &y) == K3_OK && x.n == y.n &&
              (x.n == 0 || memcmp(x.p, y.p, x.n) == 0);
    k3_clear_error();
    k3_chat_buf_free(&x);
    k3_chat_buf_free(&y);
    return eq;
}

static k3_status tool_msg(rctx *c, const k3_chat_json *m, const k3_chat_json *resolved,
                          const char *where) {
    c->tool_index++;
    const k3_chat_json *name = resolved;
    if (!name || name->kind == K3_JSON_NULL) {
        const k3_chat_json *t = k3_chat_json_get(m, "tool");
        name = t ? t : k3_chat_json_get(m, "name");
    }
    if ((!name || name->kind == K3_JSON_NULL) && c->tool_calls &&
        c->tool_index <= (int64_t)c->tool_calls->n_items)
        name = k3_chat_json_get(call_fn(c->tool_calls->items[c->tool_index - 1]), "name");
    if (!name || name->kind == K3_JSON_NULL)
        return K3_ERR(K3_ERR_ARG,
                      "request: %s (role tool) has no resolvable tool name: give it "
                      "`tool`/`name` or a tool_call_id of the preceding assistant's "
                      "tool_calls",
                      where);
    char idx[32];
    snprintf(idx, sizeof idx, "%lld", (long long)c->tool_index);
    attr a[] = {{"role", NULL, "tool"}, {"tool", name, NULL}, {"index", NULL, idx}};
    K3_TRY(open_tag(c, "message", a, 3, "a tool name"));
    char what[64];
    snprintf(what, sizeof what, "%s.content", where);
    K3_TRY(content(c, k3_chat_json_get(m, "content"), what));
    return end_msg(c);
}

static bool is_role(const k3_chat_json *m, const char *role) {
    return m->kind == K3_JSON_OBJECT && k3_chat_json_is_str(k3_chat_json_get(m, "role"), role);
}

/* A run of consecutive tool messages msgs[i0..i1): if every one matches (by tool_call_id) a
 * call of the last assistant, render them in call order (stable; duplicate call ids: first
 * occurrence wins) with the matched call's name; otherwise render them as given. */
static k3_status tool_run(rctx *c, const k3_chat_json *msgs, size_t i0, size_t i1) {
    bool all = c->tool_calls != NULL;
    for (size_t i = i0; all && i < i1; i++) {
        const k3_chat_json *id = result_id(msgs->items[i]);
        bool found = false;
        for (size_t k = 0; id && id->kind != K3_JSON_NULL && !found && k < c->tool_calls->n_items;
             k++) {
            const k3_chat_json *cid = k3_chat_json_get(c->tool_calls->items[k], "id");
            found = cid && cid->kind != K3_JSON_NULL && same_str(cid, id);
        }
        all = found;
    }
    char where[48];
    if (!all) {
        for (size_t i = i0; i < i1; i++) {
            snprintf(where, sizeof where, "messages[%zu]", i);
            K3_TRY(tool_msg(c, msgs->items[i], NULL, where));
        }
        return K3_OK;
    }
    const k3_chat_json *calls = c->tool_calls;
    for (size_t k = 0; k < calls->n_items; k++) {
        const k3_chat_json *cid = k3_chat_json_get(calls->items[k], "id");
        if (!cid || cid->kind == K3_JSON_NULL) continue;
        bool seen = false; /* an earlier call with the same id already took these results */
        for (size_t j = 0; !seen && j < k; j++) {
            const k3_chat_json *pid = k3_chat_json_get(calls->items[j], "id");
            seen = pid && pid->kind != K3_JSON_NULL && same_str(pid, cid);
        }
        if (seen) continue;
        const k3_chat_json *name = k3_chat_json_get(call_fn(calls->items[k]), "name");
        for (size_t i = i0; i < i1; i++) {
            const k3_chat_json *id = result_id(msgs->items[i]);
            if (!id || id->kind == K3_JSON_NULL || !same_str(id, cid)) continue;
            snprintf(where, sizeof where, "messages[%zu]", i);
            K3_TRY(tool_msg(c, msgs->items[i], name, where));
        }
    }
    return K3_OK;
}

static k3_status render_all(rctx *c, const k3_chat_request *r) {
    const k3_chat_json *root = r->root;
    const k3_chat_json *tools = k3_chat_json_get(root, "tools");
    if (k3_chat_json_truthy(tools)) K3_TRY(tool_declare(c, tools, false));
    if (c->thinking) {
        char body[512];
        int n = snprintf(body, sizeof body,
                         "`thinking_effort` guides on how much to think in your thinking channel "
                         "(not including the response channel), supported values include `low`, "
                         "`medium`, `high`, and `max`.\nNow the system is invoked with "
                         "`thinking_effort=%s`.",
                         r->effort);
        K3_ASSERT(n > 0 && n < (int)sizeof body);
        K3_TRY(internal_msg(c, "thinking-effort", body, (size_t)n));
    }

    const k3_chat_json *msgs = k3_chat_json_get(root, "messages");
    /* continue_final_message: the final (assistant) message is rendered last and left open, after
     * the internal system messages of §1.2 steps 4-5 (our placement: they address the message
     * being generated, and nothing may follow an open message). */
    size_t n_msgs = msgs->n_items - (r->continue_final ? 1 : 0);
    for (size_t i = 0; i < n_msgs; i++) {
        const k3_chat_json *m = msgs->items[i];
        char where[48];
        snprintf(where, sizeof where, "messages[%zu]", i);
        if (m->kind != K3_JSON_OBJECT) continue; /* rejected by check_messages already */
        const k3_chat_json *role = k3_chat_json_get(m, "role");
        if (!role) return K3_ERR(K3_ERR_ARG, "request: %s has no \"role\"", where);
        /* `developer` (OpenAI) is rendered as `system`: our request policy, see the file head. */
        bool sys = k3_chat_json_is_str(role, "system") || k3_chat_json_is_str(role, "developer");
        attr a[2];
        int n;
        if (k3_chat_json_is_str(role, "user") || sys) {
            const k3_chat_json *mt = k3_chat_json_get(m, "tools");
            if (sys && k3_chat_json_truthy(mt)) { /* dynamic tools; content ignored */
                K3_TRY(tool_declare(c, mt, true));
                continue;
            }
            K3_TRY(name_attrs(m, sys ? "system" : "user", a, &n));
            K3_TRY(open_tag(c, "message", a, n, "a message name"));
            char what[64];
            snprintf(what, sizeof what, "%s.content", where);
            K3_TRY(content(c, k3_chat_json_get(m, "content"), what));
            K3_TRY(end_msg(c));
        } else if (k3_chat_json_is_str(role, "assistant")) {
            K3_TRY(assistant(c, m, where, false));
        } else if (k3_chat_json_is_str(role, "tool")) {
            if (i > 0 && is_role(msgs->items[i - 1], "tool")) continue; /* inside a run */
            size_t j = i;
            while (j < n_msgs && is_role(msgs->items[j], "tool")) j++;
            K3_TRY(tool_run(c, msgs, i, j));
        } /* unknown roles are skipped, like the encoder (check_messages warned) */
    }

    const k3_chat_json *tc = k3_chat_json_get(root, "tool_choice");
    if (k3_chat_json_is_str(tc, "required")) {
        static const char b[] = "The system is invoked with `tool_choice=required`.\nYou MUST call "
                                "tools in the next message.";
        K3_TRY(internal_msg(c, "tool-choice", b, sizeof b - 1));
    } else if (k3_chat_json_is_str(tc, "none")) {
        static const char b[] = "The system is invoked with `tool_choice=none`.\nYou MUST NOT call "
                                "any tools in the next message.";
        K3_TRY(internal_msg(c, "tool-choice", b, sizeof b - 1));
    } /* an object (a named function) produces no message */

    const k3_chat_json *rf = k3_chat_json_get(root, "response_format");
    const k3_chat_json *rtype = rf_type(rf);
    static const char rf_head[] =
        "Your response must be raw JSON data without markdown code blocks "
        "(```json) or any additional formatting.";
    if (k3_chat_json_is_str(rtype, "json_object")) {
        k3_chat_buf b = {0};
        k3_status s =
            k3_chat_buf_puts(&b, "The system is invoked with `response_format=json_object`.\n");
        if (!s) s = k3_chat_buf_puts(&b, rf_head);
        if (!s) s = internal_msg(c, "response-format", b.p, b.n);
        k3_chat_buf_free(&b);
        K3_TRY(s);
    } else if (k3_chat_json_is_str(rtype, "json_schema")) {
        const char *key;
        const k3_chat_json *schema = rf_schema(rf, &key); /* an object: check_response_format */
        K3_ASSERT(schema && schema->kind == K3_JSON_OBJECT);
        k3_chat_buf b = {0};
        k3_status s =
            k3_chat_buf_puts(&b, "The system is invoked with `response_format=json_schema`.\n");
        if (!s) s = k3_chat_buf_puts(&b, rf_head);
        if (!s)
            s = k3_chat_buf_puts(&b, "\nThe JSON data must match the following schema:\n```json\n");
        if (!s) s = k3_chat_json_dump(schema, K3_JSON_SORT_KEYS | K3_JSON_COMPACT, &b);
        if (!s) s = k3_chat_buf_puts(&b, "\n```");
        if (!s) s = internal_msg(c, "response-format", b.p, b.n);
        k3_chat_buf_free(&b);
        K3_TRY(s);
    }

    if (r->continue_final) {
        char where[48];
        snprintf(where, sizeof where, "messages[%zu]", n_msgs);
        return assistant(c, msgs->items[n_msgs], where, true);
    }
    if (r->generation_prompt) {
        attr a[] = {{"role", NULL, "assistant"}};
        K3_TRY(open_tag(c, "message", a, 1, "role"));
        K3_TRY(open_tag(c, c->thinking ? "think" : "response", NULL, 0, ""));
    }
    return K3_OK;
}

k3_status k3_chat_render(k3_chat_request *r, k3_chat_prompt *out) {
    memset(out, 0, sizeof *out);
    K3_TRY(prompt_end(r, k3_chat_json_get(r->root, "messages")));
    rctx c = {.out = out, .thinking = r->thinking};
    k3_status s = render_all(&c, r);
    if (s == K3_OK) s = k3_chat_buf_put(&c.text, "", 0); /* a prompt may be empty */
    if (s != K3_OK) {
        k3_chat_buf_free(&c.text);
        k3_chat_prompt_free(out);
        return s;
    }
    out->text = c.text.p;
    out->n_bytes = c.text.n;
    return K3_OK;
}

k3_status k3_chat_encode(const k3_chat_prompt *p, const k3_tokenizer *t, k3_tok_ids *out) {
    k3_tok_segment *segs = calloc(p->n_segs + 1, sizeof *segs);
    if (!segs) return K3_ERR(K3_ERR_NOMEM, "out of memory listing %zu prompt segments", p->n_segs);
    for (size_t i = 0; i < p->n_segs; i++) {
        size_t b = i ? p->seg_end[i - 1] : 0;
        segs[i] = (k3_tok_segment){p->text + b, p->seg_end[i] - b, p->seg_ctrl[i]};
    }
    k3_status s = k3_tok_encode_segments(t, segs, p->n_segs, out);
    free(segs);
    return s;
}

k3_status k3_chat_prompt_segments_json(const k3_chat_prompt *p, k3_chat_buf *out) {
    K3_TRY(k3_chat_buf_puts(out, "["));
    for (size_t i = 0; i < p->n_segs; i++) {
        size_t b = i ? p->seg_end[i - 1] : 0;
        K3_TRY(k3_chat_buf_puts(out, i ? ",[" : "["));
        K3_TRY(k3_chat_json_dump_str(p->text + b, p->seg_end[i] - b, out));
        K3_TRY(k3_chat_buf_puts(out, p->seg_ctrl[i] ? ",true]" : ",false]"));
    }
    return k3_chat_buf_puts(out, "]");
}
