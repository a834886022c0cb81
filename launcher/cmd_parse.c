/* cmd_parse.c — `k3 parse`: a K3 generation on stdin -> the parsed OpenAI message as JSON.
 *
 * Owns: the command's flags and I/O. The generation text is tokenised with specials allowed
 * (control tokens written literally, e.g. `<|close|>think<|sep|>`, become marker ids), then run
 * through the id-level parser (coordinator/k3_parser.h). --request types tool arguments by the
 * request's tools and takes the initial state from its thinking switches (default: thinking on,
 * no tools). --stream-check also feeds the ids one at a time and verifies that the concatenated
 * deltas equal the final message. --deltas prints each non-empty delta (JSON, one a line) first.
 * Errors: one line on stderr, exit 1 (2 = usage). */
#include "k3_chat.h"
#include "k3_launcher.h"
#include "k3_parser.h"
#include "k3_tokenizer.h"

#include <stdio.h>
#include <stdlib.h>

static const k3_flag parse_flags[] = {
    {"model", K3_FLAG_STR, "DIR", NULL,
     "model directory (tokenizer: tiktoken.model + tokenizer_config.json)"},
    {"vocab", K3_FLAG_STR, "FILE", NULL,
     "a .tiktoken rank file; K3 special tokens past the last rank"},
    {"request", K3_FLAG_STR, "FILE", NULL,
     "the chat request (JSON): tools for typing, thinking switches"},
    {"stream-check", K3_FLAG_BOOL, NULL, NULL,
     "also parse token by token and verify the deltas add up"},
    {"deltas", K3_FLAG_BOOL, NULL, NULL,
     "print each streaming delta (one JSON object a line) before the message"},
};

static k3_status read_stdin(k3_chat_buf *b) {
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, stdin)) > 0) K3_TRY(k3_chat_buf_put(b, chunk, n));
    if (ferror(stdin)) return K3_ERR(K3_ERR_IO, "reading stdin failed");
    return k3_chat_buf_put(b, "", 0);
}

/* Streamed accumulation of one response. */
typedef struct acc {
    k3_chat_buf reasoning, content;
    k3_chat_buf *args;  /* (n) per streamed call index */
    k3_chat_buf *names; /* (n) name from the call's header delta (may hold NUL); p NULL = none */
    char **ids;         /* (n) id from the call's header delta */
    size_t n;
} acc;

static k3_status acc_add(acc *a, const k3_parser_delta *d) {
    K3_TRY(k3_chat_buf_put(&a->reasoning, d->reasoning, d->n_reasoning));
    K3_TRY(k3_chat_buf_put(&a->content, d->content, d->n_content));
    for (size_t i = 0; i < d->n_calls; i++) {
        const k3_parser_call_delta *c = &d->calls[i];
        if (c->index >= a->n) {
            size_t n = c->index + 1;
            k3_chat_buf *v = realloc(a->args, n * sizeof *v);
            if (!v) return K3_ERR(K3_ERR_NOMEM, "out of memory");
            a->args = v;
            k3_chat_buf *nm = realloc(a->names, n * sizeof *nm);
            if (!nm) return K3_ERR(K3_ERR_NOMEM, "out of memory");
            a->names = nm;
            char **id = realloc(a->ids, n * sizeof *id);
            if (!id) return K3_ERR(K3_ERR_NOMEM, "out of memory");
            a->ids = id;
            for (size_t k = a->n; k < n; k++) {
                memset(&a->args[k], 0, sizeof a->args[k]);
                memset(&a->names[k], 0, sizeof a->names[k]);
                a->ids[k] = NULL;
            }
            a->n = n;
        }
        if (c->name) {
            if (a->names[c->index].p)
                return K3_ERR(K3_ERR_INTERNAL, "call %zu: header sent twice", c->index);
            K3_TRY(k3_chat_buf_put(&a->names[c->index], c->name, c->n_name));
            a->ids[c->index] = strdup(c->id ? c->id : "");
            if (!a->ids[c->index]) return K3_ERR(K3_ERR_NOMEM, "out of memory");
        }
        if (!a->names[c->index].p)
            return K3_ERR(K3_ERR_INTERNAL, "call %zu: arguments before its header", c->index);
        K3_TRY(k3_chat_buf_put(&a->args[c->index], c->args, c->n_args));
    }
    return K3_OK;
}

static void acc_free(acc *a) {
    k3_chat_buf_free(&a->reasoning);
    k3_chat_buf_free(&a->content);
    for (size_t i = 0; i < a->n; i++) {
        k3_chat_buf_free(&a->args[i]);
        k3_chat_buf_free(&a->names[i]);
        free(a->ids[i]);
    }
    free(a->args);
    free(a->names);
    free(a->ids);
}

static bool same(const char *a, size_t na, const k3_chat_buf *b) {
    return na == b->n && (na == 0 || memcmp(a, b->p, na) == 0);
}

/* Feed ids one at a time, accumulate deltas, compare with the one-shot message `m`. */
static k3_status stream_check(const k3_tok_ids *ids, const k3_tokenizer *t, const k3_parser_opts *o,
                              k3_parser *oneshot) {
    k3_parser *p = NULL;
    acc a = {0};
    k3_parser_message m, s;
    k3_chat_buf j1 = {0}, j2 = {0};
    k3_status st = k3_parser_create(o, &p);
    k3_parser_delta d;
    for (size_t i = 0; st == K3_OK && i < ids->n; i++) {
        st = k3_parser_feed_ids(p, t, &ids->ids[i], 1);
        if (!st) st = k3_parser_take_delta(p, &d);
        if (!st) st = acc_add(&a, &d);
    }
    if (!st) st = k3_parser_finish(p);
    if (!st) st = k3_parser_take_delta(p, &d);
    if (!st) st = acc_add(&a, &d);
    if (!st) st = k3_parser_message_json(p, &j1);
    if (!st) st = k3_parser_message_json(oneshot, &j2);
    if (!st && (j1.n != j2.n || memcmp(j1.p, j2.p, j1.n) != 0))
        st = K3_ERR(K3_ERR_INTERNAL, "stream-check: token-by-token message differs from one-shot");
    if (!st) st = k3_parser_message_view(p, &s);
    if (!st) st = k3_parser_message_view(oneshot, &m);
    if (!st && !same(m.reasoning, m.n_reasoning, &a.reasoning))
        st = K3_ERR(K3_ERR_INTERNAL, "stream-check: reasoning deltas do not add up");
    if (!st && !same(m.content, m.n_content, &a.content))
        st = K3_ERR(K3_ERR_INTERNAL, "stream-check: content deltas do not add up");
    /* Every complete call, in order, is one streamed call with the same id, name and arguments.
     * Matched by position: the streamed calls are walked in the same order, skipping the ones
     * that never completed (their deltas were sent, but the final message leaves them out); the
     * id is compared as an opaque string, never parsed. */
    for (size_t i = 0, k = 0; !st && i < m.n_calls; i++, k++) {
        while (k < a.n && (!a.ids[k] || strcmp(a.ids[k], m.calls[i].id) != 0)) k++;
        if (k >= a.n || !a.names[k].p || !same(m.calls[i].name, m.calls[i].n_name, &a.names[k]) ||
            !same(m.calls[i].arguments, m.calls[i].n_arguments, &a.args[k]))
            st = K3_ERR(K3_ERR_INTERNAL, "stream-check: tool call %zu deltas do not add up", i);
    }
    k3_chat_buf_free(&j1);
    k3_chat_buf_free(&j2);
    acc_free(&a);
    k3_parser_destroy(p);
    return st;
}

static int run_parse(const k3_args *a) {
    const char *model = k3_args_str(a, "model"), *vocab = k3_args_str(a, "vocab");
    const char *reqf = k3_args_str(a, "request");
    if (!model == !vocab) {
        fprintf(stderr, "k3 parse: give exactly one of --model DIR or --vocab FILE (the "
                        "tokenizer)\n");
        return 2;
    }
    k3_chat_buf in = {0}, out = {0}, dj = {0};
    char *rtext = NULL;
    size_t rn = 0;
    k3_chat_request *req = NULL;
    k3_tokenizer *tok = NULL;
    k3_parser *p = NULL;
    k3_tok_ids ids = {0};
    int rc = 1;
    const char *what = "";
    if (reqf) {
        what = reqf;
        if (k3_read_file(reqf, &rtext, &rn) || k3_chat_request_parse(rtext, rn, &req)) goto fail;
    }
    what = model ? model : vocab;
    if (model ? k3_tok_create_model_dir(&tok, model, NULL)
              : k3_tok_create_tiktoken(&tok, vocab, NULL, K3_TOK_K3_LAYOUT, NULL))
        goto fail;
    what = "stdin";
    if (read_stdin(&in) || k3_tok_encode(tok, in.p, in.n, true, &ids)) goto fail;
    k3_parser_opts o = {.thinking = req ? k3_chat_request_thinking(req) : true,
                        .start_in_response =
                            req && k3_chat_request_prompt_end(req) == K3_CHAT_ENDS_IN_RESPONSE,
                        .tools = req ? k3_chat_request_tools(req) : NULL};
    what = "";
    if (k3_parser_create(&o, &p)) goto fail;
    if (k3_args_bool(a, "deltas")) { /* token by token, printing each delta */
        k3_parser_delta d;
        for (size_t i = 0; i <= ids.n; i++) {
            if (i < ids.n ? k3_parser_feed_ids(p, tok, &ids.ids[i], 1) : k3_parser_finish(p))
                goto fail;
            if (k3_parser_take_delta(p, &d)) goto fail;
            if (k3_parser_delta_empty(&d)) continue;
            dj.n = 0;
            if (k3_parser_delta_json(&d, &dj)) goto fail;
            printf("%s\n", dj.p);
        }
    } else if (k3_parser_feed_ids(p, tok, ids.ids, ids.n) || k3_parser_finish(p)) {
        goto fail;
    }
    if (k3_parser_message_json(p, &out)) goto fail;
    if (k3_args_bool(a, "stream-check") && stream_check(&ids, tok, &o, p)) goto fail;
    printf("%s\n", out.p);
    fflush(stdout);
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "k3 parse: %s%s%s\n", what, *what ? ": " : "", k3_last_error());
done:
    k3_parser_destroy(p);
    k3_tok_ids_free(&ids);
    k3_tok_destroy(tok);
    k3_chat_request_destroy(req);
    k3_free(rtext);
    k3_chat_buf_free(&in);
    k3_chat_buf_free(&out);
    k3_chat_buf_free(&dj);
    return rc;
}

const k3_command k3_cmd_parse = {
    .name = "parse",
    .positional = "",
    .summary = "parse a K3 generation (stdin) into reasoning, content and tool calls (JSON)",
    .flags = parse_flags,
    .n_flags = (int)K3_ARRAY_LEN(parse_flags),
    .run = run_parse,
};
