/* test_cuda_step_graph.c — a captured step of the cuda backend (issue 45; label gpuemu in the
 * emulation build, gpu on a device): k3_backend_capture_begin / capture_end / graph_launch.
 * - a step of ops (rmsnorm, silu, add, softmax over [T, D]) captured once runs nothing while it is
 *   captured, and each replay gives the bytes the same ops give run directly, reading the inputs
 *   as they are at the launch; op_stats counts the graph launches;
 * - the test hook: the same step with a host sync injected in the middle (a download, as a
 *   per-layer error-word read would be) fails inside the capture with K3_ERR_DEVICE, the capture
 *   end fails too (no graph), the emulator prints a k3emu: line naming the call, and the backend
 *   works as before afterwards.
 * Without a device (a device build) it prints one SKIP line and exits 77. */
#include "k3_gpu_test.h"
#include "k3_kernels.h"
#include "k3_test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { T = 3, D = 200 };

typedef struct bufs {
    float *x, *w, *h, *g, *y; /* [T, D] each (w [D]) */
} bufs;

/* the step: y = softmax(silu(rmsnorm(x, w)) + x); inject: a download of h in the middle */
static k3_status step(k3_backend *be, const bufs *b, bool inject) {
    K3_TRY(be->ops->rmsnorm(be, b->x, b->w, T, D, 1e-6f, b->h));
    if (inject) {
        float probe[D];
        K3_TRY(k3_backend_download(be, probe, b->h, sizeof probe));
    }
    K3_TRY(be->ops->silu(be, b->h, (int64_t)T * D, b->g));
    K3_TRY(be->ops->add(be, b->g, b->x, (int64_t)T * D, b->h));
    K3_TRY(be->ops->softmax(be, b->h, T, D, b->y));
    return K3_OK;
}

static void inputs(float *x, unsigned seed) {
    unsigned s = seed;
    for (int i = 0; i < T * D; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = (float)((int)(s >> 9) % 2001 - 1000) / 250.0f;
    }
}

/* what f prints on stderr (echoed, marked as expected) */
static void stderr_of(k3_status (*f)(k3_backend *, const bufs *, bool), k3_backend *be,
                      const bufs *b, k3_status *st, char *out, size_t cap) {
    fflush(stderr);
    FILE *tmp = tmpfile();
    const int saved = dup(2);
    out[0] = '\0';
    if (!tmp || saved < 0) {
        K3_CHECK(false, "cannot capture stderr");
        *st = f(be, b, true);
        if (tmp) fclose(tmp);
        if (saved >= 0) close(saved);
        return;
    }
    dup2(fileno(tmp), 2);
    *st = f(be, b, true);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    rewind(tmp);
    size_t n = fread(out, 1, cap - 1, tmp);
    out[n] = '\0';
    fclose(tmp);
    if (n) fprintf(stderr, "  (expected) %s", out);
}

int main(void) {
    if (k3_gpu_skip()) return 77;
    k3_backend *be = NULL;
    K3_CHECK_OK(k3_backend_create("cuda", NULL, &be));
    if (!be) return k3_test_done("cuda_step_graph");
    K3_CHECK(k3_backend_has_graphs(be), "the cuda backend captures graphs");
    bufs b;
    float **all[] = {&b.x, &b.w, &b.h, &b.g, &b.y};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        K3_CHECK_OK(k3_backend_alloc(be, (size_t)T * D * sizeof(float), "step buffer", (void **)all[i]));
    static float x1[T * D], x2[T * D], w[D], want1[T * D], want2[T * D], got[T * D], nan_[T * D];
    inputs(x1, 1), inputs(x2, 2);
    for (int i = 0; i < D; i++) w[i] = 0.5f + (float)i / D;
    for (int i = 0; i < T * D; i++) nan_[i] = NAN;
    K3_CHECK_OK(k3_backend_upload(be, b.w, w, sizeof w));
    /* direct runs: the reference bytes */
    K3_CHECK_OK(k3_backend_upload(be, b.x, x1, sizeof x1));
    K3_CHECK_OK(step(be, &b, false));
    K3_CHECK_OK(k3_backend_download(be, want1, b.y, sizeof want1));
    K3_CHECK_OK(k3_backend_upload(be, b.x, x2, sizeof x2));
    K3_CHECK_OK(step(be, &b, false));
    K3_CHECK_OK(k3_backend_download(be, want2, b.y, sizeof want2));
    K3_CHECK(memcmp(want1, want2, sizeof want1) != 0, "two inputs, two outputs");

    /* capture once, replay per input */
    K3_CHECK_OK(k3_backend_upload(be, b.y, nan_, sizeof nan_));
    k3_op_stats s0, s1;
    K3_CHECK_OK(k3_backend_op_stats(be, &s0));
    k3_backend_graph *g = NULL;
    K3_CHECK_OK(k3_backend_capture_begin(be));
    K3_CHECK_OK(step(be, &b, false));
    K3_CHECK_OK(k3_backend_capture_end(be, &g));
    K3_CHECK(g != NULL, "a graph");
    K3_CHECK_OK(k3_backend_download(be, got, b.y, sizeof got));
    K3_CHECK(isnan(got[0]) && isnan(got[T * D - 1]), "nothing ran during the capture");
    const float *in[2] = {x1, x2}, *want[2] = {want1, want2};
    for (int rep = 0; rep < 4; rep++) {
        K3_CHECK_OK(k3_backend_upload(be, b.x, in[rep % 2], sizeof x1));
        K3_CHECK_OK(k3_backend_upload(be, b.y, nan_, sizeof nan_));
        K3_CHECK_OK(k3_backend_graph_launch(be, g));
        K3_CHECK_OK(k3_backend_download(be, got, b.y, sizeof got));
        K3_CHECK(memcmp(got, want[rep % 2], sizeof got) == 0,
                 "replay %d: the bytes of the direct run (got[0] %g want %g)", rep,
                 (double)got[0], (double)want[rep % 2][0]);
    }
    K3_CHECK_OK(k3_backend_op_stats(be, &s1));
    K3_CHECK(s1.graph_launches - s0.graph_launches == 4, "graph launches counted: %llu",
             (unsigned long long)(s1.graph_launches - s0.graph_launches));
    k3_backend_graph_destroy(be, g);

    /* the test hook: a host sync inside the captured step */
    K3_CHECK_OK(k3_backend_capture_begin(be));
    k3_status st = K3_OK;
    char err[2048];
    stderr_of(step, be, &b, &st, err, sizeof err);
    K3_CHECK(st == K3_ERR_DEVICE, "a host sync in a captured step fails: %s (%s)",
             k3_status_name(st), k3_last_error());
#ifdef K3_CUDA_EMULATE
    K3_CHECK(strstr(err, "k3emu: cudaStreamSynchronize during the capture") != NULL,
             "the emulator names the sync in a k3emu: line: [%s]", err);
#endif
    g = (k3_backend_graph *)&b; /* must be reset */
    K3_CHECK_ERR(k3_backend_capture_end(be, &g), K3_ERR_DEVICE, "not capturable");
    K3_CHECK(g == NULL, "no graph from a failed capture");
    /* the backend works as before */
    K3_CHECK_OK(k3_backend_upload(be, b.x, x1, sizeof x1));
    K3_CHECK_OK(step(be, &b, false));
    K3_CHECK_OK(k3_backend_download(be, got, b.y, sizeof got));
    K3_CHECK(memcmp(got, want1, sizeof got) == 0, "direct run after the failed capture");

    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) k3_backend_free(be, *all[i]);
    k3_backend_destroy(be);
    return k3_test_done("cuda_step_graph");
}
