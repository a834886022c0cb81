/* model_internal.h — helpers shared by the files of model/ only (not a public header).
 *
 * A header peek for one tensor's shape, dtype names, byte-range reads and the strict JSON reader.
 * (The shard writer is public, k3_model.h; the BPE trainer is tiny/k3_tiny.h.) */
#ifndef K3_MODEL_INTERNAL_H
#define K3_MODEL_INTERNAL_H

#include <cjson/cJSON.h>

#include "k3_model.h"

/* Largest safetensors header we accept (the real K3 shards have ~0.2 MB headers). */
#define K3_ST_MAX_HEADER (100ull << 20)

/* dtype from its safetensors spelling; false if unknown. */
bool k3_st_dtype_parse(const char *s, k3_dtype *out);

/* The shape of `name` from the checkpoint header in `dir` (index or single file) without opening
 * every shard. K3_ERR_MISSING when there is no checkpoint or no such tensor. */
k3_status k3_st_peek_shape(const char *dir, const char *name, int64_t shape[K3_MAX_DIMS],
                           int *ndim);

/* pread bytes [off, off + n) of tensor t's data into dst (k3_ckpt_read is the whole span).
 * Thread-safe; adds to the bytes-read counter. */
k3_status k3_ckpt_read_range(k3_ckpt *ck, const k3_ckpt_tensor *t, uint64_t off, uint64_t n,
                             void *dst);

/* Parse text[0..n) as one JSON value held strictly (strict_json.c): only whitespace after it,
 * every string valid UTF-8 with no control byte and no \u0000, no key twice in an object. Errors
 * are `code`: "PATH: SYNTAX (near byte B of N)" for bad syntax, "PATH: N byte(s) after the JSON
 * value of NOUN ..." for text after it, else "PATH: WHAT<key path> ..." naming the key (WHAT:
 * "header key " for a shard header, "" for config.json). On success *out is the tree
 * (cJSON_Delete). */
k3_status k3_json_parse_strict(const char *text, size_t n, const char *path, const char *noun,
                               const char *syntax, const char *what, k3_status code, cJSON **out);

#endif /* K3_MODEL_INTERNAL_H */
