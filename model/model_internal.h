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

/* pread until n bytes or the end of the file (*got says how many; EINTR retried). K3_ERR_IO, with
 * errno set and no message, when a read fails. */
k3_status k3_pread_all(int fd, void *dst, uint64_t n, uint64_t off, uint64_t *got);
/* k3_last_error() into buf without the " (file.c:NN)" its K3_ERR added: a worker thread's error
 * that the calling thread re-raises with its own K3_ERR (errors are per thread). */
void k3_error_capture(char *buf, size_t cap);
/* Add n bytes to the checkpoint's bytes-read counter (reads made outside k3_ckpt_read_range). */
void k3_ckpt_count_read(k3_ckpt *ck, uint64_t n);

/* ---- ckpt_map.c: shard files mapped instead of read (k3_load_sel.map) -----------------------
 * A shard mapped read-only and private, its file offsets congruent to its addresses modulo 2 MB,
 * advised MADV_HUGEPAGE; nothing is resident until populated. */
typedef struct k3_ckpt_map {
    uint8_t *base; /* file byte 0 */
    uint64_t n_bytes;
    void *reserve; /* the address range reserved around it (unmapped as one) */
    size_t reserve_bytes;
} k3_ckpt_map;
k3_status k3_ckpt_map_shard(const k3_ckpt *ck, int shard, k3_ckpt_map *out);
void k3_ckpt_unmap(k3_ckpt_map *m); /* NULL-safe; zeroes *m */
/* Fault bytes [off, off + n) of a mapped shard in (read from the file where not cached; the
 * caller counts them, k3_ckpt_count_read). I/O errors name the file and the range. */
k3_status k3_ckpt_map_populate(k3_ckpt *ck, int shard, const k3_ckpt_map *m, uint64_t off,
                               uint64_t n);
/* Populate ranges [off, off + n) of maps[shard], n_threads at a time (each takes the next range;
 * the calling thread is one of them and alone calls progress(ctx, tensor bytes done so far, of
 * all the ranges) after each of its ranges, and once at the end). The first error stops the
 * others and is returned. */
typedef struct k3_map_range {
    int shard;
    uint64_t off, n;
    uint64_t tensor_bytes; /* of the tensors in the range (its gaps not counted) */
} k3_map_range;
k3_status k3_ckpt_map_populate_many(k3_ckpt *ck, const k3_ckpt_map *maps, const k3_map_range *r,
                                    int64_t n, int n_threads,
                                    k3_status (*progress)(void *ctx, uint64_t done, uint64_t total),
                                    void *ctx);
/* Over the maps m[0..n): bytes resident now, and of those, bytes mapped by 2 MB entries. */
k3_status k3_ckpt_map_pmd(const k3_ckpt_map *m, int n, uint64_t *rss, uint64_t *pmd);

/* ---- read_many.c: many reads in flight -----------------------------------------------------
 * A whole tensor into dst: host memory, or (device) an address only `upload` touches. */
typedef struct k3_read_req {
    const k3_ckpt_tensor *t;
    void *dst;
    bool device; /* dst is backend memory: the bytes go through opts.upload, piece by piece */
} k3_read_req;
typedef struct k3_read_opts {
    int n_readers; /* reader threads (0 = K3_LOAD_READERS_DEFAULT; 1 = on the calling thread) */
    bool direct;   /* O_DIRECT where the file system takes it (else buffered, said once) */
    /* called from the calling thread only: progress after pieces complete (its error stops
       the reads); upload(ctx, dst, src, n) for each piece of a device request, from a staging
       buffer that is reused once it returns */
    k3_status (*progress)(void *ctx, uint64_t done_bytes, uint64_t total_bytes);
    k3_status (*upload)(void *ctx, void *dst, const void *src, size_t n_bytes);
    void *ctx;
} k3_read_opts;
/* Read every request, split into pieces of K3_LOAD_PIECE_BYTES, n_readers at a time. Host memory
 * held besides the destinations: with device requests, 2 x n_readers staging pieces; with
 * direct, one aligned bounce piece per reader. Errors name the file and the tensor; the first
 * one stops the others. *direct_used: whether O_DIRECT was in effect (may be NULL). */
k3_status k3_ckpt_read_many(k3_ckpt *ck, const k3_read_req *reqs, int64_t n, const k3_read_opts *o,
                            bool *direct_used);

/* Parse text[0..n) as one JSON value held strictly (strict_json.c): only whitespace after it,
 * every string valid UTF-8 with no control byte and no \u0000, no key twice in an object. Errors
 * are `code`: "PATH: SYNTAX (near byte B of N)" for bad syntax, "PATH: N byte(s) after the JSON
 * value of NOUN ..." for text after it, else "PATH: WHAT<key path> ..." naming the key (WHAT:
 * "header key " for a shard header, "" for config.json). On success *out is the tree
 * (cJSON_Delete). */
k3_status k3_json_parse_strict(const char *text, size_t n, const char *path, const char *noun,
                               const char *syntax, const char *what, k3_status code, cJSON **out);

#endif /* K3_MODEL_INTERNAL_H */
