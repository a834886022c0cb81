/* test_guard_stats.c — the guard backend's counters (k3_op_stats, what `--op-stats` reads): each
 * op call counts one under its op and nothing else; upload / upload_async add h2d bytes;
 * download adds d2h bytes and one host sync, download_async the bytes but no sync (its
 * event_sync is the sync); synchronize and event_sync count one sync each; reading the counters
 * counts nothing. The async copies and events work (immediately). The ref and cpu backends keep
 * no counters (K3_ERR_ARG naming the backend), which `--op-stats` relies on to refuse them. */
#include "k3_kernels.h"
#include "k3_test.h"

static k3_op_stats diff(const k3_op_stats *a, const k3_op_stats *b) {
    k3_op_stats d;
    for (int i = 0; i < K3_OP_COUNT; i++) d.calls[i] = b->calls[i] - a->calls[i];
    d.host_syncs = b->host_syncs - a->host_syncs;
    d.h2d_bytes = b->h2d_bytes - a->h2d_bytes;
    d.d2h_bytes = b->d2h_bytes - a->d2h_bytes;
    return d;
}

static uint64_t total_calls(const k3_op_stats *s) {
    uint64_t n = 0;
    for (int i = 0; i < K3_OP_COUNT; i++) n += s->calls[i];
    return n;
}

int main(void) {
    k3_backend *be = NULL;
    k3_backend_params bp = {.n_threads = 2, .guard_reserve = (size_t)64 << 20};
    K3_CHECK_OK(k3_backend_create("guard", &bp, &be));
    if (!be) return k3_test_done("guard_stats");
    enum { N = 1000 };
    float host[N], back[N];
    for (int i = 0; i < N; i++) host[i] = (float)(i % 17) - 8.0f;
    float *a = NULL, *b = NULL, *y = NULL;
    K3_CHECK_OK(k3_backend_alloc(be, N * sizeof(float), "a", (void **)&a));
    K3_CHECK_OK(k3_backend_alloc(be, N * sizeof(float), "b", (void **)&b));
    K3_CHECK_OK(k3_backend_alloc(be, N * sizeof(float), "y", (void **)&y));

    k3_op_stats s0, s1, s2, s3;
    K3_CHECK_OK(k3_backend_op_stats(be, &s0));
    K3_CHECK_OK(k3_backend_op_stats(be, &s1)); /* a read counts nothing */
    k3_op_stats d = diff(&s0, &s1);
    K3_CHECK(total_calls(&d) == 0 && d.host_syncs == 0 && d.h2d_bytes == 0 && d.d2h_bytes == 0,
             "reading the counters changed them");

    /* transfers */
    K3_CHECK_OK(k3_backend_upload(be, a, host, N * sizeof(float)));
    K3_CHECK_OK(k3_backend_upload_async(be, b, host, 100 * sizeof(float)));
    K3_CHECK_OK(k3_backend_download(be, back, a, N * sizeof(float)));
    K3_CHECK_OK(k3_backend_sync(be));
    K3_CHECK_OK(k3_backend_op_stats(be, &s2));
    d = diff(&s1, &s2);
    K3_CHECK(d.h2d_bytes == (N + 100) * sizeof(float), "h2d %llu", (unsigned long long)d.h2d_bytes);
    K3_CHECK(d.d2h_bytes == N * sizeof(float), "d2h %llu", (unsigned long long)d.d2h_bytes);
    K3_CHECK(d.host_syncs == 2, "download + synchronize gave %llu syncs",
             (unsigned long long)d.host_syncs);
    K3_CHECK(total_calls(&d) == 0, "transfers counted %llu op calls",
             (unsigned long long)total_calls(&d));
    K3_CHECK(memcmp(back, host, sizeof host) == 0, "download returned other bytes");

    /* ops: each call one count under its own op */
    K3_CHECK_OK(be->ops->add(be, a, b, 100, y));
    K3_CHECK_OK(be->ops->add(be, a, a, N, y));
    K3_CHECK_OK(be->ops->fill(be, y, N, 1.5f));
    K3_CHECK_OK(be->ops->silu(be, a, N, y));
    K3_CHECK_OK(k3_backend_op_stats(be, &s3));
    d = diff(&s2, &s3);
    K3_CHECK(d.calls[K3_OP_add] == 2 && d.calls[K3_OP_fill] == 1 && d.calls[K3_OP_silu] == 1,
             "add %llu fill %llu silu %llu", (unsigned long long)d.calls[K3_OP_add],
             (unsigned long long)d.calls[K3_OP_fill], (unsigned long long)d.calls[K3_OP_silu]);
    K3_CHECK(total_calls(&d) == 4, "4 op calls counted as %llu",
             (unsigned long long)total_calls(&d));
    K3_CHECK(d.host_syncs == 0 && d.h2d_bytes == 0 && d.d2h_bytes == 0,
             "ops counted transfers or syncs");

    /* async download + event: the bytes at the copy, the sync at event_sync */
    k3_backend_event *ev = NULL;
    K3_CHECK_OK(k3_backend_event_create(be, &ev));
    K3_CHECK(ev != NULL, "the guard backend has events");
    memset(back, 0, sizeof back);
    k3_op_stats s4, s5;
    K3_CHECK_OK(k3_backend_op_stats(be, &s4));
    K3_CHECK_OK(k3_backend_download_async(be, back, a, N * sizeof(float)));
    K3_CHECK_OK(k3_backend_event_record(be, ev));
    K3_CHECK_OK(k3_backend_op_stats(be, &s5));
    d = diff(&s4, &s5);
    K3_CHECK(d.d2h_bytes == N * sizeof(float) && d.host_syncs == 0,
             "download_async: d2h %llu, syncs %llu (want %zu, 0)", (unsigned long long)d.d2h_bytes,
             (unsigned long long)d.host_syncs, N * sizeof(float));
    K3_CHECK_OK(k3_backend_event_sync(be, ev));
    K3_CHECK_OK(k3_backend_op_stats(be, &s4));
    d = diff(&s5, &s4);
    K3_CHECK(d.host_syncs == 1, "event_sync counted %llu syncs", (unsigned long long)d.host_syncs);
    K3_CHECK(memcmp(back, host, sizeof host) == 0, "download_async returned other bytes");
    k3_backend_event_destroy(be, ev);
    k3_backend_event_destroy(be, NULL); /* NULL-safe */
    k3_backend_destroy(be);

    /* the host backends keep no counters */
    const char *const host_names[] = {"ref", "cpu"};
    for (int i = 0; i < 2; i++) {
        k3_backend *hb = NULL;
        K3_CHECK_OK(k3_backend_create(host_names[i], &bp, &hb));
        if (!hb) continue;
        k3_op_stats s;
        K3_CHECK_ERR(k3_backend_op_stats(hb, &s), K3_ERR_ARG, host_names[i]);
        k3_backend_destroy(hb);
    }
    return k3_test_done("guard_stats");
}
