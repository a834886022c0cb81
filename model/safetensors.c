/* safetensors.c — the checkpoint reader: index + shard headers, name lookup, byte-range reads,
 * the check against the catalogue, and the shard writer make-tiny uses.
 *
 * Strict header rules (every violation names the file and, where there is one, the tensor):
 * the 8-byte little-endian header length against the file size and K3_ST_MAX_HEADER; the header
 * is one JSON object beginning with '{', held strictly (k3_json_parse_strict: UTF-8 keys and
 * strings with no NUL or control byte, no key twice, only spaces after it); __metadata__ maps
 * strings to strings; an entry holds dtype, shape and data_offsets only; dtype names known;
 * shape x dtype size == the data_offsets span; the spans tile the data section exactly (no
 * overlap, no hole, no trailing byte: check_layout); no tensor in two shards; every index entry
 * points to a shard that holds the tensor and every tensor is in the index. No tensor data is
 * read at open; reads are pread of one tensor's span (thread-safe), counted in an atomic
 * bytes-read counter.
 * Lookup is an open-addressing hash table over the names (the real K3 has ~170k tensors). */
#include "k3_model.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model_internal.h"

struct k3_ckpt {
    char *dir;
    char *listing; /* dir/model.safetensors.index.json, or the single dir/model.safetensors */
    int n_shards;
    char **shard_name;    /* [n_shards] file names ("model-00001-of-00003.safetensors") */
    char **shard_path;    /* [n_shards] dir/name */
    int *fd;              /* [n_shards] */
    uint64_t *shard_size; /* [n_shards] bytes */
    k3_ckpt_tensor *t;    /* [n] */
    int64_t n, cap;
    int64_t *ht; /* [ht_cap] tensor index or -1 */
    size_t ht_cap;
    _Atomic uint64_t bytes_read;
};

static const char *const st_dtypes[] = {"F32", "BF16", "F16", "U8", "I32", "I64"};

bool k3_st_dtype_parse(const char *s, k3_dtype *out) {
    for (int i = 0; i < (int)K3_ARRAY_LEN(st_dtypes); i++)
        if (strcmp(s, st_dtypes[i]) == 0) {
            *out = (k3_dtype)i;
            return true;
        }
    return false;
}

static uint64_t name_hash(const char *s) {
    return k3_hash_bytes(s, strlen(s), K3_HASH_INIT);
}

static int64_t ht_lookup(const k3_ckpt *ck, const char *name) {
    if (!ck->ht_cap) return -1;
    size_t m = ck->ht_cap - 1, i = (size_t)name_hash(name) & m;
    for (;;) {
        int64_t v = ck->ht[i];
        if (v < 0) return -1;
        if (strcmp(ck->t[v].name, name) == 0) return v;
        i = (i + 1) & m;
    }
}

static k3_status ht_build(k3_ckpt *ck) {
    size_t cap = 16;
    while (cap < (size_t)ck->n * 2 + 1) cap <<= 1;
    K3_TRY(k3_alloc((void **)&ck->ht, cap * sizeof(int64_t), "tensor name table"));
    for (size_t i = 0; i < cap; i++) ck->ht[i] = -1;
    ck->ht_cap = cap;
    for (int64_t k = 0; k < ck->n; k++) {
        size_t i = (size_t)name_hash(ck->t[k].name) & (cap - 1);
        while (ck->ht[i] >= 0) {
            const k3_ckpt_tensor *o = &ck->t[ck->ht[i]];
            if (strcmp(o->name, ck->t[k].name) == 0)
                return K3_ERR(K3_ERR_FORMAT, "tensor %s appears in both %s and %s", o->name,
                              ck->shard_path[o->shard], ck->shard_path[ck->t[k].shard]);
            i = (i + 1) & (cap - 1);
        }
        ck->ht[i] = k;
    }
    return K3_OK;
}

k3_status k3_pread_all(int fd, void *dst, uint64_t n, uint64_t off, uint64_t *got) {
    uint8_t *p = dst;
    *got = 0;
    while (*got < n) {
        ssize_t r =
            pread(fd, p + *got, (size_t)K3_MIN(n - *got, (uint64_t)1 << 30), (off_t)(off + *got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return K3_ERR_IO;
        if (r == 0) break;
        *got += (uint64_t)r;
    }
    return K3_OK;
}

typedef struct span {
    uint64_t b, e;
    int64_t idx;
} span;
static int span_cmp(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->b != y->b) return x->b < y->b ? -1 : 1;
    return x->e < y->e ? -1 : (x->e > y->e);
}

static k3_status add_tensor(k3_ckpt *ck, k3_ckpt_tensor *t) {
    if (ck->n == ck->cap) {
        int64_t nc = ck->cap ? ck->cap * 2 : 256;
        k3_ckpt_tensor *nt = realloc(ck->t, (size_t)nc * sizeof *nt);
        if (!nt) return K3_ERR(K3_ERR_NOMEM, "tensor table (%lld entries)", (long long)nc);
        ck->t = nt;
        ck->cap = nc;
    }
    ck->t[ck->n++] = *t;
    return K3_OK;
}

/* The tensors of shard s (ck->t[first..]) must tile its data section exactly, as the
 * safetensors reference reader requires (sorted by offsets, each tensor begins where the
 * previous one ends, the last ends at the end of the file): no overlap, no hole (bytes no tensor
 * owns: a polyglot file), no trailing byte (junk appended, or a header length that is off, which
 * shifts every tensor). An empty tensor may sit at any boundary but not inside another's bytes. */
static k3_status check_layout(const k3_ckpt *ck, int s, int64_t first, uint64_t data0,
                              uint64_t dsize) {
    const char *path = ck->shard_path[s];
    int64_t m = ck->n - first;
    if (m == 0) {
        if (dsize == 0) return K3_OK;
        return K3_ERR(K3_ERR_FORMAT,
                      "%s: %llu bytes of data after the header, which lists no tensor (header "
                      "length wrong?)",
                      path, (unsigned long long)dsize);
    }
    span *sp = NULL;
    K3_TRY(k3_alloc((void **)&sp, (size_t)m * sizeof *sp, "span list"));
    for (int64_t i = 0; i < m; i++) {
        const k3_ckpt_tensor *x = &ck->t[first + i];
        sp[i] = (span){x->offset - data0, x->offset - data0 + x->n_bytes, first + i};
    }
    qsort(sp, (size_t)m, sizeof *sp, span_cmp);
#define NAME(i) ck->t[sp[i].idx].name
    k3_status st = K3_OK;
    /* Overlaps first. Sorted by begin: a non-empty span overlaps an earlier one iff it begins
     * before the furthest end seen so far (not just the previous span's end: [0,16] [4,4]
     * [8,16] overlap). Empty spans hold no bytes and are checked below. */
    int64_t far = -1; /* index into sp of the non-empty span with the furthest end */
    for (int64_t i = 0; i < m && st == K3_OK; i++) {
        if (sp[i].e == sp[i].b) continue;
        if (far >= 0 && sp[i].b < sp[far].e)
            st = K3_ERR(K3_ERR_FORMAT,
                        "%s: tensors %s and %s overlap (bytes %llu..%llu and %llu..%llu of the "
                        "data)",
                        path, NAME(far), NAME(i), (unsigned long long)sp[far].b,
                        (unsigned long long)sp[far].e, (unsigned long long)sp[i].b,
                        (unsigned long long)sp[i].e);
        if (far < 0 || sp[i].e > sp[far].e) far = i;
    }
    /* Holes and the end: the non-empty spans, now disjoint and in order, cover [0, dsize). */
    uint64_t at = 0;
    int64_t last = -1;
    for (int64_t i = 0; i < m && st == K3_OK; i++) {
        if (sp[i].e == sp[i].b) continue;
        if (sp[i].b != at)
            st = K3_ERR(K3_ERR_FORMAT,
                        "%s: bytes %llu..%llu of the data section belong to no tensor (a hole "
                        "before tensor %s; the format allows none)",
                        path, (unsigned long long)at, (unsigned long long)sp[i].b, NAME(i));
        at = sp[i].e;
        last = i;
    }
    if (st == K3_OK && at != dsize) {
        if (last >= 0)
            st = K3_ERR(K3_ERR_FORMAT,
                        "%s: %llu byte(s) after the last tensor %s (its data ends at byte %llu of "
                        "the %llu-byte data section: a wrong header length, or bytes appended)",
                        path, (unsigned long long)(dsize - at), NAME(last), (unsigned long long)at,
                        (unsigned long long)dsize);
        else
            st = K3_ERR(K3_ERR_FORMAT,
                        "%s: %llu bytes of data but every tensor is empty (tensor %s; header "
                        "length wrong?)",
                        path, (unsigned long long)dsize, NAME(0));
    }
    /* An empty span sorts before the span that begins at its offset, so the last non-empty span
     * before it must end at or before that offset. */
    int64_t prev = -1;
    for (int64_t i = 0; i < m && st == K3_OK; i++) {
        if (sp[i].e != sp[i].b) {
            prev = i;
        } else if (prev >= 0 && sp[prev].e > sp[i].b) {
            st = K3_ERR(K3_ERR_FORMAT,
                        "%s: tensor %s is empty but its data_offsets [%llu, %llu] lie inside "
                        "tensor %s [%llu, %llu]",
                        path, NAME(i), (unsigned long long)sp[i].b, (unsigned long long)sp[i].e,
                        NAME(prev), (unsigned long long)sp[prev].b, (unsigned long long)sp[prev].e);
        }
    }
#undef NAME
    k3_free(sp);
    return st;
}

/* Read and check the header of an open shard file; its tensors are appended to ck->t. */
static k3_status parse_header(k3_ckpt *ck, int s) {
    const char *path = ck->shard_path[s];
    int fd = ck->fd[s];
    uint64_t fsize = ck->shard_size[s], got;
    uint8_t lenb[8];
    if (fsize < 8)
        return K3_ERR(K3_ERR_FORMAT,
                      "%s: file is %llu bytes, too short for the 8-byte header "
                      "length (truncated?)",
                      path, (unsigned long long)fsize);
    if (k3_pread_all(fd, lenb, 8, 0, &got) != K3_OK || got != 8)
        return K3_ERR(K3_ERR_IO, "%s: cannot read the header length: %s", path, strerror(errno));
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | lenb[i];
    if (hlen > K3_ST_MAX_HEADER)
        return K3_ERR(K3_ERR_FORMAT, "%s: header length %llu exceeds the %llu-byte limit", path,
                      (unsigned long long)hlen, (unsigned long long)K3_ST_MAX_HEADER);
    if (hlen > fsize - 8)
        return K3_ERR(K3_ERR_FORMAT,
                      "%s: header length %llu runs past the end of the file "
                      "(%llu bytes)",
                      path, (unsigned long long)hlen, (unsigned long long)fsize);
    if (hlen < 2) return K3_ERR(K3_ERR_FORMAT, "%s: empty header", path);
    char *h = NULL;
    K3_TRY(k3_alloc((void **)&h, hlen + 1, "safetensors header"));
    if (k3_pread_all(fd, h, hlen, 8, &got) != K3_OK || got != hlen) {
        k3_free(h);
        return K3_ERR(K3_ERR_IO, "%s: cannot read the %llu-byte header", path,
                      (unsigned long long)hlen);
    }
    h[hlen] = 0;
    cJSON *root = NULL;
    k3_status st =
        k3_json_parse_strict(h, (size_t)hlen, path, "the header", "the header is not valid JSON",
                             "header key ", K3_ERR_FORMAT, &root);
    char lead = h[0];
    k3_free(h);
    K3_TRY(st);
    uint64_t data0 = 8 + hlen, dsize = fsize - data0;
    int64_t first = ck->n;
    if (!cJSON_IsObject(root)) {
        st = K3_ERR(K3_ERR_FORMAT, "%s: the header is not a JSON object", path);
        goto done;
    }
    if (lead != '{') { /* the format: "MUST begin with a { character (0x7B)" */
        st = K3_ERR(K3_ERR_FORMAT, "%s: the header begins with byte 0x%02x, not '{'", path,
                    (unsigned char)lead);
        goto done;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, root) {
        const char *name = it->string;
        if (strcmp(name, "__metadata__") == 0) {
            if (!cJSON_IsObject(it)) {
                st = K3_ERR(K3_ERR_FORMAT, "%s: __metadata__ is not an object", path);
                goto done;
            }
            const cJSON *mv; /* the format: a string -> string map */
            cJSON_ArrayForEach(mv, it) if (!cJSON_IsString(mv)) {
                st = K3_ERR(K3_ERR_FORMAT, "%s: __metadata__.%s is not a string", path, mv->string);
                goto done;
            }
            continue;
        }
        const cJSON *dt = cJSON_GetObjectItemCaseSensitive(it, "dtype");
        const cJSON *sh = cJSON_GetObjectItemCaseSensitive(it, "shape");
        const cJSON *of = cJSON_GetObjectItemCaseSensitive(it, "data_offsets");
        k3_ckpt_tensor t = {0};
        if (!cJSON_IsObject(it) || !cJSON_IsString(dt) || !cJSON_IsArray(sh) ||
            !cJSON_IsArray(of)) {
            st = K3_ERR(K3_ERR_FORMAT, "%s: tensor %s: entry needs dtype, shape and data_offsets",
                        path, name);
            goto done;
        }
        if (cJSON_GetArraySize(it) != 3) { /* keys are unique (k3_json_parse_strict) */
            const cJSON *k = it->child;
            while (k && (strcmp(k->string, "dtype") == 0 || strcmp(k->string, "shape") == 0 ||
                         strcmp(k->string, "data_offsets") == 0))
                k = k->next;
            st = K3_ERR(K3_ERR_FORMAT,
                        "%s: tensor %s: unknown key '%s' (an entry holds dtype, shape and "
                        "data_offsets only)",
                        path, name, k ? k->string : "?");
            goto done;
        }
        if (!k3_st_dtype_parse(dt->valuestring, &t.dtype)) {
            st = K3_ERR(K3_ERR_FORMAT, "%s: tensor %s: unknown dtype '%s'", path, name,
                        dt->valuestring);
            goto done;
        }
        int nd = cJSON_GetArraySize(sh);
        if (nd > K3_MAX_DIMS) {
            st = K3_ERR(K3_ERR_FORMAT, "%s: tensor %s: %d dimensions (at most %d)", path, name, nd,
                        K3_MAX_DIMS);
            goto done;
        }
        t.ndim = nd;
        uint64_t numel = 1;
        for (int i = 0; i < nd; i++) {
            const cJSON *d = cJSON_GetArrayItem(sh, i);
            if (!cJSON_IsNumber(d) || d->valuedouble < 0 || d->valuedouble > 1e15 ||
                d->valuedouble != (double)(int64_t)d->valuedouble) {
                st = K3_ERR(K3_ERR_FORMAT, "%s: tensor %s: shape[%d] is not a size", path, name, i);
                goto done;
            }
            t.shape[i] = (int64_t)d->valuedouble;
            if (t.shape[i] && numel > UINT64_MAX / 16 / (uint64_t)t.shape[i]) {
                st = K3_ERR(K3_ERR_FORMAT, "%s: tensor %s: shape overflows", path, name);
                goto done;
            }
            numel *= (uint64_t)t.shape[i];
        }
        const cJSON *b = cJSON_GetArrayItem(of, 0), *e = cJSON_GetArrayItem(of, 1);
        /* integers only (like shape): 16.5 must not be truncated to 16; 2^53 keeps them exact */
        if (cJSON_GetArraySize(of) != 2 || !cJSON_IsNumber(b) || !cJSON_IsNumber(e) ||
            b->valuedouble < 0 || e->valuedouble < b->valuedouble || e->valuedouble > 9.0e15 ||
            b->valuedouble != floor(b->valuedouble) || e->valuedouble != floor(e->valuedouble)) {
            st = K3_ERR(K3_ERR_FORMAT,
                        "%s: tensor %s: data_offsets must be [begin, end], integers with "
                        "0 <= begin <= end",
                        path, name);
            goto done;
        }
        uint64_t ob = (uint64_t)b->valuedouble, oe = (uint64_t)e->valuedouble;
        uint64_t want = numel * k3_dtype_size(t.dtype);
        if (oe - ob != want) {
            st = K3_ERR(K3_ERR_FORMAT,
                        "%s: tensor %s: data_offsets span %llu bytes but shape x "
                        "%s needs %llu",
                        path, name, (unsigned long long)(oe - ob), dt->valuestring,
                        (unsigned long long)want);
            goto done;
        }
        if (oe > dsize) {
            st = K3_ERR(K3_ERR_FORMAT,
                        "%s: tensor %s: data_offsets [%llu, %llu] run past the end "
                        "of the data section (%llu bytes; file truncated?)",
                        path, name, (unsigned long long)ob, (unsigned long long)oe,
                        (unsigned long long)dsize);
            goto done;
        }
        t.shard = s;
        t.offset = data0 + ob;
        t.n_bytes = want;
        size_t nl = strlen(name);
        char *nm = malloc(nl + 1);
        if (!nm) {
            st = K3_ERR(K3_ERR_NOMEM, "tensor name");
            goto done;
        }
        memcpy(nm, name, nl + 1);
        t.name = nm;
        if ((st = add_tensor(ck, &t)) != K3_OK) {
            free(nm);
            goto done;
        }
    }
    st = check_layout(ck, s, first, data0, dsize);
done:
    cJSON_Delete(root);
    return st;
}

static k3_status open_shard(k3_ckpt *ck, int s, const char *why) {
    const k3_status st =
        k3_open_regular(ck->shard_path[s], 0, K3_ERR_MISSING, &ck->fd[s], &ck->shard_size[s]);
    if (st != K3_OK) { /* "PATH: cannot open shard listed in ...: <why, without the path>" */
        const char *path = ck->shard_path[s], *e = k3_last_error();
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", strncmp(e, path, strlen(path)) ? e : e + strlen(path) + 2);
        return K3_ERR(st, "%s: cannot open shard%s: %s", path, why, msg);
    }
    return parse_header(ck, s);
}

static k3_status alloc_shards(k3_ckpt *ck, int n) {
    ck->n_shards = n;
    K3_TRY(k3_calloc((void **)&ck->shard_name, (size_t)n * sizeof(char *), "shard list"));
    K3_TRY(k3_calloc((void **)&ck->shard_path, (size_t)n * sizeof(char *), "shard list"));
    K3_TRY(k3_calloc((void **)&ck->shard_size, (size_t)n * sizeof(uint64_t), "shard list"));
    K3_TRY(k3_alloc((void **)&ck->fd, (size_t)n * sizeof(int), "shard list"));
    for (int i = 0; i < n; i++) ck->fd[i] = -1;
    return K3_OK;
}

static k3_status set_shard(k3_ckpt *ck, int s, const char *name) {
    size_t nl = strlen(name), dl = strlen(ck->dir);
    ck->shard_name[s] = malloc(nl + 1);
    ck->shard_path[s] = malloc(dl + nl + 2);
    if (!ck->shard_name[s] || !ck->shard_path[s]) return K3_ERR(K3_ERR_NOMEM, "shard name");
    memcpy(ck->shard_name[s], name, nl + 1);
    snprintf(ck->shard_path[s], dl + nl + 2, "%s/%s", ck->dir, name);
    return K3_OK;
}

static int str_cmp(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static k3_status open_index(k3_ckpt *ck, const char *ipath) {
    char *text = NULL;
    size_t n = 0;
    K3_TRY(k3_read_file(ipath, &text, &n));
    cJSON *root = NULL;
    k3_status st = k3_json_parse_strict(text, n, ipath, "the index", "invalid JSON", "key ",
                                        K3_ERR_FORMAT, &root);
    k3_free(text);
    K3_TRY(st);
    const char **names = NULL;
    uint8_t *listed = NULL;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        st = K3_ERR(K3_ERR_FORMAT, "%s: weight_map is missing or not an object", ipath);
        goto done;
    }
    int nw = cJSON_GetArraySize(wm);
    if (nw == 0) {
        st = K3_ERR(K3_ERR_FORMAT, "%s: weight_map is empty", ipath);
        goto done;
    }
    if ((st = k3_alloc((void **)&names, (size_t)nw * sizeof *names, "shard names")) != K3_OK)
        goto done;
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, wm) {
        if (!cJSON_IsString(e) || !e->valuestring[0] || strchr(e->valuestring, '/') ||
            strcmp(e->valuestring, "..") == 0 || strcmp(e->valuestring, ".") == 0) {
            st = K3_ERR(K3_ERR_FORMAT, "%s: weight_map[%s] is not a shard file name", ipath,
                        e->string);
            goto done;
        }
        names[i++] = e->valuestring;
    }
    qsort(names, (size_t)nw, sizeof *names, str_cmp);
    int ns = 0;
    for (i = 0; i < nw; i++)
        if (i == 0 || strcmp(names[i], names[i - 1]) != 0) names[ns++] = names[i];
    if ((st = alloc_shards(ck, ns)) != K3_OK) goto done;
    for (i = 0; i < ns; i++)
        if ((st = set_shard(ck, i, names[i])) != K3_OK) goto done;
    for (i = 0; i < ns; i++) {
        if ((st = open_shard(ck, i, " listed in model.safetensors.index.json")) != K3_OK) goto done;
    }
    if ((st = ht_build(ck)) != K3_OK) goto done;
    /* every index entry must point to a shard that holds the tensor, and every tensor of the
     * shards must be listed (a reader that goes by the index would not see it) */
    if ((st = k3_calloc((void **)&listed, (size_t)ck->n + 1, "index marks")) != K3_OK) goto done;
    cJSON_ArrayForEach(e, wm) {
        int64_t k = ht_lookup(ck, e->string);
        if (k < 0 || strcmp(ck->shard_name[ck->t[k].shard], e->valuestring) != 0) {
            st = K3_ERR(K3_ERR_MISSING, "%s: tensor %s is mapped to %s, which does not contain it",
                        ipath, e->string, e->valuestring);
            goto done;
        }
        listed[k] = 1;
    }
    for (int64_t k = 0; k < ck->n; k++)
        if (!listed[k]) {
            st = K3_ERR(K3_ERR_FORMAT, "%s: tensor %s is not listed in %s",
                        ck->shard_path[ck->t[k].shard], ck->t[k].name, ipath);
            goto done;
        }
done:
    k3_free(listed);
    k3_free(names);
    cJSON_Delete(root);
    return st;
}

k3_status k3_ckpt_open(const char *dir, k3_ckpt **out) {
    *out = NULL;
    k3_ckpt *ck = NULL;
    K3_TRY(k3_calloc((void **)&ck, sizeof *ck, "checkpoint"));
    atomic_init(&ck->bytes_read, 0);
    size_t dl = strlen(dir);
    ck->dir = malloc(dl + 1);
    if (!ck->dir) {
        k3_ckpt_destroy(ck);
        return K3_ERR(K3_ERR_NOMEM, "checkpoint dir");
    }
    memcpy(ck->dir, dir, dl + 1);
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    k3_status st;
    bool indexed = access(path, F_OK) == 0;
    if (!indexed) snprintf(path, sizeof path, "%s/model.safetensors", dir);
    ck->listing = strdup(path);
    if (!ck->listing) {
        k3_ckpt_destroy(ck);
        return K3_ERR(K3_ERR_NOMEM, "checkpoint dir");
    }
    if (indexed) {
        st = open_index(ck, path);
    } else {
        if (access(path, F_OK) != 0) {
            k3_ckpt_destroy(ck);
            return K3_ERR(K3_ERR_MISSING,
                          "%s: no model.safetensors.index.json or "
                          "model.safetensors",
                          dir);
        }
        st = alloc_shards(ck, 1);
        if (st == K3_OK) st = set_shard(ck, 0, "model.safetensors");
        if (st == K3_OK) st = open_shard(ck, 0, "");
        if (st == K3_OK) st = ht_build(ck);
    }
    if (st != K3_OK) {
        k3_ckpt_destroy(ck);
        return st;
    }
    *out = ck;
    return K3_OK;
}

static void ckpt_release(k3_ckpt *ck) {
    for (int s = 0; s < ck->n_shards; s++) {
        if (ck->fd && ck->fd[s] >= 0) close(ck->fd[s]);
        if (ck->shard_name) free(ck->shard_name[s]);
        if (ck->shard_path) free(ck->shard_path[s]);
    }
    for (int64_t i = 0; i < ck->n; i++) free((char *)ck->t[i].name);
    free(ck->t);
    k3_free(ck->ht);
    k3_free(ck->fd);
    k3_free(ck->shard_name);
    k3_free(ck->shard_path);
    k3_free(ck->shard_size);
    free(ck->dir);
    free(ck->listing);
}

void k3_ckpt_destroy(k3_ckpt *ck) {
    if (!ck) return;
    ckpt_release(ck);
    k3_free(ck);
}

const k3_ckpt_tensor *k3_ckpt_find(const k3_ckpt *ck, const char *name) {
    int64_t k = ht_lookup(ck, name);
    return k < 0 ? NULL : &ck->t[k];
}
int64_t k3_ckpt_n_tensors(const k3_ckpt *ck) {
    return ck->n;
}
const k3_ckpt_tensor *k3_ckpt_tensor_at(const k3_ckpt *ck, int64_t i) {
    return i >= 0 && i < ck->n ? &ck->t[i] : NULL;
}
int k3_ckpt_n_shards(const k3_ckpt *ck) {
    return ck->n_shards;
}
const char *k3_ckpt_shard_path(const k3_ckpt *ck, int s) {
    return s >= 0 && s < ck->n_shards ? ck->shard_path[s] : NULL;
}
uint64_t k3_ckpt_shard_size(const k3_ckpt *ck, int s) {
    return s >= 0 && s < ck->n_shards ? ck->shard_size[s] : 0;
}
void k3_error_capture(char *buf, size_t cap) {
    snprintf(buf, cap, "%s", k3_last_error());
    char *at = strrchr(buf, '(');
    if (at && at > buf && at[-1] == ' ' && strchr(at, ':')) at[-1] = 0;
}

void k3_ckpt_count_read(k3_ckpt *ck, uint64_t n) {
    atomic_fetch_add(&ck->bytes_read, n);
}
uint64_t k3_ckpt_bytes_read(const k3_ckpt *ck) {
    return atomic_load(&((k3_ckpt *)ck)->bytes_read);
}

k3_status k3_ckpt_read(k3_ckpt *ck, const k3_ckpt_tensor *t, void *dst) {
    return k3_ckpt_read_range(ck, t, 0, t ? t->n_bytes : 0, dst);
}

k3_status k3_ckpt_read_range(k3_ckpt *ck, const k3_ckpt_tensor *t, uint64_t off, uint64_t n,
                             void *dst) {
    if (!t || t->shard < 0 || t->shard >= ck->n_shards || off > t->n_bytes || n > t->n_bytes - off)
        return K3_ERR(K3_ERR_ARG, "k3_ckpt_read: not a byte range of a tensor of this checkpoint");
    uint64_t got = 0;
    if (k3_pread_all(ck->fd[t->shard], dst, n, t->offset + off, &got) != K3_OK)
        return K3_ERR(K3_ERR_IO, "%s: tensor %s: read failed: %s", ck->shard_path[t->shard],
                      t->name, strerror(errno));
    atomic_fetch_add(&ck->bytes_read, got);
    if (got != n)
        return K3_ERR(K3_ERR_IO,
                      "%s: tensor %s: read %llu of %llu bytes at byte %llu of its data (file "
                      "truncated?)",
                      ck->shard_path[t->shard], t->name, (unsigned long long)got,
                      (unsigned long long)n, (unsigned long long)off);
    return K3_OK;
}

int64_t k3_ckpt_verify(const k3_ckpt *ck, const k3_config *c,
                       void (*report)(void *ctx, const char *problem), void *ctx) {
    int64_t n = k3_catalog(c, NULL, 0), problems = 0;
    k3_tensor_spec *specs = NULL;
    uint8_t *seen = NULL;
    char msg[512];
    if (k3_alloc((void **)&specs, (size_t)n * sizeof *specs, "catalogue") != K3_OK ||
        k3_calloc((void **)&seen, (size_t)ck->n + 1, "verify marks") != K3_OK) {
        if (report) report(ctx, "out of memory while verifying");
        k3_free(specs);
        return 1;
    }
    k3_catalog(c, specs, n);
    for (int64_t i = 0; i < n; i++) {
        const k3_tensor_spec *s = &specs[i];
        const k3_ckpt_tensor *t = k3_ckpt_find(ck, s->name);
        if (!t) {
            problems++;
            snprintf(msg, sizeof msg, "missing tensor %s (%s, shape from the config): not in %s",
                     s->name, k3_dtype_name(s->dtype), ck->listing);
            if (report) report(ctx, msg);
            continue;
        }
        seen[t - ck->t] = 1;
        bool shape_ok = t->ndim == s->ndim;
        for (int d = 0; shape_ok && d < s->ndim; d++) shape_ok = t->shape[d] == s->shape[d];
        if (t->dtype != s->dtype || !shape_ok) {
            char a[96], b[96];
            int la = 0, lb = 0;
            for (int d = 0; d < s->ndim; d++)
                la += snprintf(a + la, sizeof a - (size_t)la, "%s%lld", d ? ", " : "",
                               (long long)s->shape[d]);
            for (int d = 0; d < t->ndim; d++)
                lb += snprintf(b + lb, sizeof b - (size_t)lb, "%s%lld", d ? ", " : "",
                               (long long)t->shape[d]);
            problems++;
            snprintf(msg, sizeof msg, "%s: tensor %s is %s [%s], expected %s [%s]",
                     ck->shard_path[t->shard], s->name, k3_dtype_name(t->dtype), b,
                     k3_dtype_name(s->dtype), a);
            if (report) report(ctx, msg);
        }
    }
    for (int64_t k = 0; k < ck->n; k++) {
        if (seen[k]) continue;
        const char *nm = ck->t[k].name;
        /* the released K3 also carries the vision tower; text-only inference ignores it */
        if (c->tensor_prefix[0] &&
            (strncmp(nm, "vision_tower.", 13) == 0 || strncmp(nm, "mm_projector.", 13) == 0))
            continue;
        problems++;
        snprintf(msg, sizeof msg, "%s: unexpected tensor %s (not implied by the config)",
                 ck->shard_path[ck->t[k].shard], nm);
        if (report) report(ctx, msg);
    }
    k3_free(specs);
    k3_free(seen);
    return problems;
}

/* ---- header peek (config load) ------------------------------------------------------------ */
k3_status k3_st_peek_shape(const char *dir, const char *name, int64_t shape[K3_MAX_DIMS],
                           int *ndim) {
    char path[4096], shard[1024];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    char *text = NULL;
    size_t n = 0;
    if (access(path, F_OK) == 0) {
        K3_TRY(k3_read_file(path, &text, &n));
        cJSON *root = NULL;
        k3_status st = k3_json_parse_strict(text, n, path, "the index", "invalid JSON", "key ",
                                            K3_ERR_FORMAT, &root);
        k3_free(text);
        K3_TRY(st);
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(root, "weight_map"), name);
        bool ok = cJSON_IsString(f) && !strchr(f->valuestring, '/');
        if (ok) snprintf(shard, sizeof shard, "%s", f->valuestring);
        cJSON_Delete(root);
        if (!ok) return K3_ERR(K3_ERR_MISSING, "%s: no entry for %s", path, name);
    } else {
        snprintf(shard, sizeof shard, "model.safetensors");
    }
    k3_ckpt one = {0};
    one.dir = (char *)dir;
    K3_TRY(alloc_shards(&one, 1));
    k3_status st = set_shard(&one, 0, shard);
    if (st == K3_OK) st = open_shard(&one, 0, "");
    if (st == K3_OK) {
        st = K3_ERR(K3_ERR_MISSING, "%s: no tensor %s", one.shard_path[0], name);
        for (int64_t i = 0; i < one.n; i++)
            if (strcmp(one.t[i].name, name) == 0) {
                *ndim = one.t[i].ndim;
                memcpy(shape, one.t[i].shape, sizeof one.t[i].shape);
                st = K3_OK;
            }
    }
    one.dir = NULL; /* borrowed */
    ckpt_release(&one);
    return st;
}

/* ---- writer --------------------------------------------------------------------------------- */
static k3_status write_all(FILE *f, const void *p, size_t n, const char *path) {
    if (n && fwrite(p, 1, n, f) != n)
        return K3_ERR(K3_ERR_IO, "%s: write failed: %s", path, strerror(errno));
    return K3_OK;
}

k3_status k3_st_write_shard(const char *path, const k3_tensor_spec *specs, int64_t n,
                            k3_st_fill_fn fill, void *ctx) {
    /* header text: deterministic, tensors in the given order, contiguous offsets. The buffer
     * is sized from the real name lengths (each number <= 20 digits, + 8 padding); every
     * snprintf is still checked against the room left. */
    size_t cap = 64 + 8, len = 0;
    for (int64_t i = 0; i < n; i++)
        cap += strnlen(specs[i].name, sizeof specs[i].name) + 64 + 21 * ((size_t)K3_MAX_DIMS + 2);
    char *h = NULL;
    K3_TRY(k3_alloc((void **)&h, cap, "safetensors header"));
    k3_status st = K3_OK;
    uint64_t off = 0, max_bytes = 0;
#define PUT(...)                                                                                   \
    do {                                                                                           \
        int w_ = snprintf(h + len, cap - len, __VA_ARGS__);                                        \
        if (w_ < 0 || (size_t)w_ >= cap - len - 8) {                                               \
            st = K3_ERR(K3_ERR_INTERNAL, "%s: safetensors header outgrew its %zu-byte buffer",     \
                        path, cap);                                                                \
            goto header_done;                                                                      \
        }                                                                                          \
        len += (size_t)w_;                                                                         \
    } while (0)
    PUT("{\"__metadata__\":{\"format\":\"pt\"}");
    for (int64_t i = 0; i < n; i++) {
        const k3_tensor_spec *s = &specs[i];
        int64_t nb_s = k3_tensor_spec_bytes(s);
        if (nb_s < 0) {
            st = K3_ERR(K3_ERR_INTERNAL, "%s: tensor %s: size overflows", path, s->name);
            goto header_done;
        }
        uint64_t nb = (uint64_t)nb_s;
        PUT(",\"%s\":{\"dtype\":\"%s\",\"shape\":[", s->name, k3_dtype_name(s->dtype));
        for (int d = 0; d < s->ndim; d++) PUT("%s%lld", d ? "," : "", (long long)s->shape[d]);
        PUT("],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
            (unsigned long long)(off + nb));
        off += nb;
        if (nb > max_bytes) max_bytes = nb;
    }
    PUT("}");
#undef PUT
    while (len % 8) h[len++] = ' ';
header_done:
    if (st != K3_OK) {
        k3_free(h);
        return st;
    }
    FILE *f = fopen(path, "wb");
    if (!f) {
        k3_free(h);
        return K3_ERR(K3_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    }
    uint8_t lenb[8];
    for (int i = 0; i < 8; i++) lenb[i] = (uint8_t)((uint64_t)len >> (8 * i));
    st = write_all(f, lenb, 8, path);
    if (st == K3_OK) st = write_all(f, h, len, path);
    k3_free(h);
    void *buf = NULL;
    if (st == K3_OK) st = k3_alloc(&buf, max_bytes ? max_bytes : 1, "tensor buffer");
    for (int64_t i = 0; st == K3_OK && i < n; i++) {
        st = fill(ctx, &specs[i], buf);
        if (st == K3_OK) st = write_all(f, buf, (size_t)k3_tensor_spec_bytes(&specs[i]), path);
    }
    k3_free(buf);
    if (fclose(f) != 0 && st == K3_OK)
        st = K3_ERR(K3_ERR_IO, "%s: close failed: %s", path, strerror(errno));
    return st;
}
