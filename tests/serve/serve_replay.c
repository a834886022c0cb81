/* serve_replay.c — the server's request parser, response writer and SSE writer on a scripted
 * completion (owner: serve). The tiny random model never writes a tool call, so tool calls are
 * checked this way: serve_test.py's `replay` group hands the official openai client's types what
 * this prints, for the K3 completions of tests/data/fixtures/chat.
 *
 *   serve_replay MODEL_DIR REQUEST.json COMPLETION.txt OUT_PREFIX
 *
 * REQUEST.json: an OpenAI chat request body (parsed by the server's own srv_parse: tools, thinking
 * switches, stop strings). COMPLETION.txt: the K3 completion after the generation prompt, control
 * tokens written literally (encoded with specials allowed). The tokens arrive one at a time as the
 * engine would send them: a k3_sampler with the engine's stop ids (<|end_of_msg|>, [EOS]) and the
 * request's stop strings decides the released text and the stop, and the SSE writer runs after
 * every token. Writes OUT_PREFIX.json (the chat.completion) and OUT_PREFIX.sse (the stream).
 * Exit 0, or 1 with a message. */
#include <stdio.h>
#include <stdlib.h>

#include "server_internal.h"

static int die(const char *what) {
    fprintf(stderr, "serve_replay: %s: %s\n", what, k3_last_error());
    return 1;
}

static int write_file(const char *prefix, const char *ext, const k3_chat_buf *b) {
    char path[4096];
    snprintf(path, sizeof path, "%s%s", prefix, ext);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(b->p ? b->p : "", 1, b->n, f) != b->n || fclose(f) != 0) {
        fprintf(stderr, "serve_replay: cannot write %s\n", path);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: serve_replay MODEL_DIR REQUEST.json COMPLETION.txt OUT_PREFIX\n");
        return 2;
    }
    k3_tokenizer *tok = NULL;
    if (k3_tok_create_model_dir(&tok, argv[1], NULL) != K3_OK) return die(argv[1]);
    char *req = NULL, *comp = NULL;
    size_t n_req = 0, n_comp = 0;
    if (k3_read_file(argv[2], &req, &n_req) != K3_OK) return die(argv[2]);
    if (k3_read_file(argv[3], &comp, &n_comp) != K3_OK) return die(argv[3]);
    const k3_server_opts o = {
        .model_name = "replay", .tok = tok, .n_vocab = k3_tok_n_vocab(tok), .max_ctx = 1 << 20};
    sreq *q = NULL;
    char why[1024];
    int st = srv_parse(&o, SREQ_CHAT, req, n_req, &q, why, sizeof why);
    if (st != 200) {
        fprintf(stderr, "serve_replay: request refused (%d): %s\n", st, why);
        return 1;
    }
    snprintf(q->id, sizeof q->id, "chatcmpl-replay");
    q->created = 1700000000;
    k3_tok_ids ids = {0};
    if (k3_tok_encode(tok, comp, n_comp, true, &ids) != K3_OK) return die("encode");
    if ((int64_t)ids.n > q->cap_gen) {
        fprintf(stderr, "serve_replay: %zu tokens > max_tokens %lld\n", ids.n,
                (long long)q->cap_gen);
        return 1;
    }
    const k3_tok_ctrl c = k3_tok_control_ids(tok);
    const int32_t stop_ids[2] = {c.end_of_msg, c.eos};
    k3_sampler_params sp = q->job.sp;
    sp.stop_ids = stop_ids, sp.n_stop_ids = 2;
    k3_sampler *smp = NULL;
    if (k3_sampler_create(&smp, &sp, k3_tok_n_vocab(tok), tok) != K3_OK) return die("sampler");
    k3_tok_bytes text = {0};
    k3_chat_buf sse = {0}, body = {0};
    srv_stream stream = {0};
    k3_stop_kind stop = K3_STOP_NONE;
    for (size_t i = 0; i < ids.n && stop == K3_STOP_NONE; i++) {
        if (k3_sampler_accept(smp, ids.ids[i], &text, &stop) != K3_OK) return die("accept");
        q->gen[q->n_gen++] = (sreq_tok){ids.ids[i], text.n};
        const srv_snapshot s = {
            .toks = q->gen, .n_gen = q->n_gen, .text = text.data, .n_text = text.n};
        if (srv_stream_chunks(&o, q, &stream, &s, &sse) != K3_OK) return die("chunks");
    }
    if (stop == K3_STOP_NONE && k3_sampler_finish(smp, &text) != K3_OK) return die("finish");
    q->stop = stop;
    q->n_prompt = q->job.n_ids;
    q->text = text.data, q->n_text = text.n; /* lent: taken back before the free */
    q->done = true;
    const srv_snapshot s = {.toks = q->gen,
                            .n_gen = q->n_gen,
                            .text = text.data,
                            .n_text = text.n,
                            .done = true,
                            .stop = stop,
                            .n_prompt = q->n_prompt};
    if (srv_stream_chunks(&o, q, &stream, &s, &sse) != K3_OK) return die("end chunks");
    if (srv_stream_end(&o, q, &sse) != K3_OK) return die("stream end");
    if (srv_response(&o, q, &body) != K3_OK) return die("response");
    q->text = NULL;
    int rc = write_file(argv[4], ".json", &body) | write_file(argv[4], ".sse", &sse);
    srv_stream_free(&stream);
    k3_chat_buf_free(&sse), k3_chat_buf_free(&body);
    k3_tok_bytes_free(&text);
    k3_tok_ids_free(&ids);
    k3_sampler_destroy(smp);
    srv_sreq_free(q);
    k3_free(req), k3_free(comp);
    k3_tok_destroy(tok);
    return rc;
}
