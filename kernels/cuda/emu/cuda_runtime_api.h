/* cuda_runtime_api.h — k3's CUDA emulation (K3_CUDA_EMULATE builds only): the subset of the CUDA
 * runtime API that kernels/cuda and comm/comm_nccl.c use, with the real names, signatures and
 * error codes, implemented on the host by emu_runtime.cpp. This folder is first on the include
 * path of an emulation build, so it shadows the toolkit's header; C and C++ include it alike.
 *
 * The model: one emulated device per process (K3_EMU_DEVICES changes the count); device memory is
 * host memory (256-byte aligned, each allocation its own heap block, so ASan sees every
 * out-of-bounds access); every stream operation (copies, memsets, kernel launches) runs to
 * completion inside the call that enqueues it, so stream order, and the order between streams,
 * hold trivially. Errors are sticky per thread as on the device: a failed launch is returned by
 * the next cudaGetLastError. Kernels: cuda_runtime.h (C++ only) and k3emu_device.h. */
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
    cudaErrorNotReady = 600,
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

#ifdef __cplusplus
}
#endif

#endif /* K3_EMU_CUDA_RUNTIME_API_H */
