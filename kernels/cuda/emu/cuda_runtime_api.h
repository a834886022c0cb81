/* cuda_runtime_api.h — k3's CUDA emulation (K3_CUDA_EMULATE builds only): the subset of the CUDA
 * runtime API that kernels/cuda and comm/comm_nccl.c use, with the real names, signatures and
 * error codes, implemented on the host by emu_runtime.cpp. This folder is first on the include
 * path of an emulation build, so it shadows the toolkit's header; C and C++ include it alike.
 *
 * The model: one emulated device per process (K3_EMU_DEVICES changes the count); device memory is
 * its own address range, unreadable by the host while no device work runs (emu_devmem.cpp: a
 * host dereference of a device pointer aborts with a k3emu: line naming the allocation); every
 * stream runs its operations (copies, memsets, kernel launches, events) in order on its own
 * worker thread, asynchronously to the host (emu_streams.cpp); a stream in capture
 * (cudaStreamBeginCapture, emu_graph.cpp) records them instead, and a graph launch replays them
 * as one operation of its stream. Errors: a bad launch
 * configuration is returned by the next cudaGetLastError; a kernel that breaks a CUDA rule, by
 * the next synchronisation (or cudaGetLastError after it ran). Kernels: cuda_runtime.h (C++
 * only) and k3emu_device.h. */
#ifndef K3_EMU_CUDA_RUNTIME_API_H
#define K3_EMU_CUDA_RUNTIME_API_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define K3_CUDA_EMULATION 1 /* this header is the emulation's, not the toolkit's */

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorLaunchFailure = 4, /* the emulation: a kernel broke a CUDA rule (see the message) */
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorIllegalState = 401,
    cudaErrorNotReady = 600,
    cudaErrorStreamCaptureUnsupported = 900, /* a call CUDA forbids while a capture is active */
    cudaErrorStreamCaptureInvalidated = 901, /* the capture broke earlier (see the k3emu line) */
    cudaErrorNoDevice = 100,
    cudaErrorUnknown = 999
} cudaError_t;

typedef enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
} cudaMemcpyKind;

typedef struct k3emu_stream *cudaStream_t; /* NULL = the legacy default stream */
typedef struct k3emu_event *cudaEvent_t;

#define cudaStreamDefault      0x00u
#define cudaStreamNonBlocking  0x01u
#define cudaEventDefault       0x00u
#define cudaEventBlockingSync  0x01u
#define cudaEventDisableTiming 0x02u
#define cudaHostAllocDefault   0x00u

const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);

cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);

cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaFreeHost(void *p);

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t s);
cudaError_t cudaMemcpy2D(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                         size_t height, cudaMemcpyKind kind);
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind, cudaStream_t s);
cudaError_t cudaMemset(void *p, int v, size_t n);
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s);

cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);

cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

/* CUDA graphs (emu_graph.cpp): stream capture records, a graph launch replays. One stream per
 * capture (no fork/join through events); inside a capture, a synchronous copy or memset, a stream,
 * event or device synchronize or query, and an allocation or free are errors
 * (cudaErrorStreamCaptureUnsupported, with a k3emu line naming the call) that invalidate it, as on
 * CUDA in global mode (ThreadLocal: only calls from the capturing thread; Relaxed: none). */
typedef enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2
} cudaStreamCaptureMode;
typedef enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2
} cudaStreamCaptureStatus;
typedef struct k3emu_graph *cudaGraph_t;
typedef struct k3emu_graph_exec *cudaGraphExec_t;
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph,
                                 unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
/* Emulation only: enqueue host work fn(data) on s. Outside a capture it runs now and drop(data)
 * follows (drop may be NULL); inside one it becomes a node run at each launch of the graph, data
 * owned by the graph (dropped with its last graph or exec). The NCCL stand-in records its groups
 * this way, as NCCL's kernels are nodes of a captured graph. */
cudaError_t k3emu_stream_host_work(cudaStream_t s, void (*fn)(void *), void *data,
                                   void (*drop)(void *));
/* Emulation only: the graph launches this process has made. */
unsigned long long k3emu_graph_launches(void);

/* Emulation only: the launches and fiber switches this process has run (for tests and `k3
 * version`); not part of CUDA. */
typedef struct k3emu_counters {
    unsigned long long launches, blocks, threads, switches;
} k3emu_counters;
void k3emu_get_counters(k3emu_counters *out);
/* Emulation only: the warp-level mma instructions (k3c_mma.cuh) run so far by the kernel whose
 * launch named `kernel` (K3C_LAUNCH's kernel expression, e.g. "matmul_kernel<8>"), or by every
 * kernel when kernel is NULL. */
unsigned long long k3emu_mma_count(const char *kernel);
/* Emulation only: the order seed (as K3_EMU_SEED): 0 runs blocks in index order and a block's
 * threads in thread order; any other value shuffles both, differently per seed and launch, so an
 * ordering race shows up as a difference between seeds. */
void k3emu_set_seed(unsigned long long seed);

/* Emulation only (test hook): 1 holds stream s's worker before its next operation, so what is
 * enqueued stays pending; 0 lets it go on. */
void k3emu_stream_pause(cudaStream_t s, int paused);
/* Emulation only: device work done by the host itself (the NCCL stand-in's MPI transfers of
 * device buffers): open waits for every stream, then holds the device with its memory range
 * readable until the matching close (nested pairs on one thread count). */
void k3emu_device_open(void);
void k3emu_device_close(void);

#ifdef __cplusplus
}
#endif

#endif /* K3_EMU_CUDA_RUNTIME_API_H */
