/* test_chat.c — unit tests of coordinator/k3_chat.h that the jinja comparison cannot reach.
 *
 * 1. JSON reader/writer vs Python json semantics (expected strings are what CPython 3.11's
 *    json.loads/json.dumps(ensure_ascii=False) give; each noted inline): lexemes, duplicates,
 *    escapes, NUL, float repr; and the rejections (with the offending byte named).
 * 2. Request normalisation through the API (thinking bit, effort) and its errors.
 * 3. Prompt segments: the §1.7 granularity of the generation prompt, control flags.
 * The byte-exact prompt comparison is tests/chat/vs_jinja.py. */
#include "k3_chat.h"
#include "k3_test.h"

#include <stdlib.h>

static void dump_is(const char *in, int flags, const char *want) {
    k3_chat_json *v = NULL;
    K3_CHECK_OK(k3_chat_json_parse(in, strlen(in), "t", &v));
    if (!v) return;
    k3_chat_buf b = {0};
    K3_CHECK_OK(k3_chat_json_dump(v, flags, &b));
    K3_CHECK(b.p && strcmp(b.p, want) == 0, "dump(%s) = %s, want %s", in, b.p, want);
    k3_chat_buf_free(&b);
    k3_chat_json_free(v);
}

static void parse_fails(const char *in, size_t n, const char *needle) {
    k3_chat_json *v = NULL;
    K3_CHECK_ERR(k3_chat_json_parse(in, n, "req.json", &v), K3_ERR_FORMAT, needle);
    K3_CHECK(v == NULL, "no tree on error");
    K3_CHECK(strstr(k3_last_error(), "req.json") != NULL, "error names the source: %s",
             k3_last_error());
}

static void json_cases(void) {
    /* json.dumps(json.loads(x)) */
    dump_is("[1.0, 1e5, -0, -0.0, 1E-5, 0.0001, 1e16, 1e15, 123456789012345678901234567890]", 0,
            "[1.0, 100000.0, 0, -0.0, 1e-05, 0.0001, 1e+16, 1000000000000000.0, "
            "123456789012345678901234567890]");
    dump_is("[NaN, Infinity, -Infinity, 1e400]", K3_JSON_COMPACT,
            "[NaN,Infinity,-Infinity,Infinity]");
    dump_is("{\"b\": 1, \"a\": 2, \"b\": 3}", 0,
            "{\"b\": 3, \"a\": 2}"); /* first place, last value */
    dump_is("{\"b\": 1, \"a\": {\"d\": 1, \"C\": 2}}", K3_JSON_SORT_KEYS | K3_JSON_COMPACT,
            "{\"a\":{\"C\":2,\"d\":1},\"b\":1}");
    dump_is("{\"é\": 1, \"z\": 2, \"Z\": 3, \"\": 4}", K3_JSON_SORT_KEYS,
            "{\"\": 4, \"Z\": 3, \"z\": 2, \"é\": 1}");
    dump_is("\"\\u0000\\u001f\\u007f\\/\\b\\f\\n\\r\\t\\\"\\\\\\u00e9\\ud83e\\udd8a\"", 0,
            "\"\\u0000\\u001f\x7f/\\b\\f\\n\\r\\t\\\"\\\\é🦊\"");
    dump_is(" \t\n\r[ ] ", 0, "[]");
    dump_is("[[], {}, [{}]]", 0, "[[], {}, [{}]]");
    /* rejections */
    parse_fails("[1,]", 4, "expected a value");
    parse_fails("{\"a\" 1}", 7, "expected ':'");
    parse_fails("[1] x", 5, "extra data");
    parse_fails("\"a\nb\"", 5, "control character");
    parse_fails("\"\\ud800\"", 8, "lone surrogate");
    parse_fails("\"\xff\"", 3, "invalid UTF-8");
    parse_fails("\"\xed\xa0\x80\"", 5, "invalid UTF-8"); /* an encoded surrogate */
    parse_fails("01", 2, "extra data");
    parse_fails("[.5]", 4, "expected a value");
    parse_fails("", 0, "unexpected end");
    parse_fails("\"abc", 4, "unterminated");
    char deep[1202];
    memset(deep, '[', 600);
    memset(deep + 600, ']', 600);
    parse_fails(deep, 1200, "too deep");
    /* embedded NUL survives */
    k3_chat_json *v = NULL;
    K3_CHECK_OK(k3_chat_json_parse("\"a\\u0000b\"", 10, "t", &v));
    K3_CHECK(v && v->n == 3 && v->s[1] == 0, "NUL kept");
    K3_CHECK(!k3_chat_json_truthy(NULL), "absent is falsy");
    k3_chat_json_free(v);
    k3_chat_json_free(NULL);
    /* Python truthiness */
    static const char *const falsy[] = {"null", "false", "0", "-0", "0.0", "\"\"", "[]", "{}"};
    static const char *const truthy[] = {"true", "1", "0.5", "\" \"", "[0]", "{\"a\":0}", "NaN"};
    for (size_t i = 0; i < K3_ARRAY_LEN(falsy) + K3_ARRAY_LEN(truthy); i++) {
        bool want = i >= K3_ARRAY_LEN(falsy);
        const char *s = want ? truthy[i - K3_ARRAY_LEN(falsy)] : falsy[i];
        K3_CHECK_OK(k3_chat_json_parse(s, strlen(s), "t", &v));
        K3_CHECK(k3_chat_json_truthy(v) == want, "truthy(%s)", s);
        k3_chat_json_free(v);
    }
}

/* Render with add_generation_prompt forced on or off (what `k3 render --no-generation-prompt`
 * does). */
static k3_status render_gen(k3_chat_request *r, bool gen, k3_chat_prompt *p) {
    k3_status s = k3_chat_request_set_generation_prompt(r, gen);
    return s != K3_OK ? s : k3_chat_render(r, p);
}

static k3_chat_request *req(const char *json) {
    k3_chat_request *r = NULL;
    K3_CHECK_OK(k3_chat_request_parse(json, strlen(json), &r));
    return r;
}

/* Review: malformed requests the encoder would skip or render as garbage are errors naming the
 * field and its index (k3 policy, chat_render.c head). image_url errors come at render. */
static void malformed_cases(void) {
    static const struct {
        const char *json, *needle;
    } bad[] = {
        {"{\"messages\":[1]}", "request: messages[0] must be an object"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},\"x\"]}",
         "request: messages[1] must be an object"},
        {"{\"messages\":[{\"role\":5,\"content\":\"a\"}]}",
         "request: messages[0].role must be a string"},
        {"{\"messages\":[{\"content\":\"a\"}]}", "request: messages[0] has no \"role\""},
        {"{\"messages\":[],\"tools\":5}", "request: tools must be a list"},
        {"{\"messages\":[],\"tools\":{}}", "request: tools must be a list"},
        {"{\"messages\":[],\"tools\":[5]}", "request: tools[0] must be an object"},
        {"{\"messages\":[],\"tools\":[{\"type\":\"function\"}]}",
         "request: tools[0] has no \"function\" object"},
        {"{\"messages\":[],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}},"
         "{\"type\":\"function\",\"function\":{\"description\":\"d\"}}]}",
         "request: tools[1].function.name must be a non-empty string"},
        {"{\"messages\":[],\"tools\":[{\"function\":{\"name\":7}}]}",
         "request: tools[0].function.name"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"system\","
         "\"tools\":[{\"type\":\"function\"}]}]}",
         "request: messages[1].tools[0] has no \"function\" object"},
        /* issue 11: validated before rendering (parameters and schemas are objects, tool names
         * hold no control-token text) */
        {"{\"messages\":[],\"tools\":[{\"function\":{\"name\":\"f\",\"parameters\":\"{}\"}}]}",
         "request: tools[0].function.parameters must be a JSON object (a JSON Schema), not a "
         "string"},
        {"{\"messages\":[],\"tools\":[{\"function\":{\"name\":\"f\",\"parameters\":{}}},"
         "{\"function\":{\"name\":\"g\",\"parameters\":[{}]}}]}",
         "request: tools[1].function.parameters must be a JSON object (a JSON Schema), not an "
         "array"},
        {"{\"messages\":[],\"tools\":[{\"function\":{\"name\":\"f\",\"parameters\":1.5}}]}",
         "tools[0].function.parameters must be a JSON object (a JSON Schema), not a number"},
        {"{\"messages\":[],\"tools\":[{\"function\":{\"name\":\"f\",\"parameters\":false}}]}",
         "not a boolean"},
        {"{\"messages\":[{\"role\":\"developer\",\"tools\":[{\"function\":{\"name\":\"f\","
         "\"parameters\":3}}]}]}",
         "request: messages[0].tools[0].function.parameters must be a JSON object"},
        {"{\"messages\":[],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{"
         "\"name\":\"x\",\"schema\":\"{}\"}}}",
         "request: response_format.json_schema.schema must be a JSON object (a JSON Schema), not a "
         "string"},
        {"{\"messages\":[],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{"
         "\"schema\":null}}}",
         "request: response_format.json_schema.schema must be a JSON object (a JSON Schema), not "
         "null"},
        {"{\"messages\":[],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{"
         "\"json_schema\":[]}}}",
         "request: response_format.json_schema.json_schema must be a JSON object"},
        {"{\"messages\":[],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":7}}",
         "request: response_format.json_schema must be a JSON object (a JSON Schema), not a "
         "number"},
        {"{\"messages\":[],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":null}}",
         "request: response_format.json_schema is missing"},
        {"{\"messages\":[],\"response_format\":\"json_schema\"}",
         "request: response_format.json_schema is missing"},
        {"{\"messages\":[],\"tools\":[{\"function\":{\"name\":\"get<|open|>w\"}}]}",
         "request: tools[0].function.name holds control-token text '<|open|>'"},
        {"{\"messages\":[],\"tools\":[{\"function\":{\"name\":\"f\"}},{\"function\":{\"name\":"
         "\"[EOS]\"}}]}",
         "request: tools[1].function.name holds control-token text '[EOS]'"},
        {"{\"messages\":[],\"tools\":[{\"function\":{\"name\":\"f<|im_end|>\"}}]}",
         "tools[0].function.name holds control-token text '<|'"},
        {"{\"messages\":[],\"tools\":[{\"function\":{\"name\":\"f|>\"}}]}",
         "tools[0].function.name holds control-token text '|>'"},
        {"{\"messages\":[],\"tools\":[{\"function\":{\"name\":\"a[start_header_id]\"}}]}",
         "control-token text '[start_header_id]'"},
        {"{\"messages\":[],\"tools\":[{\"function\":{\"name\":\"<osagent_mode>\"}}]}",
         "control-token text '<osagent_mode>'"},
        {"{\"messages\":[{\"role\":\"system\",\"tools\":[{\"function\":{\"name\":"
         "\"x<|reserved_token_163700|>\"}}]}]}",
         "request: messages[0].tools[0].function.name holds control-token text "
         "'<|reserved_token_N|>'"},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(bad); i++) {
        k3_chat_request *r = NULL;
        K3_CHECK_ERR(k3_chat_request_parse(bad[i].json, strlen(bad[i].json), &r), K3_ERR_ARG,
                     bad[i].needle);
        K3_CHECK(r == NULL, "no request on error: %s", bad[i].json);
        k3_chat_request_destroy(r);
    }
    /* accepted: null/empty tools, unknown string roles (skipped, with a warning on stderr) */
    k3_chat_request *r = req("{\"messages\":[{\"role\":\"narrator\",\"content\":\"z\"},"
                             "{\"role\":\"user\",\"content\":\"a\"}],\"tools\":null}");
    k3_chat_prompt p;
    if (r) {
        K3_CHECK_OK(render_gen(r, false, &p));
        K3_CHECK(p.text && !strstr(p.text, "narrator") && !strstr(p.text, "z<") &&
                     strstr(p.text, "role=\"user\""),
                 "unknown role skipped: %s", p.text ? p.text : "");
        k3_chat_prompt_free(&p);
        k3_chat_request_destroy(r);
    }
    k3_chat_request_destroy(req("{\"messages\":[],\"tools\":[]}"));
    /* accepted: parameters absent or null, object schemas from each place, a json_object or a
     * text format without a schema, names with brackets and bars that are no special token */
    static const char *const valid[] = {
        "{\"messages\":[],\"tools\":[{\"function\":{\"name\":\"f\"}},{\"function\":{\"name\":"
        "\"g\",\"parameters\":null}},{\"function\":{\"name\":\"a[b]|c<d>\",\"parameters\":{}}}]}",
        "{\"messages\":[],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{"
        "\"schema\":{}}}}",
        "{\"messages\":[],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{"
        "\"json_schema\":{\"type\":\"object\"}}}}",
        "{\"messages\":[],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{}}}",
        "{\"messages\":[],\"response_format\":{\"type\":\"json_object\"}}",
        "{\"messages\":[],\"response_format\":{\"type\":\"text\",\"json_schema\":5}}",
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(valid); i++) k3_chat_request_destroy(req(valid[i]));
    /* tool names in a tool call or a tool result: refused by the parse too */
    static const struct {
        const char *json, *needle;
    } bad_names[] = {
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\","
         "\"content\":\"\",\"tool_calls\":[{\"function\":{\"name\":\"f\"}},{\"function\":{"
         "\"name\":\"g<|sep|>\"}}]}]}",
         "request: messages[1].tool_calls[1].function.name holds control-token text '<|sep|>'"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"name\":"
         "\"[EOT]\"}]}]}",
         "request: messages[0].tool_calls[0].name holds control-token text '[EOT]'"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"tool\",\"tool\":"
         "\"t<|end_of_msg|>\",\"content\":\"r\"}]}",
         "request: messages[1].tool holds control-token text '<|end_of_msg|>'"},
        {"{\"messages\":[{\"role\":\"tool\",\"name\":\"<|media_pad|>\",\"content\":\"r\"}]}",
         "request: messages[0].name holds control-token text '<|media_pad|>'"},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(bad_names); i++) {
        k3_chat_request *rn = NULL;
        K3_CHECK_ERR(k3_chat_request_parse(bad_names[i].json, strlen(bad_names[i].json), &rn),
                     K3_ERR_ARG, bad_names[i].needle);
        k3_chat_request_destroy(rn);
    }
    /* a user's name is no tool name: it may hold such text (an attribute value, a text segment) */
    k3_chat_request_destroy(req("{\"messages\":[{\"role\":\"user\",\"name\":\"<|x|>\","
                                "\"content\":\"a\"}]}"));
    /* image parts: image_url must be an object or a string (checked at render: names the part) */
    static const char *img_ok[] = {"{\"url\":\"x\"}", "\"http://x\"", "null"};
    for (size_t i = 0; i < K3_ARRAY_LEN(img_ok); i++) {
        char js[256];
        snprintf(js, sizeof js,
                 "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\","
                 "\"image_url\":%s}]}]}",
                 img_ok[i]);
        r = req(js);
        if (!r) continue;
        K3_CHECK_OK(render_gen(r, false, &p));
        k3_chat_prompt_free(&p);
        k3_chat_request_destroy(r);
    }
    r = req("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"user\","
            "\"content\":[{\"type\":\"text\",\"text\":\"t\"},{\"type\":\"image_url\","
            "\"image_url\":5}]}]}");
    if (r) {
        K3_CHECK_ERR(render_gen(r, true, &p), K3_ERR_ARG,
                     "request: messages[1].content[1].image_url must be an object");
        k3_chat_request_destroy(r);
    }
}

static void request_cases(void) {
    struct {
        const char *json;
        bool thinking;
        const char *effort;
    } ok[] = {
        {"{\"messages\":[]}", true, "max"},
        {"{\"messages\":[],\"reasoning_effort\":\"low\"}", true, "low"},
        {"{\"messages\":[],\"reasoning_effort\":\"low\",\"thinking_effort\":\"high\"}", true,
         "high"},
        {"{\"messages\":[],\"thinking_effort\":\"low\",\"chat_template_kwargs\":{\"thinking_"
         "effort\":\"max\"}}",
         true, "max"},
        {"{\"messages\":[],\"reasoning_effort\":\"none\"}", false, NULL},
        {"{\"messages\":[],\"reasoning_effort\":\"none\",\"chat_template_kwargs\":{\"thinking\":"
         "true}}",
         false, NULL},
        {"{\"messages\":[],\"thinking\":false}", false, NULL},
        {"{\"messages\":[],\"thinking\":false,\"chat_template_kwargs\":{\"enable_thinking\":true}}",
         true, "max"},
        {"{\"messages\":[],\"chat_template_kwargs\":{\"thinking\":false,\"enable_thinking\":true}}",
         false, NULL},
        {"{\"messages\":[],\"chat_template_kwargs\":{\"thinking\":null,\"enable_thinking\":false}}",
         false, NULL},
        {"{\"messages\":[],\"thinking\":false,\"thinking_effort\":\"medium\"}", false,
         NULL}, /* unused when off */
        /* spec §5.1 `??`: null is "not given" at every level */
        {"{\"messages\":[],\"thinking_effort\":null}", true, "max"},
        {"{\"messages\":[],\"thinking_effort\":null,\"reasoning_effort\":\"low\"}", true, "low"},
        {"{\"messages\":[],\"thinking_effort\":\"high\",\"chat_template_kwargs\":{\"thinking_"
         "effort\":null}}",
         true, "high"},
        {"{\"messages\":[],\"thinking\":null}", true, "max"},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(ok); i++) {
        k3_chat_request *r = req(ok[i].json);
        if (!r) continue;
        K3_CHECK(k3_chat_request_thinking(r) == ok[i].thinking, "thinking of %s", ok[i].json);
        const char *e = k3_chat_request_effort(r);
        K3_CHECK(ok[i].effort ? e && strcmp(e, ok[i].effort) == 0 : e == NULL, "effort of %s",
                 ok[i].json);
        k3_chat_request_destroy(r);
    }
    k3_chat_request *r = NULL;
    /* Official encoder: effort must be low|high|max; `medium` (ggml-org template) is rejected. */
    K3_CHECK_ERR(k3_chat_request_parse("{\"messages\":[],\"reasoning_effort\":\"medium\"}",
                                       strlen("{\"messages\":[],\"reasoning_effort\":\"medium\"}"),
                                       &r),
                 K3_ERR_ARG, "'medium' is not supported");
    K3_CHECK_ERR(k3_chat_request_parse("{\"messages\":[],\"thinking_effort\":3}",
                                       strlen("{\"messages\":[],\"thinking_effort\":3}"), &r),
                 K3_ERR_ARG, "must be a string");
    K3_CHECK_ERR(k3_chat_request_parse("{\"messages\":[],\"thinking\":1}",
                                       strlen("{\"messages\":[],\"thinking\":1}"), &r),
                 K3_ERR_ARG, "true or false");
    K3_CHECK_ERR(k3_chat_request_parse("{\"messages\":{}}", strlen("{\"messages\":{}}"), &r),
                 K3_ERR_ARG, "\"messages\" must be a list");
    K3_CHECK_ERR(k3_chat_request_parse("{}", strlen("{}"), &r), K3_ERR_ARG, "missing \"messages\"");
    K3_CHECK_ERR(k3_chat_request_parse("[]", strlen("[]"), &r), K3_ERR_ARG, "JSON object");
    K3_CHECK_ERR(k3_chat_request_parse("{\"messages\":[],\"chat_template_kwargs\":1}",
                                       strlen("{\"messages\":[],\"chat_template_kwargs\":1}"), &r),
                 K3_ERR_ARG, "chat_template_kwargs");
    K3_CHECK(r == NULL, "no request on error");
    k3_chat_request_destroy(NULL);
}

/* Issue 8: add_generation_prompt / continue_final_message (vLLM's keys) and where the prompt
 * ends; the refusals name the keys. */
static void request_key_cases(void) {
    static const struct {
        const char *json;
        k3_chat_prompt_end end;
        const char *tail; /* the rendered text ends with it */
    } ok[] = {
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]}", K3_CHAT_ENDS_IN_THINK,
         "<|open|>think<|sep|>"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"add_generation_prompt\":null,"
         "\"thinking\":false}",
         K3_CHAT_ENDS_IN_RESPONSE, "<|open|>response<|sep|>"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"add_generation_prompt\":false}",
         K3_CHAT_ENDS_CLOSED, "a<|close|>message<|sep|><|end_of_msg|>"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\","
         "\"content\":\"b\\u0000\",\"reasoning_content\":\"r\"}],\"continue_final_message\":true,"
         "\"add_generation_prompt\":false}",
         K3_CHAT_ENDS_IN_RESPONSE,
         "<|open|>think<|sep|>r<|close|>think<|sep|><|open|>response<|sep|>b\0"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\","
         "\"content\":[],\"reasoning_content\":\"r\"}],\"continue_final_message\":true,"
         "\"add_generation_prompt\":false}",
         K3_CHAT_ENDS_IN_THINK,
         "<|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>r"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":\"b\"}],\"continue_final_message\":"
         "true,\"add_generation_prompt\":false,\"thinking\":false}",
         K3_CHAT_ENDS_IN_RESPONSE,
         "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>b"},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(ok); i++) {
        k3_chat_request *r = req(ok[i].json);
        if (!r) continue;
        k3_chat_prompt p;
        K3_CHECK_OK(k3_chat_render(r, &p));
        K3_CHECK(k3_chat_request_prompt_end(r) == ok[i].end, "prompt end of case %zu", i);
        size_t nt = strlen(ok[i].tail) + (strstr(ok[i].json, "u0000") ? 1 : 0);
        K3_CHECK(p.text && p.n_bytes >= nt && memcmp(p.text + p.n_bytes - nt, ok[i].tail, nt) == 0,
                 "case %zu ends with %s: ...%s", i, ok[i].tail,
                 p.text && p.n_bytes > 60 ? p.text + p.n_bytes - 60 : p.text);
        k3_chat_prompt_free(&p);
        k3_chat_request_destroy(r);
    }
    static const struct {
        const char *json, *needle;
        bool at_parse;
    } bad[] = {
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":\"b\"}],\"continue_final_message\":"
         "true}",
         "\"continue_final_message\": true cannot be combined with \"add_generation_prompt\": true",
         false},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"b\"}],\"continue_final_message\":true,"
         "\"add_generation_prompt\":false}",
         "needs an assistant message last", false},
        {"{\"messages\":[],\"continue_final_message\":true,\"add_generation_prompt\":false}",
         "needs an assistant message last", false},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"function\":"
         "{\"name\":\"f\"}}]}],\"continue_final_message\":true,\"add_generation_prompt\":false}",
         "has tool_calls", false},
        {"{\"messages\":[],\"add_generation_prompt\":1}",
         "\"add_generation_prompt\" must be true or false", true},
        {"{\"messages\":[],\"continue_final_message\":\"yes\"}",
         "\"continue_final_message\" must be true or false", true},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(bad); i++) {
        k3_chat_request *r = NULL;
        k3_chat_prompt p;
        if (bad[i].at_parse) {
            K3_CHECK_ERR(k3_chat_request_parse(bad[i].json, strlen(bad[i].json), &r), K3_ERR_ARG,
                         bad[i].needle);
        } else if ((r = req(bad[i].json)) != NULL) {
            K3_CHECK_ERR(k3_chat_render(r, &p), K3_ERR_ARG, bad[i].needle);
            K3_CHECK(p.n_segs == 0 && !p.text, "empty on error");
        }
        k3_chat_request_destroy(r);
    }
    /* an override makes the refused combination valid (k3 render --no-generation-prompt) */
    k3_chat_request *r = req(bad[0].json);
    if (r) {
        k3_chat_prompt p;
        K3_CHECK_OK(k3_chat_request_set_generation_prompt(r, false));
        K3_CHECK_OK(k3_chat_render(r, &p));
        k3_chat_prompt_free(&p);
        K3_CHECK_ERR(k3_chat_request_set_generation_prompt(r, true), K3_ERR_ARG,
                     "continue_final_message");
        k3_chat_request_destroy(r);
    }
}

/* Segment i as a string compare. */
static bool seg_is(const k3_chat_prompt *p, size_t i, const char *text, bool ctrl) {
    if (i >= p->n_segs) return false;
    size_t b = i ? p->seg_end[i - 1] : 0, n = p->seg_end[i] - b;
    return n == strlen(text) && memcmp(p->text + b, text, n) == 0 && p->seg_ctrl[i] == ctrl;
}

static void segment_cases(void) {
    k3_chat_request *r =
        req("{\"messages\":[{\"role\":\"user\",\"content\":\"a<|sep|>\"}],\"thinking\":false}");
    k3_chat_prompt p;
    K3_CHECK_OK(render_gen(r, true, &p));
    static const struct {
        const char *t;
        bool c;
    } want[] = {{"<|open|>", 1},  {"message", 0}, {" role", 0},   {"=\"", 0},
                {"user", 0},      {"\"", 0},      {"<|sep|>", 1}, {"a<|sep|>", 0},
                {"<|close|>", 1}, {"message", 0}, {"<|sep|>", 1}, {"<|end_of_msg|>", 1},
                {"<|open|>", 1},  {"message", 0}, {" role", 0},   {"=\"", 0},
                {"assistant", 0}, {"\"", 0},      {"<|sep|>", 1}, {"<|open|>", 1},
                {"response", 0},  {"<|sep|>", 1}};
    K3_CHECK(p.n_segs == K3_ARRAY_LEN(want), "%zu segments", p.n_segs);
    for (size_t i = 0; i < K3_ARRAY_LEN(want); i++)
        K3_CHECK(seg_is(&p, i, want[i].t, want[i].c), "segment %zu", i);
    K3_CHECK(p.text[p.n_bytes] == 0, "NUL-terminated");
    k3_chat_prompt_free(&p);
    /* without the generation prompt; an empty conversation renders nothing at all */
    K3_CHECK_OK(render_gen(r, false, &p));
    K3_CHECK(p.n_segs == 12, "no generation prompt: %zu", p.n_segs);
    k3_chat_prompt_free(&p);
    k3_chat_request_destroy(r);
    r = req("{\"messages\":[],\"thinking\":false}");
    K3_CHECK_OK(render_gen(r, false, &p));
    K3_CHECK(p.n_segs == 0 && p.n_bytes == 0 && p.text && p.text[0] == 0, "empty prompt");
    k3_chat_prompt_free(&p);
    k3_chat_prompt_free(NULL);
    k3_chat_request_destroy(r);
    /* render errors name the message */
    r = req("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"tool\",\"content\":"
            "\"x\"}]}");
    K3_CHECK_ERR(render_gen(r, true, &p), K3_ERR_ARG, "messages[1]");
    K3_CHECK(p.n_segs == 0 && p.text == NULL, "empty on error");
    k3_chat_request_destroy(r);
}

/* Duplicates past the size where the reader indexes an object's keys (a hash, so that 100k keys
 * cost linear time): Python's first position, last value, at every size. 3000 keys, then every
 * 7th again with a new value; the dump must be each key once, in first order, the last value. */
static void many_keys_cases(void) {
    enum { N = 3000 };
    k3_chat_buf in = {0}, want = {0}, got = {0};
    char t[48];
    K3_CHECK_OK(k3_chat_buf_puts(&in, "{"));
    K3_CHECK_OK(k3_chat_buf_puts(&want, "{"));
    for (int i = 0; i < N; i++) {
        snprintf(t, sizeof t, "%s\"k%d\":%d", i ? "," : "", i, i);
        K3_CHECK_OK(k3_chat_buf_puts(&in, t));
        snprintf(t, sizeof t, "%s\"k%d\":%d", i ? "," : "", i, i % 7 ? i : -i);
        K3_CHECK_OK(k3_chat_buf_puts(&want, t));
    }
    for (int i = 0; i < N; i += 7) {
        snprintf(t, sizeof t, ",\"k%d\":%d", i, -i);
        K3_CHECK_OK(k3_chat_buf_puts(&in, t));
    }
    K3_CHECK_OK(k3_chat_buf_puts(&in, "}"));
    K3_CHECK_OK(k3_chat_buf_puts(&want, "}"));
    k3_chat_json *v = NULL;
    K3_CHECK_OK(k3_chat_json_parse(in.p, in.n, "t", &v));
    if (v) {
        K3_CHECK(v->n_items == N, "%zu members, want %d", v->n_items, N);
        K3_CHECK_OK(k3_chat_json_dump(v, K3_JSON_COMPACT, &got));
        K3_CHECK(got.p && strcmp(got.p, want.p) == 0, "3000 keys with duplicates: first place, "
                                                      "last value");
        const k3_chat_json *k = k3_chat_json_get(v, "k2998");
        K3_CHECK(k && k->kind == K3_JSON_INT && strcmp(k->s, "2998") == 0, "k2998 kept");
    }
    k3_chat_json_free(v);
    k3_chat_buf_free(&in);
    k3_chat_buf_free(&want);
    k3_chat_buf_free(&got);
}

int main(void) {
    json_cases();
    many_keys_cases();
    request_cases();
    request_key_cases();
    malformed_cases();
    segment_cases();
    return k3_test_done("chat");
}
