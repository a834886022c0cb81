/* cmd_tokenize.c — `k3 tokenize`: text -> token ids with the k3 tokenizer (coordinator/).
 *
 * Owns: the command's flags and output formats. Plain: ids space-separated on one line. --json:
 * {"ids":[...],"pieces":[...]} (pieces = each id decoded, invalid UTF-8 replaced by U+FFFD).
 * --jsonl: one JSON value per stdin line -> one JSON array of ids per stdout line; a line is a
 * string (encoded with specials allowed unless --no-special) or {"text": "...", "special": bool},
 * read with coordinator's JSON reader (Python json.loads rules, lengths kept: "\u0000" is byte 0,
 * tokenized as tiktoken does). Specials are allowed by default, like tokenization_kimi.py encode().
 * --vocab uses the K3 special-token layout past the last rank (§4.1). Errors: one line on stderr,
 * exit 1 (2 = usage).
 */
#include "k3_chat.h"
#include "k3_launcher.h"
#include "k3_tokenizer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

static const k3_flag tokenize_flags[] = {
    {"model", K3_FLAG_STR, "DIR", NULL, "model directory (tiktoken.model + tokenizer_config.json)"},
    {"vocab", K3_FLAG_STR, "FILE", NULL,
     "a .tiktoken rank file; K3 special tokens past the last rank"},
    {"pattern", K3_FLAG_STR, "NAME", "k3", "pre-tokenizer regex: k3 | o200k | cl100k"},
    {"no-special", K3_FLAG_BOOL, NULL, NULL, "treat special-token text as plain text"},
    {"no-kimi-chunking", K3_FLAG_BOOL, NULL, NULL,
     "skip the 400k/25k chunking of tokenization_kimi (raw tiktoken)"},
    {"json", K3_FLAG_BOOL, NULL, NULL, "print {\"ids\":[...],\"pieces\":[...]}"},
    {"jsonl", K3_FLAG_BOOL, NULL, NULL,
     "read one JSON string (or {text,special}) per stdin line, print one id array per line"},
};

/* "[id,id,...]\n" appended to out (one --jsonl answer; printf per id is the bottleneck of a
 * long batch). */
static k3_status ids_json(const k3_tok_ids *ids, k3_chat_buf *out) {
    char num[16];
    K3_TRY(k3_chat_buf_put(out, "[", 1));
    for (size_t i = 0; i < ids->n; i++) {
        int n = snprintf(num, sizeof num, i ? ",%d" : "%d", ids->ids[i]);
        K3_TRY(k3_chat_buf_put(out, num, (size_t)n));
    }
    return k3_chat_buf_put(out, "]\n", 2);
}

static int run_jsonl(const k3_tokenizer *t, bool allow_special) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    size_t lineno = 0;
    int rc = 0;
    k3_tok_ids ids = {0};
    k3_chat_buf out = {0};
    while ((len = getline(&line, &cap, stdin)) >= 0) {
        lineno++;
        /* coordinator's JSON reader (Python json.loads semantics): strings carry their length,
         * so "\u0000" is an ordinary character (byte 0), never the end of the text. */
        char what[48];
        snprintf(what, sizeof what, "stdin line %zu", lineno);
        k3_chat_json *v = NULL;
        if (k3_chat_json_parse(line, (size_t)len, what, &v) != K3_OK) {
            fprintf(stderr, "k3 tokenize: %s\n", k3_last_error());
            rc = 1;
            break;
        }
        const k3_chat_json *text = v;
        bool special = allow_special;
        if (v->kind == K3_JSON_OBJECT) {
            text = k3_chat_json_get(v, "text");
            const k3_chat_json *sp = k3_chat_json_get(v, "special");
            if (sp && sp->kind != K3_JSON_BOOL) text = NULL;
            if (sp && sp->kind == K3_JSON_BOOL) special = sp->b;
        }
        if (!text || text->kind != K3_JSON_STRING) {
            fprintf(stderr,
                    "k3 tokenize: stdin line %zu: expected a JSON string or {\"text\": string, "
                    "\"special\": bool}\n",
                    lineno);
            k3_chat_json_free(v);
            rc = 1;
            break;
        }
        ids.n = 0;
        k3_status st = k3_tok_encode(t, text->s, text->n, special, &ids);
        k3_chat_json_free(v);
        if (st != K3_OK) {
            fprintf(stderr, "k3 tokenize: stdin line %zu: %s\n", lineno, k3_last_error());
            rc = 1;
            break;
        }
        out.n = 0;
        if (ids_json(&ids, &out) != K3_OK || fwrite(out.p, 1, out.n, stdout) != out.n) {
            fprintf(stderr, "k3 tokenize: writing stdout failed after line %zu\n", lineno);
            rc = 1;
            break;
        }
    }
    if (rc == 0 && ferror(stdin)) {
        fprintf(stderr, "k3 tokenize: reading stdin failed after line %zu: %s\n", lineno,
                strerror(errno));
        rc = 1;
    }
    free(line);
    k3_tok_ids_free(&ids);
    k3_chat_buf_free(&out);
    if (fflush(stdout) != 0 && rc == 0) {
        fprintf(stderr, "k3 tokenize: writing stdout failed: %s\n", strerror(errno));
        rc = 1;
    }
    return rc;
}

/* {"ids":[...],"pieces":[...]}\n: each piece is one id decoded (invalid UTF-8 as U+FFFD), written
 * with its length (a piece may hold byte 0). */
static k3_status ids_pieces_json(const k3_tokenizer *t, const k3_tok_ids *ids, k3_chat_buf *o) {
    K3_TRY(k3_chat_buf_puts(o, "{\"ids\":"));
    K3_TRY(ids_json(ids, o));
    o->n--; /* drop the newline of ids_json */
    K3_TRY(k3_chat_buf_puts(o, ",\"pieces\":["));
    k3_tok_bytes piece = {0};
    k3_status st = K3_OK;
    for (size_t i = 0; st == K3_OK && i < ids->n; i++) {
        piece.n = 0;
        st = k3_tok_decode(t, &ids->ids[i], 1, &piece);
        if (st == K3_OK && i) st = k3_chat_buf_put(o, ",", 1);
        if (st == K3_OK) st = k3_chat_json_dump_str(piece.data ? piece.data : "", piece.n, o);
    }
    k3_tok_bytes_free(&piece);
    K3_TRY(st);
    return k3_chat_buf_puts(o, "]}\n");
}

/* All of stdin into *buf (NUL-terminated, n bytes). A failed read or allocation is an error, never
 * a silently shortened text. */
static k3_status read_stdin(char **buf, size_t *n) {
    size_t cap = 0;
    char tmp[65536];
    size_t got;
    *buf = NULL;
    *n = 0;
    while ((got = fread(tmp, 1, sizeof tmp, stdin)) > 0) {
        if (*n + got + 1 > cap) {
            cap = (*n + got + 1) * 2;
            char *nb = realloc(*buf, cap);
            if (!nb) return K3_ERR(K3_ERR_NOMEM, "out of memory reading stdin (%zu bytes)", cap);
            *buf = nb;
        }
        memcpy(*buf + *n, tmp, got);
        *n += got;
    }
    if (ferror(stdin))
        return K3_ERR(K3_ERR_IO, "reading stdin failed after %zu bytes: %s", *n, strerror(errno));
    return K3_OK;
}

static int run_tokenize(const k3_args *a) {
    const char *model = k3_args_str(a, "model"), *vocab = k3_args_str(a, "vocab");
    if ((model != NULL) == (vocab != NULL)) {
        fprintf(stderr, "k3 tokenize: give exactly one of --model DIR or --vocab FILE\n");
        return 2;
    }
    bool jsonl = k3_args_bool(a, "jsonl");
    if (jsonl && a->n_pos > 0) {
        fprintf(stderr, "k3 tokenize: --jsonl reads stdin; do not also give TEXT\n");
        return 2;
    }
    k3_tok_options opt = {0};
    if (k3_tok_pattern_from_name(k3_args_str(a, "pattern"), &opt.pattern) != K3_OK) {
        fprintf(stderr, "k3 tokenize: --pattern: %s\n", k3_last_error());
        return 2;
    }
    opt.no_kimi_chunking = k3_args_bool(a, "no-kimi-chunking");
    k3_tokenizer *t = NULL;
    k3_status st = model ? k3_tok_create_model_dir(&t, model, &opt)
                         : k3_tok_create_tiktoken(&t, vocab, NULL, K3_TOK_K3_LAYOUT, &opt);
    if (st != K3_OK) {
        fprintf(stderr, "k3 tokenize: %s\n", k3_last_error());
        return 1;
    }
    bool allow_special = !k3_args_bool(a, "no-special");
    int rc = 0;
    if (jsonl) {
        rc = run_jsonl(t, allow_special);
    } else {
        /* TEXT, or all of stdin when absent. */
        char *buf = NULL;
        size_t n = 0;
        if (a->n_pos > 0) {
            buf = strdup(a->pos[0]);
            if (!buf) {
                fprintf(stderr, "k3 tokenize: out of memory copying TEXT\n");
                k3_tok_destroy(t);
                return 1;
            }
            n = strlen(buf);
        } else if (read_stdin(&buf, &n) != K3_OK) {
            fprintf(stderr, "k3 tokenize: %s\n", k3_last_error());
            free(buf);
            k3_tok_destroy(t);
            return 1;
        }
        k3_tok_ids ids = {0};
        st = k3_tok_encode(t, buf ? buf : "", n, allow_special, &ids);
        if (st != K3_OK) {
            fprintf(stderr, "k3 tokenize: %s\n", k3_last_error());
            rc = 1;
        } else if (k3_args_bool(a, "json")) {
            k3_chat_buf o = {0};
            st = ids_pieces_json(t, &ids, &o);
            if (st == K3_OK) {
                fwrite(o.p, 1, o.n, stdout);
            } else {
                fprintf(stderr, "k3 tokenize: %s\n", k3_last_error());
                rc = 1;
            }
            k3_chat_buf_free(&o);
        } else {
            for (size_t i = 0; i < ids.n; i++) printf(i ? " %d" : "%d", ids.ids[i]);
            printf("\n");
        }
        k3_tok_ids_free(&ids);
        free(buf);
    }
    k3_tok_destroy(t);
    return rc;
}

const k3_command k3_cmd_tokenize = {
    .name = "tokenize",
    .positional = "[TEXT]",
    .min_pos = 0,
    .max_pos = 1,
    .summary = "print the token ids of TEXT (or stdin) with a model's or a .tiktoken vocabulary",
    .flags = tokenize_flags,
    .n_flags = (int)K3_ARRAY_LEN(tokenize_flags),
    .run = run_tokenize,
};
