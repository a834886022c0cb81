/* k3_test.h — the tiny harness every C test uses. A test reports only through its exit code:
 * K3_CHECK records a failure (with file:line) and goes on; k3_test_done() returns 1 if any
 * check failed or none ran, and prints the plain closing line
 * "k3-test NAME: N passed, M failed". */
#ifndef K3_TEST_H
#define K3_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_base.h"

static int k3_t_pass, k3_t_fail;

/* stdout line by line, also into a pipe: a test that ctest kills at its timeout has shown its
 * progress lines up to where it was (fully buffered, it showed nothing). */
__attribute__((constructor)) static void k3_t_line_buffered(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
}

#define K3_CHECK(cond, ...)                                                                        \
    do {                                                                                           \
        if (cond) {                                                                                \
            k3_t_pass++;                                                                           \
        } else {                                                                                   \
            k3_t_fail++;                                                                           \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
        }                                                                                          \
    } while (0)

#define K3_CHECK_OK(expr)                                                                          \
    do {                                                                                           \
        k3_status k3_t_s_ = (expr);                                                                \
        K3_CHECK(k3_t_s_ == K3_OK, "%s -> %s: %s", #expr, k3_status_name(k3_t_s_),                 \
                 k3_last_error());                                                                 \
    } while (0)

/* Expect a specific failure status and an error message containing `needle`. */
#define K3_CHECK_ERR(expr, status, needle)                                                         \
    do {                                                                                           \
        k3_clear_error();                                                                          \
        k3_status k3_t_s_ = (expr);                                                                \
        K3_CHECK(k3_t_s_ == (status) && strstr(k3_last_error(), (needle)) != NULL,                 \
                 "%s -> %s '%s' (wanted %s containing '%s')", #expr, k3_status_name(k3_t_s_),      \
                 k3_last_error(), k3_status_name(status), (needle));                               \
    } while (0)

/* A test that ran no check proved nothing: it fails too (a test that legitimately cannot run
 * exits 77 and is registered with SKIP_RETURN_CODE 77 instead). */
static inline int k3_test_done(const char *name) {
    printf("k3-test %s: %d passed, %d failed\n", name, k3_t_pass, k3_t_fail);
    if (k3_t_pass + k3_t_fail == 0) {
        printf("FAIL k3-test %s: no check ran\n", name);
        return 1;
    }
    return k3_t_fail ? 1 : 0;
}

/* a and b [n] equal bit for bit, a finite and not degenerate (sum of squares above min_ss). */
static inline void k3_check_same_bits(const float *a, const float *b, int64_t n, double min_ss,
                                      const char *what) {
    K3_CHECK(memcmp(a, b, (size_t)n * sizeof(float)) == 0, "%s: differ", what);
    double ss = 0;
    bool finite = true;
    for (int64_t i = 0; i < n; i++) finite &= isfinite(a[i]), ss += (double)a[i] * a[i];
    K3_CHECK(finite && ss > min_ss, "%s: not finite or degenerate (sum sq %g)", what, ss);
}

/* Relative L2 distance ||a-b|| / max(||b||, tiny). */
static inline double k3_rel_l2(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    return sqrt(num) / (den > 1e-300 ? sqrt(den) : 1e-150);
}

/* tests/data: the vocabularies and fixtures the tests read ($K3_TESTDATA, which ctest sets; by
 * hand, the folder this build was configured from). */
static inline const char *k3_test_data(void) {
    const char *s = getenv("K3_TESTDATA");
#ifdef K3_TESTDATA_DEFAULT
    return s ? s : K3_TESTDATA_DEFAULT;
#else
    return s ? s : "tests/data";
#endif
}

#endif /* K3_TEST_H */
