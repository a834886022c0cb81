/* test_parser.c — unit tests of coordinator/k3_parser.h (spec/K3-CHAT.md §3).
 *
 * 1. The 9 llama.cpp Kimi-K3 cases (tests/data/fixtures/chat/k3-test-chat-cases.json): tokenised
 *    with specials allowed by a tokenizer made from tests/data/vocab/o200k_base.tiktoken + the K3
 *    special layout; expected fields from the fixture (arguments compared after JSON
 *    renormalisation, and exactly as compact JSON).
 * 2. Streaming: every case fed in random id chunks (several seeds) gives the same final message
 *    as one-shot parsing, and the concatenated deltas equal the final fields.
 * 3. The extra cases of §3.6 and the type rules of §3.3 (one case each), finish reasons,
 *    UTF-8 holdback / replacement, and ids that are other specials.
 * Needs K3_TESTDATA (ctest sets it). */
#include "k3_chat.h"
#include "k3_parser.h"
#include "k3_test.h"
#include "k3_tokenizer.h"

#include <stdio.h>
#include <stdlib.h>

static k3_tokenizer *g_tok;

/* Encode `text`: spans between \x01 and \x02 are encoded as plain text (specials disallowed:
 * user-typed marker text), everything else with specials allowed (model-emitted markers). */
static void encode(const char *text, k3_tok_ids *ids) {
    ids->n = 0;
    const char *p = text;
    while (*p) {
        bool plain = *p == '\x01';
        if (plain) p++;
        const char *e = p;
        while (*e && *e != (plain ? '\x02' : '\x01')) e++;
        K3_CHECK_OK(k3_tok_encode(g_tok, p, (size_t)(e - p), !plain, ids));
        p = *e == '\x02' ? e + 1 : e;
    }
}

typedef struct expect {
    const char *reasoning; /* NULL: thinking off (no reasoning_content) */
    const char *content;
    int n_calls;
    const char *names[4];
    const char *args[4]; /* exact compact JSON (or raw block text) */
    const char *finish;
} expect;

static bool eqn(const char *a, size_t na, const char *b) {
    return strlen(b) == na && memcmp(a, b, na) == 0;
}

/* Accumulated deltas of one response. */
typedef struct acc {
    k3_chat_buf reasoning, content, args[8];
    char names[8][64];
    bool header[8];
} acc;

static void acc_add(acc *a, const k3_parser_delta *d, const char *name) {
    k3_chat_buf_put(&a->reasoning, d->reasoning, d->n_reasoning);
    k3_chat_buf_put(&a->content, d->content, d->n_content);
    for (size_t i = 0; i < d->n_calls; i++) {
        const k3_parser_call_delta *c = &d->calls[i];
        K3_CHECK(c->index < 8, "%s: call index %zu", name, c->index);
        if (c->index >= 8) continue;
        if (c->name) {
            K3_CHECK(!a->header[c->index], "%s: header of call %zu sent twice", name, c->index);
            a->header[c->index] = true;
            snprintf(a->names[c->index], 64, "%s", c->name);
        }
        K3_CHECK(a->header[c->index], "%s: arguments of call %zu before its header", name,
                 c->index);
        k3_chat_buf_put(&a->args[c->index], c->args, c->n_args);
    }
}

static void acc_free(acc *a) {
    k3_chat_buf_free(&a->reasoning);
    k3_chat_buf_free(&a->content);
    for (int i = 0; i < 8; i++) k3_chat_buf_free(&a->args[i]);
}

/* Check a finished message against `e`; `msg_json` returns its JSON for comparisons. */
static void check_message(k3_parser *p, const expect *e, const char *name) {
    k3_parser_message m;
    K3_CHECK_OK(k3_parser_message_view(p, &m));
    K3_CHECK(m.has_reasoning == (e->reasoning != NULL), "%s: has_reasoning", name);
    if (e->reasoning)
        K3_CHECK(eqn(m.reasoning, m.n_reasoning, e->reasoning), "%s: reasoning '%.*s' != '%s'",
                 name, (int)m.n_reasoning, m.reasoning, e->reasoning);
    K3_CHECK(eqn(m.content, m.n_content, e->content), "%s: content '%.*s' != '%s'", name,
             (int)m.n_content, m.content, e->content);
    K3_CHECK(m.n_calls == (size_t)e->n_calls, "%s: %zu calls, want %d", name, m.n_calls,
             e->n_calls);
    for (size_t i = 0; i < m.n_calls && i < (size_t)e->n_calls; i++) {
        K3_CHECK(strcmp(m.calls[i].name, e->names[i]) == 0, "%s: call %zu name '%s' != '%s'", name,
                 i, m.calls[i].name, e->names[i]);
        K3_CHECK(eqn(m.calls[i].arguments, m.calls[i].n_arguments, e->args[i]),
                 "%s: call %zu args '%.*s' != '%s'", name, i, (int)m.calls[i].n_arguments,
                 m.calls[i].arguments, e->args[i]);
        for (size_t j = 0; j < i; j++)
            K3_CHECK(strcmp(m.calls[i].id, m.calls[j].id) != 0, "%s: duplicate call id %s", name,
                     m.calls[i].id);
    }
    if (e->finish)
        K3_CHECK(m.finish_reason && strcmp(m.finish_reason, e->finish) == 0,
                 "%s: finish '%s' != '%s'", name, m.finish_reason ? m.finish_reason : "(null)",
                 e->finish);
    /* the message JSON is valid JSON */
    k3_chat_buf j = {0};
    K3_CHECK_OK(k3_parser_message_json(p, &j));
    k3_chat_json *v = NULL;
    K3_CHECK_OK(k3_chat_json_parse(j.p, j.n, "message", &v));
    k3_chat_json_free(v);
    k3_chat_buf_free(&j);
}

/* One-shot parse + random-split streaming (several seeds): both must give the message `e`, the
 * streamed message JSON must equal the one-shot JSON, and the deltas must add up. */
static void run_case(const char *name, bool thinking, const k3_chat_json *tools, const char *input,
                     const expect *e) {
    k3_parser_opts o = {.thinking = thinking, .tools = tools};
    k3_tok_ids ids = {0};
    encode(input, &ids);
    k3_parser *p = NULL;
    K3_CHECK_OK(k3_parser_create(&o, &p));
    K3_CHECK_OK(k3_parser_feed_ids(p, g_tok, ids.ids, ids.n));
    K3_CHECK_OK(k3_parser_finish(p));
    check_message(p, e, name);
    k3_chat_buf one = {0};
    K3_CHECK_OK(k3_parser_message_json(p, &one));
    for (uint64_t seed = 1; seed <= 6; seed++) {
        k3_rng rng;
        k3_rng_seed(&rng, seed * 7919);
        k3_parser *q = NULL;
        acc a = {0};
        K3_CHECK_OK(k3_parser_create(&o, &q));
        k3_parser_delta d;
        size_t chunks = 0;
        for (size_t i = 0; i < ids.n;) {
            size_t n = seed == 1 ? 1 : 1 + (size_t)(k3_rng_u64(&rng) % 4);
            if (i + n > ids.n) n = ids.n - i;
            K3_CHECK_OK(k3_parser_feed_ids(q, g_tok, ids.ids + i, n));
            K3_CHECK_OK(k3_parser_take_delta(q, &d));
            acc_add(&a, &d, name);
            i += n;
            chunks++;
        }
        K3_CHECK_OK(k3_parser_finish(q));
        K3_CHECK_OK(k3_parser_take_delta(q, &d));
        acc_add(&a, &d, name);
        K3_CHECK(ids.n < 4 || chunks > 1, "%s: degenerate split", name);
        k3_chat_buf streamed = {0};
        K3_CHECK_OK(k3_parser_message_json(q, &streamed));
        K3_CHECK(streamed.n == one.n && memcmp(streamed.p, one.p, one.n) == 0,
                 "%s seed %llu: streamed message %s != one-shot %s", name, (unsigned long long)seed,
                 streamed.p, one.p);
        k3_parser_message m;
        K3_CHECK_OK(k3_parser_message_view(q, &m));
        K3_CHECK(eqn(m.reasoning, m.n_reasoning, a.reasoning.p ? a.reasoning.p : ""),
                 "%s: reasoning deltas", name);
        K3_CHECK(eqn(m.content, m.n_content, a.content.p ? a.content.p : ""), "%s: content deltas",
                 name);
        for (size_t i = 0; i < m.n_calls; i++) {
            size_t k = (size_t)strtoul(m.calls[i].id + 5, NULL, 10); /* call_<stream index> */
            K3_CHECK(k < 8 && strcmp(a.names[k], m.calls[i].name) == 0, "%s: call %zu name delta",
                     name, i);
            K3_CHECK(k < 8 && eqn(m.calls[i].arguments, m.calls[i].n_arguments,
                                  a.args[k].p ? a.args[k].p : ""),
                     "%s: call %zu argument deltas '%s' != '%s'", name, i, a.args[k].p,
                     m.calls[i].arguments);
        }
        k3_chat_buf_free(&streamed);
        acc_free(&a);
        k3_parser_destroy(q);
    }
    k3_chat_buf_free(&one);
    k3_parser_destroy(p);
    k3_tok_ids_free(&ids);
}

/* ---- 1 + 2: the llama.cpp fixture ----------------------------------------------------- */
static void fixture_cases(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/fixtures/chat/k3-test-chat-cases.json", k3_test_data());
    char *text = NULL;
    size_t n = 0;
    K3_CHECK_OK(k3_read_file(path, &text, &n));
    if (!text) return;
    k3_chat_json *root = NULL;
    K3_CHECK_OK(k3_chat_json_parse(text, n, path, &root));
    k3_free(text);
    if (!root) return;
    const k3_chat_json *defs = k3_chat_json_get(root, "tool_definitions");
    const k3_chat_json *cases = k3_chat_json_get(root, "cases");
    K3_CHECK(cases && cases->n_items == 9, "fixture has %zu cases", cases ? cases->n_items : 0);
    for (size_t i = 0; cases && i < cases->n_items; i++) {
        const k3_chat_json *c = cases->items[i];
        const k3_chat_json *opt = k3_chat_json_get(c, "options"),
                           *want = k3_chat_json_get(c, "expected");
        const k3_chat_json *tnames = k3_chat_json_get(opt, "tools");
        /* the request's tools: [tool_definitions[name] for name in options.tools] */
        k3_chat_buf tj = {0};
        k3_chat_buf_puts(&tj, "[");
        for (size_t k = 0; tnames && k < tnames->n_items; k++) {
            if (k) k3_chat_buf_puts(&tj, ",");
            k3_chat_json_dump(k3_chat_json_get(defs, tnames->items[k]->s), 0, &tj);
        }
        k3_chat_buf_puts(&tj, "]");
        k3_chat_json *tools = NULL;
        K3_CHECK_OK(k3_chat_json_parse(tj.p, tj.n, "tools", &tools));
        const k3_chat_json *calls = k3_chat_json_get(want, "tool_calls");
        expect e = {.reasoning = k3_chat_json_get(want, "reasoning_content")->s,
                    .content = k3_chat_json_get(want, "content")->s,
                    .n_calls = (int)calls->n_items,
                    .finish = calls->n_items ? "tool_calls"
                              : i == 3       ? "length"
                                             : "stop"};
        for (size_t k = 0; k < calls->n_items && k < 4; k++) {
            e.names[k] = k3_chat_json_get(calls->items[k], "name")->s;
            e.args[k] = k3_chat_json_get(calls->items[k], "arguments")->s;
        }
        char name[64];
        snprintf(name, sizeof name, "fixture case %zu", i + 1);
        run_case(name, true, tools, k3_chat_json_get(c, "input")->s, &e);
        /* arguments after JSON renormalisation (the fixture's comparison) */
        k3_parser_opts o = {.thinking = true, .tools = tools};
        k3_parser *p = NULL;
        k3_tok_ids ids = {0};
        encode(k3_chat_json_get(c, "input")->s, &ids);
        K3_CHECK_OK(k3_parser_create(&o, &p));
        K3_CHECK_OK(k3_parser_feed_ids(p, g_tok, ids.ids, ids.n));
        K3_CHECK_OK(k3_parser_finish(p));
        k3_parser_message m;
        K3_CHECK_OK(k3_parser_message_view(p, &m));
        for (size_t k = 0; k < m.n_calls && k < calls->n_items; k++) {
            k3_chat_json *a = NULL, *b = NULL;
            k3_chat_buf x = {0}, y = {0};
            K3_CHECK_OK(
                k3_chat_json_parse(m.calls[k].arguments, m.calls[k].n_arguments, "ours", &a));
            K3_CHECK_OK(k3_chat_json_parse(e.args[k], strlen(e.args[k]), "fixture", &b));
            if (a && b) {
                k3_chat_json_dump(a, K3_JSON_SORT_KEYS | K3_JSON_COMPACT, &x);
                k3_chat_json_dump(b, K3_JSON_SORT_KEYS | K3_JSON_COMPACT, &y);
                K3_CHECK(x.n == y.n && memcmp(x.p, y.p, x.n) == 0, "%s: renormalised args differ",
                         name);
            }
            k3_chat_json_free(a);
            k3_chat_json_free(b);
            k3_chat_buf_free(&x);
            k3_chat_buf_free(&y);
        }
        k3_parser_destroy(p);
        k3_tok_ids_free(&ids);
        k3_chat_json_free(tools);
        k3_chat_buf_free(&tj);
    }
    k3_chat_json_free(root);
}

/* ---- 3: extra cases and type rules ----------------------------------------------------- */
#define RESP(x) "<|open|>response<|sep|>" x "<|close|>response<|sep|>"
#define CALL(tool, body)                                                                           \
    "<|open|>call tool=\"" tool "\" index=\"1\"<|sep|>" body "<|close|>call<|sep|>"
#define ARG(key, type, v)                                                                          \
    "<|open|>argument key=\"" key "\" type=\"" type "\"<|sep|>" v "<|close|>argument<|sep|>"
#define ARGN(key, v)   "<|open|>argument key=\"" key "\"<|sep|>" v "<|close|>argument<|sep|>"
#define TOOLS(x)       "<|open|>tools<|sep|>" x "<|close|>tools<|sep|>"
#define END            "<|close|>message<|sep|><|end_of_msg|>"
#define ONE_CALL(body) "r<|close|>think<|sep|>" RESP("") TOOLS(CALL("t", body)) END

static const char *TYPED_TOOLS = "[{\"type\":\"function\",\"function\":{\"name\":\"t\","
                                 "\"parameters\":{\"type\":\"object\",\"properties\":{"
                                 "\"i\":{\"type\":\"integer\"},\"s\":{\"type\":\"string\"},\"n\":{"
                                 "\"type\":[\"number\",\"null\"]},"
                                 "\"u\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"integer\"}]},"
                                 "\"sn\":{\"type\":[\"string\",\"null\"]},"
                                 "\"b\":{\"type\":\"boolean\"},\"o\":{\"type\":\"object\"}}}}}]";

typedef struct tcase {
    const char *name, *body, *args;
} tcase;

static void type_rules(void) {
    k3_chat_json *tools = NULL;
    K3_CHECK_OK(k3_chat_json_parse(TYPED_TOOLS, strlen(TYPED_TOOLS), "tools", &tools));
    static const tcase cases[] = {
        /* rule 1: type="string" -> JSON string of the raw text, not trimmed, even for an integer
           key */
        {"r1 string for integer schema", ARG("i", "string", "abc"), "{\"i\":\"abc\"}"},
        {"r1 no trim, escapes", ARG("i", "string", " 1\n\"q\"\\ \t"),
         "{\"i\":\" 1\\n\\\"q\\\"\\\\ \\t\"}"},
        {"r1 empty string", ARG("s", "string", ""), "{\"s\":\"\"}"},
        /* rule 2: other type attributes -> parse; valid + matching -> compact; else a JSON string
         */
        {"r2 number", ARG("i", "number", "1"), "{\"i\":1}"},
        {"r2 number float repr", ARG("n", "number", "3.50"), "{\"n\":3.5}"},
        {"r2 number exp", ARG("n", "number", "1e5"), "{\"n\":100000.0}"},
        {"r2 big int exact", ARG("i", "number", "123456789012345678901234567890"),
         "{\"i\":123456789012345678901234567890}"},
        {"r2 number abc -> string", ARG("i", "number", "abc"), "{\"i\":\"abc\"}"},
        {"r2 number given a JSON string -> raw as string", ARG("i", "number", "\"5\""),
         "{\"i\":\"\\\"5\\\"\"}"},
        {"r2 object compact", ARG("o", "object", "{\"a\": 1, \"b\": [1, 2]}"),
         "{\"o\":{\"a\":1,\"b\":[1,2]}}"},
        {"r2 object keeps key order", ARG("o", "object", "{\"z\": 1, \"a\": 2}"),
         "{\"o\":{\"z\":1,\"a\":2}}"},
        {"r2 object malformed", ARG("o", "object", "{\"a\": 1"), "{\"o\":\"{\\\"a\\\": 1\"}"},
        {"r2 boolean", ARG("b", "boolean", "true"), "{\"b\":true}"},
        {"r2 boolean yes -> string", ARG("b", "boolean", "yes"), "{\"b\":\"yes\"}"},
        {"r2 null", ARG("sn", "null", "null"), "{\"sn\":null}"},
        {"r2 array", ARG("a", "array", "[1, \"x\", null]"), "{\"a\":[1,\"x\",null]}"},
        {"r2 array given an object -> string", ARG("a", "array", "{}"), "{\"a\":\"{}\"}"},
        {"r2 spaces around JSON", ARG("i", "number", " 7 "), "{\"i\":7}"},
        /* rule 3: no/unknown type attribute -> the schema (incl. unions), else try JSON */
        {"r3 schema integer", ARGN("i", "42"), "{\"i\":42}"},
        {"r3 schema integer, bad -> string", ARGN("i", "4x"), "{\"i\":\"4x\"}"},
        {"r3 schema string streams raw", ARGN("s", "42"), "{\"s\":\"42\"}"},
        {"r3 schema [number,null] null", ARGN("n", "null"), "{\"n\":null}"},
        {"r3 schema [number,null] number", ARGN("n", "2.5"), "{\"n\":2.5}"},
        {"r3 schema [string,null] -> string", ARGN("sn", "null"), "{\"sn\":\"null\"}"},
        {"r3 anyOf string|integer: int", ARGN("u", "7"), "{\"u\":7}"},
        {"r3 anyOf string|integer: text", ARGN("u", "seven"), "{\"u\":\"seven\"}"},
        {"r3 no schema entry: JSON", ARGN("zz", "{\"k\": [1]}"), "{\"zz\":{\"k\":[1]}}"},
        {"r3 no schema entry: text", ARGN("zz", "hello"), "{\"zz\":\"hello\"}"},
        {"r3 unknown type attr -> schema", ARG("i", "weird", "5"), "{\"i\":5}"},
        /* rule 4: the type attribute beats the schema */
        {"r4 type null beats integer schema", ARG("i", "null", "null"), "{\"i\":null}"},
        {"r4 type number beats string schema", ARG("s", "number", "5"), "{\"s\":5}"},
        /* rule 5: order kept, unknown keys accepted, duplicates kept in order (last wins on load)
         */
        {"r5 order + unknown key", ARG("zz", "number", "1") ARG("i", "number", "2"),
         "{\"zz\":1,\"i\":2}"},
        {"r5 duplicate keys", ARG("i", "number", "1") ARG("i", "number", "2"), "{\"i\":1,\"i\":2}"},
        {"r5 no arguments", "", "{}"},
        /* rule 6: raw json block verbatim (even invalid); only as the whole body */
        {"r6 json block", "<|open|>json type=\"object\"<|sep|>{not json<|close|>json<|sep|>",
         "{not json"},
        {"r6 json block after args ignored",
         ARG("i", "number", "1") "<|open|>json type=\"object\"<|sep|>{x<|close|>json<|sep|>",
         "{\"i\":1}"},
        {"r6 args after json block ignored",
         "<|open|>json type=\"object\"<|sep|>{\"a\": 1}<|close|>json<|sep|>" ARG("i", "number",
                                                                                 "1"),
         "{\"a\": 1}"},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(cases); i++) {
        char input[1024];
        snprintf(input, sizeof input, "%s", ONE_CALL("%s"));
        char full[2048];
        snprintf(full, sizeof full, input, cases[i].body);
        expect e = {.reasoning = "r",
                    .content = "",
                    .n_calls = 1,
                    .names = {"t"},
                    .args = {cases[i].args},
                    .finish = "tool_calls"};
        run_case(cases[i].name, true, tools, full, &e);
    }
    k3_chat_json_free(tools);
}

static void extra_cases(void) {
    /* thinking off: the completion starts inside `response` */
    expect e1 = {NULL, "Hi", 0, {0}, {0}, "stop"};
    run_case("thinking off", false, NULL,
             "Hi<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>", &e1);
    expect e1b = {NULL, "Hi", 0, {0}, {0}, "stop"};
    run_case("thinking off, echoed response opener", false, NULL,
             "<|open|>response<|sep|>Hi<|close|>response<|sep|>" END, &e1b);
    /* echoed openers at offset 0 (message with a name attribute, then think) */
    expect e2 = {"why", "ok", 0, {0}, {0}, "stop"};
    run_case("echoed message (named) + think", true, NULL,
             "<|open|>message role=\"assistant\" "
             "name=\"kimi\"<|sep|><|open|>think<|sep|>why<|close|>think<|sep|>" RESP("ok") END,
             &e2);
    /* response opened without closing think */
    expect e3 = {"half", "resp", 0, {0}, {0}, "stop"};
    run_case("response without </think>", true, NULL,
             "half<|open|>response<|sep|>resp<|close|>response<|sep|>" END, &e3);
    /* truncated call: dropped, finish length */
    expect e4 = {"r", "c", 0, {0}, {0}, "length"};
    run_case("truncated call dropped", true, NULL,
             "r<|close|>think<|sep|>" RESP(
                 "c") "<|open|>tools<|sep|><|open|>call tool=\"t\" index=\"1\"<|sep|>"
                      "<|open|>argument key=\"x\" type=\"string\"<|sep|>par",
             &e4);
    /* a new call before the previous closed: the previous is dropped, the next keeps its own args
     */
    expect e5 = {"r", "", 1, {"b"}, {"{\"y\":2}"}, "tool_calls"};
    run_case("unclosed call replaced", true, NULL,
             "r<|close|>think<|sep|>" RESP(
                 "") "<|open|>tools<|sep|><|open|>call tool=\"a\" index=\"1\"<|sep|>" ARG("x",
                                                                                          "number",
                                                                                          "1")
                 CALL("b", ARG("y", "number", "2")) "<|close|>tools<|sep|>" END,
             &e5);
    /* attribute unescaping: &quot; first, then &amp; (so "&amp;quot;" stays "&quot;") */
    expect e6 = {"r", "", 1, {"we\"ird&name&quot;"}, {"{\"k&\\\"\":1}"}, "tool_calls"};
    run_case("attribute unescape", true, NULL,
             "r<|close|>think<|sep|>" RESP("")
                 TOOLS(CALL("we&quot;ird&amp;name&amp;quot;", ARG("k&amp;&quot;", "number", "1")))
                     END,
             &e6);
    /* prose with marker text encoded as ordinary ids stays content */
    expect e7 = {"r", "say <|open|>tools<|sep|> literally", 0, {0}, {0}, "stop"};
    run_case("marker text as ordinary ids", true, NULL,
             "r<|close|>think<|sep|><|open|>response<|sep|>say \x01<|open|>tools<|sep|>\x02 "
             "literally<|close|>response<|sep|>" END,
             &e7);
    /* [EOS] is a stop; other specials are never content */
    expect e8 = {"a", "bc", 0, {0}, {0}, "stop"};
    run_case("EOS stop, media ignored", true, NULL,
             "a<|close|>think<|sep|><|open|>response<|sep|>b<|media_pad|>c[EOS]ignored", &e8);
    /* text after the end is ignored; two tool sections; unicode through id splits */
    expect e9 = {"日本語 🦊", "x", 2, {"t", "u"}, {"{\"s\":\"é🦊\"}", "{}"}, "tool_calls"};
    run_case("two tools sections, unicode", true, NULL,
             "日本語 🦊<|close|>think<|sep|>" RESP("x")
                 TOOLS(CALL("t", ARG("s", "string", "é🦊"))) TOOLS(CALL("u", "")) END
             "after end",
             &e9);
    /* truncated in reasoning and in content */
    expect e10 = {"", "partial", 0, {0}, {0}, "length"};
    run_case("truncated in content", true, NULL,
             "<|close|>think<|sep|><|open|>response<|sep|>partial", &e10);
    /* whitespace between sections is dropped; content/reasoning not trimmed */
    expect e11 = {" r \n", "\n c ", 0, {0}, {0}, "stop"};
    run_case("no trimming", true, NULL, " r \n<|close|>think<|sep|>\n" RESP("\n c ") "\n" END,
             &e11);
    /* a message that ends right after think */
    expect e12 = {"only", "", 0, {0}, {0}, "stop"};
    run_case("message closed in think", true, NULL, "only<|close|>message<|sep|>", &e12);
}

/* UTF-8: bytes fed one at a time; a sequence cut by a marker becomes U+FFFD (Python replace). */
static void utf8_cases(void) {
    k3_parser_opts o = {.thinking = true};
    k3_parser *p = NULL;
    K3_CHECK_OK(k3_parser_create(&o, &p));
    const char *s = "a\xC3\xA9\xF0\x9F\xA6\x8A\xE2\x82"; /* a é 🦊 + a cut € */
    for (size_t i = 0; s[i]; i++) {
        K3_CHECK_OK(k3_parser_feed_text(p, s + i, 1));
        k3_parser_delta d;
        K3_CHECK_OK(k3_parser_take_delta(p, &d));
        k3_chat_json *v = NULL; /* every delta is valid UTF-8 on its own */
        k3_chat_buf j = {0};
        K3_CHECK_OK(k3_parser_delta_json(&d, &j));
        K3_CHECK_OK(k3_chat_json_parse(j.p, j.n, "delta", &v));
        k3_chat_json_free(v);
        k3_chat_buf_free(&j);
    }
    K3_CHECK_OK(k3_parser_feed_marker(p, K3_MARK_CLOSE));
    K3_CHECK_OK(k3_parser_feed_text(p, "think", 5));
    K3_CHECK_OK(k3_parser_feed_marker(p, K3_MARK_SEP));
    K3_CHECK_OK(k3_parser_feed_marker(p, K3_MARK_OPEN));
    K3_CHECK_OK(k3_parser_feed_text(p, "response", 8));
    K3_CHECK_OK(k3_parser_feed_marker(p, K3_MARK_SEP));
    /* Python: b"\xe2\x82A\xff\xf0\x9f\x98".decode("utf-8","replace") == "\ufffdA\ufffd\ufffd" */
    K3_CHECK_OK(k3_parser_feed_text(p,
                                    "\xE2\x82"
                                    "A\xFF\xF0\x9F\x98",
                                    7));
    K3_CHECK_OK(k3_parser_finish(p));
    k3_parser_message m;
    K3_CHECK_OK(k3_parser_message_view(p, &m));
    K3_CHECK(eqn(m.reasoning, m.n_reasoning, "a\xC3\xA9\xF0\x9F\xA6\x8A\xEF\xBF\xBD"),
             "cut sequence at a marker");
    K3_CHECK(eqn(m.content, m.n_content,
                 "\xEF\xBF\xBD"
                 "A\xEF\xBF\xBD\xEF\xBF\xBD"),
             "replace semantics: '%.*s'", (int)m.n_content, m.content);
    K3_CHECK(strcmp(m.finish_reason, "length") == 0, "finish length");
    K3_CHECK_ERR(k3_parser_feed_text(p, "x", 1), K3_ERR_STATE, "after finish");
    k3_parser_destroy(p);
    k3_parser_destroy(NULL);
}

/* The request drives the initial state (the renderer's thinking bit). */
static void request_state(void) {
    const char *req =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"reasoning_effort\":\"none\"}";
    k3_chat_request *r = NULL;
    K3_CHECK_OK(k3_chat_request_parse(req, strlen(req), &r));
    k3_parser *p = NULL;
    K3_CHECK_OK(k3_parser_create_for(r, &p));
    K3_CHECK_OK(k3_parser_feed_text(p, "Hello", 5));
    K3_CHECK_OK(k3_parser_finish(p));
    k3_parser_message m;
    K3_CHECK_OK(k3_parser_message_view(p, &m));
    K3_CHECK(!m.has_reasoning && eqn(m.content, m.n_content, "Hello"),
             "thinking off from the request");
    k3_parser_destroy(p);
    k3_chat_request_destroy(r);
    /* a continued message (continue_final_message) that ends inside `response`: the completion
     * is content from its first byte, though thinking is on (reasoning_content reported, "") */
    req = "{\"messages\":[{\"role\":\"assistant\",\"content\":\"The an\"}],"
          "\"continue_final_message\":true,\"add_generation_prompt\":false}";
    r = NULL;
    K3_CHECK_OK(k3_chat_request_parse(req, strlen(req), &r));
    p = NULL;
    K3_CHECK_OK(k3_parser_create_for(r, &p));
    K3_CHECK_OK(k3_parser_feed_text(p, "swer", 4));
    K3_CHECK_OK(k3_parser_finish(p));
    K3_CHECK_OK(k3_parser_message_view(p, &m));
    K3_CHECK(m.has_reasoning && m.n_reasoning == 0 && eqn(m.content, m.n_content, "swer"),
             "a continued response starts in content");
    k3_parser_destroy(p);
    k3_chat_request_destroy(r);
}

/* U+0000 is ordinary text: in reasoning, content, a tool name, an argument key and value, and a
 * raw json block it survives, and the message JSON escapes it (\u0000) instead of ending there. */
static void nul_cases(void) {
    const char tools[] = "[{\"type\":\"function\",\"function\":{\"name\":\"f\\u0000g\","
                         "\"parameters\":{\"properties\":{\"k\\u0000\":{\"type\":\"integer\"}}}}}]";
    k3_chat_json *tj = NULL;
    K3_CHECK_OK(k3_chat_json_parse(tools, sizeof tools - 1, "tools", &tj));
    k3_parser_opts o = {.thinking = true, .tools = tj};
    k3_parser *p = NULL;
    K3_CHECK_OK(k3_parser_create(&o, &p));
    static const char gen[] =
        "r\0s<|close|>think<|sep|><|open|>response<|sep|>c\0<|close|>response<|sep|><|open|>tools"
        "<|sep|><|open|>call tool=\"f\0g\" index=\"1\"<|sep|><|open|>argument key=\"k\0\"<|sep|>5"
        "<|close|>argument<|sep|><|open|>argument key=\"v\" type=\"string\"<|sep|>x\0<|close|>"
        "argument<|sep|><|close|>call<|sep|><|open|>call tool=\"h\" index=\"2\"<|sep|><|open|>json "
        "type=\"object\"<|sep|>{\"q\0\"<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|"
        ">";
    k3_tok_ids ids = {0};
    K3_CHECK_OK(k3_tok_encode(g_tok, gen, sizeof gen - 1, true, &ids));
    K3_CHECK_OK(k3_parser_feed_ids(p, g_tok, ids.ids, ids.n));
    K3_CHECK_OK(k3_parser_finish(p));
    k3_parser_message m;
    K3_CHECK_OK(k3_parser_message_view(p, &m));
    K3_CHECK(m.n_reasoning == 3 && memcmp(m.reasoning, "r\0s", 3) == 0, "NUL in reasoning");
    K3_CHECK(m.n_content == 2 && memcmp(m.content, "c\0", 2) == 0, "NUL in content");
    K3_CHECK(m.n_calls == 2 && m.calls[0].n_name == 3 && memcmp(m.calls[0].name, "f\0g", 3) == 0,
             "NUL in a tool name");
    /* the key with NUL found its schema (integer): 5 stays a number */
    static const char args0[] = "{\"k\\u0000\":5,\"v\":\"x\\u0000\"}";
    K3_CHECK(m.n_calls == 2 && m.calls[0].n_arguments == sizeof args0 - 1 &&
                 memcmp(m.calls[0].arguments, args0, sizeof args0 - 1) == 0,
             "arguments: %.*s", m.n_calls ? (int)m.calls[0].n_arguments : 0,
             m.n_calls ? m.calls[0].arguments : "");
    K3_CHECK(m.n_calls == 2 && m.calls[1].n_arguments == 5 &&
                 memcmp(m.calls[1].arguments, "{\"q\0\"", 5) == 0,
             "raw json block verbatim");
    k3_chat_buf j = {0};
    K3_CHECK_OK(k3_parser_message_json(p, &j));
    k3_chat_json *v = NULL;
    K3_CHECK_OK(k3_chat_json_parse(j.p, j.n, "message", &v));
    const k3_chat_json *calls = k3_chat_json_get(v, "tool_calls");
    const k3_chat_json *name =
        calls && calls->n_items
            ? k3_chat_json_get(k3_chat_json_get(calls->items[0], "function"), "name")
            : NULL;
    K3_CHECK(name && name->n == 3 && memcmp(name->s, "f\0g", 3) == 0, "name \\u0000 in the JSON");
    k3_chat_json_free(v);
    k3_chat_buf_free(&j);
    k3_tok_ids_free(&ids);
    k3_parser_destroy(p);
    k3_chat_json_free(tj);
}

int main(void) {
    char vocab[1024];
    snprintf(vocab, sizeof vocab, "%s/vocab/o200k_base.tiktoken", k3_test_data());
    K3_CHECK_OK(k3_tok_create_tiktoken(&g_tok, vocab, NULL, K3_TOK_K3_LAYOUT, NULL));
    if (!g_tok) return k3_test_done("parser");
    K3_CHECK(k3_tok_special_id(g_tok, "<|open|>") >= 0, "K3 specials present");
    fixture_cases();
    type_rules();
    extra_cases();
    utf8_cases();
    request_state();
    nul_cases();
    k3_tok_destroy(g_tok);
    return k3_test_done("parser");
}
