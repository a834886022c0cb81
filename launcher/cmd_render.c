/* cmd_render.c — `k3 render`: an OpenAI-style chat request on stdin -> the K3 prompt.
 *
 * Owns: the command's flags and output formats. Default: the prompt text, ending as the request
 * says (add_generation_prompt, default true: the assistant opener; continue_final_message: the
 * final assistant message left open; --no-generation-prompt = add_generation_prompt false).
 * --segments: the segment list as JSON `[[text, is_control], ...]` (what the tokenizer sees,
 * §4.6). --ids: the token ids (segment-wise encoding), which needs exactly one of --model or
 * --vocab. Without --ids a --model/--vocab is not needed: a note on stderr says so, and the text
 * is rendered all the same (it does not depend on the tokenizer).
 * The chat logic lives in coordinator/ (k3_chat.h); this file only does I/O.
 * Errors: one line on stderr naming the key or file, exit 1 (2 = usage). */
#include "k3_chat.h"
#include "k3_launcher.h"
#include "k3_tokenizer.h"

#include <stdio.h>
#include <stdlib.h>

static const k3_flag render_flags[] = {
    {"model", K3_FLAG_STR, "DIR", NULL,
     "model directory (its tokenizer) for --ids; not needed for the text or --segments"},
    {"vocab", K3_FLAG_STR, "FILE", NULL,
     "a .tiktoken rank file with the K3 specials past the last rank, for --ids (not with --model; "
     "not needed for the text or --segments)"},
    {"segments", K3_FLAG_BOOL, NULL, NULL, "print the segments as JSON [[text, is_control], ...]"},
    {"ids", K3_FLAG_BOOL, NULL, NULL, "print the token ids (each segment encoded on its own)"},
    {"no-generation-prompt", K3_FLAG_BOOL, NULL, NULL,
     "do not append the assistant opener, as request key \"add_generation_prompt\": false. "
     "Request keys: add_generation_prompt (default true); continue_final_message (default false; "
     "needs add_generation_prompt false) leaves the last (assistant) message open in the form of "
     "spec/K3-CHAT.md §1.8, which is inferred from llama.cpp: the official encoder cannot continue "
     "a message"},
};

/* Read all of stdin (shared shape with cmd_parse.c). */
static k3_status read_stdin(k3_chat_buf *b) {
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, stdin)) > 0) K3_TRY(k3_chat_buf_put(b, chunk, n));
    if (ferror(stdin)) return K3_ERR(K3_ERR_IO, "reading stdin failed");
    return k3_chat_buf_put(b, "", 0);
}

static int fail(const char *what) {
    fprintf(stderr, "k3 render: %s%s%s\n", what, *what ? ": " : "", k3_last_error());
    return 1;
}

static int run_render(const k3_args *a) {
    bool want_ids = k3_args_bool(a, "ids");
    const char *model = k3_args_str(a, "model"), *vocab = k3_args_str(a, "vocab");
    if (want_ids && !model == !vocab) {
        fprintf(stderr, "k3 render: --ids needs exactly one of --model DIR or --vocab FILE\n");
        return 2;
    }
    if (!want_ids && (model || vocab)) /* harmless: the text does not depend on the tokenizer */
        fprintf(stderr,
                "k3 render: note: --%s is not needed without --ids (the prompt text and segments "
                "do not depend on the tokenizer); rendering the text\n",
                model ? "model" : "vocab");
    if (want_ids && k3_args_bool(a, "segments")) {
        fprintf(stderr, "k3 render: give --ids or --segments, not both\n");
        return 2;
    }
    k3_chat_buf in = {0}, out = {0};
    k3_chat_request *req = NULL;
    k3_chat_prompt prompt = {0};
    k3_tokenizer *tok = NULL;
    k3_tok_ids ids = {0};
    int rc = 0;
    if (read_stdin(&in) || k3_chat_request_parse(in.p, in.n, &req)) {
        rc = fail("");
        goto done;
    }
    /* the flag overrides the request's key; a refused combination is k3_chat_render's error */
    if (k3_args_bool(a, "no-generation-prompt") &&
        k3_chat_request_set_generation_prompt(req, false) != K3_OK)
        k3_clear_error();
    if (k3_chat_render(req, &prompt)) {
        rc = fail("");
        goto done;
    }
    if (want_ids) {
        k3_status s = model ? k3_tok_create_model_dir(&tok, model, NULL)
                            : k3_tok_create_tiktoken(&tok, vocab, NULL, K3_TOK_K3_LAYOUT, NULL);
        if (s) {
            rc = fail(model ? model : vocab);
            goto done;
        }
        if (k3_chat_encode(&prompt, tok, &ids)) {
            rc = fail("encoding");
            goto done;
        }
        for (size_t i = 0; i < ids.n; i++) printf(i ? " %d" : "%d", ids.ids[i]);
        putchar('\n');
    } else if (k3_args_bool(a, "segments")) {
        if (k3_chat_prompt_segments_json(&prompt, &out)) {
            rc = fail("");
            goto done;
        }
        fwrite(out.p, 1, out.n, stdout);
        putchar('\n');
    } else {
        fwrite(prompt.text, 1, prompt.n_bytes, stdout);
    }
    fflush(stdout);
done:
    k3_tok_ids_free(&ids);
    k3_tok_destroy(tok);
    k3_chat_prompt_free(&prompt);
    k3_chat_request_destroy(req);
    k3_chat_buf_free(&in);
    k3_chat_buf_free(&out);
    return rc;
}

const k3_command k3_cmd_render = {
    .name = "render",
    .positional = "",
    .summary = "render an OpenAI-style chat request (stdin) as the K3 prompt",
    .flags = render_flags,
    .n_flags = (int)K3_ARRAY_LEN(render_flags),
    .run = run_render,
};
