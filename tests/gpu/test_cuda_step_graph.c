/* test_cuda_step_graph.c — a captured step of the cuda backend (issue 45; label gpuemu in the
 * emulation build, gpu on a device): k3_backend_capture_begin / capture_end / graph_launch.
 * - a step of ops (rmsnorm, silu, add, softmax over [T, D]) captured once runs nothing while it is
 *   captured, and each replay gives the bytes the same ops give run directly, reading the inputs
 *   as they are at the launch; op_stats counts the graph launches;
 * - the test hook: the same step with a host sync injected in the middle (a download, as a
 *   per-layer error-word read would be) fails inside the capture with K3_ERR_DEVICE, the capture
 *   end fails too (no graph), the emulator prints a k3emu: line naming the call, and the backend
 *   works as before afterwards.
 * - deferred checks (k3_backend_errors_defer / fetch / verdict): embed_rows with a bad id and
 *   moe_topk return at once and make no host sync; after fetch and one download the verdict
 *   names the bad position (no sync of its own); without a sync after the fetch the verdict makes
 *   one; with checks deferred the router captures, without them its error-word read fails the
 *   capture.
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

/* the router over [Tq, E] scores (ids, weights out) */
enum { Tq = 5, E = 16, K = 4 };
static k3_status router(k3_backend *be, const float *sc, float *work, int32_t *ids, float *w) {
    return be->ops->moe_topk(be, sc, NULL, Tq, E, K, 4, 2, true, 1.0f, work, ids, w);
}

static void test_deferred(k3_backend *be) {
    const int64_t V = 50, Dm = 8;
    static float emb[50 * 8];
    for (int i = 0; i < V * Dm; i++) emb[i] = (float)i;
    float *demb = NULL, *dout = NULL, *sc = NULL, *work = NULL, *wt = NULL;
    int32_t *dids = NULL, *rids = NULL;
    K3_CHECK_OK(k3_backend_alloc(be, sizeof emb, "table", (void **)&demb));
    K3_CHECK_OK(k3_backend_alloc(be, 4 * Dm * sizeof(float), "rows", (void **)&dout));
    K3_CHECK_OK(k3_backend_alloc(be, 4 * sizeof(int32_t), "ids", (void **)&dids));
    K3_CHECK_OK(k3_backend_alloc(be, Tq * E * sizeof(float), "scores", (void **)&sc));
    K3_CHECK_OK(k3_backend_alloc(be, Tq * E * sizeof(float), "work", (void **)&work));
    K3_CHECK_OK(k3_backend_alloc(be, Tq * K * sizeof(float), "weights", (void **)&wt));
    K3_CHECK_OK(k3_backend_alloc(be, Tq * K * sizeof(int32_t), "expert ids", (void **)&rids));
    K3_CHECK_OK(k3_backend_upload(be, demb, emb, sizeof emb));
    const int32_t bad[4] = {1, 2, 77, 3};
    K3_CHECK_OK(k3_backend_upload(be, dids, bad, sizeof bad));
    float scores[Tq * E];
    for (int i = 0; i < Tq * E; i++) scores[i] = (float)((i * 7) % 13) / 13.0f;
    K3_CHECK_OK(k3_backend_upload(be, sc, scores, sizeof scores));
    k3_tensor W = {.dtype = K3_DT_F32, .ndim = 2, .shape = {V, Dm}, .data = demb};
    /* immediate (the default): the error at once */
    K3_CHECK_ERR(be->ops->embed_rows(be, &W, dids, 4, dout), K3_ERR_ARG, "position 2");
    /* deferred: no error and no host sync until the verdict */
    k3_op_stats a, b2, c2;
    K3_CHECK_OK(k3_backend_errors_defer(be, true));
    K3_CHECK_OK(k3_backend_op_stats(be, &a));
    K3_CHECK_OK(be->ops->embed_rows(be, &W, dids, 4, dout));
    K3_CHECK_OK(router(be, sc, work, rids, wt));
    K3_CHECK_OK(k3_backend_errors_fetch(be));
    K3_CHECK_OK(k3_backend_op_stats(be, &b2));
    K3_CHECK(b2.host_syncs == a.host_syncs, "deferred checks made %llu host syncs",
             (unsigned long long)(b2.host_syncs - a.host_syncs));
    float row[8];
    K3_CHECK_OK(k3_backend_download(be, row, dout, sizeof row)); /* the step's one read */
    K3_CHECK_ERR(k3_backend_errors_verdict(be), K3_ERR_ARG, "position 2");
    K3_CHECK_OK(k3_backend_op_stats(be, &c2));
    K3_CHECK(c2.host_syncs - b2.host_syncs == 1, "the verdict after a read adds no sync (%llu)",
             (unsigned long long)(c2.host_syncs - b2.host_syncs));
    /* a clean step: verdict OK; no read after the fetch: the verdict syncs itself */
    const int32_t good[4] = {1, 2, 3, 4};
    K3_CHECK_OK(k3_backend_upload(be, dids, good, sizeof good));
    K3_CHECK_OK(k3_backend_errors_defer(be, true));
    K3_CHECK_OK(be->ops->embed_rows(be, &W, dids, 4, dout));
    K3_CHECK_OK(k3_backend_errors_fetch(be));
    K3_CHECK_OK(k3_backend_op_stats(be, &a));
    K3_CHECK_OK(k3_backend_errors_verdict(be));
    K3_CHECK_OK(k3_backend_op_stats(be, &b2));
    K3_CHECK(b2.host_syncs - a.host_syncs == 1, "a verdict with no read since the fetch syncs");
    K3_CHECK_OK(k3_backend_upload(be, dids, bad, sizeof bad));
    K3_CHECK_OK(k3_backend_errors_defer(be, true));
    K3_CHECK_OK(be->ops->embed_rows(be, &W, dids, 4, dout));
    K3_CHECK_OK(k3_backend_errors_fetch(be));
    K3_CHECK_ERR(k3_backend_errors_verdict(be), K3_ERR_ARG, "deferred check");
    /* the router in a capture: deferred it records, immediate its read fails the capture */
    k3_backend_graph *g = NULL;
    K3_CHECK_OK(k3_backend_errors_defer(be, true));
    K3_CHECK_OK(k3_backend_capture_begin(be));
    K3_CHECK_OK(router(be, sc, work, rids, wt));
    K3_CHECK_OK(k3_backend_capture_end(be, &g));
    K3_CHECK_OK(k3_backend_graph_launch(be, g));
    K3_CHECK_OK(k3_backend_errors_fetch(be));
    K3_CHECK_OK(k3_backend_errors_verdict(be));
    k3_backend_graph_destroy(be, g);
    K3_CHECK_OK(k3_backend_errors_defer(be, false));
    K3_CHECK_OK(k3_backend_capture_begin(be));
    fflush(stderr);
    fprintf(stderr, "  (expected: a k3emu line, the router's read in a capture)\n");
    K3_CHECK(router(be, sc, work, rids, wt) == K3_ERR_DEVICE, "an immediate check in a capture");
    K3_CHECK(k3_backend_capture_end(be, &g) == K3_ERR_DEVICE && !g, "no graph");
    void *all[] = {demb, dout, dids, sc, work, wt, rids};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) k3_backend_free(be, all[i]);
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
        K3_CHECK_OK(
            k3_backend_alloc(be, (size_t)T * D * sizeof(float), "step buffer", (void **)all[i]));
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
                 "replay %d: the bytes of the direct run (got[0] %g want %g)", rep, (double)got[0],
                 (double)want[rep % 2][0]);
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
    test_deferred(be);
    k3_backend_destroy(be);
    return k3_test_done("cuda_step_graph");
}
