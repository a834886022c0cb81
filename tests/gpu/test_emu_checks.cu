// test_emu_checks.cu — two checks of the CUDA emulation that a first device run would otherwise
// meet (issue 44, Deliver 4), each seen failing on an injected bug (label gpuemu):
//   - device memory in its own address range (kernels/cuda/emu/emu_devmem.cpp): a host
//     dereference of a device pointer (a cudaMalloc, a cuda backend buffer, a freed one) aborts
//     with a `k3emu:` line naming the allocation (its size, where it was allocated), in a child
//     process; the same memory through cudaMemcpy and kernels works.
//   - streams that really are asynchronous (emu_streams.cpp): kernels run on another thread, in
//     stream order; queries say not ready while work waits; events order streams; a host read of
//     an async download before its stream or event has synchronised reads the poison (0xff: NaN),
//     directly and through the cuda backend's download_async (the injected bug: a read before
//     event_sync); after the sync, the data.
// A stream is held with the test hook k3emu_stream_pause, so "before the sync" is deterministic.
#define _Noreturn [[noreturn]] /* k3_base.h / k3_kernels.h are C11 headers */
#define _Static_assert static_assert
extern "C" {
#include "k3_kernels.h"
#include "k3_test.h"
}
#include "cuda_math.cuh"

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <sys/wait.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
static const bool k_asan = true;
#else
static const bool k_asan = false;
#endif

/* ---- device memory in its own range -----------------------------------------------------------
 */

/* runs f in a child; its exit status and stderr */
template <class F> static int in_child(F f, std::string *err) {
    int pfd[2];
    if (pipe(pfd) != 0) return -1;
    fflush(stdout), fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
        dup2(pfd[1], 2);
        close(pfd[0]), close(pfd[1]);
        f();
        _exit(0);
    }
    close(pfd[1]);
    char buf[1024];
    ssize_t n;
    while ((n = read(pfd[0], buf, sizeof buf)) > 0) err->append(buf, (size_t)n);
    close(pfd[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    return st;
}

static bool aborted(int st) {
    return WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT;
}

static __global__ void fill_kernel(float *p, int n, float v) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) p[i] = v + (float)i;
}

static void test_device_range(void) {
    float *d = nullptr;
    K3_CHECK(cudaMalloc((void **)&d, 1000) == cudaSuccess, "cudaMalloc");
    /* device work and copies reach it */
    K3C_LAUNCH(dim3(1), dim3(256), 0, (cudaStream_t)0, fill_kernel)(d, 250, 1.0f);
    float h[250];
    K3_CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost) == cudaSuccess, "cudaMemcpy");
    K3_CHECK(h[0] == 1.0f && h[249] == 250.0f, "kernel + copy: %g %g", (double)h[0],
             (double)h[249]);
    /* the injected bug: the host reads a device pointer */
    std::string err;
    int st = in_child(
        [&] {
            volatile float v = d[3];
            (void)v;
        },
        &err);
    K3_CHECK(aborted(st), "a host read of device memory did not abort (status 0x%x)", st);
    K3_CHECK(err.find("k3emu: host access to device memory") != std::string::npos &&
                 err.find("byte 12 of a 1000-byte cudaMalloc") != std::string::npos &&
                 err.find("Allocated at:") != std::string::npos,
             "the k3emu: line does not name the allocation: [%s]", err.c_str());
    /* a host write, through the cuda backend's buffer (k3_backend_alloc) */
    k3_backend *cu = nullptr;
    K3_CHECK(k3_backend_create("cuda", NULL, &cu) == K3_OK, "cuda backend");
    void *b = nullptr;
    if (cu && k3_backend_alloc(cu, 4096, "test buffer", &b) == K3_OK) {
        err.clear();
        st = in_child([&] { memset(b, 0, 16); }, &err);
        K3_CHECK(aborted(st) && err.find("byte 0 of a 4096-byte cudaMalloc") != std::string::npos,
                 "a host memset of a backend buffer: status 0x%x, [%s]", st, err.c_str());
        /* the backend's own upload / download still work */
        float one = 3.5f, back = 0;
        K3_CHECK(k3_backend_upload(cu, b, &one, 4) == K3_OK &&
                     k3_backend_download(cu, &back, b, 4) == K3_OK && back == 3.5f,
                 "backend upload / download: %g", (double)back);
        k3_backend_free(cu, b);
    }
    if (cu) k3_backend_destroy(cu);
    /* past the end of an allocation, and after cudaFree */
    err.clear();
    st = in_child(
        [&] {
            volatile float v = d[251]; /* byte 1004: the gap after it */
            (void)v;
        },
        &err);
    /* under ASan the gap is poisoned: ASan's report comes first (as for a heap block) */
    K3_CHECK((aborted(st) && err.find("past its end") != std::string::npos) ||
                 (k_asan && err.find("use-after-poison") != std::string::npos),
             "a read past the end: status 0x%x, [%s]", st, err.c_str());
    K3_CHECK(cudaFree(d) == cudaSuccess, "cudaFree");
    err.clear();
    st = in_child(
        [&] {
            volatile float v = d[0];
            (void)v;
        },
        &err);
    K3_CHECK((aborted(st) && err.find("in no live cudaMalloc") != std::string::npos) ||
                 (k_asan && err.find("use-after-poison") != std::string::npos),
             "a read after cudaFree: status 0x%x, [%s]", st, err.c_str());
    /* a fault outside the range is still an ordinary crash (the previous handler), not ours */
    err.clear();
    st = in_child(
        [&] {
            volatile uintptr_t at = 16; /* the null page, hidden from the compiler */
            volatile int *z = (volatile int *)at;
            (void)*z;
        },
        &err);
    K3_CHECK(WIFSIGNALED(st) || (WIFEXITED(st) && WEXITSTATUS(st) != 0),
             "a null-page read did not crash (status 0x%x)", st);
    K3_CHECK(err.find("k3emu: host access") == std::string::npos,
             "a fault outside the device range was reported as ours: [%s]", err.c_str());
}

/* ---- streams -------------------------------------------------------------------------------- */

static __global__ void thread_kernel(unsigned long long *out) {
    if (threadIdx.x == 0) *out = (unsigned long long)pthread_self();
}
static __global__ void add_kernel(float *p, int n, float v) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) p[i] += v;
}

static __global__ void divergent_kernel(float *p) {
    if (threadIdx.x < 32) {
        __syncthreads(); /* half the block never comes: a launch failure */
        p[threadIdx.x] = 0.0f;
    }
}

static void test_streams(void) {
    enum { N = 512 };
    cudaStream_t s1 = nullptr, s2 = nullptr;
    cudaEvent_t e1 = nullptr, e2 = nullptr;
    K3_CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking) == cudaSuccess &&
                 cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking) == cudaSuccess &&
                 cudaEventCreate(&e1) == cudaSuccess && cudaEventCreate(&e2) == cudaSuccess,
             "streams and events");
    float *d = nullptr;
    unsigned long long *dt = nullptr;
    K3_CHECK(cudaMalloc((void **)&d, N * 4) == cudaSuccess &&
                 cudaMalloc((void **)&dt, 8) == cudaSuccess,
             "cudaMalloc");
    /* a kernel runs on another thread than the host's */
    K3C_LAUNCH(dim3(1), dim3(32), 0, s1, thread_kernel)(dt);
    unsigned long long tid = 0;
    K3_CHECK(cudaStreamSynchronize(s1) == cudaSuccess, "sync");
    cudaMemcpy(&tid, dt, 8, cudaMemcpyDeviceToHost);
    K3_CHECK(tid != 0 && tid != (unsigned long long)pthread_self(),
             "the kernel ran on the host's thread");
    /* held: the stream's work waits, the queries say so, a download's destination is poison */
    static float h[N];
    for (int i = 0; i < N; i++) h[i] = -7.0f;
    k3emu_stream_pause(s1, 1);
    K3C_LAUNCH(dim3(2), dim3(256), 0, s1, fill_kernel)(d, N, 1.0f);
    K3C_LAUNCH(dim3(2), dim3(256), 0, s1, add_kernel)(d, N, 0.5f); /* stream order: after fill */
    K3_CHECK(cudaMemcpyAsync(h, d, N * 4, cudaMemcpyDeviceToHost, s1) == cudaSuccess, "async D2H");
    K3_CHECK(cudaEventRecord(e1, s1) == cudaSuccess, "record");
    K3_CHECK(cudaStreamQuery(s1) == cudaErrorNotReady, "query of a held stream");
    K3_CHECK(cudaEventQuery(e1) == cudaErrorNotReady, "query of an event behind held work");
    /* the injected bug: the host reads the download before its event */
    int poisoned = 0;
    for (int i = 0; i < N; i++) poisoned += isnan(h[i]) != 0;
    K3_CHECK(poisoned == N, "an async download read before its event: %d of %d NaN", poisoned, N);
    /* s2 waits for e1 (recorded on s1) before its own work */
    static float h2[N];
    K3_CHECK(cudaStreamWaitEvent(s2, e1, 0) == cudaSuccess, "wait event");
    K3C_LAUNCH(dim3(2), dim3(256), 0, s2, add_kernel)(d, N, 100.0f);
    K3_CHECK(cudaMemcpyAsync(h2, d, N * 4, cudaMemcpyDeviceToHost, s2) == cudaSuccess, "D2H on s2");
    K3_CHECK(cudaEventRecord(e2, s2) == cudaSuccess, "record e2");
    K3_CHECK(cudaEventQuery(e2) == cudaErrorNotReady, "s2 ran past its wait on a held stream");
    k3emu_stream_pause(s1, 0);
    K3_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "event sync");
    int good = 0;
    for (int i = 0; i < N; i++) good += h[i] == 1.5f + (float)i;
    K3_CHECK(good == N, "after the event: %d of %d right (h[1] = %g)", good, N, (double)h[1]);
    K3_CHECK(cudaEventSynchronize(e2) == cudaSuccess, "event sync e2");
    good = 0;
    for (int i = 0; i < N; i++) good += h2[i] == 101.5f + (float)i;
    K3_CHECK(good == N, "s2 after its wait: %d of %d right (h2[1] = %g)", good, N, (double)h2[1]);
    float ms = -1;
    K3_CHECK(cudaEventElapsedTime(&ms, e1, e2) == cudaSuccess && ms >= 0, "elapsed %g ms",
             (double)ms);

    /* a kernel that breaks a rule is reported when it has run: at the next synchronisation */
    k3emu_stream_pause(s1, 1);
    K3C_LAUNCH(dim3(1), dim3(64), 0, s1, divergent_kernel)(d);
    K3_CHECK(cudaGetLastError() == cudaSuccess, "a held launch is an error already");
    k3emu_stream_pause(s1, 0);
    K3_CHECK(cudaStreamSynchronize(s1) == cudaErrorLaunchFailure,
             "a divergent barrier is not reported at the sync");
    K3_CHECK(cudaGetLastError() == cudaErrorLaunchFailure && cudaGetLastError() == cudaSuccess &&
                 cudaStreamSynchronize(s1) == cudaSuccess,
             "cudaGetLastError returns the error once and clears it");

    /* through the cuda backend: download_async then event_sync; the bug reads before it */
    k3_backend *cu = nullptr;
    K3_CHECK(k3_backend_create("cuda", NULL, &cu) == K3_OK, "cuda backend");
    void *b = nullptr;
    k3_backend_event *ev = nullptr;
    if (cu && k3_backend_alloc(cu, N * 4, "dl", &b) == K3_OK &&
        k3_backend_event_create(cu, &ev) == K3_OK && ev) {
        static float src[N], got[N];
        for (int i = 0; i < N; i++) src[i] = (float)i * 0.25f, got[i] = 0;
        K3_CHECK(k3_backend_upload(cu, b, src, sizeof src) == K3_OK, "upload");
        cudaStream_t bs = (cudaStream_t)k3_backend_native_stream(cu);
        k3emu_stream_pause(bs, 1);
        K3_CHECK(k3_backend_download_async(cu, got, b, sizeof got) == K3_OK &&
                     k3_backend_event_record(cu, ev) == K3_OK,
                 "download_async + record");
        int nan_before = 0;
        for (int i = 0; i < N; i++) nan_before += isnan(got[i]) != 0;
        K3_CHECK(nan_before == N, "backend download read before event_sync: %d of %d NaN",
                 nan_before, N);
        k3emu_stream_pause(bs, 0);
        K3_CHECK(k3_backend_event_sync(cu, ev) == K3_OK, "event_sync");
        K3_CHECK(memcmp(got, src, sizeof src) == 0, "the download after event_sync");
    }
    if (ev) k3_backend_event_destroy(cu, ev);
    if (b) k3_backend_free(cu, b);
    if (cu) k3_backend_destroy(cu);
    cudaFree(d), cudaFree(dt);
    cudaEventDestroy(e1), cudaEventDestroy(e2);
    cudaStreamDestroy(s1), cudaStreamDestroy(s2);
}

int main(void) {
    test_device_range();
    test_streams();
    return k3_test_done("emu_checks");
}
