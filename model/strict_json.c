/* strict_json.c — JSON as the checkpoint files must hold it (config.json, the safetensors index
 * and every shard header), with the checks cJSON leaves to its caller.
 *
 * cJSON accepts things that make k3 use something other than what the file says: a "\u0000"
 * escape decodes to a NUL that cuts the string ("name\u0000junk" is then used as "name"), invalid
 * UTF-8 and raw control bytes are copied through, text after the first value is ignored, and of a
 * key given twice the first one silently wins. The safetensors reference reader (serde_json over
 * a UTF-8 str) refuses all of these, and so does k3: the text is one JSON value followed only by
 * whitespace; every string (keys and values) is valid UTF-8 with no control byte and no \u0000;
 * no object holds a key twice. cJSON itself rejects lone surrogate escapes and bad syntax.
 * Errors name the file and the key path (as the file spells it; bytes outside printable ASCII
 * shown as \xNN), never print the raw bytes. Not here: what the values mean (the callers). */
#include "model_internal.h"

#include <stdio.h>
#include <stdlib.h>

#include "k3_utf8.h"

/* The JSON text s[0..n) shown printable: at most `cap`-1 bytes out, "..." when cut. */
static void show(const char *s, size_t n, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (o + 8 >= cap) {
            snprintf(out + o, cap - o, "...");
            return;
        }
        if (ch >= 0x20 && ch < 0x7f)
            out[o++] = (char)ch;
        else
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", ch);
    }
    out[o] = 0;
}

/* Where the scan is: one frame per open object/array, the key (raw literal span) or index. */
typedef struct frame {
    bool obj;
    bool want_key; /* in an object, the next string is a key */
    size_t key_off, key_len;
    int64_t index;
} frame;
enum { MAX_FRAMES = 64 }; /* deeper paths are shown up to here (cJSON stops at 1000) */

/* The key path of the frames, e.g. text_config.linear_attn_config.kda_layers[3]. */
static void key_path(const char *s, const frame *f, int depth, char *out, size_t cap) {
    size_t o = 0;
    out[0] = 0;
    for (int d = 0; d < depth && d < MAX_FRAMES && o + 16 < cap; d++) {
        if (f[d].obj) {
            if (f[d].want_key) break; /* no key yet at this level */
            if (o) out[o++] = '.';
            show(s + f[d].key_off, f[d].key_len, out + o, cap - o);
            o += strlen(out + o);
        } else {
            o += (size_t)snprintf(out + o, cap - o, "[%lld]", (long long)f[d].index);
        }
    }
}

/* Check the strings of s[0..n) (already parsed by cJSON, so the syntax is right). */
static k3_status check_strings(const char *s, size_t n, const char *path, const char *what,
                               k3_status code) {
    frame f[MAX_FRAMES];
    int depth = 0;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        frame *top = depth > 0 && depth <= MAX_FRAMES ? &f[depth - 1] : NULL;
        if (ch == '{' || ch == '[') {
            if (depth < MAX_FRAMES) f[depth] = (frame){ch == '{', ch == '{', 0, 0, 0};
            depth++;
        } else if (ch == '}' || ch == ']') {
            depth--;
        } else if (ch == ',') {
            if (top && top->obj) top->want_key = true;
            if (top && !top->obj) top->index++;
        } else if (ch == '"') {
            size_t b = ++i; /* the literal is s[b..i) */
            const char *bad = NULL;
            char why[64];
            while (i < n && s[i] != '"') {
                unsigned char c = (unsigned char)s[i];
                if (c == '\\') {
                    if (i + 5 < n && s[i + 1] == 'u' && strncmp(s + i + 2, "0000", 4) == 0)
                        bad = "holds \\u0000 (NUL), which would cut the string";
                    i += 2;
                    continue;
                }
                if (c < 0x20 && !bad) {
                    snprintf(why, sizeof why, "holds the control byte 0x%02x", c);
                    bad = why;
                }
                if (c >= 0x80) {
                    int k = k3_utf8_next((const uint8_t *)s + i, n - i, NULL);
                    if (k < 2) {
                        if (!bad) {
                            snprintf(why, sizeof why, "is not valid UTF-8 (byte 0x%02x at %zu)", c,
                                     i);
                            bad = why;
                        }
                        k = 1;
                    }
                    i += (size_t)k;
                    continue;
                }
                i++;
            }
            bool is_key = top && top->obj && top->want_key;
            if (is_key) {
                top->key_off = b;
                top->key_len = i - b;
                top->want_key = false;
            }
            if (bad) {
                char kp[512];
                key_path(s, f, depth, kp, sizeof kp);
                return K3_ERR(code, "%s: %s%s%s (byte %zu): %s %s", path, what,
                              kp[0] ? kp : "(top level)", is_key ? "" : " (its value)", b - 1,
                              is_key ? "the key" : "the string", bad);
            }
        }
    }
    return K3_OK;
}

static int key_cmp(const void *a, const void *b) {
    return strcmp((*(const cJSON *const *)a)->string, (*(const cJSON *const *)b)->string);
}

/* No object under `o` holds a key twice; `kp` is the key path of `o` (for the message). */
static k3_status check_dups(const cJSON *o, char *kp, size_t kp_len, size_t cap, const char *path,
                            const char *what, k3_status code) {
    if (!cJSON_IsObject(o) && !cJSON_IsArray(o)) return K3_OK;
    int n = cJSON_GetArraySize(o);
    if (cJSON_IsObject(o) && n > 1) {
        const cJSON **keys = NULL;
        K3_TRY(k3_alloc((void **)&keys, (size_t)n * sizeof *keys, "JSON key list"));
        int k = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, o) keys[k++] = e;
        qsort(keys, (size_t)n, sizeof *keys, key_cmp);
        for (int i = 1; i < n; i++)
            if (strcmp(keys[i]->string, keys[i - 1]->string) == 0) {
                char nm[256];
                show(keys[i]->string, strlen(keys[i]->string), nm, sizeof nm);
                k3_free(keys);
                return K3_ERR(code,
                              "%s: %s%s%s%s: the key appears twice (JSON keys must be unique)",
                              path, what, kp, kp_len ? "." : "", nm);
            }
        k3_free(keys);
    }
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, o) {
        if (cJSON_IsObject(e) || cJSON_IsArray(e)) {
            int w = cJSON_IsObject(o)
                        ? snprintf(kp + kp_len, cap - kp_len, "%s%s", kp_len ? "." : "", e->string)
                        : snprintf(kp + kp_len, cap - kp_len, "[%d]", i);
            size_t nl = w < 0 ? kp_len : K3_MIN(kp_len + (size_t)w, cap - 1);
            k3_status st = check_dups(e, kp, nl, cap, path, what, code);
            kp[kp_len] = 0;
            if (st != K3_OK) return st;
        }
        i++;
    }
    return K3_OK;
}

k3_status k3_json_parse_strict(const char *text, size_t n, const char *path, const char *noun,
                               const char *syntax, const char *what, k3_status code, cJSON **out) {
    *out = NULL;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, n, &end, false);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        long off = at && at >= text && at <= text + n ? (long)(at - text) : -1;
        return K3_ERR(code, "%s: %s (near byte %ld of %zu)", path, syntax, off, n);
    }
    size_t used = end && end >= text && end <= text + n ? (size_t)(end - text) : n;
    for (size_t i = used; i < n; i++)
        if (text[i] != ' ' && text[i] != '\t' && text[i] != '\n' && text[i] != '\r') {
            cJSON_Delete(root);
            return K3_ERR(code,
                          "%s: %zu byte(s) after the JSON value of %s (from byte %zu, 0x%02x); "
                          "only whitespace may follow it",
                          path, n - used, noun, i, (unsigned char)text[i]);
        }
    k3_status st = check_strings(text, used, path, what, code);
    if (st == K3_OK) {
        char kp[1024] = "";
        st = check_dups(root, kp, 0, sizeof kp, path, what, code);
    }
    if (st != K3_OK) {
        cJSON_Delete(root);
        return st;
    }
    *out = root;
    return K3_OK;
}
