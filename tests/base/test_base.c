/* test_base.c — base module: status messages, PRNG statistics, bf16/f16 conversions, hashing. */
#include <unistd.h>

#include "k3_test.h"

static void test_status(void) {
    k3_clear_error();
    k3_status s = K3_ERR(K3_ERR_CONFIG, "key '%s' is missing", "hidden_size");
    K3_CHECK(s == K3_ERR_CONFIG, "status passes through");
    K3_CHECK(strstr(k3_last_error(), "key 'hidden_size' is missing") != NULL, "%s",
             k3_last_error());
    K3_CHECK(strstr(k3_last_error(), "test_base.c:") != NULL, "file:line recorded: %s",
             k3_last_error());
    for (int i = 0; i < K3_STATUS_COUNT; i++)
        K3_CHECK(strlen(k3_status_name((k3_status)i)) > 0, "status %d has a name", i);
}

static void test_rng(void) {
    k3_rng a, b;
    k3_rng_seed(&a, 42);
    k3_rng_seed(&b, 42);
    bool same = true;
    for (int i = 0; i < 1000; i++) same &= k3_rng_u64(&a) == k3_rng_u64(&b);
    K3_CHECK(same, "same seed, same stream");
    k3_rng_seed(&b, 43);
    K3_CHECK(k3_rng_u64(&a) != k3_rng_u64(&b), "different seeds differ");
    /* Not degenerate: uniform mean/variance and normal moments within 5 sigma of n = 200000. */
    const int n = 200000;
    double su = 0, su2 = 0, sn = 0, sn2 = 0;
    int out_of_range = 0;
    k3_rng_seed(&a, 7);
    for (int i = 0; i < n; i++) {
        double u = k3_rng_uniform(&a), g = k3_rng_normal(&a);
        out_of_range += !(u >= 0 && u < 1);
        su += u;
        su2 += u * u;
        sn += g;
        sn2 += g * g;
    }
    K3_CHECK(out_of_range == 0, "%d uniforms outside [0,1)", out_of_range);
    double mu = su / n, varu = su2 / n - mu * mu, mn = sn / n, varn = sn2 / n - mn * mn;
    K3_CHECK(fabs(mu - 0.5) < 5 * sqrt(1.0 / 12 / n), "uniform mean %g", mu);
    K3_CHECK(fabs(varu - 1.0 / 12) < 0.002, "uniform variance %g", varu);
    K3_CHECK(fabs(mn) < 5 / sqrt((double)n), "normal mean %g", mn);
    K3_CHECK(fabs(varn - 1) < 5 * sqrt(2.0 / n), "normal variance %g", varn);
}

static void test_bf16(void) {
    /* Exact cases: 1.0 = 0x3f80, -2.0 = 0xc000; round to nearest even on the dropped 16 bits. */
    K3_CHECK(k3_f32_to_bf16(1.0f) == 0x3f80, "1.0");
    K3_CHECK(k3_f32_to_bf16(-2.0f) == 0xc000, "-2.0");
    K3_CHECK(k3_bf16_to_f32(0x3f80) == 1.0f, "back to 1.0");
    float tie_even, tie_odd, above;
    uint32_t u = 0x3f808000u;
    memcpy(&tie_even, &u, 4); /* halfway, lower is even -> down */
    u = 0x3f818000u;
    memcpy(&tie_odd, &u, 4); /* halfway, lower is odd -> up */
    u = 0x3f808001u;
    memcpy(&above, &u, 4);
    K3_CHECK(k3_f32_to_bf16(tie_even) == 0x3f80, "tie to even (down)");
    K3_CHECK(k3_f32_to_bf16(tie_odd) == 0x3f82, "tie to even (up)");
    K3_CHECK(k3_f32_to_bf16(above) == 0x3f81, "above half rounds up");
    K3_CHECK(isnan(k3_bf16_to_f32(k3_f32_to_bf16(NAN))), "NaN stays NaN");
    /* f16: 1.0 = 0x3c00, smallest subnormal 2^-24 = 0x0001, -inf = 0xfc00, 65504 = 0x7bff. */
    K3_CHECK(k3_f16_to_f32(0x3c00) == 1.0f, "f16 1.0");
    K3_CHECK(k3_f16_to_f32(0x0001) == ldexpf(1, -24), "f16 subnormal");
    K3_CHECK(k3_f16_to_f32(0x03ff) == ldexpf(1023, -24), "f16 largest subnormal");
    K3_CHECK(isinf(k3_f16_to_f32(0xfc00)) && k3_f16_to_f32(0xfc00) < 0, "f16 -inf");
    K3_CHECK(k3_f16_to_f32(0x7bff) == 65504.0f, "f16 max");
}

static void test_hash(void) {
    /* FNV-1a 64 of "a" is 0xaf63dc4c8601ec8c (published test vector). */
    K3_CHECK(k3_hash_bytes("a", 1, K3_HASH_INIT) == 0xaf63dc4c8601ec8cull, "fnv1a('a')");
    K3_CHECK(k3_hash_bytes("", 0, K3_HASH_INIT) == K3_HASH_INIT, "empty");
}

static void test_read_file(void) {
    char path[64];
    snprintf(path, sizeof path, "/tmp/k3_test_base_%d", (int)getpid());
    FILE *f = fopen(path, "wb");
    K3_CHECK(f != NULL, "temp file");
    if (!f) return;
    fputs("hello", f);
    fclose(f);
    char *buf = NULL;
    size_t n = 0;
    K3_CHECK_OK(k3_read_file(path, &buf, &n));
    K3_CHECK(buf && n == 5 && strcmp(buf, "hello") == 0, "content read back");
    k3_free(buf);
    remove(path);
    /* a directory must be an error naming it, not a 2^63-byte allocation */
    K3_CHECK_ERR(k3_read_file("/tmp", &buf, &n), K3_ERR_IO, "/tmp: not a regular file");
    K3_CHECK(buf == NULL, "no buffer on error");
    K3_CHECK_ERR(k3_read_file(path, &buf, &n), K3_ERR_IO, "cannot open");
}

int main(void) {
    test_status();
    test_read_file();
    test_rng();
    test_bf16();
    test_hash();
    return k3_test_done("base");
}
