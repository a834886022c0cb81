/* model_internal.h — helpers shared by the files of model/ only (not a public header).
 *
 * The safetensors shard writer (used by make-tiny and the tests' corrupters), a header peek for
 * one tensor's shape, the byte-level BPE trainer and the GPT-2 byte order of the tokenizer. */
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

/* Write one shard: header for specs[0..n) in order (data_offsets contiguous, header padded
 * with spaces to a multiple of 8, metadata {"format":"pt"}), then each tensor's bytes as
 * produced by fill(ctx, spec, dst) into a buffer of k3_tensor_spec_bytes(spec). */
typedef k3_status (*k3_st_fill_fn)(void *ctx, const k3_tensor_spec *spec, void *dst);
k3_status k3_st_write_shard(const char *path, const k3_tensor_spec *specs, int64_t n,
                            k3_st_fill_fn fill, void *ctx);

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

/* ---- tokenizer training ---------------------------------------------------------------- */
typedef struct k3_bpe_vocab {
    int n;          /* ranks 0..n-1 */
    uint8_t *bytes; /* all token bytes back to back */
    int64_t *off;   /* [n + 1]: token r = bytes[off[r] .. off[r+1]) */
} k3_bpe_vocab;
/* 256 single bytes in GPT-2 order (rank -> byte). */
void k3_bpe_byte_order(uint8_t rank_to_byte[256]);
/* Byte-level BPE on `text` pre-split with the K3 regex (K3-CHAT.md §4.2): ranks 0..255 are the
 * bytes in GPT-2 order, then merges by highest pair count (ties: lowest merged byte sequence)
 * until n_ranks. If the corpus runs out of pairs first, the rest is filled deterministically
 * with concatenations of existing tokens (documented in bpe.c). */
k3_status k3_bpe_train(const char *text, size_t n_bytes, int n_ranks, k3_bpe_vocab *out);
void k3_bpe_vocab_free(k3_bpe_vocab *v);

#endif /* K3_MODEL_INTERNAL_H */
