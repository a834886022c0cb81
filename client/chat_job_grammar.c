/* chat_job_grammar.c — the structured-output keys of a chat request -> a compiled grammar for the
 * sampler (k3_grammar.h), shared by `k3 serve`, `k3 batch` and `k3 run --chat` through k3_job.
 *
 * Keys: response_format {"type": "text" | "json_object" | "json_schema"}, tool_choice ("auto" |
 * "none" | "required" | {"type": "function", "function": {"name"}}), parallel_tool_calls, and
 * vLLM's structured_outputs {"json" | "regex" | "choice" | "json_object"} or its older
 * guided_json / guided_regex / guided_choice. At most one content constraint per request. A key
 * that asks for something unsupported (guided_grammar, structured_outputs.grammar, an
 * unsupported schema keyword) is a 400 naming it: nothing is silently ignored.
 * The grammar exists only when a request asks for one (unconstrained requests cost nothing). */
#include "chat_job.h"

#include <stdio.h>
#include <stdlib.h>

static const k3_chat_json *key(const k3_chat_json *o, const char *k) {
    const k3_chat_json *v = k3_chat_json_get(o, k);
    return v && v->kind != K3_JSON_NULL ? v : NULL;
}

k3_status k3_job_grammar_cache(const k3_tokenizer *tok, int64_t n_vocab, k3_grammar_cache **out) {
    k3_grammar_vocab *v = NULL;
    K3_TRY(k3_grammar_vocab_create(tok, n_vocab, &v));
    k3_status st = k3_grammar_cache_create(v, 64, out);
    if (st != K3_OK) k3_grammar_vocab_destroy(v);
    return st;
}

#define BAD(...) K3_ERR(K3_ERR_FORMAT, __VA_ARGS__)

/* A schema given as JSON text (vLLM accepts guided_json as a string): parsed into *own. */
static k3_status schema_of(const k3_chat_json *v, const char *name, const char *what,
                           k3_chat_json **own, const k3_chat_json **out) {
    if (v->kind == K3_JSON_STRING) {
        if (k3_chat_json_parse(v->s, v->n, name, own) != K3_OK)
            return BAD("%s: request key '%s': %s", what, name, k3_last_error());
        v = *own;
    }
    if (v->kind != K3_JSON_OBJECT && v->kind != K3_JSON_BOOL)
        return BAD("%s: request key '%s' must be a JSON Schema object", what, name);
    *out = v;
    return K3_OK;
}

/* The content constraint: at most one of the keys. */
static k3_status content_keys(const k3_chat_json *doc, const char *what, k3_grammar_spec *s,
                              k3_chat_json **own, const char **from) {
    const k3_chat_json *rf = key(doc, "response_format"), *so = key(doc, "structured_outputs");
    static const char *const REFUSED[] = {"guided_grammar", "guided_decoding_backend_grammar",
                                          NULL};
    for (int i = 0; REFUSED[i]; i++)
        if (key(doc, REFUSED[i]))
            return BAD("%s: request key '%s' is not supported (json, regex and choice are)", what,
                       REFUSED[i]);
    const char *name = NULL;
    int n = 0;
    if (rf) {
        const k3_chat_json *t = key(rf, "type");
        if (!t || t->kind != K3_JSON_STRING)
            return BAD("%s: request key 'response_format.type' must be a string", what);
        if (!strcmp(t->s, "json_object")) {
            s->content = K3_GC_JSON, n++, name = "response_format";
        } else if (!strcmp(t->s, "json_schema")) {
            const k3_chat_json *js = key(rf, "json_schema"), *sc = key(js, "schema");
            if (!sc)
                return BAD("%s: request key 'response_format.json_schema.schema' is required",
                           what);
            K3_TRY(schema_of(sc, "response_format.json_schema.schema", what, own, &s->schema));
            s->content = K3_GC_JSON, n++, name = "response_format.json_schema.schema";
        } else if (strcmp(t->s, "text")) {
            return BAD("%s: request key 'response_format.type': '%s' is not one of text, "
                       "json_object, json_schema",
                       what, t->s);
        }
    }
    if (so && so->kind != K3_JSON_OBJECT)
        return BAD("%s: request key 'structured_outputs' must be an object", what);
    for (size_t i = 0; so && i < so->n_items; i++) {
        const char *k = so->keys[i]->s;
        if (so->items[i]->kind == K3_JSON_NULL) continue;
        if (!strcmp(k, "grammar") || !strcmp(k, "structural_tag"))
            return BAD("%s: request key 'structured_outputs.%s' is not supported (json, regex, "
                       "choice and json_object are)",
                       what, k);
    }
    struct {
        const char *a, *b; /* structured_outputs.<a> or the older guided_<a> */
        k3_grammar_content c;
    } K[] = {{"json", "guided_json", K3_GC_JSON},
             {"regex", "guided_regex", K3_GC_REGEX},
             {"choice", "guided_choice", K3_GC_CHOICE},
             {"json_object", "guided_json_object", K3_GC_JSON}};
    for (size_t i = 0; i < sizeof K / sizeof K[0]; i++)
        for (int older = 0; older < 2; older++) {
            const char *nm = older ? K[i].b : K[i].a;
            const k3_chat_json *v = older ? key(doc, K[i].b) : key(so, K[i].a);
            if (!v) continue;
            n++, name = nm, s->content = K[i].c;
            if (K[i].c == K3_GC_JSON && i == 0) {
                K3_TRY(schema_of(v, nm, what, own, &s->schema));
            } else if (K[i].c == K3_GC_REGEX) {
                if (v->kind != K3_JSON_STRING || strlen(v->s) != v->n)
                    return BAD("%s: request key '%s' must be a string", what, nm);
                s->regex = v->s;
            } else if (K[i].c == K3_GC_CHOICE) {
                if (v->kind != K3_JSON_ARRAY || !v->n_items)
                    return BAD("%s: request key '%s' must be a non-empty array of strings", what,
                               nm);
                s->choices = v;
            } else if (!k3_chat_json_truthy(v)) {
                n--, s->content = K3_GC_FREE; /* json_object: false */
            }
        }
    if (n > 1)
        return BAD("%s: more than one structured-output constraint (response_format, "
                   "structured_outputs, guided_*): give one",
                   what);
    *from = name;
    return K3_OK;
}

k3_status k3_job_grammar_check(const k3_chat_json *doc, const char *what) {
    if (!doc) return K3_OK;
    k3_grammar_spec s = {.content = K3_GC_FREE};
    k3_chat_json *own = NULL;
    const char *from = NULL;
    k3_status st = content_keys(doc, what, &s, &own, &from);
    if (st == K3_ERR_NOMEM) return st;
    /* a key refused here is refused, with the same words, by k3_job_grammar later */
    const char *bad = NULL;
    char where[64];
    if (st == K3_OK && s.content == K3_GC_JSON && s.schema) {
        st = k3_grammar_schema_check(s.schema, from);
        bad = from;
    }
    const k3_chat_json *tc = key(doc, "tool_choice"), *tools = key(doc, "tools");
    const bool want = s.content != K3_GC_FREE || (tc && !k3_chat_json_is_str(tc, "auto"));
    for (size_t i = 0;
         st == K3_OK && want && tools && tools->kind == K3_JSON_ARRAY && i < tools->n_items; i++) {
        snprintf(where, sizeof where, "tools[%zu].function.parameters", i);
        st = k3_grammar_schema_check(key(key(tools->items[i], "function"), "parameters"), where);
        bad = where;
    }
    k3_chat_json_free(own);
    if (st == K3_OK || st == K3_ERR_NOMEM || !bad) return st == K3_ERR_NOMEM ? st : K3_OK;
    char why[512];
    snprintf(why, sizeof why, "%s", k3_last_error());
    return BAD("%s: %s", what, why);
}

k3_status k3_job_grammar(k3_job *j, k3_grammar_cache *cache, const char *what) {
    const k3_chat_json *doc = j->doc;
    if (!doc) return K3_OK;
    k3_grammar_spec s = {.content = K3_GC_FREE, .tools_mode = K3_GT_ANY};
    k3_chat_json *own = NULL;
    const char *from = NULL;
    k3_status st = content_keys(doc, what, &s, &own, &from);
    const k3_chat_json *tc = key(doc, "tool_choice"), *tools = key(doc, "tools"),
                       *ptc = key(doc, "parallel_tool_calls");
    bool want = s.content != K3_GC_FREE;
    if (st == K3_OK && tc) {
        if (k3_chat_json_is_str(tc, "required")) {
            s.tools_mode = K3_GT_REQUIRED, want = true;
        } else if (k3_chat_json_is_str(tc, "none")) {
            s.tools_mode = K3_GT_NONE, want = true;
        } else if (tc->kind == K3_JSON_OBJECT) {
            const k3_chat_json *nm = key(key(tc, "function"), "name");
            if (!nm || nm->kind != K3_JSON_STRING)
                st = BAD("%s: request key 'tool_choice.function.name' must be a string", what);
            else
                s.tools_mode = K3_GT_REQUIRED, s.tool_name = nm->s, s.single_call = true,
                want = true;
        } else if (!k3_chat_json_is_str(tc, "auto")) {
            st = BAD("%s: request key 'tool_choice' must be \"auto\", \"none\", \"required\" or "
                     "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                     what);
        }
    }
    if (st == K3_OK && s.tools_mode == K3_GT_REQUIRED &&
        (!tools || tools->kind != K3_JSON_ARRAY || !tools->n_items))
        st = BAD("%s: request key 'tool_choice' asks for a tool call but 'tools' is empty", what);
    if (st == K3_OK && want && !j->req)
        st = BAD("%s: structured outputs (response_format, tool_choice, structured_outputs, "
                 "guided_*) are for /v1/chat/completions",
                 what);
    if (st == K3_OK && want && !cache)
        st = K3_ERR(K3_ERR_INTERNAL, "%s: structured outputs without a grammar cache", what);
    if (st == K3_OK && want) {
        k3_chat_prompt_end pe = k3_chat_request_prompt_end(j->req);
        if (pe == K3_CHAT_ENDS_CLOSED || k3_chat_json_truthy(key(doc, "continue_final_message")))
            st = BAD("%s: structured outputs need the assistant's generation prompt (not "
                     "add_generation_prompt false, not continue_final_message)",
                     what);
        s.thinking = pe == K3_CHAT_ENDS_IN_THINK;
    }
    if (st == K3_OK && want) {
        s.tools = tools;
        if (ptc && ptc->kind == K3_JSON_BOOL && !ptc->b) s.single_call = true;
        if (s.tools_mode == K3_GT_REQUIRED && s.content == K3_GC_FREE) s.content = K3_GC_NONE;
        s.what = from ? from : "tools";
        k3_grammar *g = NULL;
        bool hit;
        st = k3_grammar_cache_get(cache, &s, &g, &hit);
        if (st == K3_OK) {
            j->grammar = g;
            j->sp.grammar = g;
        } else if (st != K3_ERR_NOMEM) {
            char why[512];
            snprintf(why, sizeof why, "%s", k3_last_error());
            st = BAD("%s: %s", what, why);
        }
    }
    k3_chat_json_free(own);
    return st;
}
