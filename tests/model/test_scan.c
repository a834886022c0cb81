/* test_scan.c — k3_ckpt_scan (the values check of `k3 inspect --verify`) on a hand-made shard
 * whose bad values sit at known places: every NaN/Inf of F32/BF16/F16 and every E8M0 0xFF scale
 * is reported by tensor and row with the right counts, a 0xFF in packed MXFP4 nibbles is not, a
 * row longer than the buffer is counted once, and the reports are the same for every thread count
 * and buffer size (they must not depend on timing). A shard cut short after open is a read error
 * naming the file and the tensor. The expected places come from the table below, not from k3. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_model.h"
#include "k3_test.h"
#include "model_internal.h"

typedef struct poke {
    const char *tensor;
    int64_t elem;
    uint32_t bits; /* the element's bits (F32: 32, BF16/F16: 16, U8: 8) */
} poke;
/* The bad values (and one harmless 0xFF in packed nibbles). a: BF16 [7, 5]; b: F32 [11];
 * c: E8M0 [6, 3] (0xFF in all 6 rows: more than the 4 listed); d: packed U8; e: F16 [2, 3];
 * f: BF16 [3, 1000] (a 2000-byte row, longer than the small buffers below). */
static const poke pokes[] = {
    {"a.weight", 0 * 5 + 1, 0x7fc0},     {"a.weight", 0 * 5 + 4, 0x7f80},
    {"a.weight", 3 * 5 + 0, 0xff80},     {"a.weight", 6 * 5 + 4, 0x7f81},
    {"b.bias", 10, 0x7f800000},          {"c.weight_scale", 0 * 3 + 2, 0xff},
    {"c.weight_scale", 1 * 3 + 0, 0xff}, {"c.weight_scale", 2 * 3 + 1, 0xff},
    {"c.weight_scale", 3 * 3 + 1, 0xff}, {"c.weight_scale", 4 * 3 + 2, 0xff},
    {"c.weight_scale", 5 * 3 + 0, 0xff}, {"d.weight_packed", 5, 0xff},
    {"e.weight", 1 * 3 + 2, 0xfc00},     {"f.weight", 2 * 1000 + 999, 0xffc1},
    {"f.weight", 2 * 1000 + 3, 0x7f80},
};

static k3_status fill(void *ctx, const k3_tensor_spec *s, void *dst) {
    (void)ctx;
    int64_t n = k3_tensor_spec_bytes(s);
    size_t es = k3_dtype_size(s->dtype);
    memset(dst, 0, (size_t)n);
    for (int64_t i = 0; i < n / (int64_t)es; i++) { /* finite, non-zero values: 1.0 */
        uint8_t *p = (uint8_t *)dst + i * (int64_t)es;
        if (s->dtype == K3_DT_F32) memcpy(p, &(uint32_t){0x3f800000}, 4);
        if (s->dtype == K3_DT_BF16) memcpy(p, &(uint16_t){0x3f80}, 2);
        if (s->dtype == K3_DT_F16) memcpy(p, &(uint16_t){0x3c00}, 2);
        if (s->dtype == K3_DT_U8) *p = 0x7f;
    }
    for (size_t k = 0; k < K3_ARRAY_LEN(pokes); k++) {
        if (strcmp(pokes[k].tensor, s->name) != 0) continue;
        uint8_t *p = (uint8_t *)dst + pokes[k].elem * (int64_t)es;
        uint32_t v = pokes[k].bits;
        if (es == 4) memcpy(p, &v, 4);
        if (es == 2) memcpy(p, &(uint16_t){(uint16_t)v}, 2);
        if (es == 1) *p = (uint8_t)v;
    }
    return K3_OK;
}

static k3_tensor_spec spec(const char *name, k3_dtype dt, int ndim, int64_t d0, int64_t d1) {
    k3_tensor_spec s = {.dtype = dt, .ndim = ndim, .shape = {d0, d1}};
    snprintf(s.name, sizeof s.name, "%s", name);
    return s;
}

typedef struct sink {
    char text[8192];
    int n;
} sink;
static void collect(void *ctx, const char *msg) {
    sink *s = ctx;
    size_t l = strlen(s->text);
    snprintf(s->text + l, sizeof s->text - l, "%s\n", msg);
    s->n++;
}
static bool only_b(void *ctx, const k3_ckpt_tensor *t) {
    (void)ctx;
    return strcmp(t->name, "b.bias") == 0;
}

int main(void) {
    char dir[] = "/tmp/k3-scan-test-XXXXXX", path[128];
    if (!mkdtemp(dir)) return 1;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    k3_tensor_spec sp[] = {
        spec("a.weight", K3_DT_BF16, 2, 7, 5),      spec("z.empty", K3_DT_F32, 1, 0, 0),
        spec("b.bias", K3_DT_F32, 1, 11, 0),        spec("c.weight_scale", K3_DT_U8, 2, 6, 3),
        spec("d.weight_packed", K3_DT_U8, 2, 6, 8), spec("e.weight", K3_DT_F16, 2, 2, 3),
        spec("f.weight", K3_DT_BF16, 2, 3, 1000),   spec("g.clean", K3_DT_F32, 2, 4, 4),
    };
    int64_t n_sp = (int64_t)K3_ARRAY_LEN(sp);
    uint64_t total = 0;
    for (int64_t i = 0; i < n_sp; i++) total += (uint64_t)k3_tensor_spec_bytes(&sp[i]);
    K3_CHECK_OK(k3_st_write_shard(path, sp, n_sp, fill, NULL));
    k3_ckpt *ck = NULL;
    K3_CHECK_OK(k3_ckpt_open(dir, &ck));
    if (!ck) return k3_test_done("model_scan");

    /* the expected lines: file, tensor, row, count and the first bad value of the row */
    static const char *want[] = {
        "model.safetensors: tensor a.weight: row 0: 2 non-finite values (first: NaN at column 1)",
        "tensor a.weight: row 3: 1 non-finite value (first: -Inf at column 0)",
        "tensor a.weight: row 6: 1 non-finite value (first: NaN at column 4)",
        "tensor b.bias: 1 non-finite value (first: +Inf at element 10)",
        "tensor c.weight_scale: row 0: 1 E8M0 scale of 0xFF (NaN in OCP MX; first at block 2)",
        "tensor c.weight_scale: row 3: 1 E8M0 scale of 0xFF (NaN in OCP MX; first at block 1)",
        "tensor c.weight_scale: 6 0xFF scales in 6 rows in all (the first 4 listed)",
        "tensor e.weight: row 1: 1 non-finite value (first: -Inf at column 2)",
        "tensor f.weight: row 2: 2 non-finite values (first: +Inf at column 3)",
    };
    struct {
        int threads;
        size_t buf;
    } runs[] = {{1, 0}, {4, 0}, {3, 8}, {2, 24}, {5, 1000}, {8, 3}};
    char first[8192] = "";
    for (size_t r = 0; r < K3_ARRAY_LEN(runs); r++) {
        sink s = {"", 0};
        k3_scan_opts o = {
            .n_threads = runs[r].threads, .buf_bytes = runs[r].buf, .report = collect, .ctx = &s};
        k3_scan_result res;
        K3_CHECK_OK(k3_ckpt_scan(ck, &o, &res));
        K3_CHECK(res.n_bytes == total && res.n_tensors == n_sp,
                 "run %zu: %llu of %llu bytes, %lld tensors", r, (unsigned long long)res.n_bytes,
                 (unsigned long long)total, (long long)res.n_tensors);
        /* 4 in a, 1 in b, 6 in c, 1 in e, 2 in f (3 + 1 + 4 + 1 + 1 + 1 lines, c: 4 rows and its
         * totals); d's 0xFF is a packed nibble pair, not a scale */
        K3_CHECK(res.n_bad_values == 14 && res.n_bad_tensors == 5 && res.n_reports == 11,
                 "run %zu: %lld bad values in %lld tensors, %lld lines:\n%s", r,
                 (long long)res.n_bad_values, (long long)res.n_bad_tensors,
                 (long long)res.n_reports, s.text);
        for (size_t w = 0; w < K3_ARRAY_LEN(want); w++)
            K3_CHECK(strstr(s.text, want[w]) != NULL, "run %zu lacks '%s':\n%s", r, want[w],
                     s.text);
        K3_CHECK(!strstr(s.text, "d.weight_packed") && !strstr(s.text, "g.clean"),
                 "clean tensors reported:\n%s", s.text);
        if (r == 0) snprintf(first, sizeof first, "%s", s.text);
        K3_CHECK(strcmp(first, s.text) == 0, "run %zu (%d threads, %zu-byte buffer) differs:\n%s",
                 r, runs[r].threads, runs[r].buf, s.text);
    }
    /* a selection scans only what it selects */
    sink s = {"", 0};
    k3_scan_opts o = {.select = only_b, .report = collect, .ctx = &s};
    k3_scan_result res;
    K3_CHECK_OK(k3_ckpt_scan(ck, &o, &res));
    K3_CHECK(res.n_tensors == 1 && res.n_bytes == 44 && res.n_bad_values == 1 && s.n == 1,
             "select: %lld tensors, %llu bytes, %d lines", (long long)res.n_tensors,
             (unsigned long long)res.n_bytes, s.n);
    /* the file cut short after the headers were checked: a read error naming file and tensor */
    K3_CHECK(truncate(path, (off_t)(k3_ckpt_shard_size(ck, 0) - 32)) == 0, "truncate");
    K3_CHECK_ERR(k3_ckpt_scan(ck, &(k3_scan_opts){.n_threads = 3}, &res), K3_ERR_IO,
                 "model.safetensors: tensor g.clean: read 32 of 64 bytes");
    k3_ckpt_destroy(ck);
    unlink(path);
    rmdir(dir);
    return k3_test_done("model_scan");
}
