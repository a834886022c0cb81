// test_cuda_graph.cu — CUDA graphs in k3's emulation (issue 45; label gpuemu): stream capture
// records, a graph launch replays (kernels with their by-value arguments of the capture, async
// copies and memsets reading their pointers at launch, event records, the emulation's host work
// nodes that the NCCL stand-in uses), and every call CUDA forbids inside a capture fails with a
// k3emu line naming it and invalidates the capture (EndCapture: cudaErrorStreamCaptureInvalidated,
// no graph), while the work captured before it never ran. Relaxed and thread-local modes, the
// legacy stream, a wait on an outside event and a launch into a capturing stream are checked too.
// Emulation only (the k3emu lines and k3emu_stream_host_work are the emulator's).
#include "cuda_math.cuh"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <unistd.h>
#include <vector>

static int g_pass, g_fail;
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (cond) {                                                                                \
            g_pass++;                                                                              \
        } else {                                                                                   \
            g_fail++;                                                                              \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
        }                                                                                          \
    } while (0)
#define CUDA_OK(expr)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (expr);                                                                   \
        CHECK(e_ == cudaSuccess, "%s -> %s", #expr, cudaGetErrorName(e_));                         \
    } while (0)

/* runs f with stderr captured; returns what it printed (echoed, marked as expected) */
#include "k3emu_stderr.h"

template <class F> static std::string captured_stderr(F f) {
    bool ok;
    std::string s = k3emu_captured_stderr(f, &ok);
    CHECK(ok, "cannot capture stderr");
    return s;
}

/* y[i] = x[i] * a + b (a, b by value: the capture's copy) */
static __global__ void axpb_kernel(float *y, const float *x, float a, float b, int n) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) y[i] = x[i] * a + b;
}

enum { N = 300 };

/* ---- 1. record and replay ---------------------------------------------------------------------
 */
static int g_host_runs, g_host_drops;
static void host_fn(void *p) {
    g_host_runs += *(int *)p;
}
static void host_drop(void *p) {
    g_host_drops++;
    free(p);
}

static void test_replay(void) {
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    float *x = nullptr, *y = nullptr;
    CUDA_OK(cudaMalloc((void **)&x, N * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&y, N * sizeof(float)));
    std::vector<float> xh(N), out(N, NAN), yh(N);
    for (int i = 0; i < N; i++) xh[i] = (float)i;
    CUDA_OK(cudaMemset(y, 0xff, N * sizeof(float)));
    cudaEvent_t ev;
    CUDA_OK(cudaEventCreate(&ev));
    const unsigned long long launches0 = k3emu_graph_launches();

    float a = 2.0f, b = 0.5f;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    CUDA_OK(cudaStreamIsCapturing(s, &cs));
    CHECK(cs == cudaStreamCaptureStatusActive, "capture status %d", (int)cs);
    CUDA_OK(cudaMemsetAsync(y, 0, N * sizeof(float), s));
    CUDA_OK(cudaMemcpyAsync(x, xh.data(), N * sizeof(float), cudaMemcpyHostToDevice, s));
    K3C_LAUNCH(dim3((N + 127) / 128), dim3(128), 0, s, axpb_kernel)(y, x, a, b, N);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpyAsync(out.data(), y, N * sizeof(float), cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaEventRecord(ev, s));
    CUDA_OK(cudaStreamWaitEvent(s, ev, 0)); /* recorded in the capture: allowed */
    int *one = (int *)malloc(sizeof(int));
    *one = 1;
    CUDA_OK(k3emu_stream_host_work(s, host_fn, one, host_drop));
    cudaGraph_t g = nullptr;
    CUDA_OK(cudaStreamEndCapture(s, &g));
    CHECK(g != nullptr, "a graph");
    CUDA_OK(cudaStreamIsCapturing(s, &cs));
    CHECK(cs == cudaStreamCaptureStatusNone, "capture over: status %d", (int)cs);
    /* nothing ran during the capture */
    CUDA_OK(cudaMemcpy(yh.data(), y, N * sizeof(float), cudaMemcpyDeviceToHost));
    bool untouched = isnan(out[0]) && g_host_runs == 0;
    for (int i = 0; i < N; i++) untouched = untouched && isnan(yh[i]);
    CHECK(untouched, "the captured work ran during the capture (y[0] %g, out[0] %g, host %d)",
          (double)yh[0], (double)out[0], g_host_runs);

    cudaGraphExec_t ge = nullptr;
    CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
    CUDA_OK(cudaGraphDestroy(g)); /* the exec keeps its nodes */
    a = 100.0f, b = 100.0f;       /* by-value arguments are the capture's */
    for (int rep = 0; rep < 2; rep++) {
        for (int i = 0; i < N; i++) xh[i] = (float)(i * (rep + 1)); /* pointers read at launch */
        for (int i = 0; i < N; i++) out[i] = NAN;
        CUDA_OK(cudaGraphLaunch(ge, s));
        CUDA_OK(cudaStreamSynchronize(s));
        int bad = -1;
        for (int i = 0; i < N && bad < 0; i++)
            if (out[i] != (float)(i * (rep + 1)) * 2.0f + 0.5f) bad = i;
        CHECK(bad < 0, "replay %d: out[%d] = %g", rep, bad, bad < 0 ? 0.0 : (double)out[bad]);
        CHECK(g_host_runs == rep + 1, "host work ran %d times after %d launches", g_host_runs,
              rep + 1);
    }
    CHECK(k3emu_graph_launches() - launches0 == 2, "graph launches %llu",
          k3emu_graph_launches() - launches0);
    CHECK(g_host_drops == 0, "host work dropped while its exec lives");
    CUDA_OK(cudaGraphExecDestroy(ge));
    CHECK(g_host_drops == 1, "host work dropped %d times with the last holder", g_host_drops);
    /* outside a capture, host work runs now and is dropped */
    int *two = (int *)malloc(sizeof(int));
    *two = 2;
    CUDA_OK(k3emu_stream_host_work(s, host_fn, two, host_drop));
    CHECK(g_host_runs == 4 && g_host_drops == 2, "direct host work: runs %d drops %d", g_host_runs,
          g_host_drops);
    CUDA_OK(cudaEventDestroy(ev));
    CUDA_OK(cudaFree(x));
    CUDA_OK(cudaFree(y));
    CUDA_OK(cudaStreamDestroy(s));
}

/* ---- 2. what a capture forbids ----------------------------------------------------------------
 */
enum forbidden {
    F_MEMCPY,
    F_MEMCPY2D,
    F_MEMSET,
    F_STREAM_SYNC,
    F_DEVICE_SYNC,
    F_EVENT_SYNC,
    F_STREAM_QUERY,
    F_EVENT_QUERY,
    F_MALLOC,
    F_FREE,
    F_MALLOC_HOST,
    F_WAIT_OUTSIDE_EVENT,
    F_COUNT
};
static const char *const k_api[F_COUNT] = {"cudaMemcpy (synchronous)",
                                           "cudaMemcpy2D (synchronous)",
                                           "cudaMemset (synchronous)",
                                           "cudaStreamSynchronize",
                                           "cudaDeviceSynchronize",
                                           "cudaEventSynchronize",
                                           "cudaStreamQuery",
                                           "cudaEventQuery",
                                           "cudaMalloc",
                                           "cudaFree",
                                           "cudaMallocHost",
                                           "cudaStreamWaitEvent"};

static cudaError_t call(int f, cudaStream_t s, float *dev, float *host, cudaEvent_t ev,
                        void *spare) {
    void *fresh = nullptr;
    switch (f) {
    case F_MEMCPY:
        return cudaMemcpy(host, dev, sizeof(float), cudaMemcpyDeviceToHost);
    case F_MEMCPY2D:
        return cudaMemcpy2D(host, 4, dev, 4, 4, 1, cudaMemcpyDeviceToHost);
    case F_MEMSET:
        return cudaMemset(dev, 0, 4);
    case F_STREAM_SYNC:
        return cudaStreamSynchronize(s);
    case F_DEVICE_SYNC:
        return cudaDeviceSynchronize();
    case F_EVENT_SYNC:
        return cudaEventSynchronize(ev);
    case F_STREAM_QUERY:
        return cudaStreamQuery(s);
    case F_EVENT_QUERY:
        return cudaEventQuery(ev);
    case F_MALLOC:
        return cudaMalloc(&fresh, 64);
    case F_FREE:
        return cudaFree(spare);
    case F_MALLOC_HOST:
        return cudaMallocHost(&fresh, 64);
    default:
        return cudaStreamWaitEvent(s, ev, 0); /* ev was recorded before the capture */
    }
}

static void test_forbidden(void) {
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    float *dev = nullptr, host[4] = {0, 0, 0, 0};
    CUDA_OK(cudaMalloc((void **)&dev, N * sizeof(float)));
    void *spare = nullptr;
    CUDA_OK(cudaMalloc(&spare, 64));
    cudaEvent_t ev;
    CUDA_OK(cudaEventCreate(&ev));
    CUDA_OK(cudaEventRecord(ev, s));
    for (int f = 0; f < F_COUNT; f++) {
        CUDA_OK(cudaMemset(dev, 0, N * sizeof(float)));
        CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        K3C_LAUNCH(dim3((N + 127) / 128), dim3(128), 0, s, axpb_kernel)(dev, dev, 1.0f, 7.0f, N);
        cudaError_t e = cudaSuccess;
        const std::string err = captured_stderr([&] { e = call(f, s, dev, host, ev, spare); });
        CHECK(e == cudaErrorStreamCaptureUnsupported, "%s in a capture -> %s", k_api[f],
              cudaGetErrorName(e));
        CHECK(err.find("k3emu: ") != std::string::npos && err.find(k_api[f]) != std::string::npos &&
                  err.find("stream capture") != std::string::npos,
              "%s: the k3emu line names it: [%s]", k_api[f], err.c_str());
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        CUDA_OK(cudaStreamIsCapturing(s, &cs));
        CHECK(cs == cudaStreamCaptureStatusInvalidated, "%s: status %d", k_api[f], (int)cs);
        e = cudaMemsetAsync(dev, 0, 4, s);
        CHECK(e == cudaErrorStreamCaptureInvalidated, "%s: a later enqueue -> %s", k_api[f],
              cudaGetErrorName(e));
        cudaGraph_t g = (cudaGraph_t)1;
        e = cudaStreamEndCapture(s, &g);
        CHECK(e == cudaErrorStreamCaptureInvalidated && g == nullptr, "%s: end capture -> %s",
              k_api[f], cudaGetErrorName(e));
        (void)cudaGetLastError();
        CUDA_OK(cudaMemcpy(host, dev, sizeof(float), cudaMemcpyDeviceToHost));
        CHECK(host[0] == 0.0f, "%s: the captured kernel ran (%g)", k_api[f], (double)host[0]);
    }
    /* relaxed: unsafe calls from anywhere are fine, a sync of the capturing stream is not */
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
    void *p = nullptr;
    CUDA_OK(cudaMalloc(&p, 64));
    CUDA_OK(cudaFree(p));
    cudaError_t e = cudaSuccess;
    const std::string err = captured_stderr([&] { e = cudaStreamSynchronize(s); });
    CHECK(e == cudaErrorStreamCaptureUnsupported && err.find("k3emu: cudaStreamSynchronize") == 0,
          "relaxed: sync of the capturing stream -> %s [%s]", cudaGetErrorName(e), err.c_str());
    cudaGraph_t g = nullptr;
    CHECK(cudaStreamEndCapture(s, &g) == cudaErrorStreamCaptureInvalidated, "relaxed: end");
    (void)cudaGetLastError();
    /* thread-local: another thread's cudaMalloc is fine */
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    pthread_t th;
    static cudaError_t th_e;
    pthread_create(
        &th, nullptr,
        [](void *) -> void * {
            void *q = nullptr;
            th_e = cudaMalloc(&q, 64);
            cudaFree(q);
            return nullptr;
        },
        nullptr);
    pthread_join(th, nullptr);
    CHECK(th_e == cudaSuccess, "thread-local: another thread's cudaMalloc -> %s",
          cudaGetErrorName(th_e));
    CUDA_OK(cudaStreamEndCapture(s, &g));
    CUDA_OK(cudaGraphDestroy(g));
    /* the legacy stream, a capture twice, an end without a capture, a launch into a capture */
    std::string m =
        captured_stderr([&] { e = cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeGlobal); });
    CHECK(e == cudaErrorStreamCaptureUnsupported && m.find("k3emu: ") == 0, "legacy stream: %s",
          cudaGetErrorName(e));
    m = captured_stderr([&] { e = cudaStreamEndCapture(s, &g); });
    CHECK(e == cudaErrorIllegalState && m.find("k3emu: ") == 0, "end without capture: %s",
          cudaGetErrorName(e));
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    m = captured_stderr([&] { e = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal); });
    CHECK(e == cudaErrorIllegalState, "capture twice: %s", cudaGetErrorName(e));
    CUDA_OK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t ge = nullptr;
    CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    m = captured_stderr([&] { e = cudaGraphLaunch(ge, s); });
    CHECK(e == cudaErrorStreamCaptureUnsupported && m.find("k3emu: ") == 0,
          "launch into a capture: %s", cudaGetErrorName(e));
    cudaGraph_t g2 = nullptr;
    CUDA_OK(cudaStreamEndCapture(s, &g2));
    CUDA_OK(cudaGraphDestroy(g2));
    CUDA_OK(cudaGraphExecDestroy(ge));
    CUDA_OK(cudaGraphDestroy(g));
    (void)cudaGetLastError();
    CUDA_OK(cudaEventDestroy(ev));
    CUDA_OK(cudaFree(spare));
    CUDA_OK(cudaFree(dev));
    CUDA_OK(cudaStreamDestroy(s));
}

int main(void) {
    test_replay();
    test_forbidden();
    printf("cuda_graph: %d checks passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
